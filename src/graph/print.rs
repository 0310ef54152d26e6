//! The canonical text form of a graph: one line per node, stable across runs (no addresses,
//! no hash order), so two compiler versions can be diffed.

use std::fmt::{self, Write};

use super::{Cost, Dims, Epilogue, Graph, Node, Op, Rows, Shape};

fn shape(s: &Shape) -> String {
    match s.rows {
        Rows::Tokens => format!("[T,{}]", s.cols),
        Rows::Sequences => format!("[S,{}]", s.cols),
    }
}

/// The op with its parameters, e.g. `matmul(norm, q+k+v)`.
pub fn op_text(n: &Node) -> String {
    let mut s = String::from(n.op.name());
    match &n.op {
        Op::Embed { table, .. } => {
            let _ = write!(s, "({table})");
        }
        Op::RmsNorm(norm) => {
            let _ = write!(
                s,
                "(eps={:e}{})",
                norm.eps,
                if norm.weight.is_some() { ", w" } else { "" }
            );
        }
        Op::MatMul {
            linears,
            norm,
            epilogue,
        } => {
            let names: Vec<String> = linears
                .iter()
                .map(|l| {
                    format!(
                        "{}[{}x{}]{}",
                        l.weight,
                        l.out,
                        l.inp,
                        if l.bias.is_some() { "+b" } else { "" }
                    )
                })
                .collect();
            let _ = write!(s, "({}", names.join(" | "));
            if let Some(nm) = norm {
                let _ = write!(
                    s,
                    "; norm eps={:e}{}",
                    nm.eps,
                    if nm.weight.is_some() { " w" } else { "" }
                );
            }
            match epilogue {
                Epilogue::None => {}
                Epilogue::ResidualAdd => s.push_str("; +residual"),
                Epilogue::Activation(a) => {
                    let _ = write!(s, "; {a:?}");
                }
                Epilogue::Gated(a) => {
                    let _ = write!(s, "; gated {a:?}");
                }
            }
            s.push(')');
        }
        Op::HeadNorm {
            heads,
            head_dim,
            eps,
            scale,
            weight,
        } => {
            let _ = write!(s, "({heads}x{head_dim}, eps={eps:e}");
            if *scale != 1.0 {
                let _ = write!(s, ", scale={scale}");
            }
            if let Some(w) = weight {
                let _ = write!(s, ", weight={w}");
            }
            s.push(')');
        }
        Op::Combine { a, b } => {
            let _ = write!(s, "({a}·x + {b}·y)");
        }
        Op::GatedValueAdd {
            gate,
            channels,
            kv_heads,
            head_dim,
            scale,
        } => {
            let _ = write!(
                s,
                "({gate}[{kv_heads}x{channels}], {kv_heads}x{head_dim}, scale={scale})"
            );
        }
        Op::Smear {
            gate,
            lambda,
            channels,
        } => {
            let _ = write!(s, "({gate}[{channels}], lambda={lambda})");
        }
        Op::Rope {
            heads,
            head_dim,
            local,
        } => {
            let _ = write!(s, "({heads}x{head_dim}");
            if *local {
                s.push_str(", local");
            }
            s.push(')');
        }
        Op::Attention {
            layer,
            heads,
            kv_heads,
            head_dim,
            scale,
            window,
        } => {
            let _ = write!(s, "(layer={layer}, heads={heads}, kv_heads={kv_heads}, head_dim={head_dim}, scale={scale}");
            if let Some(w) = window {
                let _ = write!(s, ", window={w}");
            }
            s.push(')');
        }
        Op::Act(a) => {
            let _ = write!(s, "({a:?})");
        }
        Op::Softcap { cap } => {
            let _ = write!(s, "({cap})");
        }
        Op::TokenIds | Op::Add | Op::Mul | Op::LastRow => {}
    }
    s
}

pub(super) fn write_text(g: &Graph, f: &mut fmt::Formatter<'_>) -> fmt::Result {
    writeln!(
        f,
        "graph: {} nodes, rope theta={} style={:?}, kv {}x{}x{}",
        g.nodes.len(),
        g.rope.theta,
        g.rope.style,
        g.kv.layers,
        g.kv.kv_heads,
        g.kv.head_dim
    )?;
    for (id, n) in g.nodes.iter().enumerate() {
        let ins: Vec<String> = n
            .inputs
            .iter()
            .map(|v| format!("%{}.{}", v.node, v.port))
            .collect();
        let outs: Vec<String> = n.outputs.iter().map(shape).collect();
        writeln!(
            f,
            "%{id:<4} {:<40} = {} ({})  # {}",
            outs.join(" "),
            op_text(n),
            ins.join(", "),
            n.label
        )?;
    }
    writeln!(f, "output %{}.{}", g.output.node, g.output.port)
}

/// `1.50 MiB`-style byte counts for summaries (binary units).
pub fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}

/// `2.62 GFLOP`-style counts (decimal units).
pub fn human_flops(f: u64) -> String {
    const UNITS: [&str; 5] = ["", "K", "M", "G", "T"];
    let mut v = f as f64;
    let mut u = 0;
    while v >= 1000.0 && u + 1 < UNITS.len() {
        v /= 1000.0;
        u += 1;
    }
    if u == 0 {
        format!("{f} FLOP")
    } else {
        format!("{v:.2} {}FLOP", UNITS[u])
    }
}

/// The canonical text with two more columns, bytes moved and flops of each node for one step
/// of the given dimensions, and their totals. Deterministic like [`Graph`]'s `Display`.
pub fn write_text_with_cost(g: &Graph, dims: &Dims, f: &mut impl Write) -> fmt::Result {
    writeln!(
        f,
        "graph: {} nodes, rope theta={} style={:?}, kv {}x{}x{}",
        g.nodes.len(),
        g.rope.theta,
        g.rope.style,
        g.kv.layers,
        g.kv.kv_heads,
        g.kv.head_dim
    )?;
    writeln!(
        f,
        "costs for tokens={} sequences={} context={}",
        dims.tokens, dims.sequences, dims.context
    )?;
    writeln!(
        f,
        "{:<6} {:<24} {:>12} {:>14}  op (inputs)  # label",
        "node", "shape", "bytes", "flops"
    )?;
    let mut total = Cost::default();
    for (id, n) in g.nodes.iter().enumerate() {
        let c = n.cost(g, dims);
        total = total + c;
        let ins: Vec<String> = n
            .inputs
            .iter()
            .map(|v| format!("%{}.{}", v.node, v.port))
            .collect();
        let outs: Vec<String> = n.outputs.iter().map(shape).collect();
        writeln!(
            f,
            "%{id:<5} {:<24} {:>12} {:>14}  {} ({})  # {}",
            outs.join(" "),
            c.bytes,
            c.flops,
            op_text(n),
            ins.join(", "),
            n.label
        )?;
    }
    writeln!(f, "output %{}.{}", g.output.node, g.output.port)?;
    writeln!(
        f,
        "total: {} bytes ({}), {} flops ({}), {:.2} flop/byte",
        total.bytes,
        human_bytes(total.bytes),
        total.flops,
        human_flops(total.flops),
        total.flops as f64 / total.bytes.max(1) as f64
    )
}

/// The shape as the text form writes it: `[T,576]` (token rows) or `[S,576]` (sequence rows).
pub fn shape_text(s: &Shape) -> String {
    shape(s)
}

//! What the compiler made of a model, stage by stage: the graph as built, after each pass, and
//! the execution plan. Every stage renders as canonical text (with bytes and flops per node for
//! stated dimensions), Graphviz or JSON, deterministically — no addresses, times or hash order —
//! so two compiler versions can be diffed. `kiln-dump` is a thin layer over [`dump`].
//!
//! The dumped graph is the one generation runs: logits for the last row of each sequence
//! ([`LogitRows::Last`]), shared by the prefill and decode plans.

use std::fmt::Write;

use serde::Serialize;

use crate::graph::build::{build_graph, LogitRows};
use crate::graph::passes::{default_pipeline, run_pipeline};
use crate::graph::{op_text, shape_text, write_text_with_cost, Cost, Dims, Graph};
use crate::model::{LoadError, Model};
use crate::plan::{ExecutionPlan, Operand, Phase};

/// Which stages to dump.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    All,
    /// The graph as the architecture builder made it, before any pass.
    Graph,
    /// The graph after each pass of the default pipeline.
    Passes,
    /// The execution plan lowered from the optimised graph.
    Plan,
    /// The decode plan lowered to a `DecodeProgram` and its tile schedule (batch 1).
    Megakernel,
    /// The CUDA C source generated for that program: what the GPU compiles and runs (run on an
    /// H200, docs/gpu-results.md).
    Cuda,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Text,
    Dot,
    Json,
}

impl Format {
    pub fn ext(self) -> &'static str {
        match self {
            Format::Text => "txt",
            Format::Dot => "dot",
            Format::Json => "json",
        }
    }
}

#[derive(Clone, Copy, Debug)]
pub struct DumpOptions {
    pub stage: Stage,
    pub format: Format,
    /// The phase whose dimensions the costs use and whose plan is dumped.
    pub phase: Phase,
    /// Decode: one sequence of one token attending over this many cached positions.
    pub context: usize,
    /// Prefill: one sequence of this many tokens.
    pub tokens: usize,
}

impl Default for DumpOptions {
    fn default() -> Self {
        DumpOptions {
            stage: Stage::All,
            format: Format::Text,
            phase: Phase::Decode,
            context: 512,
            tokens: 512,
        }
    }
}

impl DumpOptions {
    /// The step the costs are for: decode batch 1 at `context`, or prefill of `tokens`.
    pub fn dims(&self) -> Dims {
        match self.phase {
            Phase::Decode => Dims::decode(1, self.context),
            Phase::Prefill => Dims::prefill(self.tokens),
        }
    }
}

/// One stage's rendering; `name` has no extension (`00-graph`, `plan-decode`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DumpFile {
    pub name: String,
    pub ext: &'static str,
    pub contents: String,
}

impl DumpFile {
    pub fn file_name(&self) -> String {
        format!("{}.{}", self.name, self.ext)
    }
}

/// Renders the requested stages of `model`'s compilation, in pipeline order.
pub fn dump(model: &Model, opts: &DumpOptions) -> Result<Vec<DumpFile>, LoadError> {
    let dims = opts.dims();
    let mut g = build_graph(&model.config, &model.weights, LogitRows::Last)?;
    let mut files = Vec::new();
    let want = |s: Stage| opts.stage == Stage::All || opts.stage == s;
    if want(Stage::Graph) {
        files.push(render_graph(
            "00-graph",
            "before passes",
            &g,
            &dims,
            opts.format,
        ));
    }
    let passes = default_pipeline();
    let mut i = 0;
    run_pipeline(&mut g, &passes, |pass, graph| {
        i += 1;
        if want(Stage::Passes) {
            let name = format!("{i:02}-after-{pass}");
            files.push(render_graph(
                &name,
                &format!("after {pass}"),
                graph,
                &dims,
                opts.format,
            ));
        }
    });
    if want(Stage::Plan) {
        let phase = match opts.phase {
            Phase::Decode => "decode",
            Phase::Prefill => "prefill",
        };
        let plan = ExecutionPlan::lower(g.clone(), opts.phase);
        files.push(render_plan(
            &format!("plan-{phase}"),
            &plan,
            &dims,
            opts.format,
        ));
    }
    // The program, its schedule and CUDA C have a text form only.
    if (want(Stage::Megakernel) || want(Stage::Cuda)) && opts.format == Format::Text {
        files.extend(render_megakernel(&g, opts.stage));
    }
    Ok(files)
}

/// The megakernel stages: the program with its schedule, and the generated source. A model
/// whose decode plan uses ops the lowering does not cover yet gets a stage that says which.
fn render_megakernel(g: &crate::graph::Graph, stage: Stage) -> Vec<DumpFile> {
    use crate::backend::cuda::megakernel::generate;
    let plan = ExecutionPlan::lower(g.clone(), Phase::Decode);
    let both = stage == Stage::All;
    let mut out = Vec::new();
    match generate(&plan, 1) {
        Ok(mk) => {
            if both || stage == Stage::Megakernel {
                let mut s = String::from("# megakernel-program (decode, batch 1)\n");
                for (i, ins) in mk.program.instrs.iter().enumerate() {
                    let _ = writeln!(s, "i{i}: {ins:?}");
                }
                let _ = write!(s, "{}", mk.schedule);
                out.push(DumpFile {
                    name: "megakernel-program".into(),
                    ext: "txt",
                    contents: s,
                });
            }
            if both || stage == Stage::Cuda {
                out.push(DumpFile {
                    name: "megakernel".into(),
                    ext: "cu",
                    contents: mk.source,
                });
            }
        }
        Err(e) => out.push(DumpFile {
            name: "megakernel-program".into(),
            ext: "txt",
            contents: format!("# megakernel-program\nnot lowered: {e}\n"),
        }),
    }
    out
}

/// Joins the files for one stream: text and DOT with a `==> name <==` line before each stage
/// (a `//` comment in DOT), JSON as one array of the stages' objects.
pub fn concat(files: &[DumpFile], format: Format) -> String {
    let mut out = String::new();
    match format {
        Format::Json => {
            out.push_str("[\n");
            for (i, f) in files.iter().enumerate() {
                out.push_str(f.contents.trim_end());
                out.push_str(if i + 1 < files.len() { ",\n" } else { "\n" });
            }
            out.push_str("]\n");
        }
        Format::Text | Format::Dot => {
            let prefix = if format == Format::Dot { "// " } else { "" };
            for (i, f) in files.iter().enumerate() {
                if i > 0 {
                    out.push('\n');
                }
                let _ = writeln!(out, "{prefix}==> {} <==", f.file_name());
                out.push_str(&f.contents);
            }
        }
    }
    out
}

#[derive(Serialize)]
struct NodeCost<'a> {
    id: usize,
    op: &'static str,
    text: String,
    label: &'a str,
    shapes: Vec<String>,
    bytes: u64,
    flops: u64,
}

#[derive(Serialize)]
struct GraphJson<'a> {
    stage: &'a str,
    dims: &'a Dims,
    total: Cost,
    costs: Vec<NodeCost<'a>>,
    graph: &'a Graph,
}

#[derive(Serialize)]
struct PlanJson<'a> {
    stage: &'a str,
    dims: &'a Dims,
    total: Cost,
    buffer_bytes: usize,
    peak_live_bytes: usize,
    peak_at_instruction: usize,
    plan: &'a ExecutionPlan,
}

fn render_graph(name: &str, what: &str, g: &Graph, dims: &Dims, format: Format) -> DumpFile {
    let contents = match format {
        Format::Text => {
            let mut s = format!("# {name}: {what}\n");
            write_text_with_cost(g, dims, &mut s).expect("writing to a String");
            s
        }
        Format::Dot => graph_dot(g, name, |_| None),
        Format::Json => {
            let costs = g
                .nodes
                .iter()
                .enumerate()
                .map(|(id, n)| {
                    let c = n.cost(g, dims);
                    NodeCost {
                        id,
                        op: n.op.name(),
                        text: op_text(n),
                        label: &n.label,
                        shapes: n.outputs.iter().map(shape_text).collect(),
                        bytes: c.bytes,
                        flops: c.flops,
                    }
                })
                .collect();
            let j = GraphJson {
                stage: name,
                dims,
                total: g.cost(dims),
                costs,
                graph: g,
            };
            serde_json::to_string_pretty(&j).expect("graph serialises") + "\n"
        }
    };
    DumpFile {
        name: name.to_string(),
        ext: format.ext(),
        contents,
    }
}

fn render_plan(name: &str, plan: &ExecutionPlan, dims: &Dims, format: Format) -> DumpFile {
    let contents = match format {
        Format::Text => {
            let mut s = format!("# {name}\n");
            plan.write_text_with_cost(dims, &mut s)
                .expect("writing to a String");
            s
        }
        Format::Dot => {
            // The plan's graph, each node also labelled with its instruction and output slots.
            let mut at = vec![None; plan.graph.nodes.len()];
            for (i, ins) in plan.instrs.iter().enumerate() {
                let slots: Vec<String> = ins
                    .outputs
                    .iter()
                    .map(|s| format!("b{}[{}..{}]", s.buffer, s.col, s.col + s.cols))
                    .collect();
                let ins_txt = if ins.inputs.contains(&Operand::Tokens) {
                    " (tokens)"
                } else {
                    ""
                };
                at[ins.node] = Some(format!(
                    "#{i} -> {}{ins_txt}{}",
                    slots.join(", "),
                    if ins.in_place { " in-place" } else { "" }
                ));
            }
            graph_dot(&plan.graph, name, |id| at[id].clone())
        }
        Format::Json => {
            let (peak, at) = plan.peak_live_bytes(dims.tokens, dims.sequences);
            let j = PlanJson {
                stage: name,
                dims,
                total: plan.cost(dims),
                buffer_bytes: plan.buffer_bytes(dims.tokens, dims.sequences),
                peak_live_bytes: peak,
                peak_at_instruction: at,
                plan,
            };
            serde_json::to_string_pretty(&j).expect("plan serialises") + "\n"
        }
    };
    DumpFile {
        name: name.to_string(),
        ext: format.ext(),
        contents,
    }
}

fn dot_escape(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"")
}

/// Graphviz for a graph: one box per node labelled with its op, output shapes and label (plus
/// `extra(node)` if given), one edge per value read, labelled with the output port when a node
/// has several.
pub fn graph_dot(g: &Graph, name: &str, extra: impl Fn(usize) -> Option<String>) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "digraph \"{}\" {{", dot_escape(name));
    s.push_str("  rankdir=TB;\n  node [shape=box, fontname=\"monospace\", fontsize=10];\n");
    s.push_str("  edge [fontname=\"monospace\", fontsize=9];\n");
    for (id, n) in g.nodes.iter().enumerate() {
        let shapes: Vec<String> = n.outputs.iter().map(shape_text).collect();
        let mut label = format!(
            "%{id} {}\\n{}\\n{}",
            dot_escape(&op_text(n)),
            shapes.join(" "),
            dot_escape(&n.label)
        );
        if let Some(e) = extra(id) {
            label.push_str("\\n");
            label.push_str(&dot_escape(&e));
        }
        let _ = writeln!(s, "  n{id} [label=\"{label}\"];");
    }
    for (id, n) in g.nodes.iter().enumerate() {
        for v in &n.inputs {
            if g.nodes[v.node].outputs.len() > 1 {
                let _ = writeln!(s, "  n{} -> n{id} [label=\"{}\"];", v.node, v.port);
            } else {
                let _ = writeln!(s, "  n{} -> n{id};", v.node);
            }
        }
    }
    let _ = writeln!(
        s,
        "  out [shape=oval, label=\"output\"];\n  n{} -> out;",
        g.output.node
    );
    s.push_str("}\n");
    s
}

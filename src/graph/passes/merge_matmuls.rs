//! Matmuls that read the same input with the same prologue (q/k/v, gate/up) become one matmul
//! with several outputs: one pass over the input, one parallel region, one packed weight.

use super::Pass;
use crate::graph::{Epilogue, Graph, Op, Value};

pub struct MergeSiblingMatMuls;

impl Pass for MergeSiblingMatMuls {
    fn name(&self) -> &'static str {
        "merge-sibling-matmuls"
    }

    fn run(&self, g: &mut Graph) -> bool {
        let mut changed = false;
        for first in 0..g.nodes.len() {
            let Some(key) = merge_key(g, first) else {
                continue;
            };
            let siblings: Vec<usize> = ((first + 1)..g.nodes.len())
                .filter(|&s| merge_key(g, s).as_ref() == Some(&key))
                .collect();
            if siblings.is_empty() {
                continue;
            }
            for s in siblings {
                let moved = std::mem::replace(
                    &mut g.nodes[s].op,
                    Op::MatMul {
                        linears: vec![],
                        norm: None,
                        epilogue: Epilogue::None,
                    },
                );
                let Op::MatMul { linears, .. } = moved else {
                    unreachable!()
                };
                let base = g.nodes[first].outputs.len();
                let outs = std::mem::take(&mut g.nodes[s].outputs);
                for port in 0..outs.len() {
                    g.replace_uses(Value::new(s, port), Value::new(first, base + port));
                }
                g.nodes[first].outputs.extend(outs);
                if let Op::MatMul { linears: l, .. } = &mut g.nodes[first].op {
                    l.extend(linears);
                }
                let label = format!(
                    "{}+{}",
                    g.nodes[first].label,
                    short_label(&g.nodes[s].label)
                );
                g.nodes[first].label = label;
                g.nodes[s].inputs.clear();
            }
            changed = true;
        }
        changed
    }
}

/// The last dotted component of a label (`layers.0.attn.k` → `k`).
fn short_label(l: &str) -> &str {
    l.rsplit('.').next().unwrap_or(l)
}

/// Identity of what a matmul reads; equal keys may merge. Only plain matmuls with one output
/// per linear take part.
fn merge_key(g: &crate::graph::Graph, id: usize) -> Option<(Value, String)> {
    let n = &g.nodes[id];
    match &n.op {
        Op::MatMul {
            linears,
            norm,
            epilogue: Epilogue::None,
        } if !linears.is_empty() && n.inputs.len() == 1 && n.outputs.len() == linears.len() => {
            Some((n.inputs[0], format!("{norm:?}")))
        }
        _ => None,
    }
}

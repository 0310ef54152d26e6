//! RMSNorm whose every reader is a matmul becomes those matmuls' input prologue: the normalised
//! row never round-trips through memory and the plan loses an instruction per norm.

use super::Pass;
use crate::graph::{Graph, Op, Value};

pub struct FuseNormIntoMatMul;

impl Pass for FuseNormIntoMatMul {
    fn name(&self) -> &'static str {
        "fuse-norm-into-matmul"
    }

    fn run(&self, g: &mut Graph) -> bool {
        let mut changed = false;
        for id in 0..g.nodes.len() {
            let Op::RmsNorm(norm) = &g.nodes[id].op else {
                continue;
            };
            let norm = norm.clone();
            let out = Value::new(id, 0);
            if g.output == out {
                continue;
            }
            let uses = g.uses(out);
            let fusable = !uses.is_empty()
                && uses.iter().all(|&(u, i)| {
                    i == 0 && matches!(&g.nodes[u].op, Op::MatMul { norm: None, .. })
                });
            if !fusable {
                continue;
            }
            let input = g.nodes[id].inputs[0];
            for (u, _) in uses {
                if let Op::MatMul { norm: n, .. } = &mut g.nodes[u].op {
                    *n = Some(norm.clone());
                }
                g.nodes[u].inputs[0] = input;
            }
            changed = true;
        }
        changed
    }
}

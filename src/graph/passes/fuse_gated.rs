//! `act(x W_gate) · (x W_up)` (SwiGLU) computed by the merged gate/up matmul itself, so the two
//! intermediate activations are never stored.

use super::Pass;
use crate::graph::{Epilogue, Graph, Op, Value};

pub struct FuseGatedActivation;

impl Pass for FuseGatedActivation {
    fn name(&self) -> &'static str {
        "fuse-gated-activation"
    }

    fn run(&self, g: &mut Graph) -> bool {
        let mut changed = false;
        for mul in 0..g.nodes.len() {
            if g.nodes[mul].op != Op::Mul {
                continue;
            }
            let (a, b) = (g.nodes[mul].inputs[0], g.nodes[mul].inputs[1]);
            let Op::Act(act) = g.nodes[a.node].op else {
                continue;
            };
            let gate = g.nodes[a.node].inputs[0];
            let mm = gate.node;
            let ok = gate.port == 0
                && b == Value::new(mm, 1)
                && matches!(&g.nodes[mm].op, Op::MatMul { linears, epilogue: Epilogue::None, .. }
                    if linears.len() == 2 && linears[0].out == linears[1].out)
                && g.uses(gate).len() == 1
                && g.uses(b).len() == 1
                && g.uses(a).len() == 1;
            if !ok {
                continue;
            }
            if let Op::MatMul { epilogue, .. } = &mut g.nodes[mm].op {
                *epilogue = Epilogue::Gated(act);
            }
            g.nodes[mm].outputs.truncate(1);
            g.replace_uses(Value::new(mul, 0), Value::new(mm, 0));
            g.nodes[mul].inputs.clear();
            g.nodes[a.node].inputs.clear();
            changed = true;
        }
        changed
    }
}

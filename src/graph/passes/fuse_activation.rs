//! An activation applied to a matmul's only output runs in the matmul's epilogue (nanochat's
//! relu², applied while the row is still in registers).

use super::Pass;
use crate::graph::{Epilogue, Graph, Op, Value};

pub struct FuseActivation;

impl Pass for FuseActivation {
    fn name(&self) -> &'static str {
        "fuse-activation"
    }

    fn run(&self, g: &mut Graph) -> bool {
        let mut changed = false;
        for id in 0..g.nodes.len() {
            let Op::Act(act) = g.nodes[id].op else {
                continue;
            };
            let src = g.nodes[id].inputs[0];
            let ok = matches!(&g.nodes[src.node].op, Op::MatMul { linears, epilogue: Epilogue::None, .. } if linears.len() == 1)
                && g.uses(src).len() == 1
                && g.output != src;
            if !ok {
                continue;
            }
            if let Op::MatMul { epilogue, .. } = &mut g.nodes[src.node].op {
                *epilogue = Epilogue::Activation(act);
            }
            g.replace_uses(Value::new(id, 0), src);
            g.nodes[id].inputs.clear();
            changed = true;
        }
        changed
    }
}

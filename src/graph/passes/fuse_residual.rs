//! `residual + x Wᵀ` becomes the matmul's epilogue; the plan can then accumulate straight into
//! the residual stream's buffer, so the stream stays in place across layers.

use super::Pass;
use crate::graph::{Epilogue, Graph, Op, Value};

pub struct FuseResidualAdd;

impl Pass for FuseResidualAdd {
    fn name(&self) -> &'static str {
        "fuse-residual-add"
    }

    fn run(&self, g: &mut Graph) -> bool {
        let mut changed = false;
        for add in 0..g.nodes.len() {
            if g.nodes[add].op != Op::Add {
                continue;
            }
            let ins = g.nodes[add].inputs.clone();
            for (mm_side, res_side) in [(0, 1), (1, 0)] {
                let (m, r) = (ins[mm_side], ins[res_side]);
                let ok = m.port == 0
                    && r.node < m.node
                    && g.shape(m) == g.shape(r)
                    && matches!(&g.nodes[m.node].op, Op::MatMul { linears, epilogue: Epilogue::None, .. } if linears.len() == 1)
                    && g.nodes[m.node].inputs.len() == 1
                    && g.uses(m).len() == 1
                    && g.output != m;
                if !ok {
                    continue;
                }
                if let Op::MatMul { epilogue, .. } = &mut g.nodes[m.node].op {
                    *epilogue = Epilogue::ResidualAdd;
                }
                g.nodes[m.node].inputs.push(r);
                g.replace_uses(Value::new(add, 0), m);
                g.nodes[add].inputs.clear();
                changed = true;
                break;
            }
        }
        changed
    }
}

use super::*;
use crate::graph::test_graphs::{embed, graph, matmul, rms_norm};
use crate::graph::{Activation, Graph, Op, Rows, Shape};

/// A two-layer residual MLP stack, the shape whose buffers a plan must juggle.
fn tiny_graph() -> Graph {
    let mut g = graph(0, 1);
    let mut x = embed(&mut g);
    for l in 0..2 {
        let h = rms_norm(&mut g, x, &format!("{l}.norm"));
        let gt = matmul(&mut g, "gate", 16, h);
        let up = matmul(&mut g, "up", 16, h);
        let a = g.push1(Op::Act(Activation::Silu), vec![gt], 16, "silu");
        let m = g.push1(Op::Mul, vec![a, up], 16, "mul");
        let d = matmul(&mut g, "down", 8, m);
        x = g.push1(Op::Add, vec![x, d], 8, "residual");
    }
    let last = g.push1(Op::LastRow, vec![x], 8, "last");
    assert_eq!(
        g.shape(last),
        Shape {
            rows: Rows::Sequences,
            cols: 8
        }
    );
    g.output = last;
    g
}

/// Simulates the plan and checks every instruction reads the values it expects: no buffer is
/// reused while a value in it is still to be read.
pub(crate) fn check_no_clobber(plan: &ExecutionPlan) {
    use std::collections::HashMap;
    // (buffer, col) -> node whose value occupies it
    let mut owner: HashMap<(usize, usize), usize> = HashMap::new();
    let mut slot_of_value: HashMap<(usize, usize), Slot> = HashMap::new();
    for ins in &plan.instrs {
        let node = &plan.graph.nodes[ins.node];
        for (v, o) in node.inputs.iter().zip(&ins.inputs) {
            if let Operand::Slot(s) = o {
                assert_eq!(
                    slot_of_value.get(&(v.node, v.port)),
                    Some(s),
                    "{}: input slot mismatch",
                    ins.label
                );
                for c in s.col..s.col + s.cols {
                    assert_eq!(
                        owner.get(&(s.buffer, c)),
                        Some(&v.node),
                        "{}: input {:?} was clobbered",
                        ins.label,
                        v
                    );
                }
            }
        }
        for (p, s) in ins.outputs.iter().enumerate() {
            for c in s.col..s.col + s.cols {
                owner.insert((s.buffer, c), ins.node);
            }
            slot_of_value.insert((ins.node, p), *s);
        }
    }
    let out = plan.graph.output;
    assert_eq!(slot_of_value.get(&(out.node, out.port)), Some(&plan.output));
}

#[test]
fn buffers_are_reused_and_never_clobbered() {
    let mut g = tiny_graph();
    let unfused = ExecutionPlan::lower(g.clone(), Phase::Prefill);
    check_no_clobber(&unfused);
    // 16 instructions, at most 5 values live at once: reuse keeps buffers near that.
    assert!(unfused.buffers.len() <= 7, "{unfused}");

    crate::graph::passes::optimize(&mut g);
    let plan = ExecutionPlan::lower(g, Phase::Decode);
    check_no_clobber(&plan);
    let text = plan.to_string();
    // norm fused into gate/up, gate+up merged and gated, down accumulates into the residual.
    assert!(text.contains("gated Silu"), "{text}");
    assert!(text.contains("+residual"), "{text}");
    assert!(plan.instrs.iter().any(|i| i.in_place), "{text}");
    assert_eq!(plan.instrs.len(), 1 + 2 * 2 + 1, "{text}");
}

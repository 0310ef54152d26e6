//! The canonical text form of a plan: instructions with their buffer slots, then buffers with
//! liveness. Deterministic, for diffing and snapshot tests.

use std::fmt::{self, Display};

use super::{ExecutionPlan, Operand, Slot};
use crate::graph::Rows;

fn slot(s: &Slot) -> String {
    format!("b{}[{}..{}]", s.buffer, s.col, s.col + s.cols)
}

impl Display for ExecutionPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "plan {:?}: {} instructions, {} buffers",
            self.phase,
            self.instrs.len(),
            self.buffers.len()
        )?;
        for (i, ins) in self.instrs.iter().enumerate() {
            let ins_txt: Vec<String> = ins
                .inputs
                .iter()
                .map(|o| match o {
                    Operand::Tokens => "tokens".to_string(),
                    Operand::Slot(s) => slot(s),
                })
                .collect();
            let outs: Vec<String> = ins.outputs.iter().map(slot).collect();
            let node = &self.graph.nodes[ins.node];
            writeln!(
                f,
                "{i:>4}: {} = {}({}){}  # {}",
                outs.join(", "),
                crate::graph::op_text(node),
                ins_txt.join(", "),
                if ins.in_place { " in-place" } else { "" },
                ins.label
            )?;
        }
        for (i, b) in self.buffers.iter().enumerate() {
            let rows = match b.rows {
                Rows::Tokens => "T",
                Rows::Sequences => "S",
            };
            let ranges: Vec<String> = b
                .live_ranges
                .iter()
                .map(|(a, z)| format!("{a}-{z}"))
                .collect();
            writeln!(f, "  b{i}: [{rows},{}] live {}", b.cols, ranges.join(" "))?;
        }
        writeln!(f, "output {}", slot(&self.output))
    }
}

//! The canonical text form of a plan: instructions with their buffer slots, then buffers with
//! liveness. Deterministic, for diffing and snapshot tests.

use std::fmt::{self, Display, Write};

use super::{ExecutionPlan, Operand, Slot};
use crate::graph::{human_bytes, human_flops, op_text, Cost, Dims, Rows};

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

impl ExecutionPlan {
    /// The canonical text plus, for one step of the given dimensions, each instruction's bytes
    /// and flops, each buffer's size, the peak of live activation bytes and the totals.
    pub fn write_text_with_cost(&self, dims: &Dims, f: &mut impl Write) -> fmt::Result {
        writeln!(
            f,
            "plan {:?}: {} instructions, {} buffers",
            self.phase,
            self.instrs.len(),
            self.buffers.len()
        )?;
        writeln!(
            f,
            "costs for tokens={} sequences={} context={}",
            dims.tokens, dims.sequences, dims.context
        )?;
        writeln!(
            f,
            "{:>4}  {:>12} {:>14}  outputs = op(inputs)  # label",
            "#", "bytes", "flops"
        )?;
        let mut total = Cost::default();
        for (i, ins) in self.instrs.iter().enumerate() {
            let node = &self.graph.nodes[ins.node];
            let c = node.cost(&self.graph, dims);
            total = total + c;
            let ins_txt: Vec<String> = ins
                .inputs
                .iter()
                .map(|o| match o {
                    Operand::Tokens => "tokens".to_string(),
                    Operand::Slot(s) => slot(s),
                })
                .collect();
            let outs: Vec<String> = ins.outputs.iter().map(slot).collect();
            writeln!(
                f,
                "{i:>4}  {:>12} {:>14}  {} = {}({}){}  # {}",
                c.bytes,
                c.flops,
                outs.join(", "),
                op_text(node),
                ins_txt.join(", "),
                if ins.in_place { " in-place" } else { "" },
                ins.label
            )?;
        }
        writeln!(
            f,
            "buffers (bytes for this step; live = instruction ranges holding a value):"
        )?;
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
            writeln!(
                f,
                "  b{i}: [{rows},{}] {} bytes, live {}",
                b.cols,
                self.buffer_bytes_of(i, dims.tokens, dims.sequences),
                ranges.join(" ")
            )?;
        }
        writeln!(f, "output {}", slot(&self.output))?;
        let all = self.buffer_bytes(dims.tokens, dims.sequences) as u64;
        let (peak, at) = self.peak_live_bytes(dims.tokens, dims.sequences);
        writeln!(f, "activation buffers: {all} bytes ({})", human_bytes(all))?;
        writeln!(
            f,
            "peak live activations: {peak} bytes ({}) at instruction {at}",
            human_bytes(peak as u64)
        )?;
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
}

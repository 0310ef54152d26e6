//! Execution plans: the optimised graph as an ordered list of instructions over numbered
//! buffers. A buffer is reused as soon as every value in it is dead, and a residual-add matmul
//! accumulates into its residual's buffer when that value dies there, so the residual stream
//! lives in one buffer for the whole forward pass.

mod compile;
mod print;

use serde::Serialize;

pub use compile::{compile_graph, PlanKind};

use crate::graph::{Dims, Epilogue, Graph, NodeId, Op, Rows, Value};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Phase {
    /// Many tokens of one sequence (matrix-matrix work).
    Prefill,
    /// One token per sequence (matrix-vector work).
    Decode,
}

/// A column range of a buffer. Rows of a buffer are `cols` apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Slot {
    pub buffer: usize,
    pub col: usize,
    pub cols: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Operand {
    /// The step's token ids.
    Tokens,
    Slot(Slot),
}

impl Operand {
    pub fn slot(&self) -> Option<Slot> {
        match self {
            Operand::Slot(s) => Some(*s),
            Operand::Tokens => None,
        }
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct Instr {
    pub node: NodeId,
    pub op: Op,
    pub label: String,
    pub inputs: Vec<Operand>,
    pub outputs: Vec<Slot>,
    /// The output is the residual input's own slot (`ResidualAdd` accumulating in place).
    pub in_place: bool,
}

#[derive(Clone, Debug, Serialize)]
pub struct BufferDesc {
    pub rows: Rows,
    pub cols: usize,
    /// Instructions between which the buffer holds a live value, inclusive (for dumps).
    pub live_ranges: Vec<(usize, usize)>,
}

#[derive(Clone, Debug, Serialize)]
pub struct ExecutionPlan {
    pub phase: Phase,
    pub graph: Graph,
    pub instrs: Vec<Instr>,
    pub buffers: Vec<BufferDesc>,
    pub output: Slot,
}

impl ExecutionPlan {
    /// Lowers an (optimised) graph.
    pub fn lower(graph: Graph, phase: Phase) -> ExecutionPlan {
        let n = graph.nodes.len();
        // Index of the instruction that reads each node's outputs last.
        let mut last_use = vec![0usize; n];
        for (id, node) in graph.nodes.iter().enumerate() {
            for v in &node.inputs {
                last_use[v.node] = last_use[v.node].max(id);
            }
        }
        last_use[graph.output.node] = usize::MAX;

        let mut buffers: Vec<BufferDesc> = Vec::new();
        let mut live_values = Vec::<usize>::new(); // live node count per buffer
        let mut free: Vec<usize> = Vec::new();
        let mut node_buf: Vec<Option<(usize, usize)>> = vec![None; n]; // (buffer, first col)
        let mut def_at: Vec<usize> = vec![0; n];
        let mut instrs = Vec::with_capacity(n);

        let slot_of = |node_buf: &Vec<Option<(usize, usize)>>, g: &Graph, v: Value| -> Operand {
            if g.nodes[v.node].op == Op::TokenIds {
                return Operand::Tokens;
            }
            let (buffer, base) = node_buf[v.node].expect("value used before definition");
            let node = &g.nodes[v.node];
            let col = base + node.outputs[..v.port].iter().map(|s| s.cols).sum::<usize>();
            Operand::Slot(Slot {
                buffer,
                col,
                cols: node.outputs[v.port].cols,
            })
        };

        for (id, node) in graph.nodes.iter().enumerate() {
            if node.op == Op::TokenIds {
                continue;
            }
            let idx = instrs.len();
            let inputs: Vec<Operand> = node
                .inputs
                .iter()
                .map(|&v| slot_of(&node_buf, &graph, v))
                .collect();
            let width: usize = node.outputs.iter().map(|s| s.cols).sum();
            let rows = node.outputs[0].rows;

            // Accumulate into the residual's slot if that value dies here and owns its buffer.
            let mut in_place = false;
            if let Op::MatMul {
                epilogue: Epilogue::ResidualAdd,
                ..
            } = node.op
            {
                let r = node.inputs[1];
                if let Operand::Slot(s) = inputs[1] {
                    if last_use[r.node] == id
                        && live_values[s.buffer] == 1
                        && graph.nodes[r.node].outputs.len() == 1
                        && s.col == 0
                        && buffers[s.buffer].cols == width
                    {
                        node_buf[id] = Some((s.buffer, 0));
                        // The residual's value is handed over, not freed.
                        live_values[s.buffer] = 0;
                        in_place = true;
                    }
                }
            }
            if !in_place {
                let pick = free
                    .iter()
                    .enumerate()
                    .filter(|(_, &b)| buffers[b].rows == rows && buffers[b].cols >= width)
                    .min_by_key(|(_, &b)| (buffers[b].cols, b))
                    .map(|(i, _)| i);
                let b = match pick {
                    Some(i) => free.swap_remove(i),
                    None => {
                        buffers.push(BufferDesc {
                            rows,
                            cols: width,
                            live_ranges: vec![],
                        });
                        live_values.push(0);
                        buffers.len() - 1
                    }
                };
                node_buf[id] = Some((b, 0));
            }
            let (b, _) = node_buf[id].expect("just assigned");
            live_values[b] += 1;
            def_at[id] = idx;
            let outputs: Vec<Slot> = (0..node.outputs.len())
                .map(|p| match slot_of(&node_buf, &graph, Value::new(id, p)) {
                    Operand::Slot(s) => s,
                    Operand::Tokens => unreachable!(),
                })
                .collect();

            // Free inputs whose last reader is this instruction.
            let mut seen: Vec<usize> = Vec::new();
            for v in &node.inputs {
                if seen.contains(&v.node) || graph.nodes[v.node].op == Op::TokenIds {
                    continue;
                }
                seen.push(v.node);
                if last_use[v.node] == id {
                    let (vb, _) = node_buf[v.node].expect("defined");
                    buffers[vb].live_ranges.push((def_at[v.node], idx));
                    if in_place && v.node == node.inputs[1].node {
                        continue;
                    }
                    live_values[vb] -= 1;
                    if live_values[vb] == 0 {
                        free.push(vb);
                    }
                }
            }
            instrs.push(Instr {
                node: id,
                op: node.op.clone(),
                label: node.label.clone(),
                inputs,
                outputs,
                in_place,
            });
        }
        let output = match slot_of(&node_buf, &graph, graph.output) {
            Operand::Slot(s) => s,
            Operand::Tokens => panic!("graph output is its input"),
        };
        let last = instrs.len().saturating_sub(1);
        buffers[output.buffer]
            .live_ranges
            .push((def_at[graph.output.node], last));
        for b in &mut buffers {
            b.live_ranges.sort_unstable();
        }
        ExecutionPlan {
            phase,
            graph,
            instrs,
            buffers,
            output,
        }
    }

    /// Bytes of activation buffers for a step of this many token rows and sequences.
    pub fn buffer_bytes(&self, tokens: usize, sequences: usize) -> usize {
        self.buffers
            .iter()
            .map(|b| {
                let rows = match b.rows {
                    Rows::Tokens => tokens,
                    Rows::Sequences => sequences,
                };
                rows * b.cols * 4
            })
            .sum()
    }

    /// Bytes of one buffer for a step of this many token rows and sequences.
    pub fn buffer_bytes_of(&self, buffer: usize, tokens: usize, sequences: usize) -> usize {
        let b = &self.buffers[buffer];
        let rows = match b.rows {
            Rows::Tokens => tokens,
            Rows::Sequences => sequences,
        };
        rows * b.cols * 4
    }

    /// The most activation bytes live at once (over every instruction), and the instruction
    /// where that peak is first reached. Buffers count whole while any value in them is live.
    pub fn peak_live_bytes(&self, tokens: usize, sequences: usize) -> (usize, usize) {
        let mut peak = (0, 0);
        for i in 0..self.instrs.len() {
            let live: usize = (0..self.buffers.len())
                .filter(|&b| {
                    self.buffers[b]
                        .live_ranges
                        .iter()
                        .any(|&(a, z)| a <= i && i <= z)
                })
                .map(|b| self.buffer_bytes_of(b, tokens, sequences))
                .sum();
            if live > peak.0 {
                peak = (live, i);
            }
        }
        peak
    }

    /// What the plan's instructions must move and compute for one step.
    pub fn cost(&self, dims: &Dims) -> crate::graph::Cost {
        self.graph.cost(dims)
    }
}

#[cfg(test)]
mod tests;

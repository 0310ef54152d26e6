//! Bytes moved and flops per node, so every stage can report its distance from the roofline.
//! Counts are what an ideal kernel must touch: weights once per step, activations once per read
//! and write, each sequence's KV cache once per attention.

use std::ops::Add;

use serde::Serialize;

use super::{Epilogue, Graph, Node, Op, Rows};

/// Concrete sizes for one step.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Dims {
    /// Token rows in the step (batch × new tokens per sequence).
    pub tokens: usize,
    /// Sequences in the step.
    pub sequences: usize,
    /// Cached positions each sequence attends over (averaged over the step's tokens).
    pub context: usize,
}

impl Dims {
    pub fn decode(batch: usize, context: usize) -> Dims {
        Dims {
            tokens: batch,
            sequences: batch,
            context,
        }
    }

    pub fn prefill(tokens: usize) -> Dims {
        Dims {
            tokens,
            sequences: 1,
            context: tokens.div_ceil(2),
        }
    }

    fn rows(&self, r: Rows) -> usize {
        match r {
            Rows::Tokens => self.tokens,
            Rows::Sequences => self.sequences,
        }
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Cost {
    pub bytes: u64,
    pub flops: u64,
}

impl Add for Cost {
    type Output = Cost;
    fn add(self, o: Cost) -> Cost {
        Cost {
            bytes: self.bytes + o.bytes,
            flops: self.flops + o.flops,
        }
    }
}

const F32: u64 = 4;

impl Node {
    pub fn cost(&self, g: &Graph, d: &Dims) -> Cost {
        let rows_in = |i: usize| -> u64 {
            self.inputs
                .get(i)
                .map(|&v| d.rows(g.shape(v).rows) as u64)
                .unwrap_or(0)
        };
        let cols_in = |i: usize| -> u64 {
            self.inputs
                .get(i)
                .map(|&v| g.shape(v).cols as u64)
                .unwrap_or(0)
        };
        let out_elems: u64 = self
            .outputs
            .iter()
            .map(|s| (d.rows(s.rows) * s.cols) as u64)
            .sum();
        let in_elems = |i: usize| rows_in(i) * cols_in(i);
        match &self.op {
            Op::TokenIds => Cost::default(),
            Op::Embed { row_bytes, .. } => Cost {
                bytes: rows_in(0) * (*row_bytes as u64) + out_elems * F32 + rows_in(0) * 4,
                flops: 0,
            },
            Op::RmsNorm(n) => Cost {
                bytes: (in_elems(0) + out_elems) * F32
                    + n.weight.as_ref().map_or(0, |_| cols_in(0) * F32),
                flops: 3 * in_elems(0),
            },
            Op::MatMul {
                linears,
                norm,
                epilogue,
            } => {
                let rows = rows_in(0);
                let weights: u64 = linears
                    .iter()
                    .map(|l| {
                        l.weight_bytes as u64 + l.bias.as_ref().map_or(0, |_| l.out as u64 * F32)
                    })
                    .sum();
                let mac: u64 = linears.iter().map(|l| (l.out * l.inp) as u64).sum();
                let residual = if *epilogue == Epilogue::ResidualAdd {
                    in_elems(1)
                } else {
                    0
                };
                let norm_bytes = norm
                    .as_ref()
                    .and_then(|n| n.weight.as_ref())
                    .map_or(0, |_| cols_in(0) * F32);
                Cost {
                    bytes: weights + (in_elems(0) + out_elems + residual) * F32 + norm_bytes,
                    flops: 2 * rows * mac,
                }
            }
            Op::HeadNorm { .. } | Op::Rope { .. } => Cost {
                bytes: (in_elems(0) + out_elems) * F32,
                flops: 4 * in_elems(0),
            },
            Op::Attention {
                heads,
                kv_heads,
                head_dim,
                ..
            } => {
                let ctx = d.context as u64;
                let kv_row = (*kv_heads * *head_dim) as u64;
                let cache_read = d.sequences as u64 * ctx * kv_row * 2 * F32;
                let kv_write = rows_in(1) * kv_row * 2 * F32;
                Cost {
                    bytes: cache_read + kv_write + (in_elems(0) + out_elems) * F32,
                    flops: rows_in(0) * (*heads as u64) * ctx * (*head_dim as u64) * 4,
                }
            }
            Op::Add | Op::Mul | Op::Combine { .. } => Cost {
                bytes: (in_elems(0) + in_elems(1) + out_elems) * F32,
                flops: out_elems,
            },
            Op::Act(_) | Op::Softcap { .. } => Cost {
                bytes: (in_elems(0) + out_elems) * F32,
                flops: 4 * out_elems,
            },
            Op::GatedValueAdd {
                channels, kv_heads, ..
            } => Cost {
                bytes: (rows_in(0) * *channels as u64 + in_elems(1) + in_elems(2) + out_elems)
                    * F32
                    + (*channels * *kv_heads) as u64 * F32,
                flops: 2 * rows_in(0) * (*channels * *kv_heads) as u64 + 3 * out_elems,
            },
            Op::Smear { channels, .. } => Cost {
                bytes: (2 * in_elems(0) + out_elems) * F32 + *channels as u64 * F32,
                flops: 2 * rows_in(0) * *channels as u64 + 2 * out_elems,
            },
            Op::LastRow => Cost {
                bytes: 2 * out_elems * F32,
                flops: 0,
            },
        }
    }
}

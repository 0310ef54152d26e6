//! The graph IR: typed ops over a symbolic row dimension.
//!
//! Every activation is a matrix `[rows, cols]` where `cols` is fixed by the model and `rows` is
//! symbolic: all tokens of the step (`Rows::Tokens`, = batch × sequence length, unknown until
//! run time) or one row per sequence (`Rows::Sequences`, after `LastRow`). One graph therefore
//! serves prefill and decode; the plan binds the rows. Positions are not values in the graph:
//! RoPE, the KV write and the attention span read them from the step, which is what lets a GPU
//! decode step read the position from a device counter.

pub mod build;
mod cost;
pub mod passes;
mod print;
pub mod rope;
#[cfg(test)]
pub(crate) mod test_graphs;

pub use print::{human_bytes, human_flops, op_text, shape_text, write_text_with_cost};

use std::fmt;

use serde::Serialize;

pub use cost::{Cost, Dims};

use crate::model::{RopeScaling, RopeStyle};

pub type NodeId = usize;

/// One output of one node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct Value {
    pub node: NodeId,
    pub port: usize,
}

impl Value {
    pub fn new(node: NodeId, port: usize) -> Value {
        Value { node, port }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Rows {
    /// One row per token in the step.
    Tokens,
    /// One row per sequence (the last token of each).
    Sequences,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Shape {
    pub rows: Rows,
    pub cols: usize,
}

/// A linear layer: `y = x Wᵀ + b`, `W` is `[out, inp]`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Linear {
    pub weight: String,
    pub bias: Option<String>,
    pub out: usize,
    pub inp: usize,
    /// Bytes of the whole weight as stored (quantized blocks included), for cost reports.
    pub weight_bytes: usize,
}

impl Linear {
    /// Names the packed matrix of linears merged into one matmul (their weights, in order), so
    /// backends pack each distinct matrix once.
    pub fn key(linears: &[Linear]) -> String {
        linears
            .iter()
            .map(|l| l.weight.as_str())
            .collect::<Vec<_>>()
            .join("|")
    }
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Norm {
    pub weight: Option<String>,
    pub eps: f32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Activation {
    /// `x · σ(x)`
    Silu,
    /// `relu(x)²` (nanochat)
    ReluSquared,
    /// GELU with the tanh approximation (PyTorch `gelu(approximate="tanh")`, Gemma's
    /// `gelu_pytorch_tanh`): `x/2 · (1 + tanh(√(2/π)·(x + 0.044715·x³)))`.
    GeluTanh,
}

impl Activation {
    #[inline]
    pub fn apply(self, x: f32) -> f32 {
        match self {
            Activation::Silu => x / (1.0 + (-x).exp()),
            Activation::ReluSquared => {
                let r = x.max(0.0);
                r * r
            }
            Activation::GeluTanh => {
                const SQRT_2_OVER_PI: f32 = 0.797_884_6;
                0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)).tanh())
            }
        }
    }
}

/// Work fused onto the end of a matmul.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Epilogue {
    None,
    /// `out = residual + x Wᵀ`; the residual is the node's second input.
    ResidualAdd,
    /// `out = act(x Wᵀ)`.
    Activation(Activation),
    /// Two linears `[gate, up]`: `out = act(x W_gateᵀ) · (x W_upᵀ)` (SwiGLU).
    Gated(Activation),
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub enum Op {
    /// The step's token ids (the graph's one input).
    TokenIds,
    Embed {
        table: String,
        dim: usize,
        /// Bytes of one table row as stored, for cost reports.
        row_bytes: usize,
    },
    RmsNorm(Norm),
    /// One or more linears over the same input (one output each, unless an epilogue merges
    /// them), optionally normalising the input first.
    MatMul {
        linears: Vec<Linear>,
        norm: Option<Norm>,
        epilogue: Epilogue,
    },
    /// RMSNorm over each head of a `[rows, heads·head_dim]` matrix, times `scale`, then times
    /// `weight` (one `[head_dim]` vector shared by the heads: Qwen3's and Gemma 3's q/k norm)
    /// when there is one.
    HeadNorm {
        heads: usize,
        head_dim: usize,
        eps: f32,
        scale: f32,
        weight: Option<String>,
    },
    Rope {
        heads: usize,
        head_dim: usize,
        /// Rotate with the graph's `rope_local` frequencies (Gemma 3's sliding-window layers)
        /// instead of `rope`'s.
        local: bool,
    },
    /// Appends this step's k/v to the layer's cache, then attends each query row over its
    /// sequence's cached keys up to its own position.
    Attention {
        layer: usize,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        scale: f32,
        /// Keys older than `position − window` are not attended.
        window: Option<usize>,
    },
    Add,
    /// `a·x + b·y` (nanochat's residual lambdas and backout).
    Combine {
        a: f32,
        b: f32,
    },
    /// nanochat's value embedding: inputs `[v, h, ve]`, output
    /// `v + scale·σ(h[..channels] W_gateᵀ)[g] · ve` for each KV head `g`.
    GatedValueAdd {
        gate: String,
        channels: usize,
        kv_heads: usize,
        head_dim: usize,
        scale: f32,
    },
    /// nanochat's bigram smear: `x_p = e_p + λ·σ(w · e_p[..channels]) · e_{p−1}` with `e_{p−1}`
    /// from the step or, for a step's first token, from the KV cache's per-position state.
    Smear {
        gate: String,
        lambda: f32,
        channels: usize,
    },
    Mul,
    Act(Activation),
    /// `cap · tanh(x / cap)`
    Softcap {
        cap: f32,
    },
    /// Keeps the last token row of each sequence.
    LastRow,
}

impl Op {
    pub fn name(&self) -> &'static str {
        match self {
            Op::TokenIds => "token_ids",
            Op::Embed { .. } => "embed",
            Op::RmsNorm(_) => "rms_norm",
            Op::MatMul { .. } => "matmul",
            Op::HeadNorm { .. } => "head_norm",
            Op::Rope { .. } => "rope",
            Op::Attention { .. } => "attention",
            Op::Add => "add",
            Op::Combine { .. } => "combine",
            Op::GatedValueAdd { .. } => "gated_value_add",
            Op::Smear { .. } => "smear",
            Op::Mul => "mul",
            Op::Act(_) => "act",
            Op::Softcap { .. } => "softcap",
            Op::LastRow => "last_row",
        }
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct Node {
    pub op: Op,
    pub inputs: Vec<Value>,
    pub outputs: Vec<Shape>,
    /// Where the node came from in the model, e.g. `layers.3.attn.q`.
    pub label: String,
}

/// How positions turn into rotations; shared by every Rope op of a graph.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RopeSpec {
    pub theta: f32,
    pub head_dim: usize,
    pub style: RopeStyle,
    pub scaling: Option<RopeScaling>,
}

/// What the KV cache for this graph must hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct KvSpec {
    pub layers: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Floats of per-position state besides K and V (nanochat's pre-smear embedding), 0 if none.
    pub state_dim: usize,
}

#[derive(Clone, Debug, Serialize)]
pub struct Graph {
    pub nodes: Vec<Node>,
    pub output: Value,
    pub rope: RopeSpec,
    /// The second set of RoPE frequencies that `Rope { local: true }` ops use (Gemma 3's local
    /// layers have their own base); `None` when every layer shares `rope`.
    pub rope_local: Option<RopeSpec>,
    pub kv: KvSpec,
    pub vocab_size: usize,
}

impl Graph {
    pub fn new(rope: RopeSpec, kv: KvSpec, vocab_size: usize) -> Graph {
        Graph {
            nodes: vec![Node {
                op: Op::TokenIds,
                inputs: vec![],
                outputs: vec![Shape {
                    rows: Rows::Tokens,
                    cols: 1,
                }],
                label: "input".into(),
            }],
            output: Value::new(0, 0),
            rope,
            rope_local: None,
            kv,
            vocab_size,
        }
    }

    pub fn token_ids(&self) -> Value {
        Value::new(0, 0)
    }

    pub fn shape(&self, v: Value) -> Shape {
        self.nodes[v.node].outputs[v.port]
    }

    /// Appends a node whose outputs have the given shapes and returns its id.
    pub fn push(
        &mut self,
        op: Op,
        inputs: Vec<Value>,
        outputs: Vec<Shape>,
        label: impl Into<String>,
    ) -> NodeId {
        debug_assert!(inputs.iter().all(|v| v.node < self.nodes.len()));
        self.nodes.push(Node {
            op,
            inputs,
            outputs,
            label: label.into(),
        });
        self.nodes.len() - 1
    }

    /// Appends a single-output node with the rows of its first input.
    pub fn push1(
        &mut self,
        op: Op,
        inputs: Vec<Value>,
        cols: usize,
        label: impl Into<String>,
    ) -> Value {
        let rows = match op {
            Op::LastRow => Rows::Sequences,
            _ => inputs
                .first()
                .map(|&v| self.shape(v).rows)
                .unwrap_or(Rows::Tokens),
        };
        let id = self.push(op, inputs, vec![Shape { rows, cols }], label);
        Value::new(id, 0)
    }

    /// Every (consumer node, input index) that reads `v`.
    pub fn uses(&self, v: Value) -> Vec<(NodeId, usize)> {
        let mut out = Vec::new();
        for (id, n) in self.nodes.iter().enumerate() {
            for (i, &inp) in n.inputs.iter().enumerate() {
                if inp == v {
                    out.push((id, i));
                }
            }
        }
        out
    }

    /// Number of reads of each node's outputs (any port).
    pub fn use_counts(&self) -> Vec<usize> {
        let mut counts = vec![0; self.nodes.len()];
        for n in &self.nodes {
            for v in &n.inputs {
                counts[v.node] += 1;
            }
        }
        counts[self.output.node] += 1;
        counts
    }

    pub fn replace_uses(&mut self, old: Value, new: Value) {
        for n in &mut self.nodes {
            for v in &mut n.inputs {
                if *v == old {
                    *v = new;
                }
            }
        }
        if self.output == old {
            self.output = new;
        }
    }

    /// Drops nodes the output does not depend on and renumbers the rest, keeping order.
    pub fn remove_dead(&mut self) {
        let mut live = vec![false; self.nodes.len()];
        live[0] = true;
        live[self.output.node] = true;
        for id in (0..self.nodes.len()).rev() {
            if live[id] {
                for v in &self.nodes[id].inputs {
                    live[v.node] = true;
                }
            }
        }
        let mut remap = vec![usize::MAX; self.nodes.len()];
        let mut next = 0;
        for (id, &l) in live.iter().enumerate() {
            if l {
                remap[id] = next;
                next += 1;
            }
        }
        let nodes = std::mem::take(&mut self.nodes);
        self.nodes = nodes
            .into_iter()
            .enumerate()
            .filter(|(id, _)| live[*id])
            .map(|(_, mut n)| {
                for v in &mut n.inputs {
                    v.node = remap[v.node];
                }
                n
            })
            .collect();
        self.output.node = remap[self.output.node];
    }

    /// Checks the invariants passes rely on: inputs precede their users, ports exist.
    pub fn validate(&self) -> Result<(), String> {
        for (id, n) in self.nodes.iter().enumerate() {
            for v in &n.inputs {
                if v.node >= id {
                    return Err(format!(
                        "node {id} ({}) reads later node {}",
                        n.label, v.node
                    ));
                }
                if v.port >= self.nodes[v.node].outputs.len() {
                    return Err(format!(
                        "node {id} reads missing port {}:{}",
                        v.node, v.port
                    ));
                }
            }
        }
        if self.output.port >= self.nodes[self.output.node].outputs.len() {
            return Err("graph output port missing".into());
        }
        Ok(())
    }

    /// Total cost of one step with the given dimensions.
    pub fn cost(&self, dims: &Dims) -> Cost {
        self.nodes
            .iter()
            .fold(Cost::default(), |acc, n| acc + n.cost(self, dims))
    }
}

impl fmt::Display for Graph {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        print::write_text(self, f)
    }
}

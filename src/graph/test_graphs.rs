//! Small graphs for the unit tests of passes and plans: one RoPE and KV head size (4), an
//! 8-wide embedding, and the ops they push most, built the way the model builders build them.

use super::{Epilogue, Graph, KvSpec, Linear, Norm, Op, RopeSpec, Value};
use crate::model::RopeStyle;

/// A graph of `layers` KV layers of `kv_heads` heads of size 4 and a vocabulary of 10, holding
/// only its token ids.
pub(crate) fn graph(layers: usize, kv_heads: usize) -> Graph {
    Graph::new(
        RopeSpec {
            theta: 1e4,
            head_dim: 4,
            style: RopeStyle::HalfSplit,
            scaling: None,
        },
        KvSpec {
            layers,
            kv_heads,
            head_dim: 4,
            state_dim: 0,
        },
        10,
    )
}

/// The token ids' 8-wide f32 embedding.
pub(crate) fn embed(g: &mut Graph) -> Value {
    let ids = g.token_ids();
    g.push1(
        Op::Embed {
            table: "e".into(),
            dim: 8,
            row_bytes: 8 * 4,
        },
        vec![ids],
        8,
        "embed",
    )
}

/// An unweighted RMSNorm of `x`.
pub(crate) fn rms_norm(g: &mut Graph, x: Value, label: &str) -> Value {
    let cols = g.shape(x).cols;
    g.push1(
        Op::RmsNorm(Norm {
            weight: None,
            eps: 1e-5,
        }),
        vec![x],
        cols,
        label,
    )
}

/// `x` times an f32 weight `name` of `out` rows, labelled `name`.
pub(crate) fn matmul(g: &mut Graph, name: &str, out: usize, x: Value) -> Value {
    let inp = g.shape(x).cols;
    g.push1(
        Op::MatMul {
            linears: vec![Linear {
                weight: name.into(),
                bias: None,
                out,
                inp,
                weight_bytes: out * inp * 4,
            }],
            norm: None,
            epilogue: Epilogue::None,
        },
        vec![x],
        out,
        name,
    )
}

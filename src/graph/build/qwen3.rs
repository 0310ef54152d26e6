//! `Qwen3ForCausalLM`: the Llama block with a per-head RMSNorm of q and k (one `[head_dim]`
//! weight each, shared by the heads) applied before RoPE, no q/k/v biases, and an explicit
//! `head_dim` that need not be `hidden_size / heads`.

use super::{llama, LogitRows};
use crate::graph::Graph;
use crate::model::{LoadError, ModelConfig, Weights};

pub(super) fn build(
    config: &ModelConfig,
    weights: &Weights,
    logits: LogitRows,
) -> Result<Graph, LoadError> {
    llama::build_block(config, weights, logits, llama::Block { qk_norm: true })
}

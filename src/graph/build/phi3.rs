//! `Phi3ForCausalLM`: the Llama block with its projections fused, `self_attn.qkv_proj`
//! (`[q_dim + 2·kv_dim, hidden]`, rows q then k then v) and `mlp.gate_up_proj` (`[2·ffn, hidden]`,
//! rows gate then up); llama.cpp's GGUF keeps the same fusions (`attn_qkv`, a double-height
//! `ffn_up`). The loader gives each part its own name (`crate::model::arch_weights`), as a view of
//! the fused rows (no copy of mapped bytes), so the Llama builder runs unchanged.

use super::{llama, LogitRows};
use crate::graph::Graph;
use crate::model::{LoadError, ModelConfig, Weights};

pub(super) fn build(
    config: &ModelConfig,
    weights: &Weights,
    logits: LogitRows,
) -> Result<Graph, LoadError> {
    llama::build_block(config, weights, logits, llama::Block::default())
}

//! `MistralForCausalLM`: the Llama block whose attention on every layer sees only the last
//! `sliding_window` keys (Hugging Face's count, the query's own key included), which
//! [`ModelConfig::attention_window`] turns into each `Attention` op's window. Without a
//! `sliding_window` in its config a Mistral model is a Llama model.

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

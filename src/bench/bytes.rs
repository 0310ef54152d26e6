//! The fewest bytes one decode step must move through device memory, for the roofline of a GPU
//! decode: every weight read once, the KV cache read once up to the context, the new token's K
//! and V written once. Activations and logits are left out: the largest, the logits row (4 · vocab
//! bytes per sequence), is 0.07% of a SmolLM2-135M step and 0.02% of a Llama-3.2-1B one
//! (docs/gpu-method.md), and an ideal kernel keeps the rest on chip. `scripts/torch_compare.py`
//! computes the same formula (tests/torch_compare.rs checks that the two agree), so kiln's and
//! PyTorch's "% of bandwidth" divide by the same bytes.
//!
//! This is a model of what the GPU path must move (bf16 weights, bf16 KV), not of what the CPU
//! backend moves: `kiln-bench`'s CPU rows use the plan's own cost model (stored weight formats,
//! f32 KV cache) instead.

use serde::Serialize;

use crate::model::{Architecture, ModelConfig};

/// Bytes per element of each kind of data, as the device holds them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Layout {
    /// Every parameter (matrices, embedding, norm weights).
    pub weight: u64,
    /// K and V cache entries.
    pub kv: u64,
}

impl Layout {
    /// bf16 weights and a bf16 KV cache: the CUDA backend's layout.
    pub const BF16: Layout = Layout { weight: 2, kv: 2 };
}

/// One decode step of `batch` sequences, each attending over `context` positions (the new one
/// included).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct DecodeBytes {
    pub batch: u64,
    pub context: u64,
    /// Every parameter once, the (tied) embedding counted once as the LM head, plus the batch's
    /// embedding rows: `weight · (params − untied embedding) + weight · batch · hidden`.
    pub weights: u64,
    /// `kv · batch · context · layers · 2 · kv_heads · head_dim`.
    pub kv_read: u64,
    /// `kv · batch · layers · 2 · kv_heads · head_dim`.
    pub kv_write: u64,
}

impl DecodeBytes {
    pub fn total(&self) -> u64 {
        self.weights + self.kv_read + self.kv_write
    }

    /// Bytes per generated token: the step's bytes over its `batch` tokens.
    pub fn per_token(&self) -> f64 {
        self.total() as f64 / self.batch as f64
    }
}

/// KV bytes one position of one sequence occupies across all layers.
pub fn kv_bytes_per_position(config: &ModelConfig, layout: Layout) -> u64 {
    layout.kv * (config.num_layers * 2 * config.kv_dim()) as u64
}

/// The minimum bytes of one decode step, or `None` for architectures whose parameter count
/// [`ModelConfig::num_params`] does not fully describe (nanochat's value embeddings and lambdas).
pub fn decode_step(
    config: &ModelConfig,
    layout: Layout,
    batch: usize,
    context: usize,
) -> Option<DecodeBytes> {
    if config.architecture != Architecture::Llama || config.nanochat.is_some() || batch == 0 {
        return None;
    }
    let (b, ctx) = (batch as u64, context as u64);
    let embed = (config.vocab_size * config.hidden_size) as u64;
    // An untied embedding table is only gathered (one row per token); a tied one is read in full
    // as the head, and `num_params` counts it once.
    let params = config.num_params() as u64 - if config.tie_word_embeddings { 0 } else { embed };
    let per_position = kv_bytes_per_position(config, layout);
    Some(DecodeBytes {
        batch: b,
        context: ctx,
        weights: layout.weight * (params + b * config.hidden_size as u64),
        kv_read: b * ctx * per_position,
        kv_write: b * per_position,
    })
}

/// The mean context of `kiln-bench`'s `tgN` test, rounded up: N decode steps after a 1-token
/// prompt, step i (from 0) attending over i + 2 positions.
pub fn tg_context(n_gen: usize) -> usize {
    1 + (n_gen + 1).div_ceil(2)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::synthetic::shape_config;

    #[test]
    fn llama_1b_at_batch_1() {
        let (c, _) = shape_config("llama-3.2-1b").unwrap();
        let d = decode_step(&c, Layout::BF16, 1, 512).unwrap();
        // 1,235,814,400 parameters (tied) + one embedding row, bf16.
        assert_eq!(d.weights, 2 * (1_235_814_400 + 2048));
        // 16 layers · K and V · 8 heads · 64 dims · 2 bytes = 32 KiB per position.
        assert_eq!(kv_bytes_per_position(&c, Layout::BF16), 32_768);
        assert_eq!(d.kv_read, 512 * 32_768);
        assert_eq!(d.kv_write, 32_768);
        assert_eq!(d.per_token(), d.total() as f64);
    }

    #[test]
    fn batching_shares_the_weights_not_the_cache() {
        let (c, _) = shape_config("smollm2-135m").unwrap();
        let one = decode_step(&c, Layout::BF16, 1, 100).unwrap();
        let eight = decode_step(&c, Layout::BF16, 8, 100).unwrap();
        assert_eq!(eight.weights - one.weights, 2 * 7 * 576);
        assert_eq!(eight.kv_read, 8 * one.kv_read);
        assert!(eight.per_token() < one.per_token() / 6.0);
    }

    #[test]
    fn an_untied_embedding_is_only_gathered() {
        let (mut c, _) = shape_config("tiny").unwrap();
        let tied = decode_step(&c, Layout::BF16, 1, 1).unwrap();
        c.tie_word_embeddings = false;
        let untied = decode_step(&c, Layout::BF16, 1, 1).unwrap();
        // The head is a second vocab × hidden matrix, read in full; the table is not.
        assert_eq!(untied.weights, tied.weights);
    }

    #[test]
    fn tg_context_is_the_mean_over_the_steps() {
        // tg1: one step over 2 positions; tg3: steps over 2, 3, 4.
        assert_eq!(tg_context(1), 2);
        assert_eq!(tg_context(3), 3);
        assert_eq!(tg_context(128), 66);
    }
}

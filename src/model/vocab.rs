//! Checkpoints whose embedding has more rows than the tokenizer has tokens (Qwen2.5: 151,936
//! rows for 151,665 tokens; the rest is padding for faster matmuls). Ids past the tokenizer
//! have no text, so a model must never produce them: the model's vocabulary is cut to the
//! tokenizer's at load, the builders keep the padded rows in the tables (the embedding is
//! indexed by real ids only, the LM head computes logits for the real rows only), and sampling
//! never sees the rest. That a padded model never generates a padding id is tested end to end
//! in the engine (`engine/padded_vocab.rs`).

use super::{ModelConfig, Tokenizer};

/// Shrinks `config.vocab_size` to the tokenizer's when the tokenizer is the smaller.
pub(crate) fn fit_to_tokenizer(config: &mut ModelConfig, tokenizer: &Tokenizer) {
    let tokens = tokenizer.vocab_size();
    if tokens > 0 && tokens < config.vocab_size {
        config.vocab_size = tokens;
    }
}

//! Speculative decoding against plain decoding on one prompt: the same greedy request run both
//! ways (the outputs must agree), end-to-end tokens per second of each, and how many
//! proposals the target accepted. Each method gets the prompt it should help: a code edit for
//! n-gram lookup (the answer copies the code), free text for a draft model.

use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;

use super::median;
use crate::engine::{Engine, EngineError, GenerateOptions, SpecMethod, SpecOptions};
use crate::tokenizer::{ChatMessage, TokenizerError};

/// The code edit n-gram lookup is measured on.
pub const CODE_EDIT: &str = "Rename the function `area` to `rect_area` and give back the whole \
file, nothing else.\n\n```rust\n/// A rectangle on the screen.\npub struct Rect {\n    pub x: i32,\n    \
pub y: i32,\n    pub width: u32,\n    pub height: u32,\n}\n\n/// The rectangle's area in pixels.\n\
pub fn area(r: &Rect) -> u64 {\n    r.width as u64 * r.height as u64\n}\n\n/// Whether two \
rectangles overlap.\npub fn overlaps(a: &Rect, b: &Rect) -> bool {\n    a.x < b.x + b.width as \
i32\n        && b.x < a.x + a.width as i32\n        && a.y < b.y + b.height as i32\n        \
&& b.y < a.y + a.height as i32\n}\n```\n";

/// The free text a draft model is measured on.
pub const FREE_TEXT: &str = "Write a short story about a lighthouse keeper who finds a \
message in a bottle.";

/// The prompt each method is measured on.
pub fn prompt_for(method: &SpecMethod) -> &'static str {
    match method {
        SpecMethod::Ngram => CODE_EDIT,
        SpecMethod::Draft(_) => FREE_TEXT,
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct SpecBenchRow {
    pub prompt_tokens: usize,
    pub tokens: usize,
    /// Accepted over proposed, over every repetition.
    pub acceptance_rate: f64,
    /// Target passes per generated token (1 for plain decoding).
    pub passes_per_token: f64,
    /// Median end-to-end (prefill included) generated tokens per second.
    pub plain_tokens_per_s: f64,
    pub spec_tokens_per_s: f64,
}

/// `text` as a user message in the model's chat template, or as is without one.
pub fn encode_prompt(engine: &Engine, text: &str) -> Result<Vec<u32>, EngineError> {
    let tok = engine.tokenizer();
    Ok(match tok.chat_prompt(&[ChatMessage::new("user", text)]) {
        Ok(ids) => ids,
        Err(TokenizerError::NoChatTemplate) => tok.encode(text)?,
        Err(e) => return Err(e.into()),
    })
}

/// Runs the greedy request `prompt` → `n_gen` tokens plainly and with `spec`, `reps` times
/// each (after one warm-up of each), on fresh sessions. Fails if the outputs differ.
pub fn run(
    engine: &Arc<Engine>,
    spec: &SpecOptions,
    prompt: &[u32],
    n_gen: usize,
    reps: usize,
) -> Result<SpecBenchRow, EngineError> {
    let opts = GenerateOptions {
        max_tokens: Some(n_gen),
        ..GenerateOptions::default()
    };
    let capacity = prompt.len().saturating_add(n_gen);
    let (mut plain_rates, mut spec_rates) = (Vec::new(), Vec::new());
    let (mut proposed, mut accepted, mut passes, mut tokens) = (0, 0, 0, 0);
    for rep in 0..=reps {
        let t0 = Instant::now();
        let plain = engine.session(capacity).generate_batch(prompt, &opts)?;
        let plain_s = t0.elapsed().as_secs_f64();
        let t0 = Instant::now();
        let got = engine
            .session(capacity)
            .generate_speculative(prompt, &opts, spec, |_| true)?;
        let spec_s = t0.elapsed().as_secs_f64();
        if got.batch.rows[0].generated != plain.rows[0].generated {
            return Err(EngineError::Request(format!(
                "speculative output differs from plain decoding: {:?} vs {:?}",
                got.batch.rows[0].generated, plain.rows[0].generated
            )));
        }
        let n = plain.usage.completion_tokens;
        if rep > 0 {
            plain_rates.push(n as f64 / plain_s);
            spec_rates.push(n as f64 / spec_s);
            proposed += got.spec.proposed;
            accepted += got.spec.accepted;
            passes += got.spec.verify_passes;
            tokens += n;
        }
    }
    plain_rates.sort_by(f64::total_cmp);
    spec_rates.sort_by(f64::total_cmp);
    let ratio = |a: usize, b: usize| if b == 0 { 0.0 } else { a as f64 / b as f64 };
    Ok(SpecBenchRow {
        prompt_tokens: prompt.len(),
        tokens: tokens / reps.max(1),
        acceptance_rate: ratio(accepted, proposed),
        passes_per_token: ratio(passes, tokens),
        plain_tokens_per_s: median(&plain_rates),
        spec_tokens_per_s: median(&spec_rates),
    })
}

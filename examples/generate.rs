//! Embedding kiln: load a model, sample three answers to one chat prompt from a single prefill,
//! and stream a fourth token by token.
//!
//! cargo run --release --example generate -- models/SmolLM2-135M-Instruct.Q4_1.gguf

use std::sync::Arc;

use kiln::backend::cpu::CpuOptions;
use kiln::engine::{Engine, GenerateOptions};
use kiln::sample::SamplingParams;
use kiln::tokenizer::ChatMessage;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::args().nth(1).ok_or("usage: generate MODEL")?;
    let engine = Arc::new(Engine::load(&path, CpuOptions::default())?);
    let prompt = engine
        .tokenizer()
        .chat_prompt(&[ChatMessage::new("user", "Name a color.")])?;

    // Three independent samples of one prompt, prefilled once.
    let opts = GenerateOptions {
        max_tokens: Some(24),
        num_samples: 3,
        sampling: SamplingParams {
            temperature: 0.8,
            top_p: Some(0.95),
            seed: 42,
            ..SamplingParams::default()
        },
        ..GenerateOptions::default()
    };
    let batch = engine.generate_batch(&prompt, &opts)?;
    for (i, row) in batch.rows.iter().enumerate() {
        println!("sample {i} ({:?}): {}", row.finish_reason, row.text);
    }
    println!("usage: {:?}", batch.usage);

    // Streaming: one step per token, text released only on whole characters.
    let mut session = engine.session(prompt.len() + 24);
    let greedy = GenerateOptions {
        max_tokens: Some(24),
        ..GenerateOptions::default()
    };
    for step in session.stream(&prompt, &greedy)? {
        if let Some(row) = &step?.rows[0] {
            print!("{}", row.text);
        }
    }
    println!();
    Ok(())
}

//! Checkpoints whose embedding has more rows than the tokenizer has tokens (`model/vocab.rs`)
//! through the whole engine: greedy and sampled rows never produce a padding id.

use std::sync::Arc;

use super::{Engine, GenerateOptions};
use crate::backend::cpu::CpuOptions;
use crate::files::gguf::writer::GgufWriter;
use crate::files::gguf::GgufValue;
use crate::model::gguf;
use crate::sample::SamplingParams;
use crate::tokenizer::gguf::fixture::add_test_tokenizer;

/// The test tokenizer has 263 tokens; the embedding and head have 300 rows.
const TOKENS: usize = 263;
const ROWS: usize = 300;
const HIDDEN: usize = 32;

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// A one-layer llama whose blocks add nothing (zero weights) and whose head scores the 37
/// padding rows far above every real token: without the cut, greedy decoding picks a
/// padding id at once. Tied, the embedding is the head: its padding rows are twice the real
/// ones, which again makes them win.
fn padded_model(tied: bool) -> GgufWriter {
    let mut w = GgufWriter::new();
    let s = |x: &str| GgufValue::String(x.into());
    w.kv("general.architecture", s("llama"))
        .kv("llama.vocab_size", GgufValue::U32(ROWS as u32))
        .kv("llama.embedding_length", GgufValue::U32(HIDDEN as u32))
        .kv("llama.block_count", GgufValue::U32(1))
        .kv("llama.attention.head_count", GgufValue::U32(2))
        .kv("llama.feed_forward_length", GgufValue::U32(32))
        .kv("llama.context_length", GgufValue::U32(64))
        .kv(
            "llama.attention.layer_norm_rms_epsilon",
            GgufValue::F32(1e-5),
        );
    add_test_tokenizer(&mut w, Some("smollm"));
    let h = HIDDEN as u64;
    let ones = vec![1f32; HIDDEN];
    let zeros = |n: usize| f32_bytes(&vec![0f32; n]);
    let head: Vec<f32> = (0..ROWS)
        .flat_map(|r| vec![if r < TOKENS { 0.0 } else { 1.0 + r as f32 }; HIDDEN])
        .collect();
    let embd: Vec<f32> = (0..ROWS)
        .flat_map(|r| vec![if tied && r >= TOKENS { 2.0 } else { 1.0 }; HIDDEN])
        .collect();
    w.tensor("token_embd.weight", &[h, ROWS as u64], 0, f32_bytes(&embd));
    if !tied {
        w.tensor("output.weight", &[h, ROWS as u64], 0, f32_bytes(&head));
    }
    w.tensor("output_norm.weight", &[h], 0, f32_bytes(&ones))
        .tensor("blk.0.attn_norm.weight", &[h], 0, f32_bytes(&ones))
        .tensor("blk.0.ffn_norm.weight", &[h], 0, f32_bytes(&ones));
    for name in [
        "attn_q",
        "attn_k",
        "attn_v",
        "attn_output",
        "ffn_gate",
        "ffn_up",
        "ffn_down",
    ] {
        w.tensor(
            &format!("blk.0.{name}.weight"),
            &[h, h],
            0,
            zeros(HIDDEN * HIDDEN),
        );
    }
    w
}

#[test]
fn padding_rows_are_never_generated() {
    for tied in [false, true] {
        generate_from_padded(tied);
    }
}

fn generate_from_padded(tied: bool) {
    let file = padded_model(tied).write_temp("padded-vocab");
    let model = gguf::load(file.path()).unwrap();
    assert_eq!(model.config.vocab_size, TOKENS);
    assert_eq!(model.config.tie_word_embeddings, tied);
    let table = if tied {
        "model.embed_tokens.weight"
    } else {
        "lm_head.weight"
    };
    assert_eq!(model.weights.get(table).unwrap().shape, vec![ROWS, HIDDEN]);
    let engine = Arc::new(
        Engine::from_model(
            model,
            CpuOptions {
                threads: 1,
                ..Default::default()
            },
        )
        .unwrap(),
    );
    let prompt = engine.tokenizer().encode("hello").unwrap();
    for (temperature, seed) in [(0.0, 0), (1.0, 1), (1.5, 2)] {
        let opts = GenerateOptions {
            max_tokens: Some(12),
            sampling: SamplingParams {
                temperature,
                seed,
                ..Default::default()
            },
            stop_tokens: Some(Vec::new()),
            num_samples: 2,
            ..Default::default()
        };
        let out = engine.generate_batch(&prompt, &opts).unwrap();
        for row in &out.rows {
            assert_eq!(row.generated.len(), 12);
            assert!(
                row.generated.iter().all(|&id| (id as usize) < TOKENS),
                "{:?}",
                row.generated
            );
        }
    }
}

//! The real Qwen2.5-Coder-0.5B-Instruct (GGUF Q4_K_M mix: Q4_K, Q6_K, Q5_0, Q8_0 and F32
//! tensors) against transformers on the same dequantized weights: for two chat prompts
//! (rendered by the model's chat template) and two raw completions, the prompt ids and 32
//! greedy tokens must be identical (`tests/fixtures/qwen2.5_coder_0.5b_reference.json`, made by
//! `scripts/make_qwen_reference.py`). Exercises the `qwen2` GGUF architecture (q/k/v biases,
//! untied head, RoPE base 1e6), its `qwen2` pre-tokenizer and its padded vocabulary (151,936
//! rows and token-list entries for 151,665 real tokens). Skips with a message when the model has not been fetched
//! (`scripts/fetch_models.sh qwen2.5-coder-0.5b`; CI fetches it).

mod common;

use std::path::PathBuf;
use std::sync::Arc;

use kiln::backend::cpu::CpuOptions;
use kiln::engine::{Engine, FinishReason, GenerateOptions};
use kiln::sample::SamplingParams;
use kiln::tokenizer::ChatMessage;
use serde_json::Value;

const MODEL: &str = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf";

fn model_path() -> Option<PathBuf> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("models")
        .join(MODEL);
    p.is_file().then_some(p)
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn qwen2_5_coder_greedy_matches_transformers() {
    let Some(path) = model_path() else {
        eprintln!(
            "SKIPPED qwen2_5_coder_greedy_matches_transformers: models/{MODEL} absent \
             (run scripts/fetch_models.sh qwen2.5-coder-0.5b)"
        );
        return;
    };
    let text =
        std::fs::read_to_string(common::fixtures().join("qwen2.5_coder_0.5b_reference.json"))
            .unwrap();
    let r: Value = serde_json::from_str(&text).unwrap();
    let engine = Arc::new(
        Engine::load(&path, CpuOptions::default()).unwrap_or_else(|e| panic!("{MODEL}: {e}")),
    );
    let config = engine.config();
    assert!(config.attention_bias && !config.tie_word_embeddings);
    assert_eq!(config.rope_theta, 1_000_000.0);
    let tok = engine.tokenizer();
    let cases = r["cases"].as_array().unwrap();
    assert!(cases.len() >= 4);
    for c in cases {
        let text = c["text"].as_str().unwrap();
        if c["kind"] == "chat" {
            let user = c["user"].as_str().unwrap();
            let rendered = tok
                .apply_chat_template(&[ChatMessage::new("user", user)], true)
                .unwrap();
            assert_eq!(rendered, text, "{user}: rendered chat prompt");
        }
        let prompt = tok.encode(text).unwrap();
        assert_eq!(prompt, ids(&c["prompt_ids"]), "{text:?}: prompt ids");
        let want = ids(&c["generated_ids"]);
        let opts = GenerateOptions {
            max_tokens: Some(want.len()),
            sampling: SamplingParams::default(),
            stop_tokens: Some(vec![]),
            ..GenerateOptions::default()
        };
        let mut session = engine.session(prompt.len() + want.len());
        let gen = session.generate_batch(&prompt, &opts).unwrap();
        let row = &gen.rows[0];
        assert_eq!(
            row.generated,
            want,
            "{text:?}: generated {:?}",
            tok.decode(&row.generated)
        );
        assert_eq!(row.finish_reason, FinishReason::MaxTokens);
        assert_eq!(row.text, c["generated_text"].as_str().unwrap());
    }
}

//! The real demo model (SmolLM2-135M-Instruct, Q4_1 GGUF) against transformers: for three chat
//! prompts, the rendered prompt, its token ids and 32 greedy tokens must all be identical
//! (`tests/fixtures/smollm2_reference.json`, made by `scripts/make_fixtures.py` from the
//! dequantized weights). Skips with a message when the model has not been fetched
//! (`scripts/fetch_demo_model.sh`; CI fetches it).

mod common;

use std::sync::Arc;

use kiln::backend::cpu::CpuOptions;
use kiln::engine::{Engine, FinishReason, GenerateOptions};
use kiln::sample::SamplingParams;
use kiln::tokenizer::ChatMessage;
use serde_json::Value;

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn smollm2_greedy_matches_transformers() {
    let Some(path) = common::demo_model() else {
        eprintln!("SKIPPED smollm2_greedy_matches_transformers: demo model absent (run scripts/fetch_demo_model.sh)");
        return;
    };
    let text = std::fs::read_to_string(common::fixtures().join("smollm2_reference.json")).unwrap();
    let r: Value = serde_json::from_str(&text).unwrap();
    let engine = Arc::new(Engine::load(&path, CpuOptions::default()).unwrap());
    let tok = engine.tokenizer();
    for check in r["tokenizer_checks"].as_array().unwrap() {
        let text = check["text"].as_str().unwrap();
        assert_eq!(
            tok.encode(text).unwrap(),
            ids(&check["ids"]),
            "encode {text:?}"
        );
    }
    for p in r["prompts"].as_array().unwrap() {
        let user = p["user"].as_str().unwrap();
        let rendered = tok
            .apply_chat_template(&[ChatMessage::new("user", user)], true)
            .unwrap();
        assert_eq!(rendered, p["rendered_prompt"].as_str().unwrap(), "{user}");
        let prompt = tok.encode(&rendered).unwrap();
        assert_eq!(prompt, ids(&p["prompt_ids"]), "{user}: prompt ids");
        let want = ids(&p["generated_ids"]);
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
            "{user}: generated {:?}",
            tok.decode(&row.generated)
        );
        assert_eq!(row.finish_reason, FinishReason::MaxTokens);
        assert_eq!(row.text, p["generated_text"].as_str().unwrap());
    }
}

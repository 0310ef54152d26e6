//! nanochat checkpoints of every era (spec §0), converted by `scripts/convert_nanochat.py`,
//! against the independent NumPy implementation of spec §3 (`scripts/nanochat_ref.py`): logits
//! for the whole prompt, for the prompt prefilled in two chunks (the smear must carry across the
//! chunk boundary), and 16 greedy decode steps — across a sliding-window boundary for eras D, G
//! and H.

mod common;

use common::{fixtures, rel_err, Reference};
use kiln::backend::cpu::{CpuBackend, CpuOptions, Workspace};
use kiln::backend::TokenRow;
use kiln::model::Model;
use kiln::plan::PlanKind;
use kiln::sample::argmax;
use safetensors::SafeTensors;
use serde_json::Value;

const TOLERANCE: f32 = 1e-4;

fn chunked(path: &std::path::Path) -> (usize, Vec<Vec<f32>>) {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let split = i64::from_le_bytes(
        st.tensor("chunk_split").unwrap().data()[..8]
            .try_into()
            .unwrap(),
    ) as usize;
    let t = st.tensor("chunked_prefill_logits").unwrap();
    let cols = t.shape()[1];
    let vals: Vec<f32> = t
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    (split, vals.chunks(cols).map(<[f32]>::to_vec).collect())
}

fn check(era: &str) {
    let dir = fixtures().join(format!("nanochat_{era}"));
    let model = Model::load(&dir).unwrap_or_else(|e| panic!("{era}: {e}"));
    let r = Reference::load(&dir.join("reference.safetensors"));
    let be = CpuBackend::new(
        &model.config,
        &model.weights,
        CpuOptions {
            threads: 2,
            ..Default::default()
        },
    )
    .unwrap();
    let v = model.config.vocab_size;
    let p = r.prompt_ids.len();
    let rows = |from: usize, to: usize| -> Vec<TokenRow> {
        (from..to).map(|pos| TokenRow { slot: 0, pos }).collect()
    };
    let mut ws = Workspace::new();
    let mut logits = Vec::new();

    let mut kv = be.new_cache(1, p + 17).expect("cache");
    be.forward(
        PlanKind::AllLogits,
        &mut ws,
        &mut kv,
        &r.prompt_ids,
        &rows(0, p),
        &mut logits,
    )
    .unwrap();
    for (i, want) in r.prefill_logits.iter().enumerate() {
        let e = rel_err(&logits[i * v..(i + 1) * v], want);
        assert!(
            e < TOLERANCE,
            "era {era}: prefill position {i}: relative error {e:e}"
        );
    }

    let (split, want_chunked) = chunked(&dir.join("reference.safetensors"));
    let mut kv = be.new_cache(1, p + 17).expect("cache");
    let mut got = Vec::new();
    for (a, b) in [(0, split), (split, p)] {
        be.forward(
            PlanKind::AllLogits,
            &mut ws,
            &mut kv,
            &r.prompt_ids[a..b],
            &rows(a, b),
            &mut logits,
        )
        .unwrap();
        got.extend_from_slice(&logits);
    }
    for (i, want) in want_chunked.iter().enumerate() {
        let e = rel_err(&got[i * v..(i + 1) * v], want);
        assert!(
            e < TOLERANCE,
            "era {era}: chunked prefill position {i} (split {split}): relative error {e:e}"
        );
    }

    let mut kv = be.new_cache(1, p + 17).expect("cache");
    be.forward(
        PlanKind::Prefill,
        &mut ws,
        &mut kv,
        &r.prompt_ids,
        &rows(0, p),
        &mut logits,
    )
    .unwrap();
    assert_eq!(
        argmax(&logits),
        r.generated_ids[0],
        "era {era}: first token"
    );
    for (step, want) in r.decode_logits.iter().enumerate() {
        let pos = p + step;
        be.forward(
            PlanKind::Decode,
            &mut ws,
            &mut kv,
            &[r.generated_ids[step]],
            &rows(pos, pos + 1),
            &mut logits,
        )
        .unwrap();
        let e = rel_err(&logits, want);
        assert!(
            e < TOLERANCE,
            "era {era}: decode step {step}: relative error {e:e}"
        );
        assert_eq!(
            argmax(&logits),
            r.generated_ids[step + 1],
            "era {era}: decode step {step} token"
        );
    }
}

#[test]
fn era_a_original() {
    check("A");
}

#[test]
fn era_b_residual_lambdas() {
    check("B");
}

#[test]
fn era_d_value_embeddings_and_windows() {
    check("D");
}

#[test]
fn era_g_rope_100k_and_qk_scale() {
    check("G");
}

#[test]
fn era_h_smear_and_backout() {
    check("H");
}

#[test]
fn era_h_with_bf16_embeddings() {
    check("H_bf16");
}

/// The converted tokenizer encodes text like tiktoken's `encode_ordinary` (special-token text
/// stays text) and nanochat's chat format is the default chat prompt.
#[test]
fn converted_tokenizer_and_chat_format_match_tiktoken() {
    let text =
        std::fs::read_to_string(fixtures().join("nanochat_tokenizer_reference.json")).unwrap();
    let r: Value = serde_json::from_str(&text).unwrap();
    let m = Model::load(fixtures().join("nanochat_H")).unwrap();
    let ids = |v: &Value| -> Vec<u32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    for case in r["encode"].as_array().unwrap() {
        let s = case["text"].as_str().unwrap();
        assert_eq!(m.tokenizer.encode(s).unwrap(), ids(&case["ids"]), "{s:?}");
    }
    let prompt = m
        .tokenizer
        .chat_prompt(&[kiln::tokenizer::ChatMessage::new(
            "user",
            r["chat"]["user"].as_str().unwrap(),
        )])
        .unwrap();
    assert_eq!(prompt, ids(&r["chat"]["ids"]));
}

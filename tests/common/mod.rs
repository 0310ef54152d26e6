//! Shared helpers for integration tests: fixture paths and reference files.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensors};

pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// The demo model, if it has been fetched (`scripts/fetch_demo_model.sh`).
pub fn demo_model() -> Option<PathBuf> {
    let p = std::env::var_os("KILN_DEMO_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("models/SmolLM2-135M-Instruct.Q4_1.gguf")
        });
    p.exists().then_some(p)
}

/// A `reference.safetensors` written by `scripts/make_fixtures.py` from transformers' outputs.
pub struct Reference {
    pub prompt_ids: Vec<u32>,
    /// `[prompt_len, vocab]`
    pub prefill_logits: Vec<Vec<f32>>,
    /// `[16, vocab]`: logits after feeding `generated_ids[i]`.
    pub decode_logits: Vec<Vec<f32>>,
    /// 17 greedy tokens; `generated_ids[0]` comes from the prefill.
    pub generated_ids: Vec<u32>,
}

fn ints(st: &SafeTensors, name: &str) -> Vec<u32> {
    let t = st.tensor(name).unwrap();
    assert_eq!(t.dtype(), Dtype::I64, "{name}");
    t.data()
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32)
        .collect()
}

fn rows(st: &SafeTensors, name: &str) -> Vec<Vec<f32>> {
    let t = st.tensor(name).unwrap();
    assert_eq!(t.dtype(), Dtype::F32, "{name}");
    let cols = *t.shape().last().unwrap();
    let vals: Vec<f32> = t
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    vals.chunks(cols).map(<[f32]>::to_vec).collect()
}

impl Reference {
    pub fn load(path: &Path) -> Reference {
        let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let st = SafeTensors::deserialize(&bytes).unwrap();
        Reference {
            prompt_ids: ints(&st, "prompt_ids"),
            prefill_logits: rows(&st, "prefill_logits"),
            decode_logits: rows(&st, "decode_logits"),
            generated_ids: ints(&st, "generated_ids"),
        }
    }
}

/// `max |got - want| / max |want|` over a row: a relative error that is not undone by logits
/// near zero.
pub fn rel_err(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-30);
    let diff = got
        .iter()
        .zip(want)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    diff / scale
}

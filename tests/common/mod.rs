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

/// nanochat's test double: a model whose logits are uniform over the vocabulary. It is a real
/// (tiny, one-layer) Llama run by the real pipeline, with a zero LM head, so every row of every
/// step samples from the uniform distribution; the fixture tokenizer supplies the vocabulary.
pub fn uniform_model(threads: usize) -> std::sync::Arc<kiln::engine::Engine> {
    let base = kiln::model::Model::load(fixtures().join("llama_tied")).unwrap();
    uniform_model_with(base.tokenizer, threads)
}

/// nanochat's nine special tokens, in their order.
pub const NANOCHAT_SPECIALS: [&str; 9] = [
    "<|bos|>",
    "<|user_start|>",
    "<|user_end|>",
    "<|assistant_start|>",
    "<|assistant_end|>",
    "<|python_start|>",
    "<|python_end|>",
    "<|output_start|>",
    "<|output_end|>",
];

/// The fixture BPE with nanochat's specials appended after its vocabulary (ids 400..409).
pub fn nanochat_tokenizer() -> kiln::tokenizer::Tokenizer {
    let path = fixtures().join("llama_tied/tokenizer.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    for (i, s) in NANOCHAT_SPECIALS.iter().enumerate() {
        let id = 400 + i;
        v["model"]["vocab"][*s] = id.into();
        v["added_tokens"]
            .as_array_mut()
            .unwrap()
            .push(serde_json::json!({
                "id": id, "content": s, "single_word": false, "lstrip": false, "rstrip": false,
                "normalized": false, "special": true
            }));
    }
    let specials = kiln::tokenizer::SpecialTokens {
        bos_token_id: Some(400),
        eos_token_ids: vec![404],
        ..Default::default()
    };
    kiln::tokenizer::Tokenizer::from_json(
        &serde_json::to_vec(&v).unwrap(),
        Path::new("nanochat-test"),
        specials,
    )
    .unwrap()
}

/// [`uniform_model`] over any tokenizer (its vocabulary sets the model's).
pub fn uniform_model_with(
    tokenizer: kiln::tokenizer::Tokenizer,
    threads: usize,
) -> std::sync::Arc<kiln::engine::Engine> {
    let opts = kiln::backend::cpu::CpuOptions {
        threads,
        ..Default::default()
    };
    std::sync::Arc::new(
        kiln::engine::Engine::from_model(uniform_model_of(tokenizer), opts).unwrap(),
    )
}

/// The uniform model's config and weights over any tokenizer, not yet on an engine.
pub fn uniform_model_of(tokenizer: kiln::tokenizer::Tokenizer) -> kiln::model::Model {
    use kiln::model::{Architecture, Model, ModelConfig, RopeStyle, Tensor, Weights};
    let vocab = tokenizer.vocab_size();
    let (c, f, heads, kv, d) = (16, 32, 2, 1, 8);
    let config = ModelConfig {
        architecture: Architecture::Llama,
        vocab_size: vocab,
        hidden_size: c,
        num_layers: 1,
        num_heads: heads,
        num_kv_heads: kv,
        head_dim: d,
        intermediate_size: f,
        rms_norm_eps: 1e-5,
        rope_theta: 10000.0,
        rope_scaling: None,
        rope_style: RopeStyle::HalfSplit,
        max_position_embeddings: 256,
        tie_word_embeddings: false,
        attention_bias: false,
        final_logit_softcap: None,
        bos_token_id: tokenizer.specials.bos_token_id,
        eos_token_ids: tokenizer.specials.eos_token_ids.clone(),
        sliding_window: None,
        gemma3: None,
        nanochat: None,
    };
    let mut w = Weights::new("uniform-model");
    let mut seed = 1u32;
    let mut t = |name: &str, shape: Vec<usize>, zero: bool| {
        let n: usize = shape.iter().product();
        let data = (0..n)
            .map(|_| {
                seed = seed.wrapping_mul(1664525).wrapping_add(1013904223);
                if zero {
                    0.0
                } else {
                    (seed >> 8) as f32 / 16_777_216.0 - 0.5
                }
            })
            .collect();
        w.insert(Tensor::from_f32(name, shape, data));
    };
    t("model.embed_tokens.weight", vec![vocab, c], false);
    let p = "model.layers.0";
    t(&format!("{p}.input_layernorm.weight"), vec![c], false);
    t(
        &format!("{p}.self_attn.q_proj.weight"),
        vec![heads * d, c],
        false,
    );
    t(
        &format!("{p}.self_attn.k_proj.weight"),
        vec![kv * d, c],
        false,
    );
    t(
        &format!("{p}.self_attn.v_proj.weight"),
        vec![kv * d, c],
        false,
    );
    t(
        &format!("{p}.self_attn.o_proj.weight"),
        vec![c, heads * d],
        false,
    );
    t(
        &format!("{p}.post_attention_layernorm.weight"),
        vec![c],
        false,
    );
    t(&format!("{p}.mlp.gate_proj.weight"), vec![f, c], false);
    t(&format!("{p}.mlp.up_proj.weight"), vec![f, c], false);
    t(&format!("{p}.mlp.down_proj.weight"), vec![c, f], false);
    t("model.norm.weight", vec![c], false);
    t("lm_head.weight", vec![vocab, c], true);
    Model {
        path: "uniform-model".into(),
        config,
        weights: w,
        tokenizer,
        weight_type: "f32".into(),
    }
}

/// Whether a CUDA GPU is usable; without one, prints `SKIPPED: <reason>` for the test log.
#[cfg(feature = "cuda")]
pub fn gpu_or_skip() -> bool {
    match kiln::backend::cuda::probe() {
        Ok((_, info)) => {
            println!("GPU: {info}");
            true
        }
        Err(e) => {
            println!("SKIPPED: {e}");
            false
        }
    }
}

/// ‖got − want‖₂ / ‖want‖₂, in f64.
pub fn rel_l2(got: &[f32], want: &[f32]) -> f32 {
    let num: f64 = got
        .iter()
        .zip(want)
        .map(|(a, b)| ((a - b) as f64).powi(2))
        .sum();
    let den: f64 = want.iter().map(|b| (*b as f64).powi(2)).sum();
    (num / den.max(1e-30)).sqrt() as f32
}

/// A greedy choice's margin: the top logit minus the runner-up, over the logits' RMS. The GPU
/// tests call a first difference between two paths a near tie when this is small.
pub fn gap(l: &[f32]) -> f32 {
    let b = kiln::sample::argmax(l) as usize;
    let second = l
        .iter()
        .enumerate()
        .filter(|&(i, _)| i != b)
        .map(|(_, &v)| v)
        .fold(f32::NEG_INFINITY, f32::max);
    let rms = (l.iter().map(|v| v * v).sum::<f32>() / l.len() as f32).sqrt();
    (l[b] - second) / rms.max(1e-12)
}

/// `kiln-bench --concurrency`'s load on `engine`: `sequences` sequences of a 16-token prompt and
/// 64 generated tokens each, in a serving pool of exactly the blocks they need
/// (`kiln::bench::serving::run`). The serving tests run it on the CPU's graph stand-in and on a
/// GPU, so both meet the same load.
pub fn bench_load(
    engine: &std::sync::Arc<kiln::engine::Engine>,
    sequences: usize,
) -> Result<kiln::bench::serving::ServingRow, kiln::engine::EngineError> {
    kiln::bench::serving::run(
        engine,
        kiln::engine::ServeOptions::default(),
        sequences,
        16,
        64,
        1,
        &kiln::bench::serving::Load::default(),
    )
}

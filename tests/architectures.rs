//! How the Qwen3, Mistral, Phi-3 and Gemma 3 configs are read, beyond the forms of the fixtures
//! (whose logits `tests/reference.rs` checks): the config keys of older transformers releases,
//! what the GGUF metadata implies, and the variants kiln refuses by name.

mod common;

use std::path::{Path, PathBuf};

use common::fixtures;
use kiln::model::{Architecture, Model};

/// A copy of a fixture directory in a fresh temporary directory.
fn copy_fixture(name: &str, tag: &str) -> PathBuf {
    let dst = std::env::temp_dir().join(format!("kiln-arch-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dst);
    std::fs::create_dir_all(&dst).unwrap();
    for e in std::fs::read_dir(fixtures().join(name)).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
    }
    dst
}

fn edit_config(dir: &Path, f: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>)) {
    let p = dir.join("config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    f(v.as_object_mut().unwrap());
    std::fs::write(&p, serde_json::to_string(&v).unwrap()).unwrap();
}

fn config_json(m: &Model) -> serde_json::Value {
    serde_json::to_value(&m.config).unwrap()
}

fn load_err(path: &Path) -> String {
    match Model::load(path) {
        Ok(_) => panic!("{} loaded but should not have", path.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn gemma3_config_of_older_transformers_reads_the_same() {
    // Before transformers 5: rope_theta + rope_local_base_freq, sliding_window_pattern and no
    // layer_types.
    let dir = copy_fixture("gemma3", "legacy");
    edit_config(&dir, |c| {
        c.remove("rope_parameters");
        c.remove("layer_types");
        c.insert("rope_theta".into(), 1_000_000.0.into());
        c.insert("rope_local_base_freq".into(), 10_000.0.into());
        c.insert("sliding_window_pattern".into(), 6.into());
    });
    let legacy = Model::load(&dir).unwrap();
    let current = Model::load(fixtures().join("gemma3")).unwrap();
    assert_eq!(config_json(&legacy), config_json(&current));
    let g = current.config.gemma3.as_ref().unwrap();
    assert_eq!(
        g.global_layers,
        [false, false, false, false, false, true],
        "every sixth layer is global"
    );
    assert_eq!((current.config.rope_theta, g.rope_local_theta), (1e6, 1e4));
    assert_eq!(current.config.attention_window(0), Some(7));
    assert_eq!(current.config.attention_window(5), None);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn gguf_metadata_gives_the_configs_of_the_safetensors_models() {
    for name in ["qwen3", "mistral", "phi3", "gemma3"] {
        let hf = Model::load(fixtures().join(name)).unwrap();
        let gguf = Model::load(fixtures().join(format!("{name}.f32.gguf"))).unwrap();
        let (mut a, mut b) = (config_json(&hf), config_json(&gguf));
        // What the formats legitimately differ in: llama-architecture GGUF files store q/k
        // permuted for the interleaved rotation.
        if name == "mistral" {
            assert_eq!(b["rope_style"], "Interleaved");
            b["rope_style"] = a["rope_style"].clone();
        }
        a["bos_token_id"] = b["bos_token_id"].clone();
        assert_eq!(a, b, "{name}");
    }
}

#[test]
fn mistral_without_a_window_and_gguf_llama_without_one_are_plain_llama_attention() {
    let m = Model::load(fixtures().join("llama_tied.f32.gguf")).unwrap();
    assert_eq!(m.config.architecture, Architecture::Llama);
    assert_eq!(m.config.attention_window(0), None);
    let m = Model::load(fixtures().join("mistral.f32.gguf")).unwrap();
    assert_eq!(m.config.architecture, Architecture::Mistral);
    assert_eq!(m.config.attention_window(1), Some(7));
}

#[test]
fn unsupported_variants_are_refused_by_name() {
    let dir = copy_fixture("phi3", "partial");
    edit_config(&dir, |c| {
        c["rope_parameters"]["partial_rotary_factor"] = 0.5.into();
    });
    let e = load_err(&dir);
    assert!(e.contains("partial_rotary_factor"), "{e}");
    edit_config(&dir, |c| {
        c["rope_parameters"] = serde_json::json!({
            "rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": [1.0], "long_factor": [1.0],
        });
    });
    let e = load_err(&dir);
    assert!(e.contains("longrope"), "{e}");
    std::fs::remove_dir_all(dir).unwrap();

    let dir = copy_fixture("qwen3", "swa");
    edit_config(&dir, |c| {
        c.insert("use_sliding_window".into(), true.into());
    });
    let e = load_err(&dir);
    assert!(e.contains("use_sliding_window"), "{e}");
    std::fs::remove_dir_all(dir).unwrap();

    let dir = copy_fixture("gemma3", "softcap");
    edit_config(&dir, |c| {
        c.insert("attn_logit_softcapping".into(), 50.0.into());
    });
    let e = load_err(&dir);
    assert!(e.contains("attn_logit_softcapping"), "{e}");
    std::fs::remove_dir_all(dir).unwrap();
}

/// A vocabulary table padded with rows beyond the tokenizer (Qwen2.5's GGUF: 151,936 rows for
/// 151,665 tokens) loads, and its extra rows never become logits: the Qwen3 fixture with 24
/// rows of large values appended to its embedding and head gives the reference's logits.
#[test]
fn padded_vocabulary_rows_are_never_logits() {
    use kiln::backend::cpu::{CpuBackend, CpuOptions, Workspace};
    use kiln::backend::TokenRow;
    use kiln::plan::PlanKind;
    use safetensors::tensor::TensorView;

    let dir = copy_fixture("qwen3", "padded");
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut owned: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, view) in st.tensors() {
        let (mut shape, mut data) = (view.shape().to_vec(), view.data().to_vec());
        if name == "model.embed_tokens.weight" || name == "lm_head.weight" {
            shape[0] += 24;
            let pad: Vec<u8> = std::iter::repeat_n(50.0f32.to_le_bytes(), 24 * shape[1])
                .flatten()
                .collect();
            data.extend(pad);
        }
        owned.push((name, shape, data));
    }
    let views: Vec<(String, TensorView<'_>)> = owned
        .iter()
        .map(|(n, s, d)| {
            let v = TensorView::new(safetensors::Dtype::F32, s.clone(), d).unwrap();
            (n.clone(), v)
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();

    let model = Model::load(&dir).unwrap();
    let vocab = model.config.vocab_size;
    assert_eq!(vocab, 400);
    let want = safetensors::SafeTensors::deserialize(
        &std::fs::read(fixtures().join("qwen3/reference.safetensors")).unwrap(),
    )
    .unwrap()
    .tensor("prefill_logits")
    .unwrap()
    .data()
    .chunks_exact(4)
    .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
    .collect::<Vec<f32>>();
    let prompt: Vec<u32> = serde_json::from_str::<serde_json::Value>(
        &std::fs::read_to_string(fixtures().join("tokenizer_reference.json")).unwrap(),
    )
    .unwrap()["prompt_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    let cpu = CpuBackend::new(&model.config, &model.weights, CpuOptions::default()).unwrap();
    let rows: Vec<TokenRow> = (0..prompt.len())
        .map(|pos| TokenRow { slot: 0, pos })
        .collect();
    let (mut ws, mut kv, mut logits) = (
        Workspace::new(),
        cpu.new_cache(1, 32).expect("cache"),
        Vec::new(),
    );
    cpu.forward(
        PlanKind::AllLogits,
        &mut ws,
        &mut kv,
        &prompt,
        &rows,
        &mut logits,
    )
    .unwrap();
    assert_eq!(logits.len(), prompt.len() * vocab);
    assert_eq!(want.len(), logits.len());
    let err = common::rel_err(&logits, &want);
    assert!(err < 1e-4, "relative error {err:e}");
    std::fs::remove_dir_all(dir).unwrap();
}

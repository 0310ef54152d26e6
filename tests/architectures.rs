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

//! Broken model files give errors that name the file, the tensor or field, and what was wrong —
//! never a panic.

mod common;

use std::path::{Path, PathBuf};

use common::fixtures;
use kiln::backend::cpu::CpuOptions;
use kiln::engine::Engine;

/// A copy of a fixture directory in a fresh temporary directory.
fn copy_fixture(name: &str, tag: &str) -> PathBuf {
    let dst = std::env::temp_dir().join(format!("kiln-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dst);
    std::fs::create_dir_all(&dst).unwrap();
    for e in std::fs::read_dir(fixtures().join(name)).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
    }
    dst
}

fn load_err(path: &Path) -> String {
    match Engine::load(path, CpuOptions::default()) {
        Ok(_) => panic!("{} loaded but should not have", path.display()),
        Err(e) => e.to_string(),
    }
}

fn edit_config(dir: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let p = dir.join("config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(&p, serde_json::to_string(&v).unwrap()).unwrap();
}

#[test]
fn missing_tensor_is_named() {
    let d = copy_fixture("llama_tied", "missing");
    edit_config(&d, |c| c["num_hidden_layers"] = 3.into());
    let e = load_err(&d);
    assert!(
        e.contains("missing tensor `model.layers.2.input_layernorm.weight`"),
        "{e}"
    );
    assert!(e.contains("model.safetensors"), "{e}");
}

#[test]
fn wrong_shape_names_tensor_expected_and_found() {
    let d = copy_fixture("llama_tied", "shape");
    edit_config(&d, |c| c["intermediate_size"] = 128.into());
    let e = load_err(&d);
    assert!(e.contains("model.layers.0.mlp.gate_proj.weight"), "{e}");
    assert!(e.contains("[160, 64]") && e.contains("[128, 64]"), "{e}");
}

#[test]
fn truncated_weights_are_detected() {
    let d = copy_fixture("llama_tied", "trunc");
    let p = d.join("model.safetensors");
    let bytes = std::fs::read(&p).unwrap();
    std::fs::write(&p, &bytes[..bytes.len() - 100]).unwrap();
    let e = load_err(&d);
    assert!(e.contains("model.safetensors"), "{e}");
}

#[test]
fn unknown_architecture_is_named() {
    let d = copy_fixture("llama_tied", "arch");
    edit_config(&d, |c| c["model_type"] = "gpt2".into());
    let e = load_err(&d);
    assert!(
        e.contains("unsupported architecture `gpt2`") && e.contains("config.json"),
        "{e}"
    );
}

#[test]
fn unsupported_dtype_is_named() {
    let d = copy_fixture("llama_tied", "dtype");
    // A valid safetensors file holding one i32 tensor.
    let header =
        br#"{"model.embed_tokens.weight":{"dtype":"I32","shape":[2],"data_offsets":[0,8]}}"#;
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header);
    bytes.extend_from_slice(&[0u8; 8]);
    std::fs::write(d.join("model.safetensors"), bytes).unwrap();
    let e = load_err(&d);
    assert!(
        e.contains("model.embed_tokens.weight") && e.contains("I32"),
        "{e}"
    );
}

#[test]
fn bad_config_field_is_named() {
    let d = copy_fixture("llama_tied", "field");
    edit_config(&d, |c| c["num_key_value_heads"] = 3.into());
    let e = load_err(&d);
    assert!(
        e.contains("num_key_value_heads") && e.contains("does not divide"),
        "{e}"
    );
    edit_config(&d, |c| c["hidden_size"] = "wide".into());
    let e = load_err(&d);
    assert!(
        e.contains("hidden_size") && e.contains("positive integer"),
        "{e}"
    );
}

#[test]
fn missing_files_are_named() {
    let e = load_err(Path::new("/nonexistent/model.gguf"));
    assert!(e.contains("/nonexistent/model.gguf"), "{e}");
    let d = copy_fixture("llama_tied", "nofile");
    std::fs::remove_file(d.join("tokenizer.json")).unwrap();
    let e = load_err(&d);
    assert!(e.contains("tokenizer.json"), "{e}");
}

#[test]
fn truncated_gguf_is_an_error() {
    let d = std::env::temp_dir().join(format!("kiln-{}-gguf", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    let bytes = std::fs::read(fixtures().join("llama_tied.q4_1.gguf")).unwrap();
    let p = d.join("cut.gguf");
    std::fs::write(&p, &bytes[..bytes.len() / 2]).unwrap();
    let e = load_err(&p);
    assert!(e.contains("cut.gguf"), "{e}");
}

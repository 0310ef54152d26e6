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

/// Loads in a thread, so that a load that blocks fails the test instead of hanging it.
fn load_err_within(path: &Path, secs: u64) -> String {
    let (tx, rx) = std::sync::mpsc::channel();
    let p = path.to_path_buf();
    std::thread::spawn(move || {
        let _ = tx.send(load_err(&p));
    });
    rx.recv_timeout(std::time::Duration::from_secs(secs))
        .unwrap_or_else(|_| panic!("loading {} did not return in {secs} s", path.display()))
}

/// `{:#}` prints the whole cause chain, as the binaries do.
fn chain(path: &Path) -> String {
    match Engine::load(path, CpuOptions::default()) {
        Ok(_) => panic!("{} loaded but should not have", path.display()),
        Err(e) => format!("{:#}", anyhow::Error::from(e)),
    }
}

#[test]
fn huge_head_dim_is_refused_naming_the_field() {
    // 4 × (2^62 + 16) wraps to 64 = hidden_size: every shape check used to pass, then the RoPE
    // table's allocation panicked with `capacity overflow`.
    let d = copy_fixture("nanochat", "headdim");
    edit_config(&d, |c| c["head_dim"] = ((1u64 << 62) + 16).into());
    let e = load_err(&d);
    assert!(e.contains("`head_dim`") && e.contains("overflows"), "{e}");
    // nanochat's own config: 4 heads × (2^62 + 8) wraps to n_embd = 32.
    let d = copy_fixture("nanochat_A", "headdim-native");
    edit_config(&d, |c| c["head_dim"] = ((1u64 << 62) + 8).into());
    let e = load_err(&d);
    assert!(e.contains("`head_dim`") && e.contains("overflows"), "{e}");
    let d = copy_fixture("nanochat_A", "seqlen-native");
    edit_config(&d, |c| c["sequence_len"] = (u64::MAX / 4).into());
    let e = load_err(&d);
    assert!(
        e.contains("`sequence_len`") && e.contains("overflows"),
        "{e}"
    );
}

/// The fixture's tokenizer.json, re-serialized compactly and edited as text.
fn edit_tokenizer_text(dir: &Path, f: impl FnOnce(String) -> String) {
    let p = dir.join("tokenizer.json");
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    std::fs::write(&p, f(serde_json::to_string(&v).unwrap())).unwrap();
}

#[test]
fn tokenizer_json_the_crate_would_panic_on_is_an_error() {
    let d = copy_fixture("llama_tied", "tok-syntax");
    edit_tokenizer_text(&d, |t| {
        assert!(t.contains(r#""decoder":{"#), "{}", &t[..200]);
        t.replace(r#""decoder":{"#, r#""decoder":{,"#)
    });
    let e = load_err(&d);
    assert!(
        e.contains("tokenizer.json") && e.contains("invalid JSON"),
        "{e}"
    );

    // A Strip decoder cutting from the end indexes past short tokens at decode time.
    let d = copy_fixture("llama_tied", "tok-strip");
    edit_tokenizer_text(&d, |t| {
        let mut v: serde_json::Value = serde_json::from_str(&t).unwrap();
        v["decoder"] = serde_json::json!({"type": "Strip", "content": "a", "start": 1, "stop": 2});
        v.to_string()
    });
    let e = load_err(&d);
    assert!(e.contains("tokenizer.json") && e.contains("Strip"), "{e}");
}

#[test]
fn fifos_and_devices_are_refused_without_blocking() {
    let d = std::env::temp_dir().join(format!("kiln-{}-fifo", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    let fifo = d.join("model.gguf");
    let made = std::process::Command::new("mkfifo").arg(&fifo).status();
    if made.is_ok_and(|s| s.success()) {
        let e = load_err_within(&fifo, 10);
        assert!(e.contains("model.gguf") && e.contains("FIFO"), "{e}");
        // The same inside a model directory.
        let m = copy_fixture("llama_tied", "fifo-config");
        std::fs::remove_file(m.join("config.json")).unwrap();
        std::fs::rename(&fifo, m.join("config.json")).unwrap();
        let e = load_err_within(&m, 10);
        assert!(e.contains("config.json") && e.contains("FIFO"), "{e}");
    } else {
        eprintln!("mkfifo unavailable: FIFO case skipped");
    }
    let e = load_err_within(Path::new("/dev/null"), 10);
    assert!(
        e.contains("/dev/null") && e.contains("character device"),
        "{e}"
    );
    assert!(!e.contains("No such device"), "{e}");
}

#[test]
fn hyper_parameters_that_give_nan_are_refused() {
    type Edit = fn(&mut serde_json::Value);
    let cases: [(&str, &str, Edit); 9] = [
        ("llama_tied", "rms_norm_eps", |c| {
            c["rms_norm_eps"] = 0.0.into()
        }),
        ("llama_tied", "rms_norm_eps", |c| {
            c["rms_norm_eps"] = (-1e-5).into()
        }),
        // Past f32's range: infinite once read.
        ("llama_tied", "rms_norm_eps", |c| {
            c["rms_norm_eps"] = 1e300.into()
        }),
        ("llama_tied", "rope_theta", |c| {
            c["rope_parameters"]["rope_theta"] = 0.0.into()
        }),
        ("qwen2", "rope_theta", |c| c["rope_theta"] = (-10.0).into()),
        ("nanochat_H", "softcap", |c| c["softcap"] = 0.0.into()),
        ("llama_tied", "rope_parameters.factor", |c| {
            c["rope_parameters"] = serde_json::json!({"rope_type": "linear", "factor": 0.0})
        }),
        ("llama_tied", "rope_parameters", |c| {
            c["rope_parameters"] = "llama3".into()
        }),
        ("qwen2", "rope_scaling", |c| c["rope_scaling"] = 5.into()),
    ];
    for (i, (fixture, field, edit)) in cases.into_iter().enumerate() {
        let d = copy_fixture(fixture, &format!("hyper-{i}"));
        if fixture == "qwen2" {
            edit_config(&d, |c| {
                c.as_object_mut().unwrap().remove("rope_parameters");
            });
        }
        edit_config(&d, edit);
        let e = load_err(&d);
        assert!(e.contains(&format!("`{field}`")), "case {i}: {e}");
    }
}

#[test]
fn token_ids_past_u32_are_refused_not_truncated() {
    let d = copy_fixture("llama_tied", "eos-big");
    edit_config(&d, |c| c["eos_token_id"] = ((1u64 << 32) + 2).into());
    let e = load_err(&d);
    assert!(
        e.contains("`eos_token_id`") && e.contains("4294967298"),
        "{e}"
    );
    let d = copy_fixture("llama_tied", "bos-neg");
    edit_config(&d, |c| c["bos_token_id"] = serde_json::json!([1, -1]));
    let e = load_err(&d);
    assert!(e.contains("`bos_token_id`") && e.contains("-1"), "{e}");
    let d = copy_fixture("llama_tied", "gen-eos");
    let g = d.join("generation_config.json");
    std::fs::write(&g, r#"{"eos_token_id": [2, 99999999999]}"#).unwrap();
    let e = load_err(&d);
    assert!(
        e.contains("generation_config.json") && e.contains("`eos_token_id`"),
        "{e}"
    );
}

#[test]
fn causes_are_printed_once() {
    let p = Path::new("/nonexistent/model.gguf");
    let e = chain(p);
    assert_eq!(e.matches("/nonexistent/model.gguf").count(), 1, "{e}");
    assert_eq!(e.matches("No such file").count(), 1, "{e}");
    let d = copy_fixture("llama_tied", "badjson");
    std::fs::write(d.join("config.json"), "{\"a\": }").unwrap();
    let e = chain(&d);
    assert_eq!(e.matches("expected value").count(), 1, "{e}");
    assert!(e.contains("config.json"), "{e}");
}

#[test]
fn gguf_magic_prints_as_text_and_hex() {
    let d = std::env::temp_dir().join(format!("kiln-{}-magic", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    let p = d.join("bad.gguf");
    std::fs::write(&p, b"X\x1bX\xffabcdefgh").unwrap();
    let e = load_err(&p);
    assert!(
        e.contains(r#"magic is "X\x1bX\xff""#) && e.contains("58 1b 58 ff"),
        "{e}"
    );
}

/// A safetensors file with the given header and `data` bytes after it.
fn safetensors_bytes(header: &str, data: usize) -> Vec<u8> {
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.resize(bytes.len() + data, 0);
    bytes
}

#[test]
fn safetensors_errors_name_the_tensor() {
    for (i, (header, data)) in [
        // The element count overflows usize.
        (
            r#"{"model.embed_tokens.weight":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}}"#,
            8,
        ),
        // The range does not match the shape.
        (
            r#"{"model.embed_tokens.weight":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#,
            8,
        ),
        // The range lies past the end of the file.
        (
            r#"{"model.embed_tokens.weight":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#,
            8,
        ),
        // No shape.
        (
            r#"{"model.embed_tokens.weight":{"dtype":"F32","data_offsets":[0,8]}}"#,
            8,
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let d = copy_fixture("llama_tied", &format!("st-{i}"));
        std::fs::write(d.join("model.safetensors"), safetensors_bytes(header, data)).unwrap();
        let e = load_err(&d);
        assert!(
            e.contains("model.safetensors") && e.contains("`model.embed_tokens.weight`"),
            "case {i}: {e}"
        );
    }
}

#[test]
fn control_characters_from_files_are_escaped() {
    let d = copy_fixture("llama_tied", "esc");
    edit_config(&d, |c| c["model_type"] = "\u{1b}[2Jevil\u{9b}".into());
    let e = load_err(&d);
    assert!(e.contains(r"`\u{1b}[2Jevil\u{9b}`"), "{e}");
    assert!(!e.chars().any(char::is_control), "{e:?}");
    // A tensor name in a safetensors header.
    let d = copy_fixture("llama_tied", "esc-tensor");
    let header = r#"{"bad\u001b]0;title\u0007":{"dtype":"I32","shape":[2],"data_offsets":[0,8]}}"#;
    std::fs::write(d.join("model.safetensors"), safetensors_bytes(header, 8)).unwrap();
    let e = load_err(&d);
    assert!(e.contains(r"bad\u{1b}]0;title\u{7}"), "{e}");
    assert!(!e.chars().any(char::is_control), "{e:?}");
}

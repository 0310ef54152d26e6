//! The `kiln` binary end to end: `--json` output checked against the transformers reference,
//! streaming output, chat mode, and clear failures.

mod common;

use std::process::Command;

use common::{fixtures, Reference};
use serde_json::Value;

fn kiln(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn json_output_reproduces_reference_greedy_tokens() {
    for (model, reference) in [
        ("llama_tied", "llama_tied/reference.safetensors"),
        ("nanochat", "nanochat/reference.safetensors"),
        (
            "llama_tied.q4_1.gguf",
            "llama_tied.q4_1.reference.safetensors",
        ),
    ] {
        let r = Reference::load(&fixtures().join(reference));
        let ids: Vec<String> = r.prompt_ids.iter().map(u32::to_string).collect();
        let model_path = fixtures().join(model);
        let out = kiln(&[
            "-m",
            model_path.to_str().unwrap(),
            "--prompt-ids",
            &ids.join(","),
            "-n",
            "17",
            "--ignore-eos",
            "--json",
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        let got: Vec<u32> = v["generated_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(got, r.generated_ids, "{model}");
        let prompt: Vec<u32> = v["prompt_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(prompt, r.prompt_ids);
        assert_eq!(v["finish_reason"], "max_tokens");
        assert!(v["decode_tokens_per_s"].as_f64().unwrap() > 0.0);
        assert!(v["text"].is_string());
    }
}

#[test]
fn text_prompt_streams_and_reports_speed() {
    let model = fixtures().join("llama_tied");
    let out = kiln(&[
        "-m",
        model.to_str().unwrap(),
        "-p",
        "The 3 cats",
        "-n",
        "8",
        "--ignore-eos",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!out.stdout.is_empty());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("decode: 7 tokens") && err.contains("tok/s"),
        "{err}"
    );
    let out = kiln(&[
        "-m",
        model.to_str().unwrap(),
        "--chat",
        "-p",
        "Hi",
        "-n",
        "4",
        "--json",
        "--temp",
        "0.8",
        "--seed",
        "3",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    // ChatML: <|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n
    assert_eq!(v["prompt_ids"][0], 1);
}

#[test]
fn failures_exit_nonzero_with_a_message() {
    let out = kiln(&["-m", "/nonexistent", "-p", "x"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent"));
    let model = fixtures().join("llama_tied");
    let out = kiln(&["-m", model.to_str().unwrap(), "--prompt-ids", "5,999"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("999"));
    let out = kiln(&["-m", model.to_str().unwrap(), "-p", "x", "--temp=-1"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("temperature"));
}

#[test]
fn samples_json_reports_every_row() {
    let model = fixtures().join("llama_tied");
    let out = kiln(&[
        "-m",
        model.to_str().unwrap(),
        "-p",
        "The 3 cats",
        "-n",
        "6",
        "--samples",
        "3",
        "--temp",
        "1",
        "--seed",
        "4",
        "--ignore-eos",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let rows = v["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 3);
    for r in rows {
        assert_eq!(r["generated_ids"].as_array().unwrap().len(), 6);
        assert_eq!(r["masks"].as_array().unwrap().len(), 6);
        assert_eq!(r["finish_reason"], "max_tokens");
    }
    assert_eq!(v["usage"]["completion_tokens"], 18);
    let distinct: std::collections::HashSet<String> = rows
        .iter()
        .map(|r| r["generated_ids"].to_string())
        .collect();
    assert!(distinct.len() > 1, "three samples were identical");
}

/// `--regex`, `--json-schema` and `--grammar` hold every sampled row to their constraint (the
/// rows that complete end with `constraint_end`), and bad input is refused naming the flag and
/// the file.
#[test]
fn constraint_flags_hold_output_and_name_bad_input() {
    let model = fixtures().join("llama_tied");
    let m = model.to_str().unwrap();
    let run = |flags: &[&str]| {
        let mut args = vec!["-m", m, "-p", "The 3 cats", "-n", "60", "--temp", "1"];
        args.extend_from_slice(&["--samples", "3", "--json"]);
        args.extend_from_slice(flags);
        let out = kiln(&args);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        v["rows"].as_array().unwrap().clone()
    };
    let rx = regex::Regex::new(r"^[0-9]{3}-[a-z]{2,4}$").unwrap();
    for row in run(&["--regex", "[0-9]{3}-[a-z]{2,4}"]) {
        assert_eq!(row["finish_reason"], "constraint_end", "{row}");
        assert!(rx.is_match(row["text"].as_str().unwrap()), "{row}");
    }
    let dir = std::env::temp_dir().join(format!("kiln-cli-constraints-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // Compact and short: a random-weight model completes it well within the budget.
    let schema = dir.join("small.schema.json");
    let small = r#"{"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
        "maximum": 99}, "ok": {"type": "boolean"}}, "required": ["n", "ok"],
        "additionalProperties": false, "x-guidance": {"whitespace_flexible": false}}"#;
    std::fs::write(&schema, small).unwrap();
    for row in run(&["--json-schema", schema.to_str().unwrap()]) {
        assert_eq!(row["finish_reason"], "constraint_end", "{row}");
        let v: Value = serde_json::from_str(row["text"].as_str().unwrap()).unwrap();
        assert!(v["n"].as_u64().is_some_and(|n| n <= 99), "{row}");
        assert!(
            v["ok"].is_boolean() && v.as_object().unwrap().len() == 2,
            "{row}"
        );
    }
    // The grammar allows long lists; rows that complete parse.
    let grammar = fixtures().join("constraints/int_lists.lark");
    for row in run(&["--grammar", grammar.to_str().unwrap()]) {
        let text = row["text"].as_str().unwrap();
        assert!(text.starts_with('['), "{row}");
        if row["finish_reason"] == "constraint_end" {
            let v: Value = serde_json::from_str(text).unwrap();
            assert!(v.is_array(), "{row}");
        }
    }

    let bad_schema = dir.join("bad.schema.json");
    std::fs::write(&bad_schema, r#"{"type": "objekt"}"#).unwrap();
    let not_json = dir.join("not.json");
    std::fs::write(&not_json, "type: object").unwrap();
    let bad_grammar = dir.join("bad.lark");
    std::fs::write(&bad_grammar, "start: undefined_rule\n").unwrap();
    let missing = dir.join("missing.lark");
    let cases: [(&str, &std::path::Path, &str); 4] = [
        ("--json-schema", &bad_schema, "objekt"),
        ("--json-schema", &not_json, "not a JSON document"),
        ("--grammar", &bad_grammar, "undefined_rule"),
        ("--grammar", &missing, "cannot read"),
    ];
    for (flag, path, why) in cases {
        let out = kiln(&["-m", m, "-p", "x", flag, path.to_str().unwrap()]);
        assert_eq!(out.status.code(), Some(1));
        let err = String::from_utf8_lossy(&out.stderr);
        let named = format!("{flag} {}", path.display());
        assert!(err.contains(&named) && err.contains(why), "{err}");
    }
    let out = kiln(&["-m", m, "-p", "x", "--regex", "[0-9"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--regex \"[0-9\": regex"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A file that fails to load is named once in the message (the binaries used to add their own
/// `loading PATH:` in front of the loader's `PATH: ...`), by kiln and kiln-dump alike.
#[test]
fn a_bad_model_file_is_named_once() {
    let dir = std::env::temp_dir().join(format!("kiln-named-once-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("broken.gguf");
    std::fs::write(&path, b"GGUF\x03\x00\x00\x00truncated").unwrap();
    let p = path.to_str().unwrap();
    for out in [
        kiln(&["-m", p, "-p", "hi"]),
        Command::new(env!("CARGO_BIN_EXE_kiln-dump"))
            .args(["-m", p])
            .output()
            .unwrap(),
    ] {
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert_eq!(
            err.matches(p).count(),
            1,
            "path not named exactly once: {err}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

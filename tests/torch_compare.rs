//! `scripts/torch_compare.py` against `kiln-bench`: both read src/model/synthetic_shapes.json and
//! must count the same bytes per token for every shape and batch size (so the two "% of
//! bandwidth" figures in docs/gpu-results.md divide by the same number), and without PyTorch or a
//! GPU the script refuses with one line, not a traceback. Needs `python3` (the standard library
//! suffices for these checks); skipped with a message without it.

use std::process::{Command, Output};

use serde_json::Value;

fn python() -> Option<String> {
    let py = std::env::var("KILN_PYTHON").unwrap_or_else(|_| "python3".into());
    let ok = Command::new(&py)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        eprintln!("SKIPPED: no `{py}` to run scripts/torch_compare.py (set KILN_PYTHON)");
    }
    ok.then_some(py)
}

fn script(py: &str, args: &[&str]) -> Output {
    Command::new(py)
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/scripts/torch_compare.py"
        ))
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn python_and_rust_count_the_same_bytes_per_token() {
    let Some(py) = python() else { return };
    for shape in ["tiny", "smollm2-135m", "llama-3.2-1b"] {
        let out = script(
            &py,
            &[
                "--dry-run",
                "--model",
                shape,
                "-n",
                "37",
                "--batch",
                "1,3,8",
            ],
        );
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let torch: Vec<Value> = String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let out = Command::new(env!("CARGO_BIN_EXE_kiln-bench"))
            .args(["--synthetic", shape, "--bytes-per-token", "-n", "37"])
            .args(["--batch", "1,3,8", "-o", "json"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let kiln: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(torch.len(), 3);
        assert_eq!(kiln.len(), 3);
        for (t, k) in torch.iter().zip(&kiln) {
            for key in [
                "batch",
                "context",
                "weights",
                "kv_read",
                "kv_write",
                "bytes_per_step",
            ] {
                assert_eq!(t[key], k[key], "{shape} {key}");
            }
            assert_eq!(t["bytes_per_token"].as_f64(), k["bytes_per_token"].as_f64());
        }
    }
}

#[test]
fn without_torch_or_a_gpu_it_refuses_in_one_line() {
    let Some(py) = python() else { return };
    let out = script(
        &py,
        &[
            "--model",
            "tiny",
            "-n",
            "2",
            "-r",
            "1",
            "--warmup",
            "0",
            "--no-compile",
        ],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("Traceback"), "{err}");
    if out.status.success() {
        // A GPU with PyTorch: one JSON line with a speed.
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert!(v["tokens_per_s"].as_f64().unwrap() > 0.0);
    } else {
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(
            err.contains("PyTorch and transformers are needed")
                || err.contains("no CUDA GPU visible to PyTorch"),
            "{err}"
        );
    }
    for bad in [
        &["--batch", "0"][..],
        &["--batch", "x"],
        &["--model", "nope", "--dry-run"],
        &["-n", "0", "--dry-run"],
    ] {
        let out = script(&py, bad);
        assert_eq!(out.status.code(), Some(2), "{bad:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.starts_with("torch_compare: ") && !err.contains("Traceback"),
            "{err}"
        );
    }
}

#[test]
fn a_cpu_run_prints_one_json_line_per_batch() {
    let Some(py) = python() else { return };
    let has_torch = Command::new(&py)
        .args(["-c", "import torch, transformers"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !has_torch {
        eprintln!(
            "SKIPPED: `{py}` has no torch + transformers (set KILN_PYTHON to a venv with them)"
        );
        return;
    }
    let out = script(
        &py,
        &[
            "--model",
            "tiny",
            "--device",
            "cpu",
            "--no-compile",
            "-n",
            "3",
            "-r",
            "2",
            "--warmup",
            "1",
            "--batch",
            "1,2",
            "--bandwidth-gbs",
            "10",
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2);
    for (v, b) in lines.iter().zip([1u64, 2]) {
        assert_eq!(v["batch"], b);
        assert_eq!(v["samples_ms"].as_array().unwrap().len(), 2);
        let (ts, ms) = (
            v["tokens_per_s"].as_f64().unwrap(),
            v["ms_per_token"].as_f64().unwrap(),
        );
        assert!(ts > 0.0 && (ts * ms / 1e3 - 1.0).abs() < 1e-9);
        let bytes = v["bytes_per_token"].as_f64().unwrap();
        let pct = v["roofline_pct"].as_f64().unwrap();
        assert!((pct - bytes / 10e9 / (ms / 1e3) * 100.0).abs() < 1e-9 * pct);
        assert_eq!(v["graph_breaks"], 0);
    }
}

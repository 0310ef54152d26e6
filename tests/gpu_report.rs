//! `scripts/gpu_report.py`, the part of `scripts/gpu-check.sh` that judges and tabulates: greedy
//! ids compared row by row, and the final table joining kiln-bench rows with PyTorch's number for
//! the same model and batch. Fed a real kiln-bench run on the `tiny` shape and a hand-written
//! PyTorch line. Needs `python3`; skipped with a message without it.

use std::path::Path;
use std::process::{Command, Output};

use serde_json::{json, Value};

fn python() -> Option<String> {
    let py = std::env::var("KILN_PYTHON").unwrap_or_else(|_| "python3".into());
    let ok = Command::new(&py)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        eprintln!("SKIPPED: no `{py}` to run scripts/gpu_report.py (set KILN_PYTHON)");
    }
    ok.then_some(py)
}

fn report(py: &str, args: &[&str]) -> Output {
    Command::new(py)
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/scripts/gpu_report.py"
        ))
        .args(args)
        .output()
        .unwrap()
}

fn scratch(tag: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("kiln-gpu-report-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn write(path: &Path, v: &Value) {
    std::fs::write(path, serde_json::to_vec(v).unwrap()).unwrap();
}

#[test]
fn compare_finds_the_first_divergence_in_any_row() {
    let Some(py) = python() else { return };
    let d = scratch("compare");
    let (r, same, diff, short) = (
        d.join("ref.json"),
        d.join("same.json"),
        d.join("diff.json"),
        d.join("short.json"),
    );
    write(&r, &json!({"generated_ids": [5, 6, 7, 8]}));
    let rows = |rows: Vec<Vec<u32>>| json!({"rows": rows.into_iter().map(|g| json!({"generated_ids": g})).collect::<Vec<_>>()});
    write(&same, &rows(vec![vec![5, 6, 7, 8]; 3]));
    write(&diff, &rows(vec![vec![5, 6, 7, 8], vec![5, 6, 9, 8]]));
    write(&short, &json!({"generated_ids": [5, 6, 7]}));
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let out = report(&py, &["compare", &s(&r), &s(&same)]);
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "identical 4/4 tokens in 3 rows\n"
    );
    let out = report(&py, &["compare", &s(&r), &s(&diff)]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "row 1 diverges at token 2 of 4: 9 instead of 7\n"
    );
    let out = report(&py, &["compare", &s(&r), &s(&short)]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stdout).contains("at token 3 of 4: end instead of 8"));
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn the_table_joins_kiln_and_torch_by_model_and_batch() {
    let Some(py) = python() else { return };
    let d = scratch("table");
    let bench = Command::new(env!("CARGO_BIN_EXE_kiln-bench"))
        .args([
            "--synthetic",
            "tiny",
            "-p",
            "0",
            "-n",
            "2",
            "--batch",
            "1,2",
        ])
        .args(["-r", "1", "-t", "1", "-o", "json", "--bandwidth-gbs", "20"])
        .output()
        .unwrap();
    assert!(
        bench.status.success(),
        "{}",
        String::from_utf8_lossy(&bench.stderr)
    );
    std::fs::write(d.join("bench__tiny__megakernel.json"), &bench.stdout).unwrap();
    let rows: Vec<Value> = serde_json::from_slice(&bench.stdout).unwrap();
    let kiln_ts = rows[0]["tokens_per_s"].as_f64().unwrap();
    // PyTorch at batch 1 only, at half kiln's speed: the ratio column reads 2.00 there.
    let torch = json!({"tokens_per_s": kiln_ts / 2.0, "batch": 1, "num_params": 102_720});
    std::fs::write(d.join("torch-tiny.jsonl"), format!("{torch}\nnot json\n")).unwrap();
    write(
        &d.join("bandwidth-kiln.json"),
        &json!({"bytes_per_s": 3.0e12, "median_ms": 0.7158, "bytes_moved": 2u64 << 30}),
    );
    std::fs::write(
        d.join("stages.tsv"),
        "build\tpass\t95\nbench:tiny:megakernel\tFAIL (exit 1): error: no GPU\t2\n",
    )
    .unwrap();
    let out = report(&py, &["table", d.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.contains("| build                 | 95 s | pass"),
        "{text}"
    );
    assert!(text.contains("FAIL (exit 1): error: no GPU"), "{text}");
    assert!(
        text.contains("bandwidth-kiln: 3000.0 GB/s (median 0.716 ms for 2.00 GiB"),
        "{text}"
    );
    let lines: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("tiny (synthetic)"))
        .collect();
    assert_eq!(lines.len(), 2, "{text}");
    let cells = |l: &str| -> Vec<String> { l.split('|').map(|c| c.trim().to_string()).collect() };
    let (b1, b2) = (cells(lines[0]), cells(lines[1]));
    assert_eq!((b1[2].as_str(), b1[4].as_str()), ("megakernel", "1"));
    assert_eq!(b1[10], "2.00", "{text}");
    assert_eq!(
        (b2[4].as_str(), b2[9].as_str(), b2[10].as_str()),
        ("2", "-", "-")
    );
    let _ = std::fs::remove_dir_all(&d);
}

//! `kiln-bench` end to end on a tiny fixture: the JSON has every column and the raw samples,
//! the Markdown table has llama-bench's shape, and `--device cuda` fails cleanly.

mod common;

use std::process::Command;

use common::fixtures;
use serde_json::Value;

fn bench(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_kiln-bench"))
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn json_has_every_column_and_the_samples() {
    let model = fixtures().join("llama_tied");
    let out = bench(&[
        "-m",
        model.to_str().unwrap(),
        "-p",
        "8",
        "-n",
        "4",
        "-r",
        "1",
        "-t",
        "1",
        "-o",
        "json",
        "--bandwidth-mib",
        "32",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let rows = v.as_array().unwrap();
    assert_eq!(rows.len(), 2);
    for (row, test) in rows.iter().zip(["pp8", "tg4"]) {
        assert_eq!(row["test"], test);
        assert_eq!(row["model"], "llama_tied");
        assert_eq!(row["threads"], 1);
        assert!(row["backend"].as_str().unwrap().starts_with("CPU ("));
        for key in ["size", "params", "type"] {
            assert!(!row[key].as_str().unwrap().is_empty(), "{key}");
        }
        for key in [
            "size_bytes",
            "n_params",
            "tokens_per_s",
            "ms_per_token",
            "bytes_per_token",
            "bandwidth_bytes_per_s",
            "roofline_pct",
        ] {
            assert!(row[key].as_f64().unwrap() > 0.0, "{key}: {}", row[key]);
        }
        assert_eq!(row["tokens_per_s_sd"], 0.0);
        assert_eq!(row["samples_ns"].as_array().unwrap().len(), 1);
        assert_eq!(row["samples_ts"].as_array().unwrap().len(), 1);
    }
    assert_eq!(rows[0]["n_prompt"], 8);
    assert_eq!(rows[1]["n_gen"], 4);
}

#[test]
fn markdown_table_and_disabled_tests() {
    let model = fixtures().join("nanochat");
    let out = bench(&[
        "-m",
        model.to_str().unwrap(),
        "-p",
        "0",
        "-n",
        "2,3",
        "-r",
        "2",
        "-t",
        "1",
        "--bandwidth-mib",
        "32",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let table = String::from_utf8(out.stdout).unwrap();
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(lines.len(), 4, "{table}");
    assert!(
        lines[0].starts_with("| model")
            && lines[0].contains(" t/s |")
            && lines[0].contains("roofline %")
    );
    assert!(lines[2].contains("tg2") && lines[3].contains("tg3") && lines[2].contains(" ± "));
    assert!(String::from_utf8_lossy(&out.stderr).contains("memory bandwidth"));
}

#[test]
fn cuda_reports_that_it_does_not_exist() {
    let model = fixtures().join("llama_tied");
    let out = bench(&["-m", model.to_str().unwrap(), "--device", "cuda"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot time the GPU yet"));
}

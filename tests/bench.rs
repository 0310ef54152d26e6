//! `kiln-bench` end to end on tiny fixtures and synthetic models: the JSON has every column and
//! the raw samples, the Markdown table has llama-bench's shape, batch sizes, a given bandwidth and
//! the bytes-per-token model reach the report, and `--device cuda` fails cleanly.

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

/// `--profile` breaks down a prefill as it does decode steps: one row per kind of instruction,
/// with the plan's bytes and flops over the measured time.
#[test]
fn profile_breaks_down_prefill_and_decode() {
    let model = fixtures().join("llama_tied");
    let out = bench(&[
        "-m",
        model.to_str().unwrap(),
        "-p",
        "8",
        "-n",
        "4",
        "-r",
        "2",
        "-t",
        "1",
        "--bandwidth-mib",
        "32",
        "--profile",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    for header in [
        "prefill profile over 2 runs of 8 tokens",
        "decode profile over 5 steps of 1 sequences",
    ] {
        let at = err
            .find(header)
            .unwrap_or_else(|| panic!("{header}:\n{err}"));
        let table: Vec<&str> = err[at..]
            .lines()
            .skip(1)
            .take_while(|l| l.starts_with('|'))
            .collect();
        assert_eq!(
            table[0], "| op | count | ms/step | share | bytes/step | GB/s | GFLOP/s |",
            "{err}"
        );
        // A matmul row: count, times and rates parse, flops measured.
        let row = table
            .iter()
            .find(|l| l.contains("(matmul)"))
            .unwrap_or_else(|| panic!("no matmul row:\n{err}"));
        let cells: Vec<&str> = row.trim_matches('|').split('|').map(str::trim).collect();
        assert_eq!(cells.len(), 7, "{row}");
        assert!(cells[1].parse::<usize>().unwrap() >= 1, "{row}");
        assert!(cells[6].parse::<f64>().unwrap() > 0.0, "{row}");
    }
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
#[cfg(feature = "cuda")]
fn cuda_without_a_gpu_is_one_clear_error() {
    if kiln::backend::cuda::probe().is_ok() {
        println!("SKIPPED: a GPU is present (this checks the failure without one)");
        return;
    }
    let model = fixtures().join("llama_tied");
    // With a bandwidth given, the first thing to fail is starting the CUDA engine.
    for extra in [&[][..], &["--bandwidth-gbs", "1000"][..]] {
        let mut a = vec!["-m", model.to_str().unwrap(), "--device", "cuda"];
        a.extend_from_slice(extra);
        let out = bench(&a);
        assert_eq!(out.status.code(), Some(1));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("CUDA") || err.contains("cuda"), "{err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}

#[test]
fn synthetic_models_bench_at_every_batch_size_against_a_given_bandwidth() {
    let out = bench(&[
        "--synthetic",
        "tiny",
        "-p",
        "4",
        "-n",
        "3",
        "--batch",
        "1,2",
        "-r",
        "1",
        "-t",
        "1",
        "-o",
        "json",
        "--bandwidth-gbs",
        "50",
        "--seed",
        "7",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !stderr.contains("memory bandwidth"),
        "measured anyway: {stderr}"
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let rows = v.as_array().unwrap();
    let tests: Vec<(&str, u64)> = rows
        .iter()
        .map(|r| (r["test"].as_str().unwrap(), r["batch"].as_u64().unwrap()))
        .collect();
    assert_eq!(tests, [("pp4", 1), ("tg3", 1), ("tg3", 2)]);
    for r in rows {
        assert_eq!(r["model"], "tiny (synthetic)");
        assert_eq!(r["model_path"], "synthetic:tiny seed=7");
        assert_eq!(r["type"], "bf16");
        assert_eq!(r["bandwidth_bytes_per_s"], 50e9);
        assert_eq!(r["bandwidth_source"], "given: 50.0 GB/s");
        let (bytes, ms) = (
            r["bytes_per_token"].as_f64().unwrap(),
            r["ms_per_token"].as_f64().unwrap(),
        );
        let want = bytes / 50e9 / (ms / 1e3) * 100.0;
        assert!((r["roofline_pct"].as_f64().unwrap() - want).abs() < 1e-9 * want);
    }
    // A batch of 2 shares the weights: fewer bytes per token than batch 1.
    assert!(rows[2]["bytes_per_token"].as_f64() < rows[1]["bytes_per_token"].as_f64());
}

#[test]
fn bytes_per_token_of_the_1b_shape_without_building_it() {
    let out = bench(&[
        "--synthetic",
        "llama-3.2-1b",
        "--bytes-per-token",
        "-n",
        "128",
        "--batch",
        "1,8",
        "-o",
        "json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let rows = v.as_array().unwrap();
    assert_eq!(rows.len(), 2);
    for (r, b) in rows.iter().zip([1u64, 8]) {
        assert_eq!(r["batch"], b);
        assert_eq!(r["context"], 66);
        // bf16: every parameter once plus one embedding row per sequence.
        assert_eq!(r["weights"], 2 * (1_235_814_400 + 2048 * b));
        // 16 layers, K and V, 8 KV heads of 64, bf16: 32 KiB per position.
        assert_eq!(r["kv_read"], 32_768 * 66 * b);
        assert_eq!(r["kv_write"], 32_768 * b);
        let total = r["bytes_per_step"].as_u64().unwrap();
        assert_eq!(
            r["bytes_per_token"].as_f64().unwrap(),
            total as f64 / b as f64
        );
    }
}

#[test]
fn gpu_bandwidth_is_measured_or_refused_with_a_reason() {
    let out = bench(&[
        "--measure-gpu-bandwidth",
        "--bandwidth-mib",
        "64",
        "-o",
        "json",
    ]);
    if out.status.success() {
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert!(v["bytes_per_s"].as_f64().unwrap() > 1e11, "{v}");
        assert_eq!(v["samples_ms"].as_array().unwrap().len(), 20);
    } else {
        // No GPU here: a one-line error, not a panic.
        assert_eq!(out.status.code(), Some(1));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.starts_with("error: measuring GPU bandwidth: ") || err.contains("no CUDA support"),
            "{err}"
        );
    }
}

#[test]
fn unknown_shapes_and_missing_models_are_errors() {
    let out = bench(&["--synthetic", "llama-9000", "-p", "0", "-n", "1"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no synthetic shape named `llama-9000`") && err.contains("llama-3.2-1b"));
    let out = bench(&["-p", "1"]);
    assert_eq!(out.status.code(), Some(2), "clap: a model is required");
    let out = bench(&["--synthetic", "tiny", "--batch", "0"]);
    assert_eq!(out.status.code(), Some(1));
}

#[test]
fn the_synthetic_smollm2_shape_is_the_demo_models_config() {
    let Some(demo) = common::demo_model() else {
        eprintln!("SKIPPED: demo model absent (scripts/fetch_demo_model.sh)");
        return;
    };
    let real = kiln::model::Model::load(&demo).unwrap().config;
    let (syn, _) = kiln::model::synthetic::shape_config("smollm2-135m").unwrap();
    let shape = |c: &kiln::model::ModelConfig| {
        (
            c.hidden_size,
            c.num_layers,
            c.num_heads,
            c.num_kv_heads,
            c.head_dim,
            c.intermediate_size,
            c.vocab_size,
            c.max_position_embeddings,
            c.tie_word_embeddings,
            c.attention_bias,
        )
    };
    assert_eq!(shape(&real), shape(&syn));
    assert_eq!(
        (real.rope_theta, real.rope_scaling, real.rms_norm_eps),
        (syn.rope_theta, syn.rope_scaling, syn.rms_norm_eps)
    );
    assert_eq!(real.num_params(), syn.num_params());
}

/// The engine (what `kiln-bench --device cuda` times) generates from a synthetic model: its
/// bytes-only tokenizer has an entry for every id of the model's vocabulary, so the text of
/// random-weight output decodes. Before, ids from 256 up were refused ("token id 9552 is
/// outside the vocabulary of 256 tokens", the first GPU run's synthetic benches).
#[test]
fn synthetic_models_generate_text_through_the_engine() {
    use std::sync::Arc;

    use kiln::backend::cpu::CpuOptions;
    use kiln::engine::{Engine, GenerateOptions};

    let model = kiln::model::synthetic::load("smollm2-135m", 7).unwrap();
    let vocab = model.config.vocab_size;
    assert_eq!(model.tokenizer.vocab_size(), vocab);
    let engine = Arc::new(Engine::from_model(model, CpuOptions::default()).unwrap());
    let opts = GenerateOptions {
        max_tokens: Some(6),
        stop_tokens: Some(Vec::new()),
        tools: false,
        ..GenerateOptions::default()
    };
    let out = engine.generate_batch(&[1], &opts).unwrap();
    let row = &out.rows[0];
    assert_eq!(row.generated.len(), 6);
    if row.generated.iter().all(|&id| id >= 256) {
        let expected: String = row.generated.iter().map(|id| format!("<{id}>")).collect();
        assert_eq!(row.text, expected);
    }
    assert!(
        row.generated.iter().any(|&id| id >= 256),
        "{:?}",
        row.generated
    );
}

/// `--precompile-cuda` fills the on-disk kernel cache without a GPU: every per-op source and the
/// megakernel of each --batch size's bucket (3 rows: bucket 4), compiled the first time and read
/// from the cache the second; a batch past the largest bucket is an error naming it. Skipped
/// where NVRTC or the CUDA headers are missing (CI has both).
#[test]
fn precompile_cuda_fills_the_kernel_cache_without_a_gpu() {
    let cache = std::env::temp_dir().join(format!("kiln-precompile-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&cache);
    let run = |batch: &str| {
        Command::new(env!("CARGO_BIN_EXE_kiln-bench"))
            .args([
                "--synthetic",
                "tiny",
                "--precompile-cuda",
                "90",
                "--batch",
                batch,
            ])
            .env("XDG_CACHE_HOME", &cache)
            .env_remove("KILN_MK_SPLIT")
            .env_remove("KILN_MK_PRELOAD")
            .env_remove("KILN_MK_STAGE")
            .env_remove("KILN_MK_MATVEC_ROWS")
            .output()
            .unwrap()
    };
    let out = run("1,3");
    let err = String::from_utf8_lossy(&out.stderr);
    if err.contains("NVRTC not found")
        || err.contains("CUDA headers (cuda_bf16.h) not found")
        || err.contains("built without the `cuda` feature")
    {
        println!("SKIPPED precompile: {}", err.trim());
        return;
    }
    assert!(out.status.success(), "{err}");
    let lines = |o: &std::process::Output| -> Vec<(String, String)> {
        String::from_utf8_lossy(&o.stdout)
            .lines()
            .map(|l| {
                let f: Vec<&str> = l.split('\t').collect();
                assert_eq!(f.len(), 5, "{l}");
                assert_eq!(f[1], "sm_90", "{l}");
                (f[2].to_string(), f[3].to_string())
            })
            .collect()
    };
    let first = lines(&out);
    let files: Vec<&str> = first.iter().map(|(f, _)| f.as_str()).collect();
    for want in [
        "gemv.cu",
        "sample.cu",
        "kiln_decode_step_b1.cu",
        "kiln_decode_step_b4.cu",
    ] {
        assert!(files.contains(&want), "{want} missing from {files:?}");
    }
    assert!(!files.contains(&"kiln_decode_step_b2.cu"), "{files:?}");
    assert!(first.iter().all(|(_, how)| how == "compiled"), "{first:?}");
    let cubins = std::fs::read_dir(cache.join("kiln")).unwrap().count();
    assert_eq!(cubins, first.len(), "one cubin per source");

    let again = run("3,1");
    assert!(again.status.success());
    let second = lines(&again);
    assert_eq!(second.len(), first.len());
    assert!(second.iter().all(|(_, how)| how == "cached"), "{second:?}");

    let out = run("9");
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("batch 9") && err.contains("8 rows"), "{err}");
    let _ = std::fs::remove_dir_all(&cache);
}

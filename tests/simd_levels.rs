//! Every SIMD level this CPU supports, forced through whole models. The kernel tests compare each
//! level's kernels against a reference one call at a time; this runs the full pipeline (norms,
//! rope, attention, every matmul format, the KV cache) with the process pinned to one level by
//! `KILN_SIMD`, which is read once per process, so each level runs in a child process of this
//! test binary:
//! - the tiny fixtures (f32 safetensors; GGUF f32, bf16, q8_0, q4_0, q4_1) against the logits
//!   transformers computed for them, prefill and 16 greedy decode steps, as `tests/reference.rs`
//!   does at the detected level;
//! - the demo model (when fetched), prefill and decode with fixed tokens, against the scalar
//!   level's logits.
//!
//! The parent prints which levels it tested and which this CPU cannot run (see it with
//! `cargo test --release --test simd_levels -- --nocapture`; CI does).

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{fixtures, rel_err, Reference};
use kiln::backend::cpu::simd::{self, Level};
use kiln::backend::cpu::{CpuBackend, CpuOptions, Workspace};
use kiln::backend::TokenRow;
use kiln::model::Model;
use kiln::plan::PlanKind;
use kiln::sample::argmax;

/// Where the child writes the demo model's logits; set only in the child.
const CHILD_OUT: &str = "KILN_SIMD_LEVEL_CHILD_OUT";
/// The fixtures against their transformers reference, as in tests/reference.rs.
const FIXTURE_TOLERANCE: f32 = 1e-4;
/// The demo model at any level against the scalar level, where only the summation order should
/// differ: measured at most 2.3e-6 over 30 layers (AMD EPYC, avx2/avx512/avx512bf16), so a
/// level whose numerics drift further than the fixtures' own tolerance fails.
const DEMO_TOLERANCE: f32 = 1e-4;
/// Demo model: prompt tokens, then decode steps.
const DEMO_PROMPT: usize = 6;
const DEMO_STEPS: usize = 4;

const FIXTURES: [(&str, &str); 6] = [
    ("llama_tied", "llama_tied/reference.safetensors"),
    (
        "llama_tied.f32.gguf",
        "llama_tied.f32.reference.safetensors",
    ),
    (
        "llama_tied.bf16.gguf",
        "llama_tied.bf16.reference.safetensors",
    ),
    (
        "llama_tied.q8_0.gguf",
        "llama_tied.q8_0.reference.safetensors",
    ),
    (
        "llama_tied.q4_0.gguf",
        "llama_tied.q4_0.reference.safetensors",
    ),
    (
        "llama_tied.q4_1.gguf",
        "llama_tied.q4_1.reference.safetensors",
    ),
];

fn backend(model: &Model) -> CpuBackend {
    CpuBackend::new(
        &model.config,
        &model.weights,
        CpuOptions {
            threads: 2,
            ..Default::default()
        },
    )
    .unwrap()
}

/// Prefill logits at every position and 16 greedy steps against the reference.
fn check_fixture(level: Level, model_path: &str, reference: &str) {
    let what = format!("{} at {model_path}", level.name());
    let model = Model::load(fixtures().join(model_path)).unwrap_or_else(|e| panic!("{what}: {e}"));
    let r = Reference::load(&fixtures().join(reference));
    let vocab = model.config.vocab_size;
    let b = backend(&model);
    let p = r.prompt_ids.len();
    let rows: Vec<TokenRow> = (0..p).map(|pos| TokenRow { slot: 0, pos }).collect();
    let mut ws = Workspace::new();
    let mut logits = Vec::new();
    let mut kv = b.new_cache(1, p + 17).unwrap();
    b.forward(
        PlanKind::AllLogits,
        &mut ws,
        &mut kv,
        &r.prompt_ids,
        &rows,
        &mut logits,
    )
    .unwrap();
    for (i, want) in r.prefill_logits.iter().enumerate() {
        let e = rel_err(&logits[i * vocab..(i + 1) * vocab], want);
        assert!(
            e < FIXTURE_TOLERANCE,
            "{what}: prefill position {i}: relative error {e:e}"
        );
    }
    let mut kv = b.new_cache(1, p + 17).unwrap();
    b.forward(
        PlanKind::Prefill,
        &mut ws,
        &mut kv,
        &r.prompt_ids,
        &rows,
        &mut logits,
    )
    .unwrap();
    assert_eq!(argmax(&logits), r.generated_ids[0], "{what}: first token");
    for (step, want) in r.decode_logits.iter().enumerate() {
        let row = TokenRow {
            slot: 0,
            pos: p + step,
        };
        b.forward(
            PlanKind::Decode,
            &mut ws,
            &mut kv,
            &[r.generated_ids[step]],
            &[row],
            &mut logits,
        )
        .unwrap();
        let e = rel_err(&logits, want);
        assert!(
            e < FIXTURE_TOLERANCE,
            "{what}: decode step {step}: relative error {e:e}"
        );
        assert_eq!(
            argmax(&logits),
            r.generated_ids[step + 1],
            "{what}: decode step {step}"
        );
    }
}

/// The demo model's logits after a prefill of fixed tokens and after each of a few decode steps
/// of fixed tokens (the same sequence at every level, whatever each level would pick).
fn demo_logits(model: &Path) -> Vec<Vec<f32>> {
    let model = Model::load(model).unwrap();
    let vocab = model.config.vocab_size;
    let b = backend(&model);
    let ids = kiln::bench::token_ids(DEMO_PROMPT + DEMO_STEPS, vocab, 7);
    let mut ws = Workspace::new();
    let mut kv = b.new_cache(1, ids.len()).unwrap();
    let mut logits = Vec::new();
    let rows: Vec<TokenRow> = (0..DEMO_PROMPT)
        .map(|pos| TokenRow { slot: 0, pos })
        .collect();
    b.forward(
        PlanKind::Prefill,
        &mut ws,
        &mut kv,
        &ids[..DEMO_PROMPT],
        &rows,
        &mut logits,
    )
    .unwrap();
    let mut out = vec![logits.clone()];
    for pos in DEMO_PROMPT..ids.len() {
        let row = TokenRow { slot: 0, pos };
        b.forward(
            PlanKind::Decode,
            &mut ws,
            &mut kv,
            &ids[pos..=pos],
            &[row],
            &mut logits,
        )
        .unwrap();
        out.push(logits.clone());
    }
    out
}

fn write_rows(path: &Path, rows: &[Vec<f32>]) {
    let cols = rows.first().map_or(0, Vec::len) as u64;
    let mut bytes = cols.to_le_bytes().to_vec();
    for v in rows.iter().flatten() {
        bytes.extend_from_slice(&v.to_le_bytes());
    }
    std::fs::write(path, bytes).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
}

fn read_rows(path: &Path) -> Vec<Vec<f32>> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let cols = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let vals: Vec<f32> = bytes[8..]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    vals.chunks(cols.max(1)).map(<[f32]>::to_vec).collect()
}

/// Run by [`every_simd_level_runs_whole_models`] in a child process with `KILN_SIMD` set.
#[test]
#[ignore = "a child of every_simd_level_runs_whole_models, which sets KILN_SIMD"]
fn whole_models_at_the_forced_level() {
    let (Some(out), Some(want)) = (std::env::var_os(CHILD_OUT), std::env::var_os("KILN_SIMD"))
    else {
        panic!("run through every_simd_level_runs_whole_models (needs KILN_SIMD and {CHILD_OUT})");
    };
    let want = Level::parse(&want.to_string_lossy()).expect("KILN_SIMD names a level");
    // The kernels really run at the level asked for (not silently at another).
    assert_eq!(simd::level(), want);
    for (model, reference) in FIXTURES {
        check_fixture(want, model, reference);
    }
    if let Some(demo) = common::demo_model() {
        write_rows(Path::new(&out), &demo_logits(&demo));
    }
}

/// Runs [`whole_models_at_the_forced_level`] in a child process at `level` with `env` besides,
/// its demo logits written to `out`, and asserts that the child ran that test and it passed.
fn run_child(exe: &Path, level: Level, out: &Path, env: &[(&str, &str)]) {
    let result = Command::new(exe)
        .args([
            "--exact",
            "whole_models_at_the_forced_level",
            "--ignored",
            "--test-threads",
            "1",
        ])
        .env("KILN_SIMD", level.name())
        .env(CHILD_OUT, out)
        .envs(env.iter().copied())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&result.stdout);
    assert!(
        result.status.success(),
        "level {} {env:?}: {stdout}\n{}",
        level.name(),
        String::from_utf8_lossy(&result.stderr)
    );
    // The child ran the test (a filter matching nothing would also succeed).
    assert!(
        stdout.contains("1 passed"),
        "level {} {env:?}: {stdout}",
        level.name()
    );
}

#[test]
fn every_simd_level_runs_whole_models() {
    let exe = std::env::current_exe().unwrap();
    let dir = std::env::temp_dir().join(format!("kiln-simd-levels-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut tested = Vec::new();
    let mut untested = Vec::new();
    let mut demo: Vec<(Level, PathBuf)> = Vec::new();
    for level in Level::ALL {
        if !simd::available_levels().contains(&level) {
            untested.push(level.name());
            continue;
        }
        let out = dir.join(format!("{}.logits", level.name()));
        run_child(&exe, level, &out, &[]);
        tested.push(level.name());
        if out.exists() {
            demo.push((level, out));
        }
    }
    if let Some((_, scalar)) = demo.iter().find(|(l, _)| *l == Level::Scalar) {
        let want = read_rows(scalar);
        assert_eq!(want.len(), 1 + DEMO_STEPS);
        for (level, path) in &demo {
            let got = read_rows(path);
            assert_eq!(got.len(), want.len(), "{}", level.name());
            for (step, (g, w)) in got.iter().zip(&want).enumerate() {
                let e = rel_err(g, w);
                println!(
                    "demo model at {}: step {step}: relative error {e:.2e} against scalar",
                    level.name()
                );
                assert!(
                    e < DEMO_TOLERANCE,
                    "demo model at {}: step {step}: relative error {e:e} against scalar",
                    level.name()
                );
            }
        }
    } else {
        println!("demo model absent (scripts/fetch_demo_model.sh): fixtures only");
    }
    // Prefetches are hints: every other prefetch policy (`KILN_PREFETCH`: by default l2 on Intel
    // CPUs, rows on AMD Zen 5, l1 elsewhere) at the best level must give the same logits, bit
    // for bit.
    let best = simd::detected();
    let policy = kiln::backend::cpu::matmul::prefetch_policy();
    if best >= Level::Avx2 {
        for other in ["l1", "l2", "rows"].into_iter().filter(|&p| p != policy) {
            let out = dir.join(format!("{}-prefetch-{other}.logits", best.name()));
            run_child(&exe, best, &out, &[("KILN_PREFETCH", other)]);
            if let Some((_, same_level)) = demo.iter().find(|(l, _)| *l == best) {
                assert!(
                    read_rows(&out) == read_rows(same_level),
                    "demo model at {}: prefetch {other} changed the logits against {policy}",
                    best.name()
                );
                println!(
                    "demo model at {}: prefetch policies {policy} (this CPU's) and {other}: the same logits bit for bit",
                    best.name()
                );
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    // The AMX tiles serve `--numerics bf16` and `int8`, and exact products with bf16 weights
    // (tests/numerics.rs runs the modes through the demo model, the matmul unit tests each
    // kernel against its reference).
    let amx = |n| {
        if kiln::backend::cpu::matmul::amx_tiles(n) {
            "on"
        } else {
            "off"
        }
    };
    println!(
        "SIMD levels tested through whole models: {}; not supported by this CPU: {}; AMX tiles: exact bf16 weights {}, bf16 {}, int8 {}; prefetch policy {policy}",
        tested.join(", "),
        if untested.is_empty() {
            "none".to_string()
        } else {
            untested.join(", ")
        },
        amx(kiln::backend::cpu::matmul::Numerics::Exact),
        amx(kiln::backend::cpu::matmul::Numerics::Bf16),
        amx(kiln::backend::cpu::matmul::Numerics::Int8),
    );
    assert!(tested.contains(&"scalar"));
}

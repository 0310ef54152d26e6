//! The engine on a GPU against the engine on the CPU: `kiln --device cuda` must generate what
//! the CPU generates. Needs a CUDA GPU, driver and NVRTC; without them every test prints
//! `SKIPPED: <reason>` and passes. Run on a GPU machine with `scripts/gpu-check.sh`.
//!
//! * greedy tokens identical on the CPU (weights rounded to bf16, as the GPU holds them), the
//!   per-op CUDA path and the graph-replayed megakernel: 256 steps on SmolLM2-135M, 64 on every
//!   fixture directory;
//! * seeded sampling on the megakernel reproduces across runs, and matches per-op sampling;
//! * a second turn decodes past the positions the first turn's graph ran at (the attention
//!   length comes from the device position, not from the capture).
//!
//! NOT run on a GPU yet (written on machines without one).
#![cfg(feature = "cuda")]

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::{demo_model, fixtures, gpu_or_skip};
use kiln::backend::cpu::{CpuOptions, WeightFormat};
use kiln::engine::{DecodePath, Device, Engine, EngineOptions, GenerateOptions, Session};
use kiln::model::Model;
use kiln::sample::SamplingParams;

fn engine(path: &Path, device: Device, decode: DecodePath) -> Arc<Engine> {
    let model = Model::load(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let opts = EngineOptions {
        device,
        decode,
        cpu: CpuOptions {
            weights: WeightFormat::BF16,
            ..CpuOptions::default()
        },
        ..EngineOptions::default()
    };
    Arc::new(
        Engine::from_model(model, opts)
            .unwrap_or_else(|e| panic!("{} on {device:?}/{decode:?}: {e}", path.display())),
    )
}

/// The CPU, per-op CUDA and (where the model lowers to it) megakernel engines of one model.
fn engines(path: &Path) -> Vec<(String, Arc<Engine>)> {
    let mut v = vec![
        (
            "cpu".to_string(),
            engine(path, Device::Cpu, DecodePath::Auto),
        ),
        (
            "cuda per-op".to_string(),
            engine(path, Device::Cuda, DecodePath::PerOp),
        ),
    ];
    let mk = engine(path, Device::Cuda, DecodePath::Auto);
    if mk.uses_megakernel() {
        v.push(("cuda megakernel".to_string(), mk));
    } else {
        println!(
            "{}: no megakernel (the model does not lower to it)",
            path.display()
        );
    }
    v
}

fn fixture_dirs() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(fixtures())
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.join("config.json").is_file())
        .collect();
    v.sort();
    v
}

fn greedy(n: usize) -> GenerateOptions {
    GenerateOptions {
        max_tokens: Some(n),
        stop_tokens: Some(vec![]),
        tools: false,
        ..GenerateOptions::default()
    }
}

fn check_same(path: &Path, prompt: &[u32], opts: &GenerateOptions) {
    let runs: Vec<(String, Vec<Vec<u32>>)> = engines(path)
        .into_iter()
        .map(|(name, e)| {
            let r = e.generate_batch(prompt, opts).unwrap();
            (name, r.rows.into_iter().map(|r| r.generated).collect())
        })
        .collect();
    let (base_name, base) = &runs[0];
    for (name, got) in &runs[1..] {
        for (row, (a, b)) in base.iter().zip(got).enumerate() {
            let first = a.iter().zip(b).position(|(x, y)| x != y);
            assert!(
                first.is_none() && a.len() == b.len(),
                "{}: row {row}: {name} differs from {base_name} at step {first:?}",
                path.display()
            );
        }
    }
}

#[test]
fn greedy_tokens_match_the_cpu_on_every_fixture() {
    if !gpu_or_skip() {
        return;
    }
    for dir in fixture_dirs() {
        check_same(&dir, &[1, 17, 42, 99], &greedy(64));
    }
}

#[test]
fn smollm2_greedy_256_tokens_match_the_cpu() {
    if !gpu_or_skip() {
        return;
    }
    let Some(path) = demo_model() else {
        println!("SKIPPED: demo model absent (scripts/fetch_demo_model.sh)");
        return;
    };
    let e = engine(&path, Device::Cpu, DecodePath::Auto);
    let prompt = e
        .tokenizer()
        .encode("The three primary colours are")
        .unwrap();
    check_same(&path, &prompt, &greedy(256));
    // Several rows from one prefill at every graph bucket size.
    for rows in [2, 3, 8] {
        check_same(
            &path,
            &prompt,
            &GenerateOptions {
                num_samples: rows,
                ..greedy(48)
            },
        );
    }
}

#[test]
fn seeded_sampling_reproduces_on_the_megakernel() {
    if !gpu_or_skip() {
        return;
    }
    let path = fixtures().join("llama_tied");
    let mk = engine(&path, Device::Cuda, DecodePath::Megakernel);
    let opts = GenerateOptions {
        num_samples: 4,
        sampling: SamplingParams {
            temperature: 0.8,
            top_k: Some(40),
            top_p: Some(0.9),
            seed: 1234,
            ..SamplingParams::default()
        },
        ..greedy(64)
    };
    let a = mk.generate_batch(&[1, 2, 3], &opts).unwrap();
    let b = mk.generate_batch(&[1, 2, 3], &opts).unwrap();
    for (x, y) in a.rows.iter().zip(&b.rows) {
        assert_eq!(x.generated, y.generated, "same seed, same tokens");
    }
    assert_ne!(a.rows[0].generated, a.rows[1].generated, "rows draw apart");
}

#[test]
fn later_turns_attend_past_the_first_graph_positions() {
    if !gpu_or_skip() {
        return;
    }
    let path = fixtures().join("llama_tied");
    let cpu = engine(&path, Device::Cpu, DecodePath::Auto);
    let mk = engine(&path, Device::Cuda, DecodePath::Megakernel);
    let mut a = Session::new(cpu, 1024, 1);
    let mut b = Session::new(mk, 1024, 1);
    let mut prompt = vec![1u32, 5, 9];
    // Turn lengths cross the attention kernel's split boundaries (512 positions).
    for (turn, n) in [40usize, 300, 400].into_iter().enumerate() {
        let ra = a.generate_batch(&prompt, &greedy(n)).unwrap();
        let rb = b.generate_batch(&prompt, &greedy(n)).unwrap();
        assert_eq!(
            ra.rows[0].generated,
            rb.rows[0].generated,
            "turn {turn} (from position {})",
            prompt.len()
        );
        prompt = ra.rows[0].tokens.clone();
        prompt.push(7);
    }
}

//! GPU against CPU. Needs a CUDA GPU, driver and NVRTC; without them every test prints
//! `SKIPPED: <reason>` and passes. Run them on a GPU machine with `scripts/gpu-check.sh`.
//!
//! * every fixture model under `tests/fixtures` (HF directories and GGUF files): prefill logits
//!   at every prompt position and 16 decode steps, GPU within bf16 tolerance of the CPU (the CPU
//!   runs with weights rounded to bf16, as the GPU holds them; the GPU's KV cache is bf16);
//! * the demo model (SmolLM2-135M-Instruct): 128 greedy tokens identical on both.
//!
//! These tests have NOT been run on a GPU yet (written on a machine without one).
#![cfg(feature = "cuda")]

mod common;

use std::path::{Path, PathBuf};

use common::{demo_model, fixtures};
use kiln::backend::cpu::{CpuBackend, CpuOptions, PlanKind, TokenRow, WeightFormat, Workspace};
use kiln::backend::cuda::{probe, CudaBackend, CudaWorkspace};
use kiln::model::Model;
use kiln::sample::argmax;

/// Relative L2 error allowed between GPU and CPU logits (bf16 weights and KV cache on the GPU,
/// different summation order).
const TOLERANCE: f32 = 3e-2;

fn gpu_or_skip() -> bool {
    match probe() {
        Ok((_, info)) => {
            println!("GPU: {info}");
            true
        }
        Err(e) => {
            println!("SKIPPED: {e}");
            false
        }
    }
}

fn models(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    let mut entries: Vec<PathBuf> = rd.flatten().map(|e| e.path()).collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            if p.join("config.json").is_file() {
                out.push(p.clone());
            }
            models(&p, out);
        } else if p.extension().is_some_and(|e| e == "gguf") {
            out.push(p);
        }
    }
}

fn rel_l2(got: &[f32], want: &[f32]) -> f32 {
    let num: f64 = got
        .iter()
        .zip(want)
        .map(|(a, b)| ((a - b) as f64).powi(2))
        .sum();
    let den: f64 = want.iter().map(|b| (*b as f64).powi(2)).sum();
    (num / den.max(1e-30)).sqrt() as f32
}

struct Pair {
    cpu: CpuBackend,
    gpu: CudaBackend,
}

fn pair(path: &Path) -> Option<Pair> {
    let model = Model::load(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let cpu = CpuBackend::new(
        &model.config,
        &model.weights,
        CpuOptions {
            threads: 0,
            weights: WeightFormat::BF16,
        },
    )
    .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    match CudaBackend::new(&model.config, &model.weights) {
        Ok(gpu) => Some(Pair { cpu, gpu }),
        Err(kiln::backend::cuda::CudaError::Unsupported(why)) => {
            println!("{}: not supported on the GPU: {why}", path.display());
            None
        }
        Err(e) => panic!("{}: {e}", path.display()),
    }
}

#[test]
fn gpu_logits_match_cpu_on_every_fixture() {
    if !gpu_or_skip() {
        return;
    }
    let mut paths = Vec::new();
    models(&fixtures(), &mut paths);
    assert!(!paths.is_empty(), "no fixture models found");
    for path in paths {
        let Some(Pair { cpu, gpu }) = pair(&path) else {
            continue;
        };
        let vocab = cpu.config().vocab_size;
        let prompt: Vec<u32> = (0..12).map(|i| (i * 7 + 3) % vocab as u32).collect();
        let rows: Vec<TokenRow> = (0..prompt.len())
            .map(|pos| TokenRow { slot: 0, pos })
            .collect();
        let (mut cws, mut gws) = (Workspace::new(), CudaWorkspace::new());
        let mut ckv = cpu.new_cache(1, 64);
        let mut gkv = gpu.new_cache(1, 64).expect("device cache");
        let (mut cl, mut gl) = (Vec::new(), Vec::new());
        cpu.forward(
            PlanKind::AllLogits,
            &mut cws,
            &mut ckv,
            &prompt,
            &rows,
            &mut cl,
        )
        .expect("cpu prefill");
        gpu.forward(
            PlanKind::AllLogits,
            &mut gws,
            &mut gkv,
            &prompt,
            &rows,
            &mut gl,
        )
        .expect("gpu prefill");
        let e = rel_l2(&gl, &cl);
        println!("{}: prefill rel err {e:.2e}", path.display());
        assert!(e < TOLERANCE, "{}: prefill rel err {e}", path.display());
        let mut tok = argmax(&cl[cl.len() - vocab..]);
        for step in 0..16 {
            let r = [TokenRow {
                slot: 0,
                pos: prompt.len() + step,
            }];
            cpu.forward(PlanKind::Decode, &mut cws, &mut ckv, &[tok], &r, &mut cl)
                .expect("cpu decode");
            gpu.forward(PlanKind::Decode, &mut gws, &mut gkv, &[tok], &r, &mut gl)
                .expect("gpu decode");
            let e = rel_l2(&gl, &cl);
            assert!(
                e < TOLERANCE,
                "{}: decode step {step} rel err {e}",
                path.display()
            );
            tok = argmax(&cl);
        }
    }
}

#[test]
fn greedy_tokens_match_cpu_for_128_steps_on_smollm2() {
    if !gpu_or_skip() {
        return;
    }
    let Some(path) = demo_model() else {
        println!("SKIPPED: demo model not fetched (scripts/fetch_demo_model.sh)");
        return;
    };
    let Some(Pair { cpu, gpu }) = pair(&path) else {
        panic!("the demo model must run on the GPU");
    };
    let prompt: Vec<u32> = vec![1, 504, 3458, 282, 4649, 314, 2];
    let rows: Vec<TokenRow> = (0..prompt.len())
        .map(|pos| TokenRow { slot: 0, pos })
        .collect();
    let (mut cws, mut gws) = (Workspace::new(), CudaWorkspace::new());
    let mut ckv = cpu.new_cache(1, 256);
    let mut gkv = gpu.new_cache(1, 256).expect("device cache");
    let (mut cl, mut gl) = (Vec::new(), Vec::new());
    cpu.forward(
        PlanKind::Prefill,
        &mut cws,
        &mut ckv,
        &prompt,
        &rows,
        &mut cl,
    )
    .expect("cpu prefill");
    gpu.forward(
        PlanKind::Prefill,
        &mut gws,
        &mut gkv,
        &prompt,
        &rows,
        &mut gl,
    )
    .expect("gpu prefill");
    let (mut ct, mut gt) = (vec![argmax(&cl)], vec![argmax(&gl)]);
    for step in 0..127 {
        let pos = prompt.len() + step;
        let r = [TokenRow { slot: 0, pos }];
        cpu.forward(
            PlanKind::Decode,
            &mut cws,
            &mut ckv,
            &[ct[step]],
            &r,
            &mut cl,
        )
        .expect("cpu decode");
        gpu.forward(
            PlanKind::Decode,
            &mut gws,
            &mut gkv,
            &[gt[step]],
            &r,
            &mut gl,
        )
        .expect("gpu decode");
        ct.push(argmax(&cl));
        gt.push(argmax(&gl));
    }
    assert_eq!(gt, ct, "greedy tokens differ between GPU and CPU");
}

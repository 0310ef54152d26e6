//! The CPU backend on the random-weight synthetic models (`model::synthetic`): their logits are
//! finite, deterministic in the seed, and stay bounded through a deep stack, which is what the
//! weights' scale was chosen for.

use std::path::Path;

use super::exec::Deferral;
use super::{CpuBackend, CpuOptions, WeightFormat, Workspace};
use crate::backend::TokenRow;
use crate::model::synthetic::{build, load, shape_config};
use crate::model::Model;
use crate::plan::PlanKind;

/// Prefill of `ids` then 4 greedy decode steps; every logit row.
fn run(model: &Model, ids: &[u32]) -> Vec<Vec<f32>> {
    steps(&backend(model, 1), ids)
}

/// The model's backend on `threads` threads, its weights as stored.
fn backend(model: &Model, threads: usize) -> CpuBackend {
    CpuBackend::new(
        &model.config,
        &model.weights,
        CpuOptions {
            threads,
            weights: WeightFormat::AsStored,
            ..Default::default()
        },
    )
    .unwrap()
}

/// [`run`] on `backend`.
fn steps(backend: &CpuBackend, ids: &[u32]) -> Vec<Vec<f32>> {
    let mut kv = backend.new_cache(1, ids.len() + 8).unwrap();
    let mut ws = Workspace::new();
    let mut logits = Vec::new();
    let rows: Vec<TokenRow> = (0..ids.len())
        .map(|pos| TokenRow { slot: 0, pos })
        .collect();
    backend
        .forward(PlanKind::Prefill, &mut ws, &mut kv, ids, &rows, &mut logits)
        .unwrap();
    let mut out = vec![logits.clone()];
    for step in 0..4 {
        let next = logits
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .unwrap()
            .0 as u32;
        let row = TokenRow {
            slot: 0,
            pos: ids.len() + step,
        };
        backend
            .forward(
                PlanKind::Decode,
                &mut ws,
                &mut kv,
                &[next],
                &[row],
                &mut logits,
            )
            .unwrap();
        out.push(logits.clone());
    }
    out
}

fn tiny(seed: u64) -> Model {
    load("tiny", seed).unwrap()
}

#[test]
fn logits_are_finite_deterministic_and_depend_on_the_seed() {
    let ids = tiny(0).tokenizer.encode("synthetic 42").unwrap();
    assert_eq!(ids.len(), 12);
    let a = run(&tiny(7), &ids);
    let b = run(&tiny(7), &ids);
    let c = run(&tiny(8), &ids);
    assert_eq!(a, b, "same seed, same logits");
    assert_ne!(a, c, "another seed, other logits");
    for row in &a {
        assert_eq!(row.len(), 256);
        assert!(row.iter().all(|x| x.is_finite()));
        // Random weights give spread logits, not a constant row.
        let (lo, hi) = row
            .iter()
            .fold((f32::MAX, f32::MIN), |(l, h), &x| (l.min(x), h.max(x)));
        assert!(hi - lo > 0.1, "logit range {lo}..{hi}");
    }
}

#[test]
fn a_deep_stack_stays_finite() {
    let (mut config, std) = shape_config("tiny").unwrap();
    config.num_layers = 64;
    let model = build(config, std, 3, Path::new("synthetic:deep")).unwrap();
    for row in run(&model, &[1, 2, 3, 4, 5, 6, 7, 8]) {
        let max = row.iter().fold(0f32, |m, x| m.max(x.abs()));
        assert!(max.is_finite() && max < 100.0, "max |logit| {max}");
    }
}

/// One-token decode steps skip the ropes before each attention and have the attention rotate
/// its queries and keys, each task its own heads on a 2-thread team ([`super::exec::deferrals`]),
/// and give the logits of running the planned ropes bit for bit.
#[test]
fn one_token_steps_rotate_inside_attention_as_the_ropes_would() {
    let model = tiny(5);
    let ids = model.tokenizer.encode("rotate inside").unwrap();
    let inside = backend(&model, 2);
    let mut planned = backend(&model, 2);
    for plan in &mut planned.plan_deferrals {
        plan.fill(Deferral::Planned);
    }
    let rotating = inside.plan_deferrals[PlanKind::Decode as usize]
        .iter()
        .filter(|d| matches!(d, Deferral::Rotates { .. }))
        .count();
    assert_eq!(rotating, model.config.num_layers, "one per layer");
    let bits = |rows: Vec<Vec<f32>>| -> Vec<Vec<u32>> {
        rows.iter()
            .map(|r| r.iter().map(|x| x.to_bits()).collect())
            .collect()
    };
    assert_eq!(bits(steps(&inside, &ids)), bits(steps(&planned, &ids)));
}

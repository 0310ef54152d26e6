//! A whole model on every GGUF block format: a small Llama (hidden 256, so every matrix is whole
//! K-quant super-blocks) whose embedding and linear weights are random blocks of one format, run
//! on the CPU backend as stored (GEMV/GEMM on the blocks, embedding rows dequantized at lookup)
//! and with every weight dequantized to f32 up front. Both see the same f32 weights (ggml's
//! dequantization), so their logits agree up to f32 summation order; a model mixing formats
//! checks that merged linears of different formats are dequantized rather than misread.

mod common;

use std::sync::Arc;

use common::rel_err;
use kiln::backend::cpu::{CpuBackend, CpuOptions, WeightFormat, Workspace};
use kiln::backend::TokenRow;
use kiln::model::quant::QuantKind;
use kiln::model::{synthetic, DType, Model, Tensor, TensorBytes};
use kiln::plan::PlanKind;

const TOLERANCE: f32 = 1e-4;

/// xorshift64 bytes, deterministic per seed.
fn rand_bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 32) as u8
        })
        .collect()
}

/// Byte offsets of a block's f16 scale and min fields (Q8_K's f32 scale is at 0..4).
fn scale_fields(kind: QuantKind) -> &'static [usize] {
    match kind {
        QuantKind::Q8_0 | QuantKind::Q4_0 | QuantKind::Q5_0 => &[0],
        QuantKind::Q4_1 | QuantKind::Q5_1 | QuantKind::Q4_K | QuantKind::Q5_K => &[0, 2],
        QuantKind::Q2_K => &[80, 82],
        QuantKind::Q3_K => &[108],
        QuantKind::Q6_K => &[208],
        QuantKind::Q8_K => &[],
    }
}

/// Random blocks for `numel` elements with small positive scales and mins, so the weights stay
/// of order 0.01–0.1 like a trained model's.
fn rand_blocks(kind: QuantKind, numel: usize, seed: u64) -> Vec<u8> {
    let bb = kind.block_bytes();
    let mut blocks = rand_bytes(numel / kind.block_elems() * bb, seed);
    // Largest quant magnitude per format, so `d · q` stays below ~0.1.
    let qmax = match kind {
        QuantKind::Q8_0 | QuantKind::Q8_K => 128.0,
        QuantKind::Q4_0 | QuantKind::Q4_1 | QuantKind::Q5_0 | QuantKind::Q5_1 => 32.0,
        // K-quants multiply the quant by a sub-block scale of up to 63 (Q6_K: 127).
        _ => 32.0 * 127.0,
    };
    for (b, c) in blocks.chunks_exact_mut(bb).enumerate() {
        let d = (0.05 + (b % 7) as f32 * 0.01) / qmax;
        if kind == QuantKind::Q8_K {
            c[..4].copy_from_slice(&d.to_le_bytes());
        }
        for (i, &at) in scale_fields(kind).iter().enumerate() {
            let v = if i == 0 { d } else { d * 8.0 };
            c[at..at + 2].copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
        }
    }
    blocks
}

/// The synthetic Llama with every matrix replaced by random blocks: matrix `i` (in name order)
/// gets `formats[i % formats.len()]`.
fn model(formats: &[QuantKind]) -> Model {
    let (mut config, std) = synthetic::shape_config("tiny").unwrap();
    config.hidden_size = 256;
    config.head_dim = 64;
    config.intermediate_size = 512;
    let mut m = synthetic::build(config, std, 1, std::path::Path::new("quant-model")).unwrap();
    let names: Vec<String> = m
        .weights
        .tensors
        .values()
        .filter(|t| t.shape.len() == 2)
        .map(|t| t.name.clone())
        .collect();
    for (i, name) in names.iter().enumerate() {
        let kind = formats[i % formats.len()];
        let shape = m.weights.tensors[name].shape.clone();
        let blocks = rand_blocks(kind, shape.iter().product(), i as u64 + 1);
        m.weights.insert(Tensor {
            name: name.clone(),
            shape,
            dtype: DType::from_quant(kind),
            bytes: TensorBytes::Owned(Arc::new(blocks)),
        });
    }
    m
}

/// Logits of a 7-token prefill (every position) and 3 decode steps on fixed tokens.
fn logits(model: &Model, weights: WeightFormat) -> (Vec<Vec<f32>>, usize) {
    let backend = CpuBackend::new(
        &model.config,
        &model.weights,
        CpuOptions {
            threads: 2,
            weights,
            ..Default::default()
        },
    )
    .unwrap();
    let ids = [3u32, 200, 17, 99, 255, 0, 42];
    let mut ws = Workspace::new();
    let mut kv = backend.new_cache(1, 16).expect("cache");
    let mut logits = Vec::new();
    let rows: Vec<TokenRow> = (0..ids.len())
        .map(|pos| TokenRow { slot: 0, pos })
        .collect();
    backend
        .forward(
            PlanKind::AllLogits,
            &mut ws,
            &mut kv,
            &ids,
            &rows,
            &mut logits,
        )
        .unwrap();
    let mut out = vec![logits.clone()];
    for (step, id) in [7u32, 128, 250].into_iter().enumerate() {
        let row = TokenRow {
            slot: 0,
            pos: ids.len() + step,
        };
        backend
            .forward(
                PlanKind::Decode,
                &mut ws,
                &mut kv,
                &[id],
                &[row],
                &mut logits,
            )
            .unwrap();
        out.push(logits.clone());
    }
    (out, backend.weight_bytes())
}

fn compare(formats: &[QuantKind]) -> (usize, usize) {
    let m = model(formats);
    let (blocks, block_bytes) = logits(&m, WeightFormat::AsStored);
    let (dense, dense_bytes) = logits(&m, WeightFormat::F32);
    for (step, (got, want)) in blocks.iter().zip(&dense).enumerate() {
        assert!(
            want.iter().all(|v| v.is_finite()),
            "{formats:?} step {step}"
        );
        let spread = want.iter().fold(0f32, |a, v| a.max(v.abs()));
        assert!(spread > 1e-3, "{formats:?} step {step}: degenerate logits");
        let e = rel_err(got, want);
        assert!(e < TOLERANCE, "{formats:?} step {step}: rel err {e}");
    }
    (block_bytes, dense_bytes)
}

#[test]
fn every_format_runs_a_model_on_its_blocks() {
    for kind in QuantKind::ALL {
        let (blocks, dense) = compare(&[kind]);
        // The weights stayed in blocks (at most 8.5 bits of 32 per weight, plus f32 norms).
        assert!(
            blocks * 3 < dense,
            "{kind:?}: {blocks} bytes packed, {dense} as f32"
        );
    }
}

#[test]
fn mixed_formats_in_one_linear_keep_their_blocks() {
    // q/k/v and gate/up are merged into one matrix each; consecutive formats differ, and each
    // part stays in its own blocks rather than widening the merged matrix to f32.
    let (blocks, dense) = compare(&QuantKind::ALL);
    assert!(blocks * 3 < dense, "{blocks} bytes packed, {dense} as f32");
}

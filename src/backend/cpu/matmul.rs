//! `y = x Wᵀ (+ b)` for weights stored `[out, in]` row-major, the layout every checkpoint uses.
//! Rows of W are contiguous, so each output is one dot product over contiguous memory: the
//! natural shape for a memory-bound GEMV at decode and a register-tiled GEMM at prefill.

use std::ops::Range;

use half::bf16;
use rayon::prelude::*;

use super::simd;

/// Weight storage the kernels read directly (bf16 is never widened in memory).
pub enum WeightData {
    F32(Vec<f32>),
    BF16(Vec<bf16>),
}

/// A linear layer's weight (and bias) in the backend's layout.
pub struct PackedMatrix {
    pub rows: usize,
    pub cols: usize,
    pub data: WeightData,
    pub bias: Option<Vec<f32>>,
}

impl PackedMatrix {
    pub fn bytes(&self) -> usize {
        let w = match &self.data {
            WeightData::F32(v) => v.len() * 4,
            WeightData::BF16(v) => v.len() * 2,
        };
        w + self.bias.as_ref().map_or(0, |b| b.len() * 4)
    }
}

/// A raw output pointer that rayon tasks may share because each writes disjoint columns.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

/// Output rows handled by one task: small enough to balance across threads, large enough that
/// the per-task overhead vanishes next to the bytes streamed.
fn rows_per_task(w: &PackedMatrix, tokens: usize) -> usize {
    let threads = rayon::current_num_threads().max(1);
    let by_threads = w.rows.div_ceil(threads * 4);
    let min_rows = if tokens > 1 { 16 } else { 64 };
    by_threads.max(min_rows).min(w.rows.max(1))
}

/// `out[t·ldo + n] (+)= bias[n] + Σ_k W[n,k]·x[t·ldx + k]` for every token `t` and output `n`,
/// split over the current rayon pool by output rows.
///
/// `accumulate` adds into `out` (a fused residual add) instead of overwriting it.
pub fn matmul(
    w: &PackedMatrix,
    x: &[f32],
    ldx: usize,
    tokens: usize,
    out: &mut [f32],
    ldo: usize,
    accumulate: bool,
) {
    assert!(tokens == 0 || x.len() >= (tokens - 1) * ldx + w.cols, "matmul input too short");
    assert!(tokens == 0 || out.len() >= (tokens - 1) * ldo + w.rows, "matmul output too short");
    let ptr = OutPtr(out.as_mut_ptr());
    let chunk = rows_per_task(w, tokens);
    let starts: Vec<usize> = (0..w.rows).step_by(chunk).collect();
    starts.into_par_iter().for_each(|r0| {
        let rows = r0..(r0 + chunk).min(w.rows);
        let p = ptr;
        // SAFETY: tasks own disjoint column ranges `rows` of every output row, and `out` outlives
        // the parallel loop; the asserts above bound every index written.
        unsafe { matmul_rows(w, x, ldx, tokens, rows, p.0, ldo, accumulate) };
    });
}

/// The single-threaded kernel over a block of output rows.
///
/// # Safety
/// `out` must be valid for writes at `t·ldo + n` for all `t < tokens`, `n ∈ rows`.
#[allow(clippy::too_many_arguments)]
pub unsafe fn matmul_rows(
    w: &PackedMatrix,
    x: &[f32],
    ldx: usize,
    tokens: usize,
    rows: Range<usize>,
    out: *mut f32,
    ldo: usize,
    accumulate: bool,
) {
    let k = w.cols;
    for n in rows {
        let bias = w.bias.as_ref().map_or(0.0, |b| b[n]);
        for t in 0..tokens {
            let xr = &x[t * ldx..t * ldx + k];
            let d = match &w.data {
                WeightData::F32(v) => simd::dot_f32(&v[n * k..(n + 1) * k], xr),
                WeightData::BF16(v) => simd::dot_bf16(&v[n * k..(n + 1) * k], xr),
            };
            let o = out.add(t * ldo + n);
            *o = if accumulate { *o + d + bias } else { d + bias };
        }
    }
}

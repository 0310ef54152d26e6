//! The portable kernels: one scalar dot product per output (any target, any CPU). Quantized
//! weights reach them as dequantized f32 tiles (see [`super::quant_rows`]).

use half::bf16;

use super::Job;
use crate::backend::cpu::simd;

/// f32 rows.
///
/// # Safety
/// As [`super::matmul_rows_at`]; `w` holds `job.rows.end` rows of `job.k`.
pub(super) unsafe fn rows_f32(w: &[f32], job: &Job) {
    let k = job.k;
    rows(job, |n, t| {
        simd::scalar::dot_f32(&w[n * k..(n + 1) * k], job.xrow(t))
    })
}

/// bf16 rows.
///
/// # Safety
/// As [`rows_f32`].
pub(super) unsafe fn rows_bf16(w: &[bf16], job: &Job) {
    let k = job.k;
    rows(job, |n, t| {
        simd::scalar::dot_bf16(&w[n * k..(n + 1) * k], job.xrow(t))
    })
}

unsafe fn rows(job: &Job, dot: impl Fn(usize, usize) -> f32) {
    for n in job.rows.clone() {
        for t in 0..job.tokens {
            job.put(t, n, dot(n, t));
        }
    }
}

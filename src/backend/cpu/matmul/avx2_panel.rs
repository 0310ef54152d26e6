//! The AVX2 kernel for calls of more than one token (prefill chunks, batched decode rows,
//! speculative verification), after BLIS: the weights of 16 outputs are packed into a k-major
//! panel (`panel[k][16]`, f32, one cache line per k position; bf16 widened, quantized tiles
//! already dequantized), and a register tile of 6 tokens × 16 outputs walks it with 12
//! accumulators: per k position two aligned weight loads, six broadcasts of the tokens'
//! activations and twelve FMAs, with no horizontal reductions. The dot-product tile it replaced
//! (4 rows × 2 tokens along k) loaded six vectors and widened four per eight FMAs and reduced
//! every sum across lanes.
//!
//! Each output is summed in k order by one fused multiply-add chain from zero, whatever the tile
//! width, the token's place in the call or the number of tokens, so every token of a
//! multi-token call rounds alike; a one-token call takes the GEMV of [`super::avx2`], whose
//! eight-lane partial sums round differently.

use std::arch::x86_64::*;
use std::cell::RefCell;

use super::x86::tok_ptrs;
use super::Job;
use crate::backend::cpu::simd::x86::Load;

/// Outputs per panel: two 8-lane vectors.
const NR: usize = 16;
/// Tokens per register tile: 6 × 2 accumulators, two weight vectors and a broadcast take 15 of
/// the 16 ymm registers.
const MR: usize = 6;

/// One k position of a panel: the weights of its 16 outputs, one cache line.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([f32; NR]);

thread_local! {
    /// Per-thread packed panel (`k` lines: 36 KiB for k = 576).
    static PANEL: RefCell<Vec<Line>> = const { RefCell::new(Vec::new()) };
}

/// `job.rows` for `job.tokens > 1`, 16 outputs at a time.
///
/// # Safety
/// The CPU supports AVX2 and FMA; `job` describes valid memory (see `matmul_rows_at`) and `w`
/// holds `job.rows.end` rows of `job.k` elements.
#[inline(always)]
pub(super) unsafe fn panel_rows<W: Load>(w: *const W, job: &Job) {
    PANEL.with_borrow_mut(|panel| {
        panel.resize(job.k, Line([0.0; NR]));
        // SAFETY: as this function's; the panel holds `job.k` lines. The work is in a function
        // of its own because a closure is compiled without the caller's target features.
        unsafe { panels(w, job, panel.as_mut_ptr()) }
    })
}

/// # Safety
/// As [`panel_rows`], with `panel` valid for `job.k` lines.
#[target_feature(enable = "avx2,fma")]
unsafe fn panels<W: Load>(w: *const W, job: &Job, panel: *mut Line) {
    let end = job.rows.end;
    let mut n = job.rows.start;
    while n < end {
        let nr = (end - n).min(NR);
        pack::<W, NR>(w, job.k, job.k, n, nr, panel as *mut f32);
        let mut t = 0;
        while t + MR <= job.tokens {
            tile::<MR>(panel, job, n, nr, t);
            t += MR;
        }
        match job.tokens - t {
            5 => tile::<5>(panel, job, n, nr, t),
            4 => tile::<4>(panel, job, n, nr, t),
            3 => tile::<3>(panel, job, n, nr, t),
            2 => tile::<2>(panel, job, n, nr, t),
            1 => tile::<1>(panel, job, n, nr, t),
            _ => {}
        }
        n += nr;
    }
}

/// Rows `n..n + nr` (`nr ≤ P`, `P` a multiple of 8) of the `k`-column matrix at `w` (rows
/// `stride` elements apart) into a panel of `k` lines of `P` floats (`out`, 32-byte aligned),
/// transposed eight rows by eight columns at a time; rows past `nr` are zero. Shared with the
/// AVX-512 kernels ([`super::avx512_panel`]), which call it from their own AVX-512 functions
/// (for weights, and to put a few tokens' activations in lanes).
#[inline(always)]
pub(super) unsafe fn pack<W: Load, const P: usize>(
    w: *const W,
    stride: usize,
    k: usize,
    n: usize,
    nr: usize,
    out: *mut f32,
) {
    for r0 in (0..P).step_by(8) {
        let mut kk = 0;
        while kk + 8 <= k {
            // A whole group of eight rows loads without a test per row (the common case).
            let mut v = [_mm256_setzero_ps(); 8];
            if r0 + 8 <= nr {
                for (i, v) in v.iter_mut().enumerate() {
                    *v = W::ld8(w.add((n + r0 + i) * stride + kk));
                }
            } else {
                for (i, v) in v.iter_mut().enumerate().take(nr.saturating_sub(r0)) {
                    *v = W::ld8(w.add((n + r0 + i) * stride + kk));
                }
            }
            let c = transpose8(v);
            for (i, c) in c.iter().enumerate() {
                _mm256_store_ps(out.add((kk + i) * P + r0), *c);
            }
            kk += 8;
        }
        for kk in kk..k {
            for i in 0..8 {
                *out.add(kk * P + r0 + i) = if r0 + i < nr {
                    (*w.add((n + r0 + i) * stride + kk)).get()
                } else {
                    0.0
                };
            }
        }
    }
}

/// Rows of an 8 × 8 block to its columns.
#[inline(always)]
unsafe fn transpose8(r: [__m256; 8]) -> [__m256; 8] {
    // Pairs of rows interleaved, then quads, then the 128-bit halves exchanged.
    let t0 = _mm256_unpacklo_ps(r[0], r[1]);
    let t1 = _mm256_unpackhi_ps(r[0], r[1]);
    let t2 = _mm256_unpacklo_ps(r[2], r[3]);
    let t3 = _mm256_unpackhi_ps(r[2], r[3]);
    let t4 = _mm256_unpacklo_ps(r[4], r[5]);
    let t5 = _mm256_unpackhi_ps(r[4], r[5]);
    let t6 = _mm256_unpacklo_ps(r[6], r[7]);
    let t7 = _mm256_unpackhi_ps(r[6], r[7]);
    let s0 = _mm256_shuffle_ps::<0x44>(t0, t2);
    let s1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
    let s2 = _mm256_shuffle_ps::<0x44>(t1, t3);
    let s3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
    let s4 = _mm256_shuffle_ps::<0x44>(t4, t6);
    let s5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
    let s6 = _mm256_shuffle_ps::<0x44>(t5, t7);
    let s7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
    [
        _mm256_permute2f128_ps::<0x20>(s0, s4),
        _mm256_permute2f128_ps::<0x20>(s1, s5),
        _mm256_permute2f128_ps::<0x20>(s2, s6),
        _mm256_permute2f128_ps::<0x20>(s3, s7),
        _mm256_permute2f128_ps::<0x31>(s0, s4),
        _mm256_permute2f128_ps::<0x31>(s1, s5),
        _mm256_permute2f128_ps::<0x31>(s2, s6),
        _mm256_permute2f128_ps::<0x31>(s3, s7),
    ]
}

/// Tokens `t..t + T` against the packed panel of outputs `n..n + nr`, written to the output.
#[inline(always)]
unsafe fn tile<const T: usize>(panel: *const Line, job: &Job, n: usize, nr: usize, t: usize) {
    let x: [*const f32; T] = tok_ptrs(job, t);
    let p = panel as *const f32;
    let mut acc = [[_mm256_setzero_ps(); 2]; T];
    for kk in 0..job.k {
        let w0 = _mm256_load_ps(p.add(kk * NR));
        let w1 = _mm256_load_ps(p.add(kk * NR + 8));
        for (xi, acc) in x.iter().zip(acc.iter_mut()) {
            let xb = _mm256_broadcast_ss(&*xi.add(kk));
            acc[0] = _mm256_fmadd_ps(w0, xb, acc[0]);
            acc[1] = _mm256_fmadd_ps(w1, xb, acc[1]);
        }
    }
    for (i, acc) in acc.iter().enumerate() {
        put(job, t + i, n, nr, *acc);
    }
}

/// One token's 16 sums (+ bias, + the output when accumulating), rounded as [`Job::put`]:
/// `(out + sum) + bias`, or `sum + bias`.
#[inline(always)]
unsafe fn put(job: &Job, t: usize, n: usize, nr: usize, acc: [__m256; 2]) {
    if nr == NR {
        let o = job.out.add(t * job.ldo + n);
        for (h, &sum) in acc.iter().enumerate() {
            let v = if job.accumulate {
                _mm256_add_ps(_mm256_loadu_ps(o.add(8 * h)), sum)
            } else {
                sum
            };
            let bias = match job.bias {
                Some(b) => _mm256_loadu_ps(b[n + 8 * h..n + 8 * h + 8].as_ptr()),
                None => _mm256_setzero_ps(),
            };
            _mm256_storeu_ps(o.add(8 * h), _mm256_add_ps(v, bias));
        }
    } else {
        let mut s = [0f32; NR];
        _mm256_storeu_ps(s.as_mut_ptr(), acc[0]);
        _mm256_storeu_ps(s.as_mut_ptr().add(8), acc[1]);
        for (r, &v) in s.iter().take(nr).enumerate() {
            job.put(t, n + r, v);
        }
    }
}

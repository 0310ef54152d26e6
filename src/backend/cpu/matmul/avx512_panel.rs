//! The AVX-512 kernel for calls of more than 16 tokens (prefill chunks, large batched-decode
//! steps): [`super::avx2_panel`]'s scheme at twice the width. The weights of 32 outputs are
//! packed into a k-major panel (`panel[k][32]`, f32, two cache lines per k position), and a
//! register tile of 12 tokens × 32 outputs walks it with 24 zmm accumulators: per k position two
//! aligned weight loads, twelve broadcasts and twenty-four FMAs, no horizontal reductions. The
//! dot-product tile of [`super::avx512`] (4 rows × 6 tokens along k, sums reduced across lanes)
//! keeps calls of up to 16 tokens, where packing a panel costs about as much as the FMAs.
//! SmolLM2 pp512 (2 threads, Zen 5) went from 800 to 940–990 tok/s with the panels.
//! (Tokens in lanes — activations transposed once per call, 24 weight rows broadcast against a
//! 16-token vector, no weight packing — was tried for 9 to 16 tokens: 7% faster than the tiles on
//! BF16 at 16 rows, 17% slower on Q4_1 and 1.8× slower on BF16 at 4 rows; not kept.)
//!
//! Each output is summed in k order by one fused multiply-add chain from zero, as the AVX2
//! panels sum it, so a call of more than 16 tokens gives the same bits on AVX-512 and AVX2 CPUs,
//! whatever the tile width or the token's place in the call.

use std::arch::x86_64::*;
use std::cell::RefCell;

use super::avx2_panel::pack;
use super::x86::tok_ptrs;
use super::Job;
use crate::backend::cpu::simd::x86::Load;

/// Outputs per panel: two 16-lane vectors.
pub(super) const NR: usize = 32;
/// Tokens per register tile: 12 × 2 accumulators, two weight vectors and a broadcast take 27 of
/// the 32 zmm registers.
const MR: usize = 12;

/// The register tiles of a call of `tokens` tokens, as `(first token, width)`: as few as
/// [`MR`] allows, of balanced widths (16 tokens run as 8 + 8, not 12 + 4: a narrow tile spends
/// its k loop on two weight loads per few multiply-adds).
pub(super) fn tiles(tokens: usize) -> impl Iterator<Item = (usize, usize)> {
    let count = tokens.div_ceil(MR);
    (0..count).scan(0, move |t, i| {
        let width = (tokens - *t) / (count - i);
        let tile = (*t, width);
        *t += width;
        Some(tile)
    })
}

/// One k position of a panel: the weights of its 32 outputs, two cache lines.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([f32; NR]);

thread_local! {
    /// Per-thread packed panel (`k` lines: 72 KiB for k = 576, L2-resident).
    static PANEL: RefCell<Vec<Line>> = const { RefCell::new(Vec::new()) };
}

/// `job.rows` for calls of many tokens, 32 outputs at a time.
///
/// # Safety
/// The CPU supports AVX-512 F/BW/VL, AVX2 and FMA; `job` describes valid memory (see
/// `matmul_rows_at`) and `w` holds `job.rows.end` rows of `job.k` elements.
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
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn panels<W: Load>(w: *const W, job: &Job, panel: *mut Line) {
    let end = job.rows.end;
    let mut n = job.rows.start;
    while n < end {
        let nr = (end - n).min(NR);
        pack::<W, NR>(w, job.k, job.k, n, nr, panel as *mut f32);
        for (t, width) in tiles(job.tokens) {
            match width {
                12 => tile::<12>(panel, job, n, nr, t),
                11 => tile::<11>(panel, job, n, nr, t),
                10 => tile::<10>(panel, job, n, nr, t),
                9 => tile::<9>(panel, job, n, nr, t),
                8 => tile::<8>(panel, job, n, nr, t),
                7 => tile::<7>(panel, job, n, nr, t),
                6 => tile::<6>(panel, job, n, nr, t),
                5 => tile::<5>(panel, job, n, nr, t),
                4 => tile::<4>(panel, job, n, nr, t),
                3 => tile::<3>(panel, job, n, nr, t),
                2 => tile::<2>(panel, job, n, nr, t),
                _ => tile::<1>(panel, job, n, nr, t),
            }
        }
        n += nr;
    }
}

/// Tokens `t..t + T` against the packed panel of outputs `n..n + nr`, written to the output.
#[inline(always)]
unsafe fn tile<const T: usize>(panel: *const Line, job: &Job, n: usize, nr: usize, t: usize) {
    let x: [*const f32; T] = tok_ptrs(job, t);
    let p = panel as *const f32;
    let mut acc = [[_mm512_setzero_ps(); 2]; T];
    for kk in 0..job.k {
        let w0 = _mm512_load_ps(p.add(kk * NR));
        let w1 = _mm512_load_ps(p.add(kk * NR + 16));
        for (xi, acc) in x.iter().zip(acc.iter_mut()) {
            let xb = _mm512_set1_ps(*xi.add(kk));
            acc[0] = _mm512_fmadd_ps(w0, xb, acc[0]);
            acc[1] = _mm512_fmadd_ps(w1, xb, acc[1]);
        }
    }
    for (i, acc) in acc.iter().enumerate() {
        put(job, t + i, n, nr, *acc);
    }
}

/// One token's 32 sums (+ bias, + the output when accumulating), rounded as [`Job::put`]:
/// `(out + sum) + bias`, or `sum + bias`.
#[inline(always)]
pub(super) unsafe fn put(job: &Job, t: usize, n: usize, nr: usize, acc: [__m512; 2]) {
    if nr == NR {
        let o = job.out.add(t * job.ldo + n);
        for (h, &sum) in acc.iter().enumerate() {
            let v = if job.accumulate {
                _mm512_add_ps(_mm512_loadu_ps(o.add(16 * h)), sum)
            } else {
                sum
            };
            let bias = match job.bias {
                Some(b) => _mm512_loadu_ps(b[n + 16 * h..n + 16 * h + 16].as_ptr()),
                None => _mm512_setzero_ps(),
            };
            _mm512_storeu_ps(o.add(16 * h), _mm512_add_ps(v, bias));
        }
    } else {
        let mut s = [0f32; NR];
        _mm512_storeu_ps(s.as_mut_ptr(), acc[0]);
        _mm512_storeu_ps(s.as_mut_ptr().add(16), acc[1]);
        for (r, &v) in s.iter().take(nr).enumerate() {
            job.put(t, n + r, v);
        }
    }
}

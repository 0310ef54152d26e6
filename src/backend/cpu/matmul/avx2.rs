//! AVX2 + FMA + F16C kernels (8 f32 lanes, scalar k tails; 16 ymm registers, so the prefill
//! tile is 4 rows × 2 tokens). The drivers are shared with AVX-512 (see [`super::x86`]); the entry
//! points here instantiate them with this file's kernels under `#[target_feature]`. The prefill
//! tiles' dequantization runs here for every AVX level.

use std::arch::x86_64::*;
use std::marker::PhantomData;

use super::x86::{self, block_sums, BlockGemv, Blocks, DenseKernels, Lanes, Legacy};
use super::Job;
use crate::backend::cpu::simd::x86::{hsum256, Load};
use crate::model::quant::{self, BlockFormat, Q4_0, Q4_1, Q8_0};

/// The AVX2 ISA, as the shared drivers see it.
pub(super) struct Avx2;

impl<W: Load> DenseKernels<W> for Avx2 {
    #[inline(always)]
    unsafe fn tile<const R: usize, const T: usize>(
        w: [*const W; R],
        x: [*const f32; T],
        k: usize,
    ) -> [[f32; T]; R] {
        tile_256(w, x, k)
    }
    #[inline(always)]
    unsafe fn gemv<const R: usize>(w: [*const W; R], x: *const f32, k: usize) -> [f32; R] {
        gemv_256(w, x, k)
    }
}

impl Lanes for Avx2 {
    type V = __m256;
    const N: usize = 8;
    #[inline(always)]
    unsafe fn zero() -> __m256 {
        _mm256_setzero_ps()
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> __m256 {
        _mm256_loadu_ps(p)
    }
    #[inline(always)]
    unsafe fn fmadd(a: __m256, b: __m256, c: __m256) -> __m256 {
        _mm256_fmadd_ps(a, b, c)
    }
    #[inline(always)]
    unsafe fn add(a: __m256, b: __m256) -> __m256 {
        _mm256_add_ps(a, b)
    }
    #[inline(always)]
    unsafe fn sum(v: __m256) -> f32 {
        hsum256(v)
    }
}

/// `R` rows × `T` tokens register tile.
#[inline(always)]
unsafe fn tile_256<W: Load, const R: usize, const T: usize>(
    w: [*const W; R],
    x: [*const f32; T],
    k: usize,
) -> [[f32; T]; R] {
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    let mut i = 0;
    while i + 8 <= k {
        let mut xv = [_mm256_setzero_ps(); T];
        for t in 0..T {
            xv[t] = _mm256_loadu_ps(x[t].add(i));
        }
        for r in 0..R {
            let wv = W::ld8(w[r].add(i));
            for t in 0..T {
                acc[r][t] = _mm256_fmadd_ps(wv, xv[t], acc[r][t]);
            }
        }
        i += 8;
    }
    let mut s = [[0f32; T]; R];
    for r in 0..R {
        for t in 0..T {
            let mut v = hsum256(acc[r][t]);
            for j in i..k {
                v += (*w[r].add(j)).get() * *x[t].add(j);
            }
            s[r][t] = v;
        }
    }
    s
}

/// Like [`tile_256`] with one token, unrolled twice over k for 2R chains.
#[inline(always)]
unsafe fn gemv_256<W: Load, const R: usize>(w: [*const W; R], x: *const f32, k: usize) -> [f32; R] {
    let mut a0 = [_mm256_setzero_ps(); R];
    let mut a1 = [_mm256_setzero_ps(); R];
    let mut i = 0;
    while i + 16 <= k {
        let x0 = _mm256_loadu_ps(x.add(i));
        let x1 = _mm256_loadu_ps(x.add(i + 8));
        for r in 0..R {
            a0[r] = _mm256_fmadd_ps(W::ld8(w[r].add(i)), x0, a0[r]);
            a1[r] = _mm256_fmadd_ps(W::ld8(w[r].add(i + 8)), x1, a1[r]);
        }
        i += 16;
    }
    if i + 8 <= k {
        let x0 = _mm256_loadu_ps(x.add(i));
        for r in 0..R {
            a0[r] = _mm256_fmadd_ps(W::ld8(w[r].add(i)), x0, a0[r]);
        }
        i += 8;
    }
    let mut s = [0f32; R];
    for r in 0..R {
        let mut v = hsum256(_mm256_add_ps(a0[r], a1[r]));
        for j in i..k {
            v += (*w[r].add(j)).get() * *x.add(j);
        }
        s[r] = v;
    }
    s
}

/// f32/bf16 rows (any token count).
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn dense_rows<W: Load>(w: *const W, job: &Job) {
    x86::dense_rows::<W, Avx2, 2, 2, 2>(w, job)
}

// ----- Quantized blocks -----

/// A legacy block's 32 integer quants as f32 (Q4_0's −8 applied) in four 8-element vectors.
pub(super) trait Quants256: Legacy {
    unsafe fn q256(p: *const u8) -> [__m256; 4];
}

/// The 16 quant bytes of a Q4 block as nibbles: elements 0..8, 8..16, 16..24, 24..32.
#[inline(always)]
unsafe fn nibbles_256(qs: *const u8) -> [__m256i; 4] {
    let v0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(qs as *const __m128i));
    let v1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(qs.add(8) as *const __m128i));
    let f = _mm256_set1_epi32(0x0f);
    [
        _mm256_and_si256(v0, f),
        _mm256_and_si256(v1, f),
        _mm256_srli_epi32::<4>(v0),
        _mm256_srli_epi32::<4>(v1),
    ]
}

impl Quants256 for Q8_0 {
    #[inline(always)]
    unsafe fn q256(p: *const u8) -> [__m256; 4] {
        std::array::from_fn(|j| {
            let q = _mm_loadl_epi64(p.add(2 + 8 * j) as *const __m128i);
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q))
        })
    }
}

impl Quants256 for Q4_0 {
    #[inline(always)]
    unsafe fn q256(p: *const u8) -> [__m256; 4] {
        let n = nibbles_256(p.add(2));
        let eight = _mm256_set1_epi32(8);
        n.map(|v| _mm256_cvtepi32_ps(_mm256_sub_epi32(v, eight)))
    }
}

impl Quants256 for Q4_1 {
    #[inline(always)]
    unsafe fn q256(p: *const u8) -> [__m256; 4] {
        nibbles_256(p.add(4)).map(|v| _mm256_cvtepi32_ps(v))
    }
}

/// The block's f16 scale and (Q4_1) min widened to f32: lanes `[d, m, ·, ·]` (lane 1 is junk
/// for formats without a min).
#[inline(always)]
unsafe fn scales(p: *const u8) -> __m128 {
    _mm_cvtph_ps(_mm_cvtsi32_si128(std::ptr::read_unaligned(p as *const i32)))
}

/// The legacy formats' GEMV in 8-lane vectors: per block and row `s = Σ q·x` over four vectors,
/// then `acc += d·s`, and for Q4_1 `m·Σx` into a scalar accumulator.
struct Legacy256<Q>(PhantomData<Q>);

impl<Q: Quants256> BlockGemv for Legacy256<Q> {
    const ELEMS: usize = Q::ELEMS;
    const BYTES: usize = Q::BYTES;

    #[inline(always)]
    unsafe fn prepare(x: *const f32, nb: usize) -> Vec<f32> {
        block_sums::<Q>(x, nb)
    }

    #[inline(always)]
    unsafe fn gemv<const R: usize>(
        w: [*const u8; R],
        x: *const f32,
        prep: &[f32],
        nb: usize,
        _pf: usize,
    ) -> [f32; R] {
        qgemv_256::<Q, R>(w, x, prep.as_ptr(), nb)
    }
}

#[inline(always)]
unsafe fn qgemv_256<Q: Quants256, const R: usize>(
    w: [*const u8; R],
    x: *const f32,
    xs: *const f32,
    nb: usize,
) -> [f32; R] {
    const QK: usize = 32;
    let mut acc = [_mm256_setzero_ps(); R];
    let mut macc = [_mm_setzero_ps(); R];
    for b in 0..nb {
        let xv: [__m256; 4] = std::array::from_fn(|j| _mm256_loadu_ps(x.add(b * QK + 8 * j)));
        for r in 0..R {
            let p = w[r].add(b * Q::BYTES);
            let dm = scales(p);
            let q = Q::q256(p);
            let mut s = _mm256_mul_ps(q[0], xv[0]);
            s = _mm256_fmadd_ps(q[1], xv[1], s);
            s = _mm256_fmadd_ps(q[2], xv[2], s);
            s = _mm256_fmadd_ps(q[3], xv[3], s);
            acc[r] = _mm256_fmadd_ps(_mm256_broadcastss_ps(dm), s, acc[r]);
            if Q::HAS_MIN {
                macc[r] = _mm_fmadd_ss(_mm_movehdup_ps(dm), _mm_load_ss(xs.add(b)), macc[r]);
            }
        }
    }
    std::array::from_fn(|r| hsum256(acc[r]) + _mm_cvtss_f32(macc[r]))
}

/// GEMV (`job.tokens == 1`) on Q8_0/Q4_0/Q4_1 blocks.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn legacy_rows<Q: Quants256>(w: *const u8, job: &Job) {
    x86::gemv_rows::<Legacy256<Q>>(w, job)
}

/// GEMV (`job.tokens == 1`) on blocks of any format (see [`Blocks`]).
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn block_rows<F: BlockFormat>(w: *const u8, job: &Job) {
    x86::gemv_rows::<Blocks<Avx2, F>>(w, job)
}

/// `nb` legacy blocks at `src` to `nb · 32` floats at `dst`, computed as ggml's reference does
/// (`d·q`, then `+ m` as a separate rounding), so bit-identical to the scalar dequantization.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dequantize_legacy<Q: Quants256>(src: *const u8, nb: usize, dst: *mut f32) {
    const QK: usize = 32;
    for b in 0..nb {
        let p = src.add(b * Q::BYTES);
        let dm = scales(p);
        let d = _mm256_broadcastss_ps(dm);
        let m = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
        let q = Q::q256(p);
        for (j, &qj) in q.iter().enumerate() {
            let mut v = _mm256_mul_ps(qj, d);
            if Q::HAS_MIN {
                v = _mm256_add_ps(v, m);
            }
            _mm256_storeu_ps(dst.add(b * QK + 8 * j), v);
        }
    }
}

/// Whole blocks of any format to f32 with ggml's scalar operations, compiled with AVX2 so the
/// per-element decoding vectorises (Rust never fuses a multiply and an add, so the result is
/// bit-identical to [`quant::dequantize_row`]).
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dequantize_blocks<F: BlockFormat>(src: &[u8], dst: &mut [f32]) {
    quant::dequantize_blocks::<F>(src, dst)
}

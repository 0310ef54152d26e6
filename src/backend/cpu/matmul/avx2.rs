//! AVX2 + FMA + F16C kernels (8 f32 lanes, scalar k tails; the multi-token kernel is in
//! [`super::avx2_panel`]). The drivers are shared with AVX-512 (see [`super::x86`]); the entry
//! points here instantiate them with this file's kernels under `#[target_feature]`. The prefill
//! tiles' dequantization runs here for every AVX level.

use std::arch::x86_64::*;
use std::marker::PhantomData;

use super::x86::{
    self, block_sums, chunk_sums, few_tokens_rows, BlockGemv, Blocks, Lanes, Legacy, RowTokens,
};
use super::Job;
use crate::backend::cpu::simd::x86::{hsum256, Load};
use crate::model::quant::{self, BlockFormat, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q6_K, Q8_0};

// Software prefetch in the GEMVs on blocks as stored: each prefetches the same position (block)
// of a later group of four rows (up to four groups on, see `x86::prefetch_ahead`); rows are
// contiguous in memory, so the distance follows the row length. Without it the four interleaved
// row streams reached about half the bandwidth they reach with it (Q8_0 lm_head of
// Qwen2.5-0.5B, AMD EPYC Zen 3). The dense GEMV reads one row at a time instead (one stream,
// see `STREAM_PREFETCH`), which that CPU streams faster than four rows at once.

/// Prefetches the cache lines of a `bytes`-long block starting at `p` (a hint: `p` may point
/// past the matrix, as for the last group of rows).
#[inline(always)]
pub(super) unsafe fn prefetch_block(p: *const u8, bytes: usize) {
    for line in 0..bytes.div_ceil(64) {
        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(64 * line) as *const i8);
    }
}

/// The AVX2 ISA, as the shared drivers see it.
pub(super) struct Avx2;

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

/// Bytes ahead of the row being read that the one-token GEMV prefetches, once per cache line.
/// Rows are contiguous, so this runs on into the next rows: the GEMV reads its matrix as one
/// stream. One core of a 2-vCPU AMD EPYC (Zen 3), a 226 MB bf16 matrix of 576-column rows
/// (a C model of this loop): 11.5 GB/s with 2 KiB, 9.4 with 1 KiB, 10.9 with 4 KiB; four rows
/// at a time (four streams, the kernel this replaced, prefetching the next four rows) 7.4–8.5,
/// two rows 8.0; a plain streaming read 9.7–11. Both cores at once: 21.7 GB/s against 15.5.
const STREAM_PREFETCH: usize = 2048;

/// One row against one token: two k-unrolled 8-lane accumulators, summed across lanes at the
/// end, prefetching [`STREAM_PREFETCH`] bytes ahead into L1, or under the L2 prefetch policy
/// (Intel CPUs, [`super::prefetch`]) its `row_ahead` bytes ahead into L2: on a 2-vCPU Xeon
/// with this kernel forced (`KILN_SIMD=avx2`), SmolLM2 BF16 decode went from 96.5 / 95.7 to
/// 107.7 / 103.7 tok/s (`kiln-bench -t 2 -p 0 -n 128 -r 3`, `KILN_PREFETCH=l1` and `l2`
/// alternating twice, 2026-12-04).
#[inline(always)]
unsafe fn gemv_row<W: Load>(w: *const W, x: *const f32, k: usize) -> f32 {
    let step = 16 * std::mem::size_of::<W>();
    let policy = super::prefetch::policy();
    let (ahead, to_l2) = if policy.row_ahead != 0 {
        (policy.row_ahead, true)
    } else {
        (STREAM_PREFETCH, false)
    };
    let mut a0 = _mm256_setzero_ps();
    let mut a1 = _mm256_setzero_ps();
    let mut i = 0;
    while i + 16 <= k {
        let p = w.add(i) as *const u8;
        // Once per cache line: the first step whose bytes start in it.
        if (p as usize) & 63 < step {
            super::prefetch::line(p.wrapping_add(ahead), to_l2);
        }
        a0 = _mm256_fmadd_ps(W::ld8(w.add(i)), _mm256_loadu_ps(x.add(i)), a0);
        a1 = _mm256_fmadd_ps(W::ld8(w.add(i + 8)), _mm256_loadu_ps(x.add(i + 8)), a1);
        i += 16;
    }
    if i + 8 <= k {
        a0 = _mm256_fmadd_ps(W::ld8(w.add(i)), _mm256_loadu_ps(x.add(i)), a0);
        i += 8;
    }
    let mut v = hsum256(_mm256_add_ps(a0, a1));
    for j in i..k {
        v += (*w.add(j)).get() * *x.add(j);
    }
    v
}

/// f32/bf16 rows (any token count): one row at a time for one token ([`gemv_row`]), packed
/// panels for more ([`super::avx2_panel`]).
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn dense_rows<W: Load>(w: *const W, job: &Job) {
    if job.tokens == 1 {
        let x = job.xptr(0);
        for n in job.rows.clone() {
            job.put(0, n, gemv_row(w.add(n * job.k), x, job.k));
        }
    } else {
        super::avx2_panel::panel_rows(w, job)
    }
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
        let q = |j: usize| p.add(2 + 8 * j) as *const __m128i;
        [
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(q(0)))),
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(q(1)))),
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(q(2)))),
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(q(3)))),
        ]
    }
}

impl Quants256 for Q4_0 {
    #[inline(always)]
    unsafe fn q256(p: *const u8) -> [__m256; 4] {
        to_f32_minus(nibbles_256(p.add(2)), 8)
    }
}

impl Quants256 for Q4_1 {
    #[inline(always)]
    unsafe fn q256(p: *const u8) -> [__m256; 4] {
        to_f32_minus(nibbles_256(p.add(4)), 0)
    }
}

/// A Q5 block's 32 quants as signed bytes in element order: the nibbles at `qs` (element `j`
/// the low nibble of byte `j`, element `j + 16` its high nibble) with bit `e` of the
/// little-endian `qh` word at `qh` as bit 4 of element `e`, less `offset` (16 for Q5_0, 0 for
/// Q5_1). Built in the byte domain, 32 elements per instruction: the `qh` word is broadcast,
/// byte `e / 8` shuffled to byte `e`, and a compare against a per-byte mask of every other bit
/// turns bit `e % 8` into a whole byte; none through a general register. Measured single
/// thread: the int16 GEMV's Q5_0 block went from 3.6 to 2.9 ns (16-bit-lane build before; a
/// Q4_1 block takes 1.5); the f32-activation GEMV stayed at ~4.5 ns, bound elsewhere.
#[inline(always)]
pub(super) unsafe fn five_bit_bytes<const OFFSET: u8>(qh: *const u8, qs: *const u8) -> __m256i {
    let v = _mm_loadu_si128(qs as *const __m128i);
    let n = _mm256_and_si256(
        _mm256_set_m128i(_mm_srli_epi16::<4>(v), v),
        _mm256_set1_epi8(0x0f),
    );
    let h = _mm256_set1_epi32(std::ptr::read_unaligned(qh as *const i32));
    // Byte `e` takes byte `e / 8` of the word (both 128-bit halves hold all four bytes).
    let h = _mm256_shuffle_epi8(
        h,
        _mm256_set_epi64x(
            0x0303_0303_0303_0303,
            0x0202_0202_0202_0202,
            0x0101_0101_0101_0101,
            0,
        ),
    );
    // Every bit but `e % 8` set in byte `e`: all ones exactly where bit `e % 8` is set.
    let others = _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe_u64 as i64);
    let set = _mm256_cmpeq_epi8(_mm256_or_si256(h, others), _mm256_set1_epi8(-1));
    if OFFSET == 16 {
        // `n | 16·bit − 16`: where the bit is clear, `n − 16` is `n | 0xf0` in two's complement.
        _mm256_or_si256(n, _mm256_andnot_si256(set, _mm256_set1_epi8(0xf0_u8 as i8)))
    } else {
        _mm256_or_si256(n, _mm256_and_si256(set, _mm256_set1_epi8(0x10)))
    }
}

/// The 32 signed bytes `q` as four vectors of i32 lanes, elements 0..8, 8..16, 16..24, 24..32.
#[inline(always)]
unsafe fn bytes_to_i32(q: __m256i) -> [__m256i; 4] {
    let lo = _mm256_castsi256_si128(q);
    let hi = _mm256_extracti128_si256::<1>(q);
    [
        _mm256_cvtepi8_epi32(lo),
        _mm256_cvtepi8_epi32(_mm_unpackhi_epi64(lo, lo)),
        _mm256_cvtepi8_epi32(hi),
        _mm256_cvtepi8_epi32(_mm_unpackhi_epi64(hi, hi)),
    ]
}

/// Four vectors of integer lanes to f32, after subtracting `offset` from each.
#[inline(always)]
unsafe fn to_f32_minus(v: [__m256i; 4], offset: i32) -> [__m256; 4] {
    let o = _mm256_set1_epi32(offset);
    [
        _mm256_cvtepi32_ps(_mm256_sub_epi32(v[0], o)),
        _mm256_cvtepi32_ps(_mm256_sub_epi32(v[1], o)),
        _mm256_cvtepi32_ps(_mm256_sub_epi32(v[2], o)),
        _mm256_cvtepi32_ps(_mm256_sub_epi32(v[3], o)),
    ]
}

impl Quants256 for Q5_0 {
    #[inline(always)]
    unsafe fn q256(p: *const u8) -> [__m256; 4] {
        to_f32_minus(bytes_to_i32(five_bit_bytes::<16>(p.add(2), p.add(6))), 0)
    }
}

impl Quants256 for Q5_1 {
    #[inline(always)]
    unsafe fn q256(p: *const u8) -> [__m256; 4] {
        to_f32_minus(bytes_to_i32(five_bit_bytes::<0>(p.add(4), p.add(8))), 0)
    }
}

/// The block's f16 scale and (Q4_1, Q5_1) min widened to f32: lanes `[d, m, ·, ·]` (lane 1 is junk
/// for formats without a min).
#[inline(always)]
pub(super) unsafe fn scales(p: *const u8) -> __m128 {
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
        pf: usize,
    ) -> [f32; R] {
        qgemv_256::<Q, R>(w, x, prep.as_ptr(), nb, pf)
    }
}

#[inline(always)]
unsafe fn qgemv_256<Q: Quants256, const R: usize>(
    w: [*const u8; R],
    x: *const f32,
    xs: *const f32,
    nb: usize,
    pf: usize,
) -> [f32; R] {
    const QK: usize = 32;
    let mut acc = [_mm256_setzero_ps(); R];
    let mut macc = [_mm_setzero_ps(); R];
    for b in 0..nb {
        let mut xv = [_mm256_setzero_ps(); 4];
        for (j, v) in xv.iter_mut().enumerate() {
            *v = _mm256_loadu_ps(x.add(b * QK + 8 * j));
        }
        for r in 0..R {
            let p = w[r].add(b * Q::BYTES);
            prefetch_block(p.wrapping_add(pf), Q::BYTES);
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
    let mut s = [0f32; R];
    for r in 0..R {
        s[r] = hsum256(acc[r]) + _mm_cvtss_f32(macc[r]);
    }
    s
}

/// GEMV (`job.tokens == 1`) on Q8_0/Q4_0/Q4_1/Q5_0/Q5_1 blocks.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn legacy_rows<Q: Quants256>(w: *const u8, job: &Job) {
    x86::gemv_rows::<Legacy256<Q>>(w, job)
}

impl<Q: Quants256> RowTokens for Legacy256<Q> {
    /// Per token as [`qgemv_256`].
    #[inline(always)]
    unsafe fn row<const T: usize>(
        row: *const u8,
        x: [*const f32; T],
        xs: [*const f32; T],
        nb: usize,
        pf: usize,
    ) -> [f32; T] {
        const QK: usize = 32;
        let mut acc = [_mm256_setzero_ps(); T];
        let mut macc = [_mm_setzero_ps(); T];
        for b in 0..nb {
            let p = row.add(b * Q::BYTES);
            prefetch_block(p.wrapping_add(pf), Q::BYTES);
            let dm = scales(p);
            let d = _mm256_broadcastss_ps(dm);
            let q = Q::q256(p);
            for t in 0..T {
                let xb = x[t].add(b * QK);
                let mut s = _mm256_mul_ps(q[0], _mm256_loadu_ps(xb));
                s = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xb.add(8)), s);
                s = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xb.add(16)), s);
                s = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xb.add(24)), s);
                acc[t] = _mm256_fmadd_ps(d, s, acc[t]);
                if Q::HAS_MIN {
                    macc[t] = _mm_fmadd_ss(_mm_movehdup_ps(dm), _mm_load_ss(xs[t].add(b)), macc[t]);
                }
            }
        }
        let mut s = [0f32; T];
        for t in 0..T {
            s[t] = hsum256(acc[t]) + _mm_cvtss_f32(macc[t]);
        }
        s
    }
}

/// A few tokens on Q8_0/Q4_0/Q4_1/Q5_0/Q5_1 blocks (see [`few_tokens_rows`]).
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn legacy_tokens_rows<Q: Quants256>(w: *const u8, job: &Job) -> bool {
    few_tokens_rows::<Legacy256<Q>>(w, job)
}

/// A few tokens on Q4_K blocks (see [`few_tokens_rows`], [`K4Gemv256`]).
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn k4_tokens_rows(w: *const u8, job: &Job) -> bool {
    few_tokens_rows::<K4Gemv256>(w, job)
}

/// A few tokens on Q6_K blocks (see [`few_tokens_rows`], [`K6Gemv256`]).
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn k6_tokens_rows(w: *const u8, job: &Job) -> bool {
    few_tokens_rows::<K6Gemv256>(w, job)
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

// ----- K-quants -----

/// Q4_K's GEMV, folding each 32-element sub-block's scale into its partial sum as the legacy
/// kernels do: per super-block and row, the eight `d·sc_j` and `dmin·m_j` are formed once (the
/// same f32 products the format's decoding forms), the mins are dotted with the activation
/// row's sub-block sums `Σx` (computed once per call), and per sub-block `s = Σ q·x` over four
/// 8-lane vectors enters the row's accumulator as `acc += d·sc_j · s`. The result is the f32
/// product of the dequantized weights with f32 activations up to the rounding of the sums.
struct K4Gemv256;

/// A Q4_K super-block's eight `d·sc_j` and eight `dmin·m_j`, formed as the format's decoding
/// forms them.
#[inline(always)]
pub(super) unsafe fn k4_scales(p: *const u8) -> (__m256, __m256) {
    let dm = scales(p);
    let sm = quant::scales_mins_k4(&*(p.add(4) as *const [u8; 12]));
    let sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(
        sm.as_ptr() as *const __m128i
    )));
    let mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(
        sm.as_ptr().add(8) as *const __m128i
    )));
    let d = _mm256_broadcastss_ps(dm);
    let dmin = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
    (_mm256_mul_ps(d, sc), _mm256_mul_ps(dmin, mn))
}

/// The quants of sub-blocks `2c` (low nibbles) and `2c + 1` (high nibbles) of the Q4_K
/// super-block at `p`, as f32 in four 8-lane vectors each.
#[inline(always)]
unsafe fn k4_pair(p: *const u8, c: usize) -> ([__m256; 4], [__m256; 4]) {
    let low4 = _mm256_set1_epi32(0x0f);
    let qs = p.add(16 + 32 * c);
    let mut lo = [_mm256_setzero_ps(); 4];
    let mut hi = [_mm256_setzero_ps(); 4];
    for j in 0..4 {
        let v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(qs.add(8 * j) as *const __m128i));
        lo[j] = _mm256_cvtepi32_ps(_mm256_and_si256(v, low4));
        hi[j] = _mm256_cvtepi32_ps(_mm256_srli_epi32::<4>(v));
    }
    (lo, hi)
}

impl BlockGemv for K4Gemv256 {
    const ELEMS: usize = Q4_K::ELEMS;
    const BYTES: usize = Q4_K::BYTES;

    #[inline(always)]
    unsafe fn prepare(x: *const f32, nb: usize) -> Vec<f32> {
        chunk_sums(x, nb * Q4_K::ELEMS, 32)
    }

    // `r` indexes the row pointers, scale buffers and accumulators together.
    #[allow(clippy::needless_range_loop)]
    #[inline(always)]
    unsafe fn gemv<const R: usize>(
        w: [*const u8; R],
        x: *const f32,
        prep: &[f32],
        nb: usize,
        pf: usize,
    ) -> [f32; R] {
        let mut acc = [_mm256_setzero_ps(); R];
        let mut macc = [_mm256_setzero_ps(); R];
        let mut dsc = [[0f32; 8]; R];
        for b in 0..nb {
            let sums = _mm256_loadu_ps(prep.as_ptr().add(8 * b));
            for r in 0..R {
                let p = w[r].add(b * Q4_K::BYTES);
                prefetch_block(p.wrapping_add(pf), Q4_K::BYTES);
                let (d_sc, dmin_m) = k4_scales(p);
                _mm256_storeu_ps(dsc[r].as_mut_ptr(), d_sc);
                macc[r] = _mm256_fmadd_ps(dmin_m, sums, macc[r]);
            }
            let xb = x.add(b * Q4_K::ELEMS);
            // 32 bytes of quants per pair of sub-blocks: low nibbles sub-block 2c, high 2c + 1.
            for c in 0..4 {
                let mut xl = [_mm256_setzero_ps(); 4];
                let mut xh = [_mm256_setzero_ps(); 4];
                for j in 0..4 {
                    xl[j] = _mm256_loadu_ps(xb.add(64 * c + 8 * j));
                    xh[j] = _mm256_loadu_ps(xb.add(64 * c + 32 + 8 * j));
                }
                for r in 0..R {
                    let (lo, hi) = k4_pair(w[r].add(b * Q4_K::BYTES), c);
                    let mut sl = _mm256_setzero_ps();
                    let mut sh = _mm256_setzero_ps();
                    for j in 0..4 {
                        sl = _mm256_fmadd_ps(lo[j], xl[j], sl);
                        sh = _mm256_fmadd_ps(hi[j], xh[j], sh);
                    }
                    acc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(&dsc[r][2 * c]), sl, acc[r]);
                    acc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(&dsc[r][2 * c + 1]), sh, acc[r]);
                }
            }
        }
        // Σ_j d·sc_j·Σq·x − Σ_j dmin·m_j·Σx
        let mut s = [0f32; R];
        for r in 0..R {
            s[r] = hsum256(acc[r]) - hsum256(macc[r]);
        }
        s
    }
}

impl RowTokens for K4Gemv256 {
    /// Per token as [`K4Gemv256`]'s GEMV; the quants of each pair of sub-blocks are widened
    /// once for all the tokens.
    #[inline(always)]
    unsafe fn row<const T: usize>(
        row: *const u8,
        x: [*const f32; T],
        prep: [*const f32; T],
        nb: usize,
        pf: usize,
    ) -> [f32; T] {
        let mut acc = [_mm256_setzero_ps(); T];
        let mut macc = [_mm256_setzero_ps(); T];
        let mut dsc = [0f32; 8];
        for b in 0..nb {
            let p = row.add(b * Q4_K::BYTES);
            prefetch_block(p.wrapping_add(pf), Q4_K::BYTES);
            let (d_sc, dm_mn) = k4_scales(p);
            _mm256_storeu_ps(dsc.as_mut_ptr(), d_sc);
            for t in 0..T {
                let sums = _mm256_loadu_ps(prep[t].add(8 * b));
                macc[t] = _mm256_fmadd_ps(dm_mn, sums, macc[t]);
            }
            for c in 0..4 {
                let (lo, hi) = k4_pair(p, c);
                for t in 0..T {
                    let xb = x[t].add(b * Q4_K::ELEMS + 64 * c);
                    let mut sl = _mm256_setzero_ps();
                    let mut sh = _mm256_setzero_ps();
                    for j in 0..4 {
                        sl = _mm256_fmadd_ps(lo[j], _mm256_loadu_ps(xb.add(8 * j)), sl);
                        sh = _mm256_fmadd_ps(hi[j], _mm256_loadu_ps(xb.add(32 + 8 * j)), sh);
                    }
                    acc[t] = _mm256_fmadd_ps(_mm256_broadcast_ss(&dsc[2 * c]), sl, acc[t]);
                    acc[t] = _mm256_fmadd_ps(_mm256_broadcast_ss(&dsc[2 * c + 1]), sh, acc[t]);
                }
            }
        }
        let mut s = [0f32; T];
        for t in 0..T {
            s[t] = hsum256(acc[t]) - hsum256(macc[t]);
        }
        s
    }
}

/// Q6_K's GEMV. A super-block's 16 sub-blocks of 16 elements each have a signed 8-bit scale
/// `sc` under the super-block's f16 `d`; an element is `d·sc·(q − 32)` with the quant's low 4
/// bits in `ql` and its top 2 in `qh`. Per 8 elements and row, the quants are rebuilt in 8
/// integer lanes, multiplied by `sc` as integers (exact: |sc·(q − 32)| ≤ 4,096), converted to
/// f32 and multiplied with x into the super-block's partial; `d` is applied once per super-block
/// and row (`acc += d · partial`). Equal to the f32 product of the dequantized weights with f32
/// activations up to the rounding of the sums.
struct K6Gemv256;

/// Eight quants of the Q6_K super-block at `p` times their sub-block's scale, as f32 (exact:
/// integers up to 4,096): half `h` uses 64 bytes of `ql` and 32 of `qh`; its 32-element quarter
/// `q` takes the low (quarters 0, 1) or high (2, 3) nibbles of `ql` run `q % 2` and bits
/// `2·q..` of `qh`; `piece` is the quarter's 8-element part (element `l` is byte `l` of both).
#[inline(always)]
unsafe fn k6_eight(p: *const u8, h: usize, q: usize, piece: usize) -> __m256 {
    let l0 = 8 * piece;
    let ql = p.add(64 * h + 32 * (q % 2) + l0);
    let qh = p.add(128 + 32 * h + l0);
    let lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64(ql as *const __m128i));
    let hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64(qh as *const __m128i));
    let lo = _mm256_and_si256(
        _mm256_srl_epi32(lo, _mm_cvtsi32_si128(4 * (q / 2) as i32)),
        _mm256_set1_epi32(0x0f),
    );
    let hi = _mm256_and_si256(
        _mm256_srl_epi32(hi, _mm_cvtsi32_si128(2 * q as i32)),
        _mm256_set1_epi32(0x03),
    );
    let v = _mm256_sub_epi32(
        _mm256_or_si256(lo, _mm256_slli_epi32::<4>(hi)),
        _mm256_set1_epi32(32),
    );
    // Sub-block (16 elements) `8·h + 2·q + piece / 2`.
    let sc = *(p.add(192 + 8 * h + 2 * q + piece / 2) as *const i8);
    _mm256_cvtepi32_ps(_mm256_mullo_epi32(v, _mm256_set1_epi32(sc as i32)))
}

impl BlockGemv for K6Gemv256 {
    const ELEMS: usize = Q6_K::ELEMS;
    const BYTES: usize = Q6_K::BYTES;

    #[inline(always)]
    unsafe fn prepare(_x: *const f32, _nb: usize) -> Vec<f32> {
        Vec::new()
    }

    // `r` indexes the row pointers and accumulators together.
    #[allow(clippy::needless_range_loop)]
    #[inline(always)]
    unsafe fn gemv<const R: usize>(
        w: [*const u8; R],
        x: *const f32,
        _prep: &[f32],
        nb: usize,
        pf: usize,
    ) -> [f32; R] {
        let low4 = _mm256_set1_epi32(0x0f);
        let low2 = _mm256_set1_epi32(0x03);
        let bias = _mm256_set1_epi32(32);
        let mut acc = [_mm256_setzero_ps(); R];
        for b in 0..nb {
            let mut part = [_mm256_setzero_ps(); R];
            let xb = x.add(b * Q6_K::ELEMS);
            for r in 0..R {
                prefetch_block(w[r].add(b * Q6_K::BYTES).wrapping_add(pf), Q6_K::BYTES);
            }
            // The decoding of `k6_eight`, written out so the per-quarter shift counts stay out
            // of the row loop: calling `k6_eight` here measured ~11% slower Qwen2.5-0.5B decode
            // (AMD EPYC Zen 3). Same operations, same values.
            // Half `h` of the super-block uses 64 bytes of `ql` and 32 of `qh`; its 32-element
            // quarter `q` takes the low (quarters 0, 1) or high (2, 3) nibbles of `ql` run
            // `q % 2`, and bits `2·q..` of `qh`. Element `l` of a quarter is byte `l` of both.
            for h in 0..2 {
                for q in 0..4 {
                    let lshift = _mm_cvtsi32_si128(4 * (q / 2) as i32);
                    let hshift = _mm_cvtsi32_si128(2 * q as i32);
                    for piece in 0..4 {
                        let l0 = 8 * piece;
                        let xv = _mm256_loadu_ps(xb.add(128 * h + 32 * q + l0));
                        for r in 0..R {
                            let p = w[r].add(b * Q6_K::BYTES);
                            let ql = p.add(64 * h + 32 * (q % 2) + l0);
                            let qh = p.add(128 + 32 * h + l0);
                            let lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64(ql as *const __m128i));
                            let hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64(qh as *const __m128i));
                            let lo = _mm256_and_si256(_mm256_srl_epi32(lo, lshift), low4);
                            let hi = _mm256_and_si256(_mm256_srl_epi32(hi, hshift), low2);
                            let v = _mm256_sub_epi32(
                                _mm256_or_si256(lo, _mm256_slli_epi32::<4>(hi)),
                                bias,
                            );
                            // Sub-block (16 elements) `8·h + 2·q + piece / 2`.
                            let sc = *(p.add(192 + 8 * h + 2 * q + piece / 2) as *const i8);
                            let v = _mm256_mullo_epi32(v, _mm256_set1_epi32(sc as i32));
                            part[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), xv, part[r]);
                        }
                    }
                }
            }
            for r in 0..R {
                let p = w[r].add(b * Q6_K::BYTES + 208);
                let d = quant::f16_at(std::slice::from_raw_parts(p, 2));
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d), part[r], acc[r]);
            }
        }
        let mut s = [0f32; R];
        for r in 0..R {
            s[r] = hsum256(acc[r]);
        }
        s
    }
}

impl RowTokens for K6Gemv256 {
    /// Per token as [`K6Gemv256`]'s GEMV; each 8 quants are rebuilt and scaled once for all the
    /// tokens.
    #[inline(always)]
    unsafe fn row<const T: usize>(
        row: *const u8,
        x: [*const f32; T],
        _prep: [*const f32; T],
        nb: usize,
        pf: usize,
    ) -> [f32; T] {
        let mut acc = [_mm256_setzero_ps(); T];
        for b in 0..nb {
            let p = row.add(b * Q6_K::BYTES);
            prefetch_block(p.wrapping_add(pf), Q6_K::BYTES);
            let mut part = [_mm256_setzero_ps(); T];
            for h in 0..2 {
                for q in 0..4 {
                    for piece in 0..4 {
                        let l0 = 8 * piece;
                        let v = k6_eight(p, h, q, piece);
                        for t in 0..T {
                            let xv =
                                _mm256_loadu_ps(x[t].add(b * Q6_K::ELEMS + 128 * h + 32 * q + l0));
                            part[t] = _mm256_fmadd_ps(v, xv, part[t]);
                        }
                    }
                }
            }
            let d = quant::f16_at(std::slice::from_raw_parts(p.add(208), 2));
            for t in 0..T {
                acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d), part[t], acc[t]);
            }
        }
        let mut s = [0f32; T];
        for t in 0..T {
            s[t] = hsum256(acc[t]);
        }
        s
    }
}

/// GEMV (`job.tokens == 1`) on Q4_K blocks (see [`K4Gemv256`]).
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn k4_rows(w: *const u8, job: &Job) {
    x86::gemv_rows::<K4Gemv256>(w, job)
}

/// GEMV (`job.tokens == 1`) on Q6_K blocks (see [`K6Gemv256`]).
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn k6_rows(w: *const u8, job: &Job) {
    x86::gemv_rows::<K6Gemv256>(w, job)
}

//! The AVX2 kernels for Q4_0, Q4_1, Q4_K and Q5_0 weights grouped in [`Layout::Halves`]: up to
//! [`MAX_TOKENS`] tokens, each (row, token) the chain of [`super::grouped::rows_ref`] bit for
//! bit; and the exact dequantization of Q5_0's rows into prefill tiles (the 4-bit formats keep
//! the streams bytes, which [`super::avx2_grouped::dequantize`] reads).
//!
//! **Per element**, for eight rows: one mask and one conversion, then one FMA per token with the
//! broadcast activation. A lane's word is read at byte offsets 0 and 2 (the high 16 bits then
//! hold the next row's bytes, masked off), so every field lies at bit 0, 5 or 10 (Q5_0) or 0,
//! 4, 8 or 12 (the 4-bit formats) of its lane, and masked in place it is `2^p` times the
//! unsigned quant: against activations divided by `2^p` once per call ([`Activations`]),
//! `2^p·q · x/2^p` is `q·x` exactly and the FMA rounds the same sum. Where a division would
//! round (an activation within `2^10` or `2^12` of the subnormals), each field is shifted down
//! instead, for the same bits. The masks stay in registers. The chains take consecutive
//! elements in turn (`e mod 4`), so the fields go in the order they lie and each word is loaded
//! where it is used; one token's full groups go in one pass over both halves (each broadcast
//! serves sixteen rows, eight chains in flight), other calls one half and up to two tokens at a
//! time.
//!
//! **Measured.** One core of the 2-vCPU AMD EPYC (Zen 3, AVX2, no AVX-512), weights in cache,
//! `cargo bench --bench kernels -- 'gemv/Q5_0-grouped/4864x896/avx2$'` (Qwen2.5-Coder-0.5B's
//! gate; GiB/s of ggml's blocks): 9.2 in the streams layout, 14.0 in this one. Qwen2.5-Coder-0.5B
//! Q4_K_M decode at two threads (`kiln-bench -t 2 -p 0 -n 64 -r 2 --profile`): its gate+up
//! projections 8.4 → 5.5 ms a step, 53.3 → 65.0 tok/s (streaming reads of 35.6 and 31.4 GB/s).
//! The 4-bit formats gained less (their streams kernel needed no shift for most fields either):
//! the same bench, Q4_1 1536 × 576 12.8 → 13.2 GiB/s, 49152 × 576 13.1 → 13.6, Q4_K 896 × 4864
//! 11.2 → 11.5; SmolLM2-135M Q4_1 decode (`kiln-bench -t 2 -p 0 -n 128 -r 3`, both layouts in one
//! build alternating three times) 216 / 197 / 204 → 232 / 212 / 233 tok/s.
//!
//! The speed depends on how LLVM compiles [`rows_with`]'s loops: an iterator shared with the
//! other AVX2 kernels for the walk over a group's halves (tried on 2026-12-03) took the same
//! bench from 12.2–12.6 to 10.1–10.2 GiB/s on Q4_1 1536 × 576 and from 13.8 to 10.7–11.0 on Q5_0
//! 4864 × 896 (old and new builds alternating twice), so a change here is compared build
//! against build.

use std::arch::x86_64::*;

use super::avx2_grouped::{half_f16, k4_scales, store, Activations, Pieces, LANES};
use super::grouped::format::{kind_of, Q4_0, Q4_1, Q4_K, Q5_0};
use super::grouped::{
    block_ahead, elems, group_spans, job_sums, prefetch_part, quants_at, value_offset, GroupSpan,
    Grouped, Layout, BLOCK, GROUP, HALVES_QUANTS, HALVES_WORDS, K4_QUANTS, K4_SUB, K4_SUB_BYTES,
    MAX_TOKENS,
};
use super::Job;
use crate::model::quant::QuantKind;

/// Outputs `job.rows` for `job.tokens` (at most [`MAX_TOKENS`]) tokens from weights in
/// [`Layout::Halves`].
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; `job`'s output must be valid for writes at
/// `t·ldo + n` for every token and row of the job, its input for reads of `w.cols` values per
/// token, its bias (if any) for reads up to `w.rows`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn rows(w: &Grouped, job: &Job) {
    assert!(
        w.layout == Layout::Halves && job.tokens <= MAX_TOKENS,
        "{} tokens of {:?} weights for the halves kernel",
        job.tokens,
        w.layout
    );
    match w.kind {
        QuantKind::Q4_0 => rows_of::<Q4_0>(w, job),
        QuantKind::Q4_1 => rows_of::<Q4_1>(w, job),
        QuantKind::Q4_K => rows_of::<Q4_K>(w, job),
        QuantKind::Q5_0 => rows_of::<Q5_0>(w, job),
        k => unreachable!("{} is never in the halves layout", k.name()),
    }
}

#[inline(always)]
unsafe fn rows_of<const F: u8>(w: &Grouped, job: &Job) {
    if job.tokens == 0 {
        return;
    }
    let mut own = None;
    let made = Activations::of_job(w, job, &mut own);
    match made.halves(w.kind) {
        Some(x) => rows_with::<F, true>(w, job, x.as_ptr(), job.k),
        None => rows_with::<F, false>(w, job, job.xptr(0), job.ldx),
    }
}

/// [`rows`] on the activations at `x` (tokens `ldx` apart): with `H` those of [`Activations`]
/// (divided by each field's place value), else the job's own.
#[inline(always)]
unsafe fn rows_with<const F: u8, const H: bool>(w: &Grouped, job: &Job, x: *const f32, ldx: usize) {
    let sums = job_sums(w, job);
    let blocks = w.cols / BLOCK;
    let token = |t: usize| (x.add(t * ldx), sums.as_ptr().add(t * blocks));
    let nb = w.cols / elems(w.kind);
    for span in group_spans(w, job.rows.clone()) {
        let GroupSpan {
            n0, lo, hi, base, ..
        } = span;
        // The first pass over a group fetches the bytes ahead as it goes.
        let mut ahead = span.ahead;
        if job.tokens == 1 && lo == 0 && hi == GROUP {
            let acc = pass::<F, 2, 1, H>(base, nb, w.block_bytes(), ahead, [0, 1], [token(0)]);
            store(job, 0, n0, 0..LANES, &[acc[0]]);
            store(job, 0, n0 + LANES, 0..LANES, &[acc[1]]);
            continue;
        }
        // The second half's pass reads the lines that the first one brought in.
        for h in lo / LANES..hi.div_ceil(LANES) {
            let r0 = n0 + LANES * h;
            let lanes = lo.max(LANES * h) - LANES * h..hi.min(LANES * (h + 1)) - LANES * h;
            let mut t0 = 0;
            while t0 < job.tokens {
                let bb = w.block_bytes();
                if job.tokens - t0 >= 2 {
                    let two = [token(t0), token(t0 + 1)];
                    let acc = pass::<F, 1, 2, H>(base, nb, bb, ahead, [h], two);
                    store(job, t0, r0, lanes.clone(), &acc);
                    t0 += 2;
                } else {
                    let acc = pass::<F, 1, 1, H>(base, nb, bb, ahead, [h], [token(t0)]);
                    store(job, t0, r0, lanes.clone(), &[acc[0]]);
                    t0 += 1;
                }
                ahead = std::ptr::null();
            }
        }
    }
}

/// The outputs of halves `halves` of the group at `base` (`nb` blocks of `bb` bytes; the K
/// formats' super-blocks) for `N` tokens (their activations and block sums), `K·N ≤ 2` of them,
/// half `halves[k]` and token `t` at `k·N + t`; asking the bytes at `ahead` into the cache as it
/// goes (null: none).
#[inline(always)]
unsafe fn pass<const F: u8, const K: usize, const N: usize, const H: bool>(
    base: *const u8,
    nb: usize,
    bb: usize,
    ahead: *const u8,
    halves: [usize; K],
    tokens: [(*const f32, *const f32); N],
) -> [__m256; 2] {
    const { assert!(K * N <= 2) };
    let mut acc = [_mm256_setzero_ps(); 2];
    for b in 0..nb {
        let blk = base.add(b * bb);
        let next = block_ahead(ahead, b * bb);
        if F == Q4_K {
            for j in 0..K4_SUB {
                prefetch_part(next, bb, j, K4_SUB);
                let sub = b * K4_SUB + j;
                let x: [*const f32; N] = std::array::from_fn(|t| tokens[t].0.add(sub * BLOCK));
                let q = blk.add(K4_QUANTS + j * K4_SUB_BYTES);
                let p = run4::<K, N, H>(q, halves, x);
                for (k, &h) in halves.iter().enumerate() {
                    let (d1, m1) = k4_scales(blk, h, j);
                    let neg = _mm256_xor_ps(m1, _mm256_set1_ps(-0.0));
                    scale::<N>(&mut acc, &p, k, d1, neg, tokens, sub);
                }
            }
            continue;
        }
        prefetch_part(next, bb, 0, 1);
        let x: [*const f32; N] = std::array::from_fn(|t| tokens[t].0.add(b * BLOCK));
        let p = if F == Q5_0 {
            run5::<K, N, H>(blk.add(HALVES_QUANTS), halves, x)
        } else {
            run4::<K, N, H>(blk.add(quants_at(kind_of(F))), halves, x)
        };
        for (k, &h) in halves.iter().enumerate() {
            let d = half_f16(blk, h);
            let m = if F == Q4_1 {
                half_f16(blk.add(2 * GROUP), h)
            } else {
                _mm256_mul_ps(d, _mm256_set1_ps(value_offset(kind_of(F)) as f32))
            };
            scale::<N>(&mut acc, &p, k, d, m, tokens, b);
        }
    }
    acc
}

/// Four chains (`e mod 4`) of each of up to two (half, token) pairs: `p[chain][k·N + t]`.
type Chains = [[__m256; 2]; 4];

/// Half `k`'s chains of `p` into the accumulators of its `N` tokens: `acc ← fma(d, s, acc)`,
/// then `acc ← fma(m, Σx, acc)` with block sum `sum` of each token.
#[inline(always)]
unsafe fn scale<const N: usize>(
    acc: &mut [__m256; 2],
    p: &Chains,
    k: usize,
    d: __m256,
    m: __m256,
    tokens: [(*const f32, *const f32); N],
    sum: usize,
) {
    for (t, &(_, sums)) in tokens.iter().enumerate() {
        let j = k * N + t;
        let s = _mm256_add_ps(
            _mm256_add_ps(p[0][j], p[1][j]),
            _mm256_add_ps(p[2][j], p[3][j]),
        );
        acc[j] = _mm256_fmadd_ps(d, s, acc[j]);
        acc[j] = _mm256_fmadd_ps(m, _mm256_set1_ps(*sums.add(sum)), acc[j]);
    }
}

/// Element `e`'s fields, the lanes `v[k]` of half `halves[k]` masked with `masks[i]` (place
/// value `2^place`), into chain `e mod 4` of each (half, token) of `p`; activations at `x`.
macro_rules! put {
    ($p:ident, $x:ident, $masks:ident, $e:expr, $v:expr, $i:literal, $place:expr) => {{
        let e: usize = $e;
        let xe: [__m256; N] = std::array::from_fn(|t| _mm256_set1_ps(*$x[t].add(e)));
        for k in 0..K {
            let f = quant::<H, { $place }>(_mm256_and_si256($v[k], $masks[$i]));
            for t in 0..N {
                $p[e % 4][k * N + t] = _mm256_fmadd_ps(f, xe[t], $p[e % 4][k * N + t]);
            }
        }
    }};
}

/// The chains of one 32-element run of Q5_0 quants at `q` (after a block's `d`s).
#[inline(always)]
unsafe fn run5<const K: usize, const N: usize, const H: bool>(
    q: *const u8,
    halves: [usize; K],
    x: [*const f32; N],
) -> Chains {
    let masks = [
        _mm256_set1_epi32(0x1f),
        _mm256_set1_epi32(0x1f << 5),
        _mm256_set1_epi32(0x1f << 10),
    ];
    let mut p = [[_mm256_setzero_ps(); 2]; 4];
    macro_rules! word {
        ($w:literal) => {{
            let at = |k: usize, byte: usize| {
                _mm256_loadu_si256(q.add(64 * $w + 32 * halves[k] + byte) as *const __m256i)
            };
            let low: [__m256i; K] = std::array::from_fn(|k| at(k, 0));
            put!(p, x, masks, 6 * $w, low, 0, 0);
            put!(p, x, masks, 6 * $w + 1, low, 1, 5);
            put!(p, x, masks, 6 * $w + 2, low, 2, 10);
            let high: [__m256i; K] = std::array::from_fn(|k| at(k, 2));
            put!(p, x, masks, 6 * $w + 3, high, 0, 0);
            put!(p, x, masks, 6 * $w + 4, high, 1, 5);
            put!(p, x, masks, 6 * $w + 5, high, 2, 10);
        }};
    }
    word!(0);
    word!(1);
    word!(2);
    word!(3);
    word!(4);
    // Elements 30 and 31: half h's rows in the low or high 16 bits of the shared word.
    let last: [__m256i; K] = std::array::from_fn(|k| {
        _mm256_loadu_si256(q.add(HALVES_WORDS * 64 + 2 * halves[k]) as *const __m256i)
    });
    put!(p, x, masks, 30, last, 0, 0);
    put!(p, x, masks, 31, last, 1, 5);
    p
}

/// The chains of one 32-element run of 4-bit quants at `q` (four 64-byte words: element
/// `8w + 4k + i` in nibble `i` of word `w`'s 16-bit half `k`).
#[inline(always)]
unsafe fn run4<const K: usize, const N: usize, const H: bool>(
    q: *const u8,
    halves: [usize; K],
    x: [*const f32; N],
) -> Chains {
    let masks = [
        _mm256_set1_epi32(0xf),
        _mm256_set1_epi32(0xf0),
        _mm256_set1_epi32(0xf00),
        _mm256_set1_epi32(0xf000),
    ];
    let mut p = [[_mm256_setzero_ps(); 2]; 4];
    macro_rules! half {
        ($w:literal, $half:literal) => {{
            let v: [__m256i; K] = std::array::from_fn(|k| {
                _mm256_loadu_si256(q.add(64 * $w + 32 * halves[k] + 2 * $half) as *const __m256i)
            });
            put!(p, x, masks, 8 * $w + 4 * $half, v, 0, 0);
            put!(p, x, masks, 8 * $w + 4 * $half + 1, v, 1, 4);
            put!(p, x, masks, 8 * $w + 4 * $half + 2, v, 2, 8);
            put!(p, x, masks, 8 * $w + 4 * $half + 3, v, 3, 12);
        }};
    }
    half!(0, 0);
    half!(0, 1);
    half!(1, 0);
    half!(1, 1);
    half!(2, 0);
    half!(2, 1);
    half!(3, 0);
    half!(3, 1);
    p
}

/// A masked field (`2^P` times its quant) as f32: as it is against divided activations (`H`),
/// else shifted down to the quant.
#[inline(always)]
unsafe fn quant<const H: bool, const P: i32>(v: __m256i) -> __m256 {
    if H || P == 0 {
        _mm256_cvtepi32_ps(v)
    } else {
        _mm256_cvtepi32_ps(_mm256_srli_epi32::<P>(v))
    }
}

/// [`Layout::Halves`] for [`super::avx2_grouped::dequantize`]: one run of 32 elements a block,
/// `(q − 16)·d` as ggml dequantizes Q5_0.
pub(crate) struct Halves;

impl Pieces for Halves {
    const PIECES: usize = 1;
    #[inline(always)]
    unsafe fn piece(blk: *const u8, _: usize, h: usize, v: &mut [__m256; BLOCK]) {
        let d = half_f16(blk, h);
        let q = blk.add(HALVES_QUANTS);
        let value = |lane: __m256i, i: i32| {
            let shifted = _mm256_srl_epi32(
                _mm256_and_si256(lane, _mm256_set1_epi32(0x1f << (5 * i))),
                _mm_cvtsi32_si128(5 * i),
            );
            let q = _mm256_sub_epi32(shifted, _mm256_set1_epi32(16));
            _mm256_mul_ps(_mm256_cvtepi32_ps(q), d)
        };
        for w in 0..HALVES_WORDS {
            let at =
                |byte: usize| _mm256_loadu_si256(q.add(64 * w + 32 * h + byte) as *const __m256i);
            let (low, high) = (at(0), at(2));
            for i in 0..3 {
                v[6 * w + i] = value(low, i as i32);
                v[6 * w + 3 + i] = value(high, i as i32);
            }
        }
        let last = _mm256_loadu_si256(q.add(HALVES_WORDS * 64 + 2 * h) as *const __m256i);
        v[30] = value(last, 0);
        v[31] = value(last, 1);
    }
}

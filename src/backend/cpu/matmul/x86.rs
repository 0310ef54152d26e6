//! What the AVX2 and AVX-512 kernels share: the row/token drivers (written once, instantiated per
//! ISA inside each ISA's `#[target_feature]` entry points so every kernel call inlines), the
//! traits through which a driver reaches an ISA's kernels, and the generic block GEMV that gives
//! every [`BlockFormat`] a vector kernel on both ISAs from its exact scalar decoding.
//!
//! Only the entry points carry `#[target_feature]`; every helper they call (here, in `avx2.rs`,
//! `avx512.rs` and the loads in `simd.rs`) is `#[inline(always)]` without one, so it is inlined
//! into the entry point early and compiled with its features. A helper marked `#[inline]` +
//! `#[target_feature]` (stable Rust refuses `inline(always)` there) is inlined only when LLVM
//! chooses to, which depends on how the crate happens to be split into codegen units: after an
//! unrelated refactor, the 4 × 6 tile's accumulators were stored to the stack after every FMA and
//! batched decode fell from ~410 to ~250 tok/s (SmolLM2 Q4_1, 16 sequences, AMD EPYC, 2 threads).

use super::Job;
use crate::model::quant::{BlockFormat, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0};

/// An ISA's dense GEMV: `R` rows against one token.
pub(super) trait DenseGemv<W> {
    unsafe fn gemv<const R: usize>(w: [*const W; R], x: *const f32, k: usize) -> [f32; R];
}

/// An ISA's dense prefill kernels: an `R` rows × `T` tokens register tile of dot products.
pub(super) trait DenseKernels<W>: DenseGemv<W> {
    unsafe fn tile<const R: usize, const T: usize>(
        w: [*const W; R],
        x: [*const f32; T],
        k: usize,
    ) -> [[f32; T]; R];

    /// A whole `4 × T` tile, rows `n..n + 4` (at `w`) by tokens `t..t + T`, written to the
    /// output. The default reduces through [`DenseKernels::tile`] and writes element by element;
    /// an ISA may reduce and write the tile's sums together.
    #[inline(always)]
    unsafe fn tile4_put<const T: usize>(w: [*const W; 4], job: &Job, n: usize, t: usize) {
        let s = Self::tile::<4, T>(w, tok_ptrs(job, t), job.k);
        put_tile(job, n, t, s);
    }
}

#[inline(always)]
pub(super) unsafe fn row_ptrs<W, const R: usize>(w: *const W, n: usize, k: usize) -> [*const W; R] {
    std::array::from_fn(|r| w.add((n + r) * k))
}

#[inline(always)]
pub(super) unsafe fn tok_ptrs<const T: usize>(job: &Job, t: usize) -> [*const f32; T] {
    std::array::from_fn(|j| job.xptr(t + j))
}

/// Write an `R × T` block of results for rows `n..`, tokens `t..`.
#[inline(always)]
pub(super) unsafe fn put_tile<const R: usize, const T: usize>(
    job: &Job,
    n: usize,
    t: usize,
    s: [[f32; T]; R],
) {
    for (r, sr) in s.iter().enumerate() {
        for (j, &v) in sr.iter().enumerate() {
            job.put(t + j, n + r, v);
        }
    }
}

/// One `4 × T` (or, for a group of fewer than 4 rows, row-by-row `1 × T`) tile at rows `n..end`,
/// tokens `t..t + T`.
#[inline(always)]
unsafe fn dense_tile<W, K: DenseKernels<W>, const T: usize>(
    w: *const W,
    job: &Job,
    n: usize,
    end: usize,
    t: usize,
) {
    let k = job.k;
    if n + 4 <= end {
        K::tile4_put::<T>(row_ptrs(w, n, k), job, n, t);
    } else {
        for r in n..end {
            let s = K::tile::<1, T>(row_ptrs(w, r, k), tok_ptrs(job, t), k);
            put_tile(job, r, t, s);
        }
    }
}

/// The dense driver: groups of `ROWS` rows (4, or 1 to read the rows one at a time as one
/// stream); the first `tokens − tokens mod T2` tokens go `T` at a time through the register
/// tile, then through `T2`- and `T3`-token tiles, and the last `tokens mod T2` one at a time
/// (GEMV); a group of fewer than 4 rows runs row by row, as every tile's output and every GEMV
/// row are one chain over k whatever the rows beside them, so `ROWS` does not move a bit.
/// `T > T2 > T3 > 1`, or equal values where an ISA has fewer tile widths. Every tile width sums a
/// dot product in the same order, so which tokens take the GEMV (whose order differs) is what
/// fixes the rounding: it is the same set as with `T2`-wide tiles alone.
#[inline(always)]
pub(super) unsafe fn dense_rows<
    W,
    K: DenseKernels<W>,
    const T: usize,
    const T2: usize,
    const T3: usize,
    const ROWS: usize,
>(
    w: *const W,
    job: &Job,
) {
    let mut n = job.rows.start;
    while n < job.rows.end {
        let end = (n + ROWS).min(job.rows.end);
        let tiled = job.tokens - job.tokens % T2;
        let mut t = 0;
        while t + T <= tiled {
            dense_tile::<W, K, T>(w, job, n, end, t);
            t += T;
        }
        if T2 > 1 && T2 < T && t + T2 <= tiled {
            dense_tile::<W, K, T2>(w, job, n, end, t);
            t += T2;
        }
        if T3 > 1 && T3 < T2 && t + T3 <= tiled {
            dense_tile::<W, K, T3>(w, job, n, end, t);
            t += T3;
        }
        gemv_tokens::<W, K>(w, job, n, end, t);
        n = end;
    }
}

/// Tokens `t..` of the rows `n..end` (at most 4) through the GEMV, one token at a time.
#[inline(always)]
unsafe fn gemv_tokens<W, K: DenseGemv<W>>(
    w: *const W,
    job: &Job,
    n: usize,
    end: usize,
    mut t: usize,
) {
    let k = job.k;
    while t < job.tokens {
        if n + 4 <= end {
            let s = K::gemv::<4>(row_ptrs(w, n, k), job.xptr(t), k);
            put_tile::<4, 1>(job, n, t, s.map(|v| [v]));
        } else {
            for r in n..end {
                let s = K::gemv::<1>(row_ptrs(w, r, k), job.xptr(t), k);
                job.put(t, r, s[0]);
            }
        }
        t += 1;
    }
}

/// A GEMV over rows of blocks: `R` rows against one activation row.
pub(super) trait BlockGemv {
    /// Elements and bytes per block.
    const ELEMS: usize;
    const BYTES: usize;
    /// What the kernel needs from the activation row once per call (block sums), or nothing.
    unsafe fn prepare(x: *const f32, nb: usize) -> Vec<f32>;
    /// `R` rows of `nb` blocks against `x`; `pf` is the byte distance to prefetch ahead.
    unsafe fn gemv<const R: usize>(
        w: [*const u8; R],
        x: *const f32,
        prep: &[f32],
        nb: usize,
        pf: usize,
    ) -> [f32; R];
}

/// How far ahead (bytes) a group of 4 rows of `rb` bytes each prefetches in the quantized GEMVs:
/// the same block 16 rows on while that stays within [`PREFETCH_SPAN`], never nearer than the
/// next group (4 rows). The lines prefetched are used four groups later, so the span between
/// must stay in L1. One group ahead had been too near for short rows: SmolLM2's (576 columns,
/// 360 bytes in Q4_1) take about as long per group as a DRAM miss. On a Zen 5
/// (`kiln-bench -p 0 -n 64 -t 2`, old and new builds alternating) this took SmolLM2 Q4_1 decode
/// from 213–223 to 262–281 tok/s, Q8_0 from 169–176 to 241–284 and Qwen2.5-Coder-0.5B from 55 to
/// 67–69 in exact numerics; in int16 Q4_1 and Q8_0 gained too (Q8_0 210–215 → 278–283), Qwen
/// stayed at 75–78. A 16 KiB span measured about the same; the AVX2 kernels on the same CPU
/// gained on Q4_1 (218–221 → 253–259) and not on Qwen (not yet measured on an AVX2-only CPU).
#[inline(always)]
pub(super) fn prefetch_ahead(rb: usize) -> usize {
    (16 * rb).min(PREFETCH_SPAN.max(4 * rb))
}

/// The most bytes [`prefetch_ahead`] reaches beyond the next group: a quarter of a 32 KiB L1.
const PREFETCH_SPAN: usize = 8 << 10;

/// The quantized GEMV driver (`job.tokens == 1`): groups of 4 rows, then single rows. A group
/// prefetches the same block of a later group of rows ([`prefetch_ahead`]), so that group's
/// loads find their lines in cache.
#[inline(always)]
pub(super) unsafe fn gemv_rows<K: BlockGemv>(w: *const u8, job: &Job) {
    let nb = job.k / K::ELEMS;
    let rb = nb * K::BYTES;
    let x = job.xptr(0);
    let prep = K::prepare(x, nb);
    let end = job.rows.end;
    let mut n = job.rows.start;
    while n + 4 <= end {
        let s = K::gemv::<4>(row_ptrs(w, n, rb), x, &prep, nb, prefetch_ahead(rb));
        put_tile::<4, 1>(job, n, 0, s.map(|v| [v]));
        n += 4;
    }
    while n < end {
        let s = K::gemv::<1>(row_ptrs(w, n, rb), x, &prep, nb, rb);
        job.put(0, n, s[0]);
        n += 1;
    }
}

/// A format's kernel for a few tokens against one row: each block is read and decoded once for
/// all `T` tokens, and per token the arithmetic is the format's one-token GEMV's, so every
/// token's result is bit-identical to its one-token call.
/// Its block geometry and per-token preparation are the GEMV's ([`BlockGemv`]).
pub(super) trait RowTokens: BlockGemv {
    /// One row of `nb` blocks at `row` against `T` tokens; `pf` is the distance to prefetch.
    unsafe fn row<const T: usize>(
        row: *const u8,
        x: [*const f32; T],
        prep: [*const f32; T],
        nb: usize,
        pf: usize,
    ) -> [f32; T];
}

/// The few-token driver (2 to 8 tokens: small batched-decode steps, speculative verification;
/// for more, dequantizing a tile once for the multi-token kernels costs about as much): row by row,
/// prefetching the next row. Returns `false` (nothing done) for other token counts.
#[inline(always)]
pub(super) unsafe fn few_tokens_rows<K: RowTokens>(w: *const u8, job: &Job) -> bool {
    match job.tokens {
        2 => few_tokens::<K, 2>(w, job),
        3 => few_tokens::<K, 3>(w, job),
        4 => few_tokens::<K, 4>(w, job),
        5 => few_tokens::<K, 5>(w, job),
        6 => few_tokens::<K, 6>(w, job),
        7 => few_tokens::<K, 7>(w, job),
        8 => few_tokens::<K, 8>(w, job),
        _ => return false,
    }
    true
}

#[inline(always)]
unsafe fn few_tokens<K: RowTokens, const T: usize>(w: *const u8, job: &Job) {
    let nb = job.k / K::ELEMS;
    let rb = nb * K::BYTES;
    let x: [*const f32; T] = tok_ptrs(job, 0);
    let mut preps = Vec::with_capacity(T);
    for &xt in &x {
        preps.push(K::prepare(xt, nb));
    }
    let mut prep = [std::ptr::null::<f32>(); T];
    for (p, v) in prep.iter_mut().zip(&preps) {
        *p = v.as_ptr();
    }
    for n in job.rows.clone() {
        let s = K::row::<T>(w.add(n * rb), x, prep, nb, rb);
        for (t, &v) in s.iter().enumerate() {
            job.put(t, n, v);
        }
    }
}

/// The legacy formats with hand-written kernels (Q8_0, Q4_0, Q4_1, and on AVX2 Q5_0, Q5_1), which fold the block scale
/// (and min) into the block's partial sum: `d·Σq·x (+ m·Σx)`.
pub(super) trait Legacy: BlockFormat {
    /// Whether the block carries a min `m` (value `d·q + m`) after its scale `d`.
    const HAS_MIN: bool;
}

impl Legacy for Q8_0 {
    const HAS_MIN: bool = false;
}
impl Legacy for Q4_0 {
    const HAS_MIN: bool = false;
}
impl Legacy for Q4_1 {
    const HAS_MIN: bool = true;
}
impl Legacy for Q5_0 {
    const HAS_MIN: bool = false;
}
impl Legacy for Q5_1 {
    const HAS_MIN: bool = true;
}

/// Per-block sums `Σ x` of one activation row (only formats with a min need them).
pub(super) unsafe fn block_sums<Q: Legacy>(x: *const f32, nb: usize) -> Vec<f32> {
    if !Q::HAS_MIN {
        return Vec::new();
    }
    chunk_sums(x, nb * Q::ELEMS, Q::ELEMS)
}

/// Sums of each `chunk` consecutive values of the `len` activations at `x`.
pub(super) unsafe fn chunk_sums(x: *const f32, len: usize, chunk: usize) -> Vec<f32> {
    let x = std::slice::from_raw_parts(x, len);
    x.chunks_exact(chunk).map(super::block_sum).collect()
}

/// An ISA's f32 vector, as the generic block GEMV uses it.
pub(super) trait Lanes {
    type V: Copy;
    /// f32 lanes per vector.
    const N: usize;
    unsafe fn zero() -> Self::V;
    unsafe fn load(p: *const f32) -> Self::V;
    /// `a · b + c`
    unsafe fn fmadd(a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    unsafe fn add(a: Self::V, b: Self::V) -> Self::V;
    /// Sum of the lanes.
    unsafe fn sum(v: Self::V) -> f32;
}

/// The largest block any format has.
const MAX_BLOCK: usize = 256;

/// Any block format's GEMV at ISA `L`: per block and row, the block is decoded exactly
/// ([`BlockFormat::dequantize_block`], compiled with the ISA's features so the decoding
/// vectorises) into an L1-resident buffer, then multiplied with the activations in f32 vectors,
/// two accumulators per row. The result is the f32 product of ggml's dequantized weights with
/// f32 activations, up to summation order.
pub(super) struct Blocks<L, F>(std::marker::PhantomData<(L, F)>);

impl<L: Lanes, F: BlockFormat> BlockGemv for Blocks<L, F> {
    const ELEMS: usize = F::ELEMS;
    const BYTES: usize = F::BYTES;

    #[inline(always)]
    unsafe fn prepare(_x: *const f32, _nb: usize) -> Vec<f32> {
        Vec::new()
    }

    // `r` indexes the row pointers, buffers and accumulators together.
    #[allow(clippy::needless_range_loop)]
    #[inline(always)]
    unsafe fn gemv<const R: usize>(
        w: [*const u8; R],
        x: *const f32,
        _prep: &[f32],
        nb: usize,
        _pf: usize,
    ) -> [f32; R] {
        const { assert!(F::ELEMS <= MAX_BLOCK && F::ELEMS.is_multiple_of(2 * L::N)) };
        let mut buf = [[0f32; MAX_BLOCK]; R];
        let mut a0 = [L::zero(); R];
        let mut a1 = [L::zero(); R];
        for b in 0..nb {
            for r in 0..R {
                let block = std::slice::from_raw_parts(w[r].add(b * F::BYTES), F::BYTES);
                F::dequantize_block(block, &mut buf[r]);
            }
            let xb = x.add(b * F::ELEMS);
            let mut i = 0;
            while i < F::ELEMS {
                let x0 = L::load(xb.add(i));
                let x1 = L::load(xb.add(i + L::N));
                for r in 0..R {
                    let p = buf[r].as_ptr().add(i);
                    a0[r] = L::fmadd(L::load(p), x0, a0[r]);
                    a1[r] = L::fmadd(L::load(p.add(L::N)), x1, a1[r]);
                }
                i += 2 * L::N;
            }
        }
        let mut s = [0f32; R];
        for (r, s) in s.iter_mut().enumerate() {
            *s = L::sum(L::add(a0[r], a1[r]));
        }
        s
    }
}

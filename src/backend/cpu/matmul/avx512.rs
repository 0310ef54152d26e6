//! AVX-512 F/BW/VL kernels (16 f32 lanes, masked k tails). f32/bf16 weights read from memory
//! go one row at a time as one stream in calls of up to 16 tokens ([`streamed_rows`]); in-cache
//! tiles run a 4 rows × 6 tokens tile (24 zmm accumulators) whose sums are reduced together
//! ([`hsum16_512`], shared with attention); more tokens the packed panels of
//! [`super::avx512_panel`].
//! The drivers are shared with AVX2 (see [`super::x86`]); the entry points here instantiate
//! them with this file's kernels under `#[target_feature]`.

use std::arch::x86_64::*;
use std::marker::PhantomData;

use super::x86::{
    self, block_sums, few_tokens_rows, BlockGemv, Blocks, DenseGemv, DenseKernels, Lanes, Legacy,
    RowTokens,
};
use super::Job;
use crate::backend::cpu::simd::x86::{hsum16_512, hsum256, tail_mask16, Load};
use crate::model::quant::{self, BlockFormat, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q6_K, Q8_0};

const PREFETCH: bool = true;

/// The AVX-512 ISA, as the shared drivers see it.
pub(super) struct Avx512;

impl<W: Load> DenseGemv<W> for Avx512 {
    #[inline(always)]
    unsafe fn gemv<const R: usize>(w: [*const W; R], x: *const f32, k: usize) -> [f32; R] {
        gemv_512(w, x, k)
    }
}

impl<W: Load> DenseKernels<W> for Avx512 {
    #[inline(always)]
    unsafe fn tile<const R: usize, const T: usize>(
        w: [*const W; R],
        x: [*const f32; T],
        k: usize,
    ) -> [[f32; T]; R] {
        tile_512(w, x, k)
    }
    #[inline(always)]
    unsafe fn tile4_put<const T: usize>(w: [*const W; 4], job: &Job, n: usize, t: usize) {
        tile4_put_512::<W, T>(w, job, n, t)
    }
}

impl Lanes for Avx512 {
    type V = __m512;
    const N: usize = 16;
    #[inline(always)]
    unsafe fn zero() -> __m512 {
        _mm512_setzero_ps()
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> __m512 {
        _mm512_loadu_ps(p)
    }
    #[inline(always)]
    unsafe fn fmadd(a: __m512, b: __m512, c: __m512) -> __m512 {
        _mm512_fmadd_ps(a, b, c)
    }
    #[inline(always)]
    unsafe fn add(a: __m512, b: __m512) -> __m512 {
        _mm512_add_ps(a, b)
    }
    #[inline(always)]
    unsafe fn sum(v: __m512) -> f32 {
        _mm512_reduce_add_ps(v)
    }
}

/// `R` rows against one activation row: 2R independent FMA chains over k. Four rows at a time
/// prefetch the same position of the next group of rows (rows are contiguous, so that is 4
/// rows ahead); one row at a time (the drivers' one-row groups) the rows are read in order, one
/// stream, which on AMD the hardware prefetchers follow alone and on Intel a prefetch into L2
/// 8 KiB ahead keeps fed ([`super::prefetch`]: SmolLM2 BF16 decode 76–80 → 113–119 tok/s on a
/// 2-vCPU Xeon).
///
/// SmolLM2 BF16 decode on a 2-vCPU AMD EPYC Zen 4 (AVX-512 BF16), `kiln-bench -m
/// SmolLM2-135M-Instruct.BF16.gguf -t 2 -p 0 -n 128 -r 3`: 56–60 tok/s four rows at a time
/// (its matmuls at 14–19 GB/s of a 30 GB/s read). One row at a time, five rounds alternating:
/// no prefetch 95–103 tok/s, 256 bytes ahead 88–110, `avx2`'s 2 KiB ahead once a line (which
/// helped on Zen 3) 71–94, and the AVX2 GEMV itself (`KILN_SIMD=avx2`) 76–106. A C model of the
/// loop (both cores, a 226 MB bf16 matrix of 576-element rows, means of 7 passes) agreed: no
/// prefetch 27–31 GB/s, 512–2,048 bytes ahead 21–26, four interleaved rows 13–19.
#[inline(always)]
unsafe fn gemv_512<W: Load, const R: usize>(w: [*const W; R], x: *const f32, k: usize) -> [f32; R] {
    let mut a0 = [_mm512_setzero_ps(); R];
    let mut a1 = [_mm512_setzero_ps(); R];
    // One row: its stream `row_ahead` bytes ahead into L2 where the policy asks (Intel), else
    // nothing (`super::prefetch`).
    let ahead = if R == 1 {
        super::prefetch::policy().row_ahead
    } else {
        0
    };
    let mut i = 0;
    while i + 32 <= k {
        let x0 = _mm512_loadu_ps(x.add(i));
        let x1 = _mm512_loadu_ps(x.add(i + 16));
        if ahead != 0 {
            // 32 elements: one line of bf16, two of f32.
            let p = (w[0].add(i) as *const u8).wrapping_add(ahead);
            super::prefetch::line(p, true);
            if size_of::<W>() == 4 {
                super::prefetch::line(p.wrapping_add(64), true);
            }
        }
        for r in 0..R {
            if R > 1 {
                // Decode streams each weight once from DRAM: the same position of the next
                // group of rows. 32 elements are one cache line of bf16, two of f32.
                let p = w[r].wrapping_add(i + 4 * k) as *const i8;
                _mm_prefetch::<_MM_HINT_T0>(p);
                if size_of::<W>() == 4 {
                    _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(64));
                }
            }
            a0[r] = _mm512_fmadd_ps(W::ld16(w[r].add(i)), x0, a0[r]);
            a1[r] = _mm512_fmadd_ps(W::ld16(w[r].add(i + 16)), x1, a1[r]);
        }
        i += 32;
    }
    while i < k {
        let m = tail_mask16((k - i).min(16));
        let x0 = _mm512_maskz_loadu_ps(m, x.add(i));
        for r in 0..R {
            a0[r] = _mm512_fmadd_ps(W::ld16_mask(w[r].add(i), m), x0, a0[r]);
        }
        i += 16;
    }
    let mut s = [0f32; R];
    for r in 0..R {
        s[r] = _mm512_reduce_add_ps(_mm512_add_ps(a0[r], a1[r]));
    }
    s
}

/// `R` rows × `T` tokens register tile: each weight vector loaded once per `T` tokens.
#[inline(always)]
unsafe fn tile_512<W: Load, const R: usize, const T: usize>(
    w: [*const W; R],
    x: [*const f32; T],
    k: usize,
) -> [[f32; T]; R] {
    let acc = tile_acc_512(w, x, k);
    let mut s = [[0f32; T]; R];
    for r in 0..R {
        for t in 0..T {
            s[r][t] = _mm512_reduce_add_ps(acc[r][t]);
        }
    }
    s
}

/// The tile's accumulators: lane sums of `acc[r][t]` are the dot products of row `r`, token `t`.
#[inline(always)]
unsafe fn tile_acc_512<W: Load, const R: usize, const T: usize>(
    w: [*const W; R],
    x: [*const f32; T],
    k: usize,
) -> [[__m512; T]; R] {
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    // A one-row tile streams its row as the one-row GEMV does (`gemv_512`): `row_ahead` bytes
    // ahead into L2 where the policy asks, a line per 64 bytes of weights.
    let ahead = if R == 1 {
        super::prefetch::policy().row_ahead
    } else {
        0
    };
    let mut i = 0;
    while i + 16 <= k {
        if ahead != 0 && (size_of::<W>() == 4 || i % 32 == 0) {
            super::prefetch::line((w[0].add(i) as *const u8).wrapping_add(ahead), true);
        }
        let mut xv = [_mm512_setzero_ps(); T];
        for t in 0..T {
            xv[t] = _mm512_loadu_ps(x[t].add(i));
        }
        for r in 0..R {
            let wv = W::ld16(w[r].add(i));
            for t in 0..T {
                acc[r][t] = _mm512_fmadd_ps(wv, xv[t], acc[r][t]);
            }
        }
        i += 16;
    }
    if i < k {
        let m = tail_mask16(k - i);
        let mut xv = [_mm512_setzero_ps(); T];
        for t in 0..T {
            xv[t] = _mm512_maskz_loadu_ps(m, x[t].add(i));
        }
        for r in 0..R {
            let wv = W::ld16_mask(w[r].add(i), m);
            for t in 0..T {
                acc[r][t] = _mm512_fmadd_ps(wv, xv[t], acc[r][t]);
            }
        }
    }
    acc
}

/// 128-bit lane `L` of `v`.
#[inline(always)]
unsafe fn lane128(v: __m512, l: usize) -> __m128 {
    match l {
        0 => _mm512_castps512_ps128(v),
        1 => _mm512_extractf32x4_ps::<1>(v),
        2 => _mm512_extractf32x4_ps::<2>(v),
        _ => _mm512_extractf32x4_ps::<3>(v),
    }
}

/// A whole 4 × `T` tile written to the output: the sums of four tokens come out of one
/// [`hsum16_512`] as one 128-bit vector per token (the tile's 4 rows, contiguous in the output),
/// which gets the existing output (when accumulating) and then the bias added, in the scalar
/// [`Job::put`]'s order, so the values written are the same.
#[inline(always)]
unsafe fn tile4_put_512<W: Load, const T: usize>(w: [*const W; 4], job: &Job, n: usize, t: usize) {
    let acc = tile_acc_512::<W, 4, T>(w, x86::tok_ptrs(job, t), job.k);
    let bias = job.bias.map(|b| _mm_loadu_ps(b[n..n + 4].as_ptr()));
    let mut c = 0;
    while c < T {
        let mut v = [_mm512_setzero_ps(); 16];
        for (i, v) in v.iter_mut().enumerate() {
            let (tt, r) = (c + i % 4, i / 4);
            if tt < T {
                *v = acc[r][tt];
            }
        }
        let sums = hsum16_512(v);
        for l in 0..4.min(T - c) {
            let o = job.out.add((t + c + l) * job.ldo + n);
            let mut y = lane128(sums, l);
            if job.accumulate {
                y = _mm_add_ps(_mm_loadu_ps(o), y);
            }
            if let Some(b) = bias {
                y = _mm_add_ps(y, b);
            }
            _mm_storeu_ps(o, y);
        }
        c += 4;
    }
}

/// Calls of at most this many tokens run the dot-product tiles; more, the packed panels.
/// Measured on a Zen 5 (SmolLM2, 2 threads), tiles against panels: Q4_1 decode of 16 sequences
/// 603–651 against 538–563 tok/s, pp16 760–840 against 710–740; from 32 tokens up the panels
/// were faster (pp32 950 against 1,010, pp512 +20%).
pub(super) const TILE_TOKENS: usize = 16;

/// f32/bf16 rows (any token count) already in cache (the dequantized tiles of quantized
/// weights): register tiles of 4 rows × up to 6 tokens up to [`TILE_TOKENS`] tokens (the first
/// `tokens − tokens mod 4` through tiles, the rest through the four-row GEMV), packed panels for
/// more ([`super::avx512_panel`]).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
pub(super) unsafe fn dense_rows<W: Load>(w: *const W, job: &Job) {
    if job.tokens <= TILE_TOKENS {
        x86::dense_rows::<W, Avx512, 6, 4, 2, 4>(w, job)
    } else {
        super::avx512_panel::panel_rows(w, job)
    }
}

/// f32/bf16 weight rows read from memory: as [`dense_rows`], but calls of up to
/// [`TILE_TOKENS`] tokens walk the rows one at a time (one-row groups of the driver: tiles of
/// 1 row × up to 6 tokens, then the one-row GEMV for the last `tokens mod 4` tokens), so the
/// matrix is read once, as one stream ([`gemv_512`] says why), with the same bits. The tiles
/// load each token's activations once per row instead of once per four rows: about one load
/// per FMA, which a CPU with two FMA units (Zen 5, Intel) may feel where the call is bound by
/// arithmetic rather than by the memory (8–16 tokens); measured only on the Zen 4 below, where
/// 8 tokens did not move.
///
/// SmolLM2 BF16 decode of several sequences on a 2-vCPU AMD EPYC Zen 4 (AVX-512 BF16),
/// `kiln-bench -m SmolLM2-135M-Instruct.BF16.gguf -t 2 -p 0 -n 64 -r 3 --batch B`, old and new
/// builds alternating twice: `B = 2` 104–107 → 141–149 tok/s (four rows at a time both tokens
/// took the four-row GEMV, reading the matrix twice), `B = 4` 158–166 → 211–232, `B = 8`
/// 222–224 → 212–237 (the host's spread).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
pub(super) unsafe fn streamed_rows<W: Load>(w: *const W, job: &Job) {
    if job.tokens <= TILE_TOKENS {
        x86::dense_rows::<W, Avx512, 6, 4, 2, 1>(w, job)
    } else {
        super::avx512_panel::panel_rows(w, job)
    }
}

// ----- Quantized blocks -----

/// A legacy block's 32 integer quants as f32 (Q4_0's −8 applied), elements 0..16 and 16..32.
pub(super) trait Quants512: Legacy {
    unsafe fn q512(p: *const u8) -> (__m512, __m512);

    /// Whether [`Quants512::lanes512`] returns the quants in [`LANE_ORDER`] rather than in
    /// element order; the GEMVs then multiply them with activations permuted the same way
    /// ([`permute_blocks`]).
    const PERMUTED: bool = false;

    /// The quants as the GEMVs take them: elements `LANE_ORDER[i]` and `16 + LANE_ORDER[i]` in
    /// lane `i` where [`Quants512::PERMUTED`], else as [`Quants512::q512`].
    #[inline(always)]
    unsafe fn lanes512(p: *const u8) -> (__m512, __m512) {
        Self::q512(p)
    }
}

/// The element each lane of a 16-element half block holds in the permuted quants of the 4-bit
/// formats: `4·(i mod 4) + i / 4`, a 4 × 4 transpose (its own inverse). That is the order in
/// which one 16-byte broadcast (a load, no shuffle) and one per-lane shift put quant byte
/// `LANE_ORDER[i]` at the bottom of lane `i`: lane `i` holds bytes `4·(i mod 4)..+4` of the
/// copy in its 128-bit quarter `i / 4` and shifts right by `8·(i / 4)`. The 5-bit formats keep
/// element order: there the same broadcast measured slower (`cargo bench --bench kernels --
/// gemv/Q5_0`, one core of an Intel Xeon with AVX-512 FP16: 8.8 → 8.4 GiB/s), their fifth bits
/// already keeping the shift port busy.
const LANE_ORDER: [u32; 16] = {
    let mut o = [0u32; 16];
    let mut i = 0;
    while i < 16 {
        o[i] = (4 * (i % 4) + i / 4) as u32;
        i += 1;
    }
    o
};

/// Per lane `i`, the right shift that brings quant byte `LANE_ORDER[i]` of a broadcast 16-byte
/// copy to bits 0..8: `8·(i / 4)`; its high nibble needs 4 more.
#[inline(always)]
unsafe fn lane_byte_shift() -> __m512i {
    _mm512_setr_epi32(0, 0, 0, 0, 8, 8, 8, 8, 16, 16, 16, 16, 24, 24, 24, 24)
}

/// The 16 bytes at `qs` in each 128-bit quarter (one load, no shuffle).
#[inline(always)]
unsafe fn broadcast_quant_bytes(qs: *const u8) -> __m512i {
    _mm512_broadcast_i32x4(_mm_loadu_si128(qs as *const __m128i))
}

/// `x`'s `nb` blocks of 32 with each 16-element half permuted as the lanes of
/// [`Quants512::lanes512`]: element `LANE_ORDER[i]` of a half at position `i`.
#[inline(always)]
pub(super) unsafe fn permute_blocks(x: *const f32, nb: usize, out: &mut Vec<f32>) {
    let idx = _mm512_loadu_si512(LANE_ORDER.as_ptr().cast());
    out.reserve(nb * 32);
    let base = out.len();
    let dst = out.as_mut_ptr().add(base);
    for h in 0..2 * nb {
        let v = _mm512_loadu_ps(x.add(16 * h));
        _mm512_storeu_ps(dst.add(16 * h), _mm512_permutexvar_ps(idx, v));
    }
    out.set_len(base + nb * 32);
}

/// The 16 quant bytes of a Q4 block at `qs` as 32 f32 values `table[nibble]`: low nibbles
/// (elements 0..16), high nibbles (16..32). `vpermps` reads only the low 4 bits of each index,
/// so one table lookup both masks the nibble and converts it (exactly) to f32.
#[inline(always)]
unsafe fn nibbles_512(qs: *const u8, table: __m512) -> (__m512, __m512) {
    let v = _mm512_cvtepu8_epi32(_mm_loadu_si128(qs as *const __m128i));
    (
        _mm512_permutexvar_ps(v, table),
        _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(v), table),
    )
}

/// As [`nibbles_512`], in [`LANE_ORDER`]: lane `i` holds elements `LANE_ORDER[i]` (low) and
/// `16 + LANE_ORDER[i]` (high), from one broadcast and two per-lane shifts (by
/// [`lane_byte_shift`], and 4 more for the high nibbles) instead of a byte-to-dword widening and
/// a shift. The widening takes the one shuffle port of Intel cores that the two table lookups and
/// half the FMAs also need; the shifts take port 0. `cargo bench --bench kernels -- gemv/Q4_1`,
/// one core of an Intel Xeon with AVX-512 FP16, builds alternating: 9.7–9.8 → 10.4–10.5 GiB/s
/// on SmolLM2's 1536 × 576, 10.4–10.5 → 11.1–11.2 on 4864 × 896.
#[inline(always)]
unsafe fn nibble_lanes_512(qs: *const u8, table: __m512) -> (__m512, __m512) {
    let v = broadcast_quant_bytes(qs);
    let lo = lane_byte_shift();
    let hi = _mm512_add_epi32(lo, _mm512_set1_epi32(4));
    (
        _mm512_permutexvar_ps(_mm512_srlv_epi32(v, lo), table),
        _mm512_permutexvar_ps(_mm512_srlv_epi32(v, hi), table),
    )
}

/// A Q5 block's quants as 32 f32 values `lo[q]` (`q < 16`) or `hi[q − 16]`: the 16 bytes at
/// `qs` give the low four bits (low nibbles elements 0..16, high nibbles 16..32) and bit `e` of
/// the 32-bit `qh` at `qh` the fifth bit of element `e`; `vpermt2ps` reads the five low bits of
/// each index, so one two-table lookup converts the 5-bit quant (exactly) to f32, the offset
/// applied by the tables. The fifth bits reach their lanes without a mask register: `qh` is
/// broadcast (a load), each lane rotates it so that its element's bit lands on bit 4, and one
/// ternary-logic select takes bits 0..4 from the nibble and bit 4 on from the rotation (the
/// table lookup ignores the bits above). This replaced two `kmov`s and two masked ORs, which
/// compete with the byte widening and the lookups for the one shuffle port on Intel cores
/// (`cargo bench --bench kernels -- gemv/Q5_0`, Qwen2.5-Coder's 4864 × 896 gate on one core of
/// an Intel Xeon with AVX-512 FP16: 7.16 → 8.45 GiB/s).
#[inline(always)]
unsafe fn five_bits_512(qh: *const u8, qs: *const u8, lo: __m512, hi: __m512) -> (__m512, __m512) {
    // Lane i, elements i (low) and 16 + i (high): rotate right by i − 4 and 12 + i (mod 32).
    let rot_lo = _mm512_setr_epi32(28, 29, 30, 31, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11);
    let rot_hi = _mm512_setr_epi32(
        12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27,
    );
    let h = _mm512_set1_epi32(std::ptr::read_unaligned(qh as *const i32));
    let v = _mm512_cvtepu8_epi32(_mm_loadu_si128(qs as *const __m128i));
    let nibble = _mm512_set1_epi32(0x0f);
    // 0xCA: `a ? b : c` bit by bit, with a = the nibble mask.
    let low = _mm512_ternarylogic_epi32::<0xCA>(nibble, v, _mm512_rorv_epi32(h, rot_lo));
    let high = _mm512_ternarylogic_epi32::<0xCA>(
        nibble,
        _mm512_srli_epi32::<4>(v),
        _mm512_rorv_epi32(h, rot_hi),
    );
    (
        _mm512_permutex2var_ps(lo, low, hi),
        _mm512_permutex2var_ps(lo, high, hi),
    )
}

/// The 16 f32 values `start, start + 1, …, start + 15`: the quant-to-value tables of the 4- and
/// 5-bit formats (constants after inlining).
#[inline(always)]
unsafe fn iota_from(start: f32) -> __m512 {
    let iota = _mm512_setr_ps(
        0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0,
    );
    _mm512_add_ps(iota, _mm512_set1_ps(start))
}

impl Quants512 for Q5_0 {
    #[inline(always)]
    unsafe fn q512(p: *const u8) -> (__m512, __m512) {
        five_bits_512(p.add(2), p.add(6), iota_from(-16.0), iota_from(0.0))
    }
}

impl Quants512 for Q5_1 {
    #[inline(always)]
    unsafe fn q512(p: *const u8) -> (__m512, __m512) {
        five_bits_512(p.add(4), p.add(8), iota_from(0.0), iota_from(16.0))
    }
}

impl Quants512 for Q8_0 {
    #[inline(always)]
    unsafe fn q512(p: *const u8) -> (__m512, __m512) {
        let a = _mm512_cvtepi8_epi32(_mm_loadu_si128(p.add(2) as *const __m128i));
        let b = _mm512_cvtepi8_epi32(_mm_loadu_si128(p.add(18) as *const __m128i));
        (_mm512_cvtepi32_ps(a), _mm512_cvtepi32_ps(b))
    }
}

impl Quants512 for Q4_0 {
    #[inline(always)]
    unsafe fn q512(p: *const u8) -> (__m512, __m512) {
        nibbles_512(p.add(2), iota_from(-8.0))
    }

    const PERMUTED: bool = true;

    #[inline(always)]
    unsafe fn lanes512(p: *const u8) -> (__m512, __m512) {
        nibble_lanes_512(p.add(2), iota_from(-8.0))
    }
}

impl Quants512 for Q4_1 {
    #[inline(always)]
    unsafe fn q512(p: *const u8) -> (__m512, __m512) {
        nibbles_512(p.add(4), iota_from(0.0))
    }

    const PERMUTED: bool = true;

    #[inline(always)]
    unsafe fn lanes512(p: *const u8) -> (__m512, __m512) {
        nibble_lanes_512(p.add(4), iota_from(0.0))
    }
}

/// The legacy formats' GEMV: in groups of 16 blocks. Per group and row, [`group_scales`] fetches
/// the 16 blocks' `(d, m)` f16 pairs, which are widened 16 at a time into a stack buffer (so the
/// per-block broadcast of `d` is a plain load) and, for Q4_1, dotted with the block sums `Σx` at
/// once (`Σ_b m_b·Σx_b`). Per block and row: `s = Σ q·x` over the block's two 16-lane halves,
/// then `acc += d·s` (one FMA).
struct Legacy512<Q>(PhantomData<Q>);

impl<Q: Quants512> BlockGemv for Legacy512<Q> {
    const ELEMS: usize = Q::ELEMS;
    const BYTES: usize = Q::BYTES;

    #[inline(always)]
    unsafe fn prepare(x: *const f32, nb: usize) -> Vec<f32> {
        let mut prep = block_sums::<Q>(x, nb);
        if Q::PERMUTED {
            permute_blocks(x, nb, &mut prep);
        }
        prep
    }

    #[inline(always)]
    unsafe fn gemv<const R: usize>(
        w: [*const u8; R],
        x: *const f32,
        prep: &[f32],
        nb: usize,
        pf: usize,
    ) -> [f32; R] {
        qgemv_512::<Q, R>(w, lane_x::<Q>(x, prep.as_ptr(), nb), prep.as_ptr(), nb, pf)
    }
}

/// The activations a legacy GEMV multiplies the quants of [`Quants512::lanes512`] with: `x`, or
/// where the quants come permuted, the permuted copy that [`BlockGemv::prepare`] put after the
/// block sums (`prep` from `Legacy512::prepare` for `nb` blocks).
#[inline(always)]
unsafe fn lane_x<Q: Quants512>(x: *const f32, prep: *const f32, nb: usize) -> *const f32 {
    if Q::PERMUTED {
        prep.add(if Q::HAS_MIN { nb } else { 0 })
    } else {
        x
    }
}

/// The scale words of the `n` (at most 16) blocks from `p`: word `i` is block `i`'s `d` (its
/// first little-endian 16 bits), word `16 + i` its `m` (the next 16) where the format has a
/// min (else zero), words of blocks past `n` zero. The group's bytes are read in windows of 128
/// (two 64-byte loads, masked to the `n` blocks so nothing past them is touched) and one
/// `vpermt2w` per window picks the words of each block in it: three windows for the 18- to
/// 24-byte formats, four for Q8_0. This replaced sixteen scalar loads and their inserts (~30
/// instructions per group and row), which had replaced a `vpgatherdd` that held about half of the
/// Q4_1/Q8_0 GEMV's samples on a Zen 5. The `d`s and `m`s in separate halves (rather than each
/// block's `d | m << 16` dword, which took two 2-uop narrowings more per group and row) are each
/// one conversion from f16 away ([`group_scales`]), a format without a min reads only the windows
/// its `d`s reach (Q8_0's four, not five), and a row's last, partial group only the windows its
/// blocks reach. Together, on one core of an Intel Xeon with AVX-512 FP16 (`cargo bench --bench
/// kernels -- gemv`): Q4_1 1536 × 576 8.8 → 10.4 GiB/s (with the nibble lanes), Q8_0 14.9 → 16.8;
/// the group scales had been about a quarter of the Q4_1 GEMV's time (12.8 GiB/s without them).
#[inline(always)]
pub(super) unsafe fn group_words<Q: Legacy>(p: *const u8, n: usize) -> __m512i {
    let windows = const { group_windows(Q::BYTES, Q::HAS_MIN) };
    let idx = const { window_index(Q::BYTES, Q::HAS_MIN) };
    let lanes = const { window_lanes(Q::BYTES, Q::HAS_MIN) };
    let mut r = _mm512_setzero_si512();
    if n == 16 {
        // Spelled out for a whole group, so that its masks are constants.
        for c in 0..windows {
            let (a, b) = window_bytes(p, 16 * Q::BYTES, 128 * c);
            let v = _mm512_permutex2var_epi16(a, _mm512_loadu_si512(idx[c].as_ptr().cast()), b);
            r = _mm512_mask_mov_epi16(r, lanes[c], v);
        }
        r
    } else {
        // A row's last, partial group reads only the windows its blocks reach (one for the
        // two blocks that SmolLM2's 576-column rows leave after a whole group).
        let reached = group_word(Q::BYTES, (n - 1) + 16 * usize::from(Q::HAS_MIN)) / 64 + 1;
        for c in 0..reached {
            let (a, b) = window_bytes(p, n * Q::BYTES, 128 * c);
            let v = _mm512_permutex2var_epi16(a, _mm512_loadu_si512(idx[c].as_ptr().cast()), b);
            r = _mm512_mask_mov_epi16(r, lanes[c], v);
        }
        let blocks = (1u32 << n) - 1;
        _mm512_maskz_mov_epi16(blocks | blocks << 16, r)
    }
}

/// [`group_words`] widened: each block's `d` and `m` (zero for the formats without a min) as
/// f32, lane `i` for block `i`.
#[inline(always)]
pub(super) unsafe fn group_scales<Q: Legacy>(p: *const u8, n: usize) -> (__m512, __m512) {
    let g = group_words::<Q>(p, n);
    (
        _mm512_cvtph_ps(_mm512_castsi512_si256(g)),
        _mm512_cvtph_ps(_mm512_extracti64x4_epi64::<1>(g)),
    )
}

/// The 128 bytes from `p + base` as two vectors, those at or past `limit` zero and not read.
#[inline(always)]
unsafe fn window_bytes(p: *const u8, limit: usize, base: usize) -> (__m512i, __m512i) {
    (
        _mm512_maskz_loadu_epi8(byte_mask(limit, base), p.wrapping_add(base) as *const i8),
        _mm512_maskz_loadu_epi8(
            byte_mask(limit, base + 64),
            p.wrapping_add(base + 64) as *const i8,
        ),
    )
}

/// Bits of the bytes `base..base + 64` that lie below `limit`.
#[inline(always)]
fn byte_mask(limit: usize, base: usize) -> __mmask64 {
    match limit.saturating_sub(base) {
        0 => 0,
        k if k >= 64 => u64::MAX,
        k => (1u64 << k) - 1,
    }
}

/// Output words of [`group_words`] that come from the blocks: the 16 `d`s, and the 16 `m`s
/// where the format has a min.
const fn group_outputs(has_min: bool) -> usize {
    if has_min {
        32
    } else {
        16
    }
}

/// Windows of 64 words that [`group_words`] reads for blocks of `bytes` bytes: enough to reach
/// the last word it takes (the sixteenth block's `m`, or its `d` without a min).
const fn group_windows(bytes: usize, has_min: bool) -> usize {
    group_word(bytes, group_outputs(has_min) - 1) / 64 + 1
}

/// The most windows of any format (Q8_0's four).
const MAX_WINDOWS: usize = 4;

/// The group's word that output word `l` takes: word `l / 16` (`d`, then `m`) of block `l % 16`.
const fn group_word(bytes: usize, l: usize) -> usize {
    (l % 16) * (bytes / 2) + l / 16
}

/// Per window, the `vpermt2w` index of each output word ([`group_word`] `% 64` in its window).
const fn window_index(bytes: usize, has_min: bool) -> [[i16; 32]; MAX_WINDOWS] {
    let mut idx = [[0i16; 32]; MAX_WINDOWS];
    let mut l = 0;
    while l < group_outputs(has_min) {
        let w = group_word(bytes, l);
        idx[w / 64][l] = (w % 64) as i16;
        l += 1;
    }
    idx
}

/// Per window, the output words it supplies.
const fn window_lanes(bytes: usize, has_min: bool) -> [__mmask32; MAX_WINDOWS] {
    let mut lanes = [0; MAX_WINDOWS];
    let mut l = 0;
    while l < group_outputs(has_min) {
        lanes[group_word(bytes, l) / 64] |= 1 << l;
        l += 1;
    }
    lanes
}

// `j` indexes x, every row's blocks and the scale buffer together.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn qgemv_512<Q: Quants512, const R: usize>(
    w: [*const u8; R],
    x: *const f32,
    xs: *const f32,
    nb: usize,
    pf: usize,
) -> [f32; R] {
    const QK: usize = 32;
    let mut acc = [_mm512_setzero_ps(); R];
    let mut macc = [_mm512_setzero_ps(); R];
    let mut d = [[0f32; 16]; R];
    let mut b0 = 0;
    while b0 < nb {
        let n = (nb - b0).min(16);
        let mask = tail_mask16(n);
        for r in 0..R {
            let (dv, m) = group_scales::<Q>(w[r].add(b0 * Q::BYTES), n);
            _mm512_storeu_ps(d[r].as_mut_ptr(), dv);
            if Q::HAS_MIN {
                let s = _mm512_maskz_loadu_ps(mask, xs.add(b0));
                macc[r] = _mm512_fmadd_ps(m, s, macc[r]);
            }
        }
        for j in 0..n {
            let b = b0 + j;
            let x0 = _mm512_loadu_ps(x.add(b * QK));
            let x1 = _mm512_loadu_ps(x.add(b * QK + 16));
            for r in 0..R {
                let p = w[r].add(b * Q::BYTES);
                if PREFETCH {
                    _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(pf) as *const i8);
                }
                let (q0, q1) = Q::lanes512(p);
                let s = _mm512_fmadd_ps(q1, x1, _mm512_mul_ps(q0, x0));
                acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(d[r][j]), s, acc[r]);
            }
        }
        b0 += n;
    }
    let mut s = [0f32; R];
    for (r, s) in s.iter_mut().enumerate() {
        let t = if Q::HAS_MIN {
            _mm512_add_ps(acc[r], macc[r])
        } else {
            acc[r]
        };
        *s = _mm512_reduce_add_ps(t);
    }
    s
}

/// `nb` legacy blocks at `src` to f32 at `dst`, 16 lanes at a time: `q·d` (`+ m` for Q4_1) as a
/// multiply then an add, never fused, so the values are bit-identical to ggml's reference
/// dequantization (as the AVX2 version).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(super) unsafe fn dequantize_legacy<Q: Quants512>(src: *const u8, nb: usize, dst: *mut f32) {
    const QK: usize = 32;
    for b in 0..nb {
        let p = src.add(b * Q::BYTES);
        let dm = _mm_cvtph_ps(_mm_cvtsi32_si128(std::ptr::read_unaligned(p as *const i32)));
        let d = _mm512_broadcastss_ps(dm);
        let (q0, q1) = Q::q512(p);
        let (mut v0, mut v1) = (_mm512_mul_ps(q0, d), _mm512_mul_ps(q1, d));
        if Q::HAS_MIN {
            let m = _mm512_broadcastss_ps(_mm_movehdup_ps(dm));
            v0 = _mm512_add_ps(v0, m);
            v1 = _mm512_add_ps(v1, m);
        }
        _mm512_storeu_ps(dst.add(b * QK), v0);
        _mm512_storeu_ps(dst.add(b * QK + 16), v1);
    }
}

/// GEMV (`job.tokens == 1`) on Q8_0/Q4_0/Q4_1/Q5_0/Q5_1 blocks; `w` holds `job.rows.end` rows
/// of blocks.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(super) unsafe fn legacy_rows<Q: Quants512>(w: *const u8, job: &Job) {
    x86::gemv_rows::<Legacy512<Q>>(w, job)
}

/// GEMV (`job.tokens == 1`) on blocks of any format (see [`Blocks`]).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(super) unsafe fn block_rows<F: BlockFormat>(w: *const u8, job: &Job) {
    x86::gemv_rows::<Blocks<Avx512, F>>(w, job)
}

impl<Q: Quants512> RowTokens for Legacy512<Q> {
    /// Per token as [`qgemv_512`]: the same group scales ([`group_scales`]), the same block
    /// partials and the same accumulation order, so each token's result is bit-identical to its
    /// one-token call.
    #[allow(clippy::needless_range_loop)]
    #[inline(always)]
    unsafe fn row<const T: usize>(
        row: *const u8,
        x: [*const f32; T],
        xs: [*const f32; T],
        nb: usize,
        pf: usize,
    ) -> [f32; T] {
        const QK: usize = 32;
        let x: [*const f32; T] = std::array::from_fn(|t| lane_x::<Q>(x[t], xs[t], nb));
        let mut acc = [_mm512_setzero_ps(); T];
        let mut macc = [_mm512_setzero_ps(); T];
        let mut d = [0f32; 16];
        let mut b0 = 0;
        while b0 < nb {
            let n = (nb - b0).min(16);
            let mask = tail_mask16(n);
            let (dv, m) = group_scales::<Q>(row.add(b0 * Q::BYTES), n);
            _mm512_storeu_ps(d.as_mut_ptr(), dv);
            if Q::HAS_MIN {
                for t in 0..T {
                    let s = _mm512_maskz_loadu_ps(mask, xs[t].add(b0));
                    macc[t] = _mm512_fmadd_ps(m, s, macc[t]);
                }
            }
            for j in 0..n {
                let b = b0 + j;
                let p = row.add(b * Q::BYTES);
                if PREFETCH {
                    _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(pf) as *const i8);
                }
                let (q0, q1) = Q::lanes512(p);
                let db = _mm512_set1_ps(d[j]);
                for t in 0..T {
                    let x0 = _mm512_loadu_ps(x[t].add(b * QK));
                    let x1 = _mm512_loadu_ps(x[t].add(b * QK + 16));
                    let s = _mm512_fmadd_ps(q1, x1, _mm512_mul_ps(q0, x0));
                    acc[t] = _mm512_fmadd_ps(db, s, acc[t]);
                }
            }
            b0 += n;
        }
        let mut s = [0f32; T];
        for (t, s) in s.iter_mut().enumerate() {
            let v = if Q::HAS_MIN {
                _mm512_add_ps(acc[t], macc[t])
            } else {
                acc[t]
            };
            *s = _mm512_reduce_add_ps(v);
        }
        s
    }
}

/// A few tokens on Q8_0/Q4_0/Q4_1/Q5_0/Q5_1 blocks (see [`few_tokens_rows`]).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(super) unsafe fn legacy_tokens_rows<Q: Quants512>(w: *const u8, job: &Job) -> bool {
    few_tokens_rows::<Legacy512<Q>>(w, job)
}

// ----- Q6_K -----

/// Q6_K's GEMV on 16 lanes: each vector is one 16-element sub-block, so its signed 8-bit scale
/// is one lane of the super-block's scales. The quants of each half super-block (128) are
/// rebuilt in bytes, 64 per instruction ([`k6_half`]: low 4 bits from `ql`, top 2 from `qh`,
/// minus 32), then per sub-block widened, converted and multiplied by the scale (exact:
/// |sc·(q − 32)| ≤ 4,096, the value the integer product of the AVX2 kernel gives), and
/// multiplied with x into the super-block's partial; `d` applied once per super-block and row
/// (`acc += d · partial`). Equal to the f32 product of the dequantized weights with f32
/// activations up to the rounding of the sums (which differs from the AVX2 kernel's: 16 lanes,
/// not 8; the values multiplied are the same as when the quants were rebuilt 16 at a time in
/// 32-bit lanes, which took about twice the instructions: `cargo bench --bench kernels --
/// gemv/Q6_K`, Qwen2.5-Coder's 896 × 4864 ffn_down on one Zen 5 core, 14.2 → 18.9 GiB/s).
/// The one-token GEMV stages each half's bytes and the scales through memory (see its body):
/// on an Intel Xeon (AVX-512 FP16, 2026-11-27) the same benchmark went 7.45 → 9.72 GiB/s.
pub(super) struct K6Gemv512;

/// The quants `q − 32` of half `h` of the Q6_K super-block at `p`, as signed bytes: the first
/// vector holds quarters 0 and 1 (32 elements each, from the low nibbles of `ql[0..32]` and
/// `ql[32..64]` with bits 0–1 and 2–3 of `qh`), the second quarters 2 and 3 (the high nibbles,
/// bits 4–5 and 6–7). Word shifts move bits across the bytes of a word, which the masks drop.
#[inline(always)]
unsafe fn k6_half(p: *const u8, h: usize) -> [__m512i; 2] {
    let ql = _mm512_loadu_si512(p.add(64 * h) as *const __m512i);
    let qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(p.add(128 + 32 * h) as *const __m256i));
    let low4 = _mm512_set1_epi8(0x0f);
    let top2 = _mm512_set1_epi8(0x30);
    // Per 256-bit half: quarter 0 takes qh bits 0–1 to bits 4–5 (<< 4), quarter 1 bits 2–3 (<< 2);
    // quarter 2 bits 4–5 (in place), quarter 3 bits 6–7 (>> 2).
    let up = _mm512_setr_epi64(
        0x0004_0004_0004_0004,
        0x0004_0004_0004_0004,
        0x0004_0004_0004_0004,
        0x0004_0004_0004_0004,
        0x0002_0002_0002_0002,
        0x0002_0002_0002_0002,
        0x0002_0002_0002_0002,
        0x0002_0002_0002_0002,
    );
    let down = _mm512_setr_epi64(
        0,
        0,
        0,
        0,
        0x0002_0002_0002_0002,
        0x0002_0002_0002_0002,
        0x0002_0002_0002_0002,
        0x0002_0002_0002_0002,
    );
    let h01 = _mm512_and_si512(_mm512_sllv_epi16(qh, up), top2);
    let h23 = _mm512_and_si512(_mm512_srlv_epi16(qh, down), top2);
    // (a & low4) | b, as one ternary-logic op.
    let q01 = _mm512_ternarylogic_epi32::<0xEA>(ql, low4, h01);
    let q23 = _mm512_ternarylogic_epi32::<0xEA>(_mm512_srli_epi16::<4>(ql), low4, h23);
    let off = _mm512_set1_epi8(32);
    [_mm512_sub_epi8(q01, off), _mm512_sub_epi8(q23, off)]
}

/// Sub-block `8·h + 2·q + half` of a super-block whose half `h` is `bytes` ([`k6_half`]), times
/// its scale (lane `2·q + half` of `scales`, the half's eight scales as f32), as f32.
#[inline(always)]
unsafe fn k6_sixteen(bytes: &[__m512i; 2], scales: __m512, q: usize, half: usize) -> __m512 {
    let v = bytes[q / 2];
    let lane = match 2 * (q % 2) + half {
        0 => _mm512_castsi512_si128(v),
        1 => _mm512_extracti32x4_epi32::<1>(v),
        2 => _mm512_extracti32x4_epi32::<2>(v),
        _ => _mm512_extracti32x4_epi32::<3>(v),
    };
    let sc = _mm512_permutexvar_ps(_mm512_set1_epi32((2 * q + half) as i32), scales);
    _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lane)), sc)
}

/// The 16 scales of the Q6_K super-block at `p` as f32 (lane `j` for sub-block `j`; a half's
/// eight start at lane `8·h`, which [`k6_half_scales`] moves to lane 0).
#[inline(always)]
unsafe fn k6_scales(p: *const u8) -> __m512 {
    _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
        p.add(192) as *const __m128i
    )))
}

/// Half `h`'s eight scales at lanes 0..8.
#[inline(always)]
unsafe fn k6_half_scales(scales: __m512, h: usize) -> __m512 {
    if h == 0 {
        scales
    } else {
        _mm512_shuffle_f32x4::<0b11_10_11_10>(scales, scales)
    }
}

impl BlockGemv for K6Gemv512 {
    const ELEMS: usize = Q6_K::ELEMS;
    const BYTES: usize = Q6_K::BYTES;

    #[inline(always)]
    unsafe fn prepare(_x: *const f32, _nb: usize) -> Vec<f32> {
        Vec::new()
    }

    #[inline(always)]
    unsafe fn gemv<const R: usize>(
        w: [*const u8; R],
        x: *const f32,
        _prep: &[f32],
        nb: usize,
        pf: usize,
    ) -> [f32; R] {
        let mut acc = [_mm512_setzero_ps(); R];
        // Per row, the super-block's 16 scales as f32 and a half's 128 quants as bytes, kept
        // in memory so that each sub-block's scale is a broadcast load and its quants a
        // widening load: taking them out of registers cost two shuffles per 16 elements
        // (an extract and a permute), on the one port that also widens the bytes.
        let mut scales = [[0f32; 16]; R];
        let mut quants = [[0i8; 128]; R];
        for b in 0..nb {
            let mut part = [_mm512_setzero_ps(); R];
            let xb = x.add(b * Q6_K::ELEMS);
            for (row, sc) in w.iter().zip(scales.iter_mut()) {
                super::avx2::prefetch_block(row.add(b * Q6_K::BYTES).wrapping_add(pf), Q6_K::BYTES);
                _mm512_storeu_ps(sc.as_mut_ptr(), k6_scales(row.add(b * Q6_K::BYTES)));
            }
            for h in 0..2 {
                for (row, q) in w.iter().zip(quants.iter_mut()) {
                    let [q01, q23] = k6_half(row.add(b * Q6_K::BYTES), h);
                    _mm512_storeu_si512(q.as_mut_ptr() as *mut __m512i, q01);
                    _mm512_storeu_si512(q.as_mut_ptr().add(64) as *mut __m512i, q23);
                }
                for q in 0..4 {
                    for half in 0..2 {
                        let xv = _mm512_loadu_ps(xb.add(128 * h + 32 * q + 16 * half));
                        for r in 0..R {
                            // Sub-block 8h + 2q + half: bytes 32q + 16·half of the half
                            // (k6_half's vector q / 2, 128-bit lane 2·(q % 2) + half).
                            let bytes = _mm_loadu_si128(
                                quants[r].as_ptr().add(32 * q + 16 * half) as *const __m128i
                            );
                            let v = _mm512_mul_ps(
                                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)),
                                _mm512_set1_ps(scales[r][8 * h + 2 * q + half]),
                            );
                            part[r] = _mm512_fmadd_ps(v, xv, part[r]);
                        }
                    }
                }
            }
            for (row, (acc, part)) in w.iter().zip(acc.iter_mut().zip(&part)) {
                let d = quant::f16_at(std::slice::from_raw_parts(
                    row.add(b * Q6_K::BYTES + 208),
                    2,
                ));
                *acc = _mm512_fmadd_ps(_mm512_set1_ps(d), *part, *acc);
            }
        }
        let mut s = [0f32; R];
        for (s, acc) in s.iter_mut().zip(&acc) {
            *s = _mm512_reduce_add_ps(*acc);
        }
        s
    }
}

impl RowTokens for K6Gemv512 {
    /// Per token as [`K6Gemv512`]'s GEMV; each sub-block's quants are rebuilt and scaled once for
    /// all the tokens.
    #[inline(always)]
    unsafe fn row<const T: usize>(
        row: *const u8,
        x: [*const f32; T],
        _prep: [*const f32; T],
        nb: usize,
        pf: usize,
    ) -> [f32; T] {
        let mut acc = [_mm512_setzero_ps(); T];
        for b in 0..nb {
            let p = row.add(b * Q6_K::BYTES);
            super::avx2::prefetch_block(p.wrapping_add(pf), Q6_K::BYTES);
            let scales = k6_scales(p);
            let mut part = [_mm512_setzero_ps(); T];
            for h in 0..2 {
                let bytes = k6_half(p, h);
                let sc = k6_half_scales(scales, h);
                for q in 0..4 {
                    for half in 0..2 {
                        let v = k6_sixteen(&bytes, sc, q, half);
                        let at = b * Q6_K::ELEMS + 128 * h + 32 * q + 16 * half;
                        for (xt, part) in x.iter().zip(part.iter_mut()) {
                            *part = _mm512_fmadd_ps(v, _mm512_loadu_ps(xt.add(at)), *part);
                        }
                    }
                }
            }
            let d = quant::f16_at(std::slice::from_raw_parts(p.add(208), 2));
            for (acc, part) in acc.iter_mut().zip(&part) {
                *acc = _mm512_fmadd_ps(_mm512_set1_ps(d), *part, *acc);
            }
        }
        let mut s = [0f32; T];
        for (s, acc) in s.iter_mut().zip(&acc) {
            *s = _mm512_reduce_add_ps(*acc);
        }
        s
    }
}

/// GEMV (`job.tokens == 1`) on Q6_K blocks (see [`K6Gemv512`]).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(super) unsafe fn k6_rows(w: *const u8, job: &Job) {
    x86::gemv_rows::<K6Gemv512>(w, job)
}

/// A few tokens on Q6_K blocks (see [`few_tokens_rows`], [`K6Gemv512`]).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(super) unsafe fn k6_tokens_rows(w: *const u8, job: &Job) -> bool {
    few_tokens_rows::<K6Gemv512>(w, job)
}

// ----- Q4_K -----

/// Q4_K's GEMV on 16 lanes: the AVX2 kernel's arithmetic (per super-block and row the eight
/// `d·sc_j` and `dmin·m_j` formed once, the mins dotted with the activation row's sub-block sums
/// in eight lanes, per 32-element sub-block `s = Σ q·x` entering the row's accumulator as
/// `acc += d·sc_j · s`) with each sub-block's partial in two 16-lane vectors instead of four
/// 8-lane ones. Equal to the f32 product of the dequantized weights with f32 activations up to
/// the rounding of the sums.
pub(super) struct K4Gemv512;

/// The quants of sub-blocks `2c` (low nibbles) and `2c + 1` (high nibbles) of the Q4_K
/// super-block at `p`, as f32 in two 16-lane vectors each, by the table lookup of
/// [`nibbles_512`] (one instruction per 16 quants where a mask and a conversion took two;
/// `gemv/Q4_K` on the Intel Xeon above: 7.96 → 8.31 GiB/s).
#[inline(always)]
unsafe fn k4_pair_512(p: *const u8, c: usize) -> ([__m512; 2], [__m512; 2]) {
    let table = _mm512_setr_ps(
        0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0,
    );
    let qs = p.add(16 + 32 * c);
    let mut lo = [_mm512_setzero_ps(); 2];
    let mut hi = [_mm512_setzero_ps(); 2];
    for j in 0..2 {
        (lo[j], hi[j]) = nibbles_512(qs.add(16 * j), table);
    }
    (lo, hi)
}

impl BlockGemv for K4Gemv512 {
    const ELEMS: usize = Q4_K::ELEMS;
    const BYTES: usize = Q4_K::BYTES;

    #[inline(always)]
    unsafe fn prepare(x: *const f32, nb: usize) -> Vec<f32> {
        x86::chunk_sums(x, nb * Q4_K::ELEMS, 32)
    }

    #[allow(clippy::needless_range_loop)]
    #[inline(always)]
    unsafe fn gemv<const R: usize>(
        w: [*const u8; R],
        x: *const f32,
        prep: &[f32],
        nb: usize,
        pf: usize,
    ) -> [f32; R] {
        let mut acc = [_mm512_setzero_ps(); R];
        let mut macc = [_mm256_setzero_ps(); R];
        let mut dsc = [[0f32; 8]; R];
        for b in 0..nb {
            let sums = _mm256_loadu_ps(prep.as_ptr().add(8 * b));
            for r in 0..R {
                let p = w[r].add(b * Q4_K::BYTES);
                super::avx2::prefetch_block(p.wrapping_add(pf), Q4_K::BYTES);
                let (d_sc, dmin_m) = super::avx2::k4_scales(p);
                _mm256_storeu_ps(dsc[r].as_mut_ptr(), d_sc);
                macc[r] = _mm256_fmadd_ps(dmin_m, sums, macc[r]);
            }
            let xb = x.add(b * Q4_K::ELEMS);
            for c in 0..4 {
                let xl = [
                    _mm512_loadu_ps(xb.add(64 * c)),
                    _mm512_loadu_ps(xb.add(64 * c + 16)),
                ];
                let xh = [
                    _mm512_loadu_ps(xb.add(64 * c + 32)),
                    _mm512_loadu_ps(xb.add(64 * c + 48)),
                ];
                for r in 0..R {
                    let (lo, hi) = k4_pair_512(w[r].add(b * Q4_K::BYTES), c);
                    let sl = _mm512_fmadd_ps(
                        lo[1],
                        xl[1],
                        _mm512_fmadd_ps(lo[0], xl[0], _mm512_setzero_ps()),
                    );
                    let sh = _mm512_fmadd_ps(
                        hi[1],
                        xh[1],
                        _mm512_fmadd_ps(hi[0], xh[0], _mm512_setzero_ps()),
                    );
                    acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(dsc[r][2 * c]), sl, acc[r]);
                    acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(dsc[r][2 * c + 1]), sh, acc[r]);
                }
            }
        }
        // Σ_j d·sc_j·Σq·x − Σ_j dmin·m_j·Σx
        let mut s = [0f32; R];
        for r in 0..R {
            s[r] = _mm512_reduce_add_ps(acc[r]) - hsum256(macc[r]);
        }
        s
    }
}

impl RowTokens for K4Gemv512 {
    /// Per token as [`K4Gemv512`]'s GEMV; the quants of each pair of sub-blocks are widened
    /// once for all the tokens.
    #[allow(clippy::needless_range_loop)]
    #[inline(always)]
    unsafe fn row<const T: usize>(
        row: *const u8,
        x: [*const f32; T],
        prep: [*const f32; T],
        nb: usize,
        pf: usize,
    ) -> [f32; T] {
        let mut acc = [_mm512_setzero_ps(); T];
        let mut macc = [_mm256_setzero_ps(); T];
        let mut dsc = [0f32; 8];
        for b in 0..nb {
            let p = row.add(b * Q4_K::BYTES);
            super::avx2::prefetch_block(p.wrapping_add(pf), Q4_K::BYTES);
            let (d_sc, dm_mn) = super::avx2::k4_scales(p);
            _mm256_storeu_ps(dsc.as_mut_ptr(), d_sc);
            for t in 0..T {
                let sums = _mm256_loadu_ps(prep[t].add(8 * b));
                macc[t] = _mm256_fmadd_ps(dm_mn, sums, macc[t]);
            }
            for c in 0..4 {
                let (lo, hi) = k4_pair_512(p, c);
                for t in 0..T {
                    let xb = x[t].add(b * Q4_K::ELEMS + 64 * c);
                    let sl = _mm512_fmadd_ps(
                        lo[1],
                        _mm512_loadu_ps(xb.add(16)),
                        _mm512_fmadd_ps(lo[0], _mm512_loadu_ps(xb), _mm512_setzero_ps()),
                    );
                    let sh = _mm512_fmadd_ps(
                        hi[1],
                        _mm512_loadu_ps(xb.add(48)),
                        _mm512_fmadd_ps(hi[0], _mm512_loadu_ps(xb.add(32)), _mm512_setzero_ps()),
                    );
                    acc[t] = _mm512_fmadd_ps(_mm512_set1_ps(dsc[2 * c]), sl, acc[t]);
                    acc[t] = _mm512_fmadd_ps(_mm512_set1_ps(dsc[2 * c + 1]), sh, acc[t]);
                }
            }
        }
        let mut s = [0f32; T];
        for t in 0..T {
            s[t] = _mm512_reduce_add_ps(acc[t]) - hsum256(macc[t]);
        }
        s
    }
}

/// GEMV (`job.tokens == 1`) on Q4_K blocks (see [`K4Gemv512`]).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(super) unsafe fn k4_rows(w: *const u8, job: &Job) {
    x86::gemv_rows::<K4Gemv512>(w, job)
}

/// A few tokens on Q4_K blocks (see [`few_tokens_rows`], [`K4Gemv512`]).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(super) unsafe fn k4_tokens_rows(w: *const u8, job: &Job) -> bool {
    few_tokens_rows::<K4Gemv512>(w, job)
}

//! AVX-512 GEMVs against 16-bit integer activations ([`super::Numerics::Int16`], [`super::int16`])
//! for Q4_0, Q4_1, Q5_0, Q5_1, Q4_K and Q6_K: the AVX2 kernels' scheme ([`super::avx2_i16`]) on 32
//! lanes. A block's 32 weight quants are built in one vector of 16-bit lanes, `vpmaddwd` multiplies
//! them with the block's 32 activation integers in one instruction (exact, pairs summed into 16 i32
//! lanes), the sums are converted to f32 once and scaled by `d_w·d_x` in one FMA into 16 f32 lanes.
//! Per block and (row, token) that is three instructions where the AVX2 kernels spend six; the
//! quants are built with AVX-512 BW's word shifts and masks (Q5_0's fifth bits go through a mask
//! register, `vpmovm2w` and one ternary-logic op).
//!
//! Rounding: per (row, token) the 16-lane f32 accumulator and its final sum differ from the
//! AVX2 kernels' 8 lanes, so an AVX-512 CPU rounds these products (within f32 rounding of the
//! same integer sums) differently from an AVX2 one; within a CPU every call of 1 to
//! [`avx2_i16::MAX_TOKENS`] token rows gives a token the same bits, as on AVX2.
//!
//! Integer ranges: as on AVX2, one `vpmaddwd` lane sums two products of at most
//! 4,096 · 32,768 (Q6_K's `sc·(q − 32)` against a rounded activation), below 2²⁸; nothing else is
//! summed in integers.

use std::arch::x86_64::*;
use std::marker::PhantomData;

use super::avx2::{k4_scales, prefetch_block};
use super::avx2_i16::{self, GemvI16};
use super::avx512::group_scales;
use super::int16::{self, XI16};
use super::x86::Legacy;
use super::Job;
use crate::backend::cpu::simd::x86::tail_mask16;
use crate::model::quant::{self, BlockFormat, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q6_K};

/// The 32 activation integers of block `b`.
#[inline(always)]
unsafe fn x_block(x: &XI16, b: usize) -> __m512i {
    _mm512_loadu_si512(x.q.as_ptr().add(b * int16::BLOCK) as *const __m512i)
}

/// `Σ w·x` of a block in 16 i32 lanes (each the sum of two exact products), as f32.
#[inline(always)]
unsafe fn dot32(w: __m512i, x: __m512i) -> __m512 {
    _mm512_cvtepi32_ps(_mm512_madd_epi16(w, x))
}

/// A legacy block's 32 integer quants (Q4_0's −8, Q5_0's −16 applied) in 16-bit lanes,
/// elements in order. (Q8_0 runs the AVX2 kernel on AVX-512 CPUs too: it was faster there; see
/// the `QuantMethod` impls.)
pub(super) trait QuantsI16x32: Legacy {
    unsafe fn q32(p: *const u8) -> __m512i;
}

/// The 16 quant bytes at `qs` as nibbles in 16-bit lanes: the bytes are repeated in both
/// halves, widened, and the upper half shifted right by four, so lanes 0..16 hold the low
/// nibbles (elements 0..16) and lanes 16..32 the high ones (elements 16..32), the latter
/// already bare. Unmasked: the low half still carries the high nibbles above bit 3.
#[inline(always)]
unsafe fn nibble_words(qs: *const u8) -> __m512i {
    let v = _mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(_mm_loadu_si128(
        qs as *const __m128i,
    )));
    _mm512_mask_srli_epi16::<4>(v, 0xffff_0000, v)
}

/// `(a & c) | (!b & !c)` as a ternary-logic immediate (bit `4a + 2b + c` of the truth table,
/// `a` the first operand): with `c` the low-nibble mask and `b` all ones where the fifth bit is
/// set, the nibble where it is set and `n | 0xfff0 = n − 16` where it is clear: Q5_0's quant.
const Q5_0_BITS: i32 = {
    let mut imm = 0;
    let mut i = 0;
    while i < 8 {
        let (a, b, c) = (i & 4 != 0, i & 2 != 0, i & 1 != 0);
        if (a && c) || (!b && !c) {
            imm |= 1 << i;
        }
        i += 1;
    }
    imm
};

/// The fifth bits of a Q5 block (bit `e` of the little-endian word at `qh` for element `e`) as a
/// mask register.
#[inline(always)]
unsafe fn fifth_bits(qh: *const u8) -> __mmask32 {
    std::ptr::read_unaligned(qh as *const u32)
}

impl QuantsI16x32 for Q4_0 {
    #[inline(always)]
    unsafe fn q32(p: *const u8) -> __m512i {
        let n = _mm512_and_si512(nibble_words(p.add(2)), _mm512_set1_epi16(0x0f));
        _mm512_sub_epi16(n, _mm512_set1_epi16(8))
    }
}

impl QuantsI16x32 for Q4_1 {
    #[inline(always)]
    unsafe fn q32(p: *const u8) -> __m512i {
        _mm512_and_si512(nibble_words(p.add(4)), _mm512_set1_epi16(0x0f))
    }
}

impl QuantsI16x32 for Q5_0 {
    #[inline(always)]
    unsafe fn q32(p: *const u8) -> __m512i {
        let set = _mm512_movm_epi16(fifth_bits(p.add(2)));
        _mm512_ternarylogic_epi32::<Q5_0_BITS>(nibble_words(p.add(6)), set, _mm512_set1_epi16(0x0f))
    }
}

impl QuantsI16x32 for Q5_1 {
    #[inline(always)]
    unsafe fn q32(p: *const u8) -> __m512i {
        let n = _mm512_and_si512(nibble_words(p.add(8)), _mm512_set1_epi16(0x0f));
        _mm512_mask_add_epi16(n, fifth_bits(p.add(4)), n, _mm512_set1_epi16(16))
    }
}

/// Blocks per group of scales: one f32 lane per block.
const GROUP: usize = 16;

/// The legacy formats, by groups of [`GROUP`] blocks: per group, row and token the block scales
/// `d_w·d_x` in one vector multiply (the `d` words fetched as the exact AVX-512 GEMV fetches
/// them) and, for the formats with a min, `m_w·Σx` in one FMA with the exact f32 block sums;
/// per block `acc += (d_w·d_x) · Σ q·x_q`, the scale broadcast from the group's.
struct LegacyI16x32<Q>(PhantomData<Q>);

impl<Q: QuantsI16x32> GemvI16 for LegacyI16x32<Q> {
    const ELEMS: usize = Q::ELEMS;
    const BYTES: usize = Q::BYTES;

    // `r` and `t` index the row pointers, activations and accumulators together.
    #[allow(clippy::needless_range_loop)]
    #[inline(always)]
    unsafe fn tile<const R: usize, const T: usize>(
        w: [*const u8; R],
        x: [&XI16; T],
        nb: usize,
        pf: usize,
    ) -> [[f32; T]; R] {
        let mut acc = [[_mm512_setzero_ps(); T]; R];
        let mut scale = [[[0f32; GROUP]; T]; R];
        let mut g = 0;
        while g < nb {
            let n = (nb - g).min(GROUP);
            let mask = tail_mask16(n);
            for r in 0..R {
                let p = w[r].add(g * Q::BYTES);
                prefetch_block(p.wrapping_add(pf), n * Q::BYTES);
                let (d, m) = group_scales::<Q>(p, n);
                for t in 0..T {
                    let dx = _mm512_maskz_loadu_ps(mask, x[t].d.as_ptr().add(g));
                    _mm512_storeu_ps(scale[r][t].as_mut_ptr(), _mm512_mul_ps(d, dx));
                    if Q::HAS_MIN {
                        let xs = _mm512_maskz_loadu_ps(mask, x[t].sums.as_ptr().add(g));
                        acc[r][t] = _mm512_fmadd_ps(m, xs, acc[r][t]);
                    }
                }
            }
            // Block-major, rows and tokens inside: the R·T accumulator chains interleave.
            for i in 0..n {
                for r in 0..R {
                    let q = Q::q32(w[r].add((g + i) * Q::BYTES));
                    for t in 0..T {
                        let s = dot32(q, x_block(x[t], g + i));
                        let ds = _mm512_set1_ps(scale[r][t][i]);
                        acc[r][t] = _mm512_fmadd_ps(ds, s, acc[r][t]);
                    }
                }
            }
            g += n;
        }
        sums(acc)
    }
}

/// Each accumulator's lanes summed.
#[inline(always)]
unsafe fn sums<const R: usize, const T: usize>(acc: [[__m512; T]; R]) -> [[f32; T]; R] {
    let mut s = [[0f32; T]; R];
    for (sr, ar) in s.iter_mut().zip(acc.iter()) {
        for (v, a) in sr.iter_mut().zip(ar.iter()) {
            *v = _mm512_reduce_add_ps(*a);
        }
    }
    s
}

/// Q4_K: per super-block, row and token the eight `d·sc_j` (formed as the exact kernels form
/// them) times the eight activation scales; the min term `Σ_j dmin·m_j·Σx_j` from the exact f32
/// sub-block sums, subtracted in the same accumulator (its upper eight lanes zero). Each 32
/// bytes of quants widen to one vector whose low nibbles are sub-block `2c` and high nibbles
/// sub-block `2c + 1`.
struct K4I16x32;

impl GemvI16 for K4I16x32 {
    const ELEMS: usize = Q4_K::ELEMS;
    const BYTES: usize = Q4_K::BYTES;

    #[allow(clippy::needless_range_loop)]
    #[inline(always)]
    unsafe fn tile<const R: usize, const T: usize>(
        w: [*const u8; R],
        x: [&XI16; T],
        nb: usize,
        pf: usize,
    ) -> [[f32; T]; R] {
        let low4 = _mm512_set1_epi16(0x0f);
        let mut acc = [[_mm512_setzero_ps(); T]; R];
        let mut scale = [[[0f32; 8]; T]; R];
        for b in 0..nb {
            // The rows' scales and min terms first, then the quants pair by pair with the rows
            // inside: a small body the compiler unrolls over the rows, keeping the
            // accumulators in registers (with each row's whole super-block inside the row loop
            // it stayed rolled and they lived on the stack).
            for r in 0..R {
                let p = w[r].add(b * Q4_K::BYTES);
                prefetch_block(p.wrapping_add(pf), Q4_K::BYTES);
                let (d_sc, dmin_m) = k4_scales(p);
                let dmin_m = _mm512_zextps256_ps512(dmin_m);
                for t in 0..T {
                    let dx = _mm256_loadu_ps(x[t].d.as_ptr().add(8 * b));
                    _mm256_storeu_ps(scale[r][t].as_mut_ptr(), _mm256_mul_ps(d_sc, dx));
                    let sums =
                        _mm512_zextps256_ps512(_mm256_loadu_ps(x[t].sums.as_ptr().add(8 * b)));
                    acc[r][t] = _mm512_fnmadd_ps(dmin_m, sums, acc[r][t]);
                }
            }
            for c in 0..4 {
                for r in 0..R {
                    let p = w[r].add(b * Q4_K::BYTES);
                    let v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(
                        p.add(16 + 32 * c) as *const __m256i
                    ));
                    let lo = _mm512_and_si512(v, low4);
                    let hi = _mm512_srli_epi16::<4>(v);
                    for t in 0..T {
                        let sl = dot32(lo, x_block(x[t], 8 * b + 2 * c));
                        let sh = dot32(hi, x_block(x[t], 8 * b + 2 * c + 1));
                        let dl = _mm512_set1_ps(scale[r][t][2 * c]);
                        let dh = _mm512_set1_ps(scale[r][t][2 * c + 1]);
                        acc[r][t] = _mm512_fmadd_ps(dl, sl, acc[r][t]);
                        acc[r][t] = _mm512_fmadd_ps(dh, sh, acc[r][t]);
                    }
                }
            }
        }
        sums(acc)
    }
}

/// Q6_K: a 32-element quarter is two 16-element sub-blocks; its quants `q − 32` are rebuilt in
/// one vector of 16-bit lanes (low four bits from `ql`, two high bits from `qh`) and multiplied
/// as integers by the two sub-blocks' scales (`vpmullw`, exact; the scales placed by one
/// `vpermw` per quarter), dotted with the activation integers, and the quarter's sum is scaled
/// by `d·d_x`.
struct K6I16x32;

impl GemvI16 for K6I16x32 {
    const ELEMS: usize = Q6_K::ELEMS;
    const BYTES: usize = Q6_K::BYTES;

    #[allow(clippy::needless_range_loop)]
    #[inline(always)]
    unsafe fn tile<const R: usize, const T: usize>(
        w: [*const u8; R],
        x: [&XI16; T],
        nb: usize,
        pf: usize,
    ) -> [[f32; T]; R] {
        let low4 = _mm512_set1_epi16(0x0f);
        let high2 = _mm512_set1_epi16(0x30);
        let bias = _mm512_set1_epi16(32);
        let mut acc = [[_mm512_setzero_ps(); T]; R];
        let mut scale = [[0f32; 8]; T];
        for b in 0..nb {
            for r in 0..R {
                let p = w[r].add(b * Q6_K::BYTES);
                prefetch_block(p.wrapping_add(pf), Q6_K::BYTES);
                let d = _mm256_set1_ps(quant::f16_at(std::slice::from_raw_parts(p.add(208), 2)));
                for t in 0..T {
                    let dx = _mm256_loadu_ps(x[t].d.as_ptr().add(8 * b));
                    _mm256_storeu_ps(scale[t].as_mut_ptr(), _mm256_mul_ps(d, dx));
                }
                // The sixteen sub-block scales in words 0..16.
                let sc = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(_mm_loadu_si128(
                    p.add(192) as *const __m128i
                )));
                // Half `h` uses 64 bytes of `ql` and 32 of `qh`; its quarter `q` (activation
                // block 4h + q) takes the low (quarters 0, 1) or high (2, 3) nibbles of `ql` run
                // `q % 2` and bits `2q..2q + 2` of `qh`; element `l` of a quarter is byte `l` of
                // both.
                for h in 0..2 {
                    let qh = _mm512_cvtepu8_epi16(_mm256_loadu_si256(
                        p.add(128 + 32 * h) as *const __m256i
                    ));
                    for q in 0..4 {
                        let ql = _mm512_cvtepu8_epi16(_mm256_loadu_si256(
                            p.add(64 * h + 32 * (q % 2)) as *const __m256i,
                        ));
                        let lo = if q < 2 {
                            _mm512_and_si512(ql, low4)
                        } else {
                            _mm512_srli_epi16::<4>(ql)
                        };
                        // Bits 2q, 2q + 1 of `qh` to bits 4, 5.
                        let hi = match q {
                            0 => _mm512_slli_epi16::<4>(qh),
                            1 => _mm512_slli_epi16::<2>(qh),
                            2 => qh,
                            _ => _mm512_srli_epi16::<2>(qh),
                        };
                        let qv = _mm512_sub_epi16(
                            _mm512_or_si512(lo, _mm512_and_si512(hi, high2)),
                            bias,
                        );
                        // Sub-blocks 8h + 2q (elements 0..16) and 8h + 2q + 1 (16..32).
                        let s0 = (8 * h + 2 * q) as i16;
                        let idx = _mm512_inserti64x4::<1>(
                            _mm512_set1_epi16(s0),
                            _mm256_set1_epi16(s0 + 1),
                        );
                        let v = _mm512_mullo_epi16(qv, _mm512_permutexvar_epi16(idx, sc));
                        for t in 0..T {
                            let s = dot32(v, x_block(x[t], 8 * b + 4 * h + q));
                            let ds = _mm512_set1_ps(scale[t][4 * h + q]);
                            acc[r][t] = _mm512_fmadd_ps(ds, s, acc[r][t]);
                        }
                    }
                }
            }
        }
        sums(acc)
    }
}

/// Q4_0/Q4_1/Q5_0/Q5_1 blocks against `x.len()` (1 to [`avx2_i16::MAX_TOKENS`]) rounded activation
/// rows, by the AVX2 kernels' driver ([`avx2_i16::rows`]).
///
/// # Safety
/// The CPU supports AVX-512 F/BW/VL, AVX2, FMA and F16C; `job` as
/// [`super::matmul_rows_at`], with `w` holding `job.rows.end` rows and `x` the job's token rows
/// rounded (`job.k` elements each).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(super) unsafe fn legacy_rows<Q: QuantsI16x32>(w: *const u8, job: &Job, x: &[XI16]) {
    avx2_i16::rows::<LegacyI16x32<Q>>(w, job, x)
}

/// As [`legacy_rows`], Q4_K blocks.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(super) unsafe fn k4_rows(w: *const u8, job: &Job, x: &[XI16]) {
    avx2_i16::rows::<K4I16x32>(w, job, x)
}

/// As [`legacy_rows`], Q6_K blocks.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(super) unsafe fn k6_rows(w: *const u8, job: &Job, x: &[XI16]) {
    avx2_i16::rows::<K6I16x32>(w, job, x)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The immediate, worked out by hand from the expression's truth table (bit `4a + 2b + c`).
    #[test]
    fn q5_0_immediate_is_its_truth_table() {
        assert_eq!(Q5_0_BITS, 0b1011_0001);
    }
}

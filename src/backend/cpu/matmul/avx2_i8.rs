//! The AVX2 kernels of [`Numerics::Int8`](super::Numerics::Int8) ([`super::int8`]), for CPUs
//! without AVX512-VNNI: activation rounding, and the interleaved GEMM, each group of 16 rows
//! taken as two halves of eight (lane `r` of a 256-bit vector: the half's row `r`), so nothing is
//! summed across lanes and each (row, token) is the chain of [`super::int8::rows_ref`] bit for
//! bit, whatever the number of tokens. The weights are the bytes the AVX-512 kernel reads.
//!
//! **Integer sums without VNNI.** `vpmaddubsw` multiplies unsigned bytes by signed ones and adds
//! pairs into 16-bit lanes, saturating: so each product must be bounded. The activations are in
//! `−127..=127` ([`super::int8::quantize_ref`] never rounds to −128). A 4-bit quant (`0..=15`;
//! Q4_0's stored `q + 8`) times an activation is at most 1,905 in magnitude, so a row's 32
//! products of a block, 16 in each of its two 16-bit lanes over the block's eight vectors, add
//! up in 16 bits (at most 30,480), and one `vpmaddwd` by ones widens the two lanes into the
//! row's 32-bit block sum. Q5's quants (`0..=31`, the fifth bit added as 16 to the bytes its
//! mask marks) are summed in two runs of four vectors (8 products a lane, at most 31,496).
//! Q8_0's signed quants (`−128..=127`) go as `|w|` (unsigned, at most 128) against the
//! activation with `w`'s sign (`vpsignb`, which cannot overflow on an activation), so each pair
//! is at most 32,512 and is widened at once.
//! Every integer sum is exact, so the block's `Σ q_w·q_x` is [`super::int8::rows_ref`]'s; the
//! stored offsets of Q4_0 and Q5_0 are taken back in integers, Q8_0's is never added (its sign
//! bit is flipped back on load).

use std::arch::x86_64::*;

use super::avx2_grouped::{store, LANES};
use super::grouped::{spans_of, GroupSpan};
use super::int8::format::{kind_of, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0};
use super::int8::{
    self, group_block_bytes, group_masks_at, group_quants_at, has_min, stored_offset, Interleaved,
    BLOCK, GROUP, XI8,
};
use super::Job;
use crate::backend::cpu::simd::{self, Level};
use crate::model::quant::QuantKind;

/// Whether this CPU runs these kernels: AVX2, FMA and F16C at the kernels' SIMD level.
pub(crate) fn available() -> bool {
    simd::level() >= Level::Avx2
}

/// [`super::int8::quantize_ref`], vectorised: 32 elements in four vectors, the rounding by
/// `vcvtps2dq` (nearest, ties to even) and two saturating packs.
///
/// # Safety
/// The CPU must have AVX2; `x` is whole blocks.
#[target_feature(enable = "avx2")]
#[allow(clippy::needless_range_loop)]
pub(crate) unsafe fn quantize(x: &[f32]) -> XI8 {
    let nb = x.len() / BLOCK;
    let mut out = XI8::zeros(x.len());
    let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
    let inf = _mm256_set1_ps(f32::INFINITY);
    // `vpackssdw` then `vpacksswb` interleave the four vectors' 128-bit halves; this puts the
    // 32-bit groups of four bytes back in element order.
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for b in 0..nb {
        let p = x.as_ptr().add(b * BLOCK);
        // Loops, not closures: a closure's intrinsics may be compiled without AVX2.
        let (mut v, mut a) = ([_mm256_setzero_ps(); 4], [_mm256_setzero_ps(); 4]);
        let mut finite = 0xff;
        for i in 0..4 {
            v[i] = _mm256_loadu_ps(p.add(8 * i));
            a[i] = _mm256_and_ps(v[i], abs);
            finite &= _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_LT_OQ>(a[i], inf));
        }
        if finite != 0xff {
            out.d[b] = f32::NAN;
            out.sums[b] = f32::NAN;
            continue;
        }
        let m = _mm256_max_ps(_mm256_max_ps(a[0], a[1]), _mm256_max_ps(a[2], a[3]));
        let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps::<0b01>(m, m)));
        let (d, id) = int8::scale_of(amax);
        let id = _mm256_set1_ps(id);
        out.d[b] = d;
        let mut q = [_mm256_setzero_si256(); 4];
        for i in 0..4 {
            q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], id));
        }
        let bytes = _mm256_packs_epi16(
            _mm256_packs_epi32(q[0], q[1]),
            _mm256_packs_epi32(q[2], q[3]),
        );
        let bytes = _mm256_permutevar8x32_epi32(bytes, order);
        _mm256_storeu_si256(out.q.as_mut_ptr().add(b * BLOCK) as *mut __m256i, bytes);
        let s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s));
        let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
        let qsum = _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32::<0b01>(s)));
        out.qsums[b] = qsum;
        out.sums[b] = d * qsum as f32;
    }
    out
}

/// Tokens that one pass over a group half's blocks computes: their accumulators and 16-bit
/// sums, with a pass's weight and activation vectors, fit the 16 vector registers. Q8_0 keeps
/// two vectors per quant vector (`w` and `|w|`) and goes three at a time: one Zen 3 core,
/// `cargo bench --bench kernels -- 'gemm/q8_0-int8/'` at 512 tokens, 43.6–43.8 Gelem/s four at a
/// time, 48.9–49.3 three at a time, 48.1–48.9 two (Q4_1 the other way: 66.0–66.3, 61.4–64.6,
/// 64.5–66.5). (A pass of 16 tokens that unpacked each block once and kept the accumulators in
/// memory ran Q4_1 at 59.8–61.0 against 63.8–64.1 and Q8_0 at 43.8–44.5 against 39.1–43.0.)
const fn chunk(format: u8) -> usize {
    if format == Q8_0 {
        3
    } else {
        4
    }
}

/// Every output of `job` over interleaved `w` with activations `x` (one per token).
///
/// # Safety
/// [`available`] must hold; `job`'s output must be valid for writes at `t·ldo + n` for every
/// token and row of the job, its bias (if any) for reads up to `w.rows`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn rows(w: &Interleaved, x: &[XI8], job: &Job) {
    match w.kind {
        QuantKind::Q4_0 => rows_of::<Q4_0>(w, x, job),
        QuantKind::Q4_1 => rows_of::<Q4_1>(w, x, job),
        QuantKind::Q8_0 => rows_of::<Q8_0>(w, x, job),
        QuantKind::Q5_0 => rows_of::<Q5_0>(w, x, job),
        QuantKind::Q5_1 => rows_of::<Q5_1>(w, x, job),
        k => unreachable!("{} is never interleaved", k.name()),
    }
}

/// The groups the job's rows reach: one token over a whole group in one pass over both halves,
/// anything else half by half in passes of up to [`chunk`] tokens. The first pass over a group
/// asks the bytes [`super::grouped::prefetch_distance`] ahead into the cache (a second half reads the lines the
/// first brought in).
#[inline(always)]
unsafe fn rows_of<const F: u8>(w: &Interleaved, x: &[XI8], job: &Job) {
    assert!(
        x.len() >= job.tokens,
        "{} activation rows for {} tokens",
        x.len(),
        job.tokens
    );
    let nb = w.cols / BLOCK;
    let bb = group_block_bytes(w.kind);
    const { assert!(GROUP == super::grouped::GROUP) };
    for span in spans_of(w.bytes.as_ptr(), nb * bb, job.rows.clone()) {
        let GroupSpan {
            n0, lo, hi, base, ..
        } = span;
        let mut ahead = span.ahead;
        if job.tokens == 1 && lo == 0 && hi == GROUP {
            // One token over a whole group (decode): both halves in one pass.
            let acc = pass::<F, 2, 1>((base, ahead, nb, bb), [0, 1], &x[..1]);
            store(job, 0, n0, 0..LANES, &acc[0]);
            store(job, 0, n0 + LANES, 0..LANES, &acc[1]);
            continue;
        }
        for h in lo / LANES..hi.div_ceil(LANES) {
            let r0 = n0 + LANES * h;
            let lanes = lo.max(LANES * h) - LANES * h..hi.min(LANES * (h + 1)) - LANES * h;
            let mut t0 = 0;
            while t0 < job.tokens {
                let n = (job.tokens - t0).min(chunk(F));
                let at = (base, ahead, nb, bb);
                macro_rules! pass {
                    ($n:literal) => {
                        store(
                            job,
                            t0,
                            r0,
                            lanes.clone(),
                            &pass::<F, 1, $n>(at, [h], &x[t0..t0 + $n])[0],
                        )
                    };
                }
                match n {
                    1 => pass!(1),
                    2 => pass!(2),
                    3 => pass!(3),
                    _ => pass!(4),
                }
                ahead = std::ptr::null();
                t0 += n;
            }
        }
    }
}

/// 16 where the fifth-bit mask `i` of half `h` of a Q5 group block marks a byte of quant
/// vector `i` (bit `4r + k` of the half's 32: lane `r`'s byte `k`), else 0.
#[inline(always)]
unsafe fn fifth_bits(masks: *const u8, i: usize, h: usize) -> __m256i {
    let m = std::ptr::read_unaligned(masks.add(8 * i + 4 * h) as *const i32);
    // Byte `b` takes the mask's byte `b / 8` (`vpshufb` indexes within each 128-bit half, and
    // the broadcast puts the mask's four bytes at the start of both).
    let spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(m),
        _mm256_setr_epi8(
            0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3,
            3, 3, 3,
        ),
    );
    let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
    _mm256_and_si256(set, _mm256_set1_epi8(16))
}

/// Quant vector `i` of a block half whose vector 0 is at `q`.
#[inline(always)]
unsafe fn vector(q: *const u8, i: usize) -> __m256i {
    _mm256_loadu_si256(q.add(4 * GROUP * i) as *const __m256i)
}

/// A token's four activation bytes `4i..4i + 4` of block `b` (`q8`: its row), in every lane.
#[inline(always)]
unsafe fn bytes4(q8: *const i8, b: usize, i: usize) -> __m256i {
    _mm256_set1_epi32(std::ptr::read_unaligned(
        q8.add(b * BLOCK + 4 * i) as *const i32
    ))
}

/// Halves `halves` of one group's outputs (`[k][t]`, lane `r`: the group's row
/// `8·halves[k] + r` for token `t`), over the group's `nb` blocks of `bb` bytes at `base`,
/// asking the bytes at `ahead` into the cache as it goes (null: none): per block the exact
/// integer sums (module doc), then `acc ← fma(float(Σ), d_w·d_x, acc)` and, for Q4_1 and Q5_1,
/// `acc ← fma(m_w, d_x·Σq, acc)`. Both halves in one pass read each 64-byte line whole where
/// it arrives and share each activation broadcast.
// Indexed by constant ranges, so the halves and tokens unroll and the sums stay in registers.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn pass<const F: u8, const K: usize, const N: usize>(
    (base, ahead, nb, bb): (*const u8, *const u8, usize, usize),
    halves: [usize; K],
    x: &[XI8],
) -> [[__m256; N]; K] {
    assert!(
        x.len() == N,
        "{} activation rows for a pass of {N}",
        x.len()
    );
    let q8: [*const i8; N] = std::array::from_fn(|t| x[t].q.as_ptr());
    let ds: [*const f32; N] = std::array::from_fn(|t| x[t].d.as_ptr());
    let sums: [*const f32; N] = std::array::from_fn(|t| x[t].sums.as_ptr());
    let qsums: [*const i32; N] = std::array::from_fn(|t| x[t].qsums.as_ptr());
    let kind = kind_of(F);
    let (quants, masks) = (group_quants_at(kind), group_masks_at(kind));
    let min = has_min(kind);
    let offset = if F == Q8_0 { 0 } else { stored_offset(kind) };
    let nibble = _mm256_set1_epi8(0x0f);
    let ones = _mm256_set1_epi16(1);
    let five = F == Q5_0 || F == Q5_1;
    let mut acc = [[_mm256_setzero_ps(); N]; K];
    let to_l2 = super::prefetch::policy().to_l2;
    for b in 0..nb {
        let blk = base.add(b * bb);
        if !ahead.is_null() {
            let next = ahead.wrapping_add(b * bb);
            for line in (0..bb).step_by(64) {
                super::prefetch::line(next.wrapping_add(line), to_l2);
            }
        }
        // Vector `i`'s half `h`: elements 4i..4i + 4 of the half's rows (Q4 and Q5: bytes
        // 4j..4j + 4 carry elements 4j.. in their low nibbles and 16 + 4j.. in their high ones).
        let q: [*const u8; K] = std::array::from_fn(|k| blk.add(quants + 4 * LANES * halves[k]));
        let mut isum = [[_mm256_setzero_si256(); N]; K];
        if F == Q8_0 {
            let flip = _mm256_set1_epi8(0x80u8 as i8);
            for i in 0..8 {
                let mut wv = [_mm256_setzero_si256(); K];
                let mut aw = [_mm256_setzero_si256(); K];
                for k in 0..K {
                    wv[k] = _mm256_xor_si256(vector(q[k], i), flip);
                    aw[k] = _mm256_abs_epi8(wv[k]);
                }
                for t in 0..N {
                    let xi = bytes4(q8[t], b, i);
                    for k in 0..K {
                        let p = _mm256_maddubs_epi16(aw[k], _mm256_sign_epi8(xi, wv[k]));
                        isum[k][t] = _mm256_add_epi32(isum[k][t], _mm256_madd_epi16(p, ones));
                    }
                }
            }
        } else {
            // 16-bit sums: the low nibbles' elements, and (Q5, whose products are larger) the
            // high nibbles' apart.
            let mut low = [[_mm256_setzero_si256(); N]; K];
            let mut high = [[_mm256_setzero_si256(); N]; K];
            for j in 0..4 {
                let mut lo = [_mm256_setzero_si256(); K];
                let mut hi = [_mm256_setzero_si256(); K];
                for k in 0..K {
                    let c = vector(q[k], j);
                    lo[k] = _mm256_and_si256(c, nibble);
                    hi[k] = _mm256_and_si256(_mm256_srli_epi16::<4>(c), nibble);
                    if five {
                        let m = blk.add(masks);
                        lo[k] = _mm256_add_epi8(lo[k], fifth_bits(m, j, halves[k]));
                        hi[k] = _mm256_add_epi8(hi[k], fifth_bits(m, j + 4, halves[k]));
                    }
                }
                for t in 0..N {
                    let (xl, xh) = (bytes4(q8[t], b, j), bytes4(q8[t], b, j + 4));
                    for k in 0..K {
                        let pl = _mm256_maddubs_epi16(lo[k], xl);
                        let ph = _mm256_maddubs_epi16(hi[k], xh);
                        if five {
                            low[k][t] = _mm256_add_epi16(low[k][t], pl);
                            high[k][t] = _mm256_add_epi16(high[k][t], ph);
                        } else {
                            low[k][t] = _mm256_add_epi16(low[k][t], _mm256_add_epi16(pl, ph));
                        }
                    }
                }
            }
            for k in 0..K {
                for t in 0..N {
                    isum[k][t] = _mm256_madd_epi16(low[k][t], ones);
                    if five {
                        let more = _mm256_madd_epi16(high[k][t], ones);
                        isum[k][t] = _mm256_add_epi32(isum[k][t], more);
                    }
                }
            }
        }
        for k in 0..K {
            let h = halves[k];
            let dw = _mm256_cvtph_ps(_mm_loadu_si128(blk.add(2 * LANES * h) as *const __m128i));
            let mw = if min {
                _mm256_cvtph_ps(_mm_loadu_si128(
                    blk.add(2 * GROUP + 2 * LANES * h) as *const __m128i
                ))
            } else {
                _mm256_setzero_ps()
            };
            for t in 0..N {
                let mut sum = isum[k][t];
                if offset != 0 {
                    // The stored quants' offset times Σx_q, taken back in integers (exact).
                    sum = _mm256_add_epi32(sum, _mm256_set1_epi32(-offset * *qsums[t].add(b)));
                }
                let s = _mm256_mul_ps(dw, _mm256_set1_ps(*ds[t].add(b)));
                acc[k][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), s, acc[k][t]);
                if min {
                    acc[k][t] = _mm256_fmadd_ps(mw, _mm256_set1_ps(*sums[t].add(b)), acc[k][t]);
                }
            }
        }
    }
    acc
}

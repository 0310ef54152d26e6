//! AVX2 GEMVs against 16-bit integer activations ([`super::Numerics::Int16`], [`super::int16`]).
//! Per 32-element block and row, the weights' integer quants are built in 16-bit lanes and
//! multiplied with the activation integers by `vpmaddwd` (16 exact products per instruction,
//! summed in pairs into i32 lanes), the block's integer sum is converted to f32 once and scaled by
//! `d_w·d_x`. The f32 path spends a widening, a conversion and an FMA per 8 weights; this one
//! spends about a third of that. AVX-512 CPUs run the Q8_0 one too; the other formats have
//! 32-lane versions there ([`super::avx512_i16`]).
//!
//! Integer ranges (no lane can overflow, whatever a file holds): an activation integer is at most
//! 32,767 in magnitude, and a block's i32 lane sums four products (two per `vpmaddwd`, two
//! vectors). The largest weight integer is Q6_K's `sc·(q − 32)`, at most 128 · 32 = 4,096, so a
//! lane stays below 4 · 4,096 · 32,768 = 2²⁹; Q8_0's quants (≤ 128) give at most 2²⁴.

use std::arch::x86_64::*;
use std::marker::PhantomData;

use super::avx2::{five_bit_bytes, k4_scales, prefetch_block};
use super::int16::{self, XI16};
use super::x86::Legacy;
use super::x86::{self, row_ptrs};
use super::Job;
use crate::backend::cpu::simd::x86::hsum256;
use crate::model::quant::{self, BlockFormat, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q6_K, Q8_0};

/// Rounds `x` (whole 32-element blocks) to [`XI16`], bit-identical to [`int16::quantize_ref`]:
/// the same largest magnitude, the same scale and reciprocal, `x · (1/d)` rounded to nearest
/// even by `vcvtps2dq`.
///
/// # Safety
/// The CPU supports AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn quantize(x: &[f32]) -> XI16 {
    const B: usize = int16::BLOCK;
    let nb = x.len() / B;
    let mut out = XI16 {
        q: vec![0; nb * B],
        d: vec![0.0; nb.next_multiple_of(int16::PAD)],
        sums: int16::block_sums(x),
    };
    let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
    for b in 0..nb {
        let p = x.as_ptr().add(b * B);
        let v = [
            _mm256_loadu_ps(p),
            _mm256_loadu_ps(p.add(8)),
            _mm256_loadu_ps(p.add(16)),
            _mm256_loadu_ps(p.add(24)),
        ];
        // `v − v` is NaN exactly where `v` is NaN or infinite.
        let inf = _mm256_or_ps(
            _mm256_or_ps(_mm256_sub_ps(v[0], v[0]), _mm256_sub_ps(v[1], v[1])),
            _mm256_or_ps(_mm256_sub_ps(v[2], v[2]), _mm256_sub_ps(v[3], v[3])),
        );
        if _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_UNORD_Q>(inf, inf)) != 0 {
            out.d[b] = f32::NAN;
            continue;
        }
        let m = _mm256_max_ps(
            _mm256_max_ps(_mm256_and_ps(v[0], abs), _mm256_and_ps(v[1], abs)),
            _mm256_max_ps(_mm256_and_ps(v[2], abs), _mm256_and_ps(v[3], abs)),
        );
        let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let m = _mm_max_ss(m, _mm_movehdup_ps(m));
        let (d, id) = int16::scale_of(_mm_cvtss_f32(m));
        out.d[b] = d;
        let id = _mm256_set1_ps(id);
        let i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v[0], id));
        let i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v[1], id));
        let i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v[2], id));
        let i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v[3], id));
        // `packs` interleaves the 128-bit halves; the permute restores element order.
        let lo = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packs_epi32(i0, i1));
        let hi = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packs_epi32(i2, i3));
        let q = out.q.as_mut_ptr().add(b * B) as *mut __m256i;
        _mm256_storeu_si256(q, lo);
        _mm256_storeu_si256(q.add(1), hi);
    }
    out
}

/// The 32 activation integers of block `b` as two 16-lane vectors.
#[inline(always)]
unsafe fn x_block(x: &XI16, b: usize) -> [__m256i; 2] {
    let p = x.q.as_ptr().add(b * int16::BLOCK) as *const __m256i;
    [_mm256_loadu_si256(p), _mm256_loadu_si256(p.add(1))]
}

/// `Σ w·x` of two 16-lane pairs, in eight i32 lanes.
#[inline(always)]
unsafe fn dot32(w: [__m256i; 2], x: [__m256i; 2]) -> __m256i {
    _mm256_add_epi32(_mm256_madd_epi16(w[0], x[0]), _mm256_madd_epi16(w[1], x[1]))
}

/// A legacy block's 32 integer quants (Q4_0's −8, Q5_0's −16 applied) in 16-bit lanes:
/// elements 0..16, 16..32.
pub(super) trait QuantsI16: Legacy {
    unsafe fn q16(p: *const u8) -> [__m256i; 2];
}

/// `v`, through an empty `asm!` block, so the compiler cannot move the mask and shift that
/// follow it to before the widening that produced it. Seeing `(zext(b) & 15, zext(b) >> 4)`,
/// LLVM narrows both to bytes and widens twice (six instructions instead of three per 16
/// quant bytes); the barrier costs no instruction. (`asm!` needs the function's own `avx`
/// feature for a ymm operand, hence `#[inline]` rather than `#[inline(always)]`; an empty
/// function is always inlined, which `nm` on the binaries shows.)
#[target_feature(enable = "avx")]
#[inline]
unsafe fn opaque(mut v: __m256i) -> __m256i {
    std::arch::asm!("/* {0} */", inout(ymm_reg) v, options(pure, nomem, nostack, preserves_flags));
    v
}

/// The 16 quant bytes at `qs` as nibbles in 16-bit lanes: elements 0..16 (low nibbles) and
/// 16..32 (high nibbles).
#[inline(always)]
unsafe fn nibbles(qs: *const u8) -> [__m256i; 2] {
    let v = opaque(_mm256_cvtepu8_epi16(_mm_loadu_si128(qs as *const __m128i)));
    [
        _mm256_and_si256(v, _mm256_set1_epi16(0x0f)),
        _mm256_srli_epi16::<4>(v),
    ]
}

/// The 32 signed bytes `q` as two vectors of 16-bit lanes: elements 0..16, 16..32.
#[inline(always)]
unsafe fn bytes_to_i16(q: __m256i) -> [__m256i; 2] {
    [
        _mm256_cvtepi8_epi16(_mm256_castsi256_si128(q)),
        _mm256_cvtepi8_epi16(_mm256_extracti128_si256::<1>(q)),
    ]
}

#[inline(always)]
unsafe fn minus(v: [__m256i; 2], offset: i16) -> [__m256i; 2] {
    let o = _mm256_set1_epi16(offset);
    [_mm256_sub_epi16(v[0], o), _mm256_sub_epi16(v[1], o)]
}

impl QuantsI16 for Q8_0 {
    #[inline(always)]
    unsafe fn q16(p: *const u8) -> [__m256i; 2] {
        [
            _mm256_cvtepi8_epi16(_mm_loadu_si128(p.add(2) as *const __m128i)),
            _mm256_cvtepi8_epi16(_mm_loadu_si128(p.add(18) as *const __m128i)),
        ]
    }
}

impl QuantsI16 for Q4_0 {
    #[inline(always)]
    unsafe fn q16(p: *const u8) -> [__m256i; 2] {
        minus(nibbles(p.add(2)), 8)
    }
}

impl QuantsI16 for Q4_1 {
    #[inline(always)]
    unsafe fn q16(p: *const u8) -> [__m256i; 2] {
        nibbles(p.add(4))
    }
}

impl QuantsI16 for Q5_0 {
    #[inline(always)]
    unsafe fn q16(p: *const u8) -> [__m256i; 2] {
        bytes_to_i16(five_bit_bytes::<16>(p.add(2), p.add(6)))
    }
}

impl QuantsI16 for Q5_1 {
    #[inline(always)]
    unsafe fn q16(p: *const u8) -> [__m256i; 2] {
        bytes_to_i16(five_bit_bytes::<0>(p.add(4), p.add(8)))
    }
}

/// A format's integer kernel: `R` rows against `T` rounded activation rows, each block's quants
/// decoded once for all the tokens. The driver runs `R = 4, T = 1` (and `1, 1`) for a GEMV and
/// `R = 1, T = 1..8` for more tokens (in chunks of 8); per (row, token) the operations and their
/// order are the same in every shape, so a token's result never depends on what it is computed
/// beside.
pub(super) trait GemvI16 {
    /// Elements and bytes per block.
    const ELEMS: usize;
    const BYTES: usize;
    /// Rows `w` of `nb` blocks against `x`; `pf` is the byte distance to prefetch ahead.
    unsafe fn tile<const R: usize, const T: usize>(
        w: [*const u8; R],
        x: [&XI16; T],
        nb: usize,
        pf: usize,
    ) -> [[f32; T]; R];
}

/// Legacy blocks whose scales are gathered into one vector: one lane per block.
const GROUP: usize = 8;

/// The f16 pair at the start of each of the `n` (at most [`GROUP`]) blocks from `p`, `d` and the
/// next two bytes (`m` for the formats with a min), widened: `(d, m)`, lane `i` for block `i`,
/// lanes past `n` zero.
#[inline(always)]
unsafe fn group_scales<Q: Legacy>(p: *const u8, n: usize) -> (__m256, __m256) {
    let at = |i: usize| std::ptr::read_unaligned(p.add(i * Q::BYTES) as *const i32);
    let (a, b) = if n == GROUP {
        let a = _mm_cvtsi32_si128(at(0));
        let a = _mm_insert_epi32::<1>(a, at(1));
        let a = _mm_insert_epi32::<2>(a, at(2));
        let a = _mm_insert_epi32::<3>(a, at(3));
        let b = _mm_cvtsi32_si128(at(4));
        let b = _mm_insert_epi32::<1>(b, at(5));
        let b = _mm_insert_epi32::<2>(b, at(6));
        let b = _mm_insert_epi32::<3>(b, at(7));
        (a, b)
    } else {
        let mut h = [0i32; GROUP];
        for (i, v) in h.iter_mut().enumerate().take(n) {
            *v = at(i);
        }
        let v = h.as_ptr() as *const __m128i;
        (_mm_loadu_si128(v), _mm_loadu_si128(v.add(1)))
    };
    // [d0 m0 d1 m1 d2 m2 d3 m3] and [d4 m4 …]; the shuffles give [d0 d1 d4 d5 | d2 d3 d6 d7],
    // the 64-bit permute restores block order.
    let (a, b) = (_mm256_cvtph_ps(a), _mm256_cvtph_ps(b));
    let order =
        |v: __m256| _mm256_castpd_ps(_mm256_permute4x64_pd::<0b11_01_10_00>(_mm256_castps_pd(v)));
    (
        order(_mm256_shuffle_ps::<0b10_00_10_00>(a, b)),
        order(_mm256_shuffle_ps::<0b11_01_11_01>(a, b)),
    )
}

/// The legacy formats, by groups of [`GROUP`] blocks. Per group, row and token the block scales
/// `d_w·d_x` are formed in one vector multiply (and for the formats with a min, `m_w·Σx` is one
/// FMA of the gathered mins with the exact f32 block sums); per block the integer sum
/// `Σ q·x_q` (exact in i32 lanes) is converted once and added with its scale broadcast from the
/// group's vector: `acc += (d_w·d_x) · Σ q·x_q`, eight lanes per (row, token), summed at the end.
struct LegacyI16<Q>(PhantomData<Q>);

impl<Q: QuantsI16> GemvI16 for LegacyI16<Q> {
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
        let mut acc = [[_mm256_setzero_ps(); T]; R];
        let mut scale = [[[0f32; GROUP]; T]; R];
        let mut g = 0;
        while g < nb {
            let n = (nb - g).min(GROUP);
            for r in 0..R {
                let p = w[r].add(g * Q::BYTES);
                prefetch_block(p.wrapping_add(pf), n * Q::BYTES);
                let (d, m) = group_scales::<Q>(p, n);
                for t in 0..T {
                    let dx = _mm256_loadu_ps(x[t].d.as_ptr().add(g));
                    _mm256_storeu_ps(scale[r][t].as_mut_ptr(), _mm256_mul_ps(d, dx));
                    if Q::HAS_MIN {
                        let xs = _mm256_loadu_ps(x[t].sums.as_ptr().add(g));
                        acc[r][t] = _mm256_fmadd_ps(m, xs, acc[r][t]);
                    }
                }
            }
            // Block-major, rows and tokens inside: the R·T accumulator chains interleave.
            for i in 0..n {
                for r in 0..R {
                    let q = Q::q16(w[r].add((g + i) * Q::BYTES));
                    for t in 0..T {
                        let s = _mm256_cvtepi32_ps(dot32(q, x_block(x[t], g + i)));
                        let ds = _mm256_broadcast_ss(&scale[r][t][i]);
                        acc[r][t] = _mm256_fmadd_ps(ds, s, acc[r][t]);
                    }
                }
            }
            g += n;
        }
        let mut s = [[0f32; T]; R];
        for r in 0..R {
            for t in 0..T {
                s[r][t] = hsum256(acc[r][t]);
            }
        }
        s
    }
}

/// Q4_K: per super-block, row and token the eight `d·sc_j` (formed as the exact kernel forms
/// them) times the eight activation scales, one per 32-element sub-block; the min term
/// `Σ_j dmin·m_j·Σx_j` from the exact f32 sub-block sums, subtracted in the same accumulator.
struct K4I16;

impl GemvI16 for K4I16 {
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
        let mut acc = [[_mm256_setzero_ps(); T]; R];
        let mut scale = [[0f32; 8]; T];
        for b in 0..nb {
            for r in 0..R {
                let p = w[r].add(b * Q4_K::BYTES);
                prefetch_block(p.wrapping_add(pf), Q4_K::BYTES);
                let (d_sc, dmin_m) = k4_scales(p);
                for t in 0..T {
                    let dx = _mm256_loadu_ps(x[t].d.as_ptr().add(8 * b));
                    _mm256_storeu_ps(scale[t].as_mut_ptr(), _mm256_mul_ps(d_sc, dx));
                    let sums = _mm256_loadu_ps(x[t].sums.as_ptr().add(8 * b));
                    acc[r][t] = _mm256_fnmadd_ps(dmin_m, sums, acc[r][t]);
                }
                // 32 bytes of quants per pair of sub-blocks: low nibbles sub-block 2c, high 2c + 1.
                for c in 0..4 {
                    let qs = p.add(16 + 32 * c);
                    let [lo0, hi0] = nibbles(qs);
                    let [lo1, hi1] = nibbles(qs.add(16));
                    let (lo, hi) = ([lo0, lo1], [hi0, hi1]);
                    for t in 0..T {
                        let sl = _mm256_cvtepi32_ps(dot32(lo, x_block(x[t], 8 * b + 2 * c)));
                        let sh = _mm256_cvtepi32_ps(dot32(hi, x_block(x[t], 8 * b + 2 * c + 1)));
                        let dl = _mm256_broadcast_ss(&scale[t][2 * c]);
                        let dh = _mm256_broadcast_ss(&scale[t][2 * c + 1]);
                        acc[r][t] = _mm256_fmadd_ps(dl, sl, acc[r][t]);
                        acc[r][t] = _mm256_fmadd_ps(dh, sh, acc[r][t]);
                    }
                }
            }
        }
        let mut s = [[0f32; T]; R];
        for r in 0..R {
            for t in 0..T {
                s[r][t] = hsum256(acc[r][t]);
            }
        }
        s
    }
}

/// Q6_K: each 16-lane vector of a 32-element quarter is one 16-element sub-block; its quants
/// `q − 32` are rebuilt in 16-bit lanes and multiplied by the sub-block's scale as integers
/// (`vpmullw`, exact), dotted with the activation integers, and the quarter's sum is scaled by
/// `d·d_x`.
struct K6I16;

impl GemvI16 for K6I16 {
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
        let low4 = _mm256_set1_epi16(0x0f);
        let low2 = _mm256_set1_epi16(0x03);
        let bias = _mm256_set1_epi16(32);
        let mut acc = [[_mm256_setzero_ps(); T]; R];
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
                // Half `h` uses 64 bytes of `ql` and 32 of `qh`; its quarter `q` (32 elements,
                // activation block 4h + q) takes the low (quarters 0, 1) or high (2, 3) nibbles
                // of `ql` run `q % 2` and bits `2q..` of `qh`; element `l` of a quarter is byte
                // `l` of both.
                for h in 0..2 {
                    for q in 0..4 {
                        let lshift = _mm_cvtsi32_si128(4 * (q / 2) as i32);
                        let hshift = _mm_cvtsi32_si128(2 * q as i32);
                        let mut v = [_mm256_setzero_si256(); 2];
                        for (half, vh) in v.iter_mut().enumerate() {
                            let ql = p.add(64 * h + 32 * (q % 2) + 16 * half);
                            let qh = p.add(128 + 32 * h + 16 * half);
                            let lo = _mm256_cvtepu8_epi16(_mm_loadu_si128(ql as *const __m128i));
                            let hi = _mm256_cvtepu8_epi16(_mm_loadu_si128(qh as *const __m128i));
                            let lo = _mm256_and_si256(_mm256_srl_epi16(lo, lshift), low4);
                            let hi = _mm256_and_si256(_mm256_srl_epi16(hi, hshift), low2);
                            let qv = _mm256_sub_epi16(
                                _mm256_or_si256(lo, _mm256_slli_epi16::<4>(hi)),
                                bias,
                            );
                            // Sub-block (16 elements) `8h + 2q + half`.
                            let sc = *(p.add(192 + 8 * h + 2 * q + half) as *const i8);
                            *vh = _mm256_mullo_epi16(qv, _mm256_set1_epi16(sc as i16));
                        }
                        for t in 0..T {
                            let s = _mm256_cvtepi32_ps(dot32(v, x_block(x[t], 8 * b + 4 * h + q)));
                            let ds = _mm256_broadcast_ss(&scale[t][4 * h + q]);
                            acc[r][t] = _mm256_fmadd_ps(ds, s, acc[r][t]);
                        }
                    }
                }
            }
        }
        let mut s = [[0f32; T]; R];
        for r in 0..R {
            for t in 0..T {
                s[r][t] = hsum256(acc[r][t]);
            }
        }
        s
    }
}

/// Tokens handled together: each row's blocks are decoded once per chunk of this many tokens
/// (the accumulators of a chunk fill the vector registers).
const CHUNK: usize = 8;

/// The most token rows a call runs on these kernels; more go through the exact kernels, whose
/// packed panels serve many tokens faster. Measured single-threaded on a Zen 3 (AVX2) with
/// `1536 × 768` matrices: at 16 tokens the integer kernels took 0.8–0.9 of the panels' time on
/// Q4_1/Q8_0/Q4_K and 0.4 on Q6_K, at 24–32 about the same, at 64 the panels 0.7.
pub(super) const MAX_TOKENS: usize = 16;

/// The integer driver. One token: groups of 4 rows, then single rows, each group prefetching
/// the same block of a later group ([`x86::prefetch_ahead`], as [`x86::gemv_rows`] does for f32
/// activations). More
/// tokens: row by row, each row's blocks decoded once per chunk of [`CHUNK`] tokens.
#[inline(always)]
pub(super) unsafe fn rows<K: GemvI16>(w: *const u8, job: &Job, x: &[XI16]) {
    let nb = job.k / K::ELEMS;
    let rb = nb * K::BYTES;
    if x.len() == 1 {
        let end = job.rows.end;
        let mut n = job.rows.start;
        while n + 4 <= end {
            let s = K::tile::<4, 1>(row_ptrs(w, n, rb), [&x[0]], nb, x86::prefetch_ahead(rb));
            x86::put_tile(job, n, 0, s);
            n += 4;
        }
        while n < end {
            let s = K::tile::<1, 1>(row_ptrs(w, n, rb), [&x[0]], nb, rb);
            x86::put_tile(job, n, 0, s);
            n += 1;
        }
        return;
    }
    for n in job.rows.clone() {
        let mut t = 0;
        while t < x.len() {
            let c = (x.len() - t).min(CHUNK);
            let x = &x[t..t + c];
            match c {
                1 => chunk::<K, 1>(w, job, x, n, t, nb, rb),
                2 => chunk::<K, 2>(w, job, x, n, t, nb, rb),
                3 => chunk::<K, 3>(w, job, x, n, t, nb, rb),
                4 => chunk::<K, 4>(w, job, x, n, t, nb, rb),
                5 => chunk::<K, 5>(w, job, x, n, t, nb, rb),
                6 => chunk::<K, 6>(w, job, x, n, t, nb, rb),
                7 => chunk::<K, 7>(w, job, x, n, t, nb, rb),
                _ => chunk::<K, CHUNK>(w, job, x, n, t, nb, rb),
            }
            t += c;
        }
    }
}

/// Row `n` against the `T` token rows `x` (tokens `t..t + T` of the job).
#[inline(always)]
unsafe fn chunk<K: GemvI16, const T: usize>(
    w: *const u8,
    job: &Job,
    x: &[XI16],
    n: usize,
    t: usize,
    nb: usize,
    rb: usize,
) {
    let xs: [&XI16; T] = std::array::from_fn(|j| &x[j]);
    let s = K::tile::<1, T>(row_ptrs(w, n, rb), xs, nb, rb);
    x86::put_tile(job, n, t, s);
}

/// Q8_0/Q4_0/Q4_1/Q5_0/Q5_1 blocks against `x.len()` rounded activation rows (any number).
///
/// # Safety
/// The CPU supports AVX2, FMA and F16C; `job` as [`super::matmul_rows_at`], with `w` holding
/// `job.rows.end` rows and `x` the job's token rows rounded (`job.k` elements each).
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn legacy_rows<Q: QuantsI16>(w: *const u8, job: &Job, x: &[XI16]) {
    rows::<LegacyI16<Q>>(w, job, x)
}

/// As [`legacy_rows`], Q4_K blocks.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn k4_rows(w: *const u8, job: &Job, x: &[XI16]) {
    rows::<K4I16>(w, job, x)
}

/// As [`legacy_rows`], Q6_K blocks.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn k6_rows(w: *const u8, job: &Job, x: &[XI16]) {
    rows::<K6I16>(w, job, x)
}

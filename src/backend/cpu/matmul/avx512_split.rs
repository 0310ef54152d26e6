//! The activations' [`Split`] for [`super::grouped_i16`], sixteen blocks at a time (AVX-512 with
//! VBMI): the same bytes, scales and sums as [`super::grouped_i16::split_ref`], in about a
//! third of the vector work of [`super::avx512_grouped_i16::split_into`].
//!
//! **Why.** That split reduced each block on its own: a horizontal maximum, two horizontal
//! integer sums and the block sum, then six `vpmovdb` and their inserts and byte shuffles for
//! the planes, nearly all of it on the one port that shuffles, and every part of a one-token
//! matmul in a decode step splits the whole row before it reads a weight. On one core of the
//! Intel Xeon (family 6 model 207), best of 2,000 int24 splits, that one and this: 576 wide 451
//! and 218 ns, 1,536 wide 1,166 and 446 ns.
//!
//! **How.** The reductions of sixteen blocks are done together by a transposing tree: each
//! block's vector is folded half onto half (lanes `i` and `i + 8`, then `i` and `i + 4`, …) while
//! the folds of different blocks are packed into the same vectors, 31 shuffles for sixteen
//! blocks' sixteen lanes instead of four or more a block. The folds are the block sum's own order
//! ([`super::block_sum`]: halves added, then halves of those), maxima and integer sums do not
//! depend on order. A block's three (or two) byte planes are one or two `vpermt2b` of its two
//! vectors of integers: the planes are the integers' low bytes, in the order the kernel reads
//! ([`super::grouped_i16::split_at`]), and the top plane is the top byte of an integer that fits
//! its width, the signed `q >> top_shift`.

use std::arch::x86_64::*;

use super::grouped::BLOCK;
use super::grouped_i16::{split_at, Split, Width};

/// Blocks reduced together: the sixteen lanes of a vector.
const TOGETHER: usize = 16;

/// The `vpermt2b` indices of the planes of one block: output byte `32·p + split_at(e)` takes byte
/// `p` of element `e`'s integer, which is byte `4·e + p` of the two integer vectors (elements
/// 0–15, then 16–31). `FIRST` gives planes 0 and 1; otherwise plane 2 in the low half.
const fn plane_indices<const FIRST: bool>() -> [u8; 64] {
    let mut idx = [0u8; 64];
    let mut e = 0;
    while e < BLOCK {
        let at = split_at(e);
        if FIRST {
            idx[at] = (4 * e) as u8;
            idx[BLOCK + at] = (4 * e + 1) as u8;
        } else {
            idx[at] = (4 * e + 2) as u8;
        }
        e += 1;
    }
    idx
}

const PLANES_01: [u8; 64] = plane_indices::<true>();
const PLANE_2: [u8; 64] = plane_indices::<false>();

/// Whether this CPU runs [`split_into`]: AVX-512 F/BW/VL and VBMI at the kernels' level.
pub(crate) fn available() -> bool {
    super::avx512_grouped_i16::gathers()
}

/// Two vectors' 128-bit quarters folded: `[a₀+a₂, a₁+a₃, b₀+b₂, b₁+b₃]` by `op`, where `a`
/// holds lanes of one block (or pair) and `b` of the next: lane `i < 8` of the result is block
/// `a`'s lanes `i` and `i + 8` joined, lane `8 + i` block `b`'s.
#[inline(always)]
unsafe fn fold8<J: Join>(a: __m512i, b: __m512i, _: J) -> __m512i {
    J::join(
        _mm512_shuffle_i32x4::<0b01_00_01_00>(a, b),
        _mm512_shuffle_i32x4::<0b11_10_11_10>(a, b),
    )
}

/// The next fold, of vectors that hold two blocks each (eight lanes of each, from [`fold8`]):
/// quarters `[a₀+a₁, a₂+a₃, b₀+b₁, b₂+b₃]`, four blocks of four lanes.
#[inline(always)]
unsafe fn fold4<J: Join>(a: __m512i, b: __m512i, _: J) -> __m512i {
    J::join(
        _mm512_shuffle_i32x4::<0b10_00_10_00>(a, b),
        _mm512_shuffle_i32x4::<0b11_01_11_01>(a, b),
    )
}

/// Within each quarter (one block of four lanes in `a`, another in `b`):
/// `[a₀+a₂, a₁+a₃, b₀+b₂, b₁+b₃]`.
#[inline(always)]
unsafe fn fold2<J: Join>(a: __m512i, b: __m512i, _: J) -> __m512i {
    let (a, b) = (_mm512_castsi512_ps(a), _mm512_castsi512_ps(b));
    J::join(
        _mm512_castps_si512(_mm512_shuffle_ps::<0b01_00_01_00>(a, b)),
        _mm512_castps_si512(_mm512_shuffle_ps::<0b11_10_11_10>(a, b)),
    )
}

/// Within each quarter (two blocks of two lanes in `a`, two in `b`): `[a₀+a₁, a₂+a₃, b₀+b₁,
/// b₂+b₃]`.
#[inline(always)]
unsafe fn fold1<J: Join>(a: __m512i, b: __m512i, _: J) -> __m512i {
    let (a, b) = (_mm512_castsi512_ps(a), _mm512_castsi512_ps(b));
    J::join(
        _mm512_castps_si512(_mm512_shuffle_ps::<0b10_00_10_00>(a, b)),
        _mm512_castps_si512(_mm512_shuffle_ps::<0b11_01_11_01>(a, b)),
    )
}

/// Four quads of four blocks' vectors (`v[4q + i]`, block `4q + i`) reduced by `op`, lane `b` of
/// the result holding block `b`'s: the folds [`fold8`], [`fold4`] per quad as it comes
/// ([`quad`]), then [`fold2`] and [`fold1`] across quads, and one permute back to block order
/// (the folds leave block `j + 4m` in lane `4j + m`).
#[inline(always)]
unsafe fn across<J: Join>(x: [__m512i; 4], j: J) -> __m512i {
    let y0 = fold2(x[0], x[1], j);
    let y1 = fold2(x[2], x[3], j);
    let z = fold1(y0, y1, j);
    let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    _mm512_permutexvar_epi32(order, z)
}

/// Four blocks' vectors folded into one ([`fold8`] of each pair, then [`fold4`]): quarter `i`
/// holds block `i`'s four partial results.
#[inline(always)]
unsafe fn quad<J: Join>(v: [__m512i; 4], j: J) -> __m512i {
    fold4(fold8(v[0], v[1], j), fold8(v[2], v[3], j), j)
}

/// `v·id` rounded to the nearest integer (ties to even, `vcvtps2dq` in the default rounding
/// mode) and kept within `lo..=hi`.
#[inline(always)]
unsafe fn rounded(v: __m512, id: __m512, (hi, lo): (__m512i, __m512i)) -> __m512i {
    _mm512_max_epi32(
        _mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v, id)), hi),
        lo,
    )
}

/// How two blocks' partial results join: a sum of floats, of integers, or an unsigned maximum.
trait Join: Copy {
    unsafe fn join(a: __m512i, b: __m512i) -> __m512i;
}

#[derive(Clone, Copy)]
struct AddF32;
#[derive(Clone, Copy)]
struct AddI32;
#[derive(Clone, Copy)]
struct MaxU32;

impl Join for AddF32 {
    #[inline(always)]
    unsafe fn join(a: __m512i, b: __m512i) -> __m512i {
        _mm512_castps_si512(_mm512_add_ps(
            _mm512_castsi512_ps(a),
            _mm512_castsi512_ps(b),
        ))
    }
}

impl Join for AddI32 {
    #[inline(always)]
    unsafe fn join(a: __m512i, b: __m512i) -> __m512i {
        _mm512_add_epi32(a, b)
    }
}

impl Join for MaxU32 {
    #[inline(always)]
    unsafe fn join(a: __m512i, b: __m512i) -> __m512i {
        _mm512_max_epu32(a, b)
    }
}

/// `x` (whole blocks) rounded to integers of `width` and cut into a [`Split`]'s bytes, bit for
/// bit as [`super::grouped_i16::split_ref`] does (the module doc says how): per block the scale
/// of its largest magnitude (compared as the bits of absolute values, which order as the
/// floats do, a NaN or infinity above every finite value), `vcvtps2dq`'s nearest-even rounding
/// of `x·(1/d)` clamped to `±qmax`, the reference's NaN scale and zeros for a block holding a
/// NaN or infinity, and [`super::block_sum`]'s sums. Written into `out`'s buffers (a spent
/// split's, or empty ones), every value set afresh.
///
/// # Safety
/// [`available`] must hold; `x` is whole blocks.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2")]
pub(crate) unsafe fn split_into(x: &[f32], width: Width, out: &mut Split) {
    let nb = x.len() / BLOCK;
    let (bb, planes) = (width.block_bytes(), width.planes());
    out.reset(width, nb);
    let Split {
        bytes,
        d,
        sums,
        lsums,
        hsums,
        ..
    } = out;
    let abs = _mm512_set1_epi32(0x7fff_ffff);
    let qmax = width.qmax();
    let (hi_q, lo_q) = (_mm512_set1_epi32(qmax), _mm512_set1_epi32(-qmax));
    let below = _mm512_set1_epi32((1 << width.top_shift()) - 1);
    let top = _mm_cvtsi32_si128(width.top_shift() as i32);
    let planes01 = _mm512_loadu_si512(PLANES_01.as_ptr() as *const _);
    let plane2 = _mm512_loadu_si512(PLANE_2.as_ptr() as *const _);
    let xp = x.as_ptr();
    let mut g = 0;
    while g < nb {
        let n = TOGETHER.min(nb - g);
        let kept: __mmask16 = if n == TOGETHER {
            u16::MAX
        } else {
            (1u16 << n) - 1
        };
        // Pass 1: each block's largest magnitude (as bits) and its sum, sixteen at once.
        let mut amax = [_mm512_setzero_si512(); 4];
        let mut total = [_mm512_setzero_si512(); 4];
        for q in 0..4 {
            let mut m = [_mm512_setzero_si512(); 4];
            let mut s = [_mm512_setzero_si512(); 4];
            for i in 0..4 {
                let b = 4 * q + i;
                if b < n {
                    let p = xp.add((g + b) * BLOCK);
                    let (lo, hi) = (_mm512_loadu_ps(p), _mm512_loadu_ps(p.add(16)));
                    let (lb, hb) = (_mm512_castps_si512(lo), _mm512_castps_si512(hi));
                    m[i] = _mm512_max_epu32(_mm512_and_si512(lb, abs), _mm512_and_si512(hb, abs));
                    s[i] = _mm512_castps_si512(_mm512_add_ps(lo, hi));
                }
            }
            amax[q] = quad(m, MaxU32);
            total[q] = quad(s, AddF32);
        }
        let amax = across(amax, MaxU32);
        let total = _mm512_castsi512_ps(across(total, AddF32));
        // A NaN or infinity: its magnitude's bits at or above the infinity's.
        let bad = _mm512_cmpge_epu32_mask(amax, _mm512_set1_epi32(0x7f80_0000)) & kept;
        // `block_scale`: d = amax / qmax, its inverse where d > 0 and the inverse is finite.
        let dv = _mm512_div_ps(_mm512_castsi512_ps(amax), _mm512_set1_ps(qmax as f32));
        let inv = _mm512_div_ps(_mm512_set1_ps(1.0), dv);
        let usable = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(dv, _mm512_setzero_ps())
            & _mm512_cmp_ps_mask::<_CMP_LT_OQ>(inv, _mm512_set1_ps(f32::INFINITY));
        let inv = _mm512_maskz_mov_ps(usable, inv);
        let dv = _mm512_mask_mov_ps(dv, bad, _mm512_set1_ps(f32::NAN));
        _mm512_mask_storeu_ps(d.as_mut_ptr().add(g), kept, dv);
        _mm512_mask_storeu_ps(sums.as_mut_ptr().add(g), kept, total);
        let mut ids = [0f32; TOGETHER];
        _mm512_storeu_ps(ids.as_mut_ptr(), inv);
        // Pass 2: the integers, their planes, and their sums below and at the top byte.
        let mut low = [_mm512_setzero_si512(); 4];
        let mut high = [_mm512_setzero_si512(); 4];
        for q in 0..4 {
            let mut l = [_mm512_setzero_si512(); 4];
            let mut h = [_mm512_setzero_si512(); 4];
            for i in 0..4 {
                let b = 4 * q + i;
                if b >= n || bad & (1 << b) != 0 {
                    // Past the row, or the reference's zero integers (the bytes already zero).
                    continue;
                }
                let p = xp.add((g + b) * BLOCK);
                let id = _mm512_set1_ps(ids[b]);
                let ql = rounded(_mm512_loadu_ps(p), id, (hi_q, lo_q));
                let qh = rounded(_mm512_loadu_ps(p.add(16)), id, (hi_q, lo_q));
                l[i] = _mm512_add_epi32(_mm512_and_si512(ql, below), _mm512_and_si512(qh, below));
                h[i] = _mm512_add_epi32(_mm512_sra_epi32(ql, top), _mm512_sra_epi32(qh, top));
                let dst = bytes.as_mut_ptr().add((g + b) * bb);
                _mm512_storeu_si512(dst as *mut _, _mm512_permutex2var_epi8(ql, planes01, qh));
                if planes == 3 {
                    let p2 = _mm512_permutex2var_epi8(ql, plane2, qh);
                    _mm256_storeu_si256(dst.add(2 * BLOCK) as *mut _, _mm512_castsi512_si256(p2));
                }
            }
            low[q] = quad(l, AddI32);
            high[q] = quad(h, AddI32);
        }
        _mm512_mask_storeu_epi32(lsums.as_mut_ptr().add(g), kept, across(low, AddI32));
        _mm512_mask_storeu_epi32(hsums.as_mut_ptr().add(g), kept, across(high, AddI32));
        g += n;
    }
}

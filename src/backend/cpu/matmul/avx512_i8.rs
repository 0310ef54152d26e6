//! The AVX512-VNNI kernels of [`Numerics::Int8`](super::Numerics::Int8) ([`super::int8`]):
//! activation rounding, and the interleaved GEMM whose 16 output rows are the 16 lanes of every
//! vector, so nothing is summed across lanes and each (row, token) is the same chain of
//! operations as [`super::int8::rows_ref`], bit for bit, whatever the number of tokens.

use std::arch::x86_64::*;
use std::sync::OnceLock;

use super::avx512_groups::{drive, GroupPass};
use super::int8::format::{kind_of, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0};
use super::int8::{
    self, group_block_bytes, group_masks_at, group_quants_at, has_min, stored_offset, Interleaved,
    BLOCK, GROUP, XI8,
};
use super::Job;
use crate::backend::cpu::simd::{self, Level};
use crate::model::quant::QuantKind;

/// Whether this CPU runs these kernels: AVX-512 F/BW/VL and VNNI, at the kernels' SIMD level.
pub(crate) fn available() -> bool {
    static VNNI: OnceLock<bool> = OnceLock::new();
    *VNNI.get_or_init(|| is_x86_feature_detected!("avx512vnni")) && simd::level() >= Level::Avx512
}

/// [`super::int8::quantize_ref`], vectorised: 32 elements in two vectors, the rounding by
/// `vcvtps2dq` (nearest, ties to even) and `vpmovsdb`.
///
/// # Safety
/// The CPU must have AVX-512 F/BW/VL; `x` is whole blocks.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
pub(crate) unsafe fn quantize(x: &[f32]) -> XI8 {
    let nb = x.len() / BLOCK;
    let mut out = XI8::zeros(x.len());
    let abs = _mm512_set1_epi32(0x7fff_ffff);
    let inf = _mm512_set1_ps(f32::INFINITY);
    for b in 0..nb {
        let p = x.as_ptr().add(b * BLOCK);
        let (lo, hi) = (_mm512_loadu_ps(p), _mm512_loadu_ps(p.add(16)));
        let al = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(lo), abs));
        let ah = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(hi), abs));
        let finite =
            _mm512_cmp_ps_mask::<_CMP_LT_OQ>(al, inf) & _mm512_cmp_ps_mask::<_CMP_LT_OQ>(ah, inf);
        if finite != 0xffff {
            out.d[b] = f32::NAN;
            out.sums[b] = f32::NAN;
            continue;
        }
        let amax = _mm512_reduce_max_ps(_mm512_max_ps(al, ah));
        let (d, id) = int8::scale_of(amax);
        let id = _mm512_set1_ps(id);
        out.d[b] = d;
        let ql = _mm512_cvtps_epi32(_mm512_mul_ps(lo, id));
        let qh = _mm512_cvtps_epi32(_mm512_mul_ps(hi, id));
        let dst = out.q.as_mut_ptr().add(b * BLOCK) as *mut __m128i;
        _mm_storeu_si128(dst, _mm512_cvtsepi32_epi8(ql));
        _mm_storeu_si128(dst.add(1), _mm512_cvtsepi32_epi8(qh));
        let qsum = _mm512_reduce_add_epi32(_mm512_add_epi32(ql, qh));
        out.qsums[b] = qsum;
        out.sums[b] = d * qsum as f32;
    }
    out
}

/// Every output of `job` over interleaved `w` with activations `x` (one per token).
///
/// # Safety
/// [`available`] must hold; `job`'s output must be valid for writes at `t·ldo + n` for every
/// token and row of the job, its bias (if any) for reads up to `w.rows`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")]
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

#[inline(always)]
unsafe fn rows_of<const F: u8>(w: &Interleaved, x: &[XI8], job: &Job) {
    let nb = w.cols / BLOCK;
    let bb = group_block_bytes(w.kind);
    // The prefetch hint as a constant of the kernel (see `super::prefetch::lines_at_step`).
    super::prefetch::with_hint!(L2 => drive(&Pass::<F, L2> { nb, bb, x }, w.bytes.as_ptr(), nb * bb, job))
}

/// [`chunk`] as the shared group loop's pass, prefetching into L2 (`L2`) or L1.
struct Pass<'a, const F: u8, const L2: bool> {
    /// Blocks per row, and bytes per group block.
    nb: usize,
    bb: usize,
    /// Every token's rounded activations.
    x: &'a [XI8],
}

impl<const F: u8, const L2: bool> GroupPass for Pass<'_, F, L2> {
    #[inline(always)]
    unsafe fn pass<const N: usize>(
        &self,
        base: *const u8,
        ahead: *const u8,
        t0: usize,
    ) -> [__m512; N] {
        chunk::<F, N, L2>((base, ahead, self.nb, self.bb), &self.x[t0..t0 + N])
    }
}

/// One group's 16 outputs for `N` tokens: the block chain of [`super::int8`]'s module doc, lane by
/// lane.
#[inline(always)]
unsafe fn chunk<const F: u8, const N: usize, const L2: bool>(
    (base, ahead, nb, bb): (*const u8, *const u8, usize, usize),
    x: &[XI8],
) -> [__m512; N] {
    assert!(
        x.len() == N,
        "{} activation rows for a chunk of {N}",
        x.len()
    );
    let q8: [*const i8; N] = std::array::from_fn(|t| x[t].q.as_ptr());
    let ds: [*const f32; N] = std::array::from_fn(|t| x[t].d.as_ptr());
    let sums: [*const f32; N] = std::array::from_fn(|t| x[t].sums.as_ptr());
    let qsums: [*const i32; N] = std::array::from_fn(|t| x[t].qsums.as_ptr());
    let mut acc = [_mm512_setzero_ps(); N];
    let nibble = _mm512_set1_epi8(0x0f);
    let sixteen = _mm512_set1_epi8(16);
    let kind = kind_of(F);
    let (quants, masks) = (group_quants_at(kind), group_masks_at(kind));
    let min = has_min(kind);
    let offset = stored_offset(kind);
    // A constant, so that each step's lines are constant offsets.
    let lines = group_block_bytes(kind).div_ceil(64);
    for b in 0..nb {
        let blk = base.add(b * bb);
        // The same block of the next group asked for a line at a time between the weights'
        // loads (line `l` of `lines` after vector `⌊8·l / lines⌋`), not in one burst ahead of
        // them (see `Spread` in `super::avx512_grouped`): `--numerics int8` decode on the
        // 2-vCPU Intel Xeon, SmolLM2 Q8_0 212.3 → 226.6 tok/s, Q4_1 355.6 → 370.8 (medians of
        // four runs, alternating).
        let next = ahead.wrapping_add(b * bb);
        let ask = |i: usize| super::prefetch::lines_at_step::<L2>(next, lines, (i, 8));
        let dw = _mm512_cvtph_ps(_mm256_loadu_si256(blk as *const __m256i));
        let mw = if min {
            _mm512_cvtph_ps(_mm256_loadu_si256(blk.add(2 * GROUP) as *const __m256i))
        } else {
            _mm512_setzero_ps()
        };
        // Vector i: elements 4i..4i+4 of the block, every row (Q4: bytes 4j..4j+4 carry
        // elements 4j.. in their low nibbles and 16 + 4j.. in their high ones).
        let q = blk.add(quants) as *const __m512i;
        let mut wv = [_mm512_setzero_si512(); 8];
        if F == Q8_0 {
            for (i, v) in wv.iter_mut().enumerate() {
                *v = _mm512_loadu_si512(q.add(i));
                ask(i);
            }
        } else {
            for j in 0..4 {
                let c = _mm512_loadu_si512(q.add(j));
                wv[j] = _mm512_and_si512(c, nibble);
                wv[j + 4] = _mm512_and_si512(_mm512_srli_epi16::<4>(c), nibble);
                ask(2 * j);
                ask(2 * j + 1);
            }
            if F == Q5_0 || F == Q5_1 {
                // The fifth bits: 16 added to the bytes mask `i` marks.
                let m = blk.add(masks) as *const u64;
                for (i, v) in wv.iter_mut().enumerate() {
                    let k: __mmask64 = std::ptr::read_unaligned(m.add(i));
                    *v = _mm512_mask_add_epi8(*v, k, *v, sixteen);
                }
            }
        }
        // Indexed by a constant range, so the tokens unroll and `acc` stays in registers.
        #[allow(clippy::needless_range_loop)]
        for t in 0..N {
            let xp = q8[t].add(b * BLOCK) as *const i32;
            // The stored quants' offset times Σx_q, taken back in integers (exact).
            let fix = -offset * *qsums[t].add(b);
            let mut ia = _mm512_set1_epi32(fix);
            let sum = if N == 1 {
                // One token: two chains, so the eight dependent products do not wait in line.
                let mut odd = _mm512_setzero_si512();
                for i in (0..8).step_by(2) {
                    let x0 = _mm512_set1_epi32(std::ptr::read_unaligned(xp.add(i)));
                    let x1 = _mm512_set1_epi32(std::ptr::read_unaligned(xp.add(i + 1)));
                    ia = _mm512_dpbusd_epi32(ia, wv[i], x0);
                    odd = _mm512_dpbusd_epi32(odd, wv[i + 1], x1);
                }
                _mm512_add_epi32(ia, odd)
            } else {
                // Several tokens' chains interleave already.
                for (i, w) in wv.iter().enumerate() {
                    let xi = _mm512_set1_epi32(std::ptr::read_unaligned(xp.add(i)));
                    ia = _mm512_dpbusd_epi32(ia, *w, xi);
                }
                ia
            };
            let sum = _mm512_cvtepi32_ps(sum);
            let s = _mm512_mul_ps(dw, _mm512_set1_ps(*ds[t].add(b)));
            acc[t] = _mm512_fmadd_ps(sum, s, acc[t]);
            if min {
                acc[t] = _mm512_fmadd_ps(mw, _mm512_set1_ps(*sums[t].add(b)), acc[t]);
            }
        }
    }
    acc
}

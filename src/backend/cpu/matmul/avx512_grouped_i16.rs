//! The AVX512-VNNI kernel of [`super::grouped_i16`]: 16-bit activations against grouped Q4_0,
//! Q4_1, Q5_0, Q8_0 and Q4_K weights (Q4_K's 32-element sub-blocks as Q4_1 blocks,
//! [`k4_chunk`]), the 16 output rows in the 16 lanes of every vector, each (row, token) the
//! chain of [`super::grouped_i16::rows_ref`] bit for bit.
//!
//! Per group and block: the quants in eight vectors of byte lanes, four elements of each row in
//! its lane in the order of the activations' [`Split`] bytes (4-bit: four 64-byte loads, each
//! unpacked by a mask (the even elements) and a 16-bit shift and a mask (the odd ones); Q5_0 as
//! 4-bit, then per vector a mask load from its plane and a masked add of 16; Q8_0,
//! stored element-major: eight loads and eight two-source byte permutes (`vpermt2b`, AVX512-VBMI)
//! that gather each row's bytes into its lane), then per token 16 `vpdpbusd` against the
//! block's broadcast activation bytes, one shift and add to join the high and low bytes' sums,
//! one conversion, one multiply and one or two FMAs. 24-bit activations ([`Width::Int24`]) take
//! eight more `vpdpbusd` (the middle bytes), and their high and low sums are joined by two
//! conversions and an FMA.

use std::arch::x86_64::*;
use std::sync::OnceLock;

use super::avx512_groups::{drive, each_token, GroupPass};
use super::grouped::{
    elems, group_block_bytes, quants_at, value_offset, Grouped, BLOCK, GROUP, K4_DMIN, K4_MINS,
    K4_QUANTS, K4_SCALES, K4_SUB, K4_SUB_BYTES, PLANE_AT,
};
use super::grouped_i16::{takes, Split, Width};
use super::prefetch::{line_to, lines_at_step, with_hint};
use super::Job;
use crate::backend::cpu::simd::{self, Level};
use crate::model::quant::QuantKind;

/// Whether this CPU runs the kernel on Q4_0 and Q4_1: AVX-512 F/BW/VL and VNNI, at the kernels'
/// SIMD level.
pub(crate) fn available() -> bool {
    static VNNI: OnceLock<bool> = OnceLock::new();
    *VNNI.get_or_init(|| is_x86_feature_detected!("avx512vnni")) && simd::level() >= Level::Avx512
}

/// Whether it runs it on Q8_0 too, whose bytes it gathers with AVX512-VBMI's `vpermt2b` (CPUs
/// with VNNI but not VBMI, such as Cascade Lake, leave Q8_0 to the exact kernels).
pub(crate) fn gathers() -> bool {
    static VBMI: OnceLock<bool> = OnceLock::new();
    *VBMI.get_or_init(|| is_x86_feature_detected!("avx512vbmi")) && available()
}

/// `x` (whole blocks) rounded to integers of `width` as [`super::grouped_i16::split_ref`]
/// rounds it (the same scale, `vcvtps2dq`'s nearest-even rounding, the same clamp) and cut into
/// the bytes of a [`Split`] one block at a time, on CPUs without AVX512-VBMI (elsewhere
/// [`super::avx512_split`] does it for sixteen blocks at once, in well under half the time):
/// `vpmovdb` of each integer and of each of its higher bytes, each word's eight bytes put in the
/// kernel's order (even elements, then odd) by one `vpshufb`. The block sums are the
/// reference's ([`super::block_sum`]). Written into `out`'s buffers (a spent split's, or empty
/// ones), every value set afresh.
///
/// # Safety
/// The CPU must have AVX-512 F/BW/VL; `x` is whole blocks.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
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
    let inf = _mm512_set1_ps(f32::INFINITY);
    let (qmax, qmin) = (
        _mm512_set1_epi32(width.qmax()),
        _mm512_set1_epi32(-width.qmax()),
    );
    let top = _mm_cvtsi32_si128(width.top_shift() as i32);
    let below = _mm512_set1_epi32((1 << width.top_shift()) - 1);
    // Within each 8-byte word: elements 0, 2, 4, 6, then 1, 3, 5, 7 (`super::grouped_i16::split_at`).
    let order = _mm256_setr_epi8(
        0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15, 0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12,
        14, 9, 11, 13, 15,
    );
    for b in 0..nb {
        // The reference's sum ([`super::block_sum`]): a scalar chain that runs beside the
        // block's vector work. Summed in a pass of its own, as before, the split of a 576-wide
        // row took 0.83 µs instead of 0.73 (one core of the Intel Xeon family 6 model 207, best
        // of 2,000 calls).
        sums[b] = super::block_sum(&x[b * BLOCK..(b + 1) * BLOCK]);
        let p = x.as_ptr().add(b * BLOCK);
        let (lo, hi) = (_mm512_loadu_ps(p), _mm512_loadu_ps(p.add(16)));
        let al = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(lo), abs));
        let ah = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(hi), abs));
        let finite =
            _mm512_cmp_ps_mask::<_CMP_LT_OQ>(al, inf) & _mm512_cmp_ps_mask::<_CMP_LT_OQ>(ah, inf);
        if finite != 0xffff {
            // The reference's NaN scale and zero integers (its bytes are already zero).
            d[b] = f32::NAN;
            continue;
        }
        let amax = _mm512_reduce_max_ps(_mm512_max_ps(al, ah));
        let (db, id) = super::block_scale(amax, width.qmax() as f32);
        d[b] = db;
        let id = _mm512_set1_ps(id);
        let clamp = |q: __m512i| _mm512_max_epi32(_mm512_min_epi32(q, qmax), qmin);
        let ql = clamp(_mm512_cvtps_epi32(_mm512_mul_ps(lo, id)));
        let qh = clamp(_mm512_cvtps_epi32(_mm512_mul_ps(hi, id)));
        lsums[b] = _mm512_reduce_add_epi32(_mm512_add_epi32(
            _mm512_and_si512(ql, below),
            _mm512_and_si512(qh, below),
        ));
        let (tl, th) = (_mm512_sra_epi32(ql, top), _mm512_sra_epi32(qh, top));
        hsums[b] = _mm512_reduce_add_epi32(_mm512_add_epi32(tl, th));
        let dst = bytes.as_mut_ptr().add(b * bb) as *mut __m256i;
        for plane in 0..planes {
            let shift = _mm_cvtsi32_si128(8 * plane as i32);
            let (pl, ph) = (_mm512_sra_epi32(ql, shift), _mm512_sra_epi32(qh, shift));
            let v = _mm256_set_m128i(_mm512_cvtepi32_epi8(ph), _mm512_cvtepi32_epi8(pl));
            _mm256_storeu_si256(dst.add(plane), _mm256_shuffle_epi8(v, order));
        }
    }
}

/// Every output of `job` over grouped `w` ([`takes`]) with activations `x` (one per token).
///
/// # Safety
/// [`available`] must hold ([`gathers`] for Q8_0, which [`takes`] checks); `job`'s output must
/// be valid for writes at `t·ldo + n` for every token and row of the job, its bias (if any) for
/// reads up to `w.rows`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")]
pub(crate) unsafe fn rows(w: &Grouped, x: &[Split], job: &Job) {
    assert!(takes(w), "{} has no grouped int16 products", w.kind.name());
    assert!(
        x.len() >= job.tokens,
        "{} activation rows for {} tokens",
        x.len(),
        job.tokens
    );
    let width = x.first().map_or(Width::Int16, |s| s.width);
    assert!(
        x.iter().all(|s| s.width == width),
        "activation rows of mixed widths"
    );
    match (w.kind, width) {
        (QuantKind::Q4_0, Width::Int16) => rows_of::<Q4_0, false>(w, x, job),
        (QuantKind::Q4_0, Width::Int24) => rows_of::<Q4_0, true>(w, x, job),
        (QuantKind::Q4_1, Width::Int16) => rows_of::<Q4_1, false>(w, x, job),
        (QuantKind::Q4_1, Width::Int24) => rows_of::<Q4_1, true>(w, x, job),
        (QuantKind::Q5_0, Width::Int16) => rows_of::<Q5_0, false>(w, x, job),
        (QuantKind::Q5_0, Width::Int24) => rows_of::<Q5_0, true>(w, x, job),
        (QuantKind::Q4_K, Width::Int16) => rows_of::<Q4_K, false>(w, x, job),
        (QuantKind::Q4_K, Width::Int24) => rows_of::<Q4_K, true>(w, x, job),
        // SAFETY: `takes` held, so for Q8_0 the CPU has VBMI.
        _ => rows_q8(w, x, job, width),
    }
}

/// [`rows`] on Q8_0, with AVX512-VBMI for its gathers.
///
/// # Safety
/// As [`rows`], and [`gathers`] must hold.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,f16c,fma")]
unsafe fn rows_q8(w: &Grouped, x: &[Split], job: &Job, width: Width) {
    match width {
        Width::Int16 => rows_of::<Q8_0, false>(w, x, job),
        Width::Int24 => rows_of::<Q8_0, true>(w, x, job),
    }
}

/// The formats as the kernel's const parameter.
const Q4_0: u8 = 0;
const Q4_1: u8 = 1;
const Q8_0: u8 = 2;
/// In [`Layout::Planes`](super::grouped::Layout::Planes).
const Q5_0: u8 = 3;
/// Its 256-element super-blocks, each sub-block of 32 as a Q4_1 block.
const Q4_K: u8 = 4;

/// The format a const parameter stands for.
const fn kind_of(f: u8) -> QuantKind {
    match f {
        Q4_0 => QuantKind::Q4_0,
        Q4_1 => QuantKind::Q4_1,
        Q5_0 => QuantKind::Q5_0,
        Q4_K => QuantKind::Q4_K,
        _ => QuantKind::Q8_0,
    }
}

#[inline(always)]
unsafe fn rows_of<const F: u8, const WIDE: bool>(w: &Grouped, x: &[Split], job: &Job) {
    let nb = w.cols / elems(kind_of(F));
    let bb = group_block_bytes(kind_of(F));
    with_hint!(L2 => {
        let kernel = Pass::<F, WIDE, L2> { nb, bb, x };
        drive(&kernel, w.bytes.as_ptr(), nb * bb, job)
    })
}

/// [`chunk`] as the shared group loop's pass, on 24-bit activations where `WIDE`, prefetching
/// into L2 (`L2`) or L1.
struct Pass<'a, const F: u8, const WIDE: bool, const L2: bool> {
    /// Blocks per row, and bytes per group block.
    nb: usize,
    bb: usize,
    /// Every token's activations.
    x: &'a [Split],
}

impl<const F: u8, const WIDE: bool, const L2: bool> GroupPass for Pass<'_, F, WIDE, L2> {
    #[inline(always)]
    unsafe fn pass<const N: usize>(
        &self,
        base: *const u8,
        ahead: *const u8,
        t0: usize,
    ) -> [__m512; N] {
        chunk::<F, WIDE, N, L2>(self, base, ahead, &self.x[t0..t0 + N])
    }
}

/// The 16 bytes at `p` as f32 (a Q4_K sub-block's 16 rows' scales or mins). A function, not a
/// closure: a closure is compiled without the kernel's `#[target_feature]`s unless LLVM
/// chooses to inline it.
#[inline(always)]
unsafe fn bytes_f32(p: *const u8) -> __m512 {
    _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(p as *const __m128i)))
}

/// [`chunk`] for Q4_K: per super-block its 16 rows' `d` and `dmin`, then per sub-block `j` (the
/// activations' block `8b + j`) the quants as a Q4_1 block's, the integer sum `S` as theirs, and
/// `acc ← fma(S, (d·sc_j)·d_x, acc)`, `acc ← fma(−dmin·m_j, Σx_j, acc)` (`d·sc_j` and `dmin·m_j`
/// exact in f32, as the exact kernels take them).
#[inline(always)]
unsafe fn k4_chunk<const WIDE: bool, const N: usize, const L2: bool>(
    nb: usize,
    base: *const u8,
    ahead: *const u8,
    x: &[Split],
) -> [__m512; N] {
    let xb: [*const u8; N] = std::array::from_fn(|t| x[t].bytes.as_ptr());
    let ds: [*const f32; N] = std::array::from_fn(|t| x[t].d.as_ptr());
    let sums: [*const f32; N] = std::array::from_fn(|t| x[t].sums.as_ptr());
    let split_bytes = if WIDE { Width::Int24 } else { Width::Int16 }.block_bytes();
    let mut acc = [_mm512_setzero_ps(); N];
    let nibble = _mm512_set1_epi8(0x0f);
    let bb = group_block_bytes(QuantKind::Q4_K);
    for b in 0..nb {
        let blk = base.add(b * bb);
        let next = ahead.wrapping_add(b * bb);
        let d = _mm512_cvtph_ps(_mm256_loadu_si256(blk as *const __m256i));
        let dmin = _mm512_cvtph_ps(_mm256_loadu_si256(blk.add(K4_DMIN) as *const __m256i));
        for j in 0..K4_SUB {
            let (d1, m1) = (
                _mm512_mul_ps(d, bytes_f32(blk.add(K4_SCALES + GROUP * j))),
                _mm512_mul_ps(dmin, bytes_f32(blk.add(K4_MINS + GROUP * j))),
            );
            let neg_m1 = _mm512_castsi512_ps(_mm512_xor_si512(
                _mm512_castps_si512(m1),
                _mm512_set1_epi32(i32::MIN),
            ));
            if j * 64 < K4_QUANTS {
                // Its scales, mins and the super-block's `d`s, a line a sub-block.
                line_to::<L2>(next.wrapping_add(64 * j));
            }
            let q = blk.add(K4_QUANTS + j * K4_SUB_BYTES) as *const __m512i;
            let mut sw = [_mm512_setzero_si512(); 8];
            for w in 0..4 {
                let c = _mm512_loadu_si512(q.add(w));
                sw[2 * w] = _mm512_and_si512(c, nibble);
                sw[2 * w + 1] = _mm512_and_si512(_mm512_srli_epi16::<4>(c), nibble);
                // The next group's same sub-block, a line per vector (branch-free: spread
                // over the 64 steps of a super-block by `lines_at_step`, whose ranges are not
                // constants in this loop, the branches cost about as much as the products).
                line_to::<L2>(next.wrapping_add(K4_QUANTS + j * K4_SUB_BYTES + 64 * w));
            }
            let sub = b * K4_SUB + j;
            each_token!(N, |t| {
                let xt = xb[t].add(sub * split_bytes);
                let s = block_sum::<WIDE, true>((&sw, &sw), xt, (0, 0));
                let scale = _mm512_mul_ps(d1, _mm512_set1_ps(*ds[t].add(sub)));
                acc[t] = _mm512_fmadd_ps(s, scale, acc[t]);
                acc[t] = _mm512_fmadd_ps(neg_m1, _mm512_set1_ps(*sums[t].add(sub)), acc[t]);
            });
        }
    }
    acc
}

/// The block's sums `Σ w·q` of the 16 rows for one token, as f32: over the eight quant vectors
/// (vector `i`: the elements of dword `i` of each plane of the token's [`Split`] bytes `xb`), the
/// quants as the signed side against the unsigned low (and, where `WIDE`, middle) bytes (`sw`)
/// and as the unsigned side against the signed top bytes (`uw`: Q8_0's offset by 128, taken
/// back in `fix_h`), the low and top sums starting from `fix_l`/`fix_h`. 16 bits: `256·Σ w·h +
/// Σ w·l`, exact in i32, converted once; 24 bits: `fma(float(Σ w·h), 65536, float(256·Σ w·m +
/// Σ w·l))`.
#[inline(always)]
unsafe fn block_sum<const WIDE: bool, const CHAINS: bool>(
    (sw, uw): (&[__m512i; 8], &[__m512i; 8]),
    xb: *const u8,
    (fix_l, fix_h): (i32, i32),
) -> __m512 {
    let lo = xb as *const i32;
    let mid = xb.add(BLOCK) as *const i32;
    let hi = xb.add(if WIDE { 2 * BLOCK } else { BLOCK }) as *const i32;
    // A macro, not a closure: a closure is compiled without the kernel's `#[target_feature]`s
    // unless LLVM chooses to inline it.
    macro_rules! word {
        ($p:expr, $i:expr) => {
            _mm512_set1_epi32(std::ptr::read_unaligned($p.add($i)))
        };
    }
    let mut l = _mm512_set1_epi32(fix_l);
    let mut h = _mm512_set1_epi32(fix_h);
    let mut m = _mm512_setzero_si512();
    if CHAINS {
        // Two chains a plane, so the dependent products do not wait in line (one chain a
        // plane ran the one-token Q4_1 kernel 5% slower on one core of the Intel Xeon).
        let (mut l1, mut h1, mut m1) = (
            _mm512_setzero_si512(),
            _mm512_setzero_si512(),
            _mm512_setzero_si512(),
        );
        for i in (0..8).step_by(2) {
            l = _mm512_dpbusd_epi32(l, word!(lo, i), sw[i]);
            h = _mm512_dpbusd_epi32(h, uw[i], word!(hi, i));
            if WIDE {
                m = _mm512_dpbusd_epi32(m, word!(mid, i), sw[i]);
            }
            l1 = _mm512_dpbusd_epi32(l1, word!(lo, i + 1), sw[i + 1]);
            h1 = _mm512_dpbusd_epi32(h1, uw[i + 1], word!(hi, i + 1));
            if WIDE {
                m1 = _mm512_dpbusd_epi32(m1, word!(mid, i + 1), sw[i + 1]);
            }
        }
        l = _mm512_add_epi32(l, l1);
        h = _mm512_add_epi32(h, h1);
        m = _mm512_add_epi32(m, m1);
    } else {
        for i in 0..8 {
            l = _mm512_dpbusd_epi32(l, word!(lo, i), sw[i]);
            h = _mm512_dpbusd_epi32(h, uw[i], word!(hi, i));
            if WIDE {
                m = _mm512_dpbusd_epi32(m, word!(mid, i), sw[i]);
            }
        }
    }
    if WIDE {
        let low = _mm512_add_epi32(_mm512_slli_epi32::<8>(m), l);
        _mm512_fmadd_ps(
            _mm512_cvtepi32_ps(h),
            _mm512_set1_ps(65536.0),
            _mm512_cvtepi32_ps(low),
        )
    } else {
        _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32::<8>(h), l))
    }
}

/// The `vpermt2b` indices that gather Q8_0 quants into vector `2w + parity`'s lanes: lane `r`'s
/// byte `j` is element `8w + 2j + parity` of row `r`, at byte `16·(2j + parity) + r` of the two
/// 64-byte vectors holding elements `8w .. 8w + 8` (the [`Split`] order).
const fn q8_gather(parity: usize) -> [u8; 64] {
    let mut idx = [0u8; 64];
    let mut i = 0;
    while i < 64 {
        let (r, j) = (i / 4, i % 4);
        idx[i] = (16 * (2 * j + parity) + r) as u8;
        i += 1;
    }
    idx
}

/// [`q8_gather`] of the even and the odd elements.
static Q8_GATHER: [[u8; 64]; 2] = [q8_gather(0), q8_gather(1)];

/// One group's 16 outputs for `N` tokens.
#[inline(always)]
unsafe fn chunk<const F: u8, const WIDE: bool, const N: usize, const L2: bool>(
    p: &Pass<'_, F, WIDE, L2>,
    base: *const u8,
    ahead: *const u8,
    x: &[Split],
) -> [__m512; N] {
    assert!(
        x.len() == N,
        "{} activation rows for a chunk of {N}",
        x.len()
    );
    if F == Q4_K {
        return k4_chunk::<WIDE, N, L2>(p.nb, base, ahead, x);
    }
    let kind = kind_of(F);
    let xb: [*const u8; N] = std::array::from_fn(|t| x[t].bytes.as_ptr());
    let ds: [*const f32; N] = std::array::from_fn(|t| x[t].d.as_ptr());
    let sums: [*const f32; N] = std::array::from_fn(|t| x[t].sums.as_ptr());
    let lsums: [*const i32; N] = std::array::from_fn(|t| x[t].lsums.as_ptr());
    // A block's bytes in each token's `Split` (a constant of `WIDE`).
    let split_bytes = if WIDE { Width::Int24 } else { Width::Int16 }.block_bytes();
    let hsums: [*const i32; N] = std::array::from_fn(|t| x[t].hsums.as_ptr());
    let mut acc = [_mm512_setzero_ps(); N];
    let nibble = _mm512_set1_epi8(0x0f);
    let sixteen = _mm512_set1_epi8(16);
    let flip = _mm512_set1_epi8(-128);
    let even = _mm512_loadu_si512(Q8_GATHER[0].as_ptr() as *const __m512i);
    let odd = _mm512_loadu_si512(Q8_GATHER[1].as_ptr() as *const __m512i);
    let qa = quants_at(kind);
    let off = value_offset(kind);
    // A constant, so that each step's lines are constant offsets.
    let lines = group_block_bytes(kind).div_ceil(64);
    for b in 0..p.nb {
        let blk = base.add(b * p.bb);
        // The same block of the next group, a line at a time between the quants' loads (as the
        // exact and int8 kernels ask for it).
        let next = ahead.wrapping_add(b * p.bb);
        let ask = |i: usize| lines_at_step::<L2>(next, lines, (i, 8));
        let dw = _mm512_cvtph_ps(_mm256_loadu_si256(blk as *const __m256i));
        let q = blk.add(qa) as *const __m512i;
        let mut sw = [_mm512_setzero_si512(); 8];
        let mut uw = [_mm512_setzero_si512(); 8];
        if F == Q8_0 {
            for w in 0..4 {
                let (a, c) = (
                    _mm512_loadu_si512(q.add(2 * w)),
                    _mm512_loadu_si512(q.add(2 * w + 1)),
                );
                sw[2 * w] = _mm512_permutex2var_epi8(a, even, c);
                sw[2 * w + 1] = _mm512_permutex2var_epi8(a, odd, c);
                uw[2 * w] = _mm512_xor_si512(sw[2 * w], flip);
                uw[2 * w + 1] = _mm512_xor_si512(sw[2 * w + 1], flip);
                ask(2 * w);
                ask(2 * w + 1);
            }
        } else {
            for w in 0..4 {
                let c = _mm512_loadu_si512(q.add(w));
                sw[2 * w] = _mm512_and_si512(c, nibble);
                sw[2 * w + 1] = _mm512_and_si512(_mm512_srli_epi16::<4>(c), nibble);
                ask(2 * w);
                ask(2 * w + 1);
            }
            if F == Q5_0 {
                // The plane's qword `v` has a bit for each byte lane of vector `v`: 16 added
                // where it is set.
                let plane = blk.add(PLANE_AT) as *const u64;
                for (v, s) in sw.iter_mut().enumerate() {
                    let fifth: __mmask64 = std::ptr::read_unaligned(plane.add(v));
                    *s = _mm512_mask_add_epi8(*s, fifth, *s, sixteen);
                }
            }
            uw = sw;
        }
        let mw = if F == Q4_1 {
            _mm512_cvtph_ps(_mm256_loadu_si256(blk.add(2 * GROUP) as *const __m256i))
        } else {
            _mm512_setzero_ps()
        };
        // Unrolled by hand, so that `acc` stays in registers.
        each_token!(N, |t| {
            let fix = match F {
                Q4_0 | Q5_0 => (off * *lsums[t].add(b), off * *hsums[t].add(b)),
                Q8_0 => (0, -128 * *hsums[t].add(b)),
                _ => (0, 0),
            };
            let xt = xb[t].add(b * split_bytes);
            // Two chains a plane for one token, and for the 4-bit formats at every count;
            // Q8_0, whose signed and offset quants take sixteen registers, keeps one chain a
            // plane for several tokens (two spilled at 16 bits: one core of the Intel Xeon
            // family 6 model 207, 16 tokens 87.6 against 82.9 G multiply-adds/s, where Q4_1
            // went from 84.6 to 100.8 with two).
            let s = if N == 1 || F != Q8_0 {
                block_sum::<WIDE, true>((&sw, &uw), xt, fix)
            } else {
                block_sum::<WIDE, false>((&sw, &uw), xt, fix)
            };
            let scale = _mm512_mul_ps(dw, _mm512_set1_ps(*ds[t].add(b)));
            acc[t] = _mm512_fmadd_ps(s, scale, acc[t]);
            if F == Q4_1 {
                acc[t] = _mm512_fmadd_ps(mw, _mm512_set1_ps(*sums[t].add(b)), acc[t]);
            }
        });
    }
    acc
}

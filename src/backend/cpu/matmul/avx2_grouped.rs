//! The AVX2 kernels of [`super::grouped`]: up to [`MAX_TOKENS`] tokens against the weights that
//! [`super::avx512_grouped`] reads, each 16-row group taken as two halves of eight rows (the
//! first and last 32 bytes of every 64-byte quant word, the first and last 8 entries of every
//! 16-entry scale row), each (row, token) the chain of [`super::grouped::rows_ref`] bit for bit;
//! and the exact dequantization of grouped rows into prefill tiles.
//!
//! **Why.** On AVX2 the GEMVs on blocks as stored ([`super::avx2`]) sum each row's block in
//! four vectors, then reduce across lanes and scale per row: one core of an Intel Xeon (family 6
//! model 207) ran Q4_1 at 7.2 GiB/s and Q5_0 at 5.8 (`cargo bench --bench kernels --
//! 'gemv/.*/avx2'`), about half of what each of two cores must read for decode to be bound by
//! memory. With the rows in the lanes nothing is reduced or broadcast per row.
//!
//! **Per element**, for eight rows: the field extracted and converted (AVX2's `vpermps` indexes
//! only eight entries, so there is no table), with the format's offset taken in the integer
//! domain first (exact). 4-bit words are read at byte offsets 0–3 as the AVX-512 kernels read
//! them, so a byte's low nibble needs only a mask; a high nibble is taken in place, as 16 times
//! its value, against activations whose odd elements were divided by 16 once per call
//! ([`Activations`]). A 5- or 6-bit field is shifted to the top of its lane and back down, the
//! offset coming with an arithmetic shift ([`top`]). Then one FMA per token with the broadcast
//! activation. The 16 registers hold four quarter chains and an accumulator for two tokens of
//! one half at a time ([`PAIRS`]); the quarter chains are held to the run's end and fed
//! quarter-interleaved (`0, 8, 16, 24, 1, 9, …`: one element of each quarter in turn), so that
//! consecutive FMAs are independent. Until 2026-11-29 the Q5, Q6_K and Q8_0 fields went in
//! element order, eight dependent FMAs per quarter in a row; interleaved, one core of the 2-vCPU
//! AMD EPYC (Zen 3) ran Q8_0 1536 × 576 at 15.3–15.6 → 19.0–19.1 GiB/s, Q5_0 1536 × 576
//! 7.1–7.3 → 8.6–8.7 and Q6_K 896 × 4864 8.0–8.2 → 8.5–8.7 (weights in cache, best of 60 × 10
//! calls). A pass over both halves of one token (two chains of registers, every word loaded first)
//! spilled: Q4_1 ran 8.4 GiB/s where two passes ran 9.6. With each word loaded where it is used it
//! does not, and one token's full groups of the 4-bit formats and Q8_0 take it ([`pass_both`]).
//!
//! These kernels read the streams layout, what AVX-512 CPUs hold; engines on AVX2 CPUs hold
//! Q4_0, Q4_1, Q4_K and Q5_0 in [`Layout::Halves`], which [`rows`] hands to
//! [`super::avx2_halves`].
//!
//! Nothing here takes a closure (see [`super::avx512_groups`]).

use std::arch::x86_64::*;

use super::grouped::format::{kind_of, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q6_K, Q8_0};
use super::grouped::{
    block_ahead, elems, fields, group_block_bytes, group_spans, halves_place, job_sums,
    prefetch_part, quants_at, value_offset, GroupSpan, Grouped, Layout, BLOCK, GROUP, K4_DMIN,
    K4_MINS, K4_QUANTS, K4_SCALES, K4_SUB, K4_SUB_BYTES, K6_PAIR_BYTES, K6_QUANTS, K6_SCALES,
    K6_SUB, MAX_TOKENS,
};
use super::int8::has_min;
use super::Job;
use crate::model::quant::QuantKind;

/// Rows per half group: the lanes of a 256-bit vector.
pub(crate) const LANES: usize = 8;

/// Tokens per pass: four quarter chains and an accumulator each, ten of the 16 registers, the
/// rest for the activations, masks and fields in flight.
const PAIRS: usize = 2;

/// Outputs `job.rows` for `job.tokens` (at most [`MAX_TOKENS`]) tokens from grouped weights.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; `job`'s output must be valid for writes at
/// `t·ldo + n` for every token and row of the job, its input for reads of `w.cols` values per
/// token, its bias (if any) for reads up to `w.rows`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn rows(w: &Grouped, job: &Job) {
    assert!(
        job.tokens <= MAX_TOKENS,
        "{} tokens for the grouped kernel",
        job.tokens
    );
    if w.layout == Layout::Halves {
        return super::avx2_halves::rows(w, job);
    }
    match w.kind {
        QuantKind::Q4_0 => rows_of::<Q4_0>(w, job),
        QuantKind::Q4_1 => rows_of::<Q4_1>(w, job),
        QuantKind::Q5_0 => rows_of::<Q5_0>(w, job),
        QuantKind::Q5_1 => rows_of::<Q5_1>(w, job),
        QuantKind::Q8_0 => rows_of::<Q8_0>(w, job),
        QuantKind::Q4_K => rows_of::<Q4_K>(w, job),
        QuantKind::Q6_K => rows_of::<Q6_K>(w, job),
        k => unreachable!("{} is never grouped", k.name()),
    }
}

/// What every pass over a matrix shares.
struct Matrix<'a> {
    /// Blocks (K formats: super-blocks) per row.
    nb: usize,
    /// Token 0's activations as the passes read them (the job's, or those of [`Activations`]),
    /// and the distance between tokens.
    x: *const f32,
    ldx: usize,
    /// Every token's block sums, token `t`'s at `t·blocks` (empty without a min).
    sums: &'a [f32],
    /// 32-element blocks per token row.
    blocks: usize,
}

impl Matrix<'_> {
    /// Token `t`'s activations and block sums (the latter never read without a min).
    #[inline(always)]
    unsafe fn token(&self, t: usize) -> (*const f32, *const f32) {
        (
            self.x.add(t * self.ldx),
            self.sums.as_ptr().wrapping_add(t * self.blocks),
        )
    }
}

/// Whether the format's high nibbles are taken in place (see [`Activations`]).
const fn high_in_place(kind: QuantKind) -> bool {
    matches!(kind, QuantKind::Q4_0 | QuantKind::Q4_1 | QuantKind::Q4_K)
}

/// One call's activations as the kernels of the 4-bit formats read them, made once per call
/// and shared by its tasks (made per task, they cost more than the kernels gained).
///
/// **Why.** A 4-bit field in the high nibble of its byte is `16·q` once masked with `0xF0`;
/// `16·q · x/16` is `q·x` exactly, so the fused multiply-add rounds the same sum, and the shift
/// that brought the nibble down is gone: one of seven vector operations per two elements and
/// eight rows, all of which compete for Zen 3's four FP pipes. One core of the 2-vCPU AMD EPYC
/// (Zen 3), best of 40 calls on weights in cache, one token: Q4_1 1536 × 576 9.8 → 10.4 GiB/s,
/// Q4_0 7.9 → 8.7, Q4_K 896 × 4864 9.3 → 9.7. SmolLM2's decode steps on that machine did not
/// get measurably faster: their GEMVs, reading weights from memory, wait on it.
pub(crate) struct Activations {
    /// Every token's activations, token `t`'s at `t·k`, each odd element divided by 16; `None`
    /// where a division would round (see [`scaled_exact`]) or no part is in a 4-bit format.
    high: Option<Vec<f32>>,
    /// Every token's activations, token `t`'s at `t·k`, element `e` of each block divided by
    /// `2^halves_place(kind, e)`, for the 4-bit formats (`halves4`) and Q5_0 (`halves5`) in
    /// [`Layout::Halves`] ([`super::avx2_halves`]); `None` where a division would round or no
    /// part is in that layout.
    halves4: Option<Vec<f32>>,
    halves5: Option<Vec<f32>>,
}

impl Activations {
    /// What kernels on `kinds` (each part's format and layout) need of the `tokens` rows of `k`
    /// values at `x`, `ldx` apart.
    pub(crate) fn new(
        kinds: impl Iterator<Item = (QuantKind, Layout)>,
        x: &[f32],
        ldx: usize,
        tokens: usize,
        k: usize,
    ) -> Activations {
        let (mut high, mut halves4, mut halves5) = (false, false, false);
        for (kind, layout) in kinds {
            let halves = layout == Layout::Halves;
            high |= high_in_place(kind) && !halves;
            halves4 |= halves && kind != QuantKind::Q5_0;
            halves5 |= halves && kind == QuantKind::Q5_0;
        }
        let none = Activations {
            high: None,
            halves4: None,
            halves5: None,
        };
        if tokens == 0 || x.len() < (tokens - 1) * ldx + k {
            return none;
        }
        let rows = || (0..tokens).map(|t| &x[t * ldx..t * ldx + k]);
        let scaled = |place: fn(usize) -> u32| {
            let mut v = Vec::with_capacity(tokens * k);
            for row in rows() {
                v.extend(
                    row.iter()
                        .enumerate()
                        .map(|(e, &x)| x * (1.0 / (1u32 << place(e % BLOCK)) as f32)),
                );
            }
            v
        };
        Activations {
            high: (high && scaled_exact(rows(), 4, |e| e % 2 == 1))
                .then(|| scaled(|e| 4 * (e % 2) as u32)),
            halves4: (halves4 && scaled_exact(rows(), 12, |e| e % 4 > 0))
                .then(|| scaled(|e| halves_place(QuantKind::Q4_0, e))),
            halves5: (halves5
                && scaled_exact(rows(), 10, |e| halves_place(QuantKind::Q5_0, e % BLOCK) > 0))
            .then(|| scaled(|e| halves_place(QuantKind::Q5_0, e))),
        }
    }

    /// The call's activations as `job` carries them, or (a caller that made none: a test) made
    /// here for `w` into `own`.
    ///
    /// # Safety
    /// `job`'s input must be valid for reads of `job.k` values per token.
    pub(crate) unsafe fn of_job<'a>(
        w: &Grouped,
        job: &Job<'a>,
        own: &'a mut Option<Activations>,
    ) -> &'a Activations {
        match job.xg {
            Some(a) => a,
            None => {
                let x = std::slice::from_raw_parts(job.x, (job.tokens - 1) * job.ldx + job.k);
                let once = std::iter::once((w.kind, w.layout));
                own.insert(Activations::new(once, x, job.ldx, job.tokens, job.k))
            }
        }
    }

    /// The divided activations that the halves kernel of `kind` reads, where they were made.
    pub(crate) fn halves(&self, kind: QuantKind) -> Option<&[f32]> {
        if kind == QuantKind::Q5_0 {
            self.halves5.as_deref()
        } else {
            self.halves4.as_deref()
        }
    }
}

/// Whether every activation whose element `e` is `divided(e)` divides by `2^bits` exactly:
/// is 0 (or not finite) or at least `2^(bits − 126)` in magnitude, so that the quotient is not
/// subnormal.
fn scaled_exact<'a>(
    mut rows: impl Iterator<Item = &'a [f32]>,
    bits: i32,
    divided: impl Fn(usize) -> bool,
) -> bool {
    let smallest = f32::MIN_POSITIVE * (1u32 << bits) as f32;
    rows.all(|row| {
        row.iter()
            .enumerate()
            .filter(|&(e, _)| divided(e))
            .all(|(_, &x)| x == 0.0 || x.is_nan() || x.abs() >= smallest)
    })
}

#[inline(always)]
unsafe fn rows_of<const F: u8>(w: &Grouped, job: &Job) {
    if job.tokens == 0 {
        return;
    }
    let mut own = None;
    let made = Activations::of_job(w, job, &mut own);
    match &made.high {
        Some(x) if high_in_place(kind_of(F)) => rows_with::<F, true>(w, job, x.as_ptr(), job.k),
        _ => rows_with::<F, false>(w, job, job.xptr(0), job.ldx),
    }
}

/// [`rows_of`] on the activations at `x` (tokens `ldx` apart): the job's own, or with `H` those
/// of [`Activations`], for high nibbles taken in place.
#[inline(always)]
unsafe fn rows_with<const F: u8, const H: bool>(w: &Grouped, job: &Job, x: *const f32, ldx: usize) {
    let kind = kind_of(F);
    let sums = job_sums(w, job);
    let blocks = w.cols / BLOCK;
    let m = Matrix {
        nb: w.cols / elems(kind),
        x,
        ldx,
        sums: &sums,
        blocks,
    };
    for span in group_spans(w, job.rows.clone()) {
        let GroupSpan {
            n0, lo, hi, base, ..
        } = span;
        // The first pass over a group fetches the bytes ahead as it goes.
        let mut ahead = span.ahead;
        if job.tokens == 1 && lo == 0 && hi == GROUP && both_halves(kind_of(F)) {
            let acc = pass_both::<F, H>(&m, base, ahead, m.token(0));
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
                let n = (job.tokens - t0).min(PAIRS);
                if n == 2 {
                    let acc = pass::<F, 2, H>(&m, base, ahead, h, [m.token(t0), m.token(t0 + 1)]);
                    store(job, t0, r0, lanes.clone(), &acc);
                } else {
                    let acc = pass::<F, 1, H>(&m, base, ahead, h, [m.token(t0)]);
                    store(job, t0, r0, lanes.clone(), &acc);
                }
                ahead = std::ptr::null();
                t0 += n;
            }
        }
    }
}

/// Writes tokens `t0..t0 + N`'s outputs `r0 + lane` for `lanes`, as [`Job::put`] does:
/// `(out + d) + bias` when accumulating, else `d + bias`.
#[inline(always)]
pub(crate) unsafe fn store<const N: usize>(
    job: &Job,
    t0: usize,
    r0: usize,
    lanes: std::ops::Range<usize>,
    acc: &[__m256; N],
) {
    let iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    let mask = _mm256_and_si256(
        _mm256_cmpgt_epi32(iota, _mm256_set1_epi32(lanes.start as i32 - 1)),
        _mm256_cmpgt_epi32(_mm256_set1_epi32(lanes.end as i32), iota),
    );
    let bias = job
        .bias
        .map(|b| _mm256_maskload_ps(b.as_ptr().add(r0), mask));
    for (t, &d) in acc.iter().enumerate() {
        let o = job.out.add((t0 + t) * job.ldo + r0);
        let mut v = d;
        if job.accumulate {
            v = _mm256_add_ps(_mm256_maskload_ps(o, mask), v);
        }
        if let Some(b) = bias {
            v = _mm256_add_ps(v, b);
        }
        _mm256_maskstore_ps(o, mask, v);
    }
}

/// The outputs of half `h` of the group at `base` for `N` tokens, each the block chain, asking
/// the bytes at `ahead` into the cache as it goes (null: none).
#[inline(always)]
unsafe fn pass<const F: u8, const N: usize, const H: bool>(
    m: &Matrix,
    base: *const u8,
    ahead: *const u8,
    h: usize,
    tokens: [(*const f32, *const f32); N],
) -> [__m256; N] {
    let kind = kind_of(F);
    let bb = group_block_bytes(kind);
    let x: [*const f32; N] = std::array::from_fn(|t| tokens[t].0);
    let s: [*const f32; N] = std::array::from_fn(|t| tokens[t].1);
    let mut acc = [_mm256_setzero_ps(); N];
    for b in 0..m.nb {
        let blk = base.add(b * bb);
        let next = block_ahead(ahead, b * bb);
        if F == Q4_K {
            k4_super_block::<N, H>(blk, b, h, &x, &s, &mut acc, next);
            continue;
        }
        if F == Q6_K {
            k6_super_block(blk, b, h, &x, &mut acc, next);
            continue;
        }
        prefetch_part(next, bb, 0, 1);
        let xb: [*const f32; N] = std::array::from_fn(|t| x[t].add(b * BLOCK));
        let mut c = Quarters::<N>::new(xb);
        values::<F, H, _>(blk.add(quants_at(kind)), h, &mut c);
        let d = half_f16(blk, h);
        for (t, a) in acc.iter_mut().enumerate() {
            *a = _mm256_fmadd_ps(d, c.sum(t), *a);
        }
        if has_min(kind) {
            let mv = half_f16(blk.add(2 * GROUP), h);
            for (t, a) in acc.iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(mv, _mm256_set1_ps(*s[t].add(b)), *a);
            }
        }
    }
    acc
}

/// Whether one token's full groups of `kind` go through [`pass_both`]: the 4-bit formats and
/// Q8_0. Q5 and Q6_K, whose fields span five or six words per half, were not tried: both
/// halves' words and the eight chains exceed the 16 registers, and words loaded anew at each
/// use (volatile loads, which LLVM does not merge; tried on Q4_1 with all low nibbles of a
/// byte position before the high ones) made Q4_1's pass slower.
const fn both_halves(kind: QuantKind) -> bool {
    matches!(
        kind,
        QuantKind::Q4_0 | QuantKind::Q4_1 | QuantKind::Q4_K | QuantKind::Q8_0
    )
}

/// Both halves of the group at `base` for one token in one pass (`[half 0, half 1]`), each the
/// block chain of [`pass`] bit for bit, asking the bytes at `ahead` into the cache as it goes
/// (null: none).
///
/// **Why.** A pass over one half broadcasts each activation for eight rows and has four
/// quarter chains in flight, whose FMAs wait on each other's four-cycle latency. Over both
/// halves each broadcast serves sixteen rows (seven vector operations per 4-bit element and
/// sixteen rows instead of eight) and eight chains are in flight. Each quant word is loaded
/// where it is used, so that the eight chains, two accumulators and the masks stay in the 16
/// registers. One core of the 2-vCPU AMD EPYC (Zen 3), weights in cache: Q4_1 1536 × 576
/// 10.2–10.5 → 12.8–13.0 GiB/s; Q8_0 1536 × 576 15.2–15.4 → 19.5–20.0 against its
/// quarter-interleaved two passes (that host's slower hour; 12.9–13.2 in element order). Q8_0
/// through this pass in element order (two chains at a time) had been 15–28% slower than two
/// passes.
#[inline(always)]
unsafe fn pass_both<const F: u8, const H: bool>(
    m: &Matrix,
    base: *const u8,
    ahead: *const u8,
    token: (*const f32, *const f32),
) -> [__m256; 2] {
    let kind = kind_of(F);
    let bb = group_block_bytes(kind);
    let (x, s) = token;
    let mut acc = [_mm256_setzero_ps(); 2];
    for b in 0..m.nb {
        let blk = base.add(b * bb);
        let next = block_ahead(ahead, b * bb);
        if F == Q4_K {
            for j in 0..K4_SUB {
                prefetch_part(next, bb, j, K4_SUB);
                let sub = b * K4_SUB + j;
                let p =
                    run_both::<Q4_1, H>(blk.add(K4_QUANTS + j * K4_SUB_BYTES), x.add(sub * BLOCK));
                for (h, a) in acc.iter_mut().enumerate() {
                    let (d1, m1) = k4_scales(blk, h, j);
                    *a = _mm256_fmadd_ps(d1, quarters_sum(&p, h), *a);
                    *a = _mm256_fnmadd_ps(m1, _mm256_set1_ps(*s.add(sub)), *a);
                }
            }
            continue;
        }
        prefetch_part(next, bb, 0, 1);
        let p = run_both::<F, H>(blk.add(quants_at(kind)), x.add(b * BLOCK));
        for (h, a) in acc.iter_mut().enumerate() {
            *a = _mm256_fmadd_ps(half_f16(blk, h), quarters_sum(&p, h), *a);
            if has_min(kind) {
                let mv = half_f16(blk.add(2 * GROUP), h);
                *a = _mm256_fmadd_ps(mv, _mm256_set1_ps(*s.add(b)), *a);
            }
        }
    }
    acc
}

/// Half `h`'s `(p_0 + p_1) + (p_2 + p_3)` of the chains `p[quarter][half]`.
#[inline(always)]
unsafe fn quarters_sum(p: &[[__m256; 2]; 4], h: usize) -> __m256 {
    _mm256_add_ps(
        _mm256_add_ps(p[0][h], p[1][h]),
        _mm256_add_ps(p[2][h], p[3][h]),
    )
}

/// The quarter chains `p[quarter][half]` of one 32-element run of both halves of a group (its
/// Q4_0/Q4_1 quant words or Q8_0 bytes at `q`) against the activations at `x`, each activation
/// broadcast once, consecutive elements in different chains.
#[inline(always)]
unsafe fn run_both<const F: u8, const H: bool>(q: *const u8, x: *const f32) -> [[__m256; 2]; 4] {
    let mut p = [[_mm256_setzero_ps(); 2]; 4];
    macro_rules! put {
        ($e:expr, $v0:expr, $v1:expr) => {{
            let (e, xe) = ($e, _mm256_set1_ps(*x.add($e)));
            p[e / 8][0] = _mm256_fmadd_ps($v0, xe, p[e / 8][0]);
            p[e / 8][1] = _mm256_fmadd_ps($v1, xe, p[e / 8][1]);
        }};
    }
    if F == Q8_0 {
        for i in 0..8 {
            for qtr in 0..4 {
                let e = 8 * qtr + i;
                put!(e, q8_at(q, e, 0), q8_at(q, e, 1));
            }
        }
        return p;
    }
    // As [`values`]: word `w` (each half of it) read from its byte `j`, its low nibble element
    // `8w + 2j`, its high nibble `8w + 2j + 1`; each quarter's elements in order.
    let mask = _mm256_set1_epi32(0x0f);
    macro_rules! word {
        ($w:expr, $j:expr, $h:expr) => {
            _mm256_loadu_si256(q.add(64 * $w + 32 * $h + $j) as *const __m256i)
        };
    }
    for j in 0..4 {
        for w in 0..4 {
            let (v0, v1) = (word!(w, j, 0), word!(w, j, 1));
            put!(
                8 * w + 2 * j,
                to_f32::<F>(_mm256_and_si256(v0, mask)),
                to_f32::<F>(_mm256_and_si256(v1, mask))
            );
            put!(
                8 * w + 2 * j + 1,
                high_nibble::<F, H>(v0),
                high_nibble::<F, H>(v1)
            );
        }
    }
    p
}

/// Half `h` of the 16 f16 values at `p`, widened.
#[inline(always)]
pub(crate) unsafe fn half_f16(p: *const u8, h: usize) -> __m256 {
    _mm256_cvtph_ps(_mm_loadu_si128(p.add(2 * LANES * h) as *const __m128i))
}

/// Half `h` of the 16 bytes at `p`, as f32: unsigned, or signed (`SIGNED`).
#[inline(always)]
unsafe fn half_bytes<const SIGNED: bool>(p: *const u8, h: usize) -> __m256 {
    let b = _mm_loadl_epi64(p.add(LANES * h) as *const __m128i);
    _mm256_cvtepi32_ps(if SIGNED {
        _mm256_cvtepi8_epi32(b)
    } else {
        _mm256_cvtepu8_epi32(b)
    })
}

/// Half `h` of a Q4_K group super-block's `d·sc_j` and `dmin·m_j` for sub-block `j` (both
/// exact in f32: an f16 times a 6-bit integer).
#[inline(always)]
pub(crate) unsafe fn k4_scales(blk: *const u8, h: usize, j: usize) -> (__m256, __m256) {
    (
        _mm256_mul_ps(
            half_f16(blk, h),
            half_bytes::<false>(blk.add(K4_SCALES + GROUP * j), h),
        ),
        _mm256_mul_ps(
            half_f16(blk.add(K4_DMIN), h),
            half_bytes::<false>(blk.add(K4_MINS + GROUP * j), h),
        ),
    )
}

/// Half `h` of a Q6_K group super-block's `d·sc` for the two sub-blocks of pair `pair` (exact
/// in f32: an f16 times an 8-bit integer).
#[inline(always)]
unsafe fn k6_scales(blk: *const u8, h: usize, pair: usize) -> (__m256, __m256) {
    let d = half_f16(blk, h);
    let (a, b) = (
        half_bytes::<true>(blk.add(K6_SCALES + GROUP * 2 * pair), h),
        half_bytes::<true>(blk.add(K6_SCALES + GROUP * (2 * pair + 1)), h),
    );
    (_mm256_mul_ps(d, a), _mm256_mul_ps(d, b))
}

/// One Q4_K group super-block (`b` of the row) into the accumulators: each sub-block `j` as a
/// Q4_1 block's quarters, then `acc ← fma(d·sc_j, s, acc)` and `acc ← fma(−dmin·m_j, Σx_j, acc)`.
#[inline(always)]
unsafe fn k4_super_block<const N: usize, const H: bool>(
    blk: *const u8,
    b: usize,
    h: usize,
    x: &[*const f32; N],
    sums: &[*const f32; N],
    acc: &mut [__m256; N],
    next: *const u8,
) {
    for j in 0..K4_SUB {
        prefetch_part(next, group_block_bytes(QuantKind::Q4_K), j, K4_SUB);
        let sub = b * K4_SUB + j;
        let xb: [*const f32; N] = std::array::from_fn(|t| x[t].add(sub * BLOCK));
        let mut c = Quarters::<N>::new(xb);
        values::<Q4_1, H, _>(blk.add(K4_QUANTS + j * K4_SUB_BYTES), h, &mut c);
        let (d1, m1) = k4_scales(blk, h, j);
        for (t, a) in acc.iter_mut().enumerate() {
            *a = _mm256_fmadd_ps(d1, c.sum(t), *a);
            *a = _mm256_fnmadd_ps(m1, _mm256_set1_ps(*sums[t].add(sub)), *a);
        }
    }
}

/// One Q6_K group super-block (`b` of the row) into the accumulators: per pair of sub-blocks
/// the four quarters' partial sums, then `acc ← fma(d·sc_a, p_0 + p_1, acc)` and
/// `acc ← fma(d·sc_b, p_2 + p_3, acc)`.
#[inline(always)]
unsafe fn k6_super_block<const N: usize>(
    blk: *const u8,
    b: usize,
    h: usize,
    x: &[*const f32; N],
    acc: &mut [__m256; N],
    next: *const u8,
) {
    for pair in 0..K6_SUB / 2 {
        prefetch_part(next, group_block_bytes(QuantKind::Q6_K), pair, K6_SUB / 2);
        let xb: [*const f32; N] = std::array::from_fn(|t| x[t].add(b * 256 + pair * BLOCK));
        let mut c = Quarters::<N>::new(xb);
        values6(blk.add(K6_QUANTS + pair * K6_PAIR_BYTES), h, &mut c);
        let (da, db) = k6_scales(blk, h, pair);
        for (t, a) in acc.iter_mut().enumerate() {
            let (pa, pb) = c.halves(t);
            *a = _mm256_fmadd_ps(da, pa, *a);
            *a = _mm256_fmadd_ps(db, pb, *a);
        }
    }
}

/// Where [`values`] and [`values6`] deliver element `e`'s eight rows.
trait Sink {
    /// Whether the sink takes the elements quarter-interleaved (`0, 8, 16, 24, 1, 9, …`: each
    /// quarter's elements still in order) rather than in element order.
    const INTERLEAVED: bool = false;
    unsafe fn put(&mut self, e: usize, v: __m256);
}

/// The four quarter chains of a run of 32 elements for `N` tokens, held to the run's end.
struct Quarters<const N: usize> {
    /// Each token's activations at the run's first element.
    x: [*const f32; N],
    p: [[__m256; N]; 4],
}

impl<const N: usize> Quarters<N> {
    #[inline(always)]
    unsafe fn new(x: [*const f32; N]) -> Self {
        Quarters {
            x,
            p: [[_mm256_setzero_ps(); N]; 4],
        }
    }

    /// Token `t`'s `p_0 + p_1` and `p_2 + p_3`.
    #[inline(always)]
    unsafe fn halves(&self, t: usize) -> (__m256, __m256) {
        (
            _mm256_add_ps(self.p[0][t], self.p[1][t]),
            _mm256_add_ps(self.p[2][t], self.p[3][t]),
        )
    }

    /// Token `t`'s `(p_0 + p_1) + (p_2 + p_3)`.
    #[inline(always)]
    unsafe fn sum(&self, t: usize) -> __m256 {
        let (a, b) = self.halves(t);
        _mm256_add_ps(a, b)
    }
}

impl<const N: usize> Sink for Quarters<N> {
    const INTERLEAVED: bool = true;
    #[inline(always)]
    unsafe fn put(&mut self, e: usize, q: __m256) {
        for t in 0..N {
            let x = _mm256_set1_ps(*self.x[t].add(e));
            self.p[e / 8][t] = _mm256_fmadd_ps(q, x, self.p[e / 8][t]);
        }
    }
}

/// Integer quants (masked to their field) less the format's offset, as f32 (exact).
#[inline(always)]
unsafe fn to_f32<const F: u8>(q: __m256i) -> __m256 {
    to_f32_times::<F, 1>(q)
}

/// The high nibble of each lane's low byte of `v` as f32, the format's offset applied: shifted
/// down, or with `H` masked in place (16 times its value, see [`Activations`]).
#[inline(always)]
unsafe fn high_nibble<const F: u8, const H: bool>(v: __m256i) -> __m256 {
    if H {
        to_f32_times::<F, 16>(_mm256_and_si256(v, _mm256_set1_epi32(0xf0)))
    } else {
        to_f32::<F>(_mm256_and_si256(
            _mm256_srli_epi32::<4>(v),
            _mm256_set1_epi32(0x0f),
        ))
    }
}

/// [`to_f32`] of quants held `M` times their value (a field masked in place, `M` its place
/// value): the offset taken `M` times.
#[inline(always)]
unsafe fn to_f32_times<const F: u8, const M: i32>(q: __m256i) -> __m256 {
    let off = value_offset(kind_of(F)) * M;
    if off == 0 {
        _mm256_cvtepi32_ps(q)
    } else {
        _mm256_cvtepi32_ps(_mm256_add_epi32(q, _mm256_set1_epi32(off)))
    }
}

/// Element `e`'s eight rows of half `h` of a Q8_0 group block's quants at `q`, sign-extended
/// and converted.
#[inline(always)]
unsafe fn q8_at(q: *const u8, e: usize, h: usize) -> __m256 {
    let bytes = _mm_loadl_epi64(q.add(GROUP * e + LANES * h) as *const __m128i);
    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes))
}

/// Element `E`'s eight rows of a Q8_0 group block half's quants at `q` (the half's first row
/// already added): [`q8_at`] for the `fields!` macro.
#[inline(always)]
unsafe fn q8<const E: usize>(q: *const u8) -> __m256 {
    q8_at(q, E, 0)
}

/// The five-bit field at bit `S` of word `W` moved to each lane's top five bits (bits 27–31;
/// the bits below are other fields'); `L = 32 − S` where the field crosses into word `W + 1`,
/// else 0. A shift right by 27, arithmetic or logical, then extends it ([`values`]).
#[inline(always)]
unsafe fn f5<const W: usize, const S: i32, const L: i32>(w: &[__m256i; 5]) -> __m256i {
    top::<W, S, L, 5>(w)
}

/// The six-bit field at bit `S` of word `W` of six words whose fields have their top bit
/// flipped ([`sign_flip`]), as the Q6_K value `q − 32` in f32.
#[inline(always)]
unsafe fn f6<const W: usize, const S: i32, const L: i32>(w: &[__m256i; 6]) -> __m256 {
    _mm256_cvtepi32_ps(_mm256_srai_epi32::<26>(top::<W, S, L, 6>(w)))
}

/// The `B`-bit field at bit `S` of word `W` of a run's `B` words (32 fields of `B` bits) moved
/// to each lane's top `B` bits (the bits below are other fields'); `L = 32 − S` where the field
/// crosses into word `W + 1`, else 0.
///
/// **Why.** Put at the top, a shift right by `32 − B` extends the field: logically to `q`, or,
/// with its top bit flipped first ([`sign_flip`]), arithmetically to `q − 2^(B−1)`, the offset
/// of Q5_0 and Q6_K taken. That is a shift (none for the top field) where a mask and an add
/// were, and the shifts' counts are immediates. One core of the 2-vCPU AMD EPYC (Zen 3),
/// weights in cache, best of 60 × 10 calls, old and new builds alternating: Q5_0 1536 × 576
/// 6.9–8.5 → 7.7–8.8 GiB/s (8–11% within a round), Q6_K 896 × 4864 7.0–7.2 → 7.4–7.6.
/// Qwen2.5-Coder-0.5B Q4_K_M decode at two threads (`kiln-bench --profile`, two runs of each
/// build): its Q5_0 gate+up 13.8 / 14.1 → 13.0 / 12.8 ms per step (24 layers).
#[inline(always)]
unsafe fn top<const W: usize, const S: i32, const L: i32, const B: usize>(
    w: &[__m256i; B],
) -> __m256i {
    // Shift counts in a register: stable Rust cannot write `32 − B − S` as an immediate, and
    // LLVM turns a constant count back into the immediate form (`vpslld ymm, ymm, imm8`).
    let count = |n: i32| _mm_cvtsi32_si128(n);
    let at = 32 - B as i32;
    if L == 0 {
        if S == at {
            w[W]
        } else {
            _mm256_sll_epi32(w[W], count(at - S))
        }
    } else {
        // The field's low 32 − S bits are word W's top bits, its high S − at bits word W + 1's
        // lowest.
        _mm256_or_si256(
            _mm256_srl_epi32(w[W], count(S - at)),
            _mm256_sll_epi32(w[W + 1], count(L + at)),
        )
    }
}

/// Per word of a run's `B` words of `B`-bit fields (half a group's rows in the lanes), the top
/// bit of every field: flipped, a field `q` reads as `q − 2^(B−1)` in `B`-bit two's complement
/// (`q ^ 2^(B−1) ≡ q − 2^(B−1) mod 2^B`).
const fn sign_flip<const B: usize>() -> [i32; B] {
    let mut m = [0i32; B];
    let mut e = 0;
    while e < BLOCK {
        let bit = B * e + B - 1;
        m[bit / 32] |= (1u32 << (bit % 32)) as i32;
        e += 1;
    }
    m
}

/// `w` with every field's top bit flipped (`flip` from [`sign_flip`]).
#[inline(always)]
unsafe fn flipped<const K: usize>(mut w: [__m256i; K], flip: &[i32; K]) -> [__m256i; K] {
    for (w, &f) in w.iter_mut().zip(flip.iter()) {
        *w = _mm256_xor_si256(*w, _mm256_set1_epi32(f));
    }
    w
}

/// Half `h` of the `K` quant words at `q`.
#[inline(always)]
unsafe fn words<const K: usize>(q: *const u8, h: usize) -> [__m256i; K] {
    let mut w = [_mm256_setzero_si256(); K];
    for (i, v) in w.iter_mut().enumerate() {
        *v = _mm256_loadu_si256(q.add(64 * i + 32 * h) as *const __m256i);
    }
    w
}

/// The `q − 32` values of half `h` of a pair of Q6_K sub-blocks (six words at `q`) into `sink`.
#[inline(always)]
unsafe fn values6<S: Sink>(q: *const u8, h: usize, sink: &mut S) {
    let w = flipped(words::<6>(q, h), &const { sign_flip::<6>() });
    macro_rules! put {
        ($e:expr, $v:expr) => {
            sink.put($e, $v)
        };
    }
    if S::INTERLEAVED {
        fields!(quarters 6, &w, put);
    } else {
        fields!(6, &w, put);
    }
}

/// Half `h` of each element's quants as f32 (the offset applied) into `sink`; with `H`, a
/// 4-bit format's odd elements (high nibbles) as 16 times their value, for activations whose
/// odd elements were divided by 16 ([`Activations`]).
#[inline(always)]
unsafe fn values<const F: u8, const H: bool, S: Sink>(q: *const u8, h: usize, sink: &mut S) {
    if F == Q8_0 {
        let q = q.add(LANES * h);
        macro_rules! put {
            ($e:expr, $v:expr) => {
                sink.put($e, $v)
            };
        }
        if S::INTERLEAVED {
            fields!(quarters 8, q, put);
        } else {
            fields!(8, q, put);
        }
    } else if F == Q5_0 || F == Q5_1 {
        let mut w = words::<5>(q, h);
        if F == Q5_0 {
            w = flipped(w, &const { sign_flip::<5>() });
        }
        // Q5_0's flipped fields extend to `q − 16` by an arithmetic shift, Q5_1's to `q` by a
        // logical one (its offset is 0).
        macro_rules! put5 {
            ($e:expr, $i:expr) => {{
                let top = $i;
                let v = if F == Q5_0 {
                    _mm256_srai_epi32::<27>(top)
                } else {
                    _mm256_srli_epi32::<27>(top)
                };
                sink.put($e, _mm256_cvtepi32_ps(v))
            }};
        }
        if S::INTERLEAVED {
            fields!(quarters 5, &w, put5);
        } else {
            fields!(5, &w, put5);
        }
    } else {
        // Word `w` (this half of it) read from its byte `j`: lane `r`'s low byte is row `r`'s
        // byte `j` of the word, whose low nibble is element `8w + 2j` and high nibble element
        // `8w + 2j + 1`. The bytes above are masked off.
        let q = q.add(32 * h);
        let mask = _mm256_set1_epi32(0x0f);
        macro_rules! word {
            ($w:expr, $j:expr) => {
                _mm256_loadu_si256(q.add(64 * $w + $j) as *const __m256i)
            };
        }
        macro_rules! byte {
            ($v:expr, $w:expr, $j:expr) => {{
                let v = $v;
                sink.put(8 * $w + 2 * $j, to_f32::<F>(_mm256_and_si256(v, mask)));
                sink.put(8 * $w + 2 * $j + 1, high_nibble::<F, H>(v));
            }};
        }
        if S::INTERLEAVED {
            // Elements 2j of the four quarters, then 2j + 1 of each (loops: LLVM unrolls them
            // and keeps their order, see `super::avx512_grouped`).
            for j in 0..4 {
                let v = [word!(0, j), word!(1, j), word!(2, j), word!(3, j)];
                for (w, &v) in v.iter().enumerate() {
                    sink.put(8 * w + 2 * j, to_f32::<F>(_mm256_and_si256(v, mask)));
                }
                for (w, &v) in v.iter().enumerate() {
                    sink.put(8 * w + 2 * j + 1, high_nibble::<F, H>(v));
                }
            }
        } else {
            for w in 0..4 {
                for j in 0..4 {
                    byte!(word!(w, j), w, j);
                }
            }
        }
    }
}

/// A run's values, scaled (`scale[0]` for elements 0–15, `scale[1]` for 16–31), then offset,
/// never fused: how ggml dequantizes.
struct Dequantized<'a> {
    v: &'a mut [__m256; BLOCK],
    scale: [__m256; 2],
    offset: Option<__m256>,
}

impl Sink for Dequantized<'_> {
    #[inline(always)]
    unsafe fn put(&mut self, e: usize, q: __m256) {
        let x = _mm256_mul_ps(q, self.scale[e / 16]);
        self.v[e] = match self.offset {
            Some(m) => _mm256_add_ps(x, m),
            None => x,
        };
    }
}

/// Rows `rows` of grouped `w` dequantized into `out` (row-major, `w.cols` per row), bit-identical
/// to ggml's dequantization: `q·d`, then `+ m`, never fused.
///
/// # Safety
/// The CPU must have AVX2 and F16C; `rows` must lie in `w` and `out` hold `rows.len() · w.cols`
/// values.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dequantize(w: &Grouped, rows: std::ops::Range<usize>, out: &mut [f32]) {
    if w.layout == Layout::Halves && w.kind == QuantKind::Q5_0 {
        // The 4-bit formats keep the streams bytes in the halves layout.
        return dequantize_with::<super::avx2_halves::Halves>(w, rows, out);
    }
    match w.kind {
        QuantKind::Q4_0 => dequantize_with::<Legacy<Q4_0>>(w, rows, out),
        QuantKind::Q4_1 => dequantize_with::<Legacy<Q4_1>>(w, rows, out),
        QuantKind::Q5_0 => dequantize_with::<Legacy<Q5_0>>(w, rows, out),
        QuantKind::Q5_1 => dequantize_with::<Legacy<Q5_1>>(w, rows, out),
        QuantKind::Q8_0 => dequantize_with::<Legacy<Q8_0>>(w, rows, out),
        QuantKind::Q4_K => dequantize_with::<SubBlocksK4>(w, rows, out),
        QuantKind::Q6_K => dequantize_with::<PairsK6>(w, rows, out),
        k => unreachable!("{} is never grouped", k.name()),
    }
}

/// How a format's group block splits into runs of 32 elements for [`dequantize_with`], and
/// each run's values for half `h` of the group.
pub(crate) trait Pieces {
    /// Runs of 32 elements per group block.
    const PIECES: usize;
    /// Run `i` of half `h` of the group block at `blk`, element-major (8 rows each), exactly
    /// as ggml dequantizes it.
    unsafe fn piece(blk: *const u8, i: usize, h: usize, v: &mut [__m256; BLOCK]);
}

/// The legacy formats: one run, `q·d`, then `+ m` (never fused).
struct Legacy<const F: u8>;

impl<const F: u8> Pieces for Legacy<F> {
    const PIECES: usize = 1;
    #[inline(always)]
    unsafe fn piece(blk: *const u8, _: usize, h: usize, v: &mut [__m256; BLOCK]) {
        let kind = kind_of(F);
        let d = half_f16(blk, h);
        let mut sink = Dequantized {
            v,
            scale: [d, d],
            offset: if has_min(kind) {
                Some(half_f16(blk.add(2 * GROUP), h))
            } else {
                None
            },
        };
        values::<F, false, _>(blk.add(quants_at(kind)), h, &mut sink);
    }
}

/// Q4_K: its sub-blocks, `d·sc_j · q − dmin·m_j` (a multiply, then a subtraction, as ggml).
struct SubBlocksK4;

impl Pieces for SubBlocksK4 {
    const PIECES: usize = K4_SUB;
    #[inline(always)]
    unsafe fn piece(blk: *const u8, j: usize, h: usize, v: &mut [__m256; BLOCK]) {
        let (d1, m1) = k4_scales(blk, h, j);
        // `q·d1 − m1` is `q·d1 + (−m1)` bit for bit (the sign flipped, not `0 − m1`, which
        // would turn a +0 min's `−0 − 0` into +0).
        let neg = _mm256_xor_ps(m1, _mm256_set1_ps(-0.0));
        let mut sink = Dequantized {
            v,
            scale: [d1, d1],
            offset: Some(neg),
        };
        values::<Q4_1, false, _>(blk.add(K4_QUANTS + j * K4_SUB_BYTES), h, &mut sink);
    }
}

/// Q6_K: its pairs of sub-blocks, `d·sc · (q − 32)` (one multiply, as ggml).
struct PairsK6;

impl Pieces for PairsK6 {
    const PIECES: usize = K6_SUB / 2;
    #[inline(always)]
    unsafe fn piece(blk: *const u8, pair: usize, h: usize, v: &mut [__m256; BLOCK]) {
        let (da, db) = k6_scales(blk, h, pair);
        let mut sink = Dequantized {
            v,
            scale: [da, db],
            offset: None,
        };
        values6(blk.add(K6_QUANTS + pair * K6_PAIR_BYTES), h, &mut sink);
    }
}

/// [`dequantize`] for one format: every group block of `rows`, each run of 32 elements of each
/// half group computed element-major by `P` and transposed into its rows' places in `out`.
#[inline(always)]
unsafe fn dequantize_with<P: Pieces>(w: &Grouped, rows: std::ops::Range<usize>, out: &mut [f32]) {
    let (k, n, bb) = (w.cols, elems(w.kind), w.block_bytes());
    let nb = k / n;
    assert!(rows.end <= w.rows && out.len() >= rows.len() * k);
    for g in rows.start / GROUP..rows.end.div_ceil(GROUP) {
        let n0 = g * GROUP;
        for h in 0..2 {
            let r0 = n0 + LANES * h;
            let (lo, hi) = (rows.start.max(r0), rows.end.min(r0 + LANES));
            if lo >= hi {
                continue;
            }
            for b in 0..nb {
                let blk = w.bytes.as_ptr().add((g * nb + b) * bb);
                for i in 0..P::PIECES {
                    let mut v = [_mm256_setzero_ps(); BLOCK];
                    P::piece(blk, i, h, &mut v);
                    for c in 0..BLOCK / LANES {
                        let t = transpose8(v[LANES * c..LANES * (c + 1)].try_into().expect("8"));
                        for row in lo..hi {
                            let dst = out
                                .as_mut_ptr()
                                .add((row - rows.start) * k + b * n + i * BLOCK + LANES * c);
                            _mm256_storeu_ps(dst, t[row - r0]);
                        }
                    }
                }
            }
        }
    }
}

/// The transpose of an 8 × 8 matrix held as 8 row vectors: lane `c` of row `r` to lane `r` of
/// row `c`.
#[inline(always)]
pub(crate) unsafe fn transpose8(r: [__m256; 8]) -> [__m256; 8] {
    let mut t = [_mm256_setzero_ps(); 8];
    for i in 0..4 {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    let mut u = [_mm256_setzero_ps(); 8];
    for q in 0..2 {
        let (a, b, c, d) = (t[4 * q], t[4 * q + 1], t[4 * q + 2], t[4 * q + 3]);
        u[4 * q] = _mm256_shuffle_ps::<0x44>(a, c);
        u[4 * q + 1] = _mm256_shuffle_ps::<0xEE>(a, c);
        u[4 * q + 2] = _mm256_shuffle_ps::<0x44>(b, d);
        u[4 * q + 3] = _mm256_shuffle_ps::<0xEE>(b, d);
    }
    let mut o = [_mm256_setzero_ps(); 8];
    for j in 0..4 {
        o[j] = _mm256_permute2f128_ps::<0x20>(u[j], u[4 + j]);
        o[4 + j] = _mm256_permute2f128_ps::<0x31>(u[j], u[4 + j]);
    }
    o
}

//! The AVX-512 kernels of [`super::grouped`]: up to [`MAX_TOKENS`] tokens against Q4_0, Q4_1,
//! Q5_0, Q5_1, Q8_0, Q4_K and Q6_K weights regrouped sixteen rows to a group, the 16 output rows
//! in the 16 lanes of every vector, each (row, token) the chain of [`super::grouped::rows_ref`]
//! bit for bit; and the exact dequantization of grouped rows into prefill tiles.
//!
//! Per group, block and element: one table lookup that both drops the bits above the field and
//! converts the quant to f32 with its offset (`vpermps` for 4 bits, `vpermi2ps` over two
//! tables for 5), after at most one shift, and one FMA per token with the broadcast
//! activation. 4-bit words are read at byte offsets 0–3 (loads are cheap, the block is in
//! L1), so that every low nibble is an index as loaded and only the high nibbles need a shift:
//! 16 shifts a block where one a field had cost 28. Q5's fields shift (an OR of two for the
//! fields that cross words); for Q8_0, one sign-extending load and one conversion; for Q6_K, a
//! ternary-logic op and a subtraction in place of the lookup. Per group and block (Q4_K:
//! sub-block; Q6_K: pair of sub-blocks): the scales (and mins) converted once and an FMA or two
//! per token.
//!
//! With 4-bit weights and up to [`QUARTERS_MAX_TOKENS`] tokens a pass ([`Quarters`]) all four
//! quarter chains are held to the block's end and the nibbles come quarter-interleaved, so that
//! consecutive FMAs are independent: in element order each quarter is a chain of eight
//! dependent FMAs, and at one token the scheduler could not look far enough ahead to overlap
//! the quarters' latencies. Same chains, same bits. With both, one core of an Intel Xeon
//! (family 6 model 207), builds alternating, `cargo bench --bench kernels -- 'gemv/.*-grouped'`:
//! one token of Q4_1 16.0 → 18.2 GiB/s, of Q4_K 12.1–12.6 → 15.8 (with the prefetch fix of
//! [`prefetch_part`]); four tokens of Q4_1 (`gemm/q4_1-grouped/1536x576x4`) 49.8 → 52.3;
//! sixteen unchanged (57–58). Q8_0, Q5 and Q6_K gained nothing from the interleaving (Q8_0
//! lost 3–5%): their extra decode ops, not latency, bound them.
//!
//! A pass over a group's blocks (the loop of [`super::avx512_groups`]) serves up to eight
//! tokens, so each field's shift and lookup feed eight FMAs; with cached weights (a batched step
//! on a small model) the decode ops are what is left to save once the FMAs are counted. A
//! token's four quarter chains are folded as soon as each pair ends ([`Chains`]), which keeps
//! eight tokens' chains in registers; four tokens a pass, with every quarter's chain held to the
//! block's end, ran 16-token calls 13–25% slower on one core of an Intel Xeon (`cargo bench
//! --bench kernels -- 'gemm/.*-grouped'`).
//!
//! Nothing here takes a closure: a closure is compiled without its caller's `#[target_feature]`s
//! unless LLVM chooses to inline it, and per-element closures were left out of line once passes
//! grew to eight tokens (`tests/simd_inlined.rs` caught it). The fields go to a [`Sink`] by
//! static dispatch instead.

use std::arch::x86_64::*;

use super::avx512_groups::{drive, GroupPass};
use super::grouped::format::{kind_of, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q6_K, Q8_0};
use super::grouped::{
    elems, fields, group_block_bytes, job_sums, part_lines, quants_at, value_offset, Grouped,
    Layout, BLOCK, GROUP, K4_DMIN, K4_MINS, K4_QUANTS, K4_SCALES, K4_SUB, K4_SUB_BYTES,
    K6_PAIR_BYTES, K6_QUANTS, K6_SCALES, K6_SUB, MAX_TOKENS, PLANE_AT,
};
use super::prefetch::{lines_at_step, with_hint};
use super::Job;
use crate::model::quant::QuantKind;

/// The most tokens whose passes over 4-bit weights hold all four quarter chains at once
/// ([`Quarters`]): four accumulators a token, with the token's output, fit the registers.
const QUARTERS_MAX_TOKENS: usize = 4;

/// Every output of `job` (at most [`MAX_TOKENS`] tokens) over grouped `w`.
///
/// # Safety
/// The CPU must have AVX-512 F/BW/VL, FMA and F16C; `job`'s output must be valid for writes at
/// `t·ldo + n` for every token and row of the job, its input for reads of `w.cols` values per
/// token, its bias (if any) for reads up to `w.rows`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(crate) unsafe fn rows(w: &Grouped, job: &Job) {
    assert!(
        job.tokens <= MAX_TOKENS,
        "{} tokens for the grouped kernel",
        job.tokens
    );
    assert!(
        w.layout == Layout::Streams,
        "the AVX-512 grouped kernels read only the streams layout"
    );
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

#[inline(always)]
unsafe fn rows_of<const F: u8>(w: &Grouped, job: &Job) {
    let kind = kind_of(F);
    let nb = w.cols / elems(kind);
    let sums = job_sums(w, job);
    let blocks = w.cols / BLOCK;
    let group_bytes = nb * group_block_bytes(kind);
    with_hint!(L2 => {
        let kernel = Pass::<F, L2> {
            nb,
            job,
            sums: &sums,
            blocks,
        };
        drive(&kernel, w.bytes.as_ptr(), group_bytes, job)
    })
}

/// [`chunk`] as the shared group loop's pass, prefetching into L2 (`L2`) or L1.
struct Pass<'a, const F: u8, const L2: bool> {
    /// Blocks (K formats: super-blocks) per row.
    nb: usize,
    job: &'a Job<'a>,
    /// Every token's block sums, token `t`'s at `t·blocks` (empty without a min).
    sums: &'a [f32],
    /// 32-element blocks per token row.
    blocks: usize,
}

impl<const F: u8, const L2: bool> GroupPass for Pass<'_, F, L2> {
    #[inline(always)]
    unsafe fn pass<const N: usize>(
        &self,
        base: *const u8,
        ahead: *const u8,
        t0: usize,
    ) -> [__m512; N] {
        let mut x = [std::ptr::null(); N];
        let mut s = [std::ptr::null(); N];
        for t in 0..N {
            x[t] = self.job.xptr(t0 + t);
            // Never read for formats without a min, whose `sums` is empty.
            s[t] = self.sums.as_ptr().wrapping_add((t0 + t) * self.blocks);
        }
        if N <= QUARTERS_MAX_TOKENS && matches!(F, Q4_0 | Q4_1 | Q4_K) {
            chunk::<F, N, Quarters<N>, L2>((base, ahead, self.nb), x, s)
        } else {
            chunk::<F, N, Chains<N>, L2>((base, ahead, self.nb), x, s)
        }
    }
}

/// The four quarter chains of a run of 32 elements (a block, a Q4_K sub-block, a pair of Q6_K
/// sub-blocks) for `N` tokens, folded as soon as a quarter ends: `p` is the quarter under way,
/// `h[0]` becomes `p_0 + p_1` and `h[1]` becomes `p_2 + p_3`. Keeping all four quarters' chains
/// until the run's end would hold five vectors per token (with the accumulator); folding holds
/// four at most, so that eight tokens' chains fit the 32 registers with the accumulators
/// spilled once per run.
struct Chains<const N: usize> {
    /// Each token's activations at the run's first element.
    x: [*const f32; N],
    p: [__m512; N],
    h: [[__m512; N]; 2],
}

impl<const N: usize> Chains<N> {
    #[inline(always)]
    unsafe fn new(x: [*const f32; N]) -> Self {
        Chains {
            x,
            p: [_mm512_setzero_ps(); N],
            h: [[_mm512_setzero_ps(); N]; 2],
        }
    }
}

impl<const N: usize> Sink for Chains<N> {
    /// Field `e`'s FMA into the token chains of its quarter (`e / 8`); the fields come in
    /// element order.
    #[inline(always)]
    unsafe fn put(&mut self, e: usize, q: __m512) {
        for t in 0..N {
            self.p[t] = _mm512_fmadd_ps(q, _mm512_set1_ps(*self.x[t].add(e)), self.p[t]);
        }
        if e % 8 == 7 {
            for (h, p) in self.h[e / 16].iter_mut().zip(&mut self.p) {
                *h = if e % 16 == 7 {
                    *p
                } else {
                    _mm512_add_ps(*h, *p)
                };
                *p = _mm512_setzero_ps();
            }
        }
    }
}

/// Bits `S..S + 5` of the stream from word `W` as a `vpermi2ps` index; `L = 32 − S` where the
/// field crosses into word `W + 1`, else 0.
#[inline(always)]
unsafe fn f5<const W: usize, const S: u32, const L: u32>(w: &[__m512i; 5]) -> __m512i {
    let v = if S == 0 {
        w[W]
    } else {
        _mm512_srli_epi32::<S>(w[W])
    };
    if L == 0 {
        v
    } else {
        _mm512_or_si512(v, _mm512_slli_epi32::<L>(w[W + 1]))
    }
}

/// The 16 f32 values `start, …, start + 15`.
#[inline(always)]
unsafe fn iota_from(start: f32) -> __m512 {
    let iota = _mm512_setr_ps(
        0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0,
    );
    _mm512_add_ps(iota, _mm512_set1_ps(start))
}

/// Element `E`'s 16 rows of a Q8_0 group block's quants at `q`, sign-extended and converted.
#[inline(always)]
unsafe fn q8<const E: usize>(q: *const u8) -> __m512 {
    let bytes = _mm_loadu_si128(q.add(GROUP * E) as *const __m128i);
    _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes))
}

/// Bits `S..S + 6` of the stream from word `W` (`L = 32 − S` where the field crosses into word
/// `W + 1`, else 0) as the f32 value `q − 32` of a Q6_K quant: the six bits are placed in the
/// mantissa of 2²³ (one ternary-logic AND/OR) and `2²³ + 32` subtracted, both exact.
#[inline(always)]
unsafe fn f6<const W: usize, const S: u32, const L: u32>(w: &[__m512i; 6]) -> __m512 {
    let v = if S == 0 {
        w[W]
    } else {
        _mm512_srli_epi32::<S>(w[W])
    };
    let v = if L == 0 {
        v
    } else {
        _mm512_or_si512(v, _mm512_slli_epi32::<L>(w[W + 1]))
    };
    // 0xEA: (a & b) | c.
    let bits = _mm512_ternarylogic_epi32::<0xEA>(
        v,
        _mm512_set1_epi32(0x3f),
        _mm512_set1_epi32(0x4b00_0000),
    );
    _mm512_sub_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(8_388_640.0))
}

/// The `q − 32` values of a pair of Q6_K sub-blocks (32 elements; six words at `q`) into `sink`.
#[inline(always)]
unsafe fn values6<S: Sink>(q: *const u8, sink: &mut S) {
    let q = q as *const __m512i;
    let mut w = [_mm512_setzero_si512(); 6];
    for (i, v) in w.iter_mut().enumerate() {
        *v = _mm512_loadu_si512(q.add(i));
    }
    macro_rules! put {
        ($e:expr, $v:expr) => {
            sink.put($e, $v)
        };
    }
    fields!(6, &w, put);
}

/// The 16 rows' `d·sc_j` of Q6_K sub-block `j` (exact: an f16 times an 8-bit integer).
#[inline(always)]
unsafe fn k6_scale(blk: *const u8, d: __m512, j: usize) -> __m512 {
    let sc = _mm512_cvtepi8_epi32(_mm_loadu_si128(
        blk.add(K6_SCALES + GROUP * j) as *const __m128i
    ));
    _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc))
}

/// One Q6_K group super-block (`b` of the row) into the `N` tokens' accumulators: per pair of
/// sub-blocks the four quarters' partial sums, then `acc ← fma(d·sc_a, p_0 + p_1, acc)` and
/// `acc ← fma(d·sc_b, p_2 + p_3, acc)`.
#[inline(always)]
unsafe fn k6_super_block<const N: usize, R: Run<N>, const L2: bool>(
    blk: *const u8,
    b: usize,
    x: &[*const f32; N],
    acc: &mut [__m512; N],
    next: *const u8,
) {
    let d = _mm512_cvtph_ps(_mm256_loadu_si256(blk as *const __m256i));
    for pair in 0..K6_SUB / 2 {
        let xb: [*const f32; N] = std::array::from_fn(|t| x[t].add(b * 256 + pair * BLOCK));
        let mut c = R::new(xb);
        let mut spread = Spread::<_, L2>::part(
            &mut c,
            next,
            (group_block_bytes(QuantKind::Q6_K), pair, K6_SUB / 2),
        );
        values6(blk.add(K6_QUANTS + pair * K6_PAIR_BYTES), &mut spread);
        let (da, db) = (k6_scale(blk, d, 2 * pair), k6_scale(blk, d, 2 * pair + 1));
        for (t, a) in acc.iter_mut().enumerate() {
            let (ha, hb) = c.halves(t);
            *a = _mm512_fmadd_ps(da, ha, *a);
            *a = _mm512_fmadd_ps(db, hb, *a);
        }
    }
}

/// A Q5 group block's five quant words.
#[inline(always)]
unsafe fn quant_words5(q: *const u8) -> [__m512i; 5] {
    let q = q as *const __m512i;
    let mut w = [_mm512_setzero_si512(); 5];
    for (i, v) in w.iter_mut().enumerate() {
        *v = _mm512_loadu_si512(q.add(i));
    }
    w
}

/// Each element's 16 rows' quants as f32 (the offset applied) into `sink`.
#[inline(always)]
unsafe fn values<const F: u8, S: Sink>(q: *const u8, sink: &mut S) {
    let kind = kind_of(F);
    let off = value_offset(kind) as f32;
    if F == Q8_0 {
        macro_rules! put {
            ($e:expr, $v:expr) => {
                sink.put($e, $v)
            };
        }
        fields!(8, q, put);
    } else if F == Q5_0 || F == Q5_1 {
        let (lo, hi) = (iota_from(off), iota_from(off + 16.0));
        let w = quant_words5(q);
        macro_rules! lookup5 {
            ($e:expr, $i:expr) => {
                sink.put($e, _mm512_permutex2var_ps(lo, $i, hi))
            };
        }
        fields!(5, &w, lookup5);
    } else {
        // Word `w` read from its byte `j`: lane `r`'s low byte is then row `r`'s byte `j` of
        // the word, whose low nibble (element `8w + 2j`) is a `vpermps` index as loaded and
        // whose high nibble (element `8w + 2j + 1`) is one shift away. The bytes above are
        // the word's next bytes and the next row's, which `vpermps` ignores.
        let table = iota_from(off);
        macro_rules! word {
            ($w:expr, $j:expr) => {
                _mm512_loadu_si512(q.add(64 * $w + $j) as *const __m512i)
            };
        }
        // In element order (eight tokens a pass), a macro with literal positions, not a loop:
        // LLVM left such loops rolled, and the chains' element-dependent folding with them (16
        // tokens ran at half speed). Quarter-interleaved (up to four tokens), loops: they
        // unroll, and LLVM keeps their order; written with this macro in the same order, its
        // scheduler put each quarter's FMAs back together and one token of Q4_1 ran 16.6 GiB/s
        // on one core of the Intel Xeon where the loops give 18.2.
        macro_rules! byte {
            ($w:literal, $j:literal) => {{
                let v = word!($w, $j);
                sink.put(8 * $w + 2 * $j, _mm512_permutexvar_ps(v, table));
                let hi = _mm512_srli_epi32::<4>(v);
                sink.put(8 * $w + 2 * $j + 1, _mm512_permutexvar_ps(hi, table));
            }};
        }
        if S::INTERLEAVED {
            // Elements 2j of the four quarters, then 2j + 1 of each.
            for j in 0..4 {
                let v = [word!(0, j), word!(1, j), word!(2, j), word!(3, j)];
                for (w, &v) in v.iter().enumerate() {
                    sink.put(8 * w + 2 * j, _mm512_permutexvar_ps(v, table));
                }
                for (w, &v) in v.iter().enumerate() {
                    let hi = _mm512_srli_epi32::<4>(v);
                    sink.put(8 * w + 2 * j + 1, _mm512_permutexvar_ps(hi, table));
                }
            }
        } else {
            byte!(0, 0);
            byte!(0, 1);
            byte!(0, 2);
            byte!(0, 3);
            byte!(1, 0);
            byte!(1, 1);
            byte!(1, 2);
            byte!(1, 3);
            byte!(2, 0);
            byte!(2, 1);
            byte!(2, 2);
            byte!(2, 3);
            byte!(3, 0);
            byte!(3, 1);
            byte!(3, 2);
            byte!(3, 3);
        }
    }
}

/// Where [`values`] and [`values6`] deliver element `e`'s 16 rows: a trait with static dispatch
/// rather than a closure, so that nothing leaves the kernels' `#[target_feature]`s.
trait Sink {
    /// Whether the sink takes the elements quarter-interleaved (`0, 8, 16, 24, 1, 9, …`: each
    /// quarter's elements still in order) rather than in element order.
    const INTERLEAVED: bool = false;
    unsafe fn put(&mut self, e: usize, v: __m512);
}

/// A sink that asks for the same block of the next group a line at a time as this block's
/// elements go to `inner` (line `l` of `lines` with element `⌊32·l / lines⌋`), rather than all
/// its lines at once before them. A burst of five to nine prefetches at every block start waited
/// on the line fill buffers ahead of the loads and conversions behind it. On the 2-vCPU Intel
/// Xeon (family 6 model 167), two threads, builds alternating, `kiln-bench -p 0 -n 128` decode
/// medians: SmolLM2 Q8_0 154.2 → 193.3 tok/s, Q4_1 279.1 → 285.1 (within the spread), and
/// Qwen2.5-Coder-0.5B Q4_K_M 47.8 → 62.8 (its Q5_0/Q8_0 tensors, then the K formats' lines
/// spread over each sub-block as well: 60.4 → 62.8). The hint and the address are constants of
/// the pass (see [`lines_at_step`]), so that the prefetches put no branches between the loads.
struct Spread<'a, S, const L2: bool> {
    inner: &'a mut S,
    /// The next group's block (or, on a later pass over the group, this one's, in cache).
    next: *const u8,
    lines: usize,
}

impl<'a, S, const L2: bool> Spread<'a, S, L2> {
    /// The lines of part `i` of `parts` of the `bytes` bytes at `next` ([`part_lines`]: a
    /// block's whole, or a K super-block's next-group bytes over its sub-blocks).
    #[inline(always)]
    fn part(inner: &'a mut S, next: *const u8, (bytes, i, parts): (usize, usize, usize)) -> Self {
        let (next, lines) = part_lines(next, bytes, i, parts);
        Spread { inner, next, lines }
    }
}

impl<S: Sink, const L2: bool> Sink for Spread<'_, S, L2> {
    const INTERLEAVED: bool = S::INTERLEAVED;
    #[inline(always)]
    unsafe fn put(&mut self, e: usize, v: __m512) {
        lines_at_step::<L2>(self.next, self.lines, (e, BLOCK));
        self.inner.put(e, v);
    }
}

/// The partial sums of a run of 32 elements for `N` tokens.
trait Run<const N: usize>: Sink {
    unsafe fn new(x: [*const f32; N]) -> Self;
    /// Token `t`'s `p_0 + p_1` and `p_2 + p_3`.
    unsafe fn halves(&self, t: usize) -> (__m512, __m512);
    /// Token `t`'s `(p_0 + p_1) + (p_2 + p_3)`.
    #[inline(always)]
    unsafe fn sum(&self, t: usize) -> __m512 {
        let (a, b) = self.halves(t);
        _mm512_add_ps(a, b)
    }
}

/// The four quarter chains of a run held at once, for few tokens: fed quarter-interleaved, so
/// that four independent FMAs follow each other and no chain's latency waits on the scheduler.
struct Quarters<const N: usize> {
    x: [*const f32; N],
    p: [[__m512; N]; 4],
}

impl<const N: usize> Sink for Quarters<N> {
    const INTERLEAVED: bool = true;
    #[inline(always)]
    unsafe fn put(&mut self, e: usize, q: __m512) {
        for t in 0..N {
            self.p[e / 8][t] =
                _mm512_fmadd_ps(q, _mm512_set1_ps(*self.x[t].add(e)), self.p[e / 8][t]);
        }
    }
}

impl<const N: usize> Run<N> for Quarters<N> {
    #[inline(always)]
    unsafe fn new(x: [*const f32; N]) -> Self {
        Quarters {
            x,
            p: [[_mm512_setzero_ps(); N]; 4],
        }
    }
    #[inline(always)]
    unsafe fn halves(&self, t: usize) -> (__m512, __m512) {
        (
            _mm512_add_ps(self.p[0][t], self.p[1][t]),
            _mm512_add_ps(self.p[2][t], self.p[3][t]),
        )
    }
}

impl<const N: usize> Run<N> for Chains<N> {
    #[inline(always)]
    unsafe fn new(x: [*const f32; N]) -> Self {
        Chains::new(x)
    }
    #[inline(always)]
    unsafe fn halves(&self, t: usize) -> (__m512, __m512) {
        (self.h[0][t], self.h[1][t])
    }
}

/// A run's values, scaled (`scale[0]` for elements 0–15, `scale[1]` for 16–31), then offset,
/// never fused: how ggml dequantizes.
struct Dequantized<'a> {
    v: &'a mut [__m512; BLOCK],
    scale: [__m512; 2],
    offset: Option<__m512>,
}

impl Sink for Dequantized<'_> {
    #[inline(always)]
    unsafe fn put(&mut self, e: usize, q: __m512) {
        let x = _mm512_mul_ps(q, self.scale[e / 16]);
        self.v[e] = match self.offset {
            Some(m) => _mm512_add_ps(x, m),
            None => x,
        };
    }
}

/// One group's 16 outputs for `N` tokens: the block chain of [`super::grouped`]'s module doc,
/// lane by lane.
#[inline(always)]
unsafe fn chunk<const F: u8, const N: usize, R: Run<N>, const L2: bool>(
    (base, ahead, nb): (*const u8, *const u8, usize),
    x: [*const f32; N],
    sums: [*const f32; N],
) -> [__m512; N] {
    let kind = kind_of(F);
    let bb = group_block_bytes(kind);
    let qa = quants_at(kind);
    let min = super::int8::has_min(kind);
    let mut acc = [_mm512_setzero_ps(); N];
    for b in 0..nb {
        let blk = base.add(b * bb);
        let next = ahead.wrapping_add(b * bb);
        if F == Q4_K {
            k4_super_block::<N, R, L2>(blk, b, &x, &sums, &mut acc, next);
            continue;
        }
        if F == Q6_K {
            k6_super_block::<N, R, L2>(blk, b, &x, &mut acc, next);
            continue;
        }
        let xb: [*const f32; N] = std::array::from_fn(|t| x[t].add(b * BLOCK));
        let mut c = R::new(xb);
        let mut spread = Spread::<_, L2>::part(&mut c, next, (bb, 0, 1));
        values::<F, _>(blk.add(qa), &mut spread);
        let d = _mm512_cvtph_ps(_mm256_loadu_si256(blk as *const __m256i));
        for (t, a) in acc.iter_mut().enumerate() {
            *a = _mm512_fmadd_ps(d, c.sum(t), *a);
        }
        if min {
            let m = _mm512_cvtph_ps(_mm256_loadu_si256(blk.add(2 * GROUP) as *const __m256i));
            for t in 0..N {
                acc[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(*sums[t].add(b)), acc[t]);
            }
        }
    }
    acc
}

/// The 16 rows' `d` and `dmin` of a Q4_K group super-block.
#[inline(always)]
unsafe fn k4_super_scales(blk: *const u8) -> (__m512, __m512) {
    (
        _mm512_cvtph_ps(_mm256_loadu_si256(blk as *const __m256i)),
        _mm512_cvtph_ps(_mm256_loadu_si256(blk.add(K4_DMIN) as *const __m256i)),
    )
}

/// The 16 rows' `d·sc_j` and `dmin·m_j` of Q4_K sub-block `j` (both exact in f32: an f16 times
/// a 6-bit integer), from the super-block's `(d, dmin)`.
#[inline(always)]
unsafe fn k4_scales(blk: *const u8, (d, dmin): (__m512, __m512), j: usize) -> (__m512, __m512) {
    let bytes = |at: usize| {
        _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(
            blk.add(at + GROUP * j) as *const __m128i,
        )))
    };
    (
        _mm512_mul_ps(d, bytes(K4_SCALES)),
        _mm512_mul_ps(dmin, bytes(K4_MINS)),
    )
}

/// One Q4_K group super-block (`b` of the row) into the `N` tokens' accumulators: each sub-block
/// `j` as a Q4_1 block's quarters, then `acc ← fma(d·sc_j, s, acc)` and
/// `acc ← fma(−dmin·m_j, Σx_j, acc)`.
#[inline(always)]
unsafe fn k4_super_block<const N: usize, R: Run<N>, const L2: bool>(
    blk: *const u8,
    b: usize,
    x: &[*const f32; N],
    sums: &[*const f32; N],
    acc: &mut [__m512; N],
    next: *const u8,
) {
    let dd = k4_super_scales(blk);
    for j in 0..K4_SUB {
        let sub = b * K4_SUB + j;
        let xb: [*const f32; N] = std::array::from_fn(|t| x[t].add(sub * BLOCK));
        let mut c = R::new(xb);
        let mut spread = Spread::<_, L2>::part(
            &mut c,
            next,
            (group_block_bytes(QuantKind::Q4_K), j, K4_SUB),
        );
        values::<Q4_1, _>(blk.add(K4_QUANTS + j * K4_SUB_BYTES), &mut spread);
        let (d1, m1) = k4_scales(blk, dd, j);
        for t in 0..N {
            acc[t] = _mm512_fmadd_ps(d1, c.sum(t), acc[t]);
            acc[t] = _mm512_fnmadd_ps(m1, _mm512_set1_ps(*sums[t].add(sub)), acc[t]);
        }
    }
}

/// Element-major values of a block's 32 elements × 16 rows (`v[e]`, lane `r` = row `n0 + r`)
/// written row by row for the rows `lo_hi`, row `n` at `dst + (n − first)·k`.
#[inline(always)]
unsafe fn store_rows(
    v: &[__m512; BLOCK],
    first: usize,
    lo_hi: std::ops::Range<usize>,
    n0: usize,
    dst: *mut f32,
    k: usize,
) {
    let a = transpose16(v[..16].try_into().expect("16 vectors"));
    let c = transpose16(v[16..].try_into().expect("16 vectors"));
    for n in lo_hi {
        let d = dst.add((n - first) * k);
        _mm512_storeu_ps(d, a[n - n0]);
        _mm512_storeu_ps(d.add(16), c[n - n0]);
    }
}

/// Rows `rows` of grouped `w` dequantized into `out` (row-major, `w.cols` per row), bit-identical
/// to ggml's dequantization: `q·d`, then `+ m`, never fused.
///
/// # Safety
/// The CPU must have AVX-512 F/BW/VL and F16C; `rows` must lie in `w` and `out` hold
/// `rows.len() · w.cols` values.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(crate) unsafe fn dequantize(w: &Grouped, rows: std::ops::Range<usize>, out: &mut [f32]) {
    assert!(
        w.layout != Layout::Halves,
        "the AVX-512 grouped kernels do not read the halves layout"
    );
    if w.layout == Layout::Planes {
        assert!(
            w.kind == QuantKind::Q5_0,
            "{} in the planes layout",
            w.kind.name()
        );
        return dequantize_with::<PlanesQ5>(w, rows, out);
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
/// each run's values.
trait Pieces {
    /// Runs of 32 elements per group block.
    const PIECES: usize;
    /// Run `i` of the group block at `blk`, element-major (16 rows each), exactly as ggml
    /// dequantizes it.
    unsafe fn piece(blk: *const u8, i: usize, v: &mut [__m512; BLOCK]);
}

/// The legacy formats: one run, `q·d`, then `+ m` (never fused).
struct Legacy<const F: u8>;

impl<const F: u8> Pieces for Legacy<F> {
    const PIECES: usize = 1;
    #[inline(always)]
    unsafe fn piece(blk: *const u8, _: usize, v: &mut [__m512; BLOCK]) {
        let kind = kind_of(F);
        let min = super::int8::has_min(kind);
        let d = _mm512_cvtph_ps(_mm256_loadu_si256(blk as *const __m256i));
        let m = if min {
            _mm512_cvtph_ps(_mm256_loadu_si256(blk.add(2 * GROUP) as *const __m256i))
        } else {
            _mm512_setzero_ps()
        };
        let mut sink = Dequantized {
            v,
            scale: [d, d],
            offset: min.then_some(m),
        };
        values::<F, _>(blk.add(quants_at(kind)), &mut sink);
    }
}

/// Q5_0 in [`Layout::Planes`]: each element's nibbles (a Q4_0 stream's) with 16 added where the
/// plane's bit is set, then `(q − 16)·d` (one multiply, as ggml).
struct PlanesQ5;

impl Pieces for PlanesQ5 {
    const PIECES: usize = 1;
    #[inline(always)]
    unsafe fn piece(blk: *const u8, _: usize, v: &mut [__m512; BLOCK]) {
        let d = _mm512_cvtph_ps(_mm256_loadu_si256(blk as *const __m256i));
        let q = blk.add(quants_at(QuantKind::Q5_0)) as *const __m512i;
        let plane = blk.add(PLANE_AT) as *const u64;
        // Row `r`'s bit `4r + j` of a plane qword, as bit `4(r mod 8) + j` of the qword's low
        // (rows 0–7) or high (rows 8–15) half.
        let halves = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
        let at = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
        let (one, sixteen, nibble) = (
            _mm512_set1_epi32(1),
            _mm512_set1_epi32(16),
            _mm512_set1_epi32(0x0f),
        );
        for (e, out) in v.iter_mut().enumerate() {
            let (w, k) = (e / 8, e % 8);
            let words = _mm512_loadu_si512(q.add(w));
            let low = _mm512_and_si512(
                _mm512_srlv_epi32(words, _mm512_set1_epi32(4 * k as i32)),
                nibble,
            );
            let bits = std::ptr::read_unaligned(plane.add(2 * w + k % 2));
            let lanes = _mm512_permutexvar_epi32(halves, _mm512_set1_epi64(bits as i64));
            let shift = _mm512_add_epi32(at, _mm512_set1_epi32((k / 2) as i32));
            let fifth = _mm512_and_si512(_mm512_srlv_epi32(lanes, shift), one);
            let quant = _mm512_add_epi32(low, _mm512_slli_epi32::<4>(fifth));
            let value = _mm512_cvtepi32_ps(_mm512_sub_epi32(quant, sixteen));
            *out = _mm512_mul_ps(value, d);
        }
    }
}

/// Q4_K: its sub-blocks, `d·sc_j · q − dmin·m_j` (a multiply, then a subtraction, as ggml).
struct SubBlocksK4;

impl Pieces for SubBlocksK4 {
    const PIECES: usize = K4_SUB;
    #[inline(always)]
    unsafe fn piece(blk: *const u8, j: usize, v: &mut [__m512; BLOCK]) {
        let (d1, m1) = k4_scales(blk, k4_super_scales(blk), j);
        // `q·d1 − m1` is `q·d1 + (−m1)` bit for bit (the sign flipped, not `0 − m1`, which
        // would turn a +0 min's `−0 − 0` into +0).
        let neg = _mm512_xor_si512(_mm512_castps_si512(m1), _mm512_set1_epi32(i32::MIN));
        let mut sink = Dequantized {
            v,
            scale: [d1, d1],
            offset: Some(_mm512_castsi512_ps(neg)),
        };
        values::<Q4_1, _>(blk.add(K4_QUANTS + j * K4_SUB_BYTES), &mut sink);
    }
}

/// Q6_K: its pairs of sub-blocks, `d·sc · (q − 32)` (one multiply, as ggml).
struct PairsK6;

impl Pieces for PairsK6 {
    const PIECES: usize = K6_SUB / 2;
    #[inline(always)]
    unsafe fn piece(blk: *const u8, pair: usize, v: &mut [__m512; BLOCK]) {
        let d = _mm512_cvtph_ps(_mm256_loadu_si256(blk as *const __m256i));
        let (da, db) = (k6_scale(blk, d, 2 * pair), k6_scale(blk, d, 2 * pair + 1));
        let mut sink = Dequantized {
            v,
            scale: [da, db],
            offset: None,
        };
        values6(blk.add(K6_QUANTS + pair * K6_PAIR_BYTES), &mut sink);
    }
}

/// [`dequantize`] for one format: every group block of `rows`, each run of 32 elements
/// computed element-major by `P` and transposed into its rows' places in `out`.
#[inline(always)]
unsafe fn dequantize_with<P: Pieces>(w: &Grouped, rows: std::ops::Range<usize>, out: &mut [f32]) {
    let (k, n, bb) = (w.cols, elems(w.kind), group_block_bytes(w.kind));
    let nb = k / n;
    assert!(rows.end <= w.rows && out.len() >= rows.len() * k);
    for g in rows.start / GROUP..rows.end.div_ceil(GROUP) {
        let n0 = g * GROUP;
        let (lo, hi) = (rows.start.max(n0), rows.end.min(n0 + GROUP));
        for b in 0..nb {
            let blk = w.bytes.as_ptr().add((g * nb + b) * bb);
            for i in 0..P::PIECES {
                let mut v = [_mm512_setzero_ps(); BLOCK];
                P::piece(blk, i, &mut v);
                let dst = out.as_mut_ptr().add(b * n + i * BLOCK);
                store_rows(&v, rows.start, lo..hi, n0, dst, k);
            }
        }
    }
}

/// The transpose of a 16 × 16 matrix held as 16 row vectors: lane `c` of row `r` to lane `r` of
/// row `c`. Pairs of rows interleave by 32 and 64 bits within 128-bit lanes, then the 128-bit
/// lanes of four rows at a time are gathered by two rounds of `vshuff32x4`: 64 shuffles.
#[inline(always)]
unsafe fn transpose16(r: [__m512; 16]) -> [__m512; 16] {
    // t[2i], t[2i + 1]: rows 2i and 2i + 1 interleaved (columns 4L, 4L + 1 and 4L + 2, 4L + 3
    // of each 128-bit lane L).
    let mut t = [_mm512_setzero_ps(); 16];
    for i in 0..8 {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    // u[4q + j]: rows 4q..4q + 4 at column 4L + j, in lane L.
    let mut u = [_mm512_setzero_ps(); 16];
    for q in 0..4 {
        let (a, b, c, d) = (t[4 * q], t[4 * q + 1], t[4 * q + 2], t[4 * q + 3]);
        u[4 * q] = _mm512_shuffle_ps::<0x44>(a, c);
        u[4 * q + 1] = _mm512_shuffle_ps::<0xEE>(a, c);
        u[4 * q + 2] = _mm512_shuffle_ps::<0x44>(b, d);
        u[4 * q + 3] = _mm512_shuffle_ps::<0xEE>(b, d);
    }
    // Column 4L + j: lane L of u[j], u[4 + j], u[8 + j], u[12 + j].
    let mut o = [_mm512_setzero_ps(); 16];
    for j in 0..4 {
        let x0 = _mm512_shuffle_f32x4::<0x44>(u[j], u[4 + j]);
        let x1 = _mm512_shuffle_f32x4::<0xEE>(u[j], u[4 + j]);
        let y0 = _mm512_shuffle_f32x4::<0x44>(u[8 + j], u[12 + j]);
        let y1 = _mm512_shuffle_f32x4::<0xEE>(u[8 + j], u[12 + j]);
        o[j] = _mm512_shuffle_f32x4::<0x88>(x0, y0);
        o[4 + j] = _mm512_shuffle_f32x4::<0xDD>(x0, y0);
        o[8 + j] = _mm512_shuffle_f32x4::<0x88>(x1, y1);
        o[12 + j] = _mm512_shuffle_f32x4::<0xDD>(x1, y1);
    }
    o
}

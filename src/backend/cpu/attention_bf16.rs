//! Attention for [`Numerics::Bf16`](super::Numerics::Bf16) calls (prefill chunks and large
//! batched steps of more than 16 rows, on CPUs with AVX512-BF16): the two products of attention
//! as small matrix products by `vdpbf16ps`, like the mode's matrix products
//! ([`super::matmul`]'s bf16 panels), instead of one f32 dot product per (token, head, key).
//!
//! Per call, each sequence's keys and values of one KV head are rounded to bf16 once and laid
//! out for the kernels: keys 16 to a vector, transposed (`kt[c][i][lane]` holds elements `2i`
//! and `2i + 1` of key `16c + lane`), values in pairs of positions (`vp[m][e]` holds element `e`
//! of positions `2m` and `2m + 1`). A task (up to eight consecutive tokens of one sequence and
//! the query heads of one KV head) rounds its queries to bf16 pairs, and its rows (token, head)
//! walk the keys twelve rows × 16 keys at a time: one key vector load, twelve broadcasts of a
//! query pair, twelve `vdpbf16ps`. The scores are scaled and put through the exact path's f32
//! softmax; the probabilities are rounded to bf16 pairs (zero outside each row's causal window)
//! and the rows walk the value pairs six rows × 64 outputs at a time.
//!
//! Each score and each output lane is one chain in a fixed order (elements in order; position
//! pairs in order from the first attended pair, where pairs before a row's window add exact
//! zeros), so a token's result does not depend on the other tokens of its call, nor on the
//! tile or task it lands in. Against the exact path each product carries the rounding of its
//! two factors to bf16 (a relative 2⁻⁹ each): the query and key, the probability and value.
//! How `vdpbf16ps` rounds its two-product sum into the accumulator is the CPU's (see the bf16
//! panels).
//!
//! The packing is paid per sequence and call: a prefill chunk's tokens share it, but a large
//! batched decode step (one row per sequence) packs each sequence's whole context for one token,
//! reading its cache a second time.

use std::arch::x86_64::*;
use std::cell::RefCell;
use std::collections::HashMap;

use super::attention::{token_tiles, AttentionShape, OutPtr};
use super::par;
use super::simd::x86::{bf16_pairs, exp_512, tail_mask16, transpose16};
use crate::backend::TokenRow;
use crate::kv::{KvCache, KvDtype};

/// Keys per score vector, and the alignment of every packed range of positions.
const KEYS: usize = 16;
/// Query rows per score register tile (twelve accumulators).
const SCORE_ROWS: usize = 12;
/// Rows per weighted-sum register tile (four accumulators each for 64 output lanes).
const SUM_ROWS: usize = 6;
/// Tokens per task (consecutive rows of one sequence).
const TILE_TOKENS: usize = 8;

/// Whether heads of `head_dim` elements take this path: keys are transposed 16 words (32
/// elements) at a time and values summed 16 lanes at a time.
pub(super) fn supports(head_dim: usize) -> bool {
    head_dim > 0 && head_dim.is_multiple_of(32)
}

/// One KV head of one sequence, rounded and laid out for the kernels, positions
/// `base..end` (both multiples of [`KEYS`]; positions past the sequence are zero).
struct Packed {
    base: usize,
    /// `kt[(c·d/2 + i)·16 + lane]`: elements `2i`, `2i + 1` of key `base + 16c + lane`.
    kt: Vec<u32>,
    /// `vp[m·d + e]`: element `e` of value `base + 2m` (low half) and `base + 2m + 1` (high).
    vp: Vec<u32>,
}

/// Per token of the call: first attended position and end (`lo..n`).
fn span(s: &AttentionShape, r: &TokenRow) -> (usize, usize) {
    (s.window.map_or(0, |w| r.pos.saturating_sub(w)), r.pos + 1)
}

fn round_down(x: usize) -> usize {
    x - x % KEYS
}

fn round_up(x: usize) -> usize {
    x.div_ceil(KEYS) * KEYS
}

/// Attends every row of the call (whose keys and values are already in `kv`) into `out`, as
/// [`super::attention::attention`] does, in bf16 products.
///
/// # Safety
/// The CPU supports AVX512-BF16 (and F/BW/VL, AVX2, FMA); [`supports`]`(s.head_dim)`; `q` holds
/// `s.heads · head_dim` values per row and `out` has room for them (checked by the caller).
pub(super) unsafe fn attention(
    s: &AttentionShape,
    rows: &[TokenRow],
    q: (&[f32], usize, usize),
    kv: &KvCache,
    out: (*mut f32, usize, usize),
) {
    let d = s.head_dim;
    let group = s.heads / s.kv_heads;
    // The call's sequences in order of first appearance, each with the positions it needs, and
    // each row's index among them (a batched step has one row per sequence: no linear search).
    let mut seqs: Vec<(usize, usize, usize)> = Vec::new();
    let mut seq_of_slot: HashMap<usize, usize> = HashMap::new();
    let mut row_seq = Vec::with_capacity(rows.len());
    for r in rows {
        let (lo, n) = span(s, r);
        let i = *seq_of_slot.entry(r.slot).or_insert_with(|| {
            seqs.push((r.slot, lo, n));
            seqs.len() - 1
        });
        let x = &mut seqs[i];
        x.1 = x.1.min(lo);
        x.2 = x.2.max(n);
        row_seq.push(i);
    }
    let packed: Vec<Packed> = par::map_collect(0..seqs.len() * s.kv_heads, |i| {
        let (slot, lo, n) = seqs[i / s.kv_heads];
        // SAFETY: as this function's.
        unsafe { pack(kv, s, slot, i % s.kv_heads, lo, n) }
    });
    // Tasks: up to TILE_TOKENS consecutive rows of one sequence, times KV heads.
    let tiles = token_tiles(rows, TILE_TOKENS);
    let (out_data, out_stride, out_col) = out;
    let ptr = OutPtr(out_data);
    par::for_each(0..tiles.len() * s.kv_heads, |task| {
        let tile = tiles[task / s.kv_heads].clone();
        let g = task % s.kv_heads;
        let seq = row_seq[tile.start];
        let p = ptr;
        let job = Job {
            s,
            rows: &rows[tile.clone()],
            heads: g * group..(g + 1) * group,
            q: &q.0[tile.start * q.1 + q.2..],
            q_stride: q.1,
            packed: &packed[seq * s.kv_heads + g],
            // SAFETY (of the writes through it): each task writes its own heads of its
            // own rows; bounds checked by the caller.
            out: unsafe { p.0.add(tile.start * out_stride + out_col) },
            out_stride,
        };
        SCRATCH.with_borrow_mut(|scratch| {
            // SAFETY: as this function's.
            unsafe { attend(&job, scratch, d) }
        });
    });
}

/// Rounds and lays out positions `lo..n` (widened to multiples of [`KEYS`]) of KV head `g` of
/// `slot`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn pack(
    kv: &KvCache,
    s: &AttentionShape,
    slot: usize,
    g: usize,
    lo: usize,
    n: usize,
) -> Packed {
    let d = s.head_dim;
    let dp = d / 2;
    let (base, end) = (round_down(lo), round_up(n));
    let len = end - base;
    // The f32 rows first (zero outside `lo..n`: nothing there is read from the pool), in place
    // or decoded.
    let mut kf = vec![0f32; len * d];
    let mut vf = vec![0f32; len * d];
    let table = kv.page_table(slot);
    let bs = kv.layout().block_size;
    let pool = kv.pool();
    let mut pos = lo;
    while pos < n {
        let block = table[pos / bs];
        let first = pos % bs;
        let rows = (bs - first).min(n - pos);
        let at = (pos - base) * d;
        if kv.layout().dtype == KvDtype::F32 {
            let (k, v) = pool.head_block_f32(s.layer, block, g);
            kf[at..at + rows * d].copy_from_slice(&k[first * d..(first + rows) * d]);
            vf[at..at + rows * d].copy_from_slice(&v[first * d..(first + rows) * d]);
        } else {
            let (k, v) = (&mut kf[at..at + rows * d], &mut vf[at..at + rows * d]);
            pool.decode_rows(s.layer, block, g, first, rows, k, v);
        }
        pos += rows;
    }
    // Keys: 16 keys × 16 words at a time, rounded, then transposed.
    let mut kt = vec![0u32; len * dp];
    for c in 0..len / KEYS {
        for w0 in (0..dp).step_by(16) {
            let mut r = [_mm512_setzero_si512(); 16];
            for (lane, r) in r.iter_mut().enumerate() {
                *r = bf16_pairs(kf.as_ptr().add((c * KEYS + lane) * d + 2 * w0), 32);
            }
            for (j, col) in transpose16(r).iter().enumerate() {
                let at = ((c * dp + w0 + j) * KEYS) as isize;
                _mm512_storeu_si512(kt.as_mut_ptr().offset(at) as *mut __m512i, *col);
            }
        }
    }
    // Values: two positions' elements interleaved per word, 16 elements at a time.
    let mut vp = vec![0u32; len * dp];
    for m in 0..len / 2 {
        for e in (0..d).step_by(16) {
            let a = _mm512_cvtneps_pbh(_mm512_loadu_ps(vf.as_ptr().add(2 * m * d + e)));
            let b = _mm512_cvtneps_pbh(_mm512_loadu_ps(vf.as_ptr().add((2 * m + 1) * d + e)));
            let a = _mm512_cvtepu16_epi32(std::mem::transmute::<__m256bh, __m256i>(a));
            let b = _mm512_cvtepu16_epi32(std::mem::transmute::<__m256bh, __m256i>(b));
            let w = _mm512_or_si512(a, _mm512_slli_epi32::<16>(b));
            _mm512_storeu_si512(vp.as_mut_ptr().add(m * d + e) as *mut __m512i, w);
        }
    }
    Packed { base, kt, vp }
}

/// One task: tokens `rows`, query heads `heads` (those of one KV head), against `packed`.
struct Job<'a> {
    s: &'a AttentionShape,
    rows: &'a [TokenRow],
    heads: std::ops::Range<usize>,
    /// The first token's query row (heads at `h · head_dim`), the next `q_stride` further.
    q: &'a [f32],
    q_stride: usize,
    packed: &'a Packed,
    /// The first token's output row (heads at `h · head_dim`), the next `out_stride` further.
    out: *mut f32,
    out_stride: usize,
}

/// A thread's buffers, reused from task to task.
#[derive(Default)]
struct Scratch {
    /// Per task row (token-major, then head): its query as bf16 pairs.
    q: Vec<u32>,
    /// Per task row: scores, then probabilities, of the task's positions.
    scores: Vec<f32>,
    /// Per task row: its weights `e^(score − max)` as bf16 pairs of positions.
    p: Vec<u32>,
    /// Per task row: the sum of its weights.
    sums: Vec<f32>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Scores, softmax and weighted values of one task.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")]
unsafe fn attend(job: &Job, scratch: &mut Scratch, d: usize) {
    let s = job.s;
    let dp = d / 2;
    let hc = job.heads.len();
    let nrows = job.rows.len() * hc;
    let spans: Vec<(usize, usize)> = job.rows.iter().map(|r| span(s, r)).collect();
    let lo_min = spans.iter().map(|x| x.0).min().unwrap_or(0);
    let n_max = spans.iter().map(|x| x.1).max().unwrap_or(0);
    let (tbase, tend) = (round_down(lo_min), round_up(n_max));
    let width = tend - tbase;
    let pk = job.packed;
    // The task's positions within the packed range.
    let k0 = (tbase - pk.base) / KEYS;
    let m0 = (tbase - pk.base) / 2;

    // Queries rounded to bf16 pairs, row `i·hc + hh` for token `i`, head `heads.start + hh`.
    scratch.q.resize(nrows * dp, 0);
    for i in 0..job.rows.len() {
        for (hh, h) in job.heads.clone().enumerate() {
            let src = job.q.as_ptr().add(i * job.q_stride + h * d);
            let dst = scratch.q.as_mut_ptr().add((i * hc + hh) * dp);
            for w0 in (0..dp).step_by(16) {
                let b = bf16_pairs(src.add(2 * w0), 32);
                _mm512_storeu_si512(dst.add(w0) as *mut __m512i, b);
            }
        }
    }

    // Scores of every row against every key chunk of the task.
    scratch.scores.resize(nrows * width, 0.0);
    let qw = scratch.q.as_ptr();
    let sc = scratch.scores.as_mut_ptr();
    for c in 0..width / KEYS {
        let kt = pk.kt.as_ptr().add((k0 + c) * dp * KEYS);
        let mut r0 = 0;
        while r0 < nrows {
            let rn = (nrows - r0).min(SCORE_ROWS);
            let (q, o) = (qw.add(r0 * dp), sc.add(r0 * width + c * KEYS));
            match rn {
                12 => scores::<12>(q, dp, kt, s.scale, o, width),
                11 => scores::<11>(q, dp, kt, s.scale, o, width),
                10 => scores::<10>(q, dp, kt, s.scale, o, width),
                9 => scores::<9>(q, dp, kt, s.scale, o, width),
                8 => scores::<8>(q, dp, kt, s.scale, o, width),
                7 => scores::<7>(q, dp, kt, s.scale, o, width),
                6 => scores::<6>(q, dp, kt, s.scale, o, width),
                5 => scores::<5>(q, dp, kt, s.scale, o, width),
                4 => scores::<4>(q, dp, kt, s.scale, o, width),
                3 => scores::<3>(q, dp, kt, s.scale, o, width),
                2 => scores::<2>(q, dp, kt, s.scale, o, width),
                _ => scores::<1>(q, dp, kt, s.scale, o, width),
            }
            r0 += rn;
        }
    }

    // Per row: `e^(score − max)` over its own positions as bf16 pairs (zero elsewhere), and
    // their sum, by which the weighted values are divided at the end.
    let wp = width / 2;
    scratch.p.resize(nrows * wp, 0);
    scratch.sums.resize(nrows, 0.0);
    for (i, &(lo, n)) in spans.iter().enumerate() {
        for hh in 0..hc {
            let r = i * hc + hh;
            let dst = scratch.p.as_mut_ptr().add(r * wp);
            scratch.sums[r] = exps(sc.add(r * width), width, lo - tbase, n - tbase, dst);
        }
    }

    // Weighted values: six rows × 64 output lanes at a time over the task's position pairs.
    let pw = scratch.p.as_ptr();
    let vp = pk.vp.as_ptr().add(m0 * d);
    let mut r0 = 0;
    while r0 < nrows {
        let rn = (nrows - r0).min(SUM_ROWS);
        let outs: [*mut f32; SUM_ROWS] = std::array::from_fn(|k| {
            let r = r0 + k.min(rn - 1);
            let (i, hh) = (r / hc, r % hc);
            job.out.add(i * job.out_stride + (job.heads.start + hh) * d)
        });
        let p = pw.add(r0 * wp);
        let div: [f32; SUM_ROWS] = std::array::from_fn(|k| scratch.sums[r0 + k.min(rn - 1)]);
        let outs = (&outs, &div);
        let mut e = 0;
        while e < d {
            let u = ((d - e) / 16).min(4);
            match (rn, u) {
                (6, 4) => sums::<6, 4>(p, wp, vp, d, e, outs),
                (5, 4) => sums::<5, 4>(p, wp, vp, d, e, outs),
                (4, 4) => sums::<4, 4>(p, wp, vp, d, e, outs),
                (3, 4) => sums::<3, 4>(p, wp, vp, d, e, outs),
                (2, 4) => sums::<2, 4>(p, wp, vp, d, e, outs),
                (1, 4) => sums::<1, 4>(p, wp, vp, d, e, outs),
                (6, _) => sums::<6, 2>(p, wp, vp, d, e, outs),
                (5, _) => sums::<5, 2>(p, wp, vp, d, e, outs),
                (4, _) => sums::<4, 2>(p, wp, vp, d, e, outs),
                (3, _) => sums::<3, 2>(p, wp, vp, d, e, outs),
                (2, _) => sums::<2, 2>(p, wp, vp, d, e, outs),
                _ => sums::<1, 2>(p, wp, vp, d, e, outs),
            }
            e += 16 * u.max(2);
        }
        r0 += rn;
    }
}

/// Lanes `j` of the 16 from `c` with `a ≤ c + j < b`.
#[inline(always)]
unsafe fn lanes(c: usize, a: usize, b: usize) -> __mmask16 {
    tail_mask16(b.saturating_sub(c).min(16)) & !tail_mask16(a.saturating_sub(c).min(16))
}

/// The weights of one row of scores (`width` at `row`, its own positions `a..b`):
/// `e^(s − max)` by [`exp_512`] (exact path's `exp` polynomial), rounded to bf16 pairs into
/// `dst` (`width / 2` words, zero outside `a..b`), and their f32 sum (lane `j` of 16 taking
/// the positions `j` mod 16, in order, then one reduction), which the caller divides by.
#[inline(always)]
unsafe fn exps(row: *const f32, width: usize, a: usize, b: usize, dst: *mut u32) -> f32 {
    let mut mv = _mm512_set1_ps(f32::NEG_INFINITY);
    let mut c = a - a % 16;
    while c < b {
        let m = lanes(c, a, b);
        mv = _mm512_mask_max_ps(mv, m, mv, _mm512_maskz_loadu_ps(m, row.add(c)));
        c += 16;
    }
    let vm = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
    let mut sum = _mm512_setzero_ps();
    let wp = width / 2;
    for w0 in (0..wp).step_by(16) {
        let c = 2 * w0;
        let (lo, hi) = (
            exp_at(row.add(c), vm, lanes(c, a, b)),
            exp_at(
                row.add(c + 16),
                vm,
                if c + 16 < width {
                    lanes(c + 16, a, b)
                } else {
                    0
                },
            ),
        );
        sum = _mm512_add_ps(_mm512_add_ps(sum, lo), hi);
        let words: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo));
        let n = (wp - w0).min(16);
        _mm512_mask_storeu_epi32(dst.add(w0) as *mut i32, tail_mask16(n), words);
    }
    _mm512_reduce_add_ps(sum)
}

/// `e^(x − max)` of the lanes `m` of the 16 at `p` (the others neither read nor nonzero).
#[inline(always)]
unsafe fn exp_at(p: *const f32, max: __m512, m: __mmask16) -> __m512 {
    let x = _mm512_sub_ps(_mm512_maskz_loadu_ps(m, p), max);
    _mm512_maskz_mov_ps(m, exp_512(x))
}

/// Scores of `R` rows (bf16 pairs at `q`, `dp` words apart) against the 16 keys at `kt`,
/// scaled, to `out` (rows `stride` apart).
#[inline(always)]
unsafe fn scores<const R: usize>(
    q: *const u32,
    dp: usize,
    kt: *const u32,
    scale: f32,
    out: *mut f32,
    stride: usize,
) {
    let mut acc = [_mm512_setzero_ps(); R];
    for i in 0..dp {
        let k: __m512bh = std::mem::transmute(_mm512_loadu_si512(kt.add(i * KEYS) as *const _));
        for (r, acc) in acc.iter_mut().enumerate() {
            let qv: __m512bh = std::mem::transmute(_mm512_set1_epi32(*q.add(r * dp + i) as i32));
            *acc = _mm512_dpbf16_ps(*acc, qv, k);
        }
    }
    let sv = _mm512_set1_ps(scale);
    for (r, acc) in acc.iter().enumerate() {
        _mm512_storeu_ps(out.add(r * stride), _mm512_mul_ps(*acc, sv));
    }
}

/// Output lanes `e..e + 16·U` of `R` rows (weight pairs at `p`, `wp` words apart) over every
/// position pair of the task (`vp`, `d` words per pair), each divided by its row's sum of
/// weights, to `outs`. `U` is 4 or 2; with 2 only the lanes below `d` are written.
#[inline(always)]
unsafe fn sums<const R: usize, const U: usize>(
    p: *const u32,
    wp: usize,
    vp: *const u32,
    d: usize,
    e: usize,
    (outs, div): (&[*mut f32; SUM_ROWS], &[f32; SUM_ROWS]),
) {
    let lanes = (d - e).min(16 * U);
    let mut acc = [[_mm512_setzero_ps(); U]; R];
    for m in 0..wp {
        let mut v = [std::mem::transmute::<__m512, __m512bh>(_mm512_setzero_ps()); U];
        for (u, v) in v.iter_mut().enumerate() {
            if 16 * u < lanes {
                *v = std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(
                    vp.add(m * d + e + 16 * u) as *const _,
                ));
            }
        }
        for (r, acc) in acc.iter_mut().enumerate() {
            let pv: __m512bh = std::mem::transmute(_mm512_set1_epi32(*p.add(r * wp + m) as i32));
            for (u, acc) in acc.iter_mut().enumerate() {
                *acc = _mm512_dpbf16_ps(*acc, pv, v[u]);
            }
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        let dv = _mm512_set1_ps(div[r]);
        for (u, acc) in acc.iter().enumerate() {
            if 16 * u < lanes {
                _mm512_storeu_ps(outs[r].add(e + 16 * u), _mm512_div_ps(*acc, dv));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use half::{bf16, f16};

    use super::super::attention::{attention, AttentionShape};
    use super::super::simd::{self, Level};
    use super::super::Numerics;
    use crate::backend::TokenRow;
    use crate::graph::KvSpec;
    use crate::kv::{KvCache, KvDtype};

    /// Whether this process runs the bf16 kernels (a CPU with AVX512-BF16, not forced lower).
    fn runs_bf16() -> bool {
        let on = simd::clamp(simd::level()) == Level::Avx512Bf16;
        if !on {
            eprintln!(
                "skipped: the bf16 attention needs AVX512-BF16 (level {:?})",
                simd::level()
            );
        }
        on
    }

    fn wave(n: usize, seed: usize, amp: f32) -> Vec<f32> {
        (0..n)
            .map(|i| (((i * 2654435761 + seed * 97) % 1000) as f32 / 500.0 - 1.0) * amp)
            .collect()
    }

    struct Case {
        heads: usize,
        kv_heads: usize,
        d: usize,
        window: Option<usize>,
    }

    impl Case {
        fn shape(&self) -> AttentionShape {
            AttentionShape {
                layer: 0,
                heads: self.heads,
                kv_heads: self.kv_heads,
                head_dim: self.d,
                scale: 0.3,
                window: self.window,
            }
        }

        /// Runs `rows` in one bf16 call; q/k/v rows indexed by position (`seq` picks the data).
        fn call(
            &self,
            kv: &mut KvCache,
            rows: &[TokenRow],
            data: &[(Vec<f32>, Vec<f32>, Vec<f32>)],
        ) -> Vec<f32> {
            let (hd, kd) = (self.heads * self.d, self.kv_heads * self.d);
            let pick = |which: usize, w: usize| -> Vec<f32> {
                rows.iter()
                    .flat_map(|r| {
                        let (q, k, v) = &data[r.slot];
                        let src = [q, k, v][which];
                        src[r.pos * w..(r.pos + 1) * w].to_vec()
                    })
                    .collect()
            };
            let (q, k, v) = (pick(0, hd), pick(1, kd), pick(2, kd));
            let mut out = vec![0f32; rows.len() * hd];
            attention(
                Numerics::Bf16,
                &self.shape(),
                rows,
                (&q, hd, 0),
                (&k, kd, 0),
                (&v, kd, 0),
                kv,
                (&mut out, hd, 0),
                None,
            );
            out
        }
    }

    fn cache(c: &Case, dtype: KvDtype, slots: usize, tokens: usize) -> KvCache {
        let spec = KvSpec {
            layers: 1,
            kv_heads: c.kv_heads,
            head_dim: c.d,
            state_dim: 0,
        };
        let mut kv = KvCache::new_of(spec, dtype, slots, tokens).unwrap();
        for s in 0..slots {
            kv.prepare(s, tokens).unwrap();
        }
        kv
    }

    /// Against f64 attention over the same bf16-rounded queries, keys and values (keys and values
    /// first through the cache's storage type): within the rounding of each weight to bf16
    /// (2⁻⁹ of `Σ p·|v|`) and f32 sums. Causal masks, windows and head groups that went wrong
    /// would move outputs by far more.
    #[test]
    fn bf16_attention_matches_f64_on_rounded_inputs() {
        if !runs_bf16() {
            return;
        }
        let tokens = 45;
        for d in [64, 128, 32, 96] {
            for dtype in [KvDtype::F32, KvDtype::F16] {
                for window in [None, Some(7), Some(40)] {
                    let c = Case {
                        heads: 6,
                        kv_heads: 2,
                        d,
                        window,
                    };
                    let (hd, kd) = (c.heads * d, c.kv_heads * d);
                    let data = vec![(
                        wave(tokens * hd, 1, 1.5),
                        wave(tokens * kd, 2, 1.5),
                        wave(tokens * kd, 3, 1.0),
                    )];
                    let mut kv = cache(&c, dtype, 1, tokens);
                    let rows: Vec<TokenRow> =
                        (0..tokens).map(|pos| TokenRow { slot: 0, pos }).collect();
                    let got = c.call(&mut kv, &rows, &data);
                    let stored = |x: f32| match dtype {
                        KvDtype::F16 => f16::from_f32(x).to_f32(),
                        _ => x,
                    };
                    let b = |x: f32| bf16::from_f32(x).to_f64();
                    let (q, k, v) = &data[0];
                    let group = c.heads / c.kv_heads;
                    for t in 0..tokens {
                        let lo = window.map_or(0, |w| t.saturating_sub(w));
                        for h in 0..c.heads {
                            let g = h / group;
                            let qh = &q[t * hd + h * d..][..d];
                            let s: Vec<f64> = (lo..=t)
                                .map(|j| {
                                    let kj = &k[j * kd + g * d..][..d];
                                    qh.iter()
                                        .zip(kj)
                                        .map(|(a, x)| b(*a) * b(stored(*x)))
                                        .sum::<f64>()
                                        * 0.3
                                })
                                .collect();
                            let m = s.iter().cloned().fold(f64::MIN, f64::max);
                            let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                            let z: f64 = e.iter().sum();
                            for col in 0..d {
                                let vj = |j: usize| b(stored(v[j * kd + g * d + col]));
                                let want: f64 = (lo..=t).map(|j| e[j - lo] / z * vj(j)).sum();
                                let mass: f64 = (lo..=t).map(|j| e[j - lo] / z * vj(j).abs()).sum();
                                let got = got[t * hd + h * d + col] as f64;
                                assert!(
                                    (got - want).abs() <= mass / 256.0 + 1e-5,
                                    "d={d} {dtype:?} window={window:?} t={t} h={h} c={col}: {got} vs {want}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    /// A token's output is the same bits whichever bf16 call computes it: the whole prompt at
    /// once, the prompt in two chunks (other task boundaries), or batched with another sequence.
    #[test]
    fn a_tokens_bf16_attention_does_not_depend_on_its_call() {
        if !runs_bf16() {
            return;
        }
        let tokens = 50;
        for window in [None, Some(20)] {
            let c = Case {
                heads: 9,
                kv_heads: 3,
                d: 64,
                window,
            };
            let (hd, kd) = (c.heads * c.d, c.kv_heads * c.d);
            let seq = (
                wave(tokens * hd, 4, 2.0),
                wave(tokens * kd, 5, 2.0),
                wave(tokens * kd, 6, 1.0),
            );
            let data = vec![seq.clone(), seq];
            let rows = |slot: usize, r: std::ops::Range<usize>| -> Vec<TokenRow> {
                r.map(|pos| TokenRow { slot, pos }).collect()
            };
            let whole = c.call(
                &mut cache(&c, KvDtype::F32, 1, tokens),
                &rows(0, 0..tokens),
                &data,
            );

            let mut kv = cache(&c, KvDtype::F32, 1, tokens);
            let mut chunked = c.call(&mut kv, &rows(0, 0..18), &data);
            chunked.extend(c.call(&mut kv, &rows(0, 18..tokens), &data));

            let mut kv = cache(&c, KvDtype::F32, 2, tokens);
            let first = c.call(&mut kv, &rows(0, 0..21), &data);
            let mut both = rows(1, 0..30);
            both.extend(rows(0, 21..tokens));
            let batched = c.call(&mut kv, &both, &data);
            let mut slot0 = first;
            slot0.extend_from_slice(&batched[30 * hd..]);
            let slot1 = &batched[..30 * hd];

            let same =
                |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(same(&whole, &chunked), "window={window:?}: chunked prompt");
            assert!(
                same(&whole, &slot0),
                "window={window:?}: batched, sequence 0"
            );
            assert!(
                same(&whole[..30 * hd], slot1),
                "window={window:?}: batched, sequence 1"
            );
        }
    }
}

//! Attention of a few decode rows over long contexts, shared evenly among the threads.
//!
//! With one task per (row, KV head) a single sequence has as many tasks as KV heads (three in
//! SmolLM2), too few to share among the threads; splitting a group's query heads into tasks of
//! their own (what [`super::attention`] otherwise does) has every task read its KV head's whole
//! cache, the same bytes once per query head, and at long contexts those come from memory:
//! SmolLM2 at 512 positions took the same ~55 µs a layer on 2 threads as on 1 (2-vCPU Intel
//! Xeon, `cargo bench --bench decode -- attention/decode_ctx512_layers`).
//!
//! So here the work is cut twice, with a barrier between, and every key and value is read once:
//! - *scores*: one task per (row, KV head, [`CHUNK`] positions), the dot products of every query
//!   head of the group with those keys; the task that finishes a (row, KV head) last turns its
//!   heads' scores into probabilities;
//! - *values*: one task per (row, KV head, run of output lanes), summing those lanes of every
//!   query head of the group over all positions.
//!
//! Each (row, head) gets [`super::attend`]'s arithmetic exactly: a score does not depend on
//! which keys are dotted with it, the softmax sees the whole row, and the weighted sum is one
//! chain per lane in position order whichever lanes a task takes (runs of 16, so vector lanes
//! stay vector lanes). An f32 cache is read in place; a narrower one is decoded by each task,
//! keys by the scores tasks and only its own lanes of the values by a values task, so nothing
//! is decoded twice. Head sizes must be a multiple of 16 (of the group, for grouped 8-bit
//! storage).

use std::cell::RefCell;
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::{
    keys_at_once, prefetch_blocks, score_keys, AtLevel, AttentionShape, Half, Ops, OutPtr,
};
use crate::backend::cpu::par;
use crate::backend::cpu::simd::{self, Level};
use crate::backend::TokenRow;
use crate::kv::{KvCache, KvDtype};

/// Positions per scores task: four default blocks, 16 KiB of keys for a head of 64.
const CHUNK: usize = 64;

/// The fewest attended positions for which the split pays for its second parallel loop; below
/// it the caller attends such rows alone, a task per KV head ([`few_pairs`]). One SmolLM2
/// decode row, 2 threads of the 2-vCPU Intel Xeon, every layer's cache cold, µs a layer,
/// split / alone: 10.1 / 7.7 at 64 positions, 11.3 / 10.3 at 96, 12.8 / 14.2 at 128, 22.2 /
/// 29.3 at 256.
const MIN_POSITIONS: usize = 112;

/// Whether [`attention`] takes these rows: every row its own tile (decode rows), fewer (row, KV
/// head) pairs than twice the threads, a head size that is a multiple of [`lane_unit`], and
/// every row attending at least [`MIN_POSITIONS`].
pub(super) fn applies(
    kv: &KvCache,
    s: &AttentionShape,
    rows: &[TokenRow],
    tiles: usize,
    threads: usize,
) -> bool {
    few_pairs(s, rows, tiles, threads)
        && s.head_dim.is_multiple_of(lane_unit(kv.layout().dtype))
        && rows.iter().all(|r| span(s, r).len() >= MIN_POSITIONS)
}

/// Whether the call's rows are decode rows (every row its own tile) with fewer (row, KV head)
/// pairs than twice the threads (2 or more): too few tasks of a KV head each to share among the
/// threads. Those the split does not take, over short contexts, are best attended a task per KV
/// head, by the calling thread alone or, in a step, spread over its team's parts
/// ([`crate::backend::cpu::keep_awake::parts`]): splitting a group's query heads between threads
/// had both cores fetch the same keys and values, which cost more than the work it shared
/// (SmolLM2 decode, 2 threads of the 2-vCPU Intel Xeon, 30 layers' caches cold, µs a layer,
/// query heads in parallel / KV heads alone: 5.2 / 1.4 at 8 positions, 6.9 / 3.3 at 32, 8.1 /
/// 5.7 at 48; `kiln-bench -p 0 -n 48 --profile`, attention 0.30–0.33 → 0.21–0.22 ms a step),
/// and KV heads in a rayon loop cost more than alone (0.32–0.38 against 0.27 ms a step at
/// 128 steps, family 6 model 207), while the team's parts gained 1–1.5% of the decode (one
/// process alternating, SmolLM2 Q4_1 and Q8_0, Qwen2.5-Coder-0.5B Q4_K_M). Over long contexts
/// the split's own loops stayed in rayon: its parts measured no faster at 512 steps.
pub(super) fn few_pairs(
    s: &AttentionShape,
    rows: &[TokenRow],
    tiles: usize,
    threads: usize,
) -> bool {
    threads >= 2 && !rows.is_empty() && tiles == rows.len() && rows.len() * s.kv_heads < 2 * threads
}

/// Output lanes per value-task unit: 16 (a vector), or the storage type's group if larger, so
/// that a task decodes whole groups.
fn lane_unit(dtype: KvDtype) -> usize {
    dtype.group().map_or(16, |g| g.max(16))
}

/// The positions row `r` attends.
fn span(s: &AttentionShape, r: &TokenRow) -> Range<usize> {
    s.window.map_or(0, |w| r.pos.saturating_sub(w))..r.pos + 1
}

/// Per row: its attended positions and where its heads' scores start (head `h` at
/// `start + h · positions`).
struct RowScores {
    span: Range<usize>,
    start: usize,
}

thread_local! {
    /// The calling thread's scores and probabilities of every row and head, shared by the
    /// tasks through a pointer.
    static SCORES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// A task's buffers, reused from task to task.
    static BUFS: RefCell<Bufs> = const {
        RefCell::new(Bufs { acc: Vec::new(), decoded: Vec::new(), pairs: Vec::new() })
    };
}

/// A task's buffers.
struct Bufs {
    /// Output lanes being summed (`group × head_dim`).
    acc: Vec<f32>,
    /// Keys or values of one block decoded from a narrower storage type.
    decoded: Vec<f32>,
    /// Per query head of the group: its output lanes and its probabilities.
    pairs: Vec<(*mut f32, *const f32)>,
}

/// The scores buffer, shared by tasks that each write (then read) their own parts.
#[derive(Clone, Copy)]
struct ScoresPtr(*mut f32);
unsafe impl Send for ScoresPtr {}
unsafe impl Sync for ScoresPtr {}

/// Attends `rows` (checked by [`applies`]; keys and values already written) into `out`
/// (`(data, stride, col)`, as [`super::attention`]'s).
///
/// # Safety
/// `q` holds every row's heads and `out` is valid for writes of them (asserted by the caller).
pub(super) unsafe fn attention(
    s: &AttentionShape,
    rows: &[TokenRow],
    q: (&[f32], usize, usize),
    kv: &KvCache,
    out: (OutPtr, usize, usize),
    threads: usize,
) {
    let d = s.head_dim;
    let mut layout = Vec::with_capacity(rows.len());
    let mut total = 0usize;
    for r in rows {
        let span = span(s, r);
        layout.push(RowScores {
            span: span.clone(),
            start: total,
        });
        total += s.heads * span.len();
    }
    // Scores tasks: (row, KV head, positions), and per (row, KV head) how many are left.
    let mut score_tasks = Vec::new();
    let mut left = Vec::with_capacity(rows.len() * s.kv_heads);
    for (i, l) in layout.iter().enumerate() {
        let chunks = l.span.len().div_ceil(CHUNK);
        for g in 0..s.kv_heads {
            left.push(AtomicUsize::new(chunks));
            for c in 0..chunks {
                let a = l.span.start + c * CHUNK;
                score_tasks.push((i, g, a..(a + CHUNK).min(l.span.end)));
            }
        }
    }
    // Values tasks: (row, KV head, lanes), the lanes in runs of `unit`, as few runs as give
    // every thread a task: a task that takes part of each value row shares that row's cache lines
    // with the tasks that take the rest, which costs more than the imbalance of whole rows.
    let unit = lane_unit(kv.layout().dtype);
    let units = d / unit;
    let pairs = rows.len() * s.kv_heads;
    let runs = threads.div_ceil(pairs).clamp(1, units);
    let per_run = units.div_ceil(runs);
    let level = simd::clamp(simd::level());
    // Taken out of the thread-local for the call rather than borrowed across its parallel
    // loops: while it waits in them this thread may run another step's jobs, whose attention
    // then finds the buffer empty and takes its own.
    let mut scores = SCORES.with_borrow_mut(std::mem::take);
    scores.clear();
    scores.resize(total, 0.0);
    let sp = ScoresPtr(scores.as_mut_ptr());
    let head = |i: usize, g: usize, sp: ScoresPtr| Head {
        s,
        kv,
        row: &rows[i],
        span: layout[i].span.clone(),
        kv_head: g,
        q: &q.0[i * q.1 + q.2..],
        scores: sp.0.wrapping_add(layout[i].start),
    };
    par::for_each(score_tasks.as_slice(), |(i, g, range)| {
        let h = head(*i, *g, sp);
        let left = &left[i * s.kv_heads + g];
        BUFS.with_borrow_mut(|bufs| dispatch_scores(level, &h, range.clone(), left, bufs));
    });
    par::for_each(0..pairs * runs, |t| {
        let (i, g, run) = (t / (s.kv_heads * runs), t / runs % s.kv_heads, t % runs);
        let cols = (run * per_run * unit).min(d)..((run + 1) * per_run * unit).min(d);
        if cols.is_empty() {
            return;
        }
        let h = head(i, g, sp);
        let o = out.0;
        let dst = o.0.add(i * out.1 + out.2);
        BUFS.with_borrow_mut(|bufs| dispatch_values(level, &h, cols, bufs, dst));
    });
    SCORES.with_borrow_mut(|kept| *kept = scores);
}

/// One (row, KV head) of the call.
struct Head<'a> {
    s: &'a AttentionShape,
    kv: &'a KvCache,
    row: &'a TokenRow,
    /// The positions the row attends.
    span: Range<usize>,
    kv_head: usize,
    /// The row's query (head `h` at `h · head_dim`).
    q: &'a [f32],
    /// The row's scores (head `h` at `h · span.len()`).
    scores: *mut f32,
}

/// [`scores`] at `level`.
unsafe fn dispatch_scores(
    level: Level,
    head: &Head,
    range: Range<usize>,
    left: &AtomicUsize,
    bufs: &mut Bufs,
) {
    match level {
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 => scores_avx2(head, range, left, bufs),
        #[cfg(target_arch = "x86_64")]
        Level::Avx512 | Level::Avx512Bf16 => scores_avx512(head, range, left, bufs),
        other => scores(&AtLevel(other), head, range, left, bufs),
    }
}

/// [`values`] at `level`.
unsafe fn dispatch_values(
    level: Level,
    head: &Head,
    cols: Range<usize>,
    bufs: &mut Bufs,
    out: *mut f32,
) {
    match level {
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 => values_avx2(head, cols, bufs, out),
        #[cfg(target_arch = "x86_64")]
        Level::Avx512 | Level::Avx512Bf16 => values_avx512(head, cols, bufs, out),
        other => values(&AtLevel(other), head, cols, bufs, out),
    }
}

/// # Safety
/// The CPU supports AVX2 and FMA; as [`scores`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn scores_avx2(head: &Head, range: Range<usize>, left: &AtomicUsize, bufs: &mut Bufs) {
    scores(&super::avx2::Avx2, head, range, left, bufs)
}

/// # Safety
/// The CPU supports AVX-512 F/BW/VL, AVX2 and FMA; as [`scores`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn scores_avx512(head: &Head, range: Range<usize>, left: &AtomicUsize, bufs: &mut Bufs) {
    scores(&super::avx512::Avx512, head, range, left, bufs)
}

/// # Safety
/// The CPU supports AVX2 and FMA; as [`values`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn values_avx2(head: &Head, cols: Range<usize>, bufs: &mut Bufs, out: *mut f32) {
    values(&super::avx2::Avx2, head, cols, bufs, out)
}

/// # Safety
/// The CPU supports AVX-512 F/BW/VL, AVX2 and FMA; as [`values`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn values_avx512(head: &Head, cols: Range<usize>, bufs: &mut Bufs, out: *mut f32) {
    values(&super::avx512::Avx512, head, cols, bufs, out)
}

/// The scores of positions `range` for every query head of the group: `q·k · scale`, sixteen,
/// eight or one key at a time as [`super::attend`] takes them (which changes no score). `left`
/// counts the (row, KV head)'s scores tasks not yet done: the last turns every head's scores
/// into probabilities.
///
/// # Safety
/// `head.scores` has room for the group's heads over `head.span`; `range` lies in the span.
#[inline(always)]
unsafe fn scores<O: Ops>(
    o: &O,
    head: &Head,
    range: Range<usize>,
    left: &AtomicUsize,
    bufs: &mut Bufs,
) {
    let s = head.s;
    let d = s.head_dim;
    let group = s.heads / s.kv_heads;
    let heads = head.kv_head * group..(head.kv_head + 1) * group;
    let n = head.span.len();
    let table = head.kv.page_table(head.row.slot);
    let bs = head.kv.layout().block_size;
    let in_place = head.kv.layout().dtype == KvDtype::F32;
    if in_place {
        prefetch_blocks(head.kv, (s, head.kv_head), table, range.clone(), Half::Keys);
    } else {
        bufs.decoded.resize(bs * d, 0.0);
    }
    let mut j = range.start;
    while j < range.end {
        let start = j - j % bs;
        let end = (start + bs).min(range.end);
        let block = table[j / bs];
        // Key of position `p` at `keys + (p - first) · d`.
        let (keys, first) = if in_place {
            let (k, _) = head.kv.pool().head_block_f32(s.layer, block, head.kv_head);
            (k.as_ptr(), start)
        } else {
            let rows = (j - start, end - j);
            let pool = head.kv.pool();
            pool.decode_cols(
                s.layer,
                block,
                head.kv_head,
                rows,
                false,
                0..d,
                &mut bufs.decoded,
            );
            (bufs.decoded.as_ptr(), j)
        };
        while j < end {
            let take = keys_at_once(j, end);
            let key = keys.add((j - first) * d);
            for h in heads.clone() {
                let q = &head.q[h * d..(h + 1) * d];
                let at = head.scores.add(h * n + j - head.span.start);
                score_keys(o, q, key, take, s.scale, at);
            }
            j += take;
        }
    }
    // AcqRel: this task's scores are published to, and the others' seen by, the last one.
    if left.fetch_sub(1, Ordering::AcqRel) == 1 {
        for h in heads {
            o.softmax(std::slice::from_raw_parts_mut(head.scores.add(h * n), n));
        }
    }
}

/// Lanes `cols` of every query head of the group: the values of the span weighted by the
/// heads' probabilities, in position order ([`Ops::weighted_sum_multi`]), into `out` (the
/// row's output, head `h` at `h · head_dim`).
///
/// # Safety
/// The group's probabilities are final; `out` is valid for writes of the group's heads.
#[inline(always)]
unsafe fn values<O: Ops>(o: &O, head: &Head, cols: Range<usize>, bufs: &mut Bufs, out: *mut f32) {
    let s = head.s;
    let d = s.head_dim;
    let group = s.heads / s.kv_heads;
    let h0 = head.kv_head * group;
    let n = head.span.len();
    let Bufs {
        acc,
        decoded,
        pairs,
    } = bufs;
    acc.clear();
    acc.resize(group * d, 0.0);
    let table = head.kv.page_table(head.row.slot);
    let bs = head.kv.layout().block_size;
    let in_place = head.kv.layout().dtype == KvDtype::F32;
    // In place, the outputs' lanes `cols` of `d`-wide value rows; decoded, lanes `0..w` of
    // rows of only those lanes, the outputs offset to match.
    let w = cols.len();
    let (lanes, offset) = if in_place {
        (cols.clone(), 0)
    } else {
        decoded.resize(bs * w, 0.0);
        (0..w, cols.start)
    };
    pairs.clear();
    pairs.extend((0..group).map(|ii| {
        (
            acc.as_mut_ptr().add(ii * d + offset),
            head.scores.add((h0 + ii) * n) as *const f32,
        )
    }));
    let (a, b) = (head.span.start, head.span.end);
    let mut start = a - a % bs;
    while start < b {
        let block = table[start / bs];
        let first = start.max(a);
        let count = (start + bs).min(b) - first;
        if in_place {
            let (_, values) = head.kv.pool().head_block_f32(s.layer, block, head.kv_head);
            let vals = &values[(first - start) * d..(first - start + count) * d];
            o.weighted_sum_multi(pairs, first - a, count, vals, d, lanes.clone());
        } else {
            let rows = (first - start, count);
            let pool = head.kv.pool();
            pool.decode_cols(
                s.layer,
                block,
                head.kv_head,
                rows,
                true,
                cols.clone(),
                decoded,
            );
            let vals = &decoded[..count * w];
            o.weighted_sum_multi(pairs, first - a, count, vals, w, lanes.clone());
        }
        start += bs;
    }
    for ii in 0..group {
        std::ptr::copy_nonoverlapping(
            acc.as_ptr().add(ii * d + cols.start),
            out.add((h0 + ii) * d + cols.start),
            cols.len(),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{one_head_at_a_time, smollm2_shape, wave};
    use super::*;
    use crate::graph::KvSpec;

    /// Split attention gives, bit for bit, what one head at a time through the `simd` entry
    /// points gives: one and two sequences of different lengths (not multiples of the block or
    /// the chunk), grouped-query heads, head sizes of one to eight runs of 16 lanes, full and
    /// windowed, every storage type, and as many lane runs as 2, 3 and 8 threads ask for.
    #[test]
    fn split_tasks_round_like_one_head_at_a_time() {
        let (heads, kv_heads) = (6, 2);
        let lens = [300usize, 181];
        let cases = [64, 16, 48, 128]
            .into_iter()
            .flat_map(|d| crate::kv::storage::ALL_KV_DTYPES.map(|t| (d, t)))
            .filter(|&(d, t)| d % lane_unit(t) == 0);
        for (d, dtype) in cases {
            for window in [None, Some(150)] {
                for seqs in [1, 2] {
                    let spec = KvSpec {
                        layers: 2,
                        kv_heads,
                        head_dim: d,
                        state_dim: 0,
                    };
                    let mut kv = KvCache::new_of(spec, dtype, 2, 320).unwrap();
                    for (slot, &len) in lens.iter().enumerate() {
                        kv.prepare(slot, len).unwrap();
                        let k = wave(len * kv_heads * d, 2 + slot);
                        let v = wave(len * kv_heads * d, 5 + slot);
                        for layer in 0..2 {
                            for p in 0..len {
                                let r = p * kv_heads * d..(p + 1) * kv_heads * d;
                                kv.write(layer, slot, p, &k[r.clone()], &v[r]);
                            }
                        }
                    }
                    let rows: Vec<TokenRow> = (0..seqs)
                        .map(|slot| TokenRow {
                            slot,
                            pos: lens[slot] - 1,
                        })
                        .collect();
                    let q = wave(seqs * heads * d, 1);
                    let shape = AttentionShape {
                        layer: 1,
                        heads,
                        kv_heads,
                        head_dim: d,
                        scale: 0.125,
                        window,
                    };
                    assert!(applies(&kv, &shape, &rows, rows.len(), 8));
                    let want = one_head_at_a_time(&kv, &shape, &rows, &q);
                    for threads in [2, 3, 8] {
                        let mut out = vec![f32::NAN; seqs * heads * d];
                        let ptr = OutPtr(out.as_mut_ptr());
                        // SAFETY: `q` and `out` hold every head of every row.
                        unsafe {
                            attention(
                                &shape,
                                &rows,
                                (&q, heads * d, 0),
                                &kv,
                                (ptr, heads * d, 0),
                                threads,
                            )
                        };
                        let same = out
                            .iter()
                            .zip(&want)
                            .all(|(a, b)| a.to_bits() == b.to_bits());
                        assert!(
                            same,
                            "d={d} {dtype:?} window={window:?} seqs={seqs} threads={threads}"
                        );
                    }
                }
            }
        }
    }

    /// Prefill tiles, short contexts, many rows and a single thread keep the task-per-head
    /// path; narrower storage does not.
    #[test]
    fn applies_only_to_few_long_decode_rows() {
        let spec = KvSpec {
            layers: 1,
            kv_heads: 3,
            head_dim: 64,
            state_dim: 0,
        };
        let kv = KvCache::new(spec, 4, 1024).unwrap();
        let shape = smollm2_shape();
        let row = |slot, pos| TokenRow { slot, pos };
        assert!(applies(&kv, &shape, &[row(0, 500)], 1, 2));
        assert!(!applies(&kv, &shape, &[row(0, 500)], 1, 1), "one thread");
        assert!(!applies(&kv, &shape, &[row(0, 40)], 1, 2), "short context");
        assert!(!applies(&kv, &shape, &[row(0, 100)], 1, 2), "short context");
        assert!(applies(&kv, &shape, &[row(0, 111)], 1, 2));
        assert!(few_pairs(&shape, &[row(0, 40)], 1, 2));
        assert!(!few_pairs(&shape, &[row(0, 40)], 1, 1), "one thread");
        assert!(
            !few_pairs(&shape, &[row(0, 40), row(1, 40)], 2, 2),
            "six pairs, two threads"
        );
        assert!(
            !few_pairs(&shape, &[row(0, 40), row(0, 41)], 1, 8),
            "a prefill tile"
        );
        let two = [row(0, 500), row(1, 700)];
        assert!(
            !applies(&kv, &shape, &two, 2, 2),
            "six tasks for two threads"
        );
        assert!(applies(&kv, &shape, &two, 2, 4));
        assert!(
            !applies(&kv, &shape, &[row(0, 500), row(0, 501)], 1, 8),
            "a prefill tile"
        );
        let windowed = AttentionShape {
            window: Some(32),
            ..shape
        };
        assert!(
            !applies(&kv, &windowed, &[row(0, 500)], 1, 2),
            "short window"
        );
        let kv16 = KvCache::new_of(spec, KvDtype::F16, 1, 1024).unwrap();
        assert!(applies(&kv16, &shape, &[row(0, 500)], 1, 2), "f16 storage");
    }
}

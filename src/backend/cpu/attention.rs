//! Attention over the KV cache for the CPU. Grouped-query heads share the KV head
//! `h / (heads / kv_heads)`, as `repeat_kv` does; one task takes up to eight consecutive tokens
//! of one sequence (one in decode) and the query heads of one KV head, so each cached key and
//! value (read in place, or decoded once from a narrower storage type) serves every head of its
//! group and every token of the task while it is in L1; the values of the positions all of a
//! task's tokens attend are summed for four (token, head) outputs per load (AVX-512; two on
//! AVX2, whose 16 registers hold 32 lanes of two). Per (token, head) the
//! arithmetic is fixed whatever the grouping: scores `q·k · scale` by the SIMD level's dot
//! product, a softmax in f32 (`simd::softmax_at`: vectorised `exp` on AVX2 and AVX-512), and the
//! values summed in position order with per-lane fused multiply-adds, as `simd::axpy` sums
//! them. On AVX2 and
//! AVX-512 the dot products and the weighted sum are inlined into one kernel that keeps output
//! lanes in registers across positions and reduces the scores of 8 (AVX2) or 16 keys
//! (AVX-512) together; on AVX2 a 64-element query stays in registers for the 16 keys it is
//! scored against, so each score's FMAs load only the key (their sums and order unchanged);
//! the scalar level calls the `simd` entry points. (On a Zen 5, SmolLM2 pp512
//! at 2 threads went from ~950–1,000 to ~1,100–1,270 tok/s when AVX-512 got its kernel, and to
//! ~1,350–1,500 with tasks of eight tokens.)

mod split;

use std::cell::RefCell;

use super::keep_awake;
use super::par;
use super::rope;
use super::simd::{self, Level};
use super::Numerics;
use crate::backend::TokenRow;
use crate::kv::{HeadRows, KvCache, KvDtype};
use crate::model::RopeStyle;

pub struct AttentionShape {
    pub layer: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
    /// Keys older than `pos - window` are not attended (sliding-window layers).
    pub window: Option<usize>,
}

/// The output rows, shared by tasks that each write their own heads of their own rows.
#[derive(Clone, Copy)]
pub(super) struct OutPtr(pub(super) *mut f32);
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

/// The rotary embedding that [`attention`] applies to its queries and keys itself, for a
/// caller that leaves them as the projection wrote them.
#[derive(Clone, Copy)]
pub struct Rotation<'a> {
    /// Per row of the call, `head_dim / 2` (cos, sin) pairs ([`rope::push_angles`]).
    pub angles: &'a [(f32, f32)],
    pub style: RopeStyle,
}

/// Appends `k`/`v` of every token to the cache, then attends. Keys and values are read through
/// the slot's page table in the cache's one layout ([`crate::kv::layout`]); with f32 storage the
/// arithmetic is exactly that of a contiguous cache.
///
/// `q`, `k`, `v`, `out` are row views: `(data, stride, col)` with row `t` at
/// `data[t·stride + col ..]`. With `rotate`, `q` and `k` are not yet rotated and every head
/// of them is rotated here as [`rope::apply`] rotates it. A decode row whose KV heads the
/// threads share ([`split::few_pairs`]) has each task rotate its own query heads and KV head
/// and write that head's key and value to the cache itself: the step's thread rotating and
/// writing every head, between the calls, had the other thread idle meanwhile and then read
/// lines just written on the other core. Elsewhere they are rotated up front, into buffers
/// the calling thread keeps. Calls that run [`Numerics::Bf16`]'s kernels
/// ([`super::matmul::bf16_applies`]) attend in bf16 products ([`super::attention_bf16`]) where
/// the head size allows; every other call as described here.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    numerics: Numerics,
    s: &AttentionShape,
    rows: &[TokenRow],
    q: (&[f32], usize, usize),
    k: (&[f32], usize, usize),
    v: (&[f32], usize, usize),
    kv: &mut KvCache,
    out: (&mut [f32], usize, usize),
    rotate: Option<Rotation<'_>>,
) {
    let d = s.head_dim;
    let kv_dim = s.kv_heads * d;
    let half = d / 2;
    if let Some(r) = rotate {
        assert!(
            r.angles.len() >= rows.len() * half,
            "attention: rotary angles for {} rows, {} rows",
            r.angles.len() / half.max(1),
            rows.len()
        );
    }
    // Tasks rotate and write their own heads ([`rotates_in_tasks`]), or everything is rotated
    // here first.
    let writer: Option<HeadRows> = match rotate {
        Some(_) if rotates_in_tasks(numerics, s, rows, kv) => {
            kv.head_rows(s.layer, rows[0].slot, rows[0].pos)
        }
        _ => None,
    };
    if let (Some(r), None) = (rotate, &writer) {
        // Buffers kept from call to call (a long context's decode steps come here every
        // layer), taken out while the call runs.
        let (mut qr, mut kr) = UP_FRONT.take();
        rotate_rows(s, rows, q, s.heads, r, &mut qr);
        rotate_rows(s, rows, k, s.kv_heads, r, &mut kr);
        let (qv, kv_) = ((&qr[..], s.heads * d, 0), (&kr[..], kv_dim, 0));
        attention(numerics, s, rows, qv, kv_, v, kv, out, None);
        UP_FRONT.set((qr, kr));
        return;
    }
    if writer.is_none() {
        for (t, r) in rows.iter().enumerate() {
            let kr = &k.0[t * k.1 + k.2..t * k.1 + k.2 + kv_dim];
            let vr = &v.0[t * v.1 + v.2..t * v.1 + v.2 + kv_dim];
            kv.write(s.layer, r.slot, r.pos, kr, vr);
        }
    }
    let kv = &*kv;
    let group = s.heads / s.kv_heads;
    let (out_data, out_stride, out_col) = out;
    assert!(
        rows.is_empty() || out_data.len() >= (rows.len() - 1) * out_stride + out_col + s.heads * d
    );
    for t in 0..rows.len() {
        assert!(
            q.0.len() >= t * q.1 + q.2 + s.heads * d,
            "attention query too short"
        );
    }
    #[cfg(target_arch = "x86_64")]
    if in_bf16(numerics, rows, d) {
        let out = (out_data.as_mut_ptr(), out_stride, out_col);
        // SAFETY: `in_bf16` (through `bf16_applies`) says the CPU has AVX512-BF16 at the
        // kernels' level and the head size is supported; bounds asserted above.
        unsafe { super::attention_bf16::attention(s, rows, q, kv, out) };
        return;
    }
    // Tasks take up to TILE_TOKENS consecutive rows of one slot (a prefill chunk's tokens share
    // every key and value they read). A few decode rows over long contexts are split by
    // positions and output lanes instead ([`split`]); over short contexts the calling thread
    // attends them alone. Otherwise a task takes a whole group of query heads, or one head over
    // an f32 cache where there are too few groups to share among the threads (a prefill of
    // one tile). A cache in another type keeps groups whole: each task
    // decodes the blocks it reads to f32, and a task per head decoded each KV head's once per
    // query head (SmolLM2 with a bf16 cache, one sequence of 1,024 tokens, 2 threads on an
    // Intel Xeon: 80 → 103–110 tok/s).
    let tiles = token_tiles(rows, TILE_TOKENS);
    let threads = par::threads();
    let ptr = OutPtr(out_data.as_mut_ptr());
    if split::applies(kv, s, rows, tiles.len(), threads) {
        // SAFETY: bounds asserted above.
        unsafe { split::attention(s, rows, q, kv, (ptr, out_stride, out_col), threads) };
        return;
    }
    // Decode rows with too few KV heads to share that the split did not take (short
    // contexts): a task per KV head, on the step's team or else the calling thread alone
    // ([`split::few_pairs`]).
    let alone = split::few_pairs(s, rows, tiles.len(), threads);
    let decodes = kv.layout().dtype != KvDtype::F32;
    let per_task = if alone || decodes || tiles.len() * s.kv_heads >= 2 * threads {
        group
    } else {
        1
    };
    let chunks = group / per_task;
    let level = simd::level();
    let task_of = |task: usize| {
        let tile = tiles[task / (s.kv_heads * chunks)].clone();
        let g = task % (s.kv_heads * chunks) / chunks;
        let h0 = g * group + task % chunks * per_task;
        let p = ptr;
        let heads = h0..h0 + per_task;
        let run = |q: &[f32], q_stride: usize| {
            let job = Task {
                s,
                rows: &rows[tile.clone()],
                kv_head: g,
                heads: heads.clone(),
                q,
                q_stride,
                // SAFETY (of the writes through it): each task writes its own heads of its own
                // rows; bounds asserted above.
                out: unsafe { p.0.add(tile.start * out_stride + out_col) },
                out_stride,
            };
            SCRATCH.with_borrow_mut(|scratch| match simd::clamp(level) {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: the clamped level says the CPU has AVX2 and FMA.
                Level::Avx2 => unsafe { attend_avx2(kv, &job, scratch) },
                #[cfg(target_arch = "x86_64")]
                // SAFETY: the clamped level says the CPU has AVX-512 F/BW/VL.
                Level::Avx512 | Level::Avx512Bf16 => unsafe { attend_avx512(kv, &job, scratch) },
                other => unsafe { attend(&AtLevel(other), kv, &job, scratch) },
            });
        };
        match (rotate, &writer) {
            (Some(r), Some(w)) => ROTATED.with_borrow_mut(|buf| {
                // One row (`rotates_in_tasks`): this task's query heads and KV head, rotated;
                // its key and value written before it reads them.
                buf.resize(s.heads * d + d, 0.0);
                let (qbuf, kbuf) = buf.split_at_mut(s.heads * d);
                let cs = &r.angles[..half];
                for h in heads.clone() {
                    let dst = &mut qbuf[h * d..(h + 1) * d];
                    dst.copy_from_slice(&q.0[q.2 + h * d..q.2 + (h + 1) * d]);
                    rope::apply(dst, d, r.style, cs);
                }
                kbuf.copy_from_slice(&k.0[k.2 + g * d..k.2 + (g + 1) * d]);
                rope::apply(kbuf, d, r.style, cs);
                // SAFETY: this task is the only one of KV head `g` (a task per KV head), and
                // the pool does not change during the call.
                unsafe { w.write(g, kbuf, &v.0[v.2 + g * d..v.2 + (g + 1) * d]) };
                run(qbuf, s.heads * d)
            }),
            _ => run(&q.0[tile.start * q.1 + q.2..], q.1),
        }
    };
    let tasks = 0..tiles.len() * s.kv_heads * chunks;
    // Such rows go to the step's team when it has one: its parts are cheap enough to share a
    // few KV heads (part `p` takes tasks `p`, `p + members`, …).
    let members = if alone { keep_awake::members() } else { 0 };
    if members >= 2 {
        let n = tasks.end;
        keep_awake::parts(&|p| (p..n).step_by(members).for_each(&task_of));
    } else if alone {
        tasks.for_each(task_of);
    } else {
        par::for_each(tasks, task_of);
    }
}

thread_local! {
    /// A task's rotated query heads (at their places in a row of every head) and its rotated
    /// key ([`attention`] with a [`Rotation`] its tasks apply).
    static ROTATED: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// The queries and keys of a call that [`attention`] rotates up front.
    static UP_FRONT: std::cell::Cell<(Vec<f32>, Vec<f32>)> =
        const { std::cell::Cell::new((Vec::new(), Vec::new())) };
}

/// Whether [`attention`] has its tasks rotate their own heads and write their own KV heads:
/// one decode row over an f32 cache that the call attends a task per KV head with whole
/// groups of query heads ([`split::few_pairs`], over contexts too short for [`split`]), in the
/// exact f32 products (not [`super::attention_bf16`]).
fn rotates_in_tasks(
    numerics: Numerics,
    s: &AttentionShape,
    rows: &[TokenRow],
    kv: &KvCache,
) -> bool {
    let threads = par::threads();
    !in_bf16(numerics, rows, s.head_dim)
        && rows.len() == 1
        && kv.layout().dtype == KvDtype::F32
        && s.head_dim.is_multiple_of(2)
        && split::few_pairs(s, rows, 1, threads)
        && !split::applies(kv, s, rows, 1, threads)
}

/// Whether [`attention`] attends these rows in bf16 products ([`super::attention_bf16`]):
/// calls that run [`Numerics::Bf16`]'s kernels ([`super::matmul::bf16_applies`]), with a head
/// size those products support.
fn in_bf16(numerics: Numerics, rows: &[TokenRow], head_dim: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        super::matmul::bf16_applies(numerics, rows.len())
            && super::attention_bf16::supports(head_dim)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (numerics, rows, head_dim);
        false
    }
}

/// `heads` heads of every row of `x`, each rotated by `r` ([`rope::apply`]), into `out` as
/// rows of `heads × head_dim`.
fn rotate_rows(
    s: &AttentionShape,
    rows: &[TokenRow],
    x: (&[f32], usize, usize),
    heads: usize,
    r: Rotation<'_>,
    out: &mut Vec<f32>,
) {
    let (d, width) = (s.head_dim, heads * s.head_dim);
    let half = d / 2;
    out.clear();
    for t in 0..rows.len() {
        let at = t * x.1 + x.2;
        out.extend_from_slice(&x.0[at..at + width]);
        let cs = &r.angles[t * half..(t + 1) * half];
        rope::apply(&mut out[t * width..], d, r.style, cs);
    }
}

/// The call's rows cut into runs of consecutive rows of one slot, at most `max` each: the
/// tokens of one task.
pub(super) fn token_tiles(rows: &[TokenRow], max: usize) -> Vec<std::ops::Range<usize>> {
    let mut tiles = Vec::new();
    let mut t0 = 0;
    while t0 < rows.len() {
        let mut t1 = t0 + 1;
        while t1 < rows.len() && t1 - t0 < max && rows[t1].slot == rows[t0].slot {
            t1 += 1;
        }
        tiles.push(t0..t1);
        t0 = t1;
    }
    tiles
}

/// Rows per task in prefill: their query heads' scores take `8 · group · positions` floats of
/// scratch, and each key and value is read once for all of them.
const TILE_TOKENS: usize = 8;

/// One task: tokens `rows` (consecutive rows of one slot), query heads `heads` (all of KV head
/// `kv_head`, or one of them).
struct Task<'a> {
    s: &'a AttentionShape,
    rows: &'a [TokenRow],
    kv_head: usize,
    heads: std::ops::Range<usize>,
    /// The first token's query row (heads at `h · head_dim`), the next `q_stride` further.
    q: &'a [f32],
    q_stride: usize,
    /// The first token's output row (heads at `h · head_dim`), the next `out_stride` further.
    out: *mut f32,
    out_stride: usize,
}

/// A thread's buffers, reused from task to task.
#[derive(Default)]
struct Scratch {
    /// `heads × positions` scores, then probabilities.
    scores: Vec<f32>,
    /// One block's keys and values decoded from a narrower storage type.
    keys: Vec<f32>,
    values: Vec<f32>,
    /// `tokens × heads × head_dim` outputs being summed.
    acc: Vec<f32>,
    /// Per token: first attended position, end, offset of its scores.
    spans: Vec<(usize, usize, usize)>,
    /// Per (token, head) of a task: its output being summed and its probabilities.
    pairs: Vec<(*mut f32, *const f32)>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// The arithmetic of a task, per SIMD level.
trait Ops {
    /// `Σ q[i]·k[i]`, rounded as `simd::dot_f32` rounds it.
    unsafe fn dot(&self, q: &[f32], k: &[f32]) -> f32;
    /// `acc[c] += Σ_j w[j] · values[j·d + c]` for the lanes `c` in `cols` of a `d`-wide output,
    /// in order of `j`, each term as `simd::axpy`. Whatever `cols`, a lane's arithmetic is the
    /// same as when all `0..d` are summed, provided `cols.start` is a multiple of 16 and
    /// `cols.end` is too or is `d` (the vector lanes stay vector lanes).
    unsafe fn weighted_sum(
        &self,
        acc: *mut f32,
        w: &[f32],
        values: &[f32],
        d: usize,
        cols: std::ops::Range<usize>,
    );
    /// [`Ops::weighted_sum`] for several outputs over the same `count` values: pair `p` is
    /// (`d` outputs, weights), its weights `w[skip..skip + count]`. By default one pair at a time.
    /// (`inline(always)`, as every method here: the kernels' intrinsics inline only into
    /// callers compiled with their target features.)
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn weighted_sum_multi(
        &self,
        pairs: &[(*mut f32, *const f32)],
        skip: usize,
        count: usize,
        values: &[f32],
        d: usize,
        cols: std::ops::Range<usize>,
    ) {
        for &(acc, w) in pairs {
            let w = std::slice::from_raw_parts(w.add(skip), count);
            self.weighted_sum(acc, w, values, d, cols.clone());
        }
    }
    /// The scores of one head to probabilities, as `simd::softmax_at` computes them.
    unsafe fn softmax(&self, scores: &mut [f32]);
    /// `out[j] = dot(q, keys[j·d..][..d]) · scale` for eight consecutive keys of `q.len()`
    /// elements, each rounded exactly as [`Ops::dot`] then the scale multiply round it; by
    /// default one [`Ops::dot`] at a time.
    #[inline(always)]
    unsafe fn dot8(&self, q: &[f32], keys: *const f32, scale: f32, out: *mut f32) {
        dot8_one_by_one(self, q, keys, scale, out)
    }
    /// As [`Ops::dot8`] for sixteen consecutive keys; by default two [`Ops::dot8`] calls.
    #[inline(always)]
    unsafe fn dot16(&self, q: &[f32], keys: *const f32, scale: f32, out: *mut f32) {
        self.dot8(q, keys, scale, out);
        self.dot8(q, keys.add(8 * q.len()), scale, out.add(8));
    }
}

/// [`Ops::dot8`] as eight [`Ops::dot`] calls.
#[inline(always)]
unsafe fn dot8_one_by_one<O: Ops + ?Sized>(
    o: &O,
    q: &[f32],
    keys: *const f32,
    scale: f32,
    out: *mut f32,
) {
    let d = q.len();
    for j in 0..8 {
        *out.add(j) = o.dot(q, std::slice::from_raw_parts(keys.add(j * d), d)) * scale;
    }
}

/// Through the `simd` entry points at a level.
struct AtLevel(Level);

impl Ops for AtLevel {
    #[inline(always)]
    unsafe fn dot(&self, q: &[f32], k: &[f32]) -> f32 {
        simd::dot_f32_at(self.0, q, k)
    }
    #[inline(always)]
    unsafe fn weighted_sum(
        &self,
        acc: *mut f32,
        w: &[f32],
        values: &[f32],
        d: usize,
        cols: std::ops::Range<usize>,
    ) {
        let acc = std::slice::from_raw_parts_mut(acc.add(cols.start), cols.len());
        for (j, &wj) in w.iter().enumerate() {
            simd::axpy_at(
                self.0,
                wj,
                &values[j * d + cols.start..j * d + cols.end],
                acc,
            );
        }
    }
    #[inline(always)]
    unsafe fn softmax(&self, scores: &mut [f32]) {
        simd::softmax_at(self.0, scores)
    }
}

/// The task under AVX2 + FMA with its arithmetic inlined.
///
/// # Safety
/// The CPU supports AVX2 and FMA; as [`attend`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn attend_avx2(kv: &KvCache, job: &Task, scratch: &mut Scratch) {
    attend(&avx2::Avx2, kv, job, scratch)
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::Ops;
    use crate::backend::cpu::simd::x86::{dot_256_body, softmax_256_body};

    pub(super) struct Avx2;

    /// `[lo(a) + hi(a) | lo(b) + hi(b)]`.
    #[inline(always)]
    unsafe fn halves(a: __m256, b: __m256) -> __m256 {
        _mm256_add_ps(
            _mm256_permute2f128_ps::<0x20>(a, b),
            _mm256_permute2f128_ps::<0x31>(a, b),
        )
    }

    /// Per 128-bit lane, `[p0 + p2, p1 + p3, q0 + q2, q1 + q3]`.
    #[inline(always)]
    unsafe fn pairs(p: __m256, q: __m256) -> __m256 {
        let (p, q) = (_mm256_castps_pd(p), _mm256_castps_pd(q));
        _mm256_add_ps(
            _mm256_castpd_ps(_mm256_unpacklo_pd(p, q)),
            _mm256_castpd_ps(_mm256_unpackhi_pd(p, q)),
        )
    }

    /// The eight keys' sums `s_j` (each `dot_256_body`'s four accumulators added) reduced
    /// across lanes as `dot_256_body` reduces one (`(s0+s4) + (s2+s6)` and `(s1+s5) + (s3+s7)`,
    /// then those two), for the eight together by a transposition, times `scale`, to `out`.
    #[inline(always)]
    unsafe fn reduced8(s: [__m256; 8], scale: f32, out: *mut f32) {
        // [a_j | a_j+1] with a_j = lo(s_j) + hi(s_j) = [s0+s4, s1+s5, s2+s6, s3+s7].
        let p01 = halves(s[0], s[1]);
        let p23 = halves(s[2], s[3]);
        let p45 = halves(s[4], s[5]);
        let p67 = halves(s[6], s[7]);
        // [e0 f0 e2 f2 | e1 f1 e3 f3] with e = a0 + a2, f = a1 + a3.
        let r = pairs(p01, p23);
        let t = pairs(p45, p67);
        let e = _mm256_shuffle_ps::<0b10_00_10_00>(r, t);
        let f = _mm256_shuffle_ps::<0b11_01_11_01>(r, t);
        // [r0 r2 r4 r6 | r1 r3 r5 r7] back to key order.
        let v = _mm256_permutevar8x32_ps(
            _mm256_add_ps(e, f),
            _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7),
        );
        _mm256_storeu_ps(out, _mm256_mul_ps(v, _mm256_set1_ps(scale)));
    }

    /// A 64-element query in eight registers.
    #[inline(always)]
    unsafe fn query64(q: &[f32]) -> [__m256; 8] {
        assert!(q.len() == 64);
        let mut v = [_mm256_setzero_ps(); 8];
        for (i, v) in v.iter_mut().enumerate() {
            *v = _mm256_loadu_ps(q.as_ptr().add(8 * i));
        }
        v
    }

    /// [`Ops::dot8`] for 64-element keys with the query in registers: per key the four
    /// accumulators of `dot_256_body` (elements `8u..8u + 8`, then `32 + 8u..`), added as it
    /// adds them, then [`reduced8`].
    #[inline(always)]
    unsafe fn keys8_d64(q: &[__m256; 8], keys: *const f32, scale: f32, out: *mut f32) {
        let mut s = [_mm256_setzero_ps(); 8];
        for (j, sj) in s.iter_mut().enumerate() {
            let kp = keys.add(j * 64);
            let mut acc = [_mm256_setzero_ps(); 4];
            for i in 0..2 {
                for (u, a) in acc.iter_mut().enumerate() {
                    let o = 32 * i + 8 * u;
                    *a = _mm256_fmadd_ps(q[4 * i + u], _mm256_loadu_ps(kp.add(o)), *a);
                }
            }
            *sj = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        }
        reduced8(s, scale, out);
    }

    impl Ops for Avx2 {
        #[inline(always)]
        unsafe fn dot(&self, q: &[f32], k: &[f32]) -> f32 {
            debug_assert_eq!(q.len(), k.len());
            dot_256_body(q.as_ptr(), k.as_ptr(), q.len())
        }

        #[inline(always)]
        unsafe fn softmax(&self, scores: &mut [f32]) {
            softmax_256_body(scores.as_mut_ptr(), scores.len())
        }

        /// Keys of a multiple of 32 elements: each key's four accumulators and their sum are
        /// `dot_256_body`'s; its horizontal sum (`(s0+s4) + (s2+s6)` and `(s1+s5) + (s3+s7)`,
        /// then those two) is done for the eight keys together by a transposition, which saves
        /// the eight separate reductions and scalar stores. Other lengths: one dot at a time.
        #[inline(always)]
        unsafe fn dot8(&self, q: &[f32], keys: *const f32, scale: f32, out: *mut f32) {
            let d = q.len();
            if !d.is_multiple_of(32) {
                return super::dot8_one_by_one(self, q, keys, scale, out);
            }
            if d == 64 {
                return keys8_d64(&query64(q), keys, scale, out);
            }
            let qp = q.as_ptr();
            let mut s = [_mm256_setzero_ps(); 8];
            for (j, sj) in s.iter_mut().enumerate() {
                let kp = keys.add(j * d);
                let mut acc = [_mm256_setzero_ps(); 4];
                let mut i = 0;
                while i < d {
                    for (u, a) in acc.iter_mut().enumerate() {
                        let o = i + 8 * u;
                        *a = _mm256_fmadd_ps(
                            _mm256_loadu_ps(qp.add(o)),
                            _mm256_loadu_ps(kp.add(o)),
                            *a,
                        );
                    }
                    i += 32;
                }
                *sj = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
            }
            reduced8(s, scale, out);
        }

        /// As two [`Ops::dot8`] calls; a 64-element query is loaded into registers once for
        /// the sixteen keys.
        #[inline(always)]
        unsafe fn dot16(&self, q: &[f32], keys: *const f32, scale: f32, out: *mut f32) {
            if q.len() == 64 {
                let qv = query64(q);
                keys8_d64(&qv, keys, scale, out);
                keys8_d64(&qv, keys.add(8 * 64), scale, out.add(8));
            } else {
                self.dot8(q, keys, scale, out);
                self.dot8(q, keys.add(8 * q.len()), scale, out.add(8));
            }
        }

        /// Two outputs at a time over the same values, 32 lanes of each in eight registers
        /// across every position, so each value vector loaded serves both (one output's 64
        /// lanes at a time took eight vector loads and a broadcast per eight FMAs, more than
        /// two 32-byte loads a cycle can feed). Per lane the arithmetic is
        /// [`Ops::weighted_sum`]'s. Lanes past the last multiple of 32, and a last odd output,
        /// go through [`Ops::weighted_sum`].
        #[inline(always)]
        unsafe fn weighted_sum_multi(
            &self,
            pairs: &[(*mut f32, *const f32)],
            skip: usize,
            count: usize,
            values: &[f32],
            d: usize,
            cols: std::ops::Range<usize>,
        ) {
            assert!(cols.end <= d && values.len() >= count * d);
            let pv = values.as_ptr();
            let mut two = pairs.chunks_exact(2);
            let whole = cols.start + (cols.end - cols.start) / 32 * 32;
            for p in two.by_ref() {
                let ((pa, wa), (pb, wb)) = (p[0], p[1]);
                let (wa, wb) = (wa.add(skip), wb.add(skip));
                let mut c = cols.start;
                while c < whole {
                    let mut a = [_mm256_setzero_ps(); 4];
                    let mut b = [_mm256_setzero_ps(); 4];
                    for u in 0..4 {
                        a[u] = _mm256_loadu_ps(pa.add(c + 8 * u));
                        b[u] = _mm256_loadu_ps(pb.add(c + 8 * u));
                    }
                    for j in 0..count {
                        let v = pv.add(j * d + c);
                        let (xa, xb) = (_mm256_set1_ps(*wa.add(j)), _mm256_set1_ps(*wb.add(j)));
                        for u in 0..4 {
                            let vu = _mm256_loadu_ps(v.add(8 * u));
                            a[u] = _mm256_fmadd_ps(xa, vu, a[u]);
                            b[u] = _mm256_fmadd_ps(xb, vu, b[u]);
                        }
                    }
                    for u in 0..4 {
                        _mm256_storeu_ps(pa.add(c + 8 * u), a[u]);
                        _mm256_storeu_ps(pb.add(c + 8 * u), b[u]);
                    }
                    c += 32;
                }
                if whole < cols.end {
                    for (acc, w) in [(pa, wa), (pb, wb)] {
                        let w = std::slice::from_raw_parts(w, count);
                        self.weighted_sum(acc, w, values, d, whole..cols.end);
                    }
                }
            }
            for &(acc, w) in two.remainder() {
                let w = std::slice::from_raw_parts(w.add(skip), count);
                self.weighted_sum(acc, w, values, d, cols.clone());
            }
        }

        /// 64 output lanes at a time stay in eight registers across every position; per lane
        /// the sum is `simd::axpy`'s (`fma(w, v, acc)` in position order; the scalar lanes past
        /// the last whole vector `acc + w·v`, rounded twice).
        #[inline(always)]
        unsafe fn weighted_sum(
            &self,
            pa: *mut f32,
            w: &[f32],
            values: &[f32],
            d: usize,
            cols: std::ops::Range<usize>,
        ) {
            assert!(cols.end <= d && values.len() >= w.len() * d);
            let pv = values.as_ptr();
            let (mut c, end) = (cols.start, cols.end);
            while c + 64 <= end {
                let mut a = [_mm256_setzero_ps(); 8];
                for (u, a) in a.iter_mut().enumerate() {
                    *a = _mm256_loadu_ps(pa.add(c + 8 * u));
                }
                for (j, &wj) in w.iter().enumerate() {
                    let vw = _mm256_set1_ps(wj);
                    let v = pv.add(j * d + c);
                    for (u, a) in a.iter_mut().enumerate() {
                        *a = _mm256_fmadd_ps(vw, _mm256_loadu_ps(v.add(8 * u)), *a);
                    }
                }
                for (u, a) in a.iter().enumerate() {
                    _mm256_storeu_ps(pa.add(c + 8 * u), *a);
                }
                c += 64;
            }
            while c + 8 <= end {
                let mut a = _mm256_loadu_ps(pa.add(c));
                for (j, &wj) in w.iter().enumerate() {
                    a = _mm256_fmadd_ps(_mm256_set1_ps(wj), _mm256_loadu_ps(pv.add(j * d + c)), a);
                }
                _mm256_storeu_ps(pa.add(c), a);
                c += 8;
            }
            for lane in c..end {
                for (j, &wj) in w.iter().enumerate() {
                    *pa.add(lane) += wj * *pv.add(j * d + lane);
                }
            }
        }
    }
}

/// The task under AVX-512 with its arithmetic inlined.
///
/// # Safety
/// The CPU supports AVX-512 F/BW/VL, AVX2 and FMA; as [`attend`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn attend_avx512(kv: &KvCache, job: &Task, scratch: &mut Scratch) {
    attend(&avx512::Avx512, kv, job, scratch)
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::Ops;
    use crate::backend::cpu::simd::x86::{
        dot_512_lanes, hsum16_finish, hsum16_quarter, softmax_512_body, tail_mask16,
    };

    pub(super) struct Avx512;

    impl Avx512 {
        /// Scores of `N` (at most 16) consecutive keys: each key's lanes are `dot_512`'s
        /// before its reduction, and the sixteen reductions are one
        /// [`hsum16_512`](crate::backend::cpu::simd::x86::hsum16_512), which sums in
        /// `_mm512_reduce_add_ps`'s order, so each score is `dot_512`'s bit for bit. The
        /// keys go four at a time, those of one [`hsum16_quarter`], each four reduced at once
        /// (the sixteen vectors of lanes had gone through a stack array, a store and a load per
        /// key). Heads of 64 and 128 (the usual sizes) keep the query in registers.
        #[inline(always)]
        unsafe fn dots<const N: usize>(q: &[f32], keys: *const f32, scale: f32, out: *mut f32) {
            let s = match q.len() {
                64 => Self::reduced::<N, 1>(q, keys),
                128 => Self::reduced::<N, 2>(q, keys),
                _ => Self::reduced::<N, 0>(q, keys),
            };
            let s = _mm512_mul_ps(s, _mm512_set1_ps(scale));
            _mm512_mask_storeu_ps(out, tail_mask16(N), s);
        }

        /// Lane `j` of the result: the reduced lanes of key `j < N` (zero past `N`). Lane
        /// `4·a + b` of [`hsum16_512`] sums `v[a + 4·b]`, so key `j` takes slot
        /// `j / 4 + 4·(j mod 4)`, and quarter `b` holds keys `b`, `4 + b`, `8 + b`, `12 + b`.
        #[inline(always)]
        unsafe fn reduced<const N: usize, const C: usize>(q: &[f32], keys: *const f32) -> __m512 {
            let d = q.len();
            let mut u = [_mm512_setzero_ps(); 4];
            for (b, u) in u.iter_mut().enumerate() {
                let mut v = [_mm512_setzero_ps(); 4];
                for (a, v) in v.iter_mut().enumerate() {
                    let j = 4 * a + b;
                    if j < N {
                        let key = keys.add(j * d);
                        *v = if C == 0 {
                            dot_512_lanes(q.as_ptr(), key, d)
                        } else {
                            lanes_fixed::<C>(q.as_ptr(), key)
                        };
                    }
                }
                *u = hsum16_quarter(v);
            }
            hsum16_finish(u)
        }
    }

    /// `dot_512_lanes` for `64·C` elements, its loop unrolled (four chains, each `C`
    /// multiply-adds from zero in order, then `(a0 + a1) + (a2 + a3)`): the same lanes.
    #[inline(always)]
    unsafe fn lanes_fixed<const C: usize>(q: *const f32, k: *const f32) -> __m512 {
        let mut acc = [_mm512_setzero_ps(); 4];
        for c in 0..C {
            for (u, acc) in acc.iter_mut().enumerate() {
                let o = 64 * c + 16 * u;
                *acc = _mm512_fmadd_ps(_mm512_loadu_ps(q.add(o)), _mm512_loadu_ps(k.add(o)), *acc);
            }
        }
        _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]))
    }

    impl Ops for Avx512 {
        #[inline(always)]
        unsafe fn dot(&self, q: &[f32], k: &[f32]) -> f32 {
            debug_assert_eq!(q.len(), k.len());
            _mm512_reduce_add_ps(dot_512_lanes(q.as_ptr(), k.as_ptr(), q.len()))
        }

        #[inline(always)]
        unsafe fn softmax(&self, scores: &mut [f32]) {
            softmax_512_body(scores.as_mut_ptr(), scores.len())
        }

        #[inline(always)]
        unsafe fn dot8(&self, q: &[f32], keys: *const f32, scale: f32, out: *mut f32) {
            Self::dots::<8>(q, keys, scale, out)
        }

        #[inline(always)]
        unsafe fn dot16(&self, q: &[f32], keys: *const f32, scale: f32, out: *mut f32) {
            Self::dots::<16>(q, keys, scale, out)
        }

        /// Four outputs at a time share each value vector's loads: 16 accumulators (64 lanes
        /// of four outputs) across the positions, then 16 lanes of four outputs at a time;
        /// lanes past the last 16 go one output at a time, masked. Every lane is
        /// `simd::axpy`'s `fma(w, v, acc)` in position order. (Six outputs' 24 accumulators,
        /// four value vectors and six broadcasts did not fit the 32 registers: the compiler
        /// spilled and shuffled accumulators every position; four are 4–6% faster on
        /// SmolLM2's pp512 attention on a Zen 5.)
        #[inline(always)]
        unsafe fn weighted_sum_multi(
            &self,
            pairs: &[(*mut f32, *const f32)],
            skip: usize,
            count: usize,
            values: &[f32],
            d: usize,
            cols: std::ops::Range<usize>,
        ) {
            assert!(values.len() >= count * d && cols.end <= d);
            let pv = values.as_ptr();
            let end = cols.end;
            let mut rest = cols.start;
            for group in pairs.chunks(4) {
                let mut c = cols.start;
                while c + 64 <= end {
                    outputs_of::<4>(group, skip, count, pv, d, c);
                    c += 64;
                }
                while c + 16 <= end {
                    outputs_of::<1>(group, skip, count, pv, d, c);
                    c += 16;
                }
                rest = c;
            }
            if rest < end {
                for &(acc, w) in pairs {
                    tail16(acc, w.add(skip), count, pv, d, rest..end);
                }
            }
        }

        /// One output through [`Ops::weighted_sum_multi`].
        #[inline(always)]
        unsafe fn weighted_sum(
            &self,
            acc: *mut f32,
            w: &[f32],
            values: &[f32],
            d: usize,
            cols: std::ops::Range<usize>,
        ) {
            self.weighted_sum_multi(&[(acc, w.as_ptr())], 0, w.len(), values, d, cols)
        }
    }

    /// Lanes `cols` of one output (values `d` apart), 16 at a time (masked at the end).
    #[inline(always)]
    unsafe fn tail16(
        pa: *mut f32,
        w: *const f32,
        count: usize,
        pv: *const f32,
        d: usize,
        cols: std::ops::Range<usize>,
    ) {
        let mut c = cols.start;
        while c < cols.end {
            let m = tail_mask16((cols.end - c).min(16));
            let mut a = _mm512_maskz_loadu_ps(m, pa.add(c));
            for j in 0..count {
                let v = _mm512_maskz_loadu_ps(m, pv.add(j * d + c));
                a = _mm512_fmadd_ps(_mm512_set1_ps(*w.add(j)), v, a);
            }
            _mm512_mask_storeu_ps(pa.add(c), m, a);
            c += 16;
        }
    }

    /// [`outputs`] for the 1–4 outputs of `group`.
    #[inline(always)]
    unsafe fn outputs_of<const U: usize>(
        group: &[(*mut f32, *const f32)],
        skip: usize,
        count: usize,
        pv: *const f32,
        d: usize,
        c: usize,
    ) {
        match group.len() {
            4 => outputs::<4, U>(group, skip, count, pv, d, c),
            3 => outputs::<3, U>(group, skip, count, pv, d, c),
            2 => outputs::<2, U>(group, skip, count, pv, d, c),
            _ => outputs::<1, U>(group, skip, count, pv, d, c),
        }
    }

    /// Lanes `c..c + 16·U` of `P` outputs over `count` values (weights from `skip`).
    #[inline(always)]
    unsafe fn outputs<const P: usize, const U: usize>(
        group: &[(*mut f32, *const f32)],
        skip: usize,
        count: usize,
        pv: *const f32,
        d: usize,
        c: usize,
    ) {
        let mut a = [[_mm512_setzero_ps(); U]; P];
        for (p, a) in a.iter_mut().enumerate() {
            for (u, a) in a.iter_mut().enumerate() {
                *a = _mm512_loadu_ps(group[p].0.add(c + 16 * u));
            }
        }
        let w: [*const f32; P] = std::array::from_fn(|p| group[p].1.wrapping_add(skip));
        for j in 0..count {
            let v = pv.add(j * d + c);
            let mut vs = [_mm512_setzero_ps(); U];
            for (u, vs) in vs.iter_mut().enumerate() {
                *vs = _mm512_loadu_ps(v.add(16 * u));
            }
            for (p, a) in a.iter_mut().enumerate() {
                let wj = _mm512_set1_ps(*w[p].add(j));
                for (u, a) in a.iter_mut().enumerate() {
                    *a = _mm512_fmadd_ps(wj, vs[u], *a);
                }
            }
        }
        for (p, a) in a.iter().enumerate() {
            for (u, a) in a.iter().enumerate() {
                _mm512_storeu_ps(group[p].0.add(c + 16 * u), *a);
            }
        }
    }
}

/// One block of the task's KV head: keys and values of rows `0..rows_here`, read in place (f32
/// storage) or decoded into `kbuf`/`vbuf`.
#[inline(always)]
unsafe fn block_rows(
    kv: &KvCache,
    job: &Task,
    block: u32,
    rows_here: usize,
    kbuf: &mut [f32],
    vbuf: &mut [f32],
) -> (*const f32, *const f32) {
    if kv.layout().dtype == KvDtype::F32 {
        let (k, v) = kv.pool().head_block_f32(job.s.layer, block, job.kv_head);
        (k.as_ptr(), v.as_ptr())
    } else {
        kv.pool()
            .decode_rows(job.s.layer, block, job.kv_head, 0, rows_here, kbuf, vbuf);
        (kbuf.as_ptr(), vbuf.as_ptr())
    }
}

/// Which half of an f32 KV block [`prefetch_blocks`] requests.
#[derive(Clone, Copy)]
enum Half {
    Keys,
    Values,
}

/// Requests the cache lines of positions `range` of KV head `kv_head` of layer `s.layer`, keys
/// or values, from an f32 pool (a hint: no effect on results, none off x86-64).
fn prefetch_blocks(
    kv: &KvCache,
    (s, kv_head): (&AttentionShape, usize),
    table: &[u32],
    range: std::ops::Range<usize>,
    half: Half,
) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let bs = kv.layout().block_size;
        let d = s.head_dim;
        let mut start = range.start - range.start % bs;
        while start < range.end {
            let Some(&block) = table.get(start / bs) else {
                return;
            };
            let rows = bs.min(range.end - start);
            let (k, v) = kv.pool().head_block_f32(s.layer, block, kv_head);
            let data = match half {
                Half::Keys => k,
                Half::Values => v,
            };
            let bytes = (rows * d).min(data.len()) * 4;
            let p = data.as_ptr() as *const i8;
            for off in (0..bytes).step_by(64) {
                // SAFETY: a prefetch of an address inside `data` (no access, no fault).
                unsafe { _mm_prefetch::<_MM_HINT_T0>(p.add(off)) };
            }
            start += bs;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (kv, s, kv_head, table, range, half);
}

/// How many keys from position `j` (of a run ending at `end`) are scored together: sixteen,
/// then eight, then one (each score is rounded the same way in all three).
#[inline(always)]
fn keys_at_once(j: usize, end: usize) -> usize {
    if j + 16 <= end {
        16
    } else if j + 8 <= end {
        8
    } else {
        1
    }
}

/// The scores `q·k · scale` of `take` ([`keys_at_once`]) consecutive keys from `key` into
/// `at..`.
#[inline(always)]
unsafe fn score_keys<O: Ops>(
    o: &O,
    q: &[f32],
    key: *const f32,
    take: usize,
    scale: f32,
    at: *mut f32,
) {
    match take {
        16 => o.dot16(q, key, scale, at),
        8 => o.dot8(q, key, scale, at),
        _ => *at = o.dot(q, std::slice::from_raw_parts(key, q.len())) * scale,
    }
}

/// Values of positions `a..b` into the outputs of `pairs` (each: `d` outputs, its probability
/// for position `a`), block by block, in position order ([`Ops::weighted_sum_multi`]). A
/// function, not a closure, so that it is compiled with the caller's target features.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn sum_values<O: Ops>(
    o: &O,
    kv: &KvCache,
    job: &Task,
    table: &[u32],
    n_max: usize,
    (kbuf, vbuf): (&mut Vec<f32>, &mut Vec<f32>),
    pairs: &[(*mut f32, *const f32)],
    a: usize,
    b: usize,
) {
    let d = job.s.head_dim;
    let bs = kv.layout().block_size;
    let mut start = a - a % bs;
    while start < b {
        let rows_here = bs.min(n_max - start);
        let (_, values) = block_rows(kv, job, table[start / bs], rows_here, kbuf, vbuf);
        let first = start.max(a);
        let count = (start + rows_here).min(b) - first;
        let vals = std::slice::from_raw_parts(values.add((first - start) * d), count * d);
        o.weighted_sum_multi(pairs, first - a, count, vals, d, 0..d);
        start += bs;
    }
}

/// Scores, softmax and weighted values for one task. Each (token, head) gets the same
/// arithmetic whatever the task: its scores one by one (grouped 16 or 8 keys at a time, which
/// changes no score), its softmax, and its weighted sum as one chain per lane in position order,
/// which the task splits into the positions before those every token of the task attends, those,
/// and the ones after (causal: the later tokens' own), summing the shared part for four outputs
/// at a time ([`Ops::weighted_sum_multi`]).
///
/// # Safety
/// `job.out` is valid for writes of the task's heads of its rows; `job.q` holds them.
#[inline(always)]
unsafe fn attend<O: Ops>(o: &O, kv: &KvCache, job: &Task, scratch: &mut Scratch) {
    let s = job.s;
    let d = s.head_dim;
    let hc = job.heads.len();
    let table = kv.page_table(job.rows[0].slot);
    let layout = *kv.layout();
    let bs = layout.block_size;
    let f32_in_place = layout.dtype == KvDtype::F32;
    let Scratch {
        scores,
        keys: kbuf,
        values: vbuf,
        acc,
        spans,
        pairs,
    } = scratch;
    if !f32_in_place {
        kbuf.resize(bs * d, 0.0);
        vbuf.resize(bs * d, 0.0);
    }
    // Each token's attended positions `lo..n` and where its heads' scores start.
    spans.clear();
    let mut total = 0;
    for r in job.rows {
        let lo = s.window.map_or(0, |w| r.pos.saturating_sub(w));
        let n = r.pos + 1;
        spans.push((lo, n, total));
        total += hc * (n - lo);
    }
    let lo_min = spans.iter().map(|p| p.0).min().unwrap_or(0);
    let n_max = spans.iter().map(|p| p.1).max().unwrap_or(0);
    // Every score is written below (each token's positions, every head): a reused buffer
    // keeps its old contents meanwhile, instead of being zeroed (up to 48 KiB a prefill task).
    if scores.len() < total {
        scores.resize(total, 0.0);
    }
    let qh = |i: usize, h: usize| &job.q[i * job.q_stride + h * d..i * job.q_stride + (h + 1) * d];
    let first_block = lo_min - lo_min % bs;
    // A task of a few rows requests its keys all at once: its blocks lie anywhere in the pool,
    // and a decode row reads each once, so waiting on them one block after another left the
    // 16-sequence decode step waiting on DRAM in its key and value loads (`perf`). A task of
    // more rows spends thousands of cycles on each block, and requesting everything up front
    // (up to 128 KiB of keys and values, more than L1, for a 512-token prefill's last tasks)
    // took 2–3% of a 512-token prefill's attention in the requests alone (`perf`, one
    // thread): it requests each next block's keys while it scores the current one.
    let upfront = f32_in_place && job.rows.len() < 4;
    if upfront {
        prefetch_blocks(kv, (s, job.kv_head), table, first_block..n_max, Half::Keys);
    }
    let mut start = first_block;
    while start < n_max {
        let rows_here = bs.min(n_max - start);
        let (keys, _) = block_rows(kv, job, table[start / bs], rows_here, kbuf, vbuf);
        let end = start + rows_here;
        if f32_in_place && !upfront && end < n_max {
            prefetch_blocks(
                kv,
                (s, job.kv_head),
                table,
                end..n_max.min(end + bs),
                Half::Keys,
            );
        }
        let mut j = start.max(lo_min);
        while j < end {
            let g = keys_at_once(j, end);
            for (i, &(lo, n, base)) in spans.iter().enumerate() {
                let positions = n - lo;
                if j >= lo && j + g <= n {
                    let key = keys.add((j - start) * d);
                    for (ii, h) in job.heads.clone().enumerate() {
                        let at = scores.as_mut_ptr().add(base + ii * positions + j - lo);
                        score_keys(o, qh(i, h), key, g, s.scale, at);
                    }
                } else {
                    let (from, to) = (j.max(lo), (j + g).min(n));
                    if g > 1 && (to.saturating_sub(from)) * 4 > g {
                        // A token that attends part of the group (the causal diagonal): the
                        // whole group (rows the cache holds) scored together, each key as
                        // alone, and its own kept; one by one, a key cost several of a
                        // group's.
                        let key = keys.add((j - start) * d);
                        let mut part = [0f32; 16];
                        for (ii, h) in job.heads.clone().enumerate() {
                            score_keys(o, qh(i, h), key, g, s.scale, part.as_mut_ptr());
                            let row = base + ii * positions;
                            scores[row + from - lo..row + to - lo]
                                .copy_from_slice(&part[from - j..to - j]);
                        }
                    } else {
                        for jj in from..to {
                            let key = std::slice::from_raw_parts(keys.add((jj - start) * d), d);
                            for (ii, h) in job.heads.clone().enumerate() {
                                scores[base + ii * positions + jj - lo] =
                                    o.dot(qh(i, h), key) * s.scale;
                            }
                        }
                    }
                }
            }
            j += g;
        }
        start += bs;
    }
    if upfront {
        // The values, while the softmax runs.
        prefetch_blocks(
            kv,
            (s, job.kv_head),
            table,
            first_block..n_max,
            Half::Values,
        );
    }
    for &(lo, n, base) in spans.iter() {
        for head in scores[base..base + hc * (n - lo)].chunks_exact_mut(n - lo) {
            o.softmax(head);
        }
    }
    acc.clear();
    acc.resize(job.rows.len() * hc * d, 0.0);
    // Positions every token attends; before and after them, each token's own. (Sliding windows
    // can leave none: then each pair sums its own positions.)
    let shared_lo = spans.iter().map(|p| p.0).max().unwrap_or(0);
    let shared_end = spans.iter().map(|p| p.1).min().unwrap_or(0);
    // Pair (token i, head ii): its outputs, and its probability for position `at`.
    let pair = |acc: &mut Vec<f32>, (i, ii): (usize, usize), at: usize| {
        let (lo, n, base) = spans[i];
        let w = scores.as_ptr().add(base + ii * (n - lo) + at - lo);
        (acc.as_mut_ptr().add((i * hc + ii) * d), w)
    };
    let bufs = (&mut *kbuf, &mut *vbuf);
    if shared_lo >= shared_end {
        for (i, &(lo, n, _)) in spans.iter().enumerate() {
            for ii in 0..hc {
                let one = [pair(acc, (i, ii), lo)];
                sum_values(o, kv, job, table, n_max, (bufs.0, bufs.1), &one, lo, n);
            }
        }
    } else {
        for (i, &(lo, _, _)) in spans.iter().enumerate() {
            for ii in 0..hc {
                let one = [pair(acc, (i, ii), lo)];
                sum_values(
                    o,
                    kv,
                    job,
                    table,
                    n_max,
                    (bufs.0, bufs.1),
                    &one,
                    lo,
                    shared_lo,
                );
            }
        }
        pairs.clear();
        for i in 0..spans.len() {
            for ii in 0..hc {
                pairs.push(pair(acc, (i, ii), shared_lo));
            }
        }
        sum_values(
            o,
            kv,
            job,
            table,
            n_max,
            (bufs.0, bufs.1),
            pairs,
            shared_lo,
            shared_end,
        );
        for (i, &(_, n, _)) in spans.iter().enumerate() {
            for ii in 0..hc {
                let one = [pair(acc, (i, ii), shared_end)];
                sum_values(
                    o,
                    kv,
                    job,
                    table,
                    n_max,
                    (bufs.0, bufs.1),
                    &one,
                    shared_end,
                    n,
                );
            }
        }
    }
    for i in 0..job.rows.len() {
        for (ii, h) in job.heads.clone().enumerate() {
            std::ptr::copy_nonoverlapping(
                acc.as_ptr().add((i * hc + ii) * d),
                job.out.add(i * job.out_stride + h * d),
                d,
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::KvSpec;

    /// `n` values in [−1, 1) from `seed`: test queries, keys and values.
    pub(super) fn wave(n: usize, seed: usize) -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 2654435761 + seed) % 1000) as f32 / 500.0 - 1.0)
            .collect()
    }

    /// [`attention`] in exact numerics over contiguous rows of `q`, `k` and `v`, checked bit for
    /// bit against [`one_head_at_a_time`] (`what` names the case).
    fn assert_rounds_like_one_head_at_a_time(
        shape: &AttentionShape,
        rows: &[TokenRow],
        (q, k, v): (&[f32], &[f32], &[f32]),
        kv: &mut KvCache,
        what: &str,
    ) {
        let (hd, kd) = (
            shape.heads * shape.head_dim,
            shape.kv_heads * shape.head_dim,
        );
        let mut out = vec![f32::NAN; rows.len() * hd];
        attention(
            Numerics::Exact,
            shape,
            rows,
            (q, hd, 0),
            (k, kd, 0),
            (v, kd, 0),
            kv,
            (&mut out, hd, 0),
            None,
        );
        let want = one_head_at_a_time(kv, shape, rows, q);
        let same = out
            .iter()
            .zip(&want)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "{what}");
    }

    /// Every head of every row (queries `heads × head_dim` apart) attended on its own through
    /// the `simd` entry points at the process's level: the reference the task layouts match.
    pub(super) fn one_head_at_a_time(
        kv: &KvCache,
        shape: &AttentionShape,
        rows: &[TokenRow],
        q: &[f32],
    ) -> Vec<f32> {
        let (heads, d) = (shape.heads, shape.head_dim);
        let mut want = vec![0.0; rows.len() * heads * d];
        let mut scratch = Scratch::default();
        for (t, row) in rows.iter().enumerate() {
            for h in 0..heads {
                let job = Task {
                    s: shape,
                    rows: std::slice::from_ref(row),
                    kv_head: h / (heads / shape.kv_heads),
                    heads: h..h + 1,
                    q: &q[t * heads * d..],
                    q_stride: heads * d,
                    out: want[t * heads * d..].as_mut_ptr(),
                    out_stride: heads * d,
                };
                // SAFETY: `want` holds every head of row `t`, `q` its queries.
                unsafe { attend(&AtLevel(simd::level()), kv, &job, &mut scratch) };
            }
        }
        want
    }

    /// The grouped tasks (and on AVX2 the inlined kernel) give bit for bit what one head at a
    /// time through the `simd` entry points gives: f32 and f16 storage, grouped-query heads,
    /// head sizes with 64-lane chunks, 8-lane vectors and scalar lanes, full and windowed.
    #[test]
    fn grouped_tasks_round_like_one_head_at_a_time() {
        let (heads, kv_heads, tokens) = (6, 2, 21);
        for d in [64, 72, 67, 5] {
            for dtype in [KvDtype::F32, KvDtype::F16] {
                for window in [None, Some(7), Some(2)] {
                    let spec = KvSpec {
                        layers: 1,
                        kv_heads,
                        head_dim: d,
                        state_dim: 0,
                    };
                    let mut kv = KvCache::new_of(spec, dtype, 1, 32).unwrap();
                    kv.prepare(0, tokens).unwrap();
                    let q = wave(tokens * heads * d, 1);
                    let k = wave(tokens * kv_heads * d, 2);
                    let v = wave(tokens * kv_heads * d, 3);
                    let rows: Vec<TokenRow> =
                        (0..tokens).map(|pos| TokenRow { slot: 0, pos }).collect();
                    let shape = AttentionShape {
                        layer: 0,
                        heads,
                        kv_heads,
                        head_dim: d,
                        scale: 0.125,
                        window,
                    };
                    assert_rounds_like_one_head_at_a_time(
                        &shape,
                        &rows,
                        (&q, &k, &v),
                        &mut kv,
                        &format!("d={d} {dtype:?} window={window:?}"),
                    );
                }
            }
        }
    }

    /// SmolLM2's attention heads (9 query, 3 KV, 64 wide), layer 0 of one.
    pub(super) fn smollm2_shape() -> AttentionShape {
        AttentionShape {
            layer: 0,
            heads: 9,
            kv_heads: 3,
            head_dim: 64,
            scale: 0.125,
            window: None,
        }
    }

    /// A one-layer cache of `dtype` for `shape`'s KV heads, slot `i` holding keys and values at
    /// every position below `lens[i] − 1` (the last is written by the call under test).
    fn decode_cache(shape: &AttentionShape, dtype: KvDtype, lens: &[usize]) -> KvCache {
        let kd = shape.kv_heads * shape.head_dim;
        let spec = KvSpec {
            layers: 1,
            kv_heads: shape.kv_heads,
            head_dim: shape.head_dim,
            state_dim: 0,
        };
        let mut kv = KvCache::new_of(spec, dtype, lens.len(), 256).unwrap();
        for (slot, &len) in lens.iter().enumerate() {
            kv.prepare(slot, len).unwrap();
            let k = wave(len * kd, 2 + slot);
            let v = wave(len * kd, 5 + slot);
            for p in 0..len - 1 {
                let r = p * kd..(p + 1) * kd;
                kv.write(0, slot, p, &k[r.clone()], &v[r]);
            }
        }
        kv
    }

    /// One decode row per slot of [`decode_cache`] (at its last position), each a call of its
    /// own, then all of them in one call.
    fn decode_calls(lens: &[usize]) -> Vec<Vec<TokenRow>> {
        let one = |slot: usize| TokenRow {
            slot,
            pos: lens[slot] - 1,
        };
        (0..lens.len())
            .map(|slot| vec![one(slot)])
            .chain(std::iter::once((0..lens.len()).map(one).collect()))
            .collect()
    }

    /// Decode rows on two threads, whichever way they go (alone over short contexts, or in a
    /// step on its team's parts; split over long ones; tasks of a group when there are enough
    /// rows to share), give bit for bit what one head at a time gives.
    #[test]
    fn decode_rows_on_two_threads_round_like_one_head_at_a_time() {
        let shape = smollm2_shape();
        let (heads, kv_heads, d) = (shape.heads, shape.kv_heads, shape.head_dim);
        let lens = [8usize, 40, 100, 200];
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .expect("a 2-thread pool");
        for dtype in [KvDtype::F32, KvDtype::F16] {
            let mut kv = decode_cache(&shape, dtype, &lens);
            for rows in decode_calls(&lens) {
                let q = wave(rows.len() * heads * d, 1);
                let k = wave(rows.len() * kv_heads * d, 7);
                let v = wave(rows.len() * kv_heads * d, 9);
                pool.install(|| {
                    assert_rounds_like_one_head_at_a_time(
                        &shape,
                        &rows,
                        (&q, &k, &v),
                        &mut kv,
                        &format!("{dtype:?} rows {rows:?}"),
                    )
                });
                pool.install(|| {
                    keep_awake::during(2, || {
                        let team = keep_awake::keepers_present(2);
                        assert_rounds_like_one_head_at_a_time(
                            &shape,
                            &rows,
                            (&q, &k, &v),
                            &mut kv,
                            &format!("{dtype:?} rows {rows:?} in a step (team: {team})"),
                        )
                    })
                });
            }
        }
    }

    /// Queries and keys rotated inside the call ([`Rotation`]: by each task for its own heads,
    /// with its own KV head's row written by it, where a decode row's KV heads are shared; else
    /// up front) give bit for bit the outputs and cache rows of rotating them first: f32 and
    /// f16 storage, each rope style, on two threads alone and in a step, over contexts short
    /// and long enough to split, and a call of several rows.
    #[test]
    fn rotating_inside_matches_rotating_first() {
        let shape = smollm2_shape();
        let d = shape.head_dim;
        let (hd, kd) = (shape.heads * d, shape.kv_heads * d);
        let lens = [8usize, 40, 200];
        let inv_freq: Vec<f32> = (0..d / 2)
            .map(|i| 1.0 / 10000f32.powf(2.0 * i as f32 / d as f32))
            .collect();
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .expect("a 2-thread pool");
        let calls = decode_calls(&lens);
        let styles = [
            RopeStyle::HalfSplit,
            RopeStyle::Interleaved,
            RopeStyle::HalfSplitNegated,
        ];
        for dtype in [KvDtype::F32, KvDtype::F16] {
            for style in styles {
                for rows in &calls {
                    let q = wave(rows.len() * hd, 1);
                    let k = wave(rows.len() * kd, 7);
                    let v = wave(rows.len() * kd, 9);
                    let mut angles = Vec::new();
                    for r in rows {
                        rope::push_angles(&inv_freq, r.pos, &mut angles);
                    }
                    let (mut qr, mut kr) = (q.clone(), k.clone());
                    for (t, cs) in angles.chunks_exact(d / 2).enumerate() {
                        rope::apply(&mut qr[t * hd..(t + 1) * hd], d, style, cs);
                        rope::apply(&mut kr[t * kd..(t + 1) * kd], d, style, cs);
                    }
                    for in_step in [false, true] {
                        let run = |q: &[f32], k: &[f32], rotate: Option<Rotation<'_>>| {
                            let mut kv = decode_cache(&shape, dtype, &lens);
                            let mut out = vec![f32::NAN; rows.len() * hd];
                            let call = |kv: &mut KvCache, out: &mut Vec<f32>| {
                                attention(
                                    Numerics::Exact,
                                    &shape,
                                    rows,
                                    (q, hd, 0),
                                    (k, kd, 0),
                                    (&v, kd, 0),
                                    kv,
                                    (out, hd, 0),
                                    rotate,
                                )
                            };
                            pool.install(|| {
                                if in_step {
                                    keep_awake::during(2, || call(&mut kv, &mut out))
                                } else {
                                    call(&mut kv, &mut out)
                                }
                            });
                            let mut written = Vec::new();
                            for r in rows {
                                let (mut kw, mut vw) = (vec![0.0; kd], vec![0.0; kd]);
                                kv.read(0, r.slot, r.pos, &mut kw, &mut vw);
                                written.extend(kw.into_iter().chain(vw));
                            }
                            (out, written)
                        };
                        let inside = run(
                            &q,
                            &k,
                            Some(Rotation {
                                angles: &angles,
                                style,
                            }),
                        );
                        let first = run(&qr, &kr, None);
                        let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                        let what = format!("{dtype:?} {style:?} rows {rows:?} in step {in_step}");
                        assert_eq!(bits(&inside.0), bits(&first.0), "outputs, {what}");
                        assert_eq!(bits(&inside.1), bits(&first.1), "cache rows, {what}");
                    }
                }
            }
        }
    }

    /// One query attending over keys it matches exactly picks out those values.
    #[test]
    fn causal_gqa_attention_matches_a_direct_computation() {
        let (heads, kv_heads, d) = (4, 2, 3);
        let spec = KvSpec {
            layers: 1,
            kv_heads,
            head_dim: d,
            state_dim: 0,
        };
        let mut kv = KvCache::new(spec, 1, 8).unwrap();
        kv.prepare(0, 3).unwrap();
        let t = 3;
        let q: Vec<f32> = (0..t * heads * d)
            .map(|i| ((i * 7) % 5) as f32 * 0.3 - 0.5)
            .collect();
        let k: Vec<f32> = (0..t * kv_heads * d)
            .map(|i| ((i * 3) % 7) as f32 * 0.2 - 0.4)
            .collect();
        let v: Vec<f32> = (0..t * kv_heads * d).map(|i| i as f32 * 0.1).collect();
        let rows: Vec<TokenRow> = (0..t).map(|pos| TokenRow { slot: 0, pos }).collect();
        let mut out = vec![0.0; t * heads * d];
        let shape = AttentionShape {
            layer: 0,
            heads,
            kv_heads,
            head_dim: d,
            scale: 0.5,
            window: None,
        };
        attention(
            Numerics::Exact,
            &shape,
            &rows,
            (&q, heads * d, 0),
            (&k, kv_heads * d, 0),
            (&v, kv_heads * d, 0),
            &mut kv,
            (&mut out, heads * d, 0),
            None,
        );
        for ti in 0..t {
            for h in 0..heads {
                let g = h / 2;
                let qh = &q[ti * heads * d + h * d..][..d];
                let s: Vec<f64> = (0..=ti)
                    .map(|j| {
                        let kj = &k[j * kv_heads * d + g * d..][..d];
                        qh.iter().zip(kj).map(|(a, b)| (a * b) as f64).sum::<f64>() * 0.5
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::MIN, f64::max);
                let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for c in 0..d {
                    let want: f64 = (0..=ti)
                        .map(|j| e[j] / z * v[j * kv_heads * d + g * d + c] as f64)
                        .sum();
                    let got = out[ti * heads * d + h * d + c] as f64;
                    assert!(
                        (want - got).abs() < 1e-6,
                        "t={ti} h={h} c={c}: {got} vs {want}"
                    );
                }
            }
        }
    }
}

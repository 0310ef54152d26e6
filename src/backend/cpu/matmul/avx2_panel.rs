//! The AVX2 kernel for calls of more than one token (prefill chunks, batched decode rows,
//! speculative verification), after BLIS: the weights of 16 outputs are packed into a k-major
//! panel (`panel[k][16]`, f32, one cache line per k position; bf16 widened, quantized tiles
//! already dequantized), and a register tile of 6 tokens × 16 outputs walks it with 12
//! accumulators: per k position two aligned weight loads, six broadcasts of the tokens'
//! activations and twelve FMAs, with no horizontal reductions. The dot-product tile it replaced
//! (4 rows × 2 tokens along k) loaded six vectors and widened four per eight FMAs and reduced
//! every sum across lanes.
//!
//! Two things keep the FMAs fed at prefill sizes, where a call's activations (1.2 MB for 512
//! tokens of 576) are larger than L2 and came from L3 once per panel:
//! - the activations of the call's full 6-token tiles are packed once per call
//!   ([`PackedTokens`]: `[tile][k][6]`, shared by every task), so a tile reads one sequential
//!   stream instead of six rows `ldx` apart;
//! - up to four panels are packed before the tokens pass over them ([`panels_per_pass`]), each
//!   tile meeting all of them while it is in L1, so the activations stream once per four
//!   panels.
//!
//! Together: SmolLM2-135M pp512 at 2 threads from ~390 to ~486 tok/s (BF16) and ~406 to ~492
//! (Q4_1) (medians of five or six interleaved `kiln-bench -p 512 -n 0 -t 2 -r 2` pairs, the old
//! paths behind a temporary switch, AMD EPYC Zen 3). The matmuls alone reach ~140 GFLOP/s of
//! the two cores' 188 (one core's FMA peak, measured, is 94). A later host of the same kind
//! (2026-12-03) clocked higher: ten independent FMA chains ran at 120 GFLOP/s a core, this
//! kernel's inner loop alone (a C copy over 86 packed tiles, one to four panels a pass) at
//! 94–100, `cargo bench --bench kernels -- 'gemm/f32/1536x576x512'` at 81–88, and SmolLM2
//! Q8_0's pp512 matmuls at 2 threads (`kiln-bench --profile`) at 151–162 of the 240. Blocking k
//! so that a panel's block stays in L1 (96 to 192 positions) changed nothing measurable.
//!
//! Each output is summed in k order by one fused multiply-add chain from zero, whatever the tile
//! width, the token's place in the call or the number of tokens, so every token of a
//! multi-token call rounds alike; a one-token call takes the GEMV of [`super::avx2`], whose
//! eight-lane partial sums round differently.

use std::arch::x86_64::*;
use std::cell::RefCell;

use super::x86::tok_ptrs;
use super::Job;
use crate::backend::cpu::par;
use crate::backend::cpu::simd::x86::Load;

/// Outputs per panel: two 8-lane vectors.
const NR: usize = 16;
/// Tokens per register tile: 6 × 2 accumulators, two weight vectors and a broadcast take 15 of
/// the 16 ymm registers.
const MR: usize = 6;

/// One k position of a panel: the weights of its 16 outputs, one cache line.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([f32; NR]);

thread_local! {
    /// Per-thread packed panels ([`panels_per_pass`] of `k` lines each: 36 KiB a panel for
    /// k = 576).
    static PANEL: RefCell<Vec<Line>> = const { RefCell::new(Vec::new()) };
    /// The largest buffer of a [`PackedTokens`] this thread dropped, for its next call: a
    /// 512-token call's tiles take megabytes (as much as its activations), which a fresh
    /// allocation would fault in anew.
    static TOKENS: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Calls of fewer tokens read the activation rows directly: packing pays for itself over the
/// call's panels, but a short call's rows stay in L1/L2 anyway.
pub(super) const PACK_MIN_TOKENS: usize = 4 * MR;

/// Tiles packed by one parallel task: about 10 KiB of activations a tile (k = 576), so a task
/// packs ~160 KiB.
const PACK_TILES_PER_TASK: usize = 16;

/// A call's full tiles of [`MR`] tokens, each stored k-major (`[k][MR]`, the tokens of one k
/// position side by side), tile `i` holding tokens `MR·i .. MR·i + MR`. Built once per call
/// (in parallel over the current rayon pool) and read by every task's panels; the tokens past
/// the last full tile are read from their rows.
pub(super) struct PackedTokens {
    data: Vec<f32>,
    k: usize,
    tiles: usize,
}

impl PackedTokens {
    /// The full tiles of `tokens` rows of `k` activations, `ldx` apart, in `x`.
    ///
    /// # Panics
    /// If `x` is shorter than the rows.
    pub(super) fn new(x: &[f32], ldx: usize, tokens: usize, k: usize) -> PackedTokens {
        assert!(tokens == 0 || x.len() >= (tokens - 1) * ldx + k);
        let tiles = tokens / MR;
        let tile_len = k * MR;
        // Every float is written below: a reused buffer keeps its old contents meanwhile.
        let mut data = TOKENS.with_borrow_mut(std::mem::take);
        data.resize(tiles * tile_len, 0.0);
        let pack_tiles = |first: usize, out: &mut [f32]| {
            for (i, tile) in out.chunks_exact_mut(tile_len).enumerate() {
                let rows: [&[f32]; MR] =
                    std::array::from_fn(|j| &x[((first + i) * MR + j) * ldx..][..k]);
                pack_tile(rows, tile);
            }
        };
        if tiles <= PACK_TILES_PER_TASK {
            pack_tiles(0, &mut data);
        } else {
            par::for_each_chunk_mut(&mut data, PACK_TILES_PER_TASK * tile_len, |c, out| {
                pack_tiles(c * PACK_TILES_PER_TASK, out)
            });
        }
        PackedTokens { data, k, tiles }
    }
}

impl Drop for PackedTokens {
    fn drop(&mut self) {
        let data = std::mem::take(&mut self.data);
        TOKENS.with_borrow_mut(|kept| {
            if data.capacity() > kept.capacity() {
                *kept = data;
            }
        });
    }
}

/// Six rows of `k` activations into `out` (`k × MR` floats) k-major, eight k positions at a
/// time through the AVX2 transpose where the CPU has it.
fn pack_tile(rows: [&[f32]; MR], out: &mut [f32]) {
    if crate::backend::cpu::simd::level() >= crate::backend::cpu::simd::Level::Avx2 {
        // SAFETY: the CPU has AVX2 (checked); `out` holds `k × MR` floats, each row `k`.
        unsafe { pack_tile_avx2(rows, out) }
    } else {
        for (kk, o) in out.chunks_exact_mut(MR).enumerate() {
            for (o, r) in o.iter_mut().zip(rows) {
                *o = r[kk];
            }
        }
    }
}

/// [`pack_tile`] on AVX2: each block of eight k positions is transposed as an 8 × 8 block
/// (two zero rows) and each of its columns stored as eight floats at the position's six, the
/// next store overwriting the two extra ones; the block's last column is stored masked to six.
///
/// # Safety
/// The CPU supports AVX2; every row holds `out.len() / MR` floats.
#[target_feature(enable = "avx2,fma")]
unsafe fn pack_tile_avx2(rows: [&[f32]; MR], out: &mut [f32]) {
    let k = out.len() / MR;
    let o = out.as_mut_ptr();
    let mut kk = 0;
    while kk + 8 <= k {
        let mut v = [_mm256_setzero_ps(); 8];
        for (v, r) in v.iter_mut().zip(rows) {
            *v = _mm256_loadu_ps(r.as_ptr().add(kk));
        }
        let c = transpose8(v);
        for (i, c) in c.iter().enumerate().take(7) {
            _mm256_storeu_ps(o.add((kk + i) * MR), *c);
        }
        let six = _mm256_setr_epi32(-1, -1, -1, -1, -1, -1, 0, 0);
        _mm256_maskstore_ps(o.add((kk + 7) * MR), six, c[7]);
        kk += 8;
    }
    for kk in kk..k {
        for (j, r) in rows.iter().enumerate() {
            *o.add(kk * MR + j) = r[kk];
        }
    }
}

/// Panels packed before the tokens pass over them, by the panel's size: as many as fit in
/// 256 KiB (half of a Zen 3's L2), at most four (two at k = 1536). Each tile of tokens meets
/// every one of them while it is in L1, so the call's activations stream from L3 once per
/// group instead of once per panel. (Two, four and eight panels a pass ran alike, within the
/// noise, at k = 576; one was ~10% slower at 2 threads.)
fn panels_per_pass(k: usize) -> usize {
    (256 * 1024 / (k.max(1) * std::mem::size_of::<Line>())).clamp(1, 4)
}

/// The outputs of the panels packed for one pass over the tokens ([`panels_per_pass`]):
/// quantized weights are dequantized this many rows at a time.
pub(super) fn rows_per_pass(k: usize) -> usize {
    NR * panels_per_pass(k)
}

/// `job.rows` for `job.tokens > 1`, 16 outputs at a time.
///
/// # Safety
/// The CPU supports AVX2 and FMA; `job` describes valid memory (see `matmul_rows_at`) and `w`
/// holds `job.rows.end` rows of `job.k` elements.
#[inline(always)]
pub(super) unsafe fn panel_rows<W: Load>(w: *const W, job: &Job) {
    let group = panels_per_pass(job.k);
    PANEL.with_borrow_mut(|panel| {
        panel.resize(group * job.k, Line([0.0; NR]));
        // SAFETY: as this function's; the buffer holds `group` panels of `job.k` lines. The
        // work is in a function of its own because a closure is compiled without the caller's
        // target features.
        unsafe { panels(w, job, panel.as_mut_ptr(), group) }
    })
}

/// # Safety
/// As [`panel_rows`], with `panel` valid for `group · job.k` lines.
#[target_feature(enable = "avx2,fma")]
unsafe fn panels<W: Load>(w: *const W, job: &Job, panel: *mut Line, group: usize) {
    let k = job.k;
    let packed = job.xp.filter(|p| p.k == k);
    let full_tiles = packed.map_or(0, |p| p.tiles);
    let end = job.rows.end;
    let mut n0 = job.rows.start;
    while n0 < end {
        // Up to `group` panels of 16 outputs (the last maybe fewer), packed one after another.
        let count = (end - n0).div_ceil(NR).min(group);
        let at = |g: usize| (n0 + g * NR, (end - n0 - g * NR).min(NR), panel.add(g * k));
        for g in 0..count {
            let (n, nr, p) = at(g);
            pack::<W, NR>(w, k, k, n, nr, p as *mut f32);
        }
        let mut t = 0;
        while t + MR <= job.tokens {
            let i = t / MR;
            for g in 0..count {
                let (n, nr, p) = at(g);
                match packed {
                    Some(a) if i < full_tiles => {
                        packed_tile(p, a.data.as_ptr().add(i * k * MR), job, n, nr, t)
                    }
                    _ => tile::<MR>(p, job, n, nr, t),
                }
            }
            t += MR;
        }
        for g in 0..count {
            let (n, nr, p) = at(g);
            match job.tokens - t {
                5 => tile::<5>(p, job, n, nr, t),
                4 => tile::<4>(p, job, n, nr, t),
                3 => tile::<3>(p, job, n, nr, t),
                2 => tile::<2>(p, job, n, nr, t),
                1 => tile::<1>(p, job, n, nr, t),
                _ => {}
            }
        }
        n0 += (end - n0).min(count * NR);
    }
}

/// Rows `n..n + nr` (`nr ≤ P`, `P` a multiple of 8) of the `k`-column matrix at `w` (rows
/// `stride` elements apart) into a panel of `k` lines of `P` floats (`out`, 32-byte aligned),
/// transposed eight rows by eight columns at a time; rows past `nr` are zero. Shared with the
/// AVX-512 kernels ([`super::avx512_panel`]), which call it from their own AVX-512 functions
/// (for weights, and to put a few tokens' activations in lanes).
#[inline(always)]
pub(super) unsafe fn pack<W: Load, const P: usize>(
    w: *const W,
    stride: usize,
    k: usize,
    n: usize,
    nr: usize,
    out: *mut f32,
) {
    for r0 in (0..P).step_by(8) {
        let mut kk = 0;
        while kk + 8 <= k {
            // A whole group of eight rows loads without a test per row (the common case).
            let mut v = [_mm256_setzero_ps(); 8];
            if r0 + 8 <= nr {
                for (i, v) in v.iter_mut().enumerate() {
                    *v = W::ld8(w.add((n + r0 + i) * stride + kk));
                }
            } else {
                for (i, v) in v.iter_mut().enumerate().take(nr.saturating_sub(r0)) {
                    *v = W::ld8(w.add((n + r0 + i) * stride + kk));
                }
            }
            let c = transpose8(v);
            for (i, c) in c.iter().enumerate() {
                _mm256_store_ps(out.add((kk + i) * P + r0), *c);
            }
            kk += 8;
        }
        for kk in kk..k {
            for i in 0..8 {
                *out.add(kk * P + r0 + i) = if r0 + i < nr {
                    (*w.add((n + r0 + i) * stride + kk)).get()
                } else {
                    0.0
                };
            }
        }
    }
}

/// Rows of an 8 × 8 block to its columns.
#[inline(always)]
unsafe fn transpose8(r: [__m256; 8]) -> [__m256; 8] {
    // Pairs of rows interleaved, then quads, then the 128-bit halves exchanged.
    let t0 = _mm256_unpacklo_ps(r[0], r[1]);
    let t1 = _mm256_unpackhi_ps(r[0], r[1]);
    let t2 = _mm256_unpacklo_ps(r[2], r[3]);
    let t3 = _mm256_unpackhi_ps(r[2], r[3]);
    let t4 = _mm256_unpacklo_ps(r[4], r[5]);
    let t5 = _mm256_unpackhi_ps(r[4], r[5]);
    let t6 = _mm256_unpacklo_ps(r[6], r[7]);
    let t7 = _mm256_unpackhi_ps(r[6], r[7]);
    let s0 = _mm256_shuffle_ps::<0x44>(t0, t2);
    let s1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
    let s2 = _mm256_shuffle_ps::<0x44>(t1, t3);
    let s3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
    let s4 = _mm256_shuffle_ps::<0x44>(t4, t6);
    let s5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
    let s6 = _mm256_shuffle_ps::<0x44>(t5, t7);
    let s7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
    [
        _mm256_permute2f128_ps::<0x20>(s0, s4),
        _mm256_permute2f128_ps::<0x20>(s1, s5),
        _mm256_permute2f128_ps::<0x20>(s2, s6),
        _mm256_permute2f128_ps::<0x20>(s3, s7),
        _mm256_permute2f128_ps::<0x31>(s0, s4),
        _mm256_permute2f128_ps::<0x31>(s1, s5),
        _mm256_permute2f128_ps::<0x31>(s2, s6),
        _mm256_permute2f128_ps::<0x31>(s3, s7),
    ]
}

/// Tokens `t..t + T` against the packed panel of outputs `n..n + nr`, written to the output.
#[inline(always)]
unsafe fn tile<const T: usize>(panel: *const Line, job: &Job, n: usize, nr: usize, t: usize) {
    let x: [*const f32; T] = tok_ptrs(job, t);
    let p = panel as *const f32;
    let mut acc = [[_mm256_setzero_ps(); 2]; T];
    for kk in 0..job.k {
        let w0 = _mm256_load_ps(p.add(kk * NR));
        let w1 = _mm256_load_ps(p.add(kk * NR + 8));
        for (xi, acc) in x.iter().zip(acc.iter_mut()) {
            let xb = _mm256_broadcast_ss(&*xi.add(kk));
            acc[0] = _mm256_fmadd_ps(w0, xb, acc[0]);
            acc[1] = _mm256_fmadd_ps(w1, xb, acc[1]);
        }
    }
    for (i, acc) in acc.iter().enumerate() {
        put(job, t + i, n, nr, *acc);
    }
}

/// [`tile`] for a full tile of tokens `t..t + MR` packed at `a` ([`PackedTokens`]).
#[inline(always)]
unsafe fn packed_tile(panel: *const Line, a: *const f32, job: &Job, n: usize, nr: usize, t: usize) {
    let p = panel as *const f32;
    let mut acc = [[_mm256_setzero_ps(); 2]; MR];
    for kk in 0..job.k {
        let w0 = _mm256_load_ps(p.add(kk * NR));
        let w1 = _mm256_load_ps(p.add(kk * NR + 8));
        for (i, acc) in acc.iter_mut().enumerate() {
            let xb = _mm256_broadcast_ss(&*a.add(kk * MR + i));
            acc[0] = _mm256_fmadd_ps(w0, xb, acc[0]);
            acc[1] = _mm256_fmadd_ps(w1, xb, acc[1]);
        }
    }
    for (i, acc) in acc.iter().enumerate() {
        put(job, t + i, n, nr, *acc);
    }
}

/// One token's 16 sums (+ bias, + the output when accumulating), rounded as [`Job::put`]:
/// `(out + sum) + bias`, or `sum + bias`.
#[inline(always)]
unsafe fn put(job: &Job, t: usize, n: usize, nr: usize, acc: [__m256; 2]) {
    if nr == NR {
        let o = job.out.add(t * job.ldo + n);
        for (h, &sum) in acc.iter().enumerate() {
            let v = if job.accumulate {
                _mm256_add_ps(_mm256_loadu_ps(o.add(8 * h)), sum)
            } else {
                sum
            };
            let bias = match job.bias {
                Some(b) => _mm256_loadu_ps(b[n + 8 * h..n + 8 * h + 8].as_ptr()),
                None => _mm256_setzero_ps(),
            };
            _mm256_storeu_ps(o.add(8 * h), _mm256_add_ps(v, bias));
        }
    } else {
        let mut s = [0f32; NR];
        _mm256_storeu_ps(s.as_mut_ptr(), acc[0]);
        _mm256_storeu_ps(s.as_mut_ptr().add(8), acc[1]);
        for (r, &v) in s.iter().take(nr).enumerate() {
            job.put(t, n + r, v);
        }
    }
}

//! [`super::Numerics::Bf16`]: bf16 weights (or dequantized tiles of quantized weights, rounded
//! by [`round_weights`]) against activations rounded to bf16, in calls of more
//! than 16 tokens, by `vdpbf16ps` (AVX512-BF16), which multiplies two bf16 pairs per 32-bit lane
//! into an f32 sum: twice the multiply-adds per instruction of the f32 panels of
//! [`super::avx512_panel`], on the same scheme. The weights of 32 outputs are packed into a
//! panel of k pairs (`panel[j][i]` holds weights `2j` and `2j + 1` of output `i`, one 32-bit
//! word; 64 KiB for k = 1,024), and a register tile of 12 tokens × 32 outputs walks it with 24 zmm
//! accumulators: per pair two aligned weight loads, twelve broadcasts of a token's activation
//! pair and twenty-four `vdpbf16ps`.
//!
//! Each output is one chain over the pairs in k order, so a token's results do not depend on
//! the tile it lands in or on the other tokens of the call (calls of more than 16 tokens).
//! Products of two bf16 are exact in f32; how `vdpbf16ps` rounds the two-product sum into the
//! accumulator (and its flushing of subnormals) is the CPU's, so results may differ in the last
//! bits between CPU models.

use std::arch::x86_64::*;
use std::cell::RefCell;

use half::bf16;

use super::avx512_panel::{put, tiles, NR};
use super::{amx, Job};
use crate::backend::cpu::simd::x86::{bf16_pairs, tail_mask16, transpose16};

/// One pair of k positions of a panel: the weights of its 32 outputs as bf16 pairs, two cache
/// lines.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u32; NR]);

thread_local! {
    /// Per-thread packed panel (`k / 2` lines).
    static PANEL: RefCell<Vec<Line>> = const { RefCell::new(Vec::new()) };
}

/// Words (bf16 pairs) per row of `k` elements; an odd `k` gets a zero partner.
#[inline(always)]
fn pairs(k: usize) -> usize {
    k.div_ceil(2)
}

/// Rows `0..tokens` of `x` (row `t` at `t·ldx`, `k` wide) rounded to bf16 (nearest even, NaN
/// kept) as words of two (element `2j` in the low half of word `j`; an odd `k`'s last word has
/// a zero partner), laid out for the register tiles (the f32 panels' [`tiles`]): the tile of
/// tokens `t0..t0 + w` holds its words at `t0·⌈k/2⌉ ..`, word `j` of its token `t0 + i` at
/// `t0·⌈k/2⌉ + j·w + i`, so a tile's broadcasts are at fixed offsets from one pointer. Tiles are
/// rounded in parallel.
///
/// # Safety
/// The CPU supports AVX512-BF16 (and F/BW/VL); `x` holds the rows.
pub(super) unsafe fn round_rows(x: &[f32], ldx: usize, tokens: usize, k: usize) -> Vec<u32> {
    use crate::backend::cpu::par;
    if amx::takes(k) {
        // The AMX tiles' layout instead: row by row.
        return amx::round_rows(x, ldx, tokens, k);
    }
    let kp = pairs(k);
    let mut out = vec![0u32; tokens * kp];
    let mut parts: Vec<(usize, usize, &mut [u32])> = Vec::new();
    let mut rest = &mut out[..];
    for (t0, w) in tiles(tokens) {
        let (part, tail) = rest.split_at_mut(w * kp);
        parts.push((t0, w, part));
        rest = tail;
    }
    par::for_each(parts, |(t0, w, part)| {
        // SAFETY: as this function's; the tile's rows are in `x`.
        unsafe { round_tile(&x[t0 * ldx..], ldx, k, w, part) };
    });
    out
}

/// The `w` rows (at most 16) of one tile rounded into `words[j·w + i]` (see [`round_rows`]):
/// per 16 words, each row's 32 values rounded by `cvtne2ps`, then the 16 × 16 transpose
/// ([`transpose16`]) and a masked store of `w` words per column.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn round_tile(x: &[f32], ldx: usize, k: usize, w: usize, words: &mut [u32]) {
    assert!(w <= 16 && words.len() >= w * pairs(k) && x.len() >= (w - 1) * ldx + k);
    let kp = pairs(k);
    let store = tail_mask16(w);
    let mut j = 0;
    while j < kp {
        let c = 2 * j;
        let n = (k - c).min(32);
        let mut rows = [_mm512_setzero_si512(); 16];
        for (i, r) in rows.iter_mut().enumerate().take(w) {
            *r = bf16_pairs(x.as_ptr().add(i * ldx + c), n);
        }
        let cols = transpose16(rows);
        for (jj, col) in cols.iter().enumerate().take((kp - j).min(16)) {
            let dst = words.as_mut_ptr().add((j + jj) * w) as *mut i32;
            _mm512_mask_storeu_epi32(dst, store, *col);
        }
        j += 16;
    }
}

/// `src` rounded to bf16 (nearest even, as [`round_rows`] rounds activations) into `dst`:
/// dequantized weight tiles, for [`super::Numerics::Bf16`] on quantized weights.
///
/// # Safety
/// The CPU supports AVX512-BF16 (and F/BW/VL); `dst` is at least as long as `src`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
pub(super) unsafe fn round_weights(src: &[f32], dst: &mut [bf16]) {
    assert!(dst.len() >= src.len(), "bf16 weight tile too short");
    let (s, d) = (src.as_ptr(), dst.as_mut_ptr() as *mut u16);
    let mut c = 0;
    while c < src.len() {
        let n = (src.len() - c).min(32);
        let b = bf16_pairs(s.add(c), n);
        _mm512_mask_storeu_epi16(d.add(c) as *mut i16, ((1u64 << n) - 1) as __mmask32, b);
        c += 32;
    }
}

/// `job.rows` against the bf16 pairs in `job.xb`, 32 outputs at a time.
///
/// # Safety
/// The CPU supports AVX512-BF16 (and F/BW/VL, AVX2, FMA); `job` describes valid memory (see
/// `matmul_rows_at`), `job.xb` holds `job.tokens` rows of [`round_rows`], and `w` holds
/// `job.rows.end` rows of `job.k` elements.
#[inline(always)]
pub(super) unsafe fn panel_rows(w: *const bf16, job: &Job) {
    let xb = job.xb.expect("Numerics::Bf16 calls carry bf16 activations");
    let kp = pairs(job.k);
    if amx::takes(job.k) {
        with_panels(amx::panels_per_block(kp) * kp, |panel| unsafe {
            amx_blocks::<1>(w, job, panel, xb)
        })
    } else {
        with_panels(kp, |panel| unsafe { panels(w, job, panel, xb) })
    }
}

/// Exact products of bf16 weights on the AMX tiles: `job.rows` against the activations cut
/// into three bf16 parts ([`amx::split_rows`], in `job.xs`), in blocks of panels packed as
/// [`panel_rows`] packs them.
///
/// # Safety
/// As [`panel_rows`], with `job.xs` holding [`amx::split_rows`]'s rows for `job.tokens` tokens
/// and AMX [`amx::enabled`].
#[inline(always)]
pub(super) unsafe fn exact_panel_rows(w: *const bf16, job: &Job) {
    let xs = job.xs.expect("exact AMX calls carry split activations");
    let kp = pairs(job.k);
    with_panels(amx::panels_per_block(kp) * kp, |panel| unsafe {
        amx_blocks::<{ amx::EXACT_PARTS }>(w, job, panel, xs)
    })
}

/// `f` with this thread's panel buffer, resized to `lines` lines.
#[inline(always)]
fn with_panels(lines: usize, f: impl FnOnce(*mut Line)) {
    PANEL.with_borrow_mut(|panel| {
        panel.resize(lines, Line([0; NR]));
        // The work is in a function of its own because a closure is compiled without the
        // caller's target features.
        f(panel.as_mut_ptr())
    })
}

/// `job.rows` on the AMX tiles ([`amx::block_tokens`]), a block of panels at a time, each block
/// packed into `panel` first.
///
/// # Safety
/// As [`panel_rows`] with `xb` the activations `amx::block_tokens::<PARTS>` reads, and `panel`
/// valid for [`amx::panels_per_block`] panels of `⌈k/2⌉` lines.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")]
unsafe fn amx_blocks<const PARTS: usize>(w: *const bf16, job: &Job, panel: *mut Line, xb: &[u32]) {
    let kp = pairs(job.k);
    let block_rows = amx::panels_per_block(kp) * NR;
    let end = job.rows.end;
    let mut n = job.rows.start;
    while n < end {
        let block_end = (n + block_rows).min(end);
        for (i, o) in (n..block_end).step_by(NR).enumerate() {
            pack(w, job.k, o, (block_end - o).min(NR), panel.add(i * kp));
        }
        amx::block_tokens::<PARTS>(panel as *const u32, xb, kp, job, n, block_end);
        n = block_end;
    }
}

/// # Safety
/// As [`panel_rows`], with `panel` valid for `⌈k/2⌉` lines and `xb` [`round_rows`]'s
/// register-tile layout.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")]
unsafe fn panels(w: *const bf16, job: &Job, panel: *mut Line, xb: &[u32]) {
    let kp = pairs(job.k);
    assert!(xb.len() >= job.tokens * kp, "bf16 activations too short");
    let end = job.rows.end;
    let mut n = job.rows.start;
    while n < end {
        let nr = (end - n).min(NR);
        pack(w, job.k, n, nr, panel);
        for (t, width) in tiles(job.tokens) {
            let x = xb.as_ptr().add(t * kp);
            match width {
                12 => tile::<12>(panel, x, kp, job, n, nr, t),
                11 => tile::<11>(panel, x, kp, job, n, nr, t),
                10 => tile::<10>(panel, x, kp, job, n, nr, t),
                9 => tile::<9>(panel, x, kp, job, n, nr, t),
                8 => tile::<8>(panel, x, kp, job, n, nr, t),
                7 => tile::<7>(panel, x, kp, job, n, nr, t),
                6 => tile::<6>(panel, x, kp, job, n, nr, t),
                5 => tile::<5>(panel, x, kp, job, n, nr, t),
                4 => tile::<4>(panel, x, kp, job, n, nr, t),
                3 => tile::<3>(panel, x, kp, job, n, nr, t),
                2 => tile::<2>(panel, x, kp, job, n, nr, t),
                _ => tile::<1>(panel, x, kp, job, n, nr, t),
            }
        }
        n += nr;
    }
}

/// Outputs `n..n + nr` of the row-major `w` (`k` bf16 per row) into the panel: word `j` of lane
/// `i` is elements `2j, 2j + 1` of row `n + i`; lanes past `nr`, and the partner of an odd
/// `k`'s last element, are zero. Sixteen rows × sixteen words at a time through
/// [`transpose16`].
#[inline(always)]
unsafe fn pack(w: *const bf16, k: usize, n: usize, nr: usize, panel: *mut Line) {
    let kp = pairs(k);
    let panel = panel as *mut u32;
    for half in 0..NR / 16 {
        let mut j = 0;
        while j < kp {
            // Elements `2j ..` of each row: 32 bf16 (16 words), fewer at the row's end.
            let elems = (k - 2 * j).min(32);
            let m = ((1u64 << elems) - 1) as __mmask32;
            let mut rows = [_mm512_setzero_si512(); 16];
            for (r, v) in rows.iter_mut().enumerate() {
                let row = half * 16 + r;
                if row < nr {
                    *v = _mm512_maskz_loadu_epi16(m, w.add((n + row) * k + 2 * j) as *const i16);
                }
            }
            let cols = transpose16(rows);
            for (c, col) in cols.iter().enumerate().take((kp - j).min(16)) {
                _mm512_store_si512(panel.add((j + c) * NR + 16 * half) as *mut __m512i, *col);
            }
            j += 16;
        }
    }
}

/// Tokens `t..t + T` (their pairs from `x`, interleaved as [`round_rows`] lays out a tile)
/// against the packed panel of outputs `n..n + nr`, written to the output.
#[inline(always)]
unsafe fn tile<const T: usize>(
    panel: *const Line,
    x: *const u32,
    kp: usize,
    job: &Job,
    n: usize,
    nr: usize,
    t: usize,
) {
    let p = panel as *const u32;
    let mut acc = [[_mm512_setzero_ps(); 2]; T];
    for j in 0..kp {
        let w0: __m512bh = std::mem::transmute(_mm512_load_si512(p.add(j * NR) as *const __m512i));
        let w1: __m512bh =
            std::mem::transmute(_mm512_load_si512(p.add(j * NR + 16) as *const __m512i));
        for (i, acc) in acc.iter_mut().enumerate() {
            let xv: __m512bh = std::mem::transmute(_mm512_set1_epi32(*x.add(j * T + i) as i32));
            acc[0] = _mm512_dpbf16_ps(acc[0], w0, xv);
            acc[1] = _mm512_dpbf16_ps(acc[1], w1, xv);
        }
    }
    for (i, acc) in acc.iter().enumerate() {
        put(job, t + i, n, nr, *acc);
    }
}

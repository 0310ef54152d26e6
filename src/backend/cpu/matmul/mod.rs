//! `y = x Wᵀ (+ b)` for weights stored `[out, in]` row-major, the layout every checkpoint uses.
//! Rows of W are contiguous, so each output is one dot product over contiguous memory: the
//! natural shape for a memory-bound GEMV at decode and a register-tiled GEMM at prefill.
//!
//! Kernels (x86-64, picked by [`simd::level`]): decode (`tokens == 1`) runs 4 weight rows against
//! the activation row with two k-unrolled accumulators per row and software prefetch; prefill
//! runs a 4 rows × 4 tokens register tile (16 zmm accumulators; 4 × 2 ymm on AVX2) so each weight
//! vector is loaded once per 4 tokens, with 1-row / 1-token tails and masked (AVX-512) or scalar
//! (AVX2) k tails. An AVX512-BF16 prefill path (activations split into bf16 hi + lo, two
//! `vdpbf16ps` per weight vector) was measured at about half the speed of the FMA tile on this
//! Zen 5 machine and removed; `Level::Avx512Bf16` therefore runs the AVX-512 FMA kernels.
//!
//! Quantized weights (ggml Q8_0/Q4_0/Q4_1 blocks, see [`crate::model::quant`]) are computed on
//! directly, with f32 activations (never quantized), so results equal the f32 product with the
//! dequantized weights up to f32 rounding of the sums:
//! - decode (`tokens == 1`): per 32-element block and row, the integer quants are widened to f32
//!   (exact), multiplied with x into one block partial `Σ q·x` (two vectors), and the block scale
//!   is applied once to that partial with one FMA into the row's accumulator: `d·Σ q·x` (Q8_0),
//!   `d·Σ (q−8)·x` (Q4_0; the −8 is applied to the integers), `d·Σ q·x + m·Σ x` (Q4_1; the block
//!   sums `Σ x` of the activation row are computed once per call and shared by every row). Four
//!   rows run together so each x vector is loaded once per four rows.
//! - prefill (`tokens > 1`): a tile of rows is dequantized to f32 (bit-identical to ggml's
//!   reference dequantization) into thread-local scratch and handed to the f32 kernels, so the
//!   per-element dequantization cost is shared by all tokens.

use std::cell::RefCell;
use std::ops::Range;

use half::bf16;
use rayon::prelude::*;

use super::simd::{self, Level};
use crate::model::quant::{self, QuantKind};

/// Weight storage the kernels read directly (bf16 is never widened in memory, quantized blocks
/// are never dequantized in memory).
pub enum WeightData {
    F32(Vec<f32>),
    BF16(Vec<bf16>),
    /// ggml blocks, rows concatenated: row `n` is `blocks[n·row_bytes..(n+1)·row_bytes]` with
    /// `row_bytes = cols / 32 · kind.block_bytes()`. An owned copy rather than a borrow of the
    /// file mapping: merged linears (qkv, gate|up) must be concatenated anyway, the 34/18/20-byte
    /// blocks make every load unaligned whatever the base, and an owned buffer keeps the packed
    /// matrix independent of the file (one extra copy of ~the file size at load).
    Quant {
        kind: QuantKind,
        blocks: Vec<u8>,
    },
}

impl WeightData {
    /// Checks quantized blocks against a `rows × cols` shape (other formats always pass).
    pub fn check_shape(&self, rows: usize, cols: usize) -> Result<(), String> {
        if let WeightData::Quant { kind, blocks } = self {
            let n = kind.block_elems();
            if !cols.is_multiple_of(n) {
                return Err(format!(
                    "{} rows of {cols} columns are not whole {n}-element blocks",
                    kind.name()
                ));
            }
            let want = rows * (cols / n) * kind.block_bytes();
            if blocks.len() != want {
                return Err(format!(
                    "{} bytes of {} blocks for a {rows}x{cols} matrix, expected {want}",
                    blocks.len(),
                    kind.name()
                ));
            }
        }
        Ok(())
    }
}

/// A linear layer's weight (and bias) in the backend's layout.
pub struct PackedMatrix {
    pub rows: usize,
    pub cols: usize,
    pub data: WeightData,
    pub bias: Option<Vec<f32>>,
}

impl PackedMatrix {
    pub fn bytes(&self) -> usize {
        let w = match &self.data {
            WeightData::F32(v) => v.len() * 4,
            WeightData::BF16(v) => v.len() * 2,
            WeightData::Quant { blocks, .. } => blocks.len(),
        };
        w + self.bias.as_ref().map_or(0, |b| b.len() * 4)
    }
}

/// A raw output pointer that rayon tasks may share because each writes disjoint columns.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

/// Output rows handled by one task: small enough to balance across threads, large enough that
/// the per-task overhead vanishes next to the bytes streamed. A multiple of 4, the kernels' row
/// block.
fn rows_per_task(w: &PackedMatrix, tokens: usize) -> usize {
    let threads = rayon::current_num_threads().max(1);
    let by_threads = w.rows.div_ceil(threads * 4).next_multiple_of(4);
    let min_rows = if tokens > 1 { 16 } else { 64 };
    by_threads.max(min_rows).min(w.rows.max(1))
}

/// `out[t·ldo + n] (+)= bias[n] + Σ_k W[n,k]·x[t·ldx + k]` for every token `t` and output `n`,
/// split over the current rayon pool by output rows.
///
/// `accumulate` adds into `out` (a fused residual add) instead of overwriting it.
pub fn matmul(
    w: &PackedMatrix,
    x: &[f32],
    ldx: usize,
    tokens: usize,
    out: &mut [f32],
    ldo: usize,
    accumulate: bool,
) {
    matmul_at(simd::level(), w, x, ldx, tokens, out, ldo, accumulate)
}

/// [`matmul`] at an explicit SIMD level (clamped to what the CPU supports).
#[allow(clippy::too_many_arguments)]
pub fn matmul_at(
    level: Level,
    w: &PackedMatrix,
    x: &[f32],
    ldx: usize,
    tokens: usize,
    out: &mut [f32],
    ldo: usize,
    accumulate: bool,
) {
    assert!(
        tokens == 0 || x.len() >= (tokens - 1) * ldx + w.cols,
        "matmul input too short"
    );
    assert!(
        tokens == 0 || out.len() >= (tokens - 1) * ldo + w.rows,
        "matmul output too short"
    );
    let ptr = OutPtr(out.as_mut_ptr());
    let chunk = rows_per_task(w, tokens);
    let starts: Vec<usize> = (0..w.rows).step_by(chunk).collect();
    starts.into_par_iter().for_each(|r0| {
        let rows = r0..(r0 + chunk).min(w.rows);
        let p = ptr;
        // SAFETY: tasks own disjoint column ranges `rows` of every output row, and `out` outlives
        // the parallel loop; the asserts above bound every index written.
        unsafe { matmul_rows_at(level, w, x, ldx, tokens, rows, p.0, ldo, accumulate) };
    });
}

/// The single-threaded kernel over a block of output rows.
///
/// # Safety
/// `out` must be valid for writes at `t·ldo + n` for all `t < tokens`, `n ∈ rows`.
#[allow(clippy::too_many_arguments)]
pub unsafe fn matmul_rows(
    w: &PackedMatrix,
    x: &[f32],
    ldx: usize,
    tokens: usize,
    rows: Range<usize>,
    out: *mut f32,
    ldo: usize,
    accumulate: bool,
) {
    matmul_rows_at(simd::level(), w, x, ldx, tokens, rows, out, ldo, accumulate)
}

/// [`matmul_rows`] at an explicit SIMD level (clamped to what the CPU supports).
///
/// # Safety
/// As [`matmul_rows`].
#[allow(clippy::too_many_arguments)]
pub unsafe fn matmul_rows_at(
    level: Level,
    w: &PackedMatrix,
    x: &[f32],
    ldx: usize,
    tokens: usize,
    rows: Range<usize>,
    out: *mut f32,
    ldo: usize,
    accumulate: bool,
) {
    if tokens == 0 || rows.is_empty() {
        return;
    }
    assert!(rows.end <= w.rows, "matmul rows out of range");
    assert!(
        x.len() >= (tokens - 1) * ldx + w.cols,
        "matmul input too short"
    );
    if let Some(b) = &w.bias {
        assert!(b.len() >= w.rows, "matmul bias too short");
    }
    if let Err(e) = w.data.check_shape(w.rows, w.cols) {
        panic!("matmul: {e}");
    }
    let job = Job {
        k: w.cols,
        bias: w.bias.as_deref(),
        x: x.as_ptr(),
        ldx,
        tokens,
        rows,
        out,
        ldo,
        accumulate,
    };
    if let WeightData::Quant { kind, blocks } = &w.data {
        quant_rows(level, *kind, blocks, &job);
        return;
    }
    let dense = match &w.data {
        WeightData::F32(v) => Dense::F32(v),
        WeightData::BF16(v) => Dense::BF16(v),
        WeightData::Quant { .. } => unreachable!(),
    };
    dense_rows(level, dense, &job);
}

/// Unquantized weights as the f32/bf16 kernels read them.
#[derive(Clone, Copy)]
enum Dense<'a> {
    F32(&'a [f32]),
    BF16(&'a [bf16]),
}

/// The f32/bf16 kernels.
///
/// # Safety
/// `job` must describe valid memory (see [`matmul_rows_at`]); `data` holds `job.rows.end` rows.
unsafe fn dense_rows(level: Level, data: Dense, job: &Job) {
    match (simd::clamp(level), data) {
        #[cfg(target_arch = "x86_64")]
        (Level::Avx512 | Level::Avx512Bf16, Dense::F32(v)) => x86::rows_512(v.as_ptr(), job),
        #[cfg(target_arch = "x86_64")]
        (Level::Avx512 | Level::Avx512Bf16, Dense::BF16(v)) => x86::rows_512(v.as_ptr(), job),
        #[cfg(target_arch = "x86_64")]
        (Level::Avx2, Dense::F32(v)) => x86::rows_256(v.as_ptr(), job),
        #[cfg(target_arch = "x86_64")]
        (Level::Avx2, Dense::BF16(v)) => x86::rows_256(v.as_ptr(), job),
        (_, Dense::F32(v)) => {
            let k = job.k;
            rows_scalar(job, |n, t| {
                simd::scalar::dot_f32(&v[n * k..(n + 1) * k], job.xrow(t))
            })
        }
        (_, Dense::BF16(v)) => {
            let k = job.k;
            rows_scalar(job, |n, t| {
                simd::scalar::dot_bf16(&v[n * k..(n + 1) * k], job.xrow(t))
            })
        }
    }
}

/// Rows dequantized per prefill tile: a multiple of the kernels' 4-row block, and small enough
/// (16 × cols f32) to stay in L1/L2 while every token passes over it.
const TILE_ROWS: usize = 16;

thread_local! {
    /// Per-thread f32 scratch for prefill tiles of quantized weights.
    static TILE: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Quantized weights: GEMV on the blocks at decode, dequantized tiles + f32 kernels otherwise.
///
/// # Safety
/// As [`matmul_rows_at`]; `blocks` has been checked against the matrix shape.
unsafe fn quant_rows(level: Level, kind: QuantKind, blocks: &[u8], job: &Job) {
    let level = simd::clamp(level);
    #[cfg(target_arch = "x86_64")]
    if job.tokens == 1 && matches!(kind, QuantKind::Q8_0 | QuantKind::Q4_0 | QuantKind::Q4_1) {
        match level {
            Level::Avx512 | Level::Avx512Bf16 => return x86::qrows_512(kind, blocks.as_ptr(), job),
            Level::Avx2 => return x86::qrows_256(kind, blocks.as_ptr(), job),
            Level::Scalar => {}
        }
    }
    let rb = job.k / kind.block_elems() * kind.block_bytes();
    TILE.with_borrow_mut(|tile| {
        let mut n0 = job.rows.start;
        while n0 < job.rows.end {
            let n1 = (n0 + TILE_ROWS).min(job.rows.end);
            tile.resize((n1 - n0) * job.k, 0.0);
            dequantize_rows(level, kind, &blocks[n0 * rb..n1 * rb], tile);
            // The tile's row r is output n0 + r: shift the output and bias views to match.
            let sub = Job {
                bias: job.bias.map(|b| &b[n0..]),
                rows: 0..n1 - n0,
                out: job.out.add(n0),
                ..*job
            };
            dense_rows(level, Dense::F32(tile), &sub);
            n0 = n1;
        }
    });
}

/// Dequantizes whole rows of blocks into `out` (bit-identical to [`quant::dequantize_row`]).
fn dequantize_rows(level: Level, kind: QuantKind, blocks: &[u8], out: &mut [f32]) {
    let nb = out.len() / kind.block_elems();
    assert!(blocks.len() >= nb * kind.block_bytes());
    match simd::clamp(level) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the level is supported; `blocks` holds `nb` blocks and `out` `nb · 32` floats.
        Level::Avx512 | Level::Avx512Bf16 | Level::Avx2
            if matches!(kind, QuantKind::Q8_0 | QuantKind::Q4_0 | QuantKind::Q4_1) =>
        unsafe { x86::dequantize_256(kind, blocks.as_ptr(), nb, out.as_mut_ptr()) },
        _ => quant::dequantize_row(kind, blocks, out),
    }
}

/// One call's operands, shared by every kernel.
struct Job<'a> {
    k: usize,
    bias: Option<&'a [f32]>,
    x: *const f32,
    ldx: usize,
    tokens: usize,
    rows: Range<usize>,
    out: *mut f32,
    ldo: usize,
    accumulate: bool,
}

impl Job<'_> {
    /// Write `d` (+ bias) for output `n` of token `t`.
    #[inline(always)]
    unsafe fn put(&self, t: usize, n: usize, d: f32) {
        let bias = self.bias.map_or(0.0, |b| b[n]);
        let o = self.out.add(t * self.ldo + n);
        *o = if self.accumulate {
            *o + d + bias
        } else {
            d + bias
        };
    }

    #[inline(always)]
    unsafe fn xptr(&self, t: usize) -> *const f32 {
        self.x.add(t * self.ldx)
    }

    #[inline(always)]
    unsafe fn xrow(&self, t: usize) -> &[f32] {
        std::slice::from_raw_parts(self.xptr(t), self.k)
    }
}

/// The portable path: one scalar dot product per output.
unsafe fn rows_scalar(job: &Job, dot: impl Fn(usize, usize) -> f32) {
    for n in job.rows.clone() {
        for t in 0..job.tokens {
            job.put(t, n, dot(n, t));
        }
    }
}

#[cfg(target_arch = "x86_64")]
// The AVX-512 intrinsics are stable since Rust 1.89, the workspace's `rust-version`.
mod x86 {
    use std::arch::x86_64::*;

    use half::bf16;

    use super::{Job, QuantKind};

    /// Elements per legacy block.
    const QK: usize = 32;
    use crate::backend::cpu::simd::x86::{
        hsum256, load_bf16_256, load_bf16_512, load_bf16_512_mask, tail_mask16,
    };

    /// A weight element type the kernels load straight from memory.
    pub(super) trait Weight: Copy {
        /// 16 elements widened to f32.
        unsafe fn ld16(p: *const Self) -> __m512;
        /// The first `m`-selected of 16 elements (others zero).
        unsafe fn ld16_mask(p: *const Self, m: __mmask16) -> __m512;
        /// 8 elements widened to f32.
        unsafe fn ld8(p: *const Self) -> __m256;
        fn get(self) -> f32;
    }

    impl Weight for f32 {
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
        unsafe fn ld16(p: *const f32) -> __m512 {
            _mm512_loadu_ps(p)
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
        unsafe fn ld16_mask(p: *const f32, m: __mmask16) -> __m512 {
            _mm512_maskz_loadu_ps(m, p)
        }
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn ld8(p: *const f32) -> __m256 {
            _mm256_loadu_ps(p)
        }
        #[inline(always)]
        fn get(self) -> f32 {
            self
        }
    }

    impl Weight for bf16 {
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
        unsafe fn ld16(p: *const bf16) -> __m512 {
            load_bf16_512(p)
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
        unsafe fn ld16_mask(p: *const bf16, m: __mmask16) -> __m512 {
            load_bf16_512_mask(p, m)
        }
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn ld8(p: *const bf16) -> __m256 {
            load_bf16_256(p)
        }
        #[inline(always)]
        fn get(self) -> f32 {
            self.to_f32()
        }
    }

    // ----- AVX-512 -----

    const PREFETCH: bool = true;
    /// Bytes ahead of the current load that GEMV prefetches in each weight row.
    const PF_DIST: usize = 1024;

    /// `R` rows against one activation row: 2R independent FMA chains over k.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn gemv_512<W: Weight, const R: usize>(
        w: [*const W; R],
        x: *const f32,
        k: usize,
    ) -> [f32; R] {
        let mut a0 = [_mm512_setzero_ps(); R];
        let mut a1 = [_mm512_setzero_ps(); R];
        let mut i = 0;
        while i + 32 <= k {
            let x0 = _mm512_loadu_ps(x.add(i));
            let x1 = _mm512_loadu_ps(x.add(i + 16));
            for r in 0..R {
                if PREFETCH {
                    // Decode streams each weight once from DRAM: prefetch every row's lines ahead.
                    let p = w[r].add(i) as *const i8;
                    _mm_prefetch::<_MM_HINT_T0>(p.add(PF_DIST));
                    if size_of::<W>() == 4 {
                        _mm_prefetch::<_MM_HINT_T0>(p.add(PF_DIST + 64));
                    }
                }
                a0[r] = _mm512_fmadd_ps(W::ld16(w[r].add(i)), x0, a0[r]);
                a1[r] = _mm512_fmadd_ps(W::ld16(w[r].add(i + 16)), x1, a1[r]);
            }
            i += 32;
        }
        while i < k {
            let m = tail_mask16((k - i).min(16));
            let x0 = _mm512_maskz_loadu_ps(m, x.add(i));
            for r in 0..R {
                a0[r] = _mm512_fmadd_ps(W::ld16_mask(w[r].add(i), m), x0, a0[r]);
            }
            i += 16;
        }
        let mut s = [0f32; R];
        for r in 0..R {
            s[r] = _mm512_reduce_add_ps(_mm512_add_ps(a0[r], a1[r]));
        }
        s
    }

    /// `R` rows × `T` tokens register tile: each weight vector loaded once per `T` tokens.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn tile_512<W: Weight, const R: usize, const T: usize>(
        w: [*const W; R],
        x: [*const f32; T],
        k: usize,
    ) -> [[f32; T]; R] {
        let mut acc = [[_mm512_setzero_ps(); T]; R];
        let mut i = 0;
        while i + 16 <= k {
            let mut xv = [_mm512_setzero_ps(); T];
            for t in 0..T {
                xv[t] = _mm512_loadu_ps(x[t].add(i));
            }
            for r in 0..R {
                let wv = W::ld16(w[r].add(i));
                for t in 0..T {
                    acc[r][t] = _mm512_fmadd_ps(wv, xv[t], acc[r][t]);
                }
            }
            i += 16;
        }
        if i < k {
            let m = tail_mask16(k - i);
            let mut xv = [_mm512_setzero_ps(); T];
            for t in 0..T {
                xv[t] = _mm512_maskz_loadu_ps(m, x[t].add(i));
            }
            for r in 0..R {
                let wv = W::ld16_mask(w[r].add(i), m);
                for t in 0..T {
                    acc[r][t] = _mm512_fmadd_ps(wv, xv[t], acc[r][t]);
                }
            }
        }
        let mut s = [[0f32; T]; R];
        for r in 0..R {
            for t in 0..T {
                s[r][t] = _mm512_reduce_add_ps(acc[r][t]);
            }
        }
        s
    }

    #[inline(always)]
    unsafe fn row_ptrs<W, const R: usize>(w: *const W, n: usize, k: usize) -> [*const W; R] {
        std::array::from_fn(|r| w.add((n + r) * k))
    }

    #[inline(always)]
    unsafe fn tok_ptrs<const T: usize>(job: &Job, t: usize) -> [*const f32; T] {
        std::array::from_fn(|j| job.xptr(t + j))
    }

    /// Write an `R × T` block of results for rows `n..`, tokens `t..`.
    #[inline(always)]
    unsafe fn put_tile<const R: usize, const T: usize>(
        job: &Job,
        n: usize,
        t: usize,
        s: [[f32; T]; R],
    ) {
        for (r, sr) in s.iter().enumerate() {
            for (j, &v) in sr.iter().enumerate() {
                job.put(t + j, n + r, v);
            }
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn rows_512<W: Weight>(w: *const W, job: &Job) {
        let k = job.k;
        let end = job.rows.end;
        let mut n = job.rows.start;
        if job.tokens == 1 {
            let x = job.xptr(0);
            while n + 4 <= end {
                let s = gemv_512::<W, 4>(row_ptrs(w, n, k), x, k);
                put_tile::<4, 1>(job, n, 0, s.map(|v| [v]));
                n += 4;
            }
            while n < end {
                let s = gemv_512::<W, 1>(row_ptrs(w, n, k), x, k);
                job.put(0, n, s[0]);
                n += 1;
            }
            return;
        }
        while n < end {
            let full = n + 4 <= end;
            let mut t = 0;
            while t + 4 <= job.tokens {
                if full {
                    let s = tile_512::<W, 4, 4>(row_ptrs(w, n, k), tok_ptrs(job, t), k);
                    put_tile(job, n, t, s);
                } else {
                    for r in n..end {
                        let s = tile_512::<W, 1, 4>(row_ptrs(w, r, k), tok_ptrs(job, t), k);
                        put_tile(job, r, t, s);
                    }
                }
                t += 4;
            }
            while t < job.tokens {
                if full {
                    let s = gemv_512::<W, 4>(row_ptrs(w, n, k), job.xptr(t), k);
                    put_tile::<4, 1>(job, n, t, s.map(|v| [v]));
                } else {
                    for r in n..end {
                        let s = gemv_512::<W, 1>(row_ptrs(w, r, k), job.xptr(t), k);
                        job.put(t, r, s[0]);
                    }
                }
                t += 1;
            }
            n = (n + 4).min(end);
        }
    }

    // ----- Quantized blocks -----

    /// A ggml block format as the kernels decode it.
    pub(super) trait QBlock {
        /// Bytes per block.
        const BYTES: usize;
        /// Whether the block carries a min `m` (value `d·q + m`) after its scale `d`.
        const HAS_MIN: bool;
        /// The block's 32 integer quants as f32 (Q4_0's −8 applied), elements 0..16 and 16..32.
        unsafe fn q512(p: *const u8) -> (__m512, __m512);
        /// The same as four 8-element vectors.
        unsafe fn q256(p: *const u8) -> [__m256; 4];
    }

    pub(super) struct Q8_0;
    pub(super) struct Q4_0;
    pub(super) struct Q4_1;

    /// The 16 quant bytes of a Q4 block at `qs` as 32 f32 values `table[nibble]`: low nibbles
    /// (elements 0..16), high nibbles (16..32). `vpermps` reads only the low 4 bits of each index,
    /// so one table lookup both masks the nibble and converts it (exactly) to f32.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn nibbles_512(qs: *const u8, table: __m512) -> (__m512, __m512) {
        let v = _mm512_cvtepu8_epi32(_mm_loadu_si128(qs as *const __m128i));
        (
            _mm512_permutexvar_ps(v, table),
            _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(v), table),
        )
    }

    /// As [`nibbles_512`] in four 8-lane vectors: elements 0..8, 8..16, 16..24, 24..32.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn nibbles_256(qs: *const u8) -> [__m256i; 4] {
        let v0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(qs as *const __m128i));
        let v1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(qs.add(8) as *const __m128i));
        let f = _mm256_set1_epi32(0x0f);
        [
            _mm256_and_si256(v0, f),
            _mm256_and_si256(v1, f),
            _mm256_srli_epi32::<4>(v0),
            _mm256_srli_epi32::<4>(v1),
        ]
    }

    impl QBlock for Q8_0 {
        const BYTES: usize = QuantKind::Q8_0.block_bytes();
        const HAS_MIN: bool = false;
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
        unsafe fn q512(p: *const u8) -> (__m512, __m512) {
            let a = _mm512_cvtepi8_epi32(_mm_loadu_si128(p.add(2) as *const __m128i));
            let b = _mm512_cvtepi8_epi32(_mm_loadu_si128(p.add(18) as *const __m128i));
            (_mm512_cvtepi32_ps(a), _mm512_cvtepi32_ps(b))
        }
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn q256(p: *const u8) -> [__m256; 4] {
            std::array::from_fn(|j| {
                let q = _mm_loadl_epi64(p.add(2 + 8 * j) as *const __m128i);
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q))
            })
        }
    }

    impl QBlock for Q4_0 {
        const BYTES: usize = QuantKind::Q4_0.block_bytes();
        const HAS_MIN: bool = false;
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
        unsafe fn q512(p: *const u8) -> (__m512, __m512) {
            let t = _mm512_setr_ps(
                -8.0, -7.0, -6.0, -5.0, -4.0, -3.0, -2.0, -1.0, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0,
                7.0,
            );
            nibbles_512(p.add(2), t)
        }
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn q256(p: *const u8) -> [__m256; 4] {
            let n = nibbles_256(p.add(2));
            let eight = _mm256_set1_epi32(8);
            n.map(|v| _mm256_cvtepi32_ps(_mm256_sub_epi32(v, eight)))
        }
    }

    impl QBlock for Q4_1 {
        const BYTES: usize = QuantKind::Q4_1.block_bytes();
        const HAS_MIN: bool = true;
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
        unsafe fn q512(p: *const u8) -> (__m512, __m512) {
            let t = _mm512_setr_ps(
                0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0,
                15.0,
            );
            nibbles_512(p.add(4), t)
        }
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn q256(p: *const u8) -> [__m256; 4] {
            nibbles_256(p.add(4)).map(|v| _mm256_cvtepi32_ps(v))
        }
    }

    /// The block's f16 scale and (Q4_1) min widened to f32: lanes `[d, m, ·, ·]` (lane 1 is junk
    /// for formats without a min).
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn scales(p: *const u8) -> __m128 {
        _mm_cvtph_ps(_mm_cvtsi32_si128(std::ptr::read_unaligned(p as *const i32)))
    }

    /// Per-block sums `Σ x` of one activation row (only formats with a min need them).
    unsafe fn block_sums<Q: QBlock>(x: *const f32, nb: usize) -> Vec<f32> {
        if !Q::HAS_MIN {
            return Vec::new();
        }
        let x = std::slice::from_raw_parts(x, nb * QK);
        x.chunks_exact(QK).map(|c| c.iter().sum()).collect()
    }

    /// `R` quantized rows against one activation row, in groups of 16 blocks. Per group and row,
    /// one gather fetches the 16 blocks' `(d, m)` f16 pairs, which are widened 16 at a time into a
    /// stack buffer (so the per-block broadcast of `d` is a plain load) and, for Q4_1, dotted
    /// with the block sums `Σx` at once (`Σ_b m_b·Σx_b`). Per block and row: `s = Σ q·x` over the
    /// block's two 16-lane halves, then `acc += d·s` (one FMA).
    // `j` indexes x, every row's blocks and the scale buffer together.
    #[allow(clippy::needless_range_loop)]
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    unsafe fn qgemv_512<Q: QBlock, const R: usize>(
        w: [*const u8; R],
        x: *const f32,
        xs: *const f32,
        nb: usize,
        pf: usize,
    ) -> [f32; R] {
        let mut acc = [_mm512_setzero_ps(); R];
        let mut macc = [_mm512_setzero_ps(); R];
        let mut d = [[0f32; 16]; R];
        let offs = _mm512_mullo_epi32(
            _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
            _mm512_set1_epi32(Q::BYTES as i32),
        );
        let mut b0 = 0;
        while b0 < nb {
            let n = (nb - b0).min(16);
            let mask = tail_mask16(n);
            for r in 0..R {
                // Lane j: the block's first dword, `d | m << 16` (m only meaningful for Q4_1).
                let g = _mm512_mask_i32gather_epi32::<1>(
                    _mm512_setzero_si512(),
                    mask,
                    offs,
                    w[r].add(b0 * Q::BYTES) as *const i32,
                );
                _mm512_storeu_ps(d[r].as_mut_ptr(), _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g)));
                if Q::HAS_MIN {
                    let m = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(g)));
                    let s = _mm512_maskz_loadu_ps(mask, xs.add(b0));
                    macc[r] = _mm512_fmadd_ps(m, s, macc[r]);
                }
            }
            for j in 0..n {
                let b = b0 + j;
                let x0 = _mm512_loadu_ps(x.add(b * QK));
                let x1 = _mm512_loadu_ps(x.add(b * QK + 16));
                for r in 0..R {
                    let p = w[r].add(b * Q::BYTES);
                    if PREFETCH {
                        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(pf) as *const i8);
                    }
                    let (q0, q1) = Q::q512(p);
                    let s = _mm512_fmadd_ps(q1, x1, _mm512_mul_ps(q0, x0));
                    acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(d[r][j]), s, acc[r]);
                }
            }
            b0 += n;
        }
        std::array::from_fn(|r| {
            let t = if Q::HAS_MIN {
                _mm512_add_ps(acc[r], macc[r])
            } else {
                acc[r]
            };
            _mm512_reduce_add_ps(t)
        })
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    unsafe fn qrows_512_t<Q: QBlock>(w: *const u8, job: &Job) {
        let nb = job.k / QK;
        let rb = nb * Q::BYTES;
        let x = job.xptr(0);
        let xs = block_sums::<Q>(x, nb);
        let end = job.rows.end;
        let mut n = job.rows.start;
        while n + 4 <= end {
            // Prefetch the same block of the next group of rows: the group's scale gather then
            // finds its lines in cache instead of waiting on DRAM.
            let s = qgemv_512::<Q, 4>(row_ptrs(w, n, rb), x, xs.as_ptr(), nb, 4 * rb);
            put_tile::<4, 1>(job, n, 0, s.map(|v| [v]));
            n += 4;
        }
        while n < end {
            let s = qgemv_512::<Q, 1>(row_ptrs(w, n, rb), x, xs.as_ptr(), nb, rb);
            job.put(0, n, s[0]);
            n += 1;
        }
    }

    /// Quantized GEMV (`job.tokens == 1`) at AVX-512; `w` holds `job.rows.end` rows of blocks.
    pub(super) unsafe fn qrows_512(kind: QuantKind, w: *const u8, job: &Job) {
        match kind {
            QuantKind::Q8_0 => qrows_512_t::<Q8_0>(w, job),
            QuantKind::Q4_0 => qrows_512_t::<Q4_0>(w, job),
            QuantKind::Q4_1 => qrows_512_t::<Q4_1>(w, job),
            _ => unreachable!(),
        }
    }

    /// [`qgemv_512`] in 8-lane vectors.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn qgemv_256<Q: QBlock, const R: usize>(
        w: [*const u8; R],
        x: *const f32,
        xs: *const f32,
        nb: usize,
    ) -> [f32; R] {
        let mut acc = [_mm256_setzero_ps(); R];
        let mut macc = [_mm_setzero_ps(); R];
        for b in 0..nb {
            let xv: [__m256; 4] = std::array::from_fn(|j| _mm256_loadu_ps(x.add(b * QK + 8 * j)));
            for r in 0..R {
                let p = w[r].add(b * Q::BYTES);
                let dm = scales(p);
                let q = Q::q256(p);
                let mut s = _mm256_mul_ps(q[0], xv[0]);
                s = _mm256_fmadd_ps(q[1], xv[1], s);
                s = _mm256_fmadd_ps(q[2], xv[2], s);
                s = _mm256_fmadd_ps(q[3], xv[3], s);
                acc[r] = _mm256_fmadd_ps(_mm256_broadcastss_ps(dm), s, acc[r]);
                if Q::HAS_MIN {
                    macc[r] = _mm_fmadd_ss(_mm_movehdup_ps(dm), _mm_load_ss(xs.add(b)), macc[r]);
                }
            }
        }
        std::array::from_fn(|r| hsum256(acc[r]) + _mm_cvtss_f32(macc[r]))
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn qrows_256_t<Q: QBlock>(w: *const u8, job: &Job) {
        let nb = job.k / QK;
        let rb = nb * Q::BYTES;
        let x = job.xptr(0);
        let xs = block_sums::<Q>(x, nb);
        let end = job.rows.end;
        let mut n = job.rows.start;
        while n + 4 <= end {
            let s = qgemv_256::<Q, 4>(row_ptrs(w, n, rb), x, xs.as_ptr(), nb);
            put_tile::<4, 1>(job, n, 0, s.map(|v| [v]));
            n += 4;
        }
        while n < end {
            let s = qgemv_256::<Q, 1>(row_ptrs(w, n, rb), x, xs.as_ptr(), nb);
            job.put(0, n, s[0]);
            n += 1;
        }
    }

    /// Quantized GEMV (`job.tokens == 1`) at AVX2.
    pub(super) unsafe fn qrows_256(kind: QuantKind, w: *const u8, job: &Job) {
        match kind {
            QuantKind::Q8_0 => qrows_256_t::<Q8_0>(w, job),
            QuantKind::Q4_0 => qrows_256_t::<Q4_0>(w, job),
            QuantKind::Q4_1 => qrows_256_t::<Q4_1>(w, job),
            _ => unreachable!(),
        }
    }

    /// `nb` blocks at `src` to `nb · 32` floats at `dst`, computed as ggml's reference does
    /// (`d·q`, then `+ m` as a separate rounding), so bit-identical to the scalar dequantization.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dequantize_256_t<Q: QBlock>(src: *const u8, nb: usize, dst: *mut f32) {
        for b in 0..nb {
            let p = src.add(b * Q::BYTES);
            let dm = scales(p);
            let d = _mm256_broadcastss_ps(dm);
            let m = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
            let q = Q::q256(p);
            for (j, &qj) in q.iter().enumerate() {
                let mut v = _mm256_mul_ps(qj, d);
                if Q::HAS_MIN {
                    v = _mm256_add_ps(v, m);
                }
                _mm256_storeu_ps(dst.add(b * QK + 8 * j), v);
            }
        }
    }

    /// Dequantizes `nb` blocks of `kind` (AVX2 level or above).
    pub(super) unsafe fn dequantize_256(kind: QuantKind, src: *const u8, nb: usize, dst: *mut f32) {
        match kind {
            QuantKind::Q8_0 => dequantize_256_t::<Q8_0>(src, nb, dst),
            QuantKind::Q4_0 => dequantize_256_t::<Q4_0>(src, nb, dst),
            QuantKind::Q4_1 => dequantize_256_t::<Q4_1>(src, nb, dst),
            _ => unreachable!(),
        }
    }

    // ----- AVX2 + FMA (16 ymm registers: 4 rows × 2 tokens) -----

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn tile_256<W: Weight, const R: usize, const T: usize>(
        w: [*const W; R],
        x: [*const f32; T],
        k: usize,
    ) -> [[f32; T]; R] {
        let mut acc = [[_mm256_setzero_ps(); T]; R];
        let mut i = 0;
        while i + 8 <= k {
            let mut xv = [_mm256_setzero_ps(); T];
            for t in 0..T {
                xv[t] = _mm256_loadu_ps(x[t].add(i));
            }
            for r in 0..R {
                let wv = W::ld8(w[r].add(i));
                for t in 0..T {
                    acc[r][t] = _mm256_fmadd_ps(wv, xv[t], acc[r][t]);
                }
            }
            i += 8;
        }
        let mut s = [[0f32; T]; R];
        for r in 0..R {
            for t in 0..T {
                let mut v = hsum256(acc[r][t]);
                for j in i..k {
                    v += (*w[r].add(j)).get() * *x[t].add(j);
                }
                s[r][t] = v;
            }
        }
        s
    }

    /// Like [`tile_256`] with one token, unrolled twice over k for 2R chains.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn gemv_256<W: Weight, const R: usize>(
        w: [*const W; R],
        x: *const f32,
        k: usize,
    ) -> [f32; R] {
        let mut a0 = [_mm256_setzero_ps(); R];
        let mut a1 = [_mm256_setzero_ps(); R];
        let mut i = 0;
        while i + 16 <= k {
            let x0 = _mm256_loadu_ps(x.add(i));
            let x1 = _mm256_loadu_ps(x.add(i + 8));
            for r in 0..R {
                a0[r] = _mm256_fmadd_ps(W::ld8(w[r].add(i)), x0, a0[r]);
                a1[r] = _mm256_fmadd_ps(W::ld8(w[r].add(i + 8)), x1, a1[r]);
            }
            i += 16;
        }
        if i + 8 <= k {
            let x0 = _mm256_loadu_ps(x.add(i));
            for r in 0..R {
                a0[r] = _mm256_fmadd_ps(W::ld8(w[r].add(i)), x0, a0[r]);
            }
            i += 8;
        }
        let mut s = [0f32; R];
        for r in 0..R {
            let mut v = hsum256(_mm256_add_ps(a0[r], a1[r]));
            for j in i..k {
                v += (*w[r].add(j)).get() * *x.add(j);
            }
            s[r] = v;
        }
        s
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn rows_256<W: Weight>(w: *const W, job: &Job) {
        let k = job.k;
        let end = job.rows.end;
        let mut n = job.rows.start;
        while n < end {
            let full = n + 4 <= end;
            let mut t = 0;
            while job.tokens > 1 && t + 2 <= job.tokens {
                if full {
                    let s = tile_256::<W, 4, 2>(row_ptrs(w, n, k), tok_ptrs(job, t), k);
                    put_tile(job, n, t, s);
                } else {
                    for r in n..end {
                        let s = tile_256::<W, 1, 2>(row_ptrs(w, r, k), tok_ptrs(job, t), k);
                        put_tile(job, r, t, s);
                    }
                }
                t += 2;
            }
            while t < job.tokens {
                if full {
                    let s = gemv_256::<W, 4>(row_ptrs(w, n, k), job.xptr(t), k);
                    put_tile::<4, 1>(job, n, t, s.map(|v| [v]));
                } else {
                    for r in n..end {
                        let s = gemv_256::<W, 1>(row_ptrs(w, r, k), job.xptr(t), k);
                        job.put(t, r, s[0]);
                    }
                }
                t += 1;
            }
            n = (n + 4).min(end);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rand_vec(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// The matrix's weights as f64 (quantized blocks through the scalar reference dequantization).
    fn weights_f64(w: &PackedMatrix) -> Vec<f64> {
        match &w.data {
            WeightData::F32(v) => v.iter().map(|&x| x as f64).collect(),
            WeightData::BF16(v) => v.iter().map(|x| x.to_f64()).collect(),
            WeightData::Quant { kind, blocks } => {
                let mut f = vec![0f32; w.rows * w.cols];
                quant::dequantize_row(*kind, blocks, &mut f);
                f.into_iter().map(|x| x as f64).collect()
            }
        }
    }

    /// `rows × cols` random blocks of `kind`: every quant value occurs, scales and mins vary in
    /// magnitude and sign (as real ggml files have them).
    fn rand_blocks(kind: QuantKind, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
        let bb = kind.block_bytes();
        let nb = rows * cols / kind.block_elems();
        let r = rand_vec(nb * bb, seed);
        let mut blocks: Vec<u8> = r.iter().map(|&v| ((v + 1.0) * 127.99) as u8).collect();
        for (b, c) in blocks.chunks_exact_mut(bb).enumerate() {
            let d = 0.002 + 0.05 * (r[b * bb] + 1.0);
            let m = -8.0 * d * (r[b * bb + 1] + 0.5);
            if kind == QuantKind::Q8_K {
                c[..4].copy_from_slice(&d.to_le_bytes());
            }
            for (&at, v) in f16_fields(kind).iter().zip([d, m]) {
                c[at..at + 2].copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
            }
        }
        blocks
    }

    /// Byte offsets of a block's f16 scale (and min) fields, which random bytes must not fill.
    fn f16_fields(kind: QuantKind) -> &'static [usize] {
        match kind {
            QuantKind::Q8_0 | QuantKind::Q4_0 | QuantKind::Q5_0 => &[0],
            QuantKind::Q4_1 | QuantKind::Q5_1 | QuantKind::Q4_K | QuantKind::Q5_K => &[0, 2],
            QuantKind::Q2_K => &[80, 82],
            QuantKind::Q3_K => &[108],
            QuantKind::Q6_K => &[208],
            QuantKind::Q8_K => &[],
        }
    }

    /// Block-aligned column counts for `kind`: one block, a few, and an odd number of blocks.
    fn quant_cols(kind: QuantKind) -> [usize; 3] {
        let n = kind.block_elems();
        [n, 3 * n, 5 * n]
    }

    fn quant_matrix(
        kind: QuantKind,
        rows: usize,
        cols: usize,
        bias: bool,
        seed: u64,
    ) -> PackedMatrix {
        PackedMatrix {
            rows,
            cols,
            data: WeightData::Quant {
                kind,
                blocks: rand_blocks(kind, rows, cols, seed),
            },
            bias: bias.then(|| rand_vec(rows, seed + 1)),
        }
    }

    const KINDS: [QuantKind; 3] = [QuantKind::Q8_0, QuantKind::Q4_0, QuantKind::Q4_1];

    #[test]
    fn every_format_every_level_matches_f64_reference() {
        for level in simd::available_levels() {
            for kind in QuantKind::ALL {
                for rows in [1, 3, 4, 5, 17, 33] {
                    for cols in quant_cols(kind) {
                        for tokens in [1, 2, 3, 5, 9] {
                            let v = rows + cols + tokens;
                            let seed = (rows * 1000 + cols * 10 + tokens) as u64;
                            let w = quant_matrix(kind, rows, cols, v % 2 == 0, seed);
                            if let Err(e) =
                                run_and_compare(level, &w, tokens, v % 3 != 0, false, seed)
                            {
                                panic!("{level:?} {kind:?} {rows}x{cols} tokens={tokens}: {e}");
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn every_format_parallel_split_matches_reference() {
        for level in simd::available_levels() {
            for kind in QuantKind::ALL {
                let cols = quant_cols(kind)[1];
                for (rows, tokens) in [(70, 1), (257, 1), (150, 5)] {
                    let w = quant_matrix(kind, rows, cols, true, rows as u64);
                    if let Err(e) = run_and_compare(level, &w, tokens, true, true, 3) {
                        panic!("{level:?} {kind:?} {rows}x{cols} tokens={tokens}: {e}");
                    }
                }
            }
        }
    }

    /// Run one configuration at `level` and compare against an f64 reference.
    #[allow(clippy::too_many_arguments)]
    fn check(
        level: Level,
        bf: bool,
        rows: usize,
        cols: usize,
        tokens: usize,
        bias: bool,
        acc: bool,
        par: bool,
    ) {
        let seed = (rows * 1000 + cols * 10 + tokens) as u64;
        let wv = rand_vec(rows * cols, seed);
        let data = if bf {
            WeightData::BF16(wv.iter().map(|&v| bf16::from_f32(v)).collect())
        } else {
            WeightData::F32(wv)
        };
        let w = PackedMatrix {
            rows,
            cols,
            data,
            bias: bias.then(|| rand_vec(rows, seed + 1)),
        };
        if let Err(e) = run_and_compare(level, &w, tokens, acc, par, seed) {
            panic!("{level:?} bf16={bf} {rows}x{cols} tokens={tokens} bias={bias} acc={acc}: {e}");
        }
    }

    /// Multiply `w` by random strided activations at `level` (whole-pool split or one call over
    /// all rows) and compare against the f64 reference.
    fn run_and_compare(
        level: Level,
        w: &PackedMatrix,
        tokens: usize,
        acc: bool,
        par: bool,
        seed: u64,
    ) -> Result<(), String> {
        let (rows, cols) = (w.rows, w.cols);
        let (ldx, ldo) = (cols + 3, rows + 5);
        let x = rand_vec((tokens - 1) * ldx + cols, seed + 2);
        let out0 = rand_vec((tokens - 1) * ldo + rows + 2, seed + 3);
        let mut out = out0.clone();
        if par {
            matmul_at(level, w, &x, ldx, tokens, &mut out, ldo, acc);
        } else {
            unsafe {
                matmul_rows_at(
                    level,
                    w,
                    &x,
                    ldx,
                    tokens,
                    0..rows,
                    out.as_mut_ptr(),
                    ldo,
                    acc,
                )
            };
        }
        compare(w, &x, ldx, tokens, &out0, &out, ldo, acc)
    }

    /// Check `out` (computed from `out0`) against an f64 reference; error scaled by Σ|terms|.
    #[allow(clippy::too_many_arguments)]
    fn compare(
        w: &PackedMatrix,
        x: &[f32],
        ldx: usize,
        tokens: usize,
        out0: &[f32],
        out: &[f32],
        ldo: usize,
        acc: bool,
    ) -> Result<(), String> {
        let (rows, cols) = (w.rows, w.cols);
        let wf = weights_f64(w);
        for (i, (&o, &o0)) in out.iter().zip(out0).enumerate() {
            let (t, n) = (i / ldo, i % ldo);
            if t >= tokens || n >= rows {
                if o.to_bits() != o0.to_bits() {
                    return Err(format!("wrote outside the output at {i}"));
                }
                continue;
            }
            let mut want = if acc { o0 as f64 } else { 0.0 };
            let mut mag = want.abs();
            if let Some(b) = &w.bias {
                want += b[n] as f64;
                mag += b[n].abs() as f64;
            }
            for k in 0..cols {
                let p = wf[n * cols + k] * x[t * ldx + k] as f64;
                want += p;
                mag += p.abs();
            }
            let err = (o as f64 - want).abs();
            if err > 1e-5 * mag {
                return Err(format!(
                    "out[{t},{n}] = {o}, want {want} (err {err:e}, mag {mag})"
                ));
            }
        }
        Ok(())
    }

    #[test]
    fn every_level_matches_f64_reference() {
        let rows_set = [1, 2, 3, 4, 5, 7, 8, 13, 16, 17, 33, 70];
        let cols_set = [1, 2, 7, 15, 16, 17, 31, 32, 33, 47, 64, 100, 129, 300];
        for level in simd::available_levels() {
            for bf in [false, true] {
                for &rows in &rows_set {
                    for &cols in &cols_set {
                        for tokens in 1..=9 {
                            let v = rows + cols + tokens;
                            check(level, bf, rows, cols, tokens, v % 2 == 0, v % 3 != 0, false);
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn parallel_split_matches_reference() {
        for level in simd::available_levels() {
            for bf in [false, true] {
                for (rows, cols, tokens) in [(70, 300, 1), (257, 96, 1), (150, 65, 5), (64, 33, 12)]
                {
                    check(level, bf, rows, cols, tokens, true, true, true);
                    check(level, bf, rows, cols, tokens, false, false, true);
                }
            }
        }
    }

    #[test]
    fn quantized_every_level_matches_f64_reference() {
        let rows_set = [1, 2, 3, 4, 5, 7, 8, 13, 16, 17, 33, 70];
        let cols_set = [32, 64, 96, 160, 576];
        for level in simd::available_levels() {
            for kind in KINDS {
                for &rows in &rows_set {
                    for &cols in &cols_set {
                        for tokens in 1..=9 {
                            let v = rows + cols + tokens;
                            let seed = (rows * 1000 + cols * 10 + tokens) as u64;
                            let w = quant_matrix(kind, rows, cols, v % 2 == 0, seed);
                            if let Err(e) =
                                run_and_compare(level, &w, tokens, v % 3 != 0, false, seed)
                            {
                                panic!("{level:?} {kind:?} {rows}x{cols} tokens={tokens}: {e}");
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn quantized_parallel_split_matches_reference() {
        for level in simd::available_levels() {
            for kind in KINDS {
                for (rows, cols, tokens) in [(70, 320, 1), (257, 96, 1), (150, 64, 5), (64, 32, 12)]
                {
                    for (bias, acc) in [(true, true), (false, false)] {
                        let w = quant_matrix(kind, rows, cols, bias, rows as u64);
                        if let Err(e) = run_and_compare(level, &w, tokens, acc, true, 3) {
                            panic!("{level:?} {kind:?} {rows}x{cols} tokens={tokens}: {e}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn quantized_tiles_dequantize_bit_exactly() {
        for level in simd::available_levels() {
            for kind in QuantKind::ALL {
                let (rows, cols) = (3, 5 * kind.block_elems());
                let blocks = rand_blocks(kind, rows, cols, 5);
                let mut want = vec![0f32; rows * cols];
                quant::dequantize_row(kind, &blocks, &mut want);
                let mut got = vec![f32::NAN; rows * cols];
                dequantize_rows(level, kind, &blocks, &mut got);
                let same = want
                    .iter()
                    .zip(&got)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{level:?} {kind:?}");
            }
        }
    }

    #[test]
    fn quantized_shapes_are_checked() {
        let w = WeightData::Quant {
            kind: QuantKind::Q4_1,
            blocks: vec![0; 2 * 20],
        };
        assert!(w.check_shape(2, 32).is_ok());
        assert!(w.check_shape(3, 32).is_err(), "byte count must match rows");
        assert!(w.check_shape(2, 16).unwrap_err().contains("not whole"));
        assert!(WeightData::F32(vec![0.0; 3]).check_shape(1, 3).is_ok());
    }

    #[test]
    fn comparison_catches_a_dropped_tail() {
        // A kernel that skipped the last column (a dropped k tail) must fail the comparison.
        let (rows, cols, tokens) = (5, 33, 3);
        let wv = rand_vec(rows * cols, 9);
        let mut dropped = wv.clone();
        for n in 0..rows {
            dropped[n * cols + cols - 1] = 0.0;
        }
        let good = PackedMatrix {
            rows,
            cols,
            data: WeightData::F32(wv),
            bias: None,
        };
        let bad = PackedMatrix {
            rows,
            cols,
            data: WeightData::F32(dropped),
            bias: None,
        };
        let x = rand_vec(tokens * cols, 10);
        let out0 = vec![0f32; tokens * rows];
        let mut out = out0.clone();
        matmul_at(Level::Scalar, &bad, &x, cols, tokens, &mut out, rows, false);
        assert!(compare(&good, &x, cols, tokens, &out0, &out, rows, false).is_err());
        matmul_at(
            Level::Scalar,
            &good,
            &x,
            cols,
            tokens,
            &mut out,
            rows,
            false,
        );
        assert!(compare(&good, &x, cols, tokens, &out0, &out, rows, false).is_ok());
    }

    #[test]
    #[should_panic(expected = "input too short")]
    fn short_input_is_rejected() {
        let w = PackedMatrix {
            rows: 1,
            cols: 17,
            data: WeightData::F32(vec![1.0; 17]),
            bias: None,
        };
        let mut out = vec![0.0f32; 1];
        matmul(&w, &[1.0; 16], 16, 1, &mut out, 1, false);
    }
}

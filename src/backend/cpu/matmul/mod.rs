//! `y = x Wᵀ (+ b)` for weights stored `[out, in]` row-major, the layout every checkpoint uses.
//! Rows of W are contiguous, so each output is one dot product over contiguous memory: the
//! natural shape for a memory-bound GEMV at decode and a register-tiled GEMM at prefill.
//!
//! Kernels (x86-64, picked at run time by [`simd::level`] from `is_x86_feature_detected!`), one
//! file per ISA: [`avx512`], [`avx2`], [`scalar`], with the row/token drivers they share written
//! once in [`x86`]. Decode (`tokens == 1`) runs 4 weight rows against the activation row with two
//! k-unrolled accumulators per row and software prefetch of later rows. Calls of more
//! tokens (prefill, and batched decode, whose rows are tokens too): on AVX2, weights packed
//! k-major after BLIS, 6 tokens × 16 outputs ([`avx2_panel`]: broadcasts and FMAs, no
//! reductions, one FMA chain per output in k order; from 24 tokens the activations packed too,
//! once per call, and four panels a pass); on AVX-512, up to 16 tokens a 4 rows × 6
//! tokens register tile of dot products (24 zmm accumulators, then 4- and 2-token tiles, 1-row /
//! 1-token tails, masked k tails) whose sums are reduced 16 at a time by one shuffle tree, and
//! above 16 tokens the packed panels at twice the AVX2 width ([`avx512_panel`], 12 tokens × 32
//! outputs, the same bits as AVX2's). Packing costs about as much as 16 tokens' FMAs, hence the
//! split: on a Zen 5 (SmolLM2, 2 threads) the panels took pp512 from 800 to 940–990 tok/s, while
//! at 16 rows the tiles stayed faster. An AVX512-BF16 prefill path that kept results near f32
//! (activations split into bf16 hi + lo, two `vdpbf16ps` per weight vector, in a dot-product
//! tile) was measured at about half the speed of the FMA tile on a Zen 5 machine and removed, so
//! `Level::Avx512Bf16` runs the AVX-512 FMA kernels in exact numerics; [`Numerics::Bf16`] rounds
//! the activations to bf16 once and runs `vdpbf16ps` panels ([`avx512_bf16_panel`]), 1.4× the
//! exact panels' prefill on bf16 weights, and 1.4–1.6× on quantized weights, whose dequantized
//! tiles it rounds to bf16 before packing.
//!
//! Quantized weights (every ggml block format of [`crate::model::quant`]) are computed on
//! directly (on AVX-512 CPUs most of them regrouped first, see below), with f32 activations
//! (never quantized), so results equal the f32 product with the dequantized weights up to f32
//! rounding of the sums. Each format is one [`QuantMethod`]
//! implementation:
//! - decode (`tokens == 1`), Q8_0/Q4_0/Q4_1: per 32-element block and row, the integer quants
//!   are widened to f32 (exact), multiplied with x into one block partial `Σ q·x` (two vectors),
//!   and the block scale is applied once to that partial with one FMA into the row's
//!   accumulator: `d·Σ q·x` (Q8_0), `d·Σ (q−8)·x` (Q4_0; the −8 is applied to the integers),
//!   `d·Σ q·x + m·Σ x` (Q4_1; the block sums `Σ x` of the activation row are computed once per
//!   call and shared by every row). Four rows run together so each x vector is loaded once per
//!   four rows.
//! - decode, Q5_0/Q5_1: as the Q4 formats, with the fifth bit of each quant taken from the
//!   block's 32-bit `qh` word (AVX2: bytes compared against a mask; AVX-512: a masked OR from a
//!   mask register, then one two-table `vpermt2ps` lookup).
//! - decode, Q4_K (AVX2, run by AVX-512 CPUs too): per 256-element super-block and row, the
//!   eight 6-bit scales and mins are unpacked once into `d·sc_j` and `dmin·m_j`; each 32-element
//!   sub-block's `Σ q·x` is scaled by `d·sc_j` into the accumulator, and `Σ_j dmin·m_j·Σx_j`
//!   (sub-block sums of x computed once per call) is subtracted at the end.
//! - decode, Q6_K (likewise): per 16-element sub-block the 6-bit quants are rebuilt in integer
//!   lanes and multiplied by the sub-block's 8-bit scale as integers (exact), converted and
//!   multiplied with x into a super-block partial that `d` scales once.
//! - decode, every other format (Q2_K, Q3_K, Q5_K, Q8_K): the generic block GEMV of [`x86`]:
//!   each block is decoded exactly (ggml's operations, vectorised by the compiler under the
//!   ISA's features) into an L1 buffer and multiplied with x by FMA, four rows at a time.
//! - 2 to 8 tokens (small batched-decode steps, speculative verification), legacy formats,
//!   Q4_K and Q6_K, AVX2 and AVX-512: each row's blocks are decoded once for all the tokens, and
//!   each token is summed as its one-token GEMV sums it (bit-identical), instead of dequantizing
//!   whole tiles for a few tokens (SmolLM2 Q4_1 decode of 4 sequences on a Zen 5: 308–345 →
//!   445–465 tok/s).
//! - prefill (`tokens > 1`, and every token count at the scalar level): a tile of rows is
//!   dequantized to f32 (bit-identical to ggml's reference dequantization) into thread-local
//!   scratch and handed to the f32 kernels, so the per-element dequantization cost is shared by
//!   all tokens.
//!
//! On AVX-512 CPUs, engines in [`Numerics::Exact`] (and [`Numerics::Bf16`], whose decode is exact)
//! hold their Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K and Q6_K matrices regrouped sixteen rows to a
//! group ([`WeightData::Grouped`], [`grouped`]): the 16 lanes of every vector are 16 output rows, each
//! quant one shift and one table lookup from f32, so no block scale is gathered and nothing is
//! summed across lanes; calls of 1 to 16 tokens run on it ([`avx512_grouped`]), bit-identical per
//! token whatever the call's size, and prefill dequantizes its tiles from it. One core of an
//! Intel Xeon with AVX-512 FP16 (`cargo bench --bench kernels -- gemv`, the blocks as stored
//! against grouped, one run): Q4_1 1536 × 576 10.4 → 16.1 GiB/s, Q4_1 4864 × 896 9.8 → 16.0,
//! Q5_0 4864 × 896 8.6 → 16.2, Q8_0 1536 × 576 17.4 → 24.3 (and above the int16 kernels on the
//! stored blocks: 10.3, 11.5, 9.0 and 21.5); Q4_K 896 × 4864 8.8 → 12.4, Q6_K 896 × 4864 9.7 →
//! 13.2. The K formats' next-group prefetches are spread over their sub-blocks: issued as one
//! burst per super-block (37 and 53 lines) they held Qwen2.5-Coder's down projection at 13.6–14.0
//! GB/s in a 2-thread decode against 15.1–17.2 on the stored blocks; spread, 16.8–18.1
//! (`kiln-bench --profile`). The kernels below, on the blocks as stored, run everywhere else:
//! AVX2 CPUs, int16 engines, and matrices built by hand.
//!
//! [`Numerics::Int16`] engines on AVX512-VNNI CPUs hold grouped weights too, and their calls of
//! every size on grouped Q4_0, Q4_1 and (with AVX512-VBMI) Q8_0 round the activations to 16-bit
//! integers and take each block's integer sums from `vpdpbusd` ([`grouped_i16`],
//! [`avx512_grouped_i16`]): no quant is converted to f32, and one core of the 2-vCPU Intel Xeon
//! (family 6 model 167) ran a Q4_1 1536 × 576 one-token product at 39–43 GiB/s against the exact
//! grouped kernel's 19 (`cargo bench --bench kernels -- 'gemv/Q4_1-grouped'`). [`Numerics::Int24`]
//! (the default) runs the same kernel on 24-bit integers (three bytes an activation) in calls
//! of up to 16 tokens: as accurate as the exact kernels, faster than them there.
//!
//! [`Numerics::Int8`] engines hold their Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 matrices regrouped sixteen
//! rows to a group ([`WeightData::Interleaved`], [`int8`]) and run every call on them through one
//! AVX512-VNNI kernel ([`avx512_i8`]) whose 16 lanes are 16 output rows, against 8-bit activations:
//! decode at the memory's speed, batched steps and prefill on `vpdpbusd`; CPUs with AVX2 but not
//! AVX512-VNNI run the same bytes through `vpmaddubsw` ([`avx2_i8`], two halves of eight rows),
//! bit for bit the same results. On AMX CPUs calls of
//! 16 tokens or more take the integer sums from AMX-INT8 tiles instead ([`amx_i8`], the same
//! bits), and the products with bf16 weights from AMX-BF16 tiles ([`amx`]: rounded activations
//! for [`Numerics::Bf16`], exact three-part products otherwise); `KILN_AMX=0` turns
//! both off.

use std::cell::RefCell;
use std::ops::Range;

use half::bf16;

use super::keep_awake;
pub use super::pages::{Pages, WeightArena};
use super::par;
use super::simd::{self, Level};
use crate::model::quant::{self, BlockFormat, QuantKind};
use crate::with_format;

#[cfg(target_arch = "x86_64")]
mod amx;
#[cfg(target_arch = "x86_64")]
mod amx_i8;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx2_grouped;
#[cfg(target_arch = "x86_64")]
mod avx2_halves;
#[cfg(target_arch = "x86_64")]
mod avx2_i16;
#[cfg(target_arch = "x86_64")]
mod avx2_i8;
#[cfg(target_arch = "x86_64")]
mod avx2_panel;
#[cfg(target_arch = "x86_64")]
// The AVX-512 intrinsics are stable since Rust 1.89, the workspace's `rust-version`.
mod avx512;
#[cfg(target_arch = "x86_64")]
mod avx512_bf16_panel;
#[cfg(target_arch = "x86_64")]
mod avx512_grouped;
#[cfg(target_arch = "x86_64")]
mod avx512_grouped_i16;
#[cfg(target_arch = "x86_64")]
mod avx512_groups;
#[cfg(target_arch = "x86_64")]
mod avx512_i16;
#[cfg(target_arch = "x86_64")]
mod avx512_i8;
#[cfg(target_arch = "x86_64")]
mod avx512_panel;
#[cfg(target_arch = "x86_64")]
mod avx512_split;
mod grouped;
mod grouped_i16;
mod int16;
mod int8;
mod prefetch;
mod scalar;

pub use grouped::{groupable, Grouped};
pub use int8::{interleavable, Interleaved};
#[cfg(target_arch = "x86_64")]
pub(crate) use prefetch::line_to as prefetch_line;
pub(crate) use prefetch::ROW_AHEAD_L2;
#[cfg(test)]
mod tests;
#[cfg(target_arch = "x86_64")]
mod x86;

/// How activations meet the weights: exactly, or rounded where that is faster (16-bit integers
/// against quantized weights in calls of 1 to 16 tokens, bf16 against bf16 or bf16-rounded
/// quantized weights in calls of more).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Numerics {
    /// f32 activations (never rounded): every product equals the f32 product of the
    /// dequantized weights with the activations, up to the rounding of the sums. The tests hold
    /// it, and [`Numerics::Int24`] (the default), to the same bounds against transformers and
    /// nanochat. On AMX CPUs the
    /// products with bf16 weights in calls of more than 16 tokens run on AMX-BF16 tiles, each
    /// activation cut into three bf16 parts that sum to it exactly ([`amx`]): the terms stay
    /// exact, but the tiles read bf16 subnormals as zero, so activations below 2⁻¹¹⁰ in
    /// magnitude lose their low bits there (below 2⁻¹²⁶, all of them).
    Exact,
    /// Activations rounded to 16-bit integers per 32-element block (`x ≈ d·q`,
    /// `d = max|x| / 32767`: at most a relative 1.5·10⁻⁵ of the block's largest value per
    /// element) and multiplied with the weights' integer quants in integer lanes. On CPUs with
    /// AVX512-VNNI the engine groups its weights as exact engines do, and Q4_0, Q4_1 and (with
    /// AVX512-VBMI) Q8_0 take the rounded activations there in calls of every size, prefill
    /// included ([`grouped_i16`]: `vpdpbusd` on each activation's two bytes, about twice the
    /// exact grouped kernel's speed on one core at one token, and above the f32 panels at many),
    /// while its other grouped formats run the exact kernels. On other AVX2 CPUs the engine
    /// keeps the blocks as stored, and Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K and Q6_K take them
    /// through integer kernels on those in calls of 1 to 16 tokens, which are slower than the
    /// exact grouped kernels there (README). Each token's result is the same whichever call it
    /// is in, except on those stored blocks, whose calls of more tokens run exact. Everything
    /// else (f32/bf16 weights, other formats, CPUs without AVX2) runs as [`Numerics::Exact`].
    /// What it costs in agreement with the exact path is measured in the README.
    Int16,
    /// Activations rounded to 24-bit integers per 32-element block (`d = max|x| / 8388607`: at
    /// most 2⁻²⁴ of the block's largest value per element, the size of one f32 rounding of it)
    /// against grouped Q4_0, Q4_1 and (with AVX512-VBMI) Q8_0 weights, their products exact in
    /// integer lanes (`vpdpbusd` on each activation's three bytes, [`grouped_i16`]) in calls of
    /// up to 16 tokens. Its results differ from [`Numerics::Exact`]'s by about as much as the
    /// exact path's own rounding, so it is held to the same reference bounds. Needs AVX512-VNNI
    /// at the AVX-512 level; everything else (other formats and weights, larger calls, other
    /// CPUs, a lower level) runs as [`Numerics::Exact`]. The default: on the CPUs with its
    /// kernel it decodes faster than exact at the exact path's accuracy (README), and elsewhere
    /// it is exact.
    #[default]
    Int24,
    /// Activations rounded to bf16 (nearest even) against bf16 weights in calls of more than 16
    /// tokens (prefill chunks, large batched steps), multiplied in pairs by `vdpbf16ps` into
    /// f32 sums: twice the multiply-adds per instruction of the f32 kernels, at the cost of
    /// each activation's rounding to 8 significant bits (a relative 2⁻⁹ at most). Quantized
    /// weights take part too: each tile is dequantized exactly, as in exact prefill, then its
    /// values rounded to bf16 (a second relative 2⁻⁹ per product; about twice the divergence
    /// of bf16 weights, measured in the README). The same calls' attention rounds queries, keys,
    /// values and softmax weights to bf16 and multiplies them by `vdpbf16ps` too
    /// (`attention_bf16`). Needs AVX512-BF16; everything else (products with f32 weights, calls
    /// of up to 16 tokens, decode, other CPUs) runs as [`Numerics::Exact`].
    Bf16,
    /// Activations rounded to 8-bit integers per 32-element block (`d = max|x| / 127`: at most a
    /// relative 0.4% of the block's largest value per element, llama.cpp's activations) against
    /// Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 weights, which the engine regroups at load sixteen rows to a
    /// group for AVX512-VNNI's `vpdpbusd` or AVX2's `vpmaddubsw` ([`int8`]), in every call (decode,
    /// batched steps and prefill; each token's result is the same whichever call it is in, and the
    /// same bits on either kind of CPU). Other formats, and CPUs without AVX2, run as
    /// [`Numerics::Exact`].
    /// What it costs in agreement with the exact path is measured in the README.
    Int8,
}

impl Numerics {
    pub const ALL: [Numerics; 5] = [
        Numerics::Exact,
        Numerics::Int24,
        Numerics::Int16,
        Numerics::Bf16,
        Numerics::Int8,
    ];

    /// The name used by `--numerics`.
    pub fn name(self) -> &'static str {
        match self {
            Numerics::Exact => "exact",
            Numerics::Int16 => "int16",
            Numerics::Int24 => "int24",
            Numerics::Bf16 => "bf16",
            Numerics::Int8 => "int8",
        }
    }
}

/// Whether a call of `tokens` token rows runs [`Numerics::Bf16`]'s kernels on this CPU: the
/// numerics asked for, AVX512-BF16 at the kernels' SIMD level, more than 16 rows. The matrix
/// products (for bf16 and quantized weights) and the attention take the same decision, so a
/// call is either all bf16 or all exact.
pub fn bf16_applies(numerics: Numerics, tokens: usize) -> bool {
    bf16_call(simd::level(), numerics, tokens)
}

/// [`bf16_applies`] at `level`.
fn bf16_call(level: Level, numerics: Numerics, tokens: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        numerics == Numerics::Bf16
            && simd::clamp(level) == Level::Avx512Bf16
            && tokens > avx512::TILE_TOKENS
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (level, numerics, tokens);
        false
    }
}

/// Whether this CPU runs [`Numerics::Int8`]'s kernels (AVX512-VNNI, or AVX2, at the kernels' SIMD
/// level): an engine interleaves its weights for them only then.
pub fn int8_kernels() -> bool {
    #[cfg(target_arch = "x86_64")]
    return avx512_i8::available() || avx2_i8::available();
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Whether this CPU runs [`Numerics::Int16`]'s (and [`Numerics::Int24`]'s) products on grouped
/// Q4_0, Q4_1, Q5_0 and Q8_0 weights ([`grouped_i16`]: AVX512-VNNI at the kernels' SIMD level):
/// an int16 engine then groups its weights as exact engines do (Q5_0 in its own layout), where
/// it otherwise keeps the blocks as stored for the integer kernels on those (int24 engines
/// always group them).
pub fn int16_grouped_kernels() -> bool {
    #[cfg(target_arch = "x86_64")]
    return avx512_grouped_i16::available();
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Whether an engine of `numerics` groups its weights for the integer kernels
/// ([`Grouped::new`]'s `integer`): int16 and int24 where this CPU has them.
pub fn integer_layouts(numerics: Numerics) -> bool {
    matches!(numerics, Numerics::Int16 | Numerics::Int24) && int16_grouped_kernels()
}

/// Which prefetch policy the streaming kernels follow in this process, as `KILN_PREFETCH`
/// spells it: `l2` (Intel CPUs: next weights into L2, the one-row GEMV's stream prefetched
/// ahead), `rows` (AMD Zen 5: only the one-row GEMV's stream, into L2) or `l1` (others). See
/// `prefetch.rs` for what each was measured to do.
pub fn prefetch_policy() -> &'static str {
    prefetch::policy().name()
}

/// Whether `numerics`' calls of many tokens run on AMX tiles in this process (an AMX CPU, Linux
/// granting the tile state, `KILN_AMX` not `0`): at the AVX512-BF16 level every numerics'
/// products with bf16 weights (AMX-BF16: rounded activations for [`Numerics::Bf16`], which
/// also rounds quantized weights onto them, exact three-part products otherwise), and
/// [`Numerics::Int8`] on interleaved weights (AMX-INT8).
pub fn amx_tiles(numerics: Numerics) -> bool {
    #[cfg(target_arch = "x86_64")]
    return match numerics {
        Numerics::Int8 if amx_i8::enabled() => true,
        _ => simd::level() == Level::Avx512Bf16 && amx::enabled(),
    };
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = numerics;
        false
    }
}

/// Weight storage the kernels read directly (bf16 is never widened in memory, quantized blocks
/// are never dequantized in memory).
pub enum WeightData {
    F32(Pages<f32>),
    BF16(Pages<bf16>),
    /// ggml blocks, rows concatenated: row `n` is `blocks[n·row_bytes..(n+1)·row_bytes]` with
    /// `row_bytes = cols / kind.block_elems() · kind.block_bytes()`. An owned copy rather than a
    /// borrow of the file mapping: merged linears (qkv, gate|up) must be concatenated anyway, the
    /// 34/18/20-byte blocks make every load unaligned whatever the base, and an owned buffer keeps
    /// the packed matrix independent of the file (one extra copy of ~the file size at load),
    /// on huge pages ([`Pages`]).
    Quant {
        kind: QuantKind,
        blocks: Pages<u8>,
    },
    /// Consecutive row ranges held in different formats: a merged linear whose parts were stored
    /// differently (Qwen2.5-Coder's Q4_K_M file has q and k in Q5_0 beside a Q8_0 v in half its
    /// layers). Each part keeps its own format and the kernels run part by part within one
    /// call; widening every part to f32 instead moved 5× the bytes of those layers' qkv.
    Parts(Vec<MatrixPart>),
    /// Q4_0, Q4_1, Q5_0, Q5_1 or Q8_0 blocks regrouped for [`Numerics::Int8`]'s kernels (engines
    /// loaded in that numerics on CPUs with AVX512-VNNI or AVX2): every call rounds its
    /// activations to 8 bits.
    Interleaved(Interleaved),
    /// Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K or Q6_K blocks regrouped for the exact AVX-512 and AVX2
    /// kernels of [`grouped`] (engines whose decode is exact, on AVX-512 and AVX2 CPUs; int8
    /// engines' K-quant matrices).
    Grouped(Grouped),
}

/// Rows `rows` of a [`WeightData::Parts`] matrix, following the previous part's rows.
pub struct MatrixPart {
    pub rows: usize,
    pub data: WeightData,
}

/// Checks `bytes` bytes of `kind` blocks against a `rows × cols` shape.
pub fn check_blocks(kind: QuantKind, bytes: usize, rows: usize, cols: usize) -> Result<(), String> {
    let n = kind.block_elems();
    if !cols.is_multiple_of(n) {
        return Err(format!(
            "{} rows of {cols} columns are not whole {n}-element blocks",
            kind.name()
        ));
    }
    let want = rows
        .checked_mul(cols / n)
        .and_then(|b| b.checked_mul(kind.block_bytes()));
    if want != Some(bytes) {
        return Err(format!(
            "{bytes} bytes of {} blocks for a {rows}x{cols} matrix, expected {}",
            kind.name(),
            want.map_or_else(|| "more than memory holds".to_string(), |w| w.to_string())
        ));
    }
    Ok(())
}

impl WeightData {
    /// Checks quantized blocks against a `rows × cols` shape (other formats always pass).
    pub fn check_shape(&self, rows: usize, cols: usize) -> Result<(), String> {
        if let WeightData::Quant { kind, blocks } = self {
            check_blocks(*kind, blocks.len(), rows, cols)?;
        }
        if let WeightData::Interleaved(m) = self {
            if (m.rows, m.cols) != (rows, cols) {
                return Err(format!(
                    "interleaved {}x{} weights for a {rows}x{cols} matrix",
                    m.rows, m.cols
                ));
            }
            m.check()?;
        }
        if let WeightData::Grouped(m) = self {
            if (m.rows, m.cols) != (rows, cols) {
                return Err(format!(
                    "grouped {}x{} weights for a {rows}x{cols} matrix",
                    m.rows, m.cols
                ));
            }
            m.check()?;
        }
        if let WeightData::Parts(parts) = self {
            let total: usize = parts.iter().map(|p| p.rows).sum();
            if total != rows {
                return Err(format!(
                    "parts of {total} rows in all for a {rows}x{cols} matrix"
                ));
            }
            for p in parts {
                p.data.check_shape(p.rows, cols)?;
            }
        }
        Ok(())
    }

    /// Whether these weights, or one of their parts, are bf16.
    fn has_bf16(&self) -> bool {
        match self {
            WeightData::BF16(_) => true,
            WeightData::Parts(parts) => parts.iter().any(|p| p.data.has_bf16()),
            _ => false,
        }
    }

    /// Whether [`Numerics::Bf16`] rounds these weights' values to bf16 (bf16 and quantized
    /// weights; f32 weights, which a user asked for, stay exact).
    fn bf16_eligible(&self) -> bool {
        match self {
            WeightData::F32(_) | WeightData::Interleaved(_) => false,
            WeightData::BF16(_) | WeightData::Quant { .. } | WeightData::Grouped(_) => true,
            WeightData::Parts(parts) => parts.iter().any(|p| p.data.bf16_eligible()),
        }
    }

    /// Bytes held (every part's).
    fn bytes(&self) -> usize {
        match self {
            WeightData::F32(v) => v.len() * 4,
            WeightData::BF16(v) => v.len() * 2,
            WeightData::Quant { blocks, .. } => blocks.len(),
            WeightData::Interleaved(m) => m.bytes.len(),
            WeightData::Grouped(m) => m.bytes.len(),
            WeightData::Parts(parts) => parts.iter().map(|p| p.data.bytes()).sum(),
        }
    }

    /// Row `n` of a matrix of `cols` columns, widened to f32 into `dst` (`cols` long): an
    /// embedding lookup dequantizes only the row it reads.
    ///
    /// # Panics
    /// If `n` is not a row of the matrix.
    pub fn row_f32(&self, n: usize, cols: usize, dst: &mut [f32]) {
        match self {
            WeightData::F32(w) => dst.copy_from_slice(&w[n * cols..(n + 1) * cols]),
            WeightData::BF16(w) => {
                for (d, s) in dst.iter_mut().zip(&w[n * cols..(n + 1) * cols]) {
                    *d = s.to_f32();
                }
            }
            WeightData::Quant { kind, blocks } => {
                let rb = cols / kind.block_elems() * kind.block_bytes();
                quant::dequantize_row(*kind, &blocks[n * rb..(n + 1) * rb], dst);
            }
            WeightData::Interleaved(m) => m.row_f32(n, dst),
            WeightData::Grouped(m) => m.row_f32(n, dst),
            WeightData::Parts(parts) => {
                let mut start = 0;
                for p in parts {
                    if n < start + p.rows {
                        return p.data.row_f32(n - start, cols, dst);
                    }
                    start += p.rows;
                }
                panic!("row {n} of a matrix of {start} rows");
            }
        }
    }

    /// Whether a kernel reads [`Numerics::Int16`]'s rounded activations (a part in a format
    /// that has integer kernels).
    fn takes_int16(&self) -> bool {
        match self {
            WeightData::Quant { kind, .. } => with_format!(*kind, F => F::INT16),
            WeightData::Parts(parts) => parts.iter().any(|p| p.data.takes_int16()),
            WeightData::F32(_)
            | WeightData::BF16(_)
            | WeightData::Interleaved(_)
            | WeightData::Grouped(_) => false,
        }
    }

    /// Whether a part is [`WeightData::Grouped`] in a format with grouped int16 products
    /// ([`grouped_i16`]).
    fn takes_grouped_int16(&self) -> bool {
        match self {
            WeightData::Grouped(g) => grouped_i16::takes(g),
            WeightData::Parts(parts) => parts.iter().any(|p| p.data.takes_grouped_int16()),
            _ => false,
        }
    }

    /// Whether a part is [`WeightData::Interleaved`], whose kernels read 8-bit activations.
    fn takes_int8(&self) -> bool {
        match self {
            WeightData::Interleaved(_) => true,
            WeightData::Parts(parts) => parts.iter().any(|p| p.data.takes_int8()),
            _ => false,
        }
    }

    /// Whether a part is [`WeightData::Grouped`] in a format whose exact kernel multiplies block
    /// sums of the activations (a min: Q4_1, Q5_1, Q4_K), not counting the parts that take
    /// int16 products where `int16` (whose activations carry their own sums).
    fn takes_grouped_sums(&self, int16: bool) -> bool {
        match self {
            WeightData::Grouped(g) => g.takes_sums() && !(int16 && grouped_i16::takes(g)),
            WeightData::Parts(parts) => parts.iter().any(|p| p.data.takes_grouped_sums(int16)),
            _ => false,
        }
    }

    /// The formats and layouts of the part's [`WeightData::Grouped`] parts, pushed onto `kinds`.
    fn grouped_kinds(&self, kinds: &mut Vec<(QuantKind, grouped::Layout)>) {
        match self {
            WeightData::Grouped(g) => kinds.push((g.kind, g.layout)),
            WeightData::Parts(parts) => parts.iter().for_each(|p| p.data.grouped_kinds(kinds)),
            _ => {}
        }
    }

    /// Whether a part's kernels take rows sixteen at a time ([`WeightData::Interleaved`],
    /// [`WeightData::Grouped`]).
    fn takes_groups(&self) -> bool {
        match self {
            WeightData::Interleaved(_) | WeightData::Grouped(_) => true,
            WeightData::Parts(parts) => parts.iter().any(|p| p.data.takes_groups()),
            _ => false,
        }
    }

    /// These weights regrouped for [`grouped`]'s exact kernels: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
    /// Q4_K and Q6_K blocks (parts of other formats, and other data, unchanged).
    pub fn grouped(self, rows: usize, cols: usize) -> WeightData {
        self.grouped_for(rows, cols, Numerics::Exact)
    }

    /// [`WeightData::grouped`] as an engine of `numerics` groups them: for the integer kernels
    /// of [`Numerics::Int16`] and [`Numerics::Int24`] where this CPU has them
    /// ([`int16_grouped_kernels`]; Q5_0 then in [`grouped::Layout::Planes`]).
    pub fn grouped_for(self, rows: usize, cols: usize, numerics: Numerics) -> WeightData {
        let integer = integer_layouts(numerics);
        match self {
            WeightData::Quant { kind, blocks } if groupable(kind) => {
                WeightData::Grouped(Grouped::new(
                    kind,
                    (rows, cols),
                    &blocks,
                    integer,
                    &mut WeightArena::new(),
                ))
            }
            WeightData::Parts(parts) => WeightData::Parts(
                parts
                    .into_iter()
                    .map(|p| MatrixPart {
                        rows: p.rows,
                        data: p.data.grouped_for(p.rows, cols, numerics),
                    })
                    .collect(),
            ),
            other => other,
        }
    }

    /// These weights regrouped for [`Numerics::Int8`]: Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 blocks
    /// (parts of other formats, and other data, unchanged).
    pub fn interleaved(self, rows: usize, cols: usize) -> WeightData {
        self.interleaved_in(rows, cols, &mut WeightArena::new())
    }

    /// [`WeightData::interleaved`], the regrouped bytes placed in `arena`.
    pub fn interleaved_in(self, rows: usize, cols: usize, arena: &mut WeightArena) -> WeightData {
        match self {
            WeightData::Quant { kind, blocks } if interleavable(kind) => {
                WeightData::Interleaved(Interleaved::new(kind, rows, cols, &blocks, arena))
            }
            WeightData::Parts(parts) => WeightData::Parts(
                parts
                    .into_iter()
                    .map(|p| MatrixPart {
                        rows: p.rows,
                        data: p.data.interleaved_in(p.rows, cols, arena),
                    })
                    .collect(),
            ),
            other => other,
        }
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
        self.data.bytes() + self.bias.as_ref().map_or(0, |b| b.len() * 4)
    }
}

/// A raw output pointer that rayon tasks may share because each writes disjoint columns.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

/// The output rows of each task: about four tasks per thread (two in one-token calls), small
/// enough to balance across threads, large enough that the per-task overhead vanishes next to
/// the bytes streamed. A one-token call of a small model streams a few hundred KiB in a few
/// tens of microseconds, where every task start (a rayon steal, a prefetch stream begun
/// anew) shows: on the 2-vCPU Intel Xeon, SmolLM2 Q4_1 decode at two threads (with the
/// grouped kernels' prefetch past a job's last group, [`avx512_groups`]), six runs
/// alternating, median 215.5 tok/s at four tasks a thread, 224.6 at two, 218.8 at one; two
/// still leave a thread that starts late a half task to take from the other. Task
/// boundaries fall on multiples of the kernels' unit (4 rows, the GEMVs' row block; 16, a group
/// of grouped or interleaved weights; with more than one token, one packed panel's outputs)
/// and split the units as evenly as they can: rayon halves the list of tasks between threads,
/// and equal-sized tasks with a short last one gave one of two threads 320 of 576 rows.
fn task_rows(level: Level, w: &PackedMatrix, tokens: usize) -> TaskRows {
    let threads = par::threads();
    // Multi-token calls go one packed panel's outputs at a time (the quantized prefill tiles
    // too): 32 on AVX-512, 16 on AVX2.
    let panel = tile_rows(simd::clamp(level), tokens);
    // Interleaved and grouped weights go 16 rows (one group) at a time.
    let one_token = if w.data.takes_groups() {
        int8::GROUP
    } else {
        4
    };
    let unit = if tokens > 1 { panel } else { one_token };
    let min_rows = if tokens > 1 { panel } else { 64 };
    let units = w.rows.div_ceil(unit);
    let per_thread = if tokens > 1 { 4 } else { 2 };
    let tasks = (threads * per_thread)
        .min(w.rows.div_ceil(min_rows))
        .clamp(1, units.max(1));
    TaskRows {
        tasks,
        units,
        unit,
        rows: w.rows,
    }
}

/// A call's tasks ([`task_rows`]), each task's rows computed when it starts rather than listed
/// in a vector that every call allocated (a one-token call's allocations show in a decode
/// step: see [`grouped_i16::recycle`]).
#[derive(Clone, Copy, Debug)]
struct TaskRows {
    tasks: usize,
    units: usize,
    unit: usize,
    rows: usize,
}

impl TaskRows {
    /// Task `i`'s rows: units `⌊i·units/tasks⌋..⌊(i+1)·units/tasks⌋`, all non-empty when the
    /// matrix has rows (`tasks ≤ units`).
    fn rows(&self, i: usize) -> std::ops::Range<usize> {
        let at = |i: usize| (i * self.units / self.tasks * self.unit).min(self.rows);
        at(i)..at(i + 1)
    }

    /// Every task's rows, in order.
    #[cfg(test)]
    fn iter(&self) -> impl Iterator<Item = std::ops::Range<usize>> + '_ {
        (0..self.tasks).map(|i| self.rows(i))
    }
}

/// Weight bytes that the step's thread takes beyond an even share of a call on the step's team
/// ([`TeamRows`]), because the keepers start later: a keeper sees the call's post and claims its
/// part ~0.25–0.4 µs after the step's thread starts its own, and the step's thread learns that a
/// keeper has finished ~0.3–0.5 µs after it has (cross-core handoffs of the 2-vCPU Xeon, family
/// 6 model 207; a ping-pong of two lines there takes 0.2–0.35 µs), so with even parts the step's
/// thread waited ~1 µs at the end of every call. 12 KiB is about half that time at one core's
/// share of the memory's bandwidth. SmolLM2 Q4_1 decode, 2 threads of that Xeon, one process
/// alternating, 128 steps a round, median per-round ratio against even parts: 1.012 (80 rounds,
/// quartiles 1.000–1.029) and 1.008 (40 rounds); 6 KiB 0.997, 18 KiB 1.004;
/// Qwen2.5-Coder-0.5B Q4_K_M (calls of 100 µs a part and more) 0.996, within its spread. With
/// the keepers' early claim ([`keep_awake`]'s `Slot::own_ahead`), both against neither: Q4_1
/// 1.024 (60 rounds, quartiles 1.006–1.038), Q8_0 1.010 (40), BF16 0.997 and Qwen 0.993
/// (within their spreads of ±4%). Measured on Intel only: other vendors' cross-core handoffs
/// may cost less, where a lead would leave the keepers idle, so elsewhere parts stay even
/// ([`caller_lead_bytes`]).
const CALLER_LEAD_BYTES: usize = 12 << 10;

/// The lead this process gives the step's thread: [`CALLER_LEAD_BYTES`] on Intel CPUs, none
/// elsewhere.
fn caller_lead_bytes() -> usize {
    if prefetch::intel() {
        CALLER_LEAD_BYTES
    } else {
        0
    }
}

/// The parts of a call on the step's team: the call's units ([`TaskRows`]) split evenly, except
/// that part 0 (the step's own thread) takes a lead of some bytes more ([`caller_lead_bytes`]),
/// in whole units, where the call has more than eight times that many units.
#[derive(Clone, Copy, Debug)]
struct TeamRows {
    units: usize,
    unit: usize,
    rows: usize,
    members: usize,
    /// Units of part 0: an even share plus the lead.
    first: usize,
}

impl TeamRows {
    /// `members` parts (2 or more, at most `tasks.units`) of a call whose matrix holds `bytes`,
    /// part 0 with a lead of `lead_bytes`.
    fn new(tasks: TaskRows, members: usize, bytes: usize, lead_bytes: usize) -> TeamRows {
        let TaskRows {
            units, unit, rows, ..
        } = tasks;
        let unit_bytes = (bytes / units.max(1)).max(1);
        let lead = (lead_bytes + unit_bytes / 2) / unit_bytes;
        let lead = if units > 8 * lead { lead } else { 0 };
        TeamRows {
            units,
            unit,
            rows,
            members,
            first: (units / members + lead).min(units),
        }
    }

    /// Part `i`'s rows: part 0 units `0..first`, the others the rest split as evenly as units
    /// allow.
    fn rows(&self, i: usize) -> std::ops::Range<usize> {
        let rest = self.units - self.first;
        let at = |i: usize| {
            let units = if i == 0 {
                0
            } else {
                self.first + (i - 1) * rest / (self.members - 1)
            };
            (units * self.unit).min(self.rows)
        };
        at(i)..at(i + 1)
    }
}

/// `out[t·ldo + n] (+)= bias[n] + Σ_k W[n,k]·x[t·ldx + k]` for every token `t` and output `n`,
/// split over the current rayon pool by output rows, with the given [`Numerics`].
///
/// `accumulate` adds into `out` (a fused residual add) instead of overwriting it.
#[allow(clippy::too_many_arguments)]
pub fn matmul(
    numerics: Numerics,
    w: &PackedMatrix,
    x: &[f32],
    ldx: usize,
    tokens: usize,
    out: &mut [f32],
    ldo: usize,
    accumulate: bool,
) {
    matmul_with(
        simd::level(),
        numerics,
        w,
        x,
        ldx,
        tokens,
        out,
        ldo,
        accumulate,
    )
}

/// [`matmul`] at an explicit SIMD level (clamped to what the CPU supports), exact.
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
    matmul_with(
        level,
        Numerics::Exact,
        w,
        x,
        ldx,
        tokens,
        out,
        ldo,
        accumulate,
    )
}

/// [`matmul`] at an explicit SIMD level (clamped to what the CPU supports) and [`Numerics`].
#[allow(clippy::too_many_arguments)]
pub fn matmul_with(
    level: Level,
    numerics: Numerics,
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
    let tasks = task_rows(level, w, tokens);
    let run = |rows: Range<usize>, prepared: &Prepared| {
        if rows.is_empty() {
            return;
        }
        let p = ptr;
        // SAFETY: tasks and parts own disjoint column ranges `rows` of every output row, and
        // `out` outlives the call; the asserts above bound every index written.
        unsafe {
            rows_job(
                level, w, x, ldx, tokens, rows, p.0, ldo, accumulate, prepared,
            )
        };
    };
    // A call of up to [`TEAM_TOKENS`] tokens inside a forward step goes to the step's team, a
    // part a thread ([`keep_awake::parts`], rows by [`TeamRows`]); each part prepares its own
    // activations (the same bits), so no thread waits while one rounds them. SmolLM2 decode, 2
    // threads of the 2-vCPU Xeon (family 6 model 207), one process alternating rayon loops and
    // parts, 30 rounds, median per-round ratio: Q4_1 int24 1.037–1.039 with the activations
    // prepared once before the parts, 1.059 with each part preparing its own; Q8_0 1.038,
    // Qwen2.5-Coder-0.5B Q4_K_M 1.031.
    let members = if tokens <= TEAM_TOKENS {
        keep_awake::members()
    } else {
        0
    };
    if members >= 2 && members <= tasks.units {
        let parts = TeamRows::new(tasks, members, w.bytes(), caller_lead_bytes());
        keep_awake::parts(&|i| {
            run(
                parts.rows(i),
                &Prepared::new(level, numerics, w, x, ldx, tokens),
            )
        });
        return;
    }
    // Computed once per call, shared by every task.
    let prepared = Prepared::new(level, numerics, w, x, ldx, tokens);
    par::for_each(0..tasks.tasks, |i| run(tasks.rows(i), &prepared));
}

/// The most tokens a call may have to go to the step's team rather than a rayon loop. SmolLM2
/// Q4_1 decode of several sequences, 64 steps, 2 threads of the 2-vCPU Xeon (family 6 model
/// 207), one process alternating calls of up to 1 and up to 16 tokens on the team, median
/// per-round ratio: 2 sequences 1.059, 4 1.039, 8 0.997, 16 0.999 (the larger calls' rayon
/// tasks balance better than fixed parts, and their overhead is a smaller share).
const TEAM_TOKENS: usize = 4;

/// What a call derives from its activation rows once and shares with every task (in a step's
/// team, once per part: see [`matmul_with`]): the rows rounded for the kernel's numerics, and
/// the block sums that formats with a min multiply.
#[derive(Default)]
struct Prepared {
    /// The token rows rounded for [`Numerics::Int16`].
    xq: Option<Vec<int16::XI16>>,
    /// The token rows rounded to 16 ([`Numerics::Int16`]) or 24 ([`Numerics::Int24`]) bits and
    /// cut into bytes for grouped weights' integer products ([`grouped_i16`]).
    x16g: Option<Vec<grouped_i16::Split>>,
    /// The token rows rounded to bf16 pairs for [`Numerics::Bf16`].
    xb: Option<Vec<u32>>,
    /// The token rows cut into three bf16 parts for exact products on AMX tiles.
    xs: Option<Vec<u32>>,
    /// The token rows rounded to 8 bits for interleaved weights.
    x8: Option<Vec<int8::XI8>>,
    /// The same, laid out for the AMX-INT8 tiles, where a call takes them.
    #[cfg(target_arch = "x86_64")]
    x8t: Option<amx_i8::Tokens>,
    /// [`grouped_block_sums`].
    sums: Option<Vec<f32>>,
    /// The activations as the AVX2 grouped kernels read them.
    #[cfg(target_arch = "x86_64")]
    xg: Option<avx2_grouped::Activations>,
    /// The activations' full tiles as the AVX2 panels read them.
    #[cfg(target_arch = "x86_64")]
    xp: Option<avx2_panel::PackedTokens>,
}

impl Drop for Prepared {
    /// Gives the call's splits back for the next call to fill.
    fn drop(&mut self) {
        if let Some(splits) = self.x16g.take() {
            grouped_i16::recycle(splits);
        }
    }
}

impl Prepared {
    fn new(
        level: Level,
        numerics: Numerics,
        w: &PackedMatrix,
        x: &[f32],
        ldx: usize,
        tokens: usize,
    ) -> Prepared {
        let x8 = int8_activations(w, x, ldx, tokens);
        let x16g = grouped_integer_activations(level, numerics, w, x, ldx, tokens);
        Prepared {
            xq: rounded_activations(level, numerics, w, x, ldx, tokens),
            sums: grouped_block_sums(level, w, x, ldx, tokens, x16g.is_some()),
            x16g,
            xb: bf16_activations(level, numerics, w, x, ldx, tokens),
            xs: split_activations(level, numerics, w, x, ldx, tokens),
            #[cfg(target_arch = "x86_64")]
            x8t: x8
                .as_deref()
                .filter(|_| simd::clamp(level) >= Level::Avx512 && amx_i8::takes(tokens))
                .map(|x| amx_i8::Tokens::new(x, w.cols)),
            x8,
            #[cfg(target_arch = "x86_64")]
            xg: grouped_activations(level, w, x, ldx, tokens),
            #[cfg(target_arch = "x86_64")]
            xp: panel_activations(level, w, x, ldx, tokens),
        }
    }
}

/// `Σ x` of every 32-element block of every token row (token `t`'s at `t·cols/32`), summed as
/// the kernels' reference sums it ([`block_sum`]), when grouped weights of a format with a min
/// (Q4_1, Q5_1, Q4_K) will run their AVX-512 kernels on this call. Once per call, not once per
/// task: each task needs every token's sums, and at 16 tokens and eight tasks the per-task sums
/// took ~5% of a SmolLM2 Q4_1 decode step on 2 threads (Intel Xeon, `perf`). Not for the
/// parts whose int16 products the call runs (`int16`), whose activations carry their sums.
fn grouped_block_sums(
    level: Level,
    w: &PackedMatrix,
    x: &[f32],
    ldx: usize,
    tokens: usize,
    int16: bool,
) -> Option<Vec<f32>> {
    if tokens == 0
        || tokens > grouped::MAX_TOKENS
        || simd::clamp(level) < Level::Avx2
        || !w.data.takes_grouped_sums(int16)
        || !w.cols.is_multiple_of(grouped::BLOCK)
        || x.len() < (tokens - 1) * ldx + w.cols
    {
        return None;
    }
    Some(grouped::token_block_sums(
        (0..tokens).map(|t| &x[t * ldx..t * ldx + w.cols]),
    ))
}

/// The activations of a call on grouped weights as the AVX2 grouped kernels read them
/// ([`avx2_grouped::Activations`]), where those kernels will run: once per call, not per task.
#[cfg(target_arch = "x86_64")]
fn grouped_activations(
    level: Level,
    w: &PackedMatrix,
    x: &[f32],
    ldx: usize,
    tokens: usize,
) -> Option<avx2_grouped::Activations> {
    if tokens > grouped::MAX_TOKENS || simd::clamp(level) != Level::Avx2 {
        return None;
    }
    let mut kinds = Vec::new();
    w.data.grouped_kinds(&mut kinds);
    Some(avx2_grouped::Activations::new(
        kinds.into_iter(),
        x,
        ldx,
        tokens,
        w.cols,
    ))
}

/// The activations' full tiles packed for the AVX2 panels ([`avx2_panel::PackedTokens`]) when
/// the call runs them: an AVX2 CPU (not AVX-512, whose panels are wider), at least
/// [`avx2_panel::PACK_MIN_TOKENS`] tokens (more than the few-token, grouped and integer
/// kernels take, so every format but interleaved weights reaches the panels).
#[cfg(target_arch = "x86_64")]
fn panel_activations(
    level: Level,
    w: &PackedMatrix,
    x: &[f32],
    ldx: usize,
    tokens: usize,
) -> Option<avx2_panel::PackedTokens> {
    if simd::clamp(level) != Level::Avx2
        || tokens < avx2_panel::PACK_MIN_TOKENS
        || matches!(w.data, WeightData::Interleaved(_))
        || x.len() < (tokens - 1) * ldx + w.cols
    {
        return None;
    }
    Some(avx2_panel::PackedTokens::new(x, ldx, tokens, w.cols))
}

/// A block's scale `d = amax / qmax` for rounding activations to integers up to `qmax`, and its
/// reciprocal: `(d, 1/d)`, the reciprocal 0 where `d` is 0 or its reciprocal overflows (every
/// `q` is then 0). [`int16`] and [`int8`] round with it.
#[inline(always)]
pub(crate) fn block_scale(amax: f32, qmax: f32) -> (f32, f32) {
    let d = amax / qmax;
    let id = if d > 0.0 { 1.0 / d } else { 0.0 };
    (d, if id.is_finite() { id } else { 0.0 })
}

/// `Σ c` of one block of activations: the block sum of every kernel and reference that takes
/// one (a format's min, an integer numerics' offset), so that all of them give the same bits.
/// A block of 2–32 elements, a power of two, is summed by folding halves: `c[i] + c[i + n/2]`
/// for each `i < n/2`, then the same of those, down to one; other lengths in element order.
/// The folds are what sixteen blocks' vectors reduce together at the cost of a few shuffles a
/// block ([`avx512_split`]); a sum in element order had to be a scalar chain beside them.
#[inline(always)]
pub(crate) fn block_sum(c: &[f32]) -> f32 {
    let n = c.len();
    if !(2..=32).contains(&n) || !n.is_power_of_two() {
        return c.iter().sum();
    }
    let mut a = [0f32; 32];
    a[..n].copy_from_slice(c);
    let mut half = n / 2;
    while half > 0 {
        for i in 0..half {
            a[i] += a[i + half];
        }
        half /= 2;
    }
    a[0]
}

/// One block `c` of activations rounded to integers up to `qmax` as the integer numerics'
/// references round it ([`int8`], [`int16`], [`grouped_i16`]): `None` where the block holds a
/// NaN or infinity (its scale is then NaN and its integers 0), else its scale `d`
/// ([`block_scale`] of its largest magnitude) and each element's `x·(1/d)` rounded to the nearest
/// integer, ties to even, still as f32 (within `±qmax` up to that product's rounding: each
/// caller casts or clamps).
pub(crate) fn round_block_ref(
    c: &[f32],
    qmax: f32,
) -> Option<(f32, impl Iterator<Item = f32> + '_)> {
    if c.iter().any(|v| !v.is_finite()) {
        return None;
    }
    let amax = c.iter().fold(0f32, |m, v| m.max(v.abs()));
    let (d, id) = block_scale(amax, qmax);
    Some((d, c.iter().map(move |&v| (v * id).round_ties_even())))
}

/// `f` of each of `tokens` rows of `cols` values, `ldx` apart in `x`: the activations a call
/// prepares once for every task. Prefill-sized calls round their rows on every thread of the
/// pool, in order: on one thread, while the others waited, a 512-token call's rounding took
/// a tenth to a fifth of a SmolLM2 int16 projection at two threads (a Zen 4).
fn per_token<T: Send>(
    x: &[f32],
    ldx: usize,
    tokens: usize,
    cols: usize,
    f: impl Fn(&[f32]) -> T + Sync,
) -> Vec<T> {
    let row = |t: usize| f(&x[t * ldx..t * ldx + cols]);
    if tokens.saturating_mul(cols) < PARALLEL_ROUNDING {
        (0..tokens).map(row).collect()
    } else {
        par::map_collect(0..tokens, row)
    }
}

/// Activation values from which [`per_token`] splits its rows between threads: 32 tokens of
/// 576 (SmolLM2's width), where a call is already a prefill chunk and its rounding tens of
/// microseconds.
const PARALLEL_ROUNDING: usize = 32 * 576;

/// The token rows rounded to 8-bit integers for interleaved weights (which only
/// [`Numerics::Int8`] engines hold, and which have no other kernel).
fn int8_activations(
    w: &PackedMatrix,
    x: &[f32],
    ldx: usize,
    tokens: usize,
) -> Option<Vec<int8::XI8>> {
    if !w.data.takes_int8() || tokens == 0 || x.len() < (tokens - 1) * ldx + w.cols {
        return None;
    }
    Some(per_token(x, ldx, tokens, w.cols, int8::quantize))
}

/// The token rows rounded to 16-bit integers when `numerics` asks for it and a kernel on the
/// blocks as stored will use them: 1 to 16 tokens (more run the exact kernels, whose packed
/// panels serve many tokens faster), quantized weights of a format with an integer kernel, an
/// AVX2 CPU.
fn rounded_activations(
    level: Level,
    numerics: Numerics,
    w: &PackedMatrix,
    x: &[f32],
    ldx: usize,
    tokens: usize,
) -> Option<Vec<int16::XI16>> {
    #[cfg(target_arch = "x86_64")]
    let max_tokens = avx2_i16::MAX_TOKENS;
    #[cfg(not(target_arch = "x86_64"))]
    let max_tokens = 0;
    if numerics != Numerics::Int16
        || !integer_call(level, w, x, ldx, tokens, max_tokens)
        || !w.data.takes_int16()
    {
        return None;
    }
    Some(per_token(x, ldx, tokens, w.cols, int16::quantize))
}

/// The token rows rounded to 16-bit ([`Numerics::Int16`]) or 24-bit ([`Numerics::Int24`])
/// integers and cut into bytes for the integer products of grouped Q4_0/Q4_1/Q5_0/Q8_0 weights
/// ([`grouped_i16`]), under the conditions of [`rounded_activations`] but for any number of
/// tokens: prefill and large batched steps take the same products as decode, so a token's result
/// never depends on how many rows its call held, and the integer products outrun the exact
/// panels at every size (one core of a Zen 4, Q4_1 1536 × 576 × 512 tokens: 78 G multiply-adds/s
/// at 16 bits against the f32 panels' 51). 24 bits only where the AVX512-VNNI kernel runs
/// (below it, int24 runs the exact kernels), and in calls of up to [`grouped::MAX_TOKENS`]
/// tokens: its eight more products a block cost half again the 16-bit kernel's time, and at
/// many tokens the f32 panels are faster (one core of the Intel Xeon family 6 model 207,
/// 1536 × 576: Q4_1 at 512 tokens 59 G multiply-adds/s against the panels' 72, Q8_0 51
/// against 71; at 16 tokens 64 against the exact grouped kernel's 58, and 56 against 59; at
/// one token 31 against 18 GiB/s, and 36 against 26). So, as in exact numerics, where the
/// grouped kernels serve calls of up to 16 tokens and the panels larger ones, a token's bits
/// can differ between a call of up to 16 tokens and a larger one.
fn grouped_integer_activations(
    level: Level,
    numerics: Numerics,
    w: &PackedMatrix,
    x: &[f32],
    ldx: usize,
    tokens: usize,
) -> Option<Vec<grouped_i16::Split>> {
    let (width, max_tokens) = match numerics {
        Numerics::Int16 => (grouped_i16::Width::Int16, usize::MAX),
        Numerics::Int24 if grouped_int24_kernel(level) => {
            (grouped_i16::Width::Int24, grouped::MAX_TOKENS)
        }
        _ => return None,
    };
    if !integer_call(level, w, x, ldx, tokens, max_tokens) || !w.data.takes_grouped_int16() {
        return None;
    }
    Some(per_token(x, ldx, tokens, w.cols, |x| {
        grouped_i16::split(x, width)
    }))
}

/// Whether a call at `level` runs [`Numerics::Int24`]'s kernel: AVX512-VNNI at the AVX-512
/// level.
fn grouped_int24_kernel(level: Level) -> bool {
    #[cfg(target_arch = "x86_64")]
    return simd::clamp(level) >= Level::Avx512 && avx512_grouped_i16::available();
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = level;
        false
    }
}

/// Whether a call can round its activations to integers (for the kernels that take them):
/// 1 to `max_tokens` tokens, whole 32-element blocks, an AVX2 CPU.
fn integer_call(
    level: Level,
    w: &PackedMatrix,
    x: &[f32],
    ldx: usize,
    tokens: usize,
    max_tokens: usize,
) -> bool {
    (1..=max_tokens).contains(&tokens)
        && simd::clamp(level) >= Level::Avx2
        && w.cols.is_multiple_of(int16::BLOCK)
        && x.len() >= (tokens - 1) * ldx + w.cols
}

/// The token rows rounded to bf16 pairs ([`avx512_bf16_panel::round_rows`]) when `numerics` is
/// [`Numerics::Bf16`] and its kernel will use them: bf16 or quantized weights, more than
/// [`avx512::TILE_TOKENS`] tokens, a CPU with AVX512-BF16.
fn bf16_activations(
    level: Level,
    numerics: Numerics,
    w: &PackedMatrix,
    x: &[f32],
    ldx: usize,
    tokens: usize,
) -> Option<Vec<u32>> {
    #[cfg(target_arch = "x86_64")]
    if bf16_call(level, numerics, tokens)
        && w.data.bf16_eligible()
        && x.len() >= (tokens - 1) * ldx + w.cols
    {
        // SAFETY: the clamped level says the CPU has AVX512-BF16; `x` holds the rows (checked).
        return Some(unsafe { avx512_bf16_panel::round_rows(x, ldx, tokens, w.cols) });
    }
    let _ = (level, numerics, w, x, ldx, tokens);
    None
}

/// The token rows cut into three bf16 parts ([`amx::split_rows`]) for exact products of bf16
/// weights on AMX tiles ([`exact_amx_call`]).
fn split_activations(
    level: Level,
    numerics: Numerics,
    w: &PackedMatrix,
    x: &[f32],
    ldx: usize,
    tokens: usize,
) -> Option<Vec<u32>> {
    #[cfg(target_arch = "x86_64")]
    if exact_amx_call(level, numerics, tokens, w.cols)
        && w.data.has_bf16()
        && x.len() >= (tokens - 1) * ldx + w.cols
    {
        // SAFETY: the clamped level says the CPU has AVX-512 F/BW; `x` holds the rows (checked).
        return Some(unsafe { amx::split_rows(x, ldx, tokens, w.cols) });
    }
    let _ = (level, numerics, w, x, ldx, tokens);
    None
}

/// Whether a call of `tokens` rows multiplies bf16 weights exactly on AMX-BF16 tiles, the
/// activations cut into three bf16 parts: a call that does not round for [`Numerics::Bf16`], more
/// than [`avx512::TILE_TOKENS`] rows (where the f32 panels would run), `k` a multiple of 32, at
/// the AVX512-BF16 level with AMX [`amx::enabled`]. Each product is exact, as on the f32
/// panels; the sums round in another order (per 32-element step, the CPU's), so the results
/// differ from the panels' in the last bits.
#[cfg(target_arch = "x86_64")]
fn exact_amx_call(level: Level, numerics: Numerics, tokens: usize, k: usize) -> bool {
    !bf16_call(level, numerics, tokens)
        && simd::clamp(level) == Level::Avx512Bf16
        && tokens > avx512::TILE_TOKENS
        && amx::takes(k)
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

/// [`matmul_rows_at`] with the given [`Numerics`] (the activation row is rounded here, per call).
///
/// # Safety
/// As [`matmul_rows`].
#[allow(clippy::too_many_arguments)]
pub unsafe fn matmul_rows_with(
    level: Level,
    numerics: Numerics,
    w: &PackedMatrix,
    x: &[f32],
    ldx: usize,
    tokens: usize,
    rows: Range<usize>,
    out: *mut f32,
    ldo: usize,
    accumulate: bool,
) {
    let prepared = Prepared::new(level, numerics, w, x, ldx, tokens);
    rows_job(
        level, w, x, ldx, tokens, rows, out, ldo, accumulate, &prepared,
    )
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
    matmul_rows_with(
        level,
        Numerics::Exact,
        w,
        x,
        ldx,
        tokens,
        rows,
        out,
        ldo,
        accumulate,
    )
}

/// [`matmul_rows_at`], with what the call [`Prepared`] from its activation rows.
///
/// # Safety
/// As [`matmul_rows`].
#[allow(clippy::too_many_arguments)]
unsafe fn rows_job(
    level: Level,
    w: &PackedMatrix,
    x: &[f32],
    ldx: usize,
    tokens: usize,
    rows: Range<usize>,
    out: *mut f32,
    ldo: usize,
    accumulate: bool,
    prepared: &Prepared,
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
    let job = Job::new(w, x, ldx, tokens, rows, out, ldo, accumulate, prepared);
    data_rows(level, &w.data, &job);
}

/// The kernels for `data`'s format over `job` (rows counted from `data`'s first).
///
/// # Safety
/// As [`dense_rows`].
unsafe fn data_rows(level: Level, data: &WeightData, job: &Job) {
    match data {
        WeightData::F32(v) => dense_rows(level, Dense::F32(v), job),
        WeightData::BF16(v) => dense_rows(level, Dense::BF16(v), job),
        WeightData::Quant { kind, blocks } => quant_rows(level, *kind, blocks, job),
        WeightData::Interleaved(m) => interleaved_rows(level, m, job),
        WeightData::Grouped(m) => grouped_rows(level, m, job),
        WeightData::Parts(parts) => {
            // Each part's share of the rows, with the output and bias views shifted to its
            // first row.
            let mut start = 0;
            for p in parts {
                let end = start + p.rows;
                let (lo, hi) = (job.rows.start.max(start), job.rows.end.min(end));
                if lo < hi {
                    let sub = Job {
                        bias: job.bias.map(|b| &b[start..]),
                        rows: lo - start..hi - start,
                        out: job.out.add(start),
                        ..*job
                    };
                    data_rows(level, &p.data, &sub);
                }
                start = end;
            }
        }
    }
}

/// The [`Numerics::Int8`] kernels: AVX512-VNNI where the CPU (and `level`) has it, else AVX2's
/// (`vpmaddubsw`, [`avx2_i8`]), else the scalar reference, all bit-identical.
///
/// # Safety
/// As [`dense_rows`].
unsafe fn interleaved_rows(level: Level, m: &Interleaved, job: &Job) {
    let owned: Vec<int8::XI8>;
    let x8 = match job.x8 {
        Some(x) if x.len() >= job.tokens => x,
        // Every entry point rounds them; a call that did not still computes.
        _ => {
            owned = (0..job.tokens)
                .map(|t| int8::quantize(job.xrow(t)))
                .collect();
            &owned
        }
    };
    #[cfg(target_arch = "x86_64")]
    if simd::clamp(level) >= Level::Avx512 && avx512_i8::available() {
        match job.x8t {
            // SAFETY: the call's activations are laid out for the tiles only where they run
            // (`amx_i8::takes`).
            Some(tiles) if m.cols > 0 => amx_i8::rows(m, tiles, job),
            _ => avx512_i8::rows(m, x8, job),
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if simd::clamp(level) >= Level::Avx2 {
        // SAFETY: the clamped level says the CPU has AVX2, FMA and F16C.
        avx2_i8::rows(m, x8, job);
        return;
    }
    let _ = level;
    int8::rows_ref(m, x8, job)
}

/// [`grouped`]'s kernels: AVX-512 or AVX2 up to [`grouped::MAX_TOKENS`] tokens, dequantized
/// tiles otherwise (row by row at the scalar level, which engines never pair with grouped
/// weights but tests may).
///
/// # Safety
/// As [`dense_rows`].
unsafe fn grouped_rows(level: Level, m: &Grouped, job: &Job) {
    let level = simd::clamp(level);
    // Int16 products where the call rounded its activations for them: the AVX512-VNNI kernel,
    // or below its level the scalar chain it equals bit for bit.
    if let Some(x) = job.x16g.filter(|_| grouped_i16::takes(m)) {
        #[cfg(target_arch = "x86_64")]
        if level >= Level::Avx512 && avx512_grouped_i16::available() {
            avx512_grouped_i16::rows(m, x, job);
            return;
        }
        grouped_i16::rows_ref(m, x, job);
        return;
    }
    // The planes layout is for the integer kernels (above); other calls on it (prefill-sized
    // int24 calls) dequantize tiles at AVX-512, or below it row by row as below AVX2.
    let planes = m.layout == grouped::Layout::Planes;
    #[cfg(target_arch = "x86_64")]
    if level >= Level::Avx2 && (!planes || level >= Level::Avx512) {
        // Only the AVX2 kernels read the halves layout (which an AVX-512 CPU runs too, where
        // a test or `KILN_SIMD` built the weights for a lower level than it runs).
        let avx512 = level >= Level::Avx512 && m.layout != grouped::Layout::Halves;
        if job.tokens <= grouped::MAX_TOKENS && !planes {
            if avx512 {
                avx512_grouped::rows(m, job);
            } else {
                avx2_grouped::rows(m, job);
            }
        } else {
            let group_bytes = m.group_bytes();
            tiled_rows(
                level,
                job,
                // SAFETY: the level includes AVX-512 F/BW/VL and F16C, or AVX2, FMA and F16C;
                // the rows lie in `m` (the job's rows are checked against the matrix).
                |rows, tile| unsafe {
                    if avx512 {
                        avx512_grouped::dequantize(m, rows, tile)
                    } else {
                        avx2_grouped::dequantize(m, rows, tile)
                    }
                },
                |rows| {
                    let g = rows.start / grouped::GROUP..rows.end.div_ceil(grouped::GROUP);
                    &m.bytes[g.start * group_bytes..g.end * group_bytes]
                },
            );
        }
        return;
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = planes;
    tiled_rows(
        level,
        job,
        |rows, tile| {
            for (i, n) in rows.enumerate() {
                m.row_f32(n, &mut tile[i * m.cols..(i + 1) * m.cols]);
            }
        },
        |_| &[],
    );
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
        (Level::Avx512 | Level::Avx512Bf16, Dense::F32(v)) => {
            avx512::streamed_rows(v.as_ptr(), job)
        }
        #[cfg(target_arch = "x86_64")]
        (Level::Avx512Bf16, Dense::BF16(v)) if job.xb.is_some() => {
            avx512_bf16_panel::panel_rows(v.as_ptr(), job)
        }
        #[cfg(target_arch = "x86_64")]
        (Level::Avx512Bf16, Dense::BF16(v)) if job.xs.is_some() => {
            avx512_bf16_panel::exact_panel_rows(v.as_ptr(), job)
        }
        #[cfg(target_arch = "x86_64")]
        (Level::Avx512 | Level::Avx512Bf16, Dense::BF16(v)) => {
            avx512::streamed_rows(v.as_ptr(), job)
        }
        #[cfg(target_arch = "x86_64")]
        (Level::Avx2, Dense::F32(v)) => avx2::dense_rows(v.as_ptr(), job),
        #[cfg(target_arch = "x86_64")]
        (Level::Avx2, Dense::BF16(v)) => avx2::dense_rows(v.as_ptr(), job),
        (_, Dense::F32(v)) => scalar::rows_f32(v, job),
        (_, Dense::BF16(v)) => scalar::rows_bf16(v, job),
    }
}

/// How the CPU backend multiplies by one block format (after mistral.rs' `QuantMethod`): the
/// format's geometry and exact decoding come from [`BlockFormat`], its kernels per ISA from
/// here. The defaults give every format vector kernels (the generic block GEMV of [`x86`], and
/// the scalar decoding compiled for AVX2 for prefill tiles); formats with hand-written kernels
/// override them. [`gemv_at`] and [`dequantize_at`] pick the ISA at run time; the scalar level
/// runs dequantized tiles through the scalar f32 kernels.
trait QuantMethod: BlockFormat + Sized {
    /// Whether [`QuantMethod::gemv_i16_avx2`] has a kernel (so the activations are worth
    /// rounding for [`Numerics::Int16`]).
    const INT16: bool = false;

    /// One-token GEMV against activations rounded to 16-bit integers, AVX2 (run by AVX-512 CPUs
    /// too); `false` (nothing done) where the format has no such kernel. Safety as
    /// [`QuantMethod::gemv_avx2`], with `x` the rounded row.
    #[cfg(target_arch = "x86_64")]
    unsafe fn gemv_i16_avx2(_w: *const u8, _job: &Job, _x: &[int16::XI16]) -> bool {
        false
    }

    /// As [`QuantMethod::gemv_i16_avx2`], for AVX-512 CPUs (safety as
    /// [`QuantMethod::gemv_avx512`]): the AVX2 kernel where the format has no 32-lane one.
    #[cfg(target_arch = "x86_64")]
    unsafe fn gemv_i16_avx512(w: *const u8, job: &Job, x: &[int16::XI16]) -> bool {
        Self::gemv_i16_avx2(w, job, x)
    }

    /// One-token GEMV over `job.rows` on the blocks at `w`, AVX-512.
    ///
    /// # Safety
    /// The CPU supports AVX-512 F/BW/VL; otherwise as [`matmul_rows_at`], with `w` holding
    /// `job.rows.end` rows of `job.k / ELEMS` blocks.
    #[cfg(target_arch = "x86_64")]
    unsafe fn gemv_avx512(w: *const u8, job: &Job) {
        avx512::block_rows::<Self>(w, job)
    }

    /// As [`QuantMethod::gemv_avx512`], AVX2 (safety: the CPU supports AVX2, FMA and F16C).
    #[cfg(target_arch = "x86_64")]
    unsafe fn gemv_avx2(w: *const u8, job: &Job) {
        avx2::block_rows::<Self>(w, job)
    }

    /// A few tokens at once on the blocks, AVX2, each token rounded as its one-token GEMV;
    /// `false` (nothing done) where the format or token count has no such kernel, and the
    /// dequantized tiles are used. Safety as [`QuantMethod::gemv_avx2`].
    #[cfg(target_arch = "x86_64")]
    unsafe fn gemv_tokens_avx2(_w: *const u8, _job: &Job) -> bool {
        false
    }

    /// As [`QuantMethod::gemv_tokens_avx2`], for AVX-512 CPUs: each token rounded as this
    /// format's AVX-512 GEMV (which is the AVX2 one where the format has no 16-lane kernel).
    /// Safety as [`QuantMethod::gemv_avx512`].
    #[cfg(target_arch = "x86_64")]
    unsafe fn gemv_tokens_avx512(_w: *const u8, _job: &Job) -> bool {
        false
    }

    /// Whole blocks to f32 (`out.len() / ELEMS` of them), bit-identical to
    /// [`quant::dequantize_row`], AVX2 (safety: the CPU supports AVX2, FMA and F16C).
    #[cfg(target_arch = "x86_64")]
    unsafe fn dequantize_avx2(blocks: &[u8], out: &mut [f32]) {
        avx2::dequantize_blocks::<Self>(blocks, out)
    }

    /// As [`QuantMethod::dequantize_avx2`], AVX-512 (safety: the CPU supports AVX-512 F/BW/VL,
    /// AVX2, FMA and F16C). Only formats with hand-written 16-lane decoding differ.
    #[cfg(target_arch = "x86_64")]
    unsafe fn dequantize_avx512(blocks: &[u8], out: &mut [f32]) {
        Self::dequantize_avx2(blocks, out)
    }
}

/// The legacy formats' AVX2 kernels (see the module documentation): the GEMV that folds each
/// block's scale into its partial sum, and bit-exact tile dequantization. Items of a
/// [`QuantMethod`] impl.
macro_rules! avx2_legacy_kernels {
    () => {
        const INT16: bool = true;
        #[cfg(target_arch = "x86_64")]
        unsafe fn gemv_i16_avx2(w: *const u8, job: &Job, x: &[int16::XI16]) -> bool {
            avx2_i16::legacy_rows::<Self>(w, job, x);
            true
        }
        #[cfg(target_arch = "x86_64")]
        unsafe fn gemv_avx2(w: *const u8, job: &Job) {
            avx2::legacy_rows::<Self>(w, job)
        }
        #[cfg(target_arch = "x86_64")]
        unsafe fn gemv_tokens_avx2(w: *const u8, job: &Job) -> bool {
            avx2::legacy_tokens_rows::<Self>(w, job)
        }
        #[cfg(target_arch = "x86_64")]
        unsafe fn dequantize_avx2(blocks: &[u8], out: &mut [f32]) {
            let nb = out.len() / Self::ELEMS;
            assert!(blocks.len() >= nb * Self::BYTES);
            avx2::dequantize_legacy::<Self>(blocks.as_ptr(), nb, out.as_mut_ptr())
        }
    };
}

/// The legacy formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) have their kernels on both ISAs.
/// `$extra` holds further items of each impl in braces.
macro_rules! legacy_quant_method {
    ($($t:ident),*; $extra:tt) => {$(
        impl QuantMethod for quant::$t {
            avx2_legacy_kernels!();
            impl_items!($extra);
            #[cfg(target_arch = "x86_64")]
            unsafe fn gemv_avx512(w: *const u8, job: &Job) {
                avx512::legacy_rows::<Self>(w, job)
            }
            #[cfg(target_arch = "x86_64")]
            unsafe fn gemv_tokens_avx512(w: *const u8, job: &Job) -> bool {
                avx512::legacy_tokens_rows::<Self>(w, job)
            }
            #[cfg(target_arch = "x86_64")]
            unsafe fn dequantize_avx512(blocks: &[u8], out: &mut [f32]) {
                let nb = out.len() / Self::ELEMS;
                assert!(blocks.len() >= nb * Self::BYTES);
                avx512::dequantize_legacy::<Self>(blocks.as_ptr(), nb, out.as_mut_ptr())
            }
        }
    )*};
}
/// The items inside the braces.
macro_rules! impl_items {
    ({ $($i:item)* }) => { $($i)* };
}

// On AVX-512 CPUs Q8_0 keeps the AVX2 integer GEMV: on Qwen2.5-Coder's Q8_0 lm_head (one
// thread, `kiln-bench -t 1 --numerics int16`, three alternations) a 32-lane Q8_0 kernel lost,
// 62.5/64.5/67.2 against 66.8/66.4/70.4 tok/s, and SmolLM2 Q8_0 did not gain (180–192 against
// 191–195). The nibble and five-bit formats run `avx512_i16`: Q5_0 4864 × 896 took 114 µs
// against the AVX2 kernel's 207 (one core, `cargo bench --bench kernels -- gemv/Q`); Q4_1's
// one-token GEMV is as fast either way (SmolLM2 int16 decode on one thread 221–225 tok/s both),
// and its 2- to 16-token calls gain (`kiln-bench --concurrency 1,4,16 -p 16 -n 64 -t 2
// --numerics int16`, two alternations: 4 sequences 437/493 → 534/524 tok/s, 16 sequences
// 486/566 → 587/575).
legacy_quant_method!(Q8_0; {});
legacy_quant_method!(Q4_0, Q4_1, Q5_0, Q5_1; {
    #[cfg(target_arch = "x86_64")]
    unsafe fn gemv_i16_avx512(w: *const u8, job: &Job, x: &[int16::XI16]) -> bool {
        avx512_i16::legacy_rows::<Self>(w, job, x);
        true
    }
});

impl QuantMethod for quant::Q2_K {}
impl QuantMethod for quant::Q3_K {}
/// Q4_K and Q6_K have hand-written AVX2 GEMVs (`avx2::k4_rows`, `avx2::k6_rows`) that apply the
/// sub-block scales to partial sums, and 16-lane AVX-512 ones (`avx512::k4_rows`,
/// `avx512::k6_rows`). Prefill tiles use the generic exact decoding.
impl QuantMethod for quant::Q4_K {
    const INT16: bool = true;
    #[cfg(target_arch = "x86_64")]
    unsafe fn gemv_i16_avx2(w: *const u8, job: &Job, x: &[int16::XI16]) -> bool {
        avx2_i16::k4_rows(w, job, x);
        true
    }
    #[cfg(target_arch = "x86_64")]
    unsafe fn gemv_i16_avx512(w: *const u8, job: &Job, x: &[int16::XI16]) -> bool {
        avx512_i16::k4_rows(w, job, x);
        true
    }
    #[cfg(target_arch = "x86_64")]
    unsafe fn gemv_avx512(w: *const u8, job: &Job) {
        avx512::k4_rows(w, job)
    }
    #[cfg(target_arch = "x86_64")]
    unsafe fn gemv_avx2(w: *const u8, job: &Job) {
        avx2::k4_rows(w, job)
    }
    #[cfg(target_arch = "x86_64")]
    unsafe fn gemv_tokens_avx2(w: *const u8, job: &Job) -> bool {
        avx2::k4_tokens_rows(w, job)
    }
    #[cfg(target_arch = "x86_64")]
    unsafe fn gemv_tokens_avx512(w: *const u8, job: &Job) -> bool {
        avx512::k4_tokens_rows(w, job)
    }
}
impl QuantMethod for quant::Q5_K {}
impl QuantMethod for quant::Q6_K {
    const INT16: bool = true;
    #[cfg(target_arch = "x86_64")]
    unsafe fn gemv_i16_avx2(w: *const u8, job: &Job, x: &[int16::XI16]) -> bool {
        avx2_i16::k6_rows(w, job, x);
        true
    }
    #[cfg(target_arch = "x86_64")]
    unsafe fn gemv_i16_avx512(w: *const u8, job: &Job, x: &[int16::XI16]) -> bool {
        avx512_i16::k6_rows(w, job, x);
        true
    }
    #[cfg(target_arch = "x86_64")]
    unsafe fn gemv_avx512(w: *const u8, job: &Job) {
        avx512::k6_rows(w, job)
    }
    #[cfg(target_arch = "x86_64")]
    unsafe fn gemv_avx2(w: *const u8, job: &Job) {
        avx2::k6_rows(w, job)
    }
    #[cfg(target_arch = "x86_64")]
    unsafe fn gemv_tokens_avx2(w: *const u8, job: &Job) -> bool {
        avx2::k6_tokens_rows(w, job)
    }
    #[cfg(target_arch = "x86_64")]
    unsafe fn gemv_tokens_avx512(w: *const u8, job: &Job) -> bool {
        avx512::k6_tokens_rows(w, job)
    }
}
impl QuantMethod for quant::Q8_K {}

/// [`QuantMethod`]'s GEMV at `level` (clamped); `false` when the level has none (scalar).
///
/// # Safety
/// As [`QuantMethod::gemv_avx512`], less the CPU requirement.
unsafe fn gemv_at<F: QuantMethod>(level: Level, w: *const u8, job: &Job) -> bool {
    match level {
        #[cfg(target_arch = "x86_64")]
        Level::Avx512 | Level::Avx512Bf16 => F::gemv_avx512(w, job),
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 => F::gemv_avx2(w, job),
        _ => return false,
    }
    true
}

/// Whole blocks of `F` to f32 at `level` (clamped), bit-identical to [`quant::dequantize_row`].
fn dequantize_at<F: QuantMethod>(level: Level, blocks: &[u8], out: &mut [f32]) {
    match level {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the level, clamped to the CPU's, includes AVX-512 F/BW/VL, AVX2, FMA and F16C.
        Level::Avx512 | Level::Avx512Bf16 => unsafe { F::dequantize_avx512(blocks, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the level, clamped to the CPU's, includes AVX2, FMA and F16C.
        Level::Avx2 => unsafe { F::dequantize_avx2(blocks, out) },
        _ => quant::dequantize_blocks::<F>(blocks, out),
    }
}

/// Asks for `bytes` to be brought into the cache (a hint; nothing on other architectures).
#[inline]
fn prefetch(bytes: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    for line in bytes.chunks(64) {
        // SAFETY: SSE is part of x86-64; a prefetch never faults, and the address is in `bytes`.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                line.as_ptr() as *const i8
            )
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = bytes;
}

/// The multi-token kernels' unit of outputs for `tokens` at `level`, on which tasks split: one
/// packed panel's outputs (32 on AVX-512 above 16 tokens, 16 on AVX2), 16 for AVX-512's
/// dot-product tiles and the scalar kernels.
fn tile_rows(level: Level, tokens: usize) -> usize {
    match level {
        #[cfg(target_arch = "x86_64")]
        Level::Avx512 | Level::Avx512Bf16 if tokens > avx512::TILE_TOKENS => avx512_panel::NR,
        _ => 16,
    }
}

/// Rows of quantized weights dequantized per prefill tile of `k` columns: on AVX2 the panels
/// that one pass over the tokens takes ([`avx2_panel::rows_per_pass`]), elsewhere one unit of
/// [`tile_rows`]; small enough (× k f32) to stay in L2 while every token passes over it.
fn dequantized_rows(level: Level, tokens: usize, k: usize) -> usize {
    match level {
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 => avx2_panel::rows_per_pass(k),
        _ => tile_rows(level, tokens),
    }
}

thread_local! {
    /// Per-thread f32 scratch for prefill tiles of quantized weights.
    static TILE: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// The same tile rounded to bf16 for [`Numerics::Bf16`].
    static TILE_BF16: RefCell<Vec<bf16>> = const { RefCell::new(Vec::new()) };
}

/// [`dense_rows`] for an f32 tile already in cache (dequantized weights): the AVX-512 kernels'
/// four-row tiles, which load each activation once per four rows, instead of the one stream
/// of [`avx512::streamed_rows`] that weights read from memory take (the same bits either way).
///
/// # Safety
/// As [`dense_rows`].
unsafe fn resident_rows(level: Level, tile: &[f32], job: &Job) {
    match simd::clamp(level) {
        #[cfg(target_arch = "x86_64")]
        Level::Avx512 | Level::Avx512Bf16 => avx512::dense_rows(tile.as_ptr(), job),
        _ => dense_rows(level, Dense::F32(tile), job),
    }
}

/// Quantized weights: GEMV on the blocks at decode, dequantized tiles + f32 kernels otherwise.
///
/// # Safety
/// As [`matmul_rows_at`]; `blocks` has been checked against the matrix shape.
unsafe fn quant_rows(level: Level, kind: QuantKind, blocks: &[u8], job: &Job) {
    with_format!(kind, F => quant_rows_of::<F>(simd::clamp(level), blocks, job))
}

unsafe fn quant_rows_of<F: QuantMethod>(level: Level, blocks: &[u8], job: &Job) {
    #[cfg(target_arch = "x86_64")]
    if let Some(x) = job.xq {
        let done = match level {
            _ if x.len() != job.tokens => false,
            Level::Avx512 | Level::Avx512Bf16 => F::gemv_i16_avx512(blocks.as_ptr(), job, x),
            Level::Avx2 => F::gemv_i16_avx2(blocks.as_ptr(), job, x),
            _ => false,
        };
        if done {
            return;
        }
    }
    if job.tokens == 1 && gemv_at::<F>(level, blocks.as_ptr(), job) {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    match level {
        Level::Avx2 if F::gemv_tokens_avx2(blocks.as_ptr(), job) => return,
        Level::Avx512 | Level::Avx512Bf16 if F::gemv_tokens_avx512(blocks.as_ptr(), job) => return,
        _ => {}
    }
    let rb = job.k / F::ELEMS * F::BYTES;
    tiled_rows(
        level,
        job,
        |rows, tile| dequantize_at::<F>(level, &blocks[rows.start * rb..rows.end * rb], tile),
        |rows| &blocks[rows.start * rb..rows.end * rb],
    );
}

/// Quantized weights through the dense kernels: tiles of rows dequantized to f32 (by
/// `dequantize(rows, tile)`, `tile` holding `rows.len() × job.k` values) into thread-local
/// scratch, each passed over by every token, the next tile's bytes (`bytes_of(rows)`) fetched
/// meanwhile.
///
/// # Safety
/// As [`dense_rows`].
unsafe fn tiled_rows<'w>(
    level: Level,
    job: &Job,
    dequantize: impl Fn(Range<usize>, &mut [f32]),
    bytes_of: impl Fn(Range<usize>) -> &'w [u8],
) {
    #[cfg(target_arch = "x86_64")]
    let bf16_panels = job.xb.is_some() && level == Level::Avx512Bf16;
    #[cfg(not(target_arch = "x86_64"))]
    let bf16_panels = false;
    TILE.with_borrow_mut(|tile| {
        let step = dequantized_rows(level, job.tokens, job.k);
        let mut n0 = job.rows.start;
        while n0 < job.rows.end {
            let n1 = (n0 + step).min(job.rows.end);
            tile.resize((n1 - n0) * job.k, 0.0);
            dequantize(n0..n1, tile);
            // The next tile's blocks are fetched while the tokens pass over this one: a tile
            // is a few KiB read once, too short for the hardware prefetcher, and without this
            // the dequantization waited on DRAM (a Zen 5 spent a quarter of a 16-sequence
            // SmolLM2 Q4_1 decode step in it, mostly on its loads).
            prefetch(bytes_of(n1..(n1 + step).min(job.rows.end)));
            // The tile's row r is output n0 + r: shift the output and bias views to match.
            let sub = Job {
                bias: job.bias.map(|b| &b[n0..]),
                rows: 0..n1 - n0,
                out: job.out.add(n0),
                ..*job
            };
            if bf16_panels {
                // Numerics::Bf16: the dequantized tile rounded to bf16, through the bf16 panels.
                #[cfg(target_arch = "x86_64")]
                TILE_BF16.with_borrow_mut(|tb| {
                    tb.resize(tile.len(), bf16::ZERO);
                    avx512_bf16_panel::round_weights(tile, tb);
                    avx512_bf16_panel::panel_rows(tb.as_ptr(), &sub);
                });
            } else {
                resident_rows(level, tile, &sub);
            }
            n0 = n1;
        }
    });
}

/// Dequantizes whole rows of blocks into `out` (bit-identical to [`quant::dequantize_row`]).
#[cfg(test)]
fn dequantize_rows(level: Level, kind: QuantKind, blocks: &[u8], out: &mut [f32]) {
    assert!(blocks.len() >= out.len() / kind.block_elems() * kind.block_bytes());
    with_format!(kind, F => dequantize_at::<F>(simd::clamp(level), blocks, out))
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
    /// The token rows rounded for [`Numerics::Int16`] (one to sixteen tokens), if rounded.
    xq: Option<&'a [int16::XI16]>,
    /// The token rows cut into bytes for grouped weights' 16- or 24-bit integer products, if
    /// cut.
    x16g: Option<&'a [grouped_i16::Split]>,
    /// The token rows rounded to bf16 pairs for [`Numerics::Bf16`], if rounded.
    xb: Option<&'a [u32]>,
    /// The token rows cut into three bf16 parts for exact AMX products, if cut.
    xs: Option<&'a [u32]>,
    /// The token rows rounded to 8 bits for interleaved weights ([`Numerics::Int8`]).
    x8: Option<&'a [int8::XI8]>,
    /// The same, laid out for the AMX-INT8 tiles, where the call takes them.
    #[cfg(target_arch = "x86_64")]
    x8t: Option<&'a amx_i8::Tokens>,
    /// Every token's 32-element block sums, token `t`'s at `t·k/32` ([`grouped_block_sums`]),
    /// where the call computed them; kernels that need them compute their own otherwise.
    sums: Option<&'a [f32]>,
    /// The activations as the AVX2 grouped kernels read them, where the call made them; those
    /// kernels make their own otherwise.
    #[cfg(target_arch = "x86_64")]
    xg: Option<&'a avx2_grouped::Activations>,
    /// The activations' full tiles as the AVX2 panels read them, where the call packed them;
    /// the panels read the rows otherwise.
    #[cfg(target_arch = "x86_64")]
    xp: Option<&'a avx2_panel::PackedTokens>,
}

impl<'a> Job<'a> {
    /// A call's job over `rows` of `w` for `tokens` rows of `x` (`ldx` apart) into `out` (`ldo`
    /// apart), reading what the call `prepared` from its activations.
    #[allow(clippy::too_many_arguments)]
    fn new(
        w: &'a PackedMatrix,
        x: &[f32],
        ldx: usize,
        tokens: usize,
        rows: Range<usize>,
        out: *mut f32,
        ldo: usize,
        accumulate: bool,
        prepared: &'a Prepared,
    ) -> Job<'a> {
        Job {
            k: w.cols,
            bias: w.bias.as_deref(),
            x: x.as_ptr(),
            ldx,
            tokens,
            rows,
            out,
            ldo,
            accumulate,
            xq: prepared.xq.as_deref(),
            x16g: prepared.x16g.as_deref(),
            xb: prepared.xb.as_deref(),
            xs: prepared.xs.as_deref(),
            x8: prepared.x8.as_deref(),
            #[cfg(target_arch = "x86_64")]
            x8t: prepared.x8t.as_ref(),
            sums: prepared.sums.as_deref(),
            #[cfg(target_arch = "x86_64")]
            xg: prepared.xg.as_ref(),
            #[cfg(target_arch = "x86_64")]
            xp: prepared.xp.as_ref(),
        }
    }
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

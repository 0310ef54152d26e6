//! ggml's quantized block formats: their layouts, and dequantization to f32 bit-for-bit as
//! ggml's `dequantize_row_*` reference code computes it (f16 scales widened to f32, then each
//! product and offset as a separate f32 operation, in ggml's order), so kiln's f32 view of a
//! weight equals what llama.cpp and transformers see when they dequantize the same file.
//!
//! Each format is one [`BlockFormat`] implementation (elements and bytes per block, the decoding
//! of one block); [`QuantKind`] names the format at run time and [`with_format!`] turns a
//! `QuantKind` back into its type, so generic code (the CPU kernels) is written once for all
//! formats. Legacy 32-element formats live in [`legacy`], the 256-element K-quants in [`kquants`].
//!
//! Quantized tensors stay in these blocks in memory ([`super::DType::Q8_0`] etc.); the CPU
//! backend computes on them directly and uses [`dequantize_row`] where it needs f32 rows.

mod kquants;
mod legacy;
#[cfg(test)]
mod tests;

use half::f16;
use rayon::prelude::*;

pub(crate) use kquants::scales_mins_k4;
pub use kquants::{Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K};
pub use legacy::{Q4_0, Q4_1, Q5_0, Q5_1, Q8_0};

/// Elements a task of [`dequantize`] handles; large enough that scheduling costs nothing next
/// to the work.
const ELEMS_PER_TASK: usize = 1 << 17;

/// One ggml block format: its geometry and the exact decoding of one block.
pub trait BlockFormat {
    /// The run-time name of this format.
    const KIND: QuantKind;
    /// Elements per block (32 for the legacy formats, 256 for the K-quants).
    const ELEMS: usize;
    /// Bytes per block.
    const BYTES: usize;
    /// Decodes one block (the first [`Self::BYTES`] bytes of `b`) into the first
    /// [`Self::ELEMS`] elements of `out`, exactly as ggml's reference does.
    fn dequantize_block(b: &[u8], out: &mut [f32]);
}

/// One of the block formats, by name (ggml's names, hence `Q4_K` rather than `Q4K`).
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum QuantKind {
    /// `{ f16 d; i8 qs[32] }`, `x[j] = d * qs[j]`.
    Q8_0,
    /// `{ f16 d; u8 qs[16] }`; low nibbles are elements 0..16, high nibbles 16..32;
    /// `x = d * (q - 8)`.
    Q4_0,
    /// `{ f16 d; f16 m; u8 qs[16] }`, nibbles as in Q4_0, `x = d * q + m`.
    Q4_1,
    /// `{ f16 d; u32 qh; u8 qs[16] }`: Q4_0's nibbles plus a fifth bit per element from `qh`,
    /// `x = d * (q - 16)`.
    Q5_0,
    /// `{ f16 d; f16 m; u32 qh; u8 qs[16] }`, bits as in Q5_0, `x = d * q + m`.
    Q5_1,
    /// 256-element super-blocks of 16 × 16 with 2-bit quants and 4-bit scales and mins.
    Q2_K,
    /// 256-element super-blocks of 16 × 16 with 3-bit quants and signed 6-bit scales.
    Q3_K,
    /// 256-element super-blocks of 8 × 32 with 4-bit quants and 6-bit scales and mins.
    Q4_K,
    /// As Q4_K with a fifth quant bit.
    Q5_K,
    /// 256-element super-blocks of 16 × 16 with 6-bit quants and 8-bit scales.
    Q6_K,
    /// `{ f32 d; i8 qs[256]; i16 bsums[16] }`, `x = d * q` (ggml's activation format).
    Q8_K,
}

/// Evaluates `$body` with `$F` bound to the [`BlockFormat`] type of `$kind` (a [`QuantKind`]).
#[macro_export]
macro_rules! with_format {
    ($kind:expr, $F:ident => $body:expr) => {{
        use $crate::model::quant as q;
        match $kind {
            q::QuantKind::Q8_0 => {
                type $F = q::Q8_0;
                $body
            }
            q::QuantKind::Q4_0 => {
                type $F = q::Q4_0;
                $body
            }
            q::QuantKind::Q4_1 => {
                type $F = q::Q4_1;
                $body
            }
            q::QuantKind::Q5_0 => {
                type $F = q::Q5_0;
                $body
            }
            q::QuantKind::Q5_1 => {
                type $F = q::Q5_1;
                $body
            }
            q::QuantKind::Q2_K => {
                type $F = q::Q2_K;
                $body
            }
            q::QuantKind::Q3_K => {
                type $F = q::Q3_K;
                $body
            }
            q::QuantKind::Q4_K => {
                type $F = q::Q4_K;
                $body
            }
            q::QuantKind::Q5_K => {
                type $F = q::Q5_K;
                $body
            }
            q::QuantKind::Q6_K => {
                type $F = q::Q6_K;
                $body
            }
            q::QuantKind::Q8_K => {
                type $F = q::Q8_K;
                $body
            }
        }
    }};
}
pub use with_format;

impl QuantKind {
    /// Every format, in ggml's type-id order.
    pub const ALL: [QuantKind; 11] = [
        QuantKind::Q4_0,
        QuantKind::Q4_1,
        QuantKind::Q5_0,
        QuantKind::Q5_1,
        QuantKind::Q8_0,
        QuantKind::Q2_K,
        QuantKind::Q3_K,
        QuantKind::Q4_K,
        QuantKind::Q5_K,
        QuantKind::Q6_K,
        QuantKind::Q8_K,
    ];

    /// Elements per block.
    pub const fn block_elems(self) -> usize {
        match self {
            QuantKind::Q8_0
            | QuantKind::Q4_0
            | QuantKind::Q4_1
            | QuantKind::Q5_0
            | QuantKind::Q5_1 => 32,
            QuantKind::Q2_K
            | QuantKind::Q3_K
            | QuantKind::Q4_K
            | QuantKind::Q5_K
            | QuantKind::Q6_K
            | QuantKind::Q8_K => 256,
        }
    }

    /// Bytes per block.
    pub const fn block_bytes(self) -> usize {
        match self {
            QuantKind::Q8_0 => Q8_0::BYTES,
            QuantKind::Q4_0 => Q4_0::BYTES,
            QuantKind::Q4_1 => Q4_1::BYTES,
            QuantKind::Q5_0 => Q5_0::BYTES,
            QuantKind::Q5_1 => Q5_1::BYTES,
            QuantKind::Q2_K => Q2_K::BYTES,
            QuantKind::Q3_K => Q3_K::BYTES,
            QuantKind::Q4_K => Q4_K::BYTES,
            QuantKind::Q5_K => Q5_K::BYTES,
            QuantKind::Q6_K => Q6_K::BYTES,
            QuantKind::Q8_K => Q8_K::BYTES,
        }
    }

    /// Bytes of `numel` elements, or `None` when `numel` is not a whole number of blocks.
    pub fn bytes_for(self, numel: usize) -> Option<usize> {
        let n = self.block_elems();
        numel
            .is_multiple_of(n)
            .then(|| (numel / n).checked_mul(self.block_bytes()))
            .flatten()
    }

    /// ggml's name of the format (`"Q4_K"`).
    pub fn name(self) -> &'static str {
        match self {
            QuantKind::Q8_0 => "Q8_0",
            QuantKind::Q4_0 => "Q4_0",
            QuantKind::Q4_1 => "Q4_1",
            QuantKind::Q5_0 => "Q5_0",
            QuantKind::Q5_1 => "Q5_1",
            QuantKind::Q2_K => "Q2_K",
            QuantKind::Q3_K => "Q3_K",
            QuantKind::Q4_K => "Q4_K",
            QuantKind::Q5_K => "Q5_K",
            QuantKind::Q6_K => "Q6_K",
            QuantKind::Q8_K => "Q8_K",
        }
    }

    /// Decodes one block (`block_bytes()` bytes) into its `block_elems()` outputs.
    #[inline]
    pub fn dequantize_block(self, b: &[u8], out: &mut [f32]) {
        with_format!(self, F => F::dequantize_block(b, out))
    }
}

/// An f16 stored little-endian at `b[0..2]`, widened to f32 (exact).
#[inline(always)]
pub(crate) fn f16_at(b: &[u8]) -> f32 {
    f16::from_le_bytes([b[0], b[1]]).to_f32()
}

/// Dequantizes whole blocks of format `F` from `data` into `out`, serially; `out.len()` is a
/// multiple of `F::ELEMS` and `data` holds at least that many blocks.
#[inline(always)]
pub fn dequantize_blocks<F: BlockFormat>(data: &[u8], out: &mut [f32]) {
    for (o, b) in out
        .chunks_exact_mut(F::ELEMS)
        .zip(data.chunks_exact(F::BYTES))
    {
        F::dequantize_block(b, o);
    }
}

/// Dequantizes whole blocks `data` into `out` (`out.len()` elements, a multiple of the block
/// size), serially.
pub fn dequantize_row(kind: QuantKind, data: &[u8], out: &mut [f32]) {
    let n = kind.block_elems();
    assert!(
        out.len().is_multiple_of(n) && data.len() >= out.len() / n * kind.block_bytes(),
        "dequantize_row: {} bytes do not hold {} {} elements",
        data.len(),
        out.len(),
        kind.name()
    );
    with_format!(kind, F => dequantize_blocks::<F>(data, out))
}

/// Dequantizes `data` (exactly `numel` elements of `kind`) to f32, in parallel; `None` when the
/// sizes do not match.
pub fn dequantize(kind: QuantKind, data: &[u8], numel: usize) -> Option<Vec<f32>> {
    if kind.bytes_for(numel) != Some(data.len()) {
        return None;
    }
    let mut out = vec![0f32; numel];
    let blocks_per_task = ELEMS_PER_TASK / kind.block_elems();
    // `chunks_exact` yields only whole blocks, and the length check above pairs them one-to-one
    // with the output chunks, so the fixed indices inside the block functions are in range.
    out.par_chunks_mut(kind.block_elems() * blocks_per_task)
        .zip(data.par_chunks(kind.block_bytes() * blocks_per_task))
        .for_each(|(o, d)| dequantize_row(kind, d, o));
    Some(out)
}

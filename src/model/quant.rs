//! ggml's legacy 32-element block formats (Q8_0, Q4_0, Q4_1): their layouts, and dequantization
//! to f32 bit-for-bit as ggml's `dequantize_row_*` reference code computes it (f16 scale widened
//! to f32, then `d * q` and, for Q4_1, `+ m` as separate f32 operations), so kiln's f32 view of a
//! weight equals what llama.cpp and transformers see when they dequantize the same file.
//!
//! Quantized tensors stay in these blocks in memory ([`super::DType::Q8_0`] etc.); the CPU
//! backend computes on them directly and uses [`dequantize_row`] where it needs f32 rows.

use half::f16;
use rayon::prelude::*;

/// Elements per block in every format here.
pub const QK: usize = 32;

/// Blocks handed to one rayon task; large enough that scheduling costs nothing next to the work.
const BLOCKS_PER_TASK: usize = 4096;

/// One of the block formats.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum QuantKind {
    /// `{ f16 d; i8 qs[32] }`, `x[j] = d * qs[j]`.
    Q8_0,
    /// `{ f16 d; u8 qs[16] }`; low nibbles are elements 0..16, high nibbles 16..32;
    /// `x = d * (q - 8)`.
    Q4_0,
    /// `{ f16 d; f16 m; u8 qs[16] }`, nibbles as in Q4_0, `x = d * q + m`.
    Q4_1,
}

impl QuantKind {
    /// Bytes per 32-element block.
    pub const fn block_bytes(self) -> usize {
        match self {
            QuantKind::Q8_0 => 2 + QK,
            QuantKind::Q4_0 => 2 + QK / 2,
            QuantKind::Q4_1 => 4 + QK / 2,
        }
    }

    /// Bytes of `numel` elements, or `None` when `numel` is not a whole number of blocks.
    pub fn bytes_for(self, numel: usize) -> Option<usize> {
        numel
            .is_multiple_of(QK)
            .then(|| numel / QK * self.block_bytes())
    }

    pub fn name(self) -> &'static str {
        match self {
            QuantKind::Q8_0 => "Q8_0",
            QuantKind::Q4_0 => "Q4_0",
            QuantKind::Q4_1 => "Q4_1",
        }
    }

    /// Decodes one block (`block_bytes()` bytes) into its 32 outputs.
    #[inline]
    pub fn dequantize_block(self, b: &[u8], out: &mut [f32]) {
        match self {
            QuantKind::Q8_0 => block_q8_0(b, out),
            QuantKind::Q4_0 => block_q4_0(b, out),
            QuantKind::Q4_1 => block_q4_1(b, out),
        }
    }
}

#[inline]
fn f16_at(lo: u8, hi: u8) -> f32 {
    f16::from_le_bytes([lo, hi]).to_f32()
}

fn block_q8_0(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b[0], b[1]);
    for (o, &q) in out[..QK].iter_mut().zip(&b[2..2 + QK]) {
        *o = (q as i8) as f32 * d;
    }
}

fn block_q4_0(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b[0], b[1]);
    let (lo, hi) = out[..QK].split_at_mut(QK / 2);
    for ((l, h), &q) in lo.iter_mut().zip(hi.iter_mut()).zip(&b[2..2 + QK / 2]) {
        *l = ((q & 0x0f) as i32 - 8) as f32 * d;
        *h = ((q >> 4) as i32 - 8) as f32 * d;
    }
}

fn block_q4_1(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b[0], b[1]);
    let m = f16_at(b[2], b[3]);
    let (lo, hi) = out[..QK].split_at_mut(QK / 2);
    for ((l, h), &q) in lo.iter_mut().zip(hi.iter_mut()).zip(&b[4..4 + QK / 2]) {
        *l = (q & 0x0f) as f32 * d + m;
        *h = (q >> 4) as f32 * d + m;
    }
}

/// Dequantizes whole blocks `data` into `out` (`out.len()` elements, a multiple of 32), serially.
pub fn dequantize_row(kind: QuantKind, data: &[u8], out: &mut [f32]) {
    let bb = kind.block_bytes();
    assert!(
        out.len().is_multiple_of(QK) && data.len() >= out.len() / QK * bb,
        "dequantize_row: {} bytes do not hold {} {} elements",
        data.len(),
        out.len(),
        kind.name()
    );
    for (o, b) in out.chunks_exact_mut(QK).zip(data.chunks_exact(bb)) {
        kind.dequantize_block(b, o);
    }
}

/// Dequantizes `data` (exactly `numel / 32` blocks of `kind`) to f32, in parallel; `None` when
/// the sizes do not match.
pub fn dequantize(kind: QuantKind, data: &[u8], numel: usize) -> Option<Vec<f32>> {
    let block_bytes = kind.block_bytes();
    if kind.bytes_for(numel) != Some(data.len()) {
        return None;
    }
    let mut out = vec![0f32; numel];
    // `chunks_exact` yields only whole blocks, and the length check above pairs them one-to-one
    // with the 32-element output chunks, so the fixed indices inside the block functions are in range.
    out.par_chunks_mut(QK * BLOCKS_PER_TASK)
        .zip(data.par_chunks(block_bytes * BLOCKS_PER_TASK))
        .for_each(|(o, d)| {
            for (ob, db) in o.chunks_exact_mut(QK).zip(d.chunks_exact(block_bytes)) {
                kind.dequantize_block(db, ob);
            }
        });
    Some(out)
}

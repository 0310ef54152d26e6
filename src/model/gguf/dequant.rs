//! Dequantization of ggml's legacy 32-element block formats to f32, bit-for-bit as ggml's
//! `dequantize_row_*` reference code computes them (f16 scale widened to f32, then `d * q` and, for
//! Q4_1, `+ m` as separate f32 operations), so kiln's f32 weights equal what llama.cpp and
//! transformers see when they dequantize the same file.

use half::f16;
use rayon::prelude::*;

use super::reader::GgmlType;

/// Elements per block in every format here.
pub const QK: usize = 32;

/// Blocks handed to one rayon task; large enough that scheduling costs nothing next to the work.
const BLOCKS_PER_TASK: usize = 4096;

fn f16_at(lo: u8, hi: u8) -> f32 {
    f16::from_le_bytes([lo, hi]).to_f32()
}

/// Q8_0: `{ f16 d; i8 qs[32] }`, `x[j] = d * qs[j]`.
fn block_q8_0(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b[0], b[1]);
    for (o, &q) in out.iter_mut().zip(&b[2..2 + QK]) {
        *o = (q as i8) as f32 * d;
    }
}

/// Q4_0: `{ f16 d; u8 qs[16] }`; low nibbles are elements 0..16, high nibbles 16..32;
/// `x = d * (q - 8)`.
fn block_q4_0(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b[0], b[1]);
    let (lo, hi) = out.split_at_mut(QK / 2);
    for ((l, h), &q) in lo.iter_mut().zip(hi.iter_mut()).zip(&b[2..2 + QK / 2]) {
        *l = ((q & 0x0f) as i32 - 8) as f32 * d;
        *h = ((q >> 4) as i32 - 8) as f32 * d;
    }
}

/// Q4_1: `{ f16 d; f16 m; u8 qs[16] }`, nibbles as in Q4_0, `x = d * q + m`.
fn block_q4_1(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b[0], b[1]);
    let m = f16_at(b[2], b[3]);
    let (lo, hi) = out.split_at_mut(QK / 2);
    for ((l, h), &q) in lo.iter_mut().zip(hi.iter_mut()).zip(&b[4..4 + QK / 2]) {
        *l = (q & 0x0f) as f32 * d + m;
        *h = (q >> 4) as f32 * d + m;
    }
}

/// Decodes one block into its 32 outputs.
type BlockFn = fn(&[u8], &mut [f32]);

/// Dequantizes `data` (whole blocks of `ty`) to f32, or returns `None` when `ty` is not one of
/// the formats handled here. The caller has checked that `data` holds exactly `numel / 32` blocks.
pub fn dequantize(ty: GgmlType, data: &[u8], numel: usize) -> Option<Vec<f32>> {
    let (block_bytes, f): (usize, BlockFn) = match ty {
        GgmlType::Q8_0 => (2 + QK, block_q8_0),
        GgmlType::Q4_0 => (2 + QK / 2, block_q4_0),
        GgmlType::Q4_1 => (4 + QK / 2, block_q4_1),
        _ => return None,
    };
    if !numel.is_multiple_of(QK) || data.len() != numel / QK * block_bytes {
        return None;
    }
    let mut out = vec![0f32; numel];
    // `chunks_exact` yields only whole blocks, and the length check above pairs them one-to-one
    // with the 32-element output chunks, so the fixed indices inside the block functions are in range.
    out.par_chunks_mut(QK * BLOCKS_PER_TASK)
        .zip(data.par_chunks(block_bytes * BLOCKS_PER_TASK))
        .for_each(|(o, d)| {
            for (ob, db) in o.chunks_exact_mut(QK).zip(d.chunks_exact(block_bytes)) {
                f(db, ob);
            }
        });
    Some(out)
}

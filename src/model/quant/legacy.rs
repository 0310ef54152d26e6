//! ggml's legacy 32-element block formats: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 (`block_q*` in
//! `ggml-common.h`, decoded as `dequantize_row_q*` in `ggml-quants.c` does).

use super::{f16_at, BlockFormat, QuantKind};

/// Elements per legacy block.
const QK: usize = 32;

/// `{ f16 d; i8 qs[32] }`.
pub struct Q8_0;
/// `{ f16 d; u8 qs[16] }`.
pub struct Q4_0;
/// `{ f16 d; f16 m; u8 qs[16] }`.
pub struct Q4_1;
/// `{ f16 d; u8 qh[4]; u8 qs[16] }`.
pub struct Q5_0;
/// `{ f16 d; f16 m; u8 qh[4]; u8 qs[16] }`.
pub struct Q5_1;

impl BlockFormat for Q8_0 {
    const KIND: QuantKind = QuantKind::Q8_0;
    const ELEMS: usize = QK;
    const BYTES: usize = 2 + QK;
    #[inline(always)]
    fn dequantize_block(b: &[u8], out: &mut [f32]) {
        let d = f16_at(b);
        for (o, &q) in out[..QK].iter_mut().zip(&b[2..2 + QK]) {
            *o = (q as i8) as f32 * d;
        }
    }
}

impl BlockFormat for Q4_0 {
    const KIND: QuantKind = QuantKind::Q4_0;
    const ELEMS: usize = QK;
    const BYTES: usize = 2 + QK / 2;
    #[inline(always)]
    fn dequantize_block(b: &[u8], out: &mut [f32]) {
        let d = f16_at(b);
        let (lo, hi) = out[..QK].split_at_mut(QK / 2);
        for ((l, h), &q) in lo.iter_mut().zip(hi.iter_mut()).zip(&b[2..2 + QK / 2]) {
            *l = ((q & 0x0f) as i32 - 8) as f32 * d;
            *h = ((q >> 4) as i32 - 8) as f32 * d;
        }
    }
}

impl BlockFormat for Q4_1 {
    const KIND: QuantKind = QuantKind::Q4_1;
    const ELEMS: usize = QK;
    const BYTES: usize = 4 + QK / 2;
    #[inline(always)]
    fn dequantize_block(b: &[u8], out: &mut [f32]) {
        let d = f16_at(b);
        let m = f16_at(&b[2..]);
        let (lo, hi) = out[..QK].split_at_mut(QK / 2);
        for ((l, h), &q) in lo.iter_mut().zip(hi.iter_mut()).zip(&b[4..4 + QK / 2]) {
            *l = (q & 0x0f) as f32 * d + m;
            *h = (q >> 4) as f32 * d + m;
        }
    }
}

/// The 32 five-bit quants of a Q5 block: nibble `j` of `qs` (low nibbles are elements 0..16,
/// high nibbles 16..32) with bit `j` of the little-endian `qh` as its fifth bit.
#[inline(always)]
fn five_bit_quants(qh: &[u8], qs: &[u8]) -> [u8; QK] {
    let qh = u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]);
    let mut q = [0u8; QK];
    for (j, &byte) in qs[..QK / 2].iter().enumerate() {
        q[j] = (byte & 0x0f) | (((qh >> j) & 1) << 4) as u8;
        q[j + QK / 2] = (byte >> 4) | (((qh >> (j + QK / 2)) & 1) << 4) as u8;
    }
    q
}

impl BlockFormat for Q5_0 {
    const KIND: QuantKind = QuantKind::Q5_0;
    const ELEMS: usize = QK;
    const BYTES: usize = 2 + 4 + QK / 2;
    #[inline(always)]
    fn dequantize_block(b: &[u8], out: &mut [f32]) {
        let d = f16_at(b);
        let q = five_bit_quants(&b[2..6], &b[6..6 + QK / 2]);
        for (o, &q) in out[..QK].iter_mut().zip(&q) {
            *o = (q as i32 - 16) as f32 * d;
        }
    }
}

impl BlockFormat for Q5_1 {
    const KIND: QuantKind = QuantKind::Q5_1;
    const ELEMS: usize = QK;
    const BYTES: usize = 4 + 4 + QK / 2;
    #[inline(always)]
    fn dequantize_block(b: &[u8], out: &mut [f32]) {
        let d = f16_at(b);
        let m = f16_at(&b[2..]);
        let q = five_bit_quants(&b[4..8], &b[8..8 + QK / 2]);
        for (o, &q) in out[..QK].iter_mut().zip(&q) {
            *o = q as f32 * d + m;
        }
    }
}

//! ggml's K-quants: 256-element super-blocks split into sub-blocks of 16 or 32 elements, each
//! with its own small integer scale (and min) relative to the super-block's f16 `d` (and
//! `dmin`). Layouts are `block_q*_K` in `ggml-common.h`; decoding follows `dequantize_row_q*_K`
//! in `ggml-quants.c`: the sub-block's f32 scale `d · sc` (and min `dmin · m`) is formed first,
//! then each element is `scale · q` (minus the min) as separate f32 operations.

// The types carry ggml's names (`Q4_K`), the ones users see in file listings and llama.cpp.
#![allow(non_camel_case_types)]

use super::{f16_at, BlockFormat, QuantKind};

/// Elements per super-block.
const QK_K: usize = 256;

/// `{ u8 scales[16]; u8 qs[64]; f16 d; f16 dmin }`: 2-bit quants, per 16 elements a 4-bit scale
/// (low nibble) and 4-bit min (high nibble).
pub struct Q2_K;
/// `{ u8 hmask[32]; u8 qs[64]; u8 scales[12]; f16 d }`: 2 low quant bits in `qs`, a third in
/// `hmask` (a clear bit subtracts 4), per 16 elements a 6-bit scale stored minus 32.
pub struct Q3_K;
/// `{ f16 d; f16 dmin; u8 scales[12]; u8 qs[128] }`: 4-bit quants, per 32 elements a 6-bit
/// scale and 6-bit min packed into 12 bytes.
pub struct Q4_K;
/// `{ f16 d; f16 dmin; u8 scales[12]; u8 qh[32]; u8 qs[128] }`: Q4_K plus a fifth quant bit.
pub struct Q5_K;
/// `{ u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d }`: 6-bit quants stored minus 32, per 16
/// elements a signed 8-bit scale.
pub struct Q6_K;
/// `{ f32 d; i8 qs[256]; i16 bsums[16] }`: 8-bit quants (the block sums are for ggml's integer
/// dot products and do not affect the values).
pub struct Q8_K;

/// Where the 16 elements of sub-block `sub` (0..16) keep their 2-bit fields in Q2_K/Q3_K's
/// `qs`: each 128-element half uses 32 bytes, and its four 32-element quarters take bits 0-1,
/// 2-3, 4-5, 6-7 of those bytes. Returns the 16 bytes and the shift.
#[inline(always)]
fn two_bit_field(qs: &[u8], sub: usize) -> (&[u8], usize) {
    let (half, quarter, part) = (sub / 8, (sub % 8) / 2, sub % 2);
    (&qs[half * 32 + part * 16..][..16], 2 * quarter)
}

impl BlockFormat for Q2_K {
    const KIND: QuantKind = QuantKind::Q2_K;
    const ELEMS: usize = QK_K;
    const BYTES: usize = QK_K / 16 + QK_K / 4 + 4;
    #[inline(always)]
    fn dequantize_block(b: &[u8], out: &mut [f32]) {
        let b = &b[..Self::BYTES];
        let out = &mut out[..QK_K];
        let (scales, qs) = (&b[..16], &b[16..80]);
        let d = f16_at(&b[80..]);
        let dmin = f16_at(&b[82..]);
        for (sub, o) in out.chunks_exact_mut(16).enumerate() {
            let dl = d * (scales[sub] & 0x0f) as f32;
            let ml = dmin * (scales[sub] >> 4) as f32;
            let (bytes, shift) = two_bit_field(qs, sub);
            for (o, &q) in o.iter_mut().zip(bytes) {
                *o = dl * ((q >> shift) & 3) as f32 - ml;
            }
        }
    }
}

/// Q3_K's 16 six-bit scales: the low 4 bits of scale `j` are nibble `j / 8` of byte `j % 8`,
/// the high 2 bits are bits `2·(j / 4)..` of byte `8 + j % 4`; stored plus 32.
#[inline(always)]
fn q3k_scales(s: &[u8]) -> [i8; 16] {
    std::array::from_fn(|j| {
        let lo = (s[j % 8] >> (4 * (j / 8))) & 0x0f;
        let hi = (s[8 + j % 4] >> (2 * (j / 4))) & 0x03;
        ((lo | (hi << 4)) as i8).wrapping_sub(32)
    })
}

impl BlockFormat for Q3_K {
    const KIND: QuantKind = QuantKind::Q3_K;
    const ELEMS: usize = QK_K;
    const BYTES: usize = QK_K / 8 + QK_K / 4 + 12 + 2;
    #[inline(always)]
    fn dequantize_block(b: &[u8], out: &mut [f32]) {
        let b = &b[..Self::BYTES];
        let out = &mut out[..QK_K];
        let (hmask, qs) = (&b[..32], &b[32..96]);
        let scales = q3k_scales(&b[96..108]);
        let d = f16_at(&b[108..]);
        // The third bit of element `e` is bit `e / 32` of `hmask[e % 32]`; a clear bit means −4.
        for (sub, o) in out.chunks_exact_mut(16).enumerate() {
            let dl = d * scales[sub] as f32;
            let (bytes, shift) = two_bit_field(qs, sub);
            let high = &hmask[(sub % 2) * 16..][..16];
            for ((o, &q), &h) in o.iter_mut().zip(bytes).zip(high) {
                let q = ((q >> shift) & 3) as i32 - if (h >> (sub / 2)) & 1 == 0 { 4 } else { 0 };
                *o = dl * q as f32;
            }
        }
    }
}

/// Q4_K/Q5_K's eight 6-bit sub-block scales (bytes 0..8) and mins (bytes 8..16) from the 12
/// packed bytes `s`. Sub-blocks 0..4 keep theirs in the low 6 bits of bytes `j` (scale) and
/// `j + 4` (min); sub-blocks 4..8 take their low 4 bits from the nibbles of byte `j + 4` and
/// their top 2 bits from the top bits of bytes `j - 4` (scale) and `j` (min). Done four
/// sub-blocks at a time in 32-bit words, so the CPU GEMV can unpack once per super-block too.
#[inline(always)]
pub(crate) fn scales_mins_k4(s: &[u8; 12]) -> [u8; 16] {
    let w = |i: usize| u32::from_le_bytes([s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]]);
    let (w0, w1, w2) = (w(0), w(1), w(2));
    const LOW6: u32 = 0x3f3f_3f3f;
    const LOW4: u32 = 0x0f0f_0f0f;
    const LOW2: u32 = 0x0303_0303;
    let words = [
        w0 & LOW6,
        (w2 & LOW4) | (((w0 >> 6) & LOW2) << 4),
        w1 & LOW6,
        ((w2 >> 4) & LOW4) | (((w1 >> 6) & LOW2) << 4),
    ];
    let mut out = [0u8; 16];
    for (o, v) in out.chunks_exact_mut(4).zip(words) {
        o.copy_from_slice(&v.to_le_bytes());
    }
    out
}

/// Q4_K/Q5_K: sub-block `j` of 32 elements is `d·sc_j · q − dmin·m_j`, with the 4 low quant bits
/// in nibble `j % 2` of bytes `32·(j / 2)..` of `qs` and (Q5_K) the fifth in bit `j` of `qh`.
#[inline(always)]
fn dequantize_k4(b: &[u8], qh: Option<&[u8]>, qs: &[u8], out: &mut [f32]) {
    let d = f16_at(b);
    let dmin = f16_at(&b[2..]);
    let sm = scales_mins_k4(b[4..16].try_into().expect("12 scale bytes"));
    for (j, o) in out[..QK_K].chunks_exact_mut(32).enumerate() {
        let (sc, m) = (sm[j], sm[8 + j]);
        let d1 = d * sc as f32;
        let m1 = dmin * m as f32;
        let bytes = &qs[32 * (j / 2)..32 * (j / 2) + 32];
        let shift = 4 * (j % 2);
        match qh {
            None => {
                for (o, &q) in o.iter_mut().zip(bytes) {
                    *o = d1 * ((q >> shift) & 0x0f) as f32 - m1;
                }
            }
            Some(qh) => {
                for ((o, &q), &h) in o.iter_mut().zip(bytes).zip(&qh[..32]) {
                    let q = ((q >> shift) & 0x0f) | (((h >> j) & 1) << 4);
                    *o = d1 * q as f32 - m1;
                }
            }
        }
    }
}

impl BlockFormat for Q4_K {
    const KIND: QuantKind = QuantKind::Q4_K;
    const ELEMS: usize = QK_K;
    const BYTES: usize = 4 + 12 + QK_K / 2;
    #[inline(always)]
    fn dequantize_block(b: &[u8], out: &mut [f32]) {
        let b = &b[..Self::BYTES];
        dequantize_k4(b, None, &b[16..144], out);
    }
}

impl BlockFormat for Q5_K {
    const KIND: QuantKind = QuantKind::Q5_K;
    const ELEMS: usize = QK_K;
    const BYTES: usize = 4 + 12 + QK_K / 8 + QK_K / 2;
    #[inline(always)]
    fn dequantize_block(b: &[u8], out: &mut [f32]) {
        let b = &b[..Self::BYTES];
        dequantize_k4(b, Some(&b[16..48]), &b[48..176], out);
    }
}

impl BlockFormat for Q6_K {
    const KIND: QuantKind = QuantKind::Q6_K;
    const ELEMS: usize = QK_K;
    const BYTES: usize = QK_K / 2 + QK_K / 4 + QK_K / 16 + 2;
    #[inline(always)]
    fn dequantize_block(b: &[u8], out: &mut [f32]) {
        let b = &b[..Self::BYTES];
        let out = &mut out[..QK_K];
        let (ql, qh, scales) = (&b[..128], &b[128..192], &b[192..208]);
        let d = f16_at(&b[208..]);
        // Each 128-element half uses 64 bytes of `ql` (quarters 0 and 1 in the low nibbles of its
        // two 32-byte runs, quarters 2 and 3 in the high nibbles) and 32 bytes of `qh` (2-bit
        // fields, one per 32-element quarter).
        for (sub, o) in out.chunks_exact_mut(16).enumerate() {
            let dl = d * (scales[sub] as i8) as f32;
            let (half, quarter, part) = (sub / 8, (sub % 8) / 2, sub % 2);
            let low = &ql[half * 64 + (quarter % 2) * 32 + part * 16..][..16];
            let high = &qh[half * 32 + part * 16..][..16];
            let (lshift, hshift) = (4 * (quarter / 2), 2 * quarter);
            for ((o, &l), &h) in o.iter_mut().zip(low).zip(high) {
                let q = (((l >> lshift) & 0x0f) | (((h >> hshift) & 0x03) << 4)) as i32 - 32;
                *o = dl * q as f32;
            }
        }
    }
}

impl BlockFormat for Q8_K {
    const KIND: QuantKind = QuantKind::Q8_K;
    const ELEMS: usize = QK_K;
    const BYTES: usize = 4 + QK_K + QK_K / 16 * 2;
    #[inline(always)]
    fn dequantize_block(b: &[u8], out: &mut [f32]) {
        let d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        for (o, &q) in out[..QK_K].iter_mut().zip(&b[4..4 + QK_K]) {
            *o = d * (q as i8) as f32;
        }
    }
}

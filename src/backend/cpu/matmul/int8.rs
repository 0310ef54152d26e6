//! [`Numerics::Int8`](super::Numerics::Int8): 8-bit integer activations against Q4_0, Q4_1,
//! Q5_0, Q5_1 and Q8_0 weights interleaved at load, sixteen rows to a group, for AVX512-VNNI's
//! `vpdpbusd` ([`super::avx512_i8`]) and, on CPUs without it, AVX2's `vpmaddubsw`
//! ([`super::avx2_i8`]).
//!
//! **Activations.** Each token row is rounded per 32-element block to `q = round(x / d)`,
//! `d = max|x| / 127` (at most `d/2` per element, a relative 0.4% of the block's largest
//! magnitude: llama.cpp's `Q8_0`/`Q8_1` activations), once per call, shared by every row.
//!
//! **Weights.** The ggml blocks of 16 consecutive rows are regrouped block by block: the 16
//! scales (and Q4_1's 16 mins), then the quants transposed so that one 64-byte vector holds
//! four consecutive elements of each of the 16 rows (32-bit lane `r` = row `r`). Q4 bytes keep
//! their nibble pairing (byte `i` of a block holds elements `i` and `i + 16`), so a Q4 block is
//! four such vectors, each unpacked into two by a mask and a shift; Q8_0 is eight, stored with
//! the sign bit flipped (`w + 128` as an unsigned byte, which `vpdpbusd` needs on one side).
//! Q5's fifth bits (ggml's `qh`, one 32-bit word per row and block) become eight 64-bit masks
//! per group block, mask `i` holding the bits of the bytes of quant vector `i` (bit `4r + k` for
//! row `r`'s element `4i + k`), which the kernel adds as 16 to the unpacked nibbles (one masked
//! byte add per vector). The same bytes as the ggml blocks, reordered: no memory is added but
//! the padding of a last group of fewer than 16 rows.
//!
//! **Products.** Per group of 16 rows, block and token, eight `vpdpbusd` (64 products each,
//! exact in 32-bit lanes, the token's four activation bytes broadcast from memory) give the
//! block's integer sums `Σ q_w·q_x` of the 16 rows (Q4_0's quants stored as `q + 8`, Q5_0's as
//! `q + 16` and Q8_0's as `q + 128`, the multiple of `Σ q_x` taken back in integers); then one
//! conversion, one multiply (`d_w·d_x`) and one FMA into the rows' f32 accumulators (Q4_1 and
//! Q5_1: one more FMA, `m_w·d_x·Σq`). That is about one instruction per 43
//! multiply-adds at one token and per 55 at many, against 16 for the exact f32 kernels, with
//! no dequantization and no horizontal sums.
//!
//! **Bits.** Each (row, token) result is one chain over the blocks in order, the same whatever
//! the call's token count or the row's place in its group: integer sums are exact, and
//! `acc ← fma(float(Σ), d_w·d_x, acc)` (then `acc ← fma(m_w, d_x·Σq, acc)` for Q4_1 and Q5_1)
//! is computed lane by lane. [`rows_ref`] is that chain in scalar Rust, the reference the
//! AVX-512 kernel ([`super::avx512_i8`]) and the AVX2 one ([`super::avx2_i8`], whose integer
//! sums are taken in 16-bit pairs, each bounded so that none saturates) are tested against bit
//! for bit, and what runs at the scalar level.

use half::f16;

use super::{Job, Pages, WeightArena};
use crate::model::quant::{self, QuantKind};

/// The interleaved formats as the kernels' const parameter (the AVX-512 and AVX2 kernels are
/// each compiled once per format).
pub(crate) mod format {
    use crate::model::quant::QuantKind;

    pub(crate) const Q4_0: u8 = 0;
    pub(crate) const Q4_1: u8 = 1;
    pub(crate) const Q8_0: u8 = 2;
    pub(crate) const Q5_0: u8 = 3;
    pub(crate) const Q5_1: u8 = 4;

    /// The format a const parameter stands for.
    pub(crate) const fn kind_of(format: u8) -> QuantKind {
        match format {
            Q4_0 => QuantKind::Q4_0,
            Q4_1 => QuantKind::Q4_1,
            Q5_0 => QuantKind::Q5_0,
            Q5_1 => QuantKind::Q5_1,
            _ => QuantKind::Q8_0,
        }
    }
}

/// Elements per activation block (one scale each): every interleaved format's block.
pub(crate) const BLOCK: usize = 32;

/// Rows per interleaved group: one 32-bit lane of a 512-bit vector each.
pub(crate) const GROUP: usize = 16;

/// The largest integer an activation is rounded to.
const QMAX: f32 = 127.0;

/// One activation row in 8-bit integers.
pub(crate) struct XI8 {
    /// `x / d`, rounded to the nearest integer (ties to even), per element.
    pub q: Vec<i8>,
    /// The scale `d` of each block; NaN where the block holds a NaN or an infinity (its `q`
    /// are then 0), so non-finite activations stay non-finite in the products.
    pub d: Vec<f32>,
    /// `d·Σq` of each block: the rounded activations' sum, which Q4_1's and Q5_1's min multiplies.
    /// (The unrounded `Σx` would leave each product's error at `(w − m)·(x − d·q)`, Q4_1's quants
    /// being all positive; with the rounded sum it is `w·(x − d·q)`, as for the other formats: on
    /// the demo model the mean KL against exact fell from 1.0·10⁻² to 1.9·10⁻³.)
    pub sums: Vec<f32>,
    /// `Σ q` of each block (the corrections of Q4_0's `−8`, Q5_0's `−16` and Q8_0's `+128`).
    pub qsums: Vec<i32>,
}

impl XI8 {
    /// Zeros for `len` elements (whole blocks), filled in by the rounding.
    pub(crate) fn zeros(len: usize) -> XI8 {
        let nb = len / BLOCK;
        XI8 {
            q: vec![0; len],
            d: vec![0.0; nb],
            sums: vec![0.0; nb],
            qsums: vec![0; nb],
        }
    }
}

/// A block's scale and its reciprocal from its largest magnitude ([`super::block_scale`]).
#[inline(always)]
pub(crate) fn scale_of(amax: f32) -> (f32, f32) {
    super::block_scale(amax, QMAX)
}

/// Rounds `x` (a whole number of blocks) as the kernels do: the reference for the vectorised
/// [`quantize`].
pub(crate) fn quantize_ref(x: &[f32]) -> XI8 {
    assert!(
        x.len().is_multiple_of(BLOCK),
        "activation row of {} is not whole blocks",
        x.len()
    );
    let mut out = XI8::zeros(x.len());
    for (b, c) in x.chunks_exact(BLOCK).enumerate() {
        let Some((d, rounded)) = super::round_block_ref(c, QMAX) else {
            out.d[b] = f32::NAN;
            out.sums[b] = f32::NAN;
            continue;
        };
        out.d[b] = d;
        let mut s = 0;
        for (q, v) in out.q[b * BLOCK..(b + 1) * BLOCK].iter_mut().zip(rounded) {
            // `as` saturates; the values are within ±127 up to rounding, so nothing is clipped.
            *q = v as i8;
            s += *q as i32;
        }
        out.qsums[b] = s;
        out.sums[b] = d * s as f32;
    }
    out
}

/// Rounds `x` with the fastest kernel the CPU has (bit-identical to [`quantize_ref`]).
pub(crate) fn quantize(x: &[f32]) -> XI8 {
    assert!(
        x.len().is_multiple_of(BLOCK),
        "activation row of {} is not whole blocks",
        x.len()
    );
    #[cfg(target_arch = "x86_64")]
    if super::avx512_i8::available() {
        // SAFETY: the CPU has AVX-512 F/BW/VL and VNNI; `x` is whole blocks.
        return unsafe { super::avx512_i8::quantize(x) };
    }
    #[cfg(target_arch = "x86_64")]
    if super::avx2_i8::available() {
        // SAFETY: the CPU has AVX2; `x` is whole blocks.
        return unsafe { super::avx2_i8::quantize(x) };
    }
    quantize_ref(x)
}

/// Weights of a block format regrouped for the integer kernels (see the module doc).
pub struct Interleaved {
    pub kind: QuantKind,
    /// Rows of the matrix (the last group is padded to [`GROUP`] rows with zero blocks).
    pub rows: usize,
    pub cols: usize,
    pub bytes: Pages<u8>,
}

/// Bytes of one interleaved block of a group: scales, mins, fifth-bit masks, quants.
pub(crate) const fn group_block_bytes(kind: QuantKind) -> usize {
    group_quants_at(kind)
        + match kind {
            QuantKind::Q8_0 => GROUP * 32,
            _ => GROUP * 16,
        }
}

/// Whether a format has a min per block (its values `d·q + m`).
pub(crate) const fn has_min(kind: QuantKind) -> bool {
    matches!(kind, QuantKind::Q4_1 | QuantKind::Q5_1)
}

/// Whether a format has a fifth bit per quant (ggml's `qh`).
pub(crate) const fn has_fifth_bit(kind: QuantKind) -> bool {
    matches!(kind, QuantKind::Q5_0 | QuantKind::Q5_1)
}

/// Offset of the fifth-bit masks in an interleaved group block (after the scales and mins).
pub(crate) const fn group_masks_at(kind: QuantKind) -> usize {
    if has_min(kind) {
        4 * GROUP
    } else {
        2 * GROUP
    }
}

/// What a format's stored quant adds to the signed value it stands for: Q4_0 stores `q + 8`,
/// Q5_0 `q + 16` (its fifth bit included) and Q8_0, in the interleaved bytes, `q + 128` (sign
/// bit flipped); the kernels take that multiple of the activations' `Σ q` back in integers.
/// Formats with a min store their quants as they are.
pub(crate) const fn stored_offset(kind: QuantKind) -> i32 {
    match kind {
        QuantKind::Q4_0 => 8,
        QuantKind::Q5_0 => 16,
        QuantKind::Q8_0 => 128,
        _ => 0,
    }
}

/// Offset of `qh` in a Q5 ggml block (after its f16 scale, and Q5_1's f16 min).
pub(crate) const fn ggml_fifth_at(kind: QuantKind) -> usize {
    if has_min(kind) {
        4
    } else {
        2
    }
}

/// Offset of the quants in a ggml block (after its f16 scale, its f16 min, its `qh`).
pub(crate) const fn ggml_quants_at(kind: QuantKind) -> usize {
    ggml_fifth_at(kind) + if has_fifth_bit(kind) { 4 } else { 0 }
}

/// Offset of the quants in an interleaved group block (after the scales, mins and masks).
pub(crate) const fn group_quants_at(kind: QuantKind) -> usize {
    group_masks_at(kind) + if has_fifth_bit(kind) { 8 * 8 } else { 0 }
}

/// Whether [`Interleaved`] takes this format.
pub fn interleavable(kind: QuantKind) -> bool {
    matches!(
        kind,
        QuantKind::Q4_0 | QuantKind::Q4_1 | QuantKind::Q5_0 | QuantKind::Q5_1 | QuantKind::Q8_0
    )
}

impl Interleaved {
    /// Regroups `rows` rows of `cols` columns of ggml blocks (`kind` must be
    /// [`interleavable`]; the shape checked by the caller), into `arena`.
    pub fn new(
        kind: QuantKind,
        rows: usize,
        cols: usize,
        blocks: &[u8],
        arena: &mut WeightArena,
    ) -> Interleaved {
        assert!(interleavable(kind), "{} cannot be interleaved", kind.name());
        let nb = cols / BLOCK;
        let (gb, bb) = (kind.block_bytes(), group_block_bytes(kind));
        let groups = rows.div_ceil(GROUP);
        let bytes = arena.filled::<u8>(groups * nb * bb, |bytes| {
            let (qa, ga) = (ggml_quants_at(kind), group_quants_at(kind));
            for n in 0..rows {
                let (g, r) = (n / GROUP, n % GROUP);
                for b in 0..nb {
                    let src = &blocks[(n * nb + b) * gb..(n * nb + b + 1) * gb];
                    let dst = &mut bytes[(g * nb + b) * bb..(g * nb + b + 1) * bb];
                    dst[2 * r..2 * r + 2].copy_from_slice(&src[0..2]);
                    if has_min(kind) {
                        dst[2 * GROUP + 2 * r..2 * GROUP + 2 * r + 2].copy_from_slice(&src[2..4]);
                    }
                    if has_fifth_bit(kind) {
                        let fa = ggml_fifth_at(kind);
                        let qh =
                            u32::from_le_bytes([src[fa], src[fa + 1], src[fa + 2], src[fa + 3]]);
                        let masks = group_masks_at(kind);
                        for e in (0..BLOCK).filter(|e| qh >> e & 1 == 1) {
                            let bit = 4 * r + e % 4;
                            dst[masks + 8 * (e / 4) + bit / 8] |= 1 << (bit % 8);
                        }
                    }
                    let q = &src[qa..];
                    // Vector `j` holds bytes 4j..4j+4 of every row's quants, row r at lane r.
                    for (j, word) in q.chunks_exact(4).enumerate() {
                        let at = ga + j * 4 * GROUP + 4 * r;
                        for (i, &v) in word.iter().enumerate() {
                            dst[at + i] = if kind == QuantKind::Q8_0 { v ^ 0x80 } else { v };
                        }
                    }
                }
            }
        });
        Interleaved {
            kind,
            rows,
            cols,
            bytes,
        }
    }

    /// Row `n`'s ggml blocks, rebuilt.
    fn ggml_row(&self, n: usize) -> Vec<u8> {
        let nb = self.cols / BLOCK;
        let (gb, bb) = (self.kind.block_bytes(), group_block_bytes(self.kind));
        let (qa, ga) = (ggml_quants_at(self.kind), group_quants_at(self.kind));
        let (g, r) = (n / GROUP, n % GROUP);
        let mut out = vec![0u8; nb * gb];
        for b in 0..nb {
            let src = &self.bytes[(g * nb + b) * bb..(g * nb + b + 1) * bb];
            let dst = &mut out[b * gb..(b + 1) * gb];
            dst[0..2].copy_from_slice(&src[2 * r..2 * r + 2]);
            if has_min(self.kind) {
                dst[2..4].copy_from_slice(&src[2 * GROUP + 2 * r..2 * GROUP + 2 * r + 2]);
            }
            if has_fifth_bit(self.kind) {
                let qh = (0..BLOCK)
                    .filter(|&e| fifth_bit(src, self.kind, r, e))
                    .fold(0u32, |h, e| h | 1 << e);
                let fa = ggml_fifth_at(self.kind);
                dst[fa..fa + 4].copy_from_slice(&qh.to_le_bytes());
            }
            let quants = gb - qa;
            for e in 0..quants {
                let (j, i) = (e / 4, e % 4);
                let v = src[ga + j * 4 * GROUP + 4 * r + i];
                dst[qa + e] = if self.kind == QuantKind::Q8_0 {
                    v ^ 0x80
                } else {
                    v
                };
            }
        }
        out
    }

    /// Row `n` dequantized as ggml does (an embedding lookup).
    pub fn row_f32(&self, n: usize, dst: &mut [f32]) {
        assert!(n < self.rows, "row {n} of a matrix of {} rows", self.rows);
        quant::dequantize_row(self.kind, &self.ggml_row(n), dst);
    }

    /// Whether the bytes fit the shape.
    pub fn check(&self) -> Result<(), String> {
        let want = self.rows.div_ceil(GROUP) * (self.cols / BLOCK) * group_block_bytes(self.kind);
        if !self.cols.is_multiple_of(BLOCK) || self.bytes.len() != want {
            return Err(format!(
                "{} bytes of interleaved {} for a {}x{} matrix, expected {want}",
                self.bytes.len(),
                self.kind.name(),
                self.rows,
                self.cols
            ));
        }
        Ok(())
    }
}

/// The fifth bit of row `r`'s element `e` in an interleaved Q5 group block: bit `4r + e % 4` of
/// mask `e / 4`.
fn fifth_bit(blk: &[u8], kind: QuantKind, r: usize, e: usize) -> bool {
    let bit = 4 * r + e % 4;
    blk[group_masks_at(kind) + 8 * (e / 4) + bit / 8] >> (bit % 8) & 1 == 1
}

/// The f16 at `p[2i..2i+2]`.
fn f16_at(p: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([p[2 * i], p[2 * i + 1]]).to_f32()
}

/// Output `n` of token `t`: the block chain of the module doc, in scalar Rust.
fn dot_ref(w: &Interleaved, n: usize, x: &XI8) -> f32 {
    let nb = w.cols / BLOCK;
    let bb = group_block_bytes(w.kind);
    let ga = group_quants_at(w.kind);
    let (g, r) = (n / GROUP, n % GROUP);
    let mut acc = 0f32;
    for b in 0..nb {
        let blk = &w.bytes[(g * nb + b) * bb..(g * nb + b + 1) * bb];
        let xq = &x.q[b * BLOCK..(b + 1) * BLOCK];
        let mut sum: i32 = 0;
        match w.kind {
            QuantKind::Q8_0 => {
                for e in 0..BLOCK {
                    let v = blk[ga + (e / 4) * 4 * GROUP + 4 * r + e % 4] ^ 0x80;
                    sum += (v as i8) as i32 * xq[e] as i32;
                }
            }
            kind => {
                let off = stored_offset(kind);
                let fifth = |e: usize| {
                    if has_fifth_bit(kind) && fifth_bit(blk, kind, r, e) {
                        16
                    } else {
                        0
                    }
                };
                for e in 0..16 {
                    let v = blk[ga + (e / 4) * 4 * GROUP + 4 * r + e % 4];
                    sum += ((v & 0x0f) as i32 + fifth(e) - off) * xq[e] as i32;
                    sum += ((v >> 4) as i32 + fifth(e + 16) - off) * xq[e + 16] as i32;
                }
            }
        }
        let s = f16_at(blk, r) * x.d[b];
        acc = (sum as f32).mul_add(s, acc);
        if has_min(w.kind) {
            acc = f16_at(&blk[2 * GROUP..], r).mul_add(x.sums[b], acc);
        }
    }
    acc
}

/// Every output of `job` over interleaved `w` with activations `x` (one per token), in scalar
/// Rust: the reference, and the kernel below AVX2 (a level forced to scalar).
///
/// # Safety
/// `job`'s output must be valid for writes at `t·ldo + n` for every token and row of the job.
pub(crate) unsafe fn rows_ref(w: &Interleaved, x: &[XI8], job: &Job) {
    for (t, xt) in x.iter().enumerate().take(job.tokens) {
        for n in job.rows.clone() {
            job.put(t, n, dot_ref(w, n, xt));
        }
    }
}

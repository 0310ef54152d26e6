//! Exact decode on Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 weights regrouped at load, sixteen rows to a group,
//! for AVX-512 kernels whose 16 lanes are 16 output rows ([`super::avx512_grouped`]).
//!
//! **Why.** The GEMV on the blocks as stored ([`super::avx512`]) multiplies one row's block with
//! the activations in two 16-lane halves and scales the partial sum by the block's `d`, so every
//! block and row also pays for its scale's gather and broadcast, and Q5's fifth bits are
//! spliced in lane by lane (five vector operations per half block). With the rows in the lanes
//! no scale is gathered (the 16 rows' `d`s are one 32-byte load and one conversion per block),
//! nothing is summed across lanes, and each quant is one shift and one table lookup
//! (`vpermps`/`vpermi2ps` read only an index's low 4 or 5 bits) before its FMA with a broadcast
//! activation.
//!
//! **Layout.** The ggml blocks of 16 consecutive rows are regrouped block by block: the 16
//! scales `d` (f16), for Q4_1 and Q5_1 the 16 mins `m`, then the quants, row `r` in 32-bit lane
//! `r` of `bits` consecutive 64-byte vectors (`bits` = 4 or 5): element `e` of the block is the
//! unsigned quant in bits `bits·e .. bits·(e + 1)` of that lane's `32·bits`-bit stream (Q5's
//! fifth bit, ggml's `qh` bit `e`, on top of the nibble), crossing from one word into the next
//! where it must (four of Q5's 32 fields). Q8_0's quants are element-major instead: element
//! `e`'s 16 signed bytes (rows in order) at `16e`, one sign-extending load and one conversion
//! from f32. The same bytes as the ggml blocks, reordered: no memory is added but the padding of
//! a last group of fewer than 16 rows.
//!
//! **Bits.** Each (row, token) output is one chain over the blocks in order, whatever the call's
//! token count: per block, four partial sums `p_i = Σ_{8i ≤ e < 8i+8} q_e·x_e` (each in element
//! order, one FMA per element: four chains of 8, so one token's FMAs do not wait on each other's
//! latency), `acc ← fma(d, (p_0 + p_1) + (p_2 + p_3), acc)`, then for formats with a min
//! `acc ← fma(m, Σx_block, acc)` (the block sums summed in element order). [`rows_ref`] is that
//! chain in scalar Rust, which the AVX-512 kernel is tested against bit for bit. Products of more
//! tokens than [`MAX_TOKENS`] (prefill) dequantize tiles of rows exactly, as for blocks as
//! stored, and run the dense kernels.

#[cfg(test)]
use half::f16;

use super::int8::{ggml_fifth_at, ggml_quants_at, has_fifth_bit, has_min};
#[cfg(test)]
use super::Job;
use super::{Pages, WeightArena};
use crate::model::quant::{self, QuantKind};

/// Elements per block (one scale each): every grouped format's block.
pub(crate) const BLOCK: usize = 32;

/// Rows per group: one 32-bit lane of a 512-bit vector each.
pub(crate) const GROUP: usize = 16;

/// The most tokens the grouped kernel takes in one call (in chunks of 4, each re-reading the
/// group's blocks from L1); calls of more dequantize tiles for the packed panels. At 16 the
/// chunks beat a dequantized tile through the 4 × 6 dot-product kernels: SmolLM2 Q4_1,
/// `kiln-bench --concurrency 16 -p 16 -n 64 -t 2` on an Intel Xeon with AVX-512 FP16, 236–259
/// → 360–403 tok/s (blocks as stored: 304–333).
pub(crate) const MAX_TOKENS: usize = 16;

/// Whether [`Grouped`] takes this format.
pub fn groupable(kind: QuantKind) -> bool {
    matches!(
        kind,
        QuantKind::Q4_0 | QuantKind::Q4_1 | QuantKind::Q5_0 | QuantKind::Q5_1 | QuantKind::Q8_0
    )
}

/// Bits per quant: 4, 5 with ggml's `qh` bit, or Q8_0's 8.
pub(crate) const fn bits(kind: QuantKind) -> usize {
    match kind {
        QuantKind::Q8_0 => 8,
        _ if has_fifth_bit(kind) => 5,
        _ => 4,
    }
}

/// What a stored (unsigned) quant adds to the value it stands for: Q4_0's `−8`, Q5_0's `−16`.
pub(crate) const fn value_offset(kind: QuantKind) -> i32 {
    match kind {
        QuantKind::Q4_0 => -8,
        QuantKind::Q5_0 => -16,
        _ => 0,
    }
}

/// Offset of the quants in a group block (after the scales and mins).
pub(crate) const fn quants_at(kind: QuantKind) -> usize {
    if has_min(kind) {
        4 * GROUP
    } else {
        2 * GROUP
    }
}

/// Bytes of one group block: scales, mins, `bits` vectors of quants.
pub(crate) const fn group_block_bytes(kind: QuantKind) -> usize {
    quants_at(kind) + bits(kind) * 4 * GROUP
}

/// Weights of a block format regrouped for the grouped kernels (see the module doc).
pub struct Grouped {
    pub kind: QuantKind,
    /// Rows of the matrix (the last group is padded to [`GROUP`] rows with zero blocks).
    pub rows: usize,
    pub cols: usize,
    pub bytes: Pages<u8>,
}

/// Element `e`'s unsigned quant in a ggml block of `kind` (nibble, and Q5's fifth bit; not
/// Q8_0).
fn ggml_quant(kind: QuantKind, src: &[u8], e: usize) -> u32 {
    let qs = &src[ggml_quants_at(kind)..];
    let nibble = if e < 16 {
        qs[e] & 0x0f
    } else {
        qs[e - 16] >> 4
    } as u32;
    if has_fifth_bit(kind) {
        let fa = ggml_fifth_at(kind);
        let qh = u32::from_le_bytes([src[fa], src[fa + 1], src[fa + 2], src[fa + 3]]);
        nibble | (qh >> e & 1) << 4
    } else {
        nibble
    }
}

/// The byte offset (in the group block) and bit of lane `r`'s field `e`: bit `bits·e` of the
/// lane's stream lies in word `bits·e / 32`, which for row `r` is at `4r` of that word's
/// vector.
fn field_at(kind: QuantKind, r: usize, e: usize) -> (usize, usize) {
    let bit = bits(kind) * e;
    (quants_at(kind) + (bit / 32) * 4 * GROUP + 4 * r, bit % 32)
}

/// The 32-bit word at `p[at..at + 4]`.
fn word_at(p: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([p[at], p[at + 1], p[at + 2], p[at + 3]])
}

/// Where row `r`'s element `e` lies in a Q8_0 group block: each element's 16 rows are 16
/// consecutive bytes (one sign-extending load each).
fn q8_at(r: usize, e: usize) -> usize {
    quants_at(QuantKind::Q8_0) + GROUP * e + r
}

/// Lane `r`'s field `e` of a group block (not Q8_0).
fn field(kind: QuantKind, blk: &[u8], r: usize, e: usize) -> u32 {
    let (at, shift) = field_at(kind, r, e);
    let mut v = word_at(blk, at) >> shift;
    if shift + bits(kind) > 32 {
        v |= word_at(blk, at + 4 * GROUP) << (32 - shift);
    }
    v & ((1 << bits(kind)) - 1)
}

/// The f16 at `p[2i..2i+2]`.
#[cfg(test)]
fn f16_at(p: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([p[2 * i], p[2 * i + 1]]).to_f32()
}

impl Grouped {
    /// Regroups `rows` rows of `cols` columns of ggml blocks (`kind` must be [`groupable`]; the
    /// shape checked by the caller), into `arena`.
    pub fn new(
        kind: QuantKind,
        rows: usize,
        cols: usize,
        blocks: &[u8],
        arena: &mut WeightArena,
    ) -> Grouped {
        assert!(groupable(kind), "{} cannot be grouped", kind.name());
        let nb = cols / BLOCK;
        let (gb, bb) = (kind.block_bytes(), group_block_bytes(kind));
        let groups = rows.div_ceil(GROUP);
        let bytes = arena.filled::<u8>(groups * nb * bb, |bytes| {
            for n in 0..rows {
                let (g, r) = (n / GROUP, n % GROUP);
                for b in 0..nb {
                    let src = &blocks[(n * nb + b) * gb..(n * nb + b + 1) * gb];
                    let dst = &mut bytes[(g * nb + b) * bb..(g * nb + b + 1) * bb];
                    dst[2 * r..2 * r + 2].copy_from_slice(&src[0..2]);
                    if has_min(kind) {
                        dst[2 * GROUP + 2 * r..2 * GROUP + 2 * r + 2].copy_from_slice(&src[2..4]);
                    }
                    if kind == QuantKind::Q8_0 {
                        for e in 0..BLOCK {
                            dst[q8_at(r, e)] = src[ggml_quants_at(kind) + e];
                        }
                        continue;
                    }
                    for e in 0..BLOCK {
                        let q = u64::from(ggml_quant(kind, src, e));
                        let (at, shift) = field_at(kind, r, e);
                        // The field's bits, spilling into the next word's bytes where it crosses.
                        let spread = q << shift;
                        for i in 0..4 {
                            dst[at + i] |= (spread >> (8 * i)) as u8;
                        }
                        if shift + bits(kind) > 32 {
                            dst[at + 4 * GROUP] |= (spread >> 32) as u8;
                        }
                    }
                }
            }
        });
        Grouped {
            kind,
            rows,
            cols,
            bytes,
        }
    }

    /// Group `g`'s block `b`.
    fn group_block(&self, g: usize, b: usize) -> &[u8] {
        let (nb, bb) = (self.cols / BLOCK, group_block_bytes(self.kind));
        &self.bytes[(g * nb + b) * bb..(g * nb + b + 1) * bb]
    }

    /// Row `n`'s ggml blocks, rebuilt.
    fn ggml_row(&self, n: usize) -> Vec<u8> {
        let kind = self.kind;
        let (nb, gb) = (self.cols / BLOCK, kind.block_bytes());
        let (g, r) = (n / GROUP, n % GROUP);
        let (qa, fa) = (ggml_quants_at(kind), ggml_fifth_at(kind));
        let mut out = vec![0u8; nb * gb];
        for b in 0..nb {
            let src = self.group_block(g, b);
            let dst = &mut out[b * gb..(b + 1) * gb];
            dst[0..2].copy_from_slice(&src[2 * r..2 * r + 2]);
            if has_min(kind) {
                dst[2..4].copy_from_slice(&src[2 * GROUP + 2 * r..2 * GROUP + 2 * r + 2]);
            }
            if kind == QuantKind::Q8_0 {
                for e in 0..BLOCK {
                    dst[qa + e] = src[q8_at(r, e)];
                }
                continue;
            }
            let mut qh = 0u32;
            for e in 0..BLOCK {
                let q = field(kind, src, r, e);
                let nibble = (q & 0x0f) as u8;
                if e < 16 {
                    dst[qa + e] |= nibble;
                } else {
                    dst[qa + e - 16] |= nibble << 4;
                }
                qh |= (q >> 4) << e;
            }
            if has_fifth_bit(kind) {
                dst[fa..fa + 4].copy_from_slice(&qh.to_le_bytes());
            }
        }
        out
    }

    /// Row `n` dequantized as ggml does (an embedding lookup, and prefill tiles where the
    /// CPU has no AVX-512).
    pub fn row_f32(&self, n: usize, dst: &mut [f32]) {
        assert!(n < self.rows, "row {n} of a matrix of {} rows", self.rows);
        quant::dequantize_row(self.kind, &self.ggml_row(n), dst);
    }

    /// Whether the bytes fit the shape.
    pub fn check(&self) -> Result<(), String> {
        let want = self.rows.div_ceil(GROUP) * (self.cols / BLOCK) * group_block_bytes(self.kind);
        if !self.cols.is_multiple_of(BLOCK) || self.bytes.len() != want {
            return Err(format!(
                "{} bytes of grouped {} for a {}x{} matrix, expected {want}",
                self.bytes.len(),
                self.kind.name(),
                self.rows,
                self.cols
            ));
        }
        Ok(())
    }
}

/// The sums of each block of `x` (whole blocks), each in element order: what formats with a
/// min multiply by `m`.
pub(crate) fn block_sums(x: &[f32]) -> Vec<f32> {
    x.chunks_exact(BLOCK).map(|c| c.iter().sum()).collect()
}

/// Output `n` for the activation row `x` (with its [`block_sums`]): the block chain of the
/// module doc, in scalar Rust.
#[cfg(test)]
fn dot_ref(w: &Grouped, n: usize, x: &[f32], sums: &[f32]) -> f32 {
    let (g, r) = (n / GROUP, n % GROUP);
    let off = value_offset(w.kind);
    let mut acc = 0f32;
    for b in 0..w.cols / BLOCK {
        let blk = w.group_block(g, b);
        let xb = &x[b * BLOCK..(b + 1) * BLOCK];
        let q = |e: usize| {
            if w.kind == QuantKind::Q8_0 {
                blk[q8_at(r, e)] as i8 as f32
            } else {
                (field(w.kind, blk, r, e) as i32 + off) as f32
            }
        };
        let quarter = |i: usize| (8 * i..8 * i + 8).fold(0f32, |p, e| q(e).mul_add(xb[e], p));
        let s = (quarter(0) + quarter(1)) + (quarter(2) + quarter(3));
        acc = f16_at(blk, r).mul_add(s, acc);
        if has_min(w.kind) {
            acc = f16_at(&blk[2 * GROUP..], r).mul_add(sums[b], acc);
        }
    }
    acc
}

/// Every output of `job` over grouped `w`, in scalar Rust: the reference the AVX-512 kernel is
/// tested against.
///
/// # Safety
/// `job`'s output must be valid for writes at `t·ldo + n` for every token and row of the job, its
/// input for reads of `job.k` values per token.
#[cfg(test)]
pub(crate) unsafe fn rows_ref(w: &Grouped, job: &Job) {
    for t in 0..job.tokens {
        let x = job.xrow(t);
        let sums = block_sums(x);
        for n in job.rows.clone() {
            job.put(t, n, dot_ref(w, n, x, &sums));
        }
    }
}

//! Exact decode on Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K and Q6_K weights regrouped at load,
//! sixteen rows to a group, for AVX-512 kernels whose 16 lanes are 16 output rows
//! ([`super::avx512_grouped`]) and AVX2 kernels that take each group as two halves of eight
//! ([`super::avx2_grouped`]).
//!
//! **Why.** The GEMV on the blocks as stored ([`super::avx512`]) multiplies one row's block with
//! the activations in two 16-lane halves and scales the partial sum by the block's `d`, so every
//! block and row also pays for its scale's gather and broadcast, and Q5's fifth bits are
//! spliced in lane by lane (five vector operations per half block). With the rows in the lanes
//! no scale is gathered (the 16 rows' `d`s are one 32-byte load and one conversion per block),
//! nothing is summed across lanes, and each quant is at most one shift and one table lookup
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
//! from f32. The K formats group their 256-element super-blocks: Q4_K's 16 `d`s and `dmin`s, its
//! 6-bit sub-block scales and mins unpacked to bytes (16 bytes a row for ggml's 12), then each
//! 32-element sub-block's quants as a Q4_1 block's; Q6_K's 16 `d`s, its 8-bit sub-block scales,
//! then each lane a stream of 6-bit fields (`q − 32` from the field by one ternary-logic op and
//! one subtraction: the bits go into the mantissa of 2²³). The same bytes as the ggml blocks,
//! reordered (Q4_K: 4 more a row and super-block): no memory is added but that and the padding of
//! a last group of fewer than 16 rows. On CPUs whose best kernels are AVX2's, Q4_0, Q4_1, Q4_K
//! and Q5_0 are grouped in [`Layout::Halves`] instead (the same bytes for the 4-bit formats, 2
//! more a row and block for Q5_0), whose chain differs (below).
//!
//! **Bits.** Each (row, token) output is one chain over the blocks in order, whatever the call's
//! token count: per block, four partial sums `p_i = Σ_{8i ≤ e < 8i+8} q_e·x_e` (each in element
//! order, one FMA per element: four chains of 8, so one token's FMAs do not wait on each other's
//! latency), `acc ← fma(d, (p_0 + p_1) + (p_2 + p_3), acc)`, then for formats with a min
//! `acc ← fma(m, Σx_block, acc)` (the block sums as [`super::block_sum`] folds them). Q4_K's
//! sub-blocks go as blocks with `d·sc_j` for `d` and `−dmin·m_j` for `m`; Q6_K's pairs of
//! 16-element sub-blocks as blocks whose two halves `p_0 + p_1` and `p_2 + p_3` each take their own
//! `d·sc_j` (no min). In [`Layout::Halves`] the partial sums are `p_i = Σ_{e ≡ i mod 4} q_e·x_e`
//! instead (each in element order: consecutive elements go to different chains in the order the
//! fields lie) over the unsigned quants, Q4_0's `−8` and Q5_0's `−16` taken as a min
//! (`acc ← fma(−8·d, Σx_block, acc)`, `−16·d`). [`rows_ref`] is that
//! chain in scalar Rust, which the AVX-512 and AVX2 kernels are tested against bit for bit. Products of more
//! tokens than [`MAX_TOKENS`] (prefill) dequantize tiles of rows exactly, as for blocks as
//! stored, and run the dense kernels.

use std::borrow::Cow;

use half::f16;

use super::int8::{ggml_fifth_at, ggml_quants_at, has_fifth_bit, has_min};
use super::Job;
use super::{Pages, WeightArena};
use crate::model::quant::{self, QuantKind};

/// The grouped formats as the kernels' const parameter.
pub(crate) mod format {
    use crate::model::quant::QuantKind;

    pub(crate) const Q4_0: u8 = 0;
    pub(crate) const Q4_1: u8 = 1;
    pub(crate) const Q5_0: u8 = 2;
    pub(crate) const Q5_1: u8 = 3;
    pub(crate) const Q8_0: u8 = 4;
    pub(crate) const Q4_K: u8 = 5;
    pub(crate) const Q6_K: u8 = 6;

    /// The format a kernel's const parameter stands for.
    pub(crate) const fn kind_of(f: u8) -> QuantKind {
        match f {
            Q4_0 => QuantKind::Q4_0,
            Q4_1 => QuantKind::Q4_1,
            Q5_0 => QuantKind::Q5_0,
            Q5_1 => QuantKind::Q5_1,
            Q8_0 => QuantKind::Q8_0,
            Q4_K => QuantKind::Q4_K,
            _ => QuantKind::Q6_K,
        }
    }
}

/// Invokes the macro `$f!(e, index)` for the 32 fields of a block's quant words `$w` (for Q8_0,
/// `$f!(e, value)` from the quants at `$q`), in element order, or with `quarters`
/// quarter-interleaved (`0, 8, 16, 24, 1, 9, …`, each quarter's elements still in order, so that
/// consecutive multiply-adds go to different chains). A macro, not a closure: a closure is
/// compiled without the kernel's `#[target_feature]`s unless LLVM chooses to inline it, and at
/// eight tokens a chunk it did not (see [`super::avx512_grouped`]).
macro_rules! fields {
    (8, $q:expr, $f:ident) => {{
        let q = $q;
        $f!(0, q8::<0>(q));
        $f!(1, q8::<1>(q));
        $f!(2, q8::<2>(q));
        $f!(3, q8::<3>(q));
        $f!(4, q8::<4>(q));
        $f!(5, q8::<5>(q));
        $f!(6, q8::<6>(q));
        $f!(7, q8::<7>(q));
        $f!(8, q8::<8>(q));
        $f!(9, q8::<9>(q));
        $f!(10, q8::<10>(q));
        $f!(11, q8::<11>(q));
        $f!(12, q8::<12>(q));
        $f!(13, q8::<13>(q));
        $f!(14, q8::<14>(q));
        $f!(15, q8::<15>(q));
        $f!(16, q8::<16>(q));
        $f!(17, q8::<17>(q));
        $f!(18, q8::<18>(q));
        $f!(19, q8::<19>(q));
        $f!(20, q8::<20>(q));
        $f!(21, q8::<21>(q));
        $f!(22, q8::<22>(q));
        $f!(23, q8::<23>(q));
        $f!(24, q8::<24>(q));
        $f!(25, q8::<25>(q));
        $f!(26, q8::<26>(q));
        $f!(27, q8::<27>(q));
        $f!(28, q8::<28>(q));
        $f!(29, q8::<29>(q));
        $f!(30, q8::<30>(q));
        $f!(31, q8::<31>(q));
    }};
    (6, $w:expr, $f:ident) => {{
        let w = $w;
        $f!(0, f6::<0, 0, 0>(w));
        $f!(1, f6::<0, 6, 0>(w));
        $f!(2, f6::<0, 12, 0>(w));
        $f!(3, f6::<0, 18, 0>(w));
        $f!(4, f6::<0, 24, 0>(w));
        $f!(5, f6::<0, 30, 2>(w));
        $f!(6, f6::<1, 4, 0>(w));
        $f!(7, f6::<1, 10, 0>(w));
        $f!(8, f6::<1, 16, 0>(w));
        $f!(9, f6::<1, 22, 0>(w));
        $f!(10, f6::<1, 28, 4>(w));
        $f!(11, f6::<2, 2, 0>(w));
        $f!(12, f6::<2, 8, 0>(w));
        $f!(13, f6::<2, 14, 0>(w));
        $f!(14, f6::<2, 20, 0>(w));
        $f!(15, f6::<2, 26, 0>(w));
        $f!(16, f6::<3, 0, 0>(w));
        $f!(17, f6::<3, 6, 0>(w));
        $f!(18, f6::<3, 12, 0>(w));
        $f!(19, f6::<3, 18, 0>(w));
        $f!(20, f6::<3, 24, 0>(w));
        $f!(21, f6::<3, 30, 2>(w));
        $f!(22, f6::<4, 4, 0>(w));
        $f!(23, f6::<4, 10, 0>(w));
        $f!(24, f6::<4, 16, 0>(w));
        $f!(25, f6::<4, 22, 0>(w));
        $f!(26, f6::<4, 28, 4>(w));
        $f!(27, f6::<5, 2, 0>(w));
        $f!(28, f6::<5, 8, 0>(w));
        $f!(29, f6::<5, 14, 0>(w));
        $f!(30, f6::<5, 20, 0>(w));
        $f!(31, f6::<5, 26, 0>(w));
    }};
    (5, $w:expr, $f:ident) => {{
        let w = $w;
        $f!(0, f5::<0, 0, 0>(w));
        $f!(1, f5::<0, 5, 0>(w));
        $f!(2, f5::<0, 10, 0>(w));
        $f!(3, f5::<0, 15, 0>(w));
        $f!(4, f5::<0, 20, 0>(w));
        $f!(5, f5::<0, 25, 0>(w));
        $f!(6, f5::<0, 30, 2>(w));
        $f!(7, f5::<1, 3, 0>(w));
        $f!(8, f5::<1, 8, 0>(w));
        $f!(9, f5::<1, 13, 0>(w));
        $f!(10, f5::<1, 18, 0>(w));
        $f!(11, f5::<1, 23, 0>(w));
        $f!(12, f5::<1, 28, 4>(w));
        $f!(13, f5::<2, 1, 0>(w));
        $f!(14, f5::<2, 6, 0>(w));
        $f!(15, f5::<2, 11, 0>(w));
        $f!(16, f5::<2, 16, 0>(w));
        $f!(17, f5::<2, 21, 0>(w));
        $f!(18, f5::<2, 26, 0>(w));
        $f!(19, f5::<2, 31, 1>(w));
        $f!(20, f5::<3, 4, 0>(w));
        $f!(21, f5::<3, 9, 0>(w));
        $f!(22, f5::<3, 14, 0>(w));
        $f!(23, f5::<3, 19, 0>(w));
        $f!(24, f5::<3, 24, 0>(w));
        $f!(25, f5::<3, 29, 3>(w));
        $f!(26, f5::<4, 2, 0>(w));
        $f!(27, f5::<4, 7, 0>(w));
        $f!(28, f5::<4, 12, 0>(w));
        $f!(29, f5::<4, 17, 0>(w));
        $f!(30, f5::<4, 22, 0>(w));
        $f!(31, f5::<4, 27, 0>(w));
    }};
    (quarters 8, $q:expr, $f:ident) => {{
        let q = $q;
        $f!(0, q8::<0>(q));
        $f!(8, q8::<8>(q));
        $f!(16, q8::<16>(q));
        $f!(24, q8::<24>(q));
        $f!(1, q8::<1>(q));
        $f!(9, q8::<9>(q));
        $f!(17, q8::<17>(q));
        $f!(25, q8::<25>(q));
        $f!(2, q8::<2>(q));
        $f!(10, q8::<10>(q));
        $f!(18, q8::<18>(q));
        $f!(26, q8::<26>(q));
        $f!(3, q8::<3>(q));
        $f!(11, q8::<11>(q));
        $f!(19, q8::<19>(q));
        $f!(27, q8::<27>(q));
        $f!(4, q8::<4>(q));
        $f!(12, q8::<12>(q));
        $f!(20, q8::<20>(q));
        $f!(28, q8::<28>(q));
        $f!(5, q8::<5>(q));
        $f!(13, q8::<13>(q));
        $f!(21, q8::<21>(q));
        $f!(29, q8::<29>(q));
        $f!(6, q8::<6>(q));
        $f!(14, q8::<14>(q));
        $f!(22, q8::<22>(q));
        $f!(30, q8::<30>(q));
        $f!(7, q8::<7>(q));
        $f!(15, q8::<15>(q));
        $f!(23, q8::<23>(q));
        $f!(31, q8::<31>(q));
    }};
    (quarters 6, $w:expr, $f:ident) => {{
        let w = $w;
        $f!(0, f6::<0, 0, 0>(w));
        $f!(8, f6::<1, 16, 0>(w));
        $f!(16, f6::<3, 0, 0>(w));
        $f!(24, f6::<4, 16, 0>(w));
        $f!(1, f6::<0, 6, 0>(w));
        $f!(9, f6::<1, 22, 0>(w));
        $f!(17, f6::<3, 6, 0>(w));
        $f!(25, f6::<4, 22, 0>(w));
        $f!(2, f6::<0, 12, 0>(w));
        $f!(10, f6::<1, 28, 4>(w));
        $f!(18, f6::<3, 12, 0>(w));
        $f!(26, f6::<4, 28, 4>(w));
        $f!(3, f6::<0, 18, 0>(w));
        $f!(11, f6::<2, 2, 0>(w));
        $f!(19, f6::<3, 18, 0>(w));
        $f!(27, f6::<5, 2, 0>(w));
        $f!(4, f6::<0, 24, 0>(w));
        $f!(12, f6::<2, 8, 0>(w));
        $f!(20, f6::<3, 24, 0>(w));
        $f!(28, f6::<5, 8, 0>(w));
        $f!(5, f6::<0, 30, 2>(w));
        $f!(13, f6::<2, 14, 0>(w));
        $f!(21, f6::<3, 30, 2>(w));
        $f!(29, f6::<5, 14, 0>(w));
        $f!(6, f6::<1, 4, 0>(w));
        $f!(14, f6::<2, 20, 0>(w));
        $f!(22, f6::<4, 4, 0>(w));
        $f!(30, f6::<5, 20, 0>(w));
        $f!(7, f6::<1, 10, 0>(w));
        $f!(15, f6::<2, 26, 0>(w));
        $f!(23, f6::<4, 10, 0>(w));
        $f!(31, f6::<5, 26, 0>(w));
    }};
    (quarters 5, $w:expr, $f:ident) => {{
        let w = $w;
        $f!(0, f5::<0, 0, 0>(w));
        $f!(8, f5::<1, 8, 0>(w));
        $f!(16, f5::<2, 16, 0>(w));
        $f!(24, f5::<3, 24, 0>(w));
        $f!(1, f5::<0, 5, 0>(w));
        $f!(9, f5::<1, 13, 0>(w));
        $f!(17, f5::<2, 21, 0>(w));
        $f!(25, f5::<3, 29, 3>(w));
        $f!(2, f5::<0, 10, 0>(w));
        $f!(10, f5::<1, 18, 0>(w));
        $f!(18, f5::<2, 26, 0>(w));
        $f!(26, f5::<4, 2, 0>(w));
        $f!(3, f5::<0, 15, 0>(w));
        $f!(11, f5::<1, 23, 0>(w));
        $f!(19, f5::<2, 31, 1>(w));
        $f!(27, f5::<4, 7, 0>(w));
        $f!(4, f5::<0, 20, 0>(w));
        $f!(12, f5::<1, 28, 4>(w));
        $f!(20, f5::<3, 4, 0>(w));
        $f!(28, f5::<4, 12, 0>(w));
        $f!(5, f5::<0, 25, 0>(w));
        $f!(13, f5::<2, 1, 0>(w));
        $f!(21, f5::<3, 9, 0>(w));
        $f!(29, f5::<4, 17, 0>(w));
        $f!(6, f5::<0, 30, 2>(w));
        $f!(14, f5::<2, 6, 0>(w));
        $f!(22, f5::<3, 14, 0>(w));
        $f!(30, f5::<4, 22, 0>(w));
        $f!(7, f5::<1, 3, 0>(w));
        $f!(15, f5::<2, 11, 0>(w));
        $f!(23, f5::<3, 19, 0>(w));
        $f!(31, f5::<4, 27, 0>(w));
    }};
}
pub(crate) use fields;

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
        QuantKind::Q4_0
            | QuantKind::Q4_1
            | QuantKind::Q5_0
            | QuantKind::Q5_1
            | QuantKind::Q8_0
            | QuantKind::Q4_K
            | QuantKind::Q6_K
    )
}

/// Elements per stored block: 32, or the K formats' super-block of 256.
pub(crate) const fn elems(kind: QuantKind) -> usize {
    if matches!(kind, QuantKind::Q4_K | QuantKind::Q6_K) {
        K4_SUB * BLOCK
    } else {
        BLOCK
    }
}

/// Q4_K's sub-blocks per super-block.
pub(crate) const K4_SUB: usize = 8;
/// Offsets in a Q4_K group super-block: the 16 `d`s, the 16 `dmin`s (f16), the 6-bit sub-block
/// scales and mins as bytes (sub-block `j`'s 16 rows at `16j`), then each sub-block's quants as
/// four 4-bit words per lane (as Q4_1's block).
pub(crate) const K4_DMIN: usize = 2 * GROUP;
pub(crate) const K4_SCALES: usize = 4 * GROUP;
pub(crate) const K4_MINS: usize = K4_SCALES + K4_SUB * GROUP;
pub(crate) const K4_QUANTS: usize = K4_MINS + K4_SUB * GROUP;
/// Bytes of one Q4_K sub-block's quants in a group (four 64-byte words).
pub(crate) const K4_SUB_BYTES: usize = 4 * 4 * GROUP;

/// Q6_K's sub-blocks (of 16 elements, one 8-bit signed scale each) per super-block.
pub(crate) const K6_SUB: usize = 16;
/// Offsets in a Q6_K group super-block: the 16 `d`s (f16), the sub-block scales as bytes
/// (sub-block `j`'s 16 rows at `16j`), then the 6-bit quants: each lane a stream of 256 6-bit
/// fields, element `e` at bit `6e`, so each sub-block is three 32-bit words per lane (three
/// 64-byte vectors) and two of its 16 fields cross from one word into the next.
pub(crate) const K6_SCALES: usize = 2 * GROUP;
pub(crate) const K6_QUANTS: usize = K6_SCALES + K6_SUB * GROUP;
/// Bytes of a pair of Q6_K sub-blocks' quants in a group (six 64-byte words): the 32 elements
/// that one pass of the kernel takes.
pub(crate) const K6_PAIR_BYTES: usize = 6 * 4 * GROUP;

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
    if matches!(kind, QuantKind::Q4_K) {
        K4_QUANTS + K4_SUB * K4_SUB_BYTES
    } else if matches!(kind, QuantKind::Q6_K) {
        K6_QUANTS + K6_SUB / 2 * K6_PAIR_BYTES
    } else {
        quants_at(kind) + bits(kind) * 4 * GROUP
    }
}

/// Bytes of one group block of `kind` in `layout`.
pub(crate) const fn block_bytes(kind: QuantKind, layout: Layout) -> usize {
    if halves_bytes(kind, layout) {
        HALVES_BLOCK_BYTES
    } else {
        group_block_bytes(kind)
    }
}

/// Zeroed bytes after the last group, never part of a value: the AVX-512 and AVX2 kernels read
/// each 4-bit quant word at byte offsets 0–3 as well (so that a byte's low nibble needs no
/// shift), and the last word's reads at offsets 1–3 end up to 3 bytes past it.
pub(crate) const READ_SLACK: usize = 64;

/// How a group block's quants lie in its lanes, and which chain its kernels follow.
///
/// **Why a second layout.** In [`Layout::Streams`] a Q5_0 field is two shifts from its value
/// (to the top of the lane and back down, four of 32 fields spliced from two words), and on AVX2
/// that ran at 9.2 GiB/s a core where Q8_0 ran 23 (one core of the 2-vCPU AMD EPYC, Zen 3,
/// `cargo bench --bench kernels -- 'gemv/Q5_0-grouped/4864x896/avx2$'`): Qwen2.5-Coder-0.5B's
/// Q5_0 gate and up projections took 44% of its decode step, at half the memory's speed. In
/// [`Layout::Halves`] every field is one mask from 2^p times its value, p one of three (Q5_0)
/// or four (the 4-bit formats), against activations divided by 2^p ([`super::avx2_halves`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// Each lane a stream of `bits`-wide fields (the module doc); every format, and what the
    /// AVX-512 kernels read.
    Streams,
    /// Q4_0, Q4_1, Q4_K and Q5_0 on CPUs whose best kernels are AVX2's, read from the 16-bit
    /// halves of each lane (a word loaded at byte offsets 0 and 2), with the halves chain of the
    /// module doc. The 4-bit formats keep the streams bytes: each 16-bit half holds four
    /// nibbles, elements `8w + 4k .. 8w + 4k + 4` of word `w` in half `k`. Q5_0's lanes hold
    /// three unsigned 5-bit fields in each 16-bit half (bits 0, 5, 10 and 16, 21, 26), elements
    /// `6w .. 6w + 6` in word `w` (five 64-byte vectors after the 16 `d`s), and elements 30 and
    /// 31 of row `r` in one 32-byte vector shared by the two halves of the group: row `r < 8` in
    /// lane `r`'s low 16 bits, row `r + 8` in its high 16. 24 bytes a row and block against
    /// ggml's 22.
    Halves,
    /// Q5_0 for the integer kernels ([`super::grouped_i16`], AVX512-VNNI), whose byte lanes take
    /// a 4-bit quant with one mask: the nibbles lie as a Q4_0 block's streams (four 64-byte
    /// vectors after the 16 `d`s), then one 64-byte plane holds the fifth bits, qword `v = 2w +
    /// p` of it bit `4r + j` for row `r`'s element `8w + 2j + p`: the 64 bits of the byte lanes
    /// into which the kernel unpacks nibble vector `v`, so one mask load and one masked add put
    /// every fifth bit in place. The same 22 bytes a row and block as ggml's. Chosen only where
    /// those kernels take the weights ([`Layout::native`]); the exact kernels read it only
    /// through tile dequantization (prefill-sized int24 calls).
    Planes,
}

impl Layout {
    /// The layout that the kernels of `level` read fastest for `kind`; `integer` where the
    /// weights serve [`super::grouped_i16`]'s kernels (an int16 or int24 engine on a CPU that
    /// has them: Q5_0 in [`Layout::Planes`]).
    pub fn native(kind: QuantKind, level: super::Level, integer: bool) -> Layout {
        if planes_kind(kind) && integer && level >= super::Level::Avx512 {
            Layout::Planes
        } else if halves_kind(kind) && level == super::Level::Avx2 {
            Layout::Halves
        } else {
            Layout::Streams
        }
    }
}

/// Whether `kind` can be grouped in [`Layout::Planes`].
pub(crate) const fn planes_kind(kind: QuantKind) -> bool {
    matches!(kind, QuantKind::Q5_0)
}

/// Where a [`Layout::Planes`] block's plane of fifth bits starts: after the `d`s and four
/// vectors of nibbles.
pub(crate) const PLANE_AT: usize = 2 * GROUP + 4 * 4 * GROUP;

/// Row `r`'s element `e` in a [`Layout::Planes`] block: the byte offset and shift of its
/// nibble (a Q4_0 stream's), and the bit of the plane that holds its fifth bit.
const fn planes_field_at(r: usize, e: usize) -> (usize, usize, usize) {
    let (w, k) = (e / 8, e % 8);
    let nibble_at = 2 * GROUP + w * 4 * GROUP + 4 * r;
    let plane_bit = 64 * (2 * w + k % 2) + 4 * r + k / 2;
    (nibble_at, 4 * k, plane_bit)
}

/// Row `r`'s element `e` of a [`Layout::Planes`] block: its unsigned 5-bit quant.
pub(crate) fn planes_quant(blk: &[u8], r: usize, e: usize) -> u32 {
    let (at, shift, bit) = planes_field_at(r, e);
    let nibble = word_at(blk, at) >> shift & 0x0f;
    let fifth = u32::from(blk[PLANE_AT + bit / 8] >> (bit % 8) & 1);
    nibble | fifth << 4
}

/// Whether `kind` can be grouped in [`Layout::Halves`].
pub(crate) const fn halves_kind(kind: QuantKind) -> bool {
    matches!(
        kind,
        QuantKind::Q4_0 | QuantKind::Q4_1 | QuantKind::Q4_K | QuantKind::Q5_0
    )
}

/// Whether a group block of `kind` in `layout` has [`Layout::Halves`]'s own bytes (Q5_0's; the
/// 4-bit formats keep the streams bytes).
const fn halves_bytes(kind: QuantKind, layout: Layout) -> bool {
    matches!(layout, Layout::Halves) && matches!(kind, QuantKind::Q5_0)
}

/// Bytes of one [`Layout::Halves`] group block: the 16 `d`s, five 64-byte words and the shared
/// 32-byte one.
pub(crate) const HALVES_BLOCK_BYTES: usize = 2 * GROUP + HALVES_WORDS * 4 * GROUP + 2 * GROUP;
/// Full 64-byte words of a [`Layout::Halves`] block (six fields a lane each).
pub(crate) const HALVES_WORDS: usize = 5;
/// Where a [`Layout::Halves`] block's quants start (after the `d`s).
pub(crate) const HALVES_QUANTS: usize = 2 * GROUP;

/// Where row `r`'s element `e` lies in a [`Layout::Halves`] block: the byte offset of its lane's
/// word and its shift there.
pub(crate) const fn halves_field_at(r: usize, e: usize) -> (usize, usize) {
    if e < 6 * HALVES_WORDS {
        let shift = 5 * (e % 6 % 3) + 16 * (e % 6 / 3);
        (HALVES_QUANTS + (e / 6) * 4 * GROUP + 4 * r, shift)
    } else {
        let at = HALVES_QUANTS + HALVES_WORDS * 4 * GROUP + 4 * (r % 8);
        (at, 5 * (e - 6 * HALVES_WORDS) + 16 * (r / 8))
    }
}

/// The place value of element `e`'s field of `kind` in [`Layout::Halves`] once its lane (read at
/// byte offset 0 or 2 of its word, [`super::avx2_halves`]) is masked: `2^halves_place(e)` times
/// the quant (`e` within its 32-element block).
pub(crate) const fn halves_place(kind: QuantKind, e: usize) -> u32 {
    if matches!(kind, QuantKind::Q5_0) {
        5 * (e % 6 % 3) as u32
    } else {
        4 * (e % 4) as u32
    }
}

/// Weights of a block format regrouped for the grouped kernels (see the module doc).
pub struct Grouped {
    pub kind: QuantKind,
    /// How the quants lie in the lanes ([`Layout::Halves`] only for [`halves_kind`]s).
    pub layout: Layout,
    /// Rows of the matrix (the last group is padded to [`GROUP`] rows with zero blocks).
    pub rows: usize,
    pub cols: usize,
    /// The groups, then [`READ_SLACK`] zeroed bytes.
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

/// Row `r`'s element `e` (of 256) of a Q4_K group super-block: the byte offset of its word and
/// its shift.
fn k4_field_at(r: usize, e: usize) -> (usize, usize) {
    let (j, l) = (e / BLOCK, e % BLOCK);
    (
        K4_QUANTS + j * K4_SUB_BYTES + (l / 8) * 4 * GROUP + 4 * r,
        4 * (l % 8),
    )
}

/// Row `r`'s element `e` of a Q4_K group super-block (its 4-bit quant).
fn k4_quant(blk: &[u8], r: usize, e: usize) -> u32 {
    let (at, shift) = k4_field_at(r, e);
    word_at(blk, at) >> shift & 0x0f
}

/// Element `e`'s unsigned 6-bit quant in a ggml Q6_K block (its value is `q − 32`): the low
/// 4 bits from a nibble of `ql`, the top 2 from a 2-bit field of `qh` (see the format's
/// dequantization).
fn ggml_q6(src: &[u8], e: usize) -> u32 {
    let (sub, l) = (e / 16, e % 16);
    let (half, quarter, part) = (sub / 8, (sub % 8) / 2, sub % 2);
    let low = src[half * 64 + (quarter % 2) * 32 + part * 16 + l] >> (4 * (quarter / 2)) & 0x0f;
    let high = src[128 + half * 32 + part * 16 + l] >> (2 * quarter) & 0x03;
    u32::from(low | high << 4)
}

/// Row `r`'s element `e` of a Q6_K group super-block (its unsigned 6-bit quant).
fn k6_quant(blk: &[u8], r: usize, e: usize) -> u32 {
    let bit = 6 * e;
    let at = K6_QUANTS + (bit / 32) * 4 * GROUP + 4 * r;
    let mut v = word_at(blk, at) >> (bit % 32);
    if bit % 32 > 26 {
        v |= word_at(blk, at + 4 * GROUP) << (32 - bit % 32);
    }
    v & 0x3f
}

/// Lane `r`'s field `e` of a group block in `layout` (not Q8_0 or the K formats).
fn field(kind: QuantKind, layout: Layout, blk: &[u8], r: usize, e: usize) -> u32 {
    if layout == Layout::Planes {
        return planes_quant(blk, r, e);
    }
    if halves_bytes(kind, layout) {
        let (at, shift) = halves_field_at(r, e);
        return word_at(blk, at) >> shift & 0x1f;
    }
    let (at, shift) = field_at(kind, r, e);
    let mut v = word_at(blk, at) >> shift;
    if shift + bits(kind) > 32 {
        v |= word_at(blk, at + 4 * GROUP) << (32 - shift);
    }
    v & ((1 << bits(kind)) - 1)
}

/// The f16 at `p[2i..2i+2]`.
fn f16_at(p: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([p[2 * i], p[2 * i + 1]]).to_f32()
}

impl Grouped {
    /// Regroups `rows` rows of `cols` columns of ggml blocks (`kind` must be [`groupable`]; the
    /// shape checked by the caller), into `arena`, in the layout that this CPU's kernels read
    /// fastest ([`Layout::native`]; `integer` where the weights serve the integer kernels).
    pub fn new(
        kind: QuantKind,
        (rows, cols): (usize, usize),
        blocks: &[u8],
        integer: bool,
        arena: &mut WeightArena,
    ) -> Grouped {
        let layout = Layout::native(kind, super::simd::level(), integer);
        Grouped::with_layout(kind, layout, rows, cols, blocks, arena)
    }

    /// [`Grouped::new`] in `layout` ([`Layout::Halves`] only for [`halves_kind`]s,
    /// [`Layout::Planes`] only for [`planes_kind`]s).
    pub fn with_layout(
        kind: QuantKind,
        layout: Layout,
        rows: usize,
        cols: usize,
        blocks: &[u8],
        arena: &mut WeightArena,
    ) -> Grouped {
        assert!(groupable(kind), "{} cannot be grouped", kind.name());
        assert!(
            match layout {
                Layout::Streams => true,
                Layout::Halves => halves_kind(kind),
                Layout::Planes => planes_kind(kind),
            },
            "{} in the {layout:?} layout",
            kind.name()
        );
        let nb = cols / elems(kind);
        let (gb, bb) = (kind.block_bytes(), block_bytes(kind, layout));
        let groups = rows.div_ceil(GROUP);
        let bytes = arena.filled::<u8>(groups * nb * bb + READ_SLACK, |bytes| {
            for n in 0..rows {
                let (g, r) = (n / GROUP, n % GROUP);
                for b in 0..nb {
                    let src = &blocks[(n * nb + b) * gb..(n * nb + b + 1) * gb];
                    let dst = &mut bytes[(g * nb + b) * bb..(g * nb + b + 1) * bb];
                    if kind == QuantKind::Q6_K {
                        dst[2 * r..2 * r + 2].copy_from_slice(&src[208..210]);
                        for j in 0..K6_SUB {
                            dst[K6_SCALES + GROUP * j + r] = src[192 + j];
                        }
                        for e in 0..elems(kind) {
                            let bit = 6 * e;
                            let at = K6_QUANTS + (bit / 32) * 4 * GROUP + 4 * r;
                            // The field's bits, spilling into the next word's bytes where it
                            // crosses.
                            let spread = u64::from(ggml_q6(src, e)) << (bit % 32);
                            for i in 0..4 {
                                dst[at + i] |= (spread >> (8 * i)) as u8;
                            }
                            if bit % 32 > 26 {
                                dst[at + 4 * GROUP] |= (spread >> 32) as u8;
                            }
                        }
                        continue;
                    }
                    dst[2 * r..2 * r + 2].copy_from_slice(&src[0..2]);
                    if kind == QuantKind::Q4_K {
                        dst[K4_DMIN + 2 * r..K4_DMIN + 2 * r + 2].copy_from_slice(&src[2..4]);
                        let sm = quant::scales_mins_k4(src[4..16].try_into().expect("12 bytes"));
                        for j in 0..K4_SUB {
                            dst[K4_SCALES + GROUP * j + r] = sm[j];
                            dst[K4_MINS + GROUP * j + r] = sm[K4_SUB + j];
                        }
                        for e in 0..elems(kind) {
                            let (j, l) = (e / BLOCK, e % BLOCK);
                            let byte = src[16 + 32 * (j / 2) + l];
                            let q = (byte >> (4 * (j % 2))) & 0x0f;
                            let (at, shift) = k4_field_at(r, e);
                            dst[at + shift / 8] |= q << (shift % 8);
                        }
                        continue;
                    }
                    if has_min(kind) {
                        dst[2 * GROUP + 2 * r..2 * GROUP + 2 * r + 2].copy_from_slice(&src[2..4]);
                    }
                    if kind == QuantKind::Q8_0 {
                        for e in 0..BLOCK {
                            dst[q8_at(r, e)] = src[ggml_quants_at(kind) + e];
                        }
                        continue;
                    }
                    if layout == Layout::Planes {
                        for e in 0..BLOCK {
                            let (at, shift, bit) = planes_field_at(r, e);
                            let q = ggml_quant(kind, src, e);
                            dst[at + shift / 8] |= ((q & 0x0f) << (shift % 8)) as u8;
                            dst[PLANE_AT + bit / 8] |= ((q >> 4) << (bit % 8)) as u8;
                        }
                        continue;
                    }
                    if halves_bytes(kind, layout) {
                        for e in 0..BLOCK {
                            let (at, shift) = halves_field_at(r, e);
                            let q = ggml_quant(kind, src, e) << shift;
                            for (i, byte) in q.to_le_bytes().into_iter().enumerate() {
                                dst[at + i] |= byte;
                            }
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
            layout,
            rows,
            cols,
            bytes,
        }
    }

    /// Bytes of one group block.
    pub(crate) fn block_bytes(&self) -> usize {
        block_bytes(self.kind, self.layout)
    }

    /// Bytes of one group (every block of its 16 rows).
    pub(crate) fn group_bytes(&self) -> usize {
        self.cols / elems(self.kind) * self.block_bytes()
    }

    /// Whether the kernels multiply block sums of the activations: a min, Q4_K's, or
    /// [`Layout::Halves`]'s unsigned Q4_0 and Q5_0 fields (whose `−8` and `−16` are `−8·d` and
    /// `−16·d` times the block sum).
    pub(crate) fn takes_sums(&self) -> bool {
        takes_sums(self.kind) || self.layout == Layout::Halves
    }

    /// Group `g`'s block `b`.
    fn group_block(&self, g: usize, b: usize) -> &[u8] {
        let (nb, bb) = (self.cols / elems(self.kind), self.block_bytes());
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
                let q = field(kind, self.layout, src, r, e);
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

    /// Row `n` dequantized as ggml does (an embedding lookup, and prefill tiles at the scalar
    /// level).
    pub fn row_f32(&self, n: usize, dst: &mut [f32]) {
        assert!(n < self.rows, "row {n} of a matrix of {} rows", self.rows);
        if self.kind == QuantKind::Q4_K {
            // ggml's `d·sc · q − dmin·m` per sub-block, the same operations in the same order.
            let (g, r) = (n / GROUP, n % GROUP);
            for (b, out) in dst.chunks_exact_mut(elems(self.kind)).enumerate() {
                let blk = self.group_block(g, b);
                let (d, dmin) = (f16_at(blk, r), f16_at(&blk[K4_DMIN..], r));
                for (e, o) in out.iter_mut().enumerate() {
                    let j = e / BLOCK;
                    let d1 = d * blk[K4_SCALES + GROUP * j + r] as f32;
                    let m1 = dmin * blk[K4_MINS + GROUP * j + r] as f32;
                    *o = d1 * k4_quant(blk, r, e) as f32 - m1;
                }
            }
            return;
        }
        if self.kind == QuantKind::Q6_K {
            // ggml's `d·sc · (q − 32)` per sub-block of 16, the same operations.
            let (g, r) = (n / GROUP, n % GROUP);
            for (b, out) in dst.chunks_exact_mut(elems(self.kind)).enumerate() {
                let blk = self.group_block(g, b);
                let d = f16_at(blk, r);
                for (e, o) in out.iter_mut().enumerate() {
                    let dl = d * (blk[K6_SCALES + GROUP * (e / 16) + r] as i8) as f32;
                    *o = dl * (k6_quant(blk, r, e) as i32 - 32) as f32;
                }
            }
            return;
        }
        quant::dequantize_row(self.kind, &self.ggml_row(n), dst);
    }

    /// Whether the bytes fit the shape.
    pub fn check(&self) -> Result<(), String> {
        let n = elems(self.kind);
        let want = self.rows.div_ceil(GROUP) * (self.cols / n) * self.block_bytes() + READ_SLACK;
        if !self.cols.is_multiple_of(n) || self.bytes.len() != want {
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

/// The sums of each block of `x` (whole blocks), each as [`super::block_sum`] folds it: what
/// formats with a min multiply by `m`.
#[cfg(test)]
pub(crate) fn block_sums(x: &[f32]) -> Vec<f32> {
    block_sums_iter(x).collect()
}

/// [`block_sums`], one block at a time.
fn block_sums_iter(x: &[f32]) -> impl Iterator<Item = f32> + '_ {
    x.chunks_exact(BLOCK).map(super::block_sum)
}

/// [`block_sums`] of each token row in turn, in one buffer (token `t`'s at `t·cols/32`).
pub(crate) fn token_block_sums<'a>(rows: impl IntoIterator<Item = &'a [f32]>) -> Vec<f32> {
    rows.into_iter().flat_map(block_sums_iter).collect()
}

/// The block sums that grouped weights of `kind` multiply, every token of `job`'s (empty
/// without a min): the call's, or computed here where the call did not compute them.
///
/// # Safety
/// `job`'s input must be valid for reads of `job.k` values per token.
pub(crate) unsafe fn job_sums<'a>(w: &Grouped, job: &'a Job) -> Cow<'a, [f32]> {
    let blocks = job.k / BLOCK;
    match job.sums {
        _ if !w.takes_sums() => Cow::Borrowed(&[]),
        Some(s) if s.len() >= job.tokens * blocks => Cow::Borrowed(s),
        _ => Cow::Owned(token_block_sums((0..job.tokens).map(|t| job.xrow(t)))),
    }
}

/// How far ahead of the block being read a group pass prefetches: the same block of the next
/// group where groups are short (SmolLM2's 576 and Qwen2.5's 896 columns: 5–10 KiB a group), at
/// most [`PREFETCH_SPAN`] where they are long (Qwen2.5's down projection, 4,864 columns: 44 KiB
/// a Q4_K group, 64 KiB a Q6_K one), so that what is prefetched is still in L1 when it is read.
#[inline(always)]
pub(crate) fn prefetch_distance(group_bytes: usize) -> usize {
    group_bytes.min(PREFETCH_SPAN)
}

/// One group's share of a call's rows, as the AVX2 kernels walk them.
#[cfg(target_arch = "x86_64")]
pub(crate) struct GroupSpan {
    /// The group's first row.
    pub(crate) n0: usize,
    /// The call's rows within the group, `lo..hi` of its 16.
    pub(crate) lo: usize,
    pub(crate) hi: usize,
    /// The group's bytes.
    pub(crate) base: *const u8,
    /// Where its first pass prefetches from, [`prefetch_distance`] ahead (null: nothing, at the
    /// last group of a call when the distance reaches past it).
    pub(crate) ahead: *const u8,
}

/// The groups of `w` that `rows` touch, in order. Only addresses are formed past the weights'
/// end, never dereferenced.
#[cfg(target_arch = "x86_64")]
pub(crate) fn group_spans(
    w: &Grouped,
    rows: std::ops::Range<usize>,
) -> impl Iterator<Item = GroupSpan> + '_ {
    spans_of(w.bytes.as_ptr(), w.group_bytes(), rows)
}

/// [`group_spans`] over any weights of [`GROUP`]-row groups, group `g` at `bytes + g · gb` (the
/// int8 kernels' interleaved groups too).
#[cfg(target_arch = "x86_64")]
pub(crate) fn spans_of(
    bytes: *const u8,
    gb: usize,
    rows: std::ops::Range<usize>,
) -> impl Iterator<Item = GroupSpan> {
    let distance = prefetch_distance(gb);
    let (g0, g1) = (rows.start / GROUP, rows.end.div_ceil(GROUP));
    (g0..g1).map(move |g| {
        let n0 = g * GROUP;
        let base = bytes.wrapping_add(g * gb);
        GroupSpan {
            n0,
            lo: rows.start.max(n0) - n0,
            hi: rows.end.min(n0 + GROUP) - n0,
            base,
            ahead: if g + 1 < g1 || distance < gb {
                base.wrapping_add(distance)
            } else {
                std::ptr::null()
            },
        }
    })
}

/// The farthest a group pass prefetches ahead.
const PREFETCH_SPAN: usize = 12 << 10;

/// What a pass prefetches for its block at `offset`: `ahead` moved on by `offset`, or null
/// (nothing) where `ahead` is null, which moving would make a real-looking address.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn block_ahead(ahead: *const u8, offset: usize) -> *const u8 {
    if ahead.is_null() {
        ahead
    } else {
        ahead.wrapping_add(offset)
    }
}

/// Part `i` of `parts` of the `bytes` bytes at `next` (nothing where `next` is null) asked into
/// the cache: a K super-block's next-group bytes spread over its sub-blocks, so that a burst of
/// forty-odd prefetches does not wait on the line fill buffers ahead of the loads that matter.
/// Every part is the same whole number of lines (the last runs past `bytes` into what is
/// prefetched next anyway), so that with `bytes` and `parts` constants the lines are constant
/// offsets: computing each part's first and last line at run time had cost the AVX-512 Q4_K
/// kernel about 10% (12.4 → 13.6 GiB/s on one core of an Intel Xeon, family 6 model 207,
/// `cargo bench --bench kernels -- 'gemv/Q4_K-grouped'`). Into L2 or L1 as the process's
/// [`super::prefetch::policy`] says (L2 on Intel CPUs, where it ran Q8_0 and Q4_K_M decode
/// 12–24% faster).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn prefetch_part(next: *const u8, bytes: usize, i: usize, parts: usize) {
    if next.is_null() {
        return;
    }
    let to_l2 = super::prefetch::policy().to_l2;
    let (first, per) = part_lines(next, bytes, i, parts);
    for line in 0..per {
        super::prefetch::line(first.wrapping_add(64 * line), to_l2);
    }
}

/// Where part `i` of `parts` of the `bytes` bytes at `next` starts (null where `next` is) and
/// how many lines it has, as [`prefetch_part`] asks for them.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn part_lines(
    next: *const u8,
    bytes: usize,
    i: usize,
    parts: usize,
) -> (*const u8, usize) {
    let per = bytes.div_ceil(64).div_ceil(parts);
    (block_ahead(next, 64 * per * i), per)
}

/// Whether grouped weights of `kind` multiply block sums of the activations (a min).
pub(crate) const fn takes_sums(kind: QuantKind) -> bool {
    super::int8::has_min(kind) || matches!(kind, QuantKind::Q4_K)
}

/// Output `n` for the activation row `x` (with its [`block_sums`]): the block chain of the
/// module doc, in scalar Rust.
#[cfg(test)]
fn dot_ref(w: &Grouped, n: usize, x: &[f32], sums: &[f32]) -> f32 {
    let (g, r) = (n / GROUP, n % GROUP);
    if w.kind == QuantKind::Q4_K {
        return dot_ref_k4(w, g, r, x, sums);
    }
    if w.layout == Layout::Halves {
        return dot_ref_halves(w, g, r, x, sums);
    }
    if w.kind == QuantKind::Q6_K {
        return dot_ref_k6(w, g, r, x);
    }
    let off = value_offset(w.kind);
    let mut acc = 0f32;
    for b in 0..w.cols / BLOCK {
        let blk = w.group_block(g, b);
        let xb = &x[b * BLOCK..(b + 1) * BLOCK];
        let q = |e: usize| {
            if w.kind == QuantKind::Q8_0 {
                blk[q8_at(r, e)] as i8 as f32
            } else {
                (field(w.kind, w.layout, blk, r, e) as i32 + off) as f32
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

/// The halves chain's `(p_0 + p_1) + (p_2 + p_3)` of one block's 32 unsigned quants `q(e)`
/// against `x`: `p_i = Σ_{e ≡ i mod 4} q_e·x_e` in element order.
#[cfg(test)]
fn halves_sum(q: impl Fn(usize) -> u32, x: &[f32]) -> f32 {
    let mut p = [0f32; 4];
    for (e, &xe) in x.iter().enumerate().take(BLOCK) {
        p[e % 4] = (q(e) as f32).mul_add(xe, p[e % 4]);
    }
    (p[0] + p[1]) + (p[2] + p[3])
}

/// [`dot_ref`] for Q4_0, Q4_1 and Q5_0 in [`Layout::Halves`]: per block [`halves_sum`], then
/// `acc ← fma(d, s, acc)` and `acc ← fma(m, Σx_block, acc)`, `m` Q4_1's min, `−8·d` (Q4_0) or
/// `−16·d` (Q5_0).
#[cfg(test)]
fn dot_ref_halves(w: &Grouped, g: usize, r: usize, x: &[f32], sums: &[f32]) -> f32 {
    let mut acc = 0f32;
    for b in 0..w.cols / BLOCK {
        let blk = w.group_block(g, b);
        let s = halves_sum(|e| field(w.kind, w.layout, blk, r, e), &x[b * BLOCK..]);
        let d = f16_at(blk, r);
        let m = match w.kind {
            QuantKind::Q4_1 => f16_at(&blk[2 * GROUP..], r),
            k => value_offset(k) as f32 * d,
        };
        acc = d.mul_add(s, acc);
        acc = m.mul_add(sums[b], acc);
    }
    acc
}

/// [`dot_ref`] for Q4_K: per sub-block `j`, the quarters' sums as a legacy block's (in
/// [`Layout::Halves`], [`halves_sum`]), then
/// `acc ← fma(d·sc_j, s, acc)` and `acc ← fma(−dmin·m_j, Σx_j, acc)`.
#[cfg(test)]
fn dot_ref_k4(w: &Grouped, g: usize, r: usize, x: &[f32], sums: &[f32]) -> f32 {
    let n = elems(w.kind);
    let mut acc = 0f32;
    for b in 0..w.cols / n {
        let blk = w.group_block(g, b);
        let (d, dmin) = (f16_at(blk, r), f16_at(&blk[K4_DMIN..], r));
        for j in 0..K4_SUB {
            let base = b * n + j * BLOCK;
            let q = |e: usize| k4_quant(blk, r, j * BLOCK + e) as f32;
            let quarter =
                |i: usize| (8 * i..8 * i + 8).fold(0f32, |p, e| q(e).mul_add(x[base + e], p));
            let s = if w.layout == Layout::Halves {
                halves_sum(|e| k4_quant(blk, r, j * BLOCK + e), &x[base..])
            } else {
                (quarter(0) + quarter(1)) + (quarter(2) + quarter(3))
            };
            let d1 = d * blk[K4_SCALES + GROUP * j + r] as f32;
            let m1 = dmin * blk[K4_MINS + GROUP * j + r] as f32;
            acc = d1.mul_add(s, acc);
            acc = (-m1).mul_add(sums[b * K4_SUB + j], acc);
        }
    }
    acc
}

/// [`dot_ref`] for Q6_K: per pair of sub-blocks (32 elements), the quarters' sums of
/// `(q − 32)·x`, then `acc ← fma(d·sc_a, p_0 + p_1, acc)` and
/// `acc ← fma(d·sc_b, p_2 + p_3, acc)`.
#[cfg(test)]
fn dot_ref_k6(w: &Grouped, g: usize, r: usize, x: &[f32]) -> f32 {
    let n = elems(w.kind);
    let mut acc = 0f32;
    for b in 0..w.cols / n {
        let blk = w.group_block(g, b);
        let d = f16_at(blk, r);
        for pair in 0..K6_SUB / 2 {
            let base = 32 * pair;
            let q = |e: usize| (k6_quant(blk, r, base + e) as i32 - 32) as f32;
            let quarter = |i: usize| {
                (8 * i..8 * i + 8).fold(0f32, |p, e| q(e).mul_add(x[b * n + base + e], p))
            };
            let dl = |j: usize| d * (blk[K6_SCALES + GROUP * j + r] as i8) as f32;
            acc = dl(2 * pair).mul_add(quarter(0) + quarter(1), acc);
            acc = dl(2 * pair + 1).mul_add(quarter(2) + quarter(3), acc);
        }
    }
    acc
}

/// Every output of `job` over grouped `w`, in scalar Rust: the reference the SIMD kernels are
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

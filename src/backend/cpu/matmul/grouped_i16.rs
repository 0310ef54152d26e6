//! [`Numerics::Int16`](super::Numerics::Int16) on grouped Q4_0, Q4_1, Q5_0, Q8_0 and Q4_K
//! weights ([`super::grouped`]'s streams layout, the exact kernels' bytes; Q5_0 in
//! [`Layout::Planes`], its nibbles as Q4_0's and its fifth bits apart): the activations rounded to
//! 16-bit integers as [`super::int16`] rounds them, and each block's integer sums taken by
//! AVX512-VNNI's 8-bit `vpdpbusd` ([`super::avx512_grouped_i16`]), the 16 output rows in the 16
//! lanes of every vector.
//!
//! **Why.** The exact grouped kernel spends per 16 rows × 32 elements 32 table lookups, 16
//! shifts and 32 FMAs (one per 16 products), and on the 2-vCPU Intel Xeon (family 6 model 167)
//! that bound the demo model's decode at about 20 GiB/s a core, short of the memory's speed.
//! Integer products need no conversion of the quants: a 4-bit quant is already a byte lane once
//! masked, and `vpdpbusd` does 64 products an instruction.
//!
//! **Products.** A 16-bit activation `q` is `256·h + l` with `h = q >> 8` a signed byte and `l =
//! q & 255` an unsigned one. Per block and token, 16 `vpdpbusd` (eight with the broadcast `l`s as
//! the unsigned side and the quants as the signed one, eight with the quants unsigned against the
//! broadcast `h`s) give `Σ w·l` and `Σ w·h`, and `256·Σ w·h + Σ w·l = Σ w·q` exactly (at most
//! 128·32768·32 in magnitude, far inside 32 bits). Q4_0's `−8` and Q5_0's `−16` are taken back
//! in integers (`−8·Σq`, `−16·Σq`), and so is the 128 that Q8_0's signed quants carry as the
//! unsigned side against the high bytes (`−128·Σh`). The 4-bit words are read as stored: byte
//! `j` of lane `r` of word `w` holds row `r`'s elements `8w + 2j` (low nibble) and `8w + 2j + 1`
//! (high), so a mask gives the even elements and a shift and a mask the odd ones, and the
//! activations' bytes are laid out in that order once per call ([`Split`]); Q5_0's fifth bits
//! are one masked add of 16 per vector of such bytes, its plane's 64 bits the mask; Q8_0's
//! element-major bytes are gathered into that order by byte permutes.
//!
//! **Bits.** Each (row, token) output is one chain over the blocks in order: the block's exact
//! integer sum `S`, then `acc ← fma(float(S), d_w·d_x, acc)` and, for Q4_1,
//! `acc ← fma(m_w, Σx_block, acc)` with the unrounded block sum as the other int16 kernels take
//! it. Q4_K's 32-element sub-blocks are taken as Q4_1 blocks of the activations' blocks
//! (sub-block `j` of super-block `b` is block `8b + j`): `acc ← fma(float(S), (d·sc_j)·d_x, acc)`,
//! then `acc ← fma(−dmin·m_j, Σx_block, acc)`, with `d·sc_j` and `dmin·m_j` the products of the
//! f16 scales and 6-bit factors in f32 (exact), as the exact kernels take them. The integer sum
//! is the same whatever the order of its products, so [`rows_ref`], that
//! chain in scalar Rust, is what the kernel is tested against bit for bit, and what runs where
//! the kernel cannot (a level forced below AVX-512): an int16 result never depends on the level.
//!
//! **24 bits.** [`Numerics::Int24`](super::Numerics::Int24) rounds each activation to a 24-bit
//! integer instead (`d = max|x| / 8388607`: at most 2⁻²⁴ of the block's largest magnitude per
//! element, the size of one f32 rounding of it) and cuts it into three bytes, `q = 65536·h +
//! 256·m + l` (`h` signed, `m` and `l` unsigned): per block and token eight more `vpdpbusd` (the
//! quants against the `m`s). `Σ w·q` no longer fits 32 bits, so the block's sum is joined in f32:
//! `S = fma(float(Σ w·h), 65536, float(256·Σ w·m + Σ w·l))`, both integer sums exact. Its error
//! against the f32 products of the exact path is of the size of their own rounding, so it keeps
//! to the reference bounds the exact path is tested against. It runs in calls of up to 16
//! tokens, where it is faster than the exact kernels (README); where this kernel does not run
//! (no AVX512-VNNI, a level forced lower, larger calls, other formats) int24 runs the exact
//! kernels, not the scalar chain, which would be far slower.

use std::cell::RefCell;

use half::f16;

use super::grouped::{
    elems, group_block_bytes, planes_quant, quants_at, value_offset, Grouped, Layout, BLOCK, GROUP,
    K4_DMIN, K4_MINS, K4_QUANTS, K4_SCALES, K4_SUB, K4_SUB_BYTES,
};
use super::int16::XI16;
use super::Job;
use crate::model::quant::QuantKind;

/// How many bits a [`Split`]'s integers have.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Width {
    /// [`Numerics::Int16`](super::Numerics::Int16): two bytes, `q = 256·h + l`.
    Int16,
    /// [`Numerics::Int24`](super::Numerics::Int24): three bytes, `q = 65536·h + 256·m + l`.
    Int24,
}

impl Width {
    /// Byte planes of a block: the unsigned low bytes (`l`, then for 24 bits `m`), then the
    /// signed top bytes `h`.
    pub(crate) const fn planes(self) -> usize {
        match self {
            Width::Int16 => 2,
            Width::Int24 => 3,
        }
    }

    /// Bytes of one block's activations in a [`Split`]: [`Self::planes`] runs of 32.
    pub(crate) const fn block_bytes(self) -> usize {
        self.planes() * BLOCK
    }

    /// The largest magnitude an activation is rounded to.
    pub(crate) const fn qmax(self) -> i32 {
        match self {
            Width::Int16 => 32767,
            Width::Int24 => 8_388_607,
        }
    }

    /// The shift that gives the top (signed) byte of an integer.
    pub(crate) const fn top_shift(self) -> u32 {
        8 * (self.planes() as u32 - 1)
    }
}

/// Whether grouped weights take the int16 products: Q4_0, Q4_1 and Q4_K in the streams layout,
/// Q5_0 in [`Layout::Planes`] (which engines build only for these products), and Q8_0 where the
/// CPU runs the kernel's gathers (AVX512-VBMI; elsewhere Q8_0 runs exact, where the scalar chain
/// would be far slower).
///
/// Q4_K: Qwen2.5-Coder-0.5B Q4_K_M decode (its down projection Q4_K in half the layers, Q6_K in
/// the others), 2 threads of the 2-vCPU Xeon (family 6 model 207), int24, one process
/// alternating the exact and the integer kernel on those matrices, 16 rounds of 64 steps: the
/// down projections 3.44 → 3.26 ms a step, the decode's median per-round ratio 1.016 (quartiles
/// 0.999–1.029; 0.994 in a second run of 24 rounds, its down projections 3.50 → 3.43 ms). One
/// core, `gemv/Q4_K-grouped(-int24|-int16)?/896x4864/avx512` (`benches/kernels.rs`): exact
/// 15.3, int24 23.8, int16 26.2 GiB/s.
pub(crate) fn takes(w: &Grouped) -> bool {
    match (w.layout, w.kind) {
        (Layout::Streams, QuantKind::Q4_0 | QuantKind::Q4_1 | QuantKind::Q4_K) => true,
        (Layout::Streams, QuantKind::Q8_0) => q8_kernel(),
        (Layout::Planes, QuantKind::Q5_0) => true,
        _ => false,
    }
}

/// Whether this CPU runs the kernel on Q8_0.
fn q8_kernel() -> bool {
    #[cfg(target_arch = "x86_64")]
    return super::avx512_grouped_i16::gathers();
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Where element `e` (of a 32-element block) goes among the block's 32 bytes of a [`Split`]:
/// dword `2w + (e mod 2)` for word `w = e / 8`, byte `(e mod 8) / 2` of it, the order in which the
/// kernel unpacks each word's quants (the even elements by a mask, the odd ones by a shift).
pub(crate) const fn split_at(e: usize) -> usize {
    let (w, k) = (e / 8, e % 8);
    4 * (2 * w + k % 2) + k / 2
}

/// One token row's 16- or 24-bit activations as the grouped integer kernel reads them.
pub(crate) struct Split {
    /// How many bits the integers have.
    pub width: Width,
    /// Per block, [`Width::block_bytes`] bytes, a plane of 32 each: `q & 255` of each element
    /// at [`split_at`], for 24 bits `(q >> 8) & 255` at `32 + split_at`, then the top byte
    /// `q >> top_shift` (signed) in the last plane.
    pub bytes: Vec<u8>,
    /// The scale `d` of each block (NaN where the block held a NaN or infinity), as rounded.
    pub d: Vec<f32>,
    /// `Σ x` of each block, unrounded, as rounded ([`XI16::sums`]).
    pub sums: Vec<f32>,
    /// `Σ (q mod 2^top_shift)` of each block, the unsigned part below the top byte: Q4_0's `−8`
    /// is taken back in integers against it and against [`Self::hsums`].
    pub lsums: Vec<i32>,
    /// `Σ (q >> top_shift)` of each block: the kernel's Q8_0 quants against the top bytes are
    /// offset by 128 (the unsigned side of `vpdpbusd`), taken back in integers.
    pub hsums: Vec<i32>,
}

impl Split {
    /// A split of no blocks, for [`split`] to fill.
    fn empty(width: Width) -> Split {
        Split {
            width,
            bytes: Vec::new(),
            d: Vec::new(),
            sums: Vec::new(),
            lsums: Vec::new(),
            hsums: Vec::new(),
        }
    }

    /// This split (a spent one, or [`Split::empty`]) made `nb` blocks of `width`, every value
    /// zero (what a block holding a NaN or infinity keeps), in its own buffers: for the AVX-512
    /// splits to fill.
    pub(crate) fn reset(&mut self, width: Width, nb: usize) {
        fn zeroed<T: Default + Clone>(v: &mut Vec<T>, n: usize) {
            v.clear();
            v.resize(n, T::default());
        }
        self.width = width;
        zeroed(&mut self.bytes, nb * width.block_bytes());
        zeroed(&mut self.d, nb);
        zeroed(&mut self.sums, nb);
        zeroed(&mut self.lsums, nb);
        zeroed(&mut self.hsums, nb);
    }

    /// `x`'s 16-bit integers cut into bytes and laid out for the kernel.
    pub(crate) fn new(x: &XI16) -> Split {
        let nb = x.q.len() / BLOCK;
        let q: Vec<i32> = x.q.iter().map(|&v| v as i32).collect();
        Split::of_ints(Width::Int16, &q, &x.d[..nb], &x.sums[..nb])
    }

    /// Integers `q` of `width` (whole blocks; scales `d` and sums `sums` a block each) cut into
    /// bytes and laid out for the kernel.
    pub(crate) fn of_ints(width: Width, q: &[i32], d: &[f32], sums: &[f32]) -> Split {
        let nb = q.len() / BLOCK;
        let (bb, top) = (width.block_bytes(), width.top_shift());
        let mut bytes = vec![0u8; nb * bb];
        let mut lsums = Vec::with_capacity(nb);
        let mut hsums = Vec::with_capacity(nb);
        for (b, q) in q.chunks_exact(BLOCK).enumerate() {
            let dst = &mut bytes[b * bb..(b + 1) * bb];
            for (e, &v) in q.iter().enumerate() {
                for p in 0..width.planes() {
                    dst[p * BLOCK + split_at(e)] = (v >> (8 * p)) as u8;
                }
            }
            lsums.push(q.iter().map(|&v| v & ((1 << top) - 1)).sum());
            hsums.push(q.iter().map(|&v| v >> top).sum());
        }
        Split {
            width,
            bytes,
            d: d.to_vec(),
            sums: sums.to_vec(),
            lsums,
            hsums,
        }
    }

    /// Element `e`'s integer of block `b`, rebuilt from its bytes.
    fn q(&self, b: usize, e: usize) -> i32 {
        let planes = self.width.planes();
        let blk = &self.bytes[b * self.width.block_bytes()..];
        let top = blk[(planes - 1) * BLOCK + split_at(e)] as i8 as i32;
        (0..planes - 1).fold(top << self.width.top_shift(), |q, p| {
            q + ((blk[p * BLOCK + split_at(e)] as i32) << (8 * p))
        })
    }
}

/// `x` (whole blocks) rounded to integers of `width` per 32-element block in scalar Rust, the
/// reference of every rounding to a [`Split`]: `d = max|x| / qmax` ([`super::block_scale`]),
/// `q = x·(1/d)` rounded to the nearest integer (ties to even) and kept within `±qmax` (at 24
/// bits the product can round one past it), a NaN scale and zero integers for a block holding a
/// NaN or infinity, and the unrounded block sums ([`super::int16::block_sums`]). At 16 bits
/// this is [`super::int16::quantize_ref`]'s rounding.
pub(crate) fn split_ref(x: &[f32], width: Width) -> Split {
    assert!(
        x.len().is_multiple_of(BLOCK),
        "activation row of {} is not whole blocks",
        x.len()
    );
    let nb = x.len() / BLOCK;
    let qmax = width.qmax();
    let mut q = vec![0i32; x.len()];
    let mut d = vec![0f32; nb];
    for (b, c) in x.chunks_exact(BLOCK).enumerate() {
        let Some((db, rounded)) = super::round_block_ref(c, qmax as f32) else {
            d[b] = f32::NAN;
            continue;
        };
        d[b] = db;
        for (q, v) in q[b * BLOCK..(b + 1) * BLOCK].iter_mut().zip(rounded) {
            *q = (v as i32).clamp(-qmax, qmax);
        }
    }
    let sums = super::int16::block_sums(x);
    Split::of_ints(width, &q, &d, &sums[..nb])
}

/// `x` (whole blocks) rounded to integers of `width` and laid out for the kernel: by AVX-512
/// in one pass where the kernel runs, else as [`split_ref`] rounds it (16 bits through
/// [`super::int16::quantize`]); the same bytes either way.
pub(crate) fn split(x: &[f32], width: Width) -> Split {
    assert!(
        x.len().is_multiple_of(BLOCK),
        "activation row of {} is not whole blocks",
        x.len()
    );
    #[cfg(target_arch = "x86_64")]
    if super::avx512_grouped_i16::available() {
        let mut out = SPENT
            .with_borrow_mut(Vec::pop)
            .unwrap_or_else(|| Split::empty(width));
        if super::avx512_split::available() {
            // SAFETY: the CPU has AVX-512 F/BW/VL and VBMI; `x` is whole blocks (asserted).
            unsafe { super::avx512_split::split_into(x, width, &mut out) };
        } else {
            // SAFETY: the CPU has AVX-512 F/BW/VL; `x` is whole blocks (asserted).
            unsafe { super::avx512_grouped_i16::split_into(x, width, &mut out) };
        }
        return out;
    }
    match width {
        Width::Int16 => Split::new(&super::int16::quantize(x)),
        Width::Int24 => split_ref(x, width),
    }
}

/// How many spent splits a thread keeps for [`split`] to fill again. A one-token call's split
/// allocated five buffers and freed them when the call ended (0.13 of the 0.73 µs a 576-wide
/// row took on one core of the Intel Xeon family 6 model 207); a decode step makes one such
/// call a matmul. With them reused, SmolLM2 decode on that CPU (two threads, int24, 128 steps,
/// reuse on and off alternating in one process, median per-round ratio) ran 2.0% and 2.2%
/// faster on the Q4_1 file (two runs of 40 rounds, quartiles 1.007–1.040) and 2.6% on the
/// Q8_0 one (30 rounds, 1.004–1.030).
const SPENT_KEPT: usize = 64;

thread_local! {
    /// This thread's spent splits, at most [`SPENT_KEPT`].
    static SPENT: RefCell<Vec<Split>> = const { RefCell::new(Vec::new()) };
}

/// Gives `splits` back for [`split`] to reuse (on the thread that ends the call; those past
/// [`SPENT_KEPT`] are freed, and all of them where [`split`] does not reuse).
pub(crate) fn recycle(splits: Vec<Split>) {
    #[cfg(target_arch = "x86_64")]
    let reused = super::avx512_grouped_i16::available();
    #[cfg(not(target_arch = "x86_64"))]
    let reused = false;
    if !reused {
        return;
    }
    SPENT.with_borrow_mut(|spent| {
        let room = SPENT_KEPT.saturating_sub(spent.len());
        spent.extend(splits.into_iter().take(room));
    });
}

/// The f16 at `p[2i..2i+2]`.
fn f16_at(p: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([p[2 * i], p[2 * i + 1]]).to_f32()
}

/// Row `r`'s element `e` of the 4-bit streams at `blk[qa..]` (a Q4_0/Q4_1 block's, a Q4_K
/// sub-block's): its nibble in the row's word `e / 8`.
fn nibble_at(blk: &[u8], qa: usize, r: usize, e: usize) -> i32 {
    let at = qa + (e / 8) * 4 * GROUP + 4 * r;
    let word = u32::from_le_bytes([blk[at], blk[at + 1], blk[at + 2], blk[at + 3]]);
    (word >> (4 * (e % 8)) & 0x0f) as i32
}

/// `Σ (q + off)·x` of one block of 32 quants `quant(e)` against block `b` of the activations,
/// as f32: exact integer sums against the bits below the top byte and against the top byte (at
/// most 2²⁸ and 2²⁰ in magnitude), joined as the kernel joins them.
fn block_dot(quant: impl Fn(usize) -> i32, off: i32, x: &Split, b: usize) -> f32 {
    let top = x.width.top_shift();
    let (mut low, mut high) = (0i32, 0i32);
    for e in 0..BLOCK {
        let q = x.q(b, e);
        low += (quant(e) + off) * (q & ((1 << top) - 1));
        high += (quant(e) + off) * (q >> top);
    }
    match x.width {
        // Exact in i32 (at most 136·32768·32 in magnitude).
        Width::Int16 => ((high << top) + low) as f32,
        // The top part's 2¹⁶ would overflow i32: joined in f32, one rounding.
        Width::Int24 => (high as f32).mul_add(65536.0, low as f32),
    }
}

/// [`dot_ref`] for Q4_K: per sub-block `j` of super-block `b` (activation block `8b + j`) its
/// [`block_dot`] `S`, then `acc ← fma(S, (d·sc_j)·d_x, acc)` and `acc ← fma(−dmin·m_j, Σx, acc)`.
fn dot_ref_k4(w: &Grouped, n: usize, x: &Split) -> f32 {
    let nb = w.cols / elems(QuantKind::Q4_K);
    let bb = group_block_bytes(QuantKind::Q4_K);
    let (g, r) = (n / GROUP, n % GROUP);
    let mut acc = 0f32;
    for b in 0..nb {
        let blk = &w.bytes[(g * nb + b) * bb..(g * nb + b + 1) * bb];
        let (d, dmin) = (f16_at(blk, r), f16_at(&blk[K4_DMIN..], r));
        for j in 0..K4_SUB {
            let quant = |e: usize| nibble_at(blk, K4_QUANTS + j * K4_SUB_BYTES, r, e);
            let sub = b * K4_SUB + j;
            let s = block_dot(quant, 0, x, sub);
            let d1 = d * blk[K4_SCALES + GROUP * j + r] as f32;
            let m1 = dmin * blk[K4_MINS + GROUP * j + r] as f32;
            acc = s.mul_add(d1 * x.d[sub], acc);
            acc = (-m1).mul_add(x.sums[sub], acc);
        }
    }
    acc
}

/// Output `n` of one token: the chain of the module doc in scalar Rust.
fn dot_ref(w: &Grouped, n: usize, x: &Split) -> f32 {
    if w.kind == QuantKind::Q4_K {
        return dot_ref_k4(w, n, x);
    }
    let nb = w.cols / BLOCK;
    let bb = group_block_bytes(w.kind);
    let qa = quants_at(w.kind);
    let off = value_offset(w.kind);
    let (g, r) = (n / GROUP, n % GROUP);
    let mut acc = 0f32;
    for b in 0..nb {
        let blk = &w.bytes[(g * nb + b) * bb..(g * nb + b + 1) * bb];
        let quant = |e: usize| {
            if w.kind == QuantKind::Q8_0 {
                // Element-major: element `e`'s 16 rows at `16e`, signed.
                blk[qa + GROUP * e + r] as i8 as i32
            } else if w.layout == Layout::Planes {
                planes_quant(blk, r, e) as i32
            } else {
                nibble_at(blk, qa, r, e)
            }
        };
        let sum = block_dot(quant, off, x, b);
        acc = sum.mul_add(f16_at(blk, r) * x.d[b], acc);
        if w.kind == QuantKind::Q4_1 {
            acc = f16_at(&blk[2 * GROUP..], r).mul_add(x.sums[b], acc);
        }
    }
    acc
}

/// Every output of `job` over grouped `w` ([`takes`]) with activations `x` (one per token), in
/// scalar Rust: the reference, and what runs below the kernel's level.
///
/// # Safety
/// `job`'s output must be valid for writes at `t·ldo + n` for every token and row of the job.
pub(crate) unsafe fn rows_ref(w: &Grouped, x: &[Split], job: &Job) {
    assert!(takes(w), "{} has no grouped int16 products", w.kind.name());
    for (t, xt) in x.iter().enumerate().take(job.tokens) {
        for n in job.rows.clone() {
            job.put(t, n, dot_ref(w, n, xt));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_places_cover_each_byte_once() {
        let mut seen = [false; BLOCK];
        for e in 0..BLOCK {
            assert!(!seen[split_at(e)], "element {e} lands on a taken byte");
            seen[split_at(e)] = true;
        }
    }

    #[test]
    fn split_rebuilds_every_integer() {
        let x: Vec<f32> = (0..64)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.37)
            .collect();
        let xq = super::super::int16::quantize_ref(&x);
        let s = Split::new(&xq);
        let fast = split(&x, Width::Int16);
        assert_eq!(fast.bytes, s.bytes);
        assert_eq!(fast.lsums, s.lsums);
        assert_eq!(fast.hsums, s.hsums);
        for b in 0..2 {
            for e in 0..BLOCK {
                assert_eq!(
                    s.q(b, e),
                    xq.q[b * BLOCK + e] as i32,
                    "block {b} element {e}"
                );
            }
            let want: i32 = xq.q[b * BLOCK..(b + 1) * BLOCK]
                .iter()
                .map(|&v| v as i32)
                .sum();
            assert_eq!(256 * s.hsums[b] + s.lsums[b], want);
        }
        assert!(xq.q.iter().any(|&v| v == 32767 || v == -32767));
    }

    /// Every 24-bit integer comes back from its three bytes, the extremes included, and the
    /// block sums split `Σ q` into the part below the top byte and the top byte's.
    #[test]
    fn split24_rebuilds_every_integer() {
        let mut q: Vec<i32> = (0..96)
            .map(|i: i32| (i * 7_654_321 % 16_777_213) - 8_388_606)
            .collect();
        q[..4].copy_from_slice(&[8_388_607, -8_388_607, 0, -1]);
        let s = Split::of_ints(Width::Int24, &q, &[1.0; 3], &[0.0; 3]);
        for b in 0..3 {
            for e in 0..BLOCK {
                assert_eq!(s.q(b, e), q[b * BLOCK + e], "block {b} element {e}");
            }
            let want: i64 = q[b * BLOCK..(b + 1) * BLOCK]
                .iter()
                .map(|&v| v as i64)
                .sum();
            assert_eq!(65536 * s.hsums[b] as i64 + s.lsums[b] as i64, want);
        }
    }

    /// The 16-bit reference rounding is [`super::super::int16::quantize_ref`]'s, and the 24-bit
    /// one keeps a block's largest magnitude at `±qmax` and every element within `d/2` (plus
    /// the product's own f32 rounding) of `x/d`.
    #[test]
    fn split_ref_rounds_as_int16_and_to_24_bits() {
        let x: Vec<f32> = (0..32 * 5)
            .map(|i| ((i * 7919 % 1013) as f32 - 506.5) * 0.0137)
            .collect();
        let s16 = split_ref(&x, Width::Int16);
        let r16 = Split::new(&super::super::int16::quantize_ref(&x));
        assert_eq!(s16.bytes, r16.bytes);
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&s16.d), bits(&r16.d));
        let s24 = split_ref(&x, Width::Int24);
        for (b, c) in x.chunks_exact(BLOCK).enumerate() {
            let amax = c.iter().fold(0f32, |m, v| m.max(v.abs()));
            let mut top = 0;
            for (e, &v) in c.iter().enumerate() {
                let q = s24.q(b, e);
                top = top.max(q.abs());
                let err = (q as f64 - v as f64 / s24.d[b] as f64).abs();
                assert!(err <= 0.5 + 1.0, "block {b} element {e}: {q} for {v}");
            }
            // amax·(1/d) is within three f32 roundings of qmax.
            assert!(
                (8_388_605..=8_388_607).contains(&top),
                "block {b} (max {amax}): {top}"
            );
        }
    }

    /// Every split the CPU runs against the rounding's reference, bit for bit, at both widths,
    /// on blocks of every kind (ordinary, all zeros, huge, tiny, subnormal, non-finite), and on
    /// rows of 1–48 blocks, so that the sixteen-block split's groups end early, exactly, and
    /// past a bad block anywhere in a group.
    #[test]
    fn split_equals_the_reference_rounding() {
        for nb in [1, 2, 9, 15, 16, 17, 18, 31, 32, 33, 48] {
            let mut x: Vec<f32> = (0..32 * nb)
                .map(|i| ((i * 7919 % 1013) as f32 - 506.5) * 0.0137 * (1.0 + (i / 32) as f32))
                .collect();
            let block = |b: usize| (b % nb) * 32..(b % nb + 1) * 32;
            if nb > 4 {
                x[block(1)].fill(0.0);
                x[block(2)].iter_mut().for_each(|v| *v *= 1e30);
                x[block(3)].iter_mut().for_each(|v| *v *= 1e-40);
                x[block(4)].iter_mut().for_each(|v| *v *= 1e-44);
            }
            x[block(5).start + 2] = f32::NAN;
            x[block(nb / 2 + 1).start + 10] = f32::INFINITY;
            x[block(nb.saturating_sub(1)).start + 31] = f32::NEG_INFINITY;
            if nb > 6 {
                x[block(6).start + 26] = 0.5;
            }
            for width in [Width::Int16, Width::Int24] {
                let want = split_ref(&x, width);
                let mut splits = vec![("split", split(&x, width))];
                #[cfg(target_arch = "x86_64")]
                {
                    let mut each = |name, f: unsafe fn(&[f32], Width, &mut Split)| {
                        let mut out = Split::empty(width);
                        // Spent buffers of another size and contents, as reused ones are.
                        out.bytes = vec![7; 5];
                        out.sums = vec![1.0; 70];
                        // SAFETY: called where `available` says the CPU has the kernel.
                        unsafe { f(&x, width, &mut out) };
                        splits.push((name, out));
                    };
                    if super::super::avx512_grouped_i16::available() {
                        each("blockwise", super::super::avx512_grouped_i16::split_into);
                    }
                    if super::super::avx512_split::available() {
                        each("sixteen", super::super::avx512_split::split_into);
                    }
                }
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                for (name, got) in &splits {
                    let at = format!("{name}, {nb} blocks, {width:?}");
                    assert_eq!(got.bytes, want.bytes, "{at}");
                    assert_eq!(got.lsums, want.lsums, "{at}");
                    assert_eq!(got.hsums, want.hsums, "{at}");
                    assert_eq!(bits(&got.d), bits(&want.d), "{at}");
                    assert_eq!(bits(&got.sums), bits(&want.sums), "{at}");
                }
            }
        }
    }

    /// The block sum folds halves (the order the sixteen-block split reduces in): for 32
    /// elements, `((((c₀+c₁₆)+(c₈+c₂₄))+…`, written out here for blocks whose sums in element
    /// order differ from it, and lengths that are not powers of two in element order.
    #[test]
    fn block_sum_folds_halves() {
        let c: Vec<f32> = (0..32)
            .map(|i| 1.0 + (i as f32) * 1e-7 * 3.0f32.powi(i % 5))
            .collect();
        let mut t: Vec<f32> = (0..16).map(|i| c[i] + c[i + 16]).collect();
        for half in [8, 4, 2, 1] {
            t = (0..half).map(|i| t[i] + t[i + half]).collect();
        }
        let sequential: f32 = c.iter().sum();
        assert_eq!(super::super::block_sum(&c).to_bits(), t[0].to_bits());
        assert_ne!(
            t[0].to_bits(),
            sequential.to_bits(),
            "a block that tells the orders apart"
        );
        assert_eq!(super::super::block_sum(&c[..2]), c[0] + c[1]);
        let odd: f32 = c[..24].iter().sum();
        assert_eq!(super::super::block_sum(&c[..24]).to_bits(), odd.to_bits());
    }
}

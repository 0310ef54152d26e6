//! [`Numerics::Int16`](super::Numerics::Int16) on grouped Q4_0, Q4_1 and Q8_0 weights
//! ([`super::grouped`]'s streams layout, the exact kernels' bytes): the activations rounded to
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
//! 128·32768·32 in magnitude, far inside 32 bits). Q4_0's `−8` is taken back in integers
//! (`−8·Σq`), and so is the 128 that Q8_0's signed quants carry as the unsigned side against the
//! high bytes (`−128·Σh`). The 4-bit words are read as stored: byte `j` of lane `r` of word `w`
//! holds row `r`'s elements `8w + 2j` (low nibble) and `8w + 2j + 1` (high), so a mask gives the
//! even elements and a shift and a mask the odd ones, and the activations' bytes are laid out in
//! that order once per call ([`Split`]); Q8_0's element-major bytes are gathered into that order
//! by byte permutes.
//!
//! **Bits.** Each (row, token) output is one chain over the blocks in order: the block's exact
//! integer sum `S`, then `acc ← fma(float(S), d_w·d_x, acc)` and, for Q4_1,
//! `acc ← fma(m_w, Σx_block, acc)` with the unrounded block sum as the other int16 kernels take
//! it. The integer sum is the same whatever the order of its products, so [`rows_ref`], that
//! chain in scalar Rust, is what the kernel is tested against bit for bit, and what runs where
//! the kernel cannot (a level forced below AVX-512): an int16 result never depends on the level.

use half::f16;

use super::grouped::{group_block_bytes, quants_at, value_offset, Grouped, Layout, BLOCK, GROUP};
use super::int16::XI16;
use super::Job;
use crate::model::quant::QuantKind;

/// Bytes of one block's activations in a [`Split`]: the 32 low bytes, then the 32 high ones.
pub(crate) const SPLIT_BLOCK: usize = 2 * BLOCK;

/// Whether grouped weights take the int16 products: Q4_0 and Q4_1 in the streams layout, and
/// Q8_0 where the CPU runs the kernel's gathers (AVX512-VBMI; elsewhere Q8_0 runs exact, where
/// the scalar chain would be far slower).
pub(crate) fn takes(w: &Grouped) -> bool {
    w.layout == Layout::Streams
        && match w.kind {
            QuantKind::Q4_0 | QuantKind::Q4_1 => true,
            QuantKind::Q8_0 => q8_kernel(),
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

/// One token row's 16-bit activations as the grouped int16 kernel reads them.
pub(crate) struct Split {
    /// Per block, [`SPLIT_BLOCK`] bytes: `q & 255` of each element at [`split_at`], then
    /// `q >> 8` (a signed byte) at `32 + split_at`.
    pub bytes: Vec<u8>,
    /// The scale `d` of each block (NaN where the block held a NaN or infinity), as rounded.
    pub d: Vec<f32>,
    /// `Σ x` of each block, unrounded, as rounded ([`XI16::sums`]).
    pub sums: Vec<f32>,
    /// `Σ q` of each block: Q4_0's `−8` taken back in integers.
    pub qsums: Vec<i32>,
    /// `Σ (q >> 8)` of each block: the kernel's Q8_0 quants against the high bytes are offset by
    /// 128 (the unsigned side of `vpdpbusd`), taken back in integers.
    pub hsums: Vec<i32>,
}

impl Split {
    /// `x`'s integers cut into bytes and laid out for the kernel.
    pub(crate) fn new(x: &XI16) -> Split {
        let nb = x.q.len() / BLOCK;
        let mut bytes = vec![0u8; nb * SPLIT_BLOCK];
        let mut qsums = Vec::with_capacity(nb);
        let mut hsums = Vec::with_capacity(nb);
        for (b, q) in x.q.chunks_exact(BLOCK).enumerate() {
            let dst = &mut bytes[b * SPLIT_BLOCK..(b + 1) * SPLIT_BLOCK];
            for (e, &v) in q.iter().enumerate() {
                let [lo, hi] = v.to_le_bytes();
                dst[split_at(e)] = lo;
                dst[BLOCK + split_at(e)] = hi;
            }
            qsums.push(q.iter().map(|&v| v as i32).sum());
            hsums.push(q.iter().map(|&v| (v >> 8) as i32).sum());
        }
        Split {
            bytes,
            d: x.d[..nb].to_vec(),
            sums: x.sums[..nb].to_vec(),
            qsums,
            hsums,
        }
    }

    /// Element `e`'s integer of block `b`, rebuilt from its two bytes.
    fn q(&self, b: usize, e: usize) -> i32 {
        let blk = &self.bytes[b * SPLIT_BLOCK..];
        256 * (blk[BLOCK + split_at(e)] as i8 as i32) + blk[split_at(e)] as i32
    }
}

/// `x` (whole blocks) rounded as [`super::int16::quantize`] rounds it and laid out for the
/// kernel: by AVX-512 in one pass where the kernel runs, else through [`Split::new`] (the same
/// bytes either way).
pub(crate) fn split(x: &[f32]) -> Split {
    assert!(
        x.len().is_multiple_of(BLOCK),
        "activation row of {} is not whole blocks",
        x.len()
    );
    #[cfg(target_arch = "x86_64")]
    if super::avx512_grouped_i16::available() {
        // SAFETY: the CPU has AVX-512 F/BW/VL; `x` is whole blocks (asserted).
        return unsafe { super::avx512_grouped_i16::split(x) };
    }
    Split::new(&super::int16::quantize(x))
}

/// The f16 at `p[2i..2i+2]`.
fn f16_at(p: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([p[2 * i], p[2 * i + 1]]).to_f32()
}

/// Output `n` of one token: the chain of the module doc in scalar Rust.
fn dot_ref(w: &Grouped, n: usize, x: &Split) -> f32 {
    let nb = w.cols / BLOCK;
    let bb = group_block_bytes(w.kind);
    let qa = quants_at(w.kind);
    let off = value_offset(w.kind);
    let (g, r) = (n / GROUP, n % GROUP);
    let mut acc = 0f32;
    for b in 0..nb {
        let blk = &w.bytes[(g * nb + b) * bb..(g * nb + b + 1) * bb];
        let mut sum: i32 = off * x.qsums[b];
        for e in 0..BLOCK {
            let quant = if w.kind == QuantKind::Q8_0 {
                // Element-major: element `e`'s 16 rows at `16e`, signed.
                blk[qa + GROUP * e + r] as i8 as i32
            } else {
                let at = qa + (e / 8) * 4 * GROUP + 4 * r;
                let word = u32::from_le_bytes([blk[at], blk[at + 1], blk[at + 2], blk[at + 3]]);
                (word >> (4 * (e % 8)) & 0x0f) as i32
            };
            sum += quant * x.q(b, e);
        }
        acc = (sum as f32).mul_add(f16_at(blk, r) * x.d[b], acc);
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
        let fast = split(&x);
        assert_eq!(fast.bytes, s.bytes);
        assert_eq!(fast.qsums, s.qsums);
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
            assert_eq!(s.qsums[b], want);
        }
        assert!(xq.q.iter().any(|&v| v == 32767 || v == -32767));
    }

    /// The one-pass split (AVX-512 where the CPU has the kernel) against the rounding's reference,
    /// bit for bit, on blocks of every kind: ordinary, all zeros, huge, tiny, and non-finite.
    #[test]
    fn split_equals_the_reference_rounding() {
        let mut x: Vec<f32> = (0..32 * 9)
            .map(|i| ((i * 7919 % 1013) as f32 - 506.5) * 0.0137)
            .collect();
        x[32..64].fill(0.0);
        x[64..96].iter_mut().for_each(|v| *v *= 1e30);
        x[96..128].iter_mut().for_each(|v| *v *= 1e-40);
        x[130] = f32::NAN;
        x[170] = f32::INFINITY;
        x[200] = f32::NEG_INFINITY;
        x[250] = 0.5;
        let want = Split::new(&super::super::int16::quantize_ref(&x));
        let got = split(&x);
        assert_eq!(got.bytes, want.bytes);
        assert_eq!(got.qsums, want.qsums);
        assert_eq!(got.hsums, want.hsums);
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got.d), bits(&want.d));
        assert_eq!(bits(&got.sums), bits(&want.sums));
    }
}

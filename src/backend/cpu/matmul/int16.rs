//! The 16-bit integer activations of [`Numerics::Int16`](super::Numerics::Int16): one
//! activation row rounded, per 32-element block, to `q = round(x / d)` with
//! `d = max|x| / 32767`, so `x ≈ d·q` with an error of at most `d/2` per element (a relative
//! 1.5·10⁻⁵ of the block's largest magnitude — about 250 times finer than bf16's rounding).
//! The GEMVs then multiply the weights' integer quants with `q` in integer lanes
//! (`vpmaddwd`: 16 products per instruction, exact in i32) and apply `d_w·d` once per block.
//!
//! Blocks of 32 match every kernel's block (the legacy formats' blocks, Q4_K's sub-blocks, pairs
//! of Q6_K's sub-blocks), so one scale covers each integer partial sum.

/// Elements per activation block (one scale each).
pub(crate) const BLOCK: usize = 32;

/// The largest integer an activation is rounded to.
const QMAX: f32 = 32767.0;

/// Entries of [`XI16::d`] and [`XI16::sums`] are padded with zeros to a multiple of this, so the
/// kernels load them a vector (of one lane per block) at a time.
pub(crate) const PAD: usize = 8;

/// One activation row in 16-bit integers.
pub(crate) struct XI16 {
    /// `x / d`, rounded to the nearest integer (ties to even), per element.
    pub q: Vec<i16>,
    /// The scale `d` of each 32-element block; NaN where the block holds a NaN or infinity (its
    /// `q` are then 0), so non-finite activations stay non-finite in the products. Padded
    /// ([`PAD`]).
    pub d: Vec<f32>,
    /// `Σ x` of each 32-element block in f32, summed in order from the unrounded activations
    /// (the formats with a min, Q4_K's min term): only the products with the quants are rounded.
    /// Padded ([`PAD`]).
    pub sums: Vec<f32>,
}

/// A block's scale and its reciprocal from its largest magnitude ([`super::block_scale`]).
#[inline(always)]
pub(crate) fn scale_of(amax: f32) -> (f32, f32) {
    super::block_scale(amax, QMAX)
}

/// Rounds `x` (a whole number of 32-element blocks) as the kernels do: the reference for the
/// vectorised [`quantize`], and what the scalar level would run.
pub(crate) fn quantize_ref(x: &[f32]) -> XI16 {
    assert!(
        x.len().is_multiple_of(BLOCK),
        "activation row of {} is not whole blocks",
        x.len()
    );
    let nb = x.len() / BLOCK;
    let mut out = XI16 {
        q: vec![0; x.len()],
        d: vec![0.0; nb.next_multiple_of(PAD)],
        sums: block_sums(x),
    };
    for (b, c) in x.chunks_exact(BLOCK).enumerate() {
        let Some((d, rounded)) = super::round_block_ref(c, QMAX) else {
            out.d[b] = f32::NAN;
            continue;
        };
        out.d[b] = d;
        for (q, v) in out.q[b * BLOCK..(b + 1) * BLOCK].iter_mut().zip(rounded) {
            *q = v as i16;
        }
    }
    out
}

/// `Σ x` of each 32-element block, summed in order, padded with zeros ([`PAD`]).
pub(crate) fn block_sums(x: &[f32]) -> Vec<f32> {
    let mut s: Vec<f32> = x.chunks_exact(BLOCK).map(super::block_sum).collect();
    s.resize(s.len().next_multiple_of(PAD), 0.0);
    s
}

/// Rounds `x` with the fastest kernel the CPU has (bit-identical to [`quantize_ref`]).
pub(crate) fn quantize(x: &[f32]) -> XI16 {
    #[cfg(target_arch = "x86_64")]
    if super::simd::detected() >= super::simd::Level::Avx2 {
        assert!(
            x.len().is_multiple_of(BLOCK),
            "activation row of {} is not whole blocks",
            x.len()
        );
        // SAFETY: the CPU has AVX2, FMA and F16C; `x` is whole blocks.
        return unsafe { super::avx2_i16::quantize(x) };
    }
    quantize_ref(x)
}

//! Rotary position embeddings. Frequencies follow Hugging Face's computation (f32
//! `1 / theta^(2i/d)`, then the config's scaling), angles are `position · inv_freq` rounded to
//! f32 as PyTorch's f32 outer product does, and the three pairing/sign conventions of
//! [`RopeStyle`] are applied to each head.

#[cfg(test)]
use crate::graph::{rope::inv_freq, RopeSpec};
use crate::model::RopeStyle;

/// `(cos, sin)` for every pair at `pos`, appended to `out`.
pub fn push_angles(inv_freq: &[f32], pos: usize, out: &mut Vec<(f32, f32)>) {
    for &f in inv_freq {
        let a = (pos as f32 * f) as f64;
        out.push((a.cos() as f32, a.sin() as f32));
    }
}

/// Rotates every head of one row in place; `cs` holds `head_dim / 2` (cos, sin) pairs.
pub fn apply(x: &mut [f32], head_dim: usize, style: RopeStyle, cs: &[(f32, f32)]) {
    // Zipped iterators instead of indexing: no bounds checks, so the loops vectorize (each
    // product and sum still rounded on its own; Rust never fuses them).
    let half = head_dim / 2;
    for head in x.chunks_exact_mut(head_dim) {
        match style {
            RopeStyle::HalfSplit => {
                let (lo, hi) = head.split_at_mut(half);
                for ((a, b), &(c, s)) in lo.iter_mut().zip(hi.iter_mut()).zip(cs) {
                    let (x, y) = (*a, *b);
                    *a = x * c - y * s;
                    *b = y * c + x * s;
                }
            }
            RopeStyle::HalfSplitNegated => {
                let (lo, hi) = head.split_at_mut(half);
                for ((a, b), &(c, s)) in lo.iter_mut().zip(hi.iter_mut()).zip(cs) {
                    let (x, y) = (*a, *b);
                    *a = x * c + y * s;
                    *b = y * c - x * s;
                }
            }
            RopeStyle::Interleaved => {
                for (p, &(c, s)) in head.chunks_exact_mut(2).zip(cs) {
                    let (x, y) = (p[0], p[1]);
                    p[0] = x * c - y * s;
                    p[1] = y * c + x * s;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(style: RopeStyle) -> RopeSpec {
        RopeSpec {
            theta: 10000.0,
            head_dim: 8,
            style,
            scaling: None,
        }
    }

    /// The attention score between positions depends only on their distance, for every style.
    #[test]
    fn dot_products_depend_on_relative_position_only() {
        for style in [
            RopeStyle::HalfSplit,
            RopeStyle::HalfSplitNegated,
            RopeStyle::Interleaved,
        ] {
            let f = inv_freq(&spec(style));
            let q: Vec<f32> = (0..8).map(|i| (i as f32 * 0.7).sin()).collect();
            let k: Vec<f32> = (0..8).map(|i| (i as f32 * 1.3).cos()).collect();
            let score = |pq: usize, pk: usize| {
                let (mut a, mut b) = (q.clone(), k.clone());
                let (mut ca, mut cb) = (vec![], vec![]);
                push_angles(&f, pq, &mut ca);
                push_angles(&f, pk, &mut cb);
                apply(&mut a, 8, style, &ca);
                apply(&mut b, 8, style, &cb);
                a.iter().zip(&b).map(|(x, y)| x * y).sum::<f32>()
            };
            assert!((score(5, 2) - score(13, 10)).abs() < 1e-4, "{style:?}");
            assert!((score(5, 2) - score(5, 4)).abs() > 1e-3, "{style:?}");
        }
    }

    /// Each style rotates the pairs it names, each output `x·cos ∓ y·sin` rounded as written
    /// (products, then the sum), over several heads.
    #[test]
    fn rotations_pair_and_round_as_written() {
        let cs: Vec<(f32, f32)> = (0..4)
            .map(|i| ((i as f32 * 0.37).cos(), (i as f32 * 0.37 + 0.1).sin()))
            .collect();
        let x: Vec<f32> = (0..24).map(|i| (i as f32 * 0.61).sin() * 3.0).collect();
        for style in [
            RopeStyle::HalfSplit,
            RopeStyle::HalfSplitNegated,
            RopeStyle::Interleaved,
        ] {
            let mut got = x.clone();
            apply(&mut got, 8, style, &cs);
            for h in 0..3 {
                for (i, &(c, s)) in cs.iter().enumerate() {
                    let (ia, ib) = match style {
                        RopeStyle::Interleaved => (8 * h + 2 * i, 8 * h + 2 * i + 1),
                        _ => (8 * h + i, 8 * h + i + 4),
                    };
                    let (a, b) = (x[ia], x[ib]);
                    let (ea, eb) = match style {
                        RopeStyle::HalfSplitNegated => (a * c + b * s, b * c - a * s),
                        _ => (a * c - b * s, b * c + a * s),
                    };
                    assert_eq!(
                        got[ia].to_bits(),
                        ea.to_bits(),
                        "{style:?} head {h} pair {i}"
                    );
                    assert_eq!(
                        got[ib].to_bits(),
                        eb.to_bits(),
                        "{style:?} head {h} pair {i}"
                    );
                }
            }
        }
    }

    /// Interleaved rotation of a row permuted the way llama.cpp permutes q/k equals half-split
    /// rotation of the original row, permuted.
    #[test]
    fn interleaved_matches_half_split_under_the_gguf_permutation() {
        let f = inv_freq(&spec(RopeStyle::HalfSplit));
        let mut cs = vec![];
        push_angles(&f, 7, &mut cs);
        let x: Vec<f32> = (0..8).map(|i| i as f32 + 1.0).collect();
        // GGUF row order: [x0, x4, x1, x5, x2, x6, x3, x7]
        let perm = |v: &[f32]| -> Vec<f32> { (0..4).flat_map(|i| [v[i], v[i + 4]]).collect() };
        let mut hf = x.clone();
        apply(&mut hf, 8, RopeStyle::HalfSplit, &cs);
        let mut gg = perm(&x);
        apply(&mut gg, 8, RopeStyle::Interleaved, &cs);
        for (a, b) in perm(&hf).iter().zip(&gg) {
            assert!((a - b).abs() < 1e-6);
        }
    }
}

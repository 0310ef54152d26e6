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
    let half = head_dim / 2;
    for head in x.chunks_exact_mut(head_dim) {
        match style {
            RopeStyle::HalfSplit => {
                for (i, &(c, s)) in cs.iter().enumerate() {
                    let (a, b) = (head[i], head[i + half]);
                    head[i] = a * c - b * s;
                    head[i + half] = b * c + a * s;
                }
            }
            RopeStyle::HalfSplitNegated => {
                for (i, &(c, s)) in cs.iter().enumerate() {
                    let (a, b) = (head[i], head[i + half]);
                    head[i] = a * c + b * s;
                    head[i + half] = b * c - a * s;
                }
            }
            RopeStyle::Interleaved => {
                for (i, &(c, s)) in cs.iter().enumerate() {
                    let (a, b) = (head[2 * i], head[2 * i + 1]);
                    head[2 * i] = a * c - b * s;
                    head[2 * i + 1] = b * c + a * s;
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

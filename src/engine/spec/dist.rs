//! The distribution a row samples from, written out: what [`crate::sample::sample`] draws
//! from (softmax of `logits / T` cut by top-k, then min-p, then top-p), as explicit
//! probabilities. Speculative sampling needs them to compare the target's and the draft's
//! probabilities of a proposed token and to resample from their difference.

use crate::sample::{argmax, philox4x32_10, SamplingParams};

/// Which independent Philox stream a speculative draw comes from. Plain sampling uses the
/// counter's fourth word 0 ([`crate::sample::uniform`]); these use the others, so every draw
/// is keyed by `(seed, row, position, purpose)` and a run reproduces exactly.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Draw {
    /// Accepting or rejecting a proposed token.
    Accept = 1,
    /// Resampling after a rejection.
    Resample = 2,
    /// The draft model's own choice of a proposal.
    Draft = 3,
}

/// A uniform draw in `[0, 1)` for `(seed, row, position)` from the stream `draw` names.
pub(crate) fn uniform_for(draw: Draw, seed: u64, row: u32, position: u64) -> f32 {
    let out = philox4x32_10(
        [position as u32, (position >> 32) as u32, row, draw as u32],
        [seed as u32, (seed >> 32) as u32],
    );
    (out[0] >> 8) as f32 * (1.0 / 16_777_216.0)
}

/// Kept tokens and their probabilities (summing to 1), most likely first (ties by id).
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Dist {
    ids: Vec<u32>,
    probs: Vec<f64>,
}

impl Dist {
    /// The distribution `sample` draws from for these (already shaped) logits. Greedy
    /// parameters, or logits without a finite maximum, give a point mass on the argmax.
    pub fn of(logits: &[f32], params: &SamplingParams) -> Dist {
        let point = |id: u32| Dist {
            ids: vec![id],
            probs: vec![1.0],
        };
        if params.temperature == 0.0 || logits.len() <= 1 {
            return point(argmax(logits));
        }
        let inv_t = 1.0 / params.temperature;
        let mut order: Vec<u32> = (0..logits.len() as u32).collect();
        order.sort_unstable_by(|a, b| {
            logits[*b as usize]
                .total_cmp(&logits[*a as usize])
                .then(a.cmp(b))
        });
        if let Some(k) = params.top_k {
            order.truncate(k.max(1));
        }
        let max = logits[order[0] as usize];
        if !max.is_finite() || !inv_t.is_finite() {
            return point(argmax(logits));
        }
        let w = |i: u32| ((logits[i as usize] - max) * inv_t).exp();
        if let Some(mp) = params.min_p {
            order.retain(|&i| w(i) >= mp);
        }
        let mut weights: Vec<f64> = order.iter().map(|&i| w(i) as f64).collect();
        if let Some(p) = params.top_p {
            let total: f64 = weights.iter().sum();
            let target = p as f64 * total;
            let mut cum = 0.0;
            if let Some(n) = weights.iter().position(|&x| {
                cum += x;
                cum >= target
            }) {
                order.truncate(n + 1);
                weights.truncate(n + 1);
            }
        }
        let total: f64 = weights.iter().sum();
        if total.is_nan() || total <= 0.0 {
            return point(argmax(logits));
        }
        Dist {
            ids: order,
            probs: weights.into_iter().map(|x| x / total).collect(),
        }
    }

    /// The probability of `id` (0 outside the kept set).
    pub fn prob(&self, id: u32) -> f64 {
        self.ids
            .iter()
            .position(|&i| i == id)
            .map_or(0.0, |at| self.probs[at])
    }

    /// The token at cumulative probability `u` (in `[0, 1)`).
    pub fn pick(&self, u: f32) -> u32 {
        pick(&self.ids, &self.probs, u)
    }
}

fn pick(ids: &[u32], weights: &[f64], u: f32) -> u32 {
    let total: f64 = weights.iter().sum();
    let target = u as f64 * total;
    let mut cum = 0.0;
    for (&id, &w) in ids.iter().zip(weights) {
        cum += w;
        if target < cum {
            return id;
        }
    }
    // Only rounding leaves the walk short: take the last token with weight.
    ids.iter()
        .zip(weights)
        .rev()
        .find(|(_, &w)| w > 0.0)
        .map_or(ids[0], |(&id, _)| id)
}

/// The verdict on one proposed token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    Accept,
    /// Rejected; this token (drawn from the residual) takes its place.
    Replace(u32),
}

/// The speculative-sampling rule (Leviathan et al. 2023; Chen et al. 2023): accept `x`, drawn
/// from the proposal `q`, with probability `min(1, p(x) / q(x))`; otherwise draw from
/// `norm(max(0, p − q))`. The token that comes out is distributed exactly as `p`. `q` `None`
/// is a point mass on `x` (an n-gram proposal): accept with `p(x)`, else draw from `p` without
/// `x`. `u_accept` and `u_resample` are independent uniforms in `[0, 1)`.
pub(crate) fn judge(p: &Dist, x: u32, q: Option<&Dist>, u_accept: f32, u_resample: f32) -> Verdict {
    let px = p.prob(x);
    let qx = q.map_or(1.0, |q| q.prob(x));
    if qx > 0.0 && (u_accept as f64) < px / qx {
        return Verdict::Accept;
    }
    let residual: Vec<f64> = p
        .ids
        .iter()
        .zip(&p.probs)
        .map(|(&id, &pi)| {
            let qi = match q {
                Some(q) => q.prob(id),
                None if id == x => 1.0,
                None => 0.0,
            };
            (pi - qi).max(0.0)
        })
        .collect();
    if residual.iter().sum::<f64>() > 0.0 {
        Verdict::Replace(pick(&p.ids, &residual, u_resample))
    } else {
        // p ≤ q everywhere means p = q, where rejection has probability 0; rounding only.
        Verdict::Replace(p.pick(u_resample))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sample::sample;

    fn params(t: f32) -> SamplingParams {
        SamplingParams {
            temperature: t,
            seed: 3,
            ..SamplingParams::default()
        }
    }

    /// The written-out distribution is the one `sample` draws from, cuts included.
    #[test]
    fn dist_matches_sample_frequencies() {
        let logits: Vec<f32> = (0..40).map(|i| ((i * 7) % 11) as f32 * 0.4).collect();
        for p in [
            params(0.8),
            SamplingParams {
                top_k: Some(5),
                ..params(1.0)
            },
            SamplingParams {
                top_p: Some(0.6),
                min_p: Some(0.2),
                ..params(1.3)
            },
        ] {
            let d = Dist::of(&logits, &p);
            let total: f64 = d.probs.iter().sum();
            assert!((total - 1.0).abs() < 1e-9);
            let n = 20000;
            let mut counts = vec![0usize; logits.len()];
            for pos in 0..n {
                counts[sample(&logits, &p, 0, pos) as usize] += 1;
            }
            for (id, &c) in counts.iter().enumerate() {
                let want = d.prob(id as u32);
                let got = c as f64 / n as f64;
                assert!(
                    (got - want).abs() < 0.015,
                    "{p:?} token {id}: {got} vs {want}"
                );
                if want == 0.0 {
                    assert_eq!(c, 0, "{p:?}: token {id} is outside the kept set");
                }
            }
        }
        assert_eq!(Dist::of(&logits, &params(0.0)).ids.len(), 1);
    }

    /// Pearson's chi-square statistic of `counts` against probabilities `want`.
    fn chi_square(counts: &[usize], want: &[f64]) -> f64 {
        let n: usize = counts.iter().sum();
        counts
            .iter()
            .zip(want)
            .map(|(&c, &p)| {
                let e = p * n as f64;
                (c as f64 - e).powi(2) / e
            })
            .sum()
    }

    /// Tokens drawn from `q`, then judged, come out distributed as `p` — for a draft model's
    /// `q` (overlapping support, some tokens only in one of them) and for a point mass.
    #[test]
    fn accept_or_resample_keeps_the_target_distribution() {
        let p_logits = [2.0f32, 1.5, 1.0, 0.2, -0.5, -3.0];
        let q_logits = [0.0f32, 1.8, 1.9, 0.1, 1.0, 2.0];
        let pp = SamplingParams {
            top_k: Some(5),
            ..params(1.0)
        };
        let p = Dist::of(&p_logits, &pp);
        let q = Dist::of(&q_logits, &params(0.7));
        let n = 40_000u64;
        let mut counts = [0usize; 6];
        let mut point_counts = [0usize; 6];
        for pos in 0..n {
            let x = q.pick(uniform_for(Draw::Draft, 9, 0, pos));
            let ua = uniform_for(Draw::Accept, 9, 0, pos);
            let ur = uniform_for(Draw::Resample, 9, 0, pos);
            let out = |v| match v {
                Verdict::Accept => x,
                Verdict::Replace(t) => t,
            };
            counts[out(judge(&p, x, Some(&q), ua, ur)) as usize] += 1;
            // A point mass on token 1 (an n-gram guess).
            let y = match judge(&p, 1, None, ua, ur) {
                Verdict::Accept => 1,
                Verdict::Replace(t) => t,
            };
            point_counts[y as usize] += 1;
        }
        let want: Vec<f64> = (0..5).map(|i| p.prob(i)).collect();
        assert_eq!(
            counts[5] + point_counts[5],
            0,
            "a token outside p's support came out"
        );
        // 4 degrees of freedom: P(χ² > 18.47) = 0.001.
        let c1 = chi_square(&counts[..5], &want);
        let c2 = chi_square(&point_counts[..5], &want);
        assert!(
            c1 < 18.47,
            "draft proposals: χ² = {c1}, counts {counts:?}, p {want:?}"
        );
        assert!(
            c2 < 18.47,
            "point proposals: χ² = {c2}, counts {point_counts:?}, p {want:?}"
        );
        // The rule is not vacuous: q alone is far from p.
        let q_counts: Vec<usize> = (0..5)
            .map(|i| (q.prob(i) * n as f64).round() as usize)
            .collect();
        assert!(chi_square(&q_counts, &want) > 1000.0);
    }
}

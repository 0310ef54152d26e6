//! Choosing the next token from logits. Randomness comes from Philox-4x32-10 keyed by
//! `(seed, row, position)`: counter-based, so a draw depends only on where it happens, never on
//! how many draws came before or on which thread made them — the property that lets the GPU's
//! on-device sampler reproduce the CPU's choices.

pub mod device;
mod philox;

pub use philox::{philox4x32_10, uniform};

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SampleError {
    #[error("temperature must be a finite number ≥ 0, got {0}")]
    Temperature(f32),
    #[error("top-p must be in (0, 1], got {0}")]
    TopP(f32),
    #[error("top-k must be ≥ 1, got 0 (leave it unset to disable)")]
    TopK,
    #[error("min-p must be in [0, 1], got {0}")]
    MinP(f32),
    #[error("repetition penalty must be a finite number > 0, got {0}")]
    RepetitionPenalty(f32),
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 is greedy (argmax, first index on ties).
    pub temperature: f32,
    pub top_k: Option<usize>,
    pub top_p: Option<f32>,
    /// Drops tokens whose probability is below `min_p` times the most likely one's.
    pub min_p: Option<f32>,
    /// CTRL-style penalty on tokens already in the context (> 1 discourages repeats); applied
    /// by [`apply_repetition_penalty`] before sampling, greedy included.
    pub repetition_penalty: Option<f32>,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: None,
            top_p: None,
            min_p: None,
            repetition_penalty: None,
            seed: 0,
        }
    }
}

impl SamplingParams {
    pub fn validate(&self) -> Result<(), SampleError> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(SampleError::Temperature(self.temperature));
        }
        if let Some(p) = self.top_p {
            if !(p > 0.0 && p <= 1.0) {
                return Err(SampleError::TopP(p));
            }
        }
        if self.top_k == Some(0) {
            return Err(SampleError::TopK);
        }
        if let Some(p) = self.min_p {
            if !(0.0..=1.0).contains(&p) {
                return Err(SampleError::MinP(p));
            }
        }
        if let Some(r) = self.repetition_penalty {
            if !(r.is_finite() && r > 0.0) {
                return Err(SampleError::RepetitionPenalty(r));
            }
        }
        Ok(())
    }
}

/// Divides positive logits (multiplies negative ones) of every token in `context` by `penalty`,
/// once per distinct token, as Hugging Face's `RepetitionPenaltyLogitsProcessor` does.
pub fn apply_repetition_penalty(logits: &mut [f32], context: &[u32], penalty: f32) {
    if penalty == 1.0 {
        return;
    }
    let mut seen = std::collections::HashSet::with_capacity(context.len());
    for &t in context {
        if let Some(l) = logits.get_mut(t as usize) {
            if seen.insert(t) {
                *l = if *l > 0.0 { *l / penalty } else { *l * penalty };
            }
        }
    }
}

/// Index of the largest logit; the first one on ties (NaN never wins).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut best_v = f32::NEG_INFINITY;
    for (i, &v) in logits.iter().enumerate() {
        if v > best_v {
            best_v = v;
            best = i;
        }
    }
    best as u32
}

/// Samples one token for `row` at `position` (the absolute position the token will occupy).
///
/// The distribution is `softmax(logits / T)` restricted by top-k, then min-p, then top-p, and
/// the draw walks the kept tokens by descending logit (ties by index) until the cumulative
/// weight passes `u · kept mass`. Only as many of the best tokens as the walk needs are sorted
/// (64, then 4× more at a time), and every sum is taken in a fixed order, so the result is
/// identical to sorting the whole vocabulary — at a fraction of the cost on a 50k vocabulary.
/// Without a finite best logit, or when `1 / temperature` overflows, it is greedy.
pub fn sample(logits: &[f32], params: &SamplingParams, row: u32, position: u64) -> u32 {
    if params.temperature == 0.0 || logits.len() <= 1 {
        return argmax(logits);
    }
    let by_logit = |a: &u32, b: &u32| {
        logits[*b as usize]
            .total_cmp(&logits[*a as usize])
            .then(a.cmp(b))
    };
    // The candidate set, kept in ascending index order for the order-sensitive sums below.
    let mut cand: Vec<u32> = (0..logits.len() as u32).collect();
    if let Some(k) = params.top_k.filter(|&k| k < cand.len()) {
        cand.select_nth_unstable_by(k - 1, by_logit);
        cand.truncate(k);
        cand.sort_unstable();
    }
    let max = cand
        .iter()
        .map(|&i| logits[i as usize])
        .fold(f32::NEG_INFINITY, f32::max);
    let inv_t = 1.0 / params.temperature;
    // No finite best logit (all -inf, or a +inf one), or a temperature so small that 1 / T
    // overflows: the softmax is undefined or a point mass, so take the greedy token (as the
    // device sampler, `device`, does). Without this the weights below are NaN.
    if !max.is_finite() || !inv_t.is_finite() {
        return argmax(logits);
    }
    // Weight relative to the most likely token (which weighs exactly 1).
    let w = |i: u32| ((logits[i as usize] - max) * inv_t).exp();
    if let Some(mp) = params.min_p {
        cand.retain(|&i| w(i) >= mp);
    }
    let total: f32 = cand.iter().map(|&i| w(i)).sum();
    let nucleus = params.top_p.map(|p| p * total);
    let u = uniform(params.seed, row, position);
    let mut m = 64usize;
    loop {
        let full = m >= cand.len();
        let mut top = cand.clone();
        if !full {
            top.select_nth_unstable_by(m - 1, by_logit);
            top.truncate(m);
        }
        top.sort_unstable_by(by_logit);
        // The kept prefix and its mass: up to the top-p crossing, or everything.
        let (kept, mass) = match nucleus {
            Some(target) => {
                let mut cum = 0.0f32;
                match top.iter().position(|&i| {
                    cum += w(i);
                    cum >= target
                }) {
                    Some(n) => (n + 1, cum),
                    None if full => (top.len(), cum),
                    None => {
                        m *= 4;
                        continue;
                    }
                }
            }
            None => (top.len(), total),
        };
        let target = u * mass;
        let mut cum = 0.0f32;
        for &i in &top[..kept] {
            cum += w(i);
            if target < cum {
                return i;
            }
        }
        // Only rounding can leave the walk short once the whole kept set was seen.
        if full || nucleus.is_some() {
            return top[kept - 1];
        }
        m *= 4;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_first_maximum() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
        assert_eq!(argmax(&[f32::NAN, 0.5, 0.1]), 1);
        let p = SamplingParams::default();
        assert_eq!(sample(&[0.0, 9.0, 9.0], &p, 0, 0), 1);
    }

    #[test]
    fn top_k_one_is_greedy_and_seeds_reproduce() {
        let logits: Vec<f32> = (0..100).map(|i| ((i * 37) % 17) as f32 * 0.3).collect();
        let p = SamplingParams {
            temperature: 1.0,
            top_k: Some(1),
            seed: 7,
            ..SamplingParams::default()
        };
        assert_eq!(sample(&logits, &p, 0, 3), argmax(&logits));
        let p = SamplingParams { top_k: None, ..p };
        let a: Vec<u32> = (0..50).map(|pos| sample(&logits, &p, 0, pos)).collect();
        let b: Vec<u32> = (0..50).map(|pos| sample(&logits, &p, 0, pos)).collect();
        assert_eq!(a, b);
        let c: Vec<u32> = (0..50)
            .map(|pos| sample(&logits, &SamplingParams { seed: 8, ..p }, 0, pos))
            .collect();
        assert_ne!(a, c, "different seeds gave identical 50-token draws");
        let rows: Vec<u32> = (0..50).map(|r| sample(&logits, &p, r, 0)).collect();
        assert!(
            rows.iter().any(|&t| t != rows[0]),
            "rows are not independent"
        );
    }

    #[test]
    fn frequencies_follow_the_softmax_and_top_p_cuts_the_tail() {
        // p = softmax([ln 6, ln 3, ln 1]) = [0.6, 0.3, 0.1]
        let logits = [6f32.ln(), 3f32.ln(), 0.0];
        let p = SamplingParams {
            temperature: 1.0,
            seed: 1,
            ..SamplingParams::default()
        };
        let n = 20000;
        let mut counts = [0usize; 3];
        for pos in 0..n {
            counts[sample(&logits, &p, 0, pos) as usize] += 1;
        }
        let freq: Vec<f64> = counts.iter().map(|&c| c as f64 / n as f64).collect();
        for (f, want) in freq.iter().zip([0.6, 0.3, 0.1]) {
            assert!((f - want).abs() < 0.015, "{freq:?}");
        }
        let p = SamplingParams {
            top_p: Some(0.85),
            ..p
        };
        assert!((0..2000).all(|pos| sample(&logits, &p, 0, pos) != 2));
        // min-p 0.4: 0.1/0.6 and 0.3/0.6=0.5 → only token 2 (ratio 1/6) is dropped.
        let p = SamplingParams {
            top_p: None,
            min_p: Some(0.4),
            ..p
        };
        let draws: Vec<u32> = (0..2000).map(|pos| sample(&logits, &p, 0, pos)).collect();
        assert!(draws.iter().all(|&t| t != 2) && draws.contains(&1));
    }

    /// The partial sort must pick exactly what a full sort of the vocabulary would.
    #[test]
    fn partial_selection_matches_a_full_sort() {
        let logits: Vec<f32> = (0..5000)
            .map(|i| (((i * 7919) % 1000) as f32) * 0.01 - 3.0)
            .collect();
        let reference = |p: &SamplingParams, pos: u64| -> u32 {
            let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
            idx.sort_by(|a, b| {
                logits[*b as usize]
                    .total_cmp(&logits[*a as usize])
                    .then(a.cmp(b))
            });
            if let Some(k) = p.top_k {
                idx.truncate(k);
            }
            let max = logits[idx[0] as usize];
            let w: Vec<f32> = idx
                .iter()
                .map(|&i| ((logits[i as usize] - max) / p.temperature).exp())
                .collect();
            let mut by_index: Vec<(u32, f32)> =
                idx.iter().copied().zip(w.iter().copied()).collect();
            by_index.retain(|&(_, x)| p.min_p.is_none_or(|mp| x >= mp));
            let kept: std::collections::HashSet<u32> = by_index.iter().map(|e| e.0).collect();
            by_index.sort_by_key(|e| e.0);
            let total: f32 = by_index.iter().map(|e| e.1).sum();
            let sorted: Vec<(u32, f32)> = idx
                .iter()
                .copied()
                .zip(w)
                .filter(|e| kept.contains(&e.0))
                .collect();
            let mut n = sorted.len();
            let mut mass = total;
            if let Some(tp) = p.top_p {
                let mut cum = 0.0;
                for (j, e) in sorted.iter().enumerate() {
                    cum += e.1;
                    if cum >= tp * total {
                        n = j + 1;
                        break;
                    }
                }
                mass = sorted[..n].iter().map(|e| e.1).sum();
            }
            let target = uniform(p.seed, 0, pos) * mass;
            let mut cum = 0.0;
            for e in &sorted[..n] {
                cum += e.1;
                if target < cum {
                    return e.0;
                }
            }
            sorted[n - 1].0
        };
        for (t, k, mp, tp) in [
            (1.0, None, None, None),
            (0.7, Some(40), None, Some(0.9)),
            (2.0, None, None, Some(0.95)),
            (1.3, None, Some(0.05), None),
            (3.0, None, None, None),
        ] {
            let p = SamplingParams {
                temperature: t,
                top_k: k,
                min_p: mp,
                top_p: tp,
                seed: 5,
                ..SamplingParams::default()
            };
            for pos in 0..200 {
                assert_eq!(
                    sample(&logits, &p, 0, pos),
                    reference(&p, pos),
                    "{p:?} at {pos}"
                );
            }
        }
    }

    /// Degenerate rows are greedy instead of NaN weights (all -inf with min-p used to panic).
    #[test]
    fn non_finite_rows_and_tiny_temperatures_are_greedy() {
        let p = SamplingParams {
            temperature: 1.0,
            min_p: Some(0.1),
            top_p: Some(0.9),
            ..SamplingParams::default()
        };
        let ninf = f32::NEG_INFINITY;
        assert_eq!(sample(&[ninf; 100], &p, 0, 0), 0);
        assert_eq!(
            sample(&[0.0, f32::INFINITY, 1.0, f32::INFINITY], &p, 0, 0),
            1
        );
        let tiny = SamplingParams {
            temperature: 1e-39,
            ..p
        };
        assert_eq!(sample(&[0.5, 0.25, 0.75, 0.0], &tiny, 0, 0), 2);
    }

    #[test]
    fn repetition_penalty_shrinks_seen_tokens_once() {
        let mut l = [2.0f32, -1.0, 3.0];
        apply_repetition_penalty(&mut l, &[0, 1, 0, 0], 2.0);
        assert_eq!(l, [1.0, -2.0, 3.0]);
    }

    #[test]
    fn bad_parameters_are_rejected() {
        let ok = SamplingParams::default();
        assert!(ok.validate().is_ok());
        assert_eq!(
            SamplingParams {
                temperature: -1.0,
                ..ok
            }
            .validate(),
            Err(SampleError::Temperature(-1.0))
        );
        assert!(SamplingParams {
            top_p: Some(0.0),
            ..ok
        }
        .validate()
        .is_err());
        assert!(SamplingParams {
            top_p: Some(1.5),
            ..ok
        }
        .validate()
        .is_err());
        assert_eq!(
            SamplingParams {
                top_k: Some(0),
                ..ok
            }
            .validate(),
            Err(SampleError::TopK)
        );
        assert!(SamplingParams {
            min_p: Some(1.5),
            ..ok
        }
        .validate()
        .is_err());
        assert!(SamplingParams {
            repetition_penalty: Some(0.0),
            ..ok
        }
        .validate()
        .is_err());
    }
}

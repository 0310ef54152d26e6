//! Choosing the next token from logits. Randomness comes from Philox-4x32-10 keyed by
//! `(seed, row, position)`: counter-based, so a draw depends only on where it happens, never on
//! how many draws came before or on which thread made them — the property that lets the GPU's
//! on-device sampler reproduce the CPU's choices.

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
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 is greedy (argmax, first index on ties).
    pub temperature: f32,
    pub top_k: Option<usize>,
    pub top_p: Option<f32>,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: None,
            top_p: None,
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
        Ok(())
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
pub fn sample(logits: &[f32], params: &SamplingParams, row: u32, position: u64) -> u32 {
    if params.temperature == 0.0 || logits.len() <= 1 {
        return argmax(logits);
    }
    // Candidates by descending logit, ties by index, so the walk below is deterministic.
    let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
    let by_logit = |a: &u32, b: &u32| {
        logits[*b as usize]
            .total_cmp(&logits[*a as usize])
            .then(a.cmp(b))
    };
    if let Some(k) = params.top_k.filter(|&k| k < idx.len()) {
        idx.select_nth_unstable_by(k - 1, by_logit);
        idx.truncate(k);
    }
    idx.sort_unstable_by(by_logit);
    let max = logits[idx[0] as usize];
    let inv_t = 1.0 / params.temperature;
    let mut probs: Vec<f32> = idx
        .iter()
        .map(|&i| ((logits[i as usize] - max) * inv_t).exp())
        .collect();
    let total: f32 = probs.iter().sum();
    let mut keep = probs.len();
    if let Some(p) = params.top_p {
        let mut cum = 0.0;
        for (n, q) in probs.iter().enumerate() {
            cum += q / total;
            if cum >= p {
                keep = n + 1;
                break;
            }
        }
        probs.truncate(keep);
    }
    let kept: f32 = probs.iter().sum();
    let target = uniform(params.seed, row, position) * kept;
    let mut cum = 0.0;
    for (n, q) in probs.iter().enumerate() {
        cum += q;
        if target < cum {
            return idx[n];
        }
    }
    idx[keep - 1]
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
            top_p: None,
            seed: 7,
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
        assert!(rows.iter().any(|&t| t != rows[0]), "rows are not independent");
    }

    #[test]
    fn frequencies_follow_the_softmax_and_top_p_cuts_the_tail() {
        // p = softmax([ln 6, ln 3, ln 1]) = [0.6, 0.3, 0.1]
        let logits = [6f32.ln(), 3f32.ln(), 0.0];
        let p = SamplingParams {
            temperature: 1.0,
            top_k: None,
            top_p: None,
            seed: 1,
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
        let p = SamplingParams { top_p: Some(0.85), ..p };
        assert!((0..2000).all(|pos| sample(&logits, &p, 0, pos) != 2));
    }

    #[test]
    fn bad_parameters_are_rejected() {
        let ok = SamplingParams::default();
        assert!(ok.validate().is_ok());
        assert_eq!(
            SamplingParams { temperature: -1.0, ..ok }.validate(),
            Err(SampleError::Temperature(-1.0))
        );
        assert!(SamplingParams { top_p: Some(0.0), ..ok }.validate().is_err());
        assert!(SamplingParams { top_p: Some(1.5), ..ok }.validate().is_err());
        assert_eq!(SamplingParams { top_k: Some(0), ..ok }.validate(), Err(SampleError::TopK));
    }
}

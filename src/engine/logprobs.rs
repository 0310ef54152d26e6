//! Log-probabilities of the tokens a row takes, computed only for requests that ask
//! ([`super::GenerateOptions::logprobs`]): they cost a copy of the row's logits, a
//! log-sum-exp over the vocabulary and a top-k selection per token.
//!
//! They are of the model's own next-token distribution: the log-softmax of the raw logits,
//! before the logits processor, penalties, the constraint mask, temperature and top-k/top-p/
//! min-p truncation (what vLLM returns by default). So a token's log-probability does not
//! depend on how it was sampled, a greedy and a sampled request report the same numbers for
//! the same token, and a forced (tool) token gets the model's probability of it too.

/// One taken token's log-probability and the most likely alternatives at its position.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprobs {
    /// Natural log of the model's probability of the token taken.
    pub logprob: f32,
    /// The `k` most likely tokens with their log-probabilities, most likely first (ties by
    /// lower id); `k` is the request's.
    pub top: Vec<(u32, f32)>,
}

/// Holds a row's raw logits between choosing a token and knowing which it was.
pub(super) struct RawLogits {
    logits: Vec<f32>,
    /// `ln Σ exp(logit)` over the vocabulary.
    log_sum_exp: f64,
    top: Vec<(u32, f32)>,
}

impl RawLogits {
    /// Reads `logits` (before anything adjusts them) and selects the `k` most likely tokens.
    pub fn new(logits: &[f32], k: usize) -> RawLogits {
        let max = logits
            .iter()
            .copied()
            .filter(|l| !l.is_nan())
            .fold(f32::NEG_INFINITY, f32::max);
        let log_sum_exp = if max.is_finite() {
            let sum: f64 = logits
                .iter()
                .filter(|l| !l.is_nan())
                .map(|&l| f64::from(l - max).exp())
                .sum();
            f64::from(max) + sum.ln()
        } else {
            f64::from(max)
        };
        let k = k.min(logits.len());
        let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
        // Most likely first, NaN last, ties by lower id.
        let order = |a: &u32, b: &u32| {
            let (x, y) = (logits[*a as usize], logits[*b as usize]);
            y.partial_cmp(&x)
                .unwrap_or_else(|| x.is_nan().cmp(&y.is_nan()))
                .then(a.cmp(b))
        };
        if k > 0 && k < ids.len() {
            ids.select_nth_unstable_by(k - 1, order);
        }
        ids.truncate(k);
        ids.sort_unstable_by(order);
        let mut raw = RawLogits {
            logits: logits.to_vec(),
            log_sum_exp,
            top: Vec::new(),
        };
        raw.top = ids.into_iter().map(|t| (t, raw.logprob(t))).collect();
        raw
    }

    fn logprob(&self, token: u32) -> f32 {
        self.logits
            .get(token as usize)
            .map_or(f32::NEG_INFINITY, |&l| {
                (f64::from(l) - self.log_sum_exp) as f32
            })
    }

    /// The log-probabilities once the row took `token`.
    pub fn taken(self, token: u32) -> TokenLogprobs {
        TokenLogprobs {
            logprob: self.logprob(token),
            top: self.top,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::RawLogits;

    #[test]
    fn log_softmax_and_top_k() {
        let logits = [1.0f32, 3.0, 2.0, 3.0];
        let z: f64 = logits.iter().map(|&l| f64::from(l).exp()).sum();
        let lp = |l: f32| (f64::from(l) - z.ln()) as f32;
        let got = RawLogits::new(&logits, 3).taken(0);
        assert_eq!(got.logprob, lp(1.0));
        // The tie between ids 1 and 3 goes to the lower id.
        assert_eq!(got.top, vec![(1, lp(3.0)), (3, lp(3.0)), (2, lp(2.0))]);
        let none = RawLogits::new(&logits, 0).taken(2);
        assert!(none.top.is_empty());
        assert_eq!(none.logprob, lp(2.0));
        // k beyond the vocabulary gives every token.
        assert_eq!(RawLogits::new(&logits, 9).taken(1).top.len(), 4);
    }
}

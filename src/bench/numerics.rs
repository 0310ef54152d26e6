//! What a faster numerics mode costs against the exact path: two engines over the same model
//! decode the same greedy sequence in lockstep. The exact engine chooses every token (argmax);
//! the other is fed the same tokens, so at every step both see the same history and their
//! next-token distributions can be compared directly:
//! - **leading agreement**: greedy tokens the other engine would produce identically before its
//!   first different choice (with identical histories until then, its free-running greedy output
//!   agrees for exactly that many tokens);
//! - **top-1 agreement**: the share of steps whose argmax agrees;
//! - **KL divergence** `KL(p_exact ‖ p_other)` of the two softmax distributions, mean and max
//!   over the steps (computed in f64).
//!
//! A mode that changes only calls of many tokens (`Numerics::Bf16`: prefill) would show almost
//! nothing in lockstep decoding, so [`compare_prefill`] measures it teacher-forced instead: the
//! other engine computes the logits of every step in one prefill of the exact engine's whole
//! sequence, through the multi-token kernels the mode changes.

use std::sync::Arc;

use serde::Serialize;

use crate::backend::cpu::Workspace;
use crate::backend::TokenRow;
use crate::engine::{Engine, EngineError, Session};

/// Prompts for the comparison: chat and raw text, prose and code.
pub const PROMPTS: [&str; 4] = [
    "Explain how a hash map works and when to use one.",
    "Write a Python function that parses a CSV file and returns the average of each column.",
    "The history of the printing press begins",
    "Summarize the plot of a story about a robot who learns to paint.",
];

#[derive(Clone, Debug, Serialize)]
pub struct Agreement {
    pub prompt_tokens: usize,
    pub steps: usize,
    /// Greedy tokens equal before the first different choice (`steps` if none differs).
    pub leading: usize,
    /// Steps whose argmax agrees.
    pub top1_equal: usize,
    pub mean_kl: f64,
    pub max_kl: f64,
}

impl Agreement {
    /// Nothing compared yet: every step counted as leading until one differs.
    fn new(prompt_tokens: usize, steps: usize) -> Agreement {
        Agreement {
            prompt_tokens,
            steps,
            leading: steps,
            top1_equal: 0,
            mean_kl: 0.0,
            max_kl: 0.0,
        }
    }

    /// Step `step`'s two next-token distributions (as logits), exact first.
    fn add_step(&mut self, step: usize, exact: &[f32], other: &[f32]) {
        if argmax(exact) == argmax(other) {
            self.top1_equal += 1;
        } else if self.leading == self.steps {
            self.leading = step;
        }
        let kl = kl_divergence(&log_softmax(exact), &log_softmax(other));
        self.mean_kl += kl / self.steps as f64;
        self.max_kl = self.max_kl.max(kl);
    }
}

/// The index of the largest logit (the lowest index among equals, as greedy sampling takes it).
fn argmax(logits: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best
}

/// `log softmax(logits)` in f64.
fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits
        .iter()
        .fold(f64::NEG_INFINITY, |m, &v| m.max(v as f64));
    let sum: f64 = logits.iter().map(|&v| (v as f64 - max).exp()).sum();
    let lse = max + sum.ln();
    logits.iter().map(|&v| v as f64 - lse).collect()
}

/// `KL(p ‖ q) = Σ p·(log p − log q)` from log-probabilities.
pub fn kl_divergence(logp: &[f64], logq: &[f64]) -> f64 {
    logp.iter()
        .zip(logq)
        .map(|(&a, &b)| {
            if a.is_finite() {
                a.exp() * (a - b)
            } else {
                0.0
            }
        })
        .sum()
}

/// Decodes `steps` greedy tokens after `prompt` with `exact` choosing and `other` following (see
/// the module documentation). Both engines must hold the same model.
pub fn compare(
    exact: &Arc<Engine>,
    other: &Arc<Engine>,
    prompt: &[u32],
    steps: usize,
) -> Result<Agreement, EngineError> {
    let capacity = prompt.len() + steps;
    let mut a = Session::new(exact.clone(), capacity, 1);
    let mut b = Session::new(other.clone(), capacity, 1);
    let mut la = a.feed(prompt)?.to_vec();
    let mut lb = b.feed(prompt)?.to_vec();
    let mut r = Agreement::new(prompt.len(), steps);
    for step in 0..steps {
        r.add_step(step, &la, &lb);
        let ta = argmax(&la);
        if step + 1 < steps {
            let t = [ta as u32];
            la = a.feed(&t)?.to_vec();
            lb = b.feed(&t)?.to_vec();
        }
    }
    Ok(r)
}

/// As [`compare`], with `other`'s logits for every step from one prefill of the prompt and the
/// tokens `exact` chose (see the module documentation). `other` must be a CPU engine.
pub fn compare_prefill(
    exact: &Arc<Engine>,
    other: &Arc<Engine>,
    prompt: &[u32],
    steps: usize,
) -> Result<Agreement, EngineError> {
    let capacity = prompt.len() + steps;
    let mut a = Session::new(exact.clone(), capacity, 1);
    let mut la = a.feed(prompt)?.to_vec();
    let mut exact_logits = Vec::with_capacity(steps);
    let mut sequence = prompt.to_vec();
    for step in 0..steps {
        let t = argmax(&la) as u32;
        exact_logits.push(std::mem::take(&mut la));
        if step + 1 < steps {
            sequence.push(t);
            la = a.feed(&[t])?.to_vec();
        }
    }
    let backend = other.cpu_backend().ok_or_else(|| {
        EngineError::Request("a teacher-forced comparison needs a CPU engine".into())
    })?;
    let mut kv = backend.new_cache(1, capacity)?;
    let mut ws = Workspace::new();
    let rows: Vec<TokenRow> = (0..sequence.len())
        .map(|pos| TokenRow { slot: 0, pos })
        .collect();
    let logit_rows: Vec<usize> = (prompt.len() - 1..sequence.len()).collect();
    let mut lb = Vec::new();
    backend.forward_selected(&mut ws, &mut kv, &sequence, &rows, &logit_rows, &mut lb)?;
    let vocab = lb.len() / logit_rows.len();
    let mut r = Agreement::new(prompt.len(), steps);
    for (step, la) in exact_logits.iter().enumerate() {
        r.add_step(step, la, &lb[step * vocab..(step + 1) * vocab]);
    }
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kl_divergence_by_hand() {
        // p = (1/4, 3/4), q = (1/2, 1/2): KL = ¼·ln(½) + ¾·ln(3/2).
        let p = log_softmax(&[0.0, 3f32.ln()]);
        let q = log_softmax(&[5.0, 5.0]);
        let want = 0.25 * 0.5f64.ln() + 0.75 * 1.5f64.ln();
        assert!(
            (kl_divergence(&p, &q) - want).abs() < 1e-7,
            "{}",
            kl_divergence(&p, &q)
        );
        assert!(kl_divergence(&p, &p).abs() < 1e-15);
        assert_eq!(argmax(&[0.0, 3.0, 3.0, 1.0]), 1);
    }
}

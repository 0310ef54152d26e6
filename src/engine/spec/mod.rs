//! Speculative decoding for one sequence: something cheap proposes the next `k` tokens, the
//! target model scores all of them in one forward pass (one row per proposal), and the
//! longest prefix the target agrees with is kept, plus one token of the target's own. The
//! output is the target's: identical to plain decoding when greedy, and distributed as the
//! target's when sampled (the speculative-sampling accept/resample rule, [`dist::judge`]).
//!
//! Proposals come from the sequence itself ([`SpecMethod::Ngram`], prompt lookup) or from a
//! smaller model sharing the tokenizer ([`SpecMethod::Draft`]). How many are proposed adapts
//! to how many were accepted. Rejected positions are cut from the sequence's cache only.

mod decode;
mod dist;
mod draft;
mod draft_batch;
mod ngram;

use std::path::PathBuf;
use std::sync::Arc;

use serde::Serialize;

use super::row::{RowRules, RowState};
use super::{BatchResult, Engine, EngineError};
use dist::{judge, uniform_for, Dist, Draw, Verdict};
use draft::DraftRunner;
pub(crate) use draft::Proposal;
pub(crate) use draft_batch::{DraftAsk, DraftBatch};

/// Where proposals come from.
#[derive(Clone)]
pub enum SpecMethod {
    /// The continuation of the longest earlier match of the sequence's last tokens in its own
    /// tokens (no second model).
    Ngram,
    /// A smaller model with the same vocabulary, checked by [`SpecOptions::draft`].
    Draft(Arc<Engine>),
}

impl std::fmt::Debug for SpecMethod {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SpecMethod::Ngram => f.write_str("Ngram"),
            SpecMethod::Draft(e) => write!(f, "Draft({})", e.model_path().display()),
        }
    }
}

#[derive(Clone, Debug)]
pub struct SpecOptions {
    pub method: SpecMethod,
    /// The most tokens proposed per verification pass.
    pub max_draft: usize,
    /// Grow the proposal length by one after a pass that accepted everything, shrink it by one
    /// after a pass that did not (never past `max_draft`, never below 1).
    pub adaptive: bool,
}

impl SpecOptions {
    pub fn ngram(max_draft: usize) -> Result<SpecOptions, SpecError> {
        Self::with(SpecMethod::Ngram, max_draft)
    }

    /// Drafting with `draft` for `target`: refused unless both have the same vocabulary.
    pub fn draft(
        target: &Engine,
        draft: Arc<Engine>,
        max_draft: usize,
    ) -> Result<SpecOptions, SpecError> {
        draft::check_same_vocabulary(target, &draft)?;
        Self::with(SpecMethod::Draft(draft), max_draft)
    }

    /// The checks a scheduler makes on options it is handed (they may have been built field
    /// by field): a proposal length of at least 1, and a draft with the target's vocabulary
    /// size (the full token-by-token check is [`SpecOptions::draft`]'s).
    pub(crate) fn check_for(&self, target: &Engine) -> Result<(), SpecError> {
        if self.max_draft == 0 {
            return Err(SpecError::MaxDraft);
        }
        if let SpecMethod::Draft(d) = &self.method {
            let (tv, dv) = (target.config().vocab_size, d.config().vocab_size);
            if tv != dv {
                return Err(SpecError::DraftVocabulary {
                    target: target.model_path().to_path_buf(),
                    draft: d.model_path().to_path_buf(),
                    reason: format!("vocabulary of {dv} tokens, the target's has {tv}"),
                });
            }
        }
        Ok(())
    }

    /// The proposal length after a pass that proposed `proposed` tokens and had `accepted` of
    /// them taken: one longer after a clean sweep, one shorter otherwise (within 1 and
    /// `max_draft`); unchanged when not adaptive or nothing was proposed.
    pub(crate) fn next_k(&self, k: usize, proposed: usize, accepted: usize) -> usize {
        if !self.adaptive || proposed == 0 {
            k
        } else if accepted == proposed {
            (k + 1).min(self.max_draft)
        } else {
            k.saturating_sub(1).max(1)
        }
    }

    fn with(method: SpecMethod, max_draft: usize) -> Result<SpecOptions, SpecError> {
        if max_draft == 0 {
            return Err(SpecError::MaxDraft);
        }
        Ok(SpecOptions {
            method,
            max_draft,
            adaptive: true,
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    #[error(
        "the draft model {draft} cannot draft for {target}: its {reason} (drafting needs the \
         target's tokenizer, id for id)"
    )]
    DraftVocabulary {
        target: PathBuf,
        draft: PathBuf,
        reason: String,
    },
    #[error("the draft length (max_draft) must be ≥ 1")]
    MaxDraft,
    #[error("speculative decoding runs one sample row per request; num_samples = {0}")]
    Samples(usize),
}

/// How speculation went for one request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct SpecStats {
    /// Tokens proposed (forced tool tokens, which need no guessing, are not counted).
    pub proposed: usize,
    /// Proposed tokens the target agreed with.
    pub accepted: usize,
    /// Target forward passes after the prefill (each verifies one batch of proposals, or
    /// none, and yields at least one token).
    pub verify_passes: usize,
    /// Passes with nothing to verify whose token was drawn on the device (one replay of the
    /// decode graph on a megakernel engine, else a step sampling on the device) instead of
    /// taking the logits to the host: 0 on the CPU.
    pub device_draws: usize,
}

impl SpecStats {
    /// Accepted over proposed (0 when nothing was proposed).
    pub fn acceptance_rate(&self) -> f64 {
        if self.proposed == 0 {
            0.0
        } else {
            self.accepted as f64 / self.proposed as f64
        }
    }
}

/// A speculative request's result: what plain generation returns, and the speculation's
/// statistics.
#[derive(Clone, Debug, Serialize)]
pub struct SpecResult {
    #[serde(flatten)]
    pub batch: BatchResult,
    pub spec: SpecStats,
}

/// One sequence's source of proposals: prompt lookup, or its own draft-model cache.
pub(crate) enum Proposer {
    Ngram,
    Draft(Box<DraftRunner>),
}

impl Proposer {
    /// A proposer for `method`; a draft's cache holds up to `capacity` positions.
    pub fn new(method: &SpecMethod, capacity: usize) -> Proposer {
        match method {
            SpecMethod::Ngram => Proposer::Ngram,
            SpecMethod::Draft(d) => Proposer::Draft(Box::new(DraftRunner::new(d, capacity))),
        }
    }

    /// Up to `k` tokens continuing `context`, each with the draft distribution it was drawn
    /// from (`None`: a point mass); a draft samples as `sampling` says, keyed by `row`.
    pub fn propose(
        &mut self,
        context: &[u32],
        k: usize,
        sampling: &crate::sample::SamplingParams,
        row: u32,
    ) -> Result<Vec<Proposal>, EngineError> {
        match self {
            Proposer::Ngram => Ok(lookup(context, k)),
            Proposer::Draft(d) => d.propose(context, k, sampling, row),
        }
    }
}

/// Up to `k` proposals by prompt lookup ([`SpecMethod::Ngram`]) continuing `context`.
pub(crate) fn lookup(context: &[u32], k: usize) -> Vec<Proposal> {
    ngram::propose(context, k)
        .into_iter()
        .map(|token| Proposal { token, q: None })
        .collect()
}

/// The token a verifying row takes at `pos` from its `logits`, given the proposal made for
/// that position (if any): a forced tool token or a greedy/sampled choice exactly as plain
/// decoding makes it, except that a sampled row judges a guessed proposal by the
/// speculative-sampling rule (accept it, or resample from the residual), with Philox draws
/// keyed by `(seed, row_id, pos)`. `None` when no token continues the row's constraint.
pub(in crate::engine) fn choose_verified(
    row: &mut RowState,
    rules: &RowRules<'_>,
    row_id: usize,
    context: &[u32],
    pos: usize,
    logits: &mut [f32],
    proposal: Option<&Proposal>,
) -> Option<(u32, u8)> {
    let sampling = &rules.opts.sampling;
    match proposal {
        Some(p) if sampling.temperature > 0.0 && row.tool.forced.is_empty() => {
            row.keep_raw(rules, logits);
            if !row.shape(rules, row_id, context, logits) {
                return None;
            }
            let target = Dist::of(logits, sampling);
            let (seed, r, at) = (sampling.seed, row_id as u32, pos as u64);
            let (u, v) = (
                uniform_for(Draw::Accept, seed, r, at),
                uniform_for(Draw::Resample, seed, r, at),
            );
            match judge(&target, p.token, p.q.as_ref(), u, v) {
                Verdict::Accept => Some((p.token, 1)),
                Verdict::Replace(t) => Some((t, 1)),
            }
        }
        _ => row.choose(rules, row_id, context, pos, logits),
    }
}

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
mod ngram;

use std::path::PathBuf;
use std::sync::Arc;

use serde::Serialize;

use super::{BatchResult, Engine};

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

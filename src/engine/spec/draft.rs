//! A smaller model sharing the target's tokenizer proposes the continuation (e.g.
//! Qwen2.5-Coder-0.5B drafting for the 1.5B). It keeps its own cache for the sequence: each
//! proposal first rolls that cache back to the longest prefix it shares with the sequence
//! (dropping the rejected proposals), feeds the new tokens, then runs `k` one-token steps.

use std::sync::Arc;

use super::dist::{uniform_for, Dist, Draw};
use super::SpecError;
use crate::engine::{Engine, EngineError, Session};
use crate::sample::{argmax, SamplingParams};

/// Refuses a draft whose tokens are not the target's, id for id: its proposals would be
/// other words, and its vocabulary-sized distributions would not line up.
pub(crate) fn check_same_vocabulary(target: &Engine, draft: &Engine) -> Result<(), SpecError> {
    let mismatch = |reason: String| SpecError::DraftVocabulary {
        target: target.model_path().to_path_buf(),
        draft: draft.model_path().to_path_buf(),
        reason,
    };
    let (tv, dv) = (target.config().vocab_size, draft.config().vocab_size);
    if tv != dv {
        return Err(mismatch(format!(
            "vocabulary of {dv} tokens, the target's has {tv}"
        )));
    }
    let (tt, dt) = (target.tokenizer(), draft.tokenizer());
    if tt.vocab_size() != dt.vocab_size() {
        return Err(mismatch(format!(
            "tokenizer of {} tokens, the target's has {}",
            dt.vocab_size(),
            tt.vocab_size()
        )));
    }
    for id in 0..tt.vocab_size() as u32 {
        let (a, b) = (tt.id_to_token(id), dt.id_to_token(id));
        if a != b {
            return Err(mismatch(format!(
                "token {id} is {b:?} in the draft and {a:?} in the target"
            )));
        }
    }
    Ok(())
}

/// One sequence's draft model and cache.
pub(crate) struct DraftRunner {
    session: Session,
}

/// A proposed token and, when it was sampled, the draft distribution it came from.
pub(crate) struct Proposal {
    pub token: u32,
    pub q: Option<Dist>,
}

/// The draft's proposal for position `pos` of row `row` from its `logits`: the argmax when
/// `sampling` is greedy, else a draw from the draft's distribution under the same parameters,
/// keyed by `(seed, row, pos)` on a stream of its own.
pub(crate) fn pick(logits: &[f32], sampling: &SamplingParams, row: u32, pos: usize) -> Proposal {
    if sampling.temperature == 0.0 {
        return Proposal {
            token: argmax(logits),
            q: None,
        };
    }
    let q = Dist::of(logits, sampling);
    let u = uniform_for(Draw::Draft, sampling.seed, row, pos as u64);
    Proposal {
        token: q.pick(u),
        q: Some(q),
    }
}

impl DraftRunner {
    pub fn new(draft: &Arc<Engine>, capacity: usize) -> DraftRunner {
        DraftRunner {
            session: draft.session(capacity),
        }
    }

    /// Up to `k` tokens continuing `context`: greedy when `sampling` is, else each drawn from
    /// the draft's distribution under the same parameters (keyed by `row` and position, on a
    /// stream of its own). Fewer when the draft's cache runs out.
    pub fn propose(
        &mut self,
        context: &[u32],
        k: usize,
        sampling: &SamplingParams,
        row: u32,
    ) -> Result<Vec<Proposal>, EngineError> {
        let capacity = self.session.capacity();
        // The context and all but the last proposal go through the draft's cache.
        let k = k.min((capacity + 1).saturating_sub(context.len()));
        if k == 0 || context.is_empty() || context.len() > capacity {
            return Ok(Vec::new());
        }
        self.session.prefill(context)?;
        let mut out = Vec::with_capacity(k);
        for i in 0..k {
            let proposal = pick(self.session.logits(), sampling, row, context.len() + i);
            let token = proposal.token;
            out.push(proposal);
            if i + 1 < k {
                self.session.feed(&[token])?;
            }
        }
        Ok(out)
    }
}

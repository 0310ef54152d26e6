//! A sequence: one generating row of one request, as the scheduler sees it — its tokens (prompt
//! and accepted tokens), how many of them its cache holds, where that cache is (a slot of the
//! serving cache, or nowhere while it waits or after it was preempted), and its row state
//! (tool state, stop state, finish reason).
//!
//! A sequence's KV never has to survive: when the pool runs short the scheduler frees it and
//! later recomputes it from `tokens` (the prefix cache usually still holds most of it).

use std::sync::Arc;

use super::row::RowState;
use super::spec::{Proposal, SpecOptions};
use super::GenerateOptions;

/// Identifies a request for as long as the engine serves it.
pub type RequestId = u64;

pub(super) struct Sequence {
    pub request: RequestId,
    /// Sample row within the request: keys its Philox draws, as in a session.
    pub row: usize,
    pub opts: Arc<GenerateOptions>,
    pub stop_tokens: Arc<Vec<u32>>,
    /// Prompt, then every accepted token that was not the row's last.
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    /// Leading `tokens` whose keys and values are in the cache.
    pub computed: usize,
    /// Where the cache is, if anywhere.
    pub slot: Option<usize>,
    pub state: RowState,
    /// Rows after the first wait for the first to prefill the shared prompt, then start from a
    /// copy of its cache (no copy of memory: shared blocks) and its logits.
    pub waits_for_prompt: bool,
    /// Admission order (lower runs first and is preempted last).
    pub order: u64,
    /// Speculative decoding state, when the request asked for it.
    pub spec: Option<SeqSpec>,
}

/// A speculating sequence's options, its adapted proposal length, and the proposals the
/// planned step verifies. (Prompt lookup needs no state; a draft model's cache for the row is
/// kept by the scheduler's [`super::spec::DraftBatch`] for that draft.)
pub(super) struct SeqSpec {
    pub opts: SpecOptions,
    /// Tokens to propose next (adapted to the acceptance rate, within 1..=max_draft).
    pub k: usize,
    /// What the planned step feeds after the sequence's pending token.
    pub proposals: Vec<Proposal>,
    /// Whether `proposals` were guessed (queued tool output needs no guessing and is not
    /// counted as proposed).
    pub guessed: bool,
}

impl SeqSpec {
    pub fn new(opts: &SpecOptions) -> SeqSpec {
        SeqSpec {
            k: opts.max_draft,
            opts: opts.clone(),
            proposals: Vec::new(),
            guessed: true,
        }
    }
}

impl Sequence {
    /// Tokens still to be fed to the model before the row can choose its next token.
    pub fn pending(&self) -> usize {
        self.tokens.len() - self.computed
    }

    pub fn finished(&self) -> bool {
        self.state.finished
    }

    /// Whether the sequence's next step verifies proposals: it speculates, has taken a token
    /// and feeds only that one. The first token comes from the prompt's logits (however much
    /// of the prompt the prefix cache held), and after a preemption the recomputation chooses
    /// plainly, as a pass without proposals would.
    pub fn verifies(&self) -> bool {
        self.spec.is_some() && self.pending() == 1 && self.state.generated > 0
    }
}

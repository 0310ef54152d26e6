//! A sequence: one generating row of one request, as the scheduler sees it — its tokens (prompt
//! and accepted tokens), how many of them its cache holds, where that cache is (a slot of the
//! serving cache, or nowhere while it waits or after it was preempted), and its row state
//! (tool state, stop state, finish reason).
//!
//! A sequence's KV never has to survive: when the pool runs short the scheduler frees it and
//! later recomputes it from `tokens` (the prefix cache usually still holds most of it).

use std::sync::Arc;

use super::row::RowState;
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
}

impl Sequence {
    /// Tokens still to be fed to the model before the row can choose its next token.
    pub fn pending(&self) -> usize {
        self.tokens.len() - self.computed
    }

    pub fn finished(&self) -> bool {
        self.state.finished
    }
}

//! One generating row's rules, shared by a session's [`super::Stream`] and the scheduler's
//! [`super::sequence::Sequence`]: where its next token comes from (a forced tool token, or a
//! draw from its logits with its own sampling parameters, keyed by its row id and position),
//! the tool state machine, stop tokens, stop strings, `max_tokens` and the context limit.

use super::constraint::Constraint;
use super::logprobs::RawLogits;
use super::stop::TextTracker;
use super::tools::{ToolState, ToolTokens};
use super::{EngineError, FinishReason, GenerateOptions, RowStep};
use crate::sample;
use crate::tokenizer::Tokenizer;

pub(super) struct RowState {
    pub generated: usize,
    pub text: TextTracker,
    pub tool: ToolState,
    /// The row's grammar, advanced by every token it takes (sampled or forced).
    pub constraint: Option<Constraint>,
    pub finished: bool,
    /// The raw logits of the token being chosen, kept by `choose` for `accept` when the
    /// request asks for log-probabilities.
    raw: Option<RawLogits>,
}

/// What every row of one request shares.
pub(super) struct RowRules<'a> {
    pub tokenizer: &'a Tokenizer,
    pub opts: &'a GenerateOptions,
    pub stop_tokens: &'a [u32],
    pub tools: Option<&'a ToolTokens>,
    /// Positions the row's cache may hold.
    pub capacity: usize,
}

impl RowState {
    pub fn new(opts: &GenerateOptions, constraint: Option<Constraint>) -> RowState {
        RowState {
            generated: 0,
            text: TextTracker::new(&opts.stop_strings),
            tool: ToolState::default(),
            constraint,
            finished: false,
            raw: None,
        }
    }

    /// The host's choice of the row's next token: a forced tool token if one is queued, else
    /// a draw from `logits` (after the logits processor, repetition penalty and constraint
    /// mask) keyed by `row_id` and `pos`. Returns the token and its mask (0 forced, 1
    /// sampled), or `None` when no token continues the row's constraint.
    pub fn choose(
        &mut self,
        rules: &RowRules<'_>,
        row_id: usize,
        context: &[u32],
        pos: usize,
        logits: &mut [f32],
    ) -> Option<(u32, u8)> {
        self.keep_raw(rules, logits);
        if let Some(forced) = self.tool.forced.pop_front() {
            return Some((forced, 0));
        }
        if !self.shape(rules, row_id, context, logits) {
            return None;
        }
        Some((
            sample::sample(logits, &rules.opts.sampling, row_id as u32, pos as u64),
            1,
        ))
    }

    /// Keeps the model's raw `logits` for the token about to be taken, when the request asks
    /// for log-probabilities (`accept` reports them).
    pub fn keep_raw(&mut self, rules: &RowRules<'_>, logits: &[f32]) {
        self.raw = rules.opts.logprobs.map(|k| RawLogits::new(logits, k));
    }

    /// Turns the model's logits into the ones the row samples from: the logits processor, the
    /// repetition penalty, then the constraint mask. `false` when no token continues the
    /// row's constraint. (Speculative verification samples from these by its own rule.)
    pub fn shape(
        &mut self,
        rules: &RowRules<'_>,
        row_id: usize,
        context: &[u32],
        logits: &mut [f32],
    ) -> bool {
        if let Some(p) = &rules.opts.logits_processor {
            (p.0)(row_id, context, logits);
        }
        if let Some(p) = rules.opts.sampling.repetition_penalty {
            sample::apply_repetition_penalty(logits, context, p);
        }
        !matches!(
            self.constraint.as_mut().map(|c| c.apply(logits)),
            Some(Err(_))
        )
    }

    /// Takes `token` (chosen for position `pos`) into the row: tool state, counts, text and
    /// stop rules. Returns the row's step; `finished` is set when this was its last token, and
    /// `logprobs` when the request asks for them (from the logits `choose` saw).
    pub fn accept(
        &mut self,
        rules: &RowRules<'_>,
        token: u32,
        mask: u8,
        pos: usize,
    ) -> Result<RowStep, EngineError> {
        let tok = rules.tokenizer;
        if let Some(t) = rules.tools {
            self.tool.on_token(t, tok, token)?;
        }
        let constraint_end = self.constraint.as_mut().and_then(|c| c.commit_row(token));
        self.generated += 1;
        let (mut text, finished) = if rules.stop_tokens.contains(&token) {
            (self.text.finish(tok)?, Some(FinishReason::StopToken))
        } else {
            let (piece, matched) = self.text.push(tok, token)?;
            let reason = if matched {
                Some(FinishReason::StopString)
            } else if constraint_end.is_some() {
                constraint_end
            } else if rules.opts.max_tokens.is_some_and(|m| self.generated >= m) {
                Some(FinishReason::MaxTokens)
            } else if pos >= rules.capacity {
                Some(FinishReason::ContextFull)
            } else {
                None
            };
            (piece, reason)
        };
        if let Some(reason) = finished {
            if reason != FinishReason::StopToken && reason != FinishReason::StopString {
                text.push_str(&self.text.finish(tok)?);
            }
            self.finished = true;
        }
        Ok(RowStep {
            token,
            mask,
            text,
            finished,
            logprobs: self.raw.take().map(|r| r.taken(token)),
        })
    }
}

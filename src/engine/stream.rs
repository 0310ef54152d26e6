//! The step iterator: every row samples (or takes a forced token), checks its stop rules, and
//! the rows still going advance together in one batched forward pass.

use std::time::{Duration, Instant};

use super::session::Session;
use super::stop::TextTracker;
use super::tools::{ToolState, ToolTokens};
use super::{EngineError, FinishReason, GenerateOptions, RowStep, Step, Timings, Usage};
use crate::backend::cpu::{PlanKind, TokenRow};
use crate::sample;

struct RowState {
    generated: usize,
    text: TextTracker,
    tool: ToolState,
    finished: bool,
}

pub struct Stream<'a> {
    s: &'a mut Session,
    opts: GenerateOptions,
    stop_tokens: Vec<u32>,
    tools: Option<ToolTokens>,
    rows: Vec<RowState>,
    /// Rows whose next logits are in `logits`, in order.
    live: Vec<usize>,
    logits: Vec<f32>,
    usage: Usage,
    timings: Timings,
    cancelled: Vec<(usize, FinishReason)>,
}

impl<'a> Stream<'a> {
    pub(super) fn new(
        s: &'a mut Session,
        prompt_len: usize,
        prefill_tokens: usize,
        prefill: Duration,
        opts: &GenerateOptions,
    ) -> Stream<'a> {
        let n = opts.num_samples;
        // Every row starts from the prefill's logits; each samples its own first token.
        let mut logits = Vec::with_capacity(n * s.logits.len());
        for _ in 0..n {
            logits.extend_from_slice(&s.logits);
        }
        let stop_tokens = opts
            .stop_tokens
            .clone()
            .unwrap_or_else(|| s.engine.default_stop_tokens());
        Stream {
            rows: (0..n)
                .map(|_| RowState {
                    generated: 0,
                    text: TextTracker::new(&opts.stop_strings),
                    tool: ToolState::default(),
                    finished: false,
                })
                .collect(),
            live: (0..n).collect(),
            tools: if opts.tools {
                ToolTokens::of(s.engine.tokenizer())
            } else {
                None
            },
            logits,
            s,
            opts: opts.clone(),
            stop_tokens,
            usage: Usage {
                prompt_tokens: prompt_len,
                completion_tokens: 0,
            },
            timings: Timings {
                prefill_tokens,
                prefill,
                ..Timings::default()
            },
            cancelled: Vec::new(),
        }
    }

    pub fn usage(&self) -> Usage {
        self.usage
    }

    pub fn timings(&self) -> Timings {
        self.timings
    }

    pub fn stop_tokens(&self) -> &[u32] {
        &self.stop_tokens
    }

    /// Stops every row still running; they finish with [`FinishReason::Cancelled`].
    pub fn cancel(&mut self) {
        for &r in &self.live {
            self.rows[r].finished = true;
            self.cancelled.push((r, FinishReason::Cancelled));
        }
        self.live.clear();
    }

    /// Rows ended by [`Stream::cancel`] (they got no final step).
    pub fn cancelled_rows(&self) -> Vec<(usize, FinishReason)> {
        self.cancelled.clone()
    }

    fn step(&mut self) -> Result<Step, EngineError> {
        let t0 = Instant::now();
        let vocab = self.s.engine.config().vocab_size;
        let tok = self.s.engine.tokenizer();
        let mut out: Vec<Option<RowStep>> = vec![None; self.rows.len()];
        let mut feed = Vec::new();
        let mut feed_rows = Vec::new();
        for (li, &r) in self.live.iter().enumerate() {
            let logits = &mut self.logits[li * vocab..(li + 1) * vocab];
            let pos = self.s.kv.len(r);
            let row = &mut self.rows[r];
            let (token, mask) = match row.tool.forced.pop_front() {
                Some(forced) => (forced, 0u8),
                None => {
                    if let Some(p) = &self.opts.logits_processor {
                        (p.0)(r, &self.s.tokens[r], logits);
                    }
                    if let Some(p) = self.opts.sampling.repetition_penalty {
                        sample::apply_repetition_penalty(logits, &self.s.tokens[r], p);
                    }
                    (
                        sample::sample(logits, &self.opts.sampling, r as u32, pos as u64),
                        1u8,
                    )
                }
            };
            if let Some(t) = &self.tools {
                row.tool.on_token(t, tok, token)?;
            }
            row.generated += 1;
            self.usage.completion_tokens += 1;
            let (mut text, finished) = if self.stop_tokens.contains(&token) {
                (row.text.finish(tok)?, Some(FinishReason::StopToken))
            } else {
                let (piece, matched) = row.text.push(tok, token)?;
                let reason = if matched {
                    Some(FinishReason::StopString)
                } else if self.opts.max_tokens.is_some_and(|m| row.generated >= m) {
                    Some(FinishReason::MaxTokens)
                } else if pos >= self.s.kv.capacity() {
                    Some(FinishReason::ContextFull)
                } else {
                    None
                };
                (piece, reason)
            };
            if let Some(reason) = finished {
                if reason != FinishReason::StopToken && reason != FinishReason::StopString {
                    text.push_str(&row.text.finish(tok)?);
                }
                row.finished = true;
            } else {
                feed.push(token);
                feed_rows.push(TokenRow { slot: r, pos });
            }
            out[r] = Some(RowStep {
                token,
                mask,
                text,
                finished,
            });
        }
        self.live = feed_rows.iter().map(|t| t.slot).collect();
        if !feed.is_empty() {
            self.s.engine.backend().forward(
                PlanKind::Decode,
                &mut self.s.ws,
                &mut self.s.kv,
                &feed,
                &feed_rows,
                &mut self.logits,
            )?;
            for (t, r) in feed.iter().zip(&feed_rows) {
                self.s.tokens[r.slot].push(*t);
            }
            self.timings.decode_steps += 1;
        }
        self.timings.decode += t0.elapsed();
        Ok(Step { rows: out })
    }
}

impl Iterator for Stream<'_> {
    type Item = Result<Step, EngineError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.opts.max_tokens == Some(0) {
            // Nothing may be generated: every row ends before its first token.
            for r in std::mem::take(&mut self.live) {
                self.rows[r].finished = true;
                self.cancelled.push((r, FinishReason::MaxTokens));
            }
        }
        if self.live.is_empty() {
            return None;
        }
        let res = self.step();
        if res.is_err() {
            self.cancel();
        }
        Some(res)
    }
}

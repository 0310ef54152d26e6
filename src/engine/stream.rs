//! Generating from a session: [`Session::stream`] prefills and returns the step iterator, in
//! which every row samples (or takes a forced token), checks its stop rules, and the rows still
//! going advance together in one batched forward pass.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::collect::RowsCollector;
use super::constraint::{prepare_during, Constraint};
use super::graph_run::GraphRun;
use super::row::{RowRules, RowState};
use super::session::Session;
use super::tools::ToolTokens;
use super::{
    BatchResult, EngineError, FinishReason, GenerateOptions, RowStep, Step, Timings, Usage,
};
use crate::backend::{GraphRow, RowDraw, TokenRow};
use crate::plan::PlanKind;

/// Generation: a session's streams and the batch calls built on them.
impl Session {
    /// Starts generating after `prompt`: prefills once, copies the cache to every sample row,
    /// and returns an iterator over steps.
    pub fn stream(
        &mut self,
        prompt: &[u32],
        opts: &GenerateOptions,
    ) -> Result<Stream<'_>, EngineError> {
        opts.sampling.validate()?;
        if opts.num_samples == 0 {
            return Err(EngineError::NoSamples);
        }
        if opts.num_samples > self.slots() {
            return Err(EngineError::TooManySamples {
                requested: opts.num_samples,
                slots: self.slots(),
            });
        }
        // A bad grammar fails before the prefill; the first mask is computed during it.
        let mut constraint = match &opts.constraint {
            Some(spec) => {
                let factory = self.engine.constraint_factory()?;
                Some(Constraint::new(&factory, spec)?)
            }
            None => None,
        };
        let t0 = Instant::now();
        let ran = prepare_during(constraint.iter_mut().collect(), || self.prefill(prompt))?;
        let len = self.dev.len(0);
        for row in 1..opts.num_samples {
            self.dev.copy_slot(0, row, len)?;
            self.tokens[row] = self.tokens[0].clone();
        }
        let prefill = t0.elapsed();
        Ok(Stream::new(
            self,
            prompt.len(),
            ran,
            prefill,
            opts,
            constraint,
        ))
    }

    /// Generates to completion, calling `on_step` after each step (return `false` to stop).
    pub fn generate(
        &mut self,
        prompt: &[u32],
        opts: &GenerateOptions,
        mut on_step: impl FnMut(&Step) -> bool,
    ) -> Result<BatchResult, EngineError> {
        let mut rows = RowsCollector::new(opts.num_samples);
        let mut stream = self.stream(prompt, opts)?;
        while let Some(step) = stream.next() {
            let step = step?;
            rows.push(&step);
            if !on_step(&step) {
                stream.cancel();
            }
        }
        for (r, reason) in stream.cancelled_rows() {
            rows.set_reason(r, reason);
        }
        let (usage, timings) = (stream.usage(), stream.timings());
        let rows = rows.finish(prompt, stream.stop_tokens());
        Ok(BatchResult {
            rows,
            usage: Usage {
                prompt_tokens: prompt.len(),
                ..usage
            },
            timings,
        })
    }

    /// Runs to completion (nanochat's `generate_batch`).
    pub fn generate_batch(
        &mut self,
        prompt: &[u32],
        opts: &GenerateOptions,
    ) -> Result<BatchResult, EngineError> {
        self.generate(prompt, opts, |_| true)
    }
}

/// Where the next step's tokens come from.
enum Next {
    /// Sampled on the host from `logits` (one row per live row).
    Logits,
    /// Already sampled on the device, one per live row.
    Tokens(Vec<u32>),
    /// The running decode graph's next replay.
    Graph,
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
    next: Next,
    graph: Option<GraphRun>,
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
        constraint: Option<Constraint>,
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
                .map(|_| RowState::new(opts, constraint.as_ref().map(Constraint::fork)))
                .collect(),
            live: (0..n).collect(),
            tools: if opts.tools {
                ToolTokens::of(s.engine.tokenizer())
            } else {
                None
            },
            logits,
            next: Next::Logits,
            graph: None,
            s,
            opts: opts.clone(),
            stop_tokens,
            usage: Usage {
                prompt_tokens: prompt_len,
                ..Usage::default()
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

    /// Rows that ended without a final step: by [`Stream::cancel`], `max_tokens` 0, or a
    /// constraint no token continues ([`FinishReason::ConstraintBroken`]).
    pub fn cancelled_rows(&self) -> Vec<(usize, FinishReason)> {
        self.cancelled.clone()
    }

    fn step(&mut self) -> Result<Step, EngineError> {
        let t0 = Instant::now();
        let vocab = self.s.engine.config().vocab_size;
        let sampled: Option<Vec<u32>> = match std::mem::replace(&mut self.next, Next::Logits) {
            Next::Logits => None,
            Next::Tokens(t) => Some(t),
            Next::Graph => {
                let run = self
                    .graph
                    .as_mut()
                    .expect("Next::Graph is set with a running graph");
                let got = run.next(self.s.memory())?;
                Some(
                    self.live
                        .iter()
                        .map(|r| {
                            got.iter()
                                .find(|g| g.0 == *r)
                                .map(|g| g.1)
                                .expect("every live row is one of the graph's rows")
                        })
                        .collect(),
                )
            }
        };
        let mut out: Vec<Option<RowStep>> = vec![None; self.rows.len()];
        let mut feed = Vec::new();
        let mut feed_rows = Vec::new();
        let rules = RowRules {
            tokenizer: self.s.engine.tokenizer(),
            opts: &self.opts,
            stop_tokens: &self.stop_tokens,
            tools: self.tools.as_ref(),
            capacity: self.s.dev.capacity(),
        };
        for (li, &r) in self.live.iter().enumerate() {
            let pos = self.s.dev.len(r);
            let row = &mut self.rows[r];
            let chosen = match (&sampled, row.tool.forced.is_empty()) {
                (Some(t), true) => Some((t[li], 1u8)),
                _ => row.choose(
                    &rules,
                    r,
                    &self.s.tokens[r],
                    pos,
                    &mut self.logits[li * vocab..(li + 1) * vocab],
                ),
            };
            let Some((token, mask)) = chosen else {
                // No token continues the row's constraint: it ends without one.
                row.finished = true;
                self.cancelled.push((r, FinishReason::ConstraintBroken));
                continue;
            };
            let step = row.accept(&rules, token, mask, pos)?;
            self.usage.completion_tokens += 1;
            if step.finished.is_none() {
                feed.push(token);
                feed_rows.push(TokenRow { slot: r, pos });
            }
            out[r] = Some(step);
        }
        self.live = feed_rows.iter().map(|t| t.slot).collect();
        if feed.is_empty() {
            self.end_graph()?;
        } else {
            self.advance(&feed, &feed_rows)?;
            self.timings.decode_steps += 1;
        }
        self.timings.decode += t0.elapsed();
        Ok(Step { rows: out })
    }

    /// Feeds the tokens just chosen to the model, by the fastest path the step allows: the
    /// decode graph when every fed row samples on the device next (no forced tool token, no
    /// host-side logits processing, no constraint), else a forward pass (sampling on the device
    /// when nothing needs the logits on the host; a constrained row's mask goes to the device
    /// where it can draw: the mask kernel's draws match the host's on an H200 and an H100,
    /// while a whole constrained session on a GPU has not run).
    fn advance(&mut self, feed: &[u32], feed_rows: &[TokenRow]) -> Result<(), EngineError> {
        // The graph has no masks: constrained rows step by step.
        let constrained = self.opts.constraint.is_some();
        let on_device = !self.opts.needs_host_logits() && !constrained;
        let forced = feed_rows
            .iter()
            .any(|t| !self.rows[t.slot].tool.forced.is_empty());
        {
            // A row's cache slot is its engine row, which keys its Philox draws.
            let rows: Vec<GraphRow> = feed
                .iter()
                .zip(feed_rows)
                .map(|(&token, r)| GraphRow {
                    slot: r.slot,
                    pos: r.pos,
                    token,
                    row_id: r.slot as u32,
                })
                .collect();
            let engine = Arc::clone(&self.s.engine);
            let backend = &*engine.backend;
            // The CPU stand-in for the graph applies logits processors (tests script tool
            // calls through it); the device cannot.
            let sampling_ok = on_device
                || (backend.emulates_graph()
                    && self.opts.sampling.repetition_penalty.is_none()
                    && self.opts.logprobs.is_none()
                    && !constrained);
            if sampling_ok && !forced && GraphRun::fits(backend, rows.len()) {
                if let Some(run) = self.graph.as_mut().filter(|g| g.covers(&rows)) {
                    run.feed(&rows);
                    self.next = Next::Graph;
                    return Ok(());
                }
                self.end_graph()?;
                let budget = self.graph_budget(feed_rows);
                if budget > 0 {
                    let run = GraphRun::start(
                        backend,
                        self.s.memory(),
                        &rows,
                        &self.opts.sampling,
                        &self.stop_tokens,
                        self.opts.logits_processor.as_ref(),
                        budget,
                    )?;
                    self.graph = Some(run);
                    self.next = Next::Graph;
                    return Ok(());
                }
            } else {
                self.end_graph()?;
            }
        }
        let sampled = if on_device && !forced {
            let row_ids: Vec<u32> = feed_rows.iter().map(|t| t.slot as u32).collect();
            self.s
                .dev
                .forward_sample(feed, feed_rows, &self.opts.sampling, &row_ids)?
        } else if constrained && !forced && !self.opts.needs_host_logits() {
            self.draw_constrained(feed, feed_rows)?
        } else {
            None
        };
        if let Some(tokens) = sampled {
            self.next = Next::Tokens(tokens);
        } else {
            // Rows that sample next get their masks computed while the forward runs.
            let rows = self.rows.iter_mut();
            let masks = rows.filter(|r| !r.finished && r.tool.forced.is_empty());
            let masks = masks.filter_map(|r| r.constraint.as_mut()).collect();
            let (dev, logits) = (&mut self.s.dev, &mut self.logits);
            prepare_during(masks, || {
                dev.forward(PlanKind::Decode, feed, feed_rows, logits)
            })?;
            self.next = Next::Logits;
        }
        for (t, r) in feed.iter().zip(feed_rows) {
            self.s.tokens[r.slot].push(*t);
        }
        Ok(())
    }

    /// A decode step whose constrained rows are drawn on the device: each fed row's allowed
    /// tokens are computed now and applied there, and only the tokens come back. `None` (nothing
    /// run) where the device cannot draw, or a row's constraint cannot continue (the host path
    /// ends that row as it finds it).
    fn draw_constrained(
        &mut self,
        feed: &[u32],
        feed_rows: &[TokenRow],
    ) -> Result<Option<Vec<u32>>, EngineError> {
        let mut allowed = Vec::with_capacity(feed_rows.len());
        for t in feed_rows {
            match self.rows[t.slot].constraint.as_mut().map(|c| c.allowed()) {
                Some(Ok(set)) => allowed.push(Some(set.as_slice().to_vec())),
                Some(Err(_)) => return Ok(None),
                None => allowed.push(None),
            }
        }
        let draws: Vec<RowDraw<'_>> = feed_rows
            .iter()
            .zip(&allowed)
            .map(|(t, a)| RowDraw {
                sampling: self.opts.sampling,
                row_id: t.slot as u32,
                allowed: a.as_deref(),
            })
            .collect();
        self.s.dev.forward_draw(feed, feed_rows, &draws)
    }

    /// Replays worth enqueuing after feeding `feed_rows`: each writes one cache position and
    /// yields one token per row, and no row needs more than `max_tokens` or the cache allows.
    fn graph_budget(&self, feed_rows: &[TokenRow]) -> usize {
        let capacity = self.s.dev.capacity();
        let room = feed_rows
            .iter()
            .map(|t| capacity.saturating_sub(t.pos))
            .min()
            .unwrap_or(0);
        let wanted = match self.opts.max_tokens {
            Some(m) => feed_rows
                .iter()
                .map(|t| m.saturating_sub(self.rows[t.slot].generated))
                .max()
                .unwrap_or(0),
            None => usize::MAX,
        };
        room.min(wanted)
    }

    /// Stops the decode graph, if one runs (what it had in flight is dropped).
    fn end_graph(&mut self) -> Result<(), EngineError> {
        if let Some(run) = self.graph.take() {
            run.stop(self.s.memory())?;
        }
        Ok(())
    }
}

impl Drop for Stream<'_> {
    fn drop(&mut self) {
        // A graph still in flight writes only past the confirmed cache lengths; waiting for it
        // keeps the session's device memory quiet for whatever runs next. An error here has
        // nowhere to go; the next call on the session reports the device's state.
        let _ = self.end_graph();
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

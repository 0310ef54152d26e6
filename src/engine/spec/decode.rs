//! The speculative decoding loop for one sequence of a [`Session`].
//!
//! The cache holds every token but the last one emitted (`pending`). A pass feeds `pending`
//! and the proposals `d₁…dₖ` at once, getting logits for every row; row `i` is where plain
//! decoding would choose the token after `pending, d₁…dᵢ`. The rows are walked in order, each
//! through the row's own rules exactly as plain decoding runs them (forced tool tokens, logits
//! processor, penalty, constraint, stop tokens and strings, `max_tokens`, the context limit):
//! a row whose chosen token is the next proposal moves on; the first that chooses otherwise,
//! finishes the row, or has no proposal left ends the pass, and its token becomes the new
//! `pending`. The cache is cut back to the tokens that were kept.
//!
//! A pass with no proposals is a plain decode step; where the row needs no logits on the host
//! its token is drawn on the device instead (`Session::draw_next`: the megakernel's decode graph
//! for one replay, or a step sampling on the device), UNVERIFIED on a GPU.

use std::sync::Arc;
use std::time::Instant;

use super::{choose_verified, Proposal, Proposer, SpecError, SpecOptions, SpecResult, SpecStats};
use crate::backend::{GraphRow, TokenRow};
use crate::engine::collect::RowsCollector;
use crate::engine::constraint::{prepare_during, Constraint};
use crate::engine::graph_run::GraphRun;
use crate::engine::row::{RowRules, RowState};
use crate::engine::tools::ToolTokens;
use crate::engine::{
    BatchResult, EngineError, FinishReason, GenerateOptions, RowStep, Session, Step, Timings, Usage,
};
use crate::plan::PlanKind;
use crate::sample::SamplingParams;

/// The sequence's row id, which keys its Philox draws: its cache slot, as in plain decoding.
const ROW: usize = 0;

/// Records a step and shows it to the caller; `false` when the sequence is over (finished, or
/// the caller stopped it).
fn emit(rows: &mut RowsCollector, on_step: &mut impl FnMut(&Step) -> bool, step: RowStep) -> bool {
    let finished = step.finished.is_some();
    let step = Step {
        rows: vec![Some(step)],
    };
    rows.push(&step);
    let go_on = on_step(&step);
    if finished {
        return false;
    }
    if !go_on {
        rows.set_reason(ROW, FinishReason::Cancelled);
    }
    go_on
}

impl Session {
    /// [`Session::generate`] with speculative decoding (one sample row): the same tokens as
    /// plain decoding when greedy, the same distribution when sampled. `on_step` sees one step
    /// per token, as in plain decoding (return `false` to stop).
    pub fn generate_speculative(
        &mut self,
        prompt: &[u32],
        opts: &GenerateOptions,
        spec: &SpecOptions,
        mut on_step: impl FnMut(&Step) -> bool,
    ) -> Result<SpecResult, EngineError> {
        opts.sampling.validate()?;
        if opts.num_samples != 1 {
            return Err(SpecError::Samples(opts.num_samples).into());
        }
        if spec.max_draft == 0 {
            return Err(SpecError::MaxDraft.into());
        }
        let mut constraint = match &opts.constraint {
            Some(c) => {
                let factory = self.engine.constraint_factory()?;
                Some(Constraint::new(&factory, c)?)
            }
            None => None,
        };
        let t0 = Instant::now();
        let ran = prepare_during(constraint.iter_mut().collect(), || self.prefill(prompt))?;
        let mut timings = Timings {
            prefill_tokens: ran,
            prefill: t0.elapsed(),
            ..Timings::default()
        };
        let t0 = Instant::now();
        let engine = Arc::clone(&self.engine);
        let capacity = self.dev.capacity();
        let stop_tokens = opts
            .stop_tokens
            .clone()
            .unwrap_or_else(|| engine.default_stop_tokens());
        let tools = if opts.tools {
            ToolTokens::of(engine.tokenizer())
        } else {
            None
        };
        let rules = RowRules {
            tokenizer: engine.tokenizer(),
            opts,
            stop_tokens: &stop_tokens,
            tools: tools.as_ref(),
            capacity,
        };
        let mut row = RowState::new(opts, constraint);
        let mut proposer = Proposer::new(&spec.method, capacity);
        let mut usage = Usage {
            prompt_tokens: prompt.len(),
            ..Usage::default()
        };
        let mut stats = SpecStats::default();
        let mut rows = RowsCollector::new(1);
        let vocab = engine.config().vocab_size;

        // The first token comes from the prefill's logits, as in plain decoding.
        let mut pending = None;
        if opts.max_tokens == Some(0) {
            rows.set_reason(ROW, FinishReason::MaxTokens);
        } else {
            let pos = self.dev.len(0);
            let mut logits = self.logits.clone();
            match row.choose(&rules, ROW, &self.tokens[0], pos, &mut logits) {
                None => rows.set_reason(ROW, FinishReason::ConstraintBroken),
                Some((token, mask)) => {
                    let step = row.accept(&rules, token, mask, pos)?;
                    usage.completion_tokens += 1;
                    if emit(&mut rows, &mut on_step, step) {
                        pending = Some(token);
                    }
                }
            }
        }
        // The row's choice needs nothing but the logits (the device draws it with the row's
        // own parameters and seed, as the host would).
        let draws_on_device = !opts.needs_host_logits() && opts.constraint.is_none();
        let mut k = spec.max_draft;
        while let Some(last) = pending.take() {
            let len = self.dev.len(0);
            // `last` goes at `len` (< capacity, or the context limit would have ended the row);
            // proposals fill the cache at most, and none is wasted past `max_tokens`.
            let room = capacity.saturating_sub(len + 1);
            let left = opts
                .max_tokens
                .map_or(usize::MAX, |m| m.saturating_sub(row.generated));
            let want = k.min(room).min(left.saturating_sub(1));
            // Queued tool output needs no guessing: it is proposed as is.
            let guessed = row.tool.forced.is_empty();
            let proposals: Vec<Proposal> = if !guessed {
                let forced = row.tool.forced.iter().take(want);
                forced.map(|&token| Proposal { token, q: None }).collect()
            } else if want == 0 {
                Vec::new()
            } else {
                let mut context = self.tokens[0].clone();
                context.push(last);
                proposer.propose(&context, want, &opts.sampling, ROW as u32)?
            };
            let mut feed = Vec::with_capacity(1 + proposals.len());
            feed.push(last);
            feed.extend(proposals.iter().map(|p| p.token));
            let token_rows: Vec<TokenRow> = (0..feed.len())
                .map(|i| TokenRow {
                    slot: 0,
                    pos: len + i,
                })
                .collect();
            // A pass with nothing to verify is a plain decode step: its token is drawn where
            // the logits are when the row needs none of them on the host.
            let drawn = if proposals.is_empty() && guessed && draws_on_device {
                self.draw_next(last, len, &opts.sampling, &stop_tokens)?
            } else {
                None
            };
            if drawn.is_some() {
                stats.device_draws += 1;
            } else {
                let kind = if feed.len() == 1 {
                    PlanKind::Decode
                } else {
                    PlanKind::AllLogits
                };
                {
                    let masks = row.constraint.iter_mut().filter(|_| guessed).collect();
                    let (dev, logits) = (&mut self.dev, &mut self.logits);
                    prepare_during(masks, || dev.forward(kind, &feed, &token_rows, logits))?;
                }
                self.tokens[0].extend_from_slice(&feed);
            }
            timings.decode_steps += 1;
            stats.verify_passes += 1;
            if guessed {
                stats.proposed += proposals.len();
            }

            let mut accepted = 0;
            let mut stop_at = proposals.len();
            for i in 0..=proposals.len() {
                let pos = len + 1 + i;
                let proposal = proposals.get(i);
                let chosen = match drawn {
                    // Only with no proposals, so at the pass's one row.
                    Some(token) => Some((token, 1)),
                    None => {
                        let context = &self.tokens[0][..pos];
                        let logits = &mut self.logits[i * vocab..(i + 1) * vocab];
                        choose_verified(&mut row, &rules, ROW, context, pos, logits, proposal)
                    }
                };
                let Some((token, mask)) = chosen else {
                    // No token continues the row's constraint: it ends without one.
                    rows.set_reason(ROW, FinishReason::ConstraintBroken);
                    stop_at = i;
                    break;
                };
                let step = row.accept(&rules, token, mask, pos)?;
                usage.completion_tokens += 1;
                if !emit(&mut rows, &mut on_step, step) {
                    stop_at = i;
                    break;
                }
                if proposal.is_some_and(|p| p.token == token) {
                    accepted += 1;
                    continue;
                }
                stop_at = i;
                pending = Some(token);
                break;
            }
            // Kept: `last` and the proposals up to the row that ended the pass.
            let keep = len + 1 + stop_at;
            self.dev.truncate(0, keep);
            self.tokens[0].truncate(keep);
            if guessed && !proposals.is_empty() {
                stats.accepted += accepted;
                k = spec.next_k(k, proposals.len(), accepted);
            }
        }
        timings.decode = t0.elapsed();
        let rows = rows.finish(prompt, &stop_tokens);
        Ok(SpecResult {
            batch: BatchResult {
                rows,
                usage,
                timings,
            },
            spec: stats,
        })
    }
}

impl Session {
    /// The token after `last` (fed at position `len` of the one sequence) for a pass with
    /// nothing to verify, drawn where the logits are: one replay of the decode graph on a
    /// megakernel engine (the megakernel's one-token step), else a decode step sampling on the
    /// device. Either way `last` is then confirmed in the cache and the session's tokens.
    /// `None`, with nothing run, where the device cannot draw (the CPU): the pass then takes
    /// the logits to the host.
    ///
    /// UNVERIFIED on a GPU: tested on the CPU through the decode graph's stand-in
    /// (`tests/speculative.rs`), never run on a device.
    fn draw_next(
        &mut self,
        last: u32,
        len: usize,
        sampling: &SamplingParams,
        stop_tokens: &[u32],
    ) -> Result<Option<u32>, EngineError> {
        let engine = Arc::clone(&self.engine);
        let backend = &*engine.backend;
        if GraphRun::fits(backend, 1) {
            // The row's cache slot keys its Philox draws, as in plain decoding.
            let feed = [GraphRow {
                slot: ROW,
                pos: len,
                token: last,
                row_id: ROW as u32,
            }];
            let mut run = GraphRun::start(
                backend,
                self.memory(),
                &feed,
                sampling,
                stop_tokens,
                None,
                1,
            )?;
            let drawn = run.next(self.memory())?;
            run.stop(self.memory())?;
            let &(_, token) = drawn
                .first()
                .expect("a graph started on one row samples one token");
            return Ok(Some(token));
        }
        let rows = [TokenRow {
            slot: ROW,
            pos: len,
        }];
        let Some(tokens) = self
            .dev
            .forward_sample(&[last], &rows, sampling, &[ROW as u32])?
        else {
            return Ok(None);
        };
        self.tokens[ROW].push(last);
        let &token = tokens
            .first()
            .expect("a device step on one row samples one token");
        Ok(Some(token))
    }
}

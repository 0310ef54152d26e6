//! The scheduler: many requests' sequences over one shared KV pool, advanced together.
//!
//! Each [`Scheduler::step`] is one forward pass over the rows of many sequences: one decode row
//! for every running sequence that has chosen its next token, then chunks of prompt (or of
//! recomputation after preemption) from the others, under a token budget per step — so a long
//! prompt is prefilled a chunk at a time beside the running streams instead of stalling them.
//! Sequences join and leave between steps. A new sequence first takes the longest cached prefix
//! of its tokens from the prefix cache; its own whole blocks are offered to the cache once its
//! prompt is in, and again when it finishes. When the pool runs out of blocks, the most recently
//! admitted sequence is preempted (its blocks freed; it is recomputed from its tokens later), so
//! a request that fits the pool on its own never fails because of others.
//!
//! On an engine whose decode runs through the graph-replayed megakernel, steady decode runs
//! through the pool's decode graph instead: when every sequence holding a slot is a plain decode
//! row (no prompt left, no speculation, constraint, tool calls, log-probabilities, penalty or
//! logits processor: nothing the host must do between tokens), at most a bucket's worth (8),
//! and nothing waits, the graph starts on them and runs up to [`GRAPH_DEPTH`] replays ahead,
//! sampling on the device with each row's own parameters; each scheduler step then consumes one
//! replay. A row that finishes leaves the graph between replays (its slot closes when the graph
//! stops, since replays already queued still write it); anything else — a new request, a
//! waiting one, the pool running short — stops the graph, and the kernel-by-kernel steps take
//! over from the last consumed token until the graph can start again (a restart reuses the
//! captured graph: only its row table is uploaded).
//!
//! Every row keeps its own sampling parameters and seed, and its draws are keyed by its row
//! within its request and its position, exactly as in a [`super::Session`]: a request's tokens
//! do not depend on what else runs beside it (up to the summation order of batched kernels).
//!
//! A request with [`Request::spec`] speculates: before each step its rows propose tokens (prompt
//! lookup, or a draft model: one pass of the draft per proposal position over every row it
//! drafts for), the step feeds each row's pending token and
//! proposals together with a logit row for each, and the row keeps the longest prefix its own
//! rules agree with plus one token of its own (the walk of [`super::spec`]); rejected positions
//! are cut from that row's blocks only. Proposals share the step's token budget: decode rows
//! come first, while a prompt waits its quarter of the budget is kept for it, and a step grows
//! with proposals to at most [`ServeOptions::spec_step_rows`] rows. Greedy rows
//! give exactly the tokens of plain decoding; sampled rows keep the target's distribution.

use std::collections::HashMap;
use std::sync::Arc;

use super::backend::ServingPool;
use super::constraint::Constraint;
use super::row::{RowRules, RowState};
use super::sequence::{RequestId, SeqSpec, Sequence};
use super::spec::{self, choose_verified, DraftAsk, DraftBatch, Proposal, SpecMethod};
use super::spec::{SpecOptions, SpecStats};
use super::tools::ToolTokens;
use super::{Engine, EngineError, FinishReason, GenerateOptions, RowStep, Step, Usage};
use crate::backend::{GraphRow, RowDraw, TokenRow};
use crate::kv::{KvBudget, KvCache, KvError, KvOptions, PoolError};
use crate::plan::PlanKind;

/// Replays a serving decode graph keeps queued ahead of the host (the graph's ring holds 8).
pub const GRAPH_DEPTH: usize = 8;

/// How a serving engine shares its memory and its steps.
#[derive(Clone, Copy, Debug)]
pub struct ServeOptions {
    /// Memory for the KV pool.
    pub kv_budget: KvBudget,
    /// Block size and storage type of the pool.
    pub kv: KvOptions,
    /// Sequences running at once (more wait in the queue).
    pub max_running: usize,
    /// Tokens one step may run: every running sequence's decode row counts one, and prompts
    /// are prefilled in chunks of what is left — but never less than a quarter of it while a
    /// prompt waits, so many running streams cannot starve a joining request. A step's time
    /// grows with its tokens, so this bounds how long a joining prompt stalls running streams
    /// (their inter-token latency).
    pub max_step_tokens: usize,
    /// Reuse cached prompt prefixes across requests.
    pub prefix_cache: bool,
    /// The most rows a step grows to with speculative proposals: decode rows come first, and
    /// proposals, shared evenly among the speculating rows, fill what is left up to this (none
    /// once as many sequences run); 0 turns speculation off. No limit by default (only
    /// `max_step_tokens`): n-gram proposals paid for their rows even at 16 sequences on a
    /// 2-core CPU, while a draft model's passes did not — a limit of 8 took a 1.5B/0.5B pair
    /// at 4 sequences from 0.37× to 0.64× of plain decoding (README).
    pub spec_step_rows: usize,
}

impl Default for ServeOptions {
    fn default() -> Self {
        ServeOptions {
            kv_budget: KvBudget::Bytes(512 << 20),
            kv: KvOptions::default(),
            max_running: 64,
            // Beside 16 streams of the demo model on 2 CPU threads, 256 gave ~3× the p99
            // inter-token latency of 64 for the same throughput (kiln-bench serve-load).
            max_step_tokens: 64,
            prefix_cache: true,
            spec_step_rows: usize::MAX,
        }
    }
}

/// One request: a prompt and how to continue it (`num_samples` rows, each with the request's
/// sampling parameters and seed), speculatively when `spec` says so.
#[derive(Clone, Debug, Default)]
pub struct Request {
    pub prompt: Vec<u32>,
    pub options: GenerateOptions,
    /// Speculative decoding for every row of the request (each row proposes and verifies on
    /// its own). A draft model keeps the rows' caches in a pool of its own, of as many blocks
    /// as the serving pool, and runs every row's proposal position in one pass.
    pub spec: Option<SpecOptions>,
}

/// What a request's consumer receives, in order: steps, then one `Done` (or one `Error`).
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// Tokens of the rows that advanced in one scheduler step (`None` for the others).
    Step(Step),
    /// Every row finished.
    Done(Finished),
    /// The request could not be served.
    Error(String),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Finished {
    pub usage: Usage,
    pub finish_reasons: Vec<FinishReason>,
    /// How speculation went, summed over the rows (requests that speculate).
    pub spec: Option<SpecStats>,
}

/// Delivers a request's events; returns `false` once nobody listens (the request is then
/// cancelled and its blocks freed).
pub type Sink = Box<dyn FnMut(Event) -> bool + Send>;

struct RequestState {
    sink: Sink,
    usage: Usage,
    reasons: Vec<Option<FinishReason>>,
    /// The steps being assembled for this request: one per token a row took in this scheduler
    /// step (rows that verified proposals take several), each with one entry per row.
    steps: Vec<Vec<Option<RowStep>>>,
    spec: Option<SpecStats>,
}

/// Counters a service reads (queue depth, memory, cache hits).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SchedulerStats {
    pub waiting: usize,
    pub running: usize,
    pub blocks_total: usize,
    pub blocks_free: usize,
    pub prefix_blocks: usize,
    pub prefix_hit_tokens: u64,
    pub prompt_tokens: u64,
    pub generated_tokens: u64,
    pub steps: u64,
    pub preemptions: u64,
    /// Tokens forward passes ran (prefill chunks, recomputation, decode rows and proposals).
    pub computed_tokens: u64,
    /// Tokens proposed by speculating rows (queued tool output not counted).
    pub spec_proposed_tokens: u64,
    /// Proposed tokens the model agreed with.
    pub spec_accepted_tokens: u64,
    /// Decode passes of speculating rows (each verifies its proposals, or none).
    pub spec_verify_passes: u64,
    /// Forward passes of draft models (each over every row a draft proposes for).
    pub spec_draft_passes: u64,
    /// Steps that consumed a decode-graph replay (counted in `steps` too).
    pub graph_steps: u64,
    /// Times a decode graph was started.
    pub graph_starts: u64,
    /// Decode-graph replays run but dropped by a stop (in flight when a phase had to end at
    /// once: the pool ran short or the device failed), their tokens computed again.
    pub graph_dropped: u64,
    /// Kernel-by-kernel steps whose tokens were drawn on the device (no logits to the host).
    pub device_draw_steps: u64,
}

/// One sequence's part of a step: `n` rows fed from its tokens (a prefill chunk or a decode
/// row), or when `verify`, its pending token and `n - 1` proposals, each row with logits.
#[derive(Clone, Copy, Debug)]
struct Planned {
    seq: usize,
    n: usize,
    verify: bool,
}

/// How one planned sequence's token is drawn on the device (see [`Scheduler::device_draws`]).
struct PlannedDraw {
    sampling: crate::sample::SamplingParams,
    row_id: u32,
    /// The constraint's allowed tokens, one bit each.
    allowed: Option<Vec<u32>>,
    /// Its constraint cannot continue: the row ends, its draw unused.
    broken: bool,
}

/// The pool's decode graph while it runs a phase of the scheduler's decode.
struct GraphPhase {
    /// Per batch row: the sequence it decodes (request and row within it: indices into the
    /// sequences shift as finished ones are dropped), `None` once it left.
    rows: Vec<Option<(RequestId, usize)>>,
    /// Replays queued and not consumed.
    in_flight: usize,
    /// Replays that may still be queued: none may write past a row's capacity, and none is
    /// worth running past every row's `max_tokens`.
    budget: usize,
    /// Slots of rows that left: replays queued before they left still write them, so they
    /// close when the graph stops.
    left: Vec<usize>,
}

impl GraphPhase {
    /// Whether every row has left.
    fn is_empty(&self) -> bool {
        self.rows.iter().all(Option::is_none)
    }
}

pub struct Scheduler {
    engine: Arc<Engine>,
    opts: ServeOptions,
    /// The pool on the engine's device; steps run through it.
    kv: Box<dyn ServingPool>,
    logits: Vec<f32>,
    seqs: Vec<Sequence>,
    requests: HashMap<RequestId, RequestState>,
    next_order: u64,
    tools: Option<ToolTokens>,
    stats: SchedulerStats,
    /// The draft caches of speculating rows, one pool per draft model.
    drafts: Vec<DraftBatch>,
    /// The decode graph's phase, while one runs.
    graph: Option<GraphPhase>,
}

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("serve option {name} must be at least 1")]
    Zero { name: &'static str },
    #[error("request {id}: the prompt needs {needed} KV blocks but the pool holds {total}")]
    TooBig {
        id: RequestId,
        needed: usize,
        total: usize,
    },
    #[error("request id {0} is already in use")]
    DuplicateId(RequestId),
}

impl Scheduler {
    pub fn new(engine: Arc<Engine>, opts: ServeOptions) -> Result<Scheduler, EngineError> {
        for (name, v) in [
            ("max_running", opts.max_running),
            ("max_step_tokens", opts.max_step_tokens),
        ] {
            if v == 0 {
                return Err(ServeError::Zero { name }.into());
            }
        }
        let kv = engine.new_pool(opts.kv, opts.kv_budget, engine.max_context())?;
        Ok(Scheduler {
            tools: ToolTokens::of(engine.tokenizer()),
            engine,
            opts,
            kv,
            logits: Vec::new(),
            seqs: Vec::new(),
            requests: HashMap::new(),
            next_order: 0,
            stats: SchedulerStats::default(),
            drafts: Vec::new(),
            graph: None,
        })
    }

    pub fn engine(&self) -> &Arc<Engine> {
        &self.engine
    }

    /// Whether nothing is waiting or running.
    pub fn is_idle(&self) -> bool {
        self.seqs.is_empty()
    }

    pub fn stats(&self) -> SchedulerStats {
        let mut s = self.stats;
        s.running = self.seqs.iter().filter(|q| q.slot.is_some()).count();
        s.waiting = self.seqs.len() - s.running;
        s.blocks_total = self.kv.tables().pool().num_blocks();
        s.blocks_free = self.kv.tables().pool().free_blocks();
        s.prefix_blocks = self.kv.tables().prefix_blocks();
        s.spec_draft_passes = self.drafts.iter().map(DraftBatch::passes).sum();
        s
    }

    /// The serving cache (tests check its invariants).
    #[doc(hidden)]
    pub fn cache(&self) -> &KvCache {
        self.kv.tables()
    }

    /// Queues a request under `id`; its events go to `sink`. Errors in the request itself
    /// (empty prompt, unknown token, bad sampling parameters, a prompt no pool could hold)
    /// are returned here and nothing is queued.
    pub fn submit(&mut self, id: RequestId, req: Request, sink: Sink) -> Result<(), EngineError> {
        if self.requests.contains_key(&id) {
            return Err(ServeError::DuplicateId(id).into());
        }
        let Request {
            prompt,
            options,
            spec,
        } = req;
        options.sampling.validate()?;
        if let Some(sp) = &spec {
            sp.check_for(&self.engine)?;
            if let SpecMethod::Draft(d) = &sp.method {
                if !self.drafts.iter().any(|b| b.runs(d)) {
                    // As many blocks as the serving pool: a row's draft cache holds no more
                    // positions than its own.
                    let blocks = self.kv.tables().pool().num_blocks();
                    let batch = DraftBatch::new(Arc::clone(d), self.opts.kv, blocks)?;
                    self.drafts.push(batch);
                }
            }
        }
        if prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        if options.num_samples == 0 {
            return Err(EngineError::NoSamples);
        }
        let vocab = self.engine.config().vocab_size;
        if let Some(&bad) = prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(crate::backend::ExecError::BadToken { id: bad, vocab }.into());
        }
        if prompt.len() >= self.kv.tables().capacity() {
            return Err(EngineError::PromptTooLong {
                len: prompt.len(),
                capacity: self.kv.tables().capacity(),
            });
        }
        let needed = self.kv.tables().layout().blocks_for(prompt.len() + 1);
        let total = self.kv.tables().pool().num_blocks();
        if needed > total {
            return Err(ServeError::TooBig { id, needed, total }.into());
        }
        let stop_tokens = Arc::new(
            options
                .stop_tokens
                .clone()
                .unwrap_or_else(|| self.engine.default_stop_tokens()),
        );
        let constraint = match &options.constraint {
            Some(spec) => Some(Constraint::new(&*self.engine.constraint_factory()?, spec)?),
            None => None,
        };
        let n = options.num_samples;
        let opts = Arc::new(options);
        let order = self.next_order;
        self.next_order += 1;
        for row in 0..n {
            self.seqs.push(Sequence {
                request: id,
                row,
                opts: Arc::clone(&opts),
                stop_tokens: Arc::clone(&stop_tokens),
                tokens: prompt.clone(),
                prompt_len: prompt.len(),
                computed: 0,
                slot: None,
                state: RowState::new(&opts, constraint.as_ref().map(Constraint::fork)),
                waits_for_prompt: row > 0,
                order,
                spec: spec.as_ref().map(SeqSpec::new),
            });
        }
        self.stats.prompt_tokens += prompt.len() as u64;
        self.requests.insert(
            id,
            RequestState {
                sink,
                usage: Usage {
                    prompt_tokens: prompt.len(),
                    ..Usage::default()
                },
                reasons: vec![None; n],
                steps: Vec::new(),
                spec: spec.as_ref().map(|_| SpecStats::default()),
            },
        );
        if opts.max_tokens == Some(0) {
            for i in self.rows_of(id) {
                self.finish(i, FinishReason::MaxTokens);
            }
            self.flush();
        }
        Ok(())
    }

    fn rows_of(&self, id: RequestId) -> Vec<usize> {
        (0..self.seqs.len())
            .filter(|&i| self.seqs[i].request == id)
            .collect()
    }

    /// Ends every row of a request with [`FinishReason::Cancelled`] and frees its blocks.
    pub fn cancel(&mut self, id: RequestId) {
        for i in self.rows_of(id) {
            if !self.seqs[i].finished() {
                self.seqs[i].state.finished = true;
                self.finish(i, FinishReason::Cancelled);
            }
        }
        self.flush();
        if self.graph.as_ref().is_some_and(GraphPhase::is_empty) {
            // No row is left in the graph: stop it so the slots that left close. A device
            // failure here fails the next step too, where it is reported.
            let _ = self.stop_graph();
        }
    }

    /// Records a row's end and frees its slot (its whole blocks stay in the prefix cache).
    fn finish(&mut self, i: usize, reason: FinishReason) {
        let s = &mut self.seqs[i];
        s.state.finished = true;
        if let Some(r) = self.requests.get_mut(&s.request) {
            r.reasons[s.row] = Some(reason);
        }
        self.release_slot(i);
    }

    /// Gives sequence `i`'s slot back; its whole blocks are offered to the prefix cache first,
    /// so whoever needs them next (a later turn, or this sequence after preemption) may reuse
    /// them.
    fn release_slot(&mut self, i: usize) {
        let s = &mut self.seqs[i];
        if let Some(slot) = s.slot.take() {
            if self.opts.prefix_cache {
                self.kv.publish_prefix(slot, &s.tokens[..s.computed]);
            }
            let key = (s.request, s.row);
            if let Some(g) = self.graph.as_mut() {
                if let Some(b) = g.rows.iter().position(|r| *r == Some(key)) {
                    g.rows[b] = None;
                    g.left.push(slot);
                    // A failed leave is a device failure; the next replay or stop reports it.
                    let _ = self.kv.graph_leave(b);
                    return;
                }
            }
            self.kv.close_slot(slot);
        }
    }

    /// Sends each request its assembled step, and `Done` to requests whose rows all finished;
    /// drops finished sequences and requests whose consumer has gone.
    fn flush(&mut self) {
        let mut gone = Vec::new();
        for (&id, r) in self.requests.iter_mut() {
            let steps = std::mem::take(&mut r.steps);
            if !steps
                .into_iter()
                .all(|rows| (r.sink)(Event::Step(Step { rows })))
            {
                gone.push(id);
                continue;
            }
            if r.reasons.iter().all(Option::is_some) {
                let reasons = r.reasons.iter().flatten().copied().collect();
                (r.sink)(Event::Done(Finished {
                    usage: r.usage,
                    finish_reasons: reasons,
                    spec: r.spec,
                }));
                gone.push(id);
            }
        }
        for id in gone {
            for i in self.rows_of(id) {
                if !self.seqs[i].finished() {
                    self.finish(i, FinishReason::Cancelled);
                }
            }
            self.requests.remove(&id);
        }
        self.seqs.retain(|s| !s.state.finished);
    }

    /// Gives a waiting sequence a slot, starting from the longest cached prefix of its tokens.
    fn admit(&mut self, i: usize) {
        let slot = self.kv.open_slot();
        let s = &mut self.seqs[i];
        s.slot = Some(slot);
        s.computed = 0;
        if self.opts.prefix_cache {
            // The last token must run to produce the logits that follow it.
            let cached = self
                .kv
                .attach_prefix(slot, &s.tokens, s.tokens.len() - 1)
                .unwrap_or(0);
            s.computed = cached;
            let hit = cached.min(s.prompt_len);
            self.stats.prefix_hit_tokens += hit as u64;
            if s.row == 0 && s.state.generated == 0 {
                if let Some(r) = self.requests.get_mut(&s.request) {
                    r.usage.cached_tokens = r.usage.cached_tokens.max(hit);
                }
            }
        }
    }

    /// Frees sequence `i`'s blocks; it waits again and is recomputed from its tokens.
    fn preempt(&mut self, i: usize) {
        self.release_slot(i);
        self.seqs[i].computed = 0;
        self.stats.preemptions += 1;
    }

    /// Runs one step. Returns whether any work remains.
    pub fn step(&mut self) -> Result<bool, EngineError> {
        self.admit_waiting();
        let go_on = self.graph_can_go_on();
        if let Some(g) = self.graph.as_mut().filter(|_| !go_on) {
            // The phase ends, but the replays in flight run to the end either way (a stop waits
            // for them): enqueue no more and take their tokens, one a step, rather than
            // dropping them for the rows to compute again on the host path. On an H100 a
            // batch-8 stop that dropped them took 11 ms (docs/gpu-results.md run 12).
            g.budget = 0;
            if g.in_flight == 0 {
                self.stop_graph()?;
            }
        }
        if self.graph.is_none() && self.graph_can_start() {
            self.start_graph()?;
        }
        if self.graph.is_some() {
            match self.graph_step() {
                Ok(true) => {
                    self.flush();
                    if self.graph.as_ref().is_some_and(GraphPhase::is_empty) {
                        // Its last row finished: the slots that left close now.
                        self.stop_graph()?;
                    }
                    return Ok(!self.seqs.is_empty());
                }
                // Nothing left to replay, or the pool ran short: the host path goes on
                // (preempting if it must).
                Ok(false) | Err(EngineError::Kv(KvError::Pool(PoolError::Exhausted { .. }))) => {
                    self.stop_graph()?
                }
                Err(e) => {
                    // The device failed: what it ran is lost, the slots are not reused.
                    self.graph = None;
                    return Err(e);
                }
            }
        }
        let plan = self.plan()?;
        if plan.is_empty() {
            self.flush();
            return Ok(!self.seqs.is_empty());
        }
        let mut tokens = Vec::new();
        let mut rows = Vec::new();
        // Rows that get logits: the last of each entry, every row of a verifying one.
        let mut logit_rows = Vec::new();
        for p in &plan {
            let s = &self.seqs[p.seq];
            let slot = s.slot.expect("planned sequences hold a slot");
            if p.verify {
                logit_rows.extend(tokens.len()..tokens.len() + p.n);
                tokens.push(s.tokens[s.computed]);
                let proposals = s.spec.as_ref().map_or(&[][..], |sp| &sp.proposals[..]);
                tokens.extend(proposals.iter().map(|q| q.token));
            } else {
                tokens.extend_from_slice(&s.tokens[s.computed..s.computed + p.n]);
                logit_rows.push(tokens.len() - 1);
            }
            rows.extend((s.computed..s.computed + p.n).map(|pos| TokenRow { slot, pos }));
        }
        debug_assert_eq!(tokens.len(), rows.len());
        let selected = (logit_rows.len() > plan.len()).then_some(&logit_rows[..]);
        let kind = if plan.iter().all(|p| p.n == 1) {
            PlanKind::Decode
        } else {
            PlanKind::Prefill
        };
        // Where the pool draws on the device and no row needs its logits here, only the
        // tokens come back (a constrained row's allowed tokens go the other way).
        let pre = match selected {
            None if self.kv.draws_on_device() => self.device_draws(&plan),
            _ => None,
        };
        let drawn = match &pre {
            Some(pre) => {
                let draws: Vec<RowDraw<'_>> = pre
                    .iter()
                    .map(|d| RowDraw {
                        sampling: d.sampling,
                        row_id: d.row_id,
                        allowed: d.allowed.as_deref(),
                    })
                    .collect();
                self.kv.forward_draw(kind, &tokens, &rows, &draws)?
            }
            None => None,
        };
        if drawn.is_none() {
            self.kv
                .forward(kind, &tokens, &rows, selected, &mut self.logits)?;
        }
        self.stats.steps += 1;
        self.stats.computed_tokens += tokens.len() as u64;
        if let (Some(drawn), Some(pre)) = (drawn, pre) {
            self.stats.device_draw_steps += 1;
            self.take_drawn(&plan, &drawn, &pre)?;
            self.flush();
            return Ok(!self.seqs.is_empty());
        }
        // Rows choose from their logits in place (no vocabulary-sized copy per row and step);
        // the buffer goes back for the next step whatever happens.
        let mut logits = std::mem::take(&mut self.logits);
        let taken = self.take_tokens(&plan, &mut logits);
        self.logits = logits;
        taken?;
        self.flush();
        Ok(!self.seqs.is_empty())
    }

    /// How each planned sequence's token is drawn on the device this step, or `None` when a
    /// sequence that chooses after it needs its logits on the host: log-probabilities, a logits
    /// processor, a repetition penalty, or a prompt whose sibling rows start from its logits.
    /// A constrained row's allowed tokens are computed here, before the forward; a row whose
    /// constraint cannot continue is marked to end (as `choose` finds on the host).
    fn device_draws(&mut self, plan: &[Planned]) -> Option<Vec<PlannedDraw>> {
        let mut out = Vec::with_capacity(plan.len());
        for p in plan {
            let s = &mut self.seqs[p.seq];
            let chooses = s.pending() == p.n;
            let o = &s.opts;
            let mut d = PlannedDraw {
                sampling: o.sampling,
                row_id: s.row as u32,
                allowed: None,
                broken: false,
            };
            if chooses {
                let siblings = s.row == 0 && s.state.generated == 0 && o.num_samples > 1;
                if siblings || o.needs_host_logits() {
                    return None;
                }
                if s.state.tool.forced.is_empty() {
                    if let Some(c) = s.state.constraint.as_mut() {
                        match c.allowed() {
                            Ok(set) => d.allowed = Some(set.as_slice().to_vec()),
                            Err(_) => d.broken = true,
                        }
                    }
                }
            }
            out.push(d);
        }
        Some(out)
    }

    /// Advances each planned sequence by its rows; those that have caught up take their drawn
    /// token (or a queued tool token, which comes first, as in `choose`) through their rules.
    fn take_drawn(
        &mut self,
        plan: &[Planned],
        drawn: &[u32],
        pre: &[PlannedDraw],
    ) -> Result<(), EngineError> {
        for ((p, &token), d) in plan.iter().zip(drawn).zip(pre) {
            let i = p.seq;
            self.seqs[i].computed += p.n;
            if self.seqs[i].pending() > 0 {
                continue;
            }
            if self.seqs[i].row == 0 && self.seqs[i].state.generated == 0 {
                // No sibling waits (`device_draws` checked): only the prefix is published.
                self.on_prompt_done(i, &[])?;
            }
            if d.broken {
                self.finish(i, FinishReason::ConstraintBroken);
                continue;
            }
            let (token, mask) = match self.seqs[i].state.tool.forced.pop_front() {
                Some(forced) => (forced, 0),
                None => (token, 1),
            };
            self.accept_token(i, token, mask)?;
        }
        Ok(())
    }

    /// Whether sequence `i` can decode in the graph: a plain decode row, nothing the host must
    /// do between its tokens (the device draws them with the row's own parameters and seed).
    fn graph_row(&self, i: usize) -> bool {
        let s = &self.seqs[i];
        let o = &s.opts;
        s.slot.is_some()
            && s.pending() == 1
            && s.spec.is_none()
            && s.state.constraint.is_none()
            && s.state.tool.forced.is_empty()
            && !(o.tools && self.tools.is_some())
            && !o.needs_host_logits()
    }

    /// Whether a graph phase can start now: the pool has a decode graph, something runs, every
    /// sequence with a slot is a graph row, they fit a bucket, and nothing waits.
    fn graph_can_start(&self) -> bool {
        if !self.kv.has_graph() || self.seqs.iter().any(|s| s.slot.is_none()) {
            return false;
        }
        let rows = self.seqs.len();
        rows > 0
            && kiln_codegen::bucket_for(rows).is_some()
            && (0..rows).all(|i| self.graph_row(i))
            && self.graph_budget() > 0
    }

    /// Whether the running graph phase goes on: nothing waits for a slot or holds one outside
    /// the graph, and every sequence in it is still a graph row.
    fn graph_can_go_on(&self) -> bool {
        let Some(g) = &self.graph else {
            return false;
        };
        !g.is_empty()
            && self.seqs.iter().enumerate().all(|(i, s)| {
                s.finished() || (g.rows.contains(&Some((s.request, s.row))) && self.graph_row(i))
            })
    }

    /// Replays worth running for the sequences that hold slots: none past a row's capacity,
    /// none past the longest `max_tokens` still to come.
    fn graph_budget(&self) -> usize {
        let capacity = self.kv.tables().capacity();
        let live = self.seqs.iter().filter(|s| s.slot.is_some());
        let room = live
            .clone()
            .map(|s| capacity.saturating_sub(s.computed))
            .min()
            .unwrap_or(0);
        let wanted = live
            .map(|s| {
                s.opts
                    .max_tokens
                    .map_or(usize::MAX, |m| m.saturating_sub(s.state.generated))
            })
            .max()
            .unwrap_or(0);
        room.min(wanted)
    }

    /// Starts the graph on every sequence (each feeding its pending token at its cached length).
    fn start_graph(&mut self) -> Result<(), EngineError> {
        let mut order: Vec<usize> = (0..self.seqs.len()).collect();
        order.sort_by_key(|&i| (self.seqs[i].order, self.seqs[i].row));
        let budget = self.graph_budget();
        let bucket = kiln_codegen::bucket_for(order.len()).expect("graph_can_start checked");
        let rows: Vec<GraphRow> = order
            .iter()
            .map(|&i| {
                let s = &self.seqs[i];
                GraphRow {
                    slot: s.slot.expect("graph rows hold slots"),
                    pos: s.computed,
                    token: s.tokens[s.computed],
                    row_id: s.row as u32,
                }
            })
            .collect();
        let sampling: Vec<_> = order.iter().map(|&i| self.seqs[i].opts.sampling).collect();
        match self.kv.graph_start(bucket, &rows, &sampling) {
            Ok(()) => {}
            // Too little room for the rows' first blocks: the host path preempts.
            Err(EngineError::Kv(KvError::Pool(PoolError::Exhausted { .. }))) => return Ok(()),
            Err(e) => return Err(e),
        }
        self.stats.graph_starts += 1;
        self.graph = Some(GraphPhase {
            rows: order
                .iter()
                .map(|&i| Some((self.seqs[i].request, self.seqs[i].row)))
                .collect(),
            in_flight: 0,
            budget,
            left: Vec::new(),
        });
        Ok(())
    }

    /// Stops the graph phase: the replays in flight are dropped (each row feeds its pending
    /// token again on the host path, over what the graph wrote there), the slots of rows that
    /// left are closed, and blocks the graph took ahead of the rows go back to the pool.
    fn stop_graph(&mut self) -> Result<(), EngineError> {
        let Some(g) = self.graph.take() else {
            return Ok(());
        };
        self.stats.graph_dropped += g.in_flight as u64;
        self.kv.graph_stop()?;
        for slot in g.left {
            self.kv.close_slot(slot);
        }
        for s in &self.seqs {
            if let Some(slot) = s.slot {
                self.kv.truncate(slot, s.computed);
            }
        }
        Ok(())
    }

    /// One step of the graph phase: tops the queue up, consumes the oldest replay (each row's
    /// fed token is now cached; its sampled token goes through the row's stop rules), and
    /// returns `false` (nothing consumed) when no replay can run any more.
    fn graph_step(&mut self) -> Result<bool, EngineError> {
        let g = self.graph.as_mut().expect("a graph phase runs");
        while g.in_flight < GRAPH_DEPTH && g.budget > 0 && !g.is_empty() {
            self.kv.graph_enqueue()?;
            g.in_flight += 1;
            g.budget -= 1;
        }
        if g.in_flight == 0 {
            return Ok(false);
        }
        let sampled = self.kv.graph_next()?;
        g.in_flight -= 1;
        let rows = g.rows.clone();
        let mut fed = 0;
        for (b, key) in rows.into_iter().enumerate() {
            let Some((request, row)) = key else {
                continue;
            };
            let Some(i) = self
                .seqs
                .iter()
                .position(|s| s.request == request && s.row == row)
            else {
                continue;
            };
            let token = sampled.get(b).copied().flatten().ok_or_else(|| {
                EngineError::Request(format!("decode graph row {b} produced no token"))
            })?;
            fed += 1;
            let s = &mut self.seqs[i];
            s.computed += 1;
            let slot = s.slot.expect("graph rows hold slots");
            self.kv.set_len(slot, s.computed);
            self.accept_token(i, token, 1)?;
        }
        self.stats.steps += 1;
        self.stats.graph_steps += 1;
        self.stats.computed_tokens += fed;
        Ok(true)
    }

    /// The row takes `token` (sampled, on the host or the device, with its own parameters:
    /// `mask` 1; a forced tool token: 0) and applies its stop rules.
    fn accept_token(&mut self, i: usize, token: u32, mask: u8) -> Result<(), EngineError> {
        let engine = Arc::clone(&self.engine);
        let s = &mut self.seqs[i];
        let opts = Arc::clone(&s.opts);
        let stop_tokens = Arc::clone(&s.stop_tokens);
        let rules = row_rules(
            &engine,
            self.tools.as_ref(),
            self.kv.tables().capacity(),
            &opts,
            &stop_tokens,
        );
        let pos = s.tokens.len();
        let step = s.state.accept(&rules, token, mask, pos)?;
        let finished = step.finished;
        if finished.is_none() {
            s.tokens.push(token);
        }
        let (request, row) = (s.request, s.row);
        self.record(request, row, 0, step);
        if let Some(reason) = finished {
            self.finish(i, reason);
        }
        Ok(())
    }

    /// Advances each planned sequence by its rows and lets those that have caught up choose a
    /// token from their row of `logits` (rows in plan order: one per entry, `n` for a
    /// verifying one).
    fn take_tokens(&mut self, plan: &[Planned], logits: &mut [f32]) -> Result<(), EngineError> {
        let vocab = self.engine.config().vocab_size;
        let mut at = 0;
        for &Planned { seq: i, n, verify } in plan {
            if verify {
                self.verify(i, &mut logits[at * vocab..(at + n) * vocab], n)?;
                at += n;
                continue;
            }
            let row = &mut logits[at * vocab..(at + 1) * vocab];
            at += 1;
            self.seqs[i].computed += n;
            if self.seqs[i].pending() > 0 {
                continue;
            }
            if self.seqs[i].row == 0 && self.seqs[i].state.generated == 0 {
                self.on_prompt_done(i, row)?;
            }
            self.take_token(i, row)?;
        }
        Ok(())
    }

    /// Row 0 of a request just finished its prompt: its whole blocks go to the prefix cache and
    /// every sibling row starts from them, with the same logits.
    fn on_prompt_done(&mut self, i: usize, logits: &[f32]) -> Result<(), EngineError> {
        let slot = self.seqs[i].slot.expect("a computed sequence holds a slot");
        let len = self.seqs[i].computed;
        if self.opts.prefix_cache {
            let t = self.seqs[i].tokens.clone();
            self.kv.publish_prefix(slot, &t);
        }
        let id = self.seqs[i].request;
        for j in self.rows_of(id) {
            if !self.seqs[j].waits_for_prompt {
                continue;
            }
            self.seqs[j].waits_for_prompt = false;
            let to = self.kv.open_slot();
            self.kv.copy_slot(slot, to, len);
            self.seqs[j].slot = Some(to);
            self.seqs[j].computed = len;
            self.take_token(j, &mut logits.to_vec())?;
        }
        Ok(())
    }

    /// The row chooses its next token from `logits` (or takes a forced one) and applies its
    /// stop rules.
    fn take_token(&mut self, i: usize, logits: &mut [f32]) -> Result<(), EngineError> {
        let engine = Arc::clone(&self.engine);
        let s = &mut self.seqs[i];
        let opts = Arc::clone(&s.opts);
        let stop_tokens = Arc::clone(&s.stop_tokens);
        let rules = row_rules(
            &engine,
            self.tools.as_ref(),
            self.kv.tables().capacity(),
            &opts,
            &stop_tokens,
        );
        let pos = s.tokens.len();
        let Some((token, mask)) = s.state.choose(&rules, s.row, &s.tokens, pos, logits) else {
            // No token continues the row's constraint: it ends without one.
            self.finish(i, FinishReason::ConstraintBroken);
            return Ok(());
        };
        self.accept_token(i, token, mask)
    }

    /// Queues a row's `j`-th token of this scheduler step for its request's consumer.
    fn record(&mut self, request: RequestId, row: usize, j: usize, step: RowStep) {
        self.stats.generated_tokens += 1;
        if let Some(r) = self.requests.get_mut(&request) {
            r.usage.completion_tokens += 1;
            let n = r.reasons.len();
            while r.steps.len() <= j {
                r.steps.push(vec![None; n]);
            }
            r.steps[j][row] = Some(step);
        }
    }

    /// Sequence `i` fed its pending token and its proposals (`n` rows of `logits`): walks the
    /// rows in order through the row's own rules, keeping each proposal the row agrees with;
    /// the first row that chooses otherwise, finishes the row, or has no proposal left ends the
    /// walk. The cache is cut back to the positions whose tokens were kept.
    fn verify(&mut self, i: usize, logits: &mut [f32], n: usize) -> Result<(), EngineError> {
        let engine = Arc::clone(&self.engine);
        let vocab = engine.config().vocab_size;
        let s = &mut self.seqs[i];
        let opts = Arc::clone(&s.opts);
        let stop_tokens = Arc::clone(&s.stop_tokens);
        let rules = row_rules(
            &engine,
            self.tools.as_ref(),
            self.kv.tables().capacity(),
            &opts,
            &stop_tokens,
        );
        let spec = s.spec.as_mut().expect("verifying sequences speculate");
        let proposals = std::mem::take(&mut spec.proposals);
        debug_assert_eq!(proposals.len() + 1, n);
        let cached = s.computed;
        let mut accepted = 0;
        let mut end = None;
        let mut taken = Vec::with_capacity(n);
        for (j, row_logits) in logits.chunks_exact_mut(vocab).take(n).enumerate() {
            let pos = s.tokens.len();
            let proposal = proposals.get(j);
            let chosen = choose_verified(
                &mut s.state,
                &rules,
                s.row,
                &s.tokens,
                pos,
                row_logits,
                proposal,
            );
            let Some((token, mask)) = chosen else {
                // No token continues the row's constraint: it ends without one.
                end = Some(FinishReason::ConstraintBroken);
                break;
            };
            let step = s.state.accept(&rules, token, mask, pos)?;
            let finished = step.finished;
            taken.push(step);
            if let Some(reason) = finished {
                end = Some(reason);
                break;
            }
            s.tokens.push(token);
            if proposal.is_some_and(|p| p.token == token) {
                accepted += 1;
                continue;
            }
            break;
        }
        // Kept: the pending token and the proposals up to the row that ended the walk.
        let kept = cached + 1 + accepted;
        s.computed = kept;
        let slot = s.slot.expect("a verifying sequence holds a slot");
        self.kv.truncate(slot, kept);
        if spec.guessed {
            spec.k = spec.opts.next_k(spec.k, proposals.len(), accepted);
        }
        let proposed = if spec.guessed { proposals.len() } else { 0 };
        let accepted = if spec.guessed { accepted } else { 0 };
        let (request, row) = (s.request, s.row);
        self.stats.spec_verify_passes += 1;
        self.stats.spec_proposed_tokens += proposed as u64;
        self.stats.spec_accepted_tokens += accepted as u64;
        if let Some(st) = self
            .requests
            .get_mut(&request)
            .and_then(|r| r.spec.as_mut())
        {
            st.verify_passes += 1;
            st.proposed += proposed;
            st.accepted += accepted;
        }
        for (j, step) in taken.into_iter().enumerate() {
            self.record(request, row, j, step);
        }
        if let Some(reason) = end {
            self.finish(i, reason);
        }
        Ok(())
    }

    /// Fills sequence `i`'s proposals for its next step, at most `limit` of them (its share
    /// of the step's budget), never past its cache or its `max_tokens`. Returns how many; a
    /// row with a draft model is instead added to `drafted` with the number it may propose
    /// (returned, as its share of the budget), for [`Scheduler::propose_drafted`].
    fn propose(&mut self, i: usize, limit: usize, drafted: &mut Vec<(usize, usize)>) -> usize {
        let capacity = self.kv.tables().capacity();
        let s = &mut self.seqs[i];
        let Some(spec) = s.spec.as_mut() else {
            return 0;
        };
        // The pending token goes at `computed`; proposals fill the cache at most, and none is
        // wasted past `max_tokens`.
        let room = capacity.saturating_sub(s.computed + 1);
        let left = s
            .opts
            .max_tokens
            .map_or(usize::MAX, |m| m.saturating_sub(s.state.generated));
        let want = spec.k.min(room).min(left.saturating_sub(1)).min(limit);
        // Queued tool output needs no guessing: it is proposed as is.
        spec.guessed = s.state.tool.forced.is_empty();
        spec.proposals = if !spec.guessed {
            let forced = s.state.tool.forced.iter().take(want);
            forced.map(|&token| Proposal { token, q: None }).collect()
        } else if want == 0 {
            Vec::new()
        } else {
            match &spec.opts.method {
                SpecMethod::Ngram => spec::lookup(&s.tokens, want),
                SpecMethod::Draft(_) => {
                    drafted.push((i, want));
                    return want;
                }
            }
        };
        spec.proposals.len()
    }

    /// Runs the draft models for the rows [`Scheduler::propose`] set aside: per draft, every
    /// row's catch-up in one pass and then one pass per proposal position. Draft caches of
    /// rows that are gone are freed first.
    fn propose_drafted(&mut self, drafted: &[(usize, usize)]) -> Result<(), EngineError> {
        if self.drafts.is_empty() {
            return Ok(());
        }
        let live: std::collections::HashSet<(RequestId, usize)> =
            self.seqs.iter().map(|s| (s.request, s.row)).collect();
        for batch in &mut self.drafts {
            batch.retain(|key| live.contains(key));
        }
        for batch in &mut self.drafts {
            let mine: Vec<(usize, usize)> = drafted
                .iter()
                .copied()
                .filter(|&(i, _)| {
                    let method = self.seqs[i].spec.as_ref().map(|sp| &sp.opts.method);
                    matches!(method, Some(SpecMethod::Draft(d)) if batch.runs(d))
                })
                .collect();
            if mine.is_empty() {
                continue;
            }
            let asks: Vec<DraftAsk<'_>> = mine
                .iter()
                .map(|&(i, k)| {
                    let s = &self.seqs[i];
                    DraftAsk {
                        key: (s.request, s.row),
                        context: &s.tokens,
                        k,
                        sampling: &s.opts.sampling,
                        row: s.row as u32,
                    }
                })
                .collect();
            let proposals = batch.propose(&asks)?;
            drop(asks);
            for (&(i, _), p) in mine.iter().zip(proposals) {
                if let Some(sp) = self.seqs[i].spec.as_mut() {
                    sp.proposals = p;
                }
            }
        }
        Ok(())
    }

    /// Admits waiting sequences in arrival order while there is room.
    fn admit_waiting(&mut self) {
        let mut order: Vec<usize> = (0..self.seqs.len())
            .filter(|&i| self.seqs[i].slot.is_none() && !self.seqs[i].waits_for_prompt)
            .collect();
        order.sort_by_key(|&i| (self.seqs[i].order, self.seqs[i].row));
        let running = self.seqs.iter().filter(|s| s.slot.is_some()).count();
        for (running, i) in (running..).zip(order) {
            if running >= self.opts.max_running {
                break;
            }
            // Room for the first chunk; later chunks preempt if they must.
            let first = self.seqs[i].tokens.len().min(self.opts.max_step_tokens) + 1;
            if self.kv.tables().available_blocks() < self.kv.tables().layout().blocks_for(first) + 1
                && running > 0
            {
                break;
            }
            self.admit(i);
        }
    }

    /// The rows of the next step: `(sequence, tokens to feed)`, decode rows first, then prefill
    /// chunks under the token budget, with blocks prepared for each (preempting the latest
    /// admitted sequences when the pool runs out).
    fn plan(&mut self) -> Result<Vec<Planned>, EngineError> {
        let mut running: Vec<usize> = (0..self.seqs.len())
            .filter(|&i| self.seqs[i].slot.is_some() && self.seqs[i].pending() > 0)
            .collect();
        running.sort_by_key(|&i| (self.seqs[i].order, self.seqs[i].row));
        // Every decode row runs (at most max_running of them); proposals take what is left of
        // the budget but a quarter kept for waiting prompts, up to `spec_step_rows` rows in
        // all; prefill gets the rest, and at least that quarter.
        let quarter = self.opts.max_step_tokens.div_ceil(4);
        let decode_rows = running
            .iter()
            .filter(|&&i| self.seqs[i].pending() == 1)
            .count();
        let prompt_waits = running.iter().any(|&i| self.seqs[i].pending() > 1);
        let mut spare = self
            .opts
            .max_step_tokens
            .saturating_sub(decode_rows)
            .saturating_sub(if prompt_waits { quarter } else { 0 })
            .min(self.opts.spec_step_rows.saturating_sub(decode_rows));
        let verifying: Vec<usize> = running
            .iter()
            .copied()
            .filter(|&i| self.seqs[i].pending() == 1 && self.seqs[i].verifies())
            .collect();
        let share = spare.div_ceil(verifying.len().max(1));
        let mut drafted = Vec::new();
        for &i in &verifying {
            spare -= self.propose(i, spare.min(share), &mut drafted);
        }
        self.propose_drafted(&drafted)?;
        let mut want: Vec<(usize, usize)> = Vec::new();
        let mut planned_tokens = 0;
        for &i in &running {
            if self.seqs[i].pending() == 1 {
                let extra = match &self.seqs[i].spec {
                    Some(sp) if self.seqs[i].verifies() => sp.proposals.len(),
                    _ => 0,
                };
                want.push((i, 1 + extra));
                planned_tokens += 1 + extra;
            }
        }
        let mut budget = self
            .opts
            .max_step_tokens
            .saturating_sub(planned_tokens)
            .max(quarter);
        for &i in &running {
            let p = self.seqs[i].pending();
            if p > 1 && budget > 0 {
                let n = p.min(budget);
                want.push((i, n));
                budget -= n;
            }
        }
        want.sort_by_key(|&(i, _)| (self.seqs[i].order, self.seqs[i].row));
        let mut plan = Vec::new();
        let mut k = 0;
        while k < want.len() {
            let (i, n) = want[k];
            let Some(slot) = self.seqs[i].slot else {
                k += 1;
                continue;
            };
            match self.kv.prepare(slot, self.seqs[i].computed + n) {
                Ok(()) => {
                    plan.push((i, n));
                    k += 1;
                }
                Err(EngineError::Kv(KvError::Pool(PoolError::Exhausted { .. }))) => {
                    // Preempt the latest admitted other sequence, planned or not; else this one.
                    let victim = (0..self.seqs.len())
                        .filter(|&j| j != i && self.seqs[j].slot.is_some())
                        .max_by_key(|&j| (self.seqs[j].order, self.seqs[j].row));
                    match victim {
                        Some(j)
                            if (self.seqs[j].order, self.seqs[j].row)
                                > (self.seqs[i].order, self.seqs[i].row) =>
                        {
                            self.preempt(j);
                            plan.retain(|&(p, _)| p != j);
                        }
                        _ if plan.is_empty() && !self.others_running(i) => {
                            let e = KvError::Pool(PoolError::Exhausted {
                                blocks: self.kv.tables().pool().num_blocks(),
                            });
                            self.fail_request(self.seqs[i].request, &e.to_string());
                            k += 1;
                        }
                        _ => {
                            self.preempt(i);
                            k += 1;
                        }
                    }
                }
                Err(e) => return Err(e),
            }
        }
        plan.retain(|&(i, _)| self.seqs[i].slot.is_some());
        Ok(plan
            .into_iter()
            .map(|(seq, n)| Planned {
                seq,
                n,
                verify: self.seqs[seq].verifies(),
            })
            .collect())
    }

    fn others_running(&self, i: usize) -> bool {
        self.seqs
            .iter()
            .enumerate()
            .any(|(j, s)| j != i && s.slot.is_some())
    }

    /// Ends every request with an error event (a step failed).
    pub fn fail_all(&mut self, message: &str) {
        let ids: Vec<RequestId> = self.requests.keys().copied().collect();
        for id in ids {
            self.fail_request(id, message);
        }
        self.seqs.retain(|s| !s.state.finished);
    }

    /// Ends a request with an error event.
    fn fail_request(&mut self, id: RequestId, message: &str) {
        for i in self.rows_of(id) {
            let s = &mut self.seqs[i];
            s.state.finished = true;
            if let Some(slot) = s.slot.take() {
                self.kv.close_slot(slot);
            }
        }
        if let Some(mut r) = self.requests.remove(&id) {
            (r.sink)(Event::Error(message.to_string()));
        }
    }
}

/// A sequence's rules: its request's options and stop tokens, the engine's tool tokens when
/// the request runs tools, and the serving cache's capacity.
fn row_rules<'a>(
    engine: &'a Engine,
    tools: Option<&'a ToolTokens>,
    capacity: usize,
    opts: &'a GenerateOptions,
    stop_tokens: &'a [u32],
) -> RowRules<'a> {
    RowRules {
        tokenizer: engine.tokenizer(),
        opts,
        stop_tokens,
        tools: tools.filter(|_| opts.tools),
        capacity,
    }
}

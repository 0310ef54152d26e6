//! A draft model proposing for many sequences at once: the scheduler's speculating rows keep
//! their draft caches in one pool, and each proposal position is one forward pass of the draft
//! over every row that still proposes — instead of one pass per row and position, which made a
//! draft slower than plain decoding as soon as several sequences ran together.
//!
//! Per row the tokens are those [`super::draft::DraftRunner`] proposes for the same context:
//! the cache is rolled back to the longest prefix it shares with the row's tokens, the rest is
//! fed (one prefill pass for every row's catch-up together), and proposals are picked by
//! [`pick`] with the same keyed draws.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use super::draft::{pick, Proposal};
use crate::backend::TokenRow;
use crate::engine::backend::ServingPool;
use crate::engine::session::reusable_prefix;
use crate::engine::{Engine, EngineError, RequestId};
use crate::kv::{KvBudget, KvError, KvOptions, PoolError};
use crate::plan::PlanKind;
use crate::sample::SamplingParams;

/// A scheduler row: its request and its row within the request.
pub(crate) type DraftKey = (RequestId, usize);

/// What one row asks of the draft this step.
pub(crate) struct DraftAsk<'a> {
    pub key: DraftKey,
    /// The row's tokens so far (prompt and generated); proposals continue them.
    pub context: &'a [u32],
    /// Proposals wanted.
    pub k: usize,
    pub sampling: &'a SamplingParams,
    /// The row id its draws are keyed by.
    pub row: u32,
}

/// One row's draft cache: its slot and the tokens the slot holds.
struct Held {
    slot: usize,
    tokens: Vec<u32>,
}

/// The caches of every row drafted by one draft model, in one pool on the draft engine's
/// device (a GPU draft model's pool and passes are the serving pool's device path; on an H200 the
/// scheduler's GPU test drafted a third of its requests with the GPU engine and matched the CPU,
/// docs/gpu-results.md run 10).
pub(crate) struct DraftBatch {
    engine: Arc<Engine>,
    pool: Box<dyn ServingPool>,
    logits: Vec<f32>,
    held: HashMap<DraftKey, Held>,
    /// Forward passes run.
    passes: u64,
}

impl DraftBatch {
    /// A pool of `blocks` blocks (of `kv`'s size and storage) for `engine`'s caches.
    pub fn new(
        engine: Arc<Engine>,
        kv: KvOptions,
        blocks: usize,
    ) -> Result<DraftBatch, EngineError> {
        let budget = KvBudget::Blocks(blocks.max(1));
        let pool = engine.backend.new_pool(kv, budget, engine.max_context())?;
        Ok(DraftBatch {
            engine,
            pool,
            logits: Vec::new(),
            held: HashMap::new(),
            passes: 0,
        })
    }

    /// Whether this batch runs `engine`.
    pub fn runs(&self, engine: &Arc<Engine>) -> bool {
        Arc::ptr_eq(&self.engine, engine)
    }

    /// Forward passes run so far.
    pub fn passes(&self) -> u64 {
        self.passes
    }

    /// Frees the caches of rows `keep` says are gone.
    pub fn retain(&mut self, keep: impl Fn(&DraftKey) -> bool) {
        let pool = &mut self.pool;
        self.held.retain(|key, h| {
            let kept = keep(key);
            if !kept {
                pool.close_slot(h.slot);
            }
            kept
        });
    }

    /// Proposals for every ask, in order: up to `k` each, fewer where the draft's context or
    /// its pool runs out (a row whose cache cannot grow proposes nothing this step).
    pub fn propose(&mut self, asks: &[DraftAsk<'_>]) -> Result<Vec<Vec<Proposal>>, EngineError> {
        let capacity = self.pool.tables().capacity();
        let mut out: Vec<Vec<Proposal>> = asks.iter().map(|_| Vec::new()).collect();
        // How many each row proposes: the context and all but the last proposal go through
        // the draft's cache.
        let mut ks: Vec<usize> = asks
            .iter()
            .map(|a| {
                let fits = !a.context.is_empty() && a.context.len() <= capacity;
                let k = a.k.min((capacity + 1).saturating_sub(a.context.len()));
                if fits {
                    k
                } else {
                    0
                }
            })
            .collect();
        // Roll each cache back to what it shares with its row and reserve its blocks.
        let asking: HashSet<DraftKey> = asks.iter().map(|a| a.key).collect();
        for (a, k) in asks.iter().zip(ks.iter_mut()) {
            if *k == 0 {
                continue;
            }
            let h = match self.held.get_mut(&a.key) {
                Some(h) => h,
                None => {
                    let slot = self.pool.open_slot();
                    let h = Held {
                        slot,
                        tokens: Vec::new(),
                    };
                    self.held.entry(a.key).or_insert(h)
                }
            };
            // Within what the cache holds (a failed pass may have left `tokens` ahead of it).
            let common = reusable_prefix(&h.tokens, a.context).min(self.pool.tables().len(h.slot));
            self.pool.truncate(h.slot, common);
            h.tokens.truncate(common);
            let end = a.context.len() + *k - 1;
            let slot = h.slot;
            if !reserve(&mut *self.pool, &mut self.held, &asking, slot, end)? {
                *k = 0;
            }
        }
        // Catch-up: every row's unseen tokens in one pass; its last row gives proposal 1.
        let mut tokens = Vec::new();
        let mut rows = Vec::new();
        let mut live = Vec::new();
        for (j, (a, &k)) in asks.iter().zip(&ks).enumerate() {
            if k == 0 {
                continue;
            }
            let h = self.held.get_mut(&a.key).expect("reserved above");
            let from = h.tokens.len();
            tokens.extend_from_slice(&a.context[from..]);
            rows.extend((from..a.context.len()).map(|pos| TokenRow { slot: h.slot, pos }));
            h.tokens.extend_from_slice(&a.context[from..]);
            live.push(j);
        }
        let mut kind = if tokens.len() == live.len() {
            PlanKind::Decode
        } else {
            PlanKind::Prefill
        };
        let vocab = self.engine.config().vocab_size;
        while !live.is_empty() {
            // One logit row per row drafting: its last.
            self.pool
                .forward(kind, &tokens, &rows, None, &mut self.logits)?;
            self.passes += 1;
            for (&j, logits) in live.iter().zip(self.logits.chunks_exact(vocab)) {
                let a = &asks[j];
                let pos = a.context.len() + out[j].len();
                out[j].push(pick(logits, a.sampling, a.row, pos));
            }
            // The rows still proposing feed their last proposal.
            live.retain(|&j| out[j].len() < ks[j]);
            tokens.clear();
            rows.clear();
            for &j in &live {
                let h = self.held.get_mut(&asks[j].key).expect("reserved above");
                let token = out[j].last().expect("proposed above").token;
                rows.push(TokenRow {
                    slot: h.slot,
                    pos: h.tokens.len(),
                });
                tokens.push(token);
                h.tokens.push(token);
            }
            kind = PlanKind::Decode;
        }
        Ok(out)
    }
}

/// Makes `slot` writable up to `end`. When the pool is short, the caches of rows not asking
/// this step (waiting, or not speculating now) are freed first; `false` if it still does not
/// fit.
fn reserve(
    kv: &mut dyn ServingPool,
    held: &mut HashMap<DraftKey, Held>,
    asking: &HashSet<DraftKey>,
    slot: usize,
    end: usize,
) -> Result<bool, EngineError> {
    for attempt in 0..2 {
        match kv.prepare(slot, end) {
            Ok(()) => return Ok(true),
            Err(EngineError::Kv(KvError::Pool(PoolError::Exhausted { .. }))) if attempt == 0 => {
                held.retain(|key, h| {
                    let kept = asking.contains(key);
                    if !kept {
                        kv.close_slot(h.slot);
                    }
                    kept
                });
            }
            Err(EngineError::Kv(KvError::Pool(PoolError::Exhausted { .. }))) => return Ok(false),
            Err(e) => return Err(e),
        }
    }
    Ok(false)
}

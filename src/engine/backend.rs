//! What an engine asks of the device it runs on: a [`Backend`] (the compiled model there) and
//! the [`Caches`] it makes for each session. A session's caches hold the backend that made them,
//! so they can only ever run on that device.

use crate::backend::cpu::CpuBackend;
use crate::backend::{GraphRow, RowDraw, TokenRow};
use crate::kv::{KvBudget, KvCache, KvError, KvOptions};
use crate::model::ModelConfig;
use crate::plan::{ExecutionPlan, PlanKind};
use crate::sample::SamplingParams;

use super::{EngineError, LogitsProcessor};

/// The compiled model on its device (one per engine), as the engine drives it.
pub(crate) trait Backend: Send + Sync {
    fn config(&self) -> &ModelConfig;

    fn plan(&self, kind: PlanKind) -> &ExecutionPlan;

    /// Bytes the weights occupy where they run.
    fn weight_bytes(&self) -> usize;

    /// One line naming the device and the decode path.
    fn describe(&self) -> String;

    /// Empty session memory for `slots` rows of `capacity` positions (device memory is taken on
    /// first use, so that creating a session cannot fail).
    fn new_caches(&self, slots: usize, capacity: usize) -> Box<dyn Caches>;

    /// The shared KV pool of a serving engine's scheduler: as many blocks as `budget` allows,
    /// no slot open, slots of up to `capacity` positions. `opts` (block size, storage type)
    /// applies where the backend offers a choice; the CUDA pool always stores bf16 in blocks of
    /// its default size.
    fn new_pool(
        &self,
        opts: KvOptions,
        budget: KvBudget,
        capacity: usize,
    ) -> Result<Box<dyn ServingPool>, EngineError>;

    /// Whether this is the CPU stand-in for the decode graph, which can apply a logits
    /// processor (tests script tool calls through it).
    fn emulates_graph(&self) -> bool {
        false
    }

    /// Whether decode runs through the graph-replayed megakernel (or its CPU stand-in).
    fn uses_megakernel(&self) -> bool;

    /// The CPU backend, when this is it.
    fn cpu(&self) -> Option<&CpuBackend> {
        None
    }

    /// The CUDA backend, when this is it.
    #[cfg(feature = "cuda")]
    fn cuda(&self) -> Option<&crate::backend::cuda::CudaBackend> {
        None
    }
}

/// A session's memory on the device of the backend that made it (one per session). It holds
/// that backend, so every call runs where the memory lives.
pub(crate) trait Caches: Send {
    /// Positions slot `slot` holds.
    fn len(&self, slot: usize) -> usize;

    fn capacity(&self) -> usize;

    /// Slots the session asked for (a CUDA cache may hold more, for padding rows).
    fn slots(&self) -> usize;

    /// Forgets positions from `len` on.
    fn truncate(&mut self, slot: usize, len: usize);

    /// Sets a slot's confirmed length (positions a graph step wrote, once consumed).
    fn set_len(&mut self, slot: usize, len: usize);

    /// Makes slot `to` hold slot `from`'s first `len` positions.
    fn copy_slot(&mut self, from: usize, to: usize, len: usize) -> Result<(), EngineError>;

    /// Runs one step, logits to the host. Returns the number of logit rows.
    fn forward(
        &mut self,
        kind: PlanKind,
        tokens: &[u32],
        rows: &[TokenRow],
        logits: &mut Vec<f32>,
    ) -> Result<usize, EngineError>;

    /// A decode step with sampling on the device: one token per row, or `None` (and nothing
    /// run) where the device cannot sample, and the caller runs [`Caches::forward`] instead.
    fn forward_sample(
        &mut self,
        tokens: &[u32],
        rows: &[TokenRow],
        sampling: &SamplingParams,
        row_ids: &[u32],
    ) -> Result<Option<Vec<u32>>, EngineError>;

    /// A decode step with each row drawn where the logits are, its own way (`draws`, one per
    /// row: a constrained row's allowed tokens applied there first): only the tokens come back.
    /// `None` (and nothing run) where the device cannot.
    fn forward_draw(
        &mut self,
        _tokens: &[u32],
        _rows: &[TokenRow],
        _draws: &[RowDraw<'_>],
    ) -> Result<Option<Vec<u32>>, EngineError> {
        Ok(None)
    }

    /// Starts the decode graph of `bucket` rows on `rows` (nothing runs until enqueued).
    fn graph_start(
        &mut self,
        bucket: usize,
        rows: &[GraphRow],
        sampling: &SamplingParams,
        stop_tokens: &[u32],
        emulation: CpuGraphInputs<'_>,
    ) -> Result<(), EngineError>;

    /// Queues one more step of the started graph (on a GPU: a replay, no host sync).
    fn graph_enqueue(&mut self, bucket: usize) -> Result<(), EngineError>;

    /// The oldest queued step's sampled tokens, one per started row (waits for it on a GPU).
    fn graph_next(&mut self, bucket: usize) -> Result<Vec<u32>, EngineError>;

    /// Drops every queued step (on a GPU, after waiting for them to finish).
    fn graph_stop(&mut self, bucket: usize) -> Result<(), EngineError>;
}

/// The refusal of a `graph_*` call on a pool without a decode graph (a scheduler's bug: it
/// asks [`ServingPool::has_graph`] first).
pub(crate) fn no_graph() -> EngineError {
    EngineError::Request("this pool has no decode graph".into())
}

/// Positions ahead of where it writes that a serving decode graph's row holds blocks for: the
/// replays in flight (at most the ring's depth of 8) write within them, and the row takes more
/// as it advances, so a graph row never holds its slot's whole capacity.
pub(crate) const GRAPH_REACH: usize = 16;

/// A scheduler's KV pool on the device of the backend that made it (it holds that backend):
/// one slot per running sequence over shared blocks, the prefix cache over those blocks, and
/// steps over rows of many slots, logits to the host.
pub(crate) trait ServingPool: Send {
    /// The bookkeeping: page tables, reference counts, the prefix cache, the layout.
    fn tables(&self) -> &KvCache;

    /// The bookkeeping, for the changes that move no data wherever the data lives (the provided
    /// methods below). Making positions writable is [`ServingPool::prepare`]'s: on a device it
    /// also copies shared blocks there.
    fn tables_mut(&mut self) -> &mut KvCache;

    /// A new empty slot (a closed one reused) for a sequence.
    fn open_slot(&mut self) -> usize {
        self.tables_mut().open_slot()
    }

    /// Gives a slot's blocks back (those shared stay with their other owners).
    fn close_slot(&mut self, slot: usize) {
        self.tables_mut().close_slot(slot)
    }

    /// Starts empty slot `slot` from the longest cached prefix of `tokens` (at most
    /// `max_positions`); returns the positions it now holds. Blocks are shared, not copied.
    fn attach_prefix(
        &mut self,
        slot: usize,
        tokens: &[u32],
        max_positions: usize,
    ) -> Result<usize, KvError> {
        self.tables_mut().attach_prefix(slot, tokens, max_positions)
    }

    /// Offers `slot`'s whole blocks, holding `tokens`, to the prefix cache.
    fn publish_prefix(&mut self, slot: usize, tokens: &[u32]) {
        self.tables_mut().publish_prefix(slot, tokens)
    }

    /// Makes slot `to` share slot `from`'s first `len` positions (no copy until either writes:
    /// [`ServingPool::prepare`] copies a shared partial block).
    fn copy_slot(&mut self, from: usize, to: usize, len: usize) {
        self.tables_mut().copy_slot(from, to, len)
    }

    /// Forgets positions from `len` on.
    fn truncate(&mut self, slot: usize, len: usize) {
        self.tables_mut().truncate(slot, len)
    }

    /// Sets how many positions of `slot` count as cached (a decode graph's positions, once
    /// their tokens are consumed: the graph itself never changes lengths).
    fn set_len(&mut self, slot: usize, len: usize) {
        self.tables_mut().set_len(slot, len)
    }

    /// Makes positions from `slot`'s length up to `end` writable: blocks taken from the pool,
    /// a shared partial block copied where the data lives. An exhausted pool is
    /// `EngineError::Kv(KvError::Pool(PoolError::Exhausted))`, which the scheduler answers by
    /// preempting.
    fn prepare(&mut self, slot: usize, end: usize) -> Result<(), EngineError>;

    /// Whether decode steps can run through the graph-replayed megakernel (on a CPU engine, its
    /// stand-in when the engine emulates the graph), through the `graph_*` calls below.
    fn has_graph(&self) -> bool {
        false
    }

    /// Starts the decode graph of `bucket` rows (captured on first use, then reused: starting
    /// again only uploads the row table) on `rows` (batch rows 0..n, the rest inactive), row
    /// `i` drawing with `sampling[i]`, keyed by its `row_id` and position as on the host. Each
    /// row's blocks are taken a few positions ahead of where it writes, and more as it
    /// advances ([`ServingPool::graph_enqueue`]), never up to the capacity at once.
    fn graph_start(
        &mut self,
        _bucket: usize,
        _rows: &[GraphRow],
        _sampling: &[SamplingParams],
    ) -> Result<(), EngineError> {
        Err(no_graph())
    }

    /// Batch row `b` stops decoding from the next replay on (replays already queued still
    /// write its slot: close it only after [`ServingPool::graph_stop`]).
    fn graph_leave(&mut self, _b: usize) -> Result<(), EngineError> {
        Err(no_graph())
    }

    /// Queues one replay, first taking the blocks the active rows write next. An exhausted
    /// pool is `EngineError::Kv(KvError::Pool(PoolError::Exhausted))` and queues nothing.
    fn graph_enqueue(&mut self) -> Result<(), EngineError> {
        Err(no_graph())
    }

    /// The oldest queued replay's sampled token for each batch row (`None`: inactive then).
    fn graph_next(&mut self) -> Result<Vec<Option<u32>>, EngineError> {
        Err(no_graph())
    }

    /// Waits for the queued replays and drops them; after it the pool's slots may be closed and
    /// steps run on them again.
    fn graph_stop(&mut self) -> Result<(), EngineError> {
        Ok(())
    }

    /// Whether [`ServingPool::forward_draw`] draws tokens where the logits are.
    fn draws_on_device(&self) -> bool {
        false
    }

    /// Runs one step like [`ServingPool::forward`] (one logit row per sequence) and draws each
    /// sequence's next token there, `draws[i]` for the sequence of the `i`-th logit row: only
    /// the tokens come back. `None`, and nothing run, where the pool cannot.
    fn forward_draw(
        &mut self,
        _kind: PlanKind,
        _tokens: &[u32],
        _rows: &[TokenRow],
        _draws: &[RowDraw<'_>],
    ) -> Result<Option<Vec<u32>>, EngineError> {
        Ok(None)
    }

    /// Runs one step over rows of any open slots, logits to the host: one row per sequence
    /// (its last), or with `logit_rows` the rows it names (increasing indices into `rows`).
    /// Returns the number of logit rows.
    fn forward(
        &mut self,
        kind: PlanKind,
        tokens: &[u32],
        rows: &[TokenRow],
        logit_rows: Option<&[usize]>,
        logits: &mut Vec<f32>,
    ) -> Result<usize, EngineError>;
}

/// What only the CPU stand-in for the decode graph uses: the logits processor (the device has
/// none) and each row's context for it.
pub(crate) struct CpuGraphInputs<'a> {
    pub processor: Option<&'a LogitsProcessor>,
    pub contexts: Vec<Vec<u32>>,
}

//! The KV cache: one layout ([`layout`]), a pool of blocks with reference counts ([`pool`]),
//! a page table per sequence, copy-on-write of shared blocks, and a prefix cache ([`prefix`])
//! over full blocks of token ids.
//!
//! A [`KvCache`] is the memory one step runs against: its sequences are numbered *slots*, each a
//! page table and a length. A session's cache has a fixed number of slots (its sample rows); an
//! engine's serving cache opens and closes slots as requests come and go. Backends address
//! positions only through [`layout::KvLayout`] and the slot's page table.

pub mod layout;
pub mod pool;
pub mod prefix;
pub mod storage;

use crate::graph::KvSpec;
pub use layout::{KvLayout, LayoutError, DEFAULT_BLOCK_SIZE};
pub use pool::{BlockPool, HeadRows, KvBudget, PoolError};
pub use prefix::PrefixCache;
pub use storage::KvDtype;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KvError {
    #[error("KV cache full: slot {slot} holds {len} of {capacity} positions and {needed} more were asked for")]
    Full {
        slot: usize,
        len: usize,
        capacity: usize,
        needed: usize,
    },
    #[error("KV cache slot {slot} does not exist (cache has {slots})")]
    NoSlot { slot: usize, slots: usize },
    #[error(transparent)]
    Pool(#[from] PoolError),
}

/// One sequence's blocks, in position order, and how many positions count as filled. Blocks
/// past `len` may exist (written ahead by a decode graph, not yet confirmed).
#[derive(Clone, Debug, Default)]
struct PageTable {
    blocks: Vec<u32>,
    len: usize,
    open: bool,
}

/// How a cache is cut and stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvOptions {
    pub block_size: usize,
    pub dtype: KvDtype,
}

impl Default for KvOptions {
    fn default() -> Self {
        KvOptions {
            block_size: DEFAULT_BLOCK_SIZE,
            dtype: KvDtype::F32,
        }
    }
}

pub struct KvCache {
    spec: KvSpec,
    pool: BlockPool,
    prefix: PrefixCache,
    tables: Vec<PageTable>,
    /// Positions a slot may hold at most.
    capacity: usize,
}

impl KvCache {
    /// `slots` sequences of up to `capacity` positions each, f32, default blocks; memory is
    /// taken as positions are written.
    pub fn new(spec: KvSpec, slots: usize, capacity: usize) -> Result<KvCache, KvError> {
        KvCache::new_of(spec, KvDtype::F32, slots, capacity)
    }

    /// [`KvCache::new`] storing keys and values as `dtype`.
    pub fn new_of(
        spec: KvSpec,
        dtype: KvDtype,
        slots: usize,
        capacity: usize,
    ) -> Result<KvCache, KvError> {
        let blocks = capacity.div_ceil(DEFAULT_BLOCK_SIZE).saturating_mul(slots);
        let opts = KvOptions {
            dtype,
            ..KvOptions::default()
        };
        let mut c = KvCache::with_budget(spec, opts, KvBudget::Blocks(blocks), capacity)?;
        for _ in 0..slots {
            c.open_slot();
        }
        Ok(c)
    }

    /// An empty cache (no slots) over a pool sized by `budget`; every slot may hold up to
    /// `capacity` positions.
    pub fn with_budget(
        spec: KvSpec,
        opts: KvOptions,
        budget: KvBudget,
        capacity: usize,
    ) -> Result<KvCache, KvError> {
        KvCache::build(spec, opts, budget, capacity, true)
    }

    /// Like [`KvCache::with_budget`], but the pool keeps only the bookkeeping (page tables,
    /// reference counts, free list), not the data: the host side of a device cache whose data
    /// lives in device memory in the same layout. Its owner replays the block copies
    /// [`KvCache::make_writable`] reports. Writes and state reads must not be used on it.
    pub fn tables_only(
        spec: KvSpec,
        opts: KvOptions,
        budget: KvBudget,
        capacity: usize,
    ) -> Result<KvCache, KvError> {
        KvCache::build(spec, opts, budget, capacity, false)
    }

    fn build(
        spec: KvSpec,
        opts: KvOptions,
        budget: KvBudget,
        capacity: usize,
        host_data: bool,
    ) -> Result<KvCache, KvError> {
        let layout = KvLayout {
            layers: spec.layers,
            kv_heads: spec.kv_heads,
            head_dim: spec.head_dim,
            state_dim: spec.state_dim,
            block_size: opts.block_size,
            num_blocks: 1,
            dtype: opts.dtype,
        };
        // A ceiling no array index can overflow: the pool grows toward it as it is used.
        let most =
            (isize::MAX as usize / layout.bytes_per_block().max(1)).min(u32::MAX as usize - 1);
        let budget = match budget {
            KvBudget::Blocks(n) => KvBudget::Blocks(n.min(most)),
            KvBudget::Bytes(b) => KvBudget::Blocks((b / layout.bytes_per_block().max(1)).min(most)),
        };
        if budget == KvBudget::Blocks(0) {
            return Err(PoolError::BudgetTooSmall {
                budget: 0,
                block: layout.bytes_per_block(),
            }
            .into());
        }
        let pool = if host_data {
            BlockPool::new(layout, budget)?
        } else {
            BlockPool::tables_only(layout, budget)?
        };
        Ok(KvCache {
            spec,
            prefix: PrefixCache::new(opts.block_size),
            pool,
            tables: Vec::new(),
            capacity,
        })
    }

    pub fn spec(&self) -> KvSpec {
        self.spec
    }

    pub fn layout(&self) -> &KvLayout {
        self.pool.layout()
    }

    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// Slot numbers in use or reusable (one past the highest).
    pub fn slots(&self) -> usize {
        self.tables.len()
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// A new empty slot (reusing a closed one).
    pub fn open_slot(&mut self) -> usize {
        let slot = match self.tables.iter().position(|t| !t.open) {
            Some(s) => s,
            None => {
                self.tables.push(PageTable::default());
                self.tables.len() - 1
            }
        };
        self.tables[slot].open = true;
        slot
    }

    /// Gives back a slot's blocks; the slot number may be handed out again.
    pub fn close_slot(&mut self, slot: usize) {
        if let Some(t) = self.tables.get_mut(slot) {
            for b in t.blocks.drain(..) {
                self.pool.release(b);
            }
            t.len = 0;
            t.open = false;
        }
    }

    fn table(&self, slot: usize) -> Result<&PageTable, KvError> {
        self.tables
            .get(slot)
            .filter(|t| t.open)
            .ok_or(KvError::NoSlot {
                slot,
                slots: self.tables.len(),
            })
    }

    /// Whether `slot` is open.
    pub fn has_slot(&self, slot: usize) -> bool {
        self.table(slot).is_ok()
    }

    /// Positions filled in `slot`.
    pub fn len(&self, slot: usize) -> usize {
        self.tables[slot].len
    }

    pub fn is_empty(&self, slot: usize) -> bool {
        self.tables[slot].len == 0
    }

    /// The blocks of `slot`, in position order.
    pub fn page_table(&self, slot: usize) -> &[u32] {
        &self.tables[slot].blocks
    }

    /// Bytes of cache memory taken so far.
    pub fn bytes(&self) -> usize {
        self.pool.bytes()
    }

    /// Bytes one position takes.
    pub fn bytes_per_position(&self) -> usize {
        self.layout().bytes_per_position()
    }

    /// Blocks a new position could still get: free ones plus what the prefix cache can evict.
    pub fn available_blocks(&self) -> usize {
        self.pool.free_blocks() + self.prefix.evictable(&self.pool)
    }

    /// Checks that `n` more positions fit in `slot`'s capacity.
    pub fn reserve(&self, slot: usize, n: usize) -> Result<(), KvError> {
        let len = self.table(slot)?.len;
        if len.saturating_add(n) > self.capacity {
            return Err(KvError::Full {
                slot,
                len,
                capacity: self.capacity,
                needed: n,
            });
        }
        Ok(())
    }

    /// A block from the pool, evicting from the prefix cache when none is free.
    fn alloc(&mut self) -> Result<u32, KvError> {
        match self.pool.alloc() {
            Ok(b) => Ok(b),
            Err(PoolError::Exhausted { .. }) if self.prefix.evict(&mut self.pool, 1) == 1 => {
                Ok(self.pool.alloc()?)
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Makes positions `len(slot)..end` writable: blocks are added where the page table has
    /// none, and a block shared with another holder is first copied into one of the slot's own
    /// (copy-on-write). Backends call this before a step writes.
    pub fn prepare(&mut self, slot: usize, end: usize) -> Result<(), KvError> {
        let start = self.table(slot)?.len;
        self.make_writable(slot, start, end).map(|_| ())
    }

    /// Makes positions `start..end` of `slot` writable, as [`KvCache::prepare`] does from the
    /// slot's length (`start` at most the length: the positions before it must have blocks).
    /// Returns the copy-on-write copies made, `(from, to)` blocks in order, which the holder of
    /// a device copy of the data replays there. A decode graph that runs ahead writes from
    /// its rows' positions up to the capacity.
    pub fn make_writable(
        &mut self,
        slot: usize,
        start: usize,
        end: usize,
    ) -> Result<Vec<(u32, u32)>, KvError> {
        let len = self.table(slot)?.len;
        if end > self.capacity {
            return Err(KvError::Full {
                slot,
                len,
                capacity: self.capacity,
                needed: end.saturating_sub(len),
            });
        }
        let start = start.min(len);
        let mut copies = Vec::new();
        if end <= start {
            return Ok(copies);
        }
        let bs = self.layout().block_size;
        for i in start / bs..end.div_ceil(bs) {
            match self.tables[slot].blocks.get(i).copied() {
                None => {
                    let b = self.alloc()?;
                    self.tables[slot].blocks.push(b);
                }
                Some(b) if self.pool.refcount(b) > 1 => {
                    let own = self.alloc()?;
                    self.pool.copy_block(b, own);
                    self.pool.release(b);
                    self.tables[slot].blocks[i] = own;
                    copies.push((b, own));
                }
                Some(_) => {}
            }
        }
        Ok(copies)
    }

    /// Marks `n` more positions of `slot` as filled (after every layer wrote them).
    pub fn advance(&mut self, slot: usize, n: usize) {
        let t = &mut self.tables[slot];
        t.len += n;
        debug_assert!(t.len <= t.blocks.len() * self.pool.layout().block_size);
    }

    /// Sets how many positions of `slot` count as filled (what was written past it stays,
    /// unread). Used to run ahead of what the engine has confirmed.
    pub(crate) fn set_len(&mut self, slot: usize, len: usize) {
        let bs = self.layout().block_size;
        let t = &mut self.tables[slot];
        assert!(
            len <= t.blocks.len() * bs,
            "slot {slot}: length {len} past its blocks"
        );
        t.len = len;
    }

    /// Forgets positions from `len` on (rollback); blocks wholly past it go back to the pool.
    pub fn truncate(&mut self, slot: usize, len: usize) {
        let bs = self.layout().block_size;
        let t = &mut self.tables[slot];
        t.len = t.len.min(len);
        let keep = t.len.div_ceil(bs).min(t.blocks.len());
        for b in t.blocks.drain(keep..) {
            self.pool.release(b);
        }
    }

    /// Writes one position's keys and values (`kv_heads × head_dim` each) of one layer. The
    /// position must have been [`KvCache::prepare`]d.
    pub fn write(&mut self, layer: usize, slot: usize, pos: usize, k: &[f32], v: &[f32]) {
        let (block, off) = self.layout().locate(&self.tables[slot].blocks, pos);
        debug_assert_eq!(
            self.pool.refcount(block as u32),
            1,
            "write to a shared block"
        );
        self.pool.write(layer, block as u32, off, k, v);
    }

    /// Where one position's keys and values of one layer lie in an f32 cache, for writing them
    /// head by head from several threads at once ([`HeadRows::write`]); `None` for other
    /// storage types. The position must have been [`KvCache::prepare`]d.
    pub fn head_rows(&mut self, layer: usize, slot: usize, pos: usize) -> Option<HeadRows> {
        let (block, offset) = self.layout().locate(&self.tables[slot].blocks, pos);
        debug_assert_eq!(
            self.pool.refcount(block as u32),
            1,
            "write to a shared block"
        );
        self.pool.head_rows(layer, block as u32, offset)
    }

    /// One position's keys and values of one layer (`kv_heads × head_dim` f32s each), decoded
    /// from the storage type.
    pub fn read(&self, layer: usize, slot: usize, pos: usize, k: &mut [f32], v: &mut [f32]) {
        let l = *self.layout();
        let (block, off) = l.locate(&self.tables[slot].blocks, pos);
        let d = l.head_dim;
        for h in 0..l.kv_heads {
            let r = h * d..(h + 1) * d;
            self.pool
                .decode_rows(layer, block as u32, h, off, 1, &mut k[r.clone()], &mut v[r]);
        }
    }

    /// The per-position state of `slot` at `pos` (`state_dim` floats).
    pub fn state(&self, slot: usize, pos: usize) -> &[f32] {
        let (block, off) = self.layout().locate(&self.tables[slot].blocks, pos);
        self.pool.state(block as u32, off)
    }

    pub fn write_state(&mut self, slot: usize, pos: usize, values: &[f32]) {
        let (block, off) = self.layout().locate(&self.tables[slot].blocks, pos);
        self.pool.write_state(block as u32, off, values);
    }

    /// Makes `to` hold the first `len` positions of `from` by sharing its blocks (one prefill,
    /// many samples: no copy; the shared partial block is copied when either writes to it).
    pub fn copy_slot(&mut self, from: usize, to: usize, len: usize) {
        let bs = self.layout().block_size;
        for b in self.tables[to].blocks.drain(..) {
            self.pool.release(b);
        }
        let blocks: Vec<u32> = self.tables[from].blocks[..len.div_ceil(bs)].to_vec();
        for &b in &blocks {
            self.pool.retain(b);
        }
        let t = &mut self.tables[to];
        t.blocks = blocks;
        t.len = len;
    }

    /// Starts empty `slot` with the longest cached prefix of `tokens` no longer than
    /// `max_positions`, in whole blocks. Returns the positions it now holds.
    pub fn attach_prefix(
        &mut self,
        slot: usize,
        tokens: &[u32],
        max_positions: usize,
    ) -> Result<usize, KvError> {
        self.table(slot)?;
        self.truncate(slot, 0);
        let bs = self.layout().block_size;
        let max = max_positions.min(tokens.len()).min(self.capacity) / bs;
        let blocks = self.prefix.lookup(&mut self.pool, tokens, max);
        let t = &mut self.tables[slot];
        t.len = blocks.len() * bs;
        t.blocks = blocks;
        Ok(t.len)
    }

    /// Offers `slot`'s whole blocks to the prefix cache; `tokens` are the tokens it holds.
    pub fn publish_prefix(&mut self, slot: usize, tokens: &[u32]) {
        let t = &self.tables[slot];
        let n = t.len.min(tokens.len());
        self.prefix.insert(&mut self.pool, &tokens[..n], &t.blocks);
    }

    /// Blocks the prefix cache holds.
    pub fn prefix_blocks(&self) -> usize {
        self.prefix.len()
    }

    /// Frees up to `n` blocks held only by the prefix cache; returns how many.
    pub fn evict_prefix(&mut self, n: usize) -> usize {
        self.prefix.evict(&mut self.pool, n)
    }

    /// Checks every block's reference count equals the page tables and prefix nodes that hold
    /// it, and that free blocks are exactly the unreferenced ones (tests).
    #[doc(hidden)]
    pub fn check_invariants(&self) -> Result<(), String> {
        self.pool.check_free_list()?;
        self.prefix.check_links()?;
        let mut refs = vec![0u32; self.pool.allocated_blocks()];
        for t in &self.tables {
            if !t.open && !t.blocks.is_empty() {
                return Err("a closed slot holds blocks".into());
            }
            let bs = self.layout().block_size;
            if t.len > t.blocks.len() * bs {
                return Err(format!("length {} past {} blocks", t.len, t.blocks.len()));
            }
            for &b in &t.blocks {
                refs[b as usize] += 1;
            }
        }
        for b in self.prefix.blocks() {
            refs[b as usize] += 1;
        }
        for (b, &r) in refs.iter().enumerate() {
            if self.pool.refcount(b as u32) != r {
                return Err(format!(
                    "block {b}: refcount {} but {r} holders",
                    self.pool.refcount(b as u32)
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;

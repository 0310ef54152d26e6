//! The block pool: the memory of every cached position, in [`KvLayout`]'s blocks, with a
//! reference count per block. A block belongs to every page table (and prefix-cache node) that
//! holds it; it returns to the free list when the last one lets go. Shared blocks are never
//! written: a writer first copies a shared block into one of its own (copy-on-write, done by
//! [`super::KvCache`]).
//!
//! The pool has a ceiling (`layout.num_blocks`, from a memory budget) and takes memory as it is
//! used: storage for blocks is added in growing chunks when the free list runs dry, so a cache
//! sized for a long context costs only what its sequences hold. A device pool mirrors the same
//! layout but is allocated whole.

use super::layout::{KvLayout, LayoutError};
use super::storage::{decode_row, encode_row, KvDtype};
use crate::huge_pages;

/// Why a pool could not be made.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PoolError {
    #[error(transparent)]
    Layout(#[from] LayoutError),
    #[error("KV pool: a budget of {budget} bytes holds no block of {block} bytes")]
    BudgetTooSmall { budget: usize, block: usize },
    #[error("KV pool: could not allocate {bytes} bytes for {blocks} blocks")]
    Alloc { bytes: usize, blocks: usize },
    #[error("KV pool: all {blocks} blocks are in use")]
    Exhausted { blocks: usize },
}

/// How much memory a pool takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvBudget {
    Bytes(usize),
    Blocks(usize),
}

/// Grows `v` to `n` zeros, or fails instead of aborting when memory is short. What it takes is
/// advised for huge pages before it is written ([`huge_pages`]): attention reads the cache a
/// head's block at a time from anywhere in the pool, a TLB miss per 4 KiB page otherwise.
fn grow(v: &mut Vec<f32>, n: usize, blocks: usize) -> Result<(), PoolError> {
    v.try_reserve_exact(n.saturating_sub(v.len()))
        .map_err(|_| PoolError::Alloc {
            bytes: n.saturating_mul(4),
            blocks,
        })?;
    advise_spare(v);
    v.resize(n, 0.0);
    Ok(())
}

/// [`huge_pages::advise`] over the capacity of `v` past its length (not yet written).
fn advise_spare(v: &mut Vec<f32>) {
    let spare = v.spare_capacity_mut();
    huge_pages::advise(spare.as_ptr().cast(), std::mem::size_of_val(spare));
}

/// Blocks a pool takes memory for at first (and the least it grows by).
const FIRST_CHUNK: usize = 16;

pub struct BlockPool {
    layout: KvLayout,
    /// K and V element bytes, held in f32 words (so f32 storage is readable in place).
    k: Vec<f32>,
    v: Vec<f32>,
    k_scale: Vec<f32>,
    v_scale: Vec<f32>,
    state: Vec<f32>,
    refs: Vec<u32>,
    /// Free blocks with storage, the next to hand out last.
    free: Vec<u32>,
    /// Blocks with storage (≤ `layout.num_blocks`).
    allocated: usize,
    /// Whether the pool holds the data of its blocks, or only their bookkeeping (reference
    /// counts, free list) for a device pool that mirrors the data ([`BlockPool::tables_only`]).
    host_data: bool,
}

/// One position's rows of one layer of an f32 pool, written head by head
/// ([`BlockPool::head_rows`]). Holds raw pointers into the pool's arrays (taken through
/// `Vec::as_mut_ptr`, which creates no reference to them), so that threads can write their own
/// heads while others read other heads' blocks through the cache.
pub struct HeadRows {
    k: *mut f32,
    v: *mut f32,
    layout: KvLayout,
    layer: usize,
    block: usize,
    offset: usize,
}

// SAFETY: `HeadRows::write`'s contract keeps the threads' writes to disjoint rows.
unsafe impl Send for HeadRows {}
unsafe impl Sync for HeadRows {}

impl HeadRows {
    /// Writes head `head`'s key and value (`head_dim` f32s each).
    ///
    /// # Safety
    /// The pool outlives this and does not grow meanwhile; each head is written by one thread,
    /// and no other thread reads that head's block of this layer meanwhile.
    pub unsafe fn write(&self, head: usize, k: &[f32], v: &[f32]) {
        let d = self.layout.head_dim;
        assert!(
            head < self.layout.kv_heads && k.len() == d && v.len() == d,
            "KV head {head} of {} written with rows of {} and {} (head_dim {d})",
            self.layout.kv_heads,
            k.len(),
            v.len()
        );
        let at = self.layout.row(self.layer, self.block, head, self.offset);
        // SAFETY: `head_rows` checked that every head's row lies in both arrays; the caller
        // guarantees that no one else touches this row meanwhile.
        unsafe {
            std::ptr::copy_nonoverlapping(k.as_ptr(), self.k.add(at), d);
            std::ptr::copy_nonoverlapping(v.as_ptr(), self.v.add(at), d);
        }
    }
}

impl BlockPool {
    /// A pool of blocks for `layout` (whose `num_blocks` is replaced by what `budget` allows).
    pub fn new(mut layout: KvLayout, budget: KvBudget) -> Result<BlockPool, PoolError> {
        layout.num_blocks = 1;
        layout.validate()?;
        layout.num_blocks = match budget {
            KvBudget::Blocks(n) => n,
            KvBudget::Bytes(b) => {
                let block = layout.bytes_per_block();
                let n = b / block;
                if n == 0 {
                    return Err(PoolError::BudgetTooSmall { budget: b, block });
                }
                n
            }
        };
        layout.validate()?;
        if u32::try_from(layout.num_blocks).is_err() {
            return Err(PoolError::Alloc {
                bytes: usize::MAX,
                blocks: layout.num_blocks,
            });
        }
        Ok(BlockPool {
            k: Vec::new(),
            v: Vec::new(),
            k_scale: Vec::new(),
            v_scale: Vec::new(),
            state: Vec::new(),
            refs: Vec::new(),
            free: Vec::new(),
            allocated: 0,
            host_data: true,
            layout,
        })
    }

    /// A pool that hands out, counts and frees blocks like [`BlockPool::new`] but keeps no data
    /// for them: the bookkeeping of a pool whose data lives elsewhere (a GPU's memory, in the
    /// same layout). Its `write`/`state`/`head_block_f32` must not be called, and
    /// [`BlockPool::copy_block`] copies nothing (the owner of the data copies it).
    pub fn tables_only(layout: KvLayout, budget: KvBudget) -> Result<BlockPool, PoolError> {
        let mut p = BlockPool::new(layout, budget)?;
        p.host_data = false;
        Ok(p)
    }

    /// Whether this pool holds its blocks' data (false for [`BlockPool::tables_only`]).
    pub fn has_host_data(&self) -> bool {
        self.host_data
    }

    /// Takes memory for more blocks: double what there is, at least [`FIRST_CHUNK`], at most
    /// the ceiling. Memory is only checked here, so a budget larger than the machine fails
    /// cleanly when it is reached, not at start.
    fn grow(&mut self) -> Result<(), PoolError> {
        let l = self.layout;
        let n = (self.allocated * 2).max(FIRST_CHUNK).min(l.num_blocks);
        if n <= self.allocated {
            return Err(PoolError::Exhausted {
                blocks: l.num_blocks,
            });
        }
        if self.host_data {
            let words_for =
                |blocks: usize| (blocks * l.block_elems() * l.dtype.bytes_per_elem()).div_ceil(4);
            let words = words_for(n);
            if self.allocated == 0 {
                // Address space for the whole ceiling at once where the system grants it (pages
                // are only taken as blocks are written, and `grow` advises the unwritten rest):
                // the keys and values then never move, which would split their huge pages.
                // Where it refuses, each growth reserves what it needs.
                for v in [&mut self.k, &mut self.v] {
                    let _ = v.try_reserve_exact(words_for(l.num_blocks));
                }
            }
            let scales = l.dtype.group().map_or(0, |g| n * l.block_elems() / g);
            grow(&mut self.k, words, n)?;
            grow(&mut self.v, words, n)?;
            grow(&mut self.k_scale, scales, n)?;
            grow(&mut self.v_scale, scales, n)?;
            grow(&mut self.state, n * l.block_size * l.state_dim, n)?;
        }
        self.refs.resize(n, 0);
        self.free.extend((self.allocated as u32..n as u32).rev());
        self.allocated = n;
        Ok(())
    }

    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    pub fn num_blocks(&self) -> usize {
        self.layout.num_blocks
    }

    /// Blocks not held by anyone (with or without memory yet).
    pub fn free_blocks(&self) -> usize {
        self.free.len() + (self.layout.num_blocks - self.allocated)
    }

    /// Blocks that have memory.
    pub fn allocated_blocks(&self) -> usize {
        self.allocated
    }

    /// Bytes of K, V, scales and state taken so far.
    pub fn bytes(&self) -> usize {
        (self.k.len() + self.v.len() + self.k_scale.len() + self.v_scale.len() + self.state.len())
            * 4
    }

    /// A free block with one reference.
    pub fn alloc(&mut self) -> Result<u32, PoolError> {
        if self.free.is_empty() {
            self.grow()?;
        }
        let b = self.free.pop().ok_or(PoolError::Exhausted {
            blocks: self.layout.num_blocks,
        })?;
        debug_assert_eq!(self.refs[b as usize], 0);
        self.refs[b as usize] = 1;
        Ok(b)
    }

    /// One more holder of `block`.
    pub fn retain(&mut self, block: u32) {
        let r = &mut self.refs[block as usize];
        assert!(*r > 0, "retain of free block {block}");
        *r += 1;
    }

    /// One holder fewer; returns whether the block went back to the free list.
    pub fn release(&mut self, block: u32) -> bool {
        let r = &mut self.refs[block as usize];
        assert!(*r > 0, "release of free block {block}");
        *r -= 1;
        if *r == 0 {
            self.free.push(block);
            true
        } else {
            false
        }
    }

    pub fn refcount(&self, block: u32) -> u32 {
        self.refs[block as usize]
    }

    /// Copies every layer's K/V (and scales) and the state of `src` into `dst` (nothing for a
    /// [`BlockPool::tables_only`] pool).
    pub fn copy_block(&mut self, src: u32, dst: u32) {
        if !self.host_data {
            return;
        }
        let l = self.layout;
        let (src, dst) = (src as usize, dst as usize);
        let eb = l.dtype.bytes_per_elem();
        let run = l.block_elems();
        let (s, d) = (l.head_block(0, src, 0), l.head_block(0, dst, 0));
        for arr in [&mut self.k, &mut self.v] {
            let bytes: &mut [u8] = bytemuck::cast_slice_mut(arr.as_mut_slice());
            bytes.copy_within(s * eb..(s + run) * eb, d * eb);
        }
        if let Some(g) = l.dtype.group() {
            for arr in [&mut self.k_scale, &mut self.v_scale] {
                arr.copy_within(s / g..(s + run) / g, d / g);
            }
        }
        let n = l.block_size * l.state_dim;
        let (s, d) = (l.state_row(src, 0), l.state_row(dst, 0));
        self.state.copy_within(s..s + n, d);
    }

    /// Stores one position's keys and values (`kv_heads × head_dim` each) of one layer.
    pub fn write(&mut self, layer: usize, block: u32, offset: usize, k: &[f32], v: &[f32]) {
        let l = self.layout;
        let d = l.head_dim;
        let eb = l.dtype.bytes_per_elem();
        for h in 0..l.kv_heads {
            let at = l.row(layer, block as usize, h, offset);
            let g = l.dtype.group().unwrap_or(1);
            for (arr, scales, src) in [
                (&mut self.k, &mut self.k_scale, k),
                (&mut self.v, &mut self.v_scale, v),
            ] {
                let bytes: &mut [u8] = bytemuck::cast_slice_mut(arr.as_mut_slice());
                let sc: &mut [f32] = if l.dtype.group().is_some() {
                    &mut scales[at / g..(at + d) / g]
                } else {
                    &mut []
                };
                encode_row(
                    l.dtype,
                    &src[h * d..(h + 1) * d],
                    &mut bytes[at * eb..(at + d) * eb],
                    sc,
                );
            }
        }
    }

    /// [`super::KvCache::head_rows`] for `offset` of `block`.
    pub fn head_rows(&mut self, layer: usize, block: u32, offset: usize) -> Option<HeadRows> {
        let l = self.layout;
        if l.dtype != KvDtype::F32 || !self.host_data {
            return None;
        }
        // Every head's row lies in the arrays (the last one ends furthest in).
        let last = l.row(layer, block as usize, l.kv_heads.checked_sub(1)?, offset);
        assert!(
            last + l.head_dim <= self.k.len() && last + l.head_dim <= self.v.len(),
            "KV row of layer {layer}, block {block} outside the pool"
        );
        Some(HeadRows {
            k: self.k.as_mut_ptr(),
            v: self.v.as_mut_ptr(),
            layout: l,
            layer,
            block: block as usize,
            offset,
        })
    }

    /// One head's keys and values of one block (`block_size × head_dim` f32s each), read in
    /// place. Only for f32 storage; other types go through [`BlockPool::decode_head_block`].
    #[inline]
    pub fn head_block_f32(&self, layer: usize, block: u32, head: usize) -> (&[f32], &[f32]) {
        debug_assert_eq!(self.layout.dtype, KvDtype::F32);
        let at = self.layout.head_block(layer, block as usize, head);
        let n = self.layout.head_block_elems();
        (&self.k[at..at + n], &self.v[at..at + n])
    }

    /// One head's keys and values of positions `first..first + rows` of one block, decoded to
    /// f32 into `k` and `v` (`rows × head_dim` each).
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    pub fn decode_rows(
        &self,
        layer: usize,
        block: u32,
        head: usize,
        first: usize,
        rows: usize,
        k: &mut [f32],
        v: &mut [f32],
    ) {
        let d = self.layout.head_dim;
        self.decode_cols(layer, block, head, (first, rows), false, 0..d, k);
        self.decode_cols(layer, block, head, (first, rows), true, 0..d, v);
    }

    /// Lanes `cols` of one head's keys (`values` false) or values of positions
    /// `first..first + rows` of one block, decoded to f32 into `dst` (`rows × cols.len()`, row
    /// by row; whole rows in one run). `cols` must start and end on the storage type's groups.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    pub fn decode_cols(
        &self,
        layer: usize,
        block: u32,
        head: usize,
        (first, rows): (usize, usize),
        values: bool,
        cols: std::ops::Range<usize>,
        dst: &mut [f32],
    ) {
        let l = &self.layout;
        let d = l.head_dim;
        let w = cols.len();
        let g = l.dtype.group().unwrap_or(1);
        debug_assert!(cols.end <= d && cols.start.is_multiple_of(g) && w.is_multiple_of(g));
        let row0 = l.row(layer, block as usize, head, first);
        if w == d {
            self.decode_elems(values, row0, &mut dst[..rows * d]);
        } else {
            for (r, out) in dst[..rows * w].chunks_exact_mut(w).enumerate() {
                self.decode_elems(values, row0 + r * d + cols.start, out);
            }
        }
    }

    /// Elements `at..at + out.len()` of K (`values` false) or V, decoded to f32. (A method, not
    /// a closure, so that it inlines into attention's target-feature kernels.)
    #[inline(always)]
    fn decode_elems(&self, values: bool, at: usize, out: &mut [f32]) {
        let l = &self.layout;
        let n = out.len();
        let eb = l.dtype.bytes_per_elem();
        let (arr, scales) = if values {
            (&self.v, &self.v_scale)
        } else {
            (&self.k, &self.k_scale)
        };
        let bytes: &[u8] = bytemuck::cast_slice(arr.as_slice());
        let sc: &[f32] = match l.dtype.group() {
            Some(g) => &scales[at / g..(at + n) / g],
            None => &[],
        };
        decode_row(l.dtype, &bytes[at * eb..(at + n) * eb], sc, out);
    }

    /// The state of one position (`state_dim` f32s).
    pub fn state(&self, block: u32, offset: usize) -> &[f32] {
        let at = self.layout.state_row(block as usize, offset);
        &self.state[at..at + self.layout.state_dim]
    }

    pub fn write_state(&mut self, block: u32, offset: usize, values: &[f32]) {
        let at = self.layout.state_row(block as usize, offset);
        self.state[at..at + self.layout.state_dim].copy_from_slice(values);
    }

    /// Checks the free list and reference counts agree (tests).
    #[doc(hidden)]
    pub fn check_free_list(&self) -> Result<(), String> {
        let mut free = vec![false; self.allocated];
        for &b in &self.free {
            if free[b as usize] {
                return Err(format!("block {b} is twice on the free list"));
            }
            free[b as usize] = true;
        }
        for (b, (&r, &f)) in self.refs.iter().zip(&free).enumerate() {
            if (r == 0) != f {
                return Err(format!("block {b}: {r} references but free = {f}"));
            }
        }
        Ok(())
    }
}

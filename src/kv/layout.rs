//! The one KV layout every reader follows: CPU attention, the per-op CUDA kernels and the
//! megakernel tiles (through `cuda/kv.cuh`, which mirrors this file), and kiln-codegen's
//! interpreter.
//!
//! Memory is a pool of up to `num_blocks` fixed-size blocks, each holding `block_size`
//! consecutive positions of one sequence for every layer and KV head. A sequence finds its
//! blocks through a page table: position `p` lives in block `table[p / block_size]` at offset
//! `p % block_size`.
//!
//! K and V are two arrays of the storage type, each laid out
//! `[block][layer][kv_head][block_size][head_dim]`: one head's keys for one block are
//! `block_size × head_dim` contiguous elements — the unit attention reads — and a block is one
//! contiguous range, so addresses do not depend on how many blocks exist and a CPU pool can
//! grow as it is used (a GPU pool is allocated whole, up front). Grouped 8-bit storage
//! keeps one f32 scale per `group` consecutive elements of a row in parallel arrays `k_scale` /
//! `v_scale` indexed by `element / group`. Per-position state (nanochat's smear input) is f32
//! `[block][block_size][state_dim]`, so it moves, is shared and is truncated with its block.
//!
//! A contiguous cache is the special case of one block per sequence (`block_size` = capacity)
//! and the identity page table.

use super::storage::KvDtype;

/// What a cache stores per position, and how it is cut into blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvLayout {
    pub layers: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// f32s of per-position state besides K and V (0 if none).
    pub state_dim: usize,
    /// Positions per block.
    pub block_size: usize,
    pub num_blocks: usize,
    pub dtype: KvDtype,
}

/// Why a layout cannot be built.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LayoutError {
    #[error("KV layout: {what} must be at least 1")]
    Zero { what: &'static str },
    #[error("KV layout: {layers} layers × {num_blocks} blocks × {kv_heads} heads × {block_size} positions × {head_dim} overflows")]
    Overflow {
        layers: usize,
        num_blocks: usize,
        kv_heads: usize,
        block_size: usize,
        head_dim: usize,
    },
    #[error("KV storage {dtype}: head_dim {head_dim} is not a multiple of its group of {group}")]
    Group {
        dtype: KvDtype,
        head_dim: usize,
        group: usize,
    },
}

/// The default number of positions per block: small enough that sharing and copy-on-write
/// waste little, large enough that attention reads long contiguous runs.
pub const DEFAULT_BLOCK_SIZE: usize = 16;

impl KvLayout {
    /// Checks the shape: no zero sizes, no overflow of any array's element count, and a head
    /// dimension the storage type's groups divide.
    pub fn validate(&self) -> Result<(), LayoutError> {
        for (what, v) in [
            ("layers", self.layers),
            ("kv_heads", self.kv_heads),
            ("head_dim", self.head_dim),
            ("block_size", self.block_size),
            ("num_blocks", self.num_blocks),
        ] {
            if v == 0 {
                return Err(LayoutError::Zero { what });
            }
        }
        if let Some(group) = self.dtype.group() {
            if !self.head_dim.is_multiple_of(group) {
                return Err(LayoutError::Group {
                    dtype: self.dtype,
                    head_dim: self.head_dim,
                    group,
                });
            }
        }
        let overflow = || LayoutError::Overflow {
            layers: self.layers,
            num_blocks: self.num_blocks,
            kv_heads: self.kv_heads,
            block_size: self.block_size,
            head_dim: self.head_dim,
        };
        let elems = [
            self.layers,
            self.num_blocks,
            self.kv_heads,
            self.block_size,
            self.head_dim,
        ]
        .iter()
        .try_fold(1usize, |a, &b| a.checked_mul(b))
        .ok_or_else(overflow)?;
        elems
            .checked_mul(self.dtype.bytes_per_elem() + 8)
            .ok_or_else(overflow)?;
        self.num_blocks
            .checked_mul(self.block_size)
            .and_then(|n| n.checked_mul(self.state_dim.max(1)))
            .and_then(|n| n.checked_mul(4))
            .ok_or_else(overflow)?;
        Ok(())
    }

    /// Elements of one head's block (`block_size × head_dim`): the unit attention reads.
    pub fn head_block_elems(&self) -> usize {
        self.block_size * self.head_dim
    }

    /// Elements of K (or V) in one block (all layers and heads).
    pub fn block_elems(&self) -> usize {
        self.layers * self.kv_heads * self.head_block_elems()
    }

    /// Elements of K (or V) in the whole pool.
    pub fn elems(&self) -> usize {
        self.num_blocks * self.block_elems()
    }

    /// Index of the first element of `(layer, block, head)`'s `block_size × head_dim` run in
    /// the K (or V) array.
    #[inline]
    pub fn head_block(&self, layer: usize, block: usize, head: usize) -> usize {
        ((block * self.layers + layer) * self.kv_heads + head) * self.head_block_elems()
    }

    /// Index of the first element of one position's row of one head.
    #[inline]
    pub fn row(&self, layer: usize, block: usize, head: usize, offset: usize) -> usize {
        self.head_block(layer, block, head) + offset * self.head_dim
    }

    /// Index of the first f32 of one position's state (`state_dim` floats).
    #[inline]
    pub fn state_row(&self, block: usize, offset: usize) -> usize {
        (block * self.block_size + offset) * self.state_dim
    }

    /// f32s of state in the whole pool.
    pub fn state_elems(&self) -> usize {
        self.num_blocks * self.block_size * self.state_dim
    }

    /// Scale entries of K (or V) in the whole pool (0 unless the storage type is grouped).
    pub fn scale_elems(&self) -> usize {
        self.dtype.group().map_or(0, |g| self.elems() / g)
    }

    /// Block and offset of position `pos` given a page table.
    #[inline]
    pub fn locate(&self, table: &[u32], pos: usize) -> (usize, usize) {
        (table[pos / self.block_size] as usize, pos % self.block_size)
    }

    /// Blocks needed to hold `positions` positions.
    pub fn blocks_for(&self, positions: usize) -> usize {
        positions.div_ceil(self.block_size)
    }

    /// Bytes one position takes over all layers: K and V (with their scales) and the state.
    pub fn bytes_per_position(&self) -> usize {
        let kv = self.layers * self.kv_heads * self.head_dim;
        2 * self.dtype.bytes_for(kv) + self.state_dim * 4
    }

    /// Bytes one block takes.
    pub fn bytes_per_block(&self) -> usize {
        self.bytes_per_position() * self.block_size
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> KvLayout {
        KvLayout {
            layers: 3,
            kv_heads: 2,
            head_dim: 4,
            state_dim: 5,
            block_size: 8,
            num_blocks: 7,
            dtype: KvDtype::F32,
        }
    }

    /// Every (layer, block, head, offset, dim) has its own element, and the elements tile the
    /// array exactly.
    #[test]
    fn addresses_are_a_bijection_onto_the_array() {
        let l = layout();
        let mut seen = vec![false; l.elems()];
        for layer in 0..l.layers {
            for block in 0..l.num_blocks {
                for head in 0..l.kv_heads {
                    for off in 0..l.block_size {
                        for d in 0..l.head_dim {
                            let i = l.row(layer, block, head, off) + d;
                            assert!(!seen[i], "element {i} addressed twice");
                            seen[i] = true;
                        }
                    }
                }
            }
        }
        assert!(seen.iter().all(|&s| s));
        let mut seen = vec![false; l.state_elems()];
        for block in 0..l.num_blocks {
            for off in 0..l.block_size {
                for d in 0..l.state_dim {
                    let i = l.state_row(block, off) + d;
                    assert!(!seen[i]);
                    seen[i] = true;
                }
            }
        }
        assert!(seen.iter().all(|&s| s));
    }

    #[test]
    fn positions_go_through_the_page_table() {
        let l = layout();
        let table = [5u32, 2, 6];
        assert_eq!(l.locate(&table, 0), (5, 0));
        assert_eq!(l.locate(&table, 7), (5, 7));
        assert_eq!(l.locate(&table, 8), (2, 0));
        assert_eq!(l.locate(&table, 23), (6, 7));
        assert_eq!(l.blocks_for(0), 0);
        assert_eq!(l.blocks_for(8), 1);
        assert_eq!(l.blocks_for(9), 2);
    }

    #[test]
    fn bad_shapes_are_refused() {
        let mut l = layout();
        l.num_blocks = 0;
        assert_eq!(l.validate(), Err(LayoutError::Zero { what: "num_blocks" }));
        let mut l = layout();
        l.head_dim = 1 << 40;
        l.num_blocks = 1 << 30;
        assert!(matches!(l.validate(), Err(LayoutError::Overflow { .. })));
        let mut l = layout();
        l.dtype = KvDtype::Q8;
        assert!(matches!(l.validate(), Err(LayoutError::Group { .. })));
        l.head_dim = 64;
        assert!(l.validate().is_ok());
    }

    #[test]
    fn bytes_per_position_counts_k_v_scales_and_state() {
        let mut l = layout();
        // 3 layers × 2 heads × 4 dims = 24 values each for K and V, f32; 5 state floats.
        assert_eq!(l.bytes_per_position(), 2 * 24 * 4 + 20);
        l.dtype = KvDtype::Bf16;
        assert_eq!(l.bytes_per_position(), 2 * 24 * 2 + 20);
        l.head_dim = 32;
        l.dtype = KvDtype::Q8;
        // 192 values: 192 bytes + 6 f32 scales, for K and for V.
        assert_eq!(l.bytes_per_position(), 2 * (192 + 24) + 20);
    }
}

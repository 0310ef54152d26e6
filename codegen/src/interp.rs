//! A CPU interpreter of the decode megakernel: the verification of the lowering, the schedule
//! and the argument tables that needs no GPU.
//!
//! It executes the very tables [`crate::emit::emit_kernel`] prints (`mk_tiles`, `mk_waits`,
//! `mk_args`, `mk_fargs`), dispatching on each row's tile kind like the kernel's `switch` and
//! unpacking the arguments exactly as the `case`s do; each tile kind is a Rust mirror of its
//! `__device__` function in `cuda/megakernel/tiles.cuh`, computing exactly the tile's range in f32
//! from bf16 weights (f32 ones from the `wt_f32` table) into a bf16 KV cache. Sums run in
//! sequential order rather than the device's warp / block trees, and `rsqrtf` / `expf` are the
//! exact functions: results agree with the device to f32 rounding, not bit for bit.
//!
//! Tiles run one at a time, in an order the caller picks among the tiles whose counter waits are
//! met (the kernel's `mk_wait`): any order the waits allow, not only the kernel's block
//! assignment. Counters are never reset and each [`Machine::step`] is one launch at the next
//! epoch, as on the device. Memory no tile has written is NaN: the activation arena is poisoned
//! at every launch (a value of the previous step is as wrong as garbage) and the KV cache and
//! its per-position state are poisoned past what the caller filled. A tile that reads a NaN
//! fails the step with [`InterpError::Poison`], so a missing dependency shows as soon as an
//! order runs a reader before its writer (the fixtures never produce NaN themselves).
//!
//! The run-time controls are the kernel's: [`Machine::ctl`] is its `MkControl` (one [`MkRow`] of
//! sampling parameters, seed and Philox row per batch row, and the stop ids), and
//! [`Machine::pos`], [`Machine::tokens`] and [`Machine::tables`] are its row table, which the
//! caller may rewrite between steps as the host does between replays (a row joining or leaving).
//! Each Sample tile reads its own row's controls, like `mk_sample`: a greedy row (temperature 0)
//! takes the first maximum here; a sampling row calls [`Machine::sampler`] with its logits, its
//! `MkRow`, its Philox row and the position its token takes (`pos + 1`). The sampling algorithm
//! itself is not mirrored here: kiln's `kiln::sample::device` models `kiln_sample_row` step for
//! step and is what a caller passes (kiln-codegen does not depend on kiln). An inactive row
//! (`pos[b] < 0`) behaves as on the device: zero embedding and attention output, no KV or state
//! write, no sample, no position advance, [`NO_TOKEN`] in the ring.
//!
//! What this does not check: the CUDA code itself (its indexing, synchronisation and memory
//! ordering), which only a GPU run checks (kiln's `tests/gpu.rs`; on an H200 the kernel matched
//! kiln's per-op path and CPU up to near ties, compute-sanitizer's racecheck and synccheck
//! clean: kiln's docs/gpu-results.md). A divergence between a tile function here and its CUDA
//! twin would go unnoticed here, so the two are kept side by side in structure.

use std::fmt;

use crate::control::{ring_stride, MkControl, MkRow, MAX_STOP, NO_TOKEN, RING};
use crate::emit::{tables, Tables, KINDS, NARGS, NFARGS};
use crate::program::{DecodeProgram, WeightDtype};
use crate::schedule::{Schedule, Wait};

/// f32 → bf16 bits, round to nearest even (`__float2bfloat16`); NaN stays a quiet NaN.
pub fn f32_to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) as u16) | 0x0040;
    }
    ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

/// bf16 bits → f32 (exact).
pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// A quiet NaN in bf16: the poison of unwritten cache entries.
pub const BF16_POISON: u16 = 0x7fc0;

/// One weight as the kernel's tables hold it.
#[derive(Clone, Debug, PartialEq)]
pub enum WeightData {
    /// bf16 bits, row-major.
    Bf16(Vec<u16>),
    F32(Vec<f32>),
}

#[derive(Clone, Debug, PartialEq)]
pub enum InterpError {
    /// The weights given do not match the program's weight list.
    Weights(String),
    /// A tile read memory nothing wrote (NaN poison): a missing dependency or a wrong range.
    Poison {
        tile: usize,
        instr: usize,
        what: String,
    },
    /// A tile would access memory outside its buffer, table or cache slot.
    OutOfBounds {
        tile: usize,
        instr: usize,
        what: String,
    },
    /// An argument row the kernel's `switch` does not know.
    BadRow { tile: usize, what: String },
    /// A sampling row (temperature > 0) and no [`Machine::sampler`] to draw with.
    NoSampler { tile: usize, row: usize },
    /// Tiles are left but none has its waits met.
    Deadlock {
        epoch: u32,
        done: usize,
        total: usize,
    },
}

impl fmt::Display for InterpError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            InterpError::Weights(s) => write!(f, "interpreter weights: {s}"),
            InterpError::Poison { tile, instr, what } => {
                write!(f, "tile {tile} (instruction {instr}) read unwritten {what}")
            }
            InterpError::OutOfBounds { tile, instr, what } => {
                write!(f, "tile {tile} (instruction {instr}) out of bounds: {what}")
            }
            InterpError::BadRow { tile, what } => write!(f, "tile {tile}: {what}"),
            InterpError::NoSampler { tile, row } => write!(
                f,
                "tile {tile}: batch row {row} samples (temperature > 0) and the machine has no \
                 sampler"
            ),
            InterpError::Deadlock { epoch, done, total } => write!(
                f,
                "deadlock at epoch {epoch}: {done} of {total} tiles ran, no other is ready"
            ),
        }
    }
}

impl std::error::Error for InterpError {}

/// The tile kinds of [`KINDS`], in its order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Embed,
    RmsNorm,
    Matvec,
    Rope,
    HeadNorm,
    KvAppend,
    Attention,
    Sample,
    StepEnd,
    Ewise,
    GatedAdd,
}

fn kind_of(code: i64) -> Option<Kind> {
    let name = KINDS.get(usize::try_from(code).ok()?)?;
    Some(match *name {
        "MK_K_EMBED" => Kind::Embed,
        "MK_K_RMS_NORM" => Kind::RmsNorm,
        "MK_K_MATVEC" => Kind::Matvec,
        "MK_K_ROPE" => Kind::Rope,
        "MK_K_HEAD_NORM" => Kind::HeadNorm,
        "MK_K_KV_APPEND" => Kind::KvAppend,
        "MK_K_ATTENTION" => Kind::Attention,
        "MK_K_SAMPLE" => Kind::Sample,
        "MK_K_STEP_END" => Kind::StepEnd,
        "MK_K_EWISE" => Kind::Ewise,
        "MK_K_GATED_ADD" => Kind::GatedAdd,
        _ => return None,
    })
}

/// The device state of one decode kernel: its inputs, the activation arena, the KV cache as a
/// pool of blocks in kiln's one layout (`cuda/kv.cuh`, `src/kv/layout.rs`): bf16 K and V
/// `[block][layer][kv_head][block_size][head_dim]`, the per-position state
/// `[block][block_size][state_dim]`, and each batch row's page table (`tables`, `max_blocks`
/// entries per row: position p is offset p % block_size of block table[p / block_size]), the
/// counters and the epoch. Fields are what the kernel's parameters point to.
pub struct Machine {
    tb: Tables,
    batch: usize,
    rope_style: i64,
    /// `MK_KV_HEADS`, `MK_HEAD_DIM`.
    kv_heads: usize,
    head_dim: usize,
    n_instr: usize,
    pub weights: Vec<WeightData>,
    pub act: Vec<f32>,
    pub k_cache: Vec<u16>,
    pub v_cache: Vec<u16>,
    pub kv_state: Vec<f32>,
    pub state_dim: usize,
    /// `MK_LAYERS`.
    layers: usize,
    pub block_size: usize,
    pub num_blocks: usize,
    /// Page-table entries per batch row.
    pub max_blocks: usize,
    pub pos: Vec<i32>,
    pub tokens: Vec<i32>,
    /// `[batch][max_blocks]` block numbers (the kernel's `page_tables`); -1 = none.
    pub tables: Vec<i32>,
    pub inv_freq: Vec<f32>,
    pub counters: Vec<u32>,
    /// `*epoch_ctr`: the last finished launch.
    pub epoch: u32,
    /// The token ring (`RING` entries of `batch + 2` words, as `mk_step_end` writes them).
    pub ring: Vec<u32>,
    /// The kernel's `ctl`: each batch row's sampling controls and the stop ids.
    pub ctl: MkControl,
    /// What a sampling row's Sample tile draws with (`kiln_sample_row`); `None`: every row must
    /// be greedy.
    pub sampler: Option<RowSampler>,
    /// The tile running now (for errors).
    tile: usize,
}

/// The device sampler of one row, `kiln_sample_row(logits, vocab, ctl, row, position)`: the
/// row's logits, its controls, its Philox row and the position the token takes.
pub type RowSampler = fn(&[f32], &MkRow, u32, u64) -> u32;

/// A tile function's failure before the tile index is attached.
enum Fault {
    Poison(String),
    Oob(String),
    NoSampler(usize),
}

type R<T> = Result<T, Fault>;

fn act_fn(act: i64, x: f32) -> f32 {
    if act == 0 {
        x / (1.0 + (-x).exp())
    } else {
        let r = x.max(0.0);
        r * r
    }
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

impl Machine {
    /// A machine for `p` scheduled as `s`, with `weights` indexed like `p.weights` (each of its
    /// dtype and `rows·cols` elements), a cache of `num_blocks` blocks of `block_size`
    /// positions (poisoned), page tables of `max_blocks` entries per batch row (all -1), and
    /// RoPE inverse frequencies. Positions and tokens start at 0.
    pub fn new(
        p: &DecodeProgram,
        s: &Schedule,
        weights: Vec<WeightData>,
        (num_blocks, block_size, max_blocks): (usize, usize, usize),
        inv_freq: Vec<f32>,
    ) -> Result<Machine, InterpError> {
        if weights.len() != p.weights.len() {
            return Err(InterpError::Weights(format!(
                "{} weights for a program of {}",
                weights.len(),
                p.weights.len()
            )));
        }
        for (w, d) in p.weights.iter().zip(&weights) {
            let (dtype, n) = match d {
                WeightData::Bf16(v) => (WeightDtype::Bf16, v.len()),
                WeightData::F32(v) => (WeightDtype::F32, v.len()),
            };
            if dtype != w.dtype || n != w.rows * w.cols {
                return Err(InterpError::Weights(format!(
                    "`{}`: {n} {dtype:?} values, the program wants {} {:?}",
                    w.name,
                    w.rows * w.cols,
                    w.dtype
                )));
            }
        }
        let (_, arena) = p.buffer_offsets();
        let kv = num_blocks * p.layers * p.kv_heads * block_size * p.head_dim;
        let tb = tables(p, s);
        Ok(Machine {
            counters: vec![0; s.counters()],
            tb,
            batch: p.batch,
            rope_style: p.rope_style.code() as i64,
            kv_heads: p.kv_heads.max(1),
            head_dim: p.head_dim.max(1),
            n_instr: p.instrs.len(),
            weights,
            act: vec![f32::NAN; arena],
            k_cache: vec![BF16_POISON; kv],
            v_cache: vec![BF16_POISON; kv],
            kv_state: vec![f32::NAN; num_blocks * block_size * p.state_dim],
            state_dim: p.state_dim,
            layers: p.layers.max(1),
            block_size: block_size.max(1),
            num_blocks,
            max_blocks,
            pos: vec![0; p.batch],
            tokens: vec![0; p.batch],
            tables: vec![-1; p.batch * max_blocks],
            inv_freq,
            epoch: 0,
            ring: vec![0; RING * ring_stride(p.batch)],
            ctl: MkControl {
                rows: [MkRow::GREEDY; crate::MAX_BATCH],
                n_stop: 0,
                stop_ids: [0; MAX_STOP],
            },
            sampler: None,
            tile: 0,
        })
    }

    /// The tables this machine executes.
    pub fn tables(&self) -> &Tables {
        &self.tb
    }

    /// Writes the keys and values (`kv_heads·head_dim` f32 each, rounded to bf16) of one layer
    /// at offset `off` of block `block`.
    pub fn write_kv(&mut self, layer: usize, block: usize, off: usize, k: &[f32], v: &[f32]) {
        let d = self.head_dim;
        for g in 0..self.kv_heads {
            let at = self.kv_index(layer, block, g, off);
            for c in 0..d {
                self.k_cache[at + c] = f32_to_bf16(k[g * d + c]);
                self.v_cache[at + c] = f32_to_bf16(v[g * d + c]);
            }
        }
    }

    /// Writes the state (`state_dim` floats) at offset `off` of block `block`.
    pub fn write_state(&mut self, block: usize, off: usize, values: &[f32]) {
        let at = self.state_index(block, off);
        self.kv_state[at..at + self.state_dim].copy_from_slice(values);
    }

    /// `kv_row(MK_LAYERS, kv_heads, block_size, head_dim, layer, block, g, off)` (kv.cuh).
    fn kv_index(&self, layer: usize, block: usize, g: usize, off: usize) -> usize {
        ((block * self.layers + layer) * self.kv_heads + g) * self.block_size * self.head_dim
            + off * self.head_dim
    }

    /// `kv_state_row(block_size, state_dim, block, off)` (kv.cuh).
    fn state_index(&self, block: usize, off: usize) -> usize {
        (block * self.block_size + off) * self.state_dim
    }

    /// Columns `[col, col + cols)` of each batch row of the buffer at arena offset `off` with
    /// row stride `stride` (e.g. the logits after a step).
    pub fn rows(&self, off: usize, stride: usize, col: usize, cols: usize) -> Vec<Vec<f32>> {
        (0..self.batch)
            .map(|b| self.act[off + b * stride + col..][..cols].to_vec())
            .collect()
    }

    /// One launch: poisons the arena, then runs every tile once, each time the one `pick`
    /// chooses (an index into the ready tiles, taken modulo their count) among those whose waits
    /// are met. Returns the order the tiles ran in.
    pub fn step(
        &mut self,
        pick: &mut dyn FnMut(&[usize]) -> usize,
    ) -> Result<Vec<usize>, InterpError> {
        let epoch = self.epoch.wrapping_add(1);
        self.act.fill(f32::NAN);
        let n = self.tb.tiles.len();
        // Unmet waits per tile, and the waits on each counter.
        let mut unmet = vec![0usize; n];
        let mut waiters: Vec<Vec<(usize, u32, bool)>> = vec![Vec::new(); self.counters.len()];
        for (t, um) in unmet.iter_mut().enumerate() {
            let (a, b) = (
                self.tb.wait_start[t] as usize,
                self.tb.wait_start[t + 1] as usize,
            );
            for w in &self.tb.waits[a..b] {
                let c = usize::try_from(w[0])
                    .ok()
                    .filter(|&c| c < self.counters.len())
                    .ok_or_else(|| InterpError::BadRow {
                        tile: t,
                        what: format!("wait on counter {} of {}", w[0], self.counters.len()),
                    })?;
                let target = epoch.wrapping_mul(w[1] as u32);
                if (self.counters[c].wrapping_sub(target) as i32) < 0 {
                    *um += 1;
                    waiters[c].push((t, target, false));
                }
            }
        }
        let mut ready: Vec<usize> = (0..n).filter(|&t| unmet[t] == 0).collect();
        let mut order = Vec::with_capacity(n);
        while order.len() < n {
            if ready.is_empty() {
                return Err(InterpError::Deadlock {
                    epoch,
                    done: order.len(),
                    total: n,
                });
            }
            let t = ready.swap_remove(pick(&ready) % ready.len());
            self.run_tile(t, epoch)?;
            order.push(t);
            let instr = self.tb.tiles[t][0] as usize;
            for c in [instr, self.n_instr + t] {
                self.counters[c] = self.counters[c].wrapping_add(1);
                let v = self.counters[c];
                for (w, target, met) in waiters[c].iter_mut() {
                    if !*met && (v.wrapping_sub(*target) as i32) >= 0 {
                        *met = true;
                        unmet[*w] -= 1;
                        if unmet[*w] == 0 {
                            ready.push(*w);
                        }
                    }
                }
            }
        }
        Ok(order)
    }

    /// Runs `step` with the kernel's own order for one block (tiles in index order).
    pub fn step_in_order(&mut self) -> Result<Vec<usize>, InterpError> {
        self.step(&mut |ready: &[usize]| (0..ready.len()).min_by_key(|&i| ready[i]).unwrap_or(0))
    }

    fn run_tile(&mut self, t: usize, epoch: u32) -> Result<(), InterpError> {
        self.tile = t;
        let [op, seg, lo, hi] = self.tb.tiles[t];
        let row = self
            .tb
            .arg_row
            .get(op as usize)
            .map(|r| (r + seg) as usize)
            .filter(|&r| r < self.tb.args.len())
            .ok_or_else(|| InterpError::BadRow {
                tile: t,
                what: format!("no argument row for instruction {op} segment {seg}"),
            })?;
        let g: [i64; NARGS] = self.tb.args[row];
        let fa: [f32; NFARGS] = self.tb.fargs[row];
        let kind = kind_of(g[0]).ok_or_else(|| InterpError::BadRow {
            tile: t,
            what: format!("unknown tile kind {}", g[0]),
        })?;
        let res = match kind {
            Kind::Embed => self.embed(g[1], g[2], lo, hi, g[3]),
            Kind::RmsNorm => self.rms_norm(g[1], g[2], g[3], g[4], fa[0], g[5], g[6]),
            Kind::Matvec => self.matvec(&g, lo, hi, fa[0], fa[1]),
            Kind::Rope => self.rope(g[1] + lo * g[5], g[2], g[3] + lo * g[5], g[4], g[5]),
            Kind::HeadNorm => {
                self.head_norm(g[1] + lo * g[5], g[2], g[3] + lo * g[5], g[4], g[5], fa)
            }
            Kind::KvAppend => self.kv_append(&g, lo, None),
            Kind::Attention => self.attention(&g, lo, fa[0]),
            Kind::Sample => self.sample(g[1], g[2], g[3], lo),
            Kind::StepEnd => {
                self.step_end(epoch);
                Ok(())
            }
            Kind::Ewise => self.ewise(&g, lo, hi, fa),
            Kind::GatedAdd => self.gated_add(&g, lo, fa[0]),
        };
        res.map_err(|f| match f {
            Fault::Poison(what) => InterpError::Poison {
                tile: t,
                instr: op as usize,
                what,
            },
            Fault::Oob(what) => InterpError::OutOfBounds {
                tile: t,
                instr: op as usize,
                what,
            },
            Fault::NoSampler(row) => InterpError::NoSampler { tile: t, row },
        })
    }

    // ---- memory: every access checked for bounds, every read for poison --------------------

    fn ld(&self, at: i64) -> R<f32> {
        let v = usize::try_from(at)
            .ok()
            .and_then(|i| self.act.get(i))
            .ok_or_else(|| Fault::Oob(format!("act[{at}] of {}", self.act.len())))?;
        if v.is_nan() {
            return Err(Fault::Poison(format!("act[{at}]")));
        }
        Ok(*v)
    }

    fn st(&mut self, at: i64, v: f32) -> R<()> {
        let n = self.act.len();
        let slot = usize::try_from(at)
            .ok()
            .and_then(|i| self.act.get_mut(i))
            .ok_or_else(|| Fault::Oob(format!("act[{at}] of {n}")))?;
        *slot = v;
        Ok(())
    }

    /// Base offset of a non-null arena pointer argument.
    fn ptr(&self, a: i64, what: &str) -> R<i64> {
        if a < 0 {
            return Err(Fault::Oob(format!("{what} is a null pointer")));
        }
        Ok(a)
    }

    /// Element `i` of bf16 weight `w` as f32.
    fn wb(&self, w: usize, i: usize) -> R<f32> {
        match self.weights.get(w) {
            Some(WeightData::Bf16(v)) => v
                .get(i)
                .map(|&b| bf16_to_f32(b))
                .ok_or_else(|| Fault::Oob(format!("bf16 weight {w}[{i}] of {}", v.len()))),
            _ => Err(Fault::Oob(format!("wt[{w}] is null (not a bf16 weight)"))),
        }
    }

    /// The whole f32 weight `w` (`wt_f32[w]`), or `None` for index −1 (a null pointer).
    fn wf(&self, w: i64) -> R<Option<&[f32]>> {
        if w < 0 {
            return Ok(None);
        }
        match self.weights.get(w as usize) {
            Some(WeightData::F32(v)) => Ok(Some(v)),
            _ => Err(Fault::Oob(format!(
                "wt_f32[{w}] is null (not an f32 weight)"
            ))),
        }
    }

    fn wf_at(v: &[f32], i: usize, w: i64) -> R<f32> {
        v.get(i)
            .copied()
            .ok_or_else(|| Fault::Oob(format!("f32 weight {w}[{i}] of {}", v.len())))
    }

    fn bf16_weight_len(&self, w: i64) -> R<usize> {
        match usize::try_from(w).ok().and_then(|w| self.weights.get(w)) {
            Some(WeightData::Bf16(v)) => Ok(v.len()),
            _ => Err(Fault::Oob(format!("wt[{w}] is null (not a bf16 weight)"))),
        }
    }

    /// Is batch row `b` active (`pos[b] >= 0`)?
    fn live(&self, b: usize) -> bool {
        self.pos[b] >= 0
    }

    /// Batch row `b`'s position, checked to have a page-table entry.
    fn row_pos(&self, b: usize) -> R<usize> {
        let p = self.pos[b];
        if p < 0 || p as usize / self.block_size >= self.max_blocks {
            return Err(Fault::Oob(format!(
                "row {b}: position {p} outside {} blocks of {}",
                self.max_blocks, self.block_size
            )));
        }
        Ok(p as usize)
    }

    /// Block and offset of position `p` of batch row `b` through its page table
    /// (`page_tables[b · max_blocks + p / block_size]`, `p % block_size`), checked to be a
    /// block of the pool.
    fn locate(&self, b: usize, p: usize) -> R<(usize, usize)> {
        let i = p / self.block_size;
        if i >= self.max_blocks {
            return Err(Fault::Oob(format!(
                "row {b}: position {p} past {} page-table entries",
                self.max_blocks
            )));
        }
        let block = self.tables[b * self.max_blocks + i];
        if block < 0 || block as usize >= self.num_blocks {
            return Err(Fault::Oob(format!(
                "row {b}: position {p} in block {block} (page-table entry {i}) of {}",
                self.num_blocks
            )));
        }
        Ok((block as usize, p % self.block_size))
    }

    /// `kv_pos_state(page_tables + b·max_blocks, block_size, state_dim, p)` (kv.cuh).
    fn state_index_of(&self, b: usize, p: usize) -> R<usize> {
        let (block, off) = self.locate(b, p)?;
        Ok(self.state_index(block, off))
    }

    fn kv_ld(&self, v: bool, at: usize) -> R<f32> {
        let cache = if v { &self.v_cache } else { &self.k_cache };
        let b = *cache
            .get(at)
            .ok_or_else(|| Fault::Oob(format!("kv[{at}] of {}", cache.len())))?;
        let x = bf16_to_f32(b);
        if x.is_nan() {
            let what = if v { "v_cache" } else { "k_cache" };
            return Err(Fault::Poison(format!("{what}[{at}]")));
        }
        Ok(x)
    }

    /// Rows `[0, batch)` of `k` columns at `x + b·xs` (poison-checked).
    fn load_rows(&self, x: i64, xs: i64, k: usize) -> R<Vec<Vec<f32>>> {
        (0..self.batch)
            .map(|b| {
                (0..k)
                    .map(|c| self.ld(x + b as i64 * xs + c as i64))
                    .collect()
            })
            .collect()
    }

    /// `mk_inv_rms`: 1 / rms of each row (1 when !use_norm).
    fn inv_rms(rows: &[Vec<f32>], use_norm: bool, eps: f32) -> Vec<f32> {
        rows.iter()
            .map(|r| {
                if !use_norm {
                    return 1.0;
                }
                let s: f32 = r.iter().map(|v| v * v).sum();
                1.0 / (s / r.len() as f32 + eps).sqrt()
            })
            .collect()
    }

    // ---- the tile functions of tiles.cuh ----------------------------------------------------

    /// `mk_embed(W(g[1]), g[2], tokens, pos, MK_BATCH, lo, hi, A(g[3]))`: zeros for an
    /// inactive row.
    fn embed(&mut self, table: i64, dim: i64, c0: i64, c1: i64, out: i64) -> R<()> {
        let out = self.ptr(out, "embed out")?;
        let len = self.bf16_weight_len(table)?;
        for b in 0..self.batch {
            if !self.live(b) {
                for c in c0..c1 {
                    self.st(out + b as i64 * dim + c, 0.0)?;
                }
                continue;
            }
            let tok = self.tokens[b];
            let row = tok as i64 * dim;
            if tok < 0 || (row + dim) as usize > len {
                return Err(Fault::Oob(format!(
                    "row {b}: token {tok} outside the embedding table"
                )));
            }
            for c in c0..c1 {
                let v = self.wb(table as usize, (row + c) as usize)?;
                self.st(out + b as i64 * dim + c, v)?;
            }
        }
        Ok(())
    }

    /// `mk_rms_norm(A(g[1]), g[2], g[3], MK_BATCH, WF(g[4]), fa[0], A(g[5]), g[6])`.
    #[allow(clippy::too_many_arguments)]
    fn rms_norm(&mut self, x: i64, xs: i64, n: i64, nw: i64, eps: f32, out: i64, os: i64) -> R<()> {
        let (x, out) = (self.ptr(x, "rms_norm x")?, self.ptr(out, "rms_norm out")?);
        let rows = self.load_rows(x, xs, n as usize)?;
        let inv = Self::inv_rms(&rows, true, eps);
        let nw = self.wf(nw)?.map(<[f32]>::to_vec);
        for (b, r) in rows.iter().enumerate() {
            for (c, &xv) in r.iter().enumerate() {
                let v = xv * inv[b];
                let v = match &nw {
                    Some(w) => v * Self::wf_at(w, c, 0)?,
                    None => v,
                };
                self.st(out + b as i64 * os + c as i64, v)?;
            }
        }
        Ok(())
    }

    /// `mk_matvec<MK_BATCH>(W(g[1]), W(g[2]), lo, hi, g[3], A(g[4]), g[5], MK_BATCH, WF(g[6]), g[7],
    /// fa[0], A(g[8]), g[9], A(g[10]), g[11], g[12], g[13], fa[1], WF(g[14]))`.
    #[allow(clippy::needless_range_loop)] // the kernel's loops, index for index
    fn matvec(&mut self, g: &[i64; NARGS], r0: i64, r1: i64, eps: f32, cap: f32) -> R<()> {
        let (w, up, k) = (g[1], g[2], g[3] as usize);
        let (x, xs) = (self.ptr(g[4], "matvec x")?, g[5]);
        let use_norm = g[7] != 0;
        let (out, os, res, rs, epi, act) = (
            self.ptr(g[8], "matvec out")?,
            g[9],
            g[10],
            g[11],
            g[12],
            g[13],
        );
        let rows = self.load_rows(x, xs, k)?;
        let inv = Self::inv_rms(&rows, use_norm, eps);
        let nw = self.wf(g[6])?.map(<[f32]>::to_vec);
        let bias = self.wf(g[14])?.map(<[f32]>::to_vec);
        let wlen = self.bf16_weight_len(w)?;
        let ulen = if up >= 0 {
            Some(self.bf16_weight_len(up)?)
        } else {
            None
        };
        let (wd, ud) = (w as usize, up.max(0) as usize);
        for r in r0..r1 {
            let base = r as usize * k;
            if r < 0 || base + k > wlen || ulen.is_some_and(|n| base + k > n) {
                return Err(Fault::Oob(format!(
                    "matvec row {r} of {k} columns outside the weight"
                )));
            }
            let mut a = vec![0f32; self.batch];
            let mut u = vec![0f32; self.batch];
            for c in 0..k {
                let sc = match &nw {
                    Some(n) => Self::wf_at(n, c, g[6])?,
                    None => 1.0,
                };
                let wv = self.wb(wd, base + c)? * sc;
                let uv = if ulen.is_some() {
                    self.wb(ud, base + c)? * sc
                } else {
                    0.0
                };
                for b in 0..self.batch {
                    let xv = rows[b][c];
                    a[b] += wv * xv;
                    u[b] += uv * xv;
                }
            }
            for b in 0..self.batch {
                let bv = match &bias {
                    Some(v) => Self::wf_at(v, r as usize, g[14])?,
                    None => 0.0,
                };
                let gv = a[b] * inv[b] + bv;
                let uu = u[b] * inv[b];
                let v = if ulen.is_some() {
                    act_fn(act, gv) * uu
                } else if epi == 1 {
                    act_fn(act, gv)
                } else if epi == 2 {
                    let res = self.ptr(res, "matvec residual")?;
                    self.ld(res + b as i64 * rs + r)? + gv
                } else if epi == 3 {
                    cap * (gv / cap).tanh()
                } else {
                    gv
                };
                self.st(out + b as i64 * os + r, v)?;
            }
        }
        Ok(())
    }

    /// `(cos, sin)` of pair `i` at row `b`'s position, as `mk_rope_head`.
    fn angle(&self, b: usize, i: usize) -> R<(f32, f32)> {
        let f = self
            .inv_freq
            .get(i)
            .ok_or_else(|| Fault::Oob(format!("inv_freq[{i}] of {}", self.inv_freq.len())))?;
        let a = self.pos[b] as f32 * f;
        Ok(((a as f64).cos() as f32, (a as f64).sin() as f32))
    }

    /// `mk_rope_head` into a local `[batch][head_dim]` (the caller stores it).
    fn rope_head(&self, x: i64, xs: i64, hd: usize) -> R<Vec<Vec<f32>>> {
        let half = hd / 2;
        let style = self.rope_style;
        let mut out = vec![vec![0f32; hd]; self.batch];
        for (b, o) in out.iter_mut().enumerate() {
            for i in 0..half {
                let (c, s) = self.angle(b, i)?;
                let (i0, i1) = if style == 1 {
                    (2 * i, 2 * i + 1)
                } else {
                    (i, i + half)
                };
                let p = self.ld(x + b as i64 * xs + i0 as i64)?;
                let q = self.ld(x + b as i64 * xs + i1 as i64)?;
                if style == 2 {
                    o[i0] = p * c + q * s;
                    o[i1] = q * c - p * s;
                } else {
                    o[i0] = p * c - q * s;
                    o[i1] = q * c + p * s;
                }
            }
        }
        Ok(out)
    }

    /// `mk_rope(A(g[1]) + lo·g[5], g[2], A(g[3]) + lo·g[5], g[4], g[5], ...)`.
    fn rope(&mut self, x: i64, xs: i64, out: i64, os: i64, hd: i64) -> R<()> {
        let rot = self.rope_head(x, xs, hd as usize)?;
        for (b, r) in rot.iter().enumerate() {
            for (c, v) in r.iter().enumerate() {
                self.st(out + b as i64 * os + c as i64, *v)?;
            }
        }
        Ok(())
    }

    /// `mk_head_norm(A(g[1]) + lo·g[5], g[2], A(g[3]) + lo·g[5], g[4], g[5], fa[0], fa[1])`.
    fn head_norm(
        &mut self,
        x: i64,
        xs: i64,
        out: i64,
        os: i64,
        hd: i64,
        fa: [f32; NFARGS],
    ) -> R<()> {
        let rows = self.load_rows(x, xs, hd as usize)?;
        let inv = Self::inv_rms(&rows, true, fa[0]);
        for (b, r) in rows.iter().enumerate() {
            for (c, v) in r.iter().enumerate() {
                self.st(out + b as i64 * os + c as i64, v * inv[b] * fa[1])?;
            }
        }
        Ok(())
    }

    /// `mk_kv_append(A(g[1]) + lo·g[7], A(g[2]) + lo·g[7], g[3], g[4], k_cache, v_cache,
    /// MK_LAYERS, g[5], lo, g[6], g[7], block_size, page_tables, max_blocks, pos, inv_freq,
    /// style, g[8])`.
    #[allow(clippy::needless_range_loop)] // the kernel's loops, index for index
    /// `mk_kv_append` of KV head `lo`: every batch row, or only row `only` (the fused append of
    /// an attention tile, which covers one row).
    fn kv_append(&mut self, g: &[i64; NARGS], lo: i64, only: Option<usize>) -> R<()> {
        let hd = g[7];
        let k = self.ptr(g[1], "kv_append k")? + lo * hd;
        let v = self.ptr(g[2], "kv_append v")? + lo * hd;
        let (ks, vs, layer, kv_heads) = (g[3], g[4], g[5] as usize, g[6] as usize);
        let hd = hd as usize;
        let kr = if g[8] != 0 {
            self.rope_head(k, ks, hd)?
        } else {
            self.load_rows(k, ks, hd)?
        };
        if kv_heads != self.kv_heads || hd != self.head_dim {
            return Err(Fault::Oob(format!(
                "kv_append of {kv_heads} heads × {hd} in a cache of {} × {}",
                self.kv_heads, self.head_dim
            )));
        }
        for (b, kr) in kr.iter().enumerate() {
            if !self.live(b) || only.is_some_and(|o| o != b) {
                continue;
            }
            let p = self.row_pos(b)?;
            // kv_pos_row(page_tables + b·max_blocks, layers, kv_heads, block_size, head_dim,
            // layer, g, pos[b])
            let (block, off) = self.locate(b, p)?;
            let row = self.kv_index(layer, block, lo as usize, off);
            for c in 0..hd {
                let vv = self.ld(v + b as i64 * vs + c as i64)?;
                if row + c >= self.k_cache.len() {
                    return Err(Fault::Oob(format!(
                        "kv[{}] of {}",
                        row + c,
                        self.k_cache.len()
                    )));
                }
                self.k_cache[row + c] = f32_to_bf16(kr[c]);
                self.v_cache[row + c] = f32_to_bf16(vv);
            }
        }
        Ok(())
    }

    /// The kernel's `MK_K_ATTENTION` case: with `g[10] & 2` first `mk_kv_append` of this
    /// head's KV head `lo / g[6]` (k `A(g[11])`, v `A(g[12])`, strides `g[13]`, `g[14]`, rotated
    /// when `g[10] & 4`), then `mk_attention(A(g[1]) + lo·g[8], g[2], A(g[3]) + lo·g[8], g[4],
    /// k_cache, v_cache, MK_LAYERS, g[5], lo / g[6], g[7], g[8], block_size, fa[0], g[9],
    /// page_tables, max_blocks, pos, g[10] & 1 ? inv_freq : null, style)`: q rotated when
    /// `g[10] & 1`; key j is read through the row's page table.
    /// `mk_attention` for one (batch row, query head): tile unit `unit` = row · heads + head.
    fn attention(&mut self, g: &[i64; NARGS], unit: i64, scale: f32) -> R<()> {
        let hd = g[8];
        let flags = g[10];
        let heads = g[6] * g[7];
        if heads <= 0 || unit < 0 || unit / heads >= self.batch as i64 {
            return Err(Fault::Oob(format!(
                "attention unit {unit} of {heads} heads × {} rows",
                self.batch
            )));
        }
        let (lo, b) = (unit % heads, (unit / heads) as usize);
        if flags & 2 != 0 {
            // mk_kv_append's argument row: k, v, their strides, layer, kv_heads, head_dim, rope.
            let mut ka = [0i64; NARGS];
            ka[1..9].copy_from_slice(&[
                g[11],
                g[12],
                g[13],
                g[14],
                g[5],
                g[7],
                hd,
                (flags >> 2) & 1,
            ]);
            self.kv_append(&ka, lo / g[6], Some(b))?;
        }
        let q = self.ptr(g[1], "attention q")? + lo * hd;
        let out = self.ptr(g[3], "attention out")? + lo * hd;
        let (qs, os, layer, group, kv_heads, window) =
            (g[2], g[4], g[5] as usize, g[6], g[7] as usize, g[9]);
        let kvh = (lo / group) as usize;
        let hd = hd as usize;
        let qr = if flags & 1 != 0 {
            self.rope_head(q, qs, hd)?
        } else {
            self.load_rows(q, qs, hd)?
        };
        if kv_heads != self.kv_heads || hd != self.head_dim {
            return Err(Fault::Oob(format!(
                "attention over {kv_heads} heads × {hd} in a cache of {} × {}",
                self.kv_heads, self.head_dim
            )));
        }
        let qv = &qr[b];
        if !self.live(b) {
            for c in 0..hd {
                self.st(out + b as i64 * os + c as i64, 0.0)?;
            }
            return Ok(());
        }
        let p = self.row_pos(b)?;
        let first = if window >= 0 {
            (p as i64 - window).max(0) as usize
        } else {
            0
        };
        let mut rows = Vec::with_capacity(p + 1 - first);
        for j in first..=p {
            let (block, off) = self.locate(b, j)?;
            rows.push(self.kv_index(layer, block, kvh, off));
        }
        let mut scores = Vec::with_capacity(p + 1 - first);
        for &row in &rows {
            let mut d = 0f32;
            for (c, qc) in qv.iter().enumerate() {
                d += qc * self.kv_ld(false, row + c)?;
            }
            scores.push(d * scale);
        }
        let m = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut l = 0f32;
        let mut acc = vec![0f32; hd];
        for (i, &row) in rows.iter().enumerate() {
            let e = (scores[i] - m).exp();
            l += e;
            for (c, a) in acc.iter_mut().enumerate() {
                *a += e * self.kv_ld(true, row + c)?;
            }
        }
        for (c, a) in acc.iter().enumerate() {
            self.st(out + b as i64 * os + c as i64, a / l)?;
        }
        Ok(())
    }

    /// `mk_sample(A(g[1]), g[2], g[3], lo, ctl, pos, tokens)`: row `lo` with its own controls
    /// `ctl.rows[lo]`: greedy (the first maximum) at temperature 0 (or a one-token vocabulary),
    /// else [`Machine::sampler`] keyed by its `row_id` and `pos + 1`; nothing for an inactive
    /// row.
    fn sample(&mut self, logits: i64, ls: i64, vocab: i64, b: i64) -> R<()> {
        let logits = self.ptr(logits, "sample logits")?;
        if b < 0 || b as usize >= self.batch {
            return Err(Fault::Oob(format!("sample row {b} of {}", self.batch)));
        }
        let bu = b as usize;
        if !self.live(bu) {
            return Ok(());
        }
        let row: Vec<f32> = (0..vocab)
            .map(|c| self.ld(logits + b * ls + c))
            .collect::<R<_>>()?;
        let ctl = self.ctl.rows[bu];
        let pick = if ctl.temperature > 0.0 && vocab > 1 {
            let f = self.sampler.ok_or(Fault::NoSampler(bu))?;
            f(&row, &ctl, ctl.row(), self.pos[bu] as u64 + 1)
        } else {
            let mut best = f32::NEG_INFINITY;
            let mut pick = 0;
            for (c, &v) in row.iter().enumerate() {
                if v > best {
                    best = v;
                    pick = c as u32;
                }
            }
            pick
        };
        self.tokens[bu] = pick as i32;
        Ok(())
    }

    /// `mk_step_end(pos, tokens, MK_BATCH, ctl, ring, epoch, epoch_ctr)`.
    /// Active rows advance; an inactive row's ring token is [`NO_TOKEN`], never a stop.
    fn step_end(&mut self, epoch: u32) {
        let at = (epoch as usize % RING) * ring_stride(self.batch);
        let n_stop = self.ctl.n_stop.clamp(0, MAX_STOP as i32) as usize;
        let stops = &self.ctl.stop_ids[..n_stop];
        let mut stopped = 0u32;
        for (b, &t) in self.tokens.iter().enumerate() {
            if self.pos[b] < 0 {
                self.ring[at + b] = NO_TOKEN;
                continue;
            }
            self.pos[b] += 1;
            self.ring[at + b] = t as u32;
            if stops.contains(&t) {
                stopped |= 1 << b;
            }
        }
        self.ring[at + self.batch] = stopped;
        self.ring[at + self.batch + 1] = epoch;
        self.epoch = epoch;
    }

    /// `mk_ewise(g[1], g[2], A(g[3]), g[4], A(g[5]), g[6], A(g[7]), g[8], lo, hi, fa[0], fa[1])`.
    fn ewise(&mut self, g: &[i64; NARGS], c0: i64, c1: i64, fa: [f32; NFARGS]) -> R<()> {
        let (op, act) = (g[1], g[2]);
        let (x, xs, ys) = (self.ptr(g[3], "ewise x")?, g[4], g[6]);
        let (out, os) = (self.ptr(g[7], "ewise out")?, g[8]);
        for b in 0..self.batch as i64 {
            for c in c0..c1 {
                let xv = self.ld(x + b * xs + c)?;
                let v = match op {
                    0 | 1 => {
                        let y = self.ptr(g[5], "ewise y")?;
                        let yv = self.ld(y + b * ys + c)?;
                        if op == 0 {
                            fa[0] * xv + fa[1] * yv
                        } else {
                            xv * yv
                        }
                    }
                    2 => act_fn(act, xv),
                    _ => fa[0] * (xv / fa[0]).tanh(),
                };
                self.st(out + b * os + c, v)?;
            }
        }
        Ok(())
    }

    /// `mk_gated_add(A(g[1]), g[2], A(g[3]), g[4], g[5], WF(g[6]), A(g[7]), g[8], A(g[9]), g[10],
    /// g[11], lo, fa[0], g[12], kv_state, state_dim, block_size, page_tables, max_blocks, pos)`:
    /// the smear's state at pos − 1 and pos through the row's page table.
    fn gated_add(&mut self, g: &[i64; NARGS], grp: i64, scale: f32) -> R<()> {
        let (x, xs) = (self.ptr(g[1], "gated_add x")?, g[2]);
        let (gin, gs, channels) = (self.ptr(g[3], "gated_add gate input")?, g[4], g[5] as usize);
        let (ys, out, os, hd, smear) = (
            g[8],
            self.ptr(g[9], "gated_add out")?,
            g[10],
            g[11],
            g[12] != 0,
        );
        let w = self
            .wf(g[6])?
            .ok_or_else(|| Fault::Oob("gated_add gate is a null pointer".into()))?
            .to_vec();
        let c0 = grp * hd;
        let mut gate = vec![0f32; self.batch];
        for (b, gb) in gate.iter_mut().enumerate() {
            let mut s = 0f32;
            for c in 0..channels {
                s += self.ld(gin + b as i64 * gs + c as i64)?
                    * Self::wf_at(&w, grp as usize * channels + c, g[6])?;
            }
            *gb = scale * sigmoid(s);
        }
        for (b, gb) in gate.iter().enumerate() {
            // An inactive row smears nothing, as at position 0.
            let p = if smear && self.live(b) {
                self.row_pos(b)?
            } else {
                0
            };
            let prev = if smear && p > 0 {
                Some(self.state_index_of(b, p - 1)?)
            } else {
                None
            };
            for c in c0..c0 + hd {
                let xv = self.ld(x + b as i64 * xs + c)?;
                let v = if !smear {
                    let y = self.ptr(g[7], "gated_add y")?;
                    xv + gb * self.ld(y + b as i64 * ys + c)?
                } else if let Some(prev) = prev {
                    let at = prev + c as usize;
                    let yv = *self
                        .kv_state
                        .get(at)
                        .ok_or_else(|| Fault::Oob(format!("kv_state[{at}]")))?;
                    if yv.is_nan() {
                        return Err(Fault::Poison(format!("kv_state[{at}]")));
                    }
                    xv + gb * yv
                } else {
                    xv
                };
                self.st(out + b as i64 * os + c, v)?;
            }
        }
        if smear {
            for b in 0..self.batch {
                if !self.live(b) {
                    continue;
                }
                let p = self.row_pos(b)?;
                let row = self.state_index_of(b, p)?;
                for c in 0..hd {
                    let xv = self.ld(x + b as i64 * xs + c)?;
                    let at = row + c as usize;
                    let n = self.kv_state.len();
                    *self
                        .kv_state
                        .get_mut(at)
                        .ok_or_else(|| Fault::Oob(format!("kv_state[{at}] of {n}")))? = xv;
                }
            }
        }
        Ok(())
    }
}

/// A small deterministic generator (splitmix64) for random tile orders.
#[derive(Clone, Debug)]
pub struct SplitMix(pub u64);

impl SplitMix {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A picker for [`Machine::step`]: a uniformly random ready tile.
    pub fn picker(&mut self) -> impl FnMut(&[usize]) -> usize + '_ {
        move |ready: &[usize]| (self.next_u64() % ready.len().max(1) as u64) as usize
    }
}

/// The tiles a counter wait stands for: every tile of its instruction, or its one tile.
pub fn wait_producers(s: &Schedule, w: &Wait) -> Vec<usize> {
    let n_instr = s.instr_first.len() - 1;
    if w.counter < n_instr {
        (s.instr_first[w.counter]..s.instr_first[w.counter + 1]).collect()
    } else {
        vec![w.counter - n_instr]
    }
}

/// For a mutation check: the producers of wait `k` of tile `t` that the schedule would no
/// longer order before `t` if that wait were dropped (not ancestors of `t` through its other
/// waits). Empty when the wait is implied by the others.
pub fn unordered_producers(s: &Schedule, t: usize, k: usize) -> Vec<usize> {
    let mut seen = vec![false; s.tiles.len()];
    let mut stack: Vec<usize> = Vec::new();
    for (i, w) in s.tiles[t].waits.iter().enumerate() {
        if i != k {
            stack.extend(wait_producers(s, w));
        }
    }
    while let Some(u) = stack.pop() {
        if u >= seen.len() || seen[u] {
            continue;
        }
        seen[u] = true;
        for w in &s.tiles[u].waits {
            stack.extend(wait_producers(s, w));
        }
    }
    wait_producers(s, &s.tiles[t].waits[k])
        .into_iter()
        .filter(|&u| !seen[u])
        .collect()
}

/// A picker that runs `target` as soon as it is ready and, until then, none of `avoid` while
/// another tile is ready; random otherwise. With `avoid` = [`unordered_producers`] of a dropped
/// wait, `target` runs before all of them: the order a missing dependency allows.
pub fn adversarial_picker(
    target: usize,
    avoid: Vec<usize>,
    seed: u64,
) -> impl FnMut(&[usize]) -> usize {
    let mut rng = SplitMix(seed);
    let mut done = false;
    move |ready: &[usize]| {
        if !done {
            if let Some(i) = ready.iter().position(|&t| t == target) {
                done = true;
                return i;
            }
            let ok: Vec<usize> = (0..ready.len())
                .filter(|&i| !avoid.contains(&ready[i]))
                .collect();
            if !ok.is_empty() {
                return ok[(rng.next_u64() % ok.len() as u64) as usize];
            }
        }
        (rng.next_u64() % ready.len().max(1) as u64) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounding_is_nearest_even() {
        assert_eq!(f32_to_bf16(1.0), 0x3f80);
        // 1 + 2^-8 is a tie between 1 and 1 + 2^-7: even (1.0) wins.
        assert_eq!(f32_to_bf16(1.0 + 1.0 / 256.0), 0x3f80);
        assert_eq!(f32_to_bf16(1.0 + 3.0 / 256.0), 0x3f82);
        assert!(bf16_to_f32(f32_to_bf16(f32::NAN)).is_nan());
        assert_eq!(bf16_to_f32(0xc000), -2.0);
    }
}

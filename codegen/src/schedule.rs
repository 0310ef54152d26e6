//! The tile schedule of a [`DecodeProgram`]: every instruction split into tiles, each tile's
//! dependencies, the dependency counters it waits on, and the assignment of tiles to the
//! persistent blocks.
//!
//! * **Tiles**: matvecs split into ranges of [`TileConfig::matvec_rows`] output rows (never
//!   straddling two weights), RoPE and head norm one tile per (query) head, attention one per
//!   (batch row, query head), the KV append and the gated value add one tile per KV head, the embedding lookup and elementwise
//!   ops [`TileConfig::elem_cols`] columns per tile, sampling one tile per batch row (each
//!   samples a whole vocabulary row on one block, so the rows run in parallel); norms, smear and
//!   the step end are one tile.
//! * **Dependencies** (exact, not instruction barriers): tile `t` depends on every earlier tile
//!   that writes a range overlapping one `t` reads (read after write), reads a range `t` writes
//!   (write after read: the token ids and the positions) or writes a range `t` writes. Ranges are
//!   columns of a buffer, rows of the token / position vectors and of the cache's per-position
//!   state, and KV heads of a layer's cache.
//!   `StepEnd` also waits for every sink tile, so it runs after the whole step; it reads every
//!   row's token (for the ring), so it waits on each Sample tile by that dependency too.
//! * **Counters**: one per instruction (`0..instrs`) and one per tile (`instrs..`), in global
//!   memory, never reset. A finished tile adds 1 to its instruction's counter and to its own.
//!   When a tile depends on all tiles of a producer it waits on the instruction counter, else
//!   on the producers' tile counters. At epoch `e` (1 for the first step, +1 per step) a wait is
//!   satisfied when the counter reaches `e * per_step` (`per_step` = the producer's tile count,
//!   or 1 for a tile counter): no reset pass between steps.
//! * **Assignment**: tiles are numbered in program order (a topological order); block `b` of
//!   `n` runs tiles `b, b + n, b + 2n, ...` in increasing order. With every block resident this
//!   cannot deadlock: the lowest unfinished tile is always its block's next tile and all its
//!   dependencies are lower, hence finished ([`Schedule::simulate`] checks it).

use std::collections::HashMap;
use std::fmt;

use crate::program::{ColRange, DecodeProgram, Instr};

/// Tile sizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TileConfig {
    /// Output rows of one matvec tile.
    pub matvec_rows: usize,
    /// Columns of one elementwise (embedding, elementwise op) tile.
    pub elem_cols: usize,
    /// Bytes of one of the kernel's two matvec staging buffers (`MK_STAGE_BYTES`; its dynamic
    /// shared memory is both), 0 for none: a matvec tile holds at most as many rows as fit one
    /// (one at least), so that its weights can be copied into shared memory ahead of it.
    pub stage_bytes: usize,
    /// Output rows of one LM-head tile (0: [`TileConfig::matvec_rows`]), capped like a
    /// matvec's by the staging buffer. Its own size because the LM head is the step's one wide
    /// phase of independent tiles: a block runs many of them back to back, so fewer, larger
    /// tiles pay the per-tile wait and signal fewer times.
    pub head_rows: usize,
}

impl TileConfig {
    /// Output rows per tile of a matvec over `k` columns of `mats` bf16 matrices (2 for a
    /// gated one): [`TileConfig::matvec_rows`], fewer where those rows would not fit the staging
    /// buffer.
    pub fn rows_for(&self, k: usize, mats: usize) -> usize {
        self.capped(self.matvec_rows, k, mats)
    }

    /// Output rows per LM-head tile over `k` columns: [`TileConfig::head_rows`] (or
    /// `matvec_rows` when 0), fewer where those rows would not fit the staging buffer.
    pub fn head_rows_for(&self, k: usize) -> usize {
        let rows = if self.head_rows == 0 {
            self.matvec_rows
        } else {
            self.head_rows
        };
        self.capped(rows, k, 1)
    }

    /// `rows`, fewer where they would not fit the staging buffer (one at least).
    fn capped(&self, rows: usize, k: usize, mats: usize) -> usize {
        let per_row = k.saturating_mul(2).saturating_mul(mats.max(1));
        if self.stage_bytes == 0 || per_row == 0 {
            return rows.max(1);
        }
        rows.min(self.stage_bytes / per_row).max(1)
    }
}

impl Default for TileConfig {
    fn default() -> TileConfig {
        TileConfig {
            matvec_rows: 32,
            elem_cols: 1024,
            stage_bytes: 0,
            head_rows: 0,
        }
    }
}

/// What a tile touches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Resource {
    /// Columns of an activation buffer.
    Buf(usize),
    /// Rows of the token id vector.
    Tokens,
    /// Rows of the position vector.
    Pos,
    /// KV heads of one layer's K and V cache.
    Kv(usize),
    /// Rows (batch rows, hence their slots) of the cache's per-position state.
    State,
}

/// `[lo, hi)` of a resource.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Access {
    pub res: Resource,
    pub lo: usize,
    pub hi: usize,
}

impl Access {
    pub fn overlaps(&self, o: &Access) -> bool {
        self.res == o.res && self.lo < o.hi && o.lo < self.hi
    }
    fn cols(r: ColRange) -> Access {
        Access {
            res: Resource::Buf(r.buf),
            lo: r.col,
            hi: r.col + r.cols,
        }
    }
    fn sub(r: ColRange, lo: usize, hi: usize) -> Access {
        Access {
            res: Resource::Buf(r.buf),
            lo: r.col + lo,
            hi: r.col + hi,
        }
    }
    fn buf(b: usize, lo: usize, hi: usize) -> Access {
        Access {
            res: Resource::Buf(b),
            lo,
            hi,
        }
    }
}

/// A counter wait: satisfied at epoch `e` when `counters[counter] >= e * per_step`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Wait {
    pub counter: usize,
    pub per_step: u32,
}

impl Wait {
    /// The counter value that satisfies the wait at `epoch` (wrapping like the u32 on the device).
    pub fn target(&self, epoch: u32) -> u32 {
        epoch.wrapping_mul(self.per_step)
    }
}

/// The part of an instruction's work one block does at once.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tile {
    pub instr: usize,
    /// Index among the instruction's tiles.
    pub index: usize,
    /// Work unit range: output rows of a matvec, heads, columns, segment-relative for matvecs.
    pub lo: usize,
    pub hi: usize,
    /// For multi-weight matvecs, which weight (segment) the rows are in.
    pub segment: usize,
    pub reads: Vec<Access>,
    pub writes: Vec<Access>,
    /// Earlier tiles this one must wait for, ascending.
    pub deps: Vec<usize>,
    pub waits: Vec<Wait>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Schedule {
    pub config: TileConfig,
    pub tiles: Vec<Tile>,
    /// First tile of each instruction, plus the total at the end.
    pub instr_first: Vec<usize>,
}

/// Every column range an instruction names (for validation).
pub fn instr_ranges(ins: &Instr) -> Vec<ColRange> {
    match ins {
        Instr::Embed { .. } | Instr::StepEnd => vec![],
        Instr::RmsNorm { input, .. }
        | Instr::NormMatvec { input, .. }
        | Instr::GatedMlp { input, .. }
        | Instr::Rope { input, .. }
        | Instr::HeadNorm { input, .. }
        | Instr::LmHead { input, .. } => vec![*input],
        Instr::MatvecResidual {
            input, residual, ..
        } => vec![*input, *residual],
        Instr::Elementwise { x, y, .. } => std::iter::once(*x).chain(*y).collect(),
        Instr::GatedValueAdd { v, h, ve, .. } => vec![*v, *h, *ve],
        Instr::Smear { input, .. } => vec![*input],
        Instr::RopeKvAppend { k, v, .. } => vec![*k, *v],
        Instr::AttentionDecode { q, append, .. } => std::iter::once(*q)
            .chain(append.iter().flat_map(|a| [a.k, a.v]))
            .collect(),
        Instr::Sample { logits } => vec![*logits],
    }
}

fn split(n: usize, size: usize) -> Vec<(usize, usize)> {
    (0..n.div_ceil(size))
        .map(|i| (i * size, ((i + 1) * size).min(n)))
        .collect()
}

/// The tiles of one instruction, without dependencies.
fn tiles_of(p: &DecodeProgram, cfg: &TileConfig, i: usize) -> Vec<Tile> {
    let batch = p.batch;
    let mk = |lo, hi, segment, reads: Vec<Access>, writes: Vec<Access>| Tile {
        instr: i,
        index: 0,
        lo,
        hi,
        segment,
        reads,
        writes,
        deps: vec![],
        waits: vec![],
    };
    let pos = Access {
        res: Resource::Pos,
        lo: 0,
        hi: batch,
    };
    let mut out = Vec::new();
    match &p.instrs[i] {
        Instr::Embed { out: o, .. } => {
            for (lo, hi) in split(p.buffers[*o].cols, cfg.elem_cols) {
                let tok = Access {
                    res: Resource::Tokens,
                    lo: 0,
                    hi: batch,
                };
                out.push(mk(lo, hi, 0, vec![tok], vec![Access::buf(*o, lo, hi)]));
            }
        }
        Instr::RmsNorm { input, out: o, .. } => {
            let n = p.buffers[*o].cols;
            out.push(mk(
                0,
                n,
                0,
                vec![Access::cols(*input)],
                vec![Access::buf(*o, 0, n)],
            ));
        }
        Instr::NormMatvec {
            weights,
            input,
            out: o,
            ..
        } => {
            let mut base = 0;
            for (s, w) in weights.iter().enumerate() {
                let rows = p.weights[*w].rows;
                let per_tile = cfg.rows_for(p.weights[*w].cols, 1);
                for (lo, hi) in split(rows, per_tile) {
                    out.push(mk(
                        lo,
                        hi,
                        s,
                        vec![Access::cols(*input)],
                        vec![Access::buf(*o, base + lo, base + hi)],
                    ));
                }
                base += rows;
            }
        }
        Instr::MatvecResidual {
            weight,
            input,
            residual,
            out: o,
            ..
        } => {
            let per_tile = cfg.rows_for(p.weights[*weight].cols, 1);
            for (lo, hi) in split(p.weights[*weight].rows, per_tile) {
                out.push(mk(
                    lo,
                    hi,
                    0,
                    vec![Access::cols(*input), Access::sub(*residual, lo, hi)],
                    vec![Access::buf(*o, lo, hi)],
                ));
            }
        }
        Instr::GatedMlp {
            gate,
            input,
            out: o,
            ..
        } => {
            let per_tile = cfg.rows_for(p.weights[*gate].cols, 2);
            for (lo, hi) in split(p.weights[*gate].rows, per_tile) {
                out.push(mk(
                    lo,
                    hi,
                    0,
                    vec![Access::cols(*input)],
                    vec![Access::buf(*o, lo, hi)],
                ));
            }
        }
        Instr::Elementwise { x, y, out: o, .. } => {
            for (lo, hi) in split(x.cols, cfg.elem_cols) {
                let mut reads = vec![Access::sub(*x, lo, hi)];
                reads.extend(y.map(|y| Access::sub(y, lo, hi)));
                out.push(mk(lo, hi, 0, reads, vec![Access::buf(*o, lo, hi)]));
            }
        }
        Instr::GatedValueAdd {
            channels,
            kv_heads,
            head_dim,
            v,
            h,
            ve,
            out: o,
            ..
        } => {
            // One tile per KV head: its gate reads the first `channels` columns of h.
            for g in 0..*kv_heads {
                let (lo, hi) = (g * head_dim, (g + 1) * head_dim);
                out.push(mk(
                    g,
                    g + 1,
                    0,
                    vec![
                        Access::sub(*v, lo, hi),
                        Access::sub(*h, 0, *channels),
                        Access::sub(*ve, lo, hi),
                    ],
                    vec![Access::buf(*o, lo, hi)],
                ));
            }
        }
        Instr::Smear { input, out: o, .. } => {
            // One tile: it reads each row's state at pos − 1 and writes it at pos.
            let state = Access {
                res: Resource::State,
                lo: 0,
                hi: batch,
            };
            out.push(mk(
                0,
                1,
                0,
                vec![Access::cols(*input), pos, state],
                vec![Access::buf(*o, 0, input.cols), state],
            ));
        }
        Instr::LmHead {
            weight,
            input,
            out: o,
            ..
        } => {
            let per_tile = cfg.head_rows_for(p.weights[*weight].cols);
            for (lo, hi) in split(p.weights[*weight].rows, per_tile) {
                out.push(mk(
                    lo,
                    hi,
                    0,
                    vec![Access::cols(*input)],
                    vec![Access::buf(*o, lo, hi)],
                ));
            }
        }
        Instr::Rope {
            heads,
            head_dim,
            input,
            out: o,
        } => {
            for h in 0..*heads {
                let (lo, hi) = (h * head_dim, (h + 1) * head_dim);
                out.push(mk(
                    h,
                    h + 1,
                    0,
                    vec![Access::sub(*input, lo, hi), pos],
                    vec![Access::buf(*o, lo, hi)],
                ));
            }
        }
        Instr::HeadNorm {
            heads,
            head_dim,
            input,
            out: o,
            ..
        } => {
            for h in 0..*heads {
                let (lo, hi) = (h * head_dim, (h + 1) * head_dim);
                out.push(mk(
                    h,
                    h + 1,
                    0,
                    vec![Access::sub(*input, lo, hi)],
                    vec![Access::buf(*o, lo, hi)],
                ));
            }
        }
        Instr::RopeKvAppend {
            layer,
            kv_heads,
            head_dim,
            k,
            v,
            ..
        } => {
            for g in 0..*kv_heads {
                let (lo, hi) = (g * head_dim, (g + 1) * head_dim);
                out.push(mk(
                    g,
                    g + 1,
                    0,
                    vec![Access::sub(*k, lo, hi), Access::sub(*v, lo, hi), pos],
                    vec![Access {
                        res: Resource::Kv(*layer),
                        lo: g,
                        hi: g + 1,
                    }],
                ));
            }
        }
        Instr::AttentionDecode {
            layer,
            heads,
            kv_heads,
            head_dim,
            q,
            append,
            out: o,
            ..
        } => {
            // One tile per (batch row, query head), work unit b · heads + h: a row's attention
            // is a chain of dependent key loads, so rows run on separate blocks rather than
            // one after another on the head's (on an H200 a batch-8 SmolLM2-135M step took 3.8
            // times a batch-1 step with the rows in one tile, docs/gpu-results.md run 10). The
            // accesses name the head's columns of every row (the resource model has no rows).
            let group = heads / kv_heads;
            for b in 0..batch {
                for h in 0..*heads {
                    let (lo, hi) = (h * head_dim, (h + 1) * head_dim);
                    let g = h / group;
                    let mut reads = vec![
                        Access::sub(*q, lo, hi),
                        Access {
                            res: Resource::Kv(*layer),
                            lo: g,
                            hi: g + 1,
                        },
                        pos,
                    ];
                    // A fused append's cache write is left out of the tile's writes on purpose:
                    // every query head of the group writes the same k and v at the row's
                    // position before reading them back itself, and nothing else in the step
                    // reads the layer's cache, so the heads need not wait on one another.
                    if let Some(a) = append {
                        let (klo, khi) = (g * head_dim, (g + 1) * head_dim);
                        reads.push(Access::sub(a.k, klo, khi));
                        reads.push(Access::sub(a.v, klo, khi));
                    }
                    let unit = b * heads + h;
                    out.push(mk(unit, unit + 1, 0, reads, vec![Access::buf(*o, lo, hi)]));
                }
            }
        }
        Instr::Sample { logits } => {
            // Row b reads its position and writes its token; the logits access is columns of
            // every row (the resource model has no rows), which only adds waits on the lm head.
            for b in 0..batch {
                let row = |res| Access {
                    res,
                    lo: b,
                    hi: b + 1,
                };
                out.push(mk(
                    b,
                    b + 1,
                    0,
                    vec![Access::cols(*logits), row(Resource::Pos)],
                    vec![row(Resource::Tokens)],
                ));
            }
        }
        Instr::StepEnd => {
            let tok = Access {
                res: Resource::Tokens,
                lo: 0,
                hi: batch,
            };
            out.push(mk(0, 1, 0, vec![tok], vec![pos]))
        }
    }
    for (k, t) in out.iter_mut().enumerate() {
        t.index = k;
    }
    out
}

impl Schedule {
    /// Tiles, dependencies and waits of a program.
    pub fn build(p: &DecodeProgram, config: TileConfig) -> Schedule {
        let mut tiles: Vec<Tile> = Vec::new();
        let mut instr_first = Vec::with_capacity(p.instrs.len() + 1);
        for i in 0..p.instrs.len() {
            instr_first.push(tiles.len());
            tiles.extend(tiles_of(p, &config, i));
        }
        instr_first.push(tiles.len());
        let n_instr = p.instrs.len();
        let mut has_dependent = vec![false; tiles.len()];
        // The accesses of every tile of the instructions before the current one, by resource:
        // a tile is compared only with the earlier tiles that touch a resource it touches
        // (comparing every pair took 13 s for the Llama-3.2-1B shape's 75,000 tiles).
        let mut past = AccessIndex::default();
        for i in 0..n_instr {
            let step_end = p.instrs[i] == Instr::StepEnd;
            for t in instr_first[i]..instr_first[i + 1] {
                let mut deps = Vec::new();
                let b = &tiles[t];
                for r in &b.reads {
                    past.overlapping(r, false, &mut deps);
                }
                for w in &b.writes {
                    past.overlapping(w, true, &mut deps);
                }
                if step_end {
                    deps.extend((0..instr_first[i]).filter(|&u| !has_dependent[u]));
                }
                deps.sort_unstable();
                deps.dedup();
                for &u in &deps {
                    has_dependent[u] = true;
                }
                tiles[t].waits = waits_for(&deps, &tiles, &instr_first, n_instr);
                tiles[t].deps = deps;
            }
            for (t, tile) in tiles
                .iter()
                .enumerate()
                .take(instr_first[i + 1])
                .skip(instr_first[i])
            {
                past.add(t, tile);
            }
        }
        Schedule {
            config,
            tiles,
            instr_first,
        }
    }

    /// Every tile's dependencies by the definition, comparing each tile with every tile of the
    /// earlier instructions (read after write, write after read, write after write, and for
    /// the step end every tile with no dependent yet): what [`Schedule::build`] computes through
    /// its index, in quadratic time. For tests.
    #[doc(hidden)]
    pub fn pairwise_deps(&self, p: &DecodeProgram) -> Vec<Vec<usize>> {
        let ov = |x: &[Access], y: &[Access]| x.iter().any(|i| y.iter().any(|j| i.overlaps(j)));
        let mut has_dependent = vec![false; self.tiles.len()];
        let mut all = Vec::with_capacity(self.tiles.len());
        for b in &self.tiles {
            let end = p.instrs[b.instr] == Instr::StepEnd;
            let deps: Vec<usize> = (0..self.instr_first[b.instr])
                .filter(|&u| {
                    let a = &self.tiles[u];
                    ov(&a.writes, &b.reads)
                        || ov(&a.reads, &b.writes)
                        || ov(&a.writes, &b.writes)
                        || (end && !has_dependent[u])
                })
                .collect();
            for &d in &deps {
                has_dependent[d] = true;
            }
            all.push(deps);
        }
        all
    }

    /// Counters the kernel needs: one per instruction, then one per tile.
    pub fn counters(&self) -> usize {
        self.instr_first.len() - 1 + self.tiles.len()
    }

    pub fn tiles_of_instr(&self, i: usize) -> usize {
        self.instr_first[i + 1] - self.instr_first[i]
    }

    /// The tiles block `block` of `num_blocks` runs, in order (the kernel's loop).
    pub fn block_tiles(&self, num_blocks: usize, block: usize) -> Vec<usize> {
        (block..self.tiles.len())
            .step_by(num_blocks.max(1))
            .collect()
    }

    /// Executes `steps` decode steps on `num_blocks` simulated persistent blocks that never
    /// reset their counters, honouring every wait; each round lets every block run its next
    /// tile if that tile's waits are met. Returns the order tiles ran in for each step, or an
    /// error on a deadlock (no block can move) or a tile running before a dependency.
    pub fn simulate(&self, num_blocks: usize, steps: u32) -> Result<Vec<Vec<usize>>, String> {
        let n_instr = self.instr_first.len() - 1;
        let mut counters = vec![0u32; self.counters()];
        let mut orders = Vec::new();
        for epoch in 1..=steps {
            let queues: Vec<Vec<usize>> = (0..num_blocks)
                .map(|b| self.block_tiles(num_blocks, b))
                .collect();
            let mut next = vec![0usize; num_blocks];
            let mut done = vec![false; self.tiles.len()];
            let mut order = Vec::with_capacity(self.tiles.len());
            while order.len() < self.tiles.len() {
                let mut moved = false;
                for b in 0..num_blocks {
                    let Some(&t) = queues[b].get(next[b]) else {
                        continue;
                    };
                    let ready = self.tiles[t]
                        .waits
                        .iter()
                        .all(|w| counters[w.counter] >= w.target(epoch));
                    if !ready {
                        continue;
                    }
                    if let Some(d) = self.tiles[t].deps.iter().find(|&&d| !done[d]) {
                        return Err(format!("tile {t} ran before its dependency {d}"));
                    }
                    counters[self.tiles[t].instr] += 1;
                    counters[n_instr + t] += 1;
                    done[t] = true;
                    order.push(t);
                    next[b] += 1;
                    moved = true;
                }
                if !moved {
                    return Err(format!(
                        "deadlock at step {epoch} with {num_blocks} blocks after {} tiles",
                        order.len()
                    ));
                }
            }
            orders.push(order);
        }
        Ok(orders)
    }
}

/// Where earlier tiles read and write, by resource: `(tile, access)` in tile order.
#[derive(Default)]
struct AccessIndex {
    reads: HashMap<Resource, Vec<(usize, Access)>>,
    writes: HashMap<Resource, Vec<(usize, Access)>>,
}

impl AccessIndex {
    fn add(&mut self, t: usize, tile: &Tile) {
        for a in &tile.reads {
            self.reads.entry(a.res).or_default().push((t, *a));
        }
        for a in &tile.writes {
            self.writes.entry(a.res).or_default().push((t, *a));
        }
    }

    /// Pushes onto `out` every indexed tile that writes (and, with `readers`, reads) a range
    /// overlapping `a`.
    fn overlapping(&self, a: &Access, readers: bool, out: &mut Vec<usize>) {
        let maps = std::iter::once(&self.writes).chain(readers.then_some(&self.reads));
        for list in maps.filter_map(|m| m.get(&a.res)) {
            out.extend(list.iter().filter(|(_, x)| x.overlaps(a)).map(|&(u, _)| u));
        }
    }
}

/// Compresses a dependency list into counter waits: a producer instruction all of whose tiles
/// are dependencies becomes one instruction-counter wait, else one wait per tile counter.
fn waits_for(deps: &[usize], tiles: &[Tile], first: &[usize], n_instr: usize) -> Vec<Wait> {
    let mut waits = Vec::new();
    let mut k = 0;
    while k < deps.len() {
        let instr = tiles[deps[k]].instr;
        let mut e = k;
        while e < deps.len() && tiles[deps[e]].instr == instr {
            e += 1;
        }
        let total = first[instr + 1] - first[instr];
        if e - k == total {
            waits.push(Wait {
                counter: instr,
                per_step: total as u32,
            });
        } else {
            for &d in &deps[k..e] {
                waits.push(Wait {
                    counter: n_instr + d,
                    per_step: 1,
                });
            }
        }
        k = e;
    }
    waits
}

impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "schedule: {} tiles, {} counters, matvec_rows={}, elem_cols={}, stage_bytes={}",
            self.tiles.len(),
            self.counters(),
            self.config.matvec_rows,
            self.config.elem_cols,
            self.config.stage_bytes
        )?;
        let n_instr = self.instr_first.len() - 1;
        for (t, tile) in self.tiles.iter().enumerate() {
            let waits: Vec<String> = tile
                .waits
                .iter()
                .map(|w| {
                    if w.counter < n_instr {
                        format!("i{}>={}e", w.counter, w.per_step)
                    } else {
                        format!("t{}>=e", w.counter - n_instr)
                    }
                })
                .collect();
            writeln!(
                f,
                "  t{t}: i{}.{} [{}..{}) seg{} waits [{}]",
                tile.instr,
                tile.index,
                tile.lo,
                tile.hi,
                tile.segment,
                waits.join(" ")
            )?;
        }
        Ok(())
    }
}

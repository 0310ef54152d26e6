//! A scheduler's KV pool in host memory, and — on an engine that emulates the decode graph —
//! the CPU stand-in for a serving pool's decode graph.
//!
//! The stand-in keeps the CUDA graph's contract as the scheduler sees it: replays run ahead of
//! the host, each embedding the token the previous one sampled at the next position, writing
//! the cache past the lengths the scheduler has confirmed and drawing the next token with the
//! row's own parameters (Philox keyed by its row id and the position the token takes); rows
//! take blocks [`GRAPH_REACH`] positions ahead of where they write and more as they advance,
//! so an exhausted pool surfaces at a replay exactly as on the device. Such a pool also draws
//! tokens "on the device" (`forward_draw`: the host sampler on masked logits), as a CUDA pool
//! does. The scheduler's graph phases and device draws are tested through it on machines
//! without a GPU; it buys no speed.

use std::collections::VecDeque;
use std::sync::Arc;

use super::backend::{no_graph, ServingPool, GRAPH_REACH};
use super::cpu_graph::decode_ahead;
use super::EngineError;
use crate::backend::cpu::{CpuBackend, Workspace};
use crate::backend::{last_of_each_sequence, GraphRow, RowDraw, TokenRow};
use crate::kv::KvCache;
use crate::plan::PlanKind;
use crate::sample::{self, SamplingParams};

pub(super) struct CpuPool {
    kv: KvCache,
    backend: Arc<CpuBackend>,
    ws: Workspace,
    /// Logits of the stand-in's draws.
    ws_logits: Vec<f32>,
    /// The decode graph's stand-in, when the engine emulates the graph.
    graph: Option<PoolGraph>,
}

impl CpuPool {
    pub fn new(kv: KvCache, backend: Arc<CpuBackend>, emulate_graph: bool) -> CpuPool {
        CpuPool {
            kv,
            backend,
            ws: Workspace::new(),
            ws_logits: Vec::new(),
            graph: emulate_graph.then(PoolGraph::default),
        }
    }

    fn graph(&mut self) -> Result<&mut PoolGraph, EngineError> {
        self.graph.as_mut().ok_or_else(no_graph)
    }
}

/// One batch row of the stand-in: where it writes next and how it draws.
#[derive(Clone, Copy)]
struct EmuRow {
    row: GraphRow,
    sampling: SamplingParams,
    /// Positions below this have blocks.
    end: usize,
}

#[derive(Default)]
struct PoolGraph {
    rows: Vec<Option<EmuRow>>,
    /// Sampled tokens of the replays run but not consumed yet, oldest first.
    queue: VecDeque<Vec<Option<u32>>>,
    logits: Vec<f32>,
}

impl ServingPool for CpuPool {
    fn tables(&self) -> &KvCache {
        &self.kv
    }

    fn tables_mut(&mut self) -> &mut KvCache {
        &mut self.kv
    }

    fn prepare(&mut self, slot: usize, end: usize) -> Result<(), EngineError> {
        Ok(self.kv.prepare(slot, end)?)
    }

    fn has_graph(&self) -> bool {
        self.graph.is_some()
    }

    fn graph_start(
        &mut self,
        bucket: usize,
        rows: &[GraphRow],
        sampling: &[SamplingParams],
    ) -> Result<(), EngineError> {
        let capacity = self.kv.capacity();
        let mut started = vec![None; bucket];
        for ((d, r), p) in started.iter_mut().zip(rows).zip(sampling) {
            let end = (r.pos + GRAPH_REACH).min(capacity);
            self.kv.make_writable(r.slot, r.pos, end)?;
            *d = Some(EmuRow {
                row: *r,
                sampling: *p,
                end,
            });
        }
        let g = self.graph()?;
        g.rows = started;
        g.queue.clear();
        Ok(())
    }

    fn graph_leave(&mut self, b: usize) -> Result<(), EngineError> {
        let g = self.graph()?;
        match g.rows.get_mut(b) {
            Some(r @ Some(_)) => {
                *r = None;
                Ok(())
            }
            _ => Err(EngineError::Request(format!(
                "decode graph row {b} is not active"
            ))),
        }
    }

    fn graph_enqueue(&mut self) -> Result<(), EngineError> {
        let capacity = self.kv.capacity();
        let g = self.graph.as_mut().ok_or_else(no_graph)?;
        g.enqueue(&self.backend, &mut self.kv, &mut self.ws, capacity)
    }

    fn graph_next(&mut self) -> Result<Vec<Option<u32>>, EngineError> {
        self.graph()?
            .queue
            .pop_front()
            .ok_or_else(|| EngineError::Request("no decode graph replay in flight".into()))
    }

    fn graph_stop(&mut self) -> Result<(), EngineError> {
        if let Some(g) = self.graph.as_mut() {
            g.queue.clear();
            g.rows.clear();
        }
        Ok(())
    }

    fn draws_on_device(&self) -> bool {
        self.graph.is_some()
    }

    /// The stand-in for the device's draws (on an engine that emulates the decode graph).
    fn forward_draw(
        &mut self,
        kind: PlanKind,
        tokens: &[u32],
        rows: &[TokenRow],
        draws: &[RowDraw<'_>],
    ) -> Result<Option<Vec<u32>>, EngineError> {
        if self.graph.is_none() {
            return Ok(None);
        }
        let (b, ws, kv) = (&self.backend, &mut self.ws, &mut self.kv);
        draw_on_host(b, ws, kv, kind, tokens, rows, draws, &mut self.ws_logits).map(Some)
    }

    fn forward(
        &mut self,
        kind: PlanKind,
        tokens: &[u32],
        rows: &[TokenRow],
        logit_rows: Option<&[usize]>,
        logits: &mut Vec<f32>,
    ) -> Result<usize, EngineError> {
        let (b, ws, kv) = (&self.backend, &mut self.ws, &mut self.kv);
        Ok(match logit_rows {
            Some(sel) => b.forward_selected(ws, kv, tokens, rows, sel, logits)?,
            None => b.forward(kind, ws, kv, tokens, rows, logits)?,
        })
    }
}

impl PoolGraph {
    /// One replay: blocks for what the active rows write, then one decode step of them past
    /// the confirmed lengths (which stay as they were), each row drawing its next token.
    fn enqueue(
        &mut self,
        backend: &CpuBackend,
        kv: &mut KvCache,
        ws: &mut Workspace,
        capacity: usize,
    ) -> Result<(), EngineError> {
        let active: Vec<usize> = (0..self.rows.len())
            .filter(|&b| self.rows[b].is_some())
            .collect();
        for &b in &active {
            let r = self.rows[b].as_mut().expect("active");
            if r.row.pos >= capacity {
                return Err(EngineError::Request(format!(
                    "decode graph row {b} would write position {} of a {capacity}-position slot",
                    r.row.pos
                )));
            }
            if r.row.pos + 1 > r.end {
                let end = (r.row.pos + GRAPH_REACH).min(capacity);
                kv.make_writable(r.row.slot, r.end, end)?;
                r.end = end;
            }
        }
        let live: Vec<GraphRow> = active
            .iter()
            .map(|&b| self.rows[b].expect("active").row)
            .collect();
        decode_ahead(backend, ws, kv, &live, &mut self.logits)?;
        let vocab = backend.config().vocab_size;
        let mut next = vec![None; self.rows.len()];
        for (k, &b) in active.iter().enumerate() {
            let r = self.rows[b].as_mut().expect("active");
            let logits = &mut self.logits[k * vocab..(k + 1) * vocab];
            let t = sample::sample(logits, &r.sampling, r.row.row_id, (r.row.pos + 1) as u64);
            r.row.token = t;
            r.row.pos += 1;
            next[b] = Some(t);
        }
        self.queue.push_back(next);
        Ok(())
    }
}

/// The device's draws stood in for on the host: one step, then each sequence's logit row (one
/// per sequence, its last token's) masked to `draws[i].allowed` as `Constraint::apply` masks
/// it and drawn by the host sampler with the row's parameters, keyed by its row and the position
/// its token takes.
#[allow(clippy::too_many_arguments)]
pub(super) fn draw_on_host(
    backend: &CpuBackend,
    ws: &mut Workspace,
    kv: &mut KvCache,
    kind: PlanKind,
    tokens: &[u32],
    rows: &[TokenRow],
    draws: &[RowDraw<'_>],
    logits: &mut Vec<f32>,
) -> Result<Vec<u32>, EngineError> {
    let n = backend.forward(kind, ws, kv, tokens, rows, logits)?;
    let vocab = backend.config().vocab_size;
    let last = last_of_each_sequence(rows);
    let mut out = Vec::with_capacity(n);
    for ((row, d), t) in logits.chunks_exact_mut(vocab).zip(draws).zip(last) {
        // The token takes the position after its sequence's last row.
        let pos = rows[t].pos + 1;
        if let Some(words) = d.allowed {
            for (i, l) in row.iter_mut().enumerate() {
                if words.get(i / 32).is_none_or(|w| (w >> (i % 32)) & 1 == 0) {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        out.push(sample::sample(row, &d.sampling, d.row_id, pos as u64));
    }
    Ok(out)
}

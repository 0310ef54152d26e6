//! Driving the graph-replayed decode megakernel from a stream.
//!
//! The graph runs ahead of the host: each replay embeds the token the previous one sampled and
//! samples the next on the device, so the host only reads tokens back (through pinned mapped
//! memory) and keeps up to [`DEPTH`] replays in flight. A replay's KV entries count as the
//! session's only once the host has consumed its token, so everything still in flight can be
//! dropped at any moment ([`GraphRun::stop`]): when a row must take forced tool tokens, when
//! every row has finished, or when the stream ends early. The host path (per-op forward) then
//! takes over from the last consumed position, and the graph is started again from there.
//!
//! This bookkeeping is tested on the CPU against [`super::cpu_graph::CpuGraph`], which runs
//! ahead like the device. With the CUDA graph decoder it ran on an H200 (docs/gpu-results.md):
//! `tests/gpu_engine.rs` passes (the CPU, per-op and megakernel engines agree on every fixture
//! directory and on 256 SmolLM2 tokens with 2, 3 and 8 rows at once; later turns attend past the
//! first graph's positions). No GPU test forces tool tokens, so that stop has not run on one.

use super::backend::{Backend, Caches, CpuGraphInputs};
use super::{EngineError, LogitsProcessor};
use crate::backend::GraphRow;
use crate::sample::SamplingParams;
use kiln_codegen::bucket_for;

/// The part of a session a graph run reads and confirms into: its memory on the device and
/// what each slot's cache holds.
pub(super) struct SessionMemory<'a> {
    pub dev: &'a mut dyn Caches,
    pub tokens: &'a mut [Vec<u32>],
}

/// Replays kept in flight ahead of the host.
pub(super) const DEPTH: usize = 8;

/// A started graph: which engine row each batch row is, and the token each fed row is waiting
/// to have confirmed in the cache.
pub(super) struct GraphRun {
    bucket: usize,
    /// Engine row (= cache slot) of each batch row.
    rows: Vec<usize>,
    /// Per batch row: the token the oldest in-flight replay embeds and its position, or `None`
    /// once the row has finished (its replays are ignored).
    pending: Vec<Option<(u32, usize)>>,
    /// Replays still worth enqueuing (bounded by the cache and by `max_tokens`).
    budget: usize,
    /// Replays enqueued and not consumed yet.
    in_flight: usize,
}

impl GraphRun {
    /// Whether a graph can take `rows` rows.
    pub fn fits(backend: &dyn Backend, rows: usize) -> bool {
        backend.uses_megakernel() && bucket_for(rows).is_some()
    }

    /// Starts the graph on `feed` (each row's slot is its engine row) and enqueues its first
    /// replays. `budget` is how many replays can still produce a token anyone reads.
    pub fn start(
        backend: &dyn Backend,
        s: SessionMemory<'_>,
        feed: &[GraphRow],
        sampling: &SamplingParams,
        stop_tokens: &[u32],
        processor: Option<&LogitsProcessor>,
        budget: usize,
    ) -> Result<GraphRun, EngineError> {
        let bucket = bucket_for(feed.len()).expect("GraphRun::fits checked the row count");
        let emulation = CpuGraphInputs {
            processor,
            contexts: if backend.emulates_graph() {
                feed.iter()
                    .map(|f| [s.tokens[f.slot].as_slice(), &[f.token]].concat())
                    .collect()
            } else {
                Vec::new()
            },
        };
        s.dev
            .graph_start(bucket, feed, sampling, stop_tokens, emulation)?;
        let mut run = GraphRun {
            bucket,
            rows: feed.iter().map(|f| f.slot).collect(),
            pending: feed.iter().map(|f| Some((f.token, f.pos))).collect(),
            budget,
            in_flight: 0,
        };
        for _ in 0..DEPTH.min(budget) {
            s.dev.graph_enqueue(bucket)?;
            run.budget -= 1;
            run.in_flight += 1;
        }
        Ok(run)
    }

    /// Waits for the oldest replay, confirms the tokens it embedded into the session (cache
    /// length and token history), keeps the pipeline full, and returns each batch row's newly
    /// sampled token by engine row.
    pub fn next(&mut self, s: SessionMemory<'_>) -> Result<Vec<(usize, u32)>, EngineError> {
        let sampled = s.dev.graph_next(self.bucket)?;
        self.in_flight -= 1;
        if self.budget > 0 {
            s.dev.graph_enqueue(self.bucket)?;
            self.budget -= 1;
            self.in_flight += 1;
        }
        let mut out = Vec::with_capacity(self.rows.len());
        for (b, &r) in self.rows.iter().enumerate() {
            if let Some((token, pos)) = self.pending[b].take() {
                s.dev.set_len(r, pos + 1);
                s.tokens[r].push(token);
                out.push((r, sampled[b]));
            }
        }
        Ok(out)
    }

    /// Whether the graph's rows can go on: every row in `feed` is one of the graph's rows,
    /// embedding the token it just sampled.
    pub fn covers(&self, feed: &[GraphRow]) -> bool {
        feed.iter().all(|f| self.rows.contains(&f.slot))
    }

    /// Records what the next replay embeds: `feed` rows go on, the others have finished.
    pub fn feed(&mut self, feed: &[GraphRow]) {
        for (b, r) in self.rows.iter().enumerate() {
            self.pending[b] = feed.iter().find(|f| f.slot == *r).map(|f| (f.token, f.pos));
        }
    }

    /// Waits for the replays in flight and drops them. Tokens fed to the graph since the last
    /// consumed step are confirmed first (the oldest replay in flight embedded them, and it has
    /// finished once the graph has stopped), so the session caches exactly what the host path
    /// would have: every emitted token that was fed.
    pub fn stop(self, s: SessionMemory<'_>) -> Result<(), EngineError> {
        s.dev.graph_stop(self.bucket)?;
        if self.in_flight > 0 {
            for (b, &r) in self.rows.iter().enumerate() {
                if let Some((token, pos)) = self.pending[b] {
                    s.dev.set_len(r, pos + 1);
                    s.tokens[r].push(token);
                }
            }
        }
        Ok(())
    }
}

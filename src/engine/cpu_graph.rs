//! The decode graph's contract, run on the CPU: a stand-in for the CUDA graph decoder with the
//! same observable behaviour, so that the engine's pipelined decode (run-ahead, confirmation,
//! stop and restart around forced tool tokens, stop strings and limits) is tested on machines
//! without a GPU.
//!
//! Like the device, each queued step embeds the token the previous step sampled at the next
//! position, writes the cache past the lengths the engine has confirmed, and samples the next
//! token (Philox keyed by the engine row and the position the token takes); nothing but the
//! tokens reaches the engine until it consumes a step. Enabled only through the test entry point
//! `Engine::emulating_graph_decode_on_cpu` (on a CPU it buys no speed).

use std::collections::VecDeque;

use super::{EngineError, LogitsProcessor};
use crate::backend::cpu::{CpuBackend, Workspace};
use crate::backend::{GraphRow, TokenRow};
use crate::kv::KvCache;
use crate::plan::PlanKind;
use crate::sample::{self, SamplingParams};

#[derive(Default)]
pub(crate) struct CpuGraph {
    rows: Vec<GraphRow>,
    sampling: SamplingParams,
    /// Applied before sampling, as the host path does (the device has no such hook; the CPU
    /// stand-in takes it so that tests can script forced tool calls through the graph path).
    processor: Option<LogitsProcessor>,
    /// Per row: its tokens so far, including those of steps not consumed yet.
    contexts: Vec<Vec<u32>>,
    /// Sampled tokens of the steps run but not consumed yet, oldest first.
    queue: VecDeque<Vec<u32>>,
    logits: Vec<f32>,
}

impl CpuGraph {
    /// `contexts[b]`: row `b`'s tokens in the cache, followed by `rows[b].token`.
    pub fn start(
        &mut self,
        rows: &[GraphRow],
        sampling: &SamplingParams,
        processor: Option<&LogitsProcessor>,
        contexts: Vec<Vec<u32>>,
    ) {
        self.rows = rows.to_vec();
        self.sampling = *sampling;
        self.processor = processor.cloned();
        self.contexts = contexts;
        self.queue.clear();
    }

    /// Runs one step ahead: the cache is written past its confirmed lengths, which stay as
    /// they were.
    pub fn enqueue(
        &mut self,
        backend: &CpuBackend,
        kv: &mut KvCache,
        ws: &mut Workspace,
    ) -> Result<(), EngineError> {
        decode_ahead(backend, ws, kv, &self.rows, &mut self.logits)?;
        let vocab = backend.config().vocab_size;
        let mut next = Vec::with_capacity(self.rows.len());
        for (b, r) in self.rows.iter_mut().enumerate() {
            let logits = &mut self.logits[b * vocab..(b + 1) * vocab];
            if let Some(p) = &self.processor {
                (p.0)(r.row_id as usize, &self.contexts[b], logits);
            }
            let t = sample::sample(logits, &self.sampling, r.row_id, (r.pos + 1) as u64);
            self.contexts[b].push(t);
            r.token = t;
            r.pos += 1;
            next.push(t);
        }
        self.queue.push_back(next);
        Ok(())
    }

    pub fn next(&mut self) -> Vec<u32> {
        self.queue
            .pop_front()
            .expect("the engine consumes only steps it enqueued")
    }

    pub fn stop(&mut self) {
        self.queue.clear();
    }
}

/// One decode step of `rows` (each embedding its token at its position) written past the
/// slots' confirmed lengths, which stay as they were: what a decode graph's replay does to the
/// cache, on the CPU. Logits to `logits`, one row per graph row.
pub(super) fn decode_ahead(
    backend: &CpuBackend,
    ws: &mut Workspace,
    kv: &mut KvCache,
    rows: &[GraphRow],
    logits: &mut Vec<f32>,
) -> Result<(), EngineError> {
    if rows.is_empty() {
        return Ok(());
    }
    let confirmed: Vec<usize> = rows.iter().map(|r| kv.len(r.slot)).collect();
    for r in rows {
        kv.set_len(r.slot, r.pos);
    }
    let tokens: Vec<u32> = rows.iter().map(|r| r.token).collect();
    let token_rows: Vec<TokenRow> = rows
        .iter()
        .map(|r| TokenRow {
            slot: r.slot,
            pos: r.pos,
        })
        .collect();
    let res = backend.forward(PlanKind::Decode, ws, kv, &tokens, &token_rows, logits);
    for (r, len) in rows.iter().zip(confirmed) {
        kv.set_len(r.slot, len);
    }
    res?;
    Ok(())
}

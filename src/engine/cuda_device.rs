//! The CUDA backend as an engine's device: decode kernel by kernel or through the
//! graph-replayed megakernel, sampling on the device.
//!
//! Ran on an H200 (docs/gpu-results.md): `tests/gpu_engine.rs` passes, the CPU, per-op and
//! megakernel engines generating the same tokens (up to near ties, which the tests print) on
//! every fixture directory (64 tokens) and on 256 SmolLM2 tokens with 2, 3 and 8 rows at once,
//! and seeded sampling reproducing across runs. `tests/gpu.rs`, `tests/gpu_engine.rs` and
//! `scripts/gpu-check.sh` are the checks for a GPU machine.

use std::sync::Arc;

use super::backend::{Backend, Caches, CpuGraphInputs, ServingPool, GRAPH_REACH};
use super::EngineError;
use crate::backend::cuda::trace::traced;
use crate::backend::cuda::{CudaBackend, CudaError, CudaKvCache, CudaWorkspace, GraphDecoder};
use crate::backend::{ExecError, GraphRow, RowDraw, TokenRow};
use crate::kv::{KvBudget, KvCache, KvOptions};
use crate::model::ModelConfig;
use crate::plan::{ExecutionPlan, PlanKind};
use crate::sample::SamplingParams;

pub(crate) struct CudaDevice {
    backend: Arc<CudaBackend>,
    /// Decode through the megakernel (checked to lower at load).
    megakernel: bool,
}

impl CudaDevice {
    pub fn new(backend: CudaBackend, megakernel: bool) -> CudaDevice {
        CudaDevice {
            backend: Arc::new(backend),
            megakernel,
        }
    }
}

impl Backend for CudaDevice {
    fn config(&self) -> &ModelConfig {
        self.backend.config()
    }

    fn plan(&self, kind: PlanKind) -> &ExecutionPlan {
        self.backend.plan(kind)
    }

    fn weight_bytes(&self) -> usize {
        self.backend.weight_bytes()
    }

    fn describe(&self) -> String {
        format!(
            "CUDA {} ({} decode)",
            self.backend.info(),
            if self.megakernel {
                "megakernel"
            } else {
                "per-op"
            }
        )
    }

    fn new_caches(&self, slots: usize, capacity: usize) -> Box<dyn Caches> {
        Box::new(CudaCaches {
            graphs: Vec::new(),
            first_step: false,
            slots,
            capacity,
            kv: None,
            ws: CudaWorkspace::new(),
            backend: Arc::clone(&self.backend),
        })
    }

    fn new_pool(
        &self,
        _opts: KvOptions,
        budget: KvBudget,
        capacity: usize,
    ) -> Result<Box<dyn ServingPool>, EngineError> {
        let kv = traced(
            || format!("serving pool of {budget:?}"),
            || self.backend.new_pool(budget, capacity),
        )?;
        Ok(Box::new(CudaPool {
            graphs: Vec::new(),
            running: None,
            kv,
            ws: CudaWorkspace::new(),
            backend: Arc::clone(&self.backend),
            megakernel: self.megakernel,
        }))
    }

    fn uses_megakernel(&self) -> bool {
        self.megakernel
    }

    fn cuda(&self) -> Option<&CudaBackend> {
        Some(&self.backend)
    }
}

/// A scheduler's pool on the GPU: the device blocks of [`CudaBackend::new_pool`] with the host
/// bookkeeping beside them. Steps run kernel by kernel with logits to the host (the scheduler
/// samples there, with each row's own rules), and on a megakernel engine decode phases run
/// through the pool's own decode graphs (one per bucket, captured on first use and restarted
/// without re-capture), rows taking blocks [`GRAPH_REACH`] positions ahead of where they write.
/// On an H200 (docs/gpu-results.md run 10) the scheduler's GPU test passed over it, per-op and
/// through the megakernel (prefix hits, preemptions, n-gram and draft speculation, graph phases
/// with blocks taken as rows advance). A graph start that found the pool short failed a run
/// there; `pool_refusal` answers it since (`tests/gpu_engine.rs::serving_bench_in_an_exactly_sized_pool_completes_on_the_gpu`
/// passed on an H200 in run 11 and an H100 in run 12). The same scheduler phases run
/// on the CPU through `cpu_pool.rs`'s stand-in.
///
/// Fields drop in order: the graphs (whose drop waits for replays in flight) before the cache
/// they write, and both before the backend whose weights and stream they use.
struct CudaPool {
    graphs: Vec<GraphDecoder>,
    /// The bucket of the started graph, if one is started.
    running: Option<usize>,
    kv: CudaKvCache,
    ws: CudaWorkspace,
    backend: Arc<CudaBackend>,
    megakernel: bool,
}

impl CudaPool {
    /// The index in `graphs` of the decode graph for `bucket` rows over this pool, captured on
    /// first use.
    fn graph(&mut self, bucket: usize) -> Result<usize, EngineError> {
        if let Some(i) = self.graphs.iter().position(|g| g.bucket() == bucket) {
            return Ok(i);
        }
        let (backend, kv) = (&self.backend, &self.kv);
        // SAFETY: the decoder lives in this pool beside the `Arc` of its backend and is dropped
        // first (field order), so the backend outlives it.
        let mut g = traced(
            || format!("graph serving b{bucket} new (module, buffers, capture)"),
            || unsafe { GraphDecoder::new(backend, kv, bucket) },
        )?;
        g.set_reach(Some(GRAPH_REACH));
        self.graphs.push(g);
        Ok(self.graphs.len() - 1)
    }

    /// The index in `graphs` of the started graph.
    fn started(&self) -> Result<usize, EngineError> {
        let bucket = self
            .running
            .ok_or_else(|| EngineError::Request("no decode graph is started".into()))?;
        Ok(self
            .graphs
            .iter()
            .position(|g| g.bucket() == bucket)
            .expect("a started graph was captured"))
    }
}

/// A decode-graph call's error as the scheduler needs it: the pool's refusal (no free block,
/// the capacity passed) as `EngineError::Kv`, which it answers by stopping the graph and
/// preempting on the host path; anything else as the device's error. Why: on an H200 a graph
/// start that found too few blocks ended `kiln-bench --concurrency 8` with "all 40 blocks are
/// in use" (docs/gpu-results.md, run 10), where the CPU's stand-in preempted.
fn pool_refusal(e: CudaError) -> EngineError {
    match e {
        CudaError::Exec(ExecError::Kv(e)) => EngineError::Kv(e),
        e => EngineError::Cuda(e),
    }
}

impl ServingPool for CudaPool {
    fn tables(&self) -> &KvCache {
        self.kv.tables()
    }

    fn tables_mut(&mut self) -> &mut KvCache {
        self.kv.tables_mut()
    }

    fn prepare(&mut self, slot: usize, end: usize) -> Result<(), EngineError> {
        Ok(self.kv.prepare(&self.backend, slot, end)??)
    }

    fn has_graph(&self) -> bool {
        self.megakernel
    }

    fn graph_start(
        &mut self,
        bucket: usize,
        rows: &[GraphRow],
        sampling: &[SamplingParams],
    ) -> Result<(), EngineError> {
        if self.running.is_some() {
            let i = self.started()?;
            self.running = None;
            self.graphs[i].stop()?;
        }
        let i = self.graph(bucket)?;
        let (g, kv) = (&mut self.graphs[i], &mut self.kv);
        traced(
            || format!("graph serving b{bucket} start ({} rows)", rows.len()),
            || g.start_rows(kv, rows, sampling, &[]),
        )
        .map_err(pool_refusal)?;
        self.running = Some(bucket);
        Ok(())
    }

    fn graph_leave(&mut self, b: usize) -> Result<(), EngineError> {
        let i = self.started()?;
        Ok(self.graphs[i].leave(b)?)
    }

    fn graph_enqueue(&mut self) -> Result<(), EngineError> {
        let i = self.started()?;
        self.graphs[i]
            .enqueue_in(&mut self.kv)
            .map_err(pool_refusal)
    }

    fn graph_next(&mut self) -> Result<Vec<Option<u32>>, EngineError> {
        let i = self.started()?;
        Ok(self.graphs[i].next()?.rows)
    }

    fn graph_stop(&mut self) -> Result<(), EngineError> {
        if self.running.is_some() {
            let i = self.started()?;
            self.running = None;
            let g = &mut self.graphs[i];
            let bucket = g.bucket();
            traced(|| format!("graph serving b{bucket} stop"), || g.stop())?;
        }
        Ok(())
    }

    fn draws_on_device(&self) -> bool {
        true
    }

    fn forward_draw(
        &mut self,
        kind: PlanKind,
        tokens: &[u32],
        rows: &[TokenRow],
        draws: &[RowDraw<'_>],
    ) -> Result<Option<Vec<u32>>, EngineError> {
        let (b, ws, kv) = (&self.backend, &mut self.ws, &mut self.kv);
        Ok(Some(b.forward_draw(kind, ws, kv, tokens, rows, draws)?))
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

/// A session's memory on the GPU. Fields drop in order: the decode graphs (whose drop waits
/// for replays in flight) before the cache they write and the backend whose weights they read.
struct CudaCaches {
    /// One captured decode graph per bucket used so far.
    graphs: Vec<GraphDecoder>,
    /// Whether the next `graph_next` is the first since a start (for `KILN_TRACE_CUDA`).
    first_step: bool,
    slots: usize,
    capacity: usize,
    /// Allocated on first use with the slots rounded up to a graph bucket (padding rows of the
    /// megakernel need slots of their own).
    kv: Option<CudaKvCache>,
    ws: CudaWorkspace,
    backend: Arc<CudaBackend>,
}

impl Drop for CudaCaches {
    /// The field order's teardown (graphs, whose drop waits for replays in flight, then the
    /// cache), timed under `KILN_TRACE_CUDA`.
    fn drop(&mut self) {
        let (n, graphs) = (self.graphs.len(), &mut self.graphs);
        traced(
            || format!("graph teardown of {n} graphs"),
            || graphs.clear(),
        );
        let kv = &mut self.kv;
        traced(|| "graph cache free".to_string(), || drop(kv.take()));
    }
}

impl CudaCaches {
    /// The cache (allocated on first use) and the workspace, borrowed together.
    fn parts(&mut self) -> Result<(&mut CudaKvCache, &mut CudaWorkspace), EngineError> {
        if self.kv.is_none() {
            let slots = kiln_codegen::bucket_for(self.slots).unwrap_or(self.slots);
            let (backend, capacity) = (&self.backend, self.capacity);
            let kv = traced(
                || format!("graph cache of {slots} slots x {capacity} positions"),
                || backend.new_cache(slots, capacity),
            )?;
            self.kv = Some(kv);
        }
        Ok((self.kv.as_mut().expect("allocated above"), &mut self.ws))
    }

    /// The session's decode graph for `bucket` rows, captured on first use, with the cache it
    /// writes.
    fn graph(
        &mut self,
        bucket: usize,
    ) -> Result<(&mut GraphDecoder, &mut CudaKvCache), EngineError> {
        self.parts()?;
        let kv = self.kv.as_mut().expect("allocated above");
        let i = match self.graphs.iter().position(|g| g.bucket() == bucket) {
            Some(i) => i,
            None => {
                // SAFETY: the decoder lives in these caches beside the `Arc` of its backend,
                // and is dropped first (field order), so the backend outlives it.
                let backend = &self.backend;
                let g = traced(
                    || format!("graph b{bucket} new (module, buffers, capture)"),
                    || unsafe { GraphDecoder::new(backend, kv, bucket) },
                )?;
                self.graphs.push(g);
                self.graphs.len() - 1
            }
        };
        Ok((&mut self.graphs[i], kv))
    }
}

impl Caches for CudaCaches {
    fn len(&self, slot: usize) -> usize {
        self.kv.as_ref().map_or(0, |kv| kv.len(slot))
    }

    fn capacity(&self) -> usize {
        self.capacity
    }

    fn slots(&self) -> usize {
        self.slots
    }

    fn truncate(&mut self, slot: usize, len: usize) {
        if let Some(kv) = self.kv.as_mut() {
            kv.truncate(slot, len)
        }
    }

    fn set_len(&mut self, slot: usize, len: usize) {
        if let Some(kv) = self.kv.as_mut() {
            kv.set_len(slot, len)
        }
    }

    fn copy_slot(&mut self, from: usize, to: usize, len: usize) -> Result<(), EngineError> {
        let backend = Arc::clone(&self.backend);
        let (kv, _) = self.parts()?;
        Ok(kv.copy_slot(&backend, from, to, len)?)
    }

    fn forward(
        &mut self,
        kind: PlanKind,
        tokens: &[u32],
        rows: &[TokenRow],
        logits: &mut Vec<f32>,
    ) -> Result<usize, EngineError> {
        let backend = Arc::clone(&self.backend);
        let (kv, ws) = self.parts()?;
        Ok(backend.forward(kind, ws, kv, tokens, rows, logits)?)
    }

    fn forward_sample(
        &mut self,
        tokens: &[u32],
        rows: &[TokenRow],
        sampling: &SamplingParams,
        row_ids: &[u32],
    ) -> Result<Option<Vec<u32>>, EngineError> {
        let backend = Arc::clone(&self.backend);
        let (kv, ws) = self.parts()?;
        Ok(Some(backend.forward_sample(
            PlanKind::Decode,
            ws,
            kv,
            tokens,
            rows,
            sampling,
            row_ids,
        )?))
    }

    fn forward_draw(
        &mut self,
        tokens: &[u32],
        rows: &[TokenRow],
        draws: &[RowDraw<'_>],
    ) -> Result<Option<Vec<u32>>, EngineError> {
        let backend = Arc::clone(&self.backend);
        let (kv, ws) = self.parts()?;
        Ok(Some(backend.forward_draw(
            PlanKind::Decode,
            ws,
            kv,
            tokens,
            rows,
            draws,
        )?))
    }

    fn graph_start(
        &mut self,
        bucket: usize,
        rows: &[GraphRow],
        sampling: &SamplingParams,
        stop_tokens: &[u32],
        _emulation: CpuGraphInputs<'_>,
    ) -> Result<(), EngineError> {
        self.first_step = true;
        let (g, kv) = self.graph(bucket)?;
        traced(
            || format!("graph b{bucket} start ({} rows)", rows.len()),
            || g.start(kv, rows, sampling, stop_tokens),
        )?;
        Ok(())
    }

    fn graph_enqueue(&mut self, bucket: usize) -> Result<(), EngineError> {
        Ok(self.graph(bucket)?.0.enqueue()?)
    }

    fn graph_next(&mut self, bucket: usize) -> Result<Vec<u32>, EngineError> {
        let first = std::mem::take(&mut self.first_step);
        let g = self.graph(bucket)?.0;
        if first {
            let step = traced(
                || format!("graph b{bucket} first step after start"),
                || g.next(),
            )?;
            return Ok(step.tokens);
        }
        Ok(g.next()?.tokens)
    }

    fn graph_stop(&mut self, bucket: usize) -> Result<(), EngineError> {
        let g = self.graph(bucket)?.0;
        traced(|| format!("graph b{bucket} stop"), || g.stop())?;
        Ok(())
    }
}

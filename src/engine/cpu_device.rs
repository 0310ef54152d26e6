//! The CPU backend as an engine's device: each session's cache is made on first use, and decode
//! can run through [`CpuGraph`], the CPU stand-in for the CUDA decode graph (tests).

use std::sync::Arc;

use super::backend::{Backend, Caches, CpuGraphInputs, ServingPool};
use super::cpu_graph::CpuGraph;
use super::cpu_pool::{draw_on_host, CpuPool};
use super::EngineError;
use crate::backend::cpu::{CpuBackend, Workspace};
use crate::backend::{GraphRow, RowDraw, TokenRow};
use crate::kv::{KvBudget, KvCache, KvDtype, KvOptions};
use crate::model::ModelConfig;
use crate::plan::{ExecutionPlan, PlanKind};
use crate::sample::SamplingParams;

pub(crate) struct CpuDevice {
    backend: Arc<CpuBackend>,
    /// Decode through [`CpuGraph`], the CPU stand-in for the decode graph (tests).
    emulate_graph: bool,
    /// Storage type of sessions' caches.
    kv_dtype: KvDtype,
}

impl CpuDevice {
    pub fn new(backend: CpuBackend, emulate_graph: bool, kv_dtype: KvDtype) -> CpuDevice {
        CpuDevice {
            backend: Arc::new(backend),
            emulate_graph,
            kv_dtype,
        }
    }
}

impl Backend for CpuDevice {
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
        format!("CPU ({} threads)", self.backend.threads())
    }

    fn new_caches(&self, slots: usize, capacity: usize) -> Box<dyn Caches> {
        Box::new(CpuCaches {
            backend: Arc::clone(&self.backend),
            kv: CpuCache {
                slots,
                capacity,
                dtype: self.kv_dtype,
                kv: None,
            },
            ws: Workspace::new(),
            graph: CpuGraph::default(),
            emulate: self.emulate_graph,
            draw_logits: Vec::new(),
        })
    }

    fn new_pool(
        &self,
        opts: KvOptions,
        budget: KvBudget,
        capacity: usize,
    ) -> Result<Box<dyn ServingPool>, EngineError> {
        let kv = self.backend.new_pool(opts, budget, capacity)?;
        Ok(Box::new(CpuPool::new(
            kv,
            Arc::clone(&self.backend),
            self.emulate_graph,
        )))
    }

    fn emulates_graph(&self) -> bool {
        self.emulate_graph
    }

    fn uses_megakernel(&self) -> bool {
        self.emulate_graph
    }

    fn cpu(&self) -> Option<&CpuBackend> {
        Some(&self.backend)
    }
}

/// A session's memory on the CPU.
struct CpuCaches {
    backend: Arc<CpuBackend>,
    kv: CpuCache,
    ws: Workspace,
    graph: CpuGraph,
    /// Whether the engine emulates the device (the decode graph and the device's draws).
    emulate: bool,
    /// Logits of the stand-in's draws.
    draw_logits: Vec<f32>,
}

/// A session's CPU cache, made on first use (like the device's), so that creating a session
/// cannot fail.
struct CpuCache {
    slots: usize,
    capacity: usize,
    dtype: KvDtype,
    kv: Option<KvCache>,
}

impl CpuCache {
    fn get(&mut self, backend: &CpuBackend) -> Result<&mut KvCache, EngineError> {
        let kv = match self.kv.take() {
            Some(kv) => kv,
            None => backend.new_cache_of(self.dtype, self.slots, self.capacity)?,
        };
        Ok(self.kv.insert(kv))
    }
}

impl Caches for CpuCaches {
    fn len(&self, slot: usize) -> usize {
        self.kv.kv.as_ref().map_or(0, |kv| kv.len(slot))
    }

    fn capacity(&self) -> usize {
        self.kv.capacity
    }

    fn slots(&self) -> usize {
        self.kv.slots
    }

    fn truncate(&mut self, slot: usize, len: usize) {
        if let Some(kv) = self.kv.kv.as_mut() {
            kv.truncate(slot, len)
        }
    }

    fn set_len(&mut self, slot: usize, len: usize) {
        if let Some(kv) = self.kv.kv.as_mut() {
            kv.set_len(slot, len)
        }
    }

    fn copy_slot(&mut self, from: usize, to: usize, len: usize) -> Result<(), EngineError> {
        self.kv.get(&self.backend)?.copy_slot(from, to, len);
        Ok(())
    }

    fn forward(
        &mut self,
        kind: PlanKind,
        tokens: &[u32],
        rows: &[TokenRow],
        logits: &mut Vec<f32>,
    ) -> Result<usize, EngineError> {
        let kv = self.kv.get(&self.backend)?;
        Ok(self
            .backend
            .forward(kind, &mut self.ws, kv, tokens, rows, logits)?)
    }

    fn forward_sample(
        &mut self,
        _tokens: &[u32],
        _rows: &[TokenRow],
        _sampling: &SamplingParams,
        _row_ids: &[u32],
    ) -> Result<Option<Vec<u32>>, EngineError> {
        // The CPU samples on the host, from the logits of `forward`.
        Ok(None)
    }

    /// On an engine that emulates the decode graph, the device's masked draws stood in for
    /// (so the session's device path for constrained rows is tested without a GPU); else none.
    fn forward_draw(
        &mut self,
        tokens: &[u32],
        rows: &[TokenRow],
        draws: &[RowDraw<'_>],
    ) -> Result<Option<Vec<u32>>, EngineError> {
        if !self.emulate {
            return Ok(None);
        }
        let kv = self.kv.get(&self.backend)?;
        let (b, ws) = (&self.backend, &mut self.ws);
        let kind = PlanKind::Decode;
        draw_on_host(b, ws, kv, kind, tokens, rows, draws, &mut self.draw_logits).map(Some)
    }

    fn graph_start(
        &mut self,
        _bucket: usize,
        rows: &[GraphRow],
        sampling: &SamplingParams,
        _stop_tokens: &[u32],
        emulation: CpuGraphInputs<'_>,
    ) -> Result<(), EngineError> {
        self.graph
            .start(rows, sampling, emulation.processor, emulation.contexts);
        Ok(())
    }

    fn graph_enqueue(&mut self, _bucket: usize) -> Result<(), EngineError> {
        let kv = self.kv.get(&self.backend)?;
        self.graph.enqueue(&self.backend, kv, &mut self.ws)
    }

    fn graph_next(&mut self, _bucket: usize) -> Result<Vec<u32>, EngineError> {
        Ok(self.graph.next())
    }

    fn graph_stop(&mut self, _bucket: usize) -> Result<(), EngineError> {
        self.graph.stop();
        Ok(())
    }
}

//! Where an engine runs, and the per-session memory of that place.
//!
//! The engine and its sessions see one interface — a cache with slots and lengths, and a
//! forward pass — whether the model runs on the CPU backend or (feature `cuda`) on the CUDA
//! backend, where decode goes kernel by kernel ([`DecodePath::PerOp`]) or through the
//! graph-replayed megakernel ([`DecodePath::Megakernel`], driven by `stream.rs`).
//!
//! The CUDA arms are UNVERIFIED on a GPU: they compile, and the machines they were written on
//! have none. `tests/gpu.rs` and `scripts/gpu-check.sh` are the checks for a GPU machine.

use crate::backend::cpu::{CpuBackend, CpuOptions, Workspace};
use crate::backend::TokenRow;
use crate::kv::{KvCache, KvDtype};
use crate::model::{Model, ModelConfig};
use crate::plan::ExecutionPlan;
use crate::plan::PlanKind;
use crate::sample::SamplingParams;

use super::cpu_graph::CpuGraph;
use super::{EngineError, LogitsProcessor};
use crate::backend::cuda::GraphRow;

#[cfg(feature = "cuda")]
use crate::backend::cuda::{CudaBackend, CudaKvCache, CudaWorkspace, GraphDecoder};

/// Which backend an engine asks for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Device {
    /// The CPU backend.
    #[default]
    Cpu,
    /// The CUDA backend; loading fails if it cannot start.
    Cuda,
    /// CUDA when a GPU, driver and NVRTC are usable, else the CPU (the reason is kept in
    /// [`super::Engine::fallback_reason`]).
    Auto,
}

/// How a CUDA engine runs decode steps.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DecodePath {
    /// The megakernel where the model lowers to it, else kernel by kernel.
    #[default]
    Auto,
    /// One kernel per plan instruction (prefill always runs this way).
    PerOp,
    /// One generated persistent kernel per step, replayed as a CUDA graph; loading fails if the
    /// model does not lower to it.
    Megakernel,
}

#[derive(Clone, Copy, Debug, Default)]
pub struct EngineOptions {
    pub device: Device,
    pub decode: DecodePath,
    /// The CPU backend's options (also used when `Auto` falls back to the CPU).
    pub cpu: CpuOptions,
    /// How sessions' KV caches store keys and values on the CPU (default f32, exact). The
    /// CUDA backend keeps bf16.
    pub kv_dtype: KvDtype,
    /// Decode on the CPU through the stand-in for the CUDA decode graph, which runs ahead of
    /// the engine as the device does (tests of the engine's pipelined decode; no speed gain).
    #[doc(hidden)]
    pub emulate_graph_on_cpu: bool,
}

impl From<CpuOptions> for EngineOptions {
    fn from(cpu: CpuOptions) -> EngineOptions {
        EngineOptions {
            cpu,
            ..EngineOptions::default()
        }
    }
}

/// The compiled model on its device (one per engine, so the variants' sizes do not matter).
#[allow(clippy::large_enum_variant)]
pub(crate) enum Backend {
    Cpu {
        backend: CpuBackend,
        /// Decode through [`CpuGraph`], the CPU stand-in for the decode graph (tests).
        emulate_graph: bool,
        /// Storage type of sessions' caches.
        kv_dtype: KvDtype,
    },
    #[cfg(feature = "cuda")]
    Cuda {
        backend: Box<CudaBackend>,
        /// Decode through the megakernel (checked to lower at load).
        megakernel: bool,
    },
}

/// What [`Backend::start`] produced, and why the CPU was chosen if it was.
pub(crate) struct Started {
    pub backend: Backend,
    pub fallback: Option<String>,
}

impl Backend {
    pub fn start(model: &Model, opts: EngineOptions) -> Result<Started, EngineError> {
        let cpu = |fallback| -> Result<Started, EngineError> {
            Ok(Started {
                backend: Backend::Cpu {
                    backend: CpuBackend::new(&model.config, &model.weights, opts.cpu)?,
                    emulate_graph: opts.emulate_graph_on_cpu,
                    kv_dtype: opts.kv_dtype,
                },
                fallback,
            })
        };
        match opts.device {
            Device::Cpu => cpu(None),
            #[cfg(feature = "cuda")]
            Device::Cuda | Device::Auto => match Backend::start_cuda(model, opts.decode) {
                Ok(backend) => Ok(Started {
                    backend,
                    fallback: None,
                }),
                Err(e) if opts.device == Device::Auto => cpu(Some(e.to_string())),
                Err(e) => Err(e),
            },
            #[cfg(not(feature = "cuda"))]
            Device::Cuda => Err(EngineError::NoCuda(
                "this kiln was built without the `cuda` cargo feature".into(),
            )),
            #[cfg(not(feature = "cuda"))]
            Device::Auto => cpu(Some("built without the `cuda` cargo feature".into())),
        }
    }

    #[cfg(feature = "cuda")]
    fn start_cuda(model: &Model, decode: DecodePath) -> Result<Backend, EngineError> {
        let backend = CudaBackend::new(&model.config, &model.weights)?;
        let megakernel = match decode {
            DecodePath::PerOp => false,
            DecodePath::Megakernel => {
                backend.supports_megakernel()?;
                true
            }
            DecodePath::Auto => backend.supports_megakernel().is_ok(),
        };
        Ok(Backend::Cuda {
            backend: Box::new(backend),
            megakernel,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        match self {
            Backend::Cpu { backend: b, .. } => b.config(),
            #[cfg(feature = "cuda")]
            Backend::Cuda { backend, .. } => backend.config(),
        }
    }

    pub fn plan(&self, kind: PlanKind) -> &ExecutionPlan {
        match self {
            Backend::Cpu { backend: b, .. } => b.plan(kind),
            #[cfg(feature = "cuda")]
            Backend::Cuda { backend, .. } => backend.plan(kind),
        }
    }

    /// Bytes the weights occupy where they run.
    pub fn weight_bytes(&self) -> usize {
        match self {
            Backend::Cpu { backend: b, .. } => b.weight_bytes(),
            #[cfg(feature = "cuda")]
            Backend::Cuda { backend, .. } => backend.weight_bytes(),
        }
    }

    /// One line naming the device and the decode path.
    pub fn describe(&self) -> String {
        match self {
            Backend::Cpu { backend: b, .. } => format!("CPU ({} threads)", b.threads()),
            #[cfg(feature = "cuda")]
            Backend::Cuda {
                backend,
                megakernel,
            } => format!(
                "CUDA {} ({} decode)",
                backend.info(),
                if *megakernel { "megakernel" } else { "per-op" }
            ),
        }
    }

    /// Empty session memory for `slots` rows of `capacity` positions (device memory is taken on
    /// first use, so that creating a session cannot fail).
    pub fn new_caches(&self, slots: usize, capacity: usize) -> Caches {
        match self {
            Backend::Cpu { kv_dtype, .. } => Caches::Cpu {
                kv: CpuCache {
                    slots,
                    capacity,
                    dtype: *kv_dtype,
                    kv: None,
                },
                ws: Workspace::new(),
                graph: CpuGraph::default(),
            },
            #[cfg(feature = "cuda")]
            Backend::Cuda { .. } => Caches::Cuda(Box::new(CudaCaches {
                slots,
                capacity,
                kv: None,
                ws: CudaWorkspace::new(),
                graphs: Vec::new(),
            })),
        }
    }

    /// Runs one step on `caches`, logits to the host.
    pub fn forward(
        &self,
        kind: PlanKind,
        caches: &mut Caches,
        tokens: &[u32],
        rows: &[TokenRow],
        logits: &mut Vec<f32>,
    ) -> Result<usize, EngineError> {
        match (self, caches) {
            (Backend::Cpu { backend: b, .. }, Caches::Cpu { kv, ws, .. }) => {
                Ok(b.forward(kind, ws, kv.get(b)?, tokens, rows, logits)?)
            }
            #[cfg(feature = "cuda")]
            (Backend::Cuda { backend, .. }, Caches::Cuda(c)) => {
                let (kv, ws) = c.parts(backend)?;
                Ok(backend.forward(kind, ws, kv, tokens, rows, logits)?)
            }
            #[cfg(feature = "cuda")]
            _ => unreachable!("a session's caches come from its engine's backend"),
        }
    }

    /// Whether decode steps can sample on the device (only the tokens come back).
    pub fn samples_on_device(&self) -> bool {
        match self {
            Backend::Cpu { .. } => false,
            #[cfg(feature = "cuda")]
            Backend::Cuda { .. } => true,
        }
    }

    /// Whether this is the CPU stand-in for the decode graph, which can apply a logits
    /// processor (tests script tool calls through it).
    pub fn emulates_graph(&self) -> bool {
        matches!(
            self,
            Backend::Cpu {
                emulate_graph: true,
                ..
            }
        )
    }

    /// Whether decode runs through the graph-replayed megakernel.
    pub fn uses_megakernel(&self) -> bool {
        match self {
            Backend::Cpu { emulate_graph, .. } => *emulate_graph,
            #[cfg(feature = "cuda")]
            Backend::Cuda { megakernel, .. } => *megakernel,
        }
    }

    /// A decode step with sampling on the device: returns one token per row. Only for backends
    /// where [`Backend::samples_on_device`] holds.
    pub fn forward_sample(
        &self,
        caches: &mut Caches,
        tokens: &[u32],
        rows: &[TokenRow],
        sampling: &SamplingParams,
        row_ids: &[u32],
    ) -> Result<Vec<u32>, EngineError> {
        match (self, caches) {
            #[cfg(feature = "cuda")]
            (Backend::Cuda { backend, .. }, Caches::Cuda(c)) => {
                let (kv, ws) = c.parts(backend)?;
                Ok(backend.forward_sample(
                    PlanKind::Decode,
                    ws,
                    kv,
                    tokens,
                    rows,
                    sampling,
                    row_ids,
                )?)
            }
            _ => {
                let _ = (tokens, rows, sampling, row_ids);
                unreachable!("forward_sample is only called when samples_on_device() holds")
            }
        }
    }
}

/// A session's memory on its engine's device (one per session).
#[allow(clippy::large_enum_variant)]
pub(crate) enum Caches {
    Cpu {
        kv: CpuCache,
        ws: Workspace,
        graph: CpuGraph,
    },
    #[cfg(feature = "cuda")]
    Cuda(Box<CudaCaches>),
}

/// A session's CPU cache, made on first use (like the device's), so that creating a session
/// cannot fail.
pub(crate) struct CpuCache {
    slots: usize,
    capacity: usize,
    dtype: KvDtype,
    kv: Option<KvCache>,
}

impl CpuCache {
    pub fn get(&mut self, backend: &CpuBackend) -> Result<&mut KvCache, EngineError> {
        let kv = match self.kv.take() {
            Some(kv) => kv,
            None => backend.new_cache_of(self.dtype, self.slots, self.capacity)?,
        };
        Ok(self.kv.insert(kv))
    }

    pub fn made(&self) -> Option<&KvCache> {
        self.kv.as_ref()
    }

    pub fn made_mut(&mut self) -> Option<&mut KvCache> {
        self.kv.as_mut()
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn slots(&self) -> usize {
        self.slots
    }
}

#[cfg(feature = "cuda")]
pub(crate) struct CudaCaches {
    slots: usize,
    capacity: usize,
    /// Allocated on first use with the slots rounded up to a graph bucket (padding rows of the
    /// megakernel need slots of their own).
    kv: Option<CudaKvCache>,
    ws: CudaWorkspace,
    /// One captured decode graph per bucket used so far.
    graphs: Vec<GraphDecoder>,
}

#[cfg(feature = "cuda")]
impl CudaCaches {
    pub fn kv(&mut self, backend: &CudaBackend) -> Result<&mut CudaKvCache, EngineError> {
        Ok(self.parts(backend)?.0)
    }

    /// The cache (allocated on first use) and the workspace, borrowed together.
    pub fn parts(
        &mut self,
        backend: &CudaBackend,
    ) -> Result<(&mut CudaKvCache, &mut CudaWorkspace), EngineError> {
        if self.kv.is_none() {
            let slots = kiln_codegen::bucket_for(self.slots).unwrap_or(self.slots);
            self.kv = Some(backend.new_cache(slots, self.capacity)?);
        }
        Ok((self.kv.as_mut().expect("allocated above"), &mut self.ws))
    }

    /// The session's decode graph for `bucket` rows, captured on first use, with the cache it
    /// writes.
    pub fn graph(
        &mut self,
        backend: &CudaBackend,
        bucket: usize,
    ) -> Result<(&mut GraphDecoder, &mut CudaKvCache), EngineError> {
        self.kv(backend)?;
        let kv = self.kv.as_mut().expect("allocated above");
        let i = match self.graphs.iter().position(|g| g.bucket() == bucket) {
            Some(i) => i,
            None => {
                // SAFETY: the decoder lives in a session's caches, which the session drops
                // before its `Arc<Engine>` (field order in `Session`), so the backend outlives it.
                self.graphs
                    .push(unsafe { GraphDecoder::new(backend, kv, bucket) }?);
                self.graphs.len() - 1
            }
        };
        Ok((&mut self.graphs[i], kv))
    }
}

impl Caches {
    pub fn len(&self, slot: usize) -> usize {
        match self {
            Caches::Cpu { kv, .. } => kv.made().map_or(0, |kv| kv.len(slot)),
            #[cfg(feature = "cuda")]
            Caches::Cuda(c) => c.kv.as_ref().map_or(0, |kv| kv.len(slot)),
        }
    }

    pub fn capacity(&self) -> usize {
        match self {
            Caches::Cpu { kv, .. } => kv.capacity(),
            #[cfg(feature = "cuda")]
            Caches::Cuda(c) => c.capacity,
        }
    }

    /// Slots the session asked for (a CUDA cache may hold more, for padding rows).
    pub fn slots(&self) -> usize {
        match self {
            Caches::Cpu { kv, .. } => kv.slots(),
            #[cfg(feature = "cuda")]
            Caches::Cuda(c) => c.slots,
        }
    }

    /// Forgets positions from `len` on.
    pub fn truncate(&mut self, slot: usize, len: usize) {
        match self {
            Caches::Cpu { kv, .. } => {
                if let Some(kv) = kv.made_mut() {
                    kv.truncate(slot, len)
                }
            }
            #[cfg(feature = "cuda")]
            Caches::Cuda(c) => {
                if let Some(kv) = c.kv.as_mut() {
                    kv.truncate(slot, len)
                }
            }
        }
    }

    /// Makes slot `to` hold slot `from`'s first `len` positions.
    pub fn copy_slot(
        &mut self,
        backend: &Backend,
        from: usize,
        to: usize,
        len: usize,
    ) -> Result<(), EngineError> {
        match (self, backend) {
            (Caches::Cpu { kv, .. }, Backend::Cpu { backend, .. }) => {
                kv.get(backend)?.copy_slot(from, to, len);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            (Caches::Cuda(c), Backend::Cuda { backend, .. }) => {
                let kv = c.kv(backend)?;
                Ok(kv.copy_slot(backend, from, to, len)?)
            }
            #[cfg(feature = "cuda")]
            _ => unreachable!("a session's caches come from its engine's backend"),
        }
    }

    /// Sets a slot's confirmed length (positions a graph step wrote, once consumed).
    pub fn set_len(&mut self, slot: usize, len: usize) {
        match self {
            Caches::Cpu { kv, .. } => {
                if let Some(kv) = kv.made_mut() {
                    kv.set_len(slot, len)
                }
            }
            #[cfg(feature = "cuda")]
            Caches::Cuda(c) => {
                if let Some(kv) = c.kv.as_mut() {
                    kv.set_len(slot, len)
                }
            }
        }
    }

    /// Starts the decode graph of `bucket` rows on `rows` (nothing runs until enqueued).
    pub fn graph_start(
        &mut self,
        backend: &Backend,
        bucket: usize,
        rows: &[GraphRow],
        sampling: &SamplingParams,
        stop_tokens: &[u32],
        emulation: CpuGraphInputs<'_>,
    ) -> Result<(), EngineError> {
        match (self, backend) {
            (Caches::Cpu { graph, .. }, _) => {
                let _ = (bucket, stop_tokens);
                graph.start(rows, sampling, emulation.processor, emulation.contexts);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            (Caches::Cuda(c), Backend::Cuda { backend, .. }) => {
                let _ = emulation;
                let (g, kv) = c.graph(backend, bucket)?;
                Ok(g.start(kv, rows, sampling, stop_tokens)?)
            }
            #[cfg(feature = "cuda")]
            _ => unreachable!("a session's caches come from its engine's backend"),
        }
    }

    /// Queues one more step of the started graph (on a GPU: a replay, no host sync).
    pub fn graph_enqueue(&mut self, backend: &Backend, bucket: usize) -> Result<(), EngineError> {
        match (self, backend) {
            (Caches::Cpu { kv, ws, graph }, Backend::Cpu { backend, .. }) => {
                let _ = bucket;
                graph.enqueue(backend, kv.get(backend)?, ws)
            }
            #[cfg(feature = "cuda")]
            (Caches::Cuda(c), Backend::Cuda { backend, .. }) => {
                Ok(c.graph(backend, bucket)?.0.enqueue()?)
            }
            #[cfg(feature = "cuda")]
            _ => unreachable!("a session's caches come from its engine's backend"),
        }
    }

    /// The oldest queued step's sampled tokens, one per started row (waits for it on a GPU).
    pub fn graph_next(
        &mut self,
        backend: &Backend,
        bucket: usize,
    ) -> Result<Vec<u32>, EngineError> {
        match (self, backend) {
            (Caches::Cpu { graph, .. }, _) => {
                let _ = bucket;
                Ok(graph.next())
            }
            #[cfg(feature = "cuda")]
            (Caches::Cuda(c), Backend::Cuda { backend, .. }) => {
                Ok(c.graph(backend, bucket)?.0.next()?.tokens)
            }
            #[cfg(feature = "cuda")]
            _ => unreachable!("a session's caches come from its engine's backend"),
        }
    }

    /// Drops every queued step (on a GPU, after waiting for them to finish).
    pub fn graph_stop(&mut self, backend: &Backend, bucket: usize) -> Result<(), EngineError> {
        match (self, backend) {
            (Caches::Cpu { graph, .. }, _) => {
                let _ = bucket;
                graph.stop();
                Ok(())
            }
            #[cfg(feature = "cuda")]
            (Caches::Cuda(c), Backend::Cuda { backend, .. }) => {
                Ok(c.graph(backend, bucket)?.0.stop()?)
            }
            #[cfg(feature = "cuda")]
            _ => unreachable!("a session's caches come from its engine's backend"),
        }
    }
}

/// What only the CPU stand-in for the decode graph uses: the logits processor (the device has
/// none) and each row's context for it.
pub(crate) struct CpuGraphInputs<'a> {
    pub processor: Option<&'a LogitsProcessor>,
    pub contexts: Vec<Vec<u32>>,
}

//! Where an engine runs, and the per-session memory of that place.
//!
//! The engine and its sessions see two traits: a [`Backend`] (the compiled model on its device)
//! and the [`Caches`] it makes for each session (a cache with slots and lengths, a forward pass,
//! the decode graph). The CPU backend implements them in `cpu_device.rs`; the CUDA backend
//! (feature `cuda`) in `cuda_device.rs`, where decode goes kernel by kernel
//! ([`DecodePath::PerOp`]) or through the graph-replayed megakernel ([`DecodePath::Megakernel`],
//! driven by `graph_run.rs`). A session's caches hold their backend, so they can only ever run
//! on the device that made them.

use crate::backend::cpu::{CpuBackend, CpuOptions};
use crate::backend::cuda::GraphRow;
use crate::backend::TokenRow;
use crate::kv::KvDtype;
use crate::model::{Model, ModelConfig};
use crate::plan::{ExecutionPlan, PlanKind};
use crate::sample::SamplingParams;

use super::cpu_device::CpuDevice;
use super::{EngineError, LogitsProcessor};

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

/// The compiled model on its device (one per engine), as the engine drives it.
pub(crate) trait Backend: Send + Sync {
    fn config(&self) -> &ModelConfig;

    fn plan(&self, kind: PlanKind) -> &ExecutionPlan;

    /// Bytes the weights occupy where they run.
    fn weight_bytes(&self) -> usize;

    /// One line naming the device and the decode path.
    fn describe(&self) -> String;

    /// Empty session memory for `slots` rows of `capacity` positions (device memory is taken on
    /// first use, so that creating a session cannot fail).
    fn new_caches(&self, slots: usize, capacity: usize) -> Box<dyn Caches>;

    /// Whether this is the CPU stand-in for the decode graph, which can apply a logits
    /// processor (tests script tool calls through it).
    fn emulates_graph(&self) -> bool {
        false
    }

    /// Whether decode runs through the graph-replayed megakernel (or its CPU stand-in).
    fn uses_megakernel(&self) -> bool;

    /// The CPU backend, when this is it.
    fn cpu(&self) -> Option<&CpuBackend> {
        None
    }

    /// The CUDA backend, when this is it.
    #[cfg(feature = "cuda")]
    fn cuda(&self) -> Option<&crate::backend::cuda::CudaBackend> {
        None
    }
}

/// A session's memory on the device of the backend that made it (one per session). It holds
/// that backend, so every call runs where the memory lives.
pub(crate) trait Caches: Send {
    /// Positions slot `slot` holds.
    fn len(&self, slot: usize) -> usize;

    fn capacity(&self) -> usize;

    /// Slots the session asked for (a CUDA cache may hold more, for padding rows).
    fn slots(&self) -> usize;

    /// Forgets positions from `len` on.
    fn truncate(&mut self, slot: usize, len: usize);

    /// Sets a slot's confirmed length (positions a graph step wrote, once consumed).
    fn set_len(&mut self, slot: usize, len: usize);

    /// Makes slot `to` hold slot `from`'s first `len` positions.
    fn copy_slot(&mut self, from: usize, to: usize, len: usize) -> Result<(), EngineError>;

    /// Runs one step, logits to the host. Returns the number of logit rows.
    fn forward(
        &mut self,
        kind: PlanKind,
        tokens: &[u32],
        rows: &[TokenRow],
        logits: &mut Vec<f32>,
    ) -> Result<usize, EngineError>;

    /// A decode step with sampling on the device: one token per row, or `None` (and nothing
    /// run) where the device cannot sample, and the caller runs [`Caches::forward`] instead.
    fn forward_sample(
        &mut self,
        tokens: &[u32],
        rows: &[TokenRow],
        sampling: &SamplingParams,
        row_ids: &[u32],
    ) -> Result<Option<Vec<u32>>, EngineError>;

    /// Starts the decode graph of `bucket` rows on `rows` (nothing runs until enqueued).
    fn graph_start(
        &mut self,
        bucket: usize,
        rows: &[GraphRow],
        sampling: &SamplingParams,
        stop_tokens: &[u32],
        emulation: CpuGraphInputs<'_>,
    ) -> Result<(), EngineError>;

    /// Queues one more step of the started graph (on a GPU: a replay, no host sync).
    fn graph_enqueue(&mut self, bucket: usize) -> Result<(), EngineError>;

    /// The oldest queued step's sampled tokens, one per started row (waits for it on a GPU).
    fn graph_next(&mut self, bucket: usize) -> Result<Vec<u32>, EngineError>;

    /// Drops every queued step (on a GPU, after waiting for them to finish).
    fn graph_stop(&mut self, bucket: usize) -> Result<(), EngineError>;
}

/// What [`start`] produced, and why the CPU was chosen if it was.
pub(crate) struct Started {
    pub backend: Box<dyn Backend>,
    pub fallback: Option<String>,
}

/// Compiles `model` for the device `opts` names.
pub(crate) fn start(model: &Model, opts: EngineOptions) -> Result<Started, EngineError> {
    let cpu = |fallback| -> Result<Started, EngineError> {
        Ok(Started {
            backend: Box::new(CpuDevice::new(
                CpuBackend::new(&model.config, &model.weights, opts.cpu)?,
                opts.emulate_graph_on_cpu,
                opts.kv_dtype,
            )),
            fallback,
        })
    };
    match opts.device {
        Device::Cpu => cpu(None),
        #[cfg(feature = "cuda")]
        Device::Cuda | Device::Auto => {
            match super::cuda_device::CudaDevice::start(model, opts.decode) {
                Ok(backend) => Ok(Started {
                    backend: Box::new(backend),
                    fallback: None,
                }),
                Err(e) if opts.device == Device::Auto => cpu(Some(e.to_string())),
                Err(e) => Err(e),
            }
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda => Err(EngineError::NoCuda(
            "this kiln was built without the `cuda` cargo feature".into(),
        )),
        #[cfg(not(feature = "cuda"))]
        Device::Auto => cpu(Some("built without the `cuda` cargo feature".into())),
    }
}

/// What only the CPU stand-in for the decode graph uses: the logits processor (the device has
/// none) and each row's context for it.
pub(crate) struct CpuGraphInputs<'a> {
    pub processor: Option<&'a LogitsProcessor>,
    pub contexts: Vec<Vec<u32>>,
}

//! Where an engine runs: the options that choose a device, and [`start`], which compiles the
//! model there.
//!
//! The engine and its sessions see the device only through the traits of `backend.rs`; the CPU
//! backend implements them in `cpu_device.rs` and the CUDA backend (feature `cuda`) in
//! `cuda_device.rs`, where decode goes kernel by kernel ([`DecodePath::PerOp`]) or through the
//! graph-replayed megakernel ([`DecodePath::Megakernel`], driven by `graph_run.rs`).

use crate::backend::cpu::{CpuBackend, CpuOptions};
use crate::kv::KvDtype;
use crate::model::Model;

use super::backend::Backend;
use super::cpu_device::CpuDevice;
use super::EngineError;

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
}

impl From<CpuOptions> for EngineOptions {
    fn from(cpu: CpuOptions) -> EngineOptions {
        EngineOptions {
            cpu,
            ..EngineOptions::default()
        }
    }
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
                false,
                opts.kv_dtype,
            )),
            fallback,
        })
    };
    match opts.device {
        Device::Cpu => cpu(None),
        #[cfg(feature = "cuda")]
        Device::Cuda | Device::Auto => match start_cuda(model, opts.decode) {
            Ok(backend) => Ok(Started {
                backend: Box::new(backend),
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

/// Compiles `model` for the CPU, decoding through the CPU stand-in of the CUDA decode graph
/// (`cpu_graph.rs`), which runs ahead of the engine as the device does. Only tests of the
/// engine's pipelined decode want this: on a CPU it buys no speed.
pub(crate) fn start_graph_emulation(
    model: &Model,
    cpu: CpuOptions,
    kv_dtype: KvDtype,
) -> Result<Started, EngineError> {
    Ok(Started {
        backend: Box::new(CpuDevice::new(
            CpuBackend::new(&model.config, &model.weights, cpu)?,
            true,
            kv_dtype,
        )),
        fallback: None,
    })
}

#[cfg(feature = "cuda")]
fn start_cuda(
    model: &Model,
    decode: DecodePath,
) -> Result<super::cuda_device::CudaDevice, EngineError> {
    let backend = crate::backend::cuda::CudaBackend::new(&model.config, &model.weights)?;
    let megakernel = match decode {
        DecodePath::PerOp => false,
        DecodePath::Megakernel => {
            backend.supports_megakernel()?;
            true
        }
        DecodePath::Auto => backend.supports_megakernel().is_ok(),
    };
    Ok(super::cuda_device::CudaDevice::new(backend, megakernel))
}

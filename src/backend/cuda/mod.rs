//! The CUDA backend.
//!
//! * [`kernels`]: the CUDA C sources of `cuda/`, embedded (always built, no CUDA needed).
//! * [`megakernel`]: lowering the decode plan to kiln-codegen's `DecodeProgram` and its CUDA C
//!   (no feature needed). The generated kernel is UNVERIFIED on a GPU (compiled by NVRTC only).
//! * `nvrtc` (feature `cuda`): finds NVRTC and the headers, compiles `cuda/` to cubins for the
//!   device's exact architecture, caches them on disk, parses ptxas's resource report. Compiling
//!   is verified in CI without a GPU (`tests/nvrtc_compile.rs`).
//! * `device` (feature `cuda`): driver discovery and the [`CudaBackend`] executor.
//!   **UNVERIFIED**: written against cudarc 0.19's API and compiled, but never run on a GPU;
//!   `tests/gpu.rs` / `scripts/gpu-check.sh` are the checks to run on a GPU machine.
//!
//! cudarc panics when the driver or NVRTC library is missing, so nothing here touches cudarc
//! before `is_culib_present()` says the library is there.

pub mod kernels;
pub mod megakernel;

#[cfg(feature = "cuda")]
pub mod bandwidth;
#[cfg(feature = "cuda")]
mod device;
#[cfg(feature = "cuda")]
pub mod nvrtc;

#[cfg(feature = "cuda")]
pub use device::{probe, CudaBackend, CudaError, CudaKvCache, CudaWorkspace, DeviceInfo};

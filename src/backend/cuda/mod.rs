//! The CUDA backend.
//!
//! * [`kernels`]: the CUDA C sources of `cuda/`, embedded (always built, no CUDA needed).
//! * [`megakernel`]: lowering the decode plan to kiln-codegen's `DecodeProgram` and its CUDA C
//!   (no feature needed). The generated kernel has run on an H200 (see `graph` below).
//! * `nvrtc` (feature `cuda`): finds NVRTC and the headers, compiles `cuda/` to cubins for the
//!   device's exact architecture, caches them on disk, parses ptxas's resource report. Compiling
//!   is verified in CI without a GPU (`tests/nvrtc_compile.rs`).
//! * [`gemm_args`]: the row-major to column-major argument mapping of the cuBLAS prefill GEMM
//!   (pure, unit-tested).
//! * [`graph_host`]: the host-side arithmetic of the decode graph (buckets, padding rows, grid,
//!   sampling control block, ring epochs; pure, unit-tested).
//! * `graph` (feature `cuda`): [`GraphDecoder`], the megakernel captured in a CUDA graph and
//!   replayed with results read from a pinned host-mapped ring. Ran on an H200
//!   (docs/gpu-results.md): equal to the per-op path and the CPU up to near ties; two checks
//!   fail on the demo model only (rows joining and leaving, seeded sampling against the per-op
//!   sampler; see `graph.rs`).
//! * `precompile` (feature `cuda`): compiles a model's kernels for a named architecture into
//!   the on-disk cache without a GPU (`kiln-bench --precompile-cuda`), for a device to load.
//! * `trace` (feature `cuda`): `KILN_TRACE_CUDA=1`, the time of each load and decode-graph
//!   phase on stderr.
//! * `timeline` (feature `cuda`): `KILN_MK_TIMELINE=DIR`, every megakernel tile's wait and
//!   work times of a decode graph's last step, as CSV (ran on an H200, run 11).
//! * `upload` (feature `cuda`): weight uploads through two pinned staging buffers.
//! * `device` (feature `cuda`): driver discovery and the [`CudaBackend`] executor.
//!   Ran on an H200 (docs/gpu-results.md): logits within bf16 tolerance of the CPU on every
//!   fixture, 128 greedy SmolLM2 tokens identical; `tests/gpu.rs` / `scripts/gpu-check.sh` are
//!   the checks to run on a GPU machine.
//!
//! cudarc panics when the driver or NVRTC library is missing, so nothing here touches cudarc
//! before `is_culib_present()` says the library is there.

pub mod gemm_args;
pub mod graph_host;
pub mod kernels;
pub mod megakernel;

#[cfg(feature = "cuda")]
mod device;
#[cfg(feature = "cuda")]
mod graph;
#[cfg(feature = "cuda")]
pub mod nvrtc;
#[cfg(feature = "cuda")]
pub mod precompile;
#[cfg(feature = "cuda")]
pub mod timeline;
#[cfg(feature = "cuda")]
pub mod trace;
#[cfg(feature = "cuda")]
mod upload;

#[cfg(feature = "cuda")]
pub use device::{probe, CudaBackend, CudaError, CudaKvCache, CudaWorkspace, DeviceInfo};
#[cfg(feature = "cuda")]
pub use graph::{GraphDecoder, GraphStep};
pub use graph_host::{bucket_for, GraphError, MkControl, RING};

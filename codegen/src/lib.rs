//! kiln-codegen: lowers a decode step, written as a [`DecodeProgram`] (kiln's own small
//! instruction set), to the CUDA C of one persistent megakernel.
//!
//! * [`program`]: the instruction set and its single-assignment buffers.
//! * [`schedule`]: tiles, exact tile dependencies, epoch counters, assignment to blocks, and a
//!   CPU simulation of the persistent blocks.
//! * [`emit`]: the CUDA C text (deterministic), compiled by kiln's NVRTC gate.
//! * [`control`]: the run-time sampling controls ([`MkControl`]) and the token ring ([`RING`]).
//!
//! Pure Rust, no GPU and no dependency on `kiln`. The generated kernel is UNVERIFIED on a GPU:
//! it compiles under NVRTC for sm_80 / sm_90, it has never been run.

pub mod control;
pub mod emit;
pub mod program;
pub mod schedule;

pub use control::{ring_stride, ring_words, ControlError, MkControl, MAX_STOP, RING};
pub use emit::{emit_kernel, emit_source, KERNEL};
pub use program::{
    Act, BufId, Buffer, ColRange, DecodeProgram, Instr, LowerError, NormSpec, RopeStyle, Weight,
    WeightId,
};
pub use schedule::{Access, Resource, Schedule, Tile, TileConfig, Wait};

/// Largest batch bucket one kernel handles (`MK_MAX_BATCH` in `cuda/megakernel/tiles.cuh`).
pub const MAX_BATCH: usize = 8;

//! kiln-codegen: lowers a decode step, written as a [`DecodeProgram`] (kiln's own small
//! instruction set), to the CUDA C of one persistent megakernel.
//!
//! * [`program`]: the instruction set and its single-assignment buffers.
//! * [`schedule`]: tiles, exact tile dependencies, epoch counters, assignment to blocks, and a
//!   CPU simulation of the persistent blocks.
//! * [`emit`]: the argument / tile / wait tables and the CUDA C text (deterministic), compiled
//!   by kiln's NVRTC gate.
//! * [`interp`]: a CPU interpreter of the emitted tables that mirrors the tile functions of
//!   `cuda/megakernel/tiles.cuh` (f32 math, bf16 weights and KV cache) and runs the tiles in any
//!   order their waits allow, with unwritten memory poisoned: the verification of the lowering,
//!   the schedule's dependencies and the argument rows that needs no GPU.
//! * [`control`]: the run-time sampling controls, one [`MkRow`] per batch row in [`MkControl`],
//!   and the token ring ([`RING`]).
//!
//! Pure Rust, no GPU and no dependency on `kiln`. The generated kernel compiles under NVRTC for
//! sm_80 / sm_90 and has run on an H200 (sm_90 only; kiln's docs/gpu-results.md): 256 greedy
//! steps equal to kiln's per-op path and CPU, up to near ties, on every fixture that lowers and
//! the demo model. What the interpreter checks is the kernel's intent as the interpreter mirrors
//! it, not the CUDA code itself.

pub mod control;
pub mod emit;
pub mod interp;
pub mod program;
pub mod schedule;

pub use control::{
    ring_stride, ring_words, ControlError, MkControl, MkRow, MAX_STOP, NO_TOKEN, RING,
};
pub use emit::{emit_kernel, emit_source, tables, Tables, KERNEL};
pub use program::{
    Act, BufId, Buffer, ColRange, DecodeProgram, Ewise, Instr, KvAppend, LowerError, NormSpec,
    RopeStyle, Weight, WeightDtype, WeightId,
};
pub use schedule::{Access, Resource, Schedule, Tile, TileConfig, Wait};

/// Largest batch bucket one kernel handles (`MK_MAX_BATCH` in `cuda/megakernel/tiles.cuh`).
pub const MAX_BATCH: usize = 8;

/// The batch bucket a decode graph for `rows` rows is built for: 1, 2, 4 or 8 (padding rows fill
/// the rest); `None` above [`MAX_BATCH`]. Zero rows take the smallest bucket.
pub fn bucket_for(rows: usize) -> Option<usize> {
    (rows <= MAX_BATCH).then(|| rows.max(1).next_power_of_two())
}

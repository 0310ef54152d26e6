//! The CPU backend: executes an execution plan with SIMD kernels on a rayon pool.

pub mod matmul;
pub mod simd;

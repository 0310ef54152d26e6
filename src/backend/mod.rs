//! Executors of execution plans. The CPU backend is the reference every other backend is
//! checked against; the CUDA backend (feature `cuda`, on by default) must match it.

pub mod cpu;
pub mod cuda;
mod step;

pub use step::{
    check_logit_rows, check_step, last_of_each_sequence, ExecError, GraphRow, RowDraw, TokenRow,
};

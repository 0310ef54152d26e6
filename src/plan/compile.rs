//! What every backend compiles from a model: the optimised graph its plans are lowered from, and
//! the names of those plans.

use crate::graph::build::{build_graph, LogitRows};
use crate::graph::{passes, Graph};
use crate::model::{LoadError, ModelConfig, Weights};

/// Which compiled plan a step runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(usize)]
pub enum PlanKind {
    /// Many tokens, logits for the last one of each sequence.
    Prefill,
    /// One token per sequence.
    Decode,
    /// Logits for every token (scoring, reference checks).
    AllLogits,
}

/// The optimised graph every backend lowers its plans from.
pub fn compile_graph(
    config: &ModelConfig,
    weights: &Weights,
    logits: LogitRows,
) -> Result<Graph, LoadError> {
    let mut g = build_graph(config, weights, logits)?;
    passes::optimize(&mut g);
    Ok(g)
}

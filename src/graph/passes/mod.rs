//! Graph rewrites, each a small type implementing [`Pass`], run in a fixed, printed order.
//! Passes only fuse or narrow rows to those the output needs: the graph they leave computes the
//! same function (up to f32 rounding).

mod fuse_activation;
mod fuse_gated;
mod fuse_norm;
mod fuse_residual;
mod merge_matmuls;
mod narrow_last_rows;

pub use fuse_activation::FuseActivation;
pub use fuse_gated::FuseGatedActivation;
pub use fuse_norm::FuseNormIntoMatMul;
pub use fuse_residual::FuseResidualAdd;
pub use merge_matmuls::MergeSiblingMatMuls;
pub use narrow_last_rows::NarrowToLastRows;

use super::Graph;

pub trait Pass {
    fn name(&self) -> &'static str;
    /// Rewrites the graph; returns whether anything changed.
    fn run(&self, g: &mut Graph) -> bool;
}

/// The pipeline every backend uses, in order. The last rows are narrowed first, on the plain
/// ops the model builders write; norms fuse next so that siblings reading the same normalised
/// input share one merged matmul.
pub fn default_pipeline() -> Vec<Box<dyn Pass>> {
    vec![
        Box::new(NarrowToLastRows),
        Box::new(FuseNormIntoMatMul),
        Box::new(MergeSiblingMatMuls),
        Box::new(FuseGatedActivation),
        Box::new(FuseActivation),
        Box::new(FuseResidualAdd),
    ]
}

/// Runs each pass (then dead-node removal), calling `observe` after each with the result.
pub fn run_pipeline(
    g: &mut Graph,
    passes: &[Box<dyn Pass>],
    mut observe: impl FnMut(&str, &Graph),
) {
    for p in passes {
        if p.run(g) {
            g.remove_dead();
        }
        debug_assert!(
            g.validate().is_ok(),
            "pass {} broke the graph: {:?}",
            p.name(),
            g.validate()
        );
        observe(p.name(), g);
    }
}

/// Runs the default pipeline.
pub fn optimize(g: &mut Graph) {
    run_pipeline(g, &default_pipeline(), |_, _| {});
}

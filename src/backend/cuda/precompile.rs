//! Compiling a model's CUDA kernels ahead of time, on a machine with NVRTC and no GPU.
//!
//! A device compiles `cuda/`'s per-op sources and one decode megakernel per batch bucket with
//! NVRTC the first time a model runs (seconds per megakernel), and keeps the cubins in the
//! on-disk cache ([`nvrtc::cache_dir`]). The cache key is the source text's hash, the
//! architecture and NVRTC's version, none of which needs a GPU: compiling here for the device's
//! `sm_XY` with the NVRTC version it will load fills the entries it looks up, so a machine that
//! is billed by the second (or has no compiler time to spare at start-up) loads instead of
//! compiling. The megakernel is generated exactly as the device generates it (same decode plan,
//! same file name, the same `KILN_MK_*` switches read from the environment).

use std::time::Instant;

use super::device::{decode_plan, CudaError};
use super::graph::megakernel_file;
use super::graph_host::bucket_for;
use super::kernels::SOURCES;
use super::megakernel::generate;
use super::nvrtc;
use crate::graph::build::LogitRows;
use crate::model::{ModelConfig, Weights};
use crate::plan::compile_graph;

/// One compiled (or already cached) source.
#[derive(Debug, Clone)]
pub struct Precompiled {
    /// The name it is cached under (`gemv.cu`, `kiln_decode_step_b8.cu`, ...).
    pub file: String,
    /// Whether the cache already held it (nothing was compiled).
    pub was_cached: bool,
    /// Seconds spent, compiling or reading.
    pub seconds: f64,
}

/// What [`precompile`] did for one model.
#[derive(Debug, Clone)]
pub struct PrecompileReport {
    pub files: Vec<Precompiled>,
    /// Why the model has no decode megakernel (it runs the per-op path only), if it has none.
    pub megakernel_unsupported: Option<String>,
}

/// Compiles the per-op sources and the decode megakernel of each bucket that serves `batches`
/// (1, 2, 4 or 8 rows) for `sm_{arch}` into the on-disk cache. Errors: NVRTC missing or a
/// compile failing, the cache directory unknown (no `XDG_CACHE_HOME` or `HOME`), a batch above
/// the largest bucket, or a model the graph compiler refuses.
pub fn precompile(
    config: &ModelConfig,
    weights: &Weights,
    arch: u32,
    batches: &[usize],
) -> Result<PrecompileReport, CudaError> {
    if nvrtc::cache_dir().is_none() {
        return Err(CudaError::Unsupported(
            "no kernel cache directory (set XDG_CACHE_HOME or HOME)".into(),
        ));
    }
    let include = nvrtc::find_include_dir().ok_or(nvrtc::NvrtcError::NoHeaders)?;
    let mut buckets = Vec::new();
    for &b in batches {
        let bucket = bucket_for(b).ok_or_else(|| {
            CudaError::Unsupported(format!("batch {b}: the megakernel's buckets end at 8 rows"))
        })?;
        if !buckets.contains(&bucket) {
            buckets.push(bucket);
        }
    }
    let mut files = Vec::new();
    let mut one = |file: &str, text: &str| -> Result<(), CudaError> {
        let t0 = Instant::now();
        let was_cached = nvrtc::cache_path(file, text, arch)?.is_some_and(|p| p.is_file());
        nvrtc::compile_text_cached(file, text, arch, &include)?;
        files.push(Precompiled {
            file: file.to_string(),
            was_cached,
            seconds: t0.elapsed().as_secs_f64(),
        });
        Ok(())
    };
    for src in SOURCES {
        one(src.file, &src.expanded())?;
    }
    let decode = decode_plan(compile_graph(config, weights, LogitRows::Last)?);
    let mut megakernel_unsupported = None;
    for bucket in buckets {
        match generate(&decode, bucket) {
            Ok(mk) => one(&megakernel_file(bucket), &mk.source)?,
            Err(e) => {
                megakernel_unsupported = Some(e.to_string());
                break;
            }
        }
    }
    Ok(PrecompileReport {
        files,
        megakernel_unsupported,
    })
}

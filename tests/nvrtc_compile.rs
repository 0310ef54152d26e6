//! The NVRTC compile gate: every file of `cuda/` must compile, with no warning, to cubins for
//! sm_90 and sm_80, and the hot kernels (GEMV, GEMM, attention) must not spill registers.
//!
//! Needs NVRTC and the CUDA headers, which CI installs from PyPI (`.ci/run`:
//! `pip install --target .ci/nvrtc nvidia-cuda-nvrtc nvidia-cuda-runtime`, then
//! `KILN_NVRTC_DIR=.ci/nvrtc`); a toolkit under `CUDA_HOME` or `/usr/local/cuda` works too.
//! Without them the test prints `SKIPPED` and passes. No GPU is needed.
#![cfg(feature = "cuda")]

use kiln::backend::cuda::kernels::{NO_SPILL, SOURCES};
use kiln::backend::cuda::nvrtc;

#[test]
fn every_cuda_source_compiles_for_sm90_and_sm80_without_spills() {
    if let Err(e) = nvrtc::ensure_loaded() {
        println!("SKIPPED nvrtc compile gate: {e}");
        return;
    }
    let Some(include) = nvrtc::find_include_dir() else {
        println!(
            "SKIPPED nvrtc compile gate: cuda_bf16.h not found (set KILN_NVRTC_DIR or CUDA_HOME)"
        );
        return;
    };
    let (major, minor) = nvrtc::version().expect("NVRTC loaded but nvrtcVersion failed");
    println!("NVRTC {major}.{minor}, headers from {}", include.display());
    let mut failures = Vec::new();
    println!(
        "{:<6} {:<22} {:<20} {:>5} {:>7} {:>6} {:>7} {:>7}",
        "arch", "file", "kernel", "regs", "smem", "stack", "spill_st", "spill_ld"
    );
    for arch in [90u32, 80] {
        for src in SOURCES {
            let c = match nvrtc::compile(src, arch, &include) {
                Ok(c) => c,
                Err(e) => {
                    failures.push(e.to_string());
                    continue;
                }
            };
            assert!(!c.cubin.is_empty(), "{}: empty cubin", src.file);
            for k in src.kernels {
                match c.kernels.iter().find(|r| r.name == *k) {
                    None => failures.push(format!(
                        "{} sm_{arch}: no ptxas report for kernel {k}\n{}",
                        src.file, c.log
                    )),
                    Some(r) => {
                        println!(
                            "sm_{arch:<3} {:<22} {:<20} {:>5} {:>7} {:>6} {:>7} {:>7}",
                            src.file,
                            k,
                            r.registers,
                            r.shared_bytes,
                            r.stack_bytes,
                            r.spill_stores,
                            r.spill_loads
                        );
                        if NO_SPILL.contains(k) && (r.spill_stores > 0 || r.spill_loads > 0) {
                            failures.push(format!(
                                "{} sm_{arch}: kernel {k} spills ({} bytes stored, {} loaded)",
                                src.file, r.spill_stores, r.spill_loads
                            ));
                        }
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

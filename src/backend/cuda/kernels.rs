//! The hand-written CUDA sources of `cuda/`, embedded with `include_str!`, and the kernels each
//! one defines. Pure text: available with or without the `cuda` feature, so tools can print it.
//!
//! The `.cu` files include `common.cuh` (the files that touch the KV cache `kv.cuh`, the
//! attention files `attention.cuh`, the sampler `sample.cuh`); NVRTC gets them with those `#include` lines replaced by the headers' text
//! ([`CudaSource::expanded`]), so the only include path NVRTC needs is the toolkit's, for
//! `cuda_bf16.h`.

/// One `.cu` file: its name, text and the `extern "C"` kernels it defines.
#[derive(Clone, Copy, Debug)]
pub struct CudaSource {
    pub file: &'static str,
    pub text: &'static str,
    pub kernels: &'static [&'static str],
}

/// Shared helpers (warp/block reductions, activations, Philox).
pub const COMMON_CUH: &str = include_str!("../../../cuda/common.cuh");
/// The one KV layout (`src/kv/layout.rs`) and the storage types' encodings on the device.
pub const KV_CUH: &str = include_str!("../../../cuda/kv.cuh");
/// The online-softmax core of both attention kernels.
pub const ATTENTION_CUH: &str = include_str!("../../../cuda/attention.cuh");
/// The block-level sampler and `MkControl`, shared by `sample.cu` and the megakernel.
pub const SAMPLE_CUH: &str = include_str!("../../../cuda/sample.cuh");

/// Every `.cu` file of `cuda/`, one op family each.
pub const SOURCES: &[CudaSource] = &[
    CudaSource {
        file: "embed.cu",
        text: include_str!("../../../cuda/embed.cu"),
        kernels: &["embed_bf16"],
    },
    CudaSource {
        file: "rmsnorm.cu",
        text: include_str!("../../../cuda/rmsnorm.cu"),
        kernels: &["rms_norm", "head_norm"],
    },
    CudaSource {
        file: "rope.cu",
        text: include_str!("../../../cuda/rope.cu"),
        kernels: &["rope"],
    },
    CudaSource {
        file: "gemv.cu",
        text: include_str!("../../../cuda/gemv.cu"),
        kernels: &["gemv_bf16", "gemv_finish"],
    },
    CudaSource {
        file: "gemm.cu",
        text: include_str!("../../../cuda/gemm.cu"),
        kernels: &["gemm_bf16"],
    },
    CudaSource {
        file: "attention_decode.cu",
        text: include_str!("../../../cuda/attention_decode.cu"),
        kernels: &["kv_append", "attention_decode", "attention_combine"],
    },
    CudaSource {
        file: "attention_prefill.cu",
        text: include_str!("../../../cuda/attention_prefill.cu"),
        kernels: &["attention_prefill"],
    },
    CudaSource {
        file: "elementwise.cu",
        text: include_str!("../../../cuda/elementwise.cu"),
        kernels: &[
            "add_rows",
            "mul_rows",
            "combine_rows",
            "act_rows",
            "softcap_rows",
            "gated_rows",
            "gated_value_add",
            "smear",
            "gather_rows",
        ],
    },
    CudaSource {
        file: "convert.cu",
        text: include_str!("../../../cuda/convert.cu"),
        kernels: &["f32_to_bf16_rows", "gemm_epilogue"],
    },
    CudaSource {
        file: "sample.cu",
        text: include_str!("../../../cuda/sample.cu"),
        kernels: &["sample_rows", "mask_rows"],
    },
];

/// Kernels that must never spill registers (the hot decode/prefill paths); the NVRTC gate
/// fails if ptxas reports spill stores or loads for any of them.
pub const NO_SPILL: &[&str] = &[
    "gemv_bf16",
    "gemv_finish",
    "gemm_bf16",
    "attention_decode",
    "attention_combine",
    "attention_prefill",
    "sample_rows",
];

impl CudaSource {
    /// The text NVRTC compiles: the local headers pasted in place of their `#include`s.
    pub fn expanded(&self) -> String {
        let mut out = String::with_capacity(self.text.len() + COMMON_CUH.len());
        for line in self.text.lines() {
            match line.trim() {
                "#include \"common.cuh\"" => out.push_str(COMMON_CUH),
                "#include \"kv.cuh\"" => out.push_str(KV_CUH),
                "#include \"attention.cuh\"" => out.push_str(ATTENTION_CUH),
                "#include \"sample.cuh\"" => out.push_str(SAMPLE_CUH),
                _ => out.push_str(line),
            }
            out.push('\n');
        }
        out
    }
}

/// The source file defining `kernel`.
pub fn source_of(kernel: &str) -> Option<&'static CudaSource> {
    SOURCES.iter().find(|s| s.kernels.contains(&kernel))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_listed_kernel_is_defined_once_and_headers_expand() {
        for s in SOURCES {
            let text = s.expanded();
            assert!(
                !text
                    .lines()
                    .any(|l| l.trim_start().starts_with("#include \"")),
                "{}: local include left",
                s.file
            );
            for k in s.kernels {
                let n = text.matches(&format!(" {k}(")).count()
                    + text.matches(&format!("\n{k}(")).count();
                assert_eq!(n, 1, "{}: kernel {k} defined {n} times", s.file);
            }
        }
        assert!(NO_SPILL.iter().all(|k| source_of(k).is_some()));
    }
}

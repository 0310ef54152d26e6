//! Every fixture model, in every file format, against the logits transformers computed for it
//! (`tests/fixtures`, made by `scripts/make_fixtures.py`): prefill logits at every prompt
//! position, then 16 greedy decode steps through the KV cache, each within 1e-4 relative error
//! and picking the same token. The GGUF fixtures in Q4_0, Q4_1 and Q8_0 are held to the same
//! bound in `Numerics::Int24` too (24-bit integer activations), where the CPU runs its kernel.

mod common;

use common::{fixtures, rel_err, Reference};
use kiln::backend::cpu::{matmul, CpuBackend, CpuOptions, Numerics, Workspace};
use kiln::backend::TokenRow;
use kiln::model::Model;
use kiln::plan::PlanKind;
use kiln::sample::argmax;

const TOLERANCE: f32 = 1e-4;

fn check(model_path: &str, reference: &str) {
    check_in(Numerics::Exact, model_path, reference);
}

/// [`check`] in `numerics`, where the CPU runs integer kernels for it; prints the largest
/// relative error of both numerics.
fn check_int24(model_path: &str, reference: &str) {
    if !matmul::int16_grouped_kernels() {
        println!("SKIPPED (int24): this CPU has no AVX512-VNNI kernel, so int24 runs as exact");
        check(model_path, reference);
        return;
    }
    let exact = check_in(Numerics::Exact, model_path, reference);
    let int24 = check_in(Numerics::Int24, model_path, reference);
    println!("{model_path}: largest relative error exact {exact:.3e}, int24 {int24:.3e}");
}

/// Checks `model_path` against `reference` in `numerics`; the largest relative error seen.
fn check_in(numerics: Numerics, model_path: &str, reference: &str) -> f32 {
    let mut worst = 0f32;
    let model =
        Model::load(fixtures().join(model_path)).unwrap_or_else(|e| panic!("{model_path}: {e}"));
    let r = Reference::load(&fixtures().join(reference));
    let vocab = model.config.vocab_size;
    let backend = CpuBackend::new(
        &model.config,
        &model.weights,
        CpuOptions {
            threads: 2,
            numerics,
            ..Default::default()
        },
    )
    .unwrap_or_else(|e| panic!("{model_path}: {e}"));
    let p = r.prompt_ids.len();
    let rows: Vec<TokenRow> = (0..p).map(|pos| TokenRow { slot: 0, pos }).collect();

    // Prefill, logits for every position.
    let mut ws = Workspace::new();
    let mut kv = backend.new_cache(1, p + 17).expect("cache");
    let mut logits = Vec::new();
    let n = backend
        .forward(
            PlanKind::AllLogits,
            &mut ws,
            &mut kv,
            &r.prompt_ids,
            &rows,
            &mut logits,
        )
        .unwrap();
    assert_eq!(n, p);
    for (i, want) in r.prefill_logits.iter().enumerate() {
        let e = rel_err(&logits[i * vocab..(i + 1) * vocab], want);
        worst = worst.max(e);
        assert!(
            e < TOLERANCE,
            "{model_path}: prefill position {i}: relative error {e:e}"
        );
    }

    // Prefill for generation (last row only), then greedy decode through the cache.
    let mut kv = backend.new_cache(1, p + 17).expect("cache");
    backend
        .forward(
            PlanKind::Prefill,
            &mut ws,
            &mut kv,
            &r.prompt_ids,
            &rows,
            &mut logits,
        )
        .unwrap();
    let e = rel_err(&logits, &r.prefill_logits[p - 1]);
    worst = worst.max(e);
    assert!(
        e < TOLERANCE,
        "{model_path}: prefill (last row): relative error {e:e}"
    );
    assert_eq!(
        argmax(&logits),
        r.generated_ids[0],
        "{model_path}: first token"
    );
    for (step, want) in r.decode_logits.iter().enumerate() {
        let tok = r.generated_ids[step];
        backend
            .forward(
                PlanKind::Decode,
                &mut ws,
                &mut kv,
                &[tok],
                &[TokenRow {
                    slot: 0,
                    pos: p + step,
                }],
                &mut logits,
            )
            .unwrap();
        let e = rel_err(&logits, want);
        worst = worst.max(e);
        assert!(
            e < TOLERANCE,
            "{model_path}: decode step {step}: relative error {e:e}"
        );
        assert_eq!(
            argmax(&logits),
            r.generated_ids[step + 1],
            "{model_path}: decode step {step} token"
        );
    }
    assert_eq!(kv.len(0), p + 16);
    worst
}

#[test]
fn llama_tied() {
    check("llama_tied", "llama_tied/reference.safetensors");
}

#[test]
fn llama_untied_mqa_llama3_rope_scaling() {
    check("llama_untied", "llama_untied/reference.safetensors");
}

#[test]
fn llama_sharded_checkpoint() {
    check(
        "llama_untied_sharded",
        "llama_untied_sharded/reference.safetensors",
    );
}

#[test]
fn llama_with_attention_bias() {
    check("llama_bias", "llama_bias/reference.safetensors");
}

#[test]
fn qwen2_qkv_bias() {
    check("qwen2", "qwen2/reference.safetensors");
}

#[test]
fn nanochat_published_form() {
    check("nanochat", "nanochat/reference.safetensors");
}

#[test]
fn gguf_f32() {
    check(
        "llama_tied.f32.gguf",
        "llama_tied.f32.reference.safetensors",
    );
}

#[test]
fn gguf_bf16() {
    check(
        "llama_tied.bf16.gguf",
        "llama_tied.bf16.reference.safetensors",
    );
}

#[test]
fn gguf_q8_0() {
    check_int24(
        "llama_tied.q8_0.gguf",
        "llama_tied.q8_0.reference.safetensors",
    );
}

#[test]
fn gguf_q4_0() {
    check_int24(
        "llama_tied.q4_0.gguf",
        "llama_tied.q4_0.reference.safetensors",
    );
}

#[test]
fn gguf_q4_1() {
    check_int24(
        "llama_tied.q4_1.gguf",
        "llama_tied.q4_1.reference.safetensors",
    );
}

#[test]
fn qwen3_qk_norm_head_dim_32() {
    check("qwen3", "qwen3/reference.safetensors");
}

#[test]
fn qwen3_gguf_f32() {
    check("qwen3.f32.gguf", "qwen3.f32.reference.safetensors");
}

#[test]
fn mistral_sliding_window() {
    check("mistral", "mistral/reference.safetensors");
}

#[test]
fn mistral_gguf_f32_llama_arch_with_sliding_window() {
    check("mistral.f32.gguf", "mistral.f32.reference.safetensors");
}

#[test]
fn phi3_fused_qkv_and_gate_up() {
    check("phi3", "phi3/reference.safetensors");
}

#[test]
fn phi3_gguf_f32() {
    check("phi3.f32.gguf", "phi3.f32.reference.safetensors");
}

#[test]
fn gemma3_local_and_global_layers() {
    check("gemma3", "gemma3/reference.safetensors");
}

#[test]
fn gemma3_gguf_f32_norms_stored_plus_one() {
    check("gemma3.f32.gguf", "gemma3.f32.reference.safetensors");
}

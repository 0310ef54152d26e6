//! `Gemma3ForCausalLM` (the text model): the embedding scaled by √hidden; RMSNorm as
//! `x·(1 + w)`; per-head RMSNorm of q and k before RoPE; norms before and after attention and
//! before and after the MLP ("sandwich"); a GELU-tanh gated MLP; attention scaled by
//! `query_pre_attn_scalar^-1/2`; local layers with a sliding window and their own RoPE base
//! (10,000), a global layer every few (every sixth by default) with the main base (1e6) and
//! rope scaling; tied head; no logit softcap.
//!
//! The builder multiplies by the stored norm weight as every other architecture does: Hugging
//! Face stores `w` and [`hf_norm_weights`] turns it into `1 + w` at load; llama.cpp's converter
//! already stores `w + 1` in GGUF.

use super::{Builder, LogitRows};
use crate::graph::{Activation, Graph, Op, RopeSpec};
use crate::model::{LoadError, ModelConfig, Weights};

pub(super) fn build(
    config: &ModelConfig,
    weights: &Weights,
    logits: LogitRows,
) -> Result<Graph, LoadError> {
    let c = config;
    let gemma = c.gemma3.as_ref().ok_or_else(|| {
        LoadError::config(
            &weights.source,
            "gemma3",
            "a gemma3 model needs its Gemma 3 parameters (query_pre_attn_scalar, local rope base, layer types)",
        )
    })?;
    if gemma.global_layers.len() != c.num_layers {
        return Err(LoadError::config(
            &weights.source,
            "layer_types",
            format!(
                "{} entries for {} layers",
                gemma.global_layers.len(),
                c.num_layers
            ),
        ));
    }
    let mut b = Builder::new(config, weights);
    b.g.rope_local = Some(RopeSpec {
        theta: gemma.rope_local_theta,
        head_dim: c.head_dim,
        style: c.rope_style,
        scaling: None,
    });
    let (hd, q_dim, kv_dim) = (c.head_dim, c.q_dim(), c.kv_dim());
    let embed = "model.embed_tokens.weight";
    let rows = b.vocab_rows(embed)?;
    let e = b.embed_rows(embed, rows)?;
    // `a·x + b·y` with y = x: the embedding times √hidden (Gemma's normalizer).
    let mut x = b.op1(
        Op::Combine {
            a: (c.hidden_size as f32).sqrt(),
            b: 0.0,
        },
        vec![e, e],
        "embed_scale".into(),
    );
    let scale = 1.0 / gemma.query_pre_attn_scalar.sqrt();
    for i in 0..c.num_layers {
        let p = format!("model.layers.{i}");
        let l = format!("layers.{i}");
        let local = !gemma.global_layers[i];
        let norm = |n: &str| format!("{p}.{n}.weight");
        let h = b.rms_norm(x, Some(&norm("input_layernorm")), format!("{l}.attn_norm"))?;
        let q = b.linear(&format!("{p}.self_attn.q_proj"), q_dim, c.hidden_size)?;
        let k = b.linear(&format!("{p}.self_attn.k_proj"), kv_dim, c.hidden_size)?;
        let v = b.linear(&format!("{p}.self_attn.v_proj"), kv_dim, c.hidden_size)?;
        let q = b.matmul(h, q, format!("{l}.attn.q"));
        let k = b.matmul(h, k, format!("{l}.attn.k"));
        let v = b.matmul(h, v, format!("{l}.attn.v"));
        let q = b.head_norm(
            q,
            c.num_heads,
            &norm("self_attn.q_norm"),
            format!("{l}.attn.q_norm"),
        )?;
        let k = b.head_norm(
            k,
            c.num_kv_heads,
            &norm("self_attn.k_norm"),
            format!("{l}.attn.k_norm"),
        )?;
        let q = b.rope(q, c.num_heads, local, format!("{l}.attn.rope_q"));
        let k = b.rope(k, c.num_kv_heads, local, format!("{l}.attn.rope_k"));
        let a = b.op1(
            Op::Attention {
                layer: i,
                heads: c.num_heads,
                kv_heads: c.num_kv_heads,
                head_dim: hd,
                scale,
                window: c.attention_window(i),
            },
            vec![q, k, v],
            format!("{l}.attn"),
        );
        let o = b.linear(&format!("{p}.self_attn.o_proj"), c.hidden_size, q_dim)?;
        let o = b.matmul(a, o, format!("{l}.attn.o"));
        let o = b.rms_norm(
            o,
            Some(&norm("post_attention_layernorm")),
            format!("{l}.attn_post_norm"),
        )?;
        x = b.op1(Op::Add, vec![x, o], format!("{l}.attn_residual"));
        let h = b.rms_norm(
            x,
            Some(&norm("pre_feedforward_layernorm")),
            format!("{l}.mlp_norm"),
        )?;
        let gate = b.linear(
            &format!("{p}.mlp.gate_proj"),
            c.intermediate_size,
            c.hidden_size,
        )?;
        let up = b.linear(
            &format!("{p}.mlp.up_proj"),
            c.intermediate_size,
            c.hidden_size,
        )?;
        let gate = b.matmul(h, gate, format!("{l}.mlp.gate"));
        let up = b.matmul(h, up, format!("{l}.mlp.up"));
        let act = b.op1(
            Op::Act(Activation::GeluTanh),
            vec![gate],
            format!("{l}.mlp.gelu"),
        );
        let m = b.op1(Op::Mul, vec![act, up], format!("{l}.mlp.mul"));
        let down = b.linear(
            &format!("{p}.mlp.down_proj"),
            c.hidden_size,
            c.intermediate_size,
        )?;
        let d = b.matmul(m, down, format!("{l}.mlp.down"));
        let d = b.rms_norm(
            d,
            Some(&norm("post_feedforward_layernorm")),
            format!("{l}.mlp_post_norm"),
        )?;
        x = b.op1(Op::Add, vec![x, d], format!("{l}.mlp_residual"));
    }
    if logits == LogitRows::Last {
        x = b.op1(Op::LastRow, vec![x], "last_row".into());
    }
    let h = b.rms_norm(x, Some("model.norm.weight"), "final_norm".into())?;
    let head_name = if c.tie_word_embeddings || !weights.contains("lm_head.weight") {
        "model.embed_tokens"
    } else {
        "lm_head"
    };
    let head_rows = b.vocab_rows(&format!("{head_name}.weight"))?;
    let head = b.linear_rows(head_name, c.vocab_size, head_rows, c.hidden_size)?;
    let mut out = b.matmul(h, head, "lm_head".into());
    if let Some(cap) = c.final_logit_softcap {
        out = b.op1(Op::Softcap { cap }, vec![out], "softcap".into());
    }
    Ok(b.finish(out))
}

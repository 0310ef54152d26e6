//! `LlamaForCausalLM` and relatives: pre-norm blocks with weighted RMSNorm, GQA attention with
//! RoPE, SwiGLU MLP, optional q/k/v(/o) biases (Qwen2), tied or untied head. The same block
//! serves Mistral (sliding windows, from `ModelConfig::attention_window`), Qwen3 (q/k norm,
//! [`Block::qk_norm`]) and Phi-3 (its fused projections split at load).

use super::{Builder, LogitRows};
use crate::graph::{Activation, Graph, Op};
use crate::model::{LoadError, ModelConfig, Weights};

/// What a relative changes in the Llama block.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Block {
    /// Per-head RMSNorm of q and k (`self_attn.{q,k}_norm.weight`, `[head_dim]`) before RoPE.
    pub qk_norm: bool,
}

pub(super) fn build(
    config: &ModelConfig,
    weights: &Weights,
    logits: LogitRows,
) -> Result<Graph, LoadError> {
    build_block(config, weights, logits, Block::default())
}

pub(super) fn build_block(
    config: &ModelConfig,
    weights: &Weights,
    logits: LogitRows,
    block: Block,
) -> Result<Graph, LoadError> {
    let mut b = Builder::new(config, weights);
    let c = config;
    let (hd, q_dim, kv_dim) = (c.head_dim, c.q_dim(), c.kv_dim());
    let embed = "model.embed_tokens.weight";
    let embed_rows = b.vocab_rows(embed)?;
    let mut x = b.embed_rows(embed, embed_rows)?;
    for i in 0..c.num_layers {
        let p = format!("model.layers.{i}");
        let l = format!("layers.{i}");
        let h = b.rms_norm(
            x,
            Some(&format!("{p}.input_layernorm.weight")),
            format!("{l}.attn_norm"),
        )?;
        let q = b.linear(&format!("{p}.self_attn.q_proj"), q_dim, c.hidden_size)?;
        let k = b.linear(&format!("{p}.self_attn.k_proj"), kv_dim, c.hidden_size)?;
        let v = b.linear(&format!("{p}.self_attn.v_proj"), kv_dim, c.hidden_size)?;
        let q = b.matmul(h, q, format!("{l}.attn.q"));
        let k = b.matmul(h, k, format!("{l}.attn.k"));
        let v = b.matmul(h, v, format!("{l}.attn.v"));
        let (q, k) = if block.qk_norm {
            (
                b.head_norm(
                    q,
                    c.num_heads,
                    &format!("{p}.self_attn.q_norm.weight"),
                    format!("{l}.attn.q_norm"),
                )?,
                b.head_norm(
                    k,
                    c.num_kv_heads,
                    &format!("{p}.self_attn.k_norm.weight"),
                    format!("{l}.attn.k_norm"),
                )?,
            )
        } else {
            (q, k)
        };
        let q = b.rope(q, c.num_heads, false, format!("{l}.attn.rope_q"));
        let k = b.rope(k, c.num_kv_heads, false, format!("{l}.attn.rope_k"));
        let a = b.op1(
            Op::Attention {
                layer: i,
                heads: c.num_heads,
                kv_heads: c.num_kv_heads,
                head_dim: hd,
                scale: 1.0 / (hd as f32).sqrt(),
                window: c.attention_window(i),
            },
            vec![q, k, v],
            format!("{l}.attn"),
        );
        let o = b.linear(&format!("{p}.self_attn.o_proj"), c.hidden_size, q_dim)?;
        let o = b.matmul(a, o, format!("{l}.attn.o"));
        x = b.op1(Op::Add, vec![x, o], format!("{l}.attn_residual"));
        let h = b.rms_norm(
            x,
            Some(&format!("{p}.post_attention_layernorm.weight")),
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
            Op::Act(Activation::Silu),
            vec![gate],
            format!("{l}.mlp.silu"),
        );
        let m = b.op1(Op::Mul, vec![act, up], format!("{l}.mlp.mul"));
        let down = b.linear(
            &format!("{p}.mlp.down_proj"),
            c.hidden_size,
            c.intermediate_size,
        )?;
        let d = b.matmul(m, down, format!("{l}.mlp.down"));
        x = b.op1(Op::Add, vec![x, d], format!("{l}.mlp_residual"));
    }
    if logits == LogitRows::Last {
        x = b.op1(Op::LastRow, vec![x], "last_row".into());
    }
    let h = b.rms_norm(x, Some("model.norm.weight"), "final_norm".into())?;
    let head_name = if c.tie_word_embeddings || !weights.contains("lm_head.weight") {
        if !c.tie_word_embeddings {
            return Err(LoadError::MissingTensor {
                path: weights.source.clone(),
                name: "lm_head.weight".into(),
            });
        }
        "model.embed_tokens"
    } else {
        "lm_head"
    };
    let head_rows = b.vocab_rows(&format!("{head_name}.weight"))?;
    let head = b.linear_rows(head_name, c.vocab_size, head_rows, c.hidden_size)?;
    let out = b.matmul(h, head, "lm_head".into());
    Ok(b.finish(out))
}

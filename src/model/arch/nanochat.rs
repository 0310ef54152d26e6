//! nanochat's GPT in its published form (HF `NanoChatForCausalLM`, era A of the spec):
//! parameter-free RMSNorm (also right after the embedding), RoPE rotating by −θ and then
//! QK-norm, relu² MLP without a gate, untied head, logits soft-capped.

use super::{Builder, LogitRows};
use crate::graph::{Activation, Graph, Op};
use crate::model::{LoadError, ModelConfig, Weights};

pub(super) fn build(
    config: &ModelConfig,
    weights: &Weights,
    logits: LogitRows,
) -> Result<Graph, LoadError> {
    let mut b = Builder::new(config, weights);
    let c = config;
    let (hd, q_dim, kv_dim) = (c.head_dim, c.q_dim(), c.kv_dim());
    let e = b.embed("model.embed_tokens.weight")?;
    let mut x = b.rms_norm(e, None, "embed_norm".into())?;
    for i in 0..c.num_layers {
        let p = format!("model.layers.{i}");
        let l = format!("layers.{i}");
        let h = b.rms_norm(x, None, format!("{l}.attn_norm"))?;
        let q = b.linear(&format!("{p}.self_attn.q_proj"), q_dim, c.hidden_size)?;
        let k = b.linear(&format!("{p}.self_attn.k_proj"), kv_dim, c.hidden_size)?;
        let v = b.linear(&format!("{p}.self_attn.v_proj"), kv_dim, c.hidden_size)?;
        let q = b.matmul(h, q, format!("{l}.attn.q"));
        let k = b.matmul(h, k, format!("{l}.attn.k"));
        let v = b.matmul(h, v, format!("{l}.attn.v"));
        let q = b.op1(
            Op::Rope {
                heads: c.num_heads,
                head_dim: hd,
            },
            vec![q],
            format!("{l}.attn.rope_q"),
        );
        let k = b.op1(
            Op::Rope {
                heads: c.num_kv_heads,
                head_dim: hd,
            },
            vec![k],
            format!("{l}.attn.rope_k"),
        );
        let eps = c.rms_norm_eps;
        let q = b.op1(
            Op::HeadNorm {
                heads: c.num_heads,
                head_dim: hd,
                eps,
            },
            vec![q],
            format!("{l}.attn.q_norm"),
        );
        let k = b.op1(
            Op::HeadNorm {
                heads: c.num_kv_heads,
                head_dim: hd,
                eps,
            },
            vec![k],
            format!("{l}.attn.k_norm"),
        );
        let a = b.op1(
            Op::Attention {
                layer: i,
                heads: c.num_heads,
                kv_heads: c.num_kv_heads,
                head_dim: hd,
                scale: 1.0 / (hd as f32).sqrt(),
            },
            vec![q, k, v],
            format!("{l}.attn"),
        );
        let o = b.linear(&format!("{p}.self_attn.o_proj"), c.hidden_size, q_dim)?;
        let o = b.matmul(a, o, format!("{l}.attn.o"));
        x = b.op1(Op::Add, vec![x, o], format!("{l}.attn_residual"));
        let h = b.rms_norm(x, None, format!("{l}.mlp_norm"))?;
        let fc1 = b.linear(&format!("{p}.mlp.fc1"), c.intermediate_size, c.hidden_size)?;
        let f = b.matmul(h, fc1, format!("{l}.mlp.fc1"));
        let f = b.op1(
            Op::Act(Activation::ReluSquared),
            vec![f],
            format!("{l}.mlp.relu2"),
        );
        let fc2 = b.linear(&format!("{p}.mlp.fc2"), c.hidden_size, c.intermediate_size)?;
        let d = b.matmul(f, fc2, format!("{l}.mlp.fc2"));
        x = b.op1(Op::Add, vec![x, d], format!("{l}.mlp_residual"));
    }
    if logits == LogitRows::Last {
        x = b.op1(Op::LastRow, vec![x], "last_row".into());
    }
    let h = b.rms_norm(x, None, "final_norm".into())?;
    let head = b.linear("lm_head", c.vocab_size, c.hidden_size)?;
    let mut out = b.matmul(h, head, "lm_head".into());
    if let Some(cap) = c.final_logit_softcap {
        out = b.op1(Op::Softcap { cap }, vec![out], "softcap".into());
    }
    Ok(b.finish(out))
}

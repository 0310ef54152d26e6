//! nanochat's GPT. Two sources share this builder:
//! - the published form as Hugging Face's `NanoChatForCausalLM` (era A of the spec), and
//! - nanochat's own checkpoints of every era, converted by `scripts/convert_nanochat.py`
//!   (`config.nanochat` set), which add residual lambdas, gated value embeddings, per-layer
//!   sliding windows, a q/k scale, the bigram smear and backout (spec §0, §3).
//!
//! Common to all: parameter-free RMSNorm (also right after the embedding), RoPE rotating by −θ
//! then QK-norm, relu² MLP without a gate, untied head, soft-capped logits.

use super::{Builder, LogitRows};
use crate::graph::{Activation, Graph, Op, Value};
use crate::model::{LoadError, ModelConfig, Weights};

/// Tensor names of the two layouts.
struct Names {
    embed: &'static str,
    layer: fn(usize) -> String,
    q: &'static str,
    k: &'static str,
    v: &'static str,
    o: &'static str,
    fc1: &'static str,
    fc2: &'static str,
}

const HF: Names = Names {
    embed: "model.embed_tokens.weight",
    layer: |i| format!("model.layers.{i}"),
    q: "self_attn.q_proj",
    k: "self_attn.k_proj",
    v: "self_attn.v_proj",
    o: "self_attn.o_proj",
    fc1: "mlp.fc1",
    fc2: "mlp.fc2",
};

const NATIVE: Names = Names {
    embed: "transformer.wte.weight",
    layer: |i| format!("transformer.h.{i}"),
    q: "attn.c_q",
    k: "attn.c_k",
    v: "attn.c_v",
    o: "attn.c_proj",
    fc1: "mlp.c_fc",
    fc2: "mlp.c_proj",
};

/// A scalar parameter (`resid_lambdas[i]`, `smear_lambda`, ...), read once into the graph.
fn scalar(w: &Weights, name: &str, index: usize, len: usize) -> Result<f32, LoadError> {
    let t = w.get_shaped(name, &[len])?;
    Ok(t.to_f32_vec()[index])
}

pub(super) fn build(
    config: &ModelConfig,
    weights: &Weights,
    logits: LogitRows,
) -> Result<Graph, LoadError> {
    let mut b = Builder::new(config, weights);
    let c = config;
    let native = c.nanochat.as_ref();
    let names = if native.is_some() { &NATIVE } else { &HF };
    let rows = match native {
        Some(n) => n.padded_vocab_size,
        None => b.vocab_rows(names.embed)?,
    };
    let (hd, q_dim, kv_dim, l) = (c.head_dim, c.q_dim(), c.kv_dim(), c.num_layers);

    let e = b.embed_rows(names.embed, rows)?;
    let e = b.rms_norm(e, None, "embed_norm".into())?;
    let mut x = e;
    if let Some(n) = native.filter(|n| n.smear) {
        weights.get_shaped("smear_gate.weight", &[1, 24])?;
        let lambda = scalar(weights, "smear_lambda", 0, 1)?;
        x = b.op1(
            Op::Smear {
                gate: "smear_gate.weight".into(),
                lambda,
                channels: 24,
            },
            vec![e],
            format!("smear (era {})", n.era),
        );
    }
    let x0 = x;
    let mut backout: Option<Value> = None;
    for i in 0..l {
        let p = (names.layer)(i);
        let tag = format!("layers.{i}");
        if native.is_some_and(|n| n.resid_lambdas) {
            let a = scalar(weights, "resid_lambdas", i, l)?;
            let bb = scalar(weights, "x0_lambdas", i, l)?;
            x = b.op1(
                Op::Combine { a, b: bb },
                vec![x, x0],
                format!("{tag}.lambdas"),
            );
        }
        let h = b.rms_norm(x, None, format!("{tag}.attn_norm"))?;
        let q = b.linear(&format!("{p}.{}", names.q), q_dim, c.hidden_size)?;
        let k = b.linear(&format!("{p}.{}", names.k), kv_dim, c.hidden_size)?;
        let v = b.linear(&format!("{p}.{}", names.v), kv_dim, c.hidden_size)?;
        let q = b.matmul(h, q, format!("{tag}.attn.q"));
        let k = b.matmul(h, k, format!("{tag}.attn.k"));
        let mut v = b.matmul(h, v, format!("{tag}.attn.v"));
        if let Some(n) = native.filter(|n| n.value_embed_layers.contains(&i)) {
            let gate = format!("{p}.attn.ve_gate.weight");
            weights.get_shaped(&gate, &[c.num_kv_heads, n.ve_gate_channels])?;
            let ve = b.embed_table(
                &format!("value_embeds.{i}.weight"),
                rows,
                kv_dim,
                format!("{tag}.value_embed"),
            )?;
            v = b.op1(
                Op::GatedValueAdd {
                    gate,
                    channels: n.ve_gate_channels,
                    kv_heads: c.num_kv_heads,
                    head_dim: hd,
                    scale: n.ve_gate_scale,
                },
                vec![v, h, ve],
                format!("{tag}.attn.ve_mix"),
            );
        }
        let q = b.op1(
            Op::Rope {
                heads: c.num_heads,
                head_dim: hd,
                local: false,
            },
            vec![q],
            format!("{tag}.attn.rope_q"),
        );
        let k = b.op1(
            Op::Rope {
                heads: c.num_kv_heads,
                head_dim: hd,
                local: false,
            },
            vec![k],
            format!("{tag}.attn.rope_k"),
        );
        let (eps, scale) = (c.rms_norm_eps, native.map_or(1.0, |n| n.qk_scale));
        let q = b.op1(
            Op::HeadNorm {
                heads: c.num_heads,
                head_dim: hd,
                eps,
                scale,
                weight: None,
            },
            vec![q],
            format!("{tag}.attn.q_norm"),
        );
        let k = b.op1(
            Op::HeadNorm {
                heads: c.num_kv_heads,
                head_dim: hd,
                eps,
                scale,
                weight: None,
            },
            vec![k],
            format!("{tag}.attn.k_norm"),
        );
        let a = b.op1(
            Op::Attention {
                layer: i,
                heads: c.num_heads,
                kv_heads: c.num_kv_heads,
                head_dim: hd,
                scale: 1.0 / (hd as f32).sqrt(),
                window: native.and_then(|n| n.window_sizes[i]),
            },
            vec![q, k, v],
            format!("{tag}.attn"),
        );
        let o = b.linear(&format!("{p}.{}", names.o), c.hidden_size, q_dim)?;
        let o = b.matmul(a, o, format!("{tag}.attn.o"));
        x = b.op1(Op::Add, vec![x, o], format!("{tag}.attn_residual"));
        let h = b.rms_norm(x, None, format!("{tag}.mlp_norm"))?;
        let fc1 = b.linear(
            &format!("{p}.{}", names.fc1),
            c.intermediate_size,
            c.hidden_size,
        )?;
        let f = b.matmul(h, fc1, format!("{tag}.mlp.fc1"));
        let f = b.op1(
            Op::Act(Activation::ReluSquared),
            vec![f],
            format!("{tag}.mlp.relu2"),
        );
        let fc2 = b.linear(
            &format!("{p}.{}", names.fc2),
            c.hidden_size,
            c.intermediate_size,
        )?;
        let d = b.matmul(f, fc2, format!("{tag}.mlp.fc2"));
        x = b.op1(Op::Add, vec![x, d], format!("{tag}.mlp_residual"));
        if native.and_then(|n| n.backout_layer) == Some(i) {
            backout = Some(x);
        }
    }
    if let Some(xb) = backout {
        let lambda = scalar(weights, "backout_lambda", 0, 1)?;
        x = b.op1(
            Op::Combine { a: 1.0, b: -lambda },
            vec![x, xb],
            "backout".into(),
        );
    }
    if logits == LogitRows::Last {
        x = b.op1(Op::LastRow, vec![x], "last_row".into());
    }
    let h = b.rms_norm(x, None, "final_norm".into())?;
    // The head may have padded rows; only the first vocab_size are logits.
    let head = b.linear_rows("lm_head", c.vocab_size, rows, c.hidden_size)?;
    let mut out = b.matmul(h, head, "lm_head".into());
    if let Some(cap) = c.final_logit_softcap {
        out = b.op1(Op::Softcap { cap }, vec![out], "softcap".into());
    }
    Ok(b.finish(out))
}

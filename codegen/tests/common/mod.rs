//! The hand-built programs the codegen tests share.
#![allow(dead_code)]

use kiln_codegen::*;

/// A two-layer llama-like program: d=64, 4 heads (2 kv) of 16, ffn 96, vocab 100.
pub fn small(batch: usize) -> DecodeProgram {
    let mut p = DecodeProgram::new(batch, RopeStyle::HalfSplit);
    p.layers = 2;
    p.kv_heads = 2;
    p.head_dim = 16;
    p.vocab = 100;
    let emb = p.weight("embed", 100, 64);
    let x0 = p.buffer("embed", 64);
    p.instrs.push(Instr::Embed {
        table: emb,
        out: x0,
    });
    let mut x = x0;
    for l in 0..2 {
        let n1 = p.weight_f32(&format!("{l}.n1"), 1, 64);
        let wq = p.weight(&format!("{l}.q"), 64, 64);
        let wk = p.weight(&format!("{l}.k"), 32, 64);
        let wv = p.weight(&format!("{l}.v"), 32, 64);
        let qkv = p.buffer(format!("{l}.qkv"), 128);
        p.instrs.push(Instr::NormMatvec {
            norm: Some(NormSpec {
                weight: Some(n1),
                eps: 1e-5,
            }),
            weights: vec![wq, wk, wv],
            biases: vec![],
            input: ColRange::whole(x, 64),
            out: qkv,
            act: None,
        });
        let q = p.buffer(format!("{l}.q_rope"), 64);
        p.instrs.push(Instr::Rope {
            heads: 4,
            head_dim: 16,
            input: ColRange {
                buf: qkv,
                col: 0,
                cols: 64,
            },
            out: q,
        });
        p.instrs.push(Instr::RopeKvAppend {
            layer: l,
            kv_heads: 2,
            head_dim: 16,
            k: ColRange {
                buf: qkv,
                col: 64,
                cols: 32,
            },
            v: ColRange {
                buf: qkv,
                col: 96,
                cols: 32,
            },
            rope: true,
        });
        let att = p.buffer(format!("{l}.att"), 64);
        p.instrs.push(Instr::AttentionDecode {
            layer: l,
            heads: 4,
            kv_heads: 2,
            head_dim: 16,
            scale: 0.25,
            window: None,
            q: ColRange::whole(q, 64),
            rope_q: false,
            append: None,
            out: att,
        });
        let wo = p.weight(&format!("{l}.o"), 64, 64);
        let h = p.buffer(format!("{l}.h"), 64);
        p.instrs.push(Instr::MatvecResidual {
            weight: wo,
            bias: None,
            input: ColRange::whole(att, 64),
            residual: ColRange::whole(x, 64),
            out: h,
        });
        let n2 = p.weight_f32(&format!("{l}.n2"), 1, 64);
        let wg = p.weight(&format!("{l}.gate"), 96, 64);
        let wu = p.weight(&format!("{l}.up"), 96, 64);
        let m = p.buffer(format!("{l}.mlp"), 96);
        p.instrs.push(Instr::GatedMlp {
            norm: Some(NormSpec {
                weight: Some(n2),
                eps: 1e-5,
            }),
            gate: wg,
            up: wu,
            act: Act::Silu,
            input: ColRange::whole(h, 64),
            out: m,
        });
        let wd = p.weight(&format!("{l}.down"), 64, 96);
        let y = p.buffer(format!("{l}.out"), 64);
        p.instrs.push(Instr::MatvecResidual {
            weight: wd,
            bias: None,
            input: ColRange::whole(m, 96),
            residual: ColRange::whole(h, 64),
            out: y,
        });
        x = y;
    }
    let nf = p.weight_f32("norm", 1, 64);
    let logits = p.buffer("logits", 100);
    p.instrs.push(Instr::LmHead {
        norm: Some(NormSpec {
            weight: Some(nf),
            eps: 1e-5,
        }),
        weight: emb,
        bias: None,
        input: ColRange::whole(x, 64),
        out: logits,
        softcap: None,
    });
    p.instrs.push(Instr::Sample {
        logits: ColRange::whole(logits, 100),
    });
    p.instrs.push(Instr::StepEnd);
    p.validate().unwrap();
    p
}

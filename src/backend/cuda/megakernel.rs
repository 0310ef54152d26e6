//! Lowering the CPU decode [`ExecutionPlan`] to a [`DecodeProgram`] for the decode megakernel
//! (`kiln-codegen`), and generating its CUDA C. Pure Rust: no `cuda` feature, no GPU.
//!
//! Each plan value gets its own buffer (the program is single-assignment); `LastRow` is an
//! alias (one token row per sequence in decode); a `Rope` feeding only an attention's keys is
//! fused into `RopeKvAppend` (and with [`fuse_attention`] the KV append and a `Rope` feeding
//! only an attention's queries are fused into its `AttentionDecode`); a `Softcap` of the logits is fused into `LmHead`; `Add`, `Combine`,
//! `Mul`, a standalone `Act` or `Softcap` become `Elementwise`; nanochat's `GatedValueAdd` and
//! `Smear` (whose previous-position embedding lives in the cache's per-position state) have their
//! own instructions; matmul biases, norm weights and gates are f32 weights (the `wt_f32` table,
//! as the CPU keeps them), matrices and embedding tables bf16. The program ends with `Sample` and
//! `StepEnd`. What is still a [`LowerError::Unsupported`] (no supported model builds them): a
//! residual-add matmul with a norm prologue or several linears, a gated matmul of other than two
//! linears or with biases.
//!
//! The generated kernel compiles with NVRTC (`tests/megakernel.rs`), and `super::GraphDecoder`
//! (feature `cuda`) launches it; both have run on an H200 (docs/gpu-results.md): greedy tokens
//! equal to the per-op path and the CPU up to near ties on every fixture that lowers and the
//! demo model. `tests/megakernel_interp.rs` runs the lowered programs in kiln-codegen's CPU
//! interpreter against the CPU backend, which is how the lowering is checked without a GPU.

use std::collections::HashMap;

use kiln_codegen::interp::WeightData;
use kiln_codegen::{
    Act, ColRange, DecodeProgram, Ewise, Instr, KvAppend, LowerError, NormSpec, RopeStyle,
    Schedule, TileConfig, WeightDtype,
};

use crate::graph::{Activation, Epilogue, Norm, Op, Value};
use crate::model::{LoadError, RopeStyle as ModelRope, Weights};
use crate::plan::ExecutionPlan;

fn act(a: Activation, label: &str) -> Result<Act, LowerError> {
    match a {
        Activation::Silu => Ok(Act::Silu),
        Activation::ReluSquared => Ok(Act::ReluSquared),
        Activation::GeluTanh => Err(LowerError::Unsupported {
            op: "gelu_tanh activation (Gemma 3's MLP)".into(),
            label: label.into(),
        }),
    }
}

/// Lowers a decode plan to a program for `batch` sequences ([`lower_decode_with`] with
/// [`fuse_attention`] from the environment).
pub fn lower_decode(plan: &ExecutionPlan, batch: usize) -> Result<DecodeProgram, LowerError> {
    lower_decode_with(plan, batch, fuse_attention())
}

/// Whether the decode program folds each layer's query RoPE and KV append into its attention
/// tiles: on unless `KILN_MK_FUSE_ATTN=0`. One dependent phase per layer fewer (four instead of
/// five on a Llama-style layer), paid for with each query head of a group rotating and writing
/// its KV head's new k and v itself. Same values, same bits on the CPU interpreter
/// (`tests/megakernel_interp.rs`). Every megakernel GPU test passes under it (runs 10 and 11 on
/// an H200; run 12 on an H100, with the preload and run 11's attention shares); on an H100 (run
/// 12) SmolLM2-135M with it and the preload decoded 1,143 tokens/s at batch 1 and 4,753 at
/// batch 8, against 1,144 and 4,643 with the preload alone (docs/gpu-results.md). Why: a
/// SmolLM2-135M step was a chain of about 150 dependent phases, most of it waiting (runs 8–11).
pub fn fuse_attention() -> bool {
    std::env::var("KILN_MK_FUSE_ATTN").map_or(true, |v| v.trim() != "0")
}

/// Lowers a decode plan to a program for `batch` sequences, with or without the attention
/// fusion ([`fuse_attention`]). Sampling is not part of it: the kernel reads its controls
/// (`MkControl`) at run time.
pub fn lower_decode_with(
    plan: &ExecutionPlan,
    batch: usize,
    fuse: bool,
) -> Result<DecodeProgram, LowerError> {
    let g = &plan.graph;
    let style = match g.rope.style {
        ModelRope::HalfSplit => RopeStyle::HalfSplit,
        ModelRope::Interleaved => RopeStyle::Interleaved,
        ModelRope::HalfSplitNegated => RopeStyle::HalfSplitNegated,
    };
    let mut p = DecodeProgram::new(batch, style);
    p.layers = g.kv.layers;
    p.kv_heads = g.kv.kv_heads;
    p.head_dim = g.kv.head_dim;
    p.state_dim = g.kv.state_dim;
    p.vocab = g.vocab_size;
    let uses = g.use_counts();
    let mut val: HashMap<Value, ColRange> = HashMap::new();
    // Rope nodes fused into the KV append (their input, by node).
    let mut fused_rope: HashMap<usize, Value> = HashMap::new();
    // With `fuse`: Rope nodes fused into the attention as its query (their input, by node).
    let mut fused_qrope: HashMap<usize, Value> = HashMap::new();
    let unsupported = |op: &Op, label: &str| LowerError::Unsupported {
        op: op.name().to_string(),
        label: label.to_string(),
    };
    let get = |val: &HashMap<Value, ColRange>, v: Value| {
        val.get(&v)
            .copied()
            .ok_or_else(|| LowerError::Invalid(format!("value {v:?} not lowered")))
    };
    let norm_spec = |p: &mut DecodeProgram, n: &Option<Norm>, cols: usize| {
        n.as_ref().map(|n| NormSpec {
            weight: n.weight.as_ref().map(|w| p.weight_f32(w, 1, cols)),
            eps: n.eps,
        })
    };
    for ins in &plan.instrs {
        let id = ins.node;
        let node = &g.nodes[id];
        let label = node.label.as_str();
        let input = |k: usize| get(&val, node.inputs[k]);
        let single_out = |p: &mut DecodeProgram, val: &mut HashMap<Value, ColRange>| {
            let cols = node.outputs[0].cols;
            let b = p.buffer(label, cols);
            val.insert(Value::new(id, 0), ColRange::whole(b, cols));
            b
        };
        match &node.op {
            Op::TokenIds => {}
            Op::Embed { table, dim, .. } => {
                let t = p.weight(table, g.vocab_size, *dim);
                let out = single_out(&mut p, &mut val);
                p.instrs.push(Instr::Embed { table: t, out });
            }
            Op::RmsNorm(n) => {
                let x = input(0)?;
                let norm = norm_spec(&mut p, &Some(n.clone()), x.cols).expect("some");
                let out = single_out(&mut p, &mut val);
                p.instrs.push(Instr::RmsNorm {
                    norm,
                    input: x,
                    out,
                });
            }
            Op::MatMul {
                linears,
                norm,
                epilogue,
            } => {
                let x = input(0)?;
                let nspec = norm_spec(&mut p, norm, x.cols);
                let ws: Vec<usize> = linears
                    .iter()
                    .map(|l| p.weight(&l.weight, l.out, l.inp))
                    .collect();
                // Biases are f32 vectors of the linear's output rows, as the CPU keeps them.
                let bs: Vec<Option<usize>> = linears
                    .iter()
                    .map(|l| l.bias.as_ref().map(|b| p.weight_f32(b, 1, l.out)))
                    .collect();
                // The logits: the matmul the graph output is (or whose softcap it is).
                let out_node = g.output.node;
                let softcap_of_this = match &g.nodes[out_node].op {
                    Op::Softcap { cap } if g.nodes[out_node].inputs[0] == Value::new(id, 0) => {
                        Some(*cap)
                    }
                    _ => None,
                };
                let is_logits = out_node == id || softcap_of_this.is_some();
                match epilogue {
                    _ if is_logits && linears.len() == 1 && *epilogue == Epilogue::None => {
                        let out = single_out(&mut p, &mut val);
                        if softcap_of_this.is_some() {
                            val.insert(g.output, ColRange::whole(out, linears[0].out));
                        }
                        p.instrs.push(Instr::LmHead {
                            norm: nspec,
                            weight: ws[0],
                            bias: bs[0],
                            input: x,
                            out,
                            softcap: softcap_of_this,
                        });
                    }
                    Epilogue::None | Epilogue::Activation(_) => {
                        let total: usize = linears.iter().map(|l| l.out).sum();
                        let b = p.buffer(label, total);
                        let mut col = 0;
                        for (port, l) in linears.iter().enumerate() {
                            let r = ColRange {
                                buf: b,
                                col,
                                cols: l.out,
                            };
                            if node.outputs.len() == linears.len() {
                                val.insert(Value::new(id, port), r);
                            }
                            col += l.out;
                        }
                        if node.outputs.len() != linears.len() {
                            val.insert(Value::new(id, 0), ColRange::whole(b, total));
                        }
                        p.instrs.push(Instr::NormMatvec {
                            norm: nspec,
                            weights: ws,
                            biases: if bs.iter().any(Option::is_some) {
                                bs
                            } else {
                                vec![]
                            },
                            input: x,
                            out: b,
                            act: match epilogue {
                                Epilogue::Activation(a) => Some(act(*a, label)?),
                                _ => None,
                            },
                        });
                    }
                    Epilogue::ResidualAdd if linears.len() == 1 && norm.is_none() => {
                        let residual = input(1)?;
                        let out = single_out(&mut p, &mut val);
                        p.instrs.push(Instr::MatvecResidual {
                            weight: ws[0],
                            bias: bs[0],
                            input: x,
                            residual,
                            out,
                        });
                    }
                    Epilogue::Gated(_) if bs.iter().any(Option::is_some) => {
                        return Err(LowerError::Unsupported {
                            op: "gated matmul with biases".into(),
                            label: label.into(),
                        })
                    }
                    Epilogue::Gated(a) if linears.len() == 2 => {
                        let out = single_out(&mut p, &mut val);
                        p.instrs.push(Instr::GatedMlp {
                            norm: nspec,
                            gate: ws[0],
                            up: ws[1],
                            act: act(*a, label)?,
                            input: x,
                            out,
                        });
                    }
                    _ => return Err(unsupported(&node.op, label)),
                }
            }
            Op::Rope { local: true, .. } => {
                return Err(LowerError::Unsupported {
                    op: "rope with the local layers' own frequencies (Gemma 3)".into(),
                    label: label.into(),
                })
            }
            Op::Rope {
                heads, head_dim, ..
            } => {
                // Whether this rope's only reader is input `slot` of an attention.
                let only_attention_input = |slot: usize| {
                    uses[id] == 1
                        && g.uses(Value::new(id, 0)).iter().all(|&(n, k)| {
                            k == slot && matches!(g.nodes[n].op, Op::Attention { .. })
                        })
                };
                // Fused into the KV append when its only reader is an attention's key input,
                // and with `fuse` into the attention when it is its query input.
                if only_attention_input(1) {
                    fused_rope.insert(id, node.inputs[0]);
                    continue;
                }
                if fuse && only_attention_input(0) {
                    fused_qrope.insert(id, node.inputs[0]);
                    continue;
                }
                let x = input(0)?;
                let out = single_out(&mut p, &mut val);
                p.instrs.push(Instr::Rope {
                    heads: *heads,
                    head_dim: *head_dim,
                    input: x,
                    out,
                });
            }
            Op::HeadNorm {
                weight: Some(_), ..
            } => {
                return Err(LowerError::Unsupported {
                    op: "head_norm with a weight (the q/k norm of Qwen3 and Gemma 3)".into(),
                    label: label.into(),
                })
            }
            Op::HeadNorm {
                heads,
                head_dim,
                eps,
                scale,
                weight: None,
            } => {
                let x = input(0)?;
                let out = single_out(&mut p, &mut val);
                p.instrs.push(Instr::HeadNorm {
                    heads: *heads,
                    head_dim: *head_dim,
                    eps: *eps,
                    scale: *scale,
                    input: x,
                    out,
                });
            }
            Op::Attention {
                layer,
                heads,
                kv_heads,
                head_dim,
                scale,
                window,
            } => {
                // Input `slot`, or the un-rotated input of the rope fused into it (and whether
                // one was).
                let unrotated = |fused: &HashMap<usize, Value>, slot: usize| match fused
                    .get(&node.inputs[slot].node)
                {
                    Some(&pre) => Ok((get(&val, pre)?, true)),
                    None => Ok((input(slot)?, false)),
                };
                let (q, rope_q) = unrotated(&fused_qrope, 0)?;
                let (k, rope) = unrotated(&fused_rope, 1)?;
                let v = input(2)?;
                let kv_append = KvAppend { k, v, rope };
                if !fuse {
                    p.instrs.push(Instr::RopeKvAppend {
                        layer: *layer,
                        kv_heads: *kv_heads,
                        head_dim: *head_dim,
                        k,
                        v,
                        rope,
                    });
                }
                let out = single_out(&mut p, &mut val);
                p.instrs.push(Instr::AttentionDecode {
                    layer: *layer,
                    heads: *heads,
                    kv_heads: *kv_heads,
                    head_dim: *head_dim,
                    scale: *scale,
                    window: *window,
                    q,
                    rope_q,
                    append: fuse.then_some(kv_append),
                    out,
                });
            }
            Op::LastRow => {
                let x = input(0)?;
                val.insert(Value::new(id, 0), x);
            }
            Op::Softcap { .. } if val.contains_key(&Value::new(id, 0)) => {}
            Op::Add | Op::Combine { .. } | Op::Mul | Op::Act(_) | Op::Softcap { .. } => {
                let op = match &node.op {
                    Op::Add => Ewise::Combine { a: 1.0, b: 1.0 },
                    Op::Combine { a, b } => Ewise::Combine { a: *a, b: *b },
                    Op::Mul => Ewise::Mul,
                    Op::Act(a) => Ewise::Act(act(*a, label)?),
                    Op::Softcap { cap } => Ewise::Softcap(*cap),
                    _ => unreachable!("matched above"),
                };
                let x = input(0)?;
                let y = if op.binary() { Some(input(1)?) } else { None };
                let out = single_out(&mut p, &mut val);
                p.instrs.push(Instr::Elementwise { op, x, y, out });
            }
            Op::GatedValueAdd {
                gate,
                channels,
                kv_heads,
                head_dim,
                scale,
            } => {
                let (v, h, ve) = (input(0)?, input(1)?, input(2)?);
                let gate = p.weight_f32(gate, *kv_heads, *channels);
                let out = single_out(&mut p, &mut val);
                p.instrs.push(Instr::GatedValueAdd {
                    gate,
                    channels: *channels,
                    kv_heads: *kv_heads,
                    head_dim: *head_dim,
                    scale: *scale,
                    v,
                    h,
                    ve,
                    out,
                });
            }
            Op::Smear {
                gate,
                lambda,
                channels,
            } => {
                let x = input(0)?;
                let gate = p.weight_f32(gate, 1, *channels);
                let out = single_out(&mut p, &mut val);
                p.instrs.push(Instr::Smear {
                    gate,
                    lambda: *lambda,
                    channels: *channels,
                    input: x,
                    out,
                });
            }
        }
    }
    let logits = get(&val, g.output)?;
    p.instrs.push(Instr::Sample { logits });
    p.instrs.push(Instr::StepEnd);
    p.validate()?;
    Ok(p)
}

/// A lowered program, its schedule and the full NVRTC-ready source.
pub struct Megakernel {
    pub program: DecodeProgram,
    pub schedule: Schedule,
    pub source: String,
    /// Whether the source stages matvec weights in shared memory ([`stage_weights`]).
    pub staged: bool,
}

impl Megakernel {
    /// Dynamic shared memory the kernel is launched with: the two matvec staging buffers
    /// (`MK_STAGE_BYTES` each), none when staging is compiled out ([`stage_weights`]).
    pub fn shared_bytes(&self) -> usize {
        if self.staged {
            2 * self.schedule.config.stage_bytes
        } else {
            0
        }
    }
}

/// Output rows per matvec tile on the GPU. Measured on an H200 (2026-11-26, `kiln-bench
/// --synthetic … --device cuda --decode megakernel -p 0 -n 64 --batch 1,8 -r 3`): 8 rows (one
/// per warp) decode 1.9× faster than 32 at batch 1 on both the SmolLM2-135M and the
/// Llama-3.2-1B shapes (451 vs 237 and 290 vs 150 tokens/s): a phase's matvec spreads over 4×
/// the blocks and each warp makes a quarter of the dependent memory round trips.
pub const MATVEC_ROWS: usize = 8;

/// Bytes of one of the megakernel's two matvec staging buffers (its dynamic shared memory is
/// twice this): a block copies its next matvec tile's weight rows into one while its current
/// tile waits and computes from the other, and a tile holds no more rows than fit (8 rows of
/// SmolLM2's 576 columns, 8 of the Llama-3.2-1B's 2,048, 4 of its gated 2,048, 2 of its
/// 8,192-column down projection). 64 KiB beside the kernel's ~29 KB of static shared memory
/// leaves room for two 256-thread blocks per SM on sm_90, which its registers (about 106 at
/// batch 1, 128 at batch 8 under NVRTC 13.5) allow anyway; one on sm_80's 164 KB.
pub const STAGE_BYTES: usize = 32 * 1024;

/// Output rows per LM-head tile on the GPU: as many as the staging buffer holds ([`STAGE_BYTES`]
/// caps it: 28 rows of SmolLM2's 576 columns, 8 of the Llama-3.2-1B shape's 2,048).
/// `KILN_MK_HEAD_ROWS` overrides it. The LM head is the step's one wide phase of independent
/// tiles, so a block runs many of them back to back and fewer, larger tiles pay the per-tile
/// wait and signal fewer times: on an H100 (run 12, with the attention fusion and the preload)
/// SmolLM2-135M decoded 1,143 tokens/s at batch 1 with 8-row LM-head tiles, 1,193 with 16 and
/// 1,212 with 28.
pub const HEAD_ROWS: usize = 1024;

/// The tile sizes: [`MATVEC_ROWS`] (or `KILN_MK_MATVEC_ROWS` output rows per matvec tile, 1 to
/// 1024; anything else keeps the default) and [`HEAD_ROWS`] (or `KILN_MK_HEAD_ROWS`, likewise)
/// per LM-head tile, capped by [`STAGE_BYTES`]. A tuning knob for measuring the schedule on a
/// GPU: fewer rows per tile spread a small matvec over more blocks, more rows cost fewer
/// dependency waits.
pub fn tile_config() -> TileConfig {
    let mut c = TileConfig {
        matvec_rows: MATVEC_ROWS,
        stage_bytes: STAGE_BYTES,
        head_rows: HEAD_ROWS,
        ..TileConfig::default()
    };
    if let Some(rows) = env_rows("KILN_MK_HEAD_ROWS") {
        c.head_rows = rows;
    }
    if let Some(rows) = env_rows("KILN_MK_MATVEC_ROWS") {
        c.matvec_rows = rows;
    }
    if let Some(bytes) = env_stage_bytes() {
        c.stage_bytes = bytes;
    }
    c
}

/// `KILN_MK_STAGE_BYTES`: one staging buffer's bytes instead of [`STAGE_BYTES`], a multiple of
/// 16 from 1 KiB to 64 KiB (anything else keeps the default). For tests more than speed: a
/// small buffer makes the fixtures' attention tiles stage only part of their keys and reads the
/// rest from the cache, and caps their matvec tiles below the warps, so both paths run on
/// models this small.
fn env_stage_bytes() -> Option<usize> {
    std::env::var("KILN_MK_STAGE_BYTES")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|b| (1024..=65536).contains(b) && b % 16 == 0)
}

/// A rows-per-tile setting from the environment: 1 to 1024, anything else `None`.
fn env_rows(var: &str) -> Option<usize> {
    std::env::var(var)
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|r| (1..=1024).contains(r))
}

/// Whether matvec tiles copy their weights into shared memory before waiting on their inputs
/// (`MK_STAGE` in `cuda/megakernel/tiles.cuh`): on unless `KILN_MK_STAGE=0`, the switch for
/// measuring it (the tiles keep the same sizes either way).
pub fn stage_weights() -> bool {
    std::env::var("KILN_MK_STAGE").map_or(true, |v| v.trim() != "0")
}

/// Whether matvec tiles of fewer rows than warps split each row's columns across warps
/// (`MK_SPLIT` in `cuda/megakernel/tiles.cuh`), as `KILN_MK_SPLIT` says: `1` always, `0` never,
/// unset or anything else `None`, which [`generate_with`] reads as "where the schedule has such
/// a tile". Those are the Llama-3.2-1B shape's 4-row gate/up and 2-row down tiles, where all but
/// one or two of the eight warps sat idle: on an H100 (run 12, with the fusion) it decoded that
/// shape at 377 tokens/s at batch 1 against 335 without, 395 with the preload too; in the
/// second call (with the attention key staging, without the preload) 396 at batch 1 and 1,708 at
/// batch 8, against 337 and 1,196 with the preload and no split. SmolLM2-135M has no such tile,
/// and compiled in anyway it cost 9% (run 9). Every megakernel GPU test passes with it (at 4-row
/// tiles, or 2 KiB staging buffers, so that the fixtures' tiles split; run 12).
pub fn split_rows() -> Option<bool> {
    env_switch("KILN_MK_SPLIT")
}

/// A three-way switch from the environment: `1` on, `0` off, unset or anything else `None` (the
/// kernel's own choice).
fn env_switch(var: &str) -> Option<bool> {
    match std::env::var(var).as_deref().map(str::trim) {
        Ok("1") => Some(true),
        Ok("0") => Some(false),
        _ => None,
    }
}

/// Warps of a megakernel block (`MK_WARPS` in `cuda/megakernel/tiles.cuh`): a matvec tile of
/// fewer output rows leaves warps without a row unless its rows split.
pub const MK_WARPS: usize = 8;

/// Whether a schedule sizes some matvec's tiles below the kernel's warps ([`MK_WARPS`] output
/// rows), the tiles [`split_rows`] is for: judged by each matvec's first tile, so that a short
/// last tile (a remainder of rows) does not turn the split on for a whole kernel.
pub fn has_small_matvec_tiles(p: &DecodeProgram, s: &Schedule) -> bool {
    s.tiles.iter().any(|t| {
        t.index == 0
            && matches!(
                p.instrs[t.instr],
                Instr::NormMatvec { .. }
                    | Instr::MatvecResidual { .. }
                    | Instr::GatedMlp { .. }
                    | Instr::LmHead { .. }
            )
            && t.hi - t.lo < MK_WARPS
    })
}

/// Whether the kernel loads each tile's arguments, and a matvec's weight pointers, into shared
/// memory before its dependency wait (`MK_PRELOAD` in `cuda/megakernel/tiles.cuh`), as
/// `KILN_MK_PRELOAD` says: `1` always, `0` never, unset or anything else `None`, which
/// [`generate_with`] reads as "unless the rows split ([`split_rows`]) or the weights are not
/// staged ([`stage_weights`])": with either it spills at batch 1 under NVRTC 13.5 (68 and 60
/// bytes), though on an H100 (run 12) the Llama-3.2-1B shape
/// decoded 395 tokens/s with both against 377 with split rows alone. Every megakernel GPU test
/// passes under it (run 12, H100); there it took SmolLM2-135M from 1,009 to 1,144 tokens/s at
/// batch 1 and the Llama-3.2-1B shape (with the fusion) from 319 to 335, while the 1B shape at
/// batch 8 fell from 1,286 to 1,194 with the fusion and the preload together. Why: every wait
/// acquires, which leaves the SM's L1 cold, and without it a tile's first work was four
/// dependent table loads from L2.
pub fn preload_args() -> Option<bool> {
    env_switch("KILN_MK_PRELOAD")
}

/// Whether attention tiles read their earlier keys from a copy the block made in shared memory
/// before their wait (`MK_ATT_STAGE` in `cuda/megakernel/tiles.cuh`): on unless
/// `KILN_MK_ATT_STAGE=0`, the switch for measuring it. On an H100 (run 12) SmolLM2-135M decoded
/// 1,379 tokens/s at batch 1 with it, 1,218 without.
pub fn stage_attention() -> bool {
    std::env::var("KILN_MK_ATT_STAGE").map_or(true, |v| v.trim() != "0")
}

/// Whether finished tiles publish with the sequentially consistent `__threadfence` and release
/// reds of every run up to run 11 (`MK_SC_FENCE` in `cuda/megakernel/tiles.cuh`) instead of one
/// `fence.acq_rel.gpu` and relaxed reds: only when `KILN_MK_SC_FENCE=1`, the switch for
/// measuring the change.
pub fn sc_fence() -> bool {
    std::env::var("KILN_MK_SC_FENCE").is_ok_and(|v| v.trim() == "1")
}

/// Whether matvec tiles copy their input rows into shared memory once before reading them
/// (`MK_XSTAGE` in `cuda/megakernel/tiles.cuh`; same values, same bits): off unless
/// `KILN_MK_XSTAGE=1`. On an H200 (docs/gpu-results.md run 10) its megakernel tests pass; it
/// decoded SmolLM2-135M 5–6% slower and the Llama-3.2-1B shape 2% slower at batch 1 and 6% faster
/// at batch 8, so it stays opt-in until a
/// GPU run measures it.
pub fn stage_inputs() -> bool {
    std::env::var("KILN_MK_XSTAGE").is_ok_and(|v| v.trim() == "1")
}

/// Whether attention tiles stripe 32-key tiles over their warps even for short contexts
/// (`MK_ATT_CHUNKS 0` in `cuda/megakernel/tiles.cuh`): only when `KILN_MK_ATT_STRIPE=1`, the
/// switch for measuring the contiguous shares that replaced it in run 11 (SmolLM2-135M batch
/// 1 on an H200: 947 tokens/s with the shares, 842 striped).
pub fn stripe_attention() -> bool {
    std::env::var("KILN_MK_ATT_STRIPE").is_ok_and(|v| v.trim() == "1")
}

/// Where every tile's wait and work times go (`MK_TIMELINE` in `cuda/megakernel/tiles.cuh`;
/// the host's side is `backend::cuda::timeline`): the directory `KILN_MK_TIMELINE` names, if
/// set and not empty. A diagnostic, off by default.
pub fn timeline_dir() -> Option<std::path::PathBuf> {
    std::env::var_os("KILN_MK_TIMELINE")
        .filter(|v| !v.is_empty())
        .map(std::path::PathBuf::from)
}

/// Lowers, schedules ([`tile_config`]) and emits ([`generate_with`], the attention fusion as
/// [`fuse_attention`] says).
pub fn generate(plan: &ExecutionPlan, batch: usize) -> Result<Megakernel, LowerError> {
    generate_with(plan, batch, fuse_attention())
}

/// [`generate`] with the attention fusion chosen here rather than by the environment.
pub fn generate_with(
    plan: &ExecutionPlan,
    batch: usize,
    fuse: bool,
) -> Result<Megakernel, LowerError> {
    let program = lower_decode_with(plan, batch, fuse)?;
    let schedule = Schedule::build(&program, tile_config());
    let mut source = kiln_codegen::emit_source(&program, &schedule);
    let staged = stage_weights();
    if !staged {
        source.insert_str(0, "#define MK_STAGE 0\n");
    }
    let split = split_rows().unwrap_or_else(|| has_small_matvec_tiles(&program, &schedule));
    if split {
        source.insert_str(0, "#define MK_SPLIT 1\n");
    }
    if !preload_args().unwrap_or(!split && staged) {
        source.insert_str(0, "#define MK_PRELOAD 0\n");
    }
    if stage_inputs() {
        source.insert_str(0, "#define MK_XSTAGE 1\n");
    }
    if !stage_attention() {
        source.insert_str(0, "#define MK_ATT_STAGE 0\n");
    }
    if sc_fence() {
        source.insert_str(0, "#define MK_SC_FENCE 1\n");
    }
    if stripe_attention() {
        source.insert_str(0, "#define MK_ATT_CHUNKS 0\n");
    }
    if timeline_dir().is_some() {
        source.insert_str(0, "#define MK_TIMELINE 1\n");
    }
    Ok(Megakernel {
        program,
        schedule,
        source,
        staged,
    })
}

/// The values of each program weight as the kernel's tables hold them: bf16 bits (the stored
/// bits when the tensor is bf16, else rounded to nearest from f32 or dequantized blocks) or f32,
/// the first `rows · cols` elements of the tensor (a padded vocabulary keeps its real rows). What
/// a runtime uploads, and what kiln-codegen's interpreter runs on.
pub fn weight_data(p: &DecodeProgram, weights: &Weights) -> Result<Vec<WeightData>, LoadError> {
    p.weights
        .iter()
        .map(|w| {
            let t = weights.get(&w.name)?;
            let n = w.rows * w.cols;
            if t.numel() < n {
                return Err(LoadError::tensor(
                    &weights.source,
                    &w.name,
                    format!(
                        "{} elements, the decode program reads [{}, {}]",
                        t.numel(),
                        w.rows,
                        w.cols
                    ),
                ));
            }
            Ok(match w.dtype {
                WeightDtype::Bf16 => WeightData::Bf16(
                    t.to_bf16_vec()
                        .into_iter()
                        .take(n)
                        .map(|b| b.to_bits())
                        .collect(),
                ),
                WeightDtype::F32 => WeightData::F32(t.to_f32_vec().into_iter().take(n).collect()),
            })
        })
        .collect()
}

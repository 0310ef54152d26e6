//! The emitter: a [`DecodeProgram`] and its [`Schedule`] as the CUDA C of one persistent
//! `__global__ void kiln_decode_step(...)` kernel. Deterministic text.
//!
//! The kernel: every block reads the epoch `e = *epoch + 1`, then runs tiles
//! `blockIdx.x, blockIdx.x + gridDim.x, ...` (the schedule's assignment). Before a tile its
//! waits (`mk_waits`, pairs of counter and per-step count) are polled with `ld.acquire.gpu`
//! until `counter >= e * per_step`; after it, one thread fences and adds 1 to the
//! instruction's and the tile's counters. `Sample` runs one tile per batch row (rows in
//! parallel), each writing its row's next token to `tokens`, the buffer the next step's
//! embedding reads; how it samples is run-time data, the row's `MkRow` in the `MkControl` at
//! `ctl` (greedy when its temperature is 0), so rows with different parameters share a launch.
//! The `StepEnd` tile (after every sink tile, the Sample tiles included) advances each active
//! row's `pos`, writes ring entry `e % MK_RING` (the tokens, `MK_NO_TOKEN` for an inactive row,
//! the bitmask of rows whose token is one of `ctl`'s stop ids, then `e` after
//! `__threadfence_system()`) and stores `e` into `*epoch`. `pos`, `tokens`, `page_tables` and
//! `ctl` are the row table: device memory the host rewrites between launches, read at replay
//! (never baked into a captured graph); `pos[b] < 0` marks batch row `b` inactive (see
//! `cuda/megakernel/tiles.cuh`), so rows join and leave without a new capture. A tile's arguments come from its
//! instruction's row of the `mk_args` / `mk_fargs` tables, and the kernel's `switch` has one case
//! per tile kind (not per instruction), so it compiles without register spills at SmolLM2-135M's
//! 30 layers as at the small fixtures.
//!
//! Weights come from two tables indexed alike: `wt` (bf16 matrices and embedding tables) and
//! `wt_f32` (norm weights, biases and gates, f32 as the CPU keeps them), each null where the
//! other holds the weight ([`crate::WeightDtype`]). The KV cache is kiln's one paged layout
//! (`cuda/kv.cuh`, mirroring `src/kv/layout.rs`): bf16 `k_cache` / `v_cache`
//! `[block][layer][kv_head][block_size][head_dim]`, f32 `kv_state` `[block][block_size][state_dim]`
//! (nanochat's smear reads and writes it), and one page table per batch row in `page_tables`
//! (`max_blocks` int32 entries per row), which the host fills when it starts the rows.
//!
//! The tables are built once by [`tables`], which both this emitter and the CPU interpreter
//! ([`crate::interp`]) read: the interpreter's `run_tile` mirrors the kernel's `switch` below,
//! case for case, and must change with it.
//!
//! The generated source compiles with NVRTC for sm_80 and sm_90 without spills (kiln's
//! `tests/megakernel.rs`) and has run on an H200 (sm_90; docs/gpu-results.md): 256 greedy steps
//! equal to kiln's per-op CUDA path and CPU up to near ties on every fixture that lowers and the
//! demo model, compute-sanitizer clean. sm_80 has not run.

use std::fmt::Write;

use crate::program::{DecodeProgram, Ewise, Instr, NormSpec};
use crate::schedule::Schedule;

/// Device code the generated kernel needs, pasted in this order before it.
pub const COMMON_CUH: &str = include_str!("../../cuda/common.cuh");
pub const KV_CUH: &str = include_str!("../../cuda/kv.cuh");
pub const ATTENTION_CUH: &str = include_str!("../../cuda/attention.cuh");
pub const SAMPLE_CUH: &str = include_str!("../../cuda/sample.cuh");
pub const TILES_CUH: &str = include_str!("../../cuda/megakernel/tiles.cuh");

/// The kernel's name.
pub const KERNEL: &str = "kiln_decode_step";

fn f(v: f32) -> String {
    let s = format!("{v:?}");
    if s.contains('.') || s.contains('e') {
        format!("{s}f")
    } else {
        format!("{s}.0f")
    }
}

fn table(out: &mut String, name: &str, vals: &[i64]) {
    // A sentinel keeps every array non-empty.
    let _ = write!(out, "__device__ const int {name}[{}] = {{", vals.len() + 1);
    for (i, v) in vals.iter().enumerate() {
        if i % 16 == 0 {
            out.push_str("\n    ");
        }
        let _ = write!(out, "{v}, ");
    }
    out.push_str("\n    0};\n");
}

/// Integer arguments per table row (column 0 is the tile kind, `MK_K_*`).
pub const NARGS: usize = 16;
/// Float arguments per table row.
pub const NFARGS: usize = 2;

/// One row of the argument tables: the tile kind, up to `NARGS - 1` integers (weight indices,
/// `-1` for none; activation-arena offsets, `-1` for none; strides, sizes, flags) and up to
/// `NFARGS` floats.
struct Row {
    label: String,
    kind: &'static str,
    ints: Vec<i64>,
    floats: Vec<f32>,
}

/// The tile kinds: one `switch` case each in the kernel (a kind's code is its index).
pub const KINDS: [&str; 11] = [
    "MK_K_EMBED",
    "MK_K_RMS_NORM",
    "MK_K_MATVEC",
    "MK_K_ROPE",
    "MK_K_HEAD_NORM",
    "MK_K_KV_APPEND",
    "MK_K_ATTENTION",
    "MK_K_SAMPLE",
    "MK_K_STEP_END",
    "MK_K_EWISE",
    "MK_K_GATED_ADD",
];

fn kind_code(kind: &str) -> usize {
    KINDS.iter().position(|k| *k == kind).unwrap()
}

fn opt(w: &Option<usize>) -> i64 {
    w.map_or(-1, |w| w as i64)
}

/// `(nw, use_norm, eps)` of an optional norm.
fn norm_args(n: &Option<NormSpec>) -> (i64, i64, f32) {
    match n {
        None => (-1, 0, 0.0),
        Some(NormSpec { weight, eps }) => (weight.map_or(-1, |w| w as i64), 1, *eps),
    }
}

/// The argument rows of one instruction: one per segment (`NormMatvec`: one per weight).
fn instr_rows(p: &DecodeProgram, offs: &[usize], i: usize, ins: &Instr) -> Vec<Row> {
    let a = |b: usize, col: usize| (offs[b] + col) as i64;
    let stride = |b: usize| p.buffers[b].cols as i64;
    let label = format!("i{i}: {}", ins.name());
    let row = |kind, ints: Vec<i64>, floats: Vec<f32>| Row {
        label: label.clone(),
        kind,
        ints,
        floats,
    };
    // Matvec: w, up, k, x, xs, nw, use_norm, out, os, res, rs, epi, act, bias | eps, cap
    // (w, up: bf16 table; nw, bias: f32 table).
    match ins {
        Instr::Embed { table, out } => vec![row(
            "MK_K_EMBED",
            vec![*table as i64, p.buffers[*out].cols as i64, a(*out, 0)],
            vec![],
        )],
        Instr::RmsNorm { norm, input, out } => vec![row(
            "MK_K_RMS_NORM",
            vec![
                a(input.buf, input.col),
                stride(input.buf),
                input.cols as i64,
                norm.weight.map_or(-1, |w| w as i64),
                a(*out, 0),
                stride(*out),
            ],
            vec![norm.eps],
        )],
        Instr::NormMatvec {
            norm,
            weights,
            biases,
            input,
            out,
            act,
        } => {
            let (nw, un, eps) = norm_args(norm);
            let mut base = 0;
            let mut rows = Vec::new();
            for (sidx, w) in weights.iter().enumerate() {
                let mut r = row(
                    "MK_K_MATVEC",
                    vec![
                        *w as i64,
                        -1,
                        input.cols as i64,
                        a(input.buf, input.col),
                        stride(input.buf),
                        nw,
                        un,
                        a(*out, base),
                        stride(*out),
                        -1,
                        0,
                        if act.is_some() { 1 } else { 0 },
                        act.map_or(0, |x| x.code() as i64),
                        biases.get(sidx).map_or(-1, opt),
                    ],
                    vec![eps, 0.0],
                );
                r.label = format!("{label} seg {sidx}");
                rows.push(r);
                base += p.weights[*w].rows;
            }
            rows
        }
        Instr::MatvecResidual {
            weight,
            bias,
            input,
            residual,
            out,
        } => vec![row(
            "MK_K_MATVEC",
            vec![
                *weight as i64,
                -1,
                input.cols as i64,
                a(input.buf, input.col),
                stride(input.buf),
                -1,
                0,
                a(*out, 0),
                stride(*out),
                a(residual.buf, residual.col),
                stride(residual.buf),
                2,
                0,
                opt(bias),
            ],
            vec![0.0, 0.0],
        )],
        Instr::GatedMlp {
            norm,
            gate,
            up,
            act,
            input,
            out,
        } => {
            let (nw, un, eps) = norm_args(norm);
            vec![row(
                "MK_K_MATVEC",
                vec![
                    *gate as i64,
                    *up as i64,
                    input.cols as i64,
                    a(input.buf, input.col),
                    stride(input.buf),
                    nw,
                    un,
                    a(*out, 0),
                    stride(*out),
                    -1,
                    0,
                    0,
                    act.code() as i64,
                    -1,
                ],
                vec![eps, 0.0],
            )]
        }
        Instr::LmHead {
            norm,
            weight,
            bias,
            input,
            out,
            softcap,
        } => {
            let (nw, un, eps) = norm_args(norm);
            vec![row(
                "MK_K_MATVEC",
                vec![
                    *weight as i64,
                    -1,
                    input.cols as i64,
                    a(input.buf, input.col),
                    stride(input.buf),
                    nw,
                    un,
                    a(*out, 0),
                    stride(*out),
                    -1,
                    0,
                    if softcap.is_some() { 3 } else { 0 },
                    0,
                    opt(bias),
                ],
                vec![eps, softcap.unwrap_or(0.0)],
            )]
        }
        Instr::Elementwise { op, x, y, out } => {
            let (fa, fb) = match op {
                Ewise::Combine { a, b } => (*a, *b),
                Ewise::Softcap(c) => (*c, 0.0),
                Ewise::Mul | Ewise::Act(_) => (0.0, 0.0),
            };
            vec![row(
                "MK_K_EWISE",
                vec![
                    op.code() as i64,
                    match op {
                        Ewise::Act(a) => a.code() as i64,
                        _ => 0,
                    },
                    a(x.buf, x.col),
                    stride(x.buf),
                    y.map_or(-1, |y| a(y.buf, y.col)),
                    y.map_or(0, |y| stride(y.buf)),
                    a(*out, 0),
                    stride(*out),
                ],
                vec![fa, fb],
            )]
        }
        Instr::GatedValueAdd {
            gate,
            channels,
            head_dim,
            scale,
            v,
            h,
            ve,
            out,
            ..
        } => vec![row(
            "MK_K_GATED_ADD",
            vec![
                a(v.buf, v.col),
                stride(v.buf),
                a(h.buf, h.col),
                stride(h.buf),
                *channels as i64,
                *gate as i64,
                a(ve.buf, ve.col),
                stride(ve.buf),
                a(*out, 0),
                stride(*out),
                *head_dim as i64,
                0,
            ],
            vec![*scale],
        )],
        Instr::Smear {
            gate,
            lambda,
            channels,
            input,
            out,
        } => vec![row(
            "MK_K_GATED_ADD",
            vec![
                a(input.buf, input.col),
                stride(input.buf),
                a(input.buf, input.col),
                stride(input.buf),
                *channels as i64,
                *gate as i64,
                -1,
                0,
                a(*out, 0),
                stride(*out),
                input.cols as i64,
                1,
            ],
            vec![*lambda],
        )],
        Instr::Rope {
            head_dim,
            input,
            out,
            ..
        } => vec![row(
            "MK_K_ROPE",
            vec![
                a(input.buf, input.col),
                stride(input.buf),
                a(*out, 0),
                stride(*out),
                *head_dim as i64,
            ],
            vec![],
        )],
        Instr::HeadNorm {
            head_dim,
            eps,
            scale,
            input,
            out,
            ..
        } => vec![row(
            "MK_K_HEAD_NORM",
            vec![
                a(input.buf, input.col),
                stride(input.buf),
                a(*out, 0),
                stride(*out),
                *head_dim as i64,
            ],
            vec![*eps, *scale],
        )],
        Instr::RopeKvAppend {
            layer,
            kv_heads,
            head_dim,
            k,
            v,
            rope,
        } => vec![row(
            "MK_K_KV_APPEND",
            vec![
                a(k.buf, k.col),
                a(v.buf, v.col),
                stride(k.buf),
                stride(v.buf),
                *layer as i64,
                *kv_heads as i64,
                *head_dim as i64,
                *rope as i64,
            ],
            vec![],
        )],
        Instr::AttentionDecode {
            layer,
            heads,
            kv_heads,
            head_dim,
            scale,
            window,
            q,
            rope_q,
            append,
            out,
        } => {
            // g[10]: bit 0 rotate q, bit 1 append k/v first, bit 2 rotate k;
            // g[11..15): the append's k, v and their row strides (-1 / 0 without one).
            let flags = i64::from(*rope_q) | append.map_or(0, |ap| 2 | (i64::from(ap.rope) << 2));
            let (k, v, ks, vs) = match append {
                Some(ap) => (
                    a(ap.k.buf, ap.k.col),
                    a(ap.v.buf, ap.v.col),
                    stride(ap.k.buf),
                    stride(ap.v.buf),
                ),
                None => (-1, -1, 0, 0),
            };
            vec![row(
                "MK_K_ATTENTION",
                vec![
                    a(q.buf, q.col),
                    stride(q.buf),
                    a(*out, 0),
                    stride(*out),
                    *layer as i64,
                    (heads / kv_heads) as i64,
                    *kv_heads as i64,
                    *head_dim as i64,
                    window.map_or(-1, |w| w as i64),
                    flags,
                    k,
                    v,
                    ks,
                    vs,
                ],
                vec![*scale],
            )]
        }
        Instr::Sample { logits } => vec![row(
            "MK_K_SAMPLE",
            vec![
                a(logits.buf, logits.col),
                stride(logits.buf),
                logits.cols as i64,
            ],
            vec![],
        )],
        Instr::StepEnd => vec![row("MK_K_STEP_END", vec![], vec![])],
    }
}

/// The kernel's data: what [`emit_kernel`] prints as the `mk_*` tables, and what the CPU
/// interpreter ([`crate::interp`]) executes, so both run the very same argument rows.
#[derive(Clone, Debug, PartialEq)]
pub struct Tables {
    /// Per tile: instruction, segment, lo, hi.
    pub tiles: Vec<[i64; 4]>,
    /// Tile `t`'s waits are `waits[wait_start[t]..wait_start[t + 1]]`.
    pub wait_start: Vec<i64>,
    /// `(counter, per_step)`: wait until `counter >= epoch * per_step`.
    pub waits: Vec<[i64; 2]>,
    /// First argument row of each instruction; a tile's row is `arg_row[instr] + segment`.
    pub arg_row: Vec<i64>,
    /// Per row: the kind's code (index in [`KINDS`]), then its integer arguments.
    pub args: Vec<[i64; NARGS]>,
    pub fargs: Vec<[f32; NFARGS]>,
    /// Per row: the instruction (and segment) it belongs to, for comments.
    pub labels: Vec<String>,
}

/// The argument, tile and wait tables of a program and its schedule.
pub fn tables(p: &DecodeProgram, s: &Schedule) -> Tables {
    let (offs, _) = p.buffer_offsets();
    let mut tb = Tables {
        tiles: Vec::with_capacity(s.tiles.len()),
        wait_start: vec![0],
        waits: Vec::new(),
        arg_row: Vec::with_capacity(p.instrs.len()),
        args: Vec::new(),
        fargs: Vec::new(),
        labels: Vec::new(),
    };
    for t in &s.tiles {
        tb.tiles
            .push([t.instr as i64, t.segment as i64, t.lo as i64, t.hi as i64]);
        for w in &t.waits {
            tb.waits.push([w.counter as i64, w.per_step as i64]);
        }
        tb.wait_start.push(tb.waits.len() as i64);
    }
    for (i, ins) in p.instrs.iter().enumerate() {
        tb.arg_row.push(tb.args.len() as i64);
        for r in instr_rows(p, &offs, i, ins) {
            assert!(r.ints.len() < NARGS && r.floats.len() <= NFARGS);
            let mut a = [0i64; NARGS];
            a[0] = kind_code(r.kind) as i64;
            a[1..=r.ints.len()].copy_from_slice(&r.ints);
            let mut fa = [0f32; NFARGS];
            fa[..r.floats.len()].copy_from_slice(&r.floats);
            tb.args.push(a);
            tb.fargs.push(fa);
            tb.labels.push(r.label);
        }
    }
    for t in &s.tiles {
        // A tile's row is `mk_arg_row[instr] + segment`: it must stay inside its instruction.
        let end = tb
            .arg_row
            .get(t.instr + 1)
            .copied()
            .unwrap_or(tb.args.len() as i64);
        assert!((tb.arg_row[t.instr] + t.segment as i64) < end);
    }
    tb
}

/// The generated part only (no headers): what snapshot tests compare.
///
/// Instruction parameters are data, not code: every instruction (every segment of a
/// `NormMatvec`) is one row of `mk_args` (ints) and `mk_fargs` (floats), found through
/// `mk_arg_row[instr] + segment`, and the kernel's `switch` has one case per tile *kind*, each
/// calling its `__noinline__` tile function with arguments loaded from the row. The kernel's
/// size and register pressure therefore do not grow with the number of layers (one case per
/// instruction, with literal arguments, spilled about 1.3 KB per thread at SmolLM2-135M's 30
/// layers). Register / spill counts are ptxas's, through NVRTC.
pub fn emit_kernel(p: &DecodeProgram, s: &Schedule) -> String {
    let (_, arena) = p.buffer_offsets();
    let n_instr = p.instrs.len();
    let mut o = String::new();
    let _ = writeln!(
        o,
        "// Generated by kiln-codegen: decode step megakernel. Do not edit."
    );
    let _ = writeln!(
        o,
        "// batch {}, {} instructions, {} tiles, {} counters, activation arena {} floats.",
        p.batch,
        n_instr,
        s.tiles.len(),
        s.counters(),
        arena
    );
    for (i, ins) in p.instrs.iter().enumerate() {
        let _ = writeln!(
            o,
            "//   i{i}: {} x{} tiles",
            ins.name(),
            s.tiles_of_instr(i)
        );
    }
    let _ = writeln!(o, "#define MK_BATCH {}", p.batch);
    let _ = writeln!(o, "#define MK_TILES {}", s.tiles.len());
    let _ = writeln!(o, "#define MK_INSTRS {n_instr}");
    let _ = writeln!(o, "#define MK_LAYERS {}", p.layers.max(1));
    let _ = writeln!(o, "#define MK_KV_HEADS {}", p.kv_heads.max(1));
    let _ = writeln!(o, "#define MK_HEAD_DIM {}", p.head_dim.max(1));
    let _ = writeln!(o, "#define MK_ROPE_STYLE {}", p.rope_style.code());
    let _ = writeln!(o, "#define MK_NARGS {NARGS}");
    let _ = writeln!(o, "#define MK_NFARGS {NFARGS}");
    for (c, k) in KINDS.iter().enumerate() {
        let _ = writeln!(o, "#define {k} {c}");
    }
    let tb = tables(p, s);
    let tiles: Vec<i64> = tb.tiles.iter().flatten().copied().collect();
    let waits: Vec<i64> = tb.waits.iter().flatten().copied().collect();
    o.push_str("// Per tile: instruction, segment, lo, hi.\n");
    table(&mut o, "mk_tiles", &tiles);
    table(&mut o, "mk_wait_start", &tb.wait_start);
    o.push_str("// Pairs (counter, per_step): wait until counter >= epoch * per_step.\n");
    table(&mut o, "mk_waits", &waits);
    o.push_str("// First argument row of each instruction (its segments follow).\n");
    table(&mut o, "mk_arg_row", &tb.arg_row);
    o.push_str(
        "// Per row: kind, then ints (weight index or activation offset, -1 for none; strides,\n\
// sizes, flags). Matvec: w, up, k, x, xs, nw, use_norm, out, os, res, rs, epi, act, bias.\n",
    );
    let _ = writeln!(
        o,
        "__device__ const int mk_args[{}] = {{",
        (tb.args.len() + 1) * NARGS
    );
    for (r, label) in tb.args.iter().zip(&tb.labels) {
        o.push_str("    ");
        for v in r {
            let _ = write!(o, "{v}, ");
        }
        let _ = writeln!(o, "// {label}");
    }
    o.push_str("    ");
    for _ in 0..NARGS {
        o.push_str("0, ");
    }
    o.push_str("\n};\n");
    o.push_str("// Per row: floats (matvec: eps, softcap; rms_norm: eps; head_norm: eps, scale;\n// attention: scale; ewise: a, b or cap; gated_add: scale).\n");
    let _ = writeln!(
        o,
        "__device__ const float mk_fargs[{}] = {{",
        (tb.fargs.len() + 1) * NFARGS
    );
    for (r, label) in tb.fargs.iter().zip(&tb.labels) {
        o.push_str("    ");
        for v in r {
            let _ = write!(o, "{}, ", f(*v));
        }
        let _ = writeln!(o, "// {label}");
    }
    o.push_str("    ");
    for _ in 0..NFARGS {
        o.push_str("0.0f, ");
    }
    o.push_str("\n};\n");
    o.push_str(
        "#define W(i) ((i) < 0 ? nullptr : wt[i])\n\
#define WF(i) ((i) < 0 ? nullptr : wt_f32[i])\n\
#define A(i) ((i) < 0 ? nullptr : act + (i))\n\
#if MK_STAGE\n\
// A matvec tile's weights depend on nothing in the step: tile t's are copied into staging\n\
// buffer `buf` while the block's previous tile waits and computes (mk_stage_rows). Commits one\n\
// copy group, empty for a tile past the end or of another kind. Out of line, so that the\n\
// kernel's loop keeps its registers.\n\
// An attention tile's earlier keys are copied likewise (mk_stage_attention).\n\
__device__ __noinline__ void mk_stage_tile(int t, const __nv_bfloat16* const* __restrict__ wt,\n\
                                           const unsigned short* k_cache, const unsigned short* v_cache,\n\
                                           const int* page_tables, int max_blocks, int block_size,\n\
                                           const int* pos, int buf) {\n\
    if (t < MK_TILES) {\n\
        const int* g = mk_args + MK_NARGS * (mk_arg_row[mk_tiles[4 * t]] + mk_tiles[4 * t + 1]);\n\
        if (g[0] == MK_K_MATVEC) {\n\
            mk_stage_rows(W(g[1]), W(g[2]), mk_tiles[4 * t + 2], mk_tiles[4 * t + 3], g[3], buf);\n\
        } else if (g[0] == MK_K_ATTENTION) {  // as the kernel's case: lo = row * heads + head\n\
            const int heads = g[6] * g[7], lo = mk_tiles[4 * t + 2];\n\
            const int h = lo % heads, b = lo / heads;\n\
            mk_stage_attention(k_cache, v_cache, MK_LAYERS, g[5], h / g[6], g[7], g[8], block_size,\n\
                               g[9], page_tables + b * max_blocks, pos + b, buf);\n\
        }\n\
    }\n\
    mk_stage_commit();\n\
}\n\
#endif\n\
#if MK_TIMELINE\n\
// Per tile: timer at the block reaching it, at its wait's end, at its work's end; SM << 32 | block.\n\
__device__ unsigned long long mk_timeline[4 * MK_TILES];\n\
#endif\n\
extern \"C\" __global__ void __launch_bounds__(MK_THREADS)\n\
kiln_decode_step(const __nv_bfloat16* const* __restrict__ wt,\n\
                 const float* const* __restrict__ wt_f32, float* act,\n\
                 unsigned short* k_cache, unsigned short* v_cache, float* kv_state, int state_dim,\n\
                 const int* page_tables, int max_blocks, int block_size,\n\
                 int* pos, int* tokens, const float* __restrict__ inv_freq,\n\
                 unsigned* counters, unsigned* epoch_ctr,\n\
                 const MkControl* __restrict__ ctl, unsigned* ring) {\n\
    __shared__ unsigned epoch_sh;\n\
    // The last counter and target thread 0 saw reached (mk_wait); no counter is -1.\n\
    __shared__ unsigned wait_seen[2];\n\
#if MK_PRELOAD\n\
    __shared__ int pre_tile[4];\n\
    __shared__ int pre_g[MK_NARGS];\n\
    __shared__ float pre_fa[MK_NFARGS];\n\
    __shared__ const void* pre_mv[4];\n\
#endif\n\
    if (threadIdx.x == 0) {\n\
        epoch_sh = mk_ld_acquire(epoch_ctr) + 1u;\n\
        wait_seen[0] = 0xffffffffu;\n\
        wait_seen[1] = 0u;\n\
    }\n\
    __syncthreads();\n\
    // Only `t` and `buf` live across the tile calls: the epoch stays in shared memory, the instruction is\n\
    // reloaded for the signal (fewer callee-saved registers).\n\
    // Staging buffer parity: tile t's weights are in buffer `buf`, the next tile's go to the\n\
    // other.\n\
    int buf = 0;\n\
#if MK_STAGE\n\
    mk_stage_tile(blockIdx.x, wt, k_cache, v_cache, page_tables, max_blocks, block_size, pos, 0);\n\
#endif\n\
    for (int t = blockIdx.x; t < MK_TILES; t += gridDim.x, buf ^= 1) {\n\
#if MK_TIMELINE\n\
        if (threadIdx.x == 0) mk_timeline[4 * t] = mk_now();\n\
#endif\n\
#if MK_STAGE\n\
        mk_stage_tile(t + gridDim.x, wt, k_cache, v_cache, page_tables, max_blocks, block_size, pos,\n\
                      buf ^ 1);\n\
#endif\n\
#if MK_PRELOAD\n\
        // The tile's header and argument row depend on nothing in the step: into shared memory\n\
        // before the wait (whose closing barrier publishes them), so that no chain of table\n\
        // loads follows it. The previous tile read its arguments before mk_signal's barrier.\n\
        if (threadIdx.x < 4) {\n\
            pre_tile[threadIdx.x] = mk_tiles[4 * t + threadIdx.x];\n\
        } else if (threadIdx.x < 4 + MK_NARGS + MK_NFARGS) {\n\
            const int j = threadIdx.x - 4, row = mk_arg_row[mk_tiles[4 * t]] + mk_tiles[4 * t + 1];\n\
            if (j < MK_NARGS) pre_g[j] = mk_args[MK_NARGS * row + j];\n\
            else pre_fa[j - MK_NARGS] = mk_fargs[MK_NFARGS * row + j - MK_NARGS];\n\
        } else if (threadIdx.x >= 64 && threadIdx.x < 68) {\n\
            // A matvec's weight, up, norm-weight and bias pointers (the weight tables are\n\
            // global memory too): W, up, nw, bias from argument slots 1, 2, 6, 14.\n\
            const int j = threadIdx.x - 64, row = mk_arg_row[mk_tiles[4 * t]] + mk_tiles[4 * t + 1];\n\
            const int* gr = mk_args + MK_NARGS * row;\n\
            const void* p = nullptr;\n\
            if (gr[0] == MK_K_MATVEC) {\n\
                const int id = gr[j == 0 ? 1 : (j == 1 ? 2 : (j == 2 ? 6 : 14))];\n\
                p = j < 2 ? (const void*)W(id) : (const void*)WF(id);\n\
            }\n\
            pre_mv[j] = p;\n\
        }\n\
#endif\n\
        mk_wait(counters, mk_waits + 2 * mk_wait_start[t], mk_wait_start[t + 1] - mk_wait_start[t], epoch_sh,\n\
                wait_seen);\n\
#if MK_TIMELINE\n\
        if (threadIdx.x == 0) mk_timeline[4 * t + 1] = mk_now();\n\
#endif\n\
#if MK_PRELOAD\n\
        const int lo = pre_tile[2], hi = pre_tile[3];\n\
        const int* g = pre_g;\n\
        const float* fa = pre_fa;\n\
#else\n\
        const int op = mk_tiles[4 * t], seg = mk_tiles[4 * t + 1];\n\
        const int lo = mk_tiles[4 * t + 2], hi = mk_tiles[4 * t + 3];\n\
        const int row = mk_arg_row[op] + seg;\n\
        const int* g = mk_args + MK_NARGS * row;\n\
        const float* fa = mk_fargs + MK_NFARGS * row;\n\
#endif\n\
        switch (g[0]) {\n\
        case MK_K_EMBED:\n\
            mk_embed(W(g[1]), g[2], tokens, pos, MK_BATCH, lo, hi, A(g[3]));\n\
            break;\n\
        case MK_K_RMS_NORM:\n\
            mk_rms_norm(A(g[1]), g[2], g[3], MK_BATCH, WF(g[4]), fa[0], A(g[5]), g[6]);\n\
            break;\n\
        case MK_K_MATVEC: {\n\
#if MK_PRELOAD\n\
            const __nv_bfloat16* mw = (const __nv_bfloat16*)pre_mv[0];\n\
            const __nv_bfloat16* mu = (const __nv_bfloat16*)pre_mv[1];\n\
            const float* mnw = (const float*)pre_mv[2];\n\
            const float* mbias = (const float*)pre_mv[3];\n\
#else\n\
            const __nv_bfloat16 *mw = W(g[1]), *mu = W(g[2]);\n\
            const float *mnw = WF(g[6]), *mbias = WF(g[14]);\n\
#endif\n\
            mk_matvec<MK_BATCH>(mw, mu, lo, hi, g[3], A(g[4]), g[5], MK_BATCH, mnw, g[7],\n\
                      fa[0], A(g[8]), g[9], A(g[10]), g[11], g[12], g[13], fa[1], mbias, buf);\n\
            break;\n\
        }\n\
        case MK_K_EWISE:\n\
            mk_ewise(g[1], g[2], A(g[3]), g[4], A(g[5]), g[6], A(g[7]), g[8], lo, hi, fa[0], fa[1],\n\
                     MK_BATCH);\n\
            break;\n\
        case MK_K_GATED_ADD:\n\
            mk_gated_add(A(g[1]), g[2], A(g[3]), g[4], g[5], WF(g[6]), A(g[7]), g[8], A(g[9]), g[10],\n\
                         g[11], lo, fa[0], g[12], kv_state, state_dim, block_size, page_tables,\n\
                         max_blocks, pos, MK_BATCH);\n\
            break;\n\
        case MK_K_ROPE:\n\
            mk_rope(A(g[1]) + lo * g[5], g[2], A(g[3]) + lo * g[5], g[4], g[5], pos, inv_freq,\n\
                    MK_ROPE_STYLE, MK_BATCH);\n\
            break;\n\
        case MK_K_HEAD_NORM:\n\
            mk_head_norm(A(g[1]) + lo * g[5], g[2], A(g[3]) + lo * g[5], g[4], g[5], fa[0], fa[1],\n\
                         MK_BATCH);\n\
            break;\n\
        case MK_K_KV_APPEND:\n\
            mk_kv_append(A(g[1]) + lo * g[7], A(g[2]) + lo * g[7], g[3], g[4], k_cache, v_cache,\n\
                         MK_LAYERS, g[5], lo, g[6], g[7], block_size, page_tables, max_blocks, pos,\n\
                         inv_freq, MK_ROPE_STYLE, g[8], MK_BATCH);\n\
            break;\n\
        case MK_K_ATTENTION: {  // one (batch row, query head): lo = row * heads + head\n\
            const int heads = g[6] * g[7], h = lo % heads, b = lo / heads, kvh = h / g[6];\n\
            if (g[10] & 2) {  // the fused KV append of this row's KV head, then a barrier\n\
                mk_kv_append(A(g[11]) + b * g[13] + kvh * g[8], A(g[12]) + b * g[14] + kvh * g[8], g[13],\n\
                             g[14], k_cache, v_cache, MK_LAYERS, g[5], kvh, g[7], g[8], block_size,\n\
                             page_tables + b * max_blocks, max_blocks, pos + b, inv_freq, MK_ROPE_STYLE,\n\
                             (g[10] >> 2) & 1, 1);\n\
                __syncthreads();\n\
            }\n\
            mk_attention(A(g[1]) + b * g[2] + h * g[8], g[2], A(g[3]) + b * g[4] + h * g[8], g[4], k_cache,\n\
                         v_cache, MK_LAYERS, g[5], kvh, g[7], g[8], block_size, fa[0], g[9],\n\
                         page_tables + b * max_blocks, max_blocks, pos + b, (g[10] & 1) ? inv_freq : nullptr,\n\
                         MK_ROPE_STYLE, 1, buf);\n\
            break;\n\
        }\n\
        case MK_K_SAMPLE:\n\
            mk_sample(A(g[1]), g[2], g[3], lo, ctl, pos, tokens);\n\
            break;\n\
        case MK_K_STEP_END:\n\
            mk_step_end(pos, tokens, MK_BATCH, ctl, ring, epoch_sh, epoch_ctr);\n\
            break;\n\
        default: break;\n\
        }\n\
#if MK_TIMELINE\n\
        __syncthreads();  // the work's end is its last warp's\n\
        if (threadIdx.x == 0) {\n\
            mk_timeline[4 * t + 2] = mk_now();\n\
            mk_timeline[4 * t + 3] = ((unsigned long long)mk_smid() << 32) | blockIdx.x;\n\
        }\n\
#endif\n\
#if MK_PRELOAD\n\
        mk_signal(counters, pre_tile[0], MK_INSTRS + t);\n\
#else\n\
        mk_signal(counters, mk_tiles[4 * t], MK_INSTRS + t);\n\
#endif\n\
    }\n\
}\n\
#undef W\n\
#undef WF\n\
#undef A\n",
    );
    let _ = writeln!(
        o,
        "// {KERNEL}: one switch case per tile kind, arguments from mk_args / mk_fargs."
    );
    o
}

/// The whole NVRTC-ready source: `common.cuh`, `kv.cuh`, `attention.cuh`, `sample.cuh`,
/// `megakernel/tiles.cuh`, then the generated kernel.
pub fn emit_source(p: &DecodeProgram, s: &Schedule) -> String {
    let mut out = format!(
        "// One matvec staging buffer's size (two make the dynamic shared memory), from the schedule.\n#define MK_STAGE_BYTES {}\n",
        s.config.stage_bytes
    );
    for h in [COMMON_CUH, KV_CUH, ATTENTION_CUH, SAMPLE_CUH, TILES_CUH] {
        for line in h.lines() {
            if !line.trim_start().starts_with("#pragma once") {
                out.push_str(line);
                out.push('\n');
            }
        }
    }
    out.push_str(&emit_kernel(p, s));
    out
}

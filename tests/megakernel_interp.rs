//! The decode megakernel's program, schedule and argument tables, executed by kiln-codegen's CPU
//! interpreter (a mirror of `cuda/megakernel/tiles.cuh`: f32 math, bf16 weights and KV cache)
//! against the CPU backend, on every fixture model and the demo model:
//!
//! * the CPU (weights rounded to bf16, as the kernel holds them) prefills each row's prompt; its
//!   KV cache (and nanochat's per-position smear state) is copied into the interpreter's bf16
//!   cache; then 16+ decode steps run in the interpreter, each in a random order of tiles that
//!   the counter waits allow, with every unwritten value poisoned, the position advancing and
//!   the greedy token fed back, as the kernel does. Every step's logits are within the bf16
//!   tolerance of `tests/gpu.rs` of the CPU decode's, and the greedy tokens are identical. Rows
//!   sit in permuted cache slots at different positions, the interpreter's blocks are a scramble
//!   of the CPU's (page tables in no order); nanochat D/G/H cross a sliding window.
//! * mutation: dropping any wait of the schedule that the others do not imply is detected
//!   (a poisoned read, or logits, tokens, caches or token ring different from the unmutated
//!   run) by an order that runs the waiting tile before the producer, on fixtures that use every
//!   tile kind.
//!
//! This verifies the lowering, the dependencies and the kernel arguments as the interpreter
//! reads them; the CUDA code itself is checked only on a GPU (`tests/gpu.rs`, run on an H200:
//! docs/gpu-results.md).

mod common;

use std::path::{Path, PathBuf};

use common::{demo_model, fixtures, rel_l2};
use kiln::backend::cpu::{CpuBackend, CpuOptions, WeightFormat, Workspace};
use kiln::backend::cuda::megakernel::{
    fuse_attention, lower_decode, lower_decode_with, tile_config, weight_data,
};
use kiln::backend::TokenRow;
use kiln::graph::build::{build_graph, LogitRows};
use kiln::kv::KvCache;
use kiln::model::Model;
use kiln::plan::PlanKind;
use kiln::plan::{ExecutionPlan, Phase};
use kiln::sample::{argmax, SamplingParams};
use kiln_codegen::interp::{
    adversarial_picker, unordered_producers, InterpError, Machine, SplitMix, BF16_POISON,
};
use kiln_codegen::{ring_stride, MkControl, MkRow, NO_TOKEN, RING};
use kiln_codegen::{DecodeProgram, Ewise, Instr, Schedule};

/// Relative L2 error allowed between interpreter and CPU logits: `tests/gpu.rs`'s bf16 GPU
/// tolerance (bf16 weights on both sides, bf16 KV cache in the interpreter only).
const TOLERANCE: f32 = 3e-2;
const STEPS: usize = 18;
const SLOTS: usize = 4;

/// Fixtures of the architectures the megakernel does not lower yet, and what it says is missing.
const NOT_LOWERED: [(&str, &str); 4] = [
    ("qwen3", "head_norm with a weight"),
    ("qwen3.f32.gguf", "head_norm with a weight"),
    ("gemma3", "head_norm with a weight"),
    ("gemma3.f32.gguf", "head_norm with a weight"),
];

/// Every fixture model the megakernel lowers: the HF directories and the GGUF files.
fn fixture_models() -> Vec<PathBuf> {
    let dir = fixtures();
    let mut out: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.join("config.json").is_file() || p.extension().is_some_and(|e| e == "gguf"))
        .filter(|p| {
            let name = p.file_name().unwrap().to_string_lossy();
            // quant_blocks.gguf holds block-format test tensors, not a model.
            !NOT_LOWERED.iter().any(|(n, _)| *n == name) && name != "quant_blocks.gguf"
        })
        .collect();
    out.sort();
    out
}

/// A CPU backend with bf16 weights, its decode program for `batch` rows and the schedule.
struct Setup {
    model: Model,
    cpu: CpuBackend,
    program: DecodeProgram,
    schedule: Schedule,
}

fn setup(path: &Path, batch: usize) -> Setup {
    setup_with(path, batch, |_, cpu| cpu.plan(PlanKind::Decode).clone())
}

/// [`setup`] with the decode plan to lower made by `plan` (the CPU backend runs its own).
fn setup_with(
    path: &Path,
    batch: usize,
    plan: impl Fn(&Model, &CpuBackend) -> ExecutionPlan,
) -> Setup {
    let model = Model::load(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let cpu = CpuBackend::new(
        &model.config,
        &model.weights,
        CpuOptions {
            threads: 0,
            weights: WeightFormat::BF16,
            ..Default::default()
        },
    )
    .unwrap();
    let program = lower_decode(&plan(&model, &cpu), batch)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    // The tile sizes the GPU runs.
    let schedule = Schedule::build(&program, tile_config());
    Setup {
        model,
        cpu,
        program,
        schedule,
    }
}

/// The smallest attention window of the program, if any layer has one.
fn min_window(p: &DecodeProgram) -> Option<usize> {
    p.instrs
        .iter()
        .filter_map(|i| match i {
            Instr::AttentionDecode { window, .. } => *window,
            _ => None,
        })
        .min()
}

/// The interpreter's block for block `cpu` of the CPU's cache: a fixed scramble of the
/// machine's `2 · SLOTS · max_blocks` blocks, the first half standing for the CPU's blocks, the
/// second for the blocks a row's decode writes ahead into (`ahead`: row `b`'s page-table entry
/// `i` is `SLOTS · max_blocks + b · max_blocks + i`).
fn scrambled(block: usize, num_blocks: usize) -> usize {
    // A bijection of 0..num_blocks: 7919 is prime and does not divide num_blocks.
    assert_ne!(num_blocks % 7919, 0);
    (block * 7919 + 3) % num_blocks
}

/// Copies positions `0..len` of `slot` (every layer, and the state) into the interpreter's
/// blocks (the CPU's blocks through [`scrambled`]) and sets batch row `b`'s page table: the
/// slot's blocks, then write-ahead blocks up to `max_blocks`.
fn copy_cache(m: &mut Machine, p: &DecodeProgram, kv: &KvCache, slot: usize, b: usize, len: usize) {
    let d = p.head_dim;
    let l = *kv.layout();
    let (mb, nb) = (m.max_blocks, m.num_blocks);
    let cpu_table = kv.page_table(slot).to_vec();
    for i in 0..mb {
        let block = match cpu_table.get(i) {
            Some(&c) => scrambled(c as usize, nb),
            None => scrambled(SLOTS * mb + b * mb + i, nb),
        };
        m.tables[b * mb + i] = block as i32;
    }
    for pos in 0..len {
        let (cb, off) = l.locate(&cpu_table, pos);
        let block = scrambled(cb, nb);
        for layer in 0..p.layers {
            let (mut k, mut v) = (Vec::new(), Vec::new());
            for g in 0..p.kv_heads {
                let (kb, vb) = kv.pool().head_block_f32(layer, cb as u32, g);
                k.extend_from_slice(&kb[off * d..(off + 1) * d]);
                v.extend_from_slice(&vb[off * d..(off + 1) * d]);
            }
            m.write_kv(layer, block, off, &k, &v);
        }
        if p.state_dim > 0 {
            m.write_state(block, off, kv.state(slot, pos));
        }
    }
}

/// Batch rows: (cache slot, prompt length). Slots are permuted, prompts of different lengths;
/// the first row's prompt ends 8 positions before the smallest window so decoding crosses it
/// (a window under 9, as in the Mistral fixture, starts it at one token).
fn rows_for(p: &DecodeProgram, batch: usize) -> Vec<(usize, usize)> {
    let long = min_window(p).map_or(20, |w| w.saturating_sub(8).max(1));
    [(2, long), (0, 5), (3, 9), (1, 13)][..batch].to_vec()
}

/// The CPU's cache and scratch, and the interpreter with every row prefilled: row `b` at
/// `rows[b] = (slot, len)` gets prompt tokens `prompt(b, i)` run on the CPU, whose cache is
/// copied into the machine's blocks in scrambled order, with the row's page table, position and
/// greedy first token.
struct Started {
    ws: Workspace,
    kv: KvCache,
    logits: Vec<f32>,
    m: Machine,
}

fn start(
    s: &Setup,
    sched: &Schedule,
    rows: &[(usize, usize)],
    capacity: usize,
    prompt: impl Fn(usize, usize) -> u32,
) -> Started {
    let p = &s.program;
    let mut ws = Workspace::new();
    let mut kv = s.cpu.new_cache(SLOTS, capacity).expect("cache");
    let mut logits = Vec::new();
    let weights = weight_data(p, &s.model.weights).unwrap();
    let inv_freq = kiln::graph::rope::inv_freq(&s.cpu.plan(PlanKind::Decode).graph.rope);
    let block_size = kv.layout().block_size;
    let max_blocks = capacity.div_ceil(block_size);
    let geometry = (2 * SLOTS * max_blocks, block_size, max_blocks);
    let mut m = Machine::new(p, sched, weights, geometry, inv_freq).unwrap();
    for (b, &(slot, len)) in rows.iter().enumerate() {
        let ids: Vec<u32> = (0..len).map(|i| prompt(b, i)).collect();
        let tr: Vec<TokenRow> = (0..len).map(|pos| TokenRow { slot, pos }).collect();
        s.cpu
            .forward(PlanKind::Prefill, &mut ws, &mut kv, &ids, &tr, &mut logits)
            .unwrap();
        copy_cache(&mut m, p, &kv, slot, b, len);
        m.pos[b] = len as i32;
        m.tokens[b] = argmax(&logits) as i32;
    }
    Started { ws, kv, logits, m }
}

/// Prefills every row on the CPU, then decodes `steps` steps in the interpreter (tile order
/// from `seed`) and on the CPU side by side, both fed the interpreter's tokens. Greedy tokens
/// must be identical; with `near_ties_allowed` (random-weight fixtures, whose logits are nearly
/// flat) a different token is accepted where the CPU's top two logits are within twice the
/// largest logit difference of the two runs. Returns the largest relative logits error and the
/// number of such near ties.
fn decode_against_cpu(
    s: &Setup,
    batch: usize,
    steps: usize,
    seed: u64,
    near_ties_allowed: bool,
    what: &str,
) -> (f32, usize) {
    let p = &s.program;
    let vocab = p.vocab;
    let rows = rows_for(p, batch);
    let capacity = rows.iter().map(|r| r.1).max().unwrap() + steps + 4;
    let Started {
        mut ws,
        mut kv,
        mut logits,
        mut m,
    } = start(s, &s.schedule, &rows, capacity, |b, i| {
        ((i * 7 + 3 + 11 * b) % vocab) as u32
    });
    let Some(Instr::Sample { logits: lr, .. }) = p.instrs.iter().rev().nth(1) else {
        panic!("{what}: the program does not end with sample, step_end");
    };
    let (offs, _) = p.buffer_offsets();
    let mut rng = SplitMix(seed);
    let (mut worst, mut ties) = (0f32, 0);
    for step in 0..steps {
        let tokens: Vec<u32> = m.tokens.iter().map(|&t| t as u32).collect();
        let tr: Vec<TokenRow> = rows
            .iter()
            .map(|r| TokenRow {
                slot: r.0,
                pos: r.1 + step,
            })
            .collect();
        assert_eq!(
            m.pos,
            tr.iter().map(|r| r.pos as i32).collect::<Vec<_>>(),
            "{what}: step {step} positions"
        );
        s.cpu
            .forward(
                PlanKind::Decode,
                &mut ws,
                &mut kv,
                &tokens,
                &tr,
                &mut logits,
            )
            .unwrap();
        m.step(&mut rng.picker())
            .unwrap_or_else(|e| panic!("{what}: step {step}: {e}"));
        let got = m.rows(offs[lr.buf], p.buffers[lr.buf].cols, lr.col, lr.cols);
        // The step end reported the step's tokens in its ring entry, the epoch last.
        let entry = &m.ring[(m.epoch as usize % RING) * ring_stride(batch)..][..batch + 2];
        let toks: Vec<u32> = m.tokens.iter().map(|&t| t as u32).collect();
        assert_eq!(entry[..batch], toks[..], "{what}: step {step} ring tokens");
        assert_eq!(
            entry[batch + 1],
            step as u32 + 1,
            "{what}: step {step} ring epoch"
        );
        for (b, g) in got.iter().enumerate() {
            let want = &logits[b * vocab..(b + 1) * vocab];
            let e = rel_l2(g, want);
            worst = worst.max(e);
            assert!(e < TOLERANCE, "{what}: step {step} row {b}: rel err {e}");
            let (got_tok, want_tok) = (m.tokens[b] as usize, argmax(want) as usize);
            if got_tok != want_tok {
                // A near tie: the CPU's two logits are closer than the two runs' largest logit
                // difference (bf16 KV cache and summation order), so either token is right.
                let diff = g
                    .iter()
                    .zip(want)
                    .fold(0f32, |d, (a, b)| d.max((a - b).abs()));
                let gap = want[want_tok] - want[got_tok];
                assert!(
                    near_ties_allowed && gap <= 2.0 * diff,
                    "{what}: step {step} row {b}: greedy token {got_tok}, CPU {want_tok} \
                     (logit gap {gap:.2e}, largest logit difference {diff:.2e}, rel err {e:.2e})"
                );
                ties += 1;
            }
        }
    }
    (worst, ties)
}

#[test]
fn interpreted_megakernel_matches_the_cpu_on_every_fixture() {
    let models = fixture_models();
    assert!(models.len() >= 17, "{} fixture models", models.len());
    let (mut total_ties, mut rows) = (0, 0);
    for path in models {
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        for (batch, seed) in [(1usize, 1u64), (3, 2)] {
            let s = setup(&path, batch);
            let what = format!("{name} batch {batch}");
            let (e, ties) = decode_against_cpu(&s, batch, STEPS, seed, true, &what);
            println!("{what}: {STEPS} steps, worst logits rel err {e:.2e}, {ties} near ties");
            total_ties += ties;
            rows += batch * STEPS;
        }
    }
    // Near ties are the exception: a systematic error would flip far more tokens.
    println!("{total_ties} near ties in {rows} greedy tokens");
    assert!(
        total_ties * 50 <= rows,
        "{total_ties} near ties in {rows} tokens"
    );
}

#[test]
fn qwen3_and_gemma3_are_refused_with_what_is_missing() {
    for (fx, missing) in NOT_LOWERED {
        let path = fixtures().join(fx);
        let model = Model::load(&path).unwrap_or_else(|e| panic!("{fx}: {e}"));
        let cpu = CpuBackend::new(&model.config, &model.weights, CpuOptions::default()).unwrap();
        let e = lower_decode(cpu.plan(PlanKind::Decode), 1)
            .err()
            .unwrap_or_else(|| panic!("{fx}: lowered"));
        assert!(
            matches!(&e, kiln_codegen::LowerError::Unsupported { op, .. } if op.contains(missing)),
            "{fx}: {e}"
        );
    }
}

#[test]
fn gemma3_without_q_k_norm_weights_is_refused_for_its_local_rope_and_gelu() {
    // With the head-norm weights dropped from its graph, the next things Gemma 3 needs are
    // named: the local layers' RoPE table, then GELU-tanh.
    let model = Model::load(fixtures().join("gemma3")).unwrap();
    let cpu = CpuBackend::new(&model.config, &model.weights, CpuOptions::default()).unwrap();
    let mut plan = cpu.plan(PlanKind::Decode).clone();
    for n in &mut plan.graph.nodes {
        if let kiln::graph::Op::HeadNorm { weight, .. } = &mut n.op {
            *weight = None;
        }
    }
    let Err(e) = lower_decode(&plan, 1) else {
        panic!("gemma3 lowered")
    };
    assert!(e.to_string().contains("local layers"), "{e}");
    for n in &mut plan.graph.nodes {
        if let kiln::graph::Op::Rope { local, .. } = &mut n.op {
            *local = false;
        }
    }
    let Err(e) = lower_decode(&plan, 1) else {
        panic!("gemma3 lowered")
    };
    assert!(e.to_string().contains("gelu_tanh"), "{e}");
}

#[test]
fn sliding_windows_are_crossed_on_nanochat_d_g_h() {
    for fx in ["nanochat_D", "nanochat_G", "nanochat_H"] {
        let s = setup(&fixtures().join(fx), 2);
        let w = min_window(&s.program).unwrap_or_else(|| panic!("{fx}: no window"));
        let (_, first) = rows_for(&s.program, 2)[0];
        // The first row attends past its window within the steps the test decodes.
        assert!(
            first < w && first + STEPS > w + 1,
            "{fx}: {first} + {STEPS} vs {w}"
        );
        decode_against_cpu(&s, 2, STEPS, 3, true, fx);
    }
}

#[test]
fn unfused_plans_lower_add_mul_and_act_and_match_the_cpu() {
    // The graph before the fusion passes: residual adds, the SwiGLU / relu² activation and
    // product are standalone ops, lowered to elementwise tiles. The CPU runs its fused plan.
    for fx in ["llama_tied", "nanochat_H"] {
        let path = fixtures().join(fx);
        let s = setup_with(&path, 2, |m, _| {
            let g = build_graph(&m.config, &m.weights, LogitRows::Last).unwrap();
            ExecutionPlan::lower(g, Phase::Decode)
        });
        let has = |f: &dyn Fn(&Ewise) -> bool| {
            s.program
                .instrs
                .iter()
                .any(|i| matches!(i, Instr::Elementwise { op, .. } if f(op)))
        };
        assert!(
            has(&|op| *op == Ewise::Combine { a: 1.0, b: 1.0 }),
            "{fx}: add"
        );
        assert!(has(&|op| matches!(op, Ewise::Act(_))), "{fx}: act");
        if fx == "llama_tied" {
            assert!(has(&|op| *op == Ewise::Mul), "{fx}: mul");
        }
        decode_against_cpu(&s, 2, STEPS, 4, true, &format!("{fx} unfused"));
    }
}

#[test]
fn interpreted_megakernel_matches_the_cpu_on_the_demo_model() {
    let Some(path) = demo_model() else {
        println!("SKIPPED: demo model not fetched (scripts/fetch_demo_model.sh)");
        return;
    };
    let s = setup(&path, 2);
    // A real model: greedy tokens identical, no near-tie exception.
    let (e, _) = decode_against_cpu(&s, 2, 16, 5, false, "SmolLM2");
    println!("SmolLM2 batch 2: 16 steps, worst logits rel err {e:.2e}");
}

/// Logits of each step and the final caches of a 2-step interpreter run, or its error.
type Outcome = Result<
    (
        Vec<Vec<Vec<f32>>>,
        Vec<Vec<i32>>,
        Vec<u16>,
        Vec<f32>,
        Vec<u32>,
    ),
    InterpError,
>;

fn run_mutant(s: &Setup, sched: &Schedule, pick: &mut dyn FnMut(&[usize]) -> usize) -> Outcome {
    let p = &s.program;
    let rows = rows_for(p, p.batch);
    let capacity = rows.iter().map(|r| r.1).max().unwrap() + 4;
    let Started { mut m, .. } = start(s, sched, &rows, capacity, |b, i| {
        ((i * 5 + b) % p.vocab) as u32
    });
    let Some(Instr::Sample { logits: lr, .. }) = p.instrs.iter().rev().nth(1) else {
        panic!("no sample");
    };
    let (offs, _) = p.buffer_offsets();
    let (mut ls, mut toks) = (Vec::new(), Vec::new());
    for _ in 0..2 {
        m.step(pick)?;
        ls.push(m.rows(offs[lr.buf], p.buffers[lr.buf].cols, lr.col, lr.cols));
        toks.push(m.tokens.clone());
    }
    let mut kvs = m.k_cache.clone();
    kvs.extend(&m.v_cache);
    Ok((ls, toks, kvs, m.kv_state.clone(), m.ring.clone()))
}

#[test]
fn dropping_any_essential_wait_is_detected_on_fixtures_with_every_tile_kind() {
    // nanochat_H: embed, rms norm, smear, elementwise, matvecs, value embedding, rope, head norm,
    // attention with windows; llama_bias: biases and the fused rope + KV append.
    for fx in ["nanochat_H", "llama_bias"] {
        let s = setup(&fixtures().join(fx), 2);
        let sched = &s.schedule;
        let want = run_mutant(&s, sched, &mut SplitMix(9).picker()).unwrap();
        let (mut essential, mut missed) = (0, Vec::new());
        for t in 0..sched.tiles.len() {
            for k in 0..sched.tiles[t].waits.len() {
                let avoid = unordered_producers(sched, t, k);
                if avoid.is_empty() {
                    continue;
                }
                let w = sched.tiles[t].waits[k];
                essential += 1;
                let mut mutant = sched.clone();
                mutant.tiles[t].waits.remove(k);
                let got = run_mutant(&s, &mutant, &mut adversarial_picker(t, avoid, t as u64));
                if got.as_ref().ok() == Some(&want) {
                    let instr = &s.program.instrs[sched.tiles[t].instr];
                    missed.push(format!("tile {t} ({}) wait {w:?}", instr.name()));
                }
            }
        }
        println!("{fx}: {essential} essential waits, each drop detected");
        assert!(essential > 50, "{fx}: only {essential} essential waits");
        assert!(missed.is_empty(), "{fx}: undetected: {missed:#?}");
    }
}

/// Per-row sampling parameters: greedy, top-k, top-p with min-p, plain temperature.
fn row_params() -> [SamplingParams; 4] {
    let base = SamplingParams::default();
    [
        base,
        SamplingParams {
            temperature: 0.8,
            top_k: Some(20),
            seed: 11,
            ..base
        },
        SamplingParams {
            temperature: 1.3,
            top_p: Some(0.9),
            min_p: Some(0.02),
            seed: 0x5eed_0000_0000_0042,
            ..base
        },
        SamplingParams {
            temperature: 0.6,
            seed: 3,
            ..base
        },
    ]
}

fn mk_row(p: &SamplingParams, row_id: u32) -> MkRow {
    MkRow::new(p.temperature, p.top_k, p.top_p, p.min_p, p.seed, row_id).unwrap()
}

/// The logits range the program samples from.
fn logits_range(p: &DecodeProgram) -> (usize, usize, usize, usize) {
    let Some(Instr::Sample { logits: lr, .. }) = p.instrs.iter().rev().nth(1) else {
        panic!("the program does not end with sample, step_end");
    };
    let (offs, _) = p.buffer_offsets();
    (offs[lr.buf], p.buffers[lr.buf].cols, lr.col, lr.cols)
}

/// Every row of one launch samples with its own controls (`MkControl::rows[b]`: parameters,
/// seed, Philox row) exactly as the host sampler `kiln::sample::sample` does for that row's
/// parameters at the position the token takes, and an inactive row (`pos < 0`) samples nothing,
/// does not advance, writes no KV and reports `NO_TOKEN` in the ring.
#[test]
fn each_row_samples_with_its_own_controls_as_the_host_sampler() {
    for name in ["llama_tied", "nanochat_H"] {
        let s = setup(&fixtures().join(name), 4);
        let p = &s.program;
        let vocab = p.vocab;
        let rows = rows_for(p, 4);
        let capacity = rows.iter().map(|r| r.1).max().unwrap() + 12;
        let Started { mut m, .. } = start(&s, &s.schedule, &rows, capacity, |b, i| {
            ((i * 5 + 1 + 13 * b) % vocab) as u32
        });
        let params = row_params();
        let ids = [40u32, 7, u32::MAX, 1 << 20];
        let ctl: Vec<MkRow> = (0..3).map(|b| mk_row(&params[b], ids[b])).collect();
        // Row 3 has sampling controls but is inactive.
        let mut all = ctl.clone();
        all.push(mk_row(&params[3], ids[3]));
        m.ctl = MkControl::new(&all, &[]).unwrap();
        m.sampler = Some(kiln::sample::device::sample);
        m.pos[3] = -1;
        m.tokens[3] = 0;
        let kv_before = (m.k_cache.clone(), m.v_cache.clone(), m.kv_state.clone());
        let (off, stride, col, cols) = logits_range(p);
        let mut rng = SplitMix(5);
        let mut drawn = 0;
        for step in 0..8 {
            let pos: Vec<i32> = m.pos.clone();
            m.step(&mut rng.picker())
                .unwrap_or_else(|e| panic!("{name}: step {step}: {e}"));
            let logits = m.rows(off, stride, col, cols);
            for b in 0..3 {
                let want = kiln::sample::sample(&logits[b], &params[b], ids[b], pos[b] as u64 + 1);
                assert_eq!(
                    m.tokens[b] as u32, want,
                    "{name}: step {step} row {b} ({:?})",
                    params[b]
                );
                drawn += usize::from(want != argmax(&logits[b]));
                assert_eq!(m.pos[b], pos[b] + 1);
            }
            assert_eq!(
                (m.pos[3], m.tokens[3]),
                (-1, 0),
                "{name}: inactive row moved"
            );
            let entry = &m.ring[(m.epoch as usize % RING) * ring_stride(4)..][..6];
            assert_eq!(entry[3], NO_TOKEN, "{name}: step {step}");
            assert_eq!(entry[4] & 0b1000, 0, "{name}: an inactive row never stops");
        }
        // The sampling rows did not all fall back to the greedy token.
        assert!(drawn >= 4, "{name}: {drawn} non-greedy draws");
        // The inactive row wrote nothing: its write-ahead blocks are still poisoned.
        let mb = m.max_blocks;
        let first = rows[3].1 / m.block_size + 1;
        assert!(first < mb, "{name}: no write-ahead block to check");
        for i in first..mb {
            let block = m.tables[3 * mb + i] as usize;
            let l = m.k_cache.len() / m.num_blocks;
            assert!(m.k_cache[block * l..(block + 1) * l]
                .iter()
                .all(|&v| v == BF16_POISON));
        }
        assert_ne!(kv_before.0, m.k_cache, "{name}: active rows write");
        // A sampling row with no sampler is an error naming the row.
        m.sampler = None;
        let e = m.step_in_order().unwrap_err();
        assert!(
            matches!(e, InterpError::NoSampler { row: 1, .. }),
            "{name}: {e}"
        );
    }
}

/// One sequence of [`joins_and_leaves`]: its prompt, its sampling and Philox row.
struct Seq {
    len: usize,
    params: SamplingParams,
    row_id: u32,
}

/// Runs `seq` alone in a batch-1 machine for `steps` steps; its tokens.
fn solo(s1: &Setup, seq: &Seq, slot: usize, steps: usize, capacity: usize) -> Vec<u32> {
    let vocab = s1.program.vocab;
    let Started { mut m, .. } = start(s1, &s1.schedule, &[(slot, seq.len)], capacity, |_, i| {
        ((i * 3 + slot * 17 + 2) % vocab) as u32
    });
    m.ctl = MkControl::new(&[mk_row(&seq.params, seq.row_id)], &[]).unwrap();
    m.sampler = Some(kiln::sample::device::sample);
    let mut rng = SplitMix(slot as u64);
    (0..steps)
        .map(|_| {
            m.step(&mut rng.picker()).unwrap();
            m.tokens[0] as u32
        })
        .collect()
}

/// The row table is read at every launch: in a running batch-2 machine, sequence B joins row 1
/// at step `JOIN` (its position, token, page table and controls written between launches, as
/// the host does between graph replays) and sequence A leaves row 0 at step `LEAVE` (its
/// position set to -1 and its page table cleared, so a read of it would fail). Each sequence's
/// tokens equal its solo run in a batch-1 machine; the other row's presence changes nothing.
#[test]
fn a_row_joins_and_another_leaves_a_running_batch_and_each_matches_its_solo_run() {
    const JOIN: usize = 3;
    const LEAVE: usize = 6;
    const STEPS: usize = 10;
    let params = row_params();
    for name in ["llama_tied", "nanochat_H"] {
        let path = fixtures().join(name);
        let (s1, s2) = (setup(&path, 1), setup(&path, 2));
        let a = Seq {
            len: 7,
            params: params[1],
            row_id: 3,
        };
        let b = Seq {
            len: 12,
            params: params[2],
            row_id: 9,
        };
        let (slot_a, slot_b) = (1, 2);
        let capacity = b.len + STEPS + 4;
        let solo_a = solo(&s1, &a, slot_a, LEAVE, capacity);
        let solo_b = solo(&s1, &b, slot_b, STEPS - JOIN, capacity);

        let vocab = s2.program.vocab;
        let slots = [slot_a, slot_b];
        let Started { mut m, .. } = start(
            &s2,
            &s2.schedule,
            &[(slot_a, a.len), (slot_b, b.len)],
            capacity,
            |r, i| ((i * 3 + slots[r] * 17 + 2) % vocab) as u32,
        );
        m.sampler = Some(kiln::sample::device::sample);
        m.ctl = MkControl::new(&[mk_row(&a.params, a.row_id)], &[]).unwrap();
        // B's row is prefilled in the cache but not in the row table yet.
        let mb = m.max_blocks;
        let table_b = m.tables[mb..2 * mb].to_vec();
        let token_b = m.tokens[1];
        m.tables[mb..2 * mb].fill(-1);
        m.pos[1] = -1;
        m.tokens[1] = 0;
        let (mut got_a, mut got_b) = (Vec::new(), Vec::new());
        let mut rng = SplitMix(17);
        for step in 0..STEPS {
            if step == JOIN {
                m.pos[1] = b.len as i32;
                m.tokens[1] = token_b;
                m.tables[mb..2 * mb].copy_from_slice(&table_b);
                m.ctl.rows[1] = mk_row(&b.params, b.row_id);
            }
            if step == LEAVE {
                m.pos[0] = -1;
                m.tables[..mb].fill(-1);
                m.ctl.rows[0] = MkRow::GREEDY;
            }
            m.step(&mut rng.picker())
                .unwrap_or_else(|e| panic!("{name}: step {step}: {e}"));
            let entry = &m.ring[(m.epoch as usize % RING) * ring_stride(2)..][..2];
            if step < LEAVE {
                got_a.push(entry[0]);
            } else {
                assert_eq!(entry[0], NO_TOKEN, "{name}: step {step}: A left");
            }
            if step >= JOIN {
                got_b.push(entry[1]);
            } else {
                assert_eq!(entry[1], NO_TOKEN, "{name}: step {step}: B not joined");
            }
        }
        assert_eq!(got_a, solo_a, "{name}: A");
        assert_eq!(got_b, solo_b, "{name}: B");
        assert_eq!(m.pos, [-1, (b.len + STEPS - JOIN) as i32], "{name}");
    }
}

/// `KILN_MK_FUSE_ATTN`'s program (each layer's query RoPE and KV append folded into its
/// attention tiles) computes exactly what the unfused one does: on every fixture the megakernel
/// lowers, at batch 1 and 3, every step's logits and tokens are bit-identical over 18 steps
/// (each run in its own random tile order), with one instruction fewer per fused Rope and KV
/// append and one dependent phase per layer fewer. (Running this file with
/// `KILN_MK_FUSE_ATTN=1` puts the fused program through every other check here too, the
/// dropped-wait mutations included.)
#[test]
fn fused_attention_is_bit_identical_to_rope_and_kv_append_tiles() {
    if fuse_attention() {
        println!("note: KILN_MK_FUSE_ATTN is set: the other tests here run the fused program");
    }
    for path in fixture_models() {
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        for batch in [1usize, 3] {
            let run = |fuse: bool, seed: u64| {
                let base = setup(&path, batch);
                let program = lower_decode_with(base.cpu.plan(PlanKind::Decode), batch, fuse)
                    .unwrap_or_else(|e| panic!("{name}: {e}"));
                let schedule = Schedule::build(&program, tile_config());
                let s = Setup {
                    program,
                    schedule,
                    ..base
                };
                let p = &s.program;
                let rows = rows_for(p, batch);
                let capacity = rows.iter().map(|r| r.1).max().unwrap() + STEPS + 4;
                let vocab = p.vocab;
                let mut st = start(&s, &s.schedule, &rows, capacity, |b, i| {
                    ((i * 7 + 3 + 11 * b) % vocab) as u32
                });
                let Some(Instr::Sample { logits: lr, .. }) = p.instrs.iter().rev().nth(1) else {
                    panic!("{name}: no sample instruction");
                };
                let (offs, _) = p.buffer_offsets();
                let mut rng = SplitMix(seed);
                let mut out = Vec::new();
                for step in 0..STEPS {
                    st.m.step(&mut rng.picker())
                        .unwrap_or_else(|e| panic!("{name} fuse {fuse}: step {step}: {e}"));
                    let got =
                        st.m.rows(offs[lr.buf], p.buffers[lr.buf].cols, lr.col, lr.cols);
                    let bits: Vec<Vec<u32>> = got
                        .iter()
                        .map(|r| r.iter().map(|v| v.to_bits()).collect())
                        .collect();
                    out.push((bits, st.m.tokens.clone()));
                }
                (s.program.instrs.len(), out)
            };
            let (n_plain, plain) = run(false, 5);
            let (n_fused, fused) = run(true, 6);
            let what = format!("{name} batch {batch}");
            for (step, (a, b)) in plain.iter().zip(&fused).enumerate() {
                assert!(
                    a == b,
                    "{what}: step {step}: the fused program's logits or tokens differ"
                );
            }
            let layers = setup(&path, batch).program.layers;
            // Every layer loses its KV append; a Llama-style layer its query Rope too.
            assert!(
                n_fused + layers <= n_plain,
                "{what}: {n_plain} instructions unfused, {n_fused} fused, {layers} layers"
            );
            println!("{what}: {STEPS} steps bit-identical; {n_plain} -> {n_fused} instructions");
        }
    }
}

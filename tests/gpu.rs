//! GPU against CPU. Needs a CUDA GPU, driver and NVRTC; without them every test prints
//! `SKIPPED: <reason>` and passes. Run them on a GPU machine with `scripts/gpu-check.sh`.
//!
//! * every fixture model under `tests/fixtures` (HF directories and GGUF files): prefill logits
//!   at every prompt position and 16 decode steps, GPU within bf16 tolerance of the CPU (the CPU
//!   runs with weights rounded to bf16, as the GPU holds them; the GPU's KV cache is bf16);
//! * the demo model (SmolLM2-135M-Instruct): 128 greedy tokens identical on both;
//! * prefill through cuBLAS against kiln's own GEMM kernel and the CPU;
//! * the decode megakernel replayed from a CUDA graph (`GraphDecoder`), on the demo model and on
//!   every fixture whose decode plan lowers: 256 greedy tokens equal to the per-op GPU path and
//!   the CPU; started late and decoding past the attention split sizes (the position must come
//!   from device memory, not from the capture); stopped with steps in flight, continued on the
//!   host path, restarted; a batch with a padding row and stop tokens; a row joining and one
//!   leaving between replays; seeded sampling
//!   reproducible and equal to the per-op device sampler;
//! * the per-op device sampler (`forward_sample`) against `kiln::sample::sample` on the same
//!   logits, and with masks (`forward_draw`, written without a GPU) against it on masked
//!   logits.
//!
//! Run on an H200 on 2026-11-26 (docs/gpu-results.md): all pass on the fixtures; on the demo
//! model the join/leave and the graph-vs-per-op sampling tests failed (not yet shown to be
//! near ties; the join/leave test now prints the gap).
//!
//! SAFETY of every `GraphDecoder::new` below: each decoder is declared after the backend it
//! comes from, in the same scope, so it is dropped first.
#![cfg(feature = "cuda")]

mod common;

use std::path::{Path, PathBuf};

use common::{demo_model, fixtures, gap, gpu_or_skip, rel_l2};
use kiln::backend::cpu::{CpuBackend, CpuOptions, WeightFormat, Workspace};
use kiln::backend::cuda::{CudaBackend, CudaKvCache, CudaWorkspace, GraphDecoder};
use kiln::backend::{GraphRow, RowDraw, TokenRow};
use kiln::kv::KvDtype;
use kiln::model::Model;
use kiln::plan::PlanKind;
use kiln::sample::{argmax, sample, SamplingParams};

/// Relative L2 error allowed between GPU and CPU logits (bf16 weights and KV cache on the GPU,
/// different summation order).
const TOLERANCE: f32 = 3e-2;

/// Near-tie bound for the demo model's greedy tokens (top-2 gap over the logits' RMS): trained
/// weights have clear margins, so only a much closer call may go either way.
const DEMO_NEAR_TIE: f32 = 1e-3;

fn models(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    let mut entries: Vec<PathBuf> = rd.flatten().map(|e| e.path()).collect();
    entries.sort();
    for p in entries {
        // tests/fixtures/quant holds quantization blocks for the format tests, not a model.
        if p.file_name().is_some_and(|n| n == "quant") {
            continue;
        }
        if p.is_dir() {
            if p.join("config.json").is_file() {
                out.push(p.clone());
            }
            models(&p, out);
        } else if p.extension().is_some_and(|e| e == "gguf") {
            out.push(p);
        }
    }
}

struct Pair {
    cpu: CpuBackend,
    gpu: CudaBackend,
}

fn pair(path: &Path) -> Option<Pair> {
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
    .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    match CudaBackend::new(&model.config, &model.weights) {
        Ok(gpu) => Some(Pair { cpu, gpu }),
        Err(kiln::backend::cuda::CudaError::Unsupported(why)) => {
            println!("{}: not supported on the GPU: {why}", path.display());
            None
        }
        Err(e) => panic!("{}: {e}", path.display()),
    }
}

#[test]
fn gpu_logits_match_cpu_on_every_fixture() {
    if !gpu_or_skip() {
        return;
    }
    let mut paths = Vec::new();
    models(&fixtures(), &mut paths);
    assert!(!paths.is_empty(), "no fixture models found");
    for path in paths {
        let Some(Pair { cpu, gpu }) = pair(&path) else {
            continue;
        };
        let vocab = cpu.config().vocab_size;
        let prompt: Vec<u32> = (0..12).map(|i| (i * 7 + 3) % vocab as u32).collect();
        let rows: Vec<TokenRow> = (0..prompt.len())
            .map(|pos| TokenRow { slot: 0, pos })
            .collect();
        let (mut cws, mut gws) = (Workspace::new(), CudaWorkspace::new());
        let mut ckv = cpu.new_cache(1, 64).expect("cache");
        let mut gkv = gpu.new_cache(1, 64).expect("device cache");
        let (mut cl, mut gl) = (Vec::new(), Vec::new());
        cpu.forward(
            PlanKind::AllLogits,
            &mut cws,
            &mut ckv,
            &prompt,
            &rows,
            &mut cl,
        )
        .expect("cpu prefill");
        gpu.forward(
            PlanKind::AllLogits,
            &mut gws,
            &mut gkv,
            &prompt,
            &rows,
            &mut gl,
        )
        .expect("gpu prefill");
        let e = rel_l2(&gl, &cl);
        println!("{}: prefill rel err {e:.2e}", path.display());
        assert!(e < TOLERANCE, "{}: prefill rel err {e}", path.display());
        let mut tok = argmax(&cl[cl.len() - vocab..]);
        for step in 0..16 {
            let r = [TokenRow {
                slot: 0,
                pos: prompt.len() + step,
            }];
            cpu.forward(PlanKind::Decode, &mut cws, &mut ckv, &[tok], &r, &mut cl)
                .expect("cpu decode");
            gpu.forward(PlanKind::Decode, &mut gws, &mut gkv, &[tok], &r, &mut gl)
                .expect("gpu decode");
            let e = rel_l2(&gl, &cl);
            assert!(
                e < TOLERANCE,
                "{}: decode step {step} rel err {e}",
                path.display()
            );
            tok = argmax(&cl);
        }
    }
}

#[test]
fn greedy_tokens_match_cpu_for_128_steps_on_smollm2() {
    if !gpu_or_skip() {
        return;
    }
    let Some(path) = demo_model() else {
        println!("SKIPPED: demo model not fetched (scripts/fetch_demo_model.sh)");
        return;
    };
    let Some(Pair { cpu, gpu }) = pair(&path) else {
        panic!("the demo model must run on the GPU");
    };
    let prompt: Vec<u32> = vec![1, 504, 3458, 282, 4649, 314, 2];
    let rows: Vec<TokenRow> = (0..prompt.len())
        .map(|pos| TokenRow { slot: 0, pos })
        .collect();
    let (mut cws, mut gws) = (Workspace::new(), CudaWorkspace::new());
    let mut ckv = cpu.new_cache(1, 256).expect("cache");
    let mut gkv = gpu.new_cache(1, 256).expect("device cache");
    let (mut cl, mut gl) = (Vec::new(), Vec::new());
    cpu.forward(
        PlanKind::Prefill,
        &mut cws,
        &mut ckv,
        &prompt,
        &rows,
        &mut cl,
    )
    .expect("cpu prefill");
    gpu.forward(
        PlanKind::Prefill,
        &mut gws,
        &mut gkv,
        &prompt,
        &rows,
        &mut gl,
    )
    .expect("gpu prefill");
    let (mut ct, mut gt) = (vec![argmax(&cl)], vec![argmax(&gl)]);
    for step in 0..127 {
        let pos = prompt.len() + step;
        let r = [TokenRow { slot: 0, pos }];
        cpu.forward(
            PlanKind::Decode,
            &mut cws,
            &mut ckv,
            &[ct[step]],
            &r,
            &mut cl,
        )
        .expect("cpu decode");
        gpu.forward(
            PlanKind::Decode,
            &mut gws,
            &mut gkv,
            &[gt[step]],
            &r,
            &mut gl,
        )
        .expect("gpu decode");
        ct.push(argmax(&cl));
        gt.push(argmax(&gl));
    }
    assert_eq!(gt, ct, "greedy tokens differ between GPU and CPU");
}

#[test]
fn prefill_through_cublas_matches_the_fallback_gemm_and_cpu() {
    if !gpu_or_skip() {
        return;
    }
    let mut paths = Vec::new();
    models(&fixtures(), &mut paths);
    for path in paths {
        let Some(Pair { cpu, gpu }) = pair(&path) else {
            continue;
        };
        if !gpu.uses_cublas() {
            println!("SKIPPED: libcublas not loaded, nothing to compare");
            return;
        }
        let model = Model::load(&path).expect("loads");
        let plain = CudaBackend::new(&model.config, &model.weights)
            .expect("second backend")
            .without_cublas();
        let vocab = cpu.config().vocab_size;
        // 40 rows: well past the 8-row GEMV limit, not a multiple of any tile size.
        let prompt: Vec<u32> = (0..40).map(|i| (i * 11 + 5) % vocab as u32).collect();
        let rows: Vec<TokenRow> = (0..prompt.len())
            .map(|pos| TokenRow { slot: 0, pos })
            .collect();
        let mut cl = Vec::new();
        cpu.forward(
            PlanKind::AllLogits,
            &mut Workspace::new(),
            &mut cpu.new_cache(1, 64).expect("cache"),
            &prompt,
            &rows,
            &mut cl,
        )
        .expect("cpu prefill");
        let mut got = Vec::new();
        for be in [&gpu, &plain] {
            let mut l = Vec::new();
            let mut kv = be.new_cache(1, 64).expect("cache");
            be.forward(
                PlanKind::AllLogits,
                &mut CudaWorkspace::new(),
                &mut kv,
                &prompt,
                &rows,
                &mut l,
            )
            .expect("gpu prefill");
            got.push(l);
        }
        let (eb, ep) = (rel_l2(&got[0], &cl), rel_l2(&got[1], &cl));
        println!(
            "{}: prefill rel err cuBLAS {eb:.2e}, gemm_bf16 {ep:.2e}",
            path.display()
        );
        assert!(eb < TOLERANCE, "{}: cuBLAS prefill {eb}", path.display());
        assert!(ep < TOLERANCE, "{}: gemm_bf16 prefill {ep}", path.display());
    }
}

/// Models the megakernel runs: the lowering fixtures and the demo model when fetched.
fn megakernel_models() -> Vec<(PathBuf, Pair)> {
    let mut paths = Vec::new();
    models(&fixtures(), &mut paths);
    if let Some(p) = demo_model() {
        paths.push(p);
    } else {
        println!("note: demo model not fetched, megakernel checked on the fixtures only");
    }
    let mut out = Vec::new();
    for path in paths {
        let Some(pair) = pair(&path) else {
            continue;
        };
        match pair.gpu.supports_megakernel() {
            Ok(()) => out.push((path, pair)),
            Err(e) => println!("{}: no megakernel: {e}", path.display()),
        }
    }
    out
}

fn is_demo(path: &Path) -> bool {
    demo_model().is_some_and(|d| d == path)
}

fn prompt_for(vocab: usize, n: usize) -> Vec<u32> {
    let mut p = vec![1u32.min(vocab as u32 - 1)];
    p.extend((1..n).map(|i| ((i * 7919 + 13) % vocab) as u32));
    p
}

fn token_rows(slot: usize, from: usize, n: usize) -> Vec<TokenRow> {
    (from..from + n).map(|pos| TokenRow { slot, pos }).collect()
}

/// CPU greedy decode: `steps` tokens (the prefill's first) and each step's top-2 logit gap
/// relative to the logits' RMS (how close to a tie the choice was).
fn cpu_greedy(cpu: &CpuBackend, prompt: &[u32], steps: usize, cap: usize) -> (Vec<u32>, Vec<f32>) {
    let (mut ws, mut kv, mut l) = (
        Workspace::new(),
        // The GPU's KV storage, so that only the summation order differs.
        cpu.new_cache_of(KvDtype::Bf16, 1, cap).expect("cache"),
        Vec::new(),
    );
    cpu.forward(
        PlanKind::Prefill,
        &mut ws,
        &mut kv,
        prompt,
        &token_rows(0, 0, prompt.len()),
        &mut l,
    )
    .expect("cpu prefill");
    let (mut toks, mut gaps) = (vec![argmax(&l)], vec![gap(&l)]);
    while toks.len() < steps {
        let pos = prompt.len() + toks.len() - 1;
        let t = *toks.last().expect("one");
        cpu.forward(
            PlanKind::Decode,
            &mut ws,
            &mut kv,
            &[t],
            &[TokenRow { slot: 0, pos }],
            &mut l,
        )
        .expect("cpu decode");
        toks.push(argmax(&l));
        gaps.push(gap(&l));
    }
    (toks, gaps)
}

/// Per-op GPU prefill of `prompt` into `slot` of `kv`; the first greedy token.
fn gpu_prefill(
    gpu: &CudaBackend,
    ws: &mut CudaWorkspace,
    kv: &mut CudaKvCache,
    slot: usize,
    prompt: &[u32],
) -> u32 {
    let mut l = Vec::new();
    gpu.forward(
        PlanKind::Prefill,
        ws,
        kv,
        prompt,
        &token_rows(slot, 0, prompt.len()),
        &mut l,
    )
    .expect("gpu prefill");
    argmax(&l)
}

/// Per-op GPU greedy decode of slot `slot` from `first` at `pos` for `n` more tokens.
fn gpu_per_op_greedy(
    gpu: &CudaBackend,
    ws: &mut CudaWorkspace,
    kv: &mut CudaKvCache,
    slot: usize,
    first: u32,
    pos: usize,
    n: usize,
) -> Vec<u32> {
    gpu_per_op_greedy_with_gaps(gpu, ws, kv, slot, first, pos, n).0
}

/// [`gpu_per_op_greedy`] with the top-2 gap of every step (see [`gap`]).
fn gpu_per_op_greedy_with_gaps(
    gpu: &CudaBackend,
    ws: &mut CudaWorkspace,
    kv: &mut CudaKvCache,
    slot: usize,
    first: u32,
    pos: usize,
    n: usize,
) -> (Vec<u32>, Vec<f32>) {
    let (mut out, mut gaps, mut l, mut t) = (Vec::new(), Vec::new(), Vec::new(), first);
    for i in 0..n {
        gpu.forward(
            PlanKind::Decode,
            ws,
            kv,
            &[t],
            &[TokenRow { slot, pos: pos + i }],
            &mut l,
        )
        .expect("gpu decode");
        t = argmax(&l);
        out.push(t);
        gaps.push(gap(&l));
    }
    (out, gaps)
}

/// `n` graph steps of the started rows, at most `depth` in flight; confirms each consumed
/// position in the cache (as the engine does). Returns the tokens per row and the stop masks.
fn graph_steps(
    g: &mut GraphDecoder,
    kv: &mut CudaKvCache,
    rows: &[GraphRow],
    n: usize,
    depth: usize,
) -> (Vec<Vec<u32>>, Vec<u32>) {
    let mut toks = vec![Vec::new(); rows.len()];
    let mut masks = Vec::new();
    let mut enqueued = 0;
    for step in 0..n {
        while enqueued < n && g.in_flight() < depth {
            g.enqueue().expect("enqueue");
            enqueued += 1;
        }
        let s = g.next().expect("graph step");
        assert_eq!(s.tokens.len(), rows.len());
        for (b, r) in rows.iter().enumerate() {
            kv.set_len(r.slot, r.pos + step + 1);
            toks[b].push(s.tokens[b]);
        }
        masks.push(s.stopped);
    }
    (toks, masks)
}

fn greedy() -> SamplingParams {
    SamplingParams::default()
}

/// Equal, or the reference's choice at the first difference was a near tie: the CPU keeps an
/// f32 KV cache and the GPU a bf16 one, and the per-op and megakernel paths sum in different
/// orders.
fn assert_equal_or_near_tie(
    what: &str,
    reference: &[u32],
    gaps: &[f32],
    other: &[u32],
    bound: f32,
) {
    if let Some(i) = reference.iter().zip(other).position(|(a, b)| a != b) {
        assert!(
            gaps[i] < bound,
            "{what}: token {i} differs from the reference ({} vs {}) with a top-2 gap of {} RMS",
            other[i],
            reference[i],
            gaps[i]
        );
        println!(
            "{what}: first difference from the reference at token {i}, a near tie ({:.1e} RMS)",
            gaps[i]
        );
    }
}

#[test]
fn megakernel_greedy_matches_per_op_and_cpu_for_256_steps() {
    if !gpu_or_skip() {
        return;
    }
    const STEPS: usize = 256;
    for (path, Pair { cpu, gpu }) in megakernel_models() {
        let name = path.display().to_string();
        let vocab = gpu.config().vocab_size;
        let prompt = prompt_for(vocab, 9);
        let cap = prompt.len() + STEPS + 8;
        let (ct, gaps) = cpu_greedy(&cpu, &prompt, STEPS, cap);

        let mut ws = CudaWorkspace::new();
        let mut kv = gpu.new_cache(1, cap).expect("cache");
        let first = gpu_prefill(&gpu, &mut ws, &mut kv, 0, &prompt);
        let (rest, rest_gaps) =
            gpu_per_op_greedy_with_gaps(&gpu, &mut ws, &mut kv, 0, first, prompt.len(), STEPS - 1);
        let mut per_op = vec![first];
        per_op.extend(rest);
        // The prefill's token is shared by both paths (one prefill each, the same kernels).
        let mut per_op_gaps = vec![f32::INFINITY];
        per_op_gaps.extend(rest_gaps);

        let mut kv = gpu.new_cache(1, cap).expect("cache");
        let first = gpu_prefill(&gpu, &mut ws, &mut kv, 0, &prompt);
        let mut g = unsafe { GraphDecoder::new(&gpu, &kv, 1) }.expect("graph");
        let (tiles, blocks) = g.geometry();
        println!("{name}: megakernel {tiles} tiles on {blocks} blocks");
        let rows = [GraphRow {
            slot: 0,
            pos: prompt.len(),
            token: first,
            row_id: 0,
        }];
        g.start(&mut kv, &rows, &greedy(), &[]).expect("start");
        let (toks, _) = graph_steps(&mut g, &mut kv, &rows, STEPS - 1, 16);
        g.stop().expect("stop");
        let mut mk = vec![first];
        mk.extend(&toks[0]);

        // The megakernel's tiles and the per-op kernels sum in different orders.
        assert_equal_or_near_tie(
            &format!("{name}: megakernel vs per-op GPU greedy tokens"),
            &per_op,
            &per_op_gaps,
            &mk,
            TOLERANCE,
        );
        let bound = if is_demo(&path) {
            DEMO_NEAR_TIE
        } else {
            TOLERANCE
        };
        assert_equal_or_near_tie(&name, &ct, &gaps, &per_op, bound);
    }
}

/// zerfoo's bug: a graph captured while the sequence was short kept the attention length of
/// the capture. Here the graph is captured before any position is known, started after a long
/// prefill, and decodes past the per-op path's 512-position attention splits; every token must
/// match the per-op path (which computes lengths on the host each step).
#[test]
fn megakernel_started_late_decodes_past_the_attention_splits() {
    if !gpu_or_skip() {
        return;
    }
    const PROMPT: usize = 500;
    const STEPS: usize = 300;
    for (path, Pair { gpu, .. }) in megakernel_models() {
        let name = path.display().to_string();
        let prompt = prompt_for(gpu.config().vocab_size, PROMPT);
        let cap = PROMPT + STEPS + 4;
        let mut ws = CudaWorkspace::new();
        // One prefill into slot 0, copied to slot 1: the per-op path decodes slot 0, the graph
        // slot 1.
        let mut kv = gpu.new_cache(2, cap).expect("cache");
        let g0 =
            unsafe { GraphDecoder::new(&gpu, &kv, 1) }.expect("graph captured before the prefill");
        let first = gpu_prefill(&gpu, &mut ws, &mut kv, 0, &prompt);
        kv.copy_slot(&gpu, 0, 1, PROMPT).expect("copy_slot");
        assert_eq!(kv.len(1), PROMPT);
        let (per_op, gaps) =
            gpu_per_op_greedy_with_gaps(&gpu, &mut ws, &mut kv, 0, first, PROMPT, STEPS);
        let mut g = g0;
        let rows = [GraphRow {
            slot: 1,
            pos: PROMPT,
            token: first,
            row_id: 0,
        }];
        g.start(&mut kv, &rows, &greedy(), &[]).expect("start");
        let (toks, _) = graph_steps(&mut g, &mut kv, &rows, STEPS, 32);
        g.stop().expect("stop");
        // The two paths sum in different orders; where the per-op path's choice was a near tie
        // the graph may break it the other way (seen once on an H200: mistral's sliding-window
        // fixture, 117 steps in).
        assert_equal_or_near_tie(
            &format!(
                "{name}: graph started at {PROMPT} vs per-op, through position {}",
                PROMPT + STEPS
            ),
            &per_op,
            &gaps,
            &toks[0],
            TOLERANCE,
        );
    }
}

#[test]
fn megakernel_restarts_after_stop_and_host_path_steps() {
    if !gpu_or_skip() {
        return;
    }
    for (path, Pair { gpu, .. }) in megakernel_models() {
        let name = path.display().to_string();
        let prompt = prompt_for(gpu.config().vocab_size, 7);
        let p = prompt.len();
        let cap = p + 160;
        let mut ws = CudaWorkspace::new();
        let mut kv = gpu.new_cache(1, cap).expect("cache");
        let first = gpu_prefill(&gpu, &mut ws, &mut kv, 0, &prompt);
        let reference = gpu_per_op_greedy(&gpu, &mut ws, &mut kv, 0, first, p, 120);

        let mut kv = gpu.new_cache(1, cap).expect("cache");
        gpu_prefill(&gpu, &mut ws, &mut kv, 0, &prompt);
        let mut g = unsafe { GraphDecoder::new(&gpu, &kv, 1) }.expect("graph");
        let mut got: Vec<u32> = Vec::new();
        let mut last = first;
        // Graph 30 steps; then 20 enqueued, 5 read, stop (15 discarded); 10 host-path steps;
        // graph again to 120.
        for phase in 0..3 {
            let pos = p + got.len();
            let rows = [GraphRow {
                slot: 0,
                pos,
                token: last,
                row_id: 0,
            }];
            g.start(&mut kv, &rows, &greedy(), &[]).expect("start");
            if phase == 1 {
                for _ in 0..20 {
                    g.enqueue().expect("enqueue");
                }
                // Depth 0: read 5 of the 20 in flight without enqueueing more.
                let (toks, _) = graph_steps(&mut g, &mut kv, &rows, 5, 0);
                assert_eq!(g.in_flight(), 15);
                g.stop().expect("stop discards");
                assert_eq!(g.in_flight(), 0);
                got.extend(&toks[0]);
                last = *got.last().expect("tokens");
                let host = gpu_per_op_greedy(&gpu, &mut ws, &mut kv, 0, last, p + got.len(), 10);
                got.extend(&host);
                last = *got.last().expect("tokens");
                continue;
            }
            let n = if phase == 0 { 30 } else { 120 - got.len() };
            let (toks, _) = graph_steps(&mut g, &mut kv, &rows, n, 8);
            g.stop().expect("stop");
            got.extend(&toks[0]);
            last = *got.last().expect("tokens");
        }
        assert_eq!(
            got, reference,
            "{name}: graph / host / graph vs per-op only"
        );
    }
}

#[test]
fn megakernel_batch_with_a_padding_row_and_stop_tokens() {
    if !gpu_or_skip() {
        return;
    }
    const STEPS: usize = 64;
    for (path, Pair { gpu, .. }) in megakernel_models() {
        let name = path.display().to_string();
        let prompt = prompt_for(gpu.config().vocab_size, 11);
        let p = prompt.len();
        let mut ws = CudaWorkspace::new();
        let mut kv = gpu.new_cache(4, p + STEPS + 4).expect("cache");
        let first = gpu_prefill(&gpu, &mut ws, &mut kv, 0, &prompt);
        let reference = gpu_per_op_greedy(&gpu, &mut ws, &mut kv, 0, first, p, STEPS);
        kv.truncate(0, p);
        // Three rows of the same prefill in slots 0, 2, 3; slot 1 (empty) pads bucket 4.
        for to in [2, 3] {
            kv.copy_slot(&gpu, 0, to, p).expect("copy_slot");
        }
        let stops = [reference[3], reference[10]];
        let rows: Vec<GraphRow> = [0, 2, 3]
            .iter()
            .enumerate()
            .map(|(i, &slot)| GraphRow {
                slot,
                pos: p,
                token: first,
                row_id: i as u32,
            })
            .collect();
        let mut g = unsafe { GraphDecoder::new(&gpu, &kv, 4) }.expect("graph");
        g.start(&mut kv, &rows, &greedy(), &stops).expect("start");
        let (toks, masks) = graph_steps(&mut g, &mut kv, &rows, STEPS, 12);
        g.stop().expect("stop");
        for (b, t) in toks.iter().enumerate() {
            assert_eq!(t, &reference, "{name}: batch row {b} vs per-op single row");
        }
        for (step, &m) in masks.iter().enumerate() {
            let want = if stops.contains(&reference[step]) {
                0b111
            } else {
                0
            };
            assert_eq!(m, want, "{name}: stop mask at step {step}");
        }
    }
}

/// A row joins a running graph and another leaves it, between replays, without a re-capture:
/// row 0 decodes slot 0 from the start; at step `JOIN` slot 1 (the same prefill) joins batch
/// row 2 of bucket 4 while steps are in flight; at step `LEAVE` row 0 leaves. Each row's greedy
/// tokens equal the per-op single-row reference from its own start, and inactive rows report
/// no token. The row-table semantics are checked on the CPU by
/// `tests/megakernel_interp.rs::a_row_joins_and_another_leaves_a_running_batch_and_each_matches_its_solo_run`;
/// this is the GPU run of the same contract.
#[test]
fn megakernel_rows_join_and_leave_between_replays() {
    if !gpu_or_skip() {
        return;
    }
    const STEPS: usize = 40;
    const JOIN: usize = 9;
    const LEAVE: usize = 25;
    for (path, Pair { gpu, .. }) in megakernel_models() {
        let name = path.display().to_string();
        let prompt = prompt_for(gpu.config().vocab_size, 9);
        let p = prompt.len();
        let mut ws = CudaWorkspace::new();
        let mut kv = gpu.new_cache(2, p + STEPS + 4).expect("cache");
        let first = gpu_prefill(&gpu, &mut ws, &mut kv, 0, &prompt);
        let (reference, gaps) =
            gpu_per_op_greedy_with_gaps(&gpu, &mut ws, &mut kv, 0, first, p, STEPS);
        kv.truncate(0, p);
        kv.copy_slot(&gpu, 0, 1, p).expect("copy_slot");
        let row = |slot: usize| GraphRow {
            slot,
            pos: p,
            token: first,
            row_id: slot as u32,
        };
        let mut g = unsafe { GraphDecoder::new(&gpu, &kv, 4) }.expect("graph");
        g.start(&mut kv, &[row(0)], &greedy(), &[]).expect("start");
        let (mut a, mut b) = (Vec::new(), Vec::new());
        let mut enqueued = 0;
        for step in 0..STEPS {
            while enqueued < STEPS && g.in_flight() < 4 {
                if enqueued == JOIN {
                    g.join(&mut kv, 2, row(1), &greedy()).expect("join");
                }
                if enqueued == LEAVE {
                    g.leave(0).expect("leave");
                }
                g.enqueue().expect("enqueue");
                enqueued += 1;
            }
            let s = g.next().expect("graph step");
            assert_eq!(s.rows[1], None, "{name}: step {step}: row 1 never joined");
            match s.rows[0] {
                Some(t) => {
                    kv.set_len(0, p + a.len() + 1);
                    a.push(t);
                }
                None => assert!(step >= LEAVE, "{name}: step {step}: row 0 missing"),
            }
            match s.rows[2] {
                Some(t) => {
                    kv.set_len(1, p + b.len() + 1);
                    b.push(t);
                }
                None => assert!(step < JOIN, "{name}: step {step}: row 2 missing"),
            }
        }
        g.stop().expect("stop");
        // The megakernel and the per-op path sum in different orders: a near tie may go either
        // way (on the demo model, the first H200 run saw the row that left differ one step in;
        // the gap printed here tells a tie from a bug).
        assert_eq!(a.len(), LEAVE, "{name}: the row that left");
        assert_eq!(b.len(), STEPS - JOIN, "{name}: the row that joined");
        let bound = if is_demo(&path) {
            DEMO_NEAR_TIE
        } else {
            TOLERANCE
        };
        assert_equal_or_near_tie(
            &format!("{name}: the row that left"),
            &reference[..LEAVE],
            &gaps,
            &a,
            bound,
        );
        assert_equal_or_near_tie(
            &format!("{name}: the row that joined"),
            &reference[..STEPS - JOIN],
            &gaps,
            &b,
            bound,
        );
    }
}

#[test]
fn seeded_sampling_is_reproducible_on_the_graph_and_matches_the_per_op_sampler() {
    if !gpu_or_skip() {
        return;
    }
    const STEPS: usize = 48;
    let params = SamplingParams {
        temperature: 0.9,
        top_k: Some(50),
        top_p: Some(0.95),
        min_p: Some(0.01),
        repetition_penalty: None,
        seed: 1234,
    };
    for (path, Pair { gpu, .. }) in megakernel_models() {
        let name = path.display().to_string();
        let prompt = prompt_for(gpu.config().vocab_size, 6);
        let p = prompt.len();
        let mut ws = CudaWorkspace::new();
        let mut kv = gpu.new_cache(1, p + STEPS + 4).expect("cache");
        let first = gpu_prefill(&gpu, &mut ws, &mut kv, 0, &prompt);
        let row_id = 5;
        let rows = [GraphRow {
            slot: 0,
            pos: p,
            token: first,
            row_id,
        }];
        let mut g = unsafe { GraphDecoder::new(&gpu, &kv, 1) }.expect("graph");
        let mut runs = Vec::new();
        for _ in 0..2 {
            kv.truncate(0, p);
            g.start(&mut kv, &rows, &params, &[]).expect("start");
            runs.push(graph_steps(&mut g, &mut kv, &rows, STEPS, 8).0.remove(0));
            g.stop().expect("stop");
        }
        assert_eq!(runs[0], runs[1], "{name}: two seeded graph runs differ");
        // The per-op path with the device sampler, fed the same tokens.
        kv.truncate(0, p);
        let mut t = first;
        let mut per_op = Vec::new();
        for i in 0..STEPS {
            let s = gpu
                .forward_sample(
                    PlanKind::Decode,
                    &mut ws,
                    &mut kv,
                    &[t],
                    &[TokenRow {
                        slot: 0,
                        pos: p + i,
                    }],
                    &params,
                    &[row_id],
                )
                .expect("forward_sample");
            t = s[0];
            per_op.push(t);
        }
        assert_eq!(runs[0], per_op, "{name}: graph vs per-op device sampling");
    }
}

#[test]
fn device_sampler_matches_the_host_sampler_on_the_same_logits() {
    if !gpu_or_skip() {
        return;
    }
    let mut paths = Vec::new();
    models(&fixtures(), &mut paths);
    paths.extend(demo_model());
    let cases = [
        SamplingParams::default(),
        SamplingParams {
            temperature: 0.8,
            top_k: Some(40),
            seed: 7,
            ..SamplingParams::default()
        },
        SamplingParams {
            temperature: 1.1,
            top_p: Some(0.9),
            min_p: Some(0.02),
            seed: 99,
            ..SamplingParams::default()
        },
        SamplingParams {
            temperature: 0.7,
            seed: 3,
            ..SamplingParams::default()
        },
    ];
    for path in paths {
        let Some(Pair { gpu, .. }) = pair(&path) else {
            continue;
        };
        let prompt = prompt_for(gpu.config().vocab_size, 5);
        let p = prompt.len();
        for params in &cases {
            let mut ws = CudaWorkspace::new();
            let mut host = gpu.new_cache(1, p + 40).expect("cache");
            let mut dev = gpu.new_cache(1, p + 40).expect("cache");
            let mut l = Vec::new();
            let rows = token_rows(0, 0, p);
            gpu.forward(
                PlanKind::Prefill,
                &mut ws,
                &mut host,
                &prompt,
                &rows,
                &mut l,
            )
            .expect("prefill");
            let want = sample(&l, params, 3, p as u64);
            let got = gpu
                .forward_sample(
                    PlanKind::Prefill,
                    &mut ws,
                    &mut dev,
                    &prompt,
                    &rows,
                    params,
                    &[3],
                )
                .expect("prefill + sample");
            assert_eq!(
                got,
                vec![want],
                "{}: prefill sample {params:?}",
                path.display()
            );
            let mut t = want;
            for i in 0..32 {
                let r = [TokenRow {
                    slot: 0,
                    pos: p + i,
                }];
                gpu.forward(PlanKind::Decode, &mut ws, &mut host, &[t], &r, &mut l)
                    .expect("decode");
                let want = sample(&l, params, 3, (p + i + 1) as u64);
                let got = gpu
                    .forward_sample(PlanKind::Decode, &mut ws, &mut dev, &[t], &r, params, &[3])
                    .expect("decode + sample");
                assert_eq!(got, vec![want], "{}: step {i} {params:?}", path.display());
                t = want;
            }
        }
    }
}

/// Draws with a mask (`forward_draw`, the serving scheduler's device draws for constrained
/// rows): two sequences in one decode step, each with its own parameters and an allowed set
/// (a pseudo-random third of the vocabulary, and a set of three tokens that excludes the best
/// one), equal the host sampler on the same logits masked to the same sets (the sets applied as
/// `Constraint::apply` does: -inf outside). Written without a GPU; not yet run on one.
#[test]
fn masked_device_draws_match_the_host_sampler_on_masked_logits() {
    if !gpu_or_skip() {
        return;
    }
    let path = fixtures().join("llama_tied");
    let Some(Pair { gpu, .. }) = pair(&path) else {
        return;
    };
    let vocab = gpu.config().vocab_size;
    let words = vocab.div_ceil(32);
    let prompt = prompt_for(vocab, 5);
    let p = prompt.len();
    let params = [
        SamplingParams::default(),
        SamplingParams {
            temperature: 0.9,
            top_k: Some(40),
            seed: 11,
            ..SamplingParams::default()
        },
    ];
    let mut ws = CudaWorkspace::new();
    let mut kv = gpu.new_cache(2, p + 8).expect("cache");
    let mut l = Vec::new();
    for slot in 0..2 {
        gpu.forward(
            PlanKind::Prefill,
            &mut ws,
            &mut kv,
            &prompt,
            &token_rows(slot, 0, p),
            &mut l,
        )
        .expect("prefill");
    }
    let rows = [TokenRow { slot: 0, pos: p }, TokenRow { slot: 1, pos: p }];
    let fed = [3u32, 4];
    // The host's view: the same step's logits, masked on the host.
    gpu.forward(PlanKind::Decode, &mut ws, &mut kv, &fed, &rows, &mut l)
        .expect("decode");
    for slot in 0..2 {
        kv.truncate(slot, p);
    }
    let mut third = vec![0u32; words];
    for t in (0..vocab).filter(|t| (t * 7 + 1) % 3 == 0) {
        third[t / 32] |= 1 << (t % 32);
    }
    let best = argmax(&l[vocab..2 * vocab]) as usize;
    let mut three = vec![0u32; words];
    for t in (0..vocab).filter(|&t| t != best).take(3) {
        three[t / 32] |= 1 << (t % 32);
    }
    let masks = [third, three];
    let mut want = Vec::new();
    for (r, (m, sp)) in masks.iter().zip(&params).enumerate() {
        let mut row = l[r * vocab..(r + 1) * vocab].to_vec();
        for (t, x) in row.iter_mut().enumerate() {
            if (m[t / 32] >> (t % 32)) & 1 == 0 {
                *x = f32::NEG_INFINITY;
            }
        }
        want.push(sample(&row, sp, r as u32, (p + 1) as u64));
    }
    let draws: Vec<RowDraw<'_>> = (0..2)
        .map(|r| RowDraw {
            sampling: params[r],
            row_id: r as u32,
            allowed: Some(&masks[r]),
        })
        .collect();
    let got = gpu
        .forward_draw(PlanKind::Decode, &mut ws, &mut kv, &fed, &rows, &draws)
        .expect("decode + masked draws");
    assert_eq!(got, want, "masked device draws vs the host");
    assert_ne!(got[1] as usize, best, "the best token was masked out");
}

/// The graph decoder and the backend can move between threads and the backend be shared.
#[test]
fn graph_types_are_send_and_the_backend_sync() {
    fn send<T: Send>() {}
    fn sync<T: Sync>() {}
    send::<GraphDecoder>();
    send::<CudaKvCache>();
    send::<CudaBackend>();
    sync::<CudaBackend>();
}

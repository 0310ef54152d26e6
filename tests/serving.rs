//! The serving core on the CPU: the paged cache against a one-block-per-sequence (contiguous)
//! cache, KV storage types against f32, and the scheduler (batched steps, chunked prefill,
//! preemption, the prefix cache) against each request run alone in a session.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use common::{bench_load, demo_model, fixtures, Reference};
use kiln::backend::cpu::{CpuBackend, CpuOptions, Workspace};
use kiln::backend::TokenRow;
use kiln::engine::{
    Engine, EngineHandle, Event, GenerateOptions, Request, Scheduler, ServeOptions, Step,
};
use kiln::kv::storage::ALL_KV_DTYPES;
use kiln::kv::{KvBudget, KvCache, KvDtype, KvOptions};
use kiln::model::Model;
use kiln::plan::PlanKind;
use kiln::sample::SamplingParams;

const FIXTURES: [&str; 12] = [
    "llama_tied",
    "llama_untied",
    "llama_untied_sharded",
    "llama_bias",
    "qwen2",
    "nanochat",
    "nanochat_A",
    "nanochat_B",
    "nanochat_D",
    "nanochat_G",
    "nanochat_H",
    "nanochat_H_bf16",
];

fn backend(name: &str) -> CpuBackend {
    let model = Model::load(fixtures().join(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
    CpuBackend::new(
        &model.config,
        &model.weights,
        CpuOptions {
            threads: 2,
            ..Default::default()
        },
    )
    .unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// A cache whose free list hands blocks out in a scrambled order: slots take blocks and are
/// closed in an order that interleaves them.
fn scrambled(b: &CpuBackend, opts: KvOptions, blocks: usize) -> KvCache {
    let mut kv = b
        .new_pool(opts, KvBudget::Blocks(blocks), 1 << 20)
        .expect("pool");
    let slots: Vec<usize> = (0..5).map(|_| kv.open_slot()).collect();
    for round in 0..blocks / 5 {
        for &s in &slots {
            let end = (round + 1) * opts.block_size;
            kv.prepare(s, end).expect("blocks");
            kv.advance(s, opts.block_size);
        }
    }
    for s in [3, 0, 4, 1, 2] {
        kv.close_slot(slots[s]);
    }
    kv
}

/// Prefill in three chunks (crossing block boundaries), then greedy decode; every logit row.
fn run(b: &CpuBackend, kv: &mut KvCache, prompt: &[u32], steps: usize) -> Vec<Vec<f32>> {
    run_forced(b, kv, prompt, steps, None)
}

/// Like [`run`], feeding `forced[i]` at decode step `i` instead of the argmax when given.
fn run_forced(
    b: &CpuBackend,
    kv: &mut KvCache,
    prompt: &[u32],
    steps: usize,
    forced: Option<&[u32]>,
) -> Vec<Vec<f32>> {
    let slot = kv.open_slot();
    let mut ws = Workspace::new();
    let mut logits = Vec::new();
    let mut out = Vec::new();
    let mut pos = 0;
    for chunk in [&prompt[..7], &prompt[7..8], &prompt[8..]] {
        let rows: Vec<TokenRow> = (pos..pos + chunk.len())
            .map(|pos| TokenRow { slot, pos })
            .collect();
        b.forward(PlanKind::Prefill, &mut ws, kv, chunk, &rows, &mut logits)
            .expect("prefill");
        pos += chunk.len();
    }
    out.push(logits.clone());
    for i in 0..steps {
        let next = forced.map_or_else(|| kiln::sample::argmax(&logits), |f| f[i]);
        let rows = [TokenRow { slot, pos }];
        b.forward(PlanKind::Decode, &mut ws, kv, &[next], &rows, &mut logits)
            .expect("decode");
        pos += 1;
        out.push(logits.clone());
    }
    out
}

/// Paged = contiguous: identical f32 logits (bitwise) on every fixture, for blocks of 3 and 16
/// positions handed out in scrambled order, against one block per sequence.
#[test]
fn paged_cache_equals_contiguous_bitwise_on_every_fixture() {
    for name in FIXTURES {
        let b = backend(name);
        let r = Reference::load(&fixtures().join(name).join("reference.safetensors"));
        let prompt = &r.prompt_ids;
        let contiguous_opts = KvOptions {
            block_size: 256,
            dtype: KvDtype::F32,
        };
        let mut contiguous = b
            .new_pool(contiguous_opts, KvBudget::Blocks(1), 256)
            .expect("pool");
        let want = run(&b, &mut contiguous, prompt, 12);
        assert_eq!(contiguous.pool().allocated_blocks(), 1);
        for block_size in [3, 16] {
            let opts = KvOptions {
                block_size,
                dtype: KvDtype::F32,
            };
            let mut kv = scrambled(&b, opts, 200);
            let got = run(&b, &mut kv, prompt, 12);
            assert!(
                got == want,
                "{name}: blocks of {block_size}: logits differ from the contiguous cache"
            );
            kv.check_invariants().unwrap();
        }
    }
}

fn max_abs(a: &[f32]) -> f32 {
    a.iter().fold(0f32, |m, x| m.max(x.abs()))
}

/// Each storage type's effect on the logits of every fixture, relative to the largest f32
/// logit (prefill and 12 decode steps). The bounds are about twice what was measured.
#[test]
fn kv_storage_types_stay_close_to_f32_on_every_fixture() {
    let bound = |d: KvDtype| match d {
        KvDtype::F32 => 0.0,
        KvDtype::Bf16 => 2.5e-2,
        KvDtype::F16 => 2e-3,
        KvDtype::Fp8E4m3 => 2.7e-1,
        KvDtype::Q8 => 4e-2,
    };
    let mut report = Vec::new();
    for name in FIXTURES {
        let b = backend(name);
        let r = Reference::load(&fixtures().join(name).join("reference.safetensors"));
        let mut f32_kv = b
            .new_pool(KvOptions::default(), KvBudget::Blocks(64), 256)
            .unwrap();
        let want = run(&b, &mut f32_kv, &r.prompt_ids, 12);
        let tokens: Vec<u32> = want.iter().map(|l| kiln::sample::argmax(l)).collect();
        let head_dim = b.plan(PlanKind::Decode).graph.kv.head_dim;
        for dtype in ALL_KV_DTYPES {
            if dtype.group().is_some_and(|g| !head_dim.is_multiple_of(g)) {
                continue;
            }
            let opts = KvOptions {
                dtype,
                ..KvOptions::default()
            };
            let mut kv = b.new_pool(opts, KvBudget::Blocks(64), 256).unwrap();
            // Teacher-forced: feed the f32 run's greedy tokens so every step compares the
            // same context.
            let got = run_forced(&b, &mut kv, &r.prompt_ids, 12, Some(&tokens));
            let mut worst = 0f32;
            for (g, w) in got.iter().zip(&want) {
                let diff: Vec<f32> = g.iter().zip(w).map(|(a, b)| a - b).collect();
                worst = worst.max(max_abs(&diff) / max_abs(w));
            }
            report.push(format!("{name} {dtype}: {worst:.2e}"));
            assert!(
                worst <= bound(dtype),
                "{name}: KV {dtype}: max logit error {worst:e} (relative to the largest logit) over {}",
                bound(dtype)
            );
        }
    }
    println!("max logit error vs f32 KV:\n{}", report.join("\n"));
}

fn greedy(max: usize) -> GenerateOptions {
    GenerateOptions {
        max_tokens: Some(max),
        ..GenerateOptions::default()
    }
}

fn sampled(max: usize, seed: u64, samples: usize) -> GenerateOptions {
    GenerateOptions {
        max_tokens: Some(max),
        num_samples: samples,
        stop_tokens: Some(vec![]),
        sampling: SamplingParams {
            temperature: 0.9,
            top_k: Some(40),
            top_p: Some(0.95),
            seed,
            ..SamplingParams::default()
        },
        ..GenerateOptions::default()
    }
}

fn engine(name: &str) -> Arc<Engine> {
    Arc::new(
        Engine::load(
            fixtures().join(name),
            CpuOptions {
                threads: 2,
                ..Default::default()
            },
        )
        .unwrap(),
    )
}

/// Collected per request: every row's tokens, and the final event.
#[derive(Default)]
struct Collected {
    rows: HashMap<usize, Vec<u32>>,
    done: Option<Event>,
}

fn sink(store: &Arc<Mutex<Collected>>) -> kiln::engine::Sink {
    let store = Arc::clone(store);
    Box::new(move |e: Event| {
        let mut c = store.lock().unwrap();
        match &e {
            Event::Step(Step { rows }) => {
                for (r, row) in rows.iter().enumerate() {
                    if let Some(row) = row {
                        c.rows.entry(r).or_default().push(row.token);
                    }
                }
            }
            _ => c.done = Some(e),
        }
        true
    })
}

/// Every row of every request (collected in `stores`) equals the request run alone on `e`,
/// with the same finish reasons and completion tokens.
fn assert_each_equals_its_run_alone(
    e: &Arc<Engine>,
    reqs: &[Request],
    stores: &[Arc<Mutex<Collected>>],
) {
    for (i, req) in reqs.iter().enumerate() {
        let alone = e.generate_batch(&req.prompt, &req.options).unwrap();
        let got = stores[i].lock().unwrap();
        for (r, row) in alone.rows.iter().enumerate() {
            assert_eq!(
                got.rows.get(&r).cloned().unwrap_or_default(),
                row.generated,
                "request {i} row {r} differs from its run alone"
            );
        }
        match &got.done {
            Some(Event::Done(d)) => {
                let want: Vec<_> = alone.rows.iter().map(|r| r.finish_reason).collect();
                assert_eq!(d.finish_reasons, want, "request {i}");
                assert_eq!(d.usage.completion_tokens, alone.usage.completion_tokens);
            }
            other => panic!("request {i} ended with {other:?}"),
        }
    }
}

/// Runs `reqs` through `s`, `joins(step)` of them submitted before each step (in order, ids
/// from 0), `after_step` run after each step, until every request has finished; returns what
/// each request's sink collected.
fn serve_joining(
    s: &mut Scheduler,
    reqs: &[Request],
    joins: impl Fn(usize) -> usize,
    mut after_step: impl FnMut(&Scheduler),
) -> Vec<Arc<Mutex<Collected>>> {
    let stores: Vec<Arc<Mutex<Collected>>> = (0..reqs.len())
        .map(|_| Arc::new(Mutex::new(Collected::default())))
        .collect();
    let mut submitted = 0;
    let mut steps = 0;
    while submitted < reqs.len() || !s.is_idle() {
        for _ in 0..joins(steps) {
            if submitted < reqs.len() {
                let id = submitted as u64;
                s.submit(id, reqs[submitted].clone(), sink(&stores[submitted]))
                    .unwrap();
                submitted += 1;
            }
        }
        s.step().unwrap();
        after_step(s);
        steps += 1;
        assert!(steps < 10_000, "the scheduler does not finish");
    }
    stores
}

/// 64 requests (72 rows) with mixed prompt lengths, options and seeds join at different steps
/// through one scheduler whose pool holds a fraction of them (so sequences are preempted and
/// recomputed): every row's tokens equal the same request run alone.
#[test]
fn batched_scheduler_equals_each_request_alone() {
    let e = engine("llama_tied");
    let vocab = e.config().vocab_size as u64;
    let mut rng = 0x2545_F491_4F6C_DD1Du64;
    let mut next = move |n: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % n
    };
    let mut reqs = Vec::new();
    for i in 0..64u64 {
        let len = 3 + next(60) as usize;
        // Half the prompts share a 20-token start, so the prefix cache is used too.
        let mut prompt: Vec<u32> = (0..len).map(|_| 3 + next(vocab - 3) as u32).collect();
        if i % 2 == 0 && len > 20 {
            for (k, t) in prompt.iter_mut().take(20).enumerate() {
                *t = 10 + k as u32;
            }
        }
        let max = 4 + next(20) as usize;
        let opts = match i % 3 {
            0 => greedy(max),
            1 => sampled(max, i, 1),
            _ => sampled(max, 1000 + i, if i % 9 == 2 { 3 } else { 1 }),
        };
        reqs.push(Request {
            prompt,
            options: opts,
            spec: None,
        });
    }
    let opts = ServeOptions {
        kv_budget: KvBudget::Blocks(48),
        kv: KvOptions {
            block_size: 4,
            dtype: KvDtype::F32,
        },
        max_running: 64,
        max_step_tokens: 48,
        prefix_cache: true,
        spec_step_rows: usize::MAX,
    };
    let mut s = Scheduler::new(Arc::clone(&e), opts).unwrap();
    // Requests join a few at a time, between steps.
    let stores = serve_joining(
        &mut s,
        &reqs,
        |step| 1 + step % 4,
        |s| s.cache().check_invariants().unwrap(),
    );
    let stats = s.stats();
    assert!(stats.preemptions > 0, "the pool never ran short: {stats:?}");
    assert!(
        stats.prefix_hit_tokens > 0,
        "no prefix was reused: {stats:?}"
    );
    assert_eq!(
        stats.blocks_free + stats.prefix_blocks,
        stats.blocks_total,
        "finished requests left blocks in use"
    );
    assert_each_equals_its_run_alone(&e, &reqs, &stores);
    println!("{stats:?}");
}

/// `Numerics::Int8` (8-bit activations against interleaved Q4_0, Q4_1 and Q8_0 weights) keeps
/// a sequence's tokens independent of the batch it runs in: 16 requests, greedy and sampled,
/// joining at different steps through a pool that forces preemption, each equal to its run
/// alone, on the three formats' fixtures.
#[test]
fn int8_batched_steps_equal_each_request_alone() {
    if !kiln::backend::cpu::matmul::int8_kernels() {
        println!("SKIPPED: this CPU has no AVX512-VNNI, so Numerics::Int8 runs as exact");
        return;
    }
    for file in [
        "llama_tied.q4_0.gguf",
        "llama_tied.q4_1.gguf",
        "llama_tied.q8_0.gguf",
    ] {
        let e = Arc::new(
            Engine::load(
                fixtures().join(file),
                CpuOptions {
                    threads: 2,
                    numerics: kiln::backend::cpu::Numerics::Int8,
                    ..Default::default()
                },
            )
            .unwrap(),
        );
        let vocab = e.config().vocab_size as u32;
        let reqs: Vec<Request> = (0..16u32)
            .map(|i| Request {
                prompt: (0..3 + 5 * i)
                    .map(|j| (j * 11 + i * 7 + 3) % vocab)
                    .collect(),
                options: if i % 2 == 0 {
                    greedy(6 + i as usize)
                } else {
                    sampled(6 + i as usize, i as u64, 1)
                },
                spec: None,
            })
            .collect();
        let opts = ServeOptions {
            // 112 positions: the longest request (99) fits alone, not beside others.
            kv_budget: KvBudget::Blocks(28),
            kv: KvOptions {
                block_size: 4,
                dtype: KvDtype::F32,
            },
            max_step_tokens: 32,
            ..ServeOptions::default()
        };
        let mut s = Scheduler::new(Arc::clone(&e), opts).unwrap();
        let stores = serve_joining(&mut s, &reqs, |_| 1, |_| {});
        let stats = s.stats();
        assert!(
            stats.preemptions > 0,
            "{file}: the pool never ran short: {stats:?}"
        );
        assert_each_equals_its_run_alone(&e, &reqs, &stores);
    }
}

/// A second request sharing a 200-token prefix computes only what is new (counted), and equals
/// a cold run; under a pool too small to keep the prefix, results are unchanged.
#[test]
fn prefix_cache_computes_only_the_new_suffix() {
    let e = engine("llama_tied");
    let shared: Vec<u32> = (0..200).map(|i| 5 + (i * 7 % 200) as u32).collect();
    let prompt = |tail: &[u32]| -> Vec<u32> { shared.iter().chain(tail).copied().collect() };
    let a = prompt(&[40, 41, 42, 43, 44]);
    let b = prompt(&[50, 51, 52]);
    // The second pool is too small to keep the shared prefix while an unrelated request of the
    // same size runs between the two: the prefix is evicted and recomputed.
    let other: Vec<u32> = (0..205).map(|i| 7 + (i * 11 % 190) as u32).collect();
    for (blocks, expect_hit) in [(200, true), (14, false)] {
        let mut s = Scheduler::new(
            Arc::clone(&e),
            ServeOptions {
                kv_budget: KvBudget::Blocks(blocks),
                kv: KvOptions {
                    block_size: 16,
                    dtype: KvDtype::F32,
                },
                ..ServeOptions::default()
            },
        )
        .unwrap();
        let run = |s: &mut Scheduler, id: u64, p: &[u32]| {
            let store = Arc::new(Mutex::new(Collected::default()));
            let before = s.stats().computed_tokens;
            s.submit(
                id,
                Request {
                    prompt: p.to_vec(),
                    options: greedy(8),
                    spec: None,
                },
                sink(&store),
            )
            .unwrap();
            while !s.is_idle() {
                s.step().unwrap();
            }
            let computed = (s.stats().computed_tokens - before) as usize;
            let c = store.lock().unwrap();
            let usage = match &c.done {
                Some(Event::Done(d)) => d.usage,
                other => panic!("{other:?}"),
            };
            (c.rows[&0].clone(), computed, usage)
        };
        let (ta, ca, ua) = run(&mut s, 1, &a);
        if !expect_hit {
            run(&mut s, 3, &other);
        }
        let (tb, cb, ub) = run(&mut s, 2, &b);
        assert_eq!(ua.cached_tokens, 0);
        // Each request computes its prompt (less what was cached) and one row per generated
        // token but the last.
        assert_eq!(ca, a.len() + ta.len() - 1);
        if expect_hit {
            // 12 whole blocks of 16 = 192 positions come from the cache.
            assert_eq!(ub.cached_tokens, 192);
            assert_eq!(cb, b.len() - 192 + tb.len() - 1);
        } else {
            assert_eq!(ub.cached_tokens, 0);
            assert_eq!(cb, b.len() + tb.len() - 1);
        }
        assert_eq!(
            ta,
            e.generate_batch(&a, &greedy(8)).unwrap().rows[0].generated
        );
        assert_eq!(
            tb,
            e.generate_batch(&b, &greedy(8)).unwrap().rows[0].generated
        );
        s.cache().check_invariants().unwrap();
    }
}

/// The step budget: with more running streams than `max_step_tokens`, every stream still
/// advances each step, and a joining prompt is prefilled a quarter of the budget at a time
/// beside them (not starved until streams finish, nor run whole in one long step).
#[test]
fn decode_rows_always_run_and_prefill_keeps_a_quarter_of_the_budget() {
    let e = engine("llama_tied");
    let mut s = Scheduler::new(
        Arc::clone(&e),
        ServeOptions {
            kv_budget: KvBudget::Blocks(200),
            kv: KvOptions {
                block_size: 16,
                dtype: KvDtype::F32,
            },
            max_step_tokens: 8,
            ..ServeOptions::default()
        },
    )
    .unwrap();
    let streams = 12;
    let stores: Vec<_> = (0..=streams)
        .map(|_| Arc::new(Mutex::new(Collected::default())))
        .collect();
    for (i, store) in stores.iter().take(streams).enumerate() {
        let mut o = greedy(40);
        o.stop_tokens = Some(vec![]);
        let req = Request {
            prompt: vec![5 + i as u32, 9, 11],
            options: o,
            spec: None,
        };
        s.submit(i as u64, req, sink(store)).unwrap();
    }
    // Every stream has its first token once their prompts (3 tokens each) are in.
    while stores[..streams]
        .iter()
        .any(|c| c.lock().unwrap().rows.is_empty())
    {
        s.step().unwrap();
    }
    let long: Vec<u32> = (0..40).map(|i| 3 + (i * 13 % 100) as u32).collect();
    s.submit(
        99,
        Request {
            prompt: long.clone(),
            options: greedy(4),
            spec: None,
        },
        sink(&stores[streams]),
    )
    .unwrap();
    let mut steps = 0;
    while stores[streams].lock().unwrap().rows.is_empty() {
        let before: Vec<usize> = stores[..streams]
            .iter()
            .map(|c| c.lock().unwrap().rows[&0].len())
            .collect();
        let computed = s.stats().computed_tokens;
        s.step().unwrap();
        steps += 1;
        // All 12 streams advanced, and the prompt took its quarter of the budget (2 tokens).
        for (c, b) in stores[..streams].iter().zip(before) {
            assert_eq!(c.lock().unwrap().rows[&0].len(), b + 1, "step {steps}");
        }
        assert_eq!(s.stats().computed_tokens - computed, streams as u64 + 2);
    }
    assert_eq!(steps, long.len() / 2);
    while !s.is_idle() {
        s.step().unwrap();
    }
    let alone = e.generate_batch(&long, &greedy(4)).unwrap().rows[0]
        .generated
        .clone();
    assert_eq!(stores[streams].lock().unwrap().rows[&0], alone);
    s.cache().check_invariants().unwrap();
}

/// The handle: many threads submit at once; streaming, waiting, cancelling and dropping a
/// request all end cleanly and free the blocks.
#[test]
fn engine_handle_serves_threads_and_cancellation() {
    let e = engine("llama_tied");
    let h = EngineHandle::start(Arc::clone(&e), ServeOptions::default()).unwrap();
    let threads: Vec<_> = (0..8u64)
        .map(|i| {
            let h = h.clone();
            let e = Arc::clone(&e);
            std::thread::spawn(move || {
                let prompt: Vec<u32> = (0..10 + i as u32).map(|t| 3 + t * 5).collect();
                let opts = sampled(12, i, 2);
                let got = h
                    .submit(Request {
                        prompt: prompt.clone(),
                        options: opts.clone(),
                        spec: None,
                    })
                    .unwrap()
                    .wait()
                    .unwrap();
                let alone = e.generate_batch(&prompt, &opts).unwrap();
                for (g, a) in got.rows.iter().zip(&alone.rows) {
                    assert_eq!(g.tokens, a.tokens);
                    assert_eq!(g.finish_reason, a.finish_reason);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    // Cancel mid-stream: the request ends with `cancelled`.
    let mut req = h
        .submit(Request {
            prompt: vec![3, 4, 5],
            options: greedy(200),
            spec: None,
        })
        .unwrap();
    assert!(matches!(req.next(), Some(Event::Step(_))));
    req.cancel();
    let last = req.last();
    match last {
        Some(Event::Done(d)) => {
            assert_eq!(
                d.finish_reasons,
                vec![kiln::engine::FinishReason::Cancelled]
            )
        }
        other => panic!("{other:?}"),
    }
    // Dropping a request handle cancels it too.
    let req = h
        .submit(Request {
            prompt: vec![3, 4, 5],
            options: greedy(200),
            spec: None,
        })
        .unwrap();
    drop(req);
    // A bad request is refused at submit, naming the problem.
    let err = h
        .submit(Request {
            prompt: vec![u32::MAX],
            options: greedy(4),
            spec: None,
        })
        .err()
        .expect("refused");
    assert!(
        err.to_string().contains("outside the model's vocabulary"),
        "{err}"
    );
    // Every sequence has ended: nothing but the prefix cache holds blocks.
    for _ in 0..100 {
        let st = h.stats();
        if st.running == 0 && st.waiting == 0 {
            assert_eq!(st.blocks_free + st.prefix_blocks, st.blocks_total);
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    panic!("requests still running: {:?}", h.stats());
}

/// The demo model: greedy agreement with the f32 KV cache, per storage type: 256 tokens after a
/// story prompt (the README's figure) and 64 after two more prompts.
#[test]
fn kv_storage_types_greedy_agreement_on_the_demo_model() {
    let Some(path) = demo_model() else {
        println!("SKIPPED: demo model absent (scripts/fetch_demo_model.sh)");
        return;
    };
    let e = Arc::new(Engine::load(&path, CpuOptions::default()).unwrap());
    let prompts: Vec<(Vec<u32>, usize)> = [
        ("Write a long story about a lighthouse keeper.", 256),
        ("Explain how a hash map works and when to use one.", 64),
        ("Describe the water cycle to a ten-year-old.", 64),
    ]
    .into_iter()
    .map(|(text, n)| {
        let prompt = e
            .tokenizer()
            .chat_prompt(&[kiln::tokenizer::ChatMessage::new("user", text)])
            .unwrap();
        (prompt, n)
    })
    .collect();
    // Per storage type, per prompt: the generated tokens.
    let mut runs: Vec<(KvDtype, Vec<Vec<u32>>)> = Vec::new();
    for dtype in ALL_KV_DTYPES {
        let h = EngineHandle::start(
            Arc::clone(&e),
            ServeOptions {
                kv: KvOptions {
                    dtype,
                    ..KvOptions::default()
                },
                ..ServeOptions::default()
            },
        )
        .unwrap();
        let outs = prompts
            .iter()
            .map(|(prompt, n)| {
                let opts = GenerateOptions {
                    max_tokens: Some(*n),
                    stop_tokens: Some(vec![]),
                    ..GenerateOptions::default()
                };
                let r = h
                    .submit(Request {
                        prompt: prompt.clone(),
                        options: opts,
                        spec: None,
                    })
                    .unwrap()
                    .wait()
                    .unwrap();
                r.rows[0].generated.clone()
            })
            .collect();
        runs.push((dtype, outs));
    }
    let reference = runs[0].1.clone();
    for ((prompt, n), want) in prompts.iter().zip(&reference) {
        assert_eq!(want.len(), *n);
        let opts = GenerateOptions {
            max_tokens: Some(*n),
            stop_tokens: Some(vec![]),
            ..GenerateOptions::default()
        };
        let alone = e.generate_batch(prompt, &opts).unwrap();
        assert_eq!(
            want, &alone.rows[0].generated,
            "f32 KV differs from a session"
        );
    }
    let leading =
        |toks: &[u32], want: &[u32]| toks.iter().zip(want).take_while(|(a, b)| a == b).count();
    let agreement: Vec<(KvDtype, Vec<usize>)> = runs
        .iter()
        .map(|(dtype, outs)| {
            let per: Vec<usize> = outs
                .iter()
                .zip(&reference)
                .map(|(o, w)| leading(o, w))
                .collect();
            (*dtype, per)
        })
        .collect();
    let report: Vec<String> = agreement
        .iter()
        .map(|(dtype, per)| format!("{dtype}: {}/256, then {}/64, {}/64", per[0], per[1], per[2]))
        .collect();
    println!(
        "greedy agreement with f32 KV (story prompt over 256 tokens, two more over 64): {}",
        report.join(", ")
    );
    for (dtype, per) in agreement {
        // Leading-token agreement ends at the first near-tie that the cache's rounding flips,
        // and which tie that is depends on the f32 path's own rounding, which differs between
        // SIMD levels (on the story prompt q8 measured 101 tokens on AVX-512 and 62 on AVX2, and
        // fp8 flips its very first token on some levels): the bound is on the best of the
        // prompts, which still fails a cache that is wrong rather than rounded.
        let least = match dtype {
            KvDtype::F32 | KvDtype::Bf16 | KvDtype::F16 => 64,
            KvDtype::Q8 => 48,
            KvDtype::Fp8E4m3 => 16,
        };
        let best = per.iter().copied().max().unwrap_or(0);
        assert!(
            best >= least,
            "KV {dtype}: greedy agrees for only {per:?} tokens"
        );
    }
}

/// An engine on fixture `name` decoding through the CPU stand-in of the device's decode graph,
/// on two threads.
fn graph_engine(name: &str) -> Arc<Engine> {
    let model = Model::load(fixtures().join(name)).unwrap();
    Arc::new(
        Engine::emulating_graph_decode_on_cpu(
            model,
            CpuOptions {
                threads: 2,
                ..Default::default()
            },
        )
        .unwrap(),
    )
}

/// Steps `s` until it is idle, submitting request `i` once `joins[i]` steps have run (in order:
/// a request waits for the ones before it) and checking the cache's invariants after every
/// step; returns what each request streamed.
fn run_with_joins(
    s: &mut Scheduler,
    reqs: &[Request],
    joins: &[usize],
) -> Vec<Arc<Mutex<Collected>>> {
    // Requests ready by step `t`: the leading ones whose join step has come.
    let ready = |t: usize| joins.iter().take_while(|&&j| j <= t).count();
    serve_joining(
        s,
        reqs,
        |t| ready(t) - t.checked_sub(1).map_or(0, ready),
        |s| s.cache().check_invariants().unwrap(),
    )
}

/// A request joining a running graph phase ends it, but the replays already in flight are
/// taken, not dropped (a stop waits for them anyway; on an H100 a batch-8 stop that dropped
/// them took 11 ms): with a pool that never runs short no replay is dropped, and every row
/// still equals its request alone.
#[test]
fn a_join_takes_the_replays_in_flight_before_the_graph_stops() {
    let plain = engine("llama_tied");
    let graph = graph_engine("llama_tied");
    let vocab = plain.config().vocab_size as u32;
    let reqs: Vec<Request> = (0..4u32)
        .map(|i| Request {
            prompt: (0..5 + i)
                .map(|j| 3 + (j * 13 + i * 7) % (vocab - 3))
                .collect(),
            options: if i == 2 {
                sampled(30, 9, 1)
            } else {
                greedy(30)
            },
            spec: None,
        })
        .collect();
    let mut s = Scheduler::new(Arc::clone(&graph), ServeOptions::default()).unwrap();
    let stores = run_with_joins(&mut s, &reqs, &[0, 0, 10, 20]);
    let stats = s.stats();
    assert!(stats.graph_starts > 1, "no join stopped a graph: {stats:?}");
    assert_eq!(stats.preemptions, 0, "{stats:?}");
    assert_eq!(stats.graph_dropped, 0, "replays dropped: {stats:?}");
    assert_each_equals_its_run_alone(&plain, &reqs, &stores);
}

/// Graph phases (on an engine decoding through the CPU stand-in of the device's decode graph):
/// requests join in waves, so the scheduler switches between kernel-by-kernel steps and graph
/// phases (started, rows leaving as they finish, stopped when a request joins or the pool runs
/// short), through a pool small enough that the graph's block growth runs out and sequences are
/// preempted; rows the graph cannot run (log-probabilities, two samples of one prompt) join in
/// between. Every row's tokens equal its request run alone on a plain engine.
#[test]
fn graph_phases_equal_each_request_alone() {
    let plain = engine("llama_tied");
    let graph = graph_engine("llama_tied");
    let vocab = plain.config().vocab_size as u32;
    let reqs: Vec<Request> = (0..14u32)
        .map(|i| {
            let prompt: Vec<u32> = (0..3 + (i * 7) % 31)
                .map(|j| 3 + (j * 17 + i * 5) % (vocab - 3))
                .collect();
            let max = 12 + (i as usize * 11) % 30;
            let options = match i % 4 {
                0 | 2 => greedy(max),
                1 => sampled(max, u64::from(i), 1),
                _ if i == 7 => sampled(max, 70, 2),
                _ => GenerateOptions {
                    logprobs: Some(2),
                    ..greedy(max)
                },
            };
            Request {
                prompt,
                options,
                spec: None,
            }
        })
        .collect();
    let mut s = Scheduler::new(
        Arc::clone(&graph),
        ServeOptions {
            kv_budget: KvBudget::Blocks(40),
            kv: KvOptions {
                block_size: 4,
                dtype: KvDtype::F32,
            },
            max_step_tokens: 32,
            ..ServeOptions::default()
        },
    )
    .unwrap();
    // Waves: 3 at once, then one at a time at later steps, then 4 more.
    let joins = [0, 0, 0, 6, 15, 30, 31, 32, 45, 70, 70, 70, 70, 90];
    let stores = run_with_joins(&mut s, &reqs, &joins);
    let stats = s.stats();
    println!("{stats:?}");
    assert!(stats.graph_steps > 0, "no graph phase ran: {stats:?}");
    assert!(
        stats.graph_starts > 1,
        "the graph never restarted: {stats:?}"
    );
    assert!(stats.preemptions > 0, "the pool never ran short: {stats:?}");
    assert!(
        stats.graph_steps < stats.steps,
        "no step ran kernel by kernel: {stats:?}"
    );
    assert_eq!(
        stats.blocks_free + stats.prefix_blocks,
        stats.blocks_total,
        "finished requests left blocks in use"
    );
    assert_each_equals_its_run_alone(&plain, &reqs, &stores);
}

/// `kiln-bench --concurrency`'s load (`kiln::bench::serving::run`: every sequence's prompt and
/// tokens in a pool of exactly the blocks they need) on an engine decoding through the CPU
/// stand-in of the device's graph: the graph takes blocks ahead of where rows write, so at 8
/// and 16 sequences the pool runs short in graph phases and the scheduler must stop the graph
/// and go on by the host path, never fail the run. (On an H200 the CUDA pool's refusal at a
/// graph start was not recognised and the run failed, docs/gpu-results.md run 10.)
#[test]
fn serving_bench_in_an_exactly_sized_pool_completes_through_graph_phases() {
    let model = Model::load(fixtures().join("llama_tied")).unwrap();
    let graph =
        Arc::new(Engine::emulating_graph_decode_on_cpu(model, CpuOptions::default()).unwrap());
    for c in [1, 8, 16] {
        let r = bench_load(&graph, c).unwrap_or_else(|e| panic!("{c} sequences: {e}"));
        println!(
            "{c} sequences: {} of {} steps through the graph",
            r.graph_steps, r.steps
        );
        assert!(r.graph_steps > 0, "{c} sequences: no graph phase");
        assert!(
            r.graph_steps < r.steps,
            "{c} sequences: every step in the graph"
        );
    }
}

//! What one decode step costs, whole and in the pieces outside the matmuls: a full SmolLM2-135M
//! decode step at a fixed context, RMSNorm over a hidden row, attention of one token over a
//! 512-position cache, and choosing a token from a 49152-entry vocabulary (greedy and top-p).
//!
//! `cargo bench --bench decode`; the whole-step bench skips with a message when the demo model
//! (`models/SmolLM2-135M-Instruct.Q4_1.gguf`, or `KILN_DEMO_MODEL`) is absent.

use std::hint::black_box;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kiln::backend::cpu::attention::{attention, AttentionShape};
use kiln::backend::cpu::keep_awake;
use kiln::backend::cpu::norm::rms_norm;
use kiln::backend::cpu::{CpuBackend, CpuOptions, Numerics, Workspace};
use kiln::backend::TokenRow;
use kiln::graph::{Dims, KvSpec};
use kiln::kv::KvCache;
use kiln::model::Model;
use kiln::plan::PlanKind;
use kiln::sample::{sample, SamplingParams};

fn rand_vec(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn demo_model() -> Option<PathBuf> {
    let p = std::env::var_os("KILN_DEMO_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("models/SmolLM2-135M-Instruct.Q4_1.gguf")
        });
    p.exists().then_some(p)
}

/// One decode step of SmolLM2-135M at context 128 (the cache is rolled back before each step),
/// with throughput in the bytes the plan's cost model says a step must move.
fn decode_step(c: &mut Criterion) {
    let Some(path) = demo_model() else {
        eprintln!("decode/smollm2_step: skipped, demo model absent (run scripts/demo.sh or set KILN_DEMO_MODEL)");
        return;
    };
    let model = Model::load(&path).expect("loading the demo model");
    let b =
        CpuBackend::new(&model.config, &model.weights, CpuOptions::default()).expect("compiling");
    let ctx = 128;
    let prompt: Vec<u32> = (0..ctx as u32)
        .map(|i| (i * 7919) % model.config.vocab_size as u32)
        .collect();
    let rows: Vec<TokenRow> = (0..ctx).map(|pos| TokenRow { slot: 0, pos }).collect();
    let mut kv = b.new_cache(1, ctx + 1).expect("cache");
    let mut ws = Workspace::new();
    let mut logits = Vec::new();
    b.forward(
        PlanKind::Prefill,
        &mut ws,
        &mut kv,
        &prompt,
        &rows,
        &mut logits,
    )
    .unwrap();
    let bytes = b
        .plan(PlanKind::Decode)
        .cost(&Dims::decode(1, ctx + 1))
        .bytes;

    let mut g = c.benchmark_group("decode");
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3))
        .throughput(Throughput::Bytes(bytes));
    g.bench_function(
        format!("smollm2_step_ctx{}_t{}", ctx + 1, b.threads()),
        |bench| {
            bench.iter(|| {
                kv.truncate(0, ctx);
                b.forward(
                    PlanKind::Decode,
                    &mut ws,
                    &mut kv,
                    &[42],
                    &[TokenRow { slot: 0, pos: ctx }],
                    &mut logits,
                )
                .unwrap();
                black_box(logits[0])
            })
        },
    );
    g.finish();
}

/// RMSNorm of one SmolLM2 hidden row (576) and one Llama-3-8B row (4096).
fn norm(c: &mut Criterion) {
    let mut g = c.benchmark_group("rms_norm");
    g.sample_size(20)
        .warm_up_time(Duration::from_millis(200))
        .measurement_time(Duration::from_secs(1));
    for n in [576, 4096] {
        let x = rand_vec(n, 1);
        let w = rand_vec(n, 2);
        let mut out = vec![0f32; n];
        g.throughput(Throughput::Bytes((3 * n * 4) as u64));
        g.bench_function(format!("{n}"), |bench| {
            bench.iter(|| {
                rms_norm(black_box(&x), Some(&w), 1e-5, &mut out);
                black_box(out[0])
            })
        });
    }
    g.finish();
}

/// SmolLM2-135M's attention heads: 9 query heads sharing 3 KV heads, 64 wide.
const SMOLLM2_HEADS: usize = 9;
const SMOLLM2_KV_HEADS: usize = 3;
const SMOLLM2_HEAD_DIM: usize = 64;

/// A one-layer cache of `positions` for one sequence, and the attention shape, with SmolLM2's
/// heads.
fn smollm2_attention(positions: usize) -> (KvCache, AttentionShape) {
    smollm2_attention_layers(1, positions)
}

/// [`smollm2_attention`] with `layers` layers (the shape names layer 0).
fn smollm2_attention_layers(layers: usize, positions: usize) -> (KvCache, AttentionShape) {
    let spec = KvSpec {
        layers,
        kv_heads: SMOLLM2_KV_HEADS,
        head_dim: SMOLLM2_HEAD_DIM,
        state_dim: 0,
    };
    let mut kv = KvCache::new(spec, 1, positions).expect("cache");
    kv.prepare(0, positions).expect("cache blocks");
    let shape = AttentionShape {
        layer: 0,
        heads: SMOLLM2_HEADS,
        kv_heads: SMOLLM2_KV_HEADS,
        head_dim: SMOLLM2_HEAD_DIM,
        scale: 1.0 / (SMOLLM2_HEAD_DIM as f32).sqrt(),
        window: None,
    };
    (kv, shape)
}

/// The threads the attention benches run on: `RAYON_NUM_THREADS`, or rayon's default.
fn bench_pool() -> (rayon::ThreadPool, usize) {
    let threads = rayon::current_num_threads();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("thread pool");
    (pool, threads)
}

/// One attention call over contiguous rows of `q`, `k`, `v` and `out`; returns an output value
/// for `black_box`.
fn attend(
    numerics: Numerics,
    shape: &AttentionShape,
    rows: &[TokenRow],
    (q, k, v): (&[f32], &[f32], &[f32]),
    kv: &mut KvCache,
    out: &mut [f32],
) -> f32 {
    let (hd, kd) = (
        shape.heads * shape.head_dim,
        shape.kv_heads * shape.head_dim,
    );
    attention(
        numerics,
        shape,
        rows,
        (q, hd, 0),
        (k, kd, 0),
        (v, kd, 0),
        kv,
        (out, hd, 0),
        None,
    );
    out[0]
}

/// One token attending over 64 and over 512 cached positions with SmolLM2's heads (9 query, 3
/// KV, 64 wide), the cache in L2: what attention costs besides fetching it (64 positions is the
/// mean context of a tg128 test). Throughput is the K and V bytes read.
fn attention_decode(c: &mut Criterion) {
    for ctx in [64, 512] {
        attention_decode_at(c, ctx);
    }
}

/// [`attention_decode`] over `ctx` cached positions.
fn attention_decode_at(c: &mut Criterion, ctx: usize) {
    let (heads, kv_heads, d) = (SMOLLM2_HEADS, SMOLLM2_KV_HEADS, SMOLLM2_HEAD_DIM);
    let (mut kv, shape) = smollm2_attention(ctx);
    for pos in 0..ctx {
        let k = rand_vec(kv_heads * d, pos as u64 + 1);
        let v = rand_vec(kv_heads * d, pos as u64 + 10_000);
        kv.write(0, 0, pos, &k, &v);
    }
    let q = rand_vec(heads * d, 3);
    let k = rand_vec(kv_heads * d, 4);
    let v = rand_vec(kv_heads * d, 5);
    let mut out = vec![0f32; heads * d];
    let rows = [TokenRow {
        slot: 0,
        pos: ctx - 1,
    }];
    let mut g = c.benchmark_group("attention");
    g.sample_size(20)
        .warm_up_time(Duration::from_millis(200))
        .measurement_time(Duration::from_secs(1))
        .throughput(Throughput::Bytes((2 * ctx * kv_heads * d * 4) as u64));
    // Timed on a worker of the pool with keepers on the others, as a forward step runs: called
    // from outside, every call would wait for a worker (and then the caller) to wake.
    let (pool, threads) = bench_pool();
    g.bench_function(
        format!("decode_ctx{ctx}_h{heads}_kv{kv_heads}_d{d}"),
        |bench| {
            bench.iter_custom(|iters| {
                pool.install(|| {
                    keep_awake::during(threads, || {
                        let start = Instant::now();
                        for _ in 0..iters {
                            let qkv = (&q[..], &k[..], &v[..]);
                            black_box(attend(
                                Numerics::Exact,
                                &shape,
                                &rows,
                                qkv,
                                &mut kv,
                                &mut out,
                            ));
                        }
                        start.elapsed()
                    })
                })
            })
        },
    );
    g.finish();
}

/// One token attending over 512 cached positions in each of SmolLM2's 30 layers in turn, as a
/// decode step does: 23.6 MB of keys and values, more than the caches of most CPUs, read through
/// the paged layout (a layer's blocks lie a block's all-layer size apart). Throughput is the K
/// and V bytes read.
fn attention_decode_layers(c: &mut Criterion) {
    let (heads, kv_heads, d, ctx, layers) =
        (SMOLLM2_HEADS, SMOLLM2_KV_HEADS, SMOLLM2_HEAD_DIM, 512, 30);
    let (mut kv, mut shape) = smollm2_attention_layers(layers, ctx);
    for layer in 0..layers {
        for pos in 0..ctx {
            let seed = (layer * ctx + pos) as u64;
            let k = rand_vec(kv_heads * d, seed + 1);
            let v = rand_vec(kv_heads * d, seed + 1_000_000);
            kv.write(layer, 0, pos, &k, &v);
        }
    }
    let q = rand_vec(heads * d, 3);
    let k = rand_vec(kv_heads * d, 4);
    let v = rand_vec(kv_heads * d, 5);
    let mut out = vec![0f32; heads * d];
    let rows = [TokenRow {
        slot: 0,
        pos: ctx - 1,
    }];
    let mut g = c.benchmark_group("attention");
    g.sample_size(20)
        .warm_up_time(Duration::from_millis(200))
        .measurement_time(Duration::from_secs(2))
        .throughput(Throughput::Bytes(
            (layers * 2 * ctx * kv_heads * d * 4) as u64,
        ));
    let (pool, threads) = bench_pool();
    g.bench_function(
        format!("decode_ctx{ctx}_layers{layers}_h{heads}_kv{kv_heads}_d{d}"),
        |bench| {
            bench.iter_custom(|iters| {
                pool.install(|| {
                    keep_awake::during(threads, || {
                        let start = Instant::now();
                        for _ in 0..iters {
                            for layer in 0..layers {
                                shape.layer = layer;
                                let qkv = (&q[..], &k[..], &v[..]);
                                black_box(attend(
                                    Numerics::Exact,
                                    &shape,
                                    &rows,
                                    qkv,
                                    &mut kv,
                                    &mut out,
                                ));
                            }
                        }
                        start.elapsed()
                    })
                })
            })
        },
    );
    g.finish();
}

/// A 512-token prefill chunk attending causally with SmolLM2's heads, in exact and in bf16
/// numerics (the latter runs exactly on CPUs without AVX512-BF16); throughput is token rows.
fn attention_prefill(c: &mut Criterion) {
    let (heads, kv_heads, d, tokens) = (SMOLLM2_HEADS, SMOLLM2_KV_HEADS, SMOLLM2_HEAD_DIM, 512);
    let (mut kv, shape) = smollm2_attention(tokens);
    let q = rand_vec(tokens * heads * d, 3);
    let k = rand_vec(tokens * kv_heads * d, 4);
    let v = rand_vec(tokens * kv_heads * d, 5);
    let mut out = vec![0f32; tokens * heads * d];
    let rows: Vec<TokenRow> = (0..tokens).map(|pos| TokenRow { slot: 0, pos }).collect();
    let mut g = c.benchmark_group("attention");
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(200))
        .measurement_time(Duration::from_secs(1))
        .throughput(Throughput::Elements(tokens as u64));
    for numerics in [Numerics::Exact, Numerics::Bf16] {
        g.bench_function(
            format!(
                "prefill{tokens}_h{heads}_kv{kv_heads}_d{d}_{}",
                numerics.name()
            ),
            |bench| {
                bench.iter(|| {
                    let qkv = (&q[..], &k[..], &v[..]);
                    black_box(attend(numerics, &shape, &rows, qkv, &mut kv, &mut out))
                })
            },
        );
    }
    g.finish();
}

/// Choosing one token from SmolLM2's 49152 logits: greedy, and temperature 0.8 with top-p 0.9.
fn sampling(c: &mut Criterion) {
    let logits: Vec<f32> = rand_vec(49152, 7).iter().map(|x| x * 8.0).collect();
    let mut g = c.benchmark_group("sample");
    g.sample_size(20)
        .warm_up_time(Duration::from_millis(200))
        .measurement_time(Duration::from_secs(1))
        .throughput(Throughput::Elements(logits.len() as u64));
    let greedy = SamplingParams::default();
    let top_p = SamplingParams {
        temperature: 0.8,
        top_p: Some(0.9),
        ..SamplingParams::default()
    };
    for (name, params) in [("greedy_49152", greedy), ("top_p0.9_49152", top_p)] {
        let mut pos = 0u64;
        g.bench_function(name, |bench| {
            bench.iter(|| {
                pos += 1;
                black_box(sample(black_box(&logits), &params, 0, pos))
            })
        });
    }
    g.finish();
}

criterion_group!(
    benches,
    decode_step,
    norm,
    attention_decode,
    attention_decode_layers,
    attention_prefill,
    sampling
);
criterion_main!(benches);

//! Kernel micro-benchmarks: single-thread GEMV (decode) throughput in weight bytes/s, prefill
//! GEMM, and dot products, at every SIMD level worth comparing on this CPU.
//!
//! `cargo bench --bench kernels -- gemv` runs only the GEMV group; `-- attention` the
//! attention over a warm KV cache (one thread, the process's SIMD level).

use std::hint::black_box;
use std::time::Duration;

use criterion::measurement::WallTime;
use criterion::{
    criterion_group, criterion_main, BenchmarkGroup, BenchmarkId, Criterion, Throughput,
};
use half::{bf16, f16};
use kiln::backend::cpu::matmul::{
    amx_tiles, groupable, matmul_rows_with, Numerics, PackedMatrix, WeightData,
};
use kiln::backend::cpu::simd::{self, Level};
use kiln::model::quant::QuantKind;

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

fn matrix(rows: usize, cols: usize, bf: bool) -> PackedMatrix {
    let v = rand_vec(rows * cols, (rows ^ cols) as u64);
    let data = if bf {
        WeightData::BF16(v.iter().map(|&x| bf16::from_f32(x)).collect())
    } else {
        WeightData::F32(v.into())
    };
    PackedMatrix {
        rows,
        cols,
        data,
        bias: None,
    }
}

/// Random ggml blocks of `kind` (scales small and positive, quants uniform).
fn quant_matrix(rows: usize, cols: usize, kind: QuantKind) -> PackedMatrix {
    let nb = rows * cols / kind.block_elems();
    let bb = kind.block_bytes();
    let r = rand_vec(nb * bb, (rows ^ cols) as u64 + 7);
    let mut blocks: Vec<u8> = r.iter().map(|&v| ((v + 1.0) * 127.5) as u8).collect();
    // The f16 scale (and min) fields: Q6_K keeps its scale after the quants.
    let d_at = if kind == QuantKind::Q6_K { 208 } else { 0 };
    for (b, c) in blocks.chunks_exact_mut(bb).enumerate() {
        let d = f16::from_f32(0.01 + 0.001 * (b % 7) as f32).to_le_bytes();
        c[d_at..d_at + 2].copy_from_slice(&d);
        if matches!(kind, QuantKind::Q4_1 | QuantKind::Q4_K) {
            c[2..4].copy_from_slice(&f16::from_f32(-0.08).to_le_bytes());
        }
    }
    PackedMatrix {
        rows,
        cols,
        data: WeightData::Quant {
            kind,
            blocks: blocks.into(),
        },
        bias: None,
    }
}

fn weight_bytes(w: &PackedMatrix) -> u64 {
    w.bytes() as u64
}

/// SIMD levels worth benchmarking here (the scalar path only on small shapes).
fn levels(include_scalar: bool) -> Vec<Level> {
    simd::available_levels()
        .into_iter()
        .filter(|&l| include_scalar || l != Level::Scalar)
        .collect()
}

fn run(level: Level, w: &PackedMatrix, x: &[f32], tokens: usize, out: &mut [f32]) {
    run_with(level, Numerics::Exact, w, x, tokens, out)
}

/// `Numerics::Int16` and (up to 16 tokens) `Numerics::Int24` on grouped weights at the AVX-512
/// level, as benches `{name}-int16/{shape}` and `{name}-int24/{shape}` (the rounding of the
/// activations is part of each call).
fn bench_grouped_integers(
    g: &mut BenchmarkGroup<WallTime>,
    (name, shape): (&str, &str),
    w: &PackedMatrix,
    x: &[f32],
    tokens: usize,
    out: &mut [f32],
) {
    // Int24 runs its kernel in calls of up to 16 tokens (larger ones are exact).
    let widths: &[Numerics] = if tokens <= 16 {
        &[Numerics::Int16, Numerics::Int24]
    } else {
        &[Numerics::Int16]
    };
    for &numerics in widths {
        let id = BenchmarkId::new(
            format!("{name}-{}/{shape}", numerics.name()),
            Level::Avx512.name(),
        );
        g.bench_function(id, |b| {
            b.iter(|| run_with(Level::Avx512, numerics, w, black_box(x), tokens, out))
        });
    }
}

fn run_with(
    level: Level,
    numerics: Numerics,
    w: &PackedMatrix,
    x: &[f32],
    tokens: usize,
    out: &mut [f32],
) {
    // SAFETY: `out` holds `tokens × rows` contiguous outputs.
    unsafe {
        matmul_rows_with(
            level,
            numerics,
            w,
            x,
            w.cols,
            tokens,
            0..w.rows,
            out.as_mut_ptr(),
            w.rows,
            false,
        )
    };
}

fn gemv(c: &mut Criterion) {
    let mut g = c.benchmark_group("gemv");
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1));
    for (rows, cols) in [(576, 1536), (1536, 576), (49152, 576), (2048, 8192)] {
        for bf in [false, true] {
            let w = matrix(rows, cols, bf);
            let x = rand_vec(cols, 1);
            let mut out = vec![0f32; rows];
            g.throughput(Throughput::Bytes(weight_bytes(&w)));
            let dt = if bf { "bf16" } else { "f32" };
            // Level::Avx512Bf16 uses the same GEMV as Avx512, so skip it.
            for level in levels(rows * cols <= 1 << 20)
                .into_iter()
                .filter(|&l| l != Level::Avx512Bf16)
            {
                let id = BenchmarkId::new(format!("{dt}/{rows}x{cols}"), level.name());
                g.bench_function(id, |b| {
                    b.iter(|| run(level, &w, black_box(&x), 1, &mut out))
                });
            }
        }
    }
    // SmolLM2's Q4_1/Q8_0 shapes, then Qwen2.5-Coder-0.5B's Q5_0 gate/up (4864 × 896; Q8_0 and
    // Q4_1 in the same shape, to compare formats at Qwen's row length) and its
    // Q4_K/Q6_K down (896 × 4864), and Q4_1 in that shape to compare formats.
    let shapes = [
        (1536, 576, QuantKind::Q4_1),
        (49152, 576, QuantKind::Q4_1),
        (1536, 576, QuantKind::Q8_0),
        (49152, 576, QuantKind::Q8_0),
        (4864, 896, QuantKind::Q5_0),
        (4864, 896, QuantKind::Q8_0),
        (4864, 896, QuantKind::Q4_1),
        (896, 4864, QuantKind::Q4_K),
        (896, 4864, QuantKind::Q4_1),
        (896, 4864, QuantKind::Q6_K),
    ];
    for (rows, cols, kind) in shapes {
        {
            let w = quant_matrix(rows, cols, kind);
            let x = rand_vec(cols, 1);
            let mut out = vec![0f32; rows];
            g.throughput(Throughput::Bytes(weight_bytes(&w)));
            for level in levels(rows * cols <= 1 << 20)
                .into_iter()
                .filter(|&l| l != Level::Avx512Bf16)
            {
                for numerics in Numerics::ALL {
                    let name = match numerics {
                        Numerics::Exact => kind.name().to_string(),
                        n => format!("{}-{}", kind.name(), n.name()),
                    };
                    let id = BenchmarkId::new(format!("{name}/{rows}x{cols}"), level.name());
                    g.bench_function(id, |b| {
                        b.iter(|| run_with(level, numerics, &w, black_box(&x), 1, &mut out))
                    });
                }
            }
            // The same blocks regrouped sixteen rows to a group for the exact AVX-512 and AVX2
            // kernels (what engines hold on those CPUs).
            if groupable(kind) && simd::level() >= Level::Avx2 {
                let grouped = PackedMatrix {
                    data: quant_matrix(rows, cols, kind).data.grouped(rows, cols),
                    ..quant_matrix(rows, cols, kind)
                };
                for level in [Level::Avx512, Level::Avx2] {
                    if simd::level() < level {
                        continue;
                    }
                    let id = BenchmarkId::new(
                        format!("{}-grouped/{rows}x{cols}", kind.name()),
                        level.name(),
                    );
                    g.bench_function(id, |b| {
                        b.iter(|| run(level, &grouped, black_box(&x), 1, &mut out))
                    });
                }
                // `Numerics::Int16` and `Int24` on the blocks as an engine of those numerics
                // groups them (Q5_0 in its own layout), where the CPU has their grouped kernel
                // (the rounding of the activations is part of each call).
                if kiln::backend::cpu::matmul::int16_grouped_kernels() {
                    let m = quant_matrix(rows, cols, kind);
                    let integer = PackedMatrix {
                        data: m.data.grouped_for(rows, cols, Numerics::Int24),
                        ..m
                    };
                    let name = format!("{}-grouped", kind.name());
                    let shape = format!("{rows}x{cols}");
                    bench_grouped_integers(&mut g, (&name, &shape), &integer, &x, 1, &mut out);
                }
            }
            // Regrouped for `Numerics::Int8`'s kernels (8-bit activations; the rounding of the
            // activations is part of each call), at each level that has one.
            if kiln::backend::cpu::matmul::interleavable(kind)
                && kiln::backend::cpu::matmul::int8_kernels()
            {
                let m = quant_matrix(rows, cols, kind);
                let interleaved = PackedMatrix {
                    data: m.data.interleaved(rows, cols),
                    ..m
                };
                for level in [Level::Avx512, Level::Avx2] {
                    if simd::level() < level {
                        continue;
                    }
                    let id = BenchmarkId::new(
                        format!("{}-interleaved/{rows}x{cols}", kind.name()),
                        level.name(),
                    );
                    g.bench_function(id, |b| {
                        b.iter(|| run(level, &interleaved, black_box(&x), 1, &mut out))
                    });
                }
            }
        }
    }
    g.finish();
}

fn gemm(c: &mut Criterion) {
    let mut g = c.benchmark_group("gemm");
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1));
    // A prefill chunk (512 tokens) and batched decode steps (4 and 16 sequences) of
    // SmolLM2-sized projections, in every weight storage the CPU backend multiplies by (the
    // down projection's rows of 1536 also fit the K formats' super-blocks).
    for (rows, cols, tokens) in [
        (576, 1536, 64),
        (1536, 576, 512),
        (1536, 576, 16),
        (1536, 576, 4),
        (576, 1536, 16),
    ] {
        let mut storages = vec![
            ("f32", matrix(rows, cols, false)),
            ("bf16", matrix(rows, cols, true)),
            ("q8_0", quant_matrix(rows, cols, QuantKind::Q8_0)),
            ("q4_1", quant_matrix(rows, cols, QuantKind::Q4_1)),
        ];
        // `Numerics::Int8`'s regrouped weights, where the CPU has its kernels (their calls
        // take 8-bit activations whatever the numerics asked).
        if kiln::backend::cpu::matmul::int8_kernels() {
            for (name, kind) in [
                ("q8_0-int8", QuantKind::Q8_0),
                ("q4_1-int8", QuantKind::Q4_1),
            ] {
                let m = quant_matrix(rows, cols, kind);
                storages.push((
                    name,
                    PackedMatrix {
                        data: m.data.interleaved(rows, cols),
                        ..m
                    },
                ));
            }
        }
        // The exact kernels' regrouped weights, what engines hold on AVX-512 CPUs (calls of
        // more than 16 tokens dequantize tiles from them).
        if simd::level() >= Level::Avx512 {
            for (name, kind) in [
                ("q8_0-grouped", QuantKind::Q8_0),
                ("q4_1-grouped", QuantKind::Q4_1),
                ("q5_0-grouped", QuantKind::Q5_0),
                ("q4_k-grouped", QuantKind::Q4_K),
                ("q6_k-grouped", QuantKind::Q6_K),
            ] {
                if cols % kind.block_elems() != 0 {
                    continue;
                }
                let m = quant_matrix(rows, cols, kind);
                storages.push((
                    name,
                    PackedMatrix {
                        data: m.data.grouped(rows, cols),
                        ..m
                    },
                ));
            }
        }
        for (dt, w) in &storages {
            let x = rand_vec(tokens * cols, 2);
            let mut out = vec![0f32; tokens * rows];
            // Report FLOP-ish work as "elements": multiply-adds.
            g.throughput(Throughput::Elements((rows * cols * tokens) as u64));
            // Level::Avx512Bf16 runs the same FMA kernel as Avx512 (see matmul.rs), so skip it,
            // except for bf16 weights where AMX serves exact products of many tokens; grouped
            // weights only ever meet AVX-512.
            let exact_amx = *dt == "bf16" && tokens > 16 && amx_tiles(Numerics::Exact);
            for level in levels(false).into_iter().filter(|&l| {
                (l != Level::Avx512Bf16 || exact_amx)
                    && (!dt.ends_with("-grouped") || l >= Level::Avx512)
            }) {
                let id = BenchmarkId::new(format!("{dt}/{rows}x{cols}x{tokens}"), level.name());
                g.bench_function(id, |b| {
                    b.iter(|| run(level, w, black_box(&x), tokens, &mut out))
                });
            }
            // `Numerics::Int16` and `Int24` on the grouped Q4_1 and Q8_0 bytes (calls of every
            // size), where the CPU has their grouped kernel.
            if matches!(*dt, "q4_1-grouped" | "q8_0-grouped")
                && kiln::backend::cpu::matmul::int16_grouped_kernels()
            {
                let shape = format!("{rows}x{cols}x{tokens}");
                bench_grouped_integers(&mut g, (dt, &shape), w, &x, tokens, &mut out);
            }
        }
    }
    g.finish();
}

fn dots(c: &mut Criterion) {
    let mut g = c.benchmark_group("dot");
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(200))
        .measurement_time(Duration::from_millis(500));
    for n in [64usize, 576, 4096] {
        let a = rand_vec(n, 3);
        let b = rand_vec(n, 4);
        let ab: Vec<bf16> = a.iter().map(|&v| bf16::from_f32(v)).collect();
        g.throughput(Throughput::Elements(n as u64));
        for level in levels(true) {
            g.bench_function(BenchmarkId::new(format!("f32/{n}"), level.name()), |bn| {
                bn.iter(|| simd::dot_f32_at(level, black_box(&a), black_box(&b)))
            });
            g.bench_function(BenchmarkId::new(format!("bf16/{n}"), level.name()), |bn| {
                bn.iter(|| simd::dot_bf16_at(level, black_box(&ab), black_box(&b)))
            });
        }
    }
    g.finish();
}

/// Attention of SmolLM2-135M's shape (9 query heads, 3 KV heads of 64) on one thread: a
/// 512-token causal prefill, and one decode row after 512 cached positions. Throughput in
/// multiply-adds (scores and weighted values of the positions each token attends). On one core
/// of the 2-vCPU AMD EPYC (Zen 3, AVX2) over the morning of 2026-12-03: prefill 15.9–21.2
/// Gelem/s (32–42 GFLOP/s, about a third of the core's 120 GFLOP/s FMA peak), decode 9–13.
fn attention(c: &mut Criterion) {
    use kiln::backend::cpu::attention::{attention, AttentionShape};
    use kiln::backend::TokenRow;
    use kiln::graph::KvSpec;
    use kiln::kv::KvCache;
    let mut g = c.benchmark_group("attention");
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(2));
    let (heads, kv_heads, d, n) = (9usize, 3usize, 64usize, 512usize);
    let shape = AttentionShape {
        layer: 0,
        heads,
        kv_heads,
        head_dim: d,
        scale: 0.125,
        window: None,
    };
    let spec = KvSpec {
        layers: 1,
        kv_heads,
        head_dim: d,
        state_dim: 0,
    };
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .expect("a one-thread pool");
    // Rows at positions `positions` of slot 0, with activations drawn from `seed`: their keys
    // and values appended to `kv`, then attended.
    let rows_at = |positions: std::ops::Range<usize>, seed: u64| {
        let t = positions.len();
        let rows: Vec<TokenRow> = positions.map(|pos| TokenRow { slot: 0, pos }).collect();
        let qkv =
            [(heads, 0), (kv_heads, 1), (kv_heads, 2)].map(|(h, i)| rand_vec(t * h * d, seed + i));
        (rows, qkv, vec![0f32; t * heads * d])
    };
    let attend =
        |kv: &mut KvCache, rows: &[TokenRow], [q, k, v]: &[Vec<f32>; 3], out: &mut [f32]| {
            attention(
                Numerics::Exact,
                &shape,
                rows,
                (black_box(q), heads * d, 0),
                (k, kv_heads * d, 0),
                (v, kv_heads * d, 0),
                kv,
                (out, heads * d, 0),
                None,
            )
        };
    for (name, first, tokens) in [("prefill", 0, n), ("decode", n, 1)] {
        let mut kv = KvCache::new(spec, 1, n + 1).expect("a cache");
        kv.prepare(0, first + tokens).expect("cache blocks");
        // The decode row's cached positions, written by a prefill first.
        if first > 0 {
            let (rows, qkv, mut out) = rows_at(0..first, 5);
            attend(&mut kv, &rows, &qkv, &mut out);
        }
        let (rows, qkv, mut out) = rows_at(first..first + tokens, 7);
        let attended: usize = rows.iter().map(|r| r.pos + 1).sum();
        g.throughput(Throughput::Elements((2 * attended * heads * d) as u64));
        let id = BenchmarkId::new(
            format!("{name}/{tokens}x{}", first + tokens),
            simd::level().name(),
        );
        g.bench_function(id, |b| {
            b.iter(|| pool.install(|| attend(&mut kv, &rows, &qkv, &mut out)))
        });
    }
    g.finish();
}

criterion_group!(benches, gemv, gemm, dots, attention);
criterion_main!(benches);

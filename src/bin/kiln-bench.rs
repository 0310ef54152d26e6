//! `kiln-bench`: prefill and decode throughput in the shape of llama.cpp's `llama-bench`, plus
//! how close each test runs to the memory roofline of the machine it ran on.
//!
//! ```text
//! kiln-bench -m models/SmolLM2-135M-Instruct.Q4_1.gguf -p 512 -n 128 -t 1,2 -r 5
//! ```
//!
//! For each (model, threads, test) there is one warm-up run, then `-r` timed repetitions, each
//! on a fresh KV cache. `ppN` times one prefill step of N seeded random tokens; `tgN` times N
//! decode steps after a 1-token prompt. The roofline column is the time the plan's bytes per
//! token (from the graph's cost model) would take at the measured streaming-read bandwidth,
//! over the measured time per token.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::{Parser, ValueEnum};
use serde::Serialize;

use kiln::backend::cpu::{
    simd, CpuBackend, CpuOptions, PlanKind, TokenRow, WeightFormat, Workspace,
};
use kiln::graph::Dims;
use kiln::model::Model;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Device {
    Cpu,
    /// The CUDA backend through the engine (sampling on the device, as in real generation).
    Cuda,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Decode {
    /// The graph-replayed megakernel (CUDA).
    Megakernel,
    /// One kernel per plan instruction (CUDA).
    PerOp,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Output {
    /// A Markdown table, like llama-bench.
    Md,
    /// An array of objects: every column plus the raw per-repetition samples.
    Json,
    Csv,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Weights {
    /// bf16 stays bf16; f32, f16 and quantized types run as f32 (exact).
    Auto,
    F32,
    /// Round weights to bf16: half the memory traffic per token.
    Bf16,
}

#[derive(Parser, Debug)]
#[command(
    name = "kiln-bench",
    version,
    about = "Benchmark prefill (ppN) and decode (tgN) throughput, llama-bench style, with the fraction of the memory roofline reached"
)]
struct Args {
    /// Model: a Hugging Face directory or a .gguf file (repeat for several).
    #[arg(short, long, required = true)]
    model: Vec<PathBuf>,
    /// Prompt lengths to time as one prefill step (comma list; 0 disables).
    #[arg(
        short = 'p',
        long = "n-prompt",
        value_delimiter = ',',
        default_value = "512"
    )]
    n_prompt: Vec<usize>,
    /// Decode steps to time after a 1-token prompt (comma list; 0 disables).
    #[arg(
        short = 'n',
        long = "n-gen",
        value_delimiter = ',',
        default_value = "128"
    )]
    n_gen: Vec<usize>,
    /// CPU thread counts (comma list); default: every core.
    #[arg(short = 't', long, value_delimiter = ',')]
    threads: Option<Vec<usize>>,
    /// Backend.
    #[arg(long, value_enum, default_value_t = Device::Cpu)]
    device: Device,
    /// Decode path on CUDA.
    #[arg(long, value_enum, default_value_t = Decode::Megakernel)]
    decode: Decode,
    /// Rows decoded together (comma list, CUDA only): `tgN@bB` generates N tokens in each of B
    /// rows from one prefill; tokens/s counts every row.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    batch: Vec<usize>,
    /// Timed repetitions per test (after one warm-up run).
    #[arg(short = 'r', long, default_value_t = 5)]
    repetitions: usize,
    /// Output format on stdout (progress goes to stderr).
    #[arg(short = 'o', long, value_enum, default_value_t = Output::Md)]
    output: Output,
    /// How weights are held in memory.
    #[arg(long, value_enum, default_value_t = Weights::Auto)]
    weights: Weights,
    /// Size of the buffer read to measure memory bandwidth, in MiB (keep it far above the LLC).
    #[arg(long, default_value_t = 1024)]
    bandwidth_mib: usize,
    /// Seed for the random prompt and decode token ids.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Also time every instruction of the decode plan and print, per op, milliseconds per token,
    /// share of the step, bytes per token and achieved bandwidth (stderr).
    #[arg(long)]
    profile: bool,
}

/// One row of the table.
#[derive(Serialize, Debug)]
struct Row {
    model: String,
    model_path: String,
    size: String,
    size_bytes: usize,
    params: String,
    n_params: usize,
    #[serde(rename = "type")]
    weight_type: String,
    backend: String,
    threads: usize,
    test: String,
    n_prompt: usize,
    n_gen: usize,
    /// Tokens per second: mean and sample standard deviation over the repetitions.
    tokens_per_s: f64,
    tokens_per_s_sd: f64,
    /// Median over repetitions of milliseconds per token.
    ms_per_token: f64,
    /// Bytes the plan must move per token for this test's dimensions.
    bytes_per_token: f64,
    /// Measured streaming-read bandwidth for this thread count, bytes/s.
    bandwidth_bytes_per_s: f64,
    /// (bytes per token / bandwidth) / measured time per token, in percent.
    roofline_pct: f64,
    /// Wall time of each repetition, nanoseconds.
    samples_ns: Vec<u64>,
    /// Tokens per second of each repetition.
    samples_ts: Vec<f64>,
}

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let args = Args::parse();
    if args.repetitions == 0 {
        bail!("-r must be at least 1");
    }
    let threads = match &args.threads {
        Some(t) if t.contains(&0) => bail!("thread counts must be at least 1"),
        Some(t) => t.clone(),
        None => vec![std::thread::available_parallelism().map_or(1, |n| n.get())],
    };
    let weights = match args.weights {
        Weights::Auto => WeightFormat::AsStored,
        Weights::F32 => WeightFormat::F32,
        Weights::Bf16 => WeightFormat::BF16,
    };
    let backend_name = format!("CPU ({})", simd::level().name());
    let mut bandwidth: BTreeMap<usize, f64> = BTreeMap::new();
    let mut rows = Vec::new();
    for path in &args.model {
        eprintln!("kiln-bench: loading {}", path.display());
        let model = Model::load(path).with_context(|| format!("loading {}", path.display()))?;
        let name = path.file_name().map_or_else(
            || path.display().to_string(),
            |n| n.to_string_lossy().into_owned(),
        );
        let weight_type = match args.weights {
            Weights::Auto => model.weight_type.clone(),
            Weights::F32 => format!("{} as f32", model.weight_type),
            Weights::Bf16 => format!("{} as bf16", model.weight_type),
        };
        let max_ctx = model.config.max_position_embeddings;
        if args.device == Device::Cuda {
            rows.extend(gpu::bench(&args, path, &name, &weight_type, model)?);
            continue;
        }
        if args.batch != [1] {
            bail!("--batch is for --device cuda; the CPU bench decodes one row");
        }
        for &t in &threads {
            let bw = match bandwidth.get(&t) {
                Some(&bw) => bw,
                None => {
                    let bw = measure_bandwidth(t, args.bandwidth_mib)?;
                    bandwidth.insert(t, bw);
                    bw
                }
            };
            let backend = CpuBackend::new(
                &model.config,
                &model.weights,
                CpuOptions {
                    threads: t,
                    weights,
                },
            )?;
            let tests = args
                .n_prompt
                .iter()
                .filter(|&&n| n > 0)
                .map(|&n| (n, 0))
                .chain(args.n_gen.iter().filter(|&&n| n > 0).map(|&n| (0, n)));
            for (n_prompt, n_gen) in tests {
                let test = if n_prompt > 0 {
                    format!("pp{n_prompt}")
                } else {
                    format!("tg{n_gen}")
                };
                let positions = n_prompt.max(n_gen + 1);
                if positions > max_ctx {
                    bail!("{test} needs {positions} positions but {name} holds {max_ctx}");
                }
                eprintln!(
                    "kiln-bench: {name} threads={t} {test}: 1 warm-up + {} runs",
                    args.repetitions
                );
                let mut samples = Vec::with_capacity(args.repetitions);
                for rep in 0..=args.repetitions {
                    let d = if n_prompt > 0 {
                        time_prefill(&backend, n_prompt, args.seed)?
                    } else {
                        time_decode(&backend, n_gen, args.seed)?
                    };
                    if rep > 0 {
                        samples.push(d);
                    }
                }
                if args.profile && n_gen > 0 {
                    profile_decode(&backend, n_gen, args.seed)?;
                }
                let (n, dims, kind) = if n_prompt > 0 {
                    (n_prompt, Dims::prefill(n_prompt), PlanKind::Prefill)
                } else {
                    // Step i (0-based) of the decode attends over i + 2 positions.
                    (
                        n_gen,
                        Dims::decode(1, 1 + (n_gen + 1).div_ceil(2)),
                        PlanKind::Decode,
                    )
                };
                let bytes_per_token =
                    backend.plan(kind).cost(&dims).bytes as f64 / dims.tokens as f64;
                let ts: Vec<f64> = samples.iter().map(|d| n as f64 / d.as_secs_f64()).collect();
                let mut ms: Vec<f64> = samples
                    .iter()
                    .map(|d| d.as_secs_f64() * 1e3 / n as f64)
                    .collect();
                ms.sort_by(f64::total_cmp);
                let ms_median = median(&ms);
                let (mean, sd) = mean_sd(&ts);
                let roofline = bytes_per_token / bw / (ms_median / 1e3) * 100.0;
                rows.push(Row {
                    model: name.clone(),
                    model_path: path.display().to_string(),
                    size: format!(
                        "{:.1} MiB",
                        backend.weight_bytes() as f64 / (1 << 20) as f64
                    ),
                    size_bytes: backend.weight_bytes(),
                    params: params_text(model.weights.num_params()),
                    n_params: model.config.num_params(),
                    weight_type: weight_type.clone(),
                    backend: backend_name.clone(),
                    threads: backend.threads(),
                    test,
                    n_prompt,
                    n_gen,
                    tokens_per_s: mean,
                    tokens_per_s_sd: sd,
                    ms_per_token: ms_median,
                    bytes_per_token,
                    bandwidth_bytes_per_s: bw,
                    roofline_pct: roofline,
                    samples_ns: samples.iter().map(|d| d.as_nanos() as u64).collect(),
                    samples_ts: ts,
                });
            }
        }
    }
    let out = match args.output {
        Output::Md => markdown(&rows),
        Output::Json => serde_json::to_string_pretty(&rows)? + "\n",
        Output::Csv => csv(&rows),
    };
    print!("{out}");
    Ok(())
}

/// A xorshift stream of token ids below the vocabulary size.
fn token_ids(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % vocab as u64) as u32
        })
        .collect()
}

fn time_prefill(b: &CpuBackend, n: usize, seed: u64) -> Result<Duration> {
    let ids = token_ids(n, b.config().vocab_size, seed);
    let rows: Vec<TokenRow> = (0..n).map(|pos| TokenRow { slot: 0, pos }).collect();
    let mut kv = b.new_cache(1, n);
    let mut ws = Workspace::new();
    let mut logits = Vec::new();
    let t0 = Instant::now();
    b.forward(
        PlanKind::Prefill,
        &mut ws,
        &mut kv,
        &ids,
        &rows,
        &mut logits,
    )?;
    Ok(t0.elapsed())
}

/// Times each decode-plan instruction over `n` steps and prints a per-op summary to stderr.
fn profile_decode(b: &CpuBackend, n: usize, seed: u64) -> Result<()> {
    use std::collections::BTreeMap;
    let ids = token_ids(n + 1, b.config().vocab_size, seed);
    let mut kv = b.new_cache(1, n + 1);
    let mut ws = Workspace::new();
    let mut logits = Vec::new();
    ws.enable_profile();
    for (i, id) in ids.iter().enumerate() {
        let row = TokenRow { slot: 0, pos: i };
        b.forward(
            PlanKind::Decode,
            &mut ws,
            &mut kv,
            std::slice::from_ref(id),
            &[row],
            &mut logits,
        )?;
    }
    let plan = b.plan(PlanKind::Decode);
    let dims = Dims::decode(1, n.div_ceil(2) + 1);
    let times = ws.profile().unwrap_or(&[]);
    // Group instructions by what they are, not by layer: `layers.7.attn.q+k+v` → `attn.q+k+v`.
    let mut groups: BTreeMap<String, (usize, Duration, u64)> = BTreeMap::new();
    for (ins, t) in plan.instrs.iter().zip(times) {
        let key = match ins.label.strip_prefix("layers.") {
            Some(rest) => rest.split_once('.').map_or(rest, |(_, r)| r).to_string(),
            None => ins.label.clone(),
        };
        let node = &plan.graph.nodes[ins.node];
        let e = groups
            .entry(format!("{key} ({})", ins.op.name()))
            .or_default();
        e.0 += 1;
        e.1 += *t;
        e.2 += node.cost(&plan.graph, &dims).bytes;
    }
    let total: Duration = times.iter().sum();
    let steps = (n + 1) as f64;
    eprintln!(
        "kiln-bench: decode profile over {} steps, {:.3} ms/token in instructions",
        n + 1,
        total.as_secs_f64() * 1e3 / steps
    );
    eprintln!("| op | count | ms/token | share | bytes/token | GB/s |");
    eprintln!("|---|---:|---:|---:|---:|---:|");
    let mut rows: Vec<_> = groups.into_iter().collect();
    rows.sort_by(|a, b| b.1 .1.cmp(&a.1 .1).then(a.0.cmp(&b.0)));
    for (name, (count, t, bytes)) in rows {
        let ms = t.as_secs_f64() * 1e3 / steps;
        eprintln!(
            "| {name} | {count} | {ms:.3} | {:.1}% | {bytes} | {:.1} |",
            100.0 * t.as_secs_f64() / total.as_secs_f64().max(1e-12),
            bytes as f64 / (ms / 1e3) / 1e9
        );
    }
    Ok(())
}

fn time_decode(b: &CpuBackend, n: usize, seed: u64) -> Result<Duration> {
    let ids = token_ids(n + 1, b.config().vocab_size, seed);
    let mut kv = b.new_cache(1, n + 1);
    let mut ws = Workspace::new();
    let mut logits = Vec::new();
    b.forward(
        PlanKind::Decode,
        &mut ws,
        &mut kv,
        &ids[..1],
        &[TokenRow { slot: 0, pos: 0 }],
        &mut logits,
    )?;
    let t0 = Instant::now();
    for (i, id) in ids[1..].iter().enumerate() {
        let row = TokenRow {
            slot: 0,
            pos: i + 1,
        };
        b.forward(
            PlanKind::Decode,
            &mut ws,
            &mut kv,
            std::slice::from_ref(id),
            &[row],
            &mut logits,
        )?;
    }
    Ok(t0.elapsed())
}

/// Streaming-read bandwidth in bytes/s with `threads` threads: the median of 5 passes over a
/// buffer of `mib` MiB (after one pass that faults the pages in), each thread reading its
/// chunks with the same SIMD dot-product kernel the matmuls use.
fn measure_bandwidth(threads: usize, mib: usize) -> Result<f64> {
    use rayon::prelude::*;
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()?;
    let floats = (mib.max(1) << 20) / 4;
    let mut buf: Vec<f32> = Vec::new();
    buf.try_reserve_exact(floats).with_context(|| {
        format!("allocating {mib} MiB to measure bandwidth (try --bandwidth-mib)")
    })?;
    // Chunks of 1 MiB: small enough to balance across threads, large enough to stream.
    let chunk = 1 << 18;
    pool.install(|| {
        buf.resize(floats, 0.0);
        buf.par_chunks_mut(chunk).enumerate().for_each(|(i, c)| {
            c.iter_mut()
                .enumerate()
                .for_each(|(j, w)| *w = ((i + j) % 7) as f32)
        });
    });
    let mut secs: Vec<f64> = (0..5)
        .map(|_| {
            let t0 = Instant::now();
            let sum: f32 = pool.install(|| buf.par_chunks(chunk).map(simd::sum_sq).sum());
            std::hint::black_box(sum);
            t0.elapsed().as_secs_f64()
        })
        .collect();
    secs.sort_by(f64::total_cmp);
    let bw = (floats * 4) as f64 / median(&secs);
    eprintln!(
        "kiln-bench: memory bandwidth {:.1} GB/s (streaming read of {mib} MiB, {threads} threads, median of 5)",
        bw / 1e9
    );
    Ok(bw)
}

/// `134.5 M`, `111.9 K`, `7.24 B`: parameter counts as llama-bench writes them.
fn params_text(n: usize) -> String {
    let n = n as f64;
    if n >= 1e9 {
        format!("{:.2} B", n / 1e9)
    } else if n >= 1e6 {
        format!("{:.1} M", n / 1e6)
    } else {
        format!("{:.1} K", n / 1e3)
    }
}

/// Median of sorted values.
fn median(sorted: &[f64]) -> f64 {
    let n = sorted.len();
    if n % 2 == 1 {
        sorted[n / 2]
    } else {
        (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
    }
}

/// Mean and sample standard deviation (0 for one sample).
fn mean_sd(v: &[f64]) -> (f64, f64) {
    let n = v.len() as f64;
    let mean = v.iter().sum::<f64>() / n;
    if v.len() < 2 {
        return (mean, 0.0);
    }
    let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0);
    (mean, var.sqrt())
}

const COLUMNS: [&str; 10] = [
    "model",
    "size",
    "params",
    "type",
    "backend",
    "threads",
    "test",
    "t/s",
    "ms/token",
    "roofline %",
];

fn cells(r: &Row) -> [String; 10] {
    [
        r.model.clone(),
        r.size.clone(),
        r.params.clone(),
        r.weight_type.clone(),
        r.backend.clone(),
        r.threads.to_string(),
        r.test.clone(),
        format!("{:.2} ± {:.2}", r.tokens_per_s, r.tokens_per_s_sd),
        format!("{:.3}", r.ms_per_token),
        format!("{:.1}", r.roofline_pct),
    ]
}

fn markdown(rows: &[Row]) -> String {
    let body: Vec<[String; 10]> = rows.iter().map(cells).collect();
    let width: Vec<usize> = (0..COLUMNS.len())
        .map(|c| {
            body.iter()
                .map(|r| r[c].chars().count())
                .chain([COLUMNS[c].len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    // Text columns left-aligned, numbers right-aligned, as llama-bench does.
    let right = |c: usize| c >= 5 && c != 6;
    let line = |cells: &[String]| {
        let mut s = String::from("|");
        for (c, v) in cells.iter().enumerate() {
            let pad = width[c] - v.chars().count();
            if right(c) {
                let _ = write!(s, " {}{} |", " ".repeat(pad), v);
            } else {
                let _ = write!(s, " {}{} |", v, " ".repeat(pad));
            }
        }
        s.push('\n');
        s
    };
    let mut out = line(&COLUMNS.map(String::from));
    out.push('|');
    for (c, w) in width.iter().enumerate() {
        if right(c) {
            let _ = write!(out, " {}: |", "-".repeat(w - 1));
        } else {
            let _ = write!(out, " {} |", "-".repeat(*w));
        }
    }
    out.push('\n');
    for r in &body {
        out.push_str(&line(r));
    }
    out
}

fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

fn csv(rows: &[Row]) -> String {
    let mut out = String::from(
        "model,size_bytes,n_params,type,backend,threads,test,n_prompt,n_gen,tokens_per_s,tokens_per_s_sd,ms_per_token,bytes_per_token,bandwidth_bytes_per_s,roofline_pct,samples_ns\n",
    );
    for r in rows {
        let samples: Vec<String> = r.samples_ns.iter().map(u64::to_string).collect();
        let fields = [
            csv_field(&r.model),
            r.size_bytes.to_string(),
            r.n_params.to_string(),
            csv_field(&r.weight_type),
            csv_field(&r.backend),
            r.threads.to_string(),
            r.test.clone(),
            r.n_prompt.to_string(),
            r.n_gen.to_string(),
            format!("{:.3}", r.tokens_per_s),
            format!("{:.3}", r.tokens_per_s_sd),
            format!("{:.4}", r.ms_per_token),
            format!("{:.0}", r.bytes_per_token),
            format!("{:.0}", r.bandwidth_bytes_per_s),
            format!("{:.2}", r.roofline_pct),
            samples.join(";"),
        ];
        out.push_str(&fields.join(","));
        out.push('\n');
    }
    out
}

/// The CUDA bench: the same tests through the engine, so decode runs as in real generation
/// (device sampling, and the graph-replayed megakernel unless `--decode per-op`).
/// UNVERIFIED on a GPU (written on machines without one).
mod gpu {
    use std::path::Path;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use anyhow::{bail, Result};

    use super::{mean_sd, median, params_text, token_ids, Args, Decode, Row};
    use kiln::engine::{DecodePath, Device, Engine, EngineOptions, GenerateOptions, Session};
    use kiln::graph::Dims;
    use kiln::model::Model;

    /// Times `--n-prompt` prefills and `--n-gen` decodes at every `--batch` on the GPU.
    pub fn bench(
        args: &Args,
        path: &Path,
        name: &str,
        weight_type: &str,
        model: Model,
    ) -> Result<Vec<Row>> {
        if args.batch.contains(&0) {
            bail!("--batch sizes must be at least 1");
        }
        let bw = bandwidth(args.bandwidth_mib)?;
        let n_params = model.config.num_params();
        let params = params_text(model.weights.num_params());
        let max_ctx = model.config.max_position_embeddings;
        let opts = EngineOptions {
            device: Device::Cuda,
            decode: match args.decode {
                Decode::Megakernel => DecodePath::Megakernel,
                Decode::PerOp => DecodePath::PerOp,
            },
            ..EngineOptions::default()
        };
        let engine = Arc::new(Engine::from_model(model, opts)?);
        let backend = engine.device();
        eprintln!("kiln-bench: {name} on {backend}");
        let size_bytes = engine.weight_bytes();
        let mut tests: Vec<(usize, usize, usize)> = args
            .n_prompt
            .iter()
            .filter(|&&n| n > 0)
            .map(|&n| (n, 0, 1))
            .collect();
        for &n in args.n_gen.iter().filter(|&&n| n > 0) {
            tests.extend(args.batch.iter().map(|&b| (0, n, b)));
        }
        let mut rows = Vec::new();
        for (n_prompt, n_gen, batch) in tests {
            let test = match (n_prompt, batch) {
                (0, 1) => format!("tg{n_gen}"),
                (0, b) => format!("tg{n_gen}@b{b}"),
                (p, _) => format!("pp{p}"),
            };
            let positions = n_prompt.max(n_gen + 1);
            if positions > max_ctx {
                bail!("{test} needs {positions} positions but {name} holds {max_ctx}");
            }
            eprintln!(
                "kiln-bench: {name} {test}: 1 warm-up + {} runs",
                args.repetitions
            );
            let mut samples = Vec::with_capacity(args.repetitions);
            for rep in 0..=args.repetitions {
                let d = if n_prompt > 0 {
                    prefill(&engine, n_prompt, args.seed)?
                } else {
                    decode(&engine, n_gen, batch, args.seed)?
                };
                if rep > 0 {
                    samples.push(d);
                }
            }
            let (tokens, dims, kind) = if n_prompt > 0 {
                (
                    n_prompt,
                    Dims::prefill(n_prompt),
                    kiln::backend::cpu::PlanKind::Prefill,
                )
            } else {
                (
                    n_gen * batch,
                    Dims::decode(batch, 1 + (n_gen + 1).div_ceil(2)),
                    kiln::backend::cpu::PlanKind::Decode,
                )
            };
            let bytes_per_token = engine.plan(kind).cost(&dims).bytes as f64 / dims.tokens as f64;
            let ts: Vec<f64> = samples
                .iter()
                .map(|d| tokens as f64 / d.as_secs_f64())
                .collect();
            let mut ms: Vec<f64> = samples
                .iter()
                .map(|d| d.as_secs_f64() * 1e3 / tokens as f64)
                .collect();
            ms.sort_by(f64::total_cmp);
            let ms_median = median(&ms);
            let (mean, sd) = mean_sd(&ts);
            rows.push(Row {
                model: name.to_string(),
                model_path: path.display().to_string(),
                size: format!("{:.1} MiB", size_bytes as f64 / (1 << 20) as f64),
                size_bytes,
                params: params.clone(),
                n_params,
                weight_type: weight_type.to_string(),
                backend: backend.clone(),
                threads: 1,
                test,
                n_prompt,
                n_gen,
                tokens_per_s: mean,
                tokens_per_s_sd: sd,
                ms_per_token: ms_median,
                bytes_per_token,
                bandwidth_bytes_per_s: bw,
                roofline_pct: bytes_per_token / bw / (ms_median / 1e3) * 100.0,
                samples_ns: samples.iter().map(|d| d.as_nanos() as u64).collect(),
                samples_ts: ts,
            });
        }
        Ok(rows)
    }

    #[cfg(feature = "cuda")]
    fn bandwidth(mib: usize) -> Result<f64> {
        let bw = kiln::backend::cuda::bandwidth::measure_copy_bandwidth(mib, 20)?;
        eprintln!(
            "kiln-bench: device memory bandwidth {:.1} GB/s (device-to-device copy of {mib} MiB, read + write, median of 20)",
            bw / 1e9
        );
        Ok(bw)
    }

    #[cfg(not(feature = "cuda"))]
    fn bandwidth(_: usize) -> Result<f64> {
        bail!("--device cuda: this kiln-bench was built without the `cuda` cargo feature")
    }

    /// One prefill of `n` seeded random tokens (logits of the last come back to the host).
    fn prefill(engine: &Arc<Engine>, n: usize, seed: u64) -> Result<Duration> {
        let ids = token_ids(n, engine.config().vocab_size, seed);
        let mut s = Session::new(Arc::clone(engine), n, 1);
        let t0 = Instant::now();
        s.feed(&ids)?;
        Ok(t0.elapsed())
    }

    /// `n` greedy tokens in each of `batch` rows after a 1-token prompt, stop tokens ignored;
    /// the decode time only (the prompt's prefill is not counted).
    fn decode(engine: &Arc<Engine>, n: usize, batch: usize, seed: u64) -> Result<Duration> {
        let prompt = token_ids(1, engine.config().vocab_size, seed);
        let mut s = Session::new(Arc::clone(engine), n + 1, batch);
        let opts = GenerateOptions {
            max_tokens: Some(n),
            num_samples: batch,
            stop_tokens: Some(Vec::new()),
            tools: false,
            ..GenerateOptions::default()
        };
        let r = s.generate_batch(&prompt, &opts)?;
        Ok(r.timings.decode)
    }
}

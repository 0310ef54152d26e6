//! `kiln-bench`: prefill and decode throughput in the shape of llama.cpp's `llama-bench`, plus
//! how close each test runs to the memory roofline of the machine it ran on.
//!
//! ```text
//! kiln-bench -m models/SmolLM2-135M-Instruct.Q4_1.gguf -p 512 -n 128 -t 1,2 -r 5
//! kiln-bench --synthetic llama-3.2-1b -p 0 -n 4 -r 1 --batch 1,2
//! kiln-bench --synthetic llama-3.2-1b --bytes-per-token -n 128 --batch 1,2,4,8
//! kiln-bench serve-load --url http://127.0.0.1:8080 --concurrency 1,4,16,64 --max-tokens 64
//! ```
//!
//! For each (model, threads, batch, test) there is one warm-up run, then `-r` timed repetitions,
//! each on a fresh KV cache. `ppN` times one prefill step of N seeded random tokens; `tgN` times
//! N decode steps of `--batch` sequences after a 1-token prompt each. The roofline column is the
//! time the bytes per token would take at the bandwidth (measured, or `--bandwidth-gbs`), over
//! the measured time per token. The pieces that are not CPU-specific live in [`kiln::bench`].

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::{Parser, ValueEnum};
use serde::Serialize;

use kiln::backend::cpu::{simd, CpuBackend, CpuOptions, Numerics, WeightFormat, Workspace};
use kiln::backend::TokenRow;
use kiln::bench::bandwidth::{self, BandwidthSource};
use kiln::bench::bytes::{self, Layout};
use kiln::bench::report::{self, Row};
use kiln::bench::serving::Load;
use kiln::bench::{mean_sd, median, params_text, token_ids};
use kiln::bench::{numerics, speculative};
use kiln::cli::args::{check_model_path, check_threads, NumericsArg, Text};
use kiln::cli::context::kv_bytes_per_position;
use kiln::cli::kiln_args::KvType;
use kiln::cli::memory;
use kiln::cli::output::{die_on_closed_pipe, Stdout};
use kiln::cli::spec::SpecArgs;
use kiln::engine::{
    DecodePath, Device as EngineDevice, Engine, EngineOptions, GenerateOptions, ServeOptions,
    Session, SpecMethod, SpecOptions,
};
use kiln::graph::{human_bytes as human, Dims, Rows};
use kiln::kv::{KvCache, KvOptions};
use kiln::model::{synthetic, Model};
use kiln::note;
use kiln::plan::ExecutionPlan;
use kiln::plan::PlanKind;

#[path = "kiln-bench/serve_load.rs"]
mod serve_load;

#[derive(clap::Subcommand, Debug)]
enum Command {
    /// Closed-loop streaming clients against a running OpenAI-compatible server (kiln serve,
    /// llama-server): aggregate tokens/s, requests/s, TTFT and inter-token latency per
    /// concurrency level.
    ServeLoad(serve_load::ServeLoadArgs),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Device {
    Cpu,
    /// The CUDA backend through the engine, as generation runs it (sampling on the device).
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
    about = "Benchmark prefill (ppN) and decode (tgN) throughput, llama-bench style, with the fraction of the memory roofline reached",
    subcommand_negates_reqs = true,
    args_conflicts_with_subcommands = true
)]
struct Args {
    #[command(subcommand)]
    command: Option<Command>,
    /// Model: a Hugging Face directory or a .gguf file (repeat for several).
    #[arg(short, long, required_unless_present_any = ["synthetic", "measure_gpu_bandwidth"])]
    model: Vec<PathBuf>,
    /// A random-weight model of a named shape instead of a file (repeat or comma list):
    /// llama-3.2-1b, smollm2-135m, tiny. bf16 weights drawn from --seed; nothing is downloaded.
    #[arg(long, value_delimiter = ',', value_name = "SHAPE", value_parser = Text::NON_EMPTY)]
    synthetic: Vec<String>,
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
    /// Sequences decoded together in tg tests (comma list); t/s counts every sequence's tokens.
    /// pp tests always prefill one sequence.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    batch: Vec<usize>,
    /// CPU thread counts (comma list); default: every core.
    #[arg(short = 't', long, value_delimiter = ',')]
    threads: Option<Vec<usize>>,
    /// Backend: the CPU, or CUDA (needs an NVIDIA GPU and its driver, loaded at run time).
    #[arg(long, value_enum, default_value_t = Device::Cpu)]
    device: Device,
    /// Timed repetitions per test (after one warm-up run).
    #[arg(short = 'r', long, default_value_t = 5)]
    repetitions: usize,
    /// Output format on stdout (progress goes to stderr).
    #[arg(short = 'o', long, value_enum, default_value_t = Output::Md)]
    output: Output,
    /// How weights are held in memory.
    #[arg(long, value_enum, default_value_t = Weights::Auto)]
    weights: Weights,
    /// How the CPU multiplies activations by the weights (comma list, each a row of the table):
    /// int24 (the default: 24-bit integer activations against Q4_0/Q4_1/Q5_0/Q8_0 weights in steps
    /// of up to 16 rows on AVX512-VNNI CPUs, exact elsewhere), exact (f32 activations), int16
    /// (16-bit integer activations), bf16 (bf16 prefill activations and weights) or int8 (8-bit
    /// integer activations in every step, Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 weights).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "int24")]
    numerics: Vec<NumericsArg>,
    /// Instead of timing: decode N greedy tokens on each of a few built-in prompts with the
    /// exact path choosing and each other --numerics value following, and print their
    /// agreement (leading greedy tokens, top-1) and the KL divergence of their distributions.
    /// bf16 (which changes prefill only) computes each step's logits teacher-forced, in one
    /// prefill of the exact path's sequence.
    #[arg(long, value_name = "N")]
    agreement: Option<usize>,
    /// Size of the buffer used to measure bandwidth, in MiB. Default: on the CPU, as many bytes
    /// as the test's step reads (rounded up, at most 1024), so that a model the last-level
    /// cache holds is scored against that cache; on a GPU, 1024.
    #[arg(long)]
    bandwidth_mib: Option<usize>,
    /// Compute roofline % against this bandwidth in GB/s (10^9 bytes/s) instead of measuring
    /// one, e.g. a device-to-device copy measured with --measure-gpu-bandwidth.
    #[arg(long, value_name = "GB/s")]
    bandwidth_gbs: Option<f64>,
    /// Decode path with `--device cuda`.
    #[arg(long, value_enum, default_value_t = Decode::Megakernel)]
    decode: Decode,
    /// Seed for the random prompt and decode token ids, and for --synthetic weights.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Also time every instruction of the plan (each tg test's decode steps at its batch, each pp
    /// test's prefill, run -r times more) and print, per op, milliseconds per step, share of the
    /// step, bytes per step, achieved bandwidth and GFLOP/s (stderr).
    #[arg(long)]
    profile: bool,
    /// Time nothing: print, per model, batch and tgN test, the fewest bytes a GPU decode step
    /// must move (bf16 weights once, bf16 KV cache read to the test's mean context, new K/V
    /// written) and their per-token share. docs/gpu-method.md explains the formula.
    #[arg(long)]
    bytes_per_token: bool,
    /// Time nothing: measure GPU 0's device-to-device copy bandwidth (--bandwidth-mib buffer,
    /// bytes read + written, median of 20 event-timed copies) and print it.
    #[arg(long)]
    measure_gpu_bandwidth: bool,
    /// Time nothing and need no GPU: compile each model's CUDA kernels (the per-op sources, and
    /// the decode megakernel of the bucket of each --batch size, with the KILN_MK_* switches set
    /// in the environment) for sm_ARCH (90: H100, H200) into the on-disk kernel cache
    /// ($XDG_CACHE_HOME/kiln or ~/.cache/kiln). A device that loads the same NVRTC version
    /// finds them there instead of compiling at start-up.
    #[arg(long, value_name = "ARCH", value_parser = clap::value_parser!(u32).range(50..=200))]
    precompile_cuda: Option<u32>,
    /// Serving throughput instead of pp/tg tests: for each count (comma list), that many
    /// sequences (random prompts of the first -p length, -n tokens each, greedy) decode together
    /// through the scheduler; prints aggregate decode tokens/s and KV memory per sequence.
    /// With --spec, every sequence gets the method's prompt and runs plainly, then
    /// speculatively, in the same run.
    #[arg(long, value_delimiter = ',', value_name = "N")]
    concurrency: Vec<usize>,
    /// With --concurrency and --spec: the most rows a scheduler step grows to with proposals
    /// (`ServeOptions::spec_step_rows`; default: no limit but the step's token budget).
    #[arg(long, value_name = "N")]
    spec_step_rows: Option<usize>,
    /// With --concurrency: how the serving pool stores keys and values on the CPU (f32, the
    /// exact default, bf16, f16, fp8 or q8; `kiln serve --kv-type`).
    #[arg(long, value_enum, default_value_t = KvType::F32)]
    kv_type: KvType,
    /// With --spec: speculative against plain decoding instead of pp/tg tests, greedy, -n
    /// tokens (the first value) on the prompt each method should help (a code edit for ngram,
    /// free text for draft): acceptance rate and end-to-end tokens/s of both.
    #[command(flatten)]
    spec: SpecArgs,
}

/// The largest -p and -n values: more positions than any model's context, and small enough
/// that byte and flop counts cannot overflow.
const MAX_TOKENS: usize = 1 << 24;
/// The largest --batch.
const MAX_BATCH: usize = 1 << 16;
/// The largest -r.
const MAX_REPETITIONS: usize = 10_000;
/// The largest --bandwidth-mib (1 TiB).
const MAX_BANDWIDTH_MIB: usize = 1 << 20;

/// The buffer a GPU copy measurement takes without --bandwidth-mib, in MiB.
const GPU_COPY_MIB: usize = 1024;

fn main() {
    die_on_closed_pipe();
    if let Err(e) = run() {
        note!("error: {e:#}");
        std::process::exit(1);
    }
}

/// Refuses sizes no run could use before anything is loaded or allocated.
fn check_sizes(args: &Args) -> Result<()> {
    let lists: [(&str, &[usize], usize); 3] = [
        ("-p", &args.n_prompt, MAX_TOKENS),
        ("-n", &args.n_gen, MAX_TOKENS),
        ("--batch", &args.batch, MAX_BATCH),
    ];
    for (flag, values, max) in lists {
        if let Some(v) = values.iter().find(|&&v| v > max) {
            bail!("{flag} {v}: at most {max}");
        }
    }
    if args.repetitions > MAX_REPETITIONS {
        bail!("-r {}: at most {MAX_REPETITIONS}", args.repetitions);
    }
    if let Some(mib) = args.bandwidth_mib.filter(|&m| m > MAX_BANDWIDTH_MIB) {
        bail!("--bandwidth-mib {}: at most {MAX_BANDWIDTH_MIB}", mib);
    }
    for &t in args.threads.iter().flatten() {
        check_threads("-t", t)?;
    }
    for path in &args.model {
        check_model_path("-m", path)?;
    }
    Ok(())
}

/// Host bytes one run of `test` allocates: the KV cache, the plan's activation buffers, the
/// logits and the token ids; `None` when the count overflows.
fn run_bytes(plan: &ExecutionPlan, vocab: usize, test: &Test) -> Option<u64> {
    let (slots, positions, rows) = if test.n_prompt > 0 {
        (1, test.n_prompt, test.n_prompt)
    } else {
        (test.batch, test.n_gen.checked_add(1)?, test.batch)
    };
    let kv = kv_bytes_per_position(&plan.graph.kv)?
        .checked_mul(positions)?
        .checked_mul(slots)?;
    let activations = plan.buffers.iter().try_fold(0usize, |acc, b| {
        let r = match b.rows {
            Rows::Tokens => rows,
            Rows::Sequences => slots,
        };
        acc.checked_add(r.checked_mul(b.cols)?.checked_mul(4)?)
    })?;
    let logits = rows.checked_mul(vocab)?.checked_mul(4)?;
    let ids = positions.checked_mul(slots)?.checked_mul(4)?;
    let total = kv
        .checked_add(activations)?
        .checked_add(logits)?
        .checked_add(ids)?;
    u64::try_from(total).ok()
}

/// A model to benchmark, as named on the command line.
enum Source {
    File(PathBuf),
    Synthetic(String),
}

impl Source {
    /// The table's model column.
    fn name(&self) -> String {
        match self {
            Source::File(path) => path.file_name().map_or_else(
                || path.display().to_string(),
                |n| n.to_string_lossy().into_owned(),
            ),
            Source::Synthetic(shape) => format!("{shape} (synthetic)"),
        }
    }

    /// The JSON's model_path: the file, or how to rebuild the synthetic weights.
    fn path(&self, seed: u64) -> String {
        match self {
            Source::File(path) => path.display().to_string(),
            Source::Synthetic(shape) => format!("synthetic:{shape} seed={seed}"),
        }
    }

    fn load(&self, seed: u64) -> Result<Model> {
        match self {
            Source::File(path) => {
                note!("kiln-bench: loading {}", path.display());
                Model::load(path).context("loading the model")
            }
            Source::Synthetic(shape) => {
                note!("kiln-bench: building synthetic {shape} (seed {seed})");
                let t0 = Instant::now();
                let m = synthetic::load(shape, seed)?;
                note!(
                    "kiln-bench: {} random bf16 parameters in {:.1} s",
                    m.weights.num_params(),
                    t0.elapsed().as_secs_f64()
                );
                Ok(m)
            }
        }
    }
}

fn run() -> Result<()> {
    let args = Args::parse();
    if let Some(Command::ServeLoad(load)) = &args.command {
        return serve_load::run(load);
    }
    check_sizes(&args)?;
    if args.measure_gpu_bandwidth {
        return measure_gpu_bandwidth(&args);
    }
    if args.repetitions == 0 {
        bail!("-r must be at least 1");
    }
    if args.batch.contains(&0) {
        bail!("--batch sizes must be at least 1");
    }
    let sources: Vec<Source> = args
        .model
        .iter()
        .cloned()
        .map(Source::File)
        .chain(args.synthetic.iter().cloned().map(Source::Synthetic))
        .collect();
    if args.bytes_per_token {
        return print_bytes_per_token(&args, &sources);
    }
    if let Some(arch) = args.precompile_cuda {
        return precompile_cuda(&args, &sources, arch);
    }
    let threads = match &args.threads {
        Some(t) if t.contains(&0) => bail!("thread counts must be at least 1"),
        _ if args.device == Device::Cuda => vec![1],
        Some(t) => t.clone(),
        None => vec![std::thread::available_parallelism().map_or(1, |n| n.get())],
    };
    if let (Device::Cpu, None, Some(avail)) = (args.device, args.bandwidth_gbs, memory::available())
    {
        let mib = args.bandwidth_mib.unwrap_or(bandwidth::MAX_STEP_READ_MIB);
        let need = (mib.max(1) as u64) << 20;
        if need > avail.usable() {
            bail!(
                "--bandwidth-mib {}: the buffer needs {} but may take at most {}, 3/4 of the {} \
                 available ({})",
                mib,
                human(need),
                human(avail.usable()),
                human(avail.bytes),
                avail.limit
            );
        }
    }
    let weights = match args.weights {
        Weights::Auto => WeightFormat::AsStored,
        Weights::F32 => WeightFormat::F32,
        Weights::Bf16 => WeightFormat::BF16,
    };
    if args.numerics.is_empty() {
        bail!("--numerics needs at least one of int24, exact, int16, bf16, int8");
    }
    if args.device == Device::Cuda
        && !matches!(
            args.numerics[..],
            [NumericsArg::Int24] | [NumericsArg::Exact]
        )
    {
        bail!("--numerics applies to the CPU backend; the CUDA backend has one numerics");
    }
    let cpu_opts = |threads: usize| -> Result<CpuOptions> {
        match args.numerics[..] {
            [n] => Ok(CpuOptions {
                threads,
                weights,
                numerics: n.numerics(),
            }),
            _ => bail!("--concurrency and --spec take one --numerics value"),
        }
    };
    if let Some(steps) = args.agreement {
        return run_agreement(&args, &sources, threads[0], weights, steps);
    }
    if !args.concurrency.is_empty() {
        return run_serving(&args, &sources, &threads, &cpu_opts);
    }
    if args.spec.spec.is_some() {
        return run_speculative(&args, &sources, &threads, &cpu_opts);
    }
    let mut bandwidth = match args.bandwidth_gbs {
        Some(gbs) if !(gbs > 0.0 && gbs.is_finite()) => {
            bail!("--bandwidth-gbs must be a positive number, not {gbs}")
        }
        Some(gbs) => BandwidthSource::Given(gbs * 1e9),
        None => match args.device {
            Device::Cpu => BandwidthSource::cpu_read(args.bandwidth_mib),
            Device::Cuda => {
                BandwidthSource::device_copy(args.bandwidth_mib.unwrap_or(GPU_COPY_MIB))
            }
        },
    };
    let mut rows = Vec::new();
    for source in &sources {
        let mut model = Some(source.load(args.seed)?);
        let model_ref = model.as_ref().expect("just loaded");
        let (n_params, params) = (
            model_ref.config.num_params(),
            params_text(model_ref.weights.num_params()),
        );
        let name = source.name();
        let weight_type = match (args.device, args.weights) {
            (Device::Cuda, _) => format!("{} as bf16", model_ref.weight_type),
            (_, Weights::Auto) => model_ref.weight_type.clone(),
            (_, Weights::F32) => format!("{} as f32", model_ref.weight_type),
            (_, Weights::Bf16) => format!("{} as bf16", model_ref.weight_type),
        };
        let max_ctx = model_ref.config.max_position_embeddings;
        for (&t, &numerics) in threads
            .iter()
            .flat_map(|t| args.numerics.iter().map(move |n| (t, n)))
        {
            let target: Box<dyn Target> = match args.device {
                Device::Cpu => {
                    let m = model.as_ref().expect("kept for every thread count");
                    Box::new(CpuTarget {
                        backend: CpuBackend::new(
                            &m.config,
                            &m.weights,
                            CpuOptions {
                                threads: t,
                                weights,
                                numerics: numerics.numerics(),
                            },
                        )?,
                    })
                }
                Device::Cuda => {
                    let m = model.take().expect("one CUDA engine per model");
                    Box::new(CudaTarget::new(m, args.decode)?)
                }
            };
            for test in tests(&args) {
                let positions = test.n_prompt.max(test.n_gen.saturating_add(1));
                if positions > max_ctx {
                    bail!(
                        "{} needs {positions} positions but {name} holds {max_ctx}",
                        test.name()
                    );
                }
                target.check_memory(&test)?;
                note!(
                    "kiln-bench: {name} threads={t} batch={} {}: 1 warm-up + {} runs",
                    test.batch,
                    test.name(),
                    args.repetitions
                );
                let mut samples = Vec::new();
                for rep in 0..=args.repetitions {
                    let d = target.time(&test, args.seed)?;
                    if rep > 0 {
                        samples.push(d);
                    }
                }
                if args.profile {
                    target.profile(&test, args.repetitions, args.seed)?;
                }
                let (bytes_per_token, bytes_source) = target.bytes_per_token(&test);
                let bw = bandwidth.get(t, (bytes_per_token * test.step_tokens() as f64) as u64)?;
                let n = test.tokens() as f64;
                let ts: Vec<f64> = samples.iter().map(|d| n / d.as_secs_f64()).collect();
                let mut ms: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1e3 / n).collect();
                ms.sort_by(f64::total_cmp);
                let ms_median = median(&ms);
                let (mean, sd) = mean_sd(&ts);
                rows.push(Row {
                    model: name.clone(),
                    model_path: source.path(args.seed),
                    size: format!("{:.1} MiB", target.weight_bytes() as f64 / (1 << 20) as f64),
                    size_bytes: target.weight_bytes(),
                    params: params.clone(),
                    n_params,
                    weight_type: weight_type.clone(),
                    backend: target.backend(),
                    threads: target.threads(),
                    test: test.name(),
                    n_prompt: test.n_prompt,
                    n_gen: test.n_gen,
                    batch: test.batch,
                    tokens_per_s: mean,
                    tokens_per_s_sd: sd,
                    ms_per_token: ms_median,
                    bytes_per_token,
                    bytes_source,
                    bandwidth_bytes_per_s: bw.bytes_per_s,
                    bandwidth_source: bw.source.clone(),
                    roofline_pct: report::roofline_pct(bytes_per_token, bw.bytes_per_s, ms_median),
                    samples_ns: samples.iter().map(|d| d.as_nanos() as u64).collect(),
                    samples_ts: ts,
                });
            }
        }
    }
    let out = match args.output {
        Output::Md => report::markdown(&rows),
        Output::Json => serde_json::to_string_pretty(&rows)? + "\n",
        Output::Csv => report::csv(&rows),
    };
    print_out(&out)
}

/// Writes the report to stdout (a full disk is an error; a closed pipe ends the process).
fn print_out(text: &str) -> Result<()> {
    let mut out = Stdout::lock();
    out.write(text)?;
    out.flush()?;
    Ok(())
}

/// One timed test: `ppN` (one prefill of N tokens) or `tgN` (N decode steps of `batch`
/// sequences).
struct Test {
    n_prompt: usize,
    n_gen: usize,
    batch: usize,
}

impl Test {
    fn name(&self) -> String {
        if self.n_prompt > 0 {
            format!("pp{}", self.n_prompt)
        } else {
            format!("tg{}", self.n_gen)
        }
    }

    /// Tokens one run produces (prefill: consumes).
    fn tokens(&self) -> usize {
        if self.n_prompt > 0 {
            self.n_prompt
        } else {
            self.n_gen.saturating_mul(self.batch)
        }
    }

    /// Tokens of one step: the prompt for a pp test, a token per sequence for a tg test.
    fn step_tokens(&self) -> usize {
        if self.n_prompt > 0 {
            self.n_prompt
        } else {
            self.batch
        }
    }
}

/// Every pp test (batch 1), then every tg test at every batch size.
fn tests(args: &Args) -> Vec<Test> {
    let pp = args.n_prompt.iter().filter(|&&n| n > 0).map(|&n| Test {
        n_prompt: n,
        n_gen: 0,
        batch: 1,
    });
    let tg = args.n_gen.iter().filter(|&&n| n > 0).flat_map(|&n| {
        args.batch.iter().map(move |&b| Test {
            n_prompt: 0,
            n_gen: n,
            batch: b,
        })
    });
    pp.chain(tg).collect()
}

/// One backend compiled for one model: what the timing loop asks of it. A GPU backend plugs in
/// as a second implementation; its `time` must return device time (synchronize before reading
/// the clock, or time with events), and its bytes per token come from
/// [`kiln::bench::bytes::decode_step`] with [`Layout::BF16`], the count docs/gpu-method.md
/// defines.
trait Target {
    /// The table's backend column.
    fn backend(&self) -> String;
    fn threads(&self) -> usize;
    /// Bytes of weights the backend holds.
    fn weight_bytes(&self) -> usize;
    /// Wall time of one run of `test`.
    fn time(&self, test: &Test, seed: u64) -> Result<Duration>;
    /// Bytes a token of `test` must move, and which model of bytes that is.
    fn bytes_per_token(&self, test: &Test) -> (f64, String);
    /// `--profile`: a per-op breakdown of `test` (its decode steps, or `repetitions` runs of its
    /// prefill) on stderr, where the backend has one.
    fn profile(&self, _test: &Test, _repetitions: usize, _seed: u64) -> Result<()> {
        Ok(())
    }
    /// Refuses `test` when what it allocates in host memory does not fit.
    fn check_memory(&self, _test: &Test) -> Result<()> {
        Ok(())
    }
}

/// The CPU backend compiled for one model and thread count.
struct CpuTarget {
    backend: CpuBackend,
}

impl Target for CpuTarget {
    fn backend(&self) -> String {
        let level = format!(
            "{} prefetch-{}",
            simd::level().name(),
            kiln::backend::cpu::matmul::prefetch_policy()
        );
        match self.backend.numerics() {
            Numerics::Exact if kiln::backend::cpu::matmul::amx_tiles(Numerics::Exact) => {
                format!("CPU ({level}, amx for bf16 weights)")
            }
            Numerics::Exact => format!("CPU ({level})"),
            n if kiln::backend::cpu::matmul::amx_tiles(n) => {
                format!("CPU ({level}, {}, amx)", n.name())
            }
            n => format!("CPU ({level}, {})", n.name()),
        }
    }

    fn threads(&self) -> usize {
        self.backend.threads()
    }

    fn weight_bytes(&self) -> usize {
        self.backend.weight_bytes()
    }

    fn time(&self, test: &Test, seed: u64) -> Result<Duration> {
        if test.n_prompt > 0 {
            time_prefill(&self.backend, test.n_prompt, seed)
        } else {
            time_decode(&self.backend, test.batch, test.n_gen, seed)
        }
    }

    /// The plan's cost model: the weights as this backend stores them, the f32 KV cache read up
    /// to the test's mean context, activations.
    fn bytes_per_token(&self, test: &Test) -> (f64, String) {
        let (kind, dims) = if test.n_prompt > 0 {
            (PlanKind::Prefill, Dims::prefill(test.n_prompt))
        } else {
            (
                PlanKind::Decode,
                Dims::decode(test.batch, bytes::tg_context(test.n_gen)),
            )
        };
        let bytes = self.backend.plan(kind).cost(&dims).bytes as f64 / dims.tokens as f64;
        (bytes, "CPU plan cost model".into())
    }

    fn profile(&self, test: &Test, repetitions: usize, seed: u64) -> Result<()> {
        if test.n_prompt > 0 {
            profile_prefill(&self.backend, test.n_prompt, repetitions.max(1), seed)
        } else {
            profile_decode(&self.backend, test.batch, test.n_gen, seed)
        }
    }

    fn check_memory(&self, test: &Test) -> Result<()> {
        let kind = if test.n_prompt > 0 {
            PlanKind::Prefill
        } else {
            PlanKind::Decode
        };
        let vocab = self.backend.config().vocab_size;
        let Some(need) = run_bytes(self.backend.plan(kind), vocab, test) else {
            bail!(
                "{} at batch {}: its buffers are too large to count in bytes",
                test.name(),
                test.batch
            );
        };
        if let Some(avail) = memory::available().filter(|a| need > a.usable()) {
            bail!(
                "{} at batch {} needs {} but may take at most {}, 3/4 of the {} available ({}); \
                 pass a smaller -p, -n or --batch",
                test.name(),
                test.batch,
                human(need),
                human(avail.usable()),
                human(avail.bytes),
                avail.limit
            );
        }
        Ok(())
    }
}

/// One sequence's prefill of `n` random tokens, with the cache and buffers it reuses from run
/// to run (as a server reuses them).
struct Prefill {
    ids: Vec<u32>,
    rows: Vec<TokenRow>,
    kv: KvCache,
    ws: Workspace,
    logits: Vec<f32>,
}

impl Prefill {
    fn new(b: &CpuBackend, n: usize, seed: u64) -> Result<Prefill> {
        Ok(Prefill {
            ids: token_ids(n, b.config().vocab_size, seed),
            rows: (0..n).map(|pos| TokenRow { slot: 0, pos }).collect(),
            kv: b.new_cache(1, n)?,
            ws: Workspace::new(),
            logits: Vec::new(),
        })
    }

    /// The prefill from position 0, over whatever an earlier run left in the cache.
    fn run(&mut self, b: &CpuBackend) -> Result<()> {
        self.kv.truncate(0, 0);
        b.forward(
            PlanKind::Prefill,
            &mut self.ws,
            &mut self.kv,
            &self.ids,
            &self.rows,
            &mut self.logits,
        )?;
        Ok(())
    }
}

fn time_prefill(b: &CpuBackend, n: usize, seed: u64) -> Result<Duration> {
    let mut p = Prefill::new(b, n, seed)?;
    let t0 = Instant::now();
    p.run(b)?;
    Ok(t0.elapsed())
}

/// Times `n` decode steps of `batch` sequences (sequence i in cache slot i), after one untimed
/// step that gives each its first token.
fn time_decode(b: &CpuBackend, batch: usize, n: usize, seed: u64) -> Result<Duration> {
    let ids = token_ids((n + 1) * batch, b.config().vocab_size, seed);
    let mut kv = b.new_cache(batch, n + 1)?;
    let mut ws = Workspace::new();
    let mut logits = Vec::new();
    let mut step = |pos: usize| {
        let rows: Vec<TokenRow> = (0..batch).map(|slot| TokenRow { slot, pos }).collect();
        b.forward(
            PlanKind::Decode,
            &mut ws,
            &mut kv,
            &ids[pos * batch..(pos + 1) * batch],
            &rows,
            &mut logits,
        )
    };
    step(0)?;
    let t0 = Instant::now();
    for pos in 1..=n {
        step(pos)?;
    }
    Ok(t0.elapsed())
}

/// Times each decode-plan instruction over `n` steps of `batch` sequences (sequence i in cache
/// slot i) and prints a per-op summary to stderr; times, bytes and flops are per step.
fn profile_decode(b: &CpuBackend, batch: usize, n: usize, seed: u64) -> Result<()> {
    let ids = token_ids((n + 1) * batch, b.config().vocab_size, seed);
    let mut kv = b.new_cache(batch, n + 1)?;
    let mut ws = Workspace::new();
    let mut logits = Vec::new();
    ws.enable_profile();
    let mut wall = Duration::ZERO;
    for pos in 0..=n {
        let rows: Vec<TokenRow> = (0..batch).map(|slot| TokenRow { slot, pos }).collect();
        let t0 = Instant::now();
        b.forward(
            PlanKind::Decode,
            &mut ws,
            &mut kv,
            &ids[pos * batch..(pos + 1) * batch],
            &rows,
            &mut logits,
        )?;
        wall += t0.elapsed();
    }
    let dims = Dims::decode(batch, n.div_ceil(2) + 1);
    let what = format!("decode profile over {} steps of {batch} sequences", n + 1);
    print_profile(&what, b.plan(PlanKind::Decode), &dims, &ws, (n + 1, wall));
    Ok(())
}

/// Times each prefill-plan instruction over `runs` prefills of `n` tokens into one sequence
/// (the cache and buffers reused from run to run, as a server reuses them) and prints a per-op
/// summary to stderr; times are per run.
fn profile_prefill(b: &CpuBackend, n: usize, runs: usize, seed: u64) -> Result<()> {
    let mut p = Prefill::new(b, n, seed)?;
    p.ws.enable_profile();
    let mut wall = Duration::ZERO;
    for _ in 0..runs {
        let t0 = Instant::now();
        p.run(b)?;
        wall += t0.elapsed();
    }
    let what = format!("prefill profile over {runs} runs of {n} tokens");
    print_profile(
        &what,
        b.plan(PlanKind::Prefill),
        &Dims::prefill(n),
        &p.ws,
        (runs, wall),
    );
    Ok(())
}

/// The per-op table of a profiled workspace after `steps` forward calls of `plan`: instructions
/// grouped by what they are, not by layer (`layers.7.attn.q+k+v` → `attn.q+k+v`), with the
/// plan's cost model's bytes and flops at `dims` over the measured time.
fn print_profile(
    what: &str,
    plan: &ExecutionPlan,
    dims: &Dims,
    ws: &Workspace,
    (steps, wall): (usize, Duration),
) {
    use std::collections::BTreeMap;
    let times = ws.profile().unwrap_or(&[]);
    let mut groups: BTreeMap<String, (usize, Duration, u64, u64)> = BTreeMap::new();
    for (ins, t) in plan.instrs.iter().zip(times) {
        let key = match ins.label.strip_prefix("layers.") {
            Some(rest) => rest.split_once('.').map_or(rest, |(_, r)| r).to_string(),
            None => ins.label.clone(),
        };
        let cost = plan.graph.nodes[ins.node].cost(&plan.graph, dims);
        let e = groups
            .entry(format!("{key} ({})", ins.op.name()))
            .or_default();
        e.0 += 1;
        e.1 += *t;
        e.2 += cost.bytes;
        e.3 += cost.flops;
    }
    let total: Duration = times.iter().sum();
    let steps = steps.max(1) as f64;
    note!(
        "kiln-bench: {what}, {:.3} ms/step in instructions of {:.3} ms/step in all ({:.1} µs a \
         step outside them: its setup, the gaps between instructions and, with more than one \
         thread, its hand-over to the thread pool and back)",
        total.as_secs_f64() * 1e3 / steps,
        wall.as_secs_f64() * 1e3 / steps,
        wall.saturating_sub(total).as_secs_f64() * 1e6 / steps
    );
    note!("| op | count | ms/step | share | bytes/step | GB/s | GFLOP/s |");
    note!("|---|---:|---:|---:|---:|---:|---:|");
    let mut rows: Vec<_> = groups.into_iter().collect();
    rows.sort_by(|a, b| b.1 .1.cmp(&a.1 .1).then(a.0.cmp(&b.0)));
    let mut skipped = false;
    for (name, (count, t, bytes, flops)) in rows {
        if t.is_zero() {
            // Never run as an instruction (its work done inside another's).
            skipped = true;
            note!("| {name} | {count} | 0.000 | 0.0% | {bytes} | – | – |");
            continue;
        }
        let secs = (t.as_secs_f64() / steps).max(1e-12);
        note!(
            "| {name} | {count} | {:.3} | {:.1}% | {bytes} | {:.1} | {:.1} |",
            secs * 1e3,
            100.0 * t.as_secs_f64() / total.as_secs_f64().max(1e-12),
            bytes as f64 / secs / 1e9,
            flops as f64 / secs / 1e9
        );
    }
    if skipped {
        note!(
            "kiln-bench: ops without a time ran inside others (in one-token steps, each \
             attention rotates its queries and keys itself: the rope ops before it are skipped)"
        );
    }
}

/// One row of `--bytes-per-token`.
#[derive(Serialize)]
struct BytesRow {
    model: String,
    test: String,
    batch: usize,
    /// Mean positions attended per step.
    context: usize,
    layout: Layout,
    weights: u64,
    kv_read: u64,
    kv_write: u64,
    bytes_per_step: u64,
    bytes_per_token: f64,
}

fn print_bytes_per_token(args: &Args, sources: &[Source]) -> Result<()> {
    let mut rows = Vec::new();
    for source in sources {
        // Only the config is needed: a synthetic shape is not built, a file is only mapped.
        let config = match source {
            Source::Synthetic(shape) => synthetic::shape_config(shape)?.0,
            Source::File(_) => source.load(args.seed)?.config,
        };
        for &n in args.n_gen.iter().filter(|&&n| n > 0) {
            for &batch in &args.batch {
                let context = bytes::tg_context(n);
                let Some(d) = bytes::decode_step(&config, Layout::BF16, batch, context) else {
                    bail!(
                        "{}: the bytes model covers the llama architecture only",
                        source.name()
                    );
                };
                rows.push(BytesRow {
                    model: source.name(),
                    test: format!("tg{n}"),
                    batch,
                    context,
                    layout: Layout::BF16,
                    weights: d.weights,
                    kv_read: d.kv_read,
                    kv_write: d.kv_write,
                    bytes_per_step: d.total(),
                    bytes_per_token: d.per_token(),
                });
            }
        }
    }
    match args.output {
        Output::Json => print_out(&(serde_json::to_string_pretty(&rows)? + "\n")),
        Output::Md | Output::Csv => {
            let head = [
                "model",
                "test",
                "batch",
                "context",
                "weights B/step",
                "KV read B/step",
                "KV write B/step",
                "B/token",
            ]
            .map(String::from);
            let body: Vec<[String; 8]> = rows
                .iter()
                .map(|r| {
                    [
                        r.model.clone(),
                        r.test.clone(),
                        r.batch.to_string(),
                        r.context.to_string(),
                        r.weights.to_string(),
                        r.kv_read.to_string(),
                        r.kv_write.to_string(),
                        format!("{:.0}", r.bytes_per_token),
                    ]
                })
                .collect();
            print_out(&report::table(&head, &body, |c| c >= 2))
        }
    }
}

/// `--precompile-cuda`: each model's kernels into the on-disk cache, one line per source.
#[cfg(feature = "cuda")]
fn precompile_cuda(args: &Args, sources: &[Source], arch: u32) -> Result<()> {
    use kiln::backend::cuda::precompile::precompile;
    for source in sources {
        let model = source.load(args.seed)?;
        let report = precompile(&model.config, &model.weights, arch, &args.batch)
            .with_context(|| format!("{}: compiling for sm_{arch}", source.name()))?;
        for f in &report.files {
            let how = if f.was_cached { "cached" } else { "compiled" };
            print_out(&format!(
                "{}\tsm_{arch}\t{}\t{how}\t{:.1} s\n",
                source.name(),
                f.file,
                f.seconds
            ))?;
        }
        if let Some(why) = &report.megakernel_unsupported {
            note!("kiln-bench: {}: no decode megakernel: {why}", source.name());
        }
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn precompile_cuda(_: &Args, _: &[Source], _: u32) -> Result<()> {
    bail!("--precompile-cuda: this kiln-bench was built without the `cuda` feature")
}

fn measure_gpu_bandwidth(args: &Args) -> Result<()> {
    let copy = bandwidth::device_copy(args.bandwidth_mib.unwrap_or(GPU_COPY_MIB), 20)?;
    note!("kiln-bench: {}", copy.summary());
    match args.output {
        Output::Json => print_out(&(serde_json::to_string(&copy)? + "\n")),
        Output::Md | Output::Csv => print_out(&format!("{:.1} GB/s\n", copy.bytes_per_s / 1e9)),
    }
}

/// The engine on CUDA for one model: prefill through the per-op kernels (cuBLAS GEMMs), decode
/// through the graph-replayed megakernel or per-op kernels, sampling on the device, exactly as
/// `kiln --device cuda` generates. Timing is wall time around calls that return only once the
/// device work they started has finished (logits or tokens are on the host).
/// Ran on an H200 for decode (`-p 0`, both paths, batch 1 to 8; docs/gpu-results.md); the
/// prefill timing (`ppN`) has not run on a GPU.
struct CudaTarget {
    engine: Arc<Engine>,
}

impl CudaTarget {
    fn new(model: Model, decode: Decode) -> Result<CudaTarget> {
        let opts = EngineOptions {
            device: EngineDevice::Cuda,
            decode: match decode {
                Decode::Megakernel => DecodePath::Megakernel,
                Decode::PerOp => DecodePath::PerOp,
            },
            ..EngineOptions::default()
        };
        let engine = Arc::new(Engine::from_model(model, opts)?);
        note!("kiln-bench: on {}", engine.device());
        Ok(CudaTarget { engine })
    }
}

impl Target for CudaTarget {
    fn backend(&self) -> String {
        self.engine.device()
    }

    fn threads(&self) -> usize {
        1
    }

    fn weight_bytes(&self) -> usize {
        self.engine.weight_bytes()
    }

    /// `ppN`: one prefill of N seeded random tokens. `tgN` at batch B: N greedy tokens in each of
    /// B rows after a 1-token prompt (stop tokens ignored), the decode time only.
    fn time(&self, test: &Test, seed: u64) -> Result<Duration> {
        let vocab = self.engine.config().vocab_size;
        if test.n_prompt > 0 {
            let ids = token_ids(test.n_prompt, vocab, seed);
            let mut s = Session::new(Arc::clone(&self.engine), test.n_prompt, 1);
            let t0 = Instant::now();
            s.feed(&ids)?;
            return Ok(t0.elapsed());
        }
        let prompt = token_ids(1, vocab, seed);
        let t0 = Instant::now();
        let mut s = Session::new(Arc::clone(&self.engine), test.n_gen + 1, test.batch);
        let opts = GenerateOptions {
            max_tokens: Some(test.n_gen),
            num_samples: test.batch,
            stop_tokens: Some(Vec::new()),
            tools: false,
            ..GenerateOptions::default()
        };
        let timings = s.generate_batch(&prompt, &opts)?.timings;
        drop(s);
        // The timed part is the decode; what a run costs around it (the session's cache and
        // decode graph, the prefill, tearing them down) is printed, since it is what a request
        // pays before its first token. On an H100 a Llama-3.2-1B megakernel run spent seconds
        // outside its decode (docs/gpu-results.md, run 9) where SmolLM2's spent about one.
        let wall = t0.elapsed();
        note!(
            "kiln-bench: run: decode {:.1} ms, prefill {:.1} ms, {:.1} ms wall (session, graph and cache set-up and teardown included)",
            timings.decode.as_secs_f64() * 1e3,
            timings.prefill.as_secs_f64() * 1e3,
            wall.as_secs_f64() * 1e3
        );
        Ok(timings.decode)
    }

    /// Decode: the fewest bytes a bf16 step must move (docs/gpu-method.md), where the
    /// architecture allows that count; else, and for prefill, the plan's cost model.
    fn bytes_per_token(&self, test: &Test) -> (f64, String) {
        if test.n_prompt == 0 {
            let ctx = bytes::tg_context(test.n_gen);
            if let Some(b) = bytes::decode_step(self.engine.config(), Layout::BF16, test.batch, ctx)
            {
                return (b.per_token(), "bf16 minimum (docs/gpu-method.md)".into());
            }
        }
        let (kind, dims) = if test.n_prompt > 0 {
            (PlanKind::Prefill, Dims::prefill(test.n_prompt))
        } else {
            (
                PlanKind::Decode,
                Dims::decode(test.batch, bytes::tg_context(test.n_gen)),
            )
        };
        let bytes = self.engine.plan(kind).cost(&dims).bytes as f64 / dims.tokens as f64;
        (bytes, "plan cost model".into())
    }
}

/// `--concurrency`: the scheduler's aggregate decode throughput per number of sequences, on
/// the CPU or (`--device cuda`) over a device pool. Each level is timed after a short untimed
/// run at the same level, so that what a server pays once (the pool's blocks, and on a GPU the
/// level's megakernels and decode graphs: about 100 ms for SmolLM2-135M's batch-8 bucket on an
/// H100, docs/gpu-results.md run 12) is not counted as decode time.
fn run_serving(
    args: &Args,
    sources: &[Source],
    threads: &[usize],
    cpu_opts: &dyn Fn(usize) -> Result<CpuOptions>,
) -> Result<()> {
    const MAX_CONCURRENCY: usize = 4096;
    if let Some(&c) = args
        .concurrency
        .iter()
        .find(|&&c| c == 0 || c > MAX_CONCURRENCY)
    {
        bail!("--concurrency values must be between 1 and {MAX_CONCURRENCY}, not {c}");
    }
    let prompt = args.n_prompt.first().copied().unwrap_or(16).max(1);
    let n_gen = args.n_gen.first().copied().unwrap_or(64).max(2);
    args.spec.check()?;
    let speculating = args.spec.spec.is_some();
    print_out(if speculating {
        "| model | threads | sequences | method | prompt | tokens each | plain t/s (all) | spec t/s (all) | speedup | acceptance | KV per sequence |\n|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|\n"
    } else {
        "| model | threads | sequences | prompt | tokens each | decode t/s (all) | t/s per sequence | steps | KV per sequence |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    })?;
    for src in sources {
        for &t in threads {
            let cpu = cpu_opts(t)?;
            let engine = match args.device {
                Device::Cpu => Arc::new(Engine::from_model(src.load(args.seed)?, cpu)?),
                // The scheduler over a device pool: per-op steps, and up to 8 decode rows
                // through the megakernel graph unless `--decode per-op`.
                Device::Cuda => CudaTarget::new(src.load(args.seed)?, args.decode)?.engine,
            };
            let spec = spec_options(args, &engine, cpu)?;
            let plain = match &spec {
                Some(s) => Load {
                    prompt: Some(spec_prompt(&engine, s, n_gen + s.max_draft)?),
                    spec: None,
                },
                None => Load::default(),
            };
            let with_spec = Load {
                spec: spec.clone(),
                ..plain.clone()
            };
            let run = |c: usize, n: usize, load: &Load| {
                kiln::bench::serving::run(
                    &engine,
                    ServeOptions {
                        spec_step_rows: args
                            .spec_step_rows
                            .unwrap_or(ServeOptions::default().spec_step_rows),
                        kv: KvOptions {
                            dtype: args.kv_type.dtype(),
                            ..ServeOptions::default().kv
                        },
                        ..ServeOptions::default()
                    },
                    c,
                    prompt,
                    n,
                    args.seed,
                    load,
                )
            };
            for &c in &args.concurrency {
                kiln::note!("kiln-bench: {c} sequences, {t} threads");
                // Untimed first, at this level: the pool, the caches and (on a GPU) this
                // level's decode graphs exist before the timed run.
                run(c, 4, &with_spec)?;
                let r = run(c, n_gen, &plain)?;
                if r.graph_steps + r.device_draw_steps > 0 {
                    kiln::note!(
                        "kiln-bench: {c} sequences: {} of {} steps through the decode graph, {} \
                         drawn on the device",
                        r.graph_steps,
                        r.steps,
                        r.device_draw_steps
                    );
                }
                let p = plain.prompt.as_ref().map_or(prompt, Vec::len);
                let kv = r.kv_bytes_per_seq as f64 / 1024.0;
                let Some(s) = &spec else {
                    print_out(&format!(
                        "| {} | {t} | {c} | {p} | {n_gen} | {:.1} | {:.1} | {} | {kv:.1} KiB |\n",
                        src.name(),
                        r.decode_tokens_per_s,
                        r.decode_tokens_per_s / c as f64,
                        r.decode_steps,
                    ))?;
                    continue;
                };
                let q = run(c, n_gen, &with_spec)?;
                let method = spec_method_name(s);
                print_out(&format!(
                    "| {} | {t} | {c} | {method} (k ≤ {}) | {p} | {n_gen} | {:.1} | {:.1} | {:.2}× | {:.0}% | {kv:.1} KiB |\n",
                    src.name(),
                    s.max_draft,
                    r.decode_tokens_per_s,
                    q.decode_tokens_per_s,
                    q.decode_tokens_per_s / r.decode_tokens_per_s,
                    100.0 * q.acceptance_rate.unwrap_or(0.0),
                ))?;
            }
        }
    }
    Ok(())
}

/// `--agreement N`: each non-exact `--numerics` value against the exact path, per model and
/// built-in prompt.
fn run_agreement(
    args: &Args,
    sources: &[Source],
    threads: usize,
    weights: WeightFormat,
    steps: usize,
) -> Result<()> {
    const MAX_STEPS: usize = 1 << 16;
    if steps == 0 || steps > MAX_STEPS {
        bail!("--agreement {steps}: give 1 to {MAX_STEPS} steps");
    }
    let others: Vec<NumericsArg> = args
        .numerics
        .iter()
        .copied()
        .filter(|&n| n != NumericsArg::Exact)
        .collect();
    if others.is_empty() {
        bail!("--agreement compares --numerics values other than exact against exact: give one, e.g. --numerics int16");
    }
    let engine = |numerics: NumericsArg, model| -> Result<Arc<Engine>> {
        let cpu = CpuOptions {
            threads,
            weights,
            numerics: numerics.numerics(),
        };
        Ok(Arc::new(Engine::from_model(model, cpu)?))
    };
    print_out("| model | numerics | prompt | prompt tokens | steps | leading equal | top-1 equal | mean KL | max KL |\n|---|---|---:|---:|---:|---:|---:|---:|---:|\n")?;
    for src in sources {
        let exact = engine(NumericsArg::Exact, src.load(args.seed)?)?;
        for &n in &others {
            let other = engine(n, src.load(args.seed)?)?;
            let (mut leading, mut top1, mut kl, mut count) = (0, 0, 0.0, 0);
            for (i, text) in numerics::PROMPTS.iter().enumerate() {
                let ids = speculative::encode_prompt(&exact, text)?;
                note!(
                    "kiln-bench: {} {} prompt {i}: {steps} steps",
                    src.name(),
                    n.numerics().name()
                );
                // Bf16 changes only calls of more than 16 tokens: teacher-forced, in one prefill.
                let r = match n.numerics() {
                    Numerics::Bf16 => numerics::compare_prefill(&exact, &other, &ids, steps)?,
                    _ => numerics::compare(&exact, &other, &ids, steps)?,
                };
                print_out(&format!(
                    "| {} | {} | {i} | {} | {} | {} | {} | {:.3e} | {:.3e} |\n",
                    src.name(),
                    n.numerics().name(),
                    r.prompt_tokens,
                    r.steps,
                    r.leading,
                    r.top1_equal,
                    r.mean_kl,
                    r.max_kl
                ))?;
                leading += r.leading;
                top1 += r.top1_equal;
                kl += r.mean_kl;
                count += 1;
            }
            print_out(&format!(
                "| {} | {} | all | | {} | {} | {} | {:.3e} | |\n",
                src.name(),
                n.numerics().name(),
                steps * count,
                leading,
                top1,
                kl / count as f64
            ))?;
        }
    }
    Ok(())
}

/// The `--spec` flags' options for `engine`, loading the `--draft` model (`None` without
/// `--spec`).
fn spec_options(args: &Args, engine: &Engine, cpu: CpuOptions) -> Result<Option<SpecOptions>> {
    let draft = match args.spec.draft_path() {
        Some(path) => Some(Arc::new(
            Engine::load(path, cpu).with_context(|| format!("--draft {}", path.display()))?,
        )),
        None => None,
    };
    Ok(args.spec.options(engine, draft)?)
}

/// The prompt `spec`'s method should help, cut so that `reserve` positions remain in the
/// model's context (a small model's context keeps the prompt's end: the code, the request).
fn spec_prompt(engine: &Engine, spec: &SpecOptions, reserve: usize) -> Result<Vec<u32>> {
    let mut prompt = speculative::encode_prompt(engine, speculative::prompt_for(&spec.method))?;
    let fits = engine.max_context().saturating_sub(reserve).max(1);
    if prompt.len() > fits {
        prompt.drain(..prompt.len() - fits);
    }
    Ok(prompt)
}

/// How the tables name a method.
fn spec_method_name(spec: &SpecOptions) -> String {
    match &spec.method {
        SpecMethod::Ngram => "ngram".to_string(),
        SpecMethod::Draft(d) => format!("draft {}", d.model_path().display()),
    }
}

/// `--spec`: speculative against plain decoding, per model and thread count.
fn run_speculative(
    args: &Args,
    sources: &[Source],
    threads: &[usize],
    cpu_opts: &dyn Fn(usize) -> Result<CpuOptions>,
) -> Result<()> {
    args.spec.check()?;
    let n_gen = args.n_gen.first().copied().unwrap_or(64).max(1);
    print_out("| model | threads | method | prompt | tokens | acceptance | passes/token | plain t/s | spec t/s | speedup |\n|---|---:|---|---:|---:|---:|---:|---:|---:|---:|\n")?;
    for src in sources {
        for &t in threads {
            let cpu = cpu_opts(t)?;
            let engine = Arc::new(Engine::from_model(src.load(args.seed)?, cpu)?);
            let Some(spec) = spec_options(args, &engine, cpu)? else {
                return Ok(());
            };
            let prompt = spec_prompt(&engine, &spec, n_gen)?;
            let method = spec_method_name(&spec);
            kiln::note!("kiln-bench: {method}, {t} threads");
            let r = speculative::run(&engine, &spec, &prompt, n_gen, args.repetitions)?;
            print_out(&format!(
                "| {} | {t} | {method} (k ≤ {}) | {} | {} | {:.0}% | {:.2} | {:.1} | {:.1} | {:.2}× |\n",
                src.name(),
                spec.max_draft,
                r.prompt_tokens,
                r.tokens,
                100.0 * r.acceptance_rate,
                r.passes_per_token,
                r.plain_tokens_per_s,
                r.spec_tokens_per_s,
                r.spec_tokens_per_s / r.plain_tokens_per_s
            ))?;
        }
    }
    Ok(())
}

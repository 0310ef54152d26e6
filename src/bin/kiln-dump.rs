//! `kiln-dump`: print what the compiler made of a model, stage by stage.
//!
//! ```text
//! kiln-dump -m models/SmolLM2-135M-Instruct.Q4_1.gguf --stage plan
//! kiln-dump -m tests/fixtures/llama_tied --format dot -o /tmp/dump
//! ```

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Parser, ValueEnum};

use kiln::cli::args::check_model_path;
use kiln::cli::output::{die_on_closed_pipe, Stdout};
use kiln::dump::{concat, dump, DumpOptions, Format, Stage};
use kiln::model::Model;
use kiln::plan::Phase;

#[derive(Clone, Copy, Debug, ValueEnum)]
enum StageArg {
    /// Every stage below, in pipeline order.
    All,
    /// The graph as built, before any pass (00-graph).
    Graph,
    /// The graph after each pass (01-after-<pass>, ...).
    Passes,
    /// The execution plan for --phase (plan-<phase>).
    Plan,
    /// The decode megakernel's program and tile schedule (megakernel-program).
    Megakernel,
    /// The megakernel's generated CUDA C (megakernel.cu).
    Cuda,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum FormatArg {
    /// Canonical text with bytes and flops per node.
    Text,
    /// Graphviz: nodes labelled with op and shape, edges by value.
    Dot,
    /// Serialised IR / plan with per-node costs.
    Json,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum PhaseArg {
    Prefill,
    Decode,
}

#[derive(Parser, Debug)]
#[command(
    name = "kiln-dump",
    version,
    about = "Print every compilation stage of a model: graph, after each pass, execution plan",
    long_about = "Print every compilation stage of a model: the graph as built, the graph after \
each pass of the default pipeline, and the execution plan (instructions, buffers, liveness, \
peak activation bytes). Costs (bytes moved, flops) are for one step: decode is one sequence of \
one token attending over --context cached positions; prefill is one sequence of --tokens tokens. \
Output is deterministic, for diffing two compiler versions.\n\n\
The megakernel stages show the decode plan lowered to kiln-codegen's program, its tile \
schedule (each tile's waits on dependency counters) and the generated CUDA C; that kernel \
compiles under NVRTC and runs on a GPU (docs/gpu-results.md)."
)]
struct Args {
    /// Model: a Hugging Face directory or a .gguf file.
    #[arg(short, long)]
    model: PathBuf,
    #[arg(long, value_enum, default_value_t = StageArg::All)]
    stage: StageArg,
    #[arg(long, value_enum, default_value_t = FormatArg::Text)]
    format: FormatArg,
    /// Which plan to dump, and whose dimensions the costs use.
    #[arg(long, value_enum, default_value_t = PhaseArg::Decode)]
    phase: PhaseArg,
    /// Cached positions for decode costs (at most 2^24).
    #[arg(long, default_value_t = 512)]
    context: usize,
    /// Prompt tokens for prefill costs (at most 2^24).
    #[arg(long, default_value_t = 512)]
    tokens: usize,
    /// Write one file per stage into this directory instead of stdout.
    #[arg(short, long)]
    output: Option<PathBuf>,
}

/// The most positions or tokens costs are counted for: more than any model's context, and
/// small enough that byte and flop counts stay far from overflowing.
const MAX_DIM: usize = 1 << 24;

fn main() {
    die_on_closed_pipe();
    if let Err(e) = run() {
        kiln::note!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let args = Args::parse();
    for (flag, v) in [("--context", args.context), ("--tokens", args.tokens)] {
        if v > MAX_DIM {
            bail!("{flag} {v}: at most {MAX_DIM}");
        }
    }
    check_model_path("-m", &args.model)?;
    let opts = DumpOptions {
        stage: match args.stage {
            StageArg::All => Stage::All,
            StageArg::Graph => Stage::Graph,
            StageArg::Passes => Stage::Passes,
            StageArg::Plan => Stage::Plan,
            StageArg::Megakernel => Stage::Megakernel,
            StageArg::Cuda => Stage::Cuda,
        },
        format: match args.format {
            FormatArg::Text => Format::Text,
            FormatArg::Dot => Format::Dot,
            FormatArg::Json => Format::Json,
        },
        phase: match args.phase {
            PhaseArg::Prefill => Phase::Prefill,
            PhaseArg::Decode => Phase::Decode,
        },
        context: args.context,
        tokens: args.tokens,
    };
    let model = Model::load(&args.model).context("loading the model")?;
    let files = dump(&model, &opts)?;
    match &args.output {
        Some(dir) => {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
            for f in &files {
                let path = dir.join(f.file_name());
                std::fs::write(&path, &f.contents)
                    .with_context(|| format!("writing {}", path.display()))?;
                kiln::note!("wrote {}", path.display());
            }
        }
        None => {
            let mut out = Stdout::lock();
            out.write(&concat(&files, opts.format))?;
            out.flush()?;
        }
    }
    Ok(())
}

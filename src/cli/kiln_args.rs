//! The `kiln` binary's command line: its flags (clap derive types) and the checks that run
//! before any model is loaded. They live in the library so that a fuzz target and tests can
//! parse hostile argument lists in-process, exactly as the binary does, without loading a model.

use std::ffi::OsString;
use std::path::PathBuf;

use clap::{Args, Parser, ValueEnum};

use super::args::{check_model_path, check_threads, ArgError, NumericsArg, Text};
use super::serve_args::{parse_serve_args, ServeArgsError, ServeCommand};
use super::spec::{SpecArgError, SpecArgs};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Device {
    /// CUDA when a GPU, driver and NVRTC are present, else the CPU (one line on stderr says why).
    Auto,
    Cpu,
    /// Fail unless CUDA is usable.
    Cuda,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Decode {
    /// The megakernel where the model lowers to it, else per-op.
    Auto,
    /// One kernel per plan instruction.
    PerOp,
    /// One generated kernel per step, replayed as a CUDA graph (fails if the model does not
    /// lower to it).
    Megakernel,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum KvType {
    F32,
    Bf16,
    F16,
    Fp8,
    Q8,
}

impl KvType {
    /// The storage type it names.
    pub fn dtype(self) -> crate::kv::KvDtype {
        use crate::kv::KvDtype;
        match self {
            KvType::F32 => KvDtype::F32,
            KvType::Bf16 => KvDtype::Bf16,
            KvType::F16 => KvDtype::F16,
            KvType::Fp8 => KvDtype::Fp8E4m3,
            KvType::Q8 => KvDtype::Q8,
        }
    }
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum Weights {
    /// bf16 stays bf16; f32, f16 and quantized types run exactly.
    Auto,
    F32,
    /// Round weights to bf16: half the memory traffic per token of f32.
    Bf16,
}

/// Options shared by one-shot generation and chat.
#[derive(Args, Debug)]
pub struct Common {
    /// Model: a Hugging Face directory or a .gguf file.
    #[arg(short, long)]
    pub model: PathBuf,
    /// Tokens to generate at most (per reply in chat).
    #[arg(short = 'n', long, default_value_t = 256)]
    pub n_predict: usize,
    /// Context: positions the KV cache holds (0 = the model's whole context). Default: what the
    /// run needs (prompt + -n; in chat, the whole context), at most 4096 and at most what memory
    /// holds.
    #[arg(short = 'c', long = "ctx-size", value_name = "N")]
    pub ctx_size: Option<usize>,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temp: f32,
    #[arg(long)]
    pub top_k: Option<usize>,
    #[arg(long)]
    pub top_p: Option<f32>,
    #[arg(long)]
    pub min_p: Option<f32>,
    /// Penalty (> 1) on tokens already in the context.
    #[arg(long)]
    pub repeat_penalty: Option<f32>,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Stop when the text contains this string (repeatable, not empty); the match is not printed.
    #[arg(long = "stop", value_parser = Text::NON_EMPTY)]
    pub stop: Vec<String>,
    /// Keep generating past end-of-sequence tokens.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Do not run the calculator tool on <|python_start|>…<|python_end|> (nanochat models).
    #[arg(long)]
    pub no_tools: bool,
    /// CPU threads (0 = all cores; at most 4 × the cores, or 64).
    #[arg(short = 't', long, default_value_t = 0)]
    pub threads: usize,
    /// How weights are held in memory.
    #[arg(long, value_enum, default_value_t = Weights::Auto)]
    pub weights: Weights,
    /// How the CPU multiplies activations by the weights: int24 (the default: activations
    /// rounded to 24-bit integers against Q4_0/Q4_1/Q5_0/Q8_0 weights in steps of up to 16 rows on
    /// AVX512-VNNI CPUs, as accurate as exact and faster there; exact elsewhere), exact (f32
    /// activations), int16 (activations rounded to 16-bit integers against quantized weights),
    /// bf16 (prefill activations, and quantized weights, rounded to bf16; AVX512-BF16 CPUs) or
    /// int8 (every step's activations rounded to 8-bit integers against Q4_0/Q4_1/Q5_0/Q5_1/Q8_0
    /// weights; AVX512-VNNI or AVX2 CPUs); the last three are faster and less accurate. None is
    /// bit-equal to another. The CUDA backend has one numerics and ignores it.
    #[arg(long, value_enum, default_value_t = NumericsArg::Int24)]
    pub numerics: NumericsArg,
    /// How the KV cache stores keys and values on the CPU: f32 (exact), bf16, f16, fp8
    /// (e4m3) or q8 (32-value groups; head size divisible by 32).
    #[arg(long, value_enum, default_value_t = KvType::F32)]
    pub kv_type: KvType,
    /// Where to run.
    #[arg(long, value_enum, default_value_t = Device::Auto)]
    pub device: Device,
    /// How decode steps run on CUDA (ignored on the CPU).
    #[arg(long, value_enum, default_value_t = Decode::Auto)]
    pub decode: Decode,
    /// Constrain the output to JSON valid under this JSON Schema (a file).
    #[arg(long, value_name = "FILE", conflicts_with_all = ["regex", "grammar"])]
    pub json_schema: Option<PathBuf>,
    /// Constrain the output to match this regular expression (whole output, Rust syntax).
    #[arg(long, value_name = "RE", conflicts_with = "grammar")]
    pub regex: Option<String>,
    /// Constrain the output to this grammar (a file in llguidance's Lark syntax).
    #[arg(long, value_name = "FILE")]
    pub grammar: Option<PathBuf>,
}

#[derive(Parser, Debug)]
#[command(
    name = "kiln",
    version,
    about = "Generate text with a decoder-only language model",
    after_help = "Interactive multi-turn chat: kiln chat -m MODEL\nOpenAI-compatible HTTP server: kiln serve -m MODEL"
)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub common: Common,
    /// Prompt text.
    #[arg(short, long, value_parser = Text::ANY, conflicts_with_all = ["prompt_ids", "file"])]
    pub prompt: Option<String>,
    /// Read the prompt from a file (`-` for stdin), for prompts longer than the argument limit.
    #[arg(short = 'f', long, value_name = "FILE", conflicts_with = "prompt_ids")]
    pub file: Option<PathBuf>,
    /// Prompt as comma-separated token ids instead of text.
    #[arg(long, value_delimiter = ',')]
    pub prompt_ids: Option<Vec<u32>>,
    /// Wrap the prompt in the model's chat template as a user message.
    #[arg(long, conflicts_with = "prompt_ids")]
    pub chat: bool,
    /// System message (with --chat).
    #[arg(long, requires = "chat", value_parser = Text::ANY)]
    pub system: Option<String>,
    /// Independent samples of the prompt from one prefill.
    #[arg(long, default_value_t = 1)]
    pub samples: usize,
    /// Print one JSON object (ids, masks, text, finish reasons, timings) instead of streaming.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub spec: SpecArgs,
}

#[derive(Parser, Debug)]
#[command(
    name = "kiln chat",
    version,
    about = "Chat with a model; the conversation's cache is reused across turns"
)]
pub struct ChatArgs {
    #[command(flatten)]
    pub common: Common,
    /// System message.
    #[arg(long, value_parser = Text::ANY)]
    pub system: Option<String>,
}

/// What a `kiln` command line asks for, parsed and checked.
#[derive(Debug)]
pub enum KilnCommand {
    /// `kiln -m MODEL ...`: one-shot generation.
    Generate(GenerateArgs),
    /// `kiln chat -m MODEL ...`: interactive chat.
    Chat(ChatArgs),
    /// `kiln serve ...`: the HTTP server (flags parsed and checked by
    /// [`super::serve_args::parse_serve_args`]).
    Serve(ServeCommand),
}

/// Why a `kiln` command line was refused before any model was loaded.
#[derive(Debug, thiserror::Error)]
pub enum KilnArgsError {
    /// A usage error, or `--help`/`--version`: clap's message, printed by `clap::Error::exit`.
    #[error(transparent)]
    Usage(#[from] clap::Error),
    #[error(transparent)]
    Arg(#[from] ArgError),
    #[error(transparent)]
    Spec(#[from] SpecArgError),
    /// A `kiln serve` flag refused by a check (its usage errors are [`KilnArgsError::Usage`]).
    #[error(transparent)]
    Serve(ServeArgsError),
    #[error("--samples must be at least 1")]
    NoSamples,
    #[error("--spec runs one sample row; drop --samples {0}")]
    SpecWithSamples(usize),
}

/// Parses `argv` (program name first, as the OS gives it) and checks what can be checked
/// before a model is loaded: the model path, the thread count, `--samples`, the speculative
/// decoding flags and, for `kiln serve`, its own flags. Reads no file but the model path's
/// metadata; never panics or exits.
pub fn parse_args(argv: impl IntoIterator<Item = OsString>) -> Result<KilnCommand, KilnArgsError> {
    let mut argv: Vec<OsString> = argv.into_iter().collect();
    if argv.get(1).is_some_and(|a| a == "chat") {
        argv.splice(..2, [OsString::from("kiln chat")]);
        let args = ChatArgs::try_parse_from(argv)?;
        check_common(&args.common)?;
        Ok(KilnCommand::Chat(args))
    } else if argv.get(1).is_some_and(|a| a == "serve") {
        argv.splice(..2, [OsString::from("kiln serve")]);
        match parse_serve_args(argv) {
            Ok(c) => Ok(KilnCommand::Serve(c)),
            Err(ServeArgsError::Usage(e)) => Err(KilnArgsError::Usage(e)),
            Err(e) => Err(KilnArgsError::Serve(e)),
        }
    } else {
        let args = GenerateArgs::try_parse_from(argv)?;
        check_generate(&args)?;
        Ok(KilnCommand::Generate(args))
    }
}

/// Checks the flags shared by generation and chat.
fn check_common(c: &Common) -> Result<(), ArgError> {
    check_model_path("-m", &c.model)?;
    check_threads("-t", c.threads)?;
    Ok(())
}

/// Checks one-shot generation's flags, in the order the binary always reported them.
fn check_generate(args: &GenerateArgs) -> Result<(), KilnArgsError> {
    check_common(&args.common)?;
    if args.samples == 0 {
        return Err(KilnArgsError::NoSamples);
    }
    args.spec.check()?;
    if args.spec.spec.is_some() && args.samples != 1 {
        return Err(KilnArgsError::SpecWithSamples(args.samples));
    }
    Ok(())
}

//! `kiln`: generate from a model on the command line, or chat with it.
//!
//! ```text
//! kiln -m models/SmolLM2-135M-Instruct.Q4_1.gguf --chat -p "What is the capital of France?"
//! kiln chat -m models/SmolLM2-135M-Instruct.Q4_1.gguf
//! kiln serve -m models/SmolLM2-135M-Instruct.Q4_1.gguf --port 8080
//! ```

#[path = "kiln/serve.rs"]
mod serve;

use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, ValueEnum};
use serde::Serialize;

use kiln::backend::cpu::{CpuOptions, WeightFormat};
use kiln::engine::{
    DecodePath, Engine, EngineOptions, FinishReason, GenerateOptions, Session, Timings, Usage,
};
use kiln::sample::SamplingParams;
use kiln::tokenizer::nanochat::NanochatTokens;
use kiln::tokenizer::ChatMessage;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Device {
    /// CUDA when a GPU, driver and NVRTC are present, else the CPU (one line on stderr says why).
    Auto,
    Cpu,
    /// Fail unless CUDA is usable.
    Cuda,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Decode {
    /// The megakernel where the model lowers to it, else per-op.
    Auto,
    /// One kernel per plan instruction.
    PerOp,
    /// One generated kernel per step, replayed as a CUDA graph (fails if the model does not
    /// lower to it).
    Megakernel,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Weights {
    /// bf16 stays bf16; f32, f16 and quantized types run exactly.
    Auto,
    F32,
    /// Round weights to bf16: half the memory traffic per token of f32.
    Bf16,
}

/// Options shared by one-shot generation and chat.
#[derive(Args, Debug)]
struct Common {
    /// Model: a Hugging Face directory or a .gguf file.
    #[arg(short, long)]
    model: PathBuf,
    /// Tokens to generate at most (per reply in chat).
    #[arg(short = 'n', long, default_value_t = 256)]
    n_predict: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temp: f32,
    #[arg(long)]
    top_k: Option<usize>,
    #[arg(long)]
    top_p: Option<f32>,
    #[arg(long)]
    min_p: Option<f32>,
    /// Penalty (> 1) on tokens already in the context.
    #[arg(long)]
    repeat_penalty: Option<f32>,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Stop when the text contains this string (repeatable); the match is not printed.
    #[arg(long = "stop")]
    stop: Vec<String>,
    /// Keep generating past end-of-sequence tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// Do not run the calculator tool on <|python_start|>…<|python_end|> (nanochat models).
    #[arg(long)]
    no_tools: bool,
    /// System message (chat).
    #[arg(long)]
    system: Option<String>,
    /// CPU threads (0 = all cores).
    #[arg(short = 't', long, default_value_t = 0)]
    threads: usize,
    /// How weights are held in memory.
    #[arg(long, value_enum, default_value_t = Weights::Auto)]
    weights: Weights,
    /// Where to run.
    #[arg(long, value_enum, default_value_t = Device::Auto)]
    device: Device,
    /// How decode steps run on CUDA (ignored on the CPU).
    #[arg(long, value_enum, default_value_t = Decode::Auto)]
    decode: Decode,
}

#[derive(Parser, Debug)]
#[command(
    name = "kiln",
    version,
    about = "Generate text with a decoder-only language model",
    after_help = "Interactive multi-turn chat: kiln chat -m MODEL\nOpenAI-compatible HTTP server: kiln serve -m MODEL"
)]
struct GenerateArgs {
    #[command(flatten)]
    common: Common,
    /// Prompt text.
    #[arg(short, long, conflicts_with = "prompt_ids")]
    prompt: Option<String>,
    /// Prompt as comma-separated token ids instead of text.
    #[arg(long, value_delimiter = ',')]
    prompt_ids: Option<Vec<u32>>,
    /// Wrap the prompt in the model's chat template as a user message.
    #[arg(long)]
    chat: bool,
    /// Independent samples of the prompt from one prefill.
    #[arg(long, default_value_t = 1)]
    samples: usize,
    /// Print one JSON object (ids, masks, text, finish reasons, timings) instead of streaming.
    #[arg(long)]
    json: bool,
}

#[derive(Parser, Debug)]
#[command(
    name = "kiln chat",
    version,
    about = "Chat with a model; the conversation's cache is reused across turns"
)]
struct ChatArgs {
    #[command(flatten)]
    common: Common,
}

fn main() {
    let argv: Vec<String> = std::env::args().collect();
    let res = if argv.get(1).map(String::as_str) == Some("chat") {
        let mut rest = vec![format!("{} chat", argv[0])];
        rest.extend(argv[2..].iter().cloned());
        chat(ChatArgs::parse_from(rest))
    } else if argv.get(1).map(String::as_str) == Some("serve") {
        let mut rest = vec![format!("{} serve", argv[0])];
        rest.extend(argv[2..].iter().cloned());
        serve::run(serve::ServeArgs::parse_from(rest))
    } else {
        generate(GenerateArgs::parse())
    };
    if let Err(e) = res {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn load(c: &Common) -> Result<Arc<Engine>> {
    let opts = EngineOptions {
        device: match c.device {
            Device::Auto => kiln::engine::Device::Auto,
            Device::Cpu => kiln::engine::Device::Cpu,
            Device::Cuda => kiln::engine::Device::Cuda,
        },
        decode: match c.decode {
            Decode::Auto => DecodePath::Auto,
            Decode::PerOp => DecodePath::PerOp,
            Decode::Megakernel => DecodePath::Megakernel,
        },
        cpu: CpuOptions {
            threads: c.threads,
            weights: match c.weights {
                Weights::Auto => WeightFormat::AsStored,
                Weights::F32 => WeightFormat::F32,
                Weights::Bf16 => WeightFormat::BF16,
            },
        },
        ..EngineOptions::default()
    };
    let t0 = Instant::now();
    let engine =
        Engine::load(&c.model, opts).with_context(|| format!("loading {}", c.model.display()))?;
    if let Some(why) = engine.fallback_reason() {
        eprintln!("kiln: CUDA unavailable ({why}); running on the CPU");
    }
    let cfg = engine.config();
    eprintln!(
        "kiln: {} ({}, {} layers, {} params, {} weights) loaded in {:.2} s, on {}",
        c.model.display(),
        cfg.architecture.name(),
        cfg.num_layers,
        engine.num_params(),
        engine.weight_type(),
        t0.elapsed().as_secs_f64(),
        engine.device()
    );
    Ok(Arc::new(engine))
}

fn options(c: &Common, engine: &Engine, samples: usize) -> GenerateOptions {
    GenerateOptions {
        max_tokens: Some(c.n_predict),
        sampling: SamplingParams {
            temperature: c.temp,
            top_k: c.top_k,
            top_p: c.top_p,
            min_p: c.min_p,
            repetition_penalty: c.repeat_penalty,
            seed: c.seed,
        },
        num_samples: samples,
        stop_tokens: Some(if c.ignore_eos {
            vec![]
        } else {
            engine.default_stop_tokens()
        }),
        stop_strings: c.stop.clone(),
        tools: !c.no_tools,
        logits_processor: None,
    }
}

fn report(t: &Timings, reason: FinishReason) {
    eprintln!(
        "\nprefill: {} tokens in {:.1} ms ({:.1} tok/s) | decode: {} tokens in {:.1} ms ({:.1} tok/s) | finish: {:?}",
        t.prefill_tokens,
        t.prefill.as_secs_f64() * 1e3,
        t.prefill_tokens_per_s(),
        t.decode_steps,
        t.decode.as_secs_f64() * 1e3,
        t.decode_tokens_per_s(),
        reason
    );
}

#[derive(Serialize)]
struct JsonRow<'a> {
    generated_ids: &'a [u32],
    masks: &'a [u8],
    text: &'a str,
    finish_reason: FinishReason,
}

#[derive(Serialize)]
struct JsonOut<'a> {
    model: String,
    prompt_ids: &'a [u32],
    /// Row 0's fields, for single-sample callers.
    generated_ids: &'a [u32],
    text: &'a str,
    finish_reason: FinishReason,
    rows: Vec<JsonRow<'a>>,
    usage: Usage,
    timings: &'a Timings,
    prefill_tokens_per_s: f64,
    decode_tokens_per_s: f64,
}

fn generate(args: GenerateArgs) -> Result<()> {
    let c = &args.common;
    let engine = load(c)?;
    let tok = engine.tokenizer();
    let prompt_ids = match (&args.prompt_ids, &args.prompt) {
        (Some(ids), _) => ids.clone(),
        (None, Some(text)) if args.chat => {
            let mut messages = Vec::new();
            if let Some(s) = &c.system {
                messages.push(ChatMessage::new("system", s));
            }
            messages.push(ChatMessage::new("user", text));
            tok.chat_prompt(&messages)?
        }
        (None, Some(text)) => tok.encode(text)?,
        (None, None) => bail!("give a prompt with -p TEXT or --prompt-ids 1,2,3"),
    };
    if prompt_ids.is_empty() {
        bail!("the prompt encodes to no tokens");
    }
    if args.samples == 0 {
        bail!("--samples must be at least 1");
    }
    let opts = options(c, &engine, args.samples);
    let mut session = Session::new(engine.clone(), prompt_ids.len() + c.n_predict, args.samples);
    let mut stdout = std::io::stdout().lock();
    let stream_text = !args.json && args.samples == 1;
    let result = session.generate(&prompt_ids, &opts, |step| {
        if stream_text {
            if let Some(Some(row)) = step.rows.first() {
                let _ = stdout.write_all(row.text.as_bytes());
                let _ = stdout.flush();
            }
        }
        true
    })?;
    let t = &result.timings;
    let first = &result.rows[0];
    if args.json {
        let out = JsonOut {
            model: c.model.display().to_string(),
            prompt_ids: &prompt_ids,
            generated_ids: &first.generated,
            text: &first.text,
            finish_reason: first.finish_reason,
            rows: result
                .rows
                .iter()
                .map(|r| JsonRow {
                    generated_ids: &r.generated,
                    masks: &r.masks[prompt_ids.len()..],
                    text: &r.text,
                    finish_reason: r.finish_reason,
                })
                .collect(),
            usage: result.usage,
            timings: t,
            prefill_tokens_per_s: t.prefill_tokens_per_s(),
            decode_tokens_per_s: t.decode_tokens_per_s(),
        };
        writeln!(stdout, "{}", serde_json::to_string(&out)?)?;
        return Ok(());
    }
    if args.samples > 1 {
        for (i, r) in result.rows.iter().enumerate() {
            writeln!(stdout, "--- sample {i} ({:?})\n{}", r.finish_reason, r.text)?;
        }
    } else {
        writeln!(stdout)?;
    }
    report(t, first.finish_reason);
    Ok(())
}

fn chat(args: ChatArgs) -> Result<()> {
    let c = &args.common;
    let engine = load(c)?;
    let tok = engine.tokenizer();
    // Models without a chat template but with nanochat's tokens keep the conversation as ids,
    // as nanochat's chat_cli does: generated tool calls stay special tokens in the history.
    let nanochat = match (&tok.specials.chat_template, NanochatTokens::of(tok)) {
        (None, Ok(t)) => Some(t),
        (None, Err(e)) => bail!("{}: no chat template ({e})", c.model.display()),
        (Some(_), _) => None,
    };
    let opts = options(c, &engine, 1);
    let mut session = engine.session(engine.max_context());
    let mut messages: Vec<ChatMessage> = c
        .system
        .iter()
        .map(|s| ChatMessage::new("system", s))
        .collect();
    let mut conv: Vec<u32> = nanochat.map(|t| vec![t.bos]).unwrap_or_default();
    let mut pending_system = c.system.clone();
    let stdin = std::io::stdin();
    let mut stdout = std::io::stdout();
    eprintln!("kiln chat: type a message; /reset starts over, /exit or end of input quits.");
    loop {
        write!(stdout, "\n> ")?;
        stdout.flush()?;
        let mut line = String::new();
        if stdin.lock().read_line(&mut line)? == 0 {
            break;
        }
        let line = line.trim_end_matches(['\n', '\r']);
        match line.trim() {
            "" => continue,
            "/exit" | "/quit" => break,
            "/reset" => {
                messages.retain(|m| m.role == "system");
                conv.truncate(1);
                pending_system = c.system.clone();
                session.truncate(0);
                continue;
            }
            _ => {}
        }
        let prompt = match nanochat {
            Some(t) => {
                // nanochat folds the system message into the first user turn.
                let text = match pending_system.take() {
                    Some(sys) => format!("{sys}\n\n{line}"),
                    None => line.to_string(),
                };
                let mut p = conv.clone();
                p.push(t.user_start);
                p.extend(tok.encode_ordinary(&text)?);
                p.extend([t.user_end, t.assistant_start]);
                p
            }
            None => {
                messages.push(ChatMessage::new("user", line));
                match tok.chat_prompt(&messages) {
                    Ok(p) => p,
                    Err(e) => bail!("{}: {e}", c.model.display()),
                }
            }
        };
        let result = session.generate(&prompt, &opts, |step| {
            if let Some(Some(row)) = step.rows.first() {
                let _ = stdout.write_all(row.text.as_bytes());
                let _ = stdout.flush();
            }
            true
        });
        let result = match result {
            Ok(r) => r,
            Err(e) => {
                eprintln!("\nerror: {e}");
                if nanochat.is_none() {
                    messages.pop();
                }
                continue;
            }
        };
        let row = &result.rows[0];
        match nanochat {
            Some(t) => {
                conv = prompt;
                conv.extend(&row.generated);
                if conv.last() != Some(&t.assistant_end) {
                    conv.push(t.assistant_end);
                }
            }
            None => messages.push(ChatMessage::new("assistant", row.text.clone())),
        }
        report(&result.timings, row.finish_reason);
    }
    Ok(())
}

//! `kiln`: generate from a model on the command line.
//!
//! ```text
//! kiln -m models/SmolLM2-135M-Instruct.Q4_1.gguf --chat -p "What is the capital of France?"
//! ```

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{Parser, ValueEnum};
use serde::Serialize;

use kiln::backend::cpu::{CpuOptions, WeightFormat};
use kiln::engine::{Engine, FinishReason, GenerateOptions, Timings};
use kiln::sample::SamplingParams;
use kiln::tokenizer::{ChatMessage, StreamDecoder};

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Weights {
    /// bf16 stays bf16; f32, f16 and quantized types run as f32 (exact).
    Auto,
    F32,
    /// Round weights to bf16: half the memory traffic per token.
    Bf16,
}

#[derive(Parser, Debug)]
#[command(name = "kiln", version, about = "Generate text with a decoder-only language model")]
struct Args {
    /// Model: a Hugging Face directory or a .gguf file.
    #[arg(short, long)]
    model: PathBuf,
    /// Prompt text.
    #[arg(short, long, conflicts_with = "prompt_ids")]
    prompt: Option<String>,
    /// Prompt as comma-separated token ids instead of text.
    #[arg(long, value_delimiter = ',')]
    prompt_ids: Option<Vec<u32>>,
    /// Tokens to generate at most.
    #[arg(short = 'n', long, default_value_t = 64)]
    n_predict: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temp: f32,
    #[arg(long)]
    top_k: Option<usize>,
    #[arg(long)]
    top_p: Option<f32>,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Wrap the prompt in the model's chat template as a user message.
    #[arg(long)]
    chat: bool,
    /// System message for --chat (else the template's default, if any).
    #[arg(long, requires = "chat")]
    system: Option<String>,
    /// Keep generating past end-of-sequence tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// CPU threads (0 = all cores).
    #[arg(short = 't', long, default_value_t = 0)]
    threads: usize,
    /// How weights are held in memory.
    #[arg(long, value_enum, default_value_t = Weights::Auto)]
    weights: Weights,
    /// Print one JSON object (ids, text, timings) instead of streaming text.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct JsonOut<'a> {
    model: String,
    prompt_ids: &'a [u32],
    generated_ids: &'a [u32],
    text: String,
    finish_reason: FinishReason,
    timings: &'a Timings,
    prefill_tokens_per_s: f64,
    decode_tokens_per_s: f64,
}

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let args = Args::parse();
    let opts = CpuOptions {
        threads: args.threads,
        weights: match args.weights {
            Weights::Auto => WeightFormat::AsStored,
            Weights::F32 => WeightFormat::F32,
            Weights::Bf16 => WeightFormat::BF16,
        },
    };
    let t0 = Instant::now();
    let engine = Arc::new(Engine::load(&args.model, opts).with_context(|| format!("loading {}", args.model.display()))?);
    let cfg = engine.config();
    eprintln!(
        "kiln: {} ({}, {} layers, {} params, {} weights) loaded in {:.2} s, {} threads",
        args.model.display(),
        cfg.architecture.name(),
        cfg.num_layers,
        cfg.num_params(),
        engine.weight_type(),
        t0.elapsed().as_secs_f64(),
        engine.backend().threads()
    );
    let tok = engine.tokenizer();
    let prompt_ids = match (&args.prompt_ids, &args.prompt) {
        (Some(ids), _) => ids.clone(),
        (None, Some(text)) if args.chat => {
            let mut messages = Vec::new();
            if let Some(s) = &args.system {
                messages.push(ChatMessage::new("system", s));
            }
            messages.push(ChatMessage::new("user", text));
            let rendered = tok.apply_chat_template(&messages, true)?;
            tok.encode(&rendered)?
        }
        (None, Some(text)) => tok.encode(text)?,
        (None, None) => bail!("give a prompt with -p TEXT or --prompt-ids 1,2,3"),
    };
    if prompt_ids.is_empty() {
        bail!("the prompt encodes to no tokens");
    }
    let gen_opts = GenerateOptions {
        max_tokens: args.n_predict,
        sampling: SamplingParams {
            temperature: args.temp,
            top_k: args.top_k,
            top_p: args.top_p,
            seed: args.seed,
        },
        stop_tokens: if args.ignore_eos { vec![] } else { engine.default_stop_tokens() },
    };
    let mut session = engine.session(prompt_ids.len() + args.n_predict);
    let mut stdout = std::io::stdout().lock();
    let mut decoder = StreamDecoder::new();
    let mut stream_err = None;
    let stream = !args.json;
    let gen = session.generate(&prompt_ids, &gen_opts, |id| {
        if stream && !gen_opts.stop_tokens.contains(&id) {
            match decoder.push(tok, id) {
                Ok(piece) => {
                    let _ = stdout.write_all(piece.as_bytes());
                    let _ = stdout.flush();
                }
                Err(e) => {
                    stream_err = Some(e);
                    return false;
                }
            }
        }
        true
    })?;
    if let Some(e) = stream_err {
        return Err(e.into());
    }
    let t = &gen.timings;
    if args.json {
        let text_ids: Vec<u32> = gen
            .tokens
            .iter()
            .copied()
            .filter(|id| !gen_opts.stop_tokens.contains(id))
            .collect();
        let out = JsonOut {
            model: args.model.display().to_string(),
            prompt_ids: &prompt_ids,
            generated_ids: &gen.tokens,
            text: tok.decode(&text_ids)?,
            finish_reason: gen.finish_reason,
            timings: t,
            prefill_tokens_per_s: t.prefill_tokens_per_s(),
            decode_tokens_per_s: t.decode_tokens_per_s(),
        };
        writeln!(stdout, "{}", serde_json::to_string(&out)?)?;
    } else {
        let rest = decoder.finish(tok)?;
        writeln!(stdout, "{rest}")?;
        eprintln!(
            "\nprefill: {} tokens in {:.1} ms ({:.1} tok/s) | decode: {} tokens in {:.1} ms ({:.1} tok/s) | finish: {:?}",
            t.prefill_tokens,
            t.prefill.as_secs_f64() * 1e3,
            t.prefill_tokens_per_s(),
            t.decode_tokens,
            t.decode.as_secs_f64() * 1e3,
            t.decode_tokens_per_s(),
            gen.finish_reason
        );
    }
    Ok(())
}

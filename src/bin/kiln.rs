//! `kiln`: generate from a model on the command line, or chat with it.
//!
//! ```text
//! kiln -m models/SmolLM2-135M-Instruct.Q4_1.gguf --chat -p "What is the capital of France?"
//! kiln chat -m models/SmolLM2-135M-Instruct.Q4_1.gguf
//! kiln serve -m models/SmolLM2-135M-Instruct.Q4_1.gguf --port 8080
//! ```

#[path = "kiln/serve.rs"]
mod serve;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use serde::Serialize;

use kiln::backend::cpu::{CpuOptions, WeightFormat};
use kiln::cli::context::{self, CacheRequest};
use kiln::cli::input::{read_chat_line, read_prompt, ChatLine, MAX_TEXT_BYTES};
use kiln::cli::kiln_args::{
    parse_args, ChatArgs, Common, Decode, Device, GenerateArgs, KilnArgsError, KilnCommand, Weights,
};
use kiln::cli::memory;
use kiln::cli::output::{die_on_closed_pipe, Stdout};
use kiln::engine::{
    Constraint, ConstraintSpec, DecodePath, Engine, EngineOptions, FinishReason, GenerateOptions,
    Session, SpecStats, Timings, Usage,
};
use kiln::note;
use kiln::plan::PlanKind;
use kiln::sample::SamplingParams;
use kiln::tokenizer::nanochat::NanochatTokens;
use kiln::tokenizer::{ChatMessage, TokenizerError};

fn main() {
    // Arguments as the OS gave them: a non-UTF-8 path is still a path, and non-UTF-8 text is
    // an error naming its flag (`Text`), not a panic in `std::env::args`. Parsing starts no
    // thread, so SIGPIPE's disposition can still be chosen per command after it.
    let res = match parse_args(std::env::args_os()) {
        Ok(KilnCommand::Generate(args)) => {
            die_on_closed_pipe();
            generate(args)
        }
        Ok(KilnCommand::Chat(args)) => {
            die_on_closed_pipe();
            chat(args)
        }
        // The server keeps SIGPIPE ignored (the Rust runtime's setting): a client that hangs
        // up mid-stream must fail that one socket write, not end the process. (With the
        // default action restored, hyper's vectored writes to a closed socket killed the
        // server silently: `serve_memory_stays_within_the_kv_budget` failed ~1 run in 10.)
        Ok(KilnCommand::Serve(cmd)) => serve::run(cmd),
        // Usage errors, --help and --version: clap's message and exit status.
        Err(KilnArgsError::Usage(e)) => {
            die_on_closed_pipe();
            e.exit()
        }
        Err(e) => Err(e.into()),
    };
    if let Err(e) = res {
        note!("error: {e:#}");
        std::process::exit(1);
    }
}

/// Positions for a session's cache: what `needed` asks (all of the context when `None`), cut
/// to `-c`, the default context and the memory available. Says so on stderr when the model's
/// context was cut.
fn context_size(c: &Common, engine: &Engine, needed: Option<usize>, slots: usize) -> Result<usize> {
    let plan = context::plan(&CacheRequest {
        model_context: engine.max_context(),
        ctx_flag: c.ctx_size,
        needed,
        slots,
        bytes_per_position: context::kv_bytes_per_position(&engine.plan(PlanKind::Decode).graph.kv),
        bytes_per_slot: engine.config().vocab_size.saturating_mul(4),
        // The cache lives in host memory only on the CPU.
        available: engine.cpu_backend().and(memory::available()),
    })?;
    if let Some(line) = &plan.note {
        note!("{line}");
    }
    Ok(plan.positions)
}

/// Where the model's chat template came from, for a template error: the loader takes
/// `chat_template` from tokenizer_config.json, else chat_template.jinja, in a directory, and
/// the `tokenizer.chat_template` key in a GGUF file.
fn template_source(model: &Path) -> String {
    if !model.is_dir() {
        return format!("{} (tokenizer.chat_template)", model.display());
    }
    let config = model.join("tokenizer_config.json");
    let in_config = std::fs::read(&config)
        .ok()
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
        .is_some_and(|v| {
            matches!(
                v.get("chat_template"),
                Some(serde_json::Value::String(_) | serde_json::Value::Array(_))
            )
        });
    if in_config {
        config.display().to_string()
    } else {
        model.join("chat_template.jinja").display().to_string()
    }
}

/// A tokenizer error, naming the template's file when the template failed.
fn chat_error(model: &Path, e: TokenizerError) -> anyhow::Error {
    match e {
        TokenizerError::Template(_) => anyhow::Error::new(e).context(template_source(model)),
        e => e.into(),
    }
}

fn load(c: &Common) -> Result<Arc<Engine>> {
    load_at(c, &c.model)
}

/// Loads the model at `path` (the model, or a draft model) as the flags say.
fn load_at(c: &Common, path: &Path) -> Result<Arc<Engine>> {
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
            numerics: c.numerics.numerics(),
        },
        kv_dtype: c.kv_type.dtype(),
    };
    let t0 = Instant::now();
    let engine = Engine::load(path, opts).context("loading the model")?;
    if let Some(why) = engine.fallback_reason() {
        note!("kiln: CUDA unavailable ({why}); running on the CPU");
    }
    let cfg = engine.config();
    note!(
        "kiln: {} ({}, {} layers, {} params, {} weights) loaded in {:.2} s, on {}",
        path.display(),
        cfg.architecture.name(),
        cfg.num_layers,
        engine.num_params(),
        engine.weight_type(),
        t0.elapsed().as_secs_f64(),
        engine.device()
    );
    Ok(Arc::new(engine))
}

/// The constraint the flags ask for, with the flag that names it (files are read and parsed
/// before the model loads).
fn constraint_spec(c: &Common) -> Result<Option<(String, ConstraintSpec)>> {
    let read = |flag: &str, path: &PathBuf| {
        std::fs::read_to_string(path)
            .with_context(|| format!("{flag} {}: cannot read the file", path.display()))
    };
    Ok(Some(if let Some(path) = &c.json_schema {
        let flag = format!("--json-schema {}", path.display());
        let schema = serde_json::from_str(&read("--json-schema", path)?)
            .with_context(|| format!("{flag}: not a JSON document"))?;
        (flag, ConstraintSpec::JsonSchema(schema))
    } else if let Some(rx) = &c.regex {
        (format!("--regex {rx:?}"), ConstraintSpec::Regex(rx.clone()))
    } else if let Some(path) = &c.grammar {
        let flag = format!("--grammar {}", path.display());
        (flag, ConstraintSpec::Lark(read("--grammar", path)?))
    } else {
        return Ok(None);
    }))
}

/// Compiles the constraint once against the model's vocabulary, so that a bad schema, regex or
/// grammar is reported before anything runs, naming its flag.
fn check_constraint(
    spec: Option<(String, ConstraintSpec)>,
    engine: &Engine,
) -> Result<Option<ConstraintSpec>> {
    let Some((flag, spec)) = spec else {
        return Ok(None);
    };
    let factory = engine
        .constraint_factory()
        .with_context(|| format!("{flag}: the model's vocabulary"))?;
    Constraint::new(&factory, &spec).with_context(|| flag)?;
    Ok(Some(spec))
}

fn options(
    c: &Common,
    engine: &Engine,
    samples: usize,
    constraint: Option<ConstraintSpec>,
) -> GenerateOptions {
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
        constraint,
        logprobs: None,
    }
}

fn report(t: &Timings, reason: FinishReason) {
    note!(
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
    /// Proposed and accepted tokens and verification passes, with --spec.
    #[serde(skip_serializing_if = "Option::is_none")]
    spec: Option<SpecStats>,
}

fn generate(args: GenerateArgs) -> Result<()> {
    // `parse_args` checked the flags that need no model.
    let c = &args.common;
    let file_prompt = match &args.file {
        Some(path) => Some(read_prompt(path)?),
        None => None,
    };
    let spec = constraint_spec(c)?;
    let engine = load(c)?;
    let spec = check_constraint(spec, &engine)?;
    let draft = match args.spec.draft_path() {
        Some(path) => {
            Some(load_at(c, path).with_context(|| format!("--draft {}", path.display()))?)
        }
        None => None,
    };
    let speculation = args.spec.options(&engine, draft)?;
    let tok = engine.tokenizer();
    let text = args.prompt.as_ref().or(file_prompt.as_ref());
    let prompt_ids = match (&args.prompt_ids, text) {
        (Some(ids), _) => ids.clone(),
        (None, Some(text)) if args.chat => {
            let mut messages = Vec::new();
            if let Some(s) = &args.system {
                messages.push(ChatMessage::new("system", s));
            }
            messages.push(ChatMessage::new("user", text));
            tok.chat_prompt(&messages)
                .map_err(|e| chat_error(&c.model, e))?
        }
        (None, Some(text)) => tok.encode(text)?,
        (None, None) => bail!("give a prompt with -p TEXT, -f FILE or --prompt-ids 1,2,3"),
    };
    if prompt_ids.is_empty() {
        bail!("the prompt encodes to no tokens");
    }
    let opts = options(c, &engine, args.samples, spec);
    let needed = prompt_ids.len().saturating_add(c.n_predict);
    let positions = context_size(c, &engine, Some(needed), args.samples)?;
    let mut session = Session::new(engine.clone(), positions, args.samples);
    let mut out = Stdout::lock();
    let stream_text = !args.json && args.samples == 1;
    let mut write_error = None;
    let on_step = |step: &kiln::engine::Step| {
        if let (true, Some(Some(row))) = (stream_text, step.rows.first()) {
            if let Err(e) = out.write(&row.text).and_then(|()| out.flush()) {
                write_error = Some(e);
                return false;
            }
        }
        true
    };
    let (result, spec_stats) = match &speculation {
        Some(s) => {
            let r = session.generate_speculative(&prompt_ids, &opts, s, on_step)?;
            (r.batch, Some(r.spec))
        }
        None => (session.generate(&prompt_ids, &opts, on_step)?, None),
    };
    if let Some(e) = write_error {
        return Err(e.into());
    }
    let t = &result.timings;
    let first = &result.rows[0];
    if args.json {
        let json = JsonOut {
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
            spec: spec_stats,
        };
        out.line(&serde_json::to_string(&json)?)?;
        out.flush()?;
        return Ok(());
    }
    if args.samples > 1 {
        for (i, r) in result.rows.iter().enumerate() {
            out.line(&format!(
                "--- sample {i} ({:?})\n{}",
                r.finish_reason, r.text
            ))?;
        }
    } else {
        out.line("")?;
    }
    out.flush()?;
    report(t, first.finish_reason);
    if let Some(st) = spec_stats {
        note!(
            "kiln: speculation accepted {}/{} proposed tokens ({:.0}%): {} tokens in {} target \
             passes, {:.1} tok/s",
            st.accepted,
            st.proposed,
            100.0 * st.acceptance_rate(),
            result.usage.completion_tokens,
            st.verify_passes,
            result.usage.completion_tokens as f64 / t.decode.as_secs_f64().max(1e-9)
        );
        if st.device_draws > 0 {
            note!(
                "kiln: {} of those passes had nothing to verify and drew their token on the device",
                st.device_draws
            );
        }
    }
    Ok(())
}

fn chat(args: ChatArgs) -> Result<()> {
    // `parse_args` checked the flags that need no model.
    let c = &args.common;
    let spec = constraint_spec(c)?;
    let engine = load(c)?;
    let spec = check_constraint(spec, &engine)?;
    let tok = engine.tokenizer();
    // Models without a chat template but with nanochat's tokens keep the conversation as ids,
    // as nanochat's chat_cli does: generated tool calls stay special tokens in the history.
    let nanochat = match (&tok.specials.chat_template, NanochatTokens::of(tok)) {
        (None, Ok(t)) => Some(t),
        (None, Err(e)) => bail!("{}: no chat template ({e})", c.model.display()),
        (Some(_), _) => None,
    };
    let opts = options(c, &engine, 1, spec);
    let mut session = engine.session(context_size(c, &engine, None, 1)?);
    let mut messages: Vec<ChatMessage> = args
        .system
        .iter()
        .map(|s| ChatMessage::new("system", s))
        .collect();
    let mut conv: Vec<u32> = nanochat.map(|t| vec![t.bos]).unwrap_or_default();
    let mut pending_system = args.system.clone();
    let mut stdin = std::io::stdin().lock();
    let mut out = Stdout::lock();
    note!("kiln chat: type a message; /reset starts over, /exit or end of input quits.");
    loop {
        out.write("\n> ")?;
        out.flush()?;
        let line = match read_chat_line(&mut stdin, MAX_TEXT_BYTES).context("reading stdin")? {
            ChatLine::End => break,
            ChatLine::Text(line) => line,
            ChatLine::NotUtf8(at) => {
                note!("kiln chat: that line is not valid UTF-8 (byte {at}); it was skipped");
                continue;
            }
            ChatLine::TooLong => {
                note!(
                    "kiln chat: that line is longer than {} MiB; it was skipped",
                    MAX_TEXT_BYTES >> 20
                );
                continue;
            }
        };
        let line = line.as_str();
        match line.trim() {
            "" => continue,
            "/exit" | "/quit" => break,
            "/reset" => {
                messages.retain(|m| m.role == "system");
                conv.truncate(1);
                pending_system = args.system.clone();
                session.truncate(0);
                continue;
            }
            _ => {}
        }
        let prompt = match nanochat {
            Some(t) => {
                // nanochat folds the system message into the first user turn.
                let text = match &pending_system {
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
                    Err(e) => {
                        note!("error: {:#}", chat_error(&c.model, e));
                        messages.pop();
                        continue;
                    }
                }
            }
        };
        let mut write_error = None;
        let result = session.generate(&prompt, &opts, |step| {
            if let Some(Some(row)) = step.rows.first() {
                if let Err(e) = out.write(&row.text).and_then(|()| out.flush()) {
                    write_error = Some(e);
                    return false;
                }
            }
            true
        });
        if let Some(e) = write_error {
            return Err(e.into());
        }
        let result = match result {
            Ok(r) => r,
            Err(e) => {
                note!("\nerror: {e}");
                if nanochat.is_none() {
                    messages.pop();
                }
                continue;
            }
        };
        pending_system = None;
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

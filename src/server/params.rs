//! Reading a completion or chat request's JSON into engine requests, refusing wrong types and
//! out-of-range values with an error that names the parameter. Unknown fields are ignored;
//! known parameters this server cannot honour are refused rather than silently dropped.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{Map, Value};

use super::error::ApiError;
use crate::engine::{Constraint, ConstraintSpec, Engine, GenerateOptions, LogitsProcessor};
use crate::sample::SamplingParams;
use crate::tokenizer::ChatMessage;

/// Which endpoint a request came to (they differ in how the prompt is given).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    Chat,
}

/// The most choices one request may ask for (`n`).
pub const MAX_N: u64 = 64;
/// The most stop strings one request may give.
pub const MAX_STOP: usize = 16;
/// The most alternatives per token `logprobs` (completions) or `top_logprobs` (chat) may ask
/// for (OpenAI's chat limit; vLLM's default).
pub const MAX_TOP_LOGPROBS: u64 = 20;

/// A request read and tokenized: one engine request per prompt, each with `n` rows.
#[derive(Debug)]
pub struct Parsed {
    pub prompts: Vec<Vec<u32>>,
    pub n: usize,
    pub stream: bool,
    pub include_usage: bool,
    /// Options shared by every prompt (`max_tokens` is the request's, before the context cap).
    pub options: GenerateOptions,
    /// OpenAI's presence and frequency penalties (0 when absent).
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
}

impl Parsed {
    /// Whether the response carries log-probabilities.
    pub fn logprobs(&self) -> bool {
        self.options.logprobs.is_some()
    }
}

impl Parsed {
    /// The engine options for prompt `i` under a context of `context` positions: `max_tokens`
    /// capped so prompt and completion fit, and the penalties bound to the prompt's length.
    pub fn options_for(&self, prompt_len: usize, context: usize) -> GenerateOptions {
        let room = context.saturating_sub(prompt_len);
        let mut o = self.options.clone();
        o.max_tokens = Some(o.max_tokens.map_or(room, |m| m.min(room)));
        if self.presence_penalty != 0.0 || self.frequency_penalty != 0.0 {
            o.logits_processor = Some(penalties(
                prompt_len,
                self.presence_penalty,
                self.frequency_penalty,
            ));
        }
        o
    }
}

/// OpenAI's penalties on tokens already generated (the prompt does not count): a token seen
/// `c > 0` times loses `presence + c * frequency` from its logit.
pub fn penalties(prompt_len: usize, presence: f32, frequency: f32) -> LogitsProcessor {
    LogitsProcessor(Arc::new(move |_row, context, logits| {
        let generated = context.get(prompt_len..).unwrap_or(&[]);
        let mut counts: HashMap<u32, u32> = HashMap::new();
        for &t in generated {
            *counts.entry(t).or_default() += 1;
        }
        for (t, c) in counts {
            if let Some(l) = logits.get_mut(t as usize) {
                *l -= presence + frequency * c as f32;
            }
        }
    }))
}

/// Reads the body of a request to `endpoint` for a model named `model_id`.
pub fn parse(
    body: &[u8],
    endpoint: Endpoint,
    engine: &Engine,
    model_id: &str,
) -> Result<Parsed, ApiError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("the request body is not valid JSON: {e}")))?;
    let Value::Object(obj) = value else {
        return Err(ApiError::bad_request(
            "the request body must be a JSON object",
        ));
    };
    let o = &obj;
    match o.get("model") {
        None | Some(Value::Null) => {}
        Some(Value::String(m)) if m == model_id => {}
        Some(Value::String(m)) => return Err(ApiError::model_not_found(m, model_id)),
        Some(_) => return Err(ApiError::invalid("model", "model must be a string")),
    }
    refuse_unsupported(o, endpoint)?;

    let prompts = match endpoint {
        Endpoint::Completions => completion_prompts(o, engine)?,
        Endpoint::Chat => vec![chat_prompt(o, engine)?],
    };
    let n = uint(o, "n", 1, MAX_N)?.unwrap_or(1) as usize;
    let stream = boolean(o, "stream")?.unwrap_or(false);
    let include_usage = match o.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(Value::Object(so)) => boolean(so, "include_usage")
            .map_err(|e| ApiError {
                param: Some("stream_options.include_usage".into()),
                ..e
            })?
            .unwrap_or(false),
        Some(_) => {
            return Err(ApiError::invalid(
                "stream_options",
                "stream_options must be an object",
            ))
        }
    };
    let mut max_tokens = uint(o, "max_tokens", 1, u32::MAX as u64)?;
    if endpoint == Endpoint::Chat {
        if let Some(m) = uint(o, "max_completion_tokens", 1, u32::MAX as u64)? {
            max_tokens = Some(m);
        }
    }
    let top_k = match int(o, "top_k")? {
        None | Some(-1) | Some(0) => None,
        Some(k) if k > 0 => Some(k as usize),
        Some(_) => {
            return Err(ApiError::invalid(
                "top_k",
                "top_k must be -1, 0 or positive",
            ))
        }
    };
    let sampling = SamplingParams {
        temperature: float(o, "temperature", 0.0, 2.0)?.unwrap_or(1.0),
        top_k,
        top_p: float(o, "top_p", 0.0, 1.0)?
            .map(|p| {
                if p > 0.0 {
                    Ok(p)
                } else {
                    Err(ApiError::invalid("top_p", "top_p must be in (0, 1]"))
                }
            })
            .transpose()?
            .filter(|&p| p < 1.0),
        min_p: float(o, "min_p", 0.0, 1.0)?.filter(|&p| p > 0.0),
        repetition_penalty: float(o, "repetition_penalty", 0.01, 100.0)?.filter(|&p| p != 1.0),
        seed: match int(o, "seed")? {
            // Two's complement: every integer the client may send is a distinct seed.
            Some(s) => s as u64,
            None => fresh_seed(),
        },
    };
    let logprobs = logprobs(o, endpoint)?;
    let constraint = response_format(o, engine)?;
    let options = GenerateOptions {
        max_tokens: max_tokens.map(|m| m as usize),
        sampling,
        num_samples: n,
        stop_tokens: ignore_eos(o)?,
        stop_strings: stop(o)?,
        tools: true,
        logits_processor: None,
        constraint,
        logprobs,
    };
    Ok(Parsed {
        prompts,
        n,
        stream,
        include_usage,
        options,
        presence_penalty: float(o, "presence_penalty", -2.0, 2.0)?.unwrap_or(0.0),
        frequency_penalty: float(o, "frequency_penalty", -2.0, 2.0)?.unwrap_or(0.0),
    })
}

/// `ignore_eos` (an extension llama-server and vLLM accept): `true` turns the model's stop
/// tokens off, so the request generates until `max_tokens` or a stop string — what benchmarks
/// need to give every server the same number of tokens to generate.
fn ignore_eos(o: &Map<String, Value>) -> Result<Option<Vec<u32>>, ApiError> {
    Ok(boolean(o, "ignore_eos")?.unwrap_or(false).then(Vec::new))
}

/// A seed for a request that gave none (distinct per request).
fn fresh_seed() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    nanos
        ^ COUNTER
            .fetch_add(1, Ordering::Relaxed)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// Parameters of the OpenAI API that this server does not implement: refused when they ask
/// for something, accepted when they ask for the default.
fn refuse_unsupported(o: &Map<String, Value>, endpoint: Endpoint) -> Result<(), ApiError> {
    let asks = |name: &str| match o.get(name) {
        None | Some(Value::Null) | Some(Value::Bool(false)) => false,
        Some(Value::Array(a)) => !a.is_empty(),
        Some(Value::Object(m)) => !m.is_empty(),
        Some(Value::Number(n)) => n.as_f64() != Some(0.0),
        Some(_) => true,
    };
    match endpoint {
        Endpoint::Completions => {
            if asks("echo") {
                return Err(ApiError::unsupported("echo", "the prompt is not echoed"));
            }
            if let Some(b) = uint(o, "best_of", 1, MAX_N)? {
                if b > 1 {
                    return Err(ApiError::unsupported("best_of", "use n instead"));
                }
            }
            if asks("suffix") {
                return Err(ApiError::unsupported("suffix", "no fill-in-the-middle"));
            }
        }
        Endpoint::Chat => {
            if asks("tools") {
                return Err(ApiError::unsupported(
                    "tools",
                    "function calling is not implemented",
                ));
            }
        }
    }
    if asks("logit_bias") {
        return Err(ApiError::unsupported(
            "logit_bias",
            "logit biases are not applied",
        ));
    }
    Ok(())
}

/// How many alternatives per token the request asks for, if it asks for log-probabilities:
/// completions' `logprobs` (an integer), chat's `logprobs` (a boolean) with `top_logprobs`.
fn logprobs(o: &Map<String, Value>, endpoint: Endpoint) -> Result<Option<usize>, ApiError> {
    let top = |name| uint(o, name, 0, MAX_TOP_LOGPROBS).map(|k| k.map(|k| k as usize));
    match endpoint {
        Endpoint::Completions => top("logprobs"),
        Endpoint::Chat => match (boolean(o, "logprobs")?, top("top_logprobs")?) {
            (Some(true), k) => Ok(Some(k.unwrap_or(0))),
            (_, Some(k)) if k > 0 => Err(ApiError::invalid(
                "top_logprobs",
                "top_logprobs needs logprobs set to true",
            )),
            _ => Ok(None),
        },
    }
}

/// `response_format`: `{"type": "text"}` (no constraint), `{"type": "json_object"}` (any JSON
/// object) or `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}` (a value
/// valid under the schema). The constraint is compiled here once, so that a schema llguidance
/// cannot compile is refused before the request is queued.
fn response_format(
    o: &Map<String, Value>,
    engine: &Engine,
) -> Result<Option<ConstraintSpec>, ApiError> {
    const P: &str = "response_format";
    let rf = match o.get(P) {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(rf)) => rf,
        Some(_) => return Err(wrong_type(P, "an object")),
    };
    let spec = match rf.get("type") {
        Some(Value::String(t)) if t == "text" => return Ok(None),
        Some(Value::String(t)) if t == "json_object" => ConstraintSpec::JsonObject,
        Some(Value::String(t)) if t == "json_schema" => {
            let js = match rf.get("json_schema") {
                Some(Value::Object(js)) => js,
                _ => return Err(wrong_type("response_format.json_schema", "an object")),
            };
            match js.get("name") {
                None | Some(Value::Null) | Some(Value::String(_)) => {}
                Some(_) => return Err(wrong_type("response_format.json_schema.name", "a string")),
            }
            match js.get("strict") {
                None | Some(Value::Null) | Some(Value::Bool(_)) => {}
                Some(_) => {
                    return Err(wrong_type(
                        "response_format.json_schema.strict",
                        "a boolean",
                    ))
                }
            }
            match js.get("schema") {
                Some(schema @ Value::Object(_)) => ConstraintSpec::JsonSchema(schema.clone()),
                _ => {
                    return Err(wrong_type(
                        "response_format.json_schema.schema",
                        "a JSON Schema object",
                    ))
                }
            }
        }
        Some(Value::String(t)) => {
            return Err(ApiError::invalid(
                "response_format.type",
                format!("response_format.type {t:?} is not one of text, json_object, json_schema"),
            ))
        }
        _ => return Err(wrong_type("response_format.type", "a string")),
    };
    let factory = engine.constraint_factory().map_err(|e| {
        ApiError::invalid(
            P,
            format!("constrained output is not available for this model: {e}"),
        )
    })?;
    Constraint::new(&factory, &spec)
        .map_err(|e| ApiError::invalid(P, format!("response_format cannot be used: {e}")))?;
    Ok(Some(spec))
}

fn wrong_type(name: &str, what: &str) -> ApiError {
    ApiError::invalid(name, format!("{name} must be {what}"))
        .with_status(axum::http::StatusCode::BAD_REQUEST, "invalid_type")
}

fn float(o: &Map<String, Value>, name: &str, lo: f64, hi: f64) -> Result<Option<f32>, ApiError> {
    match o.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => match n.as_f64() {
            Some(v) if v.is_finite() && (lo..=hi).contains(&v) => Ok(Some(v as f32)),
            _ => Err(ApiError::invalid(
                name,
                format!("{name} must be between {lo} and {hi} (got {n})"),
            )),
        },
        Some(_) => Err(wrong_type(name, "a number")),
    }
}

fn uint(o: &Map<String, Value>, name: &str, lo: u64, hi: u64) -> Result<Option<u64>, ApiError> {
    match o.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => match n.as_u64() {
            Some(v) if (lo..=hi).contains(&v) => Ok(Some(v)),
            _ if n.is_f64() => Err(wrong_type(name, "an integer")),
            _ => Err(ApiError::invalid(
                name,
                format!("{name} must be an integer from {lo} to {hi} (got {n})"),
            )),
        },
        Some(_) => Err(wrong_type(name, "an integer")),
    }
}

fn int(o: &Map<String, Value>, name: &str) -> Result<Option<i64>, ApiError> {
    match o.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => match (n.as_i64(), n.as_u64()) {
            (Some(v), _) => Ok(Some(v)),
            (None, Some(v)) => Ok(Some(v as i64)),
            _ if n.is_f64() => Err(wrong_type(name, "an integer")),
            _ => Err(ApiError::invalid(name, format!("{name} is out of range"))),
        },
        Some(_) => Err(wrong_type(name, "an integer")),
    }
}

fn boolean(o: &Map<String, Value>, name: &str) -> Result<Option<bool>, ApiError> {
    match o.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(wrong_type(name, "a boolean")),
    }
}

fn stop(o: &Map<String, Value>) -> Result<Vec<String>, ApiError> {
    let list = match o.get("stop") {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| match v {
                Value::String(s) => Ok(s.clone()),
                _ => Err(wrong_type("stop", "a string or a list of strings")),
            })
            .collect::<Result<_, _>>()?,
        Some(_) => return Err(wrong_type("stop", "a string or a list of strings")),
    };
    if list.len() > MAX_STOP {
        return Err(ApiError::invalid(
            "stop",
            format!("stop may hold at most {MAX_STOP} strings"),
        ));
    }
    if list.iter().any(String::is_empty) {
        return Err(ApiError::invalid("stop", "stop strings must not be empty"));
    }
    Ok(list)
}

/// `prompt`: a string, a list of strings, a list of token ids, or a list of such lists.
fn completion_prompts(o: &Map<String, Value>, engine: &Engine) -> Result<Vec<Vec<u32>>, ApiError> {
    let tok = engine.tokenizer();
    let encode = |s: &str| {
        tok.encode(s).map_err(|e| {
            ApiError::invalid("prompt", format!("the prompt cannot be tokenized: {e}"))
        })
    };
    let what = "a string, a list of strings, a list of token ids or a list of lists of token ids";
    let prompts = match o.get("prompt") {
        None | Some(Value::Null) => return Err(ApiError::invalid("prompt", "prompt is required")),
        Some(Value::String(s)) => vec![encode(s)?],
        Some(Value::Array(a)) if a.is_empty() => {
            return Err(ApiError::invalid("prompt", "prompt must not be empty"))
        }
        Some(Value::Array(a)) if a.iter().all(Value::is_string) => a
            .iter()
            .map(|v| encode(v.as_str().unwrap_or_default()))
            .collect::<Result<_, _>>()?,
        Some(Value::Array(a)) if a.iter().all(Value::is_number) => vec![token_ids(a, engine)?],
        Some(Value::Array(a)) if a.iter().all(Value::is_array) => a
            .iter()
            .map(|v| token_ids(v.as_array().map_or(&[][..], Vec::as_slice), engine))
            .collect::<Result<_, _>>()?,
        Some(_) => return Err(wrong_type("prompt", what)),
    };
    if prompts.len() > MAX_N as usize {
        return Err(ApiError::invalid(
            "prompt",
            format!("at most {MAX_N} prompts per request"),
        ));
    }
    if prompts.iter().any(Vec::is_empty) {
        return Err(ApiError::invalid("prompt", "a prompt is empty"));
    }
    Ok(prompts)
}

fn token_ids(a: &[Value], engine: &Engine) -> Result<Vec<u32>, ApiError> {
    let vocab = engine.config().vocab_size;
    a.iter()
        .map(|v| match v.as_u64() {
            Some(t) if (t as usize) < vocab && t <= u32::MAX as u64 => Ok(t as u32),
            _ => Err(ApiError::invalid(
                "prompt",
                format!(
                    "token id {v} is not in the vocabulary (0 to {})",
                    vocab.saturating_sub(1)
                ),
            )),
        })
        .collect()
}

/// `messages`, rendered with the model's chat template.
fn chat_prompt(o: &Map<String, Value>, engine: &Engine) -> Result<Vec<u32>, ApiError> {
    let Some(Value::Array(list)) = o.get("messages") else {
        return Err(match o.get("messages") {
            None | Some(Value::Null) => ApiError::invalid("messages", "messages is required"),
            Some(_) => wrong_type("messages", "a list of messages"),
        });
    };
    if list.is_empty() {
        return Err(ApiError::invalid("messages", "messages must not be empty"));
    }
    let mut messages = Vec::with_capacity(list.len());
    for (i, m) in list.iter().enumerate() {
        let Value::Object(m) = m else {
            return Err(wrong_type(&format!("messages[{i}]"), "an object"));
        };
        let role = match m.get("role") {
            Some(Value::String(r)) => r.clone(),
            _ => return Err(wrong_type(&format!("messages[{i}].role"), "a string")),
        };
        let content = match m.get("content") {
            Some(Value::String(c)) => c.clone(),
            None | Some(Value::Null) => String::new(),
            Some(Value::Array(parts)) => {
                let mut text = String::new();
                for (j, p) in parts.iter().enumerate() {
                    match (p.get("type").and_then(Value::as_str), p.get("text")) {
                        (Some("text"), Some(Value::String(t))) => text.push_str(t),
                        _ => {
                            return Err(ApiError::invalid(
                                format!("messages[{i}].content[{j}]"),
                                "only text content parts ({\"type\": \"text\", \"text\": …}) are served",
                            ))
                        }
                    }
                }
                text
            }
            Some(_) => {
                return Err(wrong_type(
                    &format!("messages[{i}].content"),
                    "a string or a list of content parts",
                ))
            }
        };
        messages.push(ChatMessage::new(role, content));
    }
    let prompt = engine
        .tokenizer()
        .chat_prompt(&messages)
        .map_err(|e| ApiError::invalid("messages", format!("the chat template failed: {e}")))?;
    if prompt.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "the rendered prompt is empty",
        ));
    }
    Ok(prompt)
}

#[cfg(test)]
mod tests {
    use super::penalties;

    #[test]
    fn penalties_count_generated_tokens_only() {
        // Prompt [5, 5]; generated [1, 3, 1]: token 1 seen twice, token 3 once, 5 not at all.
        let p = penalties(2, 0.5, 0.25);
        let mut logits = vec![0.0f32; 6];
        (p.0)(0, &[5, 5, 1, 3, 1], &mut logits);
        assert_eq!(logits, vec![0.0, -1.0, 0.0, -0.75, 0.0, 0.0]);
    }
}

//! `POST /v1/completions` and `POST /v1/chat/completions`, whole or streamed as server-sent
//! events. The request is read and submitted on a blocking thread (tokenizing and the
//! scheduler's acceptance may take a moment); the scheduler's events come back through an
//! unbounded channel, so no handler ever waits on the engine outside `.await`.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::StreamExt;
use serde_json::{json, Value};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use super::error::ApiError;
use super::logprobs::ChoiceLogprobs;
use super::params::{self, Endpoint, Parsed};
use super::AppState;
use crate::engine::{EngineError, Event, FinishReason, Request, RequestId, ServeError, Usage};

pub async fn completions(State(st): State<Arc<AppState>>, body: Body) -> Response {
    handle(st, Endpoint::Completions, body).await
}

pub async fn chat_completions(State(st): State<Arc<AppState>>, body: Body) -> Response {
    handle(st, Endpoint::Chat, body).await
}

/// Reads a request body of at most `limit` bytes within `timeout`.
async fn read_body(body: Body, limit: usize, timeout: Duration) -> Result<Vec<u8>, ApiError> {
    let read = async {
        let mut data = body.into_data_stream();
        let mut buf = Vec::new();
        while let Some(chunk) = data.next().await {
            let chunk = chunk.map_err(|e| {
                ApiError::bad_request(format!("the request body could not be read: {e}"))
                    .with_status(StatusCode::BAD_REQUEST, "invalid_body")
            })?;
            if buf.len().saturating_add(chunk.len()) > limit {
                return Err(ApiError::bad_request(format!(
                    "the request body is larger than {limit} bytes"
                ))
                .with_status(StatusCode::PAYLOAD_TOO_LARGE, "request_too_large"));
            }
            buf.extend_from_slice(&chunk);
        }
        Ok(buf)
    };
    tokio::time::timeout(timeout, read)
        .await
        .unwrap_or_else(|_| {
            Err(ApiError::bad_request(format!(
                "the request body did not arrive within {} s",
                timeout.as_secs_f64()
            ))
            .with_status(StatusCode::REQUEST_TIMEOUT, "request_timeout"))
        })
}

async fn handle(st: Arc<AppState>, endpoint: Endpoint, body: Body) -> Response {
    let start = Instant::now();
    let body = match read_body(body, st.config.max_body_bytes, st.config.read_timeout).await {
        Ok(b) => b,
        Err(e) => {
            // The rest of the body stays unread, so the connection cannot be reused: say so,
            // or a client would send its next request on a connection about to close.
            let mut resp = e.into_response();
            resp.headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
            return resp;
        }
    };
    let state = Arc::clone(&st);
    let submitted = match tokio::task::spawn_blocking(move || submit(&state, endpoint, &body)).await
    {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => return e.into_response(),
        Err(e) => return ApiError::server(format!("the request failed: {e}")).into_response(),
    };
    let reply = Reply::new(&st, endpoint, &submitted);
    if submitted.stream {
        stream(st, reply, submitted, start).into_response()
    } else {
        match collect(&st, reply, submitted, start).await {
            Ok(v) => Json(v).into_response(),
            Err(e) => e.into_response(),
        }
    }
}

/// A request in the scheduler: its events (tagged by prompt) and the guard that cancels it
/// when the client goes away.
struct Submitted {
    rx: UnboundedReceiver<(usize, Event)>,
    guard: CancelGuard,
    prompts: usize,
    n: usize,
    stream: bool,
    include_usage: bool,
    logprobs: bool,
}

/// Cancels its requests when dropped before they finished (the client disconnected or the
/// handler failed), and gives their places in the queue back.
struct CancelGuard {
    st: Arc<AppState>,
    ids: Vec<RequestId>,
    finished: bool,
    slots: usize,
}

impl Drop for CancelGuard {
    fn drop(&mut self) {
        if !self.finished {
            for &id in &self.ids {
                self.st.handle.cancel(id);
            }
        }
        self.st.inflight.fetch_sub(self.slots, Ordering::AcqRel);
    }
}

fn submit(st: &Arc<AppState>, endpoint: Endpoint, body: &[u8]) -> Result<Submitted, ApiError> {
    let engine = st.handle.engine();
    let parsed: Parsed = params::parse(body, endpoint, engine, &st.config.model_id)?;
    let param = match endpoint {
        Endpoint::Completions => "prompt",
        Endpoint::Chat => "messages",
    };
    let context = st.config.context;
    for p in &parsed.prompts {
        if p.len() >= context {
            return Err(ApiError {
                code: Some("context_length_exceeded"),
                ..ApiError::invalid(
                    param,
                    format!(
                        "the prompt has {} tokens but the context holds {context} (prompt and completion together)",
                        p.len()
                    ),
                )
            });
        }
    }
    let k = parsed.prompts.len();
    let limit = st.config.max_running + st.config.max_queue;
    if st.inflight.fetch_add(k, Ordering::AcqRel) + k > limit {
        st.inflight.fetch_sub(k, Ordering::AcqRel);
        return Err(ApiError::overloaded());
    }
    let mut guard = CancelGuard {
        st: Arc::clone(st),
        ids: Vec::with_capacity(k),
        finished: false,
        slots: k,
    };
    let (tx, rx) = unbounded_channel();
    for (i, prompt) in parsed.prompts.iter().enumerate() {
        let options = parsed.options_for(prompt.len(), context);
        let tx = tx.clone();
        let req = Request {
            prompt: prompt.clone(),
            options,
            spec: st.config.spec.clone(),
        };
        let id = st
            .handle
            .submit_with(req, move |e| tx.send((i, e)).is_ok())
            .map_err(|e| engine_error(e, param))?;
        guard.ids.push(id);
    }
    Ok(Submitted {
        rx,
        guard,
        prompts: k,
        n: parsed.n,
        stream: parsed.stream,
        include_usage: parsed.include_usage,
        logprobs: parsed.logprobs(),
    })
}

/// The status an engine's refusal of a request deserves.
fn engine_error(e: EngineError, param: &str) -> ApiError {
    match e {
        EngineError::PromptTooLong { .. } | EngineError::Serve(ServeError::TooBig { .. }) => {
            ApiError {
                code: Some("context_length_exceeded"),
                ..ApiError::invalid(param, e.to_string())
            }
        }
        EngineError::EmptyPrompt | EngineError::Tokenizer(_) | EngineError::Exec(_) => {
            ApiError::invalid(param, e.to_string())
        }
        EngineError::Sampling(_) => ApiError::invalid("temperature", e.to_string()),
        EngineError::Stopped => ApiError::server(e.to_string())
            .with_status(StatusCode::SERVICE_UNAVAILABLE, "engine_stopped"),
        e => ApiError::server(e.to_string()),
    }
}

fn finish_reason(r: FinishReason) -> &'static str {
    match r {
        FinishReason::MaxTokens | FinishReason::ContextFull => "length",
        // A grammar that completed (or could not continue) ends the text like a stop does.
        FinishReason::StopToken
        | FinishReason::StopString
        | FinishReason::Cancelled
        | FinishReason::ConstraintEnd
        | FinishReason::ConstraintBroken => "stop",
    }
}

fn usage_json(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    })
}

fn add_usage(total: &mut Usage, u: &Usage) {
    total.prompt_tokens += u.prompt_tokens;
    total.completion_tokens += u.completion_tokens;
    total.cached_tokens += u.cached_tokens;
}

/// What every response object of one request shares.
struct Reply {
    endpoint: Endpoint,
    id: String,
    created: u64,
    model: String,
}

impl Reply {
    fn new(st: &AppState, endpoint: Endpoint, s: &Submitted) -> Reply {
        let prefix = match endpoint {
            Endpoint::Completions => "cmpl",
            Endpoint::Chat => "chatcmpl",
        };
        Reply {
            endpoint,
            id: format!("{prefix}-{}", s.guard.ids.first().copied().unwrap_or(0)),
            created: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            model: st.config.model_id.clone(),
        }
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.endpoint, chunk) {
            (Endpoint::Completions, _) => "text_completion",
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
        }
    }

    fn choice(
        &self,
        index: usize,
        text: &str,
        logprobs: Value,
        finish: Option<&str>,
        chunk: bool,
    ) -> Value {
        match (self.endpoint, chunk) {
            (Endpoint::Completions, _) => json!({
                "index": index, "text": text, "logprobs": logprobs, "finish_reason": finish,
            }),
            (Endpoint::Chat, false) => json!({
                "index": index,
                "message": {"role": "assistant", "content": text},
                "logprobs": logprobs,
                "finish_reason": finish,
            }),
            (Endpoint::Chat, true) => {
                let delta = if text.is_empty() && finish.is_some() {
                    json!({})
                } else {
                    json!({"content": text})
                };
                json!({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish})
            }
        }
    }

    fn response(&self, choices: Vec<Value>, chunk: bool) -> Value {
        json!({
            "id": self.id,
            "object": self.object(chunk),
            "created": self.created,
            "model": self.model,
            "system_fingerprint": null,
            "choices": choices,
        })
    }
}

/// Latency bookkeeping of one request.
struct Clock {
    start: Instant,
    last: Option<Instant>,
}

impl Clock {
    fn step(&mut self, st: &AppState) {
        let now = Instant::now();
        match self.last {
            None => st.metrics.time_to_first_token(now - self.start),
            Some(t) => st.metrics.inter_token(now - t),
        }
        self.last = Some(now);
    }
}

/// Runs a request to the end and builds the whole response.
async fn collect(
    st: &AppState,
    reply: Reply,
    mut s: Submitted,
    start: Instant,
) -> Result<Value, ApiError> {
    let n = s.n;
    let mut texts = vec![String::new(); s.prompts * n];
    let mut reasons: Vec<Option<&str>> = vec![None; s.prompts * n];
    let mut logprobs: Vec<ChoiceLogprobs> = (0..s.prompts * n)
        .map(|_| ChoiceLogprobs::new(reply.endpoint))
        .collect();
    let tok = st.handle.engine().tokenizer();
    let mut usage = Usage::default();
    let mut pending = s.prompts;
    let mut clock = Clock { start, last: None };
    while pending > 0 {
        let Some((i, event)) = s.rx.recv().await else {
            return Err(ApiError::server(
                "the engine stopped before the request finished",
            ));
        };
        match event {
            Event::Step(step) => {
                clock.step(st);
                for (r, row) in step.rows.iter().enumerate() {
                    if let (Some(row), Some(t), Some(lp)) =
                        (row, texts.get_mut(i * n + r), logprobs.get_mut(i * n + r))
                    {
                        t.push_str(&row.text);
                        lp.push(&st.token_texts, tok, row);
                    }
                }
            }
            Event::Done(done) => {
                add_usage(&mut usage, &done.usage);
                for (r, reason) in done.finish_reasons.into_iter().enumerate() {
                    if let Some(slot) = reasons.get_mut(i * n + r) {
                        *slot = Some(finish_reason(reason));
                    }
                }
                pending -= 1;
            }
            Event::Error(e) => return Err(ApiError::server(e)),
        }
    }
    s.guard.finished = true;
    let choices = texts
        .iter()
        .zip(&reasons)
        .zip(&mut logprobs)
        .enumerate()
        .map(|(k, ((t, r), lp))| reply.choice(k, t, lp.take(s.logprobs), *r, false))
        .collect();
    let mut v = reply.response(choices, false);
    v["usage"] = usage_json(&usage);
    Ok(v)
}

/// The state of one streamed response.
struct Streaming {
    st: Arc<AppState>,
    reply: Reply,
    s: Submitted,
    queue: VecDeque<SseEvent>,
    finished: Vec<bool>,
    logprobs: Vec<ChoiceLogprobs>,
    pending: usize,
    usage: Usage,
    clock: Clock,
    done: bool,
}

impl Streaming {
    fn push(&mut self, choices: Vec<Value>) {
        let mut v = self.reply.response(choices, true);
        if self.s.include_usage {
            v["usage"] = Value::Null;
        }
        self.queue
            .push_back(SseEvent::default().data(v.to_string()));
    }

    fn end(&mut self) {
        if self.s.include_usage {
            let mut v = self.reply.response(Vec::new(), true);
            v["usage"] = usage_json(&self.usage);
            self.queue
                .push_back(SseEvent::default().data(v.to_string()));
        }
        self.queue.push_back(SseEvent::default().data("[DONE]"));
        self.done = true;
        self.s.guard.finished = true;
    }

    fn on(&mut self, i: usize, event: Event) {
        let n = self.s.n;
        match event {
            Event::Step(step) => {
                self.clock.step(&self.st);
                let st = Arc::clone(&self.st);
                let tok = st.handle.engine().tokenizer();
                for (r, row) in step.rows.iter().enumerate() {
                    let Some(row) = row else { continue };
                    let k = i * n + r;
                    let Some(lp) = self.logprobs.get_mut(k) else {
                        continue;
                    };
                    let finish = row.finished.map(finish_reason);
                    let has_logprobs = lp.push(&st.token_texts, tok, row);
                    if row.text.is_empty() && finish.is_none() && !has_logprobs {
                        continue;
                    }
                    if finish.is_some() {
                        if let Some(f) = self.finished.get_mut(k) {
                            *f = true;
                        }
                    }
                    let lp = lp.take(self.s.logprobs);
                    let c = self.reply.choice(k, &row.text, lp, finish, true);
                    self.push(vec![c]);
                }
            }
            Event::Done(done) => {
                add_usage(&mut self.usage, &done.usage);
                for (r, reason) in done.finish_reasons.into_iter().enumerate() {
                    let k = i * n + r;
                    if self.finished.get(k) == Some(&false) {
                        self.finished[k] = true;
                        let reason = Some(finish_reason(reason));
                        let c = self.reply.choice(k, "", Value::Null, reason, true);
                        self.push(vec![c]);
                    }
                }
                self.pending -= 1;
                if self.pending == 0 {
                    self.end();
                }
            }
            Event::Error(e) => {
                let body = ApiError::server(e).body();
                self.queue
                    .push_back(SseEvent::default().data(body.to_string()));
                self.queue.push_back(SseEvent::default().data("[DONE]"));
                self.done = true;
            }
        }
    }
}

/// Streams a request's tokens as they come. Dropping the stream (the client went away) drops
/// the guard, which cancels the request at once.
fn stream(st: Arc<AppState>, reply: Reply, s: Submitted, start: Instant) -> impl IntoResponse {
    let total = s.prompts * s.n;
    let reply_endpoint = reply.endpoint;
    let mut state = Streaming {
        st,
        reply,
        pending: s.prompts,
        s,
        queue: VecDeque::new(),
        finished: vec![false; total],
        logprobs: (0..total)
            .map(|_| ChoiceLogprobs::new(reply_endpoint))
            .collect(),
        usage: Usage::default(),
        clock: Clock { start, last: None },
        done: false,
    };
    if state.reply.endpoint == Endpoint::Chat {
        for k in 0..total {
            let mut c = state.reply.choice(k, "", Value::Null, None, true);
            c["delta"] = json!({"role": "assistant", "content": ""});
            state.push(vec![c]);
        }
    }
    let events = futures_util::stream::unfold(state, |mut state| async move {
        loop {
            if let Some(e) = state.queue.pop_front() {
                return Some((Ok::<_, Infallible>(e), state));
            }
            if state.done {
                return None;
            }
            match state.s.rx.recv().await {
                Some((i, event)) => state.on(i, event),
                None => state.on(
                    0,
                    Event::Error("the engine stopped before the request finished".into()),
                ),
            }
        }
    });
    Sse::new(events)
}

//! An OpenAI-compatible HTTP server over an [`EngineHandle`]: `POST /v1/completions`,
//! `POST /v1/chat/completions` (whole or streamed as server-sent events), `GET /v1/models`,
//! `GET /health` and `GET /metrics` (Prometheus text).
//!
//! [`router`] returns the routes as an axum [`Router`] a service can mount; [`serve`] runs them
//! on a listener until a shutdown signal, cutting off clients that send a request slower than
//! [`ServerConfig::read_timeout`]. The engine steps on the handle's own thread; handlers
//! submit on a blocking thread and await the request's events through a channel, so the async
//! runtime never waits on the engine. A client that goes away cancels its request at once.
//!
//! ```no_run
//! # use std::sync::Arc;
//! # use kiln::engine::{Engine, EngineHandle, ServeOptions};
//! # use kiln::server::{router, ServerConfig};
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let engine = Arc::new(Engine::load("model.gguf", kiln::backend::cpu::CpuOptions::default())?);
//! let config = ServerConfig::new("model", engine.max_context());
//! let handle = EngineHandle::start(engine, ServeOptions::default())?;
//! let app = router(handle, config.clone());
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:8080").await?;
//! kiln::server::serve(listener, app, config.read_timeout, std::future::pending()).await?;
//! # Ok(()) }
//! ```

mod completions;
mod error;
mod listen;
mod logprobs;
mod metrics;
pub mod params;

use std::sync::atomic::AtomicUsize;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::header;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::json;
use subtle::ConstantTimeEq;

pub use error::ApiError;
pub use listen::serve;
pub use metrics::Metrics;

use crate::engine::{EngineHandle, SpecOptions};

/// How the server presents the model and protects itself.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// The name clients pass as `model` (and `/v1/models` lists).
    pub model_id: String,
    /// Positions a prompt and its completion may take together (at most the model's context).
    pub context: usize,
    /// Requests (one per prompt) running at once; more wait in the queue.
    pub max_running: usize,
    /// Requests that may wait beyond `max_running`; more are refused with 429.
    pub max_queue: usize,
    /// When set, every route but `/health` needs `Authorization: Bearer KEY`.
    pub api_key: Option<String>,
    /// The largest request body accepted, in bytes (larger ones get 413).
    pub max_body_bytes: usize,
    /// How long a client may take to send a request's head, and then its body; slower
    /// clients are disconnected (the head) or answered 408 (the body).
    pub read_timeout: Duration,
    /// Speculative decoding for every request (`kiln serve --spec`).
    pub spec: Option<SpecOptions>,
}

impl ServerConfig {
    pub fn new(model_id: impl Into<String>, context: usize) -> ServerConfig {
        ServerConfig {
            model_id: model_id.into(),
            context,
            max_running: 64,
            max_queue: 256,
            api_key: None,
            max_body_bytes: 4 << 20,
            read_timeout: Duration::from_secs(30),
            spec: None,
        }
    }
}

/// What every handler shares.
pub struct AppState {
    handle: EngineHandle,
    config: ServerConfig,
    metrics: Metrics,
    /// Requests submitted and not yet finished (running and waiting).
    inflight: AtomicUsize,
    /// Token texts for `logprobs`.
    token_texts: logprobs::TokenTexts,
}

/// The server's routes over a running engine handle.
pub fn router(handle: EngineHandle, config: ServerConfig) -> Router {
    let body_limit = config.max_body_bytes;
    let state = Arc::new(AppState {
        handle,
        config,
        metrics: Metrics::default(),
        inflight: AtomicUsize::new(0),
        token_texts: logprobs::TokenTexts::default(),
    });
    let api = Router::new()
        .route("/v1/completions", post(completions::completions))
        .route("/v1/chat/completions", post(completions::chat_completions))
        .route("/v1/models", get(models))
        .route("/metrics", get(metrics))
        .route_layer(middleware::from_fn_with_state(Arc::clone(&state), auth));
    Router::new()
        .merge(api)
        .route("/health", get(health))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(Arc::clone(&state), count))
        .layer(DefaultBodyLimit::max(body_limit))
        .with_state(state)
}

/// Refuses requests without the API key (when one is set); the comparison takes the same
/// time wherever the key differs.
async fn auth(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    if let Some(key) = &st.config.api_key {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.as_bytes().strip_prefix(b"Bearer "))
            .unwrap_or_default();
        if !bool::from(given.ct_eq(key.as_bytes())) {
            return ApiError::unauthorized().into_response();
        }
    }
    next.run(req).await
}

/// Counts responses by status for `/metrics`.
async fn count(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let resp = next.run(req).await;
    st.metrics.count_response(resp.status().as_u16());
    resp
}

async fn not_found(req: Request) -> ApiError {
    ApiError {
        status: axum::http::StatusCode::NOT_FOUND,
        message: format!("no route {} {}", req.method(), req.uri().path()),
        kind: "invalid_request_error",
        param: None,
        code: Some("not_found"),
    }
}

async fn method_not_allowed(req: Request) -> ApiError {
    ApiError {
        status: axum::http::StatusCode::METHOD_NOT_ALLOWED,
        message: format!("{} does not take {}", req.uri().path(), req.method()),
        kind: "invalid_request_error",
        param: None,
        code: Some("method_not_allowed"),
    }
}

async fn models(State(st): State<Arc<AppState>>) -> Json<serde_json::Value> {
    Json(json!({
        "object": "list",
        "data": [{
            "id": st.config.model_id,
            "object": "model",
            "created": 0,
            "owned_by": "kiln",
            "max_model_len": st.config.context,
        }],
    }))
}

async fn health() -> Json<serde_json::Value> {
    Json(json!({"status": "ok"}))
}

async fn metrics(State(st): State<Arc<AppState>>) -> Response {
    let body = st.metrics.render(&st.handle.stats());
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        body,
    )
        .into_response()
}

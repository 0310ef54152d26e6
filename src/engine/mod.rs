//! The engine: what services embed and the binaries call. An [`Engine`] holds one compiled
//! model (weights shared, `Send + Sync`); a [`Session`] owns one KV cache and workspace and
//! generates from it.

pub mod calculator;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::backend::cpu::{BackendError, CpuBackend, CpuOptions, ExecError, PlanKind, TokenRow, Workspace};
use crate::kv::KvCache;
use crate::model::{LoadError, Model, ModelConfig};
use crate::sample::{self, SampleError, SamplingParams};
use crate::tokenizer::{Tokenizer, TokenizerError};

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error(transparent)]
    Exec(#[from] ExecError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error(transparent)]
    Sampling(#[from] SampleError),
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("the prompt has {len} tokens but the context holds {capacity}")]
    PromptTooLong { len: usize, capacity: usize },
}

/// A loaded, compiled model.
pub struct Engine {
    model_path: std::path::PathBuf,
    weight_type: String,
    tokenizer: Tokenizer,
    backend: CpuBackend,
}

impl Engine {
    pub fn load(path: impl AsRef<Path>, opts: CpuOptions) -> Result<Engine, EngineError> {
        let model = Model::load(path.as_ref())?;
        Engine::from_model(model, opts)
    }

    pub fn from_model(model: Model, opts: CpuOptions) -> Result<Engine, EngineError> {
        let backend = CpuBackend::new(&model.config, &model.weights, opts)?;
        Ok(Engine {
            model_path: model.path,
            weight_type: model.weight_type,
            tokenizer: model.tokenizer,
            backend,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        self.backend.config()
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    pub fn backend(&self) -> &CpuBackend {
        &self.backend
    }

    pub fn model_path(&self) -> &Path {
        &self.model_path
    }

    /// How the file stored its weights (`"Q4_1"`, `"bf16"`, ...).
    pub fn weight_type(&self) -> &str {
        &self.weight_type
    }

    /// Token ids generation stops on by default: the model's EOS ids.
    pub fn default_stop_tokens(&self) -> Vec<u32> {
        let mut ids = self.tokenizer.specials.eos_token_ids.clone();
        for id in &self.config().eos_token_ids {
            if !ids.contains(id) {
                ids.push(*id);
            }
        }
        ids
    }

    /// A session whose cache holds `capacity` positions (capped at the model's context).
    pub fn session(self: &Arc<Self>, capacity: usize) -> Session {
        let capacity = capacity.min(self.config().max_position_embeddings).max(1);
        Session {
            kv: self.backend.new_cache(1, capacity),
            engine: Arc::clone(self),
            ws: Workspace::new(),
            logits: Vec::new(),
            tokens: Vec::new(),
            pending: Vec::new(),
        }
    }
}

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    StopToken,
    MaxTokens,
    /// The cache or the model's context is full.
    ContextFull,
    /// The caller's callback asked to stop.
    Cancelled,
}

#[derive(Clone, Debug)]
pub struct GenerateOptions {
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Generation ends after emitting one of these (the stop token is reported, not hidden).
    pub stop_tokens: Vec<u32>,
}

#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Timings {
    pub prefill_tokens: usize,
    #[serde(serialize_with = "ser_ms")]
    pub prefill: Duration,
    /// Forward passes after the prefill (each produces one more token).
    pub decode_tokens: usize,
    #[serde(serialize_with = "ser_ms")]
    pub decode: Duration,
}

fn ser_ms<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64() * 1e3)
}

fn rate(n: usize, d: Duration) -> f64 {
    if d.is_zero() {
        0.0
    } else {
        n as f64 / d.as_secs_f64()
    }
}

impl Timings {
    pub fn prefill_tokens_per_s(&self) -> f64 {
        rate(self.prefill_tokens, self.prefill)
    }

    pub fn decode_tokens_per_s(&self) -> f64 {
        rate(self.decode_tokens, self.decode)
    }
}

#[derive(Clone, Debug)]
pub struct Generation {
    pub tokens: Vec<u32>,
    pub finish_reason: FinishReason,
    pub timings: Timings,
}

/// One conversation's state: its KV cache, workspace and the tokens it holds.
pub struct Session {
    engine: Arc<Engine>,
    kv: KvCache,
    ws: Workspace,
    logits: Vec<f32>,
    tokens: Vec<u32>,
    /// Generated tokens not yet in the cache (the last one of each generation).
    pending: Vec<u32>,
}

impl Session {
    pub fn engine(&self) -> &Arc<Engine> {
        &self.engine
    }

    /// Tokens in the cache.
    pub fn position(&self) -> usize {
        self.kv.len(0)
    }

    pub fn capacity(&self) -> usize {
        self.kv.capacity()
    }

    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Logits of the last step.
    pub fn logits(&self) -> &[f32] {
        &self.logits
    }

    /// Forgets everything after `len` tokens (rollback); the next step continues from there.
    pub fn truncate(&mut self, len: usize) {
        self.kv.truncate(0, len);
        self.tokens.truncate(len);
        self.pending.clear();
    }

    /// Appends tokens (one forward pass) and returns the logits after the last one.
    pub fn feed(&mut self, ids: &[u32]) -> Result<&[f32], EngineError> {
        if ids.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        let start = self.kv.len(0);
        let rows: Vec<TokenRow> = (0..ids.len()).map(|i| TokenRow { slot: 0, pos: start + i }).collect();
        let kind = if ids.len() == 1 { PlanKind::Decode } else { PlanKind::Prefill };
        self.engine
            .backend
            .forward(kind, &mut self.ws, &mut self.kv, ids, &rows, &mut self.logits)?;
        self.tokens.extend_from_slice(ids);
        Ok(&self.logits)
    }

    /// Generates after `prompt` (appended to whatever the session holds). `on_token` sees each
    /// token as it is chosen and may return `false` to stop.
    pub fn generate(
        &mut self,
        prompt: &[u32],
        opts: &GenerateOptions,
        mut on_token: impl FnMut(u32) -> bool,
    ) -> Result<Generation, EngineError> {
        opts.sampling.validate()?;
        if prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        let mut input = std::mem::take(&mut self.pending);
        input.extend_from_slice(prompt);
        let room = self.kv.capacity() - self.kv.len(0);
        if input.len() > room {
            return Err(EngineError::PromptTooLong {
                len: self.kv.len(0) + input.len(),
                capacity: self.kv.capacity(),
            });
        }
        let mut timings = Timings {
            prefill_tokens: input.len(),
            ..Default::default()
        };
        let t0 = Instant::now();
        self.feed(&input)?;
        timings.prefill = t0.elapsed();

        let mut out = Vec::new();
        let t1 = Instant::now();
        let finish_reason = loop {
            if out.len() >= opts.max_tokens {
                break FinishReason::MaxTokens;
            }
            let pos = self.kv.len(0);
            let tok = sample::sample(&self.logits, &opts.sampling, 0, pos as u64);
            out.push(tok);
            if !on_token(tok) {
                break FinishReason::Cancelled;
            }
            if opts.stop_tokens.contains(&tok) {
                break FinishReason::StopToken;
            }
            if out.len() >= opts.max_tokens {
                break FinishReason::MaxTokens;
            }
            if self.kv.len(0) >= self.kv.capacity() {
                break FinishReason::ContextFull;
            }
            self.feed(&[tok])?;
            timings.decode_tokens += 1;
        };
        timings.decode = t1.elapsed();
        // Every break above leaves the last chosen token unfed; it joins the cache with the
        // next input, so a follow-up turn continues the same sequence without a wasted pass.
        if let Some(&last) = out.last() {
            self.pending.push(last);
        }
        Ok(Generation {
            tokens: out,
            finish_reason,
            timings,
        })
    }
}

//! The engine: what services embed and the binaries call, with nanochat's `Engine` as its
//! contract (spec §5–§7).
//!
//! An [`Engine`] is one compiled model, `Send + Sync`, shared by any number of [`Session`]s.
//! A session owns a KV cache (one slot per sample row) and streams [`Step`]s: per step, the
//! token column (one token per row) and the mask column (1 sampled, 0 forced by the tool).

mod backend;
pub mod calculator;
mod collect;
pub mod constraint;
mod cpu_device;
mod cpu_graph;
mod cpu_pool;
#[cfg(feature = "cuda")]
mod cuda_device;
mod device;
mod graph_run;
mod logprobs;
#[cfg(test)]
mod padded_vocab;
mod row;
mod scheduler;
mod sequence;
mod serve;
mod session;
pub mod spec;
mod stop;
mod stream;
mod tools;

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use serde::Serialize;

pub use constraint::{Constraint, ConstraintError, ConstraintFactory, ConstraintSpec};
pub use device::{DecodePath, Device, EngineOptions};
pub use logprobs::TokenLogprobs;
pub use scheduler::{
    Event, Finished, Request, Scheduler, SchedulerStats, ServeError, ServeOptions, Sink,
};
pub use sequence::RequestId;
pub use serve::{EngineHandle, RequestHandle};
pub use session::Session;
pub use spec::{SpecError, SpecMethod, SpecOptions, SpecResult, SpecStats};
pub use stream::Stream;

use crate::backend::cpu::{BackendError, CpuBackend, CpuOptions};
use crate::backend::ExecError;
use crate::kv::{KvDtype, KvError};
use crate::model::{LoadError, Model, ModelConfig};
use crate::sample::{SampleError, SamplingParams};
use crate::tokenizer::{Tokenizer, TokenizerError};
use backend::Backend;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error(transparent)]
    Exec(#[from] ExecError),
    #[cfg(feature = "cuda")]
    #[error(transparent)]
    Cuda(#[from] crate::backend::cuda::CudaError),
    #[error("CUDA was asked for but is not available: {0}")]
    NoCuda(String),
    #[error(transparent)]
    Kv(#[from] KvError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error(transparent)]
    Sampling(#[from] SampleError),
    #[error(transparent)]
    Serve(#[from] ServeError),
    #[error("{0}")]
    Request(String),
    #[error("the serving engine has stopped")]
    Stopped,
    #[error(transparent)]
    Constraint(#[from] ConstraintError),
    #[error(transparent)]
    Spec(#[from] SpecError),
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("the prompt has {len} tokens but the context holds {capacity}")]
    PromptTooLong { len: usize, capacity: usize },
    #[error("num_samples must be ≥ 1")]
    NoSamples,
    #[error("{requested} samples asked of a session with {slots} cache slots")]
    TooManySamples { requested: usize, slots: usize },
}

/// A loaded, compiled model.
pub struct Engine {
    model_path: PathBuf,
    weight_type: String,
    num_params: usize,
    tokenizer: Tokenizer,
    pub(crate) backend: Box<dyn Backend>,
    /// Why [`Device::Auto`] ran on the CPU.
    fallback: Option<String>,
    /// Built on the first constrained request.
    constraints: OnceLock<Arc<ConstraintFactory>>,
}

impl Engine {
    /// Loads a model file or directory onto the device `opts` names (`CpuOptions` alone means
    /// the CPU).
    pub fn load(
        path: impl AsRef<Path>,
        opts: impl Into<EngineOptions>,
    ) -> Result<Engine, EngineError> {
        let model = Model::load(path.as_ref())?;
        Engine::from_model(model, opts)
    }

    pub fn from_model(model: Model, opts: impl Into<EngineOptions>) -> Result<Engine, EngineError> {
        let started = device::start(&model, opts.into())?;
        Ok(Engine::started(model, started))
    }

    /// A test entry point, not a device: `model` on the CPU backend (with `cpu`, f32 caches),
    /// decoding through the CPU stand-in of the CUDA decode graph, which runs up to the ring's
    /// depth of steps ahead of the engine exactly as the device does. The engine's pipelined
    /// decode is tested with it on machines without a GPU; it buys no speed.
    #[doc(hidden)]
    pub fn emulating_graph_decode_on_cpu(
        model: Model,
        cpu: CpuOptions,
    ) -> Result<Engine, EngineError> {
        let started = device::start_graph_emulation(&model, cpu, KvDtype::default())?;
        Ok(Engine::started(model, started))
    }

    fn started(model: Model, started: device::Started) -> Engine {
        Engine {
            num_params: model.weights.num_params(),
            model_path: model.path,
            weight_type: model.weight_type,
            tokenizer: model.tokenizer,
            backend: started.backend,
            fallback: started.fallback,
            constraints: OnceLock::new(),
        }
    }

    pub fn config(&self) -> &ModelConfig {
        self.backend.config()
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The CPU backend, when the engine runs on the CPU.
    pub fn cpu_backend(&self) -> Option<&CpuBackend> {
        self.backend.cpu()
    }

    /// A serving scheduler's KV pool on this engine's device (see [`backend::Backend::new_pool`]).
    pub(crate) fn new_pool(
        &self,
        opts: crate::kv::KvOptions,
        budget: crate::kv::KvBudget,
        capacity: usize,
    ) -> Result<Box<dyn backend::ServingPool>, EngineError> {
        self.backend.new_pool(opts, budget, capacity)
    }

    /// The CUDA backend, when the engine runs on a GPU.
    #[cfg(feature = "cuda")]
    pub fn cuda_backend(&self) -> Option<&crate::backend::cuda::CudaBackend> {
        self.backend.cuda()
    }

    /// One line naming where the engine runs (`CPU (2 threads)`, `CUDA NVIDIA H100 … (megakernel
    /// decode)`).
    pub fn device(&self) -> String {
        self.backend.describe()
    }

    /// The compiled plan of one kind of step (its cost model gives bytes and flops per token).
    pub fn plan(&self, kind: crate::plan::PlanKind) -> &crate::plan::ExecutionPlan {
        self.backend.plan(kind)
    }

    /// Bytes the weights occupy on the engine's device.
    pub fn weight_bytes(&self) -> usize {
        self.backend.weight_bytes()
    }

    /// Whether decode steps run through the graph-replayed megakernel.
    pub fn uses_megakernel(&self) -> bool {
        self.backend.uses_megakernel()
    }

    /// Why an engine loaded with [`Device::Auto`] runs on the CPU (no driver, no GPU, a failed
    /// compile, ...); `None` when it got the device it asked for.
    pub fn fallback_reason(&self) -> Option<&str> {
        self.fallback.as_deref()
    }

    pub fn model_path(&self) -> &Path {
        &self.model_path
    }

    /// Parameters in the model's tensors.
    pub fn num_params(&self) -> usize {
        self.num_params
    }

    /// How the file stored its weights (`"Q4_1"`, `"bf16"`, ...).
    pub fn weight_type(&self) -> &str {
        &self.weight_type
    }

    /// What generation stops on unless told otherwise: the model's EOS ids, plus, as nanochat
    /// does, `<|assistant_end|>` and BOS.
    pub fn default_stop_tokens(&self) -> Vec<u32> {
        let mut ids = self.tokenizer.specials.eos_token_ids.clone();
        ids.extend(self.config().eos_token_ids.iter().copied());
        ids.extend(self.tokenizer.token_to_id("<|assistant_end|>"));
        ids.extend(self.tokenizer.specials.bos_token_id);
        let mut seen = Vec::new();
        ids.retain(|id| {
            let new = !seen.contains(id);
            seen.push(*id);
            new
        });
        ids
    }

    /// The vocabulary as constrained decoding sees it (built on first use, then shared): every
    /// token's bytes, with [`Engine::default_stop_tokens`] as the ids that end a sequence.
    pub fn constraint_factory(&self) -> Result<Arc<ConstraintFactory>, EngineError> {
        if let Some(f) = self.constraints.get() {
            return Ok(Arc::clone(f));
        }
        let built = Arc::new(ConstraintFactory::for_tokenizer(
            &self.tokenizer,
            self.config().vocab_size,
            &self.default_stop_tokens(),
        )?);
        // Two threads may both build it; the first one stored wins.
        Ok(Arc::clone(self.constraints.get_or_init(|| built)))
    }

    /// The most positions a cache can usefully hold.
    pub fn max_context(&self) -> usize {
        self.config().max_position_embeddings
    }

    /// A session with one cache slot of `capacity` positions (capped at the model's context).
    pub fn session(self: &Arc<Self>, capacity: usize) -> Session {
        Session::new(Arc::clone(self), capacity, 1)
    }

    /// Runs `prompt` to completion for `opts.num_samples` rows: the prompt is prefilled once and
    /// its cache copied to every row.
    pub fn generate_batch(
        self: &Arc<Self>,
        prompt: &[u32],
        opts: &GenerateOptions,
    ) -> Result<BatchResult, EngineError> {
        let capacity = opts
            .max_tokens
            .map_or(self.max_context(), |m| prompt.len() + m);
        let mut session = Session::new(Arc::clone(self), capacity, opts.num_samples.max(1));
        session.generate_batch(prompt, opts)
    }
}

/// Why a row stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// It produced one of the stop tokens.
    StopToken,
    /// Its text matched a stop string.
    StopString,
    /// It produced `max_tokens` tokens.
    MaxTokens,
    /// Its cache (or the model's context) is full.
    ContextFull,
    /// The caller stopped it.
    Cancelled,
    /// Its output is a complete match of its constraint and nothing may extend it.
    ConstraintEnd,
    /// Its constraint cannot continue: no token continues the output, or a forced (tool) token
    /// does not. The output is not a complete match.
    ConstraintBroken,
}

#[derive(Clone, Debug)]
pub struct GenerateOptions {
    /// Tokens to generate per row (forced tool tokens count); `None` runs to the context limit.
    pub max_tokens: Option<usize>,
    pub sampling: SamplingParams,
    /// Rows sampled independently from one prefill.
    pub num_samples: usize,
    /// `None` uses [`Engine::default_stop_tokens`].
    pub stop_tokens: Option<Vec<u32>>,
    /// Text that ends a row; the match itself is not emitted.
    pub stop_strings: Vec<String>,
    /// Run the calculator on `<|python_start|>…<|python_end|>` and force its result back into
    /// the stream (only for tokenizers that have those tokens, i.e. nanochat's).
    pub tools: bool,
    /// Adjusts a row's logits before sampling (logit bias, scripted tests).
    pub logits_processor: Option<LogitsProcessor>,
    /// What every row's output must match (JSON schema, regex, grammar); masks the logits
    /// after `logits_processor` and the repetition penalty. On the CPU sampling then runs on
    /// the host masked logits; on a GPU the mask is applied on the device (the mask kernel's
    /// draws match the host's on an H200 and an H100, `tests/gpu.rs`; a whole constrained
    /// session on a GPU has not run: its test needs the demo model there).
    pub constraint: Option<ConstraintSpec>,
    /// `Some(k)`: every step of a row carries the taken token's log-probability and the `k`
    /// most likely tokens' ([`TokenLogprobs`]: the model's raw distribution, before any
    /// adjustment). `None` computes none (they cost a pass over the vocabulary per token).
    /// Sampling then runs on the host.
    pub logprobs: Option<usize>,
}

/// `f(row, context, logits)`: `context` is the row's tokens so far (prompt included).
pub type LogitsFn = dyn Fn(usize, &[u32], &mut [f32]) + Send + Sync;

/// A shared [`LogitsFn`] (cloneable, so options stay `Clone`).
#[derive(Clone)]
pub struct LogitsProcessor(pub Arc<LogitsFn>);

impl std::fmt::Debug for LogitsProcessor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LogitsProcessor(..)")
    }
}

impl GenerateOptions {
    /// Whether a row's choice needs its logits on the host whatever the device can do: a
    /// logits processor, a repetition penalty or log-probabilities (a constraint's mask can be
    /// applied where the logits are).
    pub(crate) fn needs_host_logits(&self) -> bool {
        self.logits_processor.is_some()
            || self.sampling.repetition_penalty.is_some()
            || self.logprobs.is_some()
    }
}

impl Default for GenerateOptions {
    fn default() -> Self {
        GenerateOptions {
            max_tokens: Some(256),
            sampling: SamplingParams::default(),
            num_samples: 1,
            stop_tokens: None,
            stop_strings: Vec::new(),
            tools: true,
            logits_processor: None,
            constraint: None,
            logprobs: None,
        }
    }
}

/// One row's share of a step.
#[derive(Clone, Debug, PartialEq)]
pub struct RowStep {
    pub token: u32,
    /// 1 sampled, 0 forced.
    pub mask: u8,
    /// Text this token completes (stop-string matches and stop tokens excluded).
    pub text: String,
    /// Set on the row's last step.
    pub finished: Option<FinishReason>,
    /// The token's log-probabilities, when [`GenerateOptions::logprobs`] asks for them.
    pub logprobs: Option<TokenLogprobs>,
}

/// One decoding step: an entry per row, `None` for rows that finished earlier.
#[derive(Clone, Debug, PartialEq)]
pub struct Step {
    pub rows: Vec<Option<RowStep>>,
}

impl Step {
    /// The token column (nanochat's `token_column`), `None` for finished rows.
    pub fn tokens(&self) -> Vec<Option<u32>> {
        self.rows
            .iter()
            .map(|r| r.as_ref().map(|r| r.token))
            .collect()
    }

    /// The mask column: 1 sampled, 0 forced (and 0 for finished rows).
    pub fn masks(&self) -> Vec<u8> {
        self.rows
            .iter()
            .map(|r| r.as_ref().map_or(0, |r| r.mask))
            .collect()
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    /// Tokens produced over all rows (forced ones included).
    pub completion_tokens: usize,
    /// Prompt tokens whose cache came from the prefix cache instead of being computed.
    #[serde(skip_serializing_if = "is_zero")]
    pub cached_tokens: usize,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Timings {
    /// Tokens the prefill had to run (a reused cache prefix is not counted).
    pub prefill_tokens: usize,
    #[serde(serialize_with = "ser_ms")]
    pub prefill: Duration,
    /// Decode forward passes (each advances every live row by one token).
    pub decode_steps: usize,
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

    /// Decode passes per second (tokens per second per row).
    pub fn decode_tokens_per_s(&self) -> f64 {
        rate(self.decode_steps, self.decode)
    }
}

/// One row of a finished batch.
#[derive(Clone, Debug, Serialize)]
pub struct RowResult {
    /// Prompt + generated tokens, without a terminal stop token (nanochat's `generate_batch`).
    pub tokens: Vec<u32>,
    /// 0 for the prompt and forced tokens, 1 for sampled ones; aligned with `tokens`.
    pub masks: Vec<u8>,
    /// Generated tokens only (terminal stop token included, if any).
    pub generated: Vec<u32>,
    pub text: String,
    pub finish_reason: FinishReason,
}

#[derive(Clone, Debug, Serialize)]
pub struct BatchResult {
    pub rows: Vec<RowResult>,
    pub usage: Usage,
    pub timings: Timings,
}

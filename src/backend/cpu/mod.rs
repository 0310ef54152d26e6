//! The CPU backend: executes execution plans with SIMD kernels on its own rayon pool (a backend
//! of one thread runs them on the calling thread: the `par` module).
//!
//! Weights are packed once at construction (linears that a pass merged become one matrix; bf16 and
//! quantized blocks stay as stored) and shared by every plan and every session; all per-step memory
//! lives in a [`Workspace`] the caller owns, so one backend serves many concurrent sessions.

pub mod attention;
#[cfg(target_arch = "x86_64")]
mod attention_bf16;
mod elementwise;
mod exec;
pub mod keep_awake;
pub mod matmul;
pub mod norm;
mod pages;
mod par;
mod rope;
pub mod simd;
pub mod stream;
#[cfg(test)]
mod synthetic_models;

use std::collections::HashMap;

pub use exec::Workspace;

use crate::backend::{check_logit_rows, check_step, ExecError, TokenRow};
use crate::graph::build::LogitRows;
use crate::graph::{Linear, Norm, Op};
use crate::kv::{KvBudget, KvCache, KvDtype, KvError, KvOptions};
use crate::model::{DType, LoadError, ModelConfig, Tensor, Weights};
use crate::plan::{compile_graph, ExecutionPlan, Phase, PlanKind};
pub use matmul::Numerics;
use matmul::{Grouped, Interleaved, MatrixPart, PackedMatrix, Pages, WeightArena, WeightData};

/// How linear weights are held in memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WeightFormat {
    /// bf16 stays bf16, f32 stays f32, f16 widens to f32 (exact); ggml blocks (any of
    /// [`crate::model::quant::QuantKind`]) stay in their blocks. A merged linear whose parts
    /// are stored differently (e.g. a Q5_0 q and k beside a Q8_0 v in one qkv) keeps each part
    /// in its own format ([`matmul::WeightData::Parts`]).
    #[default]
    AsStored,
    F32,
    /// Rounded to bf16: half the bytes per token, at bf16 precision.
    BF16,
}

#[derive(Clone, Copy, Debug, Default)]
pub struct CpuOptions {
    /// Threads a step uses; 0 uses every core. With 1, each step runs on the thread that
    /// calls it (no worker: see the `par` module), so steps called from several threads at
    /// once run side by side, each on its caller's thread; with more, on the backend's pool.
    pub threads: usize,
    pub weights: WeightFormat,
    /// How activations meet the weights where rounding them is faster: at the exact path's
    /// accuracy, calls of up to 16 tokens on grouped Q4_0/Q4_1/Q5_0/Q8_0 weights on AVX512-VNNI
    /// CPUs ([`Numerics::Int24`], the default; exact elsewhere); less accurately, decode GEMVs on
    /// quantized weights ([`Numerics::Int16`]), prefill on bf16 weights ([`Numerics::Bf16`]),
    /// every call on Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 weights ([`Numerics::Int8`]); or never
    /// ([`Numerics::Exact`]).
    pub numerics: Numerics,
}

#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error("could not start {threads} CPU worker threads: {reason}")]
    Threads { threads: usize, reason: String },
}

pub struct CpuBackend {
    config: ModelConfig,
    pool: rayon::ThreadPool,
    threads: usize,
    numerics: Numerics,
    prefill: ExecutionPlan,
    decode: ExecutionPlan,
    all_logits: ExecutionPlan,
    matrices: Vec<PackedMatrix>,
    /// Per plan (indexed like [`PlanKind`]) and instruction: the matrix it reads, if any.
    plan_matrices: [Vec<Option<usize>>; 3],
    /// Per plan and instruction: its part in rotating inside attention ([`exec::deferrals`]).
    plan_deferrals: [Vec<exec::Deferral>; 3],
    vectors: HashMap<String, Vec<f32>>,
    inv_freq: Vec<f32>,
    /// The frequencies of `Rope { local: true }` (the graph's `rope_local`); empty when unused.
    inv_freq_local: Vec<f32>,
}

/// The index of the matrix stored under `key`, packing it on first sight.
fn intern(
    matrices: &mut Vec<PackedMatrix>,
    index: &mut HashMap<String, usize>,
    key: String,
    pack: impl FnOnce() -> Result<PackedMatrix, LoadError>,
) -> Result<usize, LoadError> {
    if let Some(&i) = index.get(&key) {
        return Ok(i);
    }
    matrices.push(pack()?);
    index.insert(key, matrices.len() - 1);
    Ok(matrices.len() - 1)
}

impl CpuBackend {
    pub fn new(
        config: &ModelConfig,
        weights: &Weights,
        opts: CpuOptions,
    ) -> Result<CpuBackend, BackendError> {
        let threads = if opts.threads == 0 {
            std::thread::available_parallelism().map_or(1, |n| n.get())
        } else {
            opts.threads
        };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("kiln-cpu-{i}"))
            .build()
            .map_err(|e| BackendError::Threads {
                threads,
                reason: e.to_string(),
            })?;
        let last = compile_graph(config, weights, LogitRows::Last)?;
        let all = compile_graph(config, weights, LogitRows::All)?;
        let prefill = ExecutionPlan::lower(last.clone(), Phase::Prefill);
        let decode = ExecutionPlan::lower(last, Phase::Decode);
        let all_logits = ExecutionPlan::lower(all, Phase::Prefill);
        let inv_freq = crate::graph::rope::inv_freq(&prefill.graph.rope);
        let inv_freq_local = prefill
            .graph
            .rope_local
            .as_ref()
            .map_or_else(Vec::new, crate::graph::rope::inv_freq);

        // Pack every distinct weight once; each plan instruction then names its matrix by index, so
        // a step never builds a key or hashes a name to find its weights. `Numerics::Int8` regroups
        // the Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 blocks for its kernels, where the CPU has them (elsewhere
        // those weights run exact); on AVX-512 and AVX2 CPUs every other block matrix that runs
        // exact decode (exact and bf16 numerics, and int8's Q4_K and Q6_K) is regrouped for the
        // exact grouped kernels (`matmul::grouped`). (Int8 engines kept their K-quant matrices
        // as stored until 2026-12-03: Qwen2.5-Coder-0.5B Q4_K_M's down projection then took 6.9
        // ms a decode step against 4.4 in exact engines, on a Zen 3 at two threads.)
        // `Numerics::Int16` keeps the blocks as stored, which its kernels read, except on
        // AVX512-VNNI CPUs: there its Q4_0/Q4_1/Q5_0/Q8_0 products run on grouped weights
        // (`matmul::grouped_i16`) and its other formats run the exact grouped kernels, which
        // outran its kernels on the blocks as stored.
        // Every matrix on huge pages, the small ones sharing them (see `pages`).
        let interleave = opts.numerics == Numerics::Int8 && matmul::int8_kernels();
        let mut packer = Packer {
            format: opts.weights,
            interleave,
            group: (opts.numerics != Numerics::Int16 || matmul::int16_grouped_kernels())
                && simd::level() >= simd::Level::Avx2,
            integer: matmul::integer_layouts(opts.numerics),
            arena: WeightArena::new(),
        };
        let mut matrices: Vec<PackedMatrix> = Vec::new();
        let mut index: HashMap<String, usize> = HashMap::new();
        let mut vectors = HashMap::new();
        let mut plan_matrices: [Vec<Option<usize>>; 3] = Default::default();
        for (slot, plan) in [&prefill, &decode, &all_logits].into_iter().enumerate() {
            for ins in &plan.instrs {
                let m = match &ins.op {
                    Op::Embed { table, .. } => {
                        // Only ids below vocab_size reach a table (`check_step`), so a padded
                        // table keeps its first vocab_size rows: the same rows a tied LM head
                        // uses, which then shares this matrix.
                        let stored = weights.get(table)?.shape.first().copied().unwrap_or(0);
                        let rows = stored.min(config.vocab_size);
                        Some(intern(&mut matrices, &mut index, table.clone(), || {
                            // A tied LM head is this matrix: regrouped like the others.
                            pack(weights, &[(table.clone(), None, rows)], &mut packer)
                        })?)
                    }
                    Op::GatedValueAdd { gate, .. } | Op::Smear { gate, .. } => {
                        vectors.insert(gate.clone(), weights.get(gate)?.to_f32_vec());
                        None
                    }
                    Op::MatMul { linears, norm, .. } => {
                        if let Some(w) = norm.as_ref().and_then(|n| n.weight.as_ref()) {
                            vectors.insert(w.clone(), weights.get(w)?.to_f32_vec());
                        }
                        Some(intern(
                            &mut matrices,
                            &mut index,
                            Linear::key(linears),
                            || {
                                let parts: Vec<(String, Option<String>, usize)> = linears
                                    .iter()
                                    .map(|l| (l.weight.clone(), l.bias.clone(), l.out))
                                    .collect();
                                pack(weights, &parts, &mut packer)
                            },
                        )?)
                    }
                    Op::RmsNorm(Norm {
                        weight: Some(w), ..
                    })
                    | Op::HeadNorm {
                        weight: Some(w), ..
                    } => {
                        vectors.insert(w.clone(), weights.get(w)?.to_f32_vec());
                        None
                    }
                    _ => None,
                };
                plan_matrices[slot].push(m);
            }
        }
        release_load_garbage();
        let plan_deferrals = [&prefill, &decode, &all_logits].map(exec::deferrals);
        Ok(CpuBackend {
            config: config.clone(),
            pool,
            threads,
            numerics: opts.numerics,
            prefill,
            decode,
            all_logits,
            matrices,
            plan_matrices,
            plan_deferrals,
            vectors,
            inv_freq,
            inv_freq_local,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    pub fn threads(&self) -> usize {
        self.threads
    }

    pub fn numerics(&self) -> Numerics {
        self.numerics
    }

    pub fn plan(&self, kind: PlanKind) -> &ExecutionPlan {
        match kind {
            PlanKind::Prefill => &self.prefill,
            PlanKind::Decode => &self.decode,
            PlanKind::AllLogits => &self.all_logits,
        }
    }

    /// Bytes of packed weights (what a decode step streams from memory).
    pub fn weight_bytes(&self) -> usize {
        self.matrices.iter().map(PackedMatrix::bytes).sum::<usize>()
            + self.vectors.values().map(|v| v.len() * 4).sum::<usize>()
    }

    /// A KV cache shaped for this model: `slots` sequences of up to `capacity` positions
    /// (memory is taken as positions are written).
    pub fn new_cache(&self, slots: usize, capacity: usize) -> Result<KvCache, KvError> {
        KvCache::new(self.prefill.graph.kv, slots, capacity)
    }

    /// [`CpuBackend::new_cache`] with keys and values stored as `dtype`.
    pub fn new_cache_of(
        &self,
        dtype: KvDtype,
        slots: usize,
        capacity: usize,
    ) -> Result<KvCache, KvError> {
        KvCache::new_of(self.prefill.graph.kv, dtype, slots, capacity)
    }

    /// An empty serving cache (slots opened per sequence) over a pool sized by `budget`.
    pub fn new_pool(
        &self,
        opts: KvOptions,
        budget: KvBudget,
        capacity: usize,
    ) -> Result<KvCache, KvError> {
        KvCache::with_budget(self.prefill.graph.kv, opts, budget, capacity)
    }

    /// Runs one step: appends `tokens` (placed by `rows`) to the cache and writes logits, one
    /// row of `vocab_size` per sequence (or per token for [`PlanKind::AllLogits`]), to `logits`.
    /// Returns the number of logit rows.
    pub fn forward(
        &self,
        kind: PlanKind,
        ws: &mut Workspace,
        kv: &mut KvCache,
        tokens: &[u32],
        rows: &[TokenRow],
        logits: &mut Vec<f32>,
    ) -> Result<usize, ExecError> {
        self.forward_rows(kind, ws, kv, tokens, rows, None, logits)
    }

    /// [`CpuBackend::forward`] with logits for the rows `logit_rows` names (increasing indices
    /// into `rows`) instead of the last row of each sequence: what a step needs when one
    /// sequence verifies several proposed tokens (a logit row each) beside others that want
    /// one. Runs the prefill plan; each row's logits are computed as in any other step.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_selected(
        &self,
        ws: &mut Workspace,
        kv: &mut KvCache,
        tokens: &[u32],
        rows: &[TokenRow],
        logit_rows: &[usize],
        logits: &mut Vec<f32>,
    ) -> Result<usize, ExecError> {
        check_logit_rows(logit_rows, tokens.len())?;
        let kind = PlanKind::Prefill;
        self.forward_rows(kind, ws, kv, tokens, rows, Some(logit_rows), logits)
    }

    #[allow(clippy::too_many_arguments)]
    fn forward_rows(
        &self,
        kind: PlanKind,
        ws: &mut Workspace,
        kv: &mut KvCache,
        tokens: &[u32],
        rows: &[TokenRow],
        logit_rows: Option<&[usize]>,
        logits: &mut Vec<f32>,
    ) -> Result<usize, ExecError> {
        let next = check_step(
            self.config.vocab_size,
            tokens,
            rows,
            kv.slots(),
            kv.capacity(),
            |slot| kv.len(slot),
        )?;
        for (&slot, &end) in &next {
            kv.prepare(slot, end)?;
        }
        let plan = self.plan(kind);
        let mats = &self.plan_matrices[kind as usize];
        let deferrals = &self.plan_deferrals[kind as usize];
        let step = || {
            exec::run(
                self, plan, mats, deferrals, ws, kv, tokens, rows, logit_rows, logits,
            )
        };
        // One thread: the step runs here, its loops in order ([`par`]), with no hand-over to
        // the pool and back.
        let n = if self.threads == 1 {
            par::serially(step)
        } else {
            self.pool.install(|| keep_awake::during(self.threads, step))
        };
        for (&slot, &end) in &next {
            let len = kv.len(slot);
            kv.advance(slot, end - len);
        }
        Ok(n)
    }
}

/// How the backend packs its weights, and where.
struct Packer {
    format: WeightFormat,
    /// Regroup the Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 blocks for `Numerics::Int8`'s kernels.
    interleave: bool,
    /// Regroup the Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q6_K blocks that `interleave` leaves for the
    /// exact AVX-512 and AVX2 kernels.
    group: bool,
    /// Group them for the integer kernels of int16 and int24 ([`matmul::integer_layouts`]).
    integer: bool,
    arena: WeightArena,
}

/// Packs one or more linears (rows concatenated) into the backend's matrix format. Each part is
/// `(weight, bias, rows)`: the first `rows` rows of the weight are used (a padded vocabulary's
/// head keeps only the real tokens).
fn pack(
    weights: &Weights,
    parts: &[(String, Option<String>, usize)],
    packer: &mut Packer,
) -> Result<PackedMatrix, LoadError> {
    let format = packer.format;
    let tensors = parts
        .iter()
        .map(|(w, _, _)| weights.get(w))
        .collect::<Result<Vec<_>, _>>()?;
    let cols = tensors[0].shape.last().copied().unwrap_or(0);
    for t in &tensors {
        if t.shape.len() != 2 || t.shape[1] != cols || t.shape[0] == 0 {
            return Err(LoadError::tensor(
                &weights.source,
                &t.name,
                format!(
                    "expected a matrix with {cols} columns, found shape {:?}",
                    t.shape
                ),
            ));
        }
    }
    for ((_, _, r), t) in parts.iter().zip(&tensors) {
        if *r > t.shape[0] {
            return Err(LoadError::tensor(
                &weights.source,
                &t.name,
                format!("{r} rows needed, {} stored", t.shape[0]),
            ));
        }
    }
    let rows: usize = parts.iter().map(|p| p.2).sum();
    let same_dtype = tensors.iter().all(|t| t.dtype == tensors[0].dtype);
    let data = if format == WeightFormat::AsStored && !same_dtype {
        // Each part as it would be stored alone: quantized parts keep their own formats.
        let parts = tensors
            .iter()
            .zip(parts)
            .map(|(t, p)| {
                Ok(MatrixPart {
                    rows: p.2,
                    data: pack_data(weights, &[(*t, p.2)], cols, packer)?,
                })
            })
            .collect::<Result<Vec<_>, LoadError>>()?;
        WeightData::Parts(parts)
    } else {
        let rows_of: Vec<_> = tensors.iter().zip(parts).map(|(&t, p)| (t, p.2)).collect();
        pack_data(weights, &rows_of, cols, packer)?
    };
    data.check_shape(rows, cols)
        .map_err(|e| LoadError::tensor(&weights.source, &tensors[0].name, e))?;
    let bias = if parts.iter().any(|(_, b, _)| b.is_some()) {
        let mut v = Vec::with_capacity(rows);
        for (_, b, r) in parts {
            match b {
                Some(name) => v.extend(weights.get(name)?.to_f32_vec().into_iter().take(*r)),
                None => v.extend(std::iter::repeat_n(0.0, *r)),
            }
        }
        Some(v)
    } else {
        None
    };
    Ok(PackedMatrix {
        rows,
        cols,
        data,
        bias,
    })
}

/// The first `rows` rows of each tensor, concatenated, in one format: `format`'s, where stored
/// as is a block format the tensors share stays in its blocks (they never cross rows, so
/// concatenating rows concatenates bytes), bf16 stays bf16 and anything else widens to f32.
fn pack_data(
    weights: &Weights,
    tensors: &[(&Tensor, usize)],
    cols: usize,
    packer: &mut Packer,
) -> Result<WeightData, LoadError> {
    let (format, arena) = (packer.format, &mut packer.arena);
    let first = tensors[0].0;
    let shared = tensors.iter().all(|(t, _)| t.dtype == first.dtype);
    let quant = match format {
        WeightFormat::AsStored => first.dtype.quant().filter(|_| shared),
        WeightFormat::F32 | WeightFormat::BF16 => None,
    };
    let use_bf16 = match format {
        WeightFormat::BF16 => true,
        WeightFormat::F32 => false,
        WeightFormat::AsStored => tensors.iter().all(|(t, _)| t.dtype == DType::BF16),
    };
    Ok(if let Some(kind) = quant {
        let row_bytes = first.dtype.row_bytes(cols);
        let mut rows = Vec::with_capacity(tensors.len());
        for (t, r) in tensors {
            let raw = t.raw();
            let want = r.checked_mul(row_bytes).filter(|&w| w <= raw.len());
            let Some(want) = want else {
                return Err(LoadError::tensor(
                    &weights.source,
                    &t.name,
                    format!("{} bytes stored, {r} rows of {row_bytes} needed", raw.len()),
                ));
            };
            rows.push(&raw[..want]);
        }
        let regroup = (packer.interleave && matmul::interleavable(kind))
            || (packer.group && matmul::groupable(kind));
        if regroup {
            // Regrouped straight from the file's blocks: the arena never holds them as stored.
            let joined;
            let blocks: &[u8] = match rows.as_slice() {
                [one] => one,
                _ => {
                    joined = rows.concat();
                    &joined
                }
            };
            let n: usize = tensors.iter().map(|(_, r)| r).sum();
            matmul::check_blocks(kind, blocks.len(), n, cols)
                .map_err(|e| LoadError::tensor(&weights.source, &first.name, e))?;
            if packer.interleave && matmul::interleavable(kind) {
                WeightData::Interleaved(Interleaved::new(kind, n, cols, blocks, arena))
            } else {
                let integer = packer.integer;
                WeightData::Grouped(Grouped::new(kind, (n, cols), blocks, integer, arena))
            }
        } else {
            WeightData::Quant {
                kind,
                blocks: arena.copy(&rows),
            }
        }
    } else if use_bf16 {
        WeightData::BF16(widened(arena, tensors, cols, Tensor::to_bf16_vec))
    } else {
        WeightData::F32(widened(arena, tensors, cols, Tensor::to_f32_vec))
    })
}

/// The first `rows` rows of each tensor converted by `convert`, concatenated in `arena`.
fn widened<T: bytemuck::Pod>(
    arena: &mut WeightArena,
    tensors: &[(&Tensor, usize)],
    cols: usize,
    convert: impl Fn(&Tensor) -> Vec<T>,
) -> Pages<T> {
    let parts: Vec<Vec<T>> = tensors
        .iter()
        .map(|(t, r)| {
            let mut v = convert(t);
            v.truncate(r.saturating_mul(cols));
            v
        })
        .collect();
    arena.copy(&parts.iter().map(Vec::as_slice).collect::<Vec<_>>())
}

/// Hands the heap memory freed while packing (widened copies, staging buffers) back to the
/// system: the weights now live in the arena's chunks, and without this glibc keeps the freed
/// pages of the heap resident (a Qwen2.5-Coder-0.5B Q4_K_M load in kiln-bench: anonymous
/// resident memory 637 MB without it, 538 MB with it; 542 MB before the arena).
fn release_load_garbage() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free heap pages to the kernel.
    unsafe {
        libc::malloc_trim(0);
    }
}

//! Driver discovery and the [`CudaBackend`] plan executor.
//!
//! Ran on an H200 (docs/gpu-results.md): logits within bf16 tolerance of the CPU on every test
//! fixture (prefill at every prompt position and 16 decode steps, relative L2 error 3.3e-3 to
//! 9.8e-3), 128 greedy SmolLM2-135M tokens identical to the CPU's, compute-sanitizer's memcheck
//! clean on a fixture. What it does, and what `tests/gpu.rs` checks on a GPU machine: execute the
//! same [`ExecutionPlan`]s as the CPU backend, a kernel per instruction (GEMV for few rows, the
//! tiled GEMM for prefill), with weights uploaded once as bf16, the plan's buffers in a device
//! arena ([`CudaWorkspace`]), and a bf16 KV cache on the device ([`CudaKvCache`]). Prefill matmuls
//! (more than 8 token rows) go through cuBLAS (`cublasGemmEx`, bf16 operands, f32 output and
//! accumulation) when libcublas loads, else through kiln's `gemm_bf16`.
//! [`CudaBackend::forward_sample`] samples on the device and returns only tokens. The decode
//! megakernel with CUDA-graph replay is [`super::GraphDecoder`].

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use cudarc::cublas::CudaBlas;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg,
};

use super::gemm_args::{prefill_gemm, Trans};
use super::graph::MegakernelCache;
use super::graph_host::{row_control, row_words, GraphError};
use super::kernels::SOURCES;
use super::nvrtc::{self, NvrtcError};
use super::trace::{traced, Phase as TracePhase};
use super::upload::Staging;
use crate::backend::{last_of_each_sequence, ExecError, RowDraw, TokenRow};
use crate::graph::build::LogitRows;
use crate::graph::{Activation, Epilogue, KvSpec, Linear, Op, Rows};
use crate::kv::{KvBudget, KvCache, KvDtype, KvError, KvLayout, KvOptions, DEFAULT_BLOCK_SIZE};
use crate::model::{LoadError, ModelConfig, RopeStyle, Weights};
use crate::plan::{compile_graph, PlanKind};
use crate::plan::{ExecutionPlan, Phase, Slot};
use crate::sample::SamplingParams;

/// What the GPU is.
#[derive(Clone, Debug)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    pub sms: u32,
    pub memory_bytes: usize,
    pub compute_capability: (i32, i32),
}

impl std::fmt::Display for DeviceInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} (sm_{}{}, {} SMs, {:.1} GiB)",
            self.name,
            self.compute_capability.0,
            self.compute_capability.1,
            self.sms,
            self.memory_bytes as f64 / (1u64 << 30) as f64
        )
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error("no CUDA driver (libcuda.so not found)")]
    NoDriver,
    #[error("no CUDA device ({0})")]
    NoDevice(String),
    #[error("CUDA driver error: {0}")]
    Driver(String),
    #[error(transparent)]
    Nvrtc(#[from] NvrtcError),
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error(transparent)]
    Exec(#[from] ExecError),
    #[error("the CUDA backend does not support this model: {0}")]
    Unsupported(String),
    #[error(transparent)]
    Graph(#[from] GraphError),
    #[error("cuBLAS: {0}")]
    Cublas(String),
    #[error("{got} row ids for {want} rows of logits")]
    RowIds { got: usize, want: usize },
    #[error("KV cache slot {slot} out of range (the cache has {slots} slots)")]
    Slot { slot: usize, slots: usize },
    #[error("{len} positions do not fit a cache slot of {what} {have}")]
    Len {
        len: usize,
        what: &'static str,
        have: usize,
    },
}

pub(super) fn drv<E: std::fmt::Debug>(e: E) -> CudaError {
    CudaError::Driver(format!("{e:?}"))
}

/// Finds device 0 without panicking: checks that libcuda and NVRTC load before cudarc is used.
/// Returns `NoDriver` on a machine without a driver (tested there); the success path ran on an
/// H200 (docs/gpu-results.md).
pub fn probe() -> Result<(Arc<CudaContext>, DeviceInfo), CudaError> {
    // SAFETY: only probes dlopen with cudarc's candidate library names.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(CudaError::NoDriver);
    }
    nvrtc::ensure_loaded()?;
    let n = CudaContext::device_count().map_err(|e| CudaError::NoDevice(format!("{e:?}")))?;
    if n < 1 {
        return Err(CudaError::NoDevice("the driver reports 0 devices".into()));
    }
    let ctx = CudaContext::new(0).map_err(|e| CudaError::NoDevice(format!("{e:?}")))?;
    let sms = ctx
        .attribute(
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )
        .map_err(drv)?;
    let info = DeviceInfo {
        ordinal: 0,
        name: ctx.name().map_err(drv)?,
        sms: sms.max(1) as u32,
        memory_bytes: ctx.total_mem().map_err(drv)?,
        compute_capability: ctx.compute_capability().map_err(drv)?,
    };
    Ok((ctx, info))
}

pub(super) struct DevMatrix {
    pub(super) rows: usize,
    pub(super) cols: usize,
    /// bf16 bits, row-major `[rows, cols]`.
    pub(super) w: CudaSlice<u16>,
    pub(super) bias: Option<CudaSlice<f32>>,
}

/// The KV cache on the device: a block pool in the one layout of [`crate::kv::layout`]
/// (`cuda/kv.cuh` mirrors it), bf16 K and V `[block][layer][kv_head][block_size][head_dim]` and
/// f32 state `[block][block_size][state_dim]`, allocated whole: `slots × blocks_for(capacity)`
/// blocks, so every slot can always hold its capacity whatever the others hold.
///
/// The bookkeeping is a host [`KvCache`] without data ([`KvCache::tables_only`]): page tables,
/// reference counts, copy-on-write and shared slots work exactly as on the CPU; the device
/// holds only the data, and replays the block copies the host's copy-on-write makes
/// ([`CudaKvCache::make_writable`]). Kernels get every slot's page table as one device array
/// (`int32 [slots][max_blocks]`, see [`CudaKvCache::device_tables`]).
///
/// The device memory is shared (`Arc`) with the [`super::GraphDecoder`]s captured for this
/// cache: a decoder keeps it alive until its in-flight steps have finished, whatever order the
/// owner drops the two in. Ran on an H200 under `tests/gpu.rs` and `tests/gpu_engine.rs`
/// (docs/gpu-results.md); `tests/gpu.rs` always drops a decoder before its cache, so the other
/// order has no GPU test of its own.
pub struct CudaKvCache {
    pub(super) spec: KvSpec,
    pub(super) host: KvCache,
    /// Page-table entries per slot: blocks of one slot at capacity.
    pub(super) max_blocks: usize,
    pub(super) k: Arc<CudaSlice<u16>>,
    pub(super) v: Arc<CudaSlice<u16>>,
    pub(super) state: Arc<CudaSlice<f32>>,
}

impl CudaKvCache {
    pub fn len(&self, slot: usize) -> usize {
        self.host.len(slot)
    }
    pub fn is_empty(&self, slot: usize) -> bool {
        self.host.is_empty(slot)
    }
    pub fn slots(&self) -> usize {
        self.host.slots()
    }
    pub fn capacity(&self) -> usize {
        self.host.capacity()
    }
    /// The layout the device memory follows.
    pub fn layout(&self) -> &KvLayout {
        self.host.layout()
    }
    /// The blocks of `slot`, in position order.
    pub fn page_table(&self, slot: usize) -> &[u32] {
        self.host.page_table(slot)
    }
    /// The host-side bookkeeping (page tables, reference counts).
    pub fn tables(&self) -> &KvCache {
        &self.host
    }

    /// The host-side bookkeeping, for changes that move no data on the device (opening,
    /// closing, sharing or truncating slots, the prefix cache, confirmed lengths). Making
    /// positions writable must go through [`CudaKvCache::prepare`], which also copies shared
    /// blocks on the device.
    pub(crate) fn tables_mut(&mut self) -> &mut KvCache {
        &mut self.host
    }
    pub(super) fn lens(&self) -> Vec<usize> {
        (0..self.slots()).map(|s| self.len(s)).collect()
    }

    /// A new empty slot (a closed one reused) for a sequence: its page table grows from the
    /// shared pool as positions are written.
    pub fn open_slot(&mut self) -> usize {
        self.host.open_slot()
    }

    /// Gives a finished sequence's blocks back to the pool (those it shares stay with their
    /// other owners). No decode graph may have it in an active row (`GraphDecoder::leave` it
    /// and read the steps in flight first); nothing on the device is cleared.
    pub fn close_slot(&mut self, slot: usize) {
        self.host.close_slot(slot);
    }

    /// Forgets positions from `len` on; blocks wholly past it go back to the pool (nothing on
    /// the device is cleared).
    pub fn truncate(&mut self, slot: usize, len: usize) {
        self.host.truncate(slot, len);
    }

    /// Marks `len` positions of `slot` as cached: the engine confirms the positions a decode
    /// graph wrote once it has consumed their tokens (the graph itself never changes lengths).
    /// Public (the contract said `pub(crate)`) so `tests/gpu.rs` can drive a [`super::GraphDecoder`]
    /// the way the engine does. Panics, like indexing, if `slot` is out of range or `len` is past
    /// the blocks the slot holds (a started graph holds them up to the capacity): a caller's
    /// bug, not input.
    pub fn set_len(&mut self, slot: usize, len: usize) {
        self.host.set_len(slot, len);
    }

    /// Makes slot `to` hold the first `len` positions of slot `from` (one prefill, many
    /// samples) by sharing `from`'s blocks, as [`KvCache::copy_slot`]: nothing is copied now;
    /// the shared partial block is copied on the device when either slot first writes to it.
    /// `to`'s length becomes `len`. `_backend` is kept so the call reads as before (no device
    /// work is needed).
    pub fn copy_slot(
        &mut self,
        _backend: &CudaBackend,
        from: usize,
        to: usize,
        len: usize,
    ) -> Result<(), CudaError> {
        let slots = self.slots();
        for slot in [from, to] {
            if slot >= slots {
                return Err(CudaError::Slot { slot, slots });
            }
        }
        if len > self.len(from) {
            return Err(CudaError::Len {
                len,
                what: "with cached length",
                have: self.len(from),
            });
        }
        if from != to {
            self.host.copy_slot(from, to, len);
        }
        Ok(())
    }

    /// Makes positions `start..end` of `slot` writable (blocks added, shared blocks copied:
    /// the device copies are enqueued on `stream`, ordered before the writes that follow).
    pub(super) fn make_writable(
        &mut self,
        stream: &CudaStream,
        slot: usize,
        start: usize,
        end: usize,
    ) -> Result<(), CudaError> {
        let copies = self
            .host
            .make_writable(slot, start, end)
            .map_err(|e| CudaError::Exec(ExecError::from(e)))?;
        self.replay_copies(stream, &copies)
    }

    /// Makes positions from `slot`'s length up to `end` writable, as [`KvCache::prepare`] does
    /// on the CPU, with the copy-on-write copies replayed on the backend's stream (before any
    /// later step's kernels). The bookkeeping's refusal (the pool exhausted, the capacity
    /// passed) is the inner error, so a scheduler can preempt; a failed copy is the outer one.
    /// The serving scheduler's; on an H200 it ran under
    /// `tests/gpu_engine.rs::scheduler_on_the_gpu_matches_each_request_alone` (prefix hits and
    /// preemptions included, docs/gpu-results.md run 10).
    pub fn prepare(
        &mut self,
        backend: &CudaBackend,
        slot: usize,
        end: usize,
    ) -> Result<Result<(), KvError>, CudaError> {
        let start = self.len(slot);
        let copies = match self.host.make_writable(slot, start, end) {
            Ok(c) => c,
            Err(e) => return Ok(Err(e)),
        };
        self.replay_copies(&backend.stream, &copies)?;
        Ok(Ok(()))
    }

    /// Enqueues the device copies of the host bookkeeping's copy-on-write `copies` on `stream`.
    fn replay_copies(&self, stream: &CudaStream, copies: &[(u32, u32)]) -> Result<(), CudaError> {
        if copies.is_empty() {
            return Ok(());
        }
        let l = *self.layout();
        // The raw copies below do not make the context current themselves (cudarc's safe calls
        // do); a serving scheduler calls this from its own thread.
        stream.context().bind_to_thread().map_err(drv)?;
        let cu = stream.cu_stream();
        let (k0, v0) = (self.k.device_ptr(stream).0, self.v.device_ptr(stream).0);
        let s0 = self.state.device_ptr(stream).0;
        for (src, dst) in block_copies(&l, copies) {
            let (base, bytes) = match src.array {
                BlockArray::K => (k0, src.bytes),
                BlockArray::V => (v0, src.bytes),
                BlockArray::State => (s0, src.bytes),
            };
            // SAFETY: both ranges are whole blocks of the pool's arrays (`block_copies` stays
            // within `num_blocks` blocks of the layout the arrays were allocated for), distinct
            // blocks (copy-on-write copies into a fresh one), ordered on the stream the cache is
            // used on.
            unsafe {
                cudarc::driver::result::memcpy_dtod_async(base + dst, base + src.offset, bytes, cu)
            }
            .map_err(drv)?;
        }
        Ok(())
    }

    /// Every slot's page table as the kernels read it: `[slots][max_blocks]` int32, -1 past a
    /// slot's blocks (a read there is a bug and faults rather than reading another sequence).
    pub fn device_tables(&self) -> Vec<i32> {
        let slots: Vec<usize> = (0..self.slots()).collect();
        page_tables(&self.host, &slots, self.max_blocks)
    }
}

/// The host bookkeeping of a device pool for `spec`: bf16 blocks of [`DEFAULT_BLOCK_SIZE`]
/// positions, as many as `budget` allows (its layout's `num_blocks`, what the device arrays are
/// allocated for), slots of up to `capacity` positions, none open.
pub(super) fn pool_tables(
    spec: KvSpec,
    budget: KvBudget,
    capacity: usize,
) -> Result<KvCache, CudaError> {
    let opts = KvOptions {
        block_size: DEFAULT_BLOCK_SIZE,
        dtype: KvDtype::Bf16,
    };
    KvCache::tables_only(spec, opts, budget, capacity)
        .map_err(|e| CudaError::Exec(ExecError::from(e)))
}

/// The page tables of `slots` (in that order) as kernels read them: `max_blocks` int32 entries
/// each, -1 past a slot's blocks.
pub(super) fn page_tables(host: &KvCache, slots: &[usize], max_blocks: usize) -> Vec<i32> {
    let mut out = vec![-1i32; slots.len() * max_blocks];
    for (row, &s) in out.chunks_exact_mut(max_blocks.max(1)).zip(slots) {
        for (d, &b) in row.iter_mut().zip(host.page_table(s)) {
            *d = b as i32;
        }
    }
    out
}

/// Which array of the pool a block copy moves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum BlockArray {
    K,
    V,
    State,
}

/// One byte range of a block copy's source.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct BlockRange {
    pub(super) array: BlockArray,
    pub(super) offset: u64,
    pub(super) bytes: usize,
}

/// The byte ranges `(source, destination offset)` that copy blocks `(from, to)` of a bf16 pool
/// in layout `l`: a block is one contiguous run of each array (K, V, and the state when the
/// layout has one).
pub(super) fn block_copies(l: &KvLayout, copies: &[(u32, u32)]) -> Vec<(BlockRange, u64)> {
    let mut out = Vec::new();
    let kv_bytes = l.block_elems() * 2;
    let state_bytes = l.block_size * l.state_dim * 4;
    for &(from, to) in copies {
        let (from, to) = (from as usize, to as usize);
        for array in [BlockArray::K, BlockArray::V] {
            let at = |b: usize| (l.head_block(0, b, 0) * 2) as u64;
            out.push((
                BlockRange {
                    array,
                    offset: at(from),
                    bytes: kv_bytes,
                },
                at(to),
            ));
        }
        if state_bytes > 0 {
            let at = |b: usize| (l.state_row(b, 0) * 4) as u64;
            out.push((
                BlockRange {
                    array: BlockArray::State,
                    offset: at(from),
                    bytes: state_bytes,
                },
                at(to),
            ));
        }
    }
    out
}

/// Per-session device memory: the plan's buffers and kernel scratch, grown to the largest step.
#[derive(Default)]
pub struct CudaWorkspace {
    buffers: Vec<Option<CudaSlice<f32>>>,
    scratch: HashMap<&'static str, CudaSlice<f32>>,
    ints: HashMap<&'static str, CudaSlice<i32>>,
}

impl CudaWorkspace {
    pub fn new() -> CudaWorkspace {
        CudaWorkspace::default()
    }
}

/// Executes kiln's execution plans on one GPU (run on an H200: see the module docs).
pub struct CudaBackend {
    pub(super) info: DeviceInfo,
    pub(super) ctx: Arc<CudaContext>,
    pub(super) stream: Arc<CudaStream>,
    funcs: HashMap<&'static str, CudaFunction>,
    config: ModelConfig,
    prefill: ExecutionPlan,
    pub(super) decode: ExecutionPlan,
    all_logits: ExecutionPlan,
    pub(super) matrices: HashMap<String, DevMatrix>,
    pub(super) vectors: HashMap<String, CudaSlice<f32>>,
    pub(super) inv_freq: CudaSlice<f32>,
    /// `Rope { local: true }`'s frequencies (the graph's `rope_local`).
    pub(super) inv_freq_local: CudaSlice<f32>,
    /// `sm_XY` as the number XY, and the CUDA headers, for compiling the megakernel.
    pub(super) arch: u32,
    pub(super) include: PathBuf,
    /// cuBLAS for prefill matmuls; `None` when libcublas is absent (kiln's `gemm_bf16` then).
    blas: Option<CudaBlas>,
    /// The decode megakernel's weight tables, compiled modules and launch stream.
    pub(super) mk: MegakernelCache,
}

const BLOCK: u32 = 256;

fn cfg(grid: (u32, u32, u32), block: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: grid,
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn div(a: usize, b: usize) -> u32 {
    a.div_ceil(b) as u32
}

/// CUDA's limit on `gridDim.y` (every architecture). Kernels with one block row per token row
/// (grid `(…, rows)`) are launched once per chunk of at most this many rows: a prefill of more
/// tokens would otherwise fail to launch.
const MAX_GRID_Y: usize = 65535;

/// `(first row, rows)` of each launch covering `rows` token rows, `MAX_GRID_Y` at most each.
fn row_chunks(rows: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..rows)
        .step_by(MAX_GRID_Y)
        .map(move |s| (s, (rows - s).min(MAX_GRID_Y)))
}

/// Device pointer `p` (elements of `elem` bytes, rows of `stride` elements) moved to row `row`;
/// a null pointer (an absent operand) stays null.
fn row_at(p: u64, stride: i32, elem: usize, row: usize) -> u64 {
    if p == 0 {
        0
    } else {
        p + (row * stride as usize * elem) as u64
    }
}

fn act_code(a: Activation) -> i32 {
    match a {
        Activation::Silu => 0,
        Activation::ReluSquared => 1,
        Activation::GeluTanh => 2,
    }
}

/// Launches `$f` with the raw arguments given (device pointers as `u64`, scalars as
/// `i32`/`f32`); each argument is bound to a local that outlives the launch.
macro_rules! launch {
    ($be:expr, $name:expr, $cfg:expr; $($arg:expr),* $(,)?) => {{
        let f = $be.func($name)?;
        let mut b = $be.stream.launch_builder(f);
        $( let a = $arg; b.arg(&a); )*
        // SAFETY: the argument list matches the kernel's signature in cuda/ (by hand; checked
        // only by running tests/gpu.rs on a GPU), and every pointer is a live device
        // allocation of at least the extent the kernel touches.
        unsafe { b.launch($cfg) }.map_err(drv)?;
    }};
}

/// The decode plan of a model's last-position graph: what the megakernel of every bucket is
/// generated from (here and in [`super::precompile`], which must generate the same source).
pub(super) fn decode_plan(last: crate::graph::Graph) -> ExecutionPlan {
    ExecutionPlan::lower(last, Phase::Decode)
}

impl CudaBackend {
    /// Compiles `cuda/` for the device (or takes the cached cubins), uploads the weights.
    pub fn new(config: &ModelConfig, weights: &Weights) -> Result<CudaBackend, CudaError> {
        let (ctx, info) = probe()?;
        // One stream, raw pointers: cudarc's per-slice event tracking is not needed.
        // SAFETY: no slice is used on another stream.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.default_stream();
        let include = nvrtc::find_include_dir().ok_or(NvrtcError::NoHeaders)?;
        let (major, minor) = info.compute_capability;
        let arch = (major * 10 + minor) as u32;
        let funcs = traced(
            || {
                format!(
                    "{} kernel sources compiled or read from the cache and loaded",
                    SOURCES.len()
                )
            },
            || load_sources(&ctx, arch, &include),
        )?;

        let plans = TracePhase::start();
        let last = compile_graph(config, weights, LogitRows::Last)?;
        let all = compile_graph(config, weights, LogitRows::All)?;
        let prefill = ExecutionPlan::lower(last.clone(), Phase::Prefill);
        let decode = decode_plan(last);
        let all_logits = ExecutionPlan::lower(all, Phase::Prefill);
        plans.end(|| "graphs and plans".to_string());
        let blas = traced(|| "cuBLAS".to_string(), || load_cublas(&stream));
        let upload = TracePhase::start();
        let mut staging = Staging::new(&ctx)?;
        let inv = crate::graph::rope::inv_freq(&prefill.graph.rope);
        let inv_freq = stream.clone_htod(&inv).map_err(drv)?;
        // The local layers' frequencies (Gemma 3); one unused element when there are none.
        let inv_local = match &prefill.graph.rope_local {
            Some(spec) => crate::graph::rope::inv_freq(spec),
            None => vec![0.0],
        };
        let inv_freq_local = stream.clone_htod(&inv_local).map_err(drv)?;

        let mut matrices = HashMap::new();
        let mut vectors = HashMap::new();
        let upload_vec = |name: &str, vectors: &mut HashMap<String, CudaSlice<f32>>| {
            if vectors.contains_key(name) {
                return Ok::<(), CudaError>(());
            }
            let v = weights.get(name)?.to_f32_vec();
            vectors.insert(name.to_string(), stream.clone_htod(&v).map_err(drv)?);
            Ok(())
        };
        for plan in [&prefill, &all_logits] {
            for node in &plan.graph.nodes {
                match &node.op {
                    Op::Embed { table, .. } if !matrices.contains_key(table) => {
                        // The first vocab_size rows, as on the CPU: what a tied head shares.
                        let stored = weights.get(table)?.shape.first().copied().unwrap_or(0);
                        let rows = stored.min(config.vocab_size);
                        let m = upload_matrix(
                            &stream,
                            &mut staging,
                            weights,
                            &[(table.clone(), None, rows)],
                        )?;
                        matrices.insert(table.clone(), m);
                    }
                    Op::GatedValueAdd { kv_heads, .. } if *kv_heads > 32 => {
                        return Err(CudaError::Unsupported(format!("{kv_heads} KV heads > 32")))
                    }
                    Op::GatedValueAdd { gate, .. } | Op::Smear { gate, .. } => {
                        upload_vec(gate, &mut vectors)?
                    }
                    Op::MatMul { linears, norm, .. } => {
                        let key = Linear::key(linears);
                        if let std::collections::hash_map::Entry::Vacant(e) = matrices.entry(key) {
                            let parts: Vec<(String, Option<String>, usize)> = linears
                                .iter()
                                .map(|l| (l.weight.clone(), l.bias.clone(), l.out))
                                .collect();
                            e.insert(upload_matrix(&stream, &mut staging, weights, &parts)?);
                        }
                        if let Some(w) = norm.as_ref().and_then(|n| n.weight.as_ref()) {
                            upload_vec(w, &mut vectors)?;
                        }
                    }
                    Op::RmsNorm(n) => {
                        if let Some(w) = &n.weight {
                            upload_vec(w, &mut vectors)?;
                        }
                    }
                    Op::HeadNorm {
                        weight: Some(w), ..
                    } => upload_vec(w, &mut vectors)?,
                    Op::Attention { head_dim, .. } if *head_dim > 256 => {
                        return Err(CudaError::Unsupported(format!("head_dim {head_dim} > 256")))
                    }
                    _ => {}
                }
            }
        }
        staging.finish()?;
        drop(staging);
        stream.synchronize().map_err(drv)?;
        upload.end(|| {
            format!(
                "{} matrices and {} vectors uploaded",
                matrices.len(),
                vectors.len()
            )
        });
        let mk = traced(
            || "megakernel program lowered and its weight tables uploaded".to_string(),
            || MegakernelCache::new(&stream, &decode, weights, &matrices, &vectors),
        )?;
        stream.synchronize().map_err(drv)?;
        Ok(CudaBackend {
            info,
            ctx,
            stream,
            funcs,
            config: config.clone(),
            prefill,
            decode,
            all_logits,
            matrices,
            vectors,
            inv_freq,
            inv_freq_local,
            arch,
            include,
            blas,
            mk,
        })
    }

    /// Whether prefill matmuls run on cuBLAS (else on kiln's `gemm_bf16`).
    pub fn uses_cublas(&self) -> bool {
        self.blas.is_some()
    }

    /// The same backend with cuBLAS switched off: prefill matmuls on kiln's `gemm_bf16` (for
    /// comparing the two paths).
    pub fn without_cublas(mut self) -> CudaBackend {
        self.blas = None;
        self
    }

    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// Bytes of weights on the device (bf16 matrices, f32 biases and vectors).
    pub fn weight_bytes(&self) -> usize {
        let m: usize = self
            .matrices
            .values()
            .map(|m| m.rows * m.cols * 2 + m.bias.as_ref().map_or(0, |b| b.len() * 4))
            .sum();
        m + self.vectors.values().map(|v| v.len() * 4).sum::<usize>()
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    pub fn plan(&self, kind: PlanKind) -> &ExecutionPlan {
        match kind {
            PlanKind::Prefill => &self.prefill,
            PlanKind::Decode => &self.decode,
            PlanKind::AllLogits => &self.all_logits,
        }
    }

    fn func(&self, name: &str) -> Result<&CudaFunction, CudaError> {
        self.funcs
            .get(name)
            .ok_or_else(|| CudaError::Driver(format!("kernel {name} not loaded")))
    }

    /// A device KV cache shaped for this model: `slots` sequences of up to `capacity`
    /// positions over a bf16 block pool of `slots × blocks_for(capacity)` blocks of
    /// [`DEFAULT_BLOCK_SIZE`] positions, allocated whole.
    pub fn new_cache(&self, slots: usize, capacity: usize) -> Result<CudaKvCache, CudaError> {
        let max_blocks = capacity.div_ceil(DEFAULT_BLOCK_SIZE).max(1);
        let blocks = slots.checked_mul(max_blocks).ok_or(CudaError::Len {
            len: capacity,
            what: "count of slots",
            have: slots,
        })?;
        let mut host = pool_tables(self.prefill.graph.kv, KvBudget::Blocks(blocks), capacity)?;
        for _ in 0..slots {
            host.open_slot();
        }
        self.alloc_cache(host)
    }

    /// An engine's device KV pool: as many bf16 blocks of [`DEFAULT_BLOCK_SIZE`] positions as
    /// `budget` allows (bytes count a block's K, V and state in the device layout), allocated
    /// whole and shared by every sequence through its page table, instead of a cache per
    /// session. No slot is open at first: each sequence opens one ([`CudaKvCache::open_slot`],
    /// up to `capacity` positions, blocks taken as it grows) and closes it when it finishes
    /// ([`CudaKvCache::close_slot`]). The serving scheduler's pool on a GPU engine: on an H200
    /// the scheduler's GPU test passed over it (docs/gpu-results.md run 10).
    pub fn new_pool(&self, budget: KvBudget, capacity: usize) -> Result<CudaKvCache, CudaError> {
        self.alloc_cache(pool_tables(self.prefill.graph.kv, budget, capacity)?)
    }

    /// The device arrays for `host`'s whole pool (its ceiling of blocks), zeroed.
    fn alloc_cache(&self, host: KvCache) -> Result<CudaKvCache, CudaError> {
        let layout = *host.layout();
        let max_blocks = host.capacity().div_ceil(layout.block_size).max(1);
        Ok(CudaKvCache {
            spec: host.spec(),
            max_blocks,
            k: Arc::new(
                self.stream
                    .alloc_zeros::<u16>(layout.elems())
                    .map_err(drv)?,
            ),
            v: Arc::new(
                self.stream
                    .alloc_zeros::<u16>(layout.elems())
                    .map_err(drv)?,
            ),
            state: Arc::new(
                self.stream
                    .alloc_zeros::<f32>(layout.state_elems().max(1))
                    .map_err(drv)?,
            ),
            host,
        })
    }

    pub(super) fn ptr<T>(&self, s: &CudaSlice<T>) -> u64 {
        s.device_ptr(&self.stream).0
    }

    fn scratch(
        &self,
        ws: &mut CudaWorkspace,
        name: &'static str,
        n: usize,
    ) -> Result<u64, CudaError> {
        let grow = ws.scratch.get(name).is_none_or(|s| s.len() < n);
        if grow {
            let s = self.stream.alloc_zeros::<f32>(n.max(1)).map_err(drv)?;
            ws.scratch.insert(name, s);
        }
        Ok(self.ptr(&ws.scratch[name]))
    }

    fn ints(
        &self,
        ws: &mut CudaWorkspace,
        name: &'static str,
        v: &[i32],
    ) -> Result<u64, CudaError> {
        let grow = ws.ints.get(name).is_none_or(|s| s.len() < v.len());
        if grow {
            let s = self
                .stream
                .alloc_zeros::<i32>(v.len().max(1))
                .map_err(drv)?;
            ws.ints.insert(name, s);
        }
        let dst = ws.ints.get_mut(name).expect("just inserted");
        self.stream.memcpy_htod(v, dst).map_err(drv)?;
        Ok(self.ptr(&ws.ints[name]))
    }

    /// [`crate::backend::check_step`] against this device cache.
    fn check_step(
        &self,
        kv: &CudaKvCache,
        tokens: &[u32],
        rows: &[TokenRow],
    ) -> Result<std::collections::BTreeMap<usize, usize>, CudaError> {
        Ok(crate::backend::check_step(
            self.config.vocab_size,
            tokens,
            rows,
            kv.slots(),
            kv.capacity(),
            |slot| kv.len(slot),
        )?)
    }

    /// Makes the positions a checked step writes writable in the device cache (blocks added,
    /// shared blocks copied on the backend's stream before the step's kernels).
    fn prepare_step(
        &self,
        kv: &mut CudaKvCache,
        next: &std::collections::BTreeMap<usize, usize>,
    ) -> Result<(), CudaError> {
        for (&slot, &end) in next {
            let start = kv.len(slot);
            kv.make_writable(&self.stream, slot, start, end)?;
        }
        Ok(())
    }

    /// Runs one step like [`crate::backend::cpu::CpuBackend::forward`]: appends `tokens` to the
    /// device cache and writes the logits to `logits` on the host. On an H200 the logits matched
    /// the CPU's on every fixture (docs/gpu-results.md).
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        kind: PlanKind,
        ws: &mut CudaWorkspace,
        kv: &mut CudaKvCache,
        tokens: &[u32],
        rows: &[TokenRow],
        logits: &mut Vec<f32>,
    ) -> Result<usize, CudaError> {
        let next = self.check_step(kv, tokens, rows)?;
        self.prepare_step(kv, &next)?;
        let plan = self.plan(kind);
        let out = self.run(plan, ws, kv, tokens, rows)?;
        let o = plan.output;
        let host: Vec<f32> = self
            .stream
            .clone_dtoh(ws.buffers[o.buffer].as_ref().expect("allocated"))
            .map_err(drv)?;
        logits.clear();
        for t in 0..out.rows {
            let a = t * out.stride + o.col;
            logits.extend_from_slice(&host[a..a + o.cols]);
        }
        for (&slot, &end) in &next {
            kv.set_len(slot, end);
        }
        Ok(out.rows)
    }

    /// Runs one step like [`CudaBackend::forward`] with logits for the rows `logit_rows` names
    /// (increasing indices into `rows`), as the CPU's `forward_selected` (a scheduler step where
    /// a sequence verifies proposals beside others): the all-logits plan runs, so the output
    /// projection covers every row of the step, and the named rows are kept. On an H200 the
    /// scheduler's GPU test verified n-gram proposals through it and matched the CPU (run 10).
    #[allow(clippy::too_many_arguments)]
    pub fn forward_selected(
        &self,
        ws: &mut CudaWorkspace,
        kv: &mut CudaKvCache,
        tokens: &[u32],
        rows: &[TokenRow],
        logit_rows: &[usize],
        logits: &mut Vec<f32>,
    ) -> Result<usize, CudaError> {
        crate::backend::check_logit_rows(logit_rows, tokens.len())?;
        let n = self.forward(PlanKind::AllLogits, ws, kv, tokens, rows, logits)?;
        let width = logits.len() / n.max(1);
        // Increasing rows, so each moves down (or stays): earlier kept rows are never
        // overwritten.
        for (i, &r) in logit_rows.iter().enumerate() {
            logits.copy_within(r * width..(r + 1) * width, i * width);
        }
        logits.truncate(logit_rows.len() * width);
        Ok(logit_rows.len())
    }

    /// Runs one step like [`CudaBackend::forward`] and samples each row of logits on the device
    /// (`sample_rows`: greedy at temperature 0, else top-k / min-p / top-p with the Philox draw
    /// keyed by (`sampling.seed`, `row_ids[i]`, the position the sampled token takes)); only the
    /// tokens come back. `row_ids` has one entry per row of logits (per sequence for `Prefill`
    /// and `Decode`, per token for `AllLogits`). A repetition penalty is refused: callers that
    /// need logits processors use [`CudaBackend::forward`]. On an H200 (docs/gpu-results.md) it
    /// picked the host sampler's tokens on the same logits, and seeded runs reproduced.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_sample(
        &self,
        kind: PlanKind,
        ws: &mut CudaWorkspace,
        kv: &mut CudaKvCache,
        tokens: &[u32],
        rows: &[TokenRow],
        sampling: &SamplingParams,
        row_ids: &[u32],
    ) -> Result<Vec<u32>, CudaError> {
        let draws: Vec<RowDraw<'_>> = row_ids
            .iter()
            .map(|&row_id| RowDraw {
                sampling: *sampling,
                row_id,
                allowed: None,
            })
            .collect();
        self.forward_draw(kind, ws, kv, tokens, rows, &draws)
    }

    /// [`CudaBackend::forward_sample`] with each row of logits drawn its own way (`draws`, one
    /// per row of logits): its own parameters, seed and Philox row, and where it has one, its
    /// set of allowed tokens, applied on the device (`mask_rows`) before the draw — a
    /// constrained row's mask is uploaded instead of its logits coming back. On an H200 masked
    /// and unmasked per-row draws matched the host sampler on the same logits
    /// (`tests/gpu.rs::masked_device_draws_match_the_host_sampler_on_masked_logits`) and the
    /// scheduler's greedy device draws matched the CPU (docs/gpu-results.md run 10).
    #[allow(clippy::too_many_arguments)]
    pub fn forward_draw(
        &self,
        kind: PlanKind,
        ws: &mut CudaWorkspace,
        kv: &mut CudaKvCache,
        tokens: &[u32],
        rows: &[TokenRow],
        draws: &[RowDraw<'_>],
    ) -> Result<Vec<u32>, CudaError> {
        // One MkRow per row of logits: the parameters, the seed and the row's Philox row.
        let controls = draws
            .iter()
            .map(|d| row_control(&d.sampling, d.row_id))
            .collect::<Result<Vec<_>, _>>()?;
        let next = self.check_step(kv, tokens, rows)?;
        let plan = self.plan(kind);
        let o = plan.output;
        // The token row each row of logits comes from (its position + 1 is the sampled token's).
        let from: Vec<usize> = match plan.buffers[o.buffer].rows {
            Rows::Tokens => (0..tokens.len()).collect(),
            Rows::Sequences => last_of_each_sequence(rows),
        };
        if draws.len() != from.len() {
            return Err(CudaError::RowIds {
                got: draws.len(),
                want: from.len(),
            });
        }
        let vocab = o.cols;
        let mask_words = vocab.div_ceil(32);
        // Every mask padded or cut to the vocabulary's words, back to back; -1: no mask.
        let mut masks: Vec<i32> = Vec::new();
        let mut mask_at: Vec<i32> = Vec::with_capacity(draws.len());
        for d in draws {
            match d.allowed {
                Some(words) => {
                    mask_at.push(masks.len() as i32);
                    let start = masks.len();
                    masks.extend(words.iter().take(mask_words).map(|&w| w as i32));
                    masks.resize(start + mask_words, 0);
                }
                None => mask_at.push(-1),
            }
        }
        self.prepare_step(kv, &next)?;
        let out = self.run(plan, ws, kv, tokens, rows)?;
        let n = out.rows;
        let logits =
            self.ptr(ws.buffers[o.buffer].as_ref().expect("allocated")) + (o.col * 4) as u64;
        if !masks.is_empty() {
            let d_masks = self.ints(ws, "sample_masks", &masks)?;
            let d_at = self.ints(ws, "sample_mask_at", &mask_at)?;
            launch!(self, "mask_rows", cfg((n as u32, div(vocab, 256), 1), BLOCK);
                logits, out.stride as i32, vocab as i32, d_masks, d_at, mask_words as i32);
        }
        let ctl_words: Vec<i32> = controls
            .iter()
            .flat_map(row_words)
            .map(|w| w as i32)
            .collect();
        let d_ctl = self.ints(ws, "sample_ctl", &ctl_words)?;
        let positions: Vec<i32> = from.iter().map(|&t| rows[t].pos as i32 + 1).collect();
        let d_pos = self.ints(ws, "sample_positions", &positions)?;
        let work = self.scratch(ws, "sample_work", n * vocab)?;
        let d_out = self.ints(ws, "sample_tokens", &vec![0; n])?;
        launch!(self, "sample_rows", cfg((n as u32, 1, 1), BLOCK);
            logits, out.stride as i32, vocab as i32, d_ctl, d_pos, work, d_out);
        let host: Vec<i32> = self
            .stream
            .clone_dtoh(&ws.ints["sample_tokens"])
            .map_err(drv)?;
        for (&slot, &end) in &next {
            kv.set_len(slot, end);
        }
        Ok(host[..n].iter().map(|&t| t as u32).collect())
    }

    /// Prefill matmul through cuBLAS: `x` (f32, row stride `xs`) to bf16, `cublasGemmEx` (see
    /// [`super::gemm_args`] for the argument mapping) into `out` directly when there is nothing
    /// to add but an in-place residual (β = 1), else into f32 scratch followed by
    /// `gemm_epilogue` (bias, residual, activation, gated). On an H200 a 40-row prefill through
    /// it and through `gemm_bf16` both matched the CPU's logits on every fixture (`tests/gpu.rs`).
    #[allow(clippy::too_many_arguments)]
    fn gemm_cublas(
        &self,
        blas: &CudaBlas,
        ws: &mut CudaWorkspace,
        m: &DevMatrix,
        (x, xs): (u64, i32),
        n_tok: usize,
        (out, os): (u64, i32),
        bias: u64,
        (res, rs): (u64, i32),
        epi: i32,
        act: i32,
    ) -> Result<(), CudaError> {
        use cudarc::cublas::{result::gemm_ex, sys};
        let (k, r) = (m.cols, m.rows);
        let xb = self.scratch(ws, "x_bf16", (n_tok * k).div_ceil(2))?;
        for (s, n) in row_chunks(n_tok) {
            launch!(self, "f32_to_bf16_rows", cfg((div(k, 256), n as u32, 1), BLOCK);
                row_at(x, xs, 4, s), xs, row_at(xb, k as i32, 2, s), k as i32);
        }
        let direct = bias == 0 && (epi == 0 || (epi == 1 && res == out && rs == os));
        let (c, ldc, beta) = if direct {
            (out, os as usize, if epi == 1 { 1.0f32 } else { 0.0 })
        } else {
            (self.scratch(ws, "gemm_c", n_tok * r)?, r, 0.0)
        };
        let g = prefill_gemm(n_tok, r, k, k, ldc);
        if !g.valid() {
            return Err(CudaError::Cublas(format!("invalid GEMM arguments {g:?}")));
        }
        let op = |t: Trans| match t {
            Trans::N => sys::cublasOperation_t::CUBLAS_OP_N,
            Trans::T => sys::cublasOperation_t::CUBLAS_OP_T,
        };
        let alpha = 1.0f32;
        // SAFETY: A is the `[r, k]` bf16 matrix, B the `[n_tok, k]` bf16 copy just written, C
        // `[n_tok, ldc]` f32 (the plan's output slot or scratch of that size); the shapes are
        // `prefill_gemm`'s (checked by `valid`); α and β are host scalars (cuBLAS's default
        // pointer mode) that outlive the call; the handle is bound to the backend's stream.
        unsafe {
            gemm_ex(
                *blas.handle(),
                op(g.transa),
                op(g.transb),
                g.m as i32,
                g.n as i32,
                g.k as i32,
                &alpha as *const f32 as *const std::ffi::c_void,
                self.ptr(&m.w) as *const std::ffi::c_void,
                sys::cudaDataType::CUDA_R_16BF,
                g.lda as i32,
                xb as *const std::ffi::c_void,
                sys::cudaDataType::CUDA_R_16BF,
                g.ldb as i32,
                &beta as *const f32 as *const std::ffi::c_void,
                c as *mut std::ffi::c_void,
                sys::cudaDataType::CUDA_R_32F,
                g.ldc as i32,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| CudaError::Cublas(format!("cublasGemmEx {g:?}: {e}")))?;
        if !direct {
            let n = if epi == 3 { r / 2 } else { r };
            for (s, rows) in row_chunks(n_tok) {
                launch!(self, "gemm_epilogue", cfg((div(n, 256), rows as u32, 1), BLOCK);
                    row_at(c, r as i32, 4, s), r as i32, bias, row_at(out, os, 4, s), os,
                    row_at(res, rs, 4, s), rs, n as i32, epi, act);
            }
        }
        Ok(())
    }

    /// Executes `plan`'s instructions; the output stays on the device (where: the returned
    /// rows and row stride of the plan's output buffer).
    fn run(
        &self,
        plan: &ExecutionPlan,
        ws: &mut CudaWorkspace,
        kv: &mut CudaKvCache,
        tokens: &[u32],
        rows: &[TokenRow],
    ) -> Result<DeviceOutput, CudaError> {
        let n_tok = tokens.len();
        let seq_last: Vec<i32> = last_of_each_sequence(rows)
            .into_iter()
            .map(|t| t as i32)
            .collect();
        let n_rows = |r: Rows| match r {
            Rows::Tokens => n_tok,
            Rows::Sequences => seq_last.len(),
        };
        ws.buffers.resize_with(plan.buffers.len(), || None);
        for (b, desc) in ws.buffers.iter_mut().zip(&plan.buffers) {
            let need = (n_rows(desc.rows) * desc.cols).max(1);
            if b.as_ref().is_none_or(|s| s.len() < need) {
                *b = Some(self.stream.alloc_zeros::<f32>(need).map_err(drv)?);
            }
        }
        let tok_i: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
        let d_tok = self.ints(ws, "tokens", &tok_i)?;
        let slots: Vec<i32> = rows.iter().map(|r| r.slot as i32).collect();
        let d_slot = self.ints(ws, "row_slot", &slots)?;
        let poss: Vec<i32> = rows.iter().map(|r| r.pos as i32).collect();
        let d_pos = self.ints(ws, "row_pos", &poss)?;
        let d_last = self.ints(ws, "seq_last", &seq_last)?;
        let d_tables = self.ints(ws, "page_tables", &kv.device_tables())?;
        let kv_l = *kv.layout();
        let (max_blocks, layers, block_size) = (
            kv.max_blocks as i32,
            kv_l.layers as i32,
            kv_l.block_size as i32,
        );
        let max_len = rows.iter().map(|r| r.pos + 1).max().unwrap_or(1);
        let buf_ptrs: Vec<u64> = ws
            .buffers
            .iter()
            .map(|b| self.ptr(b.as_ref().expect("allocated above")))
            .collect();
        // (pointer to the slot's first column, row stride)
        let at = |s: Slot| -> (u64, i32) {
            (
                buf_ptrs[s.buffer] + (s.col * 4) as u64,
                plan.buffers[s.buffer].cols as i32,
            )
        };
        let sms = self.info.sms as usize;

        for ins in &plan.instrs {
            let out_slot = ins.outputs[0];
            let (out, os) = at(out_slot);
            let rows_out = n_rows(plan.buffers[out_slot.buffer].rows);
            let ro = rows_out as i32;
            let inp = |i: usize| -> (u64, i32) {
                at(ins.inputs[i].slot().expect("token ids read as activations"))
            };
            match &ins.op {
                Op::TokenIds => unreachable!("the plan has no instruction for the input"),
                Op::Embed { table, dim, .. } => {
                    let m = &self.matrices[table];
                    launch!(self, "embed_bf16", cfg((n_tok as u32, 1, 1), BLOCK);
                        d_tok, self.ptr(&m.w), out, *dim as i32, os);
                }
                Op::RmsNorm(n) => {
                    let (x, xs) = inp(0);
                    let w = n.weight.as_ref().map_or(0, |w| self.ptr(&self.vectors[w]));
                    launch!(self, "rms_norm", cfg((rows_out as u32, 1, 1), BLOCK);
                        x, xs, w, n.eps, out, os, out_slot.cols as i32);
                }
                Op::MatMul {
                    linears,
                    norm,
                    epilogue,
                } => {
                    let m = &self.matrices[&Linear::key(linears)];
                    let (mut x, mut xs) = inp(0);
                    let k = m.cols;
                    if let Some(n) = norm {
                        let normed = self.scratch(ws, "normed", rows_out * k)?;
                        let w = n.weight.as_ref().map_or(0, |w| self.ptr(&self.vectors[w]));
                        launch!(self, "rms_norm", cfg((rows_out as u32, 1, 1), BLOCK);
                            x, xs, w, n.eps, normed, k as i32, k as i32);
                        x = normed;
                        xs = k as i32;
                    }
                    let bias = m.bias.as_ref().map_or(0, |b| self.ptr(b));
                    let (res, rs) = match epilogue {
                        Epilogue::ResidualAdd if ins.in_place => (out, os),
                        Epilogue::ResidualAdd => inp(1),
                        _ => (0, 0),
                    };
                    let (epi, act) = match epilogue {
                        Epilogue::None => (0, 0),
                        Epilogue::ResidualAdd => (1, 0),
                        Epilogue::Activation(a) => (2, act_code(*a)),
                        Epilogue::Gated(a) => (3, act_code(*a)),
                    };
                    let wp = self.ptr(&m.w);
                    let (mr, kk) = (m.rows as i32, k as i32);
                    if rows_out <= 8 {
                        let pairs = if epi == 3 {
                            m.rows / 2
                        } else {
                            m.rows.div_ceil(2)
                        };
                        let blocks = pairs.div_ceil(4);
                        let target = 2 * sms;
                        let mut splits = if blocks * rows_out < target {
                            target.div_ceil(blocks * rows_out).min(k / 256).clamp(1, 16)
                        } else {
                            1
                        };
                        let chunk = k.div_ceil(splits).div_ceil(8) * 8;
                        splits = k.div_ceil(chunk).max(1);
                        let partial = if splits > 1 {
                            self.scratch(ws, "partial", splits * rows_out * m.rows)?
                        } else {
                            0
                        };
                        launch!(self, "gemv_bf16", cfg((blocks as u32, ro as u32, splits as u32), 128);
                            wp, mr, kk, x, xs, bias, out, os, res, rs, epi, act, chunk as i32, partial);
                        if splits > 1 {
                            let n_out = if epi == 3 { m.rows / 2 } else { m.rows };
                            launch!(self, "gemv_finish", cfg((div(n_out, 256), ro as u32, 1), BLOCK);
                                partial, splits as i32, mr, bias, out, os, res, rs, epi, act);
                        }
                    } else if let Some(blas) = &self.blas {
                        self.gemm_cublas(
                            blas,
                            ws,
                            m,
                            (x, xs),
                            rows_out,
                            (out, os),
                            bias,
                            (res, rs),
                            epi,
                            act,
                        )?;
                    } else if epi == 3 {
                        let g = self.scratch(ws, "gated", rows_out * m.rows)?;
                        launch!(self, "gemm_bf16", cfg((div(m.rows, 64), div(rows_out, 64), 1), BLOCK);
                            wp, mr, kk, x, xs, ro, bias, g, mr, 0u64, 0i32, 0i32, 0i32);
                        let f = m.rows / 2;
                        for (s, n) in row_chunks(rows_out) {
                            launch!(self, "gated_rows", cfg((div(f, 256), n as u32, 1), BLOCK);
                                row_at(g, mr, 4, s), mr, row_at(out, os, 4, s), os, f as i32, act);
                        }
                    } else {
                        launch!(self, "gemm_bf16", cfg((div(m.rows, 64), div(rows_out, 64), 1), BLOCK);
                            wp, mr, kk, x, xs, ro, bias, out, os, res, rs, epi, act);
                    }
                }
                Op::HeadNorm {
                    heads,
                    head_dim,
                    eps,
                    scale,
                    weight,
                } => {
                    let (x, xs) = inp(0);
                    let w = weight.as_ref().map_or(0, |w| self.ptr(&self.vectors[w]));
                    launch!(self, "head_norm", cfg((div(rows_out * heads, 4), 1, 1), 128);
                        x, xs, out, os, ro, *heads as i32, *head_dim as i32, *eps, *scale, w);
                }
                Op::Rope {
                    heads,
                    head_dim,
                    local,
                } => {
                    let table = if *local {
                        &self.inv_freq_local
                    } else {
                        &self.inv_freq
                    };
                    let (x, xs) = inp(0);
                    let style = match plan.graph.rope.style {
                        RopeStyle::HalfSplit => 0i32,
                        RopeStyle::Interleaved => 1,
                        RopeStyle::HalfSplitNegated => 2,
                    };
                    launch!(self, "rope", cfg((div(rows_out * heads * head_dim / 2, 256), 1, 1), BLOCK);
                        x, xs, out, os, d_pos, self.ptr(table), ro, *heads as i32,
                        *head_dim as i32, style);
                }
                Op::Attention {
                    layer,
                    heads,
                    kv_heads,
                    head_dim,
                    scale,
                    window,
                } => {
                    let (q, qs) = inp(0);
                    let (k, ks) = inp(1);
                    let (v, vs) = inp(2);
                    let (kc, vc) = (self.ptr(&kv.k), self.ptr(&kv.v));
                    let (kvh, hd, li) = (*kv_heads as i32, *head_dim as i32, *layer as i32);
                    let win = window.map_or(-1, |w| w as i32);
                    launch!(self, "kv_append", cfg((div(rows_out * kv_heads * head_dim, 256), 1, 1), BLOCK);
                        k, ks, v, vs, kc, vc, d_slot, d_pos, ro, kvh, hd, d_tables, max_blocks,
                        layers, li, block_size);
                    if plan.phase == Phase::Decode {
                        let splits = max_len.div_ceil(512).clamp(1, 16);
                        let tasks = rows_out * heads;
                        let ml = self.scratch(ws, "att_ml", tasks * splits * 2)?;
                        let acc = self.scratch(ws, "att_acc", tasks * splits * head_dim)?;
                        launch!(self, "attention_decode", cfg((tasks as u32, splits as u32, 1), 128);
                            q, qs, kc, vc, d_slot, d_pos, *heads as i32, kvh, hd, d_tables,
                            max_blocks, layers, li, block_size, *scale, win, ml, acc);
                        launch!(self, "attention_combine", cfg((tasks as u32, 1, 1), 128);
                            ml, acc, splits as i32, *heads as i32, hd, out, os);
                    } else {
                        launch!(self, "attention_prefill", cfg((rows_out as u32, div(*heads, 4), 1), 128);
                            q, qs, kc, vc, d_slot, d_pos, *heads as i32, kvh, hd, d_tables,
                            max_blocks, layers, li, block_size, *scale, win, out, os);
                    }
                }
                Op::Add | Op::Mul => {
                    let (a, as_) = inp(0);
                    let (b, bs) = inp(1);
                    let name = if ins.op == Op::Add {
                        "add_rows"
                    } else {
                        "mul_rows"
                    };
                    for (s, n) in row_chunks(rows_out) {
                        launch!(self, name, cfg((div(out_slot.cols, 256), n as u32, 1), BLOCK);
                            row_at(a, as_, 4, s), as_, row_at(b, bs, 4, s), bs,
                            row_at(out, os, 4, s), os, out_slot.cols as i32);
                    }
                }
                Op::Combine { a, b } => {
                    let (x, xs) = inp(0);
                    let (y, ys) = inp(1);
                    for (s, n) in row_chunks(rows_out) {
                        launch!(self, "combine_rows", cfg((div(out_slot.cols, 256), n as u32, 1), BLOCK);
                            row_at(x, xs, 4, s), xs, row_at(y, ys, 4, s), ys,
                            row_at(out, os, 4, s), os, out_slot.cols as i32, *a, *b);
                    }
                }
                Op::Act(a) => {
                    let (x, xs) = inp(0);
                    for (s, n) in row_chunks(rows_out) {
                        launch!(self, "act_rows", cfg((div(out_slot.cols, 256), n as u32, 1), BLOCK);
                            row_at(x, xs, 4, s), xs, row_at(out, os, 4, s), os,
                            out_slot.cols as i32, act_code(*a));
                    }
                }
                Op::Softcap { cap } => {
                    let (x, xs) = inp(0);
                    for (s, n) in row_chunks(rows_out) {
                        launch!(self, "softcap_rows", cfg((div(out_slot.cols, 256), n as u32, 1), BLOCK);
                            row_at(x, xs, 4, s), xs, row_at(out, os, 4, s), os,
                            out_slot.cols as i32, *cap);
                    }
                }
                Op::GatedValueAdd {
                    gate,
                    channels,
                    kv_heads,
                    head_dim,
                    scale,
                } => {
                    let (v, vs) = inp(0);
                    let (h, hs) = inp(1);
                    let (ve, ves) = inp(2);
                    launch!(self, "gated_value_add", cfg((rows_out as u32, 1, 1), 32 * *kv_heads as u32);
                        v, vs, h, hs, ve, ves, self.ptr(&self.vectors[gate]), out, os,
                        *channels as i32, *kv_heads as i32, *head_dim as i32, *scale);
                }
                Op::Smear {
                    gate,
                    lambda,
                    channels,
                } => {
                    let (e, es) = inp(0);
                    launch!(self, "smear", cfg((rows_out as u32, 1, 1), BLOCK);
                        e, es, self.ptr(&self.vectors[gate]), out, os, self.ptr(&kv.state),
                        kv.spec.state_dim as i32, d_tables, max_blocks, block_size, d_slot, d_pos,
                        out_slot.cols as i32, *channels as i32, *lambda);
                }
                Op::LastRow => {
                    let (x, xs) = inp(0);
                    launch!(self, "gather_rows", cfg((div(out_slot.cols, 256), seq_last.len() as u32, 1), BLOCK);
                        x, xs, d_last, out, os, out_slot.cols as i32);
                }
            }
        }

        let o = plan.output;
        Ok(DeviceOutput {
            rows: n_rows(plan.buffers[o.buffer].rows),
            stride: plan.buffers[o.buffer].cols,
        })
    }
}

/// Where a step's output is: the plan's output slot, with this many rows of this stride.
struct DeviceOutput {
    rows: usize,
    stride: usize,
}

/// cuBLAS when libcublas loads (checked first: cudarc panics on a missing library), else
/// `None` and one line on stderr.
fn load_cublas(stream: &Arc<CudaStream>) -> Option<CudaBlas> {
    // SAFETY: only tries dlopen with cudarc's candidate names for libcublas.
    if !unsafe { cudarc::cublas::sys::is_culib_present() } {
        eprintln!("kiln: libcublas not found; prefill matmuls use kiln's own GEMM kernel");
        return None;
    }
    match CudaBlas::new(stream.clone()) {
        Ok(b) => Some(b),
        Err(e) => {
            eprintln!(
                "kiln: cuBLAS did not start ({e}); prefill matmuls use kiln's own GEMM kernel"
            );
            None
        }
    }
}

/// Compiles (or reads from the disk cache) and loads every per-op source of `cuda/`: its
/// kernels by name.
fn load_sources(
    ctx: &Arc<CudaContext>,
    arch: u32,
    include: &std::path::Path,
) -> Result<HashMap<&'static str, CudaFunction>, CudaError> {
    let mut funcs = HashMap::new();
    for src in SOURCES {
        let cubin = nvrtc::compile_cached(src, arch, include)?;
        let module = ctx
            .load_module(cudarc::nvrtc::Ptx::from_binary(cubin))
            .map_err(|e| CudaError::Driver(format!("loading cuda/{}: {e:?}", src.file)))?;
        for k in src.kernels {
            let f = module
                .load_function(k)
                .map_err(|e| CudaError::Driver(format!("cuda/{} kernel {k}: {e:?}", src.file)))?;
            funcs.insert(*k, f);
        }
    }
    Ok(funcs)
}

/// Concatenates the rows of one or more linears as bf16 and uploads them (and their biases).
///
/// Every stored format becomes bf16 here, on the host, at upload: f32/f16 round to nearest, bf16
/// is copied, and every GGUF block format (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K,
/// Q6_K, Q8_K) is first dequantized by the same Rust code the CPU backend uses
/// ([`crate::model::quant::dequantize`], bit-identical to ggml's reference) and then rounded to
/// bf16. The GPU has no quantized kernels, so a K-quant model takes bf16's memory on the device.
/// On an H200 (docs/gpu-results.md) the fixtures' f32 and bf16 weights and their Q4_0, Q4_1 and
/// Q8_0 GGUFs, and the demo model's Q4_1 and Q8_0, uploaded and matched the CPU. The formats
/// added with the K-quants (Q5_0, Q5_1, Q2_K…Q8_K) have not run on a device: their host-side
/// dequantization is tested, no GPU test uploads such a model.
fn upload_matrix(
    stream: &Arc<CudaStream>,
    staging: &mut Staging,
    weights: &Weights,
    parts: &[(String, Option<String>, usize)],
) -> Result<DevMatrix, CudaError> {
    let tensors = parts
        .iter()
        .map(|(w, _, _)| weights.get(w))
        .collect::<Result<Vec<_>, _>>()?;
    let cols = tensors[0].shape.last().copied().unwrap_or(0);
    for ((_, _, r), t) in parts.iter().zip(&tensors) {
        if t.shape.len() != 2 || t.shape[1] != cols || *r > t.shape[0] {
            return Err(LoadError::tensor(
                &weights.source,
                &t.name,
                format!(
                    "expected a matrix with {cols} columns and at least {r} rows, found shape {:?}",
                    t.shape
                ),
            )
            .into());
        }
    }
    let rows: usize = parts.iter().map(|p| p.2).sum();
    let total = rows
        .checked_mul(cols)
        .ok_or_else(|| CudaError::Driver(format!("{} x {cols} values overflow", rows)))?;
    let mut w = stream.alloc_zeros::<u16>(total.max(1)).map_err(drv)?;
    let mut at = 0;
    for (t, p) in tensors.iter().zip(parts) {
        let n = p.2 * cols;
        staging.put_bf16(stream, weights, t, n, &mut w, at)?;
        at += n;
    }
    let bias = if parts.iter().any(|(_, b, _)| b.is_some()) {
        let mut v = Vec::with_capacity(rows);
        for (_, b, r) in parts {
            match b {
                Some(name) => v.extend(weights.get(name)?.to_f32_vec().into_iter().take(*r)),
                None => v.extend(std::iter::repeat_n(0.0, *r)),
            }
        }
        Some(stream.clone_htod(&v).map_err(drv)?)
    } else {
        None
    };
    Ok(DevMatrix {
        rows,
        cols,
        w,
        bias,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Row chunks cover every row once, in order, within CUDA's `gridDim.y` limit, and a chunk's
    /// pointers land on its first row (null operands stay null).
    #[test]
    fn row_chunks_cover_the_rows_within_the_grid_limit() {
        for rows in [
            0,
            1,
            8,
            MAX_GRID_Y - 1,
            MAX_GRID_Y,
            MAX_GRID_Y + 1,
            3 * MAX_GRID_Y + 7,
        ] {
            let chunks: Vec<_> = row_chunks(rows).collect();
            let mut next = 0;
            for &(s, n) in &chunks {
                assert_eq!(s, next, "{rows} rows: {chunks:?}");
                assert!((1..=MAX_GRID_Y).contains(&n), "{rows} rows: {chunks:?}");
                next += n;
            }
            assert_eq!(next, rows);
            assert_eq!(chunks.len(), rows.div_ceil(MAX_GRID_Y));
        }
        assert_eq!(row_at(1000, 10, 4, 3), 1120);
        assert_eq!(
            row_at(1000, 6, 2, MAX_GRID_Y),
            1000 + 12 * MAX_GRID_Y as u64
        );
        assert_eq!(row_at(0, 10, 4, 3), 0);
    }

    /// Page tables come out per slot in the order asked, `max_blocks` apart, -1 past the
    /// slot's blocks, shared blocks in both slots.
    #[test]
    fn page_tables_list_each_slots_blocks() {
        let spec = KvSpec {
            layers: 1,
            kv_heads: 1,
            head_dim: 2,
            state_dim: 0,
        };
        let opts = KvOptions {
            block_size: 2,
            dtype: KvDtype::Bf16,
        };
        let mut c = KvCache::tables_only(spec, opts, KvBudget::Blocks(12), 8).unwrap();
        for _ in 0..3 {
            c.open_slot();
        }
        c.prepare(1, 5).unwrap();
        c.advance(1, 5);
        c.copy_slot(1, 2, 3);
        let t1 = c.page_table(1).to_vec();
        assert_eq!(t1.len(), 3);
        let got = page_tables(&c, &[2, 0, 1], 4);
        let t = |b: u32| b as i32;
        assert_eq!(
            got,
            vec![
                t(t1[0]),
                t(t1[1]),
                -1,
                -1,
                -1,
                -1,
                -1,
                -1,
                t(t1[0]),
                t(t1[1]),
                t(t1[2]),
                -1
            ]
        );
    }

    /// An engine pool is sized by its budget (bytes of whole device blocks, or blocks), opens no
    /// slot, and its sequences take distinct blocks from it and give them back on close.
    #[test]
    fn a_pool_is_sized_by_its_budget_and_shared_by_sequences() {
        let spec = KvSpec {
            layers: 2,
            kv_heads: 1,
            head_dim: 4,
            state_dim: 3,
        };
        let per_block = pool_tables(spec, KvBudget::Blocks(1), 64)
            .unwrap()
            .layout()
            .bytes_per_block();
        // bf16 K and V per layer and head, f32 state, per position.
        assert_eq!(per_block, DEFAULT_BLOCK_SIZE * (2 * 2 * 4 * 2 + 3 * 4));
        let mut pool =
            pool_tables(spec, KvBudget::Bytes(per_block * 10 + per_block / 2), 64).unwrap();
        assert_eq!(pool.layout().num_blocks, 10);
        assert_eq!(pool.slots(), 0);
        let (a, b) = (pool.open_slot(), pool.open_slot());
        let n = DEFAULT_BLOCK_SIZE;
        pool.prepare(a, 3 * n).unwrap();
        pool.advance(a, 3 * n);
        pool.prepare(b, 2 * n).unwrap();
        pool.advance(b, 2 * n);
        let (ta, tb) = (pool.page_table(a).to_vec(), pool.page_table(b).to_vec());
        assert_eq!((ta.len(), tb.len()), (3, 2));
        assert!(ta.iter().all(|x| !tb.contains(x)), "{ta:?} {tb:?}");
        assert_eq!(pool.available_blocks(), 5);
        pool.close_slot(a);
        assert_eq!(pool.available_blocks(), 8);
        assert!(matches!(
            pool_tables(spec, KvBudget::Bytes(per_block - 1), 64),
            Err(CudaError::Exec(_))
        ));
    }

    /// Applies `block_copies` to host arrays in the pool's layout and checks each destination
    /// block then holds exactly its source block (K, V and state), nothing else moved.
    #[test]
    fn block_copies_move_exactly_whole_blocks() {
        let l = KvLayout {
            layers: 2,
            kv_heads: 3,
            head_dim: 4,
            state_dim: 5,
            block_size: 3,
            num_blocks: 6,
            dtype: KvDtype::Bf16,
        };
        let copies = [(4u32, 1u32), (0, 5)];
        let k: Vec<u16> = (0..l.elems() as u16).collect();
        let v: Vec<u16> = k.iter().map(|x| x ^ 0x5555).collect();
        let st: Vec<f32> = (0..l.state_elems()).map(|i| i as f32).collect();
        let (mut k2, mut v2, mut st2) = (k.clone(), v.clone(), st.clone());
        for (src, dst) in block_copies(&l, &copies) {
            match src.array {
                BlockArray::K | BlockArray::V => {
                    let arr = if src.array == BlockArray::K {
                        &mut k2
                    } else {
                        &mut v2
                    };
                    let (s, d, n) = (src.offset as usize / 2, dst as usize / 2, src.bytes / 2);
                    arr.copy_within(s..s + n, d);
                }
                BlockArray::State => {
                    let (s, d, n) = (src.offset as usize / 4, dst as usize / 4, src.bytes / 4);
                    st2.copy_within(s..s + n, d);
                }
            }
        }
        let moved = |b: usize| {
            copies
                .iter()
                .find(|c| c.1 as usize == b)
                .map(|c| c.0 as usize)
        };
        for b in 0..l.num_blocks {
            let from = moved(b).unwrap_or(b);
            for layer in 0..l.layers {
                for h in 0..l.kv_heads {
                    for off in 0..l.block_size {
                        for d in 0..l.head_dim {
                            let (i, j) =
                                (l.row(layer, b, h, off) + d, l.row(layer, from, h, off) + d);
                            assert_eq!(
                                (k2[i], v2[i]),
                                (k[j], v[j]),
                                "block {b} l{layer} h{h} {off} {d}"
                            );
                        }
                    }
                }
            }
            for off in 0..l.block_size {
                for d in 0..l.state_dim {
                    assert_eq!(st2[l.state_row(b, off) + d], st[l.state_row(from, off) + d]);
                }
            }
        }
    }
}

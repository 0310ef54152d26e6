//! The decode megakernel on the device, replayed from a CUDA graph ([`GraphDecoder`]).
//!
//! Ran on an H200 (docs/gpu-results.md), checked by `tests/gpu.rs` against the per-op path and the
//! CPU: 256 greedy steps equal on every fixture that lowers and on the demo model (SmolLM2), up to
//! near ties whose gaps the tests print; replays past the capture position attend to the whole
//! cache (a graph started at position 500 decoding to 800); stopping with steps in flight,
//! host-path steps and a restart work; so do batches with padding rows and stop tokens;
//! compute-sanitizer's memcheck, racecheck and synccheck report 0 errors (a fixture, a few tokens).
//! Two checks pass on every fixture but FAIL on the demo model, neither yet shown to be a near tie:
//! rows joining and leaving between replays ([`GraphDecoder::join`]), and seeded sampling equal to
//! the per-op device sampler (it parts at step 9 of 48). The host-side arithmetic this relies on
//! (buckets, padding rows, grid size, the control block, ring epochs, waiting) is
//! [`super::graph_host`], unit-tested on the CPU.
//!
//! Per batch bucket (1, 2, 4, 8) the backend lowers its decode plan, schedules and emits the
//! kernel (kiln-codegen), compiles it with NVRTC for the device's exact architecture (cached on
//! disk) and keeps the module ([`MegakernelCache`]), so every session shares it. The weight
//! tables (`wt`, `wt_f32`: one device pointer per program weight) are built once at load,
//! pointing into the backend's merged matrices (`Linear::key` concatenations, at a row offset)
//! and vectors; only tensors the per-op path does not hold in the needed form are uploaded again.
//!
//! A [`GraphDecoder`] (one per session cache and bucket) owns the activation arena, the epoch
//! counters (zeroed once, never reset: epochs stay monotonic across restarts), the per-row
//! position / token / slot arrays, the [`MkControl`] block, and the ring of results in pinned,
//! host-mapped memory. The one kernel launch is captured into a CUDA graph once; positions,
//! tokens, page tables and each row's sampling parameters (the row table) live in device memory
//! that [`GraphDecoder::start`], [`GraphDecoder::join`] and [`GraphDecoder::leave`] rewrite
//! (asynchronous copies on the launch stream, ordered between replays), so a new position, a
//! row joining with its own sequence and parameters, or a row leaving never needs a new capture.
//! Batch rows nobody occupies are inactive (position -1): they read and write nothing.
//! Replays of every decoder go to one stream per backend: two persistent kernels never run at
//! once, so neither can keep the other's blocks from becoming resident.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cudarc::driver::{
    result, sys, CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig,
    PushKernelArg,
};
use kiln_codegen::{MkControl, Weight, WeightDtype};

use super::device::{drv, page_tables, CudaBackend, CudaError, CudaKvCache, DevMatrix};
use super::graph_host::{
    batch_arrays, bucket_for, check_rows, control_words, grid_blocks, host_stop_mask, row_control,
    row_mask, row_words, sampling_control, wait_epoch, GraphError, RingBook, StreamState,
    WaitError, CONTROL_WORDS, NO_TOKEN,
};
use super::megakernel::{generate, lower_decode, timeline_dir};
use super::nvrtc;
use super::timeline::Timeline;
use super::trace::traced;
use crate::backend::GraphRow;
use crate::graph::{Linear, Op};
use crate::model::{LoadError, Weights};
use crate::plan::ExecutionPlan;
use crate::sample::SamplingParams;

/// Threads per block of the megakernel (`MK_THREADS` in `cuda/megakernel/tiles.cuh`).
const THREADS: u32 = 256;

/// How long [`GraphDecoder::next`] waits for one step before reporting an error.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

/// Spins between polls of the stream while waiting on the ring.
const POLL_SPINS: u32 = 1024;

/// The name the megakernel of `bucket` is compiled and cached under (the precompiler uses it too,
/// so that its cubins are the ones a device looks up).
pub(super) fn megakernel_file(bucket: usize) -> String {
    format!("kiln_decode_step_b{bucket}.cu")
}

/// One decode step's results: the sampled token of each row `start` named (in its order;
/// `NO_TOKEN` for one that has left), each batch row's token (`None` where the row was inactive
/// in that step), and a bit per batch row whose token is one of the stop tokens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GraphStep {
    pub tokens: Vec<u32>,
    pub rows: Vec<Option<u32>>,
    pub stopped: u32,
}

/// The device pointer tables of the decode program's weights (the same for every bucket).
struct MkWeights {
    /// The program's weights, in table order (each bucket's program must name the same).
    program: Vec<Weight>,
    wt: CudaSlice<u64>,
    wt_f32: CudaSlice<u64>,
    /// Tensors uploaded for the megakernel alone (kept alive for the tables).
    _bf16: Vec<CudaSlice<u16>>,
    _f32: Vec<CudaSlice<f32>>,
}

/// A compiled megakernel for one bucket and its launch geometry.
pub(super) struct MkModule {
    func: CudaFunction,
    tiles: usize,
    counters: usize,
    /// Floats of the activation arena.
    arena: usize,
    grid: u32,
    /// Dynamic shared memory per block (the matvec staging buffer).
    shared: u32,
    /// Where the per-tile records go when the kernel keeps them (`KILN_MK_TIMELINE`).
    timeline: Option<Timeline>,
}

/// The backend's megakernel state: weight tables (or why the model does not lower), compiled
/// modules per bucket, and the one stream every graph replays on.
pub(super) struct MegakernelCache {
    weights: Result<MkWeights, String>,
    modules: Mutex<HashMap<usize, Arc<MkModule>>>,
    stream: Mutex<Option<Arc<CudaStream>>>,
}

/// Where a weight already lives on the device: a merged matrix (by key) and a row offset.
#[derive(Clone)]
struct Part {
    key: String,
    row: usize,
    rows: usize,
}

impl MegakernelCache {
    /// Lowers the decode plan at batch 1 and builds the weight tables, while the host weights
    /// are at hand. A model that does not lower (or a weight that cannot be resolved) is
    /// recorded, not an error: the per-op path still runs it. Driver failures are errors.
    pub(super) fn new(
        stream: &Arc<CudaStream>,
        decode: &ExecutionPlan,
        weights: &Weights,
        matrices: &HashMap<String, DevMatrix>,
        vectors: &HashMap<String, CudaSlice<f32>>,
    ) -> Result<MegakernelCache, CudaError> {
        let weights = match lower_decode(decode, 1) {
            Err(e) => Err(e.to_string()),
            Ok(p) => build_tables(stream, decode, &p.weights, weights, matrices, vectors)?,
        };
        Ok(MegakernelCache {
            weights,
            modules: Mutex::new(HashMap::new()),
            stream: Mutex::new(None),
        })
    }
}

/// Resolves each program weight to a device pointer and uploads the two tables. `Ok(Err(..))`
/// when a weight cannot be found or has the wrong shape.
fn build_tables(
    stream: &Arc<CudaStream>,
    decode: &ExecutionPlan,
    program: &[Weight],
    weights: &Weights,
    matrices: &HashMap<String, DevMatrix>,
    vectors: &HashMap<String, CudaSlice<f32>>,
) -> Result<Result<MkWeights, String>, CudaError> {
    // Where each matrix row block and each bias lives in the merged matrices.
    let mut bf16_at: HashMap<&str, Part> = HashMap::new();
    let mut bias_at: HashMap<&str, Part> = HashMap::new();
    for node in &decode.graph.nodes {
        match &node.op {
            Op::MatMul { linears, .. } => {
                let key = Linear::key(linears);
                let mut row = 0;
                for l in linears {
                    let part = Part {
                        key: key.clone(),
                        row,
                        rows: l.out,
                    };
                    if let Some(b) = &l.bias {
                        bias_at.entry(b.as_str()).or_insert_with(|| part.clone());
                    }
                    bf16_at.entry(l.weight.as_str()).or_insert(part);
                    row += l.out;
                }
            }
            Op::Embed { table, .. } => {
                if let Some(m) = matrices.get(table) {
                    bf16_at.entry(table.as_str()).or_insert(Part {
                        key: table.clone(),
                        row: 0,
                        rows: m.rows,
                    });
                }
            }
            _ => {}
        }
    }
    let ptr = |s: u64, elem: usize, at: usize| s + (elem * at) as u64;
    let dev = |s: &CudaSlice<u16>| s.device_ptr(stream).0;
    let devf = |s: &CudaSlice<f32>| s.device_ptr(stream).0;
    let mut wt = vec![0u64; program.len()];
    let mut wt_f32 = vec![0u64; program.len()];
    let (mut own16, mut own32) = (Vec::new(), Vec::new());
    for (i, w) in program.iter().enumerate() {
        let n = w.rows * w.cols;
        match w.dtype {
            WeightDtype::Bf16 => {
                let found = bf16_at.get(w.name.as_str()).and_then(|p| {
                    let m = matrices.get(&p.key)?;
                    (m.cols == w.cols && w.rows <= p.rows)
                        .then(|| ptr(dev(&m.w), 2, p.row * m.cols))
                });
                wt[i] = match found {
                    Some(p) => p,
                    None => match host_tensor(weights, w, n) {
                        Err(why) => return Ok(Err(why)),
                        Ok(t) => {
                            let bits: Vec<u16> =
                                t.to_bf16_vec()[..n].iter().map(|v| v.to_bits()).collect();
                            let s = stream.clone_htod(&bits).map_err(drv)?;
                            let p = dev(&s);
                            own16.push(s);
                            p
                        }
                    },
                };
            }
            WeightDtype::F32 => {
                let vector = vectors.get(&w.name).filter(|v| v.len() >= n).map(devf);
                let bias = || {
                    let p = bias_at.get(w.name.as_str())?;
                    let b = matrices.get(&p.key)?.bias.as_ref()?;
                    (n <= p.rows).then(|| ptr(devf(b), 4, p.row))
                };
                wt_f32[i] = match vector.or_else(bias) {
                    Some(p) => p,
                    None => match host_tensor(weights, w, n) {
                        Err(why) => return Ok(Err(why)),
                        Ok(t) => {
                            let v = t.to_f32_vec()[..n].to_vec();
                            let s = stream.clone_htod(&v).map_err(drv)?;
                            let p = devf(&s);
                            own32.push(s);
                            p
                        }
                    },
                };
            }
        }
    }
    Ok(Ok(MkWeights {
        program: program.to_vec(),
        wt: stream.clone_htod(&wt).map_err(drv)?,
        wt_f32: stream.clone_htod(&wt_f32).map_err(drv)?,
        _bf16: own16,
        _f32: own32,
    }))
}

/// The host tensor behind a program weight, checked to hold at least `rows × cols` values with
/// rows of `cols` (a vector: any shape with that many values).
fn host_tensor<'a>(
    weights: &'a Weights,
    w: &Weight,
    n: usize,
) -> Result<&'a crate::model::Tensor, String> {
    let t = weights.get(&w.name).map_err(|e: LoadError| e.to_string())?;
    let cols_ok = w.rows == 1 || t.shape.last() == Some(&w.cols);
    if t.numel() < n || !cols_ok {
        return Err(format!(
            "megakernel weight {}: expected [{}, {}], found shape {:?}",
            w.name, w.rows, w.cols, t.shape
        ));
    }
    Ok(t)
}

impl CudaBackend {
    /// Whether the decode megakernel runs this model: its decode plan lowers and every weight
    /// the program names was found. The reason otherwise (`Unsupported`).
    pub fn supports_megakernel(&self) -> Result<(), CudaError> {
        self.mk
            .weights
            .as_ref()
            .map(|_| ())
            .map_err(|why| CudaError::Unsupported(why.clone()))
    }

    fn mk_weights(&self) -> Result<&MkWeights, CudaError> {
        self.mk
            .weights
            .as_ref()
            .map_err(|why| CudaError::Unsupported(why.clone()))
    }

    /// The compiled megakernel for `bucket`, compiled (or read from the disk cache) on first
    /// use and shared by every session.
    pub(super) fn megakernel(&self, bucket: usize) -> Result<Arc<MkModule>, CudaError> {
        let weights = self.mk_weights()?;
        let mut modules = self.mk.modules.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(m) = modules.get(&bucket) {
            return Ok(m.clone());
        }
        let mk = traced(
            || format!("megakernel b{bucket} lowered, scheduled and emitted"),
            || generate(&self.decode, bucket),
        )
        .map_err(|e| CudaError::Unsupported(e.to_string()))?;
        if mk.program.weights != weights.program {
            return Err(CudaError::Unsupported(format!(
                "the batch-{bucket} decode program names other weights than batch 1's"
            )));
        }
        let file = megakernel_file(bucket);
        let cubin = traced(
            || {
                format!(
                    "{file} compiled or read from the cache ({} bytes of source)",
                    mk.source.len()
                )
            },
            || nvrtc::compile_text_cached(&file, &mk.source, self.arch, &self.include),
        )?;
        let module = self
            .ctx
            .load_module(cudarc::nvrtc::Ptx::from_binary(cubin))
            .map_err(|e| CudaError::Driver(format!("loading {file}: {e:?}")))?;
        let func = module
            .load_function(kiln_codegen::KERNEL)
            .map_err(|e| CudaError::Driver(format!("{file}: {e:?}")))?;
        // The staging buffer is dynamic shared memory: past the default 48 KB per block
        // (static + dynamic) the kernel must opt in.
        let shared = u32::try_from(mk.shared_bytes()).map_err(|_| {
            CudaError::Unsupported(format!("{} bytes of shared memory", mk.shared_bytes()))
        })?;
        func.set_attribute(
            sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            shared as i32,
        )
        .map_err(|e| {
            CudaError::Driver(format!(
                "{file}: {shared} bytes of dynamic shared memory: {e:?}"
            ))
        })?;
        let per_sm = func
            .occupancy_max_active_blocks_per_multiprocessor(THREADS, shared as usize, None)
            .map_err(drv)?;
        let tiles = mk.schedule.tiles.len();
        let grid = grid_blocks(
            self.info.sms as usize,
            per_sm as usize,
            tiles,
            THREADS as usize,
        )?;
        let timeline =
            timeline_dir().map(|dir| Timeline::new(module.clone(), dir, &mk.program, &mk.schedule));
        let m = Arc::new(MkModule {
            timeline,
            func,
            tiles,
            counters: mk.schedule.counters(),
            arena: mk.program.buffer_offsets().1,
            grid: grid as u32,
            shared,
        });
        modules.insert(bucket, m.clone());
        Ok(m)
    }

    /// The stream every decode graph replays on (created on first use).
    fn mk_stream(&self) -> Result<Arc<CudaStream>, CudaError> {
        let mut s = self.mk.stream.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(s) = s.as_ref() {
            return Ok(s.clone());
        }
        let new = self.ctx.new_stream().map_err(drv)?;
        *s = Some(new.clone());
        Ok(new)
    }
}

/// The ring of step results: `u32`s in pinned host memory mapped into the device's address
/// space (written by the kernel, read here with volatile loads).
struct PinnedRing {
    host: *mut u32,
    dev: u64,
    words: usize,
    ctx: Arc<CudaContext>,
}

// SAFETY: the allocation is process-wide pinned memory (PORTABLE); the ring is only read through
// `&GraphDecoder` / written through `&mut GraphDecoder`, never shared between threads at once.
unsafe impl Send for PinnedRing {}

impl PinnedRing {
    fn new(ctx: &Arc<CudaContext>, words: usize) -> Result<PinnedRing, CudaError> {
        ctx.bind_to_thread().map_err(drv)?;
        let bytes = words * 4;
        // SAFETY: the context is current; the flags ask for memory mapped into the device's
        // address space and usable from every context.
        let host = unsafe {
            result::malloc_host(
                bytes,
                sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE,
            )
        }
        .map_err(drv)? as *mut u32;
        // SAFETY: `host` is a fresh allocation of `bytes` bytes. Zero: no entry holds an epoch
        // (the first epoch is 1).
        unsafe { std::ptr::write_bytes(host, 0, words) };
        let mut dev: sys::CUdeviceptr = 0;
        // SAFETY: `host` came from cuMemHostAlloc with DEVICEMAP; flags must be 0.
        let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, host as *mut _, 0) };
        let ring = PinnedRing {
            host,
            dev,
            words,
            ctx: ctx.clone(),
        };
        r.result().map_err(drv)?;
        Ok(ring)
    }

    /// A volatile read of word `i` (the device writes it behind the compiler's back).
    fn read(&self, i: usize) -> u32 {
        assert!(i < self.words, "ring word {i} of {}", self.words);
        // SAFETY: in bounds (checked), aligned, and the allocation lives as long as `self`.
        unsafe { std::ptr::read_volatile(self.host.add(i)) }
    }
}

impl Drop for PinnedRing {
    fn drop(&mut self) {
        // The owner synchronised its stream first: no kernel writes the ring any more.
        self.ctx.record_err(self.ctx.bind_to_thread());
        // SAFETY: allocated by cuMemHostAlloc in `new`, freed once.
        self.ctx
            .record_err(unsafe { result::free_host(self.host as *mut _) });
    }
}

/// A captured and instantiated graph (raw handles: cudarc's `CudaGraph` is not `Send`).
struct OwnedGraph {
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
    ctx: Arc<CudaContext>,
}

// SAFETY: graph objects are not internally synchronised; this one is only used through
// `&mut GraphDecoder`, so never from two threads at once.
unsafe impl Send for OwnedGraph {}

impl Drop for OwnedGraph {
    fn drop(&mut self) {
        self.ctx.record_err(self.ctx.bind_to_thread());
        // SAFETY: both handles were created in `GraphDecoder::new` and are destroyed once,
        // after the owner synchronised the stream the graph was launched on.
        unsafe {
            self.ctx.record_err(result::graph::exec_destroy(self.exec));
            self.ctx.record_err(result::graph::destroy(self.graph));
        }
    }
}

/// The cache a graph was captured for (its device pointers are baked in): shares its memory,
/// so the memory outlives the decoder's in-flight steps.
struct KvMem {
    k: Arc<CudaSlice<u16>>,
    v: Arc<CudaSlice<u16>>,
    state: Arc<CudaSlice<f32>>,
}

impl KvMem {
    fn of(kv: &CudaKvCache) -> KvMem {
        KvMem {
            k: kv.k.clone(),
            v: kv.v.clone(),
            state: kv.state.clone(),
        }
    }

    fn is(&self, kv: &CudaKvCache) -> bool {
        Arc::ptr_eq(&self.k, &kv.k)
            && Arc::ptr_eq(&self.v, &kv.v)
            && Arc::ptr_eq(&self.state, &kv.state)
    }
}

/// The decode megakernel of one bucket, captured in a CUDA graph for one session's cache, with
/// its ring of results. Run on an H200: see the module docs for what passed and the two checks
/// that fail on the demo model.
///
/// Use: [`start`](Self::start) with the rows to decode, [`enqueue`](Self::enqueue) up to
/// `RING - 1` replays ahead, [`next`](Self::next) for each step's tokens in order,
/// [`stop`](Self::stop) before anything else touches the cache on the backend's stream (host-path
/// steps, `copy_slot`) and before restarting from other positions. The decoder never changes
/// the cache's lengths: the caller confirms positions (`set_len`) as it consumes tokens.
pub struct GraphDecoder {
    bucket: usize,
    vocab: usize,
    module: Arc<MkModule>,
    /// The backend's megakernel stream (replays, uploads of `start`).
    stream: Arc<CudaStream>,
    /// The backend's per-op stream (prefill and host-path steps write the cache there).
    backend_stream: Arc<CudaStream>,
    graph: Option<OwnedGraph>,
    ring: Option<PinnedRing>,
    book: RingBook,
    kv: KvMem,
    /// Rows `start` named (batch rows 0..rows).
    rows: usize,
    /// Each batch row's cache slot (`None`: inactive).
    slots: Vec<Option<usize>>,
    stops: Vec<u32>,
    timeout: Duration,
    /// Launched since the stream was last synchronised.
    unsynced: bool,
    /// Positions ahead of where it writes that a row holds blocks for (`None`: the whole
    /// capacity from its start, as sessions use it); see [`GraphDecoder::set_reach`].
    reach: Option<usize>,
    /// Per batch row: positions below this have blocks (and are in the uploaded page table).
    ends: Vec<usize>,
    // Device memory the captured launch points into.
    _act: CudaSlice<f32>,
    _counters: CudaSlice<u32>,
    _epoch: CudaSlice<u32>,
    pos: CudaSlice<i32>,
    tokens: CudaSlice<i32>,
    /// Each batch row's page table (`[bucket][max_blocks]`), written by `start`.
    tables: CudaSlice<i32>,
    max_blocks: usize,
    ctl: CudaSlice<u32>,
}

impl GraphDecoder {
    /// Compiles (or reuses) the bucket's megakernel, allocates the decoder's device memory and
    /// the ring, and captures the launch into a graph. `kv` is the only cache this decoder runs
    /// on (any number of slots: unoccupied batch rows are inactive and use none).
    ///
    /// # Safety
    ///
    /// The captured graph holds raw pointers into `backend`'s device memory (weights, weight
    /// tables, RoPE frequencies): `backend` must outlive the decoder (the engine drops a
    /// session's decoders before the engine they came from).
    pub unsafe fn new(
        backend: &CudaBackend,
        kv: &CudaKvCache,
        bucket: usize,
    ) -> Result<GraphDecoder, CudaError> {
        if bucket_for(bucket) != Some(bucket) {
            return Err(GraphError::BadBucket { bucket }.into());
        }
        let module = backend.megakernel(bucket)?;
        let weights = backend.mk_weights()?;
        let stream = backend.mk_stream()?;
        let book = RingBook::new(bucket);
        let ring = PinnedRing::new(&backend.ctx, book.words())?;
        let zeros = |n: usize| stream.alloc_zeros::<u32>(n.max(1)).map_err(drv);
        let act = stream
            .alloc_zeros::<f32>(module.arena.max(1))
            .map_err(drv)?;
        let counters = zeros(module.counters)?;
        let epoch = zeros(1)?;
        let ints = |n: usize| stream.alloc_zeros::<i32>(n).map_err(drv);
        let (pos, tokens) = (ints(bucket)?, ints(bucket)?);
        let max_blocks = kv.max_blocks;
        let tables = ints(bucket * max_blocks)?;
        let ctl = zeros(CONTROL_WORDS)?;
        stream.synchronize().map_err(drv)?;

        let d16 = |s: &CudaSlice<u16>| s.device_ptr(&stream).0;
        let args = LaunchArgs {
            wt: weights.wt.device_ptr(&stream).0,
            wt_f32: weights.wt_f32.device_ptr(&stream).0,
            act: act.device_ptr(&stream).0,
            k_cache: d16(kv.k.as_ref()),
            v_cache: d16(kv.v.as_ref()),
            kv_state: kv.state.device_ptr(&stream).0,
            state_dim: kv.spec.state_dim as i32,
            page_tables: tables.device_ptr(&stream).0,
            max_blocks: max_blocks as i32,
            block_size: kv.layout().block_size as i32,
            pos: pos.device_ptr(&stream).0,
            tokens: tokens.device_ptr(&stream).0,
            inv_freq: backend.inv_freq.device_ptr(&stream).0,
            counters: counters.device_ptr(&stream).0,
            epoch_ctr: epoch.device_ptr(&stream).0,
            ctl: ctl.device_ptr(&stream).0,
            ring: ring.dev,
        };
        let graph = traced(
            || format!("graph b{bucket} captured"),
            || capture(&backend.ctx, &module, &args),
        )?;
        Ok(GraphDecoder {
            bucket,
            vocab: backend.config().vocab_size,
            module,
            stream,
            backend_stream: backend.stream.clone(),
            graph: Some(graph),
            ring: Some(ring),
            book,
            kv: KvMem::of(kv),
            rows: 0,
            slots: vec![None; bucket],
            stops: Vec::new(),
            timeout: DEFAULT_TIMEOUT,
            unsynced: false,
            reach: None,
            ends: vec![0; bucket],
            _act: act,
            _counters: counters,
            _epoch: epoch,
            pos,
            tokens,
            tables,
            max_blocks,
            ctl,
        })
    }

    pub fn bucket(&self) -> usize {
        self.bucket
    }

    /// Tiles and persistent blocks of this bucket's kernel (for reports).
    pub fn geometry(&self) -> (usize, u32) {
        (self.module.tiles, self.module.grid)
    }

    /// How long [`next`](Self::next) waits for one step before reporting
    /// [`GraphError::Timeout`] (30 s by default).
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// Makes each started or joining row take blocks only `reach` positions ahead of where it
    /// writes, and more before each [`enqueue_in`](Self::enqueue_in) as it advances (`None`,
    /// the default: up to the capacity at once, which a session's own cache can afford and a
    /// shared serving pool cannot). The serving pool's setting; ran on an H200 under the
    /// scheduler's GPU test (docs/gpu-results.md run 10).
    pub fn set_reach(&mut self, reach: Option<usize>) {
        self.reach = reach;
    }

    /// The end of the positions a row starting (or advancing) at `pos` takes blocks for.
    fn reach_end(&self, pos: usize, capacity: usize) -> usize {
        self.reach
            .map_or(capacity, |r| pos.saturating_add(r.max(1)).min(capacity))
    }

    /// Points the graph at `rows` (at most the bucket; the rest of the bucket is inactive),
    /// all sampling with `sampling`, and `stop_tokens`: [`start_rows`](Self::start_rows) with
    /// the same parameters for every row.
    pub fn start(
        &mut self,
        kv: &mut CudaKvCache,
        rows: &[GraphRow],
        sampling: &SamplingParams,
        stop_tokens: &[u32],
    ) -> Result<(), CudaError> {
        self.start_rows(kv, rows, &vec![*sampling; rows.len()], stop_tokens)
    }

    /// Points the graph at `rows` (batch rows 0..n; the rest of the bucket is inactive), row
    /// `i` sampling with `sampling[i]` (its own parameters and seed, its Philox row
    /// `rows[i].row_id`), and `stop_tokens`. Anything still in flight is discarded first. The
    /// uploads are ordered after the work already on the backend's stream (the prefill or
    /// host-path steps that wrote the cache). Each row's `pos` must be at most its slot's cached
    /// length.
    ///
    /// Every started row may write from its `pos` up to the capacity while the graph runs
    /// ahead, so its slot is made writable there first: blocks are added and shared blocks
    /// copied (copy-on-write, on the backend's stream), then the rows' page tables are
    /// uploaded. A slot's positions from its row's `pos` on are overwritten.
    pub fn start_rows(
        &mut self,
        kv: &mut CudaKvCache,
        rows: &[GraphRow],
        sampling: &[SamplingParams],
        stop_tokens: &[u32],
    ) -> Result<(), CudaError> {
        if !self.kv.is(kv) {
            return Err(GraphError::OtherCache.into());
        }
        if sampling.len() != rows.len() {
            return Err(GraphError::Sampling(format!(
                "{} sampling parameter sets for {} rows",
                sampling.len(),
                rows.len()
            ))
            .into());
        }
        let lens = kv.lens();
        check_rows(rows, self.bucket, &lens, kv.capacity(), self.vocab)?;
        let controls = rows
            .iter()
            .zip(sampling)
            .map(|(r, p)| row_control(p, r.row_id))
            .collect::<Result<Vec<_>, _>>()?;
        let ctl = sampling_control(&controls, stop_tokens)?;
        if self.book.in_flight() > 0 || self.unsynced {
            self.stop()?;
        }
        let (pos, tok, slots) = batch_arrays(rows, self.bucket);
        let capacity = kv.capacity();
        let mut tables = vec![-1i32; self.bucket * self.max_blocks];
        for (b, (s, &p)) in slots.iter().zip(&pos).enumerate() {
            if let Some(s) = *s {
                let end = self.reach_end(p as usize, capacity);
                kv.make_writable(&self.backend_stream, s, p as usize, end)?;
                self.ends[b] = end;
                let t = page_tables(kv.tables(), &[s], self.max_blocks);
                tables[b * self.max_blocks..][..self.max_blocks].copy_from_slice(&t);
            }
        }
        self.stream.join(&self.backend_stream).map_err(drv)?;
        self.stream.memcpy_htod(&pos, &mut self.pos).map_err(drv)?;
        self.stream
            .memcpy_htod(&tok, &mut self.tokens)
            .map_err(drv)?;
        self.stream
            .memcpy_htod(&tables, &mut self.tables)
            .map_err(drv)?;
        self.stream
            .memcpy_htod(&control_words(&ctl), &mut self.ctl)
            .map_err(drv)?;
        let positions: Vec<Option<usize>> = rows.iter().map(|r| Some(r.pos)).collect();
        self.book.start(&positions, capacity);
        self.rows = rows.len();
        self.slots = slots;
        self.stops = stop_tokens.to_vec();
        Ok(())
    }

    /// Batch row `b` (inactive) starts decoding `row` with `sampling` from the next replay on,
    /// while the graph keeps running: the steps already enqueued are untouched (they run
    /// without it), no re-capture. `row.slot` must not be another active row's, `row.pos` at
    /// most its cached length. Its slot is made writable up to the capacity on the backend's
    /// stream, then its position, token, page table and controls (an `MkRow`, 32 bytes) are
    /// copied into the row table on the replay stream, after the replays already enqueued and
    /// after the backend stream's work (the prefill that filled the slot). On an H200
    /// (docs/gpu-results.md) rows joining and leaving between replays match the per-op path on
    /// every fixture but FAIL on the demo model (SmolLM2): the row that left differs from the
    /// per-op reference one step in, not yet shown to be a near tie. The row-table semantics are
    /// checked by kiln-codegen's interpreter (`tests/megakernel_interp.rs`).
    pub fn join(
        &mut self,
        kv: &mut CudaKvCache,
        b: usize,
        row: GraphRow,
        sampling: &SamplingParams,
    ) -> Result<(), CudaError> {
        if !self.kv.is(kv) {
            return Err(GraphError::OtherCache.into());
        }
        if !self.book.started() {
            return Err(GraphError::NotStarted.into());
        }
        let occupied = self.slot_of(b)?;
        if occupied.is_some() {
            return Err(GraphError::RowOccupied { row: b }.into());
        }
        if self.slots.contains(&Some(row.slot)) {
            return Err(GraphError::DuplicateSlot {
                row: b,
                slot: row.slot,
            }
            .into());
        }
        let capacity = kv.capacity();
        check_rows(&[row], 1, &kv.lens(), capacity, self.vocab)?;
        let words = row_words(&row_control(sampling, row.row_id)?);
        let word = MkControl::row_offset(b).map_err(|e| GraphError::Sampling(e.to_string()))? / 4;
        let end = self.reach_end(row.pos, capacity);
        kv.make_writable(&self.backend_stream, row.slot, row.pos, end)?;
        self.ends[b] = end;
        let table = page_tables(kv.tables(), &[row.slot], self.max_blocks);
        self.stream.join(&self.backend_stream).map_err(drv)?;
        let mb = self.max_blocks;
        self.stream
            .memcpy_htod(&table, &mut self.tables.slice_mut(b * mb..(b + 1) * mb))
            .map_err(drv)?;
        self.stream
            .memcpy_htod(&[row.token as i32], &mut self.tokens.slice_mut(b..b + 1))
            .map_err(drv)?;
        self.stream
            .memcpy_htod(&words, &mut self.ctl.slice_mut(word..word + words.len()))
            .map_err(drv)?;
        // The position last: it is what makes the row active.
        self.stream
            .memcpy_htod(&[row.pos as i32], &mut self.pos.slice_mut(b..b + 1))
            .map_err(drv)?;
        self.book.set_row(b, Some(row.pos))?;
        self.slots[b] = Some(row.slot);
        Ok(())
    }

    /// Batch row `b` stops decoding from the next replay on (its position becomes -1 in the
    /// row table, on the replay stream: the replays already enqueued still decode it and their
    /// tokens are read as usual). Its slot is free for another row or for host-path work once
    /// those replays are read. On a GPU this fails on the demo model: see [`join`](Self::join).
    pub fn leave(&mut self, b: usize) -> Result<(), CudaError> {
        if self.slot_of(b)?.is_none() {
            return Err(GraphError::RowInactive { row: b }.into());
        }
        self.stream
            .memcpy_htod(&[-1i32], &mut self.pos.slice_mut(b..b + 1))
            .map_err(drv)?;
        self.book.set_row(b, None)?;
        self.slots[b] = None;
        Ok(())
    }

    /// Batch row `b`'s slot (`None`: inactive), or why `b` is not a row.
    fn slot_of(&self, b: usize) -> Result<Option<usize>, GraphError> {
        self.slots
            .get(b)
            .copied()
            .ok_or(GraphError::RowOutOfBucket {
                row: b,
                bucket: self.bucket,
            })
    }

    /// One graph replay (one decode step of every row), without waiting for it. Refused when
    /// `RING - 1` steps are unread or the next step would pass the cache capacity.
    pub fn enqueue(&mut self) -> Result<(), CudaError> {
        let mut next = self.book.clone();
        next.enqueue()?;
        let graph = self.graph.as_ref().ok_or(GraphError::NotStarted)?;
        self.stream.context().bind_to_thread().map_err(drv)?;
        // SAFETY: the executable graph is alive (owned by `self`); every pointer baked into its
        // kernel node is owned by `self` or the backend (which outlives sessions' decoders) or
        // is the cache `start` checked against `self.kv`.
        unsafe { result::graph::launch(graph.exec, self.stream.cu_stream()) }.map_err(drv)?;
        self.book = next;
        self.unsynced = true;
        Ok(())
    }

    /// [`enqueue`](Self::enqueue) after giving every active row the blocks its write in this
    /// replay needs, when a [reach](Self::set_reach) is set: a row about to write past its
    /// blocks takes `reach` more positions' worth from `kv`'s pool, and its page-table row is
    /// uploaded on the replay stream (after the replays already queued, which do not read the
    /// new entries, and before this one). The pool's refusal (exhausted) comes back as
    /// `CudaError::Exec(ExecError::Kv(..))` with nothing launched. Ran on an H200 under the
    /// scheduler's GPU test (its decode phases through the graph, docs/gpu-results.md run 10);
    /// the refusal path has not run there (its test is
    /// `tests/gpu_engine.rs::serving_bench_in_an_exactly_sized_pool_completes_on_the_gpu`).
    pub fn enqueue_in(&mut self, kv: &mut CudaKvCache) -> Result<(), CudaError> {
        if !self.kv.is(kv) {
            return Err(GraphError::OtherCache.into());
        }
        if self.reach.is_some() {
            let capacity = kv.capacity();
            let positions = self.book.positions().to_vec();
            for (b, p) in positions.into_iter().enumerate() {
                let (Some(slot), Some(p)) = (self.slots[b], p) else {
                    continue;
                };
                if p < self.ends[b] || p >= capacity {
                    // Covered, or refused below by the capacity check of `enqueue`.
                    continue;
                }
                let end = self.reach_end(p, capacity);
                kv.make_writable(&self.backend_stream, slot, self.ends[b], end)?;
                self.ends[b] = end;
                let table = page_tables(kv.tables(), &[slot], self.max_blocks);
                self.stream.join(&self.backend_stream).map_err(drv)?;
                let mb = self.max_blocks;
                self.stream
                    .memcpy_htod(&table, &mut self.tables.slice_mut(b * mb..(b + 1) * mb))
                    .map_err(drv)?;
            }
        }
        self.enqueue()
    }

    /// Steps launched and not read yet.
    pub fn in_flight(&self) -> usize {
        self.book.in_flight()
    }

    /// Waits (spinning on the ring's epoch word, polling the stream for errors, at most the
    /// timeout) for the oldest step in flight and returns its tokens.
    // The contract's name; a blocking, fallible read, not an `Iterator`.
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> Result<GraphStep, CudaError> {
        let epoch = self.book.oldest()?;
        let ring = self.ring.as_ref().ok_or(GraphError::NotStarted)?;
        let word = self.book.epoch_word(epoch);
        let cu_stream = self.stream.cu_stream();
        wait_epoch(
            epoch,
            || ring.read(word),
            || query(cu_stream),
            self.timeout,
            POLL_SPINS,
        )
        .map_err(|e| match e {
            WaitError::Graph(g) => CudaError::Graph(g),
            WaitError::Stream(s) => CudaError::Driver(format!("decode graph step {epoch}: {s}")),
        })?;
        // The tokens were written before the epoch word (with a system fence between).
        std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
        let all: Vec<u32> = (0..self.bucket)
            .map(|b| ring.read(self.book.token_word(epoch, b)))
            .collect();
        let rows: Vec<Option<u32>> = all.iter().map(|&t| (t != NO_TOKEN).then_some(t)).collect();
        // An inactive row's NO_TOKEN is no stop, even among the host's extra stop ids.
        let stopped = (ring.read(self.book.mask_word(epoch)) & row_mask(self.bucket))
            | (host_stop_mask(&all, &self.stops) & live_mask(&rows));
        self.book.consume();
        Ok(GraphStep {
            tokens: all[..self.rows].to_vec(),
            rows,
            stopped,
        })
    }

    /// Waits for everything launched, discards what was not read, and stops: after this the
    /// cache may be used on the backend's stream. A failed kernel (a sticky CUDA error) is
    /// reported here.
    pub fn stop(&mut self) -> Result<(), CudaError> {
        if self.unsynced {
            self.stream.synchronize().map_err(drv)?;
            self.unsynced = false;
            if let Some(timeline) = &self.module.timeline {
                let path = timeline.write(&self.stream, self.bucket)?;
                eprintln!(
                    "kiln: the megakernel's last step, tile by tile: {}",
                    path.display()
                );
            }
        }
        self.book.stop();
        Ok(())
    }
}

/// The bits of the rows that produced a token.
fn live_mask(rows: &[Option<u32>]) -> u32 {
    rows.iter()
        .enumerate()
        .filter(|(_, t)| t.is_some())
        .fold(0, |m, (b, _)| m | (1 << b))
}

impl Drop for GraphDecoder {
    fn drop(&mut self) {
        // Nothing may still write the ring or read the arena or the cache when they are freed.
        if self.unsynced {
            let ctx = self.stream.context();
            ctx.record_err(self.stream.synchronize());
        }
        self.graph.take();
        self.ring.take();
    }
}

/// `cuStreamQuery` as a [`StreamState`].
fn query(stream: sys::CUstream) -> StreamState {
    // SAFETY: the stream is alive (owned by the backend, referenced by the decoder).
    match unsafe { sys::cuStreamQuery(stream) } {
        sys::CUresult::CUDA_SUCCESS => StreamState::Idle,
        sys::CUresult::CUDA_ERROR_NOT_READY => StreamState::Busy,
        e => StreamState::Failed(format!("{e:?}")),
    }
}

/// The kernel's arguments (pointers as `u64`); [`LaunchArgs::ordered`] puts them in the order
/// of the signature.
struct LaunchArgs {
    wt: u64,
    wt_f32: u64,
    act: u64,
    k_cache: u64,
    v_cache: u64,
    kv_state: u64,
    state_dim: i32,
    page_tables: u64,
    max_blocks: i32,
    block_size: i32,
    pos: u64,
    tokens: u64,
    inv_freq: u64,
    counters: u64,
    epoch_ctr: u64,
    ctl: u64,
    ring: u64,
}

/// One kernel argument as passed by value.
#[derive(Clone, Copy, Debug)]
enum Arg {
    Ptr(u64),
    Int(i32),
}

impl LaunchArgs {
    /// The arguments with their parameter names, in the order of the contract's
    /// `kiln_decode_step` signature (checked against the emitted source by a test).
    fn ordered(&self) -> [(&'static str, Arg); 17] {
        use Arg::{Int, Ptr};
        [
            ("wt", Ptr(self.wt)),
            ("wt_f32", Ptr(self.wt_f32)),
            ("act", Ptr(self.act)),
            ("k_cache", Ptr(self.k_cache)),
            ("v_cache", Ptr(self.v_cache)),
            ("kv_state", Ptr(self.kv_state)),
            ("state_dim", Int(self.state_dim)),
            ("page_tables", Ptr(self.page_tables)),
            ("max_blocks", Int(self.max_blocks)),
            ("block_size", Int(self.block_size)),
            ("pos", Ptr(self.pos)),
            ("tokens", Ptr(self.tokens)),
            ("inv_freq", Ptr(self.inv_freq)),
            ("counters", Ptr(self.counters)),
            ("epoch_ctr", Ptr(self.epoch_ctr)),
            ("ctl", Ptr(self.ctl)),
            ("ring", Ptr(self.ring)),
        ]
    }
}

/// Captures one launch of the megakernel on a private stream (so no other thread's work can
/// join the capture) and instantiates and uploads the graph.
fn capture(
    ctx: &Arc<CudaContext>,
    module: &MkModule,
    a: &LaunchArgs,
) -> Result<OwnedGraph, CudaError> {
    let cap = ctx.new_stream().map_err(drv)?;
    cap.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(drv)?;
    let cfg = LaunchConfig {
        grid_dim: (module.grid, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: module.shared,
    };
    let args = a.ordered();
    let mut b = cap.launch_builder(&module.func);
    for (_, arg) in &args {
        match arg {
            Arg::Ptr(p) => b.arg(p),
            Arg::Int(i) => b.arg(i),
        };
    }
    // SAFETY: the argument list is the contract's `kiln_decode_step` signature; every pointer
    // is a live allocation of the extent the generated kernel touches (the arena and counters
    // sized from the program and schedule, the batch arrays from the bucket, the ring from
    // `RingBook::words`). The launch is only recorded (capture), not run.
    let launched = unsafe { b.launch(cfg) };
    // Always end the capture, so the stream is usable (and freed) whatever happened.
    // SAFETY: `cap` is capturing (begun above).
    let ended = unsafe { result::stream::end_capture(cap.cu_stream()) };
    launched.map_err(drv)?;
    let graph = ended.map_err(drv)?;
    if graph.is_null() {
        return Err(CudaError::Driver("stream capture produced no graph".into()));
    }
    // SAFETY: `graph` is the captured graph, owned here until handed to `OwnedGraph`.
    let exec =
        match unsafe { result::graph::instantiate(graph, sys::CUgraphInstantiate_flags_enum(0)) } {
            Ok(e) => e,
            Err(e) => {
                // SAFETY: destroyed once, nothing else holds it.
                ctx.record_err(unsafe { result::graph::destroy(graph) });
                return Err(drv(e));
            }
        };
    let owned = OwnedGraph {
        graph,
        exec,
        ctx: ctx.clone(),
    };
    // SAFETY: the executable graph is alive; uploading only stages its resources.
    unsafe { result::graph::upload(exec, cap.cu_stream()) }.map_err(drv)?;
    cap.synchronize().map_err(drv)?;
    Ok(owned)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Parameter names of `kiln_decode_step` in generated source.
    fn signature(source: &str) -> Vec<String> {
        let at = source
            .find("kiln_decode_step(")
            .expect("kernel in the source");
        let rest = &source[at + "kiln_decode_step(".len()..];
        let params = &rest[..rest.find(')').expect("closing parenthesis")];
        params
            .lines()
            .map(|l| l.split("//").next().unwrap_or(""))
            .collect::<Vec<_>>()
            .join(" ")
            .split(',')
            .map(|p| {
                p.trim()
                    .rsplit(|c: char| !(c.is_alphanumeric() || c == '_'))
                    .next()
                    .unwrap_or("")
                    .to_string()
            })
            .collect()
    }

    fn zero_args() -> LaunchArgs {
        LaunchArgs {
            wt: 1,
            wt_f32: 2,
            act: 3,
            k_cache: 4,
            v_cache: 5,
            kv_state: 6,
            state_dim: 7,
            page_tables: 8,
            max_blocks: 9,
            block_size: 10,
            pos: 11,
            tokens: 12,
            inv_freq: 13,
            counters: 14,
            epoch_ctr: 15,
            ctl: 16,
            ring: 17,
        }
    }

    #[test]
    fn every_argument_is_passed_once_in_field_order() {
        let a = zero_args().ordered();
        let values: Vec<i64> = a
            .iter()
            .map(|(_, v)| match v {
                Arg::Ptr(p) => *p as i64,
                Arg::Int(i) => *i as i64,
            })
            .collect();
        assert_eq!(values, (1..=17).collect::<Vec<_>>());
    }

    #[test]
    fn signature_parser_reads_names() {
        let src = "extern \"C\" __global__ void __launch_bounds__(256)\n\
kiln_decode_step(const __nv_bfloat16* const* __restrict__ wt,   // [n] bf16\n\
                 float* act, int state_dim,\n                 unsigned* ring) {";
        assert_eq!(signature(src), ["wt", "act", "state_dim", "ring"]);
    }

    /// The launch passes exactly the generated kernel's parameters, in order. Ignored until the
    /// signature changes of helpers "mk-lower" (`wt_f32`, `kv_state`, `state_dim`) and
    /// "sampling" (`ctl`, `ring`) are merged: main's emitter still has the session-2 signature.
    #[test]
    fn launch_arguments_match_the_emitted_signature() {
        use crate::graph::build::LogitRows;
        use crate::model::Model;
        use crate::plan::compile_graph;
        use crate::plan::Phase;
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/llama_tied");
        let m = Model::load(dir).expect("fixture");
        let g = compile_graph(&m.config, &m.weights, LogitRows::Last).expect("graph");
        let plan = ExecutionPlan::lower(g, Phase::Decode);
        let k = generate(&plan, 1).expect("lowers");
        let names: Vec<&str> = zero_args().ordered().iter().map(|(n, _)| *n).collect();
        assert_eq!(signature(&k.source), names);
    }
}

//! Driver discovery and the [`CudaBackend`] plan executor.
//!
//! **UNVERIFIED**: this file compiles against cudarc 0.19 but has never run on a GPU (the
//! machines it was written on have none). What it is meant to do, and what `tests/gpu.rs`
//! checks on a GPU machine: execute the same [`ExecutionPlan`]s as the CPU backend, a kernel per
//! instruction (GEMV for few rows, the tiled GEMM for prefill), with weights uploaded once as
//! bf16, the plan's buffers in a device arena ([`CudaWorkspace`]), and a bf16 KV cache on the
//! device ([`CudaKvCache`]). The decode megakernel and CUDA-graph replay of DESIGN.md are not
//! here yet: this is the per-instruction path.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg,
};

use super::kernels::SOURCES;
use super::nvrtc::{self, NvrtcError};
use crate::backend::cpu::{compile_graph, ExecError, PlanKind, TokenRow};
use crate::graph::{Activation, Epilogue, KvSpec, Linear, Op, Rows};
use crate::model::arch::LogitRows;
use crate::model::{LoadError, ModelConfig, RopeStyle, Weights};
use crate::plan::{ExecutionPlan, Phase, Slot};

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
}

fn drv<E: std::fmt::Debug>(e: E) -> CudaError {
    CudaError::Driver(format!("{e:?}"))
}

/// Finds device 0 without panicking: checks that libcuda and NVRTC load before cudarc is used.
/// Verified on a machine without a driver (returns `NoDriver`); the success path is UNVERIFIED.
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

struct DevMatrix {
    rows: usize,
    cols: usize,
    /// bf16 bits, row-major `[rows, cols]`.
    w: CudaSlice<u16>,
    bias: Option<CudaSlice<f32>>,
}

/// The KV cache on the device: bf16 K and V laid out like [`crate::kv::KvCache`]
/// (`[layer][slot][kv_head][capacity][head_dim]`), plus f32 per-position state.
pub struct CudaKvCache {
    spec: KvSpec,
    slots: usize,
    capacity: usize,
    k: CudaSlice<u16>,
    v: CudaSlice<u16>,
    state: CudaSlice<f32>,
    lens: Vec<usize>,
}

impl CudaKvCache {
    pub fn len(&self, slot: usize) -> usize {
        self.lens[slot]
    }
    pub fn is_empty(&self, slot: usize) -> bool {
        self.lens[slot] == 0
    }
    pub fn slots(&self) -> usize {
        self.slots
    }
    pub fn capacity(&self) -> usize {
        self.capacity
    }
    /// Forgets positions from `len` on (nothing on the device is cleared).
    pub fn truncate(&mut self, slot: usize, len: usize) {
        self.lens[slot] = self.lens[slot].min(len);
    }
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

/// Executes kiln's execution plans on one GPU. **UNVERIFIED** (see the module docs).
pub struct CudaBackend {
    info: DeviceInfo,
    #[allow(dead_code)]
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    funcs: HashMap<&'static str, CudaFunction>,
    config: ModelConfig,
    prefill: ExecutionPlan,
    decode: ExecutionPlan,
    all_logits: ExecutionPlan,
    matrices: HashMap<String, DevMatrix>,
    vectors: HashMap<String, CudaSlice<f32>>,
    inv_freq: CudaSlice<f32>,
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

fn act_code(a: Activation) -> i32 {
    match a {
        Activation::Silu => 0,
        Activation::ReluSquared => 1,
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
        let mut funcs = HashMap::new();
        for src in SOURCES {
            let cubin = nvrtc::compile_cached(src, arch, &include)?;
            let module = ctx
                .load_module(cudarc::nvrtc::Ptx::from_binary(cubin))
                .map_err(|e| CudaError::Driver(format!("loading cuda/{}: {e:?}", src.file)))?;
            for k in src.kernels {
                let f = module.load_function(k).map_err(|e| {
                    CudaError::Driver(format!("cuda/{} kernel {k}: {e:?}", src.file))
                })?;
                funcs.insert(*k, f);
            }
        }

        let last = compile_graph(config, weights, LogitRows::Last)?;
        let all = compile_graph(config, weights, LogitRows::All)?;
        let prefill = ExecutionPlan::lower(last.clone(), Phase::Prefill);
        let decode = ExecutionPlan::lower(last, Phase::Decode);
        let all_logits = ExecutionPlan::lower(all, Phase::Prefill);
        let inv = crate::backend::cpu::rope_inv_freq(&prefill.graph.rope);
        let inv_freq = stream.clone_htod(&inv).map_err(drv)?;

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
                        let rows = weights.get(table)?.shape.first().copied().unwrap_or(0);
                        let m = upload_matrix(&stream, weights, &[(table.clone(), None, rows)])?;
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
                            e.insert(upload_matrix(&stream, weights, &parts)?);
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
                    Op::Attention { head_dim, .. } if *head_dim > 256 => {
                        return Err(CudaError::Unsupported(format!("head_dim {head_dim} > 256")))
                    }
                    _ => {}
                }
            }
        }
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
        })
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

    /// A device KV cache shaped for this model.
    pub fn new_cache(&self, slots: usize, capacity: usize) -> Result<CudaKvCache, CudaError> {
        let spec = self.prefill.graph.kv;
        let n = spec.layers * slots * spec.kv_heads * capacity * spec.head_dim;
        Ok(CudaKvCache {
            spec,
            slots,
            capacity,
            k: self.stream.alloc_zeros::<u16>(n.max(1)).map_err(drv)?,
            v: self.stream.alloc_zeros::<u16>(n.max(1)).map_err(drv)?,
            state: self
                .stream
                .alloc_zeros::<f32>((slots * capacity * spec.state_dim).max(1))
                .map_err(drv)?,
            lens: vec![0; slots],
        })
    }

    fn ptr<T>(&self, s: &CudaSlice<T>) -> u64 {
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

    /// Runs one step like [`crate::backend::cpu::CpuBackend::forward`]: appends `tokens` to the
    /// device cache and writes the logits to `logits` on the host. **UNVERIFIED**.
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
        let next = crate::backend::check_step(
            self.config.vocab_size,
            tokens,
            rows,
            kv.slots,
            kv.capacity,
            |slot| kv.lens[slot],
        )?;
        let n = self.run(self.plan(kind), ws, kv, tokens, rows, logits)?;
        for (&slot, &end) in &next {
            kv.lens[slot] = end;
        }
        Ok(n)
    }

    fn run(
        &self,
        plan: &ExecutionPlan,
        ws: &mut CudaWorkspace,
        kv: &mut CudaKvCache,
        tokens: &[u32],
        rows: &[TokenRow],
        logits: &mut Vec<f32>,
    ) -> Result<usize, CudaError> {
        let n_tok = tokens.len();
        let seq_last: Vec<i32> = (0..n_tok)
            .filter(|&t| t + 1 == n_tok || rows[t + 1].slot != rows[t].slot)
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
                    } else if epi == 3 {
                        let g = self.scratch(ws, "gated", rows_out * m.rows)?;
                        launch!(self, "gemm_bf16", cfg((div(m.rows, 64), div(rows_out, 64), 1), BLOCK);
                            wp, mr, kk, x, xs, ro, bias, g, mr, 0u64, 0i32, 0i32, 0i32);
                        let f = m.rows / 2;
                        launch!(self, "gated_rows", cfg((div(f, 256), ro as u32, 1), BLOCK);
                            g, mr, out, os, f as i32, act);
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
                } => {
                    let (x, xs) = inp(0);
                    launch!(self, "head_norm", cfg((div(rows_out * heads, 4), 1, 1), 128);
                        x, xs, out, os, ro, *heads as i32, *head_dim as i32, *eps, *scale);
                }
                Op::Rope { heads, head_dim } => {
                    let (x, xs) = inp(0);
                    let style = match plan.graph.rope.style {
                        RopeStyle::HalfSplit => 0i32,
                        RopeStyle::Interleaved => 1,
                        RopeStyle::HalfSplitNegated => 2,
                    };
                    launch!(self, "rope", cfg((div(rows_out * heads * head_dim / 2, 256), 1, 1), BLOCK);
                        x, xs, out, os, d_pos, self.ptr(&self.inv_freq), ro, *heads as i32,
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
                    let per_layer = kv.slots * kv_heads * kv.capacity * head_dim;
                    let kc = self.ptr(&kv.k) + (layer * per_layer * 2) as u64;
                    let vc = self.ptr(&kv.v) + (layer * per_layer * 2) as u64;
                    let (kvh, hd, cap) = (*kv_heads as i32, *head_dim as i32, kv.capacity as i32);
                    let win = window.map_or(-1, |w| w as i32);
                    launch!(self, "kv_append", cfg((div(rows_out * kv_heads * head_dim, 256), 1, 1), BLOCK);
                        k, ks, v, vs, kc, vc, d_slot, d_pos, ro, kvh, hd, cap);
                    if plan.phase == Phase::Decode {
                        let splits = max_len.div_ceil(512).clamp(1, 16);
                        let tasks = rows_out * heads;
                        let ml = self.scratch(ws, "att_ml", tasks * splits * 2)?;
                        let acc = self.scratch(ws, "att_acc", tasks * splits * head_dim)?;
                        launch!(self, "attention_decode", cfg((tasks as u32, splits as u32, 1), 128);
                            q, qs, kc, vc, d_slot, d_pos, *heads as i32, kvh, hd, cap, *scale,
                            win, ml, acc);
                        launch!(self, "attention_combine", cfg((tasks as u32, 1, 1), 128);
                            ml, acc, splits as i32, *heads as i32, hd, out, os);
                    } else {
                        launch!(self, "attention_prefill", cfg((rows_out as u32, div(*heads, 4), 1), 128);
                            q, qs, kc, vc, d_slot, d_pos, *heads as i32, kvh, hd, cap, *scale,
                            win, out, os);
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
                    launch!(self, name, cfg((div(out_slot.cols, 256), ro as u32, 1), BLOCK);
                        a, as_, b, bs, out, os, out_slot.cols as i32);
                }
                Op::Combine { a, b } => {
                    let (x, xs) = inp(0);
                    let (y, ys) = inp(1);
                    launch!(self, "combine_rows", cfg((div(out_slot.cols, 256), ro as u32, 1), BLOCK);
                        x, xs, y, ys, out, os, out_slot.cols as i32, *a, *b);
                }
                Op::Act(a) => {
                    let (x, xs) = inp(0);
                    launch!(self, "act_rows", cfg((div(out_slot.cols, 256), ro as u32, 1), BLOCK);
                        x, xs, out, os, out_slot.cols as i32, act_code(*a));
                }
                Op::Softcap { cap } => {
                    let (x, xs) = inp(0);
                    launch!(self, "softcap_rows", cfg((div(out_slot.cols, 256), ro as u32, 1), BLOCK);
                        x, xs, out, os, out_slot.cols as i32, *cap);
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
                        kv.spec.state_dim as i32, kv.capacity as i32, d_slot, d_pos,
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
        let stride = plan.buffers[o.buffer].cols;
        let n = n_rows(plan.buffers[o.buffer].rows);
        let host: Vec<f32> = self
            .stream
            .clone_dtoh(ws.buffers[o.buffer].as_ref().expect("allocated"))
            .map_err(drv)?;
        logits.clear();
        for t in 0..n {
            let a = t * stride + o.col;
            logits.extend_from_slice(&host[a..a + o.cols]);
        }
        Ok(n)
    }
}

/// Concatenates the rows of one or more linears as bf16 and uploads them (and their biases).
fn upload_matrix(
    stream: &Arc<CudaStream>,
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
    let bits: Vec<u16> = tensors
        .iter()
        .zip(parts)
        .flat_map(|(t, p)| t.to_bf16_vec().into_iter().take(p.2 * cols))
        .map(|v| v.to_bits())
        .collect();
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
        w: stream.clone_htod(&bits).map_err(drv)?,
        bias,
    })
}

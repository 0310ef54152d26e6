//! The `DecodeProgram`: kiln's decode-step instruction set, over single-assignment f32
//! activation buffers (`[batch, cols]`, one per produced value, never reused within a step, so
//! the only hazards inside a step are true data dependencies plus the few resources the step
//! both reads and writes: the token ids, the positions and the KV cache).

use std::fmt;

pub type BufId = usize;

/// The largest head the tile functions hold in shared memory (`ATT_MAX_D` in
/// `cuda/attention.cuh`).
pub const MAX_HEAD_DIM: usize = 256;

/// The buffer an instruction writes, if any.
pub fn instr_out(ins: &Instr) -> Option<BufId> {
    match ins {
        Instr::Embed { out, .. }
        | Instr::RmsNorm { out, .. }
        | Instr::NormMatvec { out, .. }
        | Instr::MatvecResidual { out, .. }
        | Instr::GatedMlp { out, .. }
        | Instr::Elementwise { out, .. }
        | Instr::GatedValueAdd { out, .. }
        | Instr::Smear { out, .. }
        | Instr::Rope { out, .. }
        | Instr::HeadNorm { out, .. }
        | Instr::AttentionDecode { out, .. }
        | Instr::LmHead { out, .. } => Some(*out),
        Instr::RopeKvAppend { .. } | Instr::Sample { .. } | Instr::StepEnd => None,
    }
}
pub type WeightId = usize;

/// An f32 activation buffer `[batch, cols]`, row stride `cols`.
#[derive(Clone, Debug, PartialEq)]
pub struct Buffer {
    pub name: String,
    pub cols: usize,
}

/// Which of the kernel's two weight tables holds a weight (`wt` for bf16, `wt_f32` for f32;
/// the other table has a null pointer at that index).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightDtype {
    /// Matrices and embedding tables: what the decode step streams.
    Bf16,
    /// Vectors the CPU backend keeps in f32 (norm weights, biases, gates), kept exact.
    F32,
}

/// A weight as the kernel sees it: `[rows, cols]` row-major (a vector has `rows == 1`). `rows`
/// may be fewer than the stored tensor has (a padded vocabulary): the first `rows` rows are used.
#[derive(Clone, Debug, PartialEq)]
pub struct Weight {
    pub name: String,
    pub rows: usize,
    pub cols: usize,
    pub dtype: WeightDtype,
}

/// Columns `[col, col + cols)` of a buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ColRange {
    pub buf: BufId,
    pub col: usize,
    pub cols: usize,
}

impl ColRange {
    pub fn whole(buf: BufId, cols: usize) -> ColRange {
        ColRange { buf, col: 0, cols }
    }
}

/// This step's k (rotated first when `rope`) and v, written into a layer's cache at each row's
/// position by the attention tiles that read it ([`Instr::AttentionDecode`]'s `append`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvAppend {
    pub k: ColRange,
    pub v: ColRange,
    pub rope: bool,
}

/// RMSNorm of the instruction's input row, optionally times a weight vector.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct NormSpec {
    pub weight: Option<WeightId>,
    pub eps: f32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Act {
    Silu,
    ReluSquared,
}

impl Act {
    /// The code of `kiln_act` in `cuda/common.cuh`.
    pub fn code(self) -> u32 {
        match self {
            Act::Silu => 0,
            Act::ReluSquared => 1,
        }
    }
}

/// The codes of `cuda/rope.cu`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    HalfSplit,
    Interleaved,
    HalfSplitNegated,
}

impl RopeStyle {
    pub fn code(self) -> u32 {
        match self {
            RopeStyle::HalfSplit => 0,
            RopeStyle::Interleaved => 1,
            RopeStyle::HalfSplitNegated => 2,
        }
    }
}

/// The operation of an [`Instr::Elementwise`], per element of its input row(s).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Ewise {
    /// `a·x + b·y` (an add is `1·x + 1·y`).
    Combine { a: f32, b: f32 },
    /// `x·y`
    Mul,
    /// `act(x)`
    Act(Act),
    /// `cap · tanh(x / cap)`
    Softcap(f32),
}

impl Ewise {
    /// The `op` code of `mk_ewise` in `cuda/megakernel/tiles.cuh`.
    pub fn code(self) -> u32 {
        match self {
            Ewise::Combine { .. } => 0,
            Ewise::Mul => 1,
            Ewise::Act(_) => 2,
            Ewise::Softcap(_) => 3,
        }
    }

    /// Whether the operation reads a second input row.
    pub fn binary(self) -> bool {
        matches!(self, Ewise::Combine { .. } | Ewise::Mul)
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum Instr {
    /// `out[b] = table[tokens[b]]` (bf16 table `[vocab, dim]`).
    Embed { table: WeightId, out: BufId },
    /// Standalone RMSNorm (nanochat's embedding norm).
    RmsNorm {
        norm: NormSpec,
        input: ColRange,
        out: BufId,
    },
    /// `out = act?(norm?(x) Wᵀ + b)` with several weights over the same input, their outputs
    /// concatenated in `out` in order (q | k | v). `biases` is empty (no bias) or has one
    /// optional f32 bias per weight.
    NormMatvec {
        norm: Option<NormSpec>,
        weights: Vec<WeightId>,
        biases: Vec<Option<WeightId>>,
        input: ColRange,
        out: BufId,
        act: Option<Act>,
    },
    /// `out = residual + x Wᵀ + b`.
    MatvecResidual {
        weight: WeightId,
        bias: Option<WeightId>,
        input: ColRange,
        residual: ColRange,
        out: BufId,
    },
    /// `out = act(norm?(x) W_gateᵀ) · (norm?(x) W_upᵀ)` (no biases: no supported model has
    /// them, and a second bias pointer made the kernel spill at sm_80).
    GatedMlp {
        norm: Option<NormSpec>,
        gate: WeightId,
        up: WeightId,
        act: Act,
        input: ColRange,
        out: BufId,
    },
    /// `out = op(x, y)` element by element over `x.cols` columns (`y` for binary ops).
    Elementwise {
        op: Ewise,
        x: ColRange,
        y: Option<ColRange>,
        out: BufId,
    },
    /// nanochat's value embedding: for each KV head `g`,
    /// `out[g] = v[g] + scale·σ(h[..channels] · gate[g]) · ve[g]` (`gate` f32 `[kv_heads, channels]`).
    GatedValueAdd {
        gate: WeightId,
        channels: usize,
        kv_heads: usize,
        head_dim: usize,
        scale: f32,
        v: ColRange,
        h: ColRange,
        ve: ColRange,
        out: BufId,
    },
    /// nanochat's bigram smear of one token per row:
    /// `out = e + lambda·σ(e[..channels] · gate) · state[pos − 1]`, or `out = e` at position 0;
    /// then `state[pos] = e` (the KV cache's per-position state, `state_dim == e.cols`).
    Smear {
        gate: WeightId,
        lambda: f32,
        channels: usize,
        input: ColRange,
        out: BufId,
    },
    /// RoPE over `heads` heads of `input`, at each row's device-resident position.
    Rope {
        heads: usize,
        head_dim: usize,
        input: ColRange,
        out: BufId,
    },
    /// Per-head RMSNorm without weight, times `scale` (nanochat's q/k norm).
    HeadNorm {
        heads: usize,
        head_dim: usize,
        eps: f32,
        scale: f32,
        input: ColRange,
        out: BufId,
    },
    /// Writes this step's k (rotated first when `rope`) and v into the layer's cache at each
    /// row's position.
    RopeKvAppend {
        layer: usize,
        kv_heads: usize,
        head_dim: usize,
        k: ColRange,
        v: ColRange,
        rope: bool,
    },
    /// Each query head over its KV head's cached keys `[pos − window, pos]`. With `rope_q` the
    /// tile rotates its head of `q` itself (q is the un-rotated projection); with `append` it
    /// first writes this step's k and v of its KV head into the cache (every query head of the
    /// group writes the same values, so no tile waits on another), which is what a separate
    /// `RopeKvAppend` would have done: one dependent phase per layer fewer.
    AttentionDecode {
        layer: usize,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        scale: f32,
        window: Option<usize>,
        q: ColRange,
        rope_q: bool,
        append: Option<KvAppend>,
        out: BufId,
    },
    /// Final norm + vocabulary projection (+ bias, + softcap).
    LmHead {
        norm: Option<NormSpec>,
        weight: WeightId,
        bias: Option<WeightId>,
        input: ColRange,
        out: BufId,
        softcap: Option<f32>,
    },
    /// Picks each row's next token (one tile per batch row) and writes it to the token buffer
    /// the next step reads. How is run-time data, the kernel's `MkControl` (`ctl`): greedy when
    /// its temperature is 0, else temperature / top-k / min-p / top-p with a Philox draw keyed
    /// by (`ctl.rows[b].seed`, `ctl.rows[b].row_id`, `pos[b] + 1`), per batch row, the algorithm
    /// of `kiln::sample::sample`; an inactive row (`pos[b] < 0`) samples nothing.
    Sample { logits: ColRange },
    /// Advances every row's position and reports the step in the token ring (tokens, stop
    /// bitmask, then the epoch); the step's last tile (waits for every sink tile).
    StepEnd,
}

impl Instr {
    pub fn name(&self) -> &'static str {
        match self {
            Instr::Embed { .. } => "embed",
            Instr::RmsNorm { .. } => "rms_norm",
            Instr::NormMatvec { .. } => "norm_matvec",
            Instr::MatvecResidual { .. } => "matvec_residual",
            Instr::GatedMlp { .. } => "gated_mlp",
            Instr::Elementwise { .. } => "elementwise",
            Instr::GatedValueAdd { .. } => "gated_value_add",
            Instr::Smear { .. } => "smear",
            Instr::Rope { .. } => "rope",
            Instr::HeadNorm { .. } => "head_norm",
            Instr::RopeKvAppend { .. } => "rope_kv_append",
            Instr::AttentionDecode { .. } => "attention_decode",
            Instr::LmHead { .. } => "lm_head",
            Instr::Sample { .. } => "sample",
            Instr::StepEnd => "step_end",
        }
    }
}

/// An error of lowering a plan to a decode program.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LowerError {
    /// An op (or a form of one) the megakernel does not implement yet.
    Unsupported {
        op: String,
        label: String,
    },
    Invalid(String),
}

impl fmt::Display for LowerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LowerError::Unsupported { op, label } => write!(
                f,
                "the decode megakernel does not support op `{op}` ({label}) yet"
            ),
            LowerError::Invalid(s) => write!(f, "invalid decode program: {s}"),
        }
    }
}

impl std::error::Error for LowerError {}

/// A whole decode step for `batch` sequences (one token each).
#[derive(Clone, Debug, PartialEq)]
pub struct DecodeProgram {
    pub batch: usize,
    pub buffers: Vec<Buffer>,
    pub weights: Vec<Weight>,
    pub instrs: Vec<Instr>,
    pub rope_style: RopeStyle,
    /// KV cache geometry (the cache is kiln's paged pool, `cuda/kv.cuh`: bf16
    /// `[block][layer][kv_head][block_size][head_dim]`, through each row's page table).
    pub layers: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Floats of per-position state in the cache (`[block][block_size][state_dim]` f32), 0 if
    /// none.
    pub state_dim: usize,
    pub vocab: usize,
}

impl DecodeProgram {
    pub fn new(batch: usize, rope_style: RopeStyle) -> DecodeProgram {
        DecodeProgram {
            batch,
            buffers: vec![],
            weights: vec![],
            instrs: vec![],
            rope_style,
            layers: 0,
            kv_heads: 0,
            head_dim: 0,
            state_dim: 0,
            vocab: 0,
        }
    }

    pub fn buffer(&mut self, name: impl Into<String>, cols: usize) -> BufId {
        self.buffers.push(Buffer {
            name: name.into(),
            cols,
        });
        self.buffers.len() - 1
    }

    /// The id of a bf16 weight, added on first use (tied embeddings share one id).
    pub fn weight(&mut self, name: &str, rows: usize, cols: usize) -> WeightId {
        self.weight_of(name, rows, cols, WeightDtype::Bf16)
    }

    /// The id of an f32 weight (a vector the CPU keeps in f32), added on first use.
    pub fn weight_f32(&mut self, name: &str, rows: usize, cols: usize) -> WeightId {
        self.weight_of(name, rows, cols, WeightDtype::F32)
    }

    /// The id of a weight, added on first use. A name used again with another dtype or shape
    /// keeps its first entry; [`DecodeProgram::validate`] reports the mismatch.
    pub fn weight_of(
        &mut self,
        name: &str,
        rows: usize,
        cols: usize,
        dtype: WeightDtype,
    ) -> WeightId {
        if let Some(i) = self.weights.iter().position(|w| w.name == name) {
            return i;
        }
        self.weights.push(Weight {
            name: name.into(),
            rows,
            cols,
            dtype,
        });
        self.weights.len() - 1
    }

    /// f32 offset of each buffer in the activation arena, and the arena's length.
    pub fn buffer_offsets(&self) -> (Vec<usize>, usize) {
        let mut offs = Vec::with_capacity(self.buffers.len());
        let mut at = 0;
        for b in &self.buffers {
            offs.push(at);
            // Keep every buffer 16-byte aligned.
            at += (self.batch * b.cols).div_ceil(4) * 4;
        }
        (offs, at)
    }

    /// Checks buffer/weight ids and shapes, and that the program ends with `Sample, StepEnd`.
    pub fn validate(&self) -> Result<(), LowerError> {
        let bad = |s: String| Err(LowerError::Invalid(s));
        if self.batch == 0 || self.batch > crate::MAX_BATCH {
            return bad(format!(
                "batch {} not in 1..={}",
                self.batch,
                crate::MAX_BATCH
            ));
        }
        let n = self.instrs.len();
        if n < 2
            || !matches!(self.instrs[n - 2], Instr::Sample { .. })
            || self.instrs[n - 1] != Instr::StepEnd
        {
            return bad("a program must end with sample, step_end".into());
        }
        for (i, ins) in self.instrs.iter().enumerate() {
            for r in crate::schedule::instr_ranges(ins) {
                if r.buf >= self.buffers.len() || r.col + r.cols > self.buffers[r.buf].cols {
                    return bad(format!("instruction {i}: range {r:?} out of bounds"));
                }
            }
            if let Some(o) = instr_out(ins) {
                if o >= self.buffers.len() {
                    return bad(format!("instruction {i}: output buffer {o} does not exist"));
                }
            }
            self.validate_shapes(ins).map_err(|s| {
                LowerError::Invalid(format!("instruction {i} ({}): {s}", ins.name()))
            })?;
        }
        Ok(())
    }

    /// The weight `w` if it exists with this dtype and `rows·cols` (rows `None`: any) elements.
    fn check_weight(
        &self,
        w: WeightId,
        dtype: WeightDtype,
        rows: Option<usize>,
        cols: usize,
    ) -> Result<&Weight, String> {
        let wt = self
            .weights
            .get(w)
            .ok_or_else(|| format!("weight {w} does not exist"))?;
        if wt.dtype != dtype {
            return Err(format!(
                "weight `{}` is {:?}, expected {dtype:?}",
                wt.name, wt.dtype
            ));
        }
        let ok = match rows {
            Some(r) => wt.rows == r && wt.cols == cols,
            None => wt.cols == cols,
        };
        if !ok {
            return Err(format!(
                "weight `{}` is [{}, {}], expected {} columns{}",
                wt.name,
                wt.rows,
                wt.cols,
                cols,
                rows.map_or(String::new(), |r| format!(" and {r} rows"))
            ));
        }
        Ok(wt)
    }

    /// An f32 vector of `n` elements (`[1, n]`, or any `[r, c]` with `r·c == n`).
    fn check_vector(&self, w: WeightId, n: usize) -> Result<(), String> {
        let wt = self
            .weights
            .get(w)
            .ok_or_else(|| format!("weight {w} does not exist"))?;
        if wt.dtype != WeightDtype::F32 || wt.rows * wt.cols != n {
            return Err(format!(
                "weight `{}` is {:?} [{}, {}], expected f32 with {n} elements",
                wt.name, wt.dtype, wt.rows, wt.cols
            ));
        }
        Ok(())
    }

    fn check_norm(&self, n: &Option<NormSpec>, cols: usize) -> Result<(), String> {
        match n.and_then(|n| n.weight) {
            Some(w) => self.check_vector(w, cols),
            None => Ok(()),
        }
    }

    /// Weight dtypes and shapes, and the geometry the tile functions rely on.
    fn validate_shapes(&self, ins: &Instr) -> Result<(), String> {
        let cols = |b: BufId| self.buffers[b].cols;
        let eq = |what: &str, a: usize, b: usize| {
            if a == b {
                Ok(())
            } else {
                Err(format!("{what}: {a} != {b}"))
            }
        };
        let heads_ok = |layer: usize, kv_heads: usize, head_dim: usize| {
            if layer >= self.layers || kv_heads != self.kv_heads || head_dim != self.head_dim {
                return Err(format!(
                    "layer {layer}, {kv_heads} kv heads of {head_dim} outside the cache's {} \
                     layers, {} kv heads of {}",
                    self.layers, self.kv_heads, self.head_dim
                ));
            }
            if head_dim == 0 || head_dim > MAX_HEAD_DIM || !head_dim.is_multiple_of(2) {
                return Err(format!(
                    "head_dim {head_dim} not even and in 2..={MAX_HEAD_DIM}"
                ));
            }
            Ok(())
        };
        match ins {
            Instr::Embed { table, out } => {
                self.check_weight(*table, WeightDtype::Bf16, Some(self.vocab), cols(*out))?;
            }
            Instr::RmsNorm { norm, input, out } => {
                eq("output columns", cols(*out), input.cols)?;
                self.check_norm(&Some(*norm), input.cols)?;
            }
            Instr::NormMatvec {
                norm,
                weights,
                biases,
                input,
                out,
                ..
            } => {
                self.check_norm(norm, input.cols)?;
                if !biases.is_empty() && biases.len() != weights.len() {
                    return Err(format!(
                        "{} biases for {} weights",
                        biases.len(),
                        weights.len()
                    ));
                }
                let mut rows = 0;
                for (k, &w) in weights.iter().enumerate() {
                    let r = self
                        .check_weight(w, WeightDtype::Bf16, None, input.cols)?
                        .rows;
                    if let Some(Some(b)) = biases.get(k) {
                        self.check_vector(*b, r)?;
                    }
                    rows += r;
                }
                eq("output columns", cols(*out), rows)?;
            }
            Instr::MatvecResidual {
                weight,
                bias,
                input,
                residual,
                out,
            } => {
                let r = self
                    .check_weight(*weight, WeightDtype::Bf16, None, input.cols)?
                    .rows;
                eq("output columns", cols(*out), r)?;
                eq("residual columns", residual.cols, r)?;
                if let Some(b) = bias {
                    self.check_vector(*b, r)?;
                }
            }
            Instr::GatedMlp {
                norm,
                gate,
                up,
                input,
                out,
                ..
            } => {
                self.check_norm(norm, input.cols)?;
                let r = self
                    .check_weight(*gate, WeightDtype::Bf16, None, input.cols)?
                    .rows;
                self.check_weight(*up, WeightDtype::Bf16, Some(r), input.cols)?;
                eq("output columns", cols(*out), r)?;
            }
            Instr::LmHead {
                norm,
                weight,
                bias,
                input,
                out,
                softcap,
            } => {
                self.check_norm(norm, input.cols)?;
                let r = self
                    .check_weight(*weight, WeightDtype::Bf16, None, input.cols)?
                    .rows;
                eq("output columns", cols(*out), r)?;
                if let Some(b) = bias {
                    self.check_vector(*b, r)?;
                }
                if softcap.is_some_and(|c| c.is_nan() || c <= 0.0) {
                    return Err(format!("softcap {softcap:?} is not positive"));
                }
            }
            Instr::Elementwise { op, x, y, out } => {
                eq("output columns", cols(*out), x.cols)?;
                match (op.binary(), y) {
                    (true, Some(y)) => eq("second input columns", y.cols, x.cols)?,
                    (false, None) => {}
                    _ => return Err(format!("{op:?} with second input {y:?}")),
                }
            }
            Instr::GatedValueAdd {
                gate,
                channels,
                kv_heads,
                head_dim,
                v,
                h,
                ve,
                out,
                ..
            } => {
                let n = kv_heads * head_dim;
                eq("output columns", cols(*out), n)?;
                eq("value columns", v.cols, n)?;
                eq("value embedding columns", ve.cols, n)?;
                if *channels == 0 || *channels > h.cols {
                    return Err(format!("{channels} gate channels of {} columns", h.cols));
                }
                self.check_vector(*gate, kv_heads * channels)?;
            }
            Instr::Smear {
                gate,
                channels,
                input,
                out,
                ..
            } => {
                eq("output columns", cols(*out), input.cols)?;
                eq("state_dim", self.state_dim, input.cols)?;
                if *channels == 0 || *channels > input.cols {
                    return Err(format!(
                        "{channels} gate channels of {} columns",
                        input.cols
                    ));
                }
                self.check_vector(*gate, *channels)?;
            }
            Instr::Rope {
                heads,
                head_dim,
                input,
                out,
            } => {
                eq("input columns", input.cols, heads * head_dim)?;
                eq("output columns", cols(*out), heads * head_dim)?;
                eq("head_dim", *head_dim, self.head_dim)?;
                if *head_dim == 0 || !head_dim.is_multiple_of(2) {
                    return Err(format!("odd head_dim {head_dim}"));
                }
            }
            Instr::HeadNorm {
                heads,
                head_dim,
                input,
                out,
                ..
            } => {
                eq("input columns", input.cols, heads * head_dim)?;
                eq("output columns", cols(*out), heads * head_dim)?;
            }
            Instr::RopeKvAppend {
                layer,
                kv_heads,
                head_dim,
                k,
                v,
                ..
            } => {
                heads_ok(*layer, *kv_heads, *head_dim)?;
                eq("k columns", k.cols, kv_heads * head_dim)?;
                eq("v columns", v.cols, kv_heads * head_dim)?;
            }
            Instr::AttentionDecode {
                layer,
                heads,
                kv_heads,
                head_dim,
                q,
                rope_q,
                append,
                out,
                ..
            } => {
                heads_ok(*layer, *kv_heads, *head_dim)?;
                if *heads == 0 || heads % kv_heads != 0 {
                    return Err(format!("{heads} heads over {kv_heads} kv heads"));
                }
                eq("q columns", q.cols, heads * head_dim)?;
                eq("output columns", cols(*out), heads * head_dim)?;
                if *rope_q && (*head_dim == 0 || !head_dim.is_multiple_of(2)) {
                    return Err(format!("odd head_dim {head_dim}"));
                }
                if let Some(a) = append {
                    eq("k columns", a.k.cols, kv_heads * head_dim)?;
                    eq("v columns", a.v.cols, kv_heads * head_dim)?;
                }
            }
            Instr::Sample { logits, .. } => eq("logits columns", logits.cols, self.vocab)?,
            Instr::StepEnd => {}
        }
        Ok(())
    }
}

//! The `DecodeProgram`: kiln's decode-step instruction set, over single-assignment f32
//! activation buffers (`[batch, cols]`, one per produced value, never reused within a step, so
//! the only hazards inside a step are true data dependencies plus the few resources the step
//! both reads and writes: the token ids, the positions and the KV cache).

use std::fmt;

pub type BufId = usize;
pub type WeightId = usize;

/// An f32 activation buffer `[batch, cols]`, row stride `cols`.
#[derive(Clone, Debug, PartialEq)]
pub struct Buffer {
    pub name: String,
    pub cols: usize,
}

/// A bf16 weight as the kernel sees it: `[rows, cols]` row-major (a vector has `rows == 1`).
#[derive(Clone, Debug, PartialEq)]
pub struct Weight {
    pub name: String,
    pub rows: usize,
    pub cols: usize,
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
    /// `out = act?(norm?(x) Wᵀ)` with several weights over the same input, their outputs
    /// concatenated in `out` in order (q | k | v).
    NormMatvec {
        norm: Option<NormSpec>,
        weights: Vec<WeightId>,
        input: ColRange,
        out: BufId,
        act: Option<Act>,
    },
    /// `out = residual + x Wᵀ`.
    MatvecResidual {
        weight: WeightId,
        input: ColRange,
        residual: ColRange,
        out: BufId,
    },
    /// `out = act(norm?(x) W_gateᵀ) · (norm?(x) W_upᵀ)`.
    GatedMlp {
        norm: Option<NormSpec>,
        gate: WeightId,
        up: WeightId,
        act: Act,
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
    /// Each query head over its KV head's cached keys `[pos − window, pos]`.
    AttentionDecode {
        layer: usize,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        scale: f32,
        window: Option<usize>,
        q: ColRange,
        out: BufId,
    },
    /// Final norm + vocabulary projection (+ softcap).
    LmHead {
        norm: Option<NormSpec>,
        weight: WeightId,
        input: ColRange,
        out: BufId,
        softcap: Option<f32>,
    },
    /// Picks each row's next token (one tile per batch row) and writes it to the token buffer
    /// the next step reads. How is run-time data, the kernel's `MkControl` (`ctl`): greedy when
    /// its temperature is 0, else temperature / top-k / min-p / top-p with a Philox draw keyed
    /// by (seed, `ctl.row_ids[b]`, `pos[b] + 1`), the algorithm of `kiln::sample::sample`.
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
    /// KV cache geometry (the cache is `[layer][slot][kv_head][capacity][head_dim]` bf16).
    pub layers: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
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

    /// The id of a weight, added on first use (tied embeddings share one id).
    pub fn weight(&mut self, name: &str, rows: usize, cols: usize) -> WeightId {
        if let Some(i) = self.weights.iter().position(|w| w.name == name) {
            return i;
        }
        self.weights.push(Weight {
            name: name.into(),
            rows,
            cols,
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
        }
        Ok(())
    }
}

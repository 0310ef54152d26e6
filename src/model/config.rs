//! The hyper-parameters every architecture builder reads, independent of the file format they
//! came from. HF `config.json` and GGUF metadata are both mapped onto this one struct.

use serde::Serialize;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Architecture {
    /// `LlamaForCausalLM` and relatives (SmolLM2, Llama 3.x, TinyLlama, Qwen2).
    Llama,
    /// `MistralForCausalLM`: the Llama block with sliding-window attention on every layer.
    Mistral,
    /// `Qwen3ForCausalLM`: the Llama block with per-head RMSNorm of q and k before RoPE.
    Qwen3,
    /// `Phi3ForCausalLM`: the Llama block with fused `qkv_proj` and `gate_up_proj`.
    Phi3,
    /// `Gemma3ForCausalLM` (text): scaled embedding, sandwich norms, q/k norm, GELU-tanh MLP,
    /// local sliding-window layers with their own RoPE base and a global layer every few.
    Gemma3,
    /// nanochat's GPT in its published form (HF `NanoChatForCausalLM`, era A of the spec).
    NanoChat,
}

impl Architecture {
    pub fn name(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Mistral => "mistral",
            Architecture::Qwen3 => "qwen3",
            Architecture::Phi3 => "phi3",
            Architecture::Gemma3 => "gemma3",
            Architecture::NanoChat => "nanochat",
        }
    }
}

/// How RoPE pairs up the dimensions of a head and which way it rotates.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum RopeStyle {
    /// HF `rotate_half`: pairs (i, i + D/2), rotation by +θ.
    HalfSplit,
    /// GPT-J / llama.cpp "normal" mode: pairs (2i, 2i + 1), rotation by +θ. GGUF llama files store
    /// q/k rows permuted for this layout, so it yields the same attention as `HalfSplit` on HF weights.
    Interleaved,
    /// nanochat: pairs (i, i + D/2), rotation by −θ (`y1 = x1·cos + x2·sin`).
    HalfSplitNegated,
}

#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub enum RopeScaling {
    /// Positions divided by `factor` (HF `rope_type: linear`).
    Linear { factor: f32 },
    /// Llama 3.1's frequency-dependent scaling (HF `rope_type: llama3`).
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_max_position_embeddings: f32,
    },
}

#[derive(Clone, Debug, Serialize)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub intermediate_size: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    pub rope_scaling: Option<RopeScaling>,
    pub rope_style: RopeStyle,
    /// Longest sequence the model was built for; generation stops cleanly there.
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// q/k/v projections carry a bias (Qwen2).
    pub attention_bias: bool,
    /// `logits = cap · tanh(logits / cap)` when set (nanochat).
    pub final_logit_softcap: Option<f32>,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    /// Sliding-window attention as Hugging Face counts it: a query attends to the last
    /// `sliding_window` keys, itself included (Mistral on every layer, Gemma 3 on its local
    /// layers); `None` is plain causal attention.
    pub sliding_window: Option<usize>,
    /// What Gemma 3 adds; `None` for every other architecture.
    pub gemma3: Option<Gemma3Params>,
    /// nanochat's own checkpoint format (converted by `scripts/convert_nanochat.py`), with the
    /// features its era adds; `None` for the HF `NanoChatForCausalLM` form and for Llama.
    pub nanochat: Option<NanochatNative>,
}

/// Gemma 3's hyper-parameters beyond the Llama set.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Gemma3Params {
    /// Attention scores are scaled by `query_pre_attn_scalar^-1/2` (not `head_dim^-1/2`).
    pub query_pre_attn_scalar: f32,
    /// RoPE base of the local (sliding-window) layers; `rope_theta` is the global layers'.
    pub rope_local_theta: f32,
    /// Per layer: `true` for a global (full attention) layer, `false` for a local one.
    pub global_layers: Vec<bool>,
}

/// What a nanochat era adds to the published design (spec §0); every field is resolved by the
/// converter, so the builder never guesses from an era letter.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct NanochatNative {
    /// The era the converter detected (A–H).
    pub era: String,
    /// Rows of `wte`/`lm_head`/`value_embeds` (vocabulary padded to a multiple of 64).
    pub padded_vocab_size: usize,
    /// Per layer: attention sees keys `p − w ..= p`; `None` is plain causal attention.
    pub window_sizes: Vec<Option<usize>>,
    /// Layers with a value embedding and its gate.
    pub value_embed_layers: Vec<usize>,
    /// Input channels of the value-embedding gate (32 or 12) and its output scale (2 or 3).
    pub ve_gate_channels: usize,
    pub ve_gate_scale: f32,
    /// Multiplies q and k after QK-norm (1.0, 1.15, 1.2).
    pub qk_scale: f32,
    /// `x = resid_lambdas[i]·x + x0_lambdas[i]·x0` before every block.
    pub resid_lambdas: bool,
    /// Bigram smear of the embedding (era H).
    pub smear: bool,
    /// `x -= backout_lambda · (residual after this layer)` before the head (era H).
    pub backout_layer: Option<usize>,
}

impl ModelConfig {
    /// The `Attention` op's window for `layer` (keys `p − w ..= p`), from the Hugging Face
    /// count of keys: `sliding_window` keys including the query's own is a reach of `w − 1`.
    /// Gemma 3's global layers have none.
    pub fn attention_window(&self, layer: usize) -> Option<usize> {
        if let Some(g) = &self.gemma3 {
            if g.global_layers.get(layer).copied().unwrap_or(true) {
                return None;
            }
        }
        self.sliding_window.map(|w| w.saturating_sub(1))
    }

    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Parameters of the transformer as configured (embeddings counted once when tied).
    pub fn num_params(&self) -> usize {
        let (c, f, l, v) = (
            self.hidden_size,
            self.intermediate_size,
            self.num_layers,
            self.vocab_size,
        );
        let attn = c * self.q_dim() * 2 + c * self.kv_dim() * 2;
        let bias = if self.attention_bias {
            self.q_dim() + 2 * self.kv_dim()
        } else {
            0
        };
        let (mlp, norms) = match self.architecture {
            Architecture::Llama | Architecture::Mistral | Architecture::Phi3 => (3 * c * f, 2 * c),
            Architecture::Qwen3 => (3 * c * f, 2 * c + 2 * self.head_dim),
            Architecture::Gemma3 => (3 * c * f, 4 * c + 2 * self.head_dim),
            Architecture::NanoChat => (2 * c * f, 0),
        };
        let head = if self.tie_word_embeddings { 0 } else { v * c };
        let final_norm = match self.architecture {
            Architecture::NanoChat => 0,
            _ => c,
        };
        v * c + l * (attn + bias + mlp + norms) + final_norm + head
    }
}

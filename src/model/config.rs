//! The hyper-parameters every architecture builder reads, independent of the file format they
//! came from. HF `config.json` and GGUF metadata are both mapped onto this one struct.

use serde::Serialize;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Architecture {
    /// `LlamaForCausalLM` and relatives (SmolLM2, Llama 3.x, TinyLlama, Qwen2, Mistral).
    Llama,
    /// nanochat's GPT in its published form (HF `NanoChatForCausalLM`, era A of the spec).
    NanoChat,
}

impl Architecture {
    pub fn name(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
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
}

impl ModelConfig {
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
            Architecture::Llama => (3 * c * f, 2 * c),
            Architecture::NanoChat => (2 * c * f, 0),
        };
        let head = if self.tie_word_embeddings { 0 } else { v * c };
        let final_norm = match self.architecture {
            Architecture::Llama => c,
            Architecture::NanoChat => 0,
        };
        v * c + l * (attn + bias + mlp + norms) + final_norm + head
    }
}

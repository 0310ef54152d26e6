//! GGUF files (llama.cpp's format): the container is parsed in [`reader`], tensors (legacy
//! quantized blocks included, see [`crate::model::quant`]) stay memory-mapped, and this module maps llama metadata and tensor names
//! onto the same [`ModelConfig`] and Hugging Face tensor names that `config.json` models use, so the
//! architecture builders never need to know which format a model came from.

mod reader;
#[cfg(test)]
pub(crate) mod writer;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

pub use reader::{GgmlType, GgufFile, GgufTensorInfo, GgufValue, DEFAULT_ALIGNMENT, GGUF_MAGIC};

use super::validate::{self, Keys};
use super::{
    vocab, Architecture, DType, LoadError, Model, ModelConfig, RopeScaling, RopeStyle, Tensor,
    TensorBytes, Weights,
};
use crate::tokenizer::gguf::tokenizer_from_gguf;
use crate::tokenizer::SpecialTokens;

/// Architectures whose GGUF metadata and tensor names this module understands.
const SUPPORTED: &str = "llama";

impl GgufFile {
    /// One tensor as a [`Tensor`] named `name`: F32/F16/BF16 and the Q8_0/Q4_0/Q4_1 blocks stay
    /// mapped as stored, anything else is a [`LoadError::DType`].
    pub fn load_tensor(&self, info: &GgufTensorInfo, name: &str) -> Result<Tensor, LoadError> {
        let dtype = match info.ggml_type {
            GgmlType::F32 => Some(DType::F32),
            GgmlType::F16 => Some(DType::F16),
            GgmlType::BF16 => Some(DType::BF16),
            GgmlType::Q8_0 => Some(DType::Q8_0),
            GgmlType::Q4_0 => Some(DType::Q4_0),
            GgmlType::Q4_1 => Some(DType::Q4_1),
            _ => None,
        };
        match dtype {
            // The reader checked that `len` holds the tensor's elements (whole blocks per row).
            Some(dtype) if dtype.bytes_for(info.numel()) == Some(info.len) => Ok(Tensor {
                name: name.to_string(),
                shape: info.shape(),
                dtype,
                bytes: TensorBytes::Mapped {
                    map: Arc::clone(&self.map),
                    offset: info.start,
                    len: info.len,
                },
            }),
            _ => Err(LoadError::DType {
                path: self.path.clone(),
                name: info.name.clone(),
                dtype: info.ggml_type.to_string(),
            }),
        }
    }
}

/// Loads a llama-architecture GGUF file: config, tokenizer and all weights.
pub fn load(path: &Path) -> Result<Model, LoadError> {
    let file = GgufFile::open(path)?;
    let arch = file.get_str("general.architecture")?;
    if arch != "llama" {
        return Err(LoadError::UnknownArchitecture {
            path: path.to_path_buf(),
            found: arch.to_string(),
            supported: SUPPORTED,
        });
    }
    let tokenizer = tokenizer_from_gguf(&file)?;
    let mut config = llama_config(&file, &tokenizer.specials)?;
    vocab::fit_to_tokenizer(&mut config, &tokenizer);
    let (weights, weight_type) = load_weights(&file)?;
    Ok(Model {
        path: path.to_path_buf(),
        config,
        weights,
        tokenizer,
        weight_type,
    })
}

/// Maps `llama.*` metadata onto [`ModelConfig`]; key names follow llama.cpp's `LLM_KV_*`.
pub fn llama_config(file: &GgufFile, specials: &SpecialTokens) -> Result<ModelConfig, LoadError> {
    let path = &file.path;
    let usize_of = |key: &str| file.get_u32(key).map(|v| v as usize);
    let positive = |key: &str| -> Result<usize, LoadError> {
        match usize_of(key)? {
            0 => Err(LoadError::config(path, key, "must be positive")),
            v => Ok(v),
        }
    };

    if file.tensor("rope_freqs.weight").is_some() {
        return Err(LoadError::tensor(
            path,
            "rope_freqs.weight",
            "per-dimension RoPE frequency factors (llama3-style rope scaling) are not supported yet",
        ));
    }

    let vocab_size = match file.opt_u32("llama.vocab_size")? {
        Some(v) => v as usize,
        None => match file.get("tokenizer.ggml.tokens") {
            Some(_) => file.get_str_array("tokenizer.ggml.tokens")?.len(),
            None => {
                return Err(LoadError::config(
                    path,
                    "llama.vocab_size",
                    "missing, and there is no tokenizer.ggml.tokens list to count",
                ))
            }
        },
    };
    let hidden_size = positive("llama.embedding_length")?;
    let num_layers = positive("llama.block_count")?;
    let num_heads = positive("llama.attention.head_count")?;
    let num_kv_heads = match file.opt_u32("llama.attention.head_count_kv")? {
        Some(v) => v as usize,
        None => num_heads,
    };
    if num_kv_heads == 0 || num_heads % num_kv_heads != 0 {
        return Err(LoadError::config(
            path,
            "llama.attention.head_count_kv",
            format!("{num_kv_heads} does not divide the {num_heads} query heads"),
        ));
    }
    let head_dim = match file.opt_u32("llama.attention.key_length")? {
        Some(v) if v > 0 => v as usize,
        Some(_) => {
            return Err(LoadError::config(
                path,
                "llama.attention.key_length",
                "must be positive",
            ))
        }
        None if hidden_size % num_heads == 0 => hidden_size / num_heads,
        None => {
            return Err(LoadError::config(
                path,
                "llama.attention.head_count",
                format!("{num_heads} heads do not divide embedding_length {hidden_size}"),
            ))
        }
    };
    if let Some(v) = file.opt_u32("llama.attention.value_length")? {
        if v as usize != head_dim {
            return Err(LoadError::config(
                path,
                "llama.attention.value_length",
                format!("{v} differs from the key length {head_dim}, which is not supported"),
            ));
        }
    }
    // Partial rotary embeddings (RoPE on the first n dimensions of a head) are not implemented;
    // a file asking for them must not run as if it rotated every dimension.
    if let Some(n) = file.opt_u32("llama.rope.dimension_count")? {
        if n as usize != head_dim {
            return Err(LoadError::config(
                path,
                "llama.rope.dimension_count",
                format!(
                    "RoPE on {n} of the {head_dim} dimensions of a head (partial rotary) is not \
                     supported; kiln rotates whole heads"
                ),
            ));
        }
    }
    let intermediate_size = positive("llama.feed_forward_length")?;
    let rms_norm_eps = file.get_f32("llama.attention.layer_norm_rms_epsilon")?;
    let rope_theta = file.opt_f32("llama.rope.freq_base")?.unwrap_or(10000.0);
    let rope_scaling = rope_scaling(file)?;
    let max_position_embeddings = positive("llama.context_length")?;

    let config = ModelConfig {
        architecture: Architecture::Llama,
        vocab_size,
        hidden_size,
        num_layers,
        num_heads,
        num_kv_heads,
        head_dim,
        intermediate_size,
        rms_norm_eps,
        rope_theta,
        rope_scaling,
        // llama.cpp's converter permutes q/k rows so that adjacent pairs rotate together; the
        // weights are kept as stored and the rotation follows them.
        rope_style: RopeStyle::Interleaved,
        max_position_embeddings,
        tie_word_embeddings: file.tensor("output.weight").is_none(),
        attention_bias: file.tensor("blk.0.attn_q.bias").is_some(),
        final_logit_softcap: None,
        bos_token_id: specials.bos_token_id,
        eos_token_ids: specials.eos_token_ids.clone(),
        nanochat: None,
    };
    validate::check(path, &config, &Keys::gguf("llama"))?;
    Ok(config)
}

fn rope_scaling(file: &GgufFile) -> Result<Option<RopeScaling>, LoadError> {
    const TYPE: &str = "llama.rope.scaling.type";
    const FACTOR: &str = "llama.rope.scaling.factor";
    let factor = match file.opt_str(TYPE)? {
        None | Some("none") => match file.opt_f32("llama.rope.scale_linear")? {
            // The key older converters wrote for linear scaling.
            Some(f) if f != 1.0 => f,
            _ => return Ok(None),
        },
        Some("linear") => file.get_f32(FACTOR)?,
        Some(other) => {
            return Err(LoadError::config(
                file.path.as_path(),
                TYPE,
                format!("rope scaling `{other}` is not supported (kiln supports: linear)"),
            ))
        }
    };
    if !(factor.is_finite() && factor > 0.0) {
        return Err(LoadError::config(
            file.path.as_path(),
            FACTOR,
            format!("expected a positive factor, found {factor}"),
        ));
    }
    Ok(Some(RopeScaling::Linear { factor }))
}

/// Hugging Face's name for a llama GGUF tensor; names it does not know pass through unchanged so
/// that extra tensors stay reachable (and reported) instead of failing the load.
pub fn hf_name(gguf: &str) -> String {
    match gguf {
        "token_embd.weight" => return "model.embed_tokens.weight".into(),
        "output_norm.weight" => return "model.norm.weight".into(),
        "output.weight" => return "lm_head.weight".into(),
        _ => {}
    }
    let layer_part = gguf.strip_prefix("blk.").and_then(|rest| {
        let (layer, tail) = rest.split_once('.')?;
        layer.parse::<usize>().ok()?;
        let (base, suffix) = tail.split_once('.')?;
        if suffix != "weight" && suffix != "bias" {
            return None;
        }
        let hf = match base {
            "attn_norm" => "input_layernorm",
            "attn_q" => "self_attn.q_proj",
            "attn_k" => "self_attn.k_proj",
            "attn_v" => "self_attn.v_proj",
            "attn_output" => "self_attn.o_proj",
            "ffn_norm" => "post_attention_layernorm",
            "ffn_gate" => "mlp.gate_proj",
            "ffn_up" => "mlp.up_proj",
            "ffn_down" => "mlp.down_proj",
            _ => return None,
        };
        Some(format!("model.layers.{layer}.{hf}.{suffix}"))
    });
    layer_part.unwrap_or_else(|| gguf.to_string())
}

/// Every tensor under its Hugging Face name, plus the most common ggml type among the 2-D
/// tensors (the matrices that dominate size and speed), which is what a report should call the
/// model's weight type. Ties go to the type seen first in the file.
fn load_weights(file: &GgufFile) -> Result<(Weights, String), LoadError> {
    let mut weights = Weights::new(&file.path);
    let mut counts: BTreeMap<GgmlType, (usize, usize)> = BTreeMap::new();
    for (i, info) in file.tensors.iter().enumerate() {
        let name = hf_name(&info.name);
        if weights.contains(&name) {
            return Err(LoadError::tensor(
                &file.path,
                &info.name,
                format!("maps to `{name}`, which another tensor already uses"),
            ));
        }
        weights.insert(file.load_tensor(info, &name)?);
        if info.dims.len() == 2 {
            counts.entry(info.ggml_type).or_insert((0, i)).0 += 1;
        }
    }
    let weight_type = counts
        .iter()
        .max_by_key(|(_, &(n, first))| (n, std::cmp::Reverse(first)))
        .map(|(t, _)| t.to_string())
        .unwrap_or_else(|| "none".to_string());
    Ok((weights, weight_type))
}

#[cfg(test)]
mod tests;

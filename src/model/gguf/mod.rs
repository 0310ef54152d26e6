//! GGUF files (llama.cpp's format): the container is parsed in [`crate::files::gguf`], tensors (quantized
//! blocks included, see [`crate::model::quant`]) stay memory-mapped, and this module maps llama metadata and tensor names
//! onto the same [`ModelConfig`] and Hugging Face tensor names that `config.json` models use, so the
//! architecture builders never need to know which format a model came from.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use crate::files::gguf::{GgmlType, GgufFile, GgufTensorInfo};

use super::validate::{self, Keys};
use super::{
    vocab, Architecture, DType, Gemma3Params, LoadError, Model, ModelConfig, RopeScaling,
    RopeStyle, Tensor, TensorBytes, Weights,
};
use crate::tokenizer::gguf::tokenizer_from_gguf;
use crate::tokenizer::SpecialTokens;

/// Architectures whose GGUF metadata and tensor names this module understands.
const SUPPORTED: &str = "llama, qwen2, qwen3, phi3, gemma3";

/// The kiln architecture a GGUF `general.architecture` maps to.
fn architecture(name: &str) -> Option<Architecture> {
    Some(match name {
        "llama" | "qwen2" => Architecture::Llama,
        "qwen3" => Architecture::Qwen3,
        "phi3" => Architecture::Phi3,
        "gemma3" => Architecture::Gemma3,
        _ => return None,
    })
}

impl GgufFile {
    /// One tensor as a [`Tensor`] named `name`: F32/F16/BF16 and the block formats of
    /// [`crate::model::quant`] (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K…Q6_K, Q8_K) stay mapped as
    /// stored, anything else is a [`LoadError::DType`].
    pub fn load_tensor(&self, info: &GgufTensorInfo, name: &str) -> Result<Tensor, LoadError> {
        let dtype = match info.ggml_type {
            GgmlType::F32 => Some(DType::F32),
            GgmlType::F16 => Some(DType::F16),
            GgmlType::BF16 => Some(DType::BF16),
            GgmlType::Q8_0 => Some(DType::Q8_0),
            GgmlType::Q4_0 => Some(DType::Q4_0),
            GgmlType::Q4_1 => Some(DType::Q4_1),
            GgmlType::Q5_0 => Some(DType::Q5_0),
            GgmlType::Q5_1 => Some(DType::Q5_1),
            GgmlType::Q2_K => Some(DType::Q2_K),
            GgmlType::Q3_K => Some(DType::Q3_K),
            GgmlType::Q4_K => Some(DType::Q4_K),
            GgmlType::Q5_K => Some(DType::Q5_K),
            GgmlType::Q6_K => Some(DType::Q6_K),
            GgmlType::Q8_K => Some(DType::Q8_K),
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

/// Loads a GGUF file of a supported architecture: config, tokenizer and all weights.
pub fn load(path: &Path) -> Result<Model, LoadError> {
    let file = GgufFile::open(path)?;
    let arch = file.get_str("general.architecture")?.to_string();
    let family = architecture(&arch).ok_or_else(|| LoadError::UnknownArchitecture {
        path: path.to_path_buf(),
        found: arch.clone(),
        supported: SUPPORTED,
    })?;
    let tokenizer = tokenizer_from_gguf(&file)?;
    let mut config = gguf_config(&file, &arch, family, &tokenizer.specials)?;
    vocab::fit_to_tokenizer(&mut config, &tokenizer);
    let (mut weights, weight_type) = load_weights(&file, family)?;
    if family == Architecture::Phi3 {
        crate::model::arch_weights::phi3_split_fused(&config, &mut weights)?;
    }
    Ok(Model {
        path: path.to_path_buf(),
        config,
        weights,
        tokenizer,
        weight_type,
    })
}

/// Maps `{arch}.*` metadata onto [`ModelConfig`]; key names follow llama.cpp's `LLM_KV_*`.
pub fn gguf_config(
    file: &GgufFile,
    arch: &str,
    family: Architecture,
    specials: &SpecialTokens,
) -> Result<ModelConfig, LoadError> {
    let path = &file.path;
    let key = |k: &str| format!("{arch}.{k}");
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

    let vocab_size = match file.opt_u32(&key("vocab_size"))? {
        Some(v) => v as usize,
        None => match file.get("tokenizer.ggml.tokens") {
            Some(_) => file.get_str_array("tokenizer.ggml.tokens")?.len(),
            None => {
                return Err(LoadError::config(
                    path,
                    &key("vocab_size"),
                    "missing, and there is no tokenizer.ggml.tokens list to count",
                ))
            }
        },
    };
    let hidden_size = positive(&key("embedding_length"))?;
    let num_layers = positive(&key("block_count"))?;
    let num_heads = positive(&key("attention.head_count"))?;
    let num_kv_heads = match file.opt_u32(&key("attention.head_count_kv"))? {
        Some(v) => v as usize,
        None => num_heads,
    };
    if num_kv_heads == 0 || num_heads % num_kv_heads != 0 {
        return Err(LoadError::config(
            path,
            &key("attention.head_count_kv"),
            format!("{num_kv_heads} does not divide the {num_heads} query heads"),
        ));
    }
    let head_dim = match file.opt_u32(&key("attention.key_length"))? {
        Some(v) if v > 0 => v as usize,
        Some(_) => {
            return Err(LoadError::config(
                path,
                &key("attention.key_length"),
                "must be positive",
            ))
        }
        None if hidden_size % num_heads == 0 => hidden_size / num_heads,
        None => {
            return Err(LoadError::config(
                path,
                &key("attention.head_count"),
                format!("{num_heads} heads do not divide embedding_length {hidden_size}"),
            ))
        }
    };
    if let Some(v) = file.opt_u32(&key("attention.value_length"))? {
        if v as usize != head_dim {
            return Err(LoadError::config(
                path,
                &key("attention.value_length"),
                format!("{v} differs from the key length {head_dim}, which is not supported"),
            ));
        }
    }
    // Partial rotary embeddings (RoPE on the first n dimensions of a head) are not implemented;
    // a file asking for them must not run as if it rotated every dimension.
    if let Some(n) = file.opt_u32(&key("rope.dimension_count"))? {
        if n as usize != head_dim {
            return Err(LoadError::config(
                path,
                &key("rope.dimension_count"),
                format!(
                    "RoPE on {n} of the {head_dim} dimensions of a head (partial rotary) is not \
                     supported; kiln rotates whole heads"
                ),
            ));
        }
    }
    let intermediate_size = positive(&key("feed_forward_length"))?;
    let rms_norm_eps = file.get_f32(&key("attention.layer_norm_rms_epsilon"))?;
    let rope_theta = file.opt_f32(&key("rope.freq_base"))?.unwrap_or(10000.0);
    let rope_scaling = rope_scaling(file, arch)?;
    let max_position_embeddings = positive(&key("context_length"))?;
    for t in ["rope_factors_long.weight", "rope_factors_short.weight"] {
        if file.tensor(t).is_some() {
            return Err(LoadError::tensor(
                path,
                t,
                "Phi-3 long-context RoPE factors (longrope) are not supported yet",
            ));
        }
    }
    let sliding_window = match file.opt_u32(&key("attention.sliding_window"))? {
        Some(0) => {
            return Err(LoadError::config(
                path,
                &key("attention.sliding_window"),
                "must be positive",
            ))
        }
        w => w.map(|w| w as usize),
    };
    // llama.cpp writes Mistral as `llama`; a sliding window is what sets it apart.
    let family = match family {
        Architecture::Llama if arch == "llama" && sliding_window.is_some() => Architecture::Mistral,
        f => f,
    };
    let gemma3 = match family {
        Architecture::Gemma3 => Some(Gemma3Params {
            // llama.cpp scales Gemma 3's scores by 1/√head_dim (the 27B model excepted, whose
            // query_pre_attn_scalar is hidden/heads); the GGUF has no key for it.
            query_pre_attn_scalar: head_dim as f32,
            rope_local_theta: file.opt_f32(&key("rope.freq_base_swa"))?.unwrap_or(10000.0),
            // llama.cpp's Gemma 3 pattern: every sixth layer is global.
            global_layers: (0..num_layers).map(|i| (i + 1) % 6 == 0).collect(),
        }),
        _ => None,
    };
    // llama.cpp's converter permutes llama's q/k rows so that adjacent pairs rotate together
    // (the weights are kept as stored and the rotation follows them); the other architectures
    // keep Hugging Face's row order and rotate halves (llama.cpp's NEOX mode).
    let rope_style = if arch == "llama" {
        RopeStyle::Interleaved
    } else {
        RopeStyle::HalfSplit
    };

    let config = ModelConfig {
        architecture: family,
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
        rope_style,
        max_position_embeddings,
        tie_word_embeddings: file.tensor("output.weight").is_none(),
        attention_bias: file.tensor("blk.0.attn_q.bias").is_some(),
        final_logit_softcap: None,
        bos_token_id: specials.bos_token_id,
        eos_token_ids: specials.eos_token_ids.clone(),
        sliding_window,
        gemma3,
        nanochat: None,
    };
    validate::check(path, &config, &Keys::gguf(arch))?;
    Ok(config)
}

fn rope_scaling(file: &GgufFile, arch: &str) -> Result<Option<RopeScaling>, LoadError> {
    let type_key = format!("{arch}.rope.scaling.type");
    let factor_key = format!("{arch}.rope.scaling.factor");
    let factor = match file.opt_str(&type_key)? {
        None | Some("none") => match file.opt_f32(&format!("{arch}.rope.scale_linear"))? {
            // The key older converters wrote for linear scaling.
            Some(f) if f != 1.0 => f,
            _ => return Ok(None),
        },
        Some("linear") => file.get_f32(&factor_key)?,
        Some(other) => {
            return Err(LoadError::config(
                file.path.as_path(),
                &type_key,
                format!("rope scaling `{other}` is not supported (kiln supports: linear)"),
            ))
        }
    };
    if !(factor.is_finite() && factor > 0.0) {
        return Err(LoadError::config(
            file.path.as_path(),
            &factor_key,
            format!("expected a positive factor, found {factor}"),
        ));
    }
    Ok(Some(RopeScaling::Linear { factor }))
}

/// Hugging Face's name for a llama GGUF tensor; names it does not know pass through unchanged so
/// that extra tensors stay reachable (and reported) instead of failing the load.
pub fn hf_name(gguf: &str) -> String {
    hf_name_for(Architecture::Llama, gguf)
}

/// Hugging Face's name for a GGUF tensor of `family`. The same GGUF name can mean different
/// things: `ffn_norm` is Llama's `post_attention_layernorm` (the norm before the MLP) but
/// Gemma 3's `pre_feedforward_layernorm` (Gemma's `post_attention_layernorm` is
/// `post_attention_norm`), and Phi-3's `ffn_up` is the fused `gate_up_proj`.
pub fn hf_name_for(family: Architecture, gguf: &str) -> String {
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
        let gemma = family == Architecture::Gemma3;
        let phi3 = family == Architecture::Phi3;
        let hf = match base {
            "attn_norm" => "input_layernorm",
            "attn_q" => "self_attn.q_proj",
            "attn_k" => "self_attn.k_proj",
            "attn_v" => "self_attn.v_proj",
            "attn_qkv" if phi3 => "self_attn.qkv_proj",
            "attn_q_norm" => "self_attn.q_norm",
            "attn_k_norm" => "self_attn.k_norm",
            "attn_output" => "self_attn.o_proj",
            "ffn_norm" if gemma => "pre_feedforward_layernorm",
            "ffn_norm" => "post_attention_layernorm",
            "post_attention_norm" if gemma => "post_attention_layernorm",
            "post_ffw_norm" if gemma => "post_feedforward_layernorm",
            "ffn_gate" => "mlp.gate_proj",
            "ffn_up" if phi3 => "mlp.gate_up_proj",
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
fn load_weights(file: &GgufFile, family: Architecture) -> Result<(Weights, String), LoadError> {
    let mut weights = Weights::new(&file.path);
    let mut counts: BTreeMap<GgmlType, (usize, usize)> = BTreeMap::new();
    for (i, info) in file.tensors.iter().enumerate() {
        let name = hf_name_for(family, &info.name);
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

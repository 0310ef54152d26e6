//! Hugging Face model directories: `config.json`, `model.safetensors` (or a sharded
//! `model.safetensors.index.json`), `tokenizer.json`, `tokenizer_config.json` and
//! `generation_config.json`. Weights stay memory-mapped.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use memmap2::Mmap;
use serde_json::Value;

use super::validate::{self, positive_finite, Keys};
use super::{
    vocab, Architecture, DType, Gemma3Params, LoadError, Model, ModelConfig, NanochatNative,
    RopeScaling, RopeStyle, Tensor, TensorBytes, Weights,
};
use crate::files::{self, MAX_SIDE_FILE, MAX_TOKENIZER_JSON};
use crate::tokenizer::{SpecialTokens, Tokenizer};

pub fn load(dir: &Path) -> Result<Model, LoadError> {
    let config_path = dir.join("config.json");
    let config_json = read_json(&config_path)?;
    let gen_path = dir.join("generation_config.json");
    let gen_json = if files::present(&gen_path) {
        Some(read_json(&gen_path)?)
    } else {
        None
    };
    let config = parse_config(&config_path, &config_json, gen_json.as_ref())?;
    let mut weights = load_safetensors_dir(dir)?;
    match config.architecture {
        Architecture::Phi3 => super::arch_weights::phi3_split_fused(&config, &mut weights)?,
        Architecture::Gemma3 => super::arch_weights::gemma3_hf_norm_weights(&mut weights),
        _ => {}
    }
    let tokenizer = load_tokenizer(dir, &config)?;
    let mut config = config;
    vocab::fit_to_tokenizer(&mut config, &tokenizer);
    let weight_type = dominant_dtype(&weights);
    Ok(Model {
        path: dir.to_path_buf(),
        config,
        weights,
        tokenizer,
        weight_type,
    })
}

fn read_json(path: &Path) -> Result<Value, LoadError> {
    let bytes = files::read_capped(path, MAX_SIDE_FILE)?;
    serde_json::from_slice(&bytes).map_err(|e| LoadError::json(path, e))
}

/// Typed access to config fields with errors that name the field.
struct Fields<'a> {
    path: &'a Path,
    json: &'a Value,
}

impl Fields<'_> {
    fn usize(&self, key: &str) -> Result<usize, LoadError> {
        self.opt_usize(key)?
            .ok_or_else(|| LoadError::config(self.path, key, "missing"))
    }

    fn opt_usize(&self, key: &str) -> Result<Option<usize>, LoadError> {
        match self.json.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_u64()
                .filter(|&n| n > 0)
                .map(|n| Some(n as usize))
                .ok_or_else(|| {
                    LoadError::config(
                        self.path,
                        key,
                        format!("expected a positive integer, found {v}"),
                    )
                }),
        }
    }

    fn opt_f32(&self, key: &str) -> Result<Option<f32>, LoadError> {
        opt_f32_in(self.path, self.json, key)
    }

    fn opt_bool(&self, key: &str) -> Result<Option<bool>, LoadError> {
        match self.json.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(LoadError::config(
                self.path,
                key,
                format!("expected true or false, found {v}"),
            )),
        }
    }
}

fn opt_f32_in(path: &Path, json: &Value, key: &str) -> Result<Option<f32>, LoadError> {
    match json.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .map(|x| Some(x as f32))
            .ok_or_else(|| LoadError::config(path, key, format!("expected a number, found {v}"))),
    }
}

/// `eos_token_id` may be an integer or a list of them; anything but token ids (a negative
/// number, one past `u32`, a string) is an error rather than something to truncate or skip.
fn token_ids(path: &Path, json: &Value, key: &str) -> Result<Vec<u32>, LoadError> {
    let id = |v: &Value| {
        v.as_u64()
            .and_then(|x| u32::try_from(x).ok())
            .ok_or_else(|| {
                LoadError::config(
                    path,
                    key,
                    format!("expected a token id (an integer below 2^32), found {v}"),
                )
            })
    };
    match json.get(key) {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(a)) => a.iter().map(id).collect(),
        Some(v) => Ok(vec![id(v)?]),
    }
}

/// An object-valued field (`rope_scaling`): absent or null is `None`, anything but an object
/// is an error (silently ignoring it would drop the scaling it was meant to give).
fn opt_object<'a>(path: &Path, json: &'a Value, key: &str) -> Result<Option<&'a Value>, LoadError> {
    match json.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) if v.is_object() => Ok(Some(v)),
        Some(v) => Err(LoadError::config(
            path,
            key,
            format!("expected an object, found {v}"),
        )),
    }
}

const SUPPORTED: &str = "llama, mistral, qwen2, qwen3, phi3, gemma3_text, nanochat";

pub(crate) fn parse_config(
    path: &Path,
    json: &Value,
    generation: Option<&Value>,
) -> Result<ModelConfig, LoadError> {
    let f = Fields { path, json };
    if json.get("model_type").and_then(Value::as_str) == Some("nanochat_native") {
        return parse_nanochat_native(path, json);
    }
    let model_type = json
        .get("model_type")
        .and_then(Value::as_str)
        .ok_or_else(|| LoadError::config(path, "model_type", "missing"))?;
    let architecture = match model_type {
        "llama" | "qwen2" => Architecture::Llama,
        "mistral" => Architecture::Mistral,
        "qwen3" => Architecture::Qwen3,
        "phi3" => Architecture::Phi3,
        "gemma3_text" => Architecture::Gemma3,
        "nanochat" => Architecture::NanoChat,
        other => {
            return Err(LoadError::UnknownArchitecture {
                path: path.to_path_buf(),
                found: other.to_string(),
                supported: SUPPORTED,
            })
        }
    };
    let hidden_size = f.usize("hidden_size")?;
    let num_heads = f.usize("num_attention_heads")?;
    let num_kv_heads = f.opt_usize("num_key_value_heads")?.unwrap_or(num_heads);
    if num_heads % num_kv_heads != 0 {
        return Err(LoadError::config(
            path,
            "num_key_value_heads",
            format!("{num_kv_heads} does not divide num_attention_heads {num_heads}"),
        ));
    }
    let head_dim = match f.opt_usize("head_dim")? {
        Some(d) => d,
        None if hidden_size % num_heads == 0 => hidden_size / num_heads,
        None => {
            return Err(LoadError::config(
                path,
                "head_dim",
                format!(
                    "missing, and hidden_size {hidden_size} is not a multiple of {num_heads} heads"
                ),
            ))
        }
    };
    if head_dim % 2 != 0 {
        return Err(LoadError::config(
            path,
            "head_dim",
            format!("{head_dim} is odd; RoPE needs pairs"),
        ));
    }
    // transformers 5 folds rope_theta and rope_scaling into `rope_parameters`; Gemma 3 keeps
    // one such object per attention type.
    let rope_all = opt_object(path, json, "rope_parameters")?;
    let rope_params = match rope_all.and_then(|p| p.get("full_attention")) {
        Some(full) if full.is_object() => Some(full),
        _ => rope_all,
    };
    let rope_theta = match rope_params {
        Some(p) => opt_f32_in(path, p, "rope_theta")?,
        None => None,
    }
    .or(f.opt_f32("rope_theta")?)
    .unwrap_or(10000.0);
    if let Some(p) = rope_params {
        match opt_f32_in(path, p, "partial_rotary_factor")? {
            None | Some(1.0) => {}
            Some(f) => {
                return Err(LoadError::config(
                    path,
                    "rope_parameters.partial_rotary_factor",
                    format!("{f}: RoPE on part of each head is not supported"),
                ))
            }
        }
    }
    let scaling_json = match rope_params {
        Some(p) => Some(("rope_parameters", p)),
        None => opt_object(path, json, "rope_scaling")?.map(|s| ("rope_scaling", s)),
    };
    let rope_scaling = match scaling_json {
        Some((key, s)) => parse_rope_scaling(path, key, s)?,
        None => None,
    };
    let (rope_style, default_tie, default_bias) = match (architecture, model_type) {
        (Architecture::NanoChat, _) => (RopeStyle::HalfSplitNegated, false, false),
        (Architecture::Gemma3, _) => (RopeStyle::HalfSplit, true, false),
        (_, "qwen2") => (RopeStyle::HalfSplit, false, true),
        _ => (RopeStyle::HalfSplit, false, false),
    };
    let attention_bias = f.opt_bool("attention_bias")?.unwrap_or(default_bias);
    let final_logit_softcap = match architecture {
        Architecture::NanoChat | Architecture::Gemma3 => f.opt_f32("final_logit_softcapping")?,
        _ => None,
    };
    let num_layers = f.usize("num_hidden_layers")?;
    let sliding_window = sliding_window(&f, architecture, model_type)?;
    let gemma3 = match architecture {
        Architecture::Gemma3 => Some(gemma3_params(&f, rope_all, head_dim, num_layers)?),
        _ => None,
    };
    let mut eos_token_ids = token_ids(path, json, "eos_token_id")?;
    let mut bos_token_id = token_ids(path, json, "bos_token_id")?.first().copied();
    if let Some(g) = generation {
        // generation_config.json is what `generate` stops on; it may list several ids.
        let gen_path = path.with_file_name("generation_config.json");
        let gen_eos = token_ids(&gen_path, g, "eos_token_id")?;
        if !gen_eos.is_empty() {
            eos_token_ids = gen_eos;
        }
        if let Some(b) = token_ids(&gen_path, g, "bos_token_id")?.first() {
            bos_token_id = Some(*b);
        }
    }
    let config = ModelConfig {
        architecture,
        vocab_size: f.usize("vocab_size")?,
        hidden_size,
        num_layers,
        num_heads,
        num_kv_heads,
        head_dim,
        intermediate_size: f.usize("intermediate_size")?,
        rms_norm_eps: f.opt_f32("rms_norm_eps")?.unwrap_or(1e-6),
        rope_theta,
        rope_scaling,
        rope_style,
        max_position_embeddings: f.opt_usize("max_position_embeddings")?.unwrap_or(2048),
        tie_word_embeddings: f.opt_bool("tie_word_embeddings")?.unwrap_or(default_tie),
        attention_bias,
        final_logit_softcap,
        bos_token_id,
        eos_token_ids,
        sliding_window,
        gemma3,
        nanochat: None,
    };
    validate::check(path, &config, &Keys::hf())?;
    Ok(config)
}

/// The sliding window an architecture applies (Hugging Face's count of keys, the query's own
/// included): Mistral and Phi-3 on every layer, Gemma 3 on its local layers. Qwen's
/// `use_sliding_window` (off in every released Qwen2/Qwen3 model) is refused rather than ignored.
fn sliding_window(
    f: &Fields<'_>,
    architecture: Architecture,
    model_type: &str,
) -> Result<Option<usize>, LoadError> {
    match architecture {
        Architecture::Mistral | Architecture::Phi3 | Architecture::Gemma3 => {
            f.opt_usize("sliding_window")
        }
        Architecture::Llama | Architecture::Qwen3
            if model_type.starts_with("qwen")
                && f.opt_bool("use_sliding_window")? == Some(true) =>
        {
            Err(LoadError::config(
                f.path,
                "use_sliding_window",
                "Qwen's per-layer sliding window (max_window_layers) is not supported",
            ))
        }
        _ => Ok(None),
    }
}

/// Gemma 3's extras: `query_pre_attn_scalar`, the local layers' RoPE base
/// (`rope_parameters.sliding_attention.rope_theta` in transformers 5, `rope_local_base_freq`
/// before) and which layers are global (`layer_types`, or every `sliding_window_pattern`-th).
fn gemma3_params(
    f: &Fields<'_>,
    rope_all: Option<&Value>,
    head_dim: usize,
    num_layers: usize,
) -> Result<Gemma3Params, LoadError> {
    if f.opt_f32("attn_logit_softcapping")?.is_some() {
        return Err(LoadError::config(
            f.path,
            "attn_logit_softcapping",
            "attention logit soft-capping (Gemma 2) is not supported",
        ));
    }
    match f.json.get("hidden_activation").and_then(Value::as_str) {
        None | Some("gelu_pytorch_tanh") => {}
        Some(other) => {
            return Err(LoadError::config(
                f.path,
                "hidden_activation",
                format!("`{other}` is not supported (kiln supports gelu_pytorch_tanh)"),
            ))
        }
    }
    let local = match rope_all.and_then(|p| p.get("sliding_attention")) {
        Some(p) => opt_f32_in(f.path, p, "rope_theta")?,
        None => None,
    };
    let rope_local_theta = match local {
        Some(t) => t,
        None => f.opt_f32("rope_local_base_freq")?.unwrap_or(10000.0),
    };
    let global_layers = match f.json.get("layer_types") {
        Some(Value::Array(types)) => types
            .iter()
            .map(|t| match t.as_str() {
                Some("full_attention") => Ok(true),
                Some("sliding_attention") => Ok(false),
                _ => Err(LoadError::config(
                    f.path,
                    "layer_types",
                    format!("{t} is neither \"full_attention\" nor \"sliding_attention\""),
                )),
            })
            .collect::<Result<Vec<bool>, LoadError>>()?,
        _ => {
            let pattern = f.opt_usize("sliding_window_pattern")?.unwrap_or(6);
            (0..num_layers).map(|i| (i + 1) % pattern == 0).collect()
        }
    };
    if global_layers.len() != num_layers {
        return Err(LoadError::config(
            f.path,
            "layer_types",
            format!("{} entries for {num_layers} layers", global_layers.len()),
        ));
    }
    Ok(Gemma3Params {
        query_pre_attn_scalar: f
            .opt_f32("query_pre_attn_scalar")?
            .unwrap_or(head_dim as f32),
        rope_local_theta,
        global_layers,
    })
}

/// The `config.json` written by `scripts/convert_nanochat.py`.
fn parse_nanochat_native(path: &Path, json: &Value) -> Result<ModelConfig, LoadError> {
    let f = Fields { path, json };
    let num_layers = f.usize("n_layer")?;
    let num_heads = f.usize("n_head")?;
    let num_kv_heads = f.usize("n_kv_head")?;
    let hidden_size = f.usize("n_embd")?;
    let head_dim = f
        .opt_usize("head_dim")?
        .unwrap_or(hidden_size / num_heads.max(1));
    if num_heads.checked_mul(head_dim).is_none() {
        return Err(LoadError::config(
            path,
            "head_dim",
            format!("{num_heads} heads × {head_dim} overflows"),
        ));
    }
    if num_heads * head_dim != hidden_size || num_heads % num_kv_heads != 0 {
        return Err(LoadError::config(
            path,
            "n_head",
            format!("{num_heads} heads × {head_dim} ≠ n_embd {hidden_size}, or n_kv_head {num_kv_heads} does not divide it"),
        ));
    }
    let ints = |key: &str| -> Result<Vec<i64>, LoadError> {
        json.get(key)
            .and_then(Value::as_array)
            .ok_or_else(|| LoadError::config(path, key, "missing or not a list"))?
            .iter()
            .map(|v| {
                v.as_i64()
                    .ok_or_else(|| LoadError::config(path, key, format!("{v} is not an integer")))
            })
            .collect()
    };
    let window_sizes: Vec<Option<usize>> = ints("window_sizes")?
        .into_iter()
        .map(|w| usize::try_from(w).ok().filter(|&w| w > 0))
        .collect();
    if window_sizes.len() != num_layers {
        return Err(LoadError::config(
            path,
            "window_sizes",
            format!("{} entries for {num_layers} layers", window_sizes.len()),
        ));
    }
    let value_embed_layers: Vec<usize> = ints("value_embed_layers")?
        .into_iter()
        .map(|l| usize::try_from(l).ok().filter(|&l| l < num_layers))
        .collect::<Option<_>>()
        .ok_or_else(|| {
            LoadError::config(path, "value_embed_layers", "a layer index is out of range")
        })?;
    let flag = |key: &str| f.opt_bool(key).map(|b| b.unwrap_or(false));
    let vocab_size = f.usize("vocab_size")?;
    let bos = token_ids(path, json, "bos_token_id")?.first().copied();
    let assistant_end = match json.get("special_tokens") {
        Some(s) => token_ids(path, s, "assistant_end")?.first().copied(),
        None => None,
    };
    let intermediate_size = hidden_size
        .checked_mul(4)
        .ok_or_else(|| LoadError::config(path, "n_embd", format!("4 × {hidden_size} overflows")))?;
    let sequence_len = f.usize("sequence_len")?;
    // nanochat's rotary cache covers ten times the training length.
    let max_position_embeddings = sequence_len.checked_mul(10).ok_or_else(|| {
        LoadError::config(
            path,
            "sequence_len",
            format!("10 × {sequence_len} overflows"),
        )
    })?;
    let backout_layer = match json.get("backout_layer") {
        None | Some(Value::Null) => None,
        Some(v) => Some(
            v.as_u64()
                .and_then(|l| usize::try_from(l).ok())
                .ok_or_else(|| {
                    LoadError::config(
                        path,
                        "backout_layer",
                        format!("expected a layer index, found {v}"),
                    )
                })?,
        ),
    };
    let config = ModelConfig {
        architecture: Architecture::NanoChat,
        vocab_size,
        hidden_size,
        num_layers,
        num_heads,
        num_kv_heads,
        head_dim,
        intermediate_size,
        rms_norm_eps: f.opt_f32("rms_norm_eps")?.unwrap_or(f32::EPSILON),
        rope_theta: f.opt_f32("rope_theta")?.unwrap_or(10000.0),
        rope_scaling: None,
        rope_style: RopeStyle::HalfSplitNegated,
        max_position_embeddings,
        tie_word_embeddings: false,
        attention_bias: false,
        final_logit_softcap: f.opt_f32("softcap")?,
        bos_token_id: bos,
        eos_token_ids: assistant_end.into_iter().collect(),
        sliding_window: None,
        gemma3: None,
        nanochat: Some(NanochatNative {
            era: json
                .get("era")
                .and_then(Value::as_str)
                .unwrap_or("?")
                .to_string(),
            padded_vocab_size: f.opt_usize("padded_vocab_size")?.unwrap_or(vocab_size),
            window_sizes,
            value_embed_layers,
            ve_gate_channels: f.opt_usize("ve_gate_channels")?.unwrap_or(0),
            ve_gate_scale: f.opt_f32("ve_gate_scale")?.unwrap_or(0.0),
            qk_scale: f.opt_f32("qk_scale")?.unwrap_or(1.0),
            resid_lambdas: flag("resid_lambdas")?,
            smear: flag("smear")?,
            backout_layer,
        }),
    };
    validate::check(path, &config, &Keys::nanochat_native())?;
    Ok(config)
}

/// `rope_scaling` (or transformers 5's `rope_parameters`, named by `field`).
fn parse_rope_scaling(
    path: &Path,
    field: &str,
    s: &Value,
) -> Result<Option<RopeScaling>, LoadError> {
    let kind = match s.get("rope_type").or_else(|| s.get("type")) {
        None | Some(Value::Null) => "default",
        Some(Value::String(k)) => k.as_str(),
        Some(v) => {
            return Err(LoadError::config(
                path,
                &format!("{field}.rope_type"),
                format!("expected a string, found {v}"),
            ))
        }
    };
    let num = |key: &str| -> Result<f32, LoadError> {
        let name = format!("{field}.{key}");
        let x =
            opt_f32_in(path, s, key)?.ok_or_else(|| LoadError::config(path, &name, "missing"))?;
        positive_finite(path, &name, x, key)
    };
    match kind {
        "default" => Ok(None),
        "linear" => Ok(Some(RopeScaling::Linear {
            factor: num("factor")?,
        })),
        "llama3" => Ok(Some(RopeScaling::Llama3 {
            factor: num("factor")?,
            low_freq_factor: num("low_freq_factor")?,
            high_freq_factor: num("high_freq_factor")?,
            original_max_position_embeddings: num("original_max_position_embeddings")?,
        })),
        other => Err(LoadError::config(
            path,
            &format!("{field}.rope_type"),
            format!("`{other}` is not supported (kiln supports default, linear, llama3)"),
        )),
    }
}

fn load_safetensors_dir(dir: &Path) -> Result<Weights, LoadError> {
    let index = dir.join("model.safetensors.index.json");
    let single = dir.join("model.safetensors");
    if files::present(&single) {
        let mut w = Weights::new(&single);
        add_safetensors_file(&single, &mut w)?;
        return Ok(w);
    }
    if !files::present(&index) {
        return Err(LoadError::format(
            dir,
            "no model.safetensors or model.safetensors.index.json in this directory",
        ));
    }
    let json = read_json(&index)?;
    let map = json
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(|| LoadError::config(&index, "weight_map", "missing or not an object"))?;
    let mut files: Vec<&str> = map.values().filter_map(Value::as_str).collect();
    files.sort_unstable();
    files.dedup();
    let mut w = Weights::new(&index);
    for file in files {
        if file.contains(['/', '\\']) || file.contains("..") {
            return Err(LoadError::config(
                &index,
                "weight_map",
                format!("shard path `{file}` leaves the model directory"),
            ));
        }
        add_safetensors_file(&dir.join(file), &mut w)?;
    }
    for (name, file) in map {
        if !w.contains(name) {
            return Err(LoadError::tensor(
                &index,
                name,
                format!("listed in weight_map under {file} but not found in that shard"),
            ));
        }
    }
    Ok(w)
}

/// Largest safetensors header accepted (the `safetensors` crate's own limit).
const MAX_SAFETENSORS_HEADER: u64 = 100_000_000;

/// Maps one safetensors file and adds its tensors. The header is parsed here rather than by the
/// `safetensors` crate so that every error names the tensor it is about.
fn add_safetensors_file(path: &Path, weights: &mut Weights) -> Result<(), LoadError> {
    let file = files::open_regular(path)?;
    // SAFETY: the map is read-only; a file truncated underneath a running process is the one
    // hazard of mmap, the same contract every mmap-based loader accepts.
    let map = Arc::new(unsafe { Mmap::map(&file) }.map_err(|e| LoadError::io(path, e))?);
    let bad =
        |reason: String| LoadError::format(path, format!("not a valid safetensors file: {reason}"));
    let header_len = map
        .get(..8)
        .map(|b| u64::from_le_bytes(b.try_into().unwrap_or_default()))
        .ok_or_else(|| {
            bad(format!(
                "{} bytes, shorter than the 8-byte header length",
                map.len()
            ))
        })?;
    let data_start = usize::try_from(header_len)
        .ok()
        .filter(|_| header_len <= MAX_SAFETENSORS_HEADER)
        .and_then(|n| n.checked_add(8))
        .filter(|&end| end <= map.len())
        .ok_or_else(|| {
            bad(format!(
                "the header claims {header_len} bytes; the file has {} (and at most \
                 {MAX_SAFETENSORS_HEADER} are accepted)",
                map.len()
            ))
        })?;
    let header: serde_json::Map<String, Value> =
        serde_json::from_slice(&map[8..data_start]).map_err(|e| bad(format!("header: {e}")))?;
    for (name, info) in &header {
        if name == "__metadata__" {
            continue;
        }
        let t = safetensors_entry(path, name, info, data_start, map.len())?;
        if weights.contains(name) {
            return Err(LoadError::tensor(
                path,
                name,
                "is stored twice (in two shards)",
            ));
        }
        weights.insert(Tensor {
            name: name.clone(),
            shape: t.shape,
            dtype: t.dtype,
            bytes: TensorBytes::Mapped {
                map: map.clone(),
                offset: t.offset,
                len: t.len,
            },
        });
    }
    Ok(())
}

/// One header entry, checked: a dtype kiln reads, a shape whose size fits, and a data range that
/// holds exactly that many bytes inside the file.
struct Entry {
    shape: Vec<usize>,
    dtype: DType,
    offset: usize,
    len: usize,
}

fn safetensors_entry(
    path: &Path,
    name: &str,
    info: &Value,
    data_start: usize,
    file_len: usize,
) -> Result<Entry, LoadError> {
    let err = |reason: String| LoadError::tensor(path, name, reason);
    let dtype = match info.get("dtype").and_then(Value::as_str) {
        Some("F32") => DType::F32,
        Some("F16") => DType::F16,
        Some("BF16") => DType::BF16,
        Some(other) => {
            return Err(LoadError::DType {
                path: path.to_path_buf(),
                name: name.to_string(),
                dtype: other.to_string(),
            })
        }
        None => {
            return Err(err(format!(
                "no \"dtype\" string in its header entry {info}"
            )))
        }
    };
    let shape = info
        .get("shape")
        .and_then(Value::as_array)
        .and_then(|dims| {
            dims.iter()
                .map(|d| d.as_u64().and_then(|d| usize::try_from(d).ok()))
                .collect::<Option<Vec<usize>>>()
        })
        .ok_or_else(|| err(format!("\"shape\" is not a list of sizes in {info}")))?;
    let offsets = info
        .get("data_offsets")
        .and_then(Value::as_array)
        .and_then(|o| match o.as_slice() {
            [a, b] => Some((a.as_u64()?, b.as_u64()?)),
            _ => None,
        })
        .ok_or_else(|| err(format!("\"data_offsets\" is not [start, end] in {info}")))?;
    let expected = shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .and_then(|n| dtype.bytes_for(n))
        .ok_or_else(|| err(format!("the byte size of {dtype} {shape:?} overflows")))?;
    let (start, end) = offsets;
    let range = usize::try_from(start)
        .ok()
        .zip(usize::try_from(end).ok())
        .filter(|(s, e)| s <= e && e - s == expected)
        .and_then(|(s, e)| Some((data_start.checked_add(s)?, data_start.checked_add(e)?)))
        .filter(|&(_, e)| e <= file_len);
    match range {
        Some((offset, end)) => Ok(Entry {
            shape,
            dtype,
            offset,
            len: end - offset,
        }),
        None => Err(err(format!(
            "data range {start}..{end} does not hold {expected} bytes of {dtype} {shape:?} \
             within the file ({file_len} bytes, data from byte {data_start})"
        ))),
    }
}

fn load_tokenizer(dir: &Path, config: &ModelConfig) -> Result<Tokenizer, LoadError> {
    let tok_path = dir.join("tokenizer.json");
    let json = files::read_capped(&tok_path, MAX_TOKENIZER_JSON)?;
    let mut specials = SpecialTokens {
        bos_token_id: config.bos_token_id,
        eos_token_ids: config.eos_token_ids.clone(),
        add_bos_token: false,
        chat_template: None,
        ordinary_text: config.nanochat.is_some(),
    };
    let cfg_path = dir.join("tokenizer_config.json");
    let mut bos_text = None;
    let mut eos_text = None;
    if files::present(&cfg_path) {
        let cfg = read_json(&cfg_path)?;
        specials.add_bos_token = cfg
            .get("add_bos_token")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        specials.chat_template = chat_template_field(cfg.get("chat_template"));
        let text = |v: Option<&Value>| -> Option<String> {
            match v? {
                Value::String(s) => Some(s.clone()),
                Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_string),
                _ => None,
            }
        };
        bos_text = text(cfg.get("bos_token"));
        eos_text = text(cfg.get("eos_token"));
    }
    // transformers 5 writes the template to its own file.
    let jinja = dir.join("chat_template.jinja");
    if specials.chat_template.is_none() && files::present(&jinja) {
        let bytes = files::read_capped(&jinja, MAX_SIDE_FILE)?;
        let text = String::from_utf8(bytes)
            .map_err(|_| LoadError::format(&jinja, "the chat template is not UTF-8 text"))?;
        specials.chat_template = Some(text);
    }
    let mut tok = Tokenizer::from_json(&json, &tok_path, specials)?;
    if tok.specials.bos_token_id.is_none() {
        tok.specials.bos_token_id = bos_text.and_then(|t| tok.token_to_id(&t));
    }
    if tok.specials.eos_token_ids.is_empty() {
        if let Some(id) = eos_text.and_then(|t| tok.token_to_id(&t)) {
            tok.specials.eos_token_ids.push(id);
        }
    }
    Ok(tok)
}

/// `chat_template` is a string, or a list of `{name, template}` of which "default" is the one.
fn chat_template_field(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Array(list) => list
            .iter()
            .find(|e| e.get("name").and_then(Value::as_str) == Some("default"))
            .and_then(|e| e.get("template"))
            .and_then(Value::as_str)
            .map(str::to_string),
        _ => None,
    }
}

pub(crate) fn dominant_dtype(weights: &Weights) -> String {
    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    for t in weights.tensors.values().filter(|t| t.shape.len() == 2) {
        *counts.entry(t.dtype.to_string()).or_default() += t.numel();
    }
    counts
        .into_iter()
        .max_by_key(|(_, n)| *n)
        .map(|(k, _)| k)
        .unwrap_or_else(|| "none".into())
}

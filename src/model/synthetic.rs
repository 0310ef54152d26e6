//! Random-weight models of a named shape, built in memory without any file: what `kiln-bench
//! --synthetic` times when the question is "how fast is a model of this shape" and no checkpoint
//! of that shape is at hand (a Llama-3.2-1B-shaped model for the GPU bandwidth target).
//!
//! The shapes are Hugging Face `config.json` objects in `synthetic_shapes.json`, parsed by the
//! same code as a real model's config; `scripts/torch_compare.py` reads the same file, so kiln
//! and PyTorch time the same architecture. Weights are bf16, deterministic from a seed (and
//! independent of thread count): every matrix draws from an approximately normal distribution
//! with standard deviation `initializer_range` (0.02, what transformers initialises with), every
//! norm weight is 1. With that scale a pre-norm residual stream grows roughly with the square
//! root of depth, so activations and logits stay finite over many layers (tested where the CPU
//! backend runs these models, `backend/cpu/synthetic_models.rs`).
//! The tokenizer is [`Tokenizer::bytes_only`]: the benchmark feeds token ids, not text.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use half::bf16;
use rayon::prelude::*;
use serde_json::Value;

use super::{hf, Architecture, DType, LoadError, Model, ModelConfig, Tensor, TensorBytes, Weights};
use crate::tokenizer::Tokenizer;

/// The shape table, shared with `scripts/torch_compare.py`.
pub const SHAPES_JSON: &str = include_str!("synthetic_shapes.json");

/// Elements drawn from one RNG stream: chunks make generation parallel and the result
/// independent of how many threads ran it.
const CHUNK: usize = 1 << 16;

fn shapes() -> Result<serde_json::Map<String, Value>, LoadError> {
    match serde_json::from_str(SHAPES_JSON) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(LoadError::format(
            "synthetic_shapes.json",
            "expected an object of shapes",
        )),
        Err(e) => Err(LoadError::json("synthetic_shapes.json", e)),
    }
}

/// Names of the known shapes (`llama-3.2-1b`, `smollm2-135m`, `tiny`), sorted. (Sorted here:
/// a JSON object's key order is its file's when serde_json preserves order, as a dependency
/// turns on.)
pub fn shape_names() -> Vec<String> {
    let mut names: Vec<String> = shapes()
        .map(|m| m.keys().filter(|k| !k.starts_with('_')).cloned().collect())
        .unwrap_or_default();
    names.sort();
    names
}

/// The path a synthetic model reports (in errors, in `Model::path`): `synthetic:NAME`.
pub fn label(name: &str) -> PathBuf {
    PathBuf::from(format!("synthetic:{name}"))
}

/// A shape's config and the standard deviation of its random matrices.
pub fn shape_config(name: &str) -> Result<(ModelConfig, f32), LoadError> {
    let path = label(name);
    let all = shapes()?;
    let json = all
        .get(name)
        .filter(|_| !name.starts_with('_'))
        .ok_or_else(|| {
            LoadError::format(
                &path,
                format!(
                    "no synthetic shape named `{name}` (known: {})",
                    shape_names().join(", ")
                ),
            )
        })?;
    let config = hf::parse_config(&path, json, None)?;
    let std = json
        .get("initializer_range")
        .and_then(Value::as_f64)
        .ok_or_else(|| LoadError::config(&path, "initializer_range", "missing"))?;
    Ok((config, std as f32))
}

/// The named shape with random bf16 weights drawn from `seed`.
pub fn load(name: &str, seed: u64) -> Result<Model, LoadError> {
    let (config, std) = shape_config(name)?;
    build(config, std, seed, &label(name))
}

/// A Llama-architecture model of any config with random bf16 weights (matrices of standard
/// deviation `std`, norms 1, biases 0).
pub fn build(config: ModelConfig, std: f32, seed: u64, path: &Path) -> Result<Model, LoadError> {
    if config.architecture != Architecture::Llama {
        return Err(LoadError::format(
            path,
            format!(
                "synthetic models are built for the llama architecture, not {}",
                config.architecture.name()
            ),
        ));
    }
    let mut weights = Weights::new(path);
    for (name, shape, init) in llama_tensors(&config) {
        let n: usize = shape.iter().product();
        let values = match init {
            Init::Random => random_bf16(n, std, stream_key(seed, &name)),
            Init::Ones => bf16::ONE.to_le_bytes().repeat(n),
            Init::Zeros => vec![0; 2 * n],
        };
        weights.insert(Tensor {
            name,
            shape,
            dtype: DType::BF16,
            bytes: TensorBytes::Owned(Arc::new(values)),
        });
    }
    Ok(Model {
        path: path.to_path_buf(),
        tokenizer: Tokenizer::bytes_only(path, config.vocab_size)?,
        config,
        weights,
        weight_type: DType::BF16.to_string(),
    })
}

enum Init {
    Random,
    Ones,
    Zeros,
}

/// Every tensor `graph::build::llama` reads, with Hugging Face names and PyTorch shapes.
fn llama_tensors(c: &ModelConfig) -> Vec<(String, Vec<usize>, Init)> {
    let (h, q, kv, f) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
    let mut t = vec![(
        "model.embed_tokens.weight".to_string(),
        vec![c.vocab_size, h],
        Init::Random,
    )];
    for i in 0..c.num_layers {
        let p = format!("model.layers.{i}");
        t.push((format!("{p}.input_layernorm.weight"), vec![h], Init::Ones));
        t.push((
            format!("{p}.post_attention_layernorm.weight"),
            vec![h],
            Init::Ones,
        ));
        for (name, rows, cols) in [
            ("self_attn.q_proj", q, h),
            ("self_attn.k_proj", kv, h),
            ("self_attn.v_proj", kv, h),
            ("self_attn.o_proj", h, q),
            ("mlp.gate_proj", f, h),
            ("mlp.up_proj", f, h),
            ("mlp.down_proj", h, f),
        ] {
            t.push((format!("{p}.{name}.weight"), vec![rows, cols], Init::Random));
        }
        if c.attention_bias {
            for (name, rows) in [("q_proj", q), ("k_proj", kv), ("v_proj", kv)] {
                t.push((
                    format!("{p}.self_attn.{name}.bias"),
                    vec![rows],
                    Init::Zeros,
                ));
            }
        }
    }
    t.push(("model.norm.weight".to_string(), vec![h], Init::Ones));
    if !c.tie_word_embeddings {
        t.push((
            "lm_head.weight".to_string(),
            vec![c.vocab_size, h],
            Init::Random,
        ));
    }
    t
}

/// SplitMix64: a full-period 64-bit generator whose every output is a strong hash of its
/// counter, so a stream can start anywhere from a key.
fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The key of one tensor's stream: the seed mixed with the tensor's name (FNV-1a), so adding a
/// tensor never changes another's values.
fn stream_key(seed: u64, name: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
    }
    let mut s = seed ^ h;
    splitmix(&mut s)
}

/// `n` values with mean 0 and standard deviation `std`, as little-endian bf16 bytes (written in
/// place: a 1B model is 2.5 GB, too much to build twice): each is the sum of four 16-bit uniforms
/// from one 64-bit draw (Irwin–Hall, a bell curve bounded at ±2√3·std), rescaled. One draw per
/// value keeps a billion-parameter model quick to build; its bound keeps every value finite.
fn random_bf16(n: usize, std: f32, key: u64) -> Vec<u8> {
    // The sum of four uniforms on [0, 65536) has standard deviation 65536·√(4/12) = 65536/√3.
    let scale = std * 3f32.sqrt() / 65536.0;
    let mut out = vec![0u8; 2 * n];
    out.par_chunks_mut(2 * CHUNK)
        .enumerate()
        .for_each(|(c, chunk)| {
            let mut s = key ^ (c as u64).wrapping_mul(0xD1B5_4A32_D192_ED03);
            splitmix(&mut s);
            for v in chunk.chunks_exact_mut(2) {
                let r = splitmix(&mut s);
                let sum = (r & 0xFFFF) + ((r >> 16) & 0xFFFF) + ((r >> 32) & 0xFFFF) + (r >> 48);
                let x = bf16::from_f32((sum as f32 - 2.0 * 65535.0) * scale);
                v.copy_from_slice(&x.to_le_bytes());
            }
        });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny(seed: u64) -> Model {
        load("tiny", seed).unwrap()
    }

    #[test]
    fn weights_have_the_configured_scale_and_are_thread_independent() {
        let n = 3 * CHUNK + 17;
        let v = random_bf16(n, 0.02, 99);
        assert_eq!(v.len(), 2 * n);
        let f: Vec<f32> = v
            .chunks_exact(2)
            .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect();
        let mean = f.iter().sum::<f32>() / n as f32;
        let sd = (f.iter().map(|x| (x - mean).powi(2)).sum::<f32>() / n as f32).sqrt();
        assert!(mean.abs() < 2e-4, "mean {mean}");
        assert!((sd - 0.02).abs() < 4e-4, "sd {sd}");
        assert!(f.iter().all(|x| x.abs() <= 2.0 * 3f32.sqrt() * 0.02 * 1.01));
        let serial = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap()
            .install(|| random_bf16(n, 0.02, 99));
        assert_eq!(v, serial);
    }

    #[test]
    fn shapes_match_the_models_they_name() {
        let (c, std) = shape_config("llama-3.2-1b").unwrap();
        assert_eq!(std, 0.02);
        assert_eq!(
            (
                c.hidden_size,
                c.num_layers,
                c.num_heads,
                c.num_kv_heads,
                c.head_dim
            ),
            (2048, 16, 32, 8, 64)
        );
        assert_eq!((c.intermediate_size, c.vocab_size), (8192, 128256));
        assert!(c.tie_word_embeddings);
        assert_eq!(c.rope_theta, 500000.0);
        assert_eq!(
            c.rope_scaling,
            Some(crate::model::RopeScaling::Llama3 {
                factor: 32.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192.0,
            })
        );
        // Meta's published parameter count for Llama 3.2 1B.
        assert_eq!(c.num_params(), 1_235_814_400);
        let (s, _) = shape_config("smollm2-135m").unwrap();
        // The demo model's count (the parameters its GGUF file holds).
        assert_eq!(s.num_params(), 134_515_008);
        assert_eq!((s.rope_theta, s.rope_scaling), (100000.0, None));
        assert_eq!(shape_names(), ["llama-3.2-1b", "smollm2-135m", "tiny"]);
    }

    #[test]
    fn a_built_model_has_every_tensor_the_config_counts() {
        let m = tiny(1);
        assert_eq!(m.weights.num_params(), m.config.num_params());
        assert_eq!(m.weight_type, "bf16");
        assert_eq!(m.path, Path::new("synthetic:tiny"));
        assert!(m.weights.tensors.values().all(|t| t.dtype == DType::BF16));
    }

    #[test]
    fn unknown_shapes_name_the_known_ones() {
        let e = load("llama-70b", 0).err().unwrap().to_string();
        assert!(
            e.contains("synthetic:llama-70b") && e.contains("llama-3.2-1b") && e.contains("tiny"),
            "{e}"
        );
        assert!(load("_comment", 0).is_err());
    }

    #[test]
    fn the_byte_tokenizer_maps_bytes_to_ids() {
        let t = &tiny(0).tokenizer;
        assert_eq!(t.vocab_size(), 256);
        assert_eq!(t.encode("hi é").unwrap(), [104, 105, 32, 0xc3, 0xa9]);
        assert_eq!(t.decode(&[104, 105, 32, 0xc3, 0xa9]).unwrap(), "hi é");
    }
}

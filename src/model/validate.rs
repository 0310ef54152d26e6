//! Checks a [`ModelConfig`] against what its architecture allows before anything is sized from
//! it. Every value came from a file: dimensions multiply into buffer sizes (so every product is
//! checked, not left to wrap), and hyper-parameters that can only produce NaN (a zero epsilon, a
//! non-positive RoPE base, a zero softcap) are refused rather than run. Errors name the field as
//! the file spells it, through [`Keys`].

use std::path::Path;

use super::{LoadError, ModelConfig, RopeScaling};

/// The names a file format gives the fields this module checks.
pub(crate) struct Keys {
    pub heads: String,
    pub kv_heads: String,
    pub head_dim: String,
    pub hidden: String,
    pub layers: String,
    pub intermediate: String,
    pub vocab: String,
    pub context: String,
    pub rms_norm_eps: String,
    pub rope_theta: String,
    pub rope_scaling: String,
    pub softcap: String,
}

impl Keys {
    fn of(names: [&str; 12]) -> Keys {
        let [heads, kv_heads, head_dim, hidden, layers, intermediate, vocab, context, eps, theta, scaling, softcap] =
            names.map(str::to_string);
        Keys {
            heads,
            kv_heads,
            head_dim,
            hidden,
            layers,
            intermediate,
            vocab,
            context,
            rms_norm_eps: eps,
            rope_theta: theta,
            rope_scaling: scaling,
            softcap,
        }
    }

    /// [`ModelConfig`]'s own field names, for configs that did not come from a file.
    pub fn config() -> Keys {
        Keys::of([
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "hidden_size",
            "num_layers",
            "intermediate_size",
            "vocab_size",
            "max_position_embeddings",
            "rms_norm_eps",
            "rope_theta",
            "rope_scaling",
            "final_logit_softcap",
        ])
    }

    /// Hugging Face `config.json`.
    pub fn hf() -> Keys {
        Keys::of([
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "hidden_size",
            "num_hidden_layers",
            "intermediate_size",
            "vocab_size",
            "max_position_embeddings",
            "rms_norm_eps",
            "rope_theta",
            "rope_scaling",
            "final_logit_softcapping",
        ])
    }

    /// The `config.json` of nanochat's converted checkpoints.
    pub fn nanochat_native() -> Keys {
        Keys::of([
            "n_head",
            "n_kv_head",
            "head_dim",
            "n_embd",
            "n_layer",
            "n_embd",
            "vocab_size",
            "sequence_len",
            "rms_norm_eps",
            "rope_theta",
            "rope_scaling",
            "softcap",
        ])
    }

    /// GGUF metadata of architecture `arch` (`llama.attention.head_count`, ...).
    pub fn gguf(arch: &str) -> Keys {
        let k = |s: &str| format!("{arch}.{s}");
        Keys {
            heads: k("attention.head_count"),
            kv_heads: k("attention.head_count_kv"),
            head_dim: k("attention.key_length"),
            hidden: k("embedding_length"),
            layers: k("block_count"),
            intermediate: k("feed_forward_length"),
            vocab: k("vocab_size"),
            context: k("context_length"),
            rms_norm_eps: k("attention.layer_norm_rms_epsilon"),
            rope_theta: k("rope.freq_base"),
            rope_scaling: k("rope.scaling.factor"),
            softcap: k("final_logit_softcapping"),
        }
    }
}

/// `x`, if it is finite and positive.
pub(crate) fn positive_finite(
    path: &Path,
    key: &str,
    x: f32,
    what: &str,
) -> Result<f32, LoadError> {
    if x.is_finite() && x > 0.0 {
        Ok(x)
    } else {
        Err(LoadError::config(
            path,
            key,
            format!("{what} must be a finite number greater than 0, found {x}"),
        ))
    }
}

/// Checks every dimension and hyper-parameter of `c`; see the module doc.
pub(crate) fn check(path: &Path, c: &ModelConfig, keys: &Keys) -> Result<(), LoadError> {
    let err = |key: &str, reason: String| LoadError::config(path, key, reason);
    for (key, v) in [
        (&keys.hidden, c.hidden_size),
        (&keys.layers, c.num_layers),
        (&keys.heads, c.num_heads),
        (&keys.kv_heads, c.num_kv_heads),
        (&keys.head_dim, c.head_dim),
        (&keys.intermediate, c.intermediate_size),
        (&keys.vocab, c.vocab_size),
        (&keys.context, c.max_position_embeddings),
    ] {
        if v == 0 {
            return Err(err(key, "must be at least 1, found 0".into()));
        }
    }
    if !c.num_heads.is_multiple_of(c.num_kv_heads) {
        return Err(err(
            &keys.kv_heads,
            format!(
                "{} does not divide the {} query heads",
                c.num_kv_heads, c.num_heads
            ),
        ));
    }
    if !c.head_dim.is_multiple_of(2) {
        return Err(err(
            &keys.head_dim,
            format!("{} is odd; RoPE rotates pairs of dimensions", c.head_dim),
        ));
    }
    // Products the builders and backends size weights, activations and caches with. Each is a
    // matrix the file must hold, so any real model keeps them far from overflow.
    let product = |key: &str, what: &str, a: usize, b: usize| {
        a.checked_mul(b)
            .ok_or_else(|| err(key, format!("{what} = {a} × {b} overflows")))
    };
    let q_dim = product(&keys.head_dim, "heads × head_dim", c.num_heads, c.head_dim)?;
    let kv_dim = product(
        &keys.head_dim,
        "kv_heads × head_dim",
        c.num_kv_heads,
        c.head_dim,
    )?;
    product(
        &keys.hidden,
        "hidden × heads × head_dim",
        c.hidden_size,
        q_dim,
    )?;
    product(
        &keys.hidden,
        "hidden × kv_heads × head_dim",
        c.hidden_size,
        kv_dim,
    )?;
    product(
        &keys.intermediate,
        "hidden × intermediate",
        c.hidden_size,
        c.intermediate_size,
    )?;
    product(&keys.vocab, "vocab × hidden", c.vocab_size, c.hidden_size)?;
    product(
        &keys.layers,
        "layers × kv_heads × head_dim",
        c.num_layers,
        kv_dim,
    )?;
    // Every product above fits, and so do these sums of them, unless the dimensions are near
    // the end of usize: checked here so that `num_params` and friends cannot wrap.
    let per_layer = (|| {
        let attn = c
            .hidden_size
            .checked_mul(q_dim.checked_add(kv_dim)?.checked_mul(2)?)?;
        let mlp = c
            .hidden_size
            .checked_mul(c.intermediate_size)?
            .checked_mul(3)?;
        attn.checked_add(mlp)?
            .checked_add(q_dim)?
            .checked_add(kv_dim.checked_mul(2)?)
    })();
    per_layer
        .and_then(|p| p.checked_mul(c.num_layers))
        .and_then(|p| p.checked_add(c.vocab_size.checked_mul(c.hidden_size)?.checked_mul(2)?))
        .ok_or_else(|| err(&keys.layers, "the parameter count overflows".into()))?;

    positive_finite(
        path,
        &keys.rms_norm_eps,
        c.rms_norm_eps,
        "the RMSNorm epsilon",
    )?;
    positive_finite(path, &keys.rope_theta, c.rope_theta, "the RoPE base")?;
    if let Some(cap) = c.final_logit_softcap {
        positive_finite(path, &keys.softcap, cap, "the logit softcap")?;
    }
    match c.rope_scaling {
        None => {}
        Some(RopeScaling::Linear { factor }) => {
            positive_finite(path, &keys.rope_scaling, factor, "the linear RoPE factor")?;
        }
        Some(RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        }) => {
            for (x, what) in [
                (factor, "factor"),
                (low_freq_factor, "low_freq_factor"),
                (high_freq_factor, "high_freq_factor"),
                (
                    original_max_position_embeddings,
                    "original_max_position_embeddings",
                ),
            ] {
                positive_finite(path, &keys.rope_scaling, x, what)?;
            }
            // The interpolation divides by their difference.
            if high_freq_factor <= low_freq_factor {
                return Err(err(
                    &keys.rope_scaling,
                    format!(
                        "llama3 scaling needs high_freq_factor ({high_freq_factor}) above \
                         low_freq_factor ({low_freq_factor})"
                    ),
                ));
            }
        }
    }
    if let Some(n) = &c.nanochat {
        if n.padded_vocab_size < c.vocab_size {
            return Err(err(
                "padded_vocab_size",
                format!(
                    "{} is smaller than vocab_size {}",
                    n.padded_vocab_size, c.vocab_size
                ),
            ));
        }
        product(
            "padded_vocab_size",
            "padded_vocab × hidden",
            n.padded_vocab_size,
            c.hidden_size,
        )?;
        product(
            "padded_vocab_size",
            "padded_vocab × kv_heads × head_dim",
            n.padded_vocab_size,
            kv_dim,
        )?;
        if !n.value_embed_layers.is_empty() && !(1..=c.hidden_size).contains(&n.ve_gate_channels) {
            return Err(err(
                "ve_gate_channels",
                format!(
                    "{} is not between 1 and the {} channels of the residual stream",
                    n.ve_gate_channels, c.hidden_size
                ),
            ));
        }
        for (x, key) in [(n.ve_gate_scale, "ve_gate_scale"), (n.qk_scale, "qk_scale")] {
            if !x.is_finite() {
                return Err(err(key, format!("must be finite, found {x}")));
            }
        }
        if n.smear && c.hidden_size < SMEAR_CHANNELS {
            return Err(err(
                &keys.hidden,
                format!(
                    "the smear gate reads {SMEAR_CHANNELS} channels, more than the {} there are",
                    c.hidden_size
                ),
            ));
        }
        if let Some(l) = n.backout_layer.filter(|&l| l >= c.num_layers) {
            return Err(err(
                "backout_layer",
                format!("layer {l} does not exist (the model has {})", c.num_layers),
            ));
        }
        if n.window_sizes.len() != c.num_layers {
            return Err(err(
                "window_sizes",
                format!(
                    "{} entries for {} layers",
                    n.window_sizes.len(),
                    c.num_layers
                ),
            ));
        }
    }
    Ok(())
}

/// Channels nanochat's bigram smear gate reads (`smear_gate.weight` is `[1, 24]`).
pub(crate) const SMEAR_CHANNELS: usize = 24;

//! What loaders do to an architecture's stored weights so that the graph builders see one layout
//! whatever the file: Phi-3's fused projections (`self_attn.qkv_proj`, `mlp.gate_up_proj`)
//! become named row ranges of the fused tensors, and Gemma 3's Hugging Face norm weights `w`
//! become `1 + w`.

use super::{LoadError, ModelConfig, Tensor, TensorBytes, Weights};

/// Adds `q_proj`/`k_proj`/`v_proj` and `gate_proj`/`up_proj` (weights, and biases when the fused
/// layer has one) for every layer, as row ranges of the fused tensors.
pub(crate) fn phi3_split_fused(
    config: &ModelConfig,
    weights: &mut Weights,
) -> Result<(), LoadError> {
    let c = config;
    let (q, kv, f) = (c.q_dim(), c.kv_dim(), c.intermediate_size);
    for i in 0..c.num_layers {
        let p = format!("model.layers.{i}");
        let attn = [("q_proj", 0, q), ("k_proj", q, kv), ("v_proj", q + kv, kv)];
        split(
            weights,
            &format!("{p}.self_attn.qkv_proj"),
            &format!("{p}.self_attn"),
            q + 2 * kv,
            c.hidden_size,
            &attn,
        )?;
        let mlp = [("gate_proj", 0, f), ("up_proj", f, f)];
        split(
            weights,
            &format!("{p}.mlp.gate_up_proj"),
            &format!("{p}.mlp"),
            2 * f,
            c.hidden_size,
            &mlp,
        )?;
    }
    Ok(())
}

/// Splits `fused.weight` (`[rows, cols]`) and `fused.bias` into `{prefix}.{name}.weight`/`.bias`
/// for each `(name, first row, rows)` part.
fn split(
    weights: &mut Weights,
    fused: &str,
    prefix: &str,
    rows: usize,
    cols: usize,
    parts: &[(&str, usize, usize)],
) -> Result<(), LoadError> {
    let w = weights.get_shaped(&format!("{fused}.weight"), &[rows, cols])?;
    let bias_name = format!("{fused}.bias");
    let b = if weights.contains(&bias_name) {
        Some(weights.get_shaped(&bias_name, &[rows])?)
    } else {
        None
    };
    let mut split = Vec::new();
    for &(name, first, n) in parts {
        split.push(row_range(
            w,
            &format!("{prefix}.{name}.weight"),
            first,
            n,
            cols,
        ));
        if let Some(b) = b {
            split.push(row_range(b, &format!("{prefix}.{name}.bias"), first, n, 1));
        }
    }
    for t in split {
        weights.insert(t);
    }
    Ok(())
}

/// Rows `first .. first + n` of a row-major tensor of `cols` columns (a 1-D tensor is `cols` 1),
/// sharing its bytes. Quantized rows are whole blocks, so a row range is a byte range.
fn row_range(t: &Tensor, name: &str, first: usize, n: usize, cols: usize) -> Tensor {
    let row_bytes = t.dtype.row_bytes(cols);
    let (start, len) = (first * row_bytes, n * row_bytes);
    let bytes = match &t.bytes {
        TensorBytes::Mapped { map, offset, .. } => TensorBytes::Mapped {
            map: map.clone(),
            offset: offset + start,
            len,
        },
        TensorBytes::Owned(v) => {
            TensorBytes::Owned(std::sync::Arc::new(v[start..start + len].to_vec()))
        }
    };
    let shape = if t.shape.len() == 1 {
        vec![n]
    } else {
        vec![n, cols]
    };
    Tensor {
        name: name.to_string(),
        shape,
        dtype: t.dtype,
        bytes,
    }
}

/// Hugging Face's Gemma 3 RMSNorm multiplies by `1 + w`; every `*norm.weight` becomes the f32
/// tensor `1 + w` so the builder's plain `x·w` norm applies (GGUF files store `w + 1` already).
pub(crate) fn gemma3_hf_norm_weights(weights: &mut Weights) {
    let norms: Vec<Tensor> = weights
        .tensors
        .values()
        .filter(|t| t.name.ends_with("norm.weight"))
        .map(|t| {
            let plus_one: Vec<f32> = t.to_f32_vec().into_iter().map(|w| 1.0 + w).collect();
            Tensor::from_f32(t.name.clone(), t.shape.clone(), plus_one)
        })
        .collect();
    for t in norms {
        weights.insert(t);
    }
}

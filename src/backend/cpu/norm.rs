//! RMSNorm, with or without a weight, over whole rows or over each head of a row. Statistics are
//! computed in f32, as PyTorch does on the CPU.

/// `out = x / sqrt(mean(x²) + eps) · w`
pub fn rms_norm(x: &[f32], weight: Option<&[f32]>, eps: f32, out: &mut [f32]) {
    let n = x.len();
    let ss: f32 = x.iter().map(|v| v * v).sum();
    let inv = 1.0 / (ss / n as f32 + eps).sqrt();
    match weight {
        Some(w) => {
            for i in 0..n {
                out[i] = w[i] * (x[i] * inv);
            }
        }
        None => {
            for i in 0..n {
                out[i] = x[i] * inv;
            }
        }
    }
}

/// RMSNorm without weight applied to each `head_dim` chunk of `x` in place.
pub fn head_norm_inplace(x: &mut [f32], head_dim: usize, eps: f32) {
    for head in x.chunks_exact_mut(head_dim) {
        let ss: f32 = head.iter().map(|v| v * v).sum();
        let inv = 1.0 / (ss / head_dim as f32 + eps).sqrt();
        for v in head.iter_mut() {
            *v *= inv;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unit_rms_after_norm_and_weight_applies() {
        let x = [3.0f32, -4.0, 0.0, 5.0];
        let mut out = [0.0; 4];
        rms_norm(&x, None, 0.0, &mut out);
        let ms: f32 = out.iter().map(|v| v * v).sum::<f32>() / 4.0;
        assert!((ms - 1.0).abs() < 1e-6);
        let mut w_out = [0.0; 4];
        rms_norm(&x, Some(&[2.0, 2.0, 2.0, 2.0]), 0.0, &mut w_out);
        assert!(w_out
            .iter()
            .zip(out)
            .all(|(a, b)| (a - 2.0 * b).abs() < 1e-6));
        let mut h = [1.0f32, 1.0, 2.0, 0.0];
        head_norm_inplace(&mut h, 2, 0.0);
        assert_eq!(h, [1.0, 1.0, 2f32.sqrt(), 0.0]);
    }
}

//! Rotary position frequencies, as Hugging Face computes them: f32 `1 / theta^(2i/d)`, then the
//! config's scaling. Every backend rotates with these.

use super::RopeSpec;
use crate::model::RopeScaling;

/// Per-pair inverse frequencies, scaling applied.
pub fn inv_freq(spec: &RopeSpec) -> Vec<f32> {
    let d = spec.head_dim;
    let base: Vec<f32> = (0..d / 2)
        .map(|i| 1.0 / spec.theta.powf((2 * i) as f32 / d as f32))
        .collect();
    match spec.scaling {
        None => base,
        Some(RopeScaling::Linear { factor }) => base.iter().map(|f| f / factor).collect(),
        Some(RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings: old,
        }) => {
            let low_wavelen = old / low_freq_factor;
            let high_wavelen = old / high_freq_factor;
            base.iter()
                .map(|&f| {
                    let wavelen = 2.0 * std::f32::consts::PI / f;
                    if wavelen < high_wavelen {
                        f
                    } else if wavelen > low_wavelen {
                        f / factor
                    } else {
                        let smooth = (old / wavelen - low_freq_factor)
                            / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                })
                .collect()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::RopeStyle;

    fn spec(style: RopeStyle) -> RopeSpec {
        RopeSpec {
            theta: 10000.0,
            head_dim: 8,
            style,
            scaling: None,
        }
    }

    #[test]
    fn llama3_scaling_keeps_high_and_divides_low_frequencies() {
        let mut s = spec(RopeStyle::HalfSplit);
        s.head_dim = 64;
        s.theta = 500000.0;
        let plain = inv_freq(&s);
        s.scaling = Some(RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192.0,
        });
        let scaled = inv_freq(&s);
        assert_eq!(scaled[0], plain[0]);
        assert!((scaled[31] - plain[31] / 8.0).abs() < 1e-12);
    }
}

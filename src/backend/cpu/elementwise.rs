//! Element-wise ops on rows.

use super::simd;
use crate::graph::Activation;

pub fn add(a: &[f32], b: &[f32], out: &mut [f32]) {
    for ((o, x), y) in out.iter_mut().zip(a).zip(b) {
        *o = x + y;
    }
}

pub fn mul(a: &[f32], b: &[f32], out: &mut [f32]) {
    for ((o, x), y) in out.iter_mut().zip(a).zip(b) {
        *o = x * y;
    }
}

pub fn act_inplace(x: &mut [f32], act: Activation) {
    for v in x {
        *v = act.apply(*v);
    }
}

/// `out = act(gate) · up`; SiLU through the SIMD level's `exp` ([`simd::silu_gated_at`]).
pub fn gated(gate: &[f32], up: &[f32], act: Activation, out: &mut [f32]) {
    if act == Activation::Silu {
        return simd::silu_gated_at(simd::level(), gate, up, out);
    }
    for ((o, g), u) in out.iter_mut().zip(gate).zip(up) {
        *o = act.apply(*g) * u;
    }
}

/// `cap · tanh(x / cap)`
pub fn softcap_inplace(x: &mut [f32], cap: f32) {
    for v in x {
        *v = cap * (*v / cap).tanh();
    }
}

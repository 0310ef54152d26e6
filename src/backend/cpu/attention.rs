//! Attention over the KV cache for the CPU: each (token, query head) pair is one task that
//! scores the cached keys of its KV head up to its own position, softmaxes in f32 and sums the
//! values. Grouped-query heads share the KV head `h / (heads / kv_heads)`, as `repeat_kv` does.

use rayon::prelude::*;

use super::simd;
use crate::backend::TokenRow;
use crate::kv::{KvCache, KvDtype};

pub struct AttentionShape {
    pub layer: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
    /// Keys older than `pos - window` are not attended (sliding-window layers).
    pub window: Option<usize>,
}

/// Called per attended position with its index, key row and value row.
type PositionFn<'a> = dyn FnMut(usize, &[f32], &[f32]) + 'a;

#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

/// Appends `k`/`v` of every token to the cache, then attends. Keys and values are read through
/// the slot's page table in the cache's one layout ([`crate::kv::layout`]); with f32 storage the
/// arithmetic is exactly that of a contiguous cache.
///
/// `q`, `k`, `v`, `out` are row views: `(data, stride, col)` with row `t` at
/// `data[t·stride + col ..]`.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    s: &AttentionShape,
    rows: &[TokenRow],
    q: (&[f32], usize, usize),
    k: (&[f32], usize, usize),
    v: (&[f32], usize, usize),
    kv: &mut KvCache,
    out: (&mut [f32], usize, usize),
) {
    let d = s.head_dim;
    let kv_dim = s.kv_heads * d;
    for (t, r) in rows.iter().enumerate() {
        let kr = &k.0[t * k.1 + k.2..t * k.1 + k.2 + kv_dim];
        let vr = &v.0[t * v.1 + v.2..t * v.1 + v.2 + kv_dim];
        kv.write(s.layer, r.slot, r.pos, kr, vr);
    }
    let kv = &*kv;
    let group = s.heads / s.kv_heads;
    let (out_data, out_stride, out_col) = out;
    assert!(
        rows.is_empty() || out_data.len() >= (rows.len() - 1) * out_stride + out_col + s.heads * d
    );
    let ptr = OutPtr(out_data.as_mut_ptr());
    let layout = *kv.layout();
    let f32_in_place = layout.dtype == KvDtype::F32;
    (0..rows.len() * s.heads).into_par_iter().for_each(|task| {
        let (t, h) = (task / s.heads, task % s.heads);
        let r = rows[t];
        let lo = s.window.map_or(0, |w| r.pos.saturating_sub(w));
        let n = r.pos + 1;
        let table = kv.page_table(r.slot);
        let qh = &q.0[t * q.1 + q.2 + h * d..t * q.1 + q.2 + (h + 1) * d];
        // One head's keys and values, a block at a time through the page table: read in place
        // when stored as f32, else decoded into this task's scratch.
        let bs = layout.block_size;
        let (mut kbuf, mut vbuf) = if f32_in_place {
            (Vec::new(), Vec::new())
        } else {
            (vec![0.0f32; bs * d], vec![0.0f32; bs * d])
        };
        let mut scores: Vec<f32> = Vec::with_capacity(n - lo);
        let mut each_block = |f: &mut PositionFn| {
            let mut start = lo - lo % bs;
            while start < n {
                let block = table[start / bs];
                let rows_here = bs.min(n - start);
                let (keys, values): (&[f32], &[f32]) = if f32_in_place {
                    kv.pool().head_block_f32(s.layer, block, h / group)
                } else {
                    kv.pool().decode_rows(
                        s.layer,
                        block,
                        h / group,
                        0,
                        rows_here,
                        &mut kbuf,
                        &mut vbuf,
                    );
                    (&kbuf, &vbuf)
                };
                for j in start.max(lo)..start + rows_here {
                    let o = (j - start) * d;
                    f(j, &keys[o..o + d], &values[o..o + d]);
                }
                start += bs;
            }
        };
        each_block(&mut |_, key, _| scores.push(simd::dot_f32(qh, key) * s.scale));
        let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0.0f32;
        for sc in &mut scores {
            *sc = (*sc - max).exp();
            sum += *sc;
        }
        let mut acc = vec![0.0f32; d];
        each_block(&mut |j, _, value| simd::axpy(scores[j - lo] / sum, value, &mut acc));
        let p = ptr;
        // SAFETY: each task writes its own `d` floats of row `t`, head `h`; bounds asserted above.
        unsafe {
            let dst = p.0.add(t * out_stride + out_col + h * d);
            std::ptr::copy_nonoverlapping(acc.as_ptr(), dst, d);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::KvSpec;

    /// One query attending over keys it matches exactly picks out those values.
    #[test]
    fn causal_gqa_attention_matches_a_direct_computation() {
        let (heads, kv_heads, d) = (4, 2, 3);
        let spec = KvSpec {
            layers: 1,
            kv_heads,
            head_dim: d,
            state_dim: 0,
        };
        let mut kv = KvCache::new(spec, 1, 8).unwrap();
        kv.prepare(0, 3).unwrap();
        let t = 3;
        let q: Vec<f32> = (0..t * heads * d)
            .map(|i| ((i * 7) % 5) as f32 * 0.3 - 0.5)
            .collect();
        let k: Vec<f32> = (0..t * kv_heads * d)
            .map(|i| ((i * 3) % 7) as f32 * 0.2 - 0.4)
            .collect();
        let v: Vec<f32> = (0..t * kv_heads * d).map(|i| i as f32 * 0.1).collect();
        let rows: Vec<TokenRow> = (0..t).map(|pos| TokenRow { slot: 0, pos }).collect();
        let mut out = vec![0.0; t * heads * d];
        let shape = AttentionShape {
            layer: 0,
            heads,
            kv_heads,
            head_dim: d,
            scale: 0.5,
            window: None,
        };
        attention(
            &shape,
            &rows,
            (&q, heads * d, 0),
            (&k, kv_heads * d, 0),
            (&v, kv_heads * d, 0),
            &mut kv,
            (&mut out, heads * d, 0),
        );
        for ti in 0..t {
            for h in 0..heads {
                let g = h / 2;
                let qh = &q[ti * heads * d + h * d..][..d];
                let s: Vec<f64> = (0..=ti)
                    .map(|j| {
                        let kj = &k[j * kv_heads * d + g * d..][..d];
                        qh.iter().zip(kj).map(|(a, b)| (a * b) as f64).sum::<f64>() * 0.5
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::MIN, f64::max);
                let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for c in 0..d {
                    let want: f64 = (0..=ti)
                        .map(|j| e[j] / z * v[j * kv_heads * d + g * d + c] as f64)
                        .sum();
                    let got = out[ti * heads * d + h * d + c] as f64;
                    assert!(
                        (want - got).abs() < 1e-6,
                        "t={ti} h={h} c={c}: {got} vs {want}"
                    );
                }
            }
        }
    }
}

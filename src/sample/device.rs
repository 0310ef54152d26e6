//! A step-for-step Rust model of the device sampler, `kiln_sample_row` in `cuda/sample.cuh`
//! (used by `sample_rows` and the decode megakernel's Sample tiles), driven by the same
//! [`MkRow`] (one row's controls) the device reads.
//!
//! Why it exists: CI has no GPU, and a GPU run checks only the rows it is given, so the
//! algorithm's design is checked here, on the CPU: the radix descent over 64-bit composites, the
//! exact integer weights, the bucket gather and sort, and the three questions (top-k, top-p, the
//! draw). The tests compare it bit for bit with a full-sort reference of the
//! same arithmetic, and with [`super::sample`] on thousands of random rows, where the only
//! differences allowed are the rounding ones `cuda/sample.cuh` documents (exact integer sums
//! here, f32 sums in the CPU sampler). On a GPU it predicts the device's token exactly, except
//! where CUDA's `expf` and the host's `exp` round a weight differently. The CUDA itself ran on an
//! H200 (docs/gpu-results.md): on the same logits it picked the host sampler's tokens.
//!
//! Each function names the device function it models.

use kiln_codegen::MkRow;

use super::{argmax, philox4x32_10};

/// `SAMPLE_CAP`: the largest bucket the device sorts in shared memory.
pub const CAP: usize = 1024;

/// `SAMPLE_ONE`: 2^40, the best token's integer weight.
const ONE: f32 = 1_099_511_627_776.0;

/// `sample_key`: f32 bits in the f32 total order (`f32::total_cmp`) as unsigned order.
fn key(v: f32) -> u32 {
    let b = v.to_bits();
    if b & 0x8000_0000 != 0 {
        !b
    } else {
        b | 0x8000_0000
    }
}

/// `sample_unkey`.
fn unkey(k: u32) -> f32 {
    f32::from_bits(if k & 0x8000_0000 != 0 {
        k & 0x7fff_ffff
    } else {
        !k
    })
}

/// `sample_ck`: descending composites are descending logits, ties by ascending index.
fn composite(v: f32, i: usize) -> u64 {
    ((key(v) as u64) << 32) | (u32::MAX - i as u32) as u64
}

fn index(ck: u64) -> u32 {
    u32::MAX - ck as u32
}

/// `SampleCut`: what is kept, and what it weighs, at one stage.
#[derive(Clone, Copy, Debug)]
struct Cut {
    mx: f32,
    inv_t: f32,
    /// ≤ 0: off.
    min_p: f32,
    /// Top-k: composites below are out (0: no top-k).
    floor: u64,
    /// Every token weighs 1 and nothing is cut (the top-k count).
    unit: bool,
}

impl Cut {
    /// `sample_kept`: the token's integer weight if it is kept.
    fn kept(&self, v: f32, ck: u64) -> Option<u64> {
        if self.unit {
            return Some(1);
        }
        if ck < self.floor {
            return None;
        }
        let w = ((v - self.mx) * self.inv_t).exp();
        // As the device's `!(w >= min_p)`: NaN weights are cut too.
        if self.min_p > 0.0 && (w.is_nan() || w < self.min_p) {
            return None;
        }
        Some(if w > 0.0 { (w * ONE) as u64 } else { 0 })
    }
}

/// `SampleHist`: count and weight per value of the next composite byte.
#[derive(Clone)]
struct Hist {
    cnt: [u32; 256],
    mass: [u64; 256],
}

/// `sample_hist`: the histogram over the next byte of the kept tokens whose composite starts
/// with the `bits` bits `prefix`.
fn hist(l: &[f32], c: &Cut, prefix: u64, bits: u32) -> Hist {
    let mut h = Hist {
        cnt: [0; 256],
        mass: [0; 256],
    };
    for (i, &v) in l.iter().enumerate() {
        let ck = composite(v, i);
        if bits != 0 && ck >> (64 - bits) != prefix {
            continue;
        }
        if let Some(w) = c.kept(v, ck) {
            let bin = ((ck >> (56 - bits)) & 255) as usize;
            h.cnt[bin] += 1;
            h.mass[bin] += w;
        }
    }
    h
}

/// `sample_select`: the composite of the first kept token, in descending order, whose running
/// weight reaches `x` (1 ≤ x ≤ the kept weight), and that running weight. `first` is the
/// level-1 histogram; buckets of at most `cap` tokens are gathered and sorted.
fn select(l: &[f32], c: &Cut, x: u64, first: &Hist, cap: usize) -> (u64, u64) {
    let mut h = first.clone();
    let (mut base, mut prefix, mut bits) = (0u64, 0u64, 0u32);
    let count = loop {
        // `sample_pick_bin`: the bin, from the top, where the running weight reaches x.
        let in_bucket: u64 = h.mass.iter().sum();
        assert!(
            base < x && x <= base + in_bucket,
            "select: {x} outside ({base}, {}]",
            base + in_bucket
        );
        let mut b = 255usize;
        while x > base + h.mass[b] {
            base += h.mass[b];
            b -= 1;
        }
        prefix = (prefix << 8) | b as u64;
        bits += 8;
        if h.cnt[b] as usize <= cap || bits == 64 {
            break h.cnt[b] as usize;
        }
        h = hist(l, c, prefix, bits);
    };
    // The gather: exactly the tokens the histogram counted.
    let mut bucket: Vec<(u64, u64)> = l
        .iter()
        .enumerate()
        .filter_map(|(i, &v)| {
            let ck = composite(v, i);
            (ck >> (64 - bits) == prefix)
                .then(|| c.kept(v, ck).map(|w| (ck, w)))
                .flatten()
        })
        .collect();
    assert_eq!(
        bucket.len(),
        count,
        "gathered bucket differs from its count"
    );
    assert!(bucket.len() <= cap || bits == 64);
    bucket.sort_unstable_by_key(|e| std::cmp::Reverse(e.0));
    let mut run = base;
    for (ck, w) in bucket {
        // The weight recomputed from the composite alone, as the device does.
        let again = c.kept(unkey((ck >> 32) as u32), ck);
        assert_eq!(again, Some(w), "weight not reproducible from the composite");
        run += w;
        if run >= x {
            return (ck, run);
        }
    }
    unreachable!("select: the bucket's weight did not reach {x}")
}

/// `kiln_sample_row`: the device's token for one row; `row` and `position` key the Philox draw
/// (`ctl.row_id` is not read, as on the device, where the caller passes the row).
pub fn sample(logits: &[f32], ctl: &MkRow, row: u32, position: u64) -> u32 {
    sample_with_cap(logits, ctl, row, position, CAP)
}

fn sample_with_cap(logits: &[f32], ctl: &MkRow, row: u32, position: u64, cap: usize) -> u32 {
    let vocab = logits.len();
    let sampling = ctl.temperature > 0.0 && vocab > 1;
    let topk = sampling && ctl.top_k > 0 && (ctl.top_k as usize) < vocab;
    let greedy = argmax(logits);
    if !sampling {
        return greedy;
    }
    let inv_t = 1.0 / ctl.temperature;
    let mx = logits
        .iter()
        .fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m });
    if mx == f32::NEG_INFINITY || mx.is_infinite() || inv_t.is_infinite() {
        return greedy;
    }
    let mut c = Cut {
        mx,
        inv_t,
        min_p: ctl.min_p,
        floor: 0,
        unit: true,
    };
    if topk {
        let first = hist(logits, &c, 0, 0);
        c.floor = select(logits, &c, ctl.top_k as u64, &first, cap).0;
    }
    c.unit = false;
    let top = hist(logits, &c, 0, 0);
    let total: u64 = top.mass.iter().sum();
    let mut mass = total;
    if ctl.top_p > 0.0 && ctl.top_p < 1.0 {
        mass = select(logits, &c, top_p_target(ctl.top_p, total), &top, cap).1;
    }
    let pick = select(
        logits,
        &c,
        draw_target(ctl.seed, row, position, mass),
        &top,
        cap,
    )
    .0;
    index(pick)
}

/// X of the top-p question: ceil(top_p · total) in f64, within [1, total].
fn top_p_target(top_p: f32, total: u64) -> u64 {
    let x = (top_p as f64 * total as f64).ceil();
    (if x < 1.0 { 1 } else { x as u64 }).min(total)
}

/// X of the draw: floor(u · mass) + 1 with u = ku / 2^24 exactly (`kiln::sample::uniform`).
fn draw_target(seed: u64, row: u32, position: u64, mass: u64) -> u64 {
    let out = philox4x32_10(
        [position as u32, (position >> 32) as u32, row, 0],
        [seed as u32, (seed >> 32) as u32],
    );
    let ku = (out[0] >> 8) as u128;
    ((ku * mass as u128) >> 24) as u64 + 1
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sample::{uniform, SamplingParams};

    /// splitmix64: the tests' own reproducible randomness.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
        fn unit(&mut self) -> f32 {
            (self.next() >> 40) as f32 / (1u64 << 24) as f32
        }
        fn normal(&mut self) -> f32 {
            let (a, b) = (self.unit().max(1e-7), self.unit());
            (-2.0 * a.ln()).sqrt() * (std::f32::consts::TAU * b).cos()
        }
        fn pick<T: Copy>(&mut self, xs: &[T]) -> T {
            xs[self.below(xs.len())]
        }
    }

    /// A random row: LLM-like (normal, a few peaks), coarse values with many ties (±0 too),
    /// -inf holes, flat, or huge magnitudes.
    fn logits(rng: &mut Rng, vocab: usize) -> Vec<f32> {
        let sigma = rng.pick(&[0.5f32, 1.0, 2.0, 4.0]);
        let mut l: Vec<f32> = match rng.below(5) {
            0 | 1 => (0..vocab).map(|_| rng.normal() * sigma).collect(),
            2 => (0..vocab)
                .map(|_| {
                    let v = (rng.normal() * 2.0).round() * 0.5;
                    if v == 0.0 && rng.below(2) == 0 {
                        -0.0
                    } else {
                        v
                    }
                })
                .collect(),
            3 => vec![rng.pick(&[0.0f32, 1.5, -3.0]); vocab],
            _ => (0..vocab).map(|_| rng.normal() * 1e4).collect(),
        };
        for _ in 0..rng.below(4) {
            let i = rng.below(vocab);
            l[i] += rng.pick(&[3.0f32, 8.0, 20.0]);
        }
        match rng.below(6) {
            0 => {
                let holes = rng.below(vocab);
                for _ in 0..holes {
                    let i = rng.below(vocab);
                    l[i] = f32::NEG_INFINITY;
                }
            }
            1 if vocab > 1 => {
                // Only a few finite tokens.
                let keep = rng.below(3) + 1;
                for (i, v) in l.iter_mut().enumerate() {
                    if i % (vocab / keep).max(1) != 0 {
                        *v = f32::NEG_INFINITY;
                    }
                }
            }
            _ => {}
        }
        l
    }

    fn params(rng: &mut Rng, vocab: usize) -> SamplingParams {
        let k = [1, 2, 5, 40, 1000, 1023, 1024, 1025, 3000];
        SamplingParams {
            temperature: rng.pick(&[
                0.0f32, 1e-39, 1e-3, 0.05, 0.3, 0.7, 1.0, 1.5, 3.0, 100.0, 1e6,
            ]),
            top_k: match rng.below(4) {
                0 | 1 => None,
                2 => Some(rng.pick(&k)),
                _ => Some((vocab + rng.below(3)).saturating_sub(1).max(1)),
            },
            top_p: rng.pick(&[
                None,
                None,
                Some(0.01f32),
                Some(0.3),
                Some(0.9),
                Some(0.95),
                Some(0.999),
                Some(1.0),
            ]),
            min_p: rng.pick(&[
                None,
                None,
                Some(0.0f32),
                Some(0.01),
                Some(0.05),
                Some(0.3),
                Some(1.0),
            ]),
            repetition_penalty: None,
            seed: rng.next(),
        }
    }

    fn control(p: &SamplingParams) -> MkRow {
        MkRow::new(p.temperature, p.top_k, p.top_p, p.min_p, p.seed, 0).unwrap()
    }

    /// What the full-sort reference decided, for explaining a difference from the CPU.
    struct Decision {
        token: u32,
        /// Kept tokens (after top-k and min-p) in descending order, with their weights.
        kept: Vec<(u32, u64)>,
        total: u64,
    }

    /// The device's semantics by brute force: sort every token, cut, scan. No radix, no
    /// buckets, no histograms.
    fn reference(l: &[f32], ctl: &MkRow, row: u32, pos: u64) -> Decision {
        let greedy = Decision {
            token: argmax(l),
            kept: vec![],
            total: 0,
        };
        let inv_t = 1.0 / ctl.temperature;
        let mx = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let sampling = ctl.temperature > 0.0;
        if !sampling || l.len() <= 1 || !mx.is_finite() || !inv_t.is_finite() {
            return greedy;
        }
        let mut order: Vec<usize> = (0..l.len()).collect();
        order.sort_by(|&a, &b| l[b].total_cmp(&l[a]).then(a.cmp(&b)));
        if ctl.top_k > 0 {
            order.truncate(ctl.top_k as usize);
        }
        let min_p_on = ctl.min_p > 0.0;
        let kept: Vec<(u32, u64)> = order
            .iter()
            .filter_map(|&i| {
                let w = ((l[i] - mx) * inv_t).exp();
                (!min_p_on || w >= ctl.min_p)
                    .then_some((i as u32, if w > 0.0 { (w * ONE) as u64 } else { 0 }))
            })
            .collect();
        let total: u64 = kept.iter().map(|e| e.1).sum();
        let first_reaching = |x: u64| {
            let mut run = 0;
            kept.iter()
                .find_map(|&(i, w)| {
                    run += w;
                    (run >= x).then_some((i, run))
                })
                .unwrap()
        };
        let mut mass = total;
        if ctl.top_p > 0.0 && ctl.top_p < 1.0 {
            mass = first_reaching(top_p_target(ctl.top_p, total)).1;
        }
        let token = first_reaching(draw_target(ctl.seed, row, pos, mass)).0;
        Decision { token, kept, total }
    }

    /// A CPU/device difference is allowed only where f32 rounding can move a decision: the CPU's
    /// token is kept, and either the top-p target lies within the f32 error bound of a running
    /// weight, or the draw's target lies within twice that bound of the CPU token's interval.
    fn explained(d: &Decision, cpu: u32, p: &SamplingParams, u: f32) -> bool {
        let pos = |t: u32| d.kept.iter().position(|e| e.0 == t);
        let (Some(a), Some(b)) = (pos(cpu), pos(d.token)) else {
            return false;
        };
        let total = d.total as f64;
        // Worst-case error of an f32 sum of n terms, relative to the total.
        let tol = (d.kept.len() as f64 + 2.0) * f32::EPSILON as f64 * total;
        let runs: Vec<f64> = d
            .kept
            .iter()
            .scan(0u64, |r, e| {
                *r += e.1;
                Some(*r as f64)
            })
            .collect();
        let mut mass = total;
        if let Some(tp) = p.top_p {
            let target = tp as f64 * total;
            if runs.iter().any(|r| (r - target).abs() <= tol) {
                return true;
            }
            if tp < 1.0 {
                mass = *runs.iter().find(|&&r| r >= target).unwrap_or(&total);
            }
        }
        let target = u as f64 * mass;
        let dist = if a < b {
            target - runs[a]
        } else {
            runs[a - 1] - target
        };
        dist <= 2.0 * tol
    }

    #[test]
    fn composites_order_like_total_cmp_and_round_trip() {
        let vals = [
            f32::NEG_INFINITY,
            -3.5,
            -0.0,
            0.0,
            1e-45,
            2.0,
            f32::INFINITY,
        ];
        for w in vals.windows(2) {
            assert!(key(w[0]) < key(w[1]), "{w:?}");
        }
        for v in vals {
            assert_eq!(unkey(key(v)).to_bits(), v.to_bits());
        }
        assert!(composite(1.0, 3) > composite(1.0, 4));
        assert!(composite(1.5, 9) > composite(1.0, 0));
        assert_eq!(index(composite(-2.0, 12345)), 12345);
    }

    /// The radix descent with buckets of any size, against the full sort: bit for bit.
    #[test]
    fn the_device_algorithm_equals_a_full_sort_of_the_same_arithmetic() {
        let mut rng = Rng(0x5eed);
        let mut sampled = 0;
        for case in 0..3000 {
            let vocab = match case % 10 {
                0 => rng.below(4) + 1,
                1..=5 => rng.below(300) + 2,
                6..=8 => rng.below(5000) + 2,
                _ => rng.below(40_000) + 2,
            };
            let l = logits(&mut rng, vocab);
            let p = params(&mut rng, vocab);
            let ctl = control(&p);
            let (row, pos) = (rng.next() as u32, rng.next());
            let want = reference(&l, &ctl, row, pos).token;
            for cap in [CAP, 1, 2, 3, 64] {
                assert_eq!(
                    sample_with_cap(&l, &ctl, row, pos, cap),
                    want,
                    "case {case}, cap {cap}, vocab {vocab}, {p:?}"
                );
            }
            sampled += (p.temperature > 0.0) as usize;
        }
        assert!(sampled > 2000);
    }

    /// Against `kiln::sample::sample` on rows up to 150k tokens: equal except where rounding
    /// explains it (see `explained`), and rarely.
    #[test]
    fn the_device_algorithm_matches_the_cpu_sampler_up_to_rounding() {
        let mut rng = Rng(0xc0ffee);
        let (mut cases, mut differ) = (0usize, Vec::new());
        for case in 0..2400 {
            let vocab = match case % 40 {
                0 => 150_000 + rng.below(2000),
                1 => 49_152,
                2..=9 => rng.below(20_000) + 2,
                _ => rng.below(2000) + 2,
            };
            let l = logits(&mut rng, vocab);
            let p = params(&mut rng, vocab);
            let ctl = control(&p);
            let (row, pos) = (rng.next() as u32, rng.next());
            let dev = sample(&l, &ctl, row, pos);
            let cpu = crate::sample::sample(&l, &p, row, pos);
            cases += 1;
            if dev != cpu {
                let d = reference(&l, &ctl, row, pos);
                assert_eq!(d.token, dev);
                assert!(
                    explained(&d, cpu, &p, uniform(p.seed, row, pos)),
                    "case {case}: device {dev}, cpu {cpu}, vocab {vocab}, {p:?}"
                );
                differ.push(case);
            }
        }
        // About 0.75% with this seed, nearly all near-flat rows (temperature 100 or 1e6, top-p
        // 1.0) of 10k-150k tokens, where the CPU's f32 running sum drifts across many
        // near-equal tokens.
        assert!(
            differ.len() * 50 <= cases,
            "{} of {cases} rows differ: {differ:?}",
            differ.len()
        );
    }

    #[test]
    fn greedy_and_degenerate_rows_follow_the_cpu() {
        let ninf = f32::NEG_INFINITY;
        let base = SamplingParams {
            temperature: 0.8,
            top_k: Some(3),
            top_p: Some(0.9),
            min_p: Some(0.1),
            ..SamplingParams::default()
        };
        let rows: [&[f32]; 6] = [
            &[ninf; 8],
            &[0.0, f32::INFINITY, 2.0, f32::INFINITY],
            &[1.0],
            &[],
            &[-0.0, 0.0, -0.0],
            &[f32::NAN, 1.0, 0.5],
        ];
        for l in rows {
            for p in [
                base,
                SamplingParams {
                    temperature: 0.0,
                    ..base
                },
                SamplingParams {
                    temperature: 1e-39,
                    ..base
                },
            ] {
                let greedy = argmax(l);
                let want = if p.temperature == 0.0 || p.temperature < 1e-38 || l.len() <= 1 {
                    greedy
                } else {
                    crate::sample::sample(l, &p, 0, 9)
                };
                assert_eq!(sample(l, &control(&p), 0, 9), want, "{l:?} {p:?}");
            }
        }
    }

    /// The draw's frequencies follow the softmax, as the CPU test of the same name checks.
    #[test]
    fn frequencies_follow_the_softmax() {
        let l = [6f32.ln(), 3f32.ln(), 0.0];
        let ctl = MkRow::new(1.0, None, None, None, 1, 0).unwrap();
        let n = 20_000;
        let mut counts = [0usize; 3];
        for pos in 0..n {
            counts[sample(&l, &ctl, 0, pos) as usize] += 1;
        }
        for (c, want) in counts.iter().zip([0.6, 0.3, 0.1]) {
            assert!((*c as f64 / n as f64 - want).abs() < 0.015, "{counts:?}");
        }
    }
}

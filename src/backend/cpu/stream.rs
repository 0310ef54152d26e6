//! A streaming read of a buffer, the reference that `kiln-bench` scores decode steps against: a
//! decode step reads every weight once, so the fastest a core pair can read the same number of
//! bytes bounds it.
//!
//! Two ways of reading, because the fastest differs by CPU: one relies on the hardware
//! prefetchers alone; the other also asks for each line [`AHEAD`] bytes before it is read into
//! L2, as the one-row dense GEMV does under the L2 prefetch policy
//! (`matmul/prefetch.rs`). On the 2-vCPU Intel Xeon of 2026-12-06 (family 6 model 167), two
//! threads, a C model of both loops: over 1 GiB (DRAM) 27.5 GB/s without and 31.0 with the L2
//! requests 8 KiB ahead; over 96 MiB (held by its large L3) 45–47 without and 55–56 with.

/// How far ahead of its loads the prefetching read asks for lines: the one-row GEMV's distance
/// under the L2 policy.
pub const AHEAD: usize = super::matmul::ROW_AHEAD_L2;

/// The sum of `x` (its value serves only to keep the reads), read front to back, with each line
/// also requested [`AHEAD`] bytes before it is read, into L2, when `prefetch` is set.
pub fn sum(x: &[f32], prefetch: bool) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        use super::simd::{self, Level};
        match (simd::level(), prefetch) {
            // SAFETY: the level says the CPU has AVX-512 F.
            (Level::Avx512 | Level::Avx512Bf16, true) => return unsafe { x86::sum_512::<true>(x) },
            (Level::Avx512 | Level::Avx512Bf16, false) => {
                return unsafe { x86::sum_512::<false>(x) }
            }
            // SAFETY: the level says the CPU has AVX2.
            (Level::Avx2, true) => return unsafe { x86::sum_256::<true>(x) },
            (Level::Avx2, false) => return unsafe { x86::sum_256::<false>(x) },
            _ => {}
        }
    }
    let _ = prefetch;
    sum_portable(x)
}

/// [`sum`] without SIMD: sixteen running sums, which the compiler may vectorise.
fn sum_portable(x: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let mut chunks = x.chunks_exact(16);
    for c in &mut chunks {
        for (a, v) in acc.iter_mut().zip(c) {
            *a += v;
        }
    }
    acc.iter().sum::<f32>() + chunks.remainder().iter().sum::<f32>()
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::AHEAD;
    use crate::backend::cpu::matmul::prefetch_line;

    /// Asks for the line [`AHEAD`] bytes past `p` into L2, as the one-row GEMV asks for its row
    /// stream.
    #[inline(always)]
    fn ask(p: *const f32) {
        prefetch_line::<true>((p as *const u8).wrapping_add(AHEAD))
    }

    /// Runs `$body` with `$i` at each 256-byte step (64 floats, four lines) of the whole steps of
    /// `$p`'s `$whole` floats, asking for the step's lines [`AHEAD`] bytes on first when
    /// `$prefetch`.
    macro_rules! steps {
        ($p:ident, $whole:ident, $prefetch:ident, |$i:ident| $body:block) => {
            let mut $i = 0;
            while $i < $whole {
                if $prefetch {
                    for l in 0..4 {
                        ask($p.wrapping_add($i + 16 * l));
                    }
                }
                $body
                $i += 64;
            }
        };
    }

    /// [`super::sum`] in 16-lane vectors.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn sum_512<const PREFETCH: bool>(x: &[f32]) -> f32 {
        let p = x.as_ptr();
        let whole = x.len() / 64 * 64;
        let mut acc = [_mm512_setzero_ps(); 4];
        steps!(p, whole, PREFETCH, |i| {
            for (l, a) in acc.iter_mut().enumerate() {
                *a = _mm512_add_ps(*a, _mm512_loadu_ps(p.add(i + 16 * l)));
            }
        });
        let v = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
        _mm512_reduce_add_ps(v) + super::sum_portable(&x[whole..])
    }

    /// [`super::sum`] in 8-lane vectors.
    ///
    /// # Safety
    /// The CPU must have AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn sum_256<const PREFETCH: bool>(x: &[f32]) -> f32 {
        let p = x.as_ptr();
        let whole = x.len() / 64 * 64;
        let mut acc = [_mm256_setzero_ps(); 8];
        steps!(p, whole, PREFETCH, |i| {
            for (l, a) in acc.iter_mut().enumerate() {
                *a = _mm256_add_ps(*a, _mm256_loadu_ps(p.add(i + 8 * l)));
            }
        });
        let mut lanes = [0f32; 8];
        let mut v = acc[0];
        for a in &acc[1..] {
            v = _mm256_add_ps(v, *a);
        }
        _mm256_storeu_ps(lanes.as_mut_ptr(), v);
        lanes.iter().sum::<f32>() + super::sum_portable(&x[whole..])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every way of reading sums the same small integers exactly, whatever the length's
    /// remainder past whole steps.
    #[test]
    fn every_read_sums_the_buffer() {
        for n in [0, 1, 15, 64, 65, 1000, 4099] {
            let x: Vec<f32> = (0..n).map(|i| (i % 7) as f32).collect();
            let want: f32 = x.iter().sum();
            assert_eq!(sum_portable(&x), want, "portable, {n}");
            assert_eq!(sum(&x, false), want, "plain, {n}");
            assert_eq!(sum(&x, true), want, "prefetching, {n}");
            #[cfg(target_arch = "x86_64")]
            {
                use crate::backend::cpu::simd::{self, Level};
                if simd::level() >= Level::Avx2 {
                    // SAFETY: the CPU has AVX2.
                    assert_eq!(unsafe { x86::sum_256::<true>(&x) }, want, "avx2, {n}");
                }
            }
        }
    }
}

//! Vector primitives with runtime CPU feature detection. Every function has a portable scalar
//! path, so results exist on any machine; the SIMD paths must agree with it to f32 rounding.
//!
//! The level used is detected once ([`detected`]) and may be capped with the environment
//! variable `KILN_SIMD=scalar|avx2|avx512|avx512bf16` (read once, see [`level`]). The `*_at`
//! variants take an explicit [`Level`] (clamped to what the CPU supports) so tests can compare
//! every level against the scalar path in one process.

use std::sync::OnceLock;

use half::bf16;

/// An instruction-set level, ordered from least to most capable.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Level {
    /// Portable Rust, any target.
    Scalar,
    /// x86-64 AVX2 + FMA + F16C (8-wide).
    Avx2,
    /// x86-64 AVX-512 F/BW/VL (16-wide).
    Avx512,
    /// AVX-512 plus the BF16 dot-product instructions.
    Avx512Bf16,
}

impl Level {
    pub const ALL: [Level; 4] = [Level::Scalar, Level::Avx2, Level::Avx512, Level::Avx512Bf16];

    pub fn name(self) -> &'static str {
        match self {
            Level::Scalar => "scalar",
            Level::Avx2 => "avx2",
            Level::Avx512 => "avx512",
            Level::Avx512Bf16 => "avx512bf16",
        }
    }

    pub fn parse(s: &str) -> Option<Level> {
        Level::ALL
            .into_iter()
            .find(|l| l.name().eq_ignore_ascii_case(s.trim()))
    }
}

/// The most capable level this CPU supports (detected once).
pub fn detected() -> Level {
    static DETECTED: OnceLock<Level> = OnceLock::new();
    *DETECTED.get_or_init(detect)
}

#[cfg(target_arch = "x86_64")]
fn detect() -> Level {
    // F16C (f16 → f32 scales of quantized blocks) ships on every AVX2 CPU; checked to be sure.
    let avx2 = is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c");
    let avx512 = avx2
        && is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl");
    if avx512 && is_x86_feature_detected!("avx512bf16") {
        Level::Avx512Bf16
    } else if avx512 {
        Level::Avx512
    } else if avx2 {
        Level::Avx2
    } else {
        Level::Scalar
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn detect() -> Level {
    Level::Scalar
}

/// The level the kernels use: [`detected`], capped by `KILN_SIMD` if set (read once).
pub fn level() -> Level {
    static LEVEL: OnceLock<Level> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        let cap = std::env::var("KILN_SIMD")
            .ok()
            .and_then(|s| Level::parse(&s));
        cap.map_or(detected(), |c| c.min(detected()))
    })
}

/// Every level this CPU can run, scalar first (for tests and benches).
pub fn available_levels() -> Vec<Level> {
    Level::ALL
        .into_iter()
        .filter(|&l| l <= detected())
        .collect()
}

/// Clamp a requested level to what the CPU supports, so `*_at` functions are always safe.
#[inline]
pub fn clamp(l: Level) -> Level {
    l.min(detected())
}

// ---------------------------------------------------------------------------------------------
// Public entry points (use the process-wide level).

/// `Σ a[i]·b[i]`
#[inline]
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    dot_f32_at(level(), a, b)
}

/// `Σ a[i]·b[i]` with bf16 `a` read directly (widened in registers only).
#[inline]
pub fn dot_bf16(a: &[bf16], b: &[f32]) -> f32 {
    dot_bf16_at(level(), a, b)
}

/// `y += a · x`
#[inline]
pub fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    axpy_at(level(), a, x, y)
}

/// `x *= a`
#[inline]
pub fn scale(x: &mut [f32], a: f32) {
    scale_at(level(), x, a)
}

/// `Σ x[i]²` (for RMSNorm).
#[inline]
pub fn sum_sq(x: &[f32]) -> f32 {
    sum_sq_at(level(), x)
}

/// The largest element (`-inf` for an empty slice; NaN handling unspecified).
#[inline]
pub fn max(x: &[f32]) -> f32 {
    max_at(level(), x)
}

// ---------------------------------------------------------------------------------------------
// Explicit-level entry points.

/// Evaluates the AVX-512 expression, the AVX2 one or the portable one, by the level `$l`
/// clamped to what the CPU supports (which is what makes the unsafe arms sound).
macro_rules! by_level {
    ($l:expr, avx512: $avx512:expr, avx2: $avx2:expr, scalar: $scalar:expr) => {
        match clamp($l) {
            #[cfg(target_arch = "x86_64")]
            Level::Avx512 | Level::Avx512Bf16 => unsafe { $avx512 },
            #[cfg(target_arch = "x86_64")]
            Level::Avx2 => unsafe { $avx2 },
            _ => $scalar,
        }
    };
}

pub fn dot_f32_at(l: Level, a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    by_level!(l, avx512: x86::dot_512(a, b), avx2: x86::dot_256(a, b), scalar: scalar::dot_f32(a, b))
}

pub fn dot_bf16_at(l: Level, a: &[bf16], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    by_level!(l, avx512: x86::dot_512(a, b), avx2: x86::dot_256(a, b), scalar: scalar::dot_bf16(a, b))
}

pub fn axpy_at(l: Level, a: f32, x: &[f32], y: &mut [f32]) {
    assert_eq!(x.len(), y.len());
    by_level!(l, avx512: x86::axpy_512(a, x, y), avx2: x86::axpy_256(a, x, y), scalar: scalar::axpy(a, x, y))
}

pub fn scale_at(l: Level, x: &mut [f32], a: f32) {
    by_level!(l, avx512: x86::scale_512(x, a), avx2: x86::scale_256(x, a), scalar: scalar::scale(x, a))
}

pub fn sum_sq_at(l: Level, x: &[f32]) -> f32 {
    by_level!(l, avx512: x86::dot_512(x, x), avx2: x86::dot_256(x, x), scalar: scalar::dot_f32(x, x))
}

pub fn max_at(l: Level, x: &[f32]) -> f32 {
    by_level!(l, avx512: x86::max_512(x), avx2: x86::max_256(x), scalar: scalar::max(x))
}

/// `x ← softmax(x)` in place: `exp(x[i] − max)` over the sum of those. AVX2 evaluates `exp`
/// eight lanes at a time with [`x86::exp_256`] (within 2 ulp of the correctly rounded value) and
/// sums in eight lanes by position modulo 8; AVX-512 gives the same bits sixteen `exp`s at a
/// time (`x86::softmax_512`); the
/// portable path calls `f32::exp` and sums in position order. Either way a row's result depends
/// on that row alone.
pub fn softmax_at(l: Level, x: &mut [f32]) {
    by_level!(l, avx512: x86::softmax_512(x), avx2: x86::softmax_256(x), scalar: scalar::softmax(x))
}

/// `out[i] = silu(gate[i]) · up[i]` with `silu(x) = x / (1 + e^−x)`. AVX2 evaluates `e^−x`
/// with [`x86::exp_256`] eight lanes at a time, AVX-512 with `exp_512` sixteen at a time, the
/// same bits per lane (within
/// 2 ulp; for `x < −88`, where the result is below 10⁻³⁶, `e^88` stands in for `e^−x`); the
/// portable path calls `f32::exp`. Each element depends on its own inputs alone.
pub fn silu_gated_at(l: Level, gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert!(gate.len() == out.len() && up.len() == out.len());
    by_level!(l, avx512: x86::silu_gated_512(gate, up, out), avx2: x86::silu_gated_256(gate, up, out), scalar: scalar::silu_gated(gate, up, out))
}

// ---------------------------------------------------------------------------------------------

/// The portable reference paths.
pub mod scalar {
    use half::bf16;

    pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
        debug_assert_eq!(a.len(), b.len());
        // Eight partial sums, like the SIMD paths, so scalar and vector results stay close.
        let mut acc = [0f32; 8];
        let mut ca = a.chunks_exact(8);
        let mut cb = b.chunks_exact(8);
        for (x, y) in (&mut ca).zip(&mut cb) {
            for l in 0..8 {
                acc[l] += x[l] * y[l];
            }
        }
        let mut s: f32 = acc.iter().sum();
        for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
            s += x * y;
        }
        s
    }

    pub fn dot_bf16(a: &[bf16], b: &[f32]) -> f32 {
        debug_assert_eq!(a.len(), b.len());
        let mut acc = [0f32; 8];
        let mut ca = a.chunks_exact(8);
        let mut cb = b.chunks_exact(8);
        for (x, y) in (&mut ca).zip(&mut cb) {
            for l in 0..8 {
                acc[l] += x[l].to_f32() * y[l];
            }
        }
        let mut s: f32 = acc.iter().sum();
        for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
            s += x.to_f32() * y;
        }
        s
    }

    pub fn silu_gated(gate: &[f32], up: &[f32], out: &mut [f32]) {
        for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
            *o = g / (1.0 + (-g).exp()) * u;
        }
    }

    pub fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
        for (yi, xi) in y.iter_mut().zip(x) {
            *yi += a * xi;
        }
    }

    pub fn scale(x: &mut [f32], a: f32) {
        for v in x {
            *v *= a;
        }
    }

    pub fn max(x: &[f32]) -> f32 {
        x.iter().copied().fold(f32::NEG_INFINITY, f32::max)
    }

    pub fn softmax(x: &mut [f32]) {
        let m = max(x);
        let mut sum = 0.0f32;
        for v in x.iter_mut() {
            *v = (*v - m).exp();
            sum += *v;
        }
        for v in x.iter_mut() {
            *v /= sum;
        }
    }
}

#[cfg(target_arch = "x86_64")]
// The AVX-512 intrinsics are stable since Rust 1.89, the workspace's `rust-version`.
pub(crate) mod x86 {
    use half::bf16;
    use std::arch::x86_64::*;

    // ----- AVX-512 (16 lanes, masked tails) -----

    /// The 16 × 16 transpose of 32-bit words: word `c` of result `r` is word `r` of input `c`.
    /// Within each 128-bit lane a 4 × 4 transpose (unpacks), then the 4 × 4 transpose of the
    /// 128-bit lanes across each group of four results (`shuffle_i32x4`).
    #[inline(always)]
    pub(crate) unsafe fn transpose16(r: [__m512i; 16]) -> [__m512i; 16] {
        // u[4g + c], lane L: column 4L + c of rows 4g..4g + 4.
        let mut u = [_mm512_setzero_si512(); 16];
        for g in 0..4 {
            let (r0, r1, r2, r3) = (r[4 * g], r[4 * g + 1], r[4 * g + 2], r[4 * g + 3]);
            let t0 = _mm512_unpacklo_epi32(r0, r1);
            let t1 = _mm512_unpackhi_epi32(r0, r1);
            let t2 = _mm512_unpacklo_epi32(r2, r3);
            let t3 = _mm512_unpackhi_epi32(r2, r3);
            u[4 * g] = _mm512_unpacklo_epi64(t0, t2);
            u[4 * g + 1] = _mm512_unpackhi_epi64(t0, t2);
            u[4 * g + 2] = _mm512_unpacklo_epi64(t1, t3);
            u[4 * g + 3] = _mm512_unpackhi_epi64(t1, t3);
        }
        // Column 4L + c: lane g of it is lane L of u[4g + c].
        let mut out = [_mm512_setzero_si512(); 16];
        for c in 0..4 {
            let (a, b, cc, d) = (u[c], u[4 + c], u[8 + c], u[12 + c]);
            let p0 = _mm512_shuffle_i32x4::<0x44>(a, b);
            let p1 = _mm512_shuffle_i32x4::<0xEE>(a, b);
            let p2 = _mm512_shuffle_i32x4::<0x44>(cc, d);
            let p3 = _mm512_shuffle_i32x4::<0xEE>(cc, d);
            out[c] = _mm512_shuffle_i32x4::<0x88>(p0, p2);
            out[4 + c] = _mm512_shuffle_i32x4::<0xDD>(p0, p2);
            out[8 + c] = _mm512_shuffle_i32x4::<0x88>(p1, p3);
            out[12 + c] = _mm512_shuffle_i32x4::<0xDD>(p1, p3);
        }
        out
    }

    #[inline(always)]
    pub(crate) unsafe fn tail_mask16(n: usize) -> __mmask16 {
        ((1u32 << n) - 1) as __mmask16
    }

    /// The first `n` (at most 32) f32 at `p` rounded to bf16 (nearest even, `vcvtne2ps2bf16`) as
    /// 16 words of two, element `2j` in the low half of word `j`; elements past `n` are zero
    /// and not read. Needs AVX512-BF16 in the caller.
    #[inline(always)]
    pub(crate) unsafe fn bf16_pairs(p: *const f32, n: usize) -> __m512i {
        let lo = _mm512_maskz_loadu_ps(tail_mask16(n.min(16)), p);
        let hi = _mm512_maskz_loadu_ps(tail_mask16(n.saturating_sub(16)), p.add(16));
        // `cvtne2ps` puts its second operand in the low half.
        std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(hi, lo))
    }

    /// 16 bf16 at `p` widened to f32 (zero-extend, shift into the high half).
    #[inline(always)]
    pub(crate) unsafe fn load_bf16_512(p: *const bf16) -> __m512 {
        let h = _mm256_loadu_si256(p as *const __m256i);
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
    }

    #[inline(always)]
    pub(crate) unsafe fn load_bf16_512_mask(p: *const bf16, m: __mmask16) -> __m512 {
        let h = _mm256_maskz_loadu_epi16(m, p as *const i16);
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
    }

    /// An element type the kernels load straight from memory and widen to f32 in registers.
    pub(crate) trait Load: Copy {
        /// 16 elements widened to f32.
        unsafe fn ld16(p: *const Self) -> __m512;
        /// The first `m`-selected of 16 elements (others zero).
        unsafe fn ld16_mask(p: *const Self, m: __mmask16) -> __m512;
        /// 8 elements widened to f32.
        unsafe fn ld8(p: *const Self) -> __m256;
        fn get(self) -> f32;
    }

    impl Load for f32 {
        #[inline(always)]
        unsafe fn ld16(p: *const f32) -> __m512 {
            _mm512_loadu_ps(p)
        }
        #[inline(always)]
        unsafe fn ld16_mask(p: *const f32, m: __mmask16) -> __m512 {
            _mm512_maskz_loadu_ps(m, p)
        }
        #[inline(always)]
        unsafe fn ld8(p: *const f32) -> __m256 {
            _mm256_loadu_ps(p)
        }
        #[inline(always)]
        fn get(self) -> f32 {
            self
        }
    }

    impl Load for bf16 {
        #[inline(always)]
        unsafe fn ld16(p: *const bf16) -> __m512 {
            load_bf16_512(p)
        }
        #[inline(always)]
        unsafe fn ld16_mask(p: *const bf16, m: __mmask16) -> __m512 {
            load_bf16_512_mask(p, m)
        }
        #[inline(always)]
        unsafe fn ld8(p: *const bf16) -> __m256 {
            load_bf16_256(p)
        }
        #[inline(always)]
        fn get(self) -> f32 {
            self.to_f32()
        }
    }

    /// `Σ a[i]·b[i]`, four accumulators, masked tail.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(crate) unsafe fn dot_512<A: Load>(a: &[A], b: &[f32]) -> f32 {
        _mm512_reduce_add_ps(dot_512_lanes(a.as_ptr(), b.as_ptr(), a.len()))
    }

    /// [`dot_512`] before its final reduction, for callers compiled with AVX-512 that reduce
    /// many dot products together ([`hsum16_512`]): the lane sums of the result, reduced as
    /// `_mm512_reduce_add_ps` reduces them, are `dot_512`'s value bit for bit.
    #[inline(always)]
    pub(crate) unsafe fn dot_512_lanes<A: Load>(pa: *const A, pb: *const f32, n: usize) -> __m512 {
        let mut acc = [_mm512_setzero_ps(); 4];
        let mut i = 0;
        while i + 64 <= n {
            for (u, acc) in acc.iter_mut().enumerate() {
                let o = i + 16 * u;
                *acc = _mm512_fmadd_ps(A::ld16(pa.add(o)), _mm512_loadu_ps(pb.add(o)), *acc);
            }
            i += 64;
        }
        while i + 16 <= n {
            acc[0] = _mm512_fmadd_ps(A::ld16(pa.add(i)), _mm512_loadu_ps(pb.add(i)), acc[0]);
            i += 16;
        }
        if i < n {
            let m = tail_mask16(n - i);
            let va = A::ld16_mask(pa.add(i), m);
            let vb = _mm512_maskz_loadu_ps(m, pb.add(i));
            acc[1] = _mm512_fmadd_ps(va, vb, acc[1]);
        }
        _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]))
    }

    /// Lane sums of 16 vectors at once, in 45 shuffles and adds instead of 16 separate reductions:
    /// lane `4·a + b` of the result is the sum of `v[a + 4·b]`, reduced in `_mm512_reduce_add_ps`'s
    /// order (halves, then quarters, pairs, and the last two lanes). With `v[t + 4·r]` holding row `r`,
    /// token `t` of a 4 × 4 tile, 128-bit lane `t` holds rows 0..4 of token `t`).
    #[inline(always)]
    pub(crate) unsafe fn hsum16_512(v: [__m512; 16]) -> __m512 {
        let mut u = [_mm512_setzero_ps(); 4];
        for (j, u) in u.iter_mut().enumerate() {
            *u = hsum16_quarter([v[4 * j], v[4 * j + 1], v[4 * j + 2], v[4 * j + 3]]);
        }
        hsum16_finish(u)
    }

    /// The first two stages of [`hsum16_512`] for `v[4j..4j + 4]` (its `u[j]`): each source's
    /// 512 bits folded to 256 (`s[2j]` from the first two, `s[2j + 1]` from the last two), then
    /// to 128: 128-bit lane `L` of the result belongs to `v[4j + L]`. Callers that produce the
    /// sixteen vectors four at a time reduce each four at once, with fewer registers live.
    #[inline(always)]
    pub(crate) unsafe fn hsum16_quarter(v: [__m512; 4]) -> __m512 {
        // (No closures: a closure is compiled without the caller's target features, and when
        // it is not inlined every intrinsic in it becomes a call.)
        let fold256 = [(v[0], v[1]), (v[2], v[3])];
        let mut s = [_mm512_setzero_ps(); 2];
        for (s, &(a, b)) in s.iter_mut().zip(&fold256) {
            *s = _mm512_add_ps(
                _mm512_shuffle_f32x4::<0x44>(a, b),
                _mm512_shuffle_f32x4::<0xEE>(a, b),
            );
        }
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x88>(s[0], s[1]),
            _mm512_shuffle_f32x4::<0xDD>(s[0], s[1]),
        )
    }

    /// The last two stages of [`hsum16_512`], from its four [`hsum16_quarter`]s.
    #[inline(always)]
    pub(crate) unsafe fn hsum16_finish(u: [__m512; 4]) -> __m512 {
        // 128 → 64 bits, within each 128-bit lane L: elements 0/2 belong to v[8m + L], 1/3 to
        // v[8m + 4 + L].
        let mut w = [_mm512_setzero_ps(); 2];
        for (m, w) in w.iter_mut().enumerate() {
            let (e, f) = (u[2 * m], u[2 * m + 1]);
            *w = _mm512_add_ps(_mm512_unpacklo_ps(e, f), _mm512_unpackhi_ps(e, f));
        }
        // 64 → 32 bits: lane L holds v[L], v[4 + L], v[8 + L], v[12 + L].
        let (g, h) = (_mm512_castps_pd(w[0]), _mm512_castps_pd(w[1]));
        _mm512_add_ps(
            _mm512_castpd_ps(_mm512_unpacklo_pd(g, h)),
            _mm512_castpd_ps(_mm512_unpackhi_pd(g, h)),
        )
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(crate) unsafe fn axpy_512(a: f32, x: &[f32], y: &mut [f32]) {
        let n = x.len();
        let (px, py) = (x.as_ptr(), y.as_mut_ptr());
        let va = _mm512_set1_ps(a);
        let mut i = 0;
        while i + 32 <= n {
            let y0 = _mm512_fmadd_ps(va, _mm512_loadu_ps(px.add(i)), _mm512_loadu_ps(py.add(i)));
            let y1 = _mm512_fmadd_ps(
                va,
                _mm512_loadu_ps(px.add(i + 16)),
                _mm512_loadu_ps(py.add(i + 16)),
            );
            _mm512_storeu_ps(py.add(i), y0);
            _mm512_storeu_ps(py.add(i + 16), y1);
            i += 32;
        }
        while i < n {
            let m = tail_mask16((n - i).min(16));
            let v = _mm512_fmadd_ps(
                va,
                _mm512_maskz_loadu_ps(m, px.add(i)),
                _mm512_maskz_loadu_ps(m, py.add(i)),
            );
            _mm512_mask_storeu_ps(py.add(i), m, v);
            i += 16;
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(crate) unsafe fn scale_512(x: &mut [f32], a: f32) {
        let n = x.len();
        let p = x.as_mut_ptr();
        let va = _mm512_set1_ps(a);
        let mut i = 0;
        while i + 16 <= n {
            _mm512_storeu_ps(p.add(i), _mm512_mul_ps(va, _mm512_loadu_ps(p.add(i))));
            i += 16;
        }
        if i < n {
            let m = tail_mask16(n - i);
            _mm512_mask_storeu_ps(
                p.add(i),
                m,
                _mm512_mul_ps(va, _mm512_maskz_loadu_ps(m, p.add(i))),
            );
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(crate) unsafe fn max_512(x: &[f32]) -> f32 {
        let n = x.len();
        let p = x.as_ptr();
        let ninf = _mm512_set1_ps(f32::NEG_INFINITY);
        let (mut m0, mut m1) = (ninf, ninf);
        let mut i = 0;
        while i + 32 <= n {
            m0 = _mm512_max_ps(m0, _mm512_loadu_ps(p.add(i)));
            m1 = _mm512_max_ps(m1, _mm512_loadu_ps(p.add(i + 16)));
            i += 32;
        }
        while i < n {
            let m = tail_mask16((n - i).min(16));
            m0 = _mm512_max_ps(m0, _mm512_mask_loadu_ps(ninf, m, p.add(i)));
            i += 16;
        }
        _mm512_reduce_max_ps(_mm512_max_ps(m0, m1))
    }

    // ----- AVX2 + FMA (8 lanes, scalar tails) -----

    #[inline(always)]
    pub(crate) unsafe fn hsum256(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    #[inline(always)]
    pub(crate) unsafe fn load_bf16_256(p: *const bf16) -> __m256 {
        let h = _mm_loadu_si128(p as *const __m128i);
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
    }

    /// `Σ a[i]·b[i]`, four accumulators, scalar tail.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn dot_256<A: Load>(a: &[A], b: &[f32]) -> f32 {
        dot_256_body(a.as_ptr(), b.as_ptr(), a.len())
    }

    /// [`dot_256`]'s arithmetic, inlined into callers compiled with AVX2 and FMA (the attention
    /// kernel), so a dot product rounds the same wherever it is computed.
    #[inline(always)]
    pub(crate) unsafe fn dot_256_body<A: Load>(pa: *const A, pb: *const f32, n: usize) -> f32 {
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        while i + 32 <= n {
            for (u, acc) in acc.iter_mut().enumerate() {
                let o = i + 8 * u;
                *acc = _mm256_fmadd_ps(A::ld8(pa.add(o)), _mm256_loadu_ps(pb.add(o)), *acc);
            }
            i += 32;
        }
        while i + 8 <= n {
            acc[0] = _mm256_fmadd_ps(A::ld8(pa.add(i)), _mm256_loadu_ps(pb.add(i)), acc[0]);
            i += 8;
        }
        let s = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        let mut s = hsum256(s);
        while i < n {
            s += (*pa.add(i)).get() * *pb.add(i);
            i += 1;
        }
        s
    }

    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn axpy_256(a: f32, x: &[f32], y: &mut [f32]) {
        axpy_256_body(a, x.as_ptr(), y.as_mut_ptr(), x.len())
    }

    /// [`axpy_256`]'s arithmetic (fused per vector lane, `y + a·x` rounded twice in the scalar
    /// tail), for callers compiled with AVX2 and FMA.
    #[inline(always)]
    pub(crate) unsafe fn axpy_256_body(a: f32, px: *const f32, py: *mut f32, n: usize) {
        let va = _mm256_set1_ps(a);
        let mut i = 0;
        while i + 8 <= n {
            let v = _mm256_fmadd_ps(va, _mm256_loadu_ps(px.add(i)), _mm256_loadu_ps(py.add(i)));
            _mm256_storeu_ps(py.add(i), v);
            i += 8;
        }
        while i < n {
            *py.add(i) += a * *px.add(i);
            i += 1;
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn scale_256(x: &mut [f32], a: f32) {
        let n = x.len();
        let p = x.as_mut_ptr();
        let va = _mm256_set1_ps(a);
        let mut i = 0;
        while i + 8 <= n {
            _mm256_storeu_ps(p.add(i), _mm256_mul_ps(va, _mm256_loadu_ps(p.add(i))));
            i += 8;
        }
        while i < n {
            *p.add(i) *= a;
            i += 1;
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn max_256(x: &[f32]) -> f32 {
        let n = x.len();
        let p = x.as_ptr();
        let mut m = _mm256_set1_ps(f32::NEG_INFINITY);
        let mut i = 0;
        while i + 8 <= n {
            m = _mm256_max_ps(m, _mm256_loadu_ps(p.add(i)));
            i += 8;
        }
        let h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
        let h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        let h = _mm_max_ss(h, _mm_movehdup_ps(h));
        let mut r = _mm_cvtss_f32(h);
        while i < n {
            r = r.max(*p.add(i));
            i += 1;
        }
        r
    }

    /// The constants of [`exp_256`] and [`exp_512`], one set so that the two give the same
    /// bits: the clamps, `ln 2` split in two for the reduction, and the polynomial's
    /// coefficients from the highest degree down.
    const EXP_UNDER: f32 = -87.336_55;
    const EXP_OVER: f32 = 88.0;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const EXP_POLY: [f32; 6] = [
        1.987_569_1e-4,
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        0.166_666_65,
        0.5,
    ];

    /// `e^x` in eight lanes (Cephes' `expf`: `x = n·ln 2 + r` with `|r| ≤ ln 2 / 2`, a degree-6
    /// polynomial in `r`, `2^n` built in the exponent bits), within 2 ulp of the correctly
    /// rounded value for results in the normal range. Below `−87.33` (where `e^x` leaves the
    /// normal range) the result is 0; NaN stays NaN. Softmax inputs are `x − max ≤ 0`; above 88
    /// the result is `e^88` (the clamp keeps `2^n` a finite f32).
    #[inline(always)]
    pub(crate) unsafe fn exp_256(x: __m256) -> __m256 {
        let lo = _mm256_set1_ps(EXP_UNDER);
        let under = _mm256_cmp_ps::<_CMP_LT_OQ>(x, lo);
        // `max(lo, x)` and `min(hi, ·)` return their second operand when it is NaN.
        let x = _mm256_min_ps(_mm256_set1_ps(EXP_OVER), _mm256_max_ps(lo, x));
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)),
        );
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
        let mut p = _mm256_set1_ps(EXP_POLY[0]);
        for &c in &EXP_POLY[1..] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
        }
        let y = _mm256_fmadd_ps(
            p,
            _mm256_mul_ps(r, r),
            _mm256_add_ps(r, _mm256_set1_ps(1.0)),
        );
        // 2^n for n in [-126, 127]: the biased exponent in bits 23..31.
        let e = _mm256_slli_epi32::<23>(_mm256_add_epi32(
            _mm256_cvtps_epi32(n),
            _mm256_set1_epi32(127),
        ));
        _mm256_andnot_ps(under, _mm256_mul_ps(y, _mm256_castsi256_ps(e)))
    }

    /// [`exp_256`] in sixteen lanes: the same reduction, polynomial and clamps, so each lane
    /// is `exp_256`'s result for it.
    #[inline(always)]
    pub(crate) unsafe fn exp_512(x: __m512) -> __m512 {
        let lo = _mm512_set1_ps(EXP_UNDER);
        let under = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, lo);
        // `max(lo, x)` and `min(hi, ·)` return their second operand when it is NaN.
        let x = _mm512_min_ps(_mm512_set1_ps(EXP_OVER), _mm512_max_ps(lo, x));
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)),
        );
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
        let mut p = _mm512_set1_ps(EXP_POLY[0]);
        for &c in &EXP_POLY[1..] {
            p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
        }
        let y = _mm512_fmadd_ps(
            p,
            _mm512_mul_ps(r, r),
            _mm512_add_ps(r, _mm512_set1_ps(1.0)),
        );
        // 2^n for n in [-126, 127]: the biased exponent in bits 23..31.
        let e = _mm512_slli_epi32::<23>(_mm512_add_epi32(
            _mm512_cvtps_epi32(n),
            _mm512_set1_epi32(127),
        ));
        _mm512_maskz_mul_ps(!under, y, _mm512_castsi512_ps(e))
    }

    /// `silu(g)·u` eight lanes at a time (see `silu_gated_at`), the tail through padded vectors.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn silu_gated_256(gate: &[f32], up: &[f32], out: &mut [f32]) {
        let n = out.len();
        let (pg, pu, po) = (gate.as_ptr(), up.as_ptr(), out.as_mut_ptr());
        let one = _mm256_set1_ps(1.0);
        let silu_mul = |g: __m256, u: __m256| {
            let e = exp_256(_mm256_sub_ps(_mm256_setzero_ps(), g));
            _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), u)
        };
        let mut i = 0;
        while i + 8 <= n {
            let y = silu_mul(_mm256_loadu_ps(pg.add(i)), _mm256_loadu_ps(pu.add(i)));
            _mm256_storeu_ps(po.add(i), y);
            i += 8;
        }
        if i < n {
            let (mut g, mut u) = ([0f32; 8], [0f32; 8]);
            g[..n - i].copy_from_slice(&gate[i..]);
            u[..n - i].copy_from_slice(&up[i..]);
            let mut y = [0f32; 8];
            _mm256_storeu_ps(
                y.as_mut_ptr(),
                silu_mul(_mm256_loadu_ps(g.as_ptr()), _mm256_loadu_ps(u.as_ptr())),
            );
            out[i..].copy_from_slice(&y[..n - i]);
        }
    }

    /// [`silu_gated_256`] sixteen lanes at a time: [`exp_512`] gives `exp_256`'s bits per lane
    /// and the division and product are the same per lane, so every element is
    /// `silu_gated_256`'s. The tail goes through `silu_gated_256`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
    pub(crate) unsafe fn silu_gated_512(gate: &[f32], up: &[f32], out: &mut [f32]) {
        let n = out.len();
        let (pg, pu, po) = (gate.as_ptr(), up.as_ptr(), out.as_mut_ptr());
        let one = _mm512_set1_ps(1.0);
        let mut i = 0;
        while i + 16 <= n {
            let g = _mm512_loadu_ps(pg.add(i));
            let e = exp_512(_mm512_sub_ps(_mm512_setzero_ps(), g));
            let y = _mm512_mul_ps(
                _mm512_div_ps(g, _mm512_add_ps(one, e)),
                _mm512_loadu_ps(pu.add(i)),
            );
            _mm512_storeu_ps(po.add(i), y);
            i += 16;
        }
        silu_gated_256(&gate[i..n], &up[i..n], &mut out[i..])
    }

    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn softmax_256(x: &mut [f32]) {
        softmax_256_body(x.as_mut_ptr(), x.len())
    }

    /// `p[i..n] ← exp(p[i..n] − m)` eight lanes at a time (the last fewer than 8 through a
    /// vector padded with `-inf`), each vector added to `acc` in order: the sum both softmaxes
    /// reduce.
    #[inline(always)]
    unsafe fn exps_256(p: *mut f32, mut i: usize, n: usize, m: f32, mut acc: __m256) -> __m256 {
        let vm = _mm256_set1_ps(m);
        while i + 8 <= n {
            let e = exp_256(_mm256_sub_ps(_mm256_loadu_ps(p.add(i)), vm));
            _mm256_storeu_ps(p.add(i), e);
            acc = _mm256_add_ps(acc, e);
            i += 8;
        }
        if i < n {
            let mut t = [f32::NEG_INFINITY; 8];
            std::ptr::copy_nonoverlapping(p.add(i), t.as_mut_ptr(), n - i);
            let e = exp_256(_mm256_sub_ps(_mm256_loadu_ps(t.as_ptr()), vm));
            _mm256_storeu_ps(t.as_mut_ptr(), e);
            std::ptr::copy_nonoverlapping(t.as_ptr(), p.add(i), n - i);
            acc = _mm256_add_ps(acc, e);
        }
        acc
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
    pub(crate) unsafe fn softmax_512(x: &mut [f32]) {
        softmax_512_body(x.as_mut_ptr(), x.len())
    }

    /// [`softmax_256_body`]'s bits, sixteen `exp`s at a time: [`exp_512`] gives `exp_256`'s
    /// bits per lane, and each 16-lane vector goes into the eight-lane sum as its low half, then
    /// its high half, the order in which two eight-lane steps add them. The rest (the max, the
    /// last fewer than 16 values, the division) is `softmax_256_body`'s.
    #[inline(always)]
    pub(crate) unsafe fn softmax_512_body(p: *mut f32, n: usize) {
        let m = max_256(std::slice::from_raw_parts(p, n));
        let vm = _mm512_set1_ps(m);
        let mut acc = _mm256_setzero_ps();
        let mut i = 0;
        while i + 16 <= n {
            let e = exp_512(_mm512_sub_ps(_mm512_loadu_ps(p.add(i)), vm));
            _mm512_storeu_ps(p.add(i), e);
            let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(e)));
            acc = _mm256_add_ps(_mm256_add_ps(acc, _mm512_castps512_ps256(e)), hi);
            i += 16;
        }
        let s = hsum256(exps_256(p, i, n, m, acc));
        let sum = _mm512_set1_ps(s);
        let mut i = 0;
        while i + 16 <= n {
            _mm512_storeu_ps(p.add(i), _mm512_div_ps(_mm512_loadu_ps(p.add(i)), sum));
            i += 16;
        }
        while i < n {
            *p.add(i) /= s;
            i += 1;
        }
    }

    /// [`softmax_256`]'s arithmetic, for callers compiled with AVX2 and FMA: the max, then
    /// `exp(x − max)` by [`exp_256`] eight lanes at a time (the tail through a padded vector),
    /// summed in eight lanes (lane `i mod 8` takes position `i`) and reduced once, then each
    /// value divided by the sum.
    #[inline(always)]
    pub(crate) unsafe fn softmax_256_body(p: *mut f32, n: usize) {
        let m = max_256(std::slice::from_raw_parts(p, n));
        let acc = exps_256(p, 0, n, m, _mm256_setzero_ps());
        let sum = _mm256_set1_ps(hsum256(acc));
        let mut i = 0;
        while i + 8 <= n {
            _mm256_storeu_ps(p.add(i), _mm256_div_ps(_mm256_loadu_ps(p.add(i)), sum));
            i += 8;
        }
        let s = _mm256_cvtss_f32(sum);
        while i < n {
            *p.add(i) /= s;
            i += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic pseudo-random values in [-1, 1).
    fn rand_vec(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// Every level's `silu(g)·u` is within a few ulp of f64's (lengths with 8-lane tails,
    /// gates from −120 to 120), NaN stays NaN, and far below zero the result is 0 to within
    /// 10⁻³⁶.
    #[test]
    fn silu_gated_matches_f64_every_level() {
        for l in available_levels() {
            for n in [0usize, 1, 7, 8, 9, 33, 1000] {
                let gate: Vec<f32> = rand_vec(n, n as u64 + 11)
                    .iter()
                    .map(|v| v * 12.0)
                    .collect();
                let up = rand_vec(n, n as u64 + 12);
                let mut out = vec![f32::NAN; n];
                silu_gated_at(l, &gate, &up, &mut out);
                for i in 0..n {
                    let (g, u) = (gate[i] as f64, up[i] as f64);
                    let want = g / (1.0 + (-g).exp()) * u;
                    let err = (out[i] as f64 - want).abs();
                    assert!(
                        err <= 4.0 * f32::EPSILON as f64 * want.abs() + 1e-37,
                        "{l:?} n={n} g={g} u={u}: {} vs {want}",
                        out[i]
                    );
                }
            }
            let gate = [f32::NAN, -120.0, -88.5, -87.0, 0.0, 87.0, 90.0, 120.0, 3.0];
            let mut out = [0f32; 9];
            silu_gated_at(l, &gate, &[1.0; 9], &mut out);
            assert!(out[0].is_nan(), "{l:?}");
            for (i, &g) in gate.iter().enumerate().skip(1) {
                let want = g as f64 / (1.0 + (-(g as f64)).exp());
                let err = (out[i] as f64 - want).abs();
                assert!(
                    err <= 4.0 * f32::EPSILON as f64 * want.abs() + 1e-36,
                    "{l:?} g={g}: {}",
                    out[i]
                );
            }
        }
    }

    /// Every level's softmax is within a few ulp of an f64 softmax (rows of 0 to 300 scores,
    /// spreads from tiny to far past `exp`'s range, `-inf` entries), and its `exp` stays within
    /// 2 ulp of f64's from −87.3 to 88.
    #[test]
    fn softmax_matches_f64_every_level() {
        for l in available_levels() {
            for n in 0..=300usize {
                for spread in [1e-3f32, 1.0, 30.0, 300.0] {
                    let mut x: Vec<f32> = rand_vec(n, n as u64 + 3)
                        .into_iter()
                        .map(|v| v * spread)
                        .collect();
                    if n > 5 {
                        x[n / 3] = f32::NEG_INFINITY;
                    }
                    let m = x.iter().fold(f64::NEG_INFINITY, |a, &v| a.max(v as f64));
                    let e: Vec<f64> = x.iter().map(|&v| (v as f64 - m).exp()).collect();
                    let total: f64 = e.iter().sum();
                    let mut got = x.clone();
                    softmax_at(l, &mut got);
                    for (i, (&g, &w)) in got.iter().zip(&e).enumerate() {
                        let want = w / total;
                        // A few ulp, what rounding `x − max` to f32 moves `exp` by, and
                        // the f32 sum's rounding (at most an ulp per term).
                        let shift = (x[i] as f64 - m).abs().min(1e3) * f32::EPSILON as f64;
                        let sum = n as f64 * f32::EPSILON as f64;
                        assert!(
                            ((g as f64) - want).abs() <= (4e-7 + shift + sum) * want + 1e-37,
                            "{l:?} n={n} spread={spread} [{i}]: {g} vs {want}"
                        );
                    }
                }
            }
        }
        #[cfg(target_arch = "x86_64")]
        if available_levels().contains(&Level::Avx2) {
            let mut worst = 0f64;
            let mut x = -87.3f32;
            while x < 87.8 {
                let v = [
                    x,
                    x * 0.5,
                    -x * 0.25,
                    x + 0.1,
                    x * 0.999,
                    -x * 0.7,
                    x * 0.01,
                    0.0,
                ];
                let mut out = [0f32; 8];
                // SAFETY: AVX2 and FMA are present.
                unsafe { exp_lanes(&v, &mut out) };
                for (&xi, &o) in v.iter().zip(&out) {
                    let want = (xi as f64).exp();
                    let ulp = (want as f32).abs() * f32::EPSILON;
                    worst = worst.max(((o as f64) - want).abs() / ulp as f64);
                }
                x += 0.0137;
            }
            assert!(worst <= 2.0, "exp_256 off by {worst} ulp");
            let mut out = [0f32; 8];
            let v = [
                f32::NAN,
                f32::NEG_INFINITY,
                -88.0,
                -1e30,
                0.0,
                -0.0,
                1.0,
                -1.0,
            ];
            unsafe { exp_lanes(&v, &mut out) };
            assert!(out[0].is_nan());
            assert_eq!(&out[1..4], &[0.0, 0.0, 0.0]);
            assert_eq!(&out[4..6], &[1.0, 1.0]);
        }
    }

    /// `exp_512` gives `exp_256`'s bits in every lane, specials included.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn exp_512_is_exp_256_lane_for_lane() {
        if !available_levels().contains(&Level::Avx512) {
            eprintln!("skipped: this CPU has no AVX-512");
            return;
        }
        let mut xs: Vec<f32> = (0..40_000).map(|i| -100.0 + i as f32 * 0.0047).collect();
        xs.extend([
            f32::NAN,
            f32::NEG_INFINITY,
            f32::INFINITY,
            -1e30,
            0.0,
            -0.0,
            1e-40,
        ]);
        for chunk in xs.chunks(16) {
            let mut x = [0f32; 16];
            x[..chunk.len()].copy_from_slice(chunk);
            let mut wide = [0f32; 16];
            let mut narrow = [0f32; 16];
            // SAFETY: AVX-512 F (and AVX2, FMA) are present.
            unsafe {
                exp_lanes16(&x, &mut wide);
                exp_lanes(
                    x[..8].try_into().unwrap(),
                    (&mut narrow[..8]).try_into().unwrap(),
                );
                exp_lanes(
                    x[8..].try_into().unwrap(),
                    (&mut narrow[8..]).try_into().unwrap(),
                );
            }
            for i in 0..16 {
                assert!(
                    wide[i].to_bits() == narrow[i].to_bits()
                        || (wide[i].is_nan() && narrow[i].is_nan()),
                    "exp({}): {} vs {}",
                    x[i],
                    wide[i],
                    narrow[i]
                );
            }
        }
    }

    /// The AVX-512 gated SiLU gives the AVX2 one's bits (so AVX-512 CPUs keep their results).
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn silu_gated_512_is_silu_gated_256_bit_for_bit() {
        if !available_levels().contains(&Level::Avx512) {
            eprintln!("skipped: this CPU has no AVX-512");
            return;
        }
        for n in [0usize, 5, 16, 31, 1000, 1536] {
            let mut gate: Vec<f32> = rand_vec(n, n as u64 + 21)
                .iter()
                .map(|v| v * 100.0)
                .collect();
            if n > 3 {
                gate[1] = f32::NAN;
                gate[2] = -120.0;
            }
            let up = rand_vec(n, n as u64 + 22);
            let (mut a, mut b) = (vec![0f32; n], vec![0f32; n]);
            // SAFETY: AVX-512 F/BW/VL, AVX2 and FMA are present.
            unsafe {
                x86::silu_gated_512(&gate, &up, &mut a);
                x86::silu_gated_256(&gate, &up, &mut b);
            }
            for i in 0..n {
                assert!(
                    a[i].to_bits() == b[i].to_bits() || (a[i].is_nan() && b[i].is_nan()),
                    "n={n} g={}: {} vs {}",
                    gate[i],
                    a[i],
                    b[i]
                );
            }
        }
    }

    /// The AVX-512 softmax gives the AVX2 one's bits: lengths around every vector boundary,
    /// `-inf` and NaN entries.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn softmax_512_is_softmax_256_bit_for_bit() {
        if !available_levels().contains(&Level::Avx512) {
            eprintln!("skipped: this CPU has no AVX-512");
            return;
        }
        for n in 0..=300usize {
            for spread in [1.0f32, 30.0, 300.0] {
                let mut x: Vec<f32> = rand_vec(n, n as u64 + 31)
                    .iter()
                    .map(|v| v * spread)
                    .collect();
                if n > 5 {
                    x[n / 3] = f32::NEG_INFINITY;
                }
                if n == 77 {
                    x[10] = f32::NAN;
                }
                let (mut a, mut b) = (x.clone(), x.clone());
                // SAFETY: AVX-512 F/BW/VL, AVX2 and FMA are present.
                unsafe {
                    x86::softmax_512(&mut a);
                    x86::softmax_256(&mut b);
                }
                for i in 0..n {
                    assert!(
                        a[i].to_bits() == b[i].to_bits() || (a[i].is_nan() && b[i].is_nan()),
                        "n={n} spread={spread} [{i}]: {} vs {}",
                        a[i],
                        b[i]
                    );
                }
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn exp_lanes16(x: &[f32; 16], out: &mut [f32; 16]) {
        use std::arch::x86_64::*;
        _mm512_storeu_ps(out.as_mut_ptr(), x86::exp_512(_mm512_loadu_ps(x.as_ptr())));
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn exp_lanes(x: &[f32; 8], out: &mut [f32; 8]) {
        use std::arch::x86_64::*;
        _mm256_storeu_ps(out.as_mut_ptr(), x86::exp_256(_mm256_loadu_ps(x.as_ptr())));
    }

    fn close(got: f32, want: f64, scale: f64) -> bool {
        ((got as f64) - want).abs() <= 1e-5 * scale.max(1e-30)
    }

    #[test]
    fn dots_match_reference_every_level() {
        for l in available_levels() {
            for n in 0..=1000usize {
                let a = rand_vec(n, n as u64 + 1);
                let b = rand_vec(n, n as u64 + 7777);
                let ab: Vec<bf16> = a.iter().map(|&v| bf16::from_f32(v)).collect();
                let want: f64 = a.iter().zip(&b).map(|(&x, &y)| x as f64 * y as f64).sum();
                let mag: f64 = a
                    .iter()
                    .zip(&b)
                    .map(|(&x, &y)| (x as f64 * y as f64).abs())
                    .sum();
                let got = dot_f32_at(l, &a, &b);
                assert!(
                    close(got, want, mag),
                    "dot_f32 {l:?} n={n}: {got} vs {want}"
                );
                let wantb: f64 = ab
                    .iter()
                    .zip(&b)
                    .map(|(&x, &y)| x.to_f64() * y as f64)
                    .sum();
                let magb: f64 = ab
                    .iter()
                    .zip(&b)
                    .map(|(&x, &y)| (x.to_f64() * y as f64).abs())
                    .sum();
                let got = dot_bf16_at(l, &ab, &b);
                assert!(
                    close(got, wantb, magb),
                    "dot_bf16 {l:?} n={n}: {got} vs {wantb}"
                );
                let want: f64 = a.iter().map(|&x| x as f64 * x as f64).sum();
                let got = sum_sq_at(l, &a);
                assert!(
                    close(got, want, want),
                    "sum_sq {l:?} n={n}: {got} vs {want}"
                );
                assert_eq!(max_at(l, &a), scalar::max(&a), "max {l:?} n={n}");
            }
        }
    }

    #[test]
    fn elementwise_match_reference_every_level() {
        for l in available_levels() {
            for n in 0..=300usize {
                let x = rand_vec(n, n as u64 + 3);
                let y0 = rand_vec(n, n as u64 + 5);
                let mut y = y0.clone();
                axpy_at(l, 0.37, &x, &mut y);
                for i in 0..n {
                    let want = y0[i] as f64 + 0.37f32 as f64 * x[i] as f64;
                    let mag = y0[i].abs() as f64 + (0.37 * x[i]).abs() as f64;
                    assert!(close(y[i], want, mag), "axpy {l:?} n={n} i={i}");
                }
                let mut s = x.clone();
                scale_at(l, &mut s, -1.5);
                for i in 0..n {
                    assert_eq!(s[i], x[i] * -1.5, "scale {l:?} n={n} i={i}");
                }
            }
        }
    }

    #[test]
    fn max_finds_the_tail() {
        for l in available_levels() {
            for n in 1..=100usize {
                let mut x = vec![-1.0f32; n];
                x[n - 1] = 5.0;
                assert_eq!(max_at(l, &x), 5.0, "{l:?} n={n}");
            }
            assert_eq!(max_at(l, &[]), f32::NEG_INFINITY);
        }
    }

    #[test]
    fn level_parsing_and_clamping() {
        assert_eq!(Level::parse("AVX512"), Some(Level::Avx512));
        assert_eq!(Level::parse("nope"), None);
        assert!(level() <= detected());
        assert_eq!(available_levels()[0], Level::Scalar);
    }
}

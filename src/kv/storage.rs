//! KV storage types: how one row of keys or values (`head_dim` f32s out of the model) is kept
//! in the cache, and read back as f32 for attention.
//!
//! | type | bytes / value | rounding |
//! |---|---|---|
//! | `f32` | 4 | none (the CPU default: exact against the references) |
//! | `bf16` | 2 | round to nearest even (the GPU default) |
//! | `f16` | 2 | round to nearest even, overflow to ±inf |
//! | `fp8` (e4m3, "fn" variant) | 1 | round to nearest even, saturating at ±448 |
//! | `q8` | 1 + 4/32 | groups of 32 values share an f32 scale `max|x| / 127`; values round to the nearest step |
//!
//! The element bytes of a row are contiguous; `q8`'s scales live in a parallel array (see
//! [`super::layout`]).

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

/// How a cache stores K and V.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum KvDtype {
    #[default]
    F32,
    Bf16,
    F16,
    /// 8-bit float, 4 exponent bits (bias 7), 3 mantissa bits, no infinities.
    Fp8E4m3,
    /// 8-bit integers in groups of [`Q8_GROUP`] with one f32 scale per group (like ggml's Q8_0).
    Q8,
}

/// Values per scale in [`KvDtype::Q8`].
pub const Q8_GROUP: usize = 32;

/// Every storage type, in the order the docs list them.
pub const ALL_KV_DTYPES: [KvDtype; 5] = [
    KvDtype::F32,
    KvDtype::Bf16,
    KvDtype::F16,
    KvDtype::Fp8E4m3,
    KvDtype::Q8,
];

impl KvDtype {
    /// Bytes of one stored value (scales not counted).
    pub fn bytes_per_elem(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::Bf16 | KvDtype::F16 => 2,
            KvDtype::Fp8E4m3 | KvDtype::Q8 => 1,
        }
    }

    /// Values sharing one scale, for grouped types.
    pub fn group(self) -> Option<usize> {
        match self {
            KvDtype::Q8 => Some(Q8_GROUP),
            _ => None,
        }
    }

    /// Bytes `n` values take, scales included (`n` a multiple of the group).
    pub fn bytes_for(self, n: usize) -> usize {
        n * self.bytes_per_elem() + self.group().map_or(0, |g| n / g * 4)
    }

    /// The name used on command lines and in reports.
    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::Bf16 => "bf16",
            KvDtype::F16 => "f16",
            KvDtype::Fp8E4m3 => "fp8",
            KvDtype::Q8 => "q8",
        }
    }

    /// Parses a [`KvDtype::name`] (also `fp8-e4m3`, `q8_0`).
    pub fn parse(s: &str) -> Option<KvDtype> {
        match s.to_ascii_lowercase().as_str() {
            "f32" => Some(KvDtype::F32),
            "bf16" => Some(KvDtype::Bf16),
            "f16" => Some(KvDtype::F16),
            "fp8" | "fp8-e4m3" | "e4m3" => Some(KvDtype::Fp8E4m3),
            "q8" | "q8_0" => Some(KvDtype::Q8),
            _ => None,
        }
    }
}

impl std::fmt::Display for KvDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Largest finite e4m3 value.
pub const FP8_MAX: f32 = 448.0;

/// f32 → e4m3 ("fn": no infinities, NaN = S.1111.111), round to nearest even, saturating.
pub fn f32_to_fp8(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7f;
    }
    let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
    let a = x.abs();
    if a >= FP8_MAX {
        return sign | 0x7e;
    }
    let bits = a.to_bits();
    let exp = ((bits >> 23) as i32) - 127;
    if exp < -6 {
        // Subnormal (or zero): steps of 2^-9. `a · 512` is exact in f32, so rounding it to
        // the nearest even integer is the correctly rounded result; 8 steps carry into the
        // smallest normal, whose code is also 8.
        let q = (a * 512.0).round_ties_even() as u8;
        return sign | q;
    }
    let mant = bits & 0x7f_ffff;
    let mut q = (((exp + 7) as u32) << 3) | (mant >> 20);
    let rem = mant & 0xf_ffff;
    let half = 0x8_0000;
    if rem > half || (rem == half && q & 1 == 1) {
        q += 1;
    }
    sign | q.min(0x7e) as u8
}

/// e4m3 → f32 (exact).
pub fn fp8_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let e = ((b >> 3) & 0xf) as i32;
    let m = (b & 7) as f32;
    if e == 0 {
        sign * m * (2.0f32).powi(-9)
    } else if e == 15 && b & 7 == 7 {
        f32::NAN
    } else {
        sign * (1.0 + m / 8.0) * (2.0f32).powi(e - 7)
    }
}

/// [`fp8_to_f32`] of every code, bit for bit.
static FP8_VALUES: std::sync::LazyLock<[f32; 256]> =
    std::sync::LazyLock::new(|| std::array::from_fn(|b| fp8_to_f32(b as u8)));

/// Stores one row: `src` (`n` values) into `data` (`n · bytes_per_elem` bytes) and, for grouped
/// types, `scales` (`n / group` entries).
pub fn encode_row(dtype: KvDtype, src: &[f32], data: &mut [u8], scales: &mut [f32]) {
    match dtype {
        KvDtype::F32 => data.copy_from_slice(bytemuck::cast_slice(src)),
        KvDtype::Bf16 => {
            for (d, &x) in data.chunks_exact_mut(2).zip(src) {
                d.copy_from_slice(&bf16::from_f32(x).to_le_bytes());
            }
        }
        KvDtype::F16 => {
            for (d, &x) in data.chunks_exact_mut(2).zip(src) {
                d.copy_from_slice(&f16::from_f32(x).to_le_bytes());
            }
        }
        KvDtype::Fp8E4m3 => {
            for (d, &x) in data.iter_mut().zip(src) {
                *d = f32_to_fp8(x);
            }
        }
        KvDtype::Q8 => {
            for ((g, d), s) in src
                .chunks_exact(Q8_GROUP)
                .zip(data.chunks_exact_mut(Q8_GROUP))
                .zip(scales.iter_mut())
            {
                let amax = g.iter().fold(0.0f32, |m, x| m.max(x.abs()));
                let scale = amax / 127.0;
                let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
                for (q, &x) in d.iter_mut().zip(g) {
                    *q = ((x * inv).round().clamp(-127.0, 127.0) as i8) as u8;
                }
                *s = scale;
            }
        }
    }
}

/// Reads one row back as f32 (the inverse of [`encode_row`] up to its rounding).
///
/// Always inlined, with the pool's readers: attention's kernels call them from functions
/// compiled for AVX2 or AVX-512, where the conversions then vectorize at that width.
#[inline(always)]
pub fn decode_row(dtype: KvDtype, data: &[u8], scales: &[f32], dst: &mut [f32]) {
    match dtype {
        KvDtype::F32 => {
            for (d, b) in dst.iter_mut().zip(data.chunks_exact(4)) {
                *d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        KvDtype::Bf16 => {
            // A shift per element, written so that it vectorizes: attention decodes every key
            // and value it reads, and `bf16::to_f32` per element took 45% of a long-context
            // decode step (SmolLM2, 512 positions, Intel Xeon, `perf`). Bit for bit
            // `bf16::to_f32`, whose NaNs keep their payload with the quiet bit set.
            let (pairs, _) = data.as_chunks::<2>();
            for (d, &b) in dst.iter_mut().zip(pairs) {
                let i = u16::from_le_bytes(b) as u32;
                let i = if i & 0x7fff > 0x7f80 { i | 0x40 } else { i };
                *d = f32::from_bits(i << 16);
            }
        }
        KvDtype::F16 => {
            // F16C eight at a time where the CPU has it (the hardware conversion is exact, and
            // quiets NaNs as `half` does); otherwise the `half` crate's slice conversion where
            // the bytes are aligned halves, as the pool's are, element by element where not.
            let n = dst.len().min(data.len() / 2);
            let (data, dst) = (&data[..2 * n], &mut dst[..n]);
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("f16c") {
                // SAFETY: the CPU has F16C.
                unsafe { f16c_to_f32(data, dst) };
                return;
            }
            f16_to_f32_portable(data, dst);
        }
        KvDtype::Fp8E4m3 => {
            // Through a table of every code: `fp8_to_f32`'s powers of two per element made an
            // fp8 cache 13–17× slower than bf16 (SmolLM2, 1,024 tokens, Intel Xeon).
            let table = &*FP8_VALUES;
            for (d, &b) in dst.iter_mut().zip(data) {
                *d = table[b as usize];
            }
        }
        KvDtype::Q8 => decode_q8(data, scales, dst),
    }
}

/// Little-endian halves to floats through the `half` crate: its slice conversion where the
/// bytes are aligned halves, element by element where not.
fn f16_to_f32_portable(data: &[u8], dst: &mut [f32]) {
    match bytemuck::try_cast_slice::<u8, f16>(data) {
        Ok(halves) if cfg!(target_endian = "little") => halves.convert_to_f32_slice(dst),
        _ => {
            for (d, b) in dst.iter_mut().zip(data.chunks_exact(2)) {
                *d = f16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
    }
}

/// Little-endian halves (`data`, two bytes per float of `dst`) to floats by F16C, eight at a
/// time; the last few through [`f16_to_f32_portable`].
///
/// # Safety
/// The CPU supports F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "f16c,avx")]
unsafe fn f16c_to_f32(data: &[u8], dst: &mut [f32]) {
    use std::arch::x86_64::{_mm256_cvtph_ps, _mm256_storeu_ps, _mm_loadu_si128};
    let n = dst.len().min(data.len() / 2);
    let whole = n - n % 8;
    for (h, out) in data[..2 * whole]
        .chunks_exact(16)
        .zip(dst[..whole].chunks_exact_mut(8))
    {
        // SAFETY: 16 bytes read, 8 floats written, each inside its chunk.
        let v = _mm256_cvtph_ps(_mm_loadu_si128(h.as_ptr().cast()));
        _mm256_storeu_ps(out.as_mut_ptr(), v);
    }
    f16_to_f32_portable(&data[2 * whole..2 * n], &mut dst[whole..n]);
}

/// [`decode_row`] of [`KvDtype::Q8`], kept out of line: inlined into attention's AVX-512
/// kernel it ran slower (SmolLM2, four sequences of 512 tokens, Intel Xeon: 303 → 256 tok/s).
#[inline(never)]
fn decode_q8(data: &[u8], scales: &[f32], dst: &mut [f32]) {
    for ((d, q), &s) in dst
        .chunks_exact_mut(Q8_GROUP)
        .zip(data.chunks_exact(Q8_GROUP))
        .zip(scales)
    {
        for (x, &b) in d.iter_mut().zip(q) {
            *x = (b as i8) as f32 * s;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn half_rows_decode_as_the_half_crate_converts_every_code() {
        // Every 16-bit pattern (NaNs, infinities, subnormals, signed zeros), from aligned bytes
        // (the pool's) and from bytes one past alignment (the element-wise fallback).
        let codes: Vec<u16> = (0..=u16::MAX).collect();
        let mut bytes = vec![0u8; 1];
        bytes.extend(codes.iter().flat_map(|c| c.to_le_bytes()));
        let words: Vec<u32> = bytemuck::cast_slice::<u16, u8>(&codes)
            .chunks_exact(4)
            .map(|b| u32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let aligned: &[u8] = bytemuck::cast_slice(&words);
        for dtype in [KvDtype::Bf16, KvDtype::F16] {
            let want: Vec<u32> = codes
                .iter()
                .map(|&c| match dtype {
                    KvDtype::Bf16 => bf16::from_bits(c).to_f32().to_bits(),
                    _ => f16::from_bits(c).to_f32().to_bits(),
                })
                .collect();
            for data in [aligned, &bytes[1..]] {
                let mut got = vec![0f32; codes.len()];
                decode_row(dtype, data, &[], &mut got);
                let got: Vec<u32> = got.iter().map(|v| v.to_bits()).collect();
                assert!(
                    got == want,
                    "{dtype:?} decodes differ from the half crate's"
                );
                // A length that is not a whole number of vectors (the last few go one by one).
                let short = codes.len() - 3;
                let mut got = vec![0f32; short];
                decode_row(dtype, &data[..2 * short], &[], &mut got);
                let got: Vec<u32> = got.iter().map(|v| v.to_bits()).collect();
                assert!(got == want[..short], "{dtype:?}: the last few codes differ");
                if dtype == KvDtype::F16 {
                    // The path CPUs without F16C take.
                    let mut got = vec![0f32; codes.len()];
                    f16_to_f32_portable(&data[..2 * codes.len()], &mut got);
                    let got: Vec<u32> = got.iter().map(|v| v.to_bits()).collect();
                    assert!(got == want, "portable f16 decodes differ");
                }
            }
        }
    }

    /// The e4m3 value set from its definition, independently of the decoder: every finite
    /// code's value, computed by exponent/mantissa enumeration in f64.
    fn e4m3_values() -> Vec<(u8, f64)> {
        let mut v = Vec::new();
        for sign in [0u8, 0x80] {
            for e in 0..16u8 {
                for m in 0..8u8 {
                    if e == 15 && m == 7 {
                        continue;
                    }
                    let mag = if e == 0 {
                        m as f64 / 8.0 * 2f64.powi(-6)
                    } else {
                        (1.0 + m as f64 / 8.0) * 2f64.powi(e as i32 - 7)
                    };
                    v.push((sign | (e << 3) | m, if sign != 0 { -mag } else { mag }));
                }
            }
        }
        v
    }

    #[test]
    fn fp8_decodes_every_code_and_round_trips() {
        for (code, want) in e4m3_values() {
            assert_eq!(fp8_to_f32(code) as f64, want, "code {code:#04x}");
            if code != 0x80 {
                assert_eq!(f32_to_fp8(want as f32), code, "value {want}");
            }
        }
        assert!(fp8_to_f32(0x7f).is_nan());
        // A row decodes through the table as `fp8_to_f32` decodes each code.
        let codes: Vec<u8> = (0..=255).collect();
        let mut row = vec![0f32; 256];
        decode_row(KvDtype::Fp8E4m3, &codes, &[], &mut row);
        for (&code, x) in codes.iter().zip(&row) {
            assert_eq!(x.to_bits(), fp8_to_f32(code).to_bits(), "code {code:#04x}");
        }
        assert_eq!(f32_to_fp8(f32::NAN), 0x7f);
        assert_eq!(f32_to_fp8(1e9), 0x7e);
        assert_eq!(f32_to_fp8(-1e9), 0xfe);
    }

    /// Encoding picks the nearest representable value (ties to the even code), checked by
    /// brute force over the value set on a sweep of inputs.
    #[test]
    fn fp8_rounds_to_nearest_even() {
        let values = e4m3_values();
        let mut x = 1e-4f32;
        while x < 460.0 {
            for s in [x, -x] {
                let got = fp8_to_f32(f32_to_fp8(s)) as f64;
                let best = values
                    .iter()
                    .map(|&(_, v)| (v - s as f64).abs())
                    .fold(f64::INFINITY, f64::min);
                let clamped = (s as f64).clamp(-448.0, 448.0);
                let err = (got - clamped).abs();
                assert!(
                    err <= best.max((clamped - s as f64).abs()) + 1e-12 || s.abs() >= 448.0,
                    "{s}: got {got}, nearest is {best} away"
                );
                if err == best && s.abs() < 448.0 {
                    // At an exact tie the even code (mantissa bit 0 clear) wins.
                    let ties: Vec<_> = values
                        .iter()
                        .filter(|&&(_, v)| ((v - s as f64).abs() - best).abs() < 1e-15)
                        .collect();
                    if ties.len() == 2 {
                        assert_eq!(f32_to_fp8(s) & 1, 0, "{s}: tie must go to the even code");
                    }
                }
            }
            x *= 1.013;
        }
    }

    fn round_trip(dtype: KvDtype, src: &[f32]) -> Vec<f32> {
        let mut data = vec![0u8; src.len() * dtype.bytes_per_elem()];
        let mut scales = vec![0f32; dtype.group().map_or(0, |g| src.len() / g)];
        encode_row(dtype, src, &mut data, &mut scales);
        let mut out = vec![0f32; src.len()];
        decode_row(dtype, &data, &scales, &mut out);
        out
    }

    #[test]
    fn every_type_round_trips_within_its_precision() {
        let src: Vec<f32> = (0..64)
            .map(|i| ((i * 37 % 64) as f32 - 31.5) * 0.173)
            .collect();
        assert_eq!(round_trip(KvDtype::F32, &src), src);
        for (dtype, rel) in [
            (KvDtype::Bf16, 1.0 / 256.0),
            (KvDtype::F16, 1.0 / 2048.0),
            (KvDtype::Fp8E4m3, 1.0 / 16.0),
        ] {
            for (a, b) in round_trip(dtype, &src).iter().zip(&src) {
                assert!((a - b).abs() <= b.abs() * rel + 1e-3, "{dtype}: {a} vs {b}");
            }
        }
        // q8: error at most half a step of its group's scale.
        let out = round_trip(KvDtype::Q8, &src);
        for g in 0..2 {
            let grp = &src[g * 32..(g + 1) * 32];
            let step = grp.iter().fold(0f32, |m, x| m.max(x.abs())) / 127.0;
            for (a, b) in out[g * 32..(g + 1) * 32].iter().zip(grp) {
                assert!((a - b).abs() <= step * 0.5 + 1e-6, "q8: {a} vs {b}");
            }
        }
        assert_eq!(round_trip(KvDtype::Q8, &[0.0; 32]), vec![0.0; 32]);
    }

    #[test]
    fn names_parse_back() {
        for d in ALL_KV_DTYPES {
            assert_eq!(KvDtype::parse(d.name()), Some(d));
        }
        assert_eq!(KvDtype::parse("fp8-e4m3"), Some(KvDtype::Fp8E4m3));
        assert_eq!(KvDtype::parse("int4"), None);
    }
}

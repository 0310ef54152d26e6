//! AMX-BF16 tiles for the matrix products with bf16 weights, on CPUs with AMX-BF16 (Intel
//! Sapphire Rapids and later), used wherever the CPU has AMX-TILE and AMX-BF16 and Linux grants
//! the tile state; `KILN_AMX=0` turns it off for a process (the `vdpbf16ps` panels, or the exact
//! FMA panels, then run). Two modes share one kernel ([`block_tokens`]):
//!
//! - [`super::Numerics::Bf16`]: the activations rounded to bf16 ([`round_rows`]), one product per
//!   tile pair. First run on 2026-12-01 on an Intel Xeon with AMX (2 vCPUs): SmolLM2-135M's shape
//!   (`kiln-bench --synthetic smollm2-135m -p 512 -n 0 -t 2 -r 3 --numerics bf16`) prefilled
//!   1,717–1,724 tok/s with it against 543–578 on the panels, alternating.
//! - Every other numerics' products with bf16 weights (exact in all of them), calls of more
//!   than 16 tokens: each activation cut into three bf16 parts whose sum is the activation
//!   exactly ([`split_rows`]), each weight tile multiplied by the three parts' tiles into the same
//!   sums. A product of two bf16 values is exact in f32, so every term `w·x` is exact and only
//!   the order of the sums differs from the FMA panels (the last bits of a result, tested against
//!   an f64 reference within 1e-6 of the sum of the terms' magnitudes). Measured on 2026-12-02 on
//!   the same kind of Xeon (quiet host, `kiln-bench --synthetic smollm2-135m -p 512 -n 0 -t 2
//!   -r 3`, alternating `KILN_AMX=0` and `1`): 1,169–1,186 tok/s on the FMA panels, 1,438–1,486
//!   with the tiles.
//!
//! `tdpbf16ps` multiplies a tile of 16 tokens × 32 bf16 activations by a tile of 16 bf16 pairs
//! × 16 outputs into 16 × 16 f32 sums: 8,192 multiply-adds per instruction, against 32 for
//! `vdpbf16ps`. The weights come in the bf16 panels' packing (`panel[j][i]` holds elements
//! `2j`, `2j + 1` of output `i`, 32 outputs, 128 bytes per pair), which is already the B tile's
//! layout: 16 pairs × 16 outputs with a stride of 128 bytes, outputs 16..32 at 64 bytes in. The
//! activations are laid out row by row (token `t`'s pairs contiguous, the A tile's rows), padded
//! with zero tokens to a multiple of 32. Each step loads two A tiles (32 tokens) per part and two
//! B tiles (32 outputs) and issues four `tdpbf16ps` per part into four accumulator tiles. Panels
//! are packed a block at a time ([`BLOCK_BYTES`], held in L2) and the 32-token steps pass over
//! the block.
//!
//! Each output is one chain over the k pairs in steps of 16, so a token's result does not depend
//! on the other tokens of its call; how a step sums its 16 pairs is the CPU's, so results differ
//! in the last bits from the panels. The tiles read bf16 subnormals as zero (see
//! [`split_rows`]). Linux must grant the process the tile state first
//! (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`); a refusal leaves AMX off.

use std::arch::asm;
use std::arch::x86_64::*;
use std::sync::OnceLock;

use super::avx512_panel::{put, NR};
use super::Job;
use crate::backend::cpu::simd::x86::bf16_pairs;

/// Whether the bf16 panels use AMX: not turned off (`KILN_AMX=0`), the CPU has AMX-TILE and
/// AMX-BF16, and the kernel granted the tile state. Decided once per process.
pub(super) fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| !turned_off() && cpu_has_amx_bf16() && permitted())
}

/// `KILN_AMX=0`: the process runs without the tiles.
pub(super) fn turned_off() -> bool {
    std::env::var("KILN_AMX").is_ok_and(|v| v.trim() == "0")
}

/// Whether a product over `k` elements takes the AMX tiles (whole 32-element steps).
pub(super) fn takes(k: usize) -> bool {
    k > 0 && k.is_multiple_of(32) && enabled()
}

/// CPUID leaf 7: EDX bit 22 AMX-BF16, bit 24 AMX-TILE.
fn cpu_has_amx_bf16() -> bool {
    let leaf = __cpuid_count(7, 0);
    leaf.edx & (1 << 22) != 0 && leaf.edx & (1 << 24) != 0
}

/// Asks Linux for the tile data state (`ARCH_REQ_XCOMP_PERM`, `XFEATURE_XTILEDATA`); asking
/// again once granted is harmless.
#[cfg(target_os = "linux")]
pub(super) fn permitted() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: a system call with integer arguments; it changes only this process's permission.
    unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        ) == 0
    }
}

#[cfg(not(target_os = "linux"))]
pub(super) fn permitted() -> bool {
    false
}

/// Tokens per step (two A tiles of 16 rows).
const STEP_TOKENS: usize = 32;

/// Rows `0..tokens` of `x` (row `t` at `t·ldx`, `k` wide, `k` a multiple of 32) rounded to bf16
/// pairs, token `t`'s `k / 2` words at `t · k/2`, then zero rows up to a multiple of 32 tokens.
///
/// # Safety
/// The CPU supports AVX512-BF16 (and F/BW/VL); `x` holds the rows.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
pub(super) unsafe fn round_rows(x: &[f32], ldx: usize, tokens: usize, k: usize) -> Vec<u32> {
    assert!(k.is_multiple_of(32) && (tokens == 0 || x.len() >= (tokens - 1) * ldx + k));
    let kp = k / 2;
    let mut out = vec![0u32; tokens.div_ceil(STEP_TOKENS) * STEP_TOKENS * kp];
    for t in 0..tokens {
        let src = x.as_ptr().add(t * ldx);
        let dst = out.as_mut_ptr().add(t * kp);
        for c in (0..k).step_by(32) {
            _mm512_storeu_si512(dst.add(c / 2) as *mut __m512i, bf16_pairs(src.add(c), 32));
        }
    }
    out
}

/// The parts [`split_rows`] cuts each activation into for exact products.
pub(super) const EXACT_PARTS: usize = 3;

/// Rows `0..tokens` of `x` (row `t` at `t·ldx`, `k` wide, `k` a multiple of 32) each cut into
/// three bf16 parts whose sum is the activation exactly, for exact products on the tiles:
/// `hi` is `x` with its 16 low bits cleared (its top 8 significant bits), `mid` the remainder
/// `x − hi` (exact in f32, at most 16 significant bits) cleared likewise, `lo = x − hi − mid`
/// (at most 8 significant bits, so a bf16 exactly). Products of bf16 weights with each part are
/// exact in f32, so `w·hi + w·mid + w·lo` is `w·x` up to the rounding of the sums. An infinite
/// or NaN activation keeps its value in `hi` (a NaN made quiet, which clearing the low bits
/// could otherwise turn into an infinity) with `mid = lo = 0`, so its products are those of the
/// f32 kernels (`∞ − ∞` would make a NaN of every product). The tiles read bf16 subnormals as
/// zero: activations below 2⁻¹¹⁰ in magnitude lose their low parts, below 2⁻¹²⁶ all of it (as do
/// subnormal weights).
///
/// Layout: 32-token steps (zero rows past `tokens`), step `s` at `s · 3 · 32 · k/2` words,
/// part `p` of it at `p · 32 · k/2`, token `32s + r`'s `k/2` words at `r · k/2` in the part
/// (element `2j` in the low half of word `j`). Steps are split in parallel.
///
/// # Safety
/// The CPU supports AVX-512 F/BW; `x` holds the rows.
pub(super) unsafe fn split_rows(x: &[f32], ldx: usize, tokens: usize, k: usize) -> Vec<u32> {
    use crate::backend::cpu::par;
    assert!(k.is_multiple_of(32) && (tokens == 0 || x.len() >= (tokens - 1) * ldx + k));
    let kp = k / 2;
    let step_words = EXACT_PARTS * STEP_TOKENS * kp;
    let mut out = vec![0u32; tokens.div_ceil(STEP_TOKENS) * step_words];
    if step_words == 0 {
        return out;
    }
    par::for_each_chunk_mut(&mut out, step_words, |s, step| {
        let t0 = s * STEP_TOKENS;
        for r in 0..(tokens - t0).min(STEP_TOKENS) {
            // SAFETY: as this function's; row `t0 + r` is in `x` (checked above).
            unsafe { split_row(&x[(t0 + r) * ldx..][..k], step, r * kp, STEP_TOKENS * kp) };
        }
    });
    out
}

/// One row's three parts into `step[at + p·part ..]`, 32 elements (16 words) at a time.
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn split_row(row: &[f32], step: &mut [u32], at: usize, part: usize) {
    assert!(row.len().is_multiple_of(32) && step.len() >= at + 2 * part + row.len() / 2);
    // Word m of the result is the high half of element m: 16-bit word 2m + 1 of (a, b).
    let odd = _mm512_set_epi16(
        63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29, 27, 25, 23, 21, 19,
        17, 15, 13, 11, 9, 7, 5, 3, 1,
    );
    let dst = step.as_mut_ptr().add(at);
    for c in (0..row.len()).step_by(32) {
        let a = split16(_mm512_loadu_ps(row.as_ptr().add(c)));
        let b = split16(_mm512_loadu_ps(row.as_ptr().add(c + 16)));
        for p in 0..EXACT_PARTS {
            let words = _mm512_permutex2var_epi16(a[p], odd, b[p]);
            _mm512_storeu_si512(dst.add(p * part + c / 2) as *mut __m512i, words);
        }
    }
}

/// Sixteen activations' three parts (hi, mid, lo), each as f32 bit patterns whose low 16 bits
/// are zero (see [`split_rows`]).
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn split16(v: __m512) -> [__m512i; EXACT_PARTS] {
    let top = _mm512_set1_epi32(0xffff_0000u32 as i32);
    let quiet = _mm512_set1_epi32(0x0040_0000);
    let abs = _mm512_set1_epi32(0x7fff_ffff);
    let inf = _mm512_set1_epi32(0x7f80_0000);
    let bits = _mm512_castps_si512(v);
    let mag = _mm512_and_si512(bits, abs);
    let nan = _mm512_cmpgt_epu32_mask(mag, inf);
    let finite = _mm512_cmplt_epu32_mask(mag, inf);
    let hi = _mm512_and_si512(_mm512_mask_or_epi32(bits, nan, bits, quiet), top);
    let rest = _mm512_maskz_sub_ps(finite, v, _mm512_castsi512_ps(hi));
    let mid = _mm512_and_si512(_mm512_castps_si512(rest), top);
    let lo = _mm512_sub_ps(rest, _mm512_castsi512_ps(mid));
    [hi, mid, _mm512_and_si512(_mm512_castps_si512(lo), top)]
}

/// A tile configuration (`ldtilecfg`'s 64 bytes).
#[repr(C, align(64))]
pub(super) struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    pub(super) colsb: [u16; 16],
    pub(super) rows: [u8; 16],
}

impl TileConfig {
    /// Palette 1 with tiles 0..8 of `rows[i]` rows × `colsb[i]` bytes, the others unused.
    pub(super) const fn palette1(colsb: [u16; 8], rows: [u8; 8]) -> TileConfig {
        let mut c = TileConfig {
            palette: 1,
            start_row: 0,
            reserved: [0; 14],
            colsb: [0; 16],
            rows: [0; 16],
        };
        let mut i = 0;
        while i < 8 {
            c.colsb[i] = colsb[i];
            c.rows[i] = rows[i];
            i += 1;
        }
        c
    }
}

/// Tiles 0..8 of 16 rows × 64 bytes (0–3 the f32 sums, 4–5 the activations, 6–7 the weights).
const CONFIG: TileConfig = TileConfig::palette1([64; 8], [16; 8]);

/// Bytes of packed weights a block of panels holds (about a third of a 2 MiB L2): the block is
/// read from memory once and its panels then stay in L2 while every 32-token step passes over
/// them.
const BLOCK_BYTES: usize = 768 << 10;

/// Panels of `kp` lines (128 bytes each) per block of [`BLOCK_BYTES`], at least one.
pub(super) fn panels_per_block(kp: usize) -> usize {
    (BLOCK_BYTES / (kp * 128).max(1)).max(1)
}

/// Every token of `job` against a block of packed panels (`panels`: panel `i`, outputs
/// `n + 32i ..`, at `i · kp · 32` words, `k / 2` lines of 32 words each) covering outputs
/// `n..end`, written to the output through [`put`]. Steps of 32 tokens go outermost, so a
/// step's activation tiles are read from memory once for the whole block and stay in L2 while
/// its panels pass. `PARTS` is 1 for [`super::Numerics::Bf16`]'s rounded activations
/// ([`round_rows`]) and [`EXACT_PARTS`] for exact products ([`split_rows`]): each step
/// multiplies the weight tiles by every part's activation tiles into the same sums.
///
/// # Safety
/// AMX is [`enabled`] and the CPU supports AVX512-BF16 (and F/BW/VL, AVX2, FMA); `xb` holds
/// [`round_rows`]'s (`PARTS == 1`) or [`split_rows`]'s (`PARTS == EXACT_PARTS`) rows for
/// `job.tokens` tokens of `k = 2·kp` elements, `kp` a multiple of 16; `panels` holds
/// `⌈(end − n) / 32⌉` panels; `job` describes valid memory.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")]
pub(super) unsafe fn block_tokens<const PARTS: usize>(
    panels: *const u32,
    xb: &[u32],
    kp: usize,
    job: &Job,
    n: usize,
    end: usize,
) {
    assert!(kp.is_multiple_of(16));
    assert!(xb.len() >= job.tokens.div_ceil(STEP_TOKENS) * STEP_TOKENS * kp * PARTS);
    asm!("ldtilecfg [{}]", in(reg) &CONFIG, options(nostack, readonly));
    let mut sums = [[0f32; 16 * 16]; 4];
    let a_stride = kp * 4;
    let b_stride = NR * 4;
    // Words between a step's parts (one part of 32 token rows).
    let part = STEP_TOKENS * kp;
    let mut t0 = 0;
    while t0 < job.tokens {
        let step = xb.as_ptr().add(t0 * kp * PARTS);
        let mut o = n;
        while o < end {
            let panel = panels.add((o - n) / NR * kp * NR);
            asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                options(nostack, nomem)
            );
            for j in (0..kp).step_by(16) {
                asm!(
                    "tileloadd tmm6, [{b} + {sb}*1]",
                    "tileloadd tmm7, [{b} + {sb}*1 + 64]",
                    b = in(reg) panel.add(j * NR),
                    sb = in(reg) b_stride,
                    options(nostack, readonly)
                );
                for p in 0..PARTS {
                    let a0 = step.add(p * part + j);
                    asm!(
                        "tileloadd tmm4, [{a0} + {sa}*1]",
                        "tileloadd tmm5, [{a1} + {sa}*1]",
                        "tdpbf16ps tmm0, tmm4, tmm6",
                        "tdpbf16ps tmm1, tmm4, tmm7",
                        "tdpbf16ps tmm2, tmm5, tmm6",
                        "tdpbf16ps tmm3, tmm5, tmm7",
                        a0 = in(reg) a0,
                        a1 = in(reg) a0.add(16 * kp),
                        sa = in(reg) a_stride,
                        options(nostack, readonly)
                    );
                }
            }
            asm!(
                "tilestored [{s0} + {st}*1], tmm0",
                "tilestored [{s1} + {st}*1], tmm1",
                "tilestored [{s2} + {st}*1], tmm2",
                "tilestored [{s3} + {st}*1], tmm3",
                s0 = in(reg) sums[0].as_mut_ptr(),
                s1 = in(reg) sums[1].as_mut_ptr(),
                s2 = in(reg) sums[2].as_mut_ptr(),
                s3 = in(reg) sums[3].as_mut_ptr(),
                st = in(reg) 64usize,
                options(nostack)
            );
            // Tile 2·h + o: tokens t0 + 16·h .., outputs o + 16·o' ...
            let nr = (end - o).min(NR);
            for i in 0..(job.tokens - t0).min(STEP_TOKENS) {
                let (h, r) = (i / 16, i % 16);
                let lo = _mm512_loadu_ps(sums[2 * h].as_ptr().add(16 * r));
                let hi = _mm512_loadu_ps(sums[2 * h + 1].as_ptr().add(16 * r));
                put(job, t0 + i, o, nr, [lo, hi]);
            }
            o += nr;
        }
        t0 += STEP_TOKENS;
    }
    asm!("tilerelease", options(nostack, nomem));
}

#[cfg(test)]
mod tests {
    use super::*;

    /// [`split_rows`]'s three parts are bf16 values (low 16 bits clear) that sum to each
    /// activation exactly, from the largest normal magnitudes down to 2⁻¹¹⁰ (below that the
    /// low part is subnormal, which the tiles would read as zero), both signs, zeros; an
    /// infinity keeps its value in `hi`, a NaN stays a NaN there (also one whose set bits are
    /// all low), with zero `mid` and `lo`; rows past the call's tokens are zero; the words sit
    /// where the tiles read them.
    #[test]
    fn split_parts_sum_to_each_activation() {
        if !std::arch::is_x86_feature_detected!("avx512bw") {
            println!("SKIPPED: this CPU has no AVX-512 BW");
            return;
        }
        let (tokens, k, ldx) = (35, 64, 70);
        let mut s = 0x2545_f491_4f6c_dd1du64;
        let mut x: Vec<f32> = (0..tokens * ldx)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                let exp = 17 + (s >> 40) as u32 % 237; // 2⁻¹¹⁰ ..= 2¹²⁶
                f32::from_bits(((s >> 63) as u32) << 31 | exp << 23 | (s as u32 & 0x007f_ffff))
            })
            .collect();
        let special = [
            0.0,
            -0.0,
            f32::MAX,
            -f32::MAX,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::from_bits(0x7f80_0001),
            f32::from_bits(0xff80_0003),
        ];
        for (i, &v) in special.iter().enumerate() {
            x[i * ldx + i] = v;
        }
        // SAFETY: the CPU has AVX-512 BW (checked); `x` holds the rows.
        let words = unsafe { split_rows(&x, ldx, tokens, k) };
        let kp = k / 2;
        assert_eq!(words.len(), 2 * EXACT_PARTS * STEP_TOKENS * kp);
        let part = |t: usize, p: usize, e: usize| {
            let w = words[(t / 32) * EXACT_PARTS * STEP_TOKENS * kp
                + p * STEP_TOKENS * kp
                + (t % 32) * kp
                + e / 2];
            f32::from_bits(if e.is_multiple_of(2) {
                w << 16
            } else {
                w & 0xffff_0000
            })
        };
        for t in 0..2 * STEP_TOKENS {
            for e in 0..k {
                let [hi, mid, lo] = [0, 1, 2].map(|p| part(t, p, e));
                if t >= tokens {
                    assert!(
                        [hi, mid, lo].iter().all(|v| v.to_bits() == 0),
                        "row {t} not zero"
                    );
                    continue;
                }
                let v = x[t * ldx + e];
                if v.is_nan() {
                    assert!(hi.is_nan() && mid == 0.0 && lo == 0.0, "{t},{e}: NaN split");
                } else if v.is_infinite() {
                    assert!(hi == v && mid == 0.0 && lo == 0.0, "{t},{e}: {v} split");
                } else {
                    let sum = hi as f64 + mid as f64 + lo as f64;
                    assert_eq!(sum, v as f64, "{t},{e}: {v:e} = {hi:e} + {mid:e} + {lo:e}");
                    assert_eq!(hi.is_sign_negative(), v.is_sign_negative(), "{t},{e}: sign");
                }
            }
        }
    }

    /// `ldtilecfg` reads the palette at byte 0, the 16 tiles' bytes per row from byte 16 and
    /// their rows from byte 48, 64 bytes in all, 64-aligned.
    #[test]
    fn the_tile_configuration_has_ldtilecfgs_layout() {
        assert_eq!(std::mem::size_of::<TileConfig>(), 64);
        assert_eq!(std::mem::align_of::<TileConfig>(), 64);
        let base = &CONFIG as *const TileConfig as usize;
        assert_eq!(&CONFIG.colsb as *const _ as usize - base, 16);
        assert_eq!(&CONFIG.rows as *const _ as usize - base, 48);
        assert_eq!((CONFIG.palette, CONFIG.start_row), (1, 0));
        // Tiles 0..8 of 16 rows × 64 bytes: a tile row is 16 f32 sums or 16 bf16 pairs.
        assert!(
            CONFIG.colsb[..8].iter().all(|&c| c == 64) && CONFIG.rows[..8].iter().all(|&r| r == 16)
        );
    }
}

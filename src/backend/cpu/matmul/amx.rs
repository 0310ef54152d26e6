//! AMX tiles for [`super::Numerics::Bf16`]'s matrix products, on CPUs with AMX-BF16 (Intel
//! Sapphire Rapids and later), used wherever the CPU has AMX-TILE and AMX-BF16 and Linux grants
//! the tile state; `KILN_AMX=0` turns it off for a process (the `vdpbf16ps` panels then run).
//! First run on 2026-12-01 on an Intel Xeon with AMX (2 vCPUs): the matmul tests pass with it
//! (`cargo test --release --lib bf16`; `bf16_panels_without_amx` runs the same checks on the
//! panels in a child process), and SmolLM2-135M's shape (`kiln-bench --synthetic smollm2-135m
//! -p 512 -n 0 -t 2 -r 3 --numerics bf16`) prefilled 1,717–1,724 tok/s with it against 543–578
//! on the panels, alternating (the exact path: 580–699 in the same runs). `perf` puts most of
//! the kernel's time on its tile loads (A and B from L2, four loads per four `tdpbf16ps`), so
//! it runs far below the tiles' peak.
//!
//! `tdpbf16ps` multiplies a tile of 16 tokens × 32 bf16 activations by a tile of 16 bf16 pairs
//! × 16 outputs into 16 × 16 f32 sums: 8,192 multiply-adds per instruction, against 32 for
//! `vdpbf16ps`. The weights come in the bf16 panels' packing (`panel[j][i]` holds elements
//! `2j`, `2j + 1` of output `i`, 32 outputs, 128 bytes per pair), which is already the B tile's
//! layout: 16 pairs × 16 outputs with a stride of 128 bytes, outputs 16..32 at 64 bytes in. The
//! activations are rounded to bf16 pairs row by row (token `t`'s pairs contiguous, the A tile's
//! rows), padded with zero tokens to a multiple of 32. Each step loads two A tiles (32 tokens)
//! and two B tiles (32 outputs) and issues four `tdpbf16ps` into four accumulator tiles.
//!
//! Each output is one chain over the k pairs in steps of 16, so a token's result does not depend
//! on the other tokens of its call; how a step sums its 16 pairs is the CPU's, so results
//! differ in the last bits from the `vdpbf16ps` panels (and the mode uses AMX for every call it
//! takes where it is on). Linux must grant the process the tile state first
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

/// Every token of `job` against one packed panel of outputs `n..n + nr` (`panel`: `k / 2`
/// lines of 32 words), written to the output through [`put`].
///
/// # Safety
/// AMX is [`enabled`] and the CPU supports AVX512-BF16 (and F/BW/VL, AVX2, FMA); `xb` holds
/// [`round_rows`]'s rows for `job.tokens` tokens of `k = 2·kp` elements, `kp` a multiple of 16;
/// `panel` holds `kp` lines; `job` describes valid memory.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")]
pub(super) unsafe fn panel_tokens(
    panel: *const u32,
    xb: &[u32],
    kp: usize,
    job: &Job,
    n: usize,
    nr: usize,
) {
    assert!(kp.is_multiple_of(16));
    assert!(xb.len() >= job.tokens.div_ceil(STEP_TOKENS) * STEP_TOKENS * kp);
    asm!("ldtilecfg [{}]", in(reg) &CONFIG, options(nostack, readonly));
    let mut sums = [[0f32; 16 * 16]; 4];
    let a_stride = kp * 4;
    let b_stride = NR * 4;
    let mut t0 = 0;
    while t0 < job.tokens {
        asm!(
            "tilezero tmm0",
            "tilezero tmm1",
            "tilezero tmm2",
            "tilezero tmm3",
            options(nostack, nomem)
        );
        let a0 = xb.as_ptr().add(t0 * kp);
        let a1 = a0.add(16 * kp);
        for j in (0..kp).step_by(16) {
            asm!(
                "tileloadd tmm4, [{a0} + {sa}*1]",
                "tileloadd tmm5, [{a1} + {sa}*1]",
                "tileloadd tmm6, [{b} + {sb}*1]",
                "tileloadd tmm7, [{b} + {sb}*1 + 64]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                a0 = in(reg) a0.add(j),
                a1 = in(reg) a1.add(j),
                b = in(reg) panel.add(j * NR),
                sa = in(reg) a_stride,
                sb = in(reg) b_stride,
                options(nostack, readonly)
            );
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
        // Tile 2·h + o: tokens t0 + 16·h .., outputs n + 16·o ...
        for i in 0..(job.tokens - t0).min(STEP_TOKENS) {
            let (h, r) = (i / 16, i % 16);
            let lo = _mm512_loadu_ps(sums[2 * h].as_ptr().add(16 * r));
            let hi = _mm512_loadu_ps(sums[2 * h + 1].as_ptr().add(16 * r));
            put(job, t0 + i, n, nr, [lo, hi]);
        }
        t0 += STEP_TOKENS;
    }
    asm!("tilerelease", options(nostack, nomem));
}

#[cfg(test)]
mod tests {
    use super::*;

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

//! AMX-INT8 tiles for [`Numerics::Int8`](super::Numerics::Int8) calls of many tokens (prefill
//! chunks, large batched steps) on interleaved weights ([`super::int8`]), on CPUs with AMX-TILE
//! and AMX-INT8 (Intel Sapphire Rapids and later) where Linux grants the tile state and
//! `KILN_AMX` is not `0`. The results are the same bits as the AVX512-VNNI kernel
//! ([`super::avx512_i8`]) and the scalar reference ([`super::int8::rows_ref`]): only the
//! integer sums move to the tiles, and integer sums are exact whoever adds them.
//!
//! Per call and task, the blocks of each group of 16 output rows are laid out as AMX B tiles: 8
//! rows of 64 bytes per 32-element block, row `i` holding elements `4i..4i + 4` of each of the
//! 16 rows — the interleaved layout's quant vectors, as signed bytes with the stored offset
//! taken off (Q4's nibbles split into bytes and Q5's fifth bits added first). Then per 16
//! tokens (their A tiles stay in L1) and each group, four blocks at a time, `tdpbssd` gives
//! each block's 16 × 16 integer sums `Σ q_w·q_x` in four accumulator tiles, stored to memory
//! (the same integers as the VNNI kernel's offset-corrected sums); the vector units then take
//! each (token, block) as the VNNI kernel does — one conversion, `d_w·d_x`, one FMA (formats
//! with a min: a second, `m_w·d_x·Σq`) — in block order, so each (row, token) is the same chain.
//!
//! What the vector units still do per (token, block) — three or four instructions for 16 rows,
//! against the VNNI kernel's eight `vpdpbusd` besides — bounds the gain; the tiles' 8,192
//! products per instruction are not the limit.

use std::arch::asm;
use std::arch::x86_64::*;
use std::cell::RefCell;
use std::sync::OnceLock;

use super::amx::{permitted, turned_off, TileConfig};
use super::avx512_groups::store;
use super::int8::{
    group_block_bytes, group_masks_at, group_quants_at, has_min, stored_offset, Interleaved, BLOCK,
    GROUP, XI8,
};
use super::Job;
use crate::model::quant::QuantKind;

/// Tokens per tile (an A tile's 16 rows).
const TILE_TOKENS: usize = 16;

/// Blocks per pass: four accumulator tiles.
const PASS_BLOCKS: usize = 4;

/// Bytes of one block's B tile: 8 rows of 16 × 4 bytes.
const B_TILE: usize = 8 * 64;

/// Calls of at least this many tokens take the tiles (fewer run the VNNI kernel, whose passes
/// of up to eight tokens waste no tile rows).
const MIN_TOKENS: usize = 16;

/// Whether this process runs the tiles: the VNNI kernels' CPU (AVX-512 F/BW/VL and VNNI at the
/// kernels' level), AMX-TILE and AMX-INT8, the tile state granted, `KILN_AMX` not `0`.
pub(super) fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        super::avx512_i8::available() && !turned_off() && cpu_has_amx_int8() && permitted()
    })
}

/// Whether a call of `tokens` tokens on interleaved weights takes the tiles.
pub(super) fn takes(tokens: usize) -> bool {
    tokens >= MIN_TOKENS && enabled()
}

/// CPUID leaf 7: EDX bit 24 AMX-TILE, bit 25 AMX-INT8.
fn cpu_has_amx_int8() -> bool {
    let leaf = __cpuid_count(7, 0);
    leaf.edx & (1 << 24) != 0 && leaf.edx & (1 << 25) != 0
}

/// A call's rounded activations laid out for the tiles: the quants of every token as rows of
/// `k` bytes (zero rows up to a multiple of 16 tokens, the A tiles' reach), and per block the
/// tokens' scales and scaled sums side by side (block `b`, token `t` at `b·padded + t`).
pub(super) struct Tokens {
    k: usize,
    padded: usize,
    q: Vec<i8>,
    d: Vec<f32>,
    sums: Vec<f32>,
}

impl Tokens {
    /// From [`super::int8::quantize`]'s rows, `k` elements each (whole blocks).
    pub(super) fn new(x: &[XI8], k: usize) -> Tokens {
        assert!(
            k.is_multiple_of(BLOCK) && x.iter().all(|r| r.q.len() >= k),
            "activation rows shorter than {k} or not whole blocks"
        );
        let nb = k / BLOCK;
        let padded = x.len().div_ceil(TILE_TOKENS) * TILE_TOKENS;
        let mut t = Tokens {
            k,
            padded,
            q: vec![0; padded * k],
            d: vec![0.0; nb * padded],
            sums: vec![0.0; nb * padded],
        };
        for (i, r) in x.iter().enumerate() {
            t.q[i * k..(i + 1) * k].copy_from_slice(&r.q[..k]);
            for b in 0..nb {
                t.d[b * padded + i] = r.d[b];
                t.sums[b * padded + i] = r.sums[b];
            }
        }
        t
    }
}

/// Tiles 0–3 the four blocks' i32 sums (16 tokens × 16 rows), 4–5 activations (16 tokens × 32
/// bytes), 6–7 weights (8 rows × 64 bytes).
const CONFIG: TileConfig = TileConfig::palette1(
    [64, 64, 64, 64, 32, 32, 64, 64],
    [16, 16, 16, 16, 16, 16, 8, 8],
);

/// One block's B tile, 64-byte aligned.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct BTile([u8; B_TILE]);

/// Four blocks' stored sums.
#[repr(C, align(64))]
struct Sums([[i32; 256]; PASS_BLOCKS]);

thread_local! {
    /// Per-thread B tiles of the job in hand (one per block of each of its groups).
    static B_TILES: RefCell<Vec<BTile>> = const { RefCell::new(Vec::new()) };
}

const Q4_0: u8 = 0;
const Q4_1: u8 = 1;
const Q8_0: u8 = 2;
const Q5_0: u8 = 3;
const Q5_1: u8 = 4;

/// Every output of `job` over interleaved `w`, activations `x` (`job.tokens` of them).
///
/// # Safety
/// [`enabled`] holds and `w.cols > 0`; `job`'s output must be valid for writes at `t·ldo + n`
/// for every token and row of the job, its bias (if any) for reads up to `w.rows`.
pub(super) unsafe fn rows(w: &Interleaved, x: &Tokens, job: &Job) {
    assert!(
        x.k == w.cols && w.cols > 0 && x.padded >= job.tokens,
        "AMX activations for {} tokens of {}, a call of {} tokens of {}",
        x.padded,
        x.k,
        job.tokens,
        w.cols
    );
    let groups = job.rows.end.div_ceil(GROUP) - job.rows.start / GROUP;
    B_TILES.with_borrow_mut(|tiles| {
        tiles.resize(groups * (w.cols / BLOCK), BTile([0; B_TILE]));
        // SAFETY: as this function's; `tiles` holds one B tile per block of every group the
        // job reaches. In a function of its own because a closure is compiled without the
        // caller's target features.
        unsafe {
            match w.kind {
                QuantKind::Q4_0 => rows_of::<Q4_0>(w, x, job, tiles),
                QuantKind::Q4_1 => rows_of::<Q4_1>(w, x, job, tiles),
                QuantKind::Q8_0 => rows_of::<Q8_0>(w, x, job, tiles),
                QuantKind::Q5_0 => rows_of::<Q5_0>(w, x, job, tiles),
                QuantKind::Q5_1 => rows_of::<Q5_1>(w, x, job, tiles),
                k => unreachable!("{} is never interleaved", k.name()),
            }
        }
    })
}

const fn kind_of(f: u8) -> QuantKind {
    match f {
        Q4_0 => QuantKind::Q4_0,
        Q4_1 => QuantKind::Q4_1,
        Q5_0 => QuantKind::Q5_0,
        Q5_1 => QuantKind::Q5_1,
        _ => QuantKind::Q8_0,
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")]
unsafe fn rows_of<const F: u8>(w: &Interleaved, x: &Tokens, job: &Job, tiles: &mut [BTile]) {
    let kind = kind_of(F);
    let nb = w.cols / BLOCK;
    let bb = group_block_bytes(kind);
    asm!("ldtilecfg [{}]", in(reg) &CONFIG, options(nostack, readonly));
    let mut sums = Sums([[0; 256]; PASS_BLOCKS]);
    let (g0, g1) = (job.rows.start / GROUP, job.rows.end.div_ceil(GROUP));
    // Every group's B tiles first, then each 16 tokens against every group in turn: the tokens'
    // A tiles (16 × k bytes) stay in L1 while the B tiles stream from L2 in address order.
    for (g, tiles) in (g0..g1).zip(tiles.chunks_exact_mut(nb)) {
        let base = w.bytes.as_ptr().add(g * nb * bb);
        for (b, tile) in tiles.iter_mut().enumerate() {
            b_tile::<F>(base.add(b * bb), tile);
        }
    }
    let mut t0 = 0;
    while t0 < job.tokens {
        let n = (job.tokens - t0).min(TILE_TOKENS);
        for (g, tiles) in (g0..g1).zip(tiles.chunks_exact(nb)) {
            let n0 = g * GROUP;
            let lo = job.rows.start.max(n0) - n0;
            let hi = job.rows.end.min(n0 + GROUP) - n0;
            let lanes = ((1u32 << hi) - (1u32 << lo)) as __mmask16;
            let base = w.bytes.as_ptr().add(g * nb * bb);
            let acc = token_tile::<F>(base, bb, tiles, x, t0, &mut sums);
            store(job, t0, n0, lanes, &acc[..n]);
        }
        t0 += TILE_TOKENS;
    }
    asm!("tilerelease", options(nostack, nomem));
}

/// One block of a group (at `blk`) as its B tile of signed quants, the stored offset taken
/// off: Q8_0's vectors with their sign bit flipped back, Q4's split into low and high nibbles
/// (bytes `4j..` of vector `j` carry elements `4j..` and `16 + 4j..`), Q5's fifth bits added
/// as 16, then Q4_0's 8 and Q5_0's 16 subtracted.
#[inline(always)]
unsafe fn b_tile<const F: u8>(blk: *const u8, tile: &mut BTile) {
    let kind = kind_of(F);
    let q = blk.add(group_quants_at(kind)) as *const __m512i;
    let dst = tile.0.as_mut_ptr() as *mut __m512i;
    // The stored quants' offset, as a byte (128 wraps to the sign bit).
    let offset = _mm512_set1_epi8(stored_offset(kind) as u8 as i8);
    let mut wv = [_mm512_setzero_si512(); 8];
    if F == Q8_0 {
        for (i, v) in wv.iter_mut().enumerate() {
            *v = _mm512_loadu_si512(q.add(i));
        }
    } else {
        let nibble = _mm512_set1_epi8(0x0f);
        for j in 0..4 {
            let c = _mm512_loadu_si512(q.add(j));
            wv[j] = _mm512_and_si512(c, nibble);
            wv[j + 4] = _mm512_and_si512(_mm512_srli_epi16::<4>(c), nibble);
        }
        if F == Q5_0 || F == Q5_1 {
            let m = blk.add(group_masks_at(kind)) as *const u64;
            let sixteen = _mm512_set1_epi8(16);
            for (i, v) in wv.iter_mut().enumerate() {
                let k: __mmask64 = std::ptr::read_unaligned(m.add(i));
                *v = _mm512_mask_add_epi8(*v, k, *v, sixteen);
            }
        }
    }
    for (i, v) in wv.iter().enumerate() {
        _mm512_store_si512(dst.add(i), _mm512_sub_epi8(*v, offset));
    }
}

/// Tokens `t0..t0 + 16` (padding rows included) against the group at `base` (whose B tiles are
/// `tiles`): every block's integer sums from the tiles, four at a time, then the VNNI kernel's
/// chain per (token, block) in block order.
#[inline(always)]
unsafe fn token_tile<const F: u8>(
    base: *const u8,
    bb: usize,
    tiles: &[BTile],
    x: &Tokens,
    t0: usize,
    sums: &mut Sums,
) -> [__m512; TILE_TOKENS] {
    let kind = kind_of(F);
    let min = has_min(kind);
    let nb = tiles.len();
    let a = x.q.as_ptr().add(t0 * x.k);
    let mut acc = [_mm512_setzero_ps(); TILE_TOKENS];
    let mut b0 = 0;
    while b0 < nb {
        let n = (nb - b0).min(PASS_BLOCKS);
        tile_sums(a.add(b0 * BLOCK), x.k, tiles[b0..].as_ptr(), n, sums);
        for (i, s) in sums.0.iter().enumerate().take(n) {
            let b = b0 + i;
            let blk = base.add(b * bb);
            let dw = _mm512_cvtph_ps(_mm256_loadu_si256(blk as *const __m256i));
            let mw = if min {
                _mm512_cvtph_ps(_mm256_loadu_si256(blk.add(2 * GROUP) as *const __m256i))
            } else {
                _mm512_setzero_ps()
            };
            let at = b * x.padded + t0;
            // Indexed by a constant range, so the tokens unroll and `acc` stays in registers.
            #[allow(clippy::needless_range_loop)]
            for t in 0..TILE_TOKENS {
                let sum =
                    _mm512_cvtepi32_ps(_mm512_load_si512(s.as_ptr().add(16 * t) as *const __m512i));
                let sc = _mm512_mul_ps(dw, _mm512_set1_ps(*x.d.get_unchecked(at + t)));
                acc[t] = _mm512_fmadd_ps(sum, sc, acc[t]);
                if min {
                    acc[t] =
                        _mm512_fmadd_ps(mw, _mm512_set1_ps(*x.sums.get_unchecked(at + t)), acc[t]);
                }
            }
        }
        b0 += n;
    }
    acc
}

/// The integer sums of `n` (1 to 4) consecutive blocks for 16 tokens: activations from `a`
/// (rows `lda` bytes apart, block `i` at `a + 32·i`), weights from `b` (block `i`'s B tile at
/// `b + i`), into `sums.0[i]` (row `t` of token `t`: the group's 16 rows).
#[inline(always)]
unsafe fn tile_sums(a: *const i8, lda: usize, b: *const BTile, n: usize, sums: &mut Sums) {
    let s = sums.0.as_mut_ptr();
    if n == PASS_BLOCKS {
        asm!(
            "tilezero tmm0",
            "tilezero tmm1",
            "tilezero tmm2",
            "tilezero tmm3",
            "tileloadd tmm4, [{a} + {sa}*1]",
            "tileloadd tmm6, [{b} + {sb}*1]",
            "tdpbssd tmm0, tmm4, tmm6",
            "tileloadd tmm5, [{a} + {sa}*1 + 32]",
            "tileloadd tmm7, [{b} + {sb}*1 + 512]",
            "tdpbssd tmm1, tmm5, tmm7",
            "tileloadd tmm4, [{a} + {sa}*1 + 64]",
            "tileloadd tmm6, [{b} + {sb}*1 + 1024]",
            "tdpbssd tmm2, tmm4, tmm6",
            "tileloadd tmm5, [{a} + {sa}*1 + 96]",
            "tileloadd tmm7, [{b} + {sb}*1 + 1536]",
            "tdpbssd tmm3, tmm5, tmm7",
            "tilestored [{s} + {sb}*1], tmm0",
            "tilestored [{s} + {sb}*1 + 1024], tmm1",
            "tilestored [{s} + {sb}*1 + 2048], tmm2",
            "tilestored [{s} + {sb}*1 + 3072], tmm3",
            a = in(reg) a,
            sa = in(reg) lda,
            b = in(reg) b,
            sb = in(reg) 64usize,
            s = in(reg) s,
            options(nostack)
        );
        return;
    }
    for i in 0..n {
        asm!(
            "tilezero tmm0",
            "tileloadd tmm4, [{a} + {sa}*1]",
            "tileloadd tmm6, [{b} + {sb}*1]",
            "tdpbssd tmm0, tmm4, tmm6",
            "tilestored [{s} + {sb}*1], tmm0",
            a = in(reg) a.add(BLOCK * i),
            sa = in(reg) lda,
            b = in(reg) b.add(i),
            sb = in(reg) 64usize,
            s = in(reg) s.add(i),
            options(nostack)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tile shapes `tdpbssd` needs: A's bytes per row are four times B's rows, C's rows
    /// are A's, C's bytes per row are B's; 64 bytes in all, 64-aligned.
    #[test]
    fn the_tile_configuration_fits_tdpbssd() {
        assert_eq!(std::mem::size_of::<TileConfig>(), 64);
        let (c, r) = (CONFIG.colsb, CONFIG.rows);
        for acc in 0..4 {
            for (a, b) in [(4, 6), (5, 7)] {
                assert_eq!(c[a] as usize, 4 * r[b] as usize);
                assert_eq!((r[acc], c[acc]), (r[a], c[b]));
            }
        }
        assert_eq!(c[4] as usize, BLOCK);
        assert_eq!(r[6] as usize * c[6] as usize, B_TILE);
        assert_eq!(std::mem::size_of::<BTile>(), B_TILE);
        assert_eq!(std::mem::size_of::<Sums>(), PASS_BLOCKS * 1024);
    }
}

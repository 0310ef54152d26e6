//! The AVX2 kernel for Q5_0 weights grouped in [`Layout::Halves`]: up to [`MAX_TOKENS`] tokens,
//! each (row, token) the chain of [`super::grouped::rows_ref`] bit for bit; and the exact
//! dequantization of such rows into prefill tiles.
//!
//! **Per element**, for eight rows: one mask and one conversion, then one FMA per token with the
//! broadcast activation. A lane's word is read at byte offsets 0 and 2 (the high 16 bits then
//! hold the next row's bytes, masked off), so every field lies at bit 0, 5 or 10 of its lane,
//! and masked in place it is `2^p` times the unsigned quant: against activations divided by
//! `2^p` once per call ([`Activations`]), `2^p·q · x/2^p` is `q·x` exactly and the FMA rounds
//! the same sum. Where a division would round (an activation within `2^10` of the subnormals),
//! each field is shifted down instead, for the same bits. The three masks stay in registers. The
//! chains take consecutive elements in turn (`e mod 4`), so the fields go in the order they lie
//! and each word is loaded where it is used; one token's full groups go in one pass over both
//! halves (each broadcast serves sixteen rows, eight chains in flight), other calls one half
//! and up to two tokens at a time.
//!
//! **Measured.** One core of the 2-vCPU AMD EPYC (Zen 3, AVX2, no AVX-512), weights in cache,
//! `cargo bench --bench kernels -- 'gemv/Q5_0-grouped/4864x896/avx2$'` (Qwen2.5-Coder-0.5B's
//! gate; GiB/s of ggml's blocks): 9.2 in the streams layout, 14.0 in this one. Qwen2.5-Coder-0.5B
//! Q4_K_M decode at two threads (`kiln-bench -t 2 -p 0 -n 64 -r 2 --profile`): its gate+up
//! projections 8.4 → 5.5 ms a step, 53.3 → 65.0 tok/s (streaming reads of 35.6 and 31.4 GB/s).

use std::arch::x86_64::*;

use super::avx2_grouped::{half_f16, store, Activations, Pieces, LANES};
use super::grouped::{
    block_ahead, job_sums, prefetch_distance, prefetch_part, Grouped, Layout, BLOCK, GROUP,
    HALVES_BLOCK_BYTES, HALVES_QUANTS, HALVES_WORDS, MAX_TOKENS,
};
use super::Job;

/// Outputs `job.rows` for `job.tokens` (at most [`MAX_TOKENS`]) tokens from Q5_0 weights in
/// [`Layout::Halves`].
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; `job`'s output must be valid for writes at
/// `t·ldo + n` for every token and row of the job, its input for reads of `w.cols` values per
/// token, its bias (if any) for reads up to `w.rows`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn rows(w: &Grouped, job: &Job) {
    assert!(
        w.layout == Layout::Halves && job.tokens <= MAX_TOKENS,
        "{} tokens of {:?} weights for the halves kernel",
        job.tokens,
        w.layout
    );
    if job.tokens == 0 {
        return;
    }
    // A caller that did not make the call's activations (a test) has them made here.
    let own;
    let made = match job.xg {
        Some(a) => a,
        None => {
            let x = std::slice::from_raw_parts(job.x, (job.tokens - 1) * job.ldx + job.k);
            own = Activations::new(
                std::iter::once((w.kind, w.layout)),
                x,
                job.ldx,
                job.tokens,
                job.k,
            );
            &own
        }
    };
    match &made.halves {
        Some(x) => rows_with::<true>(w, job, x.as_ptr(), job.k),
        None => rows_with::<false>(w, job, job.xptr(0), job.ldx),
    }
}

/// [`rows`] on the activations at `x` (tokens `ldx` apart): with `H` those of [`Activations`]
/// (divided by each field's place value), else the job's own.
#[inline(always)]
unsafe fn rows_with<const H: bool>(w: &Grouped, job: &Job, x: *const f32, ldx: usize) {
    let sums = job_sums(w, job);
    let blocks = w.cols / BLOCK;
    let token = |t: usize| (x.add(t * ldx), sums.as_ptr().add(t * blocks));
    let gb = w.group_bytes();
    let distance = prefetch_distance(gb);
    let (g0, g1) = (job.rows.start / GROUP, job.rows.end.div_ceil(GROUP));
    for g in g0..g1 {
        let n0 = g * GROUP;
        let (lo, hi) = (
            job.rows.start.max(n0) - n0,
            job.rows.end.min(n0 + GROUP) - n0,
        );
        let base = w.bytes.as_ptr().add(g * gb);
        // The first pass over a group fetches the bytes `distance` ahead as it goes; only
        // addresses are formed past the weights' end, never dereferenced.
        let mut ahead = if g + 1 < g1 || distance < gb {
            base.wrapping_add(distance)
        } else {
            std::ptr::null()
        };
        if job.tokens == 1 && lo == 0 && hi == GROUP {
            let acc = pass::<2, 1, H>(base, blocks, ahead, [0, 1], [token(0)]);
            store(job, 0, n0, 0..LANES, &[acc[0]]);
            store(job, 0, n0 + LANES, 0..LANES, &[acc[1]]);
            continue;
        }
        // The second half's pass reads the lines that the first one brought in.
        for h in lo / LANES..hi.div_ceil(LANES) {
            let r0 = n0 + LANES * h;
            let lanes = lo.max(LANES * h) - LANES * h..hi.min(LANES * (h + 1)) - LANES * h;
            let mut t0 = 0;
            while t0 < job.tokens {
                if job.tokens - t0 >= 2 {
                    let acc = pass::<1, 2, H>(base, blocks, ahead, [h], [token(t0), token(t0 + 1)]);
                    store(job, t0, r0, lanes.clone(), &acc);
                    t0 += 2;
                } else {
                    let acc = pass::<1, 1, H>(base, blocks, ahead, [h], [token(t0)]);
                    store(job, t0, r0, lanes.clone(), &[acc[0]]);
                    t0 += 1;
                }
                ahead = std::ptr::null();
            }
        }
    }
}

/// The outputs of halves `halves` of the group at `base` (`nb` blocks) for `N` tokens (their
/// activations and block sums), `K·N ≤ 2` of them, half `halves[k]` and token `t` at
/// `k·N + t`; asking the bytes at `ahead` into the cache as it goes (null: none).
#[inline(always)]
unsafe fn pass<const K: usize, const N: usize, const H: bool>(
    base: *const u8,
    nb: usize,
    ahead: *const u8,
    halves: [usize; K],
    tokens: [(*const f32, *const f32); N],
) -> [__m256; 2] {
    const { assert!(K * N <= 2) };
    let masks = [
        _mm256_set1_epi32(0x1f),
        _mm256_set1_epi32(0x1f << 5),
        _mm256_set1_epi32(0x1f << 10),
    ];
    let mut acc = [_mm256_setzero_ps(); 2];
    for b in 0..nb {
        let blk = base.add(b * HALVES_BLOCK_BYTES);
        prefetch_part(
            block_ahead(ahead, b * HALVES_BLOCK_BYTES),
            HALVES_BLOCK_BYTES,
            0,
            1,
        );
        let q = blk.add(HALVES_QUANTS);
        let x: [*const f32; N] = std::array::from_fn(|t| tokens[t].0.add(b * BLOCK));
        let mut p = [[_mm256_setzero_ps(); 2]; 4];
        // Element `e`'s fields, the lanes `v[k]` of half `halves[k]` masked with mask `$i`
        // (place value `2^(5i)`), into chain `e mod 4` of each (half, token).
        macro_rules! put {
            ($e:expr, $v:expr, $i:literal) => {{
                let e: usize = $e;
                let xe: [__m256; N] = std::array::from_fn(|t| _mm256_set1_ps(*x[t].add(e)));
                for k in 0..K {
                    let f = quant::<H, { 5 * $i }>(_mm256_and_si256($v[k], masks[$i]));
                    for t in 0..N {
                        p[e % 4][k * N + t] = _mm256_fmadd_ps(f, xe[t], p[e % 4][k * N + t]);
                    }
                }
            }};
        }
        macro_rules! word {
            ($w:literal) => {{
                let at = |k: usize, byte: usize| {
                    _mm256_loadu_si256(q.add(64 * $w + 32 * halves[k] + byte) as *const __m256i)
                };
                let low: [__m256i; K] = std::array::from_fn(|k| at(k, 0));
                put!(6 * $w, low, 0);
                put!(6 * $w + 1, low, 1);
                put!(6 * $w + 2, low, 2);
                let high: [__m256i; K] = std::array::from_fn(|k| at(k, 2));
                put!(6 * $w + 3, high, 0);
                put!(6 * $w + 4, high, 1);
                put!(6 * $w + 5, high, 2);
            }};
        }
        word!(0);
        word!(1);
        word!(2);
        word!(3);
        word!(4);
        // Elements 30 and 31: half h's rows in the low or high 16 bits of the shared word.
        let last: [__m256i; K] = std::array::from_fn(|k| {
            _mm256_loadu_si256(q.add(HALVES_WORDS * 64 + 2 * halves[k]) as *const __m256i)
        });
        put!(30, last, 0);
        put!(31, last, 1);
        for (k, &h) in halves.iter().enumerate() {
            let d = half_f16(blk, h);
            let offset = _mm256_mul_ps(d, _mm256_set1_ps(-16.0));
            for (t, &(_, sums)) in tokens.iter().enumerate() {
                let j = k * N + t;
                let s = _mm256_add_ps(
                    _mm256_add_ps(p[0][j], p[1][j]),
                    _mm256_add_ps(p[2][j], p[3][j]),
                );
                acc[j] = _mm256_fmadd_ps(d, s, acc[j]);
                acc[j] = _mm256_fmadd_ps(offset, _mm256_set1_ps(*sums.add(b)), acc[j]);
            }
        }
    }
    acc
}

/// A masked field (`2^P` times its quant) as f32: as it is against divided activations (`H`),
/// else shifted down to the quant.
#[inline(always)]
unsafe fn quant<const H: bool, const P: i32>(v: __m256i) -> __m256 {
    if H || P == 0 {
        _mm256_cvtepi32_ps(v)
    } else {
        _mm256_cvtepi32_ps(_mm256_srli_epi32::<P>(v))
    }
}

/// [`Layout::Halves`] for [`super::avx2_grouped::dequantize`]: one run of 32 elements a block,
/// `(q − 16)·d` as ggml dequantizes Q5_0.
pub(crate) struct Halves;

impl Pieces for Halves {
    const PIECES: usize = 1;
    #[inline(always)]
    unsafe fn piece(blk: *const u8, _: usize, h: usize, v: &mut [__m256; BLOCK]) {
        let d = half_f16(blk, h);
        let q = blk.add(HALVES_QUANTS);
        let value = |lane: __m256i, i: i32| {
            let shifted = _mm256_srl_epi32(
                _mm256_and_si256(lane, _mm256_set1_epi32(0x1f << (5 * i))),
                _mm_cvtsi32_si128(5 * i),
            );
            let q = _mm256_sub_epi32(shifted, _mm256_set1_epi32(16));
            _mm256_mul_ps(_mm256_cvtepi32_ps(q), d)
        };
        for w in 0..HALVES_WORDS {
            let at =
                |byte: usize| _mm256_loadu_si256(q.add(64 * w + 32 * h + byte) as *const __m256i);
            let (low, high) = (at(0), at(2));
            for i in 0..3 {
                v[6 * w + i] = value(low, i as i32);
                v[6 * w + 3 + i] = value(high, i as i32);
            }
        }
        let last = _mm256_loadu_si256(q.add(HALVES_WORDS * 64 + 2 * h) as *const __m256i);
        v[30] = value(last, 0);
        v[31] = value(last, 1);
    }
}

//! The loop that the 16-row AVX-512 kernels ([`super::avx512_grouped`]'s exact ones,
//! [`super::avx512_i8`]'s 8-bit ones and [`super::avx512_grouped_i16`]'s 16-bit ones) share:
//! groups of 16 output rows, each in passes of up to
//! [`CHUNK`] tokens, the first pass asking the next group's bytes into the cache, each pass's
//! 16 lanes stored to the job's outputs.
//!
//! A kernel is a [`GroupPass`], called by static dispatch: a driver taking a closure left every
//! intrinsic of the kernels out of line, since a closure is compiled without its caller's
//! `#[target_feature]`s unless LLVM chooses to inline it (`tests/simd_inlined.rs` checks).

use std::arch::x86_64::*;

use super::grouped::prefetch_distance;
use super::int8::GROUP;
use super::Job;

/// Tokens that one pass over a group's blocks computes. Eight tokens' accumulators, with what a
/// pass keeps per token besides, fit the 32 vector registers.
pub(super) const CHUNK: usize = 8;

/// `$body` once for each token `$t` in `0..$n` (`$n` a pass's token count, at most [`CHUNK`]),
/// unrolled by hand. LLVM leaves a loop over a pass's tokens rolled when its body is large (the
/// grouped int16 kernel's, for eight tokens): each token's accumulator then lives on the stack,
/// and every block's FMA waits on a load and a store.
macro_rules! each_token {
    ($n:expr, |$t:ident| $body:block) => {
        each_token!(@ $n, $t, $body, 0 1 2 3 4 5 6 7)
    };
    (@ $n:expr, $t:ident, $body:block, $($i:literal)*) => {
        $(
            if $i < $n {
                let $t: usize = $i;
                $body
            }
        )*
    };
}
pub(super) use each_token;

// `each_token!` unrolls eight copies.
const _: () = assert!(CHUNK == 8);

/// One kernel's pass over a group's blocks.
pub(super) trait GroupPass {
    /// The 16 outputs (lane `r`: the group's row `r`) of tokens `t0..t0 + N` for the group whose
    /// bytes start at `base`, asking the bytes at `ahead` (as far from `base` as
    /// [`prefetch_distance`], or `base` itself on a later pass) into the cache as it goes.
    ///
    /// # Safety
    /// `base` must point at whole groups of the kernel's weights; `ahead` is only prefetched
    /// from (addresses past the weights' end are formed with wrapping arithmetic).
    unsafe fn pass<const N: usize>(
        &self,
        base: *const u8,
        ahead: *const u8,
        t0: usize,
    ) -> [__m512; N];
}

/// Every output of `job` through `kernel`, over weights whose group `g` starts at
/// `bytes + g · group_bytes`.
///
/// # Safety
/// As [`GroupPass::pass`] for every group the job's rows reach; `job`'s output must be valid for
/// writes at `t·ldo + n` for every token and row of the job, its bias (if any) for reads up to
/// the job's last row.
#[inline(always)]
pub(super) unsafe fn drive<K: GroupPass>(
    kernel: &K,
    bytes: *const u8,
    group_bytes: usize,
    job: &Job,
) {
    let (g0, g1) = (job.rows.start / GROUP, job.rows.end.div_ceil(GROUP));
    for g in g0..g1 {
        let n0 = g * GROUP;
        let lo = job.rows.start.max(n0) - n0;
        let hi = job.rows.end.min(n0 + GROUP) - n0;
        let lanes = ((1u32 << hi) - (1u32 << lo)) as __mmask16;
        let base = bytes.add(g * group_bytes);
        // The first pass over a group fetches the bytes [`prefetch_distance`] ahead as it
        // goes: a group is a few KiB read once, and without this its loads waited on DRAM.
        // The job's last group fetches past the job's rows too: they are the next task's (which
        // the same thread mostly runs next, rayon handing each thread a run of consecutive
        // tasks) or, past the matrix's end, other weights, and a task that began with its
        // first group unrequested waited on DRAM for it (SmolLM2 Q4_1 decode on the 2-vCPU
        // Intel Xeon, eight runs alternating: median 218.0 → 227.7 tok/s at four tasks a
        // thread). Only addresses are formed past the weights' end, never dereferenced (a
        // prefetch does not fault).
        let distance = prefetch_distance(group_bytes);
        let mut ahead = base.wrapping_add(distance);
        let mut t0 = 0;
        while t0 < job.tokens {
            let n = (job.tokens - t0).min(CHUNK);
            macro_rules! pass {
                ($n:literal) => {
                    store(job, t0, n0, lanes, &kernel.pass::<$n>(base, ahead, t0))
                };
            }
            match n {
                1 => pass!(1),
                2 => pass!(2),
                3 => pass!(3),
                4 => pass!(4),
                5 => pass!(5),
                6 => pass!(6),
                7 => pass!(7),
                _ => pass!(8),
            }
            // Later passes ask for the group's own bytes, which the first pass brought into
            // the cache: prefetches that cost a load slot each, where a null to test for
            // would put branches in the blocks' body (see `super::prefetch::lines_at_step`).
            ahead = base;
            t0 += n;
        }
    }
}

/// Writes token `t0 + t`'s outputs `n0 + lane` for the lanes set, as [`Job::put`] does:
/// `(out + d) + bias` when accumulating, else `d + bias`.
#[inline(always)]
pub(super) unsafe fn store(job: &Job, t0: usize, n0: usize, lanes: __mmask16, acc: &[__m512]) {
    let bias = job
        .bias
        .map(|b| _mm512_maskz_loadu_ps(lanes, b.as_ptr().add(n0)));
    for (t, &d) in acc.iter().enumerate() {
        let o = job.out.add((t0 + t) * job.ldo + n0);
        let mut v = d;
        if job.accumulate {
            v = _mm512_add_ps(_mm512_maskz_loadu_ps(lanes, o), v);
        }
        if let Some(b) = bias {
            v = _mm512_add_ps(v, b);
        }
        _mm512_mask_storeu_ps(o, lanes, v);
    }
}

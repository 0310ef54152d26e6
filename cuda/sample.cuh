// sample.cuh: one row's next token, chosen on the device by one block of SAMPLE_THREADS (256)
// threads with the algorithm of `kiln::sample::sample`; used by cuda/sample.cu (`sample_rows`)
// and by the decode megakernel's Sample tiles (cuda/megakernel/tiles.cuh `mk_sample`). Also the
// `MkControl` row table the host rewrites between runs, and the megakernel's ring constants.
//
// common.cuh must come before this file (the Rust side pastes both in that order).
// Ran on an H200 (sm_90; sm_80 is compiled only; docs/gpu-results.md): `sample_rows` picks the
// host sampler's tokens on the same logits (tests/gpu.rs), and seeded sampling reproduces across
// runs. Seeded sampling through the megakernel's Sample tiles parted from `sample_rows` on the
// demo model at step 9 of 48 (fixtures agree): not yet shown to be a draw at a rounding
// boundary. The algorithm is also checked on the CPU by its Rust model, src/sample/device.rs,
// which follows it step for step and is compared with `kiln::sample::sample` on thousands of
// random rows.
//
// The CPU semantics (src/sample/mod.rs): greedy (first maximum, NaN never wins) when
// temperature == 0; otherwise tokens are ordered by descending logit, ties by index (the f32
// total order: +0 before -0), top-k keeps the first k, each weighs w = exp((l - max) * (1 / T))
// (the best weighs exactly 1), min-p keeps w >= min_p, top-p keeps the shortest prefix whose
// running weight reaches top_p * total, and the draw walks the kept prefix to the first token
// whose running weight exceeds u * (kept weight), u = Philox-4x32-10 uniform(seed, row, position).
//
// How, without sorting a 50k-150k vocabulary:
//  * Every token gets a 64-bit composite `orderable_bits(l) << 32 | (2^32 - 1 - index)`: the
//    composites are distinct and their descending order is exactly the CPU's order.
//  * Weights are integers W = floor(w * 2^40) (exact for w >= 2^-16; a vocabulary below 2^24
//    keeps every sum under 2^64), so every sum is exact and the same in any grouping: the block
//    adds them with atomics and trees freely, the result is deterministic, and the comparisons
//    below are exact integer ones.
//  * Each cut is one question, "the first token in descending order whose running weight
//    reaches X": top-k asks it with unit weights and X = k, top-p with X = ceil(top_p * total),
//    the draw with X = floor(u * mass) + 1 (u * mass < C  <=>  floor(u * mass) < C for an
//    integer C). A radix descent over the composite answers it, 8 bits per level: the histogram
//    (count and weight per next byte) of the kept tokens under the current prefix shows the byte
//    where the running weight crosses X; once that bucket holds at most SAMPLE_CAP tokens they
//    are gathered into shared memory, sorted (bitonic) and scanned. Typically one or two passes
//    over the row and a gather per question; no fallback is needed, a bucket always shrinks to
//    one token by the last level. A row is read about 4 times (temperature only) to 8 times
//    (top-k, top-p and min-p together).
//
// Where the device can differ from the CPU, only at a rounding boundary:
//  * expf (CUDA, <= 2 ulp) vs the host's exp: a weight one ulp apart can flip a min-p test at
//    its threshold or move a running weight across X;
//  * sums: the CPU adds f32 in a fixed order (index order for the total, sorted order for the
//    running weights), the device adds exact integers, so a draw or a top-p cut within rounding
//    of a boundary lands on a neighbouring token (several, in a near-flat row of 100k tokens,
//    where the CPU's f32 running sum drifts); weights below 2^-40 count as 0 (never drawn);
//  * top_p >= 1 is "off" here, while the CPU's Some(1.0) can cut the last, tiny tokens by rounding;
//  * NaN logits weigh 0 here (never drawn) where the CPU's sums become NaN.
// Everything else is identical to the CPU: the order, ties, cut rules, the greedy fallback for a
// non-finite best logit or an infinite 1 / T, and the Philox draw.
#pragma once

#ifndef MK_MAX_BATCH
#define MK_MAX_BATCH 8
#endif
#define MK_MAX_STOP 16
#define MK_RING 64

// One batch row's sampling controls (the row table the host rewrites between runs, one entry
// per batch row, so rows with different parameters share a launch and a row can join or leave a
// captured graph without a new capture). Mirrored by kiln_codegen::MkRow.
struct MkRow {
    float temperature;          // 0 = greedy (argmax, first index on ties)
    int top_k;                  // 0 = off
    float top_p;                // >= 1 = off
    float min_p;                // 0 = off
    unsigned long long seed;
    int row_id;                 // engine row: the Philox key's row
    int pad;                    // 0 (keeps the 8-byte stride explicit)
};
// The megakernel's run-time controls: a row table of MK_MAX_BATCH MkRow entries and the stop ids.
// Whether a batch row is live is not here but in the kernel's position array (pos[b] < 0: an
// inactive row, padding or a sequence that left), which every tile that reads a position
// already has. Mirrored by kiln_codegen::MkControl; the static_asserts pin the layout both sides
// rely on.
struct MkControl {
    MkRow rows[MK_MAX_BATCH];
    int n_stop;
    int stop_ids[MK_MAX_STOP];
};
static_assert(sizeof(MkRow) == 32, "MkRow size");
static_assert(alignof(MkRow) == 8, "MkRow alignment");
// NVRTC 13.0 (the CUDA 13.0 toolkit's, found on GPU machines) has no __builtin_offsetof; there
// the field offsets go unchecked here, and graph_host's tests and a newer NVRTC (CI's) check them.
#if defined(__has_builtin)
#if __has_builtin(__builtin_offsetof)
#define KILN_OFFSET_IS(T, f, off) static_assert(__builtin_offsetof(T, f) == (off), #T "." #f)
#endif
#endif
#ifndef KILN_OFFSET_IS
#define KILN_OFFSET_IS(T, f, off) static_assert((off) >= 0, #T "." #f)
#endif
KILN_OFFSET_IS(MkRow, temperature, 0);
KILN_OFFSET_IS(MkRow, top_k, 4);
KILN_OFFSET_IS(MkRow, top_p, 8);
KILN_OFFSET_IS(MkRow, min_p, 12);
KILN_OFFSET_IS(MkRow, seed, 16);
KILN_OFFSET_IS(MkRow, row_id, 24);
KILN_OFFSET_IS(MkRow, pad, 28);
static_assert(sizeof(MkControl) == 328, "MkControl size");
static_assert(alignof(MkControl) == 8, "MkControl alignment");
KILN_OFFSET_IS(MkControl, rows, 0);
KILN_OFFSET_IS(MkControl, n_stop, 256);
KILN_OFFSET_IS(MkControl, stop_ids, 260);

#define SAMPLE_THREADS 256
// Logits each thread of the greedy pass loads before comparing them (kiln_sample_row).
#define SAMPLE_LOADS 8
// Largest bucket sorted in shared memory (a power of two).
#define SAMPLE_CAP 1024
// 2^40: the best token's integer weight.
#define SAMPLE_ONE 1099511627776.0f

struct SampleBest {
    float v;
    int i;
};

// Is a better than b: larger value, or equal value and smaller index; empty (i < 0) never wins.
__device__ __forceinline__ bool sample_better(SampleBest a, SampleBest b) {
    if (a.i < 0) return false;
    if (b.i < 0) return true;
    return a.v > b.v || (a.v == b.v && a.i < b.i);
}

__device__ __forceinline__ SampleBest sample_warp_best(SampleBest b) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        SampleBest c;
        c.v = __shfl_xor_sync(KILN_FULL_MASK, b.v, o);
        c.i = __shfl_xor_sync(KILN_FULL_MASK, b.i, o);
        if (sample_better(c, b)) b = c;
    }
    return b;
}

// The block's best (value, first index); every thread gets it.
__device__ __forceinline__ SampleBest sample_block_best(SampleBest b) {
    __shared__ float sv[32];
    __shared__ int si[32];
    __shared__ SampleBest result;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    b = sample_warp_best(b);
    if (lane == 0) {
        sv[warp] = b.v;
        si[warp] = b.i;
    }
    __syncthreads();
    if (warp == 0) {
        SampleBest c;
        c.v = lane < nwarps ? sv[lane] : 0.0f;
        c.i = lane < nwarps ? si[lane] : -1;
        c = sample_warp_best(c);
        if (lane == 0) result = c;
    }
    __syncthreads();
    SampleBest r = result;
    __syncthreads();
    return r;
}

// Greedy: the first index of the largest logit above -inf (NaN never wins); 0 if there is none
// (as `kiln::sample::argmax`). The whole block calls it.
__device__ __forceinline__ int kiln_argmax_row(const float* l, int vocab) {
    SampleBest b;
    b.v = 0.0f;
    b.i = -1;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float v = l[i];
        // Each thread sees increasing indices: strictly greater keeps the first.
        if (v > KILN_NEG_INF && (b.i < 0 || v > b.v)) {
            b.v = v;
            b.i = i;
        }
    }
    b = sample_block_best(b);
    return b.i < 0 ? 0 : b.i;
}

// ---- composites and weights ----------------------------------------------------------------

// f32 bits mapped so that unsigned order is the f32 total order (Rust's `total_cmp`).
__device__ __forceinline__ u32 sample_key(float v) {
    const u32 b = __float_as_uint(v);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ float sample_unkey(u32 k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// Descending composite = descending logit, then ascending index.
__device__ __forceinline__ u64 sample_ck(float v, int i) {
    return ((u64)sample_key(v) << 32) | (u64)(0xffffffffu - (u32)i);
}

// What is kept, and what it weighs, at one stage.
struct SampleCut {
    float mx, inv_t;
    float min_p;  // <= 0: off
    u64 floor;    // top-k: composites below it are out (0: no top-k)
    int unit;     // every token weighs 1 and nothing is cut (the top-k count)
};

// Is the token (v, ck) kept, and its integer weight. w is computed as the CPU does: subtract,
// then multiply by 1 / T (explicit roundings, never contracted), then expf.
__device__ __forceinline__ bool sample_kept(const SampleCut& c, float v, u64 ck, u64& W) {
    if (c.unit) {
        W = 1ull;
        return true;
    }
    if (ck < c.floor) return false;
    const float w = expf(__fmul_rn(__fsub_rn(v, c.mx), c.inv_t));
    if (c.min_p > 0.0f && !(w >= c.min_p)) return false;
    W = w > 0.0f ? __float2ull_rz(__fmul_rn(w, SAMPLE_ONE)) : 0ull;
    return true;
}

// ---- block state and reductions ------------------------------------------------------------

struct SampleHist {
    unsigned cnt[256];
    u64 mass[256];
};

struct SampleShared {
    SampleHist top;  // level 1 of the kept set: both weighted questions start from it
    union {
        SampleHist h;         // the current level's histogram
        u64 ck[SAMPLE_CAP];   // or the gathered bucket
    } w;
    u64 base;    // weight of the kept tokens above the current bucket
    u64 reach;   // running weight through the answer
    u64 result;  // the answer's composite
    unsigned bin, count, n;
    u64 part[SAMPLE_THREADS / 32];
    unsigned cpart[SAMPLE_THREADS / 32];
};

// Sum over the block (exact); every thread gets it.
__device__ __forceinline__ unsigned sample_sum_u32(SampleShared& s, unsigned v) {
    v = __reduce_add_sync(KILN_FULL_MASK, v);
    if ((threadIdx.x & 31) == 0) s.cpart[threadIdx.x >> 5] = v;
    __syncthreads();
    unsigned t = 0;
#pragma unroll
    for (int w = 0; w < SAMPLE_THREADS / 32; ++w) t += s.cpart[w];
    __syncthreads();
    return t;
}

// Exclusive prefix sum over threads in threadIdx order (exact); `*total` gets the whole sum.
__device__ __forceinline__ u64 sample_scan_u64(SampleShared& s, u64 v, u64* total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u64 inc = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const u64 t = __shfl_up_sync(KILN_FULL_MASK, inc, o);
        if (lane >= o) inc += t;
    }
    if (lane == 31) s.part[warp] = inc;
    __syncthreads();
    u64 before = 0, all = 0;
#pragma unroll
    for (int w = 0; w < SAMPLE_THREADS / 32; ++w) {
        if (w < warp) before += s.part[w];
        all += s.part[w];
    }
    __syncthreads();
    *total = all;
    return before + inc - v;
}

// Adds (1, W) to bin `bin` for the lanes that `take`; lanes with the same bin combine first, so
// a hot bin costs one shared atomic per warp instead of one per lane. The whole warp calls it.
__device__ __forceinline__ void sample_hist_add(SampleHist& h, bool take, unsigned bin, u64 W) {
    const unsigned active = __ballot_sync(KILN_FULL_MASK, take);
    if (!take) return;
    const unsigned peers = __match_any_sync(active, bin);
    // W <= 2^40: two 20-bit halves, whose sums over 32 lanes fit 32 bits.
    const unsigned lo = __reduce_add_sync(peers, (unsigned)(W & 0xfffffull));
    const unsigned hi = __reduce_add_sync(peers, (unsigned)(W >> 20));
    if ((int)(threadIdx.x & 31) == __ffs(peers) - 1) {
        atomicAdd(&h.cnt[bin], (unsigned)__popc(peers));
        atomicAdd(&h.mass[bin], ((u64)hi << 20) + (u64)lo);
    }
}

// The histogram over the next byte of the kept tokens whose composite starts with the `bits`
// (0..56) bits `prefix`.
__device__ __forceinline__ void sample_hist(const float* l, int vocab, const SampleCut& c,
                                            u64 prefix, int bits, SampleHist& h) {
    for (int b = threadIdx.x; b < 256; b += SAMPLE_THREADS) {
        h.cnt[b] = 0u;
        h.mass[b] = 0ull;
    }
    __syncthreads();
    for (int i0 = 0; i0 < vocab; i0 += SAMPLE_THREADS) {
        const int i = i0 + threadIdx.x;
        bool take = false;
        unsigned bin = 0;
        u64 W = 0;
        if (i < vocab) {
            const float v = l[i];
            const u64 ck = sample_ck(v, i);
            if (bits == 0 || (ck >> (64 - bits)) == prefix) {
                take = sample_kept(c, v, ck, W);
                bin = (unsigned)(ck >> (56 - bits)) & 255u;
            }
        }
        sample_hist_add(h, take, bin, W);
    }
    __syncthreads();
}

// From the histogram in s.w.h (bins in descending order), the bin where the running weight,
// starting at s.base, reaches X (s.base < X <= s.base + its total): sets s.bin, s.count and
// advances s.base past the bins above it. Warp 0 decides, lane j owning bins 255 - 8j down.
__device__ __forceinline__ void sample_pick_bin(SampleShared& s, u64 X) {
    if (threadIdx.x < 32) {
        const int lane = threadIdx.x;
        u64 part = 0;
#pragma unroll
        for (int k = 0; k < 8; ++k) part += s.w.h.mass[255 - 8 * lane - k];
        u64 inc = part;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const u64 t = __shfl_up_sync(KILN_FULL_MASK, inc, o);
            if (lane >= o) inc += t;
        }
        const u64 base = s.base;
        __syncwarp();
        if (base + inc - part < X && X <= base + inc) {
            u64 acc = base + inc - part;
            int b = 255 - 8 * lane;
            for (int k = 0; k < 7; ++k, --b) {
                const u64 m = s.w.h.mass[b];
                if (X <= acc + m) break;
                acc += m;
            }
            s.bin = (unsigned)b;
            s.count = s.w.h.cnt[b];
            s.base = acc;
        }
    }
    __syncthreads();
}

// Sorts a[0, p) into descending order; p is a power of two <= SAMPLE_CAP.
__device__ __forceinline__ void sample_sort_desc(u64* a, int p) {
    for (int k = 2; k <= p; k <<= 1) {
        for (int j = k >> 1; j > 0; j >>= 1) {
            for (int t = threadIdx.x; t < p / 2; t += SAMPLE_THREADS) {
                const int i = 2 * t - (t & (j - 1));
                const u64 x = a[i], y = a[i + j];
                if ((i & k) == 0 ? x < y : x > y) {
                    a[i] = y;
                    a[i + j] = x;
                }
            }
            __syncthreads();
        }
    }
}

// The question of the header: the composite of the first kept token, in descending order, whose
// running weight reaches X (1 <= X <= the kept weight), and that running weight in *reach.
// The level-1 histogram is s.top (from_top) or already in s.w.h.
__device__ __forceinline__ u64 sample_select(const float* l, int vocab, const SampleCut& c,
                                             u64 X, SampleShared& s, bool from_top, u64* reach) {
    if (from_top) {
        for (int b = threadIdx.x; b < 256; b += SAMPLE_THREADS) {
            s.w.h.cnt[b] = s.top.cnt[b];
            s.w.h.mass[b] = s.top.mass[b];
        }
    }
    if (threadIdx.x == 0) s.base = 0ull;
    __syncthreads();
    u64 prefix = 0;
    int bits = 0;
    for (;;) {
        sample_pick_bin(s, X);
        prefix = (prefix << 8) | s.bin;
        bits += 8;
        if (s.count <= SAMPLE_CAP || bits == 64) break;
        sample_hist(l, vocab, c, prefix, bits, s.w.h);
    }
    // Gather the bucket (the tokens the histogram counted: at most SAMPLE_CAP).
    if (threadIdx.x == 0) s.n = 0u;
    __syncthreads();
    for (int i = threadIdx.x; i < vocab; i += SAMPLE_THREADS) {
        const float v = l[i];
        const u64 ck = sample_ck(v, i);
        u64 W;
        if ((ck >> (64 - bits)) == prefix && sample_kept(c, v, ck, W)) {
            const unsigned at = atomicAdd(&s.n, 1u);
            if (at < SAMPLE_CAP) s.w.ck[at] = ck;
        }
    }
    __syncthreads();
    const int n = min((int)s.n, SAMPLE_CAP);
    int p = 1;
    while (p < n) p <<= 1;
    for (int j = n + threadIdx.x; j < p; j += SAMPLE_THREADS) s.w.ck[j] = 0ull;
    __syncthreads();
    sample_sort_desc(s.w.ck, p);
    // Running weights, SAMPLE_THREADS entries a round. They never decrease: the answer's
    // position is how many stay below X, and its owner is the thread whose first entry at or
    // above X it is.
    u64 done = s.base;
    unsigned below = 0;
    int mine = -1;
    u64 mine_reach = 0;
    for (int r0 = 0; r0 < n; r0 += SAMPLE_THREADS) {
        const int j = r0 + threadIdx.x;
        u64 W = 0;
        if (j < n) {
            const u64 ck = s.w.ck[j];
            sample_kept(c, sample_unkey((u32)(ck >> 32)), ck, W);
        }
        u64 all;
        const u64 C = done + sample_scan_u64(s, W, &all) + W;
        if (j < n) {
            if (C < X) {
                ++below;
            } else if (mine < 0) {
                mine = j;
                mine_reach = C;
            }
        }
        done += all;
    }
    const int at = (int)sample_sum_u32(s, below);
    if (mine == at) {
        s.result = s.w.ck[at];
        s.reach = mine_reach;
    }
    __syncthreads();
    *reach = s.reach;
    const u64 r = s.result;
    __syncthreads();
    return r;
}

// One row's token with the algorithm of `kiln::sample::sample` (see the header): logits
// l[0, vocab), controls from ctl (its row_id is not used here: the caller passes the row),
// Philox key (ctl->seed, row, position). All SAMPLE_THREADS threads of the block call it; every thread gets the token.
__device__ __forceinline__ int kiln_sample_row(const float* l, int vocab,
                                               const MkRow* __restrict__ ctl, u32 row,
                                               u64 position) {
    __shared__ SampleShared s;
    const float temperature = ctl->temperature;
    const int top_k = ctl->top_k;
    const bool sampling = temperature > 0.0f && vocab > 1;
    const bool topk = sampling && top_k > 0 && top_k < vocab;
    if (topk) {
        for (int b = threadIdx.x; b < 256; b += SAMPLE_THREADS) {
            s.w.h.cnt[b] = 0u;
            s.w.h.mass[b] = 0ull;
        }
        __syncthreads();
    }
    // One pass: the greedy token, and the top-k question's level-1 histogram (every token, unit
    // weight). Each thread loads SAMPLE_LOADS of its logits (one per block-wide stride) before
    // comparing any: loaded one stride at a time, each load waited on the last, and one block
    // reading a row was 52 µs of a 1.29 ms SmolLM2-135M megakernel step and 195 µs of a 3.5 ms
    // Llama-3.2-1B one on an H200 (docs/gpu-results.md, run 11). Every thread still sees its
    // tokens in the same order and the histogram gets the same calls: the same result.
    SampleBest best;
    best.v = 0.0f;
    best.i = -1;
    for (int i0 = 0; i0 < vocab; i0 += SAMPLE_LOADS * SAMPLE_THREADS) {
        float v[SAMPLE_LOADS];
#pragma unroll
        for (int u = 0; u < SAMPLE_LOADS; ++u) {
            const int i = i0 + u * SAMPLE_THREADS + (int)threadIdx.x;
            v[u] = i < vocab ? l[i] : KILN_NEG_INF;
        }
#pragma unroll
        for (int u = 0; u < SAMPLE_LOADS; ++u) {
            const int i = i0 + u * SAMPLE_THREADS + (int)threadIdx.x;
            unsigned bin = 0;
            if (i < vocab) {
                if (v[u] > KILN_NEG_INF && (best.i < 0 || v[u] > best.v)) {
                    best.v = v[u];
                    best.i = i;
                }
                bin = (unsigned)(sample_ck(v[u], i) >> 56);
            }
            // Block-uniform: i0 + u * SAMPLE_THREADS < vocab or not for every thread alike.
            if (topk && i0 + u * SAMPLE_THREADS < vocab) sample_hist_add(s.w.h, i < vocab, bin, 1ull);
        }
    }
    best = sample_block_best(best);
    const int greedy = best.i < 0 ? 0 : best.i;
    if (!sampling) return greedy;
    const float inv_t = 1.0f / temperature;
    // No finite best logit, or 1 / T overflowed: the CPU takes the greedy token too.
    if (best.i < 0 || isinf(best.v) || isinf(inv_t)) return greedy;
    SampleCut c;
    c.mx = best.v;
    c.inv_t = inv_t;
    c.min_p = ctl->min_p;
    c.floor = 0ull;
    c.unit = 1;
    u64 reach;
    if (topk) c.floor = sample_select(l, vocab, c, (u64)top_k, s, false, &reach);
    c.unit = 0;
    sample_hist(l, vocab, c, 0ull, 0, s.top);
    u64 total;
    sample_scan_u64(s, s.top.mass[threadIdx.x], &total);
    // The kept weight the draw scales: everything, or the top-p prefix.
    u64 mass = total;
    const float top_p = ctl->top_p;
    if (top_p > 0.0f && top_p < 1.0f) {
        const double x = ceil((double)top_p * (double)total);
        u64 X = x < 1.0 ? 1ull : (u64)x;
        if (X > total) X = total;
        sample_select(l, vocab, c, X, s, true, &mass);
    }
    const unsigned long long seed = ctl->seed;
    u32 ctr[4] = {(u32)position, (u32)(position >> 32), row, 0u};
    philox4x32_10(ctr, (u32)seed, (u32)(seed >> 32));
    // u = ku / 2^24 exactly (as kiln::sample::uniform); X = floor(u * mass) + 1 in 128 bits.
    const u64 ku = (u64)(ctr[0] >> 8);
    const u64 lo = ku * mass, hi = __umul64hi(ku, mass);
    const u64 X = ((hi << 40) | (lo >> 24)) + 1ull;
    const u64 pick = sample_select(l, vocab, c, X, s, true, &reach);
    return (int)(0xffffffffu - (u32)pick);
}

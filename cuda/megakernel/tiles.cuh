// megakernel/tiles.cuh: the __device__ tile functions of the generated decode megakernel
// (kiln-codegen's emitter calls them; common.cuh, attention.cuh and sample.cuh are pasted before
// this file).
//
// The KV cache is kv.cuh's paged pool: bf16 K/V `[block][layer][kv_head][block_size][head_dim]`,
// f32 state `[block][block_size][state_dim]`; batch row b's page table is
// page_tables[b * max_blocks ...] (the host fills it when it starts the rows).
// The row table: the position array `pos`, the page tables and the controls' `MkRow`s are device
// memory the host rewrites between launches (a captured graph reads them at replay), so a row
// joins or leaves a running batch without a new capture. pos[b] < 0 marks batch row b inactive
// (padding, or a sequence that left): its embedding and attention output are zeros, it writes
// nothing to the KV cache or the state, it samples nothing, its position does not advance and
// its ring token is MK_NO_TOKEN. Its page table is never read.
// A tile runs on one whole block of MK_THREADS threads. Activations are f32 `[batch, cols]`
// buffers written earlier in the same launch, so they are read with plain loads (never __ldg,
// whose non-coherent cache may be stale); weights are read-only for the launch: bf16 matrices,
// f32 vectors (norm weights, biases, gates).
// kiln-codegen's interp.rs mirrors every tile function here (its CPU verification): a change
// here needs the same change there.
// Dependency counters: a waiting block polls with ld.acquire.gpu, a finished tile publishes
// with one fence.acq_rel.gpu and relaxed reds (mk_signal).
// Ran on an H200 (2026-11-26, docs/gpu-results.md): 256 greedy steps equal to the per-op path
// up to near ties on every fixture that lowers and the demo model; compute-sanitizer clean. The
// staged matvec (two cp.async buffers) ran there too: fixtures equal for 256 steps, padding
// rows and late starts pass, racecheck (shared memory) and memcheck clean.
#pragma once

#define MK_THREADS 256
#define MK_WARPS (MK_THREADS / 32)
#define MK_MAX_BATCH 8
// The ring token of an inactive row (no token id: vocabularies stay below 2^31).
#define MK_NO_TOKEN 0xffffffffu
// A tile is one block; the Sample tile's kiln_sample_row (sample.cuh) needs exactly its size.
static_assert(MK_THREADS == SAMPLE_THREADS, "the sampler's block size");

__device__ __forceinline__ unsigned mk_ld_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void mk_red_release(unsigned* p, unsigned v) {
    asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Waits for `n` (counter, per_step) pairs: counters[c] reaches epoch * per_step (wrap-safe).
// `seen` (shared, thread 0's alone) is the first pair's counter and target the last time thread
// 0 saw it reached in this launch: a block that runs several tiles of one phase in a row (the
// LM head's 23 tiles a block on SmolLM2-135M) waits on the same instruction counter for each,
// and once reached a counter stays reached for the launch (counters only grow), while that
// earlier acquire and the barrier after it already order the block's later reads after the
// producers' writes. So the repeat costs no global round trip. The kernel starts `seen` at
// counter -1. Every megakernel GPU test and compute-sanitizer pass with it (run 12, H100).
__device__ __forceinline__ void mk_wait(const unsigned* counters, const int* waits, int n,
                                        unsigned epoch, unsigned* seen) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const unsigned* c = counters + waits[2 * i];
        const unsigned target = epoch * (unsigned)waits[2 * i + 1];
        if (i == 0 && seen[0] == (unsigned)waits[0] && seen[1] == target) continue;
        while ((int)(mk_ld_acquire(c) - target) < 0) __nanosleep(64);
        if (i == 0) {
            seen[0] = (unsigned)waits[0];
            seen[1] = target;
        }
    }
    __syncthreads();
}

// Whether a matvec tile's weight rows are copied into shared memory ahead of it (mk_stage_rows).
// The host compiles with MK_STAGE 0 for a measurement without it (KILN_MK_STAGE=0): then every
// weight is read from global memory after the tile's wait.
#ifndef MK_STAGE
#define MK_STAGE 1
#endif
// Bytes of one staging buffer. There are two (the kernel's dynamic shared memory is twice this,
// which the host launches with; the emitter defines it from the schedule, which sizes matvec
// tiles to fit one).
#ifndef MK_STAGE_BYTES
#define MK_STAGE_BYTES 32768
#endif
#define MK_STAGE_U4 (MK_STAGE_BYTES / 16)
// Whether a matvec tile of fewer rows than warps splits each row's columns across several warps
// (MK_WARPS / rows of them, partial sums added in shared memory) instead of leaving the other
// warps idle. The host compiles with MK_SPLIT 1 where the schedule has such a tile (or as
// KILN_MK_SPLIT says). Why: on the H200 a Llama-3.2-1B step spent 24% of its stall samples at
// the barrier ending a tile, where the warps of a 2- or 4-row tile with no row wait for the
// others (docs/gpu-results.md, run 8). On an H100 (run 12) every megakernel GPU test passes
// with it (at 4-row tiles, so that the fixtures' tiles split) and the Llama-3.2-1B shape
// decodes 12% faster at batch 1; SmolLM2-135M, which has no such tile, decoded 9% slower with
// it compiled in (run 9), hence only where it splits something.
#ifndef MK_SPLIT
#define MK_SPLIT 0
#endif
// Whether the kernel loads each tile's header, argument row and (for a matvec) weight pointers
// into shared memory before its dependency wait instead of after (the generated loop's
// MK_PRELOAD blocks). On unless the host compiles with MK_PRELOAD 0 (KILN_MK_PRELOAD=0, and where
// rows split: MK_SPLIT with it spills at batch 1 under NVRTC 13.5). Why:
// each wait acquires (leaving L1 cold), and without the preload it was followed by four
// dependent table loads from L2 before the tile could start. On an H100 (run 12) every
// megakernel GPU test passes with it and SmolLM2-135M decodes 13% faster at batch 1.
#ifndef MK_PRELOAD
#define MK_PRELOAD 1
#endif

// Whether a matvec tile copies its input rows x (B × k f32, when they fit MK_XSTAGE_FLOATS)
// into shared memory once, block-wide, before its warps read them: every warp of a tile reads
// the whole of x (or its slice of it) for its row, so today a tile of R rows reads x R times
// from L2, each warp in dependent rounds. Same values, so the same bits. Off unless the host
// compiles with MK_XSTAGE 1 (KILN_MK_XSTAGE=1). On an H200 (run 10) the megakernel tests pass
// under it, SmolLM2-135M decodes 5-6% slower, the Llama-3.2-1B shape 2% slower at batch 1 and 6%
// faster at batch 8. Why: on an H100 41% of a
// Llama-3.2-1B step's stall cycles were long-scoreboard waits on global loads (run 9). 4,608
// floats (18 KB, static) keep two blocks per SM beside the staging buffers and cover SmolLM2's
// 576-column inputs at every batch and 2,048 columns at batch 1 and 2.
#ifndef MK_XSTAGE
#define MK_XSTAGE 0
#endif
#define MK_XSTAGE_FLOATS 4608

#if MK_XSTAGE
__shared__ __align__(16) float mk_x_sh[MK_XSTAGE_FLOATS];

// Copies rows 0..batch-1 of x (k floats each, row stride xs, 16-byte aligned, k % 4 == 0,
// batch · k <= MK_XSTAGE_FLOATS) into mk_x_sh as [batch][k], 16 bytes a thread at a time, all
// in flight at once; returns mk_x_sh. The caller's barrier publishes it. Out of line, so that
// mk_matvec keeps its registers.
__device__ __noinline__ const float* mk_stage_x(const float* x, int xs, int k, int batch) {
    const int k4 = k >> 2;
    for (int i = threadIdx.x; i < batch * k4; i += blockDim.x) {
        const int b = i / k4, c4 = i - b * k4;
        reinterpret_cast<float4*>(mk_x_sh)[i] =
            reinterpret_cast<const float4*>(x + (size_t)b * xs)[c4];
    }
    return mk_x_sh;
}
#endif

// Whether every tile records, in the module's `mk_timeline` (4 words a tile), the global timer
// when its block reached it, when its dependency wait ended and when its work ended, and the SM
// and block that ran it. Off unless the host compiles with MK_TIMELINE 1 (KILN_MK_TIMELINE=DIR,
// which also writes the last step's records to DIR after each graph stop). Why: on an H100 and
// an H200 a SmolLM2-135M step took ~1.15 ms over ~150 dependent phases and ncu could only say
// that warps wait (at barriers, on loads); which tiles wait on which, and for how long, is what
// decides what to change in the schedule. A diagnostic: thread 0 of each block adds three timer
// reads and four stores per tile. Ran on an H200 (run 11): SmolLM2-135M and Llama-3.2-1B-shape
// steps of 20,457 and 76,580 tiles recorded, 1,288 µs against 1,214 µs untimed for SmolLM2.
#ifndef MK_TIMELINE
#define MK_TIMELINE 0
#endif
#if MK_TIMELINE
__device__ __forceinline__ unsigned long long mk_now() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
__device__ __forceinline__ unsigned mk_smid() {
    unsigned s;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
    return s;
}
#endif

// The two staging buffers, MK_STAGE_U4 16-byte words each (dynamic shared memory).
extern __shared__ __align__(16) uint4 mk_stage[];

// Whether rows [r0, r1) of W [*, k] (and of `up`, if any) are staged: 16-byte aligned whole
// rows that fit one buffer. mk_stage_rows and mk_matvec decide alike.
__device__ __forceinline__ bool mk_stageable(const __nv_bfloat16* w, const __nv_bfloat16* up,
                                             int r0, int r1, int k) {
    const size_t bytes = (size_t)(r1 - r0) * (size_t)k * 2 * (up ? 2 : 1);
    return MK_STAGE && (k & 7) == 0 &&
           ((reinterpret_cast<size_t>(w) | reinterpret_cast<size_t>(up)) & 15) == 0 &&
           bytes <= (size_t)MK_STAGE_BYTES;
}

// Copies rows [r0, r1) of W [*, k] (then those of `up`, if any) into staging buffer `buf` with
// cp.async, every thread issuing 16-byte copies. The caller commits the group.
// Why: a matvec tile's weights depend on nothing computed in the step, so the kernel issues the
// copy for a block's next tile as the current one starts (double buffering): the next tile's
// whole weight read is in flight while this one waits and computes, and after its own wait a
// tile reads only activations from global memory. The first H200 runs measured the step as a
// chain of dependent phases whose tiles each paid several dependent DRAM round trips after
// their inputs landed, with at most one 16-byte load in flight per lane (docs/gpu-results.md).
// Measured on an H200 against KILN_MK_STAGE=0 (same tiles): +7% at batch 1 on SmolLM2-135M
// (875 vs 816 tokens/s), -8% at batch 8, -8% on the Llama-3.2-1B shape at batch 1, whose tiles
// of 2 and 4 rows leave most warps idle (docs/gpu-results.md): a mixed result, kept switchable.
__device__ __forceinline__ void mk_stage_rows(const __nv_bfloat16* w, const __nv_bfloat16* up,
                                              int r0, int r1, int k, int buf) {
    if (!mk_stageable(w, up, r0, r1, k)) return;
    uint4* dst = mk_stage + (size_t)buf * MK_STAGE_U4;
    const size_t n16 = (size_t)(r1 - r0) * (size_t)(k >> 3);
    const uint4* a = reinterpret_cast<const uint4*>(w + (size_t)r0 * k);
    const uint4* b = up ? reinterpret_cast<const uint4*>(up + (size_t)r0 * k) : nullptr;
    for (size_t i = threadIdx.x; i < n16; i += blockDim.x) {
        const unsigned s = (unsigned)__cvta_generic_to_shared(dst + i);
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(a + i) : "memory");
        if (b) {
            const unsigned su = (unsigned)__cvta_generic_to_shared(dst + n16 + i);
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(su), "l"(b + i)
                         : "memory");
        }
    }
}

// Ends the copy group of one tile (possibly empty: every tile commits exactly one, so that
// "all but the newest group" is always the current tile's).
__device__ __forceinline__ void mk_stage_commit() {
    asm volatile("cp.async.commit_group;" ::: "memory");
}

__device__ __forceinline__ void mk_red_relaxed(unsigned* p, unsigned v) {
    asm volatile("red.relaxed.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Whether mk_signal publishes with the sequentially consistent __threadfence (fence.sc.gpu) and
// two release reds, as every run up to run 11 did, instead of one fence.acq_rel.gpu and two
// relaxed reds. Off unless the host compiles with MK_SC_FENCE 1 (KILN_MK_SC_FENCE=1), to measure
// the two against each other. Why the change: the block barrier orders every thread's writes of
// the tile before thread 0's fence (PTX causality order is cumulative through bar.sync), and a
// release fence followed by a relaxed write is a release pattern, so one acq_rel fence publishes
// the tile to a consumer's ld.acquire; the sc fence and the second and third release orderings
// add latency to every hand-off, which run 11 measured at 1.25 µs (median) on the critical path.
// CUTLASS's inter-block barrier publishes the same way (fence.acq_rel + red.relaxed). On an
// H100 (run 12) every megakernel GPU test and compute-sanitizer's racecheck and synccheck pass
// with it; SmolLM2-135M decoded 1,009 tokens/s at batch 1 against 909 with MK_SC_FENCE 1, the
// step's median hand-off was 1.06 µs in its timeline (1.25 in run 11's, on an H200).
#ifndef MK_SC_FENCE
#define MK_SC_FENCE 0
#endif

// Publishes a finished tile on its instruction counter and its own tile counter.
__device__ __forceinline__ void mk_signal(unsigned* counters, int instr_ctr, int tile_ctr) {
    __syncthreads();
    if (threadIdx.x == 0) {
#if MK_SC_FENCE
        __threadfence();
        mk_red_release(counters + instr_ctr, 1u);
        mk_red_release(counters + tile_ctr, 1u);
#else
        asm volatile("fence.acq_rel.gpu;" ::: "memory");
        mk_red_relaxed(counters + instr_ctr, 1u);
        mk_red_relaxed(counters + tile_ctr, 1u);
#endif
    }
}

// 1 / rms(x[b]) for each batch row into inv[b] (shared), or 1 when !use_norm.
__device__ __forceinline__ void mk_inv_rms(const float* x, int xs, int k, int batch,
                                           int use_norm, float eps, float* inv) {
    for (int b = 0; b < batch; ++b) {
        if (!use_norm) {
            if (threadIdx.x == 0) inv[b] = 1.0f;
            continue;
        }
        float s = 0.0f;
        for (int c = threadIdx.x; c < k; c += blockDim.x) {
            const float v = x[(size_t)b * xs + c];
            s = fmaf(v, v, s);
        }
        s = block_sum(s);
        if (threadIdx.x == 0) inv[b] = rsqrtf(s / (float)k + eps);
    }
    __syncthreads();
}

#define MK_EPI_NONE 0
#define MK_EPI_ACT 1
#define MK_EPI_RESIDUAL 2
#define MK_EPI_SOFTCAP 3

// The 8 bf16 of a 16-byte load as f32 (exact: bf16 is the top half of an f32).
__device__ __forceinline__ void mk_unpack8(uint4 v, float* f) {
    f[0] = __uint_as_float(v.x << 16);
    f[1] = __uint_as_float(v.x & 0xffff0000u);
    f[2] = __uint_as_float(v.y << 16);
    f[3] = __uint_as_float(v.y & 0xffff0000u);
    f[4] = __uint_as_float(v.z << 16);
    f[5] = __uint_as_float(v.z & 0xffff0000u);
    f[6] = __uint_as_float(v.w << 16);
    f[7] = __uint_as_float(v.w & 0xffff0000u);
}

// Output r of batch row b from its normed dot product g (bias added) and, for a gated matvec,
// the up matrix's uu: act(g)·uu when gated, else the epilogue's act(g), residual + g,
// cap·tanh(g / cap) or g.
__device__ __forceinline__ void mk_matvec_store(float g, float uu, bool gated, int epi, int act,
                                                float cap, const float* res, int rs, float* out,
                                                int os, int b, int r) {
    float v = g;
    if (gated) {
        v = kiln_act(act, g) * uu;
    } else if (epi == MK_EPI_ACT) {
        v = kiln_act(act, g);
    } else if (epi == MK_EPI_RESIDUAL) {
        v = res[(size_t)b * rs + r] + g;
    } else if (epi == MK_EPI_SOFTCAP) {
        v = cap * tanhf(g / cap);
    }
    out[(size_t)b * os + r] = v;
}

// Rows [r0, r1) of W [*, k] (and, if `up`, of the up matrix: gated) times norm?(x), plus the
// f32 bias of W (null for none; a gated matvec has none). out[b * os + r] = epilogue(...). One
// warp per row. The norm weight `nw` (f32, may be null) scales W's columns.
// With k % 8 == 0 and 16-byte aligned rows (every matrix is its own allocation), each lane
// takes 8 columns per 16-byte load, 256 columns per warp step; the rows come from staging
// buffer `buf` when mk_stage_rows copied them there (the kernel did, a tile ahead), else from
// global memory.
// Each warp sums x² over the whole row as it goes (it reads every column of x for its row), so
// the norm costs no pass and no block barrier of its own. Other shapes take the scalar loop.
// B is the kernel's batch (MK_BATCH, a template argument so that the accumulators are the
// batch's, not MK_MAX_BATCH's: fewer registers, no spills at batch 1 under NVRTC 13.0).
template <int B>
__device__ __noinline__ void mk_matvec(const __nv_bfloat16* __restrict__ w,
                                       const __nv_bfloat16* __restrict__ up, int r0, int r1,
                                       int k, const float* x, int xs, int batch,
                                       const float* __restrict__ nw, int use_norm,
                                       float eps, float* out, int os, const float* res, int rs,
                                       int epi, int act, float cap,
                                       const float* __restrict__ bias, int buf) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    // The 16-byte loop reads W (and up) and x (and nw) 16 bytes at a time: every pointer
    // 16-byte aligned (matrices are their own allocations, activation buffers 16-byte aligned
    // in the arena) and x's row stride a multiple of 4 floats.
    const bool wide = (k & 7) == 0 && (xs & 3) == 0 &&
                      ((reinterpret_cast<size_t>(w) | reinterpret_cast<size_t>(up) |
                        reinterpret_cast<size_t>(x) | reinterpret_cast<size_t>(nw)) & 15) == 0;
    // mk_stage_rows staged exactly when mk_stageable holds (it does not look at x or nw), into
    // buffer `buf`; the newest copy group is the block's next tile's, so waiting for all but
    // one is waiting for this tile's.
    const bool staged = mk_stageable(w, up, r0, r1, k);
#if MK_XSTAGE
    // Block-uniform: x's rows go to mk_x_sh, published by the barrier below.
    const bool x_staged = wide && B * k <= MK_XSTAGE_FLOATS;
    if (x_staged) {
        x = mk_stage_x(x, xs, k, B);
        xs = k;
    }
    if (staged || x_staged) {
        if (staged) asm volatile("cp.async.wait_group 1;" ::: "memory");
        __syncthreads();
    }
#else
    if (staged) {
        asm volatile("cp.async.wait_group 1;" ::: "memory");
        __syncthreads();
    }
#endif
    const uint4* stage = mk_stage + (size_t)buf * MK_STAGE_U4;
    const int k8 = k >> 3;
    const size_t n16 = (size_t)(r1 - r0) * (size_t)k8;
    float inv[B];
#pragma unroll
    for (int b = 0; b < B; ++b) inv[b] = 1.0f;
    bool first = true;
    // `gw` warps per row (1 unless MK_SPLIT and the tile has fewer rows than warps); warp w
    // takes row r0 + w / gw and the column slice w % gw. With gw > 1 a warp has one row at most.
    const int gw = (MK_SPLIT && r1 - r0 < MK_WARPS) ? MK_WARPS / (r1 - r0) : 1;
    const int slice = warp % gw;
    __shared__ float part[MK_WARPS][3][MK_MAX_BATCH];
    for (int r = r0 + warp / gw; r < r1; r += MK_WARPS / gw) {
        const __nv_bfloat16* wr = w + (size_t)r * k;
        const __nv_bfloat16* ur = up ? up + (size_t)r * k : nullptr;
        float a[B], u[B], sq[B];
#pragma unroll
        for (int b = 0; b < B; ++b) a[b] = u[b] = sq[b] = 0.0f;
        const bool norm_here = use_norm && first;
        if (wide) {
            const uint4* w8 = staged ? stage + (size_t)(r - r0) * k8 : reinterpret_cast<const uint4*>(wr);
            const uint4* u8 = !ur ? nullptr
                              : staged ? stage + n16 + (size_t)(r - r0) * k8
                                       : reinterpret_cast<const uint4*>(ur);
            // With the weights in shared memory the loop waits on x's loads (L2): at small
            // batches unroll it so that several are in flight; at larger ones each step already
            // issues 2·B of them, and unrolling would spill.
            constexpr int U = B == 1 ? 4 : (B == 2 ? 2 : 1);
#pragma unroll U
            for (int c8 = lane + 32 * slice; c8 < k8; c8 += 32 * gw) {
                float wv[8], uv[8];
                mk_unpack8(staged ? w8[c8] : __ldg(w8 + c8), wv);
                if (u8) {
                    mk_unpack8(staged ? u8[c8] : __ldg(u8 + c8), uv);
                } else {
#pragma unroll
                    for (int j = 0; j < 8; ++j) uv[j] = 0.0f;
                }
                if (nw) {
                    const float4 s0 = __ldg(reinterpret_cast<const float4*>(nw) + 2 * c8);
                    const float4 s1 = __ldg(reinterpret_cast<const float4*>(nw) + 2 * c8 + 1);
                    const float sc[8] = {s0.x, s0.y, s0.z, s0.w, s1.x, s1.y, s1.z, s1.w};
#pragma unroll
                    for (int j = 0; j < 8; ++j) {
                        wv[j] *= sc[j];
                        uv[j] *= sc[j];
                    }
                }
#pragma unroll
                for (int b = 0; b < B; ++b) {
                    const float4* xb = reinterpret_cast<const float4*>(x + (size_t)b * xs) + 2 * c8;
                    const float4 x0 = xb[0], x1 = xb[1];
                    const float xv[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#pragma unroll
                    for (int j = 0; j < 8; ++j) {
                        a[b] = fmaf(wv[j], xv[j], a[b]);
                        u[b] = fmaf(uv[j], xv[j], u[b]);
                        if (norm_here) sq[b] = fmaf(xv[j], xv[j], sq[b]);
                    }
                }
            }
        } else {
            for (int c = lane + 32 * slice; c < k; c += 32 * gw) {
                const float sc = nw ? nw[c] : 1.0f;
                const float wv = __bfloat162float(wr[c]) * sc;
                const float uv = ur ? __bfloat162float(ur[c]) * sc : 0.0f;
#pragma unroll
                for (int b = 0; b < B; ++b) {
                    const float xv = x[(size_t)b * xs + c];
                    a[b] = fmaf(wv, xv, a[b]);
                    u[b] = fmaf(uv, xv, u[b]);
                    if (norm_here) sq[b] = fmaf(xv, xv, sq[b]);
                }
            }
        }
        if (gw > 1) {
            // This warp's slice: its sums go to shared memory, the row's first warp adds them up
            // after the loop.
#pragma unroll
            for (int b = 0; b < B; ++b) {
                const float sa = warp_sum(a[b]), su = warp_sum(u[b]), ss = warp_sum(sq[b]);
                if (lane == 0) {
                    part[warp][0][b] = sa;
                    part[warp][1][b] = su;
                    part[warp][2][b] = ss;
                }
            }
            continue;
        }
        if (norm_here) {
#pragma unroll
            for (int b = 0; b < B; ++b) inv[b] = rsqrtf(warp_sum(sq[b]) / (float)k + eps);
        }
        first = false;
#pragma unroll
        for (int b = 0; b < B; ++b) {
            const float g = warp_sum(a[b]) * inv[b] + (bias ? bias[r] : 0.0f);
            const float uu = warp_sum(u[b]) * inv[b];
            if (lane == 0) mk_matvec_store(g, uu, up != nullptr, epi, act, cap, res, rs, out, os, b, r);
        }
    }
    if (gw > 1) {  // block-uniform
        __syncthreads();
        const int r = r0 + warp / gw;
        if (slice == 0 && r < r1 && lane < B) {
            // Lane b adds up batch row b's slices, in slice order.
            const int b = lane;
            float sa = 0.0f, su = 0.0f, ss = 0.0f;
            for (int j = 0; j < gw; ++j) {
                sa += part[warp + j][0][b];
                su += part[warp + j][1][b];
                ss += part[warp + j][2][b];
            }
            const float iv = use_norm ? rsqrtf(ss / (float)k + eps) : 1.0f;
            const float g = sa * iv + (bias ? bias[r] : 0.0f);
            mk_matvec_store(g, su * iv, up != nullptr, epi, act, cap, res, rs, out, os, b, r);
        }
    }
}

// out[b] = norm(x[b]) (* f32 weight), whole row.
__device__ __noinline__ void mk_rms_norm(const float* x, int xs, int n, int batch,
                                         const float* __restrict__ nw, float eps, float* out,
                                         int os) {
    __shared__ float inv[MK_MAX_BATCH];
    mk_inv_rms(x, xs, n, batch, 1, eps, inv);
    for (int b = 0; b < batch; ++b)
        for (int c = threadIdx.x; c < n; c += blockDim.x) {
            const float v = x[(size_t)b * xs + c] * inv[b];
            out[(size_t)b * os + c] = nw ? v * nw[c] : v;
        }
}

#define MK_EW_COMBINE 0
#define MK_EW_MUL 1
#define MK_EW_ACT 2
#define MK_EW_SOFTCAP 3

// Columns [c0, c1) of out[b] = op(x[b], y[b]): combine fa·x + fb·y, mul x·y, act(x), or
// softcap fa·tanh(x / fa). `y` is null for the unary ops.
__device__ __noinline__ void mk_ewise(int op, int act, const float* x, int xs, const float* y,
                                      int ys, float* out, int os, int c0, int c1, float fa,
                                      float fb, int batch) {
    const int n = c1 - c0;
    for (int idx = threadIdx.x; idx < batch * n; idx += blockDim.x) {
        const int b = idx / n, c = c0 + idx % n;
        const float xv = x[(size_t)b * xs + c];
        float v;
        if (op == MK_EW_COMBINE) {
            v = fa * xv + fb * y[(size_t)b * ys + c];
        } else if (op == MK_EW_MUL) {
            v = xv * y[(size_t)b * ys + c];
        } else if (op == MK_EW_ACT) {
            v = kiln_act(act, xv);
        } else {
            v = fa * tanhf(xv / fa);
        }
        out[(size_t)b * os + c] = v;
    }
}

// Group `grp` (columns [grp·hd, (grp+1)·hd)) of
//   out[b] = x[b] + scale·σ(gin[b][..channels] · w[grp][..channels]) · y[b]
// with w f32 `[groups, channels]`. nanochat's value embedding: x = v, gin = h, y = ve, one group
// per KV head. nanochat's smear (`smear` = 1, one group of the whole row): gin = x = e and y is
// the row's state at pos − 1 in kv_state (through the row's page table), none at position 0
// (out = e); the tile then stores e as the row's state at pos.
__device__ __noinline__ void mk_gated_add(const float* x, int xs, const float* gin, int gs,
                                          int channels, const float* __restrict__ w,
                                          const float* y, int ys, float* out, int os, int hd,
                                          int grp, float scale, int smear, float* kv_state,
                                          int state_dim, int block_size, const int* tables,
                                          int max_blocks, const int* pos, int batch) {
    __shared__ float gate[MK_MAX_BATCH];
    const float* wg = w + (size_t)grp * channels;
    const int c0 = grp * hd;
    for (int b = 0; b < batch; ++b) {
        float s = 0.0f;
        for (int c = threadIdx.x; c < channels; c += blockDim.x)
            s = fmaf(gin[(size_t)b * gs + c], wg[c], s);
        s = block_sum(s);
        if (threadIdx.x == 0) gate[b] = scale * kiln_sigmoid(s);
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < batch * hd; idx += blockDim.x) {
        const int b = idx / hd, c = c0 + idx % hd;
        const float xv = x[(size_t)b * xs + c];
        float yv = 0.0f;
        if (!smear) {
            yv = y[(size_t)b * ys + c];
        } else if (pos[b] > 0) {  // an inactive row (pos < 0) smears nothing, as position 0
            yv = kv_state[kv_pos_state(tables + (size_t)b * max_blocks, block_size, state_dim,
                                       pos[b] - 1) + c];
        }
        out[(size_t)b * os + c] = (smear && pos[b] <= 0) ? xv : xv + gate[b] * yv;
    }
    if (smear) {
        for (int idx = threadIdx.x; idx < batch * hd; idx += blockDim.x) {
            const int b = idx / hd, c = idx % hd;
            if (pos[b] < 0) continue;
            kv_state[kv_pos_state(tables + (size_t)b * max_blocks, block_size, state_dim, pos[b]) +
                     c] = x[(size_t)b * xs + c];
        }
    }
}

// Columns [c0, c1) of the embedding rows of tokens[b]; zeros for an inactive row (its token is
// not read).
__device__ __noinline__ void mk_embed(const __nv_bfloat16* __restrict__ table, int dim,
                                      const int* tokens, const int* pos, int batch, int c0,
                                      int c1, float* out) {
    for (int b = 0; b < batch; ++b) {
        const bool live = pos[b] >= 0;
        const __nv_bfloat16* row = table + (size_t)(live ? tokens[b] : 0) * dim;
        for (int c = c0 + threadIdx.x; c < c1; c += blockDim.x)
            out[(size_t)b * dim + c] = live ? __bfloat162float(row[c]) : 0.0f;
    }
}

// Rotates one head of `in` into `out` at each row's position (as cuda/rope.cu).
__device__ __forceinline__ void mk_rope_head(const float* in, int is, float* out, int os,
                                             int head_dim, const int* pos,
                                             const float* __restrict__ inv_freq, int style,
                                             int batch) {
    const int half = head_dim / 2;
    for (int idx = threadIdx.x; idx < batch * half; idx += blockDim.x) {
        const int b = idx / half, i = idx % half;
        const float a = (float)pos[b] * inv_freq[i];
        const float c = (float)cos((double)a), s = (float)sin((double)a);
        const int i0 = style == 1 ? 2 * i : i;
        const int i1 = style == 1 ? 2 * i + 1 : i + half;
        const float p = in[(size_t)b * is + i0], q = in[(size_t)b * is + i1];
        if (style == 2) {
            out[(size_t)b * os + i0] = p * c + q * s;
            out[(size_t)b * os + i1] = q * c - p * s;
        } else {
            out[(size_t)b * os + i0] = p * c - q * s;
            out[(size_t)b * os + i1] = q * c + p * s;
        }
    }
}

__device__ __noinline__ void mk_rope(const float* in, int is, float* out, int os, int head_dim,
                                     const int* pos, const float* __restrict__ inv_freq,
                                     int style, int batch) {
    mk_rope_head(in, is, out, os, head_dim, pos, inv_freq, style, batch);
}

// Per-head RMSNorm (no weight) times scale, one head.
__device__ __noinline__ void mk_head_norm(const float* in, int is, float* out, int os,
                                          int head_dim, float eps, float scale, int batch) {
    __shared__ float inv[MK_MAX_BATCH];
    mk_inv_rms(in, is, head_dim, batch, 1, eps, inv);
    for (int idx = threadIdx.x; idx < batch * head_dim; idx += blockDim.x) {
        const int b = idx / head_dim, c = idx % head_dim;
        out[(size_t)b * os + c] = in[(size_t)b * is + c] * inv[b] * scale;
    }
}

// Writes kv head g of layer `layer`'s k (rotated when rope) and v into the cache at pos[b],
// through batch row b's page table; nothing for an inactive row.
__device__ __noinline__ void mk_kv_append(const float* k, const float* v, int ks, int vs,
                                          unsigned short* k_cache, unsigned short* v_cache,
                                          int layers, int layer, int g, int kv_heads,
                                          int head_dim, int block_size, const int* tables,
                                          int max_blocks, const int* pos,
                                          const float* __restrict__ inv_freq, int style, int rope,
                                          int batch) {
    __shared__ float kr[MK_MAX_BATCH * ATT_MAX_D];
    if (rope) {
        mk_rope_head(k, ks, kr, ATT_MAX_D, head_dim, pos, inv_freq, style, batch);
    } else {
        for (int idx = threadIdx.x; idx < batch * head_dim; idx += blockDim.x) {
            const int b = idx / head_dim, c = idx % head_dim;
            kr[b * ATT_MAX_D + c] = k[(size_t)b * ks + c];
        }
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < batch * head_dim; idx += blockDim.x) {
        const int b = idx / head_dim, c = idx % head_dim;
        if (pos[b] < 0) continue;  // an inactive row writes nothing
        const size_t row = kv_pos_row(tables + (size_t)b * max_blocks, layers, kv_heads,
                                      block_size, head_dim, layer, g, pos[b]);
        kv_store_bf16(k_cache, row + c, kr[b * ATT_MAX_D + c]);
        kv_store_bf16(v_cache, row + c, v[(size_t)b * vs + c]);
    }
}

// Whether a tile attending at most 32 · MK_WARPS keys gives each warp a contiguous share of
// them (mk_attention) rather than striping 32-key tiles over the warps, which left every key of
// a context under 33 positions to warp 0. On an H200 that tile took 13–16 µs of every
// SmolLM2-135M and Llama-3.2-1B layer's ~37 / ~175 µs (run 11's timeline). Sums over other
// partitions than the per-op kernel's: equal up to f32 rounding, not bit for bit. The host
// compiles with MK_ATT_CHUNKS 0 (KILN_MK_ATT_STRIPE=1) to measure against the striped tiles.
// Ran on an H200 (run 11, second call): every megakernel GPU test passes with it; the tile's
// work fell from 13.2 to 8.1 µs (SmolLM2-135M) and 12.8 to 7.8 µs (Llama-3.2-1B shape) at 32
// positions, SmolLM2 batch 1 decoded 947 tokens/s against 842 striped. Every megakernel GPU
// test passes with it under the attention fusion too (run 12, H100).
#ifndef MK_ATT_CHUNKS
#define MK_ATT_CHUNKS 1
#endif

// Whether an attention tile's earlier keys are copied into shared memory ahead of it (like a
// matvec's weights, mk_stage_rows): keys [lo, pos) of its KV head were written by earlier
// steps, so they depend on nothing in this one, and the block copies them into the staging
// buffer while its previous tile waits and computes; after its own wait the tile reads them
// from shared memory, and only the new key from the cache. On unless the host compiles with
// MK_ATT_STAGE 0 (KILN_MK_ATT_STAGE=0). Why: on an H100 (run 12's timeline) the attention
// tile, a chain of dependent L2 round trips (page table, keys, values) after the KV append and
// the query's RoPE, took 9.5 µs of each SmolLM2-135M layer's ~24.5 µs at 32 positions. On an
// H100 (run 12, second call) every megakernel GPU test and compute-sanitizer's racecheck pass
// with it, also with 2 KiB staging buffers (KILN_MK_STAGE_BYTES=2048: the fixtures' tiles stage
// 32 keys and read the rest from the cache); the tile's work fell to 6.3 µs and SmolLM2-135M
// decoded 1,379 tokens/s at batch 1 against 1,218 without it (5,244 against 4,927 at batch 8).
#ifndef MK_ATT_STAGE
#define MK_ATT_STAGE 1
#endif

// Keys of [lo, p) an attention tile finds staged: as many as one staging buffer holds (K rows,
// then V rows, bf16), the first ones; none without staging or with rows not 16-byte multiples.
__device__ __forceinline__ int mk_att_staged(int lo, int p, int head_dim) {
    if (!MK_STAGE || !MK_ATT_STAGE || (head_dim & 7) != 0 || head_dim <= 0) return 0;
    const int cap = MK_STAGE_BYTES / (head_dim * 4);
    return min(max(p - lo, 0), cap);
}

// Copies the staged keys (mk_att_staged) of one row's attention tile -- KV head g of layer
// `layer`, the row's page table `table` and position `*pos` -- into staging buffer `buf`: K
// rows of keys lo, lo + 1, ..., then their V rows, with cp.async. Nothing for an inactive row.
// The caller commits the group.
__device__ __forceinline__ void mk_stage_attention(const unsigned short* k_cache,
                                                   const unsigned short* v_cache, int layers,
                                                   int layer, int g, int kv_heads, int head_dim,
                                                   int block_size, int window, const int* table,
                                                   const int* pos, int buf) {
    const int p = *pos;
    if (p < 0) return;
    const int lo = window >= 0 ? max(0, p - window) : 0;
    const int n = mk_att_staged(lo, p, head_dim);
    const int per = head_dim >> 3;  // 16-byte pieces of a row
    uint4* dst = mk_stage + (size_t)buf * MK_STAGE_U4;
    for (int i = threadIdx.x; i < n * per; i += blockDim.x) {
        const int j = lo + i / per, c = i - (i / per) * per;
        const size_t row =
            kv_pos_row(table, layers, kv_heads, block_size, head_dim, layer, g, j);
        const uint4* k = reinterpret_cast<const uint4*>(k_cache + row) + c;
        const uint4* v = reinterpret_cast<const uint4*>(v_cache + row) + c;
        const unsigned sk = (unsigned)__cvta_generic_to_shared(dst + i);
        const unsigned sv = (unsigned)__cvta_generic_to_shared(dst + (size_t)n * per + i);
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(sk), "l"(k) : "memory");
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(sv), "l"(v) : "memory");
    }
}

// One query head over keys [max(0, pos - window), pos] of its KV head g of layer `layer`: the
// block's warps split the keys (up to 32 · MK_WARPS keys a contiguous share each, see
// MK_ATT_CHUNKS; beyond, warp w takes key tiles w, w + MK_WARPS, ...) and merge their softmax
// states. Keys are read through batch row b's page table; an inactive row's output is
// zeros. With `rope_freq` (not null) the head of q is rotated at the row's position first, as
// mk_rope does (the program fused its Rope into the attention). With batch 1, the keys
// mk_stage_attention staged for this tile are read from staging buffer `buf`.
__device__ __noinline__ void mk_attention(const float* q, int qs, float* out, int os,
                                          const unsigned short* k_cache,
                                          const unsigned short* v_cache, int layers, int layer,
                                          int g, int kv_heads, int head_dim, int block_size,
                                          float scale, int window, const int* tables,
                                          int max_blocks, const int* pos,
                                          const float* __restrict__ rope_freq, int style,
                                          int batch, int buf) {
    __shared__ float qsh[ATT_MAX_D];
    __shared__ float wm[MK_WARPS], wl[MK_WARPS];
    __shared__ float wacc[MK_WARPS][ATT_MAX_D];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#if MK_STAGE
    // This tile's copy group is every one but the newest (the block's next tile's); the
    // barrier after the query below publishes every thread's copies.
    if (batch == 1) asm volatile("cp.async.wait_group 1;" ::: "memory");
#endif
    for (int b = 0; b < batch; ++b) {
        if (rope_freq) {
            mk_rope_head(q + (size_t)b * qs, qs, qsh, 0, head_dim, pos + b, rope_freq, style, 1);
        } else {
            for (int c = threadIdx.x; c < head_dim; c += blockDim.x) qsh[c] = q[(size_t)b * qs + c];
        }
        __syncthreads();
        const int p = pos[b];
        if (p < 0) {  // an inactive row: zeros, no key read
            for (int c = threadIdx.x; c < head_dim; c += blockDim.x) out[(size_t)b * os + c] = 0.0f;
            __syncthreads();
            continue;
        }
        const int lo = window >= 0 ? max(0, p - window) : 0;
        const AttKv kv = att_kv(k_cache, v_cache, tables + (size_t)b * max_blocks, layers,
                                kv_heads, block_size, head_dim, layer, g);
        float m = KILN_NEG_INF, l = 0.0f, acc[ATT_PER_LANE];
#pragma unroll
        for (int i = 0; i < ATT_PER_LANE; ++i) acc[i] = 0.0f;
        // Striped: warp w takes the 32-key tiles w, w + MK_WARPS, ... of [lo, p].
        int a = lo, e = p + 1, first = warp, step = MK_WARPS;
        const int n = p + 1 - lo;
        if (MK_ATT_CHUNKS && n <= 32 * MK_WARPS) {
            // Up to one 32-key tile per warp: each warp takes a contiguous ceil(n / MK_WARPS)
            // keys, so every warp works and each makes one round of key loads and one of value
            // loads. Striped 32-key tiles left a short context's keys all to warp 0, whose value
            // loop then waited on 32 keys' loads 8 at a time.
            const int chunk = (n + MK_WARPS - 1) / MK_WARPS;
            a = min(lo + warp * chunk, p + 1);
            e = min(a + chunk, p + 1);
            first = 0;
            step = 1;
        }
        // Keys [lo, lo + staged) are in staging buffer `buf` (K rows, then V rows).
        const int staged = batch == 1 ? mk_att_staged(lo, p, head_dim) : 0;
        const unsigned short* sk =
            reinterpret_cast<const unsigned short*>(mk_stage + (size_t)buf * MK_STAGE_U4);
        // One call site: attend_tiles inlined twice spilled under NVRTC 13.5.
        attend_tiles_from(qsh, kv, head_dim, scale, a, e, first, step, m, l, acc, sk,
                          sk + (size_t)staged * head_dim, lo, lo + staged);
        if (lane == 0) {
            wm[warp] = m;
            wl[warp] = l;
        }
#pragma unroll
        for (int i = 0; i < ATT_PER_LANE; ++i) {
            const int c = lane + 32 * i;
            if (c < head_dim) wacc[warp][c] = acc[i];
        }
        __syncthreads();
        float mm = KILN_NEG_INF;
        for (int w = 0; w < MK_WARPS; ++w) mm = fmaxf(mm, wm[w]);
        float ll = 0.0f;
        for (int w = 0; w < MK_WARPS; ++w)
            if (wm[w] != KILN_NEG_INF) ll += wl[w] * expf(wm[w] - mm);
        for (int c = threadIdx.x; c < head_dim; c += blockDim.x) {
            float s = 0.0f;
            for (int w = 0; w < MK_WARPS; ++w)
                if (wm[w] != KILN_NEG_INF) s += wacc[w][c] * expf(wm[w] - mm);
            out[(size_t)b * os + c] = s / ll;
        }
        __syncthreads();
    }
}

// Batch row b's next token from its logits row, by the whole block with kiln_sample_row
// (sample.cuh): the row's own controls ctl->rows[b] at run time (temperature 0 = greedy), the
// Philox draw keyed by (rows[b].seed, rows[b].row_id, pos[b] + 1), the position the token will
// take. An inactive row (pos[b] < 0) samples nothing.
__device__ __noinline__ void mk_sample(const float* logits, int ls, int vocab, int b,
                                       const MkControl* __restrict__ ctl, const int* pos,
                                       int* tokens) {
    const int p = pos[b];
    if (p < 0) return;
    const MkRow* r = ctl->rows + b;
    const int t = kiln_sample_row(logits + (size_t)b * ls, vocab, r, (u32)r->row_id,
                                  (u64)(long long)p + 1ull);
    if (threadIdx.x == 0) tokens[b] = t;
}

// The step's last tile (every Sample tile has finished): advances each active row's position,
// writes ring entry epoch % MK_RING -- the tokens (MK_NO_TOKEN for an inactive row), the bitmask
// of active rows whose token is a stop id, then,
// after __threadfence_system(), the epoch (volatile), which the host polls -- and publishes the
// epoch for the next launch. One thread writes the whole entry, so program order plus the
// system fence put every word before the epoch for the host.
__device__ __noinline__ void mk_step_end(int* pos, const int* tokens, int batch,
                                         const MkControl* __restrict__ ctl, unsigned* ring,
                                         unsigned epoch, unsigned* epoch_ctr) {
    // batch <= MK_MAX_BATCH < 32: warp 0's ballot is every row's liveness, taken before any
    // position advances (thread 0 writes the ring from it, without reading pos again).
    const bool live = threadIdx.x < batch && pos[threadIdx.x] >= 0;
    const unsigned live_rows = __ballot_sync(KILN_FULL_MASK, live);
    if (live) pos[threadIdx.x] += 1;
    if (threadIdx.x == 0) {
        unsigned* e = ring + (size_t)(epoch % MK_RING) * (batch + 2);
        const int n_stop = min(max(ctl->n_stop, 0), MK_MAX_STOP);
        unsigned stopped = 0u;
        for (int b = 0; b < batch; ++b) {
            if (!((live_rows >> b) & 1u)) {
                e[b] = MK_NO_TOKEN;
                continue;
            }
            const int t = tokens[b];
            e[b] = (unsigned)t;
            for (int k = 0; k < n_stop; ++k)
                if (ctl->stop_ids[k] == t) stopped |= 1u << b;
        }
        e[batch] = stopped;
        __threadfence_system();
        *(volatile unsigned*)(e + batch + 1) = epoch;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        atomicExch(epoch_ctr, epoch);
    }
}

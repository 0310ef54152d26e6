// sample.cu: on-device token choice, mirroring src/sample/mod.rs.
//
//  argmax_rows   greedy: the largest logit, the first index on ties; NaN never wins; a row with
//                no finite maximum gives 0 (as `sample::argmax`).
//  sample_rows   temperature sampling with top-k / min-p / top-p: the k best candidates are
//                selected in the CPU's order (descending logit, ties by index) by k rounds of a
//                block-wide argmax that excludes what was taken, then thread 0 walks them with
//                the CPU's f32 arithmetic in the same order: p_i = exp((l_i - max) / T), min-p
//                cut, top-p cut on the normalised cumulative sum, target = u * kept with
//                u = Philox-4x32-10 uniform(seed, row, position) -- the same counter-based draw
//                as the CPU, so both pick the same token unless `expf` rounding differs from the
//                host's `exp` at a boundary.
//                Limits: k <= SAMPLE_MAX_K (1024) candidates; the host must use the CPU sampler
//                for rows without top-k (a whole-vocabulary sort is not implemented here).
// UNVERIFIED on a GPU.
#include "common.cuh"

#define SAMPLE_MAX_K 1024

struct Best {
    float v;
    int i;
};

// Is a better than b: larger value, or equal value and smaller index; empty (i < 0) never wins.
__device__ __forceinline__ bool better(Best a, Best b) {
    if (a.i < 0) return false;
    if (b.i < 0) return true;
    return a.v > b.v || (a.v == b.v && a.i < b.i);
}

__device__ __forceinline__ Best warp_best(Best b) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        Best c;
        c.v = __shfl_xor_sync(KILN_FULL_MASK, b.v, o);
        c.i = __shfl_xor_sync(KILN_FULL_MASK, b.i, o);
        if (better(c, b)) b = c;
    }
    return b;
}

__device__ __forceinline__ Best block_best(Best b) {
    __shared__ float sv[32];
    __shared__ int si[32];
    __shared__ Best result;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    b = warp_best(b);
    if (lane == 0) {
        sv[warp] = b.v;
        si[warp] = b.i;
    }
    __syncthreads();
    if (warp == 0) {
        Best c;
        c.v = lane < nwarps ? sv[lane] : 0.0f;
        c.i = lane < nwarps ? si[lane] : -1;
        c = warp_best(c);
        if (lane == 0) result = c;
    }
    __syncthreads();
    Best r = result;
    __syncthreads();
    return r;
}

// Grid: (rows), block: 256 (a multiple of 32, <= 1024).
extern "C" __global__ void argmax_rows(const float* __restrict__ logits, int stride, int vocab,
                                       u32* __restrict__ out) {
    const float* l = logits + (size_t)blockIdx.x * stride;
    Best b;
    b.v = 0.0f;
    b.i = -1;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float v = l[i];
        // Only values above -inf are candidates (NaN compares false): as `v > best_v` on the CPU.
        if (v > KILN_NEG_INF) {
            Best c;
            c.v = v;
            c.i = i;
            if (better(c, b)) b = c;
        }
    }
    b = block_best(b);
    if (threadIdx.x == 0) out[blockIdx.x] = b.i < 0 ? 0u : (u32)b.i;
}

// Grid: (rows), block: 256. `work` is scratch of rows * vocab floats (a copy the selection marks).
// Per row: seeds[row] and positions[row] (u64), `row_ids[row]` the engine's row number.
// top_p <= 0 or min_p < 0 disables that filter; top_k in [1, SAMPLE_MAX_K].
extern "C" __global__ void sample_rows(const float* __restrict__ logits, int stride, int vocab,
                                       float* __restrict__ work, float temperature, int top_k,
                                       float top_p, float min_p,
                                       const u64* __restrict__ seeds,
                                       const u64* __restrict__ positions,
                                       const u32* __restrict__ row_ids, u32* __restrict__ out) {
    __shared__ int cand[SAMPLE_MAX_K];
    __shared__ float cval[SAMPLE_MAX_K];
    const int row = blockIdx.x;
    const float* l = logits + (size_t)row * stride;
    float* wk = work + (size_t)row * vocab;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) wk[i] = l[i];
    __syncthreads();
    const int k = min(min(top_k, SAMPLE_MAX_K), vocab);
    int taken = 0;
    for (; taken < k; ++taken) {
        Best b;
        b.v = 0.0f;
        b.i = -1;
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            const float v = wk[i];
            if (v == v) {  // not NaN; taken entries are NaN
                Best c;
                c.v = v;
                c.i = i;
                if (better(c, b)) b = c;
            }
        }
        b = block_best(b);
        if (b.i < 0) break;
        if (threadIdx.x == 0) {
            cand[taken] = b.i;
            cval[taken] = b.v;
            wk[b.i] = __int_as_float(0x7fc00000);  // NaN: taken
        }
        __syncthreads();
    }
    if (threadIdx.x != 0) return;
    if (taken == 0) {
        out[row] = 0u;
        return;
    }
    const float mx = cval[0];
    const float inv_t = 1.0f / temperature;
    // Probabilities overwrite the values in place.
    for (int n = 0; n < taken; ++n) cval[n] = expf((cval[n] - mx) * inv_t);
    int keep = taken;
    if (min_p >= 0.0f) {
        int c = 0;
        while (c < keep && cval[c] >= min_p * cval[0]) ++c;
        keep = max(c, 1);
    }
    if (top_p > 0.0f) {
        float total = 0.0f;
        for (int n = 0; n < keep; ++n) total += cval[n];
        float cum = 0.0f;
        for (int n = 0; n < keep; ++n) {
            cum += cval[n] / total;
            if (cum >= top_p) {
                keep = n + 1;
                break;
            }
        }
    }
    float kept = 0.0f;
    for (int n = 0; n < keep; ++n) kept += cval[n];
    const float target = kiln_uniform(seeds[row], row_ids[row], positions[row]) * kept;
    float cum = 0.0f;
    for (int n = 0; n < keep; ++n) {
        cum += cval[n];
        if (target < cum) {
            out[row] = (u32)cand[n];
            return;
        }
    }
    out[row] = (u32)cand[keep - 1];
}

// gemv.cu: the decode matmul (Op::MatMul with one token row per sequence): memory-bound
// y = x W^T (+ bias) with bf16 W [rows, k] and f32 x, f32 accumulation.
//
// Layout of the work: a warp owns two weight rows and streams them with 16-byte loads (8 bf16
// per lane per step, 256 columns per warp step); GEMV_WARPS warps per block; grid.y is the token
// row (decode batch), grid.z splits K so that small matrices still launch enough blocks to fill
// every SM (the host picks `splits`; with splits > 1 the partial sums go to `partial` and
// gemv_finish applies the epilogue, summing the splits in a fixed order: deterministic).
//
// Epilogues (graph::Epilogue): 0 None, 1 ResidualAdd (out = residual + y; residual may be out
// itself, the in-place case), 2 Activation (out = act(y)), 3 Gated (weight rows [gate; up],
// rows = 2f: out[j] = act(y[j]) * y[j + f]; the warp owns rows j and j + f).
// The 16-byte path needs k % 8 == 0 and 16-byte aligned W rows (the host uploads every matrix
// in its own allocation); other k take the scalar path.
// Compiles for sm_80/sm_90 without spills (tests/nvrtc_compile.rs). Ran on an H200 (sm_90 only,
// docs/gpu-results.md): decode logits matched the CPU's on every fixture. Every matrix there
// and in the demo model has k % 8 == 0, so the scalar path has not run on a GPU.
#include "common.cuh"

#define GEMV_WARPS 4
#define KILN_EPI_NONE 0
#define KILN_EPI_RESIDUAL 1
#define KILN_EPI_ACT 2
#define KILN_EPI_GATED 3

__device__ __forceinline__ float bf16lo(u32 u) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float bf16hi(u32 u) { return __uint_as_float(u & 0xffff0000u); }

__device__ __forceinline__ float dot8(uint4 w, const float* __restrict__ x) {
    float s = bf16lo(w.x) * __ldg(x + 0);
    s = fmaf(bf16hi(w.x), __ldg(x + 1), s);
    s = fmaf(bf16lo(w.y), __ldg(x + 2), s);
    s = fmaf(bf16hi(w.y), __ldg(x + 3), s);
    s = fmaf(bf16lo(w.z), __ldg(x + 4), s);
    s = fmaf(bf16hi(w.z), __ldg(x + 5), s);
    s = fmaf(bf16lo(w.w), __ldg(x + 6), s);
    s = fmaf(bf16hi(w.w), __ldg(x + 7), s);
    return s;
}

// Applies the epilogue for output column j of token row t given the raw sums of its weight
// rows (a0: row j, or the gate row; a1: the up row for Gated).
__device__ __forceinline__ void gemv_store(int epilogue, int act, int j, int f, float a0,
                                                  float a1, const float* __restrict__ bias,
                                                  float* out, const float* residual) {
    if (epilogue == KILN_EPI_GATED) {
        const float g = a0 + (bias ? bias[j] : 0.0f);
        const float u = a1 + (bias ? bias[j + f] : 0.0f);
        out[j] = kiln_act_any(act, g) * u;
        return;
    }
    const float v = a0 + (bias ? bias[j] : 0.0f);
    if (epilogue == KILN_EPI_RESIDUAL) {
        out[j] = residual[j] + v;
    } else if (epilogue == KILN_EPI_ACT) {
        out[j] = kiln_act_any(act, v);
    } else {
        out[j] = v;
    }
}

// Grid: (ceil(pairs / GEMV_WARPS), n_tok, splits), block: 32 * GEMV_WARPS, where pairs is
// rows / 2 for Gated and ceil(rows / 2) otherwise. `chunk` (a multiple of 8) is the K range of
// one split. `partial` ([splits][n_tok][rows]) is only used when gridDim.z > 1.
extern "C" __global__ void __launch_bounds__(32 * GEMV_WARPS)
gemv_bf16(const __nv_bfloat16* __restrict__ w, int rows, int k, const float* __restrict__ x,
          int x_stride, const float* __restrict__ bias, float* out, int out_stride,
          const float* residual, int res_stride, int epilogue, int act, int chunk,
          float* __restrict__ partial) {
    const int lane = threadIdx.x & 31;
    const int pair = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    const int t = blockIdx.y, z = blockIdx.z, splits = gridDim.z;
    const bool gated = epilogue == KILN_EPI_GATED;
    const int f = rows / 2;
    int r0, r1;
    if (gated) {
        if (pair >= f) return;
        r0 = pair;
        r1 = pair + f;
    } else {
        r0 = 2 * pair;
        if (r0 >= rows) return;
        r1 = r0 + 1 < rows ? r0 + 1 : r0;
    }
    const float* xr = x + (size_t)t * x_stride;
    const __nv_bfloat16* w0 = w + (size_t)r0 * k;
    const __nv_bfloat16* w1 = w + (size_t)r1 * k;
    const int k0 = z * chunk;
    const int k1 = min(k, k0 + chunk);
    float a0 = 0.0f, a1 = 0.0f;
    if ((k & 7) == 0) {
        for (int c = k0 + lane * 8; c < k1; c += 32 * 8) {
            const uint4 v0 = __ldg(reinterpret_cast<const uint4*>(w0 + c));
            const uint4 v1 = __ldg(reinterpret_cast<const uint4*>(w1 + c));
            a0 += dot8(v0, xr + c);
            a1 += dot8(v1, xr + c);
        }
    } else {
        for (int c = k0 + lane; c < k1; c += 32) {
            const float xv = __ldg(xr + c);
            a0 = fmaf(__bfloat162float(w0[c]), xv, a0);
            a1 = fmaf(__bfloat162float(w1[c]), xv, a1);
        }
    }
    a0 = warp_sum(a0);
    a1 = warp_sum(a1);
    if (lane != 0) return;
    if (splits > 1) {
        float* p = partial + ((size_t)z * gridDim.y + t) * rows;
        p[r0] = a0;
        if (r1 != r0) p[r1] = a1;
        return;
    }
    float* o = out + (size_t)t * out_stride;
    const float* res = residual ? residual + (size_t)t * res_stride : nullptr;
    if (gated) {
        gemv_store(epilogue, act, r0, f, a0, a1, bias, o, res);
    } else {
        gemv_store(epilogue, act, r0, f, a0, 0.0f, bias, o, res);
        if (r1 != r0) gemv_store(epilogue, act, r1, f, a1, 0.0f, bias, o, res);
    }
}

// Sums the split-K partials in split order and applies the epilogue.
// Grid: (ceil(n_out / 256), n_tok), block: 256; n_out = rows / 2 for Gated, else rows.
extern "C" __global__ void gemv_finish(const float* __restrict__ partial, int splits, int rows,
                                       const float* __restrict__ bias, float* out,
                                       int out_stride, const float* residual, int res_stride,
                                       int epilogue, int act) {
    const int t = blockIdx.y, n_tok = gridDim.y;
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    const int f = rows / 2;
    const bool gated = epilogue == KILN_EPI_GATED;
    if (j >= (gated ? f : rows)) return;
    float a0 = 0.0f, a1 = 0.0f;
    for (int z = 0; z < splits; ++z) {
        const float* p = partial + ((size_t)z * n_tok + t) * rows;
        a0 += p[j];
        if (gated) a1 += p[j + f];
    }
    const float* res = residual ? residual + (size_t)t * res_stride : nullptr;
    gemv_store(epilogue, act, j, f, a0, a1, bias, out + (size_t)t * out_stride, res);
}

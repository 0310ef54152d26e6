// common.cuh: helpers shared by every kiln CUDA source.
//
// NVRTC gets this file prepended to each .cu source by the Rust side (src/backend/cuda/kernels.rs
// replaces the `#include "common.cuh"` line), so no include path is needed for it; only
// cuda_bf16.h comes from the toolkit's include directory.
//
// Conventions (all kernels):
//  * activations are f32 matrices addressed as `base + row * stride` (the host already offset
//    `base` by the slot's first column), weights are bf16 row-major `[out, in]`, accumulation f32;
//  * a step's token rows are described by `row_slot[t]` (KV-cache slot) and `row_pos[t]`
//    (absolute position), both int32 on the device;
//  * the KV cache is the paged pool of kv.cuh (the layout of src/kv/layout.rs), bf16 on the GPU
//    (the CPU's default is f32: GPU results therefore match the CPU within bf16 tolerance); a
//    slot's positions are found through its page table.
//
// Every file compiles with NVRTC 13.0 and 13.5 for sm_80 and sm_90 (tests/nvrtc_compile.rs) and
// mirrors src/backend/cpu/; on an H200 (2026-11-26, docs/gpu-results.md) the per-op path matched
// the CPU's logits on every fixture within bf16 tolerance (tests/gpu.rs).
#pragma once
#include <cuda_bf16.h>

typedef unsigned int u32;
typedef unsigned long long u64;

#define KILN_NEG_INF __int_as_float(0xff800000)

#define KILN_WARP 32
#define KILN_FULL_MASK 0xffffffffu

// Activation codes, matching graph::Activation.
#define KILN_ACT_SILU 0
#define KILN_ACT_RELU2 1
#define KILN_ACT_GELU_TANH 2

// SiLU and relu², the activations the decode megakernel lowers (a third branch in its tiles
// costs registers and spills).
__device__ __forceinline__ float kiln_act(int act, float x) {
    if (act == KILN_ACT_SILU) {
        return x / (1.0f + expf(-x));
    }
    float r = fmaxf(x, 0.0f);
    return r * r;
}

// Every activation, for the per-op kernels: kiln_act plus GELU-tanh (Gemma 3; its fixture's
// logits matched the CPU's on an H200).
__device__ __forceinline__ float kiln_act_any(int act, float x) {
    if (act == KILN_ACT_GELU_TANH) {
        return 0.5f * x * (1.0f + tanhf(0.7978845608f * (x + 0.044715f * x * x * x)));
    }
    return kiln_act(act, x);
}

__device__ __forceinline__ float kiln_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(KILN_FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(KILN_FULL_MASK, v, o));
    return v;
}

// Sum over the whole block (blockDim.x a multiple of 32, at most 1024). Every thread gets it.
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float part[32];
    __shared__ float total;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = warp_sum(v);
    if (lane == 0) part[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float s = lane < nwarps ? part[lane] : 0.0f;
        s = warp_sum(s);
        if (lane == 0) total = s;
    }
    __syncthreads();
    float r = total;
    __syncthreads();
    return r;
}

// ---- Philox-4x32-10, bit-identical to src/sample/philox.rs -------------------------------------
__device__ __forceinline__ void philox4x32_10(u32 ctr[4], u32 key0, u32 key1) {
    const u32 M0 = 0xD2511F53u, M1 = 0xCD9E8D57u, W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
#pragma unroll
    for (int round = 0; round < 10; ++round) {
        if (round > 0) {
            key0 += W0;
            key1 += W1;
        }
        const u32 hi0 = __umulhi(M0, ctr[0]), lo0 = M0 * ctr[0];
        const u32 hi1 = __umulhi(M1, ctr[2]), lo1 = M1 * ctr[2];
        const u32 c0 = hi1 ^ ctr[1] ^ key0, c2 = hi0 ^ ctr[3] ^ key1;
        ctr[0] = c0;
        ctr[1] = lo1;
        ctr[2] = c2;
        ctr[3] = lo0;
    }
}

// A uniform draw in [0, 1) with 24 random bits for (seed, row, position): sample::uniform.
__device__ __forceinline__ float kiln_uniform(u64 seed, u32 row, u64 position) {
    u32 c[4] = {(u32)position, (u32)(position >> 32), row, 0u};
    philox4x32_10(c, (u32)seed, (u32)(seed >> 32));
    return (float)(c[0] >> 8) * (1.0f / 16777216.0f);
}

// attention_decode.cu: Op::Attention for decode (one query row per sequence) as split-K
// flash-decoding, plus the KV-cache append every attention step starts with.
//
//  kv_append        writes this step's k/v rows (f32) into the bf16 cache at (slot, pos),
//                   through the slot's page table (kv.cuh);
//  attention_decode grid (rows * heads, splits), 4 warps: the key range [lo, pos] of the row
//                   (lo = pos - window for sliding-window layers, else 0) is cut into `splits`
//                   contiguous parts; the block's warps take 32-key tiles of its part in turn,
//                   merge their (max, sum, acc) in shared memory, and write one partial;
//  attention_combine merges the splits of each (row, head) and writes the output.
// GQA: query head h reads KV head h / (heads / kv_heads), as repeat_kv does.
// The cache is the paged pool of kv.cuh: `kc` / `vc` are the whole K / V arrays (bf16 bits),
// `tables` the page tables of every slot, `max_blocks` ints apart; `layer` picks the layer.
// Ran on an H200 (docs/gpu-results.md): the per-op path matched the CPU's logits on every
// fixture (GQA and sliding windows included).
#include "common.cuh"
#include "kv.cuh"
#include "attention.cuh"

#define DEC_WARPS 4

// One thread per (row, kv head, dim). Grid: ceil(rows * kv_heads * head_dim / 256), block 256.
extern "C" __global__ void kv_append(const float* __restrict__ k, int k_stride,
                                     const float* __restrict__ v, int v_stride,
                                     unsigned short* __restrict__ kc,
                                     unsigned short* __restrict__ vc,
                                     const int* __restrict__ row_slot,
                                     const int* __restrict__ row_pos, int rows, int kv_heads,
                                     int head_dim, const int* __restrict__ tables, int max_blocks,
                                     int layers, int layer, int block_size) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const int width = kv_heads * head_dim;
    if (idx >= (long long)rows * width) return;
    const int t = (int)(idx / width), e = (int)(idx % width);
    const int g = e / head_dim, d = e % head_dim;
    const int* table = tables + (size_t)row_slot[t] * max_blocks;
    const size_t at =
        kv_pos_row(table, layers, kv_heads, block_size, head_dim, layer, g, row_pos[t]) + d;
    kv_store_bf16(kc, at, k[(size_t)t * k_stride + e]);
    kv_store_bf16(vc, at, v[(size_t)t * v_stride + e]);
}

// Partials: part_ml[(task * splits + z) * 2 + {0: max, 1: sum}], part_acc[(task * splits + z) * D].
// Min 1 block per SM: without it ptxas (NVRTC 13.5, sm_90) held the kernel to 64 registers
// and spilled attend_tiles' in-flight loads; it needs about 90.
extern "C" __global__ void __launch_bounds__(32 * DEC_WARPS, 1)
attention_decode(const float* __restrict__ q, int q_stride, const unsigned short* __restrict__ kc,
                 const unsigned short* __restrict__ vc, const int* __restrict__ row_slot,
                 const int* __restrict__ row_pos, int heads, int kv_heads, int head_dim,
                 const int* __restrict__ tables, int max_blocks, int layers, int layer,
                 int block_size, float scale, int window, float* __restrict__ part_ml,
                 float* __restrict__ part_acc) {
    __shared__ float qs[ATT_MAX_D];
    __shared__ float wm[DEC_WARPS], wl[DEC_WARPS];
    __shared__ float wacc[DEC_WARPS][ATT_MAX_D];
    const int task = blockIdx.x, z = blockIdx.y, splits = gridDim.y;
    const int t = task / heads, h = task % heads;
    const int g = h / (heads / kv_heads);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int pos = row_pos[t], slot = row_slot[t];
    const int hi_all = pos + 1;
    const int lo_all = window >= 0 ? max(0, pos - window) : 0;
    const int per = (((hi_all - lo_all) + splits - 1) / splits + 31) / 32 * 32;
    const int lo = lo_all + z * per;
    const int hi = min(hi_all, lo + per);

    for (int c = threadIdx.x; c < head_dim; c += blockDim.x) {
        qs[c] = q[(size_t)t * q_stride + (size_t)h * head_dim + c];
    }
    __syncthreads();
    float m = KILN_NEG_INF, l = 0.0f, acc[ATT_PER_LANE];
#pragma unroll
    for (int i = 0; i < ATT_PER_LANE; ++i) acc[i] = 0.0f;
    const AttKv kv = att_kv(kc, vc, tables + (size_t)slot * max_blocks, layers, kv_heads,
                            block_size, head_dim, layer, g);
    if (lo < hi) attend_tiles(qs, kv, head_dim, scale, lo, hi, warp, DEC_WARPS, m, l, acc);
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
    float M = KILN_NEG_INF;
    for (int w = 0; w < DEC_WARPS; ++w) M = fmaxf(M, wm[w]);
    const size_t p = (size_t)task * splits + z;
    for (int c = threadIdx.x; c < head_dim; c += blockDim.x) {
        float a = 0.0f;
        for (int w = 0; w < DEC_WARPS; ++w) {
            if (wm[w] != KILN_NEG_INF) a += expf(wm[w] - M) * wacc[w][c];
        }
        part_acc[p * head_dim + c] = a;
    }
    if (threadIdx.x == 0) {
        float L = 0.0f;
        for (int w = 0; w < DEC_WARPS; ++w) {
            if (wm[w] != KILN_NEG_INF) L += expf(wm[w] - M) * wl[w];
        }
        part_ml[p * 2] = M;
        part_ml[p * 2 + 1] = L;
    }
}

// Grid: (rows * heads), block: 128.
extern "C" __global__ void attention_combine(const float* __restrict__ part_ml,
                                             const float* __restrict__ part_acc, int splits,
                                             int heads, int head_dim, float* __restrict__ out,
                                             int out_stride) {
    const int task = blockIdx.x;
    const int t = task / heads, h = task % heads;
    float M = KILN_NEG_INF;
    for (int z = 0; z < splits; ++z) M = fmaxf(M, part_ml[((size_t)task * splits + z) * 2]);
    float L = 0.0f;
    for (int z = 0; z < splits; ++z) {
        const float mz = part_ml[((size_t)task * splits + z) * 2];
        if (mz != KILN_NEG_INF) L += expf(mz - M) * part_ml[((size_t)task * splits + z) * 2 + 1];
    }
    for (int c = threadIdx.x; c < head_dim; c += blockDim.x) {
        float a = 0.0f;
        for (int z = 0; z < splits; ++z) {
            const float mz = part_ml[((size_t)task * splits + z) * 2];
            if (mz != KILN_NEG_INF) a += expf(mz - M) * part_acc[((size_t)task * splits + z) * head_dim + c];
        }
        out[(size_t)t * out_stride + (size_t)h * head_dim + c] = a / L;
    }
}

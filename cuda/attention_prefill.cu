// attention_prefill.cu: Op::Attention for prefill (many query rows, causal): flash-attention
// style online softmax over 32-key tiles of the cache (after kv_append from attention_decode.cu
// has written the step's keys). One warp per (query row, head), 4 heads of one row per block;
// rows of one step may belong to different sequences (their own slot and position), GQA and
// sliding windows as in decode. Written for correctness, not speed (K rows are read by one lane
// each, no shared-memory K/V tiles). The cache is kv.cuh's paged pool, as in attention_decode.cu.
// Ran on an H200 (docs/gpu-results.md): prefill logits matched the CPU's at every prompt position
// on every fixture (GQA and sliding windows included).
#include "common.cuh"
#include "kv.cuh"
#include "attention.cuh"

#define PRE_WARPS 4

// Grid: (rows, ceil(heads / 4)), block: 128.
extern "C" __global__ void  // no __launch_bounds__: with (128) ptxas spills 4 bytes on sm_80
attention_prefill(const float* __restrict__ q, int q_stride, const unsigned short* __restrict__ kc,
                  const unsigned short* __restrict__ vc, const int* __restrict__ row_slot,
                  const int* __restrict__ row_pos, int heads, int kv_heads, int head_dim,
                  const int* __restrict__ tables, int max_blocks, int layers, int layer,
                  int block_size, float scale, int window, float* __restrict__ out,
                  int out_stride) {
    __shared__ float qs[PRE_WARPS][ATT_MAX_D];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int t = blockIdx.x, h = blockIdx.y * PRE_WARPS + warp;
    if (h >= heads) return;  // whole warps only: no block-wide barrier below
    const int g = h / (heads / kv_heads);
    const int pos = row_pos[t], slot = row_slot[t];
    const int hi = pos + 1;
    const int lo = window >= 0 ? max(0, pos - window) : 0;
    for (int c = lane; c < head_dim; c += 32) {
        qs[warp][c] = q[(size_t)t * q_stride + (size_t)h * head_dim + c];
    }
    __syncwarp();
    float m = KILN_NEG_INF, l = 0.0f, acc[ATT_PER_LANE];
#pragma unroll
    for (int i = 0; i < ATT_PER_LANE; ++i) acc[i] = 0.0f;
    const AttKv kv = att_kv(kc, vc, tables + (size_t)slot * max_blocks, layers, kv_heads,
                            block_size, head_dim, layer, g);
    attend_tiles(qs[warp], kv, head_dim, scale, lo, hi, 0, 1, m, l, acc);
    float* o = out + (size_t)t * out_stride + (size_t)h * head_dim;
    const float inv = 1.0f / l;
#pragma unroll
    for (int i = 0; i < ATT_PER_LANE; ++i) {
        const int c = lane + 32 * i;
        if (c < head_dim) o[c] = acc[i] * inv;
    }
}

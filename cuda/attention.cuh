// attention.cuh: the per-warp online-softmax core shared by attention_decode.cu and
// attention_prefill.cu (prepended by the host like common.cuh).
//
// One warp attends one query (held in shared memory) over keys [lo, hi) of one KV head, 32 keys
// per tile: lane j scores key j of the tile, the warp rescales its running (max, sum, acc) the
// flash-attention way, then accumulates the tile's values with lane d owning dims d, d+32, ...
// head_dim <= ATT_MAX_D. Softmax statistics and accumulation are f32; K/V are bf16.
#pragma once

#define ATT_MAX_D 256
#define ATT_PER_LANE (ATT_MAX_D / 32)

// The cache row of (slot, kv head, position) in a layer's K or V block.
__device__ __forceinline__ size_t kv_row(int slot, int g, int pos, int kv_heads,
                                                int capacity, int head_dim) {
    return (((size_t)slot * kv_heads + g) * capacity + pos) * head_dim;
}

// Processes tiles starting at lo + first * 32, stepping step * 32 keys, up to hi.
__device__ __forceinline__ void attend_tiles(const float* qs, const __nv_bfloat16* kbase,
                                                    const __nv_bfloat16* vbase, int head_dim,
                                                    float scale, int lo, int hi, int first,
                                                    int step, float& m, float& l,
                                                    float acc[ATT_PER_LANE]) {
    const int lane = threadIdx.x & 31;
    for (int j0 = lo + first * 32; j0 < hi; j0 += step * 32) {
        const int j = j0 + lane;
        float s = KILN_NEG_INF;
        if (j < hi) {
            const __nv_bfloat16* kr = kbase + (size_t)j * head_dim;
            float d = 0.0f;
            for (int c = 0; c < head_dim; ++c) d = fmaf(qs[c], __bfloat162float(kr[c]), d);
            s = d * scale;
        }
        const float tile_max = warp_max(s);
        const float new_m = fmaxf(m, tile_max);
        const float corr = (m == KILN_NEG_INF) ? 0.0f : expf(m - new_m);
        const float p = (j < hi) ? expf(s - new_m) : 0.0f;
        l = l * corr + warp_sum(p);
#pragma unroll
        for (int i = 0; i < ATT_PER_LANE; ++i) acc[i] *= corr;
        const int n = min(32, hi - j0);
        for (int jj = 0; jj < n; ++jj) {
            const float pj = __shfl_sync(KILN_FULL_MASK, p, jj);
            const __nv_bfloat16* vr = vbase + (size_t)(j0 + jj) * head_dim;
#pragma unroll
            for (int i = 0; i < ATT_PER_LANE; ++i) {
                const int c = lane + 32 * i;
                if (c < head_dim) acc[i] = fmaf(pj, __bfloat162float(vr[c]), acc[i]);
            }
        }
        m = new_m;
    }
}

// attention.cuh: the per-warp online-softmax core shared by attention_decode.cu and
// attention_prefill.cu (prepended by the host like common.cuh).
//
// One warp attends one query (held in shared memory) over keys [lo, hi) of one KV head, 32 keys
// per tile: lane j scores key j of the tile, the warp rescales its running (max, sum, acc) the
// flash-attention way, then accumulates the tile's values with lane d owning dims d, d+32, ...
// head_dim <= ATT_MAX_D. Softmax statistics and accumulation are f32; K/V are bf16 in the paged
// layout of kv.cuh (included before this file): key j of the sequence is row j % block_size of
// block table[j / block_size].
#pragma once

#define ATT_MAX_D 256
#define ATT_PER_LANE (ATT_MAX_D / 32)

// One KV head of one layer of one sequence, as attention reads it: `k` / `v` point at the head's
// run in block 0 (kv_head_block(.., layer, 0, head)), a block's run is `block_stride` elements
// further per block number, and `table` is the sequence's page table.
struct AttKv {
    const unsigned short* k;
    const unsigned short* v;
    const int* table;
    size_t block_stride;
    int block_size;
};

__device__ __forceinline__ AttKv att_kv(const unsigned short* kc, const unsigned short* vc,
                                        const int* table, int layers, int kv_heads,
                                        int block_size, int head_dim, int layer, int head) {
    const size_t at = kv_head_block(layers, kv_heads, block_size, head_dim, layer, 0, head);
    return AttKv{kc + at, vc + at, table, kv_block_stride(layers, kv_heads, block_size, head_dim),
                 block_size};
}

// Element offset of key j's row from the head's block-0 run.
__device__ __forceinline__ size_t att_row(const AttKv& kv, int j, int head_dim) {
    return (size_t)kv.table[j / kv.block_size] * kv.block_stride +
           (size_t)(j % kv.block_size) * head_dim;
}

// Processes tiles starting at lo + first * 32, stepping step * 32 keys, up to hi.
// Latency, not arithmetic, is what a decode step waits on here (the first H200 runs: a
// megakernel step grew by ~15 µs per layer from 6 to 34 keys of context), so each lane reads
// its key's row 16 bytes at a time where head_dim % 8 == 0, and the value loop keeps 8 keys'
// loads in flight (each key's row offset computed once, by the lane that scored it, and
// shuffled). Every score and every accumulator still sums in the same order as one key and
// one column at a time: the results are the same bits. On an H200 the per-op decode (which
// changed in nothing else) went from 437 to 510 tokens/s on the SmolLM2-135M shape and from 449
// to 501 on the Llama-3.2-1B shape at batch 1, tg64 (docs/gpu-results.md).
// attend_tiles where keys [slo, shi) (a subset of the range, possibly empty) are read from `sk`
// and `sv` instead of the cache: their K and V rows, `head_dim` elements each, key slo first --
// a copy of those rows in shared memory (the megakernel stages a tile's earlier keys there
// before the tile's wait, mk_stage_attention). The same values, so the same bits. Each lane
// shuffles its key's V row pointer rather than its row offset, so one loop serves both.
__device__ __forceinline__ void attend_tiles_from(const float* qs, const AttKv& kv, int head_dim,
                                                  float scale, int lo, int hi, int first,
                                                  int step, float& m, float& l,
                                                  float acc[ATT_PER_LANE],
                                                  const unsigned short* sk,
                                                  const unsigned short* sv, int slo, int shi) {
    const int lane = threadIdx.x & 31;
    const bool wide = (head_dim & 7) == 0;
    for (int j0 = lo + first * 32; j0 < hi; j0 += step * 32) {
        const int j = j0 + lane;
        float s = KILN_NEG_INF;
        const unsigned short* vr = nullptr;
        if (j < hi) {
            const unsigned short* kr;
            if (j >= slo && j < shi) {
                kr = sk + (size_t)(j - slo) * head_dim;
                vr = sv + (size_t)(j - slo) * head_dim;
            } else {
                const size_t row = att_row(kv, j, head_dim);
                kr = kv.k + row;
                vr = kv.v + row;
            }
            float d = 0.0f;
            if (wide) {
                // Rows are 16-byte aligned: head_dim % 8 == 0 and every run starts at a
                // multiple of head_dim elements of an aligned allocation (or buffer).
                const uint4* k8 = reinterpret_cast<const uint4*>(kr);
#pragma unroll 4
                for (int c8 = 0; c8 < (head_dim >> 3); ++c8) {
                    const uint4 u = k8[c8];
                    const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
                    for (int h = 0; h < 4; ++h) {
                        d = fmaf(qs[8 * c8 + 2 * h], kv_bits_f32(w[h] << 16), d);
                        d = fmaf(qs[8 * c8 + 2 * h + 1], kv_bits_f32(w[h] & 0xffff0000u), d);
                    }
                }
            } else {
                for (int c = 0; c < head_dim; ++c) d = fmaf(qs[c], kv_bf16_to_f32(kr[c]), d);
            }
            s = d * scale;
        }
        const float tile_max = warp_max(s);
        const float new_m = fmaxf(m, tile_max);
        const float corr = (m == KILN_NEG_INF) ? 0.0f : expf(m - new_m);
        const float p = (j < hi) ? expf(s - new_m) : 0.0f;
        l = l * corr + warp_sum(p);
        const int n = min(32, hi - j0);
        const unsigned long long vbits = reinterpret_cast<unsigned long long>(vr);
#pragma unroll
        for (int i = 0; i < ATT_PER_LANE; ++i) {
            acc[i] *= corr;
            const int c = lane + 32 * i;
            if (32 * i < head_dim) {  // uniform: the lane's columns are lane + 32 i
                float a = acc[i];
#pragma unroll 8
                for (int jj = 0; jj < n; ++jj) {
                    const float pj = __shfl_sync(KILN_FULL_MASK, p, jj);
                    const unsigned short* vj = reinterpret_cast<const unsigned short*>(
                        __shfl_sync(KILN_FULL_MASK, vbits, jj));
                    if (c < head_dim) a = fmaf(pj, kv_bf16_to_f32(vj[c]), a);
                }
                acc[i] = a;
            }
        }
        m = new_m;
    }
}

// Every key from the cache.
__device__ __forceinline__ void attend_tiles(const float* qs, const AttKv& kv, int head_dim,
                                             float scale, int lo, int hi, int first, int step,
                                             float& m, float& l, float acc[ATT_PER_LANE]) {
    attend_tiles_from(qs, kv, head_dim, scale, lo, hi, first, step, m, l, acc, nullptr, nullptr,
                      0, 0);
}

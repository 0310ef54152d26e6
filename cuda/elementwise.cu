// elementwise.cu: the element-wise and row ops of the graph, with the formulas of
// src/backend/cpu/{elementwise.rs,exec.rs}:
//  add / mul / combine (a*x + b*y) / act (SiLU, relu^2) / softcap (cap * tanh(x / cap)) /
//  gated_rows (out = act(g[:f]) * g[f:], the prefill Gated epilogue) over [rows, n] views;
//  gated_value_add (nanochat value embeddings), smear (nanochat bigram smear, with the
//  per-position state kept on the device), gather_rows (Op::LastRow).
// All matrix kernels: grid (ceil(n / 256), rows), block 256; inputs and output may alias.
// Ran on an H200 (docs/gpu-results.md): the per-op path matched the CPU's logits on every
// fixture (nanochat's included) within bf16 tolerance.
#include "common.cuh"
#include "kv.cuh"

extern "C" __global__ void add_rows(const float* a, int a_stride, const float* b, int b_stride,
                                    float* out, int out_stride, int n) {
    const int t = blockIdx.y, i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[(size_t)t * out_stride + i] = a[(size_t)t * a_stride + i] + b[(size_t)t * b_stride + i];
}

extern "C" __global__ void mul_rows(const float* a, int a_stride, const float* b, int b_stride,
                                    float* out, int out_stride, int n) {
    const int t = blockIdx.y, i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[(size_t)t * out_stride + i] = a[(size_t)t * a_stride + i] * b[(size_t)t * b_stride + i];
}

extern "C" __global__ void combine_rows(const float* x, int x_stride, const float* y, int y_stride,
                                        float* out, int out_stride, int n, float a, float b) {
    const int t = blockIdx.y, i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[(size_t)t * out_stride + i] = a * x[(size_t)t * x_stride + i] + b * y[(size_t)t * y_stride + i];
}

extern "C" __global__ void act_rows(const float* x, int x_stride, float* out, int out_stride,
                                    int n, int act) {
    const int t = blockIdx.y, i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[(size_t)t * out_stride + i] = kiln_act_any(act, x[(size_t)t * x_stride + i]);
}

extern "C" __global__ void softcap_rows(const float* x, int x_stride, float* out, int out_stride,
                                        int n, float cap) {
    const int t = blockIdx.y, i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[(size_t)t * out_stride + i] = cap * tanhf(x[(size_t)t * x_stride + i] / cap);
}

// g is [rows, 2f] (gate then up); out is [rows, f].
extern "C" __global__ void gated_rows(const float* g, int g_stride, float* out, int out_stride,
                                      int f, int act) {
    const int t = blockIdx.y, i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < f) {
        const float* gr = g + (size_t)t * g_stride;
        out[(size_t)t * out_stride + i] = kiln_act_any(act, gr[i]) * gr[i + f];
    }
}

// out = v + scale * sigmoid(h[:channels] . wg[g]) * ve, per KV head g (head_dim dims each).
// Grid: (rows), block: 32 * kv_heads (one warp per KV head; kv_heads <= 32).
extern "C" __global__ void gated_value_add(const float* v, int v_stride, const float* h,
                                           int h_stride, const float* ve, int ve_stride,
                                           const float* __restrict__ wg, float* out,
                                           int out_stride, int channels, int kv_heads,
                                           int head_dim, float scale) {
    const int t = blockIdx.x, g = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (g >= kv_heads) return;
    const float* hr = h + (size_t)t * h_stride;
    float z = 0.0f;
    for (int c = lane; c < channels; c += 32) z += hr[c] * wg[(size_t)g * channels + c];
    z = warp_sum(z);
    const float gv = scale / (1.0f + expf(-z));
    for (int d = lane; d < head_dim; d += 32) {
        const int c = g * head_dim + d;
        out[(size_t)t * out_stride + c] = v[(size_t)t * v_stride + c] + gv * ve[(size_t)t * ve_stride + c];
    }
}

// x_t = e_t + lambda * sigmoid(w . e_t[:channels]) * prev, where prev is the step's previous row
// when it belongs to the same slot, else the state cache at (slot, pos - 1), else nothing.
// Then every row's pre-smear e_t is stored as the state at (slot, pos). The state is kv.cuh's
// `[block][block_size][state_dim]`, found through the slot's page table (`tables`, `max_blocks`
// ints per slot).
// Grid: (rows), block: 256. `out` must not alias `e` (rows read their neighbours).
// The state writes of row t can only hit positions >= the step's first position of that slot,
// and the only state read is at the first position - 1, so one launch is race-free.
extern "C" __global__ void smear(const float* __restrict__ e, int e_stride,
                                 const float* __restrict__ w, float* __restrict__ out,
                                 int out_stride, float* __restrict__ state, int state_dim,
                                 const int* __restrict__ tables, int max_blocks, int block_size,
                                 const int* __restrict__ row_slot,
                                 const int* __restrict__ row_pos, int n, int channels,
                                 float lambda) {
    const int t = blockIdx.x;
    const float* er = e + (size_t)t * e_stride;
    const int slot = row_slot[t], pos = row_pos[t];
    const int* table = tables + (size_t)slot * max_blocks;
    float z = 0.0f;
    for (int c = threadIdx.x; c < channels; c += blockDim.x) z += er[c] * w[c];
    z = block_sum(z);
    const float gsm = lambda / (1.0f + expf(-z));
    const float* prev = nullptr;
    if (t > 0 && row_slot[t - 1] == slot) {
        prev = e + (size_t)(t - 1) * e_stride;
    } else if (pos > 0) {
        prev = state + kv_pos_state(table, block_size, state_dim, pos - 1);
    }
    float* o = out + (size_t)t * out_stride;
    for (int i = threadIdx.x; i < n; i += blockDim.x) o[i] = prev ? er[i] + gsm * prev[i] : er[i];
    __syncthreads();
    float* st = state + kv_pos_state(table, block_size, state_dim, pos);
    for (int i = threadIdx.x; i < state_dim && i < n; i += blockDim.x) st[i] = er[i];
}

// out[s, :] = x[idx[s], :]. Grid: (ceil(n / 256), sequences), block 256.
extern "C" __global__ void gather_rows(const float* __restrict__ x, int x_stride,
                                       const int* __restrict__ idx, float* __restrict__ out,
                                       int out_stride, int n) {
    const int s = blockIdx.y, i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[(size_t)s * out_stride + i] = x[(size_t)idx[s] * x_stride + i];
}

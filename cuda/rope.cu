// rope.cu: Op::Rope in the three RopeStyles of src/model/config.rs. Angles are computed on the
// device exactly as src/backend/cpu/rope.rs does on the host: a = (float)pos * inv_freq[i] in f32,
// then cos/sin in double rounded to f32, so positions can come from a device counter.
// Ran on an H200 (docs/gpu-results.md): logits matched the CPU's on every fixture, which use all
// three styles (HF half-split, GGUF interleaved, nanochat negated).
#include "common.cuh"

#define KILN_ROPE_HALF_SPLIT 0
#define KILN_ROPE_INTERLEAVED 1
#define KILN_ROPE_HALF_SPLIT_NEGATED 2

// One thread per (row, head, pair). Grid: ceil(rows * heads * head_dim/2 / 256), block 256.
// `x` and `out` may alias (in-place rotation).
extern "C" __global__ void rope(const float* x, int x_stride, float* out, int out_stride,
                                const int* __restrict__ row_pos,
                                const float* __restrict__ inv_freq, int rows, int heads,
                                int head_dim, int style) {
    const int half = head_dim / 2;
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)rows * heads * half) return;
    const int i = (int)(idx % half);
    const int h = (int)((idx / half) % heads);
    const int t = (int)(idx / ((long long)half * heads));
    const float a = (float)row_pos[t] * inv_freq[i];
    const float c = (float)cos((double)a), s = (float)sin((double)a);
    const float* xh = x + (size_t)t * x_stride + (size_t)h * head_dim;
    float* oh = out + (size_t)t * out_stride + (size_t)h * head_dim;
    int i0, i1;
    if (style == KILN_ROPE_INTERLEAVED) {
        i0 = 2 * i;
        i1 = 2 * i + 1;
    } else {
        i0 = i;
        i1 = i + half;
    }
    const float p = xh[i0], q = xh[i1];
    if (style == KILN_ROPE_HALF_SPLIT_NEGATED) {
        oh[i0] = p * c + q * s;
        oh[i1] = q * c - p * s;
    } else {
        oh[i0] = p * c - q * s;
        oh[i1] = q * c + p * s;
    }
}

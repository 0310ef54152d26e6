// rmsnorm.cu: Op::RmsNorm (with or without an f32 weight), the MatMul norm prologue, and
// Op::HeadNorm (per-head RMSNorm without weight, times `scale`). Statistics in f32, exactly the
// formula of src/backend/cpu/norm.rs: x * (1 / sqrt(mean(x^2) + eps)) [* w].
// Ran on an H200 (docs/gpu-results.md): the per-op path matched the CPU's logits on every
// fixture within bf16 tolerance (tests/gpu.rs).
#include "common.cuh"

// Grid: (rows), block: 256 threads. `w` may be null (no weight). `x` and `out` may alias.
extern "C" __global__ void rms_norm(const float* x, int x_stride, const float* __restrict__ w,
                                    float eps, float* out, int out_stride, int n) {
    const float* xr = x + (size_t)blockIdx.x * x_stride;
    float* o = out + (size_t)blockIdx.x * out_stride;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) ss += xr[i] * xr[i];
    ss = block_sum(ss);
    const float inv = 1.0f / sqrtf(ss / (float)n + eps);
    if (w != nullptr) {
        for (int i = threadIdx.x; i < n; i += blockDim.x) o[i] = w[i] * (xr[i] * inv);
    } else {
        for (int i = threadIdx.x; i < n; i += blockDim.x) o[i] = xr[i] * inv;
    }
}

// One warp per (row, head). Grid: (ceil(rows * heads / 4)), block: 128 threads.
// `w` (nullable) is a [head_dim] weight shared by the heads (Qwen3/Gemma 3 q/k norm); the
// weighted form ran on an H200 in the qwen3 and gemma3 fixtures, whose logits matched the CPU's.
extern "C" __global__ void head_norm(const float* x, int x_stride, float* out, int out_stride,
                                     int rows, int heads, int head_dim, float eps, float scale,
                                     const float* w) {
    const int task = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (task >= rows * heads) return;
    const int t = task / heads, h = task % heads;
    const float* xr = x + (size_t)t * x_stride + (size_t)h * head_dim;
    float* o = out + (size_t)t * out_stride + (size_t)h * head_dim;
    float ss = 0.0f;
    for (int i = lane; i < head_dim; i += 32) ss += xr[i] * xr[i];
    ss = warp_sum(ss);
    const float inv = 1.0f / sqrtf(ss / (float)head_dim + eps);
    for (int i = lane; i < head_dim; i += 32) {
        float v = xr[i] * inv;
        if (scale != 1.0f) v *= scale;
        if (w) v *= w[i];
        o[i] = v;
    }
}

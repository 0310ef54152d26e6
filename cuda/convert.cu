// convert.cu: the glue around cuBLAS for the prefill matmul (many token rows).
//
//  f32_to_bf16_rows  the f32 activation rows (row stride x_stride) to a dense bf16 [rows, cols]
//                    copy, cuBLAS's B operand (round to nearest even, as the CPU's bf16).
//  gemm_epilogue     cuBLAS's f32 product c [rows, n or 2n] (row stride c_stride) to the plan's
//                    output: + bias, then epilogue 0 None, 1 ResidualAdd (residual may alias
//                    out: each element is read then written by one thread), 2 Activation,
//                    3 Gated (n = f: out = act(c[:f] + b[:f]) * (c[f:] + b[f:])).
// Grid: (ceil(cols / 256), rows), block: 256. Ran on an H200 (docs/gpu-results.md): prefill
// through cuBLAS matched the CPU's logits on every fixture (tests/gpu.rs).
#include "common.cuh"

extern "C" __global__ void f32_to_bf16_rows(const float* __restrict__ x, int x_stride,
                                            __nv_bfloat16* __restrict__ out, int cols) {
    const int t = blockIdx.y, i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < cols) out[(size_t)t * cols + i] = __float2bfloat16_rn(x[(size_t)t * x_stride + i]);
}

extern "C" __global__ void gemm_epilogue(const float* __restrict__ c, int c_stride,
                                         const float* __restrict__ bias, float* out,
                                         int out_stride, const float* residual, int res_stride,
                                         int n, int epilogue, int act) {
    const int t = blockIdx.y, i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float* cr = c + (size_t)t * c_stride;
    float v = cr[i] + (bias ? bias[i] : 0.0f);
    if (epilogue == 1) {
        v += residual[(size_t)t * res_stride + i];
    } else if (epilogue == 2) {
        v = kiln_act_any(act, v);
    } else if (epilogue == 3) {
        const float up = cr[i + n] + (bias ? bias[i + n] : 0.0f);
        v = kiln_act_any(act, v) * up;
    }
    out[(size_t)t * out_stride + i] = v;
}

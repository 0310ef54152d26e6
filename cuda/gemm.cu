// gemm.cu: the prefill matmul (many token rows): C[t, r] = sum_k X[t, k] W[r, k] (+ bias[r]),
// bf16 W [rows, k], f32 X and accumulation. A plain shared-memory tiled kernel (64 x 64 tile,
// 16-deep K slices, 4 x 4 outputs per thread): the fallback when libcublas cannot be loaded
// (the host otherwise runs cublasGemmEx with convert.cu around it). Epilogues 0 None,
// 1 ResidualAdd, 2 Activation; the host runs Gated as None into scratch followed by
// elementwise.cu's `gated_rows`.
// Ran on an H200 (docs/gpu-results.md): a 40-row prefill through this kernel (cuBLAS switched
// off) matched the CPU's logits on every fixture (tests/gpu.rs).
#include "common.cuh"

#define GEMM_BM 64
#define GEMM_BN 64
#define GEMM_BK 16

// Grid: (ceil(rows / 64), ceil(n_tok / 64)), block: 256.
extern "C" __global__ void __launch_bounds__(256)
gemm_bf16(const __nv_bfloat16* __restrict__ w, int rows, int k, const float* __restrict__ x,
          int x_stride, int n_tok, const float* __restrict__ bias, float* out, int out_stride,
          const float* residual, int res_stride, int epilogue, int act) {
    __shared__ float xs[GEMM_BK][GEMM_BM + 1];
    __shared__ float ws[GEMM_BK][GEMM_BN + 1];
    const int tid = threadIdx.x;
    const int tx = tid % 16, ty = tid / 16;  // 16 x 16 threads, 4 x 4 outputs each
    const int row0 = blockIdx.x * GEMM_BN;     // weight rows (output columns)
    const int tok0 = blockIdx.y * GEMM_BM;     // token rows
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;

    for (int kb = 0; kb < k; kb += GEMM_BK) {
        // 64 x 16 elements of each operand, 4 per thread.
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int idx = tid + e * 256;
            const int r = idx / GEMM_BK, c = idx % GEMM_BK;
            const int tok = tok0 + r, wr = row0 + r, kc = kb + c;
            xs[c][r] = (tok < n_tok && kc < k) ? x[(size_t)tok * x_stride + kc] : 0.0f;
            ws[c][r] = (wr < rows && kc < k) ? __bfloat162float(w[(size_t)wr * k + kc]) : 0.0f;
        }
        __syncthreads();
#pragma unroll
        for (int c = 0; c < GEMM_BK; ++c) {
            float a[4], b[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) a[i] = xs[c][ty * 4 + i];
#pragma unroll
            for (int j = 0; j < 4; ++j) b[j] = ws[c][tx * 4 + j];
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int tok = tok0 + ty * 4 + i;
        if (tok >= n_tok) continue;
        float* o = out + (size_t)tok * out_stride;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int r = row0 + tx * 4 + j;
            if (r >= rows) continue;
            float v = acc[i][j] + (bias ? bias[r] : 0.0f);
            if (epilogue == 1) {
                v += residual[(size_t)tok * res_stride + r];
            } else if (epilogue == 2) {
                v = kiln_act_any(act, v);
            }
            o[r] = v;
        }
    }
}

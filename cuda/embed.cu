// embed.cu: Op::Embed. out[t, :] = table[tokens[t], :] (bf16 table widened to f32).
// Grid: (n_tok), block: 256 threads. Ran on an H200 (docs/gpu-results.md): the per-op path
// matched the CPU's logits on every fixture.
#include "common.cuh"

extern "C" __global__ void embed_bf16(const u32* __restrict__ tokens,
                                      const __nv_bfloat16* __restrict__ table,
                                      float* __restrict__ out, int dim, int out_stride) {
    const int t = blockIdx.x;
    const u32 id = tokens[t];
    const __nv_bfloat16* src = table + (size_t)id * dim;
    float* dst = out + (size_t)t * out_stride;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) dst[i] = __bfloat162float(src[i]);
}

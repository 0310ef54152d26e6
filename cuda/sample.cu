// sample.cu: the per-op device sampler (the megakernel samples in its Sample tiles instead):
// one block per row picks the row's next token with kiln_sample_row (sample.cuh), the algorithm
// of `kiln::sample::sample` -- greedy when ctl[r].temperature == 0, else temperature with top-k
// (any k), min-p and top-p over the full vocabulary, drawn with Philox-4x32-10
// uniform(ctl[r].seed, ctl[r].row_id, positions[r]). Each row has its own MkRow, so rows with
// different sampling parameters share a launch. See sample.cuh for where it can differ from the
// CPU (only by rounding at a boundary).
// Ran on an H200 (sm_90; sm_80 is compiled only; docs/gpu-results.md): on the same logits it
// picks the host sampler's tokens (tests/gpu.rs), and seeded sampling reproduces across runs.
#include "common.cuh"
#include "sample.cuh"

// Grid: (rows), block: SAMPLE_THREADS (256). Row r's logits are logits[r * stride, + vocab), its
// controls ctl[r] (one MkRow per row: parameters, seed, Philox row). `work` (rows * vocab
// floats in the launch contract) is not needed by this algorithm, which keeps its state in
// shared memory; it may be null. The minimum of 1 block per SM keeps ptxas from capping the
// registers for occupancy (it spilled at 48 on sm_90); a call has one block per row anyway.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS, 1)
sample_rows(const float* __restrict__ logits, int stride, int vocab,
            const MkRow* __restrict__ ctl, const int* __restrict__ positions, float* work,
            int* tokens_out) {
    (void)work;
    const int r = blockIdx.x;
    const MkRow* c = ctl + r;
    const int t = kiln_sample_row(logits + (size_t)r * stride, vocab, c, (u32)c->row_id,
                                  (u64)(u32)positions[r]);
    if (threadIdx.x == 0) tokens_out[r] = t;
}

// Grid: (rows, ceil(vocab / 256)), block: 256. Before `sample_rows` draws, a row with an allowed
// set (a grammar's token mask) has every token outside it set to -inf, as the host's
// `Constraint::apply` does: mask_at[r] < 0 leaves row r as it is, else token i is allowed when
// bit i % 32 of masks[mask_at[r] + i / 32] is set (tokens past the set's `mask_words` words are
// not). -inf weighs 0 in the sampler and never wins a greedy pick, so the draw is the host's on
// the masked logits (up to sample.cuh's rounding cases). On an H200 (runs 10, 11) and an H100
// (run 12) `tests/gpu.rs::masked_device_draws_match_the_host_sampler_on_masked_logits` passed.
extern "C" __global__ void mask_rows(float* logits, int stride, int vocab, const u32* masks,
                                     const int* mask_at, int mask_words) {
    const int r = blockIdx.x;
    const int i = blockIdx.y * blockDim.x + threadIdx.x;
    const int at = mask_at[r];
    if (at < 0 || i >= vocab) return;
    const int w = i >> 5;
    const bool allowed = w < mask_words && ((masks[at + w] >> (i & 31)) & 1u);
    if (!allowed) logits[(size_t)r * stride + i] = KILN_NEG_INF;
}

// kv.cuh: the KV cache's one layout (src/kv/layout.rs) and its storage types
// (src/kv/storage.rs) on the device. Every kernel that reads or writes the cache -- kv_append,
// the attention kernels, smear, the megakernel tiles -- addresses it through these functions.
//
// Memory is a pool of blocks of `block_size` consecutive positions of one sequence. K and V are
// two arrays of the storage type, each `[block][layer][kv_head][block_size][head_dim]`; the
// per-position state (nanochat's smear input) is f32 `[block][block_size][state_dim]`. A
// sequence's page table (int32, one entry per block of the sequence, in position order) maps
// position p to block table[p / block_size], offset p % block_size. Grouped 8-bit storage (q8)
// keeps one f32 scale per KV_Q8_GROUP consecutive elements in a parallel array indexed
// element / KV_Q8_GROUP.
//
// The functions are constexpr so the host can check them at compile time: the test
// `kv_cuh_agrees_with_src_kv` (tests/nvrtc_compile.rs) compiles this header with NVRTC together
// with static_asserts whose expected values Rust computed with src/kv (addresses of sample
// positions through scrambled page tables, and the encodings of sample values, ties and
// edge cases included). On an H200 (docs/gpu-results.md) the layout functions and the bf16
// conversions ran in the kernels above, per-op and megakernel, with logits matching the CPU's
// and compute-sanitizer's memcheck clean on a fixture; the f32, f16, fp8 and q8 storage
// functions have no device caller yet and are checked at compile time only.
#pragma once

// Values per scale of q8 storage (storage.rs Q8_GROUP).
#define KV_Q8_GROUP 32

// ---- layout (layout.rs) -------------------------------------------------------------------

// Elements between one block's run of a (layer, kv head) and the next block's: a whole block.
constexpr size_t kv_block_stride(int layers, int kv_heads, int block_size, int head_dim) {
    return (size_t)layers * kv_heads * block_size * head_dim;
}

// First element of (layer, block, head)'s block_size x head_dim run (KvLayout::head_block).
constexpr size_t kv_head_block(int layers, int kv_heads, int block_size, int head_dim, int layer,
                               int block, int head) {
    return (((size_t)block * layers + layer) * kv_heads + head) * ((size_t)block_size * head_dim);
}

// First element of one position's row of one head (KvLayout::row).
constexpr size_t kv_row(int layers, int kv_heads, int block_size, int head_dim, int layer,
                        int block, int head, int offset) {
    return kv_head_block(layers, kv_heads, block_size, head_dim, layer, block, head) +
           (size_t)offset * head_dim;
}

// First f32 of one position's state (KvLayout::state_row).
constexpr size_t kv_state_row(int block_size, int state_dim, int block, int offset) {
    return ((size_t)block * block_size + offset) * state_dim;
}

// Row of position `pos` of the sequence whose page table is `table` (KvLayout::locate, then
// KvLayout::row).
constexpr size_t kv_pos_row(const int* table, int layers, int kv_heads, int block_size,
                            int head_dim, int layer, int head, int pos) {
    return kv_row(layers, kv_heads, block_size, head_dim, layer, table[pos / block_size], head,
                  pos % block_size);
}

// State of position `pos` of the sequence whose page table is `table`.
constexpr size_t kv_pos_state(const int* table, int block_size, int state_dim, int pos) {
    return kv_state_row(block_size, state_dim, table[pos / block_size], pos % block_size);
}

// ---- storage types (storage.rs) -----------------------------------------------------------

constexpr unsigned kv_f32_bits(float x) { return __builtin_bit_cast(unsigned, x); }
constexpr float kv_bits_f32(unsigned b) { return __builtin_bit_cast(float, b); }

// f32 -> bf16 bits, round to nearest even; NaN stays NaN (quiet bit set). The same steps as
// the `half` crate's bf16::from_f32, which src/kv/storage.rs uses.
constexpr unsigned short kv_f32_to_bf16(float v) {
    const unsigned x = kv_f32_bits(v);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((x >> 16) | 0x0040u);
    const unsigned round_bit = 0x8000u;
    if ((x & round_bit) != 0u && (x & (3u * round_bit - 1u)) != 0u)
        return (unsigned short)((x >> 16) + 1u);
    return (unsigned short)(x >> 16);
}

constexpr float kv_bf16_to_f32(unsigned short b) { return kv_bits_f32((unsigned)b << 16); }

// f32 -> f16 bits, round to nearest even, overflow to +-inf, subnormals rounded: the steps of
// the `half` crate's f16::from_f32 (its software path; the F16C path rounds the same way).
constexpr unsigned short kv_f32_to_f16(float value) {
    const unsigned x = kv_f32_bits(value);
    const unsigned sign = x & 0x80000000u;
    const unsigned exp = x & 0x7f800000u;
    const unsigned man = x & 0x007fffffu;
    if (exp == 0x7f800000u) {
        const unsigned nan_bit = man == 0u ? 0u : 0x0200u;
        return (unsigned short)((sign >> 16) | 0x7c00u | nan_bit | (man >> 13));
    }
    const unsigned half_sign = sign >> 16;
    const int half_exp = (int)(exp >> 23) - 127 + 15;
    if (half_exp >= 0x1f) return (unsigned short)(half_sign | 0x7c00u);
    if (half_exp <= 0) {
        if (14 - half_exp > 24) return (unsigned short)half_sign;
        const unsigned m = man | 0x00800000u;
        unsigned half_man = m >> (14 - half_exp);
        const unsigned round_bit = 1u << (13 - half_exp);
        if ((m & round_bit) != 0u && (m & (3u * round_bit - 1u)) != 0u) half_man += 1u;
        return (unsigned short)(half_sign | half_man);
    }
    const unsigned half_man = man >> 13;
    const unsigned bits = half_sign | ((unsigned)half_exp << 10) | half_man;
    const unsigned round_bit = 0x1000u;
    if ((man & round_bit) != 0u && (man & (3u * round_bit - 1u)) != 0u)
        return (unsigned short)(bits + 1u);
    return (unsigned short)bits;
}

constexpr float kv_f16_to_f32(unsigned short h) {
    const unsigned sign = ((unsigned)h & 0x8000u) << 16;
    const unsigned e = ((unsigned)h >> 10) & 0x1fu;
    const unsigned m = (unsigned)h & 0x3ffu;
    if (e == 0u) {
        // Zero or subnormal: m * 2^-24, exact in f32.
        const float mag = (float)m * (1.0f / 16777216.0f);
        return sign ? -mag : mag;
    }
    if (e == 0x1fu) return kv_bits_f32(sign | (m ? 0x7fc00000u : 0x7f800000u) | (m << 13));
    return kv_bits_f32(sign | ((e + 112u) << 23) | (m << 13));
}

// Round to nearest, ties to even, of a non-negative float below 2^31 (storage.rs's
// round_ties_even for fp8 subnormals).
constexpr float kv_round_even(float y) {
    const float t = (float)(long long)y;  // truncation; y - t is exact below 2^23
    const float frac = y - t;
    if (frac > 0.5f) return t + 1.0f;
    if (frac == 0.5f && ((long long)t & 1ll)) return t + 1.0f;
    return t;
}

// Round half away from zero (Rust's f32::round) of |y| < 2^31.
constexpr float kv_round_away(float y) {
    const float t = (float)(long long)y;
    const float frac = y - t;
    if (frac >= 0.5f) return t + 1.0f;
    if (frac <= -0.5f) return t - 1.0f;
    return t;
}

// Largest finite e4m3 value (storage.rs FP8_MAX).
#define KV_FP8_MAX 448.0f

// f32 -> e4m3 ("fn": no infinities, NaN = S.1111.111), round to nearest even, saturating at
// +-448 (storage.rs f32_to_fp8, step for step).
constexpr unsigned char kv_f32_to_fp8(float x) {
    if (x != x) return 0x7f;
    const unsigned char sign = (kv_f32_bits(x) >> 31) ? 0x80 : 0x00;
    const float a = kv_bits_f32(kv_f32_bits(x) & 0x7fffffffu);
    if (a >= KV_FP8_MAX) return (unsigned char)(sign | 0x7e);
    const unsigned bits = kv_f32_bits(a);
    const int exp = (int)(bits >> 23) - 127;
    if (exp < -6) {
        // Subnormal or zero: steps of 2^-9; a * 512 is exact.
        return (unsigned char)(sign | (unsigned char)kv_round_even(a * 512.0f));
    }
    const unsigned mant = bits & 0x7fffffu;
    unsigned q = ((unsigned)(exp + 7) << 3) | (mant >> 20);
    const unsigned rem = mant & 0xfffffu;
    const unsigned half = 0x80000u;
    if (rem > half || (rem == half && (q & 1u) == 1u)) q += 1u;
    return (unsigned char)(sign | (q < 0x7eu ? q : 0x7eu));
}

// e4m3 -> f32 (exact; storage.rs fp8_to_f32).
constexpr float kv_fp8_to_f32(unsigned char b) {
    const bool neg = (b & 0x80) != 0;
    const unsigned e = (b >> 3) & 0xfu;
    const unsigned m = b & 7u;
    float mag = 0.0f;
    if (e == 0u) {
        mag = (float)m * (1.0f / 512.0f);
    } else if (e == 15u && m == 7u) {
        return kv_bits_f32(0x7fc00000u);
    } else {
        mag = kv_bits_f32(((e - 7u + 127u) << 23) | (m << 20));
    }
    return neg ? -mag : mag;
}

// q8: the scale of a group whose largest magnitude is `amax` (storage.rs encode_row, Q8).
constexpr float kv_q8_scale(float amax) { return amax / 127.0f; }

// q8: one value of a group with scale `scale`: round(x / scale) (half away from zero),
// clamped to [-127, 127]; a zero scale stores 0.
constexpr signed char kv_q8_quant(float x, float scale) {
    const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
    const float y = x * inv;
    if (y != y) return 0;
    const float r = kv_round_away(y < -128.0f ? -128.0f : (y > 128.0f ? 128.0f : y));
    return (signed char)(r < -127.0f ? -127.0f : (r > 127.0f ? 127.0f : r));
}

constexpr float kv_q8_dequant(signed char q, float scale) { return (float)q * scale; }

// ---- device loads and stores of the GPU's storage types -----------------------------------

// bf16 (the GPU default): element i of a bf16 array.
__device__ __forceinline__ float kv_load_bf16(const unsigned short* p, size_t i) {
    return kv_bf16_to_f32(p[i]);
}
__device__ __forceinline__ void kv_store_bf16(unsigned short* p, size_t i, float x) {
    p[i] = kv_f32_to_bf16(x);
}

__device__ __forceinline__ float kv_load_f32(const float* p, size_t i) { return p[i]; }
__device__ __forceinline__ void kv_store_f32(float* p, size_t i, float x) { p[i] = x; }

__device__ __forceinline__ float kv_load_f16(const unsigned short* p, size_t i) {
    return kv_f16_to_f32(p[i]);
}
__device__ __forceinline__ void kv_store_f16(unsigned short* p, size_t i, float x) {
    p[i] = kv_f32_to_f16(x);
}

__device__ __forceinline__ float kv_load_fp8(const unsigned char* p, size_t i) {
    return kv_fp8_to_f32(p[i]);
}
__device__ __forceinline__ void kv_store_fp8(unsigned char* p, size_t i, float x) {
    p[i] = kv_f32_to_fp8(x);
}

__device__ __forceinline__ float kv_load_q8(const signed char* p, const float* scales, size_t i) {
    return kv_q8_dequant(p[i], scales[i / KV_Q8_GROUP]);
}

// Stores one q8 group: called by a whole warp, lane j holding element j of the group starting
// at element `i0` (a multiple of KV_Q8_GROUP); the warp's max magnitude sets the scale.
__device__ __forceinline__ void kv_store_q8_group(signed char* p, float* scales, size_t i0,
                                                  float x) {
    float amax = fabsf(x);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float scale = kv_q8_scale(amax);
    p[i0 + (threadIdx.x & 31)] = kv_q8_quant(x, scale);
    if ((threadIdx.x & 31) == 0) scales[i0 / KV_Q8_GROUP] = scale;
}

//! The NVRTC compile gate: every file of `cuda/` must compile, with no warning, to cubins for
//! sm_90 and sm_80, and the hot kernels (GEMV, GEMM, attention) must not spill registers.
//!
//! Needs NVRTC and the CUDA headers, which CI installs from PyPI (`.ci/run`:
//! `pip install --target .ci/nvrtc nvidia-cuda-nvrtc nvidia-cuda-runtime`, then
//! `KILN_NVRTC_DIR=.ci/nvrtc`); a toolkit under `CUDA_HOME` or `/usr/local/cuda` works too.
//! Without them the test prints `SKIPPED` and passes. No GPU is needed.
#![cfg(feature = "cuda")]

use kiln::backend::cuda::kernels::{NO_SPILL, SOURCES};
use kiln::backend::cuda::nvrtc;

#[test]
fn every_cuda_source_compiles_for_sm90_and_sm80_without_spills() {
    if let Err(e) = nvrtc::ensure_loaded() {
        println!("SKIPPED nvrtc compile gate: {e}");
        return;
    }
    let Some(include) = nvrtc::find_include_dir() else {
        println!(
            "SKIPPED nvrtc compile gate: cuda_bf16.h not found (set KILN_NVRTC_DIR or CUDA_HOME)"
        );
        return;
    };
    let (major, minor) = nvrtc::version().expect("NVRTC loaded but nvrtcVersion failed");
    println!("NVRTC {major}.{minor}, headers from {}", include.display());
    let mut failures = Vec::new();
    println!(
        "{:<6} {:<22} {:<20} {:>5} {:>7} {:>6} {:>7} {:>7}",
        "arch", "file", "kernel", "regs", "smem", "stack", "spill_st", "spill_ld"
    );
    for arch in [90u32, 80] {
        for src in SOURCES {
            let c = match nvrtc::compile(src, arch, &include) {
                Ok(c) => c,
                Err(e) => {
                    failures.push(e.to_string());
                    continue;
                }
            };
            assert!(!c.cubin.is_empty(), "{}: empty cubin", src.file);
            for k in src.kernels {
                match c.kernels.iter().find(|r| r.name == *k) {
                    None => failures.push(format!(
                        "{} sm_{arch}: no ptxas report for kernel {k}\n{}",
                        src.file, c.log
                    )),
                    Some(r) => {
                        println!(
                            "sm_{arch:<3} {:<22} {:<20} {:>5} {:>7} {:>6} {:>7} {:>7}",
                            src.file,
                            k,
                            r.registers,
                            r.shared_bytes,
                            r.stack_bytes,
                            r.spill_stores,
                            r.spill_loads
                        );
                        if NO_SPILL.contains(k) && (r.spill_stores > 0 || r.spill_loads > 0) {
                            failures.push(format!(
                                "{} sm_{arch}: kernel {k} spills ({} bytes stored, {} loaded)",
                                src.file, r.spill_stores, r.spill_loads
                            ));
                        }
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

/// `cuda/kv.cuh` and `src/kv` agree: kv.cuh's constexpr address and encoding functions are
/// compiled by NVRTC with `static_assert`s whose expected values come from `src/kv` (addresses of
/// positions through scrambled page tables in several layouts; bf16/f16/fp8/q8 encodings of
/// sampled values with ties, subnormals, overflow and NaN; decodings of every bf16/fp8 code and
/// sampled f16 codes). A mismatch fails the compile. A control run with one expected value
/// changed must fail, so the asserts are live.
#[test]
fn kv_cuh_agrees_with_src_kv() {
    use kiln::backend::cuda::kernels::KV_CUH;
    if let Err(e) = nvrtc::ensure_loaded() {
        println!("SKIPPED kv.cuh check: {e}");
        return;
    }
    let Some(include) = nvrtc::find_include_dir() else {
        println!("SKIPPED kv.cuh check: CUDA headers not found");
        return;
    };
    let checks = kv_checks();
    let src = |checks: &[String]| format!("{KV_CUH}\n{}\n", checks.join("\n"));
    if let Err(e) = nvrtc::compile_text("kv_check.cu", &src(&checks), 90, &include) {
        panic!("kv.cuh disagrees with src/kv:\n{e}");
    }
    // Control: one expected value off by one must be caught.
    let mut bad = checks.clone();
    let i = bad
        .iter()
        .position(|c| c.contains("kv_pos_row"))
        .expect("an address check");
    bad[i] = bad[i].replacen(" == ", " + 1 == ", 1);
    let e = nvrtc::compile_text("kv_check_bad.cu", &src(&bad), 90, &include)
        .expect_err("a wrong expected address must fail the compile");
    assert!(e.to_string().contains("static assertion"), "{e}");
}

/// The static_asserts of [`kv_cuh_agrees_with_src_kv`].
fn kv_checks() -> Vec<String> {
    use kiln::kv::storage::{decode_row, encode_row, Q8_GROUP};
    use kiln::kv::{KvDtype, KvLayout};
    let mut out = Vec::new();
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        rng = rng.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    // Layouts: (layers, kv_heads, head_dim, block_size, state_dim), tables in scrambled order.
    let shapes = [
        (3, 2, 4, 8, 5, 7),
        (30, 3, 64, 16, 0, 40),
        (1, 1, 128, 1, 96, 9),
        (4, 8, 96, 32, 3, 13),
    ];
    for (n, &(layers, kv_heads, head_dim, block_size, state_dim, num_blocks)) in
        shapes.iter().enumerate()
    {
        let l = KvLayout {
            layers,
            kv_heads,
            head_dim,
            state_dim,
            block_size,
            num_blocks,
            dtype: KvDtype::Bf16,
        };
        l.validate().expect("sample layout");
        let mut table: Vec<u32> = (0..num_blocks as u32).collect();
        for i in (1..table.len()).rev() {
            table.swap(i, (next() % (i as u64 + 1)) as usize);
        }
        let list: Vec<String> = table.iter().map(|b| b.to_string()).collect();
        out.push(format!(
            "constexpr int kv_t{n}[] = {{{}}};",
            list.join(", ")
        ));
        let dims = format!("{layers}, {kv_heads}, {block_size}, {head_dim}");
        out.push(format!(
            "static_assert(kv_block_stride({dims}) == {}ull, \"stride {n}\");",
            l.block_elems()
        ));
        for _ in 0..40 {
            let layer = (next() % layers as u64) as usize;
            let head = (next() % kv_heads as u64) as usize;
            let pos = (next() % (num_blocks * block_size) as u64) as usize;
            let (block, off) = l.locate(&table, pos);
            out.push(format!(
                "static_assert(kv_pos_row(kv_t{n}, {dims}, {layer}, {head}, {pos}) == {}ull, \"row {n}\");",
                l.row(layer, block, head, off)
            ));
            out.push(format!(
                "static_assert(kv_head_block({dims}, {layer}, {block}, {head}) == {}ull, \"head block {n}\");",
                l.head_block(layer, block, head)
            ));
            out.push(format!(
                "static_assert(kv_pos_state(kv_t{n}, {block_size}, {state_dim}, {pos}) == {}ull, \"state {n}\");",
                l.state_row(block, off)
            ));
        }
    }
    // Sample values: random bit patterns (all exponents), random small magnitudes, exact ties
    // of each type, and the edges.
    let mut values: Vec<f32> = (0..600).map(|_| f32::from_bits(next() as u32)).collect();
    values.extend((0..300).map(|_| (next() % 2_000_000) as f32 / 1000.0 - 1000.0));
    values.extend((0..200).map(|_| f32::from_bits((next() as u32 & 0x81ff_ffff) | 0x3800_0000)));
    for base in [1.0f32, 0.75, 3.0, 1e-3, 300.0, 6e-5] {
        let b = base.to_bits();
        values.extend([
            f32::from_bits(b | 0x8000),    // bf16 tie
            f32::from_bits(b | 0x18000),   // bf16 tie, odd
            f32::from_bits(b | 0x1000),    // f16 tie
            f32::from_bits(b | 0x3000),    // f16 tie, odd
            f32::from_bits(b | 0x80000),   // fp8 tie
            f32::from_bits(b | 0x18_0000), // fp8 tie, odd
        ]);
    }
    values.extend([
        0.0,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        f32::MAX,
        f32::MIN_POSITIVE,
        1e-40,
        448.0,
        449.0,
        -464.0,
        65504.0,
        65520.0,
        3.0 / 512.0 + 1.0 / 1024.0,
        5.0 / 512.0 + 1.0 / 1024.0,
    ]);
    let bits = |x: f32| format!("kv_bits_f32({:#010x}u)", x.to_bits());
    let enc = |dtype: KvDtype, x: f32| {
        let mut data = vec![0u8; dtype.bytes_per_elem()];
        encode_row(dtype, &[x], &mut data, &mut []);
        data
    };
    for &x in &values {
        let b = enc(KvDtype::Bf16, x);
        out.push(format!(
            "static_assert(kv_f32_to_bf16({}) == {}, \"bf16 {x:e}\");",
            bits(x),
            u16::from_le_bytes([b[0], b[1]])
        ));
        let h = enc(KvDtype::F16, x);
        out.push(format!(
            "static_assert(kv_f32_to_f16({}) == {}, \"f16 {x:e}\");",
            bits(x),
            u16::from_le_bytes([h[0], h[1]])
        ));
        out.push(format!(
            "static_assert(kv_f32_to_fp8({}) == {}, \"fp8 {x:e}\");",
            bits(x),
            enc(KvDtype::Fp8E4m3, x)[0]
        ));
    }
    let dec = |dtype: KvDtype, data: &[u8]| {
        let mut v = [0f32];
        decode_row(dtype, data, &[], &mut v);
        v[0].to_bits()
    };
    for code in 0..=255u8 {
        out.push(format!(
            "static_assert(kv_f32_bits(kv_fp8_to_f32({code})) == {:#010x}u, \"fp8 code {code}\");",
            dec(KvDtype::Fp8E4m3, &[code])
        ));
    }
    let mut codes: Vec<u16> = (0..1500).map(|_| next() as u16).collect();
    codes.extend([
        0, 0x8000, 0x7c00, 0xfc00, 0x7e00, 0x7c01, 0x0001, 0x03ff, 0x0400, 0x7bff,
    ]);
    for c in codes {
        let le = c.to_le_bytes();
        out.push(format!(
            "static_assert(kv_f32_bits(kv_f16_to_f32({c})) == {:#010x}u, \"f16 code {c}\");",
            dec(KvDtype::F16, &le)
        ));
        out.push(format!(
            "static_assert(kv_f32_bits(kv_bf16_to_f32({c})) == {:#010x}u, \"bf16 code {c}\");",
            dec(KvDtype::Bf16, &le)
        ));
    }
    // q8: whole groups, the scale from the group's largest magnitude.
    for g in 0..12 {
        let spread = [1e-3f32, 0.5, 7.0, 300.0][g % 4];
        let mut group: Vec<f32> = (0..Q8_GROUP)
            .map(|_| ((next() % 2_000_001) as f32 / 1_000_000.0 - 1.0) * spread)
            .collect();
        if g == 5 {
            group = vec![0.0; Q8_GROUP];
        }
        if g == 7 {
            // Exact half steps: amax 127 gives scale 1.
            for (i, v) in group.iter_mut().enumerate() {
                *v = i as f32 - 15.5;
            }
            group[0] = 127.0;
        }
        let mut data = vec![0u8; Q8_GROUP];
        let mut scale = [0f32];
        encode_row(KvDtype::Q8, &group, &mut data, &mut scale);
        let amax = group.iter().fold(0f32, |m, x| m.max(x.abs()));
        out.push(format!(
            "static_assert(kv_f32_bits(kv_q8_scale({})) == {:#010x}u, \"q8 scale {g}\");",
            bits(amax),
            scale[0].to_bits()
        ));
        for (x, q) in group.iter().zip(&data) {
            out.push(format!(
                "static_assert(kv_q8_quant({}, {}) == {}, \"q8 {g} {x:e}\");",
                bits(*x),
                bits(scale[0]),
                *q as i8
            ));
        }
    }
    out
}

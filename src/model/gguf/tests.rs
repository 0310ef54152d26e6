//! Tests against GGUF files written in code (see `writer`), plus the demo model when present.

use std::path::{Path, PathBuf};

use half::{bf16, f16};

use super::*;
use crate::files::gguf::writer::{GgufWriter, TempFile};
use crate::files::gguf::{parse, GgufValue};
use crate::tokenizer::gguf::fixture::{add_test_tokenizer, TOK_IM_END, TOK_IM_START};

/// A deterministic byte stream, so quantized fixtures cover every nibble and sign.
fn pseudo_bytes(n: usize, seed: u32) -> Vec<u8> {
    let mut x = seed.wrapping_mul(2654435761).wrapping_add(12345);
    (0..n)
        .map(|_| {
            x = x.wrapping_mul(1103515245).wrapping_add(12345);
            (x >> 16) as u8
        })
        .collect()
}

/// `nblocks` blocks of a format with `scales` f16 header values followed by `payload` bytes.
fn blocks(nblocks: usize, scales: usize, payload: usize, seed: u32) -> Vec<u8> {
    let mut out = Vec::new();
    let q = pseudo_bytes(nblocks * payload, seed);
    for b in 0..nblocks {
        for s in 0..scales {
            // Distinct, sign-varying, non-trivial scales per block.
            let v = (b as f32 + 1.0) * 0.0371 * if s == 0 { 1.0 } else { -2.5 };
            out.extend_from_slice(&f16::from_f32(v).to_le_bytes());
        }
        out.extend_from_slice(&q[b * payload..(b + 1) * payload]);
    }
    out
}

fn f16_of(b: &[u8]) -> f32 {
    f16::from_le_bytes([b[0], b[1]]).to_f32()
}

/// Expected values straight from ggml's block definitions, written independently of `dequant`.
fn expect_q8_0(data: &[u8]) -> Vec<f32> {
    let mut v = Vec::new();
    for blk in data.chunks(34) {
        let d = f16_of(blk);
        for j in 0..32 {
            v.push(d * f32::from(blk[2 + j] as i8));
        }
    }
    v
}

fn expect_q4(data: &[u8], with_min: bool) -> Vec<f32> {
    let size = if with_min { 20 } else { 18 };
    let mut v = Vec::new();
    for blk in data.chunks(size) {
        let d = f16_of(blk);
        let (m, qs) = if with_min {
            (f16_of(&blk[2..]), &blk[4..])
        } else {
            (0.0, &blk[2..])
        };
        for j in 0..32 {
            let byte = qs[j % 16];
            let q = if j < 16 { byte & 15 } else { byte >> 4 };
            v.push(if with_min {
                d * f32::from(q) + m
            } else {
                d * (f32::from(q) - 8.0)
            });
        }
    }
    v
}

struct Fixture {
    writer: GgufWriter,
    f32_vals: Vec<f32>,
    f16_vals: Vec<f16>,
    bf16_vals: Vec<bf16>,
    q8: Vec<u8>,
    q4_0: Vec<u8>,
    q4_1: Vec<u8>,
}

/// A two-layer-shaped llama file: one of each supported tensor type, mapped and unmapped names.
fn fixture() -> Fixture {
    let mut w = GgufWriter::new();
    let s = |x: &str| GgufValue::String(x.to_string());
    w.kv("general.architecture", s("llama"))
        .kv("general.alignment", GgufValue::U32(32))
        .kv("llama.embedding_length", GgufValue::U32(64))
        .kv("llama.block_count", GgufValue::U32(1))
        .kv("llama.attention.head_count", GgufValue::U32(4))
        .kv("llama.attention.head_count_kv", GgufValue::U32(2))
        .kv("llama.feed_forward_length", GgufValue::U64(96))
        .kv("llama.context_length", GgufValue::U32(128))
        .kv(
            "llama.attention.layer_norm_rms_epsilon",
            GgufValue::F32(1e-5),
        )
        .kv("llama.rope.freq_base", GgufValue::F32(100000.0));
    add_test_tokenizer(&mut w, Some("smollm"));

    let f32_vals: Vec<f32> = (0..64).map(|i| i as f32 * 0.25 - 3.0).collect();
    let f16_vals: Vec<f16> = (0..64 * 2).map(|i| f16::from_f32(i as f32 / 7.0)).collect();
    let bf16_vals: Vec<bf16> = (0..32 * 3)
        .map(|i| bf16::from_f32(-(i as f32) / 3.0))
        .collect();
    let q8 = blocks(4 * 2, 1, 32, 1); // ne = [64, 4]
    let q4_0 = blocks(2 * 3, 1, 16, 2); // ne = [64, 3]
    let q4_1 = blocks(3 * 2, 2, 16, 3); // ne = [96, 2]
    w.tensor(
        "output_norm.weight",
        &[64],
        0,
        bytemuck::cast_slice(&f32_vals).to_vec(),
    )
    .tensor(
        "blk.0.attn_q.weight",
        &[64, 2],
        1,
        bytemuck::cast_slice(&f16_vals).to_vec(),
    )
    .tensor(
        "blk.0.attn_k.bias",
        &[32, 3],
        30,
        bytemuck::cast_slice(&bf16_vals).to_vec(),
    )
    .tensor("token_embd.weight", &[64, 4], 8, q8.clone())
    .tensor("blk.0.ffn_up.weight", &[64, 3], 2, q4_0.clone())
    .tensor("blk.0.ffn_down.weight", &[96, 2], 3, q4_1.clone())
    .tensor("blk.0.ffn_gate.weight", &[96, 2], 3, q4_1.clone())
    .tensor("extra.thing", &[3], 0, vec![0; 12]);
    Fixture {
        writer: w,
        f32_vals,
        f16_vals,
        bf16_vals,
        q8,
        q4_0,
        q4_1,
    }
}

fn err_of<T>(r: Result<T, LoadError>) -> String {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn reads_header_metadata_and_tensor_infos() {
    for version in [2, 3] {
        let mut fx = fixture();
        fx.writer.version = version;
        let tmp = fx.writer.write_temp("header");
        let f = GgufFile::open(tmp.path()).unwrap();
        assert_eq!(f.version, version);
        assert_eq!(f.tensors.len(), 8);
        assert_eq!(f.alignment, 32);
        assert_eq!(f.data_offset % 32, 0);
        assert_eq!(f.get_str("general.architecture").unwrap(), "llama");
        assert_eq!(f.get_u32("llama.feed_forward_length").unwrap(), 96);
        assert_eq!(f.get_f32("llama.rope.freq_base").unwrap(), 100000.0);
        assert_eq!(f.get_str_array("tokenizer.ggml.merges").unwrap()[3], "4 2");
        assert_eq!(
            f.get_int_array("tokenizer.ggml.token_type").unwrap()[260],
            3
        );
        let e = err_of(f.get_str("llama.block_count"));
        assert!(
            e.contains("llama.block_count") && e.contains("expected a string"),
            "{e}"
        );
        let e = err_of(f.get_u32("no.such.key"));
        assert!(e.contains("no.such.key") && e.contains("missing"), "{e}");
        let t = f.tensor("token_embd.weight").unwrap();
        assert_eq!(t.dims, vec![64, 4]);
        assert_eq!(t.shape(), vec![4, 64]);
        assert_eq!(t.ggml_type.to_string(), "Q8_0");
    }
}

#[test]
fn loads_and_dequantizes_every_supported_type() {
    let fx = fixture();
    let tmp = fx.writer.write_temp("load");
    let m = load(tmp.path()).unwrap();
    let w = &m.weights;

    let t = w.get("model.norm.weight").unwrap();
    assert_eq!((t.shape.clone(), t.dtype), (vec![64], DType::F32));
    assert!(matches!(t.bytes, TensorBytes::Mapped { .. }));
    assert_eq!(t.to_f32_vec(), fx.f32_vals);

    let t = w.get("model.layers.0.self_attn.q_proj.weight").unwrap();
    assert_eq!((t.shape.clone(), t.dtype), (vec![2, 64], DType::F16));
    assert!(matches!(t.bytes, TensorBytes::Mapped { .. }));
    let want: Vec<f32> = fx.f16_vals.iter().map(|v| v.to_f32()).collect();
    assert_eq!(t.to_f32_vec(), want);

    let t = w.get("model.layers.0.self_attn.k_proj.bias").unwrap();
    assert_eq!((t.shape.clone(), t.dtype), (vec![3, 32], DType::BF16));
    assert_eq!(t.to_bf16_vec(), fx.bf16_vals);

    let t = w.get("model.embed_tokens.weight").unwrap();
    assert_eq!((t.shape.clone(), t.dtype), (vec![4, 64], DType::Q8_0));
    assert!(matches!(t.bytes, TensorBytes::Mapped { .. }));
    assert_eq!(t.to_f32_vec(), expect_q8_0(&fx.q8));

    let t = w.get("model.layers.0.mlp.up_proj.weight").unwrap();
    assert_eq!((t.shape.clone(), t.dtype), (vec![3, 64], DType::Q4_0));
    assert_eq!(t.to_f32_vec(), expect_q4(&fx.q4_0, false));

    let t = w.get("model.layers.0.mlp.down_proj.weight").unwrap();
    assert_eq!((t.shape.clone(), t.dtype), (vec![2, 96], DType::Q4_1));
    assert!(matches!(t.bytes, TensorBytes::Mapped { .. }));
    let got = t.to_f32_vec();
    assert_eq!(got, expect_q4(&fx.q4_1, true));
    assert!(got.iter().any(|&v| v < 0.0) && got.iter().any(|&v| v > 0.0));

    // Unknown names pass through; nothing was dropped or duplicated.
    assert!(w.contains("extra.thing"));
    assert!(w.contains("model.layers.0.mlp.gate_proj.weight"));
    assert_eq!(w.tensors.len(), 8);

    // Two Q4_1 matrices outnumber one of each other type.
    assert_eq!(m.weight_type, "Q4_1");

    let c = &m.config;
    assert_eq!(c.architecture, Architecture::Llama);
    assert_eq!(
        (
            c.vocab_size,
            c.hidden_size,
            c.num_layers,
            c.num_heads,
            c.num_kv_heads
        ),
        (263, 64, 1, 4, 2)
    );
    assert_eq!(
        (c.head_dim, c.intermediate_size, c.max_position_embeddings),
        (16, 96, 128)
    );
    assert_eq!((c.rms_norm_eps, c.rope_theta), (1e-5, 100000.0));
    assert_eq!(c.rope_scaling, None);
    assert_eq!(c.rope_style, RopeStyle::Interleaved);
    assert!(c.tie_word_embeddings);
    assert!(!c.attention_bias);
    assert_eq!(c.bos_token_id, Some(TOK_IM_START));
    assert_eq!(c.eos_token_ids, vec![TOK_IM_END]);
    assert_eq!(
        m.tokenizer.encode("<|im_start|>").unwrap(),
        vec![TOK_IM_START]
    );
}

#[test]
fn config_options() {
    let mut fx = fixture();
    let w = &mut fx.writer;
    w.kv("llama.vocab_size", GgufValue::U32(300))
        .kv("llama.attention.key_length", GgufValue::U32(32))
        .kv("llama.attention.value_length", GgufValue::U32(32))
        .kv(
            "llama.rope.scaling.type",
            GgufValue::String("linear".into()),
        )
        .kv("llama.rope.scaling.factor", GgufValue::F32(4.0))
        .remove_kv("llama.attention.head_count_kv")
        .remove_kv("llama.rope.freq_base")
        .tensor("output.weight", &[64, 4], 0, vec![0; 64 * 4 * 4])
        .tensor("blk.0.attn_q.bias", &[64], 0, vec![0; 64 * 4]);
    let tmp = w.write_temp("config");
    let m = load(tmp.path()).unwrap();
    let c = &m.config;
    // llama.vocab_size says 300 but the tokenizer has 263 tokens: ids past it are never
    // produced (model::vocab), so the model's vocabulary is the tokenizer's.
    assert_eq!((c.vocab_size, c.head_dim, c.num_kv_heads), (263, 32, 4));
    assert_eq!(c.rope_theta, 10000.0);
    assert_eq!(c.rope_scaling, Some(RopeScaling::Linear { factor: 4.0 }));
    assert!(!c.tie_word_embeddings);
    assert!(c.attention_bias);
    assert!(m.weights.contains("lm_head.weight"));
    assert!(m.weights.contains("model.layers.0.self_attn.q_proj.bias"));
}

#[test]
fn name_mapping() {
    assert_eq!(
        hf_name("blk.12.attn_output.weight"),
        "model.layers.12.self_attn.o_proj.weight"
    );
    assert_eq!(
        hf_name("blk.3.attn_v.bias"),
        "model.layers.3.self_attn.v_proj.bias"
    );
    assert_eq!(
        hf_name("blk.0.attn_norm.weight"),
        "model.layers.0.input_layernorm.weight"
    );
    assert_eq!(
        hf_name("blk.0.ffn_norm.weight"),
        "model.layers.0.post_attention_layernorm.weight"
    );
    assert_eq!(hf_name("output.weight"), "lm_head.weight");
    assert_eq!(hf_name("blk.x.attn_q.weight"), "blk.x.attn_q.weight");
    assert_eq!(hf_name("blk.0.attn_q.scale"), "blk.0.attn_q.scale");
    assert_eq!(hf_name("rope_freqs.weight"), "rope_freqs.weight");
}

#[test]
fn every_truncation_is_an_error() {
    let bytes = fixture().writer.to_bytes();
    let path = Path::new("cut.gguf");
    assert!(parse(path, &bytes).is_ok());
    for len in 0..bytes.len() {
        assert!(
            parse(path, &bytes[..len]).is_err(),
            "prefix of {len} bytes parsed"
        );
    }
    // And through the file path, with the message saying what was cut.
    let tmp = TempFile::new("trunc");
    std::fs::write(tmp.path(), &bytes[..100]).unwrap();
    let e = err_of(GgufFile::open(tmp.path()));
    assert!(e.contains("truncated"), "{e}");
    assert!(e.contains(&tmp.path().display().to_string()), "{e}");
    std::fs::write(tmp.path(), b"").unwrap();
    let e = err_of(GgufFile::open(tmp.path()));
    assert!(e.contains(&tmp.path().display().to_string()), "{e}");
    std::fs::write(tmp.path(), &bytes[..bytes.len() - 1]).unwrap();
    let e = err_of(GgufFile::open(tmp.path()));
    assert!(
        e.contains("extra.thing") && e.contains("past the end"),
        "{e}"
    );
}

#[test]
fn corrupt_bytes_never_panic() {
    let bytes = fixture().writer.to_bytes();
    let path = Path::new("corrupt.gguf");
    for i in 0..bytes.len() {
        for x in [0x01u8, 0x80, 0xff] {
            let mut b = bytes.clone();
            b[i] ^= x;
            let _ = parse(path, &b);
        }
        let mut b = bytes.clone();
        b[i] = 0xff;
        let _ = parse(path, &b);
    }
}

/// Rewrites the offset field of tensor `name` in a written file.
fn set_offset(bytes: &mut [u8], name: &str, offset: u64) {
    let mut needle = (name.len() as u64).to_le_bytes().to_vec();
    needle.extend_from_slice(name.as_bytes());
    let at = bytes
        .windows(needle.len())
        .position(|w| w == needle)
        .unwrap();
    let n_dims = u32::from_le_bytes(bytes[at + needle.len()..][..4].try_into().unwrap()) as usize;
    let off_at = at + needle.len() + 4 + 8 * n_dims + 4;
    bytes[off_at..off_at + 8].copy_from_slice(&offset.to_le_bytes());
}

#[test]
fn bad_offsets_name_the_tensor() {
    let mut bytes = fixture().writer.to_bytes();
    set_offset(&mut bytes, "blk.0.ffn_up.weight", 1 << 20);
    let e = err_of(parse(Path::new("f.gguf"), &bytes).map(|_| ()));
    assert!(
        e.contains("blk.0.ffn_up.weight") && e.contains("past the end"),
        "{e}"
    );

    set_offset(&mut bytes, "blk.0.ffn_up.weight", u64::MAX - 31);
    let e = err_of(parse(Path::new("f.gguf"), &bytes).map(|_| ()));
    assert!(e.contains("blk.0.ffn_up.weight"), "{e}");

    set_offset(&mut bytes, "blk.0.ffn_up.weight", 3);
    let e = err_of(parse(Path::new("f.gguf"), &bytes).map(|_| ()));
    assert!(
        e.contains("blk.0.ffn_up.weight") && e.contains("alignment"),
        "{e}"
    );
}

#[test]
fn unsupported_and_unknown_ggml_types() {
    // A type ggml defines but kiln does not decode: the file opens, loading names the tensor.
    let mut fx = fixture();
    fx.writer
        .tensor("blk.0.attn_v.weight", &[256, 1], 23, vec![0; 136]);
    let tmp = fx.writer.write_temp("iq4xs");
    assert!(GgufFile::open(tmp.path()).is_ok());
    let e = err_of(load(tmp.path()));
    assert!(
        e.contains("blk.0.attn_v.weight") && e.contains("IQ4_XS"),
        "{e}"
    );

    // An id ggml does not define: its size is unknowable, so opening fails.
    let mut fx = fixture();
    fx.writer.tensor("weird.weight", &[4], 99, vec![0; 16]);
    let tmp = fx.writer.write_temp("unknown");
    let e = err_of(GgufFile::open(tmp.path()));
    assert!(
        e.contains("weird.weight") && e.contains("unknown ggml type 99"),
        "{e}"
    );
}

#[test]
fn rejects_other_architectures_and_missing_keys() {
    let mut fx = fixture();
    fx.writer
        .kv("general.architecture", GgufValue::String("falcon".into()));
    let e = err_of(load(fx.writer.write_temp("arch").path()));
    assert!(e.contains("falcon") && e.contains("llama"), "{e}");

    for key in [
        "llama.block_count",
        "llama.embedding_length",
        "llama.attention.layer_norm_rms_epsilon",
        "general.architecture",
        "tokenizer.ggml.merges",
    ] {
        let mut fx = fixture();
        fx.writer.remove_kv(key);
        let e = err_of(load(fx.writer.write_temp("missing").path()));
        assert!(e.contains(key) && e.contains("missing"), "{key}: {e}");
    }

    let mut fx = fixture();
    fx.writer
        .kv("llama.block_count", GgufValue::String("one".into()));
    let e = err_of(load(fx.writer.write_temp("type").path()));
    assert!(
        e.contains("llama.block_count") && e.contains("integer"),
        "{e}"
    );

    let mut fx = fixture();
    fx.writer.tensor("rope_freqs.weight", &[8], 0, vec![0; 32]);
    let e = err_of(load(fx.writer.write_temp("ropefreqs").path()));
    assert!(
        e.contains("rope_freqs") && e.contains("not supported"),
        "{e}"
    );

    let mut fx = fixture();
    fx.writer
        .kv("llama.rope.scaling.type", GgufValue::String("yarn".into()));
    let e = err_of(load(fx.writer.write_temp("yarn").path()));
    assert!(
        e.contains("yarn") && e.contains("llama.rope.scaling.type"),
        "{e}"
    );
}

#[test]
fn rejects_bad_headers() {
    let bytes = fixture().writer.to_bytes();
    let p = Path::new("h.gguf");
    let mut b = bytes.clone();
    b[0] = b'X';
    assert!(err_of(parse(p, &b).map(|_| ())).contains("magic"));
    let mut b = bytes.clone();
    b[4] = 1;
    assert!(err_of(parse(p, &b).map(|_| ())).contains("version 1"));
    // A tensor count far beyond what the file can hold must not allocate.
    let mut b = bytes.clone();
    b[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(err_of(parse(p, &b).map(|_| ())).contains("tensor count"));
    // Nested arrays are refused.
    let mut w = GgufWriter::new();
    w.kv(
        "x.nested",
        GgufValue::Array(vec![GgufValue::Array(vec![GgufValue::U8(1)])]),
    );
    let e = err_of(parse(p, &w.to_bytes()).map(|_| ()));
    assert!(e.contains("x.nested") && e.contains("nested"), "{e}");
}

fn demo_path() -> PathBuf {
    match std::env::var_os("KILN_DEMO_MODEL") {
        Some(p) => PathBuf::from(p),
        None => {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("models/SmolLM2-135M-Instruct.Q4_1.gguf")
        }
    }
}

/// The facts in `reference/demo-model.md`, checked on the real file when it is on disk.
#[test]
fn demo_model_facts() {
    let path = demo_path();
    if !path.exists() {
        eprintln!(
            "skipping demo_model_facts: {} not found (set KILN_DEMO_MODEL)",
            path.display()
        );
        return;
    }
    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.tensors.len(), 272);
    let m = load(&path).unwrap();
    let c = &m.config;
    assert_eq!(
        (
            c.hidden_size,
            c.num_layers,
            c.num_heads,
            c.num_kv_heads,
            c.head_dim
        ),
        (576, 30, 9, 3, 64)
    );
    assert_eq!(
        (c.intermediate_size, c.vocab_size, c.max_position_embeddings),
        (1536, 49152, 8192)
    );
    assert_eq!(c.rope_theta, 100000.0);
    // Stored as 9.999999747e-06: the f32 nearest to 1e-5.
    assert_eq!(c.rms_norm_eps, 1e-5);
    assert_eq!(c.rope_scaling, None);
    assert!(c.tie_word_embeddings);
    assert!(!c.attention_bias);
    assert_eq!(c.bos_token_id, Some(1));
    assert_eq!(c.eos_token_ids, vec![2]);
    assert_eq!(c.num_params(), 134_515_008);
    assert_eq!(m.weight_type, "Q4_1");
    assert_eq!(m.weights.tensors.len(), 272);
    let embd = m.weights.get("model.embed_tokens.weight").unwrap();
    assert_eq!(embd.shape, vec![49152, 576]);
    let down = m
        .weights
        .get_shaped("model.layers.29.mlp.down_proj.weight", &[576, 1536])
        .unwrap();
    // Dequantized values match the block definitions applied to the raw bytes.
    let info = f.tensor("token_embd.weight").unwrap();
    assert_eq!(info.ggml_type, GgmlType::Q8_0);
    assert_eq!(embd.to_f32_vec(), expect_q8_0(f.tensor_data(info)));
    let info = f.tensor("blk.29.ffn_down.weight").unwrap();
    assert_eq!(info.ggml_type, GgmlType::Q4_1);
    assert_eq!(down.to_f32_vec(), expect_q4(f.tensor_data(info), true));
    let norm = m.weights.get("model.norm.weight").unwrap();
    assert!(matches!(norm.bytes, TensorBytes::Mapped { .. }));

    let tok = &m.tokenizer;
    assert!(!tok.specials.add_bos_token);
    assert!(tok
        .specials
        .chat_template
        .as_deref()
        .is_some_and(|t| t.contains("<|im_start|>")));
    assert_eq!(tok.encode("<|im_start|>user").unwrap()[0], 1);
    let text = "x  1 and x\n\n1 and   42";
    let ids = tok.encode(text).unwrap();
    assert_eq!(tok.decode(&ids).unwrap(), text);
    let pieces: Vec<String> = ids.iter().map(|&i| tok.id_to_token(i).unwrap()).collect();
    for p in &pieces {
        if p.chars().any(|c| c.is_ascii_digit()) {
            assert_eq!(p.chars().count(), 1, "digit not split alone: {pieces:?}");
        }
    }
    assert_eq!(
        pieces
            .iter()
            .filter(|p| p.chars().any(|c| c.is_ascii_digit()))
            .count(),
        4
    );
}

#[test]
fn hyper_parameters_are_validated_naming_the_key() {
    let cases: [(&str, GgufValue, &str); 5] = [
        (
            "llama.attention.layer_norm_rms_epsilon",
            GgufValue::F32(f32::NAN),
            "NaN",
        ),
        (
            "llama.attention.layer_norm_rms_epsilon",
            GgufValue::F32(0.0),
            "0",
        ),
        ("llama.rope.freq_base", GgufValue::F32(-1.0), "-1"),
        ("llama.rope.freq_base", GgufValue::F32(f32::NAN), "NaN"),
        // Partial rotary: RoPE on 8 of the 16 dimensions of each head.
        (
            "llama.rope.dimension_count",
            GgufValue::U32(8),
            "partial rotary",
        ),
    ];
    for (key, value, says) in cases {
        let mut fx = fixture();
        fx.writer.kv(key, value);
        let e = err_of(load(fx.writer.write_temp("hyper").path()));
        assert!(
            e.contains(&format!("`{key}`")) && e.contains(says),
            "{key}: {e}"
        );
    }
    // A dimension count equal to the head size is what every llama file writes.
    let mut fx = fixture();
    fx.writer
        .kv("llama.rope.dimension_count", GgufValue::U32(16));
    assert!(load(fx.writer.write_temp("rope-dims").path()).is_ok());
    // Products of u32 fields can still overflow: hidden × heads × head_dim.
    let mut fx = fixture();
    fx.writer
        .kv("llama.embedding_length", GgufValue::U32(1 << 31))
        .kv("llama.attention.key_length", GgufValue::U32(u32::MAX - 1));
    let e = err_of(load(fx.writer.write_temp("overflow").path()));
    assert!(
        e.contains("`llama.embedding_length`") && e.contains("overflows"),
        "{e}"
    );
}

#[test]
fn architecture_names_are_escaped() {
    let mut fx = fixture();
    fx.writer.kv(
        "general.architecture",
        GgufValue::String("\u{1b}[2Jllama".into()),
    );
    let e = err_of(load(fx.writer.write_temp("esc").path()));
    assert!(e.contains(r"`\u{1b}[2Jllama`"), "{e}");
    assert!(!e.chars().any(char::is_control), "{e:?}");
}

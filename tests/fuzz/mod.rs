//! Structure-aware fuzzing of everything kiln reads from a model: GGUF headers, metadata and
//! tensor tables, safetensors headers and shard indexes, `config.json`, `tokenizer.json`, and
//! `tokenizer_config.json` with its chat template.
//!
//! Each case starts from a valid fixture, mutates it where the format has structure (a metadata
//! value, a tensor's dimensions, a JSON field, a template tag) and sometimes at the byte level
//! too, writes it to a case directory, and runs it in-process: `Model::load`, and when that
//! succeeds, the tokenizer and a short generation on the CPU. A case passes when everything
//! returns (an error or a result); a panic fails it. Shared by the stable-Rust driver
//! (`tests/fuzz_load.rs`) and the `cargo fuzz` targets (`fuzz/fuzz_targets/load_*.rs`).
#![allow(dead_code)]

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use kiln::backend::cpu::CpuOptions;
use kiln::engine::{Engine, GenerateOptions};
use kiln::files::gguf::{write_gguf_string, GgufFile, GgufValue, GGUF_MAGIC};
use kiln::model::Model;
use kiln::sample::SamplingParams;
use kiln::tokenizer::ChatMessage;
use serde_json::{json, Value};

/// splitmix64: tiny, deterministic, good enough to pick mutations.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    /// A seed from arbitrary bytes (what a coverage-guided fuzzer hands over).
    pub fn from_bytes(data: &[u8]) -> Rng {
        let mut h = 0xcbf2_9ce4_8422_2325u64;
        for &b in data {
            h = (h ^ b as u64).wrapping_mul(0x100_0000_01b3);
        }
        Rng(h)
    }

    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    pub fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }

    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}

/// Integers at the edges: zero, one, powers of two around every width, their neighbours, the
/// value that wraps a product of four (2^62 + 16), and negatives.
const EDGE_INTS: [i128; 22] = [
    0,
    1,
    2,
    3,
    7,
    16,
    255,
    256,
    65535,
    65536,
    (1 << 31) - 1,
    1 << 31,
    (1 << 32) - 1,
    1 << 32,
    (1 << 32) + 2,
    (1 << 62) + 16,
    (1 << 63) - 1,
    1 << 63,
    u64::MAX as i128,
    -1,
    -2,
    i64::MIN as i128,
];

const EDGE_FLOATS: [f64; 12] = [
    0.0,
    -0.0,
    -1.0,
    1e-45,
    1e-300,
    1.0,
    0.5,
    4.0,
    1e30,
    1e300,
    -1e300,
    f64::MIN_POSITIVE,
];

/// Strings that have broken parsers and terminals: escapes, bidi overrides, lone quotes, long
/// runs, template and JSON syntax, path tricks.
const EDGE_STRINGS: [&str; 18] = [
    "",
    " ",
    "\u{1b}[2J\u{1b}[31m",
    "\u{9b}31m",
    "a\u{202e}b",
    "\u{0}",
    "\"",
    "\\",
    "{{",
    "{%",
    "../../etc/passwd",
    "/dev/zero",
    "llama",
    "nanochat",
    "Strip",
    "Sequence",
    "é日本🎉",
    "<|im_start|>",
];

fn edge_int(rng: &mut Rng) -> i128 {
    let v = *rng.pick(&EDGE_INTS);
    if rng.chance(20) {
        v + rng.below(5) as i128 - 2
    } else {
        v
    }
}

fn edge_string(rng: &mut Rng) -> String {
    match rng.below(4) {
        0 => rng.pick(&EDGE_STRINGS).repeat(1 + rng.below(3)),
        1 => "x".repeat(rng.below(5000)),
        _ => rng.pick(&EDGE_STRINGS).to_string(),
    }
}

// ---------------------------------------------------------------------------------------------
// JSON

/// A JSON value from the edges of every type.
fn edge_json(rng: &mut Rng, depth: usize) -> Value {
    match rng.below(if depth > 2 { 6 } else { 8 }) {
        0 => Value::Null,
        1 => Value::Bool(rng.chance(50)),
        2 => {
            let i = edge_int(rng);
            if let Ok(v) = i64::try_from(i) {
                json!(v)
            } else if let Ok(v) = u64::try_from(i) {
                json!(v)
            } else {
                json!(i as f64)
            }
        }
        3 => json!(rng.pick(&EDGE_FLOATS)),
        4 | 5 => Value::String(edge_string(rng)),
        6 => Value::Array(
            (0..rng.below(4))
                .map(|_| edge_json(rng, depth + 1))
                .collect(),
        ),
        _ => {
            let mut m = serde_json::Map::new();
            for _ in 0..rng.below(4) {
                m.insert(edge_string(rng), edge_json(rng, depth + 1));
            }
            Value::Object(m)
        }
    }
}

/// Paths (object keys and array indices) to every node of `v`.
fn json_paths(v: &Value, prefix: &mut Vec<Value>, out: &mut Vec<Vec<Value>>) {
    out.push(prefix.clone());
    if out.len() > 20_000 {
        return;
    }
    match v {
        Value::Object(m) => {
            for (k, c) in m {
                prefix.push(Value::String(k.clone()));
                json_paths(c, prefix, out);
                prefix.pop();
            }
        }
        Value::Array(a) => {
            for (i, c) in a.iter().enumerate() {
                prefix.push(json!(i));
                json_paths(c, prefix, out);
                prefix.pop();
            }
        }
        _ => {}
    }
}

fn json_at<'a>(v: &'a mut Value, path: &[Value]) -> Option<&'a mut Value> {
    let mut cur = v;
    for p in path {
        cur = match p {
            Value::String(k) => cur.get_mut(k.as_str())?,
            Value::Number(i) => cur.get_mut(i.as_u64()? as usize)?,
            _ => return None,
        };
    }
    Some(cur)
}

/// One structural edit somewhere in `doc`; `keys` are field names worth adding (what the
/// format reads).
fn mutate_json(rng: &mut Rng, doc: &mut Value, keys: &[&str]) {
    let mut paths = Vec::new();
    json_paths(doc, &mut Vec::new(), &mut paths);
    let path = rng.pick(&paths).clone();
    let Some(node) = json_at(doc, &path) else {
        return;
    };
    match rng.below(10) {
        // Replace the value with an edge value.
        0..=3 => *node = edge_json(rng, 0),
        // Nudge a number.
        4 => {
            if let Some(n) = node.as_i64() {
                *node = json!(n.wrapping_add(rng.below(5) as i64 - 2));
            } else if let Some(f) = node.as_f64() {
                *node = json!(-f);
            } else {
                *node = edge_json(rng, 0);
            }
        }
        // Delete a key or an element.
        5 => match node {
            Value::Object(m) if !m.is_empty() => {
                let k = m
                    .keys()
                    .nth(rng.below(m.len()))
                    .cloned()
                    .unwrap_or_default();
                m.remove(&k);
            }
            Value::Array(a) if !a.is_empty() => {
                a.remove(rng.below(a.len()));
            }
            _ => *node = Value::Null,
        },
        // Add or overwrite a field the loader reads.
        6 | 7 => {
            if let Value::Object(m) = node {
                let key = if !keys.is_empty() && rng.chance(80) {
                    rng.pick(keys).to_string()
                } else {
                    edge_string(rng)
                };
                m.insert(key, edge_json(rng, 0));
            } else {
                *node = edge_json(rng, 0);
            }
        }
        // Duplicate an element or grow a string.
        8 => match node {
            Value::Array(a) if !a.is_empty() => {
                let e = a[rng.below(a.len())].clone();
                a.insert(rng.below(a.len() + 1), e);
            }
            Value::String(s) => s.push_str(&edge_string(rng)),
            _ => *node = edge_json(rng, 0),
        },
        // Change a type but keep the value's spirit.
        _ => {
            *node = match node.take() {
                Value::Number(n) => Value::String(n.to_string()),
                Value::String(s) => s
                    .parse::<f64>()
                    .map_or(Value::Array(vec![Value::String(s)]), |f| json!(f)),
                Value::Bool(b) => json!(b as u8),
                other => Value::Array(vec![other]),
            }
        }
    }
}

/// Byte-level damage to serialized text: what a structure-aware edit cannot produce (syntax
/// errors, truncation, invalid UTF-8).
fn mutate_bytes(rng: &mut Rng, bytes: &mut Vec<u8>) {
    if bytes.is_empty() {
        bytes.push(rng.next() as u8);
        return;
    }
    let at = rng.below(bytes.len());
    match rng.below(6) {
        0 => bytes.truncate(at),
        1 => {
            bytes.remove(at);
        }
        2 => bytes.insert(at, *rng.pick(b"{}[],:\"\\\x00\xff\x1b0-e.")),
        3 => bytes[at] ^= 1 << rng.below(8),
        4 => {
            // Overwrite 8 bytes with an edge integer (counts, lengths, offsets in binary files).
            let v = (edge_int(rng) as u64).to_le_bytes();
            let end = (at + 8).min(bytes.len());
            bytes[at..end].copy_from_slice(&v[..end - at]);
        }
        _ => {
            let len = rng.below(64).min(bytes.len() - at);
            let chunk = bytes[at..at + len].to_vec();
            let to = rng.below(bytes.len());
            bytes.splice(to..to, chunk);
        }
    }
}

/// Mutates `doc` `1..=4` times structurally, serializes it, and sometimes damages the text.
fn mutated_json_text(rng: &mut Rng, mut doc: Value, keys: &[&str]) -> Vec<u8> {
    for _ in 0..1 + rng.below(4) {
        mutate_json(rng, &mut doc, keys);
    }
    let mut bytes = serde_json::to_vec(&doc).unwrap_or_default();
    if rng.chance(15) {
        for _ in 0..1 + rng.below(3) {
            mutate_bytes(rng, &mut bytes);
        }
    }
    bytes
}

// ---------------------------------------------------------------------------------------------
// GGUF

/// One tensor of a [`Gguf`]: name, ggml dims, type id, an explicit offset (or `None`: laid
/// out by the writer), data.
pub type GgufTensor = (String, Vec<u64>, u32, Option<u64>, Vec<u8>);

/// A GGUF file as editable parts; tensor data is kept per tensor so dims and types can change
/// without the data moving.
#[derive(Clone)]
pub struct Gguf {
    pub version: u32,
    pub kv: Vec<(String, GgufValue)>,
    pub tensors: Vec<GgufTensor>,
    pub alignment: usize,
}

impl Gguf {
    /// Reads a (valid) GGUF fixture into parts.
    pub fn read(path: &Path) -> Gguf {
        let f = GgufFile::open(path).unwrap_or_else(|e| panic!("fuzz seed: {e}"));
        let tensors = f
            .tensors
            .iter()
            .map(|t| {
                let data = f.tensor_data(t).to_vec();
                (t.name.clone(), t.dims.clone(), t.ggml_type.0, None, data)
            })
            .collect();
        Gguf {
            version: f.version,
            kv: f.metadata.into_iter().collect(),
            tensors,
            alignment: f.alignment as usize,
        }
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let a = self.alignment.max(1);
        let align = |n: usize| n.div_ceil(a) * a;
        let mut out = Vec::new();
        out.extend_from_slice(&GGUF_MAGIC);
        out.extend_from_slice(&self.version.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.kv.len() as u64).to_le_bytes());
        for (k, v) in &self.kv {
            write_gguf_string(&mut out, k);
            out.extend_from_slice(&v.type_id().to_le_bytes());
            v.write_to(&mut out);
        }
        let mut offset = 0usize;
        let mut offsets = Vec::new();
        for (name, dims, ty, fixed, data) in &self.tensors {
            write_gguf_string(&mut out, name);
            out.extend_from_slice(&(dims.len() as u32).to_le_bytes());
            for d in dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&ty.to_le_bytes());
            out.extend_from_slice(&fixed.unwrap_or(offset as u64).to_le_bytes());
            offsets.push(offset);
            offset = align(offset + data.len());
        }
        out.resize(align(out.len()), 0);
        let start = out.len();
        for ((_, _, _, _, data), at) in self.tensors.iter().zip(offsets) {
            out.resize(start + at, 0);
            out.extend_from_slice(data);
        }
        out
    }
}

fn edge_gguf_value(rng: &mut Rng, like: Option<&GgufValue>) -> GgufValue {
    let i = edge_int(rng);
    let f = *rng.pick(&EDGE_FLOATS);
    let v = match rng.below(16) {
        0 => GgufValue::U8(i as u8),
        1 => GgufValue::I8(i as i8),
        2 => GgufValue::U16(i as u16),
        3 => GgufValue::I16(i as i16),
        4 | 5 => GgufValue::U32(i as u32),
        6 => GgufValue::I32(i as i32),
        7 => GgufValue::U64(i as u64),
        8 => GgufValue::I64(i as i64),
        9 => GgufValue::F32(if rng.chance(30) { f32::NAN } else { f as f32 }),
        10 => GgufValue::F64(if rng.chance(30) { f64::INFINITY } else { f }),
        11 => GgufValue::Bool(rng.chance(50)),
        12 | 13 => GgufValue::String(edge_string(rng)),
        _ => GgufValue::Array(
            (0..rng.below(6))
                .map(|_| GgufValue::String(edge_string(rng)))
                .collect(),
        ),
    };
    // Half the time keep the original's type, so the value reaches the range checks.
    match (like, rng.chance(50)) {
        (Some(GgufValue::U32(_)), true) => GgufValue::U32(i as u32),
        (Some(GgufValue::U64(_)), true) => GgufValue::U64(i as u64),
        (Some(GgufValue::F32(_)), true) => {
            GgufValue::F32(if rng.chance(25) { f32::NAN } else { f as f32 })
        }
        (Some(GgufValue::String(_)), true) => GgufValue::String(edge_string(rng)),
        _ => v,
    }
}

/// Keys the loader reads, to add with edge values.
const GGUF_KEYS: [&str; 24] = [
    "general.architecture",
    "general.alignment",
    "llama.vocab_size",
    "llama.embedding_length",
    "llama.block_count",
    "llama.attention.head_count",
    "llama.attention.head_count_kv",
    "llama.attention.key_length",
    "llama.attention.value_length",
    "llama.feed_forward_length",
    "llama.context_length",
    "llama.attention.layer_norm_rms_epsilon",
    "llama.rope.freq_base",
    "llama.rope.dimension_count",
    "llama.rope.scaling.type",
    "llama.rope.scaling.factor",
    "llama.rope.scale_linear",
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.add_bos_token",
    "tokenizer.chat_template",
];

const TENSOR_NAMES: [&str; 6] = [
    "token_embd.weight",
    "output.weight",
    "rope_freqs.weight",
    "blk.0.attn_q.bias",
    "blk.99.attn_q.weight",
    "blk.0.attn_norm.weight",
];

fn mutate_gguf(rng: &mut Rng, g: &mut Gguf) {
    match rng.below(12) {
        // A metadata value.
        0..=3 if !g.kv.is_empty() => {
            let i = rng.below(g.kv.len());
            g.kv[i].1 = edge_gguf_value(rng, Some(&g.kv[i].1));
        }
        // An entry of an array (tokens, token types, merges).
        4 | 5 => {
            let arrays: Vec<usize> = (0..g.kv.len())
                .filter(|&i| matches!(g.kv[i].1, GgufValue::Array(_)))
                .collect();
            if let Some(&i) = arrays.get(rng.below(arrays.len().max(1))) {
                if let GgufValue::Array(items) = &mut g.kv[i].1 {
                    let like = items.first().cloned();
                    match rng.below(4) {
                        0 if !items.is_empty() => {
                            let at = rng.below(items.len());
                            items[at] = match &like {
                                Some(GgufValue::String(_)) => GgufValue::String(edge_string(rng)),
                                _ => edge_gguf_value(rng, like.as_ref()),
                            };
                        }
                        1 => items.truncate(rng.below(items.len() + 1)),
                        2 if !items.is_empty() => {
                            let e = items[rng.below(items.len())].clone();
                            for _ in 0..rng.below(300) {
                                items.push(e.clone());
                            }
                        }
                        _ => {
                            if let Some(e) = like {
                                items.insert(0, e);
                            }
                        }
                    }
                }
            }
        }
        // Add, remove or duplicate a key.
        6 => {
            let key = rng.pick(&GGUF_KEYS).to_string();
            let like = g.kv.iter().find(|(k, _)| *k == key).map(|(_, v)| v.clone());
            let v = edge_gguf_value(rng, like.as_ref());
            g.kv.retain(|(k, _)| *k != key);
            g.kv.push((key, v));
        }
        7 if !g.kv.is_empty() => {
            let i = rng.below(g.kv.len());
            if rng.chance(50) {
                g.kv.remove(i);
            } else {
                let e = g.kv[i].clone();
                g.kv.push(e);
            }
        }
        // A tensor's dims, type, offset or name.
        8..=10 if !g.tensors.is_empty() => {
            let i = rng.below(g.tensors.len());
            let t = &mut g.tensors[i];
            match rng.below(6) {
                0 => {
                    if !t.1.is_empty() {
                        let d = rng.below(t.1.len());
                        t.1[d] = edge_int(rng) as u64;
                    }
                }
                1 => {
                    if rng.chance(50) {
                        t.1.push(1 + rng.below(3) as u64);
                    } else {
                        t.1.pop();
                    }
                }
                2 => t.2 = *rng.pick(&[0, 1, 2, 3, 8, 12, 30, 31, 99, u32::MAX]),
                3 => t.3 = Some(edge_int(rng) as u64),
                4 => t.0 = rng.pick(&TENSOR_NAMES).to_string(),
                _ => t.0 = edge_string(rng),
            }
        }
        // Remove or duplicate a tensor.
        _ if !g.tensors.is_empty() => {
            let i = rng.below(g.tensors.len());
            if rng.chance(50) {
                g.tensors.remove(i);
            } else {
                let mut t = g.tensors[i].clone();
                t.0 = rng.pick(&TENSOR_NAMES).to_string();
                g.tensors.push(t);
            }
        }
        _ => g.version = edge_int(rng) as u32,
    }
}

// ---------------------------------------------------------------------------------------------
// Safetensors

fn split_safetensors(bytes: &[u8]) -> (Value, Vec<u8>) {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    (header, bytes[8 + n..].to_vec())
}

fn join_safetensors(header: &[u8], data: &[u8]) -> Vec<u8> {
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header);
    out.extend_from_slice(data);
    out
}

const SAFETENSORS_KEYS: [&str; 5] = [
    "dtype",
    "shape",
    "data_offsets",
    "__metadata__",
    "model.norm.weight",
];

fn mutated_safetensors(rng: &mut Rng, seed: &[u8]) -> Vec<u8> {
    let (mut header, data) = split_safetensors(seed);
    for _ in 0..1 + rng.below(3) {
        // Tensor entries are what matter: aim most edits at one.
        let names: Vec<String> = header
            .as_object()
            .map(|m| m.keys().cloned().collect())
            .unwrap_or_default();
        if rng.chance(70) && !names.is_empty() {
            let name = rng.pick(&names).clone();
            // An earlier edit may have made the entry a non-object, which `[]` cannot index.
            if let Some(entry) = header.get_mut(&name).filter(|e| e.is_object()) {
                match rng.below(6) {
                    0 => {
                        entry["dtype"] = json!(rng.pick(&[
                            "F32", "F16", "BF16", "I32", "F64", "U8", "BOOL", "F8_E4M3", "Q4", ""
                        ]))
                    }
                    1 => {
                        if let Some(Value::Array(dims)) = entry.get_mut("shape") {
                            if !dims.is_empty() && rng.chance(70) {
                                let d = rng.below(dims.len());
                                dims[d] = edge_json_int(rng);
                            } else {
                                dims.push(edge_json_int(rng));
                            }
                        }
                    }
                    2 => {
                        if let Some(Value::Array(o)) = entry.get_mut("data_offsets") {
                            if !o.is_empty() {
                                let d = rng.below(o.len());
                                o[d] = edge_json_int(rng);
                            }
                        }
                    }
                    3 => {
                        // Rename: to another tensor's name, or to hostile text.
                        let e = header.as_object_mut().and_then(|m| m.remove(&name));
                        let to = if rng.chance(50) {
                            rng.pick(&names).clone()
                        } else {
                            edge_string(rng)
                        };
                        if let (Some(e), Some(m)) = (e, header.as_object_mut()) {
                            m.insert(to, e);
                        }
                    }
                    _ => mutate_json(rng, entry, &SAFETENSORS_KEYS),
                }
            }
        } else {
            mutate_json(rng, &mut header, &SAFETENSORS_KEYS);
        }
    }
    let mut out = join_safetensors(&serde_json::to_vec(&header).unwrap_or_default(), &data);
    if rng.chance(20) {
        // The header length, or any byte.
        if rng.chance(50) {
            out[..8].copy_from_slice(&(edge_int(rng) as u64).to_le_bytes());
        } else {
            mutate_bytes(rng, &mut out);
        }
    }
    out
}

fn edge_json_int(rng: &mut Rng) -> Value {
    let i = edge_int(rng);
    i64::try_from(i)
        .map(|v| json!(v))
        .or_else(|_| u64::try_from(i).map(|v| json!(v)))
        .unwrap_or(json!(-1))
}

// ---------------------------------------------------------------------------------------------
// Chat templates

/// Pieces of Jinja that real templates use, and some that break them. Loop bounds stay small:
/// a template that is merely expensive is bounded by the renderer's own limits, not tested
/// here by waiting; strings that double per step are what those limits must stop.
const TEMPLATE_PIECES: [&str; 37] = [
    "{% set ns = namespace(s=messages[0].content) %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
    "{% set s = message.content ~ message.content %}{% set s = s + s %}{% set s = s * 3 %}{{ s }}",
    "{{ messages[0].content * 100000 }}",
    "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s|replace('a', 'aa') %}{% endfor %}",
    "{% set ns = namespace(s='\\\\') %}{% for i in range(40) %}{% set ns.s = ns.s|tojson %}{% endfor %}",
    "{% macro d(s, n) %}{% if n %}{{ d(s ~ s, n - 1) }}{% endif %}{% endmacro %}{{ d(bos_token ~ 'x', 40) }}",
    "{{ ([message.content] * 1000)|join(message.content * 1000) }}",
    "{% for message in messages %}",
    "{% endfor %}",
    "{{ message['role'] }}",
    "{{ message.content }}",
    "{{ messages[0]['content'] }}",
    "{{ messages[-1].content.strip() }}",
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    "{% if loop.first %}",
    "{% endif %}",
    "{% else %}",
    "{{ bos_token }}",
    "{{ eos_token }}",
    "{{ raise_exception('no') }}",
    "{% set x = messages|length %}{{ x }}",
    "{{ messages|tojson }}",
    "{% for i in range(50) %}{% for j in range(50) %}{{ j }}{% endfor %}{% endfor %}",
    "{{ message.content.split(' ')[0] }}",
    "{{ 'a' * 1000 }}",
    "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
    "{{ 1 / 0 }}",
    "{{ messages[99999] }}",
    "{{ undefined_thing.attr }}",
    "<|im_start|>",
    "<|im_end|>\n",
    "{{",
    "}}",
    "{%",
    "{# comment #}",
    "{{ message.content|upper|replace('A', 'B') }}",
    "{% set ns = namespace(a=1) %}{% set ns.a = ns.a + 1 %}{{ ns.a }}",
];

fn random_template(rng: &mut Rng, original: &str) -> String {
    let mut t = if rng.chance(50) {
        original.to_string()
    } else {
        String::new()
    };
    for _ in 0..1 + rng.below(8) {
        let piece = if rng.chance(85) {
            rng.pick(&TEMPLATE_PIECES).to_string()
        } else {
            edge_string(rng)
        };
        let mut at = rng.below(t.len() + 1);
        while !t.is_char_boundary(at) {
            at -= 1;
        }
        t.insert_str(at, &piece);
    }
    t
}

// ---------------------------------------------------------------------------------------------
// Formats and cases

/// What a case mutates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Gguf,
    Safetensors,
    Config,
    Tokenizer,
    ChatTemplate,
}

impl Format {
    pub const ALL: [Format; 5] = [
        Format::Gguf,
        Format::Safetensors,
        Format::Config,
        Format::Tokenizer,
        Format::ChatTemplate,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Format::Gguf => "gguf",
            Format::Safetensors => "safetensors",
            Format::Config => "config",
            Format::Tokenizer => "tokenizer",
            Format::ChatTemplate => "chat_template",
        }
    }
}

const CONFIG_KEYS: [&str; 30] = [
    "model_type",
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "rms_norm_eps",
    "rope_theta",
    "rope_parameters",
    "rope_scaling",
    "max_position_embeddings",
    "tie_word_embeddings",
    "attention_bias",
    "final_logit_softcapping",
    "bos_token_id",
    "eos_token_id",
    "n_layer",
    "n_head",
    "n_kv_head",
    "n_embd",
    "sequence_len",
    "window_sizes",
    "value_embed_layers",
    "padded_vocab_size",
    "ve_gate_channels",
    "softcap",
    "backout_layer",
    "qk_scale",
];

const TOKENIZER_KEYS: [&str; 12] = [
    "decoder",
    "pre_tokenizer",
    "normalizer",
    "post_processor",
    "added_tokens",
    "model",
    "type",
    "vocab",
    "merges",
    "id",
    "content",
    "special",
];

/// Structured rope settings and decoders are rare under random edits; these put them in.
fn rope_object(rng: &mut Rng) -> Value {
    let kind = rng.pick(&["linear", "llama3", "default", "yarn", ""]);
    let mut o = json!({"rope_type": kind, "factor": rng.pick(&EDGE_FLOATS),
        "low_freq_factor": rng.pick(&[1.0, 4.0, 0.0]), "high_freq_factor": rng.pick(&[4.0, 1.0, 0.0]),
        "original_max_position_embeddings": rng.pick(&[8192.0, 0.0, -1.0])});
    if rng.chance(30) {
        o["rope_theta"] = json!(rng.pick(&EDGE_FLOATS));
    }
    o
}

fn decoder_object(rng: &mut Rng) -> Value {
    let leaf = |rng: &mut Rng| match rng.below(5) {
        0 => {
            json!({"type": "Strip", "content": rng.pick(&[" ", "a", "Ġ"]), "start": rng.below(3), "stop": rng.below(3)})
        }
        1 => {
            json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true})
        }
        2 => json!({"type": "Replace", "pattern": {"String": "▁"}, "content": " "}),
        3 => json!({"type": "ByteFallback"}),
        _ => {
            json!({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": true})
        }
    };
    if rng.chance(40) {
        json!({"type": "Sequence", "decoders": (0..1 + rng.below(3)).map(|_| leaf(rng)).collect::<Vec<_>>()})
    } else {
        leaf(rng)
    }
}

/// One file of a case: new bytes, or a fixture file left as it is (linked, not copied, so a
/// case costs what it changes).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Content {
    Bytes(Vec<u8>),
    Fixture(PathBuf),
}

/// Fixtures every case starts from, read once.
pub struct Seeds {
    fixtures: PathBuf,
    gguf: Vec<Gguf>,
    /// Per fixture directory: its files.
    dirs: Vec<(String, Vec<(String, Content)>)>,
}

impl Seeds {
    pub fn load() -> Seeds {
        // The kiln crate's directory, or (for the cargo-fuzz crate) its parent.
        let here = Path::new(env!("CARGO_MANIFEST_DIR"));
        let fixtures = [here, here.parent().unwrap_or(here)]
            .map(|d| d.join("tests/fixtures"))
            .into_iter()
            .find(|d| d.is_dir())
            .unwrap_or_else(|| here.join("tests/fixtures"));
        let gguf = [
            "llama_tied.q4_1.gguf",
            "llama_tied.q8_0.gguf",
            "llama_tied.bf16.gguf",
        ]
        .iter()
        .map(|f| Gguf::read(&fixtures.join(f)))
        .collect();
        let dirs = [
            "llama_tied",
            "qwen2",
            "llama_untied",
            "llama_untied_sharded",
            "nanochat",
            "nanochat_A",
            "nanochat_H",
        ]
        .iter()
        .map(|d| {
            let mut files: Vec<(String, Content)> = std::fs::read_dir(fixtures.join(d))
                .unwrap()
                .map(|e| e.unwrap())
                .filter(|e| e.file_name() != "reference.safetensors")
                .map(|e| {
                    (
                        e.file_name().to_string_lossy().into_owned(),
                        Content::Fixture(e.path()),
                    )
                })
                .collect();
            files.sort_by(|a, b| a.0.cmp(&b.0));
            (d.to_string(), files)
        })
        .collect();
        Seeds {
            fixtures,
            gguf,
            dirs,
        }
    }

    fn dir(&self, rng: &mut Rng, only: &[&str]) -> Vec<(String, Content)> {
        let candidates: Vec<_> = self
            .dirs
            .iter()
            .filter(|(n, _)| only.is_empty() || only.contains(&n.as_str()))
            .collect();
        rng.pick(&candidates).1.clone()
    }
}

/// One generated input: the files to write, and whether it is a single file (GGUF) or a
/// directory.
pub struct Case {
    pub files: Vec<(String, Content)>,
    pub single_file: bool,
}

fn replace(files: &mut [(String, Content)], name: &str, f: impl FnOnce(&[u8]) -> Vec<u8>) {
    if let Some(e) = files.iter_mut().find(|(n, _)| n == name) {
        let bytes = match &e.1 {
            Content::Bytes(b) => b.clone(),
            Content::Fixture(p) => std::fs::read(p).unwrap_or_default(),
        };
        e.1 = Content::Bytes(f(&bytes));
    }
}

/// The `case`-th input of a format from `rng`.
pub fn generate(format: Format, seeds: &Seeds, rng: &mut Rng) -> Case {
    match format {
        Format::Gguf => {
            let mut g = rng.pick(&seeds.gguf).clone();
            for _ in 0..1 + rng.below(3) {
                mutate_gguf(rng, &mut g);
            }
            let mut bytes = g.to_bytes();
            if rng.chance(20) {
                mutate_bytes(rng, &mut bytes);
            }
            Case {
                files: vec![("model.gguf".into(), Content::Bytes(bytes))],
                single_file: true,
            }
        }
        Format::Safetensors => {
            let mut files = seeds.dir(
                rng,
                &["llama_tied", "qwen2", "llama_untied_sharded", "nanochat_H"],
            );
            let shards: Vec<String> = files
                .iter()
                .map(|(n, _)| n.clone())
                .filter(|n| n.ends_with(".safetensors"))
                .collect();
            if files
                .iter()
                .any(|(n, _)| n == "model.safetensors.index.json")
                && rng.chance(30)
            {
                replace(&mut files, "model.safetensors.index.json", |b| {
                    let doc: Value = serde_json::from_slice(b).unwrap();
                    mutated_json_text(
                        rng,
                        doc,
                        &["weight_map", "model.norm.weight", "lm_head.weight"],
                    )
                });
            } else {
                let shard = rng.pick(&shards).clone();
                replace(&mut files, &shard, |b| mutated_safetensors(rng, b));
            }
            Case {
                files,
                single_file: false,
            }
        }
        Format::Config => {
            let mut files = seeds.dir(rng, &[]);
            let name = if rng.chance(15) && files.iter().any(|(n, _)| n == "generation_config.json")
            {
                "generation_config.json"
            } else {
                "config.json"
            };
            replace(&mut files, name, |b| {
                let mut doc: Value = serde_json::from_slice(b).unwrap();
                if rng.chance(20) {
                    let key = *rng.pick(&["rope_parameters", "rope_scaling"]);
                    doc[key] = rope_object(rng);
                }
                mutated_json_text(rng, doc, &CONFIG_KEYS)
            });
            Case {
                files,
                single_file: false,
            }
        }
        Format::Tokenizer => {
            let mut files = seeds.dir(rng, &["llama_tied", "nanochat_H"]);
            replace(&mut files, "tokenizer.json", |b| {
                let mut doc: Value = serde_json::from_slice(b).unwrap();
                if rng.chance(30) {
                    doc["decoder"] = decoder_object(rng);
                }
                // An edit inside the 400-entry vocabulary almost always just breaks it; aim most
                // edits at the pipeline around it (and the added tokens, merges, model flags).
                let part = *rng.pick(&[
                    "decoder",
                    "pre_tokenizer",
                    "normalizer",
                    "post_processor",
                    "added_tokens",
                    "model",
                    "",
                ]);
                let mut bytes = match doc.get_mut(part) {
                    Some(sub) if rng.chance(70) => {
                        if part == "model" {
                            for k in ["vocab", "merges"] {
                                if let Some(v) = sub.get_mut(k) {
                                    if rng.chance(30) {
                                        mutate_json(rng, v, &[]);
                                    }
                                }
                            }
                            if let Some(m) = sub.as_object_mut() {
                                let key = *rng.pick(&[
                                    "unk_token",
                                    "byte_fallback",
                                    "dropout",
                                    "fuse_unk",
                                    "continuing_subword_prefix",
                                    "ignore_merges",
                                    "type",
                                ]);
                                m.insert(key.to_string(), edge_json(rng, 1));
                            }
                        } else {
                            mutate_json(rng, sub, &TOKENIZER_KEYS);
                        }
                        serde_json::to_vec(&doc).unwrap_or_default()
                    }
                    _ => mutated_json_text(rng, doc, &TOKENIZER_KEYS),
                };
                if rng.chance(5) {
                    mutate_bytes(rng, &mut bytes);
                }
                bytes
            });
            Case {
                files,
                single_file: false,
            }
        }
        Format::ChatTemplate => {
            let mut files = seeds.dir(rng, &["llama_tied"]);
            replace(&mut files, "tokenizer_config.json", |b| {
                let mut doc: Value = serde_json::from_slice(b).unwrap();
                let original = doc["chat_template"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string();
                doc["chat_template"] = Value::String(random_template(rng, &original));
                if rng.chance(30) {
                    mutated_json_text(
                        rng,
                        doc,
                        &["chat_template", "bos_token", "eos_token", "add_bos_token"],
                    )
                } else {
                    serde_json::to_vec(&doc).unwrap_or_default()
                }
            });
            Case {
                files,
                single_file: false,
            }
        }
    }
}

impl Case {
    /// Writes the case under `dir` (emptied first) and returns the path to load.
    pub fn write(&self, dir: &Path) -> std::io::Result<PathBuf> {
        if dir.exists() {
            std::fs::remove_dir_all(dir)?;
        }
        std::fs::create_dir_all(dir)?;
        for (name, content) in &self.files {
            match content {
                Content::Bytes(bytes) => std::fs::write(dir.join(name), bytes)?,
                #[cfg(unix)]
                Content::Fixture(p) => std::os::unix::fs::symlink(p, dir.join(name))?,
                #[cfg(not(unix))]
                Content::Fixture(p) => std::fs::copy(p, dir.join(name)).map(|_| ())?,
            }
        }
        Ok(if self.single_file {
            dir.join(&self.files[0].0)
        } else {
            dir.to_path_buf()
        })
    }
}

/// How a case ended when it did not panic.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The loader refused the input with a typed error.
    Refused,
    /// The model loaded, and the tokenizer and a short generation ran (or refused cleanly).
    Loaded,
}

/// Runs one written case in-process: load; on success exercise the tokenizer (encode, decode
/// every id, the chat template) and generate two tokens. A panic propagates to the caller.
pub fn exercise(path: &Path, format: Format) -> Outcome {
    let Ok(model) = Model::load(path) else {
        return Outcome::Refused;
    };
    let tok = &model.tokenizer;
    let messages = [
        ChatMessage::new("system", "be brief"),
        ChatMessage::new("user", "hello \u{1b}[2J 42 é"),
    ];
    let _ = tok.chat_prompt(&messages);
    if format == Format::ChatTemplate {
        let _ = tok.apply_chat_template(&messages[1..], false);
        return Outcome::Loaded;
    }
    let _ = tok.encode("hello world 42 <|im_start|> é🎉");
    // One decode of every id reaches each token's decoder path; a few alone and past the end.
    let vocab = tok.vocab_size().min(1 << 16) as u32;
    let _ = tok.decode(&(0..vocab).collect::<Vec<u32>>());
    for id in [0, 1, vocab / 2, vocab.saturating_sub(1), vocab, u32::MAX] {
        let _ = tok.decode(&[id]);
    }
    let Ok(engine) = Engine::from_model(
        model,
        CpuOptions {
            threads: 1,
            ..Default::default()
        },
    ) else {
        return Outcome::Loaded;
    };
    let engine = Arc::new(engine);
    let prompt = engine.tokenizer().encode("hi").unwrap_or_default();
    let opts = GenerateOptions {
        max_tokens: Some(2),
        sampling: SamplingParams {
            temperature: 1.0,
            seed: 7,
            ..Default::default()
        },
        ..Default::default()
    };
    let _ = engine.generate_batch(&prompt, &opts);
    Outcome::Loaded
}

/// A panic's message, for reports.
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".into())
}

/// Generates, writes and runs one case, catching a panic; `Err` carries its message.
pub fn run_one(
    format: Format,
    seeds: &Seeds,
    rng: &mut Rng,
    dir: &Path,
) -> Result<Outcome, String> {
    let case = catch_unwind(AssertUnwindSafe(|| generate(format, seeds, rng)))
        .map_err(|p| format!("the mutator itself panicked: {}", panic_message(p.as_ref())))?;
    let path = case
        .write(dir)
        .map_err(|e| format!("could not write the case to {}: {e}", dir.display()))?;
    catch_unwind(AssertUnwindSafe(|| exercise(&path, format)))
        .map_err(|p| panic_message(p.as_ref()))
}

//! A minimal GGUF writer for tests, so fixtures are built in code next to the assertions that use
//! them instead of being binary files nobody can review.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use super::reader::{write_gguf_string, GgufValue, DEFAULT_ALIGNMENT, GGUF_MAGIC};
use crate::tokenizer::byte_to_char;

pub(crate) struct GgufWriter {
    pub version: u32,
    pub alignment: u64,
    pub kv: Vec<(String, GgufValue)>,
    /// (name, ggml dims, ggml type id, raw data)
    pub tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)>,
}

impl GgufWriter {
    pub fn new() -> Self {
        GgufWriter {
            version: 3,
            alignment: DEFAULT_ALIGNMENT,
            kv: Vec::new(),
            tensors: Vec::new(),
        }
    }

    pub fn kv(&mut self, key: &str, value: GgufValue) -> &mut Self {
        self.kv.retain(|(k, _)| k != key);
        self.kv.push((key.to_string(), value));
        self
    }

    pub fn remove_kv(&mut self, key: &str) -> &mut Self {
        self.kv.retain(|(k, _)| k != key);
        self
    }

    pub fn tensor(&mut self, name: &str, dims: &[u64], ty: u32, data: Vec<u8>) -> &mut Self {
        self.tensors
            .push((name.to_string(), dims.to_vec(), ty, data));
        self
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let align = |n: usize| n.div_ceil(self.alignment as usize) * self.alignment as usize;
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
        for (name, dims, ty, data) in &self.tensors {
            write_gguf_string(&mut out, name);
            out.extend_from_slice(&(dims.len() as u32).to_le_bytes());
            for d in dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&ty.to_le_bytes());
            out.extend_from_slice(&(offset as u64).to_le_bytes());
            offset = align(offset + data.len());
        }
        out.resize(align(out.len()), 0);
        let data_start = out.len();
        for (_, _, _, data) in &self.tensors {
            out.resize(data_start + align(out.len() - data_start), 0);
            out.extend_from_slice(data);
        }
        out
    }

    pub fn write_temp(&self, tag: &str) -> TempFile {
        let file = TempFile::new(tag);
        std::fs::write(&file.0, self.to_bytes()).expect("write test GGUF");
        file
    }
}

/// A uniquely named file in the temp directory, removed on drop.
pub(crate) struct TempFile(pub PathBuf);

impl TempFile {
    pub fn new(tag: &str) -> TempFile {
        static N: AtomicUsize = AtomicUsize::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        TempFile(
            std::env::temp_dir().join(format!("kiln-test-{}-{n}-{tag}.gguf", std::process::id())),
        )
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Ids of the test tokenizer's extra tokens; they follow the 256 byte tokens, `he` (256) and `ll` (257).
pub(crate) const TOK_HELL: u32 = 258;
pub(crate) const TOK_42: u32 = 259;
pub(crate) const TOK_IM_START: u32 = 260;
pub(crate) const TOK_IM_END: u32 = 261;
pub(crate) const TOK_USER: u32 = 262;

/// Adds a small byte-level BPE tokenizer: the 256 byte tokens (id = byte), merges building "hell"
/// and "42", two control tokens and one user-defined token.
pub(crate) fn add_test_tokenizer(w: &mut GgufWriter, pre: Option<&str>) {
    let s = |x: &str| GgufValue::String(x.to_string());
    let mut tokens: Vec<GgufValue> = (0..=255u8)
        .map(|b| GgufValue::String(byte_to_char(b).to_string()))
        .collect();
    let mut types = vec![GgufValue::I32(1); 256];
    for (t, ty) in [
        ("he", 1),
        ("ll", 1),
        ("hell", 1),
        ("42", 1),
        ("<|im_start|>", 3),
        ("<|im_end|>", 3),
        ("<tool>", 4),
    ] {
        tokens.push(s(t));
        types.push(GgufValue::I32(ty));
    }
    let merges = ["h e", "l l", "he ll", "4 2"].map(s).to_vec();
    w.kv("tokenizer.ggml.model", s("gpt2"))
        .kv("tokenizer.ggml.tokens", GgufValue::Array(tokens))
        .kv("tokenizer.ggml.token_type", GgufValue::Array(types))
        .kv("tokenizer.ggml.merges", GgufValue::Array(merges))
        .kv("tokenizer.ggml.bos_token_id", GgufValue::U32(TOK_IM_START))
        .kv("tokenizer.ggml.eos_token_id", GgufValue::U32(TOK_IM_END))
        .kv("tokenizer.ggml.add_bos_token", GgufValue::Bool(false))
        .kv(
            "tokenizer.chat_template",
            s("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"),
        );
    match pre {
        Some(p) => w.kv("tokenizer.ggml.pre", s(p)),
        None => w.remove_kv("tokenizer.ggml.pre"),
    };
}

//! A minimal GGUF writer for tests, so fixtures are built in code next to the assertions that use
//! them instead of being binary files nobody can review.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use super::{write_gguf_string, GgufValue, DEFAULT_ALIGNMENT, GGUF_MAGIC};

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

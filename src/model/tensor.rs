//! Named weight tensors as they come off disk. Safetensors and unquantized GGUF tensors stay
//! memory-mapped; quantized GGUF tensors are dequantized into owned f32 at load. Backends pack
//! these into their own layouts, so this type only has to describe bytes faithfully.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use half::{bf16, f16};
use memmap2::Mmap;

use super::LoadError;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    F32,
    F16,
    BF16,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
        })
    }
}

/// Where a tensor's bytes live.
#[derive(Clone)]
pub enum TensorBytes {
    Mapped {
        map: Arc<Mmap>,
        offset: usize,
        len: usize,
    },
    Owned(Arc<Vec<u8>>),
}

impl TensorBytes {
    pub fn as_slice(&self) -> &[u8] {
        match self {
            TensorBytes::Mapped { map, offset, len } => &map[*offset..*offset + *len],
            TensorBytes::Owned(v) => v,
        }
    }
}

/// One named tensor, row-major, PyTorch dimension order (`[out, in]` for linear weights).
#[derive(Clone)]
pub struct Tensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: DType,
    pub bytes: TensorBytes,
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Tensor({} {:?} {})", self.name, self.shape, self.dtype)
    }
}

impl Tensor {
    /// An owned f32 tensor, e.g. the result of dequantization.
    pub fn from_f32(name: impl Into<String>, shape: Vec<usize>, data: Vec<f32>) -> Tensor {
        debug_assert_eq!(shape.iter().product::<usize>(), data.len());
        Tensor {
            name: name.into(),
            shape,
            dtype: DType::F32,
            bytes: TensorBytes::Owned(Arc::new(bytemuck::cast_slice(&data).to_vec())),
        }
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn raw(&self) -> &[u8] {
        self.bytes.as_slice()
    }

    /// Values widened to f32 (exact for every supported dtype).
    pub fn to_f32_vec(&self) -> Vec<f32> {
        let raw = self.raw();
        match self.dtype {
            DType::F32 => raw
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            DType::F16 => raw
                .chunks_exact(2)
                .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            DType::BF16 => raw
                .chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
        }
    }

    /// Values as bf16: a copy of the stored bits when the tensor is bf16, else rounded to nearest.
    pub fn to_bf16_vec(&self) -> Vec<bf16> {
        match self.dtype {
            DType::BF16 => self
                .raw()
                .chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]))
                .collect(),
            _ => self.to_f32_vec().into_iter().map(bf16::from_f32).collect(),
        }
    }
}

/// Every tensor of a model by name, plus the file they came from (for error messages).
#[derive(Clone, Default)]
pub struct Weights {
    pub source: PathBuf,
    pub tensors: BTreeMap<String, Tensor>,
}

impl Weights {
    pub fn new(source: impl AsRef<Path>) -> Weights {
        Weights {
            source: source.as_ref().to_path_buf(),
            tensors: BTreeMap::new(),
        }
    }

    pub fn insert(&mut self, t: Tensor) {
        self.tensors.insert(t.name.clone(), t);
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    pub fn get(&self, name: &str) -> Result<&Tensor, LoadError> {
        self.tensors
            .get(name)
            .ok_or_else(|| LoadError::MissingTensor {
                path: self.source.clone(),
                name: name.to_string(),
            })
    }

    /// The tensor, checked against the shape the architecture requires.
    pub fn get_shaped(&self, name: &str, expected: &[usize]) -> Result<&Tensor, LoadError> {
        let t = self.get(name)?;
        if t.shape != expected {
            return Err(LoadError::Shape {
                path: self.source.clone(),
                name: name.to_string(),
                expected: expected.to_vec(),
                found: t.shape.clone(),
            });
        }
        Ok(t)
    }

    /// Parameters: elements of every tensor (a tied embedding counts once).
    pub fn num_params(&self) -> usize {
        self.tensors.values().map(Tensor::numel).sum()
    }

    /// Total bytes of all tensors as stored.
    pub fn stored_bytes(&self) -> usize {
        self.tensors.values().map(|t| t.raw().len()).sum()
    }
}

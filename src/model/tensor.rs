//! Named weight tensors as they come off disk. Safetensors and GGUF tensors stay memory-mapped,
//! including GGUF's quantized block formats (see [`super::quant`]), whose raw bytes are ggml's blocks.
//! Backends pack these into their own layouts, so this type only has to describe bytes faithfully.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use half::{bf16, f16};
use memmap2::Mmap;

use super::quant::{self, QuantKind};
use super::LoadError;

/// How a tensor's elements are stored (quantized formats carry ggml's names, e.g. `Q4_K`).
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    F32,
    F16,
    BF16,
    /// ggml Q8_0 blocks (see [`quant`]).
    Q8_0,
    /// ggml Q4_0 blocks.
    Q4_0,
    /// ggml Q4_1 blocks.
    Q4_1,
    /// ggml Q5_0 blocks.
    Q5_0,
    /// ggml Q5_1 blocks.
    Q5_1,
    /// ggml Q2_K super-blocks.
    Q2_K,
    /// ggml Q3_K super-blocks.
    Q3_K,
    /// ggml Q4_K super-blocks.
    Q4_K,
    /// ggml Q5_K super-blocks.
    Q5_K,
    /// ggml Q6_K super-blocks.
    Q6_K,
    /// ggml Q8_K super-blocks.
    Q8_K,
}

impl DType {
    /// The block format, for quantized dtypes.
    pub fn quant(self) -> Option<QuantKind> {
        match self {
            DType::Q8_0 => Some(QuantKind::Q8_0),
            DType::Q4_0 => Some(QuantKind::Q4_0),
            DType::Q4_1 => Some(QuantKind::Q4_1),
            DType::Q5_0 => Some(QuantKind::Q5_0),
            DType::Q5_1 => Some(QuantKind::Q5_1),
            DType::Q2_K => Some(QuantKind::Q2_K),
            DType::Q3_K => Some(QuantKind::Q3_K),
            DType::Q4_K => Some(QuantKind::Q4_K),
            DType::Q5_K => Some(QuantKind::Q5_K),
            DType::Q6_K => Some(QuantKind::Q6_K),
            DType::Q8_K => Some(QuantKind::Q8_K),
            DType::F32 | DType::F16 | DType::BF16 => None,
        }
    }

    /// The dtype that stores blocks of `kind`.
    pub fn from_quant(kind: QuantKind) -> DType {
        match kind {
            QuantKind::Q8_0 => DType::Q8_0,
            QuantKind::Q4_0 => DType::Q4_0,
            QuantKind::Q4_1 => DType::Q4_1,
            QuantKind::Q5_0 => DType::Q5_0,
            QuantKind::Q5_1 => DType::Q5_1,
            QuantKind::Q2_K => DType::Q2_K,
            QuantKind::Q3_K => DType::Q3_K,
            QuantKind::Q4_K => DType::Q4_K,
            QuantKind::Q5_K => DType::Q5_K,
            QuantKind::Q6_K => DType::Q6_K,
            QuantKind::Q8_K => DType::Q8_K,
        }
    }

    pub fn is_quantized(self) -> bool {
        self.quant().is_some()
    }

    /// Bytes that `numel` elements occupy, or `None` when a quantized dtype's `numel` is not a
    /// whole number of blocks.
    pub fn bytes_for(self, numel: usize) -> Option<usize> {
        match self.quant() {
            Some(q) => q.bytes_for(numel),
            None if self == DType::F32 => numel.checked_mul(4),
            None => numel.checked_mul(2),
        }
    }

    /// Bytes of one row of `cols` elements (rows of quantized tensors are whole blocks; a
    /// partial block rounds up).
    pub fn row_bytes(self, cols: usize) -> usize {
        match self.quant() {
            Some(q) => cols.div_ceil(q.block_elems()) * q.block_bytes(),
            None => self.bytes_for(cols).unwrap_or(usize::MAX),
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match (self, self.quant()) {
            (_, Some(q)) => q.name(),
            (DType::F32, None) => "f32",
            (DType::F16, None) => "f16",
            (_, None) => "bf16",
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

    /// Values widened to f32 (exact for float dtypes; quantized blocks are dequantized exactly as
    /// ggml's reference code does).
    pub fn to_f32_vec(&self) -> Vec<f32> {
        let raw = self.raw();
        match (self.dtype, self.dtype.quant()) {
            (_, Some(kind)) => quant::dequantize(kind, raw, self.numel()).unwrap_or_else(|| {
                panic!(
                    "{}: {} bytes are not {} {} elements",
                    self.name,
                    raw.len(),
                    self.numel(),
                    kind.name()
                )
            }),
            (DType::F32, None) => raw
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            (DType::F16, None) => raw
                .chunks_exact(2)
                .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            (_, None) => raw
                .chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
        }
    }

    /// Values as bf16: a copy of the stored bits when the tensor is bf16, else rounded to nearest
    /// (from the dequantized value for quantized dtypes).
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

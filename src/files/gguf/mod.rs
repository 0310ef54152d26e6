//! The GGUF container: header, metadata key/values and tensor infos, parsed from a memory map.
//!
//! Every length, count and offset in the file is untrusted: reads are bounds-checked, arithmetic is
//! checked, and counts are compared against the bytes that remain before anything is allocated for
//! them, so a truncated or corrupt file yields a [`LoadError`] rather than a panic or an abort.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;

use crate::files::LoadError;

#[cfg(test)]
pub(crate) mod writer;

/// `GGUF` read as bytes; the file starts with it.
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
/// Alignment of the data section and of every tensor in it when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml tensors have at most four dimensions; more means the file is corrupt.
const MAX_DIMS: u32 = 4;
/// Most items reserved ahead for a metadata array or the tensor list (see [`Cursor::value`]).
const MAX_RESERVE: usize = 1 << 16;

/// One metadata value. Arrays hold scalars or strings; GGUF allows arrays of arrays but no model
/// uses them, so the reader rejects them instead of carrying an unused recursive case around.
#[derive(Clone, Debug, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<GgufValue>),
}

/// Appends a GGUF string: its length as a little-endian u64, then its bytes.
pub fn write_gguf_string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

impl GgufValue {
    /// Appends the value's GGUF encoding (without its type id; an array writes its element type
    /// and length first): the inverse of what the reader parses, for writers and fuzzers.
    pub fn write_to(&self, out: &mut Vec<u8>) {
        match self {
            GgufValue::U8(x) => out.push(*x),
            GgufValue::I8(x) => out.extend_from_slice(&x.to_le_bytes()),
            GgufValue::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
            GgufValue::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
            GgufValue::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
            GgufValue::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
            GgufValue::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
            GgufValue::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
            GgufValue::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
            GgufValue::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
            GgufValue::Bool(x) => out.push(*x as u8),
            GgufValue::String(s) => write_gguf_string(out, s),
            GgufValue::Array(items) => {
                let elem = items.first().map_or(0, GgufValue::type_id);
                out.extend_from_slice(&elem.to_le_bytes());
                out.extend_from_slice(&(items.len() as u64).to_le_bytes());
                for it in items {
                    it.write_to(out);
                }
            }
        }
    }

    /// The GGUF spec's name of the value's type, for error messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            GgufValue::U8(_) => "uint8",
            GgufValue::I8(_) => "int8",
            GgufValue::U16(_) => "uint16",
            GgufValue::I16(_) => "int16",
            GgufValue::U32(_) => "uint32",
            GgufValue::I32(_) => "int32",
            GgufValue::U64(_) => "uint64",
            GgufValue::I64(_) => "int64",
            GgufValue::F32(_) => "float32",
            GgufValue::F64(_) => "float64",
            GgufValue::Bool(_) => "bool",
            GgufValue::String(_) => "string",
            GgufValue::Array(_) => "array",
        }
    }

    /// The on-disk type id (`gguf_type` in ggml).
    pub fn type_id(&self) -> u32 {
        match self {
            GgufValue::U8(_) => 0,
            GgufValue::I8(_) => 1,
            GgufValue::U16(_) => 2,
            GgufValue::I16(_) => 3,
            GgufValue::U32(_) => 4,
            GgufValue::I32(_) => 5,
            GgufValue::F32(_) => 6,
            GgufValue::Bool(_) => 7,
            GgufValue::String(_) => 8,
            GgufValue::Array(_) => 9,
            GgufValue::U64(_) => 10,
            GgufValue::I64(_) => 11,
            GgufValue::F64(_) => 12,
        }
    }

    /// Any integer value. Writers disagree on widths (`uint32` vs `int32` vs `uint64` for the same
    /// key), so readers accept every integer kind and let range checks decide.
    pub fn as_i128(&self) -> Option<i128> {
        Some(match *self {
            GgufValue::U8(v) => v.into(),
            GgufValue::I8(v) => v.into(),
            GgufValue::U16(v) => v.into(),
            GgufValue::I16(v) => v.into(),
            GgufValue::U32(v) => v.into(),
            GgufValue::I32(v) => v.into(),
            GgufValue::U64(v) => v.into(),
            GgufValue::I64(v) => v.into(),
            _ => return None,
        })
    }

    /// Either float kind, widened.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            GgufValue::F32(v) => Some(v.into()),
            GgufValue::F64(v) => Some(v),
            _ => None,
        }
    }
}

/// A ggml tensor type id. Kept open (a newtype, not an enum) because files carry ids this crate
/// cannot decode; those must still be named in errors and have their byte ranges checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GgmlType(pub u32);

impl GgmlType {
    pub const F32: GgmlType = GgmlType(0);
    pub const F16: GgmlType = GgmlType(1);
    pub const Q4_0: GgmlType = GgmlType(2);
    pub const Q4_1: GgmlType = GgmlType(3);
    pub const Q5_0: GgmlType = GgmlType(6);
    pub const Q5_1: GgmlType = GgmlType(7);
    pub const Q8_0: GgmlType = GgmlType(8);
    pub const Q2_K: GgmlType = GgmlType(10);
    pub const Q3_K: GgmlType = GgmlType(11);
    pub const Q4_K: GgmlType = GgmlType(12);
    pub const Q5_K: GgmlType = GgmlType(13);
    pub const Q6_K: GgmlType = GgmlType(14);
    pub const Q8_K: GgmlType = GgmlType(15);
    pub const BF16: GgmlType = GgmlType(30);

    /// ggml's name and block layout (elements per block, bytes per block), from `ggml.c`'s
    /// `type_traits`. Ids that ggml removed or never assigned have none.
    fn traits(self) -> Option<(&'static str, u64, u64)> {
        Some(match self.0 {
            0 => ("F32", 1, 4),
            1 => ("F16", 1, 2),
            2 => ("Q4_0", 32, 18),
            3 => ("Q4_1", 32, 20),
            6 => ("Q5_0", 32, 22),
            7 => ("Q5_1", 32, 24),
            8 => ("Q8_0", 32, 34),
            9 => ("Q8_1", 32, 36),
            10 => ("Q2_K", 256, 84),
            11 => ("Q3_K", 256, 110),
            12 => ("Q4_K", 256, 144),
            13 => ("Q5_K", 256, 176),
            14 => ("Q6_K", 256, 210),
            15 => ("Q8_K", 256, 292),
            16 => ("IQ2_XXS", 256, 66),
            17 => ("IQ2_XS", 256, 74),
            18 => ("IQ3_XXS", 256, 98),
            19 => ("IQ1_S", 256, 50),
            20 => ("IQ4_NL", 32, 18),
            21 => ("IQ3_S", 256, 110),
            22 => ("IQ2_S", 256, 82),
            23 => ("IQ4_XS", 256, 136),
            24 => ("I8", 1, 1),
            25 => ("I16", 1, 2),
            26 => ("I32", 1, 4),
            27 => ("I64", 1, 8),
            28 => ("F64", 1, 8),
            29 => ("IQ1_M", 256, 56),
            30 => ("BF16", 1, 2),
            34 => ("TQ1_0", 256, 54),
            35 => ("TQ2_0", 256, 66),
            39 => ("MXFP4", 32, 17),
            _ => return None,
        })
    }

    /// ggml's name of the type (`"Q4_1"`), or `None` for an id ggml does not define.
    pub fn name(self) -> Option<&'static str> {
        self.traits().map(|t| t.0)
    }

    /// Elements per quantization block and bytes per block.
    pub fn block(self) -> Option<(u64, u64)> {
        self.traits().map(|t| (t.1, t.2))
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(n) => f.write_str(n),
            None => write!(f, "unknown ggml type {}", self.0),
        }
    }
}

/// Where one tensor lives and what it holds, as described by the file.
#[derive(Clone, Debug)]
pub struct GgufTensorInfo {
    pub name: String,
    /// ggml order: `dims[0]` is the innermost (contiguous) dimension.
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    /// Offset from the start of the data section, as stored.
    pub offset: u64,
    /// Absolute byte range in the file, validated against the file size at open.
    pub start: usize,
    pub len: usize,
}

impl GgufTensorInfo {
    /// PyTorch order (outermost first): ggml's `ne = [576, 49152]` is `[49152, 576]`.
    pub fn shape(&self) -> Vec<usize> {
        // Fits: `open` checked that the element count fits in usize.
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }

    pub fn numel(&self) -> usize {
        self.shape().iter().product()
    }
}

/// An opened GGUF file. Tensor data stays in the map; only metadata is parsed eagerly.
pub struct GgufFile {
    pub path: PathBuf,
    pub version: u32,
    pub metadata: BTreeMap<String, GgufValue>,
    /// In file order.
    pub tensors: Vec<GgufTensorInfo>,
    pub alignment: u64,
    /// Absolute offset of the data section.
    pub data_offset: usize,
    pub(crate) map: Arc<Mmap>,
}

impl fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "GgufFile({} v{}, {} keys, {} tensors)",
            self.path.display(),
            self.version,
            self.metadata.len(),
            self.tensors.len()
        )
    }
}

/// What parsing yields before the map is attached; separate so it can run on any byte slice.
pub(crate) struct Parsed {
    pub version: u32,
    pub metadata: BTreeMap<String, GgufValue>,
    pub tensors: Vec<GgufTensorInfo>,
    pub alignment: u64,
    pub data_offset: usize,
}

impl GgufFile {
    /// Maps the file and parses everything but the tensor data.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile, LoadError> {
        let path = path.as_ref();
        let file = crate::files::open_regular(path)?;
        // SAFETY: the map is read-only; like every mmap-based model loader, we rely on the file not
        // being truncated or rewritten while it is mapped.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| LoadError::io(path, e))?;
        let parsed = parse(path, &map)?;
        Ok(GgufFile {
            path: path.to_path_buf(),
            version: parsed.version,
            metadata: parsed.metadata,
            tensors: parsed.tensors,
            alignment: parsed.alignment,
            data_offset: parsed.data_offset,
            map: Arc::new(map),
        })
    }

    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.metadata.get(key)
    }

    pub fn tensor(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The tensor's stored bytes (in range: checked at open).
    pub fn tensor_data(&self, info: &GgufTensorInfo) -> &[u8] {
        self.map
            .get(info.start..info.start + info.len)
            .unwrap_or(&[])
    }

    fn required(&self, key: &str) -> Result<&GgufValue, LoadError> {
        self.get(key)
            .ok_or_else(|| LoadError::config(&self.path, key, "missing from GGUF metadata"))
    }

    fn wrong_type(&self, key: &str, expected: &str, found: &GgufValue) -> LoadError {
        LoadError::config(
            &self.path,
            key,
            format!("expected {expected}, found {}", found.type_name()),
        )
    }

    fn int_in<T: TryFrom<i128>>(&self, key: &str, v: &GgufValue, ty: &str) -> Result<T, LoadError> {
        let i = v.as_i128().ok_or_else(|| self.wrong_type(key, ty, v))?;
        T::try_from(i)
            .map_err(|_| LoadError::config(&self.path, key, format!("value {i} does not fit {ty}")))
    }

    pub fn get_u32(&self, key: &str) -> Result<u32, LoadError> {
        self.int_in(key, self.required(key)?, "an unsigned 32-bit integer")
    }

    pub fn get_u64(&self, key: &str) -> Result<u64, LoadError> {
        self.int_in(key, self.required(key)?, "an unsigned 64-bit integer")
    }

    pub fn get_f32(&self, key: &str) -> Result<f32, LoadError> {
        let v = self.required(key)?;
        v.as_f64()
            .map(|f| f as f32)
            .ok_or_else(|| self.wrong_type(key, "a float", v))
    }

    pub fn get_bool(&self, key: &str) -> Result<bool, LoadError> {
        match self.required(key)? {
            GgufValue::Bool(b) => Ok(*b),
            v => Err(self.wrong_type(key, "a bool", v)),
        }
    }

    pub fn get_str(&self, key: &str) -> Result<&str, LoadError> {
        match self.required(key)? {
            GgufValue::String(s) => Ok(s),
            v => Err(self.wrong_type(key, "a string", v)),
        }
    }

    fn get_array(&self, key: &str) -> Result<&[GgufValue], LoadError> {
        match self.required(key)? {
            GgufValue::Array(a) => Ok(a),
            v => Err(self.wrong_type(key, "an array", v)),
        }
    }

    pub fn get_str_array(&self, key: &str) -> Result<Vec<&str>, LoadError> {
        self.get_array(key)?
            .iter()
            .map(|v| match v {
                GgufValue::String(s) => Ok(s.as_str()),
                v => Err(self.wrong_type(key, "an array of strings", v)),
            })
            .collect()
    }

    pub fn get_int_array(&self, key: &str) -> Result<Vec<i64>, LoadError> {
        self.get_array(key)?
            .iter()
            .map(|v| self.int_in(key, v, "an array of 64-bit integers"))
            .collect()
    }

    /// `Ok(None)` when absent; a present value of the wrong type is still an error, since silently
    /// falling back to a default would run the model with the wrong hyper-parameter.
    pub fn opt_u32(&self, key: &str) -> Result<Option<u32>, LoadError> {
        self.get(key).map(|_| self.get_u32(key)).transpose()
    }

    pub fn opt_f32(&self, key: &str) -> Result<Option<f32>, LoadError> {
        self.get(key).map(|_| self.get_f32(key)).transpose()
    }

    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>, LoadError> {
        self.get(key).map(|_| self.get_bool(key)).transpose()
    }

    pub fn opt_str(&self, key: &str) -> Result<Option<&str>, LoadError> {
        self.get(key).map(|_| self.get_str(key)).transpose()
    }
}

/// Names a metadata value in truncation errors without formatting a string per array element.
struct ValueOf<'a>(&'a str);

impl fmt::Display for ValueOf<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "value of `{}`", self.0)
    }
}

/// A bounds-checked little-endian reader over the whole file.
struct Cursor<'a> {
    path: &'a Path,
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> usize {
        self.buf.len().saturating_sub(self.pos)
    }

    fn take(&mut self, n: usize, what: &dyn fmt::Display) -> Result<&'a [u8], LoadError> {
        let bytes = self
            .pos
            .checked_add(n)
            .and_then(|end| self.buf.get(self.pos..end))
            .ok_or_else(|| {
                LoadError::format(
                    self.path,
                    format!(
                        "truncated file: {what} needs {n} bytes at offset {}, file has {}",
                        self.pos,
                        self.buf.len()
                    ),
                )
            })?;
        self.pos += n;
        Ok(bytes)
    }

    fn array<const N: usize>(&mut self, what: &dyn fmt::Display) -> Result<[u8; N], LoadError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N, what)?);
        Ok(a)
    }

    fn u32(&mut self, what: &dyn fmt::Display) -> Result<u32, LoadError> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &dyn fmt::Display) -> Result<u64, LoadError> {
        self.array(what).map(u64::from_le_bytes)
    }

    /// A count that has to be backed by at least `min_size` bytes per item still in the file;
    /// checking it first keeps a corrupt count from driving a huge allocation.
    fn count(&mut self, min_size: usize, what: &dyn fmt::Display) -> Result<usize, LoadError> {
        let n = self.u64(what)?;
        match usize::try_from(n) {
            Ok(n)
                if n.checked_mul(min_size.max(1))
                    .is_some_and(|b| b <= self.remaining()) =>
            {
                Ok(n)
            }
            _ => Err(LoadError::format(
                self.path,
                format!(
                    "truncated or corrupt file: {what} claims {n} items at offset {}, more than \
                     the {} bytes left can hold",
                    self.pos - 8,
                    self.remaining()
                ),
            )),
        }
    }

    fn string(&mut self, what: &dyn fmt::Display) -> Result<String, LoadError> {
        let len = self.count(1, what)?;
        let at = self.pos;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| {
            LoadError::format(self.path, format!("{what}: invalid UTF-8 at offset {at}"))
        })
    }

    fn value(&mut self, ty: u32, key: &str, in_array: bool) -> Result<GgufValue, LoadError> {
        let what = ValueOf(key);
        Ok(match ty {
            0 => GgufValue::U8(u8::from_le_bytes(self.array(&what)?)),
            1 => GgufValue::I8(i8::from_le_bytes(self.array(&what)?)),
            2 => GgufValue::U16(u16::from_le_bytes(self.array(&what)?)),
            3 => GgufValue::I16(i16::from_le_bytes(self.array(&what)?)),
            4 => GgufValue::U32(u32::from_le_bytes(self.array(&what)?)),
            5 => GgufValue::I32(i32::from_le_bytes(self.array(&what)?)),
            6 => GgufValue::F32(f32::from_le_bytes(self.array(&what)?)),
            7 => match self.array::<1>(&what)? {
                [0] => GgufValue::Bool(false),
                [1] => GgufValue::Bool(true),
                [b] => {
                    return Err(LoadError::config(
                        self.path,
                        key,
                        format!("bool byte is {b}, expected 0 or 1"),
                    ))
                }
            },
            8 => GgufValue::String(self.string(&what)?),
            9 if in_array => {
                return Err(LoadError::config(
                    self.path,
                    key,
                    "nested arrays are not supported",
                ))
            }
            9 => {
                let elem = self.u32(&format_args!("array type of `{key}`"))?;
                let min_size = match elem {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    8 | 10..=12 => 8,
                    _ => 1,
                };
                let n = self.count(min_size, &format_args!("array length of `{key}`"))?;
                // The count is backed by bytes in the file, but one decoded item takes up to
                // 32 bytes for each byte it was read from: reserve a bounded amount and let the
                // vector grow only as items are actually decoded.
                let mut items = Vec::with_capacity(n.min(MAX_RESERVE));
                for _ in 0..n {
                    items.push(self.value(elem, key, true)?);
                }
                GgufValue::Array(items)
            }
            10 => GgufValue::U64(u64::from_le_bytes(self.array(&what)?)),
            11 => GgufValue::I64(i64::from_le_bytes(self.array(&what)?)),
            12 => GgufValue::F64(f64::from_le_bytes(self.array(&what)?)),
            t => {
                return Err(LoadError::config(
                    self.path,
                    key,
                    format!("unknown GGUF value type {t}"),
                ))
            }
        })
    }
}

/// Parses header, metadata and tensor infos, and checks every tensor's bytes lie inside `buf`.
pub(crate) fn parse(path: &Path, buf: &[u8]) -> Result<Parsed, LoadError> {
    let mut c = Cursor { path, buf, pos: 0 };
    let magic = c.array::<4>(&"magic")?;
    if magic != GGUF_MAGIC {
        return Err(LoadError::format(
            path,
            format!(
                "not a GGUF file: its magic is \"{}\" ({}), expected \"GGUF\"",
                magic.escape_ascii(),
                magic.map(|b| format!("{b:02x}")).join(" ")
            ),
        ));
    }
    let version = c.u32(&"version")?;
    if !(2..=3).contains(&version) {
        return Err(LoadError::format(
            path,
            format!("GGUF version {version} is not supported (expected 2 or 3)"),
        ));
    }
    // A tensor info takes at least 8 (name) + 4 (n_dims) + 4 (type) + 8 (offset) bytes; a
    // key/value at least 8 (key) + 4 (type) + 1.
    let n_tensors = c.count(24, &"tensor count")?;
    let n_kv = c.count(13, &"metadata count")?;

    let mut metadata = BTreeMap::new();
    for i in 0..n_kv {
        let key = c.string(&format_args!("metadata key #{i}"))?;
        let ty = c.u32(&format_args!("value type of `{key}`"))?;
        let value = c.value(ty, &key, false)?;
        if metadata.insert(key.clone(), value).is_some() {
            return Err(LoadError::config(
                path,
                &key,
                "appears twice in the metadata",
            ));
        }
    }

    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(v) => match v.as_i128() {
            Some(a) if a > 0 && (a as u64).is_power_of_two() && a <= u32::MAX.into() => a as u64,
            _ => {
                return Err(LoadError::config(
                    path,
                    "general.alignment",
                    format!("expected a power of two, found {v:?}"),
                ))
            }
        },
    };

    let mut raw = Vec::with_capacity(n_tensors.min(MAX_RESERVE));
    for i in 0..n_tensors {
        let name = c.string(&format_args!("name of tensor #{i}"))?;
        let what = format!("tensor `{name}`");
        let n_dims = c.u32(&what)?;
        if n_dims > MAX_DIMS {
            return Err(LoadError::tensor(
                path,
                &name,
                format!("has {n_dims} dimensions, at most {MAX_DIMS} are allowed"),
            ));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(c.u64(&what)?);
        }
        let ggml_type = GgmlType(c.u32(&what)?);
        let offset = c.u64(&what)?;
        raw.push((name, dims, ggml_type, offset));
    }

    let data_offset = align_up(c.pos as u64, alignment)
        .and_then(|o| usize::try_from(o).ok())
        .ok_or_else(|| LoadError::format(path, "data section offset overflows"))?;

    let mut tensors = Vec::with_capacity(raw.len());
    let mut seen = std::collections::HashSet::new();
    for (name, dims, ggml_type, offset) in raw {
        if !seen.insert(name.clone()) {
            return Err(LoadError::tensor(path, &name, "appears twice in the file"));
        }
        let info = check_tensor(
            path,
            buf.len(),
            data_offset,
            alignment,
            name,
            dims,
            ggml_type,
            offset,
        )?;
        tensors.push(info);
    }

    Ok(Parsed {
        version,
        metadata,
        tensors,
        alignment,
        data_offset,
    })
}

fn align_up(x: u64, alignment: u64) -> Option<u64> {
    x.checked_add(alignment - 1)
        .map(|v| v / alignment * alignment)
}

/// Sizes one tensor and checks that its bytes lie inside the file.
#[allow(clippy::too_many_arguments)]
fn check_tensor(
    path: &Path,
    file_len: usize,
    data_offset: usize,
    alignment: u64,
    name: String,
    dims: Vec<u64>,
    ggml_type: GgmlType,
    offset: u64,
) -> Result<GgufTensorInfo, LoadError> {
    let err = |reason: String| LoadError::tensor(path, &name, reason);
    let (block_elems, block_bytes) = ggml_type.block().ok_or_else(|| LoadError::DType {
        path: path.to_path_buf(),
        name: name.clone(),
        dtype: ggml_type.to_string(),
    })?;
    let numel = dims
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .filter(|&n| usize::try_from(n).is_ok())
        .ok_or_else(|| err(format!("dimensions {dims:?} overflow")))?;
    let row = dims.first().copied().unwrap_or(1);
    if row % block_elems != 0 {
        return Err(err(format!(
            "rows of {row} elements are not a multiple of the {ggml_type} block size {block_elems}"
        )));
    }
    if !offset.is_multiple_of(alignment) {
        return Err(err(format!(
            "data offset {offset} is not a multiple of the alignment {alignment}"
        )));
    }
    let len = (numel / block_elems)
        .checked_mul(block_bytes)
        .ok_or_else(|| err(format!("byte size of dimensions {dims:?} overflows")))?;
    let start = (data_offset as u64).checked_add(offset);
    let end = start.and_then(|s| s.checked_add(len));
    match (start, end) {
        (Some(start), Some(end)) if end <= file_len as u64 => Ok(GgufTensorInfo {
            name,
            dims,
            ggml_type,
            offset,
            start: start as usize,
            len: len as usize,
        }),
        _ => Err(err(format!(
            "data at offset {offset} (+{len} bytes) in the data section at {data_offset} lies past the \
             end of the file ({file_len} bytes)"
        ))),
    }
}

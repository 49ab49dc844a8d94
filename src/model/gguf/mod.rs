//! GGUF v2/v3 reader: parses a byte slice (header, metadata, tensor infos, data section) with
//! every read bounds-checked. The mapping to Lantern's model (config from metadata, llama.cpp
//! tensor names and Q/K row layouts to Hugging Face ones) lives in [`hf_map`].
//!
//! Format reference: <https://github.com/ggml-org/ggml/blob/master/docs/gguf.md>. The parser
//! never touches the filesystem (it runs in wasm); native callers memory-map the file with
//! [`GgufMmap`] or call [`load_gguf_file`].

use std::collections::HashMap;

use super::config::{Arch, BlockSpec, ModelConfig, RopeScaling};
use super::tensor::{DType, HostTensor, ModelWeights};
use super::LoadError;
use crate::error::LanternError;

pub mod hf_map;
pub mod synth;
pub use hf_map::{
    check_streamed, config_from_gguf, convert_tensor, gguf_info_for, gguf_layer, hf_tensor_name, part_tensors, row_range,
    unpermute_qk_rows, weights_from_gguf, weights_part, weights_part_except, STREAMED_MATRICES,
};

/// The four bytes every GGUF file starts with.
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
/// Data alignment used when `general.alignment` is absent.
pub const GGUF_DEFAULT_ALIGNMENT: u64 = 32;
/// Most dimensions a GGUF tensor may have (ggml's `GGML_MAX_DIMS`).
pub const GGUF_MAX_DIMS: u32 = 4;
/// Deepest nesting of metadata arrays accepted (real files use 1; this bounds recursion).
const MAX_ARRAY_DEPTH: usize = 8;

/// Errors reading a GGUF file. Every variant names the file and the key, tensor or field
/// involved, and what was expected.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GgufError {
    /// The file ends before a field that the header promised.
    #[error("{file}: truncated while reading {what}: needs {needed} bytes at offset {offset}, only {available} left")]
    Truncated { file: String, what: String, offset: u64, needed: u64, available: u64 },
    /// The file does not start with `GGUF`.
    #[error("{file}: not a GGUF file: magic is {found:?}, expected \"GGUF\"")]
    BadMagic { file: String, found: [u8; 4] },
    /// A GGUF version other than 2 or 3.
    #[error("{file}: unsupported GGUF version {version} (supported: 2, 3; a huge number means a big-endian file)")]
    UnsupportedVersion { file: String, version: u32 },
    /// A count or length larger than the rest of the file could hold.
    #[error("{file}: {what} is {value}, but the rest of the file can hold at most {limit}")]
    TooLarge { file: String, what: String, value: u64, limit: u64 },
    /// A string that is not UTF-8 where UTF-8 is required (keys, tensor names).
    #[error("{file}: {what} is not valid UTF-8")]
    InvalidUtf8 { file: String, what: String },
    /// A metadata value type id outside the GGUF spec.
    #[error("{file}: metadata key `{key}` has unknown value type {type_id} (expected 0..=12)")]
    UnknownValueType { file: String, key: String, type_id: u32 },
    /// Arrays nested deeper than the reader accepts.
    #[error("{file}: metadata key `{key}` nests arrays deeper than {max_depth}")]
    NestingTooDeep { file: String, key: String, max_depth: usize },
    /// The same metadata key appears twice.
    #[error("{file}: metadata key `{key}` appears twice")]
    DuplicateKey { file: String, key: String },
    /// The same tensor name appears twice.
    #[error("{file}: tensor `{tensor}` appears twice")]
    DuplicateTensor { file: String, tensor: String },
    /// `general.alignment` is zero or not a power of two.
    #[error("{file}: general.alignment is {alignment}, expected a non-zero power of two")]
    BadAlignment { file: String, alignment: u64 },
    /// A tensor with more than [`GGUF_MAX_DIMS`] dimensions.
    #[error("{file}: tensor `{tensor}` has {n_dims} dimensions, at most 4 are allowed")]
    TooManyDims { file: String, tensor: String, n_dims: u32 },
    /// A ggml type id this reader does not know (so its size cannot be computed).
    #[error("{file}: tensor `{tensor}` has unknown ggml type id {type_id}")]
    UnknownTensorType { file: String, tensor: String, type_id: u32 },
    /// A known ggml type that Lantern cannot load (IQ1/IQ2/IQ3, TQ, MXFP4, Q8_K, ...).
    #[error("{file}: tensor `{tensor}` has ggml type {ggml_type}, which Lantern does not load (supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, MXFP4)")]
    UnsupportedTensorType { file: String, tensor: String, ggml_type: String },
    /// The innermost dimension is not a whole number of quantization blocks, or the element
    /// count overflows.
    #[error("{file}: tensor `{tensor}` of type {ggml_type} has dims {dims:?}: {reason}")]
    BadTensorShape { file: String, tensor: String, ggml_type: String, dims: Vec<u64>, reason: String },
    /// A tensor data offset that is not a multiple of the file's alignment.
    #[error("{file}: tensor `{tensor}` starts at data offset {offset}, which is not a multiple of the alignment {alignment}")]
    MisalignedTensor { file: String, tensor: String, offset: u64, alignment: u64 },
    /// Tensor data that reaches past the end of the file.
    #[error("{file}: tensor `{tensor}` needs bytes {start}..{end} of the file, but the file has {file_len} bytes")]
    TensorOutOfBounds { file: String, tensor: String, start: u64, end: u64, file_len: u64 },
    /// A required metadata key is absent.
    #[error("{file}: missing metadata key `{key}`")]
    MissingKey { file: String, key: String },
    /// A metadata key holds a value of the wrong type or out of range.
    #[error("{file}: metadata key `{key}` is {found}, expected {expected}")]
    WrongType { file: String, key: String, expected: String, found: String },
}

/// The type tag of a metadata value (`gguf_metadata_value_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum GgufValueType {
    /// Unsigned 8-bit value.
    U8,
    /// Signed 8-bit value.
    I8,
    /// Unsigned 16-bit value.
    U16,
    /// Signed 16-bit value.
    I16,
    /// Unsigned 32-bit value.
    U32,
    /// Signed 32-bit value.
    I32,
    /// 32-bit float value.
    F32,
    /// Boolean value.
    Bool,
    /// Utf-8 string value.
    String,
    /// Array value.
    Array,
    /// Unsigned 64-bit value.
    U64,
    /// Signed 64-bit value.
    I64,
    /// 64-bit float value.
    F64,
}

impl GgufValueType {
    /// The type for a numeric tag from the file, if it is one of the 13 defined ones.
    pub fn from_id(id: u32) -> Option<Self> {
        use GgufValueType::*;
        Some(match id {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    /// Smallest encoded size of one value of this type, in bytes (used to reject absurd counts).
    fn min_size(self) -> u64 {
        use GgufValueType::*;
        match self {
            U8 | I8 | Bool => 1,
            U16 | I16 => 2,
            U32 | I32 | F32 => 4,
            U64 | I64 | F64 | String => 8,
            Array => 12,
        }
    }

    /// Lower-case name, as in gguf-py (`uint32`, `string`, ...).
    pub fn name(self) -> &'static str {
        use GgufValueType::*;
        match self {
            U8 => "uint8",
            I8 => "int8",
            U16 => "uint16",
            I16 => "int16",
            U32 => "uint32",
            I32 => "int32",
            F32 => "float32",
            Bool => "bool",
            String => "string",
            Array => "array",
            U64 => "uint64",
            I64 => "int64",
            F64 => "float64",
        }
    }
}

/// A homogeneous metadata array, stored compactly by element type.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufArray {
    /// Array of unsigned 8-bit values.
    U8(Vec<u8>),
    /// Array of signed 8-bit values.
    I8(Vec<i8>),
    /// Array of unsigned 16-bit values.
    U16(Vec<u16>),
    /// Array of signed 16-bit values.
    I16(Vec<i16>),
    /// Array of unsigned 32-bit values.
    U32(Vec<u32>),
    /// Array of signed 32-bit values.
    I32(Vec<i32>),
    /// Array of 32-bit float values.
    F32(Vec<f32>),
    /// Array of boolean values.
    Bool(Vec<bool>),
    /// Array of UTF-8 string values.
    String(Vec<String>),
    /// Nested arrays (each may have its own element type).
    Array(Vec<GgufArray>),
    /// Array of unsigned 64-bit values.
    U64(Vec<u64>),
    /// Array of signed 64-bit values.
    I64(Vec<i64>),
    /// Array of 64-bit float values.
    F64(Vec<f64>),
}

impl GgufArray {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            GgufArray::U8(v) => v.len(),
            GgufArray::I8(v) => v.len(),
            GgufArray::U16(v) => v.len(),
            GgufArray::I16(v) => v.len(),
            GgufArray::U32(v) => v.len(),
            GgufArray::I32(v) => v.len(),
            GgufArray::F32(v) => v.len(),
            GgufArray::Bool(v) => v.len(),
            GgufArray::String(v) => v.len(),
            GgufArray::Array(v) => v.len(),
            GgufArray::U64(v) => v.len(),
            GgufArray::I64(v) => v.len(),
            GgufArray::F64(v) => v.len(),
        }
    }

    /// True when the array has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Element type.
    pub fn elem_type(&self) -> GgufValueType {
        match self {
            GgufArray::U8(_) => GgufValueType::U8,
            GgufArray::I8(_) => GgufValueType::I8,
            GgufArray::U16(_) => GgufValueType::U16,
            GgufArray::I16(_) => GgufValueType::I16,
            GgufArray::U32(_) => GgufValueType::U32,
            GgufArray::I32(_) => GgufValueType::I32,
            GgufArray::F32(_) => GgufValueType::F32,
            GgufArray::Bool(_) => GgufValueType::Bool,
            GgufArray::String(_) => GgufValueType::String,
            GgufArray::Array(_) => GgufValueType::Array,
            GgufArray::U64(_) => GgufValueType::U64,
            GgufArray::I64(_) => GgufValueType::I64,
            GgufArray::F64(_) => GgufValueType::F64,
        }
    }

    /// Integer elements widened to i64 (`None` for non-integer arrays or u64 values above i64::MAX).
    pub fn to_i64_vec(&self) -> Option<Vec<i64>> {
        Some(match self {
            GgufArray::U8(v) => v.iter().map(|&x| x as i64).collect(),
            GgufArray::I8(v) => v.iter().map(|&x| x as i64).collect(),
            GgufArray::U16(v) => v.iter().map(|&x| x as i64).collect(),
            GgufArray::I16(v) => v.iter().map(|&x| x as i64).collect(),
            GgufArray::U32(v) => v.iter().map(|&x| x as i64).collect(),
            GgufArray::I32(v) => v.iter().map(|&x| x as i64).collect(),
            GgufArray::I64(v) => v.clone(),
            GgufArray::U64(v) => v.iter().map(|&x| i64::try_from(x).ok()).collect::<Option<_>>()?,
            _ => return None,
        })
    }

    /// Float elements as f32 (`None` for non-float arrays).
    pub fn to_f32_vec(&self) -> Option<Vec<f32>> {
        match self {
            GgufArray::F32(v) => Some(v.clone()),
            GgufArray::F64(v) => Some(v.iter().map(|&x| x as f32).collect()),
            _ => None,
        }
    }
}

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    /// Unsigned 8-bit value.
    U8(u8),
    /// Signed 8-bit value.
    I8(i8),
    /// Unsigned 16-bit value.
    U16(u16),
    /// Signed 16-bit value.
    I16(i16),
    /// Unsigned 32-bit value.
    U32(u32),
    /// Signed 32-bit value.
    I32(i32),
    /// 32-bit float value.
    F32(f32),
    /// Boolean value.
    Bool(bool),
    /// Utf-8 string value.
    String(String),
    /// Array value.
    Array(GgufArray),
    /// Unsigned 64-bit value.
    U64(u64),
    /// Signed 64-bit value.
    I64(i64),
    /// 64-bit float value.
    F64(f64),
}

impl GgufValue {
    /// The value's type tag.
    pub fn value_type(&self) -> GgufValueType {
        match self {
            GgufValue::U8(_) => GgufValueType::U8,
            GgufValue::I8(_) => GgufValueType::I8,
            GgufValue::U16(_) => GgufValueType::U16,
            GgufValue::I16(_) => GgufValueType::I16,
            GgufValue::U32(_) => GgufValueType::U32,
            GgufValue::I32(_) => GgufValueType::I32,
            GgufValue::F32(_) => GgufValueType::F32,
            GgufValue::Bool(_) => GgufValueType::Bool,
            GgufValue::String(_) => GgufValueType::String,
            GgufValue::Array(_) => GgufValueType::Array,
            GgufValue::U64(_) => GgufValueType::U64,
            GgufValue::I64(_) => GgufValueType::I64,
            GgufValue::F64(_) => GgufValueType::F64,
        }
    }

    /// Any integer value as i128 (lossless for every integer type).
    pub fn as_int(&self) -> Option<i128> {
        Some(match *self {
            GgufValue::U8(x) => x as i128,
            GgufValue::I8(x) => x as i128,
            GgufValue::U16(x) => x as i128,
            GgufValue::I16(x) => x as i128,
            GgufValue::U32(x) => x as i128,
            GgufValue::I32(x) => x as i128,
            GgufValue::U64(x) => x as i128,
            GgufValue::I64(x) => x as i128,
            _ => return None,
        })
    }

    /// A float value (f32 or f64) as f64.
    pub fn as_float(&self) -> Option<f64> {
        match *self {
            GgufValue::F32(x) => Some(x as f64),
            GgufValue::F64(x) => Some(x),
            _ => None,
        }
    }

    /// The string, for string values.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }

    /// The array, for array values.
    pub fn as_array(&self) -> Option<&GgufArray> {
        match self {
            GgufValue::Array(a) => Some(a),
            _ => None,
        }
    }

    /// Short description for error messages, e.g. `uint32 7` or `array of 3 string`.
    fn describe(&self) -> String {
        match self {
            GgufValue::String(s) if s.len() > 40 => format!("a string of {} bytes", s.len()),
            GgufValue::String(s) => format!("string {s:?}"),
            GgufValue::Array(a) => format!("an array of {} {}", a.len(), a.elem_type().name()),
            v => match (v.as_int(), v.as_float()) {
                (Some(i), _) => format!("{} {i}", v.value_type().name()),
                (_, Some(f)) => format!("{} {f}", v.value_type().name()),
                _ => format!("{v:?}"),
            },
        }
    }
}

/// ggml tensor types (`ggml_type`), with their block geometry. Only some can be loaded
/// (see [`GgmlType::to_dtype`]); the rest are known so that their sizes can be checked.
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum GgmlType {
    /// ggml `F32`.
    F32,
    /// ggml `F16`.
    F16,
    /// ggml `Q4_0`.
    Q4_0,
    /// ggml `Q4_1`.
    Q4_1,
    /// ggml `Q5_0`.
    Q5_0,
    /// ggml `Q5_1`.
    Q5_1,
    /// ggml `Q8_0`.
    Q8_0,
    /// ggml `Q8_1`.
    Q8_1,
    /// ggml `Q2_K`.
    Q2_K,
    /// ggml `Q3_K`.
    Q3_K,
    /// ggml `Q4_K`.
    Q4_K,
    /// ggml `Q5_K`.
    Q5_K,
    /// ggml `Q6_K`.
    Q6_K,
    /// ggml `Q8_K`.
    Q8_K,
    /// ggml `IQ2_XXS`.
    IQ2_XXS,
    /// ggml `IQ2_XS`.
    IQ2_XS,
    /// ggml `IQ3_XXS`.
    IQ3_XXS,
    /// ggml `IQ1_S`.
    IQ1_S,
    /// ggml `IQ4_NL`.
    IQ4_NL,
    /// ggml `IQ3_S`.
    IQ3_S,
    /// ggml `IQ2_S`.
    IQ2_S,
    /// ggml `IQ4_XS`.
    IQ4_XS,
    /// ggml `I8`.
    I8,
    /// ggml `I16`.
    I16,
    /// ggml `I32`.
    I32,
    /// ggml `I64`.
    I64,
    /// ggml `F64`.
    F64,
    /// ggml `IQ1_M`.
    IQ1_M,
    /// ggml `BF16`.
    BF16,
    /// ggml `TQ1_0`.
    TQ1_0,
    /// ggml `TQ2_0`.
    TQ2_0,
    /// ggml `MXFP4`.
    MXFP4,
}

impl GgmlType {
    /// `(id, type, elements per block, bytes per block)` for every known type.
    const TABLE: [(u32, GgmlType, u64, u64); 32] = {
        use GgmlType::*;
        [
            (0, F32, 1, 4),
            (1, F16, 1, 2),
            (2, Q4_0, 32, 18),
            (3, Q4_1, 32, 20),
            (6, Q5_0, 32, 22),
            (7, Q5_1, 32, 24),
            (8, Q8_0, 32, 34),
            (9, Q8_1, 32, 36),
            (10, Q2_K, 256, 84),
            (11, Q3_K, 256, 110),
            (12, Q4_K, 256, 144),
            (13, Q5_K, 256, 176),
            (14, Q6_K, 256, 210),
            (15, Q8_K, 256, 292),
            (16, IQ2_XXS, 256, 66),
            (17, IQ2_XS, 256, 74),
            (18, IQ3_XXS, 256, 98),
            (19, IQ1_S, 256, 50),
            (20, IQ4_NL, 32, 18),
            (21, IQ3_S, 256, 110),
            (22, IQ2_S, 256, 82),
            (23, IQ4_XS, 256, 136),
            (24, I8, 1, 1),
            (25, I16, 1, 2),
            (26, I32, 1, 4),
            (27, I64, 1, 8),
            (28, F64, 1, 8),
            (29, IQ1_M, 256, 56),
            (30, BF16, 1, 2),
            (34, TQ1_0, 256, 54),
            (35, TQ2_0, 256, 66),
            (39, MXFP4, 32, 17),
        ]
    };

    /// The type for a ggml type id, if known.
    pub fn from_id(id: u32) -> Option<Self> {
        Self::TABLE.iter().find(|e| e.0 == id).map(|e| e.1)
    }

    fn entry(self) -> (u32, GgmlType, u64, u64) {
        // Every variant is in TABLE; the fallback is unreachable but keeps this panic-free.
        Self::TABLE.iter().copied().find(|e| e.1 == self).unwrap_or((0, self, 1, 4))
    }

    /// The ggml type id written in files.
    pub fn id(self) -> u32 {
        self.entry().0
    }

    /// `(elements per block, bytes per block)`.
    pub fn block(self) -> (u64, u64) {
        let e = self.entry();
        (e.2, e.3)
    }

    /// The name ggml uses (`Q4_K`, `BF16`, ...).
    pub fn name(self) -> String {
        format!("{self:?}")
    }

    /// The Lantern dtype this type loads as, or `None` if Lantern cannot load it.
    pub fn to_dtype(self) -> Option<DType> {
        match self {
            GgmlType::F32 => Some(DType::F32),
            GgmlType::F16 => Some(DType::F16),
            GgmlType::BF16 => Some(DType::BF16),
            GgmlType::Q8_0 => Some(DType::Q8_0),
            GgmlType::Q4_0 => Some(DType::Q4_0),
            GgmlType::Q4_1 => Some(DType::Q4_1),
            GgmlType::Q5_0 => Some(DType::Q5_0),
            GgmlType::Q5_1 => Some(DType::Q5_1),
            GgmlType::Q2_K => Some(DType::Q2_K),
            GgmlType::Q3_K => Some(DType::Q3_K),
            GgmlType::Q4_K => Some(DType::Q4_K),
            GgmlType::Q5_K => Some(DType::Q5_K),
            GgmlType::Q6_K => Some(DType::Q6_K),
            GgmlType::IQ4_NL => Some(DType::IQ4_NL),
            GgmlType::IQ4_XS => Some(DType::IQ4_XS),
            GgmlType::MXFP4 => Some(DType::MXFP4),
            _ => None,
        }
    }

    /// The ggml type that stores a Lantern dtype (`None` for Lantern's packed layout and raw
    /// FP8, which only safetensors files carry).
    pub fn from_dtype(dtype: DType) -> Option<Self> {
        Some(match dtype {
            DType::F32 => GgmlType::F32,
            DType::F16 => GgmlType::F16,
            DType::BF16 => GgmlType::BF16,
            DType::Q8_0 => GgmlType::Q8_0,
            DType::Q4_0 => GgmlType::Q4_0,
            DType::Q4_1 => GgmlType::Q4_1,
            DType::Q5_0 => GgmlType::Q5_0,
            DType::Q5_1 => GgmlType::Q5_1,
            DType::Q2_K => GgmlType::Q2_K,
            DType::Q3_K => GgmlType::Q3_K,
            DType::Q4_K => GgmlType::Q4_K,
            DType::Q5_K => GgmlType::Q5_K,
            DType::Q6_K => GgmlType::Q6_K,
            DType::IQ4_NL => GgmlType::IQ4_NL,
            DType::IQ4_XS => GgmlType::IQ4_XS,
            DType::MXFP4 => GgmlType::MXFP4,
            DType::Packed(_) | DType::F8_E4M3 => return None,
        })
    }
}

/// Where one tensor lives in the file and how it is laid out.
#[derive(Debug, Clone, PartialEq)]
pub struct GgufTensorInfo {
    /// Tensor name as stored (llama.cpp naming, e.g. `blk.0.attn_q.weight`).
    pub name: String,
    /// ggml dims `ne`, innermost (contiguous) first: a Linear weight is `[in, out]`.
    pub dims: Vec<u64>,
    /// Storage type.
    pub ggml_type: GgmlType,
    /// Byte offset of the data, relative to the start of the data section.
    pub offset: u64,
    /// Byte size of the data.
    pub size: u64,
}

impl GgufTensorInfo {
    /// Number of elements.
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }

    /// Shape outermost first (the Hugging Face order): the reversed `dims`.
    pub fn shape(&self) -> Vec<usize> {
        // Sizes were bounded by the file length at parse time, so each fits in usize.
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }
}

/// A parsed GGUF file borrowing its bytes: metadata, tensor infos and access to tensor data.
#[derive(Debug, Clone)]
pub struct GgufFile<'a> {
    name: String,
    bytes: &'a [u8],
    version: u32,
    alignment: u64,
    data_offset: u64,
    /// Length of the whole file (`bytes` may be only its beginning: [`GgufFile::parse_prefix`]).
    file_len: u64,
    metadata: Vec<(String, GgufValue)>,
    key_index: HashMap<String, usize>,
    tensors: Vec<GgufTensorInfo>,
    tensor_index: HashMap<String, usize>,
}

/// Bounds-checked little-endian cursor over the file bytes.
struct Reader<'a, 'n> {
    bytes: &'a [u8],
    pos: usize,
    file: &'n str,
    /// Length of the whole file (`bytes` may be its beginning only).
    file_len: u64,
}

impl<'a> Reader<'a, '_> {
    /// Bytes left in `bytes` (what reads can take).
    fn remaining(&self) -> u64 {
        (self.bytes.len() - self.pos) as u64
    }

    /// Bytes left in the whole file (what counts are checked against).
    fn remaining_in_file(&self) -> u64 {
        self.file_len.saturating_sub(self.pos as u64)
    }

    fn take(&mut self, n: u64, what: impl FnOnce() -> String) -> Result<&'a [u8], GgufError> {
        let avail = self.remaining();
        if n > avail {
            return Err(GgufError::Truncated {
                file: self.file.to_string(),
                what: what(),
                offset: self.pos as u64,
                needed: n,
                available: avail,
            });
        }
        let n = n as usize; // n <= remaining, so it fits.
        let s = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: impl FnOnce() -> String) -> Result<[u8; N], GgufError> {
        let s = self.take(N as u64, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: impl FnOnce() -> String) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: impl FnOnce() -> String) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A count that must fit in what is left, given each item needs at least `min_size` bytes.
    fn count(&mut self, min_size: u64, what: impl Fn() -> String) -> Result<u64, GgufError> {
        let n = self.u64(&what)?;
        let limit = self.remaining_in_file() / min_size.max(1);
        if n > limit {
            return Err(GgufError::TooLarge { file: self.file.to_string(), what: what(), value: n, limit });
        }
        Ok(n)
    }

    fn raw_string(&mut self, what: impl Fn() -> String) -> Result<&'a [u8], GgufError> {
        let len = self.count(1, || format!("length of {}", what()))?;
        self.take(len, what)
    }

    /// A string that must be UTF-8 (keys, tensor names).
    fn strict_string(&mut self, what: impl Fn() -> String) -> Result<String, GgufError> {
        let raw = self.raw_string(&what)?;
        match std::str::from_utf8(raw) {
            Ok(s) => Ok(s.to_string()),
            Err(_) => Err(GgufError::InvalidUtf8 { file: self.file.to_string(), what: what() }),
        }
    }

    /// A string value; invalid UTF-8 is replaced (some converters wrote broken vocab entries).
    fn lossy_string(&mut self, what: impl Fn() -> String) -> Result<String, GgufError> {
        let raw = self.raw_string(what)?;
        Ok(String::from_utf8_lossy(raw).into_owned())
    }

    fn value_type(&mut self, key: &str) -> Result<GgufValueType, GgufError> {
        let id = self.u32(|| format!("value type of `{key}`"))?;
        GgufValueType::from_id(id).ok_or_else(|| GgufError::UnknownValueType {
            file: self.file.to_string(),
            key: key.to_string(),
            type_id: id,
        })
    }

    fn value(&mut self, ty: GgufValueType, key: &str, depth: usize) -> Result<GgufValue, GgufError> {
        let what = || format!("value of `{key}`");
        Ok(match ty {
            GgufValueType::U8 => GgufValue::U8(u8::from_le_bytes(self.array(what)?)),
            GgufValueType::I8 => GgufValue::I8(i8::from_le_bytes(self.array(what)?)),
            GgufValueType::U16 => GgufValue::U16(u16::from_le_bytes(self.array(what)?)),
            GgufValueType::I16 => GgufValue::I16(i16::from_le_bytes(self.array(what)?)),
            GgufValueType::U32 => GgufValue::U32(u32::from_le_bytes(self.array(what)?)),
            GgufValueType::I32 => GgufValue::I32(i32::from_le_bytes(self.array(what)?)),
            GgufValueType::F32 => GgufValue::F32(f32::from_le_bytes(self.array(what)?)),
            GgufValueType::Bool => GgufValue::Bool(self.array::<1>(what)?[0] != 0),
            GgufValueType::String => GgufValue::String(self.lossy_string(what)?),
            GgufValueType::U64 => GgufValue::U64(u64::from_le_bytes(self.array(what)?)),
            GgufValueType::I64 => GgufValue::I64(i64::from_le_bytes(self.array(what)?)),
            GgufValueType::F64 => GgufValue::F64(f64::from_le_bytes(self.array(what)?)),
            GgufValueType::Array => GgufValue::Array(self.array_value(key, depth + 1)?),
        })
    }

    fn array_value(&mut self, key: &str, depth: usize) -> Result<GgufArray, GgufError> {
        if depth > MAX_ARRAY_DEPTH {
            return Err(GgufError::NestingTooDeep { file: self.file.to_string(), key: key.to_string(), max_depth: MAX_ARRAY_DEPTH });
        }
        let elem = self.value_type(key)?;
        let n = self.count(elem.min_size(), || format!("array length of `{key}`"))? as usize;
        let what = || format!("array `{key}`");
        macro_rules! fixed {
            ($t:ty, $variant:ident) => {{
                let size = std::mem::size_of::<$t>() as u64;
                // n * size <= remaining because count() checked n against remaining / size.
                let raw = self.take(n as u64 * size, what)?;
                GgufArray::$variant(
                    raw.chunks_exact(size as usize)
                        .map(|c| {
                            let mut a = [0u8; std::mem::size_of::<$t>()];
                            a.copy_from_slice(c);
                            <$t>::from_le_bytes(a)
                        })
                        .collect(),
                )
            }};
        }
        Ok(match elem {
            GgufValueType::U8 => fixed!(u8, U8),
            GgufValueType::I8 => fixed!(i8, I8),
            GgufValueType::U16 => fixed!(u16, U16),
            GgufValueType::I16 => fixed!(i16, I16),
            GgufValueType::U32 => fixed!(u32, U32),
            GgufValueType::I32 => fixed!(i32, I32),
            GgufValueType::F32 => fixed!(f32, F32),
            GgufValueType::U64 => fixed!(u64, U64),
            GgufValueType::I64 => fixed!(i64, I64),
            GgufValueType::F64 => fixed!(f64, F64),
            GgufValueType::Bool => GgufArray::Bool(self.take(n as u64, what)?.iter().map(|&b| b != 0).collect()),
            GgufValueType::String => {
                let mut v = Vec::with_capacity(n);
                for i in 0..n {
                    v.push(self.lossy_string(|| format!("element {i} of array `{key}`"))?);
                }
                GgufArray::String(v)
            }
            GgufValueType::Array => {
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.array_value(key, depth + 1)?);
                }
                GgufArray::Array(v)
            }
        })
    }
}

impl<'a> GgufFile<'a> {
    /// Parse a whole GGUF file held in memory. `file_name` is used in error messages.
    /// Validates the header, every metadata value, every tensor info (dims, type, block
    /// geometry, alignment) and that all tensor data lies inside `bytes`.
    pub fn parse(bytes: &'a [u8], file_name: impl Into<String>) -> Result<Self, GgufError> {
        Self::parse_prefix(bytes, bytes.len() as u64, file_name)
    }

    /// [`GgufFile::parse`] from the first bytes of a file of `file_len` bytes: the header
    /// (metadata and tensor infos) must lie in `prefix` (else [`GgufError::Truncated`]: read
    /// more and try again), tensors are checked against `file_len`, and only tensors inside
    /// the prefix can be read with [`GgufFile::tensor_data`]; the others' byte ranges are
    /// [`GgufFile::tensor_range`], for a caller that streams them (the browser, reading a
    /// large file in pieces).
    pub fn parse_prefix(bytes: &'a [u8], file_len: u64, file_name: impl Into<String>) -> Result<Self, GgufError> {
        let name = file_name.into();
        let file = name.as_str();
        let mut r = Reader { bytes, pos: 0, file, file_len: file_len.max(bytes.len() as u64) };
        let magic: [u8; 4] = r.array(|| "magic".into())?;
        if magic != GGUF_MAGIC {
            return Err(GgufError::BadMagic { file: name.clone(), found: magic });
        }
        let version = r.u32(|| "version".into())?;
        if version != 2 && version != 3 {
            return Err(GgufError::UnsupportedVersion { file: name.clone(), version });
        }
        // Minimum encoded sizes: tensor info = name len (8) + n_dims (4) + type (4) + offset (8);
        // key/value = key len (8) + type (4) + smallest value (1).
        let n_tensors = r.count(24, || "tensor count".into())?;
        let n_kv = r.count(13, || "metadata key/value count".into())?;

        let mut metadata = Vec::with_capacity(n_kv as usize);
        let mut key_index = HashMap::with_capacity(n_kv as usize);
        for i in 0..n_kv {
            let key = r.strict_string(|| format!("metadata key #{i}"))?;
            let ty = r.value_type(&key)?;
            let value = r.value(ty, &key, 0)?;
            if key_index.insert(key.clone(), metadata.len()).is_some() {
                return Err(GgufError::DuplicateKey { file: name.clone(), key });
            }
            metadata.push((key, value));
        }

        let alignment = match key_index.get("general.alignment").map(|&i| &metadata[i].1) {
            None => GGUF_DEFAULT_ALIGNMENT,
            Some(v) => match v.as_int() {
                Some(a) if a > 0 && (a as u64).is_power_of_two() && a <= u32::MAX as i128 => a as u64,
                Some(a) => return Err(GgufError::BadAlignment { file: name.clone(), alignment: a.clamp(0, u64::MAX as i128) as u64 }),
                None => {
                    return Err(GgufError::WrongType {
                        file: name.clone(),
                        key: "general.alignment".into(),
                        expected: "an unsigned integer".into(),
                        found: v.describe(),
                    })
                }
            },
        };

        let mut tensors = Vec::with_capacity(n_tensors as usize);
        let mut tensor_index = HashMap::with_capacity(n_tensors as usize);
        for i in 0..n_tensors {
            let info = read_tensor_info(&mut r, i, alignment)?;
            if tensor_index.insert(info.name.clone(), tensors.len()).is_some() {
                return Err(GgufError::DuplicateTensor { file: name.clone(), tensor: info.name });
            }
            tensors.push(info);
        }

        let file_len = file_len.max(bytes.len() as u64);
        let end_of_infos = r.pos as u64;
        // align_up cannot overflow: end_of_infos <= file_len and alignment <= u32::MAX.
        let data_offset = end_of_infos.div_ceil(alignment) * alignment;
        for t in &tensors {
            let start = data_offset.checked_add(t.offset);
            let end = start.and_then(|s| s.checked_add(t.size));
            match (start, end) {
                (Some(_), Some(end)) if end <= file_len => {}
                _ => {
                    return Err(GgufError::TensorOutOfBounds {
                        file: name.clone(),
                        tensor: t.name.clone(),
                        start: start.unwrap_or(u64::MAX),
                        end: end.unwrap_or(u64::MAX),
                        file_len,
                    })
                }
            }
        }
        Ok(GgufFile {
            name,
            bytes,
            version,
            alignment,
            data_offset: data_offset.min(file_len),
            file_len,
            metadata,
            key_index,
            tensors,
            tensor_index,
        })
    }

    /// The file name given to [`GgufFile::parse`].
    pub fn file_name(&self) -> &str {
        &self.name
    }

    /// GGUF version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// Data alignment (`general.alignment`, default 32).
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Absolute byte offset of the data section.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// All metadata, in file order.
    pub fn metadata(&self) -> impl Iterator<Item = (&str, &GgufValue)> {
        self.metadata.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// The value of a metadata key, if present.
    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.key_index.get(key).map(|&i| &self.metadata[i].1)
    }

    fn missing(&self, key: &str) -> GgufError {
        GgufError::MissingKey { file: self.name.clone(), key: key.to_string() }
    }

    fn wrong(&self, key: &str, expected: &str, v: &GgufValue) -> GgufError {
        GgufError::WrongType { file: self.name.clone(), key: key.to_string(), expected: expected.to_string(), found: v.describe() }
    }

    /// A string value; `Ok(None)` if the key is absent, an error if it is not a string.
    pub fn get_str_opt(&self, key: &str) -> Result<Option<&str>, GgufError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_str().map(Some).ok_or_else(|| self.wrong(key, "a string", v)),
        }
    }

    /// A required string value.
    pub fn get_str(&self, key: &str) -> Result<&str, GgufError> {
        self.get_str_opt(key)?.ok_or_else(|| self.missing(key))
    }

    /// An integer value that fits in u32 (any integer type is accepted); `Ok(None)` if absent.
    pub fn get_u32_opt(&self, key: &str) -> Result<Option<u32>, GgufError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => match v.as_int().and_then(|i| u32::try_from(i).ok()) {
                Some(x) => Ok(Some(x)),
                None => Err(self.wrong(key, "an integer in 0..=4294967295", v)),
            },
        }
    }

    /// A required integer value that fits in u32.
    pub fn get_u32(&self, key: &str) -> Result<u32, GgufError> {
        self.get_u32_opt(key)?.ok_or_else(|| self.missing(key))
    }

    /// A float value (f32 or f64, returned as f32); `Ok(None)` if absent.
    pub fn get_f32_opt(&self, key: &str) -> Result<Option<f32>, GgufError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_float().map(|f| Some(f as f32)).ok_or_else(|| self.wrong(key, "a float", v)),
        }
    }

    /// A required float value.
    pub fn get_f32(&self, key: &str) -> Result<f32, GgufError> {
        self.get_f32_opt(key)?.ok_or_else(|| self.missing(key))
    }

    /// A bool value; `Ok(None)` if absent.
    pub fn get_bool_opt(&self, key: &str) -> Result<Option<bool>, GgufError> {
        match self.get(key) {
            None => Ok(None),
            Some(GgufValue::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(self.wrong(key, "a bool", v)),
        }
    }

    /// An array value; `Ok(None)` if absent.
    pub fn get_array_opt(&self, key: &str) -> Result<Option<&GgufArray>, GgufError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_array().map(Some).ok_or_else(|| self.wrong(key, "an array", v)),
        }
    }

    /// A required array value.
    pub fn get_array(&self, key: &str) -> Result<&GgufArray, GgufError> {
        self.get_array_opt(key)?.ok_or_else(|| self.missing(key))
    }

    /// A required array of strings.
    pub fn get_str_array(&self, key: &str) -> Result<&[String], GgufError> {
        match self.get_array(key)? {
            GgufArray::String(v) => Ok(v),
            a => Err(self.wrong(key, "an array of strings", &GgufValue::Array(a.clone()))),
        }
    }

    /// An array of integers widened to i64 (e.g. `tokenizer.ggml.token_type`); `Ok(None)` if absent.
    pub fn get_int_array_opt(&self, key: &str) -> Result<Option<Vec<i64>>, GgufError> {
        match self.get_array_opt(key)? {
            None => Ok(None),
            Some(a) => a.to_i64_vec().map(Some).ok_or_else(|| self.wrong(key, "an array of integers", &GgufValue::Array(a.clone()))),
        }
    }

    /// An array of floats as f32 (e.g. `tokenizer.ggml.scores`); `Ok(None)` if absent.
    pub fn get_f32_array_opt(&self, key: &str) -> Result<Option<Vec<f32>>, GgufError> {
        match self.get_array_opt(key)? {
            None => Ok(None),
            Some(a) => a.to_f32_vec().map(Some).ok_or_else(|| self.wrong(key, "an array of floats", &GgufValue::Array(a.clone()))),
        }
    }

    /// All tensor infos, in file order.
    pub fn tensors(&self) -> &[GgufTensorInfo] {
        &self.tensors
    }

    /// The info of a tensor by its GGUF name.
    pub fn tensor_info(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// Absolute byte range `[start, end)` of a tensor's data in the file (checked against the
    /// file length by the parse).
    pub fn tensor_range(&self, info: &GgufTensorInfo) -> (u64, u64) {
        let start = self.data_offset + info.offset;
        (start, start + info.size)
    }

    /// Length of the whole file.
    pub fn file_len(&self) -> u64 {
        self.file_len
    }

    /// The raw bytes of a tensor (bounds were checked by [`GgufFile::parse`]).
    pub fn tensor_data(&self, info: &GgufTensorInfo) -> Result<&'a [u8], GgufError> {
        let start = self.data_offset.checked_add(info.offset);
        let end = start.and_then(|s| s.checked_add(info.size));
        match (start, end) {
            (Some(s), Some(e)) if e <= self.bytes.len() as u64 => Ok(&self.bytes[s as usize..e as usize]),
            _ => Err(GgufError::TensorOutOfBounds {
                file: self.name.clone(),
                tensor: info.name.clone(),
                start: start.unwrap_or(u64::MAX),
                end: end.unwrap_or(u64::MAX),
                file_len: self.bytes.len() as u64,
            }),
        }
    }

    /// A tensor by GGUF name, copied into a [`HostTensor`] in its file dtype, keeping its GGUF
    /// name and HF-order shape (no Q/K un-permutation). Fails for types Lantern cannot load.
    pub fn host_tensor(&self, name: &str) -> Result<Option<HostTensor>, GgufError> {
        let Some(info) = self.tensor_info(name) else {
            return Ok(None);
        };
        let dtype = self.loadable_dtype(info)?;
        Ok(Some(HostTensor { name: info.name.clone(), shape: info.shape(), dtype, data: self.tensor_data(info)?.to_vec() }))
    }

    pub fn loadable_dtype(&self, info: &GgufTensorInfo) -> Result<DType, GgufError> {
        info.ggml_type.to_dtype().ok_or_else(|| GgufError::UnsupportedTensorType {
            file: self.name.clone(),
            tensor: info.name.clone(),
            ggml_type: info.ggml_type.name(),
        })
    }
}

fn read_tensor_info(r: &mut Reader<'_, '_>, index: u64, alignment: u64) -> Result<GgufTensorInfo, GgufError> {
    let file = r.file.to_string();
    let name = r.strict_string(|| format!("name of tensor #{index}"))?;
    let n_dims = r.u32(|| format!("n_dims of tensor `{name}`"))?;
    if n_dims > GGUF_MAX_DIMS {
        return Err(GgufError::TooManyDims { file, tensor: name, n_dims });
    }
    let mut dims = Vec::with_capacity(n_dims as usize);
    for d in 0..n_dims {
        dims.push(r.u64(|| format!("dim {d} of tensor `{name}`"))?);
    }
    let type_id = r.u32(|| format!("type of tensor `{name}`"))?;
    let offset = r.u64(|| format!("data offset of tensor `{name}`"))?;
    let Some(ggml_type) = GgmlType::from_id(type_id) else {
        return Err(GgufError::UnknownTensorType { file, tensor: name, type_id });
    };
    let bad_shape = |reason: String| GgufError::BadTensorShape {
        file: file.clone(),
        tensor: name.clone(),
        ggml_type: ggml_type.name(),
        dims: dims.clone(),
        reason,
    };
    let (block_elems, block_bytes) = ggml_type.block();
    let n = dims.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d)).ok_or_else(|| bad_shape("element count overflows".into()))?;
    let inner = dims.first().copied().unwrap_or(1);
    if inner % block_elems != 0 {
        return Err(bad_shape(format!("innermost dim {inner} is not a multiple of the block size {block_elems}")));
    }
    let size = (n / block_elems).checked_mul(block_bytes).ok_or_else(|| bad_shape("byte size overflows".into()))?;
    if offset % alignment != 0 {
        return Err(GgufError::MisalignedTensor { file, tensor: name, offset, alignment });
    }
    Ok(GgufTensorInfo { name, dims, ggml_type, offset, size })
}

/// A memory-mapped GGUF file (native only). Keep it alive while a [`GgufFile`] parsed from
/// it is in use.
#[cfg(not(target_arch = "wasm32"))]
#[derive(Debug)]
pub struct GgufMmap {
    path: std::path::PathBuf,
    map: memmap2::Mmap,
}

#[cfg(not(target_arch = "wasm32"))]
impl GgufMmap {
    /// Open and memory-map `path` read-only.
    pub fn open(path: impl AsRef<std::path::Path>) -> Result<Self, LanternError> {
        let path = path.as_ref().to_path_buf();
        let file = std::fs::File::open(&path).map_err(|e| LanternError::io(&path, e))?;
        // SAFETY: the map is read-only and private to this process; like every loader that
        // maps model files, we rely on the file not being truncated while it is mapped.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| LanternError::io(&path, e))?;
        Ok(GgufMmap { path, map })
    }

    /// The mapped bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.map
    }

    /// The file's path.
    pub fn path(&self) -> &std::path::Path {
        &self.path
    }

    /// Parse the mapped bytes (error messages name the path).
    pub fn parse(&self) -> Result<GgufFile<'_>, GgufError> {
        GgufFile::parse(&self.map, self.path.display().to_string())
    }
}

/// Memory-map, parse and load a GGUF model file (native only).
#[cfg(not(target_arch = "wasm32"))]
pub fn load_gguf_file(path: impl AsRef<std::path::Path>) -> Result<ModelWeights, LanternError> {
    let map = GgufMmap::open(path)?;
    let gguf = map.parse()?;
    weights_from_gguf(&gguf, gguf.file_name())
}

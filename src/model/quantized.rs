//! The read side of Lantern's quantized safetensors format (`lantern quantize` writes it:
//! `quant/safetensors.rs`): the `lantern.quantization` metadata and packed tensors rebuilt
//! from their `.qweight` / `.scales` entries. It lives in `model/` because loading is what
//! reads it (`model/hf.rs`); the writer above `model/` imports it from here.

use std::collections::BTreeMap;

use safetensors::tensor::{Dtype as StDtype, TensorView};
use serde::{Deserialize, Serialize};

use crate::model::{DType, HostTensor, LoadError};
use crate::quant::{QuantFormat, QuantKind};

/// `__metadata__` key holding the quantization JSON.
pub const METADATA_KEY: &str = "lantern.quantization";
/// The metadata version this code writes and reads.
pub const FORMAT_VERSION: u32 = 1;
/// Suffix of the codes entry of a packed tensor.
pub const QWEIGHT_SUFFIX: &str = ".qweight";
/// Suffix of the scales entry of a packed tensor.
pub const SCALES_SUFFIX: &str = ".scales";

/// How one packed tensor was made.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TensorInfo {
    /// Bit layout (`q8`, `q4`, `q4sym`).
    pub kind: QuantKind,
    /// Elements per scale.
    pub group: u32,
    /// `rtn` (round to nearest), `awq` (activation-aware scales, then round to nearest) or
    /// `repack` (GGUF blocks moved bit for bit).
    pub method: String,
    /// AWQ: the exponent of the input-channel scales `mean|x|^alpha` (0 = none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub alpha: Option<f32>,
    /// AWQ: where `1 / s` of the input scales was folded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fold_into: Option<String>,
    /// AWQ: rows divided by the input scales of the next projection (v_proj by o_proj's,
    /// up_proj by down_proj's), and that projection's alpha.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub row_scales_from: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub row_alpha: Option<f32>,
}

impl TensorInfo {
    pub fn new(format: QuantFormat, method: &str) -> Self {
        TensorInfo {
            kind: format.kind,
            group: format.group,
            method: method.to_string(),
            alpha: None,
            fold_into: None,
            row_scales_from: None,
            row_alpha: None,
        }
    }

    pub fn format(&self) -> QuantFormat {
        QuantFormat::new(self.kind, self.group)
    }
}

/// The `lantern.quantization` metadata of a quantized checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct QuantMetadata {
    pub format_version: u32,
    /// Every packed tensor, by its logical name (without `.qweight` / `.scales`).
    pub tensors: BTreeMap<String, TensorInfo>,
    /// What was quantized (file or folder).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    /// The writer (`lantern <version>`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool: Option<String>,
    /// Storage of the tensors that are not packed, by name (`f32`, `f16`, `bf16`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub float_tensors: BTreeMap<String, String>,
    /// AWQ calibration settings, when AWQ was used.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub calibration: Option<serde_json::Value>,
    /// Free-form remarks (e.g. how GQA o_proj scales were tied).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
}

impl Default for QuantMetadata {
    fn default() -> Self {
        QuantMetadata {
            format_version: FORMAT_VERSION,
            tensors: BTreeMap::new(),
            source: None,
            tool: Some(format!("lantern {}", env!("CARGO_PKG_VERSION"))),
            float_tensors: BTreeMap::new(),
            calibration: None,
            notes: Vec::new(),
        }
    }
}

fn meta_err(file: &str, tensor: &str, reason: impl Into<String>) -> LoadError {
    LoadError::Quantized { file: file.to_string(), tensor: tensor.to_string(), reason: reason.into() }
}

/// Parses the `lantern.quantization` JSON of `file`; every entry is checked (known kind,
/// valid group) and errors name the tensor.
pub fn parse_metadata(text: &str, file: &str) -> Result<QuantMetadata, LoadError> {
    let where_ = format!("__metadata__[\"{METADATA_KEY}\"]");
    let root: serde_json::Value = serde_json::from_str(text).map_err(|e| meta_err(file, &where_, format!("not valid JSON: {e}")))?;
    let version = root.get("format_version").and_then(serde_json::Value::as_u64);
    if version != Some(FORMAT_VERSION as u64) {
        return Err(meta_err(
            file,
            &where_,
            format!(
                "format_version is {}, this build reads {FORMAT_VERSION}",
                root.get("format_version").map_or("missing".to_string(), |v| v.to_string())
            ),
        ));
    }
    let Some(entries) = root.get("tensors").and_then(serde_json::Value::as_object) else {
        return Err(meta_err(file, &where_, "no `tensors` object"));
    };
    let mut tensors = BTreeMap::new();
    for (name, v) in entries {
        if let Some(kind) = v.get("kind") {
            if kind.as_str().and_then(QuantKind::parse).is_none() {
                return Err(meta_err(file, name, format!("unknown kind {kind} (known: {})", QuantKind::rtn_names())));
            }
        }
        let info: TensorInfo = serde_json::from_value(v.clone()).map_err(|e| meta_err(file, name, format!("bad metadata entry: {e}")))?;
        if info.group == 0 || !info.group.is_multiple_of(8) {
            return Err(meta_err(file, name, format!("group {} is not a positive multiple of 8", info.group)));
        }
        tensors.insert(name.clone(), info);
    }
    let mut rest = root.clone();
    if let Some(o) = rest.as_object_mut() {
        o.insert("tensors".into(), serde_json::json!({}));
    }
    let mut meta: QuantMetadata = serde_json::from_value(rest).map_err(|e| meta_err(file, &where_, format!("bad metadata: {e}")))?;
    meta.tensors = tensors;
    Ok(meta)
}

/// Rebuilds the packed tensor `base` of `file` from its `.qweight` and `.scales` entries,
/// checking both against the metadata and each other.
pub fn packed_from_views(
    file: &str,
    meta: Option<&QuantMetadata>,
    base: &str,
    qweight: Option<&TensorView<'_>>,
    scales: Option<&TensorView<'_>>,
) -> Result<HostTensor, LoadError> {
    let err = |reason: String| meta_err(file, base, reason);
    let meta =
        meta.ok_or_else(|| err(format!("stored as U32 {QWEIGHT_SUFFIX}/{SCALES_SUFFIX} but the file has no `{METADATA_KEY}` metadata")))?;
    let info = meta.tensors.get(base).ok_or_else(|| err(format!("no entry in the `{METADATA_KEY}` metadata")))?;
    let q = qweight.ok_or_else(|| err(format!("`{base}{SCALES_SUFFIX}` has no `{base}{QWEIGHT_SUFFIX}`")))?;
    let s = scales.ok_or_else(|| err(format!("`{base}{QWEIGHT_SUFFIX}` has no `{base}{SCALES_SUFFIX}`")))?;
    for (suffix, v) in [(QWEIGHT_SUFFIX, q), (SCALES_SUFFIX, s)] {
        if v.dtype() != StDtype::U32 {
            return Err(err(format!("`{base}{suffix}` is {}, expected U32", v.dtype())));
        }
        if v.shape().len() != 2 {
            return Err(err(format!("`{base}{suffix}` has shape {:?}, expected 2-D", v.shape())));
        }
    }
    let format = info.format();
    let (rows, qw) = (q.shape()[0], q.shape()[1]);
    // Words hold 32 / bits codes across the planes (q3: 16 low, 32 high per word).
    let bits = format.kind.lo_bits() + format.kind.hi_bits();
    if (qw * 32) % bits != 0 {
        return Err(err(format!("`{base}{QWEIGHT_SUFFIX}` has {qw} words per row, not a whole number of {bits}-bit {format} codes")));
    }
    let k = qw * 32 / bits;
    format.check(base, k).map_err(|e| err(format!("{e}")))?;
    let want = [rows, format.scale_words(k)];
    if s.shape() != want {
        return Err(err(format!("`{base}{SCALES_SUFFIX}` has shape {:?}, expected {want:?} for {rows} x {k} in {format}", s.shape())));
    }
    let mut data = Vec::with_capacity(q.data().len() + s.data().len());
    data.extend_from_slice(q.data());
    data.extend_from_slice(s.data());
    Ok(HostTensor { name: base.to_string(), shape: vec![rows, k], dtype: DType::Packed(format), data })
}

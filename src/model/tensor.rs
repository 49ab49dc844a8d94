//! Host-side tensors as loaded from a file, before upload, and the model's weight set.
//!
//! Tensors keep their file dtype (including GGUF block-quantized formats) so that later
//! stages can upload packed data without going through floats; `to_f32` dequantizes.

use super::LoadError;
use std::collections::HashMap;

use super::config::ModelConfig;
pub use crate::quant::QuantFormat;
use crate::quant::{ggml, PackedMatrix, QuantError, QuantKind};

/// Storage dtype of a host tensor.
// Variants keep ggml's type names (`Q4_K`, `IQ4_XS`).
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
pub enum DType {
    F32,
    F16,
    BF16,
    /// GGUF Q8_0: blocks of 32, one f16 scale + 32 i8 (34 bytes).
    Q8_0,
    /// GGUF Q4_0: blocks of 32, one f16 scale + 16 bytes of nibbles (18 bytes), value = (q - 8) * d.
    Q4_0,
    /// GGUF Q4_1: blocks of 32, f16 scale d, f16 min m, 16 bytes of nibbles (20 bytes), value = q * d + m.
    Q4_1,
    /// GGUF Q5_0: blocks of 32, f16 scale d, 32 high bits (u32), 16 bytes of low nibbles
    /// (22 bytes), value = (q - 16) * d.
    Q5_0,
    /// GGUF Q5_1: blocks of 32, f16 scale d, f16 min m, 32 high bits, 16 bytes of low nibbles
    /// (24 bytes), value = q * d + m.
    Q5_1,
    /// GGUF Q2_K: super-blocks of 256 (84 bytes), 16 sub-blocks of 16 with 4-bit scale and
    /// minimum, f16 d and dmin, value = (d * sc) * q - dmin * m, q in 0..=3.
    Q2_K,
    /// GGUF Q3_K: super-blocks of 256 (110 bytes), 16 sub-blocks of 16 with 6-bit scales,
    /// f16 d, value = (d * (sc - 32)) * (q - 4), q in 0..=7.
    Q3_K,
    /// GGUF Q4_K: super-blocks of 256 (144 bytes), 8 sub-blocks of 32 with 6-bit scale and
    /// minimum, f16 d and dmin, value = (d * sc) * q - dmin * m, q in 0..=15.
    Q4_K,
    /// GGUF Q5_K: super-blocks of 256 (176 bytes), as Q4_K with 5-bit codes, q in 0..=31.
    Q5_K,
    /// GGUF Q6_K: super-blocks of 256 (210 bytes), 16 sub-blocks of 16 with i8 scales, f16 d,
    /// value = (d * sc) * (q - 32), q in 0..=63.
    Q6_K,
    /// GGUF IQ4_NL: blocks of 32, f16 scale d, 16 bytes of nibbles indexing the non-linear
    /// IQ4 table (18 bytes), value = d * IQ4[q].
    IQ4_NL,
    /// GGUF IQ4_XS: super-blocks of 256 (136 bytes), 8 sub-blocks of 32 with 6-bit scales,
    /// f16 d, value = (d * (ls - 32)) * IQ4[q].
    IQ4_XS,
    /// GGUF MXFP4: blocks of 32, an E8M0 exponent byte e, 16 bytes of nibbles indexing the
    /// E2M1 values (17 bytes), value = 2^(e - 127) * E2M1[q].
    MXFP4,
    /// FP8 E4M3 (`float8_e4m3fn`, safetensors `F8_E4M3`), one byte per element, as read from
    /// a checkpoint before `model::fp8` packs it with its scale.
    F8_E4M3,
    /// Lantern's GPU layout of packed integer weights (a 2-D `[rows, k]` tensor whose data is
    /// `qs` words then `scales` words; see `crate::quant`), as stored by `lantern quantize`.
    Packed(QuantFormat),
}

impl DType {
    /// (elements per block, bytes per block).
    pub fn block(&self) -> (usize, usize) {
        match self {
            DType::F32 => (1, 4),
            DType::F16 | DType::BF16 => (1, 2),
            DType::F8_E4M3 => (1, 1),
            DType::Q8_0 => (32, 34),
            DType::Q4_0 => (32, 18),
            DType::Q4_1 => (32, 20),
            DType::Q5_0 => (32, 22),
            DType::Q5_1 => (32, 24),
            DType::Q2_K => (256, 84),
            DType::Q3_K => (256, 110),
            DType::Q4_K => (256, 144),
            DType::Q5_K => (256, 176),
            DType::Q6_K => (256, 210),
            DType::IQ4_NL => (32, 18),
            DType::IQ4_XS => (256, 136),
            DType::MXFP4 => (32, 17),
            // Per-row scale padding makes the size depend on the shape: see `bytes_for_shape`.
            DType::Packed(f) => (f.group as usize, 0),
        }
    }

    /// Bytes needed for a tensor of `shape`; `None` if its last dimension does not fit the
    /// block (or group) size, or a packed dtype is not 2-D.
    pub fn bytes_for_shape(&self, shape: &[usize]) -> Option<usize> {
        if let DType::Packed(f) = self {
            let [rows, k] = shape else { return None };
            f.check("", *k).ok()?;
            return Some(f.bytes(*rows, *k));
        }
        let n: usize = shape.iter().product();
        let (be, bb) = self.block();
        if !n.is_multiple_of(be) {
            return None;
        }
        Some(n / be * bb)
    }

    /// Short lowercase name for reports (`f32`, `q4_1`, `q4g32`, ...).
    pub fn name(&self) -> String {
        match self {
            DType::Packed(f) => f.to_string(),
            other => format!("{other:?}").to_lowercase(),
        }
    }

    /// The packed kind this dtype repacks into, for integer formats.
    pub fn quant_kind(&self) -> Option<QuantKind> {
        match self {
            DType::Q8_0 => Some(QuantKind::Q8),
            DType::Q4_0 => Some(QuantKind::Q4Sym),
            DType::Q4_1 => Some(QuantKind::Q4),
            DType::Q5_0 => Some(QuantKind::Q5Sym),
            DType::Q5_1 => Some(QuantKind::Q5),
            DType::Q2_K => Some(QuantKind::Q2K),
            DType::Q3_K => Some(QuantKind::Q3K),
            DType::Q4_K => Some(QuantKind::Q4K),
            DType::Q5_K => Some(QuantKind::Q5K),
            DType::Q6_K => Some(QuantKind::Q6K),
            DType::IQ4_NL => Some(QuantKind::Iq4Nl),
            DType::IQ4_XS => Some(QuantKind::Iq4Xs),
            DType::MXFP4 => Some(QuantKind::Mxfp4),
            DType::Packed(f) => Some(f.kind),
            _ => None,
        }
    }
}

/// A tensor in host memory, in its file dtype. `shape` is row-major, outermost first
/// (a Linear weight is `[out_features, in_features]`, as in Hugging Face checkpoints).
#[derive(Debug, Clone)]
pub struct HostTensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: DType,
    pub data: Vec<u8>,
}

impl HostTensor {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn from_f32(name: impl Into<String>, shape: Vec<usize>, values: &[f32]) -> Self {
        HostTensor { name: name.into(), shape, dtype: DType::F32, data: bytemuck::cast_slice(values).to_vec() }
    }

    /// A packed matrix as a `[rows, k]` tensor of its format (`qs` then `scales` bytes).
    pub fn from_packed(name: impl Into<String>, m: &PackedMatrix) -> Self {
        HostTensor { name: name.into(), shape: vec![m.rows, m.k], dtype: DType::Packed(m.format), data: m.to_bytes() }
    }

    /// This 2-D tensor in the packed GPU layout, for integer dtypes (GGUF blocks are
    /// repacked bit for bit); `None` for float dtypes.
    pub fn packed(&self) -> Option<Result<PackedMatrix, QuantError>> {
        let kind = self.dtype.quant_kind()?;
        let (rows, k) = match self.shape.as_slice() {
            [r, k] => (*r, *k),
            _ => {
                return Some(Err(QuantError::Invalid {
                    tensor: self.name.clone(),
                    reason: format!("packed weights must be 2-D, shape is {:?}", self.shape),
                }))
            }
        };
        Some(match self.dtype {
            DType::Packed(f) => PackedMatrix::from_bytes(&self.name, f, rows, k, &self.data),
            _ => PackedMatrix::from_gguf_blocks(&self.name, kind, &self.data, rows, k),
        })
    }

    /// Dequantize / convert to f32 values.
    pub fn to_f32(&self) -> Vec<f32> {
        let n = self.numel();
        let d = &self.data;
        let f16 = |b: &[u8]| half::f16::from_le_bytes([b[0], b[1]]).to_f32();
        match self.dtype {
            DType::F32 => d.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
            DType::F16 => d.chunks_exact(2).map(f16).collect(),
            DType::BF16 => d.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            DType::F8_E4M3 => d.iter().map(|&b| crate::quant::e4m3(b)).collect(),
            DType::Q8_0 => {
                let mut out = Vec::with_capacity(n);
                for b in d.chunks_exact(34) {
                    let s = f16(&b[0..2]);
                    out.extend(b[2..34].iter().map(|&q| q as i8 as f32 * s));
                }
                out
            }
            DType::Q4_0 => {
                let mut out = vec![0.0; n];
                for (bi, b) in d.chunks_exact(18).enumerate() {
                    let s = f16(&b[0..2]);
                    for j in 0..16 {
                        out[bi * 32 + j] = ((b[2 + j] & 0x0f) as i32 - 8) as f32 * s;
                        out[bi * 32 + j + 16] = ((b[2 + j] >> 4) as i32 - 8) as f32 * s;
                    }
                }
                out
            }
            DType::Packed(_) => match self.packed() {
                Some(Ok(m)) => m.dequantize(),
                // Validation rejects malformed packed tensors before anything converts them.
                _ => vec![0.0; n],
            },
            DType::Q4_1 => {
                let mut out = vec![0.0; n];
                for (bi, b) in d.chunks_exact(20).enumerate() {
                    let s = f16(&b[0..2]);
                    let m = f16(&b[2..4]);
                    for j in 0..16 {
                        out[bi * 32 + j] = (b[4 + j] & 0x0f) as f32 * s + m;
                        out[bi * 32 + j + 16] = (b[4 + j] >> 4) as f32 * s + m;
                    }
                }
                out
            }
            DType::Q5_0
            | DType::Q5_1
            | DType::Q2_K
            | DType::Q3_K
            | DType::Q4_K
            | DType::Q5_K
            | DType::Q6_K
            | DType::IQ4_NL
            | DType::IQ4_XS
            | DType::MXFP4 => match self.dtype.quant_kind().map(|kind| ggml::dequantize_blocks(kind, d, n)) {
                Some(Ok(v)) => v,
                // Validation rejects GGUF tensors whose size does not fit their blocks.
                _ => vec![0.0; n],
            },
        }
    }
}

/// A loaded model: its config and its tensors under canonical (Hugging Face) names, e.g.
/// `model.embed_tokens.weight`, `model.layers.3.self_attn.q_proj.weight`, `lm_head.weight`
/// (absent when embeddings are tied). Q/K rows are in the Hugging Face `rotate_half` layout,
/// whatever the source file stored.
#[derive(Debug, Clone)]
pub struct ModelWeights {
    pub config: ModelConfig,
    pub tensors: HashMap<String, HostTensor>,
    /// Where the weights came from (file or folder), for error messages.
    pub source: String,
}

impl ModelWeights {
    /// Split the row-stacked tensor `name` into consecutive row ranges named as `parts` says
    /// (rows each), replacing it. Float and GGUF block dtypes split on byte boundaries (a row
    /// is a whole number of blocks); a missing tensor is left alone.
    pub fn split_rows(&mut self, name: &str, parts: &[(String, usize)]) -> Result<(), LoadError> {
        let Some(t) = self.tensors.remove(name) else {
            return Ok(());
        };
        let invalid = |reason: String| LoadError::Invalid { file: self.source.clone(), reason: format!("tensor `{name}`: {reason}") };
        let rows: usize = parts.iter().map(|p| p.1).sum();
        let (r, rest) = match t.shape.split_first() {
            Some((r, rest)) => (*r, rest.to_vec()),
            None => return Err(invalid("is a scalar".into())),
        };
        if r != rows {
            return Err(LoadError::WrongShape {
                file: self.source.clone(),
                tensor: name.to_string(),
                got: t.shape.clone(),
                expected: [vec![rows], rest].concat(),
            });
        }
        if matches!(t.dtype, DType::Packed(_)) {
            return Err(invalid("fused Lantern-packed tensors cannot be split".into()));
        }
        let row_bytes =
            t.dtype.bytes_for_shape(&[&[1usize][..], &rest].concat()).ok_or_else(|| invalid("rows are not whole blocks".into()))?;
        if row_bytes * rows != t.data.len() {
            return Err(invalid(format!("holds {} bytes, expected {rows} rows of {row_bytes}", t.data.len())));
        }
        let mut at = 0;
        for (part, n) in parts {
            let shape = [vec![*n], rest.clone()].concat();
            let data = t.data[at * row_bytes..(at + n) * row_bytes].to_vec();
            self.tensors.insert(part.clone(), HostTensor { name: part.clone(), shape, dtype: t.dtype, data });
            at += n;
        }
        Ok(())
    }

    /// Split the 3-D tensor `name` (`[parts.len(), rows, cols]`) into one `[rows, cols]`
    /// tensor per name in `parts`, replacing it (GGUF's expert tensors): [`Self::split_rows`]
    /// with one row of the first dimension per part, then that dimension dropped. A missing
    /// tensor is left alone.
    pub fn split_first_dim(&mut self, name: &str, parts: &[String]) -> Result<(), LoadError> {
        match self.tensors.get(name) {
            None => return Ok(()),
            Some(t) if t.shape.len() != 3 => {
                return Err(LoadError::WrongShape {
                    file: self.source.clone(),
                    tensor: name.to_string(),
                    got: t.shape.clone(),
                    expected: vec![parts.len(), 0, 0],
                })
            }
            Some(_) => {}
        }
        let ones: Vec<(String, usize)> = parts.iter().map(|p| (p.clone(), 1)).collect();
        self.split_rows(name, &ones)?;
        for part in parts {
            if let Some(t) = self.tensors.get_mut(part) {
                t.shape.remove(0);
            }
        }
        Ok(())
    }

    /// Fused tensors as the separate tensors every other part of Lantern reads: Phi-3's
    /// `qkv_proj` and `gate_up_proj`, and GGUF's 3-D expert tensors (one per projection,
    /// every expert of a layer) as one tensor per expert under the checkpoint's names.
    pub fn unfuse(&mut self) -> Result<(), LoadError> {
        if self.config.block.moe.is_some() {
            let c = self.config.clone();
            for l in 0..c.num_layers {
                let Some(names) = super::validate::expert_names(&c, l) else { continue };
                for (i, proj) in ["gate_proj", "up_proj", "down_proj"].iter().enumerate() {
                    let parts: Vec<String> = names.experts.iter().map(|e| e[i].clone()).collect();
                    self.split_first_dim(&format!("model.layers.{l}.mlp.experts.{proj}.weight"), &parts)?;
                }
            }
        }
        if self.config.arch != super::Arch::Phi3 {
            return Ok(());
        }
        let c = self.config.clone();
        let (q, kv, f) = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size);
        for l in 0..c.num_layers {
            let p = format!("model.layers.{l}");
            let qkv = [
                (format!("{p}.self_attn.q_proj.weight"), q),
                (format!("{p}.self_attn.k_proj.weight"), kv),
                (format!("{p}.self_attn.v_proj.weight"), kv),
            ];
            self.split_rows(&format!("{p}.self_attn.qkv_proj.weight"), &qkv)?;
            let gu = [(format!("{p}.mlp.gate_proj.weight"), f), (format!("{p}.mlp.up_proj.weight"), f)];
            self.split_rows(&format!("{p}.mlp.gate_up_proj.weight"), &gu)?;
        }
        Ok(())
    }
}

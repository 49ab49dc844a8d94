//! Synthetic GGUF files: a real model's header (metadata, tokenizer, tensor infos) with
//! generated tensor data, for speed tests on machines that cannot download the weights (a
//! GPU machine without network gets the headers, a few MB, instead of the GBs). The data
//! keeps every tensor's type and shape, so a run reads and decodes exactly the bytes the
//! real model would: quantized blocks get pseudo-random codes and small positive scales,
//! float tensors (norms, biases) ones. The tokens such a model generates mean nothing.

use std::io::Write;

use super::{GgmlType, GgufError, GgufFile};
use crate::quant::QuantKind;

/// The header of a GGUF file (everything before its tensor data, alignment padding
/// included): what [`write_synthetic`] expands back into a whole file. `bytes` holds at
/// least the header (a whole file will do).
pub fn header(bytes: &[u8], file_name: &str) -> Result<Vec<u8>, GgufError> {
    let g = parse_header(bytes, file_name)?;
    let end = g.data_offset() as usize;
    Ok(bytes.get(..end).ok_or_else(|| truncated(file_name, end, bytes.len()))?.to_vec())
}

fn truncated(file: &str, needed: usize, available: usize) -> GgufError {
    GgufError::Truncated { file: file.into(), what: "the header".into(), offset: 0, needed: needed as u64, available: available as u64 }
}

/// A header-only prefix parses like the whole file (tensors are not read).
fn parse_header<'a>(bytes: &'a [u8], file_name: &str) -> Result<GgufFile<'a>, GgufError> {
    GgufFile::parse_prefix(bytes, u64::MAX, file_name)
}

/// Bytes of tensor data the header describes (its data section, padded to the alignment).
pub fn data_bytes(header_bytes: &[u8], file_name: &str) -> Result<u64, GgufError> {
    let g = parse_header(header_bytes, file_name)?;
    let end = g.tensors().iter().map(|t| t.offset + t.size).max().unwrap_or(0);
    Ok(end.div_ceil(g.alignment()) * g.alignment())
}

/// Write a whole GGUF file: `header_bytes` (from [`header`] or a real file) followed by
/// generated data for every tensor it lists. Calls `progress(written, total)` now and then.
/// Returns the file's size.
pub fn write_synthetic(
    header_bytes: &[u8],
    file_name: &str,
    out: &mut impl Write,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<u64, SynthError> {
    let g = parse_header(header_bytes, file_name)?;
    let head = &header_bytes[..g.data_offset() as usize];
    let total = data_bytes(header_bytes, file_name)?;
    out.write_all(head)?;
    let mut tensors: Vec<_> = g.tensors().to_vec();
    tensors.sort_by_key(|t| t.offset);
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut at = 0u64;
    let mut buf = Vec::new();
    for t in &tensors {
        if t.offset < at {
            return Err(SynthError::Overlap { file: file_name.into(), tensor: t.name.clone() });
        }
        out.write_all(&vec![0u8; (t.offset - at) as usize])?;
        at = t.offset;
        buf.clear();
        buf.resize(t.size as usize, 0);
        let k = t.dims.first().copied().unwrap_or(1).max(1);
        fill(&mut buf, t.ggml_type, k, &mut rng).ok_or_else(|| SynthError::Unsupported {
            file: file_name.into(),
            tensor: t.name.clone(),
            ggml_type: t.ggml_type.name(),
        })?;
        out.write_all(&buf)?;
        at += t.size;
        progress(at, total);
    }
    out.write_all(&vec![0u8; (total - at) as usize])?;
    progress(total, total);
    Ok(head.len() as u64 + total)
}

/// Errors of [`write_synthetic`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SynthError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("{file}: tensor `{tensor}` overlaps the one before it")]
    Overlap { file: String, tensor: String },
    #[error("{file}: tensor `{tensor}` is {ggml_type}, which the synthesizer cannot fill (F32, F16, BF16 and the quantized types Lantern reads)")]
    Unsupported { file: String, tensor: String, ggml_type: String },
    #[error("writing the synthetic file: {0}")]
    Io(#[from] std::io::Error),
}

/// Fill one tensor's bytes (rows of `k` elements): floats with ones, quantized blocks with
/// pseudo-random bytes and their f16 scale fields with 1 / (64 sqrt(k)), so that products over
/// a row stay of order one through the layers (no overflow, no denormals, which CPU adapters
/// compute slowly). `None` for a type it cannot fill.
fn fill(buf: &mut [u8], ty: GgmlType, k: u64, rng: &mut u64) -> Option<()> {
    use crate::model::tensor::DType;
    match ty.to_dtype()? {
        DType::F32 => buf.chunks_exact_mut(4).for_each(|c| c.copy_from_slice(&1.0f32.to_le_bytes())),
        DType::F16 => buf.chunks_exact_mut(2).for_each(|c| c.copy_from_slice(&half::f16::ONE.to_le_bytes())),
        DType::BF16 => buf.chunks_exact_mut(2).for_each(|c| c.copy_from_slice(&half::bf16::ONE.to_le_bytes())),
        dt => {
            let kind: QuantKind = dt.quant_kind()?;
            for c in buf.chunks_mut(8) {
                *rng ^= *rng << 13;
                *rng ^= *rng >> 7;
                *rng ^= *rng << 17;
                c.copy_from_slice(&rng.to_le_bytes()[..c.len()]);
            }
            let (_, block) = crate::quant::ggml::block_size(kind);
            let scale = half::f16::from_f32(1.0 / (64.0 * (k as f32).sqrt())).to_le_bytes();
            for b in buf.chunks_exact_mut(block) {
                for &at in crate::quant::ggml::f16_fields(kind) {
                    b[at..at + 2].copy_from_slice(&scale);
                }
            }
        }
    }
    Some(())
}

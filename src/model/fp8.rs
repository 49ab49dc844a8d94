//! FP8 weights of Hugging Face checkpoints: `float8_e4m3fn` tensors (safetensors `F8_E4M3`)
//! with their scales, kept as 8-bit codes on the GPU ([`QuantKind::Fp8`]) and decoded in the
//! shaders.
//!
//! The checkpoints the hub publishes store a weight `<w>` beside one scale tensor:
//!
//! - `<w>_scale_inv` (DeepSeek-V3, Qwen3-FP8, transformers' `fp8` quantization method):
//!   blocks of `[128, 128]` (any power-of-two block, found from the shapes), shape
//!   `[ceil(rows / br), ceil(k / bk)]`;
//! - `<w>_scale` (llm-compressor's `compressed-tensors`, `fbgemm_fp8`): per tensor (one
//!   element), per output channel (`[rows]` or `[rows, 1]`) or per group along the row
//!   (`[rows, k / g]`).
//!
//! Either way the value is `E4M3(q) * scale` (the `_inv` of DeepSeek's name notwithstanding:
//! its own dequantization multiplies). A tensor without a scale is its E4M3 values. Each row
//! of 32 elements takes the scale of the block holding it (so column blocks must be whole
//! multiples of 32), stored as an f16 of `scale * 256` ([`QuantKind::Fp8`]). Activation
//! scales (`input_scale`) are left as they are: activations stay f32 (weights-only FP8).

use std::collections::HashMap;

use half::f16;

use super::tensor::{DType, HostTensor};
use super::LoadError;
use crate::quant::{PackedMatrix, QuantKind};

/// Suffixes of the scale beside an FP8 weight, in the order they are looked for.
pub const SCALE_SUFFIXES: [&str; 2] = ["_scale_inv", "_scale"];

/// Elements per stored scale: the 32 of every 32-element packed format.
const GROUP: usize = 32;

/// Replace every `F8_E4M3` tensor of `tensors` (and the scale beside it) by its
/// [`QuantKind::Fp8`] packing. `file` names the checkpoint in errors, which name the tensor
/// and what was expected: a weight that is not 2-D, a row length that is not a multiple of
/// 32, a NaN code, a scale of an unknown shape, dtype or size, or one that no f16 holds.
pub fn pack_fp8_tensors(file: &str, tensors: &mut HashMap<String, HostTensor>) -> Result<(), LoadError> {
    let mut names: Vec<String> = tensors.iter().filter(|(_, t)| t.dtype == DType::F8_E4M3).map(|(n, _)| n.clone()).collect();
    names.sort();
    for name in names {
        let scale_name = SCALE_SUFFIXES.iter().map(|s| format!("{name}{s}")).find(|n| tensors.contains_key(n));
        let scale = match &scale_name {
            Some(n) => {
                let t = tensors.remove(n).expect("found above");
                if t.dtype.quant_kind().is_some() || t.dtype == DType::F8_E4M3 {
                    return Err(invalid(file, format!("scale `{n}` is {}, expected F32, F16 or BF16", t.dtype.name())));
                }
                Some((n.clone(), t))
            }
            None => None,
        };
        let weight = tensors.remove(&name).expect("listed above");
        let packed = pack(file, &weight, scale.as_ref().map(|(n, t)| (n.as_str(), t)))?;
        tensors.insert(name.clone(), HostTensor::from_packed(name, &packed));
    }
    Ok(())
}

fn invalid(file: &str, reason: String) -> LoadError {
    LoadError::Invalid { file: file.to_string(), reason }
}

/// The scale of element `(r, c)`, from a scale tensor of `shape` over a `rows x k` weight.
#[derive(Debug, Clone, Copy)]
struct ScaleGrid {
    /// Rows and columns per scale.
    br: usize,
    bk: usize,
    /// Scales per row of the grid.
    cols: usize,
}

impl ScaleGrid {
    fn at(&self, r: usize, c: usize) -> usize {
        (r / self.br) * self.cols + c / self.bk
    }
}

/// The block edge `b` with `ceil(n / b) == s`: the power of two that gives it (checkpoints'
/// blocks: 128 rows over 160 give 2 blocks, not 2 of 80), else `n / s` when it divides
/// exactly; `None` if there is neither. Where several powers of two fit, `s` is 1 and all
/// of them make the same single block.
fn block_edge(n: usize, s: usize) -> Option<usize> {
    if s == 0 {
        return None;
    }
    (0..usize::BITS).map(|i| 1usize << i).find(|&b| n.div_ceil(b) == s).or((n.is_multiple_of(s)).then(|| n / s))
}

fn grid(file: &str, weight: &str, scale: &str, shape: &[usize], rows: usize, k: usize) -> Result<ScaleGrid, LoadError> {
    let numel: usize = shape.iter().product();
    let (sr, sk) = match shape {
        _ if numel == 1 => (1, 1),
        [n] if *n == rows => (rows, 1),
        [a, b] => (*a, *b),
        _ => (0, 0),
    };
    let (br, bk) = match (block_edge(rows, sr), block_edge(k, sk)) {
        (Some(br), Some(bk)) => (br, bk),
        _ => {
            return Err(invalid(
                file,
                format!(
                    "scale `{scale}` has shape {shape:?}, which does not tile the {rows} x {k} weight `{weight}` \
                     (expected one element, [{rows}], [{rows}, 1], or [ceil({rows} / br), ceil({k} / bk)] blocks)"
                ),
            ))
        }
    };
    if sk > 1 && !bk.is_multiple_of(GROUP) {
        return Err(invalid(
            file,
            format!("scale `{scale}` has blocks of {bk} columns over `{weight}`; FP8 weights need column blocks of a multiple of {GROUP}"),
        ));
    }
    Ok(ScaleGrid { br, bk, cols: sk })
}

/// One FP8 weight and its scale (`None`: the values as they are) into the packed layout.
fn pack(file: &str, w: &HostTensor, scale: Option<(&str, &HostTensor)>) -> Result<PackedMatrix, LoadError> {
    let name = &w.name;
    let [rows, k] = w.shape[..] else {
        return Err(invalid(file, format!("FP8 tensor `{name}` has shape {:?}; FP8 is read for 2-D weights only", w.shape)));
    };
    if k == 0 || !k.is_multiple_of(GROUP) {
        return Err(invalid(file, format!("FP8 weight `{name}` has rows of {k} elements, not a multiple of {GROUP}")));
    }
    if w.data.len() != rows * k {
        return Err(invalid(file, format!("FP8 weight `{name}` holds {} bytes, expected {}", w.data.len(), rows * k)));
    }
    if let Some(i) = w.data.iter().position(|&b| b & 0x7f == 0x7f) {
        return Err(invalid(file, format!("FP8 weight `{name}` holds a NaN at row {}, column {}", i / k, i % k)));
    }
    let (values, g) = match scale {
        Some((sname, s)) => (s.to_f32(), grid(file, name, sname, &s.shape, rows, k)?),
        None => (vec![1.0], ScaleGrid { br: rows, bk: k, cols: 1 }),
    };
    // Lantern's FP8 block (`quant::ggml`): the f16 of scale x 256, then the 32 bytes.
    let groups = k / GROUP;
    let mut blocks = Vec::with_capacity(rows * groups * 34);
    for r in 0..rows {
        for gi in 0..groups {
            let c = gi * GROUP;
            let s = values[g.at(r, c)];
            let d = f16::from_f32(s * 256.0);
            if !d.is_finite() || (s != 0.0 && d.to_f32() == 0.0) {
                let sname = scale.map_or("", |(n, _)| n);
                return Err(invalid(
                    file,
                    format!("scale `{sname}` of `{name}` at row {r}, column {c} is {s:e}, outside what Lantern stores (|scale| from 2.4e-10 to 255)"),
                ));
            }
            blocks.extend_from_slice(&d.to_le_bytes());
            blocks.extend_from_slice(&w.data[r * k + c..r * k + c + GROUP]);
        }
    }
    PackedMatrix::from_gguf_blocks(name, QuantKind::Fp8, &blocks, rows, k).map_err(|e| invalid(file, e.to_string()))
}

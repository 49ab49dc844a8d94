//! Packed integer weights as the GPU kernels read them, and the CPU reference for them.
//!
//! A quantized matrix (`rows x k`) is two arrays of little-endian `u32` words:
//!
//! - `qs`, row-major, `k / 8` words per row for 4-bit formats (nibble `n` of word `i` is
//!   element `8 i + n`) and `k / 4` words per row for 8-bit (byte `b` of word `i` is the
//!   two's-complement element `4 i + b`);
//! - `scales`, row-major, one group of `group` consecutive elements of a row per scale:
//!   `Q4` keeps `(d, m)` as two f16 in one word per group (value = `q d + m`, `q` in 0..15,
//!   filled from GGUF Q4_1); `Q4Sym` and `Q8` keep one f16 `d` per group, two groups per word,
//!   each row padded to a whole word (value = `(q - 8) d` for `Q4Sym`, filled from GGUF Q4_0;
//!   `q d` with `q` in -127..127 for `Q8`, filled from GGUF Q8_0).
//!
//! The same bytes travel from a GGUF file (repacked block by block, bits only, no floats) or a
//! quantized safetensors file (stored as is) into GPU buffers. Dequantization here is the
//! oracle: the kernels compute `q * d + m` in f32 exactly as [`PackedMatrix::dequantize`].

use half::f16;

pub mod awq;
pub mod quantize;
pub mod safetensors;

pub use quantize::{quantize_model, EmbeddingPolicy, Method, QuantizeOptions, QuantizedModel};

/// Bit layout of a packed weight.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum QuantKind {
    /// 8-bit symmetric: value = q d, q in -127..=127.
    Q8,
    /// 4-bit with scale and minimum: value = q d + m, q in 0..=15 (GGUF Q4_1).
    Q4,
    /// 4-bit symmetric: value = (q - 8) d, q in 0..=15 (GGUF Q4_0).
    Q4Sym,
}

impl QuantKind {
    /// Elements per `u32` of `qs`.
    pub fn per_word(&self) -> usize {
        match self {
            QuantKind::Q8 => 4,
            QuantKind::Q4 | QuantKind::Q4Sym => 8,
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            QuantKind::Q8 => "q8",
            QuantKind::Q4 => "q4",
            QuantKind::Q4Sym => "q4sym",
        }
    }

    pub fn parse(s: &str) -> Option<QuantKind> {
        match s {
            "q8" => Some(QuantKind::Q8),
            "q4" => Some(QuantKind::Q4),
            "q4sym" | "q4s" => Some(QuantKind::Q4Sym),
            _ => None,
        }
    }
}

/// A packed format: bit layout and group size (elements of a row per scale).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
pub struct QuantFormat {
    pub kind: QuantKind,
    pub group: u32,
}

impl std::fmt::Display for QuantFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}g{}", self.kind.name(), self.group)
    }
}

/// Why a matrix cannot be packed in a format.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum QuantError {
    #[error("tensor `{tensor}`: row length {k} is not a multiple of the group size {group} ({format})")]
    GroupMismatch { tensor: String, k: usize, group: u32, format: String },
    #[error("tensor `{tensor}`: group size {group} must be a positive multiple of 8")]
    BadGroup { tensor: String, group: u32 },
    #[error("tensor `{tensor}`: {reason}")]
    Invalid { tensor: String, reason: String },
}

impl QuantFormat {
    pub fn new(kind: QuantKind, group: u32) -> Self {
        QuantFormat { kind, group }
    }

    /// Check that rows of `k` elements can be stored in this format.
    pub fn check(&self, tensor: &str, k: usize) -> Result<(), QuantError> {
        if self.group == 0 || !self.group.is_multiple_of(8) {
            return Err(QuantError::BadGroup { tensor: tensor.into(), group: self.group });
        }
        if k == 0 || !k.is_multiple_of(self.group as usize) {
            return Err(QuantError::GroupMismatch {
                tensor: tensor.into(),
                k,
                group: self.group,
                format: self.to_string(),
            });
        }
        Ok(())
    }

    /// Groups per row.
    pub fn groups(&self, k: usize) -> usize {
        k / self.group as usize
    }

    /// `qs` words per row.
    pub fn qs_words(&self, k: usize) -> usize {
        k / self.kind.per_word()
    }

    /// `scales` words per row.
    pub fn scale_words(&self, k: usize) -> usize {
        match self.kind {
            QuantKind::Q4 => self.groups(k),
            QuantKind::Q8 | QuantKind::Q4Sym => self.groups(k).div_ceil(2),
        }
    }

    /// Bytes of a `rows x k` matrix (qs + scales).
    pub fn bytes(&self, rows: usize, k: usize) -> usize {
        rows * (self.qs_words(k) + self.scale_words(k)) * 4
    }
}

/// A packed `rows x k` matrix in the GPU layout (see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct PackedMatrix {
    pub format: QuantFormat,
    pub rows: usize,
    pub k: usize,
    pub qs: Vec<u32>,
    pub scales: Vec<u32>,
}

fn f16_bits(b: &[u8]) -> u32 {
    u16::from_le_bytes([b[0], b[1]]) as u32
}

/// Largest |v| of a group of finite values, exactly (on the bits, so the loop vectorizes).
#[inline(always)]
fn abs_max_bits(x: &[f32]) -> u32 {
    x.iter().map(|v| v.to_bits() & 0x7fff_ffff).fold(0, u32::max)
}

/// An `i32` whose order is the order of the finite f32 `v` (negative values have every bit
/// but the sign flipped); its own inverse.
#[inline(always)]
fn order_key(bits: i32) -> i32 {
    bits ^ (((bits >> 31) as u32) >> 1) as i32
}

/// Scale word bits, `d` and `m` of one group under round-to-nearest (the stored f16 scale and
/// minimum, as f32). Shared by [`PackedMatrix::quantize`] and [`fake_quantize`]. The values
/// must be finite.
#[inline]
fn group_params(kind: QuantKind, x: &[f32]) -> (u32, f32, f32) {
    match kind {
        QuantKind::Q8 => {
            let amax = f32::from_bits(abs_max_bits(x));
            let d = f16::from_f32(amax / 127.0);
            (d.to_bits() as u32, d.to_f32(), 0.0)
        }
        QuantKind::Q4Sym => {
            // As llama.cpp's Q4_0: the value of largest magnitude (the first one, on ties)
            // maps to -8, so its sign gets the extra code.
            let a = abs_max_bits(x);
            let vmax = if a == 0 { 0.0 } else { x.iter().copied().find(|v| v.to_bits() & 0x7fff_ffff == a).unwrap_or(0.0) };
            let d = f16::from_f32(vmax / -8.0);
            (d.to_bits() as u32, d.to_f32(), -8.0 * d.to_f32())
        }
        QuantKind::Q4 => {
            let (lo, hi) = x
                .iter()
                .map(|v| order_key(v.to_bits() as i32))
                .fold((i32::MAX, i32::MIN), |(lo, hi), k| (lo.min(k), hi.max(k)));
            let (lo, hi) = (f32::from_bits(order_key(lo) as u32), f32::from_bits(order_key(hi) as u32));
            let m = f16::from_f32(lo);
            // Scale from the stored minimum so the top of the range is reachable.
            let d = f16::from_f32((hi - m.to_f32()).max(0.0) / 15.0);
            (d.to_bits() as u32 | (m.to_bits() as u32) << 16, d.to_f32(), m.to_f32())
        }
    }
}

/// `x.clamp(lo, hi).round()` (half away from zero) for integers `lo < hi`, without a libm
/// call or a branch, so that loops over it vectorize on targets lacking a rounding
/// instruction: clamp (a NaN becomes `lo`), truncate by conversion, then step by the exact
/// remainder. Clamping first gives the same result as rounding first, as the bounds are
/// integers.
#[inline(always)]
fn round_clamped(x: f32, lo: f32, hi: f32) -> f32 {
    let c = x.max(lo).min(hi);
    // SAFETY: `c` is finite and within [lo, hi] ⊂ [-127, 127] (`max` returns `lo` for NaN).
    let t = unsafe { c.to_int_unchecked::<i32>() } as f32;
    let r = c - t;
    t + if r >= 0.5 { 1.0 } else { 0.0 } - if r <= -0.5 { 1.0 } else { 0.0 }
}

/// The code of `v` (as a float) in a group with inverse scale `inv` and minimum `m`.
#[inline(always)]
fn round_code_f(kind: QuantKind, v: f32, inv: f32, m: f32) -> f32 {
    match kind {
        QuantKind::Q8 => round_clamped(v * inv, -127.0, 127.0),
        QuantKind::Q4Sym | QuantKind::Q4 => round_clamped((v - m) * inv, 0.0, 15.0),
    }
}

/// The integer code of `v` in a group with inverse scale `inv` and minimum `m`.
#[inline(always)]
fn round_code(kind: QuantKind, v: f32, inv: f32, m: f32) -> i32 {
    round_code_f(kind, v, inv, m) as i32
}

fn non_finite_scale(tensor: &str, r: usize, g: usize, x: &[f32], format: QuantFormat) -> QuantError {
    QuantError::Invalid {
        tensor: tensor.into(),
        reason: format!(
            "row {r}, group {g}: values up to {:e} do not fit an f16 scale ({})",
            x.iter().fold(0f32, |a, v| a.max(v.abs())),
            format
        ),
    }
}

/// Round-to-nearest then dequantize, in place, without packing: every element of `values`
/// (`rows x k`, row-major) becomes exactly what
/// `PackedMatrix::quantize(..).dequantize()` gives for it (same codes, same f32 `q d + m`).
/// For searches that score many candidate quantizations (AWQ).
pub fn fake_quantize(tensor: &str, values: &mut [f32], k: usize, format: QuantFormat) -> Result<(), QuantError> {
    format.check(tensor, k)?;
    let group = format.group as usize;
    for (r, row) in values.chunks_exact_mut(k).enumerate() {
        for (g, x) in row.chunks_exact_mut(group).enumerate() {
            // Branch-free finiteness test (exponent all ones = inf or NaN), then find it.
            if x.iter().fold(false, |a, v| a | (v.to_bits() & 0x7f80_0000 == 0x7f80_0000)) {
                let i = x.iter().position(|v| !v.is_finite()).unwrap_or(0);
                return Err(QuantError::Invalid {
                    tensor: tensor.into(),
                    reason: format!("non-finite value {} in row {r}, group {g}, element {i}", x[i]),
                });
            }
            let (_, d, m) = group_params(format.kind, x);
            if !(d.is_finite() && m.is_finite()) {
                return Err(non_finite_scale(tensor, r, g, x, format));
            }
            let inv = if d != 0.0 { 1.0 / d } else { 0.0 };
            // One loop per kind so the per-element match disappears.
            match format.kind {
                QuantKind::Q8 => x.iter_mut().for_each(|v| *v = round_code_f(QuantKind::Q8, *v, inv, m) * d + m),
                QuantKind::Q4 => x.iter_mut().for_each(|v| *v = round_code_f(QuantKind::Q4, *v, inv, m) * d + m),
                QuantKind::Q4Sym => x.iter_mut().for_each(|v| *v = round_code_f(QuantKind::Q4Sym, *v, inv, m) * d + m),
            }
        }
    }
    Ok(())
}

impl PackedMatrix {
    /// Bytes of weights plus scale metadata.
    pub fn bytes(&self) -> usize {
        (self.qs.len() + self.scales.len()) * 4
    }

    /// Bytes of scale metadata alone.
    pub fn scale_bytes(&self) -> usize {
        self.scales.len() * 4
    }

    /// `(d, m)` of a group: the values are `q d + m` with the format's `q`.
    pub fn group_scale(&self, row: usize, g: usize) -> (f32, f32) {
        let sw = self.format.scale_words(self.k);
        match self.format.kind {
            QuantKind::Q4 => {
                let w = self.scales[row * sw + g];
                (
                    f16::from_bits(w as u16).to_f32(),
                    f16::from_bits((w >> 16) as u16).to_f32(),
                )
            }
            QuantKind::Q8 | QuantKind::Q4Sym => {
                let w = self.scales[row * sw + g / 2];
                let d = f16::from_bits((w >> (16 * (g as u32 & 1))) as u16).to_f32();
                if self.format.kind == QuantKind::Q4Sym {
                    (d, -8.0 * d)
                } else {
                    (d, 0.0)
                }
            }
        }
    }

    /// The integer code of element `(row, c)` (0..15 for 4-bit, -127..127 for Q8).
    pub fn code(&self, row: usize, c: usize) -> i32 {
        let pw = self.format.kind.per_word();
        let w = self.qs[row * (self.k / pw) + c / pw];
        match self.format.kind {
            QuantKind::Q8 => (w >> (8 * (c % 4))) as u8 as i8 as i32,
            QuantKind::Q4 | QuantKind::Q4Sym => ((w >> (4 * (c % 8))) & 15) as i32,
        }
    }

    /// The CPU reference: every element as `q d + m` in f32 (what the kernels compute).
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.rows * self.k);
        let group = self.format.group as usize;
        for r in 0..self.rows {
            for g in 0..self.format.groups(self.k) {
                let (d, m) = self.group_scale(r, g);
                for c in g * group..(g + 1) * group {
                    out.push(self.code(r, c) as f32 * d + m);
                }
            }
        }
        out
    }

    /// Stack matrices with the same format and row length (q|k|v into one projection).
    pub fn concat_rows(parts: &[PackedMatrix]) -> Result<PackedMatrix, QuantError> {
        let first = parts.first().ok_or_else(|| QuantError::Invalid {
            tensor: "<concat>".into(),
            reason: "no parts".into(),
        })?;
        let mut out = PackedMatrix {
            format: first.format,
            rows: 0,
            k: first.k,
            qs: Vec::new(),
            scales: Vec::new(),
        };
        for p in parts {
            if p.format != first.format || p.k != first.k {
                return Err(QuantError::Invalid {
                    tensor: "<concat>".into(),
                    reason: format!("cannot stack {} x {} ({}) under {} x {} ({})", p.rows, p.k, p.format, first.rows, first.k, first.format),
                });
            }
            out.rows += p.rows;
            out.qs.extend_from_slice(&p.qs);
            out.scales.extend_from_slice(&p.scales);
        }
        Ok(out)
    }

    /// Repack GGUF blocks (Q8_0, Q4_0, Q4_1; 32 elements per block) of a `rows x k` matrix.
    /// Only bits move: the f16 scales and integer codes are copied, never converted.
    pub fn from_gguf_blocks(tensor: &str, kind: QuantKind, data: &[u8], rows: usize, k: usize) -> Result<PackedMatrix, QuantError> {
        let format = QuantFormat::new(kind, 32);
        format.check(tensor, k)?;
        let block_bytes = match kind {
            QuantKind::Q8 => 34,
            QuantKind::Q4Sym => 18,
            QuantKind::Q4 => 20,
        };
        let blocks = rows * k / 32;
        if data.len() != blocks * block_bytes {
            return Err(QuantError::Invalid {
                tensor: tensor.into(),
                reason: format!("{} bytes of GGUF blocks, expected {} for {rows} x {k}", data.len(), blocks * block_bytes),
            });
        }
        let g = k / 32;
        let sw = format.scale_words(k);
        let mut qs = Vec::with_capacity(rows * format.qs_words(k));
        let mut scales = vec![0u32; rows * sw];
        for (bi, b) in data.chunks_exact(block_bytes).enumerate() {
            let (row, gi) = (bi / g, bi % g);
            match kind {
                QuantKind::Q8 => {
                    scales[row * sw + gi / 2] |= f16_bits(&b[0..2]) << (16 * (gi & 1));
                    qs.extend(b[2..34].chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])));
                }
                QuantKind::Q4Sym | QuantKind::Q4 => {
                    let (nib, sc) = if kind == QuantKind::Q4 {
                        (&b[4..20], f16_bits(&b[0..2]) | f16_bits(&b[2..4]) << 16)
                    } else {
                        (&b[2..18], f16_bits(&b[0..2]))
                    };
                    if kind == QuantKind::Q4 {
                        scales[row * sw + gi] = sc;
                    } else {
                        scales[row * sw + gi / 2] |= sc << (16 * (gi & 1));
                    }
                    // GGUF: byte j holds element j (low nibble) and j + 16 (high nibble).
                    let mut words = [0u32; 4];
                    for e in 0..32 {
                        let q = if e < 16 { nib[e] & 15 } else { nib[e - 16] >> 4 } as u32;
                        words[e / 8] |= q << (4 * (e % 8));
                    }
                    qs.extend_from_slice(&words);
                }
            }
        }
        Ok(PackedMatrix { format, rows, k, qs, scales })
    }

    /// Round-to-nearest quantization of a `rows x k` f32 matrix, group by group. Codes are
    /// computed against the f16-rounded scale that is stored, so the only error is rounding:
    /// `|w - deq(w)| <= d / 2` per element (Q8, Q4Sym inside the clamp) and `<= d / 2 + ulp`
    /// for Q4 (see `tests/quant.rs` for the measured bounds).
    pub fn quantize(tensor: &str, values: &[f32], rows: usize, k: usize, format: QuantFormat) -> Result<PackedMatrix, QuantError> {
        format.check(tensor, k)?;
        if values.len() != rows * k {
            return Err(QuantError::Invalid {
                tensor: tensor.into(),
                reason: format!("{} values, expected {rows} x {k}", values.len()),
            });
        }
        if let Some(i) = values.iter().position(|v| !v.is_finite()) {
            return Err(QuantError::Invalid {
                tensor: tensor.into(),
                reason: format!("non-finite value {} at element {i}", values[i]),
            });
        }
        let group = format.group as usize;
        let groups = format.groups(k);
        let sw = format.scale_words(k);
        let pw = format.kind.per_word();
        let mut qs = vec![0u32; rows * format.qs_words(k)];
        let mut scales = vec![0u32; rows * sw];
        let mut codes = vec![0i32; group];
        for r in 0..rows {
            for g in 0..groups {
                let x = &values[r * k + g * group..r * k + (g + 1) * group];
                let (sc, d, m) = group_params(format.kind, x);
                if !(d.is_finite() && m.is_finite()) {
                    return Err(non_finite_scale(tensor, r, g, x, format));
                }
                let inv = if d != 0.0 { 1.0 / d } else { 0.0 };
                for (c, &v) in codes.iter_mut().zip(x) {
                    *c = round_code(format.kind, v, inv, m);
                }
                match format.kind {
                    QuantKind::Q4 => scales[r * sw + g] = sc,
                    _ => scales[r * sw + g / 2] |= sc << (16 * (g & 1)),
                }
                let base = r * format.qs_words(k) + g * group / pw;
                for (i, &c) in codes.iter().enumerate() {
                    let bits = match format.kind {
                        QuantKind::Q8 => (c as i8 as u8 as u32) << (8 * (i % 4)),
                        _ => (c as u32) << (4 * (i % 8)),
                    };
                    qs[base + i / pw] |= bits;
                }
            }
        }
        Ok(PackedMatrix { format, rows, k, qs, scales })
    }

    /// The bytes of `qs` followed by `scales` (how a `HostTensor` of a packed dtype stores it).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(self.bytes());
        v.extend_from_slice(bytemuck::cast_slice(&self.qs));
        v.extend_from_slice(bytemuck::cast_slice(&self.scales));
        v
    }

    /// Inverse of [`to_bytes`](Self::to_bytes).
    pub fn from_bytes(tensor: &str, format: QuantFormat, rows: usize, k: usize, data: &[u8]) -> Result<PackedMatrix, QuantError> {
        format.check(tensor, k)?;
        let nq = rows * format.qs_words(k);
        let ns = rows * format.scale_words(k);
        if data.len() != (nq + ns) * 4 {
            return Err(QuantError::Invalid {
                tensor: tensor.into(),
                reason: format!("{} bytes, expected {} for {rows} x {k} in {format}", data.len(), (nq + ns) * 4),
            });
        }
        let words = |b: &[u8]| -> Vec<u32> { b.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect() };
        Ok(PackedMatrix {
            format,
            rows,
            k,
            qs: words(&data[..nq * 4]),
            scales: words(&data[nq * 4..]),
        })
    }
}

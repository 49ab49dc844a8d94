//! Packed integer weights as the GPU kernels read them, and the CPU reference for them.
//!
//! A quantized matrix (`rows x k`) is two arrays of little-endian `u32` words, each row
//! independent and padded to whole words:
//!
//! - `qs`, row-major, [`QuantFormat::qs_words`] per row: first the **low plane**, then (for
//!   5-, 6- and 3-bit formats) the **high plane**.
//!   - low plane, 4-bit formats: `k / 8` words, nibble `n` of word `i` is the low 4 bits of
//!     element `8 i + n`; 8-bit (`Q8`): `k / 4` words, byte `b` of word `i` is the
//!     two's-complement element `4 i + b`; 2-bit (`Q2K`, `Q3K`, `Q3`): `k / 16` words, bits
//!     `2 n .. 2 n + 2` of word `i` are the low 2 bits of element `16 i + n`.
//!   - high plane, 1 extra bit (`Q5Sym`, `Q5`, `Q5K`: bit 4; `Q3K`, `Q3`: bit 2): `k / 32` words,
//!     bit `n` of word `i` belongs to element `32 i + n`; 2 extra bits (`Q6K`: bits 4-5):
//!     `k / 16` words, bits `2 n .. 2 n + 2` of word `i` belong to element `16 i + n`.
//! - `scales`, row-major, [`QuantFormat::scale_words`] per row, one `(d, m)` per group of
//!   `group` consecutive elements, stored as:
//!   - `Q4`, `Q5`, `Q3`: `(d, m)` as two f16 in one word per group (GGUF Q4_1, Q5_1);
//!   - `Q4Sym`, `Q5Sym`, `Q8`, `Iq4Nl`: one f16 `d` per group, two groups per word (GGUF
//!     Q4_0, Q5_0, Q8_0, IQ4_NL);
//!   - `Mxfp4`: the E8M0 scale byte of each group in the low byte of a 16-bit half, two
//!     groups per word, as the f16 formats (the file's 17-byte blocks are not word-aligned;
//!     this keeps one scale layout for every 32-element format at 2 bytes per group, 4.5
//!     bits per weight against the file's 4.25);
//!   - super-block formats (256 elements per super-block, `group` 32 or 16 per sub-block):
//!     - `Q4K`, `Q5K`: 4 words per super-block: `d | dmin << 16`, then the file's 12 bytes of
//!       6-bit sub-block scales and minimums (ggml's `get_scale_min_k4` packing);
//!     - `Q3K`: 4 words per super-block: the file's 12 bytes of 6-bit scales, then `d` in
//!       the low half of the fourth word;
//!     - `Q6K`: 4 words per super-block of 16 signed 8-bit scales (byte `j` = sub-block `j`),
//!       then after all super-blocks of the row their f16 `d`, two per word;
//!     - `Q2K`: 4 words per super-block of the file's 16 scale bytes (low nibble scale, high
//!       nibble minimum), then after all super-blocks of the row one `d | dmin << 16` word
//!       each;
//!     - `Iq4Xs`: 2 words per super-block: `d | scales_h << 16`, then `scales_l`.
//!
//! With `q` the element's integer code (low bits | high bits shifted above them), every
//! format computes `value = c * d_g + m_g` where `c` is `q + offset` (or the IQ4 table
//! value `IQ4_VALUES[q]` or `MXFP4_VALUES[q]`) and `(d_g, m_g)` are the group's scale and minimum in f32, exactly
//! as ggml's dequantization defines them: `Q5Sym` `(q - 16) d`; `Q5` `q d + m`; `Q4K`/`Q5K`
//! `(d sc) q - dmin m`; `Q6K` `(d sc)(q - 32)`; `Q3K` `(d (sc - 32))(q - 4)`; `Q3` `q d + m`; `Q2K`
//! `(d sc) q - dmin m`; `Iq4Nl` `d IQ4[q]`; `Iq4Xs` `(d (ls - 32)) IQ4[q]`; `Mxfp4`
//! `2^(e - 128) MXFP4[q]`.
//!
//! The same bytes travel from a GGUF file (repacked block by block, bits only, no floats) or a
//! quantized safetensors file (stored as is, `Q8`/`Q4`/`Q4Sym`/`Q3` only) into GPU buffers.
//! Dequantization here is the oracle: the kernels compute `c d + m` in f32 exactly as
//! [`PackedMatrix::dequantize`]; [`ggml`] holds the ggml block definitions, read straight
//! from the file bytes, that the packed layout is checked against.

use half::f16;

pub mod awq;
pub mod ggml;
pub mod gptq;
mod pool;
pub mod quantize;
pub mod safetensors;
pub mod sparse;

pub use quantize::{quantize_model, EmbeddingPolicy, Method, QuantizeOptions, QuantizedModel};

/// Bit layout of a packed weight.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum QuantKind {
    /// 8-bit symmetric: value = q d, q in -127..=127 (GGUF Q8_0).
    Q8,
    /// 4-bit with scale and minimum: value = q d + m, q in 0..=15 (GGUF Q4_1).
    Q4,
    /// 4-bit symmetric: value = (q - 8) d, q in 0..=15 (GGUF Q4_0).
    Q4Sym,
    /// 5-bit symmetric: value = (q - 16) d (GGUF Q5_0).
    Q5Sym,
    /// 5-bit with scale and minimum: value = q d + m (GGUF Q5_1).
    Q5,
    /// 4-bit codes into the non-linear IQ4 table: value = d IQ4[q] (GGUF IQ4_NL).
    Iq4Nl,
    /// 2-bit K-quant, 16 sub-blocks of 16 (GGUF Q2_K).
    Q2K,
    /// 3-bit K-quant, 16 sub-blocks of 16 (GGUF Q3_K).
    Q3K,
    /// 4-bit K-quant, 8 sub-blocks of 32 (GGUF Q4_K).
    Q4K,
    /// 5-bit K-quant, 8 sub-blocks of 32 (GGUF Q5_K).
    Q5K,
    /// 6-bit K-quant, 16 sub-blocks of 16 (GGUF Q6_K).
    Q6K,
    /// IQ4 table codes with 6-bit sub-block scales, 8 sub-blocks of 32 (GGUF IQ4_XS).
    Iq4Xs,
    /// OCP microscaling FP4 (GGUF MXFP4, gpt-oss's experts): 4-bit E2M1 codes with a
    /// power-of-two E8M0 scale per 32: value = 2^(e - 128) MXFP4[q] (the table doubled, as
    /// ggml's `kvalues_mxfp4`, so the scale is halved).
    Mxfp4,
    /// FP8 E4M3 (the `float8_e4m3fn` of Hugging Face FP8 checkpoints) with a scale per 32:
    /// value = E4M3(q) / 256 * d. The bytes sit as Q8's do; `d` is the checkpoint's
    /// per-tensor, per-channel or block scale times 256, as an f16 (so scales down to 2.4e-7
    /// stay normal halves). See [`e4m3`].
    Fp8,
    /// 3-bit with scale and minimum: value = q d + m, q in 0..=7, any group of 32 or more
    /// (GPTQ's and RTN's 3-bit: GGUF's only 3-bit type, Q3_K, needs rows of 256). The two low
    /// bits of each code sit in the low plane as Q3_K's do, the third in the high plane.
    Q3,
    /// 2:4 sparse with 4-bit symmetric values: of every four consecutive elements of a row two
    /// are zero; the kept ones are `(q - 8) d`, q in 0..=15, one f16 `d` per group of 32 or
    /// more (as `Q4Sym`). The planes have Q3's geometry: the low plane holds the kept codes
    /// (8 per word: 16 elements), the high plane each kept value's 2-bit position in its four
    /// (16 per word: 32 elements). See [`sparse`].
    S24Q4,
    /// 2:4 sparse with 8-bit symmetric values `q d` (as `Q8`): the low plane holds the kept
    /// bytes (4 per word: 8 elements), the high plane their positions as `S24Q4`'s.
    S24Q8,
}

/// The value of an FP8 E4M3 byte (sign, 4 exponent bits with bias 7, 3 mantissa bits; no
/// infinities). `0x7f` / `0xff` are NaN in `float8_e4m3fn`; here they follow the formula to
/// +-480, as the kernels' decode does (loading refuses them, see `model::fp8`).
pub fn e4m3(b: u8) -> f32 {
    fp8_code(b) * 256.0
}

/// An FP8 byte's code as [`QuantKind::Fp8`] multiplies it by its scale: E4M3(b) / 256, i.e.
/// `(m | 8 if e > 0) * 2^(max(e, 1) - 18)`, exactly as the shaders compute it.
pub fn fp8_code(b: u8) -> f32 {
    let (e, m) = ((b >> 3) & 15, b & 7);
    let v = (m | if e > 0 { 8 } else { 0 }) as f32 * f32::from_bits((e.max(1) as u32 + 127 - 18) << 23);
    if b & 0x80 != 0 {
        -v
    } else {
        v
    }
}

/// The non-linear code book of IQ4_NL and IQ4_XS (ggml's `kvalues_iq4nl`).
pub const IQ4_VALUES: [i8; 16] = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113];

/// The E2M1 values of MXFP4, doubled so they are integers (ggml's `kvalues_mxfp4`): codes
/// 0-7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6 times two, codes 8-15 their negatives.
pub const MXFP4_VALUES: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// Half the value of an E8M0 scale byte, `2^(e - 128)`, as ggml's `ggml_e8m0_to_fp32_half`
/// computes it (the bits of the f32; `e` 0 and 1 give the subnormals 2^-128 and 2^-127).
pub fn e8m0_half(e: u8) -> f32 {
    let bits = if e < 2 { 0x0020_0000u32 << e } else { (e as u32 - 1) << 23 };
    f32::from_bits(bits)
}

impl QuantKind {
    /// Every kind, in the order above.
    pub const ALL: [QuantKind; 17] = [
        QuantKind::Q8,
        QuantKind::Q4,
        QuantKind::Q4Sym,
        QuantKind::Q5Sym,
        QuantKind::Q5,
        QuantKind::Iq4Nl,
        QuantKind::Q2K,
        QuantKind::Q3K,
        QuantKind::Q4K,
        QuantKind::Q5K,
        QuantKind::Q6K,
        QuantKind::Iq4Xs,
        QuantKind::Mxfp4,
        QuantKind::Fp8,
        QuantKind::Q3,
        QuantKind::S24Q4,
        QuantKind::S24Q8,
    ];

    /// Elements per `u32` of the low plane of `qs`.
    pub fn per_word(&self) -> usize {
        32 / self.lo_bits()
    }

    /// Bits per element in the low plane of `qs`.
    pub fn lo_bits(&self) -> usize {
        match self {
            QuantKind::Q8 | QuantKind::Fp8 => 8,
            QuantKind::Q2K | QuantKind::Q3K | QuantKind::Q3 | QuantKind::S24Q4 => 2,
            _ => 4,
        }
    }

    /// Bits per element in the high plane of `qs` (0: no high plane).
    pub fn hi_bits(&self) -> usize {
        match self {
            QuantKind::Q5Sym | QuantKind::Q5 | QuantKind::Q5K | QuantKind::Q3K | QuantKind::Q3 | QuantKind::S24Q4 | QuantKind::S24Q8 => 1,
            QuantKind::Q6K => 2,
            _ => 0,
        }
    }

    /// Elements per super-block (the row length must be a multiple of it): 256 for the
    /// K-quants and IQ4_XS, else the group.
    pub fn super_block(&self) -> usize {
        if self.is_super() {
            256
        } else {
            32
        }
    }

    /// Whether this kind has 256-element super-blocks holding sub-block scales.
    pub fn is_super(&self) -> bool {
        matches!(self, QuantKind::Q2K | QuantKind::Q3K | QuantKind::Q4K | QuantKind::Q5K | QuantKind::Q6K | QuantKind::Iq4Xs)
    }

    /// The group (elements per scale) that GGUF files of this kind have; the only group
    /// possible for every kind but the round-to-nearest ones ([`is_rtn`](Self::is_rtn)).
    pub fn ggml_group(&self) -> u32 {
        match self {
            QuantKind::Q2K | QuantKind::Q3K | QuantKind::Q6K => 16,
            _ => 32,
        }
    }

    /// Whether `lantern quantize` can produce this kind and quantized safetensors store it
    /// (the others come only from GGUF files, repacked at load).
    pub fn is_rtn(&self) -> bool {
        matches!(self, QuantKind::Q8 | QuantKind::Q4 | QuantKind::Q4Sym | QuantKind::Q3 | QuantKind::S24Q4 | QuantKind::S24Q8)
    }

    /// The names of the kinds `lantern quantize` writes, for messages ("q8, q4, ...").
    pub fn rtn_names() -> String {
        QuantKind::ALL.iter().filter(|k| k.is_rtn()).map(|k| k.name()).collect::<Vec<_>>().join(", ")
    }

    /// Whether this kind is 2:4 sparse ([`sparse`]): `lantern quantize` prunes to it (by
    /// magnitude, or with `--method wanda-2:4` by Wanda's score); AWQ and GPTQ do not.
    pub fn is_sparse(&self) -> bool {
        matches!(self, QuantKind::S24Q4 | QuantKind::S24Q8)
    }

    /// The smallest group (and its multiples) a round-to-nearest kind takes: 32 for the kinds
    /// with a 1-bit-geometry high plane (32 elements per word: `Q3`, the 2:4 kinds), else 8.
    pub fn min_group(&self) -> u32 {
        if matches!(self, QuantKind::Q3 | QuantKind::S24Q4 | QuantKind::S24Q8) {
            32
        } else {
            8
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            QuantKind::Q8 => "q8",
            QuantKind::Q4 => "q4",
            QuantKind::Q4Sym => "q4sym",
            QuantKind::Q5Sym => "q5sym",
            QuantKind::Q5 => "q5",
            QuantKind::Iq4Nl => "iq4nl",
            QuantKind::Q2K => "q2k",
            QuantKind::Q3K => "q3k",
            QuantKind::Q4K => "q4k",
            QuantKind::Q5K => "q5k",
            QuantKind::Q6K => "q6k",
            QuantKind::Iq4Xs => "iq4xs",
            QuantKind::Mxfp4 => "mxfp4",
            QuantKind::Fp8 => "fp8",
            QuantKind::Q3 => "q3",
            QuantKind::S24Q4 => "s24q4",
            QuantKind::S24Q8 => "s24q8",
        }
    }

    pub fn parse(s: &str) -> Option<QuantKind> {
        match s {
            "q4sym" | "q4s" => Some(QuantKind::Q4Sym),
            _ => QuantKind::ALL.iter().copied().find(|k| k.name() == s),
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
    #[error("tensor `{tensor}`: group size {group} must be a positive multiple of 8 (of 32 for q3, s24q4 and s24q8; the format's own group for GGUF-only formats)")]
    BadGroup { tensor: String, group: u32 },
    #[error("tensor `{tensor}`: row length {k} is not a multiple of the {block}-element super-block of {format}")]
    SuperBlockMismatch { tensor: String, k: usize, block: usize, format: String },
    #[error("tensor `{tensor}`: {reason}")]
    Invalid { tensor: String, reason: String },
}

impl QuantFormat {
    pub fn new(kind: QuantKind, group: u32) -> Self {
        QuantFormat { kind, group }
    }

    /// Check that rows of `k` elements can be stored in this format.
    pub fn check(&self, tensor: &str, k: usize) -> Result<(), QuantError> {
        if self.group == 0
            || !self.group.is_multiple_of(self.kind.min_group())
            || (!self.kind.is_rtn() && self.group != self.kind.ggml_group())
        {
            return Err(QuantError::BadGroup { tensor: tensor.into(), group: self.group });
        }
        if !self.kind.is_rtn() && !k.is_multiple_of(self.kind.super_block()) {
            return Err(QuantError::SuperBlockMismatch {
                tensor: tensor.into(),
                k,
                block: self.kind.super_block(),
                format: self.to_string(),
            });
        }
        if k == 0 || !k.is_multiple_of(self.group as usize) {
            return Err(QuantError::GroupMismatch { tensor: tensor.into(), k, group: self.group, format: self.to_string() });
        }
        Ok(())
    }

    /// Groups per row.
    pub fn groups(&self, k: usize) -> usize {
        k / self.group as usize
    }

    /// `qs` words per row (low plane, then high plane).
    pub fn qs_words(&self, k: usize) -> usize {
        self.lo_words(k) + k * self.kind.hi_bits() / 32
    }

    /// Words of the low plane of `qs` per row (where the high plane starts).
    pub fn lo_words(&self, k: usize) -> usize {
        k * self.kind.lo_bits() / 32
    }

    /// `scales` words per row.
    pub fn scale_words(&self, k: usize) -> usize {
        let sb = k / 256;
        match self.kind {
            QuantKind::Q4 | QuantKind::Q5 | QuantKind::Q3 => self.groups(k),
            QuantKind::Q8
            | QuantKind::Q4Sym
            | QuantKind::Q5Sym
            | QuantKind::Iq4Nl
            | QuantKind::Mxfp4
            | QuantKind::Fp8
            | QuantKind::S24Q4
            | QuantKind::S24Q8 => self.groups(k).div_ceil(2),
            QuantKind::Q4K | QuantKind::Q5K | QuantKind::Q3K => 4 * sb,
            QuantKind::Q6K => 4 * sb + sb.div_ceil(2),
            QuantKind::Q2K => 5 * sb,
            QuantKind::Iq4Xs => 2 * sb,
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

/// Scale and minimum of sub-block `j` (0..8) from the 12 bytes of a Q4_K/Q5_K super-block's
/// 6-bit scales (three words, little-endian): ggml's `get_scale_min_k4`.
pub fn scale_min_k4(j: usize, w: &[u32]) -> (u8, u8) {
    let q = |i: usize| (w[i / 4] >> (8 * (i % 4))) as u8;
    if j < 4 {
        (q(j) & 63, q(j + 4) & 63)
    } else {
        ((q(j + 4) & 15) | ((q(j - 4) >> 6) << 4), (q(j + 4) >> 4) | ((q(j) >> 6) << 4))
    }
}

/// The 6-bit scale (0..63, before the -32 offset) of sub-block `j` (0..16) from the 12
/// bytes of a Q3_K super-block's scales (three words, little-endian).
pub fn scale_k3(j: usize, w: &[u32]) -> i32 {
    let q = |i: usize| (w[i / 4] >> (8 * (i % 4))) as u8;
    let lo = (q(j % 8) >> (4 * (j / 8))) & 15;
    let hi = (q(8 + j % 4) >> (2 * (j / 4))) & 3;
    (lo | hi << 4) as i32
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
        QuantKind::Q4 | QuantKind::Q3 => {
            let top = if kind == QuantKind::Q3 { 7.0 } else { 15.0 };
            let (lo, hi) = x.iter().map(|v| order_key(v.to_bits() as i32)).fold((i32::MAX, i32::MIN), |(lo, hi), k| (lo.min(k), hi.max(k)));
            let (lo, hi) = (f32::from_bits(order_key(lo) as u32), f32::from_bits(order_key(hi) as u32));
            let m = f16::from_f32(lo);
            // Scale from the stored minimum so the top of the range is reachable.
            let d = f16::from_f32((hi - m.to_f32()).max(0.0) / top);
            (d.to_bits() as u32 | (m.to_bits() as u32) << 16, d.to_f32(), m.to_f32())
        }
        // Only the RTN kinds get here (`check_rtn`); the others share Q8's rule harmlessly.
        _ => group_params(QuantKind::Q8, x),
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
        QuantKind::Q3 => round_clamped((v - m) * inv, 0.0, 7.0),
        _ => round_clamped(v * inv, -127.0, 127.0),
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

/// Store group `g` of one row of an RTN format: its scale word `sc` into the row's `scales`
/// and its integer codes into the row's `qs` (the layout of the module docs).
fn pack_group(format: QuantFormat, g: usize, sc: u32, codes: &[i32], qs: &mut [u32], scales: &mut [u32]) {
    match format.kind {
        QuantKind::Q4 | QuantKind::Q3 => scales[g] = sc,
        _ => scales[g / 2] |= sc << (16 * (g & 1)),
    }
    // Each code's low bits into the low plane, the rest above them into the high plane
    // (after the row's low words), as `PackedMatrix::raw_code` reads them.
    let (lb, hb) = (format.kind.lo_bits(), format.kind.hi_bits());
    let lo_words = qs.len() * 32 / (lb + hb) * lb / 32;
    for (i, &c) in codes.iter().enumerate() {
        let (e, v) = (g * format.group as usize + i, c as u32);
        qs[e * lb / 32] |= (v & ((1 << lb) - 1)) << (e * lb % 32);
        if hb > 0 {
            qs[lo_words + e * hb / 32] |= (v >> lb) << (e * hb % 32);
        }
    }
}

/// Round-to-nearest needs one of the kinds it can produce.
fn check_rtn(tensor: &str, format: QuantFormat) -> Result<(), QuantError> {
    if format.kind.is_rtn() {
        return Ok(());
    }
    Err(QuantError::Invalid {
        tensor: tensor.into(),
        reason: format!("{} comes only from GGUF files; lantern quantize writes {}", format.kind.name(), QuantKind::rtn_names()),
    })
}

/// The methods that round a dense matrix (AWQ's search, GPTQ) refuse the 2:4 kinds: those
/// are pruned by `lantern quantize --method rtn` (magnitude) or `--method wanda-2:4`.
pub fn check_dense(tensor: &str, format: QuantFormat, what: &str) -> Result<(), QuantError> {
    if !format.kind.is_sparse() {
        return Ok(());
    }
    Err(QuantError::Invalid {
        tensor: tensor.into(),
        reason: format!("{what} does not prune: {} is 2:4 sparse, made by --method wanda-2:4 or rtn (magnitude)", format.kind.name()),
    })
}

/// Arms that `check_rtn` (or the caller's match) rules out.
#[cold]
fn unreachable_rtn() {}

/// Round-to-nearest then dequantize, in place, without packing: every element of `values`
/// (`rows x k`, row-major) becomes exactly what
/// `PackedMatrix::quantize(..).dequantize()` gives for it (same codes, same f32 `q d + m`).
/// For searches that score many candidate quantizations (AWQ).
pub fn fake_quantize(tensor: &str, values: &mut [f32], k: usize, format: QuantFormat) -> Result<(), QuantError> {
    check_rtn(tensor, format)?;
    check_dense(tensor, format, "AWQ's scale search")?;
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
                QuantKind::Q3 => x.iter_mut().for_each(|v| *v = round_code_f(QuantKind::Q3, *v, inv, m) * d + m),
                // (q - 8) d, as `dequantize` and ggml compute it (the same value as q d + m,
                // m = -8 d, but for the sign of a zero).
                QuantKind::Q4Sym => x.iter_mut().for_each(|v| *v = (round_code_f(QuantKind::Q4Sym, *v, inv, m) - 8.0) * d),
                _ => unreachable_rtn(),
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

    /// `(d, m)` of a group: the values are `c d + m` with [`code`](Self::code)'s `c`.
    pub fn group_scale(&self, row: usize, g: usize) -> (f32, f32) {
        let sw = self.format.scale_words(self.k);
        let s = &self.scales[row * sw..(row + 1) * sw];
        let half = |w: u32, hi: bool| f16::from_bits((if hi { w >> 16 } else { w }) as u16).to_f32();
        // Sub-block j of super-block sb (the super-block formats).
        let per_sb = 256 / self.format.group as usize;
        let (sb, j) = (g / per_sb, g % per_sb);
        let byte = |words: &[u32], i: usize| (words[i / 4] >> (8 * (i % 4))) as u8;
        match self.format.kind {
            QuantKind::Q4 | QuantKind::Q5 | QuantKind::Q3 => (half(s[g], false), half(s[g], true)),
            QuantKind::Q8
            | QuantKind::Q4Sym
            | QuantKind::Q5Sym
            | QuantKind::Iq4Nl
            | QuantKind::Fp8
            | QuantKind::S24Q4
            | QuantKind::S24Q8 => {
                let d = half(s[g / 2], g % 2 == 1);
                // -0.0 adds nothing and keeps the sign of a zero product, as ggml's `d * q`
                // has it (Q4Sym's offset is in its code, see `code`).
                (d, -0.0)
            }
            QuantKind::Q4K | QuantKind::Q5K => {
                let h = &s[4 * sb..4 * sb + 4];
                let (sc, m) = scale_min_k4(j, &h[1..4]);
                (half(h[0], false) * sc as f32, -(half(h[0], true) * m as f32))
            }
            QuantKind::Q3K => {
                let h = &s[4 * sb..4 * sb + 4];
                (half(h[3], false) * (scale_k3(j, &h[0..3]) - 32) as f32, -0.0)
            }
            QuantKind::Q6K => {
                let d = half(s[4 * (self.k / 256) + sb / 2], sb % 2 == 1);
                (d * byte(&s[4 * sb..4 * sb + 4], j) as i8 as f32, -0.0)
            }
            QuantKind::Q2K => {
                let dm = s[4 * (self.k / 256) + sb];
                let b = byte(&s[4 * sb..4 * sb + 4], j);
                (half(dm, false) * (b & 15) as f32, -(half(dm, true) * (b >> 4) as f32))
            }
            QuantKind::Iq4Xs => {
                let (w0, w1) = (s[2 * sb], s[2 * sb + 1]);
                let lo = (w1 >> (4 * j)) & 15;
                let hi = (w0 >> (16 + 2 * j)) & 3;
                (half(w0, false) * ((lo | hi << 4) as i32 - 32) as f32, -0.0)
            }
            QuantKind::Mxfp4 => {
                let w = s[g / 2] >> (16 * (g % 2));
                (e8m0_half(w as u8), -0.0)
            }
        }
    }

    /// The integer code `q` of element `(row, c)`: low bits | high bits above them (0..15 for
    /// 4-bit, -127..127 for Q8, 0..31 for 5-bit, 0..63 for Q6K, 0..7 for Q3K, 0..3 for Q2K,
    /// the E4M3 byte 0..255 for Fp8).
    /// For the 2:4 kinds, the dense element's code: the kept value's, or the code of zero (8
    /// for `S24Q4`, 0 for `S24Q8`) where it was pruned.
    pub fn raw_code(&self, row: usize, c: usize) -> i32 {
        let kind = self.format.kind;
        let q = &self.qs[row * self.format.qs_words(self.k)..(row + 1) * self.format.qs_words(self.k)];
        if kind.is_sparse() {
            return sparse::dense_code(kind, q, self.format.lo_words(self.k), c);
        }
        let (lb, hb) = (kind.lo_bits(), kind.hi_bits());
        let lo_bit = c * lb;
        let lo = (q[lo_bit / 32] >> (lo_bit % 32)) & ((1u32 << lb) - 1);
        if kind == QuantKind::Q8 {
            return lo as u8 as i8 as i32;
        }
        if hb == 0 {
            return lo as i32;
        }
        let hi_bit = c * hb;
        let hi = (q[self.format.lo_words(self.k) + hi_bit / 32] >> (hi_bit % 32)) & ((1u32 << hb) - 1);
        (lo | hi << lb) as i32
    }

    /// The code of element `(row, c)` that multiplies the group scale, as the kernels decode
    /// it: [`code`](Self::code) as f32, or [`fp8_code`] of the byte for Fp8.
    pub fn code_value(&self, row: usize, c: usize) -> f32 {
        match self.format.kind {
            QuantKind::Fp8 => fp8_code(self.raw_code(row, c) as u8),
            _ => self.code(row, c) as f32,
        }
    }

    /// The integer code `c` of element `(row, c)` that multiplies the group scale: the raw
    /// code plus the format's offset, or its IQ4 table value (Fp8: the raw byte; its value is
    /// [`code_value`](Self::code_value)'s).
    pub fn code(&self, row: usize, c: usize) -> i32 {
        let q = self.raw_code(row, c);
        match self.format.kind {
            QuantKind::Q4Sym | QuantKind::S24Q4 => q - 8,
            QuantKind::Q5Sym => q - 16,
            QuantKind::Q6K => q - 32,
            QuantKind::Q3K => q - 4,
            QuantKind::Iq4Nl | QuantKind::Iq4Xs => IQ4_VALUES[q as usize] as i32,
            QuantKind::Mxfp4 => MXFP4_VALUES[q as usize] as i32,
            _ => q,
        }
    }

    /// The CPU reference: every element as `c d + m` in f32 (what the kernels compute).
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.rows * self.k);
        let group = self.format.group as usize;
        for r in 0..self.rows {
            for g in 0..self.format.groups(self.k) {
                let (d, m) = self.group_scale(r, g);
                for c in g * group..(g + 1) * group {
                    out.push(self.code_value(r, c) * d + m);
                }
            }
        }
        out
    }

    /// Stack matrices with the same format and row length (q|k|v into one projection).
    pub fn concat_rows(parts: &[PackedMatrix]) -> Result<PackedMatrix, QuantError> {
        let first = parts.first().ok_or_else(|| QuantError::Invalid { tensor: "<concat>".into(), reason: "no parts".into() })?;
        let mut out = PackedMatrix { format: first.format, rows: 0, k: first.k, qs: Vec::new(), scales: Vec::new() };
        for p in parts {
            if p.format != first.format || p.k != first.k {
                return Err(QuantError::Invalid {
                    tensor: "<concat>".into(),
                    reason: format!(
                        "cannot stack {} x {} ({}) under {} x {} ({})",
                        p.rows, p.k, p.format, first.rows, first.k, first.format
                    ),
                });
            }
            out.rows += p.rows;
            out.qs.extend_from_slice(&p.qs);
            out.scales.extend_from_slice(&p.scales);
        }
        Ok(out)
    }

    /// Repack GGUF blocks (Q8_0, Q4_0, Q4_1, and Lantern's Q8_0-shaped FP8 block and Q3
    /// block of [`ggml::block_size`]; 32 elements per block) of a `rows x k` matrix.
    /// Only bits move: the f16 scales and integer codes are copied, never converted.
    /// The other GGUF block formats (Q5_0, Q5_1, IQ4_NL and the 256-element K-quants and
    /// IQ4_XS) are repacked by [`ggml::repack`].
    pub fn from_gguf_blocks(tensor: &str, kind: QuantKind, data: &[u8], rows: usize, k: usize) -> Result<PackedMatrix, QuantError> {
        let block_bytes = match kind {
            QuantKind::Q8 | QuantKind::Fp8 => 34,
            QuantKind::Q4Sym => 18,
            QuantKind::Q4 => 20,
            QuantKind::Q3 => 16,
            _ => return ggml::repack(tensor, kind, data, rows, k),
        };
        let format = QuantFormat::new(kind, 32);
        format.check(tensor, k)?;
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
        if kind == QuantKind::Q3 {
            // The block's two low-plane words and its high word go to the row's two planes.
            qs.resize(rows * format.qs_words(k), 0);
            let (qw, lw) = (format.qs_words(k), format.lo_words(k));
            let word = |b: &[u8], i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
            for (bi, b) in data.chunks_exact(block_bytes).enumerate() {
                let (row, gi) = (bi / g, bi % g);
                scales[row * sw + gi] = word(b, 0);
                qs[row * qw + 2 * gi] = word(b, 4);
                qs[row * qw + 2 * gi + 1] = word(b, 8);
                qs[row * qw + lw + gi] = word(b, 12);
            }
            return Ok(PackedMatrix { format, rows, k, qs, scales });
        }
        for (bi, b) in data.chunks_exact(block_bytes).enumerate() {
            let (row, gi) = (bi / g, bi % g);
            match kind {
                QuantKind::Q8 | QuantKind::Fp8 => {
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
                _ => unreachable_rtn(),
            }
        }
        Ok(PackedMatrix { format, rows, k, qs, scales })
    }

    /// Round-to-nearest quantization of a `rows x k` f32 matrix, group by group. Codes are
    /// computed against the f16-rounded scale that is stored, so the only error is rounding:
    /// `|w - deq(w)| <= d / 2` per element (Q8, Q4Sym inside the clamp) and `<= d / 2 + ulp`
    /// for Q4 (see `tests/quant.rs` for the measured bounds).
    pub fn quantize(tensor: &str, values: &[f32], rows: usize, k: usize, format: QuantFormat) -> Result<PackedMatrix, QuantError> {
        check_rtn(tensor, format)?;
        format.check(tensor, k)?;
        if values.len() != rows * k {
            return Err(QuantError::Invalid { tensor: tensor.into(), reason: format!("{} values, expected {rows} x {k}", values.len()) });
        }
        if let Some(i) = values.iter().position(|v| !v.is_finite()) {
            return Err(QuantError::Invalid { tensor: tensor.into(), reason: format!("non-finite value {} at element {i}", values[i]) });
        }
        if format.kind.is_sparse() {
            // Round to nearest of a 2:4 kind: pruned by magnitude.
            return sparse::quantize(tensor, values, rows, k, format, None);
        }
        let group = format.group as usize;
        let groups = format.groups(k);
        let sw = format.scale_words(k);
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
                let row_qs = &mut qs[r * format.qs_words(k)..(r + 1) * format.qs_words(k)];
                pack_group(format, g, sc, &codes, row_qs, &mut scales[r * sw..(r + 1) * sw]);
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
        Ok(PackedMatrix { format, rows, k, qs: words(&data[..nq * 4]), scales: words(&data[nq * 4..]) })
    }
}

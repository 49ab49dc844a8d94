//! ggml's block formats as GGUF files store them: the CPU dequantization oracle written from
//! each format's definition, and the bit-for-bit repack into Lantern's packed layout.
//!
//! Block layouts (bytes, in file order; `d`, `m`, `dmin` are little-endian f16):
//!
//! | kind | ggml | elems | bytes | layout |
//! |---|---|---|---|---|
//! | `Q8` | Q8_0 | 32 | 34 | `d`, 32 × i8 |
//! | `Q4Sym` | Q4_0 | 32 | 18 | `d`, 16 B nibbles |
//! | `Q4` | Q4_1 | 32 | 20 | `d`, `m`, 16 B nibbles |
//! | `Q5Sym` | Q5_0 | 32 | 22 | `d`, `qh` (u32), 16 B nibbles |
//! | `Q5` | Q5_1 | 32 | 24 | `d`, `m`, `qh` (u32), 16 B nibbles |
//! | `Iq4Nl` | IQ4_NL | 32 | 18 | `d`, 16 B nibbles |
//! | `Q2K` | Q2_K | 256 | 84 | 16 B scales, 64 B 2-bit codes, `d`, `dmin` |
//! | `Q3K` | Q3_K | 256 | 110 | 32 B `hmask`, 64 B 2-bit codes, 12 B scales, `d` |
//! | `Q4K` | Q4_K | 256 | 144 | `d`, `dmin`, 12 B scales, 128 B nibbles |
//! | `Q5K` | Q5_K | 256 | 176 | `d`, `dmin`, 12 B scales, 32 B `qh`, 128 B nibbles |
//! | `Q6K` | Q6_K | 256 | 210 | 128 B `ql` nibbles, 64 B `qh` 2-bit, 16 × i8 scales, `d` |
//! | `Iq4Xs` | IQ4_XS | 256 | 136 | `d`, `scales_h` (u16), 4 B `scales_l`, 128 B nibbles |
//! | `Mxfp4` | MXFP4 | 32 | 17 | `e` (E8M0 byte), 16 B nibbles |
//! | `Fp8` | (none) | 32 | 34 | `d` (the scale x 256), 32 x E4M3 byte |
//!
//! `Fp8`'s block is not ggml's (no GGUF type holds FP8): it is Q8_0's with E4M3 bytes, the
//! shape `model::fp8` gives the FP8 tensors of safetensors checkpoints, so that they share
//! the repack and the oracle.
//!
//! Element orders inside a block (`e` the element index in the block):
//!
//! - 32-element nibble blocks (Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, MXFP4, and each 32-element
//!   sub-block of IQ4_XS): byte `j` holds element `j` (low nibble) and `j + 16` (high);
//!   Q5_0/Q5_1 bit 4 of element `e` is bit `e` of `qh`.
//! - Q4_K, Q5_K: 4 chunks of 64 elements, chunk `c` reads bytes `32 c .. 32 c + 32`: low
//!   nibbles are elements `64 c + l`, high nibbles `64 c + 32 + l`; Q5_K's bit 4 of element
//!   `e` is bit `e / 32` of `qh[e % 32]`.
//! - Q2_K, Q3_K: 2 halves of 128 elements, half `h` reads bytes `32 h .. 32 h + 32`: bits
//!   `2 s .. 2 s + 2` of byte `32 h + l` are element `128 h + 32 s + l`; Q3_K's bit 2 of
//!   element `e` is bit `e / 32` of `hmask[e % 32]`, and a **set** bit means no offset: the
//!   code is `low | hbit << 2` minus 4.
//! - Q6_K: 2 halves of 128 elements: the low nibble of `ql[64 h + l]` is element
//!   `128 h + l`, its high nibble `128 h + 64 + l` (`l` in 0..64); bits `2 t .. 2 t + 2` of
//!   `qh[32 h + l]` are bits 4-5 of element `128 h + 32 t + l` (`l` in 0..32).
//!
//! Sub-block scales: Q2_K byte `j` (low nibble scale, high nibble minimum) for the 16
//! elements `16 j ..`; Q3_K 6-bit scales ([`scale_k3`]) minus 32 per 16; Q4_K/Q5_K 6-bit
//! scale and minimum per 32 ([`scale_min_k4`]); Q6_K i8 per 16; IQ4_XS
//! `(scales_l nibble j | (scales_h >> 2 j & 3) << 4) - 32` per 32.

use half::f16;

use super::{e8m0_half, fp8_code, scale_k3, scale_min_k4, PackedMatrix, QuantError, QuantFormat, QuantKind, IQ4_VALUES, MXFP4_VALUES};

/// `(elements, bytes)` of one ggml block of `kind` as GGUF files store it.
pub fn block_size(kind: QuantKind) -> (usize, usize) {
    match kind {
        QuantKind::Q8 => (32, 34),
        QuantKind::Q4Sym => (32, 18),
        QuantKind::Q4 => (32, 20),
        QuantKind::Q5Sym => (32, 22),
        QuantKind::Q5 => (32, 24),
        QuantKind::Iq4Nl => (32, 18),
        QuantKind::Q2K => (256, 84),
        QuantKind::Q3K => (256, 110),
        QuantKind::Q4K => (256, 144),
        QuantKind::Q5K => (256, 176),
        QuantKind::Q6K => (256, 210),
        QuantKind::Iq4Xs => (256, 136),
        QuantKind::Mxfp4 => (32, 17),
        QuantKind::Fp8 => (32, 34),
        // Lantern's own (no GGUF type): d, m, 8 bytes of 2-bit codes, 4 of third bits.
        QuantKind::Q3 => (32, 16),
        // Lantern's 2:4 kinds have no block form (they come only from `lantern quantize`):
        // their bytes per 32 elements as packed (d, kept codes, positions).
        QuantKind::S24Q4 => (32, 14),
        QuantKind::S24Q8 => (32, 22),
    }
}

/// Byte offsets of the f16 fields (super-block scales and minimums) in one ggml block of
/// `kind`.
pub fn f16_fields(kind: QuantKind) -> &'static [usize] {
    match kind {
        QuantKind::Q8 | QuantKind::Q4Sym | QuantKind::Q5Sym | QuantKind::Iq4Nl | QuantKind::Iq4Xs | QuantKind::Fp8 => &[0],
        QuantKind::Q4 | QuantKind::Q5 | QuantKind::Q4K | QuantKind::Q5K | QuantKind::Q3 => &[0, 2],
        QuantKind::S24Q4 | QuantKind::S24Q8 => &[0],
        QuantKind::Q2K => &[80, 82],
        QuantKind::Q3K => &[108],
        QuantKind::Q6K => &[208],
        // The E8M0 scale byte is any byte.
        QuantKind::Mxfp4 => &[],
    }
}

/// The ggml type name of `kind` (`Q5_0`, `Q4_K`, ...), for messages.
pub fn ggml_name(kind: QuantKind) -> &'static str {
    match kind {
        QuantKind::Q8 => "Q8_0",
        QuantKind::Q4Sym => "Q4_0",
        QuantKind::Q4 => "Q4_1",
        QuantKind::Q5Sym => "Q5_0",
        QuantKind::Q5 => "Q5_1",
        QuantKind::Iq4Nl => "IQ4_NL",
        QuantKind::Q2K => "Q2_K",
        QuantKind::Q3K => "Q3_K",
        QuantKind::Q4K => "Q4_K",
        QuantKind::Q5K => "Q5_K",
        QuantKind::Q6K => "Q6_K",
        QuantKind::Iq4Xs => "IQ4_XS",
        QuantKind::Mxfp4 => "MXFP4",
        QuantKind::Fp8 => "FP8",
        QuantKind::Q3 => "Q3 (Lantern's)",
        QuantKind::S24Q4 => "S24Q4 (Lantern's 2:4)",
        QuantKind::S24Q8 => "S24Q8 (Lantern's 2:4)",
    }
}

fn u16_at(b: &[u8], i: usize) -> u32 {
    u16::from_le_bytes([b[i], b[i + 1]]) as u32
}

fn u32_at(b: &[u8], i: usize) -> u32 {
    u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]])
}

/// `dst[w]` = the 4-bit fields at `shift` of bytes `8 w .. 8 w + 8` of `src`, byte `n` in
/// nibble `n`.
fn nibble_words(src: &[u8], shift: u32, dst: &mut [u32]) {
    for (w, b) in dst.iter_mut().zip(src.chunks_exact(8)) {
        *w = b.iter().enumerate().fold(0, |a, (n, &x)| a | (((x >> shift) & 15) as u32) << (4 * n));
    }
}

/// `dst[w]` = the 2-bit fields at `shift` of bytes `16 w .. 16 w + 16` of `src`, byte `n` in
/// bits `2 n .. 2 n + 2`.
fn crumb_words(src: &[u8], shift: u32, dst: &mut [u32]) {
    for (w, b) in dst.iter_mut().zip(src.chunks_exact(16)) {
        *w = b.iter().enumerate().fold(0, |a, (n, &x)| a | (((x >> shift) & 3) as u32) << (2 * n));
    }
}

/// Bit `bit` of each of the 32 bytes of `src`, byte `n` in bit `n`.
fn bit_word(src: &[u8], bit: u32) -> u32 {
    src.iter().take(32).enumerate().fold(0, |a, (n, &x)| a | (((x >> bit) & 1) as u32) << n)
}

fn invalid(tensor: &str, reason: String) -> QuantError {
    QuantError::Invalid { tensor: tensor.into(), reason }
}

/// Bytes that `rows x k` elements of `kind` take as ggml blocks, `None` on overflow.
fn expected_bytes(kind: QuantKind, rows: usize, k: usize) -> Option<usize> {
    let (be, bb) = block_size(kind);
    rows.checked_mul(k / be)?.checked_mul(bb)
}

/// Repack the GGUF blocks of a `rows x k` matrix of `kind` into the packed layout (see the
/// module docs of [`crate::quant`]): for Q5_0 (`Q5Sym`), Q5_1 (`Q5`), IQ4_NL (`Iq4Nl`),
/// MXFP4, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and IQ4_XS. Only bits move: code bits go to the low and high
/// planes of `qs` in element order, scale bytes and f16 bits to `scales`; nothing is
/// converted. Q8_0, Q4_0 and Q4_1 are repacked by [`PackedMatrix::from_gguf_blocks`].
pub fn repack(tensor: &str, kind: QuantKind, data: &[u8], rows: usize, k: usize) -> Result<PackedMatrix, QuantError> {
    if kind.is_rtn() || kind == QuantKind::Fp8 {
        return Err(invalid(
            tensor,
            format!(
                "{} ({}) is not a ggml::repack kind: GGUF Q8_0, Q4_0, Q4_1 and Lantern's FP8 and Q3 blocks repack through PackedMatrix::from_gguf_blocks",
                kind.name(),
                ggml_name(kind)
            ),
        ));
    }
    let format = QuantFormat::new(kind, kind.ggml_group());
    format.check(tensor, k)?;
    let (be, bb) = block_size(kind);
    let expected = expected_bytes(kind, rows, k)
        .ok_or_else(|| invalid(tensor, format!("{rows} x {k} {} blocks overflow the address space", ggml_name(kind))))?;
    if data.len() != expected {
        return Err(invalid(
            tensor,
            format!("{} bytes of GGUF {} blocks, expected {expected} for {rows} x {k}", data.len(), ggml_name(kind)),
        ));
    }
    let (qw, lw, sw) = (format.qs_words(k), format.lo_words(k), format.scale_words(k));
    let mut qs = vec![0u32; rows * qw];
    let mut scales = vec![0u32; rows * sw];
    let nsb = k / 256;
    let row_words = qs.chunks_exact_mut(qw).zip(scales.chunks_exact_mut(sw));
    for (row, (q, s)) in data.chunks_exact(k / be * bb).zip(row_words) {
        let (lo, hi) = q.split_at_mut(lw);
        for (b, x) in row.chunks_exact(bb).enumerate() {
            match kind {
                QuantKind::Q5Sym | QuantKind::Q5 | QuantKind::Iq4Nl | QuantKind::Mxfp4 => {
                    // 32 elements: 4 low-plane words, 1 high-plane word.
                    let nib = match kind {
                        QuantKind::Q5Sym => &x[6..22],
                        QuantKind::Q5 => &x[8..24],
                        QuantKind::Mxfp4 => &x[1..17],
                        _ => &x[2..18],
                    };
                    let l = &mut lo[4 * b..4 * b + 4];
                    nibble_words(nib, 0, &mut l[0..2]);
                    nibble_words(nib, 4, &mut l[2..4]);
                    match kind {
                        QuantKind::Q5Sym => {
                            hi[b] = u32_at(x, 2);
                            s[b / 2] |= u16_at(x, 0) << (16 * (b & 1));
                        }
                        QuantKind::Q5 => {
                            hi[b] = u32_at(x, 4);
                            s[b] = u32_at(x, 0);
                        }
                        // The E8M0 byte in the low byte of the group's half.
                        QuantKind::Mxfp4 => s[b / 2] |= (x[0] as u32) << (16 * (b & 1)),
                        _ => s[b / 2] |= u16_at(x, 0) << (16 * (b & 1)),
                    }
                }
                QuantKind::Q4K | QuantKind::Q5K => {
                    // 256 elements: 32 low-plane words (+ 8 high-plane words for Q5_K).
                    let nib = if kind == QuantKind::Q4K { &x[16..144] } else { &x[48..176] };
                    let l = &mut lo[32 * b..32 * b + 32];
                    for c in 0..4 {
                        let src = &nib[32 * c..32 * c + 32];
                        nibble_words(src, 0, &mut l[8 * c..8 * c + 4]);
                        nibble_words(src, 4, &mut l[8 * c + 4..8 * c + 8]);
                    }
                    if kind == QuantKind::Q5K {
                        for (bit, w) in hi[8 * b..8 * b + 8].iter_mut().enumerate() {
                            *w = bit_word(&x[16..48], bit as u32);
                        }
                    }
                    // d | dmin << 16, then the 12 scale bytes: the block's first 16 bytes.
                    for (i, w) in s[4 * b..4 * b + 4].iter_mut().enumerate() {
                        *w = u32_at(x, 4 * i);
                    }
                }
                QuantKind::Q2K | QuantKind::Q3K => {
                    // 256 elements: 16 low-plane (2-bit) words (+ 8 high-plane words for Q3_K).
                    let codes = if kind == QuantKind::Q2K { &x[16..80] } else { &x[32..96] };
                    let l = &mut lo[16 * b..16 * b + 16];
                    for h in 0..2 {
                        for sh in 0..4 {
                            let w = 8 * h + 2 * sh;
                            crumb_words(&codes[32 * h..32 * h + 32], 2 * sh as u32, &mut l[w..w + 2]);
                        }
                    }
                    if kind == QuantKind::Q2K {
                        for (i, w) in s[4 * b..4 * b + 4].iter_mut().enumerate() {
                            *w = u32_at(x, 4 * i);
                        }
                        s[4 * nsb + b] = u32_at(x, 80);
                    } else {
                        for (bit, w) in hi[8 * b..8 * b + 8].iter_mut().enumerate() {
                            *w = bit_word(&x[0..32], bit as u32);
                        }
                        for (i, w) in s[4 * b..4 * b + 3].iter_mut().enumerate() {
                            *w = u32_at(x, 96 + 4 * i);
                        }
                        s[4 * b + 3] = u16_at(x, 108);
                    }
                }
                QuantKind::Q6K => {
                    // 256 elements: 32 low-plane words, 16 high-plane (2-bit) words.
                    let l = &mut lo[32 * b..32 * b + 32];
                    let h2 = &mut hi[16 * b..16 * b + 16];
                    for h in 0..2 {
                        let ql = &x[64 * h..64 * h + 64];
                        nibble_words(ql, 0, &mut l[16 * h..16 * h + 8]);
                        nibble_words(ql, 4, &mut l[16 * h + 8..16 * h + 16]);
                        for t in 0..4 {
                            let w = 8 * h + 2 * t;
                            crumb_words(&x[128 + 32 * h..160 + 32 * h], 2 * t as u32, &mut h2[w..w + 2]);
                        }
                    }
                    for (i, w) in s[4 * b..4 * b + 4].iter_mut().enumerate() {
                        *w = u32_at(x, 192 + 4 * i);
                    }
                    s[4 * nsb + b / 2] |= u16_at(x, 208) << (16 * (b & 1));
                }
                QuantKind::Iq4Xs => {
                    // 256 elements: 8 sub-blocks of 32 in the 32-element nibble order.
                    let l = &mut lo[32 * b..32 * b + 32];
                    for j in 0..8 {
                        let nib = &x[8 + 16 * j..24 + 16 * j];
                        nibble_words(nib, 0, &mut l[4 * j..4 * j + 2]);
                        nibble_words(nib, 4, &mut l[4 * j + 2..4 * j + 4]);
                    }
                    // d | scales_h << 16, then scales_l: the block's first 8 bytes.
                    s[2 * b] = u32_at(x, 0);
                    s[2 * b + 1] = u32_at(x, 4);
                }
                QuantKind::Q8 | QuantKind::Q4 | QuantKind::Q4Sym | QuantKind::Fp8 | QuantKind::Q3 | QuantKind::S24Q4 | QuantKind::S24Q8 => {
                    unreachable!("rejected above")
                }
            }
        }
    }
    Ok(PackedMatrix { format, rows, k, qs, scales })
}

/// The 12 scale bytes at `at` as three little-endian words (for [`scale_min_k4`] and
/// [`scale_k3`]).
fn scale_words12(x: &[u8], at: usize) -> [u32; 3] {
    [u32_at(x, at), u32_at(x, at + 4), u32_at(x, at + 8)]
}

fn half(x: &[u8], at: usize) -> f32 {
    f16::from_bits(u16_at(x, at) as u16).to_f32()
}

/// Dequantize `n` elements (row-major, blocks consecutive) of ggml blocks of `kind` straight
/// from the file bytes, as ggml (`dequantize_row_*` in ggml-quants.c) defines each format,
/// computing in f32 with the same operations as gguf-py's `gguf.quants.dequantize`, so the
/// results are bit-exact with it. `n` must be a multiple of the block size and `data` exactly
/// `n / block_elems * block_bytes` bytes.
pub fn dequantize_blocks(kind: QuantKind, data: &[u8], n: usize) -> Result<Vec<f32>, QuantError> {
    let (be, bb) = block_size(kind);
    let what = format!("<{} blocks>", ggml_name(kind));
    if kind.is_sparse() {
        return Err(invalid(&what, "the 2:4 kinds have no block form; they come only from lantern quantize".into()));
    }
    if !n.is_multiple_of(be) {
        return Err(invalid(&what, format!("{n} elements are not a whole number of {be}-element blocks")));
    }
    let expected = n / be * bb;
    if data.len() != expected {
        return Err(invalid(&what, format!("{} bytes of blocks, expected {expected} for {n} elements", data.len())));
    }
    let mut out = vec![0f32; n];
    for (y, x) in out.chunks_exact_mut(be).zip(data.chunks_exact(bb)) {
        match kind {
            QuantKind::Q8 => {
                let d = half(x, 0);
                for (v, &q) in y.iter_mut().zip(&x[2..34]) {
                    *v = q as i8 as f32 * d;
                }
            }
            QuantKind::Fp8 => {
                let d = half(x, 0);
                for (v, &q) in y.iter_mut().zip(&x[2..34]) {
                    *v = fp8_code(q) * d;
                }
            }
            QuantKind::Q4Sym | QuantKind::Q4 | QuantKind::Iq4Nl => {
                let d = half(x, 0);
                let (m, qs) = match kind {
                    QuantKind::Q4 => (half(x, 2), &x[4..20]),
                    _ => (0.0, &x[2..18]),
                };
                for (j, &b) in qs.iter().enumerate() {
                    for (e, q) in [(j, b & 15), (j + 16, b >> 4)] {
                        y[e] = match kind {
                            QuantKind::Q4Sym => d * (q as i32 - 8) as f32,
                            QuantKind::Q4 => d * q as f32 + m,
                            _ => d * IQ4_VALUES[q as usize] as f32,
                        };
                    }
                }
            }
            QuantKind::Q3 => {
                let (d, m) = (half(x, 0), half(x, 2));
                for (e, v) in y.iter_mut().enumerate() {
                    let q = (x[4 + e / 4] >> (2 * (e % 4))) & 3 | ((x[12 + e / 8] >> (e % 8)) & 1) << 2;
                    *v = d * q as f32 + m;
                }
            }
            QuantKind::Mxfp4 => {
                // gguf-py: e8m0_to_fp32_half(e) * kvalues[q], one f32 product.
                let d = e8m0_half(x[0]);
                for (j, &b) in x[1..17].iter().enumerate() {
                    y[j] = d * MXFP4_VALUES[(b & 15) as usize] as f32;
                    y[j + 16] = d * MXFP4_VALUES[(b >> 4) as usize] as f32;
                }
            }
            QuantKind::Q5Sym | QuantKind::Q5 => {
                let d = half(x, 0);
                let (m, qh, qs) = match kind {
                    QuantKind::Q5 => (half(x, 2), u32_at(x, 4), &x[8..24]),
                    _ => (0.0, u32_at(x, 2), &x[6..22]),
                };
                for (j, &b) in qs.iter().enumerate() {
                    for (e, lo) in [(j, b & 15), (j + 16, b >> 4)] {
                        let q = lo as u32 | ((qh >> e) & 1) << 4;
                        y[e] = if kind == QuantKind::Q5 { d * q as f32 + m } else { d * (q as i32 - 16) as f32 };
                    }
                }
            }
            QuantKind::Q2K => {
                let (sc, qs) = (&x[0..16], &x[16..80]);
                let (d, dmin) = (half(x, 80), half(x, 82));
                for h in 0..2 {
                    for s in 0..4 {
                        for l in 0..32 {
                            let e = 128 * h + 32 * s + l;
                            let b = sc[e / 16];
                            let (dl, ml) = (d * (b & 15) as f32, dmin * (b >> 4) as f32);
                            let q = (qs[32 * h + l] >> (2 * s)) & 3;
                            y[e] = dl * q as f32 - ml;
                        }
                    }
                }
            }
            QuantKind::Q3K => {
                let (hmask, qs) = (&x[0..32], &x[32..96]);
                let w = scale_words12(x, 96);
                let d = half(x, 108);
                for h in 0..2 {
                    for s in 0..4 {
                        for l in 0..32 {
                            let e = 128 * h + 32 * s + l;
                            let dl = d * (scale_k3(e / 16, &w) - 32) as f32;
                            let low = ((qs[32 * h + l] >> (2 * s)) & 3) as i32;
                            // A clear hmask bit subtracts 4; a set one leaves the low bits.
                            let hbit = ((hmask[e % 32] >> (e / 32)) & 1) as i32;
                            y[e] = dl * (low - 4 * (1 - hbit)) as f32;
                        }
                    }
                }
            }
            QuantKind::Q4K | QuantKind::Q5K => {
                let (d, dmin) = (half(x, 0), half(x, 2));
                let w = scale_words12(x, 4);
                let (qh, qs) = if kind == QuantKind::Q5K { (&x[16..48], &x[48..176]) } else { (&x[0..0], &x[16..144]) };
                for c in 0..4 {
                    for half_ in 0..2 {
                        let j = 2 * c + half_;
                        let (sc, m) = scale_min_k4(j, &w);
                        let (d1, m1) = (d * sc as f32, dmin * m as f32);
                        for l in 0..32 {
                            let e = 64 * c + 32 * half_ + l;
                            let mut q = ((qs[32 * c + l] >> (4 * half_)) & 15) as u32;
                            if kind == QuantKind::Q5K {
                                q |= (((qh[l] >> j) & 1) as u32) << 4;
                            }
                            y[e] = d1 * q as f32 - m1;
                        }
                    }
                }
            }
            QuantKind::Q6K => {
                let (ql, qh, sc) = (&x[0..128], &x[128..192], &x[192..208]);
                let d = half(x, 208);
                for h in 0..2 {
                    for l in 0..32 {
                        for t in 0..4 {
                            let e = 128 * h + 32 * t + l;
                            // Low nibbles of ql[64 h ..] are elements 128 h + 0..64, high 64..128.
                            let lo = (ql[64 * h + 32 * (t % 2) + l] >> (4 * (t / 2))) & 15;
                            let hi = (qh[32 * h + l] >> (2 * t)) & 3;
                            let q = (lo | hi << 4) as i32 - 32;
                            y[e] = (d * sc[e / 16] as i8 as f32) * q as f32;
                        }
                    }
                }
            }
            QuantKind::Iq4Xs => {
                let d = half(x, 0);
                let sh = u16_at(x, 2);
                for j in 0..8 {
                    let ls = ((x[4 + j / 2] >> (4 * (j % 2))) & 15) as i32 | (((sh >> (2 * j)) & 3) as i32) << 4;
                    let dl = d * (ls - 32) as f32;
                    let qs = &x[8 + 16 * j..24 + 16 * j];
                    for l in 0..16 {
                        y[32 * j + l] = dl * IQ4_VALUES[(qs[l] & 15) as usize] as f32;
                        y[32 * j + 16 + l] = dl * IQ4_VALUES[(qs[l] >> 4) as usize] as f32;
                    }
                }
            }
            QuantKind::S24Q4 | QuantKind::S24Q8 => unreachable!("rejected above"),
        }
    }
    Ok(out)
}

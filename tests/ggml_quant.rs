//! ggml block formats (`lantern::quant::ggml`): the CPU oracle against gguf-py's
//! `gguf.quants.dequantize` (stored fixture, `tests/fixtures/ggml-types/`), the bit-for-bit
//! repack into the packed GPU layout against the oracle (fixture and random blocks), and the
//! typed errors for bad shapes, truncated data and kinds that do not repack here.
//!
//! Every comparison is bit for bit, signed zeros included (ggml computes `d * c`, `-0.0` for
//! a zero code under a negative scale; the packed reference adds `m = -0.0` there).

mod common;

use common::random::Rng;

use lantern::model::{DType, HostTensor};
use lantern::quant::ggml::{self, block_size, dequantize_blocks, repack};
use lantern::quant::{PackedMatrix, QuantError, QuantFormat, QuantKind};

/// ggml type name, Lantern kind, the dtype a GGUF tensor of it loads as.
const TYPES: [(&str, QuantKind, DType); 13] = [
    ("Q4_0", QuantKind::Q4Sym, DType::Q4_0),
    ("Q4_1", QuantKind::Q4, DType::Q4_1),
    ("Q5_0", QuantKind::Q5Sym, DType::Q5_0),
    ("Q5_1", QuantKind::Q5, DType::Q5_1),
    ("Q8_0", QuantKind::Q8, DType::Q8_0),
    ("Q2_K", QuantKind::Q2K, DType::Q2_K),
    ("Q3_K", QuantKind::Q3K, DType::Q3_K),
    ("Q4_K", QuantKind::Q4K, DType::Q4_K),
    ("Q5_K", QuantKind::Q5K, DType::Q5_K),
    ("Q6_K", QuantKind::Q6K, DType::Q6_K),
    ("IQ4_NL", QuantKind::Iq4Nl, DType::IQ4_NL),
    ("IQ4_XS", QuantKind::Iq4Xs, DType::IQ4_XS),
    ("MXFP4", QuantKind::Mxfp4, DType::MXFP4),
];

/// The kinds `ggml::repack` handles (the others repack in `PackedMatrix::from_gguf_blocks`).
const REPACK_KINDS: [QuantKind; 10] = [
    QuantKind::Q5Sym,
    QuantKind::Q5,
    QuantKind::Iq4Nl,
    QuantKind::Mxfp4,
    QuantKind::Q2K,
    QuantKind::Q3K,
    QuantKind::Q4K,
    QuantKind::Q5K,
    QuantKind::Q6K,
    QuantKind::Iq4Xs,
];

/// Fixture geometry: the first `ROWS` rows of `blk.0.ffn_down.weight` (rows of `K`).
const ROWS: usize = 4;
const K: usize = 512;

fn fixture_dir() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/ggml-types")
}

/// `(blocks, reference values)` of type `name` from the fixture: `ROWS x K` elements of the
/// real tensor (`set` = "") or of seeded random blocks (`set` = ".random").
fn fixture_set(name: &str, set: &str) -> (Vec<u8>, Vec<f32>) {
    let dir = fixture_dir();
    let read = |f: String| std::fs::read(dir.join(&f)).unwrap_or_else(|e| panic!("reading fixture {f}: {e}"));
    let blocks = read(format!("{name}{set}.blocks.bin"));
    let deq = read(format!("{name}{set}.deq.f32"));
    let deq = deq.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    (blocks, deq)
}

fn fixture(name: &str) -> (Vec<u8>, Vec<f32>) {
    fixture_set(name, "")
}

/// Panic at the first element whose bits differ.
fn assert_bits(label: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{label}: {} values, expected {}", got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        if g.to_bits() == w.to_bits() {
            continue;
        }
        let bad = got.iter().zip(want).filter(|(g, w)| g.to_bits() != w.to_bits()).count();
        panic!(
            "{label}: element {i} (row {}, col {}) is {g:e} ({:#010x}), expected {w:e} ({:#010x}); {bad} of {} differ",
            i / K,
            i % K,
            g.to_bits(),
            w.to_bits(),
            got.len()
        );
    }
}

#[test]
fn fixture_matches_its_manifest() {
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixture_dir().join("dequant.json")).expect("dequant.json")).expect("valid json");
    assert_eq!(json["rows_stored"], ROWS);
    for (name, kind, _) in TYPES {
        let t = &json["types"][name];
        let (be, bb) = block_size(kind);
        assert_eq!(t["shape"], serde_json::json!([256, K]), "{name}");
        assert_eq!((t["block_elems"].as_u64(), t["block_bytes"].as_u64()), (Some(be as u64), Some(bb as u64)), "{name}");
        let (blocks, deq) = fixture(name);
        assert_eq!(blocks.len(), ROWS * K / be * bb, "{name}.blocks.bin");
        assert_eq!(t["blocks_bytes"].as_u64(), Some(blocks.len() as u64), "{name}");
        assert_eq!(deq.len(), ROWS * K, "{name}.deq.f32");
        let (blocks, deq) = fixture_set(name, ".random");
        assert_eq!((blocks.len(), deq.len()), (ROWS * K / be * bb, ROWS * K), "{name}.random");
    }
}

#[test]
fn oracle_matches_gguf_py_bit_for_bit() {
    for (name, kind, _) in TYPES {
        let (blocks, want) = fixture(name);
        let got = dequantize_blocks(kind, &blocks, ROWS * K).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_bits(&format!("{name} dequantize_blocks vs gguf-py"), &got, &want);
        // Not a degenerate fixture: real values of both signs.
        assert!(want.iter().any(|v| *v > 0.0) && want.iter().any(|v| *v < 0.0), "{name}");
    }
}

/// Random block bytes (every sub-scale bit, negative and subnormal scales) decoded by gguf-py:
/// the oracle and the repack against it.
#[test]
fn random_blocks_match_gguf_py() {
    for (name, kind, _) in TYPES {
        let (blocks, want) = fixture_set(name, ".random");
        let got = dequantize_blocks(kind, &blocks, ROWS * K).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_bits(&format!("{name} random dequantize_blocks vs gguf-py"), &got, &want);
        let m = PackedMatrix::from_gguf_blocks(name, kind, &blocks, ROWS, K).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_bits(&format!("{name} random repack + dequantize vs gguf-py"), &m.dequantize(), &want);
    }
}

#[test]
fn repack_matches_gguf_py_bit_for_bit() {
    for (name, kind, _) in TYPES {
        let (blocks, want) = fixture(name);
        let m = PackedMatrix::from_gguf_blocks(name, kind, &blocks, ROWS, K).unwrap_or_else(|e| panic!("{name}: {e}"));
        let f = QuantFormat::new(kind, kind.ggml_group());
        assert_eq!(m.format, f, "{name}");
        assert_eq!((m.qs.len(), m.scales.len()), (ROWS * f.qs_words(K), ROWS * f.scale_words(K)), "{name}");
        assert_bits(&format!("{name} repack + dequantize vs gguf-py"), &m.dequantize(), &want);
        // The same through ggml::repack directly for its kinds, and the packed bytes survive
        // the HostTensor round trip.
        if REPACK_KINDS.contains(&kind) {
            assert_eq!(repack(name, kind, &blocks, ROWS, K).as_ref(), Ok(&m), "{name}");
        }
        let back = PackedMatrix::from_bytes(name, f, ROWS, K, &m.to_bytes()).expect("from_bytes");
        assert_eq!(back, m, "{name}");
    }
}

#[test]
fn packed_dequantize_keeps_negative_zeros() {
    for (name, kind, _) in TYPES {
        let (blocks, want) = fixture(name);
        let m = PackedMatrix::from_gguf_blocks(name, kind, &blocks, ROWS, K).expect("repack");
        assert_bits(&format!("{name} repack + dequantize vs gguf-py"), &m.dequantize(), &want);
    }
}

#[test]
fn host_tensor_dtypes_decode_and_repack() {
    for (name, kind, dtype) in TYPES {
        let (blocks, want) = fixture(name);
        assert_eq!(dtype.quant_kind(), Some(kind), "{name}");
        assert_eq!(dtype.block(), block_size(kind), "{name}");
        assert_eq!(dtype.bytes_for_shape(&[ROWS, K]), Some(blocks.len()), "{name}");
        let t = HostTensor { name: format!("{name}.weight"), shape: vec![ROWS, K], dtype, data: blocks };
        assert_bits(&format!("{name} HostTensor::to_f32"), &t.to_f32(), &want);
        let m = t.packed().expect("integer dtype").unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(m.format.kind, kind, "{name}");
    }
}

#[test]
fn super_block_kinds_need_rows_of_256() {
    for kind in REPACK_KINDS.into_iter().filter(|k| k.is_super()) {
        for k in [128usize, 288, 384] {
            let (be, bb) = block_size(kind);
            let data = vec![0u8; 2 * k.div_ceil(be) * bb];
            match repack("blk.0.ffn_up.weight", kind, &data, 2, k) {
                Err(QuantError::SuperBlockMismatch { tensor, k: got_k, block, .. }) => {
                    assert_eq!((tensor.as_str(), got_k, block), ("blk.0.ffn_up.weight", k, 256), "{kind:?}");
                }
                other => panic!("{kind:?} with rows of {k}: {other:?}"),
            }
        }
    }
    // The 32-element kinds take any multiple of 32, and nothing else.
    for kind in [QuantKind::Q5Sym, QuantKind::Q5, QuantKind::Iq4Nl, QuantKind::Mxfp4] {
        let (_, bb) = block_size(kind);
        assert!(repack("t", kind, &vec![0u8; 3 * bb], 1, 96).is_ok(), "{kind:?}");
        assert!(matches!(repack("t", kind, &[], 1, 40), Err(QuantError::SuperBlockMismatch { .. } | QuantError::GroupMismatch { .. })));
        assert!(matches!(repack("t", kind, &[], 1, 0), Err(QuantError::GroupMismatch { .. })), "{kind:?}");
    }
}

#[test]
fn wrong_byte_counts_are_typed_errors() {
    for kind in REPACK_KINDS {
        let (be, bb) = block_size(kind);
        let (rows, k) = (3, 512);
        let expected = rows * k / be * bb;
        for len in [expected - 1, expected + 1, 0, expected - bb] {
            let data = vec![0x5au8; len];
            match repack("blk.1.attn_v.weight", kind, &data, rows, k) {
                Err(QuantError::Invalid { tensor, reason }) => {
                    assert_eq!(tensor, "blk.1.attn_v.weight", "{kind:?}");
                    assert!(
                        reason.contains(&len.to_string()) && reason.contains(&expected.to_string()),
                        "{kind:?}: `{reason}` should name {len} and {expected}"
                    );
                }
                other => panic!("{kind:?}, {len} of {expected} bytes: {other:?}"),
            }
            // The oracle refuses the same data.
            assert!(matches!(dequantize_blocks(kind, &data, rows * k), Err(QuantError::Invalid { .. })), "{kind:?}");
        }
        // Element counts that are not whole blocks, and shapes that overflow.
        assert!(matches!(dequantize_blocks(kind, &[], be + 1), Err(QuantError::Invalid { .. })), "{kind:?}");
        assert!(matches!(repack("huge", kind, &[], usize::MAX, 256), Err(QuantError::Invalid { .. })), "{kind:?}");
    }
    // The whole fixture tensor one byte short, through the public entry point.
    for (name, kind, _) in TYPES {
        let (blocks, _) = fixture(name);
        let err = PackedMatrix::from_gguf_blocks("blk.0.ffn_down.weight", kind, &blocks[..blocks.len() - 1], ROWS, K).unwrap_err();
        assert!(matches!(&err, QuantError::Invalid { tensor, .. } if tensor == "blk.0.ffn_down.weight"), "{name}: {err}");
        assert!(err.to_string().contains(&(blocks.len() - 1).to_string()), "{name}: {err}");
    }
}

#[test]
fn kinds_outside_ggml_repack_are_refused() {
    for kind in [QuantKind::Q8, QuantKind::Q4, QuantKind::Q4Sym] {
        let (_, bb) = block_size(kind);
        match repack("output.weight", kind, &vec![0u8; 8 * bb], 1, 256) {
            Err(QuantError::Invalid { tensor, reason }) => {
                assert_eq!(tensor, "output.weight");
                assert!(reason.contains(kind.name()) && reason.contains(ggml::ggml_name(kind)), "{reason}");
            }
            other => panic!("{kind:?}: {other:?}"),
        }
    }
}

/// Random blocks: any bits for codes and sub-block scales, finite f16 scales (MXFP4: an
/// E8M0 exponent up to 252, whose largest value 2^124 x 12 is finite).
fn random_blocks(rng: &mut Rng, kind: QuantKind, rows: usize, k: usize) -> Vec<u8> {
    let (be, bb) = block_size(kind);
    let mut data = rng.bytes(rows * k / be * bb);
    for b in data.chunks_exact_mut(bb) {
        for &at in ggml::f16_fields(kind) {
            b[at..at + 2].copy_from_slice(&finite_f16(rng).to_le_bytes());
        }
        if kind == QuantKind::Mxfp4 {
            b[0] %= 253;
        }
    }
    data
}

#[test]
fn random_blocks_repack_bit_for_bit() {
    let mut rng = Rng(0x1a7e_b10c);
    for (name, kind, _) in TYPES {
        let (be, _) = block_size(kind);
        // Odd row counts, and rows with an odd number of blocks (odd super-block counts put
        // Q6_K's d words and the two-per-word f16 scales at a padded end).
        let ks: &[usize] = if be == 256 { &[256, 512, 768, 1280] } else { &[32, 96, 256, 480] };
        for &rows in &[1usize, 3, 5, 7] {
            for &k in ks {
                let data = random_blocks(&mut rng, kind, rows, k);
                let label = format!("{name} random {rows} x {k}");
                let want = dequantize_blocks(kind, &data, rows * k).unwrap_or_else(|e| panic!("{label}: {e}"));
                assert!(want.iter().all(|v| v.is_finite()), "{label}");
                let m = PackedMatrix::from_gguf_blocks(&label, kind, &data, rows, k).unwrap_or_else(|e| panic!("{label}: {e}"));
                assert_bits(&label, &m.dequantize(), &want);
            }
        }
    }
}

/// Hand-built blocks whose every element has a distinct, known code: the element orders of
/// the ggml layouts, checked against `raw_code` of the packed matrix.
#[test]
fn element_order_of_each_layout() {
    // One block of each kind with every element's code bits written where ggml's definition
    // puts them (scales left zero: only the codes matter here).
    fn code_of(kind: QuantKind, e: usize) -> u32 {
        let bits = kind.lo_bits() + kind.hi_bits();
        ((e * 7 + e / 32) % (1 << bits)) as u32
    }
    for kind in REPACK_KINDS {
        let (be, bb) = block_size(kind);
        let mut b = vec![0u8; bb];
        let q: Vec<u32> = (0..be).map(|e| code_of(kind, e)).collect();
        let nib = |b: &mut [u8], at: usize, v: u32, hi: bool| b[at] |= ((v & 15) as u8) << if hi { 4 } else { 0 };
        match kind {
            QuantKind::Q5Sym | QuantKind::Q5 | QuantKind::Iq4Nl | QuantKind::Mxfp4 => {
                let (qh_at, qs_at) = match kind {
                    QuantKind::Q5Sym => (Some(2), 6),
                    QuantKind::Q5 => (Some(4), 8),
                    QuantKind::Mxfp4 => (None, 1),
                    _ => (None, 2),
                };
                for (e, &v) in q.iter().enumerate() {
                    nib(&mut b, qs_at + e % 16, v, e >= 16);
                    if let Some(at) = qh_at {
                        b[at + e / 8] |= (((v >> 4) & 1) as u8) << (e % 8);
                    }
                }
            }
            QuantKind::Q4K | QuantKind::Q5K => {
                let qs_at = if kind == QuantKind::Q4K { 16 } else { 48 };
                for (e, &v) in q.iter().enumerate() {
                    nib(&mut b, qs_at + 32 * (e / 64) + e % 32, v, e % 64 >= 32);
                    if kind == QuantKind::Q5K {
                        b[16 + e % 32] |= (((v >> 4) & 1) as u8) << (e / 32);
                    }
                }
            }
            QuantKind::Q2K | QuantKind::Q3K => {
                let qs_at = if kind == QuantKind::Q2K { 16 } else { 32 };
                for (e, &v) in q.iter().enumerate() {
                    b[qs_at + 32 * (e / 128) + e % 32] |= ((v & 3) as u8) << (2 * ((e % 128) / 32));
                    if kind == QuantKind::Q3K {
                        b[e % 32] |= (((v >> 2) & 1) as u8) << (e / 32);
                    }
                }
            }
            QuantKind::Q6K => {
                for (e, &v) in q.iter().enumerate() {
                    let (h, l) = (e / 128, e % 128);
                    nib(&mut b, 64 * h + l % 64, v, l >= 64);
                    b[128 + 32 * h + l % 32] |= (((v >> 4) & 3) as u8) << (2 * (l / 32));
                }
            }
            QuantKind::Iq4Xs => {
                for (e, &v) in q.iter().enumerate() {
                    nib(&mut b, 8 + 16 * (e / 32) + e % 16, v, e % 32 >= 16);
                }
            }
            _ => unreachable!(),
        }
        let m = repack("order", kind, &b, 1, be).expect("repack");
        for (e, &v) in q.iter().enumerate() {
            assert_eq!(m.raw_code(0, e), v as i32, "{kind:?} element {e}");
        }
    }
}

/// A finite f16 of either sign: any bits but an all-ones exponent (inf / NaN). Every third
/// one is small (exponent field below 8, subnormals and zero included).
fn finite_f16(rng: &mut Rng) -> u16 {
    let bits = rng.next_u64() as u16;
    let bits = if rng.next_u64().is_multiple_of(3) { bits & 0x9fff } else { bits };
    if bits & 0x7c00 == 0x7c00 {
        bits & !0x4000
    } else {
        bits
    }
}

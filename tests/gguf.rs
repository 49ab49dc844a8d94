//! GGUF reader: the real SmolLM2 file (metadata, config, tensor set, Q/K un-permutation),
//! synthetic files with known rows, and broken inputs that must give typed errors, never panics.

mod common;

use std::collections::HashMap;
use std::sync::OnceLock;

use common::{ggml, tiny_model, GgufWriter, Meta, TINY};
use lantern::model::gguf::{hf_tensor_name, load_gguf_file, unpermute_qk_rows, weights_from_gguf, GgmlType, GgufError, GgufFile, GgufMmap};
use lantern::model::{Arch, DType, HostTensor, ModelWeights};
use lantern::LanternError;

/// The real model, mapped once per test binary.
fn real_map() -> &'static GgufMmap {
    static MAP: OnceLock<GgufMmap> = OnceLock::new();
    MAP.get_or_init(|| GgufMmap::open(common::smollm2_gguf()).expect("map SmolLM2 GGUF"))
}

/// The real model parsed once.
fn real() -> &'static GgufFile<'static> {
    static FILE: OnceLock<GgufFile<'static>> = OnceLock::new();
    FILE.get_or_init(|| real_map().parse().expect("parse SmolLM2 GGUF"))
}

/// The real model's weights, loaded once.
fn real_weights() -> &'static ModelWeights {
    static W: OnceLock<ModelWeights> = OnceLock::new();
    W.get_or_init(|| weights_from_gguf(real(), "SmolLM2").expect("load SmolLM2 weights"))
}

#[test]
fn real_model_metadata() {
    let g = real();
    assert_eq!(g.version(), 3);
    assert_eq!(g.alignment(), 32);
    assert_eq!(g.get_str("general.architecture").unwrap(), "llama");
    assert_eq!(g.get_u32("llama.block_count").unwrap(), 30);
    assert_eq!(g.get_str("tokenizer.ggml.model").unwrap(), "gpt2");
    assert_eq!(g.get_str("tokenizer.ggml.pre").unwrap(), "smollm");
    assert_eq!(g.get_str_array("tokenizer.ggml.tokens").unwrap().len(), 49152);
    assert_eq!(g.get_str_array("tokenizer.ggml.merges").unwrap().len(), 48900);
    assert_eq!(g.get_bool_opt("tokenizer.ggml.add_bos_token").unwrap(), Some(false));
    assert!(g.get_str("tokenizer.chat_template").unwrap().contains("<|im_start|>"));
    assert_eq!(g.get_f32("llama.rope.freq_base").unwrap(), 100000.0);
    // Typed accessor errors name the key.
    let e = g.get_u32("general.name").unwrap_err().to_string();
    assert!(e.contains("general.name") && e.contains("expected"), "{e}");
    let e = g.get_str("no.such.key").unwrap_err().to_string();
    assert!(e.contains("no.such.key"), "{e}");
}

#[test]
fn real_model_config() {
    let c = &real_weights().config;
    assert_eq!(c.arch, Arch::Llama);
    assert_eq!(c.num_layers, 30);
    assert_eq!(c.hidden_size, 576);
    assert_eq!(c.num_heads, 9);
    assert_eq!(c.num_kv_heads, 3);
    assert_eq!(c.head_dim, 64);
    assert_eq!(c.intermediate_size, 1536);
    assert_eq!(c.rope_theta, 100000.0);
    assert_eq!(c.rope_scaling, None);
    assert_eq!(c.rms_norm_eps, 1e-5_f32); // stored as f32: 9.999999747378752e-06
    assert_eq!(c.vocab_size, 49152);
    assert_eq!(c.max_position_embeddings, 8192);
    assert!(c.tie_word_embeddings);
    assert!(!c.qkv_bias);
    assert_eq!(c.bos_token_id, Some(1));
    assert_eq!(c.eos_token_ids, vec![2]);
}

#[test]
fn real_model_tensor_set() {
    let g = real();
    assert_eq!(g.tensors().len(), 272);
    let mut by_type: HashMap<GgmlType, usize> = HashMap::new();
    for t in g.tensors() {
        *by_type.entry(t.ggml_type).or_default() += 1;
    }
    assert_eq!(by_type.get(&GgmlType::Q4_1), Some(&210));
    assert_eq!(by_type.get(&GgmlType::Q8_0), Some(&1));
    assert_eq!(by_type.get(&GgmlType::F32), Some(&61));
    let w = real_weights();
    assert_eq!(w.tensors.len(), 272);
    assert!(!w.tensors.contains_key("lm_head.weight"));
    let emb = &w.tensors["model.embed_tokens.weight"];
    assert_eq!((emb.shape.clone(), emb.dtype), (vec![49152, 576], DType::Q8_0));
    let q = &w.tensors["model.layers.0.self_attn.q_proj.weight"];
    assert_eq!((q.shape.clone(), q.dtype), (vec![576, 576], DType::Q4_1));
    assert_eq!(w.tensors["model.layers.29.self_attn.k_proj.weight"].shape, vec![192, 576]);
    assert_eq!(w.tensors["model.layers.3.mlp.down_proj.weight"].shape, vec![576, 1536]);
    assert_eq!(w.tensors["model.norm.weight"].dtype, DType::F32);
    for t in w.tensors.values() {
        assert_eq!(Some(t.data.len()), t.dtype.bytes_for_shape(&t.shape), "{}", t.name);
    }
}

/// Rows of the HF q/k projections equal GGUF rows `h*hd + 2*i + j` for HF row `h*hd + j*hd/2 + i`.
#[test]
fn real_model_qk_rows_unpermuted() {
    let (g, w) = (real(), real_weights());
    for (gguf_name, hf_name, heads) in [
        ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight", 9),
        ("blk.0.attn_k.weight", "model.layers.0.self_attn.k_proj.weight", 3),
        ("blk.17.attn_q.weight", "model.layers.17.self_attn.q_proj.weight", 9),
    ] {
        let raw = g.host_tensor(gguf_name).unwrap().unwrap().to_f32();
        let hf = w.tensors[hf_name].to_f32();
        let (hd, half, cols) = (64, 32, 576);
        let row = |v: &[f32], r: usize| v[r * cols..(r + 1) * cols].to_vec();
        for h in 0..heads {
            for i in 0..half {
                for j in 0..2 {
                    let (hf_row, gguf_row) = (h * hd + j * half + i, h * hd + 2 * i + j);
                    assert_eq!(row(&hf, hf_row), row(&raw, gguf_row), "{hf_name} row {hf_row}");
                }
            }
        }
        // The permutation is not the identity: adjacent GGUF rows 0 and 1 become HF rows 0 and 32.
        assert_ne!(row(&hf, 1), row(&raw, 1));
    }
    // V is not permuted.
    let v_raw = g.host_tensor("blk.0.attn_v.weight").unwrap().unwrap();
    assert_eq!(v_raw.data, w.tensors["model.layers.0.self_attn.v_proj.weight"].data);
}

fn check_synthetic_unpermute(qk_type: u32, dtype: DType) {
    let bytes = tiny_model("llama", TINY, qk_type).to_bytes();
    let g = GgufFile::parse(&bytes, "tiny.gguf").unwrap();
    let w = weights_from_gguf(&g, "tiny.gguf").unwrap();
    let (hd, half, cols) = (TINY.head_dim as usize, TINY.head_dim as usize / 2, TINY.hidden as usize);
    for (name, heads) in [("q_proj", TINY.heads), ("k_proj", TINY.kv_heads)] {
        for l in 0..TINY.layers {
            let t = &w.tensors[&format!("model.layers.{l}.self_attn.{name}.weight")];
            assert_eq!(t.dtype, dtype);
            let v = t.to_f32();
            for h in 0..heads as usize {
                for i in 0..half {
                    for j in 0..2 {
                        let hf_row = h * hd + j * half + i;
                        let want = (h * hd + 2 * i + j) as f32;
                        assert!(
                            v[hf_row * cols..(hf_row + 1) * cols].iter().all(|&x| x == want),
                            "{name} HF row {hf_row} should hold GGUF row {want}"
                        );
                    }
                }
            }
        }
    }
    assert!(w.config.tie_word_embeddings);
    assert_eq!(w.config.num_kv_heads, 1);
}

#[test]
fn synthetic_unpermute_f32() {
    check_synthetic_unpermute(ggml::F32, DType::F32);
}

#[test]
fn synthetic_unpermute_q8_0() {
    check_synthetic_unpermute(ggml::Q8_0, DType::Q8_0);
}

#[test]
fn unpermute_bytes_directly() {
    // 2 heads of 4 rows, 1 byte per row: GGUF [a0 b0 a1 b1] per head -> HF [a0 a1 b0 b1].
    let data: Vec<u8> = (0..8).collect();
    assert_eq!(unpermute_qk_rows(&data, 8, 2).unwrap(), vec![0, 2, 1, 3, 4, 6, 5, 7]);
    assert!(unpermute_qk_rows(&data, 8, 3).is_none());
    assert!(unpermute_qk_rows(&data, 3, 1).is_none());
}

#[test]
fn qwen2_is_not_permuted_and_has_biases() {
    let bytes = tiny_model("qwen2", TINY, ggml::F32).to_bytes();
    let g = GgufFile::parse(&bytes, "qwen.gguf").unwrap();
    let w = weights_from_gguf(&g, "qwen.gguf").unwrap();
    assert_eq!(w.config.arch, Arch::Qwen2);
    assert!(w.config.qkv_bias);
    let q = w.tensors["model.layers.0.self_attn.q_proj.weight"].to_f32();
    for r in 0..(TINY.heads * TINY.head_dim) as usize {
        assert_eq!(q[r * TINY.hidden as usize], r as f32);
    }
    let b = w.tensors["model.layers.1.self_attn.k_proj.bias"].to_f32();
    assert_eq!(b, (0..16).map(|x| x as f32).collect::<Vec<_>>());
}

#[test]
fn llama_biases_are_unpermuted_too() {
    let mut wr = tiny_model("llama", TINY, ggml::F32);
    for l in 0..TINY.layers {
        let q = TINY.heads * TINY.head_dim;
        let kv = TINY.kv_heads * TINY.head_dim;
        let ramp = |n: u64| (0..n).map(|x| x as f32).collect::<Vec<_>>();
        wr.tensor_f32(&format!("blk.{l}.attn_q.bias"), &[q], &ramp(q));
        wr.tensor_f32(&format!("blk.{l}.attn_k.bias"), &[kv], &ramp(kv));
        wr.tensor_f32(&format!("blk.{l}.attn_v.bias"), &[kv], &ramp(kv));
    }
    let bytes = wr.to_bytes();
    let w = weights_from_gguf(&GgufFile::parse(&bytes, "b.gguf").unwrap(), "b.gguf").unwrap();
    assert!(w.config.qkv_bias);
    let b = w.tensors["model.layers.0.self_attn.k_proj.bias"].to_f32();
    // HF element j*8 + i holds GGUF element 2*i + j (one head of 16).
    for i in 0..8 {
        for j in 0..2 {
            assert_eq!(b[j * 8 + i], (2 * i + j) as f32);
        }
    }
}

#[test]
fn untied_output_and_mistral_and_linear_rope() {
    let mut wr = tiny_model("mistral", TINY, ggml::F32);
    let n = (TINY.hidden * TINY.vocab) as usize;
    wr.tensor_f32("output.weight", &[TINY.hidden, TINY.vocab], &vec![0.5; n]);
    wr.kv("mistral.rope.scaling.type", Meta::Str("linear".into())).kv("mistral.rope.scaling.factor", Meta::F32(4.0));
    let bytes = wr.to_bytes();
    let w = weights_from_gguf(&GgufFile::parse(&bytes, "m.gguf").unwrap(), "m.gguf").unwrap();
    assert_eq!(w.config.arch, Arch::Mistral);
    assert!(!w.config.tie_word_embeddings);
    assert_eq!(w.tensors["lm_head.weight"].shape, vec![8, 32]);
    assert_eq!(w.config.rope_scaling, Some(lantern::model::RopeScaling::Linear { factor: 4.0 }));
}

#[test]
fn llama3_rope_freqs_tensor_is_recognised() {
    let mut wr = tiny_model("llama", TINY, ggml::F32);
    // Factors as convert_hf_to_gguf writes them for factor 8, low 1, high 4, original 8192.
    let (theta, hd) = (10000.0f64, 16usize);
    let factors: Vec<f32> = (0..hd / 2)
        .map(|i| {
            let freq = 1.0 / theta.powf((2 * i) as f64 / hd as f64);
            let wl = 2.0 * std::f64::consts::PI / freq;
            if wl < 8192.0 / 4.0 {
                1.0
            } else if wl > 8192.0 {
                8.0
            } else {
                let s = (8192.0 / wl - 1.0) / 3.0;
                (1.0 / ((1.0 - s) / 8.0 + s)) as f32 as f64
            }
        })
        .map(|x| x as f32)
        .collect();
    wr.tensor_f32("rope_freqs.weight", &[hd as u64 / 2], &factors);
    let bytes = wr.to_bytes();
    let w = weights_from_gguf(&GgufFile::parse(&bytes, "l3.gguf").unwrap(), "l3.gguf").unwrap();
    assert!(matches!(
        w.config.rope_scaling,
        Some(lantern::model::RopeScaling::Llama3 { factor, .. }) if factor == 8.0
    ));
    assert!(!w.tensors.contains_key("rope_freqs.weight"));
}

#[test]
fn name_mapping() {
    assert_eq!(hf_tensor_name("blk.12.ffn_down.weight", lantern::model::Arch::Llama).unwrap(), "model.layers.12.mlp.down_proj.weight");
    assert_eq!(hf_tensor_name("blk.0.attn_v.bias", lantern::model::Arch::Llama).unwrap(), "model.layers.0.self_attn.v_proj.bias");
    assert_eq!(
        hf_tensor_name("blk.3.ffn_norm.weight", lantern::model::Arch::Llama).unwrap(),
        "model.layers.3.post_attention_layernorm.weight"
    );
    assert_eq!(hf_tensor_name("output.weight", lantern::model::Arch::Llama).unwrap(), "lm_head.weight");
    assert_eq!(hf_tensor_name("rope_freqs.weight", lantern::model::Arch::Llama), None);
    assert_eq!(hf_tensor_name("blk.x.attn_q.weight", lantern::model::Arch::Llama), None);
}

#[test]
fn load_gguf_file_reads_from_disk() {
    let dir = std::env::temp_dir().join(format!("lantern-gguf-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("tiny.gguf");
    std::fs::write(&path, tiny_model("llama", TINY, ggml::Q8_0).to_bytes()).unwrap();
    let w = load_gguf_file(&path).unwrap();
    assert_eq!(w.config.num_layers, 2);
    assert!(w.source.ends_with("tiny.gguf"));
    let e = load_gguf_file(dir.join("missing.gguf")).unwrap_err();
    assert!(matches!(e, LanternError::Io { .. }), "{e}");
    std::fs::remove_dir_all(&dir).ok();
}

// ---- broken inputs -------------------------------------------------------------------------

fn parse_err(bytes: &[u8]) -> GgufError {
    match GgufFile::parse(bytes, "bad.gguf") {
        Ok(_) => panic!("parse should fail"),
        Err(e) => {
            assert!(e.to_string().starts_with("bad.gguf: "), "error should name the file: {e}");
            e
        }
    }
}

fn load_err(w: &GgufWriter) -> LanternError {
    let bytes = w.to_bytes();
    let g = GgufFile::parse(&bytes, "bad.gguf").expect("file itself parses");
    weights_from_gguf(&g, "bad.gguf").expect_err("loading should fail")
}

#[test]
fn truncated_at_every_point() {
    let bytes = tiny_model("llama", TINY, ggml::Q8_0).to_bytes();
    assert!(GgufFile::parse(&bytes, "ok.gguf").is_ok());
    for cut in 0..bytes.len() {
        let e = parse_err(&bytes[..cut]);
        assert!(
            matches!(e, GgufError::Truncated { .. } | GgufError::TensorOutOfBounds { .. } | GgufError::TooLarge { .. }),
            "cut at {cut}: unexpected {e}"
        );
    }
    let e = parse_err(&bytes[..10]).to_string();
    assert!(e.contains("tensor count"), "{e}");
    let e = parse_err(&bytes[..bytes.len() - 1]).to_string();
    assert!(e.contains("output_norm.weight"), "{e}");
}

#[test]
fn bad_magic() {
    let mut w = tiny_model("llama", TINY, ggml::F32);
    w.magic = *b"GGML";
    let e = parse_err(&w.to_bytes());
    assert!(matches!(e, GgufError::BadMagic { found, .. } if &found == b"GGML"), "{e}");
    assert!(e.to_string().contains("GGUF"));
}

#[test]
fn unsupported_versions() {
    for v in [1u32, 4, 0x0300_0000] {
        let mut w = tiny_model("llama", TINY, ggml::F32);
        w.version = v;
        let e = parse_err(&w.to_bytes());
        assert!(matches!(e, GgufError::UnsupportedVersion { version, .. } if version == v), "{e}");
        assert!(e.to_string().contains(&v.to_string()));
    }
    let mut w = tiny_model("llama", TINY, ggml::F32);
    w.version = 2;
    assert!(GgufFile::parse(&w.to_bytes(), "v2.gguf").is_ok());
}

#[test]
fn huge_counts_and_lengths() {
    let mut w = tiny_model("llama", TINY, ggml::F32);
    w.tensor_count_override = Some(u64::MAX / 2);
    let e = parse_err(&w.to_bytes());
    assert!(matches!(e, GgufError::TooLarge { .. }) && e.to_string().contains("tensor count"), "{e}");

    // A string array claiming 2^60 elements.
    let mut w = GgufWriter::default();
    let mut raw = 8u32.to_le_bytes().to_vec();
    raw.extend((1u64 << 60).to_le_bytes());
    w.kv("tokenizer.ggml.tokens", Meta::Raw(9, raw));
    let e = parse_err(&w.to_bytes());
    assert!(e.to_string().contains("tokenizer.ggml.tokens"), "{e}");

    // A string value claiming u64::MAX bytes.
    let mut w = GgufWriter::default();
    w.kv("general.name", Meta::Raw(8, u64::MAX.to_le_bytes().to_vec()));
    let e = parse_err(&w.to_bytes());
    assert!(matches!(e, GgufError::TooLarge { .. }) && e.to_string().contains("general.name"), "{e}");

    // Arrays nested far too deep.
    let mut raw = Vec::new();
    for _ in 0..100 {
        raw.extend(9u32.to_le_bytes());
        raw.extend(1u64.to_le_bytes());
    }
    raw.extend(4u32.to_le_bytes());
    raw.extend(0u64.to_le_bytes());
    let mut w = GgufWriter::default();
    w.kv("deep", Meta::Raw(9, raw));
    let e = parse_err(&w.to_bytes());
    assert!(matches!(e, GgufError::NestingTooDeep { .. }) && e.to_string().contains("deep"), "{e}");
}

#[test]
fn nested_arrays_parse() {
    let mut raw = 9u32.to_le_bytes().to_vec(); // array of arrays
    raw.extend(2u64.to_le_bytes());
    for n in [1u32, 2] {
        raw.extend(4u32.to_le_bytes());
        raw.extend((n as u64).to_le_bytes());
        (0..n).for_each(|x| raw.extend(x.to_le_bytes()));
    }
    let mut w = GgufWriter::default();
    w.kv("nested", Meta::Raw(9, raw)).kv("u64", Meta::U64(7)).kv("i32", Meta::I32(-3));
    let bytes = w.to_bytes();
    let g = GgufFile::parse(&bytes, "n.gguf").unwrap();
    use lantern::model::gguf::GgufArray;
    assert_eq!(g.get_array("nested").unwrap(), &GgufArray::Array(vec![GgufArray::U32(vec![0]), GgufArray::U32(vec![0, 1])]));
    assert_eq!(g.get_u32("u64").unwrap(), 7);
    assert!(g.get_u32("i32").unwrap_err().to_string().contains("int32 -3"));
}

#[test]
fn tensor_past_end() {
    let mut w = tiny_model("llama", TINY, ggml::F32);
    let last = w.tensors.len() - 1;
    w.tensors[last].offset = Some(1 << 40);
    let e = parse_err(&w.to_bytes());
    assert!(matches!(&e, GgufError::TensorOutOfBounds { tensor, .. } if tensor == "output_norm.weight"), "{e}");
    let mut w = tiny_model("llama", TINY, ggml::F32);
    w.tensors[0].offset = Some(u64::MAX - 31);
    assert!(matches!(parse_err(&w.to_bytes()), GgufError::TensorOutOfBounds { .. }));
}

#[test]
fn misaligned_offset_and_bad_alignment() {
    let mut w = tiny_model("llama", TINY, ggml::F32);
    w.tensors[1].offset = Some(4100);
    let e = parse_err(&w.to_bytes());
    assert!(matches!(&e, GgufError::MisalignedTensor { offset: 4100, alignment: 32, .. }), "{e}");
    let mut w = tiny_model("llama", TINY, ggml::F32);
    w.kv("general.alignment", Meta::U32(24));
    assert!(matches!(parse_err(&w.to_bytes()), GgufError::BadAlignment { alignment: 24, .. }));
    // A valid non-default alignment is honoured.
    let mut w = tiny_model("llama", TINY, ggml::F32);
    w.alignment = 64;
    w.kv("general.alignment", Meta::U32(64));
    let bytes = w.to_bytes();
    let g = GgufFile::parse(&bytes, "a64.gguf").unwrap();
    assert_eq!(g.alignment(), 64);
    assert!(weights_from_gguf(&g, "a64.gguf").is_ok());
}

#[test]
fn too_many_dims_and_block_mismatch() {
    let mut w = GgufWriter::default();
    w.tensor("t5", &[1, 1, 1, 1, 1], ggml::F32, vec![0; 4]);
    let e = parse_err(&w.to_bytes());
    assert!(matches!(&e, GgufError::TooManyDims { n_dims: 5, tensor, .. } if tensor == "t5"), "{e}");

    let mut w = GgufWriter::default();
    w.tensor("odd", &[33, 2], ggml::Q8_0, vec![0; 68]);
    let e = parse_err(&w.to_bytes());
    assert!(matches!(&e, GgufError::BadTensorShape { tensor, .. } if tensor == "odd"), "{e}");
    assert!(e.to_string().contains("block size 32"), "{e}");

    let mut w = GgufWriter::default();
    w.tensor("overflow", &[u64::MAX, 4], ggml::F32, vec![]);
    assert!(matches!(parse_err(&w.to_bytes()), GgufError::BadTensorShape { .. }));
}

#[test]
fn unknown_and_unsupported_tensor_types() {
    let mut w = GgufWriter::default();
    w.tensor("weird", &[32], 99, vec![0; 32]);
    let e = parse_err(&w.to_bytes());
    assert!(matches!(&e, GgufError::UnknownTensorType { type_id: 99, tensor, .. } if tensor == "weird"), "{e}");

    // A type Lantern does not load (IQ2_XXS, id 16) is named with the tensor.
    let mut w = tiny_model("llama", TINY, ggml::F32);
    let i = w.tensors.iter().position(|t| t.name == "blk.1.ffn_up.weight").unwrap();
    w.tensors[i].dims = vec![256, 8];
    w.tensors[i].ggml_type = 16;
    w.tensors[i].data = vec![0; 8 * 66];
    let e = load_err(&w);
    assert!(
        matches!(&e, LanternError::Gguf(GgufError::UnsupportedTensorType { tensor, ggml_type, .. })
            if tensor == "blk.1.ffn_up.weight" && ggml_type == "IQ2_XXS"),
        "{e}"
    );
}

/// K-quant tensors: a row length that is not a multiple of the 256-element super-block is
/// refused while parsing, and so is block data cut short.
#[test]
fn k_quant_rows_must_be_whole_super_blocks() {
    let mut w = GgufWriter::default();
    w.tensor("blk.0.ffn_down.weight", &[896, 2], ggml::Q4_K, vec![0; 7 * 144]);
    let e = parse_err(&w.to_bytes());
    assert!(
        matches!(&e, GgufError::BadTensorShape { tensor, ggml_type, .. } if tensor == "blk.0.ffn_down.weight" && ggml_type == "Q4_K"),
        "{e}"
    );
    assert!(e.to_string().contains("block size 256"), "{e}");

    let mut w = GgufWriter::default();
    w.tensor("cut", &[256, 4], 14, vec![0; 4 * 210 - 1]);
    let e = parse_err(&w.to_bytes());
    assert!(e.to_string().contains("cut"), "{e}");
}

#[test]
fn unsupported_architectures() {
    for arch in ["gpt2", "mamba"] {
        let e = load_err(&tiny_model(arch, TINY, ggml::F32));
        assert!(matches!(&e, LanternError::UnsupportedArchitecture { arch: a } if a == arch), "{e}");
        assert!(e.to_string().contains(arch));
    }
}

#[test]
fn missing_keys_and_tensors() {
    let mut w = tiny_model("llama", TINY, ggml::F32);
    w.kv.retain(|(k, _)| k != "llama.attention.layer_norm_rms_epsilon");
    let e = load_err(&w).to_string();
    assert!(e.contains("llama.attention.layer_norm_rms_epsilon"), "{e}");

    let mut w = tiny_model("llama", TINY, ggml::F32);
    w.tensors.retain(|t| t.name != "blk.1.ffn_gate.weight");
    let e = load_err(&w).to_string();
    assert!(e.contains("model.layers.1.mlp.gate_proj.weight"), "{e}");

    let mut w = tiny_model("llama", TINY, ggml::F32);
    w.set("llama.attention.head_count_kv", Meta::U32(3));
    let e = load_err(&w).to_string();
    assert!(e.contains("head_count_kv"), "{e}");

    let mut w = tiny_model("llama", TINY, ggml::F32);
    w.set("llama.block_count", Meta::Str("two".into()));
    let e = load_err(&w).to_string();
    assert!(e.contains("llama.block_count") && e.contains("string"), "{e}");
}

#[test]
fn random_corruption_never_panics() {
    let good = tiny_model("llama", TINY, ggml::Q8_0).to_bytes();
    let mut rng = common::random::Rng(0x2545_f491_4f6c_dd1d);
    let mut next = || rng.next_u64();
    // Corrupt the header/metadata/infos region (the data region is opaque bytes).
    let header_len = GgufFile::parse(&good, "g").unwrap().data_offset() as usize;
    for _ in 0..3000 {
        let mut bytes = good.clone();
        for _ in 0..1 + next() % 4 {
            let at = (next() as usize) % header_len;
            bytes[at] = next() as u8;
        }
        if let Ok(g) = GgufFile::parse(&bytes, "fuzz.gguf") {
            let _ = weights_from_gguf(&g, "fuzz.gguf");
            let _ = lantern::model::tokenizer::Tokenizer::from_gguf(&g);
        }
    }
}

#[test]
fn host_tensor_keeps_gguf_layout() {
    let bytes = tiny_model("llama", TINY, ggml::F32).to_bytes();
    let g = GgufFile::parse(&bytes, "t.gguf").unwrap();
    let t: HostTensor = g.host_tensor("blk.0.attn_q.weight").unwrap().unwrap();
    assert_eq!(t.shape, vec![32, 32]);
    assert_eq!(t.to_f32()[32], 1.0); // GGUF row 1, not un-permuted
    assert!(g.host_tensor("nope").unwrap().is_none());
    assert_eq!(GgmlType::from_id(3), Some(GgmlType::Q4_1));
    assert_eq!(GgmlType::Q4_K.block(), (256, 144));
}

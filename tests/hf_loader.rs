//! The Hugging Face folder loader and config parser on bad inputs: each must give a typed
//! error whose message names the file, tensor or field at fault, never a panic.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use lantern::model::hf::{load_hf_buffers, load_hf_folder};
use lantern::model::{LoadError, ModelConfig};
use lantern::LanternError;
use serde_json::{json, Value};

/// `$LANTERN_FIXTURES/tiny`, or `tests/fixtures/tiny` in the repository.
fn tiny_dir() -> PathBuf {
    let root = std::env::var_os("LANTERN_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures"));
    root.join("tiny")
}

/// A temp folder removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        static N: AtomicUsize = AtomicUsize::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let p = std::env::temp_dir().join(format!("lantern-hf-{}-{n}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A copy of fixture `name` in a temp folder.
fn copy_fixture(name: &str) -> TempDir {
    let dst = TempDir::new(name);
    for entry in std::fs::read_dir(tiny_dir().join(name)).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dst.path().join(entry.file_name())).unwrap();
    }
    dst
}

fn config_of(name: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(tiny_dir().join(name).join("config.json")).unwrap()).unwrap()
}

#[allow(clippy::result_large_err)]
fn parse(v: &Value) -> Result<ModelConfig, LanternError> {
    ModelConfig::from_hf_json(&v.to_string(), "config.json")
}

fn must_fail<T>(r: Result<T, LanternError>, what: &str) -> LanternError {
    match r {
        Ok(_) => panic!("{what}: expected an error"),
        Err(e) => {
            eprintln!("{what}: {e}");
            e
        }
    }
}

fn assert_mentions(e: &LanternError, parts: &[&str]) {
    let msg = e.to_string();
    for p in parts {
        assert!(msg.contains(p), "message {msg:?} does not mention {p:?}");
    }
}

/// Builds a safetensors file from (name, dtype, shape, bytes) entries.
fn safetensors_bytes(tensors: &[(&str, &str, Vec<usize>, Vec<u8>)]) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (name, dtype, shape, bytes) in tensors {
        let start = data.len();
        data.extend_from_slice(bytes);
        header.insert(name.to_string(), json!({"dtype": dtype, "shape": shape, "data_offsets": [start, data.len()]}));
    }
    let mut h = Value::Object(header).to_string().into_bytes();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend(h);
    out.extend(data);
    out
}

#[test]
fn fixture_loads_from_folder_and_from_buffers() {
    let dir = tiny_dir().join("llama-gqa");
    let a = load_hf_folder(&dir).unwrap();
    let config = std::fs::read_to_string(dir.join("config.json")).unwrap();
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let b = load_hf_buffers(&config, None, &[("model.safetensors", &bytes)]).unwrap();
    assert_eq!(a.config, b.config);
    assert_eq!(a.tensors.len(), b.tensors.len());
    for (name, t) in &a.tensors {
        assert_eq!(t.data, b.tensors[name].data, "{name}");
    }
}

#[test]
fn sharded_fixture_loads_from_buffers_with_index() {
    let dir = tiny_dir().join("llama-mha-tied-sharded");
    let config = std::fs::read_to_string(dir.join("config.json")).unwrap();
    let index = std::fs::read_to_string(dir.join("model.safetensors.index.json")).unwrap();
    let names = lantern::model::hf::shard_files(&index, "index").unwrap();
    assert_eq!(names.len(), 3);
    let files: Vec<(String, Vec<u8>)> = names.iter().map(|n| (n.clone(), std::fs::read(dir.join(n)).unwrap())).collect();
    let refs: Vec<(&str, &[u8])> = files.iter().map(|(n, b)| (n.as_str(), b.as_slice())).collect();
    let w = load_hf_buffers(&config, Some(&index), &refs).unwrap();
    assert!(w.config.tie_word_embeddings);
    // Leaving a shard out is an error naming it.
    let e = must_fail(load_hf_buffers(&config, Some(&index), &refs[..2]), "missing shard buffer");
    assert_mentions(&e, &[names[2].as_str()]);
}

#[test]
fn truncated_safetensors_names_the_file() {
    let d = copy_fixture("llama-gqa");
    let p = d.path().join("model.safetensors");
    let bytes = std::fs::read(&p).unwrap();
    std::fs::write(&p, &bytes[..bytes.len() - 100]).unwrap();
    let e = must_fail(load_hf_folder(d.path()), "truncated");
    assert!(matches!(e, LanternError::Load(LoadError::Safetensors { .. })), "{e:?}");
    assert_mentions(&e, &["model.safetensors", "truncated"]);
}

#[test]
fn corrupt_header_json_names_the_file() {
    let d = copy_fixture("llama-gqa");
    let p = d.path().join("model.safetensors");
    let mut bytes = std::fs::read(&p).unwrap();
    bytes[8] = b'#'; // the header's opening `{`
    std::fs::write(&p, &bytes).unwrap();
    let e = must_fail(load_hf_folder(d.path()), "corrupt header");
    assert!(matches!(e, LanternError::Load(LoadError::Safetensors { .. })), "{e:?}");
    assert_mentions(&e, &["model.safetensors", "header JSON"]);
}

#[test]
fn header_length_past_eof_names_the_file() {
    let d = copy_fixture("llama-gqa");
    let p = d.path().join("model.safetensors");
    let mut bytes = std::fs::read(&p).unwrap();
    let past = bytes.len() as u64 + 1000;
    bytes[..8].copy_from_slice(&past.to_le_bytes());
    std::fs::write(&p, &bytes).unwrap();
    let e = must_fail(load_hf_folder(d.path()), "header past EOF");
    assert!(matches!(e, LanternError::Load(LoadError::Safetensors { .. })), "{e:?}");
    assert_mentions(&e, &["model.safetensors", "past the end"]);

    // A file shorter than the 8-byte length prefix.
    std::fs::write(&p, [1u8, 2, 3]).unwrap();
    let e = must_fail(load_hf_folder(d.path()), "3-byte file");
    assert_mentions(&e, &["model.safetensors", "too short"]);
}

/// Rewrites the fixture's model.safetensors through `edit` on its tensor list.
fn rewrite_tensors(d: &TempDir, edit: impl FnOnce(&mut Vec<(String, String, Vec<usize>, Vec<u8>)>)) {
    let p = d.path().join("model.safetensors");
    let mut tensors = std::collections::HashMap::new();
    lantern::model::hf::read_safetensors("x", &std::fs::read(&p).unwrap(), &mut tensors).unwrap();
    let mut list: Vec<(String, String, Vec<usize>, Vec<u8>)> =
        tensors.into_values().map(|t| (t.name, format!("{:?}", t.dtype), t.shape, t.data)).collect();
    list.sort_by(|a, b| a.0.cmp(&b.0));
    edit(&mut list);
    let refs: Vec<(&str, &str, Vec<usize>, Vec<u8>)> =
        list.iter().map(|(n, d, s, b)| (n.as_str(), d.as_str(), s.clone(), b.clone())).collect();
    std::fs::write(&p, safetensors_bytes(&refs)).unwrap();
}

#[test]
fn missing_tensor_is_named() {
    let d = copy_fixture("llama-gqa");
    rewrite_tensors(&d, |l| l.retain(|t| t.0 != "model.layers.1.mlp.up_proj.weight"));
    let e = must_fail(load_hf_folder(d.path()), "missing tensor");
    assert!(matches!(e, LanternError::Load(LoadError::MissingTensor { .. })), "{e:?}");
    assert_mentions(&e, &["model.layers.1.mlp.up_proj.weight"]);
}

#[test]
fn missing_lm_head_when_untied_is_named() {
    let d = copy_fixture("llama-gqa");
    rewrite_tensors(&d, |l| l.retain(|t| t.0 != "lm_head.weight"));
    let e = must_fail(load_hf_folder(d.path()), "missing lm_head");
    assert_mentions(&e, &["lm_head.weight"]);
}

#[test]
fn wrong_shape_names_tensor_and_both_shapes() {
    let d = copy_fixture("llama-gqa");
    rewrite_tensors(&d, |l| {
        let t = l.iter_mut().find(|t| t.0 == "model.layers.0.self_attn.k_proj.weight").unwrap();
        t.2 = vec![64, 16]; // stored [16, 64]: transposed
    });
    let e = must_fail(load_hf_folder(d.path()), "wrong shape");
    assert!(matches!(e, LanternError::Load(LoadError::WrongShape { .. })), "{e:?}");
    assert_mentions(&e, &["model.layers.0.self_attn.k_proj.weight", "[64, 16]", "[16, 64]"]);
}

#[test]
fn unsupported_dtype_names_file_and_tensor() {
    let d = copy_fixture("llama-gqa");
    rewrite_tensors(&d, |l| {
        l.push(("model.extra_positions".into(), "I64".into(), vec![4], vec![0u8; 32]));
    });
    let e = must_fail(load_hf_folder(d.path()), "I64 tensor");
    assert!(matches!(e, LanternError::Load(LoadError::UnsupportedDType { .. })), "{e:?}");
    assert_mentions(&e, &["model.safetensors", "model.extra_positions", "I64"]);
}

#[test]
fn unexpected_bias_is_refused() {
    let d = copy_fixture("llama-gqa");
    rewrite_tensors(&d, |l| {
        l.push(("model.layers.0.self_attn.o_proj.bias".into(), "F32".into(), vec![64], vec![0u8; 256]));
    });
    let e = must_fail(load_hf_folder(d.path()), "o_proj bias");
    assert_mentions(&e, &["model.layers.0.self_attn.o_proj.bias"]);
}

#[test]
fn missing_config_json_is_explained() {
    let d = copy_fixture("llama-gqa");
    std::fs::remove_file(d.path().join("config.json")).unwrap();
    let e = must_fail(load_hf_folder(d.path()), "no config.json");
    assert_mentions(&e, &["config.json"]);
}

#[test]
fn missing_weights_file_is_explained() {
    let d = copy_fixture("llama-gqa");
    std::fs::remove_file(d.path().join("model.safetensors")).unwrap();
    let e = must_fail(load_hf_folder(d.path()), "no weights");
    assert_mentions(&e, &["model.safetensors"]);
}

#[test]
fn index_naming_a_missing_shard_is_explained() {
    let d = copy_fixture("llama-mha-tied-sharded");
    std::fs::remove_file(d.path().join("model-00002-of-00003.safetensors")).unwrap();
    let e = must_fail(load_hf_folder(d.path()), "missing shard");
    assert_mentions(&e, &["model.safetensors.index.json", "model-00002-of-00003.safetensors"]);
}

#[test]
fn index_pointing_at_the_wrong_shard_is_explained() {
    let d = copy_fixture("llama-mha-tied-sharded");
    let p = d.path().join("model.safetensors.index.json");
    let mut index: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    index["weight_map"]["model.norm.weight"] = json!("model-00001-of-00003.safetensors");
    std::fs::write(&p, index.to_string()).unwrap();
    let e = must_fail(load_hf_folder(d.path()), "wrong shard");
    assert_mentions(&e, &["model.norm.weight", "model-00001-of-00003.safetensors"]);
}

#[test]
fn unsupported_model_types_are_refused() {
    for arch in ["gpt2", "mamba"] {
        let mut c = config_of("llama-gqa");
        c["model_type"] = json!(arch);
        let e = must_fail(parse(&c), arch);
        assert!(matches!(e, LanternError::UnsupportedArchitecture { .. }), "{e:?}");
        assert_mentions(&e, &[arch]);
    }
    // The folder loader gives the same error.
    let d = copy_fixture("llama-gqa");
    let mut c = config_of("llama-gqa");
    c["model_type"] = json!("gpt2");
    c["architectures"] = json!(["GPT2LMHeadModel"]);
    std::fs::write(d.path().join("config.json"), c.to_string()).unwrap();
    let e = must_fail(load_hf_folder(d.path()), "gpt2 folder");
    assert!(matches!(e, LanternError::UnsupportedArchitecture { .. }), "{e:?}");
    // A non-causal-LM head on a supported block.
    let mut c = config_of("llama-gqa");
    c["architectures"] = json!(["LlamaForSequenceClassification"]);
    let e = must_fail(parse(&c), "sequence classification head");
    assert_mentions(&e, &["LlamaForSequenceClassification"]);
}

#[test]
fn mistral_sliding_window_puts_every_layer_behind_it() {
    use lantern::model::LayerAttention;
    let mut c = config_of("mistral");
    c["sliding_window"] = json!(4096);
    c["max_position_embeddings"] = json!(32768);
    let cfg = parse(&c).unwrap();
    assert_eq!(cfg.block.sliding_window, Some(4096));
    assert!((0..cfg.num_layers).all(|l| cfg.block.window(l) == Some(4096)));
    // The same RoPE on every layer.
    assert_eq!(cfg.layer_rope_inv_freq(0, 1), cfg.rope_inv_freq());
    // A window covering the whole context is plain full attention.
    c["sliding_window"] = json!(32768);
    let cfg = parse(&c).unwrap();
    assert!((0..cfg.num_layers).all(|l| cfg.block.attention(l) == LayerAttention::Full));
    c["sliding_window"] = json!(0);
    assert_mentions(&must_fail(parse(&c), "zero window"), &["sliding_window"]);
}

#[test]
fn qwen2_use_sliding_window_is_refused() {
    let mut c = config_of("qwen2-bias");
    c["use_sliding_window"] = json!(true);
    c["sliding_window"] = json!(4096);
    let e = must_fail(parse(&c), "qwen2 sliding window");
    assert_mentions(&e, &["use_sliding_window"]);
}

#[test]
fn biases_the_block_cannot_apply_are_refused() {
    let mut c = config_of("llama-gqa");
    c["mlp_bias"] = json!(true);
    assert_mentions(&must_fail(parse(&c), "mlp_bias"), &["mlp_bias"]);
    let mut c = config_of("llama-gqa");
    c["attention_bias"] = json!(true);
    assert_mentions(&must_fail(parse(&c), "attention_bias"), &["attention_bias", "o_proj"]);
}

#[test]
fn unknown_rope_types_are_refused() {
    let mut c = config_of("llama-gqa");
    c["rope_parameters"] = json!({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0});
    let e = must_fail(parse(&c), "yarn");
    assert!(matches!(e, LanternError::Config { .. }), "{e:?}");
    assert_mentions(&e, &["yarn", "rope_type"]);
    let mut c = config_of("llama-gqa");
    c.as_object_mut().unwrap().remove("rope_parameters");
    c["rope_scaling"] = json!({"type": "dynamic", "factor": 2.0});
    assert_mentions(&must_fail(parse(&c), "dynamic"), &["dynamic"]);
    let mut c = config_of("llama3-rope-scaling");
    c["rope_parameters"].as_object_mut().unwrap().remove("low_freq_factor");
    assert_mentions(&must_fail(parse(&c), "llama3 missing"), &["low_freq_factor"]);
}

#[test]
fn inconsistent_sizes_are_refused() {
    let mut c = config_of("llama-gqa");
    c["num_key_value_heads"] = json!(3);
    assert_mentions(&must_fail(parse(&c), "kv heads"), &["num_key_value_heads"]);
    let mut c = config_of("llama-gqa");
    c["head_dim"] = json!(7);
    assert_mentions(&must_fail(parse(&c), "odd head_dim"), &["head_dim"]);
    let mut c = config_of("llama-gqa");
    c["hidden_size"] = json!(0);
    assert_mentions(&must_fail(parse(&c), "zero hidden"), &["hidden_size"]);
    let mut c = config_of("llama-gqa");
    c.as_object_mut().unwrap().remove("vocab_size");
    assert_mentions(&must_fail(parse(&c), "no vocab"), &["vocab_size"]);
    let e = must_fail(ModelConfig::from_hf_json("{not json", "cfg.json"), "bad json");
    assert_mentions(&e, &["cfg.json"]);
}

#[test]
fn a_field_of_the_wrong_type_is_named_by_its_path() {
    let mut c = config_of("llama3-rope-scaling");
    c["rope_parameters"]["factor"] = json!("eight");
    let e = must_fail(parse(&c), "string factor");
    assert!(matches!(e, LanternError::Config { .. }), "{e:?}");
    assert_mentions(&e, &["rope_parameters.factor", "config.json"]);
    let mut c = config_of("llama-gqa");
    c["num_key_value_heads"] = json!(-2);
    assert_mentions(&must_fail(parse(&c), "negative kv heads"), &["num_key_value_heads"]);
    let mut c = config_of("llama-gqa");
    c["tie_word_embeddings"] = json!("yes");
    assert_mentions(&must_fail(parse(&c), "string bool"), &["tie_word_embeddings"]);
    let mut c = config_of("llama-gqa");
    c["hidden_size"] = json!(64.5);
    assert_mentions(&must_fail(parse(&c), "fractional size"), &["hidden_size"]);
    // Keys Lantern does not read are ignored, and null is absent.
    let mut c = config_of("llama-gqa");
    c["torch_dtype"] = json!("bfloat16");
    c["num_key_value_heads"] = json!(null);
    let p = parse(&c).unwrap();
    assert_eq!(p.num_kv_heads, p.num_heads);
}

#[test]
fn token_ids_accept_int_list_or_null() {
    let mut c = config_of("llama-gqa");
    assert_eq!(parse(&c).unwrap().eos_token_ids, Vec::<u32>::new());
    c["eos_token_id"] = json!(2);
    c["bos_token_id"] = json!(1);
    let p = parse(&c).unwrap();
    assert_eq!((p.eos_token_ids, p.bos_token_id), (vec![2], Some(1)));
    c["eos_token_id"] = json!([128001, 128008, 128009]);
    assert_eq!(parse(&c).unwrap().eos_token_ids, vec![128001, 128008, 128009]);
    c["eos_token_id"] = json!("x");
    assert_mentions(&must_fail(parse(&c), "string eos"), &["eos_token_id"]);
}

#[test]
fn qwen2_always_has_qkv_bias_and_default_head_dim() {
    let c = parse(&config_of("qwen2-bias")).unwrap();
    assert!(c.qkv_bias);
    assert_eq!(c.head_dim, 8);
    assert_eq!(c.rope_theta, 1_000_000.0);
}

#[test]
fn tensor_stored_in_two_shards_is_refused() {
    let d = copy_fixture("llama-mha-tied-sharded");
    // Shard 3 also stores the embedding that shard 1 holds.
    let p1 = d.path().join("model-00001-of-00003.safetensors");
    let p3 = d.path().join("model-00003-of-00003.safetensors");
    let mut t1 = std::collections::HashMap::new();
    lantern::model::hf::read_safetensors("1", &std::fs::read(&p1).unwrap(), &mut t1).unwrap();
    let mut t3 = std::collections::HashMap::new();
    lantern::model::hf::read_safetensors("3", &std::fs::read(&p3).unwrap(), &mut t3).unwrap();
    let dup = t1["model.embed_tokens.weight"].clone();
    t3.insert(dup.name.clone(), dup);
    let list: Vec<(String, String, Vec<usize>, Vec<u8>)> =
        t3.into_values().map(|t| (t.name, format!("{:?}", t.dtype), t.shape, t.data)).collect();
    let refs: Vec<(&str, &str, Vec<usize>, Vec<u8>)> =
        list.iter().map(|(n, dt, s, b)| (n.as_str(), dt.as_str(), s.clone(), b.clone())).collect();
    std::fs::write(&p3, safetensors_bytes(&refs)).unwrap();
    let e = must_fail(load_hf_folder(d.path()), "duplicate tensor");
    assert_mentions(&e, &["model.embed_tokens.weight", "model-00001-of-00003.safetensors", "model-00003-of-00003.safetensors"]);
}

/// Every E4M3 byte decodes as torch decodes it (bit for bit, -0 included); the two NaN
/// codes follow the formula to +-480, as the shaders' decode does (loading refuses them).
#[test]
fn e4m3_bytes_decode_as_torch_does() {
    let bytes = std::fs::read(tiny_dir().join("e4m3_values.f32")).unwrap();
    let want: Vec<f32> = bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    for b in 0..=255u8 {
        let got = lantern::quant::e4m3(b);
        if b & 0x7f == 0x7f {
            assert!(want[b as usize].is_nan());
            assert_eq!(got, if b & 0x80 != 0 { -480.0 } else { 480.0 });
        } else {
            assert_eq!(got.to_bits(), want[b as usize].to_bits(), "byte {b:#04x}: {got} vs {}", want[b as usize]);
        }
    }
}

/// The FP8 fixtures load with every projection packed as FP8 (scales folded in, the scale
/// tensors consumed), from a folder and from buffers; each element is E4M3(byte) times its
/// block's scale as stored (an f16 of scale x 256), partial blocks included.
#[test]
fn fp8_checkpoints_load_as_packed_fp8_with_their_block_scales() {
    use lantern::model::DType;
    use lantern::quant::QuantKind;
    for (name, suffix) in [("llama-gqa-fp8-block", "_scale_inv"), ("llama-gqa-fp8-channel", "_scale")] {
        let dir = tiny_dir().join(name);
        let w = load_hf_folder(&dir).unwrap_or_else(|e| panic!("{name}: {e}"));
        let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
        let from_buffers =
            load_hf_buffers(&std::fs::read_to_string(dir.join("config.json")).unwrap(), None, &[("model.safetensors", &bytes[..])])
                .unwrap();
        let mut raw = std::collections::HashMap::new();
        lantern::model::hf::read_safetensors("x", &bytes, &mut raw).unwrap();
        let mut packed = 0;
        for (n, t) in &w.tensors {
            assert!(!n.ends_with(&format!(".weight{suffix}")), "{name}: scale tensor {n} left over");
            let DType::Packed(f) = t.dtype else { continue };
            assert_eq!(f.kind, QuantKind::Fp8, "{name}: {n}");
            assert_eq!(from_buffers.tensors[n].data, t.data, "{name}: {n} differs from buffers");
            let codes = &raw[n];
            assert_eq!(codes.dtype, DType::F8_E4M3);
            let scale = &raw[&format!("{n}{suffix}")];
            let s = scale.to_f32();
            let [rows, k] = t.shape[..] else { unreachable!("packed tensors are 2-D") };
            let cols = if scale.shape.len() == 2 { scale.shape[1] } else { 1 };
            let br = if cols == 1 && s.len() == rows { 1 } else { 64 };
            let got = t.to_f32();
            for r in 0..rows {
                for c in 0..k {
                    let si = if cols == 1 { r / br } else { (r / 64) * cols + c / 64 };
                    let d = half::f16::from_f32(s[si] * 256.0).to_f32();
                    let want = lantern::quant::e4m3(codes.data[r * k + c]) / 256.0 * d;
                    assert_eq!(got[r * k + c], want, "{name}: {n}[{r}, {c}]");
                }
            }
            packed += 1;
        }
        assert_eq!(packed, 14, "{name}: 7 projections x 2 layers");
    }
}

/// FP8 tensors that cannot be read are refused naming the tensor and what was expected: a
/// NaN code, a scale that does not tile the weight, rows not a multiple of 32, a scale no
/// f16 holds, and E5M2 (not read).
#[test]
fn fp8_tensors_that_cannot_be_read_are_named() {
    const Q: &str = "model.layers.0.self_attn.q_proj.weight";
    let q = Q;
    type Edit = Box<dyn Fn(&mut Vec<(String, String, Vec<usize>, Vec<u8>)>)>;
    let cases: Vec<(&str, Edit, Vec<&str>)> = vec![
        ("NaN code", Box::new(|l| l.iter_mut().find(|t| t.0 == Q).unwrap().3[64 * 3 + 5] = 0xff), vec![q, "NaN", "row 3, column 5"]),
        (
            "scale of 3 x 3 blocks",
            Box::new(|l| {
                let s = l.iter_mut().find(|t| t.0.ends_with("q_proj.weight_scale_inv")).unwrap();
                (s.2, s.3) = (vec![3, 3], vec![0u8; 36]);
            }),
            vec!["q_proj.weight_scale_inv", "[3, 3]", "does not tile"],
        ),
        (
            "rows of 20",
            Box::new(|l| l.push(("model.extra.weight".into(), "F8_E4M3".into(), vec![2, 20], vec![0x38; 40]))),
            vec!["model.extra.weight", "multiple of 32"],
        ),
        (
            "huge scale",
            Box::new(|l| {
                let s = l.iter_mut().find(|t| t.0.ends_with("q_proj.weight_scale_inv")).unwrap();
                s.3[0..4].copy_from_slice(&1e6f32.to_le_bytes());
            }),
            vec!["q_proj.weight_scale_inv", "row 0, column 0", "outside"],
        ),
        ("E5M2", Box::new(|l| l.iter_mut().find(|t| t.0 == Q).unwrap().1 = "F8_E5M2".into()), vec![q, "F8_E5M2"]),
    ];
    for (what, edit, parts) in cases {
        let d = copy_fixture("llama-gqa-fp8-block");
        rewrite_tensors(&d, |l| edit(l));
        let e = must_fail(load_hf_folder(d.path()), what);
        assert_mentions(&e, &parts);
    }
}

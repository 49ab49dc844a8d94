//! Fuzz regressions on stable Rust: every input the fuzzers found a crash with
//! (`tests/fixtures/fuzz/<target>/`) and every seed (`fuzz/seeds/<target>/`) runs through the
//! fuzz targets' own entry points (`fuzz/src/lib.rs`, included below), which must return
//! without panicking (errors are fine). No GPU; `fuzz/README.md` says how to fuzz.
//!
//! `cargo test --release --test fuzz_regressions -- --ignored write_seeds` rewrites the
//! seeds from the synthetic models of `tests/common` and the GGUF headers of the fixtures.

mod common;

// The harness includes tests/common/gguf_writer.rs itself (it builds on its own in fuzz/), so
// this binary has that file twice: once through `common`, once through the harness.
#[allow(clippy::duplicate_mod)]
#[path = "../fuzz/src/lib.rs"]
mod harness;

use std::path::{Path, PathBuf};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The committed inputs of `target`: crash inputs and seeds, sorted. Fails if there are none
/// (a moved folder must not make the test pass vacuously).
fn inputs(target: &str) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for dir in [repo().join("tests/fixtures/fuzz").join(target), repo().join("fuzz/seeds").join(target)] {
        let Ok(entries) = std::fs::read_dir(&dir) else { continue };
        for e in entries.flatten() {
            if e.path().is_file() {
                out.push(e.path());
            }
        }
    }
    out.sort();
    assert!(!out.is_empty(), "no committed inputs for fuzz target {target}");
    out
}

/// Runs every input of `target` through `f`, naming the input that panics.
fn run_all(target: &str, f: fn(&[u8])) {
    for path in inputs(target) {
        let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        if std::panic::catch_unwind(|| f(&bytes)).is_err() {
            panic!("fuzz target {target} panics on {}", path.display());
        }
    }
}

#[test]
fn gguf_inputs_do_not_panic() {
    run_all("gguf", harness::gguf);
}

#[test]
fn safetensors_header_inputs_do_not_panic() {
    run_all("safetensors_header", harness::safetensors_header);
}

#[test]
fn gguf_tokenizer_inputs_do_not_panic() {
    run_all("gguf_tokenizer", harness::gguf_tokenizer);
}

/// `fuzz/` `gguf`: a header whose sizes multiply past u64 (`param-count-overflow.gguf`) made
/// `model::plan::param_count` overflow (a panic with overflow checks, a wrapped small count
/// without). The plan now saturates: absurd sizes fit nothing. (That file's 2^32-ish
/// block_count is now refused by `config_from_gguf` first, so the config is built here.)
#[test]
fn plan_of_an_absurd_config_saturates() {
    let mut c = lantern::model::ModelConfig::from_hf_json(&harness::tiny_config_json("llama"), "tiny").unwrap();
    c.hidden_size = u32::MAX as usize;
    c.intermediate_size = u32::MAX as usize;
    c.vocab_size = u32::MAX as usize;
    c.num_layers = lantern::model::config::MAX_LAYERS;
    let p = lantern::model::plan::param_count(&c);
    assert_eq!(p.total, u64::MAX, "{p:?}");
    let ws = lantern::model::plan::workspace_bytes(&c, 512, 1, 4096);
    let plan = lantern::model::plan::plan(&c, p.total, lantern::kv::plan::KvDtype::F16, 1, 4096, 16, ws, 64 << 20, 8 << 30, "test".into());
    assert!(!plan.fits && plan.pages == 0, "{plan:?}");
}

/// `fuzz/` `gguf`: a Phi-3 or Gemma 3 header declaring two billion layers looped over (Phi-3's
/// unfusing) or allocated (Gemma 3's attention pattern) that many before any tensor was
/// checked; a llama q_proj stored as a scalar panicked in the shape error. Now typed errors.
#[test]
fn corrupt_headers_are_typed_errors() {
    use lantern::model::gguf::{weights_from_gguf, GgufFile};
    for (name, expect) in [
        ("phi3-two-billion-layers.gguf", "more than the 65536 layers"),
        ("gemma3-two-billion-layers-header.gguf", "more than the 65536 layers"),
    ] {
        let bytes = std::fs::read(repo().join("tests/fixtures/fuzz/gguf").join(name)).unwrap();
        let g = GgufFile::parse(&bytes, name).unwrap();
        let e = weights_from_gguf(&g, name).unwrap_err().to_string();
        assert!(e.contains(expect), "{name}: {e}");
    }
    // The unminimised form of scalar-q-proj.gguf (which itself reaches the bug through the
    // streamed, prefix-parsed path).
    let mut w = common::tiny_model("llama", tiny_shape(), common::ggml::F32);
    let q = w.tensors.iter_mut().find(|t| t.name == "blk.0.attn_q.weight").unwrap();
    (q.dims, q.data) = (vec![], vec![0; 4]);
    let bytes = w.to_bytes();
    let e = weights_from_gguf(&GgufFile::parse(&bytes, "scalar.gguf").unwrap(), "scalar.gguf").unwrap_err().to_string();
    assert!(e.contains("blk.0.attn_q.weight"), "{e}");

    // Within the bound, but more layers than the file has tensors for.
    let mut w = common::tiny_model("llama", tiny_shape(), common::ggml::F32);
    w.set("llama.block_count", common::Meta::U32(3));
    let bytes = w.to_bytes();
    let e = weights_from_gguf(&GgufFile::parse(&bytes, "three.gguf").unwrap(), "three.gguf").unwrap_err().to_string();
    assert!(e.contains("llama.block_count") && e.contains("tensors for 1 layers"), "{e}");

    let bytes = std::fs::read(repo().join("tests/fixtures/fuzz/gguf_tokenizer/tojson-huge-indent.gguf")).unwrap();
    let g = GgufFile::parse(&bytes, "tojson-huge-indent.gguf").unwrap();
    let t = lantern::model::tokenizer::Tokenizer::from_gguf(&g).unwrap().chat_template().unwrap();
    let e = t.render(&[lantern::model::tokenizer::ChatMessage::user("hi")], true).unwrap_err().to_string();
    assert!(e.contains("indent"), "{e}");
}

/// The seeds load as they should: a fuzzer that starts from broken seeds explores little.
#[test]
fn seeds_are_valid_models() {
    use lantern::model::gguf::{weights_from_gguf, GgufFile};
    for name in ["tiny-llama-q8_0.gguf", "tiny-qwen2-f32.gguf"] {
        let bytes = std::fs::read(repo().join("fuzz/seeds/gguf").join(name)).unwrap();
        let g = GgufFile::parse(&bytes, name).unwrap();
        weights_from_gguf(&g, name).unwrap_or_else(|e| panic!("{name}: {e}"));
    }
    for arch in ["llama", "qwen2", "gemma3", "phi3"] {
        lantern::model::ModelConfig::from_hf_json(&harness::tiny_config_json(arch), arch).unwrap_or_else(|e| panic!("{arch}: {e}"));
    }
    for (name, arch) in [("tiny-llama-q8.safetensors", "llama"), ("tiny-qwen2-f32.safetensors", "qwen2")] {
        let bytes = std::fs::read(repo().join("fuzz/seeds/safetensors_header").join(name)).unwrap();
        let config = harness::tiny_config_json(arch);
        lantern::model::hf::load_hf_buffers(&config, None, &[("model.safetensors", &bytes)]).unwrap_or_else(|e| panic!("{name}: {e}"));
    }
}

#[test]
fn openai_request_inputs_do_not_panic() {
    run_all("openai_request", harness::openai_request);
}

/// Every OpenAI seed is a valid request for its endpoint.
#[test]
fn openai_seeds_are_valid_requests() {
    for path in std::fs::read_dir(repo().join("fuzz/seeds/openai_request")).unwrap().flatten() {
        let bytes = std::fs::read(path.path()).unwrap();
        let [chat, completion] = harness::parse_openai(&bytes);
        let name = path.file_name().to_string_lossy().to_string();
        let r = match name.split('-').next() {
            Some("chat") => chat,
            Some("completion") => completion,
            _ => continue,
        };
        assert!(r.is_ok(), "{name}: {r:?}");
    }
}

/// Every tokenizer seed builds a tokenizer.
#[test]
fn tokenizer_seeds_build() {
    for path in std::fs::read_dir(repo().join("fuzz/seeds/gguf_tokenizer")).unwrap().flatten() {
        let bytes = std::fs::read(path.path()).unwrap();
        assert!(harness::tokenizer_from_input(&bytes).is_some(), "{} builds no tokenizer", path.path().display());
    }
}

/// The tiny shape of `fuzz/src/lib.rs` for `tests/common::tiny_model`.
fn tiny_shape() -> common::TinyShape {
    use harness::tiny::*;
    common::TinyShape {
        hidden: HIDDEN as u64,
        heads: HEADS as u64,
        kv_heads: KV_HEADS as u64,
        head_dim: HEAD_DIM as u64,
        ffn: FFN as u64,
        vocab: VOCAB as u64,
        layers: LAYERS as u64,
    }
}

/// Encodes one metadata value as GGUF does (for re-writing fixture headers).
fn encode_value(v: &lantern::model::gguf::GgufValue, out: &mut Vec<u8>) {
    use lantern::model::gguf::{GgufArray as A, GgufValue as V};
    fn put_str(out: &mut Vec<u8>, s: &str) {
        out.extend((s.len() as u64).to_le_bytes());
        out.extend(s.as_bytes());
    }
    fn array(a: &A, out: &mut Vec<u8>) {
        let id = |t: lantern::model::gguf::GgufValueType| (0..13).find(|&i| lantern::model::gguf::GgufValueType::from_id(i) == Some(t));
        out.extend(id(a.elem_type()).unwrap().to_le_bytes());
        out.extend((a.len() as u64).to_le_bytes());
        match a {
            A::U8(v) => out.extend(v),
            A::I8(v) => v.iter().for_each(|x| out.extend(x.to_le_bytes())),
            A::U16(v) => v.iter().for_each(|x| out.extend(x.to_le_bytes())),
            A::I16(v) => v.iter().for_each(|x| out.extend(x.to_le_bytes())),
            A::U32(v) => v.iter().for_each(|x| out.extend(x.to_le_bytes())),
            A::I32(v) => v.iter().for_each(|x| out.extend(x.to_le_bytes())),
            A::F32(v) => v.iter().for_each(|x| out.extend(x.to_le_bytes())),
            A::Bool(v) => v.iter().for_each(|&x| out.push(x as u8)),
            A::String(v) => v.iter().for_each(|s| put_str(out, s)),
            A::Array(v) => v.iter().for_each(|x| array(x, out)),
            A::U64(v) => v.iter().for_each(|x| out.extend(x.to_le_bytes())),
            A::I64(v) => v.iter().for_each(|x| out.extend(x.to_le_bytes())),
            A::F64(v) => v.iter().for_each(|x| out.extend(x.to_le_bytes())),
        }
    }
    match v {
        V::U8(x) => out.push(*x),
        V::I8(x) => out.extend(x.to_le_bytes()),
        V::U16(x) => out.extend(x.to_le_bytes()),
        V::I16(x) => out.extend(x.to_le_bytes()),
        V::U32(x) => out.extend(x.to_le_bytes()),
        V::I32(x) => out.extend(x.to_le_bytes()),
        V::F32(x) => out.extend(x.to_le_bytes()),
        V::Bool(x) => out.push(*x as u8),
        V::String(s) => put_str(out, s),
        V::Array(a) => array(a, out),
        V::U64(x) => out.extend(x.to_le_bytes()),
        V::I64(x) => out.extend(x.to_le_bytes()),
        V::F64(x) => out.extend(x.to_le_bytes()),
    }
}

/// The metadata of a real (llama.cpp-converted) fixture GGUF, re-written with no tensors.
fn metadata_only(path: &Path) -> Vec<u8> {
    use lantern::model::gguf::GgufFile;
    let bytes = std::fs::read(path).unwrap();
    let g = GgufFile::parse(&bytes, path.display().to_string()).unwrap();
    let mut w = common::GgufWriter::default();
    for (k, v) in g.metadata() {
        let mut enc = Vec::new();
        encode_value(v, &mut enc);
        let id = (0..13).find(|&i| lantern::model::gguf::GgufValueType::from_id(i) == Some(v.value_type())).unwrap();
        w.kv(k, common::Meta::Raw(id, enc));
    }
    w.to_bytes()
}

/// Rewrites `fuzz/seeds/`. Run by hand (`--ignored`) when the formats change.
#[test]
#[ignore = "writes fuzz/seeds; run by hand"]
fn write_seeds() {
    use common::{ggml, tiny_model};
    let seeds = repo().join("fuzz/seeds");
    let put = |target: &str, name: &str, bytes: &[u8]| {
        let dir = seeds.join(target);
        std::fs::create_dir_all(&dir).unwrap();
        assert!(bytes.len() <= 65536, "{name}: seeds must fit the fuzzers' max_len");
        std::fs::write(dir.join(name), bytes).unwrap();
    };
    let s = tiny_shape();
    let llama = tiny_model("llama", s, ggml::Q8_0).to_bytes();
    let qwen2 = tiny_model("qwen2", s, ggml::F32).to_bytes();
    put("gguf", "tiny-llama-q8_0.gguf", &llama);
    put("gguf", "tiny-qwen2-f32.gguf", &qwen2);

    // One tensor of each loadable GGUF type, from real llama.cpp blocks.
    let mut w = common::GgufWriter::default();
    w.kv("general.architecture", common::Meta::Str("llama".into()));
    let types = [
        ("Q4_0", 2),
        ("Q4_1", 3),
        ("Q5_0", 6),
        ("Q5_1", 7),
        ("Q8_0", 8),
        ("Q2_K", 10),
        ("Q3_K", 11),
        ("Q4_K", 12),
        ("Q5_K", 13),
        ("Q6_K", 14),
        ("IQ4_NL", 20),
        ("IQ4_XS", 23),
    ];
    for (name, id) in types {
        let blocks = std::fs::read(common::fixtures_dir().join(format!("ggml-types/{name}.blocks.bin"))).unwrap();
        let ty = lantern::model::gguf::GgmlType::from_id(id).unwrap();
        let (be, bb) = ty.block();
        let n = blocks.len() as u64 / bb * be;
        w.tensor(&format!("t.{name}"), &[256, n / 256], id, blocks);
    }
    put("gguf", "all-types.gguf", &w.to_bytes());
    for arch in ["phi3-longrope", "gemma3"] {
        let header = metadata_only(&common::fixtures_dir().join(format!("tiny-archs/{arch}/model.gguf")));
        put("gguf", &format!("{arch}-metadata.gguf"), &header);
        put("gguf_tokenizer", &format!("{arch}-metadata.gguf"), &header);
    }

    // Safetensors: Lantern's own writer on the tiny models (q/k packed as q8 for Llama).
    for (name, bytes) in [("tiny-llama-q8.safetensors", &llama), ("tiny-qwen2-f32.safetensors", &qwen2)] {
        let g = lantern::model::gguf::GgufFile::parse(bytes, name).unwrap();
        let weights = lantern::model::gguf::weights_from_gguf(&g, name).unwrap();
        let st = lantern::quant::safetensors::to_safetensors_bytes(&weights, &Default::default()).unwrap();
        put("safetensors_header", name, &st);
    }

    // OpenAI request bodies: what clients send (both endpoints read each).
    for (name, body) in [
        (
            "chat",
            r#"{"model":"tiny","messages":[{"role":"system","content":"be brief"},{"role":"user","content":"Hi there"}],"max_tokens":8,"temperature":0.7,"top_p":0.9,"seed":3,"stop":["\n\n"],"stream":true,"stream_options":{"include_usage":true}}"#,
        ),
        (
            "chat-json-schema",
            r#"{"model":"tiny","messages":[{"role":"user","content":"a person"}],"max_tokens":32,"response_format":{"type":"json_schema","json_schema":{"name":"p","schema":{"type":"object","properties":{"name":{"type":"string"},"age":{"type":"integer","minimum":0,"maximum":150},"tags":{"type":"array","items":{"enum":["a","b"]}}},"required":["name","age"]}}}}"#,
        ),
        (
            "chat-json-object",
            r#"{"model":"tiny","messages":[{"role":"user","content":"json please"}],"response_format":{"type":"json_object"},"n":2}"#,
        ),
        (
            // A forced call after an earlier call and its tool answer.
            "tools-chat",
            r#"{"model":"tiny","messages":[{"role":"user","content":"weather in Paris?"},{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"get_weather","arguments":"{\"city\":\"Paris\"}"}}]},{"role":"tool","tool_call_id":"c1","content":"sunny"}],"tools":[{"type":"function","function":{"name":"get_weather","description":"weather","parameters":{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}}}],"tool_choice":{"type":"function","function":{"name":"get_weather"}}}"#,
        ),
        (
            "chat-parts",
            r#"{"model":"tiny","messages":[{"role":"user","content":[{"type":"text","text":"part one"},{"type":"text","text":" two"}]}],"frequency_penalty":0,"presence_penalty":0,"logit_bias":{},"speculative":{"drafter":"lookup","draft_tokens":4}}"#,
        ),
        ("completion", r#"{"model":"tiny","prompt":"Once upon a time","max_tokens":16,"echo":false,"stop":"END","top_k":40}"#),
        (
            "completion-tokens",
            r#"{"model":"tiny","prompt":[72,101,108,108,111],"max_tokens":4,"n":1,"best_of":1,"response_format":{"type":"json_schema","json_schema":{"name":"w","schema":{"type":"string","pattern":"^[a-z]+$"}}}}"#,
        ),
    ] {
        put("openai_request", &format!("{name}.json"), body.as_bytes());
    }

    // Tokenizer recipes (see `TokenizerRecipe::read`): for each (model, pre-tokenizer) byte
    // pair, the first pseudo-random recipe that builds a tokenizer which encodes its text.
    let mut rng = common::random::Rng(0x2545_f491_4f6c_dd1d);
    for (name, model, pre) in [("gpt2", 0u8, 0u8), ("gpt2-qwen2", 0, 8), ("gpt2-llama-bpe", 0, 6), ("gpt2-smollm", 0, 3), ("llama", 1, 11)]
    {
        let recipe = (0..10_000)
            .find_map(|_| {
                let mut bytes = vec![model, pre];
                bytes.extend((0..120).map(|_| (rng.next_u64() >> 24) as u8));
                bytes.extend(b"Hello world! 123 <|im_end|> caf\xc3\xa9");
                let (tok, text, _) = harness::tokenizer_from_input(&bytes)?;
                (!tok.encode(&text).ok()?.is_empty()).then_some(bytes)
            })
            .unwrap_or_else(|| panic!("no {name} recipe builds"));
        put("gguf_tokenizer", &format!("recipe-{name}.bin"), &recipe);
    }
}

/// `fuzz/` `gguf_tokenizer`: minijinja 2 panicked (index out of bounds) slicing an empty string
/// or list backwards, `''[::-1]` or `messages[::-1]` (Qwen3's template walks `messages[::-1]`),
/// from a chat template in the model file (`minijinja-empty-reverse-slice.bin`). Fixed upstream
/// in minijinja 3, which Lantern now uses.
#[test]
fn empty_reverse_slices_render() {
    use lantern::model::tokenizer::{ChatMessage, ChatTemplate};
    let t = ChatTemplate::new("[{{ messages[::-1] | length }}{{ ''[::-1] }}]", None, None).unwrap();
    assert_eq!(t.render(&[], false).unwrap(), "[0]");
    let t = ChatTemplate::new("[{{ messages[0].content[::-1] }}]", None, None).unwrap();
    assert_eq!(t.render(&[ChatMessage::user("")], false).unwrap(), "[]");
    assert_eq!(t.render(&[ChatMessage::user("abc")], false).unwrap(), "[cba]");
}

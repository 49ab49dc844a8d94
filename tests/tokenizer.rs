//! Tokenizer and chat template: SmolLM2's GGUF tokenizer against the transformers fixtures
//! (ids, decode, chat prompts), streaming decode, a synthetic SentencePiece (`llama`) GGUF
//! vocabulary, the Hugging Face `tokenizer.json` path, and template features.

mod common;

use std::sync::OnceLock;

use common::{GgufWriter, Meta};
use lantern::model::gguf::{GgufFile, GgufMmap};
use lantern::model::tokenizer::{ChatMessage, ChatTemplate, Tokenizer, TokenizerError};
use serde_json::Value;

/// SmolLM2's tokenizer, rebuilt from the GGUF once per test binary.
fn smollm2() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| {
        let map = GgufMmap::open(common::smollm2_gguf()).expect("map SmolLM2 GGUF");
        let gguf = map.parse().expect("parse SmolLM2 GGUF");
        Tokenizer::from_gguf(&gguf).expect("build tokenizer")
    })
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

fn stream_decode(tok: &Tokenizer, ids: &[u32]) -> String {
    let mut dec = tok.stream_decoder();
    let mut out = String::new();
    for &id in ids {
        if let Some(piece) = dec.step(tok, id).unwrap() {
            assert!(!piece.is_empty());
            out.push_str(&piece);
        }
    }
    if let Some(piece) = dec.finish(tok).unwrap() {
        out.push_str(&piece);
    }
    out
}

#[test]
fn special_tokens_and_flags() {
    let tok = smollm2();
    assert_eq!(tok.bos_id(), Some(1));
    assert_eq!(tok.eos_id(), Some(2));
    assert_eq!(tok.bos_token(), Some("<|im_start|>"));
    assert_eq!(tok.eos_token(), Some("<|im_end|>"));
    assert!(!tok.add_bos());
    assert_eq!(tok.vocab_size(), 49152);
    assert_eq!(tok.token_to_id("<|endoftext|>"), Some(0));
    assert_eq!(tok.id_to_token(216).as_deref(), Some("Ġ"));
}

#[test]
fn tokenize_fixture_ids_and_decode() {
    let tok = smollm2();
    let fx = common::fixture_json("smollm2/tokenize.json");
    let cases = fx["cases"].as_array().unwrap();
    assert!(cases.len() >= 20);
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let text = case["text"].as_str().unwrap();
        let want = ids(&case["ids"]);
        assert_eq!(tok.encode(text).unwrap(), want, "case {name}: ids");
        assert_eq!(tok.encode_with(text, false).unwrap(), ids(&case["ids_add_special_tokens_false"]), "case {name}");
        assert_eq!(tok.decode(&want).unwrap(), case["decoded"].as_str().unwrap(), "case {name}: decode");
        assert_eq!(
            tok.decode_with(&want, true).unwrap(),
            case["decoded_skip_special_tokens"].as_str().unwrap(),
            "case {name}: decode skipping specials"
        );
        let tokens: Vec<String> = want.iter().map(|&i| tok.id_to_token(i).unwrap()).collect();
        let want_tokens: Vec<&str> = case["tokens"].as_array().unwrap().iter().map(|t| t.as_str().unwrap()).collect();
        assert_eq!(tokens, want_tokens, "case {name}: token strings");
        assert_eq!(stream_decode(tok, &want), case["decoded"].as_str().unwrap(), "case {name}: stream");
    }
}

#[test]
fn chat_cases_render_and_encode() {
    let tok = smollm2();
    let template = tok.chat_template().unwrap();
    let cases = common::fixture_json("smollm2/cases.json");
    let mut n_chat = 0;
    for case in cases.as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let prompt_text = case["prompt_text"].as_str().unwrap();
        if case["chat"].as_bool().unwrap() {
            n_chat += 1;
            let rendered = template.render(&[ChatMessage::user(case["prompt"].as_str().unwrap())], true).unwrap();
            assert_eq!(rendered, prompt_text, "case {name}: rendered prompt");
            assert_eq!(tok.encode_chat(&rendered).unwrap(), ids(&case["input_ids"]), "case {name}: chat ids");
        }
        assert_eq!(tok.encode(prompt_text).unwrap(), ids(&case["input_ids"]), "case {name}: ids");
    }
    assert!(n_chat >= 2);
}

#[test]
fn streaming_decode_matches_full_decode() {
    let tok = smollm2();
    let cases = common::fixture_json("smollm2/cases.json");
    for case in cases.as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let greedy = ids(&case["greedy_ids"]);
        let full = tok.decode(&greedy).unwrap();
        assert_eq!(full, case["greedy_text"].as_str().unwrap(), "case {name}: greedy_text");
        assert_eq!(stream_decode(tok, &greedy), full, "case {name}: streamed greedy");
        let prompt = ids(&case["input_ids"]);
        assert_eq!(stream_decode(tok, &prompt), tok.decode(&prompt).unwrap(), "case {name}: streamed prompt");
    }
}

#[test]
fn streaming_waits_for_complete_characters() {
    let tok = smollm2();
    // "🎉" is several byte-level tokens; nothing may be emitted until the last one.
    let ids = tok.encode("a🎉").unwrap();
    assert!(ids.len() >= 3, "{ids:?}");
    let mut dec = tok.stream_decoder();
    let pieces: Vec<Option<String>> = ids.iter().map(|&i| dec.step(tok, i).unwrap()).collect();
    assert_eq!(pieces[0].as_deref(), Some("a"));
    assert!(pieces[1..ids.len() - 1].iter().all(Option::is_none), "{pieces:?}");
    assert_eq!(pieces.last().unwrap().as_deref(), Some("🎉"));
    // An unfinished character is flushed as U+FFFD at the end.
    let mut dec = tok.stream_decoder();
    assert_eq!(dec.step(tok, ids[1]).unwrap(), None);
    assert_eq!(dec.finish(tok).unwrap().as_deref(), Some("\u{FFFD}"));
}

#[test]
fn hf_files_roundtrip() {
    let tok = smollm2();
    let json = tok.inner().to_string(false).unwrap();
    let config = serde_json::json!({
        "bos_token": "<|im_start|>",
        "eos_token": {"content": "<|im_end|>", "special": true},
        "chat_template": tok.chat_template_source().unwrap(),
    });
    let hf = Tokenizer::from_hf_files(json.as_bytes(), Some(config.to_string().as_bytes())).unwrap();
    assert_eq!(hf.eos_id(), Some(2));
    assert_eq!(hf.bos_id(), Some(1));
    let text = "<|im_start|>user\nHi there 123 🎉<|im_end|>\n";
    assert_eq!(hf.encode(text).unwrap(), tok.encode(text).unwrap());
    assert!(hf.chat_template().is_ok());

    // add_bos_token = true in tokenizer_config installs a BOS post-processor.
    let config = serde_json::json!({"bos_token": "<|im_start|>", "add_bos_token": true});
    let hf = Tokenizer::from_hf_files(json.as_bytes(), Some(config.to_string().as_bytes())).unwrap();
    assert!(hf.add_bos());
    assert_eq!(hf.encode("hello").unwrap(), vec![1, 28120]);
    assert_eq!(hf.encode_chat("<|im_start|>hello").unwrap(), vec![1, 28120]);
    assert_eq!(hf.encode_chat("hello").unwrap(), vec![1, 28120]);

    let e = Tokenizer::from_hf_files(b"{not json", None).unwrap_err();
    assert!(matches!(e, TokenizerError::InvalidJson { .. }), "{e}");
    assert!(e.to_string().contains("tokenizer.json"));
    assert!(matches!(Tokenizer::from_hf_files(json.as_bytes(), None).unwrap().chat_template(), Err(TokenizerError::NoChatTemplate { .. })));
}

/// A tiny SentencePiece (`tokenizer.ggml.model = llama`) vocabulary, as in TinyLlama/Llama 2
/// GGUFs: control tokens, 256 byte tokens, scored pieces.
fn spm_gguf() -> Vec<u8> {
    let mut tokens: Vec<String> = vec!["<unk>".into(), "<s>".into(), "</s>".into()];
    let mut types = vec![2, 3, 3];
    let mut scores = vec![0.0f32, 0.0, 0.0];
    for b in 0..=255u8 {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(6);
        scores.push(0.0);
    }
    // Pieces with scores: longer merges score higher, as SentencePiece BPE vocabularies do.
    for (piece, score) in [
        ("▁", -1.0),
        ("h", -2.0),
        ("e", -2.0),
        ("l", -2.0),
        ("o", -2.0),
        ("w", -2.0),
        ("r", -2.0),
        ("d", -2.0),
        ("ll", -3.0),
        ("▁h", -4.0),
        ("▁he", -5.0),
        ("llo", -6.0),
        ("▁hello", -7.0),
        ("▁w", -8.0),
        ("or", -9.0),
        ("▁wor", -10.0),
        ("ld", -11.0),
        ("▁world", -12.0),
    ] {
        tokens.push(piece.into());
        types.push(1);
        scores.push(score);
    }
    let mut w = GgufWriter::default();
    w.kv("general.architecture", Meta::Str("llama".into()))
        .kv("tokenizer.ggml.model", Meta::Str("llama".into()))
        .kv("tokenizer.ggml.tokens", Meta::StrArray(tokens))
        .kv("tokenizer.ggml.scores", Meta::F32Array(scores))
        .kv("tokenizer.ggml.token_type", Meta::I32Array(types))
        .kv("tokenizer.ggml.bos_token_id", Meta::U32(1))
        .kv("tokenizer.ggml.eos_token_id", Meta::U32(2))
        .kv("tokenizer.ggml.unknown_token_id", Meta::U32(0))
        .kv(
            "tokenizer.chat_template",
            Meta::Str("{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}{{ eos_token }}{% endfor %}".into()),
        );
    w.to_bytes()
}

#[test]
fn sentencepiece_gguf_vocabulary() {
    let bytes = spm_gguf();
    let g = GgufFile::parse(&bytes, "spm.gguf").unwrap();
    let tok = Tokenizer::from_gguf(&g).unwrap();
    let id = |t: &str| tok.token_to_id(t).unwrap();
    assert!(tok.add_bos(), "SentencePiece vocabularies add BOS by default");
    assert_eq!(tok.encode("hello world").unwrap(), vec![1, id("▁hello"), id("▁world")]);
    assert_eq!(tok.decode(&tok.encode("hello world").unwrap()).unwrap(), "<s> hello world");
    assert_eq!(tok.decode_with(&tok.encode("hello world").unwrap(), true).unwrap(), "hello world");
    // Byte fallback for characters outside the vocabulary: é = C3 A9.
    let ids = tok.encode_with("hé", false).unwrap();
    assert_eq!(ids, vec![id("▁h"), id("<0xC3>"), id("<0xA9>")]);
    assert_eq!(tok.decode(&ids).unwrap(), "hé");
    assert_eq!(stream_decode(&tok, &ids), "hé");
    // Special tokens are recognised inside text.
    assert_eq!(tok.encode_with("hello</s>", false).unwrap(), vec![id("▁hello"), 2]);
    // The streamed text of a multi-word sequence equals the full decode (leading space stripped once).
    let ids = tok.encode_with("hello world hello", false).unwrap();
    assert_eq!(stream_decode(&tok, &ids), "hello world hello");
    let t = tok.chat_template().unwrap();
    assert_eq!(t.render(&[ChatMessage::user("hi")], false).unwrap(), "<s>[user] hi</s>");
    let rendered = t.render(&[ChatMessage::user("hello")], false).unwrap();
    assert_eq!(tok.encode_chat(&rendered).unwrap()[0], 1);
    assert_eq!(tok.encode_chat(&rendered).unwrap().iter().filter(|&&i| i == 1).count(), 1, "no double BOS");
}

#[test]
fn gguf_tokenizer_errors() {
    let mut w = GgufWriter::default();
    w.kv("tokenizer.ggml.model", Meta::Str("bert".into())).kv("tokenizer.ggml.tokens", Meta::StrArray(vec!["a".into()]));
    let bytes = w.to_bytes();
    let e = Tokenizer::from_gguf(&GgufFile::parse(&bytes, "b.gguf").unwrap()).unwrap_err();
    assert!(matches!(&e, TokenizerError::UnsupportedModel { model, .. } if model == "bert"), "{e}");

    let mut w = GgufWriter::default();
    w.kv("tokenizer.ggml.model", Meta::Str("gpt2".into()))
        .kv("tokenizer.ggml.pre", Meta::Str("mystery".into()))
        .kv("tokenizer.ggml.tokens", Meta::StrArray(vec!["a".into(), "b".into(), "ab".into()]))
        .kv("tokenizer.ggml.merges", Meta::StrArray(vec!["a b".into()]));
    let bytes = w.to_bytes();
    let e = Tokenizer::from_gguf(&GgufFile::parse(&bytes, "p.gguf").unwrap()).unwrap_err();
    assert!(e.to_string().contains("mystery") && e.to_string().contains("p.gguf"), "{e}");

    let mut w = GgufWriter::default();
    w.kv("tokenizer.ggml.model", Meta::Str("gpt2".into()))
        .kv("tokenizer.ggml.tokens", Meta::StrArray(vec!["a".into()]))
        .kv("tokenizer.ggml.bos_token_id", Meta::U32(7));
    let bytes = w.to_bytes();
    let e = Tokenizer::from_gguf(&GgufFile::parse(&bytes, "i.gguf").unwrap()).unwrap_err();
    assert!(e.to_string().contains("bos_token_id"), "{e}");

    let mut w = GgufWriter::default();
    w.kv("tokenizer.ggml.tokens", Meta::StrArray(vec!["a".into()]));
    let bytes = w.to_bytes();
    let e = Tokenizer::from_gguf(&GgufFile::parse(&bytes, "m.gguf").unwrap()).unwrap_err();
    assert!(e.to_string().contains("tokenizer.ggml.model"), "{e}");
}

#[test]
fn template_features() {
    // raise_exception surfaces as a typed error carrying the message.
    let t = ChatTemplate::new(
        "{% if messages[0].role != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}ok",
        None,
        None,
    )
    .unwrap();
    let e = t.render(&[ChatMessage::system("x")], false).unwrap_err();
    assert!(matches!(&e, TokenizerError::TemplateRender { reason } if reason.contains("first message must be from the user")), "{e}");
    assert_eq!(t.render(&[ChatMessage::user("x")], false).unwrap(), "ok");

    // Python string methods, trim_blocks/lstrip_blocks, tojson like Python's json.dumps.
    let t = ChatTemplate::new(
        "{% for m in messages %}\n    {% if m.content.startswith('  ') %}{{ m.content.strip().upper() }}{% else %}{{ m.content | tojson }}{% endif %}\n{% endfor %}\n{% if add_generation_prompt %}<gen>{% endif %}",
        Some("<s>"),
        Some("</s>"),
    )
    .unwrap();
    let out = t.render(&[ChatMessage::user("  shout  "), ChatMessage::assistant("a \"q\" é\n")], true).unwrap();
    assert_eq!(out, "SHOUT\"a \\\"q\\\" é\\n\"<gen>");

    let e = ChatTemplate::new("{% if %}", None, None).unwrap_err();
    assert!(matches!(e, TokenizerError::TemplateSyntax { .. }), "{e}");
    let t = ChatTemplate::new("{{ x | tojson }}|{{ y | tojson(indent=2) }}", None, None).unwrap();
    let out = t
        .render_with(
            minijinja::Value::from(Vec::<i32>::new()),
            false,
            minijinja::context! { x => minijinja::value::Serde(serde_json::json!({"a": [1, 2], "b": null})), y => vec![1] },
        )
        .unwrap();
    assert_eq!(out, "{\"a\": [1, 2], \"b\": null}|[\n  1\n]");
}

/// A Hugging Face folder whose chat template sits in `chat_template.jinja` (where
/// transformers 4.43+ saves it) gets that template, over `tokenizer_config.json`'s.
#[test]
fn folder_chat_template_jinja_wins_over_tokenizer_config() {
    let tok = smollm2();
    let dir = std::env::temp_dir().join(format!("lantern-jinja-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let fixture = common::tiny_dir().join("llama-gqa");
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture.join(f), dir.join(f)).unwrap();
    }
    std::fs::write(dir.join("tokenizer.json"), tok.inner().to_string(false).unwrap()).unwrap();
    let config = serde_json::json!({"eos_token": "<|im_end|>", "chat_template": "from the config"});
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    let load = || lantern::model::load::load_path(&dir).unwrap().tokenizer.unwrap();
    assert_eq!(load().chat_template_source(), Some("from the config"));
    std::fs::write(dir.join("chat_template.jinja"), tok.chat_template_source().unwrap()).unwrap();
    let hf = load();
    assert_eq!(hf.chat_template_source(), tok.chat_template_source());
    let msgs = [ChatMessage::new("user", "Hi")];
    assert_eq!(hf.chat_template().unwrap().render(&msgs, true).unwrap(), tok.chat_template().unwrap().render(&msgs, true).unwrap());
    std::fs::remove_dir_all(&dir).unwrap();
}

//! Constrained decoding (llguidance; `lantern::engine::constraint`, the GPU logit mask) on
//! SmolLM2-135M: JSON-schema outputs parse and validate against their schema (objects,
//! arrays, enums, nesting, bounded integers), greedy and seeded sampling (GPU top-k and the
//! logits path), through `generate` and through the `Engine` beside plain requests in one
//! batch; regex and Lark constraints; invalid schemas and grammars are typed errors.

mod common;

use std::sync::{Arc, OnceLock};

use lantern::engine::generate::{default_stop_ids, generate};
use lantern::engine::{Constraint, Engine, EngineOptions, Event, FinishReason, GenerateRequest, Generation, Guide, SamplingParams};
use lantern::model::forward::{GpuModel, ModelOptions};
use lantern::model::tokenizer::{ChatMessage, Tokenizer};
use lantern::model::ModelWeights;
use lantern::LanternError;
use serde_json::{json, Value};

fn loaded() -> &'static (ModelWeights, Arc<Tokenizer>) {
    static L: OnceLock<(ModelWeights, Arc<Tokenizer>)> = OnceLock::new();
    L.get_or_init(|| {
        let l = lantern::model::load::load_path(&common::smollm2_gguf()).expect("SmolLM2 GGUF");
        (l.weights, Arc::new(l.tokenizer.expect("tokenizer")))
    })
}

fn model() -> GpuModel {
    let opts = ModelOptions { context: Some(384), max_seqs: 4, ..Default::default() };
    pollster::block_on(GpuModel::load(common::gpu(), &loaded().0, opts)).expect("upload SmolLM2")
}

fn request(user: &str, max_tokens: usize, sampling: SamplingParams, constraint: Option<Constraint>) -> GenerateRequest {
    let (w, tok) = loaded();
    let text = tok.chat_template().expect("template").render(&[ChatMessage::user(user)], true).expect("render");
    GenerateRequest {
        prompt_ids: tok.encode_chat(&text).expect("encode"),
        max_tokens,
        sampling,
        stop_ids: default_stop_ids(&w.config.eos_token_ids, tok),
        constraint,
        ..Default::default()
    }
}

/// Objects, arrays, enums, nesting and integers with bounds.
fn person_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 18, "maximum": 99},
            "role": {"enum": ["admin", "user", "guest"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 10}, "zip": {"type": "integer", "minimum": 1000, "maximum": 9999}},
                "required": ["city", "zip"],
                "additionalProperties": false
            }
        },
        "required": ["name", "age", "role", "tags", "address"],
        "additionalProperties": false
    })
}

/// The output parses as JSON and validates against `schema` (the `jsonschema` crate).
fn check_valid(what: &str, schema: &Value, g: &Generation) -> Value {
    assert_eq!(g.finish_reason, FinishReason::Stop, "{what}: the grammar should finish within the budget: {:?}", g.text);
    let v: Value = serde_json::from_str(&g.text).unwrap_or_else(|e| panic!("{what}: output is not JSON ({e}): {:?}", g.text));
    let validator = jsonschema::validator_for(schema).expect("a valid schema");
    let errors: Vec<String> = validator.iter_errors(&v).map(|e| e.to_string()).collect();
    assert!(errors.is_empty(), "{what}: {v} does not fit the schema: {errors:?}");
    v
}

#[test]
fn json_schema_outputs_validate_greedy_and_sampled() {
    let mut m = model();
    let tok = &loaded().1;
    let schema = person_schema();
    let cases = [
        ("greedy", SamplingParams::default()),
        ("top-k sampled", SamplingParams { temperature: 0.9, top_k: 40, top_p: 1.0, seed: 7 }),
        ("full-row sampled", SamplingParams { temperature: 1.0, top_k: 0, top_p: 0.95, seed: 11 }),
    ];
    for (what, sampling) in cases {
        let req = request("Describe a user of a web site as JSON.", 90, sampling, Some(Constraint::JsonSchema(schema.clone())));
        let g = pollster::block_on(generate(&mut m, tok, &req, |_| true)).expect("generate");
        let v = check_valid(what, &schema, &g);
        eprintln!("{what}: {v}");
    }
    // Seeded sampling is reproducible under the mask.
    let req = request("Describe a user.", 90, cases[1].1, Some(Constraint::JsonSchema(schema.clone())));
    let a = pollster::block_on(generate(&mut m, tok, &req, |_| true)).expect("generate");
    let b = pollster::block_on(generate(&mut m, tok, &req, |_| true)).expect("generate");
    assert_eq!(a.output_ids, b.output_ids, "same seed, same constrained output");
}

#[test]
fn json_object_regex_and_lark_constraints() {
    let mut m = model();
    let tok = &loaded().1;
    let g = pollster::block_on(generate(
        &mut m,
        tok,
        &request("Say hi as JSON.", 40, SamplingParams::default(), Some(Constraint::JsonObject)),
        |_| true,
    ))
    .expect("generate");
    // Any object; it may be cut by the token limit, but what there is must begin one.
    assert!(g.text.starts_with('{'), "{:?}", g.text);
    if g.finish_reason == FinishReason::Stop {
        assert!(serde_json::from_str::<Value>(&g.text).expect("JSON").is_object(), "{:?}", g.text);
    }
    let re = r"[0-9]{3}-[a-z]{2,4}";
    let g = pollster::block_on(generate(
        &mut m,
        tok,
        &request("Give a code.", 20, SamplingParams::default(), Some(Constraint::Regex(re.into()))),
        |_| true,
    ))
    .expect("generate");
    assert_eq!(g.finish_reason, FinishReason::Stop, "{:?}", g.text);
    let ok = g.text.len() >= 6 && g.text[..3].bytes().all(|b| b.is_ascii_digit()) && &g.text[3..4] == "-";
    assert!(ok && g.text[4..].bytes().all(|b| b.is_ascii_lowercase()) && (2..=4).contains(&(g.text.len() - 4)), "{:?}", g.text);
    let lark = "start: \"yes\" | \"no\"";
    let g = pollster::block_on(generate(
        &mut m,
        tok,
        &request("Is the sky blue?", 8, SamplingParams::default(), Some(Constraint::Lark(lark.into()))),
        |_| true,
    ))
    .expect("generate");
    assert!(g.text == "yes" || g.text == "no", "{:?}", g.text);
    assert_eq!(g.finish_reason, FinishReason::Stop);
}

/// The engine: constrained requests (greedy and sampled) and plain ones share steps; the
/// constrained outputs validate, the plain ones run to their length unconstrained.
#[test]
fn engine_batches_constrained_and_plain_requests() {
    let tok = loaded().1.clone();
    let mut e = Engine::new(model(), tok, EngineOptions { step_tokens: 64, prefill_chunk: 32, max_waiting: 8 });
    let schema = json!({"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["ok", "n"], "additionalProperties": false});
    let reqs = [
        request("Reply in JSON.", 24, SamplingParams::default(), Some(Constraint::JsonSchema(schema.clone()))),
        request("Tell me a story.", 12, SamplingParams::default(), None),
        request(
            "Reply in JSON.",
            24,
            SamplingParams { temperature: 0.8, top_k: 20, top_p: 1.0, seed: 3 },
            Some(Constraint::JsonSchema(schema.clone())),
        ),
        request("Count to five.", 12, SamplingParams { temperature: 0.7, top_k: 0, top_p: 1.0, seed: 5 }, None),
    ];
    let mut handles: Vec<_> = reqs.iter().map(|r| e.submit(r.clone()).expect("submit")).collect();
    pollster::block_on(e.run_until_idle()).expect("run");
    for (i, h) in handles.iter_mut().enumerate() {
        let mut done = None;
        while let Ok(Some(ev)) = h.try_next() {
            match ev {
                Event::Done(g) => done = Some(*g),
                Event::Error(msg) => panic!("request {i}: {msg}"),
                _ => {}
            }
        }
        let g = done.unwrap_or_else(|| panic!("request {i} finished"));
        if reqs[i].constraint.is_some() {
            check_valid(&format!("engine request {i}"), &schema, &g);
        } else {
            assert!(!g.output_ids.is_empty(), "request {i}");
        }
    }
}

/// Schemas, regexes and grammars that cannot compile are `LanternError::Constraint`, from
/// `Guide::new`, `generate` and `Engine::submit` alike; `response_format` values map to
/// constraints or typed errors.
#[test]
fn bad_constraints_are_typed_errors() {
    let (w, tok) = loaded();
    let vocab = w.config.vocab_size;
    let bad = [
        Constraint::JsonSchema(json!({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}})),
        Constraint::JsonSchema(json!({"type": "integer", "minimum": 5, "maximum": 1})),
        Constraint::Regex("(unclosed".into()),
        Constraint::Lark("start: undefined_rule".into()),
    ];
    for c in &bad {
        match Guide::new(tok, c, vocab, &[]) {
            Err(LanternError::Constraint { kind, reason }) => {
                assert_eq!(kind, c.kind());
                eprintln!("{kind}: {reason}");
            }
            other => panic!("{c:?}: want a Constraint error, got {other:?}"),
        }
    }
    let mut e = Engine::new(model(), tok.clone(), EngineOptions::default());
    let r = e.submit(request("x", 4, SamplingParams::default(), Some(bad[0].clone())));
    assert!(matches!(r, Err(LanternError::Constraint { .. })), "{:?}", r.err());
    assert!(e.is_idle(), "nothing queued");
    let mut m = e.into_model();
    let r = pollster::block_on(generate(&mut m, tok, &request("x", 4, SamplingParams::default(), Some(bad[2].clone())), |_| true));
    assert!(matches!(r, Err(LanternError::Constraint { .. })), "{:?}", r.err());

    let rf = |v: Value| Constraint::from_response_format(&v).map_err(|e| e.to_string());
    assert_eq!(rf(json!({"type": "text"})).unwrap(), None);
    assert_eq!(rf(json!({"type": "json_object"})).unwrap(), Some(Constraint::JsonObject));
    assert_eq!(
        rf(json!({"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "object"}, "strict": true}})).unwrap(),
        Some(Constraint::JsonSchema(json!({"type": "object"})))
    );
    for v in
        [json!({"type": "xml"}), json!({}), json!({"type": "json_schema"}), json!({"type": "json_schema", "json_schema": {"schema": 3}})]
    {
        assert!(matches!(Constraint::from_response_format(&v), Err(LanternError::Constraint { .. })), "{v}");
    }
}

/// The token bytes llguidance sees spell what the tokenizer decodes (byte-level BPE).
#[test]
fn token_bytes_match_the_decoder() {
    let tok = &loaded().1;
    let words = lantern::model::guidance::token_bytes(tok).expect("token bytes");
    assert_eq!(words.len(), tok.vocab_size());
    let text = "Hello, world! {\"a\": [1, 2]} café ü";
    let ids = tok.encode_with(text, false).expect("encode");
    let bytes: Vec<u8> = ids.iter().flat_map(|&i| words[i as usize].clone()).collect();
    assert_eq!(String::from_utf8(bytes).expect("utf8"), text);
    let eos = tok.eos_id().expect("eos");
    assert_eq!(words[eos as usize][0], 0xff, "special tokens carry llguidance's marker");
}

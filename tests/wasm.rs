//! Unit tests in a real browser (wasm-bindgen-test in headless Chromium through
//! chromedriver, WebGPU on SwiftShader: no shader-f16): the adapter is found, the forward
//! pass on the browser's WebGPU matches the CPU reference on random models (f32 and f16
//! weights, GQA/MQA, odd widths, uneven chunks) and transformers on GGUF fixtures (every
//! block format, a mixture of experts), the generate API's regex constraint and
//! logit bias hold there, and bad input is a clear error, not a panic. Run by `scripts/test.sh` as
//! `cargo test --release --target wasm32-unknown-unknown --no-default-features --features web --test wasm`.
#![cfg(target_arch = "wasm32")]

#[path = "common/gguf_writer.rs"]
mod gguf_writer;
#[path = "common/random.rs"]
mod random;

use lantern::gpu::{DeviceOptions, GpuContext};
use lantern::model::forward::{GpuModel, ModelOptions};
use lantern::model::ModelWeights;
use lantern::reference::ReferenceModel;
use random::{random_model, Spec};
use wasm_bindgen::JsValue;
use wasm_bindgen_test::*;

wasm_bindgen_test_configure!(run_in_browser);

async fn browser_gpu() -> std::sync::Arc<GpuContext> {
    GpuContext::new(&DeviceOptions { backend: Some("webgpu".into()), ..Default::default() })
        .await
        .expect("a WebGPU adapter (Chromium with --enable-unsafe-webgpu)")
}

async fn check_against_reference(w: &ModelWeights, tokens: usize, opts: ModelOptions, tol: f32) {
    let reference = ReferenceModel::new(w).expect("reference model");
    let vocab = w.config.vocab_size;
    let ids: Vec<u32> = (0..tokens as u32).map(|i| (i * 37 + 11) % vocab as u32).collect();
    let want = reference.forward(&ids);
    let mut m = GpuModel::load(browser_gpu().await, w, opts).await.expect("load");
    let seq = m.new_sequence().unwrap();
    let got = m.forward_all_logits(seq, &ids).await.expect("forward");
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0.0f32, |a, &b| a.max(b.abs())).max(1.0);
    let worst = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    assert!(worst <= tol * scale, "{}: max |diff| {worst:e} (scale {scale})", w.source);
}

#[wasm_bindgen_test]
async fn the_browser_offers_a_webgpu_adapter() {
    let adapters = lantern::gpu::list_adapters(Some("webgpu")).await.unwrap();
    assert!(!adapters.is_empty(), "no WebGPU adapter");
    let ctx = browser_gpu().await;
    assert_eq!(ctx.info.backend, wgpu::Backend::BrowserWebGpu);
    assert!(ctx.limits.max_storage_buffer_binding_size >= 128 << 20);
    let info = lantern::web::Lantern::adapter().await.map_err(JsValue::from).unwrap();
    assert!(js_sys::Reflect::get(&info, &"limits".into()).unwrap().is_object());
}

#[wasm_bindgen_test]
async fn forward_matches_the_reference_mqa_odd_widths_uneven_chunks() {
    let w = random_model(Spec {
        seed: 1,
        vocab: 97,
        hidden: 40,
        ffn: 72,
        layers: 2,
        heads: 5,
        kv_heads: 1,
        head_dim: 8,
        bias: false,
        tied: false,
        f16: false,
        llama3: false,
        gemma: false,
    });
    let opts = ModelOptions { context: Some(64), page_size: 5, max_batch_tokens: 7, max_logit_rows: 7, ..Default::default() };
    check_against_reference(&w, 23, opts, 2e-4).await;
}

#[wasm_bindgen_test]
async fn forward_matches_the_reference_gqa_f16_weights_without_shader_f16() {
    // f16 weights are read with unpack2x16float: no shader-f16 needed (SwiftShader has none);
    // with q/k/v biases, a tied head and Llama 3 RoPE scaling.
    let w = random_model(Spec {
        seed: 3,
        vocab: 130,
        hidden: 64,
        ffn: 130,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        head_dim: 16,
        bias: true,
        tied: true,
        f16: true,
        llama3: true,
        gemma: false,
    });
    let opts = ModelOptions { context: Some(64), page_size: 16, max_batch_tokens: 16, max_logit_rows: 16, ..Default::default() };
    check_against_reference(&w, 20, opts, 2e-4).await;
}

fn message(e: JsValue) -> String {
    js_sys::Reflect::get(&e, &"message".into()).ok().and_then(|m| m.as_string()).unwrap_or_default()
}

#[wasm_bindgen_test]
async fn corrupt_and_truncated_files_are_clear_errors() {
    let bad = js_sys::Uint8Array::from(&b"GGUF\x03\x00\x00\x00 not really a model"[..]);
    let e = lantern::web::Lantern::load_bytes(bad, "bad.gguf".into(), JsValue::UNDEFINED, None).await.err().expect("an error");
    let m = message(e.into());
    assert!(m.contains("bad.gguf"), "the message names the file: {m}");
    let not_gguf = js_sys::Uint8Array::from(&b"<html>404</html>"[..]);
    let e = lantern::web::Lantern::load_bytes(not_gguf, "page.gguf".into(), JsValue::UNDEFINED, None).await.err().expect("an error");
    assert!(message(e.into()).contains("page.gguf"));
    let opts = js_sys::JSON::parse(r#"{"kvDtype": "q3"}"#).unwrap();
    let e = lantern::web::Lantern::load_bytes(js_sys::Uint8Array::new_with_length(0), "empty.gguf".into(), opts, None)
        .await
        .err()
        .expect("an error");
    assert!(!message(e.into()).is_empty());
}

/// The GGUF block formats in the browser (Tint compiles every format's kernels, SwiftShader
/// runs them): the ggml-types fixture's tiny Llama in each GGUF-only type, every position's
/// logits within the fixture's bound (1e-4 of the row's max |logit|) of transformers'.
#[wasm_bindgen_test]
async fn every_gguf_block_format_matches_transformers_in_the_browser() {
    macro_rules! fixture {
        ($t:literal) => {
            (
                $t,
                &include_bytes!(concat!("fixtures/ggml-types/tiny-", $t, ".gguf"))[..],
                &include_bytes!(concat!("fixtures/ggml-types/", $t, ".logits.f32"))[..],
            )
        };
    }
    let input: [u32; 24] =
        [303, 211, 294, 53, 204, 372, 152, 505, 143, 177, 279, 233, 154, 30, 171, 158, 236, 380, 282, 374, 442, 120, 368, 476];
    let ctx = browser_gpu().await;
    for (ty, gguf, logits) in [
        fixture!("Q5_0"),
        fixture!("Q5_1"),
        fixture!("IQ4_NL"),
        fixture!("Q2_K"),
        fixture!("Q3_K"),
        fixture!("Q4_K"),
        fixture!("Q5_K"),
        fixture!("Q6_K"),
        fixture!("IQ4_XS"),
    ] {
        let file = lantern::model::gguf::GgufFile::parse(gguf, format!("tiny-{ty}.gguf")).expect("parse");
        let w = lantern::model::gguf::hf_map::weights_from_gguf(&file, ty).expect("weights");
        let want: Vec<f32> = logits.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        let opts = ModelOptions { context: Some(64), max_batch_tokens: 8, max_logit_rows: 8, ..Default::default() };
        let mut m = GpuModel::load(ctx.clone(), &w, opts).await.expect("load");
        let seq = m.new_sequence().unwrap();
        let got = m.forward_all_logits(seq, &input).await.expect("forward");
        let vocab = w.config.vocab_size;
        for (r, (g, t)) in got.chunks_exact(vocab).zip(want.chunks_exact(vocab)).enumerate() {
            let scale = t.iter().fold(0f32, |a, v| a.max(v.abs()));
            let worst = g.iter().zip(t).fold(0f32, |a, (x, y)| a.max((x - y).abs()));
            assert!(worst <= 1e-4 * scale, "{ty}: position {r} off by {worst:e} (row max |logit| {scale})");
        }
    }
}

/// A mixture of experts in the browser (Tint compiles the router, per-pair and grouped expert
/// kernels, SwiftShader runs them): llama.cpp's GGUF of the tiny Mixtral, every position's
/// logits within 1e-4 of transformers' (prefill grouped by expert in chunks of 16, then one
/// token per step through the per-pair matvec, which must give the same next token).
#[wasm_bindgen_test]
async fn a_mixture_of_experts_matches_transformers_in_the_browser() {
    let gguf = include_bytes!("fixtures/tiny-moe/mixtral/model.gguf");
    let logits = include_bytes!("fixtures/tiny-moe/mixtral/logits.f32");
    let r: serde_json::Value = serde_json::from_str(include_str!("fixtures/tiny-moe/mixtral/reference.json")).unwrap();
    let ids: Vec<u32> = r["input_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
    let greedy: Vec<u32> = r["greedy_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
    let file = lantern::model::gguf::GgufFile::parse(gguf, "mixtral.gguf".to_string()).expect("parse");
    let w = lantern::model::gguf::hf_map::weights_from_gguf(&file, "mixtral").expect("weights");
    assert!(w.config.block.moe.is_some());
    let want: Vec<f32> = logits.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    let opts = ModelOptions { context: Some(64), max_batch_tokens: 16, max_logit_rows: 16, ..Default::default() };
    let mut m = GpuModel::load(browser_gpu().await, &w, opts).await.expect("load");
    let seq = m.new_sequence().unwrap();
    let got = m.forward_all_logits(seq, &ids).await.expect("forward");
    let worst = got.iter().zip(&want).fold(0f32, |a, (x, y)| a.max((x - y).abs()));
    assert!(worst <= 1e-4, "mixtral in the browser: logits off by {worst:e}");
    m.release_sequence(seq);
    let seq = m.new_sequence().unwrap();
    let mut out = vec![m.forward(seq, &ids, lantern::model::forward::Want::Argmax).await.unwrap().argmax[0]];
    while out.len() < greedy.len() {
        let t = *out.last().unwrap();
        out.push(m.forward(seq, &[t], lantern::model::forward::Want::Argmax).await.unwrap().argmax[0]);
    }
    assert_eq!(out, greedy, "mixtral in the browser: greedy continuation");
}

/// The browser API's constrained decoding and logit bias (llguidance compiled for wasm, the
/// mask and bias kernels on SwiftShader), on a tiny GGUF with a byte-level tokenizer: a
/// `regex` output is in the language, and `logitBias` -100 on the unconstrained first token
/// moves the first token elsewhere.
#[wasm_bindgen_test]
async fn generate_takes_a_regex_and_a_logit_bias_in_the_browser() {
    use gguf_writer::{byte_level_tokenizer, tiny_model, TinyShape};
    let mut w = tiny_model("llama", TinyShape { hidden: 32, heads: 2, kv_heads: 1, head_dim: 16, ffn: 64, vocab: 258, layers: 2 }, 0);
    for (k, v) in byte_level_tokenizer(&["a b"], &["<|endoftext|>"]) {
        w.set(&k, v);
    }
    let bytes = js_sys::Uint8Array::from(&w.to_bytes()[..]);
    let lantern = lantern::web::Lantern::load_bytes(bytes, "tiny.gguf".into(), JsValue::UNDEFINED, None).await.expect("load");
    let field = |v: &JsValue, k: &str| js_sys::Reflect::get(v, &k.into()).unwrap();
    let opts = |json: &str| js_sys::JSON::parse(json).unwrap();
    let out = lantern.generate("ab".into(), opts(r#"{"maxTokens": 8, "regex": "[ab]{2,4}c"}"#), None).await.expect("generate");
    let text = field(&out, "text").as_string().unwrap();
    let (letters, last) = text.split_at(text.len().saturating_sub(1));
    assert!(last == "c" && (2..=4).contains(&letters.len()) && letters.chars().all(|c| c == 'a' || c == 'b'), "{text:?}");
    assert_eq!(field(&out, "finishReason").as_string().unwrap(), "stop", "the finished grammar ends it");
    let plain = lantern.generate("ab".into(), opts(r#"{"maxTokens": 2}"#), None).await.expect("generate");
    let first = js_sys::Array::from(&field(&plain, "outputIds")).get(0).as_f64().unwrap() as u32;
    let biased = lantern
        .generate("ab".into(), opts(&format!(r#"{{"maxTokens": 2, "logitBias": {{"{first}": -100}}, "frequencyPenalty": 1}}"#)), None)
        .await
        .expect("generate");
    let got = js_sys::Array::from(&field(&biased, "outputIds")).get(0).as_f64().unwrap() as u32;
    assert_ne!(got, first, "a -100 bias bans the unbiased first token");
}

//! Unit tests in a real browser (wasm-bindgen-test in headless Chromium through
//! chromedriver, WebGPU on SwiftShader: no shader-f16): the adapter is found, the forward
//! pass on the browser's WebGPU matches the CPU reference on random models (f32 and f16
//! weights, GQA/MQA, odd widths, uneven chunks), and bad input is a clear error, not a
//! panic. Run by `scripts/test.sh` as
//! `cargo test --release --target wasm32-unknown-unknown --no-default-features --features web --test wasm`.
#![cfg(target_arch = "wasm32")]

use std::collections::HashMap;

use lantern::gpu::{DeviceOptions, GpuContext};
use lantern::model::llama::{GpuModel, ModelOptions};
use lantern::model::{Arch, DType, HostTensor, ModelConfig, ModelWeights};
use lantern::reference::ReferenceModel;
use wasm_bindgen::JsValue;
use wasm_bindgen_test::*;

wasm_bindgen_test_configure!(run_in_browser);

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

/// A seeded random llama: `(vocab, hidden, ffn, layers, heads, kv_heads, head_dim)`.
fn random_model(seed: u64, shape: (usize, usize, usize, usize, usize, usize, usize), f16: bool) -> ModelWeights {
    let (vocab, d, f, layers, heads, kv_heads, hd) = shape;
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let config = ModelConfig {
        arch: Arch::Llama,
        vocab_size: vocab,
        hidden_size: d,
        intermediate_size: f,
        num_layers: layers,
        num_heads: heads,
        num_kv_heads: kv_heads,
        head_dim: hd,
        rms_norm_eps: 1e-5,
        rope_theta: 10000.0,
        rope_scaling: None,
        max_position_embeddings: 256,
        tie_word_embeddings: false,
        qkv_bias: false,
        bos_token_id: None,
        eos_token_ids: vec![],
    };
    let mut tensors = HashMap::new();
    let mut add = |name: String, shape: Vec<usize>, scale: f32, offset: f32, matrix: bool| {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|_| offset + scale * rng.next()).collect();
        let t = if f16 && matrix {
            let bits: Vec<u8> = v.iter().flat_map(|x| half::f16::from_f32(*x).to_le_bytes()).collect();
            HostTensor { name: name.clone(), shape, dtype: DType::F16, data: bits }
        } else {
            HostTensor::from_f32(name.clone(), shape, &v)
        };
        tensors.insert(name, t);
    };
    add("model.embed_tokens.weight".into(), vec![vocab, d], 0.5, 0.0, true);
    for l in 0..layers {
        let p = format!("model.layers.{l}");
        add(format!("{p}.input_layernorm.weight"), vec![d], 0.2, 1.0, false);
        add(format!("{p}.post_attention_layernorm.weight"), vec![d], 0.2, 1.0, false);
        add(format!("{p}.self_attn.q_proj.weight"), vec![heads * hd, d], 0.2, 0.0, true);
        add(format!("{p}.self_attn.k_proj.weight"), vec![kv_heads * hd, d], 0.2, 0.0, true);
        add(format!("{p}.self_attn.v_proj.weight"), vec![kv_heads * hd, d], 0.2, 0.0, true);
        add(format!("{p}.self_attn.o_proj.weight"), vec![d, heads * hd], 0.2, 0.0, true);
        add(format!("{p}.mlp.gate_proj.weight"), vec![f, d], 0.2, 0.0, true);
        add(format!("{p}.mlp.up_proj.weight"), vec![f, d], 0.2, 0.0, true);
        add(format!("{p}.mlp.down_proj.weight"), vec![d, f], 0.2, 0.0, true);
    }
    add("model.norm.weight".into(), vec![d], 0.2, 1.0, false);
    add("lm_head.weight".into(), vec![vocab, d], 0.3, 0.0, true);
    ModelWeights { config, tensors, source: format!("random model seed {seed}") }
}

async fn browser_gpu() -> std::sync::Arc<GpuContext> {
    GpuContext::new(&DeviceOptions { backend: Some("webgpu".into()), ..Default::default() }).await.expect("a WebGPU adapter (Chromium with --enable-unsafe-webgpu)")
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
    let w = random_model(1, (97, 40, 72, 2, 5, 1, 8), false);
    let opts = ModelOptions { context: Some(64), page_size: 5, max_batch_tokens: 7, max_logit_rows: 7, ..Default::default() };
    check_against_reference(&w, 23, opts, 2e-4).await;
}

#[wasm_bindgen_test]
async fn forward_matches_the_reference_gqa_f16_weights_without_shader_f16() {
    // f16 weights are read with unpack2x16float: no shader-f16 needed (SwiftShader has none).
    let w = random_model(3, (130, 64, 130, 2, 4, 2, 16), true);
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
    let e = lantern::web::Lantern::load_bytes(js_sys::Uint8Array::new_with_length(0), "empty.gguf".into(), opts, None).await.err().expect("an error");
    assert!(!message(e.into()).is_empty());
}

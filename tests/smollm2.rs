//! SmolLM2-135M-Instruct from the real GGUF, loaded natively (Q4_1 layers and the Q8_0
//! embedding/LM head stay packed on the GPU and are dequantized inside the kernels), against
//! the Hugging Face transformers fixtures in `tests/fixtures/smollm2`: argmax at every prompt
//! position, last-position top-20 logits within 1e-3, and every greedy continuation token
//! for token, decoded one token per step through the paged KV cache. Also: the GPU memory of
//! the load, allocation by allocation, holds no float copy of any quantized weight.

mod common;

use std::sync::{Mutex, OnceLock};

use lantern::model::forward::{GpuModel, ModelOptions, Want};
use lantern::model::load::load_path;
use lantern::model::tokenizer::Tokenizer;

struct Loaded {
    model: GpuModel,
    tokenizer: Tokenizer,
}

fn loaded() -> &'static Mutex<Loaded> {
    static M: OnceLock<Mutex<Loaded>> = OnceLock::new();
    M.get_or_init(|| {
        let l = load_path(&common::smollm2_gguf()).expect("load SmolLM2 GGUF");
        let model =
            pollster::block_on(GpuModel::load(common::gpu(), &l.weights, ModelOptions { context: Some(256), ..Default::default() }))
                .expect("upload SmolLM2");
        Mutex::new(Loaded { model, tokenizer: l.tokenizer.expect("GGUF tokenizer") })
    })
}

fn cases() -> Vec<serde_json::Value> {
    common::fixture_json("smollm2/cases.json").as_array().unwrap().clone()
}

#[test]
fn every_case_matches_transformers() {
    let mut guard = loaded().lock().unwrap_or_else(|e| e.into_inner());
    let Loaded { model, tokenizer, .. } = &mut *guard;
    common::real::check_cases(model, tokenizer, &cases(), None).unwrap_or_else(|e| panic!("{e}"));
}

/// Every GPU allocation of the native load is explained (ledger bytes = weights + KV +
/// workspace + uniforms + readback), and the weights occupy exactly the GGUF's packed bytes:
/// Q4_1 layers as q4 (codes + f16 scale/min per 32), the Q8_0 table as q8 (codes + f16 scale
/// per 32), f32 norms. A float copy of any quantized weight would break both equalities.
#[test]
fn native_load_keeps_quantized_weights_packed() {
    let l = load_path(&common::smollm2_gguf()).expect("load SmolLM2 GGUF");
    // File bytes of the quantized tensors by dtype, and of the f32 ones.
    let mut file_bytes = std::collections::BTreeMap::new();
    for t in l.weights.tensors.values() {
        *file_bytes.entry(t.dtype.name()).or_insert(0u64) += t.data.len() as u64;
    }
    // A device of its own: the ledger window of the load then holds only this model's
    // allocations, not those of tests running beside it.
    let ctx = common::gpu_with(&Default::default());
    let opts = ModelOptions { context: Some(256), ..Default::default() };
    let model = pollster::block_on(GpuModel::load(ctx, &l.weights, opts)).expect("upload SmolLM2");
    let m = model.memory();
    eprintln!("{}", serde_json::to_string_pretty(m).unwrap());
    assert_eq!(m.ledger_bytes, m.total(), "allocations the report does not explain");
    let q4 = &m.weights["q4g32"];
    let q8 = &m.weights["q8g32"];
    // q|k|v fused into one matrix, gate and up two: 5 uploads holding 7 GGUF tensors a layer.
    assert_eq!(q4.tensors, 30 * 5, "every attention and MLP matrix packed as q4");
    assert_eq!(q4.bytes + q4.scale_bytes, file_bytes["q4_1"]);
    assert_eq!(q8.bytes + q8.scale_bytes, file_bytes["q8_0"], "tied embedding / LM head packed as q8");
    assert_eq!(m.weights["f32"].bytes, file_bytes["f32"], "norms");
    // Tiled textures (CPU adapters with 8-lane subgroups) pad rows to whole 16-byte texels:
    // Q4_1's 18 scale words per 576-wide row take 5 texels.
    assert!(q4.padding + q8.padding < (file_bytes["q4_1"] + file_bytes["q8_0"]) / 100 * 3, "padding {} {}", q4.padding, q8.padding);
    assert_eq!(m.weights.len(), 3, "no other weight dtype: {:?}", m.weights.keys());
    // No allocation is as large as an f32 copy of the LM head (49152 x 576 x 4 bytes).
    assert!(m.largest.1 < 49152 * 576 * 4, "largest allocation {:?}", m.largest);
}

/// The dequantized SmolLM2 requantized to q8 (round to nearest, groups of 32, LM head q8)
/// keeps more than 95% of the fixture's greedy tokens, position by position, each case
/// decoded through the KV cache for as many tokens as transformers produced.
#[test]
fn requantized_q8_keeps_greedy_agreement() {
    use lantern::quant::quantize::{quantize_model, QuantizeOptions};
    use lantern::quant::QuantKind;
    let l = load_path(&common::smollm2_gguf()).expect("load SmolLM2 GGUF");
    let q8 = quantize_model(&l.weights, &QuantizeOptions::new(QuantKind::Q8), None, &mut |_| {}).expect("quantize q8");
    drop(l);
    let opts = ModelOptions { context: Some(256), ..Default::default() };
    let mut m = pollster::block_on(GpuModel::load(common::gpu(), &q8.weights, opts)).expect("upload q8 SmolLM2");
    assert!(m.memory().weights.contains_key("q8g32"), "{:?}", m.memory().weights.keys());
    let (mut same, mut total) = (0usize, 0usize);
    for case in cases() {
        let prompt = common::ids(&case["input_ids"]);
        let greedy = common::ids(&case["greedy_ids"]);
        let seq = m.new_sequence().unwrap();
        let mut out = vec![pollster::block_on(m.forward(seq, &prompt, Want::Argmax)).expect("prefill").argmax[0]];
        while out.len() < greedy.len() {
            let t = *out.last().unwrap();
            out.push(pollster::block_on(m.forward(seq, &[t], Want::Argmax)).expect("decode").argmax[0]);
        }
        m.release_sequence(seq);
        let s = out.iter().zip(&greedy).filter(|(a, b)| a == b).count();
        eprintln!("{}: q8 agrees on {s}/{} greedy tokens", case["name"].as_str().unwrap(), greedy.len());
        same += s;
        total += greedy.len();
    }
    let agreement = same as f64 / total as f64;
    eprintln!("q8 RTN g32: {same}/{total} = {:.1}% of greedy tokens agree with transformers", 100.0 * agreement);
    assert!(agreement > 0.95, "q8 greedy agreement {agreement:.3}");
}

//! The architectures beyond Llama/Qwen2/Mistral on tiny random checkpoints made with
//! transformers (`tests/fixtures/tiny-archs`: Gemma 3, Qwen3, a Llama 3.2-shaped model, Phi-3
//! and Phi-3 with LongRoPE), each loaded twice: as the Hugging Face folder and as llama.cpp's
//! own GGUF conversion of it (`model.gguf`). Both the CPU reference and the GPU forward pass
//! must reproduce transformers' float32 logits for every position, and greedy decoding through
//! the paged cache its continuation.

mod common;

use std::path::PathBuf;

use lantern::model::forward::{GpuModel, ModelOptions, Want};
use lantern::model::load::load_path;
use lantern::model::{Arch, ModelWeights};
use lantern::reference::ReferenceModel;

fn dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-archs").join(name)
}

/// Logits within this of transformers' (absolute; these logits are of order 1).
const TOL: f32 = 1e-4;

fn max_diff(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max)
}

/// One case of a fixture (`case` is reference.json or its "short" entry) against one load.
fn check_case(what: &str, w: &ModelWeights, folder: &std::path::Path, case: &serde_json::Value, context: usize) {
    let ids = common::ids(&case["input_ids"]);
    let want = common::read_f32(&folder.join(case["logits"]["file"].as_str().unwrap()));
    let cpu = ReferenceModel::new(w).expect("reference").forward(&ids);
    let d = max_diff(&cpu, &want);
    assert!(d <= TOL, "{what}: CPU reference logits differ by {d:e}");
    let opts = ModelOptions { context: Some(context), max_batch_tokens: 16, max_logit_rows: 16, page_size: 4, ..Default::default() };
    let mut m = pollster::block_on(GpuModel::load(common::gpu(), w, opts)).expect("upload");
    let seq = m.new_sequence().unwrap();
    let gpu = pollster::block_on(m.forward_all_logits(seq, &ids)).expect("forward");
    let d = max_diff(&gpu, &want);
    assert!(d <= TOL, "{what}: GPU logits differ by {d:e}");
    m.release_sequence(seq);
    // Greedy through the cache: prompt in chunks, then one token per step.
    let greedy = common::ids(&case["greedy_ids"]);
    let seq = m.new_sequence().unwrap();
    let mut out = vec![pollster::block_on(m.forward(seq, &ids, Want::Argmax)).unwrap().argmax[0]];
    while out.len() < greedy.len() {
        let t = *out.last().unwrap();
        out.push(pollster::block_on(m.forward(seq, &[t], Want::Argmax)).unwrap().argmax[0]);
    }
    assert_eq!(out, greedy, "{what}: greedy continuation (min margin {})", case["greedy_min_top2_margin"]);
    eprintln!("{what}: {} positions, CPU and GPU within {TOL:e}, {} greedy tokens exact", ids.len(), greedy.len());
}

fn check(name: &str, arch: Arch) {
    let folder = dir(name);
    let r = common::read_json(&folder.join("reference.json"));
    for (form, path) in [("HF folder", folder.clone()), ("llama.cpp GGUF", folder.join("model.gguf"))] {
        let w = load_path(&path).unwrap_or_else(|e| panic!("{name} {form}: {e}")).weights;
        assert_eq!(w.config.arch, arch, "{name} {form}");
        let what = format!("{name} ({form})");
        check_case(&what, &w, &folder, &r, 256);
        if let Some(short) = r.get("short") {
            // Within the original context LongRoPE uses its short factors: a load for 32
            // positions takes them.
            check_case(&format!("{what}, short factors"), &w, &folder, short, 32);
        }
    }
}

#[test]
fn gemma3_tiny() {
    check("gemma3", Arch::Gemma3);
}

#[test]
fn qwen3_tiny() {
    check("qwen3", Arch::Qwen3);
}

#[test]
fn llama3_2_tiny_tied_head_and_llama3_rope() {
    check("llama3.2", Arch::Llama);
}

#[test]
fn phi3_tiny_fused_tensors() {
    check("phi3", Arch::Phi3);
}

#[test]
fn phi3_tiny_longrope() {
    check("phi3-longrope", Arch::Phi3);
}

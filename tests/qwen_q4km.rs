//! Qwen2.5-Coder-0.5B-Instruct and -1.5B-Instruct from their real Q4_K_M GGUFs (Q4_K, Q6_K,
//! Q5_0 and Q8_0 tensors, mixed within layers), loaded natively: every tensor stays packed on
//! the GPU and is dequantized inside the kernels. Against the transformers fixtures in
//! `tests/fixtures/qwen2.5-coder-*-q4km`: tokenizer ids, prompt argmax, last-position top-20
//! logits within 1e-3 and greedy continuations through the paged cache (every case and
//! token for 0.5B; the 1.5B decodes at about a token per second on lavapipe, so its cases
//! check the prompt pass and the first greedy tokens), perplexity within 0.5%, and the GPU
//! memory of the load: weights within 2% of the file's tensor bytes, no float copy.
//!
//! The models come from the catalogue (`lantern fetch qwen2.5-coder-0.5b`, as the test
//! command does); `LANTERN_QWEN05_GGUF` / `LANTERN_QWEN15_GGUF` point elsewhere.

mod common;

use common::real::{check_memory, json, model};
use lantern::model::llama::{GpuModel, ModelOptions};
use lantern::model::load::load_path;

#[test]
fn qwen_0_5b_q4km_matches_transformers() {
    let dir = "qwen2.5-coder-0.5b-q4km";
    let path = model("LANTERN_QWEN05_GGUF", "qwen2.5-coder-0.5b");
    let l = load_path(&path).expect("load Qwen2.5-Coder-0.5B GGUF");
    let tok = l.tokenizer.as_ref().expect("GGUF tokenizer");
    common::real::check_tokenize(tok, &json(dir, "tokenize.json"));
    let opts = ModelOptions { context: Some(640), max_batch_tokens: 256, max_logit_rows: 256, ..Default::default() };
    let mut m = pollster::block_on(GpuModel::load(common::gpu_with(&Default::default()), &l.weights, opts)).expect("upload");
    check_memory(&path, &m);
    let cases = json(dir, "cases.json").as_array().unwrap().clone();
    let reports = common::real::check_cases(&mut m, tok, &cases, None).unwrap_or_else(|e| panic!("{e}"));
    let worst = reports.iter().map(|r| r.top20_diff).fold(0.0, f32::max);
    let text = std::fs::read_to_string(common::real::fixtures(dir).join("perplexity.txt")).unwrap();
    let (ppl, want, rel) = common::real::check_perplexity(&mut m, tok, &text, &json(dir, "perplexity.json"));
    eprintln!("qwen 0.5b: worst top-20 |diff| {worst:e}; perplexity {ppl:.4} vs {want:.4} ({rel:.2e})");
    assert!(rel <= 0.005, "perplexity {ppl} vs transformers {want}");
}

#[test]
fn qwen_1_5b_q4km_matches_transformers_on_its_first_tokens() {
    let dir = "qwen2.5-coder-1.5b-q4km";
    let path = model("LANTERN_QWEN15_GGUF", "qwen2.5-coder-1.5b");
    let l = load_path(&path).expect("load Qwen2.5-Coder-1.5B GGUF");
    let tok = l.tokenizer.as_ref().expect("GGUF tokenizer");
    common::real::check_tokenize(tok, &json(dir, "tokenize.json"));
    let opts = ModelOptions { context: Some(128), ..Default::default() };
    let mut m = pollster::block_on(GpuModel::load(common::gpu_with(&Default::default()), &l.weights, opts)).expect("upload");
    check_memory(&path, &m);
    // The short cases (the long one's 566-token prompt takes minutes here), 4 greedy tokens.
    let cases: Vec<_> =
        json(dir, "cases.json").as_array().unwrap().iter().filter(|c| c["n_prompt_tokens"].as_u64().unwrap() <= 48).cloned().collect();
    assert_eq!(cases.len(), 3);
    let reports = common::real::check_cases(&mut m, tok, &cases, Some(4)).unwrap_or_else(|e| panic!("{e}"));
    let worst = reports.iter().map(|r| r.top20_diff).fold(0.0, f32::max);
    eprintln!("qwen 1.5b: worst top-20 |diff| {worst:e}");
}

//! Gemma 3 270M from its real Q4_K_M GGUF (Q5_0, Q8_0, Q4_K and Q6_K tensors), against the
//! transformers fixture in `tests/fixtures/gemma3-270m-q4km`: the SentencePiece tokenizer
//! (BOS added), prompt argmax, last-position top-20 logits within 1e-3 and 32 greedy tokens
//! per case through the paged cache, perplexity within 0.5%, and the GPU memory of the load.
//! The long case (529 tokens) crosses the 512-key window of the local layers: without the
//! window its last logits move by 0.445 (the fixture's ablation), far beyond the bound.
//!
//! The same long case runs again with the local layers keeping only a ring of their window
//! (`KvWindow::Ring`), small enough that the prompt wraps it.
//!
//! The model comes from the catalogue (`lantern fetch gemma3-270m`, as the test command
//! does); `LANTERN_GEMMA3_GGUF` points elsewhere.

mod common;

use common::real::{check_memory, json, model};
use lantern::model::forward::{GpuModel, ModelOptions};
use lantern::model::load::load_path;
use lantern::model::{Activation, LayerAttention, NormPlacement};

#[test]
fn gemma3_270m_q4km_matches_transformers() {
    let dir = "gemma3-270m-q4km";
    let path = model("LANTERN_GEMMA3_GGUF", "gemma3-270m");
    let l = load_path(&path).expect("load Gemma 3 270M GGUF");
    let c = &l.weights.config;
    // The block as data, as the fixture's README lists it.
    assert_eq!(c.block.norms, NormPlacement::Sandwich);
    assert!(c.block.qk_norm);
    assert_eq!(c.block.activation, Activation::GeluTanh);
    assert_eq!(c.block.embedding_scale, Some(25.298_222));
    assert_eq!(c.attention_scale(), 0.0625);
    assert_eq!(c.block.sliding_window, Some(512));
    let global: Vec<usize> = (0..c.num_layers).filter(|&i| c.block.attention(i) == LayerAttention::Full).collect();
    assert_eq!(global, [5, 11, 17]);
    assert_eq!((c.rope_theta, c.block.rope_local_theta), (1e6, Some(10000.0)));
    let tok = l.tokenizer.as_ref().expect("GGUF tokenizer");
    common::real::check_tokenize(tok, &json(dir, "tokenize.json"));

    let opts = ModelOptions { context: Some(640), max_batch_tokens: 128, max_logit_rows: 64, ..Default::default() };
    let mut m = pollster::block_on(GpuModel::load(common::gpu_with(&Default::default()), &l.weights, opts)).expect("upload");
    check_memory(&path, &m);
    let cases = json(dir, "cases.json").as_array().unwrap().clone();
    assert!(cases.iter().any(|c| c["n_prompt_tokens"].as_u64().unwrap() > 512), "a case longer than the window");
    let reports = common::real::check_cases(&mut m, tok, &cases, None).unwrap_or_else(|e| panic!("{e}"));
    let worst = reports.iter().map(|r| r.top20_diff).fold(0.0, f32::max);
    let text = std::fs::read_to_string(common::real::fixtures(dir).join("perplexity.txt")).unwrap();
    let (ppl, want, rel) = common::real::check_perplexity(&mut m, tok, &text, &json(dir, "perplexity.json"));
    eprintln!("gemma3 270m: worst top-20 |diff| {worst:e}; perplexity {ppl:.4} vs {want:.4} ({rel:.2e})");
    assert!(rel <= 0.005, "perplexity {ppl} vs transformers {want}");
    drop(m);

    // The local layers keeping only a ring of their window: steps of up to 16 tokens in pages
    // of 16 make rings of 528 tokens, which the long case's 529-token prompt and its
    // continuation wrap. Same logits and greedy tokens, and the memory the rings save.
    let opts = ModelOptions {
        context: Some(640),
        max_batch_tokens: 16,
        max_logit_rows: 16,
        kv_window: lantern::model::forward::KvWindow::Ring,
        ..Default::default()
    };
    let mut m = pollster::block_on(GpuModel::load(common::gpu_with(&Default::default()), &l.weights, opts)).expect("upload");
    let mem = m.memory().clone();
    assert_eq!(mem.kv_window_ring.map(|r| r.tokens()), Some(528));
    // 15 local layers hold 528 tokens each instead of 640: about 15 x 112 / (18 x 640) less.
    let per_layer_token = 2 * (c.num_kv_heads * c.head_dim * 4) as u64;
    assert_eq!(mem.kv_ring_bytes, 15 * 528 * per_layer_token);
    let long: Vec<_> = cases.iter().filter(|c| c["n_prompt_tokens"].as_u64().unwrap() > 528).cloned().collect();
    assert_eq!(long.len(), 1);
    let r = common::real::check_cases(&mut m, tok, &long, Some(8)).unwrap_or_else(|e| panic!("window rings: {e}"));
    eprintln!(
        "gemma3 270m with window rings: {} B of KV cache, rings {} B; long case top-20 |diff| {:e}",
        mem.kv_cache, mem.kv_ring_bytes, r[0].top20_diff
    );
}

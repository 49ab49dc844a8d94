//! Qwen2.5-Coder-0.5B-Instruct and -1.5B-Instruct from their real Q4_K_M GGUFs (Q4_K, Q6_K,
//! Q5_0 and Q8_0 tensors, mixed within layers), loaded natively: every tensor stays packed on
//! the GPU and is dequantized inside the kernels. Against the transformers fixtures in
//! `tests/fixtures/qwen2.5-coder-*-q4km`: tokenizer ids, prompt argmax, last-position top-20
//! logits within 1e-3 and greedy continuations through the paged cache (every case and
//! token for 0.5B; the 1.5B decodes at about a token per second on lavapipe, so its cases
//! check the prompt pass and the first greedy tokens), perplexity within 0.5%, and the GPU
//! memory of the load: weights within 2% of the file's tensor bytes, no float copy; and a
//! tool call through Qwen's own chat template.
//!
//! The models come from the catalogue (`lantern fetch qwen2.5-coder-0.5b`, as the test
//! command does); `LANTERN_QWEN05_GGUF` / `LANTERN_QWEN15_GGUF` point elsewhere.

mod common;

use common::real::{check_memory, json, model};
use lantern::model::forward::{GpuModel, ModelOptions};
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

/// Tool calls on a real model whose template takes `tools` (the server's own request path:
/// `lantern::openai` parsing and validation, the engine request, the reply's parse). Qwen2.5's
/// template renders the tools in its `<tools>` block; asked about the weather with
/// `tool_choice: auto`, Qwen2.5-Coder-0.5B calls get_weather for Paris (it writes the call
/// object without the `<tool_call>` tags the template asks for, which the parser takes too);
/// the call and the tool's answer then go back through the template.
#[test]
fn qwen_0_5b_calls_a_tool_through_its_own_template() {
    use lantern::api::{parse_request, Endpoint, ServedModel};
    use serde_json::{json, Value};
    let path = model("LANTERN_QWEN05_GGUF", "qwen2.5-coder-0.5b");
    let l = load_path(&path).expect("load Qwen2.5-Coder-0.5B GGUF");
    let tok = std::sync::Arc::new(l.tokenizer.clone().expect("GGUF tokenizer"));
    let opts = ModelOptions { context: Some(512), max_seqs: 1, ..Default::default() };
    let mut m = pollster::block_on(GpuModel::load(common::gpu_with(&Default::default()), &l.weights, opts)).expect("upload");
    let served = ServedModel {
        template: tok.chat_template().map_err(|e| e.to_string()),
        stop_ids: lantern::engine::generate::default_stop_ids(&m.config.eos_token_ids, &tok),
        vocab: m.config.vocab_size,
        context: 512,
        kv_pages_total: m.kv.alloc.total_pages(),
        page_size: m.kv.alloc.config.page_size,
        model_id: "qwen".into(),
        aliases: vec![],
        speculation: Default::default(),
        max_seqs: 1,
        embedding_dims: m.config.hidden_size,
        token_bytes: Default::default(),
        tokenizer: tok.clone(),
    };
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]);
    let question = json!({"role": "user", "content": "What is the weather like in Paris today?"});
    let body = json!({"model": "qwen", "messages": [question], "max_tokens": 40, "temperature": 0, "tools": tools});
    let v = parse_request(&served, Endpoint::Chat, body.to_string().as_bytes()).expect("valid request");
    let prompt = tok.decode(&v.prompt_ids).unwrap();
    assert!(prompt.contains("<tools>") && prompt.contains("\"get_weather\""), "Qwen's template renders the tools:\n{prompt}");
    let g = pollster::block_on(lantern::engine::generate::generate(&mut m, &tok, &v.request(&served, 0), |_| true)).expect("generate");
    let (content, calls) = v.tools.as_ref().expect("tools").parse(&g.text, "t").unwrap_or_else(|| panic!("no tool call in {:?}", g.text));
    assert_eq!((content, calls.len(), calls[0].function.name.as_str()), (None, 1, "get_weather"), "{:?}", g.text);
    let args: Value = serde_json::from_str(&calls[0].function.arguments).unwrap();
    assert_eq!(args, json!({"city": "Paris"}));
    // The call and its answer go back through the template.
    let call = json!({"id": "t-call0", "type": "function", "function": {"name": "get_weather", "arguments": calls[0].function.arguments}});
    let body = json!({"model": "qwen", "tools": tools, "messages": [question,
        {"role": "assistant", "content": null, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "t-call0", "content": "18 C, light rain"}]});
    let v = parse_request(&served, Endpoint::Chat, body.to_string().as_bytes()).expect("valid follow-up");
    let prompt = tok.decode(&v.prompt_ids).unwrap();
    assert!(prompt.contains("<tool_call>") && prompt.contains("\"Paris\""), "the earlier call is rendered:\n{prompt}");
    assert!(prompt.contains("<tool_response>\n18 C, light rain\n</tool_response>"), "the tool's answer is rendered:\n{prompt}");
}

//! The paged KV cache on the real model (SmolLM2-135M-Instruct, natively loaded, f32 KV
//! unless stated): K/V split across buffers by a small binding limit, flash-decoding splits,
//! copy-on-write forks, prefix sharing between requests, and what an f16 or q8 cache changes
//! (reported against the transformers fixtures).

mod common;

use lantern::engine::generate::{generate, GenerateRequest};
use lantern::engine::SamplingParams;
use lantern::gpu::DeviceOptions;
use lantern::kv::plan::KvDtype;
use lantern::model::forward::{GpuModel, ModelOptions, Want};
use lantern::model::load::load_path;

fn cases() -> Vec<serde_json::Value> {
    common::fixture_json("smollm2/cases.json").as_array().unwrap().clone()
}

fn load(ctx: std::sync::Arc<lantern::gpu::GpuContext>, opts: ModelOptions) -> (GpuModel, lantern::model::tokenizer::Tokenizer) {
    let l = load_path(&common::smollm2_gguf()).expect("load SmolLM2 GGUF");
    let m = pollster::block_on(GpuModel::load(ctx, &l.weights, opts)).expect("upload SmolLM2");
    (m, l.tokenizer.expect("GGUF tokenizer"))
}

/// Greedy decoding of `prompt` for `n` tokens in sequence `seq` (prefill, then one token per
/// step through the cache).
fn greedy(m: &mut GpuModel, seq: usize, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut out = vec![pollster::block_on(m.forward(seq, prompt, Want::Argmax)).expect("prefill").argmax[0]];
    while out.len() < n {
        let t = *out.last().unwrap();
        out.push(pollster::block_on(m.forward(seq, &[t], Want::Argmax)).expect("decode").argmax[0]);
    }
    out
}

/// 8 MiB storage bindings: each layer's K (and V) no longer fits one buffer, so the pages are
/// spread over two, and the sequence is placed across the boundary (filler sequences hold
/// the first shard's pages). Attention then runs per shard plus the reduce, with its keys
/// also cut into splits of 8; the greedy tokens still equal transformers'.
#[test]
fn kv_split_across_8_mib_bindings_generates_the_fixture_tokens() {
    let ctx = common::gpu_with(&DeviceOptions { max_binding_size: Some(8 << 20), ..Default::default() });
    let opts = ModelOptions { context: Some(1024), max_seqs: 13, attention_splits: Some(3), attention_split_keys: 8, ..Default::default() };
    let (mut m, _) = load(ctx, opts);
    let layout = *m.kv.layout();
    assert_eq!(layout.n_shards, 2, "{layout:?}");
    let mem = m.memory();
    assert_eq!(mem.kv_buffers_per_layer, 2);
    assert_eq!(mem.ledger_bytes, mem.total(), "allocations the report does not explain");
    // Fill all but the last 2 pages of shard 0 with filler sequences (reserved, never run).
    let page = layout.page_size;
    let mut left = (layout.pages_per_shard - 2) * page;
    let mut fillers = Vec::new();
    while left > 0 {
        let s = m.new_sequence().unwrap();
        let n = left.min(1024);
        m.kv.alloc.append(s, n).unwrap();
        left -= n;
        fillers.push(s);
    }
    for case in cases().iter().take(3) {
        let prompt = common::ids(&case["input_ids"]);
        let want = common::ids(&case["greedy_ids"]);
        let seq = m.new_sequence().unwrap();
        let got = greedy(&mut m, seq, &prompt, want.len());
        let pages = m.kv.alloc.pages(seq).unwrap().to_vec();
        let shards: std::collections::BTreeSet<usize> = pages.iter().map(|&p| p as usize / layout.pages_per_shard).collect();
        m.release_sequence(seq);
        assert_eq!(shards.len(), 2, "{}: the sequence should span both shards (pages {pages:?})", case["name"]);
        assert_eq!(got, want, "{}: greedy tokens with the KV split across two 8 MiB buffers", case["name"]);
    }
    for s in fillers {
        m.release_sequence(s);
    }
    assert_eq!(m.kv.alloc.free_pages(), m.kv.alloc.total_pages(), "every page back");
}

/// A forked sequence shares the prompt's pages; the first write into the shared partial page
/// copies it (copy-on-write) and both branches decode the fixture's tokens.
#[test]
fn forked_sequences_copy_on_write_and_decode_the_same_tokens() {
    let (mut m, _) = load(common::gpu(), ModelOptions { context: Some(256), max_seqs: 2, ..Default::default() });
    let case = &cases()[0];
    let prompt = common::ids(&case["input_ids"]);
    let want = common::ids(&case["greedy_ids"]);
    let n = want.len().min(8);
    assert!(!prompt.len().is_multiple_of(16), "the prompt must end inside a page");
    let a = m.new_sequence().unwrap();
    let first = pollster::block_on(m.forward(a, &prompt, Want::Argmax)).unwrap().argmax[0];
    assert_eq!(first, want[0]);
    let used = m.kv.alloc.used_pages();
    let b = m.fork_sequence(a).unwrap();
    assert_eq!(m.kv.alloc.used_pages(), used, "a fork takes no pages");
    for seq in [a, b] {
        let mut out = vec![first];
        while out.len() < n {
            let t = *out.last().unwrap();
            out.push(pollster::block_on(m.forward(seq, &[t], Want::Argmax)).unwrap().argmax[0]);
        }
        assert_eq!(out, want[..n], "sequence {seq} after the fork");
    }
    assert_eq!(m.kv.alloc.stats().cow_copies, 1, "one partial page copied");
    m.release_sequence(a);
    m.release_sequence(b);
}

/// Two requests with a common prompt prefix (the chat template's system turn and most of the
/// question): the second reuses the first one's full pages (counted) and produces the same
/// tokens as with the prefix cache off.
#[test]
fn requests_with_a_common_prefix_share_pages_and_tokens() {
    let (mut m, tok) = load(common::gpu(), ModelOptions { context: Some(256), ..Default::default() });
    let chat = |q: &str| {
        let t = tok.chat_template().unwrap();
        tok.encode_chat(&t.render(&[lantern::model::tokenizer::ChatMessage::user(q.to_string())], true).unwrap()).unwrap()
    };
    let a = chat("Name three colours of the rainbow, please, in order.");
    let b = chat("Name three colours of the rainbow, please, backwards.");
    let common_len = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
    assert!(common_len >= 32, "prompts share {common_len} tokens");
    let req = |ids: &Vec<u32>| GenerateRequest {
        prompt_ids: ids.clone(),
        max_tokens: 6,
        sampling: SamplingParams::default(),
        stop_ids: vec![],
        stop_strings: vec![],
        speculation: Default::default(),
        constraint: None,
        logprobs: None,
        bias: Default::default(),
    };
    let run = |m: &mut GpuModel, ids: &Vec<u32>| pollster::block_on(generate(m, &tok, &req(ids), |_| true)).expect("generate");
    let ga = run(&mut m, &a);
    assert_eq!(ga.cached_prompt_tokens, 0);
    let gb = run(&mut m, &b);
    let stats = m.kv.alloc.stats();
    assert_eq!(gb.cached_prompt_tokens, common_len / 16 * 16, "whole shared pages reused");
    assert_eq!(stats.hit_pages as usize, common_len / 16);
    // The same prompt again: everything but the last partial page comes from the cache.
    let ga2 = run(&mut m, &a);
    assert_eq!(ga2.cached_prompt_tokens, (a.len() - 1) / 16 * 16);
    assert_eq!(ga2.output_ids, ga.output_ids);
    // Without the cache: the same tokens.
    m.options.prefix_cache = false;
    m.kv.alloc.clear_prefix_cache();
    let gb_cold = run(&mut m, &b);
    assert_eq!(gb_cold.cached_prompt_tokens, 0);
    assert_eq!(gb.output_ids, gb_cold.output_ids, "prefix-cache hit changed the output");
    assert_eq!(m.kv.alloc.free_pages(), m.kv.alloc.total_pages());
}

/// f16, q8 and q4 caches against transformers' greedy tokens (f32 reproduces them exactly;
/// see smollm2.rs): the agreement is reported, and must stay high.
#[test]
fn f16_q8_and_q4_kv_caches_report_their_agreement() {
    for (dtype, floor) in [(KvDtype::F16, 0.9), (KvDtype::Q8, 0.6), (KvDtype::Q4, 0.2)] {
        let (mut m, _) = load(common::gpu(), ModelOptions { context: Some(256), kv_dtype: dtype, ..Default::default() });
        let (mut same, mut total, mut first_div) = (0usize, 0usize, Vec::new());
        for case in cases() {
            let prompt = common::ids(&case["input_ids"]);
            let want = common::ids(&case["greedy_ids"]);
            let seq = m.new_sequence().unwrap();
            let got = greedy(&mut m, seq, &prompt, want.len());
            m.release_sequence(seq);
            same += got.iter().zip(&want).filter(|(a, b)| a == b).count();
            total += want.len();
            first_div.push((0..want.len()).find(|&i| got[i] != want[i]).unwrap_or(want.len()));
        }
        let agreement = same as f64 / total as f64;
        eprintln!(
            "{dtype:?} KV: {same}/{total} = {:.1}% greedy tokens agree with transformers; first divergence per case {first_div:?}; KV cache {} bytes",
            100.0 * agreement,
            m.memory().kv_cache
        );
        assert!(agreement >= floor, "{dtype:?} KV agreement {agreement:.3} < {floor}");
    }
}

/// A budget that holds 9 pages gives a 9-page cache (fewer than the 12 that 3 sequences of 64
/// tokens would take); a request whose prompt and output cannot fit the free pages is refused
/// before any work, saying what it needs and what is free, and running sequences keep their
/// pages; a budget short of one context fails the load naming every term.
#[test]
fn budget_sizes_the_cache_and_a_full_cache_refuses_with_a_message() {
    use lantern::kv::plan::{kv_bytes_per_token, reserve_bytes};
    use lantern::model::plan::workspace_bytes;
    let l = load_path(&common::smollm2_gguf()).expect("load SmolLM2 GGUF");
    let c = l.weights.config.clone();
    let opts = ModelOptions { context: Some(64), max_seqs: 3, ..Default::default() };
    // Weight bytes as the load counts them, from a load without a budget.
    let ctx = common::gpu_with(&Default::default());
    let probe = pollster::block_on(GpuModel::load(ctx.clone(), &l.weights, opts.clone())).expect("upload");
    let weights = probe.memory().weight_bytes() + probe.memory().window_padding;
    // The CPU adapters' x textures (prefill input copies) are workspace too.
    let x_textures = probe.memory().x_textures;
    drop(probe);
    let ws = workspace_bytes(&c, opts.max_batch_tokens, opts.max_logit_rows.min(opts.max_batch_tokens), 64) + x_textures;
    let per_page = kv_bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, KvDtype::F32) * 16;
    let budget_for = |pages: u64| {
        let rest = weights + ws + pages * per_page + per_page / 2;
        // The reserve depends on the budget: 64 MiB here (5% of it is less).
        let b = rest + (64 << 20);
        assert_eq!(reserve_bytes(b), 64 << 20);
        b
    };
    let b9 = budget_for(9);
    let mut m = pollster::block_on(GpuModel::load(ctx.clone(), &l.weights, ModelOptions { memory_budget: Some(b9), ..opts.clone() }))
        .expect("upload with a budget");
    assert_eq!(m.kv.alloc.total_pages(), 9, "pages from the budget");
    assert_eq!(m.memory().budget, Some(b9));
    assert_eq!(m.memory().kv_pages_requested, 12);
    let tok = l.tokenizer.clone().expect("tokenizer");
    let hogs: Vec<usize> = (0..2)
        .map(|_| {
            let s = m.new_sequence().unwrap();
            m.kv.alloc.append(s, 64).unwrap();
            s
        })
        .collect();
    assert_eq!(m.kv.alloc.free_pages(), 1);
    let prompt = tok.encode("The capital of France is").unwrap();
    let req = GenerateRequest {
        prompt_ids: prompt.clone(),
        max_tokens: 30 - prompt.len(),
        sampling: SamplingParams::default(),
        stop_ids: vec![],
        stop_strings: vec![],
        speculation: Default::default(),
        constraint: None,
        logprobs: None,
        bias: Default::default(),
    };
    let mut streamed = String::new();
    let err = pollster::block_on(generate(&mut m, &tok, &req, |p| {
        streamed.push_str(p);
        true
    }))
    .expect_err("a request needing 2 pages with 1 free");
    let msg = err.to_string();
    assert!(matches!(err, lantern::LanternError::Kv(lantern::kv::KvError::Full { needed: 2, free: 1, total: 9, .. })), "{err:?}");
    assert!(msg.contains("needs 2 more page(s) (32 tokens of room) but only 1 of 9 pages are free"), "{msg}");
    assert!(streamed.is_empty(), "no partial output: {streamed:?}");
    assert_eq!(m.kv.alloc.free_pages(), 1, "the refused request holds nothing");
    for s in hogs {
        assert_eq!(m.kv.alloc.len(s).unwrap(), 64, "running sequences untouched");
    }
    drop(m);
    // Three pages cannot hold one 64-token context.
    let r =
        pollster::block_on(GpuModel::load(ctx.clone(), &l.weights, ModelOptions { memory_budget: Some(budget_for(3)), ..opts.clone() }));
    let msg = match r {
        Err(e @ lantern::LanternError::MemoryBudget { .. }) => e.to_string(),
        Err(e) => panic!("wrong error: {e:?}"),
        Ok(_) => panic!("a budget of 3 pages loaded a 64-token context"),
    };
    assert!(msg.contains("one sequence of 64 tokens") && msg.contains("of weights") && msg.contains("--memory-budget"), "{msg}");
    assert!(!msg.contains("weights alone"), "{msg}");
    // A budget below the weights says so (it used to blame window rings the model lacks).
    let r = pollster::block_on(GpuModel::load(ctx, &l.weights, ModelOptions { memory_budget: Some(1 << 20), ..opts }));
    let msg = match r {
        Err(e @ lantern::LanternError::MemoryBudget { .. }) => e.to_string(),
        Err(e) => panic!("wrong error: {e:?}"),
        Ok(_) => panic!("a 1 MiB budget loaded the model"),
    };
    assert!(msg.contains("the weights alone are over the budget") && !msg.contains("window rings"), "{msg}");
}

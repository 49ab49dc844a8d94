//! `lantern::eval` on the GPU against independent computations from the CPU reference forward
//! pass (f64): perplexity in every windowing mode, `compare` of a model with itself and with a
//! perturbed copy; SmolLM2's perplexity against the transformers fixture; and the
//! `lantern eval ppl` / `lantern eval compare` commands on a tiny GGUF.

mod common;

use common::random::Rng;

use std::collections::HashMap;

use lantern::eval::{compare, perplexity, EvalError, Window, WindowMode};
use lantern::model::forward::{GpuModel, ModelOptions};
use lantern::model::{Arch, HostTensor, ModelConfig, ModelWeights};
use lantern::reference::ReferenceModel;
use lantern::LanternError;

/// A seeded random Llama model (GQA, untied head). `noise` > 0 adds `noise * U(-1, 1)` from a
/// second generator to every value: a "quantized" copy of the same model.
fn random_model(seed: u64, vocab: usize, noise: f32) -> ModelWeights {
    let (d, f, layers, heads, kv_heads, hd) = (48, 80, 2, 4, 2, 12);
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
        max_position_embeddings: 512,
        tie_word_embeddings: false,
        qkv_bias: false,
        bos_token_id: None,
        eos_token_ids: vec![],
        block: Default::default(),
    };
    let mut rng = Rng::new(seed);
    let mut nrng = Rng::new(seed ^ 0xABCDEF);
    let mut tensors = HashMap::new();
    let mut add = |name: String, shape: Vec<usize>, scale: f32, offset: f32| {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|_| offset + scale * rng.uniform() + noise * nrng.uniform()).collect();
        tensors.insert(name.clone(), HostTensor::from_f32(name, shape, &v));
    };
    add("model.embed_tokens.weight".into(), vec![vocab, d], 0.5, 0.0);
    for l in 0..layers {
        let p = format!("model.layers.{l}");
        add(format!("{p}.input_layernorm.weight"), vec![d], 0.2, 1.0);
        add(format!("{p}.post_attention_layernorm.weight"), vec![d], 0.2, 1.0);
        add(format!("{p}.self_attn.q_proj.weight"), vec![heads * hd, d], 0.2, 0.0);
        add(format!("{p}.self_attn.k_proj.weight"), vec![kv_heads * hd, d], 0.2, 0.0);
        add(format!("{p}.self_attn.v_proj.weight"), vec![kv_heads * hd, d], 0.2, 0.0);
        add(format!("{p}.self_attn.o_proj.weight"), vec![d, heads * hd], 0.2, 0.0);
        add(format!("{p}.mlp.gate_proj.weight"), vec![f, d], 0.2, 0.0);
        add(format!("{p}.mlp.up_proj.weight"), vec![f, d], 0.2, 0.0);
        add(format!("{p}.mlp.down_proj.weight"), vec![d, f], 0.2, 0.0);
    }
    add("model.norm.weight".into(), vec![d], 0.2, 1.0);
    add("lm_head.weight".into(), vec![vocab, d], 0.3, 0.0);
    ModelWeights { config, tensors, source: format!("random model seed {seed} noise {noise}") }
}

/// Small steps and pages so windows cross chunk and page boundaries.
fn opts(context: usize) -> ModelOptions {
    ModelOptions { context: Some(context), page_size: 4, max_batch_tokens: 7, max_logit_rows: 5, ..Default::default() }
}

fn gpu_model(w: &ModelWeights, context: usize) -> GpuModel {
    pollster::block_on(GpuModel::load(common::gpu(), w, opts(context))).expect("load model on GPU")
}

fn random_ids(seed: u64, n: usize, vocab: usize) -> Vec<u32> {
    let mut r = Rng::new(seed);
    (0..n).map(|_| r.below(vocab) as u32).collect()
}

/// log softmax in f64.
fn log_softmax(row: &[f32]) -> Vec<f64> {
    let m = row.iter().fold(f64::NEG_INFINITY, |a, &x| a.max(x as f64));
    let lse = m + row.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln();
    row.iter().map(|&x| x as f64 - lse).collect()
}

/// The Hugging Face strided-perplexity loop, written out again from the guide, on the
/// reference forward pass: (scored positions, NLL per scored position).
fn reference_nll(r: &ReferenceModel, ids: &[u32], max_length: usize, stride: usize) -> Vec<(usize, f64)> {
    let vocab = r.config().vocab_size;
    let seq_len = ids.len();
    let mut out = Vec::new();
    let mut prev_end_loc = 0;
    let mut begin_loc = 0;
    while begin_loc < seq_len {
        let end_loc = (begin_loc + max_length).min(seq_len);
        let trg_len = end_loc - prev_end_loc; // may differ from stride on the last loop
        let window = &ids[begin_loc..end_loc];
        let logits = r.forward(window);
        // labels = window with all but the last trg_len masked; the shift drops label 0.
        for j in 1..window.len() {
            if j + trg_len < window.len() {
                continue;
            }
            let lp = log_softmax(&logits[(j - 1) * vocab..j * vocab]);
            out.push((begin_loc + j, -lp[window[j] as usize]));
        }
        prev_end_loc = end_loc;
        if end_loc == seq_len {
            break;
        }
        begin_loc += stride;
    }
    out
}

#[test]
fn perplexity_matches_the_reference_in_every_window_mode() {
    let w = random_model(11, 61, 0.0);
    let r = ReferenceModel::new(&w).unwrap();
    let ids = random_ids(5, 45, 61);
    let mut m = gpu_model(&w, 16);
    // (window, HF max_length, HF stride, expected mode, expected windows)
    let cases = [
        (Window::Auto, 16, 16, WindowMode::Chunks, 3),
        (Window::Chunks { size: 10 }, 10, 10, WindowMode::Chunks, 5),
        (Window::Sliding { size: 16, stride: 5 }, 16, 5, WindowMode::Sliding, 7),
        (Window::Sliding { size: 12, stride: 1 }, 12, 1, WindowMode::Sliding, 34),
        (Window::Sliding { size: 16, stride: 16 }, 16, 16, WindowMode::Sliding, 3),
    ];
    for (window, max_length, stride, mode, windows) in cases {
        let mut calls = 0;
        let got = pollster::block_on(perplexity(&mut m, &ids, window, |_| calls += 1)).unwrap();
        let want = reference_nll(&r, &ids, max_length, stride);
        let sum: f64 = want.iter().map(|x| x.1).sum();
        let ppl = (sum / want.len() as f64).exp();
        assert_eq!(got.window.mode, mode, "{window:?}");
        assert_eq!(got.window.windows, windows, "{window:?}");
        assert_eq!(got.token_count, ids.len());
        assert_eq!(got.predicted_tokens, want.len(), "{window:?}");
        let pos: Vec<usize> = got.per_token.iter().map(|t| t.pos).collect();
        assert_eq!(pos, want.iter().map(|x| x.0).collect::<Vec<_>>(), "{window:?}: scored positions");
        for (t, &(p, nll)) in got.per_token.iter().zip(&want) {
            assert_eq!(t.id, ids[p]);
            assert!((t.nll - nll).abs() <= 1e-3 * nll.abs().max(1.0), "{window:?}: token {p}: {} vs {nll}", t.nll);
        }
        let rel = (got.perplexity - ppl).abs() / ppl;
        eprintln!(
            "{window:?}: ppl {} (reference {ppl}, rel diff {rel:e}), {} windows, {} calls",
            got.perplexity, got.window.windows, calls
        );
        assert!(rel <= 1e-4, "{window:?}: perplexity {} vs reference {ppl} (rel {rel:e})", got.perplexity);
        assert!((got.mean_nll.exp() - got.perplexity).abs() <= 1e-12 * got.perplexity);
        assert!(calls >= 2 && got.tokens_per_s > 0.0);
    }
    // One window when the text fits the context: T - 1 tokens scored.
    let mut big = gpu_model(&w, 64);
    let got = pollster::block_on(perplexity(&mut big, &ids, Window::Auto, |_| {})).unwrap();
    let want = reference_nll(&r, &ids, 64, 64);
    let ppl = (want.iter().map(|x| x.1).sum::<f64>() / want.len() as f64).exp();
    assert_eq!(got.window.mode, WindowMode::Single);
    assert_eq!(got.predicted_tokens, ids.len() - 1);
    assert_eq!(got.tokens_evaluated, ids.len() - 1);
    assert!((got.perplexity - ppl).abs() / ppl <= 1e-4, "{} vs {ppl}", got.perplexity);
    // The cache is left empty: the same call again gives the same number.
    let again = pollster::block_on(perplexity(&mut big, &ids, Window::Auto, |_| {})).unwrap();
    assert_eq!(again.perplexity, got.perplexity);
    assert_eq!(big.kv.alloc.free_pages(), big.kv.alloc.config.num_pages);
}

#[test]
fn perplexity_errors_are_typed() {
    let w = random_model(11, 61, 0.0);
    let mut m = gpu_model(&w, 16);
    let e = pollster::block_on(perplexity(&mut m, &[3], Window::Auto, |_| {})).unwrap_err();
    assert!(matches!(e, LanternError::Eval(EvalError::TooFewTokens { tokens: 1 })), "{e}");
    let e = pollster::block_on(perplexity(&mut m, &[3; 20], Window::Chunks { size: 17 }, |_| {})).unwrap_err();
    assert!(matches!(e, LanternError::Eval(EvalError::WindowTooLarge { size: 17, context: 16 })), "{e}");
    let e = pollster::block_on(perplexity(&mut m, &[3; 20], Window::Sliding { size: 8, stride: 9 }, |_| {})).unwrap_err();
    assert!(matches!(e, LanternError::Eval(EvalError::BadStride { .. })), "{e}");
}

#[test]
fn compare_of_a_model_with_itself_agrees_everywhere() {
    let w = random_model(21, 53, 0.0);
    let mut a = gpu_model(&w, 40);
    let mut b = gpu_model(&w, 40);
    let prompts = vec![random_ids(1, 9, 53), random_ids(2, 1, 53), random_ids(3, 14, 53)];
    let rep = pollster::block_on(compare(&mut a, &mut b, &prompts, 6, |_| {})).unwrap();
    assert_eq!(rep.identical_prompts, 3);
    assert_eq!(rep.token_agreement, Some(1.0));
    assert_eq!(rep.mean_first_divergence, None);
    for p in &rep.prompts {
        assert_eq!(p.first_divergence, None);
        assert_eq!(p.a_ids, p.b_ids);
        assert_eq!(p.a_ids.len(), 6);
        assert_eq!(p.generated.positions, 6);
        assert_eq!(p.prompt.positions, p.prompt_tokens - 1);
    }
    assert_eq!(rep.prompts[1].prompt.top1_agreement, None, "a one-token prompt has no prompt positions");
    assert_eq!(rep.generated.positions, 18);
    assert_eq!(rep.prompt.positions, 8 + 13);
    assert_eq!(rep.generated.top1_agreement, Some(1.0));
    assert_eq!(rep.prompt.top1_agreement, Some(1.0));
    assert!(rep.generated.max_kl.unwrap().abs() < 1e-12 && rep.prompt.max_kl.unwrap().abs() < 1e-12, "{rep:?}");
    // Greedy through the KV cache reproduces the reference's greedy decoding.
    let r = ReferenceModel::new(&w).unwrap();
    for (p, c) in prompts.iter().zip(&rep.prompts) {
        assert_eq!(c.a_ids, r.greedy(p, 6));
    }
    assert_eq!(a.kv.alloc.free_pages(), a.kv.alloc.config.num_pages);
    assert_eq!(b.kv.alloc.free_pages(), b.kv.alloc.config.num_pages);
}

/// Top-1 minus top-2 logit.
fn margin(row: &[f32]) -> f32 {
    let mut v = row.to_vec();
    v.sort_by(|x, y| y.total_cmp(x));
    v[0] - v[1]
}

#[test]
fn compare_of_two_models_matches_an_independent_computation() {
    let vocab = 53;
    let wa = random_model(21, vocab, 0.0);
    let wb = random_model(21, vocab, 0.01);
    let (ra, rb) = (ReferenceModel::new(&wa).unwrap(), ReferenceModel::new(&wb).unwrap());
    let n = 8;
    // Prompts whose greedy steps all have a clear winner on the reference (top-2 margin above
    // 1e-2 for both models), so f32-vs-f64 rounding cannot flip a choice.
    let min_margin = |r: &ReferenceModel, p: &[u32], g: &[u32]| {
        let mut s = p.to_vec();
        s.extend(&g[..n - 1]);
        let logits = r.forward(&s);
        (p.len() - 1..s.len()).map(|i| margin(&logits[i * vocab..(i + 1) * vocab])).fold(f32::MAX, f32::min)
    };
    let prompts: Vec<Vec<u32>> = (0..200u64)
        .map(|i| random_ids(100 + i, 3 + (i % 7) as usize * 2, vocab))
        .filter(|p| min_margin(&ra, p, &ra.greedy(p, n)) > 1e-2 && min_margin(&rb, p, &rb.greedy(p, n)) > 1e-2)
        .take(6)
        .collect();
    assert_eq!(prompts.len(), 6);
    let mut a = gpu_model(&wa, 40);
    let mut b = gpu_model(&wb, 40);
    let rep = pollster::block_on(compare(&mut a, &mut b, &prompts, n, |_| {})).unwrap();
    let (mut gen_kl, mut gen_top1, mut gen_pos) = (0.0f64, 0usize, 0usize);
    let mut diverged = 0;
    for (p, c) in prompts.iter().zip(&rep.prompts) {
        // Greedy on the reference, without a cache.
        let ga = ra.greedy(p, n);
        let gb = rb.greedy(p, n);
        assert_eq!(c.a_ids, ga, "model A greedy");
        assert_eq!(c.b_ids, gb, "model B greedy");
        let div = ga.iter().zip(&gb).position(|(x, y)| x != y);
        assert_eq!(c.first_divergence, div);
        let agree = ga.iter().zip(&gb).filter(|(x, y)| x == y).count();
        assert_eq!(c.matching_tokens, agree);
        assert_eq!(c.token_agreement, Some(agree as f64 / n as f64));
        diverged += div.is_some() as usize;
        // Teacher forcing on prompt + A's continuation.
        let mut s = p.clone();
        s.extend(&ga);
        let la = ra.forward(&s[..s.len() - 1]);
        let lb = rb.forward(&s[..s.len() - 1]);
        let (mut kl_sum, mut top1) = (0.0f64, 0usize);
        let (mut p_kl, mut p_top1) = (0.0f64, 0usize);
        for i in 0..s.len() - 1 {
            let (xa, xb) = (&la[i * vocab..(i + 1) * vocab], &lb[i * vocab..(i + 1) * vocab]);
            let (pa, pb) = (log_softmax(xa), log_softmax(xb));
            let kl: f64 = pa.iter().zip(&pb).map(|(x, y)| x.exp() * (x - y)).sum();
            let same = lantern::engine::sampler::argmax(xa) == lantern::engine::sampler::argmax(xb);
            if i + 1 < p.len() {
                p_kl += kl;
                p_top1 += same as usize;
            } else {
                kl_sum += kl;
                top1 += same as usize;
            }
        }
        assert_eq!(c.generated.positions, n);
        assert_eq!(c.generated.top1_matches, top1);
        let close = |got: f64, want: f64| (got - want).abs() <= 1e-3 * want + 1e-7;
        assert!(close(c.generated.sum_kl, kl_sum), "generated KL {} vs {kl_sum}", c.generated.sum_kl);
        assert_eq!(c.prompt.positions, p.len() - 1);
        assert_eq!(c.prompt.top1_matches, p_top1);
        assert!(close(c.prompt.sum_kl, p_kl), "prompt KL {} vs {p_kl}", c.prompt.sum_kl);
        gen_kl += kl_sum;
        gen_top1 += top1;
        gen_pos += n;
        eprintln!("prompt {}: divergence {div:?}, agreement {agree}/{n}, top-1 {top1}/{n}, mean KL {:e}", c.index, kl_sum / n as f64);
    }
    assert!(diverged > 0 && diverged < prompts.len(), "the perturbed model should diverge on some prompts, not all: {diverged}");
    let firsts: Vec<usize> = rep.prompts.iter().filter_map(|c| c.first_divergence).collect();
    assert_eq!(rep.mean_first_divergence, Some(firsts.iter().sum::<usize>() as f64 / firsts.len() as f64));
    assert_eq!(rep.identical_prompts, prompts.len() - diverged);
    assert_eq!(rep.generated.positions, gen_pos);
    assert_eq!(rep.generated.top1_matches, gen_top1);
    assert!((rep.generated.mean_kl.unwrap() - gen_kl / gen_pos as f64).abs() <= 1e-3 * gen_kl / gen_pos as f64 + 1e-7);
    assert!(rep.generated.mean_kl.unwrap() > 0.0);
}

#[test]
fn compare_needs_the_same_vocabulary_and_room_in_the_context() {
    let mut a = gpu_model(&random_model(1, 53, 0.0), 16);
    let mut b = gpu_model(&random_model(1, 54, 0.0), 16);
    let e = pollster::block_on(compare(&mut a, &mut b, &[vec![1, 2]], 4, |_| {})).unwrap_err();
    assert!(matches!(e, LanternError::Eval(EvalError::VocabMismatch { a: 53, b: 54 })), "{e}");
    let mut b = gpu_model(&random_model(2, 53, 0.0), 16);
    let e = pollster::block_on(compare(&mut a, &mut b, &[vec![1; 10]], 8, |_| {})).unwrap_err();
    assert!(matches!(e, LanternError::Eval(EvalError::PromptTooLong { needed: 17, context: 16, .. })), "{e}");
    let e = pollster::block_on(compare(&mut a, &mut b, &[vec![1], vec![]], 8, |_| {})).unwrap_err();
    assert!(matches!(e, LanternError::Eval(EvalError::EmptyPrompt { index: 1 })), "{e}");
}

#[test]
fn smollm2_perplexity_matches_transformers() {
    use lantern::model::load::load_path;
    let fx = common::fixture_json("smollm2/perplexity.json");
    let text = std::fs::read_to_string(common::fixtures_dir().join("smollm2/perplexity.txt")).unwrap();
    let l = load_path(&common::smollm2_gguf()).expect("load SmolLM2 GGUF");
    let ids = l.tokenizer.as_ref().expect("GGUF tokenizer").encode(&text).unwrap();
    assert_eq!(ids, common::ids(&fx["input_ids"]), "token ids of perplexity.txt");
    // Steps of 256 tokens with every row's logits, as `lantern eval` loads models.
    let opts = ModelOptions { max_batch_tokens: 256, max_logit_rows: 256, ..Default::default() };
    let mut m = pollster::block_on(GpuModel::load(common::gpu(), &l.weights, opts)).expect("upload SmolLM2");
    let rep = pollster::block_on(perplexity(&mut m, &ids, Window::Auto, |_| {})).unwrap();
    let want = fx["perplexity"].as_f64().unwrap();
    let want_nll = fx["nll_per_token"].as_array().unwrap();
    let worst = rep.per_token.iter().zip(want_nll).map(|(t, w)| (t.nll - w.as_f64().unwrap()).abs()).fold(0.0f64, f64::max);
    eprintln!(
        "SmolLM2 perplexity {:.4} (transformers {want:.4}, rel diff {:.2e}), mean NLL {:.6}, max per-token NLL diff {worst:.2e}, {} tokens in {:.1} s ({:.1} tokens/s)",
        rep.perplexity,
        (rep.perplexity - want).abs() / want,
        rep.mean_nll,
        rep.tokens_evaluated,
        rep.elapsed_ms / 1e3,
        rep.tokens_per_s
    );
    assert_eq!(rep.token_count, fx["token_count"].as_u64().unwrap() as usize);
    assert_eq!(rep.predicted_tokens, fx["predicted_tokens"].as_u64().unwrap() as usize);
    assert_eq!(rep.window.mode, WindowMode::Single);
    assert!((rep.perplexity - want).abs() / want <= 0.005, "perplexity {} vs transformers {want}", rep.perplexity);
}

// ---- the CLI -------------------------------------------------------------------------------

/// A tiny GGUF with random weights and a byte-level BPE vocabulary of single characters
/// (plus one merge), so text files can be tokenized.
fn tiny_gguf(dir: &std::path::Path) -> std::path::PathBuf {
    use common::{Meta, TinyShape, TINY};
    let tokens: Vec<String> = ["a", "b", "c", "d", "e", "Ġ", "Ċ", "ab", ".", "f", "g", "h"].iter().map(|s| s.to_string()).collect();
    let shape = TinyShape { vocab: tokens.len() as u64, ..TINY };
    let mut w = common::tiny_model("llama", shape, common::ggml::F32);
    w.set("tokenizer.ggml.tokens", Meta::StrArray(tokens));
    w.set("tokenizer.ggml.merges", Meta::StrArray(vec!["a b".into()]));
    let mut rng = Rng::new(77);
    for t in &mut w.tensors {
        let norm = t.name.contains("norm");
        let v: Vec<f32> = (0..t.data.len() / 4).map(|_| if norm { 1.0 + 0.2 * rng.uniform() } else { 0.4 * rng.uniform() }).collect();
        t.data = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    }
    let path = dir.join("tiny.gguf");
    std::fs::write(&path, w.to_bytes()).unwrap();
    path
}

fn lantern_cli(args: &[&str]) -> serde_json::Value {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_lantern")).env("LANTERN_OFFLINE", "1").args(args).output().unwrap();
    assert!(out.status.success(), "lantern {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("lantern {args:?}: stdout is not one JSON object ({e})"))
}

#[test]
fn cli_eval_ppl_and_compare_print_json() {
    let dir = std::env::temp_dir().join(format!("lantern-eval-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let model = tiny_gguf(&dir);
    let text = "ab ba cab dead.\nbead fab, a cafe. ab ab ab bad bead abc.\nface age hedge deaf.";
    let text = text.replace(',', "");
    std::fs::write(dir.join("text.txt"), &text).unwrap();
    let (m, t) = (model.to_str().unwrap(), dir.join("text.txt"));
    let t = t.to_str().unwrap();

    // Library result on the same ids, for the numbers.
    let l = lantern::model::load::load_path(&model).unwrap();
    let ids = l.tokenizer.as_ref().unwrap().encode(&text).unwrap();
    assert!(ids.len() > 40, "{} tokens", ids.len());
    let mut g =
        pollster::block_on(GpuModel::load(common::gpu(), &l.weights, ModelOptions { context: Some(16), ..Default::default() })).unwrap();
    let lib = pollster::block_on(perplexity(&mut g, &ids, Window::Sliding { size: 16, stride: 6 }, |_| {})).unwrap();

    let v = lantern_cli(&["eval", "ppl", "--model", m, "--text", t, "--context", "16", "--stride", "6", "--json", "--per-token"]);
    assert_eq!(common::ids(&v["input_ids"]), ids);
    assert_eq!(v["token_count"], ids.len());
    assert_eq!(v["predicted_tokens"], ids.len() - 1);
    assert_eq!(v["window"]["mode"], "sliding");
    assert_eq!(v["window"]["stride"], 6);
    assert_eq!(v["per_token"].as_array().unwrap().len(), ids.len() - 1);
    let ppl = v["perplexity"].as_f64().unwrap();
    assert!((ppl - lib.perplexity).abs() <= 1e-9 * lib.perplexity, "CLI {ppl} vs library {}", lib.perplexity);
    assert!((v["mean_nll"].as_f64().unwrap().exp() - ppl).abs() <= 1e-9 * ppl);
    assert!(v["tokens_per_s"].as_f64().unwrap() > 0.0 && v["adapter"]["name"].is_string());

    let v = lantern_cli(&["eval", "ppl", "--model", m, "--text", t, "--json"]);
    assert_eq!(v["window"]["mode"], "single");
    assert!(v.get("per_token").is_none(), "per-token NLL only with --per-token");

    // Prompts as lines; model A twice: everything agrees.
    std::fs::write(dir.join("prompts.txt"), "ab cab\n\nbead fab\n").unwrap();
    let p = dir.join("prompts.txt");
    let v = lantern_cli(&["eval", "compare", "--model", m, "--model", m, "--prompts", p.to_str().unwrap(), "--max-tokens", "4", "--json"]);
    assert_eq!(v["prompts"].as_array().unwrap().len(), 2);
    assert_eq!(v["identical_prompts"], 2);
    assert_eq!(v["token_agreement"], 1.0);
    assert_eq!(v["generated"]["positions"], 8);
    assert_eq!(v["generated"]["top1_agreement"], 1.0);
    assert!(v["generated"]["max_kl"].as_f64().unwrap().abs() < 1e-12);
    assert!(v["prompts"][0]["a_text"].is_string());

    // The fixture format (objects with input_ids); f32 against f16 weights of one model.
    std::fs::write(dir.join("cases.json"), r#"[{"name": "x", "input_ids": [0, 7, 5, 2]}, {"name": "y", "prompt_text": "bead"}]"#).unwrap();
    let p = dir.join("cases.json");
    let v = lantern_cli(&[
        "eval",
        "compare",
        "--model",
        m,
        "--weights",
        "f32",
        "--weights",
        "f16",
        "--prompts",
        p.to_str().unwrap(),
        "--max-tokens",
        "3",
        "--json",
    ]);
    assert_eq!(v["prompts"][0]["name"], "x");
    assert_eq!(common::ids(&v["prompts"][0]["prompt_ids"]), vec![0, 7, 5, 2]);
    assert_eq!(v["a"]["weight_precision"], "f32");
    assert_eq!(v["b"]["weight_precision"], "f16");
    let kl = v["prompt"]["mean_kl"].as_f64().unwrap();
    assert!(kl > 0.0 && kl < 1e-3, "f16 rounding gives a small positive KL: {kl}");
    std::fs::remove_dir_all(&dir).ok();
}

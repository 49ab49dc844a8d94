//! Mixtures of experts on tiny random checkpoints made with transformers
//! (`tests/fixtures/tiny-moe`: Qwen3-MoE with a dense layer among sparse ones, Qwen3-MoE
//! without renormalised routing, Mixtral, OLMoE), loaded as Hugging Face folders. The CPU reference
//! must reproduce transformers' float32 logits at every position and its greedy continuation,
//! from the folder and from llama.cpp's GGUF conversion of it (3-D expert tensors split per
//! expert at load). The GPU forward pass (router, route and expert matvecs on the GPU) must do
//! the same, unquantized and with its experts quantized to packed formats.

mod common;

use std::path::PathBuf;

use lantern::model::forward::{GpuModel, ModelOptions, Want};
use lantern::model::load::load_path;
use lantern::model::Arch;
use lantern::reference::ReferenceModel;

fn dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-moe").join(name)
}

const TOL: f32 = 1e-4;

fn check(name: &str, arch: Arch, sparse: &[bool], renormalize: bool, idle: u64) {
    check_load(name, &dir(name), arch, sparse, renormalize, idle);
}

fn check_load(name: &str, path: &std::path::Path, arch: Arch, sparse: &[bool], renormalize: bool, idle: u64) {
    let folder = dir(name);
    let r = common::read_json(&folder.join("reference.json"));
    let w = load_path(path).unwrap_or_else(|e| panic!("{name}: {e}")).weights;
    assert_eq!(w.config.arch, arch, "{name}");
    let moe = w.config.block.moe.as_ref().expect("a mixture of experts");
    assert_eq!(moe.experts, r["config"]["num_experts"].as_u64().or(r["config"]["num_local_experts"].as_u64()).unwrap() as usize);
    assert_eq!(moe.experts_per_token, r["config"]["num_experts_per_tok"].as_u64().unwrap() as usize);
    assert_eq!(moe.renormalize, renormalize, "{name}");
    let layers: Vec<bool> = (0..w.config.num_layers).map(|l| w.config.block.experts(l).is_some()).collect();
    assert_eq!(layers, sparse, "{name}: which layers are sparse");
    assert_eq!(w.config.idle_expert_parameters(), idle, "{name}: parameters a token does not read");
    // The memory plan counts from the config what the file holds.
    let pc = lantern::model::plan::param_count(&w.config);
    let held: u64 = w.tensors.values().map(|t| t.shape.iter().product::<usize>() as u64).sum();
    assert_eq!((pc.total, pc.active), (held, held - idle), "{name}: parameters counted from the config");

    let ids = common::ids(&r["input_ids"]);
    let want = common::read_f32(&folder.join(r["logits"]["file"].as_str().unwrap()));
    let reference = ReferenceModel::new(&w).expect("reference");
    let got = reference.forward(&ids);
    assert_eq!(got.len(), want.len());
    let d = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
    assert!(d <= TOL, "{name}: CPU reference logits differ by {d:e}");
    let greedy = common::ids(&r["greedy_ids"]);
    assert_eq!(reference.greedy(&ids, greedy.len()), greedy, "{name}: greedy continuation");
    eprintln!("{name}: {} positions within {d:e} of transformers, {} greedy tokens exact", ids.len(), greedy.len());

    check_gpu(name, &w, &ids, &want, &greedy, TOL);
}

/// The GPU forward pass of `w` (expert kernels: router, route and expert matvecs on the GPU):
/// every position's logits within `tol` of `want`, prefill in chunks (the matmul shapes) and
/// then a token per step (the matvec shapes) giving `greedy`.
fn check_gpu(name: &str, w: &lantern::model::ModelWeights, ids: &[u32], want: &[f32], greedy: &[u32], tol: f32) {
    let opts = ModelOptions { context: Some(64), max_batch_tokens: 16, max_logit_rows: 16, page_size: 4, ..Default::default() };
    let mut m = pollster::block_on(GpuModel::load(common::gpu(), w, opts)).unwrap_or_else(|e| panic!("{name}: GPU load: {e}"));
    // What `lantern run` reports: a token reads every weight but the experts left out.
    assert!(m.weight_bytes_per_token() < m.weight_bytes(), "{name}");
    if w.tensors.values().all(|t| t.dtype == lantern::model::DType::F32) {
        assert_eq!(m.weight_bytes() - m.weight_bytes_per_token(), 4 * w.config.idle_expert_parameters(), "{name}: bytes a token skips");
    }
    let seq = m.new_sequence().unwrap();
    let gpu = pollster::block_on(m.forward_all_logits(seq, ids)).expect("forward");
    let d = gpu.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
    assert!(d <= tol, "{name}: GPU logits differ by {d:e}");
    m.release_sequence(seq);
    let seq = m.new_sequence().unwrap();
    let mut out = vec![pollster::block_on(m.forward(seq, ids, Want::Argmax)).unwrap().argmax[0]];
    while out.len() < greedy.len() {
        let t = *out.last().unwrap();
        out.push(pollster::block_on(m.forward(seq, &[t], Want::Argmax)).unwrap().argmax[0]);
    }
    assert_eq!(out, greedy, "{name}: GPU greedy continuation");
    eprintln!("{name}: GPU logits within {d:e}, {} greedy tokens exact", greedy.len());
}

#[test]
fn qwen3_moe_with_a_dense_layer() {
    // Two sparse layers, 6 idle experts each of 3 x 48 x 64.
    check("qwen3moe", Arch::Qwen3Moe, &[true, false, true], true, 2 * 6 * 3 * 48 * 64);
}

#[test]
fn qwen3_moe_without_renormalised_routing() {
    check("qwen3moe-unnormalised", Arch::Qwen3Moe, &[true, true], false, 2 * 3 * 3 * 40 * 64);
}

#[test]
fn mixtral() {
    check("mixtral", Arch::Mixtral, &[true, true], true, 2 * 2 * 3 * 160 * 64);
}

#[test]
fn olmoe_with_whole_projection_qk_norms() {
    check("olmoe", Arch::Olmoe, &[true, true], false, 2 * 6 * 3 * 48 * 64);
}

/// A llama.cpp conversion checked as the folder is, then loaded as `lantern run` loads a
/// GGUF: streamed a layer at a time, its 3-D expert tensors split and stacked again per layer.
fn check_gguf(name: &str, arch: Arch, renormalize: bool, idle: u64) {
    let gguf = dir(name).join("model.gguf");
    check_load(name, &gguf, arch, &[true, true], renormalize, idle);
    let r = common::read_json(&dir(name).join("reference.json"));
    let ids = common::ids(&r["input_ids"]);
    let want = common::read_f32(&dir(name).join("logits.f32"));
    let opts = ModelOptions { context: Some(64), max_batch_tokens: 16, max_logit_rows: 16, page_size: 4, ..Default::default() };
    let (mut m, _) =
        pollster::block_on(lantern::model::load::load_to_gpu(common::gpu(), &gguf, opts, &mut |_, _| {})).expect("streamed load");
    let seq = m.new_sequence().unwrap();
    let got = pollster::block_on(m.forward_all_logits(seq, &ids)).unwrap();
    let d = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
    assert!(d <= TOL, "{name} GGUF streamed: GPU logits differ by {d:e}");
}

#[test]
fn mixtral_from_llama_cpp_gguf() {
    check_gguf("mixtral", Arch::Mixtral, true, 2 * 2 * 3 * 160 * 64);
}

/// OLMoE as llama.cpp converts it (`olmoe`: whole-projection q/k norms, Q/K rows not permuted,
/// experts' weights not renormalised).
#[test]
fn olmoe_from_llama_cpp_gguf() {
    check_gguf("olmoe", Arch::Olmoe, false, 2 * 6 * 3 * 48 * 64);
}

/// llama.cpp renormalises Qwen3-MoE's expert weights whatever the checkpoint said (GGUF has
/// no `norm_topk_prob`), so the GGUF of the unnormalised checkpoint loads renormalised: its
/// logits equal the folder's run with renormalisation, which checks every expert tensor of
/// the conversion.
#[test]
fn qwen3_moe_from_llama_cpp_gguf_is_renormalised_as_llama_cpp_runs_it() {
    let folder = dir("qwen3moe-unnormalised");
    let g = load_path(&folder.join("model.gguf")).expect("gguf").weights;
    assert_eq!(g.config.arch, Arch::Qwen3Moe);
    let moe = g.config.block.moe.as_ref().unwrap();
    assert_eq!((moe.experts, moe.experts_per_token, moe.expert_intermediate, moe.renormalize), (6, 3, 40, true));
    let mut hf = load_path(&folder).expect("folder").weights;
    hf.config.block.moe.as_mut().unwrap().renormalize = true;
    let ids = common::ids(&common::read_json(&folder.join("reference.json"))["input_ids"]);
    let a = ReferenceModel::new(&g).unwrap().forward(&ids);
    let b = ReferenceModel::new(&hf).unwrap().forward(&ids);
    let d = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max);
    assert!(d <= 1e-5, "GGUF and folder (renormalised) differ by {d:e}");
    // And renormalising changes the logits: the comparison is not vacuous.
    let want = common::read_f32(&folder.join("logits.f32"));
    assert!(a.iter().zip(&want).any(|(x, y)| (x - y).abs() > 1e-3));
    // The GPU runs the GGUF as the reference does.
    let greedy = ReferenceModel::new(&g).unwrap().greedy(&ids, 8);
    check_gpu("qwen3moe-unnormalised GGUF", &g, &ids, &a, &greedy, TOL);
}

/// Experts quantized to packed formats (round-to-nearest in groups of 16; the router stays
/// f32, as llama.cpp keeps it) run on the GPU as the CPU reference runs the same packed
/// weights: the expert matvec dequantizes every format in the shader.
#[test]
fn quantized_experts_on_the_gpu_match_the_reference() {
    use lantern::quant::quantize::{quantize_model, QuantizeOptions};
    use lantern::quant::QuantKind;
    let w = load_path(&dir("qwen3moe")).unwrap().weights;
    let ids = common::ids(&common::read_json(&dir("qwen3moe").join("reference.json"))["input_ids"]);
    for kind in [QuantKind::Q8, QuantKind::Q4, QuantKind::Q4Sym] {
        let mut o = QuantizeOptions::new(kind);
        o.group = 16;
        let q = quantize_model(&w, &o, None, &mut |_| {}).unwrap().weights;
        let packed = |n: &str| q.tensors[n].dtype.quant_kind().is_some();
        assert!(packed("model.layers.2.mlp.experts.7.down_proj.weight") && packed("model.layers.1.mlp.up_proj.weight"), "{kind:?}");
        assert!(!packed("model.layers.0.mlp.gate.weight"), "the router stays float");
        let r = ReferenceModel::new(&q).unwrap();
        let (want, greedy) = (r.forward(&ids), r.greedy(&ids, 8));
        check_gpu(&format!("qwen3moe {kind:?}"), &q, &ids, &want, &greedy, TOL);
    }
}

/// Sixteen sequences decoded together by the engine give each its own single run's tokens:
/// each token's route and experts are its own, whatever else the step holds.
#[test]
fn sixteen_sequences_batched_equal_sixteen_single_runs() {
    use lantern::engine::generate::{generate_with, GenerateRequest};
    use lantern::engine::{Engine, EngineOptions, Event, SamplingParams};
    let w = load_path(&dir("mixtral")).unwrap().weights;
    let tok = common::smollm2_tokenizer();
    let ids = common::ids(&common::read_json(&dir("mixtral").join("reference.json"))["input_ids"]);
    let opts = |max_seqs: usize| ModelOptions {
        context: Some(64),
        max_seqs,
        page_size: 4,
        max_batch_tokens: 64,
        max_logit_rows: 16,
        batch_invariant: true,
        prefix_cache: false,
        ..Default::default()
    };
    let reqs: Vec<GenerateRequest> = (0..16)
        .map(|i| GenerateRequest {
            prompt_ids: ids[i..i + 3 + i % 5].to_vec(),
            max_tokens: 6,
            sampling: if i % 3 == 0 {
                SamplingParams { temperature: 0.8, top_k: 0, top_p: 1.0, seed: i as u64 }
            } else {
                SamplingParams::default()
            },
            stop_ids: vec![],
            stop_strings: vec![],
            speculation: Default::default(),
            constraint: None,
            logprobs: None,
            bias: Default::default(),
        })
        .collect();
    let mut one = pollster::block_on(GpuModel::load(common::gpu(), &w, opts(1))).unwrap();
    let solo: Vec<Vec<u32>> =
        reqs.iter().map(|r| pollster::block_on(generate_with(&mut one, None, &tok, r, |_| true)).unwrap().output_ids).collect();
    let mut e = Engine::new(
        pollster::block_on(GpuModel::load(common::gpu(), &w, opts(16))).unwrap(),
        tok,
        EngineOptions { step_tokens: 64, prefill_chunk: 8, max_waiting: 16 },
    );
    let mut handles: Vec<_> = reqs.iter().map(|r| e.submit(r.clone()).unwrap()).collect();
    pollster::block_on(e.run_until_idle()).unwrap();
    assert!(e.stats().steps < 16 * 6, "the engine batched: {} steps", e.stats().steps);
    for (i, h) in handles.iter_mut().enumerate() {
        let g = loop {
            match h.try_next() {
                Ok(Some(Event::Done(g))) => break *g,
                Ok(Some(Event::Error(err))) => panic!("request {i}: {err}"),
                Ok(Some(_)) => {}
                other => panic!("request {i} ended without Done: {:?}", other.is_ok()),
            }
        };
        assert_eq!(g.output_ids, solo[i], "request {i}: batched output differs from its single run");
    }
}

#[test]
fn expert_configs_are_checked() {
    let text = std::fs::read_to_string(dir("qwen3moe").join("config.json")).unwrap();
    let base: serde_json::Value = serde_json::from_str(&text).unwrap();
    let parse = |v: &serde_json::Value| lantern::model::ModelConfig::from_hf_json(&v.to_string(), "config.json").map_err(|e| e.to_string());
    let mut c = base.clone();
    c["num_experts_per_tok"] = serde_json::json!(9);
    let e = parse(&c).unwrap_err();
    assert!(e.contains("num_experts_per_tok"), "{e}");
    let mut c = base.clone();
    c["mlp_only_layers"] = serde_json::json!([7]);
    let e = parse(&c).unwrap_err();
    assert!(e.contains("mlp_only_layers"), "{e}");
    let mut c = base.clone();
    c.as_object_mut().unwrap().remove("moe_intermediate_size");
    let e = parse(&c).unwrap_err();
    assert!(e.contains("moe_intermediate_size"), "{e}");
    let mut c = base;
    c["shared_expert_intermediate_size"] = serde_json::json!(64);
    let e = parse(&c).unwrap_err();
    assert!(e.contains("shared"), "{e}");
}

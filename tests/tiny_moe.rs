//! Mixtures of experts on tiny random checkpoints made with transformers
//! (`tests/fixtures/tiny-moe`: Qwen3-MoE with a dense layer among sparse ones, Qwen3-MoE
//! without renormalised routing, Mixtral, OLMoE), loaded as Hugging Face folders. The CPU reference
//! must reproduce transformers' float32 logits at every position and its greedy continuation,
//! from the folder and from llama.cpp's GGUF conversion of it (3-D expert tensors split per
//! expert at load); the GPU forward pass refuses them with a typed error until its expert
//! kernels exist.

mod common;

use std::path::PathBuf;

use lantern::model::forward::{GpuModel, ModelOptions};
use lantern::model::load::load_path;
use lantern::model::Arch;
use lantern::reference::ReferenceModel;
use lantern::LanternError;

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

    match pollster::block_on(GpuModel::load(common::gpu(), &w, ModelOptions { context: Some(64), ..Default::default() })) {
        Err(e @ LanternError::UnsupportedArchitecture { .. }) => assert!(e.to_string().contains("mixture-of-experts"), "{e}"),
        Err(e) => panic!("{name}: the GPU load failed otherwise: {e}"),
        Ok(_) => panic!("{name}: the GPU load of a mixture of experts must be refused until it runs"),
    }
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

#[test]
fn mixtral_from_llama_cpp_gguf() {
    check_load("mixtral", &dir("mixtral").join("model.gguf"), Arch::Mixtral, &[true, true], true, 2 * 2 * 3 * 160 * 64);
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

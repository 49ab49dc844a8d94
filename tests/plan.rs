//! The memory plan arithmetic against worked examples, and `lantern plan` from a config.json
//! alone (Llama 3.3 70B sized without its weights). No GPU needed.

mod common;

use lantern::kv::plan::{kv_bytes, kv_bytes_per_token, param_count, plan, KvDtype};
use lantern::model::ModelConfig;

const LLAMA_33_70B: &str = r#"{
  "architectures": ["LlamaForCausalLM"], "model_type": "llama",
  "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
  "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
  "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-05,
  "rope_theta": 500000.0,
  "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
  "tie_word_embeddings": false, "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
  "hidden_act": "silu", "torch_dtype": "bfloat16"
}"#;

#[test]
fn kv_formula_reproduces_the_worked_examples() {
    // B=16, T=4096, L=32, H_kv=8, d_h=128, 2-byte elements.
    assert_eq!(kv_bytes(32, 8, 128, KvDtype::F16, 16, 4096), 8_589_934_592);
    // One sequence of 32,000 tokens of Llama 3.3 70B in bf16.
    assert_eq!(kv_bytes(80, 8, 128, KvDtype::Bf16, 1, 32_000), 10_485_760_000);
    // SmolLM2: 2 x 30 x 3 x 64 x 4 bytes per token in f32, what the runtime allocates.
    assert_eq!(kv_bytes_per_token(30, 3, 64, KvDtype::F32), 46_080);
    // q8: one byte per element plus an f16 scale per token and head, for K and for V.
    assert_eq!(kv_bytes_per_token(30, 3, 64, KvDtype::Q8), 2 * 30 * 3 * 66);
}

#[test]
fn parameter_counts_match_the_published_sizes() {
    let c = ModelConfig::from_hf_json(LLAMA_33_70B, "config.json").unwrap();
    let p = param_count(&c);
    assert_eq!(p.total, 70_553_706_496, "Llama 3.3 70B");
    // Sanity line: a block is ~12 d^2 (here 10.4 d^2+: GQA shrinks k/v, the 3.5d gated MLP grows it).
    assert!(p.per_layer > 10 * 8192 * 8192 && p.per_layer < 14 * 8192 * 8192, "{p:?}");
    let l = lantern::model::load::load_path(&common::smollm2_gguf()).unwrap();
    let counted: u64 = l.weights.tensors.values().map(|t| t.numel() as u64).sum();
    assert_eq!(param_count(&l.weights.config).total, counted, "SmolLM2 (tied): config count = tensor count");
    assert_eq!(counted, 134_515_008);
}

#[test]
fn plan_fits_pages_into_what_the_budget_leaves() {
    let c = ModelConfig::from_hf_json(LLAMA_33_70B, "config.json").unwrap();
    let per_token = kv_bytes_per_token(80, 8, 128, KvDtype::F16);
    // Budget = weights + workspace + reserve + exactly 100 pages and a bit.
    let (w, ws, res) = (141_107_412_992u64, 1 << 30, 4 << 30);
    let budget = w + ws + res + 100 * 16 * per_token + 12345;
    let p = plan(&c, w, KvDtype::F16, 2, 512, 16, ws, res, budget, "test".into());
    assert_eq!(p.pages, 100);
    assert_eq!(p.max_context_one_sequence, 1600);
    assert_eq!(p.max_sequences_at_context, 100 / 32);
    assert!(p.fits);
    let p = plan(&c, w, KvDtype::F16, 4, 512, 16, ws, res, budget, "test".into());
    assert!(!p.fits);
    // Weights alone over budget: no pages, no panic.
    let p = plan(&c, w, KvDtype::F16, 1, 512, 16, ws, res, w / 2, "test".into());
    assert_eq!((p.pages, p.kv_budget_bytes, p.fits), (0, 0, false));
}

#[test]
fn cli_plans_a_model_from_its_config_json_alone() {
    let dir = std::env::temp_dir().join(format!("lantern-plan-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("config.json"), LLAMA_33_70B).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_lantern"))
        .env("LANTERN_OFFLINE", "1")
        .args(["plan", "--context", "32000", "--kv-dtype", "bf16", "--memory-budget", "192Gi", "--json", "--model"])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["parameters"]["total"], 70_553_706_496u64);
    assert_eq!(v["plan"]["kv_bytes_requested"], 10_485_760_000u64);
    assert_eq!(v["plan"]["weight_bytes"], 141_107_412_992u64, "bf16 weights: 2 bytes per parameter");
    assert_eq!(v["plan"]["budget_bytes"], 192u64 << 30);
    assert!(v["plan"]["max_sequences_at_context"].as_u64().unwrap() >= 1);
    // A bad budget is refused with a message.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_lantern"))
        .args(["plan", "--memory-budget", "lots", "--model"])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--memory-budget"), "{}", String::from_utf8_lossy(&out.stderr));
    std::fs::remove_dir_all(&dir).ok();
}

//! The memory plan arithmetic against worked examples, `lantern plan` from a config.json
//! alone (Llama 3.3 70B sized without its weights), and the budget from the adapter: its
//! reported memory, allocation probes, and `plan --adapter` / `--probe` (these need an
//! adapter; lavapipe in CI, where a missing one fails the test).

mod common;

use lantern::gpu::memory::{adapter_memory, default_budget, probe, probe_largest, MemoryOrigin};
use lantern::kv::plan::{kv_bytes, kv_bytes_per_token, KvDtype};
use lantern::kv::ring::KvWindow;
use lantern::model::plan::{param_count, plan};
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

/// SmolLM2-135M's shape: a KV cache small enough to probe on any adapter.
const SMALL_LLAMA: &str = r#"{
  "architectures": ["LlamaForCausalLM"], "model_type": "llama",
  "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
  "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
  "vocab_size": 49152, "max_position_embeddings": 8192, "rms_norm_eps": 1e-05,
  "rope_theta": 100000.0, "tie_word_embeddings": true, "bos_token_id": 1, "eos_token_id": 2,
  "hidden_act": "silu", "torch_dtype": "bfloat16"
}"#;

/// A fresh folder holding `config` as config.json.
fn config_dir(name: &str, config: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("lantern-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("config.json"), config).unwrap();
    dir
}

/// `lantern plan ARGS --json --model DIR/config.json`, parsed; fails the test on an error exit.
fn plan_json(dir: &std::path::Path, args: &[&str]) -> serde_json::Value {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_lantern"))
        .env("LANTERN_OFFLINE", "1")
        .arg("plan")
        .args(args)
        .args(["--json", "--model"])
        .arg(dir.join("config.json"))
        .output()
        .unwrap();
    assert!(out.status.success(), "plan {args:?}: stderr: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn kv_formula_reproduces_the_worked_examples() {
    // B=16, T=4096, L=32, H_kv=8, d_h=128, 2-byte elements.
    assert_eq!(kv_bytes(32, 8, 128, KvDtype::F16, 16, 4096), 8_589_934_592);
    // One sequence of 32,000 tokens of Llama 3.3 70B in bf16.
    assert_eq!(kv_bytes(80, 8, 128, KvDtype::Bf16, 1, 32_000), 10_485_760_000);
    // SmolLM2: 2 x 30 x 3 x 64 x 4 bytes per token in f32, what the runtime allocates.
    assert_eq!(kv_bytes_per_token(30, 3, 64, KvDtype::F32), 46_080);
    // q8: one byte per element plus an f32 scale per token and head, for K and for V.
    assert_eq!(kv_bytes_per_token(30, 3, 64, KvDtype::Q8), 2 * 30 * 3 * 68);
    // q4: half a byte per element; K a 4-byte scale per channel per 16 tokens (48 bytes
    // a head), V one per 32 elements (40): 44 on average.
    assert_eq!(kv_bytes_per_token(30, 3, 64, KvDtype::Q4), 2 * 30 * 3 * 44);
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
fn sliding_window_layers_keep_rings_and_the_plan_counts_them() {
    // Gemma 3 270M's shape: 18 layers, 15 behind a 512-key window, 1 KV head of 256.
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-archs/gemma3");
    let mut c = lantern::model::load::load_path(&dir).unwrap().weights.config;
    c.num_layers = 18;
    c.num_kv_heads = 1;
    c.head_dim = 256;
    c.block = lantern::model::BlockSpec::gemma3(18, c.hidden_size, 512, 256.0, 10000.0);
    let w = lantern::model::plan::window_saving(&c, KvDtype::F32, 8192, 128, 16).unwrap();
    let per_layer_token = 2 * 256 * 4;
    assert_eq!((w.sliding_layers, w.layers, w.window), (15, 18, 512));
    assert_eq!(w.bytes_per_sequence, 18 * 8192 * per_layer_token);
    // Rings of 512 + 128 - 1 tokens, in whole pages of 16: 640.
    assert_eq!(w.bytes_per_sequence_windowed, (3 * 8192 + 15 * 640) * per_layer_token);
    // A context inside the window saves nothing.
    let w = lantern::model::plan::window_saving(&c, KvDtype::F32, 300, 1, 16).unwrap();
    assert_eq!(w.bytes_per_sequence, w.bytes_per_sequence_windowed);

    // The plan with rings: they come out of the budget first, and the pages hold 3 layers.
    let gb = 1u64 << 30;
    let full = plan(&c, 300 << 20, KvDtype::F32, 4, 8192, 16, 50 << 20, 64 << 20, gb, "test".into());
    let ring = KvWindow::Auto.ring(c.block.sliding_window, 8192, 128, 16);
    assert_eq!(ring.map(|r| r.tokens()), Some(640));
    let rung = full.clone().with_ring(&c, ring, 128);
    let r = rung.ring.as_ref().unwrap();
    assert_eq!(r.bytes_per_sequence, 15 * 640 * per_layer_token);
    assert_eq!(r.pool_bytes_per_token, 3 * per_layer_token);
    assert_eq!(rung.pages, (full.kv_budget_bytes - 4 * r.bytes_per_sequence) / (16 * 3 * per_layer_token));
    assert_eq!(rung.kv_bytes_requested, 4 * (r.bytes_per_sequence + 8192 * 3 * per_layer_token));
    assert!(rung.window.as_ref().unwrap().taken && !full.window.as_ref().unwrap().taken);
    // 8192-token sequences in 610 MiB of KV: 2 fit with every layer keeping every token
    // (302 MB each), 9 with rings (70 MB each).
    assert_eq!((full.max_sequences_at_context, full.fits), (2, false));
    assert_eq!((rung.max_sequences_at_context, rung.fits), (9, true));
    assert!(rung.kv_bytes() <= rung.kv_budget_bytes);
    // Auto takes no ring where it would not be smaller than the context; full never does.
    assert_eq!(KvWindow::Auto.ring(c.block.sliding_window, 640, 128, 16), None);
    assert_eq!(KvWindow::Full.ring(c.block.sliding_window, 8192, 128, 16), None);
    // Full attention everywhere: nothing to say.
    c.block = Default::default();
    assert!(lantern::model::plan::window_saving(&c, KvDtype::F32, 8192, 1, 16).is_none());
    assert_eq!(KvWindow::Ring.ring(c.block.sliding_window, 8192, 128, 16), None);
}

/// A config-only FP8 checkpoint is planned as the GPU will hold it (its linear layers a byte
/// and a scale per 32, the rest f32), close to what loading the folder itself counts.
#[test]
fn cli_plans_an_fp8_config_as_loaded() {
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny/llama-gqa-fp8-block");
    let dir = config_dir("plan-fp8", &std::fs::read_to_string(src.join("config.json")).unwrap());
    let plan = |model: &std::path::Path| -> serde_json::Value {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_lantern"))
            .env("LANTERN_OFFLINE", "1")
            .args(["plan", "--context", "256", "--memory-budget", "1Gi", "--json", "--model"])
            .arg(model)
            .output()
            .unwrap();
        assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let (config_only, loaded) = (plan(&dir), plan(&src));
    let (a, b) = (config_only["plan"]["weight_bytes"].as_f64().unwrap(), loaded["plan"]["weight_bytes"].as_f64().unwrap());
    assert!((a / b - 1.0).abs() < 0.03, "config only {a} bytes, loaded {b}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn cli_plans_a_model_from_its_config_json_alone() {
    let dir = config_dir("plan", LLAMA_33_70B);
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

#[test]
fn adapter_memory_reports_a_device_local_heap() {
    let ctx = common::gpu();
    let mem = adapter_memory(&ctx);
    eprintln!("{}: {mem:?}", ctx.info.name);
    let local = mem.device_local_bytes.unwrap_or_else(|| panic!("{}: no memory size: {}", ctx.info.name, mem.source));
    assert!(local > 0, "{mem:?}");
    if ctx.info.backend == wgpu::Backend::Vulkan {
        assert_eq!(mem.origin, MemoryOrigin::VulkanHeap, "{mem:?}");
        assert!(mem.source.contains("device-local"), "{}", mem.source);
    }
    if let Some(b) = mem.budget_bytes {
        assert!(b > 0, "{mem:?}");
    }
    let (budget, source) = default_budget(&mem).expect("a budget from a known heap");
    assert!(budget > 0 && budget <= mem.budget_bytes.unwrap_or(local), "{budget} from {mem:?}");
    assert!(source.starts_with("90% of"), "{source}");
}

#[test]
fn probe_allocates_64_mib_in_16_mib_buffers_outside_the_ledger() {
    let ctx = common::gpu();
    let mark = ctx.ledger.mark();
    let r = pollster::block_on(probe(&ctx, 64 << 20, 16 << 20)).unwrap();
    assert_eq!((r.allocated_bytes, r.buffers, r.chunk_bytes), (64 << 20, 4, 16 << 20), "{r:?}");
    assert!(r.complete() && r.stopped_by.is_none(), "{r:?}");
    // A total that is not a multiple of the chunk: the last buffer is the remainder, and never
    // more than asked is allocated; a chunk above max_buffer_size is capped to it.
    let r = pollster::block_on(probe_largest(&ctx, (40 << 20) + 12, u64::MAX, 3)).unwrap();
    assert_eq!((r.allocated_bytes, r.buffers, r.halvings), ((40 << 20) + 12, 1, 0), "{r:?}");
    assert_eq!(r.chunk_bytes, ctx.limits.max_buffer_size);
    assert!(ctx.ledger.since(mark).is_empty(), "probe buffers must not be recorded as live allocations");
}

#[test]
fn cli_takes_the_budget_from_the_adapter_and_caps_it_with_memory_budget() {
    let dir = config_dir("plan-adapter", SMALL_LLAMA);
    let v = plan_json(&dir, &["--adapter"]);
    let budget = &v["budget"];
    let bytes = budget["bytes"].as_u64().unwrap();
    let source = budget["source"].as_str().unwrap();
    assert!(bytes > 0, "{budget}");
    assert!(source.contains("adapter"), "{source}");
    assert_eq!(v["plan"]["budget_bytes"], bytes);
    assert!(budget["adapter_memory"]["device_local_bytes"].as_u64().unwrap() > 0, "{budget}");
    assert!(budget["probe"].is_null());
    // One layer's K of the planned pages, split at the binding limit.
    let k = &v["kv_buffers_per_layer"];
    let per_layer = v["plan"]["pages"].as_u64().unwrap() * 16 * 46_080 / 60;
    assert_eq!(k["per_layer_k_bytes"], per_layer);
    assert_eq!(k["count"], per_layer.div_ceil(k["binding_limit"].as_u64().unwrap()));

    // A user cap below the adapter's budget wins, and the source names both.
    let cap = 1u64 << 30;
    let v = plan_json(&dir, &["--adapter", "--memory-budget", "1Gi"]);
    assert_eq!(v["budget"]["bytes"], cap.min(bytes), "{}", v["budget"]);
    let source = v["budget"]["source"].as_str().unwrap();
    assert!(source.contains("--memory-budget") && source.contains("adapter"), "{source}");

    // --probe allocates the planned pages' KV bytes (the pages stay when it all succeeds).
    let v = plan_json(&dir, &["--probe", "--memory-budget", "512Mi"]);
    let p = &v["budget"]["probe"];
    let pages = v["plan"]["pages"].as_u64().unwrap();
    assert!(pages > 0, "{}", v["plan"]);
    assert_eq!(p["requested_bytes"], pages * 16 * 46_080, "{p}");
    assert_eq!(p["allocated_bytes"], p["requested_bytes"], "{p}");
    assert!(p["stopped_by"].is_null(), "{p}");
    std::fs::remove_dir_all(&dir).ok();
}

/// Regression guard for the point of `--probe`: a budget the driver cannot honour is found at
/// plan (load) time and the pages are lowered. lavapipe allocates lazily and ignores its own
/// heap size, so the refusal is made real with an address-space limit (`ulimit -v`), which
/// only binds an adapter whose memory is process memory.
#[cfg(target_os = "linux")]
#[test]
fn probe_lowers_the_pages_to_what_the_driver_allocates() {
    let ctx = common::gpu();
    let cpu_like = ctx.caps.cpu_like;
    drop(ctx);
    let dir = config_dir("plan-probe", SMALL_LLAMA);
    let cmd = format!(
        "exec '{}' plan --probe --memory-budget 1Gi --json --model '{}'",
        env!("CARGO_BIN_EXE_lantern"),
        dir.join("config.json").display()
    );
    if !cpu_like {
        // A GPU's memory is not process memory, so `ulimit -v` cannot make it refuse; there
        // the probe must get everything a 1 GiB budget asks for, and say nothing stopped it.
        let out = std::process::Command::new("sh").env("LANTERN_OFFLINE", "1").arg("-c").arg(&cmd).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let p = &v["budget"]["probe"];
        assert_eq!(p["allocated_bytes"], p["requested_bytes"], "{p}");
        assert!(p["stopped_by"].as_str().is_none_or(|s| s.is_empty()), "{p}");
        std::fs::remove_dir_all(&dir).ok();
        return;
    }
    // From generous to too small to start at all: one limit must land between "the adapter
    // opens" and "the KV fits".
    let mut seen = Vec::new();
    for limit_mib in (512..=8192u64).rev().step_by(256) {
        let out = std::process::Command::new("sh")
            .env("LANTERN_OFFLINE", "1")
            .arg("-c")
            .arg(format!("ulimit -v {}; {cmd}", limit_mib << 10))
            .output()
            .unwrap();
        if !out.status.success() {
            seen.push(format!("{limit_mib} MiB: exit {:?}", out.status.code()));
            continue;
        }
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let p = &v["budget"]["probe"];
        let (got, want) = (p["allocated_bytes"].as_u64().unwrap(), p["requested_bytes"].as_u64().unwrap());
        seen.push(format!("{limit_mib} MiB: {got} of {want}"));
        if got < want {
            assert!(p["stopped_by"].as_str().is_some_and(|s| !s.is_empty()), "{p}");
            let pages = v["plan"]["pages"].as_u64().unwrap();
            assert!(pages * 16 * 46_080 <= got, "pages {pages} not lowered to {got} bytes");
            assert!(pages * 16 * 46_080 + 16 * 46_080 > got, "pages {pages} lowered too far for {got} bytes");
            let source = v["budget"]["source"].as_str().unwrap();
            assert!(source.contains("lowered"), "{source}");
            eprintln!("{seen:?}");
            std::fs::remove_dir_all(&dir).ok();
            return;
        }
    }
    panic!("no address-space limit made the probe stop short: {seen:?}");
}

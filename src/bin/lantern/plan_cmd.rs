//! `lantern plan`: how many tokens of KV cache fit, from a GGUF, a Hugging Face folder, or a
//! config.json alone (size a model before downloading it). Needs no GPU.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;

use lantern::kv::plan::{param_count, plan, workspace_bytes, KvDtype};
use lantern::model::ModelConfig;

#[derive(Args)]
pub struct PlanArgs {
    /// A GGUF file, a Hugging Face folder, or a config.json file. Default: SmolLM2-135M-Instruct.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Tokens per sequence (prompt + output). Default: min(model's, 4096).
    #[arg(long)]
    context: Option<usize>,
    /// Sequences of `--context` tokens served at once.
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// KV cache storage: f32 (what this version allocates), f16, bf16 or q8.
    #[arg(long, default_value = "f32", value_parser = ["f32", "f16", "bf16", "q8"])]
    kv_dtype: String,
    /// Memory budget in bytes (suffixes K, M, G, Ki, Mi, Gi accepted).
    #[arg(long)]
    memory_budget: Option<String>,
    /// For a config.json without weights: bytes per parameter of the weights (2 = bf16/f16,
    /// 1 = 8-bit, 0.5625 = 4-bit with group-32 scales).
    #[arg(long, default_value_t = 2.0)]
    bytes_per_param: f64,
    /// Tokens per KV page.
    #[arg(long, default_value_t = 16)]
    page_size: usize,
    /// Largest step (prefill chunk) the workspace is sized for.
    #[arg(long, default_value_t = 128)]
    max_batch_tokens: usize,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

/// "24G", "512Mi", "1000000" -> bytes.
pub fn parse_bytes(s: &str) -> Result<u64> {
    let s = s.trim();
    let split = s.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let v: f64 = num.trim().parse().with_context(|| format!("--memory-budget {s:?}: not a number of bytes"))?;
    let mul = match unit.trim() {
        "" | "B" => 1.0,
        "K" | "KB" => 1e3,
        "M" | "MB" => 1e6,
        "G" | "GB" => 1e9,
        "T" | "TB" => 1e12,
        "Ki" | "KiB" => 1024.0,
        "Mi" | "MiB" => 1024.0 * 1024.0,
        "Gi" | "GiB" => 1024.0 * 1024.0 * 1024.0,
        u => bail!("--memory-budget {s:?}: unknown unit {u:?} (K, M, G, T, Ki, Mi, Gi)"),
    };
    if v < 0.0 || !v.is_finite() {
        bail!("--memory-budget {s:?}: must be a positive number of bytes");
    }
    Ok((v * mul) as u64)
}

pub fn run(a: PlanArgs) -> Result<()> {
    let path = match &a.model {
        Some(p) => p.clone(),
        None => lantern::fetch::ensure_default_model(!a.json).context("fetching the default model")?,
    };
    let kv_dtype = KvDtype::parse(&a.kv_dtype).context("--kv-dtype")?;
    // A config.json (file, or a folder holding only a config): no weights to count.
    let config_only = if path.is_file() && path.extension().is_some_and(|e| e == "json") {
        Some(path.clone())
    } else if path.is_dir() && !std::fs::read_dir(&path)?.flatten().any(|e| e.path().extension().is_some_and(|x| x == "safetensors")) {
        Some(path.join("config.json"))
    } else {
        None
    };
    let (config, weight_bytes, weight_source): (ModelConfig, u64, String) = match config_only {
        Some(cfg) => {
            let text = std::fs::read_to_string(&cfg).with_context(|| format!("reading {}", cfg.display()))?;
            let c = ModelConfig::from_hf_json(&text, &cfg.display().to_string())?;
            let p = param_count(&c).total;
            let b = (p as f64 * a.bytes_per_param) as u64;
            (c, b, format!("{p} parameters x {} bytes (config only)", a.bytes_per_param))
        }
        None => {
            let loaded = lantern::model::load::load_path(&path)?;
            let (_, gpu) = crate::info_cmd::by_dtype(&loaded.weights, &path)?;
            let b = gpu.values().map(|r| r.bytes + r.scale_bytes).sum();
            (loaded.weights.config, b, "the file's tensors as a native load stores them".into())
        }
    };
    let context = a.context.unwrap_or(config.max_position_embeddings.min(4096)).max(1);
    let ws = workspace_bytes(&config, a.max_batch_tokens, 64, context);
    let (budget, source) = match &a.memory_budget {
        Some(s) => (parse_bytes(s)?, "--memory-budget".to_string()),
        // WebGPU does not expose an adapter's memory size; without a budget the plan shows
        // the requirement and no capacity.
        None => (0, "none given (WebGPU exposes no memory size; pass --memory-budget)".to_string()),
    };
    let reserve = if budget > 0 { (budget / 20).max(64 << 20).min(budget) } else { 0 };
    let p = plan(&config, weight_bytes, kv_dtype, a.batch, context, a.page_size, ws, reserve, budget, source);
    let params = param_count(&config);
    if a.json {
        let v = serde_json::json!({
            "path": path.display().to_string(),
            "parameters": params,
            "weight_source": weight_source,
            "plan": p,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    let gb = |b: u64| b as f64 / 1e9;
    println!("{}", path.display());
    println!(
        "  parameters {:.3} B ({:.1} M per layer; 12 d^2 = {:.1} M)",
        params.total as f64 / 1e9,
        params.per_layer as f64 / 1e6,
        params.block_12d2 as f64 / 1e6
    );
    println!("  weights          {:10.3} GB  ({weight_source})", gb(p.weight_bytes));
    println!("  KV per token     {:10} B   ({:?}; 2 x {} layers x {} KV heads x {} dims)", p.kv_bytes_per_token, kv_dtype, config.num_layers, config.num_kv_heads, config.head_dim);
    println!("  KV for {} x {} tokens {:10.3} GB", a.batch, context, gb(p.kv_bytes_requested));
    println!("  workspace        {:10.3} GB  (steps of {} tokens)", gb(p.workspace_bytes), a.max_batch_tokens);
    if budget == 0 {
        println!("  needed           {:10.3} GB  (weights + KV + workspace); budget: {}", gb(p.weight_bytes + p.kv_bytes_requested + p.workspace_bytes), p.budget_source);
        return Ok(());
    }
    println!("  reserve          {:10.3} GB", gb(p.reserve_bytes));
    println!("  budget           {:10.3} GB  ({})", gb(p.budget_bytes), p.budget_source);
    println!(
        "  KV pages         {:10}     ({} tokens each) = {:.3} GB",
        p.pages,
        p.page_size,
        gb(p.kv_budget_bytes)
    );
    println!("  longest single sequence: {} tokens", p.max_context_one_sequence);
    println!(
        "  sequences of {} tokens at once: {} ({})",
        context,
        p.max_sequences_at_context,
        if p.fits { format!("{} fit", a.batch) } else { format!("{} do not fit", a.batch) }
    );
    Ok(())
}

//! `lantern plan`: how many tokens of KV cache fit, from a GGUF, a Hugging Face folder, or a
//! config.json alone (size a model before downloading it). Needs no GPU unless `--adapter`
//! (budget from the adapter's memory) or `--probe` (allocate the planned KV to check it).

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;

use lantern::gpu::memory::{adapter_memory, default_budget, probe_largest, AdapterMemory, Probe};
use lantern::gpu::{DeviceOptions, GpuContext};
use lantern::kv::plan::KvDtype;
use lantern::model::plan::{param_count, plan, workspace_bytes, Plan};
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
    /// KV cache storage: f32, f16, q8 or q4 (what `lantern run --kv-dtype` allocates), or
    /// bf16 (sizing only).
    #[arg(long, default_value = "f32", value_parser = ["f32", "f16", "bf16", "q8", "q4"])]
    kv_dtype: String,
    /// Memory budget in bytes (suffixes K, M, G, Ki, Mi, Gi accepted).
    #[arg(long)]
    memory_budget: Option<String>,
    /// For a config.json without weights: bytes per parameter of the weights (2 = bf16/f16,
    /// 1 = 8-bit, 0.5625 = 4-bit with group-32 scales). Default: 2, or for an FP8 checkpoint
    /// (`quantization_config.quant_method: fp8`) its linear layers as the GPU holds them
    /// (1.0625: a byte and an f16 scale per 32) and the rest (embedding, norms) in f32.
    #[arg(long)]
    bytes_per_param: Option<f64>,
    /// Tokens per KV page.
    #[arg(long, default_value_t = 16)]
    page_size: usize,
    /// Largest step (prefill chunk) the workspace is sized for.
    #[arg(long, default_value_t = 128)]
    max_batch_tokens: usize,
    /// Sliding-window layers: keep only a ring of their window's pages per sequence (`ring`),
    /// every token (`full`), or a ring where it is smaller than the context (`auto`, what
    /// `lantern run` does).
    #[arg(long, default_value = "auto", value_parser = ["auto", "ring", "full"])]
    kv_window: String,
    /// Take the budget from a GPU adapter's memory (the best adapter, or one by INDEX or NAME
    /// substring as `lantern devices` lists them); with --memory-budget, the smaller of both.
    #[arg(long, value_name = "INDEX|NAME")]
    adapter: Option<Option<String>>,
    /// Pin the backend of --adapter: vulkan, metal, dx12, gl.
    #[arg(long)]
    backend: Option<String>,
    /// Allocate the planned KV bytes on the adapter (implies --adapter) under out-of-memory
    /// error scopes, and lower the pages to what the driver actually gave.
    #[arg(long)]
    probe: bool,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

/// Halvings of the buffer size `--probe` tries after an allocation fails.
const PROBE_HALVINGS: u32 = 6;

/// The budget and the line saying where it came from: `--memory-budget` (a user cap), the
/// adapter's memory, the smaller of both, or none (budget 0).
fn resolve_budget(user: Option<u64>, adapter: Option<&AdapterMemory>) -> (u64, String) {
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let from_adapter = adapter.map(|m| (default_budget(m), m));
    match (user, from_adapter) {
        (Some(u), Some((Some((a, a_src)), _))) if u <= a => {
            (u, format!("--memory-budget, below the adapter's {:.2} GiB = {a_src}", gib(a)))
        }
        (Some(u), Some((Some((a, a_src)), _))) => (a, format!("adapter: {a_src}, below --memory-budget {:.2} GiB", gib(u))),
        (Some(u), Some((None, m))) => (u, format!("--memory-budget; the adapter reports no memory size: {}", m.source)),
        (Some(u), None) => (u, "--memory-budget".to_string()),
        (None, Some((Some((a, a_src)), _))) => (a, format!("adapter: {a_src}")),
        (None, Some((None, m))) => (0, format!("none: the adapter reports no memory size ({}); pass --memory-budget", m.source)),
        // WebGPU does not expose an adapter's memory size; without a budget the plan shows
        // the requirement and no capacity.
        (None, None) => (0, "none given (WebGPU exposes no memory size; pass --memory-budget or --adapter)".to_string()),
    }
}

/// KV bytes of the plan's pages and rings, or of the request when there is no budget.
fn planned_kv_bytes(p: &Plan) -> u64 {
    p.kv_bytes()
}

/// Storage buffers one layer's K (or V) needs at the binding limit.
#[derive(serde::Serialize)]
struct KvBuffers {
    /// `ceil(per_layer_k_bytes / binding_limit)`.
    count: u64,
    /// KV bytes / (2 x layers).
    per_layer_k_bytes: u64,
    /// `max_storage_buffer_binding_size`.
    binding_limit: u64,
    max_buffer_size: u64,
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
    let path = lantern::fetch::resolve_model(a.model.as_deref(), !a.json)?;
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
            let pc = param_count(&c);
            let p = pc.total;
            let fp8 = serde_json::from_str::<serde_json::Value>(&text)
                .ok()
                .and_then(|v| v.pointer("/quantization_config/quant_method").and_then(|m| m.as_str()).map(|m| m == "fp8"))
                .unwrap_or(false);
            match (a.bytes_per_param, fp8) {
                (Some(bpp), _) => (c, (p as f64 * bpp) as u64, format!("{p} parameters x {bpp} bytes (config only)")),
                (None, true) => {
                    // The layers' projections in FP8 (norms are a rounding error here), the
                    // embedding and LM head as the loader keeps unquantized tensors: f32.
                    let linear = pc.layers;
                    let b = linear * 34 / 32 + (p - linear) * 4;
                    (c, b, format!("{linear} FP8 layer parameters x 1.0625 bytes + {} others x 4 (config only)", p - linear))
                }
                (None, false) => (c, p * 2, format!("{p} parameters x 2 bytes (config only)")),
            }
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
    let user_budget = a.memory_budget.as_deref().map(parse_bytes).transpose()?;
    let ctx = if a.adapter.is_some() || a.probe || a.backend.is_some() {
        let opts = DeviceOptions { backend: a.backend.clone(), adapter: a.adapter.clone().flatten(), ..Default::default() };
        Some(pollster::block_on(GpuContext::new(&opts)).context("opening the GPU adapter for --adapter/--probe")?)
    } else {
        None
    };
    // On CPU adapters whose packed weights load as tiled textures the prefill matmul reads its
    // inputs from x textures, which are workspace too.
    let widths = lantern::model::plan::x_texture_widths(&config);
    let ws = ws
        + ctx
            .as_deref()
            .filter(|c| lantern::kernels::x_texture::fits(c, &widths, a.max_batch_tokens))
            .map_or(0, |_| lantern::kernels::x_texture::bytes(&widths, a.max_batch_tokens));
    let mem = ctx.as_deref().map(adapter_memory);
    let (budget, source) = resolve_budget(user_budget, mem.as_ref());
    let reserve = if budget > 0 { lantern::kv::plan::reserve_bytes(budget) } else { 0 };
    let kv_window: lantern::kv::ring::KvWindow = a.kv_window.parse().map_err(anyhow::Error::msg)?;
    let ring = kv_window.ring(config.block.sliding_window, context, a.max_batch_tokens, a.page_size);
    let windowed = |p: Plan| {
        let mut p = p.with_ring(&config, ring, a.max_batch_tokens);
        if p.ring.is_none() {
            p.window = lantern::model::plan::window_saving(&config, kv_dtype, context, a.max_batch_tokens, a.page_size);
        }
        p
    };
    let mut p = windowed(plan(&config, weight_bytes, kv_dtype, a.batch, context, a.page_size, ws, reserve, budget, source));
    let mut probed: Option<Probe> = None;
    if let (true, Some(ctx)) = (a.probe, &ctx) {
        let want = planned_kv_bytes(&p);
        let r = pollster::block_on(probe_largest(ctx, want, ctx.max_binding(), PROBE_HALVINGS))
            .with_context(|| format!("probing {want} bytes of KV cache on {}", ctx.info.name))?;
        if !r.complete() && budget > 0 {
            let src = format!("{}; lowered to the {:.3} GB the probe allocated", p.budget_source, r.allocated_bytes as f64 / 1e9);
            let b = weight_bytes + ws + reserve + r.allocated_bytes;
            p = windowed(plan(&config, weight_bytes, kv_dtype, a.batch, context, a.page_size, ws, reserve, b, src));
        }
        probed = Some(r);
    }
    let kv_buffers = ctx.as_deref().map(|ctx| {
        // The pool layers' K (rings are small and sized per sequence).
        let pool_layers = config.num_layers - p.ring.as_ref().map_or(0, |r| r.sliding_layers);
        let pool_bytes = planned_kv_bytes(&p) - p.ring.as_ref().map_or(0, |r| r.bytes_per_sequence * p.batch as u64);
        let per_layer_k_bytes = pool_bytes / (2 * pool_layers.max(1) as u64);
        let binding_limit = ctx.limits.max_storage_buffer_binding_size;
        KvBuffers {
            count: per_layer_k_bytes.div_ceil(binding_limit.max(1)),
            per_layer_k_bytes,
            binding_limit,
            max_buffer_size: ctx.limits.max_buffer_size,
        }
    });
    let params = param_count(&config);
    if a.json {
        let v = serde_json::json!({
            "path": path.display().to_string(),
            "parameters": params,
            "weight_source": weight_source,
            "plan": p,
            "budget": {
                "bytes": p.budget_bytes,
                "source": p.budget_source,
                "adapter_memory": mem,
                "probe": probed,
            },
            "adapter": ctx.as_deref().map(GpuContext::adapter_json),
            "kv_buffers_per_layer": kv_buffers,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    let gb = |b: u64| b as f64 / 1e9;
    let mib = |b: u64| b >> 20;
    println!("{}", path.display());
    println!(
        "  parameters {:.3} B ({:.1} M per layer; 12 d^2 = {:.1} M)",
        params.total as f64 / 1e9,
        params.per_layer as f64 / 1e6,
        params.block_12d2 as f64 / 1e6
    );
    if params.active < params.total {
        println!(
            "  read per token {:.3} B parameters, {:.3} GB of weights (a mixture of experts: the router's top {} of {} experts)",
            params.active as f64 / 1e9,
            gb((p.weight_bytes as f64 * params.active as f64 / params.total.max(1) as f64) as u64),
            config.block.moe.as_ref().map_or(0, |m| m.experts_per_token),
            config.block.moe.as_ref().map_or(0, |m| m.experts),
        );
    }
    println!("  weights          {:10.3} GB  ({weight_source})", gb(p.weight_bytes));
    println!(
        "  KV per token     {:10} B   ({:?}; 2 x {} layers x {} KV heads x {} dims)",
        p.kv_bytes_per_token, kv_dtype, config.num_layers, config.num_kv_heads, config.head_dim
    );
    println!("  KV for {} x {} tokens {:10.3} GB", a.batch, context, gb(p.kv_bytes_requested));
    if let Some(w) = &p.window {
        let how = match &p.ring {
            Some(r) => format!(
                "kept: each sequence's sliding layers hold a ring of {} tokens ({} pages), {:.3} GB per sequence; no prefix cache",
                r.ring.tokens(),
                r.ring.pages,
                gb(r.bytes_per_sequence)
            ),
            None => "not taken (--kv-window full, or a ring would not be smaller than the context)".to_string(),
        };
        println!(
            "  sliding window   {} of {} layers see only the last {} keys: {:.3} GB per sequence instead of {:.3} GB ({:.1}x less); {how}",
            w.sliding_layers,
            w.layers,
            w.window,
            gb(w.bytes_per_sequence_windowed),
            gb(w.bytes_per_sequence),
            w.bytes_per_sequence as f64 / w.bytes_per_sequence_windowed.max(1) as f64
        );
    }
    println!("  workspace        {:10.3} GB  (steps of {} tokens)", gb(p.workspace_bytes), a.max_batch_tokens);
    if let (Some(ctx), Some(mem)) = (&ctx, &mem) {
        println!("  adapter          {} ({:?}, {:?})", ctx.info.name, ctx.info.backend, ctx.info.device_type);
        println!("  adapter memory   {}", mem.source);
        println!(
            "  limits           max_storage_buffer_binding_size {} MiB, max_buffer_size {} MiB",
            mib(ctx.limits.max_storage_buffer_binding_size),
            mib(ctx.limits.max_buffer_size)
        );
    }
    if budget == 0 {
        println!(
            "  needed           {:10.3} GB  (weights + KV + workspace); budget: {}",
            gb(p.weight_bytes + p.kv_bytes_requested + p.workspace_bytes),
            p.budget_source
        );
    } else {
        println!("  reserve          {:10.3} GB", gb(p.reserve_bytes));
        println!("  budget           {:10.3} GB  ({})", gb(p.budget_bytes), p.budget_source);
        match &p.ring {
            Some(r) => println!(
                "  KV pages         {:10}     ({} tokens each, of the {} full-attention layers) + {} sequences' rings = {:.3} GB",
                p.pages,
                p.page_size,
                config.num_layers - r.sliding_layers,
                p.batch,
                gb(planned_kv_bytes(&p))
            ),
            None => println!("  KV pages         {:10}     ({} tokens each) = {:.3} GB", p.pages, p.page_size, gb(planned_kv_bytes(&p))),
        }
    }
    if let Some(k) = &kv_buffers {
        println!(
            "  KV buffers per layer (binding limit {} MiB): {} for K + {} for V (K of one layer: {:.3} GB)",
            mib(k.binding_limit),
            k.count,
            k.count,
            gb(k.per_layer_k_bytes)
        );
    }
    if let Some(r) = &probed {
        match &r.stopped_by {
            None => println!("  probe: allocated {:.3} GB in {} buffers", gb(r.allocated_bytes), r.buffers),
            Some(why) => println!(
                "  probe: allocated {:.3} GB of {:.3} GB in {} buffers, then out of memory ({why})",
                gb(r.allocated_bytes),
                gb(r.requested_bytes),
                r.buffers
            ),
        }
    }
    if budget == 0 {
        return Ok(());
    }
    println!("  longest single sequence: {} tokens", p.max_context_one_sequence);
    println!(
        "  sequences of {} tokens at once: {} ({})",
        context,
        p.max_sequences_at_context,
        if p.fits { format!("{} fit", a.batch) } else { format!("{} do not fit", a.batch) }
    );
    Ok(())
}

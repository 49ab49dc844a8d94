//! What the windowed and headless examples share: their arguments, loading a model onto the
//! host's device, the request `lantern run` would make for the same prompt, and the frame-time
//! summary they print at the end. (A folder without `main.rs`, so Cargo does not take it for
//! an example of its own.)
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use lantern::engine::metrics::Distribution;
use lantern::engine::{Engine, EngineOptions, GenerateRequest, SamplingParams};
use lantern::gpu::GpuContext;
use lantern::model::forward::{GpuModel, ModelOptions};

#[derive(Parser, Debug, Clone)]
pub struct Args {
    /// The prompt (raw text, as `lantern run PROMPT` takes it).
    #[arg(default_value = "Once upon a time")]
    pub prompt: String,
    /// A GGUF file or a Hugging Face folder. Default: SmolLM2-135M-Instruct, fetched once
    /// (as `lantern run` does).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Most tokens to generate (greedy, as `lantern run`'s default).
    #[arg(long, default_value_t = 24)]
    pub max_tokens: usize,
    /// Time Lantern may take out of each frame, in milliseconds.
    #[arg(long, default_value_t = 4.0)]
    pub budget_ms: f64,
    /// Frame rate the host paces itself to.
    #[arg(long, default_value_t = 60.0)]
    pub fps: f64,
    /// Stop after this many seconds even if generation has not finished (0: when it has,
    /// plus one second of animation).
    #[arg(long, default_value_t = 0.0)]
    pub seconds: f64,
    /// Print one JSON object (ids, text, frame statistics) instead of the summary.
    #[arg(long)]
    pub json: bool,
    /// Do not use the driver's pipeline cache (kept next to the models otherwise).
    #[arg(long)]
    pub no_pipeline_cache: bool,
}

impl Args {
    pub fn budget(&self) -> Duration {
        Duration::from_secs_f64(self.budget_ms.max(0.0) / 1e3)
    }
    pub fn frame(&self) -> Duration {
        Duration::from_secs_f64(1.0 / self.fps.max(1.0))
    }
}

/// Features the host asks for: what Lantern's fast paths use, when the adapter has them.
pub fn wanted_features(adapter: &wgpu::Adapter) -> wgpu::Features {
    adapter.features() & (wgpu::Features::SHADER_F16 | wgpu::Features::SUBGROUP | wgpu::Features::PIPELINE_CACHE)
}

/// The model loaded onto the host's device, with the request `lantern run PROMPT
/// --max-tokens N` would make (same tokenization, greedy, same stop tokens).
pub struct Loaded {
    pub engine: Engine,
    pub request: GenerateRequest,
    pub ctx: Arc<GpuContext>,
    pub model_path: PathBuf,
    pub load_ms: f64,
    /// `Engine::warm_up`: what the first frame would otherwise pay (lazy shader compiles).
    pub warm_ms: f64,
}

pub fn load(args: &Args, device: wgpu::Device, queue: wgpu::Queue) -> Result<Loaded, Box<dyn std::error::Error>> {
    let t0 = std::time::Instant::now();
    let model_path = match &args.model {
        Some(p) => p.clone(),
        None => lantern::fetch::ensure_default_model(true)?,
    };
    let loaded = lantern::model::load::load_path(&model_path)?;
    let tokenizer = Arc::new(loaded.tokenizer.ok_or_else(|| format!("{} has no tokenizer", model_path.display()))?);
    let ctx = if args.no_pipeline_cache {
        GpuContext::from_device(device, queue)?
    } else {
        GpuContext::from_device_with_pipeline_cache(device, queue, &lantern::fetch::cache_dir().join("pipelines"))?
    };
    let model = pollster::block_on(GpuModel::load(ctx.clone(), &loaded.weights, ModelOptions { max_seqs: 1, ..Default::default() }))?;
    let stop_ids = lantern::engine::generate::default_stop_ids(&model.config.eos_token_ids, &tokenizer);
    let request = GenerateRequest {
        prompt_ids: tokenizer.encode(&args.prompt)?,
        max_tokens: args.max_tokens,
        sampling: SamplingParams::default(),
        stop_ids,
        stop_strings: vec![],
        speculation: Default::default(),
        constraint: None,
        logprobs: None,
        bias: Default::default(),
    };
    let mut engine = Engine::new(model, tokenizer, EngineOptions::default());
    let load_ms = t0.elapsed().as_secs_f64() * 1e3;
    let warm_ms = pollster::block_on(engine.warm_up())?;
    Ok(Loaded { engine, request, ctx, model_path, load_ms, warm_ms })
}

/// Frame and call times the host kept.
#[derive(Default)]
pub struct FrameLog {
    /// Whole frames (the host's work + Lantern's call + presenting), milliseconds.
    pub frame_ms: Vec<f64>,
    /// Each `step_within` call alone, milliseconds.
    pub call_ms: Vec<f64>,
    /// Frames in which a step completed.
    pub steps: usize,
    /// When each token arrived, seconds since the first frame.
    pub token_at: Vec<f64>,
}

impl FrameLog {
    pub fn json(&self, budget: Duration) -> serde_json::Value {
        serde_json::json!({
            "frames": self.frame_ms.len(),
            "steps": self.steps,
            "budget_ms": budget.as_secs_f64() * 1e3,
            "frame_ms": Distribution::of(&self.frame_ms),
            "call_ms": Distribution::of(&self.call_ms),
            "calls_over_budget": self.call_ms.iter().filter(|&&c| c > budget.as_secs_f64() * 1e3).count(),
        })
    }

    /// The summary both examples print.
    pub fn print(&self, budget: Duration, tokens: usize, wall_s: f64) {
        let f = Distribution::of(&self.frame_ms);
        let c = Distribution::of(&self.call_ms);
        let over = self.call_ms.iter().filter(|&&x| x > budget.as_secs_f64() * 1e3).count();
        println!(
            "frames: {} in {wall_s:.1} s ({:.1} fps); {} GPU steps completed",
            self.frame_ms.len(),
            self.frame_ms.len() as f64 / wall_s.max(1e-9),
            self.steps
        );
        println!("frame time ms: p50 {:.2} p95 {:.2} p99 {:.2} max {:.2}", f.p50, f.p95, f.p99, f.max);
        println!(
            "lantern call ms (budget {:.1}): p50 {:.2} p95 {:.2} p99 {:.2} max {:.2}; {over} of {} calls over budget",
            budget.as_secs_f64() * 1e3,
            c.p50,
            c.p95,
            c.p99,
            c.max,
            self.call_ms.len()
        );
        if tokens > 0 {
            let first = self.token_at.first().copied().unwrap_or(0.0);
            let last = self.token_at.last().copied().unwrap_or(0.0);
            let rate = if tokens > 1 { (tokens - 1) as f64 / (last - first).max(1e-9) } else { 0.0 };
            println!("tokens: {tokens}; first after {:.2} s; {rate:.1} tok/s after it", first);
        }
    }
}

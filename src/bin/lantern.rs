//! `lantern`: run language models on any GPU through WebGPU.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};

use lantern::engine::generate::{generate_with, GenerateRequest};
use lantern::engine::{LogitBias, SamplingParams};
use lantern::gpu::{DeviceOptions, GpuContext};
use lantern::model::forward::{ModelOptions, WeightPrecision};
use lantern::model::tokenizer::ChatMessage;

// Subcommand modules live in src/bin/lantern/: every file directly in src/bin is a binary.
#[path = "lantern/bench_cmd.rs"]
mod bench_cmd;
#[path = "lantern/constrained_bench.rs"]
mod constrained_bench;
#[path = "lantern/eval_cmd.rs"]
mod eval_cmd;
#[path = "lantern/info_cmd.rs"]
mod info_cmd;
#[path = "lantern/plan_cmd.rs"]
mod plan_cmd;
#[path = "lantern/quantize_cmd.rs"]
mod quantize_cmd;
#[path = "lantern/serve/mod.rs"]
mod serve_cmd;
#[path = "lantern/spec_args.rs"]
mod spec_args;
#[path = "lantern/spec_bench.rs"]
mod spec_bench;

#[derive(Parser)]
#[command(name = "lantern", version, about = "Portable LLM inference on WebGPU (wgpu)")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Generate text from a prompt (fetches the default model on first use).
    Run(RunArgs),
    /// List every GPU adapter with its backend, type, driver, features and limits.
    Devices {
        /// Only adapters of this backend (vulkan, metal, dx12, gl).
        #[arg(long)]
        backend: Option<String>,
        /// Also measure each adapter's buffer-copy bandwidth (a 256 MiB copy, median of 5):
        /// the baseline kernel and decode bandwidths are compared with.
        #[arg(long)]
        bandwidth: bool,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Download a model into the cache and print its path: the default (smollm2-135m:
    /// SmolLM2-135M-Instruct, Q4_1 GGUF), or one of the catalogue's by name (`lantern models`
    /// lists them). `--model NAME` does the same on first use.
    Fetch {
        /// A catalogue name; default smollm2-135m.
        model: Option<String>,
    },
    /// The models Lantern knows by name: family, size, format, license, and whether each is
    /// already downloaded.
    Models {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Quantize a model (GGUF or Hugging Face folder) to packed q4 / q4sym / q8 weights,
    /// round-to-nearest or AWQ with --calibration, into a safetensors folder.
    Quantize(quantize_cmd::QuantizeArgs),
    /// What a model holds: config, parameters, bytes by dtype in the file and on the GPU
    /// after a native load (scales apart). Needs no GPU.
    Info(info_cmd::InfoArgs),
    /// Memory plan: weights, KV bytes per token and for B sequences of T tokens, workspace,
    /// and what fits a --memory-budget or the adapter's memory (--adapter, --probe). Works
    /// from a config.json alone; needs no GPU unless --adapter or --probe.
    Plan(plan_cmd::PlanArgs),
    /// Serving benchmark: a described workload (lengths, request count, concurrency or a
    /// Poisson rate, shared prefix) through the batching engine; TTFT, ITL, TPOT, E2E
    /// percentiles, throughput and goodput; --json, --plot, --sweep.
    Bench(bench_cmd::BenchArgs),
    /// OpenAI-compatible HTTP server on localhost (/v1/completions, /v1/chat/completions with
    /// streaming, /v1/models, /metrics, /health).
    Serve(serve_cmd::ServeArgs),
    /// Evaluate: perplexity on a text (`eval ppl`), or compare two models (`eval compare`).
    #[command(subcommand)]
    Eval(eval_cmd::EvalCmd),
    /// A GGUF with a real model's header (architecture, tokenizer, every tensor's type and
    /// shape) and generated weights, for speed tests where the model cannot be downloaded
    /// (a GPU machine without network): the tokens it generates mean nothing.
    Synth {
        /// The model to copy: a GGUF file, a catalogue name, or a header written by
        /// `--header-only`.
        #[arg(long)]
        like: PathBuf,
        /// Where to write it.
        #[arg(long)]
        out: PathBuf,
        /// Write only the header (a few MB): expand it later with `synth --like HEADER`.
        #[arg(long)]
        header_only: bool,
    },
}

#[derive(Args)]
struct DeviceArgs {
    /// Adapter by index (as `lantern devices` lists them) or name substring.
    #[arg(long)]
    adapter: Option<String>,
    /// Pin a backend: vulkan, metal, dx12, gl.
    #[arg(long)]
    backend: Option<String>,
    /// Compile every pipeline from scratch: neither read nor write the driver's pipeline
    /// cache (kept in <cache dir>/pipelines where the backend has one: Vulkan).
    #[arg(long)]
    no_pipeline_cache: bool,
    /// Force the decode matvec's layout: thread, rows4, wg8, wg64, multirow (default: the
    /// adapter's; for comparisons).
    #[arg(long, help_heading = "Kernel choices (comparisons)")]
    matvec: Option<lantern::gpu::MatvecLayout>,
    /// Force the prefill matmul: tiled or blocked (default: the adapter's).
    #[arg(long, help_heading = "Kernel choices (comparisons)")]
    matmul: Option<lantern::gpu::MatmulLayout>,
    /// Do not share x by subgroup broadcast (CPU adapters with 8-lane subgroups).
    #[arg(long, help_heading = "Kernel choices (comparisons)")]
    no_xbcast: bool,
    /// Keep packed weights in storage buffers instead of tiled textures (CPU adapters with
    /// 8-lane subgroups).
    #[arg(long, help_heading = "Kernel choices (comparisons)")]
    no_weight_textures: bool,
    /// Read x from storage in the tiled matvec instead of 64 KiB uniform windows.
    #[arg(long, help_heading = "Kernel choices (comparisons)")]
    no_uniform_x: bool,
    /// Read x from storage in the CPU adapters' prefill instead of a texture copy.
    #[arg(long, help_heading = "Kernel choices (comparisons)")]
    no_x_textures: bool,
    /// Dequantize packed weights in f32 on GPUs with shader-f16.
    #[arg(long, help_heading = "Kernel choices (comparisons)")]
    no_f16_dequant: bool,
}

impl DeviceArgs {
    /// The kernel choices these flags ask for.
    fn kernels(&self) -> lantern::gpu::KernelOptions {
        lantern::gpu::KernelOptions {
            matvec: self.matvec,
            matmul: self.matmul,
            xbcast: !self.no_xbcast,
            weight_textures: !self.no_weight_textures,
            uniform_x: !self.no_uniform_x,
            x_textures: !self.no_x_textures,
            f16_dequant: !self.no_f16_dequant,
        }
    }

    /// Open the chosen adapter (or the best one) as a GPU context.
    fn open(&self) -> Result<std::sync::Arc<GpuContext>> {
        let pipeline_cache_dir = (!self.no_pipeline_cache && std::env::var_os("LANTERN_NO_PIPELINE_CACHE").is_none())
            .then(|| lantern::fetch::cache_dir().join("pipelines"));
        Ok(pollster::block_on(GpuContext::new(&DeviceOptions {
            backend: self.backend.clone(),
            adapter: self.adapter.clone(),
            pipeline_cache_dir,
            kernels: self.kernels(),
            ..Default::default()
        }))?)
    }
}

/// One line on pipeline compilation: how many, how long, and what the driver cache did.
fn pipeline_line(p: &lantern::gpu::PipelineStats) -> String {
    use lantern::gpu::DriverCacheState as D;
    let cache = match &p.driver_cache {
        D::Unsupported => "no driver pipeline cache on this backend".to_string(),
        D::NotPersisted => "driver cache not persisted".to_string(),
        D::Empty { path } => format!("driver cache empty, saved to {path}"),
        D::Loaded { path, bytes } => format!("driver cache {:.1} MB loaded from {path}", *bytes as f64 / 1e6),
        D::Rejected { path, reason } => format!("driver cache {path} ignored ({reason}), rewritten"),
    };
    format!("{} pipelines compiled in {:.0} ms; {cache}", p.compiled, p.compile_ms)
}

#[derive(Args)]
struct RunArgs {
    /// The prompt (or the user message with --chat).
    prompt: String,
    /// A GGUF file, a Hugging Face folder or a catalogue name (qwen2.5-coder-0.5b, ...; fetched
    /// once). Default: SmolLM2-135M-Instruct, fetched once.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Wrap the prompt in the model's chat template as one user message.
    #[arg(long)]
    chat: bool,
    /// System message for --chat (default: the template's own).
    #[arg(long)]
    system: Option<String>,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// Sampling temperature; 0 = greedy (argmax on the GPU).
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Keep the k most likely tokens (0 = off).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Nucleus sampling: keep the smallest set of tokens whose probability reaches p.
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Seed of the sampler.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Stop when this string appears (repeatable); the text is cut before it.
    #[arg(long)]
    stop: Vec<String>,
    /// Add DELTA to token ID's logit at every step (repeatable; OpenAI's `logit_bias`:
    /// -100 bans a token, 100 all but forces it).
    #[arg(long, value_name = "ID=DELTA", value_parser = parse_logit_bias)]
    logit_bias: Vec<(u32, f32)>,
    /// Subtract this from the logit of every token already generated (OpenAI's).
    #[arg(long, default_value_t = 0.0, allow_hyphen_values = true)]
    presence_penalty: f32,
    /// Subtract this from a token's logit for each time it was already generated (OpenAI's).
    #[arg(long, default_value_t = 0.0, allow_hyphen_values = true)]
    frequency_penalty: f32,
    /// Constrained decoding: the output is JSON valid against the JSON schema in this file
    /// (llguidance; masked on the GPU each step).
    #[arg(long, value_name = "FILE", conflicts_with_all = ["regex", "grammar", "json_object"])]
    json_schema: Option<PathBuf>,
    /// Constrained decoding: the output is one JSON object (any keys).
    #[arg(long, conflicts_with_all = ["regex", "grammar"])]
    json_object: bool,
    /// Constrained decoding: the output matches this regular expression.
    #[arg(long, conflicts_with = "grammar")]
    regex: Option<String>,
    /// Constrained decoding: the output is in the language of this Lark grammar file.
    #[arg(long, value_name = "FILE.lark")]
    grammar: Option<PathBuf>,
    /// Context window in tokens (prompt + output). Default: min(model's, 2048).
    #[arg(long)]
    context: Option<usize>,
    /// Weight storage on the GPU: native (quantized weights stay packed and are dequantized
    /// in the kernels, f16 stays f16, the rest f32), f32 (everything expanded), or f16
    /// (everything rounded to half precision).
    #[arg(long, value_enum, default_value_t = Weights::Native)]
    weights: Weights,
    /// KV cache storage: f32 (exact), f16 (half the bytes), q8 (int8 with an f32 scale per
    /// token and head: about a quarter), q4 (4-bit codes, V scaled per 32 elements, K per
    /// channel over each page: about a sixth; SmolLM2's perplexity at 2k context rises
    /// 1.6%; a sequence rolls back at most into the page before the last one written).
    #[arg(long, value_enum, default_value_t = KvArg::F32)]
    kv_dtype: KvArg,
    /// Cap on GPU memory for weights + KV cache + workspace (bytes; K, M, G, Ki, Mi, Gi
    /// suffixes). The KV cache gets what is left, at most one full context. Default: 90% of
    /// what the adapter reports.
    #[arg(long)]
    memory_budget: Option<String>,
    /// Sliding-window layers (Gemma 3's local layers): keep only a ring of their window's
    /// pages per sequence (`ring`), every token (`full`, which keeps the prefix cache), or a
    /// ring where it is smaller than the context (`auto`).
    #[arg(long, default_value = "auto", value_parser = ["auto", "ring", "full"])]
    kv_window: String,
    /// Do not reuse the KV pages of an earlier prompt with the same beginning.
    #[arg(long)]
    no_prefix_cache: bool,
    /// Greedy decode steps kept in flight ahead of the host reading their tokens (each
    /// step's GPU argmax feeds the next one on the GPU; stops are checked as tokens arrive
    /// and the steps past one are rolled back). 0 or 1: one step at a time.
    #[arg(long, default_value_t = 3)]
    decode_ahead: usize,
    /// Decode exactly --max-tokens: no end-of-sequence token or stop string ends the run
    /// (benchmarks; synthetic models from `lantern synth`).
    #[arg(long)]
    ignore_eos: bool,
    /// Print one JSON object instead of streaming.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    spec: spec_args::SpecArgs,
    #[command(flatten)]
    device: DeviceArgs,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum Weights {
    Native,
    F32,
    F16,
}

/// KV cache storage.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum KvArg {
    F32,
    F16,
    Q8,
    Q4,
}

impl KvArg {
    pub fn dtype(self) -> lantern::kv::plan::KvDtype {
        match self {
            KvArg::F32 => lantern::kv::plan::KvDtype::F32,
            KvArg::F16 => lantern::kv::plan::KvDtype::F16,
            KvArg::Q8 => lantern::kv::plan::KvDtype::Q8,
            KvArg::Q4 => lantern::kv::plan::KvDtype::Q4,
        }
    }
}

fn main() {
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::Run(a) => run(a),
        Cmd::Devices { backend, bandwidth, json } => devices(backend, bandwidth, json),
        Cmd::Quantize(a) => quantize_cmd::quantize(a),
        Cmd::Info(a) => info_cmd::info(a),
        Cmd::Plan(a) => plan_cmd::run(a),
        Cmd::Eval(c) => eval_cmd::eval(c),
        Cmd::Bench(a) => bench_cmd::run(a),
        Cmd::Serve(a) => serve_cmd::run(a),
        Cmd::Models { json } => models(json),
        Cmd::Synth { like, out, header_only } => synth(&like, &out, header_only),
        Cmd::Fetch { model } => lantern::fetch::resolve_model(model.as_deref().map(std::path::Path::new), true).map(|p| {
            println!("{}", p.display());
        }),
    };
    if let Err(e) = r {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn models(json: bool) -> Result<()> {
    let list = lantern::fetch::listing();
    if json {
        println!("{}", serde_json::to_string_pretty(&list)?);
        return Ok(());
    }
    println!("{:<20} {:<8} {:>7} {:<8} {:<11} {:>9}  DOWNLOADED", "NAME", "FAMILY", "PARAMS", "FORMAT", "LICENSE", "SIZE");
    for m in &list {
        let name = if m.default { format!("{} *", m.name) } else { m.name.to_string() };
        let have = if m.downloaded { format!("yes  {}", m.path.display()) } else { "no".to_string() };
        println!("{:<20} {:<8} {:>7} {:<8} {:<11} {:>6} MB  {}", name, m.family, m.params, m.format, m.license, m.bytes / 1_000_000, have);
    }
    println!("* the default model. `lantern fetch NAME` downloads one; `--model NAME` does on first use.");
    Ok(())
}

fn synth(like: &std::path::Path, out: &std::path::Path, header_only: bool) -> Result<()> {
    use lantern::model::gguf::synth;
    let path = lantern::fetch::resolve_model(Some(like), true)?;
    let name = path.display().to_string();
    // The header is at the start of the file: read until it parses (tokenizers make it MBs).
    use std::io::Read as _;
    let mut bytes = Vec::new();
    let mut f = std::fs::File::open(&path).with_context(|| format!("opening {name}"))?;
    let head = loop {
        let before = bytes.len();
        std::io::Read::by_ref(&mut f).take((before as u64).max(1 << 20)).read_to_end(&mut bytes)?;
        match synth::header(&bytes, &name) {
            Ok(h) => break h,
            Err(lantern::model::gguf::GgufError::Truncated { .. }) if bytes.len() > before => continue,
            Err(e) => return Err(e.into()),
        }
    };
    let mut w = std::io::BufWriter::new(std::fs::File::create(out).with_context(|| format!("creating {}", out.display()))?);
    if header_only {
        w.write_all(&head)?;
        w.flush()?;
        eprintln!("lantern: header of {name} ({:.1} MB) written to {}", head.len() as f64 / 1e6, out.display());
        return Ok(());
    }
    let total = synth::data_bytes(&head, &name)?;
    let pb = ProgressBar::new(total);
    pb.set_style(ProgressStyle::with_template("{msg} {bar:30} {bytes}/{total_bytes}").unwrap_or_else(|_| ProgressStyle::default_bar()));
    pb.set_message("writing synthetic weights");
    let size = synth::write_synthetic(&head, &name, &mut w, &mut |done, _| pb.set_position(done))?;
    w.flush()?;
    pb.finish_and_clear();
    eprintln!("lantern: {} written: {:.1} MB, the header of {name} with generated weights", out.display(), size as f64 / 1e6);
    Ok(())
}

fn devices(backend: Option<String>, bandwidth: bool, json: bool) -> Result<()> {
    let list = pollster::block_on(lantern::gpu::list_adapters(backend.as_deref()))?;
    let copy_gbps: Vec<Option<f64>> = list
        .iter()
        .map(|a| {
            if !bandwidth {
                return Ok(None);
            }
            // The index is the adapter's place in the list just made, with the same filter.
            let opts = DeviceOptions { backend: backend.clone(), adapter: Some(a.index.to_string()), ..Default::default() };
            let ctx = pollster::block_on(GpuContext::new(&opts))?;
            Ok(Some(lantern::gpu::memory::copy_bandwidth(&ctx, 256 << 20, 5)?))
        })
        .collect::<Result<_>>()?;
    if json {
        let mut v = serde_json::to_value(&list)?;
        if let Some(arr) = v.as_array_mut() {
            for (a, g) in arr.iter_mut().zip(&copy_gbps) {
                if let (Some(o), Some(g)) = (a.as_object_mut(), g) {
                    o.insert("copy_gbps".into(), serde_json::json!(g));
                }
            }
        }
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    if list.is_empty() {
        bail!("no GPU adapter found (on Linux without a GPU, install mesa-vulkan-drivers for lavapipe)");
    }
    for a in &list {
        println!("[{}] {} ({}, {})", a.index, a.name, a.backend, a.device_type);
        println!("    driver: {} {}", a.driver, a.driver_info);
        println!("    features: {}", if a.features.is_empty() { "-".into() } else { a.features.join(", ") });
        let l = &a.limits;
        println!(
            "    limits: max_buffer_size {} MiB, max_storage_buffer_binding_size {} MiB, {} storage buffers/stage, {} B workgroup memory, {} invocations/workgroup",
            l.max_buffer_size >> 20,
            l.max_storage_buffer_binding_size >> 20,
            l.max_storage_buffers_per_shader_stage,
            l.max_compute_workgroup_storage_size,
            l.max_compute_invocations_per_workgroup
        );
        if let Some(g) = copy_gbps[a.index] {
            println!("    buffer copy: {g:.2} GB/s read");
        }
    }
    Ok(())
}

fn spinner(msg: &str, quiet: bool) -> ProgressBar {
    if quiet {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new_spinner();
    pb.set_style(ProgressStyle::with_template("{spinner} {msg} {elapsed}").unwrap_or_else(|_| ProgressStyle::default_spinner()));
    pb.set_message(msg.to_string());
    pb.enable_steady_tick(std::time::Duration::from_millis(120));
    pb
}

fn run(a: RunArgs) -> Result<()> {
    let model_path = lantern::fetch::resolve_model(a.model.as_deref(), true)?;
    let t0 = Instant::now();
    let pb = spinner(&format!("loading {}", model_path.display()), false);
    pb.set_message("choosing adapter");
    let ctx = a.device.open()?;
    pb.set_message(format!("uploading weights to {}", ctx.info.name));
    let model_options = ModelOptions {
        context: a.context,
        weights: match a.weights {
            Weights::Native => WeightPrecision::Native,
            Weights::F32 => WeightPrecision::F32,
            Weights::F16 => WeightPrecision::F16,
        },
        kv_dtype: a.kv_dtype.dtype(),
        memory_budget: a.memory_budget.as_deref().map(plan_cmd::parse_bytes).transpose()?,
        prefix_cache: !a.no_prefix_cache,
        kv_window: a.kv_window.parse().map_err(anyhow::Error::msg)?,
        decode_ahead: a.decode_ahead,
        ..Default::default()
    };
    // wgpu's noop backend runs no kernel and reads back zeros: its tokens mean nothing, so
    // a run there ignores EOS and stop strings and decodes exactly --max-tokens (its time
    // per token is the host's own cost).
    let noop = ctx.info.backend == wgpu::Backend::Noop;
    let (mut model, tokenizer) =
        pollster::block_on(lantern::model::load::load_to_gpu(ctx.clone(), &model_path, model_options.clone(), &mut |_, _| {}))
            .with_context(|| format!("loading {}", model_path.display()))?;
    let tokenizer = tokenizer.with_context(|| format!("{} has no tokenizer (tokenizer.json)", model_path.display()))?;
    if a.spec.draft.is_some() {
        pb.set_message("loading the draft model");
    }
    // Speculation's step costs as measured by earlier runs on this adapter (the first run
    // measures them: `warmup_ms` in its speculative stats). Where they already show that no
    // draft could pay here, the draft model is not even loaded.
    let mut speculation = a.spec.speculation();
    let cost_files = if speculation.enabled() && !noop {
        let (t, d) = a.spec.cost_files(&ctx, &model_path, &model_options)?;
        lantern::engine::step_costs::load(&mut model, &t);
        Some((t, d))
    } else {
        None
    };
    let draft_costs = cost_files.as_ref().and_then(|(_, d)| d.as_deref()).map(lantern::engine::step_costs::table);
    let unloaded = draft_costs
        .as_deref()
        .filter(|c| !c.is_empty())
        .and_then(|c| lantern::engine::speculative::why_plain(&speculation, model.step_costs(), Some(c), speculation.max_draft));
    let mut draft = if unloaded.is_some() {
        speculation = lantern::engine::Speculation::default();
        None
    } else {
        pollster::block_on(a.spec.load_draft(ctx.clone(), &model_path, &model, &tokenizer, model_options.clone()))?.map(|d| d.0)
    };
    if let (Some((_, Some(p))), Some(dm)) = (&cost_files, draft.as_mut()) {
        lantern::engine::step_costs::load(dm, p);
    }
    pb.finish_and_clear();
    let load_ms = t0.elapsed().as_secs_f64() * 1e3;

    let prompt_text = if a.chat {
        let tmpl = tokenizer.chat_template().context("this model has no usable chat template")?;
        let mut msgs = Vec::new();
        if let Some(s) = &a.system {
            msgs.push(ChatMessage::system(s.clone()));
        }
        msgs.push(ChatMessage::user(a.prompt.clone()));
        tmpl.render(&msgs, true)?
    } else {
        a.prompt.clone()
    };
    let prompt_ids = if a.chat { tokenizer.encode_chat(&prompt_text)? } else { tokenizer.encode(&prompt_text)? };
    let ignore_eos = noop || a.ignore_eos;
    let stop_ids =
        if ignore_eos { Vec::new() } else { lantern::engine::generate::default_stop_ids(&model.config.eos_token_ids, &tokenizer) };
    let req = GenerateRequest {
        prompt_ids,
        max_tokens: a.max_tokens,
        sampling: SamplingParams { temperature: a.temperature, top_k: a.top_k, top_p: a.top_p, seed: a.seed },
        stop_ids,
        stop_strings: if ignore_eos { Vec::new() } else { a.stop.clone() },
        speculation,
        constraint: run_constraint(&a)?,
        logprobs: None,
        bias: LogitBias { tokens: a.logit_bias.clone(), presence_penalty: a.presence_penalty, frequency_penalty: a.frequency_penalty },
    };
    let json = a.json;
    let stdout = std::io::stdout();
    let mut gen = pollster::block_on(generate_with(&mut model, draft.as_mut(), &tokenizer, &req, |piece| {
        if !json {
            let mut out = stdout.lock();
            let _ = out.write_all(piece.as_bytes());
            let _ = out.flush();
        }
        true
    }))?;
    if let Some(reason) = unloaded {
        let decoded = gen.output_ids.len().saturating_sub(1);
        let decode_ms = gen.host.as_ref().map_or(0.0, |h| h.ms_per_token * h.tokens as f64);
        gen.speculative = Some(lantern::engine::SpecStats::unspeculated(
            lantern::engine::Drafter::Model,
            format!("{reason} (measured earlier; the draft model was not loaded)"),
            decoded,
            decode_ms,
            model.step_costs().get(1).copied().flatten(),
        ));
    }
    let m = gen.timings.metrics();
    let prefill_tps = m.ttft_ms.map(|t| gen.prompt_ids.len() as f64 / (t / 1e3));
    if let Err(e) = ctx.save_pipeline_cache() {
        eprintln!("warning: saving the pipeline cache failed: {e}");
    }
    if let Some((t, d)) = &cost_files {
        let saved = lantern::engine::step_costs::save(&model, t).and_then(|_| match (d, draft.as_ref()) {
            (Some(p), Some(dm)) => lantern::engine::step_costs::save(dm, p),
            _ => Ok(()),
        });
        if let Err(e) = saved {
            eprintln!("warning: saving the step costs failed: {e}");
        }
    }
    let pipelines = ctx.pipelines.stats();
    if json {
        let v = serde_json::json!({
            "prompt_ids": gen.prompt_ids,
            "output_ids": gen.output_ids,
            "text": gen.text,
            "finish_reason": gen.finish_reason.as_str(),
            "ttft_ms": m.ttft_ms,
            "tpot_ms": m.tpot_ms,
            "tokens_per_s": m.tokens_per_s,
            "e2e_ms": m.e2e_ms,
            "prefill_tokens_per_s": prefill_tps,
            "cached_prompt_tokens": gen.cached_prompt_tokens,
            "speculative": gen.speculative,
            "kv_dtype": model.options.kv_dtype,
            "load_ms": load_ms,
            "dispatches_per_decode_step": model.dispatches_per_decode_step(),
            "decode_ahead": model.decode_ahead_depth(),
            "host": gen.host,
            "noop": noop,
            "dispatches_per_prefill_step": model.dispatches_per_prefill_step(),
            "weight_bytes": model.weight_bytes(),
            "weight_bytes_per_token": model.weight_bytes_per_token(),
            "weight_precision": model.options.weights,
            "kv_cache_bytes": model.kv.bytes(),
            "memory": model.memory(),
            "context": model.kv.alloc.config.context,
            "model": {
                "path": model_path.display().to_string(),
                "config": model.config,
            },
            "adapter": ctx.adapter_json(),
            "pipelines": pipelines,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        println!();
        let f = |v: Option<f64>| v.map_or("-".to_string(), |x| format!("{x:.1}"));
        eprintln!(
            "[{} | {} prompt + {} output tokens, finish: {} | TTFT {} ms ({} tok/s prefill) | TPOT {} ms | {} tok/s decode | {} dispatches/token | load {:.0} ms]",
            ctx.info.name,
            gen.prompt_ids.len(),
            gen.output_ids.len(),
            gen.finish_reason.as_str(),
            f(m.ttft_ms),
            f(prefill_tps),
            f(m.tpot_ms),
            f(m.tokens_per_s),
            model.dispatches_per_decode_step(),
            load_ms
        );
        let mem = model.memory();
        let mb = |b: u64| b as f64 / 1e6;
        let by_dtype: Vec<String> = mem
            .weights
            .iter()
            .map(|(k, d)| {
                if d.scale_bytes > 0 {
                    let pad = if d.padding > 0 { format!(", + {:.1} MB texture padding", mb(d.padding)) } else { String::new() };
                    format!(
                        "{k} {:.1} MB ({} tensors, {:.1} MB of it scales{pad})",
                        mb(d.bytes + d.scale_bytes),
                        d.tensors,
                        mb(d.scale_bytes)
                    )
                } else {
                    format!("{k} {:.1} MB ({} tensors)", mb(d.bytes), d.tensors)
                }
            })
            .collect();
        let tex = if mem.tiled_weights > 0 { format!(" ({:.1} MB of it as tiled textures)", mb(mem.tiled_weights)) } else { String::new() };
        let rings = match &mem.kv_window_ring {
            Some(r) => format!("; sliding layers keep a {}-token ring per sequence, {:.1} MB of it", r.tokens(), mb(mem.kv_ring_bytes)),
            None => String::new(),
        };
        let xt = if mem.x_textures > 0 { format!(" ({:.1} MB of it prefill x textures)", mb(mem.x_textures)) } else { String::new() };
        eprintln!(
            "[GPU memory {:.1} MB: weights {:.1} MB = {}{tex} | KV cache {:.1} MB ({:?}, {} pages of {} tokens in {} buffer(s) per layer for K and V{rings}) | workspace {:.1} MB{xt} | budget {}]",
            mb(mem.ledger_bytes),
            mb(mem.weight_bytes()),
            by_dtype.join(", "),
            mb(mem.kv_cache),
            mem.kv_dtype,
            mem.kv_pages,
            mem.kv_page_size,
            mem.kv_buffers_per_layer,
            mb(mem.workspace),
            match mem.budget {
                Some(b) => format!("{:.1} MB from {}", mb(b), mem.budget_source),
                None => mem.budget_source.clone(),
            }
        );
        eprintln!("[{}]", pipeline_line(&pipelines));
        if let Some(moe) = &model.config.block.moe {
            eprintln!(
                "[mixture of experts: {} of {} experts per token, so a decode token reads {:.1} MB of the {:.1} MB of weights ({:.0}%)]",
                moe.experts_per_token,
                moe.experts,
                mb(model.weight_bytes_per_token()),
                mb(model.weight_bytes()),
                100.0 * model.weight_bytes_per_token() as f64 / model.weight_bytes().max(1) as f64
            );
        }
        if let Some(h) = &gen.host {
            eprintln!(
                "[host per decode token: {:.3} ms ({:.3} ms busy), {:.0} dispatches, {:.2} submits, {:.2} writes, {:.2} readbacks, {:.2} waits ({:.2} leaving the device idle), {:.2} bind groups and {:.2} buffers created | {} steps in flight{}]",
                h.ms_per_token,
                h.busy_ms_per_token,
                h.dispatches_per_token,
                h.submits_per_token,
                h.writes_per_token,
                h.readbacks_per_token,
                h.waits_per_token,
                h.stalls_per_token,
                h.bind_groups_per_token,
                h.buffers_per_token,
                model.decode_ahead_depth().max(1),
                if noop { " | noop backend: no kernel ran, so the tokens are meaningless; EOS and stop strings were ignored and exactly --max-tokens decoded" } else { "" }
            );
        }
        if let Some(sp) = &gen.speculative {
            eprintln!(
                "[speculative ({:?}): {} drafted, {} accepted ({:.0}%), {:.2} tokens per target step over {} verify + {} plain steps | draft {:.0} ms, verify {:.0} ms | gain {:.2}x expected, {:.2}x measured against a {:.1} ms plain step{}]",
                sp.drafter,
                sp.proposed,
                sp.accepted,
                sp.acceptance_rate * 100.0,
                sp.tokens_per_step,
                sp.steps,
                sp.plain_steps,
                sp.draft_ms,
                sp.verify_ms,
                sp.expected_gain,
                sp.measured_gain,
                sp.plain_step_ms,
                if sp.warmup_ms > 0.0 { format!(" | step costs measured first: {:.0} ms, kept for later runs", sp.warmup_ms) } else { String::new() }
            );
            if let Some(r) = &sp.plain_reason {
                eprintln!("[speculative: decoded plainly: {r}]");
            }
        }
    }
    Ok(())
}

/// The constraint `run`'s flags ask for (`--json-schema`, `--json-object`, `--regex`,
/// `--grammar`), read from their files.
/// `--logit-bias ID=DELTA`.
fn parse_logit_bias(s: &str) -> std::result::Result<(u32, f32), String> {
    let (id, d) = s.split_once('=').ok_or_else(|| format!("{s:?}: expected TOKEN_ID=DELTA, e.g. 13=-100"))?;
    let id = id.trim().parse().map_err(|_| format!("{id:?} is not a token id"))?;
    let d: f32 = d.trim().parse().map_err(|_| format!("{d:?} is not a number"))?;
    if !d.is_finite() {
        return Err(format!("{d} is not a finite number"));
    }
    Ok((id, d))
}

fn run_constraint(a: &RunArgs) -> Result<Option<lantern::engine::Constraint>> {
    use lantern::engine::Constraint;
    let read = |p: &PathBuf| std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()));
    Ok(if let Some(p) = &a.json_schema {
        let schema: serde_json::Value =
            serde_json::from_str(&read(p)?).with_context(|| format!("{} is not JSON (a JSON schema)", p.display()))?;
        Some(Constraint::JsonSchema(schema))
    } else if a.json_object {
        Some(Constraint::JsonObject)
    } else if let Some(r) = &a.regex {
        Some(Constraint::Regex(r.clone()))
    } else if let Some(p) = &a.grammar {
        Some(Constraint::Lark(read(p)?))
    } else {
        None
    })
}

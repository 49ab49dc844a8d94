//! `lantern serve`: an OpenAI-compatible HTTP server over the batching engine.
//!
//! Three parts, top to bottom:
//! - `transport` (src/bin/lantern/serve/transport.rs): hyper's HTTP/1.1 on tokio with axum's
//!   routing: connection caps, read deadlines, the API key, access log, graceful shutdown.
//! - the OpenAI types and their validation, in the library (`lantern::openai`, src/openai.rs),
//!   so that they are fuzzed and tested without a server;
//! - `bridge` (src/bin/lantern/serve/bridge.rs): a validated request submitted to the
//!   [`EngineWorker`](lantern::engine::EngineWorker) thread and its events turned into one JSON
//!   answer or server-sent events, with the request deadline, cancellation when the client
//!   goes away, and the shutdown's cancellation.
//!
//! `metrics` renders `/metrics` (the `lantern_*` names and vLLM's, which routers read);
//! `ollama` answers Ollama's API over the same submission path. Endpoints:
//! - OpenAI: `POST /v1/completions`, `POST /v1/chat/completions`, `POST /v1/responses`
//!   (`responses`), `GET /v1/models`, `GET /v1/models/{id}`;
//! - Anthropic: `POST /v1/messages` (`anthropic`);
//! - Ollama: `POST /api/chat`, `POST /api/generate`, `GET /api/tags`, `POST /api/show`,
//!   `GET /api/ps`, `GET /api/version`;
//! - vLLM's `POST /tokenize` and `POST /detokenize`;
//! - embeddings (`embeddings`): OpenAI's `POST /v1/embeddings`, Ollama's `POST /api/embed` and
//!   `POST /api/embeddings`;
//! - `GET /metrics` (Prometheus text format) and `GET /health` (`/healthz`), the only one
//!   that never needs the API key (`Authorization: Bearer` or `x-api-key`): 503 while the model loads (the port is bound first) and
//!   while the server drains after SIGTERM, 200 in between.

#[path = "anthropic.rs"]
mod anthropic;
#[path = "bridge.rs"]
mod bridge;
#[path = "embeddings.rs"]
mod embeddings;
#[path = "metrics.rs"]
mod metrics;
#[path = "ollama.rs"]
mod ollama;
#[path = "responses.rs"]
mod responses;
#[path = "transport.rs"]
mod transport;

use std::io::Write as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use anyhow::{Context as _, Result};
use clap::Args;

use lantern::engine::{Engine, EngineOptions};
use lantern::model::forward::{ModelOptions, Pooling};

use super::{plan_cmd, spinner, DeviceArgs, KvArg};
use metrics::unix_now;
use ollama::ModelInfo;
pub use transport::ServerConfig;

#[derive(Args)]
pub struct ServeArgs {
    /// A GGUF file, a Hugging Face folder or a catalogue name (qwen2.5-coder-0.5b, ...; fetched
    /// once). Default: SmolLM2-135M-Instruct, fetched once.
    #[arg(long)]
    model: Option<PathBuf>,
    /// The model id clients send and /v1/models lists. Default: the model file's stem (the
    /// exact --model path is accepted too).
    #[arg(long)]
    model_name: Option<String>,
    /// Address to bind. Anything but a loopback address exposes the server to the network:
    /// set an API key then.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on; 0 picks a free one (the startup line says which).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Require `Authorization: Bearer KEY` on every endpoint but /health. Default: the
    /// LANTERN_API_KEY environment variable (preferred: a command line is visible to other
    /// users of the machine).
    #[arg(long)]
    api_key: Option<String>,
    /// Sequences decoded together (each holds KV pages while it runs).
    #[arg(long, default_value_t = 8)]
    max_seqs: usize,
    /// Context window in tokens (prompt + completion). Default: min(model's, 2048).
    #[arg(long)]
    context: Option<usize>,
    /// KV cache storage: f32 (exact), f16 (half the bytes), q8 (about a quarter).
    #[arg(long, value_enum, default_value_t = KvArg::F32)]
    kv_dtype: KvArg,
    /// Cap on GPU memory for weights + KV cache + workspace (bytes; K, M, G, Ki, Mi, Gi
    /// suffixes). Default: 90% of what the adapter reports.
    #[arg(long)]
    memory_budget: Option<String>,
    /// Requests queued for admission at most; beyond it requests get 429 with Retry-After.
    #[arg(long, default_value_t = 64)]
    max_waiting: usize,
    /// Open connections at most. At the cap, the oldest connection without a request in
    /// flight (idle keep-alive, or still sending its request) is closed to make room; when
    /// every one has a request in flight, new connections get 503 at once.
    #[arg(long, default_value_t = 1024)]
    max_connections: usize,
    /// Connections without a request in flight kept at most; beyond it the oldest is closed.
    #[arg(long, default_value_t = 256)]
    max_idle_connections: usize,
    /// Seconds a client has to send a whole request: its headers (the connection is closed
    /// beyond it, also when idle between keep-alive requests), then its body (408).
    #[arg(long, default_value_t = 30)]
    read_timeout: u64,
    /// On SIGINT or SIGTERM: stop accepting, let running requests finish for this many
    /// seconds, then cancel the rest (each ends with a final error event or a 503).
    #[arg(long, default_value_t = 30)]
    shutdown_timeout: u64,
    /// Seconds between `: keep-alive` comments on a stream that has nothing to send (a
    /// request waiting in the queue or a long prefill); 0 = none.
    #[arg(long, default_value_t = 10)]
    sse_keepalive: u64,
    /// Cancel a request that has not finished after this many seconds (504, or an error
    /// event in a stream); 0 = never.
    #[arg(long, default_value_t = 600)]
    request_timeout: u64,
    /// Sliding-window layers (Gemma 3's local layers): keep only a ring of their window's
    /// pages per sequence (`ring`), every token (`full`, which keeps the prefix cache), or a
    /// ring where it is smaller than the context (`auto`).
    #[arg(long, default_value = "auto", value_parser = ["auto", "ring", "full"])]
    kv_window: String,
    /// Do not reuse the KV pages of an earlier prompt with the same beginning.
    #[arg(long)]
    no_prefix_cache: bool,
    /// Same kernels for every step, so a request's output does not depend on what it is
    /// batched with (slower decode).
    #[arg(long)]
    batch_invariant: bool,
    /// How `/v1/embeddings` and `/api/embed` pool a text's positions into one vector (each
    /// position's final hidden state after the model's final norm; the result has unit
    /// length): `mean` or `last` (the last token's). A request's `pooling` field overrides it.
    #[arg(long, default_value = "mean", value_parser = ["mean", "last"])]
    embedding_pooling: String,
    /// No access log on stderr.
    #[arg(long)]
    quiet: bool,
    /// Speculative decoding for every request (a request may override it with
    /// `"speculative": {"drafter": "lookup" | "model" | "off", "draft_tokens": k}`).
    #[command(flatten)]
    spec: super::spec_args::SpecArgs,
    #[command(flatten)]
    device: DeviceArgs,
}

pub fn run(a: ServeArgs) -> Result<()> {
    let model_path = lantern::fetch::resolve_model(a.model.as_deref(), true)?;
    if a.max_seqs == 0 {
        anyhow::bail!("--max-seqs must be at least 1");
    }
    // Bind first: a port in use fails at once, and while the model loads every request (a
    // readiness probe's /health included) gets 503 instead of a refused connection.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("lantern-http")
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    let listener = runtime.block_on(transport::bind(&a.host, a.port))?;
    let bound = listener.local_addr().context("reading the bound address")?;
    let (ready_tx, ready_rx) = tokio::sync::watch::channel(false);
    let loading = runtime.spawn(transport::serve_loading(listener, ready_rx));
    eprintln!("lantern serve: bound http://{bound}; loading the model (requests get 503 until it is ready)");
    let info = model_info(&model_path);
    let pb = spinner(&format!("loading {}", model_path.display()), false);
    pb.set_message("choosing adapter");
    let ctx = a.device.open()?;
    pb.set_message(format!("uploading weights to {}", ctx.info.name));
    let model_options = ModelOptions {
        context: a.context,
        max_seqs: a.max_seqs,
        max_batch_tokens: 128,
        kv_dtype: a.kv_dtype.dtype(),
        memory_budget: a.memory_budget.as_deref().map(plan_cmd::parse_bytes).transpose()?,
        prefix_cache: !a.no_prefix_cache,
        kv_window: a.kv_window.parse().map_err(anyhow::Error::msg)?,
        batch_invariant: a.batch_invariant,
        ..Default::default()
    };
    let (model, tokenizer) =
        pollster::block_on(lantern::model::load::load_to_gpu(ctx.clone(), &model_path, model_options.clone(), &mut |_, _| {}))
            .with_context(|| format!("loading {}", model_path.display()))?;
    let tokenizer = tokenizer.with_context(|| format!("{} has no tokenizer (tokenizer.json)", model_path.display()))?;
    if a.spec.draft.is_some() {
        pb.set_message("loading the draft model");
    }
    let draft = pollster::block_on(a.spec.load_draft(
        ctx.clone(),
        &model_path,
        &model,
        &tokenizer,
        ModelOptions { prefix_cache: false, ..model_options },
    ))?;
    pb.finish_and_clear();

    let stem =
        model_path.file_stem().map(|s| s.to_string_lossy().into_owned()).filter(|s| !s.is_empty()).unwrap_or_else(|| "lantern".to_string());
    let model_id = a.model_name.clone().unwrap_or_else(|| stem.clone());
    let mut aliases = vec![model_path.display().to_string()];
    if let Some(name) = model_path.file_name() {
        aliases.push(name.to_string_lossy().into_owned());
    }
    if a.model_name.is_some() {
        aliases.push(stem);
    }
    let created = std::fs::metadata(&model_path)
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or_else(unix_now, |d| d.as_secs());
    let api_key = a.api_key.clone().or_else(|| std::env::var("LANTERN_API_KEY").ok()).filter(|k| !k.is_empty());
    let adapter = ctx.info.name.clone();
    let kv_dtype = format!("{:?}", model.options.kv_dtype).to_lowercase();
    let gpu_bytes = model.memory().total();
    if let Some(r) = model.memory().kv_window_ring {
        eprintln!(
            "lantern serve: the sliding-window layers keep a {}-token ring per sequence ({:.1} MB for {} sequences); no prefix cache with rings (--kv-window full keeps every token and the prefix cache)",
            r.tokens(),
            model.memory().kv_ring_bytes as f64 / 1e6,
            a.max_seqs
        );
    }
    let mut engine = Engine::new(model, Arc::new(tokenizer), EngineOptions { max_waiting: a.max_waiting, ..EngineOptions::default() });
    if let Some((d, dtok)) = draft {
        engine.set_draft(d, &dtok)?;
    }
    // Speculation chooses k from measured step costs: kept ones, else measured now.
    let spec = a.spec.speculation();
    if spec.enabled() {
        let (t, d) = a.spec.cost_files(&engine.models().0.ctx, &model_path, &engine.models().0.options)?;
        let (m, dm) = engine.models_mut();
        lantern::engine::step_costs::load(m, &t);
        if let (Some(p), Some(dm)) = (&d, dm) {
            lantern::engine::step_costs::load(dm, p);
        }
        let ms = pollster::block_on(engine.measure_step_costs(&spec))?;
        if ms > 0.0 {
            eprintln!("lantern serve: measured step costs for speculative decoding in {ms:.0} ms (kept for later runs)");
            let (m, dm) = engine.models();
            let saved = lantern::engine::step_costs::save(m, &t).and_then(|_| match (&d, dm) {
                (Some(p), Some(dm)) => lantern::engine::step_costs::save(dm, p),
                _ => Ok(()),
            });
            if let Err(e) = saved {
                eprintln!("warning: saving the step costs failed: {e}");
            }
        }
    }
    let cfg = ServerConfig {
        api_key,
        max_connections: a.max_connections.max(1),
        max_idle_connections: a.max_idle_connections.max(1),
        read_timeout: Duration::from_secs(a.read_timeout.max(1)),
        shutdown_timeout: Duration::from_secs(a.shutdown_timeout),
        sse_keepalive: (a.sse_keepalive > 0).then(|| Duration::from_secs(a.sse_keepalive)),
        request_timeout: (a.request_timeout > 0).then(|| Duration::from_secs(a.request_timeout)),
        quiet: a.quiet,
        model_id: model_id.clone(),
        aliases,
        created,
        adapter: adapter.clone(),
        kv_dtype,
        speculation: a.spec.speculation(),
        prefix_cache: !a.no_prefix_cache,
        embedding_pooling: if a.embedding_pooling == "last" { Pooling::Last } else { Pooling::Mean },
        info: ModelInfo { gpu_bytes, ..info },
    };
    let max_seqs = a.max_seqs;
    runtime.block_on(async move {
        let _ = ready_tx.send(true);
        let listener = loading.await.context("the loading responder failed")?;
        let server = transport::Server::start(listener, engine, cfg).await?;
        let sh = server.shared.clone();
        if !server.addr.ip().is_loopback() && !sh.key_required() {
            eprintln!(
                "warning: listening on {} (not a loopback address) without an API key: anyone who can reach it can use it; set LANTERN_API_KEY or --api-key",
                server.addr
            );
        }
        println!(
            "lantern serve: listening on http://{} (model {model_id} on {adapter}; context {}, max-seqs {max_seqs}, {} KV pages of {} tokens; API key {})",
            server.addr,
            sh.model.context,
            sh.model.kv_pages_total,
            sh.model.page_size,
            if sh.key_required() { "required" } else { "not required" }
        );
        let _ = std::io::stdout().flush();
        server.run_until_signal().await
    })
}

/// What the Ollama API reports of the model, read from its file's header (memory-mapped; no
/// weights are read): a file that cannot be read this way gets empty fields, not an error.
fn model_info(path: &std::path::Path) -> ModelInfo {
    let size = if path.is_dir() {
        std::fs::read_dir(path).map_or(0, |d| d.flatten().filter_map(|e| e.metadata().ok()).map(|m| m.len()).sum())
    } else {
        std::fs::metadata(path).map_or(0, |m| m.len())
    };
    let modified_at = std::fs::metadata(path).and_then(|m| m.modified()).map(ollama::rfc3339).unwrap_or_default();
    let format = if path.is_dir() { "safetensors" } else { "gguf" };
    let Ok(loaded) = lantern::model::load::load_path(path) else {
        return ModelInfo { format, size, modified_at, ..Default::default() };
    };
    let w = &loaded.weights;
    let (file, _) = super::info_cmd::by_dtype(w, path).unwrap_or_default();
    let parameters: u64 = file.values().map(|r| r.parameters).sum();
    let quantization = file.iter().max_by_key(|(_, r)| r.bytes).map(|(k, _)| k.to_uppercase()).unwrap_or_default();
    let c = &w.config;
    let arch = c.arch.name();
    let mut model_info = serde_json::Map::new();
    for (k, v) in [
        ("general.architecture".to_string(), serde_json::json!(arch)),
        ("general.parameter_count".into(), serde_json::json!(parameters)),
        (format!("{arch}.context_length"), serde_json::json!(c.max_position_embeddings)),
        (format!("{arch}.embedding_length"), serde_json::json!(c.hidden_size)),
        (format!("{arch}.feed_forward_length"), serde_json::json!(c.intermediate_size)),
        (format!("{arch}.block_count"), serde_json::json!(c.num_layers)),
        (format!("{arch}.attention.head_count"), serde_json::json!(c.num_heads)),
        (format!("{arch}.attention.head_count_kv"), serde_json::json!(c.num_kv_heads)),
        (format!("{arch}.vocab_size"), serde_json::json!(c.vocab_size)),
    ] {
        model_info.insert(k, v);
    }
    ModelInfo { format, family: arch.to_string(), parameters, quantization, size, modified_at, model_info, gpu_bytes: 0 }
}

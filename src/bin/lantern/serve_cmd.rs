//! `lantern serve`: an OpenAI-compatible HTTP server over the batching engine.
//!
//! A small HTTP/1.1 server on `std::net` (one thread per connection, keep-alive, chunked
//! transfer for server-sent events) in front of an [`EngineWorker`]: each connection thread
//! parses and validates its request, tokenizes it, submits it through the worker's
//! [`EngineClient`] and reads the request's events, writing them to the socket as they come
//! (`"stream": true`) or as one JSON object at the end. The engine's refusals become HTTP
//! errors at once (queue full: 429 with `Retry-After`; engine stopped: 503), connections
//! beyond `--max-connections` get 503 without waiting, and a client that goes away (a failed
//! write, or end-of-file on its socket while it waits) cancels its request, so the engine
//! frees its KV pages at its next step. Nothing read from a client is unwrapped: every
//! malformed input is a 4xx JSON error in OpenAI's shape.
//!
//! Endpoints: `POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`,
//! `GET /v1/models/{id}`, `GET /metrics` (Prometheus text format) and `GET /health`
//! (`/healthz`), the only one that never needs the API key.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Wake, Waker};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{anyhow, Context as _, Result};
use clap::Args;
use serde_json::{json, Map, Value};
use sha2::{Digest, Sha256};

use lantern::engine::{
    Engine, EngineClient, EngineOptions, EngineWorker, Event, FinishReason, GenerateRequest, Generation, RequestHandle, SamplingParams,
};
use lantern::kv::KvError;
use lantern::model::llama::ModelOptions;
use lantern::model::tokenizer::{ChatMessage, ChatTemplate, Tokenizer};
use lantern::LanternError;

use super::{plan_cmd, spinner, DeviceArgs, KvArg};

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
    /// Open connections at most; beyond it new connections get 503 at once.
    #[arg(long, default_value_t = 256)]
    max_connections: usize,
    /// Cancel a request that has not finished after this many seconds (504, or an error
    /// event in a stream); 0 = never.
    #[arg(long, default_value_t = 600)]
    request_timeout: u64,
    /// Do not reuse the KV pages of an earlier prompt with the same beginning.
    #[arg(long)]
    no_prefix_cache: bool,
    /// Same kernels for every step, so a request's output does not depend on what it is
    /// batched with (slower decode).
    #[arg(long)]
    batch_invariant: bool,
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
    let mut engine = Engine::new(model, Arc::new(tokenizer), EngineOptions { max_waiting: a.max_waiting, ..EngineOptions::default() });
    if let Some((d, dtok)) = draft {
        engine.set_draft(d, &dtok)?;
    }
    let server = start(
        engine,
        ServerConfig {
            host: a.host.clone(),
            port: a.port,
            api_key,
            max_connections: a.max_connections.max(1),
            request_timeout: (a.request_timeout > 0).then(|| Duration::from_secs(a.request_timeout)),
            quiet: a.quiet,
            model_id: model_id.clone(),
            aliases,
            created,
            adapter: adapter.clone(),
            kv_dtype,
            speculation: a.spec.speculation(),
        },
    )?;
    let sh = &server.shared;
    if !server.addr.ip().is_loopback() && sh.key_hash.is_none() {
        eprintln!(
            "warning: listening on {} (not a loopback address) without an API key: anyone who can reach it can use it; set LANTERN_API_KEY or --api-key",
            server.addr
        );
    }
    println!(
        "lantern serve: listening on http://{} (model {model_id} on {adapter}; context {}, max-seqs {}, {} KV pages of {} tokens; API key {})",
        server.addr,
        sh.context,
        a.max_seqs,
        sh.kv_pages_total,
        sh.page_size,
        if sh.key_hash.is_some() { "required" } else { "not required" }
    );
    let _ = std::io::stdout().flush();
    server.wait();
    Ok(())
}

// ---------------------------------------------------------------------------------------
// The server
// ---------------------------------------------------------------------------------------

/// Largest request body (413 beyond).
const MAX_BODY: usize = 4 << 20;
/// Longest request line or header line (414 / 431 beyond).
const MAX_LINE: usize = 16 << 10;
/// All header bytes of one request at most, and the number of header lines (431 beyond).
const MAX_HEADER_BYTES: usize = 64 << 10;
const MAX_HEADERS: usize = 100;
/// A request's line and headers must arrive within this (408 beyond).
const HEADER_DEADLINE: Duration = Duration::from_secs(30);
/// A socket read waits this long at most (an idle keep-alive connection is closed then).
const READ_TIMEOUT: Duration = Duration::from_secs(30);
/// A socket write waits this long at most (a client that stops reading is dropped).
const WRITE_TIMEOUT: Duration = Duration::from_secs(30);
/// How often a waiting request checks that its client is still connected.
const LIVENESS_EVERY: Duration = Duration::from_millis(200);
/// Seconds suggested in `Retry-After` of 429 and 503 answers.
const RETRY_AFTER_S: u32 = 1;
/// Threads answering 503 to connections beyond the cap at once (more are just closed).
const MAX_REJECTERS: usize = 32;
/// Stop strings per request at most.
const MAX_STOP: usize = 16;

/// What `start` needs besides the engine.
pub struct ServerConfig {
    pub host: String,
    pub port: u16,
    pub api_key: Option<String>,
    pub max_connections: usize,
    pub request_timeout: Option<Duration>,
    pub quiet: bool,
    /// The id /v1/models lists and responses carry.
    pub model_id: String,
    /// Other names accepted in a request's `model` (the model path).
    pub aliases: Vec<String>,
    /// Unix time /v1/models reports as `created`.
    pub created: u64,
    pub adapter: String,
    pub kv_dtype: String,
    /// The speculative decoding requests get unless they ask otherwise.
    pub speculation: lantern::engine::Speculation,
}

/// A running server: its bound address; `wait` serves until the process ends, `shutdown`
/// stops accepting and stops the engine.
pub struct Server {
    pub addr: SocketAddr,
    shared: Arc<Shared>,
    accept: Option<JoinHandle<()>>,
    worker: Option<EngineWorker>,
}

impl Server {
    /// Serve until the accept loop ends (it does not, short of `shutdown` or a fatal error).
    pub fn wait(mut self) {
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
    }

    /// Stop accepting connections, then stop the engine (requests in flight end with an
    /// error event or 503).
    #[allow(dead_code)]
    pub fn shutdown(mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        // Wake the accept loop with a connection of our own.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
        if let Some(w) = self.worker.take() {
            let _ = w.shutdown();
        }
    }
}

/// State every connection thread reads.
struct Shared {
    client: EngineClient,
    tokenizer: Arc<Tokenizer>,
    template: std::result::Result<ChatTemplate, String>,
    stop_ids: Vec<u32>,
    vocab: usize,
    context: usize,
    kv_pages_total: usize,
    page_size: usize,
    model_id: String,
    aliases: Vec<String>,
    created: u64,
    adapter: String,
    kv_dtype: String,
    speculation: lantern::engine::Speculation,
    key_hash: Option<[u8; 32]>,
    max_connections: usize,
    request_timeout: Option<Duration>,
    quiet: bool,
    open: AtomicUsize,
    rejecting: AtomicUsize,
    next_id: AtomicU64,
    nonce: u64,
    engine_down: AtomicBool,
    shutdown: AtomicBool,
    metrics: Mutex<Metrics>,
}

impl Shared {
    fn metrics(&self) -> MutexGuard<'_, Metrics> {
        self.metrics.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn knows_model(&self, m: &str) -> bool {
        m == self.model_id || self.aliases.iter().any(|a| a == m)
    }

    fn new_id(&self, prefix: &str) -> String {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        format!("{prefix}-{:012x}{n:08x}", self.nonce & 0xffff_ffff_ffff)
    }

    /// Longest sequence (prompt + completion) one request may reach: the context, or the
    /// whole KV pool when that is smaller.
    fn max_sequence(&self) -> usize {
        self.context.min(self.kv_pages_total.saturating_mul(self.page_size))
    }
}

/// Bind, put the engine on its own thread and start accepting connections.
pub fn start(engine: Engine, cfg: ServerConfig) -> Result<Server> {
    let tokenizer = engine.tokenizer.clone();
    let template = tokenizer.chat_template().map_err(|e| e.to_string());
    let stop_ids = lantern::engine::generate::default_stop_ids(&engine.model.config.eos_token_ids, &tokenizer);
    let vocab = engine.model.config.vocab_size;
    let listener = bind(&cfg.host, cfg.port)?;
    let addr = listener.local_addr().context("reading the bound address")?;
    let worker = EngineWorker::spawn(engine);
    let client = worker.client();
    let snap = client.snapshot();
    let shared = Arc::new(Shared {
        client,
        tokenizer,
        template,
        stop_ids,
        vocab,
        context: snap.context,
        kv_pages_total: snap.kv_pages_total,
        page_size: snap.kv_page_size.max(1),
        model_id: cfg.model_id,
        aliases: cfg.aliases,
        created: cfg.created,
        adapter: cfg.adapter,
        kv_dtype: cfg.kv_dtype,
        speculation: cfg.speculation,
        key_hash: cfg.api_key.as_deref().map(sha256),
        max_connections: cfg.max_connections.max(1),
        request_timeout: cfg.request_timeout,
        quiet: cfg.quiet,
        open: AtomicUsize::new(0),
        rejecting: AtomicUsize::new(0),
        next_id: AtomicU64::new(0),
        nonce: random_u64(),
        engine_down: AtomicBool::new(false),
        shutdown: AtomicBool::new(false),
        metrics: Mutex::new(Metrics::default()),
    });
    let sh = shared.clone();
    let accept = std::thread::Builder::new()
        .name("lantern-accept".into())
        .spawn(move || accept_loop(listener, sh))
        .context("starting the accept thread")?;
    Ok(Server { addr, shared, accept: Some(accept), worker: Some(worker) })
}

fn bind(host: &str, port: u16) -> Result<TcpListener> {
    let h = host.trim_start_matches('[').trim_end_matches(']');
    let addrs: Vec<SocketAddr> = (h, port).to_socket_addrs().with_context(|| format!("resolving --host {host}"))?.collect();
    let mut last = None;
    for a in &addrs {
        match TcpListener::bind(a) {
            Ok(l) => return Ok(l),
            Err(e) => last = Some(anyhow!("binding {a}: {e}")),
        }
    }
    Err(last.unwrap_or_else(|| anyhow!("--host {host} resolves to no address")))
}

/// Decrements the open-connection count when a connection thread ends (also by panic).
struct OpenGuard(Arc<Shared>);

impl Drop for OpenGuard {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::SeqCst);
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    for conn in listener.incoming() {
        if shared.shutdown.load(Ordering::SeqCst) {
            break;
        }
        let stream = match conn {
            Ok(s) => s,
            Err(e) => {
                // Out of file descriptors and the like: back off instead of spinning.
                if !shared.quiet {
                    eprintln!("accept: {e}");
                }
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        let open = shared.open.fetch_add(1, Ordering::SeqCst) + 1;
        if open > shared.max_connections {
            shared.open.fetch_sub(1, Ordering::SeqCst);
            reject_busy(&shared, stream);
            continue;
        }
        let sh = shared.clone();
        let spawned = std::thread::Builder::new().name("lantern-http".into()).spawn(move || {
            let guard = OpenGuard(sh);
            serve_connection(&guard.0, stream);
        });
        if spawned.is_err() {
            // The closure (and the stream) is gone: the connection closes.
            shared.open.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// 503 to a connection beyond `--max-connections`, on a short-lived thread (the accept loop
/// must not wait on a client).
fn reject_busy(shared: &Arc<Shared>, stream: TcpStream) {
    shared.metrics().outcome("too_many_connections");
    shared.metrics().http("other", 503);
    if shared.rejecting.fetch_add(1, Ordering::SeqCst) >= MAX_REJECTERS {
        shared.rejecting.fetch_sub(1, Ordering::SeqCst);
        return;
    }
    let sh = shared.clone();
    let max = shared.max_connections;
    let r = std::thread::Builder::new().name("lantern-reject".into()).spawn(move || {
        let _ = stream.set_write_timeout(Some(Duration::from_secs(2)));
        let mut conn = Conn { stream, head: false, keep_alive: false, http11: true };
        let e = ApiError::new(
            503,
            "server_overloaded",
            format!("too many connections: the server holds {max} at most (--max-connections); retry shortly"),
        )
        .code("too_many_connections")
        .retry_after();
        let _ = e.send(&mut conn);
        linger_close(&conn.stream);
        sh.rejecting.fetch_sub(1, Ordering::SeqCst);
    });
    if r.is_err() {
        shared.rejecting.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Close after an answer sent before the request was read to its end: stop writing, read
/// (and drop) what the client still sends for a moment, so that the kernel does not reset
/// the connection before the client has read the answer.
fn linger_close(stream: &TcpStream) {
    let _ = stream.shutdown(Shutdown::Write);
    let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
    let deadline = Instant::now() + Duration::from_secs(2);
    let mut buf = [0u8; 8192];
    let mut total = 0usize;
    let mut s = stream;
    while Instant::now() < deadline && total < (16 << 20) {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => total += n,
        }
    }
}

/// The writing side of a connection and how the current request wants its answer.
struct Conn {
    stream: TcpStream,
    /// A HEAD request: headers only.
    head: bool,
    keep_alive: bool,
    /// The request was HTTP/1.1 (streams use chunked transfer; HTTP/1.0 ones end by close).
    http11: bool,
}

fn serve_connection(shared: &Shared, stream: TcpStream) {
    let _ = stream.set_nodelay(true);
    let _ = stream.set_read_timeout(Some(READ_TIMEOUT));
    let _ = stream.set_write_timeout(Some(WRITE_TIMEOUT));
    let Ok(rs) = stream.try_clone() else { return };
    let mut reader = BufReader::new(rs);
    let mut conn = Conn { stream, head: false, keep_alive: true, http11: true };
    loop {
        let req = match read_request(&mut reader, &mut conn.stream) {
            Ok(r) => r,
            Err(ReadErr::Closed) => break,
            Err(ReadErr::Http(status, msg)) => {
                conn.head = false;
                conn.keep_alive = false;
                let code = match status {
                    408 => "request_timeout",
                    413 => "request_too_large",
                    414 | 431 => "headers_too_large",
                    501 | 505 => "not_supported",
                    _ => "bad_request",
                };
                let _ = ApiError::new(status, "invalid_request_error", msg).code(code).send(&mut conn);
                shared.metrics().http("other", status);
                if !shared.quiet {
                    eprintln!("- - {status} (unreadable request)");
                }
                linger_close(&conn.stream);
                return;
            }
        };
        let t0 = Instant::now();
        conn.head = req.method == "HEAD";
        conn.keep_alive = req.keep_alive();
        conn.http11 = req.http11;
        let (route, status, close) = dispatch(shared, &req, &mut conn);
        shared.metrics().http(route, status);
        if !shared.quiet {
            eprintln!("{} {} {status} {:.0} ms", req.method, req.path, t0.elapsed().as_secs_f64() * 1e3);
        }
        if close || !conn.keep_alive || shared.shutdown.load(Ordering::SeqCst) {
            break;
        }
    }
    let _ = conn.stream.shutdown(Shutdown::Both);
}

// ---------------------------------------------------------------------------------------
// HTTP/1.1 requests and responses
// ---------------------------------------------------------------------------------------

struct HttpRequest {
    method: String,
    /// The target's path, without query or fragment.
    path: String,
    http11: bool,
    /// Names in lower case.
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl HttpRequest {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
    }

    fn header_has_token(&self, name: &str, token: &str) -> bool {
        self.headers.iter().filter(|(n, _)| n == name).flat_map(|(_, v)| v.split(',')).any(|t| t.trim().eq_ignore_ascii_case(token))
    }

    fn keep_alive(&self) -> bool {
        if self.http11 {
            !self.header_has_token("connection", "close")
        } else {
            self.header_has_token("connection", "keep-alive")
        }
    }
}

enum ReadErr {
    /// End of file, a reset, or an idle connection timing out before a request began.
    Closed,
    /// Answer with this status and close.
    Http(u16, String),
}

enum Line {
    Full,
    Eof,
    TooLong,
}

/// One line (without CR LF) of at most `max` bytes.
fn read_line(r: &mut impl BufRead, buf: &mut Vec<u8>, max: usize) -> std::io::Result<Line> {
    buf.clear();
    let n = r.by_ref().take(max as u64 + 2).read_until(b'\n', buf)?;
    if n == 0 {
        return Ok(Line::Eof);
    }
    if buf.last() != Some(&b'\n') {
        return Ok(if n > max { Line::TooLong } else { Line::Eof });
    }
    buf.pop();
    if buf.last() == Some(&b'\r') {
        buf.pop();
    }
    Ok(if buf.len() > max { Line::TooLong } else { Line::Full })
}

fn timeout_or_closed(e: &std::io::Error) -> ReadErr {
    match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => ReadErr::Http(408, "the request did not arrive in time".into()),
        _ => ReadErr::Closed,
    }
}

fn http_err(status: u16, msg: impl Into<String>) -> ReadErr {
    ReadErr::Http(status, msg.into())
}

fn read_request(r: &mut BufReader<TcpStream>, w: &mut TcpStream) -> std::result::Result<HttpRequest, ReadErr> {
    let mut line = Vec::new();
    // The request line (empty lines before it are tolerated, as RFC 9112 asks).
    let mut empty = 0;
    loop {
        match read_line(r, &mut line, MAX_LINE) {
            Ok(Line::Full) if line.is_empty() && empty < 8 => empty += 1,
            Ok(Line::Full) => break,
            Ok(Line::Eof) | Err(_) => return Err(ReadErr::Closed),
            Ok(Line::TooLong) => return Err(http_err(414, "the request line is too long")),
        }
    }
    let started = Instant::now();
    let request_line = std::mem::take(&mut line);
    let text = std::str::from_utf8(&request_line).map_err(|_| http_err(400, "the request line is not UTF-8"))?;
    let mut parts = text.split(' ');
    let (Some(method), Some(target), Some(version), None) = (parts.next(), parts.next(), parts.next(), parts.next()) else {
        return Err(http_err(400, "malformed request line"));
    };
    if method.is_empty() || !method.bytes().all(|b| b.is_ascii_alphabetic()) {
        return Err(http_err(400, "malformed request method"));
    }
    let http11 = match version {
        "HTTP/1.1" => true,
        "HTTP/1.0" => false,
        v if v.starts_with("HTTP/") => return Err(http_err(505, format!("{v} is not supported (HTTP/1.1 is)"))),
        _ => return Err(http_err(400, "malformed request line")),
    };
    let mut headers = Vec::new();
    let mut header_bytes = 0usize;
    loop {
        match read_line(r, &mut line, MAX_LINE) {
            Ok(Line::Full) => {}
            Ok(Line::Eof) => return Err(ReadErr::Closed),
            Ok(Line::TooLong) => return Err(http_err(431, "a header line is too long")),
            Err(e) => return Err(timeout_or_closed(&e)),
        }
        if line.is_empty() {
            break;
        }
        header_bytes += line.len();
        if headers.len() >= MAX_HEADERS || header_bytes > MAX_HEADER_BYTES {
            return Err(http_err(431, "too many header bytes"));
        }
        if started.elapsed() > HEADER_DEADLINE {
            return Err(http_err(408, "the request headers did not arrive in time"));
        }
        if line[0] == b' ' || line[0] == b'\t' {
            return Err(http_err(400, "folded header lines are not supported"));
        }
        let l = std::str::from_utf8(&line).map_err(|_| http_err(400, "a header is not UTF-8"))?;
        let Some((name, value)) = l.split_once(':') else {
            return Err(http_err(400, "malformed header line"));
        };
        if name.is_empty() || name.bytes().any(|b| b.is_ascii_whitespace() || b.is_ascii_control()) {
            return Err(http_err(400, "malformed header name"));
        }
        headers.push((name.to_ascii_lowercase(), value.trim().to_string()));
    }
    let mut req = HttpRequest {
        method: method.to_string(),
        path: request_path(target).ok_or_else(|| http_err(400, "malformed request target"))?,
        http11,
        headers,
        body: Vec::new(),
    };

    // The body: chunked, or Content-Length, or none.
    let chunked = match req.header("transfer-encoding") {
        None => false,
        Some(te) => {
            if req.header("content-length").is_some() {
                return Err(http_err(400, "both Transfer-Encoding and Content-Length"));
            }
            if te.rsplit(',').next().map(|t| t.trim().eq_ignore_ascii_case("chunked")) != Some(true) {
                return Err(http_err(501, format!("transfer-encoding {te:?} is not supported")));
            }
            true
        }
    };
    let mut length = 0usize;
    if !chunked {
        let mut seen: Option<usize> = None;
        for (_, v) in req.headers.iter().filter(|(n, _)| n == "content-length") {
            for part in v.split(',') {
                let n: usize = part.trim().parse().map_err(|_| http_err(400, "Content-Length is not a number"))?;
                if seen.is_some_and(|s| s != n) {
                    return Err(http_err(400, "conflicting Content-Length headers"));
                }
                seen = Some(n);
            }
        }
        length = seen.unwrap_or(0);
        if length > MAX_BODY {
            return Err(http_err(413, format!("the request body has {length} bytes; the limit is {MAX_BODY}")));
        }
    }
    if let Some(exp) = req.header("expect") {
        if !exp.eq_ignore_ascii_case("100-continue") {
            return Err(http_err(417, format!("Expect: {exp} is not supported")));
        }
        if http11 && (chunked || length > 0) {
            let _ = w.write_all(b"HTTP/1.1 100 Continue\r\n\r\n");
        }
    }
    if chunked {
        req.body = read_chunked(r, MAX_BODY)?;
    } else if length > 0 {
        let mut body = vec![0u8; length];
        r.read_exact(&mut body).map_err(|e| timeout_or_closed(&e))?;
        req.body = body;
    }
    Ok(req)
}

fn read_chunked(r: &mut BufReader<TcpStream>, max: usize) -> std::result::Result<Vec<u8>, ReadErr> {
    let mut body = Vec::new();
    let mut line = Vec::new();
    loop {
        match read_line(r, &mut line, 1024) {
            Ok(Line::Full) => {}
            Ok(_) => return Err(http_err(400, "malformed chunked body")),
            Err(e) => return Err(timeout_or_closed(&e)),
        }
        let text = std::str::from_utf8(&line).map_err(|_| http_err(400, "malformed chunk size"))?;
        let size_text = text.split(';').next().unwrap_or("").trim();
        let size = usize::from_str_radix(size_text, 16).map_err(|_| http_err(400, "malformed chunk size"))?;
        if size == 0 {
            // Trailer fields, then the empty line.
            for _ in 0..MAX_HEADERS {
                match read_line(r, &mut line, MAX_LINE) {
                    Ok(Line::Full) if line.is_empty() => return Ok(body),
                    Ok(Line::Full) => {}
                    Ok(_) => return Err(http_err(400, "malformed chunked body")),
                    Err(e) => return Err(timeout_or_closed(&e)),
                }
            }
            return Err(http_err(431, "too many trailer fields"));
        }
        if body.len().saturating_add(size) > max {
            return Err(http_err(413, format!("the request body is larger than the limit of {max} bytes")));
        }
        let start = body.len();
        body.resize(start + size, 0);
        r.read_exact(&mut body[start..]).map_err(|e| timeout_or_closed(&e))?;
        match read_line(r, &mut line, 2) {
            Ok(Line::Full) if line.is_empty() => {}
            Ok(_) => return Err(http_err(400, "malformed chunked body")),
            Err(e) => return Err(timeout_or_closed(&e)),
        }
    }
}

/// The path of a request target (origin form or absolute form), percent-decoding left to
/// the routes that take a parameter.
fn request_path(target: &str) -> Option<String> {
    let rest = if let Some(r) = target.strip_prefix("http://").or_else(|| target.strip_prefix("https://")) {
        match r.find('/') {
            Some(i) => &r[i..],
            None => "/",
        }
    } else {
        target
    };
    if !rest.starts_with('/') {
        return None;
    }
    let end = rest.find(['?', '#']).unwrap_or(rest.len());
    Some(rest[..end].to_string())
}

fn percent_decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

fn reason_phrase(status: u16) -> &'static str {
    match status {
        100 => "Continue",
        200 => "OK",
        400 => "Bad Request",
        401 => "Unauthorized",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        413 => "Content Too Large",
        414 => "URI Too Long",
        417 => "Expectation Failed",
        429 => "Too Many Requests",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        501 => "Not Implemented",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        505 => "HTTP Version Not Supported",
        _ => "Unknown",
    }
}

/// Write a complete response.
fn send(conn: &mut Conn, status: u16, content_type: &str, body: &[u8], extra: &[(&str, String)]) -> std::io::Result<()> {
    let mut head = format!(
        "HTTP/1.1 {status} {}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: {}\r\n",
        reason_phrase(status),
        body.len(),
        if conn.keep_alive { "keep-alive" } else { "close" }
    );
    for (k, v) in extra {
        let _ = write!(head, "{k}: {v}\r\n");
    }
    head.push_str("\r\n");
    let mut out = head.into_bytes();
    if !conn.head {
        out.extend_from_slice(body);
    }
    conn.stream.write_all(&out)?;
    conn.stream.flush()
}

// ---------------------------------------------------------------------------------------
// Routing and errors
// ---------------------------------------------------------------------------------------

/// An error in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.
struct ApiError {
    status: u16,
    kind: &'static str,
    message: String,
    param: Option<&'static str>,
    code: Option<&'static str>,
    headers: Vec<(&'static str, String)>,
}

impl ApiError {
    fn new(status: u16, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError { status, kind, message: message.into(), param: None, code: None, headers: Vec::new() }
    }

    fn bad(message: impl Into<String>) -> Self {
        Self::new(400, "invalid_request_error", message)
    }

    fn param(mut self, p: &'static str) -> Self {
        self.param = Some(p);
        self
    }

    fn code(mut self, c: &'static str) -> Self {
        self.code = Some(c);
        self
    }

    fn retry_after(mut self) -> Self {
        self.headers.push(("Retry-After", RETRY_AFTER_S.to_string()));
        self
    }

    fn json(&self) -> Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }

    fn send(&self, conn: &mut Conn) -> std::io::Result<()> {
        let body = self.json().to_string();
        send(conn, self.status, "application/json", body.as_bytes(), &self.headers)
    }
}

/// What a handler produced.
enum Reply {
    Json(u16, Value),
    Error(ApiError),
    Text(&'static str, String),
    /// The handler wrote the response itself (a stream) with this status; `bool`: the
    /// connection can take another request.
    Written(u16, bool),
    /// The client went away before its answer (logged as 499).
    Gone,
}

/// Route a request and write its answer: the route's label for metrics, the status and
/// whether to close the connection.
fn dispatch(shared: &Shared, req: &HttpRequest, conn: &mut Conn) -> (&'static str, u16, bool) {
    let path = req.path.as_str();
    let (route, allowed): (&'static str, &'static str) = match path {
        "/health" | "/healthz" => ("/health", "GET, HEAD"),
        "/v1/models" => ("/v1/models", "GET, HEAD"),
        p if p.starts_with("/v1/models/") => ("/v1/models/{id}", "GET, HEAD"),
        "/v1/completions" => ("/v1/completions", "POST"),
        "/v1/chat/completions" => ("/v1/chat/completions", "POST"),
        "/metrics" => ("/metrics", "GET, HEAD"),
        _ => ("other", ""),
    };
    let reply = if route != "/health" && !authorized(shared, req) {
        // The same answer for a missing and a wrong key, and for routes that do not exist.
        let mut e = ApiError::new(401, "authentication_error", "unauthorized").code("invalid_api_key");
        e.headers.push(("WWW-Authenticate", "Bearer".into()));
        Reply::Error(e)
    } else if route == "other" {
        Reply::Error(ApiError::new(404, "invalid_request_error", format!("no route {path}")).code("not_found"))
    } else if !allowed.split(", ").any(|m| m == req.method) {
        let mut e = ApiError::new(405, "invalid_request_error", format!("{} is not allowed on {path} (allowed: {allowed})", req.method))
            .code("method_not_allowed");
        e.headers.push(("Allow", allowed.to_string()));
        Reply::Error(e)
    } else {
        match route {
            "/health" => health(shared),
            "/v1/models" => Reply::Json(200, json!({"object": "list", "data": [model_object(shared)]})),
            "/v1/models/{id}" => {
                let id = percent_decode(&path["/v1/models/".len()..]).unwrap_or_default();
                if shared.knows_model(&id) {
                    Reply::Json(200, model_object(shared))
                } else {
                    Reply::Error(model_not_found(&id))
                }
            }
            "/metrics" => Reply::Text("text/plain; version=0.0.4; charset=utf-8", render_metrics(shared)),
            "/v1/completions" => generate(shared, req, conn, false),
            _ => generate(shared, req, conn, true),
        }
    };
    let (status, close) = match reply {
        Reply::Json(status, v) => {
            let body = v.to_string();
            (status, send(conn, status, "application/json", body.as_bytes(), &[]).is_err())
        }
        Reply::Error(e) => (e.status, e.send(conn).is_err()),
        Reply::Text(ct, body) => (200, send(conn, 200, ct, body.as_bytes(), &[]).is_err()),
        Reply::Written(status, reusable) => (status, !reusable),
        Reply::Gone => (499, true),
    };
    (route, status, close)
}

fn model_object(shared: &Shared) -> Value {
    json!({"id": shared.model_id, "object": "model", "created": shared.created, "owned_by": "lantern"})
}

fn model_not_found(id: &str) -> ApiError {
    ApiError::new(404, "invalid_request_error", format!("the model `{id}` does not exist")).param("model").code("model_not_found")
}

fn health(shared: &Shared) -> Reply {
    let s = shared.client.snapshot();
    if shared.engine_down.load(Ordering::SeqCst) {
        return Reply::Json(503, json!({"status": "engine stopped", "last_error": s.last_error}));
    }
    Reply::Json(
        200,
        json!({
            "status": "ok",
            "model": shared.model_id,
            "running": s.running,
            "waiting": s.waiting,
            "kv_pages_free": s.kv_pages_free,
            "kv_pages_total": s.kv_pages_total,
        }),
    )
}

fn sha256(s: &str) -> [u8; 32] {
    Sha256::digest(s.as_bytes()).into()
}

/// Constant-time equality of two digests.
fn ct_eq(a: &[u8; 32], b: &[u8; 32]) -> bool {
    let mut d = 0u8;
    for (x, y) in a.iter().zip(b) {
        d |= x ^ y;
    }
    std::hint::black_box(d) == 0
}

/// The token of an `Authorization: Bearer TOKEN` header.
fn bearer(h: &str) -> Option<&str> {
    let h = h.trim();
    let (scheme, token) = h.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

fn authorized(shared: &Shared, req: &HttpRequest) -> bool {
    let Some(want) = &shared.key_hash else { return true };
    // Hashing first makes the comparison independent of the key's length and content.
    let got = req.header("authorization").and_then(bearer).map(sha256).unwrap_or([0; 32]);
    let ok = ct_eq(&got, want);
    ok && req.header("authorization").is_some()
}

// ---------------------------------------------------------------------------------------
// Completions
// ---------------------------------------------------------------------------------------

/// A validated generation request.
struct Parsed {
    prompt_ids: Vec<u32>,
    max_tokens: usize,
    sampling: SamplingParams,
    stop: Vec<String>,
    stream: bool,
    include_usage: bool,
    speculation: lantern::engine::Speculation,
}

/// `obj[key]`, treating null as absent.
fn field<'a>(obj: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    obj.get(key).filter(|v| !v.is_null())
}

fn opt_f64(obj: &Map<String, Value>, key: &'static str) -> std::result::Result<Option<f64>, ApiError> {
    match field(obj, key) {
        None => Ok(None),
        Some(v) => {
            v.as_f64().filter(|x| x.is_finite()).map(Some).ok_or_else(|| ApiError::bad(format!("`{key}` must be a number")).param(key))
        }
    }
}

fn opt_bool(obj: &Map<String, Value>, key: &'static str) -> std::result::Result<Option<bool>, ApiError> {
    match field(obj, key) {
        None => Ok(None),
        Some(v) => v.as_bool().map(Some).ok_or_else(|| ApiError::bad(format!("`{key}` must be true or false")).param(key)),
    }
}

fn opt_i64(obj: &Map<String, Value>, key: &'static str) -> std::result::Result<Option<i64>, ApiError> {
    match field(obj, key) {
        None => Ok(None),
        Some(v) => v.as_i64().map(Some).ok_or_else(|| ApiError::bad(format!("`{key}` must be an integer")).param(key)),
    }
}

fn opt_count(obj: &Map<String, Value>, key: &'static str) -> std::result::Result<Option<usize>, ApiError> {
    match field(obj, key) {
        None => Ok(None),
        Some(v) => v
            .as_u64()
            .map(|n| Some(usize::try_from(n).unwrap_or(usize::MAX)))
            .ok_or_else(|| ApiError::bad(format!("`{key}` must be a non-negative integer")).param(key)),
    }
}

fn unsupported(key: &'static str, what: &str) -> ApiError {
    ApiError::bad(format!("{what} is not supported by this server")).param(key).code("unsupported_parameter")
}

fn parse_stop(obj: &Map<String, Value>) -> std::result::Result<Vec<String>, ApiError> {
    let bad = || ApiError::bad("`stop` must be a string or a list of strings").param("stop");
    let stop: Vec<String> = match field(obj, "stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a.iter().map(|v| v.as_str().map(str::to_string).ok_or_else(bad)).collect::<std::result::Result<_, _>>()?,
        Some(_) => return Err(bad()),
    };
    if stop.len() > MAX_STOP {
        return Err(ApiError::bad(format!("`stop` has {} strings; at most {MAX_STOP} are accepted", stop.len())).param("stop"));
    }
    Ok(stop.into_iter().filter(|s| !s.is_empty()).collect())
}

/// The completions prompt: a string, a list of token ids, or a one-element list of either.
fn parse_prompt(shared: &Shared, v: Option<&Value>) -> std::result::Result<Vec<u32>, ApiError> {
    let one = || ApiError::bad("only one prompt per request is supported (send one request per prompt)").param("prompt");
    let ids = |a: &[Value]| -> std::result::Result<Vec<u32>, ApiError> {
        a.iter()
            .map(|t| {
                t.as_u64().and_then(|t| u32::try_from(t).ok()).filter(|&t| (t as usize) < shared.vocab).ok_or_else(|| {
                    ApiError::bad(format!("the prompt's token ids must be integers below the vocabulary size ({})", shared.vocab))
                        .param("prompt")
                })
            })
            .collect()
    };
    let encode =
        |s: &str| shared.tokenizer.encode(s).map_err(|e| ApiError::bad(format!("the prompt could not be tokenized: {e}")).param("prompt"));
    match v {
        None | Some(Value::Null) => Err(ApiError::bad("you must provide a `prompt`").param("prompt").code("missing_required_parameter")),
        Some(Value::String(s)) => encode(s),
        Some(Value::Array(a)) if a.iter().all(Value::is_number) && !a.is_empty() => ids(a),
        Some(Value::Array(a)) if a.len() == 1 => match &a[0] {
            Value::String(s) => encode(s),
            Value::Array(inner) => ids(inner),
            _ => Err(ApiError::bad("`prompt` must be a string or a list of token ids").param("prompt")),
        },
        Some(Value::Array(a)) if a.len() > 1 && a.iter().all(|x| x.is_string() || x.is_array()) => Err(one()),
        Some(_) => Err(ApiError::bad("`prompt` must be a string or a list of token ids").param("prompt")),
    }
}

/// Chat messages rendered with the model's template and tokenized.
fn parse_messages(shared: &Shared, v: Option<&Value>) -> std::result::Result<Vec<u32>, ApiError> {
    let bad = |m: String| ApiError::bad(m).param("messages");
    let Some(v) = v.filter(|v| !v.is_null()) else {
        return Err(bad("you must provide `messages`".into()).code("missing_required_parameter"));
    };
    let list = v.as_array().ok_or_else(|| bad("`messages` must be a list".into()))?;
    if list.is_empty() {
        return Err(bad("`messages` must not be empty".into()));
    }
    let mut msgs = Vec::with_capacity(list.len());
    for (i, m) in list.iter().enumerate() {
        let o = m.as_object().ok_or_else(|| bad(format!("messages[{i}] must be an object")))?;
        let role = o.get("role").and_then(Value::as_str).ok_or_else(|| bad(format!("messages[{i}].role must be a string")))?;
        let role = if role == "developer" { "system" } else { role };
        let content = match o.get("content") {
            None | Some(Value::Null) => String::new(),
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(parts)) => {
                let mut text = String::new();
                for p in parts {
                    match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                        (Some("text"), Some(t)) => text.push_str(t),
                        _ => return Err(bad(format!("messages[{i}].content: only text parts are supported"))),
                    }
                }
                text
            }
            Some(_) => return Err(bad(format!("messages[{i}].content must be a string or a list of text parts"))),
        };
        msgs.push(ChatMessage::new(role, content));
    }
    let tmpl = shared.template.as_ref().map_err(|e| {
        ApiError::bad(format!("this model has no usable chat template ({e}); use /v1/completions")).code("no_chat_template")
    })?;
    let rendered = tmpl.render(&msgs, true).map_err(|e| bad(format!("the chat template refused the messages: {e}")))?;
    shared.tokenizer.encode_chat(&rendered).map_err(|e| bad(format!("the messages could not be tokenized: {e}")))
}

/// The request's `speculative` extension over the server's default: `{"drafter": "lookup" |
/// "model" | "off", "draft_tokens": k}` (either key may be left out).
fn parse_speculation(shared: &Shared, obj: &Map<String, Value>) -> std::result::Result<lantern::engine::Speculation, ApiError> {
    use lantern::engine::Drafter;
    let mut s = shared.speculation;
    let Some(v) = field(obj, "speculative") else { return Ok(s) };
    let bad = |m: &str| ApiError::bad(format!("`speculative` {m}")).param("speculative");
    let o = v.as_object().ok_or_else(|| bad("must be an object: {\"drafter\": \"lookup\" | \"model\" | \"off\", \"draft_tokens\": k}"))?;
    if let Some(d) = field(o, "drafter") {
        s.drafter = match d.as_str() {
            Some("lookup") => Drafter::Lookup,
            Some("model") => Drafter::Model,
            Some("off") => Drafter::Off,
            _ => return Err(bad("`drafter` must be \"lookup\", \"model\" or \"off\"")),
        };
    }
    if let Some(k) = field(o, "draft_tokens") {
        let k = k.as_u64().filter(|&k| k <= 32).ok_or_else(|| bad("`draft_tokens` must be an integer from 0 to 32"))?;
        s.draft_tokens = Some(k as usize);
    }
    if let Some(k) = o.keys().find(|k| *k != "drafter" && *k != "draft_tokens") {
        return Err(bad(&format!("has an unknown key `{k}`")));
    }
    Ok(s)
}

fn parse_generation(shared: &Shared, body: &[u8], chat: bool) -> std::result::Result<Parsed, ApiError> {
    let v: Value =
        serde_json::from_slice(body).map_err(|e| ApiError::bad(format!("the request body is not valid JSON: {e}")).code("invalid_json"))?;
    let obj = v.as_object().ok_or_else(|| ApiError::bad("the request body must be a JSON object"))?;
    match field(obj, "model") {
        None => return Err(ApiError::bad("you must provide a `model` parameter").param("model").code("missing_required_parameter")),
        Some(Value::String(m)) if shared.knows_model(m) => {}
        Some(Value::String(m)) => return Err(model_not_found(m)),
        Some(_) => return Err(ApiError::bad("`model` must be a string").param("model")),
    }
    if opt_count(obj, "n")?.is_some_and(|n| n != 1) {
        return Err(ApiError::bad("only n = 1 is supported").param("n").code("unsupported_parameter"));
    }
    if opt_count(obj, "best_of")?.is_some_and(|n| n > 1) {
        return Err(unsupported("best_of", "best_of > 1"));
    }
    if opt_bool(obj, "echo")? == Some(true) {
        return Err(unsupported("echo", "echo"));
    }
    match field(obj, "logprobs") {
        None | Some(Value::Bool(false)) => {}
        Some(v) if v.as_u64() == Some(0) => {}
        Some(_) => return Err(unsupported("logprobs", "logprobs")),
    }
    if field(obj, "suffix").and_then(Value::as_str).is_some_and(|s| !s.is_empty()) {
        return Err(unsupported("suffix", "suffix"));
    }
    for key in ["tools", "functions"] {
        if field(obj, key).is_some_and(|t| !t.as_array().is_some_and(|a| a.is_empty())) {
            return Err(unsupported(if key == "tools" { "tools" } else { "functions" }, "tool calling"));
        }
    }
    if let Some(rf) = field(obj, "response_format") {
        if rf.get("type").and_then(Value::as_str) != Some("text") {
            return Err(unsupported("response_format", "a response_format other than text"));
        }
    }
    let stream = opt_bool(obj, "stream")?.unwrap_or(false);
    let include_usage = field(obj, "stream_options").and_then(|o| o.get("include_usage")).and_then(Value::as_bool).unwrap_or(false);
    let temperature = opt_f64(obj, "temperature")?.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::bad(format!("`temperature` is {temperature}; it must be between 0 and 2")).param("temperature"));
    }
    let top_p = opt_f64(obj, "top_p")?.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::bad(format!("`top_p` is {top_p}; it must be in (0, 1]")).param("top_p"));
    }
    let top_k = match opt_i64(obj, "top_k")? {
        None | Some(-1) | Some(0) => 0,
        Some(k) if k > 0 => usize::try_from(k).unwrap_or(usize::MAX),
        Some(k) => return Err(ApiError::bad(format!("`top_k` is {k}; it must be 0 (off), -1 (off) or positive")).param("top_k")),
    };
    let seed = match field(obj, "seed") {
        None => random_u64(),
        Some(v) => {
            v.as_u64().or_else(|| v.as_i64().map(|s| s as u64)).ok_or_else(|| ApiError::bad("`seed` must be an integer").param("seed"))?
        }
    };
    let stop = parse_stop(obj)?;
    let requested = if chat {
        match opt_count(obj, "max_completion_tokens")? {
            Some(n) => Some(n),
            None => opt_count(obj, "max_tokens")?,
        }
    } else {
        opt_count(obj, "max_tokens")?
    };
    let prompt_ids = if chat { parse_messages(shared, obj.get("messages"))? } else { parse_prompt(shared, obj.get("prompt"))? };
    let what = if chat { "messages" } else { "prompt" };
    if prompt_ids.is_empty() {
        return Err(ApiError::bad(format!("the {what} is empty (no tokens to condition on)")).param(what));
    }
    let most = shared.max_sequence();
    if prompt_ids.len() >= most {
        let msg = if most < shared.context {
            format!(
                "the {what} has {} tokens but the KV cache holds {most} tokens for one request ({} pages of {}), which leaves no room for a completion",
                prompt_ids.len(),
                shared.kv_pages_total,
                shared.page_size
            )
        } else {
            format!(
                "this model's context holds {most} tokens (prompt and completion together) but the {what} has {} tokens, which leaves no room for a completion; shorten it or restart the server with a larger --context",
                prompt_ids.len()
            )
        };
        return Err(ApiError::bad(msg).param(what).code("context_length_exceeded"));
    }
    // Generation can never go past the context: a larger max_tokens ends with "length" there.
    let room = most - prompt_ids.len();
    let max_tokens = requested.unwrap_or(if chat { room } else { 16 }).min(room);
    Ok(Parsed {
        prompt_ids,
        max_tokens,
        sampling: SamplingParams { temperature: temperature as f32, top_k, top_p: top_p as f32, seed },
        stop,
        stream,
        include_usage,
        speculation: parse_speculation(shared, obj)?,
    })
}

/// The engine's refusal of a request as an HTTP error.
fn submit_error(shared: &Shared, e: LanternError) -> (ApiError, &'static str) {
    match e {
        LanternError::PromptTooLong { prompt_tokens, context, .. } => (
            ApiError::bad(format!("this model's context holds {context} tokens but the prompt has {prompt_tokens} tokens"))
                .code("context_length_exceeded"),
            "rejected",
        ),
        LanternError::Kv(k @ KvError::Full { .. }) => {
            (ApiError::bad(format!("this request can never fit the server's KV cache: {k}")).code("kv_cache_too_small"), "rejected")
        }
        m @ LanternError::Overloaded { .. } => (
            ApiError::new(429, "server_overloaded", format!("the server is busy: {m}; retry shortly")).code("queue_full").retry_after(),
            "overloaded",
        ),
        m @ LanternError::EngineStopped => {
            shared.engine_down.store(true, Ordering::SeqCst);
            (
                ApiError::new(503, "server_error", format!("{m}; the server cannot take requests")).code("engine_stopped").retry_after(),
                "unavailable",
            )
        }
        other => (ApiError::bad(other.to_string()), "rejected"),
    }
}

fn generate(shared: &Shared, req: &HttpRequest, conn: &mut Conn, chat: bool) -> Reply {
    let p = match parse_generation(shared, &req.body, chat) {
        Ok(p) => p,
        Err(e) => {
            shared.metrics().outcome("rejected");
            return Reply::Error(e);
        }
    };
    let prompt_tokens = p.prompt_ids.len();
    let handle = match shared.client.submit(GenerateRequest {
        prompt_ids: p.prompt_ids,
        max_tokens: p.max_tokens,
        sampling: p.sampling,
        stop_ids: shared.stop_ids.clone(),
        stop_strings: p.stop,
        speculation: p.speculation,
        constraint: None,
    }) {
        Ok(h) => h,
        Err(e) => {
            let (err, outcome) = submit_error(shared, e);
            shared.metrics().outcome(outcome);
            return Reply::Error(err);
        }
    };
    let job = Job { id: shared.new_id(if chat { "chatcmpl" } else { "cmpl" }), created: unix_now(), chat, prompt_tokens };
    let waiter = Waiter::new(handle, shared.request_timeout);
    if p.stream {
        stream_reply(shared, conn, &job, waiter, p.include_usage)
    } else {
        full_reply(shared, conn, &job, waiter)
    }
}

/// One accepted request's identity in its responses.
struct Job {
    id: String,
    created: u64,
    chat: bool,
    prompt_tokens: usize,
}

impl Job {
    fn usage(&self, g: &Generation) -> Value {
        let completion = g.output_ids.len();
        let mut u = json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": g.cached_prompt_tokens},
        });
        // An extension: what speculative decoding did (drafted, accepted, timings).
        if let Some(sp) = &g.speculative {
            u["speculative"] = serde_json::to_value(sp).unwrap_or(Value::Null);
        }
        u
    }

    /// A streamed chunk carrying `text` (chat: a content delta), or the final one.
    fn chunk(&self, shared: &Shared, text: Option<&str>, finish: Option<&str>) -> Value {
        let choice = if self.chat {
            let delta = match text {
                Some(t) => json!({"content": t}),
                None => json!({}),
            };
            json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish})
        } else {
            json!({"index": 0, "text": text.unwrap_or(""), "logprobs": null, "finish_reason": finish})
        };
        json!({
            "id": self.id,
            "object": if self.chat { "chat.completion.chunk" } else { "text_completion" },
            "created": self.created,
            "model": shared.model_id,
            "choices": [choice],
        })
    }
}

fn finish_str(f: FinishReason) -> &'static str {
    match f {
        FinishReason::Stop | FinishReason::Cancelled => "stop",
        FinishReason::Length | FinishReason::ContextFull => "length",
    }
}

fn full_reply(shared: &Shared, conn: &mut Conn, job: &Job, mut w: Waiter) -> Reply {
    loop {
        match w.next(&conn.stream) {
            Wait::Event(Event::Done(g)) => {
                shared.metrics().finished(&g, job.prompt_tokens);
                let finish = finish_str(g.finish_reason);
                let choice = if job.chat {
                    json!({"index": 0, "message": {"role": "assistant", "content": g.text}, "logprobs": null, "finish_reason": finish})
                } else {
                    json!({"index": 0, "text": g.text, "logprobs": null, "finish_reason": finish})
                };
                return Reply::Json(
                    200,
                    json!({
                        "id": job.id,
                        "object": if job.chat { "chat.completion" } else { "text_completion" },
                        "created": job.created,
                        "model": shared.model_id,
                        "choices": [choice],
                        "usage": job.usage(&g),
                    }),
                );
            }
            Wait::Event(Event::Error(m)) => {
                shared.metrics().outcome("error");
                return Reply::Error(ApiError::new(500, "server_error", format!("generation failed: {m}")).code("engine_error"));
            }
            Wait::Event(_) => {}
            Wait::Ended => {
                shared.engine_down.store(true, Ordering::SeqCst);
                shared.metrics().outcome("unavailable");
                return Reply::Error(
                    ApiError::new(503, "server_error", "the engine stopped before the request finished").code("engine_stopped"),
                );
            }
            Wait::Gone => {
                shared.metrics().outcome("cancelled");
                return Reply::Gone;
            }
            Wait::TimedOut(s) => {
                shared.metrics().outcome("timeout");
                return Reply::Error(
                    ApiError::new(504, "server_error", format!("the request did not finish within {s} s (--request-timeout)"))
                        .code("timeout"),
                );
            }
        }
    }
}

/// Server-sent events over chunked transfer (HTTP/1.1) or until close (HTTP/1.0).
struct Sse<'a> {
    stream: &'a mut TcpStream,
    chunked: bool,
}

impl Sse<'_> {
    fn send(&mut self, payload: &str) -> std::io::Result<()> {
        let event = format!("data: {payload}\n\n");
        if self.chunked {
            let mut out = format!("{:x}\r\n", event.len()).into_bytes();
            out.extend_from_slice(event.as_bytes());
            out.extend_from_slice(b"\r\n");
            self.stream.write_all(&out)
        } else {
            self.stream.write_all(event.as_bytes())
        }
    }

    fn json(&mut self, v: &Value) -> std::io::Result<()> {
        self.send(&v.to_string())
    }

    /// `data: [DONE]` and the end of the body.
    fn done(&mut self) -> std::io::Result<()> {
        self.send("[DONE]")?;
        if self.chunked {
            self.stream.write_all(b"0\r\n\r\n")?;
        }
        self.stream.flush()
    }
}

fn stream_reply(shared: &Shared, conn: &mut Conn, job: &Job, mut w: Waiter, include_usage: bool) -> Reply {
    let chunked = conn.http11;
    let head = format!(
        "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\nX-Accel-Buffering: no\r\n{}Connection: {}\r\n\r\n",
        if chunked { "Transfer-Encoding: chunked\r\n" } else { "" },
        if chunked && conn.keep_alive { "keep-alive" } else { "close" }
    );
    if conn.stream.write_all(head.as_bytes()).is_err() {
        w.cancel();
        shared.metrics().outcome("cancelled");
        return Reply::Gone;
    }
    let conn_keep_alive = conn.keep_alive;
    let Conn { stream, .. } = conn;
    let mut sse = Sse { stream, chunked };
    let gone = |w: &Waiter| {
        w.cancel();
        shared.metrics().outcome("cancelled");
        Reply::Gone
    };
    if job.chat {
        let mut first = job.chunk(shared, None, None);
        first["choices"][0]["delta"] = json!({"role": "assistant", "content": ""});
        if sse.json(&first).is_err() {
            return gone(&w);
        }
    }
    loop {
        let text = match w.next(sse.stream) {
            Wait::Event(Event::Token { text, .. }) | Wait::Event(Event::Text(text)) => text,
            Wait::Event(Event::Done(g)) => {
                shared.metrics().finished(&g, job.prompt_tokens);
                let mut r = sse.json(&job.chunk(shared, None, Some(finish_str(g.finish_reason))));
                if include_usage && r.is_ok() {
                    let mut u = job.chunk(shared, None, None);
                    u["choices"] = json!([]);
                    u["usage"] = job.usage(&g);
                    r = sse.json(&u);
                }
                if r.is_err() || sse.done().is_err() {
                    return Reply::Gone;
                }
                return Reply::Written(200, chunked && conn_keep_alive);
            }
            Wait::Event(Event::Error(m)) => {
                shared.metrics().outcome("error");
                let e = ApiError::new(500, "server_error", format!("generation failed: {m}")).code("engine_error");
                let _ = sse.json(&e.json()).and_then(|_| sse.done());
                return Reply::Written(200, false);
            }
            Wait::Ended => {
                shared.engine_down.store(true, Ordering::SeqCst);
                shared.metrics().outcome("unavailable");
                let e = ApiError::new(503, "server_error", "the engine stopped before the request finished").code("engine_stopped");
                let _ = sse.json(&e.json()).and_then(|_| sse.done());
                return Reply::Written(200, false);
            }
            Wait::TimedOut(s) => {
                shared.metrics().outcome("timeout");
                let e = ApiError::new(504, "server_error", format!("the request did not finish within {s} s (--request-timeout)"))
                    .code("timeout");
                let _ = sse.json(&e.json()).and_then(|_| sse.done());
                return Reply::Written(200, false);
            }
            Wait::Gone => return gone(&w),
        };
        if text.is_empty() {
            continue;
        }
        if sse.json(&job.chunk(shared, Some(&text), None)).is_err() {
            return gone(&w);
        }
    }
}

// ---------------------------------------------------------------------------------------
// Waiting for a request's events from a connection thread
// ---------------------------------------------------------------------------------------

enum Wait {
    Event(Event),
    /// The event stream ended without `Done` (the engine stopped).
    Ended,
    /// The client closed its connection.
    Gone,
    /// `--request-timeout` passed (seconds).
    TimedOut(u64),
}

struct ParkWaker(std::thread::Thread);

impl Wake for ParkWaker {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }
}

/// A request's handle, read on this thread with periodic checks of the client's socket
/// and the request's deadline. Dropping it (with the handle) cancels the request in the
/// engine if it has not finished.
struct Waiter {
    handle: RequestHandle,
    timeout: Option<Duration>,
    started: Instant,
    last_check: Instant,
    waker: Waker,
}

impl Waiter {
    fn new(handle: RequestHandle, timeout: Option<Duration>) -> Self {
        let now = Instant::now();
        Waiter { handle, timeout, started: now, last_check: now, waker: Waker::from(Arc::new(ParkWaker(std::thread::current()))) }
    }

    fn cancel(&self) {
        self.handle.cancel();
    }

    fn next(&mut self, stream: &TcpStream) -> Wait {
        let mut cx = Context::from_waker(&self.waker);
        loop {
            let now = Instant::now();
            if now.duration_since(self.last_check) >= LIVENESS_EVERY {
                self.last_check = now;
                if client_gone(stream) {
                    self.handle.cancel();
                    return Wait::Gone;
                }
            }
            let polled = {
                let fut = self.handle.next();
                let mut fut = std::pin::pin!(fut);
                std::future::Future::poll(fut.as_mut(), &mut cx)
            };
            match polled {
                Poll::Ready(Some(e)) => return Wait::Event(e),
                Poll::Ready(None) => return Wait::Ended,
                Poll::Pending => {}
            }
            let mut nap = LIVENESS_EVERY;
            if let Some(t) = self.timeout {
                let elapsed = self.started.elapsed();
                if elapsed >= t {
                    self.handle.cancel();
                    return Wait::TimedOut(t.as_secs());
                }
                nap = nap.min(t - elapsed);
            }
            std::thread::park_timeout(nap);
        }
    }
}

/// Whether the peer has closed the connection (end of file or an error on a non-blocking
/// peek; bytes waiting, such as a pipelined request, mean it is still there).
fn client_gone(stream: &TcpStream) -> bool {
    if stream.set_nonblocking(true).is_err() {
        return true;
    }
    let mut b = [0u8; 1];
    let r = stream.peek(&mut b);
    let gone = match r {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
    };
    if stream.set_nonblocking(false).is_err() {
        return true;
    }
    gone
}

// ---------------------------------------------------------------------------------------
// Metrics
// ---------------------------------------------------------------------------------------

/// Generation request outcomes, all exported (zero until seen).
const OUTCOMES: [(&str, &str); 9] = [
    ("stop", "finished: end of sequence or a stop string"),
    ("length", "finished: max_tokens or the context reached"),
    ("cancelled", "the client went away; the engine freed the request's pages"),
    ("timeout", "--request-timeout passed"),
    ("error", "the engine failed the request"),
    ("rejected", "invalid request (4xx)"),
    ("overloaded", "the engine's queue was full (429)"),
    ("unavailable", "the engine has stopped (503)"),
    ("too_many_connections", "connection refused beyond --max-connections (503)"),
];

const TTFT_BUCKETS: &[f64] = &[0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];
const TPOT_BUCKETS: &[f64] = &[0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5];
const E2E_BUCKETS: &[f64] = &[0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0];

struct Histogram {
    buckets: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(buckets: &'static [f64]) -> Self {
        Histogram { buckets, counts: vec![0; buckets.len()], sum: 0.0, count: 0 }
    }

    fn observe(&mut self, v: f64) {
        if !v.is_finite() {
            return;
        }
        if let Some(i) = self.buckets.iter().position(|&b| v <= b) {
            self.counts[i] += 1;
        }
        self.sum += v;
        self.count += 1;
    }

    fn render(&self, o: &mut String, name: &str, help: &str) {
        let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cum = 0;
        for (b, c) in self.buckets.iter().zip(&self.counts) {
            cum += c;
            let _ = writeln!(o, "{name}_bucket{{le=\"{b}\"}} {cum}");
        }
        let _ = writeln!(o, "{name}_bucket{{le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(o, "{name}_sum {}", self.sum);
        let _ = writeln!(o, "{name}_count {}", self.count);
    }
}

struct Metrics {
    http: BTreeMap<(&'static str, u16), u64>,
    outcomes: BTreeMap<&'static str, u64>,
    prompt_tokens: u64,
    completion_tokens: u64,
    draft_proposed: u64,
    draft_accepted: u64,
    ttft: Histogram,
    tpot: Histogram,
    e2e: Histogram,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            http: BTreeMap::new(),
            outcomes: OUTCOMES.iter().map(|(k, _)| (*k, 0)).collect(),
            prompt_tokens: 0,
            completion_tokens: 0,
            draft_proposed: 0,
            draft_accepted: 0,
            ttft: Histogram::new(TTFT_BUCKETS),
            tpot: Histogram::new(TPOT_BUCKETS),
            e2e: Histogram::new(E2E_BUCKETS),
        }
    }
}

impl Metrics {
    fn http(&mut self, route: &'static str, status: u16) {
        *self.http.entry((route, status)).or_insert(0) += 1;
    }

    fn outcome(&mut self, o: &'static str) {
        *self.outcomes.entry(o).or_insert(0) += 1;
    }

    /// A request the engine finished: its outcome, tokens and latencies.
    fn finished(&mut self, g: &Generation, prompt_tokens: usize) {
        self.outcome(match g.finish_reason {
            FinishReason::Stop => "stop",
            FinishReason::Length | FinishReason::ContextFull => "length",
            FinishReason::Cancelled => "cancelled",
        });
        self.prompt_tokens += prompt_tokens as u64;
        self.completion_tokens += g.output_ids.len() as u64;
        if let Some(sp) = &g.speculative {
            self.draft_proposed += sp.proposed as u64;
            self.draft_accepted += sp.accepted as u64;
        }
        let m = g.timings.metrics();
        if let Some(t) = m.ttft_ms {
            self.ttft.observe(t / 1e3);
        }
        if let Some(t) = m.tpot_ms {
            self.tpot.observe(t / 1e3);
        }
        if let Some(t) = m.e2e_ms {
            self.e2e.observe(t / 1e3);
        }
    }
}

fn label(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

fn render_metrics(shared: &Shared) -> String {
    let s = shared.client.snapshot();
    let mut o = String::with_capacity(8192);
    let mut one = |name: &str, kind: &str, help: &str, value: f64| {
        let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}");
    };
    one("lantern_requests_running", "gauge", "Requests admitted to the engine (holding KV pages).", s.running as f64);
    one("lantern_requests_waiting", "gauge", "Requests queued for admission.", s.waiting as f64);
    one("lantern_requests_max_waiting", "gauge", "Queue length beyond which requests get 429.", s.max_waiting as f64);
    one("lantern_kv_pages_total", "gauge", "KV cache pages in the pool.", s.kv_pages_total as f64);
    one(
        "lantern_kv_pages_free",
        "gauge",
        "KV cache pages not held by a request (evictable prefix-cache pages count as free).",
        s.kv_pages_free as f64,
    );
    one("lantern_kv_page_size_tokens", "gauge", "Tokens per KV page.", s.kv_page_size as f64);
    one("lantern_context_tokens", "gauge", "Context window (prompt + completion) in tokens.", s.context as f64);
    one(
        "lantern_http_connections_open",
        "gauge",
        "Open HTTP connections (this scrape's included).",
        shared.open.load(Ordering::SeqCst) as f64,
    );
    one(
        "lantern_engine_up",
        "gauge",
        "1 while the engine thread takes requests.",
        if shared.engine_down.load(Ordering::SeqCst) { 0.0 } else { 1.0 },
    );
    one("lantern_engine_steps_total", "counter", "Engine steps (one GPU batch each).", s.stats.steps as f64);
    one(
        "lantern_engine_preemptions_total",
        "counter",
        "Running requests preempted (pages freed, recomputed later) for lack of KV pages.",
        s.stats.preemptions as f64,
    );
    one(
        "lantern_engine_prompt_tokens_computed_total",
        "counter",
        "Prompt tokens prefilled on the GPU.",
        s.stats.prompt_tokens_computed as f64,
    );
    one("lantern_engine_output_tokens_total", "counter", "Tokens sampled by the engine.", s.stats.output_tokens as f64);
    one(
        "lantern_prefix_cache_hit_tokens_total",
        "counter",
        "Prompt tokens whose KV came from the prefix cache instead of being computed.",
        s.stats.prompt_tokens_cached as f64,
    );
    one("lantern_prefix_cache_lookups_total", "counter", "Prefix cache lookups.", s.prefix.lookups as f64);
    one("lantern_prefix_cache_evictions_total", "counter", "Cached prefix pages reused for new data.", s.prefix.evictions as f64);
    if let Some((rss, threads)) = process_stats() {
        one("process_resident_memory_bytes", "gauge", "Resident memory of the server process.", rss as f64);
        one("process_threads", "gauge", "Threads of the server process.", threads as f64);
    }
    let m = shared.metrics();
    one("lantern_prompt_tokens_total", "counter", "Prompt tokens of finished requests.", m.prompt_tokens as f64);
    one("lantern_completion_tokens_total", "counter", "Completion tokens of finished requests.", m.completion_tokens as f64);
    one(
        "lantern_speculative_draft_tokens_total",
        "counter",
        "Tokens drafted for speculative decoding (finished requests).",
        m.draft_proposed as f64,
    );
    one(
        "lantern_speculative_accepted_tokens_total",
        "counter",
        "Drafted tokens the target accepted (finished requests).",
        m.draft_accepted as f64,
    );
    let _ = writeln!(o, "# HELP lantern_requests_total Generation requests by outcome.\n# TYPE lantern_requests_total counter");
    for (k, v) in &m.outcomes {
        let _ = writeln!(o, "lantern_requests_total{{outcome=\"{k}\"}} {v}");
    }
    let _ = writeln!(
        o,
        "# HELP lantern_http_responses_total HTTP responses by route and status (499: the client went away).\n# TYPE lantern_http_responses_total counter"
    );
    for ((route, code), v) in &m.http {
        let _ = writeln!(o, "lantern_http_responses_total{{route=\"{route}\",code=\"{code}\"}} {v}");
    }
    m.ttft.render(&mut o, "lantern_time_to_first_token_seconds", "Arrival to first token, per finished request.");
    m.tpot.render(
        &mut o,
        "lantern_time_per_output_token_seconds",
        "Mean of the gaps between output tokens after the first, per finished request with 2+ tokens.",
    );
    m.e2e.render(&mut o, "lantern_e2e_request_latency_seconds", "Arrival to completion, per finished request.");
    drop(m);
    let _ = writeln!(
        o,
        "# HELP lantern_model_info The served model.\n# TYPE lantern_model_info gauge\nlantern_model_info{{model=\"{}\",adapter=\"{}\",kv_dtype=\"{}\"}} 1",
        label(&shared.model_id),
        label(&shared.adapter),
        label(&shared.kv_dtype)
    );
    o
}

/// Resident bytes and thread count from /proc (Linux only).
fn process_stats() -> Option<(u64, u64)> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let field = |name: &str| {
        status.lines().find_map(|l| l.strip_prefix(name)).and_then(|v| v.split_whitespace().next()).and_then(|v| v.parse::<u64>().ok())
    };
    Some((field("VmRSS:")? * 1024, field("Threads:")?))
}

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// A seed from the clock and a counter (not for secrets).
fn random_u64() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let t = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    let mut z = t ^ COUNTER.fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_tokens() {
        assert_eq!(bearer("Bearer abc"), Some("abc"));
        assert_eq!(bearer("bearer  abc "), Some("abc"));
        assert_eq!(bearer("Basic abc"), None);
        assert_eq!(bearer("Bearer"), None);
        assert!(ct_eq(&sha256("k"), &sha256("k")));
        assert!(!ct_eq(&sha256("k"), &sha256("K")));
    }

    #[test]
    fn paths() {
        assert_eq!(request_path("/v1/models?x=1").as_deref(), Some("/v1/models"));
        assert_eq!(request_path("http://h:1/metrics").as_deref(), Some("/metrics"));
        assert_eq!(request_path("http://h:1").as_deref(), Some("/"));
        assert_eq!(request_path("*"), None);
        assert_eq!(percent_decode("a%2Fb").as_deref(), Some("a/b"));
        assert_eq!(percent_decode("a%2"), None);
        assert_eq!(percent_decode("%zz"), None);
        assert_eq!(percent_decode("%ff"), None);
    }

    #[test]
    fn lines() {
        let mut buf = Vec::new();
        let mut r = std::io::Cursor::new(b"GET / HTTP/1.1\r\nX: y\nlong-line-here\r\n".to_vec());
        assert!(matches!(read_line(&mut r, &mut buf, 64).unwrap(), Line::Full));
        assert_eq!(buf, b"GET / HTTP/1.1");
        assert!(matches!(read_line(&mut r, &mut buf, 64).unwrap(), Line::Full));
        assert_eq!(buf, b"X: y");
        assert!(matches!(read_line(&mut r, &mut buf, 4).unwrap(), Line::TooLong));
        let mut r = std::io::Cursor::new(b"partial".to_vec());
        assert!(matches!(read_line(&mut r, &mut buf, 64).unwrap(), Line::Eof));
    }

    #[test]
    fn histogram_text() {
        let mut h = Histogram::new(&[0.1, 1.0]);
        h.observe(0.05);
        h.observe(0.5);
        h.observe(5.0);
        h.observe(f64::NAN);
        let mut o = String::new();
        h.render(&mut o, "x_seconds", "help");
        assert!(o.contains("x_seconds_bucket{le=\"0.1\"} 1\n"), "{o}");
        assert!(o.contains("x_seconds_bucket{le=\"1\"} 2\n"), "{o}");
        assert!(o.contains("x_seconds_bucket{le=\"+Inf\"} 3\n"), "{o}");
        assert!(o.contains("x_seconds_count 3\n"), "{o}");
    }

    #[test]
    fn stop_lists() {
        let obj = |v: Value| v.as_object().cloned().unwrap();
        assert_eq!(parse_stop(&obj(json!({"stop": "\n"}))).ok(), Some(vec!["\n".to_string()]));
        assert_eq!(parse_stop(&obj(json!({"stop": ["a", ""]}))).ok(), Some(vec!["a".to_string()]));
        assert_eq!(parse_stop(&obj(json!({"stop": null}))).ok(), Some(vec![]));
        assert!(parse_stop(&obj(json!({"stop": 3}))).is_err());
        assert!(parse_stop(&obj(json!({"stop": [1]}))).is_err());
    }
}

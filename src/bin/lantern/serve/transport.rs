//! The HTTP side of `lantern serve`: hyper's HTTP/1.1 server on tokio, axum's router.
//!
//! - Accepting: one task per connection (a connection costs a few KB, not a thread). The
//!   connection registry caps open connections (`--max-connections`) and connections without
//!   a request in flight (`--max-idle-connections`): at either cap the oldest idle one
//!   (between keep-alive requests, or still sending its request) is closed to make room, so
//!   clients that trickle bytes cannot hold every slot. Only when every connection has a
//!   request in flight does a new one get 503 `too_many_connections` at once.
//! - Deadlines: hyper's header read timeout (`--read-timeout`) covers a request's whole header
//!   block and the wait for the next request on a keep-alive connection; the body must then
//!   arrive within the same time (408), and a declared body over 4 MiB is refused before it
//!   is read (413).
//! - Every request passes [`handle`]: the API key (constant-time; `/health` is exempt, and a
//!   missing key, a wrong key and an unknown route get the same 401), then the router, then
//!   the access log and the per-route status counters.
//! - Shutdown on SIGINT/SIGTERM ([`Server::run_until_signal`]): drain. Every request that
//!   arrives from then on gets 503 with `Retry-After` and `Connection: close` (`/health`
//!   too, so a router or a readiness probe takes the replica out), connections close once
//!   idle, requests in flight finish for `--shutdown-timeout`, then the rest are cancelled
//!   (each ends with a final event); the engine frees their pages and stops.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context as _, Result};
use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use sha2::{Digest, Sha256};
use tokio::io::AsyncWriteExt as _;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify};
use tower::ServiceExt as _;

use lantern::api::{model_not_found, ApiError, ServedModel};
use lantern::engine::{Engine, EngineClient, EngineWorker, Speculation};
use lantern::model::forward::Pooling;

use super::anthropic;
use super::bridge;
use super::embeddings;
use super::metrics::{self, random_u64, Metrics};
use super::ollama::{self, ModelInfo};
use super::responses;

/// Largest request body (413 beyond).
pub const MAX_BODY: usize = 4 << 20;
/// hyper's read buffer, which bounds a request's header block (431 beyond).
const MAX_HEADER_BYTES: usize = 64 << 10;
const MAX_HEADERS: usize = 100;
/// A rejected connection gets this long to take its 503.
const REJECT_WRITE: Duration = Duration::from_secs(2);
/// After the shutdown's cancellation, connections get this long to write their last events.
const FINAL_WRITE: Duration = Duration::from_secs(3);

/// What the server needs besides the engine.
pub struct ServerConfig {
    pub api_key: Option<String>,
    pub max_connections: usize,
    pub max_idle_connections: usize,
    pub read_timeout: Duration,
    pub shutdown_timeout: Duration,
    pub sse_keepalive: Option<Duration>,
    pub request_timeout: Option<Duration>,
    pub quiet: bool,
    pub model_id: String,
    pub aliases: Vec<String>,
    /// Unix time /v1/models reports as `created`.
    pub created: u64,
    pub adapter: String,
    pub kv_dtype: String,
    pub speculation: Speculation,
    /// Whether the prefix cache is on (`vllm:cache_config_info`).
    pub prefix_cache: bool,
    /// How `/v1/embeddings` and `/api/embed` pool positions unless a request says otherwise.
    pub embedding_pooling: Pooling,
    /// What the Ollama API reports of the model.
    pub info: ModelInfo,
}

/// One open connection in the registry.
pub struct ConnSlot {
    id: u64,
    /// Requests of this connection between submission and the end of their answer.
    busy: AtomicUsize,
    /// Close now (evicted to make room).
    evict: Notify,
}

/// Marks a connection busy while a generation runs; the bridge holds it until the answer's
/// last byte is handed to hyper.
pub struct BusyGuard(Arc<ConnSlot>, Arc<Shared>);

impl BusyGuard {
    pub fn new(slot: Arc<ConnSlot>, shared: Arc<Shared>) -> Self {
        slot.busy.fetch_add(1, Ordering::SeqCst);
        shared.in_flight.fetch_add(1, Ordering::SeqCst);
        BusyGuard(slot, shared)
    }
}

impl Drop for BusyGuard {
    fn drop(&mut self) {
        self.0.busy.fetch_sub(1, Ordering::SeqCst);
        if self.1.in_flight.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.1.idle.notify_waiters();
        }
    }
}

/// The request's connection (a request extension).
#[derive(Clone)]
pub struct Conn(pub Arc<ConnSlot>);

/// State every request reads.
pub struct Shared {
    pub client: EngineClient,
    pub model: ServedModel,
    pub created: u64,
    pub adapter: String,
    pub kv_dtype: String,
    pub prefix_cache: bool,
    pub embedding_pooling: Pooling,
    pub info: ModelInfo,
    /// SIGTERM or SIGINT came: requests get 503 with `Retry-After` (a router sends them to
    /// another replica) while those in flight finish.
    pub draining: AtomicBool,
    /// Conversations for the Responses API's `previous_response_id`.
    pub responses: responses::Store,
    key_hash: Option<[u8; 32]>,
    max_connections: usize,
    max_idle: usize,
    pub read_timeout: Duration,
    pub request_timeout: Option<Duration>,
    pub sse_keepalive: Option<Duration>,
    quiet: bool,
    next_id: AtomicU64,
    nonce: u64,
    pub engine_down: AtomicBool,
    metrics: Mutex<Metrics>,
    conns: Mutex<BTreeMap<u64, Arc<ConnSlot>>>,
    next_conn: AtomicU64,
    /// Generations in flight over all connections, and a wake-up when it reaches zero.
    in_flight: AtomicUsize,
    idle: Notify,
    /// Set once the shutdown deadline passed: requests in flight end now.
    pub cancel: watch::Sender<bool>,
}

impl Shared {
    pub fn metrics(&self) -> MutexGuard<'_, Metrics> {
        self.metrics.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn conns(&self) -> MutexGuard<'_, BTreeMap<u64, Arc<ConnSlot>>> {
        self.conns.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn open_connections(&self) -> usize {
        self.conns().len()
    }

    pub fn key_required(&self) -> bool {
        self.key_hash.is_some()
    }

    pub fn new_id(&self, prefix: &str) -> String {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        format!("{prefix}-{:012x}{n:08x}", self.nonce & 0xffff_ffff_ffff)
    }

    /// Register a new connection, closing idle ones to make room; `None`: every connection
    /// is busy and the cap is reached.
    fn admit(&self) -> Option<Arc<ConnSlot>> {
        let mut conns = self.conns();
        loop {
            let idle = conns.values().filter(|c| c.busy.load(Ordering::SeqCst) == 0).count();
            if conns.len() < self.max_connections && idle < self.max_idle {
                break;
            }
            // The map is ordered by id, so this is the oldest idle connection.
            let victim = conns.values().find(|c| c.busy.load(Ordering::SeqCst) == 0).cloned()?;
            conns.remove(&victim.id);
            victim.evict.notify_one();
            self.metrics().evicted += 1;
        }
        let id = self.next_conn.fetch_add(1, Ordering::Relaxed);
        let slot = Arc::new(ConnSlot { id, busy: AtomicUsize::new(0), evict: Notify::new() });
        conns.insert(id, slot.clone());
        Some(slot)
    }

    fn forget(&self, id: u64) {
        self.conns().remove(&id);
    }
}

/// A bound server.
pub struct Server {
    pub addr: SocketAddr,
    pub shared: Arc<Shared>,
    listener: TcpListener,
    worker: EngineWorker,
    shutdown_timeout: Duration,
}

impl Server {
    /// Serve on `listener` (bound by [`bind`]) and put the engine on its own thread.
    pub async fn start(listener: TcpListener, engine: Engine, cfg: ServerConfig) -> Result<Server> {
        let tokenizer = engine.tokenizer.clone();
        let template = tokenizer.chat_template().map_err(|e| e.to_string());
        let stop_ids = lantern::engine::generate::default_stop_ids(&engine.model.config.eos_token_ids, &tokenizer);
        let vocab = engine.model.config.vocab_size;
        let max_seqs = engine.model.kv.alloc.config.max_seqs;
        let embedding_dims = engine.model.config.hidden_size;
        let addr = listener.local_addr().context("reading the bound address")?;
        let worker = EngineWorker::spawn(engine);
        let client = worker.client();
        let snap = client.snapshot();
        let shared = Arc::new(Shared {
            client,
            model: ServedModel {
                tokenizer,
                template,
                stop_ids,
                vocab,
                context: snap.context,
                kv_pages_total: snap.kv_pages_total,
                page_size: snap.kv_page_size.max(1),
                model_id: cfg.model_id,
                aliases: cfg.aliases,
                speculation: cfg.speculation,
                max_seqs,
                embedding_dims,
                token_bytes: Default::default(),
            },
            created: cfg.created,
            adapter: cfg.adapter,
            kv_dtype: cfg.kv_dtype,
            prefix_cache: cfg.prefix_cache,
            embedding_pooling: cfg.embedding_pooling,
            info: cfg.info,
            draining: AtomicBool::new(false),
            responses: responses::Store::default(),
            key_hash: cfg.api_key.as_deref().map(sha256),
            max_connections: cfg.max_connections.max(1),
            max_idle: cfg.max_idle_connections.max(1),
            read_timeout: cfg.read_timeout,
            request_timeout: cfg.request_timeout,
            sse_keepalive: cfg.sse_keepalive,
            quiet: cfg.quiet,
            next_id: AtomicU64::new(0),
            nonce: random_u64(),
            engine_down: AtomicBool::new(false),
            metrics: Mutex::new(Metrics::default()),
            conns: Mutex::new(BTreeMap::new()),
            next_conn: AtomicU64::new(0),
            in_flight: AtomicUsize::new(0),
            idle: Notify::new(),
            cancel: watch::channel(false).0,
        });
        Ok(Server { addr, shared, listener, worker, shutdown_timeout: cfg.shutdown_timeout })
    }

    /// Serve until SIGINT or SIGTERM, then shut down gracefully.
    pub async fn run_until_signal(self) -> Result<()> {
        let Server { shared, listener, worker, shutdown_timeout, .. } = self;
        let router = router(shared.clone());
        // Connections watch this to stop taking requests.
        let (drain_tx, drain_rx) = watch::channel(false);
        let signal = shutdown_signal();
        tokio::pin!(signal);
        loop {
            tokio::select! {
                name = &mut signal => {
                    eprintln!("lantern serve: {name}: no new connections; finishing {} requests in flight (up to {} s)", shared.in_flight.load(Ordering::SeqCst), shutdown_timeout.as_secs());
                    break;
                }
                accepted = listener.accept() => match accepted {
                    Ok((stream, _)) => accept(&shared, &router, stream, drain_rx.clone()),
                    Err(e) => {
                        // Out of file descriptors and the like: back off instead of spinning.
                        if !shared.quiet {
                            eprintln!("accept: {e}");
                        }
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                },
            }
        }
        // Draining: connections that were open close once idle; the listener stays open so
        // that new requests get a 503 with Retry-After (not a refused connection) until the
        // process exits.
        shared.draining.store(true, Ordering::SeqCst);
        let _ = drain_tx.send(true);
        let late = {
            let (shared, router) = (shared.clone(), router.clone());
            let (keep_tx, keep_rx) = watch::channel(false);
            tokio::spawn(async move {
                let _keep = keep_tx;
                loop {
                    match listener.accept().await {
                        Ok((stream, _)) => accept(&shared, &router, stream, keep_rx.clone()),
                        Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
                    }
                }
            })
        };
        let deadline = Instant::now() + shutdown_timeout;
        let finished = wait_for_no_requests(&shared, deadline).await;
        let left = shared.in_flight.load(Ordering::SeqCst);
        if !finished {
            eprintln!("lantern serve: shutdown deadline passed: cancelling {left} requests");
            let _ = shared.cancel.send(true);
            wait_for_no_requests(&shared, Instant::now() + FINAL_WRITE).await;
        }
        // Let the engine take the cancellations and free the pages, then stop it.
        let client = shared.client.clone();
        let t0 = Instant::now();
        while t0.elapsed() < FINAL_WRITE {
            let s = client.snapshot();
            if s.running == 0 && s.waiting == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        late.abort();
        let engine = tokio::task::spawn_blocking(move || worker.shutdown()).await.ok().flatten();
        let pages = engine.as_ref().map(|e| (e.model.kv.alloc.free_pages(), e.model.kv.alloc.total_pages()));
        eprintln!(
            "lantern serve: stopped ({} requests cancelled at the deadline; KV pages free: {})",
            if finished { 0 } else { left },
            pages.map_or_else(|| "unknown".to_string(), |(f, t)| format!("{f} of {t}"))
        );
        Ok(())
    }
}

/// Wait until no generation is in flight, or `deadline`; whether none is left.
async fn wait_for_no_requests(shared: &Shared, deadline: Instant) -> bool {
    loop {
        let notified = shared.idle.notified();
        if shared.in_flight.load(Ordering::SeqCst) == 0 {
            return true;
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return false;
        }
        let _ = tokio::time::timeout(left.min(Duration::from_millis(200)), notified).await;
    }
}

async fn shutdown_signal() -> &'static str {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => tokio::select! {
                _ = tokio::signal::ctrl_c() => "SIGINT",
                _ = term.recv() => "SIGTERM",
            },
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
                "SIGINT"
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
        "Ctrl-C"
    }
}

/// Bind `host:port` (the first of its addresses that binds).
pub async fn bind(host: &str, port: u16) -> Result<TcpListener> {
    let h = host.trim_start_matches('[').trim_end_matches(']');
    let addrs: Vec<SocketAddr> = tokio::net::lookup_host((h, port)).await.with_context(|| format!("resolving --host {host}"))?.collect();
    let mut last = None;
    for a in &addrs {
        match TcpListener::bind(a).await {
            Ok(l) => return Ok(l),
            Err(e) => last = Some(anyhow!("binding {a}: {e}")),
        }
    }
    Err(last.unwrap_or_else(|| anyhow!("--host {host} resolves to no address")))
}

/// While the model loads: every request gets 503 (`/health` says `loading`; the rest a
/// `model_loading` error with `Retry-After`), each with `Connection: close` so that a client
/// comes back on a fresh connection once the server is ready. Ends when `ready` turns true,
/// handing the listener back.
pub async fn serve_loading(listener: TcpListener, mut ready: watch::Receiver<bool>) -> TcpListener {
    let service = hyper::service::service_fn(|req: Request<Incoming>| async move {
        let r = if req.uri().path() == "/health" || req.uri().path() == "/healthz" {
            json_response(StatusCode::SERVICE_UNAVAILABLE, serde_json::json!({"status": "loading"}).to_string())
        } else {
            api_error(ApiError::new(503, "server_error", "the model is still loading; retry shortly").code("model_loading").retry_after())
        };
        let mut r = r;
        r.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
        Ok::<_, std::convert::Infallible>(r)
    });
    loop {
        tokio::select! {
            // (The guard `wait_for` returns must not live across the select's awaits.)
            _ = async { let _ = ready.wait_for(|r| *r).await; } => return listener,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    let conn = hyper::server::conn::http1::Builder::new()
                        .timer(TokioTimer::new())
                        .header_read_timeout(Duration::from_secs(10))
                        .keep_alive(false)
                        .serve_connection(TokioIo::new(stream), service);
                    tokio::spawn(async move {
                        let _ = tokio::time::timeout(Duration::from_secs(30), conn).await;
                    });
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            },
        }
    }
}

/// Removes a connection from the registry when its task ends.
struct ConnGuard(Arc<Shared>, u64);

impl Drop for ConnGuard {
    fn drop(&mut self) {
        self.0.forget(self.1);
    }
}

fn accept(shared: &Arc<Shared>, router: &Router, stream: TcpStream, mut drain: watch::Receiver<bool>) {
    let _ = stream.set_nodelay(true);
    let Some(slot) = shared.admit() else {
        tokio::spawn(reject_busy(shared.clone(), stream));
        return;
    };
    let shared = shared.clone();
    let router = router.clone();
    tokio::spawn(async move {
        let _guard = ConnGuard(shared.clone(), slot.id);
        let conn_ext = Conn(slot.clone());
        let sh = shared.clone();
        let service = hyper::service::service_fn(move |req: Request<Incoming>| {
            let (sh, router, conn_ext) = (sh.clone(), router.clone(), conn_ext.clone());
            async move { Ok::<_, std::convert::Infallible>(handle(sh, router, conn_ext, req).await) }
        });
        let mut builder = hyper::server::conn::http1::Builder::new();
        builder
            .timer(TokioTimer::new())
            .header_read_timeout(shared.read_timeout)
            .max_buf_size(MAX_HEADER_BYTES)
            .max_headers(MAX_HEADERS)
            .keep_alive(true);
        let conn = builder.serve_connection(TokioIo::new(stream), service);
        tokio::pin!(conn);
        let draining = *drain.borrow();
        if draining {
            conn.as_mut().graceful_shutdown();
        }
        tokio::select! {
            _ = conn.as_mut() => return,
            _ = slot.evict.notified() => return,
            _ = drain.wait_for(|d| *d), if !draining => {}
        }
        // Shutting down: no new requests on this connection; the one in flight finishes.
        conn.as_mut().graceful_shutdown();
        tokio::select! {
            _ = conn.as_mut() => {}
            _ = slot.evict.notified() => {}
        }
    });
}

/// 503 to a connection beyond the cap when every connection is busy.
async fn reject_busy(shared: Arc<Shared>, mut stream: TcpStream) {
    shared.metrics().outcome("too_many_connections");
    shared.metrics().http("other", 503);
    let e = ApiError::new(
        503,
        "server_overloaded",
        format!(
            "too many connections: the server holds {} at most (--max-connections) and every one has a request in flight; retry shortly",
            shared.max_connections
        ),
    )
    .code("too_many_connections")
    .retry_after();
    let body = e.body();
    let head = format!(
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: {}\r\nRetry-After: {}\r\nConnection: close\r\n\r\n",
        body.len(),
        lantern::api::RETRY_AFTER_S
    );
    let write = async {
        stream.write_all(head.as_bytes()).await?;
        stream.write_all(body.as_bytes()).await?;
        stream.shutdown().await
    };
    let _ = tokio::time::timeout(REJECT_WRITE, write).await;
    // Let the client read the answer before the socket closes under its unread request.
    let mut buf = [0u8; 4096];
    let drain = async {
        use tokio::io::AsyncReadExt as _;
        while stream.read(&mut buf).await.is_ok_and(|n| n > 0) {}
    };
    let _ = tokio::time::timeout(REJECT_WRITE, drain).await;
}

// ---------------------------------------------------------------------------------------
// Requests
// ---------------------------------------------------------------------------------------

/// The route label of a path for metrics (`other` for unknown paths).
fn route_label(path: &str) -> &'static str {
    match path {
        "/health" | "/healthz" => "/health",
        "/v1/models" => "/v1/models",
        p if p.starts_with("/v1/models/") => "/v1/models/{id}",
        "/v1/completions" => "/v1/completions",
        "/v1/chat/completions" => "/v1/chat/completions",
        "/metrics" => "/metrics",
        "/v1/messages" => "/v1/messages",
        "/v1/responses" => "/v1/responses",
        "/tokenize" => "/tokenize",
        "/detokenize" => "/detokenize",
        "/v1/embeddings" => "/v1/embeddings",
        "/api/embed" => "/api/embed",
        "/api/embeddings" => "/api/embeddings",
        "/api/chat" => "/api/chat",
        "/api/generate" => "/api/generate",
        "/api/tags" => "/api/tags",
        "/api/show" => "/api/show",
        "/api/ps" => "/api/ps",
        "/api/version" => "/api/version",
        "/version" => "/version",
        _ => "other",
    }
}

/// Every request: the key, the router, the access log and counters.
async fn handle(shared: Arc<Shared>, router: Router, conn: Conn, mut req: Request<Incoming>) -> Response {
    let t0 = Instant::now();
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let route = route_label(&path);
    let response = if shared.draining.load(Ordering::SeqCst) && route != "/metrics" {
        draining(route)
    } else if route != "/health" && !authorized(&shared, req.headers()) {
        // The same answer for a missing and a wrong key, and for routes that do not exist.
        api_error(ApiError::new(401, "authentication_error", "unauthorized").code("invalid_api_key").header("WWW-Authenticate", "Bearer"))
    } else {
        req.extensions_mut().insert(conn);
        match router.oneshot(req.map(Body::new)).await {
            Ok(r) => r,
            Err(never) => match never {},
        }
    };
    let status = response.status().as_u16();
    shared.metrics().http(route, status);
    if !shared.quiet {
        eprintln!("{method} {path} {status} {:.0} ms", t0.elapsed().as_secs_f64() * 1e3);
    }
    response
}

/// A request that arrives while the server drains: /health says so, the rest get 503 with
/// `Retry-After` and `Connection: close`, so a router retries them on another replica.
fn draining(route: &str) -> Response {
    if route == "/health" {
        return json_response(StatusCode::SERVICE_UNAVAILABLE, serde_json::json!({"status": "draining"}).to_string());
    }
    let e = ApiError::new(503, "server_error", "the server is shutting down and takes no new requests; retry on another replica")
        .code("server_shutting_down")
        .retry_after()
        .header("Connection", "close");
    if route.starts_with("/api/") {
        ollama::error(e)
    } else if route == "/v1/messages" {
        anthropic::error(e)
    } else {
        api_error(e)
    }
}

/// `POST /tokenize`: the ids of a prompt or of chat messages (vLLM's shape).
async fn tokenize(State(shared): State<Arc<Shared>>, headers: HeaderMap, body: Body) -> Response {
    match read_body(&shared, &headers, body).await.and_then(|b| lantern::api::tokenize::tokenize(&shared.model, &b)) {
        Ok(v) => json_response(StatusCode::OK, v.to_string()),
        Err(e) => api_error(e),
    }
}

/// `POST /detokenize`: the text of ids.
async fn detokenize(State(shared): State<Arc<Shared>>, headers: HeaderMap, body: Body) -> Response {
    match read_body(&shared, &headers, body).await.and_then(|b| lantern::api::tokenize::detokenize(&shared.model, &b)) {
        Ok(v) => json_response(StatusCode::OK, v.to_string()),
        Err(e) => api_error(e),
    }
}

/// An [`ApiError`] as a response.
pub fn api_error(e: ApiError) -> Response {
    let body = e.body();
    error_response(&e, body)
}

/// An [`ApiError`]'s status and headers with `body`, its text in some API's error shape
/// (OpenAI's [`ApiError::body`], Ollama's, Anthropic's).
pub fn error_response(e: &ApiError, body: String) -> Response {
    let mut r = (StatusCode::from_u16(e.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR), body).into_response();
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    for (name, value) in &e.headers {
        if let Ok(v) = HeaderValue::from_str(value) {
            h.insert(*name, v);
        }
    }
    r
}

pub fn json_response(status: StatusCode, body: String) -> Response {
    (status, [(header::CONTENT_TYPE, "application/json")], body).into_response()
}

fn router(shared: Arc<Shared>) -> Router {
    const GET: &str = "GET, HEAD";
    Router::new()
        .route("/health", get(health).fallback(refuse(GET)))
        .route("/healthz", get(health).fallback(refuse(GET)))
        .route("/v1/models", get(models).fallback(refuse(GET)))
        .route("/v1/models/{*id}", get(model).fallback(refuse(GET)))
        .route("/metrics", get(metrics_text).fallback(refuse(GET)))
        .route("/v1/completions", post(bridge::completions).fallback(refuse("POST")))
        .route("/v1/chat/completions", post(bridge::chat).fallback(refuse("POST")))
        .route("/v1/messages", post(anthropic::messages).fallback(refuse("POST")))
        .route("/v1/responses", post(responses::create).fallback(refuse("POST")))
        .route("/tokenize", post(tokenize).fallback(refuse("POST")))
        .route("/v1/embeddings", post(embeddings::openai).fallback(refuse("POST")))
        .route("/api/embed", post(embeddings::ollama).fallback(refuse("POST")))
        .route("/api/embeddings", post(embeddings::ollama_legacy).fallback(refuse("POST")))
        .route("/detokenize", post(detokenize).fallback(refuse("POST")))
        .route("/api/chat", post(ollama::chat).fallback(refuse("POST")))
        .route("/api/generate", post(ollama::generate).fallback(refuse("POST")))
        .route("/api/tags", get(ollama::tags).fallback(refuse(GET)))
        .route("/api/show", post(ollama::show).fallback(refuse("POST")))
        .route("/api/ps", get(ollama::ps).fallback(refuse(GET)))
        .route("/api/version", get(ollama::version).fallback(refuse(GET)))
        // vLLM's version probe, the same body: routers that find it (SGLang's gateway) treat the
        // replica as vLLM-compatible and read its load from the vLLM-named metrics.
        .route("/version", get(ollama::version).fallback(refuse(GET)))
        .fallback(|req: Request<Body>| async move {
            api_error(ApiError::new(404, "invalid_request_error", format!("no route {}", req.uri().path())).code("not_found"))
        })
        .with_state(shared)
}

/// The handler for a route's other methods: 405 with `Allow`.
fn refuse(allowed: &'static str) -> impl Fn(Method) -> std::future::Ready<Response> + Clone + Send + Sync + 'static {
    move |m: Method| std::future::ready(method_not_allowed(&m, allowed))
}

fn method_not_allowed(method: &Method, allowed: &'static str) -> Response {
    api_error(
        ApiError::new(405, "invalid_request_error", format!("{method} is not allowed here (allowed: {allowed})"))
            .code("method_not_allowed")
            .header("Allow", allowed),
    )
}

fn model_object(shared: &Shared) -> serde_json::Value {
    // `max_model_len` as vLLM lists it: routers (SGLang's gateway) read a replica's context from it.
    serde_json::json!({
        "id": shared.model.model_id,
        "object": "model",
        "created": shared.created,
        "owned_by": "lantern",
        "max_model_len": shared.model.context,
    })
}

async fn health(State(shared): State<Arc<Shared>>) -> Response {
    let s = shared.client.snapshot();
    if shared.engine_down.load(Ordering::SeqCst) {
        let body = serde_json::json!({"status": "engine stopped", "last_error": s.last_error});
        return json_response(StatusCode::SERVICE_UNAVAILABLE, body.to_string());
    }
    let body = serde_json::json!({
        "status": "ok",
        "model": shared.model.model_id,
        "running": s.running,
        "waiting": s.waiting,
        "kv_pages_free": s.kv_pages_free,
        "kv_pages_total": s.kv_pages_total,
    });
    json_response(StatusCode::OK, body.to_string())
}

async fn models(State(shared): State<Arc<Shared>>) -> Response {
    json_response(StatusCode::OK, serde_json::json!({"object": "list", "data": [model_object(&shared)]}).to_string())
}

async fn model(State(shared): State<Arc<Shared>>, Path(id): Path<String>) -> Response {
    if shared.model.knows_model(&id) {
        json_response(StatusCode::OK, model_object(&shared).to_string())
    } else {
        api_error(model_not_found(&id))
    }
}

async fn metrics_text(State(shared): State<Arc<Shared>>) -> Response {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], metrics::render(&shared)).into_response()
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

/// The key from `Authorization: Bearer KEY` (OpenAI's and Ollama's clients) or `x-api-key`
/// (Anthropic's).
fn authorized(shared: &Shared, headers: &HeaderMap) -> bool {
    let Some(want) = &shared.key_hash else { return true };
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(bearer)
        .or_else(|| headers.get("x-api-key").and_then(|v| v.to_str().ok()).map(str::trim));
    // Hashing first makes the comparison independent of the key's length and content.
    let got = given.map(sha256).unwrap_or([0; 32]);
    ct_eq(&got, want) && given.is_some()
}

/// The request body, read within the read deadline: 413 when it is declared or turns out
/// larger than [`MAX_BODY`], 408 when it does not arrive in time.
pub async fn read_body(shared: &Shared, headers: &HeaderMap, body: Body) -> std::result::Result<axum::body::Bytes, ApiError> {
    use http_body_util::BodyExt as _;
    let too_large = || {
        ApiError::new(413, "invalid_request_error", format!("the request body is larger than {MAX_BODY} bytes"))
            .code("request_too_large")
            .header("Connection", "close")
    };
    let declared = headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.trim().parse::<u64>().ok());
    if declared.is_some_and(|n| n > MAX_BODY as u64) {
        return Err(too_large());
    }
    let limited = http_body_util::Limited::new(body, MAX_BODY);
    match tokio::time::timeout(shared.read_timeout, limited.collect()).await {
        Err(_) => Err(ApiError::new(
            408,
            "invalid_request_error",
            format!("the request body did not arrive within {} s (--read-timeout)", shared.read_timeout.as_secs()),
        )
        .code("request_timeout")
        .header("Connection", "close")),
        Ok(Err(e)) if e.downcast_ref::<http_body_util::LengthLimitError>().is_some() => Err(too_large()),
        Ok(Err(e)) => {
            Err(ApiError::bad(format!("the request body could not be read: {e}")).code("bad_request").header("Connection", "close"))
        }
        Ok(Ok(c)) => Ok(c.to_bytes()),
    }
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
    fn routes() {
        assert_eq!(route_label("/healthz"), "/health");
        assert_eq!(route_label("/v1/models/a/b"), "/v1/models/{id}");
        assert_eq!(route_label("/v2"), "other");
    }
}

//! Ollama's API on `lantern serve`, for the clients that speak it (the `ollama` libraries,
//! Open WebUI, editor plugins): `POST /api/chat` and `POST /api/generate` (one JSON object,
//! or newline-delimited JSON while tokens arrive), `GET /api/tags`, `POST /api/show`,
//! `GET /api/ps` and `GET /api/version`. Requests are translated and validated by
//! `lantern::api::ollama` and run through the same engine submission as the OpenAI
//! routes ([`bridge::submit`]): same admission, deadlines, cancellation when the client goes
//! away, and metrics. Errors are Ollama's `{"error": "..."}` (a streamed request that fails
//! after its first line ends with such a line).

use std::sync::Arc;
use std::time::SystemTime;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Extension;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use lantern::api::ollama::{self, Generate};
use lantern::api::tools::StreamPiece;
use lantern::api::ApiError;
use lantern::engine::Event;

use super::bridge::{self, Wait};
use super::transport::{error_response, read_body, Conn, Shared};

/// Lines a stream buffers ahead of a slow client.
const STREAM_BUFFER: usize = 64;

/// What `/api/tags`, `/api/show` and `/api/ps` say of the served model.
#[derive(Debug, Clone, Default)]
pub struct ModelInfo {
    /// `gguf` or `safetensors`.
    pub format: &'static str,
    /// GGUF's `general.architecture` (llama, qwen2, gemma3, ...).
    pub family: String,
    pub parameters: u64,
    /// The tensor type holding most of the weights' bytes (Q4_K, Q4_1, F16, ...).
    pub quantization: String,
    /// Bytes of the model file(s).
    pub size: u64,
    /// RFC 3339.
    pub modified_at: String,
    /// GGUF-style `model_info` keys (`general.*`, `<arch>.context_length`, ...).
    pub model_info: serde_json::Map<String, Value>,
    /// Bytes of weights, KV cache and workspace on the GPU.
    pub gpu_bytes: u64,
}

pub fn rfc3339(t: SystemTime) -> String {
    humantime::format_rfc3339_nanos(t).to_string()
}

fn now() -> String {
    rfc3339(SystemTime::now())
}

/// An error as Ollama's client reads it.
pub fn error(e: ApiError) -> Response {
    let body = ollama::error_body(&e);
    error_response(&e, body)
}

fn reject(shared: &Shared, e: ApiError) -> Response {
    shared.metrics().outcome("rejected");
    error(e)
}

fn json(status: StatusCode, v: &Value) -> Response {
    (status, [(header::CONTENT_TYPE, "application/json; charset=utf-8")], v.to_string()).into_response()
}

fn line(v: &Value) -> Bytes {
    let mut s = v.to_string();
    s.push('\n');
    Bytes::from(s)
}

fn ndjson(rx: mpsc::Receiver<Bytes>) -> Response {
    let mut rx = rx;
    let lines = futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx).map(|b| b.map(Ok::<_, std::convert::Infallible>)));
    let mut r = Response::new(Body::from_stream(lines));
    r.headers_mut().insert(header::CONTENT_TYPE, header::HeaderValue::from_static("application/x-ndjson"));
    r.headers_mut().insert("X-Accel-Buffering", header::HeaderValue::from_static("no"));
    r
}

pub async fn chat(State(shared): State<Arc<Shared>>, Extension(conn): Extension<Conn>, headers: HeaderMap, body: Body) -> Response {
    let bytes = match read_body(&shared, &headers, body).await {
        Ok(b) => b,
        Err(e) => return reject(&shared, e),
    };
    match ollama::parse_chat(&shared.model, &bytes) {
        Ok(r) => run(shared, conn, r, "/api/chat").await,
        Err(e) => reject(&shared, e),
    }
}

pub async fn generate(State(shared): State<Arc<Shared>>, Extension(conn): Extension<Conn>, headers: HeaderMap, body: Body) -> Response {
    let bytes = match read_body(&shared, &headers, body).await {
        Ok(b) => b,
        Err(e) => return reject(&shared, e),
    };
    match ollama::parse_generate(&shared.model, &bytes) {
        Ok(Generate::Run(r)) => run(shared, conn, *r, "/api/generate").await,
        Ok(Generate::Load { stream }) => {
            let v = ollama::Job::load(&shared.model.model_id, &now());
            if stream {
                let (tx, rx) = mpsc::channel(1);
                let _ = tx.try_send(line(&v));
                ndjson(rx)
            } else {
                json(StatusCode::OK, &v)
            }
        }
        Err(e) => reject(&shared, e),
    }
}

async fn run(shared: Arc<Shared>, conn: Conn, r: ollama::Request, route: &'static str) -> Response {
    let mut run = match bridge::submit(&shared, &conn, &r.validated, route, "ollama").await {
        Ok(run) => run,
        Err(e) => return error(e),
    };
    let job = ollama::Job {
        model: shared.model.model_id.clone(),
        chat: r.chat,
        prompt_tokens: r.validated.prompt_ids.len(),
        id: run.job.id.clone(),
        tools: r.validated.tools.clone(),
        token_bytes: r.validated.logprobs.map(|_| shared.model.token_bytes()),
    };
    if !r.stream {
        loop {
            match run.next().await {
                Wait::Event(_, Event::Done(_)) => {
                    let gens = run.finished();
                    return json(StatusCode::OK, &job.done(&now(), &gens[0], true));
                }
                Wait::Event(..) => {}
                w => return error(run.fail(&w)),
            }
        }
    }
    let (tx, rx) = mpsc::channel::<Bytes>(STREAM_BUFFER);
    tokio::spawn(async move {
        // With tools, the text outside calls streams as it comes; the calls go whole in one
        // line at the end (Ollama's arguments are an object, not fragments).
        let openai_job = run.job.clone();
        let mut calls = openai_job.call_stream(0);
        loop {
            let w = tokio::select! {
                w = run.next() => w,
                _ = tx.closed() => return,
            };
            let (text, lp) = match w {
                Wait::Event(_, Event::Token { text, logprob, .. }) => (text, logprob),
                Wait::Event(_, Event::Text(text)) => (text, None),
                Wait::Event(_, Event::Done(g)) => {
                    if let Some(cs) = calls.take() {
                        for p in cs.finish() {
                            if let StreamPiece::Content(t) = p {
                                if tx.send(line(&job.delta(&now(), &t, &[]))).await.is_err() {
                                    return;
                                }
                            }
                        }
                        if let Some((_, made)) = job.calls(&g.text).filter(|(_, c)| !c.is_empty()) {
                            if tx.send(line(&job.calls_line(&now(), made))).await.is_err() {
                                return;
                            }
                        }
                    }
                    let gens = run.finished();
                    let _ = tx.send(line(&job.done(&now(), &gens[0], false))).await;
                    return;
                }
                w => {
                    let e = run.fail(&w);
                    let _ = tx.send(line(&json!({"error": e.message}))).await;
                    return;
                }
            };
            let lps = lp.as_deref().map(std::slice::from_ref).unwrap_or(&[]);
            let mut pieces: Vec<String> = match calls.as_mut() {
                Some(cs) => {
                    cs.push(&text).into_iter().filter_map(|p| if let StreamPiece::Content(t) = p { Some(t) } else { None }).collect()
                }
                None => vec![text],
            };
            if pieces.is_empty() {
                // A token inside a call: its log-probabilities still go out.
                pieces.push(String::new());
            }
            // A token's log-probabilities go with its first piece; a piece with neither text
            // nor log-probabilities is not sent.
            for (i, t) in pieces.iter().enumerate() {
                let lps = if i == 0 { lps } else { &[] };
                if t.is_empty() && lps.is_empty() {
                    continue;
                }
                if tx.send(line(&job.delta(&now(), t, lps))).await.is_err() {
                    return;
                }
            }
        }
    });
    ndjson(rx)
}

fn details(info: &ModelInfo) -> Value {
    json!({
        "parent_model": "",
        "format": info.format,
        "family": info.family,
        "families": [info.family],
        "parameter_size": parameter_size(info.parameters),
        "quantization_level": info.quantization,
    })
}

/// Ollama's way to write a parameter count: 135M, 1.5B.
pub fn parameter_size(n: u64) -> String {
    if n >= 1_000_000_000 {
        format!("{:.1}B", n as f64 / 1e9)
    } else {
        format!("{:.0}M", n as f64 / 1e6)
    }
}

fn entry(shared: &Shared) -> Value {
    let info = &shared.info;
    json!({
        "name": shared.model.model_id,
        "model": shared.model.model_id,
        "modified_at": info.modified_at,
        "size": info.size,
        "digest": "",
        "details": details(info),
    })
}

pub async fn tags(State(shared): State<Arc<Shared>>) -> Response {
    json(StatusCode::OK, &json!({ "models": [entry(&shared)] }))
}

/// The loaded models: this one, held until the server stops.
pub async fn ps(State(shared): State<Arc<Shared>>) -> Response {
    let mut e = entry(&shared);
    e["size_vram"] = json!(shared.info.gpu_bytes);
    e["context_length"] = json!(shared.model.context);
    json(StatusCode::OK, &json!({ "models": [e] }))
}

pub async fn version() -> Response {
    json(StatusCode::OK, &json!({ "version": env!("CARGO_PKG_VERSION") }))
}

#[derive(serde::Deserialize)]
struct ShowBody {
    #[serde(default)]
    model: Option<String>,
    /// The older name of `model`.
    #[serde(default)]
    name: Option<String>,
}

pub async fn show(State(shared): State<Arc<Shared>>, headers: HeaderMap, body: Body) -> Response {
    let bytes = match read_body(&shared, &headers, body).await {
        Ok(b) => b,
        Err(e) => return error(e),
    };
    let b: ShowBody = match serde_json::from_slice(&bytes) {
        Ok(b) => b,
        Err(e) => return error(ApiError::bad(format!("the request body is not a JSON object with `model`: {e}"))),
    };
    let Some(m) = b.model.or(b.name).filter(|m| !m.is_empty()) else {
        return error(ApiError::bad("model is required").param("model"));
    };
    if !ollama::knows_model(&shared.model, &m) {
        return error(ApiError::new(
            404,
            "not_found_error",
            format!("model {m:?} not found: this server serves {:?}", shared.model.model_id),
        ));
    }
    let info = &shared.info;
    let template = shared.model.tokenizer.chat_template_source().unwrap_or_default().to_string();
    let mut capabilities = vec!["completion"];
    if shared.model.template.is_ok() {
        // Tools work with any chat template: one that does not take them gets them in the
        // system message.
        capabilities.push("tools");
    }
    json(
        StatusCode::OK,
        &json!({
            "modelfile": "",
            "parameters": "",
            "template": template,
            "details": details(info),
            "model_info": info.model_info,
            "capabilities": capabilities,
            "modified_at": info.modified_at,
        }),
    )
}

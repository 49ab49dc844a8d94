//! `POST /v1/embeddings` (OpenAI), `POST /api/embed` and `POST /api/embeddings` (Ollama):
//! every input is validated first (`lantern::api::embeddings`), then embedded on the
//! engine thread between decode steps, one input after another; the connection counts as
//! busy meanwhile, so a draining server finishes it.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::extract::{Extension, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;

use lantern::api::embeddings::{self as emb, EmbedRequest};
use lantern::api::ApiError;
use lantern::LanternError;

use super::ollama;
use super::transport::{api_error, json_response, read_body, BusyGuard, Conn, Shared};

/// Embed every input of `r` in order: the vectors, or the error that stopped them.
async fn run(shared: &Arc<Shared>, conn: &Conn, r: &EmbedRequest) -> Result<Vec<Vec<f32>>, ApiError> {
    let _busy = BusyGuard::new(conn.0.clone(), shared.clone());
    let mut out = Vec::with_capacity(r.inputs.len());
    for (i, tokens) in r.inputs.iter().enumerate() {
        let client = shared.client.clone();
        let (tokens, pooling) = (tokens.clone(), r.pooling);
        let v = tokio::task::spawn_blocking(move || client.embed(tokens, pooling).map_err(Box::new))
            .await
            .map_err(|e| ApiError::new(500, "server_error", format!("embedding input {i} failed: {e}")).code("engine_error"))?;
        match v {
            Ok(v) => out.push(v),
            Err(e) => {
                shared.metrics().outcome("error");
                return Err(engine_error(shared, i, *e));
            }
        }
    }
    Ok(out)
}

fn engine_error(shared: &Shared, i: usize, e: LanternError) -> ApiError {
    match e {
        LanternError::Kv(k) => ApiError::bad(format!("input {i} can never fit the server's KV cache: {k}")).code("kv_cache_too_small"),
        m @ LanternError::EngineStopped => {
            shared.engine_down.store(true, std::sync::atomic::Ordering::SeqCst);
            ApiError::new(503, "server_error", format!("{m}; the server cannot take requests")).code("engine_stopped").retry_after()
        }
        e => ApiError::new(500, "server_error", format!("embedding input {i} failed: {e}")).code("engine_error"),
    }
}

/// `POST /v1/embeddings`.
pub async fn openai(State(shared): State<Arc<Shared>>, Extension(conn): Extension<Conn>, headers: HeaderMap, body: Body) -> Response {
    let parsed = match read_body(&shared, &headers, body).await {
        Ok(b) => emb::parse_openai(&shared.model, &b, shared.embedding_pooling),
        Err(e) => Err(e),
    };
    let r = match parsed {
        Ok(r) => r,
        Err(e) => {
            shared.metrics().outcome("rejected");
            return api_error(e);
        }
    };
    match run(&shared, &conn, &r).await {
        Ok(v) => json_response(StatusCode::OK, emb::openai_response(&r, &v).to_string()),
        Err(e) => api_error(e),
    }
}

async fn ollama_route(shared: Arc<Shared>, conn: Conn, headers: HeaderMap, body: Body, legacy: bool) -> Response {
    let t0 = Instant::now();
    let parsed = match read_body(&shared, &headers, body).await {
        Ok(b) => emb::parse_ollama(&shared.model, &b, legacy, shared.embedding_pooling),
        Err(e) => Err(e),
    };
    let r = match parsed {
        Ok(r) => r,
        Err(e) => {
            shared.metrics().outcome("rejected");
            return ollama::error(e);
        }
    };
    match run(&shared, &conn, &r).await {
        Ok(v) => {
            let ns = t0.elapsed().as_nanos() as u64;
            json_response(StatusCode::OK, emb::ollama_response(&r, &v, legacy, ns).to_string())
        }
        Err(e) => ollama::error(e),
    }
}

/// `POST /api/embed`.
pub async fn ollama(State(shared): State<Arc<Shared>>, Extension(conn): Extension<Conn>, headers: HeaderMap, body: Body) -> Response {
    ollama_route(shared, conn, headers, body, false).await
}

/// `POST /api/embeddings` (Ollama's older route: one `prompt`, one `embedding`).
pub async fn ollama_legacy(
    State(shared): State<Arc<Shared>>,
    Extension(conn): Extension<Conn>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    ollama_route(shared, conn, headers, body, true).await
}

//! Anthropic's Messages API on `lantern serve` (`POST /v1/messages`), for the agent harnesses
//! and SDKs that speak it: translated and validated by `lantern::api::anthropic`, run
//! through the same engine submission as the other routes ([`bridge::submit`]), answered as
//! one Message or as Anthropic's typed events (`message_start`, `content_block_start`,
//! `content_block_delta` with `text_delta` or `input_json_delta`, `content_block_stop`,
//! `message_delta`, `message_stop`; an `error` event when it fails midway). Errors are
//! Anthropic's `{"type": "error", "error": {...}}`.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::sse::Event as SseEvent;
use axum::response::{IntoResponse, Response};
use axum::Extension;
use serde_json::Value;
use tokio::sync::mpsc;

use lantern::api::anthropic::{self, BlockStream};
use lantern::api::tools::StreamPiece;
use lantern::api::ApiError;
use lantern::engine::Event;

use super::bridge::{self, Wait};
use super::transport::{error_response, read_body, Conn, Shared};

const STREAM_BUFFER: usize = 64;

/// An error as Anthropic's clients read it.
pub fn error(e: ApiError) -> Response {
    let body = anthropic::error_body(&e);
    error_response(&e, body)
}

fn event(name: &'static str, data: &Value) -> SseEvent {
    SseEvent::default().event(name).data(data.to_string())
}

pub async fn messages(State(shared): State<Arc<Shared>>, Extension(conn): Extension<Conn>, headers: HeaderMap, body: Body) -> Response {
    let refuse = |e: ApiError| {
        shared.metrics().outcome("rejected");
        error(e)
    };
    let bytes = match read_body(&shared, &headers, body).await {
        Ok(b) => b,
        Err(e) => return refuse(e),
    };
    let r = match anthropic::parse(&shared.model, &bytes) {
        Ok(r) => r,
        Err(e) => return refuse(e),
    };
    let mut run = match bridge::submit(&shared, &conn, &r.validated, "/v1/messages", "msg").await {
        Ok(run) => run,
        Err(e) => return error(e),
    };
    let job = anthropic::Job {
        id: run.job.id.clone(),
        model: shared.model.model_id.clone(),
        prompt_tokens: r.validated.prompt_ids.len(),
        tools: r.validated.tools.clone(),
    };
    if !r.stream {
        loop {
            match run.next().await {
                Wait::Event(_, Event::Done(_)) => {
                    let gens = run.finished();
                    let body = job.message(&gens[0]).to_string();
                    return (StatusCode::OK, [(header::CONTENT_TYPE, "application/json")], body).into_response();
                }
                Wait::Event(..) => {}
                w => return error(run.fail(&w)),
            }
        }
    }
    let (tx, rx) = mpsc::channel::<SseEvent>(STREAM_BUFFER);
    let keepalive = shared.sse_keepalive;
    tokio::spawn(async move {
        let openai_job = run.job.clone();
        let mut calls = openai_job.call_stream(0);
        let mut blocks = BlockStream::default();
        for (name, data) in [("message_start", job.start()), ("ping", serde_json::json!({"type": "ping"}))] {
            if tx.send(event(name, &data)).await.is_err() {
                return;
            }
        }
        loop {
            let w = tokio::select! {
                w = run.next() => w,
                _ = tx.closed() => return,
            };
            let mut out = Vec::new();
            let mut push = |p: StreamPiece, out: &mut Vec<(&'static str, Value)>| match p {
                StreamPiece::Content(t) => out.extend(blocks.text(&t)),
                StreamPiece::Call(d) => out.extend(blocks.call(&d)),
            };
            match w {
                Wait::Event(_, Event::Token { text, .. } | Event::Text(text)) => match calls.as_mut() {
                    Some(cs) => cs.push(&text).into_iter().for_each(|p| push(p, &mut out)),
                    None => push(StreamPiece::Content(text), &mut out),
                },
                Wait::Event(_, Event::Done(_)) => {
                    if let Some(cs) = calls.take() {
                        cs.finish().into_iter().for_each(|p| push(p, &mut out));
                    }
                    out.extend(blocks.finish());
                    let gens = run.finished();
                    out.push(("message_delta", job.end(&gens[0], blocks.calls > 0)));
                    out.push(("message_stop", serde_json::json!({"type": "message_stop"})));
                    for (name, data) in out {
                        if tx.send(event(name, &data)).await.is_err() {
                            return;
                        }
                    }
                    return;
                }
                w => {
                    let e = run.fail(&w);
                    let data: Value = serde_json::from_str(&anthropic::error_body(&e)).unwrap_or_default();
                    let _ = tx.send(event("error", &data)).await;
                    return;
                }
            }
            for (name, data) in out {
                if tx.send(event(name, &data)).await.is_err() {
                    return;
                }
            }
        }
    });
    bridge::sse_response(rx, keepalive)
}

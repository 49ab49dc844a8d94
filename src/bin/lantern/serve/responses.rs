//! OpenAI's Responses API on `lantern serve` (`POST /v1/responses`), which coding agents
//! speak: translated and validated by `lantern::api::responses`, run through the same
//! engine submission as the other routes ([`bridge::submit`]), answered as one Response or
//! as the typed event sequence (`response.created`, `response.in_progress`, output items
//! opening, growing by `response.output_text.delta` / `response.function_call_arguments.delta`
//! and closing, then `response.completed` or `response.incomplete`; `error` when it fails
//! midway). Answered conversations are kept in a bounded in-memory store for
//! `previous_response_id` ([`Store`]) unless the request says `store: false`.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::Event as SseEvent;
use axum::response::Response;
use axum::Extension;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use lantern::api::responses::{self, OutputStream};
use lantern::api::tools::StreamPiece;
use lantern::engine::Event;

use super::bridge::{self, Wait};
use super::metrics::unix_now;
use super::transport::{api_error, json_response, read_body, Conn, Shared};

const STREAM_BUFFER: usize = 64;

/// Conversations kept at most; the oldest goes first.
pub const STORE_CAPACITY: usize = 512;

/// Answered conversations by response id, as input items, for `previous_response_id`.
#[derive(Default)]
pub struct Store(Mutex<VecDeque<(String, Arc<Vec<Value>>)>>);

impl Store {
    pub fn get(&self, id: &str) -> Option<Vec<Value>> {
        let s = self.0.lock().unwrap_or_else(|e| e.into_inner());
        s.iter().find(|(k, _)| k == id).map(|(_, v)| v.as_ref().clone())
    }

    fn put(&self, id: String, items: Vec<Value>) {
        let mut s = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if s.len() >= STORE_CAPACITY {
            s.pop_front();
        }
        s.push_back((id, Arc::new(items)));
    }
}

fn event(name: &'static str, data: &Value) -> SseEvent {
    SseEvent::default().event(name).data(data.to_string())
}

pub async fn create(State(shared): State<Arc<Shared>>, Extension(conn): Extension<Conn>, headers: HeaderMap, body: Body) -> Response {
    let bytes = match read_body(&shared, &headers, body).await {
        Ok(b) => b,
        Err(e) => return bridge::reject(&shared, e),
    };
    let r = match responses::parse(&shared.model, &bytes, |id| shared.responses.get(id)) {
        Ok(r) => r,
        Err(e) => return bridge::reject(&shared, e),
    };
    let mut run = match bridge::submit(&shared, &conn, &r.validated, "/v1/responses", "resp").await {
        Ok(run) => run,
        Err(e) => return api_error(e),
    };
    let job = responses::Job {
        id: run.job.id.clone(),
        created_at: unix_now(),
        model: shared.model.model_id.clone(),
        prompt_tokens: r.validated.prompt_ids.len(),
        tools: r.validated.tools.clone(),
        echo: r.echo.clone(),
    };
    let keep = |output: &[Value]| {
        if r.store {
            shared.responses.put(job.id.clone(), responses::conversation(r.items.clone(), output));
        }
    };
    if !r.stream {
        loop {
            match run.next().await {
                Wait::Event(_, Event::Done(_)) => {
                    let gens = run.finished();
                    let output = job.output(&gens[0]);
                    keep(&output);
                    let body = job.response(responses::Job::status(&gens[0]), output, Some(&gens[0]));
                    return json_response(StatusCode::OK, body.to_string());
                }
                Wait::Event(..) => {}
                w => return api_error(run.fail(&w)),
            }
        }
    }
    let (tx, rx) = mpsc::channel::<SseEvent>(STREAM_BUFFER);
    let keepalive = shared.sse_keepalive;
    let store = r.store.then(|| (shared.clone(), r.items.clone()));
    tokio::spawn(async move {
        let openai_job = run.job.clone();
        let mut calls = openai_job.call_stream(0);
        let mut out_stream = OutputStream::new(&job.id);
        let head = [
            out_stream.event("response.created", json!({"response": job.response("in_progress", Vec::new(), None)})),
            out_stream.event("response.in_progress", json!({"response": job.response("in_progress", Vec::new(), None)})),
        ];
        for (name, data) in head {
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
            let push = |p: StreamPiece, s: &mut OutputStream, out: &mut Vec<(&'static str, Value)>| match p {
                StreamPiece::Content(t) => out.extend(s.text(&t)),
                StreamPiece::Call(d) => out.extend(s.call(&d)),
            };
            match w {
                Wait::Event(_, Event::Token { text, .. } | Event::Text(text)) => match calls.as_mut() {
                    Some(cs) => cs.push(&text).into_iter().for_each(|p| push(p, &mut out_stream, &mut out)),
                    None => push(StreamPiece::Content(text), &mut out_stream, &mut out),
                },
                Wait::Event(_, Event::Done(_)) => {
                    if let Some(cs) = calls.take() {
                        cs.finish().into_iter().for_each(|p| push(p, &mut out_stream, &mut out));
                    }
                    out.extend(out_stream.finish());
                    let gens = run.finished();
                    let status = responses::Job::status(&gens[0]);
                    if let Some((shared, items)) = &store {
                        shared.responses.put(job.id.clone(), responses::conversation(items.clone(), &out_stream.items));
                    }
                    let last = job.response(status, out_stream.items.clone(), Some(&gens[0]));
                    let kind = if status == "completed" { "response.completed" } else { "response.incomplete" };
                    out.push(out_stream.event(kind, json!({ "response": last })));
                    for (name, data) in out {
                        if tx.send(event(name, &data)).await.is_err() {
                            return;
                        }
                    }
                    return;
                }
                w => {
                    let e = run.fail(&w);
                    let (_, data) = out_stream.event("error", json!({"code": e.code, "message": e.message, "param": e.param}));
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_store_is_bounded() {
        let s = Store::default();
        for i in 0..STORE_CAPACITY + 3 {
            s.put(format!("r{i}"), vec![json!(i)]);
        }
        assert!(s.get("r0").is_none() && s.get("r2").is_none());
        assert_eq!(s.get("r3"), Some(vec![json!(3)]));
        assert_eq!(s.get(&format!("r{}", STORE_CAPACITY + 2)), Some(vec![json!(STORE_CAPACITY + 2)]));
    }
}

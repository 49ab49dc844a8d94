//! From a validated OpenAI request to the engine worker and back: submission (the engine's
//! refusals become 4xx/429/503 at once), then the request's events as one JSON answer or as
//! server-sent events. A request ends early when its deadline passes (`--request-timeout`:
//! 504 or an error event), when the shutdown's deadline passes (503 or an error event), or
//! when its client goes away: the stream's body is dropped by hyper, the task driving it sees
//! its channel closed, and dropping the [`RequestHandle`] cancels the request in the engine,
//! which frees its KV pages at its next step.

use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Extension;
use tokio::sync::mpsc;

use lantern::api::{self, ApiError, Endpoint, Job, Validated};
use lantern::engine::{Event, Generation, RequestHandle};
use lantern::kv::KvError;
use lantern::LanternError;

use super::metrics::{random_u64, unix_now};
use super::transport::{api_error, json_response, read_body, BusyGuard, Conn, Shared};

/// Events a stream buffers ahead of a slow client.
const STREAM_BUFFER: usize = 64;

pub async fn completions(s: State<Arc<Shared>>, c: Extension<Conn>, h: HeaderMap, b: Body) -> Response {
    generate(s, c, h, b, Endpoint::Completions).await
}

pub async fn chat(s: State<Arc<Shared>>, c: Extension<Conn>, h: HeaderMap, b: Body) -> Response {
    generate(s, c, h, b, Endpoint::Chat).await
}

async fn generate(
    State(shared): State<Arc<Shared>>,
    Extension(conn): Extension<Conn>,
    headers: HeaderMap,
    body: Body,
    endpoint: Endpoint,
) -> Response {
    let bytes = match read_body(&shared, &headers, body).await {
        Ok(b) => b,
        Err(e) => return reject(&shared, e),
    };
    let v = match api::parse_request(&shared.model, endpoint, &bytes) {
        Ok(v) => v,
        Err(e) => return reject(&shared, e),
    };
    let run = match submit(&shared, &conn, &v, endpoint.path(), if endpoint == Endpoint::Chat { "chatcmpl" } else { "cmpl" }).await {
        Ok(r) => r,
        Err(e) => return api_error(e),
    };
    if v.stream {
        stream(run, v.include_usage)
    } else {
        whole(run).await
    }
}

/// A request refused before submission: counted, and its error as a response.
pub fn reject(shared: &Shared, e: ApiError) -> Response {
    shared.metrics().outcome("rejected");
    api_error(e)
}

/// Submit a validated request to the engine (waiting for the engine thread to take it,
/// between two steps): the [`Run`] that follows it, or the refusal (its outcome counted).
/// `route` labels it in the metrics; `whole`: nothing is sent before the end.
pub async fn submit(shared: &Arc<Shared>, conn: &Conn, v: &Validated, route: &'static str, id_prefix: &str) -> Result<Run, ApiError> {
    let req = v.request(&shared.model, random_u64());
    let client = shared.client.clone();
    let n = v.n;
    let handles = match tokio::task::spawn_blocking(move || client.submit_n(req, n).map_err(Box::new)).await {
        Ok(Ok(h)) => h,
        Ok(Err(e)) => {
            let (err, outcome) = submit_error(shared, *e);
            shared.metrics().outcome(outcome);
            return Err(err);
        }
        Err(e) => {
            shared.metrics().outcome("error");
            return Err(ApiError::new(500, "server_error", format!("submitting the request failed: {e}")).code("engine_error"));
        }
    };
    let job = Job {
        id: shared.new_id(id_prefix),
        created: unix_now(),
        endpoint: v.endpoint,
        model: shared.model.model_id.clone(),
        prompt_tokens: v.prompt_ids.len(),
        token_bytes: v.logprobs.map(|_| shared.model.token_bytes()),
        tools: v.tools.clone(),
    };
    Ok(Run::new(shared.clone(), handles, job, route, BusyGuard::new(conn.0.clone(), shared.clone()), !v.stream))
}

/// The engine's refusal of a request as an HTTP error, and its outcome label.
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
        e @ LanternError::Constraint { .. } => (
            ApiError::bad(format!("the response_format's grammar does not compile: {e}")).param("response_format").code("invalid_schema"),
            "rejected",
        ),
        other => (ApiError::bad(other.to_string()), "rejected"),
    }
}

/// What waiting for a request's next event gave.
pub enum Wait {
    /// An event of choice `.0`.
    Event(usize, Event),
    /// An event stream ended without `Done` (the engine stopped).
    Ended,
    /// `--request-timeout` passed (seconds).
    TimedOut(u64),
    /// The shutdown's deadline passed.
    Shutdown,
}

/// An accepted request (its `n` choices) while its answer is produced. Dropped before its
/// end (the client went away), it cancels every choice.
pub struct Run {
    shared: Arc<Shared>,
    /// The route, for the metrics.
    route: &'static str,
    /// Every choice's events, tagged with its index (`None`: that stream ended).
    events: mpsc::UnboundedReceiver<(usize, Option<Event>)>,
    cancels: Vec<Arc<AtomicBool>>,
    pub job: Job,
    started: Instant,
    /// Finished choices so far (by index).
    done: Vec<Option<Generation>>,
    /// An outcome was recorded.
    ended: bool,
    /// The answer is one JSON object (nothing is sent before the end).
    whole: bool,
    _busy: BusyGuard,
}

impl Drop for Run {
    fn drop(&mut self) {
        if !self.ended {
            self.cancel();
            let mut m = self.shared.metrics();
            m.outcome("cancelled");
            if self.whole {
                // No status went out: counted as nginx's 499 (client closed request).
                m.http(self.route, 499);
            }
        }
    }
}

impl Run {
    fn new(shared: Arc<Shared>, handles: Vec<RequestHandle>, job: Job, route: &'static str, busy: BusyGuard, whole: bool) -> Run {
        let (tx, events) = mpsc::unbounded_channel();
        let cancels = handles.iter().map(RequestHandle::cancel_flag).collect();
        let n = handles.len();
        for (i, mut h) in handles.into_iter().enumerate() {
            let tx = tx.clone();
            // Ends with its stream, or when the run is gone (dropping the handle cancels it).
            tokio::spawn(async move {
                loop {
                    let e = h.next().await;
                    let end = e.is_none();
                    if tx.send((i, e)).is_err() || end {
                        break;
                    }
                }
            });
        }
        Run { shared, route, events, cancels, job, started: Instant::now(), done: vec![None; n], ended: false, whole, _busy: busy }
    }

    fn cancel(&self) {
        for c in &self.cancels {
            c.store(true, Ordering::Relaxed);
        }
    }

    fn all_done(&self) -> bool {
        self.done.iter().all(Option::is_some)
    }

    /// The generations of every choice once all are done (their outcomes recorded).
    pub fn finished(&mut self) -> Vec<Generation> {
        self.ended = true;
        let gens: Vec<Generation> = self.done.iter_mut().filter_map(Option::take).collect();
        let mut m = self.shared.metrics();
        for (i, g) in gens.iter().enumerate() {
            m.finished(g, if i == 0 { self.job.prompt_tokens } else { 0 });
        }
        gens
    }

    pub async fn next(&mut self) -> Wait {
        let mut cancel = self.shared.cancel.subscribe();
        let timeout = self.shared.request_timeout;
        let started = self.started;
        let deadline = async move {
            match timeout {
                Some(t) => tokio::time::sleep_until((started + t).into()).await,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(deadline);
        let w = loop {
            break tokio::select! {
                e = self.events.recv() => match e {
                    Some((i, Some(e))) => Wait::Event(i, e),
                    // A finished choice's stream ends after its `Done`.
                    Some((i, None)) if self.done[i].is_some() => continue,
                    Some((_, None)) | None => Wait::Ended,
                },
                _ = &mut deadline => Wait::TimedOut(timeout.map_or(0, |t| t.as_secs())),
                _ = cancel.wait_for(|c| *c) => Wait::Shutdown,
            };
        };
        match &w {
            Wait::Event(i, Event::Done(g)) => self.done[*i] = Some((**g).clone()),
            Wait::Event(..) => {}
            _ => self.cancel(),
        }
        w
    }

    /// Record the outcome of a request that ends without `Done`, and the error it ends with.
    pub fn fail(&mut self, w: &Wait) -> ApiError {
        self.ended = true;
        self.cancel();
        let (outcome, e) = match w {
            Wait::Event(_, Event::Error(m)) => {
                ("error", ApiError::new(500, "server_error", format!("generation failed: {m}")).code("engine_error"))
            }
            Wait::TimedOut(s) => (
                "timeout",
                ApiError::new(504, "server_error", format!("the request did not finish within {s} s (--request-timeout)")).code("timeout"),
            ),
            Wait::Shutdown => (
                "shutdown",
                ApiError::new(503, "server_error", "the server is shutting down and cancelled this request").code("server_shutdown"),
            ),
            _ => {
                self.shared.engine_down.store(true, Ordering::SeqCst);
                ("unavailable", ApiError::new(503, "server_error", "the engine stopped before the request finished").code("engine_stopped"))
            }
        };
        self.shared.metrics().outcome(outcome);
        e
    }
}

/// The whole answer as one JSON object.
async fn whole(mut run: Run) -> Response {
    loop {
        match run.next().await {
            Wait::Event(_, Event::Done(_)) if run.all_done() => {
                let gens = run.finished();
                let body = serde_json::to_string(&run.job.complete(&gens)).unwrap_or_default();
                return json_response(StatusCode::OK, body);
            }
            Wait::Event(_, Event::Token { .. } | Event::Text(_) | Event::Done(_)) => {}
            w => return api_error(run.fail(&w)),
        }
    }
}

fn data<T: serde::Serialize>(v: &T) -> SseEvent {
    SseEvent::default().data(serde_json::to_string(v).unwrap_or_default())
}

/// Server-sent events: a task drives the request and feeds the body through a channel, so a
/// client that goes away (hyper drops the body) ends the task and cancels the request.
fn stream(mut run: Run, include_usage: bool) -> Response {
    let (tx, rx) = mpsc::channel::<SseEvent>(STREAM_BUFFER);
    let keepalive = run.shared.sse_keepalive;
    tokio::spawn(async move {
        // The job outlives the task's borrows of `run`: the chunker owns a clone.
        let mut chunks = api::stream::ChunkStream::new(run.job.clone(), run.done.len());
        for c in chunks.opening() {
            if tx.send(data(&c)).await.is_err() {
                return;
            }
        }
        loop {
            let w = tokio::select! {
                w = run.next() => w,
                _ = tx.closed() => return,
            };
            let (i, e) = match w {
                Wait::Event(i, e @ (Event::Token { .. } | Event::Text(_) | Event::Done(_))) => (i, e),
                w => {
                    let e = run.fail(&w);
                    let _ = tx.send(SseEvent::default().data(e.body())).await;
                    let _ = tx.send(SseEvent::default().data("[DONE]")).await;
                    return;
                }
            };
            for c in chunks.event(i, &e) {
                if tx.send(data(&c)).await.is_err() {
                    return;
                }
            }
            if matches!(e, Event::Done(_)) && run.all_done() {
                let gens = run.finished();
                if include_usage {
                    let _ = tx.send(data(&run.job.usage_chunk(&gens))).await;
                }
                let _ = tx.send(SseEvent::default().data("[DONE]")).await;
                return;
            }
        }
    });
    sse_response(rx, keepalive)
}
/// `rx`'s events as server-sent events, with `: keep-alive` comments every `keepalive` while
/// nothing is sent (every streamed route: chat, completions, Messages, Responses).
pub fn sse_response(mut rx: mpsc::Receiver<SseEvent>, keepalive: Option<Duration>) -> Response {
    let events = futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx).map(|e| e.map(Ok::<_, Infallible>)));
    let mut r = match keepalive {
        Some(every) => {
            Sse::new(events).keep_alive(KeepAlive::new().interval(every.max(Duration::from_millis(100))).text("keep-alive")).into_response()
        }
        None => Sse::new(events).into_response(),
    };
    r.headers_mut().insert("X-Accel-Buffering", HeaderValue::from_static("no"));
    r
}

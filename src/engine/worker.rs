//! An [`Engine`] on a thread of its own (native only), for servers: any thread submits
//! through a cloneable [`EngineClient`] and reads its [`RequestHandle`]; the worker steps
//! while there is work and sleeps on its command channel when idle. After every step it
//! publishes a [`Snapshot`] (queue depths, KV pages, totals) for health and metrics
//! endpoints.

use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use super::batch::{Engine, EngineStats, RequestHandle};
use super::generate::GenerateRequest;
use crate::kv::{KvError, PrefixStats};
use crate::model::forward::Pooling;
use crate::{LanternError, Result};

enum Cmd {
    Submit(Box<GenerateRequest>, usize, Sender<Result<Vec<RequestHandle>>>),
    Embed(Embed),
    Shutdown,
}

/// An embedding waiting for the engine thread.
struct Embed {
    tokens: Vec<u32>,
    pooling: Pooling,
    reply: Sender<Result<Vec<f32>>>,
}

/// The engine's state after its last step.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Snapshot {
    pub running: usize,
    pub waiting: usize,
    pub max_waiting: usize,
    pub kv_pages_total: usize,
    pub kv_pages_free: usize,
    pub kv_page_size: usize,
    pub context: usize,
    /// Whether the engine has work: requests running or waiting, or a step in flight (a
    /// decode-ahead step lands after its sequences have finished).
    pub busy: bool,
    pub stats: EngineStats,
    pub prefix: PrefixStats,
    /// The last step's error, if it failed (its requests got `Event::Error`).
    pub last_error: Option<String>,
}

fn snapshot(e: &Engine, last_error: Option<String>) -> Snapshot {
    let a = &e.model.kv.alloc;
    Snapshot {
        running: e.running(),
        waiting: e.waiting(),
        max_waiting: e.options.max_waiting,
        kv_pages_total: a.total_pages(),
        kv_pages_free: a.free_pages(),
        kv_page_size: a.config.page_size,
        context: a.config.context,
        busy: !e.is_idle(),
        stats: e.stats().clone(),
        prefix: a.stats(),
        last_error,
    }
}

/// Submits requests to a worker thread's engine.
#[derive(Clone)]
pub struct EngineClient {
    tx: Sender<Cmd>,
    snapshot: Arc<Mutex<Snapshot>>,
}

impl EngineClient {
    /// Queue a request; the engine's refusals (`Engine::submit`) come back as errors.
    pub fn submit(&self, req: GenerateRequest) -> Result<RequestHandle> {
        let mut h = self.submit_n(req, 1)?;
        h.pop().ok_or(LanternError::EngineStopped)
    }

    /// Queue `n` samples of one prompt sharing its KV pages ([`Engine::submit_n`]).
    pub fn submit_n(&self, req: GenerateRequest, n: usize) -> Result<Vec<RequestHandle>> {
        let (tx, rx) = channel();
        self.tx.send(Cmd::Submit(Box::new(req), n, tx)).map_err(|_| LanternError::EngineStopped)?;
        rx.recv().map_err(|_| LanternError::EngineStopped)?
    }

    /// The unit-length embedding of `tokens` ([`Engine::embedding`]), computed on the engine
    /// thread between steps; blocks until it is done. When the running requests hold every
    /// sequence slot or page it waits for them to free some.
    pub fn embed(&self, tokens: Vec<u32>, pooling: Pooling) -> Result<Vec<f32>> {
        let (reply, rx) = channel();
        self.tx.send(Cmd::Embed(Embed { tokens, pooling, reply })).map_err(|_| LanternError::EngineStopped)?;
        rx.recv().map_err(|_| LanternError::EngineStopped)?
    }

    /// The engine's state after its last step.
    pub fn snapshot(&self) -> Snapshot {
        self.snapshot.lock().map(|s| s.clone()).unwrap_or_default()
    }
}

/// The worker thread.
pub struct EngineWorker {
    client: EngineClient,
    thread: Option<JoinHandle<Engine>>,
}

impl EngineWorker {
    /// Move `engine` onto a new thread and start serving.
    pub fn spawn(engine: Engine) -> EngineWorker {
        let (tx, rx) = channel();
        let snap = Arc::new(Mutex::new(snapshot(&engine, None)));
        let s2 = snap.clone();
        let thread =
            std::thread::Builder::new().name("lantern-engine".into()).spawn(move || run(engine, rx, s2)).expect("spawn the engine thread");
        EngineWorker { client: EngineClient { tx, snapshot: snap }, thread: Some(thread) }
    }

    pub fn client(&self) -> EngineClient {
        self.client.clone()
    }

    /// Stop after the current step (queued requests are dropped: their handles end) and
    /// return the engine.
    pub fn shutdown(mut self) -> Option<Engine> {
        let _ = self.client.tx.send(Cmd::Shutdown);
        self.thread.take().and_then(|t| t.join().ok())
    }
}

impl Drop for EngineWorker {
    fn drop(&mut self) {
        let _ = self.client.tx.send(Cmd::Shutdown);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn run(mut engine: Engine, rx: Receiver<Cmd>, snap: Arc<Mutex<Snapshot>>) -> Engine {
    let mut embeds: std::collections::VecDeque<Embed> = Default::default();
    loop {
        // Idle: wait for a command; busy: take what has arrived and step.
        let first = if engine.is_idle() && embeds.is_empty() {
            match rx.recv() {
                Ok(c) => Some(c),
                Err(_) => return engine,
            }
        } else {
            None
        };
        for cmd in first.into_iter().chain(rx.try_iter()) {
            match cmd {
                Cmd::Submit(req, n, reply) => {
                    let _ = reply.send(engine.submit_n(*req, n));
                }
                Cmd::Embed(e) => embeds.push_back(e),
                Cmd::Shutdown => return engine,
            }
        }
        // Embeddings run between steps, in arrival order; one that finds no room waits for
        // the running requests to free some (an idle engine has nothing to free: its
        // refusal is final).
        while let Some(e) = embeds.front() {
            match block_on(engine.embedding(&e.tokens, e.pooling)) {
                Err(LanternError::Kv(KvError::NoSequenceSlot { .. } | KvError::Full { .. })) if !engine.is_idle() => break,
                r => {
                    let e = embeds.pop_front().expect("front exists");
                    let _ = e.reply.send(r);
                }
            }
        }
        let err = block_on(engine.step()).err().map(|e| e.to_string());
        if let Ok(mut s) = snap.lock() {
            *s = snapshot(&engine, err);
        }
    }
}

/// Run a future to completion on this thread (the engine's futures only wait for GPU
/// readback, which they drive themselves on native).
fn block_on<F: std::future::Future>(f: F) -> F::Output {
    struct Park(std::thread::Thread);
    impl std::task::Wake for Park {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = std::task::Waker::from(Arc::new(Park(std::thread::current())));
    let mut cx = std::task::Context::from_waker(&waker);
    let mut f = std::pin::pin!(f);
    loop {
        if let std::task::Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
        std::thread::park();
    }
}

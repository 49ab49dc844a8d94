//! The batching engine for JavaScript (`lantern-web`'s worker): OpenAI requests in, OpenAI
//! responses and chunks out, many requests on one model at once.
//!
//! The worker drives it: `submit(endpoint, body)` validates an OpenAI body exactly as
//! `lantern serve` does (`api::parse_request` against the same [`ServedModel`]) and
//! queues it in [`crate::engine::Engine`] (prefix cache, constrained decoding, speculation),
//! `step()` runs one scheduler iteration on the GPU, and `drain(id)` hands over what a
//! request produced since the last call: its stream's chunks (`api::stream`, the server's
//! own translation) or, at the end, the whole response. `cancel(id)` drops the request; the
//! engine frees its KV pages at its next step. Calls must not overlap a running `step()`
//! (the worker queues messages between steps); one that does gets a `busy` error.

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::sync::Arc;

use js_sys::Function;
use wasm_bindgen::prelude::*;

use super::{fetch_cached, load_blob, to_js, Failure, LoadOptions};
use crate::api::stream::ChunkStream;
use crate::api::{self, ApiError, Endpoint, Job, ServedModel};
use crate::engine::speculative::{Drafter, Speculation};
use crate::engine::{Engine as Batch, EngineOptions, Event, Generation, RequestHandle};
use crate::gpu::GpuContext;
use crate::kv::KvError;
use crate::LanternError;

/// A loaded model serving OpenAI requests (`Engine.load`).
#[wasm_bindgen]
pub struct Engine {
    /// `None` while a step runs (taken out across its awaits) and after `unload`.
    engine: RefCell<Option<Batch>>,
    served: ServedModel,
    ctx: Arc<GpuContext>,
    file_bytes: u64,
    source: String,
    requests: RefCell<BTreeMap<u32, Pending>>,
    next_id: Cell<u32>,
    /// Makes response ids unique across engines and page loads.
    nonce: u64,
    draft_name: RefCell<Option<String>>,
}

/// A submitted request until its end has been drained.
struct Pending {
    /// One handle per choice (`n`).
    handles: Vec<RequestHandle>,
    job: Job,
    /// Streamed requests: their chunker.
    chunks: Option<ChunkStream>,
    include_usage: bool,
    /// The opening chunks (chat's role) have been drained.
    opened: bool,
    gens: Vec<Option<Generation>>,
}

fn random_u64() -> u64 {
    let hi = (js_sys::Math::random() * 4294967296.0) as u64;
    let lo = (js_sys::Math::random() * 4294967296.0) as u64;
    (hi << 32) | lo
}

fn busy() -> JsValue {
    Failure::new("busy", "the engine is running a step (or was unloaded); call it between steps").into_js()
}

/// `{ status, body }`: an OpenAI error as the HTTP answer `lantern serve` would give.
fn api_error(e: &ApiError) -> Result<JsValue, JsValue> {
    to_js(&serde_json::json!({ "status": e.status, "body": e.body() })).map_err(JsValue::from)
}

/// The engine's refusal of a request, as `lantern serve` words it.
fn refusal(e: LanternError) -> ApiError {
    match e {
        LanternError::PromptTooLong { prompt_tokens, context, .. } => {
            ApiError::bad(format!("this model's context holds {context} tokens but the prompt has {prompt_tokens} tokens"))
                .code("context_length_exceeded")
        }
        LanternError::Kv(k @ KvError::Full { .. }) => {
            ApiError::bad(format!("this request can never fit the KV cache: {k}")).code("kv_cache_too_small")
        }
        m @ LanternError::Overloaded { .. } => {
            ApiError::new(429, "server_overloaded", format!("the engine is busy: {m}; retry shortly")).code("queue_full")
        }
        e @ LanternError::Constraint { .. } => {
            ApiError::bad(format!("the response_format's grammar does not compile: {e}")).param("response_format").code("invalid_schema")
        }
        other => ApiError::bad(other.to_string()),
    }
}

#[wasm_bindgen]
impl Engine {
    /// Load a GGUF: `source` is a URL (downloaded into Cache Storage once, then read from
    /// there), a `File`/`Blob`, or a `Uint8Array`. `options`: `{ context, maxSeqs, kvDtype,
    /// weights, memoryBudget, name }` (`name`: the model id responses carry). Errors carry a
    /// `code`: `no_adapter`, `download_failed`, `bad_model`, `out_of_memory`,
    /// `invalid_options`.
    pub async fn load(source: JsValue, options: JsValue, progress: Option<Function>) -> Result<Engine, JsValue> {
        let id = js_sys::Reflect::get(&options, &"name".into()).ok().and_then(|v| v.as_string());
        let opts = LoadOptions::from_js(options).map_err(Failure::into_js)?;
        let opts = LoadOptions { max_seqs: Some(opts.max_seqs.unwrap_or(4)), ..opts };
        let (blob, name, from) = if let Some(url) = source.as_string() {
            let (blob, from) = fetch_cached(&url, &progress).await.map_err(Failure::into_js)?;
            (blob, url.rsplit('/').next().unwrap_or(&url).to_string(), from)
        } else if let Some(file) = source.dyn_ref::<web_sys::File>() {
            (file.clone().into(), file.name(), "file".to_string())
        } else if let Some(blob) = source.dyn_ref::<web_sys::Blob>() {
            (blob.clone(), "model.gguf".to_string(), "blob".to_string())
        } else if let Some(bytes) = source.dyn_ref::<js_sys::Uint8Array>() {
            let parts = js_sys::Array::of1(bytes);
            let blob = web_sys::Blob::new_with_u8_array_sequence(&parts)
                .map_err(|e| Failure::new("invalid_options", format!("model bytes: {e:?}")).into_js())?;
            (blob, "model.gguf".to_string(), "bytes".to_string())
        } else {
            return Err(Failure::new("invalid_options", "the model must be a URL, a File, a Blob or a Uint8Array").into_js());
        };
        let l = load_blob(blob, name, from, opts, &progress).await.map_err(Failure::into_js)?;
        let tokenizer = Arc::new(l.tokenizer);
        let engine = Batch::new(l.model, tokenizer.clone(), EngineOptions::default());
        let a = &engine.model.kv.alloc;
        let model_id = id.unwrap_or_else(|| l.name.trim_end_matches(".gguf").to_string());
        let served = ServedModel {
            template: tokenizer.chat_template().map_err(|e| e.to_string()),
            stop_ids: crate::engine::generate::default_stop_ids(&engine.model.config.eos_token_ids, &tokenizer),
            vocab: engine.model.config.vocab_size,
            context: a.config.context,
            kv_pages_total: a.total_pages(),
            page_size: a.config.page_size.max(1),
            aliases: vec![l.name.clone()],
            model_id,
            speculation: Speculation::default(),
            max_seqs: a.config.max_seqs,
            embedding_dims: engine.model.config.hidden_size,
            token_bytes: Default::default(),
            tokenizer,
        };
        Ok(Engine {
            engine: RefCell::new(Some(engine)),
            served,
            ctx: l.ctx,
            file_bytes: l.file_bytes,
            source: l.source,
            requests: RefCell::new(BTreeMap::new()),
            next_id: Cell::new(1),
            nonce: random_u64(),
            draft_name: RefCell::new(None),
        })
    }

    /// The id responses carry and requests' `model` may name.
    #[wasm_bindgen(getter, js_name = modelId)]
    pub fn model_id(&self) -> String {
        self.served.model_id.clone()
    }

    /// Where the model came from: `network`, `cache`, `file`, `blob` or `bytes`.
    #[wasm_bindgen(getter)]
    pub fn source(&self) -> String {
        self.source.clone()
    }

    /// Make `draft` (another loaded engine whose model has the same tokenizer) this one's
    /// draft model: requests then speculate with it unless they ask otherwise. `draft`'s model
    /// moves here; that engine is unloaded.
    #[wasm_bindgen(js_name = setDraft)]
    pub fn set_draft(&mut self, draft: &Engine) -> Result<(), JsValue> {
        let other = draft.engine.borrow_mut().take().ok_or_else(busy)?;
        let draft_tokenizer = other.tokenizer.clone();
        let mut slot = self.engine.borrow_mut();
        let engine = slot.as_mut().ok_or_else(busy)?;
        engine.set_draft(other.into_model(), &draft_tokenizer).map_err(|e| Failure::new("bad_model", e.to_string()).into_js())?;
        self.served.speculation = Speculation { drafter: Drafter::Model, ..Speculation::default() };
        *self.draft_name.borrow_mut() = Some(draft.served.model_id.clone());
        Ok(())
    }

    /// Validate an OpenAI request body (JSON text) for `endpoint` (`chat` or `completions`)
    /// and queue it: `{ id, stream }`, or `{ status, body }` with OpenAI's error when the
    /// request is invalid or refused (what `lantern serve` would answer).
    pub fn submit(&self, endpoint: &str, body: &str) -> Result<JsValue, JsValue> {
        let endpoint = match endpoint {
            "chat" => Endpoint::Chat,
            "completions" => Endpoint::Completions,
            o => return Err(Failure::new("invalid_request", format!("endpoint must be chat or completions, not {o}")).into_js()),
        };
        let v = match api::parse_request(&self.served, endpoint, body.as_bytes()) {
            Ok(v) => v,
            Err(e) => return api_error(&e),
        };
        let req = v.request(&self.served, random_u64());
        let handles = {
            let mut slot = self.engine.borrow_mut();
            let engine = slot.as_mut().ok_or_else(busy)?;
            match engine.submit_n(req, v.n) {
                Ok(h) => h,
                Err(e) => return api_error(&refusal(e)),
            }
        };
        let id = self.next_id.get();
        self.next_id.set(id + 1);
        let prefix = if endpoint == Endpoint::Chat { "chatcmpl" } else { "cmpl" };
        let job = Job {
            id: format!("{prefix}-{:012x}{id:08x}", self.nonce & 0xffff_ffff_ffff),
            created: (js_sys::Date::now() / 1000.0) as u64,
            endpoint,
            model: self.served.model_id.clone(),
            prompt_tokens: v.prompt_ids.len(),
            token_bytes: v.logprobs.map(|_| self.served.token_bytes()),
            tools: v.tools.clone(),
        };
        let chunks = v.stream.then(|| ChunkStream::new(job.clone(), handles.len()));
        let gens = vec![None; handles.len()];
        self.requests.borrow_mut().insert(id, Pending { handles, job, chunks, include_usage: v.include_usage, opened: false, gens });
        to_js(&serde_json::json!({ "id": id, "stream": v.stream })).map_err(JsValue::from)
    }

    /// Run one step of the engine (every running request gets its next token or prompt
    /// chunk). Resolves to whether work remains.
    pub async fn step(&self) -> Result<bool, JsValue> {
        let mut engine = self.engine.borrow_mut().take().ok_or_else(busy)?;
        let r = if engine.is_idle() { Ok(()) } else { engine.step().await.map(|_| ()) };
        let more = !engine.is_idle();
        *self.engine.borrow_mut() = Some(engine);
        // A failed step's requests got `Event::Error`; `drain` reports it to each.
        r.map(|_| more).map_err(|e| Failure::new("engine_error", e.to_string()).into_js())
    }

    /// Whether no request is running or waiting.
    pub fn idle(&self) -> bool {
        self.engine.borrow().as_ref().is_none_or(Batch::is_idle)
    }

    /// Ids of the requests not yet drained to their end.
    pub fn pending(&self) -> Vec<u32> {
        self.requests.borrow().keys().copied().collect()
    }

    /// What request `id` produced since the last call: `{ chunks: [json...], done, response,
    /// error }`. Streamed requests give chunk objects (JSON text, in order; with
    /// `stream_options.include_usage` the usage chunk last); the others, at the end,
    /// `response` (JSON text). `error` (`{ status, body }`) ends a request that failed.
    /// After `done` the id is forgotten.
    pub fn drain(&self, id: u32) -> Result<JsValue, JsValue> {
        let mut requests = self.requests.borrow_mut();
        let Some(p) = requests.get_mut(&id) else {
            return Err(Failure::new("invalid_request", format!("no request {id} (finished, cancelled or never submitted)")).into_js());
        };
        let mut chunks: Vec<String> = Vec::new();
        let mut error: Option<ApiError> = None;
        if let (Some(c), false) = (p.chunks.as_ref(), p.opened) {
            p.opened = true;
            chunks.extend(c.opening().iter().map(|r| serde_json::to_string(r).unwrap_or_default()));
        }
        'choices: for i in 0..p.handles.len() {
            loop {
                let e = match p.handles[i].try_next() {
                    Ok(Some(e)) => e,
                    Ok(None) => break,
                    Err(()) => {
                        if p.gens[i].is_none() {
                            error = Some(
                                ApiError::new(503, "server_error", "the engine stopped before the request finished").code("engine_stopped"),
                            );
                            break 'choices;
                        }
                        break;
                    }
                };
                if let Event::Error(m) = &e {
                    error = Some(ApiError::new(500, "server_error", format!("generation failed: {m}")).code("engine_error"));
                    break 'choices;
                }
                if let Some(c) = p.chunks.as_mut() {
                    chunks.extend(c.event(i, &e).iter().map(|r| serde_json::to_string(r).unwrap_or_default()));
                }
                if let Event::Done(g) = e {
                    p.gens[i] = Some(*g);
                }
            }
        }
        let done = error.is_some() || p.gens.iter().all(Option::is_some);
        let mut response = None;
        if done && error.is_none() {
            let gens: Vec<Generation> = p.gens.iter_mut().filter_map(Option::take).collect();
            if p.chunks.is_some() {
                if p.include_usage {
                    chunks.push(serde_json::to_string(&p.job.usage_chunk(&gens)).unwrap_or_default());
                }
            } else {
                response = Some(serde_json::to_string(&p.job.complete(&gens)).unwrap_or_default());
            }
        }
        if done {
            // Dropping the handles cancels whatever is left of a failed request.
            requests.remove(&id);
        }
        let error = error.map(|e| serde_json::json!({ "status": e.status, "body": e.body() }));
        to_js(&serde_json::json!({ "chunks": chunks, "done": done, "response": response, "error": error })).map_err(JsValue::from)
    }

    /// Stop request `id` and forget it: the engine frees its KV pages at its next step.
    /// Unknown or finished ids are ignored.
    pub fn cancel(&self, id: u32) {
        if let Some(p) = self.requests.borrow_mut().remove(&id) {
            for h in &p.handles {
                h.cancel();
            }
        }
    }

    /// Token ids of `text` (no special tokens added).
    pub fn tokenize(&self, text: &str) -> Result<Vec<u32>, JsValue> {
        self.served.tokenizer.encode(text).map_err(|e| Failure::new("invalid_request", e.to_string()).into_js())
    }

    /// The text of token ids.
    pub fn detokenize(&self, ids: Vec<u32>) -> Result<String, JsValue> {
        self.served.tokenizer.decode(&ids).map_err(|e| Failure::new("invalid_request", e.to_string()).into_js())
    }

    /// The memory plan as loaded: weights, KV cache (pages, dtype, bytes), workspace, the
    /// context and sequences, the model's shape, the draft, where the file came from, and
    /// the engine's counters.
    pub fn plan(&self) -> Result<JsValue, JsValue> {
        let slot = self.engine.borrow();
        let engine = slot.as_ref().ok_or_else(busy)?;
        let (model, draft) = engine.models();
        let a = &model.kv.alloc;
        let v = serde_json::json!({
            "model": self.served.model_id,
            "source": self.source,
            "fileBytes": self.file_bytes,
            "config": model.config,
            "context": a.config.context,
            "maxSeqs": a.config.max_seqs,
            "kvPages": a.total_pages(),
            "kvPagesFree": a.free_pages(),
            "pageSize": a.config.page_size,
            "memory": model.memory(),
            "weightBytes": model.weight_bytes(),
            "kvCacheBytes": model.kv.bytes(),
            "draft": draft.map(|d| serde_json::json!({ "model": *self.draft_name.borrow(), "weightBytes": d.weight_bytes(), "kvCacheBytes": d.kv.bytes() })),
            "stats": engine.stats(),
            "prefix": a.stats(),
            "adapter": self.ctx.adapter_json(),
            "wasmMemoryBytes": super::wasm_memory_bytes(),
        });
        to_js(&v).map_err(JsValue::from)
    }

    /// Free the model's GPU memory; every pending request is dropped. Later calls fail with
    /// `busy`.
    pub fn unload(&self) -> Result<(), JsValue> {
        let engine = self.engine.borrow_mut().take().ok_or_else(busy)?;
        self.requests.borrow_mut().clear();
        drop(engine);
        Ok(())
    }
}

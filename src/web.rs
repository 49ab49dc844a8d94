//! The browser API (`web` feature, wasm32): a `Lantern` object for JavaScript, used by the
//! demo's Web Worker (`web/worker.js`).
//!
//! - `Lantern.adapter()`: the WebGPU adapter the browser offers (name, features, limits), or
//!   a plain-sentence error when there is none.
//! - `Lantern.loadUrl(url, options, progress)`, `loadFile(file, ...)`, `loadBytes(bytes,
//!   name, ...)`: a GGUF model onto the GPU. `loadUrl` keeps the file in Cache Storage
//!   (`lantern-models-v1`), so a reload reads it from there instead of the network.
//!   `progress({phase, done, total})` reports `download` / `cache` bytes, then `upload`
//!   layers.
//! - `generate(prompt, options, onText)`: greedy or sampled generation, `onText(piece)` per
//!   piece of text; resolves to ids, text, finish reason and TTFT/TPOT/tokens per second.
//! - `cancel()`: ends the running generation at its next token (`finish_reason: "cancelled"`).
//! - `plan()`, `info()`: the memory plan (weights, KV cache, workspace, context) and the
//!   adapter.
//!
//! Everything is async and single-threaded: no blocking call, no filesystem, no threads.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::Arc;

use js_sys::{Function, Uint8Array};
use serde::Serialize;
use wasm_bindgen::prelude::*;
use wasm_bindgen::JsCast;
use wasm_bindgen_futures::JsFuture;

use crate::engine::generate::generate;
use crate::engine::{GenerateRequest, SamplingParams};
use crate::gpu::{DeviceOptions, GpuContext};
use crate::model::gguf::GgufFile;
use crate::model::llama::{GpuModel, ModelOptions, WeightPrecision};
use crate::model::tokenizer::{ChatMessage, Tokenizer};

/// Cache Storage bucket for downloaded models.
const CACHE_NAME: &str = "lantern-models-v1";

fn js_err(e: impl std::fmt::Display) -> JsError {
    JsError::new(&e.to_string())
}

fn to_js<T: Serialize>(v: &T) -> Result<JsValue, JsError> {
    v.serialize(&serde_wasm_bindgen::Serializer::json_compatible()).map_err(js_err)
}

fn report(progress: &Option<Function>, phase: &str, done: f64, total: f64) {
    if let Some(f) = progress {
        let o = js_sys::Object::new();
        let _ = js_sys::Reflect::set(&o, &"phase".into(), &phase.into());
        let _ = js_sys::Reflect::set(&o, &"done".into(), &done.into());
        let _ = js_sys::Reflect::set(&o, &"total".into(), &total.into());
        let _ = f.call1(&JsValue::NULL, &o);
    }
}

/// Options for loading (all optional): `{ context, kvDtype: "f32"|"f16"|"q8", weights:
/// "native"|"f32"|"f16", memoryBudget: bytes }` (browsers report no GPU memory size, so
/// without a budget the KV cache holds one full context).
#[derive(serde::Deserialize, Default)]
#[serde(rename_all = "camelCase", default)]
struct LoadOptions {
    context: Option<usize>,
    memory_budget: Option<u64>,
    kv_dtype: Option<String>,
    weights: Option<String>,
}

/// Options for generating (all optional): `{ maxTokens, temperature, topK, topP, seed,
/// chat, system, history }`. With `chat`, the prompt is the user's next message and
/// `history` the conversation so far (`[{ role, content }]`), rendered with the model's
/// chat template (earlier turns' KV pages come from the prefix cache).
#[derive(serde::Deserialize)]
#[serde(rename_all = "camelCase", default)]
struct GenOptions {
    max_tokens: usize,
    temperature: f32,
    top_k: usize,
    top_p: f32,
    seed: u64,
    chat: bool,
    system: Option<String>,
    history: Vec<Turn>,
}

#[derive(serde::Deserialize)]
struct Turn {
    role: String,
    content: String,
}

impl Default for GenOptions {
    fn default() -> Self {
        GenOptions { max_tokens: 128, temperature: 0.0, top_k: 0, top_p: 1.0, seed: 0, chat: false, system: None, history: Vec::new() }
    }
}

/// A model on the GPU with its tokenizer.
#[wasm_bindgen]
pub struct Lantern {
    model: RefCell<Option<GpuModel>>,
    tokenizer: Arc<Tokenizer>,
    ctx: Arc<GpuContext>,
    cancel: Rc<Cell<bool>>,
    name: String,
    file_bytes: u64,
    source: String,
}

#[wasm_bindgen]
impl Lantern {
    /// The adapter the browser offers: `{ name, backend, features, limits, ... }`.
    pub async fn adapter() -> Result<JsValue, JsError> {
        if !webgpu_present() {
            return Err(JsError::new("This browser has no WebGPU (navigator.gpu is missing). Use a recent Chrome or Edge, or Firefox/Safari with WebGPU enabled."));
        }
        let list = crate::gpu::list_adapters(Some("webgpu")).await.map_err(js_err)?;
        match list.into_iter().next() {
            Some(a) => to_js(&a),
            None => Err(JsError::new("WebGPU is present but the browser offered no adapter (it may be blocklisted or disabled).")),
        }
    }

    /// Download a GGUF from `url` (same origin), from Cache Storage when an earlier load kept
    /// it, and load it.
    #[wasm_bindgen(js_name = loadUrl)]
    pub async fn load_url(url: String, options: JsValue, progress: Option<Function>) -> Result<Lantern, JsError> {
        let (bytes, source) = fetch_cached(&url, &progress).await?;
        let name = url.rsplit('/').next().unwrap_or(&url).to_string();
        Self::load_inner(bytes, name, source, options, progress).await
    }

    /// Load a GGUF the user picked (`<input type=file>` or drag and drop).
    #[wasm_bindgen(js_name = loadFile)]
    pub async fn load_file(file: web_sys::File, options: JsValue, progress: Option<Function>) -> Result<Lantern, JsError> {
        let total = file.size();
        let mut bytes = Vec::with_capacity(total as usize);
        let step = 16.0 * 1024.0 * 1024.0;
        let mut at = 0.0;
        while at < total {
            let end = (at + step).min(total);
            let blob = file.slice_with_f64_and_f64(at, end).map_err(|e| JsError::new(&format!("reading {}: {e:?}", file.name())))?;
            let buf = JsFuture::from(blob.array_buffer()).await.map_err(|e| JsError::new(&format!("reading {}: {e:?}", file.name())))?;
            bytes.extend_from_slice(&Uint8Array::new(&buf).to_vec());
            at = end;
            report(&progress, "read", at, total);
        }
        Self::load_inner(bytes, file.name(), "file".into(), options, progress).await
    }

    /// Load a GGUF already in memory.
    #[wasm_bindgen(js_name = loadBytes)]
    pub async fn load_bytes(bytes: Uint8Array, name: String, options: JsValue, progress: Option<Function>) -> Result<Lantern, JsError> {
        Self::load_inner(bytes.to_vec(), name, "bytes".into(), options, progress).await
    }

    async fn load_inner(bytes: Vec<u8>, name: String, source: String, options: JsValue, progress: Option<Function>) -> Result<Lantern, JsError> {
        let opts: LoadOptions = if options.is_undefined() || options.is_null() {
            LoadOptions::default()
        } else {
            serde_wasm_bindgen::from_value(options).map_err(|e| JsError::new(&format!("load options: {e}")))?
        };
        let file_bytes = bytes.len() as u64;
        let (weights, tokenizer) = {
            let gguf = GgufFile::parse(&bytes, name.clone()).map_err(|e| JsError::new(&format!("{name} is not a usable GGUF model: {e}")))?;
            let weights = crate::model::gguf::weights_from_gguf(&gguf, &name).map_err(js_err)?;
            let tokenizer = Tokenizer::from_gguf(&gguf).map_err(|e| JsError::new(&format!("{name}: no usable tokenizer: {e}")))?;
            (weights, tokenizer)
        };
        let ctx = GpuContext::new(&DeviceOptions { backend: Some("webgpu".into()), ..Default::default() }).await.map_err(js_err)?;
        let kv_dtype = match opts.kv_dtype.as_deref() {
            None | Some("f32") => crate::kv::plan::KvDtype::F32,
            Some("f16") => crate::kv::plan::KvDtype::F16,
            Some("q8") => crate::kv::plan::KvDtype::Q8,
            Some(o) => return Err(JsError::new(&format!("kvDtype must be f32, f16 or q8, not {o}"))),
        };
        let precision = match opts.weights.as_deref() {
            None | Some("native") => WeightPrecision::Native,
            Some("f32") => WeightPrecision::F32,
            Some("f16") => WeightPrecision::F16,
            Some(o) => return Err(JsError::new(&format!("weights must be native, f32 or f16, not {o}"))),
        };
        let options = ModelOptions { context: opts.context, max_seqs: 1, kv_dtype, weights: precision, memory_budget: opts.memory_budget, ..Default::default() };
        let model = GpuModel::load_with_progress(ctx.clone(), &weights, options, &mut |done, total| report(&progress, "upload", done as f64, total as f64))
            .await
            .map_err(js_err)?;
        drop(weights);
        drop(bytes);
        Ok(Lantern { model: RefCell::new(Some(model)), tokenizer: Arc::new(tokenizer), ctx, cancel: Rc::new(Cell::new(false)), name, file_bytes, source })
    }

    /// Generate from `prompt`, calling `on_text(piece)` as text arrives. Resolves to
    /// `{ promptIds, outputIds, text, finishReason, ttftMs, tpotMs, tokensPerS, e2eMs }`.
    pub async fn generate(&self, prompt: String, options: JsValue, on_text: Option<Function>) -> Result<JsValue, JsError> {
        let o: GenOptions = if options.is_undefined() || options.is_null() {
            GenOptions::default()
        } else {
            serde_wasm_bindgen::from_value(options).map_err(|e| JsError::new(&format!("generate options: {e}")))?
        };
        let mut model = self
            .model
            .try_borrow_mut()
            .map_err(|_| JsError::new("a generation is already running on this model; cancel it or wait"))?
            .take()
            .ok_or_else(|| JsError::new("the model was released"))?;
        let r = self.run(&mut model, &prompt, &o, on_text).await;
        *self.model.borrow_mut() = Some(model);
        r
    }

    async fn run(&self, model: &mut GpuModel, prompt: &str, o: &GenOptions, on_text: Option<Function>) -> Result<JsValue, JsError> {
        self.cancel.set(false);
        let tok = &self.tokenizer;
        let prompt_ids = if o.chat {
            let tmpl = tok.chat_template().map_err(js_err)?;
            let mut msgs = Vec::new();
            if let Some(s) = &o.system {
                msgs.push(ChatMessage::system(s.clone()));
            }
            for t in &o.history {
                if !matches!(t.role.as_str(), "system" | "user" | "assistant") {
                    return Err(JsError::new(&format!("history: role must be system, user or assistant, not {:?}", t.role)));
                }
                msgs.push(ChatMessage::new(t.role.clone(), t.content.clone()));
            }
            msgs.push(ChatMessage::user(prompt.to_string()));
            tok.encode_chat(&tmpl.render(&msgs, true).map_err(js_err)?).map_err(js_err)?
        } else {
            tok.encode(prompt).map_err(js_err)?
        };
        let stop_ids = crate::engine::generate::default_stop_ids(&model.config.eos_token_ids, tok);
        let req = GenerateRequest {
            prompt_ids,
            max_tokens: o.max_tokens,
            sampling: SamplingParams { temperature: o.temperature, top_k: o.top_k, top_p: o.top_p, seed: o.seed },
            stop_ids,
            stop_strings: vec![],
        };
        let cancel = self.cancel.clone();
        let g = generate(model, tok, &req, |piece| {
            if let Some(f) = &on_text {
                let _ = f.call1(&JsValue::NULL, &piece.into());
            }
            !cancel.get()
        })
        .await
        .map_err(js_err)?;
        let m = g.timings.metrics();
        #[derive(Serialize)]
        #[serde(rename_all = "camelCase")]
        struct Out<'a> {
            prompt_ids: &'a [u32],
            output_ids: &'a [u32],
            text: &'a str,
            finish_reason: &'a str,
            ttft_ms: Option<f64>,
            tpot_ms: Option<f64>,
            tokens_per_s: Option<f64>,
            e2e_ms: Option<f64>,
            prefill_tokens_per_s: Option<f64>,
        }
        to_js(&Out {
            prompt_ids: &g.prompt_ids,
            output_ids: &g.output_ids,
            text: &g.text,
            finish_reason: g.finish_reason.as_str(),
            ttft_ms: m.ttft_ms,
            tpot_ms: m.tpot_ms,
            tokens_per_s: m.tokens_per_s,
            e2e_ms: m.e2e_ms,
            prefill_tokens_per_s: m.ttft_ms.map(|t| g.prompt_ids.len() as f64 / (t / 1e3)),
        })
    }

    /// Stop the running generation at its next token.
    pub fn cancel(&self) {
        self.cancel.set(true);
    }

    /// Token ids of `text` (as `generate` would see the prompt without `chat`).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, JsError> {
        self.tokenizer.encode(text).map_err(js_err)
    }

    /// The memory plan as loaded: weights by dtype, KV cache (pages, dtype, bytes), workspace,
    /// context, the model's shape, and where the file came from.
    pub fn plan(&self) -> Result<JsValue, JsError> {
        let guard = self.model.try_borrow().map_err(|_| JsError::new("busy"))?;
        let model = guard.as_ref().ok_or_else(|| JsError::new("the model was released"))?;
        let v = serde_json::json!({
            "model": self.name,
            "source": self.source,
            "fileBytes": self.file_bytes,
            "config": model.config,
            "context": model.kv.alloc.config.context,
            "memory": model.memory(),
            "weightBytes": model.weight_bytes(),
            "kvCacheBytes": model.kv.bytes(),
        });
        to_js(&v)
    }

    /// The adapter this model runs on.
    pub fn info(&self) -> Result<JsValue, JsError> {
        to_js(&self.ctx.adapter_json())
    }
}

fn webgpu_present() -> bool {
    let g = js_sys::global();
    js_sys::Reflect::get(&g, &"navigator".into())
        .ok()
        .and_then(|n| js_sys::Reflect::get(&n, &"gpu".into()).ok())
        .is_some_and(|gpu| !gpu.is_undefined() && !gpu.is_null())
}

/// `caches` of the window or worker, if this context has Cache Storage (secure contexts).
fn cache_storage() -> Option<web_sys::CacheStorage> {
    let g = js_sys::global();
    js_sys::Reflect::get(&g, &"caches".into()).ok().and_then(|c| c.dyn_into::<web_sys::CacheStorage>().ok())
}

async fn read_body(resp: &web_sys::Response, phase: &str, progress: &Option<Function>) -> Result<Vec<u8>, JsError> {
    let total = resp.headers().get("content-length").ok().flatten().and_then(|s| s.parse::<f64>().ok()).unwrap_or(0.0);
    let body = resp.body().ok_or_else(|| JsError::new("the response has no body"))?;
    let reader: web_sys::ReadableStreamDefaultReader = body.get_reader().unchecked_into();
    let mut out = Vec::with_capacity(total as usize);
    loop {
        let chunk = JsFuture::from(reader.read()).await.map_err(|e| JsError::new(&format!("download interrupted: {e:?}")))?;
        let done = js_sys::Reflect::get(&chunk, &"done".into()).ok().and_then(|d| d.as_bool()).unwrap_or(true);
        if done {
            break;
        }
        let value: Uint8Array = js_sys::Reflect::get(&chunk, &"value".into()).map_err(|_| JsError::new("bad stream chunk"))?.unchecked_into();
        let at = out.len();
        out.resize(at + value.length() as usize, 0);
        value.copy_to(&mut out[at..]);
        report(progress, phase, out.len() as f64, total.max(out.len() as f64));
    }
    if total > 0.0 && (out.len() as f64) < total {
        return Err(JsError::new(&format!("download truncated: {} of {} bytes", out.len(), total)));
    }
    Ok(out)
}

/// The bytes of `url`: from Cache Storage when present ("cache"), else from the network
/// ("network"), kept in Cache Storage for next time.
async fn fetch_cached(url: &str, progress: &Option<Function>) -> Result<(Vec<u8>, String), JsError> {
    let cache = match cache_storage() {
        Some(cs) => JsFuture::from(cs.open(CACHE_NAME)).await.ok().map(|c| c.unchecked_into::<web_sys::Cache>()),
        None => None,
    };
    if let Some(c) = &cache {
        if let Ok(hit) = JsFuture::from(c.match_with_str(url)).await {
            if let Ok(resp) = hit.dyn_into::<web_sys::Response>() {
                if let Ok(bytes) = read_body(&resp, "cache", progress).await {
                    return Ok((bytes, "cache".into()));
                }
            }
        }
    }
    let g = js_sys::global();
    let fetch: Function = js_sys::Reflect::get(&g, &"fetch".into()).map_err(|_| JsError::new("no fetch"))?.unchecked_into();
    let resp = JsFuture::from(js_sys::Promise::from(fetch.call1(&g, &url.into()).map_err(|e| JsError::new(&format!("fetching {url}: {e:?}")))?))
        .await
        .map_err(|e| JsError::new(&format!("could not download {url}: {e:?}")))?;
    let resp: web_sys::Response = resp.unchecked_into();
    if !resp.ok() {
        return Err(JsError::new(&format!("could not download {url}: HTTP {} {}", resp.status(), resp.status_text())));
    }
    let bytes = read_body(&resp, "download", progress).await?;
    if let Some(c) = &cache {
        // Keep a copy for the next page load; failing to (quota) only costs a download.
        let mut copy = bytes.clone();
        if let Ok(stored) = web_sys::Response::new_with_opt_u8_array(Some(&mut copy)) {
            let _ = JsFuture::from(c.put_with_str(url, &stored)).await;
        }
    }
    Ok((bytes, "network".into()))
}

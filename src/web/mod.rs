//! The browser API (`web` feature, wasm32): a `Lantern` object for JavaScript, used by the
//! demo's Web Worker (`web/worker.js`).
//!
//! - `Lantern.adapter()`: the WebGPU adapter the browser offers (name, features, limits), or
//!   a plain-sentence error when there is none.
//! - `Lantern.catalogue()`: the models Lantern knows by name (`crate::catalogue`).
//! - `Lantern.loadUrl(url, options, progress)`, `loadFile(file, ...)`, `loadBytes(bytes,
//!   name, ...)`: a GGUF model onto the GPU. `loadUrl` downloads the file into Cache Storage
//!   (`lantern-models-v1`) once; later loads read it from there. The file is never held
//!   whole in wasm memory: the header is parsed from its first bytes, then each layer's
//!   tensors are read from the `Blob` by byte range, uploaded and dropped (a 1.1 GB model
//!   loads with about one layer in wasm memory). `progress({phase, done, total})` reports
//!   `download` bytes, then `upload` layers.
//! - `generate(prompt, options, onText)`: greedy or sampled generation, `onText(piece)` per
//!   piece of text; resolves to ids, text, finish reason and TTFT/TPOT/tokens per second.
//! - `setDraft(other)`: another loaded model with the same tokenizer drafts for this one
//!   (`generate` option `speculative: { drafter: "model" }`; `"lookup"` needs no second
//!   model).
//! - `cancel()`: ends the running generation at its next token (`finish_reason: "cancelled"`).
//! - `plan()`, `info()`: the memory plan (weights, KV cache, workspace, context) and the
//!   adapter.
//!
//! Everything is async and single-threaded: no blocking call, no filesystem, no threads.

mod engine;

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::Arc;

use js_sys::{Function, Uint8Array};
use serde::Serialize;
use wasm_bindgen::prelude::*;
use wasm_bindgen::JsCast;
use wasm_bindgen_futures::JsFuture;

use crate::engine::generate::generate_with;
use crate::engine::{GenerateRequest, SamplingParams};
use crate::gpu::{DeviceOptions, GpuContext};
use crate::model::forward::{GpuModel, ModelOptions, WeightPrecision};
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
/// without a budget the KV cache holds one full context per sequence).
#[derive(serde::Deserialize, Default)]
#[serde(rename_all = "camelCase", default)]
pub(crate) struct LoadOptions {
    context: Option<usize>,
    /// Sequences the KV cache serves at once (the `Engine` class; `Lantern` uses one).
    max_seqs: Option<usize>,
    memory_budget: Option<u64>,
    kv_dtype: Option<String>,
    weights: Option<String>,
}

/// Options for generating (all optional): `{ maxTokens, temperature, topK, topP, seed,
/// chat, system, history, speculative, jsonSchema, regex, logitBias, presencePenalty,
/// frequencyPenalty }` (`logitBias`: `{ "tokenId": delta }`, OpenAI's). With `chat`, the prompt is the user's next message and
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
    /// Speculative decoding: `{ drafter: "lookup" | "model" | "off", draftTokens }` (a draft
    /// model is set with `setDraft`).
    speculative: Option<SpecOptions>,
    /// Constrained decoding: the output is JSON valid against this JSON schema (`{}` or
    /// `{"type": "object"}` for any object).
    json_schema: Option<serde_json::Value>,
    /// Constrained decoding: the output matches this regular expression.
    regex: Option<String>,
    /// Added to these tokens' logits (`{ "13": -100 }`), OpenAI's `logit_bias`.
    logit_bias: std::collections::BTreeMap<String, f32>,
    presence_penalty: f32,
    frequency_penalty: f32,
}

#[derive(serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct SpecOptions {
    drafter: crate::engine::Drafter,
    draft_tokens: Option<usize>,
}

#[derive(serde::Deserialize)]
struct Turn {
    role: String,
    content: String,
}

impl LoadOptions {
    pub(crate) fn from_js(options: JsValue) -> Result<LoadOptions, Failure> {
        if options.is_undefined() || options.is_null() {
            return Ok(LoadOptions::default());
        }
        serde_wasm_bindgen::from_value(options).map_err(|e| Failure::new("invalid_options", format!("load options: {e}")))
    }
}

impl Default for GenOptions {
    fn default() -> Self {
        GenOptions {
            max_tokens: 128,
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
            chat: false,
            system: None,
            history: Vec::new(),
            speculative: None,
            json_schema: None,
            regex: None,
            logit_bias: Default::default(),
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
        }
    }
}

/// A model on the GPU with its tokenizer.
#[wasm_bindgen]
pub struct Lantern {
    model: RefCell<Option<GpuModel>>,
    /// The draft model for `drafter: "model"` speculation (`setDraft`).
    draft: RefCell<Option<GpuModel>>,
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

    /// The models Lantern knows by name: `[{ name, file, bytes, family, params, format,
    /// license, default }]` (the demo offers those its site serves under `models/`).
    pub fn catalogue() -> Result<JsValue, JsError> {
        to_js(&crate::catalogue::entries())
    }

    /// Load the GGUF at `url` (same origin): from Cache Storage when an earlier load kept it,
    /// else downloaded into Cache Storage first (where the browser keeps it on disk).
    #[wasm_bindgen(js_name = loadUrl)]
    pub async fn load_url(url: String, options: JsValue, progress: Option<Function>) -> Result<Lantern, JsError> {
        let (blob, source) = fetch_cached(&url, &progress).await?;
        let name = url.rsplit('/').next().unwrap_or(&url).to_string();
        Self::load_blob(blob, name, source, options, progress).await
    }

    /// Load a GGUF the user picked (`<input type=file>` or drag and drop).
    #[wasm_bindgen(js_name = loadFile)]
    pub async fn load_file(file: web_sys::File, options: JsValue, progress: Option<Function>) -> Result<Lantern, JsError> {
        let name = file.name();
        Self::load_blob(file.into(), name, "file".into(), options, progress).await
    }

    /// Load a GGUF already in memory.
    #[wasm_bindgen(js_name = loadBytes)]
    pub async fn load_bytes(bytes: Uint8Array, name: String, options: JsValue, progress: Option<Function>) -> Result<Lantern, JsError> {
        let parts = js_sys::Array::of1(&bytes);
        let blob = web_sys::Blob::new_with_u8_array_sequence(&parts).map_err(|e| JsError::new(&format!("{name}: {e:?}")))?;
        Self::load_blob(blob, name, "bytes".into(), options, progress).await
    }

    async fn load_blob(
        blob: web_sys::Blob,
        name: String,
        source: String,
        options: JsValue,
        progress: Option<Function>,
    ) -> Result<Lantern, JsError> {
        let opts = LoadOptions::from_js(options)?;
        // One sequence at a time: `generate` runs one request (the `Engine` class batches).
        let l = load_blob(blob, name, source, LoadOptions { max_seqs: Some(1), ..opts }, &progress).await?;
        Ok(Lantern {
            model: RefCell::new(Some(l.model)),
            draft: RefCell::new(None),
            tokenizer: Arc::new(l.tokenizer),
            ctx: l.ctx,
            cancel: Rc::new(Cell::new(false)),
            name: l.name,
            file_bytes: l.file_bytes,
            source: l.source,
        })
    }

    /// Use `draft`'s model (another loaded `Lantern` with the same tokenizer: Qwen2.5-Coder
    /// 0.5B for the 1.5B) as this model's draft model for `speculative: { drafter: "model" }`.
    /// The draft's model moves here: `draft` can no longer generate by itself.
    #[wasm_bindgen(js_name = setDraft)]
    pub fn set_draft(&self, draft: &Lantern) -> Result<(), JsError> {
        let model = self.model.try_borrow().map_err(|_| JsError::new("a generation is running on this model"))?;
        let target = model.as_ref().ok_or_else(|| JsError::new("the model was released"))?;
        let mut slot = draft.model.try_borrow_mut().map_err(|_| JsError::new("a generation is running on the draft"))?;
        let d = slot.as_ref().ok_or_else(|| JsError::new("the draft's model was released or is already a draft"))?;
        crate::engine::speculative::check_pair((&self.name, &target.config, &self.tokenizer), (&draft.name, &d.config, &draft.tokenizer))
            .map_err(js_err)?;
        *self.draft.borrow_mut() = slot.take();
        Ok(())
    }

    /// Generate from `prompt`, calling `on_text(piece)` as text arrives. Resolves to
    /// `{ promptIds, outputIds, text, finishReason, ttftMs, tpotMs, tokensPerS, e2eMs,
    /// speculative, host }` (`speculative`: drafted, accepted, timings, when it was on;
    /// `host`: the host's work per decode token: dispatches, submits, readbacks...).
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
        let mut draft = self.draft.borrow_mut().take();
        let r = self.run(&mut model, draft.as_mut(), &prompt, &o, on_text).await;
        *self.model.borrow_mut() = Some(model);
        *self.draft.borrow_mut() = draft;
        r
    }

    async fn run(
        &self,
        model: &mut GpuModel,
        draft: Option<&mut GpuModel>,
        prompt: &str,
        o: &GenOptions,
        on_text: Option<Function>,
    ) -> Result<JsValue, JsError> {
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
            speculation: o.speculative.as_ref().map_or_else(Default::default, |s| crate::engine::Speculation {
                drafter: s.drafter,
                draft_tokens: s.draft_tokens,
                ..Default::default()
            }),
            constraint: match (o.json_schema.clone(), o.regex.clone()) {
                (Some(schema), _) => Some(crate::engine::Constraint::JsonSchema(schema)),
                (None, Some(r)) => Some(crate::engine::Constraint::Regex(r)),
                (None, None) => None,
            },
            logprobs: None,
            bias: crate::engine::LogitBias {
                tokens: o
                    .logit_bias
                    .iter()
                    .map(|(k, &v)| {
                        k.trim().parse::<u32>().map(|t| (t, v)).map_err(|_| JsError::new(&format!("logitBias key {k:?} is not a token id")))
                    })
                    .collect::<Result<_, _>>()?,
                presence_penalty: o.presence_penalty,
                frequency_penalty: o.frequency_penalty,
            },
        };
        let cancel = self.cancel.clone();
        let g = generate_with(model, draft, tok, &req, |piece| {
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
            speculative: Option<&'a crate::engine::SpecStats>,
            host: Option<&'a crate::engine::metrics::HostCosts>,
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
            speculative: g.speculative.as_ref(),
            host: g.host.as_ref(),
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
            "wasmMemoryBytes": wasm_memory_bytes(),
        });
        to_js(&v)
    }

    /// The adapter this model runs on.
    pub fn info(&self) -> Result<JsValue, JsError> {
        to_js(&self.ctx.adapter_json())
    }
}

/// A failed call's message and the `code` JavaScript sees on its error (`no_adapter`,
/// `download_failed`, `bad_model`, `out_of_memory`, `invalid_options`, ...).
pub(crate) struct Failure {
    pub code: &'static str,
    pub message: String,
}

impl Failure {
    pub(crate) fn new(code: &'static str, message: impl Into<String>) -> Failure {
        Failure { code, message: message.into() }
    }

    /// A JavaScript `Error` with `code` set.
    pub(crate) fn into_js(self) -> JsValue {
        let e = js_sys::Error::new(&self.message);
        let _ = js_sys::Reflect::set(&e, &"code".into(), &self.code.into());
        e.into()
    }
}

impl From<Failure> for JsError {
    fn from(f: Failure) -> JsError {
        JsError::new(&f.message)
    }
}

/// A model on the GPU, as loaded from a GGUF `Blob`.
pub(crate) struct Loaded {
    pub model: GpuModel,
    pub tokenizer: Tokenizer,
    pub ctx: Arc<GpuContext>,
    pub name: String,
    pub file_bytes: u64,
    /// `network`, `cache`, `file` or `bytes`.
    pub source: String,
}

/// The streamed load: header from the first bytes (grown until it holds the metadata), then
/// one layer's tensors at a time read from `blob` by byte range.
pub(crate) async fn load_blob(
    blob: web_sys::Blob,
    name: String,
    source: String,
    opts: LoadOptions,
    progress: &Option<Function>,
) -> Result<Loaded, Failure> {
    let total = blob.size() as u64;
    if !webgpu_present() {
        return Err(Failure::new(
            "no_adapter",
            "This browser has no WebGPU (navigator.gpu is missing). Use a recent Chrome or Edge, or Firefox/Safari with WebGPU enabled.",
        ));
    }
    let ctx = GpuContext::new(&DeviceOptions { backend: Some("webgpu".into()), ..Default::default() })
        .await
        .map_err(|e| Failure::new("no_adapter", format!("no usable WebGPU adapter: {e}")))?;
    let bad = |what: &str, o: &str, allowed: &str| Failure::new("invalid_options", format!("{what} must be {allowed}, not {o}"));
    let kv_dtype = match opts.kv_dtype.as_deref() {
        None | Some("f32") => crate::kv::plan::KvDtype::F32,
        Some("f16") => crate::kv::plan::KvDtype::F16,
        Some("q8") => crate::kv::plan::KvDtype::Q8,
        Some("q4") => crate::kv::plan::KvDtype::Q4,
        Some(o) => return Err(bad("kvDtype", o, "f32, f16, q8 or q4")),
    };
    let precision = match opts.weights.as_deref() {
        None | Some("native") => WeightPrecision::Native,
        Some("f32") => WeightPrecision::F32,
        Some("f16") => WeightPrecision::F16,
        Some(o) => return Err(bad("weights", o, "native, f32 or f16")),
    };
    let max_seqs = opts.max_seqs.unwrap_or(1);
    if !(1..=64).contains(&max_seqs) {
        return Err(Failure::new("invalid_options", format!("maxSeqs must be 1 to 64, not {max_seqs}")));
    }
    let options = ModelOptions {
        context: opts.context,
        max_seqs,
        kv_dtype,
        weights: precision,
        memory_budget: opts.memory_budget,
        ..Default::default()
    };
    let mut read = async |start: u64, end: u64| -> crate::Result<Vec<u8>> {
        read_range(&blob, start, end).await.map_err(|e| crate::LanternError::Read { source_name: name.clone(), reason: e })
    };
    let (model, tokenizer) = crate::model::load::load_gguf_streamed(ctx.clone(), &name, total, options, &mut read, &mut |done, total| {
        report(progress, "upload", done as f64, total as f64)
    })
    .await
    .map_err(|e| match e {
        crate::LanternError::Gguf(_)
        | crate::LanternError::Config { .. }
        | crate::LanternError::UnsupportedArchitecture { .. }
        | crate::LanternError::Read { .. }
        | crate::LanternError::Load(_) => Failure::new("bad_model", format!("{name} is not a usable GGUF model: {e}")),
        crate::LanternError::Tokenizer(_) => Failure::new("bad_model", format!("{name}: no usable tokenizer: {e}")),
        e @ (crate::LanternError::MemoryBudget { .. } | crate::LanternError::Gpu(crate::gpu::GpuError::Allocation { .. })) => {
            Failure::new("out_of_memory", format!("{name} does not fit: {e}"))
        }
        crate::LanternError::Gpu(crate::gpu::GpuError::BindingTooLarge { .. }) => {
            Failure::new("out_of_memory", format!("{name} does not fit this adapter: {e}"))
        }
        other => Failure::new("load_failed", format!("loading {name}: {other}")),
    })?;
    Ok(Loaded { model, tokenizer, ctx, name, file_bytes: total, source })
}

/// The wasm heap as it stands (it grows to the load's peak and never shrinks).
fn wasm_memory_bytes() -> u32 {
    wasm_bindgen::memory().unchecked_into::<js_sys::WebAssembly::Memory>().buffer().unchecked_into::<js_sys::ArrayBuffer>().byte_length()
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

/// Bytes `[start, end)` of `blob`.
async fn read_range(blob: &web_sys::Blob, start: u64, end: u64) -> Result<Vec<u8>, String> {
    let part = blob.slice_with_f64_and_f64(start as f64, end as f64).map_err(|e| format!("{e:?}"))?;
    let buf = JsFuture::from(part.array_buffer()).await.map_err(|e| format!("{e:?}"))?;
    let view = Uint8Array::new(&buf);
    let mut out = vec![0u8; view.length() as usize];
    view.copy_to(&mut out);
    if out.len() as u64 != end - start {
        return Err(format!("read {} bytes at {start}, expected {}", out.len(), end - start));
    }
    Ok(out)
}

/// `resp`'s body as a stream reporting its bytes as `phase` (the download's progress) as they
/// pass. Its consumer (the cache write) pulls it, so the network is read only as fast as the
/// cache takes it and nothing queues in the page. (A `tee`d clone counted by a second reader
/// queued the file in the renderer whenever the counting branch ran ahead of the cache: a
/// 1223 MB renderer peak downloading a 1117 MB model.)
struct CountingBody {
    stream: web_sys::ReadableStream,
    /// Bytes passed so far, and the Content-Length (0 when the server sent none).
    count: Rc<Cell<u64>>,
    total: u64,
    /// Why the network read failed, if it did.
    failed: Rc<RefCell<Option<String>>>,
    _pull: Closure<dyn FnMut(JsValue) -> js_sys::Promise>,
}

fn counting_body(resp: &web_sys::Response, phase: &'static str, progress: &Option<Function>) -> Result<CountingBody, Failure> {
    let total = resp.headers().get("content-length").ok().flatten().and_then(|s| s.parse::<u64>().ok()).unwrap_or(0);
    let body = resp.body().ok_or_else(|| Failure::new("download_failed", "the response has no body"))?;
    let reader: web_sys::ReadableStreamDefaultReader = body.get_reader().unchecked_into();
    let count = Rc::new(Cell::new(0u64));
    let failed = Rc::new(RefCell::new(None));
    let (c, f, progress) = (count.clone(), failed.clone(), progress.clone());
    let pull = Closure::<dyn FnMut(JsValue) -> js_sys::Promise>::new(move |controller: JsValue| {
        let controller: web_sys::ReadableStreamDefaultController = controller.unchecked_into();
        let (reader, count, failed, progress) = (reader.clone(), c.clone(), f.clone(), progress.clone());
        wasm_bindgen_futures::future_to_promise(async move {
            let chunk = match JsFuture::from(reader.read()).await {
                Ok(chunk) => chunk,
                Err(e) => {
                    *failed.borrow_mut() = Some(format!("{e:?}"));
                    return Err(e);
                }
            };
            if js_sys::Reflect::get(&chunk, &"done".into())?.as_bool().unwrap_or(true) {
                controller.close()?;
                return Ok(JsValue::UNDEFINED);
            }
            let value: Uint8Array = js_sys::Reflect::get(&chunk, &"value".into())?.unchecked_into();
            count.set(count.get() + value.length() as u64);
            report(&progress, phase, count.get() as f64, total.max(count.get()) as f64);
            controller.enqueue_with_chunk(&value)?;
            Ok(JsValue::UNDEFINED)
        })
    });
    let source = js_sys::Object::new();
    js_sys::Reflect::set(&source, &"pull".into(), pull.as_ref()).map_err(|e| Failure::new("download_failed", format!("{e:?}")))?;
    let stream =
        web_sys::ReadableStream::new_with_underlying_source(&source).map_err(|e| Failure::new("download_failed", format!("{e:?}")))?;
    Ok(CountingBody { stream, count, total, failed, _pull: pull })
}

async fn response_blob(resp: &web_sys::Response, url: &str) -> Result<web_sys::Blob, Failure> {
    let b = JsFuture::from(resp.blob().map_err(|e| Failure::new("download_failed", format!("{url}: {e:?}")))?)
        .await
        .map_err(|e| Failure::new("download_failed", format!("{url}: {e:?}")))?;
    Ok(b.unchecked_into())
}

/// `url` as a `Blob`: from Cache Storage when present ("cache"), else downloaded into it
/// ("network"; the body streams into the cache while a clone of it counts the progress) and
/// read back from there. Without Cache Storage the response itself is the blob.
async fn fetch_cached(url: &str, progress: &Option<Function>) -> Result<(web_sys::Blob, String), Failure> {
    let cache = match cache_storage() {
        Some(cs) => JsFuture::from(cs.open(CACHE_NAME)).await.ok().map(|c| c.unchecked_into::<web_sys::Cache>()),
        None => None,
    };
    if let Some(c) = &cache {
        if let Ok(hit) = JsFuture::from(c.match_with_str(url)).await {
            if let Ok(resp) = hit.dyn_into::<web_sys::Response>() {
                if let Ok(blob) = response_blob(&resp, url).await {
                    return Ok((blob, "cache".into()));
                }
            }
        }
    }
    let g = js_sys::global();
    let fetch: Function =
        js_sys::Reflect::get(&g, &"fetch".into()).map_err(|_| Failure::new("download_failed", "no fetch"))?.unchecked_into();
    let resp = JsFuture::from(js_sys::Promise::from(
        fetch.call1(&g, &url.into()).map_err(|e| Failure::new("download_failed", format!("fetching {url}: {e:?}")))?,
    ))
    .await
    .map_err(|e| Failure::new("download_failed", format!("could not download {url}: {e:?}")))?;
    let resp: web_sys::Response = resp.unchecked_into();
    if !resp.ok() {
        return Err(Failure::new("download_failed", format!("could not download {url}: HTTP {} {}", resp.status(), resp.status_text())));
    }
    if let Some(c) = &cache {
        // The download streams into the cache and is read back from there (on disk).
        let body = counting_body(&resp, "download", progress)?;
        let counted = web_sys::Response::new_with_opt_readable_stream(Some(&body.stream))
            .map_err(|e| Failure::new("download_failed", format!("{e:?}")))?;
        let put = JsFuture::from(c.put_with_str(url, &counted)).await;
        if let Some(e) = body.failed.borrow().as_ref() {
            let _ = JsFuture::from(c.delete_with_str(url)).await;
            return Err(Failure::new("download_failed", format!("download of {url} interrupted after {} bytes: {e}", body.count.get())));
        }
        if body.total > 0 && body.count.get() < body.total {
            let _ = JsFuture::from(c.delete_with_str(url)).await;
            return Err(Failure::new(
                "download_failed",
                format!("download of {url} truncated: {} of {} bytes", body.count.get(), body.total),
            ));
        }
        // Failing to store (quota) only costs a download next time: read the response again.
        if put.is_ok() {
            if let Ok(hit) = JsFuture::from(c.match_with_str(url)).await {
                if let Ok(stored) = hit.dyn_into::<web_sys::Response>() {
                    return Ok((response_blob(&stored, url).await?, "network".into()));
                }
            }
        }
        let again = JsFuture::from(js_sys::Promise::from(
            fetch.call1(&g, &url.into()).map_err(|e| Failure::new("download_failed", format!("fetching {url}: {e:?}")))?,
        ))
        .await
        .map_err(|e| Failure::new("download_failed", format!("could not download {url}: {e:?}")))?;
        return Ok((response_blob(&again.unchecked_into(), url).await?, "network".into()));
    }
    Ok((response_blob(&resp, url).await?, "network".into()))
}

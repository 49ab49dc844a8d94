//! Ollama's generation API (`POST /api/chat`, `POST /api/generate`) translated into the
//! OpenAI request this module validates, and the engine's output written back in Ollama's
//! shape (one JSON object, or newline-delimited JSON when streamed).
//!
//! A request becomes a [`RequestBody`] (chat: `messages`, `tools`, `format` as a
//! `response_format`, `options` as the sampler's fields) and goes through [`validate`], so
//! both APIs accept and refuse the same things; a refusal's field is then named the way
//! Ollama's client wrote it (`options.temperature`, `format`). As in Ollama:
//! - `stream` defaults to true;
//! - the sampler defaults are Ollama's (temperature 0.8, top_k 40, top_p 0.9; no model file
//!   parameters exist here to override them), and `num_predict` -1 or -2 (or none) means
//!   "until the end of the sequence or the context";
//! - options that only tune how Ollama loads a model (`num_ctx`, `num_gpu`, `num_thread`,
//!   ...) are ignored, while sampler options this server does not implement are refused
//!   unless they hold their neutral value (`repeat_penalty` 1, `mirostat` 0, ...), so that no
//!   request silently samples differently from what it asked;
//! - `/api/generate` with an empty prompt only reports that the model is loaded
//!   (`done_reason: "load"`); `raw: true` skips the chat template.

use std::sync::Arc;

use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::{typed_body, validate, ApiError, Content, Endpoint, Logprobs, MessageIn, Prompt, RequestBody, ServedModel, Stop, Validated};
use crate::api::tools::{self, Tools};
use crate::engine::{Generation, TokenLogprob};

/// Ollama's sampler defaults (its `api.DefaultOptions`).
pub const DEFAULT_TEMPERATURE: f64 = 0.8;
pub const DEFAULT_TOP_K: i64 = 40;
pub const DEFAULT_TOP_P: f64 = 0.9;

/// `POST /api/chat`. Unknown fields are ignored, as Ollama does.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct ChatBody {
    pub model: Option<String>,
    pub messages: Option<Vec<Message>>,
    pub tools: Option<Vec<tools::Tool>>,
    /// `"json"`, a JSON schema, or `""`/null (free text).
    pub format: Option<Value>,
    pub options: Option<Options>,
    pub stream: Option<bool>,
    /// Accepted and ignored: the served model stays loaded.
    pub keep_alive: Option<Value>,
    pub think: Option<Value>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<u64>,
}

/// `POST /api/generate`.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct GenerateBody {
    pub model: Option<String>,
    pub prompt: Option<String>,
    pub suffix: Option<String>,
    pub system: Option<String>,
    pub template: Option<String>,
    /// The deprecated token context of an earlier answer.
    pub context: Option<Vec<u64>>,
    pub raw: Option<bool>,
    pub images: Option<Vec<Value>>,
    pub format: Option<Value>,
    pub options: Option<Options>,
    pub stream: Option<bool>,
    pub keep_alive: Option<Value>,
    pub think: Option<Value>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Message {
    pub role: String,
    pub content: Option<String>,
    pub images: Option<Vec<Value>>,
    /// An assistant message's calls: `[{"function": {"name", "arguments": {...}}}]`.
    pub tool_calls: Option<Vec<Value>>,
    /// A `tool` message's function.
    pub tool_name: Option<String>,
    pub thinking: Option<String>,
}

/// The `options` this server reads; other keys (Ollama's loading options) are ignored.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Options {
    pub seed: Option<serde_json::Number>,
    pub num_predict: Option<i64>,
    pub top_k: Option<i64>,
    pub top_p: Option<f64>,
    pub temperature: Option<f64>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub stop: Option<Stop>,
    // Sampler options without an implementation here: refused unless neutral.
    pub repeat_penalty: Option<f64>,
    pub min_p: Option<f64>,
    pub typical_p: Option<f64>,
    pub tfs_z: Option<f64>,
    pub mirostat: Option<i64>,
}

/// A validated Ollama generation request.
#[derive(Debug, Clone)]
pub struct Request {
    pub validated: Validated,
    /// NDJSON lines as tokens arrive (Ollama's default), or one object.
    pub stream: bool,
    /// `/api/chat` (a `message`) or `/api/generate` (a `response`).
    pub chat: bool,
}

/// What `/api/generate` asked for.
#[derive(Debug, Clone)]
pub enum Generate {
    Run(Box<Request>),
    /// An empty prompt: Ollama's way to load a model; answered at once.
    Load {
        stream: bool,
    },
}

/// Ollama's error body: `{"error": "..."}`.
pub fn error_body(e: &ApiError) -> String {
    json!({ "error": e.message }).to_string()
}

/// Whether `m` names the served model, Ollama-style (`name` or `name:latest`).
pub fn knows_model(model: &ServedModel, m: &str) -> bool {
    model.knows_model(m) || m.strip_suffix(":latest").is_some_and(|b| model.knows_model(b))
}

fn not_found(model: &ServedModel, m: &str) -> ApiError {
    ApiError::new(404, "not_found_error", format!("model {m:?} not found: this server serves {:?} (see /api/tags)", model.model_id))
        .param("model")
        .code("model_not_found")
}

/// The OpenAI field names [`validate`] reports, as Ollama's client wrote them.
fn rename(mut e: ApiError, input: &str) -> ApiError {
    let Some(p) = e.param.clone() else { return e };
    let to = match p.as_str() {
        "max_tokens" | "max_completion_tokens" => "options.num_predict".to_string(),
        "temperature" | "top_p" | "top_k" | "seed" | "stop" | "presence_penalty" | "frequency_penalty" => format!("options.{p}"),
        "response_format" => "format".to_string(),
        "messages" | "prompt" => input.to_string(),
        _ => p.clone(),
    };
    if to != p {
        e.message = e.message.replace(&format!("`{p}`"), &format!("`{to}`"));
    }
    if !e.message.contains(&to) {
        e.message = format!("{to}: {}", e.message);
    }
    e.param = Some(to);
    e
}

pub(crate) fn check_model(model: &ServedModel, m: Option<&str>) -> Result<String, ApiError> {
    match m {
        None | Some("") => Err(ApiError::bad("model is required").param("model").code("missing_required_parameter")),
        Some(m) if knows_model(model, m) => Ok(model.model_id.clone()),
        Some(m) => Err(not_found(model, m)),
    }
}

fn refuse_thinking(model: &ServedModel, think: Option<&Value>) -> Result<(), ApiError> {
    match think {
        None | Some(Value::Null) | Some(Value::Bool(false)) => Ok(()),
        Some(_) => Err(ApiError::bad(format!("{:?} does not support thinking", model.model_id)).param("think")),
    }
}

fn refuse_images(images: Option<&Vec<Value>>, param: String) -> Result<(), ApiError> {
    match images {
        Some(v) if !v.is_empty() => Err(ApiError::bad(format!("{param}: this model does not take images")).param(param)),
        _ => Ok(()),
    }
}

/// The sampler fields of an OpenAI body from Ollama's `options`, `format` and logprobs.
fn sampler(
    req: &mut RequestBody,
    options: Option<Options>,
    format: Option<Value>,
    logprobs: Option<bool>,
    top_logprobs: Option<u64>,
) -> Result<(), ApiError> {
    let o = options.unwrap_or_default();
    for (key, v, neutral) in [
        ("repeat_penalty", o.repeat_penalty, 1.0),
        ("min_p", o.min_p, 0.0),
        ("typical_p", o.typical_p, 1.0),
        ("tfs_z", o.tfs_z, 1.0),
        ("mirostat", o.mirostat.map(|m| m as f64), 0.0),
    ] {
        if let Some(v) = v.filter(|&v| v != neutral) {
            return Err(ApiError::bad(format!(
                "options.{key} is {v}: this server does not implement {key} (leave it out, or set it to {neutral})"
            ))
            .param(format!("options.{key}"))
            .code("unsupported_parameter"));
        }
    }
    req.temperature = Some(o.temperature.unwrap_or(DEFAULT_TEMPERATURE));
    req.top_k = Some(o.top_k.unwrap_or(DEFAULT_TOP_K));
    req.top_p = Some(o.top_p.unwrap_or(DEFAULT_TOP_P));
    req.seed = o.seed;
    req.presence_penalty = o.presence_penalty;
    req.frequency_penalty = o.frequency_penalty;
    req.stop = o.stop;
    req.max_tokens = match o.num_predict {
        // Until the end of the sequence (-1) or the context (-2): validation caps it.
        None | Some(-1) | Some(-2) => Some(u64::MAX),
        Some(n) if n >= 0 => Some(n as u64),
        Some(n) => {
            return Err(ApiError::bad(format!("options.num_predict is {n}; it must be -2, -1 or at least 0")).param("options.num_predict"))
        }
    };
    req.response_format = match format {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if s.is_empty() => None,
        Some(Value::String(s)) if s == "json" => Some(json!({"type": "json_object"})),
        Some(schema @ (Value::Object(_) | Value::Bool(_))) => {
            Some(json!({"type": "json_schema", "json_schema": {"name": "format", "schema": schema}}))
        }
        Some(other) => return Err(ApiError::bad(format!("format must be \"json\" or a JSON schema object, not {other}")).param("format")),
    };
    match (logprobs, top_logprobs) {
        (Some(true), k) => {
            req.logprobs = Some(Logprobs::Flag(true));
            req.top_logprobs = k.filter(|&k| k > 0);
        }
        (_, Some(k)) if k > 0 => return Err(ApiError::bad("top_logprobs needs logprobs: true").param("top_logprobs")),
        _ => {}
    }
    Ok(())
}

/// Deserialize and validate a `/api/chat` body.
pub fn parse_chat(model: &ServedModel, bytes: &[u8]) -> Result<Request, ApiError> {
    let b: ChatBody = typed_body(bytes)?;
    let id = check_model(model, b.model.as_deref())?;
    refuse_thinking(model, b.think.as_ref())?;
    let Some(list) = b.messages else {
        return Err(ApiError::bad("messages is required").param("messages").code("missing_required_parameter"));
    };
    let mut messages = Vec::with_capacity(list.len());
    for (i, m) in list.into_iter().enumerate() {
        refuse_images(m.images.as_ref(), format!("messages[{i}].images"))?;
        // Earlier calls in OpenAI's shape (arguments stay an object: templates print them).
        let tool_calls = m.tool_calls.map(|calls| {
            calls
                .into_iter()
                .enumerate()
                .map(|(j, c)| {
                    let f = c.get("function").cloned().unwrap_or(Value::Null);
                    json!({"type": "function", "id": format!("call{i}-{j}"), "function": {
                        "name": f.get("name").cloned().unwrap_or_default(),
                        "arguments": f.get("arguments").cloned().unwrap_or_else(|| json!({})),
                    }})
                })
                .collect()
        });
        messages.push(MessageIn {
            role: m.role,
            content: Some(Content::Text(m.content.unwrap_or_default())),
            name: m.tool_name,
            tool_calls,
            tool_call_id: None,
        });
    }
    let mut req = RequestBody { model: Some(id), messages: Some(messages), tools: b.tools, ..Default::default() };
    sampler(&mut req, b.options, b.format, b.logprobs, b.top_logprobs)?;
    let validated = validate(model, Endpoint::Chat, req).map_err(|e| rename(e, "messages"))?;
    Ok(Request { validated, stream: b.stream.unwrap_or(true), chat: true })
}

/// Deserialize and validate a `/api/generate` body: the prompt (and `system`) through the
/// chat template, or as it is with `raw: true`.
pub fn parse_generate(model: &ServedModel, bytes: &[u8]) -> Result<Generate, ApiError> {
    let b: GenerateBody = typed_body(bytes)?;
    let id = check_model(model, b.model.as_deref())?;
    refuse_thinking(model, b.think.as_ref())?;
    refuse_images(b.images.as_ref(), "images".into())?;
    let stream = b.stream.unwrap_or(true);
    for (key, v) in [("suffix", &b.suffix), ("template", &b.template)] {
        if v.as_deref().is_some_and(|s| !s.is_empty()) {
            let why = if key == "template" {
                "the model's own chat template is used (or none with raw: true)"
            } else {
                "fill-in-the-middle is not supported"
            };
            return Err(ApiError::bad(format!("{key} is not supported: {why}")).param(key).code("unsupported_parameter"));
        }
    }
    if b.context.as_ref().is_some_and(|c| !c.is_empty()) {
        return Err(ApiError::bad("context (an earlier answer's tokens) is not supported: send the conversation to /api/chat")
            .param("context")
            .code("unsupported_parameter"));
    }
    let prompt = b.prompt.unwrap_or_default();
    if prompt.is_empty() {
        return Ok(Generate::Load { stream });
    }
    let raw = b.raw.unwrap_or(false);
    let mut req = RequestBody { model: Some(id), ..Default::default() };
    let endpoint = if raw {
        if b.system.as_deref().is_some_and(|s| !s.is_empty()) {
            return Err(ApiError::bad("system has no place in a raw prompt (raw: true skips the template)").param("system"));
        }
        req.prompt = Some(Prompt::Text(prompt));
        Endpoint::Completions
    } else {
        let mut messages = Vec::new();
        if let Some(s) = b.system.filter(|s| !s.is_empty()) {
            messages.push(MessageIn {
                role: "system".into(),
                content: Some(Content::Text(s)),
                name: None,
                tool_calls: None,
                tool_call_id: None,
            });
        }
        messages.push(MessageIn {
            role: "user".into(),
            content: Some(Content::Text(prompt)),
            name: None,
            tool_calls: None,
            tool_call_id: None,
        });
        req.messages = Some(messages);
        Endpoint::Chat
    };
    sampler(&mut req, b.options, b.format, b.logprobs, b.top_logprobs)?;
    if raw {
        // Completions count alternatives instead of a flag.
        if let Some(Logprobs::Flag(true)) = req.logprobs {
            req.logprobs = Some(Logprobs::Count(req.top_logprobs.take().unwrap_or(0)));
        }
    }
    let validated = validate(model, endpoint, req).map_err(|e| rename(e, "prompt"))?;
    Ok(Generate::Run(Box::new(Request { validated, stream, chat: false })))
}

/// One accepted Ollama request's identity in its answer lines.
#[derive(Debug, Clone)]
pub struct Job {
    pub model: String,
    pub chat: bool,
    pub prompt_tokens: usize,
    /// Tool call ids' prefix.
    pub id: String,
    pub tools: Option<Tools>,
    /// Every token's bytes, when the request asked for logprobs.
    pub token_bytes: Option<Arc<Vec<Vec<u8>>>>,
}

impl Job {
    fn head(&self, created_at: &str, text: &str, done: bool) -> Map<String, Value> {
        let mut o = Map::new();
        o.insert("model".into(), json!(self.model));
        o.insert("created_at".into(), json!(created_at));
        if self.chat {
            o.insert("message".into(), json!({"role": "assistant", "content": text}));
        } else {
            o.insert("response".into(), json!(text));
        }
        o.insert("done".into(), json!(done));
        o
    }

    /// Ollama's `logprobs` entries for these tokens.
    pub fn logprobs(&self, lps: &[TokenLogprob]) -> Option<Value> {
        let words = self.token_bytes.as_ref()?;
        let entry = |id: u32, lp: f32| {
            let b = words.get(id as usize).cloned().unwrap_or_default();
            json!({"token": String::from_utf8_lossy(&b), "logprob": lp, "bytes": b})
        };
        Some(Value::Array(
            lps.iter()
                .map(|t| {
                    let mut e = entry(t.id, t.logprob);
                    if !t.top.is_empty() {
                        e["top_logprobs"] = Value::Array(t.top.iter().map(|&(id, lp)| entry(id, lp)).collect());
                    }
                    e
                })
                .collect(),
        ))
    }

    /// A streamed line with a piece of text (and its tokens' log-probabilities).
    pub fn delta(&self, created_at: &str, text: &str, lps: &[TokenLogprob]) -> Value {
        let mut o = self.head(created_at, text, false);
        if let Some(l) = self.logprobs(lps).filter(|_| !lps.is_empty()) {
            o.insert("logprobs".into(), l);
        }
        Value::Object(o)
    }

    /// Chat: the calls in the whole text, in Ollama's shape (arguments an object), and the
    /// text outside them; `None` without tools or calls.
    pub fn calls(&self, text: &str) -> Option<(String, Vec<Value>)> {
        let (content, calls) = self.tools.as_ref()?.parse(text, &self.id)?;
        let calls = calls
            .into_iter()
            .enumerate()
            .map(|(i, c)| {
                json!({"id": c.id, "function": {"index": i, "name": c.function.name,
                    "arguments": tools::arguments_value(Some(&Value::String(c.function.arguments)))}})
            })
            .collect();
        Some((content.unwrap_or_default(), calls))
    }

    /// A streamed line carrying the message's tool calls.
    pub fn calls_line(&self, created_at: &str, calls: Vec<Value>) -> Value {
        let mut o = self.head(created_at, "", false);
        o["message"]["tool_calls"] = Value::Array(calls);
        Value::Object(o)
    }

    /// The last line: `done`, why, token counts and durations (nanoseconds; the prompt's
    /// evaluation is the time to the first token). `whole`: the non-streamed answer, with the
    /// whole text, tool calls and log-probabilities.
    pub fn done(&self, created_at: &str, g: &Generation, whole: bool) -> Value {
        let (text, calls) = match (whole, self.chat.then(|| self.calls(&g.text)).flatten()) {
            (false, _) => (String::new(), None),
            (true, Some((content, calls))) => (content, Some(calls)),
            (true, None) => (g.text.clone(), None),
        };
        let mut o = self.head(created_at, &text, true);
        if let Some(calls) = calls {
            o["message"]["tool_calls"] = Value::Array(calls);
        }
        if whole {
            if let Some(l) = self.logprobs(&g.logprobs) {
                o.insert("logprobs".into(), l);
            }
        }
        let m = g.timings.metrics();
        let ns = |ms: f64| (ms * 1e6).round().max(0.0) as u64;
        let (ttft, e2e) = (m.ttft_ms.unwrap_or(0.0), m.e2e_ms.unwrap_or(0.0));
        o.insert("done_reason".into(), json!(super::finish_reason(g.finish_reason)));
        o.insert("total_duration".into(), json!(ns(e2e)));
        o.insert("load_duration".into(), json!(0));
        o.insert("prompt_eval_count".into(), json!(self.prompt_tokens));
        o.insert("prompt_eval_duration".into(), json!(ns(ttft)));
        o.insert("eval_count".into(), json!(g.output_ids.len()));
        o.insert("eval_duration".into(), json!(ns((e2e - ttft).max(0.0))));
        Value::Object(o)
    }

    /// `/api/generate`'s answer to an empty prompt.
    pub fn load(model: &str, created_at: &str) -> Value {
        json!({"model": model, "created_at": created_at, "response": "", "done": true, "done_reason": "load"})
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn option_type_errors_name_their_field() {
        let e = typed_body::<ChatBody>(br#"{"options": {"temperature": "hot"}}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("options.temperature"));
        let e = typed_body::<GenerateBody>(br#"{"prompt": 3}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("prompt"));
        // Unknown options (Ollama's loading knobs) are ignored.
        let b = typed_body::<ChatBody>(br#"{"options": {"num_ctx": 4096, "num_gpu": 1, "seed": 3}}"#).unwrap();
        assert_eq!(b.options.unwrap().seed.and_then(|s| s.as_u64()), Some(3));
    }

    #[test]
    fn validation_errors_use_ollama_names() {
        let e = rename(ApiError::bad("`temperature` is 3; it must be between 0 and 2").param("temperature"), "messages");
        assert_eq!(e.param.as_deref(), Some("options.temperature"));
        assert_eq!(e.message, "`options.temperature` is 3; it must be between 0 and 2");
        let e = rename(ApiError::bad("the grammar does not compile").param("response_format"), "messages");
        assert_eq!((e.param.as_deref(), e.message.as_str()), (Some("format"), "format: the grammar does not compile"));
        let e = rename(ApiError::bad("the messages is empty").param("messages"), "prompt");
        assert_eq!(e.param.as_deref(), Some("prompt"));
    }

    #[test]
    fn formats_and_neutral_options() {
        let mut r = RequestBody::default();
        sampler(&mut r, None, Some(json!("json")), None, None).unwrap();
        assert_eq!(r.response_format, Some(json!({"type": "json_object"})));
        assert_eq!((r.temperature, r.top_k, r.top_p, r.max_tokens), (Some(0.8), Some(40), Some(0.9), Some(u64::MAX)));
        let schema = json!({"type": "object"});
        sampler(&mut r, None, Some(schema.clone()), None, None).unwrap();
        assert_eq!(r.response_format.as_ref().unwrap()["json_schema"]["schema"], schema);
        assert!(sampler(&mut r, None, Some(json!(3)), None, None).is_err());
        let o: Options = serde_json::from_value(json!({"repeat_penalty": 1.0, "mirostat": 0})).unwrap();
        sampler(&mut r, Some(o), None, None, None).unwrap();
        let o: Options = serde_json::from_value(json!({"repeat_penalty": 1.1})).unwrap();
        let e = sampler(&mut r, Some(o), None, None, None).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("options.repeat_penalty"));
        let o: Options = serde_json::from_value(json!({"num_predict": -3})).unwrap();
        assert_eq!(sampler(&mut r, Some(o), None, None, None).unwrap_err().param.as_deref(), Some("options.num_predict"));
        assert!(sampler(&mut r, None, None, None, Some(2)).is_err());
    }
}

//! The HTTP APIs `lantern serve` and the browser package speak, as typed requests. First
//! OpenAI's: its request and response types, and the validation that turns a request body
//! into a [`GenerateRequest`] (`lantern serve` is the transport around it: src/bin/lantern/serve/).
//!
//! Requests are typed serde structs, deserialized through `serde_path_to_error`, so a field
//! of the wrong type is a 400 naming that field (`param`), in OpenAI's error shape. What the
//! types accept is then checked against the served model ([`ServedModel`]: its tokenizer,
//! chat template, vocabulary, context and KV pool). Nothing here blocks, touches the network
//! or the GPU: the fuzz target `openai_request` drives [`parse_request`] on arbitrary bytes.
//!
//! The other APIs `lantern serve` speaks are translated into these requests, so that they
//! accept and refuse the same things: [`responses`] (the Responses API), [`anthropic`] (the
//! Messages API), [`ollama`] (Ollama's
//! `/api/chat` and `/api/generate`)
//! and [`tokenize`] (vLLM's `/tokenize` and `/detokenize`, no generation).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

pub mod anthropic;
pub mod embeddings;
pub mod ollama;
pub mod responses;
pub mod stream;
pub mod tokenize;
pub mod tools;

use tools::{CallStream, StreamPiece, ToolCall, ToolCallDelta, Tools};

use crate::engine::{
    Constraint, Drafter, FinishReason, GenerateRequest, Generation, LogitBias, SamplingParams, SpecStats, Speculation, TokenLogprob,
};
use crate::model::tokenizer::{ChatTemplate, Tokenizer};

/// Stop strings per request at most.
pub const MAX_STOP: usize = 16;
/// Seconds suggested in `Retry-After` of 429 and 503 answers.
pub const RETRY_AFTER_S: u32 = 1;

/// An error in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`, with its
/// HTTP status and the headers it needs.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: u16,
    pub kind: &'static str,
    pub message: String,
    pub param: Option<String>,
    pub code: Option<&'static str>,
    pub headers: Vec<(&'static str, String)>,
}

#[derive(Serialize)]
struct ErrorBody<'a> {
    error: ErrorFields<'a>,
}

#[derive(Serialize)]
struct ErrorFields<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'a str,
    param: Option<&'a str>,
    code: Option<&'a str>,
}

impl ApiError {
    pub fn new(status: u16, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError { status, kind, message: message.into(), param: None, code: None, headers: Vec::new() }
    }

    /// 400 `invalid_request_error`.
    pub fn bad(message: impl Into<String>) -> Self {
        Self::new(400, "invalid_request_error", message)
    }

    pub fn param(mut self, p: impl Into<String>) -> Self {
        self.param = Some(p.into());
        self
    }

    pub fn code(mut self, c: &'static str) -> Self {
        self.code = Some(c);
        self
    }

    pub fn header(mut self, name: &'static str, value: impl Into<String>) -> Self {
        self.headers.push((name, value.into()));
        self
    }

    pub fn retry_after(self) -> Self {
        self.header("Retry-After", RETRY_AFTER_S.to_string())
    }

    /// The JSON body.
    pub fn body(&self) -> String {
        let e = ErrorBody { error: ErrorFields { message: &self.message, kind: self.kind, param: self.param.as_deref(), code: self.code } };
        serde_json::to_string(&e).unwrap_or_else(|_| String::from("{\"error\":{\"message\":\"error\"}}"))
    }

    fn unsupported(key: &str, what: &str) -> Self {
        ApiError::bad(format!("{what} is not supported by this server")).param(key).code("unsupported_parameter")
    }
}

// ---------------------------------------------------------------------------------------
// Requests
// ---------------------------------------------------------------------------------------

/// The body of `POST /v1/completions` and `POST /v1/chat/completions` (one type: the two
/// share almost every field; [`parse_request`] refuses the other endpoint's fields). Unknown
/// fields are ignored, as OpenAI's servers do.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct RequestBody {
    pub model: Option<String>,
    /// Completions: a string, a list of token ids, or a one-element list of either.
    pub prompt: Option<Prompt>,
    /// Chat.
    pub messages: Option<Vec<MessageIn>>,
    pub max_tokens: Option<u64>,
    /// Chat's newer name for `max_tokens`.
    pub max_completion_tokens: Option<u64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    /// An extension most servers accept: 0 or -1 = off.
    pub top_k: Option<i64>,
    pub seed: Option<serde_json::Number>,
    pub stop: Option<Stop>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub n: Option<u64>,
    pub best_of: Option<u64>,
    pub echo: Option<bool>,
    pub suffix: Option<String>,
    /// Chat: `true`/`false`; completions: the number of top entries (0 = off).
    pub logprobs: Option<Logprobs>,
    pub top_logprobs: Option<u64>,
    /// `{"type": "text" | "json_object" | "json_schema", "json_schema": {"name", "schema",
    /// "strict"}}` ([`Constraint::from_response_format`]).
    pub response_format: Option<serde_json::Value>,
    pub tools: Option<Vec<tools::Tool>>,
    pub tool_choice: Option<serde_json::Value>,
    pub functions: Option<Vec<serde_json::Value>>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub logit_bias: Option<BTreeMap<String, f64>>,
    pub user: Option<String>,
    /// An extension: `{"drafter": "lookup" | "model" | "off", "draft_tokens": k}`.
    pub speculative: Option<SpeculativeIn>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u64>),
    Many(Vec<PromptItem>),
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum PromptItem {
    Text(String),
    Tokens(Vec<u64>),
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Logprobs {
    Flag(bool),
    Count(u64),
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SpeculativeIn {
    #[serde(default)]
    pub drafter: Option<Drafter>,
    #[serde(default)]
    pub draft_tokens: Option<u8>,
}

#[derive(Debug, Deserialize)]
pub struct MessageIn {
    pub role: String,
    #[serde(default)]
    pub content: Option<Content>,
    #[serde(default)]
    pub name: Option<String>,
    /// An assistant message's earlier calls.
    #[serde(default)]
    pub tool_calls: Option<Vec<serde_json::Value>>,
    /// A `tool` message's call id.
    #[serde(default)]
    pub tool_call_id: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: Option<String>,
}

/// Which endpoint a body was sent to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    Chat,
}

impl Endpoint {
    /// The route.
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Completions => "/v1/completions",
            Endpoint::Chat => "/v1/chat/completions",
        }
    }

    /// The request field holding the input.
    fn input(self) -> &'static str {
        match self {
            Endpoint::Completions => "prompt",
            Endpoint::Chat => "messages",
        }
    }
}

/// What validation needs to know of the served model.
pub struct ServedModel {
    pub tokenizer: std::sync::Arc<Tokenizer>,
    /// The chat template, or why there is none.
    pub template: std::result::Result<ChatTemplate, String>,
    pub stop_ids: Vec<u32>,
    pub vocab: usize,
    pub context: usize,
    pub kv_pages_total: usize,
    pub page_size: usize,
    /// The id /v1/models lists and responses carry.
    pub model_id: String,
    /// Other names accepted in a request's `model` (the model path).
    pub aliases: Vec<String>,
    /// The speculative decoding requests get unless they ask otherwise.
    pub speculation: Speculation,
    /// Sequences the engine runs at once: the most choices (`n`) one request may ask for.
    pub max_seqs: usize,
    /// Floats per embedding (the model's hidden size).
    pub embedding_dims: usize,
    /// Every token's bytes, for logprobs (built on first use).
    pub token_bytes: std::sync::OnceLock<std::sync::Arc<Vec<Vec<u8>>>>,
}

impl ServedModel {
    pub fn knows_model(&self, m: &str) -> bool {
        m == self.model_id || self.aliases.iter().any(|a| a == m)
    }

    /// Every token's bytes (special tokens as their text).
    pub fn token_bytes(&self) -> std::sync::Arc<Vec<Vec<u8>>> {
        self.token_bytes
            .get_or_init(|| {
                let mut words = crate::model::guidance::token_bytes(&self.tokenizer).unwrap_or_else(|_| {
                    (0..self.vocab as u32).map(|id| self.tokenizer.decode(&[id]).unwrap_or_default().into_bytes()).collect()
                });
                for w in &mut words {
                    if w.first() == Some(&toktrie::TokTrie::SPECIAL_TOKEN_MARKER) {
                        w.remove(0);
                    }
                }
                std::sync::Arc::new(words)
            })
            .clone()
    }

    /// Longest sequence (prompt + completion) one request may reach: the context, or the
    /// whole KV pool when that is smaller.
    pub fn max_sequence(&self) -> usize {
        self.context.min(self.kv_pages_total.saturating_mul(self.page_size))
    }
}

/// A validated generation request.
#[derive(Debug, Clone)]
pub struct Validated {
    pub endpoint: Endpoint,
    pub prompt_ids: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// The request's `seed`; `None`: the caller picks one.
    pub seed: Option<u64>,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    pub speculation: Speculation,
    /// Choices to sample (they share the prompt's KV pages).
    pub n: usize,
    /// The output's grammar (`response_format`).
    pub constraint: Option<Constraint>,
    /// Log-probabilities with this many alternatives per token (`logprobs`, `top_logprobs`).
    pub logprobs: Option<usize>,
    /// The request's tools (chat), unless `tool_choice` is `none`.
    pub tools: Option<Tools>,
    /// `logit_bias`, `presence_penalty` and `frequency_penalty`.
    pub bias: LogitBias,
}

impl Validated {
    /// The engine request, with `seed` when the client gave none.
    pub fn request(&self, model: &ServedModel, seed: u64) -> GenerateRequest {
        GenerateRequest {
            prompt_ids: self.prompt_ids.clone(),
            max_tokens: self.max_tokens,
            sampling: SamplingParams { seed: self.seed.unwrap_or(seed), ..self.sampling },
            stop_ids: model.stop_ids.clone(),
            stop_strings: self.stop.clone(),
            speculation: self.speculation,
            constraint: self.constraint.clone(),
            logprobs: self.logprobs,
            bias: self.bias.clone(),
        }
    }
}

/// `presence_penalty` and `frequency_penalty` (-2 to 2) and `logit_bias` (token ids as
/// strings, values -100 to 100), OpenAI's ranges.
fn logit_bias(
    model: &ServedModel,
    presence: Option<f64>,
    frequency: Option<f64>,
    bias: Option<&BTreeMap<String, f64>>,
) -> Result<LogitBias, ApiError> {
    let mut out = LogitBias::default();
    for (key, v, slot) in
        [("presence_penalty", presence, &mut out.presence_penalty), ("frequency_penalty", frequency, &mut out.frequency_penalty)]
    {
        let v = v.unwrap_or(0.0);
        if !(-2.0..=2.0).contains(&v) {
            return Err(ApiError::bad(format!("`{key}` is {v}; it must be between -2 and 2")).param(key));
        }
        *slot = v as f32;
    }
    for (k, &v) in bias.into_iter().flatten() {
        let param = format!("logit_bias.{k}");
        let t: u32 = k
            .trim()
            .parse()
            .map_err(|_| ApiError::bad(format!("`logit_bias` keys are token ids; {k:?} is not one")).param(param.clone()))?;
        if t as usize >= model.vocab {
            return Err(
                ApiError::bad(format!("`logit_bias` names token {t}, outside the vocabulary (size {})", model.vocab)).param(param.clone())
            );
        }
        if !(-100.0..=100.0).contains(&v) {
            return Err(ApiError::bad(format!("`logit_bias` for token {t} is {v}; it must be between -100 and 100")).param(param.clone()));
        }
        if out.tokens.iter().any(|p| p.0 == t) {
            return Err(ApiError::bad(format!("`logit_bias` names token {t} twice")).param(param.clone()));
        }
        out.tokens.push((t, v as f32));
    }
    Ok(out)
}

/// The JSON path of a deserialization error as OpenAI's `param` (`messages[0].role`).
fn path_param(path: &serde_path_to_error::Path) -> Option<String> {
    use serde_path_to_error::Segment;
    let mut out = String::new();
    for seg in path.iter() {
        match seg {
            Segment::Seq { index } => out.push_str(&format!("[{index}]")),
            Segment::Map { key } => {
                if !out.is_empty() {
                    out.push('.');
                }
                out.push_str(key);
            }
            Segment::Enum { variant } => {
                if !out.is_empty() {
                    out.push('.');
                }
                out.push_str(variant);
            }
            Segment::Unknown => {}
        }
    }
    (!out.is_empty()).then_some(out)
}

/// A body that must be a JSON object, deserialized into `T`: a field of the wrong type is a
/// 400 naming that field (`param`).
pub(crate) fn typed_body<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    let value: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| ApiError::bad(format!("the request body is not valid JSON: {e}")).code("invalid_json"))?;
    if !value.is_object() {
        return Err(ApiError::bad("the request body must be a JSON object"));
    }
    serde_path_to_error::deserialize(value).map_err(|e| {
        let param = path_param(e.path());
        let inner = e.into_inner();
        let mut err = ApiError::bad(match &param {
            Some(p) => format!("`{p}`: {inner}"),
            None => inner.to_string(),
        });
        err.param = param;
        err
    })
}

/// Deserialize and validate a request body sent to `endpoint`.
pub fn parse_request(model: &ServedModel, endpoint: Endpoint, body: &[u8]) -> Result<Validated, ApiError> {
    validate(model, endpoint, typed_body(body)?)
}

/// Check a deserialized body against the served model.
pub fn validate(model: &ServedModel, endpoint: Endpoint, mut req: RequestBody) -> Result<Validated, ApiError> {
    let chat = endpoint == Endpoint::Chat;
    match req.model.as_deref() {
        None => return Err(ApiError::bad("you must provide a `model` parameter").param("model").code("missing_required_parameter")),
        Some(m) if model.knows_model(m) => {}
        Some(m) => return Err(model_not_found(m)),
    }
    let n = req.n.unwrap_or(1);
    if n == 0 || n > model.max_seqs as u64 {
        return Err(ApiError::bad(format!("`n` is {n}; this server samples 1 to {} choices per request (its --max-seqs)", model.max_seqs))
            .param("n"));
    }
    if req.best_of.is_some_and(|n| n > 1) {
        return Err(ApiError::unsupported("best_of", "best_of > 1"));
    }
    if req.echo == Some(true) {
        return Err(ApiError::unsupported("echo", "echo"));
    }
    let max_lp = crate::engine::batch::MAX_LOGPROBS as u64;
    let logprobs = match (endpoint, req.logprobs, req.top_logprobs) {
        (_, None | Some(Logprobs::Flag(false)), None) => None,
        (Endpoint::Chat, Some(Logprobs::Flag(true)), None) => Some(0),
        (Endpoint::Chat, Some(Logprobs::Flag(true)), Some(k)) if k <= max_lp => Some(k as usize),
        (Endpoint::Chat, Some(Logprobs::Flag(true)), Some(k)) => {
            return Err(ApiError::bad(format!("`top_logprobs` is {k}; at most {max_lp}")).param("top_logprobs"))
        }
        (Endpoint::Chat, _, Some(_)) => return Err(ApiError::bad("`top_logprobs` needs `logprobs: true`").param("top_logprobs")),
        (Endpoint::Chat, Some(Logprobs::Count(_)), _) => {
            return Err(ApiError::bad("`logprobs` is true or false in chat completions (alternatives: `top_logprobs`)").param("logprobs"))
        }
        (Endpoint::Completions, Some(Logprobs::Count(k)), None) if k <= max_lp => Some(k as usize),
        (Endpoint::Completions, _, Some(_)) => {
            return Err(ApiError::bad("completions take `logprobs: k`, not `top_logprobs`").param("top_logprobs"))
        }
        (Endpoint::Completions, Some(_), _) => {
            return Err(ApiError::bad(format!("`logprobs` is the number of alternatives per token, 0 to {max_lp}")).param("logprobs"))
        }
    };
    let bias = logit_bias(model, req.presence_penalty, req.frequency_penalty, req.logit_bias.as_ref())?;
    if req.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::unsupported("suffix", "suffix"));
    }
    if !chat && req.tools.as_ref().is_some_and(|t| !t.is_empty()) {
        return Err(ApiError::bad("tools are for chat completions (/v1/chat/completions)").param("tools"));
    }
    let tools = if chat { Tools::from_request(req.tools.take(), req.tool_choice.as_ref())? } else { None };
    if req.functions.as_ref().is_some_and(|t| !t.is_empty()) {
        return Err(ApiError::unsupported("functions", "tool calling"));
    }
    // The grammar compiles at submission (the engine refuses one that does not).
    let mut constraint = match &req.response_format {
        None => None,
        Some(v) => Constraint::from_response_format(v).map_err(|e| ApiError::bad(e.to_string()).param("response_format"))?,
    };
    // A forced tool call (`required`, or a named function) is a grammar too.
    if let Some(forced) = tools.as_ref().and_then(Tools::constraint) {
        if constraint.is_some() {
            return Err(ApiError::bad("a forced tool call and a response_format cannot both constrain the output").param("tool_choice"));
        }
        constraint = Some(forced);
    }
    let temperature = req.temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::bad(format!("`temperature` is {temperature}; it must be between 0 and 2")).param("temperature"));
    }
    let top_p = req.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::bad(format!("`top_p` is {top_p}; it must be in (0, 1]")).param("top_p"));
    }
    let top_k = match req.top_k {
        None | Some(-1) | Some(0) => 0,
        Some(k) if k > 0 => usize::try_from(k).unwrap_or(usize::MAX),
        Some(k) => return Err(ApiError::bad(format!("`top_k` is {k}; it must be 0 (off), -1 (off) or positive")).param("top_k")),
    };
    let seed = match &req.seed {
        None => None,
        Some(n) => Some(
            n.as_u64().or_else(|| n.as_i64().map(|s| s as u64)).ok_or_else(|| ApiError::bad("`seed` must be an integer").param("seed"))?,
        ),
    };
    let stop = match req.stop {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s],
        Some(Stop::Many(v)) => v,
    };
    if stop.len() > MAX_STOP {
        return Err(ApiError::bad(format!("`stop` has {} strings; at most {MAX_STOP} are accepted", stop.len())).param("stop"));
    }
    let stop: Vec<String> = stop.into_iter().filter(|s| !s.is_empty()).collect();
    let requested = if chat { req.max_completion_tokens.or(req.max_tokens) } else { req.max_tokens };
    let prompt_ids = match endpoint {
        Endpoint::Chat => {
            if req.prompt.is_some() {
                return Err(ApiError::bad("chat completions take `messages`, not `prompt`").param("prompt"));
            }
            chat_prompt(model, req.messages.take(), tools.as_ref(), true)?
        }
        Endpoint::Completions => {
            if req.messages.is_some() {
                return Err(ApiError::bad("completions take `prompt`, not `messages` (use /v1/chat/completions)").param("messages"));
            }
            completion_prompt(model, req.prompt)?
        }
    };
    let what = endpoint.input();
    if prompt_ids.is_empty() {
        return Err(ApiError::bad(format!("the {what} is empty (no tokens to condition on)")).param(what));
    }
    let most = model.max_sequence();
    if prompt_ids.len() >= most {
        let msg = if most < model.context {
            format!(
                "the {what} has {} tokens but the KV cache holds {most} tokens for one request ({} pages of {}), which leaves no room for a completion",
                prompt_ids.len(),
                model.kv_pages_total,
                model.page_size
            )
        } else {
            format!(
                "this model's context holds {most} tokens (prompt and completion together) but the {what} has {} tokens, which leaves no room for a completion; shorten it or restart the server with a larger --context",
                prompt_ids.len()
            )
        };
        return Err(ApiError::bad(msg).param(what).code("context_length_exceeded"));
    }
    // Generation can never go past the context: a larger max_tokens ends with "length" there.
    let room = most - prompt_ids.len();
    let max_tokens = requested.map_or(if chat { room } else { 16 }, |n| usize::try_from(n).unwrap_or(usize::MAX)).min(room);
    let mut speculation = model.speculation;
    if let Some(s) = req.speculative {
        if let Some(d) = s.drafter {
            speculation.drafter = d;
        }
        if let Some(k) = s.draft_tokens {
            if k > 32 {
                return Err(ApiError::bad("`speculative.draft_tokens` must be an integer from 0 to 32").param("speculative.draft_tokens"));
            }
            speculation.draft_tokens = Some(k as usize);
        }
    }
    Ok(Validated {
        endpoint,
        prompt_ids,
        max_tokens,
        sampling: SamplingParams { temperature: temperature as f32, top_k, top_p: top_p as f32, seed: 0 },
        seed,
        stop,
        stream: req.stream.unwrap_or(false),
        include_usage: req.stream_options.and_then(|o| o.include_usage).unwrap_or(false),
        speculation,
        n: n as usize,
        constraint,
        logprobs,
        tools,
        bias,
    })
}

pub fn model_not_found(id: &str) -> ApiError {
    ApiError::new(404, "invalid_request_error", format!("the model `{id}` does not exist")).param("model").code("model_not_found")
}

fn token_ids(model: &ServedModel, ids: &[u64]) -> Result<Vec<u32>, ApiError> {
    ids.iter()
        .map(|&t| {
            u32::try_from(t).ok().filter(|&t| (t as usize) < model.vocab).ok_or_else(|| {
                ApiError::bad(format!("the prompt's token ids must be integers below the vocabulary size ({})", model.vocab))
                    .param("prompt")
            })
        })
        .collect()
}

fn completion_prompt(model: &ServedModel, prompt: Option<Prompt>) -> Result<Vec<u32>, ApiError> {
    let encode =
        |s: &str| model.tokenizer.encode(s).map_err(|e| ApiError::bad(format!("the prompt could not be tokenized: {e}")).param("prompt"));
    match prompt {
        None => Err(ApiError::bad("you must provide a `prompt`").param("prompt").code("missing_required_parameter")),
        Some(Prompt::Text(s)) => encode(&s),
        Some(Prompt::Tokens(ids)) if !ids.is_empty() => token_ids(model, &ids),
        Some(Prompt::Tokens(_)) => Err(ApiError::bad("the prompt is empty (no tokens to condition on)").param("prompt")),
        Some(Prompt::Many(mut items)) if items.len() == 1 => match items.remove(0) {
            PromptItem::Text(s) => encode(&s),
            PromptItem::Tokens(ids) => token_ids(model, &ids),
        },
        Some(Prompt::Many(_)) => {
            Err(ApiError::bad("only one prompt per request is supported (send one request per prompt)").param("prompt"))
        }
    }
}

/// Chat messages rendered with the model's template and tokenized. With tools, a template
/// that takes `tools` gets them (and earlier calls as `tool_calls`); for one that does not,
/// the system message describes them and earlier calls are written in the call syntax.
fn chat_prompt(
    model: &ServedModel,
    messages: Option<Vec<MessageIn>>,
    tools: Option<&Tools>,
    add_generation_prompt: bool,
) -> Result<Vec<u32>, ApiError> {
    let bad = |m: String| ApiError::bad(m).param("messages");
    let Some(list) = messages else {
        return Err(bad("you must provide `messages`".into()).code("missing_required_parameter"));
    };
    if list.is_empty() {
        return Err(bad("`messages` must not be empty".into()));
    }
    let tmpl = model.template.as_ref().map_err(|e| {
        ApiError::bad(format!("this model has no usable chat template ({e}); use /v1/completions")).code("no_chat_template")
    })?;
    let takes_tools = model.tokenizer.chat_template_source().is_some_and(|t| t.contains("tools"));
    let mut msgs: Vec<serde_json::Value> = Vec::with_capacity(list.len() + 1);
    for (i, m) in list.into_iter().enumerate() {
        let role = if m.role == "developer" { "system".to_string() } else { m.role };
        let mut content = match m.content {
            None => String::new(),
            Some(Content::Text(s)) => s,
            Some(Content::Parts(parts)) => {
                let mut text = String::new();
                for p in parts {
                    match (p.kind.as_str(), p.text) {
                        ("text", Some(t)) => text.push_str(&t),
                        _ => return Err(bad(format!("messages[{i}].content: only text parts are supported"))),
                    }
                }
                text
            }
        };
        let mut msg = serde_json::json!({"role": role});
        match m.tool_calls.filter(|c| !c.is_empty()) {
            Some(calls) if takes_tools => {
                let calls: Vec<serde_json::Value> = calls
                    .iter()
                    .map(|c| {
                        let name = c.pointer("/function/name").cloned().unwrap_or_default();
                        let args = tools::arguments_value(c.pointer("/function/arguments"));
                        serde_json::json!({"type": "function", "id": c.get("id"), "function": {"name": name, "arguments": args}})
                    })
                    .collect();
                msg["tool_calls"] = serde_json::Value::Array(calls);
            }
            Some(calls) => content.push_str(&tools::calls_as_text(&calls)),
            None => {}
        }
        if let Some(id) = m.tool_call_id {
            msg["tool_call_id"] = serde_json::Value::String(id);
        }
        msg["content"] = serde_json::Value::String(content);
        msgs.push(msg);
    }
    let rendered = match tools {
        Some(t) if takes_tools => tmpl.render_with(
            minijinja::Value::from(minijinja::value::Serde(&msgs)),
            add_generation_prompt,
            minijinja::context! { tools => minijinja::Value::from(minijinja::value::Serde(t.template_value())) },
        ),
        Some(t) => {
            let text = t.system_text();
            if msgs[0]["role"] == "system" {
                let c = msgs[0]["content"].as_str().unwrap_or("").to_string();
                msgs[0]["content"] = serde_json::Value::String(format!("{c}\n\n{text}"));
            } else {
                msgs.insert(0, serde_json::json!({"role": "system", "content": text}));
            }
            tmpl.render_with(minijinja::Value::from(minijinja::value::Serde(&msgs)), add_generation_prompt, minijinja::Value::UNDEFINED)
        }
        None => {
            tmpl.render_with(minijinja::Value::from(minijinja::value::Serde(&msgs)), add_generation_prompt, minijinja::Value::UNDEFINED)
        }
    }
    .map_err(|e| bad(format!("the chat template refused the messages: {e}")))?;
    model.tokenizer.encode_chat(&rendered).map_err(|e| bad(format!("the messages could not be tokenized: {e}")))
}

// ---------------------------------------------------------------------------------------
// Responses
// ---------------------------------------------------------------------------------------

/// OpenAI's `finish_reason` for an engine outcome.
pub fn finish_reason(f: FinishReason) -> &'static str {
    match f {
        FinishReason::Stop | FinishReason::Cancelled => "stop",
        FinishReason::Length | FinishReason::ContextFull => "length",
    }
}

#[derive(Debug, Serialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    pub prompt_tokens_details: PromptTokensDetails,
    /// An extension: what speculative decoding did (drafted, accepted, timings).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub speculative: Option<SpecStats>,
}

#[derive(Debug, Serialize)]
pub struct PromptTokensDetails {
    pub cached_tokens: usize,
}

impl Usage {
    /// The prompt once, the completions of every choice.
    pub fn of(prompt_tokens: usize, gens: &[Generation]) -> Usage {
        let completion = gens.iter().map(|g| g.output_ids.len()).sum::<usize>();
        Usage {
            prompt_tokens,
            completion_tokens: completion,
            total_tokens: prompt_tokens + completion,
            prompt_tokens_details: PromptTokensDetails { cached_tokens: gens.first().map_or(0, |g| g.cached_prompt_tokens) },
            speculative: gens.first().and_then(|g| g.speculative.clone()),
        }
    }
}

#[derive(Debug, Serialize)]
pub struct AssistantMessage {
    pub role: &'static str,
    /// `null` when the answer is only tool calls.
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCall>>,
}

#[derive(Debug, Default, Serialize)]
pub struct Delta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallDelta>>,
}

/// One choice of a response or chunk: `text` (completions), `message` (chat) or `delta`
/// (chat chunks).
#[derive(Debug, Serialize)]
pub struct Choice {
    pub index: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<AssistantMessage>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub delta: Option<Delta>,
    pub logprobs: Option<serde_json::Value>,
    pub finish_reason: Option<&'static str>,
}

/// A whole response (`chat.completion`, `text_completion`) or a streamed chunk
/// (`chat.completion.chunk`, `text_completion`).
#[derive(Debug, Serialize)]
pub struct Response {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<Choice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

/// A token with its log-probability, as chat completions report it.
#[derive(Debug, Serialize)]
pub struct ChatTokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<TopLogprob>,
}

#[derive(Debug, Serialize)]
pub struct TopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

/// `choices[i].logprobs` of chat completions.
#[derive(Debug, Serialize)]
pub struct ChatLogprobs {
    pub content: Vec<ChatTokenLogprob>,
}

/// `choices[i].logprobs` of (legacy) completions.
#[derive(Debug, Serialize)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<f32>,
    pub top_logprobs: Vec<BTreeMap<String, f32>>,
    pub text_offset: Vec<usize>,
}

/// One accepted request's identity in its responses.
#[derive(Debug, Clone)]
pub struct Job {
    pub id: String,
    pub created: u64,
    pub endpoint: Endpoint,
    pub model: String,
    pub prompt_tokens: usize,
    /// Every token's bytes, when the request asked for logprobs.
    pub token_bytes: Option<std::sync::Arc<Vec<Vec<u8>>>>,
    /// The request's tools: the output is parsed for calls.
    pub tools: Option<Tools>,
}

impl Job {
    /// The `logprobs` object of a choice for these tokens (`offset`: text bytes before them).
    pub fn logprobs(&self, lps: &[TokenLogprob], offset: usize) -> Option<serde_json::Value> {
        let words = self.token_bytes.as_ref()?;
        let bytes = |id: u32| words.get(id as usize).cloned().unwrap_or_default();
        let text = |id: u32| String::from_utf8_lossy(&bytes(id)).into_owned();
        let v = if self.chat() {
            let content = lps
                .iter()
                .map(|t| ChatTokenLogprob {
                    token: text(t.id),
                    logprob: t.logprob,
                    bytes: bytes(t.id),
                    top_logprobs: t.top.iter().map(|&(id, lp)| TopLogprob { token: text(id), logprob: lp, bytes: bytes(id) }).collect(),
                })
                .collect();
            serde_json::to_value(ChatLogprobs { content })
        } else {
            let mut at = offset;
            let mut text_offset = Vec::with_capacity(lps.len());
            for t in lps {
                text_offset.push(at);
                at += bytes(t.id).len();
            }
            serde_json::to_value(CompletionLogprobs {
                tokens: lps.iter().map(|t| text(t.id)).collect(),
                token_logprobs: lps.iter().map(|t| t.logprob).collect(),
                top_logprobs: lps.iter().map(|t| t.top.iter().map(|&(id, lp)| (text(id), lp)).collect()).collect(),
                text_offset,
            })
        };
        v.ok()
    }

    fn chat(&self) -> bool {
        self.endpoint == Endpoint::Chat
    }

    fn response(&self, object_chat: &'static str, choices: Vec<Choice>, usage: Option<Usage>) -> Response {
        Response {
            id: self.id.clone(),
            object: if self.chat() { object_chat } else { "text_completion" },
            created: self.created,
            model: self.model.clone(),
            choices,
            usage,
        }
    }

    /// The non-streamed answer: one choice per generation.
    pub fn complete(&self, gens: &[Generation]) -> Response {
        let choices = gens
            .iter()
            .enumerate()
            .map(|(index, g)| {
                let finish = Some(finish_reason(g.finish_reason));
                if self.chat() {
                    let (message, finish) = match self.calls(index, &g.text) {
                        Some((content, calls)) => {
                            (AssistantMessage { role: "assistant", content, tool_calls: Some(calls) }, Some("tool_calls"))
                        }
                        None => (AssistantMessage { role: "assistant", content: Some(g.text.clone()), tool_calls: None }, finish),
                    };
                    Choice {
                        index,
                        text: None,
                        message: Some(message),
                        delta: None,
                        logprobs: self.logprobs(&g.logprobs, 0),
                        finish_reason: finish,
                    }
                } else {
                    let logprobs = self.logprobs(&g.logprobs, 0);
                    Choice { index, text: Some(g.text.clone()), message: None, delta: None, logprobs, finish_reason: finish }
                }
            })
            .collect();
        self.response("chat.completion", choices, Some(Usage::of(self.prompt_tokens, gens)))
    }

    /// A streamed chunk of choice `index`: `text` (chat: a content delta), the role (chat's
    /// first chunk), or the final one with its `finish_reason`.
    pub fn chunk(&self, index: usize, text: Option<&str>, role: bool, finish: Option<&'static str>) -> Response {
        self.chunk_with(index, text, role, finish, None)
    }

    /// A chunk carrying one token's text and its log-probabilities (`offset`: the choice's
    /// text bytes before it).
    pub fn chunk_with(
        &self,
        index: usize,
        text: Option<&str>,
        role: bool,
        finish: Option<&'static str>,
        logprob: Option<(&TokenLogprob, usize)>,
    ) -> Response {
        let logprobs = logprob.and_then(|(t, offset)| self.logprobs(std::slice::from_ref(t), offset));
        let choice = if self.chat() {
            let delta = Delta {
                role: role.then_some("assistant"),
                content: if role { Some(String::new()) } else { text.map(str::to_string) },
                tool_calls: None,
            };
            Choice { index, text: None, message: None, delta: Some(delta), logprobs, finish_reason: finish }
        } else {
            Choice { index, text: Some(text.unwrap_or("").to_string()), message: None, delta: None, logprobs, finish_reason: finish }
        };
        self.response("chat.completion.chunk", vec![choice], None)
    }

    /// The tool calls in choice `index`'s text, with the text outside them.
    pub fn calls(&self, index: usize, text: &str) -> Option<(Option<String>, Vec<ToolCall>)> {
        self.tools.as_ref()?.parse(text, &format!("{}-{index}", self.id))
    }

    /// A streamed choice's parser of tool calls (with tools).
    pub fn call_stream(&self, index: usize) -> Option<CallStream> {
        Some(CallStream::new(self.tools.as_ref()?, &format!("{}-{index}", self.id)))
    }

    /// A chunk for one piece of a streamed choice with tools: content, or a tool-call delta.
    pub fn piece_chunk(&self, index: usize, piece: StreamPiece) -> Response {
        let delta = match piece {
            StreamPiece::Content(t) => Delta { role: None, content: Some(t), tool_calls: None },
            StreamPiece::Call(c) => Delta { role: None, content: None, tool_calls: Some(vec![c]) },
        };
        let choice = Choice { index, text: None, message: None, delta: Some(delta), logprobs: None, finish_reason: None };
        self.response("chat.completion.chunk", vec![choice], None)
    }

    /// The last chunk of a streamed choice with tools: `tool_calls` when it made any.
    pub fn tools_finish_chunk(&self, index: usize, g: &Generation, made_calls: bool) -> Response {
        let finish = if made_calls { "tool_calls" } else { finish_reason(g.finish_reason) };
        self.chunk(index, None, false, Some(finish))
    }

    /// The last chunk of a stream with `include_usage`: no choices, the usage.
    pub fn usage_chunk(&self, gens: &[Generation]) -> Response {
        self.response("chat.completion.chunk", Vec::new(), Some(Usage::of(self.prompt_tokens, gens)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn param_of(body: &str) -> Option<String> {
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        let e = serde_path_to_error::deserialize::<_, RequestBody>(v).unwrap_err();
        path_param(e.path())
    }

    #[test]
    fn type_errors_name_their_field() {
        assert_eq!(param_of(r#"{"temperature": "hot"}"#).as_deref(), Some("temperature"));
        assert_eq!(param_of(r#"{"max_tokens": -1}"#).as_deref(), Some("max_tokens"));
        assert_eq!(param_of(r#"{"messages": [{"content": "x"}]}"#).as_deref(), Some("messages[0]"));
        assert_eq!(param_of(r#"{"speculative": {"drafter": "x"}}"#).as_deref(), Some("speculative.drafter"));
    }

    #[test]
    fn stop_lists() {
        let v: RequestBody = serde_json::from_str(r#"{"stop": ["a", ""]}"#).unwrap();
        assert!(matches!(v.stop, Some(Stop::Many(ref s)) if s.len() == 2));
        assert!(serde_json::from_str::<RequestBody>(r#"{"stop": 3}"#).is_err());
        assert!(serde_json::from_str::<RequestBody>(r#"{"stop": [1]}"#).is_err());
        let v: RequestBody = serde_json::from_str(r#"{"stop": null}"#).unwrap();
        assert!(v.stop.is_none());
    }

    #[test]
    fn error_body_shape() {
        let e = ApiError::bad("no").param("x").code("c");
        let v: serde_json::Value = serde_json::from_str(&e.body()).unwrap();
        assert_eq!(v["error"]["message"], "no");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(v["error"]["param"], "x");
        assert_eq!(v["error"]["code"], "c");
    }
}

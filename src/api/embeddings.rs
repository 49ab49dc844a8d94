//! Embeddings: OpenAI's `POST /v1/embeddings` and Ollama's `POST /api/embed` (and its older
//! `POST /api/embeddings`), parsed into the token ids to embed and written back in each API's
//! shape. Each input is run through the served decoder on a sequence of its own
//! (`GpuModel::embedding`): every position's final hidden state goes through the model's
//! final RMS norm, the positions are pooled (`mean` by default, or `last`; the server's
//! `--embedding-pooling`, or the request's `pooling` field, a Lantern extension) and the
//! result is scaled to unit length, so a dot product is a cosine similarity. A decoder
//! trained for generation is not a retrieval model: these vectors serve clustering and
//! near-duplicate checks, and a dedicated embedding model ranks passages better.

use base64::Engine as _;
use serde::Deserialize;
use serde_json::{json, Value};

use super::{typed_body, ApiError, ServedModel};
use crate::model::forward::Pooling;

/// Most inputs one request may embed (OpenAI's limit).
pub const MAX_INPUTS: usize = 2048;

/// What to embed, validated: nothing reaches the engine before every input is checked.
#[derive(Debug, Clone, PartialEq)]
pub struct EmbedRequest {
    /// The model id the answer names.
    pub model: String,
    /// Token ids per input, each within the context.
    pub inputs: Vec<Vec<u32>>,
    pub pooling: Pooling,
    /// OpenAI's `encoding_format: "base64"` (little-endian f32 bytes).
    pub base64: bool,
}

impl EmbedRequest {
    pub fn prompt_tokens(&self) -> usize {
        self.inputs.iter().map(Vec::len).sum()
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct OpenAiBody {
    model: Option<String>,
    input: Option<Value>,
    encoding_format: Option<String>,
    dimensions: Option<u64>,
    user: Option<String>,
    pooling: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct OllamaBody {
    model: Option<String>,
    /// `/api/embed`: a string or a list of strings.
    input: Option<Value>,
    /// `/api/embeddings` (the older route): one string.
    prompt: Option<String>,
    /// Cut inputs longer than the context to fit (default true); false refuses them.
    truncate: Option<bool>,
    dimensions: Option<u64>,
    options: Option<Value>,
    keep_alive: Option<Value>,
    pooling: Option<String>,
}

fn pooling(p: Option<&str>, default: Pooling) -> Result<Pooling, ApiError> {
    match p {
        None => Ok(default),
        Some("mean") => Ok(Pooling::Mean),
        Some("last") => Ok(Pooling::Last),
        Some(o) => Err(ApiError::bad(format!("`pooling` is {o:?}; this server pools by \"mean\" or \"last\"")).param("pooling")),
    }
}

fn dimensions(model: &ServedModel, d: Option<u64>) -> Result<(), ApiError> {
    match d {
        Some(d) if d != model.embedding_dims as u64 => Err(ApiError::bad(format!(
            "`dimensions` is {d}, but this model's embeddings have {} dimensions (it cannot shorten them)",
            model.embedding_dims
        ))
        .param("dimensions")),
        _ => Ok(()),
    }
}

fn encode(model: &ServedModel, text: &str, param: &str) -> Result<Vec<u32>, ApiError> {
    if text.is_empty() {
        return Err(ApiError::bad(format!("`{param}` is an empty string; every input needs some text")).param(param));
    }
    model.tokenizer.encode(text).map_err(|e| ApiError::bad(format!("`{param}` could not be tokenized: {e}")).param(param))
}

/// `ids` at `param` as token ids of this vocabulary.
fn ids(model: &ServedModel, v: &[Value], param: &str) -> Result<Vec<u32>, ApiError> {
    if v.is_empty() {
        return Err(ApiError::bad(format!("`{param}` is an empty list of tokens")).param(param));
    }
    v.iter()
        .enumerate()
        .map(|(i, t)| {
            t.as_u64().and_then(|t| u32::try_from(t).ok()).filter(|&t| (t as usize) < model.vocab).ok_or_else(|| {
                ApiError::bad(format!("`{param}[{i}]` is {t}; token ids are integers below the vocabulary size {}", model.vocab))
                    .param(format!("{param}[{i}]"))
            })
        })
        .collect()
}

/// Refuse (or with `truncate`, cut) an input longer than the context.
fn fit(model: &ServedModel, mut t: Vec<u32>, param: &str, truncate: bool) -> Result<Vec<u32>, ApiError> {
    if t.len() > model.context {
        if !truncate {
            return Err(ApiError::bad(format!("`{param}` has {} tokens but this model's context holds {} tokens", t.len(), model.context))
                .param(param)
                .code("context_length_exceeded"));
        }
        t.truncate(model.context);
    }
    Ok(t)
}

fn count(n: usize, param: &str) -> Result<(), ApiError> {
    if n == 0 {
        return Err(ApiError::bad(format!("`{param}` is an empty list; give at least one input")).param(param));
    }
    if n > MAX_INPUTS {
        return Err(ApiError::bad(format!("`{param}` has {n} inputs; at most {MAX_INPUTS} per request")).param(param));
    }
    Ok(())
}

/// `POST /v1/embeddings`: `input` is a string, a list of strings, a list of token ids or a
/// list of such lists.
pub fn parse_openai(model: &ServedModel, bytes: &[u8], default_pooling: Pooling) -> Result<EmbedRequest, ApiError> {
    let b: OpenAiBody = typed_body(bytes)?;
    let _ = b.user;
    match b.model.as_deref() {
        None => return Err(ApiError::bad("you must provide a `model`").param("model").code("missing_required_parameter")),
        Some(m) if !model.knows_model(m) => return Err(super::model_not_found(m)),
        Some(_) => {}
    }
    let base64 = match b.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(o) => {
            return Err(ApiError::bad(format!("`encoding_format` is {o:?}; it must be \"float\" or \"base64\"")).param("encoding_format"))
        }
    };
    dimensions(model, b.dimensions)?;
    let pooling = pooling(b.pooling.as_deref(), default_pooling)?;
    let inputs = match b.input {
        None | Some(Value::Null) => {
            return Err(ApiError::bad("you must provide an `input`").param("input").code("missing_required_parameter"))
        }
        Some(Value::String(s)) => vec![encode(model, &s, "input")?],
        Some(Value::Array(items)) => {
            count(items.len(), "input")?;
            if items.iter().all(Value::is_number) {
                vec![ids(model, &items, "input")?]
            } else {
                items
                    .iter()
                    .enumerate()
                    .map(|(i, it)| {
                        let p = format!("input[{i}]");
                        match it {
                            Value::String(s) => encode(model, s, &p),
                            Value::Array(t) => ids(model, t, &p),
                            _ => Err(ApiError::bad(format!("`{p}` must be a string or a list of token ids")).param(p)),
                        }
                    })
                    .collect::<Result<_, _>>()?
            }
        }
        Some(_) => {
            return Err(ApiError::bad("`input` must be a string, a list of strings or a list of token ids").param("input"));
        }
    };
    let inputs = inputs.into_iter().enumerate().map(|(i, t)| fit(model, t, &format!("input[{i}]"), false)).collect::<Result<_, _>>()?;
    Ok(EmbedRequest { model: model.model_id.clone(), inputs, pooling, base64 })
}

/// `POST /api/embed` (`legacy`: false; `input` a string or list of strings) or
/// `POST /api/embeddings` (`legacy`: true; `prompt`, one string).
pub fn parse_ollama(model: &ServedModel, bytes: &[u8], legacy: bool, default_pooling: Pooling) -> Result<EmbedRequest, ApiError> {
    let b: OllamaBody = typed_body(bytes)?;
    let _ = (&b.options, &b.keep_alive);
    let id = super::ollama::check_model(model, b.model.as_deref())?;
    dimensions(model, b.dimensions)?;
    let pooling = pooling(b.pooling.as_deref(), default_pooling)?;
    let truncate = b.truncate.unwrap_or(true);
    let texts: Vec<(String, String)> = if legacy {
        match b.prompt {
            Some(p) => vec![("prompt".into(), p)],
            None => return Err(ApiError::bad("prompt is required").param("prompt").code("missing_required_parameter")),
        }
    } else {
        match b.input {
            None | Some(Value::Null) => {
                return Err(ApiError::bad("input is required").param("input").code("missing_required_parameter"));
            }
            Some(Value::String(s)) => vec![("input".into(), s)],
            Some(Value::Array(items)) => {
                count(items.len(), "input")?;
                items
                    .into_iter()
                    .enumerate()
                    .map(|(i, v)| match v {
                        Value::String(s) => Ok((format!("input[{i}]"), s)),
                        _ => Err(ApiError::bad(format!("input[{i}] must be a string")).param(format!("input[{i}]"))),
                    })
                    .collect::<Result<_, _>>()?
            }
            Some(_) => return Err(ApiError::bad("input must be a string or a list of strings").param("input")),
        }
    };
    let inputs = texts.iter().map(|(p, s)| encode(model, s, p).and_then(|t| fit(model, t, p, truncate))).collect::<Result<Vec<_>, _>>()?;
    Ok(EmbedRequest { model: id, inputs, pooling, base64: false })
}

fn vector(v: &[f32], base64: bool) -> Value {
    if base64 {
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        Value::String(base64::engine::general_purpose::STANDARD.encode(bytes))
    } else {
        json!(v)
    }
}

/// OpenAI's answer: `{"object": "list", "data": [{"object": "embedding", "index", "embedding"}],
/// "model", "usage"}` (plus `pooling`, which pooling made the vectors).
pub fn openai_response(r: &EmbedRequest, vectors: &[Vec<f32>]) -> Value {
    let data: Vec<Value> =
        vectors.iter().enumerate().map(|(i, v)| json!({"object": "embedding", "index": i, "embedding": vector(v, r.base64)})).collect();
    let n = r.prompt_tokens();
    json!({
        "object": "list",
        "data": data,
        "model": r.model,
        "usage": {"prompt_tokens": n, "total_tokens": n},
        "pooling": r.pooling.name(),
    })
}

/// Ollama's answer: `/api/embed` `{"model", "embeddings", "total_duration",
/// "prompt_eval_count"}`; `/api/embeddings` `{"embedding"}`.
pub fn ollama_response(r: &EmbedRequest, vectors: &[Vec<f32>], legacy: bool, total_ns: u64) -> Value {
    if legacy {
        return json!({ "embedding": vectors.first().cloned().unwrap_or_default() });
    }
    json!({
        "model": r.model,
        "embeddings": vectors,
        "total_duration": total_ns,
        "load_duration": 0,
        "prompt_eval_count": r.prompt_tokens(),
    })
}

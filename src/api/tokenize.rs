//! `POST /tokenize` and `POST /detokenize` in vLLM's shape: a prompt or chat messages to the
//! token ids the engine would see (the chat template applied as for a chat completion), and
//! ids back to text. Nothing is submitted to the engine.

use serde::Deserialize;
use serde_json::{json, Value};

use super::{chat_prompt, tools, typed_body, ApiError, MessageIn, ServedModel};

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct TokenizeBody {
    pub model: Option<String>,
    pub prompt: Option<String>,
    pub messages: Option<Vec<MessageIn>>,
    pub tools: Option<Vec<tools::Tool>>,
    /// Prompts: the tokenizer's BOS and the like (default true).
    pub add_special_tokens: Option<bool>,
    /// Messages: end with the assistant's turn opening (default true).
    pub add_generation_prompt: Option<bool>,
    /// Also each token's text.
    pub return_token_strs: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct DetokenizeBody {
    pub model: Option<String>,
    pub tokens: Option<Vec<u64>>,
}

fn check_model(model: &ServedModel, m: Option<&str>) -> Result<(), ApiError> {
    match m {
        Some(m) if !model.knows_model(m) => Err(super::model_not_found(m)),
        _ => Ok(()),
    }
}

/// `{"count", "max_model_len", "tokens", "token_strs"}`.
pub fn tokenize(model: &ServedModel, bytes: &[u8]) -> Result<Value, ApiError> {
    let b: TokenizeBody = typed_body(bytes)?;
    check_model(model, b.model.as_deref())?;
    let ids = match (b.prompt, b.messages) {
        (Some(p), None) => model
            .tokenizer
            .encode_with(&p, b.add_special_tokens.unwrap_or(true))
            .map_err(|e| ApiError::bad(format!("the prompt could not be tokenized: {e}")).param("prompt"))?,
        (None, Some(m)) => {
            let t = tools::Tools::from_request(b.tools, None)?;
            chat_prompt(model, Some(m), t.as_ref(), b.add_generation_prompt.unwrap_or(true))?
        }
        (Some(_), Some(_)) => return Err(ApiError::bad("give `prompt` or `messages`, not both").param("messages")),
        (None, None) => {
            return Err(ApiError::bad("you must provide a `prompt` or `messages`").param("prompt").code("missing_required_parameter"))
        }
    };
    let strs = b.return_token_strs.unwrap_or(false).then(|| {
        let words = model.token_bytes();
        ids.iter()
            .map(|&id| String::from_utf8_lossy(words.get(id as usize).map_or(&[][..], Vec::as_slice)).into_owned())
            .collect::<Vec<_>>()
    });
    Ok(json!({"count": ids.len(), "max_model_len": model.context, "tokens": ids, "token_strs": strs}))
}

/// `{"prompt"}`: the text of the ids (special tokens included).
pub fn detokenize(model: &ServedModel, bytes: &[u8]) -> Result<Value, ApiError> {
    let b: DetokenizeBody = typed_body(bytes)?;
    check_model(model, b.model.as_deref())?;
    let Some(tokens) = b.tokens else {
        return Err(ApiError::bad("you must provide `tokens`").param("tokens").code("missing_required_parameter"));
    };
    let ids = tokens
        .iter()
        .enumerate()
        .map(|(i, &t)| {
            u32::try_from(t).ok().filter(|&t| (t as usize) < model.vocab).ok_or_else(|| {
                ApiError::bad(format!("`tokens[{i}]` is {t}, outside the vocabulary (size {})", model.vocab)).param(format!("tokens[{i}]"))
            })
        })
        .collect::<Result<Vec<u32>, _>>()?;
    let text = model
        .tokenizer
        .decode_with(&ids, false)
        .map_err(|e| ApiError::bad(format!("the tokens could not be decoded: {e}")).param("tokens"))?;
    Ok(json!({ "prompt": text }))
}

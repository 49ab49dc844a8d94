//! Anthropic's Messages API (`POST /v1/messages`) translated into the chat request this module
//! validates, and the engine's output written back as a Message (one JSON object, or
//! Anthropic's typed server-sent events).
//!
//! The translation: `system` becomes the first message; text blocks are the message text;
//! an assistant's `tool_use` blocks are its earlier tool calls and a user's `tool_result`
//! blocks `tool` messages (answers to those calls), so a template that takes tools renders
//! them as it would an OpenAI conversation; `tools` (`name`, `description`, `input_schema`)
//! become functions and `tool_choice` (`auto`, `any`, `tool`, `none`) OpenAI's choices (a
//! forced call's `input` always fits its schema). Then [`validate`] checks everything, and a
//! refusal names the Messages field. `max_tokens` is required and `temperature` is 0 to 1,
//! as Anthropic has them; images, documents, server tools and extended thinking are refused
//! by name, never ignored.

use serde::Deserialize;
use serde_json::{json, Value};

use super::{typed_body, validate, ApiError, Content, Endpoint, MessageIn, RequestBody, ServedModel, Stop, Validated};
use crate::api::tools::{self, Tools};
use crate::engine::{FinishReason, Generation};

/// `POST /v1/messages`. Unknown fields are ignored.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct MessagesBody {
    pub model: Option<String>,
    pub max_tokens: Option<u64>,
    pub messages: Option<Vec<Message>>,
    /// A string or a list of text blocks.
    pub system: Option<Value>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    pub stop_sequences: Option<Vec<String>>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub stream: Option<bool>,
    /// Accepted and ignored (`user_id`).
    pub metadata: Option<Value>,
    pub thinking: Option<Value>,
    /// `{"format": {"type": "json_schema", "schema": {...}}}` (structured outputs); `effort`
    /// is accepted and has no effect (no extended thinking here).
    pub output_config: Option<Value>,
}

#[derive(Debug, Deserialize)]
pub struct Message {
    pub role: String,
    /// A string or a list of content blocks.
    pub content: Value,
}

/// A validated Messages request.
#[derive(Debug, Clone)]
pub struct Request {
    pub validated: Validated,
    pub stream: bool,
}

/// Anthropic's error body: `{"type": "error", "error": {"type", "message"}}`, the type from
/// the status as Anthropic's API uses them.
pub fn error_body(e: &ApiError) -> String {
    let kind = match e.status {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 => "overloaded_error",
        s if s < 500 => "invalid_request_error",
        _ => "api_error",
    };
    json!({"type": "error", "error": {"type": kind, "message": e.message}}).to_string()
}

fn bad(param: impl Into<String>, message: impl std::fmt::Display) -> ApiError {
    let p = param.into();
    ApiError::bad(format!("{p}: {message}")).param(p)
}

/// The text of a string or a list of `text` blocks (`system`, a tool result's `content`).
fn text_of(v: &Value, param: &str) -> Result<String, ApiError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Null => Ok(String::new()),
        Value::Array(blocks) => {
            let mut out = String::new();
            for (i, b) in blocks.iter().enumerate() {
                match (b.get("type").and_then(Value::as_str), b.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(t)) => out.push_str(t),
                    (Some(kind), _) if kind != "text" => {
                        return Err(bad(format!("{param}[{i}].type"), format!("{kind:?} blocks are not supported here (text only)")))
                    }
                    _ => return Err(bad(format!("{param}[{i}]"), "a text block needs `type: \"text\"` and a string `text`")),
                }
            }
            Ok(out)
        }
        _ => Err(bad(param, "must be a string or a list of text blocks")),
    }
}

fn message(role: &str, content: String) -> MessageIn {
    MessageIn { role: role.into(), content: Some(Content::Text(content)), name: None, tool_calls: None, tool_call_id: None }
}

/// One Messages message as OpenAI chat messages (tool results first, as `tool` messages).
fn translate(i: usize, m: Message, out: &mut Vec<MessageIn>) -> Result<(), ApiError> {
    let param = format!("messages[{i}]");
    if m.role != "user" && m.role != "assistant" {
        return Err(bad(
            format!("{param}.role"),
            format!("{:?} is not a role here (user or assistant; `system` is a field of its own)", m.role),
        ));
    }
    let blocks = match m.content {
        Value::String(s) => {
            out.push(message(&m.role, s));
            return Ok(());
        }
        Value::Array(b) => b,
        _ => return Err(bad(format!("{param}.content"), "must be a string or a list of content blocks")),
    };
    let mut text = String::new();
    let mut calls = Vec::new();
    let mut results = 0;
    for (j, b) in blocks.into_iter().enumerate() {
        let at = format!("{param}.content[{j}]");
        let kind = b.get("type").and_then(Value::as_str).unwrap_or("").to_string();
        match (kind.as_str(), m.role.as_str()) {
            ("text", _) => text.push_str(
                b.get("text").and_then(Value::as_str).ok_or_else(|| bad(format!("{at}.text"), "a text block needs a string `text`"))?,
            ),
            ("tool_use", "assistant") => {
                let (Some(id), Some(name)) = (b.get("id").and_then(Value::as_str), b.get("name").and_then(Value::as_str)) else {
                    return Err(bad(at, "a tool_use block needs `id` and `name`"));
                };
                let input = b.get("input").cloned().unwrap_or_else(|| json!({}));
                calls.push(json!({"type": "function", "id": id, "function": {"name": name, "arguments": input}}));
            }
            ("tool_result", "user") => {
                let id = b.get("tool_use_id").and_then(Value::as_str).ok_or_else(|| bad(format!("{at}.tool_use_id"), "is required"))?;
                let mut content = text_of(b.get("content").unwrap_or(&Value::Null), &format!("{at}.content"))?;
                if b.get("is_error").and_then(Value::as_bool) == Some(true) {
                    content = format!("Error: {content}");
                }
                results += 1;
                out.push(MessageIn {
                    role: "tool".into(),
                    content: Some(Content::Text(content)),
                    name: None,
                    tool_calls: None,
                    tool_call_id: Some(id.into()),
                });
            }
            ("tool_use" | "tool_result", role) => {
                return Err(bad(
                    format!("{at}.type"),
                    format!("{kind} blocks belong to {} messages, not {role}", if kind == "tool_use" { "assistant" } else { "user" }),
                ))
            }
            ("thinking" | "redacted_thinking", _) => {} // an earlier turn's thinking: not part of the prompt
            (other, _) => {
                return Err(bad(
                    format!("{at}.type"),
                    format!("{other:?} blocks are not supported by this server (text, tool_use, tool_result)"),
                ))
            }
        }
    }
    // The message itself: its text and calls; one made only of tool results is those.
    if !calls.is_empty() || !text.is_empty() || results == 0 {
        let mut msg = message(&m.role, text);
        msg.tool_calls = (!calls.is_empty()).then_some(calls);
        out.push(msg);
    }
    Ok(())
}

/// `tools` as OpenAI function tools.
fn functions(list: Vec<Value>) -> Result<Vec<tools::Tool>, ApiError> {
    list.into_iter()
        .enumerate()
        .map(|(i, t)| {
            let at = format!("tools[{i}]");
            if let Some(kind) = t.get("type").and_then(Value::as_str).filter(|k| *k != "custom") {
                return Err(bad(
                    format!("{at}.type"),
                    format!("server tools ({kind:?}) are not supported: declare client tools with `name` and `input_schema`"),
                ));
            }
            let name = t.get("name").and_then(Value::as_str).ok_or_else(|| bad(format!("{at}.name"), "is required"))?;
            let schema = t.get("input_schema").cloned().ok_or_else(|| bad(format!("{at}.input_schema"), "is required"))?;
            let mut f = json!({"name": name, "parameters": schema});
            if let Some(d) = t.get("description") {
                f["description"] = d.clone();
            }
            serde_json::from_value(json!({"type": "function", "function": f})).map_err(|e| bad(at, e))
        })
        .collect()
}

/// `tool_choice` as OpenAI's.
fn choice(v: Option<Value>) -> Result<Option<Value>, ApiError> {
    let Some(v) = v else { return Ok(None) };
    Ok(Some(match v.get("type").and_then(Value::as_str) {
        Some("auto") => json!("auto"),
        Some("any") => json!("required"),
        Some("none") => json!("none"),
        Some("tool") => match v.get("name").and_then(Value::as_str) {
            Some(name) => json!({"type": "function", "function": {"name": name}}),
            None => return Err(bad("tool_choice.name", "is required with type \"tool\"")),
        },
        _ => return Err(bad("tool_choice.type", "must be auto, any, tool or none")),
    }))
}

/// Deserialize and validate a `/v1/messages` body.
pub fn parse(model: &ServedModel, bytes: &[u8]) -> Result<Request, ApiError> {
    let b: MessagesBody = typed_body(bytes)?;
    let Some(max_tokens) = b.max_tokens else {
        return Err(bad("max_tokens", "Field required").code("missing_required_parameter"));
    };
    if max_tokens == 0 {
        return Err(bad("max_tokens", "must be at least 1"));
    }
    if let Some(t) = b.temperature.filter(|t| !(0.0..=1.0).contains(t)) {
        return Err(bad("temperature", format!("is {t}; it must be between 0 and 1")));
    }
    if b.thinking.as_ref().and_then(|t| t.get("type")).and_then(Value::as_str).is_some_and(|t| t != "disabled") {
        return Err(bad("thinking", format!("{:?} does not support extended thinking", model.model_id)).code("unsupported_parameter"));
    }
    let Some(list) = b.messages else {
        return Err(bad("messages", "Field required").code("missing_required_parameter"));
    };
    if list.first().is_some_and(|m| m.role != "user") {
        return Err(bad("messages[0].role", "the first message must be the user's"));
    }
    let mut messages = Vec::with_capacity(list.len() + 1);
    if let Some(s) = &b.system {
        let s = text_of(s, "system")?;
        if !s.is_empty() {
            messages.push(message("system", s));
        }
    }
    for (i, m) in list.into_iter().enumerate() {
        translate(i, m, &mut messages)?;
    }
    let tools = b.tools.map(functions).transpose()?;
    let response_format = match b.output_config.as_ref().and_then(|o| o.get("format")).filter(|f| !f.is_null()) {
        None => None,
        Some(f) => match (f.get("type").and_then(Value::as_str), f.get("schema")) {
            (Some("json_schema"), Some(schema)) => {
                Some(json!({"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}))
            }
            (Some("json_schema"), None) => return Err(bad("output_config.format.schema", "is required")),
            _ => return Err(bad("output_config.format.type", "must be \"json_schema\"")),
        },
    };
    let req = RequestBody {
        model: b.model,
        messages: Some(messages),
        max_tokens: Some(max_tokens),
        temperature: Some(b.temperature.unwrap_or(1.0)),
        top_p: b.top_p,
        top_k: b.top_k,
        stop: b.stop_sequences.map(Stop::Many),
        tools,
        tool_choice: choice(b.tool_choice)?,
        response_format,
        ..Default::default()
    };
    let validated = validate(model, Endpoint::Chat, req).map_err(|mut e| {
        if let Some(p) = e.param.as_deref() {
            let to = match p {
                "stop" => "stop_sequences",
                "response_format" => "output_config.format",
                p => p,
            };
            if !e.message.contains(to) {
                e.message = format!("{to}: {}", e.message);
            }
            e.param = Some(to.to_string());
        }
        e
    })?;
    Ok(Request { validated, stream: b.stream.unwrap_or(false) })
}

/// Anthropic's `stop_reason`.
pub fn stop_reason(g: &Generation, made_calls: bool) -> &'static str {
    match g.finish_reason {
        _ if made_calls => "tool_use",
        FinishReason::Stop if g.stop_string.is_some() => "stop_sequence",
        FinishReason::Stop | FinishReason::Cancelled => "end_turn",
        FinishReason::Length | FinishReason::ContextFull => "max_tokens",
    }
}

/// One accepted Messages request's identity in its answer.
#[derive(Debug, Clone)]
pub struct Job {
    pub id: String,
    pub model: String,
    pub prompt_tokens: usize,
    pub tools: Option<Tools>,
}

impl Job {
    fn usage(&self, output_tokens: usize, cached: usize) -> Value {
        json!({"input_tokens": self.prompt_tokens.saturating_sub(cached), "output_tokens": output_tokens,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0})
    }

    /// The whole Message.
    pub fn message(&self, g: &Generation) -> Value {
        let (text, calls) = match self.tools.as_ref().and_then(|t| t.parse(&g.text, &self.id)) {
            Some((content, calls)) => (content.unwrap_or_default(), calls),
            None => (g.text.clone(), Vec::new()),
        };
        let mut content = Vec::new();
        if !text.is_empty() || calls.is_empty() {
            content.push(json!({"type": "text", "text": text}));
        }
        for c in &calls {
            content.push(json!({"type": "tool_use", "id": c.id, "name": c.function.name,
                "input": tools::arguments_value(Some(&Value::String(c.function.arguments.clone())))}));
        }
        json!({
            "id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
            "stop_reason": stop_reason(g, !calls.is_empty()), "stop_sequence": g.stop_string,
            "usage": self.usage(g.output_ids.len(), g.cached_prompt_tokens),
        })
    }

    /// The `message_start` event's data.
    pub fn start(&self) -> Value {
        json!({"type": "message_start", "message": {
            "id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": null, "stop_sequence": null, "usage": self.usage(0, 0)}})
    }

    /// The `message_delta` event's data: why it ended, and the output's token count.
    pub fn end(&self, g: &Generation, made_calls: bool) -> Value {
        json!({"type": "message_delta", "delta": {"stop_reason": stop_reason(g, made_calls), "stop_sequence": g.stop_string},
            "usage": {"output_tokens": g.output_ids.len()}})
    }
}

/// The content blocks of a streamed Message as its text arrives: text blocks, and
/// `tool_use` blocks whose input streams as `input_json_delta` fragments. Each item is an
/// event's name and data.
#[derive(Debug, Default)]
pub struct BlockStream {
    /// The open block: its index and whether it is a tool_use block.
    open: Option<(usize, bool)>,
    next: usize,
    /// tool_use blocks opened.
    pub calls: usize,
}

impl BlockStream {
    fn close(&mut self, out: &mut Vec<(&'static str, Value)>) {
        if let Some((i, _)) = self.open.take() {
            out.push(("content_block_stop", json!({"type": "content_block_stop", "index": i})));
        }
    }

    fn open(&mut self, block: Value, tool: bool, out: &mut Vec<(&'static str, Value)>) -> usize {
        self.close(out);
        let i = self.next;
        self.next += 1;
        self.open = Some((i, tool));
        out.push(("content_block_start", json!({"type": "content_block_start", "index": i, "content_block": block})));
        i
    }

    /// Text outside tool calls.
    pub fn text(&mut self, t: &str) -> Vec<(&'static str, Value)> {
        let mut out = Vec::new();
        if t.is_empty() {
            return out;
        }
        let i = match self.open {
            Some((i, false)) => i,
            _ => self.open(json!({"type": "text", "text": ""}), false, &mut out),
        };
        out.push(("content_block_delta", json!({"type": "content_block_delta", "index": i, "delta": {"type": "text_delta", "text": t}})));
        out
    }

    /// A piece of a tool call: a new call (`name` set) opens a tool_use block; argument
    /// fragments go to the open one.
    pub fn call(&mut self, d: &tools::ToolCallDelta) -> Vec<(&'static str, Value)> {
        let mut out = Vec::new();
        let i = match (&d.function.name, self.open) {
            (Some(name), _) => {
                self.calls += 1;
                let id = d.id.clone().unwrap_or_default();
                self.open(json!({"type": "tool_use", "id": id, "name": name, "input": {}}), true, &mut out)
            }
            (None, Some((i, true))) => i,
            (None, _) => return out,
        };
        if !d.function.arguments.is_empty() {
            out.push((
                "content_block_delta",
                json!({"type": "content_block_delta", "index": i, "delta": {"type": "input_json_delta", "partial_json": d.function.arguments}}),
            ));
        }
        out
    }

    /// The end: the open block closes (a Message with no block gets an empty text block).
    pub fn finish(&mut self) -> Vec<(&'static str, Value)> {
        let mut out = Vec::new();
        if self.next == 0 {
            self.open(json!({"type": "text", "text": ""}), false, &mut out);
        }
        self.close(&mut out);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conversations_with_tools_translate() {
        let mut out = Vec::new();
        let m: Message = serde_json::from_value(json!({"role": "assistant", "content": [
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Oslo"}}]}))
        .unwrap();
        translate(1, m, &mut out).unwrap();
        let m: Message = serde_json::from_value(json!({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "4 C"}]},
            {"type": "text", "text": "And tomorrow?"}]}))
        .unwrap();
        translate(2, m, &mut out).unwrap();
        assert_eq!(out.len(), 3);
        assert_eq!(out[0].role, "assistant");
        assert_eq!(out[0].tool_calls.as_ref().unwrap()[0]["function"]["arguments"]["city"], "Oslo");
        assert_eq!((out[1].role.as_str(), out[1].tool_call_id.as_deref()), ("tool", Some("t1")));
        assert_eq!(out[2].role, "user");
        let m: Message = serde_json::from_value(json!({"role": "user", "content": [{"type": "image", "source": {}}]})).unwrap();
        assert_eq!(translate(0, m, &mut out).unwrap_err().param.as_deref(), Some("messages[0].content[0].type"));
        let m: Message =
            serde_json::from_value(json!({"role": "user", "content": [{"type": "tool_use", "id": "x", "name": "f"}]})).unwrap();
        assert!(translate(0, m, &mut out).is_err());
    }

    #[test]
    fn tools_and_choices_translate() {
        let f = functions(vec![json!({"name": "add", "description": "Add", "input_schema": {"type": "object"}})]).unwrap();
        assert_eq!(f.len(), 1);
        let e = functions(vec![json!({"type": "web_search_20250305", "name": "web_search"})]).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tools[0].type"));
        assert_eq!(choice(Some(json!({"type": "any"}))).unwrap(), Some(json!("required")));
        assert_eq!(choice(Some(json!({"type": "tool", "name": "add"}))).unwrap().unwrap()["function"]["name"], "add");
        assert!(choice(Some(json!({"type": "tool"}))).is_err());
    }

    #[test]
    fn blocks_open_and_close_in_order() {
        let mut b = BlockStream::default();
        let mut ev = b.text("Hi");
        ev.extend(b.text(" there"));
        let call = tools::ToolCallDelta {
            index: 0,
            id: Some("c0".into()),
            kind: Some("function"),
            function: tools::FunctionDelta { name: Some("add".into()), arguments: String::new() },
        };
        ev.extend(b.call(&call));
        ev.extend(b.call(&tools::ToolCallDelta {
            index: 0,
            id: None,
            kind: None,
            function: tools::FunctionDelta { name: None, arguments: "{\"a\": 1}".into() },
        }));
        ev.extend(b.finish());
        let names: Vec<&str> = ev.iter().map(|e| e.0).collect();
        assert_eq!(
            names,
            [
                "content_block_start",
                "content_block_delta",
                "content_block_delta",
                "content_block_stop",
                "content_block_start",
                "content_block_delta",
                "content_block_stop"
            ]
        );
        assert_eq!(ev[4].1["index"], 1);
        assert_eq!(ev[5].1["delta"]["partial_json"], "{\"a\": 1}");
        assert_eq!(b.calls, 1);
        let e: Value = serde_json::from_str(&error_body(&ApiError::new(404, "x", "no"))).unwrap();
        assert_eq!(e, json!({"type": "error", "error": {"type": "not_found_error", "message": "no"}}));
    }
}

//! OpenAI's Responses API (`POST /v1/responses`) translated into the chat request this module
//! validates, and the engine's output written back as a Response object (or the typed event
//! sequence when streamed).
//!
//! `input` (a string, or items: messages with text parts, earlier `function_call`s and their
//! `function_call_output`s) and `instructions` become chat messages; `tools` (flat function
//! tools), `tool_choice`, `text.format` (`text`, `json_object`, `json_schema`),
//! `max_output_tokens`, `temperature` and `top_p` map to their chat fields, and [`validate`]
//! checks everything (a refusal names the Responses field). `previous_response_id` continues
//! a stored conversation: the caller looks its items up ([`parse`]'s `previous`), and keeps
//! each answered conversation unless `store: false`. Images, files, built-in tools
//! (web search, file search, computer use) are refused by name; `reasoning` is accepted and
//! has no effect (these models do not reason; `reasoning_tokens` is 0).

use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::{typed_body, validate, ApiError, Content, Endpoint, MessageIn, RequestBody, ServedModel, Validated};
use crate::api::tools::{self, ToolCallDelta, Tools};
use crate::engine::{FinishReason, Generation};

/// `POST /v1/responses`. Unknown fields are ignored.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct ResponsesBody {
    pub model: Option<String>,
    pub input: Option<Value>,
    pub instructions: Option<String>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    pub text: Option<Value>,
    pub max_output_tokens: Option<u64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub stream: Option<bool>,
    pub previous_response_id: Option<String>,
    pub store: Option<bool>,
    pub metadata: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    pub reasoning: Option<Value>,
}

/// A validated Responses request.
#[derive(Debug, Clone)]
pub struct Request {
    pub validated: Validated,
    pub stream: bool,
    /// Keep the conversation for a later `previous_response_id`.
    pub store: bool,
    /// The conversation so far as input items (the previous response's, then this input).
    pub items: Vec<Value>,
    /// The request's settings a Response reports back.
    pub echo: Map<String, Value>,
}

fn bad(param: impl Into<String>, message: impl std::fmt::Display) -> ApiError {
    let p = param.into();
    ApiError::bad(format!("`{p}`: {message}")).param(p)
}

fn msg(role: &str, text: String) -> MessageIn {
    MessageIn { role: role.into(), content: Some(Content::Text(text)), name: None, tool_calls: None, tool_call_id: None }
}

/// The text of a message item's content: a string, or text parts.
fn content_text(v: &Value, at: &str) -> Result<String, ApiError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut out = String::new();
            for (j, p) in parts.iter().enumerate() {
                match p.get("type").and_then(Value::as_str) {
                    Some("input_text" | "output_text" | "text") => {
                        out.push_str(p.get("text").and_then(Value::as_str).ok_or_else(|| bad(format!("{at}[{j}].text"), "is required"))?)
                    }
                    Some("refusal") => {}
                    Some(other) => {
                        return Err(bad(format!("{at}[{j}].type"), format!("{other:?} parts are not supported by this server (text only)")))
                    }
                    None => return Err(bad(format!("{at}[{j}].type"), "is required")),
                }
            }
            Ok(out)
        }
        _ => Err(bad(at, "must be a string or a list of content parts")),
    }
}

/// Input items as chat messages (`i0`: the index of the first in the request's `input`, for
/// error paths; items of a stored conversation were checked when they were stored).
fn messages(items: &[Value], i0: usize, out: &mut Vec<MessageIn>) -> Result<(), ApiError> {
    for (k, item) in items.iter().enumerate() {
        let at = format!("input[{}]", k + i0);
        let kind = item.get("type").and_then(Value::as_str).unwrap_or(if item.get("role").is_some() { "message" } else { "" });
        match kind {
            "message" => {
                let role = item.get("role").and_then(Value::as_str).ok_or_else(|| bad(format!("{at}.role"), "is required"))?;
                if !matches!(role, "user" | "assistant" | "system" | "developer") {
                    return Err(bad(format!("{at}.role"), format!("{role:?} is not one of user, assistant, system, developer")));
                }
                let text = content_text(item.get("content").unwrap_or(&Value::Null), &format!("{at}.content"))?;
                out.push(msg(role, text));
            }
            "function_call" => {
                let (Some(call_id), Some(name)) = (item.get("call_id").and_then(Value::as_str), item.get("name").and_then(Value::as_str))
                else {
                    return Err(bad(at, "a function_call item needs `call_id` and `name`"));
                };
                let args = tools::arguments_value(item.get("arguments"));
                let call = json!({"type": "function", "id": call_id, "function": {"name": name, "arguments": args}});
                // Calls in a row are one assistant turn.
                match out.last_mut() {
                    Some(m) if m.role == "assistant" && m.tool_calls.is_some() => m.tool_calls.get_or_insert_with(Vec::new).push(call),
                    _ => {
                        let mut m = msg("assistant", String::new());
                        m.tool_calls = Some(vec![call]);
                        out.push(m);
                    }
                }
            }
            "function_call_output" => {
                let call_id = item.get("call_id").and_then(Value::as_str).ok_or_else(|| bad(format!("{at}.call_id"), "is required"))?;
                let output = match item.get("output") {
                    Some(Value::String(s)) => s.clone(),
                    Some(v @ Value::Array(_)) => content_text(v, &format!("{at}.output"))?,
                    _ => return Err(bad(format!("{at}.output"), "must be a string")),
                };
                out.push(MessageIn {
                    role: "tool".into(),
                    content: Some(Content::Text(output)),
                    name: None,
                    tool_calls: None,
                    tool_call_id: Some(call_id.into()),
                });
            }
            "reasoning" => {}
            "" => return Err(bad(format!("{at}.type"), "is required (or `role`, for a message)")),
            other => return Err(bad(format!("{at}.type"), format!("{other:?} items are not supported by this server"))),
        }
    }
    Ok(())
}

fn functions(list: Vec<Value>) -> Result<Vec<tools::Tool>, ApiError> {
    list.into_iter()
        .enumerate()
        .map(|(i, t)| {
            let at = format!("tools[{i}]");
            match t.get("type").and_then(Value::as_str) {
                Some("function") => {}
                Some(other) => {
                    return Err(bad(
                        format!("{at}.type"),
                        format!("{other:?} tools are not supported by this server (function tools only)"),
                    ))
                }
                None => return Err(bad(format!("{at}.type"), "is required")),
            }
            let name = t.get("name").and_then(Value::as_str).ok_or_else(|| bad(format!("{at}.name"), "is required"))?;
            let mut f = json!({"name": name});
            for k in ["description", "parameters", "strict"] {
                if let Some(v) = t.get(k).filter(|v| !v.is_null()) {
                    f[k] = v.clone();
                }
            }
            serde_json::from_value(json!({"type": "function", "function": f})).map_err(|e| bad(at, e))
        })
        .collect()
}

/// Deserialize and validate a `/v1/responses` body; `previous` gives a stored
/// conversation's items by response id.
pub fn parse(model: &ServedModel, bytes: &[u8], previous: impl Fn(&str) -> Option<Vec<Value>>) -> Result<Request, ApiError> {
    let b: ResponsesBody = typed_body(bytes)?;
    let mut items = match b.previous_response_id.as_deref() {
        None => Vec::new(),
        Some(id) => previous(id).ok_or_else(|| {
            ApiError::new(404, "invalid_request_error", format!("previous response {id:?} not found (not stored, or evicted)"))
                .param("previous_response_id")
                .code("previous_response_not_found")
        })?,
    };
    let stored = items.len();
    match &b.input {
        None => return Err(bad("input", "is required").code("missing_required_parameter")),
        Some(Value::String(s)) => items.push(json!({"type": "message", "role": "user", "content": s})),
        Some(Value::Array(a)) if !a.is_empty() => items.extend(a.iter().cloned()),
        Some(_) => return Err(bad("input", "must be a string or a non-empty list of items")),
    }
    let mut chat = Vec::with_capacity(items.len() + 1);
    if let Some(s) = b.instructions.as_deref().filter(|s| !s.is_empty()) {
        chat.push(msg("system", s.to_string()));
    }
    messages(&items[..stored], 0, &mut chat).map_err(|e| ApiError { message: format!("the stored conversation: {}", e.message), ..e })?;
    messages(&items[stored..], 0, &mut chat)?;
    // (Error paths of the new items count from the request's own `input`.)
    let tools_in = b.tools.clone().map(functions).transpose()?;
    let tool_choice = match &b.tool_choice {
        None => None,
        Some(v @ Value::String(_)) => Some(v.clone()),
        Some(v) => match (v.get("type").and_then(Value::as_str), v.get("name").and_then(Value::as_str)) {
            (Some("function"), Some(name)) => Some(json!({"type": "function", "function": {"name": name}})),
            _ => return Err(bad("tool_choice", "must be auto, none, required or {\"type\": \"function\", \"name\": ...}")),
        },
    };
    let format = b.text.as_ref().and_then(|t| t.get("format")).filter(|f| !f.is_null());
    let response_format = match format {
        None => None,
        Some(f) => match f.get("type").and_then(Value::as_str) {
            Some("text") => None,
            Some("json_object") => Some(json!({"type": "json_object"})),
            Some("json_schema") => Some(json!({"type": "json_schema", "json_schema": {
                "name": f.get("name").cloned().unwrap_or(json!("output")), "schema": f.get("schema").cloned().unwrap_or(json!({}))}})),
            _ => return Err(bad("text.format.type", "must be text, json_object or json_schema")),
        },
    };
    let req = RequestBody {
        model: b.model.clone(),
        messages: Some(chat),
        max_completion_tokens: b.max_output_tokens,
        temperature: b.temperature,
        top_p: b.top_p,
        tools: tools_in,
        tool_choice,
        response_format,
        ..Default::default()
    };
    let validated = validate(model, Endpoint::Chat, req).map_err(|mut e| {
        if let Some(p) = e.param.clone() {
            let to = match p.as_str() {
                "max_tokens" | "max_completion_tokens" => "max_output_tokens".to_string(),
                "response_format" => "text.format".to_string(),
                "messages" => "input".to_string(),
                _ => p.clone(),
            };
            e.message = e.message.replace(&format!("`{p}`"), &format!("`{to}`"));
            if !e.message.contains(&to) {
                e.message = format!("`{to}`: {}", e.message);
            }
            e.param = Some(to);
        }
        e
    })?;
    let mut echo = Map::new();
    echo.insert("instructions".into(), json!(b.instructions));
    echo.insert("tools".into(), json!(b.tools.unwrap_or_default()));
    echo.insert("tool_choice".into(), b.tool_choice.unwrap_or(json!("auto")));
    echo.insert("temperature".into(), json!(b.temperature.unwrap_or(1.0)));
    echo.insert("top_p".into(), json!(b.top_p.unwrap_or(1.0)));
    echo.insert("max_output_tokens".into(), json!(b.max_output_tokens));
    echo.insert("previous_response_id".into(), json!(b.previous_response_id));
    echo.insert("store".into(), json!(b.store.unwrap_or(true)));
    echo.insert("text".into(), json!({"format": format.cloned().unwrap_or(json!({"type": "text"}))}));
    echo.insert("parallel_tool_calls".into(), json!(b.parallel_tool_calls.unwrap_or(true)));
    echo.insert("metadata".into(), b.metadata.unwrap_or(json!({})));
    echo.insert("reasoning".into(), json!({"effort": null, "summary": null}));
    echo.insert("truncation".into(), json!("disabled"));
    Ok(Request { validated, stream: b.stream.unwrap_or(false), store: b.store.unwrap_or(true), items, echo })
}

/// One accepted Responses request's identity in its answer.
#[derive(Debug, Clone)]
pub struct Job {
    pub id: String,
    pub created_at: u64,
    pub model: String,
    pub prompt_tokens: usize,
    pub tools: Option<Tools>,
    pub echo: Map<String, Value>,
}

fn message_item(id: &str, text: &str, status: &str) -> Value {
    json!({"type": "message", "id": id, "status": status, "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]})
}

fn call_item(id: &str, call_id: &str, name: &str, arguments: &str, status: &str) -> Value {
    json!({"type": "function_call", "id": id, "call_id": call_id, "name": name, "arguments": arguments, "status": status})
}

impl Job {
    /// The Response object: `status` and `output` as given, the request's settings echoed.
    pub fn response(&self, status: &str, output: Vec<Value>, g: Option<&Generation>) -> Value {
        let mut o = Map::new();
        o.insert("id".into(), json!(self.id));
        o.insert("object".into(), json!("response"));
        o.insert("created_at".into(), json!(self.created_at));
        o.insert("status".into(), json!(status));
        o.insert("model".into(), json!(self.model));
        o.insert("output".into(), Value::Array(output));
        o.insert("error".into(), Value::Null);
        let incomplete = g.filter(|g| matches!(g.finish_reason, FinishReason::Length | FinishReason::ContextFull));
        o.insert("incomplete_details".into(), incomplete.map_or(Value::Null, |_| json!({"reason": "max_output_tokens"})));
        o.insert(
            "usage".into(),
            g.map_or(Value::Null, |g| {
                json!({"input_tokens": self.prompt_tokens, "input_tokens_details": {"cached_tokens": g.cached_prompt_tokens},
                    "output_tokens": g.output_ids.len(), "output_tokens_details": {"reasoning_tokens": 0},
                    "total_tokens": self.prompt_tokens + g.output_ids.len()})
            }),
        );
        for (k, v) in &self.echo {
            o.insert(k.clone(), v.clone());
        }
        Value::Object(o)
    }

    /// `completed`, or `incomplete` when max_output_tokens (or the context) cut it.
    pub fn status(g: &Generation) -> &'static str {
        match g.finish_reason {
            FinishReason::Length | FinishReason::ContextFull => "incomplete",
            _ => "completed",
        }
    }

    /// The output items of a whole generation: the message (its text outside calls) and a
    /// `function_call` item per call.
    pub fn output(&self, g: &Generation) -> Vec<Value> {
        let (text, calls) = match self.tools.as_ref().and_then(|t| t.parse(&g.text, &self.id)) {
            Some((content, calls)) => (content.unwrap_or_default(), calls),
            None => (g.text.clone(), Vec::new()),
        };
        let mut out = Vec::new();
        if !text.is_empty() || calls.is_empty() {
            out.push(message_item(&format!("msg_{}", self.id), &text, "completed"));
        }
        for (i, c) in calls.iter().enumerate() {
            out.push(call_item(&format!("fc_{}_{i}", self.id), &c.id, &c.function.name, &c.function.arguments, "completed"));
        }
        out
    }
}

/// The typed events of a streamed Response as its text arrives, each `(type, data)` with
/// its `sequence_number`: output items open (`response.output_item.added`, a message's
/// `response.content_part.added`), grow (`response.output_text.delta`,
/// `response.function_call_arguments.delta`) and close (`...done`); the items are kept for
/// the final `response.completed`, under the same ids.
#[derive(Debug)]
pub struct OutputStream {
    id: String,
    seq: u64,
    /// Finished items.
    pub items: Vec<Value>,
    /// The open item: a message's text, or a call's (call id, name, arguments).
    open: Option<Open>,
}

#[derive(Debug)]
enum Open {
    Text(String),
    Call(String, String, String),
}

impl OutputStream {
    pub fn new(id: &str) -> Self {
        OutputStream { id: id.into(), seq: 0, items: Vec::new(), open: None }
    }

    /// An event; `data` gains its type and sequence number.
    pub fn event(&mut self, kind: &'static str, mut data: Value) -> (&'static str, Value) {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(self.seq);
        self.seq += 1;
        (kind, data)
    }

    fn item_id(&self) -> String {
        match self.open {
            Some(Open::Call(..)) => format!("fc_{}_{}", self.id, self.items.len()),
            _ => format!("msg_{}_{}", self.id, self.items.len()),
        }
    }

    fn close(&mut self, out: &mut Vec<(&'static str, Value)>) {
        let index = self.items.len();
        let id = self.item_id();
        let item = match self.open.take() {
            None => return,
            Some(Open::Text(text)) => {
                let part = json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []});
                let e = self.event(
                    "response.output_text.done",
                    json!({"item_id": id, "output_index": index, "content_index": 0, "text": text, "logprobs": []}),
                );
                out.push(e);
                let e = self
                    .event("response.content_part.done", json!({"item_id": id, "output_index": index, "content_index": 0, "part": part}));
                out.push(e);
                message_item(&id, &text, "completed")
            }
            Some(Open::Call(call_id, name, args)) => {
                let e =
                    self.event("response.function_call_arguments.done", json!({"item_id": id, "output_index": index, "arguments": args}));
                out.push(e);
                call_item(&id, &call_id, &name, &args, "completed")
            }
        };
        let e = self.event("response.output_item.done", json!({"output_index": index, "item": item}));
        out.push(e);
        self.items.push(item);
    }

    /// Close the open item and open an empty message item with its output_text part.
    fn open_message(&mut self, out: &mut Vec<(&'static str, Value)>) {
        self.close(out);
        self.open = Some(Open::Text(String::new()));
        let (index, id) = (self.items.len(), self.item_id());
        let e = self.event("response.output_item.added", json!({"output_index": index, "item": message_item(&id, "", "in_progress")}));
        out.push(e);
        let part = json!({"type": "output_text", "text": "", "annotations": [], "logprobs": []});
        let e = self.event("response.content_part.added", json!({"item_id": id, "output_index": index, "content_index": 0, "part": part}));
        out.push(e);
    }

    /// Text outside calls.
    pub fn text(&mut self, t: &str) -> Vec<(&'static str, Value)> {
        let mut out = Vec::new();
        if t.is_empty() {
            return out;
        }
        if !matches!(self.open, Some(Open::Text(_))) {
            self.open_message(&mut out);
        }
        if let Some(Open::Text(s)) = &mut self.open {
            s.push_str(t);
        }
        let (index, id) = (self.items.len(), self.item_id());
        let e = self.event(
            "response.output_text.delta",
            json!({"item_id": id, "output_index": index, "content_index": 0, "delta": t, "logprobs": []}),
        );
        out.push(e);
        out
    }

    /// A piece of a tool call: a new call opens a `function_call` item, argument fragments
    /// grow the open one.
    pub fn call(&mut self, d: &ToolCallDelta) -> Vec<(&'static str, Value)> {
        let mut out = Vec::new();
        if let Some(name) = &d.function.name {
            self.close(&mut out);
            self.open = Some(Open::Call(d.id.clone().unwrap_or_default(), name.clone(), String::new()));
            let (index, id) = (self.items.len(), self.item_id());
            let item = call_item(&id, d.id.as_deref().unwrap_or(""), name, "", "in_progress");
            let e = self.event("response.output_item.added", json!({"output_index": index, "item": item}));
            out.push(e);
        }
        if d.function.arguments.is_empty() {
            return out;
        }
        if let Some(Open::Call(_, _, args)) = &mut self.open {
            args.push_str(&d.function.arguments);
            let (index, id) = (self.items.len(), self.item_id());
            let e = self.event(
                "response.function_call_arguments.delta",
                json!({"item_id": id, "output_index": index, "delta": d.function.arguments}),
            );
            out.push(e);
        }
        out
    }

    /// The end: the open item closes (a Response without output gets an empty message).
    pub fn finish(&mut self) -> Vec<(&'static str, Value)> {
        let mut out = Vec::new();
        if self.items.is_empty() && self.open.is_none() {
            self.open_message(&mut out);
        }
        self.close(&mut out);
        out
    }
}

/// A conversation as the input items a later `previous_response_id` continues: its input
/// items, then the response's output items.
pub fn conversation(mut items: Vec<Value>, output: &[Value]) -> Vec<Value> {
    for o in output {
        match o.get("type").and_then(Value::as_str) {
            Some("message") => {
                let text = o.pointer("/content/0/text").and_then(Value::as_str).unwrap_or("");
                items.push(json!({"type": "message", "role": "assistant", "content": text}));
            }
            Some("function_call") => items.push(o.clone()),
            _ => {}
        }
    }
    items
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn items_translate() {
        let items = vec![
            json!({"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]}),
            json!({"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{\"city\": \"Oslo\"}"}),
            json!({"type": "function_call", "call_id": "c2", "name": "w", "arguments": "{\"city\": \"Rome\"}"}),
            json!({"type": "function_call_output", "call_id": "c1", "output": "4 C"}),
        ];
        let mut out = Vec::new();
        messages(&items, 0, &mut out).unwrap();
        assert_eq!(out.len(), 3);
        assert_eq!(out[1].tool_calls.as_ref().unwrap().len(), 2, "calls in a row are one turn");
        assert_eq!(out[1].tool_calls.as_ref().unwrap()[0]["function"]["arguments"]["city"], "Oslo");
        assert_eq!(out[2].tool_call_id.as_deref(), Some("c1"));
        let e = messages(&[json!({"role": "user", "content": [{"type": "input_image", "image_url": "x"}]})], 0, &mut out).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("input[0].content[0].type"));
        let e = messages(&[json!({"type": "web_search_call"})], 0, &mut out).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("input[0].type"));
        let e = functions(vec![json!({"type": "web_search"})]).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tools[0].type"));
    }

    #[test]
    fn stream_items_open_and_close_with_one_id() {
        let mut s = OutputStream::new("r");
        let mut ev = s.text("Hi");
        ev.extend(s.call(&ToolCallDelta {
            index: 0,
            id: Some("call0".into()),
            kind: Some("function"),
            function: tools::FunctionDelta { name: Some("add".into()), arguments: String::new() },
        }));
        ev.extend(s.call(&ToolCallDelta {
            index: 0,
            id: None,
            kind: None,
            function: tools::FunctionDelta { name: None, arguments: "{}".into() },
        }));
        ev.extend(s.finish());
        let kinds: Vec<&str> = ev.iter().map(|e| e.0).collect();
        assert_eq!(
            kinds,
            [
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
            ]
        );
        assert!(ev.iter().enumerate().all(|(i, e)| e.1["sequence_number"] == i), "sequence numbers count up");
        assert_eq!(s.items.len(), 2);
        assert_eq!(ev[0].1["item"]["id"], s.items[0]["id"]);
        assert_eq!(ev[6].1["item"]["id"], s.items[1]["id"]);
        assert_eq!((s.items[1]["call_id"].clone(), s.items[1]["arguments"].clone()), (json!("call0"), json!("{}")));
        let conv = conversation(vec![json!({"role": "user", "content": "x"})], &s.items);
        assert_eq!(conv.len(), 3);
    }
}

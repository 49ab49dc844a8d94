//! Tool calling: `tools` and `tool_choice` of a chat request, how the prompt presents them,
//! the grammar that forces a call, and the parser that turns the model's output back into
//! `tool_calls`.
//!
//! One call syntax for every model, the Hermes/Qwen one:
//! `<tool_call>\n{"name": NAME, "arguments": {...}}\n</tool_call>`. A chat template that takes
//! `tools` (Qwen2.5's does) renders them itself and was trained on that syntax; for one that
//! does not (SmolLM2's), the tools and the syntax are described in the system message.
//! `tool_choice: "required"` or a named function constrains the output to exactly one call
//! whose arguments fit the function's `parameters` schema (a Lark grammar embedding the JSON
//! schema, compiled by llguidance); `"auto"` leaves the model free and parses what it wrote.

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use super::ApiError;
use crate::engine::Constraint;

/// One entry of `tools`.
#[derive(Debug, Clone, Deserialize)]
pub struct Tool {
    #[serde(rename = "type")]
    pub kind: String,
    pub function: FunctionDef,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct FunctionDef {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// A JSON schema of the arguments object (absent: any object).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parameters: Option<Value>,
}

/// `tool_choice`.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolChoice {
    None,
    Auto,
    Required,
    Named(String),
}

/// The request's tools, checked.
#[derive(Debug, Clone)]
pub struct Tools {
    pub functions: Vec<FunctionDef>,
    pub choice: ToolChoice,
}

/// A call the model made, as the response reports it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ToolCall {
    /// Streamed deltas carry the call's index.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub index: Option<usize>,
    pub id: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub function: CalledFunction,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CalledFunction {
    pub name: String,
    /// The arguments as a JSON string (OpenAI's shape).
    pub arguments: String,
}

/// A streamed piece of a tool call (OpenAI's chunk shape): the first names the call (`id`,
/// `type`, `function.name`, empty arguments), the later ones carry argument fragments only.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ToolCallDelta {
    pub index: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
    pub function: FunctionDelta,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FunctionDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub arguments: String,
}

impl ToolCallDelta {
    /// A whole call as one delta.
    pub fn whole(index: usize, c: ToolCall) -> ToolCallDelta {
        ToolCallDelta {
            index,
            id: Some(c.id),
            kind: Some(c.kind),
            function: FunctionDelta { name: Some(c.function.name), arguments: c.function.arguments },
        }
    }
}

/// What a choice's streamed text becomes, piece by piece.
#[derive(Debug, Clone, PartialEq)]
pub enum StreamPiece {
    /// Message text outside any call.
    Content(String),
    /// A call, or a fragment of its arguments.
    Call(ToolCallDelta),
}

/// Where [`CallStream`] is in the text.
#[derive(Debug, Clone, PartialEq)]
enum StreamState {
    /// Message text (maybe the start of a call tag).
    Text,
    /// After the opening tag, before the arguments: `{"name": "...", "arguments": `.
    Header,
    /// Inside a call whose shape the header parse did not take: kept until the closing tag,
    /// then parsed whole.
    Held,
    /// Streaming an arguments object: JSON depth, inside a string, after a backslash.
    Args { depth: usize, in_str: bool, esc: bool },
    /// After the arguments, up to the closing tag.
    Tail,
    /// The whole message may be an untagged call (it starts with `{` or a fence): kept to the
    /// end, then parsed as [`Tools::parse`] does.
    Untagged,
}

/// Tool calls parsed from a streamed choice as its text arrives, so that a client sees the
/// call's name as soon as the model has written it and then its arguments as they are
/// generated (OpenAI's streamed `tool_calls` deltas). The calls it reports are the ones
/// [`Tools::parse`] finds in the whole text: tagged calls to a declared function with an
/// object of arguments, or a whole message that is an untagged call.
pub struct CallStream {
    tools: Tools,
    id_prefix: String,
    buf: String,
    state: StreamState,
    calls: usize,
    /// Content text sent so far (a leading untagged call is possible only before any).
    sent_text: bool,
}

impl CallStream {
    /// A parser for a choice's text against `tools` (cloned: the stream owns what it parses
    /// against, so it can live beside the job it answers).
    pub fn new(tools: &Tools, id_prefix: &str) -> CallStream {
        CallStream {
            tools: tools.clone(),
            id_prefix: id_prefix.to_string(),
            buf: String::new(),
            state: StreamState::Text,
            calls: 0,
            sent_text: false,
        }
    }

    /// Calls reported so far.
    pub fn calls(&self) -> usize {
        self.calls
    }

    /// Take the next piece of text.
    pub fn push(&mut self, text: &str) -> Vec<StreamPiece> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        while self.step(&mut out, false) {}
        out
    }

    /// The text has ended: what is still held.
    pub fn finish(mut self) -> Vec<StreamPiece> {
        let mut out = Vec::new();
        while self.step(&mut out, true) {}
        match std::mem::replace(&mut self.state, StreamState::Text) {
            StreamState::Untagged => match self.tools.parse_untagged(&self.buf, &self.id_prefix) {
                Some(calls) => {
                    for c in calls {
                        out.push(StreamPiece::Call(ToolCallDelta::whole(self.calls, c)));
                        self.calls += 1;
                    }
                }
                None => out.push(StreamPiece::Content(std::mem::take(&mut self.buf))),
            },
            // An unclosed call is text, as in `Tools::parse` (what the header took included).
            StreamState::Header | StreamState::Held => out.push(StreamPiece::Content(format!("{OPEN}{}", self.buf))),
            // Text was sent in full by the last step; a call's tail needs nothing more.
            _ => {}
        }
        out.retain(|p| !matches!(p, StreamPiece::Content(t) if t.is_empty()));
        out
    }

    /// One move of the state machine; whether another may follow.
    fn step(&mut self, out: &mut Vec<StreamPiece>, end: bool) -> bool {
        match self.state.clone() {
            StreamState::Text => {
                let t = self.buf.trim_start();
                if !self.sent_text && self.calls == 0 && (t.starts_with('{') || t.starts_with('[') || t.starts_with("```")) {
                    self.state = StreamState::Untagged;
                    return false;
                }
                if let Some(i) = self.buf.find(OPEN) {
                    self.emit_text(out, i);
                    self.buf.drain(..OPEN.len());
                    self.state = StreamState::Header;
                    return true;
                }
                // Hold back what may be the start of a tag (or, at the start, of a call).
                let keep = if end { 0 } else { (1..OPEN.len()).rev().find(|&n| self.buf.ends_with(&OPEN[..n])).unwrap_or(0) };
                if !end && self.buf.trim().is_empty() && !self.sent_text && self.calls == 0 {
                    return false;
                }
                let upto = self.buf.len() - keep;
                self.emit_text(out, upto);
                false
            }
            StreamState::Header => match header(&self.buf) {
                Header::More => false,
                Header::Bad => {
                    self.state = StreamState::Held;
                    true
                }
                Header::Done { name, consumed } => {
                    if !self.tools.functions.iter().any(|f| f.name == name) {
                        self.state = StreamState::Held;
                        return true;
                    }
                    let rest = self.buf[consumed..].trim_start();
                    if rest.is_empty() {
                        return false;
                    }
                    if !rest.starts_with('{') {
                        // Arguments as a string (or anything else): parsed whole at the tag.
                        self.state = StreamState::Held;
                        return true;
                    }
                    let id = format!("{}-call{}", self.id_prefix, self.calls);
                    let skip = self.buf.len() - rest.len();
                    self.buf.drain(..skip);
                    out.push(StreamPiece::Call(ToolCallDelta {
                        index: self.calls,
                        id: Some(id),
                        kind: Some("function"),
                        function: FunctionDelta { name: Some(name), arguments: String::new() },
                    }));
                    self.state = StreamState::Args { depth: 0, in_str: false, esc: false };
                    true
                }
            },
            StreamState::Held => {
                let Some(i) = self.buf.find(CLOSE) else { return false };
                let body = self.buf[..i].trim().to_string();
                let call = serde_json::from_str::<Value>(&body).ok().and_then(|v| self.tools.call(&v, &self.id_prefix, self.calls));
                match call {
                    Some(c) => {
                        out.push(StreamPiece::Call(ToolCallDelta::whole(self.calls, c)));
                        self.calls += 1;
                    }
                    // Not a call to a declared function: the tag and all are text.
                    None => {
                        out.push(StreamPiece::Content(format!("{OPEN}{}{CLOSE}", &self.buf[..i])));
                        self.sent_text = true;
                    }
                }
                self.buf.drain(..i + CLOSE.len());
                self.state = StreamState::Text;
                true
            }
            StreamState::Args { mut depth, mut in_str, mut esc } => {
                let mut done = None;
                for (i, ch) in self.buf.char_indices() {
                    if in_str {
                        match (esc, ch) {
                            (true, _) => esc = false,
                            (false, '\\') => esc = true,
                            (false, '"') => in_str = false,
                            _ => {}
                        }
                        continue;
                    }
                    match ch {
                        '"' => in_str = true,
                        '{' | '[' => depth += 1,
                        '}' | ']' => {
                            depth = depth.saturating_sub(1);
                            if depth == 0 {
                                done = Some(i + 1);
                                break;
                            }
                        }
                        _ => {}
                    }
                }
                let take = done.unwrap_or(self.buf.len());
                let frag: String = self.buf.drain(..take).collect();
                if !frag.is_empty() {
                    out.push(StreamPiece::Call(ToolCallDelta {
                        index: self.calls,
                        id: None,
                        kind: None,
                        function: FunctionDelta { name: None, arguments: frag },
                    }));
                }
                if done.is_some() {
                    self.calls += 1;
                    self.state = StreamState::Tail;
                    true
                } else {
                    self.state = StreamState::Args { depth, in_str, esc };
                    false
                }
            }
            StreamState::Tail => {
                let Some(i) = self.buf.find(CLOSE) else {
                    if end {
                        self.buf.clear();
                    }
                    return false;
                };
                self.buf.drain(..i + CLOSE.len());
                self.state = StreamState::Text;
                true
            }
            StreamState::Untagged => false,
        }
    }

    /// Send `buf[..upto]` as content (text between calls, as `Tools::parse` keeps it).
    fn emit_text(&mut self, out: &mut Vec<StreamPiece>, upto: usize) {
        if upto == 0 {
            return;
        }
        let t: String = self.buf.drain(..upto).collect();
        // Leading whitespace before anything else is dropped, as `parse` trims it.
        let t = if self.sent_text { t } else { t.trim_start().to_string() };
        if !t.is_empty() {
            self.sent_text = true;
            out.push(StreamPiece::Content(t));
        }
    }
}

enum Header {
    /// Not enough text yet.
    More,
    /// Not `{"name": "<string>", "arguments":` (another key order, say).
    Bad,
    /// The function's name, and the bytes up to the arguments' value.
    Done { name: String, consumed: usize },
}

/// `{"name": "<name>", "arguments": ` at the start of `s` (whitespace allowed between).
fn header(s: &str) -> Header {
    let mut i = 0;
    let b = s.as_bytes();
    let ws = |i: &mut usize| {
        while *i < b.len() && (b[*i] as char).is_ascii_whitespace() {
            *i += 1;
        }
    };
    // Each literal must match in full; a prefix of it at the end of `s` needs more text.
    let lit = |i: &mut usize, l: &str| -> Option<bool> {
        let rest = &s[*i..];
        if rest.starts_with(l) {
            *i += l.len();
            Some(true)
        } else if l.starts_with(rest) {
            None
        } else {
            Some(false)
        }
    };
    // The literals `ls` in order, with whitespace before each: the header's verdict if they
    // are not all there.
    let lits = |i: &mut usize, ls: &[&str]| -> Result<(), Header> {
        for l in ls {
            ws(i);
            match lit(i, l) {
                None => return Err(Header::More),
                Some(false) => return Err(Header::Bad),
                Some(true) => {}
            }
        }
        Ok(())
    };
    if let Err(h) = lits(&mut i, &["{", "\"name\"", ":"]) {
        return h;
    }
    ws(&mut i);
    if i >= b.len() {
        return Header::More;
    }
    if b[i] != b'"' {
        return Header::Bad;
    }
    // The name: a JSON string without escapes (function names are [a-zA-Z0-9_-]).
    let Some(len) = s[i + 1..].find('"') else { return Header::More };
    let name = s[i + 1..i + 1 + len].to_string();
    if name.contains('\\') {
        return Header::Bad;
    }
    i += len + 2;
    if let Err(h) = lits(&mut i, &[",", "\"arguments\"", ":"]) {
        return h;
    }
    Header::Done { name, consumed: i }
}

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

impl Tools {
    /// Check `tools` and `tool_choice` (`None` when the request has no tools or chose none).
    pub fn from_request(tools: Option<Vec<Tool>>, choice: Option<&Value>) -> Result<Option<Tools>, ApiError> {
        let tools = tools.unwrap_or_default();
        let bad = |p: &str, m: String| ApiError::bad(m).param(p);
        for (i, t) in tools.iter().enumerate() {
            if t.kind != "function" {
                return Err(bad("tools", format!("tools[{i}].type is {:?}; only \"function\" tools exist", t.kind)));
            }
            if t.function.name.is_empty() || !t.function.name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-') {
                return Err(bad("tools", format!("tools[{i}].function.name {:?} must be letters, digits, _ or -", t.function.name)));
            }
            if let Some(p) = &t.function.parameters {
                if !p.is_object() {
                    return Err(bad("tools", format!("tools[{i}].function.parameters must be a JSON schema object")));
                }
            }
        }
        let choice = match choice {
            None | Some(Value::Null) => {
                if tools.is_empty() {
                    ToolChoice::None
                } else {
                    ToolChoice::Auto
                }
            }
            Some(Value::String(s)) => match s.as_str() {
                "none" => ToolChoice::None,
                "auto" => ToolChoice::Auto,
                "required" => ToolChoice::Required,
                other => return Err(bad("tool_choice", format!("`tool_choice` {other:?} is not none, auto, required or a function"))),
            },
            Some(v) => match v.pointer("/function/name").and_then(Value::as_str) {
                Some(name) if v.get("type").and_then(Value::as_str) == Some("function") => ToolChoice::Named(name.to_string()),
                _ => {
                    return Err(bad(
                        "tool_choice",
                        "`tool_choice` must be a string or {\"type\": \"function\", \"function\": {\"name\": ...}}".into(),
                    ))
                }
            },
        };
        if choice != ToolChoice::None && tools.is_empty() {
            return Err(bad("tool_choice", "`tool_choice` asks for a tool call but `tools` is empty".into()));
        }
        if let ToolChoice::Named(n) = &choice {
            if !tools.iter().any(|t| &t.function.name == n) {
                return Err(bad("tool_choice", format!("`tool_choice` names {n:?}, which is not among `tools`")));
            }
        }
        if choice == ToolChoice::None {
            return Ok(None);
        }
        Ok(Some(Tools { functions: tools.into_iter().map(|t| t.function).collect(), choice }))
    }

    /// The tools as chat templates take them (`tools` in the template's context).
    pub fn template_value(&self) -> Value {
        Value::Array(self.functions.iter().map(|f| json!({"type": "function", "function": f})).collect())
    }

    /// The system text describing the tools, for templates that do not take `tools`.
    pub fn system_text(&self) -> String {
        let mut s = String::from(
            "You can call functions. To call one, answer with only\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <arguments-json-object>}\n</tool_call>\nThe functions:\n",
        );
        for f in &self.functions {
            s.push_str(&serde_json::to_string(f).unwrap_or_default());
            s.push('\n');
        }
        s
    }

    /// The grammar of a forced call (`required` or a named function): one call whose
    /// arguments fit the function's schema. `None` for `auto`.
    pub fn constraint(&self) -> Option<Constraint> {
        let call = |f: &FunctionDef| {
            json!({
                "type": "object",
                "properties": {"name": {"const": f.name}, "arguments": f.parameters.clone().unwrap_or_else(|| json!({"type": "object"}))},
                "required": ["name", "arguments"],
                "additionalProperties": false,
            })
        };
        let mut schema = match &self.choice {
            ToolChoice::Named(n) => call(self.functions.iter().find(|f| &f.name == n)?),
            ToolChoice::Required => json!({"anyOf": self.functions.iter().map(call).collect::<Vec<_>>()}),
            ToolChoice::Auto | ToolChoice::None => return None,
        };
        schema["x-guidance"] = json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "});
        Some(Constraint::Lark(format!("start: \"{OPEN}\\n\" call \"\\n{CLOSE}\"\ncall: %json {schema}\n")))
    }

    /// The calls in `text` (the text outside them is the message's content). Only calls to
    /// known functions with an object of arguments count; `None` when there is none.
    ///
    /// Small models often drop the tags the template asks for: a message that is, as a
    /// whole, one call object (or a list of them) without tags, bare or in a ```json fence,
    /// is read as those calls too, under the same rule (known functions, object arguments).
    pub fn parse(&self, text: &str, id_prefix: &str) -> Option<(Option<String>, Vec<ToolCall>)> {
        let mut calls = Vec::new();
        let mut content = String::new();
        let mut rest = text;
        while let Some(start) = rest.find(OPEN) {
            let Some(len) = rest[start..].find(CLOSE) else { break };
            let body = rest[start + OPEN.len()..start + len].trim();
            content.push_str(&rest[..start]);
            rest = &rest[start + len + CLOSE.len()..];
            if let Some(c) = serde_json::from_str::<Value>(body).ok().and_then(|v| self.call(&v, id_prefix, calls.len())) {
                calls.push(c);
            }
        }
        content.push_str(rest);
        if calls.is_empty() {
            return self.parse_untagged(text, id_prefix).map(|c| (None, c));
        }
        let content = content.trim();
        Some(((!content.is_empty()).then(|| content.to_string()), calls))
    }

    /// A whole message that is one call object or a list of them (optionally in a ```json
    /// fence); every element must be a call to a known function.
    pub(crate) fn parse_untagged(&self, text: &str, id_prefix: &str) -> Option<Vec<ToolCall>> {
        let t = text.trim();
        let t = t.strip_prefix("```json").or_else(|| t.strip_prefix("```")).and_then(|r| r.trim_end().strip_suffix("```")).unwrap_or(t);
        let v: Value = serde_json::from_str(t.trim()).ok()?;
        let items = match v {
            Value::Array(a) if !a.is_empty() => a,
            v @ Value::Object(_) => vec![v],
            _ => return None,
        };
        items.iter().enumerate().map(|(i, v)| self.call(v, id_prefix, i)).collect()
    }

    /// `{"name", "arguments"}` as call number `i`, when it names a known function and its
    /// arguments are an object (or a JSON string of one).
    pub(crate) fn call(&self, v: &Value, id_prefix: &str, i: usize) -> Option<ToolCall> {
        let (name, args) = (v.get("name")?.as_str()?, v.get("arguments")?);
        self.functions.iter().find(|f| f.name == name)?;
        let arguments = match args {
            Value::String(s) if serde_json::from_str::<Value>(s).is_ok_and(|a| a.is_object()) => s.clone(),
            Value::Object(_) => args.to_string(),
            _ => return None,
        };
        Some(ToolCall {
            index: None,
            id: format!("{id_prefix}-call{i}"),
            kind: "function",
            function: CalledFunction { name: name.to_string(), arguments },
        })
    }
}

/// An assistant message's `tool_calls` (OpenAI's shape, arguments a JSON string) as the
/// call syntax, for templates that do not render tool calls themselves.
pub fn calls_as_text(calls: &[Value]) -> String {
    let mut s = String::new();
    for c in calls {
        let name = c.pointer("/function/name").and_then(Value::as_str).unwrap_or("");
        let args = arguments_value(c.pointer("/function/arguments"));
        s.push_str(&format!("{OPEN}\n{}\n{CLOSE}\n", json!({"name": name, "arguments": args})));
    }
    s
}

/// Call arguments as an object (templates such as Qwen's print them with `tojson`): a JSON
/// string is parsed, anything unparsable kept as it is.
pub fn arguments_value(v: Option<&Value>) -> Value {
    match v {
        Some(Value::String(s)) => serde_json::from_str(s).unwrap_or_else(|_| Value::String(s.clone())),
        Some(v) => v.clone(),
        None => json!({}),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools(choice: Value) -> Tools {
        let t: Vec<Tool> = serde_json::from_value(json!([
            {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
            {"type": "function", "function": {"name": "add"}},
        ]))
        .unwrap();
        Tools::from_request(Some(t), Some(&choice)).unwrap().unwrap()
    }

    #[test]
    fn calls_parse_back() {
        let t = tools(json!("auto"));
        let text = "Sure.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
        let (content, calls) = t.parse(text, "x").unwrap();
        assert_eq!(content.as_deref(), Some("Sure."));
        assert_eq!(calls[0].function.name, "get_weather");
        assert_eq!(serde_json::from_str::<Value>(&calls[0].function.arguments).unwrap(), json!({"city": "Paris"}));
        assert!(t.parse("no call", "x").is_none());
        assert!(t.parse("<tool_call>{\"name\": \"unknown\", \"arguments\": {}}</tool_call>", "x").is_none());
        assert!(t.constraint().is_none());
    }

    /// A streamed text, split anywhere, reassembles to what `parse` makes of the whole:
    /// the same content and the same calls (names first, then argument fragments).
    #[test]
    fn streamed_calls_equal_the_whole_text_parse() {
        let t = tools(json!("auto"));
        let texts = [
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Pa}ris \\\"x\\\" {\"}}\n</tool_call>",
            "Sure, checking.\n<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": [1, {\"b\": 2}]}}\n</tool_call>\n<tool_call>{\"name\": \"get_weather\", \"arguments\": {}}</tool_call> done",
            "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}",
            "Plain text with a < sign and <tool_ but no call.",
            "<tool_call>{\"arguments\": {}, \"name\": \"add\"}</tool_call>",
            "<tool_call>{\"name\": \"nope\", \"arguments\": {}}</tool_call> after",
            "<tool_call>{\"name\": \"add\", \"arguments\": \"{\\\"a\\\": 1}\"}</tool_call>",
            "  [1, 2, 3]",
        ];
        for text in texts {
            let want = t.parse(text, "x");
            for step in [1usize, 2, 3, 7, 1000] {
                let mut cs = CallStream::new(&t, "x");
                let mut pieces = Vec::new();
                let chars: Vec<char> = text.chars().collect();
                for chunk in chars.chunks(step) {
                    pieces.extend(cs.push(&chunk.iter().collect::<String>()));
                }
                pieces.extend(cs.finish());
                let mut content = String::new();
                let mut calls: Vec<(String, String, String)> = Vec::new();
                for p in pieces {
                    match p {
                        StreamPiece::Content(c) => content.push_str(&c),
                        StreamPiece::Call(d) if d.function.name.is_some() => {
                            assert_eq!(d.index, calls.len(), "{text:?}");
                            calls.push((d.id.unwrap(), d.function.name.unwrap(), d.function.arguments));
                        }
                        StreamPiece::Call(d) => calls[d.index].2.push_str(&d.function.arguments),
                    }
                }
                match &want {
                    None => {
                        assert!(calls.is_empty(), "{text:?} step {step}: {calls:?}");
                        assert_eq!(content.trim(), text.trim(), "{text:?} step {step}");
                    }
                    Some((wc, wcalls)) => {
                        let content = content.trim();
                        assert_eq!((!content.is_empty()).then_some(content), wc.as_deref(), "{text:?} step {step}");
                        assert_eq!(calls.len(), wcalls.len(), "{text:?} step {step}");
                        for ((id, name, args), w) in calls.iter().zip(wcalls) {
                            assert_eq!((id, name), (&w.id, &w.function.name));
                            let (a, b): (Value, Value) =
                                (serde_json::from_str(args).unwrap(), serde_json::from_str(&w.function.arguments).unwrap());
                            assert_eq!(a, b, "{text:?} step {step}");
                        }
                    }
                }
            }
        }
    }

    /// What Qwen2.5-Coder-0.5B answers (measured): the call object without its tags.
    #[test]
    fn untagged_whole_message_calls_parse_back() {
        let t = tools(json!("auto"));
        let (content, calls) = t.parse(r#"{"name": "get_weather", "arguments": {"city": "Paris"}}"#, "x").unwrap();
        assert_eq!((content, calls[0].function.name.as_str()), (None, "get_weather"));
        let fenced = "```json\n[{\"name\": \"add\", \"arguments\": {\"a\": 1}}, {\"name\": \"get_weather\", \"arguments\": \"{}\"}]\n```";
        let (_, calls) = t.parse(fenced, "x").unwrap();
        assert_eq!(calls.iter().map(|c| c.function.name.as_str()).collect::<Vec<_>>(), ["add", "get_weather"]);
        assert_eq!(calls[1].id, "x-call1");
        // Anything else stays text: an unknown name, non-object arguments, text around it.
        for text in [
            r#"{"name": "unknown", "arguments": {}}"#,
            r#"{"name": "add", "arguments": 3}"#,
            r#"Call: {"name": "add", "arguments": {}}"#,
            r#"[{"name": "add", "arguments": {}}, {"x": 1}]"#,
            r#"{"city": "Paris"}"#,
        ] {
            assert!(t.parse(text, "x").is_none(), "{text}");
        }
    }

    #[test]
    fn choices_are_checked() {
        assert!(matches!(tools(json!("required")).constraint(), Some(Constraint::Lark(g)) if g.contains("anyOf")));
        assert!(tools(json!({"type": "function", "function": {"name": "add"}})).constraint().is_some());
        let t: Vec<Tool> = serde_json::from_value(json!([{"type": "function", "function": {"name": "f"}}])).unwrap();
        assert!(Tools::from_request(Some(t.clone()), Some(&json!({"type": "function", "function": {"name": "g"}}))).is_err());
        assert!(Tools::from_request(Some(t.clone()), Some(&json!("sometimes"))).is_err());
        assert!(Tools::from_request(Some(t), Some(&json!("none"))).unwrap().is_none());
        assert!(Tools::from_request(None, Some(&json!("required"))).is_err());
    }
}

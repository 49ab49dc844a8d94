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
    fn parse_untagged(&self, text: &str, id_prefix: &str) -> Option<Vec<ToolCall>> {
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
    fn call(&self, v: &Value, id_prefix: &str, i: usize) -> Option<ToolCall> {
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

//! Constrained decoding with llguidance: a request's [`Constraint`] (JSON schema, any JSON
//! object, regex, Lark grammar) compiles, with the tokenizer's cached grammar compiler
//! ([`Tokenizer::guidance`]), into a [`Guide`] that gives the allowed-token bitmask of each
//! step (`ceil(vocab / 32)` u32 words, applied to the logits on the GPU by
//! `kernels::logit_mask`) and follows the sampled tokens. A stop id (EOS) is allowed only
//! where the grammar accepts; a finished grammar ends the sequence.

use serde_json::Value;

use crate::model::tokenizer::Tokenizer;
use crate::{LanternError, Result};

/// What a constrained request's output must match.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case", tag = "type", content = "value")]
#[non_exhaustive]
pub enum Constraint {
    /// A JSON document valid against this JSON schema.
    JsonSchema(Value),
    /// Any JSON object (OpenAI's `json_object`).
    JsonObject,
    /// Text matching this regular expression (Rust `regex` syntax), whole.
    Regex(String),
    /// Text in the language of this Lark grammar (llguidance's Lark dialect).
    Lark(String),
}

impl Constraint {
    /// The constraint's kind, as errors name it.
    pub fn kind(&self) -> &'static str {
        match self {
            Constraint::JsonSchema(_) => "json_schema",
            Constraint::JsonObject => "json_object",
            Constraint::Regex(_) => "regex",
            Constraint::Lark(_) => "lark",
        }
    }

    /// An OpenAI `response_format` value: `{"type": "json_schema", "json_schema": {"name",
    /// "schema", "strict"}}`, `{"type": "json_object"}` or `{"type": "text"}` (no
    /// constraint: `None`). Anything else is a [`LanternError::Constraint`].
    pub fn from_response_format(v: &Value) -> Result<Option<Constraint>> {
        let bad = |reason: String| LanternError::Constraint { kind: "response_format".into(), reason };
        match v.get("type").and_then(Value::as_str) {
            Some("text") => Ok(None),
            Some("json_object") => Ok(Some(Constraint::JsonObject)),
            Some("json_schema") => {
                let js = v.get("json_schema").ok_or_else(|| bad("`json_schema` is missing".into()))?;
                let schema = js.get("schema").cloned().unwrap_or_else(|| serde_json::json!({}));
                if !(schema.is_object() || schema.is_boolean()) {
                    return Err(bad("`json_schema.schema` must be a JSON schema object".into()));
                }
                Ok(Some(Constraint::JsonSchema(schema)))
            }
            Some(other) => Err(bad(format!("type {other:?} is not one of text, json_object, json_schema"))),
            None => Err(bad("`type` is missing".into())),
        }
    }

    /// The llguidance grammar. JSON output is compact (`, ` and `: ` separators, no free
    /// whitespace) unless the schema sets `x-guidance` itself: small models given free
    /// whitespace tend to spend their tokens on it.
    fn grammar(&self) -> llguidance::api::TopLevelGrammar {
        use llguidance::api::TopLevelGrammar as G;
        let compact = serde_json::json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "});
        match self {
            Constraint::JsonSchema(s) => {
                let mut s = s.clone();
                if let Value::Bool(b) = s {
                    s = if b { serde_json::json!({}) } else { serde_json::json!({"not": {}}) };
                }
                if let Value::Object(m) = &mut s {
                    m.entry("x-guidance").or_insert(compact);
                }
                G::from_json_schema(s)
            }
            Constraint::JsonObject => G::from_json_schema(serde_json::json!({"type": "object", "x-guidance": compact})),
            Constraint::Regex(r) => G::from_regex(r),
            Constraint::Lark(l) => G::from_lark(l.clone()),
        }
    }
}

/// One constrained sequence's grammar state.
pub struct Guide {
    matcher: llguidance::Matcher,
    kind: &'static str,
    /// The model's vocabulary (logit row width); ids past the tokenizer's are never allowed.
    vocab: usize,
    /// Ids that end the sequence: allowed only where the grammar accepts.
    stop_ids: Vec<u32>,
    /// The tokenizer's EOS as llguidance marks it (replaced by `stop_ids`).
    trie_eos: Vec<u32>,
}

impl std::fmt::Debug for Guide {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Guide").field("kind", &self.kind).field("finished", &self.is_finished()).finish()
    }
}

impl Guide {
    /// Compile `c` for a model of `vocab` logits whose sequences end at `stop_ids`. A schema
    /// or grammar that does not compile is a [`LanternError::Constraint`] naming why.
    pub fn new(tokenizer: &Tokenizer, c: &Constraint, vocab: usize, stop_ids: &[u32]) -> Result<Guide> {
        let factory = tokenizer.guidance()?;
        let err = |reason: String| LanternError::Constraint { kind: c.kind().into(), reason };
        let parser = factory.create_parser(c.grammar()).map_err(|e| err(format!("{e:#}")))?;
        let matcher = llguidance::Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(err(e));
        }
        let trie_eos = factory.tok_env().tok_trie().eos_tokens().to_vec();
        Ok(Guide { matcher, kind: c.kind(), vocab, stop_ids: stop_ids.to_vec(), trie_eos })
    }

    fn failed(&self, reason: String) -> LanternError {
        LanternError::Constraint { kind: self.kind.into(), reason }
    }

    /// Mask words per row of `vocab` logits.
    pub fn words(vocab: usize) -> usize {
        crate::kernels::logit_mask::words(vocab)
    }

    /// The allowed tokens of the next step as `words(vocab)` bitmask words (bit `i % 32` of
    /// word `i / 32`) written into `out`: the grammar's tokens, and the stop ids where it
    /// accepts.
    pub fn mask_into(&mut self, out: &mut [u32]) -> Result<()> {
        let v = self.matcher.compute_mask().map_err(|e| self.failed(format!("{e:#}")))?;
        let src = v.as_slice();
        let n = out.len().min(src.len());
        out[..n].copy_from_slice(&src[..n]);
        out[n..].fill(0);
        // Bits past the model's vocabulary (a padded last word) stay clear.
        if !self.vocab.is_multiple_of(32) {
            if let Some(last) = out.get_mut(self.vocab / 32) {
                *last &= (1u32 << (self.vocab % 32)) - 1;
            }
        }
        let accepting = self.matcher.is_accepting().unwrap_or(false);
        let mut set = |id: u32, on: bool| {
            if let Some(w) = out.get_mut(id as usize / 32) {
                if on {
                    *w |= 1 << (id % 32);
                } else {
                    *w &= !(1 << (id % 32));
                }
            }
        };
        for &id in &self.trie_eos {
            set(id, false);
        }
        for &id in &self.stop_ids {
            set(id, accepting && (id as usize) < self.vocab);
        }
        Ok(())
    }

    /// [`Self::mask_into`] into a new row.
    pub fn mask(&mut self) -> Result<Vec<u32>> {
        let mut m = vec![0u32; Self::words(self.vocab)];
        self.mask_into(&mut m)?;
        Ok(m)
    }

    /// Follow a sampled token. A stop id ends the sequence and must come where the grammar
    /// accepts; any other token must be one the grammar allows.
    pub fn accept(&mut self, token: u32) -> Result<()> {
        if self.stop_ids.contains(&token) {
            return match self.matcher.is_accepting() {
                Ok(true) => Ok(()),
                _ => Err(self.failed(format!("stop token {token} came before the grammar accepts"))),
            };
        }
        self.matcher.consume_token(token).map_err(|e| self.failed(format!("token {token}: {e:#}")))
    }

    /// Whether the grammar allows nothing more (the sequence ends here).
    pub fn is_finished(&self) -> bool {
        self.matcher.is_stopped()
    }

    /// Whether the text so far is a complete match.
    pub fn is_accepting(&mut self) -> bool {
        self.matcher.is_accepting().unwrap_or(false)
    }
}

/// Check that every constraint `GenerateRequest` may carry compiles (used by `submit` and
/// `generate` before any GPU work).
pub(crate) fn guide_for(tokenizer: &Tokenizer, c: Option<&Constraint>, vocab: usize, stop_ids: &[u32]) -> Result<Option<Guide>> {
    c.map(|c| Guide::new(tokenizer, c, vocab, stop_ids)).transpose()
}

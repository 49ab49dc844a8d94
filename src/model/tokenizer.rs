//! Tokenizer and chat template: wraps a `tokenizers::Tokenizer` built either from a Hugging
//! Face `tokenizer.json` or from a GGUF's `tokenizer.ggml.*` metadata (byte-level BPE `gpt2`
//! and SentencePiece `llama`), an incremental UTF-8-safe streaming decoder, and Jinja chat
//! templates rendered with minijinja the way transformers renders them.
//!
//! The GGUF rebuild mirrors transformers' `GGUFGPTConverter` / `GGUFLlamaConverter` and
//! llama.cpp's `llama-vocab.cpp` (pre-tokenizer regexes chosen by `tokenizer.ggml.pre`).

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use serde::Serialize;
use serde_json::{json, Value as Json};

use super::gguf::{GgufError, GgufFile};

/// Errors building or running a tokenizer or chat template.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TokenizerError {
    /// Reading `tokenizer.ggml.*` metadata failed (missing key, wrong type).
    #[error(transparent)]
    Gguf(#[from] GgufError),
    /// `tokenizer.ggml.model` names a tokenizer kind Lantern cannot rebuild.
    #[error("{source_name}: tokenizer model {model:?} is not supported (supported: gpt2, llama)")]
    UnsupportedModel { source_name: String, model: String },
    /// `tokenizer.ggml.pre` names a pre-tokenizer Lantern does not know.
    #[error("{source_name}: pre-tokenizer {pre:?} is not supported (supported: default, gpt2 (gpt-2), smollm, starcoder, refact, llama-bpe, llama3, qwen2)")]
    UnsupportedPreTokenizer { source_name: String, pre: String },
    /// The vocabulary or its metadata is inconsistent (lengths differ, ids out of range...).
    #[error("{source_name}: invalid tokenizer data: {reason}")]
    InvalidVocab { source_name: String, reason: String },
    /// A JSON file (tokenizer.json, tokenizer_config.json) could not be read.
    #[error("{file}: {reason}")]
    InvalidJson { file: String, reason: String },
    /// The `tokenizers` crate rejected the tokenizer definition.
    #[error("{source_name}: cannot build tokenizer: {reason}")]
    Build { source_name: String, reason: String },
    /// Encoding text failed.
    #[error("cannot encode text starting {text_start:?}: {reason}")]
    Encode { text_start: String, reason: String },
    /// Decoding ids failed (e.g. an id outside the vocabulary).
    #[error("cannot decode {n_ids} token ids: {reason}")]
    Decode { n_ids: usize, reason: String },
    /// The model has no chat template.
    #[error("{source_name}: the model has no chat template")]
    NoChatTemplate { source_name: String },
    /// The chat template does not parse.
    #[error("chat template does not compile: {reason}")]
    TemplateSyntax { reason: String },
    /// Rendering the chat template failed, or the template called `raise_exception`.
    #[error("chat template failed to render: {reason}")]
    TemplateRender { reason: String },
}

/// GGUF `tokenizer.ggml.token_type` values (llama.cpp `llama_token_type`).
mod token_type {
    pub const CONTROL: i64 = 3;
    pub const USER_DEFINED: i64 = 4;
}

/// Llama 3 split regex (`tokenizer.ggml.pre` = `llama-bpe`), as in its tokenizer.json.
const LLAMA3_REGEX: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2 split regex (single digits), as in its tokenizer.json.
const QWEN2_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// A text tokenizer with the model's special tokens and chat template.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    source_name: String,
    bos_token: Option<String>,
    eos_token: Option<String>,
    add_bos: bool,
    chat_template: Option<String>,
    /// The llguidance grammar compiler over this vocabulary, built on first use and shared
    /// by clones ([`Tokenizer::guidance`]).
    guidance: Arc<OnceLock<Result<Arc<llguidance::ParserFactory>, String>>>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("source", &self.source_name)
            .field("vocab_size", &self.vocab_size())
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .field("add_bos", &self.add_bos)
            .field("has_chat_template", &self.chat_template.is_some())
            .finish()
    }
}

fn build_err(source_name: &str, e: impl std::fmt::Display) -> TokenizerError {
    TokenizerError::Build { source_name: source_name.to_string(), reason: e.to_string() }
}

fn vocab_err(source_name: &str, reason: impl Into<String>) -> TokenizerError {
    TokenizerError::InvalidVocab { source_name: source_name.to_string(), reason: reason.into() }
}

/// A `TemplateProcessing` post-processor that prepends `bos` (as tokenizer.json JSON).
fn bos_post_processor(bos: &str, bos_id: u32) -> Json {
    json!({
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [
            {"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
            {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}
        ],
        "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}}
    })
}

/// Merges for a SentencePiece vocabulary without explicit merges, ranked as transformers'
/// `generate_merges` does: every split of every piece into two in-vocab pieces, ordered by
/// the merged piece's score (descending), then longer left piece, then longer right piece.
fn merges_from_scores(tokens: &[String], scores: &[f32], vocab: &HashMap<&str, u32>) -> Vec<(String, String)> {
    // (merged score, chars in left, chars in right, left id, right id)
    let mut merges: Vec<(f32, usize, usize, u32, u32)> = Vec::new();
    for (t, &score) in tokens.iter().zip(scores) {
        let start = merges.len();
        for (k, _) in t.char_indices().skip(1) {
            let (l, r) = t.split_at(k);
            if let (Some(&il), Some(&ir)) = (vocab.get(l), vocab.get(r)) {
                merges.push((score, l.chars().count(), r.chars().count(), il, ir));
            }
        }
        merges[start..].sort_by_key(|m| (m.3, m.4));
    }
    // Stable sort, descending on (score, len(left), len(right)) like Python's reverse=True.
    merges.sort_by(|a, b| b.0.partial_cmp(&a.0).unwrap_or(std::cmp::Ordering::Equal).then(b.1.cmp(&a.1)).then(b.2.cmp(&a.2)));
    merges.into_iter().map(|m| (tokens[m.3 as usize].clone(), tokens[m.4 as usize].clone())).collect()
}

impl Tokenizer {
    /// Rebuild the tokenizer stored in a GGUF's `tokenizer.ggml.*` metadata: `gpt2`
    /// (byte-level BPE with merges, pre-tokenizer from `tokenizer.ggml.pre`) or `llama`
    /// (SentencePiece with scores and `<0xNN>` byte fallback). Tokens of type control (3) and
    /// user-defined (4) become special added tokens, recognised anywhere in input text.
    /// The chat template comes from `tokenizer.chat_template`.
    pub fn from_gguf(gguf: &GgufFile<'_>) -> Result<Self, TokenizerError> {
        let src = gguf.file_name();
        let model = gguf.get_str("tokenizer.ggml.model")?;
        let tokens = gguf.get_str_array("tokenizer.ggml.tokens")?;
        let n = tokens.len();
        if n == 0 || n > u32::MAX as usize {
            return Err(vocab_err(src, format!("tokenizer.ggml.tokens has {n} entries")));
        }
        let types = gguf.get_int_array_opt("tokenizer.ggml.token_type")?;
        if let Some(t) = &types {
            if t.len() != n {
                return Err(vocab_err(src, format!("tokenizer.ggml.token_type has {} entries for {n} tokens", t.len())));
            }
        }
        let id_key = |key: &str| -> Result<Option<u32>, TokenizerError> {
            match gguf.get_u32_opt(key)? {
                Some(id) if id as usize >= n => Err(vocab_err(src, format!("{key} = {id} is outside the {n} tokens"))),
                v => Ok(v),
            }
        };
        let bos_id = id_key("tokenizer.ggml.bos_token_id")?;
        let eos_id = id_key("tokenizer.ggml.eos_token_id")?;
        let unk_id = id_key("tokenizer.ggml.unknown_token_id")?;
        let add_space_prefix = gguf.get_bool_opt("tokenizer.ggml.add_space_prefix")?;

        let mut vocab: HashMap<&str, u32> = HashMap::with_capacity(n);
        for (i, t) in tokens.iter().enumerate() {
            // Keep the first id of a duplicated string (some converters pad with repeats).
            vocab.entry(t.as_str()).or_insert(i as u32);
        }
        let mut added = Vec::new();
        if let Some(types) = &types {
            for (&ty, t) in types.iter().zip(tokens) {
                if ty == token_type::CONTROL || ty == token_type::USER_DEFINED {
                    added.push(
                        tokenizers::AddedToken::from(t.clone(), true).single_word(false).lstrip(false).rstrip(false).normalized(false),
                    );
                }
            }
        }
        // The BPE model is built from the vocabulary and merges directly, not through its
        // tokenizer.json form: for a 262k-token vocabulary (Gemma 3) the JSON value, its
        // bytes and the parser's copies took 700 MB at the peak, which a browser's wasm heap
        // keeps. The rest of the pipeline (normalizer, pre-tokenizer, decoder, post-processor)
        // is small and still described as JSON.
        let bpe_vocab: tokenizers::models::bpe::Vocab = vocab.iter().map(|(k, &v)| (k.to_string(), v)).collect();

        let (add_bos_default, spec, bpe) = match model {
            "gpt2" => {
                let merges = gguf.get_str_array("tokenizer.ggml.merges")?;
                let mut pairs = Vec::with_capacity(merges.len());
                for (i, m) in merges.iter().enumerate() {
                    let Some((a, b)) = m.split_once(' ') else {
                        return Err(vocab_err(src, format!("merge #{i} {m:?} is not two tokens separated by a space")));
                    };
                    pairs.push((a, b));
                }
                let pre = gguf.get_str_opt("tokenizer.ggml.pre")?.unwrap_or("default");
                let prefix = add_space_prefix.unwrap_or(false);
                let byte_level = |use_regex: bool| json!({"type": "ByteLevel", "add_prefix_space": prefix, "trim_offsets": false, "use_regex": use_regex});
                let split = |re: &str| json!({"type": "Split", "pattern": {"Regex": re}, "behavior": "Isolated", "invert": false});
                let (pre_tokenizer, ignore_merges) = match pre {
                    // "gpt-2": what llama.cpp's converter writes for its own GPT-2 regex hash.
                    "default" | "gpt2" | "gpt-2" => (byte_level(true), false),
                    "smollm" | "starcoder" | "refact" => (
                        json!({"type": "Sequence", "pretokenizers": [
                            {"type": "Digits", "individual_digits": true}, byte_level(true)]}),
                        false,
                    ),
                    "llama-bpe" | "llama3" => {
                        (json!({"type": "Sequence", "pretokenizers": [split(LLAMA3_REGEX), byte_level(false)]}), true)
                    }
                    "qwen2" => (json!({"type": "Sequence", "pretokenizers": [split(QWEN2_REGEX), byte_level(false)]}), false),
                    other => return Err(TokenizerError::UnsupportedPreTokenizer { source_name: src.to_string(), pre: other.to_string() }),
                };
                let spec = json!({
                    "version": "1.0",
                    "added_tokens": [],
                    "normalizer": null,
                    "pre_tokenizer": pre_tokenizer,
                    "post_processor": null,
                    "decoder": {"type": "ByteLevel", "add_prefix_space": prefix, "trim_offsets": false, "use_regex": true},
                    "model": {"type": "BPE", "vocab": {}, "merges": []}
                });
                let merges: Vec<(String, String)> = pairs.into_iter().map(|(a, b)| (a.to_string(), b.to_string())).collect();
                let bpe = tokenizers::models::bpe::BPE::builder().vocab_and_merges(bpe_vocab, merges).ignore_merges(ignore_merges);
                (false, spec, bpe)
            }
            "llama" => {
                let merges: Vec<(String, String)> = match gguf.get_array_opt("tokenizer.ggml.merges")? {
                    Some(_) => gguf
                        .get_str_array("tokenizer.ggml.merges")?
                        .iter()
                        .filter_map(|m| m.split_once(' ').map(|(a, b)| (a.to_string(), b.to_string())))
                        .collect(),
                    None => {
                        let scores = gguf
                            .get_f32_array_opt("tokenizer.ggml.scores")?
                            .ok_or_else(|| vocab_err(src, "SentencePiece vocabulary without tokenizer.ggml.scores"))?;
                        if scores.len() != n {
                            return Err(vocab_err(src, format!("tokenizer.ggml.scores has {} entries for {n} tokens", scores.len())));
                        }
                        merges_from_scores(tokens, &scores, &vocab)
                    }
                };
                let prefix = add_space_prefix.unwrap_or(true);
                let mut normalizers = Vec::new();
                if prefix {
                    normalizers.push(json!({"type": "Prepend", "prepend": "▁"}));
                }
                normalizers.push(json!({"type": "Replace", "pattern": {"String": " "}, "content": "▁"}));
                let mut decoders = vec![
                    json!({"type": "Replace", "pattern": {"String": "▁"}, "content": " "}),
                    json!({"type": "ByteFallback"}),
                    json!({"type": "Fuse"}),
                ];
                if prefix {
                    decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
                }
                let unk = unk_id.map(|i| tokens[i as usize].clone());
                let spec = json!({
                    "version": "1.0",
                    "added_tokens": [],
                    "normalizer": {"type": "Sequence", "normalizers": normalizers},
                    "pre_tokenizer": null,
                    "post_processor": null,
                    "decoder": {"type": "Sequence", "decoders": decoders},
                    "model": {"type": "BPE", "vocab": {}, "merges": []}
                });
                let mut bpe =
                    tokenizers::models::bpe::BPE::builder().vocab_and_merges(bpe_vocab, merges).fuse_unk(true).byte_fallback(true);
                if let Some(u) = unk {
                    bpe = bpe.unk_token(u);
                }
                (true, spec, bpe)
            }
            other => return Err(TokenizerError::UnsupportedModel { source_name: src.to_string(), model: other.to_string() }),
        };
        let mut spec = spec;
        let add_bos = gguf.get_bool_opt("tokenizer.ggml.add_bos_token")?.unwrap_or(add_bos_default);
        let bos_token = bos_id.map(|i| tokens[i as usize].clone());
        if let (true, Some(bos), Some(id)) = (add_bos, &bos_token, bos_id) {
            spec["post_processor"] = bos_post_processor(bos, id);
        }
        let bytes = serde_json::to_vec(&spec).map_err(|e| build_err(src, e))?;
        drop(spec);
        let mut inner = tokenizers::Tokenizer::from_bytes(bytes).map_err(|e| build_err(src, e))?;
        inner.with_model(bpe.build().map_err(|e| build_err(src, e))?);
        // As tokenizer.json's `added_tokens` would be: ids from the model's vocabulary.
        inner.add_tokens(&added);
        let mut tok = Tokenizer {
            inner,
            source_name: src.to_string(),
            bos_token,
            eos_token: eos_id.map(|i| tokens[i as usize].clone()),
            add_bos: false,
            chat_template: gguf.get_str_opt("tokenizer.chat_template")?.map(str::to_string),
            guidance: Default::default(),
        };
        tok.add_bos = tok.detect_add_bos();
        Ok(tok)
    }

    /// Load a Hugging Face tokenizer from the bytes of `tokenizer.json` and, optionally,
    /// `tokenizer_config.json` (special token names, `add_bos_token`, `chat_template`).
    pub fn from_hf_files(tokenizer_json: &[u8], tokenizer_config: Option<&[u8]>) -> Result<Self, TokenizerError> {
        let src = "tokenizer.json";
        let mut inner = tokenizers::Tokenizer::from_bytes(tokenizer_json)
            .map_err(|e| TokenizerError::InvalidJson { file: src.to_string(), reason: e.to_string() })?;
        let config: Json = match tokenizer_config {
            None => Json::Null,
            Some(b) => serde_json::from_slice(b)
                .map_err(|e| TokenizerError::InvalidJson { file: "tokenizer_config.json".into(), reason: e.to_string() })?,
        };
        // Special tokens may be plain strings or AddedToken objects {"content": ...}.
        let token_name = |key: &str| -> Option<String> {
            match config.get(key)? {
                Json::String(s) => Some(s.clone()),
                Json::Object(o) => o.get("content")?.as_str().map(str::to_string),
                _ => None,
            }
        };
        let bos_token = token_name("bos_token");
        let eos_token = token_name("eos_token");
        let chat_template = match config.get("chat_template") {
            Some(Json::String(s)) => Some(s.clone()),
            // A list of named templates: take "default" (or the first).
            Some(Json::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(Json::as_str) == Some("default"))
                .or_else(|| list.first())
                .and_then(|t| t.get("template"))
                .and_then(Json::as_str)
                .map(str::to_string),
            _ => None,
        };
        let mut tok = Tokenizer {
            inner: inner.clone(),
            source_name: src.to_string(),
            bos_token: bos_token.clone(),
            eos_token,
            add_bos: false,
            chat_template,
            guidance: Default::default(),
        };
        let detected = tok.detect_add_bos();
        // Like transformers' LlamaTokenizerFast: an explicit add_bos_token rewrites the
        // post-processor when tokenizer.json disagrees with it.
        if let Some(want) = config.get("add_bos_token").and_then(Json::as_bool) {
            if want != detected {
                let pp = match (want, &bos_token, bos_token.as_deref().and_then(|b| inner.token_to_id(b))) {
                    (true, Some(b), Some(id)) => Some(
                        serde_json::from_value::<tokenizers::PostProcessorWrapper>(bos_post_processor(b, id))
                            .map_err(|e| build_err(src, e))?,
                    ),
                    _ => None,
                };
                inner.with_post_processor(pp);
                tok.inner = inner;
            }
        }
        tok.add_bos = tok.detect_add_bos();
        Ok(tok)
    }

    /// Replace the chat template (a folder's `chat_template.jinja`).
    pub fn set_chat_template(&mut self, template: String) {
        self.chat_template = Some(template);
    }

    /// Whether encoding adds a BOS: true when the post-processor puts the BOS id first.
    fn detect_add_bos(&self) -> bool {
        match (self.bos_id(), self.inner.encode("", true)) {
            (Some(bos), Ok(enc)) => enc.get_ids().first() == Some(&bos),
            _ => false,
        }
    }

    /// Encode text to ids. Special and added tokens (e.g. `<|im_end|>`) are recognised
    /// anywhere in the text; a BOS is prepended only if the model asks for one
    /// ([`Tokenizer::add_bos`]). No EOS is appended.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        self.encode_with(text, true)
    }

    /// Encode with explicit control over the post-processor (BOS). With
    /// `add_special_tokens = false` no BOS is added; special tokens in the text are still
    /// recognised.
    pub fn encode_with(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizerError> {
        self.inner
            .encode_fast(text, add_special_tokens)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| TokenizerError::Encode { text_start: text.chars().take(40).collect(), reason: e.to_string() })
    }

    /// Encode a prompt rendered by a chat template: like [`Tokenizer::encode`], but no
    /// second BOS is added when the template already wrote one.
    pub fn encode_chat(&self, rendered: &str) -> Result<Vec<u32>, TokenizerError> {
        let ids = self.encode_with(rendered, false)?;
        match self.bos_id() {
            Some(bos) if self.add_bos && ids.first() != Some(&bos) => Ok(std::iter::once(bos).chain(ids).collect()),
            _ => Ok(ids),
        }
    }

    /// Decode ids to text, special tokens included as their text. Incomplete UTF-8 at
    /// the end becomes U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        self.decode_with(ids, false)
    }

    /// Decode ids, optionally dropping special tokens.
    pub fn decode_with(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, TokenizerError> {
        self.inner.decode(ids, skip_special_tokens).map_err(|e| TokenizerError::Decode { n_ids: ids.len(), reason: e.to_string() })
    }

    /// A fresh streaming decoder for one generated sequence.
    pub fn stream_decoder(&self) -> StreamDecoder {
        StreamDecoder::default()
    }

    /// The id of a token string (vocabulary or added token).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The token string of an id.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Number of ids, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The BOS token's id, if the model has one.
    pub fn bos_id(&self) -> Option<u32> {
        self.bos_token.as_deref().and_then(|t| self.token_to_id(t))
    }

    /// The EOS token's id, if the model has one.
    pub fn eos_id(&self) -> Option<u32> {
        self.eos_token.as_deref().and_then(|t| self.token_to_id(t))
    }

    /// The BOS token's text (e.g. `<s>`), passed to chat templates as `bos_token`.
    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    /// The EOS token's text, passed to chat templates as `eos_token`.
    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }

    /// Whether [`Tokenizer::encode`] prepends a BOS.
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// The chat template source, if the model ships one.
    pub fn chat_template_source(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// The model's chat template, compiled, with this tokenizer's BOS/EOS strings.
    pub fn chat_template(&self) -> Result<ChatTemplate, TokenizerError> {
        let src = self.chat_template.as_deref().ok_or_else(|| TokenizerError::NoChatTemplate { source_name: self.source_name.clone() })?;
        ChatTemplate::new(src, self.bos_token.as_deref(), self.eos_token.as_deref())
    }

    /// The wrapped `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// The llguidance grammar compiler over this vocabulary (token bytes, trie, token
    /// slices: [`super::guidance`]), built on the first call and cached, clones included;
    /// constrained decoding compiles each request's grammar with it.
    pub fn guidance(&self) -> Result<Arc<llguidance::ParserFactory>, TokenizerError> {
        self.guidance
            .get_or_init(|| super::guidance::build_factory(self).map_err(|e| e.to_string()))
            .clone()
            .map_err(|reason| TokenizerError::InvalidVocab { source_name: self.source_name.clone(), reason })
    }
}

/// Incremental detokenizer for streaming: feed ids one at a time and get text only once it
/// is complete UTF-8. The concatenation of all returned pieces plus [`StreamDecoder::finish`]
/// equals `decode(all ids)`.
///
/// Works on a sliding window (the previous piece's ids as context), so decoders that strip
/// a leading space or merge byte tokens see the same neighbours as a full decode.
#[derive(Debug, Clone, Default)]
pub struct StreamDecoder {
    ids: Vec<u32>,
    /// Start of the context window.
    prefix: usize,
    /// End of the ids already turned into text.
    read: usize,
}

impl StreamDecoder {
    /// Add one id; returns the new text, if a complete piece is available.
    pub fn step(&mut self, tokenizer: &Tokenizer, id: u32) -> Result<Option<String>, TokenizerError> {
        self.ids.push(id);
        self.emit(tokenizer, false)
    }

    /// Flush what is left at the end of generation (an incomplete character becomes U+FFFD).
    pub fn finish(&mut self, tokenizer: &Tokenizer) -> Result<Option<String>, TokenizerError> {
        self.emit(tokenizer, true)
    }

    fn emit(&mut self, tokenizer: &Tokenizer, flush: bool) -> Result<Option<String>, TokenizerError> {
        if self.read == self.ids.len() {
            return Ok(None);
        }
        let before = tokenizer.decode(&self.ids[self.prefix..self.read])?;
        let now = tokenizer.decode(&self.ids[self.prefix..])?;
        if !flush && (now.len() <= before.len() || now.ends_with('\u{FFFD}')) {
            return Ok(None);
        }
        let piece = if now.starts_with(&before) {
            now[before.len()..].to_string()
        } else {
            // The decoder rewrote earlier text (rare); emit the part past the common prefix.
            let common = now
                .char_indices()
                .zip(before.chars())
                .find(|((_, a), b)| a != b)
                .map(|((i, _), _)| i)
                .unwrap_or(before.len().min(now.len()));
            now[common..].to_string()
        };
        // The ids of the piece just emitted become the next window's context.
        self.ids.drain(..self.read);
        self.prefix = 0;
        self.read = self.ids.len();
        Ok(if piece.is_empty() { None } else { Some(piece) })
    }
}

/// One chat message as chat templates expect it (`{"role": ..., "content": ...}`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct ChatMessage {
    /// `system`, `user` or `assistant` (templates may accept others).
    pub role: String,
    /// The message text.
    pub content: String,
}

impl ChatMessage {
    /// A message with any role.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage { role: role.into(), content: content.into() }
    }

    /// A `system` message.
    pub fn system(content: impl Into<String>) -> Self {
        Self::new("system", content)
    }

    /// A `user` message.
    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }

    /// An `assistant` message.
    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new("assistant", content)
    }
}

/// A compiled Jinja chat template, rendered like transformers' `apply_chat_template`
/// (`trim_blocks`, `lstrip_blocks`, `raise_exception`, `tojson`, Python string methods).
pub struct ChatTemplate {
    env: minijinja::Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").field("bos_token", &self.bos_token).field("eos_token", &self.eos_token).finish_non_exhaustive()
    }
}

const TEMPLATE_NAME: &str = "chat";

impl ChatTemplate {
    /// Compile a template. `bos_token`/`eos_token` are exposed to it as variables (empty
    /// strings when absent).
    pub fn new(source: &str, bos_token: Option<&str>, eos_token: Option<&str>) -> Result<Self, TokenizerError> {
        let mut env = minijinja::Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| TokenizerError::TemplateSyntax { reason: format!("{e:#}") })?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<minijinja::Value, minijinja::Error> {
            Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
        });
        env.add_filter("tojson", tojson);
        env.add_template_owned(TEMPLATE_NAME, source.to_string())
            .map_err(|e| TokenizerError::TemplateSyntax { reason: format!("{e:#}") })?;
        Ok(ChatTemplate { env, bos_token: bos_token.unwrap_or_default().to_string(), eos_token: eos_token.unwrap_or_default().to_string() })
    }

    /// Render `messages`; with `add_generation_prompt` the template appends the assistant
    /// turn header.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String, TokenizerError> {
        self.render_with(minijinja::Value::from(minijinja::value::Serde(messages)), add_generation_prompt, minijinja::Value::UNDEFINED)
    }

    /// Render with arbitrary message values (e.g. messages carrying tool calls) and extra
    /// variables (`extra` is a map merged into the context, e.g. `tools`).
    pub fn render_with(
        &self,
        messages: minijinja::Value,
        add_generation_prompt: bool,
        extra: minijinja::Value,
    ) -> Result<String, TokenizerError> {
        let render_err = |e: minijinja::Error| TokenizerError::TemplateRender {
            reason: match e.kind() {
                minijinja::ErrorKind::InvalidOperation => e.detail().unwrap_or("raise_exception").to_string(),
                _ => format!("{e:#}"),
            },
        };
        let tmpl = self.env.get_template(TEMPLATE_NAME).map_err(render_err)?;
        let base = minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.as_str(),
            eos_token => self.eos_token.as_str(),
        };
        let ctx = if extra.is_undefined() {
            base
        } else {
            minijinja::context! { ..extra, ..base }
        };
        tmpl.render(ctx).map_err(render_err)
    }
}

/// Largest `tojson(indent=...)` accepted (real templates use 2 or 4).
const MAX_TOJSON_INDENT: usize = 64;

/// Python `json.dumps(value, ensure_ascii=False, indent=indent)` as transformers' `tojson`
/// filter produces it (`", "` and `": "` separators), unlike minijinja's HTML-safe default.
fn tojson(value: minijinja::Value, kwargs: minijinja::value::Kwargs) -> Result<String, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    // A chat template comes from the model file: `tojson(indent=2**62)` must be an error, not
    // an allocation that aborts the process (found by review next to fuzz target gguf_tokenizer).
    if let Some(n) = indent.filter(|&n| n > MAX_TOJSON_INDENT) {
        return Err(minijinja::Error::new(
            minijinja::ErrorKind::InvalidOperation,
            format!("tojson: indent {n} is larger than the {MAX_TOJSON_INDENT} this renderer allows"),
        ));
    }
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    let _: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let mut out = String::new();
    py_json(&value, indent, 0, &mut out)?;
    Ok(out)
}

fn py_json(v: &minijinja::Value, indent: Option<usize>, level: usize, out: &mut String) -> Result<(), minijinja::Error> {
    use minijinja::value::ValueKind;
    let newline = |out: &mut String, level: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * level));
        }
    };
    let item_sep = if indent.is_some() { "," } else { ", " };
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => out.push_str(&v.to_string()),
        ValueKind::String => py_json_str(v.as_str().unwrap_or_default(), out),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<_> = v.try_iter()?.collect();
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, level + 1);
                py_json(item, indent, level + 1, out)?;
            }
            if !items.is_empty() {
                newline(out, level);
            }
            out.push(']');
        }
        ValueKind::Map => {
            let keys: Vec<_> = v.try_iter()?.collect();
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, level + 1);
                match k.as_str() {
                    Some(s) => py_json_str(s, out),
                    None => py_json_str(&k.to_string(), out),
                }
                out.push_str(": ");
                py_json(&v.get_item(k)?, indent, level + 1, out)?;
            }
            if !keys.is_empty() {
                newline(out, level);
            }
            out.push('}');
        }
        _ => py_json_str(&v.to_string(), out),
    }
    Ok(())
}

fn py_json_str(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

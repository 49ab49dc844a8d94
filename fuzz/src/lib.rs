//! The entry points of Lantern's fuzz targets, shared by `fuzz/fuzz_targets/*.rs` (libFuzzer,
//! nightly) and `tests/fuzz_regressions.rs` (stable, the normal test suite), which includes
//! this file with `#[path]` so that the committed crash inputs and seeds run through exactly
//! the code that was fuzzed.
//!
//! Each function takes arbitrary bytes and drives Lantern's real parsers and loaders on them.
//! The contract under test: any input gives `Ok` or a typed `Err`, never a panic, an
//! unbounded allocation or an endless loop. Results are ignored on purpose.
//!
//! Depends on `lantern` only (no `arbitrary`, no libfuzzer-sys), so the stable test can use it.

#![allow(dead_code)]

use std::collections::HashMap;

use lantern::model::gguf::{config_from_gguf, convert_tensor, part_tensors, weights_from_gguf, weights_part, GgufFile, GgufTensorInfo};
use lantern::model::tokenizer::{ChatMessage, Tokenizer};
use lantern::model::{HostTensor, ModelConfig};

// The tests' GGUF writer and byte-level tokenizer (one file, shared with tests/common and
// tests/wasm.rs).
#[path = "../../tests/common/gguf_writer.rs"]
mod gguf_writer;
pub use gguf_writer::{byte_level_char, byte_level_tokenizer, GgufWriter, Meta};

/// Name given to the inputs in error messages.
const GGUF_NAME: &str = "fuzz.gguf";
const ST_NAME: &str = "model.safetensors";

/// Elements above which a tensor is not dequantized (keeps one run fast; inputs are small,
/// so this only skips tensors whose dims were blown up by a mutation of a header).
const MAX_DEQUANT_ELEMENTS: usize = 1 << 20;

// ---------------------------------------------------------------------------------------
// gguf: the GGUF reader and the model load from it.
// ---------------------------------------------------------------------------------------

/// `gguf` target: [`GgufFile::parse`] on the bytes, then everything a load does with a
/// parsed file: metadata accessors, tensor data, dequantization and repacking of every
/// tensor, the config, the full load ([`weights_from_gguf`] + validation) and the streamed
/// load's per-layer path ([`convert_tensor`], [`weights_part`]). The same bytes are also
/// parsed as the prefix of a larger file ([`GgufFile::parse_prefix`]), as the browser and the
/// streamed native load do.
pub fn gguf(data: &[u8]) {
    if let Ok(g) = GgufFile::parse(data, GGUF_NAME) {
        exercise_gguf(&g, data);
    }
    // The header in a prefix; the tensors claimed to lie in a file twice as long.
    let file_len = (data.len() as u64).saturating_mul(2);
    let cut = data.len() - data.len() / 4;
    if let Ok(g) = GgufFile::parse_prefix(&data[..cut], file_len, GGUF_NAME) {
        for t in g.tensors() {
            let (a, b) = g.tensor_range(t);
            assert!(a <= b && b <= g.file_len(), "tensor_range {a}..{b} outside the file ({})", g.file_len());
            // Inside the prefix it must read; past it, it must fail cleanly.
            let _ = g.tensor_data(t);
        }
        if let Ok(config) = config_from_gguf(&g) {
            exercise_config(&config);
            streamed_parts(&g, &config, |info| {
                let (a, b) = g.tensor_range(info);
                // Bytes past the end of the input read as zeros, as a sparse file would.
                let mut raw = vec![0u8; (b - a) as usize];
                let have = data.len().saturating_sub(a as usize).min(raw.len());
                if have > 0 {
                    raw[..have].copy_from_slice(&data[a as usize..a as usize + have]);
                }
                raw
            });
        }
    }
}

fn exercise_gguf(g: &GgufFile<'_>, data: &[u8]) {
    let _ = (g.version(), g.alignment(), g.data_offset(), g.file_len());
    for (k, v) in g.metadata() {
        let _ = (g.get(k), v.as_int(), v.as_float(), v.as_str());
        if let Some(a) = v.as_array() {
            let _ = (a.len(), a.to_i64_vec(), a.to_f32_vec());
        }
        let _ = (g.get_u32_opt(k), g.get_f32_opt(k), g.get_bool_opt(k), g.get_int_array_opt(k), g.get_f32_array_opt(k));
    }
    for t in g.tensors() {
        let (a, b) = g.tensor_range(t);
        let bytes = g.tensor_data(t).expect("a parsed file's tensor data lies inside it");
        assert_eq!(bytes.len() as u64, b - a);
        assert!(b as usize <= data.len());
        if let Ok(Some(h)) = g.host_tensor(&t.name) {
            exercise_host_tensor(&h);
        }
    }
    if let Ok(config) = config_from_gguf(g) {
        exercise_config(&config);
        if let Ok(w) = weights_from_gguf(g, GGUF_NAME) {
            let _ = lantern::model::validate::validate(&w);
        }
        streamed_parts(g, &config, |info| g.tensor_data(info).map(<[u8]>::to_vec).unwrap_or_default());
    }
}

/// What `lantern plan` computes from a config read from a file header alone.
fn exercise_config(c: &ModelConfig) {
    use lantern::kv::plan::KvDtype;
    use lantern::model::plan::{param_count, plan, window_saving, workspace_bytes};
    let params = param_count(c);
    let workspace = workspace_bytes(c, 512, 1, 4096);
    let _ = window_saving(c, KvDtype::F16, 4096, 512, 16);
    let ring = lantern::kv::ring::KvWindow::Ring.ring(c.block.sliding_window, 4096, 512, 16);
    let p = plan(c, params.total.saturating_mul(2), KvDtype::F16, 4, 4096, 16, workspace, 64 << 20, 8 << 30, "fuzz".into());
    let _ = p.with_ring(c, ring, 512).kv_bytes();
}

/// The streamed load: the tensors outside the layers, then each layer's (at most a few; a
/// corrupt `block_count` must fail, not loop), converted and checked part by part.
fn streamed_parts(g: &GgufFile<'_>, config: &ModelConfig, mut read: impl FnMut(&GgufTensorInfo) -> Vec<u8>) {
    let layers = std::iter::once(None).chain((0..config.num_layers.min(4)).map(Some));
    for layer in layers {
        let mut tensors = Vec::new();
        for info in part_tensors(g, layer) {
            let Ok(dtype) = g.loadable_dtype(info) else { continue };
            if let Ok(Some(t)) = convert_tensor(config, info, dtype, read(info), GGUF_NAME) {
                tensors.push(t);
            }
        }
        let _ = weights_part(config, layer, tensors, GGUF_NAME);
    }
}

/// Dequantize and repack a loaded tensor the way the GPU upload and the CPU reference do.
fn exercise_host_tensor(t: &HostTensor) {
    if t.numel() > MAX_DEQUANT_ELEMENTS {
        return;
    }
    let _ = t.dtype.bytes_for_shape(&t.shape);
    let values = t.to_f32();
    let _ = values.len();
    if let Some(Ok(m)) = t.packed() {
        let _ = m.dequantize();
    }
}

// ---------------------------------------------------------------------------------------
// safetensors_header: Lantern's safetensors loading path.
// ---------------------------------------------------------------------------------------

/// `safetensors_header` target: [`lantern::model::hf::read_safetensors`] on the bytes
/// (header JSON, dtypes, offsets, the `lantern.quantization` metadata and packed
/// `.qweight`/`.scales` pairs), every tensor dequantized, then the whole Hugging Face load
/// ([`lantern::model::hf::load_hf_buffers`]: norm offsets, Phi-3 unfusing, validation) of
/// the bytes as `model.safetensors` under tiny Llama, Qwen2, Gemma 3 and Phi-3 configs, and
/// the same bytes' header JSON as a shard index.
pub fn safetensors_header(data: &[u8]) {
    let mut out = HashMap::new();
    if lantern::model::hf::read_safetensors(ST_NAME, data, &mut out).is_ok() {
        for t in out.values() {
            exercise_host_tensor(t);
        }
    }
    if out.is_empty() {
        // Nothing loaded: the configs would only repeat the same parse error.
        return;
    }
    for config in tiny_configs() {
        if let Ok(w) = lantern::model::hf::load_hf_buffers(config, None, &[(ST_NAME, data)]) {
            for t in w.tensors.values() {
                exercise_host_tensor(t);
            }
        }
    }
    // The header as an index naming this file (an index's `weight_map` must match).
    if let Some(header) = safetensors_header_json(data) {
        let _ = lantern::model::hf::parse_index(header, "model.safetensors.index.json");
        let _ = lantern::model::hf::load_hf_buffers(tiny_configs()[0], Some(header), &[(ST_NAME, data)]);
    }
}

/// The header JSON of a safetensors file, if its length prefix is sane and it is UTF-8.
fn safetensors_header_json(data: &[u8]) -> Option<&str> {
    let n = u64::from_le_bytes(data.get(..8)?.try_into().ok()?);
    let end = 8usize.checked_add(usize::try_from(n).ok()?)?;
    std::str::from_utf8(data.get(8..end)?).ok()
}

/// The shape of the tiny models the seeds and configs use (`tests/fuzz_regressions.rs`
/// writes the seeds from the same numbers).
pub mod tiny {
    pub const HIDDEN: u32 = 32;
    pub const HEADS: u32 = 2;
    pub const KV_HEADS: u32 = 1;
    pub const HEAD_DIM: u32 = 16;
    pub const FFN: u32 = 32;
    pub const VOCAB: u32 = 8;
    pub const LAYERS: u32 = 1;
}

/// `config.json` texts for the tiny shape in four architectures, made by Lantern itself
/// (GGUF metadata -> [`config_from_gguf`] -> [`ModelConfig::to_hf_json`]), once.
fn tiny_configs() -> [&'static str; 4] {
    static CONFIGS: std::sync::OnceLock<[String; 4]> = std::sync::OnceLock::new();
    let c = CONFIGS.get_or_init(|| ["llama", "qwen2", "gemma3", "phi3"].map(tiny_config_json));
    [&c[0], &c[1], &c[2], &c[3]]
}

/// Lantern's `config.json` for the tiny shape in architecture `arch`.
pub fn tiny_config_json(arch: &str) -> String {
    use tiny::*;
    if arch == "phi3" {
        // Lantern does not write Phi-3 configs (it never writes fused checkpoints): the Llama
        // one with Phi-3's model type reads as a Phi-3 config.
        let mut v: serde_json::Value = serde_json::from_str(&tiny_config_json("llama")).expect("config.json is JSON");
        v["model_type"] = "phi3".into();
        v["architectures"] = serde_json::json!(["Phi3ForCausalLM"]);
        return v.to_string();
    }
    let k = |s: &str| format!("{arch}.{s}");
    let mut kv = vec![
        ("general.architecture".to_string(), Meta::Str(arch.into())),
        (k("block_count"), Meta::U32(LAYERS)),
        (k("context_length"), Meta::U32(64)),
        (k("embedding_length"), Meta::U32(HIDDEN)),
        (k("feed_forward_length"), Meta::U32(FFN)),
        (k("attention.head_count"), Meta::U32(HEADS)),
        (k("attention.head_count_kv"), Meta::U32(KV_HEADS)),
        (k("attention.key_length"), Meta::U32(HEAD_DIM)),
        (k("attention.layer_norm_rms_epsilon"), Meta::F32(1e-6)),
        (k("vocab_size"), Meta::U32(VOCAB)),
    ];
    if arch == "gemma3" {
        kv.push((k("attention.sliding_window"), Meta::U32(16)));
    }
    let bytes = gguf_bytes(&kv);
    let g = GgufFile::parse(&bytes, "tiny").expect("tiny GGUF parses");
    config_from_gguf(&g).expect("tiny config").to_hf_json().expect("tiny config.json")
}

// ---------------------------------------------------------------------------------------
// gguf_tokenizer: the tokenizer rebuilt from `tokenizer.ggml.*` metadata.
// ---------------------------------------------------------------------------------------

/// `gguf_tokenizer` target. Input starting with `GGUF` is a raw file; anything else is read
/// as a recipe ([`TokenizerRecipe`]) for a well-formed GGUF whose `tokenizer.ggml.*` keys
/// (model, pre-tokenizer, tokens, types, scores, merges, special ids, flags) and chat
/// template come from the bytes, so that the fuzzer spends its time in the tokenizer rebuild
/// rather than in the GGUF framing. Then [`Tokenizer::from_gguf`], encode/decode of text
/// from the input, the streaming decoder, and the chat template compiled and rendered.
pub fn gguf_tokenizer(data: &[u8]) {
    if let Some((tok, text, ids)) = tokenizer_from_input(data) {
        exercise_tokenizer(&tok, &text, &ids);
    }
}

/// The tokenizer a `gguf_tokenizer` input builds (if it builds), with the text to encode and
/// the ids to decode.
pub fn tokenizer_from_input(data: &[u8]) -> Option<(Tokenizer, String, Vec<u32>)> {
    if data.starts_with(b"GGUF") {
        let g = GgufFile::parse(data, GGUF_NAME).ok()?;
        let tok = Tokenizer::from_gguf(&g).ok()?;
        return Some((tok, "Hello world! <s> 123 \u{2581}x \u{1F600}".to_string(), vec![0, 1, 2, 3, u32::MAX]));
    }
    let recipe = TokenizerRecipe::read(data);
    let bytes = gguf_bytes(&recipe.kv);
    let g = GgufFile::parse(&bytes, GGUF_NAME).expect("the recipe writes a well-formed GGUF");
    let tok = Tokenizer::from_gguf(&g).ok()?;
    Some((tok, recipe.text, recipe.ids))
}

fn exercise_tokenizer(tok: &Tokenizer, text: &str, ids: &[u32]) {
    let _ = (tok.vocab_size(), tok.bos_id(), tok.eos_id(), tok.add_bos());
    if let Ok(enc) = tok.encode(text) {
        let _ = tok.decode(&enc);
        let _ = tok.decode_with(&enc, true);
        let mut s = tok.stream_decoder();
        for &id in &enc {
            let _ = s.step(tok, id);
        }
        let _ = s.finish(tok);
    }
    let _ = tok.encode_chat(text);
    let _ = tok.decode(ids);
    let mut s = tok.stream_decoder();
    for &id in ids {
        let _ = s.step(tok, id);
        let _ = tok.id_to_token(id);
    }
    let _ = s.finish(tok);
    let _ = tok.token_to_id(text);
    if let Ok(t) = tok.chat_template() {
        let messages = [ChatMessage::system("be brief"), ChatMessage::user(text), ChatMessage::assistant("ok")];
        let _ = t.render(&messages, true);
    }
}

/// Token pieces the recipe picks from: byte-level and SentencePiece markers, byte fallback,
/// special tokens, multi-byte characters.
const PIECES: &[&str] = &[
    "a",
    "b",
    "ab",
    "abc",
    " ",
    "Ġ",
    "Ġa",
    "▁",
    "▁a",
    "▁ab",
    "<0x41>",
    "<0x0A>",
    "<0xFF>",
    "<0xZZ>",
    "<s>",
    "</s>",
    "<unk>",
    "<|im_start|>",
    "<|im_end|>",
    "\n",
    "Ċ",
    "1",
    "12",
    "é",
    "\u{1F600}",
    "",
    "a b",
    "<",
    ">",
    "<0x",
];

/// Chat templates the recipe picks from (a real one, edge cases, and raw input text).
const TEMPLATES: &[&str] = &[
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    "{{ bos_token }}{% for m in messages %}{{ m.content | trim }}{{ eos_token }}{% endfor %}",
    "{{ messages | tojson }}",
    "{{ messages | tojson(indent=2) }}",
    "{% if messages[0].role == 'system' %}{{ raise_exception('no system') }}{% endif %}",
    "{{ messages[0].content.split(' ') | join(',') }}{{ messages[0].content.startswith('a') }}",
    "{% for m in messages %}{{ m.content[::-1] }}{% endfor %}",
];

/// Bytes read as a sequence of choices, the way `arbitrary::Unstructured` reads them: past
/// the end everything is zero, so every input is a valid recipe.
struct Cursor<'a> {
    data: &'a [u8],
}

impl Cursor<'_> {
    fn u8(&mut self) -> u8 {
        match self.data.split_first() {
            Some((&b, rest)) => {
                self.data = rest;
                b
            }
            None => 0,
        }
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes([self.u8(), self.u8(), self.u8(), self.u8()])
    }
    /// A number in `0..n` (n > 0).
    fn below(&mut self, n: usize) -> usize {
        self.u8() as usize % n
    }
    fn flag(&mut self) -> bool {
        self.u8() & 1 == 1
    }
    /// A short string: a known piece, or up to 8 bytes of input (lossy UTF-8).
    fn piece(&mut self) -> String {
        let c = self.u8() as usize;
        if c < 200 {
            return PIECES[c % PIECES.len()].to_string();
        }
        let n = (self.u8() % 8) as usize;
        let raw: Vec<u8> = (0..n).map(|_| self.u8()).collect();
        String::from_utf8_lossy(&raw).into_owned()
    }
    fn rest(&mut self) -> &[u8] {
        std::mem::take(&mut self.data)
    }
}

/// The GGUF metadata of one tokenizer, read from fuzz input.
struct TokenizerRecipe {
    kv: Vec<(String, Meta)>,
    /// Text to encode.
    text: String,
    /// Ids to decode (some out of range).
    ids: Vec<u32>,
}

impl TokenizerRecipe {
    fn read(data: &[u8]) -> Self {
        let mut c = Cursor { data };
        let mut kv = Vec::new();
        let model = ["gpt2", "llama", "bert", ""][c.below(4)];
        kv.push(("tokenizer.ggml.model".to_string(), Meta::Str(model.into())));
        let pre = c.below(12);
        let pres = ["default", "gpt2", "gpt-2", "smollm", "starcoder", "refact", "llama-bpe", "llama3", "qwen2", "deepseek"];
        if pre < pres.len() {
            kv.push(("tokenizer.ggml.pre".to_string(), Meta::Str(pres[pre].into())));
        }
        let n = 1 + c.below(48);
        let mut tokens: Vec<String> = Vec::with_capacity(n);
        // The 256 byte-level or `<0xNN>` tokens most real vocabularies start with, sometimes.
        if c.flag() {
            if model == "llama" {
                tokens.extend((0..=255u8).map(|b| format!("<0x{b:02X}>")));
            } else {
                tokens.extend((0..=255u8).map(|b| byte_level_char(b).to_string()));
            }
        }
        tokens.extend((0..n).map(|_| c.piece()));
        let n = tokens.len();
        match c.below(16) {
            0 => {}
            // Wrong type where an array of strings belongs.
            1 => kv.push(("tokenizer.ggml.tokens".to_string(), Meta::U32(n as u32))),
            _ => kv.push(("tokenizer.ggml.tokens".to_string(), Meta::StrArray(tokens.clone()))),
        }
        if c.flag() {
            // Mostly the right length; sometimes one off.
            let len = if c.below(8) == 0 { n + 1 } else { n };
            let types = (0..len).map(|_| [1, 1, 1, 2, 3, 4, 5, 6, -1][c.below(9)]).collect();
            kv.push(("tokenizer.ggml.token_type".to_string(), Meta::I32Array(types)));
        }
        if c.flag() {
            let len = if c.below(8) == 0 { n.saturating_sub(1) } else { n };
            let scores = (0..len)
                .map(|_| match c.below(8) {
                    0 => f32::NAN,
                    1 => f32::INFINITY,
                    _ => -(c.u8() as f32) / 8.0,
                })
                .collect();
            kv.push(("tokenizer.ggml.scores".to_string(), Meta::F32Array(scores)));
        }
        if c.flag() {
            let m = c.below(32);
            let merges = (0..m)
                .map(|_| match c.below(4) {
                    0 => c.piece(),
                    _ => format!("{} {}", tokens[c.below(n)], tokens[c.below(n)]),
                })
                .collect();
            kv.push(("tokenizer.ggml.merges".to_string(), Meta::StrArray(merges)));
        }
        for key in ["bos_token_id", "eos_token_id", "eot_token_id", "unknown_token_id", "padding_token_id"] {
            match c.below(8) {
                0 | 1 => {}
                // Mostly out of range.
                2 => kv.push((format!("tokenizer.ggml.{key}"), Meta::U32(c.u32()))),
                _ => kv.push((format!("tokenizer.ggml.{key}"), Meta::U32(c.below(n) as u32))),
            }
        }
        for key in ["add_bos_token", "add_eos_token", "add_space_prefix"] {
            match c.below(8) {
                0 => {}
                // Wrong type.
                1 => kv.push((format!("tokenizer.ggml.{key}"), Meta::U32(c.u8() as u32))),
                _ => kv.push((format!("tokenizer.ggml.{key}"), Meta::Bool(c.flag()))),
            }
        }
        let template = c.below(TEMPLATES.len() + 2);
        let ids = (0..c.below(8)).map(|_| if c.below(4) == 0 { c.u32() } else { c.below(n + 2) as u32 }).collect();
        let rest = c.rest();
        let text = String::from_utf8_lossy(rest).into_owned();
        if template < TEMPLATES.len() {
            kv.push(("tokenizer.chat_template".to_string(), Meta::Str(TEMPLATES[template].into())));
        } else if template == TEMPLATES.len() {
            // The input text is the template too.
            kv.push(("tokenizer.chat_template".to_string(), Meta::Str(text.clone())));
        }
        TokenizerRecipe { kv, text, ids }
    }
}

// ---------------------------------------------------------------------------------------
// openai_request: the OpenAI request parsing and validation of `lantern serve`.
// ---------------------------------------------------------------------------------------

/// `openai_request` target: the bytes as the body of a `/v1/chat/completions` and of a
/// `/v1/completions` request, through [`lantern::api::parse_request`] (JSON, the typed
/// serde structs, validation against the served model: tokenizer, chat template with tools,
/// vocabulary, context, KV pool, `response_format` grammars), then the engine request it
/// makes, and as the body of `/v1/embeddings`, `/api/embed` and `/api/embeddings`. The served
/// model is a tiny byte-level tokenizer with a ChatML template.
pub fn openai_request(data: &[u8]) {
    let _ = parse_openai(data);
    // The same bytes as an embeddings request (OpenAI's and Ollama's shapes).
    SERVED.with(|model| {
        use lantern::api::embeddings::{parse_ollama, parse_openai};
        let _ = parse_openai(model, data, Default::default());
        let _ = parse_ollama(model, data, false, Default::default());
        let _ = parse_ollama(model, data, true, Default::default());
    });
}

/// What [`openai_request`] makes of a body: per endpoint (chat, completions), the error
/// message or `Ok`.
pub fn parse_openai(data: &[u8]) -> [Result<(), String>; 2] {
    use lantern::api::{parse_request, Endpoint};
    SERVED.with(|model| {
        [Endpoint::Chat, Endpoint::Completions].map(|endpoint| match parse_request(model, endpoint, data) {
            Ok(v) => {
                let _ = v.request(model, 7);
                Ok(())
            }
            Err(e) => Err(format!("{e:?}")),
        })
    })
}

thread_local! {
    static SERVED: lantern::api::ServedModel = served_model();
}

/// ChatML with tools, as Qwen's and SmolLM2's templates render them (shortened).
const SERVED_TEMPLATE: &str = "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}\
{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}{% endif %}\
{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}{% endif %}<|im_end|>\n{% endfor %}\
{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

/// The model `openai_request` validates against: 256 byte-level tokens, a few merges,
/// ChatML specials, 4096 tokens of context in 64 pages of 16.
fn served_model() -> lantern::api::ServedModel {
    let merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "{ \""];
    let mut kv = byte_level_tokenizer(&merges, &["<|im_start|>", "<|im_end|>", "<|endoftext|>"]);
    let n = 256 + merges.len() + 3;
    kv.retain(|(k, _)| k != "tokenizer.ggml.eos_token_id");
    kv.push(("tokenizer.ggml.eos_token_id".to_string(), Meta::U32(n as u32 - 2)));
    kv.push(("tokenizer.chat_template".to_string(), Meta::Str(SERVED_TEMPLATE.into())));
    let bytes = gguf_bytes(&kv);
    let g = GgufFile::parse(&bytes, "served.gguf").expect("served GGUF parses");
    let tokenizer = Tokenizer::from_gguf(&g).expect("served tokenizer builds");
    let template = tokenizer.chat_template().map_err(|e| e.to_string());
    lantern::api::ServedModel {
        vocab: tokenizer.vocab_size(),
        stop_ids: vec![n as u32 - 2, n as u32 - 1],
        tokenizer: std::sync::Arc::new(tokenizer),
        template,
        context: 4096,
        kv_pages_total: 64,
        page_size: 16,
        model_id: "tiny".into(),
        aliases: vec!["models/tiny.gguf".into()],
        speculation: Default::default(),
        max_seqs: 4,
        embedding_dims: 64,
        token_bytes: Default::default(),
    }
}

/// A GGUF file with these metadata entries and no tensors (the tests' writer).
pub fn gguf_bytes(kv: &[(String, Meta)]) -> Vec<u8> {
    let mut w = GgufWriter::default();
    for (k, v) in kv {
        w.kv(k, v.clone());
    }
    w.to_bytes()
}

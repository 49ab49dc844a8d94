//! A GGUF writer for synthetic test files, and the tiny models and byte-level tokenizers
//! the tests build with it. Plain Rust with no filesystem and no dependencies beyond std, so
//! the native tests (through `tests/common`), the browser tests (`tests/wasm.rs`) and the
//! fuzz targets (`fuzz/src/lib.rs`) all include this one file with `#[path]`.
#![allow(dead_code)]

/// ggml type ids used by the tests.
pub mod ggml {
    pub const F32: u32 = 0;
    pub const F16: u32 = 1;
    pub const Q4_0: u32 = 2;
    pub const Q4_1: u32 = 3;
    pub const Q8_0: u32 = 8;
    pub const Q4_K: u32 = 12;
    pub const BF16: u32 = 30;
}

/// A metadata value for [`GgufWriter`].
#[derive(Debug, Clone)]
pub enum Meta {
    U32(u32),
    I32(i32),
    U64(u64),
    F32(f32),
    Bool(bool),
    Str(String),
    StrArray(Vec<String>),
    I32Array(Vec<i32>),
    F32Array(Vec<f32>),
    /// Any value: type id and already-encoded bytes.
    Raw(u32, Vec<u8>),
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

impl Meta {
    fn type_id(&self) -> u32 {
        match self {
            Meta::U32(_) => 4,
            Meta::I32(_) => 5,
            Meta::F32(_) => 6,
            Meta::Bool(_) => 7,
            Meta::Str(_) => 8,
            Meta::StrArray(_) | Meta::I32Array(_) | Meta::F32Array(_) => 9,
            Meta::U64(_) => 10,
            Meta::Raw(t, _) => *t,
        }
    }

    fn encode(&self, out: &mut Vec<u8>) {
        match self {
            Meta::U32(v) => out.extend(v.to_le_bytes()),
            Meta::I32(v) => out.extend(v.to_le_bytes()),
            Meta::U64(v) => out.extend(v.to_le_bytes()),
            Meta::F32(v) => out.extend(v.to_le_bytes()),
            Meta::Bool(v) => out.push(*v as u8),
            Meta::Str(s) => put_str(out, s),
            Meta::StrArray(v) => {
                out.extend(8u32.to_le_bytes());
                out.extend((v.len() as u64).to_le_bytes());
                v.iter().for_each(|s| put_str(out, s));
            }
            Meta::I32Array(v) => {
                out.extend(5u32.to_le_bytes());
                out.extend((v.len() as u64).to_le_bytes());
                v.iter().for_each(|x| out.extend(x.to_le_bytes()));
            }
            Meta::F32Array(v) => {
                out.extend(6u32.to_le_bytes());
                out.extend((v.len() as u64).to_le_bytes());
                v.iter().for_each(|x| out.extend(x.to_le_bytes()));
            }
            Meta::Raw(_, b) => out.extend(b),
        }
    }
}

/// One tensor for [`GgufWriter`]. `offset` overrides the computed data offset (for broken files).
#[derive(Debug, Clone)]
pub struct WTensor {
    pub name: String,
    /// ggml dims, innermost first.
    pub dims: Vec<u64>,
    pub ggml_type: u32,
    pub data: Vec<u8>,
    pub offset: Option<u64>,
}

/// Minimal GGUF writer (little-endian, v3 by default) for synthetic test files.
#[derive(Debug, Clone)]
pub struct GgufWriter {
    pub magic: [u8; 4],
    pub version: u32,
    pub alignment: u64,
    pub kv: Vec<(String, Meta)>,
    pub tensors: Vec<WTensor>,
    /// Overrides the tensor count written in the header.
    pub tensor_count_override: Option<u64>,
}

impl Default for GgufWriter {
    fn default() -> Self {
        GgufWriter { magic: *b"GGUF", version: 3, alignment: 32, kv: Vec::new(), tensors: Vec::new(), tensor_count_override: None }
    }
}

impl GgufWriter {
    /// Add a metadata entry.
    pub fn kv(&mut self, key: &str, v: Meta) -> &mut Self {
        self.kv.push((key.to_string(), v));
        self
    }

    /// Replace (or add) a metadata entry.
    pub fn set(&mut self, key: &str, v: Meta) -> &mut Self {
        self.kv.retain(|(k, _)| k != key);
        self.kv(key, v)
    }

    /// Add a tensor (`dims` innermost first).
    pub fn tensor(&mut self, name: &str, dims: &[u64], ggml_type: u32, data: Vec<u8>) -> &mut Self {
        self.tensors.push(WTensor { name: name.to_string(), dims: dims.to_vec(), ggml_type, data, offset: None });
        self
    }

    /// Add an F32 tensor from values (`dims` innermost first).
    pub fn tensor_f32(&mut self, name: &str, dims: &[u64], values: &[f32]) -> &mut Self {
        let data = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.tensor(name, dims, ggml::F32, data)
    }

    /// Serialize. Tensor data is laid out in order, each aligned to `alignment`.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend(self.magic);
        out.extend(self.version.to_le_bytes());
        let n_tensors = self.tensor_count_override.unwrap_or(self.tensors.len() as u64);
        out.extend(n_tensors.to_le_bytes());
        out.extend((self.kv.len() as u64).to_le_bytes());
        for (k, v) in &self.kv {
            put_str(&mut out, k);
            out.extend(v.type_id().to_le_bytes());
            v.encode(&mut out);
        }
        let align = self.alignment.max(1);
        let mut offset = 0u64;
        let mut offsets = Vec::new();
        for t in &self.tensors {
            offsets.push(offset);
            offset = (offset + t.data.len() as u64).div_ceil(align) * align;
        }
        for (t, &off) in self.tensors.iter().zip(&offsets) {
            put_str(&mut out, &t.name);
            out.extend((t.dims.len() as u32).to_le_bytes());
            t.dims.iter().for_each(|d| out.extend(d.to_le_bytes()));
            out.extend(t.ggml_type.to_le_bytes());
            out.extend(t.offset.unwrap_or(off).to_le_bytes());
        }
        if self.tensors.is_empty() {
            // Metadata only: no data section to align.
            return out;
        }
        let data_start = (out.len() as u64).div_ceil(align) * align;
        out.resize(data_start as usize, 0);
        for (t, &off) in self.tensors.iter().zip(&offsets) {
            out.resize((data_start + off) as usize, 0);
            out.extend(&t.data);
        }
        out
    }
}

/// Encode rows of f32 values as Q8_0 with scale 1.0 (values must be integers in -127..=127).
pub fn q8_0_exact(values: &[f32]) -> Vec<u8> {
    assert!(values.len().is_multiple_of(32));
    let mut out = Vec::new();
    for block in values.chunks(32) {
        // f16 1.0.
        out.extend(0x3c00u16.to_le_bytes());
        out.extend(block.iter().map(|&v| v as i8 as u8));
    }
    out
}

/// Shape of the tiny synthetic model made by [`tiny_model`].
#[derive(Debug, Clone, Copy)]
pub struct TinyShape {
    pub hidden: u64,
    pub heads: u64,
    pub kv_heads: u64,
    pub head_dim: u64,
    pub ffn: u64,
    pub vocab: u64,
    pub layers: u64,
}

/// The default tiny shape: 2 layers, hidden 32, 2 heads of 16, 1 KV head, ffn 64, vocab 8.
pub const TINY: TinyShape = TinyShape { hidden: 32, heads: 2, kv_heads: 1, head_dim: 16, ffn: 64, vocab: 8, layers: 2 };

/// A complete synthetic model GGUF for architecture `arch`. Every value of row `r` of the
/// Q and K projections equals `r` (the GGUF row index), so un-permutation can be checked
/// exactly; `qk_type` is `ggml::F32` or `ggml::Q8_0`. Other tensors are F32 with small
/// distinct values. Qwen2 files get q/k/v biases whose element `r` equals `r`.
pub fn tiny_model(arch: &str, s: TinyShape, qk_type: u32) -> GgufWriter {
    let mut w = GgufWriter::default();
    let k = |x: &str| format!("{arch}.{x}");
    let tokens: Vec<String> = (0..s.vocab).map(|i| format!("tok{i}")).collect();
    w.kv("general.architecture", Meta::Str(arch.to_string()))
        .kv("general.name", Meta::Str("tiny".into()))
        .kv(&k("block_count"), Meta::U32(s.layers as u32))
        .kv(&k("context_length"), Meta::U32(256))
        .kv(&k("embedding_length"), Meta::U32(s.hidden as u32))
        .kv(&k("feed_forward_length"), Meta::U32(s.ffn as u32))
        .kv(&k("attention.head_count"), Meta::U32(s.heads as u32))
        .kv(&k("attention.head_count_kv"), Meta::U32(s.kv_heads as u32))
        .kv(&k("attention.key_length"), Meta::U32(s.head_dim as u32))
        .kv(&k("attention.layer_norm_rms_epsilon"), Meta::F32(1e-6))
        .kv(&k("rope.freq_base"), Meta::F32(10000.0))
        .kv("tokenizer.ggml.model", Meta::Str("gpt2".into()))
        .kv("tokenizer.ggml.tokens", Meta::StrArray(tokens))
        .kv("tokenizer.ggml.bos_token_id", Meta::U32(1))
        .kv("tokenizer.ggml.eos_token_id", Meta::U32(2));
    let q = s.heads * s.head_dim;
    let kv = s.kv_heads * s.head_dim;
    let ramp = |n: u64, base: f32| (0..n).map(|i| base + i as f32 * 0.001).collect::<Vec<f32>>();
    let rows =
        |out_rows: u64, inner: u64| -> Vec<f32> { (0..out_rows).flat_map(|r| std::iter::repeat_n(r as f32, inner as usize)).collect() };
    let qk = |w: &mut GgufWriter, name: &str, out_rows: u64| {
        let vals = rows(out_rows, s.hidden);
        match qk_type {
            ggml::Q8_0 => w.tensor(name, &[s.hidden, out_rows], ggml::Q8_0, q8_0_exact(&vals)),
            _ => w.tensor_f32(name, &[s.hidden, out_rows], &vals),
        };
    };
    w.tensor_f32("token_embd.weight", &[s.hidden, s.vocab], &ramp(s.hidden * s.vocab, 0.0));
    for l in 0..s.layers {
        let b = |x: &str| format!("blk.{l}.{x}");
        w.tensor_f32(&b("attn_norm.weight"), &[s.hidden], &ramp(s.hidden, 1.0));
        qk(&mut w, &b("attn_q.weight"), q);
        qk(&mut w, &b("attn_k.weight"), kv);
        w.tensor_f32(&b("attn_v.weight"), &[s.hidden, kv], &ramp(s.hidden * kv, 0.5));
        if arch == "qwen2" {
            w.tensor_f32(&b("attn_q.bias"), &[q], &rows(q, 1));
            w.tensor_f32(&b("attn_k.bias"), &[kv], &rows(kv, 1));
            w.tensor_f32(&b("attn_v.bias"), &[kv], &rows(kv, 1));
        }
        w.tensor_f32(&b("attn_output.weight"), &[q, s.hidden], &ramp(q * s.hidden, 0.25));
        w.tensor_f32(&b("ffn_norm.weight"), &[s.hidden], &ramp(s.hidden, 1.5));
        w.tensor_f32(&b("ffn_gate.weight"), &[s.hidden, s.ffn], &ramp(s.hidden * s.ffn, 0.1));
        w.tensor_f32(&b("ffn_up.weight"), &[s.hidden, s.ffn], &ramp(s.hidden * s.ffn, 0.2));
        w.tensor_f32(&b("ffn_down.weight"), &[s.ffn, s.hidden], &ramp(s.ffn * s.hidden, 0.3));
    }
    w.tensor_f32("output_norm.weight", &[s.hidden], &ramp(s.hidden, 2.0));
    w
}

/// GPT-2's byte-to-character table: byte `b` as the character byte-level BPE vocabularies
/// spell it with.
pub fn byte_level_char(b: u8) -> char {
    let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
    if printable(b) {
        return b as char;
    }
    let n = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + n).unwrap_or('?')
}

/// A byte-level BPE tokenizer's metadata (`tokenizer.ggml.*`, Qwen2's pre-tokenizer): the
/// 256 byte tokens, one token per merge (`"h e"` makes `he`), then `specials` (control
/// tokens); EOS is the first special. Its vocabulary is `256 + merges.len() +
/// specials.len()` tokens.
pub fn byte_level_tokenizer(merges: &[&str], specials: &[&str]) -> Vec<(String, Meta)> {
    let mut tokens: Vec<String> = (0..=255u8).map(|b| byte_level_char(b).to_string()).collect();
    let merges: Vec<String> = merges.iter().map(|m| m.to_string()).collect();
    tokens.extend(merges.iter().map(|m| m.replace(' ', "")));
    tokens.extend(specials.iter().map(|t| t.to_string()));
    let n = tokens.len();
    let types = (0..n).map(|i| if i + specials.len() >= n { 3 } else { 1 }).collect();
    let mut kv = vec![
        ("tokenizer.ggml.model".to_string(), Meta::Str("gpt2".into())),
        ("tokenizer.ggml.pre".to_string(), Meta::Str("qwen2".into())),
        ("tokenizer.ggml.tokens".to_string(), Meta::StrArray(tokens)),
        ("tokenizer.ggml.token_type".to_string(), Meta::I32Array(types)),
        ("tokenizer.ggml.merges".to_string(), Meta::StrArray(merges)),
    ];
    if !specials.is_empty() {
        kv.push(("tokenizer.ggml.eos_token_id".to_string(), Meta::U32((n - specials.len()) as u32)));
    }
    kv
}

//! Shared test helpers: where the real model and the fixtures live, and a tiny GGUF writer
//! for synthetic files (valid ones and deliberately broken ones).
#![allow(dead_code)]

pub mod random;
pub mod real;

use std::path::PathBuf;

/// File name of the SmolLM2 test model inside `<cache>/models/`.
pub const SMOLLM2_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// SmolLM2's tokenizer, loaded once per test binary: tiny models' ids (< 512) are byte-level
/// tokens in it, so engines over tiny models have real text to stream.
pub fn smollm2_tokenizer() -> std::sync::Arc<lantern::model::tokenizer::Tokenizer> {
    static T: std::sync::OnceLock<std::sync::Arc<lantern::model::tokenizer::Tokenizer>> = std::sync::OnceLock::new();
    T.get_or_init(|| {
        let l = lantern::model::load::load_path(&smollm2_gguf()).expect("SmolLM2 GGUF");
        std::sync::Arc::new(l.tokenizer.expect("the SmolLM2 GGUF has a tokenizer"))
    })
    .clone()
}

/// Path of the SmolLM2-135M-Instruct Q4_1 GGUF: `$LANTERN_SMOLLM2_GGUF`, else where
/// `lantern fetch` puts it (`lantern::fetch::default_model_path`). Panics (the test fails, it does not
/// skip) when the file is missing.
pub fn smollm2_gguf() -> PathBuf {
    let path = match std::env::var_os("LANTERN_SMOLLM2_GGUF") {
        Some(p) => PathBuf::from(p),
        None => lantern::fetch::default_model_path(),
    };
    if !path.is_file() {
        panic!(
            "test model not found at {}: run the test command from the README (it fetches \
             {SMOLLM2_FILE} into the cache), or set LANTERN_SMOLLM2_GGUF to the file",
            path.display()
        );
    }
    path
}

/// The reference fixtures: `$LANTERN_FIXTURES`, else `tests/fixtures` in the repository
/// (vendored with their READMEs; see `tests/fixtures/README.md`).
pub fn fixtures_dir() -> PathBuf {
    match std::env::var_os("LANTERN_FIXTURES") {
        Some(p) => PathBuf::from(p),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures"),
    }
}

/// `fixtures_dir()/tiny`: the tiny transformers checkpoints.
pub fn tiny_dir() -> PathBuf {
    fixtures_dir().join("tiny")
}

/// Read and parse a JSON file.
pub fn read_json(path: &std::path::Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Read a raw little-endian f32 file.
pub fn read_f32(path: &std::path::Path) -> Vec<f32> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

/// A JSON list of token ids.
pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array().expect("id list").iter().map(|x| x.as_u64().expect("id") as u32).collect()
}

/// Asserts `got` matches `want` (rows of `vocab` logits) within `tol`, naming the worst
/// position, token and values; a NaN difference counts as the worst.
pub fn assert_close(what: &str, got: &[f32], want: &[f32], vocab: usize, tol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let (mut worst, mut worst_i) = (0.0f32, 0usize);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let d = (g - w).abs();
        if d.is_nan() || d > worst {
            worst = d;
            worst_i = i;
        }
    }
    assert!(
        worst <= tol,
        "{what}: max |diff| {worst:e} > {tol:e} at position {} token {} (got {}, want {})",
        worst_i / vocab,
        worst_i % vocab,
        got[worst_i],
        want[worst_i]
    );
    eprintln!("{what}: max |diff| {worst:e}");
}

/// Read and parse a JSON fixture under [`fixtures_dir`].
pub fn fixture_json(rel: &str) -> serde_json::Value {
    let path = fixtures_dir().join(rel);
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("cannot read fixture {}: {e}", path.display()));
    serde_json::from_slice(&bytes).unwrap_or_else(|e| panic!("fixture {} is not JSON: {e}", path.display()))
}

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
        out.extend(half::f16::from_f32(1.0).to_le_bytes());
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

/// The GPU context every GPU test uses: the best adapter (pin with `WGPU_BACKEND=vulkan`).
/// Panics when there is none: in CI a missing adapter is a failure, never a skip.
pub fn gpu() -> std::sync::Arc<lantern::gpu::GpuContext> {
    gpu_with(&lantern::gpu::DeviceOptions::default())
}

/// A GPU context with explicit options (e.g. a small binding limit).
pub fn gpu_with(opts: &lantern::gpu::DeviceOptions) -> std::sync::Arc<lantern::gpu::GpuContext> {
    match pollster::block_on(lantern::gpu::GpuContext::new(opts)) {
        Ok(c) => c,
        Err(e) => panic!(
            "no usable GPU adapter ({e}); install Mesa's lavapipe (mesa-vulkan-drivers) and set \
             WGPU_BACKEND=vulkan, as the README's test command does"
        ),
    }
}

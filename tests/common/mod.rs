//! Shared test helpers: where the real model and the fixtures live, and a tiny GGUF writer
//! for synthetic files (valid ones and deliberately broken ones).
#![allow(dead_code)]

pub mod gguf_writer;
pub mod random;
pub mod real;

#[allow(unused_imports)]
pub use gguf_writer::*;

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

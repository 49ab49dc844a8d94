//! Lantern: portable LLM inference on WebGPU.
//!
//! Layers, top to bottom (see ARCHITECTURE.md; `tests/layers.rs` enforces them): `web` (the
//! browser API), `api` (the HTTP APIs' types), `eval` (perplexity, model comparison),
//! `engine` (generation, batching, sampling, metrics), the quantizer
//! (`quant::{quantize, awq, safetensors}`: whole models packed, calibrated and written),
//! `model` (config, loaders, tokenizer, memory plan, forward pass), `kernels` (one file per
//! GPU op), `kv` (paged KV cache), `gpu` (the only code that makes wgpu objects). Beside
//! them: the packed formats (`quant`'s mod.rs and ggml.rs, below `model`), `reference` (the
//! plain-loop CPU oracle for every op and the whole forward pass, on the model's types, no
//! GPU), `catalogue` and `fetch` (known models and their download), and `error` (one error
//! type wrapping each layer's).

pub mod catalogue;
pub mod error;
#[cfg(feature = "cli")]
pub mod fetch;
pub mod model;
pub mod quant;
pub mod reference;

pub use error::{LanternError, Result};
pub mod api;
pub mod engine;
pub mod eval;
pub mod gpu;
pub mod kernels;
pub mod kv;
#[cfg(all(feature = "web", target_arch = "wasm32"))]
pub mod web;

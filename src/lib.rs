//! Lantern: portable LLM inference on WebGPU.
//!
//! Layers, top to bottom (see ARCHITECTURE.md): `eval` (perplexity, model comparison),
//! `engine` (generation, sampling, metrics),
//! `model` (config, loaders, tokenizer, forward pass), `kv` (paged KV cache), `kernels`
//! (one file per GPU op), `gpu` (the only code that touches wgpu), and `reference`
//! (plain-loop CPU oracle for every op and for the whole forward pass).

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

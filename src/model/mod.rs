//! Models: configuration, loaders (GGUF, Hugging Face safetensors folders), tokenizer and
//! chat template, host-side weights, and the GPU forward pass.

pub mod config;
pub mod forward;
pub mod fp8;
pub mod gguf;
pub mod guidance;
pub mod hf;
pub mod load;
pub mod plan;
pub mod quantized;
pub mod tensor;
pub mod tokenizer;
pub mod validate;

pub use config::{Activation, Arch, BlockSpec, LayerAttention, ModelConfig, MoeSpec, NormPlacement, RopeScaling};
pub use tensor::{DType, HostTensor, ModelWeights};

/// Errors while loading weights from a safetensors folder or while mapping tensors to the
/// model's expected set.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LoadError {
    #[error("{file}: missing tensor `{tensor}`")]
    MissingTensor { file: String, tensor: String },
    #[error("{file}: tensor `{tensor}` has shape {got:?}, expected {expected:?}")]
    WrongShape { file: String, tensor: String, got: Vec<usize>, expected: Vec<usize> },
    #[error("{file}: tensor `{tensor}` has unsupported dtype {dtype}")]
    UnsupportedDType { file: String, tensor: String, dtype: String },
    #[error("{file}: invalid safetensors data: {reason}")]
    Safetensors { file: String, reason: String },
    #[error("{file}: {reason}")]
    Invalid { file: String, reason: String },
    /// A quantized checkpoint (written by `lantern quantize`) whose packed tensors or
    /// `lantern.quantization` metadata are missing, malformed or inconsistent.
    #[error("{file}: quantized tensor `{tensor}`: {reason}")]
    Quantized { file: String, tensor: String, reason: String },
}

/// The host's greedy choice over one row of logits: the index of the largest (lowest index on
/// ties, NaN skipped; 0 for an all-NaN row), the rule the GPU argmax kernel follows. The test
/// oracle (`reference::ops::argmax`) has its own copy, so that each checks the other.
pub fn argmax(row: &[f32]) -> u32 {
    let mut best: Option<(usize, f32)> = None;
    for (i, &v) in row.iter().enumerate() {
        if !v.is_nan() && best.is_none_or(|(_, b)| v > b) {
            best = Some((i, v));
        }
    }
    best.map_or(0, |(i, _)| i as u32)
}

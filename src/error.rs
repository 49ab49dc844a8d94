//! The crate's typed errors. Every error names the file, tensor, field or limit involved.

use std::path::PathBuf;

/// Result alias used across the library.
pub type Result<T, E = LanternError> = std::result::Result<T, E>;

/// Everything that can go wrong in Lantern. Variants carry the names and numbers a user
/// needs to fix the input; no variant is produced by a panic.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LanternError {
    #[error("I/O error on {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Gguf(#[from] crate::model::gguf::GgufError),
    #[error(transparent)]
    Load(#[from] crate::model::LoadError),
    #[error(transparent)]
    Tokenizer(#[from] crate::model::tokenizer::TokenizerError),
    #[error("unsupported architecture {arch:?} (supported: llama, mistral, qwen2, qwen3, gemma3, phi3)")]
    UnsupportedArchitecture { arch: String },
    #[error("invalid model config field `{field}`: {reason}")]
    Config { field: String, reason: String },
    #[error("prompt has {prompt_tokens} tokens but the context holds {context} (with {max_new} new tokens requested)")]
    PromptTooLong { prompt_tokens: usize, max_new: usize, context: usize },
    #[error("the memory budget of {budget} bytes ({source_of_budget}) leaves {kv_room} bytes for the KV cache after {weights} of weights, {workspace} of workspace and {reserve} of reserve, but {what} needs {needed}; lower --context or --max-seqs, pick a smaller --kv-dtype, or raise --memory-budget")]
    MemoryBudget {
        budget: u64,
        source_of_budget: String,
        weights: u64,
        workspace: u64,
        reserve: u64,
        kv_room: u64,
        what: String,
        needed: u64,
    },
    #[error("overloaded: {waiting} requests are already waiting (max_waiting {max_waiting})")]
    Overloaded { waiting: usize, max_waiting: usize },
    #[error("the engine has stopped")]
    EngineStopped,
    #[error(transparent)]
    Gpu(#[from] crate::gpu::GpuError),
    #[error(transparent)]
    Kv(#[from] crate::kv::KvError),
    #[error(transparent)]
    Quant(#[from] crate::quant::QuantError),
    #[error(transparent)]
    Eval(#[from] crate::eval::EvalError),
    /// A call the model or engine cannot serve as asked (an empty prompt, a batch larger
    /// than the step, a position without reserved pages, an engine that is not idle).
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// A token id outside the vocabulary.
    #[error("token id {id} is outside the vocabulary (size {vocab})")]
    TokenOutOfRange { id: u32, vocab: usize },
    /// Writing a file format failed (`what`: safetensors, metadata JSON, a tokenizer...).
    #[error("cannot write {what}: {reason}")]
    Serialize { what: String, reason: String },
    /// AWQ calibration could not run.
    #[error("AWQ calibration: {0}")]
    Calibration(String),
    /// A draft model that cannot draft for the target (another vocabulary or tokenizer).
    #[error("the draft model {draft} cannot draft for {target}: {reason}")]
    DraftMismatch { target: String, draft: String, reason: String },
    /// A constrained-decoding request whose JSON schema, regex, Lark grammar or
    /// `response_format` (`kind`) is invalid or does not compile, or a step that left its
    /// grammar (`reason` says which).
    #[error("{kind} constraint: {reason}")]
    Constraint { kind: String, reason: String },
    /// Reading model bytes from a source that is not a file (a browser `Blob`).
    #[error("reading {source_name}: {reason}")]
    Read { source_name: String, reason: String },
}

impl LanternError {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        LanternError::Io { path: path.into(), source }
    }
}

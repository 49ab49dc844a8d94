//! What a caller chooses at load ([`ModelOptions`], [`WeightPrecision`]) and asks of a step
//! ([`Want`], [`StepOutput`]).

use crate::kv::plan::KvDtype;
pub use crate::kv::ring::KvWindow;

/// Load-time choices.
#[derive(Debug, Clone)]
pub struct ModelOptions {
    /// Longest sequence in tokens (prompt + generated). Default: min(model max, 2048).
    pub context: Option<usize>,
    /// Sequences served at once.
    pub max_seqs: usize,
    /// Tokens per KV page.
    pub page_size: usize,
    /// Most tokens processed in one step (prefill chunk size).
    pub max_batch_tokens: usize,
    /// Most rows of logits read in one step.
    pub max_logit_rows: usize,
    /// How matrices are stored on the GPU.
    pub weights: WeightPrecision,
    /// Storage of cached K and V: f32 (exact), f16 or q8 (int8 with a scale per token and
    /// head).
    pub kv_dtype: KvDtype,
    /// Most key ranges a decode token's attention is cut into (flash-decoding). Default:
    /// 1 on CPU adapters (few cores, and each extra dispatch costs), 16 on GPUs.
    pub attention_splits: Option<usize>,
    /// Keys per split at least (short sequences are not cut into slivers).
    pub attention_split_keys: usize,
    /// Keep the full KV pages of finished prompts and reuse them for prompts that start
    /// the same way (until their memory is needed).
    pub prefix_cache: bool,
    /// Steps of at most this many tokens use the matvec kernels (one pass over the weights
    /// per token), larger ones the batched matvec or the matmul. Default: 1 where batched
    /// plans exist (packed weights) or on CPU adapters, else 4.
    pub matvec_max_tokens: Option<usize>,
    /// Packed weights: larger steps up to this many tokens use the batched matvec (one
    /// pass over the weights per four tokens, or per eight for steps of more than four
    /// where the layout has the eight-token form; CPU adapters' ROWS4 | XBCAST or TEX,
    /// GPUs' MULTI_ROW) before the matmul takes over. Default: 16 on CPU adapters, 8 on
    /// GPUs (4 without the eight-token form).
    pub batch_max_tokens: Option<usize>,
    /// Steps of more than four tokens (speculative verify) take the eight-token matvec
    /// (`flags::TOK8`: the tiled layout of CPU adapters, GPUs' MULTI_ROW), one pass over the
    /// weights per eight tokens. `None` or `Some(true)`: where the layout has it;
    /// `Some(false)`: passes of the four-token matvec (comparisons).
    pub eight_token_matvec: Option<bool>,
    /// Pages in the KV pool; default `max_seqs` full contexts (capped by the budget).
    pub kv_pages: Option<usize>,
    /// Run every step through the same kernels (the matmul path, even for one token), so a
    /// sequence's logits do not depend on how many tokens share its step: continuous
    /// batching then reproduces single-sequence outputs bit for bit. Slower decode.
    pub batch_invariant: bool,
    /// Cap on the GPU memory this model may take (weights + KV + workspace + reserve).
    /// The budget is the smaller of this and 90% of what the adapter reports
    /// (`gpu::memory`); the KV cache gets what is left, up to `max_seqs` full contexts.
    pub memory_budget: Option<u64>,
    /// CPU adapters with 8-lane subgroups (lavapipe): hold packed weights as tiled textures,
    /// read through texel fetches (`None` or `Some(true)`, the default where they fit:
    /// `kernels::linear::tiled_fits`), or in storage buffers (`Some(false)`: the slower
    /// storage kernels, for comparisons).
    pub weight_textures: Option<bool>,
    /// A streamed load ([`GpuModel::load_streamed`](super::GpuModel::load_streamed)) reads
    /// the embedding table and the head a slice of rows at a time, each slice at most this
    /// many bytes once converted (counted as f32, the widest kernel format). Default 16 MiB.
    pub stream_slice_bytes: usize,
    /// Whether sliding-window layers (Gemma 3's local layers) keep only a ring of their
    /// window's pages per sequence instead of every token (`kv::ring`). Default: where the
    /// ring is smaller than the context; the prefix cache is then off.
    pub kv_window: KvWindow,
    /// Greedy decode steps of one sequence kept in flight ahead of the host reading their
    /// tokens (`GpuModel::begin_ahead`): each step's argmax feeds the next step's embedding
    /// on the GPU, so the device never waits for the host between tokens. Below 2: one step
    /// at a time, each waiting for its token. Default 3.
    pub decode_ahead: usize,
}

impl Default for ModelOptions {
    fn default() -> Self {
        ModelOptions {
            context: None,
            max_seqs: 1,
            page_size: 16,
            max_batch_tokens: 128,
            max_logit_rows: 64,
            weights: WeightPrecision::Native,
            kv_dtype: KvDtype::F32,
            attention_splits: None,
            attention_split_keys: 256,
            prefix_cache: true,
            batch_invariant: false,
            matvec_max_tokens: None,
            batch_max_tokens: None,
            eight_token_matvec: None,
            kv_pages: None,
            memory_budget: None,
            weight_textures: None,
            stream_slice_bytes: 16 << 20,
            kv_window: KvWindow::Auto,
            decode_ahead: 3,
        }
    }
}

/// Storage of weight matrices on the GPU (norms and biases are always f32).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum WeightPrecision {
    /// Quantized weights (GGUF Q8_0/Q4_0/Q4_1, Lantern-quantized safetensors) stay packed and
    /// are dequantized inside the kernels; f16 checkpoints stay f16; f32 and bf16 become f32.
    /// On CPU adapters every kernel computes in f32, so results equal the f32 reference.
    #[default]
    Native,
    /// Everything f32.
    F32,
    /// Everything f16 (half the bytes and faster; quantized and bf16 weights are rounded to
    /// f16, so logits differ from the f32 reference by about 1e-3).
    F16,
}

/// What a step should return.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Want {
    /// Only the argmax of each requested row (4 bytes read back per row).
    Argmax,
    /// The full logits of each requested row (and their argmax).
    Logits,
    /// The best `TOPK_MAX` (id, logit) pairs of each requested row, from the GPU (and the
    /// argmax): what a sampler with top-k <= TOPK_MAX needs, 512 bytes per row.
    TopK,
}

/// Result of a forward step.
#[derive(Debug, Clone, Default)]
pub struct StepOutput {
    /// Argmax per requested row.
    pub argmax: Vec<u32>,
    /// Logits per requested row (`rows x vocab`), when asked for.
    pub logits: Option<Vec<f32>>,
    /// Per requested row, its best (id, logit) pairs, best first (with `Want::TopK`).
    pub top: Option<Vec<Vec<(u32, f32)>>>,
    /// Per requested row, the logsumexp of its finite logits, from the GPU (with
    /// `Want::TopK`): `logit - lse` is a log-probability.
    pub lse: Option<Vec<f32>>,
}

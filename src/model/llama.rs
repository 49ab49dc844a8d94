//! The Llama-family forward pass on the GPU (Llama 1/2/3, SmolLM2, TinyLlama, Mistral without
//! sliding window, Qwen2 with q/k/v biases), mirroring Hugging Face transformers'
//! `modeling_llama.py` (https://github.com/huggingface/transformers) and the paper
//! "LLaMA: Open and Efficient Foundation Language Models" (arXiv:2302.13971).
//!
//! Per layer, six dispatches, each a fused op:
//! 1. `qkv = rmsnorm(x) W_qkv^T (+ b)`   (norm folded into the q|k|v projection)
//! 2. RoPE on q and k; k and v written into the paged KV cache
//! 3. causal GQA attention over the cache
//! 4. `x += attn W_o^T`                  (residual add fused)
//! 5. `act = silu(n W_gate^T) * (n W_up^T)`, `n = rmsnorm(x)` (norm and gate fused)
//! 6. `x += act W_down^T`
//!
//! plus the embedding gather before and `logits = rmsnorm(x) W_head^T` and the GPU argmax
//! after: 6 L + 3 dispatches per step, all recorded into one command submission.

use std::sync::Arc;

use crate::gpu::buffer::{create_storage, create_zeroed, Readback};
use crate::gpu::{GpuContext, GpuError};
use crate::kernels::attention::{AttentionIo, AttentionParams};
use crate::kernels::linear::{GpuLinear, HostMatrix, LinearIo, Shape};
use crate::kernels::rope_kv::{rope_table, RopeKvIo, RopeKvParams};
use crate::kernels::{self, Dispatch, StepUniform};
use crate::kv::cache::{KvCache, KvLayout, KvStore};
use crate::kv::plan::KvDtype;
use crate::kv::{KvConfig, KvError, PageAllocator};
use crate::kernels::attention::KvBinding;
use crate::model::{DType, HostTensor, ModelConfig, ModelWeights};
use crate::quant::PackedMatrix;
use crate::{LanternError, Result};

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
    /// per token), larger ones the matmul. Default: 4 on GPUs, 1 on CPU adapters.
    pub matvec_max_tokens: Option<usize>,
    /// CPU adapters: larger steps up to this many tokens use the four-token texture matvec
    /// (one pass over the weights per four tokens) before the matmul takes over. Default 16.
    pub batch_max_tokens: Option<usize>,
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
    /// CPU adapters: hold packed weights a second time as textures for the batched matvec
    /// (`Some(true)`), never (`Some(false)`), or only while holding them twice takes at most
    /// 60% of the memory budget (`None`, the default).
    pub weight_textures: Option<bool>,
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
            kv_pages: None,
            memory_budget: None,
            weight_textures: None,
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

struct Layer {
    /// q|k|v: one projection, or runs of parts stored alike, each with the first qkv column
    /// it writes.
    qkv: Vec<(GpuLinear, usize)>,
    o: GpuLinear,
    gate_up: GpuLinear,
    down: GpuLinear,
    /// The attention input's norm (folded into the q|k|v projection).
    in_norm: wgpu::Buffer,
    /// The MLP input's norm (folded into gate/up).
    post_norm: wgpu::Buffer,
    /// q norm | k norm (2 head_dim floats), applied in place to each head.
    qk_norm: Option<wgpu::Buffer>,
    /// Sandwich norms of the attention and MLP outputs, applied as they are added into the
    /// residual stream.
    attn_out_norm: Option<wgpu::Buffer>,
    mlp_out_norm: Option<wgpu::Buffer>,
}

/// Per-step host inputs.
struct Workspace {
    step: wgpu::Buffer,
    ids: wgpu::Buffer,
    positions: wgpu::Buffer,
    token_seq: wgpu::Buffer,
    block_table: wgpu::Buffer,
    logit_rows: wgpu::Buffer,
    hidden: wgpu::Buffer,
    qkv: wgpu::Buffer,
    attn: wgpu::Buffer,
    act: wgpu::Buffer,
    logits: wgpu::Buffer,
    argmax: wgpu::Buffer,
    /// GPU top-k pairs of the logit rows (`2 TOPK_MAX` words per row).
    topk: wgpu::Buffer,
    rope: wgpu::Buffer,
    /// The sliding layers' cos/sin table when their RoPE base differs (Gemma 3).
    rope_local: Option<wgpu::Buffer>,
    /// A sublayer's output before its post-norm (sandwich-norm models), `t x hidden`.
    branch: Option<wgpu::Buffer>,
    /// Attention's partial results when keys are split (a 4-byte stand-in otherwise).
    partials: wgpu::Buffer,
}

struct Plans {
    embed: Vec<Dispatch>,
    layers_matvec: Vec<Dispatch>,
    layers_matmul: Vec<Dispatch>,
    head_gather: Vec<Dispatch>,
    /// CPU adapters with texture-held weights: the four-token texture matvec for steps of a
    /// few tokens (batched decode) and its LM head; None elsewhere.
    layers_batch: Option<Vec<Dispatch>>,
    head_gather_batch: Option<Vec<Dispatch>>,
    head_all: Vec<Dispatch>,
    argmax: Dispatch,
    topk: Dispatch,
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
}

/// Bytes of one weight dtype on the GPU.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct DtypeBytes {
    /// Weight matrices (or norm/bias vectors) stored in this dtype.
    pub tensors: usize,
    /// Bytes of values or integer codes.
    pub bytes: u64,
    /// Bytes of group scales (packed dtypes).
    pub scale_bytes: u64,
}

/// Where a loaded model's GPU memory went. Built from the model's own buffers and checked
/// against the context's allocation ledger: `ledger_bytes` is every byte allocated during
/// the load (storage, uniform and readback buffers), `total()` what the categories explain.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct MemoryReport {
    /// Weights by dtype (`q4g32`, `q8g32`, `f16`, `f32`; norms and biases are `f32`).
    pub weights: std::collections::BTreeMap<String, DtypeBytes>,
    /// CPU adapters: packed codes and scales held a second time as textures for the texel
    /// matvec (`flags::TEX`).
    pub weight_textures: u64,
    pub kv_cache: u64,
    /// Activations, step inputs, logits and the RoPE table.
    pub workspace: u64,
    /// Kernel parameter uniforms (one per dispatch).
    pub uniforms: u64,
    /// Host-mapped staging for logits readback.
    pub readback: u64,
    /// Every byte the context's ledger saw allocated during the load (allocations made on the
    /// same context by other threads meanwhile count too: load one model at a time to
    /// compare this with `total()`).
    pub ledger_bytes: u64,
    /// Allocations during the load.
    pub allocations: usize,
    /// The largest single allocation: (label, bytes).
    pub largest: (String, u64),
    /// The budget the KV cache was sized against, and where it came from (None: the adapter
    /// reports no memory size and no `memory_budget` was given).
    pub budget: Option<u64>,
    pub budget_source: String,
    /// Pages of the KV cache, and the pages `max_seqs` full contexts would take.
    pub kv_pages: usize,
    pub kv_pages_requested: usize,
    pub kv_page_size: usize,
    /// How the cache is stored: dtype, and the buffers per layer for K (and V).
    pub kv_dtype: KvDtype,
    pub kv_buffers_per_layer: usize,
}

impl MemoryReport {
    pub fn weight_bytes(&self) -> u64 {
        self.weights.values().map(|d| d.bytes + d.scale_bytes).sum()
    }

    /// Bytes the categories explain (equals `ledger_bytes` when every allocation is known).
    pub fn total(&self) -> u64 {
        self.weight_bytes() + self.weight_textures + self.kv_cache + self.workspace + self.uniforms + self.readback
    }

    fn add_linear(&mut self, lin: &GpuLinear) {
        let key = match lin.quant {
            Some(q) => q.to_string(),
            None => lin.format.name().to_string(),
        };
        let e = self.weights.entry(key).or_default();
        e.tensors += 1 + lin.u.is_some() as usize;
        e.bytes += lin.bytes() - lin.scale_bytes();
        e.scale_bytes += lin.scale_bytes();
        if lin.bias.is_some() {
            self.add_f32_vector(lin.n_rows);
        }
        self.weight_textures += lin.tex.as_ref().map_or(0, |t| t.bytes);
    }

    fn add_f32_vector(&mut self, n: usize) {
        let e = self.weights.entry("f32".into()).or_default();
        e.tensors += 1;
        e.bytes += n as u64 * 4;
    }
}

/// A model resident on the GPU with its KV cache.
pub struct GpuModel {
    pub ctx: Arc<GpuContext>,
    pub config: ModelConfig,
    pub options: ModelOptions,
    pub kv: KvCache,
    // Weights stay owned here for the model's lifetime (the plans' bind groups use them).
    #[allow(dead_code)]
    layers: Vec<Layer>,
    #[allow(dead_code)]
    lm_head: GpuLinear,
    #[allow(dead_code)]
    embed_own: Option<GpuLinear>,
    #[allow(dead_code)]
    final_norm: wgpu::Buffer,
    ws: Workspace,
    plans: Plans,
    readback: Readback,
    memory: MemoryReport,
    /// Measured milliseconds one dispatch costs the caller on the frame-budgeted path.
    submit_ms_per_dispatch: Option<f64>,
    /// Steps where the matvec path runs (n_tokens at or below this).
    pub matvec_max_tokens: usize,
    /// Steps above `matvec_max_tokens` and up to this use the four-token texture matvec
    /// (CPU adapters; 0 where there is none).
    pub batch_max_tokens: usize,
    /// Most key splits per token in a decode step's attention.
    pub attention_splits: usize,
    /// Rows of logits one step can produce (`max_logit_rows` within the binding limit).
    pub logit_rows: usize,
}

/// Most dispatches recorded per submission on the frame-budgeted path. Fewer go into one
/// submission when the measured cost per dispatch says more would overrun the frame budget.
pub const DISPATCHES_PER_SUBMIT: usize = 8;

impl PendingStep {
    /// Dispatches submitted so far.
    pub fn submitted(&self) -> usize {
        self.next
    }
}

/// A step started with [`GpuModel::begin_step_batch`] and driven by [`GpuModel::advance`].
pub struct PendingStep {
    s: StepUniform,
    want: Want,
    /// Dispatches submitted so far.
    next: usize,
    submissions: usize,
    mapping: Option<futures_channel::oneshot::Receiver<std::result::Result<(), wgpu::BufferAsyncError>>>,
}

/// Steps of at most this many tokens may split each token's keys (flash-decoding); larger
/// steps have enough tokens to fill the device.
const SPLIT_MAX_TOKENS: usize = 4;


enum Owned {
    F32(Vec<f32>),
    F16(Vec<u16>),
    Packed(PackedMatrix),
}

impl Owned {
    fn as_matrix(&self) -> HostMatrix<'_> {
        match self {
            Owned::F32(v) => HostMatrix::F32(v),
            Owned::F16(v) => HostMatrix::F16(v),
            Owned::Packed(p) => HostMatrix::Packed(p),
        }
    }

    /// Whether two matrices are stored alike (gate and up share one kernel).
    fn same_storage(&self, other: &Owned) -> bool {
        match (self, other) {
            (Owned::F32(_), Owned::F32(_)) | (Owned::F16(_), Owned::F16(_)) => true,
            (Owned::Packed(a), Owned::Packed(b)) => a.format == b.format,
            _ => false,
        }
    }
}

fn get<'a>(w: &'a ModelWeights, name: &str) -> Result<&'a HostTensor> {
    w.tensors.get(name).ok_or_else(|| {
        LanternError::Load(crate::model::LoadError::MissingTensor {
            file: w.source.clone(),
            tensor: name.into(),
        })
    })
}

/// Concatenate row blocks of matrices into one: with `Native`, packed when every part is
/// quantized in one format (GGUF blocks repacked bit for bit), f16 when all parts are f16.
fn matrix(parts: &[&HostTensor], precision: WeightPrecision) -> Result<Owned> {
    if precision == WeightPrecision::Native {
        // Every part packed (`packed()` is None for float dtypes), in one format.
        let packed = parts.iter().map(|t| t.packed()).collect::<Option<std::result::Result<Vec<_>, _>>>();
        if let Some(packed) = packed {
            let packed = packed?;
            if packed.iter().all(|p| p.format == packed[0].format) {
                return Ok(Owned::Packed(PackedMatrix::concat_rows(&packed)?));
            }
        }
    }
    Ok(matrix_float(parts, precision))
}

/// Whether two tensors load into one kernel format under `precision` (same packed format, or
/// both float).
fn same_dtype(a: &HostTensor, b: &HostTensor, precision: WeightPrecision) -> bool {
    if precision != WeightPrecision::Native {
        return true;
    }
    match (a.dtype.quant_kind(), b.dtype.quant_kind()) {
        (None, None) => true,
        (Some(_), Some(_)) => a.dtype == b.dtype,
        _ => false,
    }
}

fn matrix_float(parts: &[&HostTensor], precision: WeightPrecision) -> Owned {
    if precision == WeightPrecision::F16 {
        let mut v = Vec::new();
        for t in parts {
            if t.dtype == DType::F16 {
                v.extend(t.data.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])));
            } else {
                v.extend(t.to_f32().into_iter().map(|x| half::f16::from_f32(x).to_bits()));
            }
        }
        return Owned::F16(v);
    }
    if precision == WeightPrecision::Native && parts.iter().all(|t| t.dtype == DType::F16) {
        let mut v = Vec::new();
        for t in parts {
            v.extend(t.data.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])));
        }
        Owned::F16(v)
    } else {
        let mut v = Vec::new();
        for t in parts {
            v.extend(t.to_f32());
        }
        Owned::F32(v)
    }
}

#[allow(clippy::too_many_arguments)]
fn lin_io<'a>(
    ws: &'a Workspace,
    x: &'a wgpu::Buffer,
    x_stride: usize,
    norm: Option<&'a wgpu::Buffer>,
    y: &'a wgpu::Buffer,
    out_stride: usize,
    residual: bool,
    eps: f32,
    rows: Option<&'a wgpu::Buffer>,
) -> LinearIo<'a> {
    LinearIo {
        step: &ws.step,
        x,
        x_stride,
        norm,
        eps,
        y,
        out_stride,
        out_offset: 0,
        residual,
        rows,
    }
}

fn gpu_err(e: GpuError) -> LanternError {
    LanternError::Gpu(e)
}

impl GpuModel {
    /// Upload `weights` and build the step plans.
    pub async fn load(ctx: Arc<GpuContext>, weights: &ModelWeights, options: ModelOptions) -> Result<GpuModel> {
        Self::load_with_progress(ctx, weights, options, &mut |_, _| {}).await
    }

    /// [`GpuModel::load`], calling `progress(layers uploaded, layers)` after each layer's
    /// weights are on their way to the GPU (a browser page shows it as the upload bar).
    pub async fn load_with_progress(
        ctx: Arc<GpuContext>,
        weights: &ModelWeights,
        options: ModelOptions,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<GpuModel> {
        let c = weights.config.clone();
        let d = c.hidden_size;
        let hd = c.head_dim;
        let qkv_dim = c.qkv_dim();
        let q_dim = c.num_heads * hd;
        let kv_dim = c.num_kv_heads * hd;
        let f = c.intermediate_size;
        let keep = options.weights;
        let mark = ctx.ledger.mark();
        let textures = Self::weight_textures(&ctx, weights, &options);
        let mut layers = Vec::with_capacity(c.num_layers);
        let norm = |name: &str| -> Result<wgpu::Buffer> {
            let t = get(weights, name)?;
            create_storage(&ctx, name, bytemuck::cast_slice(&t.to_f32())).map_err(gpu_err)
        };
        for l in 0..c.num_layers {
            let p = format!("model.layers.{l}");
            let q = get(weights, &format!("{p}.self_attn.q_proj.weight"))?;
            let k = get(weights, &format!("{p}.self_attn.k_proj.weight"))?;
            let v = get(weights, &format!("{p}.self_attn.v_proj.weight"))?;
            let bias = if c.qkv_bias {
                let mut b = get(weights, &format!("{p}.self_attn.q_proj.bias"))?.to_f32();
                b.extend(get(weights, &format!("{p}.self_attn.k_proj.bias"))?.to_f32());
                b.extend(get(weights, &format!("{p}.self_attn.v_proj.bias"))?.to_f32());
                Some(b)
            } else {
                None
            };
            // q|k|v as one projection, or as runs of parts stored alike when a file mixes
            // formats within the layer (Q4_K_M: q and k in Q4_K, v in Q6_K), each run
            // writing its columns of the qkv output.
            let mut qkv = Vec::new();
            let mut start = 0;
            let parts = [(q, q_dim), (k, kv_dim), (v, kv_dim)];
            let mut i = 0;
            while i < parts.len() {
                let mut j = i + 1;
                while j < parts.len() && same_dtype(parts[i].0, parts[j].0, keep) {
                    j += 1;
                }
                let run: Vec<&HostTensor> = parts[i..j].iter().map(|p| p.0).collect();
                let rows: usize = parts[i..j].iter().map(|p| p.1).sum();
                let w = matrix(&run, keep)?;
                let name = if i == 0 && j == parts.len() { format!("{p}.qkv") } else { format!("{p}.qkv[{start}..{}]", start + rows) };
                let b = bias.as_ref().map(|b| &b[start..start + rows]);
                let lin = GpuLinear::upload_with(&ctx, &name, w.as_matrix(), None, b, rows, d, textures).map_err(gpu_err)?;
                qkv.push((lin, start));
                start += rows;
                i = j;
            }
            let o_w = matrix(&[get(weights, &format!("{p}.self_attn.o_proj.weight"))?], keep)?;
            let o = GpuLinear::upload_with(&ctx, &format!("{p}.o_proj"), o_w.as_matrix(), None, None, d, q_dim, textures).map_err(gpu_err)?;
            let g_t = get(weights, &format!("{p}.mlp.gate_proj.weight"))?;
            let u_t = get(weights, &format!("{p}.mlp.up_proj.weight"))?;
            let g_w = matrix(&[g_t], keep)?;
            let u_w = matrix(&[u_t], keep)?;
            // One gated kernel reads both: if they are stored differently, both go to f32.
            let (g_m, u_m) = if g_w.same_storage(&u_w) {
                (g_w, u_w)
            } else {
                (matrix_float(&[g_t], WeightPrecision::F32), matrix_float(&[u_t], WeightPrecision::F32))
            };
            let gate_up = GpuLinear::upload_with(&ctx, &format!("{p}.gate_up"), g_m.as_matrix(), Some(u_m.as_matrix()), None, f, d, textures)
                .map_err(gpu_err)?;
            let dn_w = matrix(&[get(weights, &format!("{p}.mlp.down_proj.weight"))?], keep)?;
            let down = GpuLinear::upload_with(&ctx, &format!("{p}.down_proj"), dn_w.as_matrix(), None, None, d, f, textures).map_err(gpu_err)?;
            let norms = crate::model::validate::layer_norm_names(&c, l);
            let qk_norm = if c.block.qk_norm {
                let mut v = get(weights, &format!("{p}.self_attn.q_norm.weight"))?.to_f32();
                v.extend(get(weights, &format!("{p}.self_attn.k_norm.weight"))?.to_f32());
                Some(create_storage(&ctx, &format!("{p}.qk_norm"), bytemuck::cast_slice(&v)).map_err(gpu_err)?)
            } else {
                None
            };
            let mut gate_up = gate_up;
            gate_up.gelu = c.block.activation == crate::model::Activation::GeluTanh;
            layers.push(Layer {
                qkv,
                o,
                gate_up,
                down,
                in_norm: norm(&norms.attn_in)?,
                post_norm: norm(&norms.mlp_in)?,
                qk_norm,
                attn_out_norm: norms.attn_out.as_deref().map(norm).transpose()?,
                mlp_out_norm: norms.mlp_out.as_deref().map(norm).transpose()?,
            });
            // Flush this layer's uploads so staging memory stays about one layer's worth.
            ctx.queue.submit(std::iter::empty());
            progress(l + 1, c.num_layers);
        }
        let embed_t = get(weights, "model.embed_tokens.weight")?;
        let head_t = if c.tie_word_embeddings {
            embed_t
        } else {
            get(weights, "lm_head.weight")?
        };
        let head_m = matrix(&[head_t], keep)?;
        let lm_head = GpuLinear::upload_with(&ctx, "lm_head", head_m.as_matrix(), None, None, c.vocab_size, d, textures).map_err(gpu_err)?;
        let embed_own = if c.tie_word_embeddings {
            None
        } else {
            let m = matrix(&[embed_t], keep)?;
            let t = GpuLinear::upload_with(&ctx, "embed_tokens", m.as_matrix(), None, None, c.vocab_size, d, textures).map_err(gpu_err)?;
            Some(t)
        };
        let final_norm = norm("model.norm.weight")?;

        // KV cache.
        let context = options
            .context
            .unwrap_or(c.max_position_embeddings.min(2048))
            .max(1);
        let page_size = options.page_size.max(1);
        let max_seqs = options.max_seqs.max(1);
        let requested_pages = options.kv_pages.unwrap_or(max_seqs * context.div_ceil(page_size)).max(1);
        let weights_bytes: u64 = ctx.ledger.since(mark).iter().map(|a| a.bytes).sum();
        let (num_pages, budget) = Self::size_kv(&ctx, &c, &options, context, requested_pages, weights_bytes)?;
        let kv_cfg = KvConfig { page_size, num_pages, max_seqs, context };
        let layout = KvLayout::new(options.kv_dtype, kv_cfg.page_size, c.num_kv_heads, hd, kv_cfg.num_pages, ctx.max_binding())
            .map_err(gpu_err)?;
        // The cache is the big allocation: one the driver cannot honour is found here, at
        // load, not mid-generation.
        let oom = ctx.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let store = KvStore::new(&ctx, layout, c.num_layers).map_err(gpu_err)?;
        if let Some(e) = oom.pop().await {
            return Err(LanternError::Gpu(GpuError::Allocation {
                what: format!("the KV cache ({} pages of {} tokens)", kv_cfg.num_pages, page_size),
                bytes: store.bytes(),
                reason: e.to_string(),
            }));
        }
        let kv = KvCache { alloc: PageAllocator::new(kv_cfg), store };
        // Batch invariance: a token's key splits must not depend on the step it is in.
        let attention_splits = if options.batch_invariant {
            1
        } else {
            options.attention_splits.unwrap_or(if ctx.caps.cpu_like { 1 } else { 16 }).max(1)
        };
        let attn_p = Self::attention_params(&c, kv_cfg, 0);
        let t_max = options.max_batch_tokens.max(1);
        let partials_bytes = kernels::attention::partials_bytes(&attn_p, &layout, t_max, 1)
            .max(kernels::attention::partials_bytes(&attn_p, &layout, t_max.min(SPLIT_MAX_TOKENS), attention_splits));

        // Workspace.
        let t = options.max_batch_tokens.max(1);
        // Rows of logits per step: as asked, within one storage binding.
        let r = options.max_logit_rows.max(1).min(t).min((ctx.max_binding() / (c.vocab_size as u64 * 4)).max(1) as usize);
        let ws = Workspace {
            step: kernels::step_buffer(&ctx),
            ids: create_zeroed(&ctx, "ids", (t * 4) as u64).map_err(gpu_err)?,
            positions: create_zeroed(&ctx, "positions", (t * 4) as u64).map_err(gpu_err)?,
            token_seq: create_zeroed(&ctx, "token_seq", (t * 4) as u64).map_err(gpu_err)?,
            block_table: create_zeroed(&ctx, "block_table", (kv_cfg.max_seqs * kv_cfg.max_pages_per_seq() * 4) as u64)
                .map_err(gpu_err)?,
            logit_rows: create_zeroed(&ctx, "logit_rows", (r * 4) as u64).map_err(gpu_err)?,
            hidden: create_zeroed(&ctx, "hidden", (t * d * 4) as u64).map_err(gpu_err)?,
            qkv: create_zeroed(&ctx, "qkv", (t * qkv_dim * 4) as u64).map_err(gpu_err)?,
            attn: create_zeroed(&ctx, "attn", (t * q_dim * 4) as u64).map_err(gpu_err)?,
            act: create_zeroed(&ctx, "act", (t * f * 4) as u64).map_err(gpu_err)?,
            logits: create_zeroed(&ctx, "logits", (r * c.vocab_size * 4) as u64).map_err(gpu_err)?,
            argmax: create_zeroed(&ctx, "argmax", (t * 4) as u64).map_err(gpu_err)?,
            topk: create_zeroed(&ctx, "topk", (r * 2 * kernels::topk::TOPK_MAX * 4) as u64).map_err(gpu_err)?,
            rope: create_storage(&ctx, "rope", bytemuck::cast_slice(&rope_table(&c.rope_inv_freq(), context)))
                .map_err(gpu_err)?,
            rope_local: match (c.has_local_rope(), c.block.layer_attention.iter().position(|a| *a == crate::model::LayerAttention::Sliding)) {
                (true, Some(l)) => Some(
                    create_storage(&ctx, "rope.local", bytemuck::cast_slice(&rope_table(&c.layer_rope_inv_freq(l), context))).map_err(gpu_err)?,
                ),
                _ => None,
            },
            branch: if c.block.norms == crate::model::NormPlacement::Sandwich {
                Some(create_zeroed(&ctx, "branch", (t * d * 4) as u64).map_err(gpu_err)?)
            } else {
                None
            },
            partials: create_zeroed(&ctx, "attention.partials", partials_bytes.max(4)).map_err(gpu_err)?,
        };
        let _ = kv_dim;

        // Plans.
        let embed_src = embed_own.as_ref().unwrap_or(&lm_head);
        let embed = kernels::embedding::build(&ctx, &ws.step, &ws.ids, embed_src, &ws.hidden, c.block.embedding_scale.unwrap_or(1.0))
            .await
            .map_err(gpu_err)?;
        let mut layers_matvec = Vec::new();
        let mut layers_matmul = Vec::new();
        // The four-token texture matvec exists where the matvec reads textures (CPU adapters).
        let batch_plans = !options.batch_invariant && layers.iter().any(|l| l.qkv.iter().any(|(q, _)| q.tex.is_some()));
        let mut layers_batch = Vec::new();
        for (l, layer) in layers.iter().enumerate() {
            for shape in [Shape::Matvec, Shape::Matmul, Shape::MatvecBatch] {
                if shape == Shape::MatvecBatch && !batch_plans {
                    continue;
                }
                let list = Self::layer_plan(&ctx, &c, &ws, &kv.store, kv_cfg, l, layer, shape).await?;
                match shape {
                    Shape::Matvec => layers_matvec.extend(list),
                    Shape::Matmul => layers_matmul.extend(list),
                    Shape::MatvecBatch => layers_batch.extend(list),
                }
            }
        }
        let batch_max_tokens = if batch_plans { options.batch_max_tokens.unwrap_or(16) } else { 0 };
        let head_gather_batch = if batch_plans {
            Some(
                kernels::linear::build(&ctx, &lm_head, &lin_io(&ws, &ws.hidden, d, Some(&final_norm), &ws.logits, c.vocab_size, false, c.rms_norm_eps, Some(&ws.logit_rows)), Shape::MatvecBatch)
                    .await
                    .map_err(gpu_err)?,
            )
        } else {
            None
        };
        let head_gather = kernels::linear::build(&ctx, &lm_head, &lin_io(&ws, &ws.hidden, d, Some(&final_norm), &ws.logits, c.vocab_size, false, c.rms_norm_eps, Some(&ws.logit_rows)), Shape::Matvec)
            .await
            .map_err(gpu_err)?;
        let head_all = kernels::linear::build(&ctx, &lm_head, &lin_io(&ws, &ws.hidden, d, Some(&final_norm), &ws.logits, c.vocab_size, false, c.rms_norm_eps, None), Shape::Matmul)
            .await
            .map_err(gpu_err)?;
        let argmax = kernels::argmax::build(&ctx, &ws.step, &ws.logits, &ws.argmax, c.vocab_size)
            .await
            .map_err(gpu_err)?;
        let topk = kernels::topk::build(&ctx, &ws.step, &ws.logits, &ws.topk, c.vocab_size, kernels::topk::TOPK_MAX)
            .await
            .map_err(gpu_err)?;
        let readback = Readback::new(&ctx, "logits readback", (r * c.vocab_size.max(2 * kernels::topk::TOPK_MAX) * 4) as u64);
        let plans = Plans {
            embed,
            layers_matvec,
            layers_matmul,
            head_gather,
            layers_batch: batch_plans.then_some(layers_batch),
            head_gather_batch,
            head_all,
            argmax,
            topk,
        };
        // CPU adapters: the blocked matmul already beats one matvec per token at 2 tokens
        // (SmolLM2-135M on lavapipe, layer linears: 1.67 s blocked vs 2 x 1.04 s matvec).
        let matvec_max_tokens = if options.batch_invariant {
            0
        } else if let Some(n) = options.matvec_max_tokens {
            n
        } else if ctx.caps.cpu_like {
            1
        } else {
            4
        };

        // Where the memory went, checked against every allocation made above.
        let mut memory = MemoryReport::default();
        for layer in &layers {
            for (lin, _) in &layer.qkv {
                memory.add_linear(lin);
            }
            for lin in [&layer.o, &layer.gate_up, &layer.down] {
                memory.add_linear(lin);
            }
            memory.add_f32_vector(d);
            memory.add_f32_vector(d);
            for b in [&layer.qk_norm, &layer.attn_out_norm, &layer.mlp_out_norm].into_iter().flatten() {
                memory.add_f32_vector(b.size() as usize / 4);
            }
        }
        memory.add_linear(&lm_head);
        if let Some(e) = &embed_own {
            memory.add_linear(e);
        }
        memory.add_f32_vector(d);
        memory.kv_cache = kv.bytes();
        memory.budget = budget.as_ref().map(|b| b.0);
        memory.budget_source = budget.map(|b| b.1).unwrap_or_else(|| "none (the adapter reports no memory size; set memory_budget)".into());
        memory.kv_pages = kv_cfg.num_pages;
        memory.kv_pages_requested = requested_pages;
        memory.kv_page_size = page_size;
        memory.kv_dtype = options.kv_dtype;
        memory.kv_buffers_per_layer = layout.n_shards;
        memory.workspace = [
            &ws.ids, &ws.positions, &ws.token_seq, &ws.block_table, &ws.logit_rows, &ws.hidden, &ws.qkv, &ws.attn,
            &ws.act, &ws.logits, &ws.argmax, &ws.topk, &ws.rope, &ws.partials,
        ]
        .iter()
        .map(|b| b.size())
        .sum::<u64>()
            + [&ws.rope_local, &ws.branch].into_iter().flatten().map(|b| b.size()).sum::<u64>();
        let allocs = ctx.ledger.since(mark);
        let usage_bytes = |u: crate::gpu::AllocUsage| allocs.iter().filter(|a| a.usage == u).map(|a| a.bytes).sum::<u64>();
        memory.uniforms = usage_bytes(crate::gpu::AllocUsage::Uniform);
        memory.readback = usage_bytes(crate::gpu::AllocUsage::Readback);
        memory.ledger_bytes = allocs.iter().map(|a| a.bytes).sum();
        memory.allocations = allocs.len();
        if let Some(a) = allocs.iter().max_by_key(|a| a.bytes) {
            memory.largest = (a.label.clone(), a.bytes);
        }
        Ok(GpuModel {
            ctx,
            config: c,
            options,
            kv,
            layers,
            lm_head,
            embed_own,
            final_norm,
            ws,
            plans,
            readback,
            memory,
            matvec_max_tokens,
            batch_max_tokens,
            attention_splits,
            logit_rows: r,
            submit_ms_per_dispatch: None,
        })
    }

    /// Whether packed weights get texture copies (CPU adapters' batched matvec, `TOK4`): as
    /// `options.weight_textures` says, by default only while holding the weights twice takes
    /// at most 60% of the memory budget, so that a
    /// large model keeps its room for the KV cache (Qwen2.5-1.5B Q4_K_M on lavapipe's 2 GiB
    /// heap: 1.1 GB of weights, no copies).
    fn weight_textures(ctx: &GpuContext, weights: &ModelWeights, options: &ModelOptions) -> bool {
        if let Some(t) = options.weight_textures {
            return t;
        }
        let packed: u64 = weights.tensors.values().filter(|t| t.dtype.quant_kind().is_some()).map(|t| t.data.len() as u64).sum();
        let adapter = crate::gpu::memory::default_budget(&crate::gpu::memory::adapter_memory(ctx)).map(|(b, _)| b);
        match options.memory_budget.into_iter().chain(adapter).min() {
            Some(budget) => 2 * packed <= budget / 5 * 3,
            None => true,
        }
    }

    /// Pages of KV cache for this load: `requested` (max_seqs full contexts), or fewer when
    /// the budget (the smaller of `memory_budget` and the adapter's figure) leaves less room
    /// after weights, workspace and a reserve; an error when not even one full context fits.
    fn size_kv(
        ctx: &GpuContext,
        c: &ModelConfig,
        options: &ModelOptions,
        context: usize,
        requested: usize,
        weights: u64,
    ) -> Result<(usize, Option<(u64, String)>)> {
        let adapter = crate::gpu::memory::default_budget(&crate::gpu::memory::adapter_memory(ctx));
        let budget = match (options.memory_budget, adapter) {
            (Some(u), Some((a, src))) if a < u => Some((a, format!("adapter: {src}, below memory_budget {u}"))),
            (Some(u), Some(_)) => Some((u, "memory_budget (below the adapter's figure)".to_string())),
            (Some(u), None) => Some((u, "memory_budget".to_string())),
            (None, Some((a, src))) => Some((a, format!("adapter: {src}"))),
            (None, None) => None,
        };
        let Some((b, src)) = budget.clone() else {
            return Ok((requested, None));
        };
        let page_size = options.page_size.max(1);
        let t = options.max_batch_tokens.max(1);
        let workspace = crate::kv::plan::workspace_bytes(c, t, options.max_logit_rows.max(1).min(t), context);
        let reserve = crate::kv::plan::reserve_bytes(b);
        let kv_room = b.saturating_sub(weights + workspace + reserve);
        let per_page = crate::kv::plan::kv_bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, options.kv_dtype) * page_size as u64;
        let fit = (kv_room / per_page.max(1)) as usize;
        let one_context = context.div_ceil(page_size);
        if fit < one_context {
            return Err(LanternError::MemoryBudget {
                budget: b,
                source_of_budget: src,
                weights,
                workspace,
                reserve,
                kv_room,
                what: format!("one sequence of {context} tokens ({:?} KV)", options.kv_dtype),
                needed: one_context as u64 * per_page,
            });
        }
        if fit < requested {
            log::warn!(
                "KV cache: the budget holds {} pages of {page_size} tokens, fewer than the {requested} that {} sequences of {context} tokens would take; requests wait or are refused when it is full",
                fit,
                options.max_seqs
            );
        }
        Ok((fit.min(requested), budget))
    }

    /// Layer `l`'s attention sizes, scale and window.
    fn attention_params(c: &ModelConfig, kv_cfg: KvConfig, l: usize) -> AttentionParams {
        AttentionParams {
            n_heads: c.num_heads as u32,
            n_kv_heads: c.num_kv_heads as u32,
            head_dim: c.head_dim as u32,
            qkv_stride: c.qkv_dim() as u32,
            max_pages: kv_cfg.max_pages_per_seq() as u32,
            out_stride: (c.num_heads * c.head_dim) as u32,
            scale: c.attention_scale(),
            window: c.block.window(l).map_or(0, |w| w as u32),
        }
    }

    #[allow(clippy::too_many_arguments)]
    async fn layer_plan<'a>(
        ctx: &GpuContext,
        c: &ModelConfig,
        ws: &'a Workspace,
        kv: &KvStore,
        kv_cfg: KvConfig,
        l: usize,
        layer: &'a Layer,
        shape: Shape,
    ) -> Result<Vec<Dispatch>> {
        let d = c.hidden_size;
        let hd = c.head_dim;
        let qkv_dim = c.qkv_dim();
        let q_dim = c.num_heads * hd;
        let eps = c.rms_norm_eps;
        let io = |x, x_stride, norm, y, out_stride, residual| lin_io(ws, x, x_stride, norm, y, out_stride, residual, eps, None);
        let mut v = Vec::new();
        for (part, col) in &layer.qkv {
            let mut pio = io(&ws.hidden, d, Some(&layer.in_norm), &ws.qkv, qkv_dim, false);
            pio.out_offset = *col;
            v.extend(kernels::linear::build(ctx, part, &pio, shape).await.map_err(gpu_err)?);
        }
        if let Some(g) = &layer.qk_norm {
            // Every q head, then every k head, of each token's q|k|v row.
            let rows = kernels::rmsnorm::RowLayout { k: hd, rows: c.num_heads + c.num_kv_heads, row_stride: hd, token_stride: qkv_dim, split: c.num_heads };
            v.push(kernels::rmsnorm::build(ctx, &ws.step, &ws.qkv, g, &ws.qkv, rows, eps, kernels::rmsnorm::Mode::InPlace).await.map_err(gpu_err)?);
        }
        let local = c.block.attention(l) == crate::model::LayerAttention::Sliding;
        let rope = ws.rope_local.as_ref().filter(|_| local).unwrap_or(&ws.rope);
        let max_pages = kv_cfg.max_pages_per_seq() as u32;
        let kvb = KvBinding { layout: &kv.layout, k: &kv.k[l], v: &kv.v[l] };
        v.extend(
            kernels::rope_kv::build(
                ctx,
                &RopeKvIo {
                    step: &ws.step,
                    qkv: &ws.qkv,
                    rope,
                    positions: &ws.positions,
                    token_seq: &ws.token_seq,
                    block_table: &ws.block_table,
                    kv: kvb,
                },
                RopeKvParams {
                    n_heads: c.num_heads as u32,
                    n_kv_heads: c.num_kv_heads as u32,
                    head_dim: hd as u32,
                    qkv_stride: qkv_dim as u32,
                    max_pages,
                    n_positions: kv_cfg.context as u32,
                },
            )
            .await
            .map_err(gpu_err)?,
        );
        v.extend(
            kernels::attention::build(
                ctx,
                &AttentionIo {
                    step: &ws.step,
                    qkv: &ws.qkv,
                    positions: &ws.positions,
                    token_seq: &ws.token_seq,
                    block_table: &ws.block_table,
                    kv: kvb,
                    out: &ws.attn,
                    partials: &ws.partials,
                },
                Self::attention_params(c, kv_cfg, l),
            )
            .await
            .map_err(gpu_err)?,
        );
        // A sublayer's output goes into the residual stream directly, or (sandwich norms)
        // through `branch` and its post-norm.
        let post = |out_norm: &'a Option<wgpu::Buffer>| -> Option<(&'a wgpu::Buffer, &'a wgpu::Buffer)> {
            out_norm.as_ref().zip(ws.branch.as_ref())
        };
        let add_normed = async |g: &wgpu::Buffer, b: &wgpu::Buffer| {
            kernels::rmsnorm::build(ctx, &ws.step, b, g, &ws.hidden, kernels::rmsnorm::RowLayout::dense(d), eps, kernels::rmsnorm::Mode::Residual)
                .await
                .map_err(gpu_err)
        };
        match post(&layer.attn_out_norm) {
            Some((g, b)) => {
                v.extend(kernels::linear::build(ctx, &layer.o, &io(&ws.attn, q_dim, None, b, d, false), shape).await.map_err(gpu_err)?);
                v.push(add_normed(g, b).await?);
            }
            None => v.extend(
                kernels::linear::build(ctx, &layer.o, &io(&ws.attn, q_dim, None, &ws.hidden, d, true), shape)
                    .await
                    .map_err(gpu_err)?,
            ),
        }
        v.extend(
            kernels::linear::build(
                ctx,
                &layer.gate_up,
                &io(&ws.hidden, d, Some(&layer.post_norm), &ws.act, c.intermediate_size, false),
                shape,
            )
            .await
            .map_err(gpu_err)?,
        );
        match post(&layer.mlp_out_norm) {
            Some((g, b)) => {
                v.extend(kernels::linear::build(ctx, &layer.down, &io(&ws.act, c.intermediate_size, None, b, d, false), shape).await.map_err(gpu_err)?);
                v.push(add_normed(g, b).await?);
            }
            None => v.extend(
                kernels::linear::build(ctx, &layer.down, &io(&ws.act, c.intermediate_size, None, &ws.hidden, d, true), shape)
                    .await
                    .map_err(gpu_err)?,
            ),
        }
        Ok(v)
    }

    /// Where the GPU memory of this model went (weights by dtype with scales, KV cache,
    /// workspace, uniforms, readback), and what the allocation ledger saw.
    pub fn memory(&self) -> &MemoryReport {
        &self.memory
    }

    /// Bytes of weights on the GPU (values or codes, scales, norms, biases).
    pub fn weight_bytes(&self) -> u64 {
        self.memory.weight_bytes()
    }

    /// Dispatches recorded for one decode step (one token of one sequence).
    /// (one token of one sequence, a short context: no key splits).
    pub fn dispatches_per_decode_step(&self) -> usize {
        let s = StepUniform::new(1, 1);
        self.plans.embed.iter().chain(&self.plans.layers_matvec).chain(&self.plans.head_gather).filter(|d| d.runs(&s)).count() + 1
    }

    /// Dispatches recorded for one prefill step (of `max_batch_tokens` tokens).
    pub fn dispatches_per_prefill_step(&self) -> usize {
        let s = StepUniform::new(self.options.max_batch_tokens.max(1) as u32, 1);
        self.plans.embed.iter().chain(&self.plans.layers_matmul).chain(&self.plans.head_gather).filter(|d| d.runs(&s)).count() + 1
    }

    /// Run one step of each plan shape (decode; the batched and the matmul prefill), with
    /// argmax and top-k readback, on a scratch sequence that is released afterwards: drivers
    /// that compile a shader at its first dispatch (llvmpipe) and first touches of weight
    /// memory then happen here, at load time, and not inside a host's frame. Returns the
    /// milliseconds it took.
    pub async fn warm_up(&mut self) -> Result<f64> {
        let t0 = web_time::Instant::now();
        let context = self.kv.alloc.config.context;
        let mut sizes = vec![1usize, self.matvec_max_tokens + 1, self.batch_max_tokens.max(self.matvec_max_tokens) + 1];
        sizes.dedup();
        sizes.retain(|&n| n <= self.options.max_batch_tokens);
        let seq = self.new_sequence()?;
        let mut run = async || -> Result<()> {
            let mut used = 0;
            for (i, &n) in sizes.iter().enumerate() {
                if used + n + 1 > context {
                    break;
                }
                self.forward(seq, &vec![0u32; n], Want::Argmax).await?;
                used += n;
                if i == 0 {
                    self.forward(seq, &[0u32], Want::TopK).await?;
                    used += 1;
                }
            }
            Ok(())
        };
        let r = run().await;
        self.release_sequence(seq);
        r.map(|_| t0.elapsed().as_secs_f64() * 1e3)
    }

    /// Start a new sequence in the KV cache.
    pub fn new_sequence(&mut self) -> Result<usize> {
        self.kv.alloc.create().map_err(LanternError::Kv)
    }

    /// End a sequence, freeing its pages (full pages registered in the prefix cache stay
    /// there, evictable, until memory is needed).
    pub fn release_sequence(&mut self, seq: usize) {
        self.kv.alloc.release(seq);
    }

    /// A new sequence sharing every page of `seq` (parallel samples of one prompt); the
    /// partial last page is copied when either writes to it.
    pub fn fork_sequence(&mut self, seq: usize) -> Result<usize> {
        self.kv.alloc.fork(seq).map_err(LanternError::Kv)
    }

    /// Attach the longest cached prefix of `prompt` (whole pages, never the whole prompt) to
    /// the empty sequence `seq`; returns the tokens that need no computing.
    pub fn attach_cached_prefix(&mut self, seq: usize, prompt: &[u32]) -> Result<usize> {
        self.kv.alloc.match_prefix(seq, prompt).map_err(LanternError::Kv)
    }

    /// Offer the full pages of `tokens` (positions 0.. of `seq`) to the prefix cache.
    pub fn cache_prefix(&mut self, seq: usize, tokens: &[u32]) -> Result<usize> {
        self.kv.alloc.register_prefix(seq, tokens).map_err(LanternError::Kv)
    }

    /// Record the copy-on-write page copies the allocator queued (before the step's
    /// dispatches, so the new tokens land on the copies).
    fn encode_pending_copies(&mut self, enc: &mut wgpu::CommandEncoder) {
        for c in self.kv.alloc.take_copies() {
            self.kv.store.encode_page_copy(enc, c.src as usize, c.dst as usize, c.tokens);
        }
    }

    /// Tokens stored for a sequence.
    pub fn sequence_len(&self, seq: usize) -> Result<usize> {
        self.kv.alloc.len(seq).map_err(LanternError::Kv)
    }

    /// Append `tokens` to sequence `seq`, running as many steps as the batch limit needs,
    /// and return the argmax (and logits, if asked) of the last token.
    pub async fn forward(&mut self, seq: usize, tokens: &[u32], want: Want) -> Result<StepOutput> {
        if tokens.is_empty() {
            return Err(LanternError::Other("forward called with no tokens".into()));
        }
        let chunk = self.options.max_batch_tokens.max(1);
        let mut outs = self.run_chunks(seq, tokens, chunk, want, false).await?;
        Ok(outs.pop().unwrap_or_default())
    }

    /// Append `tokens` to `seq` and return the logits of every position (`tokens x vocab`),
    /// for evaluation (perplexity) and reference comparisons.
    pub async fn forward_all_logits(&mut self, seq: usize, tokens: &[u32]) -> Result<Vec<f32>> {
        if tokens.is_empty() {
            return Ok(Vec::new());
        }
        let chunk = self.logit_rows;
        let outs = self.run_chunks(seq, tokens, chunk, Want::Logits, true).await?;
        Ok(outs.into_iter().flat_map(|o| o.logits.unwrap_or_default()).collect())
    }

    /// Append `tokens` to `seq` in steps of at most `chunk` tokens. With `every_row` each
    /// step returns all its rows' outputs, else only the last step returns its last row.
    /// Pages are reserved up front (a full cache is reported before any work) and released
    /// again if a step fails, so the sequence is left as it was.
    async fn run_chunks(&mut self, seq: usize, tokens: &[u32], chunk: usize, want: Want, every_row: bool) -> Result<Vec<StepOutput>> {
        self.check_ids(tokens)?;
        let start = self.kv.alloc.append(seq, tokens.len()).map_err(LanternError::Kv)?;
        let n_chunks = tokens.len().div_ceil(chunk);
        let mut outs = Vec::with_capacity(if every_row { n_chunks } else { 1 });
        for (ci, part) in tokens.chunks(chunk).enumerate() {
            let rows: Vec<u32> = if every_row {
                (0..part.len() as u32).collect()
            } else if ci + 1 == n_chunks {
                vec![(part.len() - 1) as u32]
            } else {
                vec![]
            };
            match self.step(seq, part, start + ci * chunk, &rows, want, every_row).await {
                Ok(o) => {
                    if !rows.is_empty() {
                        outs.push(o);
                    }
                }
                Err(e) => {
                    let _ = self.kv.alloc.truncate(seq, start);
                    return Err(e);
                }
            }
        }
        Ok(outs)
    }

    /// Write one step's inputs: the step uniform, token ids, positions, sequence of each
    /// token, the block table and the rows whose logits are wanted.
    fn write_step_inputs(&self, seq: usize, part: &[u32], pos0: usize, rows: &[u32]) -> StepUniform {
        let n = part.len() as u32;
        let positions: Vec<u32> = (0..n).map(|i| pos0 as u32 + i).collect();
        let seqs = vec![seq as u32; part.len()];
        self.write_batch_inputs(part, &positions, &seqs, rows)
    }

    /// [`Self::write_step_inputs`] for tokens of any sequences: id, position and sequence per
    /// token.
    fn write_batch_inputs(&self, ids: &[u32], positions: &[u32], seqs: &[u32], rows: &[u32]) -> StepUniform {
        let q = &self.ctx.queue;
        let n = ids.len() as u32;
        let max_keys = positions.iter().map(|&p| p as usize + 1).max().unwrap_or(1);
        let mut step = StepUniform::new(n, rows.len() as u32);
        step.n_splits = self.splits_for(ids.len(), max_keys) as u32;
        q.write_buffer(&self.ws.step, 0, bytemuck::bytes_of(&step));
        q.write_buffer(&self.ws.ids, 0, bytemuck::cast_slice(ids));
        q.write_buffer(&self.ws.positions, 0, bytemuck::cast_slice(positions));
        q.write_buffer(&self.ws.token_seq, 0, bytemuck::cast_slice(seqs));
        q.write_buffer(&self.ws.block_table, 0, bytemuck::cast_slice(&self.kv.alloc.block_table()));
        if !rows.is_empty() {
            q.write_buffer(&self.ws.logit_rows, 0, bytemuck::cast_slice(rows));
        }
        step
    }

    /// Key splits for a step of `n_tokens` whose longest sequence has `max_keys` keys: one
    /// per `attention_split_keys` keys, up to `attention_splits`, in decode-sized steps only.
    fn splits_for(&self, n_tokens: usize, max_keys: usize) -> usize {
        if n_tokens > SPLIT_MAX_TOKENS {
            return 1;
        }
        max_keys.div_ceil(self.options.attention_split_keys.max(1)).clamp(1, self.attention_splits)
    }

    /// The layer dispatches for a step of `n` tokens: matvec for decode-sized steps, matmul
    /// otherwise.
    fn layer_plan_for(&self, n: usize) -> &[Dispatch] {
        if n <= self.matvec_max_tokens {
            &self.plans.layers_matvec
        } else if n <= self.batch_max_tokens {
            self.plans.layers_batch.as_deref().unwrap_or(&self.plans.layers_matmul)
        } else {
            &self.plans.layers_matmul
        }
    }

    fn check_ids(&self, tokens: &[u32]) -> Result<()> {
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= self.config.vocab_size) {
            return Err(LanternError::Other(format!(
                "token id {bad} is outside the vocabulary (size {})",
                self.config.vocab_size
            )));
        }
        Ok(())
    }

    /// One step: `part` tokens of `seq` at positions `pos0..`, logits for `rows` (indices
    /// into `part`). Pages must already be reserved.
    async fn step(&mut self, seq: usize, part: &[u32], pos0: usize, rows: &[u32], want: Want, all_rows: bool) -> Result<StepOutput> {
        let s = self.write_step_inputs(seq, part, pos0, rows);
        self.run_step(s, want, all_rows).await
    }

    /// One step over tokens of several sequences (continuous batching): `ids[i]` at
    /// `positions[i]` of sequence `seqs[i]`, whose pages must already be reserved
    /// (`kv.alloc.append`); argmax (and logits with `Want::Logits`) of the tokens at indices
    /// `rows`. At most `options.max_batch_tokens` tokens and `logit_rows` rows.
    fn validate_batch(&self, ids: &[u32], positions: &[u32], seqs: &[u32], rows: &[u32]) -> Result<()> {
        let bad = |m: String| Err(LanternError::Other(m));
        if ids.is_empty() || ids.len() != positions.len() || ids.len() != seqs.len() {
            return bad(format!("step_batch: {} ids, {} positions, {} sequence indices", ids.len(), positions.len(), seqs.len()));
        }
        if ids.len() > self.options.max_batch_tokens.max(1) || rows.len() > self.logit_rows {
            return bad(format!(
                "step_batch: {} tokens and {} logit rows exceed the step's {} tokens / {} rows",
                ids.len(),
                rows.len(),
                self.options.max_batch_tokens,
                self.logit_rows
            ));
        }
        if let Some(&r) = rows.iter().find(|&&r| r as usize >= ids.len()) {
            return bad(format!("step_batch: logit row {r} outside the step's {} tokens", ids.len()));
        }
        self.check_ids(ids)?;
        for (&s, &p) in seqs.iter().zip(positions) {
            let len = self.kv.alloc.len(s as usize).map_err(LanternError::Kv)?;
            if p as usize >= len {
                return bad(format!("step_batch: position {p} of sequence {s}, which has room for {len} tokens (reserve pages first)"));
            }
        }
        Ok(())
    }

    pub async fn step_batch(&mut self, ids: &[u32], positions: &[u32], seqs: &[u32], rows: &[u32], want: Want) -> Result<StepOutput> {
        self.validate_batch(ids, positions, seqs, rows)?;
        let s = self.write_batch_inputs(ids, positions, seqs, rows);
        self.run_step(s, want, false).await
    }

    async fn run_step(&mut self, s: StepUniform, want: Want, all_rows: bool) -> Result<StepOutput> {
        let ctx = self.ctx.clone();
        ctx.check_lost().map_err(LanternError::Gpu)?;
        let r = self.run_step_inner(s, want, all_rows).await;
        // Whatever failed on a lost device, the loss is the error to report.
        match (r, ctx.check_lost()) {
            (Err(_), Err(lost)) => Err(LanternError::Gpu(lost)),
            (r, _) => r,
        }
    }

    /// The dispatches of a step, in order.
    fn step_dispatches(&self, s: &StepUniform, want: Want, all_rows: bool) -> Vec<&Dispatch> {
        let mut v: Vec<&Dispatch> = self.plans.embed.iter().chain(self.layer_plan_for(s.n_tokens as usize)).collect();
        if s.n_out > 0 {
            let head = if all_rows {
                &self.plans.head_all
            } else if s.n_out > 1 && self.plans.head_gather_batch.is_some() {
                self.plans.head_gather_batch.as_deref().unwrap_or(&self.plans.head_gather)
            } else {
                &self.plans.head_gather
            };
            v.extend(head.iter());
            v.push(&self.plans.argmax);
            if want == Want::TopK {
                v.push(&self.plans.topk);
            }
        }
        v
    }

    /// What a step reads back: (source buffer, bytes).
    fn readback_source(&self, n_out: u32, want: Want) -> (&wgpu::Buffer, u64) {
        let n = n_out as u64;
        match want {
            Want::Logits => (&self.ws.logits, n * self.config.vocab_size as u64 * 4),
            Want::TopK => (&self.ws.topk, n * (kernels::topk::TOPK_MAX * 2) as u64 * 4),
            Want::Argmax => (&self.ws.argmax, n * 4),
        }
    }

    /// The step's output from the bytes read back.
    fn parse_output(&self, bytes: &[u8], n_out: u32, want: Want) -> StepOutput {
        if n_out == 0 {
            return StepOutput::default();
        }
        match want {
            Want::Logits => {
                let logits: Vec<f32> = bytemuck::cast_slice(bytes).to_vec();
                let argmax = logits.chunks_exact(self.config.vocab_size).map(crate::engine::sampler::argmax).collect();
                StepOutput { argmax, logits: Some(logits), top: None }
            }
            Want::TopK => {
                let words: &[u32] = bytemuck::cast_slice(bytes);
                let top: Vec<Vec<(u32, f32)>> = words
                    .chunks_exact(kernels::topk::TOPK_MAX * 2)
                    .map(|w| kernels::topk::decode_row(w, kernels::topk::TOPK_MAX))
                    .collect();
                // The best pair is the argmax (same order: value, then lower id).
                let argmax = top.iter().map(|t| t.first().map_or(0, |p| p.0)).collect();
                StepOutput { argmax, logits: None, top: Some(top) }
            }
            Want::Argmax => StepOutput { argmax: bytemuck::cast_slice(bytes).to_vec(), logits: None, top: None },
        }
    }

    async fn run_step_inner(&mut self, s: StepUniform, want: Want, all_rows: bool) -> Result<StepOutput> {
        let ctx = self.ctx.clone();
        let scope = ctx.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let mut enc = ctx.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("step") });
        self.encode_pending_copies(&mut enc);
        {
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some("forward"),
                timestamp_writes: None,
            });
            for d in self.step_dispatches(&s, want, all_rows) {
                d.encode(&mut pass, &s);
            }
        }
        let (src, bytes) = self.readback_source(s.n_out, want);
        if s.n_out > 0 {
            self.readback.copy_from(&mut enc, src, 0, bytes);
        }
        ctx.queue.submit([enc.finish()]);
        if let Some(e) = scope.pop().await {
            return Err(LanternError::Gpu(GpuError::Validation {
                context: "forward step".into(),
                message: e.to_string(),
            }));
        }
        if s.n_out == 0 {
            return Ok(StepOutput::default());
        }
        let data = self.readback.read(&ctx, bytes).await.map_err(gpu_err)?;
        Ok(self.parse_output(&data[..bytes as usize], s.n_out, want))
    }

    /// Start a step of tokens of several sequences without running it (the frame-budgeted
    /// path): inputs are written and page copies submitted; [`Self::advance`] then submits
    /// its dispatches a few at a time and collects the result without ever waiting.
    pub fn begin_step_batch(&mut self, ids: &[u32], positions: &[u32], seqs: &[u32], rows: &[u32], want: Want) -> Result<PendingStep> {
        self.ctx.check_lost().map_err(LanternError::Gpu)?;
        self.validate_batch(ids, positions, seqs, rows)?;
        let s = self.write_batch_inputs(ids, positions, seqs, rows);
        let mut enc = self.ctx.device.create_command_encoder(&Default::default());
        self.encode_pending_copies(&mut enc);
        self.ctx.queue.submit([enc.finish()]);
        Ok(PendingStep { s, want, next: 0, mapping: None, submissions: 0 })
    }

    /// Submit more of `p`'s dispatches until `deadline` or `max_dispatches` (at least one
    /// dispatch per call; submissions of at most [`DISPATCHES_PER_SUBMIT`], fewer when the
    /// measured cost per dispatch says more would pass the deadline), then its readback,
    /// then check without waiting whether the result has arrived: `Some` once it has. Never
    /// blocks on the GPU.
    pub async fn advance(&mut self, p: &mut PendingStep, deadline: web_time::Instant, max_dispatches: usize) -> Result<Option<StepOutput>> {
        let ctx = self.ctx.clone();
        ctx.check_lost().map_err(LanternError::Gpu)?;
        let dispatches = self.step_dispatches(&p.s, p.want, false);
        let total = dispatches.len();
        let mut this_call = 0;
        let mut cost = self.submit_ms_per_dispatch;
        while p.next < total && this_call < max_dispatches.max(1) {
            let now = web_time::Instant::now();
            if this_call > 0 && now >= deadline {
                break;
            }
            // As many dispatches as the measured cost says fit in what is left of the
            // budget (at least one per call, so a step always progresses).
            let left_ms = deadline.saturating_duration_since(now).as_secs_f64() * 1e3;
            let fit = match cost {
                Some(c) if c > 0.0 => ((left_ms / c).floor() as usize).clamp(1, DISPATCHES_PER_SUBMIT),
                _ => 1,
            };
            let n = fit.min(max_dispatches.max(1) - this_call).min(total - p.next).max(1);
            let scope = ctx.device.push_error_scope(wgpu::ErrorFilter::Validation);
            let mut enc = ctx.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("step part") });
            let end = p.next + n;
            {
                let mut pass = enc.begin_compute_pass(&Default::default());
                for d in &dispatches[p.next..end] {
                    d.encode(&mut pass, &p.s);
                }
            }
            if end == total && p.s.n_out > 0 {
                let (src, bytes) = self.readback_source(p.s.n_out, p.want);
                self.readback.copy_from(&mut enc, src, 0, bytes);
            }
            ctx.queue.submit([enc.finish()]);
            if let Some(e) = scope.pop().await {
                return Err(LanternError::Gpu(GpuError::Validation { context: "forward step".into(), message: e.to_string() }));
            }
            // What one dispatch costs the caller here (encoding and submitting; on CPU
            // adapters the work itself runs inside submit): a moving average over the
            // submissions after a call's first, since the first also waits for whatever the
            // host queued before the call (its own frame), which more dispatches do not add.
            if this_call > 0 || cost.is_none() {
                let per = now.elapsed().as_secs_f64() * 1e3 / n as f64;
                cost = Some(match cost {
                    Some(c) => 0.7 * c + 0.3 * per,
                    None => per,
                });
            }
            p.next = end;
            p.submissions += 1;
            this_call += n;
        }
        self.submit_ms_per_dispatch = cost;
        if p.next < total {
            return Ok(None);
        }
        if p.s.n_out == 0 {
            return Ok(Some(StepOutput::default()));
        }
        let (_, bytes) = self.readback_source(p.s.n_out, p.want);
        if p.mapping.is_none() {
            p.mapping = Some(self.readback.start_map(bytes));
        }
        // Let the device make progress and deliver the map callback, without waiting.
        #[cfg(not(target_arch = "wasm32"))]
        let _ = ctx.device.poll(wgpu::PollType::Poll);
        match p.mapping.as_mut().map(|rx| rx.try_recv()) {
            Some(Ok(Some(r))) => r.map_err(|e| LanternError::Gpu(GpuError::Readback(e.to_string())))?,
            Some(Ok(None)) => return Ok(None),
            _ => return Err(LanternError::Gpu(GpuError::Readback("map callback dropped (device lost?)".into()))),
        }
        let data = self.readback.take_mapped(bytes).map_err(gpu_err)?;
        Ok(Some(self.parse_output(&data[..bytes as usize], p.s.n_out, p.want)))
    }

    /// Time every dispatch of one step separately (one submission and wait per dispatch):
    /// wall-clock milliseconds per dispatch label, summed over layers. Appends `tokens` to
    /// `seq` like `forward`. For profiling only: it is much slower than a real step.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn profile_step(&mut self, seq: usize, tokens: &[u32]) -> Result<Vec<(String, f64, usize)>> {
        self.check_ids(tokens)?;
        let start = self.kv.alloc.append(seq, tokens.len()).map_err(LanternError::Kv)?;
        let n = tokens.len() as u32;
        let s = self.write_step_inputs(seq, tokens, start, &[n - 1]);
        let ctx = self.ctx.clone();
        let mut enc = ctx.device.create_command_encoder(&Default::default());
        self.encode_pending_copies(&mut enc);
        ctx.queue.submit([enc.finish()]);
        let layers = self.layer_plan_for(tokens.len());
        let all: Vec<&Dispatch> = self
            .plans
            .embed
            .iter()
            .chain(layers.iter())
            .chain(self.plans.head_gather.iter())
            .chain(std::iter::once(&self.plans.argmax))
            .collect();
        let _ = ctx.device.poll(wgpu::PollType::wait_indefinitely());
        let mut acc: Vec<(String, f64, usize)> = Vec::new();
        for d in all {
            let t0 = web_time::Instant::now();
            let mut enc = ctx.device.create_command_encoder(&Default::default());
            {
                let mut pass = enc.begin_compute_pass(&Default::default());
                d.encode(&mut pass, &s);
            }
            ctx.queue.submit([enc.finish()]);
            let _ = ctx.device.poll(wgpu::PollType::wait_indefinitely());
            let ms = t0.elapsed().as_secs_f64() * 1e3;
            // Group by kernel variant and weight name without the layer index.
            let key = d
                .label
                .split_whitespace()
                .map(|w| {
                    w.split('.')
                        .filter(|p| p.parse::<usize>().is_err() && *p != "model" && *p != "layers")
                        .collect::<Vec<_>>()
                        .join(".")
                })
                .collect::<Vec<_>>()
                .join(" ");
            match acc.iter_mut().find(|e| e.0 == key) {
                Some(e) => {
                    e.1 += ms;
                    e.2 += 1;
                }
                None => acc.push((key, ms, 1)),
            }
        }
        Ok(acc)
    }

    /// The KV error of trying to add `n` tokens to `seq`, if it would fail.
    pub fn check_fits(&self, seq: usize, n: usize) -> std::result::Result<(), KvError> {
        let needed = self.kv.alloc.pages_needed(seq, n)?;
        if needed > self.kv.alloc.free_pages() {
            return Err(KvError::Full {
                needed,
                free: self.kv.alloc.free_pages(),
                total: self.kv.alloc.config.num_pages,
                page_size: self.kv.alloc.config.page_size,
            });
        }
        Ok(())
    }
}

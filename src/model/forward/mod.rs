//! The forward pass on the GPU of every supported family (`model::config::Arch`: Llama 1/2/3,
//! SmolLM2, Mistral, Qwen2 with q/k/v biases, Qwen3, Phi-3, Gemma 3, and the mixtures of
//! experts Qwen3-MoE, Mixtral and OLMoE), one decoder block whose differences are data
//! (`BlockSpec`: norm placement, q/k norms, activation, embedding scale, sliding windows,
//! experts), mirroring Hugging Face transformers' `modeling_llama.py`
//! (https://github.com/huggingface/transformers) and the paper "LLaMA: Open and Efficient
//! Foundation Language Models" (arXiv:2302.13971); the Llama block is shown below.
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
//! after: 6 L + 3 dispatches per step, all recorded into one command submission. A mixture of
//! experts replaces 5 and 6 with the router, the route and the chosen experts' gate|up and
//! down (`kernels::moe`; prefill groups the pairs by expert first).

//! The code is split by job: `options` (what a caller chooses), `upload` (weights onto the
//! GPU), `memory` (accounting and the KV budget), `plan` (workspace and recorded
//! dispatches), `step` (sequences and step execution), `ahead` (decode steps run ahead of the
//! host), `pooled` (text embeddings).

use std::sync::Arc;

use crate::gpu::buffer::Readback;
use crate::gpu::{GpuContext, GpuError};
use crate::kernels::linear::GpuLinear;
use crate::kernels::{self, StepUniform};
use crate::kv::cache::{KvCache, KvLayout, KvStore};
use crate::kv::plan::KvDtype;
use crate::kv::{KvConfig, PageAllocator};
use crate::model::{ModelConfig, ModelWeights};

use crate::{LanternError, Result};
use plan::{Plans, Workspace};
use step::SPLIT_MAX_TOKENS;

mod ahead;
mod memory;
mod options;
mod plan;
mod pooled;
mod step;
mod upload;

pub use ahead::AheadToken;
pub(crate) use ahead::{BatchFlight, BatchSampling};
pub use memory::{DtypeBytes, MemoryReport};
pub use options::{KvWindow, ModelOptions, StepOutput, Want, WeightPrecision};
pub use pooled::{l2_normalized, Pooling};
pub use step::{LogitOps, MaskFn, PendingStep, DISPATCHES_PER_SUBMIT};

/// What a streamed load ([`GpuModel::load_streamed`]) asks its source for next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Part {
    /// Layer `l`'s tensors.
    Layer(usize),
    /// The final norm and any other global tensor, without the embedding table and the
    /// head (`model::gguf::STREAMED_MATRICES`), which come by [`Part::Rows`].
    Globals,
    /// Rows `start..end` of the 2-D tensor `tensor` (a Hugging Face name), as a
    /// [`ModelWeights`] holding just that slice under that name (shape `[end - start, cols]`).
    Rows { tensor: String, start: usize, end: usize },
}

struct Layer {
    /// q|k|v: one projection, or runs of parts stored alike, each with the first qkv column
    /// it writes.
    qkv: Vec<(GpuLinear, usize)>,
    o: GpuLinear,
    /// The MLP's gate|up (one gated layer) and down: dense, or with `experts` every expert's
    /// stacked by rows (expert e's rows from `e * rows`).
    gate_up: GpuLinear,
    down: GpuLinear,
    experts: Option<Experts>,
    /// The attention input's norm (folded into the q|k|v projection).
    in_norm: wgpu::Buffer,
    /// The MLP input's norm (folded into gate/up).
    post_norm: wgpu::Buffer,
    /// q norm | k norm, applied in place to each head (2 head_dim floats) or to the whole q and
    /// k projections (OLMoE: q_dim + kv_dim floats).
    qk_norm: Option<wgpu::Buffer>,
    /// Sandwich norms of the attention and MLP outputs, applied as they are added into the
    /// residual stream.
    attn_out_norm: Option<wgpu::Buffer>,
    mlp_out_norm: Option<wgpu::Buffer>,
}

/// A mixture of experts' router and shape (`kernels::moe`); its experts' gate|up and down
/// are the layer's, stacked by rows.
struct Experts {
    /// `[experts, hidden]`: the router logits' linear layer.
    router: GpuLinear,
    spec: crate::model::config::MoeSpec,
}

/// A model resident on the GPU with its KV cache.
pub struct GpuModel {
    pub ctx: Arc<GpuContext>,
    pub config: ModelConfig,
    pub options: ModelOptions,
    pub kv: KvCache,
    // Weights stay owned here for the model's lifetime (the plans' bind groups use them).
    weights: upload::GpuWeights,
    ws: Workspace,
    plans: Plans,
    readback: Readback,
    memory: MemoryReport,
    /// Measured milliseconds one dispatch costs the caller on the frame-budgeted path.
    submit_ms_per_dispatch: Option<f64>,
    /// Steps where the matvec path runs (n_tokens at or below this).
    pub matvec_max_tokens: usize,
    /// Steps above `matvec_max_tokens` and up to this use the four-token packed matvec
    /// (CPU adapters: 16; GPUs: 4; 0 where there is none).
    pub batch_max_tokens: usize,
    /// Most key splits per token in a decode step's attention.
    pub attention_splits: usize,
    /// Rows of logits one step can produce (`max_logit_rows` within the binding limit).
    pub logit_rows: usize,
    /// Measured milliseconds of one sequence's steps by width (tokens), averaged: what a
    /// speculative verify step of each width costs here, learned across requests.
    step_ms: Vec<Option<f64>>,
    /// What speculative decoding learned here across requests (see [`DraftMemory`]).
    pub draft_memory: DraftMemory,
    /// The run ahead in progress (`ahead.rs`), and its readback slots (one per step in
    /// flight; none where runs ahead are off).
    ahead: Option<ahead::Ahead>,
    ahead_slots: Vec<Readback>,
    /// The engine's batched decode steps ahead: their readback slots (none where runs ahead
    /// are off), the next one to use, and which hold a step not yet landed.
    batch_slots: Vec<Readback>,
    next_batch_slot: usize,
    batch_unlanded: Vec<bool>,
    /// The final norm's weight on the host and the readback of a step's hidden states, made
    /// at the first embedding (`pooled.rs`).
    final_norm_host: Option<Vec<f32>>,
    hidden_readback: Option<Readback>,
    /// Leading rows of `ws.row_draws` that hold a draw (the rest hold the argmax).
    row_draws_set: usize,
}

/// What speculative decoding learned on a model across requests, so a new request starts
/// from it instead of from a blind prior: on a draft model, the measured milliseconds of
/// drafting k tokens (index k) and the decayed counts of its accepted drafts and of trials;
/// on a target, the same counts for prompt lookup's drafts (whose cost is nil). The engine's
/// `DraftLength` reads it at a request's start and writes it back after each step.
#[derive(Debug, Clone, Default)]
pub struct DraftMemory {
    pub draft_ms: Vec<Option<f64>>,
    pub accepts: f64,
    pub trials: f64,
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
        let mark = ctx.ledger.mark();
        let textures = Self::weight_textures(&options);
        let w = upload::upload_weights(&ctx, weights, options.weights, textures, progress)?;
        Self::finish_load(ctx, weights.config.clone(), options, mark, w).await
    }

    /// [`GpuModel::load_with_progress`] without the whole model in host memory: `fetch(Part::Layer(l))`
    /// yields layer `l`'s tensors, `fetch(Part::Globals)` the final norm, and the embedding
    /// table and head come a slice of rows at a time (`fetch(Part::Rows { .. })`,
    /// [`ModelOptions::stream_slice_bytes`] each), each a [`ModelWeights`] holding just those, under Hugging Face names. Each part
    /// is uploaded and dropped before the next is asked for, so host memory holds about one
    /// layer or one slice. Native GGUF files and browser `Blob`s load this way.
    pub async fn load_streamed(
        ctx: Arc<GpuContext>,
        config: ModelConfig,
        options: ModelOptions,
        fetch: &mut impl AsyncFnMut(Part) -> Result<ModelWeights>,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<GpuModel> {
        let mark = ctx.ledger.mark();
        let textures = Self::weight_textures(&options);
        let keep = options.weights;
        let mut layers = Vec::with_capacity(config.num_layers);
        for l in 0..config.num_layers {
            let part = fetch(Part::Layer(l)).await?;
            layers.push(upload::upload_layer(&ctx, &part, l, keep, textures)?);
            drop(part);
            ctx.queue.submit(std::iter::empty());
            progress(l + 1, config.num_layers);
        }
        let part = fetch(Part::Globals).await?;
        let (lm_head, embed_own, final_norm) =
            upload::upload_globals_streamed(&ctx, &part, keep, textures, options.stream_slice_bytes, fetch).await?;
        drop(part);
        let w = upload::GpuWeights { layers, lm_head, embed_own, final_norm };
        Self::finish_load(ctx, config, options, mark, w).await
    }

    /// The KV cache, workspace, plans and memory report of a load whose weights are up.
    async fn finish_load(
        ctx: Arc<GpuContext>,
        c: ModelConfig,
        options: ModelOptions,
        mark: usize,
        w: upload::GpuWeights,
    ) -> Result<GpuModel> {
        let hd = c.head_dim;

        // KV cache.
        let context = options.context.unwrap_or(c.max_position_embeddings.min(2048)).max(1);
        let page_size = options.page_size.max(1);
        let max_seqs = options.max_seqs.max(1);
        let requested_pages = options.kv_pages.unwrap_or(max_seqs * context.div_ceil(page_size)).max(1);
        let weights_bytes: u64 = ctx.ledger.since(mark).iter().map(|a| a.bytes).sum();
        // Sliding layers keep a ring of their window's pages per sequence where that saves
        // memory (`kv::ring`); the other layers keep the pool's pages.
        let ring = options.kv_window.ring(
            c.block.sliding_window.filter(|_| c.sliding_layers() > 0),
            context,
            options.max_batch_tokens.max(1),
            page_size,
        );
        let ringed: Vec<bool> = (0..c.num_layers).map(|l| ring.is_some() && c.block.window(l).is_some()).collect();
        // CPU adapters' prefill reads the linear inputs from texture copies when the weights
        // are tiled textures (`kernels::x_texture`).
        let tiled =
            w.layers.iter().any(|l| l.gate_up.is_tiled() || l.down.is_tiled() || l.o.is_tiled() || l.qkv.iter().any(|q| q.0.is_tiled()));
        let x_tex = tiled && plan::x_textures_fit(&ctx, &c, &options);
        let x_tex_bytes = if x_tex { plan::x_texture_bytes(&c, &options) } else { 0 };
        let (num_pages, budget) = Self::size_kv(&ctx, &c, &options, context, requested_pages, weights_bytes, x_tex_bytes, ring.as_ref())?;
        let kv_cfg = KvConfig { page_size, num_pages, max_seqs, context };
        let layout = KvLayout::new(options.kv_dtype, kv_cfg.page_size, c.num_kv_heads, hd, kv_cfg.num_pages, max_seqs, ctx.max_binding())
            .map_err(gpu_err)?;
        let ring_layout = ring
            .as_ref()
            .map(|r| KvLayout::rings(options.kv_dtype, r, max_seqs, c.num_kv_heads, hd, ctx.max_binding()))
            .transpose()
            .map_err(gpu_err)?;
        // The cache is the big allocation: one the driver cannot honour is found here, at
        // load, not mid-generation.
        let oom = ctx.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let store = KvStore::with_rings(&ctx, layout, ring_layout, &ringed).map_err(gpu_err)?;
        if let Some(e) = oom.pop().await {
            return Err(LanternError::Gpu(GpuError::Allocation {
                what: format!("the KV cache ({} pages of {} tokens)", kv_cfg.num_pages, page_size),
                bytes: store.bytes(),
                reason: e.to_string(),
            }));
        }
        let alloc = PageAllocator::new(kv_cfg);
        let alloc = if options.kv_dtype == KvDtype::Q4 { alloc.with_tails() } else { alloc };
        let kv = KvCache {
            alloc: match ring {
                Some(r) => alloc.with_ring(r),
                None => alloc,
            },
            store,
        };
        // Batch invariance: a token's key splits must not depend on the step it is in.
        let attention_splits =
            if options.batch_invariant { 1 } else { options.attention_splits.unwrap_or(if ctx.caps.cpu_like { 1 } else { 16 }).max(1) };
        let attn_p = Self::attention_params(&c, kv_cfg, 0);
        let t_max = options.max_batch_tokens.max(1);
        // The partial results of the layout with the most shards (pool or ring).
        let widest = ring_layout.filter(|r| r.n_shards > layout.n_shards).unwrap_or(layout);
        let partials_bytes = kernels::attention::partials_bytes(&attn_p, &widest, t_max, 1).max(kernels::attention::partials_bytes(
            &attn_p,
            &widest,
            t_max.min(SPLIT_MAX_TOKENS),
            attention_splits,
        ));

        let (ws, r) = plan::Workspace::new(&ctx, &c, &options, kv_cfg, context, partials_bytes, x_tex)?;
        let (plans, batch_max_tokens) = plan::build_plans(&ctx, &c, &options, &ws, &kv, kv_cfg, &w).await?;
        let readback = Readback::new(&ctx, "logits readback", (r * (1 + c.vocab_size.max(kernels::topk::TOPK_ROW_WORDS)) * 4) as u64);
        let ahead_slots = if options.decode_ahead >= 2 { ahead::slots(&ctx, options.decode_ahead) } else { Vec::new() };
        let batch_slots = ahead::batch_slots(&ctx, options.decode_ahead, r);
        // CPU adapters: the blocked matmul already beats one matvec per token at 2 tokens
        // (SmolLM2-135M on lavapipe, layer linears: 1.67 s blocked vs 2 x 1.04 s matvec).
        // Where batched plans exist (the four-token packed matvec) they take every step
        // above one token; float weights on GPUs keep one matvec pass per token up to 4.
        let matvec_max_tokens = if options.batch_invariant {
            0
        } else if let Some(n) = options.matvec_max_tokens {
            n
        } else if ctx.caps.cpu_like || batch_max_tokens > 0 {
            1
        } else {
            4
        };

        // Where the memory went, checked against every allocation made above.
        let mut memory = MemoryReport::default();
        memory.add_weights(&w, c.hidden_size);
        memory.kv_cache = kv.bytes();
        memory.budget = budget.as_ref().map(|b| b.0);
        memory.budget_source = budget.map(|b| b.1).unwrap_or_else(|| "none (the adapter reports no memory size; set memory_budget)".into());
        memory.kv_pages = kv_cfg.num_pages;
        memory.kv_pages_requested = requested_pages;
        memory.kv_page_size = page_size;
        memory.kv_dtype = options.kv_dtype;
        memory.kv_buffers_per_layer = layout.n_shards;
        memory.kv_window_ring = ring;
        memory.kv_ring_bytes = kv.store.ring_bytes();
        let allocs = ctx.ledger.since(mark);
        let usage_bytes = |u: crate::gpu::AllocUsage| allocs.iter().filter(|a| a.usage == u).map(|a| a.bytes).sum::<u64>();
        memory.uniforms = usage_bytes(crate::gpu::AllocUsage::Uniform);
        memory.readback = usage_bytes(crate::gpu::AllocUsage::Readback);
        memory.ledger_bytes = allocs.iter().map(|a| a.bytes).sum();
        memory.allocations = allocs.len();
        if let Some(a) = allocs.iter().max_by_key(|a| a.bytes) {
            memory.largest = (a.label.clone(), a.bytes);
        }
        memory.workspace = ws.bytes();
        memory.x_textures = x_tex_bytes;
        Ok(GpuModel {
            ctx,
            config: c,
            options,
            kv,
            weights: w,
            ws,
            plans,
            readback,
            memory,
            matvec_max_tokens,
            batch_max_tokens,
            attention_splits,
            logit_rows: r,
            submit_ms_per_dispatch: None,
            step_ms: Vec::new(),
            draft_memory: DraftMemory::default(),
            ahead: None,
            ahead_slots,
            batch_unlanded: vec![false; batch_slots.len()],
            batch_slots,
            next_batch_slot: 0,
            final_norm_host: None,
            hidden_readback: None,
            row_draws_set: 0,
        })
    }

    /// Record that a step of `width` tokens of one sequence took `ms` (a moving average per
    /// width; speculative decoding reads it to choose how many tokens to draft).
    pub fn record_step_ms(&mut self, width: usize, ms: f64) {
        if width == 0 || width > 64 || !ms.is_finite() {
            return;
        }
        if self.step_ms.len() <= width {
            self.step_ms.resize(width + 1, None);
        }
        let e = &mut self.step_ms[width];
        *e = Some(e.map_or(ms, |o| 0.8 * o + 0.2 * ms));
    }

    /// The measured step costs by width (index = tokens; `None` where not measured yet).
    pub fn step_costs(&self) -> &[Option<f64>] {
        &self.step_ms
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

    /// Weight bytes a decode token reads: every weight less, in each mixture-of-experts
    /// layer, the stacked experts its router leaves out (`weight_bytes` for a dense model).
    pub fn weight_bytes_per_token(&self) -> u64 {
        let idle: u64 = self
            .weights
            .layers
            .iter()
            .filter_map(|l| {
                let m = &l.experts.as_ref()?.spec;
                let stacked = l.gate_up.bytes() + l.down.bytes();
                Some(stacked / m.experts as u64 * (m.experts - m.experts_per_token) as u64)
            })
            .sum();
        self.weight_bytes().saturating_sub(idle)
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
}

//! Memory accounting: where a loaded model's GPU bytes went ([`MemoryReport`], checked
//! against the allocation ledger), the budget the KV cache is sized against, and whether packed
//! weights may be held as tiled textures.

use crate::gpu::GpuContext;
use crate::kernels::linear::GpuLinear;
use crate::kv::plan::KvDtype;
use crate::model::ModelConfig;
use crate::{LanternError, Result};

use super::upload::GpuWeights;
use super::{GpuModel, ModelOptions};

/// Bytes of one weight dtype on the GPU.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct DtypeBytes {
    /// Weight matrices (or norm/bias vectors) stored in this dtype.
    pub tensors: usize,
    /// Bytes of values or integer codes.
    pub bytes: u64,
    /// Bytes of group scales (packed dtypes).
    pub scale_bytes: u64,
    /// Bytes of tiled textures' padding (`kernels::linear::GpuLinear::padding_bytes`):
    /// allocated beside `bytes` and `scale_bytes`, which are the packed weights themselves.
    pub padding: u64,
}

/// Where a loaded model's GPU memory went. Built from the model's own buffers and checked
/// against the context's allocation ledger: `ledger_bytes` is every byte allocated during
/// the load (storage, uniform and readback buffers), `total()` what the categories explain.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct MemoryReport {
    /// Weights by dtype (`q4g32`, `q8g32`, `f16`, `f32`; norms and biases are `f32`).
    pub weights: std::collections::BTreeMap<String, DtypeBytes>,
    /// The part of the weights held as tiled textures (CPU adapters with 8-lane subgroups:
    /// `kernels::linear::tiled_fits`), padding included.
    pub tiled_weights: u64,
    /// Zeros that make norm weights as long as the uniform window the tiled matvec binds
    /// them with (`kernels::linear::XU_WINDOW`).
    pub window_padding: u64,
    pub kv_cache: u64,
    /// Activations, step inputs, logits and the RoPE table (and the x textures).
    pub workspace: u64,
    /// The part of the workspace held as x textures (CPU adapters with tiled weights: the
    /// prefill matmul's input copies, `kernels::x_texture`).
    pub x_textures: u64,
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
    /// The sliding layers' window ring per sequence, when they keep one (`kv::ring`), and
    /// the bytes of every slot's rings (part of `kv_cache`).
    pub kv_window_ring: Option<crate::kv::ring::WindowRing>,
    pub kv_ring_bytes: u64,
}

impl MemoryReport {
    /// Bytes the weights take on the GPU, padding included.
    pub fn weight_bytes(&self) -> u64 {
        self.weights.values().map(|d| d.bytes + d.scale_bytes + d.padding).sum()
    }

    /// Bytes the categories explain (equals `ledger_bytes` when every allocation is known).
    pub fn total(&self) -> u64 {
        self.weight_bytes() + self.window_padding + self.kv_cache + self.workspace + self.uniforms + self.readback
    }

    fn add_linear(&mut self, lin: &GpuLinear) {
        let key = match lin.quant {
            Some(q) => q.to_string(),
            None => lin.format.name().to_string(),
        };
        let e = self.weights.entry(key).or_default();
        e.tensors += 1 + lin.is_gated() as usize;
        e.bytes += lin.bytes() - lin.scale_bytes();
        e.scale_bytes += lin.scale_bytes();
        e.padding += lin.padding_bytes();
        if lin.is_tiled() {
            self.tiled_weights += lin.bytes() + lin.padding_bytes();
        }
        if lin.bias.is_some() {
            self.add_f32_vector(lin.n_rows);
        }
    }

    /// Every weight of a load: linear layers by dtype, norms and biases as f32.
    pub(super) fn add_weights(&mut self, w: &GpuWeights, hidden: usize) {
        for layer in &w.layers {
            for (lin, _) in &layer.qkv {
                self.add_linear(lin);
            }
            for lin in [&layer.o, &layer.gate_up, &layer.down].into_iter().chain(layer.experts.as_ref().map(|e| &e.router)) {
                self.add_linear(lin);
            }
            for b in [Some(&layer.in_norm), Some(&layer.post_norm), layer.attn_out_norm.as_ref(), layer.mlp_out_norm.as_ref()]
                .into_iter()
                .flatten()
            {
                self.add_norm(b, hidden);
            }
            if let Some(b) = &layer.qk_norm {
                self.add_f32_vector(b.size() as usize / 4);
            }
        }
        self.add_linear(&w.lm_head);
        if let Some(e) = &w.embed_own {
            self.add_linear(e);
        }
        self.add_norm(&w.final_norm, hidden);
    }

    /// A norm weight of `n` values; its buffer may be padded to a uniform window (the tiled
    /// matvec reads fused norm weights so), which counts as `window_padding`.
    fn add_norm(&mut self, b: &wgpu::Buffer, n: usize) {
        self.add_f32_vector(n);
        self.window_padding += b.size().saturating_sub(n as u64 * 4);
    }

    fn add_f32_vector(&mut self, n: usize) {
        let e = self.weights.entry("f32".into()).or_default();
        e.tensors += 1;
        e.bytes += n as u64 * 4;
    }
}

impl GpuModel {
    /// Whether packed weights may be held as tiled textures (`kernels::linear::tiled_fits`:
    /// CPU adapters with 8-lane subgroups): as `options.weight_textures` says, by default yes.
    pub(super) fn weight_textures(options: &ModelOptions) -> bool {
        options.weight_textures.unwrap_or(true)
    }

    /// Pages of KV cache for this load: `requested` (max_seqs full contexts), or fewer when
    /// the budget (the smaller of `memory_budget` and the adapter's figure) leaves less room
    /// after weights, workspace (`x_textures`: the bytes of the CPU adapters' x textures on
    /// top of the buffers), a reserve and the sliding layers' rings (`ring`: then the pages
    /// hold only the other layers); an error when not even one full context fits.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn size_kv(
        ctx: &GpuContext,
        c: &ModelConfig,
        options: &ModelOptions,
        context: usize,
        requested: usize,
        weights: u64,
        x_textures: u64,
        ring: Option<&crate::kv::ring::WindowRing>,
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
        let workspace = crate::model::plan::workspace_bytes(c, t, options.max_logit_rows.max(1).min(t), context) + x_textures;
        let reserve = crate::kv::plan::reserve_bytes(b);
        let sliding = ring.map_or(0, |_| c.sliding_layers());
        let ring_bytes = ring
            .map_or(0, |r| r.bytes_per_sequence(sliding, c.num_kv_heads, c.head_dim, options.kv_dtype) * options.max_seqs.max(1) as u64);
        let kv_room = b.saturating_sub(weights + workspace + reserve + ring_bytes);
        let per_page =
            crate::kv::plan::kv_bytes_per_token(c.num_layers - sliding, c.num_kv_heads, c.head_dim, options.kv_dtype) * page_size as u64;
        let fit = kv_room.checked_div(per_page).map_or(usize::MAX, |f| f as usize);
        let over = |what: String, needed: u64| LanternError::MemoryBudget {
            budget: b,
            source_of_budget: src.clone(),
            weights,
            workspace,
            reserve,
            kv_room,
            what,
            needed,
        };
        // The rings do not fit (without rings, weights over the budget leave no room for one
        // sequence: the check below names that).
        if ring_bytes > 0 && weights + workspace + reserve + ring_bytes > b {
            let what = format!("the sliding layers' window rings of {} sequences ({:?} KV)", options.max_seqs.max(1), options.kv_dtype);
            return Err(over(what, ring_bytes));
        }
        let one_context = context.div_ceil(page_size);
        if fit < one_context {
            let mut what = format!("one sequence of {context} tokens ({:?} KV)", options.kv_dtype);
            if weights + workspace + reserve > b {
                what += ", and the weights alone are over the budget (a quantized model or --weights f16 holds fewer bytes)";
            }
            return Err(over(what, one_context as u64 * per_page));
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
}

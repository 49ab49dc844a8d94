//! Memory accounting: where a loaded model's GPU bytes went ([`MemoryReport`], checked
//! against the allocation ledger), the budget the KV cache is sized against, and whether packed
//! weights also get texture copies.

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
    /// The sliding layers' window ring per sequence, when they keep one (`kv::ring`), and
    /// the bytes of every slot's rings (part of `kv_cache`).
    pub kv_window_ring: Option<crate::kv::ring::WindowRing>,
    pub kv_ring_bytes: u64,
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

    /// Every weight of a load: linear layers by dtype, norms and biases as f32.
    pub(super) fn add_weights(&mut self, w: &GpuWeights, hidden: usize) {
        for layer in &w.layers {
            for (lin, _) in &layer.qkv {
                self.add_linear(lin);
            }
            for lin in [&layer.o, &layer.gate_up, &layer.down] {
                self.add_linear(lin);
            }
            self.add_f32_vector(hidden);
            self.add_f32_vector(hidden);
            for b in [&layer.qk_norm, &layer.attn_out_norm, &layer.mlp_out_norm].into_iter().flatten() {
                self.add_f32_vector(b.size() as usize / 4);
            }
        }
        self.add_linear(&w.lm_head);
        if let Some(e) = &w.embed_own {
            self.add_linear(e);
        }
        self.add_f32_vector(hidden);
    }

    fn add_f32_vector(&mut self, n: usize) {
        let e = self.weights.entry("f32".into()).or_default();
        e.tensors += 1;
        e.bytes += n as u64 * 4;
    }
}

impl GpuModel {
    /// Whether packed weights get texture copies (CPU adapters' batched matvec, `TOK4 | TEX`,
    /// with `LANTERN_TOK4=tex`): as `options.weight_textures` says, by default only with
    /// `LANTERN_TOK4=tex` and while holding the weights twice takes
    /// at most 60% of the memory budget, so that a
    /// large model keeps its room for the KV cache (Qwen2.5-1.5B Q4_K_M on lavapipe's 2 GiB
    /// heap: 1.1 GB of weights, no copies).
    /// `packed`: bytes of the file's quantized tensors.
    pub(super) fn weight_textures(ctx: &GpuContext, packed: u64, options: &ModelOptions) -> bool {
        if let Some(t) = options.weight_textures {
            return t;
        }
        // Only the texture form of the four-token matvec reads them, and it is opt-in: the
        // storage form measured faster on lavapipe (SmolLM2 Q4_1, a 4-token step's gate/up
        // projection: 35 ms from storage, 47-56 ms from textures).
        if !crate::kernels::linear::tok4_from_textures() {
            return false;
        }
        let adapter = crate::gpu::memory::default_budget(&crate::gpu::memory::adapter_memory(ctx)).map(|(b, _)| b);
        match options.memory_budget.into_iter().chain(adapter).min() {
            Some(budget) => 2 * packed <= budget / 5 * 3,
            None => true,
        }
    }

    /// Pages of KV cache for this load: `requested` (max_seqs full contexts), or fewer when
    /// the budget (the smaller of `memory_budget` and the adapter's figure) leaves less room
    /// after weights, workspace, a reserve and the sliding layers' rings (`ring`: then the
    /// pages hold only the other layers); an error when not even one full context fits.
    pub(super) fn size_kv(
        ctx: &GpuContext,
        c: &ModelConfig,
        options: &ModelOptions,
        context: usize,
        requested: usize,
        weights: u64,
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
        let workspace = crate::model::plan::workspace_bytes(c, t, options.max_logit_rows.max(1).min(t), context);
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
        if weights + workspace + reserve + ring_bytes > b {
            let what = format!("the sliding layers' window rings of {} sequences ({:?} KV)", options.max_seqs.max(1), options.kv_dtype);
            return Err(over(what, ring_bytes));
        }
        let one_context = context.div_ceil(page_size);
        if fit < one_context {
            return Err(over(format!("one sequence of {context} tokens ({:?} KV)", options.kv_dtype), one_context as u64 * per_page));
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

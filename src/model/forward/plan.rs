//! The step plans: the workspace buffers a step reads and writes, and for each step shape
//! (decode matvec, CPU adapters' batched matvec, prefill matmul) the dispatches of every layer
//! and of the head, with their bind groups, built once at load.

use crate::gpu::buffer::{create_storage, create_zeroed, create_zeroed_window};
use crate::gpu::shader::flags;
use crate::gpu::GpuContext;
use crate::kernels::attention::{AttentionIo, AttentionParams, KvBinding};
use crate::kernels::linear::{x_window, LinearIo, Shape};
use crate::kernels::rope_kv::{rope_table, RopeKvIo, RopeKvParams};
use crate::kernels::{self, Dispatch};
use crate::kv::cache::{KvCache, KvStore};
use crate::kv::KvConfig;
use crate::model::ModelConfig;
use crate::Result;

use super::upload::GpuWeights;
use super::{gpu_err, Experts, GpuModel, Layer, ModelOptions};

/// Per-step host inputs.
pub(super) struct Workspace {
    pub step: wgpu::Buffer,
    pub ids: wgpu::Buffer,
    pub positions: wgpu::Buffer,
    pub token_seq: wgpu::Buffer,
    pub block_table: wgpu::Buffer,
    pub logit_rows: wgpu::Buffer,
    pub hidden: wgpu::Buffer,
    pub qkv: wgpu::Buffer,
    pub attn: wgpu::Buffer,
    pub act: wgpu::Buffer,
    pub logits: wgpu::Buffer,
    pub argmax: wgpu::Buffer,
    /// GPU top-k pairs of the logit rows (`TOPK_ROW_WORDS` words per row).
    pub topk: wgpu::Buffer,
    /// Sampling on the GPU (`kernels::sample`): the request's parameters (a uniform) and one
    /// uniform draw per logit row.
    pub sample_params: wgpu::Buffer,
    pub draws: wgpu::Buffer,
    /// How each logit row's token is chosen by the argmax kernel (`kernels::argmax::RowDraw`:
    /// the argmax, or a Gumbel-max draw from the vocabulary or its top-p nucleus).
    pub row_draws: wgpu::Buffer,
    /// Constrained decoding: the allowed-token bitmask of each logit row (`r x ceil(vocab / 32)`).
    pub token_mask: wgpu::Buffer,
    /// OpenAI's logit_bias and penalties: each logit row's sparse (token, delta) pairs
    /// (`kernels::logit_bias::pack`); grows when a step brings more pairs.
    pub logit_bias: wgpu::Buffer,
    pub rope: wgpu::Buffer,
    /// The sliding layers' cos/sin table when their RoPE base differs (Gemma 3).
    pub rope_local: Option<wgpu::Buffer>,
    /// A sublayer's output before its post-norm (sandwich-norm models), `t x hidden`.
    pub branch: Option<wgpu::Buffer>,
    /// Attention's partial results when keys are split (a 4-byte stand-in otherwise).
    pub partials: wgpu::Buffer,
    /// CPU adapters with tiled weights: texture copies of the linear inputs for the prefill
    /// matmul (`kernels::x_texture`).
    pub x_tex: Option<XTextures>,
    /// Mixtures of experts: the router's logits and route, and the experts' activations.
    pub moe: Option<MoeBuffers>,
}

/// A mixture of experts' step buffers (`kernels::moe`).
pub(super) struct MoeBuffers {
    /// `t x experts` router logits.
    pub logits: wgpu::Buffer,
    /// `t x experts_per_token` (expert, weight) pairs.
    pub route: wgpu::Buffer,
    /// `t x experts_per_token x expert_intermediate` gated activations.
    pub act: wgpu::Buffer,
    /// Prefill steps (grouped by expert): the pairs by expert, the work list, and each
    /// pair's weighted down row (`t x experts_per_token x hidden`).
    pub groups: wgpu::Buffer,
    pub work: wgpu::Buffer,
    pub pairs: wgpu::Buffer,
}

/// The x textures of `hidden`, `attn` and `act`.
pub(super) struct XTextures {
    pub hidden: wgpu::Texture,
    pub attn: wgpu::Texture,
    pub act: wgpu::Texture,
}

/// Whether this adapter's prefill reads the linear inputs from x textures (given tiled
/// weights): `kernels::x_texture::fits`.
pub(super) fn x_textures_fit(ctx: &GpuContext, c: &ModelConfig, options: &ModelOptions) -> bool {
    kernels::x_texture::fits(ctx, &crate::model::plan::x_texture_widths(c), options.max_batch_tokens.max(1))
}

/// Bytes of the x textures.
pub(super) fn x_texture_bytes(c: &ModelConfig, options: &ModelOptions) -> u64 {
    kernels::x_texture::bytes(&crate::model::plan::x_texture_widths(c), options.max_batch_tokens.max(1))
}

pub(super) struct Plans {
    pub embed: Vec<Dispatch>,
    pub layers_matvec: Vec<Dispatch>,
    pub layers_matmul: Vec<Dispatch>,
    pub head_gather: Vec<Dispatch>,
    /// Packed weights where the four-token matvec exists (CPU adapters' XBCAST and TEX
    /// layouts, GPUs' MULTI_ROW): its layers and LM head for steps of a few tokens (batched
    /// decode, speculative verify); None elsewhere.
    pub layers_batch: Option<Vec<Dispatch>>,
    pub head_gather_batch: Option<Vec<Dispatch>>,
    /// Where the eight-token matvec exists too (TEX, MULTI_ROW): the same for steps of more
    /// than four tokens.
    pub layers_batch8: Option<Vec<Dispatch>>,
    pub head_gather_batch8: Option<Vec<Dispatch>>,
    pub head_all: Vec<Dispatch>,
    pub argmax: Dispatch,
    pub topk: Dispatch,
    /// Constrained decoding's mask over the logit rows (before argmax / top-k / readback).
    pub logit_mask: Dispatch,
    /// Logit bias and penalties over the logit rows (before the mask).
    pub logit_bias: Dispatch,
    /// A token drawn from each logit row's top-k pairs, into `argmax`.
    pub sample: Dispatch,
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
    LinearIo { step: &ws.step, x, x_stride, norm, eps, y, out_stride, out_offset: 0, residual, rows, x_tex: None }
}

impl Workspace {
    /// The buffers of steps of up to `max_batch_tokens` tokens; also returns the rows of
    /// logits one step can produce.
    pub(super) fn new(
        ctx: &GpuContext,
        c: &ModelConfig,
        options: &ModelOptions,
        kv_cfg: KvConfig,
        context: usize,
        partials_bytes: u64,
        x_tex: bool,
    ) -> Result<(Workspace, usize)> {
        let (d, f) = (c.hidden_size, c.intermediate_size);
        let qkv_dim = c.qkv_dim();
        let q_dim = c.num_heads * c.head_dim;
        let t = options.max_batch_tokens.max(1);
        // Rows of logits per step: as asked, within one storage binding.
        let r = options.max_logit_rows.max(1).min(t).min((ctx.max_binding() / (c.vocab_size as u64 * 4)).max(1) as usize);
        let xw = x_window(ctx);
        let ws = Workspace {
            step: kernels::step_buffer(ctx),
            ids: create_zeroed(ctx, "ids", (t * 4) as u64).map_err(gpu_err)?,
            positions: create_zeroed(ctx, "positions", (t * 4) as u64).map_err(gpu_err)?,
            token_seq: create_zeroed(ctx, "token_seq", (t * 4) as u64).map_err(gpu_err)?,
            block_table: create_zeroed(ctx, "block_table", (kv_cfg.max_seqs * kv_cfg.max_pages_per_seq() * 4) as u64).map_err(gpu_err)?,
            logit_rows: create_zeroed(ctx, "logit_rows", (r * 4) as u64).map_err(gpu_err)?,
            // The linear layers' inputs, which the tiled matvec may read as uniform windows.
            hidden: create_zeroed_window(ctx, "hidden", (t * d * 4) as u64, xw).map_err(gpu_err)?,
            qkv: create_zeroed(ctx, "qkv", (t * qkv_dim * 4) as u64).map_err(gpu_err)?,
            attn: create_zeroed_window(ctx, "attn", (t * q_dim * 4) as u64, xw).map_err(gpu_err)?,
            act: create_zeroed_window(ctx, "act", (t * f * 4) as u64, xw).map_err(gpu_err)?,
            logits: create_zeroed(ctx, "logits", (r * c.vocab_size * 4) as u64).map_err(gpu_err)?,
            argmax: create_zeroed(ctx, "argmax", (t * 4) as u64).map_err(gpu_err)?,
            topk: create_zeroed(ctx, "topk", (r * kernels::topk::TOPK_ROW_WORDS * 4) as u64).map_err(gpu_err)?,
            sample_params: crate::gpu::buffer::create_uniform(ctx, "sample.params", &kernels::sample::SampleParams::default()),
            draws: create_zeroed(ctx, "draws", (r * 4) as u64).map_err(gpu_err)?,
            row_draws: create_zeroed(ctx, "row_draws", (r * std::mem::size_of::<kernels::argmax::RowDraw>()) as u64).map_err(gpu_err)?,
            token_mask: create_zeroed(ctx, "token_mask", (r * kernels::logit_mask::words(c.vocab_size) * 4) as u64).map_err(gpu_err)?,
            logit_bias: create_zeroed(ctx, "logit_bias", kernels::logit_bias::initial_bytes(r)).map_err(gpu_err)?,
            rope: create_storage(
                ctx,
                "rope",
                bytemuck::cast_slice(&rope_table(&c.rope_inv_freq_for(context), context, c.rope_attention_factor())),
            )
            .map_err(gpu_err)?,
            rope_local: match (c.has_local_rope(), c.block.layer_attention.iter().position(|a| *a == crate::model::LayerAttention::Sliding))
            {
                (true, Some(l)) => Some(
                    create_storage(ctx, "rope.local", bytemuck::cast_slice(&rope_table(&c.layer_rope_inv_freq(l, context), context, 1.0)))
                        .map_err(gpu_err)?,
                ),
                _ => None,
            },
            branch: if c.block.norms == crate::model::NormPlacement::Sandwich {
                Some(create_zeroed(ctx, "branch", (t * d * 4) as u64).map_err(gpu_err)?)
            } else {
                None
            },
            partials: create_zeroed(ctx, "attention.partials", partials_bytes.max(4)).map_err(gpu_err)?,
            x_tex: if x_tex {
                let make = |name: &str, width: usize| kernels::x_texture::create(ctx, name, width, t).map_err(gpu_err);
                Some(XTextures { hidden: make("hidden.tex", d)?, attn: make("attn.tex", q_dim)?, act: make("act.tex", f)? })
            } else {
                None
            },
            moe: match &c.block.moe {
                Some(m) => {
                    let pairs = t * m.experts_per_token;
                    let (gb, wb) = kernels::moe::group_bytes(t, m.experts_per_token, m.experts);
                    Some(MoeBuffers {
                        logits: create_zeroed(ctx, "moe.logits", (t * m.experts * 4) as u64).map_err(gpu_err)?,
                        route: create_zeroed(ctx, "moe.route", (pairs * kernels::moe::ROUTE_BYTES) as u64).map_err(gpu_err)?,
                        act: create_zeroed(ctx, "moe.act", (pairs * m.expert_intermediate * 4) as u64).map_err(gpu_err)?,
                        groups: create_zeroed(ctx, "moe.groups", gb).map_err(gpu_err)?,
                        work: create_zeroed(ctx, "moe.work", wb).map_err(gpu_err)?,
                        pairs: create_zeroed(ctx, "moe.pairs", (pairs * d * 4) as u64).map_err(gpu_err)?,
                    })
                }
                None => None,
            },
        };
        Ok((ws, r))
    }

    /// Bytes of every buffer.
    pub(super) fn bytes(&self) -> u64 {
        [
            &self.ids,
            &self.positions,
            &self.token_seq,
            &self.block_table,
            &self.logit_rows,
            &self.hidden,
            &self.qkv,
            &self.attn,
            &self.act,
            &self.logits,
            &self.argmax,
            &self.topk,
            &self.draws,
            &self.row_draws,
            &self.token_mask,
            &self.logit_bias,
            &self.rope,
            &self.partials,
        ]
        .iter()
        .map(|b| b.size())
        .sum::<u64>()
            + [&self.rope_local, &self.branch].into_iter().flatten().map(|b| b.size()).sum::<u64>()
            + self
                .moe
                .as_ref()
                .map_or(0, |m| [&m.logits, &m.route, &m.act, &m.groups, &m.work, &m.pairs].iter().map(|b| b.size()).sum::<u64>())
            + self
                .x_tex
                .as_ref()
                .map_or(0, |x| [&x.hidden, &x.attn, &x.act].iter().map(|t| t.width() as u64 * t.height() as u64 * 16).sum::<u64>())
    }
}

/// Every plan of a load; also returns the most tokens the batched matvec takes (0 without it).
pub(super) async fn build_plans(
    ctx: &GpuContext,
    c: &ModelConfig,
    options: &ModelOptions,
    ws: &Workspace,
    kv: &KvCache,
    kv_cfg: KvConfig,
    w: &GpuWeights,
) -> Result<(Plans, usize)> {
    let d = c.hidden_size;
    let (layers, lm_head, final_norm) = (&w.layers, &w.lm_head, &w.final_norm);
    let embed_own = &w.embed_own;
    let embed_src = embed_own.as_ref().unwrap_or(lm_head);
    let embed = kernels::embedding::build(ctx, &ws.step, &ws.ids, embed_src, &ws.hidden, c.block.embedding_scale.unwrap_or(1.0))
        .await
        .map_err(gpu_err)?;
    let mut layers_matvec = Vec::new();
    let mut layers_matmul = Vec::new();
    // The four-token packed matvec (TOK4) exists where the packed matvec takes the XBCAST
    // layout (CPU adapters whose workgroup of 8 is one subgroup: from storage, or from
    // texture copies) or the MULTI_ROW one (GPUs).
    let packed = layers.iter().any(|l| l.qkv.iter().any(|(q, _)| q.format.is_packed()));
    let tok4 = packed && kernels::linear::packed_matvec_layout(ctx).0 & (flags::XBCAST | flags::MULTI_ROW) != 0;
    let batch_plans = !options.batch_invariant && tok4;
    // The eight-token form (TOK8) exists in the tiled layout (CPU adapters' texture-held
    // weights) and in MULTI_ROW (GPUs); the storage layout's steps of 5-8 tokens would take
    // two four-token passes, which the four-token plan already does.
    let tiled = layers.iter().any(|l| l.qkv.iter().any(|(q, _)| q.is_tiled()));
    let tok8 = batch_plans
        && options.eight_token_matvec != Some(false)
        && (tiled || kernels::linear::packed_matvec_layout(ctx).0 & flags::MULTI_ROW != 0);
    let mut layers_batch = Vec::new();
    let mut layers_batch8 = Vec::new();
    for (l, layer) in layers.iter().enumerate() {
        for shape in [Shape::Matvec, Shape::Matmul, Shape::MatvecBatch, Shape::MatvecBatch8] {
            if (shape == Shape::MatvecBatch && !batch_plans) || (shape == Shape::MatvecBatch8 && !tok8) {
                continue;
            }
            let list = GpuModel::layer_plan(ctx, c, ws, &kv.store, kv_cfg, l, layer, shape).await?;
            match shape {
                Shape::Matvec => layers_matvec.extend(list),
                Shape::Matmul => layers_matmul.extend(list),
                Shape::MatvecBatch => layers_batch.extend(list),
                Shape::MatvecBatch8 => layers_batch8.extend(list),
            }
        }
    }
    // CPU adapters: up to 16 tokens (passes of the four- or eight-token matvec beat the
    // blocked matmul there); GPUs: 8 with the eight-token form, else 4 (one pass over the
    // weights; beyond it the tiled matmul, which also reads them once).
    let batch_default = match (ctx.caps.cpu_like, tok8) {
        (true, _) => 16,
        (false, true) => 8,
        (false, false) => 4,
    };
    let batch_max_tokens = if batch_plans { options.batch_max_tokens.unwrap_or(batch_default) } else { 0 };
    let head_gather_batch8 = if tok8 {
        Some(
            kernels::linear::build(
                ctx,
                lm_head,
                &lin_io(ws, &ws.hidden, d, Some(final_norm), &ws.logits, c.vocab_size, false, c.rms_norm_eps, Some(&ws.logit_rows)),
                Shape::MatvecBatch8,
            )
            .await
            .map_err(gpu_err)?,
        )
    } else {
        None
    };
    let head_gather_batch = if batch_plans {
        Some(
            kernels::linear::build(
                ctx,
                lm_head,
                &lin_io(ws, &ws.hidden, d, Some(final_norm), &ws.logits, c.vocab_size, false, c.rms_norm_eps, Some(&ws.logit_rows)),
                Shape::MatvecBatch,
            )
            .await
            .map_err(gpu_err)?,
        )
    } else {
        None
    };
    let head_gather = kernels::linear::build(
        ctx,
        lm_head,
        &lin_io(ws, &ws.hidden, d, Some(final_norm), &ws.logits, c.vocab_size, false, c.rms_norm_eps, Some(&ws.logit_rows)),
        Shape::Matvec,
    )
    .await
    .map_err(gpu_err)?;
    let head_all = kernels::linear::build(
        ctx,
        lm_head,
        &lin_io(ws, &ws.hidden, d, Some(final_norm), &ws.logits, c.vocab_size, false, c.rms_norm_eps, None),
        Shape::Matmul,
    )
    .await
    .map_err(gpu_err)?;
    let argmax = kernels::argmax::build(ctx, &ws.step, &ws.logits, &ws.argmax, &ws.row_draws, c.vocab_size).await.map_err(gpu_err)?;
    let topk = kernels::topk::build(ctx, &ws.step, &ws.logits, &ws.topk, c.vocab_size, kernels::topk::TOPK_MAX).await.map_err(gpu_err)?;
    let sample = kernels::sample::build(ctx, &ws.step, &ws.sample_params, &ws.topk, &ws.draws, &ws.argmax).await.map_err(gpu_err)?;
    let logit_mask = kernels::logit_mask::build(ctx, &ws.step, &ws.token_mask, &ws.logits, c.vocab_size).await.map_err(gpu_err)?;
    // The rows of logits a step can produce: the logit_rows buffer holds one index each.
    let logit_rows = (ws.logit_rows.size() / 4) as usize;
    let logit_bias =
        kernels::logit_bias::build(ctx, &ws.step, &ws.logit_bias, &ws.logits, c.vocab_size, logit_rows).await.map_err(gpu_err)?;
    let plans = Plans {
        embed,
        layers_matvec,
        layers_matmul,
        head_gather,
        layers_batch: batch_plans.then_some(layers_batch),
        head_gather_batch,
        layers_batch8: tok8.then_some(layers_batch8),
        head_gather_batch8,
        head_all,
        argmax,
        topk,
        logit_mask,
        logit_bias,
        sample,
    };
    Ok((plans, batch_max_tokens))
}

impl GpuModel {
    /// Layer `l`'s attention sizes, scale and window.
    pub(super) fn attention_params(c: &ModelConfig, kv_cfg: KvConfig, l: usize) -> AttentionParams {
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
        // Prefill on CPU adapters: each linear input copied into its texture first.
        let xt = ws.x_tex.as_ref().filter(|_| shape == Shape::Matmul);
        let (t_hidden, t_attn, t_act) = (xt.map(|t| &t.hidden), xt.map(|t| &t.attn), xt.map(|t| &t.act));
        let io = |x, x_tex: Option<&'a wgpu::Texture>, x_stride, norm, y, out_stride, residual| LinearIo {
            x_tex,
            ..lin_io(ws, x, x_stride, norm, y, out_stride, residual, eps, None)
        };
        let copy = async |x: &wgpu::Buffer, tex: Option<&wgpu::Texture>, width: usize| match tex {
            Some(t) => kernels::x_texture::build(ctx, &ws.step, x, width, width, t).await.map(Some).map_err(gpu_err),
            None => Ok(None),
        };
        let mut v = Vec::new();
        v.extend(copy(&ws.hidden, t_hidden, d).await?);
        for (part, col) in &layer.qkv {
            let mut pio = io(&ws.hidden, t_hidden, d, Some(&layer.in_norm), &ws.qkv, qkv_dim, false);
            pio.out_offset = *col;
            v.extend(kernels::linear::build(ctx, part, &pio, shape).await.map_err(gpu_err)?);
        }
        if let Some(g) = &layer.qk_norm {
            use kernels::rmsnorm::RowLayout;
            let kv_dim = c.num_kv_heads * hd;
            let layouts = if c.block.qk_norm_whole {
                // The whole q, then the whole k, of each token's q|k|v row (OLMoE; g is the q
                // norm's q_dim floats, then the k norm's kv_dim).
                vec![
                    RowLayout { k: q_dim, rows: 1, row_stride: q_dim, token_stride: qkv_dim, split: 1, ..Default::default() },
                    RowLayout { k: kv_dim, rows: 1, row_stride: kv_dim, token_stride: qkv_dim, split: 1, offset: q_dim, g_offset: q_dim },
                ]
            } else {
                // Every q head, then every k head.
                vec![RowLayout {
                    k: hd,
                    rows: c.num_heads + c.num_kv_heads,
                    row_stride: hd,
                    token_stride: qkv_dim,
                    split: c.num_heads,
                    ..Default::default()
                }]
            };
            for rows in layouts {
                v.push(
                    kernels::rmsnorm::build(ctx, &ws.step, &ws.qkv, g, &ws.qkv, rows, eps, kernels::rmsnorm::Mode::InPlace)
                        .await
                        .map_err(gpu_err)?,
                );
            }
        }
        let local = c.block.attention(l) == crate::model::LayerAttention::Sliding;
        let rope = ws.rope_local.as_ref().filter(|_| local).unwrap_or(&ws.rope);
        let max_pages = kv_cfg.max_pages_per_seq() as u32;
        let kvb = KvBinding { layout: kv.layout_of(l), k: &kv.k[l], v: &kv.v[l] };
        let rope_io = RopeKvIo {
            step: &ws.step,
            qkv: &ws.qkv,
            rope,
            positions: &ws.positions,
            token_seq: &ws.token_seq,
            block_table: &ws.block_table,
            kv: kvb,
        };
        let rope_p = RopeKvParams {
            n_heads: c.num_heads as u32,
            n_kv_heads: c.num_kv_heads as u32,
            head_dim: hd as u32,
            qkv_stride: qkv_dim as u32,
            max_pages,
            n_positions: kv_cfg.context as u32,
        };
        v.extend(kernels::rope_kv::build(ctx, &rope_io, rope_p).await.map_err(gpu_err)?);
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
        // A q4 cache's tail is written after attention has read it.
        v.extend(kernels::rope_kv::build_tail(ctx, &rope_io, rope_p).await.map_err(gpu_err)?);

        // A sublayer's output goes into the residual stream directly, or (sandwich norms)
        // through `branch` and its post-norm.
        let post = |out_norm: &'a Option<wgpu::Buffer>| -> Option<(&'a wgpu::Buffer, &'a wgpu::Buffer)> {
            out_norm.as_ref().zip(ws.branch.as_ref())
        };
        let add_normed = async |g: &wgpu::Buffer, b: &wgpu::Buffer| {
            kernels::rmsnorm::build(
                ctx,
                &ws.step,
                b,
                g,
                &ws.hidden,
                kernels::rmsnorm::RowLayout::dense(d),
                eps,
                kernels::rmsnorm::Mode::Residual,
            )
            .await
            .map_err(gpu_err)
        };
        v.extend(copy(&ws.attn, t_attn, q_dim).await?);
        match post(&layer.attn_out_norm) {
            Some((g, b)) => {
                v.extend(
                    kernels::linear::build(ctx, &layer.o, &io(&ws.attn, t_attn, q_dim, None, b, d, false), shape).await.map_err(gpu_err)?,
                );
                v.push(add_normed(g, b).await?);
            }
            None => v.extend(
                kernels::linear::build(ctx, &layer.o, &io(&ws.attn, t_attn, q_dim, None, &ws.hidden, d, true), shape)
                    .await
                    .map_err(gpu_err)?,
            ),
        }
        if let Some(e) = &layer.experts {
            v.extend(Self::experts_plan(ctx, c, ws, layer, e, shape).await?);
            if let Some((g, b)) = post(&layer.mlp_out_norm) {
                v.push(add_normed(g, b).await?);
            }
            return Ok(v);
        }
        v.extend(copy(&ws.hidden, t_hidden, d).await?);
        v.extend(
            kernels::linear::build(
                ctx,
                &layer.gate_up,
                &io(&ws.hidden, t_hidden, d, Some(&layer.post_norm), &ws.act, c.intermediate_size, false),
                shape,
            )
            .await
            .map_err(gpu_err)?,
        );
        v.extend(copy(&ws.act, t_act, c.intermediate_size).await?);
        match post(&layer.mlp_out_norm) {
            Some((g, b)) => {
                v.extend(
                    kernels::linear::build(ctx, &layer.down, &io(&ws.act, t_act, c.intermediate_size, None, b, d, false), shape)
                        .await
                        .map_err(gpu_err)?,
                );
                v.push(add_normed(g, b).await?);
            }
            None => v.extend(
                kernels::linear::build(ctx, &layer.down, &io(&ws.act, t_act, c.intermediate_size, None, &ws.hidden, d, true), shape)
                    .await
                    .map_err(gpu_err)?,
            ),
        }
        Ok(v)
    }

    /// A mixture of experts' dispatches: the router's logits (the MLP norm folded in, as for
    /// a dense MLP's gate|up), each token's route on the GPU, the chosen experts' gate|up,
    /// and their down with the route's weighted sum added into the residual stream (or
    /// written to `branch` for a post-norm). Decode and batched shapes run the expert matvec
    /// per pair; prefill (`Shape::Matmul`) groups the pairs by expert first.
    async fn experts_plan(
        ctx: &GpuContext,
        c: &ModelConfig,
        ws: &Workspace,
        layer: &Layer,
        e: &Experts,
        shape: Shape,
    ) -> Result<Vec<Dispatch>> {
        let (d, eps) = (c.hidden_size, c.rms_norm_eps);
        let m = &e.spec;
        let bufs = ws.moe.as_ref().expect("a model with experts has their workspace");
        let mut v = kernels::linear::build(
            ctx,
            &e.router,
            &lin_io(ws, &ws.hidden, d, Some(&layer.post_norm), &bufs.logits, m.experts, false, eps, None),
            // The router is a few rows: its matvec or, for prefill, the matmul.
            if shape == Shape::Matmul { Shape::Matmul } else { Shape::Matvec },
        )
        .await
        .map_err(gpu_err)?;
        v.push(
            kernels::moe::route(ctx, &ws.step, &bufs.logits, &bufs.route, m.experts, m.experts_per_token, m.renormalize)
                .await
                .map_err(gpu_err)?,
        );
        let up = kernels::moe::ExpertIo {
            step: &ws.step,
            x: &ws.hidden,
            x_stride: d,
            norm: Some(&layer.post_norm),
            eps,
            route: &bufs.route,
            top_k: m.experts_per_token,
            y: &bufs.act,
            out_stride: m.expert_intermediate,
            residual: false,
        };
        let (y, residual) = match (&layer.mlp_out_norm, &ws.branch) {
            (Some(_), Some(b)) => (b, false),
            _ => (&ws.hidden, true),
        };
        if shape == Shape::Matmul {
            // Prefill: the pairs grouped by expert, so each expert's rows are read once per
            // `GROUP_PAIRS` of its pairs; down writes weighted pair rows, which the combine
            // sums per token.
            let g = kernels::moe::Grouping {
                groups: &bufs.groups,
                work: &bufs.work,
                max_tokens: (bufs.groups.size() as usize / 4 / m.experts_per_token).max(1),
            };
            v.push(kernels::moe::group(ctx, &ws.step, &bufs.route, &g, m.experts, m.experts_per_token).await.map_err(gpu_err)?);
            v.push(kernels::moe::grouped(ctx, &layer.gate_up, m.experts, &up, &g).await.map_err(gpu_err)?);
            let down = kernels::moe::ExpertIo {
                x: &bufs.act,
                x_stride: m.expert_intermediate,
                norm: None,
                y: &bufs.pairs,
                out_stride: d,
                residual: false,
                ..up
            };
            v.push(kernels::moe::grouped(ctx, &layer.down, m.experts, &down, &g).await.map_err(gpu_err)?);
            v.push(kernels::moe::combine(ctx, &ws.step, &bufs.pairs, y, d, m.experts_per_token, residual).await.map_err(gpu_err)?);
            return Ok(v);
        }
        v.push(kernels::moe::experts(ctx, &layer.gate_up, m.experts, &up).await.map_err(gpu_err)?);
        let down = kernels::moe::ExpertIo { x: &bufs.act, x_stride: m.expert_intermediate, norm: None, y, out_stride: d, residual, ..up };
        v.push(kernels::moe::experts(ctx, &layer.down, m.experts, &down).await.map_err(gpu_err)?);
        Ok(v)
    }
}

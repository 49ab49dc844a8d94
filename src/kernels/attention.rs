//! Causal grouped-query attention over the paged KV cache (`shaders/attention.wgsl`), split
//! over KV shards and key ranges (flash-decoding) with a reduce pass
//! (`shaders/attention_reduce.wgsl`) when there is more than one part.

use crate::gpu::buffer::create_uniform;
use crate::gpu::shader::WeightFormat;
use crate::gpu::{GpuContext, GpuError, PipelineKey, ShaderOp};
use crate::kv::cache::KvLayout;
use crate::kv::plan::KvDtype;

use super::{bind, pipeline, Dim, Dispatch};

/// Bytes of the `Params` uniform this op writes ([`super::params_size`]).
pub const UNIFORM_BYTES: usize = std::mem::size_of::<AttentionUniform>();

/// The sizes of one attention layer.
#[derive(Debug, Clone, Copy, Default)]
pub struct AttentionParams {
    pub n_heads: u32,
    pub n_kv_heads: u32,
    pub head_dim: u32,
    /// Floats per fused q|k|v row.
    pub qkv_stride: u32,
    /// Entries per block-table row.
    pub max_pages: u32,
    /// Floats per output row.
    pub out_stride: u32,
    /// 1 / sqrt(head_dim) (or the model's attention scale).
    pub scale: f32,
    /// Keys a query sees, itself included (sliding-window layers); 0: all earlier keys.
    pub window: u32,
}

/// Bytes of the `Params` uniform this op writes ([`super::params_size`]).
pub const REDUCE_UNIFORM_BYTES: usize = std::mem::size_of::<ReduceUniform>();

/// Mirrors `struct Params` in attention.wgsl.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
struct AttentionUniform {
    n_heads: u32,
    n_kv_heads: u32,
    head_dim: u32,
    qkv_stride: u32,
    page_size: u32,
    max_pages: u32,
    out_stride: u32,
    scale: f32,
    pages_per_shard: u32,
    shard: u32,
    n_shards: u32,
    scale_base: u32,
    window: u32,
    ring: u32,
    tail_base: u32,
    _pad: u32,
}

/// Mirrors `struct Params` in attention_reduce.wgsl.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
struct ReduceUniform {
    n_heads: u32,
    head_dim: u32,
    out_stride: u32,
    n_shards: u32,
}

/// `AttentionUniform`'s named fields and offsets (`kernels::params_fields`).
pub(crate) fn uniform_fields() -> Vec<(&'static str, usize)> {
    field_offsets!(AttentionUniform; n_heads, n_kv_heads, head_dim, qkv_stride, page_size, max_pages, out_stride, scale,
        pages_per_shard, shard, n_shards, scale_base, window, ring, tail_base)
}

/// `ReduceUniform`'s named fields and offsets (`kernels::params_fields`).
pub(crate) fn reduce_uniform_fields() -> Vec<(&'static str, usize)> {
    field_offsets!(ReduceUniform; n_heads, head_dim, out_stride, n_shards)
}

/// Largest head_dim the kernel supports (4 dims per lane x 64 lanes).
pub const MAX_HEAD_DIM: u32 = 256;

/// Query heads of one GQA group handled (sharing K/V loads) per workgroup; `HB` in the shader.
const HEAD_BATCH: u32 = 4;

/// One layer's K and V shard buffers and their layout.
#[derive(Clone, Copy)]
pub struct KvBinding<'a> {
    pub layout: &'a KvLayout,
    pub k: &'a [wgpu::Buffer],
    pub v: &'a [wgpu::Buffer],
}

/// The buffers of the attention op.
pub struct AttentionIo<'a> {
    pub step: &'a wgpu::Buffer,
    pub qkv: &'a wgpu::Buffer,
    pub positions: &'a wgpu::Buffer,
    pub token_seq: &'a wgpu::Buffer,
    pub block_table: &'a wgpu::Buffer,
    pub kv: KvBinding<'a>,
    pub out: &'a wgpu::Buffer,
    /// Partial results when a token's keys are split into several parts, at least
    /// [`partials_bytes`]; any other small buffer (not `out`) when they never are.
    pub partials: &'a wgpu::Buffer,
}

/// The kernel format that stands for a KV dtype in a [`PipelineKey`].
pub fn kv_format(dtype: KvDtype) -> Result<WeightFormat, GpuError> {
    match dtype {
        KvDtype::F32 => Ok(WeightFormat::F32),
        KvDtype::F16 => Ok(WeightFormat::F16),
        KvDtype::Q8 => Ok(WeightFormat::Packed(crate::quant::QuantKind::Q8)),
        KvDtype::Q4 => Ok(WeightFormat::Packed(crate::quant::QuantKind::Q4Sym)),
        KvDtype::Bf16 => Err(GpuError::Validation {
            context: "attention".into(),
            message: "bf16 is a planning size only; the runtime caches f32, f16, q8 or q4".into(),
        }),
    }
}

/// Bytes of the partial results for steps of up to `max_tokens` tokens whose keys are cut
/// into up to `max_splits` ranges (0 when there is only ever one part).
pub fn partials_bytes(p: &AttentionParams, layout: &KvLayout, max_tokens: usize, max_splits: usize) -> u64 {
    let parts = layout.n_shards * max_splits.max(1);
    if parts == 1 {
        return 0;
    }
    (max_tokens * p.n_heads as usize * parts * (p.head_dim as usize + 2) * 4) as u64
}

/// Whether the barrier-free subgroup kernel can run this layer on this adapter.
pub fn subgroup_fits(ctx: &GpuContext, p: &AttentionParams) -> bool {
    super::linear::xbcast_fits(ctx) && p.head_dim.is_multiple_of(32)
}

/// The variant for this adapter: on CPU adapters with 8-lane subgroups the barrier-free
/// subgroup kernel (`XBCAST`), elsewhere the workgroup kernel.
pub async fn build(ctx: &GpuContext, io: &AttentionIo<'_>, p: AttentionParams) -> Result<Vec<Dispatch>, GpuError> {
    let sub = ctx.caps.cpu_like && subgroup_fits(ctx, &p);
    build_variant(ctx, io, p, sub).await
}

/// `subgroup`: the XBCAST kernel (one 8-lane subgroup per workgroup, head_dim a multiple of
/// 32). One dispatch per KV shard, then the reduce (which does nothing in steps with one part).
pub async fn build_variant(ctx: &GpuContext, io: &AttentionIo<'_>, p: AttentionParams, subgroup: bool) -> Result<Vec<Dispatch>, GpuError> {
    let invalid = |message: String| GpuError::Validation { context: "attention".into(), message };
    let layout = io.kv.layout;
    if subgroup && !subgroup_fits(ctx, &p) {
        return Err(invalid(format!(
            "the subgroup attention kernel needs 8-lane subgroups and head_dim a multiple of 32 (got {})",
            p.head_dim
        )));
    }
    if p.head_dim > MAX_HEAD_DIM || p.n_kv_heads == 0 || !p.n_heads.is_multiple_of(p.n_kv_heads) {
        return Err(invalid(format!(
            "unsupported head layout: {} heads, {} kv heads, head_dim {} (max {MAX_HEAD_DIM})",
            p.n_heads, p.n_kv_heads, p.head_dim
        )));
    }
    if layout.head_dim != p.head_dim as usize || layout.n_kv_heads != p.n_kv_heads as usize {
        return Err(invalid(format!(
            "the KV layout holds {} heads of {} dims but the layer has {} of {}",
            layout.n_kv_heads, layout.head_dim, p.n_kv_heads, p.head_dim
        )));
    }
    if io.kv.k.len() != layout.n_shards || io.kv.v.len() != layout.n_shards {
        return Err(invalid(format!("{} K and {} V buffers for a layout of {} shards", io.kv.k.len(), io.kv.v.len(), layout.n_shards)));
    }
    if layout.dtype != KvDtype::F32 && !p.head_dim.is_multiple_of(4) {
        return Err(invalid(format!("a {:?} KV cache needs head_dim a multiple of 4 (got {})", layout.dtype, p.head_dim)));
    }
    let kv = kv_format(layout.dtype)?;
    let group = p.n_heads / p.n_kv_heads;
    let key = if subgroup {
        PipelineKey::new(ShaderOp::Attention, 8)
            .with_flags(crate::gpu::shader::flags::XBCAST)
            .with_features(crate::gpu::Features { f16: false, subgroups: true })
    } else {
        PipelineKey::new(ShaderOp::Attention, 64)
    }
    .with_weights(kv);
    let pipe = pipeline(ctx, key).await?;
    let mut out = Vec::with_capacity(layout.n_shards + 1);
    for shard in 0..layout.n_shards {
        let u = AttentionUniform {
            n_heads: p.n_heads,
            n_kv_heads: p.n_kv_heads,
            head_dim: p.head_dim,
            qkv_stride: p.qkv_stride,
            page_size: layout.page_size as u32,
            max_pages: p.max_pages,
            out_stride: p.out_stride,
            scale: p.scale,
            pages_per_shard: layout.pages_per_shard as u32,
            shard: shard as u32,
            n_shards: layout.n_shards as u32,
            window: p.window,
            ring: layout.ring as u32,
            tail_base: layout.tail_base() as u32,
            _pad: 0,
            scale_base: layout.scale_base() as u32,
        };
        let ubuf = create_uniform(ctx, "attention.params", &u);
        let bg = bind(
            ctx,
            "attention",
            &pipe,
            &[
                (0, io.step),
                (1, &ubuf),
                (2, io.qkv),
                (3, io.positions),
                (4, io.token_seq),
                (5, io.block_table),
                (6, &io.kv.k[shard]),
                (7, &io.kv.v[shard]),
                (8, io.out),
                (9, io.partials),
            ],
        );
        out.push(Dispatch {
            label: format!("attention [{}]", key.label()),
            pipeline: pipe.clone(),
            bind_group: bg,
            // One workgroup per (KV head, batch of up to HEAD_BATCH query heads of its group),
            // token and key split.
            grid: [Dim::Const(p.n_kv_heads * group.div_ceil(HEAD_BATCH)), Dim::Tokens, Dim::Splits],
        });
    }
    let rkey = PipelineKey::new(ShaderOp::AttentionReduce, 64);
    let rpipe = pipeline(ctx, rkey).await?;
    let ru = ReduceUniform { n_heads: p.n_heads, head_dim: p.head_dim, out_stride: p.out_stride, n_shards: layout.n_shards as u32 };
    let rbuf = create_uniform(ctx, "attention_reduce.params", &ru);
    let rbg = bind(ctx, "attention_reduce", &rpipe, &[(0, io.step), (1, &rbuf), (2, io.partials), (3, io.out)]);
    out.push(Dispatch {
        label: format!("attention reduce [{}]", rkey.label()),
        pipeline: rpipe,
        bind_group: rbg,
        grid: [Dim::Const(p.n_heads), Dim::TokensIfParts(layout.n_shards as u32), Dim::Const(1)],
    });
    Ok(out)
}

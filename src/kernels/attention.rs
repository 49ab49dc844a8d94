//! Causal grouped-query attention over the paged KV cache (`shaders/attention.wgsl`).

use crate::gpu::buffer::create_uniform;
use crate::gpu::{GpuContext, GpuError, PipelineKey, ShaderOp};

use super::{bind, pipeline, Dim, Dispatch};

/// Mirrors `struct Params` in attention.wgsl.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct AttentionParams {
    pub n_heads: u32,
    pub n_kv_heads: u32,
    pub head_dim: u32,
    pub qkv_stride: u32,
    pub page_size: u32,
    pub max_pages: u32,
    pub out_stride: u32,
    pub scale: f32,
}

/// Largest head_dim the kernel supports (4 dims per lane x 64 lanes).
pub const MAX_HEAD_DIM: u32 = 256;

/// Query heads of one GQA group handled (sharing K/V loads) per workgroup; `HB` in the shader.
const HEAD_BATCH: u32 = 4;

/// The buffers of the attention op.
pub struct AttentionIo<'a> {
    pub step: &'a wgpu::Buffer,
    pub qkv: &'a wgpu::Buffer,
    pub positions: &'a wgpu::Buffer,
    pub token_seq: &'a wgpu::Buffer,
    pub block_table: &'a wgpu::Buffer,
    pub k_cache: &'a wgpu::Buffer,
    pub v_cache: &'a wgpu::Buffer,
    pub out: &'a wgpu::Buffer,
}

/// The variant for this adapter: on CPU adapters with 8-lane subgroups the barrier-free
/// subgroup kernel (`XBCAST`), elsewhere the workgroup kernel.
pub async fn build(ctx: &GpuContext, io: &AttentionIo<'_>, p: AttentionParams) -> Result<Dispatch, GpuError> {
    let sub = ctx.caps.cpu_like && super::linear::xbcast_fits(ctx) && p.head_dim.is_multiple_of(8);
    build_variant(ctx, io, p, sub).await
}

/// `subgroup`: the XBCAST kernel (one 8-lane subgroup per workgroup, head_dim a multiple of 8).
pub async fn build_variant(ctx: &GpuContext, io: &AttentionIo<'_>, p: AttentionParams, subgroup: bool) -> Result<Dispatch, GpuError> {
    if subgroup && (!super::linear::xbcast_fits(ctx) || !p.head_dim.is_multiple_of(8)) {
        return Err(GpuError::Validation {
            context: "attention".into(),
            message: format!("the subgroup attention kernel needs 8-lane subgroups and head_dim a multiple of 8 (got {})", p.head_dim),
        });
    }
    if p.head_dim > MAX_HEAD_DIM || p.n_kv_heads == 0 || !p.n_heads.is_multiple_of(p.n_kv_heads) {
        return Err(GpuError::Validation {
            context: "attention".into(),
            message: format!(
                "unsupported head layout: {} heads, {} kv heads, head_dim {} (max {MAX_HEAD_DIM})",
                p.n_heads, p.n_kv_heads, p.head_dim
            ),
        });
    }
    let group = p.n_heads / p.n_kv_heads;
    let key = if subgroup {
        PipelineKey::new(ShaderOp::Attention, 8)
            .with_flags(crate::gpu::shader::flags::XBCAST)
            .with_features(crate::gpu::Features { f16: false, subgroups: true })
    } else {
        PipelineKey::new(ShaderOp::Attention, 64)
    };
    let pipe = pipeline(ctx, key).await?;
    let ubuf = create_uniform(ctx, "attention.params", &p);
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
            (6, io.k_cache),
            (7, io.v_cache),
            (8, io.out),
        ],
    );
    Ok(Dispatch {
        label: format!("attention [{}]", key.label()),
        pipeline: pipe,
        bind_group: bg,
        // One workgroup per (KV head, batch of up to HEAD_BATCH query heads of its group).
        grid: [Dim::Const(p.n_kv_heads * group.div_ceil(HEAD_BATCH)), Dim::Tokens, Dim::Const(1)],
    })
}

//! RoPE on q/k plus the KV-cache write (`shaders/rope_kv.wgsl`; for a q4 cache followed by
//! `shaders/kv_seal.wgsl`, which stores K a page at a time), and the host-side cos/sin table
//! it reads.

use crate::gpu::buffer::create_uniform;
use crate::gpu::{GpuContext, GpuError, PipelineKey, ShaderOp};

use super::attention::{kv_format, KvBinding};
use super::{bind, pipeline, Dim, Dispatch};

/// Bytes of the `Params` uniform this op writes ([`super::params_size`]).
pub const UNIFORM_BYTES: usize = std::mem::size_of::<RopeKvUniform>();

/// Bytes of the seal pass's `Params` uniform ([`super::params_size`]).
pub const SEAL_UNIFORM_BYTES: usize = std::mem::size_of::<SealUniform>();

/// Invocations per workgroup of the seal pass (one per KV head, 8 channels and token).
pub const SEAL_WORKGROUP: u32 = 64;

/// The sizes of one layer's RoPE + KV write.
#[derive(Debug, Clone, Copy, Default)]
pub struct RopeKvParams {
    pub n_heads: u32,
    pub n_kv_heads: u32,
    pub head_dim: u32,
    /// Floats per fused q|k|v row.
    pub qkv_stride: u32,
    /// Entries per block-table row.
    pub max_pages: u32,
    /// Positions the cos/sin table covers.
    pub n_positions: u32,
}

/// Mirrors `struct Params` in rope_kv.wgsl.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
struct RopeKvUniform {
    n_heads: u32,
    n_kv_heads: u32,
    head_dim: u32,
    qkv_stride: u32,
    page_size: u32,
    max_pages: u32,
    n_positions: u32,
    pages_per_shard: u32,
    shard: u32,
    scale_base: u32,
    ring: u32,
    tail_base: u32,
}

/// Mirrors `struct Params` in kv_seal.wgsl.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
struct SealUniform {
    n_heads: u32,
    n_kv_heads: u32,
    head_dim: u32,
    qkv_stride: u32,
    page_size: u32,
    max_pages: u32,
    pages_per_shard: u32,
    shard: u32,
    scale_base: u32,
    ring: u32,
    tail_base: u32,
    phase: u32,
}

/// `RopeKvUniform`'s named fields and offsets (`kernels::params_fields`).
pub(crate) fn uniform_fields() -> Vec<(&'static str, usize)> {
    field_offsets!(RopeKvUniform; n_heads, n_kv_heads, head_dim, qkv_stride, page_size, max_pages, n_positions, pages_per_shard, shard, scale_base, ring, tail_base)
}

/// `SealUniform`'s named fields and offsets (`kernels::params_fields`).
pub(crate) fn seal_uniform_fields() -> Vec<(&'static str, usize)> {
    field_offsets!(SealUniform; n_heads, n_kv_heads, head_dim, qkv_stride, page_size, max_pages, pages_per_shard, shard, scale_base, ring, tail_base, phase)
}

/// cos/sin table: row `pos` holds cos(pos * inv_freq[i]) for i < hd/2, then the sines, each
/// times `mscale` (LongRoPE's attention factor; 1 otherwise). The angle is formed in f32 (as
/// transformers does), the cos/sin taken in f64.
pub fn rope_table(inv_freq: &[f32], n_positions: usize, mscale: f32) -> Vec<f32> {
    let half = inv_freq.len();
    let mut t = vec![0.0f32; n_positions * half * 2];
    for pos in 0..n_positions {
        for (i, &f) in inv_freq.iter().enumerate() {
            let angle = (pos as f32 * f) as f64;
            t[pos * 2 * half + i] = angle.cos() as f32 * mscale;
            t[pos * 2 * half + half + i] = angle.sin() as f32 * mscale;
        }
    }
    t
}

/// The buffers of the rope + KV write op.
pub struct RopeKvIo<'a> {
    pub step: &'a wgpu::Buffer,
    pub qkv: &'a wgpu::Buffer,
    pub rope: &'a wgpu::Buffer,
    pub positions: &'a wgpu::Buffer,
    pub token_seq: &'a wgpu::Buffer,
    pub block_table: &'a wgpu::Buffer,
    pub kv: KvBinding<'a>,
}

/// One dispatch per KV shard (each writes the tokens whose page lies in its shard; the
/// first also rotates q), and for a q4 cache one seal dispatch per shard after them (the
/// tokens of a sequence must be consecutive rows at consecutive positions, as steps lay
/// them out); a q4 cache also needs [`build_tail`]'s dispatches after attention.
pub async fn build(ctx: &GpuContext, io: &RopeKvIo<'_>, p: RopeKvParams) -> Result<Vec<Dispatch>, GpuError> {
    let layout = io.kv.layout;
    if !p.head_dim.is_multiple_of(2) || p.n_kv_heads == 0 || !p.n_heads.is_multiple_of(p.n_kv_heads) {
        return Err(GpuError::Validation {
            context: "rope_kv".into(),
            message: format!("bad head layout: {} heads, {} kv heads, head_dim {}", p.n_heads, p.n_kv_heads, p.head_dim),
        });
    }
    if layout.head_dim != p.head_dim as usize
        || layout.n_kv_heads != p.n_kv_heads as usize
        || io.kv.k.len() != layout.n_shards
        || io.kv.v.len() != layout.n_shards
    {
        return Err(GpuError::Validation {
            context: "rope_kv".into(),
            message: format!(
                "the KV layout ({} heads of {} dims, {} shards) does not match the layer ({} heads of {}) and its {} buffers",
                layout.n_kv_heads,
                layout.head_dim,
                layout.n_shards,
                p.n_kv_heads,
                p.head_dim,
                io.kv.k.len()
            ),
        });
    }
    let key = PipelineKey::new(ShaderOp::RopeKv, 64).with_weights(kv_format(layout.dtype)?);
    let pipe = pipeline(ctx, key).await?;
    let q4 = layout.dtype == crate::kv::plan::KvDtype::Q4;
    // With a q4 cache the rotation covers the k heads too (kv_seal.wgsl reads them).
    let rotated = if q4 { p.n_heads + p.n_kv_heads } else { p.n_heads };
    let per_token = rotated * p.head_dim / 2 + p.n_kv_heads;
    let mut out = Vec::with_capacity(layout.n_shards);
    for shard in 0..layout.n_shards {
        let u = RopeKvUniform {
            n_heads: p.n_heads,
            n_kv_heads: p.n_kv_heads,
            head_dim: p.head_dim,
            qkv_stride: p.qkv_stride,
            page_size: layout.page_size as u32,
            max_pages: p.max_pages,
            n_positions: p.n_positions,
            pages_per_shard: layout.pages_per_shard as u32,
            shard: shard as u32,
            scale_base: layout.scale_base() as u32,
            ring: layout.ring as u32,
            tail_base: layout.tail_base() as u32,
        };
        let ubuf = create_uniform(ctx, "rope_kv.params", &u);
        let mut entries = vec![
            (0, io.step),
            (1, &ubuf),
            (2, io.qkv),
            (3, io.rope),
            (4, io.positions),
            (5, io.token_seq),
            (6, io.block_table),
            (8, &io.kv.v[shard]),
        ];
        // A q4 cache's K is written by the seal pass; this shader does not bind it.
        if !q4 {
            entries.push((7, &io.kv.k[shard]));
        }
        let bg = bind(ctx, "rope_kv", &pipe, &entries);
        out.push(Dispatch {
            label: format!("rope_kv [{}]", key.label()),
            pipeline: pipe.clone(),
            bind_group: bg,
            grid: [Dim::Const(per_token.div_ceil(64)), Dim::Tokens, Dim::Const(1)],
        });
    }
    if q4 {
        out.extend(seal_pass(ctx, io, p, 0).await?);
    }
    Ok(out)
}

/// A q4 cache's second seal pass, to record after the layer's attention: the f16 tail of
/// each sequence's last two pages (attention reads the tail of the page the step starts
/// in, which this overwrites). Nothing for the other dtypes.
pub async fn build_tail(ctx: &GpuContext, io: &RopeKvIo<'_>, p: RopeKvParams) -> Result<Vec<Dispatch>, GpuError> {
    if io.kv.layout.dtype != crate::kv::plan::KvDtype::Q4 {
        return Ok(Vec::new());
    }
    seal_pass(ctx, io, p, 1).await
}

/// One `kv_seal.wgsl` dispatch per shard in `phase` (0: seal and step rows; 1: tail).
async fn seal_pass(ctx: &GpuContext, io: &RopeKvIo<'_>, p: RopeKvParams, phase: u32) -> Result<Vec<Dispatch>, GpuError> {
    let layout = io.kv.layout;
    let key = PipelineKey::new(ShaderOp::KvSeal, SEAL_WORKGROUP).with_weights(kv_format(layout.dtype)?);
    let pipe = pipeline(ctx, key).await?;
    let lanes = p.n_kv_heads * p.head_dim / 8;
    let mut out = Vec::with_capacity(layout.n_shards);
    for shard in 0..layout.n_shards {
        let u = SealUniform {
            n_heads: p.n_heads,
            n_kv_heads: p.n_kv_heads,
            head_dim: p.head_dim,
            qkv_stride: p.qkv_stride,
            page_size: layout.page_size as u32,
            max_pages: p.max_pages,
            pages_per_shard: layout.pages_per_shard as u32,
            shard: shard as u32,
            scale_base: layout.scale_base() as u32,
            ring: layout.ring as u32,
            tail_base: layout.tail_base() as u32,
            phase,
        };
        let ubuf = create_uniform(ctx, "kv_seal.params", &u);
        let bg = bind(
            ctx,
            "kv_seal",
            &pipe,
            &[(0, io.step), (1, &ubuf), (2, io.qkv), (3, io.positions), (4, io.token_seq), (5, io.block_table), (6, &io.kv.k[shard])],
        );
        out.push(Dispatch {
            label: format!("kv_seal{} [{}]", if phase == 0 { "" } else { " tail" }, key.label()),
            pipeline: pipe.clone(),
            bind_group: bg,
            grid: [Dim::Const(lanes.div_ceil(SEAL_WORKGROUP)), Dim::Tokens, Dim::Const(1)],
        });
    }
    Ok(out)
}

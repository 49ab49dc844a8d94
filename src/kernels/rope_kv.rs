//! RoPE on q/k plus the KV-cache write (`shaders/rope_kv.wgsl`), and the host-side cos/sin
//! table it reads.

use crate::gpu::buffer::create_uniform;
use crate::gpu::{GpuContext, GpuError, PipelineKey, ShaderOp};

use super::attention::{kv_format, KvBinding};
use super::{bind, pipeline, Dim, Dispatch};

/// Bytes of the `Params` uniform this op writes ([`super::params_size`]).
pub const UNIFORM_BYTES: usize = std::mem::size_of::<RopeKvUniform>();

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
    _pad: u32,
}

/// `RopeKvUniform`'s named fields and offsets (`kernels::params_fields`).
pub(crate) fn uniform_fields() -> Vec<(&'static str, usize)> {
    field_offsets!(RopeKvUniform; n_heads, n_kv_heads, head_dim, qkv_stride, page_size, max_pages, n_positions, pages_per_shard, shard, scale_base, ring)
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
/// first also rotates q).
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
    let per_token = p.n_heads * p.head_dim / 2 + p.n_kv_heads;
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
            _pad: 0,
        };
        let ubuf = create_uniform(ctx, "rope_kv.params", &u);
        let bg = bind(
            ctx,
            "rope_kv",
            &pipe,
            &[
                (0, io.step),
                (1, &ubuf),
                (2, io.qkv),
                (3, io.rope),
                (4, io.positions),
                (5, io.token_seq),
                (6, io.block_table),
                (7, &io.kv.k[shard]),
                (8, &io.kv.v[shard]),
            ],
        );
        out.push(Dispatch {
            label: format!("rope_kv [{}]", key.label()),
            pipeline: pipe.clone(),
            bind_group: bg,
            grid: [Dim::Const(per_token.div_ceil(64)), Dim::Tokens, Dim::Const(1)],
        });
    }
    Ok(out)
}

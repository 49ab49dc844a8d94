//! RoPE on q/k plus the KV-cache write (`shaders/rope_kv.wgsl`), and the host-side cos/sin
//! table it reads.

use crate::gpu::buffer::create_uniform;
use crate::gpu::{GpuContext, GpuError, PipelineKey, ShaderOp};

use super::{bind, pipeline, Dim, Dispatch};

/// Mirrors `struct Params` in rope_kv.wgsl.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct RopeKvParams {
    pub n_heads: u32,
    pub n_kv_heads: u32,
    pub head_dim: u32,
    pub qkv_stride: u32,
    pub page_size: u32,
    pub max_pages: u32,
    pub n_positions: u32,
    pub _pad: u32,
}

/// cos/sin table: row `pos` holds cos(pos * inv_freq[i]) for i < hd/2, then the sines.
/// The angle is formed in f32 (as transformers does), the cos/sin taken in f64.
pub fn rope_table(inv_freq: &[f32], n_positions: usize) -> Vec<f32> {
    let half = inv_freq.len();
    let mut t = vec![0.0f32; n_positions * half * 2];
    for pos in 0..n_positions {
        for (i, &f) in inv_freq.iter().enumerate() {
            let angle = (pos as f32 * f) as f64;
            t[pos * 2 * half + i] = angle.cos() as f32;
            t[pos * 2 * half + half + i] = angle.sin() as f32;
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
    pub k_cache: &'a wgpu::Buffer,
    pub v_cache: &'a wgpu::Buffer,
}

pub async fn build(ctx: &GpuContext, io: &RopeKvIo<'_>, p: RopeKvParams) -> Result<Dispatch, GpuError> {
    if !p.head_dim.is_multiple_of(2) || p.n_kv_heads == 0 || !p.n_heads.is_multiple_of(p.n_kv_heads) {
        return Err(GpuError::Validation {
            context: "rope_kv".into(),
            message: format!("bad head layout: {} heads, {} kv heads, head_dim {}", p.n_heads, p.n_kv_heads, p.head_dim),
        });
    }
    let key = PipelineKey::new(ShaderOp::RopeKv, 64);
    let pipe = pipeline(ctx, key).await?;
    let ubuf = create_uniform(ctx, "rope_kv.params", &p);
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
            (7, io.k_cache),
            (8, io.v_cache),
        ],
    );
    let per_token = (p.n_heads + p.n_kv_heads) * p.head_dim / 2;
    Ok(Dispatch {
        label: "rope_kv".into(),
        pipeline: pipe,
        bind_group: bg,
        grid: [Dim::Const(per_token.div_ceil(64)), Dim::Tokens, Dim::Const(1)],
    })
}

//! Embedding gather (`shaders/embedding.wgsl`): one dispatch per row chunk of the table.

use crate::gpu::buffer::create_uniform;
use crate::gpu::{GpuContext, GpuError, PipelineKey, ShaderOp};

use super::linear::GpuLinear;

use super::{bind, pipeline, Dim, Dispatch};

/// Mirrors `struct Params` in embedding.wgsl.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct EmbeddingParams {
    pub k: u32,
    pub row_offset: u32,
    pub n_rows: u32,
    /// Elements per scale of packed tables (0 otherwise).
    pub group: u32,
    /// Multiplies every gathered value.
    pub scale: f32,
    pub _pad: [u32; 3],
}

/// `y[t] = table[ids[t]] * scale` for a table (vocab x k, any weight format) held as a linear
/// layer, so a tied table is the LM head's own buffers (`scale`: 1.0, or the model's
/// embedding scale).
pub async fn build(
    ctx: &GpuContext,
    step: &wgpu::Buffer,
    ids: &wgpu::Buffer,
    table: &GpuLinear,
    y: &wgpu::Buffer,
    scale: f32,
) -> Result<Vec<Dispatch>, GpuError> {
    let k = table.k;
    let key = PipelineKey::new(ShaderOp::Embedding, 64).with_weights(table.format);
    let pipe = pipeline(ctx, key).await?;
    let mut out = Vec::new();
    for (ci, c) in table.w.chunks.iter().enumerate() {
        let params = EmbeddingParams {
            k: k as u32,
            row_offset: c.row_offset as u32,
            n_rows: c.rows as u32,
            group: table.quant.map_or(0, |q| q.group),
            scale,
            _pad: [0; 3],
        };
        let ubuf = create_uniform(ctx, "embedding.params", &params);
        let mut entries = vec![(0, step), (1, &ubuf), (2, ids), (3, &c.buffer), (4, y)];
        if let Some(s) = &table.w_scales {
            entries.push((5, &s.chunks[ci].buffer));
        }
        let bg = bind(ctx, "embedding", &pipe, &entries);
        out.push(Dispatch {
            label: format!("embedding [{}]", key.label()),
            pipeline: pipe.clone(),
            bind_group: bg,
            grid: [Dim::Const((k as u32).div_ceil(64)), Dim::Tokens, Dim::Const(1)],
        });
    }
    Ok(out)
}

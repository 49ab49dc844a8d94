//! Embedding gather (`shaders/embedding.wgsl`): one dispatch per row chunk of the table.

use crate::gpu::buffer::create_uniform;
use crate::gpu::shader::WeightFormat;
use crate::gpu::{GpuContext, GpuError, GpuTensor, PipelineKey, ShaderOp};

use super::{bind, pipeline, Dim, Dispatch};

/// Mirrors `struct Params` in embedding.wgsl.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct EmbeddingParams {
    pub k: u32,
    pub row_offset: u32,
    pub n_rows: u32,
    pub _pad: u32,
}

/// `y[t] = table[ids[t]]` for a table of `k`-wide rows in `format`.
pub async fn build(
    ctx: &GpuContext,
    step: &wgpu::Buffer,
    ids: &wgpu::Buffer,
    table: &GpuTensor,
    format: WeightFormat,
    k: usize,
    y: &wgpu::Buffer,
) -> Result<Vec<Dispatch>, GpuError> {
    let key = PipelineKey::new(ShaderOp::Embedding, 64).with_weights(format);
    let pipe = pipeline(ctx, key).await?;
    let mut out = Vec::new();
    for c in &table.chunks {
        let params = EmbeddingParams {
            k: k as u32,
            row_offset: c.row_offset as u32,
            n_rows: c.rows as u32,
            _pad: 0,
        };
        let ubuf = create_uniform(ctx, "embedding.params", &params);
        let bg = bind(ctx, "embedding", &pipe, &[(0, step), (1, &ubuf), (2, ids), (3, &c.buffer), (4, y)]);
        out.push(Dispatch {
            label: format!("embedding [{}]", key.label()),
            pipeline: pipe.clone(),
            bind_group: bg,
            grid: [Dim::Const((k as u32).div_ceil(64)), Dim::Tokens, Dim::Const(1)],
        });
    }
    Ok(out)
}

//! Embedding gather (`shaders/embedding.wgsl`): one dispatch per row chunk of the table.

use crate::gpu::buffer::create_uniform;
use crate::gpu::{GpuContext, GpuError, PipelineKey, ShaderOp};

use super::linear::{GpuLinear, Store};

use super::{pipeline, Dim, Dispatch};
use crate::gpu::shader::flags;

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
    let tiled = table.is_tiled();
    let key = PipelineKey::new(ShaderOp::Embedding, 64).with_flags(if tiled { flags::TEX } else { 0 }).with_weights(table.format);
    let pipe = pipeline(ctx, key).await?;
    let mut out = Vec::new();
    for (ci, (row_offset, rows)) in table.chunks().into_iter().enumerate() {
        let params = EmbeddingParams {
            k: k as u32,
            row_offset: row_offset as u32,
            n_rows: rows as u32,
            group: table.quant.map_or(0, |q| q.group),
            scale,
            _pad: [0; 3],
        };
        let ubuf = create_uniform(ctx, "embedding.params", &params);
        let mut entries = vec![
            wgpu::BindGroupEntry { binding: 0, resource: step.as_entire_binding() },
            wgpu::BindGroupEntry { binding: 1, resource: ubuf.as_entire_binding() },
            wgpu::BindGroupEntry { binding: 2, resource: ids.as_entire_binding() },
            wgpu::BindGroupEntry { binding: 4, resource: y.as_entire_binding() },
        ];
        match &table.store {
            Store::Buffers { w, w_scales, .. } => {
                entries.push(wgpu::BindGroupEntry { binding: 3, resource: w.chunks[ci].buffer.as_entire_binding() });
                if let Some(s) = w_scales {
                    entries.push(wgpu::BindGroupEntry { binding: 5, resource: s.chunks[ci].buffer.as_entire_binding() });
                }
            }
            Store::Tiled { w, ws, .. } => {
                entries.push(wgpu::BindGroupEntry { binding: 11, resource: wgpu::BindingResource::TextureView(&w.chunks[ci].view) });
                entries.push(wgpu::BindGroupEntry { binding: 12, resource: wgpu::BindingResource::TextureView(&ws.chunks[ci].view) });
            }
        }
        let bg = ctx.bind_group(&wgpu::BindGroupDescriptor {
            label: Some("embedding"),
            layout: &pipe.get_bind_group_layout(0),
            entries: &entries,
        });
        out.push(Dispatch {
            label: format!("embedding [{}]", key.label()),
            pipeline: pipe.clone(),
            bind_group: bg,
            grid: [Dim::Const((k as u32).div_ceil(64)), Dim::Tokens, Dim::Const(1)],
        });
    }
    Ok(out)
}

//! Standalone RMSNorm (`shaders/rmsnorm.wgsl`). The forward pass folds the norm into the
//! following linear kernel; this op exists for hidden-state outputs and as the plain form.

use crate::gpu::buffer::create_uniform;
use crate::gpu::{GpuContext, GpuError, PipelineKey, ShaderOp};

use super::{bind, pipeline, Dim, Dispatch};

/// Mirrors `struct Params` in rmsnorm.wgsl.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct RmsNormParams {
    pub k: u32,
    pub eps: f32,
    pub _pad: [u32; 2],
}

/// `y[t] = rmsnorm(x[t]) * g` for every token row.
pub async fn build(
    ctx: &GpuContext,
    step: &wgpu::Buffer,
    x: &wgpu::Buffer,
    g: &wgpu::Buffer,
    y: &wgpu::Buffer,
    k: usize,
    eps: f32,
) -> Result<Dispatch, GpuError> {
    let key = PipelineKey::new(ShaderOp::RmsNorm, 64);
    let pipe = pipeline(ctx, key).await?;
    let ubuf = create_uniform(ctx, "rmsnorm.params", &RmsNormParams { k: k as u32, eps, _pad: [0; 2] });
    let bg = bind(ctx, "rmsnorm", &pipe, &[(0, step), (1, &ubuf), (2, x), (3, g), (4, y)]);
    Ok(Dispatch {
        label: "rmsnorm".into(),
        pipeline: pipe,
        bind_group: bg,
        grid: [Dim::Tokens, Dim::Const(1), Dim::Const(1)],
    })
}

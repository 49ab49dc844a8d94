//! Greedy sampling on the GPU (`shaders/argmax.wgsl`): 4 bytes per row come back.

use crate::gpu::buffer::create_uniform;
use crate::gpu::{GpuContext, GpuError, PipelineKey, ShaderOp};

use super::{bind, pipeline, Dim, Dispatch};

/// Mirrors `struct Params` in argmax.wgsl.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct ArgmaxParams {
    pub n: u32,
    pub _pad: [u32; 3],
}

/// `out[r] = argmax(logits[r, :n])` for the step's `n_out` rows.
pub async fn build(
    ctx: &GpuContext,
    step: &wgpu::Buffer,
    logits: &wgpu::Buffer,
    out: &wgpu::Buffer,
    n: usize,
) -> Result<Dispatch, GpuError> {
    let key = PipelineKey::new(ShaderOp::Argmax, 256);
    let pipe = pipeline(ctx, key).await?;
    let ubuf = create_uniform(ctx, "argmax.params", &ArgmaxParams { n: n as u32, _pad: [0; 3] });
    let bg = bind(ctx, "argmax", &pipe, &[(0, step), (1, &ubuf), (2, logits), (3, out)]);
    Ok(Dispatch { label: "argmax".into(), pipeline: pipe, bind_group: bg, grid: [Dim::Out, Dim::Const(1), Dim::Const(1)] })
}

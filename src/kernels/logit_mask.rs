//! Constrained decoding on the GPU (`shaders/logit_mask.wgsl`): the allowed-token bitmask of
//! each logits row (`ceil(vocab / 32)` words, llguidance's layout) sets every disallowed
//! logit to -inf in place, so argmax, top-k and the logits readback only ever see tokens
//! the grammar allows, and greedy still reads back 4 bytes.

use crate::gpu::buffer::create_uniform;
use crate::gpu::{GpuContext, GpuError, PipelineKey, ShaderOp};

use super::{bind, pipeline, Dim, Dispatch};

/// Invocations per workgroup (one mask word each).
pub const WORKGROUP: u32 = 64;

/// Mirrors `struct Params` in logit_mask.wgsl.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct LogitMaskParams {
    pub n: u32,
    pub words: u32,
    pub fill: f32,
    pub _pad: u32,
}

/// Mask words per row of `n` logits.
pub fn words(n: usize) -> usize {
    n.div_ceil(32)
}

/// `logits[r, i] = -inf` where bit `i` of `mask[r]` is clear, for the step's `n_out` rows
/// of `n` logits (`mask`: `n_out x words(n)` u32).
pub async fn build(
    ctx: &GpuContext,
    step: &wgpu::Buffer,
    mask: &wgpu::Buffer,
    logits: &wgpu::Buffer,
    n: usize,
) -> Result<Dispatch, GpuError> {
    let key = PipelineKey::new(ShaderOp::LogitMask, WORKGROUP);
    let pipe = pipeline(ctx, key).await?;
    let w = words(n);
    let params = LogitMaskParams { n: n as u32, words: w as u32, fill: f32::NEG_INFINITY, _pad: 0 };
    let ubuf = create_uniform(ctx, "logit_mask.params", &params);
    let bg = bind(ctx, "logit_mask", &pipe, &[(0, step), (1, &ubuf), (2, mask), (3, logits)]);
    Ok(Dispatch {
        label: "logit_mask".into(),
        pipeline: pipe,
        bind_group: bg,
        grid: [Dim::Const((w as u32).div_ceil(WORKGROUP)), Dim::Out, Dim::Const(1)],
    })
}

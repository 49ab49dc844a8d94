//! Sampling on the GPU (`shaders/sample.wgsl`): a token drawn from each row's top-k pairs
//! (temperature, top-k, top-p, one uniform number per row from the host's generator), written
//! where the next step's embedding reads it, so sampled decoding can run ahead of the host
//! like greedy decoding. The host's sampler stays the reference: it draws from the same pairs
//! and the decode loop keeps its token when the two differ (f32 rounding at a boundary).

use crate::gpu::{GpuContext, GpuError, PipelineKey, ShaderOp};

use super::{bind, pipeline, Dim, Dispatch};

/// Mirrors `struct Params` in sample.wgsl: the request's sampling parameters.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct SampleParams {
    pub temperature: f32,
    /// Pairs considered, 1..=TOPK_MAX (0: all of them).
    pub top_k: u32,
    pub top_p: f32,
    pub _pad: u32,
}

impl SampleParams {
    /// Whether the kernel can draw with these: a positive temperature, a top-k of at most
    /// `TOPK_MAX` (0: all of them) and a top-p above 0; else what is wrong, in words.
    pub fn check(&self) -> Result<(), String> {
        let positive = |v: f32| v.is_finite() && v > 0.0;
        if positive(self.temperature) && self.top_k as usize <= super::topk::TOPK_MAX && positive(self.top_p) {
            return Ok(());
        }
        Err(format!(
            "sampling on the GPU needs a positive temperature, top-k of at most {} and top-p above 0 (got {self:?})",
            super::topk::TOPK_MAX
        ))
    }
}

/// The dispatch drawing `ids[r]` for the step's `n_out` rows from `top` (topk.wgsl's rows)
/// with `params` (a uniform the caller writes per request) and `u` (one f32 per row).
pub async fn build(
    ctx: &GpuContext,
    step: &wgpu::Buffer,
    params: &wgpu::Buffer,
    top: &wgpu::Buffer,
    u: &wgpu::Buffer,
    ids: &wgpu::Buffer,
) -> Result<Dispatch, GpuError> {
    let pipe = pipeline(ctx, PipelineKey::new(ShaderOp::Sample, 64)).await?;
    let bg = bind(ctx, "sample", &pipe, &[(0, step), (1, params), (2, top), (3, u), (4, ids)]);
    Ok(Dispatch { label: "sample".into(), pipeline: pipe, bind_group: bg, grid: [Dim::OutDiv(64), Dim::Const(1), Dim::Const(1)] })
}

/// The draw `sample.wgsl` makes, on the host in f32 (the kernel's tests compare with it).
pub fn draw(top: &[(u32, f32)], params: &SampleParams, u: f32) -> u32 {
    let kk = if params.top_k > 0 { (params.top_k as usize).min(super::topk::TOPK_MAX) } else { super::topk::TOPK_MAX };
    let cand = &top[..top.len().min(kk)];
    let Some(&(_, v0)) = cand.first() else { return 0 };
    let t = params.temperature;
    let e = |v: f32| (v / t - v0 / t).exp();
    let sum: f32 = cand.iter().map(|c| e(c.1)).sum();
    let mut keep = cand.len();
    if params.top_p < 1.0 {
        let mut acc = 0.0;
        for (j, c) in cand.iter().enumerate() {
            acc += e(c.1) / sum;
            if acc >= params.top_p {
                keep = j + 1;
                break;
            }
        }
    }
    let kept: f32 = cand[..keep].iter().map(|c| e(c.1) / sum).sum();
    let mut acc = 0.0;
    for c in &cand[..keep] {
        acc += e(c.1) / sum / kept;
        if u < acc {
            return c.0;
        }
    }
    cand[keep - 1].0
}

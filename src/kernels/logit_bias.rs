//! OpenAI's `logit_bias` and presence/frequency penalties on the GPU
//! (`shaders/logit_bias.wgsl`): sparse `(token, delta)` pairs per logit row are added to the
//! logits in place, before the logit mask, argmax, top-k and the logits readback, so a
//! biased token competes in the GPU's own argmax and top-k like any other.

use crate::gpu::buffer::create_uniform;
use crate::gpu::{GpuContext, GpuError, PipelineKey, ShaderOp};

use super::{bind, pipeline, Dim, Dispatch};

/// Invocations per workgroup (one workgroup per logit row).
pub const WORKGROUP: u32 = 64;

/// Mirrors `struct Params` in logit_bias.wgsl.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct LogitBiasParams {
    pub n: u32,
    pub base: u32,
    pub _pad0: u32,
    pub _pad1: u32,
}

/// (token, delta) pairs per logit row a bias buffer first holds room for; a step that brings
/// more grows it (`GpuModel` replaces the buffer and rebinds the dispatch).
pub const INITIAL_PAIRS_PER_ROW: usize = 64;

/// Bytes of a first bias buffer for steps of up to `max_rows` logit rows.
pub fn initial_bytes(max_rows: usize) -> u64 {
    (words(max_rows, max_rows * INITIAL_PAIRS_PER_ROW) * 4) as u64
}

/// Words of a bias buffer for steps of up to `max_rows` logit rows holding `pairs` pairs.
pub fn words(max_rows: usize, pairs: usize) -> usize {
    max_rows + 1 + 2 * pairs
}

/// The buffer's contents for `rows` (row `r`'s `(token, delta)` pairs; rows past
/// `rows.len()` up to `max_rows` have none): `max_rows + 1` offsets, then the pairs.
pub fn pack(rows: &[Vec<(u32, f32)>], max_rows: usize) -> Vec<u32> {
    let pairs: usize = rows.iter().map(Vec::len).sum();
    let mut out = Vec::with_capacity(words(max_rows, pairs));
    let mut at = 0u32;
    out.push(0);
    for r in 0..max_rows {
        at += rows.get(r).map_or(0, Vec::len) as u32;
        out.push(at);
    }
    for row in rows {
        for &(t, d) in row {
            out.push(t);
            out.push(d.to_bits());
        }
    }
    out
}

/// `logits[r, t] += delta` for every pair of the step's `n_out` rows of `n` logits, from a
/// buffer `pack`ed for `max_rows` rows.
pub async fn build(
    ctx: &GpuContext,
    step: &wgpu::Buffer,
    bias: &wgpu::Buffer,
    logits: &wgpu::Buffer,
    n: usize,
    max_rows: usize,
) -> Result<Dispatch, GpuError> {
    let pipe = pipeline(ctx, PipelineKey::new(ShaderOp::LogitBias, WORKGROUP)).await?;
    Ok(rebind(ctx, pipe, step, bias, logits, n, max_rows))
}

/// The dispatch of `pipe` (from a [`build`]) bound to these buffers: a plan rebinds it when
/// its bias buffer grows.
pub fn rebind(
    ctx: &GpuContext,
    pipe: std::sync::Arc<wgpu::ComputePipeline>,
    step: &wgpu::Buffer,
    bias: &wgpu::Buffer,
    logits: &wgpu::Buffer,
    n: usize,
    max_rows: usize,
) -> Dispatch {
    let params = LogitBiasParams { n: n as u32, base: (max_rows + 1) as u32, _pad0: 0, _pad1: 0 };
    let ubuf = create_uniform(ctx, "logit_bias.params", &params);
    let bg = bind(ctx, "logit_bias", &pipe, &[(0, step), (1, &ubuf), (2, bias), (3, logits)]);
    Dispatch { label: "logit_bias".into(), pipeline: pipe, bind_group: bg, grid: [Dim::Const(1), Dim::Out, Dim::Const(1)] }
}

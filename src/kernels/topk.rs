//! GPU top-k of sampled rows (`shaders/topk.wgsl`): the K best (id, logit) pairs per row,
//! 8 K bytes read back per row instead of the vocabulary's logits.

use crate::gpu::buffer::create_uniform;
use crate::gpu::{GpuContext, GpuError, PipelineKey, ShaderOp};

use super::{bind, pipeline, Dim, Dispatch};

/// Bytes of the `Params` uniform this op writes ([`super::params_size`]).
pub const UNIFORM_BYTES: usize = std::mem::size_of::<TopkParams>();

/// Pairs per row the kernel can return (`KMAX` in the shader).
pub const TOPK_MAX: usize = 64;

/// Words per output row (`ROW` in the shader): `TOPK_MAX` ids, `TOPK_MAX` values, the row's
/// logsumexp, a pad word.
pub const TOPK_ROW_WORDS: usize = 2 * TOPK_MAX + 2;

/// Mirrors `struct Params` in topk.wgsl.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
struct TopkParams {
    n: u32,
    k: u32,
    _pad: [u32; 2],
}

/// `TopkParams`' named fields and offsets (`kernels::params_fields`).
pub(crate) fn uniform_fields() -> Vec<(&'static str, usize)> {
    field_offsets!(TopkParams; n, k)
}

/// `out[r]` = the `k` (at most [`TOPK_MAX`]) best (id, value) of `logits[r, :n]` for the
/// step's `n_out` rows: ids in words `0..TOPK_MAX` of the row's [`TOPK_ROW_WORDS`], values
/// (f32 bits) in `TOPK_MAX..2 TOPK_MAX`, the logsumexp of the row's finite values at
/// `2 TOPK_MAX` ([`row_logsumexp`]).
pub async fn build(
    ctx: &GpuContext,
    step: &wgpu::Buffer,
    logits: &wgpu::Buffer,
    out: &wgpu::Buffer,
    n: usize,
    k: usize,
) -> Result<Dispatch, GpuError> {
    if k == 0 || k > TOPK_MAX {
        return Err(GpuError::Validation {
            context: "topk".into(),
            message: format!("k = {k}: the kernel returns 1..={TOPK_MAX} pairs per row"),
        });
    }
    let key = PipelineKey::new(ShaderOp::TopK, 64);
    let pipe = pipeline(ctx, key).await?;
    let ubuf = create_uniform(ctx, "topk.params", &TopkParams { n: n as u32, k: k as u32, _pad: [0; 2] });
    let bg = bind(ctx, "topk", &pipe, &[(0, step), (1, &ubuf), (2, logits), (3, out)]);
    Ok(Dispatch { label: "topk".into(), pipeline: pipe, bind_group: bg, grid: [Dim::Out, Dim::Const(1), Dim::Const(1)] })
}

/// The row's logsumexp from its words: `logit - logsumexp` is a token's log-probability.
pub fn row_logsumexp(words: &[u32]) -> f32 {
    f32::from_bits(words[2 * TOPK_MAX])
}

/// One row's pairs from the words the kernel wrote ([`TOPK_ROW_WORDS`] per row), best first,
/// without the empty slots.
pub fn decode_row(words: &[u32], k: usize) -> Vec<(u32, f32)> {
    (0..k.min(TOPK_MAX)).filter(|&j| words[j] != u32::MAX).map(|j| (words[j], f32::from_bits(words[TOPK_MAX + j]))).collect()
}

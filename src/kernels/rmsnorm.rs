//! RMSNorm over rows (`shaders/rmsnorm.wgsl`): the norms that follow an op. The forward pass
//! folds every projection's input norm into the projection (`flags::NORM`); this op applies
//! Gemma's sandwich norms of the attention and MLP outputs (`Mode::Residual`) and the q/k
//! norms over each head, or over the whole q and k projections (OLMoE), inside the fused
//! q|k|v rows (`Mode::InPlace`).

use crate::gpu::buffer::create_uniform;
use crate::gpu::shader::flags;
use crate::gpu::{GpuContext, GpuError, PipelineKey, ShaderOp};

use super::{bind, pipeline, Dim, Dispatch};

/// Mirrors `struct Params` in rmsnorm.wgsl.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct RmsNormParams {
    pub k: u32,
    pub eps: f32,
    pub rows: u32,
    pub token_stride: u32,
    pub row_stride: u32,
    pub split: u32,
    pub offset: u32,
    pub g_offset: u32,
}

/// Where the normalized rows go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// `y[row] = norm(x[row])`.
    Write,
    /// `y[row] += norm(x[row])`.
    Residual,
    /// `y[row] = norm(y[row])` (`x` unused).
    InPlace,
}

/// The rows of one token: `rows` rows of `k` floats, `row_stride` apart from `offset`, tokens
/// `token_stride` apart; rows at or past `split` use the second `k` floats of `g`. `g` is read
/// from float `g_offset`.
#[derive(Debug, Clone, Copy, Default)]
pub struct RowLayout {
    pub k: usize,
    pub rows: usize,
    pub row_stride: usize,
    pub token_stride: usize,
    pub split: usize,
    pub offset: usize,
    pub g_offset: usize,
}

impl RowLayout {
    /// One row of `k` per token, rows packed.
    pub fn dense(k: usize) -> Self {
        RowLayout { k, rows: 1, row_stride: k, token_stride: k, split: 1, ..Default::default() }
    }
}

/// The pipeline variant of a mode.
pub fn key(mode: Mode) -> PipelineKey {
    let f = match mode {
        Mode::Write => 0,
        Mode::Residual => flags::RESIDUAL,
        Mode::InPlace => flags::IN_PLACE,
    };
    PipelineKey::new(ShaderOp::RmsNorm, 64).with_flags(f)
}

/// RMSNorm of every row of every token of the step (`x` is ignored for `Mode::InPlace`).
#[allow(clippy::too_many_arguments)]
pub async fn build(
    ctx: &GpuContext,
    step: &wgpu::Buffer,
    x: &wgpu::Buffer,
    g: &wgpu::Buffer,
    y: &wgpu::Buffer,
    rows: RowLayout,
    eps: f32,
    mode: Mode,
) -> Result<Dispatch, GpuError> {
    let need = (rows.g_offset + if rows.split < rows.rows { 2 * rows.k } else { rows.k }) as u64 * 4;
    if rows.k == 0 || g.size() < need {
        return Err(GpuError::Validation {
            context: "rmsnorm".into(),
            message: format!("rows of {} floats from float {} need {need} bytes of norm weights, got {}", rows.k, rows.g_offset, g.size()),
        });
    }
    let key = key(mode);
    let pipe = pipeline(ctx, key).await?;
    let params = RmsNormParams {
        k: rows.k as u32,
        eps,
        rows: rows.rows as u32,
        token_stride: rows.token_stride as u32,
        row_stride: rows.row_stride as u32,
        split: rows.split as u32,
        offset: rows.offset as u32,
        g_offset: rows.g_offset as u32,
    };
    let ubuf = create_uniform(ctx, "rmsnorm.params", &params);
    let mut entries = vec![(0, step), (1, &ubuf), (3, g), (4, y)];
    if mode != Mode::InPlace {
        entries.push((2, x));
    }
    let bg = bind(ctx, "rmsnorm", &pipe, &entries);
    Ok(Dispatch {
        label: format!("rmsnorm [{}]", key.label()),
        pipeline: pipe,
        bind_group: bg,
        grid: [Dim::Tokens, Dim::Const(rows.rows as u32), Dim::Const(1)],
    })
}

//! A mixture of experts on the GPU: the router (`shaders/moe_route.wgsl`: each token's top-k
//! experts and their weights from its router logits) and the expert matvecs
//! (`shaders/moe_matvec.wgsl`: gate|up of each token-expert pair, then down with the weighted
//! sum over a token's experts fused into its reduction). The route stays on the GPU: the
//! expert kernels read it, so a step has no host round trip between router and experts, and
//! only the chosen experts' rows of the stacked expert weights are read.
//!
//! Expert weights are one [`GpuLinear`] per matrix kind with every expert's matrix stacked by
//! rows (expert e's row r at row `e * rows + r`), in any weight format, in storage buffers
//! (one binding: [`check_stacked`]). The router's own product is an ordinary linear layer.

use crate::gpu::buffer::create_uniform;
use crate::gpu::shader::flags;
use crate::gpu::{Features, GpuContext, GpuError, PipelineKey, ShaderOp};

use super::linear::{GpuLinear, LinearParams, Store};
use super::{bind, pipeline, Dim, Dispatch};

/// Invocations per workgroup of both kernels.
pub const WORKGROUP: u32 = 64;

/// Bytes of one route entry (expert index, weight bits).
pub const ROUTE_BYTES: usize = 8;

/// The expert matvec's variants by job: gate|up with the norm folded in (SiLU or GELU), and
/// down added into the residual stream or written (sandwich norms post-norm it first).
pub const FLAG_SETS: [u32; 4] = [
    flags::ROW_PER_WORKGROUP | flags::NORM | flags::GATED,
    flags::ROW_PER_WORKGROUP | flags::NORM | flags::GATED | flags::GELU,
    flags::ROW_PER_WORKGROUP | flags::RESIDUAL,
    flags::ROW_PER_WORKGROUP,
];

/// Mirrors `struct Params` in moe_route.wgsl.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct RouteParams {
    pub n_experts: u32,
    pub top_k: u32,
    /// 1: the chosen experts' probabilities are renormalised to sum to 1.
    pub renormalize: u32,
    pub _pad: u32,
}

/// Mirrors `struct Moe` in moe_matvec.wgsl (binding 19).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct MoeUniform {
    pub top_k: u32,
    pub _pad: [u32; 3],
}

/// Bytes of [`MoeUniform`] (what tests/shaders.rs checks binding 19 against).
pub const MOE_UNIFORM_BYTES: u32 = std::mem::size_of::<MoeUniform>() as u32;

/// The router's dispatch: `route[t * top_k + j]` = (expert, weight) of token t's j-th most
/// probable expert, from `logits` (`n_tokens x n_experts`).
pub async fn route(
    ctx: &GpuContext,
    step: &wgpu::Buffer,
    logits: &wgpu::Buffer,
    route: &wgpu::Buffer,
    n_experts: usize,
    top_k: usize,
    renormalize: bool,
) -> Result<Dispatch, GpuError> {
    if top_k == 0 || top_k > n_experts {
        return Err(GpuError::Validation {
            context: "moe_route".into(),
            message: format!("{top_k} experts per token of {n_experts}: expected 1 to {n_experts}"),
        });
    }
    let pipe = pipeline(ctx, PipelineKey::new(ShaderOp::MoeRoute, WORKGROUP)).await?;
    let params = RouteParams { n_experts: n_experts as u32, top_k: top_k as u32, renormalize: u32::from(renormalize), _pad: 0 };
    let ubuf = create_uniform(ctx, "moe_route.params", &params);
    let bg = bind(ctx, "moe_route", &pipe, &[(0, step), (1, &ubuf), (2, logits), (3, route)]);
    Ok(Dispatch {
        label: "moe_route".into(),
        pipeline: pipe,
        bind_group: bg,
        grid: [Dim::TokensDiv(WORKGROUP), Dim::Const(1), Dim::Const(1)],
    })
}

/// The buffers of one expert matvec.
pub struct ExpertIo<'a> {
    pub step: &'a wgpu::Buffer,
    /// gate|up: the tokens' rows (`x_stride` floats each); down: the pairs' activations.
    pub x: &'a wgpu::Buffer,
    pub x_stride: usize,
    /// RMSNorm weight folded into gate|up.
    pub norm: Option<&'a wgpu::Buffer>,
    pub eps: f32,
    /// The router's output.
    pub route: &'a wgpu::Buffer,
    pub top_k: usize,
    /// gate|up: one row per pair; down: one row per token.
    pub y: &'a wgpu::Buffer,
    pub out_stride: usize,
    /// Down: add into y (the residual stream).
    pub residual: bool,
}

/// Whether `lin` can be read as `n_experts` stacked experts by the expert matvec: rows a
/// whole number of experts, k a multiple of 8, in storage buffers of one binding.
pub fn check_stacked(lin: &GpuLinear, n_experts: usize) -> Result<(), GpuError> {
    let bad = |message: String| Err(GpuError::Validation { context: lin.name.clone(), message });
    if n_experts == 0 || !lin.n_rows.is_multiple_of(n_experts) {
        return bad(format!("{} rows are not {n_experts} experts' worth", lin.n_rows));
    }
    if !lin.k.is_multiple_of(8) {
        return bad(format!("the expert matvec reads rows in steps of 8: k = {} must be a multiple of 8", lin.k));
    }
    match &lin.store {
        Store::Buffers { .. } if lin.chunks().len() == 1 => Ok(()),
        Store::Buffers { .. } => bad(format!(
            "the stacked experts take {} buffers: the expert matvec binds one (the adapter's max_storage_buffer_binding_size is too small for {} experts of {} x {})",
            lin.chunks().len(),
            n_experts,
            lin.n_rows / n_experts,
            lin.k
        )),
        Store::Tiled { .. } => bad("the expert matvec reads storage buffers, not tiled textures".into()),
    }
}

/// The expert matvec variant for `lin` (gated: gate|up with the norm folded in, `gelu` for
/// GELU; else down, `residual` adding into y), reduced with subgroups where `subgroups`.
pub fn key(lin: &GpuLinear, residual: bool, subgroups: bool) -> PipelineKey {
    let fl = if lin.is_gated() {
        flags::ROW_PER_WORKGROUP | flags::NORM | flags::GATED | if lin.gelu { flags::GELU } else { 0 }
    } else {
        flags::ROW_PER_WORKGROUP | if residual { flags::RESIDUAL } else { 0 }
    };
    PipelineKey::new(ShaderOp::MoeMatvec, WORKGROUP)
        .with_flags(fl)
        .with_weights(lin.format)
        .with_features(Features { f16: false, subgroups })
}

/// The expert matvec over `lin` (`n_experts` stacked experts): gated, one output row per
/// token-expert pair (`tokens x top_k` rows of `lin.n_rows / n_experts`); else one per token,
/// the route's weighted sum over its experts.
pub async fn experts(ctx: &GpuContext, lin: &GpuLinear, n_experts: usize, io: &ExpertIo<'_>) -> Result<Dispatch, GpuError> {
    experts_with(ctx, lin, n_experts, io, ctx.caps.subgroups).await
}

/// [`experts`] with the reduction chosen (`subgroups` needs the adapter's): tests run both.
pub async fn experts_with(
    ctx: &GpuContext,
    lin: &GpuLinear,
    n_experts: usize,
    io: &ExpertIo<'_>,
    subgroups: bool,
) -> Result<Dispatch, GpuError> {
    check_stacked(lin, n_experts)?;
    if subgroups && !ctx.caps.subgroups {
        return Err(GpuError::Validation { context: lin.name.clone(), message: "the adapter has no subgroups".into() });
    }
    let gated = lin.is_gated();
    if gated != io.norm.is_some() {
        return Err(GpuError::Validation {
            context: lin.name.clone(),
            message: "the gate|up expert matvec folds the MLP norm in (and only it does)".into(),
        });
    }
    if io.top_k == 0 || io.top_k > n_experts {
        return Err(GpuError::Validation {
            context: lin.name.clone(),
            message: format!("{} experts per token of {n_experts}: expected 1 to {n_experts}", io.top_k),
        });
    }
    let key = key(lin, io.residual, subgroups);
    let pipe = pipeline(ctx, key).await?;
    let rows = (lin.n_rows / n_experts) as u32;
    let gx = rows.min(ctx.limits.max_compute_workgroups_per_dimension.max(1));
    let params = LinearParams {
        n_rows: rows,
        k: lin.k as u32,
        row_offset: 0,
        out_stride: io.out_stride as u32,
        x_stride: io.x_stride as u32,
        grid_x: gx,
        eps: io.eps,
        group: lin.quant.map_or(0, |q| q.group),
    };
    let ubuf = create_uniform(ctx, &format!("{}.params", lin.name), &params);
    let mbuf = create_uniform(ctx, &format!("{}.moe", lin.name), &MoeUniform { top_k: io.top_k as u32, _pad: [0; 3] });
    let Store::Buffers { w, u, w_scales, u_scales } = &lin.store else { unreachable!("check_stacked admits storage buffers only") };
    let missing = |what: &str| GpuError::Validation { context: lin.name.clone(), message: format!("{} needs {what}", key.label()) };
    let mut entries: Vec<(u32, &wgpu::Buffer)> =
        vec![(0, io.step), (1, &ubuf), (2, io.x), (3, &w.chunks[0].buffer), (7, io.y), (18, io.route), (19, &mbuf)];
    if gated {
        entries.push((4, &u.as_ref().ok_or_else(|| missing("the up weight"))?.chunks[0].buffer));
    }
    if let Some(g) = io.norm {
        entries.push((5, g));
    }
    if lin.format.is_packed() {
        entries.push((9, &w_scales.as_ref().ok_or_else(|| missing("scales"))?.chunks[0].buffer));
        if gated {
            entries.push((10, &u_scales.as_ref().ok_or_else(|| missing("scales"))?.chunks[0].buffer));
        }
    }
    let bg = bind(ctx, &lin.name, &pipe, &entries);
    let z = if gated { Dim::TokensTimes(io.top_k as u32) } else { Dim::Tokens };
    Ok(Dispatch {
        label: format!("{} [{}]", lin.name, key.label()),
        pipeline: pipe,
        bind_group: bg,
        grid: [Dim::Const(gx), Dim::Const(rows.div_ceil(gx)), z],
    })
}

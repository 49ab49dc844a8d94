//! A mixture of experts on the GPU: the router (`shaders/moe_route.wgsl`: each token's top-k
//! experts and their weights from its router logits) and the expert matvecs (gate|up of each
//! token-expert pair, then down with the weighted sum over a token's experts fused into its
//! reduction): `shaders/moe_matvec_multi.wgsl` for packed experts of whole 16-element units
//! (the dense GPU matvec's MULTI_ROW layout: two rows per workgroup, a unit's scale and codes
//! decoded once), `shaders/moe_matvec.wgsl` (a workgroup per row, 8-element steps) for the
//! others. The route stays on the GPU: the
//! expert kernels read it, so a step has no host round trip between router and experts, and
//! only the chosen experts' rows of the stacked expert weights are read.
//!
//! Expert weights are one [`GpuLinear`] per matrix kind with every expert's matrix stacked by
//! rows (expert e's row r at row `e * rows + r`), in any weight format, in storage buffers
//! (one binding: [`check_stacked`]). The router's own product is an ordinary linear layer.

use crate::gpu::buffer::{create_storage, create_uniform};
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

/// The same jobs in the MULTI_ROW layout (`shaders/moe_matvec_multi.wgsl`, packed experts
/// whose rows and groups are whole 16-element units: [`multi_fits`]).
pub const MULTI_FLAG_SETS: [u32; 4] = [
    flags::MULTI_ROW | flags::NORM | flags::GATED,
    flags::MULTI_ROW | flags::NORM | flags::GATED | flags::GELU,
    flags::MULTI_ROW | flags::RESIDUAL,
    flags::MULTI_ROW,
];

/// Whether the MULTI_ROW expert matvec reads `lin` with `io`'s x: packed weights with rows
/// and scale groups of whole 16-element units (as the dense MULTI_ROW matvec), and x rows
/// of whole vec4s.
pub fn multi_fits(lin: &GpuLinear, io: &ExpertIo<'_>) -> bool {
    lin.format.is_packed() && super::linear::multi_row_fits(lin) && io.x_stride.is_multiple_of(4)
}

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
    let ubuf = create_storage(ctx, "moe_route.params", bytemuck::bytes_of(&params))?;
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
/// GELU; else down, `residual` adding into y), reduced with subgroups where `subgroups`, in
/// the MULTI_ROW layout where `multi` (else a workgroup per row).
pub fn key(lin: &GpuLinear, residual: bool, subgroups: bool, multi: bool) -> PipelineKey {
    let layout = if multi { flags::MULTI_ROW } else { flags::ROW_PER_WORKGROUP };
    let fl = if lin.is_gated() {
        layout | flags::NORM | flags::GATED | if lin.gelu { flags::GELU } else { 0 }
    } else {
        layout | if residual { flags::RESIDUAL } else { 0 }
    };
    PipelineKey::new(ShaderOp::MoeMatvec, WORKGROUP)
        .with_flags(fl)
        .with_weights(lin.format)
        .with_features(Features { f16: false, subgroups })
}

/// The expert matvec over `lin` (`n_experts` stacked experts): gated, one output row per
/// token-expert pair (`tokens x top_k` rows of `lin.n_rows / n_experts`); else one per token,
/// the route's weighted sum over its experts. Packed experts of whole 16-element units take
/// the MULTI_ROW layout ([`multi_fits`]), the others a workgroup per row.
pub async fn experts(ctx: &GpuContext, lin: &GpuLinear, n_experts: usize, io: &ExpertIo<'_>) -> Result<Dispatch, GpuError> {
    experts_with(ctx, lin, n_experts, io, ctx.caps.subgroups, multi_fits(lin, io)).await
}

/// [`experts`] with the reduction (`subgroups` needs the adapter's) and the layout (`multi`
/// needs [`multi_fits`]) chosen: tests run every combination.
pub async fn experts_with(
    ctx: &GpuContext,
    lin: &GpuLinear,
    n_experts: usize,
    io: &ExpertIo<'_>,
    subgroups: bool,
    multi: bool,
) -> Result<Dispatch, GpuError> {
    if subgroups && !ctx.caps.subgroups {
        return Err(GpuError::Validation { context: lin.name.clone(), message: "the adapter has no subgroups".into() });
    }
    check_io(lin, n_experts, io, "the gate|up expert matvec folds the MLP norm in (and only it does)")?;
    if multi && !multi_fits(lin, io) {
        return Err(GpuError::Validation {
            context: lin.name.clone(),
            message: format!(
                "the MULTI_ROW expert matvec reads packed weights with k ({}), the scale group and the x stride ({}) in whole 16-element units and vec4s",
                lin.k, io.x_stride
            ),
        });
    }
    let key = key(lin, io.residual, subgroups, multi);
    let pipe = pipeline(ctx, key).await?;
    let rows_per_group = if multi { super::linear::MULTI_ROW_ROWS } else { 1 };
    let (bind_group, [gx, gy]) = bind_experts(ctx, lin, n_experts, io, &pipe, key, &[(0, io.step), (18, io.route)], true, rows_per_group)?;
    let z = if lin.is_gated() { Dim::TokensTimes(io.top_k as u32) } else { Dim::Tokens };
    Ok(Dispatch { label: format!("{} [{}]", lin.name, key.label()), pipeline: pipe, bind_group, grid: [Dim::Const(gx), Dim::Const(gy), z] })
}

/// The checks every expert kernel makes: `lin` holds `n_experts` stacked experts it can
/// read, the norm comes with (and only with) gate|up (`norm_rule` says so otherwise), and
/// the experts per token are 1 to all of them.
fn check_io(lin: &GpuLinear, n_experts: usize, io: &ExpertIo<'_>, norm_rule: &str) -> Result<(), GpuError> {
    check_stacked(lin, n_experts)?;
    let bad = |message: String| Err(GpuError::Validation { context: lin.name.clone(), message });
    if lin.is_gated() != io.norm.is_some() {
        return bad(norm_rule.into());
    }
    if io.top_k == 0 || io.top_k > n_experts {
        return bad(format!("{} experts per token of {n_experts}: expected 1 to {n_experts}", io.top_k));
    }
    Ok(())
}

/// The bind group of an expert kernel (`key`, compiled as `pipe`) over `lin`'s stacked
/// experts and `io`: its `LinearParams` (one expert's rows), x, the weights (and up, scales),
/// the norm, y, the experts per token where `with_top_k`, and `extra` (what else the variant
/// reads). Also returns the grid's x and y (the rows, `rows_per_group` per workgroup).
#[allow(clippy::too_many_arguments)]
fn bind_experts(
    ctx: &GpuContext,
    lin: &GpuLinear,
    n_experts: usize,
    io: &ExpertIo<'_>,
    pipe: &wgpu::ComputePipeline,
    key: PipelineKey,
    extra: &[(u32, &wgpu::Buffer)],
    with_top_k: bool,
    rows_per_group: u32,
) -> Result<(wgpu::BindGroup, [u32; 2]), GpuError> {
    let rows = (lin.n_rows / n_experts) as u32;
    let groups = rows.div_ceil(rows_per_group);
    let gx = groups.min(ctx.limits.max_compute_workgroups_per_dimension.max(1));
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
    let gated = lin.is_gated();
    let mut entries: Vec<(u32, &wgpu::Buffer)> = vec![(1, &ubuf), (2, io.x), (3, &w.chunks[0].buffer), (7, io.y)];
    entries.extend_from_slice(extra);
    if with_top_k {
        entries.push((19, &mbuf));
    }
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
    Ok((bind(ctx, &lin.name, pipe, &entries), [gx, groups.div_ceil(gx)]))
}

// ---------------------------------------------------------------------------------------------
// Grouped by expert (prefill): moe_group.wgsl, moe_grouped.wgsl, moe_combine.wgsl.
// ---------------------------------------------------------------------------------------------

/// Invocations of the grouping kernel's one workgroup.
pub const GROUP_WORKGROUP: u32 = 256;
/// Most experts the grouping kernel counts (its workgroup arrays).
pub const GROUP_MAX_EXPERTS: usize = 512;
/// Pairs per work item of the grouped expert matvec (`TT` in moe_grouped.wgsl).
pub const GROUP_PAIRS: usize = 8;

/// The grouped expert matvec's variants: gate|up with the norm folded in (SiLU or GELU), and
/// down into weighted pair rows.
pub const GROUPED_FLAG_SETS: [u32; 3] = [flags::NORM | flags::GATED, flags::NORM | flags::GATED | flags::GELU, 0];

/// Mirrors `struct Params` in moe_group.wgsl.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct GroupParams {
    pub n_experts: u32,
    pub top_k: u32,
    pub tt: u32,
    pub max_items: u32,
}

/// Mirrors `struct Params` in moe_combine.wgsl.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct CombineParams {
    pub n: u32,
    pub top_k: u32,
    pub _pad: [u32; 2],
}

/// Work items of `tokens` tokens' pairs grouped by expert: at most one partial item per
/// expert that has pairs, plus the full ones.
/// (Saturating: sizes from a corrupt file must not wrap.)
pub fn work_items(tokens: usize, top_k: usize, experts: usize) -> usize {
    let pairs = tokens.saturating_mul(top_k);
    pairs.div_ceil(GROUP_PAIRS).saturating_add(experts.min(pairs))
}

/// Bytes of the grouping's buffers for steps of up to `tokens` tokens: the pairs by expert,
/// and the work list (saturating).
pub fn group_bytes(tokens: usize, top_k: usize, experts: usize) -> (u64, u64) {
    let pairs = (tokens as u64).saturating_mul(top_k as u64);
    (pairs.saturating_mul(4).max(4), (work_items(tokens, top_k, experts) as u64).saturating_mul(16).max(16))
}

/// The grouping's buffers (sized by [`group_bytes`] for steps of up to `max_tokens` tokens):
/// the pairs by expert, and the work list.
pub struct Grouping<'a> {
    pub groups: &'a wgpu::Buffer,
    pub work: &'a wgpu::Buffer,
    pub max_tokens: usize,
}

/// The grouping's dispatch: the route's pairs by expert into `g.groups`, and the work list
/// into `g.work`.
pub async fn group(
    ctx: &GpuContext,
    step: &wgpu::Buffer,
    route: &wgpu::Buffer,
    g: &Grouping<'_>,
    n_experts: usize,
    top_k: usize,
) -> Result<Dispatch, GpuError> {
    let (groups, work, max_tokens) = (g.groups, g.work, g.max_tokens);
    let bad = |message: String| Err(GpuError::Validation { context: "moe_group".into(), message });
    if n_experts == 0 || n_experts > GROUP_MAX_EXPERTS || top_k == 0 || top_k > n_experts {
        return bad(format!(
            "{top_k} of {n_experts} experts: the grouping takes 1 to {GROUP_MAX_EXPERTS} experts and 1 to all of them per token"
        ));
    }
    let (gb, wb) = group_bytes(max_tokens, top_k, n_experts);
    if groups.size() < gb || work.size() < wb {
        return bad(format!(
            "steps of {max_tokens} tokens need {gb} and {wb} bytes of groups and work list, got {} and {}",
            groups.size(),
            work.size()
        ));
    }
    let pipe = pipeline(ctx, PipelineKey::new(ShaderOp::MoeGroup, GROUP_WORKGROUP)).await?;
    let params = GroupParams {
        n_experts: n_experts as u32,
        top_k: top_k as u32,
        tt: GROUP_PAIRS as u32,
        max_items: work_items(max_tokens, top_k, n_experts) as u32,
    };
    let ubuf = create_uniform(ctx, "moe_group.params", &params);
    let bg = bind(ctx, "moe_group", &pipe, &[(0, step), (1, &ubuf), (2, route), (3, groups), (4, work)]);
    Ok(Dispatch { label: "moe_group".into(), pipeline: pipe, bind_group: bg, grid: [Dim::Const(1), Dim::Const(1), Dim::Const(1)] })
}

/// The grouped expert matvec over `lin` (`n_experts` stacked experts) and the grouping `g`
/// ([`group`] ran before it): gated, row `pair` of `io.y` for every pair (as [`experts`]);
/// else down, row `pair` of `io.y` weighted by its route weight, for [`combine`]
/// (`io.residual` must be false).
pub async fn grouped(
    ctx: &GpuContext,
    lin: &GpuLinear,
    n_experts: usize,
    io: &ExpertIo<'_>,
    g: &Grouping<'_>,
) -> Result<Dispatch, GpuError> {
    if io.residual {
        return Err(GpuError::Validation {
            context: lin.name.clone(),
            message: "the grouped down writes pair rows for moe_combine (no residual)".into(),
        });
    }
    check_io(lin, n_experts, io, "the grouped gate|up folds the MLP norm in (and only it does)")?;
    let gated = lin.is_gated();
    let fl = if gated { flags::NORM | flags::GATED | if lin.gelu { flags::GELU } else { 0 } } else { 0 };
    let key = PipelineKey::new(ShaderOp::MoeGrouped, WORKGROUP).with_flags(fl).with_weights(lin.format);
    let pipe = pipeline(ctx, key).await?;
    // (The work list sets the pairs, not the step: gate|up reads the experts per token to
    // find a pair's token, down the route for its weight.)
    let extra: &[(u32, &wgpu::Buffer)] =
        if gated { &[(20, g.groups), (21, g.work)] } else { &[(20, g.groups), (21, g.work), (18, io.route)] };
    let (bind_group, [gx, gy]) = bind_experts(ctx, lin, n_experts, io, &pipe, key, extra, gated, 1)?;
    Ok(Dispatch {
        label: format!("{} [{}]", lin.name, key.label()),
        pipeline: pipe,
        bind_group,
        grid: [Dim::Const(gx), Dim::Const(gy), Dim::GroupItems { top_k: io.top_k as u32, experts: n_experts as u32 }],
    })
}

/// Each token's `top_k` weighted pair rows of `n` floats (`pairs`, from [`grouped`]'s down)
/// summed into row t of `y`, added with `residual`.
pub async fn combine(
    ctx: &GpuContext,
    step: &wgpu::Buffer,
    pairs: &wgpu::Buffer,
    y: &wgpu::Buffer,
    n: usize,
    top_k: usize,
    residual: bool,
) -> Result<Dispatch, GpuError> {
    let key = PipelineKey::new(ShaderOp::MoeCombine, WORKGROUP).with_flags(if residual { flags::RESIDUAL } else { 0 });
    let pipe = pipeline(ctx, key).await?;
    let ubuf = create_uniform(ctx, "moe_combine.params", &CombineParams { n: n as u32, top_k: top_k as u32, _pad: [0; 2] });
    let bg = bind(ctx, "moe_combine", &pipe, &[(0, step), (1, &ubuf), (2, pairs), (3, y)]);
    Ok(Dispatch {
        label: format!("moe_combine [{}]", key.label()),
        pipeline: pipe,
        bind_group: bg,
        grid: [Dim::Const((n as u32).div_ceil(WORKGROUP)), Dim::Tokens, Dim::Const(1)],
    })
}

//! `y = W x` in its two shapes: the decode matvec (`shaders/matvec.wgsl`, packed weights
//! `shaders/matvec_q_*.wgsl`, one file per layout) and the prefill matmul (`shaders/matmul.wgsl` on GPUs,
//! `shaders/matmul_blocked.wgsl` / `matmul_blocked_q.wgsl` on CPU adapters), with the fused
//! prologue/epilogues of all of them (`shaders/common/linear.wgsl`: RMSNorm folded in, bias,
//! SiLU or GELU gate, residual add, gathered rows).
//!
//! Three files by job: `upload.rs` (weights to the GPU: buffers or tiled textures),
//! `layout.rs` (which kernel layout this adapter and `gpu::KernelOptions` choose) and this one
//! (the dispatches of one linear call).

mod layout;
mod upload;

pub use layout::*;
pub use upload::*;

use crate::gpu::buffer::{create_uniform, TILE_ROWS};
use crate::gpu::shader::{flags, WeightFormat};
use crate::gpu::{GpuContext, GpuError, PipelineKey, ShaderOp};

use super::{pipeline, Dim, Dispatch};

/// Mirrors `struct Params` in matvec.wgsl and matmul.wgsl.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct LinearParams {
    pub n_rows: u32,
    pub k: u32,
    pub row_offset: u32,
    pub out_stride: u32,
    pub x_stride: u32,
    pub grid_x: u32,
    pub eps: f32,
    /// Elements per scale of packed weights (0 otherwise).
    pub group: u32,
}

/// Which kernel shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// One or a few rows: matvec.
    Matvec,
    /// A few rows sharing each pass over the weights: the four-token packed matvec
    /// (`flags::TOK4`) of the adapter's layout (CPU adapters: ROWS4 | XBCAST from storage or
    /// texture copies; GPUs: MULTI_ROW); elsewhere the matvec.
    MatvecBatch,
    /// Steps of 5-8 rows (speculative verify): the eight-token packed matvec (`flags::TOK8`)
    /// where the layout has one (TEX, MULTI_ROW), else as `MatvecBatch`.
    MatvecBatch8,
    /// Many rows: tiled matmul.
    Matmul,
}

/// The buffers of one linear call.
pub struct LinearIo<'a> {
    pub step: &'a wgpu::Buffer,
    /// Input rows (tokens x x_stride).
    pub x: &'a wgpu::Buffer,
    pub x_stride: usize,
    /// RMSNorm weight when NORM is fused.
    pub norm: Option<&'a wgpu::Buffer>,
    pub eps: f32,
    /// Output rows (tokens x out_stride); written at column `out_offset`.
    pub y: &'a wgpu::Buffer,
    pub out_stride: usize,
    pub out_offset: usize,
    /// Add into y.
    pub residual: bool,
    /// Gather input rows through this index list (matvec only).
    pub rows: Option<&'a wgpu::Buffer>,
    /// An rgba32float texture holding the step's rows of x (`kernels::x_texture`, filled by
    /// a dispatch before this one): CPU adapters' blocked matmul over tiled weights reads it
    /// (`flags::XTEX`) instead of x. None elsewhere.
    pub x_tex: Option<&'a wgpu::Texture>,
}

/// Build the dispatches (one per weight chunk) of `y = epilogue(W x)`.
pub async fn build(ctx: &GpuContext, lin: &GpuLinear, io: &LinearIo<'_>, shape: Shape) -> Result<Vec<Dispatch>, GpuError> {
    let mut fl = 0;
    if io.norm.is_some() {
        fl |= flags::NORM;
    }
    if lin.bias.is_some() {
        fl |= flags::BIAS;
    }
    if io.residual {
        fl |= flags::RESIDUAL;
    }
    if lin.is_gated() {
        fl |= flags::GATED;
        if lin.gelu {
            fl |= flags::GELU;
        }
    }
    if io.rows.is_some() {
        if shape == Shape::Matmul {
            return Err(GpuError::Validation {
                context: lin.name.clone(),
                message: "gathered rows are only supported by the matvec kernel".into(),
            });
        }
        fl |= flags::GATHER;
    }
    if lin.is_tiled() {
        return build_with_key(ctx, lin, io, tiled_key(ctx, lin, io, shape, fl)).await;
    }
    let mut features = crate::gpu::Features::default();
    let packed = lin.format.is_packed();
    let (op, wg) = match shape {
        Shape::Matvec if packed && masked_fits(ctx, lin) => (ShaderOp::MatvecQMasked, MASKED_WG),
        Shape::Matvec | Shape::MatvecBatch | Shape::MatvecBatch8 => {
            let (mut f, w) = if packed { packed_matvec_layout(ctx) } else { matvec_layout(ctx) };
            if f & flags::MULTI_ROW != 0 && !multi_row_fits(lin) {
                f = (f & !flags::MULTI_ROW) | flags::ROW_PER_WORKGROUP;
            }
            fl |= f;
            features.subgroups = fl & (flags::ROW_PER_WORKGROUP | flags::MULTI_ROW) != 0 && ctx.caps.subgroups;
            // GPUs' batched steps: four or eight tokens per pass over the weights.
            if fl & flags::MULTI_ROW != 0 {
                fl |= match shape {
                    Shape::MatvecBatch => flags::TOK4,
                    Shape::MatvecBatch8 => flags::TOK8,
                    _ => 0,
                };
            }
            if fl & flags::XBCAST != 0 {
                features.subgroups = true;
                // Batched steps take four tokens per pass over the weights (the storage
                // layout has no eight-token form: 5-8 tokens take two passes).
                if matches!(shape, Shape::MatvecBatch | Shape::MatvecBatch8) {
                    fl |= flags::TOK4;
                }
            }
            features.f16 = packed && fl & flags::ROW_PER_WORKGROUP != 0 && packed_f16(ctx);
            (if packed { ShaderOp::MatvecQ } else { ShaderOp::Matvec }, w)
        }
        Shape::Matmul => {
            let (op, f, w) = matmul_layout(ctx);
            fl |= f;
            match (op, packed) {
                (ShaderOp::MatmulBlocked, true) => {
                    if xbcast_fits(ctx) {
                        fl |= flags::XBCAST;
                        features.subgroups = true;
                    }
                    (ShaderOp::MatmulBlockedQ, w)
                }
                (op, true) => {
                    features.f16 = packed_f16(ctx);
                    (op, w)
                }
                (op, false) => (op, w),
            }
        }
    };
    let key = PipelineKey::new(op, wg).with_flags(fl).with_weights(lin.format).with_features(features);
    build_with_key(ctx, lin, io, key).await
}

/// The `flags::TEX` variant reading a tiled linear in `shape` (epilogue flags `fl`): the
/// tiled matvec (TOK4 for batched steps; XU where x and the norm weight can be bound as
/// uniform windows), or the blocked matmul reading words through the textures.
pub fn tiled_key(ctx: &GpuContext, lin: &GpuLinear, io: &LinearIo<'_>, shape: Shape, fl: u32) -> PipelineKey {
    let sg = crate::gpu::Features { f16: false, subgroups: true };
    match shape {
        Shape::Matmul => {
            let (_, f, w) = BLOCKED_DEFAULT;
            if xtex_usable(lin, io) {
                return PipelineKey::new(ShaderOp::MatmulBlockedQ, w)
                    .with_flags(fl | f | flags::XBCAST | flags::TEX | flags::XTEX)
                    .with_weights(lin.format)
                    .with_features(sg);
            }
            PipelineKey::new(ShaderOp::MatmulBlockedQ, w)
                .with_flags(fl | f | flags::XBCAST | flags::TEX)
                .with_weights(lin.format)
                .with_features(sg)
        }
        Shape::Matvec | Shape::MatvecBatch | Shape::MatvecBatch8 => {
            let mut f = fl | flags::TEX;
            f |= match shape {
                Shape::MatvecBatch => flags::TOK4,
                Shape::MatvecBatch8 => flags::TOK8,
                _ => 0,
            };
            if xu_usable(ctx, lin, io) {
                f |= flags::XU;
            }
            PipelineKey::new(ShaderOp::MatvecQ, 8).with_flags(f).with_weights(lin.format).with_features(sg)
        }
    }
}

/// Whether the blocked matmul can read `io`'s x from its texture (`flags::XTEX`): there is
/// one, a row of x fits it, and the norm weight (if any) can be bound as a uniform window.
fn xtex_usable(lin: &GpuLinear, io: &LinearIo<'_>) -> bool {
    let window = |b: &wgpu::Buffer| b.usage().contains(wgpu::BufferUsages::UNIFORM) && b.size() >= XU_WINDOW as u64;
    io.x_tex.is_some_and(|t| t.width() as usize * 4 >= lin.k)
        && io.norm.is_none_or(|g| window(g) && lin.k * 4 <= XU_WINDOW as usize)
        && lin.is_tiled()
}

/// Whether the tiled matvec can read `io`'s x and norm weight through 64 KiB uniform windows:
/// the adapter allows them ([`xu_fits`]), a row of x fits one, and the buffers are
/// uniform-capable and at least that long.
fn xu_usable(ctx: &GpuContext, lin: &GpuLinear, io: &LinearIo<'_>) -> bool {
    let window = |b: &wgpu::Buffer| b.usage().contains(wgpu::BufferUsages::UNIFORM) && b.size() >= XU_WINDOW as u64;
    xu_fits(ctx) && lin.k * 4 <= XU_WINDOW as usize && window(io.x) && io.norm.is_none_or(window)
}

/// Build with an explicit variant (tests use this to cover every layout on one adapter).
pub async fn build_with_key(ctx: &GpuContext, lin: &GpuLinear, io: &LinearIo<'_>, key: PipelineKey) -> Result<Vec<Dispatch>, GpuError> {
    if key.weights != lin.format {
        return Err(GpuError::Validation {
            context: lin.name.clone(),
            message: format!("kernel {} does not read {} weights", key.label(), lin.format.name()),
        });
    }
    if lin.format == WeightFormat::F16 && !lin.k.is_multiple_of(2) {
        return Err(GpuError::Validation {
            context: lin.name.clone(),
            message: format!("f16 products read weight pairs: k = {} must be even", lin.k),
        });
    }
    if key.flags & flags::XBCAST != 0 && (key.workgroup != 8 || !xbcast_fits(ctx)) {
        return Err(GpuError::Validation {
            context: lin.name.clone(),
            message: format!("{} needs workgroups of exactly one 8-lane subgroup", key.label()),
        });
    }
    if key.op == ShaderOp::MatvecQMasked && !masked_reads(lin) {
        return Err(GpuError::Validation {
            context: lin.name.clone(),
            message: format!(
                "{} reads Q8 and 4-bit-plane formats in 16-element units, not {} weights with k = {} and groups of {}",
                key.label(),
                lin.format.name(),
                lin.k,
                lin.quant.map_or(0, |q| q.group)
            ),
        });
    }
    let tex = key.flags & flags::TEX != 0;
    if tex != lin.is_tiled() || tex && !matches!(key.op, ShaderOp::MatvecQ | ShaderOp::MatmulBlockedQ) {
        return Err(GpuError::Validation {
            context: lin.name.clone(),
            message: format!(
                "{} reads {} weights, but {} holds them in {}",
                key.label(),
                if tex { "texture-held" } else { "buffer-held" },
                lin.name,
                if lin.is_tiled() { "tiled textures" } else { "storage buffers" }
            ),
        });
    }
    if tex && (key.workgroup != 8 || !xbcast_fits(ctx)) {
        return Err(GpuError::Validation {
            context: lin.name.clone(),
            message: format!("{} needs workgroups of exactly one 8-lane subgroup", key.label()),
        });
    }
    if key.flags & flags::XU != 0 && (key.op != ShaderOp::MatvecQ || !xu_usable(ctx, lin, io)) {
        return Err(GpuError::Validation {
            context: lin.name.clone(),
            message: format!(
                "{} reads x and the norm weight as {XU_WINDOW}-byte uniform windows: k = {} must fit one, and the buffers must be uniform-capable and that long",
                key.label(),
                lin.k
            ),
        });
    }
    let xtex = key.flags & flags::XTEX != 0;
    if xtex && (key.op != ShaderOp::MatmulBlockedQ || !xtex_usable(lin, io)) {
        return Err(GpuError::Validation {
            context: lin.name.clone(),
            message: format!(
                "{} reads x from a texture and the norm weight as a {XU_WINDOW}-byte uniform window: it needs tiled weights, an x texture at least {} floats wide, and a uniform-capable norm buffer that long",
                key.label(),
                lin.k
            ),
        });
    }
    if matches!(key.op, ShaderOp::MatvecQ | ShaderOp::MatmulBlockedQ | ShaderOp::MatvecQMasked)
        && (!io.x_stride.is_multiple_of(4) || !lin.k.is_multiple_of(4))
    {
        return Err(GpuError::Validation {
            context: lin.name.clone(),
            message: format!("packed kernels read x as vec4: x stride {} and k {} must be multiples of 4", io.x_stride, lin.k),
        });
    }
    if key.flags & flags::MULTI_ROW != 0 && (key.op != ShaderOp::MatvecQ || !multi_row_fits(lin)) {
        return Err(GpuError::Validation {
            context: lin.name.clone(),
            message: format!(
                "{} reads packed weights in 16-element units: k = {} and the group ({}) must be multiples of 16",
                key.label(),
                lin.k,
                lin.quant.map_or(0, |q| q.group)
            ),
        });
    }
    let pipe = pipeline(ctx, key).await?;
    let x_view = io.x_tex.filter(|_| xtex).map(|t| t.create_view(&Default::default()));
    let max_dim = ctx.limits.max_compute_workgroups_per_dimension.max(1);
    let mut out = Vec::new();
    for (ci, (row_offset, rows)) in lin.chunks().into_iter().enumerate() {
        let rows = rows as u32;
        let (grid, grid_x) = match key.op {
            ShaderOp::Matmul => ([Dim::Const(rows.div_ceil(32)), Dim::TokensDiv(32), Dim::Const(1)], 0),
            ShaderOp::MatmulBlocked | ShaderOp::MatmulBlockedQ => {
                let (tm, tn) = blocked_tile(key.flags);
                ([Dim::Const(rows.div_ceil(tn * key.workgroup)), Dim::TokensDiv(tm), Dim::Const(1)], 0)
            }
            _ => {
                let groups = if key.op == ShaderOp::MatvecQMasked {
                    // Lanes of MASKED_ROWS rows.
                    rows.div_ceil(key.workgroup * MASKED_ROWS)
                } else if key.flags & flags::ROW_PER_WORKGROUP != 0 {
                    rows
                } else if key.flags & flags::MULTI_ROW != 0 {
                    rows.div_ceil(MULTI_ROW_ROWS)
                } else if tex {
                    rows.div_ceil(TILE_ROWS as u32)
                } else if key.flags & flags::ROWS4 != 0 {
                    rows.div_ceil(4 * key.workgroup)
                } else {
                    rows.div_ceil(key.workgroup)
                };
                let gx = groups.min(max_dim);
                let gy = groups.div_ceil(gx);
                let tt = tokens_per_pass(key.flags);
                let tok = if key.flags & flags::GATHER != 0 { Dim::OutDiv(tt) } else { Dim::TokensDiv(tt) };
                ([Dim::Const(gx), Dim::Const(gy), tok], gx)
            }
        };
        let params = LinearParams {
            n_rows: rows,
            k: lin.k as u32,
            row_offset: (io.out_offset + row_offset) as u32,
            out_stride: io.out_stride as u32,
            x_stride: io.x_stride as u32,
            grid_x,
            eps: io.eps,
            group: lin.quant.map_or(0, |q| q.group),
        };
        let ubuf = create_uniform(ctx, &format!("{}.params", lin.name), &params);
        let gated = key.flags & flags::GATED != 0;
        let missing = |what: &str| GpuError::Validation { context: lin.name.clone(), message: format!("{} needs {what}", key.label()) };
        let mut entries: Vec<(u32, Res)> = vec![(0, Res::Buf(io.step)), (1, Res::Buf(&ubuf)), (7, Res::Buf(io.y))];
        if let (true, Some(v)) = (xtex, &x_view) {
            entries.push((17, Res::View(v)));
        } else {
            entries.push((2, Res::Buf(io.x)));
        }
        match &lin.store {
            Store::Buffers { w, u, w_scales, u_scales } => {
                entries.push((3, Res::Buf(&w.chunks[ci].buffer)));
                if gated {
                    entries.push((4, Res::Buf(&u.as_ref().ok_or_else(|| missing("the up weight"))?.chunks[ci].buffer)));
                }
                if key.weights.is_packed() {
                    entries.push((9, Res::Buf(&w_scales.as_ref().ok_or_else(|| missing("scales"))?.chunks[ci].buffer)));
                    if gated {
                        entries.push((10, Res::Buf(&u_scales.as_ref().ok_or_else(|| missing("scales"))?.chunks[ci].buffer)));
                    }
                }
            }
            Store::Tiled { w, ws, u, us } => {
                entries.push((11, Res::View(&w.chunks[ci].view)));
                entries.push((12, Res::View(&ws.chunks[ci].view)));
                if gated {
                    entries.push((13, Res::View(&u.as_ref().ok_or_else(|| missing("the up weight"))?.chunks[ci].view)));
                    entries.push((14, Res::View(&us.as_ref().ok_or_else(|| missing("the up weight"))?.chunks[ci].view)));
                }
            }
        }
        if let Some(g) = io.norm {
            entries.push(if key.flags & (flags::XU | flags::XTEX) != 0 { (16, Res::Window(g)) } else { (5, Res::Buf(g)) });
        }
        if key.flags & flags::XU != 0 {
            entries.push((15, Res::Window(io.x)));
        }
        if let Some(b) = &lin.bias {
            entries.push((6, Res::Buf(&b[ci])));
        }
        if let Some(r) = io.rows {
            entries.push((8, Res::Buf(r)));
        }
        let bg = bind_res(ctx, &lin.name, &pipe, &entries);
        out.push(Dispatch { label: format!("{} [{}]", lin.name, key.label()), pipeline: pipe.clone(), bind_group: bg, grid });
    }
    Ok(out)
}

/// A resource bound to a linear kernel.
enum Res<'a> {
    Buf(&'a wgpu::Buffer),
    /// The first [`XU_WINDOW`] bytes of a buffer, as a uniform.
    Window(&'a wgpu::Buffer),
    View(&'a wgpu::TextureView),
}

fn bind_res(ctx: &GpuContext, label: &str, pipe: &wgpu::ComputePipeline, entries: &[(u32, Res)]) -> wgpu::BindGroup {
    let all: Vec<wgpu::BindGroupEntry> = entries
        .iter()
        .map(|(b, r)| wgpu::BindGroupEntry {
            binding: *b,
            resource: match r {
                Res::Buf(buf) => buf.as_entire_binding(),
                Res::Window(buf) => wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                    buffer: buf,
                    offset: 0,
                    size: std::num::NonZeroU64::new(XU_WINDOW as u64),
                }),
                Res::View(v) => wgpu::BindingResource::TextureView(v),
            },
        })
        .collect();
    ctx.bind_group(&wgpu::BindGroupDescriptor { label: Some(label), layout: &pipe.get_bind_group_layout(0), entries: &all })
}

//! A step's linear-layer input rows copied into an rgba32float texture
//! (`shaders/x_texture.wgsl`), for the CPU adapters' prefill matmul (`flags::XTEX`).
//!
//! lavapipe runs every divergent storage load as a per-lane scalar loop, each lane's value
//! stored to the stack and the vector reloaded (a store-forwarding stall). The blocked matmul
//! reads every element of x once per 64-row block, so with x in a storage buffer those loops
//! took about a third of its time (perf on Qwen2.5-Coder-0.5B's gate/up). Copied once per
//! linear input into a texture, x is read with texel fetches, which lavapipe compiles to
//! plain vector loads.

use crate::gpu::buffer::{create_float_texture, create_uniform};
use crate::gpu::{GpuContext, GpuError, PipelineKey, ShaderOp};

use super::{pipeline, Dim, Dispatch};

/// Invocations per workgroup (one texel each).
pub const WORKGROUP: u32 = 64;

/// Mirrors `struct Params` in x_texture.wgsl.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct XTextureParams {
    pub texels: u32,
    pub x_stride4: u32,
    pub _pad0: u32,
    pub _pad1: u32,
}

/// Whether linear inputs of these widths, in steps of up to `tokens` rows, are read through
/// x textures here: CPU adapters whose weights are tiled textures (8-lane subgroups), widths
/// of whole texels within the adapter's texture size. `KernelOptions::x_textures` (and
/// `weight_textures`) off turns it off (comparisons).
pub fn fits(ctx: &GpuContext, widths: &[usize], tokens: usize) -> bool {
    let max = ctx.limits.max_texture_dimension_2d as usize;
    ctx.caps.cpu_like
        && super::linear::xbcast_fits(ctx)
        && ctx.kernels.x_textures
        && ctx.kernels.weight_textures
        && tokens <= max
        && widths.iter().all(|&w| w.is_multiple_of(4) && w / 4 <= max)
}

/// Bytes of the x textures of inputs of these widths for steps of up to `tokens` rows.
pub fn bytes(widths: &[usize], tokens: usize) -> u64 {
    widths.iter().map(|&w| (w * tokens * 4) as u64).sum()
}

/// An x texture for inputs `width` floats wide, `tokens` rows (recorded in the ledger).
pub fn create(ctx: &GpuContext, name: &str, width: usize, tokens: usize) -> Result<wgpu::Texture, GpuError> {
    let (w, h) = (width.div_ceil(4).max(1), tokens.max(1));
    let max = ctx.limits.max_texture_dimension_2d as usize;
    if w > max || h > max {
        return Err(GpuError::Validation {
            context: name.into(),
            message: format!("an x texture of {w} x {h} texels exceeds the adapter's {max}"),
        });
    }
    Ok(create_float_texture(ctx, name, w as u32, h as u32))
}

/// The dispatch copying the step's rows of `x` (`x_stride` floats apart, a multiple of 4;
/// the first `k` of each, rounded up to whole texels) into `tex`.
pub async fn build(
    ctx: &GpuContext,
    step: &wgpu::Buffer,
    x: &wgpu::Buffer,
    x_stride: usize,
    k: usize,
    tex: &wgpu::Texture,
) -> Result<Dispatch, GpuError> {
    let texels = k.div_ceil(4);
    if !x_stride.is_multiple_of(4) || k > x_stride || (tex.width() as usize) < texels {
        return Err(GpuError::Validation {
            context: "x texture".into(),
            message: format!("rows of {k} of {x_stride} floats do not fit a texture of {} texels a row", tex.width()),
        });
    }
    let pipe = pipeline(ctx, PipelineKey::new(ShaderOp::XTexture, WORKGROUP)).await?;
    let params = XTextureParams { texels: texels as u32, x_stride4: (x_stride / 4) as u32, _pad0: 0, _pad1: 0 };
    let ubuf = create_uniform(ctx, "x_texture.params", &params);
    let view = tex.create_view(&Default::default());
    let bg = ctx.bind_group(&wgpu::BindGroupDescriptor {
        label: Some("x_texture"),
        layout: &pipe.get_bind_group_layout(0),
        entries: &[
            wgpu::BindGroupEntry { binding: 0, resource: step.as_entire_binding() },
            wgpu::BindGroupEntry { binding: 1, resource: ubuf.as_entire_binding() },
            wgpu::BindGroupEntry { binding: 2, resource: x.as_entire_binding() },
            wgpu::BindGroupEntry { binding: 3, resource: wgpu::BindingResource::TextureView(&view) },
        ],
    });
    Ok(Dispatch {
        label: "x_texture".into(),
        pipeline: pipe,
        bind_group: bg,
        grid: [Dim::Const((texels as u32).div_ceil(WORKGROUP)), Dim::Tokens, Dim::Const(1)],
    })
}

//! Which layout each linear kernel takes here: chosen from the adapter's capabilities, narrowed
//! by `gpu::KernelOptions`.

use crate::gpu::buffer::TiledTensor;
use crate::gpu::shader::{flags, WeightFormat};
use crate::gpu::{GpuContext, ShaderOp};
use crate::quant::QuantFormat;

use super::upload::GpuLinear;

/// Whether a packed weight with rows of `k` in `format` is held as tiled textures here: CPU
/// adapters whose workgroup of 8 is one subgroup, rows of whole 32-element units, and scale
/// groups of a power-of-two number of units (the kernel shifts instead of dividing) or a
/// K-quant's fixed 16 (two per unit). `KernelOptions::weight_textures` off keeps
/// storage buffers (comparisons). Measured on lavapipe, Q4_K 16384 x 4096: 4.3-5.1 GB/s
/// against 0.72 GB/s for the storage layout (`cargo bench --bench kernels` compares them).
pub fn tiled_fits(ctx: &GpuContext, format: QuantFormat, k: usize) -> bool {
    let texels = [TiledTensor::texels_per_row(format.qs_words(k)), TiledTensor::texels_per_row(format.scale_words(k))];
    ctx.caps.cpu_like
        && xbcast_fits(ctx)
        && k.is_multiple_of(32)
        // The high plane starts at a texel (q3's 2-bit low plane: rows of 64).
        && format.lo_words(k).is_multiple_of(4)
        && format.qs_words(k).max(format.scale_words(k)) <= crate::gpu::buffer::MAX_TILED_ROW_WORDS
        && (format.kind.is_super() || format.group >= 32 && format.group.is_power_of_two())
        && TiledTensor::split(ctx, 1, &texels).is_some()
        && ctx.kernels.weight_textures
}

/// Whether the tiled matvec reads x and the norm weight through 64 KiB uniform windows
/// here (`flags::XU`): the adapter binds uniforms that large. Activation and norm buffers are
/// then made uniform-capable and at least that long ([`crate::gpu::buffer::create_x_buffer`]).
pub fn xu_fits(ctx: &GpuContext) -> bool {
    // The padded buffers are also bound whole as storage.
    ctx.limits.max_uniform_buffer_binding_size >= XU_WINDOW as u64 && ctx.max_binding() >= XU_WINDOW as u64 && ctx.kernels.uniform_x
}

/// Bytes of the uniform window of x (`xu` in shaders/common/linear.wgsl: 4096 vec4).
pub const XU_WINDOW: u32 = 65536;

/// The uniform window the linear layers' inputs and norm weights are made for here: the
/// tiled matvec's [`XU_WINDOW`] where it can read them so (CPU adapters with 8-lane subgroups
/// and 64 KiB uniforms), else 0 (plain storage buffers).
pub fn x_window(ctx: &GpuContext) -> u64 {
    if ctx.caps.cpu_like && xbcast_fits(ctx) && xu_fits(ctx) {
        XU_WINDOW as u64
    } else {
        0
    }
}

/// Matvec layout by adapter: `(flags, workgroup size)`.
///
/// On CPU adapters (lavapipe, SwiftShader) every storage-buffer load is emulated per lane
/// (lavapipe: a scalar load behind two branches), so the count of loads, not bytes, sets the
/// speed: each invocation computes four rows (ROWS4) so one x load serves four weights, in
/// workgroups of 8 (one SIMD batch; many workgroups keep every CPU thread busy). Measured
/// on lavapipe: 1.6-2x the row-per-workgroup and row-per-invocation layouts. On GPUs a
/// 64-wide workgroup per row gives coalesced loads. `KernelOptions::matvec` overrides
/// (comparisons, tests).
pub fn matvec_layout(ctx: &GpuContext) -> (u32, u32) {
    use crate::gpu::MatvecLayout as L;
    match ctx.kernels.matvec {
        Some(L::Thread) => return (0, 64),
        Some(L::Rows4) => return (flags::ROWS4, 8),
        // `MultiRow` is a packed-weight layout (packed_matvec_layout); float weights take
        // the GPU layout they have.
        Some(L::Wg64) | Some(L::MultiRow) => return (flags::ROW_PER_WORKGROUP, 64),
        Some(L::Wg8) => return (flags::ROW_PER_WORKGROUP, 8),
        None => {}
    }
    if ctx.caps.cpu_like {
        (flags::ROWS4, 8)
    } else {
        (flags::ROW_PER_WORKGROUP, 64)
    }
}

/// The packed matvec's layout here: `matvec_layout`, restricted to the tuned packed layouts
/// (ROWS4 on CPU adapters, with XBCAST where the workgroup of 8 is one subgroup; on GPUs
/// MULTI_ROW, llama.cpp's K-quant layout, for rows whose groups hold 16 elements or more:
/// `build` takes ROW_PER_WORKGROUP for the rest). `KernelOptions::matvec` `Wg64` forces the
/// row-per-workgroup layout, `MultiRow` the multi-row one (on any adapter: tests). The
/// four-token batched form (TOK4) exists where XBCAST or MULTI_ROW does.
pub fn packed_matvec_layout(ctx: &GpuContext) -> (u32, u32) {
    let forced = ctx.kernels.matvec;
    if forced == Some(crate::gpu::MatvecLayout::MultiRow) || (forced.is_none() && !ctx.caps.cpu_like) {
        return (flags::MULTI_ROW, 64);
    }
    let (f, w) = matvec_layout(ctx);
    let (f, w) = if f & flags::ROWS4 == 0 && f & flags::ROW_PER_WORKGROUP == 0 { (flags::ROWS4, 8) } else { (f, w) };
    if f & flags::ROWS4 != 0 && w == 8 && xbcast_fits(ctx) {
        (f | flags::XBCAST, w)
    } else {
        (f, w)
    }
}

/// Tokens one pass of a matvec variant computes: 8 with TOK8, 4 with TOK4, else 1.
pub fn tokens_per_pass(fl: u32) -> u32 {
    if fl & flags::TOK8 != 0 {
        8
    } else if fl & flags::TOK4 != 0 {
        4
    } else {
        1
    }
}

/// Rows per workgroup of the MULTI_ROW matvec (`MR_ROWS` in shaders/common/matvec_end.wgsl).
pub const MULTI_ROW_ROWS: u32 = 2;

/// Whether the MULTI_ROW matvec reads this weight: packed, with rows and scale groups of
/// whole 16-element units (every GGUF format; `lantern quantize` packs may use groups of 8).
pub fn multi_row_fits(lin: &GpuLinear) -> bool {
    lin.quant.is_some_and(|q| q.group.is_multiple_of(16)) && lin.k.is_multiple_of(16)
}

/// Whether the packed decode matvec of CPU adapters that hold packed weights in storage
/// buffers (no 8-lane subgroups for XBCAST: SwiftShader, the browser's software GPU) is
/// `ShaderOp::MatvecQMasked`: four rows per invocation in 16-element units, codes decoded in
/// place, each group's scale applied once, for the formats [`masked_format`] lists with rows
/// and groups of whole units; the others keep ROWS4. On SwiftShader (benches/kernels.rs,
/// 4096x4096): Q8 0.39-0.49 GB/s against ROWS4's 0.29-0.30, Q5_0 0.22-0.29 against 0.12.
pub fn masked_fits(ctx: &GpuContext, lin: &GpuLinear) -> bool {
    ctx.caps.cpu_like && !xbcast_fits(ctx) && !lin.is_tiled() && masked_reads(lin)
}

/// Whether `ShaderOp::MatvecQMasked` can read `lin`: a [`masked_format`] with rows and
/// groups of whole 16-element units.
pub fn masked_reads(lin: &GpuLinear) -> bool {
    masked_format(lin.format) && lin.k.is_multiple_of(16) && lin.quant.is_some_and(|q| q.group.is_multiple_of(16))
}

/// Rows per invocation of `ShaderOp::MatvecQMasked` (shaders/matvec_q_masked.wgsl).
pub const MASKED_ROWS: u32 = 4;

/// Its workgroup: eight invocations (two SIMD batches of SwiftShader), so a 896-row matrix
/// still spreads over 28 workgroups, enough for every core of a desktop CPU.
pub const MASKED_WG: u32 = 8;

/// The formats `ShaderOp::MatvecQMasked` decodes in place (common/masked.wgsl): Q8 and those
/// with a 4-bit low plane; not the 2-bit low planes (Q2_K, Q3_K) or the IQ4 tables.
pub fn masked_format(w: WeightFormat) -> bool {
    use crate::quant::QuantKind as K;
    matches!(w.kind(), Some(K::Q8 | K::Q4 | K::Q4Sym | K::Q5Sym | K::Q5 | K::Q4K | K::Q5K | K::Q6K))
}

/// Whether the XBCAST layouts run here: the workgroup of 8 must be exactly one subgroup
/// (lavapipe: always 8 lanes). `KernelOptions::xbcast` off turns them off (comparisons).
pub fn xbcast_fits(ctx: &GpuContext) -> bool {
    ctx.caps.subgroups && ctx.caps.subgroup_min_size == 8 && ctx.caps.subgroup_max_size == 8 && ctx.kernels.xbcast
}

/// Whether the packed-weight GPU kernels dequantize in half precision: on GPUs offering
/// shader-f16 (packed f16 math, half-size weight tiles). CPU adapters always take the f32
/// kernels, whose results equal dequantize-then-multiply in f32. `KernelOptions::f16_dequant`
/// off turns it off.
pub fn packed_f16(ctx: &GpuContext) -> bool {
    ctx.caps.shader_f16 && !ctx.caps.cpu_like && ctx.kernels.f16_dequant
}

/// Prefill matmul variant by adapter: `(op, flags, workgroup size)`.
///
/// On CPU adapters the tiled matmul's workgroup-memory staging and barriers cost more than
/// they save (workgroup-memory loads are emulated per lane like storage loads, and each
/// barrier switches every invocation's coroutine), so each invocation instead computes a
/// register block of tokens x rows straight from global memory (`MatmulBlocked`), in
/// workgroups of 8 (one SIMD batch), 8 tokens x 8 rows each: measured on lavapipe (64
/// tokens, 576x1536 and 1536x576) 3-5x the tiled matmul, and 1.3-1.8x the 4x4, 8x4 and 4x8
/// blocks (benches/kernels.rs). On GPUs the tiled matmul. `KernelOptions::matmul`
/// overrides (comparisons, tests).
pub fn matmul_layout(ctx: &GpuContext) -> (ShaderOp, u32, u32) {
    match ctx.kernels.matmul {
        Some(crate::gpu::MatmulLayout::Tiled) => return (ShaderOp::Matmul, 0, 64),
        Some(crate::gpu::MatmulLayout::Blocked) => return BLOCKED_DEFAULT,
        None => {}
    }
    if ctx.caps.cpu_like {
        BLOCKED_DEFAULT
    } else {
        (ShaderOp::Matmul, 0, 64)
    }
}

/// The blocked matmul variant CPU adapters get.
pub const BLOCKED_DEFAULT: (ShaderOp, u32, u32) = (ShaderOp::MatmulBlocked, flags::BLOCK_M8 | flags::BLOCK_N8, 8);

/// Tokens x rows computed by one invocation of a blocked matmul variant.
pub fn blocked_tile(fl: u32) -> (u32, u32) {
    let tm = if fl & flags::BLOCK_M8 != 0 { 8 } else { 4 };
    let tn = if fl & flags::BLOCK_N8 != 0 { 8 } else { 4 };
    (tm, tn)
}

// The interface shared by the linear kernels (matvec.wgsl, matmul.wgsl, matmul_blocked.wgsl):
// Params, bindings 0-7, weight loads, and the fused epilogue.
#include "common/step.wgsl"

struct Params {
    // Output rows in this weight chunk.
    n_rows: u32,
    // Input width.
    k: u32,
    // Column of y where this chunk's row 0 lands.
    row_offset: u32,
    // Floats per row of y.
    out_stride: u32,
    // Floats per row of x.
    x_stride: u32,
    // Workgroups along x (matvec: row group index = wid.y * grid_x + wid.x).
    grid_x: u32,
    eps: f32,
    // Elements per scale of packed weights (W_PACKED).
    group: u32,
}

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<uniform> p: Params;
#if X_VEC4
@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>;      // (rows of x, x_stride / 4)
#else
@group(0) @binding(2) var<storage, read> x: array<f32>;            // (rows of x, x_stride)
#endif
// Weights in storage buffers, unless they are packed in textures (TEX: below).
#if W_F32
@group(0) @binding(3) var<storage, read> w: array<f32>;            // (n_rows, k)
#elif TEX
#else
@group(0) @binding(3) var<storage, read> w: array<u32>;            // (n_rows, k) f16 pairs or codes
#endif
#if GATED
#if W_F32
@group(0) @binding(4) var<storage, read> u: array<f32>;            // (n_rows, k) up
#elif TEX
#else
@group(0) @binding(4) var<storage, read> u: array<u32>;
#endif
#endif
// The norm weight in storage, unless it comes through the uniform window `gu` (XU, XTEX:
// below).
#if XU
#elif XTEX
#elif NORM
#if X_VEC4
@group(0) @binding(5) var<storage, read> g: array<vec4<f32>>;      // (k / 4) norm weight
#else
@group(0) @binding(5) var<storage, read> g: array<f32>;            // (k) norm weight
#endif
#endif
#if BIAS
@group(0) @binding(6) var<storage, read> bias: array<f32>;         // (n_rows)
#endif
@group(0) @binding(7) var<storage, read_write> y: array<f32>;      // (n_tok, out_stride)
#if TEX
// Packed codes and scales as tiled rgba32uint textures (common/weights.wgsl, TEX; only
// packed formats are held in textures).
@group(0) @binding(11) var wtex: texture_2d<u32>;
@group(0) @binding(12) var wstex: texture_2d<u32>;
#if GATED
@group(0) @binding(13) var utex: texture_2d<u32>;
@group(0) @binding(14) var ustex: texture_2d<u32>;
#endif
#elif W_PACKED
@group(0) @binding(9) var<storage, read> wsc: array<u32>;          // group scales of w
#if GATED
@group(0) @binding(10) var<storage, read> usc: array<u32>;         // group scales of u
#endif
#endif
#if XU
// The first 64 KiB of x (and of the norm weight, whose buffer is at least that long) as
// uniforms: CPU adapters gather a uniform vector in a few instructions, where a divergent
// storage load is a per-lane loop. Rows of x past the window are read from `x`.
@group(0) @binding(15) var<uniform> xu: array<vec4<f32>, 4096>;
#if NORM
@group(0) @binding(16) var<uniform> gu: array<vec4<f32>, 4096>;
#endif
#endif

#if XTEX
// The step's rows of x as an rgba32float texture (x_texture.wgsl; texel i of row t holds
// x[t, 4 i .. 4 i + 4]), and the norm weight's first 64 KiB as uniforms.
@group(0) @binding(17) var xt: texture_2d<f32>;
#if NORM
@group(0) @binding(16) var<uniform> gu: array<vec4<f32>, 4096>;
#endif
#endif

#include "common/weights.wgsl"

fn silu(v: f32) -> f32 {
    return v / (1.0 + exp(-v));
}
#if GELU

// GELU, tanh approximation (PyTorch `gelu_pytorch_tanh`). tanh(u) is written as
// 1 - 2 / (exp(2u) + 1), which saturates to +-1 instead of dividing infinities.
fn gelu_tanh(v: f32) -> f32 {
    let u = 0.7978845608028654 * (v + 0.044715 * v * v * v);
    return 0.5 * v * (2.0 - 2.0 / (exp(2.0 * u) + 1.0));
}
#endif

// Loads of x from storage (XTEX reads a texture and XU a uniform window instead, in their
// kernels).
#if XTEX
#elif XU
#elif X_VEC4
// x'[4 i .. 4 i + 4] of the input row starting at vec4 `xb4`: with NORM scaled by the norm
// weight, their squares added to `*sum_sq` (which is left alone otherwise).
fn load_x4(xb4: u32, i: u32, sum_sq: ptr<function, f32>) -> vec4<f32> {
    var v = x[xb4 + i];
#if NORM
    *sum_sq += dot(v, v);
    v = v * g[i];
#endif
    return v;
}
#else
// x'[k], x'[k + 1] of the input row starting at element `xb`: with NORM scaled by the norm
// weight, their squares added to `*sum_sq` (which is left alone otherwise).
fn load_x2(xb: u32, k: u32, sum_sq: ptr<function, f32>) -> vec2<f32> {
    var v = vec2<f32>(x[xb + k], x[xb + k + 1u]);
#if NORM
    *sum_sq += dot(v, v);
    v = v * vec2<f32>(g[k], g[k + 1u]);
#endif
    return v;
}

// x'[k] of the input row starting at element `xb` (see load_x2).
fn load_x1(xb: u32, k: u32, sum_sq: ptr<function, f32>) -> f32 {
    var v = x[xb + k];
#if NORM
    *sum_sq += v * v;
    v = v * g[k];
#endif
    return v;
}
#endif

#if XBCAST
// Eight elements held one per lane of an 8-lane subgroup (lane i holds element i), handed to
// every lane as two vec4 (elements 0-3, 4-7).
fn bcast8(xl: f32) -> array<vec4<f32>, 2> {
    return array<vec4<f32>, 2>(
        vec4<f32>(subgroupBroadcast(xl, 0u), subgroupBroadcast(xl, 1u), subgroupBroadcast(xl, 2u), subgroupBroadcast(xl, 3u)),
        vec4<f32>(subgroupBroadcast(xl, 4u), subgroupBroadcast(xl, 5u), subgroupBroadcast(xl, 6u), subgroupBroadcast(xl, 7u)));
}
#endif

// 1/rms of an input row from its sum of squares (NORM).
fn inv_rms(sum_sq: f32) -> f32 {
    return inverseSqrt(sum_sq / f32(p.k) + p.eps);
}

// Epilogue and store of output (t, row): `a` = W x', `b` = U x' (GATED), both raw sums;
// `r` = the row's 1/rms with NORM (pass 1.0 otherwise: multiplying by 1 is exact).
fn store_out(t: u32, row: u32, a_raw: f32, b_raw: f32, r: f32) {
    var a = a_raw * r;
#if GATED
#if GELU
    a = gelu_tanh(a) * (b_raw * r);
#else
    a = silu(a) * (b_raw * r);
#endif
#endif
#if BIAS
    a += bias[row];
#endif
    let oi = t * p.out_stride + p.row_offset + row;
#if RESIDUAL
    y[oi] = y[oi] + a;
#else
    y[oi] = a;
#endif
}

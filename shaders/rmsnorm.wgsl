// RMSNorm over rows of k floats: n = x / sqrt(mean(x^2) + eps) * g. Rust dispatch:
// src/kernels/rmsnorm.rs. One workgroup per (token, row of the token). The forward pass folds
// the input norm of every projection into the projection itself (flag NORM of the linear
// kernels); this kernel is for the norms that follow an op (Gemma's sandwich norms of the
// attention and MLP outputs, and the q/k norms over each head or the whole projection). Modes:
// - default:   y[row] = n(x[row])
// - RESIDUAL:  y[row] += n(x[row])        (a post-norm added into the residual stream)
// - IN_PLACE:  y[row] = n(y[row])         (q/k heads inside the fused q|k|v rows)
// Row r of token t starts at offset + t * token_stride + r * row_stride; rows r >= split use
// the second weight vector g[g_offset + k..g_offset + 2k] (the k heads' norm after the q
// heads'), the others g[g_offset..g_offset + k].
#include "common/step.wgsl"

struct Params {
    k: u32,
    eps: f32,
    rows: u32,
    token_stride: u32,
    row_stride: u32,
    split: u32,
    // Where a token's first row starts in it, and the first float of g read.
    offset: u32,
    g_offset: u32,
}

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<uniform> p: Params;
#ifndef IN_PLACE
@group(0) @binding(2) var<storage, read> x: array<f32>;
#endif
@group(0) @binding(3) var<storage, read> g: array<f32>;            // (k) or (2 k)
@group(0) @binding(4) var<storage, read_write> y: array<f32>;

var<workgroup> red: array<f32, WG>;

fn src(i: u32) -> f32 {
#if IN_PLACE
    return y[i];
#else
    return x[i];
#endif
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let t = wid.x;
    let row = wid.y;
    if (t >= step.n_tokens || row >= p.rows) {
        return;
    }
    let base = p.offset + t * p.token_stride + row * p.row_stride;
    let gb = p.g_offset + select(0u, p.k, row >= p.split);
    var s = 0.0;
    for (var k = lid; k < p.k; k += WG) {
        let v = src(base + k);
        s += v * v;
    }
    red[lid] = s;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride = stride / 2u) {
        if (lid < stride) {
            red[lid] += red[lid + stride];
        }
        workgroupBarrier();
    }
    let r = inverseSqrt(red[0] / f32(p.k) + p.eps);
    // Each invocation writes only the elements it read, so IN_PLACE needs no second barrier.
    for (var k = lid; k < p.k; k += WG) {
        let n = src(base + k) * r * g[gb + k];
#if RESIDUAL
        y[base + k] = y[base + k] + n;
#else
        y[base + k] = n;
#endif
    }
}

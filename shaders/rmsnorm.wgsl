// RMSNorm: y[t, :] = x[t, :] / sqrt(mean(x[t, :]^2) + eps) * g. One workgroup per row.
// The forward pass folds this into the matvec/matmul that follows (flag NORM); this kernel
// is the standalone op.
#include "common/step.wgsl"

struct Params {
    k: u32,
    eps: f32,
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<uniform> p: Params;
@group(0) @binding(2) var<storage, read> x: array<f32>;            // (n_tokens, k)
@group(0) @binding(3) var<storage, read> g: array<f32>;            // (k)
@group(0) @binding(4) var<storage, read_write> y: array<f32>;      // (n_tokens, k)

var<workgroup> red: array<f32, WG>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let t = wid.x;
    if (t >= step.n_tokens) {
        return;
    }
    let base = t * p.k;
    var s = 0.0;
    for (var k = lid; k < p.k; k += WG) {
        let v = x[base + k];
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
    for (var k = lid; k < p.k; k += WG) {
        y[base + k] = x[base + k] * r * g[k];
    }
}

// Decode matvec: y[t, row_offset + n] = epilogue(sum_k W[n, k] * x'[t, k]) for the rows n of
// one weight chunk. Prologue NORM folds RMSNorm: x' = x * g and the result is scaled by
// r = 1/sqrt(mean(x^2) + eps), accumulated in the same pass over x. Epilogues: GATED
// (silu(W x') * (U x')), BIAS, RESIDUAL (add into y). GATHER reads input rows rows[t].
//
// Layouts: by default one invocation per output row walks K contiguously (what CPU adapters
// such as lavapipe want); ROW_PER_WORKGROUP gives each row a workgroup whose threads stride
// K (coalesced loads on GPUs), reduced with subgroups when SUBGROUPS is set.
#include "common/step.wgsl"

struct Params {
    // Output rows in this chunk.
    n_rows: u32,
    // Input width.
    k: u32,
    // Column of y where this chunk's row 0 lands.
    row_offset: u32,
    // Floats per row of y.
    out_stride: u32,
    // Floats per row of x.
    x_stride: u32,
    // Workgroups along x; the row (group) index is wid.y * grid_x + wid.x.
    grid_x: u32,
    eps: f32,
    _pad: u32,
}

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<uniform> p: Params;
@group(0) @binding(2) var<storage, read> x: array<f32>;            // (rows of x, x_stride)
#if W_F32
@group(0) @binding(3) var<storage, read> w: array<f32>;            // (n_rows, k)
#else
@group(0) @binding(3) var<storage, read> w: array<u32>;            // (n_rows, k) f16 pairs
#endif
#if GATED
#if W_F32
@group(0) @binding(4) var<storage, read> u: array<f32>;            // (n_rows, k) up
#else
@group(0) @binding(4) var<storage, read> u: array<u32>;
#endif
#endif
#if NORM
@group(0) @binding(5) var<storage, read> g: array<f32>;            // (k) norm weight
#endif
#if BIAS
@group(0) @binding(6) var<storage, read> bias: array<f32>;         // (n_rows)
#endif
@group(0) @binding(7) var<storage, read_write> y: array<f32>;      // (n_tok, out_stride)
#if GATHER
@group(0) @binding(8) var<storage, read> rows: array<u32>;         // (n_out) rows of x
#endif

#include "common/weights.wgsl"

fn silu(v: f32) -> f32 {
    return v / (1.0 + exp(-v));
}

// Apply the epilogue to the raw sums (w.x, u.x, sum of squares) and store.
fn finish(t: u32, row: u32, acc: vec3<f32>) {
    var a = acc.x;
#if NORM
    let r = inverseSqrt(acc.z / f32(p.k) + p.eps);
    a = a * r;
#endif
#if GATED
    var b = acc.y;
#if NORM
    b = b * r;
#endif
    a = silu(a) * b;
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

#if ROW_PER_WORKGROUP
var<workgroup> red: array<vec3<f32>, WG>;
#endif

@compute @workgroup_size(WG)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
#if SUBGROUPS
    @builtin(subgroup_invocation_id) sg_lane: u32,
    @builtin(subgroup_size) sg_size: u32,
#endif
) {
#if GATHER
    let n_tok = step.n_out;
#else
    let n_tok = step.n_tokens;
#endif
    let t = wid.z;
    if (t >= n_tok) {
        return;
    }
#if GATHER
    let xb = rows[t] * p.x_stride;
#else
    let xb = t * p.x_stride;
#endif
#if ROW_PER_WORKGROUP
    let row = wid.y * p.grid_x + wid.x;
    if (row >= p.n_rows) {
        return;
    }
    let wb = row * p.k;
    var acc = vec3<f32>(0.0);
    for (var k = lid; k < p.k; k += WG) {
        var xv = x[xb + k];
#if NORM
        acc.z += xv * xv;
        xv = xv * g[k];
#endif
        acc.x += w_load(wb + k) * xv;
#if GATED
        acc.y += u_load(wb + k) * xv;
#endif
    }
#if SUBGROUPS
    acc = subgroupAdd(acc);
    if (sg_lane == 0u) {
        red[lid / sg_size] = acc;
    }
    workgroupBarrier();
    if (lid == 0u) {
        var total = vec3<f32>(0.0);
        for (var i = 0u; i < WG / sg_size; i++) {
            total += red[i];
        }
        finish(t, row, total);
    }
#else
    red[lid] = acc;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride = stride / 2u) {
        if (lid < stride) {
            red[lid] += red[lid + stride];
        }
        workgroupBarrier();
    }
    if (lid == 0u) {
        finish(t, row, red[0]);
    }
#endif
#else
    let row = (wid.y * p.grid_x + wid.x) * WG + lid;
    if (row >= p.n_rows) {
        return;
    }
    let wb = row * p.k;
    // Two independent accumulators per sum for instruction-level parallelism.
    var a0 = 0.0;
    var a1 = 0.0;
    var u0 = 0.0;
    var u1 = 0.0;
    var s0 = 0.0;
    let k2 = p.k & ~1u;
    var k = 0u;
    for (; k < k2; k += 2u) {
        var xv = vec2<f32>(x[xb + k], x[xb + k + 1u]);
#if NORM
        s0 += dot(xv, xv);
        xv = xv * vec2<f32>(g[k], g[k + 1u]);
#endif
        let wv = w_load2(wb + k);
        a0 += wv.x * xv.x;
        a1 += wv.y * xv.y;
#if GATED
        let uv = u_load2(wb + k);
        u0 += uv.x * xv.x;
        u1 += uv.y * xv.y;
#endif
    }
    if (k < p.k) {
        var xv = x[xb + k];
#if NORM
        s0 += xv * xv;
        xv = xv * g[k];
#endif
        a0 += w_load(wb + k) * xv;
#if GATED
        u0 += u_load(wb + k) * xv;
#endif
    }
    finish(t, row, vec3<f32>(a0 + a1, u0 + u1, s0));
#endif
}

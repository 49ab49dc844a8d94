// Rust dispatch: src/kernels/moe.rs (combine); checked by tests/kernels.rs moe_grouped_*.
// The grouped down projection's end: each token's output row is the sum of its top_k pair
// rows (each already weighted by its route weight, moe_grouped.wgsl), written to y or, with
// RESIDUAL, added into it (the residual stream). One invocation per output element.
#include "common/step.wgsl"

struct Params {
    // Floats per row (the hidden size).
    n: u32,
    top_k: u32,
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<uniform> p: Params;
@group(0) @binding(2) var<storage, read> pairs: array<f32>;          // (n_tokens * top_k, n)
@group(0) @binding(3) var<storage, read_write> y: array<f32>;        // (n_tokens, n)

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let c = gid.x;
    let t = gid.y;
    if (c >= p.n || t >= step.n_tokens) {
        return;
    }
    var s = 0.0;
    for (var j = 0u; j < p.top_k; j++) {
        s += pairs[(t * p.top_k + j) * p.n + c];
    }
#if RESIDUAL
    y[t * p.n + c] = y[t * p.n + c] + s;
#else
    y[t * p.n + c] = s;
#endif
}

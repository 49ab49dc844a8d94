// Rust dispatch: src/kernels/x_texture.rs; CPU reference and tests: ARCHITECTURE.md ops table (tests/kernels.rs packed_linear_* with the XTEX layouts).
// A step's linear-layer input rows copied into an rgba32float texture (texel i of row t =
// x[t, 4 i .. 4 i + 4]), for the CPU adapters' prefill matmul (matmul_blocked_q.wgsl, XTEX):
// lavapipe runs a divergent storage load as a per-lane loop, which the matmul would pay once
// per row block for every element of x; here each element is read once, and the matmul's
// texel fetches are plain vector loads. One invocation per texel; y: the step's tokens.
#include "common/step.wgsl"

struct Params {
    // Texels per row (k / 4).
    texels: u32,
    // vec4s per row of x (x_stride / 4).
    x_stride4: u32,
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<uniform> p: Params;
@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>;           // (tokens, x_stride / 4)
@group(0) @binding(3) var xt: texture_storage_2d<rgba32float, write>;  // (k / 4, tokens)

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    let t = gid.y;
    if (i >= p.texels || t >= step.n_tokens) {
        return;
    }
    textureStore(xt, vec2<u32>(i, t), x[t * p.x_stride4 + i]);
}

// The expert kernels' shared part (moe_matvec.wgsl, moe_matvec_multi.wgsl, moe_grouped.wgsl; included after
// common/linear.wgsl): the route and the experts per token, and the 8-element weight and x
// loads every weight format serves.

struct Moe {
    // Experts per token.
    top_k: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(18) var<storage, read> route: array<vec2<u32>>;     // (n_tokens * top_k)
@group(0) @binding(19) var<uniform> moe: Moe;

// Eight elements of row `row` of matrix `m` (0: w, 1: u with GATED) from element k8.
fn weights8(m: u32, row: u32, k8: u32) -> array<vec4<f32>, 2> {
#if W_PACKED
    return deq8_of(m, row, k8);
#else
    let b = row * p.k + k8;
#if GATED
    if (m == 1u) {
        return array<vec4<f32>, 2>(vec4<f32>(u_load2(b), u_load2(b + 2u)), vec4<f32>(u_load2(b + 4u), u_load2(b + 6u)));
    }
#endif
    return array<vec4<f32>, 2>(vec4<f32>(w_load2(b), w_load2(b + 2u)), vec4<f32>(w_load2(b + 4u), w_load2(b + 6u)));
#endif
}

#if X_VEC4
#else
// x'[k8 .. k8 + 8] of the row of x starting at element xb (see load_x2).
fn x8(xb: u32, k8: u32, sum_sq: ptr<function, f32>) -> array<vec4<f32>, 2> {
    return array<vec4<f32>, 2>(vec4<f32>(load_x2(xb, k8, sum_sq), load_x2(xb, k8 + 2u, sum_sq)),
                               vec4<f32>(load_x2(xb, k8 + 4u, sum_sq), load_x2(xb, k8 + 6u, sum_sq)));
}
#endif

fn dot8(a: array<vec4<f32>, 2>, b: array<vec4<f32>, 2>) -> f32 {
    return dot(a[0], b[0]) + dot(a[1], b[1]);
}

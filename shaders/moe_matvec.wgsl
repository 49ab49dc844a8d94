// Rust dispatch: src/kernels/moe.rs (experts); CPU reference: src/reference/forward.rs `mixture`
// (tests/kernels_moe.rs).
// The expert matvecs of a mixture-of-experts MLP. Every expert's matrix is stacked by rows in
// one weight (expert e's row r is row e * n_rows + r; any weight format, storage buffers), and
// only the experts each token's router chose are read: their indices and weights come from
// `route` (moe_route.wgsl, (expert, weight bits) per token and pick), read on the GPU, so the
// step needs no host round trip between the router and the experts.
//
// GATED (gate|up): one workgroup per (output row, token-pick pair), writing row `pair` of y:
// silu(gate_e x') * (up_e x') for x' the pair's token's row of x (NORM folded in, as in every
// linear kernel).
// Otherwise (down): one workgroup per (output row, token): y[t] gets (RESIDUAL: adds) the sum
// over the token's top_k picks j of weight_j * (down_e_j act[t * top_k + j]). The weighted sum
// over experts is this kernel's own reduction: no per-expert output is stored and summed later.
//
// Threads stride each row in 8-element steps (k a multiple of 8) and are reduced as the
// ROW_PER_WORKGROUP matvec's are (common/matvec_end.wgsl).
#include "common/linear.wgsl"
#include "common/matvec_end.wgsl"
#include "common/moe.wgsl"

@compute @workgroup_size(WG)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
#if SUBGROUPS
    @builtin(subgroup_invocation_id) sg_lane: u32,
    @builtin(subgroup_size) sg_size: u32,
#endif
) {
    let row = wid.y * p.grid_x + wid.x;
    if (row >= p.n_rows) {
        return; // the whole workgroup: uniform
    }
    var acc = vec3<f32>(0.0);
#if GATED
    let out = wid.z;
    if (out >= step.n_tokens * moe.top_k) {
        return;
    }
    let wrow = route[out].x * p.n_rows + row;
    let xb = (out / moe.top_k) * p.x_stride;
    var sum_sq = 0.0;
    for (var k8 = lid * 8u; k8 < p.k; k8 += WG * 8u) {
        let xv = x8(xb, k8, &sum_sq);
        acc.x += dot8(weights8(0u, wrow, k8), xv);
        acc.y += dot8(weights8(1u, wrow, k8), xv);
    }
    acc.z = sum_sq;
#else
    let out = wid.z;
    if (out >= step.n_tokens) {
        return;
    }
    for (var j = 0u; j < moe.top_k; j++) {
        let pick = route[out * moe.top_k + j];
        let wrow = pick.x * p.n_rows + row;
        let xb = (out * moe.top_k + j) * p.x_stride;
        var part = 0.0;
        var sum_sq = 0.0;
        for (var k8 = lid * 8u; k8 < p.k; k8 += WG * 8u) {
            part += dot8(weights8(0u, wrow, k8), x8(xb, k8, &sum_sq));
        }
        acc.x += bitcast<f32>(pick.y) * part;
    }
#endif
#if SUBGROUPS
    reduce_row(out, row, acc, lid, sg_lane, sg_size);
#else
    reduce_row(out, row, acc, lid, 0u, 0u);
#endif
}

// Rust dispatch: src/kernels/moe.rs (experts, the layout for packed experts with rows and groups of whole 16-element units); CPU reference: src/reference/forward.rs `mixture` (tests/kernels.rs moe_*).
// The expert matvecs of a mixture-of-experts MLP in the MULTI_ROW layout of
// matvec_q_multi.wgsl (packed experts, groups of 16 or more): MR_ROWS adjacent rows of the
// chosen expert per workgroup, invocations taking 16-element units (common/unit16.wgsl: a
// unit's scale and codes decoded once, the group minimum applied once per unit), each x'
// unit loaded once for every row. Every expert's matrix is stacked by rows in one weight
// (expert e's row r is row e * n_rows + r); the route (moe_route.wgsl) is read on the GPU.
//
// GATED (gate|up): workgroup z is a token-pick pair, writing row `pair` of y: silu(gate_e x')
// * (up_e x') for x' the pair's token's row of x (NORM folded in).
// Otherwise (down): workgroup z is a token, y[t] gets (RESIDUAL: adds) the sum over the
// token's top_k picks j of weight_j * (down_e_j act[t * top_k + j]): the weighted sum over
// experts is this kernel's own accumulation.
#include "common/linear.wgsl"
const TT: u32 = 1u;
#include "common/matvec_end.wgsl"
#include "common/unit16.wgsl"
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
    let row0 = (wid.y * p.grid_x + wid.x) * MR_ROWS;
    let out = wid.z;
#if GATED
    let n_out = step.n_tokens * moe.top_k;
#else
    let n_out = step.n_tokens;
#endif
    if (row0 >= p.n_rows || out >= n_out) {
        return; // the whole workgroup: uniform
    }
    // acc[r]: (w.x, u.x) of row row0 + r; rows past n_rows are read clamped, not stored.
    var acc: array<vec2<f32>, MR_N>;
    var sum_sq: array<f32, TT>;
#if GATED
    let base = route[out].x * p.n_rows;
    let xb4 = (out / moe.top_k) * (p.x_stride / 4u);
    for (var un = lid; un < p.k / 16u; un += WG) {
        let k16 = un * 16u;
        var xs: array<vec4<f32>, 4>;
        var ss = 0.0;
        for (var i = 0u; i < 4u; i++) {
            xs[i] = load_x4(xb4, k16 / 4u + i, &ss);
        }
        sum_sq[0] += ss;
        let sx = dot(xs[0] + xs[1] + xs[2] + xs[3], vec4<f32>(1.0));
        for (var r = 0u; r < MR_ROWS; r++) {
            let row = base + min(row0 + r, p.n_rows - 1u);
            acc[r].x += unit_dot(unit16(0u, row, k16), xs, sx);
            acc[r].y += unit_dot(unit16(1u, row, k16), xs, sx);
        }
    }
#else
    // The invocations take (pick, unit) items, so a narrow down projection (k = the expert
    // width, a few hundred) still gives every invocation work: item i is pick i / units,
    // unit i % units.
    let units = p.k / 16u;
    for (var i = lid; i < moe.top_k * units; i += WG) {
        let j = i / units;
        let k16 = (i % units) * 16u;
        let pick = route[out * moe.top_k + j];
        let weight = bitcast<f32>(pick.y);
        let xb4 = (out * moe.top_k + j) * (p.x_stride / 4u);
        var xs: array<vec4<f32>, 4>;
        var ss = 0.0;
        for (var c = 0u; c < 4u; c++) {
            xs[c] = load_x4(xb4, k16 / 4u + c, &ss);
        }
        let sx = dot(xs[0] + xs[1] + xs[2] + xs[3], vec4<f32>(1.0));
        for (var r = 0u; r < MR_ROWS; r++) {
            let row = pick.x * p.n_rows + min(row0 + r, p.n_rows - 1u);
            acc[r].x += weight * unit_dot(unit16(0u, row, k16), xs, sx);
        }
    }
#endif
#if SUBGROUPS
    reduce_rows(out, out + 1u, row0, acc, sum_sq, lid, sg_lane, sg_size);
#else
    reduce_rows(out, out + 1u, row0, acc, sum_sq, lid, 0u, 0u);
#endif
}

// Rust dispatch: src/kernels/moe.rs (grouped); CPU reference: as moe_matvec.wgsl
// (tests/kernels.rs moe_grouped_*).
// The expert matvecs of a step with many tokens (prefill), over the pairs grouped by expert
// (moe_group.wgsl): a workgroup takes one work item, up to TT pairs of one expert, and one
// output row, so each weight row is read and dequantized once for TT pairs instead of once
// per pair. Items past the written list have no pairs and return at once.
//
// GATED (gate|up): row `pair` of y gets silu(gate_e x') * (up_e x') for x' the pair's token's
// row of x (NORM folded in), as moe_matvec.wgsl computes it.
// Otherwise (down): row `pair` of y gets weight_pair * (down_e act[pair]); moe_combine.wgsl
// then sums each token's pair rows into the residual stream.
//
// Threads stride each row in 8-element steps as moe_matvec.wgsl's do, reduced in workgroup
// memory (TT sums at once).
#include "common/linear.wgsl"
#include "common/matvec_end.wgsl"
#include "common/moe.wgsl"

// Pairs per work item.
const TT: u32 = 8u;

@group(0) @binding(20) var<storage, read> groups: array<u32>;          // pairs by expert
@group(0) @binding(21) var<storage, read> work: array<vec4<u32>>;      // (expert, slot, pairs, 0)

var<workgroup> red_tt: array<vec3<f32>, TT * WG>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let row = wid.y * p.grid_x + wid.x;
    let item = work[wid.z];
    if (row >= p.n_rows || item.z == 0u) {
        return; // the whole workgroup: uniform
    }
    let wrow = item.x * p.n_rows + row;
    var pair: array<u32, TT>;
    var xb: array<u32, TT>;
    for (var j = 0u; j < TT; j++) {
        pair[j] = groups[item.y + min(j, item.z - 1u)];
#if GATED
        xb[j] = (pair[j] / moe.top_k) * p.x_stride;
#else
        xb[j] = pair[j] * p.x_stride;
#endif
    }
    var acc: array<vec3<f32>, TT>;
    for (var k8 = lid * 8u; k8 < p.k; k8 += WG * 8u) {
        let wv = weights8(0u, wrow, k8);
#if GATED
        let uv = weights8(1u, wrow, k8);
#endif
        for (var j = 0u; j < TT; j++) {
            var sum_sq = 0.0;
            let xv = x8(xb[j], k8, &sum_sq);
            acc[j].x += dot8(wv, xv);
#if GATED
            acc[j].y += dot8(uv, xv);
#endif
            acc[j].z += sum_sq;
        }
    }
    for (var j = 0u; j < TT; j++) {
        red_tt[j * WG + lid] = acc[j];
    }
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride = stride / 2u) {
        if (lid < stride) {
            for (var j = 0u; j < TT; j++) {
                red_tt[j * WG + lid] += red_tt[j * WG + lid + stride];
            }
        }
        workgroupBarrier();
    }
    if (lid < item.z) {
        var total = red_tt[lid * WG];
#if GATED
#else
        total.x *= bitcast<f32>(route[pair[lid]].y);
#endif
        finish(pair[lid], row, total);
    }
}

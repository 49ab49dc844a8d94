// Rust dispatch: src/kernels/linear/ (matvec_layout); CPU reference and tests: ARCHITECTURE.md ops table (tests/kernels.rs linear_*).
// Decode matvec over f32 / f16 weights: y[t, row_offset + n] = epilogue(sum_k W[n, k] * x'[t, k])
// for the rows n of one weight chunk. Prologue NORM folds RMSNorm: x' = x * g and the result
// is scaled by r = 1/sqrt(mean(x^2) + eps), accumulated in the same pass over x. Epilogues:
// GATED (silu(W x') * (U x')), BIAS, RESIDUAL (add into y). GATHER reads input rows rows[t].
// The float matvec's layouts, one file each: matvec.wgsl (an invocation per row),
// matvec_rows4.wgsl (four rows per invocation) and matvec_wg.wgsl (a workgroup per row).
//
// This file: ROW_PER_WORKGROUP, a workgroup per row whose threads stride K (coalesced loads
// on GPUs), reduced with subgroups when SUBGROUPS is set.
#include "common/linear.wgsl"
#include "common/gather.wgsl"
#include "common/matvec_end.wgsl"

@compute @workgroup_size(WG)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
#if SUBGROUPS
    @builtin(subgroup_invocation_id) sg_lane: u32,
    @builtin(subgroup_size) sg_size: u32,
#endif
) {
    let t = wid.z;
    if (t >= step_rows()) {
        return;
    }
    let xb = xrow_of(t) * p.x_stride;
    let row = wid.y * p.grid_x + wid.x;
    if (row >= p.n_rows) {
        return;
    }
    let wb = row * p.k;
    var acc = vec3<f32>(0.0);
    var sum_sq = 0.0;
    for (var k = lid; k < p.k; k += WG) {
        let xv = load_x1(xb, k, &sum_sq);
        acc.x += w_load(wb + k) * xv;
#if GATED
        acc.y += u_load(wb + k) * xv;
#endif
    }
    acc.z = sum_sq;
#if SUBGROUPS
    reduce_row(t, row, acc, lid, sg_lane, sg_size);
#else
    reduce_row(t, row, acc, lid, 0u, 0u);
#endif
}

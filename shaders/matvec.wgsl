// Rust dispatch: src/kernels/linear/ (matvec_layout); CPU reference and tests: ARCHITECTURE.md ops table (tests/kernels.rs linear_*).
// Decode matvec over f32 / f16 weights: y[t, row_offset + n] = epilogue(sum_k W[n, k] * x'[t, k])
// for the rows n of one weight chunk. Prologue NORM folds RMSNorm: x' = x * g and the result
// is scaled by r = 1/sqrt(mean(x^2) + eps), accumulated in the same pass over x. Epilogues:
// GATED (silu(W x') * (U x')), BIAS, RESIDUAL (add into y). GATHER reads input rows rows[t].
// The float matvec's layouts, one file each: matvec.wgsl (an invocation per row),
// matvec_rows4.wgsl (four rows per invocation) and matvec_wg.wgsl (a workgroup per row).
//
// This file: one invocation per output row, walking K contiguously (what CPU adapters such
// as lavapipe want), two accumulators per sum.
#include "common/linear.wgsl"
#include "common/gather.wgsl"
#include "common/matvec_end.wgsl"

@compute @workgroup_size(WG)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let t = wid.z;
    if (t >= step_rows()) {
        return;
    }
    let xb = xrow_of(t) * p.x_stride;
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
        let xv = load_x2(xb, k, &s0);
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
        let xv = load_x1(xb, k, &s0);
        a0 += w_load(wb + k) * xv;
#if GATED
        u0 += u_load(wb + k) * xv;
#endif
    }
    finish(t, row, vec3<f32>(a0 + a1, u0 + u1, s0));
}

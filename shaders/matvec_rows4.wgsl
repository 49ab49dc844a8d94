// Rust dispatch: src/kernels/linear/ (matvec_layout); CPU reference and tests: ARCHITECTURE.md ops table (tests/kernels.rs linear_*).
// Decode matvec over f32 / f16 weights: y[t, row_offset + n] = epilogue(sum_k W[n, k] * x'[t, k])
// for the rows n of one weight chunk. Prologue NORM folds RMSNorm: x' = x * g and the result
// is scaled by r = 1/sqrt(mean(x^2) + eps), accumulated in the same pass over x. Epilogues:
// GATED (silu(W x') * (U x')), BIAS, RESIDUAL (add into y). GATHER reads input rows rows[t].
// The float matvec's layouts, one file each: matvec.wgsl (an invocation per row),
// matvec_rows4.wgsl (four rows per invocation) and matvec_wg.wgsl (a workgroup per row).
//
// This file: ROWS4, four adjacent rows per invocation, so that each x load serves four
// weights (CPU adapters, where every storage load is costly).
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
    // Four rows per invocation (register blocking): every x (and g) load feeds four rows.
    // On lavapipe each storage-buffer load is a per-lane scalar branch, so loads, not
    // bytes, are the cost; this halves them per weight. Rows past n_rows read the last row.
    let row0 = ((wid.y * p.grid_x + wid.x) * WG + lid) * 4u;
    if (row0 >= p.n_rows) {
        return;
    }
    let last = p.n_rows - 1u;
    let wb0 = row0 * p.k;
    let wb1 = min(row0 + 1u, last) * p.k;
    let wb2 = min(row0 + 2u, last) * p.k;
    let wb3 = min(row0 + 3u, last) * p.k;
    var a = vec4<f32>(0.0);
    var b = vec4<f32>(0.0);
    var ua = vec4<f32>(0.0);
    var ub = vec4<f32>(0.0);
    var s0 = 0.0;
    let k2 = p.k & ~1u;
    var k = 0u;
    for (; k < k2; k += 2u) {
        let xv = load_x2(xb, k, &s0);
        let w0 = w_load2(wb0 + k);
        let w1 = w_load2(wb1 + k);
        let w2 = w_load2(wb2 + k);
        let w3 = w_load2(wb3 + k);
        a += vec4<f32>(w0.x, w1.x, w2.x, w3.x) * xv.x;
        b += vec4<f32>(w0.y, w1.y, w2.y, w3.y) * xv.y;
#if GATED
        let u0 = u_load2(wb0 + k);
        let u1 = u_load2(wb1 + k);
        let u2 = u_load2(wb2 + k);
        let u3 = u_load2(wb3 + k);
        ua += vec4<f32>(u0.x, u1.x, u2.x, u3.x) * xv.x;
        ub += vec4<f32>(u0.y, u1.y, u2.y, u3.y) * xv.y;
#endif
    }
    if (k < p.k) {
        let xv = load_x1(xb, k, &s0);
        a += vec4<f32>(w_load(wb0 + k), w_load(wb1 + k), w_load(wb2 + k), w_load(wb3 + k)) * xv;
#if GATED
        ua += vec4<f32>(u_load(wb0 + k), u_load(wb1 + k), u_load(wb2 + k), u_load(wb3 + k)) * xv;
#endif
    }
    a += b;
    ua += ub;
    for (var i = 0u; i < 4u; i++) {
        if (row0 + i < p.n_rows) {
            finish(t, row0 + i, vec3<f32>(a[i], ua[i], s0));
        }
    }
}

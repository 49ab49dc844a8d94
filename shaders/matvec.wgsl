// Rust dispatch: src/kernels/linear/ (matvec_layout); CPU reference and tests: ARCHITECTURE.md ops table (tests/kernels.rs linear_*).
// Decode matvec: y[t, row_offset + n] = epilogue(sum_k W[n, k] * x'[t, k]) for the rows n of
// one weight chunk. Prologue NORM folds RMSNorm: x' = x * g and the result is scaled by
// r = 1/sqrt(mean(x^2) + eps), accumulated in the same pass over x. Epilogues: GATED
// (silu(W x') * (U x')), BIAS, RESIDUAL (add into y). GATHER reads input rows rows[t].
//
// Layouts: by default one invocation per output row walks K contiguously (what CPU adapters
// such as lavapipe want); ROW_PER_WORKGROUP gives each row a workgroup whose threads stride
// K (coalesced loads on GPUs), reduced with subgroups when SUBGROUPS is set; ROWS4 gives
// each invocation four adjacent rows so that each x load serves four weights.
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
#if ROW_PER_WORKGROUP
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
#elif ROWS4
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
#endif
}

// Rust dispatch: src/kernels/linear/ (packed_matvec_layout; build takes it where MULTI_ROW cannot read the weight); CPU reference and tests: ARCHITECTURE.md ops table (tests/kernels.rs packed_linear_*, ggml_*).
// y[t, row_offset + n] = epilogue(sum_k W[n, k] * x'[t, k]) over packed integer weights (every
// W_PACKED format; layout in src/quant/mod.rs): every code word is read once and dequantized
// in registers with its group's scale, never written back. The fused prologue/epilogues are
// common/linear.wgsl's (NORM, GATED, BIAS, RESIDUAL) and GATHER's gathered rows
// (common/gather.wgsl). The decode matvec's layouts, one file each: matvec_q_rows4.wgsl (CPU
// adapters, storage buffers), matvec_q_tiled.wgsl (CPU adapters with 8-lane subgroups,
// tiled textures), matvec_q_masked.wgsl (SwiftShader), matvec_q_multi.wgsl (GPUs) and
// matvec_q_wg.wgsl (GPUs, groups of 8).
//
// This file: ROW_PER_WORKGROUP (GPUs, for weights MULTI_ROW cannot read: groups of 8): a
// workgroup per row, invocations striding over the row's 8-element steps (coalesced code
// words), reduced with subgroups when SUBGROUPS is set (common/matvec_end.wgsl). F16
// dequantizes in half precision. x (and the norm weight) are read as vec4.
#include "common/linear.wgsl"
#include "common/gather.wgsl"
#include "common/matvec_end.wgsl"

// w . x' over one step's eight values (elements 0-3 against xa, 4-7 against xh).
fn dot8v(v: array<vec4<f32>, 2>, xa: vec4<f32>, xh: vec4<f32>) -> f32 {
    return dot(v[0], xa) + dot(v[1], xh);
}

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
    let row = wid.y * p.grid_x + wid.x;
    if (t >= step_rows() || row >= p.n_rows) {
        return; // the whole workgroup: uniform
    }
    let xb4 = xrow_of(t) * (p.x_stride / 4u);
    var acc = vec3<f32>(0.0);
    var sum_sq = 0.0;
    for (var s8 = lid; s8 < p.k / 8u; s8 += WG) {
        let k8 = s8 * 8u;
        let xa = load_x4(xb4, 2u * s8, &sum_sq);
        let xh = load_x4(xb4, 2u * s8 + 1u, &sum_sq);
        acc.x += dot8v(w_deq8(row, k8), xa, xh);
#if GATED
        acc.y += dot8v(u_deq8(row, k8), xa, xh);
#endif
    }
    acc.z = sum_sq;
#if SUBGROUPS
    reduce_row(t, row, acc, lid, sg_lane, sg_size);
#else
    reduce_row(t, row, acc, lid, 0u, 0u);
#endif
}

// Rust dispatch: src/kernels/linear/ (packed_matvec_layout, the GPU default); CPU reference and tests: ARCHITECTURE.md ops table (tests/kernels.rs packed_linear_*, ggml_*).
// y[t, row_offset + n] = epilogue(sum_k W[n, k] * x'[t, k]) over packed integer weights (every
// W_PACKED format; layout in src/quant/mod.rs): every code word is read once and dequantized
// in registers with its group's scale, never written back. The fused prologue/epilogues are
// common/linear.wgsl's (NORM, GATED, BIAS, RESIDUAL) and GATHER's gathered rows
// (common/gather.wgsl). The decode matvec's layouts, one file each: matvec_q_rows4.wgsl (CPU
// adapters, storage buffers), matvec_q_tiled.wgsl (CPU adapters with 8-lane subgroups,
// tiled textures), matvec_q_masked.wgsl (SwiftShader), matvec_q_multi.wgsl (GPUs) and
// matvec_q_wg.wgsl (GPUs, groups of 8).
//
// This file: MULTI_ROW (GPUs, the default there for groups of 16 or more; llama.cpp's K-quant
// layout): MR_ROWS rows per workgroup, 16-element units per invocation sharing x' across the
// rows, the group minimum factored out (see rows_multi); TOK4 computes four tokens per pass
// over the weights (batched steps), TOK8 eight (speculative verify steps of 5-8 tokens). x (and the norm weight) are read as vec4.
#include "common/linear.wgsl"
#include "common/gather.wgsl"
#if TOK8
// Tokens per workgroup: every weight read and dequantization serves eight tokens.
const TT: u32 = 8u;
#elif TOK4
// Tokens per workgroup: every weight read and dequantization serves four tokens.
const TT: u32 = 4u;
#else
const TT: u32 = 1u;
#endif
#include "common/matvec_end.wgsl"
#include "common/unit16.wgsl"

@compute @workgroup_size(WG)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
#if SUBGROUPS
    @builtin(subgroup_invocation_id) sg_lane: u32,
    @builtin(subgroup_size) sg_size: u32,
#endif
) {
#if SUBGROUPS
    rows_multi(wid.z * TT, step_rows(), wid, lid, sg_lane, sg_size);
#else
    rows_multi(wid.z * TT, step_rows(), wid, lid, 0u, 0u);
#endif
}

// The workgroup computes MR_ROWS adjacent rows for TT tokens (TOK4: 4, TOK8: 8, batched
// steps; else 1). Invocation i takes units i, i + WG, ...: adjacent invocations
// read adjacent code words (coalesced), 16 of them cover a 256-element super-block and
// share its scale words in cache. Each unit's x' is loaded once per token (its sum of
// squares taken once for NORM) for every row, and each row's codes are decoded once for
// every token. Rows past n_rows and tokens past n_tok are read clamped and not stored, so
// every invocation reaches the reduction's barriers.
fn rows_multi(t0: u32, n_tok: u32, wid: vec3<u32>, lid: u32, sg_lane: u32, sg_size: u32) {
    let row0 = (wid.y * p.grid_x + wid.x) * MR_ROWS;
    if (row0 >= p.n_rows || t0 >= n_tok) {
        return; // the whole workgroup: uniform
    }
    var xb4: array<u32, TT>;
    for (var j = 0u; j < TT; j++) {
        xb4[j] = xrow_of(min(t0 + j, n_tok - 1u)) * (p.x_stride / 4u);
    }
    // acc[r * TT + j]: (w.x, u.x) of row row0 + r, token t0 + j.
    var acc: array<vec2<f32>, MR_N>;
    var sum_sq: array<f32, TT>;
    for (var un = lid; un < p.k / 16u; un += WG) {
        let k16 = un * 16u;
        var xs: array<array<vec4<f32>, 4>, TT>;
        var sx: array<f32, TT>;
        for (var j = 0u; j < TT; j++) {
            // (A pointer to a whole variable: naga's SPIR-V writer fails on one to an element.)
            var ss = 0.0;
            for (var i = 0u; i < 4u; i++) {
                xs[j][i] = load_x4(xb4[j], k16 / 4u + i, &ss);
            }
            sum_sq[j] += ss;
            sx[j] = dot(xs[j][0] + xs[j][1] + xs[j][2] + xs[j][3], vec4<f32>(1.0));
        }
        for (var r = 0u; r < MR_ROWS; r++) {
            let row = min(row0 + r, p.n_rows - 1u);
            let wu = unit16(0u, row, k16);
#if GATED
            let uu = unit16(1u, row, k16);
#endif
            for (var j = 0u; j < TT; j++) {
                acc[r * TT + j].x += unit_dot(wu, xs[j], sx[j]);
#if GATED
                acc[r * TT + j].y += unit_dot(uu, xs[j], sx[j]);
#endif
            }
        }
    }
    reduce_rows(t0, n_tok, row0, acc, sum_sq, lid, sg_lane, sg_size);
}

// Rust dispatch: src/kernels/linear/ (masked_fits); CPU reference and tests: ARCHITECTURE.md ops table (tests/kernels.rs packed_linear_*, ggml_*).
// Decode matvec over packed integer weights for CPU adapters that keep them in storage
// buffers (SwiftShader, the browser's software GPU; lavapipe's texture layout is
// matvec_q_tiled.wgsl): y[t, row_offset + n] = epilogue(sum_k W[n, k] x'[t, k]), the same
// fused prologue and epilogues as matvec_q_rows4.wgsl (NORM, GATED, BIAS, RESIDUAL, GATHER).
//
// Each invocation computes four adjacent rows, walking them in 16-element units: one x'
// load serves four rows, the codes are decoded in place (common/masked.wgsl) and each
// group's scale and minimum are applied once. Invocations share nothing, so no subgroups or
// barriers are needed (WebGPU in browsers through wgpu 30 gets no subgroups). On
// SwiftShader's JIT the decode, not the loads, is the cost: sharing x by subgroupBroadcast
// measured within noise of loading it per lane.
#include "common/linear.wgsl"
#include "common/gather.wgsl"
const TT: u32 = 1u;
#include "common/matvec_end.wgsl"
#include "common/masked.wgsl"
#include "common/hi_words4.wgsl"

// sum(q x') of one 16-element unit (two steps) of the row of matrix m whose code words start
// at `rb`, its high-plane word `hw` given.
fn unit_dot(m: u32, rb: u32, k16: u32, hw: u32, x0: array<vec4<f32>, 2>, x1: array<vec4<f32>, 2>) -> f32 {
    return mdot(step_words_hi(m, rb, k16, hw), x0) + mdot(step_words_hi(m, rb, k16 + 8u, hw), x1);
}

// The four rows' d and (m + MASK_OFF d) of one group.
fn dm4(s: Scales4) -> array<vec4<f32>, 2> {
    let d = vec4<f32>(s.s0.x, s.s1.x, s.s2.x, s.s3.x);
    return array<vec4<f32>, 2>(d, vec4<f32>(s.s0.y, s.s1.y, s.s2.y, s.s3.y) + MASK_OFF * d);
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let t = wid.z;
    if (t >= step_rows()) {
        return;
    }
    let xb4 = xrow_of(t) * (p.x_stride / 4u);
    let row0 = ((wid.y * p.grid_x + wid.x) * WG + lid) * 4u;
    if (row0 >= p.n_rows) {
        return;
    }
    // Rows past n_rows read the last row and are not stored.
    let r = min(vec4<u32>(row0) + vec4<u32>(0u, 1u, 2u, 3u), vec4<u32>(p.n_rows - 1u));
    let wb = r * row_words();
    let sb0 = r * scale_row_words();
    var a = vec4<f32>(0.0);
    var ua = vec4<f32>(0.0);
    var ss = 0.0;
    // Super-block scale words and high-plane words, read once per super-block / HI_SPAN
    // elements (the rows are walked in order).
    var wh: Heads4;
    var hw = vec4<u32>(0u);
#if GATED
    var uh: Heads4;
    var hu = vec4<u32>(0u);
#endif
    for (var gi = 0u; gi < p.k / p.group; gi++) {
        let sw = dm4(scales4(0u, sb0, gi, &wh));
#if GATED
        let su = dm4(scales4(1u, sb0, gi, &uh));
#endif
        var cw = vec4<f32>(0.0);
        var cu = vec4<f32>(0.0);
        var sx = vec4<f32>(0.0);
        for (var k16 = gi * p.group; k16 < (gi + 1u) * p.group; k16 += 16u) {
            let v0 = load_x4(xb4, k16 / 4u, &ss);
            let v1 = load_x4(xb4, k16 / 4u + 1u, &ss);
            let v2 = load_x4(xb4, k16 / 4u + 2u, &ss);
            let v3 = load_x4(xb4, k16 / 4u + 3u, &ss);
            sx += (v0 + v1) + (v2 + v3);
            let x0 = xsplit(v0, v1);
            let x1 = xsplit(v2, v3);
            hw = hi_words4(0u, wb, k16, hw);
            cw += vec4<f32>(unit_dot(0u, wb.x, k16, hw.x, x0, x1), unit_dot(0u, wb.y, k16, hw.y, x0, x1),
                            unit_dot(0u, wb.z, k16, hw.z, x0, x1), unit_dot(0u, wb.w, k16, hw.w, x0, x1));
#if GATED
            hu = hi_words4(1u, wb, k16, hu);
            cu += vec4<f32>(unit_dot(1u, wb.x, k16, hu.x, x0, x1), unit_dot(1u, wb.y, k16, hu.y, x0, x1),
                            unit_dot(1u, wb.z, k16, hu.z, x0, x1), unit_dot(1u, wb.w, k16, hu.w, x0, x1));
#endif
        }
        let sxs = dot(sx, vec4<f32>(1.0));
        a += sw[0] * cw + sw[1] * sxs;
#if GATED
        ua += su[0] * cu + su[1] * sxs;
#endif
    }
    for (var i = 0u; i < 4u; i++) {
        if (row0 + i < p.n_rows) {
            finish(t, row0 + i, vec3<f32>(a[i], ua[i], ss));
        }
    }
}

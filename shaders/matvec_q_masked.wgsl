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
//
// Batched steps (speculative verify, a few sequences): TOK4 and TOK8 take four and eight
// tokens per pass over the weights, every code decoded once (`unit_vals`) and multiplied
// into each token's x'.
#include "common/linear.wgsl"
#include "common/gather.wgsl"
#if TOK8
const TT: u32 = 8u;
#elif TOK4
const TT: u32 = 4u;
#else
const TT: u32 = 1u;
#endif
#include "common/matvec_end.wgsl"
#include "common/masked.wgsl"
#include "common/hi_words4.wgsl"

#ifndef TOK4
// sum(q x') of one 16-element unit (two steps) of the row of matrix m whose code words start
// at `rb`, its high-plane word `hw` given.
fn unit_dot(m: u32, rb: u32, k16: u32, hw: u32, x0: array<vec4<f32>, 2>, x1: array<vec4<f32>, 2>) -> f32 {
    return mdot(step_words_hi(m, rb, k16, hw), x0) + mdot(step_words_hi(m, rb, k16 + 8u, hw), x1);
}
#endif

// The four rows' d and (m + MASK_OFF d) of one group.
fn dm4(s: Scales4) -> array<vec4<f32>, 2> {
    let d = vec4<f32>(s.s0.x, s.s1.x, s.s2.x, s.s3.x);
    return array<vec4<f32>, 2>(d, vec4<f32>(s.s0.y, s.s1.y, s.s2.y, s.s3.y) + MASK_OFF * d);
}

#if TOK4
// The decoded codes of one 16-element unit (two steps) of the row of matrix m whose code
// words start at `rb`, its high-plane word `hw` given: the masked bytes as floats (A and B of
// each step), for `vdot` with any token's x'.
fn unit_vals(m: u32, rb: u32, k16: u32, hw: u32) -> array<vec4<f32>, 4> {
    let a = mbytes(step_words_hi(m, rb, k16, hw));
    let b = mbytes(step_words_hi(m, rb, k16 + 8u, hw));
    return array<vec4<f32>, 4>(mvals(a.x), mvals(a.y), mvals(b.x), mvals(b.y));
}

// sum(q x') of a unit from `unit_vals` (the same sums in the same order as `unit_dot`).
fn vdot(v: array<vec4<f32>, 4>, x0: array<vec4<f32>, 2>, x1: array<vec4<f32>, 2>) -> f32 {
    return (dot(v[0], x0[0]) + dot(v[1], x0[1])) + (dot(v[2], x1[0]) + dot(v[3], x1[1]));
}
#endif

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
#if TOK4
    masked_tokens(wid.z * TT, step_rows(), wid, lid);
#else
    masked_one(wid.z, wid, lid);
#endif
}

#ifndef TOK4
// Four rows of token t.
fn masked_one(t: u32, wid: vec3<u32>, lid: u32) {
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
#endif

#if TOK4
// Four rows of tokens t0 .. t0 + TT (TOK4, TOK8): each unit's codes decoded once for every
// token; tokens past n_tok read the last one and are not stored. Per token the sums are
// those of `masked_one`, in the same order.
fn masked_tokens(t0: u32, n_tok: u32, wid: vec3<u32>, lid: u32) {
    if (t0 >= n_tok) {
        return;
    }
    let row0 = ((wid.y * p.grid_x + wid.x) * WG + lid) * 4u;
    if (row0 >= p.n_rows) {
        return;
    }
    var xb4: array<u32, TT>;
    for (var j = 0u; j < TT; j++) {
        xb4[j] = xrow_of(min(t0 + j, n_tok - 1u)) * (p.x_stride / 4u);
    }
    let r = min(vec4<u32>(row0) + vec4<u32>(0u, 1u, 2u, 3u), vec4<u32>(p.n_rows - 1u));
    let wb = r * row_words();
    let sb0 = r * scale_row_words();
    // a[j], ua[j]: the four rows' sums for token t0 + j; ss[j] its sum of squares.
    var a: array<vec4<f32>, TT>;
    var ua: array<vec4<f32>, TT>;
    var ss: array<f32, TT>;
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
        var cw: array<vec4<f32>, TT>;
        var cu: array<vec4<f32>, TT>;
        var sx: array<vec4<f32>, TT>;
        for (var k16 = gi * p.group; k16 < (gi + 1u) * p.group; k16 += 16u) {
            hw = hi_words4(0u, wb, k16, hw);
            let w0 = unit_vals(0u, wb.x, k16, hw.x);
            let w1 = unit_vals(0u, wb.y, k16, hw.y);
            let w2 = unit_vals(0u, wb.z, k16, hw.z);
            let w3 = unit_vals(0u, wb.w, k16, hw.w);
#if GATED
            hu = hi_words4(1u, wb, k16, hu);
            let u0 = unit_vals(1u, wb.x, k16, hu.x);
            let u1 = unit_vals(1u, wb.y, k16, hu.y);
            let u2 = unit_vals(1u, wb.z, k16, hu.z);
            let u3 = unit_vals(1u, wb.w, k16, hu.w);
#endif
            for (var j = 0u; j < TT; j++) {
                // (A pointer to a whole variable: naga's SPIR-V writer fails on one to an element.)
                var sq = ss[j];
                let v0 = load_x4(xb4[j], k16 / 4u, &sq);
                let v1 = load_x4(xb4[j], k16 / 4u + 1u, &sq);
                let v2 = load_x4(xb4[j], k16 / 4u + 2u, &sq);
                let v3 = load_x4(xb4[j], k16 / 4u + 3u, &sq);
                ss[j] = sq;
                sx[j] += (v0 + v1) + (v2 + v3);
                let x0 = xsplit(v0, v1);
                let x1 = xsplit(v2, v3);
                cw[j] += vec4<f32>(vdot(w0, x0, x1), vdot(w1, x0, x1), vdot(w2, x0, x1), vdot(w3, x0, x1));
#if GATED
                cu[j] += vec4<f32>(vdot(u0, x0, x1), vdot(u1, x0, x1), vdot(u2, x0, x1), vdot(u3, x0, x1));
#endif
            }
        }
        for (var j = 0u; j < TT; j++) {
            let sxs = dot(sx[j], vec4<f32>(1.0));
            a[j] += sw[0] * cw[j] + sw[1] * sxs;
#if GATED
            ua[j] += su[0] * cu[j] + su[1] * sxs;
#endif
        }
    }
    for (var j = 0u; j < TT; j++) {
        if (t0 + j < n_tok) {
            for (var i = 0u; i < 4u; i++) {
                if (row0 + i < p.n_rows) {
                    finish(t0 + j, row0 + i, vec3<f32>(a[j][i], ua[j][i], ss[j]));
                }
            }
        }
    }
}
#endif

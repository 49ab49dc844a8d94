// Rust dispatch: src/kernels/linear/ (packed_matvec_layout); CPU reference and tests: ARCHITECTURE.md ops table (tests/kernels.rs packed_linear_*, ggml_*).
// y[t, row_offset + n] = epilogue(sum_k W[n, k] * x'[t, k]) over packed integer weights (every
// W_PACKED format; layout in src/quant/mod.rs): every code word is read once and dequantized
// in registers with its group's scale, never written back. The fused prologue/epilogues are
// common/linear.wgsl's (NORM, GATED, BIAS, RESIDUAL) and GATHER's gathered rows
// (common/gather.wgsl). The decode matvec's layouts, one file each: matvec_q_rows4.wgsl (CPU
// adapters, storage buffers), matvec_q_tiled.wgsl (CPU adapters with 8-lane subgroups,
// tiled textures), matvec_q_masked.wgsl (SwiftShader), matvec_q_multi.wgsl (GPUs) and
// matvec_q_wg.wgsl (GPUs, groups of 8).
//
// This file: ROWS4 (CPU adapters whose weights stay in storage buffers): each invocation
// computes four adjacent rows, walking the rows' groups and 8-element steps
// (common/weights.wgsl: w_q8w, codes8, scales4), so one x load serves four rows and one code
// word eight weights: loads, not bytes, are what CPU adapters pay for. With XBCAST (the
// workgroup of 8 is one subgroup) x is loaded one element per lane and handed to every lane
// with subgroupBroadcast, one load per element instead of one per lane (lavapipe runs
// divergent loads lane by lane); with XBCAST and TOK4 every code word decoded serves four
// tokens (batched steps). x (and the norm weight) are read as vec4 without XBCAST: k is a
// multiple of the group size (itself a multiple of 8) and the host checks that x_stride is
// a multiple of 4.
#include "common/linear.wgsl"
#include "common/gather.wgsl"
#include "common/matvec_end.wgsl"

// One row's product over one step: its code bits `b`, group scale `s`.
fn dot_step(b: vec2<u32>, s: vec2<f32>, xa: vec4<f32>, xh: vec4<f32>) -> f32 {
    let c = codes8(b);
    return dot(deq(c[0], s), xa) + dot(deq(c[1], s), xh);
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let n_tok = step_rows();
#if TOK4
    rows4_bcast4(wid.z * 4u, n_tok, wid, lid);
#else
    let t = wid.z;
    if (t >= n_tok) {
        return;
    }
#if XBCAST
    rows4_bcast(t, xrow_of(t) * p.x_stride, wid, lid);
#else
    rows4(t, xrow_of(t) * (p.x_stride / 4u), wid, lid);
#endif
#endif
}

#if XBCAST
// The four rows an invocation of the XBCAST layouts computes: the first, and the word bases
// of the rows' codes and scales (rows past n_rows read the last row and are not stored, so
// control flow stays uniform).
struct Rows4 {
    row0: u32,
    wb: vec4<u32>,
    sb: vec4<u32>,
}

fn rows4_at(wid: vec3<u32>, lid: u32) -> Rows4 {
    let row0 = ((wid.y * p.grid_x + wid.x) * WG + lid) * 4u;
    let r = min(vec4<u32>(row0) + vec4<u32>(0u, 1u, 2u, 3u), vec4<u32>(p.n_rows - 1u));
    return Rows4(row0, r * row_words(), r * scale_row_words());
}

#include "common/hi_words4.wgsl"

// ROWS4 with x shared by subgroupBroadcast: the workgroup (WG = 8 lanes) is one subgroup, so
// control flow stays uniform to the end (rows past n_rows are read clamped, never stored).
// Each step covers 8 elements of x: one load per lane, then eight broadcasts.
fn rows4_bcast(t: u32, xb: u32, wid: vec3<u32>, lid: u32) {
    let rw = rows4_at(wid, lid);
    let row0 = rw.row0;
    let wb = rw.wb;
    let sb0 = rw.sb;
    var a = vec4<f32>(0.0);
    var ua = vec4<f32>(0.0);
    var ss = 0.0;
    let spg = p.group / 8u;
    // Super-block scale words and high-plane words, read once per super-block / HI_SPAN
    // elements (the row is walked in order).
    var wh: Heads4;
    var hw = vec4<u32>(0u);
#if GATED
    var uh: Heads4;
    var hu = vec4<u32>(0u);
#endif
    for (var gi = 0u; gi < p.k / p.group; gi++) {
        let s = scales4(0u, sb0, gi, &wh);
#if GATED
        let su = scales4(1u, sb0, gi, &uh);
#endif
        for (var j = 0u; j < spg; j++) {
            let k8 = (gi * spg + j) * 8u;
            hw = hi_words4(0u, wb, k8, hw);
#if GATED
            hu = hi_words4(1u, wb, k8, hu);
#endif
            let xl = load_x1(xb, k8 + lid, &ss);
            let xv = bcast8(xl);
            let xa = xv[0];
            let xh = xv[1];
            a += vec4<f32>(dot_step(step_words_hi(0u, wb.x, k8, hw.x), s.s0, xa, xh), dot_step(step_words_hi(0u, wb.y, k8, hw.y), s.s1, xa, xh),
                           dot_step(step_words_hi(0u, wb.z, k8, hw.z), s.s2, xa, xh), dot_step(step_words_hi(0u, wb.w, k8, hw.w), s.s3, xa, xh));
#if GATED
            ua += vec4<f32>(dot_step(step_words_hi(1u, wb.x, k8, hu.x), su.s0, xa, xh), dot_step(step_words_hi(1u, wb.y, k8, hu.y), su.s1, xa, xh),
                            dot_step(step_words_hi(1u, wb.z, k8, hu.z), su.s2, xa, xh), dot_step(step_words_hi(1u, wb.w, k8, hu.w), su.s3, xa, xh));
#endif
        }
    }
    // Each lane summed the squares of its own elements.
    let s0 = subgroupAdd(ss);
    for (var i = 0u; i < 4u; i++) {
        if (row0 + i < p.n_rows) {
            finish(t, row0 + i, vec3<f32>(a[i], ua[i], s0));
        }
    }
}

// w . x' over one step's eight values (elements 0-3 against xa, 4-7 against xh).
fn dot8v(v: array<vec4<f32>, 2>, xa: vec4<f32>, xh: vec4<f32>) -> f32 {
    return dot(v[0], xa) + dot(v[1], xh);
}

// One row's eight dequantized values of one step: its code bits `b`, group scale `s`.
fn vals8(b: vec2<u32>, s: vec2<f32>) -> array<vec4<f32>, 2> {
    let c = codes8(b);
    return array<vec4<f32>, 2>(deq(c[0], s), deq(c[1], s));
}

// Four rows' products over one step's eight elements.
fn dot4r(v0: array<vec4<f32>, 2>, v1: array<vec4<f32>, 2>, v2: array<vec4<f32>, 2>, v3: array<vec4<f32>, 2>, xa: vec4<f32>, xh: vec4<f32>) -> vec4<f32> {
    return vec4<f32>(dot8v(v0, xa, xh), dot8v(v1, xa, xh), dot8v(v2, xa, xh), dot8v(v3, xa, xh));
}

// rows4_bcast for tokens t0 .. t0 + 3 (TOK4 without TEX): every code word read and
// dequantized once serves four tokens, whose x elements are loaded one per lane and
// broadcast. Tokens past n_tok read the last one and are not stored. The four tokens'
// accumulators are named values (lavapipe turns dynamically indexed private arrays into
// memory).
fn rows4_bcast4(t0: u32, n_tok: u32, wid: vec3<u32>, lid: u32) {
    if (t0 >= n_tok) {
        return;
    }
    let tl = n_tok - 1u;
    let xb0 = xrow_of(t0) * p.x_stride;
    let xb1 = xrow_of(min(t0 + 1u, tl)) * p.x_stride;
    let xb2 = xrow_of(min(t0 + 2u, tl)) * p.x_stride;
    let xb3 = xrow_of(min(t0 + 3u, tl)) * p.x_stride;
    let rw = rows4_at(wid, lid);
    let row0 = rw.row0;
    let wb = rw.wb;
    let sb0 = rw.sb;
    var a0 = vec4<f32>(0.0);
    var a1 = vec4<f32>(0.0);
    var a2 = vec4<f32>(0.0);
    var a3 = vec4<f32>(0.0);
    var ua0 = vec4<f32>(0.0);
    var ua1 = vec4<f32>(0.0);
    var ua2 = vec4<f32>(0.0);
    var ua3 = vec4<f32>(0.0);
    var ss0 = 0.0;
    var ss1 = 0.0;
    var ss2 = 0.0;
    var ss3 = 0.0;
    let spg = p.group / 8u;
    var wh: Heads4;
    var hw = vec4<u32>(0u);
#if GATED
    var uh: Heads4;
    var hu = vec4<u32>(0u);
#endif
    for (var gi = 0u; gi < p.k / p.group; gi++) {
        let s = scales4(0u, sb0, gi, &wh);
#if GATED
        let su = scales4(1u, sb0, gi, &uh);
#endif
        for (var j = 0u; j < spg; j++) {
            let k8 = (gi * spg + j) * 8u;
            hw = hi_words4(0u, wb, k8, hw);
#if GATED
            hu = hi_words4(1u, wb, k8, hu);
#endif
            let v0 = vals8(step_words_hi(0u, wb.x, k8, hw.x), s.s0);
            let v1 = vals8(step_words_hi(0u, wb.y, k8, hw.y), s.s1);
            let v2 = vals8(step_words_hi(0u, wb.z, k8, hw.z), s.s2);
            let v3 = vals8(step_words_hi(0u, wb.w, k8, hw.w), s.s3);
            let x0 = bcast8(load_x1(xb0, k8 + lid, &ss0));
            let x1 = bcast8(load_x1(xb1, k8 + lid, &ss1));
            let x2 = bcast8(load_x1(xb2, k8 + lid, &ss2));
            let x3 = bcast8(load_x1(xb3, k8 + lid, &ss3));
            a0 += dot4r(v0, v1, v2, v3, x0[0], x0[1]);
            a1 += dot4r(v0, v1, v2, v3, x1[0], x1[1]);
            a2 += dot4r(v0, v1, v2, v3, x2[0], x2[1]);
            a3 += dot4r(v0, v1, v2, v3, x3[0], x3[1]);
#if GATED
            let g0 = vals8(step_words_hi(1u, wb.x, k8, hu.x), su.s0);
            let g1 = vals8(step_words_hi(1u, wb.y, k8, hu.y), su.s1);
            let g2 = vals8(step_words_hi(1u, wb.z, k8, hu.z), su.s2);
            let g3 = vals8(step_words_hi(1u, wb.w, k8, hu.w), su.s3);
            ua0 += dot4r(g0, g1, g2, g3, x0[0], x0[1]);
            ua1 += dot4r(g0, g1, g2, g3, x1[0], x1[1]);
            ua2 += dot4r(g0, g1, g2, g3, x2[0], x2[1]);
            ua3 += dot4r(g0, g1, g2, g3, x3[0], x3[1]);
#endif
        }
    }
    // Each lane summed the squares of its own elements.
    let q0 = subgroupAdd(ss0);
    let q1 = subgroupAdd(ss1);
    let q2 = subgroupAdd(ss2);
    let q3 = subgroupAdd(ss3);
    for (var i = 0u; i < 4u; i++) {
        if (row0 + i < p.n_rows) {
            finish(t0, row0 + i, vec3<f32>(a0[i], ua0[i], q0));
            if (t0 + 1u < n_tok) {
                finish(t0 + 1u, row0 + i, vec3<f32>(a1[i], ua1[i], q1));
            }
            if (t0 + 2u < n_tok) {
                finish(t0 + 2u, row0 + i, vec3<f32>(a2[i], ua2[i], q2));
            }
            if (t0 + 3u < n_tok) {
                finish(t0 + 3u, row0 + i, vec3<f32>(a3[i], ua3[i], q3));
            }
        }
    }
}
#else

// ROWS4 from storage, x as vec4 loads: rows past n_rows read the last row and are not stored.
fn rows4(t: u32, xb4: u32, wid: vec3<u32>, lid: u32) {
    let row0 = ((wid.y * p.grid_x + wid.x) * WG + lid) * 4u;
    if (row0 >= p.n_rows) {
        return;
    }
    let last = p.n_rows - 1u;
    let r = min(vec4<u32>(row0) + vec4<u32>(0u, 1u, 2u, 3u), vec4<u32>(last));
    let wb = r * row_words();
    var a = vec4<f32>(0.0);
    var ua = vec4<f32>(0.0);
    var s0 = 0.0;
    let spg = p.group / 8u;
    let sb0 = r * scale_row_words();
    var wh: Heads4;
#if GATED
    var uh: Heads4;
#endif
    for (var gi = 0u; gi < p.k / p.group; gi++) {
        let s = scales4(0u, sb0, gi, &wh);
#if GATED
        let su = scales4(1u, sb0, gi, &uh);
#endif
        for (var j = 0u; j < spg; j++) {
            let k8 = (gi * spg + j) * 8u;
            let xa = load_x4(xb4, k8 / 4u, &s0);
            let xh = load_x4(xb4, k8 / 4u + 1u, &s0);
            a += vec4<f32>(dot_step(w_q8w(wb.x, k8), s.s0, xa, xh), dot_step(w_q8w(wb.y, k8), s.s1, xa, xh),
                           dot_step(w_q8w(wb.z, k8), s.s2, xa, xh), dot_step(w_q8w(wb.w, k8), s.s3, xa, xh));
#if GATED
            ua += vec4<f32>(dot_step(u_q8w(wb.x, k8), su.s0, xa, xh), dot_step(u_q8w(wb.y, k8), su.s1, xa, xh),
                            dot_step(u_q8w(wb.z, k8), su.s2, xa, xh), dot_step(u_q8w(wb.w, k8), su.s3, xa, xh));
#endif
        }
    }
    for (var i = 0u; i < 4u; i++) {
        if (row0 + i < p.n_rows) {
            finish(t, row0 + i, vec3<f32>(a[i], ua[i], s0));
        }
    }
}
#endif

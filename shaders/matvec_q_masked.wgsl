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
// Q4_K and Q5_K walk a super-block's eight groups in an unrolled sequence of calls with
// literal sub-block indices: the drivers inline them (SwiftShader runs spirv-opt's
// performance passes), so the packed 6-bit scales are extracted by constant shifts instead
// of selects on a loop counter (Q4_K on SwiftShader: 20 -> 15 ms for a 2048 x 2048 matvec).
// Q6_K's sixteen groups measured slower unrolled (26 -> 37 ms) and keep the loop.
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

// What an invocation carries along its rows: the four rows' sums for W (and U), x's sum of
// squares (NORM), and the high-plane words held for HI_SPAN elements.
struct Acc {
    a: vec4<f32>,
    ua: vec4<f32>,
    ss: f32,
    hw: vec4<u32>,
    hu: vec4<u32>,
}

// Adds group gi of the four rows (code words from `wb`, input row from vec4 `xb4`), scaled by
// `sw` (and `su`) from dm4, to `*acc`.
fn group_dot(xb4: u32, wb: vec4<u32>, gi: u32, sw: array<vec4<f32>, 2>, su: array<vec4<f32>, 2>, acc: ptr<function, Acc>) {
    var cw = vec4<f32>(0.0);
    var cu = vec4<f32>(0.0);
    var sx = vec4<f32>(0.0);
    var ss = (*acc).ss;
    for (var k16 = gi * p.group; k16 < (gi + 1u) * p.group; k16 += 16u) {
        let v0 = load_x4(xb4, k16 / 4u, &ss);
        let v1 = load_x4(xb4, k16 / 4u + 1u, &ss);
        let v2 = load_x4(xb4, k16 / 4u + 2u, &ss);
        let v3 = load_x4(xb4, k16 / 4u + 3u, &ss);
        sx += (v0 + v1) + (v2 + v3);
        let x0 = xsplit(v0, v1);
        let x1 = xsplit(v2, v3);
        let hw = hi_words4(0u, wb, k16, (*acc).hw);
        (*acc).hw = hw;
        cw += vec4<f32>(unit_dot(0u, wb.x, k16, hw.x, x0, x1), unit_dot(0u, wb.y, k16, hw.y, x0, x1),
                        unit_dot(0u, wb.z, k16, hw.z, x0, x1), unit_dot(0u, wb.w, k16, hw.w, x0, x1));
#if GATED
        let hu = hi_words4(1u, wb, k16, (*acc).hu);
        (*acc).hu = hu;
        cu += vec4<f32>(unit_dot(1u, wb.x, k16, hu.x, x0, x1), unit_dot(1u, wb.y, k16, hu.y, x0, x1),
                        unit_dot(1u, wb.z, k16, hu.z, x0, x1), unit_dot(1u, wb.w, k16, hu.w, x0, x1));
#endif
    }
    (*acc).ss = ss;
    let sxs = dot(sx, vec4<f32>(1.0));
    (*acc).a += sw[0] * cw + sw[1] * sxs;
#if GATED
    (*acc).ua += su[0] * cu + su[1] * sxs;
#endif
}

// Every group in order, each group's scales decoded at the loop's index (super-block scale
// words, Q6_K's, read once per super-block into wh / uh).
fn walk_groups(xb4: u32, wb: vec4<u32>, sb0: vec4<u32>, acc: ptr<function, Acc>) {
    var wh: Heads4;
    var uh: Heads4;
    for (var gi = 0u; gi < p.k / p.group; gi++) {
        let sw = dm4(scales4(0u, sb0, gi, &wh));
#if GATED
        let su = dm4(scales4(1u, sb0, gi, &uh));
#else
        let su = sw;
#endif
        group_dot(xb4, wb, gi, sw, su, acc);
    }
}

#if W_SUPER
// The four rows' super-block scale words of super-block sb of matrix m.
fn heads4(m: u32, sb0: vec4<u32>, sb: u32) -> Heads4 {
    return Heads4(sb_head(m, sb0.x, sb), sb_head(m, sb0.y, sb), sb_head(m, sb0.z, sb), sb_head(m, sb0.w, sb));
}

#if W_Q6K
// The four rows' super-block d (Q6_K).
fn d4(h: Heads4) -> vec4<f32> {
    let d0 = unpack2x16float(h.h0.x);
    let d1 = unpack2x16float(h.h1.x);
    let d2 = unpack2x16float(h.h2.x);
    let d3 = unpack2x16float(h.h3.x);
    return select(vec4<f32>(d0.x, d1.x, d2.x, d3.x), vec4<f32>(d0.y, d1.y, d2.y, d3.y), h.h0.xh == 1u);
}

// Q6_K sub-block 4 q + i (i a literal at every call) of super-block sb: its signed 8-bit
// scales are byte i of the rows' scale words `bw` (word q of each header).
fn q6_dot(xb4: u32, wb: vec4<u32>, g: u32, i: u32, dw: vec4<f32>, bw: vec4<u32>, du: vec4<f32>, bu: vec4<u32>, acc: ptr<function, Acc>) {
    let sw = dw * vec4<f32>(bitcast<vec4<i32>>(bw << vec4<u32>(24u - 8u * i)) >> vec4<u32>(24u));
    let su = du * vec4<f32>(bitcast<vec4<i32>>(bu << vec4<u32>(24u - 8u * i)) >> vec4<u32>(24u));
    group_dot(xb4, wb, g, array<vec4<f32>, 2>(sw, MASK_OFF * sw), array<vec4<f32>, 2>(su, MASK_OFF * su), acc);
}

// Word q of the four rows' headers.
fn hword4(h: Heads4, q: u32) -> vec4<u32> {
    return vec4<u32>(pick4(h.h0.h, q), pick4(h.h1.h, q), pick4(h.h2.h, q), pick4(h.h3.h, q));
}
#endif

// dm4 of sub-block j (a literal at every call) of the four rows' super-blocks `h`.
fn dm4_at(h: Heads4, j: u32) -> array<vec4<f32>, 2> {
    return dm4(Scales4(sb_scale(h.h0.h, h.h0.x, h.h0.xh, j), sb_scale(h.h1.h, h.h1.x, h.h1.xh, j),
                       sb_scale(h.h2.h, h.h2.x, h.h2.xh, j), sb_scale(h.h3.h, h.h3.x, h.h3.xh, j)));
}

// Sub-block j of super-block sb: the group's scales and its dot.
fn sub_dot(xb4: u32, wb: vec4<u32>, sb: u32, j: u32, hw: Heads4, hu: Heads4, acc: ptr<function, Acc>) {
#if GATED
    let su = dm4_at(hu, j);
#else
    let su = array<vec4<f32>, 2>(vec4<f32>(0.0), vec4<f32>(0.0));
#endif
    group_dot(xb4, wb, sb * groups_per_sb() + j, dm4_at(hw, j), su, acc);
}
#endif

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
    var acc = Acc(vec4<f32>(0.0), vec4<f32>(0.0), 0.0, vec4<u32>(0u), vec4<u32>(0u));
#if W_Q6K
    // Per super-block: the rows' d once, then four words of signed 8-bit scales, each
    // word's four groups at literal byte positions.
    for (var sb = 0u; sb < p.k / 256u; sb++) {
        let hw = heads4(0u, sb0, sb);
        let dw = d4(hw);
#if GATED
        let hu = heads4(1u, sb0, sb);
        let du = d4(hu);
#else
        let hu = hw;
        let du = dw;
#endif
        for (var q = 0u; q < 4u; q++) {
            let bw = hword4(hw, q);
            let bu = hword4(hu, q);
            let g = sb * 16u + 4u * q;
            q6_dot(xb4, wb, g, 0u, dw, bw, du, bu, &acc);
            q6_dot(xb4, wb, g + 1u, 1u, dw, bw, du, bu, &acc);
            q6_dot(xb4, wb, g + 2u, 2u, dw, bw, du, bu, &acc);
            q6_dot(xb4, wb, g + 3u, 3u, dw, bw, du, bu, &acc);
        }
    }
#elif W_SUPER
    // Super-block scale words read once per super-block, each group's scales decoded at a
    // literal index.
    for (var sb = 0u; sb < p.k / 256u; sb++) {
        let hw = heads4(0u, sb0, sb);
#if GATED
        let hu = heads4(1u, sb0, sb);
#else
        let hu = hw;
#endif
        sub_dot(xb4, wb, sb, 0u, hw, hu, &acc);
        sub_dot(xb4, wb, sb, 1u, hw, hu, &acc);
        sub_dot(xb4, wb, sb, 2u, hw, hu, &acc);
        sub_dot(xb4, wb, sb, 3u, hw, hu, &acc);
        sub_dot(xb4, wb, sb, 4u, hw, hu, &acc);
        sub_dot(xb4, wb, sb, 5u, hw, hu, &acc);
        sub_dot(xb4, wb, sb, 6u, hw, hu, &acc);
        sub_dot(xb4, wb, sb, 7u, hw, hu, &acc);
    }
#else
    walk_groups(xb4, wb, sb0, &acc);
#endif
    for (var i = 0u; i < 4u; i++) {
        if (row0 + i < p.n_rows) {
            finish(t, row0 + i, vec3<f32>(acc.a[i], acc.ua[i], acc.ss));
        }
    }
}

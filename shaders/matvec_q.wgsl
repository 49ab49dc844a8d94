// Rust dispatch: src/kernels/linear.rs (matvec_layout); CPU reference and tests: ARCHITECTURE.md ops table (tests/kernels.rs packed_linear_*, ggml_*).
// Decode matvec over packed integer weights (every W_PACKED format; layout in
// src/quant/mod.rs): y[t, row_offset + n] = epilogue(sum_k W[n, k] * x'[t, k]) where every
// code word is read once and dequantized in registers (c d + m with the group's scale), never
// written back. Same fused prologue/epilogues as matvec.wgsl: NORM, GATED, BIAS, RESIDUAL,
// GATHER. Rows are walked in steps of 8 elements (common/weights.wgsl: w_q8w, codes8,
// w_scale). x (and the norm weight) are read as vec4: k is a multiple of the group size
// (itself a multiple of 8) and the host checks that x_stride is a multiple of 4.
//
// Layouts: ROWS4 (CPU adapters): each invocation computes four adjacent rows, walking the
// row's groups and steps, so one x load serves four rows and one code word serves eight
// weights: loads, not bytes, are what CPU adapters pay for.
// XBCAST (with ROWS4, on CPU adapters whose workgroup of 8 is one subgroup): x is loaded one
// element per lane and handed to every lane with subgroupBroadcast, so each element costs
// one load instead of one per lane (lavapipe runs divergent loads lane by lane).
// ROW_PER_WORKGROUP (GPUs): a workgroup per row, invocations striding over the row's steps
// (coalesced code words), reduced with subgroups when SUBGROUPS is set. F16 dequantizes in
// half precision.
// MULTI_ROW (GPUs, the default there for groups of 16 or more): MR_ROWS rows per workgroup,
// 16-element units per invocation sharing x' across the rows, minimum factored out (see
// rows_multi).
#include "common/linear.wgsl"
#if GATHER
@group(0) @binding(8) var<storage, read> rows: array<u32>;         // (n_out) rows of x
#endif
#if TEX
// TEX (CPU adapters, with XBCAST): the codes and scales as rgba32uint textures, row r's
// texels at r * texels_per_row + i (linear index i -> (i % TEXW, i / TEXW)), each row padded
// to whole texels, words as in the storage layout. lavapipe fetches a texel (16 bytes) for a
// fraction of what a 4-byte storage load costs, so each lane computes eight rows from
// whole-texel reads.
@group(0) @binding(11) var wtex: texture_2d<u32>;
@group(0) @binding(12) var wstex: texture_2d<u32>;
#if GATED
@group(0) @binding(13) var utex: texture_2d<u32>;
@group(0) @binding(14) var ustex: texture_2d<u32>;
#endif
const TEXW: u32 = 8192u;
#endif
#if TOK4
// Tokens per invocation (TEX) or workgroup (MULTI_ROW): every weight read and
// dequantization serves four tokens.
const TT: u32 = 4u;
#else
const TT: u32 = 1u;
#endif

#include "common/matvec_end.wgsl"

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

// One row's product over one step: its code bits `b`, group scale `s`.
fn dot_step(b: vec2<u32>, s: vec2<f32>, xa: vec4<f32>, xh: vec4<f32>) -> f32 {
    let c = codes8(b);
    return dot(deq(c[0], s), xa) + dot(deq(c[1], s), xh);
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
#if GATHER
    let n_tok = step.n_out;
#else
    let n_tok = step.n_tokens;
#endif
#if MULTI_ROW
#if SUBGROUPS
    rows_multi(wid.z * TT, n_tok, wid, lid, sg_lane, sg_size);
#else
    rows_multi(wid.z * TT, n_tok, wid, lid, 0u, 0u);
#endif
#else
#if TEX
    rows8_tex(wid.z * TT, n_tok, wid, lid);
#else
#if TOK4
    rows4_bcast4(wid.z * 4u, n_tok, wid, lid);
#else
    let t = wid.z;
    if (t >= n_tok) {
        return;
    }
#if GATHER
    let xrow = rows[t];
#else
    let xrow = t;
#endif
#if XBCAST
    rows4_bcast(t, xrow * p.x_stride, wid, lid);
#else
    // Words of codes per row.
    let wpr = row_words();
    let xb4 = xrow * (p.x_stride / 4u);
#if ROW_PER_WORKGROUP
    let row = wid.y * p.grid_x + wid.x;
    if (row >= p.n_rows) {
        return;
    }
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
#else
    // ROWS4: rows past n_rows read the last row and are not stored.
    let row0 = ((wid.y * p.grid_x + wid.x) * WG + lid) * 4u;
    if (row0 >= p.n_rows) {
        return;
    }
    let last = p.n_rows - 1u;
    let r = min(vec4<u32>(row0) + vec4<u32>(0u, 1u, 2u, 3u), vec4<u32>(last));
    let wb = r * wpr;
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
        let sw4 = scales4(0u, sb0, gi, &wh);
        let s_0 = sw4.s0;
        let s_1 = sw4.s1;
        let s_2 = sw4.s2;
        let s_3 = sw4.s3;
#if GATED
        let su4 = scales4(1u, sb0, gi, &uh);
        let t_0 = su4.s0;
        let t_1 = su4.s1;
        let t_2 = su4.s2;
        let t_3 = su4.s3;
#endif
        for (var j = 0u; j < spg; j++) {
            let k8 = (gi * spg + j) * 8u;
            let xa = load_x4(xb4, k8 / 4u, &s0);
            let xh = load_x4(xb4, k8 / 4u + 1u, &s0);
            a += vec4<f32>(dot_step(w_q8w(wb.x, k8), s_0, xa, xh), dot_step(w_q8w(wb.y, k8), s_1, xa, xh),
                           dot_step(w_q8w(wb.z, k8), s_2, xa, xh), dot_step(w_q8w(wb.w, k8), s_3, xa, xh));
#if GATED
            ua += vec4<f32>(dot_step(u_q8w(wb.x, k8), t_0, xa, xh), dot_step(u_q8w(wb.y, k8), t_1, xa, xh),
                            dot_step(u_q8w(wb.z, k8), t_2, xa, xh), dot_step(u_q8w(wb.w, k8), t_3, xa, xh));
#endif
        }
    }
    for (var i = 0u; i < 4u; i++) {
        if (row0 + i < p.n_rows) {
            finish(t, row0 + i, vec3<f32>(a[i], ua[i], s0));
        }
    }
#endif
#endif
#endif
#endif
#endif
}

#if MULTI_ROW

// One row's 16-element unit at k16 (one scale group's worth: groups are multiples of 16):
// its group's (d, m) and its sixteen codes, decoded once for every token of the step. The
// unit's high-plane word is read once for both of its steps.
struct Unit16 {
    s: vec2<f32>,
    c0: array<vec4<f32>, 2>,
    c1: array<vec4<f32>, 2>,
}

fn unit16(m: u32, row: u32, k16: u32) -> Unit16 {
    let rb = row * row_words();
    let hw = hi_word(m, rb, k16);
    return Unit16(scale_at(m, row * scale_row_words(), k16 / p.group), codes8(step_words_hi(m, rb, k16, hw)),
                  codes8(step_words_hi(m, rb, k16 + 8u, hw)));
}

// The unit's raw sum against x' of the unit (`xs`) with its sum `sx`: the minimum is applied
// once per unit (d sum(c x') + m sum(x')), not per element.
fn unit_dot(w: Unit16, xs: array<vec4<f32>, 4>, sx: f32) -> f32 {
    let cx = dot(w.c0[0], xs[0]) + dot(w.c0[1], xs[1]) + dot(w.c1[0], xs[2]) + dot(w.c1[1], xs[3]);
    return w.s.x * cx + w.s.y * sx;
}

// MULTI_ROW (GPUs): the workgroup computes MR_ROWS adjacent rows for TT tokens (TOK4: 4,
// batched steps; else 1). Invocation i takes units i, i + WG, ...: adjacent invocations
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
        let t = min(t0 + j, n_tok - 1u);
#if GATHER
        xb4[j] = rows[t] * (p.x_stride / 4u);
#else
        xb4[j] = t * (p.x_stride / 4u);
#endif
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
#endif

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

// The high-plane words of the four rows of matrix m (0: W, 1: U) for the step at element
// k8: read at the start of each HI_SPAN elements, else the words `held` (the row is walked in
// order).
fn hi_words4(m: u32, wb: vec4<u32>, k8: u32, held: vec4<u32>) -> vec4<u32> {
    if (HI_SPAN != 0u && k8 % max(HI_SPAN, 1u) == 0u) {
        return vec4<u32>(hi_word(m, wb.x, k8), hi_word(m, wb.y, k8), hi_word(m, wb.z, k8), hi_word(m, wb.w, k8));
    }
    return held;
}

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

#if TOK4
// The x row of step token t.
fn xrow_of(t: u32) -> u32 {
#if GATHER
    return rows[t];
#else
    return t;
#endif
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
#endif
#endif

#if TEX
fn texel(tex: texture_2d<u32>, i: u32) -> vec4<u32> {
    return textureLoad(tex, vec2<u32>(i % TEXW, i / TEXW), 0);
}

// Code texels of one row for the 32-element unit `un` (code words of the row from texel
// `cb`): .lo the low-plane texel (Q8: two, in lo and lo2), .hi the high-plane texel.
struct Unit {
    lo: vec4<u32>,
    lo2: vec4<u32>,
    hi: vec4<u32>,
}

fn tex_unit(ct: texture_2d<u32>, cb: u32, un: u32) -> Unit {
    var o: Unit;
#if W_Q8
    o.lo = texel(ct, cb + 2u * un);
    o.lo2 = texel(ct, cb + 2u * un + 1u);
#else
#if W_LO2
    o.lo = texel(ct, cb + un / 2u);
#else
    o.lo = texel(ct, cb + un);
#endif
#endif
#if W_HI1
    o.hi = texel(ct, cb + lo_words() / 4u + un / 4u);
#endif
#if W_HI2
    o.hi = texel(ct, cb + lo_words() / 4u + un / 2u);
#endif
    return o;
}

// The code bits of step h (0-3) of unit `un` from its texels.
fn unit_bits(o: Unit, un: u32, h: u32) -> vec2<u32> {
    let k8 = un * 32u + h * 8u;
#if W_Q8
    let lw = select(o.lo, o.lo2, h >= 2u);
    return step_bits(pick4(lw, (h & 1u) * 2u), pick4(lw, (h & 1u) * 2u + 1u), 0u, k8);
#else
#if W_LO2
    let l = pick4(o.lo, (un & 1u) * 2u + h / 2u);
#else
    let l = pick4(o.lo, h);
#endif
#if W_HI1
    let hw = pick4(o.hi, un & 3u);
#else
#if W_HI2
    let hw = pick4(o.hi, (un & 1u) * 2u + h / 2u);
#else
    let hw = 0u;
#endif
#endif
    return step_bits(l, 0u, hw, k8);
#endif
}

// The scale texels of one row (from texel `sb`) that a step needs: .a the texel holding its
// group's scale word (super-block formats: its super-block's header), .x the extra word
// (Q6_K's d word, Q2_K's d | dmin). `key` is `scale_key` of the step.
struct UnitScale {
    a: vec4<u32>,
    x: u32,
}

// Which scale texels step h of unit `un` reads: its super-block, or the texel index of its
// group's scale word. Steps with the same key share one fetch.
fn scale_key(un: u32, h: u32) -> u32 {
#if W_SUPER
    return un / 8u;
#else
    let gi = (un * 32u + h * 8u) / p.group;
#if W_Q4
    return gi / 4u;
#else
#if W_Q5
    return gi / 4u;
#else
    return gi / 8u;
#endif
#endif
#endif
}

fn tex_scale_words(st: texture_2d<u32>, sb: u32, key: u32) -> UnitScale {
    var o: UnitScale;
#if W_SUPER
#if W_IQ4XS
    o.a = texel(st, sb + key / 2u);
#else
    o.a = texel(st, sb + key);
#endif
    // The extra words start at texel nsb (4 words per super-block before them).
    let nsb = p.k / 256u;
#if W_Q6K
    o.x = pick4(texel(st, sb + nsb + key / 8u), (key / 2u) & 3u);
#endif
#if W_Q2K
    o.x = pick4(texel(st, sb + nsb + key / 4u), key & 3u);
#endif
#else
    o.a = texel(st, sb + key);
#endif
    return o;
}

// (d, m) of step h of unit `un`.
fn unit_scale(o: UnitScale, un: u32, h: u32) -> vec2<f32> {
    let gi = (un * 32u + h * 8u) / p.group;
#if W_SUPER
    let s = un / 8u;
#if W_IQ4XS
    let hd = select(o.a.xy, o.a.zw, (s & 1u) == 1u);
    let hv = vec4<u32>(hd, 0u, 0u);
#else
    let hv = o.a;
#endif
    return sb_scale(hv, o.x, s & 1u, gi % groups_per_sb());
#else
#if W_Q4
    return scale_of(pick4(o.a, gi & 3u), 0u);
#else
#if W_Q5
    return scale_of(pick4(o.a, gi & 3u), 0u);
#else
    return scale_of(pick4(o.a, (gi / 2u) & 3u), gi & 1u);
#endif
#endif
#endif
}

// Row r's eight values of step h of unit `un` from its code texels `o` and scale texels `sc`.
fn row_vals(o: Unit, sc: UnitScale, un: u32, h: u32) -> array<vec4<f32>, 2> {
    let s = unit_scale(sc, un, h);
    let c = codes8(unit_bits(o, un, h));
    return array<vec4<f32>, 2>(deq(c[0], s), deq(c[1], s));
}

// Per token of the block: row accumulators (rows 0-3, 4-7; GATED: the up rows too) and the x
// base of the token.
var<private> acc_a: array<vec4<f32>, TT>;
var<private> acc_b: array<vec4<f32>, TT>;
#if GATED
var<private> acc_ua: array<vec4<f32>, TT>;
var<private> acc_ub: array<vec4<f32>, TT>;
#endif
var<private> xbase: array<u32, TT>;

// Eight rows per lane from texture-held codes and scales, for tokens t0 .. t0 + TT - 1 (TOK4:
// four tokens share every texel fetch and dequantization; x of each token shared by
// subgroupBroadcast). A unit's code texels are fetched at its first step; scale texels when
// a step needs other ones than those held (every 4 groups for Q4_1/Q5_1's word per group,
// every 8 for pairs of f16 d, every super-block). The eight rows are eight named values, not
// an array: lavapipe turns dynamically indexed private arrays into memory.
fn rows8_tex(t0: u32, n_tok: u32, wid: vec3<u32>, lid: u32) {
    if (t0 >= n_tok) {
        return;
    }
    var acc_ss: array<f32, TT>;
    for (var j = 0u; j < TT; j++) {
        // Tokens past the end read the last one and are not stored.
        let t = min(t0 + j, n_tok - 1u);
#if GATHER
        xbase[j] = rows[t] * p.x_stride;
#else
        xbase[j] = t * p.x_stride;
#endif
        acc_a[j] = vec4<f32>(0.0);
        acc_b[j] = vec4<f32>(0.0);
#if GATED
        acc_ua[j] = vec4<f32>(0.0);
        acc_ub[j] = vec4<f32>(0.0);
#endif
        acc_ss[j] = 0.0;
    }
    let row0 = ((wid.y * p.grid_x + wid.x) * WG + lid) * 8u;
    let last = p.n_rows - 1u;
    let ra = min(vec4<u32>(row0) + vec4<u32>(0u, 1u, 2u, 3u), vec4<u32>(last));
    let rb = min(vec4<u32>(row0) + vec4<u32>(4u, 5u, 6u, 7u), vec4<u32>(last));
    // Texel bases of the rows' codes and scales.
    let tpr = (row_words() + 3u) / 4u;
    let spr = (scale_row_words() + 3u) / 4u;
    let ca = ra * tpr;
    let cb = rb * tpr;
    let sa = ra * spr;
    let sb = rb * spr;
    var c0: Unit; var c1: Unit; var c2: Unit; var c3: Unit;
    var c4: Unit; var c5: Unit; var c6: Unit; var c7: Unit;
    var s0: UnitScale; var s1: UnitScale; var s2: UnitScale; var s3: UnitScale;
    var s4: UnitScale; var s5: UnitScale; var s6: UnitScale; var s7: UnitScale;
#if GATED
    var d0: Unit; var d1: Unit; var d2: Unit; var d3: Unit;
    var d4: Unit; var d5: Unit; var d6: Unit; var d7: Unit;
    var e0: UnitScale; var e1: UnitScale; var e2: UnitScale; var e3: UnitScale;
    var e4: UnitScale; var e5: UnitScale; var e6: UnitScale; var e7: UnitScale;
#endif
    // The scale texels held (their `scale_key`).
    var held = 0xffffffffu;
    // 32-element units (texture-held rows are whole units: `tex_fits`), four steps of 8
    // elements each; the step loop has a constant count so that it unrolls.
    for (var un = 0u; un < p.k / 32u; un++) {
        c0 = tex_unit(wtex, ca.x, un); c1 = tex_unit(wtex, ca.y, un); c2 = tex_unit(wtex, ca.z, un); c3 = tex_unit(wtex, ca.w, un);
        c4 = tex_unit(wtex, cb.x, un); c5 = tex_unit(wtex, cb.y, un); c6 = tex_unit(wtex, cb.z, un); c7 = tex_unit(wtex, cb.w, un);
#if GATED
        d0 = tex_unit(utex, ca.x, un); d1 = tex_unit(utex, ca.y, un); d2 = tex_unit(utex, ca.z, un); d3 = tex_unit(utex, ca.w, un);
        d4 = tex_unit(utex, cb.x, un); d5 = tex_unit(utex, cb.y, un); d6 = tex_unit(utex, cb.z, un); d7 = tex_unit(utex, cb.w, un);
#endif
        for (var h = 0u; h < 4u; h++) {
            let key = scale_key(un, h);
            if (key != held) {
                held = key;
                s0 = tex_scale_words(wstex, sa.x, key); s1 = tex_scale_words(wstex, sa.y, key);
                s2 = tex_scale_words(wstex, sa.z, key); s3 = tex_scale_words(wstex, sa.w, key);
                s4 = tex_scale_words(wstex, sb.x, key); s5 = tex_scale_words(wstex, sb.y, key);
                s6 = tex_scale_words(wstex, sb.z, key); s7 = tex_scale_words(wstex, sb.w, key);
#if GATED
                e0 = tex_scale_words(ustex, sa.x, key); e1 = tex_scale_words(ustex, sa.y, key);
                e2 = tex_scale_words(ustex, sa.z, key); e3 = tex_scale_words(ustex, sa.w, key);
                e4 = tex_scale_words(ustex, sb.x, key); e5 = tex_scale_words(ustex, sb.y, key);
                e6 = tex_scale_words(ustex, sb.z, key); e7 = tex_scale_words(ustex, sb.w, key);
#endif
            }
            let v0 = row_vals(c0, s0, un, h);
            let v1 = row_vals(c1, s1, un, h);
            let v2 = row_vals(c2, s2, un, h);
            let v3 = row_vals(c3, s3, un, h);
            let v4 = row_vals(c4, s4, un, h);
            let v5 = row_vals(c5, s5, un, h);
            let v6 = row_vals(c6, s6, un, h);
            let v7 = row_vals(c7, s7, un, h);
#if GATED
            let g0 = row_vals(d0, e0, un, h);
            let g1 = row_vals(d1, e1, un, h);
            let g2 = row_vals(d2, e2, un, h);
            let g3 = row_vals(d3, e3, un, h);
            let g4 = row_vals(d4, e4, un, h);
            let g5 = row_vals(d5, e5, un, h);
            let g6 = row_vals(d6, e6, un, h);
            let g7 = row_vals(d7, e7, un, h);
#endif
            let k8 = un * 32u + h * 8u;
            for (var j = 0u; j < TT; j++) {
                // (A local, not &acc_ss[j]: naga's SPIR-V writer rejects pointers into a
                // dynamically indexed local array as call arguments.)
                var ss_j = acc_ss[j];
                let xl = load_x1(xbase[j], k8 + lid, &ss_j);
                acc_ss[j] = ss_j;
                let xv = bcast8(xl);
                acc_a[j] += dot4r(v0, v1, v2, v3, xv[0], xv[1]);
                acc_b[j] += dot4r(v4, v5, v6, v7, xv[0], xv[1]);
#if GATED
                acc_ua[j] += dot4r(g0, g1, g2, g3, xv[0], xv[1]);
                acc_ub[j] += dot4r(g4, g5, g6, g7, xv[0], xv[1]);
#endif
            }
        }
    }
    for (var j = 0u; j < TT; j++) {
        let t = t0 + j;
        let s_all = subgroupAdd(acc_ss[j]);
        if (t >= n_tok) {
            continue;
        }
        let a = acc_a[j];
        let b = acc_b[j];
#if GATED
        let ua = acc_ua[j];
        let ub = acc_ub[j];
#else
        let ua = vec4<f32>(0.0);
        let ub = vec4<f32>(0.0);
#endif
        for (var i = 0u; i < 4u; i++) {
            if (row0 + i < p.n_rows) {
                finish(t, row0 + i, vec3<f32>(a[i], ua[i], s_all));
            }
            if (row0 + 4u + i < p.n_rows) {
                finish(t, row0 + 4u + i, vec3<f32>(b[i], ub[i], s_all));
            }
        }
    }
}
#endif

// Decode matvec over packed integer weights (W_Q8, W_Q4, W_Q4S; layout in src/quant/mod.rs):
// y[t, row_offset + n] = epilogue(sum_k W[n, k] * x'[t, k]) where every code word is read
// once and dequantized in registers (q d + m with the group's scale), never written back.
// Same fused prologue/epilogues as matvec.wgsl: NORM, GATED, BIAS, RESIDUAL, GATHER. x (and
// the norm weight) are read as vec4: k is a multiple of the group size (itself a multiple
// of 8) and the host checks that x_stride is a multiple of 4.
//
// Layouts: ROWS4 (CPU adapters): each invocation computes four adjacent rows, walking the
// row's groups and words, so one x load serves four rows and one word load serves eight
// (4-bit) or four (Q8) weights: loads, not bytes, are what CPU adapters pay for.
// XBCAST (with ROWS4, on CPU adapters whose workgroup of 8 is one subgroup): x is loaded one
// element per lane and handed to every lane with subgroupBroadcast, so each element costs
// one load instead of one per lane (lavapipe runs divergent loads lane by lane).
// ROW_PER_WORKGROUP (GPUs): a workgroup per row, invocations striding over the row's code
// words (coalesced), reduced with subgroups when SUBGROUPS is set. F16 dequantizes in half
// precision.
#include "common/linear.wgsl"
#if GATHER
@group(0) @binding(8) var<storage, read> rows: array<u32>;         // (n_out) rows of x
#endif
#if TEX
// TEX (CPU adapters, with XBCAST): the codes and scales as rgba32uint textures, row r's
// texels at r * texels_per_row + i (linear index i -> (i % TEXW, i / TEXW)), each row padded
// to whole texels. lavapipe fetches a texel (16 bytes) for a fraction of what a 4-byte
// storage load costs, so each lane computes eight rows from whole-texel reads.
@group(0) @binding(11) var wtex: texture_2d<u32>;
@group(0) @binding(12) var wstex: texture_2d<u32>;
#if GATED
@group(0) @binding(13) var utex: texture_2d<u32>;
@group(0) @binding(14) var ustex: texture_2d<u32>;
#endif
const TEXW: u32 = 8192u;
#if TOK4
// Tokens per invocation: every texel fetch and dequantization serves four tokens.
const TT: u32 = 4u;
#else
const TT: u32 = 1u;
#endif
#endif

#include "common/matvec_end.wgsl"

// w . x' over the eight elements of one 4-bit word (or four of a Q8 word: `xb_` unused).
fn dot_word(v: array<vec4<f32>, 2>, xa: vec4<f32>, xb_: vec4<f32>) -> f32 {
#if W_Q8
    return dot(v[0], xa);
#else
    return dot(v[0], xa) + dot(v[1], xb_);
#endif
}

// Four rows' products w . x' over one code word each (`q`: the rows' words, s0-s3 their
// group scales): elements 0-3 against xa, and for 4-bit words 4-7 against xh.
fn dot_rows(q: vec4<u32>, s0: vec2<f32>, s1: vec2<f32>, s2: vec2<f32>, s3: vec2<f32>, xa: vec4<f32>, xh: vec4<f32>) -> vec4<f32> {
#if W_Q8
    return vec4<f32>(
        dot(deq(codes_lo(q.x), s0), xa),
        dot(deq(codes_lo(q.y), s1), xa),
        dot(deq(codes_lo(q.z), s2), xa),
        dot(deq(codes_lo(q.w), s3), xa));
#else
    return vec4<f32>(
        dot(deq(codes_lo(q.x), s0), xa) + dot(deq(codes_hi(q.x), s0), xh),
        dot(deq(codes_lo(q.y), s1), xa) + dot(deq(codes_hi(q.y), s1), xh),
        dot(deq(codes_lo(q.z), s2), xa) + dot(deq(codes_hi(q.z), s2), xh),
        dot(deq(codes_lo(q.w), s3), xa) + dot(deq(codes_hi(q.w), s3), xh));
#endif
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
#if TEX
    rows8_tex(wid.z * TT, n_tok, wid, lid);
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
    // Words per row.
    let wpr = p.k / EPW;
#if XBCAST
    rows4_bcast(t, xrow * p.x_stride, wpr, wid, lid);
#else
    let xb4 = xrow * (p.x_stride / 4u);
    // vec4s of x per word.
    let xpw = EPW / 4u;
#if ROW_PER_WORKGROUP
    let row = wid.y * p.grid_x + wid.x;
    if (row >= p.n_rows) {
        return;
    }
    var acc = vec3<f32>(0.0);
    var sum_sq = 0.0;
    for (var kw = lid; kw < wpr; kw += WG) {
        let xa = load_x4(xb4, kw * xpw, &sum_sq);
#if W_Q8
        let xh = xa;
#else
        let xh = load_x4(xb4, kw * xpw + 1u, &sum_sq);
#endif
        acc.x += dot_word(w_deq_word(row, kw), xa, xh);
#if GATED
        acc.y += dot_word(u_deq_word(row, kw), xa, xh);
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
    let wpg = p.group / EPW;
    for (var gi = 0u; gi < p.k / p.group; gi++) {
        let s_0 = w_scale(r.x, gi);
        let s_1 = w_scale(r.y, gi);
        let s_2 = w_scale(r.z, gi);
        let s_3 = w_scale(r.w, gi);
#if GATED
        let t_0 = u_scale(r.x, gi);
        let t_1 = u_scale(r.y, gi);
        let t_2 = u_scale(r.z, gi);
        let t_3 = u_scale(r.w, gi);
#endif
        for (var j = 0u; j < wpg; j++) {
            let kw = gi * wpg + j;
            let xa = load_x4(xb4, kw * xpw, &s0);
            let q = vec4<u32>(w[wb.x + kw], w[wb.y + kw], w[wb.z + kw], w[wb.w + kw]);
#if W_Q8
            let xh = xa;
#else
            let xh = load_x4(xb4, kw * xpw + 1u, &s0);
#endif
            a += dot_rows(q, s_0, s_1, s_2, s_3, xa, xh);
#if GATED
            let qu = vec4<u32>(u[wb.x + kw], u[wb.y + kw], u[wb.z + kw], u[wb.w + kw]);
            ua += dot_rows(qu, t_0, t_1, t_2, t_3, xa, xh);
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
}

#if XBCAST

// ROWS4 with x shared by subgroupBroadcast: the workgroup (WG = 8 lanes) is one subgroup, so
// control flow stays uniform to the end (rows past n_rows are read clamped, never stored).
// Each step covers 8 elements of x: one load per lane, then eight broadcasts.
fn rows4_bcast(t: u32, xb: u32, wpr: u32, wid: vec3<u32>, lid: u32) {
    let row0 = ((wid.y * p.grid_x + wid.x) * WG + lid) * 4u;
    let last = p.n_rows - 1u;
    let r = min(vec4<u32>(row0) + vec4<u32>(0u, 1u, 2u, 3u), vec4<u32>(last));
    let wb = r * wpr;
    var a = vec4<f32>(0.0);
    var ua = vec4<f32>(0.0);
    var ss = 0.0;
    // Words per 8 elements, 8-element steps per group.
    let w8 = 8u / EPW;
    let spg = p.group / 8u;
    for (var gi = 0u; gi < p.k / p.group; gi++) {
        let s_0 = w_scale(r.x, gi);
        let s_1 = w_scale(r.y, gi);
        let s_2 = w_scale(r.z, gi);
        let s_3 = w_scale(r.w, gi);
#if GATED
        let t_0 = u_scale(r.x, gi);
        let t_1 = u_scale(r.y, gi);
        let t_2 = u_scale(r.z, gi);
        let t_3 = u_scale(r.w, gi);
#endif
        for (var j = 0u; j < spg; j++) {
            let k8 = (gi * spg + j) * 8u;
            let xl = load_x1(xb, k8 + lid, &ss);
            let xv = bcast8(xl);
            let xa = xv[0];
            let xh = xv[1];
            let kw = k8 / EPW;
            let q = vec4<u32>(w[wb.x + kw], w[wb.y + kw], w[wb.z + kw], w[wb.w + kw]);
#if W_Q8
            let q2 = vec4<u32>(w[wb.x + kw + 1u], w[wb.y + kw + 1u], w[wb.z + kw + 1u], w[wb.w + kw + 1u]);
            a += dot_rows(q, s_0, s_1, s_2, s_3, xa, xh) + dot_rows(q2, s_0, s_1, s_2, s_3, xh, xh);
#else
            a += dot_rows(q, s_0, s_1, s_2, s_3, xa, xh);
#endif
#if GATED
            let qu = vec4<u32>(u[wb.x + kw], u[wb.y + kw], u[wb.z + kw], u[wb.w + kw]);
#if W_Q8
            let qu2 = vec4<u32>(u[wb.x + kw + 1u], u[wb.y + kw + 1u], u[wb.z + kw + 1u], u[wb.w + kw + 1u]);
            ua += dot_rows(qu, t_0, t_1, t_2, t_3, xa, xh) + dot_rows(qu2, t_0, t_1, t_2, t_3, xh, xh);
#else
            ua += dot_rows(qu, t_0, t_1, t_2, t_3, xa, xh);
#endif
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
#endif

#if TEX
fn texel(tex: texture_2d<u32>, i: u32) -> vec4<u32> {
    return textureLoad(tex, vec2<u32>(i % TEXW, i / TEXW), 0);
}

// (d, m) of group gg of a scale texel.
fn tex_scale(sc: vec4<u32>, gg: u32) -> vec2<f32> {
#if W_Q4
    return scale_of(sc[gg], 0u);
#else
    return scale_of(sc[gg >> 1u], gg & 1u);
#endif
}

// Eight rows of one code word (or, Q8, of two words) dequantized: rows 0-3 / 4-7, elements
// 0-3 (l) and 4-7 (h).
struct D8 {
    la: R4v,
    ha: R4v,
    lb: R4v,
    hb: R4v,
}

struct R4v {
    r0: vec4<f32>,
    r1: vec4<f32>,
    r2: vec4<f32>,
    r3: vec4<f32>,
}

fn deq_lo4(q: vec4<u32>, s0: vec2<f32>, s1: vec2<f32>, s2: vec2<f32>, s3: vec2<f32>) -> R4v {
    return R4v(deq(codes_lo(q.x), s0), deq(codes_lo(q.y), s1), deq(codes_lo(q.z), s2), deq(codes_lo(q.w), s3));
}

#ifndef W_Q8
fn deq_hi4(q: vec4<u32>, s0: vec2<f32>, s1: vec2<f32>, s2: vec2<f32>, s3: vec2<f32>) -> R4v {
    return R4v(deq(codes_hi(q.x), s0), deq(codes_hi(q.y), s1), deq(codes_hi(q.z), s2), deq(codes_hi(q.w), s3));
}
#endif

// Four rows' w . x' over eight elements: l against xa (elements 0-3), h against xh (4-7).
fn dot8(l: R4v, h: R4v, xa: vec4<f32>, xh: vec4<f32>) -> vec4<f32> {
    return vec4<f32>(
        dot(l.r0, xa) + dot(h.r0, xh),
        dot(l.r1, xa) + dot(h.r1, xh),
        dot(l.r2, xa) + dot(h.r2, xh),
        dot(l.r3, xa) + dot(h.r3, xh));
}

// The eight rows' values of texel slot h (a 4-bit word: its low and high nibbles; Q8: words
// h and h + 1).
fn deq8(C0: vec4<u32>, C1: vec4<u32>, C2: vec4<u32>, C3: vec4<u32>, C4: vec4<u32>, C5: vec4<u32>, C6: vec4<u32>, C7: vec4<u32>, h: u32, sa: array<vec2<f32>, 8>) -> D8 {
    let qa = vec4<u32>(C0[h], C1[h], C2[h], C3[h]);
    let qb = vec4<u32>(C4[h], C5[h], C6[h], C7[h]);
#if W_Q8
    let qa2 = vec4<u32>(C0[h + 1u], C1[h + 1u], C2[h + 1u], C3[h + 1u]);
    let qb2 = vec4<u32>(C4[h + 1u], C5[h + 1u], C6[h + 1u], C7[h + 1u]);
    return D8(deq_lo4(qa, sa[0], sa[1], sa[2], sa[3]), deq_lo4(qa2, sa[0], sa[1], sa[2], sa[3]),
              deq_lo4(qb, sa[4], sa[5], sa[6], sa[7]), deq_lo4(qb2, sa[4], sa[5], sa[6], sa[7]));
#else
    return D8(deq_lo4(qa, sa[0], sa[1], sa[2], sa[3]), deq_hi4(qa, sa[0], sa[1], sa[2], sa[3]),
              deq_lo4(qb, sa[4], sa[5], sa[6], sa[7]), deq_hi4(qb, sa[4], sa[5], sa[6], sa[7]));
#endif
}

// Per token of the block: row accumulators (rows 0-3, 4-7; GATED: the up rows too) and the
// sum of squares of its x (NORM).
var<private> acc_a: array<vec4<f32>, TT>;
var<private> acc_b: array<vec4<f32>, TT>;
#if GATED
var<private> acc_ua: array<vec4<f32>, TT>;
var<private> acc_ub: array<vec4<f32>, TT>;
#endif
var<private> xbase: array<u32, TT>;

// Eight rows per lane from texture-held codes and scales, for tokens t0 .. t0 + TT - 1 (TOK4:
// four tokens share every texel fetch and dequantization; x of each token shared by
// subgroupBroadcast).
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
    let groups = p.k / p.group;
    // Texels per row of codes and of scales; groups per scale texel; code texels per group.
    let tpr = (p.k / EPW + 3u) / 4u;
#if W_Q4
    let spr = (groups + 3u) / 4u;
    let gpt = 4u;
#else
    let spr = ((groups + 1u) / 2u + 3u) / 4u;
    let gpt = 8u;
#endif
    let tpg = p.group / (4u * EPW);
    let ca = ra * tpr;
    let cb = rb * tpr;
    let sa = ra * spr;
    let sb = rb * spr;
    for (var st = 0u; st < spr; st++) {
        let S0 = texel(wstex, sa.x + st);
        let S1 = texel(wstex, sa.y + st);
        let S2 = texel(wstex, sa.z + st);
        let S3 = texel(wstex, sa.w + st);
        let S4 = texel(wstex, sb.x + st);
        let S5 = texel(wstex, sb.y + st);
        let S6 = texel(wstex, sb.z + st);
        let S7 = texel(wstex, sb.w + st);
#if GATED
        let U0 = texel(ustex, sa.x + st);
        let U1 = texel(ustex, sa.y + st);
        let U2 = texel(ustex, sa.z + st);
        let U3 = texel(ustex, sa.w + st);
        let U4 = texel(ustex, sb.x + st);
        let U5 = texel(ustex, sb.y + st);
        let U6 = texel(ustex, sb.z + st);
        let U7 = texel(ustex, sb.w + st);
#endif
        for (var gg = 0u; gg < gpt; gg++) {
            let gi = st * gpt + gg;
            if (gi >= groups) {
                break;
            }
            let ws = array<vec2<f32>, 8>(tex_scale(S0, gg), tex_scale(S1, gg), tex_scale(S2, gg), tex_scale(S3, gg),
                                         tex_scale(S4, gg), tex_scale(S5, gg), tex_scale(S6, gg), tex_scale(S7, gg));
#if GATED
            let us = array<vec2<f32>, 8>(tex_scale(U0, gg), tex_scale(U1, gg), tex_scale(U2, gg), tex_scale(U3, gg),
                                         tex_scale(U4, gg), tex_scale(U5, gg), tex_scale(U6, gg), tex_scale(U7, gg));
#endif
            for (var tt = 0u; tt < tpg; tt++) {
                let ti = gi * tpg + tt;
                let C0 = texel(wtex, ca.x + ti);
                let C1 = texel(wtex, ca.y + ti);
                let C2 = texel(wtex, ca.z + ti);
                let C3 = texel(wtex, ca.w + ti);
                let C4 = texel(wtex, cb.x + ti);
                let C5 = texel(wtex, cb.y + ti);
                let C6 = texel(wtex, cb.z + ti);
                let C7 = texel(wtex, cb.w + ti);
#if GATED
                let D0 = texel(utex, ca.x + ti);
                let D1 = texel(utex, ca.y + ti);
                let D2 = texel(utex, ca.z + ti);
                let D3 = texel(utex, ca.w + ti);
                let D4 = texel(utex, cb.x + ti);
                let D5 = texel(utex, cb.y + ti);
                let D6 = texel(utex, cb.z + ti);
                let D7 = texel(utex, cb.w + ti);
#endif
                // 8 elements (one 4-bit word, two Q8 words) per x broadcast.
                for (var h = 0u; h < 4u; h += 8u / EPW) {
                    let k8 = ti * 4u * EPW + h * EPW;
                    let w8 = deq8(C0, C1, C2, C3, C4, C5, C6, C7, h, ws);
#if GATED
                    let u8 = deq8(D0, D1, D2, D3, D4, D5, D6, D7, h, us);
#endif
                    for (var j = 0u; j < TT; j++) {
                        // (A local, not &acc_ss[j]: naga's SPIR-V writer rejects pointers
                        // into a dynamically indexed local array as call arguments.)
                        var ss_j = acc_ss[j];
                        let xl = load_x1(xbase[j], k8 + lid, &ss_j);
                        acc_ss[j] = ss_j;
                        let xv = bcast8(xl);
                        acc_a[j] += dot8(w8.la, w8.ha, xv[0], xv[1]);
                        acc_b[j] += dot8(w8.lb, w8.hb, xv[0], xv[1]);
#if GATED
                        acc_ua[j] += dot8(u8.la, u8.ha, xv[0], xv[1]);
                        acc_ub[j] += dot8(u8.lb, u8.hb, xv[0], xv[1]);
#endif
                    }
                }
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

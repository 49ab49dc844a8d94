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

fn finish(t: u32, row: u32, acc: vec3<f32>) {
#if NORM
    store_out(t, row, acc.x, acc.y, inv_rms(acc.z));
#else
    store_out(t, row, acc.x, acc.y, 1.0);
#endif
}

#if ROW_PER_WORKGROUP
#include "common/row_reduce.wgsl"
#endif

// w . x' over the eight elements of one 4-bit word (or four of a Q8 word: `xb_` unused).
fn dot_word(v: array<vec4<f32>, 2>, xa: vec4<f32>, xb_: vec4<f32>) -> f32 {
#if W_Q8
    return dot(v[0], xa);
#else
    return dot(v[0], xa) + dot(v[1], xb_);
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
            a += vec4<f32>(
                dot(deq(codes_lo(q.x), s_0), xa),
                dot(deq(codes_lo(q.y), s_1), xa),
                dot(deq(codes_lo(q.z), s_2), xa),
                dot(deq(codes_lo(q.w), s_3), xa));
#else
            let xh = load_x4(xb4, kw * xpw + 1u, &s0);
            a += vec4<f32>(
                dot(deq(codes_lo(q.x), s_0), xa) + dot(deq(codes_hi(q.x), s_0), xh),
                dot(deq(codes_lo(q.y), s_1), xa) + dot(deq(codes_hi(q.y), s_1), xh),
                dot(deq(codes_lo(q.z), s_2), xa) + dot(deq(codes_hi(q.z), s_2), xh),
                dot(deq(codes_lo(q.w), s_3), xa) + dot(deq(codes_hi(q.w), s_3), xh));
#endif
#if GATED
            let qu = vec4<u32>(u[wb.x + kw], u[wb.y + kw], u[wb.z + kw], u[wb.w + kw]);
#if W_Q8
            ua += vec4<f32>(
                dot(deq(codes_lo(qu.x), t_0), xa),
                dot(deq(codes_lo(qu.y), t_1), xa),
                dot(deq(codes_lo(qu.z), t_2), xa),
                dot(deq(codes_lo(qu.w), t_3), xa));
#else
            ua += vec4<f32>(
                dot(deq(codes_lo(qu.x), t_0), xa) + dot(deq(codes_hi(qu.x), t_0), xh),
                dot(deq(codes_lo(qu.y), t_1), xa) + dot(deq(codes_hi(qu.y), t_1), xh),
                dot(deq(codes_lo(qu.z), t_2), xa) + dot(deq(codes_hi(qu.z), t_2), xh),
                dot(deq(codes_lo(qu.w), t_3), xa) + dot(deq(codes_hi(qu.w), t_3), xh));
#endif
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
}

#if XBCAST
// Four rows' dot products with one 4-wide slice of x given per lane... see rows4_bcast.
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
            let xa = vec4<f32>(subgroupBroadcast(xl, 0u), subgroupBroadcast(xl, 1u), subgroupBroadcast(xl, 2u), subgroupBroadcast(xl, 3u));
            let xh = vec4<f32>(subgroupBroadcast(xl, 4u), subgroupBroadcast(xl, 5u), subgroupBroadcast(xl, 6u), subgroupBroadcast(xl, 7u));
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

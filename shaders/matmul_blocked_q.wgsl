// Rust dispatch: src/kernels/linear/ (matmul_layout); CPU reference and tests: ARCHITECTURE.md ops table (tests/kernels.rs packed_linear_*, ggml_*).
// Prefill matmul over packed integer weights for CPU adapters (lavapipe, SwiftShader): the
// register-blocked kernel of matmul_blocked.wgsl with the weights read as code words and
// dequantized in registers (c d + m, the group's scale read once per group and row; every
// W_PACKED format through common/weights.wgsl's 8-element steps).
// Y[m, row_offset + n] = epilogue(sum_k X'[m, k] * W[n, k]); each invocation computes TM
// tokens x TN rows (TM = 8 with BLOCK_M8, else 4; TN = 8 with BLOCK_N8, else 4) straight from
// global memory, eight elements of K at a time: one vec4 x load feeds TN rows and one step's
// code bits (8 weights) feed TM tokens. Same fused prologue/epilogues as the other linear
// kernels: NORM, GATED, BIAS, RESIDUAL. Tokens and rows past the ends are read clamped and
// never stored, so control flow stays uniform. XBCAST (the workgroup of 8 is one subgroup):
// each lane loads one element of x per token and subgroupBroadcast hands it to the others,
// one load per element instead of one per element per lane. XTEX (instead): x comes from an
// rgba32float copy of the step's rows (x_texture.wgsl), each lane fetching one texel of a
// step and subgroupBroadcast sharing them, and the norm weight from its uniform window; no
// per-lane storage loads of x at all, and every lane sums each token's squares itself.
#include "common/linear.wgsl"

#if BLOCK_M8
const TM: u32 = 8u;
#else
const TM: u32 = 4u;
#endif
#if BLOCK_N8
const TN: u32 = 8u;
#else
const TN: u32 = 4u;
#endif

// Four consecutive dequantized values of four rows (their scales: common/weights.wgsl's
// Scales4).
struct R4 {
    r0: vec4<f32>,
    r1: vec4<f32>,
    r2: vec4<f32>,
    r3: vec4<f32>,
}

// The weights of one 4-wide K step of the row block: rows 0-3 (a, ua) and 4-7 (b, ub).
struct Wk {
    a: R4,
#if BLOCK_N8
    b: R4,
#endif
#if GATED
    ua: R4,
#if BLOCK_N8
    ub: R4,
#endif
#endif
}

// The scales of one group of the row block.
struct Sk {
    a: Scales4,
#if BLOCK_N8
    b: Scales4,
#endif
#if GATED
    ua: Scales4,
#if BLOCK_N8
    ub: Scales4,
#endif
#endif
}

#include "common/blocked_acc.wgsl"

var<private> t0: Acc;
var<private> t1: Acc;
var<private> t2: Acc;
var<private> t3: Acc;
#if BLOCK_M8
var<private> t4: Acc;
var<private> t5: Acc;
var<private> t6: Acc;
var<private> t7: Acc;
#endif
#if XTEX
// This lane's rows of the x texture (tokens lane / 2 and 4 + lane / 2 of the block; tokens
// past the end read the last token) and its texel of each step (lane & 1).
var<private> xl_row: vec2<u32>;
var<private> xl_dk: u32;
#else
// Token row bases in x (tokens past the end read the last token): vec4 index, or element
// index with XBCAST.
var<private> xb: array<u32, TM>;
#endif
#if XBCAST
var<private> lane: u32;
#endif

// Four rows' codes of one step dequantized with their scales.
fn vals4(c0: array<vec4<f32>, 2>, c1: array<vec4<f32>, 2>, c2: array<vec4<f32>, 2>, c3: array<vec4<f32>, 2>, s: Scales4) -> array<R4, 2> {
    return array<R4, 2>(
        R4(deq(c0[0], s.s0), deq(c1[0], s.s1), deq(c2[0], s.s2), deq(c3[0], s.s3)),
        R4(deq(c0[1], s.s0), deq(c1[1], s.s1), deq(c2[1], s.s2), deq(c3[1], s.s3)));
}

fn dot4(r: R4, xv: vec4<f32>) -> vec4<f32> {
    return vec4<f32>(dot(r.r0, xv), dot(r.r1, xv), dot(r.r2, xv), dot(r.r3, xv));
}

#ifndef XBCAST
#ifndef XTEX
fn tok4(t: ptr<private, Acc>, xi4: u32, gv: vec4<f32>, wk: Wk) {
    var xv = x[xi4];
#if NORM
    (*t).s += dot(xv, xv);
    xv = xv * gv;
#endif
    (*t).a0 += dot4(wk.a, xv);
#if BLOCK_N8
    (*t).a1 += dot4(wk.b, xv);
#endif
#if GATED
    (*t).c0 += dot4(wk.ua, xv);
#if BLOCK_N8
    (*t).c1 += dot4(wk.ub, xv);
#endif
#endif
}

// One 4-wide K step (x vec4 index `kx` within a row) for every token of the block.
fn step4(kx: u32, wk: Wk) {
#if NORM
    let gv = g[kx];
#else
    let gv = vec4<f32>(1.0);
#endif
    tok4(&t0, xb[0] + kx, gv, wk);
    tok4(&t1, xb[1] + kx, gv, wk);
    tok4(&t2, xb[2] + kx, gv, wk);
    tok4(&t3, xb[3] + kx, gv, wk);
#if BLOCK_M8
    tok4(&t4, xb[4] + kx, gv, wk);
    tok4(&t5, xb[5] + kx, gv, wk);
    tok4(&t6, xb[6] + kx, gv, wk);
    tok4(&t7, xb[7] + kx, gv, wk);
#endif
}
#endif
#endif

// One token, one 8-element step: x' elements 0-3 (xa) and 4-7 (xh) times the rows' values lo
// and hi.
fn acc8(t: ptr<private, Acc>, xa: vec4<f32>, xh: vec4<f32>, lo: Wk, hi: Wk) {
    (*t).a0 += dot4(lo.a, xa) + dot4(hi.a, xh);
#if BLOCK_N8
    (*t).a1 += dot4(lo.b, xa) + dot4(hi.b, xh);
#endif
#if GATED
    (*t).c0 += dot4(lo.ua, xa) + dot4(hi.ua, xh);
#if BLOCK_N8
    (*t).c1 += dot4(lo.ub, xa) + dot4(hi.ub, xh);
#endif
#endif
}

#ifndef XTEX
#if XBCAST
// x'[k] of token i for this lane's element k (its square added to the token's sum).
fn x_lane(i: u32, k: u32, gl: f32, t: ptr<private, Acc>) -> f32 {
    var v = x[xb[i] + k];
#if NORM
    (*t).s += v * v;
    v = v * gl;
#endif
    return v;
}

// One token, one 8-element step: the lanes' elements broadcast, times rows' values lo
// (elements 0-3) and hi (4-7).
fn tok8(t: ptr<private, Acc>, xl: f32, lo: Wk, hi: Wk) {
    let xv = bcast8(xl);
    acc8(t, xv[0], xv[1], lo, hi);
}

// Elements k8 .. k8 + 8 for every token of the block.
fn step8(k8: u32, lo: Wk, hi: Wk) {
    let k = k8 + lane;
#if NORM
    let gl = g[k];
#else
    let gl = 1.0;
#endif
    tok8(&t0, x_lane(0u, k, gl, &t0), lo, hi);
    tok8(&t1, x_lane(1u, k, gl, &t1), lo, hi);
    tok8(&t2, x_lane(2u, k, gl, &t2), lo, hi);
    tok8(&t3, x_lane(3u, k, gl, &t3), lo, hi);
#if BLOCK_M8
    tok8(&t4, x_lane(4u, k, gl, &t4), lo, hi);
    tok8(&t5, x_lane(5u, k, gl, &t5), lo, hi);
    tok8(&t6, x_lane(6u, k, gl, &t6), lo, hi);
    tok8(&t7, x_lane(7u, k, gl, &t7), lo, hi);
#endif
}
#endif
#endif

#if XTEX
// x' of a token from its two texels of the step (its squares added to the token's sum).
fn tokx(t: ptr<private, Acc>, va: vec4<f32>, vh: vec4<f32>, ga: vec4<f32>, gh: vec4<f32>, lo: Wk, hi: Wk) {
    var xa = va;
    var xh = vh;
#if NORM
    (*t).s += dot(xa, xa) + dot(xh, xh);
    xa = xa * ga;
    xh = xh * gh;
#endif
    acc8(t, xa, xh, lo, hi);
}

// Elements k8 .. k8 + 8 for every token of the block: each lane fetches one texel (lane l:
// texel l & 1 of the step, token l / 2, and with BLOCK_M8 token 4 + l / 2 too) and
// subgroupBroadcast hands each token's two texels to every lane: two texel fetches per step
// instead of two per token.
fn step8(k8: u32, lo: Wk, hi: Wk) {
    let kt = (k8 >> 2u) + xl_dk;
    let fa = textureLoad(xt, vec2<u32>(kt, xl_row.x), 0);
#if BLOCK_M8
    let fb = textureLoad(xt, vec2<u32>(kt, xl_row.y), 0);
#endif
#if NORM
    let gk = k8 >> 2u;
    let ga = gu[gk];
    let gh = gu[gk + 1u];
#else
    let ga = vec4<f32>(1.0);
    let gh = ga;
#endif
    tokx(&t0, subgroupBroadcast(fa, 0u), subgroupBroadcast(fa, 1u), ga, gh, lo, hi);
    tokx(&t1, subgroupBroadcast(fa, 2u), subgroupBroadcast(fa, 3u), ga, gh, lo, hi);
    tokx(&t2, subgroupBroadcast(fa, 4u), subgroupBroadcast(fa, 5u), ga, gh, lo, hi);
    tokx(&t3, subgroupBroadcast(fa, 6u), subgroupBroadcast(fa, 7u), ga, gh, lo, hi);
#if BLOCK_M8
    tokx(&t4, subgroupBroadcast(fb, 0u), subgroupBroadcast(fb, 1u), ga, gh, lo, hi);
    tokx(&t5, subgroupBroadcast(fb, 2u), subgroupBroadcast(fb, 3u), ga, gh, lo, hi);
    tokx(&t6, subgroupBroadcast(fb, 4u), subgroupBroadcast(fb, 5u), ga, gh, lo, hi);
    tokx(&t7, subgroupBroadcast(fb, 6u), subgroupBroadcast(fb, 7u), ga, gh, lo, hi);
#endif
}
#endif

// Code word bases of rows 0-3 (wa) and 4-7 (wb) of the block.
var<private> wa: vec4<u32>;
var<private> wb: vec4<u32>;

#if TEX
// Four rows' code texels of the current chunk (common/weights.wgsl's ChunkTex).
struct Tex4 {
    c0: ChunkTex,
    c1: ChunkTex,
    c2: ChunkTex,
    c3: ChunkTex,
}

var<private> ca: Tex4;
var<private> cb: Tex4;
#if GATED
var<private> cua: Tex4;
var<private> cub: Tex4;
#endif

fn tex4(m: u32, r: vec4<u32>, kc: u32) -> Tex4 {
    return Tex4(chunk_tex(m, r.x, kc), chunk_tex(m, r.y, kc), chunk_tex(m, r.z, kc), chunk_tex(m, r.w, kc));
}
#endif

// Step k8's values of row set `i` (0: rows 0-3 of w, 1: rows 4-7, 2 and 3: the same rows of
// u; a constant at every call): from the chunk's texels (TEX) or from the code words.
fn set_vals(i: u32, k8: u32, s: Scales4) -> array<R4, 2> {
#if TEX
    var t = ca;
#if BLOCK_N8
    if (i == 1u) {
        t = cb;
    }
#endif
#if GATED
    if (i == 2u) {
        t = cua;
    }
#if BLOCK_N8
    if (i == 3u) {
        t = cub;
    }
#endif
#endif
    return vals4(codes8(chunk_step(t.c0, k8)), codes8(chunk_step(t.c1, k8)), codes8(chunk_step(t.c2, k8)), codes8(chunk_step(t.c3, k8)), s);
#else
    let m = i >> 1u;
    let r = select(wa, wb, (i & 1u) == 1u);
    return vals4(codes8(step_words(m, r.x, k8)), codes8(step_words(m, r.y, k8)), codes8(step_words(m, r.z, k8)), codes8(step_words(m, r.w, k8)), s);
#endif
}

// One 8-element step: every row's values (elements 0-3: lo, 4-7: hi), then every token.
fn step_k(k8: u32, s: Sk) {
    var lo: Wk;
    var hi: Wk;
    let va = set_vals(0u, k8, s.a);
    lo.a = va[0];
    hi.a = va[1];
#if BLOCK_N8
    let vb = set_vals(1u, k8, s.b);
    lo.b = vb[0];
    hi.b = vb[1];
#endif
#if GATED
    let vua = set_vals(2u, k8, s.ua);
    lo.ua = vua[0];
    hi.ua = vua[1];
#if BLOCK_N8
    let vub = set_vals(3u, k8, s.ub);
    lo.ub = vub[0];
    hi.ub = vub[1];
#endif
#endif
#if XTEX
    step8(k8, lo, hi);
#elif XBCAST
    step8(k8, lo, hi);
#else
    step4(k8 / 4u, lo);
    step4(k8 / 4u + 1u, hi);
#endif
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let n_tok = step.n_tokens;
    let m0 = wid.y * TM;
    let n0 = (wid.x * WG + lid) * TN;
    let last = p.n_rows - 1u;
    // Rows of the block (rows past the end read the last row) and their word bases.
    let ra = min(vec4<u32>(n0) + vec4<u32>(0u, 1u, 2u, 3u), vec4<u32>(last));
#if BLOCK_N8
    let rb = min(vec4<u32>(n0) + vec4<u32>(4u, 5u, 6u, 7u), vec4<u32>(last));
#endif
    let lt = max(n_tok, 1u) - 1u;
#if XTEX
    xl_row = min(vec2<u32>(m0 + lid / 2u, m0 + 4u + lid / 2u), vec2<u32>(lt));
    xl_dk = lid & 1u;
#elif XBCAST
    lane = lid;
    for (var i = 0u; i < TM; i++) {
        xb[i] = min(m0 + i, lt) * p.x_stride;
    }
#else
    for (var i = 0u; i < TM; i++) {
        xb[i] = min(m0 + i, lt) * (p.x_stride / 4u);
    }
#endif
    let spg = p.group / 8u;
    wa = vec4<u32>(code_base(ra.x), code_base(ra.y), code_base(ra.z), code_base(ra.w));
#if BLOCK_N8
    wb = vec4<u32>(code_base(rb.x), code_base(rb.y), code_base(rb.z), code_base(rb.w));
#endif
    // Super-block scale words of the rows, read once per super-block.
    let sa = vec4<u32>(scale_base(ra.x), scale_base(ra.y), scale_base(ra.z), scale_base(ra.w));
#if BLOCK_N8
    let sbb = vec4<u32>(scale_base(rb.x), scale_base(rb.y), scale_base(rb.z), scale_base(rb.w));
#endif
    var ha: Heads4;
    var hb: Heads4;
    var hua: Heads4;
    var hub: Heads4;
    for (var gi = 0u; gi < p.k / p.group; gi++) {
        var s: Sk;
        s.a = scales4(0u, sa, gi, &ha);
#if BLOCK_N8
        s.b = scales4(0u, sbb, gi, &hb);
#endif
#if GATED
        s.ua = scales4(1u, sa, gi, &hua);
#if BLOCK_N8
        s.ub = scales4(1u, sbb, gi, &hub);
#endif
#endif
#if TEX
        // Chunks of the group within one texel of each code plane: the rows' texels are
        // fetched once per chunk (a texel fetch is a function call of ~100 instructions on
        // lavapipe), and its words picked for each step.
        let cs = min(p.group, CHUNK_SPAN) / 8u;
        for (var j0 = 0u; j0 < spg; j0 += cs) {
            let kc = (gi * spg + j0) * 8u;
            ca = tex4(0u, wa, kc);
#if BLOCK_N8
            cb = tex4(0u, wb, kc);
#endif
#if GATED
            cua = tex4(1u, wa, kc);
#if BLOCK_N8
            cub = tex4(1u, wb, kc);
#endif
#endif
            for (var j = j0; j < j0 + cs; j++) {
                step_k((gi * spg + j) * 8u, s);
            }
        }
#else
        for (var j = 0u; j < spg; j++) {
            step_k((gi * spg + j) * 8u, s);
        }
#endif
    }
#ifndef XTEX
#if XBCAST
#if NORM
    // Each lane summed the squares of its own elements of each token.
    t0.s = subgroupAdd(t0.s);
    t1.s = subgroupAdd(t1.s);
    t2.s = subgroupAdd(t2.s);
    t3.s = subgroupAdd(t3.s);
#if BLOCK_M8
    t4.s = subgroupAdd(t4.s);
    t5.s = subgroupAdd(t5.s);
    t6.s = subgroupAdd(t6.s);
    t7.s = subgroupAdd(t7.s);
#endif
#endif
#endif
#endif
    finish(t0, m0, n0);
    finish(t1, m0 + 1u, n0);
    finish(t2, m0 + 2u, n0);
    finish(t3, m0 + 3u, n0);
#if BLOCK_M8
    finish(t4, m0 + 4u, n0);
    finish(t5, m0 + 5u, n0);
    finish(t6, m0 + 6u, n0);
    finish(t7, m0 + 7u, n0);
#endif
}

// The shared body of the packed blocked matmuls (matmul_blocked_q.wgsl: x from storage,
// matmul_blocked_q_xbcast.wgsl: x shared by subgroupBroadcast, matmul_blocked_q_xtex.wgsl: x
// from a texture). Each of them defines how a step meets x, `x_step(k8, lo, hi)`, and its
// `main`, which sets up its x rows, calls `run_block` (the walk over K: the rows' scales once
// per group, their codes dequantized once per 8-element step) and `finish_block`.
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

// Four rows' codes of one step dequantized with their scales.
fn vals4(c0: array<vec4<f32>, 2>, c1: array<vec4<f32>, 2>, c2: array<vec4<f32>, 2>, c3: array<vec4<f32>, 2>, s: Scales4) -> array<R4, 2> {
    return array<R4, 2>(
        R4(deq(c0[0], s.s0), deq(c1[0], s.s1), deq(c2[0], s.s2), deq(c3[0], s.s3)),
        R4(deq(c0[1], s.s0), deq(c1[1], s.s1), deq(c2[1], s.s2), deq(c3[1], s.s3)));
}

fn dot4(r: R4, xv: vec4<f32>) -> vec4<f32> {
    return vec4<f32>(dot(r.r0, xv), dot(r.r1, xv), dot(r.r2, xv), dot(r.r3, xv));
}

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

// Code word bases of rows 0-3 (wa) and 4-7 (wb) of the block.
var<private> wa: vec4<u32>;
var<private> wb: vec4<u32>;

#if TEX
#include "common/blocked_q_tex.wgsl"
#endif

// Step k8's values of row set `i` (0: rows 0-3 of w, 1: rows 4-7, 2 and 3: the same rows of
// u; a constant at every call): from the chunk's texels (TEX) or from the code words.
fn set_vals(i: u32, k8: u32, s: Scales4) -> array<R4, 2> {
#if TEX
    let t = tex_set(i);
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
    x_step(k8, lo, hi);
}

// The walk over K for the row block starting at row n0 (rows past the end read the last row).
fn run_block(n0: u32) {
    let last = p.n_rows - 1u;
    let ra = min(vec4<u32>(n0) + vec4<u32>(0u, 1u, 2u, 3u), vec4<u32>(last));
#if BLOCK_N8
    let rb = min(vec4<u32>(n0) + vec4<u32>(4u, 5u, 6u, 7u), vec4<u32>(last));
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
            load_chunks((gi * spg + j0) * 8u);
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
}

// The epilogue and store of every token of the block.
fn finish_block(m0: u32, n0: u32) {
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

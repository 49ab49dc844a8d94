// Rust dispatch: src/kernels/linear/ (matmul_layout); CPU reference and tests: ARCHITECTURE.md ops table (tests/kernels.rs linear_*).
// Prefill matmul for CPU adapters (lavapipe, SwiftShader):
// Y[m, row_offset + n] = epilogue(sum_k X'[m, k] * W[n, k]) with no workgroup memory and no
// barriers. Each invocation computes a register block of TM tokens x TN rows straight from
// global memory (TM = 8 with BLOCK_M8, else 4; TN = 8 with BLOCK_N8, else 4), walking K two
// at a time (one f16 pair per weight load) with a scalar tail for odd K, so that each x load
// feeds TN FMAs and each weight load TM. On lavapipe every storage-buffer load is emulated
// lane by lane (mask and bounds-check branches), so loads per FMA, not bytes, set the speed.
// Same semantics as matmul.wgsl: NORM (RMSNorm folded: X' = X * g, the result scaled by each
// token row's 1/rms, sum(x^2) accumulated in the same pass over x), GATED
// (silu(W x') * (U x')), BIAS, RESIDUAL. The WG invocations of a workgroup take adjacent row
// blocks of the same TM tokens. Tokens and rows past the ends are read clamped and never
// stored, so there is no early return and control flow stays uniform.
#include "common/linear.wgsl"

// Four rows of a weight at k (lo) and k + 1 (hi).
struct Pair {
    lo: vec4<f32>,
    hi: vec4<f32>,
}

// The weights of one K step of the row block: rows 0-3 (w0, u0) and 4-7 (w1, u1).
struct Wk {
    w0: Pair,
#if BLOCK_N8
    w1: Pair,
#endif
#if GATED
    u0: Pair,
#if BLOCK_N8
    u1: Pair,
#endif
#endif
}

#include "common/blocked_acc.wgsl"

fn w_pair(b: vec4<u32>, k: u32) -> Pair {
    let r0 = w_load2(b.x + k);
    let r1 = w_load2(b.y + k);
    let r2 = w_load2(b.z + k);
    let r3 = w_load2(b.w + k);
    return Pair(vec4<f32>(r0.x, r1.x, r2.x, r3.x), vec4<f32>(r0.y, r1.y, r2.y, r3.y));
}

fn w_one(b: vec4<u32>, k: u32) -> vec4<f32> {
    return vec4<f32>(w_load(b.x + k), w_load(b.y + k), w_load(b.z + k), w_load(b.w + k));
}

#if GATED
fn u_pair(b: vec4<u32>, k: u32) -> Pair {
    let r0 = u_load2(b.x + k);
    let r1 = u_load2(b.y + k);
    let r2 = u_load2(b.z + k);
    let r3 = u_load2(b.w + k);
    return Pair(vec4<f32>(r0.x, r1.x, r2.x, r3.x), vec4<f32>(r0.y, r1.y, r2.y, r3.y));
}

fn u_one(b: vec4<u32>, k: u32) -> vec4<f32> {
    return vec4<f32>(u_load(b.x + k), u_load(b.y + k), u_load(b.z + k), u_load(b.w + k));
}
#endif

// One token, K step of two: x at xi and xi + 1, norm weights gv.
fn tok2(t: ptr<function, Acc>, xi: u32, gv: vec2<f32>, wk: Wk) {
    var xv = vec2<f32>(x[xi], x[xi + 1u]);
#if NORM
    (*t).s += dot(xv, xv);
    xv = xv * gv;
#endif
    (*t).a0 += wk.w0.lo * xv.x + wk.w0.hi * xv.y;
#if BLOCK_N8
    (*t).a1 += wk.w1.lo * xv.x + wk.w1.hi * xv.y;
#endif
#if GATED
    (*t).c0 += wk.u0.lo * xv.x + wk.u0.hi * xv.y;
#if BLOCK_N8
    (*t).c1 += wk.u1.lo * xv.x + wk.u1.hi * xv.y;
#endif
#endif
}

// One token, the last K (odd K): weights in the `lo` halves of wk.
fn tok1(t: ptr<function, Acc>, xi: u32, gk: f32, wk: Wk) {
    var xv = x[xi];
#if NORM
    (*t).s += xv * xv;
    xv = xv * gk;
#endif
    (*t).a0 += wk.w0.lo * xv;
#if BLOCK_N8
    (*t).a1 += wk.w1.lo * xv;
#endif
#if GATED
    (*t).c0 += wk.u0.lo * xv;
#if BLOCK_N8
    (*t).c1 += wk.u1.lo * xv;
#endif
#endif
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let n_tok = step.n_tokens;
    let m0 = wid.y * TM;
    let n0 = (wid.x * WG + lid) * TN;
    // Row bases of the block (rows past the end read the last row).
    let last = p.n_rows - 1u;
    let rb0 = min(vec4<u32>(n0) + vec4<u32>(0u, 1u, 2u, 3u), vec4<u32>(last)) * p.k;
#if BLOCK_N8
    let rb1 = min(vec4<u32>(n0) + vec4<u32>(4u, 5u, 6u, 7u), vec4<u32>(last)) * p.k;
#endif
    // Token row bases (tokens past the end read the last token).
    let lt = max(n_tok, 1u) - 1u;
    let xb0 = min(m0, lt) * p.x_stride;
    let xb1 = min(m0 + 1u, lt) * p.x_stride;
    let xb2 = min(m0 + 2u, lt) * p.x_stride;
    let xb3 = min(m0 + 3u, lt) * p.x_stride;
#if BLOCK_M8
    let xb4 = min(m0 + 4u, lt) * p.x_stride;
    let xb5 = min(m0 + 5u, lt) * p.x_stride;
    let xb6 = min(m0 + 6u, lt) * p.x_stride;
    let xb7 = min(m0 + 7u, lt) * p.x_stride;
#endif
    var t0: Acc;
    var t1: Acc;
    var t2: Acc;
    var t3: Acc;
#if BLOCK_M8
    var t4: Acc;
    var t5: Acc;
    var t6: Acc;
    var t7: Acc;
#endif
    let k2 = p.k & ~1u;
    var k = 0u;
    for (; k < k2; k += 2u) {
        var wk: Wk;
        wk.w0 = w_pair(rb0, k);
#if BLOCK_N8
        wk.w1 = w_pair(rb1, k);
#endif
#if GATED
        wk.u0 = u_pair(rb0, k);
#if BLOCK_N8
        wk.u1 = u_pair(rb1, k);
#endif
#endif
#if NORM
        let gv = vec2<f32>(g[k], g[k + 1u]);
#else
        let gv = vec2<f32>(1.0);
#endif
        tok2(&t0, xb0 + k, gv, wk);
        tok2(&t1, xb1 + k, gv, wk);
        tok2(&t2, xb2 + k, gv, wk);
        tok2(&t3, xb3 + k, gv, wk);
#if BLOCK_M8
        tok2(&t4, xb4 + k, gv, wk);
        tok2(&t5, xb5 + k, gv, wk);
        tok2(&t6, xb6 + k, gv, wk);
        tok2(&t7, xb7 + k, gv, wk);
#endif
    }
    if (k < p.k) {
        var wk: Wk;
        wk.w0.lo = w_one(rb0, k);
#if BLOCK_N8
        wk.w1.lo = w_one(rb1, k);
#endif
#if GATED
        wk.u0.lo = u_one(rb0, k);
#if BLOCK_N8
        wk.u1.lo = u_one(rb1, k);
#endif
#endif
#if NORM
        let gk = g[k];
#else
        let gk = 1.0;
#endif
        tok1(&t0, xb0 + k, gk, wk);
        tok1(&t1, xb1 + k, gk, wk);
        tok1(&t2, xb2 + k, gk, wk);
        tok1(&t3, xb3 + k, gk, wk);
#if BLOCK_M8
        tok1(&t4, xb4 + k, gk, wk);
        tok1(&t5, xb5 + k, gk, wk);
        tok1(&t6, xb6 + k, gk, wk);
        tok1(&t7, xb7 + k, gk, wk);
#endif
    }
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

// Rust dispatch: src/kernels/linear/ (matmul_layout); CPU reference and tests: ARCHITECTURE.md ops table (tests/kernels.rs packed_linear_*, ggml_*).
// The packed blocked matmul of matmul_blocked_q.wgsl with x shared by subgroupBroadcast (the
// workgroup of 8 is one subgroup, XBCAST): each lane loads one element of x per token and
// hands it to the others, one load per element instead of one per element per lane; each
// lane sums the squares of its own elements, and the lanes' sums are added at the end.
#include "common/linear.wgsl"
#include "common/blocked_q.wgsl"

// Token row bases in x, as element indices (tokens past the end read the last token).
var<private> xb: array<u32, TM>;
var<private> lane: u32;

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
fn x_step(k8: u32, lo: Wk, hi: Wk) {
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

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let n_tok = step.n_tokens;
    let m0 = wid.y * TM;
    let n0 = (wid.x * WG + lid) * TN;
    let lt = max(n_tok, 1u) - 1u;
    lane = lid;
    for (var i = 0u; i < TM; i++) {
        xb[i] = min(m0 + i, lt) * p.x_stride;
    }
    run_block(n0);
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
    finish_block(m0, n0);
}

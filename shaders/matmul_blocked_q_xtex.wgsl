// Rust dispatch: src/kernels/linear/ (matmul_layout); CPU reference and tests: ARCHITECTURE.md ops table (tests/kernels.rs packed_linear_*, ggml_*).
// The packed blocked matmul of matmul_blocked_q.wgsl with x from a texture (XTEX): an
// rgba32float copy of the step's rows (x_texture.wgsl), each lane fetching one texel of a
// step and subgroupBroadcast sharing them, and the norm weight from its uniform window; no
// per-lane storage loads of x at all, and every lane sums each token's squares itself.
#include "common/linear.wgsl"
#include "common/blocked_q.wgsl"

// This lane's rows of the x texture (tokens lane / 2 and 4 + lane / 2 of the block; tokens
// past the end read the last token) and its texel of each step (lane & 1).
var<private> xl_row: vec2<u32>;
var<private> xl_dk: u32;

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
fn x_step(k8: u32, lo: Wk, hi: Wk) {
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

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let n_tok = step.n_tokens;
    let m0 = wid.y * TM;
    let n0 = (wid.x * WG + lid) * TN;
    let lt = max(n_tok, 1u) - 1u;
    xl_row = min(vec2<u32>(m0 + lid / 2u, m0 + 4u + lid / 2u), vec2<u32>(lt));
    xl_dk = lid & 1u;
    run_block(n0);
    finish_block(m0, n0);
}

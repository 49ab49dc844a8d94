// Rust dispatch: src/kernels/linear/ (matmul_layout); CPU reference and tests: ARCHITECTURE.md ops table (tests/kernels.rs packed_linear_*, ggml_*).
// Prefill matmul over packed integer weights for CPU adapters (lavapipe, SwiftShader), x
// read from storage: the register-blocked kernel of matmul_blocked.wgsl with the weights
// read as code words and dequantized in registers (c d + m, the group's scale read once per
// group and row; every W_PACKED format through common/weights.wgsl's 8-element steps).
// Y[m, row_offset + n] = epilogue(sum_k X'[m, k] * W[n, k]); each invocation computes TM
// tokens x TN rows (TM = 8 with BLOCK_M8, else 4; TN = 8 with BLOCK_N8, else 4) straight from
// global memory, eight elements of K at a time: one vec4 x load feeds TN rows and one step's
// code bits (8 weights) feed TM tokens. Same fused prologue/epilogues as the other linear
// kernels: NORM, GATED, BIAS, RESIDUAL. Tokens and rows past the ends are read clamped and
// never stored, so control flow stays uniform. The same kernel with x shared by subgroup
// broadcasts: matmul_blocked_q_xbcast.wgsl; with x from a texture: matmul_blocked_q_xtex.wgsl.
#include "common/linear.wgsl"
#include "common/blocked_q.wgsl"

// Token row bases in x, as vec4 indices (tokens past the end read the last token).
var<private> xb: array<u32, TM>;

// One token, one 4-wide K step: x' (vec4 `xi4` of x, times the norm weight `gv`) times the
// rows' values.
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

// Elements k8 .. k8 + 8 (two vec4 steps) for every token of the block.
fn x_step(k8: u32, lo: Wk, hi: Wk) {
    step4(k8 / 4u, lo);
    step4(k8 / 4u + 1u, hi);
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let n_tok = step.n_tokens;
    let m0 = wid.y * TM;
    let n0 = (wid.x * WG + lid) * TN;
    let lt = max(n_tok, 1u) - 1u;
    for (var i = 0u; i < TM; i++) {
        xb[i] = min(m0 + i, lt) * (p.x_stride / 4u);
    }
    run_block(n0);
    finish_block(m0, n0);
}

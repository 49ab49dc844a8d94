// The accumulators and the store of the register-blocked matmuls (matmul_blocked.wgsl,
// matmul_blocked_q*.wgsl): TM tokens x TN rows per invocation, TM = 8 with BLOCK_M8 and
// TN = 8 with BLOCK_N8, else 4.
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

// The accumulators of one token: W x' (a) and U x' (c) for rows 0-3 / 4-7, and sum(x^2).
struct Acc {
    a0: vec4<f32>,
#if BLOCK_N8
    a1: vec4<f32>,
#endif
#if GATED
    c0: vec4<f32>,
#if BLOCK_N8
    c1: vec4<f32>,
#endif
#endif
    s: f32,
}

// Epilogue and store of one token's row block.
fn finish(t: Acc, m: u32, n0: u32) {
    if (m >= step.n_tokens) {
        return;
    }
#if NORM
    let r = inv_rms(t.s);
#else
    let r = 1.0;
#endif
    for (var j = 0u; j < TN; j++) {
        let n = n0 + j;
        if (n >= p.n_rows) {
            break;
        }
        var v = t.a0[j & 3u];
        var b = 0.0;
#if GATED
        b = t.c0[j & 3u];
#endif
#if BLOCK_N8
        if (j >= 4u) {
            v = t.a1[j & 3u];
#if GATED
            b = t.c1[j & 3u];
#endif
        }
#endif
        store_out(m, n, v, b, r);
    }
}

// Rust dispatch: src/kernels/linear/ (matmul_layout); CPU reference and tests: ARCHITECTURE.md ops table (tests/kernels.rs linear_*, packed_linear_*, ggml_*).
// Prefill tiled matmul: Y[m, row_offset + n] = epilogue(sum_k X'[m, k] * W[n, k]) for a
// BM x BN output tile per workgroup, staging BK-wide slices of X and W in workgroup memory.
// Same fused prologue/epilogues as matvec.wgsl: NORM (RMSNorm folded: X' = X * g, result
// scaled by each row's 1/rms), GATED (silu(W x') * (U x')), BIAS, RESIDUAL. Packed integer
// weights (W_PACKED) are dequantized while staging: each invocation turns the code words of
// eight elements of one row into values in workgroup memory (kept as f16 with F16, which
// halves the weight tiles).
#include "common/linear.wgsl"

const BM: u32 = 32u;   // tokens per tile
const BN: u32 = 32u;   // output rows per tile
const BK: u32 = 16u;   // K slice staged per step
const TILE: u32 = 512u; // BM * BK == BN * BK

#if F16
alias wtile = f16;
#else
alias wtile = f32;
#endif
var<workgroup> xs: array<f32, TILE>;   // [m][k]
var<workgroup> ws: array<wtile, TILE>; // [n][k]
#if GATED
var<workgroup> us: array<wtile, TILE>;
#endif
#if NORM
var<workgroup> part: array<f32, 64>;
var<workgroup> rs: array<f32, BM>;
#endif

// 64 invocations as 8 x 8; each computes 4 x 4 outputs at stride 8.
@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let n_tok = step.n_tokens;
    let m0 = wid.y * BM;
    let n0 = wid.x * BN;
    if (m0 >= n_tok) {
        return;
    }
    let tx = lid % 8u;
    let ty = lid / 8u;
#if NORM
    {
        // Two invocations per token row sum squares over halves of K.
        let r = lid / 2u;
        let m = m0 + r;
        var s = 0.0;
        if (m < n_tok) {
            for (var k = lid % 2u; k < p.k; k += 2u) {
                let v = x[m * p.x_stride + k];
                s += v * v;
            }
        }
        part[lid] = s;
    }
    workgroupBarrier();
    if (lid < BM) {
        rs[lid] = inv_rms(part[2u * lid] + part[2u * lid + 1u]);
    }
#endif
    var acc: array<f32, 16>;
#if GATED
    var acc_u: array<f32, 16>;
#endif
    for (var k0 = 0u; k0 < p.k; k0 += BK) {
#if W_PACKED
        {
            // 32 rows x 16 k: invocation lid dequantizes k0 + (lid % 2) * 8 .. + 8 of row lid / 2
            // (k is a multiple of the group size, itself a multiple of 8).
            let r = lid / 2u;
            let kk = (lid % 2u) * 8u;
            let n = n0 + r;
            var v = array<vec4<f32>, 2>(vec4<f32>(0.0), vec4<f32>(0.0));
#if GATED
            var vu = array<vec4<f32>, 2>(vec4<f32>(0.0), vec4<f32>(0.0));
#endif
            if (n < p.n_rows && k0 + kk < p.k) {
                v = w_deq8(n, k0 + kk);
#if GATED
                vu = u_deq8(n, k0 + kk);
#endif
            }
            for (var e = 0u; e < 8u; e++) {
                ws[r * BK + kk + e] = wtile(v[e / 4u][e % 4u]);
#if GATED
                us[r * BK + kk + e] = wtile(vu[e / 4u][e % 4u]);
#endif
            }
        }
#endif
        for (var j = 0u; j < 8u; j++) {
            let idx = lid + j * 64u;
            let r = idx / BK;
            let kk = idx % BK;
            let k = k0 + kk;
            let m = m0 + r;
            var xv = 0.0;
            if (m < n_tok && k < p.k) {
                xv = x[m * p.x_stride + k];
#if NORM
                xv = xv * g[k];
#endif
            }
            xs[idx] = xv;
#ifndef W_PACKED
            let n = n0 + r;
            var wv = 0.0;
#if GATED
            var uv = 0.0;
#endif
            if (n < p.n_rows && k < p.k) {
                wv = w_load(n * p.k + k);
#if GATED
                uv = u_load(n * p.k + k);
#endif
            }
            ws[idx] = wv;
#if GATED
            us[idx] = uv;
#endif
#endif
        }
        workgroupBarrier();
        for (var kk = 0u; kk < BK; kk++) {
            var a: array<f32, 4>;
            var b: array<f32, 4>;
#if GATED
            var c: array<f32, 4>;
#endif
            for (var i = 0u; i < 4u; i++) {
                a[i] = xs[(ty + 8u * i) * BK + kk];
                b[i] = f32(ws[(tx + 8u * i) * BK + kk]);
#if GATED
                c[i] = f32(us[(tx + 8u * i) * BK + kk]);
#endif
            }
            for (var i = 0u; i < 4u; i++) {
                for (var j = 0u; j < 4u; j++) {
                    acc[i * 4u + j] += a[i] * b[j];
#if GATED
                    acc_u[i * 4u + j] += a[i] * c[j];
#endif
                }
            }
        }
        workgroupBarrier();
    }
    for (var i = 0u; i < 4u; i++) {
        let ml = ty + 8u * i;
        let m = m0 + ml;
        if (m >= n_tok) {
            continue;
        }
        for (var j = 0u; j < 4u; j++) {
            let n = n0 + tx + 8u * j;
            if (n >= p.n_rows) {
                continue;
            }
            var b = 0.0;
#if GATED
            b = acc_u[i * 4u + j];
#endif
#if NORM
            store_out(m, n, acc[i * 4u + j], b, rs[ml]);
#else
            store_out(m, n, acc[i * 4u + j], b, 1.0);
#endif
        }
    }
}

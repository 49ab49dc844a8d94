// Rust dispatch: src/kernels/argmax.rs; CPU reference and tests: ARCHITECTURE.md ops table (tests/kernels.rs argmax_*).
// The token of each logit row: out[r] = argmax(logits[r, :]) (lowest index on ties, NaN
// never wins, 0 for a row without any value above -f32::MAX), or, for a row with a
// positive inverse temperature in draws[r], a draw from softmax(logits / T) over the whole
// vocabulary by the Gumbel-max rule: argmax_i(logits[i] / T + g_i), where g_i is standard
// Gumbel noise from a counter-based hash of (the row's key, i). The key comes from the
// request's seed and the token's index in its output, so the draw is a function of the
// logits alone: every path (a step at a time, batched, decoded ahead) draws the same token,
// and no logits row needs to come back to the host.
// One workgroup per row; the host reads back 4 bytes per row.
#include "common/step.wgsl"

struct Params {
    // Vocabulary size (row width).
    n: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

// One row's draw: inv_t 0 for the plain argmax (greedy rows).
struct Draw {
    inv_t: f32,
    key0: u32,
    key1: u32,
    _pad: u32,
}

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<uniform> p: Params;
@group(0) @binding(2) var<storage, read> logits: array<f32>;       // (n_out, n)
@group(0) @binding(3) var<storage, read_write> out: array<u32>;    // (n_out)
@group(0) @binding(4) var<storage, read> draws: array<Draw>;       // (n_out)

var<workgroup> best_v: array<f32, WG>;
var<workgroup> best_i: array<u32, WG>;

#include "common/rank.wgsl"

// A 32-bit integer hash with good avalanche (two multiply-xorshift rounds).
fn mix32(x0: u32) -> u32 {
    var x = x0;
    x ^= x >> 16u;
    x *= 0x7feb352du;
    x ^= x >> 15u;
    x *= 0x846ca68bu;
    x ^= x >> 16u;
    return x;
}

// Standard Gumbel noise for token i of a row with this draw's key: -log(-log(u)), u uniform
// in (0, 1) on a 2^-24 grid (so g lies in about [-2.8, 17.3]).
fn gumbel(d: Draw, i: u32) -> f32 {
    let h = mix32(mix32(i ^ d.key0) + d.key1);
    let u = (f32(h >> 8u) + 0.5) * (1.0 / 16777216.0);
    return -log(-log(u));
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let r = wid.x;
    if (r >= step.n_out) {
        return;
    }
    let base = r * p.n;
    let d = draws[r];
    var bv = -F32_MAX;
    var bi = 0xffffffffu;
    for (var i = lid; i < p.n; i += WG) {
        var v = logits[base + i];
        if (d.inv_t > 0.0 && v > -F32_MAX) {
            v = v * d.inv_t + gumbel(d, i);
        }
        // v == v is false for NaN.
        if (v == v && better(v, i, bv, bi)) {
            bv = v;
            bi = i;
        }
    }
    best_v[lid] = bv;
    best_i[lid] = bi;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride = stride / 2u) {
        if (lid < stride) {
            let ov = best_v[lid + stride];
            let oi = best_i[lid + stride];
            if (better(ov, oi, best_v[lid], best_i[lid])) {
                best_v[lid] = ov;
                best_i[lid] = oi;
            }
        }
        workgroupBarrier();
    }
    if (lid == 0u) {
        // A row with no finite maximum (all NaN or -inf) yields token 0, as the CPU does.
        out[r] = select(best_i[0], 0u, best_i[0] >= p.n);
    }
}

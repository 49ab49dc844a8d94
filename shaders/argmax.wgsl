// Rust dispatch: src/kernels/argmax.rs; CPU reference and tests: ARCHITECTURE.md ops table (tests/kernels.rs argmax_*).
// The token of each logit row: out[r] = argmax(logits[r, :]) (lowest index on ties, NaN
// never wins, 0 for a row without any value above -f32::MAX), or, for a row with a
// positive inverse temperature in draws[r], a draw from softmax(logits / T) by the
// Gumbel-max rule: argmax_i(logits[i] / T + g_i), where g_i is standard Gumbel noise from a
// counter-based hash of (the row's key, i). With a top-p below 1 the candidates are first
// cut to the nucleus: the tokens whose logit is at least the largest threshold that keeps a
// probability mass of top-p (found by bisection over the logits' order, one pass over the
// row per step); the Gumbel-max over the candidates is an exact draw from the renormalised
// nucleus. The key comes from the request's seed and the token's index in its output, so
// the draw is a function of the logits alone: every path (a step at a time, batched,
// decoded ahead) draws the same token, and no logits row needs to come back to the host.
// One workgroup per row; the host reads back 4 bytes per row.
#include "common/step.wgsl"

struct Params {
    // Vocabulary size (row width).
    n: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

// One row's draw: inv_t 0 for the plain argmax (greedy rows); top_p in (0, 1) cuts the
// candidates to the nucleus (else all).
struct Draw {
    inv_t: f32,
    key0: u32,
    key1: u32,
    top_p: f32,
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

// The f32 order as a u32 order (finite values and infinities).
fn order_key(v: f32) -> u32 {
    let b = bitcast<u32>(v);
    return select(b ^ 0x80000000u, ~b, (b & 0x80000000u) != 0u);
}

fn from_order_key(k: u32) -> f32 {
    return bitcast<f32>(select(~k, k ^ 0x80000000u, (k & 0x80000000u) != 0u));
}

var<workgroup> shared_total: f32;

// The workgroup's sum (`is_max`: maximum) of each invocation's `v`, the same uniform value in
// every invocation.
fn reduce_all(lid: u32, v: f32, is_max: bool) -> f32 {
    best_v[lid] = v;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride = stride / 2u) {
        if (lid < stride) {
            let o = best_v[lid + stride];
            best_v[lid] = select(best_v[lid] + o, max(best_v[lid], o), is_max);
        }
        workgroupBarrier();
    }
    if (lid == 0u) {
        shared_total = best_v[0];
    }
    return workgroupUniformLoad(&shared_total);
}

// Probability mass (unnormalised: exp((v - mx) * inv_t) summed) of the row's tokens whose
// logit is at least `floor`.
fn mass_from(lid: u32, base: u32, mx: f32, inv_t: f32, floor: f32) -> f32 {
    var acc = 0.0;
    for (var i = lid; i < p.n; i += WG) {
        let v = logits[base + i];
        if (v >= floor) {
            acc += exp((v - mx) * inv_t);
        }
    }
    return reduce_all(lid, acc, false);
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let r = wid.x;
    if (r >= step.n_out) {
        return;
    }
    let base = r * p.n;
    let d = draws[r];
    // Candidates: tokens whose logit is at least `floor` (all but -inf and NaN, or the
    // nucleus).
    var floor = -F32_MAX;
    if (d.inv_t > 0.0 && d.top_p > 0.0 && d.top_p < 1.0) {
        var m = -F32_MAX;
        for (var i = lid; i < p.n; i += WG) {
            let v = logits[base + i];
            if (v > m) {
                m = v;
            }
        }
        let mx = reduce_all(lid, m, true);
        let want_mass = d.top_p * mass_from(lid, base, mx, d.inv_t, -F32_MAX);
        // mass(floor) falls as floor rises: keep mass(lo) >= want_mass > mass(hi).
        var lo = order_key(-F32_MAX);
        var hi = order_key(mx) + 1u;
        for (var it = 0u; it < 40u && hi - lo > 1u; it++) {
            let mid = lo + (hi - lo) / 2u;
            if (mass_from(lid, base, mx, d.inv_t, from_order_key(mid)) >= want_mass) {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        floor = from_order_key(lo);
    }
    var bv = -F32_MAX;
    var bi = 0xffffffffu;
    for (var i = lid; i < p.n; i += WG) {
        var v = logits[base + i];
        if (v < floor) {
            // Outside the nucleus (or -inf).
            continue;
        }
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

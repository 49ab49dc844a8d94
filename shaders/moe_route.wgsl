// Rust dispatch: src/kernels/moe.rs (route); CPU reference: src/reference/forward.rs `mixture`
// (tests/kernels_moe.rs).
// A mixture-of-experts router's choice for each token of the step, on the GPU so that the
// expert matvecs (moe_matvec.wgsl) read it without a host round trip: the softmax of the
// token's router logits, its top_k most probable experts (the lower index first on a tie),
// and their probabilities, renormalised to sum to 1 with `renormalize` (Qwen3-MoE's
// norm_topk_prob, Mixtral's top-k-then-softmax). Written as (expert, weight bits) pairs,
// route[t * top_k + j], in order of probability. One invocation per token: the top_k picks
// are top_k passes over the row, each taking the best expert ranked after the last pick.
#include "common/step.wgsl"

struct Params {
    n_experts: u32,
    top_k: u32,
    // 1: the chosen probabilities are renormalised to sum to 1.
    renormalize: u32,
    _pad: u32,
}

@group(0) @binding(0) var<uniform> step: Step;
// The parameters are a storage buffer, not a uniform: lavapipe specializes a shader on the
// uniform values its loops are bounded by ("inline uniforms"), and this kernel's loops over
// the experts then cost 6-50 ms a dispatch (32 experts: 45 ms, against 0.06 ms from storage;
// benches/kernels.rs, the MoE step's parts).
@group(0) @binding(1) var<storage, read> p: Params;
@group(0) @binding(2) var<storage, read> logits: array<f32>;            // (n_tokens, n_experts)
@group(0) @binding(3) var<storage, read_write> route: array<vec2<u32>>; // (n_tokens * top_k)

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let t = gid.x;
    if (t >= step.n_tokens) {
        return;
    }
    let base = t * p.n_experts;
    var mx = logits[base];
    for (var e = 1u; e < p.n_experts; e++) {
        mx = max(mx, logits[base + e]);
    }
    var total = 0.0;
    for (var e = 0u; e < p.n_experts; e++) {
        total += exp(logits[base + e] - mx);
    }
    // The order is (logit descending, index ascending); the softmax keeps it.
    var last_v = 0.0;
    var last_i = 0xffffffffu;
    var chosen = 0.0;
    for (var j = 0u; j < p.top_k; j++) {
        var best_i = 0xffffffffu;
        var best_v = 0.0;
        for (var e = 0u; e < p.n_experts; e++) {
            let v = logits[base + e];
            let after = last_i == 0xffffffffu || v < last_v || (v == last_v && e > last_i);
            if (after && (best_i == 0xffffffffu || v > best_v)) {
                best_i = e;
                best_v = v;
            }
        }
        last_i = best_i;
        last_v = best_v;
        let w = exp(best_v - mx);
        chosen += w;
        route[t * p.top_k + j] = vec2<u32>(best_i, bitcast<u32>(w / total));
    }
    if (p.renormalize != 0u) {
        for (var j = 0u; j < p.top_k; j++) {
            let r = route[t * p.top_k + j];
            route[t * p.top_k + j] = vec2<u32>(r.x, bitcast<u32>(exp(logits[base + r.x] - mx) / chosen));
        }
    }
}

// Rust dispatch: src/kernels/sample.rs; CPU reference and tests: ARCHITECTURE.md ops table (tests/kernels.rs sample_*).
// Sampling on the GPU from each row's top-k pairs (topk.wgsl's output: the best KMAX
// (id, logit) pairs, best first): temperature, then top-k (at most KMAX), then top-p over
// the renormalised probabilities, then one draw with the row's uniform number `u[r]` from
// the host's generator; the drawn id goes into `ids[r]` (the argmax slot, which the next
// step's embedding reads when decoding runs ahead). The order of operations is the host
// sampler's (engine/sampler.rs), in f32 instead of f64: a draw within rounding of a
// boundary can differ, so the host checks every drawn token against its own draw from the
// same pairs and restarts from its token when they differ.
#include "common/step.wgsl"

struct Params {
    temperature: f32,
    // Pairs considered (1..=KMAX; 0: all KMAX).
    top_k: u32,
    top_p: f32,
    _pad0: u32,
}

#include "common/topk_row.wgsl"

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<uniform> p: Params;
@group(0) @binding(2) var<storage, read> top: array<u32>;          // (n_out, ROW)
@group(0) @binding(3) var<storage, read> u: array<f32>;            // (n_out) uniform draws in [0, 1), or -1
@group(0) @binding(4) var<storage, read_write> ids: array<u32>;    // (n_out) drawn ids

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let r = gid.x;
    if (r >= step.n_out) {
        return;
    }
    // A negative number: the row keeps the argmax kernel's choice (a draw from the whole
    // vocabulary, for a request without top-k).
    if (u[r] < 0.0) {
        return;
    }
    let b = r * ROW;
    let kk = select(KMAX, min(p.top_k, KMAX), p.top_k > 0u);
    // The candidates: the row's pairs up to kk, empty slots (id 0xffffffff) ending them.
    var n = 0u;
    for (; n < kk; n++) {
        if (top[b + n] == 0xffffffffu) {
            break;
        }
    }
    if (n == 0u) {
        ids[r] = 0u;
        return;
    }
    let v0 = bitcast<f32>(top[b + KMAX]) / p.temperature;
    var sum = 0.0;
    for (var j = 0u; j < n; j++) {
        sum += exp(bitcast<f32>(top[b + KMAX + j]) / p.temperature - v0);
    }
    // Top-p: the fewest best candidates whose probability reaches p.
    var keep = n;
    if (p.top_p < 1.0) {
        var acc = 0.0;
        for (var j = 0u; j < n; j++) {
            acc += exp(bitcast<f32>(top[b + KMAX + j]) / p.temperature - v0) / sum;
            if (acc >= p.top_p) {
                keep = j + 1u;
                break;
            }
        }
    }
    var kept = 0.0;
    for (var j = 0u; j < keep; j++) {
        kept += exp(bitcast<f32>(top[b + KMAX + j]) / p.temperature - v0) / sum;
    }
    let draw = u[r];
    var acc = 0.0;
    var id = top[b + keep - 1u];
    for (var j = 0u; j < keep; j++) {
        acc += exp(bitcast<f32>(top[b + KMAX + j]) / p.temperature - v0) / sum / kept;
        if (draw < acc) {
            id = top[b + j];
            break;
        }
    }
    ids[r] = id;
}

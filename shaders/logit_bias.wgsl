// Rust dispatch: src/kernels/logit_bias.rs; CPU reference and tests: ARCHITECTURE.md ops table (tests/kernels.rs logit_bias_*).
// OpenAI's logit_bias and presence/frequency penalties: in place, logits[r, t] += delta for
// each (t, delta) pair of row r, before the logit mask, argmax, top-k or the logits readback.
// The pairs are sparse: `bias` holds the rows' offsets first (row r's pairs are
// [bias[r], bias[r + 1]), counted in pairs), then from word p.base the pairs themselves, two
// words each (token, delta's f32 bits). The host writes each token at most once per row, so
// no two invocations touch the same logit. One workgroup per row (y); its invocations stride
// over the row's pairs.
#include "common/step.wgsl"

struct Params {
    // Vocabulary size (row width).
    n: u32,
    // Word index of the first pair (the offsets take the words before it).
    base: u32,
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<uniform> p: Params;
@group(0) @binding(2) var<storage, read> bias: array<u32>;         // offsets, then (token, delta) pairs
@group(0) @binding(3) var<storage, read_write> logits: array<f32>; // (n_out, n)

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let r = wid.y;
    if (r >= step.n_out) {
        return;
    }
    let end = bias[r + 1u];
    for (var k = bias[r] + lid.x; k < end; k += WG) {
        let t = bias[p.base + 2u * k];
        if (t < p.n) {
            logits[r * p.n + t] += bitcast<f32>(bias[p.base + 2u * k + 1u]);
        }
    }
}

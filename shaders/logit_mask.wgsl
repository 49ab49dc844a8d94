// Rust dispatch: src/kernels/logit_mask.rs; CPU reference and tests: ARCHITECTURE.md ops table (tests/kernels.rs logit_mask_*).
// Constrained decoding: in place, logits[r, i] = p.fill (the host passes -inf) where bit i of
// row r's allowed-token bitmask is clear, before argmax, top-k or the logits readback. Bit i
// of row r is bit i % 32 of mask[r * p.words + i / 32] (llguidance's layout). Rows without a
// constraint upload all-ones words and are left as they are. One invocation per mask word
// (32 logits); y is the row.
#include "common/step.wgsl"

struct Params {
    // Vocabulary size (row width).
    n: u32,
    // Mask words per row (ceil(n / 32)).
    words: u32,
    // What a disallowed logit becomes (-inf from the host: not a WGSL constant, which Tint
    // would reject).
    fill: f32,
    _pad0: u32,
}

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<uniform> p: Params;
@group(0) @binding(2) var<storage, read> mask: array<u32>;         // (n_out, words)
@group(0) @binding(3) var<storage, read_write> logits: array<f32>; // (n_out, n)

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let w = gid.x;
    let r = gid.y;
    if (r >= step.n_out || w >= p.words) {
        return;
    }
    let m = mask[r * p.words + w];
    if (m == 0xffffffffu) {
        return;
    }
    let i0 = w * 32u;
    let base = r * p.n + i0;
    let end = min(32u, p.n - i0);
    for (var b = 0u; b < end; b++) {
        if ((m & (1u << b)) == 0u) {
            logits[base + b] = p.fill;
        }
    }
}

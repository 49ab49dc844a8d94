// Rust dispatch: src/kernels/attention.rs; CPU reference and tests: ARCHITECTURE.md ops table (tests/kernels.rs attention_*).
// The reduce pass of flash-decoding: combines the partial results that attention.wgsl wrote
// for the parts (KV shard x key split) of each (token, query head): with M the largest
// running max, out = sum_p acc_p e^(m_p - M) / sum_p l_p e^(m_p - M). A part that saw no
// keys has m = -FLT_MAX and l = 0 and drops out. One workgroup per (query head, token).
#include "common/step.wgsl"

struct Params {
    n_heads: u32,
    head_dim: u32,
    out_stride: u32,
    n_shards: u32,
}

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<uniform> p: Params;
@group(0) @binding(2) var<storage, read> partials: array<f32>;  // (n_tokens, n_heads, parts, head_dim + 2)
@group(0) @binding(3) var<storage, read_write> out: array<f32>; // (n_tokens, out_stride)

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let h = wid.x;
    let t = wid.y;
    let parts = p.n_shards * max(step.n_splits, 1u);
    if (t >= step.n_tokens || h >= p.n_heads || parts == 1u) {
        return;
    }
    let hd = p.head_dim;
    let w = hd + 2u;
    let base = (t * p.n_heads + h) * parts * w;
    var mx = -0x1.fffffep+127f;
    for (var i = 0u; i < parts; i++) {
        mx = max(mx, partials[base + i * w + hd]);
    }
    var l = 0.0;
    for (var i = 0u; i < parts; i++) {
        l += partials[base + i * w + hd + 1u] * exp(partials[base + i * w + hd] - mx);
    }
    for (var d = lid; d < hd; d += WG) {
        var o = 0.0;
        for (var i = 0u; i < parts; i++) {
            o += partials[base + i * w + d] * exp(partials[base + i * w + hd] - mx);
        }
        out[t * p.out_stride + h * hd + d] = o / l;
    }
}

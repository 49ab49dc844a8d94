// Rust dispatch: src/kernels/argmax.rs; CPU reference and tests: ARCHITECTURE.md ops table (tests/kernels.rs argmax_*).
// Greedy sampling: out[r] = argmax(logits[r, :]) (lowest index on ties, NaN never wins,
// 0 for a row without any value above -f32::MAX).
// One workgroup per row; the host reads back 4 bytes per row.
#include "common/step.wgsl"

struct Params {
    // Vocabulary size (row width).
    n: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<uniform> p: Params;
@group(0) @binding(2) var<storage, read> logits: array<f32>;       // (n_out, n)
@group(0) @binding(3) var<storage, read_write> out: array<u32>;    // (n_out)

var<workgroup> best_v: array<f32, WG>;
var<workgroup> best_i: array<u32, WG>;

#include "common/rank.wgsl"

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let r = wid.x;
    if (r >= step.n_out) {
        return;
    }
    let base = r * p.n;
    var bv = -F32_MAX;
    var bi = 0xffffffffu;
    for (var i = lid; i < p.n; i += WG) {
        let v = logits[base + i];
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

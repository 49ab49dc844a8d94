// Rust dispatch: src/kernels/moe.rs (group); checked by tests/kernels.rs moe_grouped_*.
// A step's token-expert pairs grouped by expert, so that the grouped expert matvecs
// (moe_grouped.wgsl) read each chosen expert's weights once for up to TT of its pairs
// instead of once per pair (prefill). One workgroup: counts per expert (atomics in workgroup
// memory), offsets by an exclusive scan, the pairs scattered into `groups` by expert, and the
// work list: one item (expert, first slot, pairs) per TT pairs of an expert, in expert
// order, then items of no pairs up to the list's length. The order of an expert's pairs in
// its group depends on the scatter's atomics, which changes nothing computed: each pair's
// products are its own.
#include "common/step.wgsl"

struct Params {
    n_experts: u32,
    top_k: u32,
    // Pairs per work item (moe_grouped.wgsl's TT).
    tt: u32,
    // Length of the work list (items past the written ones get no pairs).
    max_items: u32,
}

// Most experts a model may have (kernels::moe::GROUP_MAX_EXPERTS).
const MAX_E: u32 = 512u;

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<uniform> p: Params;
@group(0) @binding(2) var<storage, read> route: array<vec2<u32>>;      // (n_tokens * top_k)
@group(0) @binding(3) var<storage, read_write> groups: array<u32>;     // pairs by expert
@group(0) @binding(4) var<storage, read_write> work: array<vec4<u32>>; // (expert, slot, pairs, 0)

var<workgroup> count: array<atomic<u32>, MAX_E>;
var<workgroup> offset: array<u32, MAX_E>;

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_index) lid: u32) {
    let n_pairs = step.n_tokens * p.top_k;
    for (var e = lid; e < p.n_experts; e += WG) {
        atomicStore(&count[e], 0u);
    }
    workgroupBarrier();
    for (var i = lid; i < n_pairs; i += WG) {
        atomicAdd(&count[route[i].x], 1u);
    }
    workgroupBarrier();
    if (lid == 0u) {
        var at = 0u;
        var item = 0u;
        for (var e = 0u; e < p.n_experts; e++) {
            let c = atomicLoad(&count[e]);
            offset[e] = at;
            for (var s = 0u; s < c; s += p.tt) {
                work[item] = vec4<u32>(e, at + s, min(p.tt, c - s), 0u);
                item++;
            }
            at += c;
            // The count becomes the expert's cursor for the scatter.
            atomicStore(&count[e], 0u);
        }
        for (; item < p.max_items; item++) {
            work[item] = vec4<u32>(0u);
        }
    }
    workgroupBarrier();
    for (var i = lid; i < n_pairs; i += WG) {
        let e = route[i].x;
        groups[offset[e] + atomicAdd(&count[e], 1u)] = i;
    }
}

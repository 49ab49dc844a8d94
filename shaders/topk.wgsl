// Rust dispatch: src/kernels/topk.rs; CPU reference and tests: ARCHITECTURE.md ops table (tests/kernels.rs topk_*).
// GPU top-k for sampled rows: the K best (id, logit) pairs of each row of logits, best
// first, ordered by value then by lower id (the host sampler's order), non-finite values
// skipped; rows with fewer than K finite values end with id 0xffffffff. The host samples
// among them (temperature, top-k <= K, top-p), so a step reads back 8 K bytes per row
// instead of the whole vocabulary. One workgroup per row: each invocation keeps a sorted
// private top-K of its strided share of the row, then K rounds of a workgroup max-reduction
// over the invocations' current heads merge them. Word 2 KMAX of each row is the row's
// logsumexp over its finite values (f32 bits), for log-probabilities: an online max/sum per
// invocation, then one workgroup reduction of the (max, sum) pairs.
#include "common/step.wgsl"

struct Params {
    // Vocabulary size (row width).
    n: u32,
    // Pairs wanted per row (at most KMAX).
    k: u32,
    _pad0: u32,
    _pad1: u32,
}

#include "common/topk_row.wgsl"

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<uniform> p: Params;
@group(0) @binding(2) var<storage, read> logits: array<f32>;       // (n_out, n)
// (n_out, ROW): K ids, then K values as f32 bits, then the logsumexp.
@group(0) @binding(3) var<storage, read_write> out: array<u32>;

var<private> lv: array<f32, KMAX>;
var<private> li: array<u32, KMAX>;
var<workgroup> hv: array<f32, WG>;
var<workgroup> hi: array<u32, WG>;
var<workgroup> hl: array<u32, WG>;
var<workgroup> hs: array<f32, WG>;

#include "common/rank.wgsl"

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let r = wid.x;
    if (r >= step.n_out) {
        return;
    }
    let k = min(p.k, KMAX);
    let none = 0xffffffffu;
    // Empty slots: the lowest finite f32 (their index is `none`, which the host drops).
    // Not -inf: WGSL const-evaluation (Tint) rejects an infinite bitcast.
    let neg_inf = -F32_MAX;
    // This invocation's best k of indices lid, lid + WG, ..., sorted; n of them filled.
    var n = 0u;
    // Running max and sum of exp(v - max) of this invocation's finite values.
    var m = neg_inf;
    var sum = 0.0;
    let base = r * p.n;
    for (var i = lid; i < p.n; i += WG) {
        let v = logits[base + i];
        if (!(abs(v) <= F32_MAX)) {
            continue; // NaN or infinite (a masked logit is -inf)
        }
        if (v > m) {
            sum = sum * exp(m - v) + 1.0;
            m = v;
        } else {
            sum += exp(v - m);
        }
        var j = n;
        if (n < k) {
            n += 1u;
        } else if (better(v, i, lv[k - 1u], li[k - 1u])) {
            j = k - 1u;
        } else {
            continue;
        }
        while (j > 0u && better(v, i, lv[j - 1u], li[j - 1u])) {
            lv[j] = lv[j - 1u];
            li[j] = li[j - 1u];
            j -= 1u;
        }
        lv[j] = v;
        li[j] = i;
    }
    // The row's logsumexp: (max, sum) pairs combined pairwise.
    hv[lid] = m;
    hs[lid] = sum;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (lid < s) {
            let m2 = hv[lid + s];
            let mm = max(hv[lid], m2);
            hs[lid] = hs[lid] * exp(hv[lid] - mm) + hs[lid + s] * exp(m2 - mm);
            hv[lid] = mm;
        }
        workgroupBarrier();
    }
    if (lid == 0u) {
        out[r * ROW + 2u * KMAX] = bitcast<u32>(hv[0] + log(hs[0]));
    }
    workgroupBarrier();
    // Merge: each round the best head wins and its invocation moves to its next entry.
    var head = 0u;
    for (var round = 0u; round < k; round++) {
        if (head < n) {
            hv[lid] = lv[head];
            hi[lid] = li[head];
        } else {
            hv[lid] = neg_inf;
            hi[lid] = none;
        }
        hl[lid] = lid;
        workgroupBarrier();
        for (var s = WG / 2u; s > 0u; s >>= 1u) {
            if (lid < s && better(hv[lid + s], hi[lid + s], hv[lid], hi[lid])) {
                hv[lid] = hv[lid + s];
                hi[lid] = hi[lid + s];
                hl[lid] = hl[lid + s];
            }
            workgroupBarrier();
        }
        let winner = hl[0];
        let win_id = hi[0];
        if (lid == 0u) {
            out[r * ROW + round] = win_id;
            out[r * ROW + KMAX + round] = bitcast<u32>(hv[0]);
        }
        if (lid == winner && win_id != none) {
            head += 1u;
        }
        workgroupBarrier();
    }
}

// Causal grouped-query attention over the paged KV cache. One workgroup per (KV head, batch
// of up to HB = 4 query heads of its group, token): query head h reads KV head
// h / (n_heads / n_kv_heads), and the heads of a batch share every K and V load (their
// values are packed in the components of a vec4). Keys 0..=pos of the token's sequence are
// visited in chunks of WG with an online softmax. Each invocation scores one key of a chunk
// for all heads of the batch and owns output dimensions lid, lid + WG, ... (head_dim <= 4 * WG).
//
// XBCAST (CPU adapters; the workgroup is one 8-lane subgroup): no workgroup memory and no
// barriers. Each lane scores its own key of a chunk of 8, getting q by subgroupBroadcast
// from the lane that loaded it; the chunk max and sum come from subgroupMax/subgroupAdd;
// for the values every lane owns dims lid, lid + 8, ... and takes each key's probability
// and address by broadcast. On lavapipe every divergent load and every barrier is costly,
// and this touches each K and V element once per lane that needs it.
#include "common/step.wgsl"

struct Params {
    n_heads: u32,
    n_kv_heads: u32,
    head_dim: u32,
    qkv_stride: u32,
    page_size: u32,
    max_pages: u32,
    // Floats per output row (n_heads * head_dim).
    out_stride: u32,
    // 1 / sqrt(head_dim) (or the model's attention scale).
    scale: f32,
}

const MAX_HEAD_DIM: u32 = 256u;
const DIMS_PER_LANE: u32 = 4u;
// Query heads per workgroup (components of a vec4).
const HB: u32 = 4u;
const NEG: f32 = -3.4028235e38;

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<uniform> p: Params;
@group(0) @binding(2) var<storage, read> qkv: array<f32>;          // (n_tokens, qkv_stride), q rotated
@group(0) @binding(3) var<storage, read> positions: array<u32>;    // (n_tokens)
@group(0) @binding(4) var<storage, read> token_seq: array<u32>;    // (n_tokens)
@group(0) @binding(5) var<storage, read> block_table: array<u32>;  // (n_seqs, max_pages)
@group(0) @binding(6) var<storage, read> k_cache: array<f32>;      // (pages, page_size, n_kv_heads, head_dim)
@group(0) @binding(7) var<storage, read> v_cache: array<f32>;
@group(0) @binding(8) var<storage, read_write> out: array<f32>;    // (n_tokens, out_stride)

#if XBCAST
// Dims lid + 8 i of q (scaled) for the heads of the batch, and the output accumulators of the
// same dims.
var<private> qr: array<vec4<f32>, 32>;
var<private> acc8: array<vec4<f32>, 32>;

@compute @workgroup_size(8)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let t = wid.y;
    let group = p.n_heads / p.n_kv_heads;
    let batches = (group + HB - 1u) / HB;
    let kvh = wid.x / batches;
    if (t >= step.n_tokens || kvh >= p.n_kv_heads) {
        return;
    }
    let b = wid.x % batches;
    let h0 = kvh * group + b * HB;
    let nh = min(HB, group - b * HB);
    let hd = p.head_dim;
    // Dims per lane (head_dim is a multiple of 8 for this variant; the host checks).
    let dpl = hd / 8u;
    let qb = t * p.qkv_stride + h0 * hd;
    for (var i = 0u; i < dpl; i++) {
        var qv = vec4<f32>(0.0);
        for (var g = 0u; g < nh; g++) {
            qv[g] = qkv[qb + g * hd + i * 8u + lid] * p.scale;
        }
        qr[i] = qv;
        acc8[i] = vec4<f32>(0.0);
    }
    let pos = positions[t];
    let n_keys = pos + 1u;
    let seq = token_seq[t];
    var m = vec4<f32>(NEG);
    var l = vec4<f32>(0.0);
    for (var start = 0u; start < n_keys; start += 8u) {
        let j = start + lid;
        let live = j < n_keys;
        let jj = min(j, n_keys - 1u);
        let page = block_table[seq * p.max_pages + jj / p.page_size];
        let addr = ((page * p.page_size + jj % p.page_size) * p.n_kv_heads + kvh) * hd;
        var dot = vec4<f32>(0.0);
        for (var i = 0u; i < dpl; i++) {
            let q = qr[i];
            let kb = addr + i * 8u;
            dot += subgroupBroadcast(q, 0u) * k_cache[kb];
            dot += subgroupBroadcast(q, 1u) * k_cache[kb + 1u];
            dot += subgroupBroadcast(q, 2u) * k_cache[kb + 2u];
            dot += subgroupBroadcast(q, 3u) * k_cache[kb + 3u];
            dot += subgroupBroadcast(q, 4u) * k_cache[kb + 4u];
            dot += subgroupBroadcast(q, 5u) * k_cache[kb + 5u];
            dot += subgroupBroadcast(q, 6u) * k_cache[kb + 6u];
            dot += subgroupBroadcast(q, 7u) * k_cache[kb + 7u];
        }
        let s = select(vec4<f32>(NEG), dot, live);
        let cmax = max(m, subgroupMax(s));
        let corr = exp(m - cmax);
        m = cmax;
        let pr = select(vec4<f32>(0.0), exp(s - m), live);
        l = l * corr + subgroupAdd(pr);
        // Key by key: its probability and address from the lane that scored it.
        let p0 = subgroupBroadcast(pr, 0u);
        let p1 = subgroupBroadcast(pr, 1u);
        let p2 = subgroupBroadcast(pr, 2u);
        let p3 = subgroupBroadcast(pr, 3u);
        let p4 = subgroupBroadcast(pr, 4u);
        let p5 = subgroupBroadcast(pr, 5u);
        let p6 = subgroupBroadcast(pr, 6u);
        let p7 = subgroupBroadcast(pr, 7u);
        let a0 = subgroupBroadcast(addr, 0u) + lid;
        let a1 = subgroupBroadcast(addr, 1u) + lid;
        let a2 = subgroupBroadcast(addr, 2u) + lid;
        let a3 = subgroupBroadcast(addr, 3u) + lid;
        let a4 = subgroupBroadcast(addr, 4u) + lid;
        let a5 = subgroupBroadcast(addr, 5u) + lid;
        let a6 = subgroupBroadcast(addr, 6u) + lid;
        let a7 = subgroupBroadcast(addr, 7u) + lid;
        for (var i = 0u; i < dpl; i++) {
            let o = i * 8u;
            acc8[i] = acc8[i] * corr + p0 * v_cache[a0 + o] + p1 * v_cache[a1 + o] + p2 * v_cache[a2 + o]
                + p3 * v_cache[a3 + o] + p4 * v_cache[a4 + o] + p5 * v_cache[a5 + o] + p6 * v_cache[a6 + o]
                + p7 * v_cache[a7 + o];
        }
    }
    let ob = t * p.out_stride + h0 * hd;
    for (var i = 0u; i < dpl; i++) {
        let o = acc8[i] / l;
        for (var g = 0u; g < nh; g++) {
            out[ob + g * hd + i * 8u + lid] = o[g];
        }
    }
}
#else
// qs[d][g] = q of head h0 + g at dim d (0 for heads past the batch).
var<workgroup> qs: array<vec4<f32>, MAX_HEAD_DIM>;
var<workgroup> scores: array<vec4<f32>, WG>;
var<workgroup> probs: array<vec4<f32>, WG>;
var<workgroup> key_addr: array<u32, WG>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let t = wid.y;
    let group = p.n_heads / p.n_kv_heads;
    let batches = (group + HB - 1u) / HB;
    let kvh = wid.x / batches;
    if (t >= step.n_tokens || kvh >= p.n_kv_heads) {
        return;
    }
    let b = wid.x % batches;
    let h0 = kvh * group + b * HB;
    let nh = min(HB, group - b * HB);
    let hd = p.head_dim;
    let qb = t * p.qkv_stride + h0 * hd;
    for (var d = lid; d < hd; d += WG) {
        var qv = vec4<f32>(0.0);
        for (var g = 0u; g < nh; g++) {
            qv[g] = qkv[qb + g * hd + d] * p.scale;
        }
        qs[d] = qv;
    }
    workgroupBarrier();
    let pos = positions[t];
    let n_keys = pos + 1u;
    let seq = token_seq[t];
    var m = vec4<f32>(NEG);
    var l = vec4<f32>(0.0);
    var acc: array<vec4<f32>, DIMS_PER_LANE>;
    for (var start = 0u; start < n_keys; start += WG) {
        let j = start + lid;
        var s = vec4<f32>(NEG);
        var addr = 0u;
        if (j < n_keys) {
            let page = block_table[seq * p.max_pages + j / p.page_size];
            addr = ((page * p.page_size + j % p.page_size) * p.n_kv_heads + kvh) * hd;
            var dot = vec4<f32>(0.0);
            for (var d = 0u; d < hd; d++) {
                dot += qs[d] * k_cache[addr + d];
            }
            s = dot;
        }
        scores[lid] = s;
        key_addr[lid] = addr;
        workgroupBarrier();
        let n_chunk = min(WG, n_keys - start);
        // Tree max over the chunk (lanes past it hold NEG).
        for (var w = WG / 2u; w > 0u; w >>= 1u) {
            if (lid < w) {
                scores[lid] = max(scores[lid], scores[lid + w]);
            }
            workgroupBarrier();
        }
        let cmax = max(m, scores[0]);
        let corr = exp(m - cmax);
        m = cmax;
        if (lid < n_chunk) {
            probs[lid] = exp(s - m);
        }
        workgroupBarrier();
        // Dimension lid (clamped for lanes past head_dim) also sums the chunk's probabilities.
        var psum = vec4<f32>(0.0);
        let d0 = min(lid, hd - 1u);
        var a0 = acc[0] * corr;
        for (var i = 0u; i < n_chunk; i++) {
            let pr = probs[i];
            psum += pr;
            a0 += pr * v_cache[key_addr[i] + d0];
        }
        acc[0] = a0;
        l = l * corr + psum;
        for (var e = 1u; e < DIMS_PER_LANE; e++) {
            let d = lid + e * WG;
            if (d < hd) {
                var a = acc[e] * corr;
                for (var i = 0u; i < n_chunk; i++) {
                    a += probs[i] * v_cache[key_addr[i] + d];
                }
                acc[e] = a;
            }
        }
        workgroupBarrier();
    }
    let ob = t * p.out_stride + h0 * hd;
    for (var e = 0u; e < DIMS_PER_LANE; e++) {
        let d = lid + e * WG;
        if (d < hd) {
            let o = acc[e] / l;
            for (var g = 0u; g < nh; g++) {
                out[ob + g * hd + d] = o[g];
            }
        }
    }
}
#endif

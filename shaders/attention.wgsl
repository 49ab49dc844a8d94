// Causal grouped-query attention over the paged KV cache. One workgroup per (KV head, batch
// of up to HB = 4 query heads of its group, token): query head h reads KV head
// h / (n_heads / n_kv_heads), and the heads of a batch share every K and V load (their
// values are packed in the components of a vec4). Keys 0..=pos of the token's sequence are
// visited in chunks of WG with an online softmax. Each invocation scores one key of a chunk
// for all heads of the batch and owns output dimensions lid, lid + WG, ... (head_dim <= 4 * WG).
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

// Rust dispatch: src/kernels/attention.rs; CPU reference and tests: ARCHITECTURE.md ops table (tests/kernels.rs attention_*, paged_attention_*).
// Causal grouped-query attention over the paged KV cache. One workgroup per (KV head, batch
// of up to HB = 4 query heads of its group, token, split): query head h reads KV head
// h / (n_heads / n_kv_heads), and the heads of a batch share every K and V load (their
// values are packed in the components of a vec4). Keys are visited in chunks with an online
// softmax.
//
// Flash-decoding: the keys 0..=pos of a token are cut into step.n_splits ranges, one per
// workgroup along z, and with several KV shards (buffers) each dispatch sees only the keys
// whose page lies in its shard. When n_shards * n_splits > 1 every workgroup writes a
// partial result (unnormalised output, running max m, sum l) and attention_reduce.wgsl
// combines them; otherwise it writes the output directly.
//
// XBCAST (CPU adapters; the workgroup is one 8-lane subgroup): no workgroup memory and no
// barriers. Each lane scores its own key of a chunk of 8, getting q by subgroupBroadcast
// from the lane that loaded it; the chunk max and sum come from subgroupMax/subgroupAdd;
// for the values every lane owns head_dim / 8 adjacent dims and takes each key's
// probability and address by broadcast. On lavapipe every divergent load and every barrier
// is costly, and this touches each K and V word once per lane that needs it.
// The default kernel (GPUs) uses WG invocations: each scores one key of a chunk of WG, then
// owns output dims lid, lid + WG, ... (head_dim <= 4 * WG).
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
    pages_per_shard: u32,
    // The shard this dispatch reads, and how many there are.
    shard: u32,
    n_shards: u32,
    // KV_Q8: first word of the scales in a shard buffer.
    scale_base: u32,
    // Keys a query sees, itself included (sliding-window layers); 0: every earlier key.
    window: u32,
    // Pages of a sequence's window ring (kv/ring.rs): key j of sequence `seq` is in page
    // seq * ring + (j / page_size) % ring; 0: pages come from the block table.
    ring: u32,
    _pad1: u32,
    _pad2: u32,
}

#include "common/kv.wgsl"

const MAX_HEAD_DIM: u32 = 256u;
const DIMS_PER_LANE: u32 = 4u;
// Query heads per workgroup (components of a vec4).
const HB: u32 = 4u;
const NEG: f32 = -0x1.fffffep+127f;

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<uniform> p: Params;
@group(0) @binding(2) var<storage, read> qkv: array<f32>;          // (n_tokens, qkv_stride), q rotated
@group(0) @binding(3) var<storage, read> positions: array<u32>;    // (n_tokens)
@group(0) @binding(4) var<storage, read> token_seq: array<u32>;    // (n_tokens)
@group(0) @binding(5) var<storage, read> block_table: array<u32>;  // (n_seqs, max_pages)
@group(0) @binding(6) var<storage, read> k_cache: array<KvWord>;   // this shard's pages
@group(0) @binding(7) var<storage, read> v_cache: array<KvWord>;
@group(0) @binding(8) var<storage, read_write> out: array<f32>;    // (n_tokens, out_stride)
// (n_tokens, n_heads, n_shards * n_splits, head_dim + 2): output, m, l per part.
@group(0) @binding(9) var<storage, read_write> partials: array<f32>;

// Parts (shard x split) of each token's keys.
fn n_parts() -> u32 {
    return p.n_shards * max(step.n_splits, 1u);
}

// A sliding-window layer's query at key count n_keys sees keys [n_keys - window, n_keys).
fn key_range(n_keys: u32, split: u32, align: u32) -> vec2<u32> {
    let first = select(0u, n_keys - min(p.window, n_keys), p.window != 0u);
    let splits = max(step.n_splits, 1u);
    let per = ((n_keys - first + splits - 1u) / splits + align - 1u) / align * align;
    let k0 = min(first + split * per, n_keys);
    return vec2<u32>(k0, min(k0 + per, n_keys));
}

// Where head h0 + g's part of token t goes in `partials`.
fn part_base(t: u32, h: u32, split: u32) -> u32 {
    let parts = n_parts();
    return ((t * p.n_heads + h) * parts + p.shard * max(step.n_splits, 1u) + split) * (p.head_dim + 2u);
}

// The cache slot of key j of sequence `seq`: its token-head index in this shard, or
// 0xffffffff when the key's page is in another shard.
fn key_th(seq: u32, j: u32, kvh: u32) -> u32 {
    let page = kv_page(seq, j);
    if (page / p.pages_per_shard != p.shard) {
        return 0xffffffffu;
    }
    return ((page % p.pages_per_shard) * p.page_size + j % p.page_size) * p.n_kv_heads + kvh;
}

#if XBCAST
// Dims lid + 8 i of q (scaled) for the heads of the batch, and the output accumulators of
// dims lid * dpl + i.
var<private> qr: array<vec4<f32>, 32>;
var<private> acc8: array<vec4<f32>, 32>;

// acc8[i..i+4] += pr * V[e..e+4].
fn vacc(i: u32, pr: vec4<f32>, e: u32) {
    let v = v4(e);
    acc8[i] += pr * v.x;
    acc8[i + 1u] += pr * v.y;
    acc8[i + 2u] += pr * v.z;
    acc8[i + 3u] += pr * v.w;
}

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
    // Dims per lane (head_dim is a multiple of 32 for this variant; the host checks).
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
    let n_keys = positions[t] + 1u;
    let seq = token_seq[t];
    let range = key_range(n_keys, wid.z, 8u);
    var m = vec4<f32>(NEG);
    var l = vec4<f32>(0.0);
    for (var start = range.x; start < range.y; start += 8u) {
        let j = start + lid;
        let th0 = key_th(seq, min(j, range.y - 1u), kvh);
        let live = j < range.y && th0 != 0xffffffffu;
        let th = select(0u, th0, live);
        let addr = th * hd;
        var dot = vec4<f32>(0.0);
        for (var i = 0u; i < dpl; i++) {
            let q = qr[i];
            let ka = k4(addr + i * 8u);
            let kb = k4(addr + i * 8u + 4u);
            dot += subgroupBroadcast(q, 0u) * ka.x;
            dot += subgroupBroadcast(q, 1u) * ka.y;
            dot += subgroupBroadcast(q, 2u) * ka.z;
            dot += subgroupBroadcast(q, 3u) * ka.w;
            dot += subgroupBroadcast(q, 4u) * kb.x;
            dot += subgroupBroadcast(q, 5u) * kb.y;
            dot += subgroupBroadcast(q, 6u) * kb.z;
            dot += subgroupBroadcast(q, 7u) * kb.w;
        }
        let s = select(vec4<f32>(NEG), dot * k_scale(th), live);
        let cmax = max(m, subgroupMax(s));
        let corr = exp(m - cmax);
        m = cmax;
        let pr = select(vec4<f32>(0.0), exp(s - m), live);
        l = l * corr + subgroupAdd(pr);
        // Key by key: its probability (times its V scale) and address from the lane that
        // scored it.
        let pv = pr * v_scale(th);
        let p0 = subgroupBroadcast(pv, 0u);
        let p1 = subgroupBroadcast(pv, 1u);
        let p2 = subgroupBroadcast(pv, 2u);
        let p3 = subgroupBroadcast(pv, 3u);
        let p4 = subgroupBroadcast(pv, 4u);
        let p5 = subgroupBroadcast(pv, 5u);
        let p6 = subgroupBroadcast(pv, 6u);
        let p7 = subgroupBroadcast(pv, 7u);
        let own = lid * dpl;
        let a0 = subgroupBroadcast(addr, 0u) + own;
        let a1 = subgroupBroadcast(addr, 1u) + own;
        let a2 = subgroupBroadcast(addr, 2u) + own;
        let a3 = subgroupBroadcast(addr, 3u) + own;
        let a4 = subgroupBroadcast(addr, 4u) + own;
        let a5 = subgroupBroadcast(addr, 5u) + own;
        let a6 = subgroupBroadcast(addr, 6u) + own;
        let a7 = subgroupBroadcast(addr, 7u) + own;
        for (var i = 0u; i < dpl; i += 4u) {
            acc8[i] *= corr;
            acc8[i + 1u] *= corr;
            acc8[i + 2u] *= corr;
            acc8[i + 3u] *= corr;
            vacc(i, p0, a0 + i);
            vacc(i, p1, a1 + i);
            vacc(i, p2, a2 + i);
            vacc(i, p3, a3 + i);
            vacc(i, p4, a4 + i);
            vacc(i, p5, a5 + i);
            vacc(i, p6, a6 + i);
            vacc(i, p7, a7 + i);
        }
    }
    if (n_parts() == 1u) {
        let ob = t * p.out_stride + h0 * hd + lid * dpl;
        for (var i = 0u; i < dpl; i++) {
            let o = acc8[i] / l;
            for (var g = 0u; g < nh; g++) {
                out[ob + g * hd + i] = o[g];
            }
        }
        return;
    }
    for (var g = 0u; g < nh; g++) {
        let pb = part_base(t, h0 + g, wid.z);
        for (var i = 0u; i < dpl; i++) {
            partials[pb + lid * dpl + i] = acc8[i][g];
        }
        if (lid == 0u) {
            partials[pb + hd] = m[g];
            partials[pb + hd + 1u] = l[g];
        }
    }
}
#else
// qs[d][g] = q of head h0 + g at dim d (0 for heads past the batch).
var<workgroup> qs: array<vec4<f32>, MAX_HEAD_DIM>;
var<workgroup> scores: array<vec4<f32>, WG>;
var<workgroup> probs: array<vec4<f32>, WG>;
var<workgroup> prob_sum: array<vec4<f32>, WG>;
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
    let n_keys = positions[t] + 1u;
    let seq = token_seq[t];
    let range = key_range(n_keys, wid.z, WG);
    var m = vec4<f32>(NEG);
    var l = vec4<f32>(0.0);
    var acc: array<vec4<f32>, DIMS_PER_LANE>;
    for (var start = range.x; start < range.y; start += WG) {
        let j = start + lid;
        var s = vec4<f32>(NEG);
        var addr = 0u;
        var vs = 0.0;
        var live = false;
        if (j < range.y) {
            let th = key_th(seq, j, kvh);
            if (th != 0xffffffffu) {
                live = true;
                addr = th * hd;
                vs = v_scale(th);
                var dot = vec4<f32>(0.0);
#if KV_F32
                for (var d = 0u; d < hd; d++) {
                    dot += qs[d] * k_cache[addr + d];
                }
#else
                for (var d = 0u; d < hd; d += 4u) {
                    let k = k4(addr + d);
                    dot += qs[d] * k.x + qs[d + 1u] * k.y + qs[d + 2u] * k.z + qs[d + 3u] * k.w;
                }
#endif
                s = dot * k_scale(th);
            }
        }
        scores[lid] = s;
        key_addr[lid] = addr;
        workgroupBarrier();
        let n_chunk = min(WG, range.y - start);
        // Tree max over the chunk (lanes past it and keys of other shards hold NEG).
        for (var w = WG / 2u; w > 0u; w >>= 1u) {
            if (lid < w) {
                scores[lid] = max(scores[lid], scores[lid + w]);
            }
            workgroupBarrier();
        }
        let cmax = max(m, scores[0]);
        let corr = exp(m - cmax);
        m = cmax;
        let pr = select(vec4<f32>(0.0), exp(s - m), live);
        // The row sum uses the unscaled probability; the values take it times the V scale.
        prob_sum[lid] = pr;
        probs[lid] = pr * vs;
        workgroupBarrier();
        var psum = vec4<f32>(0.0);
        for (var i = 0u; i < n_chunk; i++) {
            psum += prob_sum[i];
        }
        l = l * corr + psum;
        for (var e = 0u; e < DIMS_PER_LANE; e++) {
            let d = lid + e * WG;
            if (d < hd) {
                var a = acc[e] * corr;
                for (var i = 0u; i < n_chunk; i++) {
                    a += probs[i] * v1(key_addr[i] + d);
                }
                acc[e] = a;
            }
        }
        workgroupBarrier();
    }
    if (n_parts() == 1u) {
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
        return;
    }
    for (var g = 0u; g < nh; g++) {
        let pb = part_base(t, h0 + g, wid.z);
        for (var e = 0u; e < DIMS_PER_LANE; e++) {
            let d = lid + e * WG;
            if (d < hd) {
                partials[pb + d] = acc[e][g];
            }
        }
        if (lid == 0u) {
            partials[pb + hd] = m[g];
            partials[pb + hd + 1u] = l[g];
        }
    }
}
#endif

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
// This kernel (GPUs) uses WG invocations: each scores one key of a chunk of WG, then owns
// output dims lid, lid + WG, ... (head_dim <= 4 * WG). CPU adapters get
// attention_xbcast.wgsl.
#include "common/attention.wgsl"

// qs[d][g] = q of head h0 + g at dim d (0 for heads past the batch).
var<workgroup> qs: array<vec4<f32>, MAX_HEAD_DIM>;
var<workgroup> scores: array<vec4<f32>, WG>;
var<workgroup> probs: array<vec4<f32>, WG>;
var<workgroup> prob_sum: array<vec4<f32>, WG>;
var<workgroup> key_slot: array<u32, WG>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let hb = head_batch(wid);
    if (!hb.live) {
        return;
    }
    let t = hb.t;
    let kvh = hb.kvh;
    let h0 = hb.h0;
    let nh = hb.nh;
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
        var slot = 0u;
        var vs = 0.0;
        var live = false;
        if (j < range.y) {
            let th = key_th(seq, j, kvh);
            if (th != 0xffffffffu) {
                live = true;
                slot = th;
                vs = v_scale(th);
                var dot = vec4<f32>(0.0);
#if KV_F32
                for (var d = 0u; d < hd; d++) {
                    dot += qs[d] * k_cache[th * hd + d];
                }
#else
                let key = key_at(seq, j, th);
                for (var d = 0u; d < hd; d += 4u) {
                    let k = k4(key, d);
                    dot += qs[d] * k.x + qs[d + 1u] * k.y + qs[d + 2u] * k.z + qs[d + 3u] * k.w;
                }
#endif
                s = dot * k_scale(th);
            }
        }
        scores[lid] = s;
        key_slot[lid] = slot;
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
                    a += probs[i] * v1(key_slot[i], d);
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

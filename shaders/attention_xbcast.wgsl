// Rust dispatch: src/kernels/attention.rs; CPU reference and tests: ARCHITECTURE.md ops table (tests/kernels.rs attention_*, paged_attention_*).
// Causal grouped-query attention over the paged KV cache for CPU adapters (XBCAST: the
// workgroup is one 8-lane subgroup), the same work as attention.wgsl (whose header describes
// batches of query heads, flash-decoding splits and shards) with no workgroup memory and no
// barriers. Each lane scores its own key of a chunk of 8, getting q by subgroupBroadcast
// from the lane that loaded it; the chunk max and sum come from subgroupMax/subgroupAdd;
// for the values every lane owns head_dim / 8 adjacent dims and takes each key's
// probability and address by broadcast. On lavapipe every divergent load and every barrier
// is costly, and this touches each K and V word once per lane that needs it.
#include "common/attention.wgsl"

// Dims lid + 8 i of q (scaled) for the heads of the batch, and the output accumulators of
// dims lid * dpl + i.
var<private> qr: array<vec4<f32>, 32>;
var<private> acc8: array<vec4<f32>, 32>;

// `acc` plus a key's 8 channels (ka, kb) against q's, each held by the lane of its index
// (added one at a time, in channel order).
fn dot8(acc: vec4<f32>, q: vec4<f32>, ka: vec4<f32>, kb: vec4<f32>) -> vec4<f32> {
    var dot = acc;
    dot += subgroupBroadcast(q, 0u) * ka.x;
    dot += subgroupBroadcast(q, 1u) * ka.y;
    dot += subgroupBroadcast(q, 2u) * ka.z;
    dot += subgroupBroadcast(q, 3u) * ka.w;
    dot += subgroupBroadcast(q, 4u) * kb.x;
    dot += subgroupBroadcast(q, 5u) * kb.y;
    dot += subgroupBroadcast(q, 6u) * kb.z;
    dot += subgroupBroadcast(q, 7u) * kb.w;
    return dot;
}

// The scores of a chunk's keys (one per lane) against the batch's q heads.
fn key_dot(key: Key, dpl: u32) -> vec4<f32> {
    var dot = vec4<f32>(0.0);
    for (var i = 0u; i < dpl; i++) {
        let q = qr[i];
        let ka = k4(key, i * 8u);
        let kb = k4(key, i * 8u + 4u);
        dot = dot8(dot, q, ka, kb);
    }
    return dot;
}

#if KV_Q4
// q times each channel's d of a page, for the dims this lane holds.
var<private> qd: array<vec4<f32>, 32>;

// key_dot for a chunk whose keys all lie in one page sealed before this step (a choice
// uniform over the subgroup): sum_c q_c (n_c d_c + m_c) = sum_c (q_c d_c) n_c + sum_c q_c m_c,
// the page's scales (from `dm`, its first scale word) folded into q once per chunk instead
// of loaded for every key and channel.
fn sealed_dot(key: Key, dm: u32, lid: u32, dpl: u32) -> vec4<f32> {
    var qm = vec4<f32>(0.0);
    for (var i = 0u; i < dpl; i++) {
        let s = unpack2x16float(k_cache[dm + i * 8u + lid]);
        qd[i] = qr[i] * s.x;
        qm += qr[i] * s.y;
    }
    var dot = subgroupAdd(qm);
    for (var i = 0u; i < dpl; i++) {
        let q = qd[i];
        let w = k_cache[key.th * (p.head_dim / 8u) + i];
        let ka = nib4(w, 0u);
        let kb = nib4(w, 4u);
        dot = dot8(dot, q, ka, kb);
    }
    return dot;
}
#endif

// acc8[i..i+4] += pr * V[d..d+4] of token-head th.
fn vacc(i: u32, pr: vec4<f32>, th: u32, d: u32) {
    let v = v4(th, d);
    acc8[i] += pr * v.x;
    acc8[i + 1u] += pr * v.y;
    acc8[i + 2u] += pr * v.z;
    acc8[i + 3u] += pr * v.w;
}

@compute @workgroup_size(8)
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
        let key = key_at(seq, min(j, range.y - 1u), th);
#if KV_Q4
        // Lane 0's key is in range; a chunk whose keys are in another shard is all dead.
        let ps = p.page_size;
        let last = min(start + 7u, range.y - 1u);
        let sealed = start / ps == last / ps && (last / ps + 1u) * ps <= k_cache[step_rows_word(seq) + 1u];
        var dot: vec4<f32>;
        if (sealed) {
            dot = sealed_dot(key, subgroupBroadcast(key.dm, 0u), lid, dpl);
        } else {
            dot = key_dot(key, dpl);
        }
#else
        let dot = key_dot(key, dpl);
#endif
        let s = select(vec4<f32>(NEG), dot * k_scale(th), live);
        let cmax = max(m, subgroupMax(s));
        let corr = exp(m - cmax);
        m = cmax;
        let pr = select(vec4<f32>(0.0), exp(s - m), live);
        l = l * corr + subgroupAdd(pr);
        // Key by key: its probability (times its V scale) and token-head from the lane that
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
        let a0 = subgroupBroadcast(th, 0u);
        let a1 = subgroupBroadcast(th, 1u);
        let a2 = subgroupBroadcast(th, 2u);
        let a3 = subgroupBroadcast(th, 3u);
        let a4 = subgroupBroadcast(th, 4u);
        let a5 = subgroupBroadcast(th, 5u);
        let a6 = subgroupBroadcast(th, 6u);
        let a7 = subgroupBroadcast(th, 7u);
        for (var i = 0u; i < dpl; i += 4u) {
            acc8[i] *= corr;
            acc8[i + 1u] *= corr;
            acc8[i + 2u] *= corr;
            acc8[i + 3u] *= corr;
            vacc(i, p0, a0, own + i);
            vacc(i, p1, a1, own + i);
            vacc(i, p2, a2, own + i);
            vacc(i, p3, a3, own + i);
            vacc(i, p4, a4, own + i);
            vacc(i, p5, a5, own + i);
            vacc(i, p6, a6, own + i);
            vacc(i, p7, a7, own + i);
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

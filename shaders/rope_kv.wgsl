// Rust dispatch: src/kernels/rope_kv.rs; CPU reference and tests: ARCHITECTURE.md ops table (tests/kernels.rs rope_kv_*).
// RoPE (rotate_half layout: dimension i pairs with i + head_dim/2) on the q heads of each
// token's fused q|k|v row, in place, and the write of the token's rotated k and its v into the
// paged KV cache at its position: page = block_table[seq, pos / page_size] (or, for a
// sliding layer's window ring, seq * ring + (pos / page_size) % ring), slot pos % page_size,
// in the cache's dtype (common/kv.wgsl). cos/sin come from a host-computed table (exact like
// transformers).
//
// Invocations: one per (q head, rotation pair), then one per KV head that writes the whole
// head (so a Q8 head can find its amax and an F16 word gets both its halves from one
// invocation). With several KV shards there is one dispatch per shard: each writes only
// the tokens whose page lies in its shard, and only shard 0 rotates q.
// KV_Q4 writes V only: its K is rounded per channel over whole pages, so the rotation
// invocations rotate the k heads in place too and kv_seal.wgsl stores them after this.
#include "common/step.wgsl"

struct Params {
    n_heads: u32,
    n_kv_heads: u32,
    head_dim: u32,
    // Floats per fused q|k|v row.
    qkv_stride: u32,
    page_size: u32,
    // Entries per block-table row (pages a sequence can hold).
    max_pages: u32,
    // Positions the cos/sin table covers.
    n_positions: u32,
    pages_per_shard: u32,
    // The shard this dispatch writes.
    shard: u32,
    // KV_Q8, KV_Q4: first word of the scales in a shard buffer.
    scale_base: u32,
    // Pages of a sequence's window ring (sliding layers, kv/ring.rs): position pos of
    // sequence seq goes to page seq * ring + (pos / page_size) % ring; 0: the block table.
    ring: u32,
    // KV_Q4: first word of the open pages' f16 K (common/kv.wgsl).
    tail_base: u32,
}

#include "common/kv.wgsl"

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<uniform> p: Params;
@group(0) @binding(2) var<storage, read_write> qkv: array<f32>;    // (n_tokens, qkv_stride)
@group(0) @binding(3) var<storage, read> rope: array<f32>;         // (n_positions, head_dim): cos | sin
@group(0) @binding(4) var<storage, read> positions: array<u32>;    // (n_tokens)
@group(0) @binding(5) var<storage, read> token_seq: array<u32>;    // (n_tokens)
@group(0) @binding(6) var<storage, read> block_table: array<u32>;  // (n_seqs, max_pages)
@group(0) @binding(7) var<storage, read_write> k_cache: array<KvWord>;
@group(0) @binding(8) var<storage, read_write> v_cache: array<KvWord>;

// Element i of the rotated head whose row starts at `base`, at table row `pos`.
fn rotated(base: u32, pos: u32, i: u32) -> f32 {
    let half = p.head_dim / 2u;
    let r = pos * p.head_dim;
    if (i < half) {
        return qkv[base + i] * rope[r + i] - qkv[base + i + half] * rope[r + half + i];
    }
    let j = i - half;
    return qkv[base + i] * rope[r + j] + qkv[base + j] * rope[r + half + j];
}

#if KV_Q8
// The largest |x| of the token's rotated K head (.x) and of its V head (.y), each code's
// scale.
fn head_amax(kb: u32, vb: u32, pos: u32, hd: u32) -> vec2<f32> {
    var a = vec2<f32>(0.0);
    for (var i = 0u; i < hd; i++) {
        a = max(a, abs(vec2<f32>(rotated(kb, pos, i), qkv[vb + i])));
    }
    return a;
}

// Rotated K elements i..i+4 of a head.
fn rot4(kb: u32, pos: u32, i: u32) -> vec4<f32> {
    return vec4<f32>(rotated(kb, pos, i), rotated(kb, pos, i + 1u), rotated(kb, pos, i + 2u), rotated(kb, pos, i + 3u));
}
#endif

#if KV_F32
#elif KV_F16
#else
fn inv_or_zero(a: f32) -> f32 {
    return select(0.0, 1.0 / a, a > 0.0);
}
#endif

#if KV_Q4
// V elements i..i+4 of a head.
fn qkv4(vb: u32, i: u32) -> vec4<f32> {
    return vec4<f32>(qkv[vb + i], qkv[vb + i + 1u], qkv[vb + i + 2u], qkv[vb + i + 3u]);
}
#endif

// The heads rotated in place: q, and with KV_Q4 k (which kv_seal.wgsl rounds per page).
fn rot_heads() -> u32 {
#if KV_Q4
    return p.n_heads + p.n_kv_heads;
#else
    return p.n_heads;
#endif
}

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let t = gid.y;
    let hd = p.head_dim;
    let half = hd / 2u;
    let q_pairs = rot_heads() * half;
    let i_flat = gid.x;
    if (t >= step.n_tokens || i_flat >= q_pairs + p.n_kv_heads) {
        return;
    }
    let pos = min(positions[t], p.n_positions - 1u);
    if (i_flat < q_pairs) {
        if (p.shard != 0u) {
            return;
        }
        let head = i_flat / half;
        let i = i_flat % half;
        let c = rope[pos * hd + i];
        let s = rope[pos * hd + half + i];
        let base = t * p.qkv_stride + head * hd;
        let x1 = qkv[base + i];
        let x2 = qkv[base + i + half];
        qkv[base + i] = x1 * c - x2 * s;
        qkv[base + i + half] = x2 * c + x1 * s;
        return;
    }
    let kvh = i_flat - q_pairs;
    let page = kv_page(token_seq[t], positions[t]);
    if (page / p.pages_per_shard != p.shard) {
        return;
    }
    let th = ((page % p.pages_per_shard) * p.page_size + positions[t] % p.page_size) * p.n_kv_heads + kvh;
    let dst = th * hd;
    let kb = t * p.qkv_stride + (p.n_heads + kvh) * hd;
    let vb = t * p.qkv_stride + (p.n_heads + p.n_kv_heads + kvh) * hd;
#if KV_F32
    for (var i = 0u; i < hd; i++) {
        k_cache[dst + i] = rotated(kb, pos, i);
        v_cache[dst + i] = qkv[vb + i];
    }
#elif KV_F16
    for (var i = 0u; i < hd; i += 2u) {
        k_cache[(dst + i) >> 1u] = pack2x16float(vec2<f32>(rotated(kb, pos, i), rotated(kb, pos, i + 1u)));
        v_cache[(dst + i) >> 1u] = pack2x16float(vec2<f32>(qkv[vb + i], qkv[vb + i + 1u]));
    }
#elif KV_Q8
    let amax = head_amax(kb, vb, pos, hd);
    let inv = vec2<f32>(inv_or_zero(amax.x), inv_or_zero(amax.y));
    for (var i = 0u; i < hd; i += 4u) {
        k_cache[(dst + i) / 4u] = pack4x8snorm(rot4(kb, pos, i) * inv.x);
        v_cache[(dst + i) / 4u] = pack4x8snorm(vec4<f32>(qkv[vb + i], qkv[vb + i + 1u], qkv[vb + i + 2u], qkv[vb + i + 3u]) * inv.y);
    }
    k_cache[p.scale_base + th] = bitcast<u32>(amax.x);
    v_cache[p.scale_base + th] = bitcast<u32>(amax.y);
#else
    // KV_Q4: V, asymmetric per group of vg() elements (K: kv_seal.wgsl).
    let g = vg();
    for (var i0 = 0u; i0 < hd; i0 += g) {
        var lo = qkv[vb + i0];
        var hi = lo;
        for (var i = 1u; i < g; i++) {
            lo = min(lo, qkv[vb + i0 + i]);
            hi = max(hi, qkv[vb + i0 + i]);
        }
        let dm = q4_dm(lo, hi);
        let inv = inv_or_zero(dm.x);
        for (var i = i0; i < i0 + g; i += 8u) {
            let a = q4_code((qkv4(vb, i) - dm.y) * inv);
            let b = q4_code((qkv4(vb, i + 4u) - dm.y) * inv);
            v_cache[(dst + i) / 8u] = a.x | (a.y << 4u) | (a.z << 8u) | (a.w << 12u) | (b.x << 16u) | (b.y << 20u) | (b.z << 24u) | (b.w << 28u);
        }
        v_cache[p.scale_base + th * (hd / g) + i0 / g] = pack2x16float(dm);
    }
#endif
}

// Rust dispatch: src/kernels/rope_kv.rs (after rope_kv's dispatches); CPU oracle: kv::cache::seal_k; tests: tests/kernels.rs (rope_kv_*, kv_q4_*).
// The K of a KV_Q4 cache (common/kv.wgsl has the layout), in two passes per layer. Before
// attention (p.phase 0), after rope_kv.wgsl has rotated the step's k heads in place: every
// page the step fills is rounded per channel (4-bit codes, f16 d and m per channel of the
// page, KIVI's scales), and each sequence's first row and position in the step are
// written for attention. After attention (p.phase 1): the keys of each sequence's last two
// pages go to the f16 tail, the open page (attention reads it in later steps) and the one
// before it, so that a rollback of up to a page can reopen a page sealed in this step
// (kv::alloc tracks which pages' tails are exact). Attention reads the tail of the page
// the step starts in, so it is rewritten only after attention.
//
// One invocation per (KV head, group of 8 channels, token); the tokens of a sequence are
// consecutive rows at consecutive positions. The invocation of a sequence's first row in
// the step, or of a row that starts a page, owns that page and seals it when the step fills
// it, taking the page's earlier keys from the tail. The first row's invocation writes the
// step rows and the tail. With several KV shards there is one dispatch per shard and pass;
// each seals and writes the tails of the pages in its shard, and every one writes the step
// rows.
#include "common/step.wgsl"

struct Params {
    n_heads: u32,
    n_kv_heads: u32,
    head_dim: u32,
    // Floats per fused q|k|v row.
    qkv_stride: u32,
    page_size: u32,
    // Entries per block-table row.
    max_pages: u32,
    pages_per_shard: u32,
    // The shard this dispatch writes.
    shard: u32,
    // First word of the per-channel scales, and of the tail (common/kv.wgsl).
    scale_base: u32,
    ring: u32,
    tail_base: u32,
    // 0: seal and step rows (before attention); 1: the tail (after it).
    phase: u32,
}

#include "common/kv.wgsl"

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<uniform> p: Params;
@group(0) @binding(2) var<storage, read> qkv: array<f32>;          // (n_tokens, qkv_stride), k rotated
@group(0) @binding(3) var<storage, read> positions: array<u32>;    // (n_tokens)
@group(0) @binding(4) var<storage, read> token_seq: array<u32>;    // (n_tokens)
@group(0) @binding(5) var<storage, read> block_table: array<u32>;  // (n_seqs, max_pages)
@group(0) @binding(6) var<storage, read_write> k_cache: array<KvWord>;
// Not bound: common/kv.wgsl's V readers name it.
@group(0) @binding(7) var<storage, read> v_cache: array<KvWord>;

// Channel c of KV head kvh's rotated K at row t.
fn k_row(t: u32, kvh: u32, c: u32) -> f32 {
    return qkv[t * p.qkv_stride + (p.n_heads + kvh) * p.head_dim + c];
}

// Channel c of slot s of logical page x of sequence seq, whose slots before `a` were written
// by earlier steps (in the tail) and the rest by rows t0 + s - a of this one.
fn page_k(seq: u32, x: u32, s: u32, a: u32, t0: u32, kvh: u32, c: u32) -> f32 {
    if (s < a) {
        return unpack2x16float(k_cache[tail_word(seq, x, s, kvh) + c / 2u])[c % 2u];
    }
    return k_row(t0 + s - a, kvh, c);
}

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let t = gid.y;
    let hd = p.head_dim;
    let groups = hd / 8u;
    if (t >= step.n_tokens || gid.x >= p.n_kv_heads * groups) {
        return;
    }
    let kvh = gid.x / groups;
    let c0 = (gid.x % groups) * 8u;
    let ps = p.page_size;
    let seq = token_seq[t];
    let pos = positions[t];
    let first = t == 0u || token_seq[t - 1u] != seq;
    if (!first && pos % ps != 0u) {
        return;
    }
    let x = pos / ps;
    // Slots of the page written by earlier steps (only a first row starts mid-page), and
    // this step's rows in it: t .. t + n.
    let a = pos % ps;
    var n = 1u;
    while (a + n < ps && t + n < step.n_tokens && token_seq[t + n] == seq) {
        n++;
    }
    let page = kv_page(seq, pos);
    if (p.phase == 0u && a + n == ps && page / p.pages_per_shard == p.shard) {
        var lo: array<f32, 8>;
        var hi: array<f32, 8>;
        for (var i = 0u; i < 8u; i++) {
            lo[i] = page_k(seq, x, 0u, a, t, kvh, c0 + i);
            hi[i] = lo[i];
        }
        for (var s = 1u; s < ps; s++) {
            for (var i = 0u; i < 8u; i++) {
                let v = page_k(seq, x, s, a, t, kvh, c0 + i);
                lo[i] = min(lo[i], v);
                hi[i] = max(hi[i], v);
            }
        }
        let lp = page % p.pages_per_shard;
        var dm: array<vec2<f32>, 8>;
        for (var i = 0u; i < 8u; i++) {
            dm[i] = q4_dm(lo[i], hi[i]);
            k_cache[p.scale_base + (lp * p.n_kv_heads + kvh) * hd + c0 + i] = pack2x16float(dm[i]);
            dm[i].x = select(0.0, 1.0 / dm[i].x, dm[i].x > 0.0);
        }
        for (var s = 0u; s < ps; s++) {
            var word = 0u;
            for (var i = 0u; i < 8u; i++) {
                let v = (page_k(seq, x, s, a, t, kvh, c0 + i) - dm[i].y) * dm[i].x;
                word |= q4_code(vec4<f32>(v)).x << (4u * i);
            }
            k_cache[(((lp * ps + s) * p.n_kv_heads + kvh) * hd + c0) / 8u] = word;
        }
    }
    if (!first) {
        return;
    }
    if (p.phase == 0u) {
        if (gid.x == 0u) {
            k_cache[step_rows_word(seq)] = t;
            k_cache[step_rows_word(seq) + 1u] = pos;
        }
        return;
    }
    var e = t + n - 1u;
    while (e + 1u < step.n_tokens && token_seq[e + 1u] == seq) {
        e++;
    }
    let len = positions[e] + 1u;
    let q = (len - 1u) / ps;
    for (var y = max(x, max(q, 1u) - 1u); y <= q; y++) {
        if (kv_page(seq, y * ps) / p.pages_per_shard != p.shard) {
            continue;
        }
        let s0 = select(0u, a, y == x);
        let s1 = min(ps, len - y * ps);
        for (var s = s0; s < s1; s++) {
            let r = t + y * ps + s - pos;
            let w = tail_word(seq, y, s, kvh) + c0 / 2u;
            for (var i = 0u; i < 8u; i += 2u) {
                k_cache[w + i / 2u] = pack2x16float(vec2<f32>(k_row(r, kvh, c0 + i), k_row(r, kvh, c0 + i + 1u)));
            }
        }
    }
}

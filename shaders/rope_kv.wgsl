// RoPE (rotate_half layout: dimension i pairs with i + head_dim/2) on the q and k heads of
// each token's fused q|k|v row, then k and v are written into the paged KV cache at the
// token's position: page = block_table[seq, pos / page_size], slot = pos % page_size.
// q is rotated in place. cos/sin come from a host-computed table (exact like transformers).
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
    _pad: u32,
}

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<uniform> p: Params;
@group(0) @binding(2) var<storage, read_write> qkv: array<f32>;    // (n_tokens, qkv_stride)
@group(0) @binding(3) var<storage, read> rope: array<f32>;         // (n_positions, head_dim): cos | sin
@group(0) @binding(4) var<storage, read> positions: array<u32>;    // (n_tokens)
@group(0) @binding(5) var<storage, read> token_seq: array<u32>;    // (n_tokens)
@group(0) @binding(6) var<storage, read> block_table: array<u32>;  // (n_seqs, max_pages)
@group(0) @binding(7) var<storage, read_write> k_cache: array<f32>; // (pages, page_size, n_kv_heads, head_dim)
@group(0) @binding(8) var<storage, read_write> v_cache: array<f32>; // same

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let t = gid.y;
    let half = p.head_dim / 2u;
    let per_token = (p.n_heads + p.n_kv_heads) * half;
    let i_flat = gid.x;
    if (t >= step.n_tokens || i_flat >= per_token) {
        return;
    }
    let head = i_flat / half;
    let i = i_flat % half;
    let pos = min(positions[t], p.n_positions - 1u);
    let c = rope[pos * p.head_dim + i];
    let s = rope[pos * p.head_dim + half + i];
    let base = t * p.qkv_stride + head * p.head_dim;
    let x1 = qkv[base + i];
    let x2 = qkv[base + i + half];
    let o1 = x1 * c - x2 * s;
    let o2 = x2 * c + x1 * s;
    if (head < p.n_heads) {
        qkv[base + i] = o1;
        qkv[base + i + half] = o2;
        return;
    }
    let kvh = head - p.n_heads;
    let seq = token_seq[t];
    let page = block_table[seq * p.max_pages + pos / p.page_size];
    let slot = pos % p.page_size;
    let dst = ((page * p.page_size + slot) * p.n_kv_heads + kvh) * p.head_dim;
    k_cache[dst + i] = o1;
    k_cache[dst + i + half] = o2;
    let vb = t * p.qkv_stride + (p.n_heads + p.n_kv_heads) * p.head_dim + kvh * p.head_dim;
    v_cache[dst + i] = qkv[vb + i];
    v_cache[dst + i + half] = qkv[vb + i + half];
}

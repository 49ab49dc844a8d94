// The shared part of the paged attention kernels (attention.wgsl: GPUs, a workgroup of WG;
// attention_xbcast.wgsl: CPU adapters, one 8-lane subgroup): parameters, bindings, and the
// key ranges, parts and cache addresses both walk. See attention.wgsl for the algorithm.
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
    // KV_Q8, KV_Q4: first word of the scales in a shard buffer.
    scale_base: u32,
    // Keys a query sees, itself included (sliding-window layers); 0: every earlier key.
    window: u32,
    // Pages of a sequence's window ring (kv/ring.rs): key j of sequence `seq` is in page
    // seq * ring + (j / page_size) % ring; 0: pages come from the block table.
    ring: u32,
    // KV_Q4: first word of the open pages' f16 K (common/kv.wgsl).
    tail_base: u32,
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

// The query heads workgroup `wid` serves: token t (wid.y), KV head kvh, and the batch of
// its group's query heads h0 .. h0 + nh (at most HB; wid.x = kvh * batches + batch);
// `live` is false for workgroups past the step's tokens or the KV heads.
struct HeadBatch {
    t: u32,
    kvh: u32,
    h0: u32,
    nh: u32,
    live: bool,
}

fn head_batch(wid: vec3<u32>) -> HeadBatch {
    let group = p.n_heads / p.n_kv_heads;
    let batches = (group + HB - 1u) / HB;
    let kvh = wid.x / batches;
    let b = wid.x % batches;
    return HeadBatch(wid.y, kvh, kvh * group + b * HB, min(HB, group - b * HB), wid.y < step.n_tokens && kvh < p.n_kv_heads);
}

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

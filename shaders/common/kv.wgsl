// Storage of the paged KV cache, by KV dtype (one define of KV_F32, KV_F16, KV_Q8).
//
// A layer's K (and V) pages are spread over shards (buffers no larger than the binding
// limit); page `g` lives in shard g / pages_per_shard at local page g % pages_per_shard. In a
// shard, the head of token slot `s` of local page `lp` for KV head `h` is the "token-head"
// th = (lp * page_size + s) * n_kv_heads + h, its elements th * head_dim + i:
//   KV_F32: one f32 per element.
//   KV_F16: two f16 per u32 word (element e in half e % 2 of word e / 2), unpack2x16float.
//   KV_Q8:  four int8 codes per word (element e in byte e % 4 of word e / 4), and after the
//           codes, from word p.scale_base, one f32 per token-head: amax, the largest |x| of
//           the head; x = unpack4x8snorm(code) * amax, code = round(x / amax * 127).
// A sequence's position lives in the page the block table names, or for a sliding layer's
// window ring (p.ring pages per sequence slot, kv/ring.rs) in page
// seq * p.ring + (pos / p.page_size) % p.ring (`kv_page`).
// The including shader declares `k_cache` and `v_cache` as array<KvWord> and `block_table`,
// and has `p.scale_base`, `p.page_size`, `p.max_pages` and `p.ring`. K and V get a function each: WebGPU's WGSL cannot pass a storage buffer
// to a function (no pointer parameters in the storage address space).
// The pool page of position `pos` of sequence slot `seq`.
fn kv_page(seq: u32, pos: u32) -> u32 {
    if (p.ring != 0u) {
        return seq * p.ring + (pos / p.page_size) % p.ring;
    }
    return block_table[seq * p.max_pages + pos / p.page_size];
}

#if KV_F32
alias KvWord = f32;
#else
alias KvWord = u32;
#endif

// Four elements e..e+3 (e a multiple of 4) of K, without the Q8 scale.
fn k4(e: u32) -> vec4<f32> {
#if KV_F32
    return vec4<f32>(k_cache[e], k_cache[e + 1u], k_cache[e + 2u], k_cache[e + 3u]);
#endif
#if KV_F16
    return vec4<f32>(unpack2x16float(k_cache[e >> 1u]), unpack2x16float(k_cache[(e >> 1u) + 1u]));
#endif
#if KV_Q8
    return unpack4x8snorm(k_cache[e >> 2u]);
#endif
}

fn v4(e: u32) -> vec4<f32> {
#if KV_F32
    return vec4<f32>(v_cache[e], v_cache[e + 1u], v_cache[e + 2u], v_cache[e + 3u]);
#endif
#if KV_F16
    return vec4<f32>(unpack2x16float(v_cache[e >> 1u]), unpack2x16float(v_cache[(e >> 1u) + 1u]));
#endif
#if KV_Q8
    return unpack4x8snorm(v_cache[e >> 2u]);
#endif
}

// One element of K / V, without the Q8 scale.
fn k1(e: u32) -> f32 {
#if KV_F32
    return k_cache[e];
#endif
#if KV_F16
    return unpack2x16float(k_cache[e >> 1u])[e & 1u];
#endif
#if KV_Q8
    return unpack4x8snorm(k_cache[e >> 2u])[e & 3u];
#endif
}

fn v1(e: u32) -> f32 {
#if KV_F32
    return v_cache[e];
#endif
#if KV_F16
    return unpack2x16float(v_cache[e >> 1u])[e & 1u];
#endif
#if KV_Q8
    return unpack4x8snorm(v_cache[e >> 2u])[e & 3u];
#endif
}

// The Q8 scale of token-head `th` (1 for float dtypes).
fn k_scale(th: u32) -> f32 {
#if KV_Q8
    return bitcast<f32>(k_cache[p.scale_base + th]);
#else
    return 1.0;
#endif
}

fn v_scale(th: u32) -> f32 {
#if KV_Q8
    return bitcast<f32>(v_cache[p.scale_base + th]);
#else
    return 1.0;
#endif
}

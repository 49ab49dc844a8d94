// Storage of the paged KV cache, by KV dtype (one define of KV_F32, KV_F16, KV_Q8, KV_Q4).
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
//   KV_Q4:  eight 4-bit codes per word (element e in nibble e % 8 of word e / 8, the code
//           c in -7..7 stored as c + 8), and the same f32 amax per token-head after them;
//           x = c / 7 * amax, c = round(x / amax * 7) (half away from zero).
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

#if KV_Q4
// Elements e..e+3 (e a multiple of 4) of the word holding them, as c / 7 (the amax apart).
fn q4x4(word: u32, e: u32) -> vec4<f32> {
    let n = (vec4<u32>(word >> (4u * (e & 4u))) >> vec4<u32>(0u, 4u, 8u, 12u)) & vec4<u32>(15u);
    return (vec4<f32>(n) - 8.0) * (1.0 / 7.0);
}

fn q4x1(word: u32, e: u32) -> f32 {
    return (f32((word >> (4u * (e & 7u))) & 15u) - 8.0) * (1.0 / 7.0);
}

// The stored nibbles of four values already divided by amax: round(v * 7) half away from
// zero (as Rust's f32::round, the oracle's), plus 8.
fn q4_pack4(v: vec4<f32>) -> u32 {
    let s = clamp(v, vec4<f32>(-1.0), vec4<f32>(1.0)) * 7.0;
    let c = vec4<u32>(vec4<i32>(sign(s) * floor(abs(s) + 0.5)) + vec4<i32>(8));
    return c.x | (c.y << 4u) | (c.z << 8u) | (c.w << 12u);
}
#endif

// Four elements e..e+3 (e a multiple of 4) of K, without the Q8 / Q4 scale.
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
#if KV_Q4
    return q4x4(k_cache[e >> 3u], e);
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
#if KV_Q4
    return q4x4(v_cache[e >> 3u], e);
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
#if KV_Q4
    return q4x1(k_cache[e >> 3u], e);
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
#if KV_Q4
    return q4x1(v_cache[e >> 3u], e);
#endif
}

// The Q8 / Q4 scale of token-head `th` (1 for float dtypes).
fn k_scale(th: u32) -> f32 {
#if KV_Q8
    return bitcast<f32>(k_cache[p.scale_base + th]);
#elif KV_Q4
    return bitcast<f32>(k_cache[p.scale_base + th]);
#else
    return 1.0;
#endif
}

fn v_scale(th: u32) -> f32 {
#if KV_Q8
    return bitcast<f32>(v_cache[p.scale_base + th]);
#elif KV_Q4
    return bitcast<f32>(v_cache[p.scale_base + th]);
#else
    return 1.0;
#endif
}

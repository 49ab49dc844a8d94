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
//   KV_Q4:  eight 4-bit codes n in 0..15 per word (element e in nibble e % 8 of word e / 8),
//           dequantized as n * d + m with f16 d and m (one word: d low, m high), the scales
//           chosen as KIVI does (arXiv:2402.02750):
//           V: per group of vg() elements of each token-head, the group's words from
//              p.scale_base + th * (head_dim / vg()); written with the token (rope_kv.wgsl).
//           K: per channel over each page, one word per (local page, KV head, channel) from
//              p.scale_base: a few channels of K are large in every token, and a scale per
//              token would spend its levels on them. A page's K can only be rounded once
//              all its keys are known, so the page a sequence is still filling (its open
//              page) keeps K in f16 in the tail region of the shard that holds it, from
//              p.tail_base: per sequence slot two pages (logical page X in half X % 2),
//              each page_size x n_kv_heads heads of head_dim / 2 words. kv_seal.wgsl
//              rounds a page when a step fills it (and writes the tail after attention).
//              Attention reads a key written by the current step from the step's own
//              rotated k (qkv), an earlier key of the page the step starts in from the
//              tail, and the rest from sealed pages: every key a query sees is rounded
//              from keys at or before it (a page the step seals holds later keys).
//              Before the tail, from p.tail_base - 2 * max_seqs, two words per sequence
//              slot: the row of its first token in the current step and that token's
//              position (`step_rows`).
// A sequence's position lives in the page the block table names, or for a sliding layer's
// window ring (p.ring pages per sequence slot, kv/ring.rs) in page
// seq * p.ring + (pos / p.page_size) % p.ring (`kv_page`).
// The including shader declares `k_cache` and `v_cache` as array<KvWord>, `block_table` and
// `qkv`, and has `p.scale_base`, `p.page_size`, `p.max_pages`, `p.ring`, `p.n_heads`,
// `p.n_kv_heads`, `p.head_dim`, `p.qkv_stride`, `p.pages_per_shard` and `p.tail_base`. K and V get a function each: WebGPU's
// WGSL cannot pass a storage buffer to a function (no pointer parameters in the storage
// address space).
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

// Where one key's K head is read: its token-head `th` in this shard and, for KV_Q4, `open`:
// the first tail word of its f16 copy when its page is the one the step starts in (else
// NO_TAIL), `row`: the first qkv float of its rotated k when the step wrote it (else
// NO_TAIL), and `dm`: the first of its page's per-channel scale words.
struct Key {
    th: u32,
    open: u32,
    row: u32,
    dm: u32,
}

const NO_TAIL: u32 = 0xffffffffu;

#if KV_Q4
// The elements of a V group sharing a scale: 32, or 16 or 8 for heads not a multiple of 32.
fn vg() -> u32 {
    if (p.head_dim % 32u == 0u) {
        return 32u;
    }
    if (p.head_dim % 16u == 0u) {
        return 16u;
    }
    return 8u;
}

// Elements e..e+3 (e a multiple of 4) of the word holding them: their codes n.
fn nib4(word: u32, e: u32) -> vec4<f32> {
    return vec4<f32>((vec4<u32>(word >> (4u * (e & 4u))) >> vec4<u32>(0u, 4u, 8u, 12u)) & vec4<u32>(15u));
}

// The words of a sequence slot's step rows (first row, its position) and of the tail:
// slot `seq`, logical page `x`, page slot `s`, KV head `kvh`.
fn step_rows_word(seq: u32) -> u32 {
    return p.tail_base - 2u * (seq + 1u);
}

fn tail_word(seq: u32, x: u32, s: u32, kvh: u32) -> u32 {
    return p.tail_base + (((seq * 2u + x % 2u) * p.page_size + s) * p.n_kv_heads + kvh) * (p.head_dim / 2u);
}

// The code (0..15) of v scaled into levels (v - m) / d, half away from zero like the oracle.
fn q4_code(v: vec4<f32>) -> vec4<u32> {
    return vec4<u32>(clamp(floor(v + 0.5), vec4<f32>(0.0), vec4<f32>(15.0)));
}

// The f16 scale and minimum of values in [lo, hi] (d 0 when they are all equal), as stored:
// m = f16(lo), d = f16((hi - m) / 15).
fn q4_dm(lo: f32, hi: f32) -> vec2<f32> {
    let m = unpack2x16float(pack2x16float(vec2<f32>(lo, 0.0))).x;
    let d = unpack2x16float(pack2x16float(vec2<f32>(max(hi - m, 0.0) / 15.0, 0.0))).x;
    return vec2<f32>(d, m);
}
#endif

// Key j of sequence `seq` at token-head th: where to read its K.
fn key_at(seq: u32, j: u32, th: u32) -> Key {
#if KV_Q4
    let kvh = th % p.n_kv_heads;
    let lp = th / (p.page_size * p.n_kv_heads);
    let x = j / p.page_size;
    let first_row = k_cache[step_rows_word(seq)];
    let start = k_cache[step_rows_word(seq) + 1u];
    var open = NO_TAIL;
    var row = NO_TAIL;
    if (j >= start) {
        row = (first_row + j - start) * p.qkv_stride + (p.n_heads + kvh) * p.head_dim;
    } else if ((x + 1u) * p.page_size > start) {
        open = tail_word(seq, x, j % p.page_size, kvh);
    }
    return Key(th, open, row, p.scale_base + (lp * p.n_kv_heads + kvh) * p.head_dim);
#else
    return Key(th, NO_TAIL, NO_TAIL, 0u);
#endif
}

// Four elements d..d+3 (d a multiple of 4) of a key's K, without the Q8 scale.
fn k4(key: Key, d: u32) -> vec4<f32> {
    let e = key.th * p.head_dim + d;
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
    if (key.row != NO_TAIL) {
        return vec4<f32>(qkv[key.row + d], qkv[key.row + d + 1u], qkv[key.row + d + 2u], qkv[key.row + d + 3u]);
    }
    if (key.open != NO_TAIL) {
        let w = key.open + d / 2u;
        return vec4<f32>(unpack2x16float(k_cache[w]), unpack2x16float(k_cache[w + 1u]));
    }
    let a = unpack2x16float(k_cache[key.dm + d]);
    let b = unpack2x16float(k_cache[key.dm + d + 1u]);
    let c = unpack2x16float(k_cache[key.dm + d + 2u]);
    let f = unpack2x16float(k_cache[key.dm + d + 3u]);
    return nib4(k_cache[e >> 3u], e) * vec4<f32>(a.x, b.x, c.x, f.x) + vec4<f32>(a.y, b.y, c.y, f.y);
#endif
}

// Four elements d..d+3 of token-head th's V, without the Q8 scale.
fn v4(th: u32, d: u32) -> vec4<f32> {
    let e = th * p.head_dim + d;
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
    let dm = unpack2x16float(v_cache[p.scale_base + th * (p.head_dim / vg()) + d / vg()]);
    return nib4(v_cache[e >> 3u], e) * dm.x + dm.y;
#endif
}

// One element of token-head th's V, without the Q8 scale.
fn v1(th: u32, d: u32) -> f32 {
#if KV_F32
    return v_cache[th * p.head_dim + d];
#else
    return v4(th, d & ~3u)[d & 3u];
#endif
}

// The Q8 scale of token-head `th` (1 for the other dtypes).
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

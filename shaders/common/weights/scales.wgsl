// The group scales of the packed formats: how many words a row's scales take and how (d, m)
// of a group decode from them (32-element groups, and the super-block formats' sub-blocks).

fn scale_row_words() -> u32 {
    let sb = p.k / 256u;
#if W_SUPER
#if W_Q6K
    return 4u * sb + (sb + 1u) / 2u;
#elif W_Q2K
    return 5u * sb;
#elif W_IQ4XS
    return 2u * sb;
#else
    return 4u * sb;
#endif
#elif W_DM
    return p.k / p.group;
#else
    return (p.k / p.group + 1u) / 2u;
#endif
}

// (d, m) of a 32-element-group format from its scale word (`hi`: which f16 of the word;
// MXFP4: which half's low byte holds the E8M0 exponent e, d = 2^(e - 128)).
fn scale_of(word: u32, hi: u32) -> vec2<f32> {
#if W_MXFP4
    let e = (word >> (16u * hi)) & 0xffu;
    return vec2<f32>(ldexp(1.0, i32(e) - 128), 0.0);
#elif W_DM
    return unpack2x16float(word);
#else
    let v = unpack2x16float(word);
    let d = select(v.x, v.y, hi == 1u);
#if W_Q4S
    return vec2<f32>(d, -8.0 * d);
#else
    return vec2<f32>(d, 0.0);
#endif
#endif
}

#if W_SUPER
// Sub-blocks (groups) per 256-element super-block.
// The group size of a super-block format is fixed (src/quant QuantKind::ggml_group: 16 for
// Q6_K, Q3_K and Q2_K, 32 for the others), so this is a constant, not a per-lane division.
fn groups_per_sb() -> u32 {
#if W_Q6K
    return 16u;
#elif W_Q3K
    return 16u;
#elif W_Q2K
    return 16u;
#else
    return 8u;
#endif
}

// Byte i of four words.
fn byte_of(h: vec4<u32>, i: u32) -> u32 {
    return (pick4(h, i / 4u) >> (8u * (i % 4u))) & 0xffu;
}

// (d, m) of sub-block j of a super-block from its header `h` (the super-block's scale words:
// 4, or 2 for IQ4_XS in .xy) and `x` (Q6_K: the word holding its f16 d, in the half `xh`;
// Q2_K: its d | dmin word; unused otherwise), as src/quant/mod.rs defines them.
fn sb_scale(h: vec4<u32>, x: u32, xh: u32, j: u32) -> vec2<f32> {
#if W_Q4K
    let dm = unpack2x16float(h.x);
    let sc = sb_scale_min_k4(vec3<u32>(h.y, h.z, h.w), j);
    return vec2<f32>(dm.x * f32(sc.x), -(dm.y * f32(sc.y)));
#endif
#if W_Q5K
    let dm = unpack2x16float(h.x);
    let sc = sb_scale_min_k4(vec3<u32>(h.y, h.z, h.w), j);
    return vec2<f32>(dm.x * f32(sc.x), -(dm.y * f32(sc.y)));
#endif
#if W_Q3K
    let d = unpack2x16float(h.w).x;
    let lo = (byte_of(h, j % 8u) >> (4u * (j / 8u))) & 15u;
    let hb = (byte_of(h, 8u + j % 4u) >> (2u * (j / 4u))) & 3u;
    return vec2<f32>(d * (f32(lo | (hb << 4u)) - 32.0), 0.0);
#endif
#if W_Q6K
    let dv = unpack2x16float(x);
    let d = select(dv.x, dv.y, xh == 1u);
    let sc = f32(bitcast<i32>(byte_of(h, j) << 24u) >> 24u);
    return vec2<f32>(d * sc, 0.0);
#endif
#if W_Q2K
    let dm = unpack2x16float(x);
    let b = byte_of(h, j);
    return vec2<f32>(dm.x * f32(b & 15u), -(dm.y * f32(b >> 4u)));
#endif
#if W_IQ4XS
    let d = unpack2x16float(h.x).x;
    let ls = ((h.y >> (4u * j)) & 15u) | (((h.x >> (16u + 2u * j)) & 3u) << 4u);
    return vec2<f32>(d * (f32(ls) - 32.0), 0.0);
#endif
}

// ggml's get_scale_min_k4: the 6-bit scale and minimum of sub-block j from 12 bytes.
fn sb_scale_min_k4(q: vec3<u32>, j: u32) -> vec2<u32> {
    let h = vec4<u32>(q, 0u);
    if (j < 4u) {
        return vec2<u32>(byte_of(h, j) & 63u, byte_of(h, j + 4u) & 63u);
    }
    return vec2<u32>((byte_of(h, j + 4u) & 15u) | ((byte_of(h, j - 4u) >> 6u) << 4u),
                     (byte_of(h, j + 4u) >> 4u) | ((byte_of(h, j) >> 6u) << 4u));
}

// Words of a row's scales: where super-block sb's header starts, and the index and half of
// its extra word (Q6_K's d, Q2_K's d | dmin).
fn sb_header_index(sb: u32) -> u32 {
#if W_IQ4XS
    return 2u * sb;
#else
    return 4u * sb;
#endif
}

fn sb_extra_index(sb: u32) -> vec2<u32> {
    let nsb = p.k / 256u;
#if W_Q6K
    return vec2<u32>(4u * nsb + sb / 2u, sb & 1u);
#else
    return vec2<u32>(4u * nsb + sb, 0u);
#endif
}
#endif

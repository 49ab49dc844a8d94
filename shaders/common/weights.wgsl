// Weight loads by storage format. `w` (and `u` for gated kernels) are declared by the
// including shader: array<f32> for W_F32, array<u32> holding two f16 per word for W_F16,
// and for the packed integer formats (W_PACKED: W_Q8, W_Q4, W_Q4S) array<u32> of codes with
// the group scales in `wsc` (and `usc`), laid out as src/quant/mod.rs documents. The
// including shader's `p` has `k` (row length) and `group` (elements per scale).
#if W_F32
fn w_load(i: u32) -> f32 {
    return w[i];
}
fn w_load2(i: u32) -> vec2<f32> {
    return vec2<f32>(w[i], w[i + 1u]);
}
#if GATED
fn u_load(i: u32) -> f32 {
    return u[i];
}
fn u_load2(i: u32) -> vec2<f32> {
    return vec2<f32>(u[i], u[i + 1u]);
}
#endif
#endif
#if W_F16
fn w_load(i: u32) -> f32 {
    let v = unpack2x16float(w[i >> 1u]);
    return select(v.x, v.y, (i & 1u) == 1u);
}
// i must be even.
fn w_load2(i: u32) -> vec2<f32> {
    return unpack2x16float(w[i >> 1u]);
}
#if GATED
fn u_load(i: u32) -> f32 {
    let v = unpack2x16float(u[i >> 1u]);
    return select(v.x, v.y, (i & 1u) == 1u);
}
fn u_load2(i: u32) -> vec2<f32> {
    return unpack2x16float(u[i >> 1u]);
}
#endif
#endif
#if W_PACKED
#if W_Q8
// Elements per code word.
const EPW: u32 = 4u;
#else
const EPW: u32 = 8u;
#endif

// Index of the scale word of group `gi` of `row`, and whether its f16 is the high half.
fn scale_word(row: u32, gi: u32) -> vec2<u32> {
    let groups = p.k / p.group;
#if W_Q4
    return vec2<u32>(row * groups + gi, 0u);
#else
    return vec2<u32>(row * ((groups + 1u) / 2u) + (gi >> 1u), gi & 1u);
#endif
}

// (d, m) of a group from its scale word: values are q d + m.
fn scale_of(word: u32, hi: u32) -> vec2<f32> {
    let v = unpack2x16float(word);
#if W_Q4
    return v;
#else
    let d = select(v.x, v.y, hi == 1u);
#if W_Q4S
    return vec2<f32>(d, -8.0 * d);
#else
    return vec2<f32>(d, 0.0);
#endif
#endif
}

fn w_scale(row: u32, gi: u32) -> vec2<f32> {
    let i = scale_word(row, gi);
    return scale_of(wsc[i.x], i.y);
}
#if GATED
fn u_scale(row: u32, gi: u32) -> vec2<f32> {
    let i = scale_word(row, gi);
    return scale_of(usc[i.x], i.y);
}
#endif

// Codes of elements 0-3 of a word (Q8: the whole word; Q4: nibbles 0-3) as floats.
fn codes_lo(q: u32) -> vec4<f32> {
#if W_Q8
    return vec4<f32>(bitcast<vec4<i32>>(vec4<u32>(q) << vec4<u32>(24u, 16u, 8u, 0u)) >> vec4<u32>(24u));
#else
    return vec4<f32>((vec4<u32>(q) >> vec4<u32>(0u, 4u, 8u, 12u)) & vec4<u32>(15u));
#endif
}

// Codes of elements 4-7 of a 4-bit word.
fn codes_hi(q: u32) -> vec4<f32> {
    return vec4<f32>((vec4<u32>(q) >> vec4<u32>(16u, 20u, 24u, 28u)) & vec4<u32>(15u));
}

// Dequantized values q d + m, computed in f32 exactly as the CPU reference (q d is exact,
// so one rounding), or with F16 in half precision (packed math on GPUs; weights rounded to
// f16 like W_F16).
fn deq(c: vec4<f32>, s: vec2<f32>) -> vec4<f32> {
#if F16
    return vec4<f32>(vec4<f16>(c) * f16(s.x) + f16(s.y));
#else
    return c * s.x + s.y;
#endif
}

// Element c of `row` (one code word and one scale word read per element: for gathers).
fn w_elem(row: u32, c: u32) -> f32 {
    let q = w[row * (p.k / EPW) + c / EPW];
    let s = w_scale(row, c / p.group);
#if W_Q8
    let code = f32(bitcast<i32>(q << (24u - 8u * (c % 4u))) >> 24u);
#else
    let code = f32((q >> (4u * (c % 8u))) & 15u);
#endif
    return code * s.x + s.y;
}

// Code word `kw` of `row`, dequantized (Q8 fills only the first vec4).
fn w_deq_word(row: u32, kw: u32) -> array<vec4<f32>, 2> {
    let q = w[row * (p.k / EPW) + kw];
    let s = w_scale(row, kw * EPW / p.group);
#if W_Q8
    return array<vec4<f32>, 2>(deq(codes_lo(q), s), vec4<f32>(0.0));
#else
    return array<vec4<f32>, 2>(deq(codes_lo(q), s), deq(codes_hi(q), s));
#endif
}
#if GATED
fn u_deq_word(row: u32, kw: u32) -> array<vec4<f32>, 2> {
    let q = u[row * (p.k / EPW) + kw];
    let s = u_scale(row, kw * EPW / p.group);
#if W_Q8
    return array<vec4<f32>, 2>(deq(codes_lo(q), s), vec4<f32>(0.0));
#else
    return array<vec4<f32>, 2>(deq(codes_lo(q), s), deq(codes_hi(q), s));
#endif
}
#endif

// Eight consecutive elements of `row` from column c (a multiple of 8) as two vec4.
fn w_deq8(row: u32, c: u32) -> array<vec4<f32>, 2> {
    let s = w_scale(row, c / p.group);
    let wi = row * (p.k / EPW) + c / EPW;
#if W_Q8
    return array<vec4<f32>, 2>(deq(codes_lo(w[wi]), s), deq(codes_lo(w[wi + 1u]), s));
#else
    let q = w[wi];
    return array<vec4<f32>, 2>(deq(codes_lo(q), s), deq(codes_hi(q), s));
#endif
}
#if GATED
fn u_deq8(row: u32, c: u32) -> array<vec4<f32>, 2> {
    let s = u_scale(row, c / p.group);
    let wi = row * (p.k / EPW) + c / EPW;
#if W_Q8
    return array<vec4<f32>, 2>(deq(codes_lo(u[wi]), s), deq(codes_lo(u[wi + 1u]), s));
#else
    let q = u[wi];
    return array<vec4<f32>, 2>(deq(codes_lo(q), s), deq(codes_hi(q), s));
#endif
}
#endif
#endif

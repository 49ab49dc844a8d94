// What every kernel reads packed weights through, on either word source (words_buffer or
// words_texture): a group's scales, a step's code bits, dequantized values.

// A super-block's scale words as `sb_scale` reads them (header, extra word and its half).
struct SbHead {
    h: vec4<u32>,
    x: u32,
    xh: u32,
}

// The scale words of super-block `sb` of a row of matrix `m` whose scale words start at
// `sb0` (zeros for the formats without super-blocks).
fn sb_head(m: u32, sb0: u32, sb: u32) -> SbHead {
    var o: SbHead;
#if W_SUPER
    let hi = sb0 + sb_header_index(sb);
#if W_IQ4XS
    o.h = vec4<u32>(scale_word(m, hi), scale_word(m, hi + 1u), 0u, 0u);
#elif TEX
    // The four header words are one texel (headers start at word 4 sb of the row).
    o.h = scale_texel(m, hi >> ROW_SHIFT, (hi & ROW_WORDS_MASK) / 4u);
#else
    o.h = vec4<u32>(scale_word(m, hi), scale_word(m, hi + 1u), scale_word(m, hi + 2u), scale_word(m, hi + 3u));
#endif
    let xi = sb_extra_index(sb);
    o.xh = xi.y;
#if W_Q6K
    o.x = scale_word(m, sb0 + xi.x);
#endif
#if W_Q2K
    o.x = scale_word(m, sb0 + xi.x);
#endif
#endif
    return o;
}

// (d, m) of group gi of a row of matrix `m` whose scale words start at `sb0`.
fn scale_at(m: u32, sb0: u32, gi: u32) -> vec2<f32> {
#if W_SUPER
    let hd = sb_head(m, sb0, gi / groups_per_sb());
    return sb_scale(hd.h, hd.x, hd.xh, gi % groups_per_sb());
#elif W_DM
    return scale_of(scale_word(m, sb0 + gi), 0u);
#else
    return scale_of(scale_word(m, sb0 + (gi >> 1u)), gi & 1u);
#endif
}

// Four rows' (d, m) of group gi (rows' scale words from `sb0`), for kernels that walk
// groups in order: with super-blocks the rows' scale words are read once per super-block
// into `*hd` and decoded per group (Q6_K: five loads per row per 256 elements instead of
// per 16).
struct Scales4 {
    s0: vec2<f32>,
    s1: vec2<f32>,
    s2: vec2<f32>,
    s3: vec2<f32>,
}

struct Heads4 {
    h0: SbHead,
    h1: SbHead,
    h2: SbHead,
    h3: SbHead,
}

fn scales4(m: u32, sb0: vec4<u32>, gi: u32, hd: ptr<function, Heads4>) -> Scales4 {
#if W_SUPER
    let gps = groups_per_sb();
    let j = gi % gps;
    if (j == 0u) {
        let sb = gi / gps;
        (*hd).h0 = sb_head(m, sb0.x, sb);
        (*hd).h1 = sb_head(m, sb0.y, sb);
        (*hd).h2 = sb_head(m, sb0.z, sb);
        (*hd).h3 = sb_head(m, sb0.w, sb);
    }
    let h = *hd;
    return Scales4(sb_scale(h.h0.h, h.h0.x, h.h0.xh, j), sb_scale(h.h1.h, h.h1.x, h.h1.xh, j),
                   sb_scale(h.h2.h, h.h2.x, h.h2.xh, j), sb_scale(h.h3.h, h.h3.x, h.h3.xh, j));
#else
    return Scales4(scale_at(m, sb0.x, gi), scale_at(m, sb0.y, gi), scale_at(m, sb0.z, gi), scale_at(m, sb0.w, gi));
#endif
}

// Elements per high-plane word (0: no high plane): the span a kernel walking a row in
// order may keep one high word for.
#if W_HI1
const HI_SPAN: u32 = 32u;
#elif W_HI2
const HI_SPAN: u32 = 16u;
#else
const HI_SPAN: u32 = 0u;
#endif

// The high-plane word of step k8 of the row of matrix `m` whose code words start at `rb`.
fn hi_word(m: u32, rb: u32, k8: u32) -> u32 {
#if W_HI1
    return code_word(m, rb + hi_index(k8));
#elif W_HI2
    return code_word(m, rb + hi_index(k8));
#else
    return 0u;
#endif
}

// The code bits of step k8 from the low plane, with the step's high word `hw` given (read
// once per HI_SPAN elements by the caller).
fn step_words_hi(m: u32, rb: u32, k8: u32, hw: u32) -> vec2<u32> {
    let li = rb + lo_index(k8);
#if W_Q8
    return step_bits(code_word(m, li), code_word(m, li + 1u), 0u, k8);
#else
    return step_bits(code_word(m, li), 0u, hw, k8);
#endif
}

// The code bits of step k8 of the row of matrix `m` whose code words start at `rb`.
fn step_words(m: u32, rb: u32, k8: u32) -> vec2<u32> {
    let li = rb + lo_index(k8);
#if W_Q8
    return step_bits(code_word(m, li), code_word(m, li + 1u), 0u, k8);
#elif W_HI1
    return step_bits(code_word(m, li), 0u, code_word(m, rb + hi_index(k8)), k8);
#elif W_HI2
    return step_bits(code_word(m, li), 0u, code_word(m, rb + hi_index(k8)), k8);
#else
    return step_bits(code_word(m, li), 0u, 0u, k8);
#endif
}

fn w_scale(row: u32, gi: u32) -> vec2<f32> {
    return scale_at(0u, scale_base(row), gi);
}

fn w_q8w(rb: u32, k8: u32) -> vec2<u32> {
    return step_words(0u, rb, k8);
}

#if GATED
fn u_scale(row: u32, gi: u32) -> vec2<f32> {
    return scale_at(1u, scale_base(row), gi);
}

fn u_q8w(rb: u32, k8: u32) -> vec2<u32> {
    return step_words(1u, rb, k8);
}
#endif

// Dequantized values c d + m, computed in f32 exactly as the CPU reference (c d is exact,
// so one rounding), or with F16 in half precision (packed math on GPUs; weights rounded to
// f16 like W_F16).
fn deq(c: vec4<f32>, s: vec2<f32>) -> vec4<f32> {
#if F16
    return vec4<f32>(vec4<f16>(c) * f16(s.x) + f16(s.y));
#else
    return c * s.x + s.y;
#endif
}

// The eight dequantized elements of step k8 of `row` of matrix `m`.
fn deq8_of(m: u32, row: u32, k8: u32) -> array<vec4<f32>, 2> {
    let s = scale_at(m, scale_base(row), k8 / p.group);
    let c = codes8(step_words(m, code_base(row), k8));
    return array<vec4<f32>, 2>(deq(c[0], s), deq(c[1], s));
}

fn w_deq8(row: u32, k8: u32) -> array<vec4<f32>, 2> {
    return deq8_of(0u, row, k8);
}
#if GATED
fn u_deq8(row: u32, k8: u32) -> array<vec4<f32>, 2> {
    return deq8_of(1u, row, k8);
}
#endif

// Element c of `row` (for gathers), exactly as the CPU reference: c d + m in f32.
fn w_elem(row: u32, c: u32) -> f32 {
    let k8 = c & ~7u;
    let s = w_scale(row, c / p.group);
    let v = codes8(w_q8w(code_base(row), k8));
    return v[(c >> 2u) & 1u][c & 3u] * s.x + s.y;
}

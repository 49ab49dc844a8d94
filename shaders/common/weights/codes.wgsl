// The code planes of the packed formats (W_PACKED): where a row's codes sit, the bits of one
// 8-element step, and the codes they make (offset or IQ4 table applied).

// Component i of v by selects: CPU adapters (lavapipe) turn a vector indexed by a value
// they cannot prove uniform into a per-lane loop through memory.
fn pick4(v: vec4<u32>, i: u32) -> u32 {
    return select(select(v.x, v.y, i == 1u), select(v.z, v.w, i == 3u), i >= 2u);
}

// Elements per low-plane word.
#if W_Q8
const EPW: u32 = 4u;
#elif W_LO2
const EPW: u32 = 16u;
#else
const EPW: u32 = 8u;
#endif

// Low-plane words per row (where the high plane starts).
fn lo_words() -> u32 {
    return p.k / EPW;
}

// Words of codes per row: the low plane, then the high plane (1 bit: k / 32 words; 2 bits:
// k / 16).
fn row_words() -> u32 {
#if W_HI1
    return lo_words() + p.k / 32u;
#elif W_HI2
    return lo_words() + p.k / 16u;
#else
    return lo_words();
#endif
}

// Scale words per row.

// The code bits of elements k8 .. k8 + 8 (k8 a multiple of 8) from the low-plane word(s)
// `lo` / `lo2` (Q8: both; 2-bit: `lo` holds 16 elements) and the high-plane word `hi` that
// hold them: .x low bits, .y high bits, shifted down to bit 0.
fn step_bits(lo: u32, lo2: u32, hi: u32, k8: u32) -> vec2<u32> {
    let h = (k8 / 8u) & 3u;
#if W_Q8
    return vec2<u32>(lo, lo2);
#else
#if W_LO2
    let l = (lo >> (16u * (h & 1u))) & 0xffffu;
#else
    let l = lo;
#endif
#if W_HI1
    return vec2<u32>(l, (hi >> (8u * h)) & 0xffu);
#elif W_HI2
    return vec2<u32>(l, (hi >> (16u * (h & 1u))) & 0xffffu);
#else
    return vec2<u32>(l, 0u);
#endif
#endif
}

// Index (within a row's words) of the low-plane word holding element k8, and of the high-plane word.
fn lo_index(k8: u32) -> u32 {
    return k8 / EPW;
}

fn hi_index(k8: u32) -> u32 {
#if W_HI2
    return lo_words() + k8 / 16u;
#else
    return lo_words() + k8 / 32u;
#endif
}

#if W_TABLE
// The format's 16-entry table as signed bytes, four per word: looked up with selects and
// shifts, because CPU adapters turn an indexed constant array into a per-lane loop through
// memory (30x slower). IQ4_NL / IQ4_XS: ggml's kvalues_iq4nl (-127, -104, -83, -65, -49,
// -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113); MXFP4: the E2M1 values doubled,
// kvalues_mxfp4 (0, 1, 2, 3, 4, 6, 8, 12, then their negatives).
#if W_MXFP4
const TABLE_BYTES: vec4<u32> = vec4<u32>(0x03020100u, 0x0c080604u, 0xfdfeff00u, 0xf4f8fafcu);
#else
const TABLE_BYTES: vec4<u32> = vec4<u32>(0xbfad9881u, 0xf6eaddcfu, 0x26190d01u, 0x71594535u);
#endif

fn iq4_1(q: u32) -> f32 {
    let wd = pick4(TABLE_BYTES, q >> 2u);
    return f32(bitcast<i32>(wd << (24u - 8u * (q & 3u))) >> 24u);
}

fn iq4(q: vec4<u32>) -> vec4<f32> {
    return vec4<f32>(iq4_1(q.x), iq4_1(q.y), iq4_1(q.z), iq4_1(q.w));
}
#endif

// Codes of four elements from their raw integer codes: the offset or table applied.
fn code4(q: vec4<u32>) -> vec4<f32> {
#if W_TABLE
    return iq4(q);
#elif W_Q5S
    return vec4<f32>(q) - 16.0;
#elif W_Q6K
    return vec4<f32>(q) - 32.0;
#elif W_Q3K
    return vec4<f32>(q) - 4.0;
#elif W_S24Q8
    return vec4<f32>(bitcast<vec4<i32>>(q));
#else
    return vec4<f32>(q);
#endif
}

// The offset `code4` adds to a raw code: c = raw + CODE_OFF (0 where codes are used as they
// are: table values, signed Q8 bytes, unsigned 4-bit codes whose offset is the minimum).
#if W_Q5S
const CODE_OFF: f32 = -16.0;
#elif W_Q6K
const CODE_OFF: f32 = -32.0;
#elif W_Q3K
const CODE_OFF: f32 = -4.0;
#else
const CODE_OFF: f32 = 0.0;
#endif

// The eight raw integer codes of one step from its bits (see step_bits): elements 0-3 and
// 4-7. The one place the bit planes are unpacked; Q8 (signed bytes) does not use it.
fn raw_codes8(b: vec2<u32>) -> array<vec4<u32>, 2> {
#if W_S24
    return sparse_codes8(b);
#else
    return plane_codes8(b);
#endif
}

#if W_S24
// 2:4 sparse (src/quant/sparse.rs): the step's four kept codes (.x bits: S24Q4 four 4-bit
// codes, W_S24Q8 four bytes, sign-extended) go to the positions the high-plane bits (.y, 2
// bits each) give within elements 0-3 (kept 0 and 1) and 4-7 (kept 2 and 3); the pruned
// elements get the code of zero (S24Q4's 8, whose values are q - 8; S24Q8's 0). Selects, no
// indexing: a second kept value at the same position wins, as in the CPU oracle.
fn sparse_codes8(b: vec2<u32>) -> array<vec4<u32>, 2> {
    let at = (vec4<u32>(b.y) >> vec4<u32>(0u, 2u, 4u, 6u)) & vec4<u32>(3u);
#if W_S24Q8
    let v = bitcast<vec4<u32>>(bitcast<vec4<i32>>(vec4<u32>(b.x) << vec4<u32>(24u, 16u, 8u, 0u)) >> vec4<u32>(24u));
    let zero = vec4<u32>(0u);
#else
    let v = (vec4<u32>(b.x) >> vec4<u32>(0u, 4u, 8u, 12u)) & vec4<u32>(15u);
    let zero = vec4<u32>(8u);
#endif
    let e = vec4<u32>(0u, 1u, 2u, 3u);
    let lo = select(select(zero, vec4<u32>(v.x), e == vec4<u32>(at.x)), vec4<u32>(v.y), e == vec4<u32>(at.y));
    let hi = select(select(zero, vec4<u32>(v.z), e == vec4<u32>(at.z)), vec4<u32>(v.w), e == vec4<u32>(at.w));
    return array<vec4<u32>, 2>(lo, hi);
}
#endif

// The dense formats' eight raw codes: each element's low-plane bits with its high-plane bits
// above them.
fn plane_codes8(b: vec2<u32>) -> array<vec4<u32>, 2> {
#if W_LO2
    var lo = (vec4<u32>(b.x) >> vec4<u32>(0u, 2u, 4u, 6u)) & vec4<u32>(3u);
    var hi = (vec4<u32>(b.x) >> vec4<u32>(8u, 10u, 12u, 14u)) & vec4<u32>(3u);
#if W_HI1
    lo |= ((vec4<u32>(b.y) >> vec4<u32>(0u, 1u, 2u, 3u)) & vec4<u32>(1u)) << vec4<u32>(2u);
    hi |= ((vec4<u32>(b.y) >> vec4<u32>(4u, 5u, 6u, 7u)) & vec4<u32>(1u)) << vec4<u32>(2u);
#endif
#else
    var lo = (vec4<u32>(b.x) >> vec4<u32>(0u, 4u, 8u, 12u)) & vec4<u32>(15u);
    var hi = (vec4<u32>(b.x) >> vec4<u32>(16u, 20u, 24u, 28u)) & vec4<u32>(15u);
#if W_HI1
    lo |= ((vec4<u32>(b.y) >> vec4<u32>(0u, 1u, 2u, 3u)) & vec4<u32>(1u)) << vec4<u32>(4u);
    hi |= ((vec4<u32>(b.y) >> vec4<u32>(4u, 5u, 6u, 7u)) & vec4<u32>(1u)) << vec4<u32>(4u);
#endif
#if W_HI2
    lo |= ((vec4<u32>(b.y) >> vec4<u32>(0u, 2u, 4u, 6u)) & vec4<u32>(3u)) << vec4<u32>(4u);
    hi |= ((vec4<u32>(b.y) >> vec4<u32>(8u, 10u, 12u, 14u)) & vec4<u32>(3u)) << vec4<u32>(4u);
#endif
#endif
    return array<vec4<u32>, 2>(lo, hi);
}

// The eight codes of one step without CODE_OFF (kernels that factor the group's scale out
// of the sum fold the offset into the minimum: sum((q + o) d + m) x = d sum(q x) + (m + o d)
// sum(x)); table formats give their table values, Q8 its signed bytes, FP8 its floats.
fn raw8(b: vec2<u32>) -> array<vec4<f32>, 2> {
#if W_Q8
    return codes8(b);
#elif W_TABLE
    return codes8(b);
#else
    let r = raw_codes8(b);
    return array<vec4<f32>, 2>(vec4<f32>(bitcast<vec4<i32>>(r[0])), vec4<f32>(bitcast<vec4<i32>>(r[1])));
#endif
}

#if W_FP8
// The four FP8 E4M3 bytes of w as codes, E4M3(b) / 256 (the scale carries the 256, see
// QuantKind::Fp8): normal bytes by moving exponent and mantissa into an f32's fields with the
// exponent bias 7 + 8 -> 127, subnormal ones (exponent 0) as m 2^-17, then the sign bit.
// 0x7f / 0xff (NaN in float8_e4m3fn; refused at load) decode as +-480 / 256.
fn fp8x4(w: u32) -> vec4<f32> {
    let b = (vec4<u32>(w) >> vec4<u32>(0u, 8u, 16u, 24u)) & vec4<u32>(0xffu);
    let em = b & vec4<u32>(0x7fu);
    let normal = bitcast<vec4<f32>>((em << vec4<u32>(20u)) + vec4<u32>(0x38000000u));
    let mag = select(normal, vec4<f32>(em) * (1.0 / 131072.0), em < vec4<u32>(8u));
    return bitcast<vec4<f32>>(bitcast<vec4<u32>>(mag) | ((b & vec4<u32>(0x80u)) << vec4<u32>(24u)));
}
#endif

// The eight codes c of one step from its bits (see step_bits): elements 0-3 and 4-7.
fn codes8(b: vec2<u32>) -> array<vec4<f32>, 2> {
#if W_FP8
    return array<vec4<f32>, 2>(fp8x4(b.x), fp8x4(b.y));
#elif W_Q8
    return array<vec4<f32>, 2>(
        vec4<f32>(bitcast<vec4<i32>>(vec4<u32>(b.x) << vec4<u32>(24u, 16u, 8u, 0u)) >> vec4<u32>(24u)),
        vec4<f32>(bitcast<vec4<i32>>(vec4<u32>(b.y) << vec4<u32>(24u, 16u, 8u, 0u)) >> vec4<u32>(24u)));
#else
    let r = raw_codes8(b);
    return array<vec4<f32>, 2>(code4(r[0]), code4(r[1]));
#endif
}

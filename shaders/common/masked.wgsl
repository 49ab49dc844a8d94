// Masked decode (matvec_q_masked.wgsl): a step's eight raw codes are left
// in place as the bytes of two words, A and B, and each byte is masked out and converted
// as it stands, byte j worth code * 256^j; x' is multiplied by 256^-j to match (`xsplit`),
// so a product is still code * x' exactly (both scalings are powers of two). Per element
// that is a mask, a conversion and a multiply-add, where shifting each code down costs a
// shift more; on SwiftShader's JIT the shifts and unsigned conversions cost more than the
// products (a Q4 dequant-dot measured 0.53 GB/s with shifts, 1.07 with masks). The group
// scale and minimum are applied once per group outside: sum((q + o) d + m) x' =
// d sum(q x') + (m + o d) sum(x'), with MASK_OFF as o.
//
// Formats: Q8 (A, B: elements 0-3 and 4-7, each byte XORed with 0x80 so it is unsigned,
// offset -128), and the formats with a 4-bit low plane (A: elements 0, 2, 4, 6 from the low
// nibbles, B: 1, 3, 5, 7 from the high ones), their 1- or 2-bit high plane moved onto bits
// 4-5 of each byte by multiplies whose cross terms fall outside the mask. Not the 2-bit low
// planes (Q2_K, Q3_K) nor the IQ4 tables.

// Powers of two that undo the byte positions (byte 3 is shifted down instead: a masked top
// byte can pass i32's range).
const XSCALE: vec4<f32> = vec4<f32>(1.0, 0.00390625, 0.0000152587890625, 1.0);

#if W_Q8
const MASK_OFF: f32 = CODE_OFF - 128.0;
#else
const MASK_OFF: f32 = CODE_OFF;
#endif

// The two code words of a step (see step_bits): A and B, raw codes (plus 128 for Q8) in
// their bytes.
fn mbytes(b: vec2<u32>) -> vec2<u32> {
#if W_Q8
    return b ^ vec2<u32>(0x80808080u);
#else
    var a = b.x & 0x0f0f0f0fu;
    var c = (b.x >> 4u) & 0x0f0f0f0fu;
#if W_HI1
    // High bit of element j (bit j) onto bit 4 of its byte.
    a |= ((b.y & 0x55u) * 0x410410u) & 0x10101010u;
    c |= ((b.y & 0xaau) * 0x208208u) & 0x10101010u;
#endif
#if W_HI2
    // High bits of element j (bits 2j, 2j + 1) onto bits 4-5 of its byte, two elements per
    // multiply so that no cross term lands inside the mask.
    a |= (((b.y & 0x0303u) * 0x1010u) & 0x00300030u) | (((b.y & 0x3030u) * 0x10100u) & 0x30003000u);
    c |= (((b.y & 0x0c0cu) * 0x404u) & 0x00300030u) | (((b.y & 0xc0c0u) * 0x4040u) & 0x30003000u);
#endif
    return vec2<u32>(a, c);
#endif
}

// The step's x' (elements 0-3, 4-7) arranged and scaled for A and B.
fn xsplit(xa: vec4<f32>, xh: vec4<f32>) -> array<vec4<f32>, 2> {
#if W_Q8
    return array<vec4<f32>, 2>(xa * XSCALE, xh * XSCALE);
#else
    return array<vec4<f32>, 2>(vec4<f32>(xa.x, xa.z, xh.x, xh.z) * XSCALE, vec4<f32>(xa.y, xa.w, xh.y, xh.w) * XSCALE);
#endif
}

// The bytes of w in place, as floats.
fn mvals(w: u32) -> vec4<f32> {
    return vec4<f32>(bitcast<vec4<i32>>(vec4<u32>(w & 0xffu, w & 0xff00u, w & 0xff0000u, w >> 24u)));
}

// sum(q x') of one step: its code bits `b`, its x' from `xsplit`.
fn mdot(b: vec2<u32>, xs: array<vec4<f32>, 2>) -> f32 {
    let m = mbytes(b);
    return dot(mvals(m.x), xs[0]) + dot(mvals(m.y), xs[1]);
}

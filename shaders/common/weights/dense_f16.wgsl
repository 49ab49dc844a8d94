// f16 weights (W_F16): `w` (and `u`) are array<u32>, two f16 per word, element i in half
// i & 1 of word i / 2.
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

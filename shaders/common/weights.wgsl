// Weight loads by storage format. `w` (and `u` for gated kernels) are declared by the
// including shader: array<f32> for W_F32, array<u32> holding two f16 per word for W_F16.
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

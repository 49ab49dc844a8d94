// f32 weights (W_F32): `w` (and `u`) are array<f32>; element i is w[i].
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

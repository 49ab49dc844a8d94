// A row's 16-element units as the MULTI_ROW kernels read them (matvec_q_multi.wgsl,
// moe_matvec_multi.wgsl; packed weights, groups of 16 or more): the group's (d, m) and the
// sixteen codes decoded once, and their dot product with x' with the minimum applied once.

// One row's 16-element unit at k16 (one scale group's worth: groups are multiples of 16):
// its group's (d, m) and its sixteen codes, decoded once for every token of the step. The
// unit's high-plane word is read once for both of its steps.
struct Unit16 {
    s: vec2<f32>,
    c0: array<vec4<f32>, 2>,
    c1: array<vec4<f32>, 2>,
}

fn unit16(m: u32, row: u32, k16: u32) -> Unit16 {
    let rb = row * row_words();
    let hw = hi_word(m, rb, k16);
    return Unit16(scale_at(m, row * scale_row_words(), k16 / p.group), codes8(step_words_hi(m, rb, k16, hw)),
                  codes8(step_words_hi(m, rb, k16 + 8u, hw)));
}

// The unit's raw sum against x' of the unit (`xs`) with its sum `sx`: the minimum is applied
// once per unit (d sum(c x') + m sum(x')), not per element.
fn unit_dot(w: Unit16, xs: array<vec4<f32>, 4>, sx: f32) -> f32 {
    let cx = dot(w.c0[0], xs[0]) + dot(w.c0[1], xs[1]) + dot(w.c1[0], xs[2]) + dot(w.c1[1], xs[3]);
    return w.s.x * cx + w.s.y * sx;
}

// The high-plane words of the four rows of matrix m (0: W, 1: U) for the step at element
// k8: read at the start of each HI_SPAN elements, else the words `held` (the row is walked in
// order).
fn hi_words4(m: u32, wb: vec4<u32>, k8: u32, held: vec4<u32>) -> vec4<u32> {
    if (HI_SPAN != 0u && k8 % max(HI_SPAN, 1u) == 0u) {
        return vec4<u32>(hi_word(m, wb.x, k8), hi_word(m, wb.y, k8), hi_word(m, wb.z, k8), hi_word(m, wb.w, k8));
    }
    return held;
}

// Code and scale words of packed weights held in storage buffers (`w`/`wsc`, `u`/`usc`).
// The word index of row `row`'s first code word / scale word in `w` / `wsc` (and `u`, `usc`).
fn code_base(row: u32) -> u32 {
    return row * row_words();
}

fn scale_base(row: u32) -> u32 {
    return row * scale_row_words();
}

// Word i of the scales and of the codes of matrix `m` (0: w, 1: u with GATED): WGSL cannot
// pass storage arrays to functions, and `m` is a constant at every call, so the branch
// folds away.
fn scale_word(m: u32, i: u32) -> u32 {
#if GATED
    if (m == 1u) {
        return usc[i];
    }
#endif
    return wsc[i];
}

fn code_word(m: u32, i: u32) -> u32 {
#if GATED
    if (m == 1u) {
        return u[i];
    }
#endif
    return w[i];
}

// The rows of x a decode matvec step reads (matvec.wgsl, matvec_q_*.wgsl): with GATHER the
// step's n_out rows listed in `rows` (the logits of selected positions), else its n_tokens
// rows in order. Included after common/linear.wgsl (`step`).
#if GATHER
@group(0) @binding(8) var<storage, read> rows: array<u32>;         // (n_out) rows of x
#endif

// Rows of x (tokens) this step computes.
fn step_rows() -> u32 {
#if GATHER
    return step.n_out;
#else
    return step.n_tokens;
#endif
}

// The x row of step token t.
fn xrow_of(t: u32) -> u32 {
#if GATHER
    return rows[t];
#else
    return t;
#endif
}

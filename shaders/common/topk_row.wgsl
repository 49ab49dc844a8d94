// The layout of a top-k row (topk.wgsl writes it, sample.wgsl reads it; Rust:
// kernels::topk::{TOPK_MAX, TOPK_ROW_WORDS}): KMAX ids, best first (0xffffffff past the
// row's finite values), then their KMAX values as f32 bits, then the row's logsumexp, one pad
// word.
const KMAX: u32 = 64u;
const ROW: u32 = 2u * KMAX + 2u;

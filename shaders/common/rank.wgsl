// Ranking logits (argmax, top-k): a total order, ties broken by the lower index, so every
// adapter and the CPU sampler pick the same token.
const F32_MAX: f32 = 0x1.fffffep+127f; // not a decimal literal: Tint rejects 3.4028235e38

fn better(v: f32, i: u32, bv: f32, bi: u32) -> bool {
    return v > bv || (v == bv && i < bi);
}

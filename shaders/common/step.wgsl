// Per-step values shared by every dispatch of one forward step (written once per step).
struct Step {
    // Activation rows (tokens) in this step.
    n_tokens: u32,
    // Rows whose logits are computed (GATHER kernels).
    n_out: u32,
    // Key splits per token in attention (flash-decoding); 0 or 1 means no split.
    n_splits: u32,
    _pad1: u32,
}

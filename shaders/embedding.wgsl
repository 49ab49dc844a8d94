// Rust dispatch: src/kernels/embedding.rs; CPU reference and tests: ARCHITECTURE.md ops table (tests/kernels.rs embedding_*).
// Embedding gather: y[t, :] = table[ids[t], :] * scale for the ids that fall in this chunk
// of rows (packed tables are dequantized element by element, exactly as the CPU reference;
// scale is 1 except for models that scale their embedding, e.g. Gemma's sqrt(hidden)).
#include "common/step.wgsl"

struct Params {
    // Row width (hidden size).
    k: u32,
    // First vocabulary row held by this chunk of the table.
    row_offset: u32,
    // Rows in this chunk.
    n_rows: u32,
    // Elements per scale of packed tables (W_PACKED).
    group: u32,
    // Multiplies every gathered value (1.0: exact copy).
    scale: f32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<uniform> p: Params;
@group(0) @binding(2) var<storage, read> ids: array<u32>;          // (n_tokens)
#if W_F32
@group(0) @binding(3) var<storage, read> w: array<f32>;            // (n_rows, k)
#elif TEX
// Packed codes and scales as tiled textures (common/weights.wgsl, TEX).
@group(0) @binding(11) var wtex: texture_2d<u32>;
@group(0) @binding(12) var wstex: texture_2d<u32>;
#else
@group(0) @binding(3) var<storage, read> w: array<u32>;            // (n_rows, k) f16 pairs or codes
#endif
#if W_PACKED
#ifndef TEX
@group(0) @binding(5) var<storage, read> wsc: array<u32>;          // group scales
#endif
#endif
@group(0) @binding(4) var<storage, read_write> y: array<f32>;      // (n_tokens, k)

#include "common/weights.wgsl"

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let t = gid.y;
    let c = gid.x;
    if (t >= step.n_tokens || c >= p.k) {
        return;
    }
    let id = ids[t];
    if (id < p.row_offset || id >= p.row_offset + p.n_rows) {
        return;
    }
#if W_PACKED
    y[t * p.k + c] = w_elem(id - p.row_offset, c) * p.scale;
#else
    y[t * p.k + c] = w_load((id - p.row_offset) * p.k + c) * p.scale;
#endif
}

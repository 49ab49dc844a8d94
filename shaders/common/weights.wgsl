// Weight loads by storage format. `w` (and `u` for gated kernels) are declared by the
// including shader: array<f32> for W_F32, array<u32> holding two f16 per word for W_F16,
// and for the packed integer formats (W_PACKED) array<u32> of code planes with the group
// scales in `wsc` (and `usc`), laid out as src/quant/mod.rs documents. The including
// shader's `p` has `k` (row length) and `group` (elements per scale).
//
// Packed formats share one interface, so every kernel serves every format: the kernels
// walk a row in steps of 8 elements; `w_q8w` loads the step's code bits as a vec2<u32>
// (.x: the low-plane bits, .y: the high-plane bits, each shifted down to bit 0; Q8: the two
// words), `codes8` turns them into the eight codes c (raw code plus the format's offset, or
// its IQ4 table value), `w_scale` gives the group's (d, m) and `deq` computes c d + m. The
// pure pieces (codes8, the scale decoders) are what the texture kernel shares; only loads
// differ per binding (w / u / textures).
//
// With TEX (CPU adapters with 8-lane subgroups) packed weights live in rgba32uint textures
// instead of storage buffers: `wtex` / `wstex` (and `utex` / `ustex`), declared by the
// including shader, in tiles of TILE rows (src/gpu/buffer.rs `TiledTensor`): texel i of row
// r at linear index (r / TILE) * TILE * tpr + i * TILE + r % TILE (tpr: the row's texels, its
// words padded to whole texels), linear index l at (l % TEXW, l / TEXW). A workgroup of the
// tiled matvec computes one tile (8 lanes x 4 rows), so each of its texel fetches reads one
// contiguous run of the texture. `code_word` / `scale_word` read through the same
// addressing, so every kernel walking words serves texture-held weights unchanged.
//
// One file per concern: the dense formats' loads (dense_f32, dense_f16), and for the packed
// formats the code planes (codes: the one place bit planes are unpacked), the scales
// (scales), where words come from (words_buffer or, with TEX, words_texture) and the
// interface kernels use (packed).
#if W_F32
#include "common/weights/dense_f32.wgsl"
#elif W_F16
#include "common/weights/dense_f16.wgsl"
#elif W_PACKED
#include "common/weights/codes.wgsl"
#include "common/weights/scales.wgsl"
#if TEX
#include "common/weights/words_texture.wgsl"
#else
#include "common/weights/words_buffer.wgsl"
#endif
#include "common/weights/packed.wgsl"
#endif

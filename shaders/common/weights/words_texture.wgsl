// Code and scale words of packed weights held in tiled rgba32uint textures (TEX): the
// addressing `weights.wgsl`'s header describes.
// Rows per tile (src/gpu/buffer.rs TILE_ROWS) and texels per texture row (TEX_WIDTH).
const TILE: u32 = 32u;
const TEXW: u32 = 512u;

// Texel i of row `row` of a tiled texture whose rows hold `tpr` texels each.
fn tile_texel(t: texture_2d<u32>, row: u32, i: u32, tpr: u32) -> vec4<u32> {
    let l = (row / TILE) * TILE * tpr + i * TILE + row % TILE;
    return textureLoad(t, vec2<u32>(l % TEXW, l / TEXW), 0);
}

// Texels per row of the codes and of the scales.
fn code_texels() -> u32 {
    return (row_words() + 3u) / 4u;
}

fn scale_texels() -> u32 {
    return (scale_row_words() + 3u) / 4u;
}

// Texel i of row `row` of the codes / scales of matrix `m` (0: w, 1: u with GATED).
fn code_texel(m: u32, row: u32, i: u32) -> vec4<u32> {
#if GATED
    if (m == 1u) {
        return tile_texel(utex, row, i, code_texels());
    }
#endif
    return tile_texel(wtex, row, i, code_texels());
}

fn scale_texel(m: u32, row: u32, i: u32) -> vec4<u32> {
#if GATED
    if (m == 1u) {
        return tile_texel(ustex, row, i, scale_texels());
    }
#endif
    return tile_texel(wstex, row, i, scale_texels());
}

// Word i of the scales and of the codes of matrix `m`, i = code_base(row) + word (or
// scale_base): one texel fetch per word, for kernels that walk words.
fn scale_word(m: u32, i: u32) -> u32 {
    let wi = i & ROW_WORDS_MASK;
    return pick4(scale_texel(m, i >> ROW_SHIFT, wi / 4u), wi % 4u);
}

fn code_word(m: u32, i: u32) -> u32 {
    let wi = i & ROW_WORDS_MASK;
    return pick4(code_texel(m, i >> ROW_SHIFT, wi / 4u), wi % 4u);
}

// Elements of a row one texel of its low code plane holds (four words): kernels walking a
// row in order fetch each row's texels once per chunk of at most this many elements and of
// at most one scale group (`chunk_tex`), and pick the words of each step from them
// (`chunk_step`). A chunk's high-plane bits are in one word (one bit: 32 elements, two
// bits: 16, and a chunk of a Q6_K row is one group of 16).
const CHUNK_SPAN: u32 = 4u * EPW;

// The code texels of the chunk at element k0 of the row of matrix `m` whose code words
// start at `rb`: its low plane's and, for formats with one, its high plane's.
struct ChunkTex {
    lo: vec4<u32>,
#if W_HI
    hi: vec4<u32>,
#endif
}

fn chunk_tex(m: u32, rb: u32, k0: u32) -> ChunkTex {
    let row = rb >> ROW_SHIFT;
    var c: ChunkTex;
    c.lo = code_texel(m, row, lo_index(k0) / 4u);
#if W_HI
    c.hi = code_texel(m, row, hi_index(k0) / 4u);
#endif
    return c;
}

// The code bits of step k8 of a chunk, as `step_words` reads them from words.
fn chunk_step(c: ChunkTex, k8: u32) -> vec2<u32> {
    let li = lo_index(k8) & 3u;
#if W_Q8
    return step_bits(pick4(c.lo, li), pick4(c.lo, li + 1u), 0u, k8);
#elif W_HI
    return step_bits(pick4(c.lo, li), 0u, pick4(c.hi, hi_index(k8) & 3u), k8);
#else
    return step_bits(pick4(c.lo, li), 0u, 0u, k8);
#endif
}

// Word indices of texture-held weights: row << ROW_SHIFT | word, so that code_word splits
// them with a shift instead of a division by the row's words (a per-lane scalar loop on CPU
// adapters). Rows of at most 32768 words, chunks of at most 131072 rows
// (`kernels::linear::tiled_fits`, `TiledTensor::split`).
const ROW_SHIFT: u32 = 15u;
const ROW_WORDS_MASK: u32 = 32767u;

fn code_base(row: u32) -> u32 {
    return row << ROW_SHIFT;
}

fn scale_base(row: u32) -> u32 {
    return row << ROW_SHIFT;
}

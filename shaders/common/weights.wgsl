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
#if W_F32
fn w_load(i: u32) -> f32 {
    return w[i];
}
fn w_load2(i: u32) -> vec2<f32> {
    return vec2<f32>(w[i], w[i + 1u]);
}
#if GATED
fn u_load(i: u32) -> f32 {
    return u[i];
}
fn u_load2(i: u32) -> vec2<f32> {
    return vec2<f32>(u[i], u[i + 1u]);
}
#endif
#endif
#if W_F16
fn w_load(i: u32) -> f32 {
    let v = unpack2x16float(w[i >> 1u]);
    return select(v.x, v.y, (i & 1u) == 1u);
}
// i must be even.
fn w_load2(i: u32) -> vec2<f32> {
    return unpack2x16float(w[i >> 1u]);
}
#if GATED
fn u_load(i: u32) -> f32 {
    let v = unpack2x16float(u[i >> 1u]);
    return select(v.x, v.y, (i & 1u) == 1u);
}
fn u_load2(i: u32) -> vec2<f32> {
    return unpack2x16float(u[i >> 1u]);
}
#endif
#endif
#if W_PACKED
// Component i of v by selects: CPU adapters (lavapipe) turn a vector indexed by a value
// they cannot prove uniform into a per-lane loop through memory.
fn pick4(v: vec4<u32>, i: u32) -> u32 {
    return select(select(v.x, v.y, i == 1u), select(v.z, v.w, i == 3u), i >= 2u);
}

// Elements per low-plane word.
#if W_Q8
const EPW: u32 = 4u;
#elif W_LO2
const EPW: u32 = 16u;
#else
const EPW: u32 = 8u;
#endif

// Low-plane words per row (where the high plane starts).
fn lo_words() -> u32 {
    return p.k / EPW;
}

// Words of codes per row: the low plane, then the high plane (1 bit: k / 32 words; 2 bits:
// k / 16).
fn row_words() -> u32 {
#if W_HI1
    return lo_words() + p.k / 32u;
#elif W_HI2
    return lo_words() + p.k / 16u;
#else
    return lo_words();
#endif
}

// Scale words per row.
fn scale_row_words() -> u32 {
    let sb = p.k / 256u;
#if W_SUPER
#if W_Q6K
    return 4u * sb + (sb + 1u) / 2u;
#elif W_Q2K
    return 5u * sb;
#elif W_IQ4XS
    return 2u * sb;
#else
    return 4u * sb;
#endif
#elif W_Q4
    return p.k / p.group;
#elif W_Q5
    return p.k / p.group;
#else
    return (p.k / p.group + 1u) / 2u;
#endif
}

// The code bits of elements k8 .. k8 + 8 (k8 a multiple of 8) from the low-plane word(s)
// `lo` / `lo2` (Q8: both; 2-bit: `lo` holds 16 elements) and the high-plane word `hi` that
// hold them: .x low bits, .y high bits, shifted down to bit 0.
fn step_bits(lo: u32, lo2: u32, hi: u32, k8: u32) -> vec2<u32> {
    let h = (k8 / 8u) & 3u;
#if W_Q8
    return vec2<u32>(lo, lo2);
#else
#if W_LO2
    let l = (lo >> (16u * (h & 1u))) & 0xffffu;
#else
    let l = lo;
#endif
#if W_HI1
    return vec2<u32>(l, (hi >> (8u * h)) & 0xffu);
#elif W_HI2
    return vec2<u32>(l, (hi >> (16u * (h & 1u))) & 0xffffu);
#else
    return vec2<u32>(l, 0u);
#endif
#endif
}

// Index (within a row's words) of the low-plane word holding element k8, and of the high-plane word.
fn lo_index(k8: u32) -> u32 {
    return k8 / EPW;
}

fn hi_index(k8: u32) -> u32 {
#if W_HI2
    return lo_words() + k8 / 16u;
#else
    return lo_words() + k8 / 32u;
#endif
}

#if W_TABLE
// ggml's kvalues_iq4nl (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69,
// 89, 113) as signed bytes, four per word: looked up with selects and shifts, because CPU
// adapters turn an indexed constant array into a per-lane loop through memory (30x slower).
const IQ4_BYTES: vec4<u32> = vec4<u32>(0xbfad9881u, 0xf6eaddcfu, 0x26190d01u, 0x71594535u);

fn iq4_1(q: u32) -> f32 {
    let wd = pick4(IQ4_BYTES, q >> 2u);
    return f32(bitcast<i32>(wd << (24u - 8u * (q & 3u))) >> 24u);
}

fn iq4(q: vec4<u32>) -> vec4<f32> {
    return vec4<f32>(iq4_1(q.x), iq4_1(q.y), iq4_1(q.z), iq4_1(q.w));
}
#endif

// Codes of four elements from their raw integer codes: the offset or table applied.
fn code4(q: vec4<u32>) -> vec4<f32> {
#if W_TABLE
    return iq4(q);
#elif W_Q5S
    return vec4<f32>(q) - 16.0;
#elif W_Q6K
    return vec4<f32>(q) - 32.0;
#elif W_Q3K
    return vec4<f32>(q) - 4.0;
#else
    return vec4<f32>(q);
#endif
}

// The offset `code4` adds to a raw code: c = raw + CODE_OFF (0 where codes are used as they
// are: table values, signed Q8 bytes, unsigned 4-bit codes whose offset is the minimum).
#if W_Q5S
const CODE_OFF: f32 = -16.0;
#elif W_Q6K
const CODE_OFF: f32 = -32.0;
#elif W_Q3K
const CODE_OFF: f32 = -4.0;
#else
const CODE_OFF: f32 = 0.0;
#endif

// The eight codes of one step without CODE_OFF (kernels that factor the group's scale out
// of the sum fold the offset into the minimum: sum((q + o) d + m) x = d sum(q x) + (m + o d)
// sum(x)); table formats give their table values, Q8 its signed bytes.
fn raw8(b: vec2<u32>) -> array<vec4<f32>, 2> {
#if W_Q8
    return codes8(b);
#elif W_TABLE
    return codes8(b);
#else
#if W_LO2
    var lo = (vec4<u32>(b.x) >> vec4<u32>(0u, 2u, 4u, 6u)) & vec4<u32>(3u);
    var hi = (vec4<u32>(b.x) >> vec4<u32>(8u, 10u, 12u, 14u)) & vec4<u32>(3u);
#if W_HI1
    lo |= ((vec4<u32>(b.y) >> vec4<u32>(0u, 1u, 2u, 3u)) & vec4<u32>(1u)) << vec4<u32>(2u);
    hi |= ((vec4<u32>(b.y) >> vec4<u32>(4u, 5u, 6u, 7u)) & vec4<u32>(1u)) << vec4<u32>(2u);
#endif
#else
    var lo = (vec4<u32>(b.x) >> vec4<u32>(0u, 4u, 8u, 12u)) & vec4<u32>(15u);
    var hi = (vec4<u32>(b.x) >> vec4<u32>(16u, 20u, 24u, 28u)) & vec4<u32>(15u);
#if W_HI1
    lo |= ((vec4<u32>(b.y) >> vec4<u32>(0u, 1u, 2u, 3u)) & vec4<u32>(1u)) << vec4<u32>(4u);
    hi |= ((vec4<u32>(b.y) >> vec4<u32>(4u, 5u, 6u, 7u)) & vec4<u32>(1u)) << vec4<u32>(4u);
#endif
#if W_HI2
    lo |= ((vec4<u32>(b.y) >> vec4<u32>(0u, 2u, 4u, 6u)) & vec4<u32>(3u)) << vec4<u32>(4u);
    hi |= ((vec4<u32>(b.y) >> vec4<u32>(8u, 10u, 12u, 14u)) & vec4<u32>(3u)) << vec4<u32>(4u);
#endif
#endif
    return array<vec4<f32>, 2>(vec4<f32>(bitcast<vec4<i32>>(lo)), vec4<f32>(bitcast<vec4<i32>>(hi)));
#endif
}

// The eight codes c of one step from its bits (see step_bits): elements 0-3 and 4-7.
fn codes8(b: vec2<u32>) -> array<vec4<f32>, 2> {
#if W_Q8
    return array<vec4<f32>, 2>(
        vec4<f32>(bitcast<vec4<i32>>(vec4<u32>(b.x) << vec4<u32>(24u, 16u, 8u, 0u)) >> vec4<u32>(24u)),
        vec4<f32>(bitcast<vec4<i32>>(vec4<u32>(b.y) << vec4<u32>(24u, 16u, 8u, 0u)) >> vec4<u32>(24u)));
#else
#if W_LO2
    var lo = (vec4<u32>(b.x) >> vec4<u32>(0u, 2u, 4u, 6u)) & vec4<u32>(3u);
    var hi = (vec4<u32>(b.x) >> vec4<u32>(8u, 10u, 12u, 14u)) & vec4<u32>(3u);
#if W_HI1
    lo |= ((vec4<u32>(b.y) >> vec4<u32>(0u, 1u, 2u, 3u)) & vec4<u32>(1u)) << vec4<u32>(2u);
    hi |= ((vec4<u32>(b.y) >> vec4<u32>(4u, 5u, 6u, 7u)) & vec4<u32>(1u)) << vec4<u32>(2u);
#endif
#else
    var lo = (vec4<u32>(b.x) >> vec4<u32>(0u, 4u, 8u, 12u)) & vec4<u32>(15u);
    var hi = (vec4<u32>(b.x) >> vec4<u32>(16u, 20u, 24u, 28u)) & vec4<u32>(15u);
#if W_HI1
    lo |= ((vec4<u32>(b.y) >> vec4<u32>(0u, 1u, 2u, 3u)) & vec4<u32>(1u)) << vec4<u32>(4u);
    hi |= ((vec4<u32>(b.y) >> vec4<u32>(4u, 5u, 6u, 7u)) & vec4<u32>(1u)) << vec4<u32>(4u);
#endif
#if W_HI2
    lo |= ((vec4<u32>(b.y) >> vec4<u32>(0u, 2u, 4u, 6u)) & vec4<u32>(3u)) << vec4<u32>(4u);
    hi |= ((vec4<u32>(b.y) >> vec4<u32>(8u, 10u, 12u, 14u)) & vec4<u32>(3u)) << vec4<u32>(4u);
#endif
#endif
    return array<vec4<f32>, 2>(code4(lo), code4(hi));
#endif
}

// (d, m) of a 32-element-group format from its scale word (`hi`: which f16 of the word).
fn scale_of(word: u32, hi: u32) -> vec2<f32> {
    let v = unpack2x16float(word);
#if W_Q4
    return v;
#elif W_Q5
    return v;
#else
    let d = select(v.x, v.y, hi == 1u);
#if W_Q4S
    return vec2<f32>(d, -8.0 * d);
#else
    return vec2<f32>(d, 0.0);
#endif
#endif
}

#if W_SUPER
// Sub-blocks (groups) per 256-element super-block.
// The group size of a super-block format is fixed (src/quant QuantKind::ggml_group: 16 for
// Q6_K, Q3_K and Q2_K, 32 for the others), so this is a constant, not a per-lane division.
fn groups_per_sb() -> u32 {
#if W_Q6K
    return 16u;
#elif W_Q3K
    return 16u;
#elif W_Q2K
    return 16u;
#else
    return 8u;
#endif
}

// Byte i of four words.
fn byte_of(h: vec4<u32>, i: u32) -> u32 {
    return (pick4(h, i / 4u) >> (8u * (i % 4u))) & 0xffu;
}

// (d, m) of sub-block j of a super-block from its header `h` (the super-block's scale words:
// 4, or 2 for IQ4_XS in .xy) and `x` (Q6_K: the word holding its f16 d, in the half `xh`;
// Q2_K: its d | dmin word; unused otherwise), as src/quant/mod.rs defines them.
fn sb_scale(h: vec4<u32>, x: u32, xh: u32, j: u32) -> vec2<f32> {
#if W_Q4K
    let dm = unpack2x16float(h.x);
    let sc = sb_scale_min_k4(vec3<u32>(h.y, h.z, h.w), j);
    return vec2<f32>(dm.x * f32(sc.x), -(dm.y * f32(sc.y)));
#endif
#if W_Q5K
    let dm = unpack2x16float(h.x);
    let sc = sb_scale_min_k4(vec3<u32>(h.y, h.z, h.w), j);
    return vec2<f32>(dm.x * f32(sc.x), -(dm.y * f32(sc.y)));
#endif
#if W_Q3K
    let d = unpack2x16float(h.w).x;
    let lo = (byte_of(h, j % 8u) >> (4u * (j / 8u))) & 15u;
    let hb = (byte_of(h, 8u + j % 4u) >> (2u * (j / 4u))) & 3u;
    return vec2<f32>(d * (f32(lo | (hb << 4u)) - 32.0), 0.0);
#endif
#if W_Q6K
    let dv = unpack2x16float(x);
    let d = select(dv.x, dv.y, xh == 1u);
    let sc = f32(bitcast<i32>(byte_of(h, j) << 24u) >> 24u);
    return vec2<f32>(d * sc, 0.0);
#endif
#if W_Q2K
    let dm = unpack2x16float(x);
    let b = byte_of(h, j);
    return vec2<f32>(dm.x * f32(b & 15u), -(dm.y * f32(b >> 4u)));
#endif
#if W_IQ4XS
    let d = unpack2x16float(h.x).x;
    let ls = ((h.y >> (4u * j)) & 15u) | (((h.x >> (16u + 2u * j)) & 3u) << 4u);
    return vec2<f32>(d * (f32(ls) - 32.0), 0.0);
#endif
}

// ggml's get_scale_min_k4: the 6-bit scale and minimum of sub-block j from 12 bytes.
fn sb_scale_min_k4(q: vec3<u32>, j: u32) -> vec2<u32> {
    let h = vec4<u32>(q, 0u);
    if (j < 4u) {
        return vec2<u32>(byte_of(h, j) & 63u, byte_of(h, j + 4u) & 63u);
    }
    return vec2<u32>((byte_of(h, j + 4u) & 15u) | ((byte_of(h, j - 4u) >> 6u) << 4u),
                     (byte_of(h, j + 4u) >> 4u) | ((byte_of(h, j) >> 6u) << 4u));
}

// Words of a row's scales: where super-block sb's header starts, and the index and half of
// its extra word (Q6_K's d, Q2_K's d | dmin).
fn sb_header_index(sb: u32) -> u32 {
#if W_IQ4XS
    return 2u * sb;
#else
    return 4u * sb;
#endif
}

fn sb_extra_index(sb: u32) -> vec2<u32> {
    let nsb = p.k / 256u;
#if W_Q6K
    return vec2<u32>(4u * nsb + sb / 2u, sb & 1u);
#else
    return vec2<u32>(4u * nsb + sb, 0u);
#endif
}
#endif

#if TEX
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
#else
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
#endif

// A super-block's scale words as `sb_scale` reads them (header, extra word and its half).
struct SbHead {
    h: vec4<u32>,
    x: u32,
    xh: u32,
}

// The scale words of super-block `sb` of a row of matrix `m` whose scale words start at
// `sb0` (zeros for the formats without super-blocks).
fn sb_head(m: u32, sb0: u32, sb: u32) -> SbHead {
    var o: SbHead;
#if W_SUPER
    let hi = sb0 + sb_header_index(sb);
#if W_IQ4XS
    o.h = vec4<u32>(scale_word(m, hi), scale_word(m, hi + 1u), 0u, 0u);
#elif TEX
    // The four header words are one texel (headers start at word 4 sb of the row).
    o.h = scale_texel(m, hi >> ROW_SHIFT, (hi & ROW_WORDS_MASK) / 4u);
#else
    o.h = vec4<u32>(scale_word(m, hi), scale_word(m, hi + 1u), scale_word(m, hi + 2u), scale_word(m, hi + 3u));
#endif
    let xi = sb_extra_index(sb);
    o.xh = xi.y;
#if W_Q6K
    o.x = scale_word(m, sb0 + xi.x);
#endif
#if W_Q2K
    o.x = scale_word(m, sb0 + xi.x);
#endif
#endif
    return o;
}

// (d, m) of group gi of a row of matrix `m` whose scale words start at `sb0`.
fn scale_at(m: u32, sb0: u32, gi: u32) -> vec2<f32> {
#if W_SUPER
    let hd = sb_head(m, sb0, gi / groups_per_sb());
    return sb_scale(hd.h, hd.x, hd.xh, gi % groups_per_sb());
#elif W_Q4
    return scale_of(scale_word(m, sb0 + gi), 0u);
#elif W_Q5
    return scale_of(scale_word(m, sb0 + gi), 0u);
#else
    return scale_of(scale_word(m, sb0 + (gi >> 1u)), gi & 1u);
#endif
}

// Four rows' (d, m) of group gi (rows' scale words from `sb0`), for kernels that walk
// groups in order: with super-blocks the rows' scale words are read once per super-block
// into `*hd` and decoded per group (Q6_K: five loads per row per 256 elements instead of
// per 16).
struct Scales4 {
    s0: vec2<f32>,
    s1: vec2<f32>,
    s2: vec2<f32>,
    s3: vec2<f32>,
}

struct Heads4 {
    h0: SbHead,
    h1: SbHead,
    h2: SbHead,
    h3: SbHead,
}

fn scales4(m: u32, sb0: vec4<u32>, gi: u32, hd: ptr<function, Heads4>) -> Scales4 {
#if W_SUPER
    let gps = groups_per_sb();
    let j = gi % gps;
    if (j == 0u) {
        let sb = gi / gps;
        (*hd).h0 = sb_head(m, sb0.x, sb);
        (*hd).h1 = sb_head(m, sb0.y, sb);
        (*hd).h2 = sb_head(m, sb0.z, sb);
        (*hd).h3 = sb_head(m, sb0.w, sb);
    }
    let h = *hd;
    return Scales4(sb_scale(h.h0.h, h.h0.x, h.h0.xh, j), sb_scale(h.h1.h, h.h1.x, h.h1.xh, j),
                   sb_scale(h.h2.h, h.h2.x, h.h2.xh, j), sb_scale(h.h3.h, h.h3.x, h.h3.xh, j));
#else
    return Scales4(scale_at(m, sb0.x, gi), scale_at(m, sb0.y, gi), scale_at(m, sb0.z, gi), scale_at(m, sb0.w, gi));
#endif
}

// Elements per high-plane word (0: no high plane): the span a kernel walking a row in
// order may keep one high word for.
#if W_HI1
const HI_SPAN: u32 = 32u;
#elif W_HI2
const HI_SPAN: u32 = 16u;
#else
const HI_SPAN: u32 = 0u;
#endif

// The high-plane word of step k8 of the row of matrix `m` whose code words start at `rb`.
fn hi_word(m: u32, rb: u32, k8: u32) -> u32 {
#if W_HI1
    return code_word(m, rb + hi_index(k8));
#elif W_HI2
    return code_word(m, rb + hi_index(k8));
#else
    return 0u;
#endif
}

// The code bits of step k8 from the low plane, with the step's high word `hw` given (read
// once per HI_SPAN elements by the caller).
fn step_words_hi(m: u32, rb: u32, k8: u32, hw: u32) -> vec2<u32> {
    let li = rb + lo_index(k8);
#if W_Q8
    return step_bits(code_word(m, li), code_word(m, li + 1u), 0u, k8);
#else
    return step_bits(code_word(m, li), 0u, hw, k8);
#endif
}

// The code bits of step k8 of the row of matrix `m` whose code words start at `rb`.
fn step_words(m: u32, rb: u32, k8: u32) -> vec2<u32> {
    let li = rb + lo_index(k8);
#if W_Q8
    return step_bits(code_word(m, li), code_word(m, li + 1u), 0u, k8);
#elif W_HI1
    return step_bits(code_word(m, li), 0u, code_word(m, rb + hi_index(k8)), k8);
#elif W_HI2
    return step_bits(code_word(m, li), 0u, code_word(m, rb + hi_index(k8)), k8);
#else
    return step_bits(code_word(m, li), 0u, 0u, k8);
#endif
}

fn w_scale(row: u32, gi: u32) -> vec2<f32> {
    return scale_at(0u, scale_base(row), gi);
}

fn w_q8w(rb: u32, k8: u32) -> vec2<u32> {
    return step_words(0u, rb, k8);
}

#if GATED
fn u_scale(row: u32, gi: u32) -> vec2<f32> {
    return scale_at(1u, scale_base(row), gi);
}

fn u_q8w(rb: u32, k8: u32) -> vec2<u32> {
    return step_words(1u, rb, k8);
}
#endif

// Dequantized values c d + m, computed in f32 exactly as the CPU reference (c d is exact,
// so one rounding), or with F16 in half precision (packed math on GPUs; weights rounded to
// f16 like W_F16).
fn deq(c: vec4<f32>, s: vec2<f32>) -> vec4<f32> {
#if F16
    return vec4<f32>(vec4<f16>(c) * f16(s.x) + f16(s.y));
#else
    return c * s.x + s.y;
#endif
}

// The eight dequantized elements of step k8 of `row` of matrix `m`.
fn deq8_of(m: u32, row: u32, k8: u32) -> array<vec4<f32>, 2> {
    let s = scale_at(m, scale_base(row), k8 / p.group);
    let c = codes8(step_words(m, code_base(row), k8));
    return array<vec4<f32>, 2>(deq(c[0], s), deq(c[1], s));
}

fn w_deq8(row: u32, k8: u32) -> array<vec4<f32>, 2> {
    return deq8_of(0u, row, k8);
}
#if GATED
fn u_deq8(row: u32, k8: u32) -> array<vec4<f32>, 2> {
    return deq8_of(1u, row, k8);
}
#endif

// Element c of `row` (for gathers), exactly as the CPU reference: c d + m in f32.
fn w_elem(row: u32, c: u32) -> f32 {
    let k8 = c & ~7u;
    let s = w_scale(row, c / p.group);
    let v = codes8(w_q8w(code_base(row), k8));
    return v[(c >> 2u) & 1u][c & 3u] * s.x + s.y;
}
#endif

// The packed blocked matmuls' weights held in textures (TEX; common/blocked_q.wgsl): the
// code texels of the current chunk, fetched once per chunk and picked from for each step.

// Four rows' code texels of the current chunk (common/weights.wgsl's ChunkTex).
struct Tex4 {
    c0: ChunkTex,
    c1: ChunkTex,
    c2: ChunkTex,
    c3: ChunkTex,
}

var<private> ca: Tex4;
var<private> cb: Tex4;
#if GATED
var<private> cua: Tex4;
var<private> cub: Tex4;
#endif

fn tex4(m: u32, r: vec4<u32>, kc: u32) -> Tex4 {
    return Tex4(chunk_tex(m, r.x, kc), chunk_tex(m, r.y, kc), chunk_tex(m, r.z, kc), chunk_tex(m, r.w, kc));
}

// The chunk texels of row set `i` (see set_vals).
fn tex_set(i: u32) -> Tex4 {
    var t = ca;
#if BLOCK_N8
    if (i == 1u) {
        t = cb;
    }
#endif
#if GATED
    if (i == 2u) {
        t = cua;
    }
#if BLOCK_N8
    if (i == 3u) {
        t = cub;
    }
#endif
#endif
    return t;
}

// Every row set's texels of the chunk at element kc.
fn load_chunks(kc: u32) {
    ca = tex4(0u, wa, kc);
#if BLOCK_N8
    cb = tex4(0u, wb, kc);
#endif
#if GATED
    cua = tex4(1u, wa, kc);
#if BLOCK_N8
    cub = tex4(1u, wb, kc);
#endif
#endif
}

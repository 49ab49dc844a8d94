// Rust dispatch: src/kernels/linear/ (tiled_key); CPU reference and tests: ARCHITECTURE.md ops table (tests/kernels.rs packed_linear_*, ggml_*).
// y[t, row_offset + n] = epilogue(sum_k W[n, k] * x'[t, k]) over packed integer weights (every
// W_PACKED format; layout in src/quant/mod.rs): every code word is read once and dequantized
// in registers with its group's scale, never written back. The fused prologue/epilogues are
// common/linear.wgsl's (NORM, GATED, BIAS, RESIDUAL) and GATHER's gathered rows
// (common/gather.wgsl). The decode matvec's layouts, one file each: matvec_q_rows4.wgsl (CPU
// adapters, storage buffers), matvec_q_tiled.wgsl (CPU adapters with 8-lane subgroups,
// tiled textures), matvec_q_masked.wgsl (SwiftShader), matvec_q_multi.wgsl (GPUs) and
// matvec_q_wg.wgsl (GPUs, groups of 8).
//
// This file: TEX (CPU adapters with 8-lane subgroups, the default there): the weights are
// tiled rgba32uint textures (common/weights.wgsl), a workgroup computes a 32-row tile from
// 16-byte texel fetches, x' is gathered from a uniform window with XU (see rows_tiled); TOK4
// computes four tokens per pass (batched steps), TOK8 eight (speculative verify steps of 5-8
// tokens: one pass over the weights; TOK8 defines TOK4 too, its tokens 4-7 are added under
// #if TOK8).
#include "common/linear.wgsl"
#include "common/gather.wgsl"
#if TOK8
// Tokens per invocation: every texel fetched and decoded serves eight tokens.
const TT: u32 = 8u;
#elif TOK4
// Tokens per invocation: every texel fetched and decoded serves four tokens.
const TT: u32 = 4u;
#else
const TT: u32 = 1u;
#endif
#include "common/matvec_end.wgsl"

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    rows_tiled(wid.z * TT, step_rows(), wid, lid);
}

// Code texels of one row for the 32-element unit `un`: .lo the low-plane texel (Q8: two, in
// lo and lo2; 2-bit planes: the texel holding it), .hi the high-plane texel.
struct Unit {
    lo: vec4<u32>,
    lo2: vec4<u32>,
    hi: vec4<u32>,
}

// The high-plane texel of unit un (0 without a high plane). Units sharing one (4 with a 1-bit
// plane, 2 with a 2-bit one) each fetch it: holding it across units took a second loop level,
// which measured slower on lavapipe (Q6_K 4.15 -> 3.39 GB/s, Q5_0 3.79 -> 3.66).
fn tex_hi(m: u32, row: u32, un: u32) -> vec4<u32> {
#if W_HI1
    return code_texel(m, row, lo_words() / 4u + un / 4u);
#elif W_HI2
    return code_texel(m, row, lo_words() / 4u + un / 2u);
#else
    return vec4<u32>(0u);
#endif
}

fn tex_unit(m: u32, row: u32, un: u32, hi: vec4<u32>) -> Unit {
    var o: Unit;
    o.hi = hi;
#if W_Q8
    o.lo = code_texel(m, row, 2u * un);
    o.lo2 = code_texel(m, row, 2u * un + 1u);
#elif W_LO2
    o.lo = code_texel(m, row, un / 2u);
#else
    o.lo = code_texel(m, row, un);
#endif
    return o;
}

// The code bits of step h (0-3) of unit `un` from its texels.
fn unit_bits(o: Unit, un: u32, h: u32) -> vec2<u32> {
    let k8 = un * 32u + h * 8u;
#if W_Q8
    let lw = select(o.lo, o.lo2, h >= 2u);
    return step_bits(pick4(lw, (h & 1u) * 2u), pick4(lw, (h & 1u) * 2u + 1u), 0u, k8);
#else
#if W_LO2
    let l = pick4(o.lo, (un & 1u) * 2u + h / 2u);
#else
    let l = pick4(o.lo, h);
#endif
#if W_HI1
    let hw = pick4(o.hi, un & 3u);
#elif W_HI2
    let hw = pick4(o.hi, (un & 1u) * 2u + h / 2u);
#else
    let hw = 0u;
#endif
    return step_bits(l, 0u, hw, k8);
#endif
}

// The scale texels of one row that unit `un` needs: .a the texel holding its group's scale
// word (super-block formats: its super-block's header), .x the extra word (Q6_K's d word,
// Q2_K's d | dmin). Every unit of one `scale_key` shares them.
struct UnitScale {
    a: vec4<u32>,
    x: u32,
}

// log2 of the units (32 elements) per scale group: groups of the tiled formats are
// powers of two of at least 32 elements (`kernels::linear::tiled_fits`), or a super-block
// format's fixed 16 or 32 (0 here: a unit holds one or two whole groups). Shifts, because a
// division by a runtime value is a per-lane scalar loop on CPU adapters.
fn unit_group_shift() -> u32 {
#if W_SUPER
    return 0u;
#else
    return firstTrailingBit(p.group) - 5u;
#endif
}

// Which scale texels unit `un` reads: its super-block, or the texel index of its group's
// scale word (groups of 32 elements or more: one group per unit).
fn scale_key(un: u32, gsh: u32) -> u32 {
#if W_SUPER
    return un / 8u;
#else
    let gi = un >> gsh;
#if W_DM
    return gi / 4u;
#else
    return gi / 8u;
#endif
#endif
}

// Units per scale key (the units sharing one set of scale texels).
fn units_per_key(gsh: u32) -> u32 {
#if W_SUPER
    return 8u;
#elif W_DM
    return 4u << gsh;
#else
    return 8u << gsh;
#endif
}

fn tex_scale_words(m: u32, row: u32, key: u32) -> UnitScale {
    var o: UnitScale;
#if W_SUPER
#if W_IQ4XS
    o.a = scale_texel(m, row, key / 2u);
#else
    o.a = scale_texel(m, row, key);
#endif
    // The extra words start at texel nsb (4 words per super-block before them).
    let nsb = p.k / 256u;
#if W_Q6K
    o.x = pick4(scale_texel(m, row, nsb + key / 8u), (key / 2u) & 3u);
#endif
#if W_Q2K
    o.x = pick4(scale_texel(m, row, nsb + key / 4u), key & 3u);
#endif
#else
    o.a = scale_texel(m, row, key);
#endif
    return o;
}

// (d, m') of the group holding element `e` (0, or 16 for the second group of a G16 unit) of
// unit `un`, with the code offset folded into the minimum: m' = m + CODE_OFF d (see raw8).
fn unit_scale(o: UnitScale, un: u32, e: u32, gsh: u32) -> vec2<f32> {
#if W_SUPER
    // Groups of 32 (one per unit) or 16 (two).
    let gi = select(un, 2u * un + e / 16u, G16);
    let s = un / 8u;
#if W_IQ4XS
    let hd = select(o.a.xy, o.a.zw, (s & 1u) == 1u);
    let hv = vec4<u32>(hd, 0u, 0u);
#else
    let hv = o.a;
#endif
    let dm = sb_scale(hv, o.x, s & 1u, gi % groups_per_sb());
#else
    let gi = un >> gsh;
#if W_DM
    let dm = scale_of(pick4(o.a, gi & 3u), 0u);
#else
    let dm = scale_of(pick4(o.a, (gi / 2u) & 3u), gi & 1u);
#endif
#endif
    return vec2<f32>(dm.x, dm.y + CODE_OFF * dm.x);
}

// Groups of 16 elements (Q6_K, Q3_K, Q2_K): a unit holds two groups, each with its scale.
#if W_Q6K
const G16: bool = true;
#elif W_Q3K
const G16: bool = true;
#elif W_Q2K
const G16: bool = true;
#else
const G16: bool = false;
#endif

// One token's x' over a unit as every lane needs it: v[2h] elements 8h .. 8h + 3 and
// v[2h + 1] elements 8h + 4 .. 8h + 7 (each lane loaded elements 4 lid .. 4 lid + 3 and
// subgroupBroadcast hands them out), sa the sum of the first group's elements (G16: 0-15;
// else all 32), sb of the second (G16: 16-31).
struct XUnit {
    v: array<vec4<f32>, 8>,
    sa: f32,
    sb: f32,
}

fn x_unit(xq: vec4<f32>, lid: u32) -> XUnit {
    var o: XUnit;
    // (subgroupBroadcast takes a constant lane.)
    o.v[0] = vec4<f32>(subgroupBroadcast(xq.x, 0u), subgroupBroadcast(xq.y, 0u), subgroupBroadcast(xq.z, 0u), subgroupBroadcast(xq.w, 0u));
    o.v[1] = vec4<f32>(subgroupBroadcast(xq.x, 1u), subgroupBroadcast(xq.y, 1u), subgroupBroadcast(xq.z, 1u), subgroupBroadcast(xq.w, 1u));
    o.v[2] = vec4<f32>(subgroupBroadcast(xq.x, 2u), subgroupBroadcast(xq.y, 2u), subgroupBroadcast(xq.z, 2u), subgroupBroadcast(xq.w, 2u));
    o.v[3] = vec4<f32>(subgroupBroadcast(xq.x, 3u), subgroupBroadcast(xq.y, 3u), subgroupBroadcast(xq.z, 3u), subgroupBroadcast(xq.w, 3u));
    o.v[4] = vec4<f32>(subgroupBroadcast(xq.x, 4u), subgroupBroadcast(xq.y, 4u), subgroupBroadcast(xq.z, 4u), subgroupBroadcast(xq.w, 4u));
    o.v[5] = vec4<f32>(subgroupBroadcast(xq.x, 5u), subgroupBroadcast(xq.y, 5u), subgroupBroadcast(xq.z, 5u), subgroupBroadcast(xq.w, 5u));
    o.v[6] = vec4<f32>(subgroupBroadcast(xq.x, 6u), subgroupBroadcast(xq.y, 6u), subgroupBroadcast(xq.z, 6u), subgroupBroadcast(xq.w, 6u));
    o.v[7] = vec4<f32>(subgroupBroadcast(xq.x, 7u), subgroupBroadcast(xq.y, 7u), subgroupBroadcast(xq.z, 7u), subgroupBroadcast(xq.w, 7u));
    let sl = xq.x + xq.y + xq.z + xq.w;
    if (G16) {
        o.sa = subgroupAdd(select(0.0, sl, lid < 4u));
        o.sb = subgroupAdd(select(sl, 0.0, lid < 4u));
    } else {
        o.sa = subgroupAdd(sl);
        o.sb = 0.0;
    }
    return o;
}

// This lane's four elements 4 lid .. 4 lid + 3 of unit `un` of the x row starting at vec4
// `xb4`: from the uniform window when the whole row lies in it (`in_win`), else from storage;
// with NORM scaled by the norm weight, their squares added to `*ss`.
fn x_lane4(xb4: u32, un: u32, lid: u32, in_win: bool, ss: ptr<function, f32>) -> vec4<f32> {
    let i = un * 8u + lid;
#if XU
    var v: vec4<f32>;
    if (in_win) {
        v = xu[xb4 + i];
    } else {
        v = x[xb4 + i];
    }
#if NORM
    *ss += dot(v, v);
    v = v * gu[i];
#endif
    return v;
#else
    return load_x4(xb4, i, ss);
#endif
}

// The x' of every token of the step over one unit (TOK4: four, TOK8: eight; named, not an array:
// lavapipe turns a private array indexed by a loop counter it does not unroll into a
// per-lane loop through memory).
struct XTok {
    t0: XUnit,
#if TOK4
    t1: XUnit,
    t2: XUnit,
    t3: XUnit,
#endif
#if TOK8
    t4: XUnit,
    t5: XUnit,
    t6: XUnit,
    t7: XUnit,
#endif
}

// Where each token's x row starts (vec4 index) and whether it lies in the uniform window.
// (TOK8: b and win for tokens 0-3, b2 and win2 for tokens 4-7.)
struct XRows {
    b: vec4<u32>,
    win: vec4<bool>,
#if TOK8
    b2: vec4<u32>,
    win2: vec4<bool>,
#endif
}

// Per token (w, u) sums of one row (.x: w, .y: u), or the rows' accumulators.
struct Acc {
    t0: vec2<f32>,
#if TOK4
    t1: vec2<f32>,
    t2: vec2<f32>,
    t3: vec2<f32>,
#endif
#if TOK8
    t4: vec2<f32>,
    t5: vec2<f32>,
    t6: vec2<f32>,
    t7: vec2<f32>,
#endif
}

fn acc_add(a: Acc, b: Acc) -> Acc {
    var o = a;
    o.t0 += b.t0;
#if TOK4
    o.t1 += b.t1;
    o.t2 += b.t2;
    o.t3 += b.t3;
#endif
#if TOK8
    o.t4 += b.t4;
    o.t5 += b.t5;
    o.t6 += b.t6;
    o.t7 += b.t7;
#endif
    return o;
}

// The eight raw codes of each of a unit's four steps (see raw8).
struct Codes32 {
    c0: array<vec4<f32>, 2>,
    c1: array<vec4<f32>, 2>,
    c2: array<vec4<f32>, 2>,
    c3: array<vec4<f32>, 2>,
}

fn codes32(o: Unit, un: u32) -> Codes32 {
    return Codes32(raw8(unit_bits(o, un, 0u)), raw8(unit_bits(o, un, 1u)), raw8(unit_bits(o, un, 2u)), raw8(unit_bits(o, un, 3u)));
}

// One row's product with one token's x' over a unit: d sum(q x') + m' sum(x') per group (s0:
// the first group's (d, m'), s1 the second's with G16), the codes against the broadcast x'
// as four independent fma chains.
fn unit_dot(c: Codes32, x: XUnit, s0: vec2<f32>, s1: vec2<f32>) -> f32 {
    let a = fma(c.c1[1], x.v[3], fma(c.c1[0], x.v[2], fma(c.c0[1], x.v[1], c.c0[0] * x.v[0])));
    let b = fma(c.c3[1], x.v[7], fma(c.c3[0], x.v[6], fma(c.c2[1], x.v[5], c.c2[0] * x.v[4])));
    if (G16) {
        return s0.x * dot(a, vec4<f32>(1.0)) + s0.y * x.sa + s1.x * dot(b, vec4<f32>(1.0)) + s1.y * x.sb;
    }
    return s0.x * dot(a + b, vec4<f32>(1.0)) + s0.y * x.sa;
}

// One row's products over a unit for tokens 0-3 (.a) and 4-7 (.b, TOK8).
struct Dots {
    a: vec4<f32>,
    b: vec4<f32>,
}

// Matrix m's row `row` over unit `un` for every token: its code texels fetched and decoded
// once, its group scales from the scale texels `sc`.
fn row_unit(m: u32, row: u32, un: u32, sc: UnitScale, gsh: u32, xs: XTok) -> Dots {
    let c = codes32(tex_unit(m, row, un, tex_hi(m, row, un)), un);
    let s0 = unit_scale(sc, un, 0u, gsh);
    let s1 = unit_scale(sc, un, 16u, gsh);
    var o = Dots(vec4<f32>(unit_dot(c, xs.t0, s0, s1), 0.0, 0.0, 0.0), vec4<f32>(0.0));
#if TOK4
    o.a.y = unit_dot(c, xs.t1, s0, s1);
    o.a.z = unit_dot(c, xs.t2, s0, s1);
    o.a.w = unit_dot(c, xs.t3, s0, s1);
#endif
#if TOK8
    o.b = vec4<f32>(unit_dot(c, xs.t4, s0, s1), unit_dot(c, xs.t5, s0, s1), unit_dot(c, xs.t6, s0, s1), unit_dot(c, xs.t7, s0, s1));
#endif
    return o;
}

// Row `row`'s (w, u) over unit `un` for every token.
fn row_acc(row: u32, un: u32, sw: UnitScale, su: UnitScale, gsh: u32, xs: XTok) -> Acc {
    let w = row_unit(0u, row, un, sw, gsh, xs);
#if GATED
    let u = row_unit(1u, row, un, su, gsh, xs);
#else
    let u = Dots(vec4<f32>(0.0), vec4<f32>(0.0));
#endif
    var o: Acc;
    o.t0 = vec2<f32>(w.a.x, u.a.x);
#if TOK4
    o.t1 = vec2<f32>(w.a.y, u.a.y);
    o.t2 = vec2<f32>(w.a.z, u.a.z);
    o.t3 = vec2<f32>(w.a.w, u.a.w);
#endif
#if TOK8
    o.t4 = vec2<f32>(w.b.x, u.b.x);
    o.t5 = vec2<f32>(w.b.y, u.b.y);
    o.t6 = vec2<f32>(w.b.z, u.b.z);
    o.t7 = vec2<f32>(w.b.w, u.b.w);
#endif
    return o;
}

// Token j's x' over unit `un` (its squares added to ss[j] with NORM).
fn x_tok(r: XRows, j: u32, un: u32, lid: u32, ss: ptr<function, f32>) -> XUnit {
    return x_unit(x_lane4(r.b[j], un, lid, r.win[j], ss), lid);
}
#if TOK8

// Token 4 + j's x' over unit `un`.
fn x_tok2(r: XRows, j: u32, un: u32, lid: u32, ss: ptr<function, f32>) -> XUnit {
    return x_unit(x_lane4(r.b2[j], un, lid, r.win2[j], ss), lid);
}
#endif

// The epilogue of one row for every token that exists (`s`: tokens 0-3's sums of squares,
// `s2` tokens 4-7's).
fn finish_row(t0: u32, n_tok: u32, row: u32, a: Acc, s: vec4<f32>, s2: vec4<f32>) {
    if (row >= p.n_rows) {
        return;
    }
    finish(t0, row, vec3<f32>(a.t0, s.x));
#if TOK4
    if (t0 + 1u < n_tok) {
        finish(t0 + 1u, row, vec3<f32>(a.t1, s.y));
    }
    if (t0 + 2u < n_tok) {
        finish(t0 + 2u, row, vec3<f32>(a.t2, s.z));
    }
    if (t0 + 3u < n_tok) {
        finish(t0 + 3u, row, vec3<f32>(a.t3, s.w));
    }
#endif
#if TOK8
    if (t0 + 4u < n_tok) {
        finish(t0 + 4u, row, vec3<f32>(a.t4, s2.x));
    }
    if (t0 + 5u < n_tok) {
        finish(t0 + 5u, row, vec3<f32>(a.t5, s2.y));
    }
    if (t0 + 6u < n_tok) {
        finish(t0 + 6u, row, vec3<f32>(a.t6, s2.z));
    }
    if (t0 + 7u < n_tok) {
        finish(t0 + 7u, row, vec3<f32>(a.t7, s2.w));
    }
#endif
}

// Tiled texture-held weights (TEX): the workgroup computes one tile of 32 rows, lane lid the
// rows lid, lid + 8, lid + 16, lid + 24 of it, for tokens t0 .. t0 + TT - 1 (TOK4: 4, TOK8: 8). Per
// 32-element unit each lane loads four elements of each token's x' (one uniform gather with
// XU) and the subgroup hands them out; each row's code texels are fetched and decoded once
// for every token and multiplied with four independent fma chains; the group's scale is
// applied once per group (d sum(q x') + m' sum(x')). Scale texels are fetched once per
// scale key (a super-block, or 4-8 groups). Rows past n_rows read the tile's zero padding
// and are not stored; tokens past n_tok read the last one and are not stored. Rows and
// tokens are named values throughout (see XTok).
fn rows_tiled(t0: u32, n_tok: u32, wid: vec3<u32>, lid: u32) {
    if (t0 >= n_tok) {
        return;
    }
    let row0 = (wid.y * p.grid_x + wid.x) * TILE + lid;
    let tl = n_tok - 1u;
    let xr = vec4<u32>(xrow_of(t0), xrow_of(min(t0 + 1u, tl)), xrow_of(min(t0 + 2u, tl)), xrow_of(min(t0 + 3u, tl)));
    let xb = xr * (p.x_stride / 4u);
#if TOK8
    let xr2 = vec4<u32>(xrow_of(min(t0 + 4u, tl)), xrow_of(min(t0 + 5u, tl)), xrow_of(min(t0 + 6u, tl)), xrow_of(min(t0 + 7u, tl)));
    let xb2 = xr2 * (p.x_stride / 4u);
    let xrows = XRows(xb, xb + vec4<u32>(p.k / 4u) <= vec4<u32>(4096u), xb2, xb2 + vec4<u32>(p.k / 4u) <= vec4<u32>(4096u));
#else
    let xrows = XRows(xb, xb + vec4<u32>(p.k / 4u) <= vec4<u32>(4096u));
#endif
    var a0: Acc;
    var a1: Acc;
    var a2: Acc;
    var a3: Acc;
    var ss0 = 0.0;
    var ss1 = 0.0;
    var ss2 = 0.0;
    var ss3 = 0.0;
    var ss4 = 0.0;
    var ss5 = 0.0;
    var ss6 = 0.0;
    var ss7 = 0.0;
    let units = p.k / 32u;
    let gsh = unit_group_shift();
    let upk = units_per_key(gsh);
    for (var un0 = 0u; un0 < units; un0 += upk) {
        let key = scale_key(un0, gsh);
        let end = min(un0 + upk, units);
        let sw0 = tex_scale_words(0u, row0, key);
        let sw1 = tex_scale_words(0u, row0 + 8u, key);
        let sw2 = tex_scale_words(0u, row0 + 16u, key);
        let sw3 = tex_scale_words(0u, row0 + 24u, key);
#if GATED
        let su0 = tex_scale_words(1u, row0, key);
        let su1 = tex_scale_words(1u, row0 + 8u, key);
        let su2 = tex_scale_words(1u, row0 + 16u, key);
        let su3 = tex_scale_words(1u, row0 + 24u, key);
#else
        // (Unused: the ungated kernel reads no up weight.)
        let su0 = sw0;
        let su1 = sw1;
        let su2 = sw2;
        let su3 = sw3;
#endif
        for (var un = un0; un < end; un++) {
            var xs: XTok;
            xs.t0 = x_tok(xrows, 0u, un, lid, &ss0);
#if TOK4
            xs.t1 = x_tok(xrows, 1u, un, lid, &ss1);
            xs.t2 = x_tok(xrows, 2u, un, lid, &ss2);
            xs.t3 = x_tok(xrows, 3u, un, lid, &ss3);
#endif
#if TOK8
            xs.t4 = x_tok2(xrows, 0u, un, lid, &ss4);
            xs.t5 = x_tok2(xrows, 1u, un, lid, &ss5);
            xs.t6 = x_tok2(xrows, 2u, un, lid, &ss6);
            xs.t7 = x_tok2(xrows, 3u, un, lid, &ss7);
#endif
            a0 = acc_add(a0, row_acc(row0, un, sw0, su0, gsh, xs));
            a1 = acc_add(a1, row_acc(row0 + 8u, un, sw1, su1, gsh, xs));
            a2 = acc_add(a2, row_acc(row0 + 16u, un, sw2, su2, gsh, xs));
            a3 = acc_add(a3, row_acc(row0 + 24u, un, sw3, su3, gsh, xs));
        }
    }
    // Each lane summed the squares of its own elements.
    let s = vec4<f32>(subgroupAdd(ss0), subgroupAdd(ss1), subgroupAdd(ss2), subgroupAdd(ss3));
    let s2 = vec4<f32>(subgroupAdd(ss4), subgroupAdd(ss5), subgroupAdd(ss6), subgroupAdd(ss7));
    finish_row(t0, n_tok, row0, a0, s, s2);
    finish_row(t0, n_tok, row0 + 8u, a1, s, s2);
    finish_row(t0, n_tok, row0 + 16u, a2, s, s2);
    finish_row(t0, n_tok, row0 + 24u, a3, s, s2);
}

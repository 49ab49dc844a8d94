// The end of a matvec (matvec.wgsl, matvec_q_*.wgsl): `finish` applies the epilogue to one
// row's raw sums; with ROW_PER_WORKGROUP every invocation of the workgroup holds partial sums
// (w.x, u.x, sum of squares) of one output row, which `reduce_row` adds (subgroupAdd then one
// partial per subgroup with SUBGROUPS, else a tree in workgroup memory) before invocation 0
// finishes the row; with MULTI_ROW `reduce_rows` does the same for the workgroup's rows.

// Apply the epilogue to the raw sums (w.x, u.x, sum of squares) and store.
fn finish(t: u32, row: u32, acc: vec3<f32>) {
#if NORM
    store_out(t, row, acc.x, acc.y, inv_rms(acc.z));
#else
    store_out(t, row, acc.x, acc.y, 1.0);
#endif
}

#if ROW_PER_WORKGROUP
var<workgroup> red: array<vec3<f32>, WG>;

// `sg_lane` and `sg_size` are the subgroup builtins with SUBGROUPS (ignored otherwise).
fn reduce_row(t: u32, row: u32, acc_in: vec3<f32>, lid: u32, sg_lane: u32, sg_size: u32) {
#if SUBGROUPS
    let acc = subgroupAdd(acc_in);
    if (sg_lane == 0u) {
        red[lid / sg_size] = acc;
    }
    workgroupBarrier();
    if (lid == 0u) {
        var total = vec3<f32>(0.0);
        // Partials of every subgroup (a subgroup wider than the workgroup gives one).
        for (var i = 0u; i < (WG + sg_size - 1u) / sg_size; i++) {
            total += red[i];
        }
        finish(t, row, total);
    }
#else
    red[lid] = acc_in;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride = stride / 2u) {
        if (lid < stride) {
            red[lid] += red[lid + stride];
        }
        workgroupBarrier();
    }
    if (lid == 0u) {
        finish(t, row, red[0]);
    }
#endif
}
#endif

#if MULTI_ROW
// Rows per workgroup of the MULTI_ROW matvec (llama.cpp's K-quant matvec takes 2 on most
// GPUs): each x' load serves this many rows. Tokens per workgroup: matvec_q_multi.wgsl's TT (4
// with TOK4, 8 with TOK8, else 1).
const MR_ROWS: u32 = 2u;
// (row, token) outputs per workgroup.
const MR_N: u32 = MR_ROWS * TT;
var<workgroup> red_rows: array<vec3<f32>, MR_N * WG>;

// Add the MULTI_ROW partial sums of rows row0 .. row0 + MR_ROWS for tokens t0 .. t0 + TT
// (`acc[r * TT + j]`: (w.x, u.x); `sum_sq[j]`: token j's row-independent sum of squares)
// over the workgroup, and finish the outputs that exist, one per invocation. With
// SUBGROUPS: subgroupAdd, then one partial per subgroup and output in workgroup memory;
// else a tree in workgroup memory.
fn reduce_rows(t0: u32, n_tok: u32, row0: u32, acc: array<vec2<f32>, MR_N>, sum_sq: array<f32, TT>, lid: u32, sg_lane: u32, sg_size: u32) {
#if SUBGROUPS
    // Subgroups per workgroup (a subgroup wider than the workgroup gives one).
    let n_sg = (WG + sg_size - 1u) / sg_size;
    for (var i = 0u; i < MR_N; i++) {
        let v = subgroupAdd(vec3<f32>(acc[i], sum_sq[i % TT]));
        if (sg_lane == 0u) {
            red_rows[i * n_sg + lid / sg_size] = v;
        }
    }
    workgroupBarrier();
    var total = vec3<f32>(0.0);
    if (lid < MR_N) {
        for (var i = 0u; i < n_sg; i++) {
            total += red_rows[lid * n_sg + i];
        }
    }
#else
    for (var i = 0u; i < MR_N; i++) {
        red_rows[i * WG + lid] = vec3<f32>(acc[i], sum_sq[i % TT]);
    }
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride = stride / 2u) {
        if (lid < stride) {
            for (var i = 0u; i < MR_N; i++) {
                red_rows[i * WG + lid] += red_rows[i * WG + lid + stride];
            }
        }
        workgroupBarrier();
    }
    var total = vec3<f32>(0.0);
    if (lid < MR_N) {
        total = red_rows[lid * WG];
    }
#endif
    let r = lid / TT;
    let j = lid % TT;
    if (lid < MR_N && row0 + r < p.n_rows && t0 + j < n_tok) {
        finish(t0 + j, row0 + r, total);
    }
}
#endif

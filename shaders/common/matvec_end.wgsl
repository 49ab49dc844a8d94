// The end of a matvec (matvec.wgsl, matvec_q.wgsl): `finish` applies the epilogue to one
// row's raw sums; with ROW_PER_WORKGROUP every invocation of the workgroup holds partial sums
// (w.x, u.x, sum of squares) of one output row, which `reduce_row` adds (subgroupAdd then one
// partial per subgroup with SUBGROUPS, else a tree in workgroup memory) before invocation 0
// finishes the row.

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

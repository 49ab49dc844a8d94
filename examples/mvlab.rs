//! Standalone WGSL experiments for matvec formulations on the current adapter:
//! `cargo run --release --example mvlab [N K REPS]`. Prints GB/s of weight reads (median).

use std::time::Instant;

use lantern::gpu::{DeviceOptions, GpuContext};
use wgpu::util::DeviceExt;

fn buf(ctx: &GpuContext, data: &[f32]) -> wgpu::Buffer {
    ctx.device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
        label: None,
        contents: bytemuck::cast_slice(data),
        usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST,
    })
}

fn pipe(ctx: &GpuContext, src: &str) -> wgpu::ComputePipeline {
    let m = ctx.device.create_shader_module(wgpu::ShaderModuleDescriptor { label: None, source: wgpu::ShaderSource::Wgsl(src.into()) });
    ctx.device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
        label: None,
        layout: None,
        module: &m,
        entry_point: Some("main"),
        compilation_options: Default::default(),
        cache: None,
    })
}

fn wait(ctx: &GpuContext) {
    let _ = ctx.device.poll(wgpu::PollType::wait_indefinitely());
}

fn time<F: Fn(&mut wgpu::CommandEncoder)>(ctx: &GpuContext, reps: usize, f: F) -> f64 {
    let mut ts = Vec::new();
    for i in 0..reps + 1 {
        let mut enc = ctx.device.create_command_encoder(&Default::default());
        f(&mut enc);
        let t = Instant::now();
        ctx.queue.submit([enc.finish()]);
        wait(ctx);
        if i > 0 {
            ts.push(t.elapsed().as_secs_f64());
        }
    }
    ts.sort_by(|a, b| a.partial_cmp(b).unwrap());
    ts[ts.len() / 2]
}

fn run(ctx: &GpuContext, p: &wgpu::ComputePipeline, bufs: &[&wgpu::Buffer], groups: (u32, u32), reps: usize) -> f64 {
    let layout = p.get_bind_group_layout(0);
    let entries: Vec<_> =
        bufs.iter().enumerate().map(|(i, b)| wgpu::BindGroupEntry { binding: i as u32, resource: b.as_entire_binding() }).collect();
    let bg = ctx.device.create_bind_group(&wgpu::BindGroupDescriptor { label: None, layout: &layout, entries: &entries });
    time(ctx, reps, |enc| {
        let mut pass = enc.begin_compute_pass(&Default::default());
        pass.set_pipeline(p);
        pass.set_bind_group(0, &bg, &[]);
        pass.dispatch_workgroups(groups.0, groups.1, 1);
    })
}

fn read(ctx: &std::sync::Arc<GpuContext>, b: &wgpu::Buffer, n: usize) -> Vec<f32> {
    pollster::block_on(lantern::gpu::buffer::read_f32(ctx, b, n)).unwrap()
}

// Matvec, one invocation computes R rows (scalar loads), x shared across R rows.
fn mv_rows(r: u32, wg: u32, vec4: bool, unroll: bool) -> String {
    let mut s = String::new();
    if vec4 {
        s += "@group(0) @binding(0) var<storage, read> w: array<vec4<f32>>;\n@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;\n";
    } else {
        s += "@group(0) @binding(0) var<storage, read> w: array<f32>;\n@group(0) @binding(1) var<storage, read> x: array<f32>;\n";
    }
    s += "@group(0) @binding(2) var<storage, read_write> y: array<f32>;\n";
    s += "@group(0) @binding(3) var<storage, read> dims: array<u32>;\n";
    s += &format!(
        "@compute @workgroup_size({wg})\nfn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {{\n"
    );
    s += &format!("  let n = dims[0]; let k = dims[1];\n  let row0 = ((wid.y * 65535u + wid.x) * {wg}u + lid) * {r}u;\n  if (row0 >= n) {{ return; }}\n");
    let kk = if vec4 { "k / 4u" } else { "k" };
    s += &format!("  let kv = {kk};\n");
    for i in 0..r {
        if vec4 {
            s += &format!("  var a{i} = vec4<f32>(0.0);\n");
        } else {
            s += &format!("  var a{i} = 0.0;\n");
        }
    }
    s += "  let b0 = row0 * kv;\n";
    let step = if unroll { 2 } else { 1 };
    s += &format!("  for (var i = 0u; i < kv; i += {step}u) {{\n");
    for u in 0..step {
        s += &format!("    let xv{u} = x[i + {u}u];\n");
        for j in 0..r {
            s += &format!("    a{j} += w[b0 + {j}u * kv + i + {u}u] * xv{u};\n");
        }
    }
    s += "  }\n";
    for j in 0..r {
        let sum = if vec4 { format!("dot(a{j}, vec4<f32>(1.0))") } else { format!("a{j}") };
        s += &format!("  if (row0 + {j}u < n) {{ y[row0 + {j}u] = {sum}; }}\n");
    }
    s += "}\n";
    s
}

// Row per workgroup of WG lanes striding K with vec4 (lane l reads vec4 l, l+WG, ...).
fn mv_wg(wg: u32, r: u32) -> String {
    let mut s = String::new();
    s += "@group(0) @binding(0) var<storage, read> w: array<vec4<f32>>;\n@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;\n";
    s += "@group(0) @binding(2) var<storage, read_write> y: array<f32>;\n@group(0) @binding(3) var<storage, read> dims: array<u32>;\n";
    s += &format!("var<workgroup> red: array<f32, {}>;\n", wg * r);
    s += &format!(
        "@compute @workgroup_size({wg})\nfn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {{\n"
    );
    s += &format!("  let n = dims[0]; let kv = dims[1] / 4u;\n  let row0 = (wid.y * 65535u + wid.x) * {r}u;\n");
    for i in 0..r {
        s += &format!("  var a{i} = vec4<f32>(0.0);\n");
    }
    s += &format!("  for (var i = lid; i < kv; i += {wg}u) {{\n    let xv = x[i];\n");
    for j in 0..r {
        s += &format!("    a{j} += w[(min(row0 + {j}u, n - 1u)) * kv + i] * xv;\n");
    }
    s += "  }\n";
    for j in 0..r {
        s += &format!("  red[{j}u * {wg}u + lid] = dot(a{j}, vec4<f32>(1.0));\n");
    }
    s += "  workgroupBarrier();\n";
    s += &format!("  if (lid < {r}u && row0 + lid < n) {{ var t = 0.0; for (var j = 0u; j < {wg}u; j++) {{ t += red[lid * {wg}u + j]; }} y[row0 + lid] = t; }}\n");
    s += "}\n";
    s
}

// Weights in an rgba32float (or rgba16float) texture: texel (i, row) = W[row, 4i..4i+4].
fn mv_tex(r: u32, wg: u32) -> String {
    let mut s = String::new();
    s += "@group(0) @binding(0) var w: texture_2d<f32>;\n@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;\n";
    s += "@group(0) @binding(2) var<storage, read_write> y: array<f32>;\n@group(0) @binding(3) var<storage, read> dims: array<u32>;\n";
    s += &format!(
        "@compute @workgroup_size({wg})\nfn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {{\n"
    );
    s += &format!("  let n = dims[0]; let kv = dims[1] / 4u;\n  let row0 = ((wid.y * 65535u + wid.x) * {wg}u + lid) * {r}u;\n  if (row0 >= n) {{ return; }}\n");
    for i in 0..r {
        s += &format!("  var a{i} = vec4<f32>(0.0);\n");
    }
    s += "  for (var i = 0u; i < kv; i++) {\n    let xv = x[i];\n";
    for j in 0..r {
        s += &format!("    a{j} += textureLoad(w, vec2<u32>(i, row0 + {j}u), 0) * xv;\n");
    }
    s += "  }\n";
    for j in 0..r {
        s += &format!("  if (row0 + {j}u < n) {{ y[row0 + {j}u] = dot(a{j}, vec4<f32>(1.0)); }}\n");
    }
    s += "}\n";
    s
}

fn read_kernel(vec4: bool, wg: u32) -> String {
    let ty = if vec4 { "vec4<f32>" } else { "f32" };
    format!(
        "@group(0) @binding(0) var<storage, read> w: array<{ty}>;\n@group(0) @binding(1) var<storage, read_write> y: array<f32>;\n@group(0) @binding(2) var<storage, read> dims: array<u32>;\n\
@compute @workgroup_size({wg})\nfn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {{\n\
  let chunk = dims[0]; let id = wid.x * {wg}u + lid; let b = id * chunk;\n  var a = {ty}(0.0);\n  for (var i = 0u; i < chunk; i++) {{ a += w[b + i]; }}\n  y[id] = dot(vec4<f32>(a), vec4<f32>(1.0));\n}}\n"
    )
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let n: u32 = args.get(1).map(|s| s.parse().unwrap()).unwrap_or(2048);
    let k: u32 = args.get(2).map(|s| s.parse().unwrap()).unwrap_or(2048);
    let reps: usize = args.get(3).map(|s| s.parse().unwrap()).unwrap_or(5);
    let filter = args.get(4).cloned().unwrap_or_default();
    let ctx = pollster::block_on(GpuContext::new(&DeviceOptions::default())).unwrap();
    println!("adapter {} caps {:?}", ctx.info.name, ctx.caps);
    let nk = (n * k) as usize;
    let wv: Vec<f32> = (0..nk).map(|i| ((i * 7919 % 1000) as f32) / 1000.0 - 0.5).collect();
    let xv: Vec<f32> = (0..k as usize).map(|i| ((i * 31 % 100) as f32) / 100.0).collect();
    let want: Vec<f32> = (0..n as usize).map(|r| (0..k as usize).map(|c| wv[r * k as usize + c] * xv[c]).sum()).collect();
    let wb = buf(&ctx, &wv);
    let xb = buf(&ctx, &xv);
    let yb = buf(&ctx, &vec![0.0; n as usize * 8]);
    let db = ctx.device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
        label: None,
        contents: bytemuck::cast_slice(&[n, k, 0u32, 0u32]),
        usage: wgpu::BufferUsages::STORAGE,
    });
    let bytes = (nk * 4) as f64;
    let dst = ctx.device.create_buffer(&wgpu::BufferDescriptor {
        label: None,
        size: bytes as u64,
        usage: wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    let t = time(&ctx, reps, |enc| enc.copy_buffer_to_buffer(&wb, 0, &dst, 0, bytes as u64));
    let copy = bytes / t / 1e9;
    println!("{:<28} {:8.3} ms {:7.2} GB/s", "copy", t * 1e3, copy);
    let report = |name: &str, t: f64, check: bool| {
        let mut err = 0.0f32;
        if check {
            let got = read(&ctx, &yb, n as usize);
            for i in 0..n as usize {
                err = err.max((got[i] - want[i]).abs() / (1.0 + want[i].abs()));
            }
        }
        println!(
            "{:<28} {:8.3} ms {:7.2} GB/s {:5.1}% of copy{}",
            name,
            t * 1e3,
            bytes / t / 1e9,
            100.0 * bytes / t / 1e9 / copy,
            if check { format!("  err {err:.1e}") } else { String::new() }
        );
    };
    let want_name = |s: &str| filter.is_empty() || s.contains(filter.as_str());
    for vec4 in [false, true] {
        for wg in [64u32] {
            for chunk_groups in [256u32, 16, 2] {
                let name = format!("read_{}_wg{wg}_g{chunk_groups}", if vec4 { "v4" } else { "f" });
                if !want_name(&name) {
                    continue;
                }
                let inv = chunk_groups * wg;
                let elems = nk as u32 / if vec4 { 4 } else { 1 };
                let chunk = elems / inv;
                let d2 = ctx.device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
                    label: None,
                    contents: bytemuck::cast_slice(&[chunk, 0u32, 0, 0]),
                    usage: wgpu::BufferUsages::STORAGE,
                });
                let p = pipe(&ctx, &read_kernel(vec4, wg));
                let t = run(&ctx, &p, &[&wb, &yb, &d2], (chunk_groups, 1), reps);
                report(&name, t, false);
            }
        }
    }
    let groups2 = |rows_per_group: u32| {
        let g = n.div_ceil(rows_per_group);
        (g.min(65535), g.div_ceil(65535))
    };
    for (vec4, unroll) in [(false, false), (true, false), (true, true)] {
        for r in [1u32, 2, 4, 8] {
            for wg in [1u32, 8, 16, 64] {
                let name = format!("thread_{}{}_r{r}_wg{wg}", if vec4 { "v4" } else { "f" }, if unroll { "u2" } else { "" });
                if !want_name(&name) {
                    continue;
                }
                let p = pipe(&ctx, &mv_rows(r, wg, vec4, unroll));
                let t = run(&ctx, &p, &[&wb, &xb, &yb, &db], groups2(r * wg), reps);
                report(&name, t, true);
            }
        }
    }
    if n <= 16384 && k / 4 <= 16384 {
        for f16 in [false, true] {
            let (fmt, data): (wgpu::TextureFormat, Vec<u8>) = if f16 {
                (
                    wgpu::TextureFormat::Rgba16Float,
                    bytemuck::cast_slice(&wv.iter().map(|&v| half::f16::from_f32(v)).collect::<Vec<_>>()).to_vec(),
                )
            } else {
                (wgpu::TextureFormat::Rgba32Float, bytemuck::cast_slice(&wv).to_vec())
            };
            let tex = ctx.device.create_texture_with_data(
                &ctx.queue,
                &wgpu::TextureDescriptor {
                    label: None,
                    size: wgpu::Extent3d { width: k / 4, height: n, depth_or_array_layers: 1 },
                    mip_level_count: 1,
                    sample_count: 1,
                    dimension: wgpu::TextureDimension::D2,
                    format: fmt,
                    usage: wgpu::TextureUsages::TEXTURE_BINDING,
                    view_formats: &[],
                },
                wgpu::util::TextureDataOrder::LayerMajor,
                &data,
            );
            let view = tex.create_view(&Default::default());
            for r in [1u32, 4, 8] {
                for wg in [8u32, 64] {
                    let name = format!("tex{}_r{r}_wg{wg}", if f16 { "16" } else { "32" });
                    if !want_name(&name) {
                        continue;
                    }
                    let p = pipe(&ctx, &mv_tex(r, wg));
                    let layout = p.get_bind_group_layout(0);
                    let bg = ctx.device.create_bind_group(&wgpu::BindGroupDescriptor {
                        label: None,
                        layout: &layout,
                        entries: &[
                            wgpu::BindGroupEntry { binding: 0, resource: wgpu::BindingResource::TextureView(&view) },
                            wgpu::BindGroupEntry { binding: 1, resource: xb.as_entire_binding() },
                            wgpu::BindGroupEntry { binding: 2, resource: yb.as_entire_binding() },
                            wgpu::BindGroupEntry { binding: 3, resource: db.as_entire_binding() },
                        ],
                    });
                    let g = groups2(r * wg);
                    let t = time(&ctx, reps, |enc| {
                        let mut pass = enc.begin_compute_pass(&Default::default());
                        pass.set_pipeline(&p);
                        pass.set_bind_group(0, &bg, &[]);
                        pass.dispatch_workgroups(g.0, g.1, 1);
                    });
                    report(&name, t * if f16 { 2.0 } else { 1.0 }, !f16);
                }
            }
        }
    }
    for wg in [4u32, 8, 16, 64] {
        for r in [1u32, 4] {
            let name = format!("wgrow_v4_wg{wg}_r{r}");
            if !want_name(&name) {
                continue;
            }
            let p = pipe(&ctx, &mv_wg(wg, r));
            let t = run(&ctx, &p, &[&wb, &xb, &yb, &db], groups2(r), reps);
            report(&name, t, true);
        }
    }
}

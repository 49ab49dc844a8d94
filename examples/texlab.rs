//! Lab: Q4_K-shaped decode matvec formulations on a CPU adapter (lavapipe):
//! `cargo run --release --example texlab [N K REPS FILTER]`. Prints GB/s of weight reads.

use std::time::Instant;

use lantern::gpu::{DeviceOptions, GpuContext};
use wgpu::util::DeviceExt;

const TEXW: u32 = 8192;

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

fn tex(ctx: &GpuContext, words: &[u32]) -> wgpu::TextureView {
    let texels = words.len().div_ceil(4) as u32;
    let h = texels.div_ceil(TEXW);
    let mut data = words.to_vec();
    data.resize((h * TEXW * 4) as usize, 0);
    let t = ctx.device.create_texture_with_data(
        &ctx.queue,
        &wgpu::TextureDescriptor {
            label: None,
            size: wgpu::Extent3d { width: TEXW, height: h, depth_or_array_layers: 1 },
            mip_level_count: 1,
            sample_count: 1,
            dimension: wgpu::TextureDimension::D2,
            format: wgpu::TextureFormat::Rgba32Uint,
            usage: wgpu::TextureUsages::TEXTURE_BINDING,
            view_formats: &[],
        },
        wgpu::util::TextureDataOrder::LayerMajor,
        bytemuck::cast_slice(&data),
    );
    t.create_view(&Default::default())
}

#[derive(Clone, Copy, PartialEq)]
enum XSrc {
    Storage,
    Uniform,
}

#[derive(Clone, Copy, PartialEq)]
enum Nib {
    /// (w >> 4e) & 15, converted.
    Shift,
    /// w & (15 << 4e) converted, times x pre-scaled by 2^-4e (the top nibble shifted).
    Mask,
}

/// Q4_K-shaped matvec from textures: R rows per lane, a 32-element sub-block per code texel,
/// one scale texel per 256-element super-block (d | dmin << 16, 12 bytes of 6-bit scales).
fn tex_kernel(r: u32, xs: XSrc, nib: Nib, il: bool) -> String {
    let mut s = String::new();
    s += "@group(0) @binding(0) var wtex: texture_2d<u32>;\n@group(0) @binding(1) var stex: texture_2d<u32>;\n";
    match xs {
        XSrc::Storage => s += "@group(0) @binding(2) var<storage, read> x: array<f32>;\n",
        XSrc::Uniform => s += "@group(0) @binding(2) var<uniform> xu: array<vec4<f32>, 4096>;\n@group(0) @binding(5) var<storage, read> xs4: array<vec4<f32>>;\n",
    }
    s += "@group(0) @binding(3) var<storage, read_write> y: array<f32>;\n@group(0) @binding(4) var<uniform> dims: vec4<u32>;\n";
    s += &format!("const TEXW: u32 = {TEXW}u;\nfn tl(t: texture_2d<u32>, i: u32) -> vec4<u32> {{ return textureLoad(t, vec2<u32>(i % TEXW, i / TEXW), 0); }}\n");
    s += "fn byte(q: vec3<u32>, i: u32) -> u32 { var w = q.x; if (i >= 8u) { w = q.z; } else if (i >= 4u) { w = q.y; } return (w >> (8u * (i % 4u))) & 0xffu; }\n";
    s += "@compute @workgroup_size(8)\nfn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {\n";
    s += "  let n = dims.x; let k = dims.y; let tpr = k / 32u; let spr = k / 256u;\n";
    if il {
        // Rows of a workgroup interleaved: lane l's rows are base + l + 8 i; texel t of a
        // workgroup's rows at base_t + t * 8R + 8 i + l (one sequential stream).
        s += &format!("  let row0 = wid.x * {}u + lid;\n", 8 * r);
        for i in 0..r {
            s += &format!("  let o{i} = wid.x * {}u + {}u + lid;\n  var acc{i} = 0.0;\n", 8 * r, 8 * i);
        }
        s += "  for (var sb = 0u; sb < spr; sb++) {\n";
        for i in 0..r {
            s += &format!("    let st{i} = tl(stex, wid.x * {}u * spr + sb * {}u + {}u + lid);\n    let dm{i} = unpack2x16float(st{i}.x);\n    let q{i} = st{i}.yzw;\n", 8 * r, 8 * r, 8 * i);
        }
    } else {
        s += &format!("  let row0 = (wid.x * 8u + lid) * {r}u;\n");
        for i in 0..r {
            s += &format!("  let r{i} = min(row0 + {i}u, n - 1u);\n  var acc{i} = 0.0;\n");
        }
        s += "  for (var sb = 0u; sb < spr; sb++) {\n";
        for i in 0..r {
            s += &format!(
                "    let st{i} = tl(stex, r{i} * spr + sb);\n    let dm{i} = unpack2x16float(st{i}.x);\n    let q{i} = st{i}.yzw;\n"
            );
        }
    }
    for j in 0..8u32 {
        s += &format!("    {{\n    let kb = sb * 256u + {}u;\n", j * 32);
        // x for the sub-block, and its sum.
        match xs {
            XSrc::Storage => {
                for w in 0..4 {
                    s += &format!("    let xl{w} = x[kb + {}u + lid];\n", w * 8);
                }
                s += "    let sx = subgroupAdd(xl0 + xl1 + xl2 + xl3);\n";
            }
            XSrc::Uniform => {
                if std::env::var("FALLBACK").is_ok() {
                    s += "    var xq: vec4<f32>;\n    if (dims.z == 0u) { xq = xu[kb / 4u + lid]; } else { xq = xs4[kb / 4u + lid]; }\n    let sx = subgroupAdd(xq.x + xq.y + xq.z + xq.w);\n";
                } else {
                    s += "    let xq = xu[kb / 4u + lid] + xs4[0] * 0.0;\n    let sx = subgroupAdd(xq.x + xq.y + xq.z + xq.w);\n";
                }
            }
        }
        for e in 0..32u32 {
            let (w, ne) = (e / 8, e % 8);
            let src = match xs {
                XSrc::Storage => format!("subgroupBroadcast(xl{w}, {ne}u)"),
                XSrc::Uniform => format!("subgroupBroadcast(xq.{}, {}u)", ["x", "y", "z", "w"][(e % 4) as usize], e / 4),
            };
            match nib {
                Nib::Shift => s += &format!("    let x{e} = {src};\n"),
                Nib::Mask => {
                    let sc = if ne == 7 { 1.0 / 16.0f32.powi(1) } else { 1.0 / 16.0f32.powi(ne as i32) };
                    let _ = w;
                    s += &format!("    let x{e} = {src} * {sc:e};\n");
                }
            }
        }
        for i in 0..r {
            if il {
                s += &format!("    let c{i} = tl(wtex, wid.x * {}u * tpr + (sb * 8u + {j}u) * {}u + {}u + lid);\n", 8 * r, 8 * r, 8 * i);
            } else {
                s += &format!("    let c{i} = tl(wtex, r{i} * tpr + sb * 8u + {j}u);\n");
            }
            // Scale and min of sub-block j.
            if j < 4 {
                s += &format!("    let sc{i} = f32(byte(q{i}, {j}u) & 63u); let mn{i} = f32(byte(q{i}, {}u) & 63u);\n", j + 4);
            } else {
                s += &format!(
                    "    let sc{i} = f32((byte(q{i}, {a}u) & 15u) | ((byte(q{i}, {b}u) >> 6u) << 4u)); let mn{i} = f32((byte(q{i}, {a}u) >> 4u) | ((byte(q{i}, {j}u) >> 6u) << 4u));\n",
                    a = j + 4,
                    b = j - 4
                );
            }
            s += &format!("    var d{i}_0 = 0.0; var d{i}_1 = 0.0; var d{i}_2 = 0.0; var d{i}_3 = 0.0;\n");
            for e in 0..32u32 {
                let (w, ne) = (e / 8, e % 8);
                let comp = ["x", "y", "z", "w"][w as usize];
                match nib {
                    Nib::Shift => {
                        s += &format!("    d{i}_{w} = fma(f32(bitcast<i32>((c{i}.{comp} >> {}u) & 15u)), x{e}, d{i}_{w});\n", 4 * ne);
                    }
                    Nib::Mask => {
                        if ne == 7 {
                            s += &format!("    d{i}_{w} = fma(f32(bitcast<i32>((c{i}.{comp} >> 24u) & 0xf0u)), x{e}, d{i}_{w});\n");
                        } else {
                            s += &format!("    d{i}_{w} = fma(f32(bitcast<i32>(c{i}.{comp} & {}u)), x{e}, d{i}_{w});\n", 15u32 << (4 * ne));
                        }
                    }
                }
            }
            s += &format!("    acc{i} += dm{i}.x * sc{i} * ((d{i}_0 + d{i}_1) + (d{i}_2 + d{i}_3)) - dm{i}.y * mn{i} * sx;\n");
        }
        s += "    }\n";
    }
    s += "  }\n";
    for i in 0..r {
        if il {
            s += &format!("  if (o{i} < n) {{ y[o{i}] = acc{i}; }}\n");
        } else {
            s += &format!("  if (row0 + {i}u < n) {{ y[row0 + {i}u] = acc{i}; }}\n");
        }
    }
    s += "}\n";
    s
}

/// Words of a row-major `rows x per_row` array in the interleaved texel order: blocks of `g`
/// rows, texel t of row q of a block at block_base + t * g + q (texels of 4 words).
fn interleave(words: &[u32], rows: usize, per_row: usize, g: usize) -> Vec<u32> {
    let tpr = per_row / 4;
    let blocks = rows.div_ceil(g);
    let mut out = vec![0u32; blocks * g * per_row];
    for r in 0..rows {
        let (b, q) = (r / g, r % g);
        for t in 0..tpr {
            let dst = (b * g * tpr + t * g + q) * 4;
            out[dst..dst + 4].copy_from_slice(&words[(r * tpr + t) * 4..(r * tpr + t) * 4 + 4]);
        }
    }
    out
}

/// The same math from storage buffers, ROWS4-like: R rows per lane, a word (8 elements) per
/// load, x loaded per lane and broadcast (today's XBCAST layout, simplified).
fn storage_kernel(r: u32) -> String {
    let mut s = String::new();
    s += "@group(0) @binding(0) var<storage, read> w: array<u32>;\n@group(0) @binding(1) var<storage, read> sw: array<u32>;\n";
    s += "@group(0) @binding(2) var<storage, read> x: array<f32>;\n";
    s += "@group(0) @binding(3) var<storage, read_write> y: array<f32>;\n@group(0) @binding(4) var<uniform> dims: vec4<u32>;\n";
    s += "fn byte(q: vec3<u32>, i: u32) -> u32 { var w = q.x; if (i >= 8u) { w = q.z; } else if (i >= 4u) { w = q.y; } return (w >> (8u * (i % 4u))) & 0xffu; }\n";
    s += "@compute @workgroup_size(8)\nfn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {\n";
    s += "  let n = dims.x; let k = dims.y; let wpr = k / 8u; let spr = k / 256u;\n";
    s += &format!("  let row0 = (wid.x * 8u + lid) * {r}u;\n");
    for i in 0..r {
        s += &format!("  let r{i} = min(row0 + {i}u, n - 1u);\n  var acc{i} = 0.0;\n");
    }
    s += "  for (var sb = 0u; sb < spr; sb++) {\n";
    for i in 0..r {
        s += &format!("    let sbase{i} = (r{i} * spr + sb) * 4u;\n    let dm{i} = unpack2x16float(sw[sbase{i}]);\n    let q{i} = vec3<u32>(sw[sbase{i} + 1u], sw[sbase{i} + 2u], sw[sbase{i} + 3u]);\n");
    }
    s += "    for (var j = 0u; j < 8u; j++) {\n      let kb = sb * 256u + j * 32u;\n";
    for i in 0..r {
        s += &format!("      var sc{i} = 0.0; var mn{i} = 0.0;\n      if (j < 4u) {{ sc{i} = f32(byte(q{i}, j) & 63u); mn{i} = f32(byte(q{i}, j + 4u) & 63u); }} else {{ sc{i} = f32((byte(q{i}, j + 4u) & 15u) | ((byte(q{i}, j - 4u) >> 6u) << 4u)); mn{i} = f32((byte(q{i}, j + 4u) >> 4u) | ((byte(q{i}, j) >> 6u) << 4u)); }}\n      var d{i} = 0.0;\n");
    }
    s += "      var sx = 0.0;\n";
    s += "      for (var ww = 0u; ww < 4u; ww++) {\n        let xl = x[kb + ww * 8u + lid];\n        sx += subgroupAdd(xl);\n";
    for e in 0..8 {
        s += &format!("        let x{e} = subgroupBroadcast(xl, {e}u);\n");
    }
    for i in 0..r {
        s += &format!("        let c{i} = w[r{i} * wpr + kb / 8u + ww];\n");
        for e in 0..8 {
            s += &format!("        d{i} += f32(bitcast<i32>((c{i} >> {}u) & 15u)) * x{e};\n", 4 * e);
        }
    }
    s += "      }\n";
    for i in 0..r {
        s += &format!("      acc{i} += dm{i}.x * sc{i} * d{i} - dm{i}.y * mn{i} * sx;\n");
    }
    s += "    }\n  }\n";
    for i in 0..r {
        s += &format!("  if (row0 + {i}u < n) {{ y[row0 + {i}u] = acc{i}; }}\n");
    }
    s += "}\n";
    s
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let n: u32 = args.get(1).map(|s| s.parse().unwrap()).unwrap_or(4096);
    let k: u32 = args.get(2).map(|s| s.parse().unwrap()).unwrap_or(4096);
    let reps: usize = args.get(3).map(|s| s.parse().unwrap()).unwrap_or(5);
    let filter = args.get(4).cloned().unwrap_or_default();
    let ctx = pollster::block_on(GpuContext::new(&DeviceOptions::default())).unwrap();
    println!("adapter {} max_uniform_buffer_binding_size {}", ctx.info.name, ctx.limits.max_uniform_buffer_binding_size);
    // Random Q4_K-shaped data.
    let mut seed = 0x1234_5678_9abc_def0u64;
    let mut rnd = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let wpr = (k / 8) as usize;
    let spr = (k / 256) as usize;
    let codes: Vec<u32> = (0..n as usize * wpr).map(|_| rnd() as u32).collect();
    let scales: Vec<u32> = (0..n as usize * spr * 4)
        .map(|i| {
            if i % 4 == 0 {
                let d = half::f16::from_f32(((rnd() % 1000) as f32 / 1000.0 + 0.1) * 0.01).to_bits() as u32;
                let dm = half::f16::from_f32(((rnd() % 1000) as f32 / 1000.0) * 0.01).to_bits() as u32;
                d | (dm << 16)
            } else {
                rnd() as u32
            }
        })
        .collect();
    let xv: Vec<f32> = (0..k as usize).map(|_| (rnd() % 2000) as f32 / 1000.0 - 1.0).collect();
    let want: Vec<f64> = (0..n as usize)
        .map(|r| {
            let mut acc = 0.0f64;
            for sb in 0..spr {
                let sw = &scales[(r * spr + sb) * 4..(r * spr + sb) * 4 + 4];
                let d = half::f16::from_bits(sw[0] as u16).to_f32() as f64;
                let dm = half::f16::from_bits((sw[0] >> 16) as u16).to_f32() as f64;
                let (sc, mn) = lantern::quant::scale_min_k4(0, &sw[1..4]);
                let _ = (sc, mn);
                for j in 0..8 {
                    let (sc, mn) = lantern::quant::scale_min_k4(j, &sw[1..4]);
                    for e in 0..32 {
                        let kk = sb * 256 + j * 32 + e;
                        let c = (codes[r * wpr + kk / 8] >> (4 * (kk % 8))) & 15;
                        acc += (d * sc as f64 * c as f64 - dm * mn as f64) * xv[kk] as f64;
                    }
                }
            }
            acc
        })
        .collect();
    let bytes = (codes.len() * 4 + scales.len() * 4) as f64;
    let sbuf = |data: &[u8], u: wgpu::BufferUsages| {
        ctx.device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: None,
            contents: data,
            usage: u | wgpu::BufferUsages::COPY_SRC,
        })
    };
    let wb = sbuf(bytemuck::cast_slice(&codes), wgpu::BufferUsages::STORAGE);
    let swb = sbuf(bytemuck::cast_slice(&scales), wgpu::BufferUsages::STORAGE);
    let mut xpad = xv.clone();
    xpad.resize(16384, 0.0);
    let xb = sbuf(bytemuck::cast_slice(&xpad), wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::UNIFORM);
    let yb = sbuf(bytemuck::cast_slice(&vec![0f32; n as usize]), wgpu::BufferUsages::STORAGE);
    let db = sbuf(bytemuck::cast_slice(&[n, k, 0, 0]), wgpu::BufferUsages::UNIFORM);
    let dst = ctx.device.create_buffer(&wgpu::BufferDescriptor {
        label: None,
        size: bytes as u64,
        usage: wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    let t = time(&ctx, reps.min(7), |enc| {
        enc.copy_buffer_to_buffer(&wb, 0, &dst, 0, (codes.len() * 4) as u64);
        enc.copy_buffer_to_buffer(&swb, 0, &dst, (codes.len() * 4) as u64, (scales.len() * 4) as u64);
    });
    let copy = bytes / t / 1e9;
    println!("{:<28} {:8.3} ms {:7.2} GB/s", "copy", t * 1e3, copy);
    let check = |name: &str, t: f64| {
        let got = pollster::block_on(lantern::gpu::buffer::read_f32(&ctx, &yb, n as usize)).unwrap();
        let mut err = 0.0f64;
        for i in 0..n as usize {
            err = err.max((got[i] as f64 - want[i]).abs() / (1.0 + want[i].abs()));
        }
        println!(
            "{:<28} {:8.3} ms {:7.2} GB/s {:5.1}% of copy  err {err:.1e}",
            name,
            t * 1e3,
            bytes / t / 1e9,
            100.0 * bytes / t / 1e9 / copy
        );
    };
    let want_name = |s: &str| filter.is_empty() || s.contains(filter.as_str());
    let run = |p: &wgpu::ComputePipeline, entries: &[wgpu::BindGroupEntry], groups: u32| {
        let bg = ctx.device.create_bind_group(&wgpu::BindGroupDescriptor { label: None, layout: &p.get_bind_group_layout(0), entries });
        time(&ctx, reps, |enc| {
            let mut pass = enc.begin_compute_pass(&Default::default());
            pass.set_pipeline(p);
            pass.set_bind_group(0, &bg, &[]);
            pass.dispatch_workgroups(groups, 1, 1);
        })
    };
    for r in [1u32, 2, 4] {
        let name = format!("storage_r{r}");
        if want_name(&name) {
            let p = pipe(&ctx, &storage_kernel(r));
            let t = run(
                &p,
                &[
                    wgpu::BindGroupEntry { binding: 0, resource: wb.as_entire_binding() },
                    wgpu::BindGroupEntry { binding: 1, resource: swb.as_entire_binding() },
                    wgpu::BindGroupEntry { binding: 2, resource: xb.as_entire_binding() },
                    wgpu::BindGroupEntry { binding: 3, resource: yb.as_entire_binding() },
                    wgpu::BindGroupEntry { binding: 4, resource: db.as_entire_binding() },
                ],
                n.div_ceil(8 * r),
            );
            check(&name, t);
        }
    }
    for xs in [XSrc::Storage, XSrc::Uniform] {
        for nib in [Nib::Shift, Nib::Mask] {
            for (r, il) in [(1u32, false), (2, false), (4, false), (8, false), (1, true), (2, true), (4, true), (8, true)] {
                let name = format!(
                    "tex_r{r}_{}_{}{}",
                    if xs == XSrc::Storage { "xs" } else { "xu" },
                    if nib == Nib::Shift { "shift" } else { "mask" },
                    if il { "_il" } else { "" }
                );
                if !want_name(&name) {
                    continue;
                }
                let (wt, st) = if il {
                    let g = 8 * r as usize;
                    (tex(&ctx, &interleave(&codes, n as usize, wpr, g)), tex(&ctx, &interleave(&scales, n as usize, spr * 4, g)))
                } else {
                    (tex(&ctx, &codes), tex(&ctx, &scales))
                };
                let p = pipe(&ctx, &tex_kernel(r, xs, nib, il));
                let xres = match xs {
                    XSrc::Storage => xb.as_entire_binding(),
                    XSrc::Uniform => wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                        buffer: &xb,
                        offset: 0,
                        size: std::num::NonZeroU64::new(65536),
                    }),
                };
                let t = run(
                    &p,
                    &[
                        wgpu::BindGroupEntry { binding: 0, resource: wgpu::BindingResource::TextureView(&wt) },
                        wgpu::BindGroupEntry { binding: 1, resource: wgpu::BindingResource::TextureView(&st) },
                        wgpu::BindGroupEntry { binding: 2, resource: xres },
                        wgpu::BindGroupEntry { binding: 3, resource: yb.as_entire_binding() },
                        wgpu::BindGroupEntry { binding: 4, resource: db.as_entire_binding() },
                        wgpu::BindGroupEntry { binding: 5, resource: xb.as_entire_binding() },
                    ],
                    n.div_ceil(8 * r),
                );
                check(&name, t);
            }
        }
    }
}

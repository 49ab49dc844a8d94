//! Kernel bandwidth bench (plain main, `harness = false`): `cargo bench --bench kernels`.
//! Prints, in one run, medians of: the adapter's buffer-copy bandwidth (baseline), a plain
//! WGSL contiguous-read kernel, every matvec layout for 4096x4096, 1536x8960 and 576x1536
//! weights in every weight dtype (f32, f16 and every packed format: q8, q4, q4s and the GGUF
//! ones, q5s ... iq4xs, dequantized in the kernel), and every
//! prefill matmul variant (tiled, blocked) at 64 tokens; GB/s of weight bytes read (codes and
//! scales for packed dtypes) and the fraction of the copy bandwidth (GFLOP/s for matmul).
//! Then SmolLM2 prefill and decode tokens/s per weight dtype (see `model_bench`).
//! Then decode attention over a long paged context per KV dtype and key-split count, and a
//! mixture of experts' decode step (router and expert matvecs) per weight format.
//! Set `BENCH_REPS` (default 3), `BENCH_FORMATS=q4,f32`, `BENCH_MATMUL=tiled,b88` (`none`:
//! no matmul), `BENCH_MATVEC=0`, `BENCH_ATTENTION=0`, `BENCH_MOE=0` and `BENCH_MODEL=0` to
//! restrict.

use std::sync::Arc;
use std::time::Instant;

use lantern::gpu::shader::{flags, Features, WeightFormat};
use lantern::gpu::{DeviceOptions, GpuContext, PipelineKey, ShaderOp};
use lantern::kernels::linear::{build_with_key, GpuLinear, HostMatrix, LinearIo};
use lantern::kernels::{step_buffer, submit};
use lantern::quant::{PackedMatrix, QuantFormat, QuantKind};
use wgpu::util::DeviceExt;

fn wait(ctx: &GpuContext) {
    let _ = ctx.device.poll(wgpu::PollType::wait_indefinitely());
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// Median seconds of `f` (one warm-up run first).
fn time(ctx: &GpuContext, reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    wait(ctx);
    median(
        (0..reps)
            .map(|_| {
                let t = Instant::now();
                f();
                wait(ctx);
                t.elapsed().as_secs_f64()
            })
            .collect(),
    )
}

fn storage(ctx: &GpuContext, data: &[u8]) -> wgpu::Buffer {
    ctx.device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
        label: Some("bench"),
        contents: data,
        usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST,
    })
}

fn data(n: usize, seed: usize) -> Vec<f32> {
    (0..n).map(|i| (((i * 7919 + seed * 104729) % 2001) as f32 / 1000.0 - 1.0) * 0.5).collect()
}

const READ_WGSL: &str = "
@group(0) @binding(0) var<storage, read> w: array<f32>;
@group(0) @binding(1) var<storage, read_write> y: array<f32>;
@group(0) @binding(2) var<uniform> chunk: vec4<u32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) id: vec3<u32>) {
    let b = id.x * chunk.x;
    var a = 0.0;
    for (var i = 0u; i < chunk.x; i++) { a += w[b + i]; }
    y[id.x] = a;
}";

struct Layout {
    name: &'static str,
    flags: u32,
    wg: u32,
    subgroups: bool,
    /// `ShaderOp::MatvecQMasked` (packed weights) instead of the matvec op of the dtype.
    masked: bool,
}

const LAYOUTS: &[Layout] = &[
    Layout { name: "thread (row/invocation, wg64)", flags: 0, wg: 64, subgroups: false, masked: false },
    Layout { name: "rows4 (4 rows/invocation, wg8)", flags: flags::ROWS4, wg: 8, subgroups: false, masked: false },
    Layout {
        name: "rows4 + x broadcast (packed, wg8 = subgroup)",
        flags: flags::ROWS4 | flags::XBCAST,
        wg: 8,
        subgroups: true,
        masked: false,
    },
    Layout { name: "tiled textures (packed, 32-row tile/wg8), x storage", flags: flags::TEX, wg: 8, subgroups: true, masked: false },
    Layout {
        name: "tiled textures (packed), x uniform window (default)",
        flags: flags::TEX | flags::XU,
        wg: 8,
        subgroups: true,
        masked: false,
    },
    Layout { name: "wg8 row/workgroup + subgroups", flags: flags::ROW_PER_WORKGROUP, wg: 8, subgroups: true, masked: false },
    Layout { name: "wg64 row/workgroup + subgroups", flags: flags::ROW_PER_WORKGROUP, wg: 64, subgroups: true, masked: false },
    Layout {
        name: "multirow (packed GPU default: 2 rows/wg64, 16-element units) + subgroups",
        flags: flags::MULTI_ROW,
        wg: 64,
        subgroups: true,
        masked: false,
    },
    Layout {
        name: "masked (packed: 4 rows/invocation, codes decoded in place; SwiftShader default)",
        flags: 0,
        wg: 8,
        subgroups: false,
        masked: true,
    },
];

struct Case {
    lin: GpuLinear,
    x: wgpu::Buffer,
    y: wgpu::Buffer,
    step: wgpu::Buffer,
    k: usize,
}

/// Every weight dtype the kernels read: f32, f16 and every packed format.
fn formats() -> Vec<WeightFormat> {
    let mut v = vec![WeightFormat::F32, WeightFormat::F16];
    v.extend(WeightFormat::packed());
    v
}

fn quant_kind(fmt: WeightFormat) -> Option<QuantKind> {
    fmt.kind()
}

/// GGUF blocks of `kind` for an `n x k` matrix: pseudo-random code and sub-scale bytes, f16
/// scales of order 0.01, repacked.
fn ggml_blocks(kind: QuantKind, n: usize, k: usize) -> PackedMatrix {
    let (be, bb) = lantern::quant::ggml::block_size(kind);
    let mut b: Vec<u8> = (0..n * k / be * bb).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect();
    for (i, blk) in b.chunks_exact_mut(bb).enumerate() {
        for &at in lantern::quant::ggml::f16_fields(kind) {
            let v = half::f16::from_f32(0.004 + 0.001 * (i % 7) as f32);
            blk[at..at + 2].copy_from_slice(&v.to_le_bytes());
        }
        if kind == QuantKind::Mxfp4 {
            // E8M0 exponents of 2^-8 .. 2^-6 (no subnormal or infinite values).
            blk[0] = 120 + (i % 3) as u8;
        }
    }
    PackedMatrix::from_gguf_blocks("w", kind, &b, n, k).expect("repack")
}

/// A weight in `fmt` and the f32 values it holds (rounded or dequantized); packed weights
/// as tiled textures (`tiled`, where the adapter holds them so) or in storage buffers.
fn case(ctx: &Arc<GpuContext>, n: usize, k: usize, fmt: WeightFormat, tokens: usize, tiled: bool) -> (Case, Vec<f32>, Vec<f32>) {
    let mut w = data(n * k, 1);
    let lin = match fmt {
        WeightFormat::F32 => GpuLinear::upload(ctx, "w", HostMatrix::F32(&w), None, None, n, k),
        WeightFormat::F16 => {
            let h: Vec<u16> = w.iter().map(|&v| half::f16::from_f32(v).to_bits()).collect();
            w = h.iter().map(|&b| half::f16::from_bits(b).to_f32()).collect();
            GpuLinear::upload(ctx, "w", HostMatrix::F16(&h), None, None, n, k)
        }
        f => {
            let kind = quant_kind(f).unwrap();
            let p = if kind.is_rtn() {
                PackedMatrix::quantize("w", &w, n, k, QuantFormat::new(kind, 32)).expect("quantize")
            } else {
                ggml_blocks(kind, n, k)
            };
            w = p.dequantize();
            GpuLinear::upload_with(ctx, "w", HostMatrix::Packed(&p), None, None, n, k, tiled)
        }
    }
    .expect("upload");
    let xv = data(tokens * k, 2);
    // As the runtime makes its activations: uniform-capable where the tiled matvec reads them so.
    let x = lantern::gpu::buffer::create_storage_window(ctx, "x", bytemuck::cast_slice(&xv), lantern::kernels::linear::x_window(ctx))
        .expect("x");
    let y = storage(ctx, &vec![0u8; tokens * n * 4]);
    (Case { lin, x, y, step: step_buffer(ctx), k }, w, xv)
}

/// The case's input and output as a matvec reads them.
fn io(c: &Case) -> LinearIo<'_> {
    LinearIo {
        step: &c.step,
        x: &c.x,
        x_stride: c.k,
        norm: None,
        eps: 1e-5,
        y: &c.y,
        out_stride: c.lin.n_rows,
        out_offset: 0,
        residual: false,
        rows: None,
        x_tex: None,
    }
}

fn dispatches(ctx: &Arc<GpuContext>, c: &Case, key: PipelineKey) -> Vec<lantern::kernels::Dispatch> {
    pollster::block_on(build_with_key(ctx, &c.lin, &io(c), key)).expect("pipeline")
}

/// The layout the runtime picks for the case's weights on this adapter.
fn auto_dispatches(ctx: &Arc<GpuContext>, c: &Case) -> Vec<lantern::kernels::Dispatch> {
    pollster::block_on(lantern::kernels::linear::build(ctx, &c.lin, &io(c), lantern::kernels::linear::Shape::Matvec)).expect("pipeline")
}

fn key(l: &Layout, fmt: WeightFormat, ctx: &GpuContext, c: &Case) -> Option<PipelineKey> {
    if l.subgroups && !ctx.caps.subgroups {
        return None;
    }
    let packed = fmt.is_packed();
    if (l.flags & flags::TEX != 0) != c.lin.is_tiled() {
        return None; // the case's weights live elsewhere
    }
    if l.masked {
        let fits = packed && lantern::kernels::linear::masked_reads(&c.lin);
        return fits.then(|| PipelineKey::new(ShaderOp::MatvecQMasked, l.wg).with_weights(fmt));
    }
    if l.flags & flags::XU != 0 && lantern::kernels::linear::x_window(ctx) == 0 {
        return None;
    }
    if packed && l.flags & (flags::ROWS4 | flags::ROW_PER_WORKGROUP | flags::MULTI_ROW | flags::TEX) == 0 {
        return None; // the packed matvec has its tuned layouts only
    }
    if l.flags & flags::MULTI_ROW != 0 && !packed {
        return None;
    }
    if l.flags & flags::XBCAST != 0 && !(packed && lantern::kernels::linear::xbcast_fits(ctx)) {
        return None;
    }
    Some(
        PipelineKey::new(if packed { ShaderOp::MatvecQ } else { ShaderOp::Matvec }, l.wg)
            .with_flags(l.flags)
            .with_weights(fmt)
            .with_features(Features { f16: false, subgroups: l.subgroups }),
    )
}

/// Every layout against a CPU product on an odd K (tails) and a row count not a multiple
/// of any workgroup.
fn check(ctx: &Arc<GpuContext>) {
    let mut cases = vec![(WeightFormat::F32, 101, 77), (WeightFormat::F16, 37, 130)];
    cases.extend(WeightFormat::packed().map(|f| (f, 37, 512)));
    for (fmt, n, k) in cases {
        for tiled in [false, true] {
            let (c, w, x) = case(ctx, n, k, fmt, 1, tiled);
            for l in LAYOUTS {
                let Some(key) = key(l, fmt, ctx, &c) else { continue };
                submit(ctx, &c.step, 1, 1, &dispatches(ctx, &c, key));
                let got = pollster::block_on(lantern::gpu::buffer::read_f32(ctx, &c.y, n)).unwrap();
                for r in 0..n {
                    let want: f32 = (0..k).map(|i| w[r * k + i] * x[i]).sum();
                    assert!((got[r] - want).abs() < 1e-3 * (1.0 + want.abs()), "{} {fmt:?} row {r}: {} vs {want}", l.name, got[r]);
                }
            }
        }
    }
    println!("check: every matvec layout matches the CPU product (odd K, ragged rows)");
}

fn main() {
    let reps: usize = std::env::var("BENCH_REPS").ok().and_then(|s| s.parse().ok()).unwrap_or(3);
    let ctx = pollster::block_on(GpuContext::new(&DeviceOptions::default())).expect("device");
    println!("adapter: {} ({:?}), cpu_like {}, reps {reps}", ctx.info.name, ctx.info.backend, ctx.caps.cpu_like);
    check(&ctx);

    // Baseline: buffer-to-buffer copy of 64 MiB.
    let bytes = 64u64 << 20;
    let src = storage(&ctx, &vec![1u8; bytes as usize]);
    let dst = storage(&ctx, &vec![0u8; bytes as usize]);
    let t = time(&ctx, reps, || {
        let mut enc = ctx.device.create_command_encoder(&Default::default());
        enc.copy_buffer_to_buffer(&src, 0, &dst, 0, bytes);
        ctx.queue.submit([enc.finish()]);
    });
    let copy = bytes as f64 / t / 1e9;
    println!("{:<44} {:9.2} ms {:7.2} GB/s", "buffer copy 64 MiB (read)", t * 1e3, copy);
    let line = |name: &str, t: f64, b: f64| {
        println!("{:<44} {:9.2} ms {:7.2} GB/s {:6.1}% of copy", name, t * 1e3, b / t / 1e9, 100.0 * b / t / 1e9 / copy);
    };

    // Plain WGSL read: each of 64 x 256 invocations sums a contiguous run of f32.
    {
        let m = ctx
            .device
            .create_shader_module(wgpu::ShaderModuleDescriptor { label: Some("read"), source: wgpu::ShaderSource::Wgsl(READ_WGSL.into()) });
        let p = ctx.device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some("read"),
            layout: None,
            module: &m,
            entry_point: Some("main"),
            compilation_options: Default::default(),
            cache: None,
        });
        let inv = 64 * 256u32;
        let chunk = (bytes / 4) as u32 / inv;
        let out = storage(&ctx, &vec![0u8; inv as usize * 4]);
        let u = ctx.device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: None,
            contents: bytemuck::cast_slice(&[chunk, 0, 0, 0]),
            usage: wgpu::BufferUsages::UNIFORM,
        });
        let bg = ctx.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: None,
            layout: &p.get_bind_group_layout(0),
            entries: &[
                wgpu::BindGroupEntry { binding: 0, resource: src.as_entire_binding() },
                wgpu::BindGroupEntry { binding: 1, resource: out.as_entire_binding() },
                wgpu::BindGroupEntry { binding: 2, resource: u.as_entire_binding() },
            ],
        });
        let t = time(&ctx, reps, || {
            let mut enc = ctx.device.create_command_encoder(&Default::default());
            {
                let mut pass = enc.begin_compute_pass(&Default::default());
                pass.set_pipeline(&p);
                pass.set_bind_group(0, &bg, &[]);
                pass.dispatch_workgroups(inv / 64, 1, 1);
            }
            ctx.queue.submit([enc.finish()]);
        });
        line("WGSL contiguous read (f32 per invocation)", t, (inv as u64 * chunk as u64 * 4) as f64);
    }
    drop((src, dst));

    let only_fmt = std::env::var("BENCH_FORMATS").ok();
    let formats: Vec<WeightFormat> =
        formats().into_iter().filter(|f| only_fmt.as_deref().is_none_or(|o| o.split(',').any(|x| x == f.name()))).collect();
    let matvecs = std::env::var("BENCH_MATVEC").as_deref() != Ok("0");
    for (n, k) in [(4096usize, 4096usize), (1536, 8960), (576, 1536)].into_iter().filter(|_| matvecs) {
        for &fmt in &formats {
            for tiled in [false, true] {
                if tiled && !fmt.is_packed() {
                    continue;
                }
                let (c, _, _) = case(&ctx, n, k, fmt, 1, tiled);
                let wbytes = c.lin.bytes() as f64;
                for l in LAYOUTS {
                    let Some(key) = key(l, fmt, &ctx, &c) else { continue };
                    let d = dispatches(&ctx, &c, key);
                    let t = time(&ctx, reps, || submit(&ctx, &c.step, 1, 1, &d));
                    line(&format!("matvec {n}x{k} {} {}", fmt.name(), l.name), t, wbytes);
                }
            }
        }
    }

    if std::env::var("BENCH_ATTENTION").as_deref() != Ok("0") {
        attention_bench(&ctx, reps, copy);
    }
    if std::env::var("BENCH_MOE").as_deref() != Ok("0") {
        moe_bench(&ctx, reps, copy, only_fmt.as_deref());
    }

    // Prefill matmul at 64 tokens in every variant: the tiled one (workgroup memory) and the
    // blocked ones (tokens x rows per invocation, CPU adapters). The 4096x4096 case is too
    // slow for CPU adapters. `BENCH_MATMUL=tiled,b88` restricts the variants.
    if std::env::var("BENCH_MODEL").as_deref() != Ok("0") {
        model_bench(&ctx);
    }

    let big = !ctx.caps.cpu_like;
    let only = std::env::var("BENCH_MATMUL").ok();
    for (n, k) in [(576usize, 1536usize), (1536, 576), (4096, 4096)] {
        if n == 4096 && !big {
            continue;
        }
        for &fmt in &formats {
            if quant_kind(fmt).is_some_and(|q| !k.is_multiple_of(q.super_block())) {
                continue; // rows of whole 256-element super-blocks only
            }
            let tokens = 64;
            for tiled in [false, true] {
                if tiled && !fmt.is_packed() {
                    continue;
                }
                let (c, _, _) = case(&ctx, n, k, fmt, tokens, tiled);
                for m in MATMULS {
                    if only.as_deref().is_some_and(|o| !o.split(',').any(|x| x == m.name)) {
                        continue;
                    }
                    if (m.flags & flags::TEX != 0) != c.lin.is_tiled() {
                        continue;
                    }
                    let op = match (m.op, fmt.is_packed()) {
                        (ShaderOp::MatmulBlocked, true) => ShaderOp::MatmulBlockedQ,
                        (op, _) => op,
                    };
                    let xb = m.flags & flags::XBCAST != 0;
                    if xb && !(fmt.is_packed() && lantern::kernels::linear::xbcast_fits(&ctx)) {
                        continue;
                    }
                    let key = PipelineKey::new(op, m.wg)
                        .with_flags(m.flags)
                        .with_weights(fmt)
                        .with_features(Features { f16: false, subgroups: xb });
                    let d = dispatches(&ctx, &c, key);
                    let t = time(&ctx, reps, || submit(&ctx, &c.step, tokens as u32, tokens as u32, &d));
                    let flops = 2.0 * (tokens * n * k) as f64;
                    println!(
                        "{:<44} {:9.2} ms {:7.2} GFLOP/s {:7.2} GB/s of weights ({:.1}% of copy)",
                        format!("matmul {} {tokens} tok x {n}x{k} {}", m.name, fmt.name()),
                        t * 1e3,
                        flops / t / 1e9,
                        c.lin.bytes() as f64 / t / 1e9,
                        100.0 * c.lin.bytes() as f64 / t / 1e9 / copy
                    );
                }
            }
        }
    }
}

/// The catalogue's Q4_K_M models, then SmolLM2 end to end per weight dtype: the GGUF as shipped (q4 layers + q8 LM head, packed),
/// requantized to q8 (RTN, group 32), and expanded to f16 and f32. Skipped when the model is
/// not on disk (`LANTERN_SMOLLM2_GGUF` or the default cache path; `lantern fetch` puts it
/// there). Decode: median over `BENCH_DECODE` (default 16) single-token steps after a
/// 32-token prefill, tokens/s = 1000 / median ms.
fn model_bench(ctx: &Arc<GpuContext>) {
    use lantern::model::forward::{GpuModel, ModelOptions, WeightPrecision};
    use lantern::quant::quantize::{quantize_model, QuantizeOptions};
    let path = std::env::var_os("LANTERN_SMOLLM2_GGUF")
        .map(std::path::PathBuf::from)
        .or_else(|| Some(lantern::fetch::default_model_path()))
        .filter(|p| p.exists());
    let steps: usize = std::env::var("BENCH_DECODE").ok().and_then(|s| s.parse().ok()).unwrap_or(16);
    let prompt: Vec<u32> = (0..32u32).map(|i| 100 + 7 * i).collect();
    // The catalogue's GGUF models (Q4_K_M) that are on disk, loaded natively.
    for spec in lantern::fetch::CATALOGUE {
        let p = lantern::fetch::model_path(spec);
        if !p.exists() {
            println!("{}: skipped (not on disk; `lantern fetch {}`)", spec.name, spec.name);
            continue;
        }
        let loaded = lantern::model::load::load_path(&p).expect("load");
        let opts = ModelOptions { context: Some(256), ..Default::default() };
        let mut m = pollster::block_on(GpuModel::load(ctx.clone(), &loaded.weights, opts)).expect("upload");
        drop(loaded);
        let (pre, dec) = prefill_decode(&mut m, &prompt, steps);
        println!(
            "{:<41} weights {:7.1} MB  prefill {:6.1} tok/s  decode {:7.1} ms/token = {:5.2} tok/s",
            spec.name,
            m.weight_bytes() as f64 / 1e6,
            pre,
            dec * 1e3,
            1.0 / dec
        );
    }
    let Some(path) = path else {
        println!("SmolLM2 decode per dtype: skipped (no model on disk; run `lantern fetch`)");
        return;
    };
    let loaded = lantern::model::load::load_path(&path).expect("load SmolLM2");
    let q8 = quantize_model(&loaded.weights, &QuantizeOptions::new(QuantKind::Q8), None, &mut |_| {}).expect("quantize q8");
    let variants = [
        ("q4_1 GGUF (q4 layers, q8 head)", &loaded.weights, WeightPrecision::Native),
        ("q8 (RTN g32 requantized)", &q8.weights, WeightPrecision::Native),
        ("f16", &loaded.weights, WeightPrecision::F16),
        ("f32", &loaded.weights, WeightPrecision::F32),
    ];
    for (name, w, precision) in variants {
        let opts = ModelOptions { context: Some(256), weights: precision, ..Default::default() };
        let mut m = pollster::block_on(GpuModel::load(ctx.clone(), w, opts)).expect("upload");
        let (pre, dec) = prefill_decode(&mut m, &prompt, steps);
        println!(
            "SmolLM2 {:<34} weights {:7.1} MB  prefill {:6.1} tok/s  decode {:7.1} ms/token = {:5.2} tok/s",
            name,
            m.weight_bytes() as f64 / 1e6,
            pre,
            dec * 1e3,
            1.0 / dec
        );
    }
}

/// Prefill tokens/s of `prompt` in one step, then the median seconds of `steps` single-token
/// decode steps.
fn prefill_decode(m: &mut lantern::model::forward::GpuModel, prompt: &[u32], steps: usize) -> (f64, f64) {
    use lantern::model::forward::Want;
    let seq = m.new_sequence().expect("sequence");
    let t0 = Instant::now();
    let mut tok = pollster::block_on(m.forward(seq, prompt, Want::Argmax)).expect("prefill").argmax[0];
    let prefill = t0.elapsed().as_secs_f64();
    let mut times = Vec::new();
    for _ in 0..steps {
        let t = Instant::now();
        tok = pollster::block_on(m.forward(seq, &[tok], Want::Argmax)).expect("decode").argmax[0];
        times.push(t.elapsed().as_secs_f64());
    }
    m.release_sequence(seq);
    (prompt.len() as f64 / prefill, median(times))
}

/// Decode attention of one token over a long paged context, SmolLM2's heads (9 query, 3 KV,
/// head_dim 64), per KV dtype and number of key splits (flash-decoding, reduce included):
/// GB/s of K and V bytes read and the share of the copy bandwidth. `BENCH_ATTENTION=0` skips.
fn attention_bench(ctx: &Arc<GpuContext>, reps: usize, copy: f64) {
    use lantern::kernels::attention::{self, AttentionIo, AttentionParams, KvBinding};
    use lantern::kernels::{submit_step, StepUniform};
    use lantern::kv::cache::KvLayout;
    use lantern::kv::plan::KvDtype;
    let (heads, kv_heads, hd, page) = (9u32, 3u32, 64u32, 16usize);
    let keys = if ctx.caps.cpu_like { 2048usize } else { 32768 };
    let pages = keys / page;
    let p = AttentionParams {
        n_heads: heads,
        n_kv_heads: kv_heads,
        head_dim: hd,
        qkv_stride: (heads + 2 * kv_heads) * hd,
        max_pages: pages as u32,
        out_stride: heads * hd,
        scale: 0.125,
        window: 0,
    };
    let step = step_buffer(ctx);
    let qkv = storage(ctx, bytemuck::cast_slice(&data(p.qkv_stride as usize, 1)));
    let pos = storage(ctx, bytemuck::cast_slice(&[keys as u32 - 1]));
    let seq = storage(ctx, bytemuck::cast_slice(&[0u32]));
    let table: Vec<u32> = (0..pages as u32).collect();
    let bt = storage(ctx, bytemuck::cast_slice(&table));
    let out = storage(ctx, &vec![0u8; (heads * hd * 4) as usize]);
    for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::Q8, KvDtype::Q4] {
        let layout = KvLayout::new(dtype, page, kv_heads as usize, hd as usize, pages, 1, ctx.max_binding()).expect("layout");
        // Small values in every dtype: f32 data, f16 halves of it, q8 codes with amax 1, q4
        // codes with f16 scales and minimums of 1 (and the sequence's length: its pages
        // sealed but the last).
        let fill = |bytes: u64, k: bool| -> Vec<u32> {
            let words = (bytes / 4) as usize;
            match dtype {
                KvDtype::F32 => data(words, 2).iter().map(|v| v.to_bits()).collect(),
                KvDtype::F16 => data(words * 2, 3)
                    .chunks(2)
                    .map(|c| half::f16::from_f32(c[0]).to_bits() as u32 | (half::f16::from_f32(c[1]).to_bits() as u32) << 16)
                    .collect(),
                KvDtype::Q8 => (0..words)
                    .map(|i| if i < layout.scale_base() { (i as u32).wrapping_mul(2654435761) & 0x3f3f3f3f } else { 1.0f32.to_bits() })
                    .collect(),
                _ => (0..words)
                    .map(|i| match i {
                        i if i < layout.scale_base() => (i as u32).wrapping_mul(2654435761),
                        i if k && i + 1 == layout.tail_base() => keys as u32,
                        _ => 0x3c00_3c00,
                    })
                    .collect(),
            }
        };
        let (kf, vf) = (fill(layout.k_shard_bytes(), true), fill(layout.v_shard_bytes(), false));
        let k: Vec<wgpu::Buffer> = (0..layout.n_shards).map(|_| storage(ctx, bytemuck::cast_slice(&kf))).collect();
        let v: Vec<wgpu::Buffer> = (0..layout.n_shards).map(|_| storage(ctx, bytemuck::cast_slice(&vf))).collect();
        let kv_bytes = 2.0 * keys as f64 * kv_heads as f64 * dtype.head_bytes(hd as usize) as f64;
        for splits in [1usize, 2, 4, 8] {
            let partials = storage(ctx, &vec![0u8; attention::partials_bytes(&p, &layout, 1, splits).max(4) as usize]);
            let io = AttentionIo {
                step: &step,
                qkv: &qkv,
                positions: &pos,
                token_seq: &seq,
                block_table: &bt,
                kv: KvBinding { layout: &layout, k: &k, v: &v },
                out: &out,
                partials: &partials,
            };
            let d = pollster::block_on(attention::build(ctx, &io, p)).expect("attention");
            let mut s = StepUniform::new(1, 1);
            s.n_splits = splits as u32;
            let t = time(ctx, reps, || submit_step(ctx, &step, &s, &d));
            println!(
                "attention decode {keys} keys {:<4} {splits} split(s) {:9.2} ms {:7.2} GB/s {:6.1}% of copy  [{}]",
                format!("{dtype:?}").to_lowercase(),
                t * 1e3,
                kv_bytes / t / 1e9,
                100.0 * kv_bytes / t / 1e9 / copy,
                d[0].label
            );
        }
    }
}

/// A mixture of experts' decode step on Qwen3-30B-A3B's experts (hidden 2048, expert width
/// 768, 8 of 128 per token; 32 experts on CPU adapters, which read the same chosen bytes):
/// the route, then gate|up and down of the chosen experts (`kernels::moe`), per weight
/// format. GB/s of the chosen experts' weight bytes (codes and scales) read per token, and
/// the share of the copy bandwidth. `BENCH_MOE=0` skips.
fn moe_bench(ctx: &Arc<GpuContext>, reps: usize, copy: f64, only: Option<&str>) {
    use lantern::kernels::moe::{self, ExpertIo};
    let (d, ei, top_k) = (2048usize, 768usize, 8usize);
    let n = if ctx.caps.cpu_like { 32 } else { 128 };
    let step = step_buffer(ctx);
    let mut fmts = vec![WeightFormat::Packed(QuantKind::Q4K), WeightFormat::Packed(QuantKind::Q6K), WeightFormat::Packed(QuantKind::Q8)];
    if !ctx.caps.cpu_like {
        fmts.push(WeightFormat::F16);
    }
    for fmt in fmts.into_iter().filter(|f| only.is_none_or(|o| o.split(',').any(|x| x == f.name()))) {
        let upload = |name: &str, rows: usize, k: usize, gated: bool| -> GpuLinear {
            match quant_kind(fmt) {
                Some(kind) => {
                    let w = ggml_blocks(kind, rows, k);
                    let u = gated.then(|| ggml_blocks(kind, rows, k));
                    GpuLinear::upload_with(ctx, name, HostMatrix::Packed(&w), u.as_ref().map(HostMatrix::Packed), None, rows, k, false)
                }
                None => {
                    let h: Vec<u16> = data(rows * k, 1).iter().map(|&v| half::f16::from_f32(v).to_bits()).collect();
                    GpuLinear::upload_with(ctx, name, HostMatrix::F16(&h), gated.then_some(HostMatrix::F16(&h)), None, rows, k, false)
                }
            }
            .expect("upload experts")
        };
        let gate_up = upload("experts.gate_up", n * ei, d, true);
        let down = upload("experts.down", n * d, ei, false);
        let logits = storage(ctx, bytemuck::cast_slice(&data(n, 3)));
        let route = storage(ctx, &vec![0u8; top_k * moe::ROUTE_BYTES]);
        let x = storage(ctx, bytemuck::cast_slice(&data(d, 4)));
        let g = storage(ctx, bytemuck::cast_slice(&vec![1.0f32; d]));
        let act = storage(ctx, &vec![0u8; top_k * ei * 4]);
        let y = storage(ctx, &vec![0u8; d * 4]);
        let io = ExpertIo {
            step: &step,
            x: &x,
            x_stride: d,
            norm: Some(&g),
            eps: 1e-5,
            route: &route,
            top_k,
            y: &act,
            out_stride: ei,
            residual: false,
        };
        let down_io = ExpertIo { x: &act, x_stride: ei, norm: None, y: &y, out_stride: d, residual: true, ..io };
        // Both layouts: a workgroup per row, and MULTI_ROW (the default where it fits).
        let layouts = [false, true].into_iter().filter(|&m| !m || moe::multi_fits(&gate_up, &io) && moe::multi_fits(&down, &down_io));
        for multi in layouts {
            let sg = ctx.caps.subgroups;
            let dispatches = vec![
                pollster::block_on(moe::route(ctx, &step, &logits, &route, n, top_k, true)).expect("route"),
                pollster::block_on(moe::experts_with(ctx, &gate_up, n, &io, sg, multi)).expect("gate|up"),
                pollster::block_on(moe::experts_with(ctx, &down, n, &down_io, sg, multi)).expect("down"),
            ];
            let t = time(ctx, reps, || submit(ctx, &step, 1, 1, &dispatches));
            let parts: Vec<String> = dispatches
                .iter()
                .zip(["route", "gate|up", "down"])
                .map(|(d, name)| format!("{name} {:.2} ms", 1e3 * time(ctx, reps, || submit(ctx, &step, 1, 1, std::slice::from_ref(d)))))
                .collect();
            println!("  the step's parts: {}", parts.join(", "));
            let chosen = top_k as f64 * (gate_up.bytes() + down.bytes()) as f64 / n as f64;
            println!(
                "moe decode {top_k} of {n} experts 768x2048 {:<5} {:9.2} ms {:7.2} GB/s of chosen experts {:6.1}% of copy  [{}]",
                fmt.name(),
                t * 1e3,
                chosen / t / 1e9,
                100.0 * chosen / t / 1e9 / copy,
                dispatches[1].label
            );
        }
        // The same bytes as one dense layer would hold them (gate and up of the chosen
        // experts stacked: 2 x 8 x 768 rows of 2048; down: 2048 rows of 8 x 768), in the same
        // run, in each storage layout the experts have and the adapter's default: the
        // fraction of the dense matvec's GB/s the expert step reaches, shape for shape.
        if fmt.is_packed() {
            let storage = [case(ctx, 2 * top_k * ei, d, fmt, 1, false).0, case(ctx, d, top_k * ei, fmt, 1, false).0];
            let tiled = [case(ctx, 2 * top_k * ei, d, fmt, 1, true).0, case(ctx, d, top_k * ei, fmt, 1, true).0];
            let bytes = (storage[0].lin.bytes() + storage[1].lin.bytes()) as f64;
            type Run<'a> = (String, &'a [Case; 2], [Vec<lantern::kernels::Dispatch>; 2]);
            let mut runs: Vec<Run> = Vec::new();
            for l in LAYOUTS
                .iter()
                .filter(|l| l.wg == 64 && l.subgroups == ctx.caps.subgroups && l.flags & (flags::ROW_PER_WORKGROUP | flags::MULTI_ROW) != 0)
            {
                if let (Some(ku), Some(kd)) = (key(l, fmt, ctx, &storage[0]), key(l, fmt, ctx, &storage[1])) {
                    runs.push((l.name.to_string(), &storage, [dispatches(ctx, &storage[0], ku), dispatches(ctx, &storage[1], kd)]));
                }
            }
            runs.push(("the adapter's default layout".into(), &tiled, [auto_dispatches(ctx, &tiled[0]), auto_dispatches(ctx, &tiled[1])]));
            for (name, cs, ds) in &runs {
                let t = time(ctx, reps, || {
                    submit(ctx, &cs[0].step, 1, 1, &ds[0]);
                    submit(ctx, &cs[1].step, 1, 1, &ds[1]);
                });
                let t_up = time(ctx, reps, || submit(ctx, &cs[0].step, 1, 1, &ds[0]));
                println!("  dense parts: gate and up {:.2} ms, down {:.2} ms", 1e3 * t_up, 1e3 * (t - t_up));
                println!(
                    "  dense, same bytes        {:<5} {:9.2} ms {:7.2} GB/s {:6.1}% of copy  [{name}]",
                    fmt.name(),
                    t * 1e3,
                    bytes / t / 1e9,
                    100.0 * bytes / t / 1e9 / copy
                );
            }
        }
    }
}

struct MatmulVariant {
    name: &'static str,
    op: ShaderOp,
    flags: u32,
    wg: u32,
}

const MATMULS: &[MatmulVariant] = &[
    MatmulVariant { name: "tiled", op: ShaderOp::Matmul, flags: 0, wg: 64 },
    MatmulVariant { name: "b44", op: ShaderOp::MatmulBlocked, flags: 0, wg: 8 },
    MatmulVariant { name: "b84", op: ShaderOp::MatmulBlocked, flags: flags::BLOCK_M8, wg: 8 },
    MatmulVariant { name: "b48", op: ShaderOp::MatmulBlocked, flags: flags::BLOCK_N8, wg: 8 },
    MatmulVariant { name: "b88", op: ShaderOp::MatmulBlocked, flags: flags::BLOCK_M8 | flags::BLOCK_N8, wg: 8 },
    MatmulVariant { name: "b84x", op: ShaderOp::MatmulBlocked, flags: flags::BLOCK_M8 | flags::XBCAST, wg: 8 },
    MatmulVariant { name: "b88x", op: ShaderOp::MatmulBlocked, flags: flags::BLOCK_M8 | flags::BLOCK_N8 | flags::XBCAST, wg: 8 },
    MatmulVariant { name: "b44t", op: ShaderOp::MatmulBlocked, flags: flags::XBCAST | flags::TEX, wg: 8 },
    MatmulVariant { name: "b84t", op: ShaderOp::MatmulBlocked, flags: flags::BLOCK_M8 | flags::XBCAST | flags::TEX, wg: 8 },
    MatmulVariant { name: "b48t", op: ShaderOp::MatmulBlocked, flags: flags::BLOCK_N8 | flags::XBCAST | flags::TEX, wg: 8 },
    MatmulVariant {
        name: "b88t",
        op: ShaderOp::MatmulBlocked,
        flags: flags::BLOCK_M8 | flags::BLOCK_N8 | flags::XBCAST | flags::TEX,
        wg: 8,
    },
];

//! Time one packed matvec kernel variant in a loop (for profilers):
//! `cargo run --release --example mvprof -- FORMAT N K REPS [TOKENS]` (FORMAT: q4k, q6k, q5s,
//! q8, ...; `MVPROF_GATE_UP=1` times the fused gate/up form: RMS norm prologue, two matrices,
//! SiLU gate; the runtime's own layout for that format on this adapter: the matvec for one token,
//! the four-token matvec for 2-4, the eight-token one for 5-8, the prefill matmul above). Prints GB/s of weight bytes per
//! dispatch, median of REPS.

use std::time::Instant;

use lantern::gpu::shader::WeightFormat;
use lantern::gpu::{DeviceOptions, GpuContext};
use lantern::kernels::linear::{build, GpuLinear, HostMatrix, LinearIo, Shape};
use lantern::kernels::{step_buffer, submit};
use lantern::quant::{PackedMatrix, QuantFormat, QuantKind};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let fmt = args.get(1).map(String::as_str).unwrap_or("q4k");
    let n: usize = args.get(2).map(|s| s.parse()).transpose()?.unwrap_or(4096);
    let k: usize = args.get(3).map(|s| s.parse()).transpose()?.unwrap_or(4096);
    let reps: usize = args.get(4).map(|s| s.parse()).transpose()?.unwrap_or(20);
    let tokens: usize = args.get(5).map(|s| s.parse()).transpose()?.unwrap_or(1);
    let kind = QuantKind::ALL.into_iter().find(|q| WeightFormat::Packed(*q).name() == fmt).ok_or("unknown format")?;
    let ctx = pollster::block_on(GpuContext::new(&DeviceOptions::default()))?;
    let p = if kind.is_rtn() {
        let w: Vec<f32> = (0..n * k).map(|i| ((i * 7919 % 2001) as f32 / 1000.0 - 1.0) * 0.5).collect();
        PackedMatrix::quantize("w", &w, n, k, QuantFormat::new(kind, 32))?
    } else {
        let (be, bb) = lantern::quant::ggml::block_size(kind);
        let mut b: Vec<u8> = (0..n * k / be * bb).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect();
        for blk in b.chunks_exact_mut(bb) {
            for &at in lantern::quant::ggml::f16_fields(kind) {
                blk[at..at + 2].copy_from_slice(&half::f16::from_f32(0.005).to_le_bytes());
            }
        }
        PackedMatrix::from_gguf_blocks("w", kind, &b, n, k)?
    };
    let gate_up = std::env::var("MVPROF_GATE_UP").is_ok_and(|v| v == "1");
    let u = gate_up.then_some(HostMatrix::Packed(&p));
    let lin = GpuLinear::upload(&ctx, "w", HostMatrix::Packed(&p), u, None, n, k)?;
    let g: Vec<f32> = (0..k).map(|i| 1.0 + (i % 5) as f32 / 10.0).collect();
    let norm = gate_up
        .then(|| lantern::gpu::buffer::create_storage_window(&ctx, "g", bytemuck::cast_slice(&g), lantern::kernels::linear::x_window(&ctx)))
        .transpose()?;
    let xv: Vec<f32> = (0..tokens * k).map(|i| (i % 17) as f32 / 17.0 - 0.5).collect();
    let x = lantern::gpu::buffer::create_storage_window(&ctx, "x", bytemuck::cast_slice(&xv), lantern::kernels::linear::x_window(&ctx))?;
    let y = lantern::gpu::buffer::create_zeroed(&ctx, "y", (tokens * n * 4) as u64)?;
    let step = step_buffer(&ctx);
    // Prefill steps read x from a texture copy where the runtime makes one.
    let xt = (tokens > 4 && lantern::kernels::x_texture::fits(&ctx, &[k], tokens))
        .then(|| lantern::kernels::x_texture::create(&ctx, "x.tex", k, tokens))
        .transpose()?;
    let io = LinearIo {
        step: &step,
        x: &x,
        x_stride: k,
        norm: norm.as_ref(),
        eps: 1e-5,
        y: &y,
        out_stride: n,
        out_offset: 0,
        residual: false,
        rows: None,
        x_tex: xt.as_ref(),
    };
    let shape = match tokens {
        1 => Shape::Matvec,
        2..=4 => Shape::MatvecBatch,
        5..=8 => Shape::MatvecBatch8,
        _ => Shape::Matmul,
    };
    let mut d = pollster::block_on(build(&ctx, &lin, &io, shape))?;
    if let Some(t) = &xt {
        d.insert(0, pollster::block_on(lantern::kernels::x_texture::build(&ctx, &step, &x, k, k, t))?);
    }
    let mut t = Vec::new();
    for _ in 0..reps {
        let t0 = Instant::now();
        submit(&ctx, &step, tokens as u32, tokens as u32, &d);
        let _ = ctx.device.poll(wgpu::PollType::wait_indefinitely());
        t.push(t0.elapsed().as_secs_f64());
    }
    t.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let med = t[t.len() / 2];
    println!(
        "{} {n}x{k} x{tokens}: {:.3} ms, {:.2} GB/s [{}]",
        fmt,
        med * 1e3,
        lin.bytes() as f64 / med / 1e9,
        d.iter().map(|d| d.label.as_str()).collect::<Vec<_>>().join(" + ")
    );
    Ok(())
}

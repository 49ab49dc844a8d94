//! Lantern inside a host's frame loop, without a window: the host owns the wgpu device, runs
//! its own GPU work every frame (a stand-in compute pass over a 1 MiB buffer), paces itself
//! to a frame rate, and gives Lantern a time budget per frame with `Engine::step_within`.
//! Text streams to stdout as it arrives; at the end the frame times it kept are printed.
//!
//! `cargo run --release --example headless -- "Once upon a time" --max-tokens 24 --budget-ms 4`

#[path = "../shared/mod.rs"]
mod shared;

use std::io::Write;
use std::time::{Duration, Instant};

use clap::Parser;
use lantern::engine::Event;

/// The host's own per-frame work: a compute pass that rewrites a buffer, so Lantern's
/// dispatches share the queue with someone else's, as in a game.
struct HostWork {
    pipeline: wgpu::ComputePipeline,
    bind: wgpu::BindGroup,
    groups: u32,
}

impl HostWork {
    fn new(device: &wgpu::Device) -> HostWork {
        let words = 1u32 << 18;
        let buf = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("host particles"),
            size: words as u64 * 4,
            usage: wgpu::BufferUsages::STORAGE,
            mapped_at_creation: false,
        });
        let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
            label: Some("host work"),
            source: wgpu::ShaderSource::Wgsl(
                "@group(0) @binding(0) var<storage, read_write> p: array<f32>;
                 @compute @workgroup_size(256) fn main(@builtin(global_invocation_id) g: vec3<u32>) {
                     let i = g.x + g.y * 65535u * 256u;
                     if (i < arrayLength(&p)) { p[i] = fract(p[i] * 1.0001 + 0.37); }
                 }"
                .into(),
            ),
        });
        let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some("host work"),
            layout: None,
            module: &module,
            entry_point: Some("main"),
            compilation_options: Default::default(),
            cache: None,
        });
        let bind = device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some("host work"),
            layout: &pipeline.get_bind_group_layout(0),
            entries: &[wgpu::BindGroupEntry { binding: 0, resource: buf.as_entire_binding() }],
        });
        HostWork { pipeline, bind, groups: words / 256 }
    }

    fn submit(&self, device: &wgpu::Device, queue: &wgpu::Queue) {
        let mut enc = device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("host frame") });
        {
            let mut pass = enc.begin_compute_pass(&Default::default());
            pass.set_pipeline(&self.pipeline);
            pass.set_bind_group(0, &self.bind, &[]);
            pass.dispatch_workgroups(self.groups, 1, 1);
        }
        queue.submit([enc.finish()]);
    }
}

fn main() {
    if let Err(e) = run(shared::Args::parse()) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn run(args: shared::Args) -> Result<(), Box<dyn std::error::Error>> {
    // The host's device, made the way an application makes one.
    let instance = wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle_from_env());
    let adapter =
        pollster::block_on(instance.request_adapter(&wgpu::RequestAdapterOptions {
            power_preference: wgpu::PowerPreference::HighPerformance,
            ..Default::default()
        }))?;
    let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
        label: Some("host"),
        required_features: shared::wanted_features(&adapter),
        required_limits: adapter.limits(),
        ..Default::default()
    }))?;
    let host = HostWork::new(&device);
    let mut loaded = shared::load(&args, device.clone(), queue.clone())?;
    if !args.json {
        eprintln!(
            "[{} on {} | loaded in {:.0} ms, warmed up in {:.0} ms | budget {:.1} ms per frame at {:.0} fps]",
            loaded.model_path.display(),
            loaded.ctx.info.name,
            loaded.load_ms,
            loaded.warm_ms,
            args.budget_ms,
            args.fps
        );
    }
    let mut handle = loaded.engine.submit(loaded.request.clone())?;
    let (budget, frame) = (args.budget(), args.frame());
    let mut log = shared::FrameLog::default();
    let (mut ids, mut text, mut finish) = (Vec::new(), String::new(), None);
    let start = Instant::now();
    let mut done_at: Option<Instant> = None;
    loop {
        let t = Instant::now();
        if args.seconds > 0.0 && start.elapsed().as_secs_f64() >= args.seconds {
            break;
        }
        if args.seconds <= 0.0 && done_at.is_some_and(|d| d.elapsed() >= Duration::from_secs(1)) {
            break;
        }
        host.submit(&device, &queue);
        if !loaded.engine.is_idle() {
            let c = Instant::now();
            let r = pollster::block_on(loaded.engine.step_within(budget))?;
            log.call_ms.push(c.elapsed().as_secs_f64() * 1e3);
            log.steps += r.step.is_some() as usize;
        }
        while let Ok(Some(ev)) = handle.try_next() {
            match ev {
                Event::Token { id, text: piece, .. } => {
                    ids.push(id);
                    log.token_at.push(start.elapsed().as_secs_f64());
                    text.push_str(&piece);
                    if !args.json {
                        print!("{piece}");
                        std::io::stdout().flush()?;
                    }
                }
                Event::Text(piece) => {
                    text.push_str(&piece);
                    if !args.json {
                        print!("{piece}");
                    }
                }
                Event::Done(g) => {
                    finish = Some(g.finish_reason.as_str());
                    done_at = Some(Instant::now());
                }
                Event::Error(m) => return Err(m.into()),
            }
        }
        // Pace to the frame rate like a vsync'd host would.
        if let Some(rest) = frame.checked_sub(t.elapsed()) {
            std::thread::sleep(rest);
        }
        log.frame_ms.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let wall = start.elapsed().as_secs_f64();
    if let Err(e) = loaded.ctx.save_pipeline_cache() {
        eprintln!("warning: saving the pipeline cache failed: {e}");
    }
    if args.json {
        let v = serde_json::json!({
            "prompt_ids": loaded.request.prompt_ids,
            "output_ids": ids,
            "text": text,
            "finish_reason": finish,
            "adapter": loaded.ctx.info.name,
            "wall_s": wall,
            "frames": log.json(budget),
            "pipelines": loaded.ctx.pipelines.stats(),
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        println!();
        log.print(budget, ids.len(), wall);
        if finish.is_none() {
            println!("(stopped after {:.1} s before generation finished)", args.seconds);
        }
    }
    Ok(())
}

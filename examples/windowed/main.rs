//! Lantern in a windowed application: a winit window renders an animation every frame on
//! its own wgpu device while Lantern generates on that same device within a per-frame time
//! budget (`Engine::step_within`). The text streams into an overlay at the bottom of the
//! window and the token count and rate into the title; at the end the frame times the
//! application kept are printed, and `--screenshot` saves the last frame as a PNG.
//!
//! `cargo run --release --example windowed -- "Once upon a time" --budget-ms 4`

#[path = "../shared/mod.rs"]
mod shared;

use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use lantern::engine::{Event, RequestHandle};
use winit::application::ApplicationHandler;
use winit::dpi::PhysicalSize;
use winit::event::WindowEvent;
use winit::event_loop::{ActiveEventLoop, ControlFlow, EventLoop};
use winit::window::{Window, WindowId};

#[derive(Parser, Debug)]
struct Args {
    #[command(flatten)]
    common: shared::Args,
    /// Save the last frame (animation and overlay) as a PNG here.
    #[arg(long)]
    screenshot: Option<std::path::PathBuf>,
    /// Window size in pixels, WIDTHxHEIGHT.
    #[arg(long, default_value = "960x540")]
    size: String,
}

/// Glyphs are font8x8's 8x8 bitmaps drawn at this scale.
const SCALE: u32 = 2;
const GLYPH: u32 = 8 * SCALE;
const LINE: u32 = GLYPH + 4;
const OVERLAY_LINES: u32 = 8;

const SHADER: &str = r#"
struct Frame { size: vec2<f32>, time: f32, overlay_top: f32 };
@group(0) @binding(0) var<uniform> f: Frame;
@group(0) @binding(1) var text: texture_2d<f32>;

struct Out { @builtin(position) pos: vec4<f32> };

@vertex fn vs(@builtin(vertex_index) i: u32) -> Out {
    // One triangle that covers the screen.
    let xy = vec2<f32>(f32((i << 1u) & 2u), f32(i & 2u)) * 2.0 - 1.0;
    return Out(vec4<f32>(xy, 0.0, 1.0));
}

@fragment fn fs(o: Out) -> @location(0) vec4<f32> {
    let p = (o.pos.xy - 0.5 * f.size) / f.size.y;
    let t = f.time;
    // The animation: rotating rings over a drifting colour field.
    let a = atan2(p.y, p.x) + t * 0.8;
    let r = length(p);
    let rings = 0.5 + 0.5 * sin(24.0 * r - 3.0 * t + 4.0 * sin(3.0 * a));
    let glow = smoothstep(0.45, 0.0, r);
    var c = vec3<f32>(0.08, 0.10, 0.16)
        + 0.25 * vec3<f32>(0.5 + 0.5 * sin(t + p.x * 3.0), 0.5 + 0.5 * sin(t * 0.7 + p.y * 3.0 + 2.0), 0.6)
        + rings * glow * vec3<f32>(1.0, 0.75, 0.35);
    // The overlay: a dark band with the generated text.
    if (o.pos.y >= f.overlay_top) {
        let ij = vec2<i32>(i32(o.pos.x), i32(o.pos.y - f.overlay_top));
        let dims = vec2<i32>(textureDimensions(text));
        var ink = 0.0;
        if (ij.x < dims.x && ij.y < dims.y) { ink = textureLoad(text, ij, 0).r; }
        c = mix(c * 0.25, vec3<f32>(0.95, 0.97, 1.0), ink);
    }
    return vec4<f32>(c, 1.0);
}
"#;

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct FrameUniform {
    size: [f32; 2],
    time: f32,
    overlay_top: f32,
}

/// The text as an 8-bit coverage mask, word-wrapped to the window, last lines kept.
fn rasterize(text: &str, width: u32) -> (Vec<u8>, u32, u32) {
    let cols = (width.saturating_sub(2 * GLYPH) / GLYPH).max(1) as usize;
    let mut lines: Vec<String> = Vec::new();
    for para in text.split('\n') {
        let mut line = String::new();
        for word in para.split(' ') {
            let w: String = word.chars().map(|c| if c.is_ascii() && !c.is_ascii_control() { c } else { '?' }).collect();
            if !line.is_empty() && line.chars().count() + 1 + w.chars().count() > cols {
                lines.push(std::mem::take(&mut line));
            }
            if !line.is_empty() {
                line.push(' ');
            }
            line.push_str(&w);
            while line.chars().count() > cols {
                let rest = line.split_off(cols);
                lines.push(std::mem::replace(&mut line, rest));
            }
        }
        lines.push(line);
    }
    let keep = lines.len().saturating_sub(OVERLAY_LINES as usize);
    let height = OVERLAY_LINES * LINE + 8;
    let mut mask = vec![0u8; (width * height) as usize];
    for (row, line) in lines[keep..].iter().enumerate() {
        for (col, ch) in line.chars().enumerate() {
            let Some(bits) = font8x8::legacy::BASIC_LEGACY.get(ch as usize) else { continue };
            for (gy, byte) in bits.iter().enumerate() {
                for gx in 0..8u32 {
                    if byte >> gx & 1 == 0 {
                        continue;
                    }
                    for sy in 0..SCALE {
                        for sx in 0..SCALE {
                            let x = GLYPH + col as u32 * GLYPH + gx * SCALE + sx;
                            let y = 6 + row as u32 * LINE + gy as u32 * SCALE + sy;
                            if x < width && y < height {
                                mask[(y * width + x) as usize] = 255;
                            }
                        }
                    }
                }
            }
        }
    }
    (mask, width, height)
}

struct Gfx {
    window: Arc<Window>,
    surface: wgpu::Surface<'static>,
    config: wgpu::SurfaceConfiguration,
    device: wgpu::Device,
    queue: wgpu::Queue,
    pipeline: wgpu::RenderPipeline,
    uniform: wgpu::Buffer,
    text_tex: wgpu::Texture,
    bind: wgpu::BindGroup,
}

impl Gfx {
    fn text_texture(device: &wgpu::Device, width: u32) -> wgpu::Texture {
        device.create_texture(&wgpu::TextureDescriptor {
            label: Some("overlay text"),
            size: wgpu::Extent3d { width: width.max(1), height: OVERLAY_LINES * LINE + 8, depth_or_array_layers: 1 },
            mip_level_count: 1,
            sample_count: 1,
            dimension: wgpu::TextureDimension::D2,
            format: wgpu::TextureFormat::R8Unorm,
            usage: wgpu::TextureUsages::TEXTURE_BINDING | wgpu::TextureUsages::COPY_DST,
            view_formats: &[],
        })
    }

    fn rebind(&mut self) {
        self.bind = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some("frame"),
            layout: &self.pipeline.get_bind_group_layout(0),
            entries: &[
                wgpu::BindGroupEntry { binding: 0, resource: self.uniform.as_entire_binding() },
                wgpu::BindGroupEntry {
                    binding: 1,
                    resource: wgpu::BindingResource::TextureView(&self.text_tex.create_view(&Default::default())),
                },
            ],
        });
    }

    fn resize(&mut self, size: PhysicalSize<u32>) {
        self.config.width = size.width.max(1);
        self.config.height = size.height.max(1);
        self.surface.configure(&self.device, &self.config);
        self.text_tex = Gfx::text_texture(&self.device, self.config.width);
        self.rebind();
    }

    fn upload_text(&self, text: &str) {
        let (mask, w, h) = rasterize(text, self.config.width);
        self.queue.write_texture(
            wgpu::TexelCopyTextureInfo {
                texture: &self.text_tex,
                mip_level: 0,
                origin: wgpu::Origin3d::ZERO,
                aspect: wgpu::TextureAspect::All,
            },
            &mask,
            wgpu::TexelCopyBufferLayout { offset: 0, bytes_per_row: Some(w), rows_per_image: Some(h) },
            wgpu::Extent3d { width: w, height: h, depth_or_array_layers: 1 },
        );
    }

    fn encode_scene(&self, enc: &mut wgpu::CommandEncoder, view: &wgpu::TextureView) {
        let mut pass = enc.begin_render_pass(&wgpu::RenderPassDescriptor {
            label: Some("scene"),
            color_attachments: &[Some(wgpu::RenderPassColorAttachment {
                view,
                depth_slice: None,
                resolve_target: None,
                ops: wgpu::Operations { load: wgpu::LoadOp::Clear(wgpu::Color::BLACK), store: wgpu::StoreOp::Store },
            })],
            ..Default::default()
        });
        pass.set_pipeline(&self.pipeline);
        pass.set_bind_group(0, &self.bind, &[]);
        pass.draw(0..3, 0..1);
    }

    /// Render one frame at time `t` into the window (and into `capture` for a screenshot).
    fn render(&self, t: f32, capture: Option<&std::path::Path>) -> Result<(), Box<dyn std::error::Error>> {
        let (w, h) = (self.config.width, self.config.height);
        let overlay_top = h.saturating_sub(OVERLAY_LINES * LINE + 8) as f32;
        self.queue.write_buffer(&self.uniform, 0, bytemuck::bytes_of(&FrameUniform { size: [w as f32, h as f32], time: t, overlay_top }));
        let frame = match self.surface.get_current_texture() {
            wgpu::CurrentSurfaceTexture::Success(f) | wgpu::CurrentSurfaceTexture::Suboptimal(f) => f,
            wgpu::CurrentSurfaceTexture::Outdated | wgpu::CurrentSurfaceTexture::Lost => {
                self.surface.configure(&self.device, &self.config);
                return Ok(());
            }
            other => return Err(format!("no surface texture: {other:?}").into()),
        };
        let mut enc = self.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("frame") });
        self.encode_scene(&mut enc, &frame.texture.create_view(&Default::default()));
        self.queue.submit([enc.finish()]);
        self.window.pre_present_notify();
        self.queue.present(frame);
        if let Some(path) = capture {
            self.screenshot(path)?;
        }
        Ok(())
    }

    /// The same scene rendered off screen, read back and written as an RGBA PNG.
    fn screenshot(&self, path: &std::path::Path) -> Result<(), Box<dyn std::error::Error>> {
        let (w, h) = (self.config.width, self.config.height);
        let format = self.config.format;
        let tex = self.device.create_texture(&wgpu::TextureDescriptor {
            label: Some("screenshot"),
            size: wgpu::Extent3d { width: w, height: h, depth_or_array_layers: 1 },
            mip_level_count: 1,
            sample_count: 1,
            dimension: wgpu::TextureDimension::D2,
            format,
            usage: wgpu::TextureUsages::RENDER_ATTACHMENT | wgpu::TextureUsages::COPY_SRC,
            view_formats: &[],
        });
        let row = (w * 4).div_ceil(256) * 256;
        let buf = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("screenshot"),
            size: (row * h) as u64,
            usage: wgpu::BufferUsages::COPY_DST | wgpu::BufferUsages::MAP_READ,
            mapped_at_creation: false,
        });
        let mut enc = self.device.create_command_encoder(&Default::default());
        self.encode_scene(&mut enc, &tex.create_view(&Default::default()));
        enc.copy_texture_to_buffer(
            tex.as_image_copy(),
            wgpu::TexelCopyBufferInfo {
                buffer: &buf,
                layout: wgpu::TexelCopyBufferLayout { offset: 0, bytes_per_row: Some(row), rows_per_image: Some(h) },
            },
            wgpu::Extent3d { width: w, height: h, depth_or_array_layers: 1 },
        );
        self.queue.submit([enc.finish()]);
        let (tx, rx) = std::sync::mpsc::channel();
        buf.slice(..).map_async(wgpu::MapMode::Read, move |r| {
            let _ = tx.send(r);
        });
        self.device.poll(wgpu::PollType::wait_indefinitely())?;
        rx.recv()??;
        let data = buf.slice(..).get_mapped_range().map_err(|e| format!("{e:?}"))?;
        let bgra = matches!(format, wgpu::TextureFormat::Bgra8Unorm | wgpu::TextureFormat::Bgra8UnormSrgb);
        let mut rgba = Vec::with_capacity((w * h * 4) as usize);
        for y in 0..h {
            for px in data[(y * row) as usize..(y * row + w * 4) as usize].chunks_exact(4) {
                if bgra {
                    rgba.extend_from_slice(&[px[2], px[1], px[0], 255]);
                } else {
                    rgba.extend_from_slice(&[px[0], px[1], px[2], 255]);
                }
            }
        }
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let mut png = png::Encoder::new(std::io::BufWriter::new(std::fs::File::create(path)?), w, h);
        png.set_color(png::ColorType::Rgba);
        png.set_depth(png::BitDepth::Eight);
        png.write_header()?.write_image_data(&rgba)?;
        Ok(())
    }
}

struct Session {
    gfx: Gfx,
    loaded: shared::Loaded,
    handle: RequestHandle,
    text: String,
    ids: Vec<u32>,
    finish: Option<&'static str>,
    done_at: Option<Instant>,
    log: shared::FrameLog,
    start: Instant,
    next_frame: Instant,
}

struct App {
    args: Args,
    instance: wgpu::Instance,
    session: Option<Session>,
    error: Option<Box<dyn std::error::Error>>,
}

impl App {
    fn start(&mut self, el: &ActiveEventLoop) -> Result<Session, Box<dyn std::error::Error>> {
        let (w, h): (u32, u32) = self
            .args
            .size
            .split_once('x')
            .and_then(|(w, h)| Some((w.parse().ok()?, h.parse().ok()?)))
            .ok_or("--size must be WIDTHxHEIGHT")?;
        let window = Arc::new(el.create_window(
            Window::default_attributes().with_title("Lantern: loading the model").with_inner_size(PhysicalSize::new(w, h)),
        )?);
        let surface = self.instance.create_surface(window.clone())?;
        let adapter = pollster::block_on(self.instance.request_adapter(&wgpu::RequestAdapterOptions {
            power_preference: wgpu::PowerPreference::HighPerformance,
            compatible_surface: Some(&surface),
            ..Default::default()
        }))?;
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("windowed host"),
            required_features: shared::wanted_features(&adapter),
            required_limits: adapter.limits(),
            ..Default::default()
        }))?;
        let size = window.inner_size();
        let config = surface
            .get_default_config(&adapter, size.width.max(1), size.height.max(1))
            .ok_or("the surface does not work with this adapter")?;
        surface.configure(&device, &config);
        let module = device
            .create_shader_module(wgpu::ShaderModuleDescriptor { label: Some("scene"), source: wgpu::ShaderSource::Wgsl(SHADER.into()) });
        let pipeline = device.create_render_pipeline(&wgpu::RenderPipelineDescriptor {
            label: Some("scene"),
            layout: None,
            vertex: wgpu::VertexState { module: &module, entry_point: Some("vs"), compilation_options: Default::default(), buffers: &[] },
            fragment: Some(wgpu::FragmentState {
                module: &module,
                entry_point: Some("fs"),
                compilation_options: Default::default(),
                targets: &[Some(config.format.into())],
            }),
            primitive: Default::default(),
            depth_stencil: None,
            multisample: Default::default(),
            multiview_mask: None,
            cache: None,
        });
        let uniform = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("frame"),
            size: std::mem::size_of::<FrameUniform>() as u64,
            usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let text_tex = Gfx::text_texture(&device, config.width);
        let bind = device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some("frame"),
            layout: &pipeline.get_bind_group_layout(0),
            entries: &[
                wgpu::BindGroupEntry { binding: 0, resource: uniform.as_entire_binding() },
                wgpu::BindGroupEntry {
                    binding: 1,
                    resource: wgpu::BindingResource::TextureView(&text_tex.create_view(&Default::default())),
                },
            ],
        });
        let gfx = Gfx {
            window: window.clone(),
            surface,
            config,
            device: device.clone(),
            queue: queue.clone(),
            pipeline,
            uniform,
            text_tex,
            bind,
        };
        gfx.render(0.0, None)?;
        let mut loaded = shared::load(&self.args.common, device, queue)?;
        eprintln!(
            "[{} on {} ({:?}) | loaded in {:.0} ms, warmed up in {:.0} ms | budget {:.1} ms per frame at {:.0} fps | {}x{} {:?}]",
            loaded.model_path.display(),
            loaded.ctx.info.name,
            loaded.ctx.info.backend,
            loaded.load_ms,
            loaded.warm_ms,
            self.args.common.budget_ms,
            self.args.common.fps,
            gfx.config.width,
            gfx.config.height,
            gfx.config.format
        );
        let handle = loaded.engine.submit(loaded.request.clone())?;
        window.set_title("Lantern: generating");
        let now = Instant::now();
        Ok(Session {
            gfx,
            loaded,
            handle,
            text: self.args.common.prompt.clone(),
            ids: Vec::new(),
            finish: None,
            done_at: None,
            log: shared::FrameLog::default(),
            start: now,
            next_frame: now,
        })
    }

    /// One frame: Lantern's share of the budget, the new text, then the animation.
    fn frame(&mut self) -> Result<bool, Box<dyn std::error::Error>> {
        let common = &self.args.common;
        let Some(s) = self.session.as_mut() else { return Ok(true) };
        let t = Instant::now();
        if !s.loaded.engine.is_idle() {
            let c = Instant::now();
            let r = pollster::block_on(s.loaded.engine.step_within(common.budget()))?;
            s.log.call_ms.push(c.elapsed().as_secs_f64() * 1e3);
            s.log.steps += r.step.is_some() as usize;
        }
        let mut changed = false;
        while let Ok(Some(ev)) = s.handle.try_next() {
            match ev {
                Event::Token { id, text, .. } => {
                    s.ids.push(id);
                    s.log.token_at.push(s.start.elapsed().as_secs_f64());
                    s.text.push_str(&text);
                    changed = true;
                }
                Event::Text(text) => {
                    s.text.push_str(&text);
                    changed = true;
                }
                Event::Done(g) => {
                    s.finish = Some(g.finish_reason.as_str());
                    s.done_at = Some(Instant::now());
                }
                Event::Error(m) => return Err(m.into()),
            }
        }
        if changed || s.log.frame_ms.is_empty() {
            s.gfx.upload_text(&s.text);
            let secs = s.start.elapsed().as_secs_f64();
            s.gfx.window.set_title(&format!(
                "Lantern: {} tokens, {:.1} tok/s on {}",
                s.ids.len(),
                s.ids.len() as f64 / secs.max(1e-3),
                s.loaded.ctx.info.name
            ));
        }
        let elapsed = s.start.elapsed().as_secs_f64();
        let over =
            if common.seconds > 0.0 { elapsed >= common.seconds } else { s.done_at.is_some_and(|d| d.elapsed() >= Duration::from_secs(1)) };
        s.gfx.render(elapsed as f32, if over { self.args.screenshot.as_deref() } else { None })?;
        s.log.frame_ms.push(t.elapsed().as_secs_f64() * 1e3);
        Ok(over)
    }

    fn finish(&mut self) {
        let Some(s) = self.session.take() else { return };
        let wall = s.start.elapsed().as_secs_f64();
        let _ = s.loaded.ctx.save_pipeline_cache();
        let budget = self.args.common.budget();
        if self.args.common.json {
            let v = serde_json::json!({
                "prompt_ids": s.loaded.request.prompt_ids,
                "output_ids": s.ids,
                "text": s.text,
                "finish_reason": s.finish,
                "adapter": s.loaded.ctx.info.name,
                "wall_s": wall,
                "frames": s.log.json(budget),
                "screenshot": self.args.screenshot,
            });
            println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
        } else {
            println!("{}", s.text);
            s.log.print(budget, s.ids.len(), wall);
            if let Some(p) = &self.args.screenshot {
                println!("screenshot: {}", p.display());
            }
        }
    }
}

impl ApplicationHandler for App {
    fn resumed(&mut self, el: &ActiveEventLoop) {
        if self.session.is_some() {
            return;
        }
        match self.start(el) {
            Ok(s) => self.session = Some(s),
            Err(e) => {
                self.error = Some(e);
                el.exit();
            }
        }
    }

    fn window_event(&mut self, el: &ActiveEventLoop, _id: WindowId, event: WindowEvent) {
        match event {
            WindowEvent::CloseRequested => {
                self.finish();
                el.exit();
            }
            WindowEvent::Resized(size) => {
                if let Some(s) = self.session.as_mut() {
                    s.gfx.resize(size);
                    s.gfx.upload_text(&s.text);
                }
            }
            WindowEvent::RedrawRequested => match self.frame() {
                Ok(false) => {}
                Ok(true) => {
                    self.finish();
                    el.exit();
                }
                Err(e) => {
                    self.error = Some(e);
                    self.session = None;
                    el.exit();
                }
            },
            _ => {}
        }
    }

    fn about_to_wait(&mut self, el: &ActiveEventLoop) {
        let frame = self.args.common.frame();
        if let Some(s) = self.session.as_mut() {
            let now = Instant::now();
            if now >= s.next_frame {
                s.gfx.window.request_redraw();
                // Pace to the frame rate; a late frame starts the next period from now.
                s.next_frame = (s.next_frame + frame).max(now);
            }
            el.set_control_flow(ControlFlow::WaitUntil(s.next_frame));
        }
    }
}

fn main() {
    let args = Args::parse();
    let run = || -> Result<(), Box<dyn std::error::Error>> {
        let event_loop = EventLoop::new()?;
        let instance =
            wgpu::Instance::new(wgpu::InstanceDescriptor::new_with_display_handle_from_env(Box::new(event_loop.owned_display_handle())));
        let mut app = App { args, instance, session: None, error: None };
        event_loop.run_app(&mut app)?;
        match app.error.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    };
    if let Err(e) = run() {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

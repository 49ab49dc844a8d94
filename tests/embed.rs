//! Lantern on a device the host application owns (`Engine::with_device`): two models share
//! the host's device while the host runs its own compute work between steps, and generate the
//! same tokens as on Lantern's own device; a destroyed device ends requests with a clear
//! error, and a new engine on a new device works in the same process.

mod common;

use std::sync::Arc;

use lantern::engine::{Engine, EngineOptions, Event, GenerateRequest, SamplingParams};
use lantern::model::forward::{GpuModel, ModelOptions};
use lantern::model::hf::load_hf_folder;
use lantern::model::tokenizer::Tokenizer;
use lantern::model::ModelWeights;

fn tokenizer() -> Arc<Tokenizer> {
    common::smollm2_tokenizer()
}

fn weights(name: &str) -> ModelWeights {
    load_hf_folder(&common::tiny_dir().join(name)).expect("tiny fixture")
}

/// The host's own device, made with plain wgpu the way an application would (the adapter's
/// limits, subgroups when offered).
fn host_device() -> (wgpu::Device, wgpu::Queue) {
    let instance = wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle_from_env());
    let adapter = pollster::block_on(instance.request_adapter(&wgpu::RequestAdapterOptions::default()))
        .expect("an adapter (lavapipe: WGPU_BACKEND=vulkan)");
    let features = adapter.features() & (wgpu::Features::SUBGROUP | wgpu::Features::SHADER_F16);
    pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
        label: Some("host"),
        required_features: features,
        required_limits: adapter.limits(),
        ..Default::default()
    }))
    .expect("host device")
}

fn request(prompt: Vec<u32>, n: usize) -> GenerateRequest {
    GenerateRequest {
        prompt_ids: prompt,
        max_tokens: n,
        sampling: SamplingParams::default(),
        stop_ids: vec![],
        stop_strings: vec![],
        speculation: Default::default(),
        constraint: None,
        logprobs: None,
        bias: Default::default(),
    }
}

fn opts() -> ModelOptions {
    ModelOptions { context: Some(64), max_seqs: 2, ..Default::default() }
}

/// Run one request to its end on `e`; the output ids.
fn run(e: &mut Engine, prompt: Vec<u32>, n: usize) -> Vec<u32> {
    let mut h = e.submit(request(prompt, n)).expect("submit");
    pollster::block_on(e.run_until_idle()).expect("run");
    loop {
        match h.try_next() {
            Ok(Some(Event::Done(g))) => return g.output_ids,
            Ok(Some(Event::Error(m))) => panic!("{m}"),
            Ok(Some(_)) => {}
            _ => panic!("no result"),
        }
    }
}

#[test]
fn two_models_share_the_host_device_beside_its_own_work() {
    let prompt: Vec<u32> = (3..20).collect();
    // References on Lantern's own device.
    let own = |name: &str| {
        let m = pollster::block_on(GpuModel::load(common::gpu(), &weights(name), opts())).unwrap();
        run(&mut Engine::new(m, tokenizer(), EngineOptions::default()), prompt.clone(), 8)
    };
    let (want_a, want_b) = (own("llama-gqa"), own("llama-mqa"));

    let (device, queue) = host_device();
    let mut a = pollster::block_on(Engine::with_device(
        device.clone(),
        queue.clone(),
        &weights("llama-gqa"),
        tokenizer(),
        opts(),
        EngineOptions::default(),
    ))
    .unwrap();
    let mut b = pollster::block_on(Engine::with_device(
        device.clone(),
        queue.clone(),
        &weights("llama-mqa"),
        tokenizer(),
        opts(),
        EngineOptions::default(),
    ))
    .unwrap();
    // The host's own work on the same queue: a buffer it clears and copies every "frame".
    let buf = device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("host"),
        size: 1 << 20,
        usage: wgpu::BufferUsages::COPY_DST | wgpu::BufferUsages::COPY_SRC,
        mapped_at_creation: false,
    });
    let buf2 = device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("host2"),
        size: 1 << 20,
        usage: wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    let mut ha = a.submit(request(prompt.clone(), 8)).unwrap();
    let mut hb = b.submit(request(prompt.clone(), 8)).unwrap();
    let mut frames = 0;
    while !(a.is_idle() && b.is_idle()) {
        let mut enc = device.create_command_encoder(&Default::default());
        enc.clear_buffer(&buf, 0, None);
        enc.copy_buffer_to_buffer(&buf, 0, &buf2, 0, 1 << 20);
        queue.submit([enc.finish()]);
        frames += 1;
        pollster::block_on(a.step()).unwrap();
        pollster::block_on(b.step()).unwrap();
    }
    assert!(frames >= 8);
    let done = |h: &mut lantern::engine::RequestHandle| loop {
        match h.try_next() {
            Ok(Some(Event::Done(g))) => return g.output_ids,
            Ok(Some(_)) => {}
            other => panic!("no result: {:?}", other.is_ok()),
        }
    };
    assert_eq!(done(&mut ha), want_a, "model A on the host device");
    assert_eq!(done(&mut hb), want_b, "model B on the host device");
}

#[test]
fn a_lost_device_ends_requests_with_an_error_and_a_new_device_works() {
    let prompt: Vec<u32> = (5..15).collect();
    let (device, queue) = host_device();
    let mut e = pollster::block_on(Engine::with_device(
        device.clone(),
        queue,
        &weights("llama-gqa"),
        tokenizer(),
        opts(),
        EngineOptions::default(),
    ))
    .unwrap();
    let mut h = e.submit(request(prompt.clone(), 30)).unwrap();
    let mut waiting = e.submit(request(prompt.clone(), 30)).unwrap();
    pollster::block_on(e.step()).unwrap();
    device.destroy();
    let _ = device.poll(wgpu::PollType::wait_indefinitely());
    let err = pollster::block_on(e.step()).expect_err("a step on a destroyed device");
    assert!(err.to_string().contains("lost"), "{err}");
    for h in [&mut h, &mut waiting] {
        let mut saw = None;
        while let Ok(Some(ev)) = h.try_next() {
            if let Event::Error(m) = ev {
                saw = Some(m);
            }
        }
        let m = saw.expect("the request ended with an error");
        assert!(m.contains("device was lost"), "{m}");
    }
    assert!(e.is_idle());
    // The same process, a new device: works.
    let (device2, queue2) = host_device();
    let mut e2 =
        pollster::block_on(Engine::with_device(device2, queue2, &weights("llama-gqa"), tokenizer(), opts(), EngineOptions::default()))
            .unwrap();
    let m = pollster::block_on(GpuModel::load(common::gpu(), &weights("llama-gqa"), opts())).unwrap();
    let want = run(&mut Engine::new(m, tokenizer(), EngineOptions::default()), prompt.clone(), 6);
    assert_eq!(run(&mut e2, prompt, 6), want);
}

/// What a host may move across threads: the engine (to a worker), handles and clients (to
/// UI or network threads), the context (shared).
#[test]
fn thread_safety_of_the_public_types() {
    fn send<T: Send>() {}
    fn send_sync<T: Send + Sync>() {}
    send::<Engine>();
    send::<GpuModel>();
    send::<lantern::engine::RequestHandle>();
    send_sync::<lantern::engine::EngineClient>();
    send_sync::<lantern::gpu::GpuContext>();
}

/// The frame-budgeted step: a host loop gives Lantern a 2 ms budget per frame while it does
/// its own GPU work; no call into Lantern on the frame path takes longer than its budget by
/// more than the margin (one batch of 8 dispatches plus a non-blocking poll), steps are
/// spread over frames, and the tokens equal those of the blocking path.
#[test]
fn frame_budgeted_steps_keep_the_budget_and_the_tokens() {
    use std::time::{Duration, Instant};
    let prompt: Vec<u32> = (7..40).collect();
    let m = pollster::block_on(GpuModel::load(common::gpu(), &weights("llama-gqa"), opts())).unwrap();
    let want = run(&mut Engine::new(m, tokenizer(), EngineOptions::default()), prompt.clone(), 12);

    let (device, queue) = host_device();
    let mut e = pollster::block_on(Engine::with_device(
        device.clone(),
        queue.clone(),
        &weights("llama-gqa"),
        tokenizer(),
        opts(),
        EngineOptions::default(),
    ))
    .unwrap();
    let buf = device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("host"),
        size: 1 << 16,
        usage: wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    let mut h = e.submit(request(prompt, 12)).unwrap();
    let budget = Duration::from_millis(2);
    // lavapipe runs submitted work on the submitting thread, so one call can take a batch
    // of 8 dispatches past the budget; the margin covers that on a loaded 2-core machine.
    let margin = Duration::from_millis(100);
    let (mut frames, mut steps, mut worst) = (0usize, 0usize, Duration::ZERO);
    let mut got = Vec::new();
    while !e.is_idle() {
        // The host's frame: its own work, then Lantern within the budget.
        let mut enc = device.create_command_encoder(&Default::default());
        enc.clear_buffer(&buf, 0, None);
        queue.submit([enc.finish()]);
        let t = Instant::now();
        let r = pollster::block_on(e.step_within(budget)).expect("frame step");
        worst = worst.max(t.elapsed());
        frames += 1;
        steps += r.step.is_some() as usize;
        while let Ok(Some(ev)) = h.try_next() {
            match ev {
                Event::Token { id, .. } => got.push(id),
                Event::Done(g) => assert_eq!(g.output_ids.len(), 12),
                Event::Error(m) => panic!("{m}"),
                Event::Text(_) => {}
            }
        }
        assert!(frames < 100_000, "no progress");
    }
    eprintln!("{frames} frames for {steps} steps; the longest call took {worst:?} (budget {budget:?})");
    assert_eq!(got, want, "frame-budgeted tokens equal the blocking path's");
    assert!(frames > steps, "steps were spread over frames");
    assert!(worst <= budget + margin, "a frame call took {worst:?}, budget {budget:?} + margin {margin:?}");
}

/// A host device created with `Features::PIPELINE_CACHE` gets Lantern's pipelines through
/// the driver's cache, persisted in a folder the host names: the next context (a new device,
/// as at the next start of the application) hands the saved data to the driver and produces
/// the same tokens. A device without the feature compiles as before.
#[test]
fn host_pipeline_cache_persists_across_devices() {
    use lantern::gpu::{DriverCacheState, GpuContext};
    let dir = std::env::temp_dir().join(format!("lantern-embed-pipelines-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let prompt: Vec<u32> = (3..12).collect();
    let cached_device = || {
        let instance = wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle_from_env());
        let adapter = pollster::block_on(instance.request_adapter(&wgpu::RequestAdapterOptions::default())).expect("adapter");
        assert!(adapter.features().contains(wgpu::Features::PIPELINE_CACHE), "lavapipe offers PIPELINE_CACHE");
        pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("host with a pipeline cache"),
            required_features: wgpu::Features::PIPELINE_CACHE | (adapter.features() & wgpu::Features::SUBGROUP),
            required_limits: adapter.limits(),
            ..Default::default()
        }))
        .expect("device")
    };
    let start = || {
        let (device, queue) = cached_device();
        let ctx = GpuContext::from_device_with_pipeline_cache(device, queue, &dir).unwrap();
        let model = pollster::block_on(GpuModel::load(ctx.clone(), &weights("llama-gqa"), opts())).unwrap();
        let ids = run(&mut Engine::new(model, tokenizer(), EngineOptions::default()), prompt.clone(), 4);
        let stats = ctx.pipelines.stats();
        let written = ctx.save_pipeline_cache().unwrap();
        (ids, stats, written)
    };
    let (first_ids, first, written) = start();
    assert!(matches!(first.driver_cache, DriverCacheState::Empty { .. }), "{first:?}");
    assert!(first.compiled > 0 && written > 0, "{first:?}, {written} bytes written");
    let (second_ids, second, _) = start();
    match &second.driver_cache {
        DriverCacheState::Loaded { bytes, .. } => {
            assert_eq!(*bytes + lantern::gpu::pipeline::ENVELOPE as u64, written, "the whole saved payload reached the driver")
        }
        other => panic!("expected the saved cache to load, got {other:?}"),
    }
    assert_eq!(second_ids, first_ids);

    // Without the feature: no driver cache, nothing written, same tokens.
    let (device, queue) = host_device();
    let ctx = GpuContext::from_device_with_pipeline_cache(device, queue, &dir.join("unused")).unwrap();
    let model = pollster::block_on(GpuModel::load(ctx.clone(), &weights("llama-gqa"), opts())).unwrap();
    assert_eq!(run(&mut Engine::new(model, tokenizer(), EngineOptions::default()), prompt, 4), first_ids);
    assert_eq!(ctx.pipelines.stats().driver_cache, DriverCacheState::Unsupported);
    assert_eq!(ctx.save_pipeline_cache().unwrap(), 0);
    assert!(!dir.join("unused").exists());
    let _ = std::fs::remove_dir_all(&dir);
}

/// A work budget: with `FrameBudget::dispatches(3)` no call submits more than three
/// dispatches, every step is spread over many calls, and the tokens are the blocking path's.
#[test]
fn a_work_budget_caps_the_dispatches_per_call() {
    use lantern::engine::FrameBudget;
    let prompt: Vec<u32> = (5..30).collect();
    let m = pollster::block_on(GpuModel::load(common::gpu(), &weights("llama-gqa"), opts())).unwrap();
    let want = run(&mut Engine::new(m, tokenizer(), EngineOptions::default()), prompt.clone(), 6);

    let (device, queue) = host_device();
    let mut e =
        pollster::block_on(Engine::with_device(device, queue, &weights("llama-gqa"), tokenizer(), opts(), EngineOptions::default()))
            .unwrap();
    let warm = pollster::block_on(e.warm_up()).unwrap();
    assert!(warm > 0.0);
    let mut h = e.submit(request(prompt, 6)).unwrap();
    let (mut calls, mut steps, mut most) = (0usize, 0usize, 0usize);
    let mut got = Vec::new();
    // Bounded by time, not by calls: a call that finds the readback not yet mapped returns at
    // once, so on a loaded 2-core machine (lavapipe runs the work on the same cores) a step
    // can take very many calls.
    let started = std::time::Instant::now();
    while !e.is_idle() {
        let r = pollster::block_on(e.step_within(FrameBudget::dispatches(3))).unwrap();
        most = most.max(r.submitted);
        calls += 1;
        steps += r.step.is_some() as usize;
        while let Ok(Some(ev)) = h.try_next() {
            if let Event::Token { id, .. } = ev {
                got.push(id);
            }
        }
        assert!(started.elapsed() < std::time::Duration::from_secs(300), "no progress after {calls} calls");
    }
    assert_eq!(got, want);
    assert!(most <= 3 && most > 0, "at most 3 dispatches per call, got {most}");
    assert!(calls >= steps * 3, "{calls} calls for {steps} steps");
}

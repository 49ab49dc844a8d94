//! The only code that touches wgpu: adapter choice, device creation with the adapter's real
//! limits and optional features, the shader registry and pipeline cache, buffers and readback.

pub mod buffer;
pub mod counters;
pub mod kernel_options;
pub mod memory;
pub mod pipeline;
pub mod preprocess;
pub mod shader;

use std::sync::Arc;

use serde::Serialize;

pub use buffer::{GpuTensor, Readback};
pub use counters::{HostCounters, HostCounts};
pub use kernel_options::{KernelOptions, MatmulLayout, MatvecLayout};
pub use pipeline::{DriverCacheState, PipelineCache, PipelineStats};
pub use shader::{Features, PipelineKey, ShaderOp};

/// Errors from the GPU layer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GpuError {
    #[error("no GPU adapter found{}{}", match .backend { Some(b) => format!(" for backend {b}"), None => String::new() }, if .available.is_empty() { String::new() } else { format!(" matching the request; available: {}", .available.join(", ")) })]
    NoAdapter { backend: Option<String>, available: Vec<String> },
    #[error("adapter {adapter}: device request failed: {reason}")]
    RequestDevice { adapter: String, reason: String },
    #[error("adapter {adapter} lacks {capability}, which Lantern needs: {why}")]
    MissingCapability { adapter: String, capability: String, why: String },
    #[error("shader `{label}`: {message}")]
    Shader { label: String, message: String },
    #[error("tensor `{tensor}` needs a binding of {bytes} bytes but the device allows {limit} (max_storage_buffer_binding_size); it must be split")]
    BindingTooLarge { tensor: String, bytes: u64, limit: u64 },
    #[error("allocating `{what}` ({bytes} bytes) failed: {reason}")]
    Allocation { what: String, bytes: u64, reason: String },
    #[error("GPU readback failed: {0}")]
    Readback(String),
    #[error("GPU validation error in {context}: {message}")]
    Validation { context: String, message: String },
    #[error("unknown backend `{0}` (expected vulkan, metal, dx12, gl or noop)")]
    UnknownBackend(String),
    #[error("the GPU device was lost ({0}); build a new engine on a new device")]
    DeviceLost(String),
}

/// What the kernels may use on this device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Capabilities {
    pub shader_f16: bool,
    pub subgroups: bool,
    pub timestamps: bool,
    pub subgroup_min_size: u32,
    pub subgroup_max_size: u32,
    /// The adapter is a CPU (lavapipe, SwiftShader, WARP): kernels that walk contiguous
    /// memory per invocation beat the usual coalesced layout there.
    pub cpu_like: bool,
}

/// A description of one adapter, as `lantern devices` prints it.
#[derive(Debug, Clone, Serialize)]
pub struct AdapterSummary {
    pub index: usize,
    pub name: String,
    pub backend: String,
    pub device_type: String,
    pub driver: String,
    pub driver_info: String,
    pub vendor: u32,
    pub device: u32,
    pub features: Vec<String>,
    pub limits: LimitsSummary,
}

/// The limits that matter for inference.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct LimitsSummary {
    pub max_buffer_size: u64,
    pub max_storage_buffer_binding_size: u64,
    pub max_storage_buffers_per_shader_stage: u32,
    pub max_compute_workgroup_storage_size: u32,
    pub max_compute_invocations_per_workgroup: u32,
    pub max_compute_workgroups_per_dimension: u32,
}

impl From<&wgpu::Limits> for LimitsSummary {
    fn from(l: &wgpu::Limits) -> Self {
        LimitsSummary {
            max_buffer_size: l.max_buffer_size,
            max_storage_buffer_binding_size: l.max_storage_buffer_binding_size,
            max_storage_buffers_per_shader_stage: l.max_storage_buffers_per_shader_stage,
            max_compute_workgroup_storage_size: l.max_compute_workgroup_storage_size,
            max_compute_invocations_per_workgroup: l.max_compute_invocations_per_workgroup,
            max_compute_workgroups_per_dimension: l.max_compute_workgroups_per_dimension,
        }
    }
}

/// How to choose an adapter and device.
#[derive(Debug, Clone, Default)]
pub struct DeviceOptions {
    /// Pin a backend: "vulkan", "metal", "dx12", "gl". `None`: all, or `WGPU_BACKEND`.
    pub backend: Option<String>,
    /// Pick an adapter by index (as `lantern devices` prints) or by a name substring.
    pub adapter: Option<String>,
    /// Cap on `max_storage_buffer_binding_size` (tests use this to force tensor splitting).
    pub max_binding_size: Option<u64>,
    /// Do not request optional features (shader-f16, subgroups, timestamps).
    pub no_optional_features: bool,
    /// Where the driver's pipeline cache persists between processes (Vulkan): the CLI uses
    /// `<cache dir>/pipelines`. `None`: compile every pipeline at every start.
    pub pipeline_cache_dir: Option<std::path::PathBuf>,
    /// Kernel layouts forced or switched off (default: the adapter's choices).
    pub kernels: KernelOptions,
}

fn parse_backend(name: &str) -> Result<wgpu::Backends, GpuError> {
    match name.to_ascii_lowercase().as_str() {
        "vulkan" | "vk" => Ok(wgpu::Backends::VULKAN),
        "metal" | "mtl" => Ok(wgpu::Backends::METAL),
        "dx12" | "d3d12" => Ok(wgpu::Backends::DX12),
        "gl" | "gles" | "opengl" => Ok(wgpu::Backends::GL),
        "webgpu" | "browser" => Ok(wgpu::Backends::BROWSER_WEBGPU),
        "noop" => Ok(wgpu::Backends::NOOP),
        other => Err(GpuError::UnknownBackend(other.to_string())),
    }
}

/// The limits the noop adapter reports: those of a mid-range discrete GPU through Vulkan
/// (wgpu-core panics on a device created with the noop adapter's own unbounded limits).
pub fn noop_limits() -> wgpu::Limits {
    wgpu::Limits {
        max_buffer_size: 4 << 30,
        max_storage_buffer_binding_size: (2 << 30) - 4,
        max_storage_buffers_per_shader_stage: 16,
        max_uniform_buffer_binding_size: 64 << 10,
        max_compute_workgroup_storage_size: 48 << 10,
        max_compute_invocations_per_workgroup: 1024,
        max_compute_workgroup_size_x: 1024,
        max_compute_workgroup_size_y: 1024,
        max_compute_workgroups_per_dimension: 65535,
        max_texture_dimension_2d: 16384,
        ..wgpu::Limits::default()
    }
}

/// Whether the noop backend was asked for, by `backend` or else by `WGPU_BACKEND`.
fn wants_noop(backend: Option<&str>) -> bool {
    let env = std::env::var("WGPU_BACKEND").ok();
    backend.or(env.as_deref()).is_some_and(|b| b.eq_ignore_ascii_case("noop"))
}

fn make_instance(backend: Option<&str>) -> Result<wgpu::Instance, GpuError> {
    let mut desc = wgpu::InstanceDescriptor::new_without_display_handle_from_env();
    if let Some(b) = backend {
        desc.backends = parse_backend(b)?;
    }
    // The noop backend stands in for a GPU that takes no time: a discrete GPU's limits,
    // subgroups of 32 and shader-f16, so the kernels choose the layouts a GPU gets.
    if wants_noop(backend) {
        desc.backend_options.noop = wgpu::NoopBackendOptions {
            enable: true,
            limits: Some(noop_limits()),
            features: Some(wgpu::Features::SHADER_F16 | wgpu::Features::SUBGROUP),
            device_type: Some(wgpu::DeviceType::DiscreteGpu),
            subgroup_min_size: Some(32),
            subgroup_max_size: Some(32),
        };
    }
    Ok(wgpu::Instance::new(desc))
}

fn device_type_rank(t: wgpu::DeviceType) -> u32 {
    match t {
        wgpu::DeviceType::DiscreteGpu => 0,
        wgpu::DeviceType::IntegratedGpu => 1,
        wgpu::DeviceType::VirtualGpu => 2,
        wgpu::DeviceType::Cpu => 3,
        wgpu::DeviceType::Other => 4,
    }
}

fn backend_rank(b: wgpu::Backend) -> u32 {
    match b {
        wgpu::Backend::Vulkan | wgpu::Backend::Metal | wgpu::Backend::Dx12 => 0,
        wgpu::Backend::BrowserWebGpu => 0,
        wgpu::Backend::Gl => 1,
        _ => 2,
    }
}

fn summarize(index: usize, a: &wgpu::Adapter) -> AdapterSummary {
    let info = a.get_info();
    let feats = a.features();
    let mut features = Vec::new();
    for (flag, name) in [
        (wgpu::Features::SHADER_F16, "shader-f16"),
        (wgpu::Features::SUBGROUP, "subgroups"),
        (wgpu::Features::TIMESTAMP_QUERY, "timestamp-query"),
        (wgpu::Features::PIPELINE_CACHE, "pipeline-cache"),
    ] {
        if feats.contains(flag) {
            features.push(name.to_string());
        }
    }
    AdapterSummary {
        index,
        name: info.name.clone(),
        backend: format!("{:?}", info.backend).to_lowercase(),
        device_type: format!("{:?}", info.device_type),
        driver: info.driver.clone(),
        driver_info: info.driver_info.clone(),
        vendor: info.vendor,
        device: info.device,
        features,
        limits: LimitsSummary::from(&a.limits()),
    }
}

/// Every adapter present, in the order `--adapter INDEX` refers to (best first).
pub async fn list_adapters(backend: Option<&str>) -> Result<Vec<AdapterSummary>, GpuError> {
    let instance = make_instance(backend)?;
    let adapters = sorted_adapters(&instance, backend).await?;
    Ok(adapters.iter().enumerate().map(|(i, a)| summarize(i, a)).collect())
}

async fn sorted_adapters(instance: &wgpu::Instance, backend: Option<&str>) -> Result<Vec<wgpu::Adapter>, GpuError> {
    let backends = match backend {
        Some(b) => parse_backend(b)?,
        None => instance_backends(),
    };
    #[allow(unused_mut)]
    let mut adapters = instance.enumerate_adapters(backends).await;
    #[cfg(target_arch = "wasm32")]
    if adapters.is_empty() {
        if let Ok(a) = instance
            .request_adapter(&wgpu::RequestAdapterOptions {
                power_preference: wgpu::PowerPreference::HighPerformance,
                ..Default::default()
            })
            .await
        {
            adapters.push(a);
        }
    }
    adapters.sort_by_key(|a| {
        let i = a.get_info();
        (device_type_rank(i.device_type), backend_rank(i.backend))
    });
    Ok(adapters)
}

fn instance_backends() -> wgpu::Backends {
    wgpu::Backends::from_env().unwrap_or(wgpu::Backends::all())
}

/// The device Lantern runs on, with what its kernels may use.
pub struct GpuContext {
    pub device: wgpu::Device,
    pub queue: wgpu::Queue,
    pub info: wgpu::AdapterInfo,
    pub limits: wgpu::Limits,
    pub caps: Capabilities,
    pub pipelines: PipelineCache,
    /// Every buffer this context created (see [`Ledger`]).
    pub ledger: Ledger,
    /// Set (with the driver's reason) when the device is lost or destroyed.
    pub lost: Arc<std::sync::Mutex<Option<String>>>,
    /// What the host has done on this device (dispatches, submits, waits...).
    pub counters: HostCounters,
    /// Kernel layouts forced or switched off on this context.
    pub kernels: KernelOptions,
}

/// What a buffer is for, as the allocation functions of `buffer.rs` know it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum AllocUsage {
    /// Storage buffer (weights, KV cache, activations).
    Storage,
    /// Uniform buffer (kernel parameters).
    Uniform,
    /// Host-readable staging buffer for readback.
    Readback,
    /// Texture (packed weights read through texel fetches on CPU adapters).
    Texture,
}

/// One buffer allocation.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Allocation {
    pub label: String,
    pub bytes: u64,
    pub usage: AllocUsage,
}

/// The record of every GPU buffer a context allocated: all allocations go through
/// `gpu::buffer`, which writes here, so a model can show where each byte went and tests can
/// check that nothing unaccounted (such as a float copy of a quantized weight) was made.
#[derive(Debug, Default)]
pub struct Ledger {
    entries: std::sync::Mutex<Vec<Allocation>>,
}

impl Ledger {
    pub fn record(&self, label: &str, bytes: u64, usage: AllocUsage) {
        if let Ok(mut e) = self.entries.lock() {
            e.push(Allocation { label: label.into(), bytes, usage });
        }
    }

    /// A position to list allocations from.
    pub fn mark(&self) -> usize {
        self.entries.lock().map_or(0, |e| e.len())
    }

    /// Allocations made since `mark`.
    pub fn since(&self, mark: usize) -> Vec<Allocation> {
        self.entries.lock().map_or_else(|_| Vec::new(), |e| e.get(mark..).unwrap_or(&[]).to_vec())
    }
}

impl std::fmt::Debug for GpuContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuContext")
            .field("adapter", &self.info.name)
            .field("backend", &self.info.backend)
            .field("caps", &self.caps)
            .finish()
    }
}

impl GpuContext {
    /// Choose the best adapter (discrete > integrated > virtual > CPU; native backends over
    /// GL) unless `opts` pins one, and request a device with the adapter's real limits and
    /// the optional features the kernels can use.
    pub async fn new(opts: &DeviceOptions) -> Result<Arc<GpuContext>, GpuError> {
        let backend = opts.backend.as_deref();
        let instance = make_instance(backend)?;
        let adapters = sorted_adapters(&instance, backend).await?;
        let names: Vec<String> = adapters
            .iter()
            .map(|a| {
                let i = a.get_info();
                format!("{} ({:?})", i.name, i.backend)
            })
            .collect();
        let chosen = match &opts.adapter {
            None => adapters.into_iter().next(),
            Some(sel) => {
                if let Ok(idx) = sel.parse::<usize>() {
                    adapters.into_iter().nth(idx)
                } else {
                    let sel_l = sel.to_lowercase();
                    adapters.into_iter().find(|a| a.get_info().name.to_lowercase().contains(&sel_l))
                }
            }
        };
        let adapter = chosen.ok_or_else(|| GpuError::NoAdapter {
            backend: backend.map(String::from).or_else(|| std::env::var("WGPU_BACKEND").ok()),
            available: names,
        })?;
        Self::from_adapter(adapter, opts).await
    }

    /// Request a device on a given adapter.
    pub async fn from_adapter(adapter: wgpu::Adapter, opts: &DeviceOptions) -> Result<Arc<GpuContext>, GpuError> {
        let info = adapter.get_info();
        let mut limits = adapter.limits();
        if let Some(cap) = opts.max_binding_size {
            limits.max_storage_buffer_binding_size = limits.max_storage_buffer_binding_size.min(cap);
        }
        let available = adapter.features();
        let mut wanted = wgpu::Features::empty();
        if !opts.no_optional_features {
            wanted |= wgpu::Features::SHADER_F16 | wgpu::Features::SUBGROUP | wgpu::Features::TIMESTAMP_QUERY;
        }
        if opts.pipeline_cache_dir.is_some() {
            wanted |= wgpu::Features::PIPELINE_CACHE;
        }
        let features = available & wanted;
        if limits.max_storage_buffers_per_shader_stage < 8 {
            return Err(GpuError::MissingCapability {
                adapter: info.name.clone(),
                capability: format!("8 storage buffers per shader stage (has {})", limits.max_storage_buffers_per_shader_stage),
                why: "the fused kernels bind up to 8 storage buffers".into(),
            });
        }
        if !adapter.get_downlevel_capabilities().flags.contains(wgpu::DownlevelFlags::COMPUTE_SHADERS) {
            return Err(GpuError::MissingCapability {
                adapter: info.name.clone(),
                capability: "compute shaders".into(),
                why: "every kernel is a compute shader".into(),
            });
        }
        let (device, queue) = adapter
            .request_device(&wgpu::DeviceDescriptor {
                label: Some("lantern"),
                required_features: features,
                required_limits: limits.clone(),
                experimental_features: wgpu::ExperimentalFeatures::disabled(),
                memory_hints: wgpu::MemoryHints::Performance,
                trace: wgpu::Trace::Off,
            })
            .await
            .map_err(|e| GpuError::RequestDevice { adapter: info.name.clone(), reason: e.to_string() })?;
        Ok(Self::wrap(device, queue, info, limits, opts.pipeline_cache_dir.as_deref(), opts.kernels))
    }

    /// Run on a device the host application already has (a game's or an editor's), sharing
    /// its queue: Lantern uses the features and limits the host requested (shader-f16 and
    /// subgroups when enabled, else the paths that need neither) and owns nothing global.
    /// The host keeps using the device meanwhile; see ARCHITECTURE.md for the rules.
    pub fn from_device(device: wgpu::Device, queue: wgpu::Queue) -> Result<Arc<GpuContext>, GpuError> {
        Self::host_device(device, queue, None)
    }

    fn host_device(
        device: wgpu::Device,
        queue: wgpu::Queue,
        pipeline_cache_dir: Option<&std::path::Path>,
    ) -> Result<Arc<GpuContext>, GpuError> {
        let info = device.adapter_info();
        let limits = device.limits();
        if limits.max_storage_buffers_per_shader_stage < 8 {
            return Err(GpuError::MissingCapability {
                adapter: info.name.clone(),
                capability: format!("8 storage buffers per shader stage (the device has {})", limits.max_storage_buffers_per_shader_stage),
                why: "the fused kernels bind up to 8 storage buffers; request the adapter's limits for the device".into(),
            });
        }
        Ok(Self::wrap(device, queue, info, limits, pipeline_cache_dir, KernelOptions::default()))
    }

    /// [`GpuContext::from_device`] with the driver's pipeline cache persisted in `dir`
    /// (native; the host's device must have been created with `Features::PIPELINE_CACHE`,
    /// else this is `from_device`). The second start of the host compiles no Lantern
    /// pipeline the driver has seen; call [`GpuContext::save_pipeline_cache`] after a model
    /// has run (dropping the context saves too).
    pub fn from_device_with_pipeline_cache(
        device: wgpu::Device,
        queue: wgpu::Queue,
        dir: &std::path::Path,
    ) -> Result<Arc<GpuContext>, GpuError> {
        Self::host_device(device, queue, Some(dir))
    }

    /// The same device, with the kernels choosing their variants and layouts as they would
    /// on an adapter with `caps`: a test can then walk the pipelines a GPU (or another CPU
    /// adapter) would ask for on this machine. `caps` may claim no shader-f16 or subgroups
    /// the device lacks (those pipelines would not compile); its own pipeline cache starts
    /// empty.
    pub fn with_caps(&self, caps: Capabilities) -> Result<Arc<GpuContext>, GpuError> {
        let has = self.device.features();
        for (want, feature, name) in
            [(caps.shader_f16, wgpu::Features::SHADER_F16, "shader-f16"), (caps.subgroups, wgpu::Features::SUBGROUP, "subgroups")]
        {
            if want && !has.contains(feature) {
                return Err(GpuError::MissingCapability {
                    adapter: self.info.name.clone(),
                    capability: name.into(),
                    why: "with_caps cannot claim a feature the device was not created with".into(),
                });
            }
        }
        Ok(self.derived(caps, self.kernels))
    }

    /// The same device with these kernel choices (its own pipeline cache, starting empty).
    pub fn with_kernels(&self, kernels: KernelOptions) -> Arc<GpuContext> {
        self.derived(self.caps, kernels)
    }

    fn derived(&self, caps: Capabilities, kernels: KernelOptions) -> Arc<GpuContext> {
        Arc::new(GpuContext {
            device: self.device.clone(),
            queue: self.queue.clone(),
            info: self.info.clone(),
            limits: self.limits.clone(),
            caps,
            pipelines: PipelineCache::default(),
            ledger: Ledger::default(),
            lost: self.lost.clone(),
            counters: HostCounters::default(),
            kernels,
        })
    }

    fn wrap(
        device: wgpu::Device,
        queue: wgpu::Queue,
        info: wgpu::AdapterInfo,
        limits: wgpu::Limits,
        pipeline_cache_dir: Option<&std::path::Path>,
        kernels: KernelOptions,
    ) -> Arc<GpuContext> {
        let features = device.features();
        let caps = Capabilities {
            shader_f16: features.contains(wgpu::Features::SHADER_F16),
            subgroups: features.contains(wgpu::Features::SUBGROUP),
            timestamps: features.contains(wgpu::Features::TIMESTAMP_QUERY),
            subgroup_min_size: info.subgroup_min_size,
            subgroup_max_size: info.subgroup_max_size,
            // The noop adapter calls itself a CPU (wgpu 30 ignores the device type asked of
            // it) but stands in for a GPU here.
            cpu_like: info.device_type == wgpu::DeviceType::Cpu && info.backend != wgpu::Backend::Noop,
        };
        let lost = Arc::new(std::sync::Mutex::new(None));
        let flag = lost.clone();
        device.set_device_lost_callback(move |reason, message| {
            if let Ok(mut l) = flag.lock() {
                *l = Some(format!("{reason:?}: {message}"));
            }
        });
        let pipelines = PipelineCache::for_device(&device, &info, pipeline_cache_dir);
        Arc::new(GpuContext {
            device,
            queue,
            info,
            limits,
            caps,
            pipelines,
            ledger: Ledger::default(),
            lost,
            counters: HostCounters::default(),
            kernels,
        })
    }

    /// Persist the driver's pipeline cache if pipelines were compiled since the last save
    /// (native; a no-op without a cache location). Returns the bytes written.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn save_pipeline_cache(&self) -> std::io::Result<u64> {
        self.pipelines.save()
    }

    /// The device-lost error, once the device is gone.
    pub fn check_lost(&self) -> Result<(), GpuError> {
        match self.lost.lock().ok().and_then(|l| l.clone()) {
            Some(reason) => Err(GpuError::DeviceLost(reason)),
            None => Ok(()),
        }
    }

    /// Adapter facts for reports (`--json`, `lantern devices`).
    pub fn adapter_json(&self) -> serde_json::Value {
        serde_json::json!({
            "name": self.info.name,
            "backend": format!("{:?}", self.info.backend).to_lowercase(),
            "device_type": format!("{:?}", self.info.device_type),
            "driver": self.info.driver,
            "driver_info": self.info.driver_info,
            "capabilities": self.caps,
            "limits": LimitsSummary::from(&self.limits),
        })
    }

    /// The largest storage binding, in bytes.
    pub fn max_binding(&self) -> u64 {
        self.limits.max_storage_buffer_binding_size
    }

    /// The kernel feature set this device supports.
    pub fn features(&self) -> Features {
        Features { f16: self.caps.shader_f16, subgroups: self.caps.subgroups }
    }
}

//! How much memory the device has, as far as anything will say: WebGPU exposes no memory
//! size, so native Vulkan is asked through wgpu's HAL (the largest device-local heap and its
//! `VK_EXT_memory_budget` budget), a CPU adapter on Linux reads `/proc/meminfo`, and
//! allocation probes under an out-of-memory error scope check a budget against the driver.

use serde::Serialize;

use super::{GpuContext, GpuError};

/// Where an [`AdapterMemory`] figure came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MemoryOrigin {
    /// `vkGetPhysicalDeviceMemoryProperties(2)`: the largest `DEVICE_LOCAL` heap.
    VulkanHeap,
    /// `/proc/meminfo` (a CPU adapter allocates from system memory).
    SystemMemory,
    /// Nothing reports a size.
    Unknown,
}

/// The device's memory, where the platform reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct AdapterMemory {
    /// Size of the largest device-local heap (system memory for a CPU adapter).
    pub device_local_bytes: Option<u64>,
    /// What the driver says this process may use of it now (`VK_EXT_memory_budget`, or
    /// `MemAvailable` for a CPU adapter).
    pub budget_bytes: Option<u64>,
    pub origin: MemoryOrigin,
    /// How the figures were obtained, or why there are none.
    pub source: String,
}

fn gib(b: u64) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

/// The device's memory: Vulkan heaps through the HAL, else `/proc/meminfo` for a CPU adapter
/// on Linux, else unknown (WebGPU, and the other native backends for now).
pub fn adapter_memory(ctx: &GpuContext) -> AdapterMemory {
    #[cfg(any(windows, target_os = "linux", target_os = "android", target_os = "freebsd"))]
    if let Some(m) = vulkan_memory(&ctx.device) {
        return m;
    }
    #[cfg(target_os = "linux")]
    if ctx.caps.cpu_like {
        if let Some(m) = system_memory() {
            return m;
        }
    }
    AdapterMemory {
        device_local_bytes: None,
        budget_bytes: None,
        origin: MemoryOrigin::Unknown,
        source: format!("WebGPU exposes no memory size (backend {:?}, {:?} adapter)", ctx.info.backend, ctx.info.device_type),
    }
}

/// The largest `DEVICE_LOCAL` heap of a Vulkan device and, with `VK_EXT_memory_budget`
/// enabled, its budget. `None` when the device is not a Vulkan one.
#[cfg(any(windows, target_os = "linux", target_os = "android", target_os = "freebsd"))]
fn vulkan_memory(device: &wgpu::Device) -> Option<AdapterMemory> {
    use ash::vk;

    // SAFETY: the HAL device is only read (physical-device queries), never destroyed or
    // used to create objects behind wgpu's back, and the guard is dropped before returning.
    let hal = unsafe { device.as_hal::<wgpu::hal::api::Vulkan>() }?;
    let pd = hal.raw_physical_device();
    let shared = hal.shared_instance();
    let instance = shared.raw_instance();
    // SAFETY: `pd` is the live physical device of this instance.
    let pd_version = unsafe { instance.get_physical_device_properties(pd) }.api_version;
    let v11 = shared.instance_api_version() >= vk::API_VERSION_1_1 && pd_version >= vk::API_VERSION_1_1;
    let with_budget = v11 && hal.enabled_device_extensions().contains(&ash::ext::memory_budget::NAME);
    let mut budget = vk::PhysicalDeviceMemoryBudgetPropertiesEXT::default();
    let props = if v11 {
        let mut p2 = vk::PhysicalDeviceMemoryProperties2::default();
        if with_budget {
            p2 = p2.push_next(&mut budget);
        }
        // SAFETY: Vulkan 1.1 instance and device; the chained struct's extension is enabled.
        unsafe { instance.get_physical_device_memory_properties2(pd, &mut p2) };
        p2.memory_properties
    } else {
        // SAFETY: core 1.0 query on a live physical device.
        unsafe { instance.get_physical_device_memory_properties(pd) }
    };
    let heaps = props.memory_heaps_as_slice();
    let local = |i: &usize| heaps[*i].flags.contains(vk::MemoryHeapFlags::DEVICE_LOCAL);
    // Every Vulkan device has a device-local heap; fall back to the largest heap regardless.
    let idx = (0..heaps.len()).filter(local).max_by_key(|&i| heaps[i].size).or_else(|| (0..heaps.len()).max_by_key(|&i| heaps[i].size))?;
    let size = heaps[idx].size;
    let heap_budget = with_budget.then(|| budget.heap_budget[idx]).filter(|&b| b > 0);
    let query = if v11 { "vkGetPhysicalDeviceMemoryProperties2" } else { "vkGetPhysicalDeviceMemoryProperties" };
    let source = format!(
        "Vulkan {query}: heap {idx} of {}{} ({:.2} GiB){}",
        heaps.len(),
        if local(&idx) { ", device-local" } else { ", the largest (no device-local heap)" },
        gib(size),
        match heap_budget {
            Some(b) => format!(", VK_EXT_memory_budget budget {:.2} GiB", gib(b)),
            None => ", no VK_EXT_memory_budget".into(),
        }
    );
    Some(AdapterMemory { device_local_bytes: Some(size), budget_bytes: heap_budget, origin: MemoryOrigin::VulkanHeap, source })
}

/// `MemTotal` and `MemAvailable` from `/proc/meminfo`.
#[cfg(target_os = "linux")]
fn system_memory() -> Option<AdapterMemory> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let field = |name: &str| -> Option<u64> {
        let line = text.lines().find(|l| l.starts_with(name))?;
        let kib: u64 = line[name.len()..].trim().trim_end_matches("kB").trim().parse().ok()?;
        Some(kib * 1024)
    };
    let total = field("MemTotal:");
    let available = field("MemAvailable:");
    if total.is_none() && available.is_none() {
        return None;
    }
    Some(AdapterMemory {
        device_local_bytes: total,
        budget_bytes: available,
        origin: MemoryOrigin::SystemMemory,
        source: format!(
            "/proc/meminfo (CPU adapter: system memory {:.2} GiB, MemAvailable {:.2} GiB)",
            gib(total.unwrap_or(0)),
            gib(available.unwrap_or(0))
        ),
    })
}

/// Share of the reported memory a default budget takes.
pub const DEFAULT_BUDGET_PERCENT: u64 = 90;

/// The budget when the user gives none: [`DEFAULT_BUDGET_PERCENT`] of the budget figure, or
/// of the heap size when there is no budget figure, with a line saying so. `None` when the
/// memory is unknown.
pub fn default_budget(mem: &AdapterMemory) -> Option<(u64, String)> {
    let (bytes, what, note) = match (mem.origin, mem.budget_bytes, mem.device_local_bytes) {
        (MemoryOrigin::VulkanHeap, Some(b), _) => (b, "the Vulkan device-local heap budget", ""),
        (MemoryOrigin::VulkanHeap, None, Some(s)) => (s, "the Vulkan device-local heap", "; no budget figure"),
        (MemoryOrigin::SystemMemory, Some(b), _) => (b, "available system memory", "; MemAvailable, CPU adapter"),
        (MemoryOrigin::SystemMemory, None, Some(s)) => (s, "system memory", "; MemTotal, CPU adapter"),
        (MemoryOrigin::Unknown, _, _) | (_, None, None) => return None,
    };
    let budget = bytes / 100 * DEFAULT_BUDGET_PERCENT + bytes % 100 * DEFAULT_BUDGET_PERCENT / 100;
    Some((budget, format!("{DEFAULT_BUDGET_PERCENT}% of {what} ({:.2} GiB{note})", gib(bytes))))
}

/// What an allocation probe managed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Probe {
    pub requested_bytes: u64,
    /// Bytes held at once before the buffers were destroyed.
    pub allocated_bytes: u64,
    pub buffers: u32,
    /// Size of the first (largest) buffer tried.
    pub chunk_bytes: u64,
    /// Halvings of the buffer size tried after the first failure.
    pub halvings: u32,
    /// The driver's error that stopped the probe short of `requested_bytes`.
    pub stopped_by: Option<String>,
}

impl Probe {
    /// Whether every requested byte was allocated.
    pub fn complete(&self) -> bool {
        self.allocated_bytes >= self.requested_bytes
    }
}

/// Allocate `bytes` as storage buffers of at most `min(chunk, max_buffer_size)` bytes each,
/// every one inside out-of-memory, validation and internal error scopes; stop at the first
/// failure; destroy them all. The buffers bypass the [`Ledger`](super::Ledger): nothing of
/// them outlives the call. A validation error is an `Err` (a bug, not a memory limit).
pub async fn probe(ctx: &GpuContext, bytes: u64, chunk: u64) -> Result<Probe, GpuError> {
    probe_largest(ctx, bytes, chunk, 0).await
}

/// [`probe`], but after a failure keep what was allocated and retry with half the buffer
/// size, up to `max_halvings` times, so the total found is within `chunk >> max_halvings`
/// of the most the driver allows (below `bytes`; never more than `bytes` is allocated).
pub async fn probe_largest(ctx: &GpuContext, bytes: u64, chunk: u64, max_halvings: u32) -> Result<Probe, GpuError> {
    let cap = if chunk == 0 { ctx.limits.max_buffer_size } else { chunk.min(ctx.limits.max_buffer_size) };
    let first = cap.max(4);
    let mut size = first;
    let mut held: Vec<wgpu::Buffer> = Vec::new();
    let mut allocated = 0u64;
    let mut halvings = 0;
    let mut stopped_by = None;
    let mut result = Ok(());
    while allocated < bytes {
        let want = size.min(bytes - allocated);
        let oom = ctx.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let validation = ctx.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let internal = ctx.device.push_error_scope(wgpu::ErrorFilter::Internal);
        let buffer = ctx.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("memory probe"),
            size: want,
            usage: wgpu::BufferUsages::STORAGE,
            mapped_at_creation: false,
        });
        // Pop all three (innermost first) before awaiting: the guards are not `Send`.
        let (internal, validation, oom) = (internal.pop(), validation.pop(), oom.pop());
        let (internal, validation, oom) = (internal.await, validation.await, oom.await);
        if let Some(e) = validation {
            buffer.destroy();
            result = Err(GpuError::Allocation {
                what: format!("memory probe buffer {} (after {allocated} bytes)", held.len()),
                bytes: want,
                reason: e.to_string(),
            });
            break;
        }
        if let Some(e) = oom.or(internal) {
            buffer.destroy();
            stopped_by = Some(format!("{want}-byte buffer after {allocated} bytes: {e}"));
            if halvings >= max_halvings || size / 2 < 4 {
                break;
            }
            halvings += 1;
            size /= 2;
            continue;
        }
        allocated += want;
        held.push(buffer);
    }
    let buffers = held.len() as u32;
    for b in held.drain(..) {
        b.destroy();
    }
    // Let wgpu free the memory now rather than at the next submission.
    let _ = ctx.device.poll(wgpu::PollType::wait_indefinitely());
    result?;
    if allocated >= bytes {
        stopped_by = None;
    }
    Ok(Probe { requested_bytes: bytes, allocated_bytes: allocated, buffers, chunk_bytes: first, halvings, stopped_by })
}

/// The device's buffer-to-buffer copy bandwidth in GB/s (bytes read per second): the median
/// of `reps` copies of a `bytes`-long buffer after one warm-up, timed from submit to
/// completion. The baseline kernel bandwidths are reported against (benches, `lantern devices
/// --bandwidth`, scripts/gpu-bench.sh). Native only (it blocks).
#[cfg(not(target_arch = "wasm32"))]
pub fn copy_bandwidth(ctx: &GpuContext, bytes: u64, reps: usize) -> Result<f64, GpuError> {
    let bytes = (bytes.min(ctx.limits.max_buffer_size) / 4 * 4).max(4);
    let make = |label: &str| {
        ctx.ledger.record(label, bytes, super::AllocUsage::Storage);
        ctx.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: bytes,
            usage: wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        })
    };
    let (src, dst) = (make("bandwidth.src"), make("bandwidth.dst"));
    let mut times = Vec::with_capacity(reps);
    for i in 0..=reps.max(1) {
        let t0 = std::time::Instant::now();
        let mut enc = ctx.device.create_command_encoder(&Default::default());
        enc.copy_buffer_to_buffer(&src, 0, &dst, 0, bytes);
        let idx = ctx.submit([enc.finish()]);
        ctx.wait(Some(idx))?;
        if i > 0 {
            times.push(t0.elapsed().as_secs_f64());
        }
    }
    times.sort_by(|a, b| a.total_cmp(b));
    Ok(bytes as f64 / times[times.len() / 2] / 1e9)
}

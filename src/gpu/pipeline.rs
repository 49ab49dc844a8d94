//! Compute pipelines, compiled once per `PipelineKey` and kept for the device's lifetime, and
//! the driver's pipeline cache that carries compiled code from one process to the next.
//!
//! Within a process, [`PipelineCache`] maps each key to its pipeline. Across processes, where
//! the device has `Features::PIPELINE_CACHE` (Vulkan), every pipeline is created against one
//! `wgpu::PipelineCache`; its data is written to disk (native builds, [`PipelineCache::save`])
//! and handed back to the driver at the next start, so the driver skips the compilation of
//! every pipeline it has seen. The file is wrapped in a small envelope of our own (magic,
//! length, checksum) because wgpu checks the header of the data but not its body: a torn or
//! corrupted file is refused here and never reaches the driver.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use serde::Serialize;

use super::shader::PipelineKey;
use super::GpuError;

/// What happened to the driver's pipeline cache at start.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum DriverCacheState {
    /// The backend has no pipeline cache (Metal, DX12, GL, the browser) or the device was
    /// created without `Features::PIPELINE_CACHE`.
    Unsupported,
    /// Supported, but no persistent location was given: pipelines are compiled every start.
    NotPersisted,
    /// No usable data yet (first start, or after a driver update): compiled and saved.
    Empty { path: String },
    /// Data from an earlier start was handed to the driver.
    Loaded { path: String, bytes: u64 },
    /// The file was there but unusable (truncated, corrupted, another adapter): ignored and
    /// replaced at the next save.
    Rejected { path: String, reason: String },
}

/// Pipeline compilation in this process.
#[derive(Debug, Clone, Serialize)]
pub struct PipelineStats {
    /// Pipelines compiled (each key once).
    pub compiled: u32,
    /// Wall time spent creating shader modules and pipelines, in milliseconds.
    pub compile_ms: f64,
    pub driver_cache: DriverCacheState,
}

/// The driver-side cache and where it persists.
struct DriverCache {
    cache: wgpu::PipelineCache,
    /// File the data is saved to (native only).
    #[cfg_attr(target_arch = "wasm32", allow(dead_code))]
    path: Option<std::path::PathBuf>,
    /// Pipelines compiled since the last save.
    dirty: bool,
}

/// Pipelines by key. Auto layouts: bind group layouts come from the shader itself.
pub struct PipelineCache {
    map: Mutex<HashMap<PipelineKey, Arc<wgpu::ComputePipeline>>>,
    driver: Mutex<Option<DriverCache>>,
    stats: Mutex<PipelineStats>,
}

impl Default for PipelineCache {
    fn default() -> Self {
        PipelineCache::with_state(None, DriverCacheState::Unsupported)
    }
}

const MAGIC: &[u8; 8] = b"LNTNPC01";
/// Bytes of the envelope [`seal`] puts before the driver data.
pub const ENVELOPE: usize = 8 + 8 + 8;

/// 64-bit FNV-1a: enough to tell a torn or flipped file from a good one (not adversarial).
fn checksum(data: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in data {
        h ^= b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// Wrap driver cache data for storage: magic, length, checksum, data.
pub fn seal(data: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(ENVELOPE + data.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&(data.len() as u64).to_le_bytes());
    out.extend_from_slice(&checksum(data).to_le_bytes());
    out.extend_from_slice(data);
    out
}

/// The driver data inside a sealed file, or why it cannot be used.
pub fn unseal(file: &[u8]) -> Result<&[u8], String> {
    if file.len() < ENVELOPE {
        return Err(format!("truncated: {} bytes, the header alone is {ENVELOPE}", file.len()));
    }
    if &file[..8] != MAGIC {
        return Err("not a Lantern pipeline cache (bad magic)".into());
    }
    let len = u64::from_le_bytes(file[8..16].try_into().unwrap_or_default());
    let sum = u64::from_le_bytes(file[16..24].try_into().unwrap_or_default());
    let data = &file[ENVELOPE..];
    if data.len() as u64 != len {
        return Err(format!("truncated or extended: header says {len} bytes of data, file has {}", data.len()));
    }
    if checksum(data) != sum {
        return Err("corrupted: checksum mismatch".into());
    }
    Ok(data)
}

impl PipelineCache {
    fn with_state(driver: Option<DriverCache>, state: DriverCacheState) -> Self {
        PipelineCache {
            map: Mutex::new(HashMap::new()),
            driver: Mutex::new(driver),
            stats: Mutex::new(PipelineStats { compiled: 0, compile_ms: 0.0, driver_cache: state }),
        }
    }

    /// A cache backed by the driver's pipeline cache when the device has
    /// `Features::PIPELINE_CACHE`, seeded from `dir` (native) and saved back there.
    pub(crate) fn for_device(device: &wgpu::Device, info: &wgpu::AdapterInfo, dir: Option<&std::path::Path>) -> Self {
        if !device.features().contains(wgpu::Features::PIPELINE_CACHE) {
            return Self::default();
        }
        let Some(key) = wgpu::util::pipeline_cache_key(info) else {
            return Self::default();
        };
        #[cfg(target_arch = "wasm32")]
        let _ = (dir, &key);
        #[cfg(target_arch = "wasm32")]
        let (path, state, data): (Option<std::path::PathBuf>, DriverCacheState, Option<Vec<u8>>) =
            (None, DriverCacheState::NotPersisted, None);
        #[cfg(not(target_arch = "wasm32"))]
        let (path, state, data) = match dir {
            None => (None, DriverCacheState::NotPersisted, None),
            Some(dir) => {
                let path = dir.join(format!("{key}.bin"));
                let shown = path.display().to_string();
                match std::fs::read(&path) {
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => (Some(path), DriverCacheState::Empty { path: shown }, None),
                    Err(e) => (Some(path), DriverCacheState::Rejected { path: shown, reason: e.to_string() }, None),
                    Ok(file) => match unseal(&file) {
                        Ok(data) => {
                            let bytes = data.len() as u64;
                            (Some(path), DriverCacheState::Loaded { path: shown, bytes }, Some(data.to_vec()))
                        }
                        Err(reason) => {
                            log::warn!("pipeline cache {shown}: {reason}; ignoring it");
                            (Some(path), DriverCacheState::Rejected { path: shown, reason }, None)
                        }
                    },
                }
            }
        };
        // SAFETY: `data` is only ever what `PipelineCache::get_data` returned on a device with
        // the same `pipeline_cache_key` (the file name), checked byte for byte against our
        // checksum; wgpu validates its own header (adapter, driver, version) on top, and
        // `fallback` makes data the driver rejects start an empty cache instead of failing.
        let scope = device.push_error_scope(wgpu::ErrorFilter::Validation);
        let cache = unsafe {
            device.create_pipeline_cache(&wgpu::PipelineCacheDescriptor {
                label: Some("lantern pipelines"),
                data: data.as_deref(),
                fallback: true,
            })
        };
        // The error scope only reports validation problems of the call itself; an invalid
        // cache object would make every pipeline fail, so fall back to no cache then.
        if let Some(e) = pop_scope_now(scope) {
            log::warn!("pipeline cache: {e}; compiling without one");
            return Self::default();
        }
        let driver = DriverCache { cache, path, dirty: false };
        Self::with_state(Some(driver), state)
    }

    /// The keys of every pipeline compiled so far.
    pub fn keys(&self) -> Vec<PipelineKey> {
        self.map.lock().map(|m| m.keys().copied().collect()).unwrap_or_default()
    }

    /// Number of compiled pipelines.
    pub fn len(&self) -> usize {
        self.map.lock().map(|m| m.len()).unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// What this process compiled so far, and the driver cache's state.
    pub fn stats(&self) -> PipelineStats {
        self.stats.lock().map(|s| s.clone()).unwrap_or(PipelineStats {
            compiled: 0,
            compile_ms: 0.0,
            driver_cache: DriverCacheState::Unsupported,
        })
    }

    /// The driver's cache data now (sealed as [`seal`] stores it), if the device has one.
    pub fn data(&self) -> Option<Vec<u8>> {
        let d = self.driver.lock().ok()?;
        d.as_ref()?.cache.get_data().map(|data| seal(&data))
    }

    /// Write the driver's cache data to its file when pipelines were compiled since the last
    /// save: a temporary file renamed into place, so a concurrent reader never sees half a
    /// file. Returns the bytes written (0 when there was nothing new or nowhere to write).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn save(&self) -> std::io::Result<u64> {
        let Ok(mut guard) = self.driver.lock() else { return Ok(0) };
        let Some(d) = guard.as_mut() else { return Ok(0) };
        let Some(path) = d.path.clone() else { return Ok(0) };
        if !d.dirty {
            return Ok(0);
        }
        let Some(data) = d.cache.get_data() else { return Ok(0) };
        let sealed = seal(&data);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)?;
        }
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        std::fs::write(&tmp, &sealed)?;
        std::fs::rename(&tmp, &path)?;
        d.dirty = false;
        Ok(sealed.len() as u64)
    }

    /// The pipeline for `key`, compiling it on first use. Shader errors are captured in an
    /// error scope and returned, never raised as an uncaptured device error.
    pub async fn get(&self, device: &wgpu::Device, key: PipelineKey) -> Result<Arc<wgpu::ComputePipeline>, GpuError> {
        if let Some(p) = self.map.lock().ok().and_then(|m| m.get(&key).cloned()) {
            return Ok(p);
        }
        let label = key.label();
        let src = key.expand().map_err(|e| GpuError::Shader { label: label.clone(), message: e.to_string() })?;
        let t0 = web_time::Instant::now();
        let scope_v = device.push_error_scope(wgpu::ErrorFilter::Validation);
        let scope_i = device.push_error_scope(wgpu::ErrorFilter::Internal);
        let module =
            device.create_shader_module(wgpu::ShaderModuleDescriptor { label: Some(&label), source: wgpu::ShaderSource::Wgsl(src.into()) });
        let pipeline = {
            let driver = self.driver.lock().ok();
            let cache = driver.as_ref().and_then(|d| d.as_ref()).map(|d| &d.cache);
            device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(&label),
                layout: None,
                module: &module,
                entry_point: Some("main"),
                compilation_options: wgpu::PipelineCompilationOptions::default(),
                cache,
            })
        };
        let elapsed = t0.elapsed().as_secs_f64() * 1e3;
        let internal = scope_i.pop().await;
        let validation = scope_v.pop().await;
        if let Some(e) = validation.or(internal) {
            return Err(GpuError::Shader { label, message: e.to_string() });
        }
        if let Ok(mut s) = self.stats.lock() {
            s.compiled += 1;
            s.compile_ms += elapsed;
        }
        if let Ok(mut d) = self.driver.lock() {
            if let Some(d) = d.as_mut() {
                d.dirty = true;
            }
        }
        let p = Arc::new(pipeline);
        if let Ok(mut m) = self.map.lock() {
            m.insert(key, p.clone());
        }
        Ok(p)
    }
}

impl Drop for PipelineCache {
    /// Save what was compiled since the last save, so a host that forgets to call
    /// `save_pipeline_cache` still starts warm next time.
    fn drop(&mut self) {
        #[cfg(not(target_arch = "wasm32"))]
        if let Err(e) = self.save() {
            log::warn!("pipeline cache: saving failed: {e}");
        }
    }
}

/// Pop an error scope without an executor: wgpu's native scopes resolve immediately (the
/// future is ready on first poll); anything still pending is treated as no error.
fn pop_scope_now(scope: wgpu::ErrorScopeGuard) -> Option<wgpu::Error> {
    use std::future::Future;
    let mut fut = std::pin::pin!(scope.pop());
    let waker = std::task::Waker::noop();
    let mut cx = std::task::Context::from_waker(waker);
    match fut.as_mut().poll(&mut cx) {
        std::task::Poll::Ready(e) => e,
        std::task::Poll::Pending => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seal_round_trips_and_refuses_damage() {
        let data: Vec<u8> = (0..1000u32).map(|i| (i * 7 % 251) as u8).collect();
        let sealed = seal(&data);
        assert_eq!(unseal(&sealed).unwrap(), &data[..]);
        // Truncated anywhere.
        for cut in [0, 5, ENVELOPE, sealed.len() - 1] {
            assert!(unseal(&sealed[..cut]).is_err(), "cut at {cut}");
        }
        // One flipped bit in the body.
        let mut bad = sealed.clone();
        bad[ENVELOPE + 500] ^= 0x10;
        assert!(unseal(&bad).unwrap_err().contains("checksum"));
        // Extended.
        let mut long = sealed.clone();
        long.push(0);
        assert!(unseal(&long).is_err());
        // Another format.
        let mut other = sealed;
        other[0] = b'X';
        assert!(unseal(&other).unwrap_err().contains("magic"));
    }
}

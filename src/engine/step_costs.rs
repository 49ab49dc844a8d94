//! What a step of each width costs on this adapter, measured before speculative decoding
//! chooses how many tokens to draft, and kept per adapter and model so that later runs start
//! from it.
//!
//! Speculation pays only where a verify step of 1 + k tokens costs much less than 1 + k
//! single-token steps, and how much less depends on the adapter (a GPU reads each weight once
//! for every width up to its batched kernel's; a CPU adapter's batched kernel may cost
//! three single steps for four tokens). Guessing that cost made a user's first request slower
//! than plain decoding, so [`ensure`] measures the widths a request may use before its first
//! draft (a short warm-up on scratch sequences, stated in `SpecStats::warmup_ms`), and the
//! CLI keeps them in a small JSON file per adapter and model ([`load`], [`save`]) next to the
//! pipeline cache. During a request the costs keep being refined from its own steps.

use super::speculative::{Drafter, Speculation};
use crate::model::forward::GpuModel;
use crate::Result;

/// Tokens before the measured steps (a short context, as early in a request).
const PREFIX: usize = 32;

/// Timed steps per width (the request refines the figures as it runs).
const REPS: usize = 1;

/// The target step widths a request with `s` may run and whose cost decides its k: one token
/// (a plain step) and verify steps of 2, 4 and 8 tokens, or 1 + k for a fixed k; within what
/// one step of `model` can hold. Widths between measured ones are costed as the next measured
/// width above them, widths past the widest as proportionally dearer
/// (`DraftLength`: an unmeasured width is assumed expensive, not cheap).
pub fn target_widths(model: &GpuModel, s: &Speculation) -> Vec<usize> {
    let most = model.options.max_batch_tokens.min(model.logit_rows);
    let mut w: Vec<usize> = match s.draft_tokens {
        Some(k) => vec![1, k + 1],
        None => [1usize, 2, 4, 8].into_iter().filter(|&w| w <= s.max_draft + 1).collect(),
    };
    w.retain(|&w| w >= 1 && w <= most);
    w.dedup();
    w
}

/// The draft model's widths: one token (each draft after the first) and two (the first
/// draft step also takes the token the target emitted last).
pub fn draft_widths(draft: &GpuModel) -> Vec<usize> {
    let most = draft.options.max_batch_tokens.min(draft.logit_rows);
    [1usize, 2].into_iter().filter(|&w| w <= most).collect()
}

/// Measure the widths of [`target_widths`] (and the draft's, for `Drafter::Model`) that
/// `target` and `draft` have no cost for yet. Returns the milliseconds spent (0 when all
/// were known). Adaptive requests only: a fixed k needs no costs.
pub async fn ensure(target: &mut GpuModel, draft: Option<&mut GpuModel>, s: &Speculation) -> Result<f64> {
    if !s.enabled() || s.draft_tokens.is_some() {
        return Ok(0.0);
    }
    let t0 = web_time::Instant::now();
    let mut measured = false;
    let missing = |m: &GpuModel, widths: Vec<usize>| -> Vec<usize> {
        widths.into_iter().filter(|&w| m.step_costs().get(w).copied().flatten().is_none()).collect()
    };
    let tw = missing(target, target_widths(target, s));
    let context = target.kv.alloc.config.context;
    if !tw.is_empty() && PREFIX + tw.iter().max().copied().unwrap_or(0) < context {
        target.measure_step_costs(PREFIX, &tw, REPS).await?;
        measured = true;
    }
    // Where verify steps alone rule drafting out (free drafts would not pay), the draft
    // model's cost does not matter.
    let hopeless = super::speculative::DraftLength::new(s).with_costs(target.step_costs(), None).hopeless(s.max_draft);
    if let (Drafter::Model, Some(d), false) = (s.drafter, draft, hopeless) {
        let dw = missing(d, draft_widths(d));
        if !dw.is_empty() && PREFIX + 2 < d.kv.alloc.config.context {
            d.measure_step_costs(PREFIX, &dw, REPS).await?;
            measured = true;
        }
    }
    Ok(if measured { t0.elapsed().as_secs_f64() * 1e3 } else { 0.0 })
}

/// The file a model's step costs are kept in on this adapter: `dir/<adapter>/<model_key>.json`,
/// names reduced to letters, digits, `.`, `-` and `_`. `model_key` names the model as
/// loaded (its file, size and whatever changes its kernels: KV dtype, weight precision).
/// The file name also carries a fingerprint of the kernels (every shader source, the
/// context's `KernelOptions` and Lantern's version): costs measured with other kernels are
/// not read back.
#[cfg(not(target_arch = "wasm32"))]
pub fn path(
    dir: &std::path::Path,
    adapter: &wgpu::AdapterInfo,
    kernels: &crate::gpu::KernelOptions,
    model_key: &str,
) -> std::path::PathBuf {
    let clean = |s: &str| -> String {
        let s: String = s.chars().map(|c| if c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_') { c } else { '_' }).collect();
        s.chars().take(96).collect()
    };
    let a = format!("{}-{:?}-{}-{}", adapter.name, adapter.backend, adapter.driver, adapter.driver_info);
    dir.join(clean(&a)).join(format!("{}-k{:016x}.json", clean(model_key), kernels_fingerprint(kernels)))
}

/// FNV-1a over the shader sources' fingerprint, the context's kernel choices and the crate
/// version.
#[cfg(not(target_arch = "wasm32"))]
fn kernels_fingerprint(kernels: &crate::gpu::KernelOptions) -> u64 {
    let mut h = crate::gpu::shader::sources_fingerprint();
    for b in format!("{kernels:?}{}", env!("CARGO_PKG_VERSION")).bytes() {
        h = (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// The file's contents.
#[cfg(not(target_arch = "wasm32"))]
#[derive(serde::Serialize, serde::Deserialize)]
struct CostFile {
    version: u32,
    /// Milliseconds of one sequence's step by width (tokens).
    step_ms: std::collections::BTreeMap<usize, f64>,
}

#[cfg(not(target_arch = "wasm32"))]
const VERSION: u32 = 1;

/// Give `model` the step costs kept at `path`; returns how many widths it had (0 when there
/// is no file). A file that does not parse is ignored (and replaced by the next [`save`]).
#[cfg(not(target_arch = "wasm32"))]
pub fn load(model: &mut GpuModel, path: &std::path::Path) -> usize {
    let costs = read(path);
    for &(w, ms) in &costs {
        model.record_step_ms(w, ms);
    }
    costs.len()
}

/// Keep `model`'s step costs at `path` (its folder is created).
#[cfg(not(target_arch = "wasm32"))]
pub fn save(model: &GpuModel, path: &std::path::Path) -> std::io::Result<()> {
    write(path, model.step_costs())
}

/// The (width, milliseconds) pairs kept at `path`: none when there is no file or it does not
/// parse (a warning), or is of another version.
#[cfg(not(target_arch = "wasm32"))]
pub fn read(path: &std::path::Path) -> Vec<(usize, f64)> {
    let Ok(text) = std::fs::read_to_string(path) else {
        return Vec::new();
    };
    match serde_json::from_str::<CostFile>(&text) {
        Ok(f) if f.version == VERSION => f.step_ms.into_iter().filter(|(w, ms)| *w > 0 && ms.is_finite() && *ms > 0.0).collect(),
        Ok(_) => Vec::new(),
        Err(e) => {
            log::warn!("step costs {}: {e}; measuring them again", path.display());
            Vec::new()
        }
    }
}

/// The step costs kept at `path` as a table indexed by width (`None` where not measured;
/// empty without a file).
#[cfg(not(target_arch = "wasm32"))]
pub fn table(path: &std::path::Path) -> Vec<Option<f64>> {
    let mut t = Vec::new();
    for (w, ms) in read(path) {
        if w < 65 {
            if t.len() <= w {
                t.resize(w + 1, None);
            }
            t[w] = Some(ms);
        }
    }
    t
}

/// Keep `step_ms` (index: width) at `path`, written whole and then renamed so that a reader
/// never sees half a file.
#[cfg(not(target_arch = "wasm32"))]
pub fn write(path: &std::path::Path, step_ms: &[Option<f64>]) -> std::io::Result<()> {
    let step_ms = step_ms.iter().enumerate().filter_map(|(w, v)| v.map(|v| (w, v))).collect();
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let text = serde_json::to_string_pretty(&CostFile { version: VERSION, step_ms }).map_err(std::io::Error::other)?;
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path)
}

#[cfg(all(test, not(target_arch = "wasm32")))]
mod tests {
    use super::*;

    #[test]
    fn costs_survive_a_round_trip_and_bad_files_are_ignored() {
        let dir = std::env::temp_dir().join(format!("lantern-costs-{}", std::process::id()));
        let info = wgpu::AdapterInfo {
            name: "Some GPU / (rev 2)".into(),
            driver: "drv".into(),
            driver_info: "1.2 beta".into(),
            ..wgpu::AdapterInfo::new(wgpu::DeviceType::DiscreteGpu, wgpu::Backend::Vulkan)
        };
        let kernels = crate::gpu::KernelOptions::default();
        let p = path(&dir, &info, &kernels, "model one.gguf-123-F32");
        let name = p.strip_prefix(&dir).unwrap().to_string_lossy().to_string();
        assert!(name.chars().all(|c| c.is_ascii_alphanumeric() || "._-/".contains(c)), "{name}");
        assert!(name.contains("Vulkan") && name.contains("model_one.gguf-123-F32-k") && name.ends_with(".json"), "{name}");
        // Other kernel choices, other file: their costs are not read back.
        let other = crate::gpu::KernelOptions { weight_textures: false, ..kernels };
        assert_ne!(path(&dir, &info, &other, "model one.gguf-123-F32"), p);
        assert!(read(&p).is_empty(), "no file yet");
        write(&p, &[None, Some(10.5), None, None, Some(30.0)]).unwrap();
        assert_eq!(read(&p), vec![(1, 10.5), (4, 30.0)]);
        std::fs::write(&p, "{not json").unwrap();
        assert!(read(&p).is_empty(), "a corrupt file is ignored");
        std::fs::write(&p, r#"{"version": 1, "step_ms": {"0": 5.0, "2": -1.0, "3": 7.0}}"#).unwrap();
        assert_eq!(read(&p), vec![(3, 7.0)], "zero widths and non-positive costs are dropped");
        std::fs::write(&p, r#"{"version": 99, "step_ms": {"3": 7.0}}"#).unwrap();
        assert!(read(&p).is_empty(), "another version is ignored");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

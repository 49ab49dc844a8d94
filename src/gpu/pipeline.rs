//! Compute pipelines, compiled once per `PipelineKey` and cached for the device's lifetime.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::shader::PipelineKey;
use super::GpuError;

/// Pipelines by key. Auto layouts: bind group layouts come from the shader itself.
#[derive(Default)]
pub struct PipelineCache {
    map: Mutex<HashMap<PipelineKey, Arc<wgpu::ComputePipeline>>>,
}

impl PipelineCache {
    /// Number of compiled pipelines.
    pub fn len(&self) -> usize {
        self.map.lock().map(|m| m.len()).unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The pipeline for `key`, compiling it on first use. Shader errors are captured in an
    /// error scope and returned, never raised as an uncaptured device error.
    pub async fn get(
        &self,
        device: &wgpu::Device,
        key: PipelineKey,
    ) -> Result<Arc<wgpu::ComputePipeline>, GpuError> {
        if let Some(p) = self.map.lock().ok().and_then(|m| m.get(&key).cloned()) {
            return Ok(p);
        }
        let label = key.label();
        let src = key.expand().map_err(|e| GpuError::Shader {
            label: label.clone(),
            message: e.to_string(),
        })?;
        let scope_v = device.push_error_scope(wgpu::ErrorFilter::Validation);
        let scope_i = device.push_error_scope(wgpu::ErrorFilter::Internal);
        let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
            label: Some(&label),
            source: wgpu::ShaderSource::Wgsl(src.into()),
        });
        let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some(&label),
            layout: None,
            module: &module,
            entry_point: Some("main"),
            compilation_options: wgpu::PipelineCompilationOptions::default(),
            cache: None,
        });
        let internal = scope_i.pop().await;
        let validation = scope_v.pop().await;
        if let Some(e) = validation.or(internal) {
            return Err(GpuError::Shader {
                label,
                message: e.to_string(),
            });
        }
        let p = Arc::new(pipeline);
        if let Ok(mut m) = self.map.lock() {
            m.insert(key, p.clone());
        }
        Ok(p)
    }
}

//! One Rust file per GPU op: the uniform struct that mirrors the WGSL `Params`, shape checks,
//! variant choice by device capability, and construction of ready-to-encode dispatches.
//! The CPU oracle for each op lives in `crate::reference::ops`.

pub mod argmax;
pub mod attention;
pub mod embedding;
pub mod linear;
pub mod rmsnorm;
pub mod rope_kv;

use std::sync::Arc;

use crate::gpu::{GpuContext, GpuError, PipelineKey};

/// Mirrors `struct Step` in `shaders/common/step.wgsl`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct StepUniform {
    pub n_tokens: u32,
    pub n_out: u32,
    pub _pad: [u32; 2],
}

/// A workgroup-count dimension that may depend on the step's sizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dim {
    Const(u32),
    /// The step's token count.
    Tokens,
    /// ceil(tokens / n).
    TokensDiv(u32),
    /// Rows whose logits are computed.
    Out,
}

impl Dim {
    fn eval(&self, n_tokens: u32, n_out: u32) -> u32 {
        match *self {
            Dim::Const(c) => c,
            Dim::Tokens => n_tokens,
            Dim::TokensDiv(d) => n_tokens.div_ceil(d),
            Dim::Out => n_out,
        }
    }
}

/// A recorded kernel invocation: pipeline, bind group (built once at load) and grid.
pub struct Dispatch {
    pub label: String,
    pub pipeline: Arc<wgpu::ComputePipeline>,
    pub bind_group: wgpu::BindGroup,
    pub grid: [Dim; 3],
}

impl Dispatch {
    /// Record this dispatch into a compute pass for a step of `n_tokens` rows.
    pub fn encode(&self, pass: &mut wgpu::ComputePass<'_>, n_tokens: u32, n_out: u32) {
        let [x, y, z] = self.grid.map(|d| d.eval(n_tokens, n_out));
        if x == 0 || y == 0 || z == 0 {
            return;
        }
        pass.set_pipeline(&self.pipeline);
        pass.set_bind_group(0, &self.bind_group, &[]);
        pass.dispatch_workgroups(x, y, z);
    }
}

/// Build a bind group for `pipeline` from (binding, buffer) pairs.
pub fn bind(
    ctx: &GpuContext,
    label: &str,
    pipeline: &wgpu::ComputePipeline,
    entries: &[(u32, &wgpu::Buffer)],
) -> wgpu::BindGroup {
    let layout = pipeline.get_bind_group_layout(0);
    let entries: Vec<wgpu::BindGroupEntry> = entries
        .iter()
        .map(|(b, buf)| wgpu::BindGroupEntry {
            binding: *b,
            resource: buf.as_entire_binding(),
        })
        .collect();
    ctx.device.create_bind_group(&wgpu::BindGroupDescriptor {
        label: Some(label),
        layout: &layout,
        entries: &entries,
    })
}

/// Fetch (compile or reuse) the pipeline of `key`.
pub async fn pipeline(ctx: &GpuContext, key: PipelineKey) -> Result<Arc<wgpu::ComputePipeline>, GpuError> {
    ctx.pipelines.get(&ctx.device, key).await
}

/// Encode `dispatches` for one step into a single command submission (tests and one-off
/// ops; the forward pass has its own step loop).
pub fn submit(ctx: &GpuContext, step: &wgpu::Buffer, n_tokens: u32, n_out: u32, dispatches: &[Dispatch]) {
    ctx.queue.write_buffer(
        step,
        0,
        bytemuck::bytes_of(&StepUniform {
            n_tokens,
            n_out,
            _pad: [0; 2],
        }),
    );
    let mut enc = ctx.device.create_command_encoder(&Default::default());
    {
        let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
            label: Some("lantern ops"),
            timestamp_writes: None,
        });
        for d in dispatches {
            d.encode(&mut pass, n_tokens, n_out);
        }
    }
    ctx.queue.submit([enc.finish()]);
}

/// A step uniform buffer.
pub fn step_buffer(ctx: &GpuContext) -> wgpu::Buffer {
    crate::gpu::buffer::create_uniform(ctx, "step", &StepUniform::default())
}

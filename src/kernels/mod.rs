//! One Rust file per GPU op: the uniform struct that mirrors the WGSL `Params`, shape checks,
//! variant choice by device capability, and construction of ready-to-encode dispatches.
//! The CPU oracle for each op lives in `crate::reference::ops`.

/// `(field, byte offset)` of each named field of a uniform struct, for the test that checks
/// them against the WGSL struct the struct mirrors (padding fields are left out).
macro_rules! field_offsets {
    ($t:ty; $($f:ident),* $(,)?) => {
        vec![$((stringify!($f), std::mem::offset_of!($t, $f))),*]
    };
}

pub mod argmax;
pub mod attention;
pub mod embedding;
pub mod linear;
pub mod logit_bias;
pub mod logit_mask;
pub mod moe;
pub mod rmsnorm;
pub mod rope_kv;
pub mod sample;
pub mod topk;
pub mod x_texture;

use std::sync::Arc;

use crate::gpu::{GpuContext, GpuError, PipelineKey};

/// Mirrors `struct Step` in `shaders/common/step.wgsl`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct StepUniform {
    pub n_tokens: u32,
    pub n_out: u32,
    /// Key ranges per token in attention (flash-decoding); 0 and 1 mean one.
    pub n_splits: u32,
    pub _pad: u32,
}

impl StepUniform {
    /// A step of `n_tokens` rows with `n_out` rows of logits and no key splits.
    pub fn new(n_tokens: u32, n_out: u32) -> Self {
        StepUniform { n_tokens, n_out, n_splits: 1, _pad: 0 }
    }
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
    /// ceil(out rows / n).
    OutDiv(u32),
    /// The step's key splits per token (at least 1).
    Splits,
    /// The token count when `shards` x splits > 1, else 0 (the attention reduce).
    TokensIfParts(u32),
    /// tokens x n (a mixture of experts' token-expert pairs).
    TokensTimes(u32),
    /// The work items of a step's grouped expert pairs (`kernels::moe::work_items`).
    GroupItems {
        top_k: u32,
        experts: u32,
    },
}

impl Dim {
    fn eval(&self, s: &StepUniform) -> u32 {
        match *self {
            Dim::Const(c) => c,
            Dim::Tokens => s.n_tokens,
            Dim::TokensDiv(d) => s.n_tokens.div_ceil(d),
            Dim::Out => s.n_out,
            Dim::OutDiv(d) => s.n_out.div_ceil(d),
            Dim::Splits => s.n_splits.max(1),
            Dim::TokensTimes(n) => s.n_tokens * n,
            Dim::GroupItems { top_k, experts } => moe::work_items(s.n_tokens as usize, top_k as usize, experts as usize) as u32,
            Dim::TokensIfParts(shards) => {
                if shards * s.n_splits.max(1) > 1 {
                    s.n_tokens
                } else {
                    0
                }
            }
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
    /// Whether the step `s` runs this dispatch (no dimension evaluates to 0).
    pub fn runs(&self, s: &StepUniform) -> bool {
        self.grid.iter().all(|d| d.eval(s) > 0)
    }

    /// Record this dispatch into a compute pass for the step `s`.
    pub fn encode(&self, pass: &mut wgpu::ComputePass<'_>, s: &StepUniform) {
        encode_all(pass, [self], s);
    }
}

/// Record `dispatches` into a compute pass for the step `s`, in order, skipping those the
/// step does not run and setting a pipeline only when it changes; returns how many were
/// recorded.
pub fn encode_all<'d>(pass: &mut wgpu::ComputePass<'_>, dispatches: impl IntoIterator<Item = &'d Dispatch>, s: &StepUniform) -> usize {
    let mut last: Option<&wgpu::ComputePipeline> = None;
    let mut n = 0;
    for d in dispatches {
        let [x, y, z] = d.grid.map(|g| g.eval(s));
        if x == 0 || y == 0 || z == 0 {
            continue;
        }
        if !last.is_some_and(|p| std::ptr::eq(p, &*d.pipeline)) {
            pass.set_pipeline(&d.pipeline);
            last = Some(&d.pipeline);
        }
        pass.set_bind_group(0, &d.bind_group, &[]);
        pass.dispatch_workgroups(x, y, z);
        n += 1;
    }
    n
}

/// Build a bind group for `pipeline` from (binding, buffer) pairs.
pub fn bind(ctx: &GpuContext, label: &str, pipeline: &wgpu::ComputePipeline, entries: &[(u32, &wgpu::Buffer)]) -> wgpu::BindGroup {
    let layout = pipeline.get_bind_group_layout(0);
    let entries: Vec<wgpu::BindGroupEntry> =
        entries.iter().map(|(b, buf)| wgpu::BindGroupEntry { binding: *b, resource: buf.as_entire_binding() }).collect();
    ctx.bind_group(&wgpu::BindGroupDescriptor { label: Some(label), layout: &layout, entries: &entries })
}

/// Fetch (compile or reuse) the pipeline of `key`.
pub async fn pipeline(ctx: &GpuContext, key: PipelineKey) -> Result<Arc<wgpu::ComputePipeline>, GpuError> {
    ctx.pipelines.get(&ctx.device, key).await
}

/// Encode `dispatches` for one step into a single command submission (tests and one-off
/// ops; the forward pass has its own step loop).
pub fn submit(ctx: &GpuContext, step: &wgpu::Buffer, n_tokens: u32, n_out: u32, dispatches: &[Dispatch]) {
    submit_step(ctx, step, &StepUniform::new(n_tokens, n_out), dispatches)
}

/// [`submit`] with a full step uniform (key splits included).
pub fn submit_step(ctx: &GpuContext, step: &wgpu::Buffer, s: &StepUniform, dispatches: &[Dispatch]) {
    ctx.write(step, 0, bytemuck::bytes_of(s));
    let mut enc = ctx.device.create_command_encoder(&Default::default());
    {
        let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some("lantern ops"), timestamp_writes: None });
        ctx.counters.dispatched(encode_all(&mut pass, dispatches, s));
    }
    ctx.submit([enc.finish()]);
}

/// A step uniform buffer.
pub fn step_buffer(ctx: &GpuContext) -> wgpu::Buffer {
    crate::gpu::buffer::create_uniform(ctx, "step", &StepUniform::default())
}

/// Bytes of the Rust struct each op writes into its `Params` uniform (binding 1), and of
/// [`StepUniform`] (binding 0): what `tests/shaders.rs` checks against naga's layout of the
/// WGSL structs for every variant, so a field added on one side only fails a test.
pub fn params_fields(op: crate::gpu::ShaderOp) -> Vec<(&'static str, usize)> {
    use crate::gpu::ShaderOp as O;
    match op {
        O::Embedding => field_offsets!(embedding::EmbeddingParams; k, row_offset, n_rows, group, scale),
        O::RmsNorm => field_offsets!(rmsnorm::RmsNormParams; k, eps, rows, token_stride, row_stride, split, offset, g_offset),
        O::Matvec | O::Matmul | O::MatmulBlocked | O::MatvecQ | O::MatvecQMasked | O::MatmulBlockedQ => {
            field_offsets!(linear::LinearParams; n_rows, k, row_offset, out_stride, x_stride, grid_x, eps, group)
        }
        O::RopeKv => rope_kv::uniform_fields(),
        O::KvSeal => rope_kv::seal_uniform_fields(),
        O::Attention => attention::uniform_fields(),
        O::AttentionReduce => attention::reduce_uniform_fields(),
        O::Argmax => field_offsets!(argmax::ArgmaxParams; n),
        O::TopK => topk::uniform_fields(),
        O::Sample => field_offsets!(sample::SampleParams; temperature, top_k, top_p),
        O::LogitMask => field_offsets!(logit_mask::LogitMaskParams; n, words, fill),
        O::LogitBias => field_offsets!(logit_bias::LogitBiasParams; n, base),
        O::XTexture => field_offsets!(x_texture::XTextureParams; texels, x_stride4),
        O::MoeRoute => field_offsets!(moe::RouteParams; n_experts, top_k, renormalize),
        O::MoeMatvec | O::MoeGrouped => {
            field_offsets!(linear::LinearParams; n_rows, k, row_offset, out_stride, x_stride, grid_x, eps, group)
        }
        O::MoeGroup => field_offsets!(moe::GroupParams; n_experts, top_k, tt, max_items),
        O::MoeCombine => field_offsets!(moe::CombineParams; n, top_k),
    }
}

/// Bytes of the `Params` uniform the op's shader declares at binding 1 (its Rust mirror).
pub fn params_size(op: crate::gpu::ShaderOp) -> usize {
    use crate::gpu::ShaderOp as O;
    match op {
        O::Embedding => std::mem::size_of::<embedding::EmbeddingParams>(),
        O::RmsNorm => std::mem::size_of::<rmsnorm::RmsNormParams>(),
        O::Matvec | O::Matmul | O::MatmulBlocked | O::MatvecQ | O::MatvecQMasked | O::MatmulBlockedQ => {
            std::mem::size_of::<linear::LinearParams>()
        }
        O::RopeKv => rope_kv::UNIFORM_BYTES,
        O::KvSeal => rope_kv::SEAL_UNIFORM_BYTES,
        O::Attention => attention::UNIFORM_BYTES,
        O::AttentionReduce => attention::REDUCE_UNIFORM_BYTES,
        O::Argmax => std::mem::size_of::<argmax::ArgmaxParams>(),
        O::TopK => topk::UNIFORM_BYTES,
        O::Sample => std::mem::size_of::<sample::SampleParams>(),
        O::LogitMask => std::mem::size_of::<logit_mask::LogitMaskParams>(),
        O::LogitBias => std::mem::size_of::<logit_bias::LogitBiasParams>(),
        O::XTexture => std::mem::size_of::<x_texture::XTextureParams>(),
        O::MoeRoute => std::mem::size_of::<moe::RouteParams>(),
        O::MoeMatvec | O::MoeGrouped => std::mem::size_of::<linear::LinearParams>(),
        O::MoeGroup => std::mem::size_of::<moe::GroupParams>(),
        O::MoeCombine => std::mem::size_of::<moe::CombineParams>(),
    }
}

/// Every pipeline variant the kernels can ask for on a device with `features`: the set the
/// shader tests validate, translate and snapshot (tests/shaders.rs), and that
/// tests/gpu_model.rs checks every requested pipeline against. It lives with the kernels
/// because their variant choices define it.
pub fn all_variants(features: crate::gpu::Features) -> Vec<PipelineKey> {
    use crate::gpu::shader::flags::*;
    use crate::gpu::shader::{Features, ShaderOp, WeightFormat};
    let mut v = Vec::new();
    let sg = Features { f16: false, subgroups: features.subgroups };
    v.push(PipelineKey::new(ShaderOp::Embedding, 64));
    // f16 tables (f16 checkpoints, `--weights f16`): unpacked from u32 pairs, no shader-f16.
    v.push(PipelineKey::new(ShaderOp::Embedding, 64).with_weights(WeightFormat::F16));
    for mode in [rmsnorm::Mode::Write, rmsnorm::Mode::Residual, rmsnorm::Mode::InPlace] {
        v.push(rmsnorm::key(mode));
    }
    for kv in [crate::kv::plan::KvDtype::F32, crate::kv::plan::KvDtype::F16, crate::kv::plan::KvDtype::Q8, crate::kv::plan::KvDtype::Q4]
        .map(|d| attention::kv_format(d).expect("a runtime KV dtype"))
    {
        v.push(PipelineKey::new(ShaderOp::RopeKv, 64).with_weights(kv));
        if kv == attention::kv_format(crate::kv::plan::KvDtype::Q4).expect("a runtime KV dtype") {
            v.push(PipelineKey::new(ShaderOp::KvSeal, rope_kv::SEAL_WORKGROUP).with_weights(kv));
        }
        v.push(PipelineKey::new(ShaderOp::Attention, 64).with_weights(kv));
        if features.subgroups {
            v.push(PipelineKey::new(ShaderOp::Attention, 8).with_flags(XBCAST).with_features(sg).with_weights(kv));
        }
    }
    v.push(PipelineKey::new(ShaderOp::AttentionReduce, 64));
    v.push(PipelineKey::new(ShaderOp::Argmax, 256));
    v.push(PipelineKey::new(ShaderOp::TopK, 64));
    v.push(PipelineKey::new(ShaderOp::Sample, 64));
    v.push(PipelineKey::new(ShaderOp::LogitMask, logit_mask::WORKGROUP));
    v.push(PipelineKey::new(ShaderOp::LogitBias, logit_bias::WORKGROUP));
    v.push(PipelineKey::new(ShaderOp::XTexture, x_texture::WORKGROUP));
    // Mixtures of experts: the router and the expert matvecs in every weight format.
    v.push(PipelineKey::new(ShaderOp::MoeRoute, moe::WORKGROUP));
    v.push(PipelineKey::new(ShaderOp::MoeGroup, moe::GROUP_WORKGROUP));
    for c in [0, RESIDUAL] {
        v.push(PipelineKey::new(ShaderOp::MoeCombine, moe::WORKGROUP).with_flags(c));
    }
    for w in [WeightFormat::F32, WeightFormat::F16].into_iter().chain(WeightFormat::packed()) {
        for feat in [Features::default(), sg] {
            for c in moe::FLAG_SETS {
                v.push(PipelineKey::new(ShaderOp::MoeMatvec, moe::WORKGROUP).with_flags(c).with_weights(w).with_features(feat));
            }
            if w.is_packed() {
                for c in moe::MULTI_FLAG_SETS {
                    v.push(PipelineKey::new(ShaderOp::MoeMatvec, moe::WORKGROUP).with_flags(c).with_weights(w).with_features(feat));
                }
            }
        }
        for c in moe::GROUPED_FLAG_SETS {
            v.push(PipelineKey::new(ShaderOp::MoeGrouped, moe::WORKGROUP).with_flags(c).with_weights(w));
        }
    }
    let combos = [NORM | BIAS, 0, RESIDUAL, NORM | GATED, NORM | GATED | GELU, NORM | GATHER, NORM, BIAS];
    for w in [WeightFormat::F32, WeightFormat::F16] {
        for &c in &combos {
            v.push(PipelineKey::new(ShaderOp::Matvec, 64).with_flags(c).with_weights(w));
            v.push(PipelineKey::new(ShaderOp::Matvec, 8).with_flags(c | ROWS4).with_weights(w));
            v.push(PipelineKey::new(ShaderOp::Matvec, 64).with_flags(c | ROW_PER_WORKGROUP).with_weights(w).with_features(sg));
            if c & GATHER == 0 {
                v.push(PipelineKey::new(ShaderOp::Matmul, 64).with_flags(c).with_weights(w));
                // The blocked matmul CPU adapters get (kernels::linear::BLOCKED_DEFAULT).
                v.push(PipelineKey::new(ShaderOp::MatmulBlocked, 8).with_flags(c | BLOCK_M8 | BLOCK_N8).with_weights(w));
            }
        }
    }
    // Packed integer weights: the CPU-adapter and GPU matvec layouts, the blocked and
    // tiled matmuls, with and without shader-f16 where the variant uses it, and the
    // embedding gather (a tied table is also the LM head).
    let f16 = Features { f16: features.f16, subgroups: false };
    let f16_sg = Features { f16: features.f16, subgroups: features.subgroups };
    for w in WeightFormat::packed() {
        v.push(PipelineKey::new(ShaderOp::Embedding, 64).with_weights(w));
        v.push(PipelineKey::new(ShaderOp::Embedding, 64).with_flags(TEX).with_weights(w));
        for &c in &combos {
            v.push(PipelineKey::new(ShaderOp::MatvecQ, 8).with_flags(c | ROWS4).with_weights(w));
            if linear::masked_format(w) {
                // CPU adapters without texture-held weights (SwiftShader).
                v.push(PipelineKey::new(ShaderOp::MatvecQMasked, linear::MASKED_WG).with_flags(c).with_weights(w));
            }
            if features.subgroups {
                v.push(PipelineKey::new(ShaderOp::MatvecQ, 8).with_flags(c | ROWS4 | XBCAST).with_weights(w).with_features(sg));
                v.push(PipelineKey::new(ShaderOp::MatvecQ, 8).with_flags(c | ROWS4 | XBCAST | TOK4).with_weights(w).with_features(sg));
                // Tiled texture-held weights (CPU adapters with 8-lane subgroups): x from
                // storage, or from uniform windows (XU).
                for tok in [0, TOK4, TOK8] {
                    for xu in [0, XU] {
                        v.push(PipelineKey::new(ShaderOp::MatvecQ, 8).with_flags(c | TEX | tok | xu).with_weights(w).with_features(sg));
                    }
                }
            }
            for feat in [sg, f16_sg] {
                v.push(PipelineKey::new(ShaderOp::MatvecQ, 64).with_flags(c | ROW_PER_WORKGROUP).with_weights(w).with_features(feat));
            }
            // The GPU default (MULTI_ROW), with subgroups and with the workgroup-memory
            // reduction adapters without them take.
            for feat in [Features::default(), sg] {
                for tok in [0, TOK4, TOK8] {
                    v.push(PipelineKey::new(ShaderOp::MatvecQ, 64).with_flags(c | MULTI_ROW | tok).with_weights(w).with_features(feat));
                }
            }
            if c & GATHER == 0 {
                for feat in [Features::default(), f16] {
                    v.push(PipelineKey::new(ShaderOp::Matmul, 64).with_flags(c).with_weights(w).with_features(feat));
                }
                v.push(PipelineKey::new(ShaderOp::MatmulBlockedQ, 8).with_flags(c | BLOCK_M8 | BLOCK_N8).with_weights(w));
                if features.subgroups {
                    // Texture-held weights: x by broadcast from storage, or from a texture
                    // copy (XTEX: CPU adapters' prefill).
                    for tex in [0, TEX, TEX | XTEX] {
                        v.push(
                            PipelineKey::new(ShaderOp::MatmulBlockedQ, 8)
                                .with_flags(c | BLOCK_M8 | BLOCK_N8 | XBCAST | tex)
                                .with_weights(w)
                                .with_features(sg),
                        );
                    }
                }
            }
        }
    }
    v.sort();
    v.dedup();
    v
}

//! Weights onto the GPU: each matrix in the kernel format its file dtype and the
//! [`WeightPrecision`] allow (packed GGUF blocks stay packed, bit for bit), q|k|v as runs of
//! parts stored alike, gate and up as one gated layer, and the norms as f32 vectors.

use crate::gpu::buffer::{create_storage, create_storage_window};
use crate::gpu::GpuContext;
use crate::kernels::linear::{GpuLinear, HostMatrix, RowUpload};
use crate::model::{DType, HostTensor, ModelWeights};
use crate::quant::PackedMatrix;
use crate::{LanternError, Result};

use super::{gpu_err, Experts, Layer, Part, WeightPrecision};

/// Everything a model holds on the GPU besides its cache and workspace.
pub(super) struct GpuWeights {
    pub layers: Vec<Layer>,
    pub lm_head: GpuLinear,
    /// The embedding table when it is not the (tied) head's.
    pub embed_own: Option<GpuLinear>,
    pub final_norm: wgpu::Buffer,
}

enum Owned {
    F32(Vec<f32>),
    F16(Vec<u16>),
    Packed(PackedMatrix),
}

impl Owned {
    fn as_matrix(&self) -> HostMatrix<'_> {
        match self {
            Owned::F32(v) => HostMatrix::F32(v),
            Owned::F16(v) => HostMatrix::F16(v),
            Owned::Packed(p) => HostMatrix::Packed(p),
        }
    }

    /// Whether two matrices are stored alike (gate and up share one kernel).
    fn same_storage(&self, other: &Owned) -> bool {
        match (self, other) {
            (Owned::F32(_), Owned::F32(_)) | (Owned::F16(_), Owned::F16(_)) => true,
            (Owned::Packed(a), Owned::Packed(b)) => a.format == b.format,
            _ => false,
        }
    }
}

fn get<'a>(w: &'a ModelWeights, name: &str) -> Result<&'a HostTensor> {
    w.tensors
        .get(name)
        .ok_or_else(|| LanternError::Load(crate::model::LoadError::MissingTensor { file: w.source.clone(), tensor: name.into() }))
}

/// Concatenate row blocks of matrices into one: with `Native`, packed when every part is
/// quantized in one format (GGUF blocks repacked bit for bit), f16 when all parts are f16.
fn matrix(parts: &[&HostTensor], precision: WeightPrecision) -> Result<Owned> {
    if precision == WeightPrecision::Native {
        // Every part packed (`packed()` is None for float dtypes), in one format.
        let packed = parts.iter().map(|t| t.packed()).collect::<Option<std::result::Result<Vec<_>, _>>>();
        if let Some(packed) = packed {
            let mut packed = packed?;
            if packed.len() == 1 {
                // One tensor: no second copy to stack it (an LM head is the largest matrix).
                return Ok(Owned::Packed(packed.pop().expect("one part")));
            }
            if packed.iter().all(|p| p.format == packed[0].format) {
                return Ok(Owned::Packed(PackedMatrix::concat_rows(&packed)?));
            }
        }
    }
    Ok(matrix_float(parts, precision))
}

/// Whether two tensors load into one kernel format under `precision` (same packed format, or
/// both float).
fn same_dtype(a: &HostTensor, b: &HostTensor, precision: WeightPrecision) -> bool {
    if precision != WeightPrecision::Native {
        return true;
    }
    match (a.dtype.quant_kind(), b.dtype.quant_kind()) {
        (None, None) => true,
        (Some(_), Some(_)) => a.dtype == b.dtype,
        _ => false,
    }
}

fn matrix_float(parts: &[&HostTensor], precision: WeightPrecision) -> Owned {
    if precision == WeightPrecision::F16 {
        let mut v = Vec::new();
        for t in parts {
            if t.dtype == DType::F16 {
                v.extend(t.data.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])));
            } else {
                v.extend(t.to_f32().into_iter().map(|x| half::f16::from_f32(x).to_bits()));
            }
        }
        return Owned::F16(v);
    }
    if precision == WeightPrecision::Native && parts.iter().all(|t| t.dtype == DType::F16) {
        let mut v = Vec::new();
        for t in parts {
            v.extend(t.data.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])));
        }
        Owned::F16(v)
    } else {
        let mut v = Vec::new();
        for t in parts {
            v.extend(t.to_f32());
        }
        Owned::F32(v)
    }
}

/// Upload every weight of `weights` (stored as `keep` says; texture copies for the CPU-adapter
/// batched matvec with `textures`), calling `progress(layers done, layers)` after each layer.
pub(super) fn upload_weights(
    ctx: &GpuContext,
    weights: &ModelWeights,
    keep: WeightPrecision,
    textures: bool,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<GpuWeights> {
    let c = &weights.config;
    let mut layers = Vec::with_capacity(c.num_layers);
    for l in 0..c.num_layers {
        layers.push(upload_layer(ctx, weights, l, keep, textures)?);
        // Flush this layer's uploads so staging memory stays about one layer's worth.
        ctx.queue.submit(std::iter::empty());
        progress(l + 1, c.num_layers);
    }
    let (lm_head, embed_own, final_norm) = upload_globals(ctx, weights, keep, textures)?;
    Ok(GpuWeights { layers, lm_head, embed_own, final_norm })
}

/// An f32 norm (or other vector) weight.
fn upload_norm(ctx: &GpuContext, weights: &ModelWeights, name: &str) -> Result<wgpu::Buffer> {
    let t = get(weights, name)?;
    // The tiled matvec reads a fused norm's weight as a uniform window.
    create_storage_window(ctx, name, bytemuck::cast_slice(&t.to_f32()), crate::kernels::linear::x_window(ctx)).map_err(gpu_err)
}

/// Layer `l` from `weights` (which may hold only that layer's tensors).
pub(super) fn upload_layer(ctx: &GpuContext, weights: &ModelWeights, l: usize, keep: WeightPrecision, textures: bool) -> Result<Layer> {
    let c = &weights.config;
    let d = c.hidden_size;
    let hd = c.head_dim;
    let q_dim = c.num_heads * hd;
    let kv_dim = c.num_kv_heads * hd;
    let f = c.intermediate_size;
    let norm = |name: &str| upload_norm(ctx, weights, name);
    let p = format!("model.layers.{l}");
    let q = get(weights, &format!("{p}.self_attn.q_proj.weight"))?;
    let k = get(weights, &format!("{p}.self_attn.k_proj.weight"))?;
    let v = get(weights, &format!("{p}.self_attn.v_proj.weight"))?;
    let bias = if c.qkv_bias {
        let mut b = get(weights, &format!("{p}.self_attn.q_proj.bias"))?.to_f32();
        b.extend(get(weights, &format!("{p}.self_attn.k_proj.bias"))?.to_f32());
        b.extend(get(weights, &format!("{p}.self_attn.v_proj.bias"))?.to_f32());
        Some(b)
    } else {
        None
    };
    // q|k|v as one projection, or as runs of parts stored alike when a file mixes
    // formats within the layer (Q4_K_M: q and k in Q4_K, v in Q6_K), each run
    // writing its columns of the qkv output.
    let mut qkv = Vec::new();
    let mut start = 0;
    let parts = [(q, q_dim), (k, kv_dim), (v, kv_dim)];
    let mut i = 0;
    while i < parts.len() {
        let mut j = i + 1;
        while j < parts.len() && same_dtype(parts[i].0, parts[j].0, keep) {
            j += 1;
        }
        let run: Vec<&HostTensor> = parts[i..j].iter().map(|p| p.0).collect();
        let rows: usize = parts[i..j].iter().map(|p| p.1).sum();
        let w = matrix(&run, keep)?;
        let name = if i == 0 && j == parts.len() { format!("{p}.qkv") } else { format!("{p}.qkv[{start}..{}]", start + rows) };
        let b = bias.as_ref().map(|b| &b[start..start + rows]);
        let lin = GpuLinear::upload_with(ctx, &name, w.as_matrix(), None, b, rows, d, textures).map_err(gpu_err)?;
        qkv.push((lin, start));
        start += rows;
        i = j;
    }
    let o_w = matrix(&[get(weights, &format!("{p}.self_attn.o_proj.weight"))?], keep)?;
    let o = GpuLinear::upload_with(ctx, &format!("{p}.o_proj"), o_w.as_matrix(), None, None, d, q_dim, textures).map_err(gpu_err)?;
    let gelu = c.block.activation == crate::model::Activation::GeluTanh;
    let (gate_up, down, experts) = match crate::model::validate::expert_names(c, l) {
        Some(names) => upload_experts(ctx, weights, l, &names, keep, gelu)?,
        None => {
            let gate = get(weights, &format!("{p}.mlp.gate_proj.weight"))?;
            let up = get(weights, &format!("{p}.mlp.up_proj.weight"))?;
            let mut gate_up = upload_gate_up(ctx, &format!("{p}.gate_up"), &[gate], &[up], f, d, keep, textures)?;
            gate_up.gelu = gelu;
            let dn_w = matrix(&[get(weights, &format!("{p}.mlp.down_proj.weight"))?], keep)?;
            let down =
                GpuLinear::upload_with(ctx, &format!("{p}.down_proj"), dn_w.as_matrix(), None, None, d, f, textures).map_err(gpu_err)?;
            (gate_up, down, None)
        }
    };
    let norms = crate::model::validate::layer_norm_names(c, l);
    let qk_norm = if c.block.qk_norm {
        let mut v = get(weights, &format!("{p}.self_attn.q_norm.weight"))?.to_f32();
        v.extend(get(weights, &format!("{p}.self_attn.k_norm.weight"))?.to_f32());
        Some(create_storage(ctx, &format!("{p}.qk_norm"), bytemuck::cast_slice(&v)).map_err(gpu_err)?)
    } else {
        None
    };
    Ok(Layer {
        qkv,
        o,
        gate_up,
        down,
        experts,
        in_norm: norm(&norms.attn_in)?,
        post_norm: norm(&norms.mlp_in)?,
        qk_norm,
        attn_out_norm: norms.attn_out.as_deref().map(norm).transpose()?,
        mlp_out_norm: norms.mlp_out.as_deref().map(norm).transpose()?,
    })
}

/// The gated pair of `gate` and `up` (row blocks of each, stacked: `rows` x `k` in all), in
/// one kernel format: if the two are stored differently, both go to f32.
#[allow(clippy::too_many_arguments)]
fn upload_gate_up(
    ctx: &GpuContext,
    name: &str,
    gate: &[&HostTensor],
    up: &[&HostTensor],
    rows: usize,
    k: usize,
    keep: WeightPrecision,
    textures: bool,
) -> Result<GpuLinear> {
    let g_w = matrix(gate, keep)?;
    let u_w = matrix(up, keep)?;
    let (g_m, u_m) = if g_w.same_storage(&u_w) {
        (g_w, u_w)
    } else {
        (matrix_float(gate, WeightPrecision::F32), matrix_float(up, WeightPrecision::F32))
    };
    GpuLinear::upload_with(ctx, name, g_m.as_matrix(), Some(u_m.as_matrix()), None, rows, k, textures).map_err(gpu_err)
}

/// Layer `l`'s mixture of experts: every expert's gate|up and down stacked by rows (expert
/// e's rows at `e * rows`) in storage buffers, as the expert matvec reads them
/// (`kernels::moe`), and the router as a linear layer.
fn upload_experts(
    ctx: &GpuContext,
    weights: &ModelWeights,
    l: usize,
    names: &crate::model::validate::ExpertNames,
    keep: WeightPrecision,
    gelu: bool,
) -> Result<(GpuLinear, GpuLinear, Option<Experts>)> {
    let c = &weights.config;
    let moe = c.block.experts(l).expect("expert names come with a mixture").clone();
    let (d, ei, n) = (c.hidden_size, moe.expert_intermediate, moe.experts);
    let p = format!("model.layers.{l}.experts");
    let router_w = matrix(&[get(weights, &names.router)?], keep)?;
    let router =
        GpuLinear::upload_with(ctx, &format!("model.layers.{l}.router"), router_w.as_matrix(), None, None, n, d, false).map_err(gpu_err)?;
    let part = |i: usize| names.experts.iter().map(|e| get(weights, &e[i])).collect::<Result<Vec<_>>>();
    let mut gate_up = upload_gate_up(ctx, &format!("{p}.gate_up"), &part(0)?, &part(1)?, n * ei, d, keep, false)?;
    gate_up.gelu = gelu;
    let down_w = matrix(&part(2)?, keep)?;
    let down = GpuLinear::upload_with(ctx, &format!("{p}.down"), down_w.as_matrix(), None, None, n * d, ei, false).map_err(gpu_err)?;
    for lin in [&gate_up, &down] {
        crate::kernels::moe::check_stacked(lin, n).map_err(gpu_err)?;
    }
    Ok((gate_up, down, Some(Experts { router, spec: moe })))
}

/// The embedding, head and final norm from `weights` (which may hold only those).
pub(super) fn upload_globals(
    ctx: &GpuContext,
    weights: &ModelWeights,
    keep: WeightPrecision,
    textures: bool,
) -> Result<(GpuLinear, Option<GpuLinear>, wgpu::Buffer)> {
    let c = &weights.config;
    let d = c.hidden_size;
    let norm = |name: &str| upload_norm(ctx, weights, name);
    let embed_t = get(weights, "model.embed_tokens.weight")?;
    let head_t = if c.tie_word_embeddings { embed_t } else { get(weights, "lm_head.weight")? };
    // Each host copy is dropped once it is on the GPU, before the next is made: the head and
    // the embedding table are a model's largest matrices (a browser's wasm heap keeps its
    // high-water mark).
    let lm_head = {
        let head_m = matrix(&[head_t], keep)?;
        GpuLinear::upload_with(ctx, "lm_head", head_m.as_matrix(), None, None, c.vocab_size, d, textures).map_err(gpu_err)?
    };
    let embed_own = if c.tie_word_embeddings {
        None
    } else {
        let m = matrix(&[embed_t], keep)?;
        let t = GpuLinear::upload_with(ctx, "embed_tokens", m.as_matrix(), None, None, c.vocab_size, d, textures).map_err(gpu_err)?;
        Some(t)
    };
    let final_norm = norm("model.norm.weight")?;
    Ok((lm_head, embed_own, final_norm))
}

/// [`upload_globals`] for a streamed load: the final norm from `part`, and the head and the
/// embedding table (when not tied) a slice of rows at a time from `fetch`, so the host never
/// holds one of them whole (its file bytes and its repacked copy at once were a browser's
/// wasm-heap high-water mark).
pub(super) async fn upload_globals_streamed(
    ctx: &GpuContext,
    part: &ModelWeights,
    keep: WeightPrecision,
    textures: bool,
    slice_bytes: usize,
    fetch: &mut impl AsyncFnMut(Part) -> Result<ModelWeights>,
) -> Result<(GpuLinear, Option<GpuLinear>, wgpu::Buffer)> {
    let c = &part.config;
    let (n, d) = (c.vocab_size, c.hidden_size);
    let embed = "model.embed_tokens.weight";
    let head = if c.tie_word_embeddings { embed } else { "lm_head.weight" };
    let lm_head = stream_matrix(ctx, "lm_head", head, n, d, keep, textures, slice_bytes, fetch).await?;
    let embed_own = match c.tie_word_embeddings {
        true => None,
        false => Some(stream_matrix(ctx, "embed_tokens", embed, n, d, keep, textures, slice_bytes, fetch).await?),
    };
    let final_norm = upload_norm(ctx, part, "model.norm.weight")?;
    Ok((lm_head, embed_own, final_norm))
}

/// The `n` x `k` matrix `tensor` uploaded as `label` from slices of rows. Whole (one fetch of
/// every row) where it cannot be written by slices: f16 rows that are not whole words.
#[allow(clippy::too_many_arguments)]
async fn stream_matrix(
    ctx: &GpuContext,
    label: &str,
    tensor: &str,
    n: usize,
    k: usize,
    keep: WeightPrecision,
    textures: bool,
    slice_bytes: usize,
    fetch: &mut impl AsyncFnMut(Part) -> Result<ModelWeights>,
) -> Result<GpuLinear> {
    let per = (slice_bytes / (k * 4).max(1)).clamp(1, n.max(1));
    let rows = |start: usize| Part::Rows { tensor: tensor.into(), start, end: (start + per).min(n) };
    let first_part = fetch(rows(0)).await?;
    let first = matrix(&[get(&first_part, tensor)?], keep)?;
    if per >= n || !RowUpload::fits(&first.as_matrix(), k) {
        let m = if per >= n {
            first
        } else {
            drop((first, first_part));
            let all = fetch(Part::Rows { tensor: tensor.into(), start: 0, end: n }).await?;
            matrix(&[get(&all, tensor)?], keep)?
        };
        return GpuLinear::upload_with(ctx, label, m.as_matrix(), None, None, n, k, textures).map_err(gpu_err);
    }
    let mut up = RowUpload::begin(ctx, label, &first.as_matrix(), n, k, textures).map_err(gpu_err)?;
    up.write(ctx, &first.as_matrix()).map_err(gpu_err)?;
    drop((first, first_part));
    let mut start = per;
    while start < n {
        let part = fetch(rows(start)).await?;
        let m = matrix(&[get(&part, tensor)?], keep)?;
        up.write(ctx, &m.as_matrix()).map_err(gpu_err)?;
        drop((m, part));
        // Flush the slice's staging copy before the next is made.
        ctx.queue.submit(std::iter::empty());
        start += per;
    }
    up.finish().map_err(gpu_err)
}

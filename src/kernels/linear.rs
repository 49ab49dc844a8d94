//! `y = W x` in its two shapes: the decode matvec (`shaders/matvec.wgsl`, packed weights
//! `shaders/matvec_q.wgsl`) and the prefill matmul (`shaders/matmul.wgsl` on GPUs,
//! `shaders/matmul_blocked.wgsl` / `matmul_blocked_q.wgsl` on CPU adapters), with the fused
//! prologue/epilogues of all of them (`shaders/common/linear.wgsl`: RMSNorm folded in, bias,
//! SiLU or GELU gate, residual add, gathered rows).

use crate::gpu::buffer::{create_storage, create_uniform};
use crate::gpu::shader::{flags, WeightFormat};
use crate::gpu::{GpuContext, GpuError, GpuTensor, PipelineKey, ShaderOp};
use crate::quant::{PackedMatrix, QuantFormat};

use super::{bind, pipeline, Dim, Dispatch};

/// Mirrors `struct Params` in matvec.wgsl and matmul.wgsl.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct LinearParams {
    pub n_rows: u32,
    pub k: u32,
    pub row_offset: u32,
    pub out_stride: u32,
    pub x_stride: u32,
    pub grid_x: u32,
    pub eps: f32,
    /// Elements per scale of packed weights (0 otherwise).
    pub group: u32,
}

/// Host data of one weight matrix in a format the kernels read.
pub enum HostMatrix<'a> {
    F32(&'a [f32]),
    /// IEEE half bits.
    F16(&'a [u16]),
    /// Packed integer codes and group scales (`crate::quant`), uploaded as they are.
    Packed(&'a PackedMatrix),
}

/// A linear layer on the GPU: weight (n_rows x k), optional second weight for the gated
/// product, optional bias, all split by rows into binding-sized chunks with the same row
/// boundaries.
pub struct GpuLinear {
    pub name: String,
    pub n_rows: usize,
    pub k: usize,
    pub format: WeightFormat,
    pub w: GpuTensor,
    pub u: Option<GpuTensor>,
    /// Packed formats: the group size, and the scales of `w` (and `u`), chunked like them.
    pub quant: Option<QuantFormat>,
    pub w_scales: Option<GpuTensor>,
    pub u_scales: Option<GpuTensor>,
    /// One bias buffer per chunk.
    pub bias: Option<Vec<wgpu::Buffer>>,
    /// CPU adapters: the packed codes and scales again as textures for the TEX matvec.
    pub tex: Option<TexCopy>,
    /// Gated layers: GELU-tanh instead of SiLU on the gate (`flags::GELU`).
    pub gelu: bool,
}

/// The textures of one weight chunk (codes and scales of w, and of u when gated), each row
/// padded to whole texels.
pub struct TexChunk {
    pub w: wgpu::TextureView,
    pub ws: wgpu::TextureView,
    pub u: Option<wgpu::TextureView>,
    pub us: Option<wgpu::TextureView>,
    _textures: Vec<wgpu::Texture>,
}

/// Texture copies of a packed weight (see `flags::TEX`).
pub struct TexCopy {
    pub chunks: Vec<TexChunk>,
    /// Bytes of all the textures.
    pub bytes: u64,
}

/// Whether packed weights with rows of `k` also get texture copies here: CPU adapters with
/// 8-lane subgroups, rows of whole 32-element units (the texture kernel's step; every GGUF
/// format's rows are). `LANTERN_TEX=0` turns it off.
pub fn tex_fits(ctx: &GpuContext, k: usize) -> bool {
    ctx.caps.cpu_like
        && xbcast_fits(ctx)
        && k.is_multiple_of(32)
        && ctx.limits.max_texture_dimension_2d >= crate::gpu::buffer::TEX_WIDTH
        && std::env::var("LANTERN_TEX").as_deref() != Ok("0")
}

/// Rows `r0..r0 + n` of `words` (`per_row` words each), each padded to a multiple of 4.
fn padded_rows(words: &[u32], per_row: usize, r0: usize, n: usize) -> Vec<u32> {
    let padded = per_row.div_ceil(4) * 4;
    let mut v = Vec::with_capacity(n * padded);
    for r in r0..r0 + n {
        v.extend_from_slice(&words[r * per_row..(r + 1) * per_row]);
        v.resize(v.len() + padded - per_row, 0);
    }
    v
}

fn texture_copy(
    ctx: &GpuContext,
    name: &str,
    w: &PackedMatrix,
    u: Option<&PackedMatrix>,
    chunks: &[crate::gpu::buffer::Chunk],
) -> Option<TexCopy> {
    use crate::gpu::buffer::create_u32_texture;
    let (qw, sw) = (w.format.qs_words(w.k), w.format.scale_words(w.k));
    let mut out = Vec::new();
    let mut bytes = 0u64;
    for c in chunks {
        let mut keep = Vec::new();
        let mut mk = |label: String, words: &[u32], per_row: usize| -> Option<wgpu::TextureView> {
            let (t, v) = create_u32_texture(ctx, &label, &padded_rows(words, per_row, c.row_offset, c.rows))?;
            bytes += (t.width() * t.height()) as u64 * 16;
            keep.push(t);
            Some(v)
        };
        let wv = mk(format!("{name}.tex"), &w.qs, qw)?;
        let wsv = mk(format!("{name}.scales.tex"), &w.scales, sw)?;
        let (uv, usv) = match u {
            Some(u) => (Some(mk(format!("{name}.up.tex"), &u.qs, qw)?), Some(mk(format!("{name}.up.scales.tex"), &u.scales, sw)?)),
            None => (None, None),
        };
        out.push(TexChunk { w: wv, ws: wsv, u: uv, us: usv, _textures: keep });
    }
    Some(TexCopy { chunks: out, bytes })
}

/// Upload one matrix: the weights (codes for packed formats) and, for packed formats, the
/// scales split at the same rows.
fn upload_matrix(ctx: &GpuContext, name: &str, m: &HostMatrix, n: usize, k: usize) -> Result<(GpuTensor, Option<GpuTensor>), GpuError> {
    let bad = |message: String| GpuError::Validation { context: name.into(), message };
    match m {
        HostMatrix::Packed(p) => {
            if p.rows != n || p.k != k {
                return Err(bad(format!("packed weight is {} x {}, expected {n} x {k}", p.rows, p.k)));
            }
            p.format.check(name, k).map_err(|e| bad(e.to_string()))?;
            let qs = GpuTensor::upload_rows(ctx, name, bytemuck::cast_slice(&p.qs), n, p.format.qs_words(k) * 4)?;
            let sc = GpuTensor::upload_rows_like(
                ctx,
                &format!("{name}.scales"),
                bytemuck::cast_slice(&p.scales),
                p.format.scale_words(k) * 4,
                &qs,
            )?;
            Ok((qs, Some(sc)))
        }
        HostMatrix::F32(v) => {
            if v.len() != n * k {
                return Err(bad(format!("weight has {} values, expected {n} x {k}", v.len())));
            }
            Ok((GpuTensor::upload_rows(ctx, name, bytemuck::cast_slice(v), n, k * 4)?, None))
        }
        HostMatrix::F16(v) => {
            // Odd k is fine for gathers (embedding tables); the products check it in `build`.
            if v.len() != n * k {
                return Err(bad(format!("f16 weight has {} values, expected {n} x {k}", v.len())));
            }
            Ok((GpuTensor::upload_rows(ctx, name, bytemuck::cast_slice(v), n, k * 2)?, None))
        }
    }
}

/// A single (ungated, unbiased) matrix uploaded a slice of rows at a time: a streamed load
/// writes an LM head or embedding table (a model's largest matrix) without holding it whole
/// on the host. Rows must be written in order; [`RowUpload::finish`] checks they all were.
pub struct RowUpload {
    name: String,
    n_rows: usize,
    k: usize,
    format: WeightFormat,
    quant: Option<QuantFormat>,
    w: GpuTensor,
    scales: Option<GpuTensor>,
    next: usize,
}

impl HostMatrix<'_> {
    /// Bytes per row of the weights (codes for packed formats) and of the scales, for rows
    /// of `k` elements.
    fn row_bytes(&self, k: usize) -> (usize, usize) {
        match self {
            HostMatrix::F32(_) => (k * 4, 0),
            HostMatrix::F16(_) => (k * 2, 0),
            HostMatrix::Packed(p) => (p.format.qs_words(k) * 4, p.format.scale_words(k) * 4),
        }
    }

    /// Rows held, for rows of `k` elements.
    fn rows(&self, k: usize) -> usize {
        match self {
            HostMatrix::F32(v) => v.len() / k.max(1),
            HostMatrix::F16(v) => v.len() / k.max(1),
            HostMatrix::Packed(p) => p.rows,
        }
    }
}

impl RowUpload {
    /// Whether a matrix stored like `first` can be written a slice at a time: its rows are
    /// whole 4-byte words (an f16 matrix with odd `k` is not).
    pub fn fits(first: &HostMatrix, k: usize) -> bool {
        let (w, s) = first.row_bytes(k);
        w.is_multiple_of(4) && s.is_multiple_of(4)
    }

    /// GPU buffers for an `n_rows` x `k` matrix stored like `first` (a slice of its rows, in
    /// the format every slice will have); nothing is written yet.
    pub fn begin(ctx: &GpuContext, name: &str, first: &HostMatrix, n_rows: usize, k: usize) -> Result<RowUpload, GpuError> {
        let (format, quant) = match first {
            HostMatrix::F32(_) => (WeightFormat::F32, None),
            HostMatrix::F16(_) => (WeightFormat::F16, None),
            HostMatrix::Packed(p) => {
                p.format.check(name, k).map_err(|e| GpuError::Validation { context: name.into(), message: e.to_string() })?;
                (WeightFormat::from_quant(p.format.kind), Some(p.format))
            }
        };
        let (wb, sb) = first.row_bytes(k);
        let w = GpuTensor::allocate_rows(ctx, name, n_rows, wb)?;
        let scales = match quant {
            Some(_) => Some(GpuTensor::allocate_rows_like(ctx, &format!("{name}.scales"), sb, &w)?),
            None => None,
        };
        Ok(RowUpload { name: name.into(), n_rows, k, format, quant, w, scales, next: 0 })
    }

    /// Write the next rows (as many as `m` holds), which must be stored like the first.
    pub fn write(&mut self, ctx: &GpuContext, m: &HostMatrix) -> Result<(), GpuError> {
        let bad = |message: String| GpuError::Validation { context: self.name.clone(), message };
        let same = match (m, self.quant) {
            (HostMatrix::F32(_), None) => self.format == WeightFormat::F32,
            (HostMatrix::F16(_), None) => self.format == WeightFormat::F16,
            (HostMatrix::Packed(p), Some(q)) => p.format == q && p.k == self.k,
            _ => false,
        };
        if !same {
            return Err(bad(format!("rows from {} on are stored unlike the first rows", self.next)));
        }
        let n = m.rows(self.k);
        if self.next + n > self.n_rows {
            return Err(bad(format!("rows {}..{} written, the matrix has {}", self.next, self.next + n, self.n_rows)));
        }
        match m {
            HostMatrix::F32(v) => self.w.write_rows(ctx, self.next, bytemuck::cast_slice(v))?,
            HostMatrix::F16(v) => self.w.write_rows(ctx, self.next, bytemuck::cast_slice(v))?,
            HostMatrix::Packed(p) => {
                self.w.write_rows(ctx, self.next, bytemuck::cast_slice(&p.qs))?;
                if let Some(s) = &self.scales {
                    s.write_rows(ctx, self.next, bytemuck::cast_slice(&p.scales))?;
                }
            }
        }
        self.next += n;
        Ok(())
    }

    /// The linear layer, once every row is written.
    pub fn finish(self) -> Result<GpuLinear, GpuError> {
        if self.next != self.n_rows {
            return Err(GpuError::Validation {
                context: self.name,
                message: format!("{} of {} rows were written", self.next, self.n_rows),
            });
        }
        Ok(GpuLinear {
            name: self.name,
            n_rows: self.n_rows,
            k: self.k,
            format: self.format,
            w: self.w,
            u: None,
            quant: self.quant,
            w_scales: self.scales,
            u_scales: None,
            bias: None,
            tex: None,
            gelu: false,
        })
    }
}

impl GpuLinear {
    /// Upload a weight (and, for gated layers, the up weight) plus an optional bias, with
    /// texture copies of packed weights where [`tex_fits`].
    pub fn upload(
        ctx: &GpuContext,
        name: &str,
        w: HostMatrix,
        u: Option<HostMatrix>,
        bias: Option<&[f32]>,
        n_rows: usize,
        k: usize,
    ) -> Result<GpuLinear, GpuError> {
        Self::upload_with(ctx, name, w, u, bias, n_rows, k, true)
    }

    /// [`upload`](Self::upload), with `textures: false` never making texture copies (a model
    /// too large for its weights to be held twice).
    #[allow(clippy::too_many_arguments)]
    pub fn upload_with(
        ctx: &GpuContext,
        name: &str,
        w: HostMatrix,
        u: Option<HostMatrix>,
        bias: Option<&[f32]>,
        n_rows: usize,
        k: usize,
        textures: bool,
    ) -> Result<GpuLinear, GpuError> {
        let (format, quant) = match w {
            HostMatrix::F32(_) => (WeightFormat::F32, None),
            HostMatrix::F16(_) => (WeightFormat::F16, None),
            HostMatrix::Packed(p) => (WeightFormat::from_quant(p.format.kind), Some(p.format)),
        };
        let u_format = match &u {
            None => None,
            Some(HostMatrix::F32(_)) => Some(None),
            Some(HostMatrix::F16(_)) => Some(Some(WeightFormat::F16)),
            Some(HostMatrix::Packed(p)) => Some(Some(WeightFormat::from_quant(p.format.kind))),
        };
        let same = match (&u, u_format) {
            (None, _) => true,
            (Some(HostMatrix::Packed(p)), _) => quant == Some(p.format),
            (Some(_), Some(f)) => f.unwrap_or(WeightFormat::F32) == format,
            _ => false,
        };
        if !same {
            return Err(GpuError::Validation { context: name.into(), message: "gate and up weights must share one storage format".into() });
        }
        let (wt, w_scales) = upload_matrix(ctx, name, &w, n_rows, k)?;
        let (ut, u_scales) = match &u {
            Some(m) => {
                let (t, s) = upload_matrix(ctx, &format!("{name}.up"), m, n_rows, k)?;
                (Some(t), s)
            }
            None => (None, None),
        };
        let bias = match bias {
            Some(b) => {
                if b.len() != n_rows {
                    return Err(GpuError::Validation {
                        context: name.into(),
                        message: format!("bias has {} values, expected {n_rows}", b.len()),
                    });
                }
                let mut v = Vec::new();
                for c in &wt.chunks {
                    v.push(create_storage(ctx, &format!("{name}.bias"), bytemuck::cast_slice(&b[c.row_offset..c.row_offset + c.rows]))?);
                }
                Some(v)
            }
            None => None,
        };
        let tex = match (&w, &u, quant) {
            (HostMatrix::Packed(pw), u, Some(_)) if textures && tex_fits(ctx, k) => {
                let pu = match u {
                    Some(HostMatrix::Packed(p)) => Some(*p),
                    _ => None,
                };
                texture_copy(ctx, name, pw, pu, &wt.chunks)
            }
            _ => None,
        };
        Ok(GpuLinear { name: name.into(), n_rows, k, format, w: wt, u: ut, quant, w_scales, u_scales, bias, tex, gelu: false })
    }

    /// Bytes of weights held on the GPU (codes and scales).
    pub fn bytes(&self) -> u64 {
        let t = |x: &Option<GpuTensor>| x.as_ref().map_or(0, |t| t.bytes());
        self.w.bytes() + t(&self.u) + t(&self.w_scales) + t(&self.u_scales)
    }

    /// Bytes of scale metadata alone (packed formats).
    pub fn scale_bytes(&self) -> u64 {
        let t = |x: &Option<GpuTensor>| x.as_ref().map_or(0, |t| t.bytes());
        t(&self.w_scales) + t(&self.u_scales)
    }

    /// Bytes of bias held on the GPU.
    pub fn bias_bytes(&self) -> u64 {
        self.bias.as_ref().map_or(0, |_| self.n_rows as u64 * 4)
    }
}

/// Which kernel shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// One or a few rows: matvec.
    Matvec,
    /// A few rows sharing each pass over the weights: the four-token packed matvec
    /// (`flags::TOK4`) of the adapter's layout (CPU adapters: ROWS4 | XBCAST from storage or
    /// texture copies; GPUs: MULTI_ROW); elsewhere the matvec.
    MatvecBatch,
    /// Many rows: tiled matmul.
    Matmul,
}

/// The buffers of one linear call.
pub struct LinearIo<'a> {
    pub step: &'a wgpu::Buffer,
    /// Input rows (tokens x x_stride).
    pub x: &'a wgpu::Buffer,
    pub x_stride: usize,
    /// RMSNorm weight when NORM is fused.
    pub norm: Option<&'a wgpu::Buffer>,
    pub eps: f32,
    /// Output rows (tokens x out_stride); written at column `out_offset`.
    pub y: &'a wgpu::Buffer,
    pub out_stride: usize,
    pub out_offset: usize,
    /// Add into y.
    pub residual: bool,
    /// Gather input rows through this index list (matvec only).
    pub rows: Option<&'a wgpu::Buffer>,
}

/// Build the dispatches (one per weight chunk) of `y = epilogue(W x)`.
pub async fn build(ctx: &GpuContext, lin: &GpuLinear, io: &LinearIo<'_>, shape: Shape) -> Result<Vec<Dispatch>, GpuError> {
    let mut fl = 0;
    if io.norm.is_some() {
        fl |= flags::NORM;
    }
    if lin.bias.is_some() {
        fl |= flags::BIAS;
    }
    if io.residual {
        fl |= flags::RESIDUAL;
    }
    if lin.u.is_some() {
        fl |= flags::GATED;
        if lin.gelu {
            fl |= flags::GELU;
        }
    }
    if io.rows.is_some() {
        if shape == Shape::Matmul {
            return Err(GpuError::Validation {
                context: lin.name.clone(),
                message: "gathered rows are only supported by the matvec kernel".into(),
            });
        }
        fl |= flags::GATHER;
    }
    let mut features = crate::gpu::Features::default();
    let packed = lin.format.is_packed();
    let (op, wg) = match shape {
        Shape::Matvec | Shape::MatvecBatch => {
            let (mut f, w) = if packed { packed_matvec_layout(ctx) } else { matvec_layout(ctx) };
            if f & flags::MULTI_ROW != 0 && !multi_row_fits(lin) {
                f = (f & !flags::MULTI_ROW) | flags::ROW_PER_WORKGROUP;
            }
            fl |= f;
            features.subgroups = fl & (flags::ROW_PER_WORKGROUP | flags::MULTI_ROW) != 0 && ctx.caps.subgroups;
            // GPUs' batched steps: four tokens per pass over the weights.
            if fl & flags::MULTI_ROW != 0 && shape == Shape::MatvecBatch {
                fl |= flags::TOK4;
            }
            if fl & flags::XBCAST != 0 {
                features.subgroups = true;
                // Batched steps take four tokens per pass over the weights: from the texture
                // copies when the model has them (`LANTERN_TOK4=tex` or
                // `ModelOptions::weight_textures`), else from storage; one token reads
                // storage (measured on lavapipe, SmolLM2 Q4_1 decode: 57 ms per token from
                // storage, 85 ms from textures).
                if shape == Shape::MatvecBatch {
                    fl |= flags::TOK4;
                    if lin.tex.is_some() {
                        fl |= flags::TEX;
                    }
                }
            }
            features.f16 = packed && fl & flags::ROW_PER_WORKGROUP != 0 && packed_f16(ctx);
            (if packed { ShaderOp::MatvecQ } else { ShaderOp::Matvec }, w)
        }
        Shape::Matmul => {
            let (op, f, w) = matmul_layout(ctx);
            fl |= f;
            match (op, packed) {
                (ShaderOp::MatmulBlocked, true) => {
                    if xbcast_fits(ctx) {
                        fl |= flags::XBCAST;
                        features.subgroups = true;
                    }
                    (ShaderOp::MatmulBlockedQ, w)
                }
                (op, true) => {
                    features.f16 = packed_f16(ctx);
                    (op, w)
                }
                (op, false) => (op, w),
            }
        }
    };
    let key = PipelineKey::new(op, wg).with_flags(fl).with_weights(lin.format).with_features(features);
    build_with_key(ctx, lin, io, key).await
}

/// Matvec layout by adapter: `(flags, workgroup size)`.
///
/// On CPU adapters (lavapipe, SwiftShader) every storage-buffer load is emulated per lane
/// (lavapipe: a scalar load behind two branches), so the count of loads, not bytes, sets the
/// speed: each invocation computes four rows (ROWS4) so one x load serves four weights, in
/// workgroups of 8 (one SIMD batch; many workgroups keep every CPU thread busy). Measured
/// on lavapipe: 1.6-2x the row-per-workgroup and row-per-invocation layouts. On GPUs a
/// 64-wide workgroup per row gives coalesced loads. Override with
/// `LANTERN_MATVEC=thread|rows4|wg8|wg64` (benchmarks).
pub fn matvec_layout(ctx: &GpuContext) -> (u32, u32) {
    let forced = std::env::var("LANTERN_MATVEC").ok();
    match forced.as_deref() {
        Some("thread") => return (0, 64),
        Some("rows4") => return (flags::ROWS4, 8),
        // `multirow` is a packed-weight layout (packed_matvec_layout); float weights take
        // the GPU layout they have.
        Some("wg64") | Some("multirow") => return (flags::ROW_PER_WORKGROUP, 64),
        Some("wg8") => return (flags::ROW_PER_WORKGROUP, 8),
        _ => {}
    }
    if ctx.caps.cpu_like {
        (flags::ROWS4, 8)
    } else {
        (flags::ROW_PER_WORKGROUP, 64)
    }
}

/// Whether models get texture copies of packed weights by default, for the texture form of
/// the batched (TOK4) packed matvec (`LANTERN_TOK4=tex`; the storage form is the default).
pub fn tok4_from_textures() -> bool {
    std::env::var("LANTERN_TOK4").as_deref() == Ok("tex")
}

/// The packed matvec's layout here: `matvec_layout`, restricted to the tuned packed layouts
/// (ROWS4 on CPU adapters, with XBCAST where the workgroup of 8 is one subgroup; on GPUs
/// MULTI_ROW, llama.cpp's K-quant layout, for rows whose groups hold 16 elements or more:
/// `build` takes ROW_PER_WORKGROUP for the rest). `LANTERN_MATVEC=wg64` forces the
/// row-per-workgroup layout, `multirow` the multi-row one (on any adapter: tests). The
/// four-token batched form (TOK4) exists where XBCAST or MULTI_ROW does.
pub fn packed_matvec_layout(ctx: &GpuContext) -> (u32, u32) {
    let forced = std::env::var("LANTERN_MATVEC").ok();
    if forced.as_deref() == Some("multirow") || (forced.is_none() && !ctx.caps.cpu_like) {
        return (flags::MULTI_ROW, 64);
    }
    let (f, w) = matvec_layout(ctx);
    let (f, w) = if f & flags::ROWS4 == 0 && f & flags::ROW_PER_WORKGROUP == 0 { (flags::ROWS4, 8) } else { (f, w) };
    if f & flags::ROWS4 != 0 && w == 8 && xbcast_fits(ctx) {
        (f | flags::XBCAST, w)
    } else {
        (f, w)
    }
}

/// Rows per workgroup of the MULTI_ROW matvec (`MR_ROWS` in shaders/common/matvec_end.wgsl).
pub const MULTI_ROW_ROWS: u32 = 2;

/// Whether the MULTI_ROW matvec reads this weight: packed, with rows and scale groups of
/// whole 16-element units (every GGUF format; `lantern quantize` packs may use groups of 8).
pub fn multi_row_fits(lin: &GpuLinear) -> bool {
    lin.quant.is_some_and(|q| q.group.is_multiple_of(16)) && lin.k.is_multiple_of(16)
}

/// Whether the XBCAST layouts run here: the workgroup of 8 must be exactly one subgroup
/// (lavapipe: always 8 lanes). `LANTERN_XBCAST=0` turns them off (benchmarks).
pub fn xbcast_fits(ctx: &GpuContext) -> bool {
    ctx.caps.subgroups
        && ctx.caps.subgroup_min_size == 8
        && ctx.caps.subgroup_max_size == 8
        && std::env::var("LANTERN_XBCAST").as_deref() != Ok("0")
}

/// Whether the packed-weight GPU kernels dequantize in half precision: on GPUs offering
/// shader-f16 (packed f16 math, half-size weight tiles). CPU adapters always take the f32
/// kernels, whose results equal dequantize-then-multiply in f32. `LANTERN_F16_DEQUANT=0`
/// turns it off.
pub fn packed_f16(ctx: &GpuContext) -> bool {
    ctx.caps.shader_f16 && !ctx.caps.cpu_like && std::env::var("LANTERN_F16_DEQUANT").as_deref() != Ok("0")
}

/// Prefill matmul variant by adapter: `(op, flags, workgroup size)`.
///
/// On CPU adapters the tiled matmul's workgroup-memory staging and barriers cost more than
/// they save (workgroup-memory loads are emulated per lane like storage loads, and each
/// barrier switches every invocation's coroutine), so each invocation instead computes a
/// register block of tokens x rows straight from global memory (`MatmulBlocked`), in
/// workgroups of 8 (one SIMD batch), 8 tokens x 8 rows each: measured on lavapipe (64
/// tokens, 576x1536 and 1536x576) 3-5x the tiled matmul, and 1.3-1.8x the 4x4, 8x4 and 4x8
/// blocks (benches/kernels.rs). On GPUs the tiled matmul. Override with
/// `LANTERN_MATMUL=tiled|blocked` (benchmarks).
pub fn matmul_layout(ctx: &GpuContext) -> (ShaderOp, u32, u32) {
    let forced = std::env::var("LANTERN_MATMUL").ok();
    match forced.as_deref() {
        Some("tiled") => return (ShaderOp::Matmul, 0, 64),
        Some("blocked") => return BLOCKED_DEFAULT,
        _ => {}
    }
    if ctx.caps.cpu_like {
        BLOCKED_DEFAULT
    } else {
        (ShaderOp::Matmul, 0, 64)
    }
}

/// The blocked matmul variant CPU adapters get.
pub const BLOCKED_DEFAULT: (ShaderOp, u32, u32) = (ShaderOp::MatmulBlocked, flags::BLOCK_M8 | flags::BLOCK_N8, 8);

/// Tokens x rows computed by one invocation of a blocked matmul variant.
pub fn blocked_tile(fl: u32) -> (u32, u32) {
    let tm = if fl & flags::BLOCK_M8 != 0 { 8 } else { 4 };
    let tn = if fl & flags::BLOCK_N8 != 0 { 8 } else { 4 };
    (tm, tn)
}

/// Build with an explicit variant (tests use this to cover every layout on one adapter).
pub async fn build_with_key(ctx: &GpuContext, lin: &GpuLinear, io: &LinearIo<'_>, key: PipelineKey) -> Result<Vec<Dispatch>, GpuError> {
    if key.weights != lin.format {
        return Err(GpuError::Validation {
            context: lin.name.clone(),
            message: format!("kernel {} does not read {} weights", key.label(), lin.format.name()),
        });
    }
    if lin.format == WeightFormat::F16 && !lin.k.is_multiple_of(2) {
        return Err(GpuError::Validation {
            context: lin.name.clone(),
            message: format!("f16 products read weight pairs: k = {} must be even", lin.k),
        });
    }
    if key.flags & flags::XBCAST != 0 && (key.workgroup != 8 || !xbcast_fits(ctx)) {
        return Err(GpuError::Validation {
            context: lin.name.clone(),
            message: format!("{} needs workgroups of exactly one 8-lane subgroup", key.label()),
        });
    }
    if key.flags & flags::TOK4 != 0 && key.flags & flags::TEX != 0 && lin.tex.is_none() {
        return Err(GpuError::Validation {
            context: lin.name.clone(),
            message: format!("{} reads texture-held weights, which {} has not", key.label(), lin.name),
        });
    }
    if matches!(key.op, ShaderOp::MatvecQ | ShaderOp::MatmulBlockedQ) && (!io.x_stride.is_multiple_of(4) || !lin.k.is_multiple_of(4)) {
        return Err(GpuError::Validation {
            context: lin.name.clone(),
            message: format!("packed kernels read x as vec4: x stride {} and k {} must be multiples of 4", io.x_stride, lin.k),
        });
    }
    if key.flags & flags::MULTI_ROW != 0 && (key.op != ShaderOp::MatvecQ || !multi_row_fits(lin)) {
        return Err(GpuError::Validation {
            context: lin.name.clone(),
            message: format!(
                "{} reads packed weights in 16-element units: k = {} and the group ({}) must be multiples of 16",
                key.label(),
                lin.k,
                lin.quant.map_or(0, |q| q.group)
            ),
        });
    }
    let pipe = pipeline(ctx, key).await?;
    let max_dim = ctx.limits.max_compute_workgroups_per_dimension.max(1);
    let mut out = Vec::new();
    for (ci, chunk) in lin.w.chunks.iter().enumerate() {
        let rows = chunk.rows as u32;
        let (grid, grid_x) = match key.op {
            ShaderOp::Matmul => ([Dim::Const(rows.div_ceil(32)), Dim::TokensDiv(32), Dim::Const(1)], 0),
            ShaderOp::MatmulBlocked | ShaderOp::MatmulBlockedQ => {
                let (tm, tn) = blocked_tile(key.flags);
                ([Dim::Const(rows.div_ceil(tn * key.workgroup)), Dim::TokensDiv(tm), Dim::Const(1)], 0)
            }
            _ => {
                let groups = if key.flags & flags::ROW_PER_WORKGROUP != 0 {
                    rows
                } else if key.flags & flags::MULTI_ROW != 0 {
                    rows.div_ceil(MULTI_ROW_ROWS)
                } else if key.flags & flags::TEX != 0 {
                    rows.div_ceil(8 * key.workgroup)
                } else if key.flags & flags::ROWS4 != 0 {
                    rows.div_ceil(4 * key.workgroup)
                } else {
                    rows.div_ceil(key.workgroup)
                };
                let gx = groups.min(max_dim);
                let gy = groups.div_ceil(gx);
                let tt = if key.flags & flags::TOK4 != 0 { 4 } else { 1 };
                let tok = if key.flags & flags::GATHER != 0 { Dim::OutDiv(tt) } else { Dim::TokensDiv(tt) };
                ([Dim::Const(gx), Dim::Const(gy), tok], gx)
            }
        };
        let params = LinearParams {
            n_rows: rows,
            k: lin.k as u32,
            row_offset: (io.out_offset + chunk.row_offset) as u32,
            out_stride: io.out_stride as u32,
            x_stride: io.x_stride as u32,
            grid_x,
            eps: io.eps,
            group: lin.quant.map_or(0, |q| q.group),
        };
        let ubuf = create_uniform(ctx, &format!("{}.params", lin.name), &params);
        let mut entries: Vec<(u32, &wgpu::Buffer)> = vec![(0, io.step), (1, &ubuf), (2, io.x), (3, &chunk.buffer), (7, io.y)];
        if key.flags & flags::GATED != 0 {
            let u = lin
                .u
                .as_ref()
                .ok_or_else(|| GpuError::Validation { context: lin.name.clone(), message: "gated kernel without up weight".into() })?;
            entries.push((4, &u.chunks[ci].buffer));
        }
        if let Some(g) = io.norm {
            entries.push((5, g));
        }
        if let Some(b) = &lin.bias {
            entries.push((6, &b[ci]));
        }
        if let Some(r) = io.rows {
            entries.push((8, r));
        }
        let tex = if key.flags & flags::TEX != 0 {
            let t = lin.tex.as_ref().ok_or_else(|| GpuError::Validation {
                context: lin.name.clone(),
                message: format!("{} needs the texture copy of the weights", key.label()),
            })?;
            // The texture kernel reads no weight storage buffers.
            entries.retain(|(b, _)| !matches!(b, 3 | 4));
            Some(&t.chunks[ci])
        } else {
            None
        };
        if key.weights.is_packed() && tex.is_none() {
            let missing = || GpuError::Validation { context: lin.name.clone(), message: "packed kernel without scales".into() };
            entries.push((9, &lin.w_scales.as_ref().ok_or_else(missing)?.chunks[ci].buffer));
            if key.flags & flags::GATED != 0 {
                entries.push((10, &lin.u_scales.as_ref().ok_or_else(missing)?.chunks[ci].buffer));
            }
        }
        let bg = match tex {
            None => bind(ctx, &lin.name, &pipe, &entries),
            Some(tc) => {
                let mut all: Vec<wgpu::BindGroupEntry> =
                    entries.iter().map(|(b, buf)| wgpu::BindGroupEntry { binding: *b, resource: buf.as_entire_binding() }).collect();
                let views = [(11, Some(&tc.w)), (12, Some(&tc.ws)), (13, tc.u.as_ref()), (14, tc.us.as_ref())];
                for (b, v) in views {
                    if let Some(v) = v.filter(|_| b < 13 || key.flags & flags::GATED != 0) {
                        all.push(wgpu::BindGroupEntry { binding: b, resource: wgpu::BindingResource::TextureView(v) });
                    }
                }
                ctx.device.create_bind_group(&wgpu::BindGroupDescriptor {
                    label: Some(&lin.name),
                    layout: &pipe.get_bind_group_layout(0),
                    entries: &all,
                })
            }
        };
        out.push(Dispatch { label: format!("{} [{}]", lin.name, key.label()), pipeline: pipe.clone(), bind_group: bg, grid });
    }
    Ok(out)
}

//! `y = W x` in its two shapes: the decode matvec (`shaders/matvec.wgsl`, packed weights
//! `shaders/matvec_q_*.wgsl`, one file per layout) and the prefill matmul (`shaders/matmul.wgsl` on GPUs,
//! `shaders/matmul_blocked.wgsl` / `matmul_blocked_q.wgsl` on CPU adapters), with the fused
//! prologue/epilogues of all of them (`shaders/common/linear.wgsl`: RMSNorm folded in, bias,
//! SiLU or GELU gate, residual add, gathered rows).

use crate::gpu::buffer::{create_storage, create_uniform, TiledTensor, TILE_ROWS};
use crate::gpu::shader::{flags, WeightFormat};
use crate::gpu::{GpuContext, GpuError, GpuTensor, PipelineKey, ShaderOp};
use crate::quant::{PackedMatrix, QuantFormat};

use super::{pipeline, Dim, Dispatch};

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
/// product, optional bias, all split by rows into chunks (binding-sized buffers, or
/// texture-sized tiled textures) with the same row boundaries.
pub struct GpuLinear {
    pub name: String,
    pub n_rows: usize,
    pub k: usize,
    pub format: WeightFormat,
    pub store: Store,
    /// Packed formats: the group size.
    pub quant: Option<QuantFormat>,
    /// One bias buffer per chunk.
    pub bias: Option<Vec<wgpu::Buffer>>,
    /// Gated layers: GELU-tanh instead of SiLU on the gate (`flags::GELU`).
    pub gelu: bool,
}

/// Where a linear layer's weights live.
pub enum Store {
    /// Storage buffers: the weights (codes for packed formats), the up weight of gated
    /// layers, and packed formats' scales, chunked alike.
    Buffers { w: GpuTensor, u: Option<GpuTensor>, w_scales: Option<GpuTensor>, u_scales: Option<GpuTensor> },
    /// Packed weights on CPU adapters with 8-lane subgroups ([`tiled_fits`]): codes and
    /// scales (and the up weight's) as tiled rgba32uint textures, read by the `flags::TEX`
    /// kernels.
    Tiled { w: TiledTensor, ws: TiledTensor, u: Option<TiledTensor>, us: Option<TiledTensor> },
}

/// Whether a packed weight with rows of `k` in `format` is held as tiled textures here: CPU
/// adapters whose workgroup of 8 is one subgroup, rows of whole 32-element units, and scale
/// groups of a power-of-two number of units (the kernel shifts instead of dividing) or a
/// K-quant's fixed 16 (two per unit). `KernelOptions::weight_textures` off keeps
/// storage buffers (comparisons). Measured on lavapipe, Q4_K 16384 x 4096: 4.3-5.1 GB/s
/// against 0.72 GB/s for the storage layout (`cargo bench --bench kernels` compares them).
pub fn tiled_fits(ctx: &GpuContext, format: QuantFormat, k: usize) -> bool {
    let texels = [TiledTensor::texels_per_row(format.qs_words(k)), TiledTensor::texels_per_row(format.scale_words(k))];
    ctx.caps.cpu_like
        && xbcast_fits(ctx)
        && k.is_multiple_of(32)
        && format.qs_words(k).max(format.scale_words(k)) <= crate::gpu::buffer::MAX_TILED_ROW_WORDS
        && (format.kind.is_super() || format.group >= 32 && format.group.is_power_of_two())
        && TiledTensor::split(ctx, 1, &texels).is_some()
        && ctx.kernels.weight_textures
}

/// Whether the tiled matvec reads x and the norm weight through 64 KiB uniform windows
/// here (`flags::XU`): the adapter binds uniforms that large. Activation and norm buffers are
/// then made uniform-capable and at least that long ([`crate::gpu::buffer::create_x_buffer`]).
pub fn xu_fits(ctx: &GpuContext) -> bool {
    // The padded buffers are also bound whole as storage.
    ctx.limits.max_uniform_buffer_binding_size >= XU_WINDOW as u64 && ctx.max_binding() >= XU_WINDOW as u64 && ctx.kernels.uniform_x
}

/// Bytes of the uniform window of x (`xu` in shaders/common/linear.wgsl: 4096 vec4).
pub const XU_WINDOW: u32 = 65536;

/// The uniform window the linear layers' inputs and norm weights are made for here: the
/// tiled matvec's [`XU_WINDOW`] where it can read them so (CPU adapters with 8-lane subgroups
/// and 64 KiB uniforms), else 0 (plain storage buffers).
pub fn x_window(ctx: &GpuContext) -> u64 {
    if ctx.caps.cpu_like && xbcast_fits(ctx) && xu_fits(ctx) {
        XU_WINDOW as u64
    } else {
        0
    }
}

/// Upload one matrix: the weights (codes for packed formats) and, for packed formats, the
/// scales split at the same rows.
fn upload_matrix(ctx: &GpuContext, name: &str, m: &HostMatrix, n: usize, k: usize) -> Result<(GpuTensor, Option<GpuTensor>), GpuError> {
    let bad = |message: String| GpuError::Validation { context: name.into(), message };
    match m {
        HostMatrix::Packed(p) => {
            check_packed(name, p, n, k)?;
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

fn check_packed(name: &str, p: &PackedMatrix, n: usize, k: usize) -> Result<(), GpuError> {
    let bad = |message: String| GpuError::Validation { context: name.into(), message };
    if p.rows != n || p.k != k {
        return Err(bad(format!("packed weight is {} x {}, expected {n} x {k}", p.rows, p.k)));
    }
    p.format.check(name, k).map_err(|e| bad(e.to_string()))
}

/// The row split of a tiled matrix in `format` with rows of `k`: codes and scales alike.
fn tiled_split(ctx: &GpuContext, name: &str, format: QuantFormat, n: usize, k: usize) -> Result<Vec<(usize, usize)>, GpuError> {
    let texels = [TiledTensor::texels_per_row(format.qs_words(k)), TiledTensor::texels_per_row(format.scale_words(k))];
    TiledTensor::split(ctx, n, &texels).ok_or_else(|| GpuError::BindingTooLarge {
        tensor: name.into(),
        bytes: (texels[0] * 16 * crate::gpu::buffer::TILE_ROWS) as u64,
        limit: crate::gpu::buffer::TEX_WIDTH as u64 * ctx.limits.max_texture_dimension_2d as u64 * 16,
    })
}

/// Upload a packed matrix as tiled textures (codes, scales) split at `split`.
fn upload_tiled(ctx: &GpuContext, name: &str, p: &PackedMatrix, split: &[(usize, usize)]) -> Result<(TiledTensor, TiledTensor), GpuError> {
    let (qw, sw) = (p.format.qs_words(p.k), p.format.scale_words(p.k));
    let w = TiledTensor::upload(ctx, name, &p.qs, p.rows, qw, split)?;
    let s = TiledTensor::upload(ctx, &format!("{name}.scales"), &p.scales, p.rows, sw, split)?;
    Ok((w, s))
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
    dest: RowDest,
    next: usize,
}

/// Where a [`RowUpload`] writes.
enum RowDest {
    Buffers {
        w: GpuTensor,
        scales: Option<GpuTensor>,
    },
    /// Tiled textures take whole tiles: the rows of a slice past its last whole tile wait
    /// here (codes, scales; starting at `RowUpload::next` minus their count) for the next.
    Tiled {
        w: TiledTensor,
        ws: TiledTensor,
        qs: Vec<u32>,
        sc: Vec<u32>,
    },
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

    /// GPU storage for an `n_rows` x `k` matrix stored like `first` (a slice of its rows, in
    /// the format every slice will have), tiled textures where [`tiled_fits`] and `tiled`;
    /// nothing is written yet.
    pub fn begin(ctx: &GpuContext, name: &str, first: &HostMatrix, n_rows: usize, k: usize, tiled: bool) -> Result<RowUpload, GpuError> {
        let (format, quant) = match first {
            HostMatrix::F32(_) => (WeightFormat::F32, None),
            HostMatrix::F16(_) => (WeightFormat::F16, None),
            HostMatrix::Packed(p) => {
                p.format.check(name, k).map_err(|e| GpuError::Validation { context: name.into(), message: e.to_string() })?;
                (WeightFormat::from_quant(p.format.kind), Some(p.format))
            }
        };
        let dest = match quant {
            Some(q) if tiled && tiled_fits(ctx, q, k) => {
                let split = tiled_split(ctx, name, q, n_rows, k)?;
                RowDest::Tiled {
                    w: TiledTensor::allocate(ctx, name, n_rows, q.qs_words(k), &split),
                    ws: TiledTensor::allocate(ctx, &format!("{name}.scales"), n_rows, q.scale_words(k), &split),
                    qs: Vec::new(),
                    sc: Vec::new(),
                }
            }
            _ => {
                let (wb, sb) = first.row_bytes(k);
                let w = GpuTensor::allocate_rows(ctx, name, n_rows, wb)?;
                let scales = match quant {
                    Some(_) => Some(GpuTensor::allocate_rows_like(ctx, &format!("{name}.scales"), sb, &w)?),
                    None => None,
                };
                RowDest::Buffers { w, scales }
            }
        };
        Ok(RowUpload { name: name.into(), n_rows, k, format, quant, dest, next: 0 })
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
        match (&mut self.dest, m) {
            (RowDest::Buffers { w, .. }, HostMatrix::F32(v)) => w.write_rows(ctx, self.next, bytemuck::cast_slice(v))?,
            (RowDest::Buffers { w, .. }, HostMatrix::F16(v)) => w.write_rows(ctx, self.next, bytemuck::cast_slice(v))?,
            (RowDest::Buffers { w, scales }, HostMatrix::Packed(p)) => {
                w.write_rows(ctx, self.next, bytemuck::cast_slice(&p.qs))?;
                if let Some(s) = scales {
                    s.write_rows(ctx, self.next, bytemuck::cast_slice(&p.scales))?;
                }
            }
            (RowDest::Tiled { w, ws, qs, sc }, HostMatrix::Packed(p)) => {
                qs.extend_from_slice(&p.qs);
                sc.extend_from_slice(&p.scales);
                let (qw, sw) = (w.row_words, ws.row_words);
                let held = qs.len() / qw;
                let start = self.next + n - held;
                // Whole tiles now; the rest waits (all of it at the matrix's end).
                let whole = if self.next + n == self.n_rows { held } else { held / TILE_ROWS * TILE_ROWS };
                w.write_rows(ctx, start, &qs[..whole * qw])?;
                ws.write_rows(ctx, start, &sc[..whole * sw])?;
                qs.drain(..whole * qw);
                sc.drain(..whole * sw);
            }
            (RowDest::Tiled { .. }, _) => return Err(bad("tiled textures hold packed weights only".into())),
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
        let store = match self.dest {
            RowDest::Buffers { w, scales } => Store::Buffers { w, u: None, w_scales: scales, u_scales: None },
            RowDest::Tiled { w, ws, .. } => Store::Tiled { w, ws, u: None, us: None },
        };
        Ok(GpuLinear {
            name: self.name,
            n_rows: self.n_rows,
            k: self.k,
            format: self.format,
            store,
            quant: self.quant,
            bias: None,
            gelu: false,
        })
    }
}

impl GpuLinear {
    /// Upload a weight (and, for gated layers, the up weight) plus an optional bias; packed
    /// weights as tiled textures where [`tiled_fits`].
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

    /// [`upload`](Self::upload), with `tiled: false` keeping packed weights in storage
    /// buffers where tiled textures would fit (benchmarks and tests of both).
    #[allow(clippy::too_many_arguments)]
    pub fn upload_with(
        ctx: &GpuContext,
        name: &str,
        w: HostMatrix,
        u: Option<HostMatrix>,
        bias: Option<&[f32]>,
        n_rows: usize,
        k: usize,
        tiled: bool,
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
        let store = match (&w, quant) {
            (HostMatrix::Packed(pw), Some(q)) if tiled && tiled_fits(ctx, q, k) => {
                check_packed(name, pw, n_rows, k)?;
                let split = tiled_split(ctx, name, q, n_rows, k)?;
                let (tw, ts) = upload_tiled(ctx, name, pw, &split)?;
                let (tu, tus) = match &u {
                    Some(HostMatrix::Packed(pu)) => {
                        check_packed(&format!("{name}.up"), pu, n_rows, k)?;
                        let (a, b) = upload_tiled(ctx, &format!("{name}.up"), pu, &split)?;
                        (Some(a), Some(b))
                    }
                    _ => (None, None),
                };
                Store::Tiled { w: tw, ws: ts, u: tu, us: tus }
            }
            _ => {
                let (wt, w_scales) = upload_matrix(ctx, name, &w, n_rows, k)?;
                let (ut, u_scales) = match &u {
                    Some(m) => {
                        let (t, s) = upload_matrix(ctx, &format!("{name}.up"), m, n_rows, k)?;
                        (Some(t), s)
                    }
                    None => (None, None),
                };
                Store::Buffers { w: wt, u: ut, w_scales, u_scales }
            }
        };
        let chunks = store.chunks();
        let bias = match bias {
            Some(b) => {
                if b.len() != n_rows {
                    return Err(GpuError::Validation {
                        context: name.into(),
                        message: format!("bias has {} values, expected {n_rows}", b.len()),
                    });
                }
                let mut v = Vec::new();
                for &(r, n) in &chunks {
                    v.push(create_storage(ctx, &format!("{name}.bias"), bytemuck::cast_slice(&b[r..r + n]))?);
                }
                Some(v)
            }
            None => None,
        };
        Ok(GpuLinear { name: name.into(), n_rows, k, format, store, quant, bias, gelu: false })
    }

    /// The row ranges `(first row, rows)` of the chunks: one dispatch each.
    pub fn chunks(&self) -> Vec<(usize, usize)> {
        self.store.chunks()
    }

    /// Whether this is a gated layer (gate and up weights).
    pub fn is_gated(&self) -> bool {
        match &self.store {
            Store::Buffers { u, .. } => u.is_some(),
            Store::Tiled { u, .. } => u.is_some(),
        }
    }

    /// Whether the weights are tiled textures (read by the `flags::TEX` kernels only).
    pub fn is_tiled(&self) -> bool {
        matches!(self.store, Store::Tiled { .. })
    }

    /// Bytes of the weights (codes and scales) as packed, padding aside.
    pub fn bytes(&self) -> u64 {
        match &self.store {
            Store::Buffers { w, u, w_scales, u_scales } => {
                let t = |x: &Option<GpuTensor>| x.as_ref().map_or(0, |t| t.bytes());
                w.bytes() + t(u) + t(w_scales) + t(u_scales)
            }
            Store::Tiled { w, ws, u, us } => {
                let t = |x: &Option<TiledTensor>| x.as_ref().map_or(0, |t| t.bytes());
                w.bytes() + ws.bytes() + t(u) + t(us)
            }
        }
    }

    /// Bytes of tiled textures' padding (rows to whole texels, chunks to whole tiles,
    /// textures to whole texture rows); 0 for storage buffers.
    pub fn padding_bytes(&self) -> u64 {
        match &self.store {
            Store::Buffers { .. } => 0,
            Store::Tiled { w, ws, u, us } => {
                [Some(w), Some(ws), u.as_ref(), us.as_ref()].into_iter().flatten().map(|t| t.allocated_bytes() - t.bytes()).sum()
            }
        }
    }

    /// Bytes of scale metadata alone (packed formats).
    pub fn scale_bytes(&self) -> u64 {
        match &self.store {
            Store::Buffers { w_scales, u_scales, .. } => {
                let t = |x: &Option<GpuTensor>| x.as_ref().map_or(0, |t| t.bytes());
                t(w_scales) + t(u_scales)
            }
            Store::Tiled { ws, us, .. } => ws.bytes() + us.as_ref().map_or(0, |t| t.bytes()),
        }
    }

    /// Bytes of bias held on the GPU.
    pub fn bias_bytes(&self) -> u64 {
        self.bias.as_ref().map_or(0, |_| self.n_rows as u64 * 4)
    }
}

impl Store {
    /// The row ranges `(first row, rows)` of the chunks.
    pub fn chunks(&self) -> Vec<(usize, usize)> {
        match self {
            Store::Buffers { w, .. } => w.chunks.iter().map(|c| (c.row_offset, c.rows)).collect(),
            Store::Tiled { w, .. } => w.chunks.iter().map(|c| (c.row_offset, c.rows)).collect(),
        }
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
    /// Steps of 5-8 rows (speculative verify): the eight-token packed matvec (`flags::TOK8`)
    /// where the layout has one (TEX, MULTI_ROW), else as `MatvecBatch`.
    MatvecBatch8,
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
    /// An rgba32float texture holding the step's rows of x (`kernels::x_texture`, filled by
    /// a dispatch before this one): CPU adapters' blocked matmul over tiled weights reads it
    /// (`flags::XTEX`) instead of x. None elsewhere.
    pub x_tex: Option<&'a wgpu::Texture>,
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
    if lin.is_gated() {
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
    if lin.is_tiled() {
        return build_with_key(ctx, lin, io, tiled_key(ctx, lin, io, shape, fl)).await;
    }
    let mut features = crate::gpu::Features::default();
    let packed = lin.format.is_packed();
    let (op, wg) = match shape {
        Shape::Matvec if packed && masked_fits(ctx, lin) => (ShaderOp::MatvecQMasked, MASKED_WG),
        Shape::Matvec | Shape::MatvecBatch | Shape::MatvecBatch8 => {
            let (mut f, w) = if packed { packed_matvec_layout(ctx) } else { matvec_layout(ctx) };
            if f & flags::MULTI_ROW != 0 && !multi_row_fits(lin) {
                f = (f & !flags::MULTI_ROW) | flags::ROW_PER_WORKGROUP;
            }
            fl |= f;
            features.subgroups = fl & (flags::ROW_PER_WORKGROUP | flags::MULTI_ROW) != 0 && ctx.caps.subgroups;
            // GPUs' batched steps: four or eight tokens per pass over the weights.
            if fl & flags::MULTI_ROW != 0 {
                fl |= match shape {
                    Shape::MatvecBatch => flags::TOK4,
                    Shape::MatvecBatch8 => flags::TOK8,
                    _ => 0,
                };
            }
            if fl & flags::XBCAST != 0 {
                features.subgroups = true;
                // Batched steps take four tokens per pass over the weights (the storage
                // layout has no eight-token form: 5-8 tokens take two passes).
                if matches!(shape, Shape::MatvecBatch | Shape::MatvecBatch8) {
                    fl |= flags::TOK4;
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

/// The `flags::TEX` variant reading a tiled linear in `shape` (epilogue flags `fl`): the
/// tiled matvec (TOK4 for batched steps; XU where x and the norm weight can be bound as
/// uniform windows), or the blocked matmul reading words through the textures.
pub fn tiled_key(ctx: &GpuContext, lin: &GpuLinear, io: &LinearIo<'_>, shape: Shape, fl: u32) -> PipelineKey {
    let sg = crate::gpu::Features { f16: false, subgroups: true };
    match shape {
        Shape::Matmul => {
            let (_, f, w) = BLOCKED_DEFAULT;
            if xtex_usable(lin, io) {
                return PipelineKey::new(ShaderOp::MatmulBlockedQ, w)
                    .with_flags(fl | f | flags::XBCAST | flags::TEX | flags::XTEX)
                    .with_weights(lin.format)
                    .with_features(sg);
            }
            PipelineKey::new(ShaderOp::MatmulBlockedQ, w)
                .with_flags(fl | f | flags::XBCAST | flags::TEX)
                .with_weights(lin.format)
                .with_features(sg)
        }
        Shape::Matvec | Shape::MatvecBatch | Shape::MatvecBatch8 => {
            let mut f = fl | flags::TEX;
            f |= match shape {
                Shape::MatvecBatch => flags::TOK4,
                Shape::MatvecBatch8 => flags::TOK8,
                _ => 0,
            };
            if xu_usable(ctx, lin, io) {
                f |= flags::XU;
            }
            PipelineKey::new(ShaderOp::MatvecQ, 8).with_flags(f).with_weights(lin.format).with_features(sg)
        }
    }
}

/// Whether the blocked matmul can read `io`'s x from its texture (`flags::XTEX`): there is
/// one, a row of x fits it, and the norm weight (if any) can be bound as a uniform window.
fn xtex_usable(lin: &GpuLinear, io: &LinearIo<'_>) -> bool {
    let window = |b: &wgpu::Buffer| b.usage().contains(wgpu::BufferUsages::UNIFORM) && b.size() >= XU_WINDOW as u64;
    io.x_tex.is_some_and(|t| t.width() as usize * 4 >= lin.k)
        && io.norm.is_none_or(|g| window(g) && lin.k * 4 <= XU_WINDOW as usize)
        && lin.is_tiled()
}

/// Whether the tiled matvec can read `io`'s x and norm weight through 64 KiB uniform windows:
/// the adapter allows them ([`xu_fits`]), a row of x fits one, and the buffers are
/// uniform-capable and at least that long.
fn xu_usable(ctx: &GpuContext, lin: &GpuLinear, io: &LinearIo<'_>) -> bool {
    let window = |b: &wgpu::Buffer| b.usage().contains(wgpu::BufferUsages::UNIFORM) && b.size() >= XU_WINDOW as u64;
    xu_fits(ctx) && lin.k * 4 <= XU_WINDOW as usize && window(io.x) && io.norm.is_none_or(window)
}

/// Matvec layout by adapter: `(flags, workgroup size)`.
///
/// On CPU adapters (lavapipe, SwiftShader) every storage-buffer load is emulated per lane
/// (lavapipe: a scalar load behind two branches), so the count of loads, not bytes, sets the
/// speed: each invocation computes four rows (ROWS4) so one x load serves four weights, in
/// workgroups of 8 (one SIMD batch; many workgroups keep every CPU thread busy). Measured
/// on lavapipe: 1.6-2x the row-per-workgroup and row-per-invocation layouts. On GPUs a
/// 64-wide workgroup per row gives coalesced loads. `KernelOptions::matvec` overrides
/// (comparisons, tests).
pub fn matvec_layout(ctx: &GpuContext) -> (u32, u32) {
    use crate::gpu::MatvecLayout as L;
    match ctx.kernels.matvec {
        Some(L::Thread) => return (0, 64),
        Some(L::Rows4) => return (flags::ROWS4, 8),
        // `MultiRow` is a packed-weight layout (packed_matvec_layout); float weights take
        // the GPU layout they have.
        Some(L::Wg64) | Some(L::MultiRow) => return (flags::ROW_PER_WORKGROUP, 64),
        Some(L::Wg8) => return (flags::ROW_PER_WORKGROUP, 8),
        None => {}
    }
    if ctx.caps.cpu_like {
        (flags::ROWS4, 8)
    } else {
        (flags::ROW_PER_WORKGROUP, 64)
    }
}

/// The packed matvec's layout here: `matvec_layout`, restricted to the tuned packed layouts
/// (ROWS4 on CPU adapters, with XBCAST where the workgroup of 8 is one subgroup; on GPUs
/// MULTI_ROW, llama.cpp's K-quant layout, for rows whose groups hold 16 elements or more:
/// `build` takes ROW_PER_WORKGROUP for the rest). `KernelOptions::matvec` `Wg64` forces the
/// row-per-workgroup layout, `MultiRow` the multi-row one (on any adapter: tests). The
/// four-token batched form (TOK4) exists where XBCAST or MULTI_ROW does.
pub fn packed_matvec_layout(ctx: &GpuContext) -> (u32, u32) {
    let forced = ctx.kernels.matvec;
    if forced == Some(crate::gpu::MatvecLayout::MultiRow) || (forced.is_none() && !ctx.caps.cpu_like) {
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

/// Tokens one pass of a matvec variant computes: 8 with TOK8, 4 with TOK4, else 1.
pub fn tokens_per_pass(fl: u32) -> u32 {
    if fl & flags::TOK8 != 0 {
        8
    } else if fl & flags::TOK4 != 0 {
        4
    } else {
        1
    }
}

/// Rows per workgroup of the MULTI_ROW matvec (`MR_ROWS` in shaders/common/matvec_end.wgsl).
pub const MULTI_ROW_ROWS: u32 = 2;

/// Whether the MULTI_ROW matvec reads this weight: packed, with rows and scale groups of
/// whole 16-element units (every GGUF format; `lantern quantize` packs may use groups of 8).
pub fn multi_row_fits(lin: &GpuLinear) -> bool {
    lin.quant.is_some_and(|q| q.group.is_multiple_of(16)) && lin.k.is_multiple_of(16)
}

/// Whether the packed decode matvec of CPU adapters that hold packed weights in storage
/// buffers (no 8-lane subgroups for XBCAST: SwiftShader, the browser's software GPU) is
/// `ShaderOp::MatvecQMasked`: four rows per invocation in 16-element units, codes decoded in
/// place, each group's scale applied once, for the formats [`masked_format`] lists with rows
/// and groups of whole units; the others keep ROWS4. On SwiftShader (benches/kernels.rs,
/// 4096x4096): Q8 0.39-0.49 GB/s against ROWS4's 0.29-0.30, Q5_0 0.22-0.29 against 0.12.
pub fn masked_fits(ctx: &GpuContext, lin: &GpuLinear) -> bool {
    ctx.caps.cpu_like && !xbcast_fits(ctx) && !lin.is_tiled() && masked_reads(lin)
}

/// Whether `ShaderOp::MatvecQMasked` can read `lin`: a [`masked_format`] with rows and
/// groups of whole 16-element units.
pub fn masked_reads(lin: &GpuLinear) -> bool {
    masked_format(lin.format) && lin.k.is_multiple_of(16) && lin.quant.is_some_and(|q| q.group.is_multiple_of(16))
}

/// Rows per invocation of `ShaderOp::MatvecQMasked` (shaders/matvec_q_masked.wgsl).
pub const MASKED_ROWS: u32 = 4;

/// Its workgroup: eight invocations (two SIMD batches of SwiftShader), so a 896-row matrix
/// still spreads over 28 workgroups, enough for every core of a desktop CPU.
pub const MASKED_WG: u32 = 8;

/// The formats `ShaderOp::MatvecQMasked` decodes in place (common/masked.wgsl): Q8 and those
/// with a 4-bit low plane; not the 2-bit low planes (Q2_K, Q3_K) or the IQ4 tables.
pub fn masked_format(w: WeightFormat) -> bool {
    use WeightFormat as F;
    matches!(w, F::Q8 | F::Q4 | F::Q4Sym | F::Q5Sym | F::Q5 | F::Q4K | F::Q5K | F::Q6K)
}

/// Whether the XBCAST layouts run here: the workgroup of 8 must be exactly one subgroup
/// (lavapipe: always 8 lanes). `KernelOptions::xbcast` off turns them off (comparisons).
pub fn xbcast_fits(ctx: &GpuContext) -> bool {
    ctx.caps.subgroups && ctx.caps.subgroup_min_size == 8 && ctx.caps.subgroup_max_size == 8 && ctx.kernels.xbcast
}

/// Whether the packed-weight GPU kernels dequantize in half precision: on GPUs offering
/// shader-f16 (packed f16 math, half-size weight tiles). CPU adapters always take the f32
/// kernels, whose results equal dequantize-then-multiply in f32. `KernelOptions::f16_dequant`
/// off turns it off.
pub fn packed_f16(ctx: &GpuContext) -> bool {
    ctx.caps.shader_f16 && !ctx.caps.cpu_like && ctx.kernels.f16_dequant
}

/// Prefill matmul variant by adapter: `(op, flags, workgroup size)`.
///
/// On CPU adapters the tiled matmul's workgroup-memory staging and barriers cost more than
/// they save (workgroup-memory loads are emulated per lane like storage loads, and each
/// barrier switches every invocation's coroutine), so each invocation instead computes a
/// register block of tokens x rows straight from global memory (`MatmulBlocked`), in
/// workgroups of 8 (one SIMD batch), 8 tokens x 8 rows each: measured on lavapipe (64
/// tokens, 576x1536 and 1536x576) 3-5x the tiled matmul, and 1.3-1.8x the 4x4, 8x4 and 4x8
/// blocks (benches/kernels.rs). On GPUs the tiled matmul. `KernelOptions::matmul`
/// overrides (comparisons, tests).
pub fn matmul_layout(ctx: &GpuContext) -> (ShaderOp, u32, u32) {
    match ctx.kernels.matmul {
        Some(crate::gpu::MatmulLayout::Tiled) => return (ShaderOp::Matmul, 0, 64),
        Some(crate::gpu::MatmulLayout::Blocked) => return BLOCKED_DEFAULT,
        None => {}
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
    if key.op == ShaderOp::MatvecQMasked && !masked_reads(lin) {
        return Err(GpuError::Validation {
            context: lin.name.clone(),
            message: format!(
                "{} reads Q8 and 4-bit-plane formats in 16-element units, not {} weights with k = {} and groups of {}",
                key.label(),
                lin.format.name(),
                lin.k,
                lin.quant.map_or(0, |q| q.group)
            ),
        });
    }
    let tex = key.flags & flags::TEX != 0;
    if tex != lin.is_tiled() || tex && !matches!(key.op, ShaderOp::MatvecQ | ShaderOp::MatmulBlockedQ) {
        return Err(GpuError::Validation {
            context: lin.name.clone(),
            message: format!(
                "{} reads {} weights, but {} holds them in {}",
                key.label(),
                if tex { "texture-held" } else { "buffer-held" },
                lin.name,
                if lin.is_tiled() { "tiled textures" } else { "storage buffers" }
            ),
        });
    }
    if tex && (key.workgroup != 8 || !xbcast_fits(ctx)) {
        return Err(GpuError::Validation {
            context: lin.name.clone(),
            message: format!("{} needs workgroups of exactly one 8-lane subgroup", key.label()),
        });
    }
    if key.flags & flags::XU != 0 && (key.op != ShaderOp::MatvecQ || !xu_usable(ctx, lin, io)) {
        return Err(GpuError::Validation {
            context: lin.name.clone(),
            message: format!(
                "{} reads x and the norm weight as {XU_WINDOW}-byte uniform windows: k = {} must fit one, and the buffers must be uniform-capable and that long",
                key.label(),
                lin.k
            ),
        });
    }
    let xtex = key.flags & flags::XTEX != 0;
    if xtex && (key.op != ShaderOp::MatmulBlockedQ || !xtex_usable(lin, io)) {
        return Err(GpuError::Validation {
            context: lin.name.clone(),
            message: format!(
                "{} reads x from a texture and the norm weight as a {XU_WINDOW}-byte uniform window: it needs tiled weights, an x texture at least {} floats wide, and a uniform-capable norm buffer that long",
                key.label(),
                lin.k
            ),
        });
    }
    if matches!(key.op, ShaderOp::MatvecQ | ShaderOp::MatmulBlockedQ | ShaderOp::MatvecQMasked)
        && (!io.x_stride.is_multiple_of(4) || !lin.k.is_multiple_of(4))
    {
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
    let x_view = io.x_tex.filter(|_| xtex).map(|t| t.create_view(&Default::default()));
    let max_dim = ctx.limits.max_compute_workgroups_per_dimension.max(1);
    let mut out = Vec::new();
    for (ci, (row_offset, rows)) in lin.chunks().into_iter().enumerate() {
        let rows = rows as u32;
        let (grid, grid_x) = match key.op {
            ShaderOp::Matmul => ([Dim::Const(rows.div_ceil(32)), Dim::TokensDiv(32), Dim::Const(1)], 0),
            ShaderOp::MatmulBlocked | ShaderOp::MatmulBlockedQ => {
                let (tm, tn) = blocked_tile(key.flags);
                ([Dim::Const(rows.div_ceil(tn * key.workgroup)), Dim::TokensDiv(tm), Dim::Const(1)], 0)
            }
            _ => {
                let groups = if key.op == ShaderOp::MatvecQMasked {
                    // Lanes of MASKED_ROWS rows.
                    rows.div_ceil(key.workgroup * MASKED_ROWS)
                } else if key.flags & flags::ROW_PER_WORKGROUP != 0 {
                    rows
                } else if key.flags & flags::MULTI_ROW != 0 {
                    rows.div_ceil(MULTI_ROW_ROWS)
                } else if tex {
                    rows.div_ceil(TILE_ROWS as u32)
                } else if key.flags & flags::ROWS4 != 0 {
                    rows.div_ceil(4 * key.workgroup)
                } else {
                    rows.div_ceil(key.workgroup)
                };
                let gx = groups.min(max_dim);
                let gy = groups.div_ceil(gx);
                let tt = tokens_per_pass(key.flags);
                let tok = if key.flags & flags::GATHER != 0 { Dim::OutDiv(tt) } else { Dim::TokensDiv(tt) };
                ([Dim::Const(gx), Dim::Const(gy), tok], gx)
            }
        };
        let params = LinearParams {
            n_rows: rows,
            k: lin.k as u32,
            row_offset: (io.out_offset + row_offset) as u32,
            out_stride: io.out_stride as u32,
            x_stride: io.x_stride as u32,
            grid_x,
            eps: io.eps,
            group: lin.quant.map_or(0, |q| q.group),
        };
        let ubuf = create_uniform(ctx, &format!("{}.params", lin.name), &params);
        let gated = key.flags & flags::GATED != 0;
        let missing = |what: &str| GpuError::Validation { context: lin.name.clone(), message: format!("{} needs {what}", key.label()) };
        let mut entries: Vec<(u32, Res)> = vec![(0, Res::Buf(io.step)), (1, Res::Buf(&ubuf)), (7, Res::Buf(io.y))];
        if let (true, Some(v)) = (xtex, &x_view) {
            entries.push((17, Res::View(v)));
        } else {
            entries.push((2, Res::Buf(io.x)));
        }
        match &lin.store {
            Store::Buffers { w, u, w_scales, u_scales } => {
                entries.push((3, Res::Buf(&w.chunks[ci].buffer)));
                if gated {
                    entries.push((4, Res::Buf(&u.as_ref().ok_or_else(|| missing("the up weight"))?.chunks[ci].buffer)));
                }
                if key.weights.is_packed() {
                    entries.push((9, Res::Buf(&w_scales.as_ref().ok_or_else(|| missing("scales"))?.chunks[ci].buffer)));
                    if gated {
                        entries.push((10, Res::Buf(&u_scales.as_ref().ok_or_else(|| missing("scales"))?.chunks[ci].buffer)));
                    }
                }
            }
            Store::Tiled { w, ws, u, us } => {
                entries.push((11, Res::View(&w.chunks[ci].view)));
                entries.push((12, Res::View(&ws.chunks[ci].view)));
                if gated {
                    entries.push((13, Res::View(&u.as_ref().ok_or_else(|| missing("the up weight"))?.chunks[ci].view)));
                    entries.push((14, Res::View(&us.as_ref().ok_or_else(|| missing("the up weight"))?.chunks[ci].view)));
                }
            }
        }
        if let Some(g) = io.norm {
            entries.push(if key.flags & (flags::XU | flags::XTEX) != 0 { (16, Res::Window(g)) } else { (5, Res::Buf(g)) });
        }
        if key.flags & flags::XU != 0 {
            entries.push((15, Res::Window(io.x)));
        }
        if let Some(b) = &lin.bias {
            entries.push((6, Res::Buf(&b[ci])));
        }
        if let Some(r) = io.rows {
            entries.push((8, Res::Buf(r)));
        }
        let bg = bind_res(ctx, &lin.name, &pipe, &entries);
        out.push(Dispatch { label: format!("{} [{}]", lin.name, key.label()), pipeline: pipe.clone(), bind_group: bg, grid });
    }
    Ok(out)
}

/// A resource bound to a linear kernel.
enum Res<'a> {
    Buf(&'a wgpu::Buffer),
    /// The first [`XU_WINDOW`] bytes of a buffer, as a uniform.
    Window(&'a wgpu::Buffer),
    View(&'a wgpu::TextureView),
}

fn bind_res(ctx: &GpuContext, label: &str, pipe: &wgpu::ComputePipeline, entries: &[(u32, Res)]) -> wgpu::BindGroup {
    let all: Vec<wgpu::BindGroupEntry> = entries
        .iter()
        .map(|(b, r)| wgpu::BindGroupEntry {
            binding: *b,
            resource: match r {
                Res::Buf(buf) => buf.as_entire_binding(),
                Res::Window(buf) => wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                    buffer: buf,
                    offset: 0,
                    size: std::num::NonZeroU64::new(XU_WINDOW as u64),
                }),
                Res::View(v) => wgpu::BindingResource::TextureView(v),
            },
        })
        .collect();
    ctx.bind_group(&wgpu::BindGroupDescriptor { label: Some(label), layout: &pipe.get_bind_group_layout(0), entries: &all })
}

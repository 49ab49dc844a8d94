//! A linear layer's weights on the GPU: storage buffers split at binding-sized row chunks, or
//! tiled textures on CPU adapters (`layout::tiled_fits`).

use crate::gpu::buffer::{create_storage, TiledTensor, TILE_ROWS};
use crate::gpu::shader::WeightFormat;
use crate::gpu::{GpuContext, GpuError, GpuTensor};
use crate::quant::{PackedMatrix, QuantFormat};

use super::layout::tiled_fits;
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
                (WeightFormat::Packed(p.format.kind), Some(p.format))
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
            HostMatrix::Packed(p) => (WeightFormat::Packed(p.format.kind), Some(p.format)),
        };
        let u_format = match &u {
            None => None,
            Some(HostMatrix::F32(_)) => Some(None),
            Some(HostMatrix::F16(_)) => Some(Some(WeightFormat::F16)),
            Some(HostMatrix::Packed(p)) => Some(Some(WeightFormat::Packed(p.format.kind))),
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

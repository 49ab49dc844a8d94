//! GPU buffers: uploads, tensors split by rows across bindings when they exceed
//! `max_storage_buffer_binding_size`, and asynchronous readback.

use std::sync::Arc;

use wgpu::util::DeviceExt;

use super::{AllocUsage, GpuContext, GpuError};

/// One binding-sized piece of a row-split tensor.
#[derive(Debug)]
pub struct Chunk {
    pub buffer: wgpu::Buffer,
    /// First row of the tensor held here.
    pub row_offset: usize,
    /// Rows held here.
    pub rows: usize,
}

/// A 2-D tensor (rows x row_bytes) on the GPU, split by whole rows into chunks that each fit
/// one storage binding.
#[derive(Debug)]
pub struct GpuTensor {
    pub name: String,
    pub rows: usize,
    pub row_bytes: usize,
    pub chunks: Vec<Chunk>,
}

impl GpuTensor {
    /// Upload `data` (rows x row_bytes) split into chunks of at most the binding limit.
    pub fn upload_rows(ctx: &GpuContext, name: &str, data: &[u8], rows: usize, row_bytes: usize) -> Result<GpuTensor, GpuError> {
        debug_assert_eq!(data.len(), rows * row_bytes);
        let mut chunks = Vec::new();
        for (r, n) in Self::split(ctx, name, rows, row_bytes)? {
            let bytes = &data[r * row_bytes..(r + n) * row_bytes];
            chunks.push(Chunk { buffer: create_storage(ctx, &format!("{name}[{r}..{}]", r + n), bytes)?, row_offset: r, rows: n });
        }
        Ok(GpuTensor { name: name.into(), rows, row_bytes, chunks })
    }

    /// Upload `data` (rows x row_bytes) split at the same row boundaries as `like` (the
    /// scales of a packed weight follow the chunks of its codes, so each dispatch binds a
    /// matching pair).
    pub fn upload_rows_like(ctx: &GpuContext, name: &str, data: &[u8], row_bytes: usize, like: &GpuTensor) -> Result<GpuTensor, GpuError> {
        if data.len() != like.rows * row_bytes {
            return Err(GpuError::Validation {
                context: name.into(),
                message: format!("{} bytes, expected {} rows of {row_bytes}", data.len(), like.rows),
            });
        }
        let mut chunks = Vec::new();
        for c in &like.chunks {
            let bytes = &data[c.row_offset * row_bytes..(c.row_offset + c.rows) * row_bytes];
            chunks.push(Chunk {
                buffer: create_storage(ctx, &format!("{name}[{}..{}]", c.row_offset, c.row_offset + c.rows), bytes)?,
                row_offset: c.row_offset,
                rows: c.rows,
            });
        }
        Ok(GpuTensor { name: name.into(), rows: like.rows, row_bytes, chunks })
    }

    /// The row ranges `(first row, rows)` of a tensor's chunks: as many whole rows as one
    /// binding holds (one empty chunk for an empty tensor).
    fn split(ctx: &GpuContext, name: &str, rows: usize, row_bytes: usize) -> Result<Vec<(usize, usize)>, GpuError> {
        let limit = ctx.max_binding() as usize;
        if row_bytes > limit || row_bytes == 0 && rows > 0 {
            return Err(GpuError::BindingTooLarge { tensor: name.into(), bytes: row_bytes as u64, limit: limit as u64 });
        }
        let per_chunk = (limit / row_bytes.max(1)).max(1);
        let mut out = Vec::new();
        let mut r = 0;
        while r < rows || out.is_empty() {
            let n = per_chunk.min(rows - r);
            out.push((r, n));
            r += n;
            if rows == 0 {
                break;
            }
        }
        Ok(out)
    }

    /// Rows written a slice at a time must be whole 4-byte words (the queue's copy alignment).
    fn check_word_rows(name: &str, row_bytes: usize) -> Result<(), GpuError> {
        if row_bytes.is_multiple_of(4) {
            return Ok(());
        }
        Err(GpuError::Validation {
            context: name.into(),
            message: format!("rows of {row_bytes} bytes cannot be written a slice at a time (not a multiple of 4)"),
        })
    }

    /// A tensor of `rows` x `row_bytes` whose bytes come later, a slice of rows at a time
    /// ([`write_rows`](Self::write_rows)): a streamed load writes a large matrix (an LM head)
    /// without holding it whole on the host. Chunked as [`upload_rows`](Self::upload_rows)
    /// would chunk it; `row_bytes` must be a multiple of 4 (the queue's copy alignment).
    pub fn allocate_rows(ctx: &GpuContext, name: &str, rows: usize, row_bytes: usize) -> Result<GpuTensor, GpuError> {
        Self::check_word_rows(name, row_bytes)?;
        let mut chunks = Vec::new();
        for (r, n) in Self::split(ctx, name, rows, row_bytes)? {
            chunks.push(Chunk {
                buffer: create_zeroed(ctx, &format!("{name}[{r}..{}]", r + n), (n * row_bytes) as u64)?,
                row_offset: r,
                rows: n,
            });
        }
        Ok(GpuTensor { name: name.into(), rows, row_bytes, chunks })
    }

    /// [`allocate_rows`](Self::allocate_rows) split at the same rows as `like`.
    pub fn allocate_rows_like(ctx: &GpuContext, name: &str, row_bytes: usize, like: &GpuTensor) -> Result<GpuTensor, GpuError> {
        Self::check_word_rows(name, row_bytes)?;
        let mut chunks = Vec::new();
        for c in &like.chunks {
            let label = format!("{name}[{}..{}]", c.row_offset, c.row_offset + c.rows);
            chunks.push(Chunk { buffer: create_zeroed(ctx, &label, (c.rows * row_bytes) as u64)?, row_offset: c.row_offset, rows: c.rows });
        }
        Ok(GpuTensor { name: name.into(), rows: like.rows, row_bytes, chunks })
    }

    /// Write rows `r0 ..` (as many as `data` holds, whole rows) of a tensor made by
    /// [`allocate_rows`](Self::allocate_rows), across chunk boundaries.
    pub fn write_rows(&self, ctx: &GpuContext, r0: usize, data: &[u8]) -> Result<(), GpuError> {
        let bad = |message: String| GpuError::Validation { context: self.name.clone(), message };
        if self.row_bytes == 0 || !data.len().is_multiple_of(self.row_bytes) {
            return Err(bad(format!("{} bytes are not whole rows of {}", data.len(), self.row_bytes)));
        }
        let n = data.len() / self.row_bytes;
        if r0 + n > self.rows {
            return Err(bad(format!("rows {r0}..{} written, the tensor has {}", r0 + n, self.rows)));
        }
        for c in &self.chunks {
            let (a, b) = (r0.max(c.row_offset), (r0 + n).min(c.row_offset + c.rows));
            if a >= b {
                continue;
            }
            let src = &data[(a - r0) * self.row_bytes..(b - r0) * self.row_bytes];
            let at = ((a - c.row_offset) * self.row_bytes) as u64;
            for (i, piece) in src.chunks(UPLOAD_CHUNK).enumerate() {
                ctx.queue.write_buffer(&c.buffer, at + (i * UPLOAD_CHUNK) as u64, piece);
            }
        }
        Ok(())
    }

    /// Bytes held on the GPU.
    pub fn bytes(&self) -> u64 {
        (self.rows * self.row_bytes) as u64
    }

    /// The single buffer of an unsplit tensor.
    pub fn single(&self) -> Result<&wgpu::Buffer, GpuError> {
        if self.chunks.len() == 1 {
            Ok(&self.chunks[0].buffer)
        } else {
            Err(GpuError::BindingTooLarge { tensor: self.name.clone(), bytes: self.bytes(), limit: 0 })
        }
    }
}

/// Create a storage buffer holding `bytes` (padded to 4 bytes, at least 4), checking the
/// binding limit and capturing allocation failure.
pub fn create_storage(ctx: &GpuContext, label: &str, bytes: &[u8]) -> Result<wgpu::Buffer, GpuError> {
    let limit = ctx.max_binding();
    if bytes.len() as u64 > limit {
        return Err(GpuError::BindingTooLarge { tensor: label.into(), bytes: bytes.len() as u64, limit });
    }
    let padded;
    let contents = if !bytes.len().is_multiple_of(4) || bytes.is_empty() {
        let mut v = bytes.to_vec();
        v.resize(bytes.len().div_ceil(4) * 4 + if bytes.is_empty() { 4 } else { 0 }, 0);
        padded = v;
        &padded[..]
    } else {
        bytes
    };
    ctx.ledger.record(label, contents.len() as u64, AllocUsage::Storage);
    // Not mapped at creation: the bytes go through the queue in chunks, so no buffer-sized
    // mapping (or, in a browser, no buffer-sized JS copy) exists at any time.
    let buffer = ctx.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some(label),
        size: contents.len() as u64,
        usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST | wgpu::BufferUsages::COPY_SRC,
        mapped_at_creation: false,
    });
    for (i, chunk) in contents.chunks(UPLOAD_CHUNK).enumerate() {
        ctx.queue.write_buffer(&buffer, (i * UPLOAD_CHUNK) as u64, chunk);
    }
    Ok(buffer)
}

/// Bytes per `write_buffer` when uploading weights (a multiple of 4).
pub const UPLOAD_CHUNK: usize = 8 << 20;

/// A zeroed storage buffer of `size` bytes (rounded up to 4, at least 4).
pub fn create_zeroed(ctx: &GpuContext, label: &str, size: u64) -> Result<wgpu::Buffer, GpuError> {
    let limit = ctx.max_binding();
    if size > limit {
        return Err(GpuError::BindingTooLarge { tensor: label.into(), bytes: size, limit });
    }
    let size = (size.div_ceil(4) * 4).max(4);
    ctx.ledger.record(label, size, AllocUsage::Storage);
    Ok(ctx.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some(label),
        size,
        usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST | wgpu::BufferUsages::COPY_SRC,
        mapped_at_creation: false,
    }))
}

/// A uniform buffer initialised with a `Pod` value.
pub fn create_uniform<T: bytemuck::Pod>(ctx: &GpuContext, label: &str, value: &T) -> wgpu::Buffer {
    ctx.ledger.record(label, std::mem::size_of::<T>() as u64, AllocUsage::Uniform);
    ctx.device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
        label: Some(label),
        contents: bytemuck::bytes_of(value),
        usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
    })
}

/// A reusable staging buffer for reading results back to the host.
pub struct Readback {
    buffer: wgpu::Buffer,
    size: u64,
}

impl Readback {
    pub fn new(ctx: &GpuContext, label: &str, size: u64) -> Readback {
        let size = (size.div_ceil(4) * 4).max(4);
        ctx.ledger.record(label, size, AllocUsage::Readback);
        Readback {
            buffer: ctx.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some(label),
                size,
                usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            }),
            size,
        }
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    /// Record a copy of `bytes` bytes from `src` at `offset` into this staging buffer.
    pub fn copy_from(&self, enc: &mut wgpu::CommandEncoder, src: &wgpu::Buffer, offset: u64, bytes: u64) {
        enc.copy_buffer_to_buffer(src, offset, &self.buffer, 0, bytes);
    }

    /// Ask for the first `bytes` bytes to be mapped once the submitted copy completes; the
    /// receiver fires when they are (poll the device to get there). Then [`Self::take_mapped`].
    pub fn start_map(&self, bytes: u64) -> futures_channel::oneshot::Receiver<Result<(), wgpu::BufferAsyncError>> {
        let bytes = (bytes.div_ceil(4) * 4).min(self.size).max(4);
        let (tx, rx) = futures_channel::oneshot::channel();
        self.buffer.slice(0..bytes).map_async(wgpu::MapMode::Read, move |r| {
            let _ = tx.send(r);
        });
        rx
    }

    /// The bytes of a completed [`Self::start_map`], unmapping the buffer.
    pub fn take_mapped(&self, bytes: u64) -> Result<Vec<u8>, GpuError> {
        let bytes = (bytes.div_ceil(4) * 4).min(self.size).max(4);
        let out = {
            let view = self.buffer.slice(0..bytes).get_mapped_range().map_err(|e| GpuError::Readback(e.to_string()))?;
            view.to_vec()
        };
        self.buffer.unmap();
        Ok(out)
    }

    /// Map and read the first `bytes` bytes after the submitted copy completes. On native the
    /// await drives the device until that work is done; in a browser it yields to the event
    /// loop.
    pub async fn read(&self, ctx: &GpuContext, bytes: u64) -> Result<Vec<u8>, GpuError> {
        let bytes = (bytes.div_ceil(4) * 4).min(self.size).max(4);
        let slice = self.buffer.slice(0..bytes);
        let (tx, rx) = futures_channel::oneshot::channel();
        slice.map_async(wgpu::MapMode::Read, move |r| {
            let _ = tx.send(r);
        });
        #[cfg(not(target_arch = "wasm32"))]
        ctx.device.poll(wgpu::PollType::wait_indefinitely()).map_err(|e| GpuError::Readback(e.to_string()))?;
        #[cfg(target_arch = "wasm32")]
        let _ = ctx;
        rx.await
            .map_err(|_| GpuError::Readback("map callback dropped (device lost?)".into()))?
            .map_err(|e| GpuError::Readback(e.to_string()))?;
        let out = {
            let view = slice.get_mapped_range().map_err(|e| GpuError::Readback(e.to_string()))?;
            view.to_vec()
        };
        self.buffer.unmap();
        Ok(out)
    }
}

/// Read a whole storage buffer (tests and debugging).
pub async fn read_buffer(ctx: &Arc<GpuContext>, src: &wgpu::Buffer, bytes: u64) -> Result<Vec<u8>, GpuError> {
    let rb = Readback::new(ctx, "read_buffer", bytes);
    let mut enc = ctx.device.create_command_encoder(&Default::default());
    rb.copy_from(&mut enc, src, 0, bytes.div_ceil(4) * 4);
    ctx.queue.submit([enc.finish()]);
    rb.read(ctx, bytes).await
}

/// Read f32 values of a storage buffer.
pub async fn read_f32(ctx: &Arc<GpuContext>, src: &wgpu::Buffer, n: usize) -> Result<Vec<f32>, GpuError> {
    let b = read_buffer(ctx, src, (n * 4) as u64).await?;
    Ok(bytemuck::cast_slice(&b[..n * 4]).to_vec())
}

/// Texels per row of the rgba32uint textures that hold packed weights (`TEXW` in
/// matvec_q.wgsl): a linear texel index i lives at (i % TEX_WIDTH, i / TEX_WIDTH).
pub const TEX_WIDTH: u32 = 8192;

/// An rgba32uint texture holding `words` (padded with zeros to whole rows of TEX_WIDTH
/// texels, or one row exactly as wide as needed), or `None` when the adapter's texture
/// limits cannot hold it.
pub fn create_u32_texture(ctx: &GpuContext, label: &str, words: &[u32]) -> Option<(wgpu::Texture, wgpu::TextureView)> {
    use wgpu::util::DeviceExt;
    let max = ctx.limits.max_texture_dimension_2d;
    let texels = words.len().div_ceil(4).max(1) as u64;
    let height = texels.div_ceil(TEX_WIDTH as u64);
    if TEX_WIDTH > max || height > max as u64 {
        return None;
    }
    // A single row can be narrower: index i < width still maps to (i % TEX_WIDTH, 0).
    let width = if height == 1 { texels as u32 } else { TEX_WIDTH };
    let mut data = words.to_vec();
    data.resize((height * width as u64 * 4) as usize, 0);
    ctx.ledger.record(label, data.len() as u64 * 4, AllocUsage::Texture);
    let tex = ctx.device.create_texture_with_data(
        &ctx.queue,
        &wgpu::TextureDescriptor {
            label: Some(label),
            size: wgpu::Extent3d { width, height: height as u32, depth_or_array_layers: 1 },
            mip_level_count: 1,
            sample_count: 1,
            dimension: wgpu::TextureDimension::D2,
            format: wgpu::TextureFormat::Rgba32Uint,
            usage: wgpu::TextureUsages::TEXTURE_BINDING,
            view_formats: &[],
        },
        wgpu::util::TextureDataOrder::LayerMajor,
        bytemuck::cast_slice(&data),
    );
    let view = tex.create_view(&Default::default());
    Some((tex, view))
}

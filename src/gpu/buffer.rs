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
    create_storage_window(ctx, label, bytes, 0)
}

/// [`create_storage`] for a buffer kernels may also bind as a uniform window of `window`
/// bytes from its start (0: none): then it is uniform-capable and zero-padded to at least
/// `window` bytes (the tiled matvec's norm weights).
pub fn create_storage_window(ctx: &GpuContext, label: &str, bytes: &[u8], window: u64) -> Result<wgpu::Buffer, GpuError> {
    let limit = ctx.max_binding();
    if bytes.len() as u64 > limit {
        return Err(GpuError::BindingTooLarge { tensor: label.into(), bytes: bytes.len() as u64, limit });
    }
    let size = (bytes.len() as u64).max(window);
    let size = (size.div_ceil(4) * 4).max(4);
    let padded;
    let contents = if bytes.len() as u64 != size {
        let mut v = bytes.to_vec();
        v.resize(size as usize, 0);
        padded = v;
        &padded[..]
    } else {
        bytes
    };
    ctx.ledger.record(label, size, AllocUsage::Storage);
    // Not mapped at creation: the bytes go through the queue in chunks, so no buffer-sized
    // mapping (or, in a browser, no buffer-sized JS copy) exists at any time.
    let buffer = ctx.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some(label),
        size,
        usage: storage_usage(window),
        mapped_at_creation: false,
    });
    for (i, chunk) in contents.chunks(UPLOAD_CHUNK).enumerate() {
        ctx.queue.write_buffer(&buffer, (i * UPLOAD_CHUNK) as u64, chunk);
    }
    Ok(buffer)
}

fn storage_usage(window: u64) -> wgpu::BufferUsages {
    let u = wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST | wgpu::BufferUsages::COPY_SRC;
    if window > 0 {
        u | wgpu::BufferUsages::UNIFORM
    } else {
        u
    }
}

/// Bytes per `write_buffer` when uploading weights (a multiple of 4).
pub const UPLOAD_CHUNK: usize = 8 << 20;

/// A zeroed storage buffer of `size` bytes (rounded up to 4, at least 4).
pub fn create_zeroed(ctx: &GpuContext, label: &str, size: u64) -> Result<wgpu::Buffer, GpuError> {
    create_zeroed_window(ctx, label, size, 0)
}

/// [`create_zeroed`] for a buffer kernels may also bind as a uniform window of `window`
/// bytes from its start (0: none): uniform-capable and at least `window` long (the tiled
/// matvec's inputs).
pub fn create_zeroed_window(ctx: &GpuContext, label: &str, size: u64, window: u64) -> Result<wgpu::Buffer, GpuError> {
    let limit = ctx.max_binding();
    if size > limit {
        return Err(GpuError::BindingTooLarge { tensor: label.into(), bytes: size, limit });
    }
    let size = (size.max(window).div_ceil(4) * 4).max(4);
    ctx.ledger.record(label, size, AllocUsage::Storage);
    Ok(ctx.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some(label),
        size,
        usage: storage_usage(window),
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

/// An rgba32float texture of `width` x `height` texels that kernels write as storage and
/// read with texel fetches (the CPU adapters' x textures, `kernels::x_texture`), recorded in
/// the ledger.
pub fn create_float_texture(ctx: &GpuContext, label: &str, width: u32, height: u32) -> wgpu::Texture {
    ctx.ledger.record(label, width as u64 * height as u64 * 16, AllocUsage::Texture);
    ctx.device.create_texture(&wgpu::TextureDescriptor {
        label: Some(label),
        size: wgpu::Extent3d { width, height, depth_or_array_layers: 1 },
        mip_level_count: 1,
        sample_count: 1,
        dimension: wgpu::TextureDimension::D2,
        format: wgpu::TextureFormat::Rgba32Float,
        usage: wgpu::TextureUsages::STORAGE_BINDING | wgpu::TextureUsages::TEXTURE_BINDING,
        view_formats: &[],
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
        self.copy_to(enc, src, offset, 0, bytes);
    }

    /// [`Self::copy_from`] into this buffer at byte `at` (a multiple of 4).
    pub fn copy_to(&self, enc: &mut wgpu::CommandEncoder, src: &wgpu::Buffer, offset: u64, at: u64, bytes: u64) {
        enc.copy_buffer_to_buffer(src, offset, &self.buffer, at, bytes);
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

    /// Give up on a [`Self::start_map`] whose result will never be taken: a pending map is
    /// aborted (its receiver gets an error) and a completed one unmapped, so the buffer can
    /// be copied into again.
    pub fn abandon(&self) {
        self.buffer.unmap();
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
        ctx.counters.read_back();
        #[cfg(not(target_arch = "wasm32"))]
        ctx.wait(None)?;
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
/// shaders/common/weights.wgsl): a linear texel index i lives at (i % TEX_WIDTH, i / TEX_WIDTH).
/// Narrow, because each texture's last row is padded to the full width (8192 cost SmolLM2's
/// 300 weight textures 15 MB, 22% of its weights); 512 x lavapipe's 16384 rows still hold
/// 128 MiB, one storage binding.
pub const TEX_WIDTH: u32 = 512;

/// Rows per tile of a [`TiledTensor`] (`TILE` in shaders/common/weights.wgsl): the rows one
/// 8-lane workgroup of the tiled matvec computes (4 per lane).
pub const TILE_ROWS: usize = 32;

/// Rows per [`TiledTensor`] chunk at most, and words per row at most: kernels index a word
/// as `row << 15 | word` in 32 bits (`ROW_SHIFT` in shaders/common/weights.wgsl).
pub const MAX_TILED_ROWS: usize = 1 << 17;
pub const MAX_TILED_ROW_WORDS: usize = 1 << 15;

/// A 2-D tensor of u32 words (`rows` x `row_words`) held in rgba32uint textures, split by
/// whole tiles of [`TILE_ROWS`] rows into chunks that each fit one texture. Each row is
/// padded to whole texels (`texels_per_row`); texel i of row r of a chunk is at linear index
/// `(r / TILE_ROWS) * TILE_ROWS * texels_per_row + i * TILE_ROWS + r % TILE_ROWS` (the last
/// tile padded with zero rows), linear index l at (l % TEX_WIDTH, l / TEX_WIDTH). A
/// workgroup reading texel i of a tile's rows reads one contiguous run of texels.
#[derive(Debug)]
pub struct TiledTensor {
    pub name: String,
    pub rows: usize,
    pub row_words: usize,
    pub chunks: Vec<TiledChunk>,
}

/// One texture of a [`TiledTensor`].
#[derive(Debug)]
pub struct TiledChunk {
    pub texture: wgpu::Texture,
    pub view: wgpu::TextureView,
    /// First row of the tensor held here (a multiple of [`TILE_ROWS`]).
    pub row_offset: usize,
    /// Rows held here.
    pub rows: usize,
}

impl TiledTensor {
    /// Texels per row: the row's words padded to whole texels.
    pub fn texels_per_row(row_words: usize) -> usize {
        row_words.div_ceil(4)
    }

    /// The row ranges `(first row, rows)` of chunks for tensors of `rows` rows whose rows
    /// take `texels` texels each (the widest of the tensors split alike: codes and scales):
    /// as many whole tiles as one texture holds, and no more bytes than one storage binding
    /// (a tensor splits where its buffers would, so a small binding limit tests the splits
    /// of both); `None` when not even one tile fits.
    pub fn split(ctx: &GpuContext, rows: usize, texels: &[usize]) -> Option<Vec<(usize, usize)>> {
        let max = ctx.limits.max_texture_dimension_2d as usize;
        if (TEX_WIDTH as usize) > max {
            return None;
        }
        let cap = (TEX_WIDTH as usize * max).min(ctx.max_binding() as usize / 16);
        let widest = texels.iter().copied().max().unwrap_or(1).max(1);
        let tiles = cap / (widest * TILE_ROWS);
        if tiles == 0 {
            return None;
        }
        // Kernels index words as row << 15 | word (shaders/common/weights.wgsl ROW_SHIFT).
        let per = (tiles * TILE_ROWS).min(MAX_TILED_ROWS);
        let mut out = Vec::new();
        let mut r = 0;
        while r < rows || out.is_empty() {
            let n = per.min(rows - r);
            out.push((r, n));
            r += n;
            if rows == 0 {
                break;
            }
        }
        Some(out)
    }

    /// Textures for `rows` x `row_words` words split at `split` (from [`Self::split`]), zeroed;
    /// the words come later through [`Self::write_rows`].
    pub fn allocate(ctx: &GpuContext, name: &str, rows: usize, row_words: usize, split: &[(usize, usize)]) -> TiledTensor {
        let tpr = Self::texels_per_row(row_words).max(1) as u64;
        let mut chunks = Vec::new();
        for &(r, n) in split {
            let texels = (n.div_ceil(TILE_ROWS) * TILE_ROWS) as u64 * tpr;
            let height = texels.div_ceil(TEX_WIDTH as u64).max(1);
            // A single row can be narrower: index l < width still maps to (l % TEX_WIDTH, 0).
            let width = if height == 1 { texels.max(1) as u32 } else { TEX_WIDTH };
            let label = format!("{name}[{r}..{}]", r + n);
            ctx.ledger.record(&label, height * width as u64 * 16, AllocUsage::Texture);
            let texture = ctx.device.create_texture(&wgpu::TextureDescriptor {
                label: Some(&label),
                size: wgpu::Extent3d { width, height: height as u32, depth_or_array_layers: 1 },
                mip_level_count: 1,
                sample_count: 1,
                dimension: wgpu::TextureDimension::D2,
                format: wgpu::TextureFormat::Rgba32Uint,
                usage: wgpu::TextureUsages::TEXTURE_BINDING | wgpu::TextureUsages::COPY_DST,
                view_formats: &[],
            });
            let view = texture.create_view(&Default::default());
            chunks.push(TiledChunk { texture, view, row_offset: r, rows: n });
        }
        TiledTensor { name: name.into(), rows, row_words, chunks }
    }

    /// [`Self::allocate`] and write every row of `words` (`rows` x `row_words`, row-major).
    pub fn upload(
        ctx: &GpuContext,
        name: &str,
        words: &[u32],
        rows: usize,
        row_words: usize,
        split: &[(usize, usize)],
    ) -> Result<TiledTensor, GpuError> {
        let t = Self::allocate(ctx, name, rows, row_words, split);
        t.write_rows(ctx, 0, words)?;
        Ok(t)
    }

    /// Write rows `r0 ..` (as many as `words` holds, row-major): whole tiles of a chunk, or
    /// the chunk's last rows. A streamed load writes slices of rows; its upload holds
    /// back a slice's partial tile until the rest arrives (`kernels::linear::RowUpload`).
    pub fn write_rows(&self, ctx: &GpuContext, r0: usize, words: &[u32]) -> Result<(), GpuError> {
        let bad = |message: String| GpuError::Validation { context: self.name.clone(), message };
        if self.row_words == 0 || !words.len().is_multiple_of(self.row_words) {
            return Err(bad(format!("{} words are not whole rows of {}", words.len(), self.row_words)));
        }
        let n = words.len() / self.row_words;
        if r0 + n > self.rows {
            return Err(bad(format!("rows {r0}..{} written, the tensor has {}", r0 + n, self.rows)));
        }
        let tpr = Self::texels_per_row(self.row_words);
        for c in &self.chunks {
            let (a, b) = (r0.max(c.row_offset), (r0 + n).min(c.row_offset + c.rows));
            if a >= b {
                continue;
            }
            let (la, lb) = (a - c.row_offset, b - c.row_offset);
            // Whole tiles only, or a run ending at the chunk's last row.
            if !la.is_multiple_of(TILE_ROWS) || (!lb.is_multiple_of(TILE_ROWS) && lb != c.rows) {
                return Err(bad(format!("rows {a}..{b} do not cover whole tiles of {TILE_ROWS} rows")));
            }
            let tiles = (lb - la).div_ceil(TILE_ROWS);
            let mut texels = vec![0u32; tiles * TILE_ROWS * tpr * 4];
            for r in la..lb {
                let (tile, q) = ((r - la) / TILE_ROWS, (r - la) % TILE_ROWS);
                let src = &words[(r + c.row_offset - r0) * self.row_words..][..self.row_words];
                for (w, &v) in src.iter().enumerate() {
                    texels[((tile * TILE_ROWS * tpr) + (w / 4) * TILE_ROWS + q) * 4 + w % 4] = v;
                }
            }
            write_texels(ctx, &c.texture, (la / TILE_ROWS * TILE_ROWS * tpr) as u64, &texels);
        }
        Ok(())
    }

    /// Bytes of the words held (`rows` x `row_words` x 4), padding aside.
    pub fn bytes(&self) -> u64 {
        (self.rows * self.row_words * 4) as u64
    }

    /// Bytes of the textures: [`Self::bytes`] plus the padding of rows to whole texels, of
    /// chunks to whole tiles and of each texture to whole texture rows.
    pub fn allocated_bytes(&self) -> u64 {
        self.chunks.iter().map(|c| c.texture.width() as u64 * c.texture.height() as u64 * 16).sum()
    }
}

/// Write `words` (whole texels) at linear texel index `at` of a TEX_WIDTH-wide texture: a
/// partial first row, whole rows, a partial last row.
fn write_texels(ctx: &GpuContext, texture: &wgpu::Texture, at: u64, words: &[u32]) {
    let w = TEX_WIDTH as u64;
    let mut i = at;
    let end = at + words.len() as u64 / 4;
    let put = |x: u64, y: u64, width: u64, height: u64, src: &[u32]| {
        ctx.queue.write_texture(
            wgpu::TexelCopyTextureInfo {
                texture,
                mip_level: 0,
                origin: wgpu::Origin3d { x: x as u32, y: y as u32, z: 0 },
                aspect: wgpu::TextureAspect::All,
            },
            bytemuck::cast_slice(src),
            wgpu::TexelCopyBufferLayout { offset: 0, bytes_per_row: Some((width * 16) as u32), rows_per_image: None },
            wgpu::Extent3d { width: width as u32, height: height as u32, depth_or_array_layers: 1 },
        );
    };
    let word = |l: u64| ((l - at) * 4) as usize;
    if !i.is_multiple_of(w) {
        let n = (w - i % w).min(end - i);
        put(i % w, i / w, n, 1, &words[word(i)..word(i + n)]);
        i += n;
    }
    // Whole rows, a few MiB per write so no single staging copy is large.
    let rows_per_write = ((UPLOAD_CHUNK as u64) / (w * 16)).max(1);
    while end - i >= w {
        let rows = ((end - i) / w).min(rows_per_write);
        put(0, i / w, w, rows, &words[word(i)..word(i + rows * w)]);
        i += rows * w;
    }
    if i < end {
        put(0, i / w, end - i, 1, &words[word(i)..]);
    }
}

//! The GPU side of the paged KV cache: per layer, K and V pages spread over as many buffers
//! ("shards") as the storage-binding limit requires, in the cache's dtype.
//!
//! Page `g` lives in shard `g / pages_per_shard` at local page `g % pages_per_shard`. Inside
//! a shard the head of slot `s` of local page `lp` for KV head `h` is the token-head
//! `th = (lp * page_size + s) * n_kv_heads + h`, elements `th * head_dim + i`, stored as f32,
//! as f16 pairs per u32 word, or as int8 codes four per word followed (from word
//! [`KvLayout::scale_base`]) by one f32 per token-head: the head's largest |x| (`amax`), with
//! `x = max(code / 127, -1) * amax` (`shaders/common/kv.wgsl`; [`quantize_head_q8`] is the
//! CPU mirror).

use super::plan::KvDtype;
use crate::gpu::buffer::create_zeroed;
use crate::gpu::{GpuContext, GpuError};

/// Where every page of a layer lives and how big the buffers are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct KvLayout {
    pub dtype: KvDtype,
    pub page_size: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub num_pages: usize,
    pub pages_per_shard: usize,
    pub n_shards: usize,
}

impl KvLayout {
    /// Split `num_pages` pages into shards of at most `max_binding` bytes. Errors when the
    /// dtype cannot store this head size or one page does not fit a binding.
    pub fn new(
        dtype: KvDtype,
        page_size: usize,
        n_kv_heads: usize,
        head_dim: usize,
        num_pages: usize,
        max_binding: u64,
    ) -> Result<KvLayout, GpuError> {
        let invalid = |message: String| GpuError::Validation { context: "KV cache layout".into(), message };
        match dtype {
            KvDtype::F32 => {}
            KvDtype::F16 if head_dim.is_multiple_of(2) => {}
            KvDtype::Q8 if head_dim.is_multiple_of(4) => {}
            KvDtype::F16 | KvDtype::Q8 => {
                return Err(invalid(format!(
                    "a {dtype:?} KV cache needs head_dim a multiple of {} (got {head_dim})",
                    if dtype == KvDtype::F16 { 2 } else { 4 }
                )))
            }
            KvDtype::Bf16 => return Err(invalid("bf16 is a planning size only; the runtime caches f32, f16 or q8".into())),
        }
        let mut l = KvLayout { dtype, page_size, n_kv_heads, head_dim, num_pages: num_pages.max(1), pages_per_shard: 1, n_shards: 1 };
        let page = l.page_bytes();
        if page > max_binding {
            return Err(invalid(format!(
                "one page ({page_size} tokens x {n_kv_heads} KV heads x {head_dim} dims, {page} bytes) exceeds the storage binding limit of {max_binding} bytes; use a smaller page size"
            )));
        }
        let fit = (max_binding / page).max(1) as usize;
        l.pages_per_shard = fit.min(l.num_pages);
        l.n_shards = l.num_pages.div_ceil(l.pages_per_shard);
        Ok(l)
    }

    /// Token-heads in one shard.
    fn shard_heads(&self) -> usize {
        self.pages_per_shard * self.page_size * self.n_kv_heads
    }

    /// u32 words of codes in one shard: where the Q8 scales start.
    pub fn scale_base(&self) -> usize {
        let elems = self.shard_heads() * self.head_dim;
        match self.dtype {
            KvDtype::F32 => elems,
            KvDtype::F16 | KvDtype::Bf16 => elems / 2,
            KvDtype::Q8 => elems / 4,
        }
    }

    /// Bytes of one shard buffer (K or V of one layer).
    pub fn shard_bytes(&self) -> u64 {
        let scales = if self.dtype == KvDtype::Q8 { self.shard_heads() } else { 0 };
        ((self.scale_base() + scales) * 4) as u64
    }

    /// Bytes one page takes in one layer's K (or V).
    pub fn page_bytes(&self) -> u64 {
        self.page_size as u64 * self.n_kv_heads as u64 * self.dtype.head_bytes(self.head_dim)
    }

    /// (shard, token-head index inside it) of a page slot.
    pub fn locate(&self, page: usize, slot: usize, kv_head: usize) -> (usize, usize) {
        let (s, lp) = (page / self.pages_per_shard, page % self.pages_per_shard);
        (s, (lp * self.page_size + slot) * self.n_kv_heads + kv_head)
    }
}

/// Q8 storage of one head: codes `round(x / amax * 127)` and amax (the GPU mirrors this).
pub fn quantize_head_q8(x: &[f32]) -> (Vec<i8>, f32) {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let inv = if amax > 0.0 { 1.0 / amax } else { 0.0 };
    let codes = x.iter().map(|v| ((v * inv).clamp(-1.0, 1.0) * 127.0).round() as i8).collect();
    (codes, amax)
}

/// The value a Q8 code stands for.
pub fn dequantize_q8(code: i8, amax: f32) -> f32 {
    (code as f32 / 127.0).max(-1.0) * amax
}

/// What the cache hands back for a head written as `x` (f32: itself; f16: rounded; q8: the
/// dequantized codes).
pub fn round_trip(dtype: KvDtype, x: &[f32]) -> Vec<f32> {
    match dtype {
        KvDtype::F32 => x.to_vec(),
        KvDtype::F16 => x.iter().map(|&v| half::f16::from_f32(v).to_f32()).collect(),
        KvDtype::Bf16 => x.iter().map(|&v| half::bf16::from_f32(v).to_f32()).collect(),
        KvDtype::Q8 => {
            let (c, a) = quantize_head_q8(x);
            c.into_iter().map(|c| dequantize_q8(c, a)).collect()
        }
    }
}

/// The K and V shard buffers of every layer.
pub struct KvStore {
    pub layout: KvLayout,
    /// `k[layer][shard]`.
    pub k: Vec<Vec<wgpu::Buffer>>,
    pub v: Vec<Vec<wgpu::Buffer>>,
    /// One page of one layer's K or V: copy-on-write goes through it (wgpu copies never
    /// have the same buffer at both ends).
    staging: wgpu::Buffer,
}

impl KvStore {
    pub fn new(ctx: &GpuContext, layout: KvLayout, n_layers: usize) -> Result<KvStore, GpuError> {
        let mut k = Vec::with_capacity(n_layers);
        let mut v = Vec::with_capacity(n_layers);
        for l in 0..n_layers {
            let mut ks = Vec::with_capacity(layout.n_shards);
            let mut vs = Vec::with_capacity(layout.n_shards);
            for s in 0..layout.n_shards {
                ks.push(create_zeroed(ctx, &format!("kv.k.{l}.{s}"), layout.shard_bytes())?);
                vs.push(create_zeroed(ctx, &format!("kv.v.{l}.{s}"), layout.shard_bytes())?);
            }
            k.push(ks);
            v.push(vs);
        }
        let staging = create_zeroed(ctx, "kv.page_staging", layout.page_bytes().next_multiple_of(4))?;
        Ok(KvStore { layout, k, v, staging })
    }

    /// Total bytes of the cache (the page-sized staging buffer included).
    pub fn bytes(&self) -> u64 {
        self.layout.shard_bytes() * 2 * (self.k.len() * self.layout.n_shards) as u64 + self.staging.size()
    }

    /// Record copies of slots `0..tokens` of page `src` into page `dst` in every layer's K
    /// and V (copy-on-write of a shared partial page).
    pub fn encode_page_copy(&self, enc: &mut wgpu::CommandEncoder, src: usize, dst: usize, tokens: usize) {
        let l = &self.layout;
        let heads = tokens * l.n_kv_heads;
        let word_bytes = |th: usize| -> (u64, u64) {
            // (offset of the codes, their length) for `heads` token-heads starting at th.
            match l.dtype {
                KvDtype::F32 => ((th * l.head_dim * 4) as u64, (heads * l.head_dim * 4) as u64),
                KvDtype::F16 | KvDtype::Bf16 => ((th * l.head_dim * 2) as u64, (heads * l.head_dim * 2) as u64),
                KvDtype::Q8 => ((th * l.head_dim) as u64, (heads * l.head_dim) as u64),
            }
        };
        let (ss, sth) = l.locate(src, 0, 0);
        let (ds, dth) = l.locate(dst, 0, 0);
        let (so, len) = word_bytes(sth);
        let (dof, _) = word_bytes(dth);
        for bufs in [&self.k, &self.v] {
            for layer in bufs {
                enc.copy_buffer_to_buffer(&layer[ss], so, &self.staging, 0, len);
                enc.copy_buffer_to_buffer(&self.staging, 0, &layer[ds], dof, len);
                if l.dtype == KvDtype::Q8 {
                    let base = (l.scale_base() * 4) as u64;
                    let n = heads as u64 * 4;
                    enc.copy_buffer_to_buffer(&layer[ss], base + sth as u64 * 4, &self.staging, 0, n);
                    enc.copy_buffer_to_buffer(&self.staging, 0, &layer[ds], base + dth as u64 * 4, n);
                }
            }
        }
    }
}

/// The paged cache of a loaded model: page accounting on the host, pages on the GPU.
pub struct KvCache {
    pub alloc: super::PageAllocator,
    pub store: KvStore,
}

impl KvCache {
    /// Bytes of the cache on the GPU.
    pub fn bytes(&self) -> u64 {
        self.store.bytes()
    }

    /// The layout of every layer's pages.
    pub fn layout(&self) -> &KvLayout {
        &self.store.layout
    }
}

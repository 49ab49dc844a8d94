//! The GPU side of the paged KV cache: per layer, K and V pages spread over as many buffers
//! ("shards") as the storage-binding limit requires, in the cache's dtype.
//!
//! Page `g` lives in shard `g / pages_per_shard` at local page `g % pages_per_shard`. Inside
//! a shard the head of slot `s` of local page `lp` for KV head `h` is the token-head
//! `th = (lp * page_size + s) * n_kv_heads + h`, elements `th * head_dim + i`, stored as f32,
//! as f16 pairs per u32 word, or as int8 codes four per word followed (from word
//! [`KvLayout::scale_base`]) by one f32 per token-head: the head's largest |x| (`amax`), with
//! `x = max(code / 127, -1) * amax` (`shaders/common/kv.wgsl`; [`quantize_head`] is the
//! CPU mirror). Q4 keeps 4-bit codes eight per word with KIVI's scales: V asymmetric per
//! group of [`v_group`] elements of each token-head, K asymmetric per channel over each
//! page, the page a sequence is still filling kept in f16 in a per-sequence tail until a
//! step fills it ([`KvLayout::tail_base`]; `shaders/kv_seal.wgsl`; [`quantize_group`] and
//! [`seal_page`] are the CPU mirror).

pub use super::plan::v_group;
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
    /// 0: pages come from the block table. Else the layout of sliding layers' window rings
    /// (`kv::ring`): this many pages per sequence slot, slot `s` owning pages
    /// `s * ring .. (s + 1) * ring`.
    pub ring: usize,
    /// Sequence slots: Q4 keeps each one's open pages' K in f16 in every K shard (the tail).
    pub seqs: usize,
}

impl KvLayout {
    /// Split `num_pages` pages into shards of at most `max_binding` bytes, for `seqs`
    /// sequence slots. Errors when the dtype cannot store this head size or one page does
    /// not fit a binding.
    pub fn new(
        dtype: KvDtype,
        page_size: usize,
        n_kv_heads: usize,
        head_dim: usize,
        num_pages: usize,
        seqs: usize,
        max_binding: u64,
    ) -> Result<KvLayout, GpuError> {
        let invalid = |message: String| GpuError::Validation { context: "KV cache layout".into(), message };
        match dtype {
            KvDtype::F32 => {}
            KvDtype::F16 if head_dim.is_multiple_of(2) => {}
            KvDtype::Q8 if head_dim.is_multiple_of(4) => {}
            KvDtype::Q4 if head_dim.is_multiple_of(8) => {}
            KvDtype::F16 | KvDtype::Q8 | KvDtype::Q4 => {
                let per_word = match dtype {
                    KvDtype::F16 => 2,
                    KvDtype::Q8 => 4,
                    _ => 8,
                };
                return Err(invalid(format!("a {dtype:?} KV cache needs head_dim a multiple of {per_word} (got {head_dim})")));
            }
            KvDtype::Bf16 => return Err(invalid("bf16 is a planning size only; the runtime caches f32, f16, q8 or q4".into())),
        }
        let mut l = KvLayout {
            dtype,
            page_size,
            n_kv_heads,
            head_dim,
            num_pages: num_pages.max(1),
            pages_per_shard: 1,
            n_shards: 1,
            ring: 0,
            seqs: seqs.max(1),
        };
        let page = l.page_bytes();
        let fixed = l.tail_words() as u64 * 4;
        if page.saturating_add(fixed) > max_binding {
            return Err(invalid(format!(
                "one page ({page_size} tokens x {n_kv_heads} KV heads x {head_dim} dims, {page} bytes{}) exceeds the storage binding limit of {max_binding} bytes; use a smaller page size",
                if fixed > 0 { format!(", with {fixed} bytes of open pages for {} sequences", l.seqs) } else { String::new() }
            )));
        }
        let fit = ((max_binding - fixed) / page).max(1) as usize;
        l.pages_per_shard = fit.min(l.num_pages);
        l.n_shards = l.num_pages.div_ceil(l.pages_per_shard);
        Ok(l)
    }

    /// The layout of window rings of `ring` pages for `max_seqs` sequence slots (the rings
    /// of a layer: `max_seqs * ring` pages, sharded like any layout).
    pub fn rings(
        dtype: KvDtype,
        ring: &super::ring::WindowRing,
        max_seqs: usize,
        n_kv_heads: usize,
        head_dim: usize,
        max_binding: u64,
    ) -> Result<KvLayout, GpuError> {
        let mut l = KvLayout::new(dtype, ring.page_size, n_kv_heads, head_dim, max_seqs * ring.pages, max_seqs, max_binding)?;
        l.ring = ring.pages;
        Ok(l)
    }

    /// Token-heads in one shard.
    fn shard_heads(&self) -> usize {
        self.pages_per_shard * self.page_size * self.n_kv_heads
    }

    /// u32 words of codes in one shard: where the Q8 / Q4 scales start.
    pub fn scale_base(&self) -> usize {
        let elems = self.shard_heads() * self.head_dim;
        match self.dtype {
            KvDtype::F32 => elems,
            KvDtype::F16 | KvDtype::Bf16 => elems / 2,
            KvDtype::Q8 => elems / 4,
            KvDtype::Q4 => elems / 8,
        }
    }

    /// Whether scale words follow the codes.
    pub fn scaled(&self) -> bool {
        matches!(self.dtype, KvDtype::Q8 | KvDtype::Q4)
    }

    /// Scale words of one token-head's V (Q8: its amax; Q4: one per group).
    pub fn v_scales_per_head(&self) -> usize {
        match self.dtype {
            KvDtype::Q8 => 1,
            KvDtype::Q4 => self.head_dim / v_group(self.head_dim),
            _ => 0,
        }
    }

    /// Scale words of one page's K (Q8: one per token-head; Q4: one per KV head and
    /// channel).
    pub fn k_scales_per_page(&self) -> usize {
        match self.dtype {
            KvDtype::Q8 => self.page_size * self.n_kv_heads,
            KvDtype::Q4 => self.n_kv_heads * self.head_dim,
            _ => 0,
        }
    }

    /// Q4: the words after K's scales in each K shard: two per sequence slot (its first
    /// row in the current step and that row's position), then two pages of f16 K per slot
    /// (0 for the other dtypes).
    pub fn tail_words(&self) -> usize {
        match self.dtype {
            KvDtype::Q4 => 2 * self.seqs + self.seqs * self.tail_words_per_seq(),
            _ => 0,
        }
    }

    /// Q4: words of one sequence slot's tail (two pages of f16 K).
    pub fn tail_words_per_seq(&self) -> usize {
        2 * self.page_size * self.n_kv_heads * self.head_dim / 2
    }

    /// Q4: the first tail word in a K shard (the step rows are the `2 * seqs` words
    /// before it).
    pub fn tail_base(&self) -> usize {
        self.scale_base() + self.pages_per_shard * self.k_scales_per_page() + 2 * self.seqs
    }

    /// Bytes of one K shard buffer of one layer.
    pub fn k_shard_bytes(&self) -> u64 {
        ((self.scale_base() + self.pages_per_shard * self.k_scales_per_page() + self.tail_words()) * 4) as u64
    }

    /// Bytes of one V shard buffer of one layer.
    pub fn v_shard_bytes(&self) -> u64 {
        ((self.scale_base() + self.shard_heads() * self.v_scales_per_head()) * 4) as u64
    }

    /// Bytes one page takes in one layer's K or V, whichever is larger.
    pub fn page_bytes(&self) -> u64 {
        let heads = (self.page_size * self.n_kv_heads) as u64;
        let codes = heads
            * match self.dtype {
                KvDtype::F32 => self.head_dim as u64 * 4,
                KvDtype::F16 | KvDtype::Bf16 => self.head_dim as u64 * 2,
                KvDtype::Q8 => self.head_dim as u64,
                KvDtype::Q4 => self.head_dim as u64 / 2,
            };
        codes + 4 * (self.k_scales_per_page() as u64).max(heads * self.v_scales_per_head() as u64)
    }

    /// (shard, token-head index inside it) of a page slot.
    pub fn locate(&self, page: usize, slot: usize, kv_head: usize) -> (usize, usize) {
        let (s, lp) = (page / self.pages_per_shard, page % self.pages_per_shard);
        (s, (lp * self.page_size + slot) * self.n_kv_heads + kv_head)
    }
}

/// Q8 storage of one head: codes `round(x / amax * levels)` (rounded half away from zero, as
/// the GPU does; `levels` 127) and amax (the GPU mirrors this).
pub fn quantize_head(x: &[f32], levels: f32) -> (Vec<i8>, f32) {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let inv = if amax > 0.0 { 1.0 / amax } else { 0.0 };
    let codes = x.iter().map(|v| ((v * inv).clamp(-1.0, 1.0) * levels).round() as i8).collect();
    (codes, amax)
}

/// The value a Q8 code stands for.
pub fn dequantize_q8(code: i8, amax: f32) -> f32 {
    (code as f32 / 127.0).max(-1.0) * amax
}

/// Q4 codes (0..15) of `x` and the f16 scale and minimum the GPU stores with them:
/// `m = f16(min)`, `d = f16((max - m) / 15)`, `n = round((x - m) / d)` (half away from zero,
/// clamped), so `x ~ n d + m`.
pub fn quantize_group(x: &[f32]) -> (Vec<u8>, f32, f32) {
    let lo = x.iter().copied().fold(f32::INFINITY, f32::min);
    let hi = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let m = half::f16::from_f32(lo).to_f32();
    let d = half::f16::from_f32((hi - m).max(0.0) / 15.0).to_f32();
    let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
    let codes = x.iter().map(|&v| ((v - m) * inv + 0.5).floor().clamp(0.0, 15.0) as u8).collect();
    (codes, d, m)
}

/// A q4 head of V as stored: each group of [`v_group`] elements rounded.
pub fn round_trip_v4(x: &[f32]) -> Vec<f32> {
    x.chunks(v_group(x.len()))
        .flat_map(|g| {
            let (c, d, m) = quantize_group(g);
            c.into_iter().map(move |n| n as f32 * d + m)
        })
        .collect()
}

/// A sealed q4 page of K as stored: `keys[slot]` is one key head; each channel is rounded
/// over the page's slots.
pub fn seal_page(keys: &[Vec<f32>]) -> Vec<Vec<f32>> {
    let hd = keys.first().map_or(0, Vec::len);
    let mut out = vec![vec![0.0f32; hd]; keys.len()];
    for c in 0..hd {
        let col: Vec<f32> = keys.iter().map(|k| k[c]).collect();
        let (codes, d, m) = quantize_group(&col);
        for (o, n) in out.iter_mut().zip(codes) {
            o[c] = n as f32 * d + m;
        }
    }
    out
}

/// What the cache hands back for a head written as `x` (f32: itself; f16: rounded; q8: the
/// dequantized codes; q4: V's groups rounded, which is also what an open page's K gives in
/// f16 before [`seal_page`] rounds it).
pub fn round_trip(dtype: KvDtype, x: &[f32]) -> Vec<f32> {
    match dtype {
        KvDtype::F32 => x.to_vec(),
        KvDtype::F16 => x.iter().map(|&v| half::f16::from_f32(v).to_f32()).collect(),
        KvDtype::Bf16 => x.iter().map(|&v| half::bf16::from_f32(v).to_f32()).collect(),
        KvDtype::Q8 => {
            let (c, a) = quantize_head(x, 127.0);
            c.into_iter().map(|c| dequantize_q8(c, a)).collect()
        }
        KvDtype::Q4 => round_trip_v4(x),
    }
}

/// The K and V shard buffers of every layer. Full-attention layers hold the pool's pages
/// (`layout`); with a window ring, sliding layers hold their rings instead (`ring_layout`).
pub struct KvStore {
    pub layout: KvLayout,
    /// The sliding layers' ring layout, when they keep rings.
    pub ring_layout: Option<KvLayout>,
    /// Per layer, whether it keeps a ring (its buffers have `ring_layout`).
    pub ringed: Vec<bool>,
    /// `k[layer][shard]`.
    pub k: Vec<Vec<wgpu::Buffer>>,
    pub v: Vec<Vec<wgpu::Buffer>>,
    /// Copies go through it (wgpu copies never have the same buffer at both ends): one page
    /// of a pool layer's K or V, or one whole ring.
    staging: wgpu::Buffer,
}

impl KvStore {
    /// Every layer's buffers with `layout`.
    pub fn new(ctx: &GpuContext, layout: KvLayout, n_layers: usize) -> Result<KvStore, GpuError> {
        Self::with_rings(ctx, layout, None, &vec![false; n_layers])
    }

    /// Buffers for each layer: `ring_layout` for the layers `ringed` marks, `layout` for the
    /// rest.
    pub fn with_rings(ctx: &GpuContext, layout: KvLayout, ring_layout: Option<KvLayout>, ringed: &[bool]) -> Result<KvStore, GpuError> {
        let n_layers = ringed.len();
        let mut k = Vec::with_capacity(n_layers);
        let mut v = Vec::with_capacity(n_layers);
        for (l, &r) in ringed.iter().enumerate() {
            let lay = match (r, ring_layout) {
                (true, Some(rl)) => rl,
                (true, None) => {
                    return Err(GpuError::Validation {
                        context: "KV cache layout".into(),
                        message: format!("layer {l} keeps a window ring but no ring layout was given"),
                    })
                }
                (false, _) => layout,
            };
            let tag = if r { "ring" } else { "pool" };
            let mut ks = Vec::with_capacity(lay.n_shards);
            let mut vs = Vec::with_capacity(lay.n_shards);
            for s in 0..lay.n_shards {
                ks.push(create_zeroed(ctx, &format!("kv.k.{l}.{s} ({tag})"), lay.k_shard_bytes())?);
                vs.push(create_zeroed(ctx, &format!("kv.v.{l}.{s} ({tag})"), lay.v_shard_bytes())?);
            }
            k.push(ks);
            v.push(vs);
        }
        let ring_layout = ring_layout.filter(|_| ringed.contains(&true));
        let ring_bytes = ring_layout.map_or(0, |r| r.page_bytes() * r.ring as u64);
        let tail_bytes = (layout.tail_words_per_seq() * 4) as u64;
        let staging = create_zeroed(ctx, "kv.page_staging", layout.page_bytes().max(ring_bytes).max(tail_bytes).next_multiple_of(4))?;
        Ok(KvStore { layout, ring_layout, ringed: ringed.to_vec(), k, v, staging })
    }

    /// The layout of layer `l`'s buffers.
    pub fn layout_of(&self, l: usize) -> &KvLayout {
        match (self.ringed.get(l), &self.ring_layout) {
            (Some(true), Some(r)) => r,
            _ => &self.layout,
        }
    }

    /// Bytes of layer `l`'s K and V buffers.
    fn layer_bytes(&self, l: usize) -> u64 {
        let lay = self.layout_of(l);
        (lay.k_shard_bytes() + lay.v_shard_bytes()) * lay.n_shards as u64
    }

    /// Total bytes of the cache (the staging buffer included).
    pub fn bytes(&self) -> u64 {
        (0..self.k.len()).map(|l| self.layer_bytes(l)).sum::<u64>() + self.staging.size()
    }

    /// Bytes of the sliding layers' rings (0 without).
    pub fn ring_bytes(&self) -> u64 {
        (0..self.k.len()).filter(|&l| self.ringed[l]).map(|l| self.layer_bytes(l)).sum()
    }

    /// Record copies of slots `0..tokens` of page `src` into page `dst` in every pool layer's
    /// K and V (copy-on-write of a shared partial page).
    pub fn encode_page_copy(&self, enc: &mut wgpu::CommandEncoder, src: usize, dst: usize, tokens: usize) {
        for l in (0..self.k.len()).filter(|&l| !self.ringed[l]) {
            self.encode_copy(enc, l, &self.layout, src, dst, tokens);
        }
    }

    /// Record copies of sequence slot `src`'s whole window ring into slot `dst`'s, in every
    /// ringed layer's K and V (a forked sequence).
    pub fn encode_ring_copy(&self, enc: &mut wgpu::CommandEncoder, src: usize, dst: usize) {
        let Some(r) = self.ring_layout else { return };
        for l in (0..self.k.len()).filter(|&l| self.ringed[l]) {
            // Page by page where a ring straddles a shard edge, else the ring at once.
            let (s0, _) = r.locate(src * r.ring, 0, 0);
            let (s1, _) = r.locate(src * r.ring + r.ring - 1, 0, 0);
            let (d0, _) = r.locate(dst * r.ring, 0, 0);
            let (d1, _) = r.locate(dst * r.ring + r.ring - 1, 0, 0);
            if s0 == s1 && d0 == d1 {
                self.encode_copy(enc, l, &r, src * r.ring, dst * r.ring, r.ring * r.page_size);
            } else {
                for i in 0..r.ring {
                    self.encode_copy(enc, l, &r, src * r.ring + i, dst * r.ring + i, r.page_size);
                }
            }
        }
    }

    /// Record copies of sequence slot `src`'s tail (a q4 cache's open pages' f16 keys) into
    /// slot `dst`'s, in every layer's K shards (a forked sequence; nothing for the other
    /// dtypes).
    pub fn encode_tail_copy(&self, enc: &mut wgpu::CommandEncoder, src: usize, dst: usize) {
        for l in 0..self.k.len() {
            let lay = self.layout_of(l);
            if lay.dtype != KvDtype::Q4 {
                continue;
            }
            let len = (lay.tail_words_per_seq() * 4) as u64;
            let at = |slot: usize| ((lay.tail_base() + slot * lay.tail_words_per_seq()) * 4) as u64;
            for shard in &self.k[l] {
                enc.copy_buffer_to_buffer(shard, at(src), &self.staging, 0, len);
                enc.copy_buffer_to_buffer(&self.staging, 0, shard, at(dst), len);
            }
        }
    }

    /// Slots `0..tokens` from page `src` on (`tokens` may run over consecutive pages of one
    /// shard) to the same slots from page `dst` on, in layer `l`'s K and V: codes, scales
    /// per token-head, and a q4 K's scales of the pages copied whole (a q4 page still
    /// open keeps its K in its sequence's tail, which forks copy).
    fn encode_copy(&self, enc: &mut wgpu::CommandEncoder, l: usize, lay: &KvLayout, src: usize, dst: usize, tokens: usize) {
        let heads = tokens * lay.n_kv_heads;
        let bits = match lay.dtype {
            KvDtype::F32 => 32,
            KvDtype::F16 | KvDtype::Bf16 => 16,
            KvDtype::Q8 => 8,
            KvDtype::Q4 => 4,
        };
        let code_bytes = |th: usize| (th * lay.head_dim * bits / 8) as u64;
        let (ss, sth) = lay.locate(src, 0, 0);
        let (ds, dth) = lay.locate(dst, 0, 0);
        let mut copy = |bufs: &[wgpu::Buffer], from: u64, to: u64, len: u64| {
            if len > 0 {
                enc.copy_buffer_to_buffer(&bufs[ss], from, &self.staging, 0, len);
                enc.copy_buffer_to_buffer(&self.staging, 0, &bufs[ds], to, len);
            }
        };
        let base = (lay.scale_base() * 4) as u64;
        for bufs in [&self.k[l], &self.v[l]] {
            copy(bufs, code_bytes(sth), code_bytes(dth), code_bytes(heads));
        }
        let vs = lay.v_scales_per_head() as u64 * 4;
        copy(&self.v[l], base + sth as u64 * vs, base + dth as u64 * vs, heads as u64 * vs);
        let page_heads = lay.page_size * lay.n_kv_heads;
        let (per_page, pages) = match lay.dtype {
            KvDtype::Q4 => (lay.k_scales_per_page() as u64 * 4, (tokens / lay.page_size) as u64),
            _ => (lay.k_scales_per_page() as u64 * 4 / lay.page_size as u64, tokens as u64),
        };
        let (sp, dp) = match lay.dtype {
            KvDtype::Q4 => ((sth / page_heads) as u64, (dth / page_heads) as u64),
            _ => ((sth / lay.n_kv_heads) as u64, (dth / lay.n_kv_heads) as u64),
        };
        copy(&self.k[l], base + sp * per_page, base + dp * per_page, pages * per_page);
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

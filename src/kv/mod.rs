//! The paged KV cache: fixed-size pages in per-layer K and V buffers, a free list, and a
//! block table per sequence that maps token positions to pages.
//!
//! Layout of one layer's K (and V) buffer: `(num_pages, page_size, n_kv_heads, head_dim)` f32.
//! A sequence's token at position `p` lives in page `block_table[p / page_size]`, slot
//! `p % page_size`. The allocator here is a plain free list; sharing of prefix pages with
//! reference counts builds on the same tables.

pub mod plan;

use crate::gpu::buffer::create_zeroed;
use crate::gpu::{GpuContext, GpuError};

/// Errors of the cache.
#[derive(Debug, thiserror::Error, PartialEq)]
#[non_exhaustive]
pub enum KvError {
    #[error("KV cache full: sequence needs {needed} more page(s) of {page_size} tokens but only {free} of {total} are free")]
    Full {
        needed: usize,
        free: usize,
        total: usize,
        page_size: usize,
    },
    #[error("sequence would reach {tokens} tokens but the context holds {context}")]
    ContextExceeded { tokens: usize, context: usize },
    #[error("no free sequence slot ({max_seqs} sequences at most)")]
    NoSequenceSlot { max_seqs: usize },
    #[error("unknown sequence {0}")]
    UnknownSequence(usize),
}

/// Sizes of the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct KvConfig {
    /// Tokens per page.
    pub page_size: usize,
    /// Pages in the pool.
    pub num_pages: usize,
    /// Sequences that can be live at once (rows of the block table).
    pub max_seqs: usize,
    /// Longest sequence, in tokens.
    pub context: usize,
}

impl KvConfig {
    /// Block-table entries per sequence.
    pub fn max_pages_per_seq(&self) -> usize {
        self.context.div_ceil(self.page_size)
    }
}

/// Host-side page accounting: free list and per-sequence block tables.
#[derive(Debug, Clone)]
pub struct PageAllocator {
    pub config: KvConfig,
    free: Vec<u32>,
    /// Per sequence slot: `Some((pages, tokens))` when live.
    seqs: Vec<Option<(Vec<u32>, usize)>>,
}

impl PageAllocator {
    pub fn new(config: KvConfig) -> Self {
        PageAllocator {
            config,
            free: (0..config.num_pages as u32).rev().collect(),
            seqs: vec![None; config.max_seqs],
        }
    }

    pub fn free_pages(&self) -> usize {
        self.free.len()
    }

    /// Start a sequence; returns its slot.
    pub fn create(&mut self) -> Result<usize, KvError> {
        let slot = self
            .seqs
            .iter()
            .position(|s| s.is_none())
            .ok_or(KvError::NoSequenceSlot {
                max_seqs: self.config.max_seqs,
            })?;
        self.seqs[slot] = Some((Vec::new(), 0));
        Ok(slot)
    }

    /// Tokens stored for `seq`.
    pub fn len(&self, seq: usize) -> Result<usize, KvError> {
        self.seqs
            .get(seq)
            .and_then(|s| s.as_ref())
            .map(|s| s.1)
            .ok_or(KvError::UnknownSequence(seq))
    }

    /// Would `n` more tokens fit for `seq`? Returns the pages they need.
    pub fn pages_needed(&self, seq: usize, n: usize) -> Result<usize, KvError> {
        let (pages, len) = self
            .seqs
            .get(seq)
            .and_then(|s| s.as_ref())
            .ok_or(KvError::UnknownSequence(seq))?;
        let new_len = len + n;
        if new_len > self.config.context {
            return Err(KvError::ContextExceeded {
                tokens: new_len,
                context: self.config.context,
            });
        }
        Ok(new_len.div_ceil(self.config.page_size).saturating_sub(pages.len()))
    }

    /// Reserve room for `n` more tokens of `seq` (all or nothing) and return the first new
    /// position.
    pub fn append(&mut self, seq: usize, n: usize) -> Result<usize, KvError> {
        let needed = self.pages_needed(seq, n)?;
        if needed > self.free.len() {
            return Err(KvError::Full {
                needed,
                free: self.free.len(),
                total: self.config.num_pages,
                page_size: self.config.page_size,
            });
        }
        let new_pages: Vec<u32> = (0..needed).filter_map(|_| self.free.pop()).collect();
        let entry = self.seqs[seq].as_mut().ok_or(KvError::UnknownSequence(seq))?;
        entry.0.extend(new_pages);
        let start = entry.1;
        entry.1 += n;
        Ok(start)
    }

    /// Forget the last `n` tokens of `seq` (a failed step), returning pages no longer used.
    pub fn truncate(&mut self, seq: usize, len: usize) -> Result<(), KvError> {
        let page_size = self.config.page_size;
        let entry = self
            .seqs
            .get_mut(seq)
            .and_then(|s| s.as_mut())
            .ok_or(KvError::UnknownSequence(seq))?;
        if len < entry.1 {
            entry.1 = len;
            let keep = len.div_ceil(page_size);
            while entry.0.len() > keep {
                if let Some(p) = entry.0.pop() {
                    self.free.push(p);
                }
            }
        }
        Ok(())
    }

    /// End a sequence and return its pages to the pool.
    pub fn release(&mut self, seq: usize) {
        if let Some(Some((pages, _))) = self.seqs.get_mut(seq).map(|s| s.take()) {
            self.free.extend(pages);
        }
    }

    /// The pages of `seq`.
    pub fn pages(&self, seq: usize) -> Result<&[u32], KvError> {
        self.seqs
            .get(seq)
            .and_then(|s| s.as_ref())
            .map(|s| &s.0[..])
            .ok_or(KvError::UnknownSequence(seq))
    }

    /// The whole block table, `max_seqs x max_pages_per_seq`, unused entries 0.
    pub fn block_table(&self) -> Vec<u32> {
        let w = self.config.max_pages_per_seq();
        let mut t = vec![0u32; self.config.max_seqs * w];
        for (s, e) in self.seqs.iter().enumerate() {
            if let Some((pages, _)) = e {
                t[s * w..s * w + pages.len()].copy_from_slice(pages);
            }
        }
        t
    }
}

/// The GPU side: one K and one V buffer per layer.
pub struct KvCache {
    pub alloc: PageAllocator,
    pub k: Vec<wgpu::Buffer>,
    pub v: Vec<wgpu::Buffer>,
    /// Bytes per layer per K or V buffer.
    pub layer_bytes: u64,
}

impl KvCache {
    pub fn new(
        ctx: &GpuContext,
        config: KvConfig,
        n_layers: usize,
        n_kv_heads: usize,
        head_dim: usize,
    ) -> Result<KvCache, GpuError> {
        let layer_bytes = (config.num_pages * config.page_size * n_kv_heads * head_dim * 4) as u64;
        let mut k = Vec::with_capacity(n_layers);
        let mut v = Vec::with_capacity(n_layers);
        for l in 0..n_layers {
            k.push(create_zeroed(ctx, &format!("kv.k.{l}"), layer_bytes)?);
            v.push(create_zeroed(ctx, &format!("kv.v.{l}"), layer_bytes)?);
        }
        Ok(KvCache {
            alloc: PageAllocator::new(config),
            k,
            v,
            layer_bytes,
        })
    }

    /// Total bytes of the cache.
    pub fn bytes(&self) -> u64 {
        self.layer_bytes * 2 * self.k.len() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> KvConfig {
        KvConfig {
            page_size: 4,
            num_pages: 5,
            max_seqs: 2,
            context: 12,
        }
    }

    #[test]
    fn append_allocates_pages_and_release_returns_them() {
        let mut a = PageAllocator::new(cfg());
        let s = a.create().unwrap();
        assert_eq!(a.append(s, 5).unwrap(), 0);
        assert_eq!(a.pages(s).unwrap().len(), 2);
        assert_eq!(a.append(s, 3).unwrap(), 5);
        assert_eq!(a.pages(s).unwrap().len(), 2);
        assert_eq!(a.free_pages(), 3);
        a.release(s);
        assert_eq!(a.free_pages(), 5);
    }

    #[test]
    fn full_cache_and_context_are_errors_and_leave_state_unchanged() {
        let mut a = PageAllocator::new(cfg());
        let s1 = a.create().unwrap();
        let s2 = a.create().unwrap();
        a.append(s1, 12).unwrap(); // 3 pages
        assert_eq!(
            a.append(s1, 1),
            Err(KvError::ContextExceeded { tokens: 13, context: 12 })
        );
        let err = a.append(s2, 12).unwrap_err();
        assert!(matches!(err, KvError::Full { needed: 3, free: 2, .. }), "{err:?}");
        assert_eq!(a.len(s2).unwrap(), 0);
        assert_eq!(a.free_pages(), 2);
        assert!(matches!(a.create(), Err(KvError::NoSequenceSlot { .. })));
    }

    #[test]
    fn block_table_rows_follow_slots() {
        let mut a = PageAllocator::new(cfg());
        let s = a.create().unwrap();
        a.append(s, 6).unwrap();
        let t = a.block_table();
        assert_eq!(t.len(), 2 * 3);
        assert_eq!(&t[0..2], a.pages(s).unwrap());
        a.truncate(s, 3).unwrap();
        assert_eq!(a.pages(s).unwrap().len(), 1);
        assert_eq!(a.free_pages(), 4);
    }
}

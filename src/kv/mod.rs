//! The paged KV cache: fixed-size pages, a block table per sequence that maps token
//! positions to pages, and on the GPU ([`cache`]) per-layer K and V pages spread over as
//! many buffers as the binding limit requires, stored as f32, f16, q8 or q4.
//!
//! A sequence's token at position `p` lives in page `block_table[p / page_size]`, slot
//! `p % page_size`. The host-side [`PageAllocator`] (module `alloc`) keeps the free list,
//! reference counts for pages shared between sequences (fork, copy-on-write) and the prefix
//! cache of full prompt pages.

pub mod alloc;
pub mod cache;
pub mod plan;
pub mod ring;

pub use self::alloc::*;

/// Errors of the cache.
#[derive(Debug, thiserror::Error, PartialEq)]
#[non_exhaustive]
pub enum KvError {
    #[error(
        "KV cache full: the sequence needs {needed} more page(s) ({} tokens of room) but only {free} of {total} pages are free",
        .needed * .page_size
    )]
    Full { needed: usize, free: usize, total: usize, page_size: usize },
    #[error("sequence would reach {tokens} tokens but the context holds {context}")]
    ContextExceeded { tokens: usize, context: usize },
    #[error("no free sequence slot ({max_seqs} sequences at most)")]
    NoSequenceSlot { max_seqs: usize },
    #[error("unknown sequence {0}")]
    UnknownSequence(usize),
    #[error("sequence {0} is not empty (only an empty sequence can take a cached prefix)")]
    NotEmpty(usize),
    #[error("{tokens} tokens given for sequence {seq}, which holds {len}")]
    BeyondLength { seq: usize, tokens: usize, len: usize },
    #[error(
        "sequence {seq} cannot go back to {len} tokens: its sliding-window layers keep a ring of {ring_tokens} tokens, and positions up to {written} have overwritten keys of that window (roll back at most {ring_tokens} tokens minus the window, or start the sequence again)"
    )]
    RollbackBeyondRing { seq: usize, len: usize, written: usize, ring_tokens: usize },
    #[error(
        "sequence {seq} cannot go back to {len} tokens: its q4 KV cache rounded the keys of that page to 4 bits and keeps them exactly only for the last two pages written (roll back at most one page of {page_size} tokens, or start the sequence again)"
    )]
    RollbackBeyondTail { seq: usize, len: usize, page_size: usize },
    #[error("sequence {seq} lost keys it needs (a failed step after its sliding-window ring had wrapped, or after its q4 cache had rounded the page it went back into); release it and start again")]
    WindowLost { seq: usize },
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

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> KvConfig {
        KvConfig { page_size: 4, num_pages: 5, max_seqs: 2, context: 12 }
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
        assert_eq!(a.append(s1, 1), Err(KvError::ContextExceeded { tokens: 13, context: 12 }));
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

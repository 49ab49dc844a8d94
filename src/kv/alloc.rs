//! Host-side page accounting: a free list, a block table per sequence, reference counts so
//! sequences can share pages, and a prefix cache that keeps full pages of registered prompts
//! after their sequences end.
//!
//! Every page is in exactly one state: free (on the free list), evictable (in the prefix
//! cache without references, in LRU order) or referenced (refcount = the block-table entries
//! naming it). A sequence of `len` tokens holds `len.div_ceil(page_size)` pages.
//!
//! Cached pages are full pages whose contents never change: appends write only at positions
//! past a sequence's length, a shared page about to be written is copied first
//! (copy-on-write, see [`PageCopy`]) and a cached page held alone leaves the cache before it
//! is written. A cached page is keyed by a chain hash over the tokens of all pages up to it,
//! and stores its tokens and the cached page before it, both checked on a match, so a hash
//! collision can only miss, never attach KV computed for other tokens.

use std::collections::{BTreeMap, HashMap};

use super::ring::WindowRing;
use super::{KvConfig, KvError};

/// A copy the GPU side must execute, in queue order, before the next step writes: slots
/// `0..tokens` of page `src` to the same slots of page `dst`, for every layer's K and V.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageCopy {
    pub src: u32,
    pub dst: u32,
    /// Slots `0..tokens` to copy.
    pub tokens: usize,
}

/// Counters of sharing and the prefix cache since the allocator was made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct PrefixStats {
    /// Calls of `match_prefix`.
    pub lookups: u64,
    /// Pages attached from the cache.
    pub hit_pages: u64,
    /// Tokens attached from the cache (`hit_pages x page_size`).
    pub hit_tokens: u64,
    /// Pages entered into the cache.
    pub registered_pages: u64,
    /// Cached pages without references taken for new data (LRU victims).
    pub evictions: u64,
    /// Copy-on-write copies queued.
    pub cow_copies: u64,
}

/// Shard and page within the shard of pool page `page`, when the pool is split into buffers
/// of `pages_per_shard` pages (> 0) each.
pub fn shard_of(page: u32, pages_per_shard: u32) -> (u32, u32) {
    (page / pages_per_shard, page % pages_per_shard)
}

/// `h_{-1}` of the chain hash.
const HASH_SEED: u64 = 0x6c61_6e74_6572_6e6b;

/// Chain hash of one full page: FNV-1a (64 bit) over `prev` and the page's tokens, all
/// little-endian.
fn chain_hash(prev: u64, tokens: &[u32]) -> u64 {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let bytes = prev.to_le_bytes().into_iter().chain(tokens.iter().flat_map(|t| t.to_le_bytes()));
    bytes.fold(OFFSET, |h, b| (h ^ b as u64).wrapping_mul(PRIME))
}

/// A live sequence: its block-table row and length in tokens.
#[derive(Debug, Clone)]
struct Seq {
    pages: Vec<u32>,
    len: usize,
    /// Positions `..written` have been reserved for writing since the sequence started (with
    /// a window ring: how far its ring may have wrapped).
    written: usize,
    /// With a window ring: a rollback past the ring left its window incomplete. With open
    /// page tails: a rollback into a page whose f16 keys were overwritten.
    lost: bool,
    /// With open page tails: the first logical page whose f16 keys the tail still holds
    /// exactly (it holds two pages, the last written and the one before).
    tail_low: usize,
}

/// A page in the prefix cache.
#[derive(Debug, Clone)]
struct Cached {
    /// Chain hash, the key in `map`.
    hash: u64,
    /// The page's `page_size` tokens.
    tokens: Vec<u32>,
    /// The cached page before this one in the chain (`None` for a first page).
    parent: Option<u32>,
    /// Cached pages whose parent this is; they leave the cache with it.
    children: Vec<u32>,
    /// Key in `lru` while evictable.
    lru: Option<u64>,
}

/// Host-side page accounting: free list, reference counts, per-sequence block tables and the
/// prefix cache.
#[derive(Debug, Clone)]
pub struct PageAllocator {
    pub config: KvConfig,
    free: Vec<u32>,
    /// References per page (block-table entries naming it).
    refs: Vec<u32>,
    /// Per sequence slot, `Some` when live.
    seqs: Vec<Option<Seq>>,
    /// Per page, its prefix-cache entry.
    cache: Vec<Option<Cached>>,
    /// Chain hash -> cached page.
    map: HashMap<u64, u32>,
    /// Evictable cached pages by release stamp, oldest first.
    lru: BTreeMap<u64, u32>,
    /// Next release stamp.
    tick: u64,
    /// Copy-on-write copies not yet taken.
    copies: Vec<PageCopy>,
    /// Sliding-window layers' page rings (one per sequence slot), if the cache has them.
    ring: Option<WindowRing>,
    /// Ring copies (source slot, destination slot) queued by forks, not yet taken.
    ring_copies: Vec<(usize, usize)>,
    /// Whether each sequence slot keeps its open pages' keys in a tail (a q4 cache).
    tails: bool,
    /// Tail copies (source slot, destination slot) queued by forks, not yet taken.
    tail_copies: Vec<(usize, usize)>,
    stats: PrefixStats,
}

impl PageAllocator {
    pub fn new(config: KvConfig) -> Self {
        PageAllocator {
            config,
            free: (0..config.num_pages as u32).rev().collect(),
            refs: vec![0; config.num_pages],
            seqs: vec![None; config.max_seqs],
            cache: vec![None; config.num_pages],
            map: HashMap::new(),
            lru: BTreeMap::new(),
            tick: 0,
            copies: Vec::new(),
            ring: None,
            ring_copies: Vec::new(),
            tails: false,
            tail_copies: Vec::new(),
            stats: PrefixStats::default(),
        }
    }

    /// This allocator for a cache whose sliding-window layers keep a page ring per sequence
    /// slot (`kv::ring`): forks queue a ring copy ([`Self::take_ring_copies`]), a rollback
    /// past the ring marks the sequence lost, and there is no prefix cache (a cached
    /// prefix's sliding-layer keys are not kept).
    pub fn with_ring(mut self, ring: WindowRing) -> Self {
        self.ring = Some(ring);
        self
    }

    /// This allocator for a cache that keeps each sequence's open pages' keys in a tail of
    /// two pages per slot (the q4 cache, `kv::cache`): forks queue a tail copy
    /// ([`Self::take_tail_copies`]), and a rollback into a page whose tail was overwritten
    /// (further back than the page before the last one a step wrote) is refused.
    pub fn with_tails(mut self) -> Self {
        self.tails = true;
        self
    }

    /// The sliding layers' page ring, if there is one.
    pub fn ring(&self) -> Option<&WindowRing> {
        self.ring.as_ref()
    }

    /// Pages that can be handed out: the free list plus evictable cached pages.
    pub fn free_pages(&self) -> usize {
        self.free.len() + self.lru.len()
    }

    /// Pages referenced by at least one sequence.
    pub fn used_pages(&self) -> usize {
        self.total_pages() - self.free_pages()
    }

    /// Pages in the pool.
    pub fn total_pages(&self) -> usize {
        self.config.num_pages
    }

    /// Pages in the prefix cache, referenced or evictable.
    pub fn cached_pages(&self) -> usize {
        self.map.len()
    }

    /// Counters of sharing and the prefix cache.
    pub fn stats(&self) -> PrefixStats {
        self.stats
    }

    fn seq(&self, seq: usize) -> Result<&Seq, KvError> {
        self.seqs.get(seq).and_then(|s| s.as_ref()).ok_or(KvError::UnknownSequence(seq))
    }

    fn seq_mut(&mut self, seq: usize) -> Result<&mut Seq, KvError> {
        self.seqs.get_mut(seq).and_then(|s| s.as_mut()).ok_or(KvError::UnknownSequence(seq))
    }

    fn free_slot(&self) -> Result<usize, KvError> {
        self.seqs.iter().position(|s| s.is_none()).ok_or(KvError::NoSequenceSlot { max_seqs: self.config.max_seqs })
    }

    /// Start a sequence; returns its slot.
    pub fn create(&mut self) -> Result<usize, KvError> {
        let slot = self.free_slot()?;
        self.seqs[slot] = Some(Seq { pages: Vec::new(), len: 0, written: 0, lost: false, tail_low: 0 });
        Ok(slot)
    }

    /// Start a sequence that shares all pages of `seq` (one more reference each) and has its
    /// length; returns its slot. The first write into the shared partial last page, by
    /// either, copies it. With a window ring, the source's ring is queued to be copied whole
    /// into the new slot's.
    pub fn fork(&mut self, seq: usize) -> Result<usize, KvError> {
        let s = self.seq(seq)?.clone();
        let slot = self.free_slot()?;
        for &p in &s.pages {
            self.refs[p as usize] += 1;
        }
        self.seqs[slot] = Some(s);
        if self.ring.is_some() {
            self.ring_copies.push((seq, slot));
        }
        if self.tails {
            self.tail_copies.push((seq, slot));
        }
        Ok(slot)
    }

    /// Tail copies (source slot, destination slot) queued by forks since the last call, in
    /// the order they must run (before the next step writes).
    pub fn take_tail_copies(&mut self) -> Vec<(usize, usize)> {
        std::mem::take(&mut self.tail_copies)
    }

    /// Ring copies (source slot, destination slot) queued by forks since the last call, in
    /// the order they must run (before the next step writes).
    pub fn take_ring_copies(&mut self) -> Vec<(usize, usize)> {
        std::mem::take(&mut self.ring_copies)
    }

    /// Positions of `seq` reserved for writing since it started (at least its length).
    pub fn written(&self, seq: usize) -> Result<usize, KvError> {
        self.seq(seq).map(|s| s.written)
    }

    /// Whether `seq` can go back to `len` tokens and keep its sliding window (always true
    /// without a ring).
    pub fn can_truncate(&self, seq: usize, len: usize) -> Result<bool, KvError> {
        let s = self.seq(seq)?;
        Ok(len >= s.len || (self.ring.is_none_or(|r| r.keeps_window(s.written, len)) && self.keeps_tail(s, len)))
    }

    /// Whether the tail still holds the keys of the page `len` tokens end in (always true
    /// without tails, or at a page edge).
    fn keeps_tail(&self, s: &Seq, len: usize) -> bool {
        let ps = self.config.page_size;
        !self.tails || len.is_multiple_of(ps) || len / ps >= s.tail_low
    }

    /// The first logical page a tail holds exactly, after rollbacks, for `seq`.
    pub fn tail_low(&self, seq: usize) -> Result<usize, KvError> {
        self.seq(seq).map(|s| s.tail_low)
    }

    /// Tokens stored for `seq`.
    pub fn len(&self, seq: usize) -> Result<usize, KvError> {
        self.seq(seq).map(|s| s.len)
    }

    /// The shared partial last page that writing `n` more tokens to `s` must copy first.
    fn cow_source(&self, s: &Seq, n: usize) -> Option<u32> {
        if n == 0 || s.len.is_multiple_of(self.config.page_size) {
            return None;
        }
        let last = *s.pages.last()?;
        (self.refs[last as usize] > 1).then_some(last)
    }

    /// Would `n` more tokens fit for `seq`? Returns the pages they need, counting a
    /// copy-on-write page for a shared partial last page.
    pub fn pages_needed(&self, seq: usize, n: usize) -> Result<usize, KvError> {
        let s = self.seq(seq)?;
        let new_len = s.len + n;
        if new_len > self.config.context {
            return Err(KvError::ContextExceeded { tokens: new_len, context: self.config.context });
        }
        let fresh = new_len.div_ceil(self.config.page_size).saturating_sub(s.pages.len());
        Ok(fresh + usize::from(self.cow_source(s, n).is_some()))
    }

    /// Reserve room for `n` more tokens of `seq` (all or nothing) and return the first new
    /// position. Writing into a shared partial last page replaces it with a fresh page and
    /// queues a [`PageCopy`] (see [`Self::take_copies`]); writing into a cached page held
    /// alone removes it from the prefix cache.
    pub fn append(&mut self, seq: usize, n: usize) -> Result<usize, KvError> {
        if self.seq(seq)?.lost {
            return Err(KvError::WindowLost { seq });
        }
        let needed = self.pages_needed(seq, n)?;
        if needed > self.free_pages() {
            return Err(KvError::Full { needed, free: self.free_pages(), total: self.config.num_pages, page_size: self.config.page_size });
        }
        let ps = self.config.page_size;
        let s = self.seq(seq)?;
        let (start, held) = (s.len, s.pages.len());
        let cow = self.cow_source(s, n);
        let last = s.pages.last().copied();
        if let Some(src) = cow {
            let dst = self.take_page();
            self.refs[src as usize] -= 1;
            self.refs[dst as usize] = 1;
            self.seq_mut(seq)?.pages[held - 1] = dst;
            self.copies.push(PageCopy { src, dst, tokens: start % ps });
            self.stats.cow_copies += 1;
        } else if let Some(last) = last.filter(|_| n > 0 && !start.is_multiple_of(ps)) {
            self.uncache(last);
        }
        let fresh = (start + n).div_ceil(ps) - held;
        for _ in 0..fresh {
            let p = self.take_page();
            self.refs[p as usize] = 1;
            self.seq_mut(seq)?.pages.push(p);
        }
        let tails = self.tails;
        let s = self.seq_mut(seq)?;
        s.len = start + n;
        s.written = s.written.max(s.len);
        if tails && n > 0 {
            // The step writes the tails of its last two pages (kv_seal.wgsl); one that stays
            // in one page leaves the page before as it was.
            let (first, last) = (start / ps, (start + n - 1) / ps);
            s.tail_low = match last.checked_sub(1) {
                Some(before) if first < last || before >= s.tail_low => before,
                _ => last,
            };
        }
        Ok(start)
    }

    /// Copy-on-write copies queued since the last call, in the order they must run.
    pub fn take_copies(&mut self) -> Vec<PageCopy> {
        std::mem::take(&mut self.copies)
    }

    /// Keep only the first `len` tokens of `seq` (a failed step, rejected drafts), dropping
    /// the references of pages it no longer needs. With a window ring, going back further
    /// than [`Self::can_truncate`] allows marks the sequence lost: later appends fail with
    /// [`KvError::WindowLost`].
    pub fn truncate(&mut self, seq: usize, len: usize) -> Result<(), KvError> {
        let page_size = self.config.page_size;
        let keeps = self.can_truncate(seq, len)?;
        let s = self.seq_mut(seq)?;
        if len < s.len {
            s.lost |= !keeps;
            s.len = len;
            let dropped = s.pages.split_off(len.div_ceil(page_size));
            for p in dropped.into_iter().rev() {
                self.unref(p);
            }
        }
        Ok(())
    }

    /// End a sequence and drop its page references, last page first (so the later pages of
    /// a cached prompt are evicted before its earlier ones).
    pub fn release(&mut self, seq: usize) {
        if let Some(Some(s)) = self.seqs.get_mut(seq).map(|s| s.take()) {
            for p in s.pages.into_iter().rev() {
                self.unref(p);
            }
        }
    }

    /// The pages of `seq`.
    pub fn pages(&self, seq: usize) -> Result<&[u32], KvError> {
        self.seq(seq).map(|s| &s.pages[..])
    }

    /// The whole block table, `max_seqs x max_pages_per_seq`, unused entries 0.
    pub fn block_table(&self) -> Vec<u32> {
        let w = self.config.max_pages_per_seq();
        let mut t = vec![0u32; self.config.max_seqs * w];
        for (i, s) in self.seqs.iter().enumerate() {
            if let Some(s) = s {
                t[i * w..i * w + s.pages.len()].copy_from_slice(&s.pages);
            }
        }
        t
    }

    /// Enter the full pages of `tokens`, the tokens at positions `0..tokens.len()` of `seq`,
    /// into the prefix cache; returns the pages newly entered. A page already cached keeps
    /// its entry, and a chain whose hash another page holds continues through that page;
    /// entering stops at a page that contradicts the cache (a hash collision).
    pub fn register_prefix(&mut self, seq: usize, tokens: &[u32]) -> Result<usize, KvError> {
        let s = self.seq(seq)?;
        if tokens.len() > s.len {
            return Err(KvError::BeyondLength { seq, tokens: tokens.len(), len: s.len });
        }
        if self.ring.is_some() {
            return Ok(0);
        }
        let pages = s.pages.clone();
        let (mut hash, mut parent, mut added) = (HASH_SEED, None, 0);
        for (chunk, &page) in tokens.chunks_exact(self.config.page_size).zip(&pages) {
            hash = chain_hash(hash, chunk);
            let same = |c: &Cached| c.hash == hash && c.tokens == chunk && c.parent == parent;
            if let Some(c) = &self.cache[page as usize] {
                if !same(c) {
                    break;
                }
                parent = Some(page);
            } else if let Some(&q) = self.map.get(&hash) {
                // The same prefix computed in another page: chain on through that one.
                if !self.cache[q as usize].as_ref().is_some_and(same) {
                    break;
                }
                parent = Some(q);
            } else {
                self.cache[page as usize] = Some(Cached { hash, tokens: chunk.to_vec(), parent, children: Vec::new(), lru: None });
                self.map.insert(hash, page);
                if let Some(c) = parent.and_then(|p| self.cache[p as usize].as_mut()) {
                    c.children.push(page);
                }
                parent = Some(page);
                added += 1;
            }
        }
        self.stats.registered_pages += added as u64;
        Ok(added)
    }

    /// Attach to the empty sequence `seq` the cached pages of the longest cached prefix of
    /// `tokens`, in whole pages and at most `tokens.len() - 1` tokens (the caller computes at
    /// least one token for logits). Sets the length of `seq` to the tokens matched and
    /// returns it.
    pub fn match_prefix(&mut self, seq: usize, tokens: &[u32]) -> Result<usize, KvError> {
        if self.seq(seq)?.len != 0 {
            return Err(KvError::NotEmpty(seq));
        }
        self.stats.lookups += 1;
        if self.ring.is_some() {
            return Ok(0);
        }
        let ps = self.config.page_size;
        let max_pages = tokens.len().saturating_sub(1).min(self.config.context) / ps;
        let (mut hash, mut parent) = (HASH_SEED, None);
        let mut found = Vec::new();
        for chunk in tokens.chunks_exact(ps).take(max_pages) {
            hash = chain_hash(hash, chunk);
            let Some(&q) = self.map.get(&hash) else { break };
            let ok = self.cache[q as usize].as_ref().is_some_and(|c| c.hash == hash && c.tokens == chunk && c.parent == parent);
            if !ok {
                break;
            }
            found.push(q);
            parent = Some(q);
        }
        for &q in &found {
            if let Some(stamp) = self.cache[q as usize].as_mut().and_then(|c| c.lru.take()) {
                self.lru.remove(&stamp);
            }
            self.refs[q as usize] += 1;
        }
        let matched = found.len() * ps;
        self.stats.hit_pages += found.len() as u64;
        self.stats.hit_tokens += matched as u64;
        let s = self.seq_mut(seq)?;
        s.pages = found;
        s.len = matched;
        Ok(matched)
    }

    /// Empty the prefix cache: evictable pages go to the free list, referenced ones stay
    /// with their sequences.
    pub fn clear_prefix_cache(&mut self) {
        self.free.extend(self.lru.values().rev());
        self.lru.clear();
        self.map.clear();
        self.cache.iter_mut().for_each(|c| *c = None);
    }

    /// A page for new data: the free list first, else the least recently released evictable
    /// cached page. The caller has checked `free_pages()`.
    fn take_page(&mut self) -> u32 {
        if let Some(p) = self.free.pop() {
            return p;
        }
        let (_, p) = self.lru.pop_first().expect("free_pages() checked by the caller");
        if let Some(c) = self.cache[p as usize].as_mut() {
            c.lru = None;
        }
        self.uncache(p);
        self.stats.evictions += 1;
        p
    }

    /// Drop one reference of `page`; unreferenced, it becomes evictable if cached, else free.
    fn unref(&mut self, page: u32) {
        let r = &mut self.refs[page as usize];
        *r -= 1;
        if *r > 0 {
            return;
        }
        match self.cache[page as usize].as_mut() {
            Some(c) => {
                c.lru = Some(self.tick);
                self.lru.insert(self.tick, page);
                self.tick += 1;
            }
            None => self.free.push(page),
        }
    }

    /// Remove `page` and the cached pages chained after it from the prefix cache; evictable
    /// ones among them go to the free list.
    fn uncache(&mut self, page: u32) {
        let Some(parent) = self.cache[page as usize].as_ref().map(|c| c.parent) else {
            return;
        };
        if let Some(c) = parent.and_then(|p| self.cache[p as usize].as_mut()) {
            c.children.retain(|&x| x != page);
        }
        let mut stack = vec![page];
        while let Some(p) = stack.pop() {
            let Some(c) = self.cache[p as usize].take() else {
                continue;
            };
            self.map.remove(&c.hash);
            if let Some(stamp) = c.lru {
                self.lru.remove(&stamp);
                self.free.push(p);
            }
            stack.extend(c.children);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(page_size: usize, num_pages: usize, max_seqs: usize, context: usize) -> KvConfig {
        KvConfig { page_size, num_pages, max_seqs, context }
    }

    fn refs(a: &PageAllocator, pages: &[u32]) -> Vec<u32> {
        pages.iter().map(|&p| a.refs[p as usize]).collect()
    }

    /// Every structural invariant of the allocator.
    fn check_invariants(a: &PageAllocator) {
        let n = a.total_pages();
        let ps = a.config.page_size;
        let mut counted = vec![0u32; n];
        for s in a.seqs.iter().flatten() {
            assert_eq!(s.pages.len(), s.len.div_ceil(ps), "pages of a sequence");
            assert!(s.len <= a.config.context);
            for &p in &s.pages {
                counted[p as usize] += 1;
            }
        }
        assert_eq!(counted, a.refs, "refcounts = block-table references");
        // 1 free, 2 evictable, 3 referenced.
        let mut state = vec![0u8; n];
        for &p in &a.free {
            assert_eq!(state[p as usize], 0, "page {p} twice");
            assert!(a.cache[p as usize].is_none(), "free page {p} cached");
            state[p as usize] = 1;
        }
        for (&stamp, &p) in &a.lru {
            assert_eq!(state[p as usize], 0, "page {p} twice");
            assert_eq!(a.cache[p as usize].as_ref().and_then(|c| c.lru), Some(stamp));
            state[p as usize] = 2;
        }
        for (p, st) in state.iter_mut().enumerate() {
            if a.refs[p] > 0 {
                assert_eq!(*st, 0, "page {p} referenced and free/evictable");
                assert!(a.cache[p].as_ref().is_none_or(|c| c.lru.is_none()));
                *st = 3;
            }
        }
        assert!(state.iter().all(|&s| s != 0), "page in no state: {state:?}");
        assert_eq!(a.free_pages() + a.used_pages(), a.total_pages());
        assert_eq!(a.used_pages(), a.refs.iter().filter(|&&r| r > 0).count());
        // The cache map and entries agree, and parent/child links are mutual.
        for (&h, &p) in &a.map {
            assert_eq!(a.cache[p as usize].as_ref().map(|c| c.hash), Some(h));
        }
        for (p, c) in a.cache.iter().enumerate() {
            let Some(c) = c else { continue };
            assert_eq!(a.map.get(&c.hash), Some(&(p as u32)));
            assert_eq!(c.tokens.len(), ps);
            if let Some(par) = c.parent {
                assert!(a.cache[par as usize].as_ref().unwrap().children.contains(&(p as u32)));
            }
            for &ch in &c.children {
                assert_eq!(a.cache[ch as usize].as_ref().unwrap().parent, Some(p as u32));
            }
        }
    }

    #[test]
    fn shard_of_splits_page_numbers() {
        assert_eq!(shard_of(0, 4), (0, 0));
        assert_eq!(shard_of(3, 4), (0, 3));
        assert_eq!(shard_of(4, 4), (1, 0));
        assert_eq!(shard_of(11, 4), (2, 3));
        assert_eq!(shard_of(7, 1), (7, 0));
    }

    #[test]
    fn full_error_states_pages_and_tokens() {
        let mut a = PageAllocator::new(cfg(4, 5, 2, 12));
        let s1 = a.create().unwrap();
        let s2 = a.create().unwrap();
        a.append(s1, 12).unwrap();
        let err = a.append(s2, 12).unwrap_err();
        assert_eq!(err.to_string(), "KV cache full: the sequence needs 3 more page(s) (12 tokens of room) but only 2 of 5 pages are free");
    }

    #[test]
    fn fork_shares_pages_and_counts_refs() {
        let mut a = PageAllocator::new(cfg(4, 6, 3, 16));
        let s = a.create().unwrap();
        a.append(s, 6).unwrap();
        let f = a.fork(s).unwrap();
        assert_ne!(f, s);
        assert_eq!(a.pages(f).unwrap(), a.pages(s).unwrap());
        assert_eq!(a.len(f).unwrap(), 6);
        assert_eq!(refs(&a, a.pages(s).unwrap()), [2, 2]);
        assert_eq!((a.used_pages(), a.free_pages(), a.total_pages()), (2, 4, 6));
        a.release(s);
        assert_eq!(refs(&a, a.pages(f).unwrap()), [1, 1]);
        assert_eq!(a.used_pages(), 2);
        assert_eq!(a.fork(7), Err(KvError::UnknownSequence(7)));
        check_invariants(&a);
    }

    #[test]
    fn fork_without_a_free_slot_is_an_error() {
        let mut a = PageAllocator::new(cfg(4, 6, 2, 16));
        let s = a.create().unwrap();
        a.append(s, 5).unwrap();
        a.fork(s).unwrap();
        assert_eq!(a.fork(s), Err(KvError::NoSequenceSlot { max_seqs: 2 }));
        assert_eq!(refs(&a, a.pages(s).unwrap()), [2, 2]);
    }

    #[test]
    fn tails_follow_the_last_two_pages_written_and_refuse_older_rollbacks() {
        let mut a = PageAllocator::new(cfg(4, 16, 3, 64)).with_tails();
        let s = a.create().unwrap();
        a.append(s, 6).unwrap(); // pages 0-1: both tails exact
        assert_eq!(a.tail_low(s).unwrap(), 0);
        a.append(s, 1).unwrap(); // stays in page 1
        assert_eq!(a.tail_low(s).unwrap(), 0);
        a.append(s, 10).unwrap(); // 7..17: pages 1-4, the tails hold 3 and 4
        assert_eq!(a.tail_low(s).unwrap(), 3);
        assert!(!a.can_truncate(s, 9).unwrap(), "page 2's tail was overwritten");
        assert!(a.can_truncate(s, 8).unwrap(), "a page edge needs no tail");
        assert!(a.can_truncate(s, 13).unwrap());
        a.truncate(s, 13).unwrap();
        a.append(s, 1).unwrap(); // stays in page 3, whose page before (2) is not exact
        assert_eq!(a.tail_low(s).unwrap(), 3);
        // Going back further than allowed marks the sequence lost, as with rings.
        a.truncate(s, 9).unwrap();
        assert_eq!(a.append(s, 1), Err(KvError::WindowLost { seq: s }));
        // A fork queues the tail copy.
        let t = a.create().unwrap();
        a.append(t, 3).unwrap();
        let f = a.fork(t).unwrap();
        assert_eq!(a.take_tail_copies(), vec![(t, f)]);
        assert!(a.take_tail_copies().is_empty());
        // Without tails nothing is tracked or queued.
        let mut b = PageAllocator::new(cfg(4, 16, 2, 64));
        let u = b.create().unwrap();
        b.append(u, 17).unwrap();
        assert!(b.can_truncate(u, 1).unwrap());
        b.fork(u).unwrap();
        assert!(b.take_tail_copies().is_empty());
    }

    #[test]
    fn cow_on_append_after_fork_copies_the_partial_last_page() {
        let mut a = PageAllocator::new(cfg(4, 6, 3, 16));
        let s = a.create().unwrap();
        a.append(s, 6).unwrap();
        let f = a.fork(s).unwrap();
        let before = a.pages(s).unwrap().to_vec();
        assert_eq!(a.pages_needed(f, 0).unwrap(), 0);
        assert_eq!(a.pages_needed(f, 1).unwrap(), 1, "the copy-on-write page");
        assert_eq!(a.pages_needed(f, 3).unwrap(), 2, "copy plus a new page");
        assert_eq!(a.append(f, 1).unwrap(), 6);
        let fp = a.pages(f).unwrap().to_vec();
        assert_eq!(fp[0], before[0], "full pages stay shared");
        assert_ne!(fp[1], before[1]);
        assert_eq!(a.take_copies(), [PageCopy { src: before[1], dst: fp[1], tokens: 2 }]);
        assert!(a.take_copies().is_empty());
        assert_eq!(a.pages(s).unwrap(), before, "the other sequence is unchanged");
        assert_eq!(refs(&a, &before), [2, 1]);
        assert_eq!(a.stats().cow_copies, 1);
        // Neither page is shared any more: no further copies.
        a.append(f, 1).unwrap();
        a.append(s, 1).unwrap();
        assert!(a.take_copies().is_empty());
        assert_eq!(a.pages(s).unwrap(), before);
        check_invariants(&a);
    }

    #[test]
    fn fork_at_a_page_boundary_needs_no_copy() {
        let mut a = PageAllocator::new(cfg(4, 6, 3, 16));
        let s = a.create().unwrap();
        a.append(s, 8).unwrap();
        let f = a.fork(s).unwrap();
        assert_eq!(a.pages_needed(f, 1).unwrap(), 1);
        a.append(f, 1).unwrap();
        assert!(a.take_copies().is_empty());
        assert_eq!(a.pages(f).unwrap()[..2], *a.pages(s).unwrap());
        check_invariants(&a);
    }

    #[test]
    fn cow_when_full_returns_full_and_changes_nothing() {
        let mut a = PageAllocator::new(cfg(4, 2, 2, 16));
        let s = a.create().unwrap();
        a.append(s, 6).unwrap();
        let f = a.fork(s).unwrap();
        let pages = a.pages(s).unwrap().to_vec();
        assert_eq!(a.append(f, 1), Err(KvError::Full { needed: 1, free: 0, total: 2, page_size: 4 }));
        assert_eq!(a.pages(f).unwrap(), pages);
        assert_eq!(a.pages(s).unwrap(), pages);
        assert_eq!(a.len(f).unwrap(), 6);
        assert_eq!(refs(&a, &pages), [2, 2]);
        assert!(a.take_copies().is_empty());
        assert_eq!(a.stats().cow_copies, 0);
        check_invariants(&a);
    }

    #[test]
    fn releasing_both_forks_frees_all_pages() {
        let mut a = PageAllocator::new(cfg(4, 6, 3, 16));
        let s = a.create().unwrap();
        a.append(s, 6).unwrap();
        let f = a.fork(s).unwrap();
        a.append(f, 3).unwrap();
        a.release(s);
        assert_eq!(a.used_pages(), 3);
        a.release(f);
        assert_eq!((a.used_pages(), a.free_pages()), (0, 6));
        check_invariants(&a);
    }

    #[test]
    fn prefix_register_and_match_across_sequences() {
        let mut a = PageAllocator::new(cfg(4, 12, 5, 32));
        let prompt: Vec<u32> = (100..110).collect(); // 10 tokens: 2 full pages and 2 more
        let s = a.create().unwrap();
        a.append(s, 10).unwrap();
        assert_eq!(a.register_prefix(s, &prompt).unwrap(), 2);
        assert_eq!(a.register_prefix(s, &prompt).unwrap(), 0, "already cached");
        assert_eq!(a.cached_pages(), 2);
        let t = a.create().unwrap();
        assert_eq!(a.match_prefix(t, &prompt).unwrap(), 8);
        assert_eq!(a.len(t).unwrap(), 8);
        assert_eq!(a.pages(t).unwrap(), &a.pages(s).unwrap()[..2]);
        assert_eq!(refs(&a, a.pages(t).unwrap()), [2, 2]);
        // Never all of the prompt: 8 tokens match one page, 9 match two.
        let u = a.create().unwrap();
        assert_eq!(a.match_prefix(u, &prompt[..8]).unwrap(), 4);
        let v = a.create().unwrap();
        assert_eq!(a.match_prefix(v, &prompt[..9]).unwrap(), 8);
        let st = a.stats();
        assert_eq!((st.lookups, st.hit_pages, st.hit_tokens, st.registered_pages), (3, 5, 20, 2));
        // Only empty sequences match; only stored tokens register.
        assert_eq!(a.match_prefix(t, &prompt), Err(KvError::NotEmpty(t)));
        assert_eq!(a.register_prefix(u, &prompt[..5]), Err(KvError::BeyondLength { seq: u, tokens: 5, len: 4 }));
        // The matched sequence appends after the shared pages into a page of its own.
        assert_eq!(a.append(t, 2).unwrap(), 8);
        assert!(a.take_copies().is_empty());
        check_invariants(&a);
        // Released, the pages stay cached and match again.
        for q in [s, t, u, v] {
            a.release(q);
        }
        assert_eq!(a.used_pages(), 0);
        let w = a.create().unwrap();
        assert_eq!(a.match_prefix(w, &prompt).unwrap(), 8);
        check_invariants(&a);
    }

    #[test]
    fn prefix_match_stops_at_the_first_mismatch() {
        let mut a = PageAllocator::new(cfg(4, 12, 4, 32));
        let prompt: Vec<u32> = (0..13).collect();
        let s = a.create().unwrap();
        a.append(s, 13).unwrap();
        assert_eq!(a.register_prefix(s, &prompt).unwrap(), 3);
        let mut middle = prompt.clone();
        middle[5] = 99;
        let t = a.create().unwrap();
        assert_eq!(a.match_prefix(t, &middle).unwrap(), 4);
        let mut first = prompt.clone();
        first[0] = 99;
        let u = a.create().unwrap();
        assert_eq!(a.match_prefix(u, &first).unwrap(), 0, "later pages hang on the first");
        assert_eq!(a.pages(u).unwrap(), &[] as &[u32]);
        assert_eq!(a.stats().hit_pages, 1);
        check_invariants(&a);
    }

    /// Make cached `page` collide: move its entry to key `hash`.
    fn rekey(a: &mut PageAllocator, page: u32, hash: u64) {
        let c = a.cache[page as usize].as_mut().unwrap();
        a.map.remove(&c.hash);
        c.hash = hash;
        a.map.insert(hash, page);
    }

    #[test]
    fn hash_collisions_cannot_attach_wrong_pages() {
        // Same hash, other tokens: [9, 9] collides with the first page of [1, 2, 3, 4].
        let mut a = PageAllocator::new(cfg(2, 12, 4, 16));
        let s = a.create().unwrap();
        a.append(s, 4).unwrap();
        a.register_prefix(s, &[1, 2, 3, 4]).unwrap();
        let s0 = a.pages(s).unwrap()[0];
        rekey(&mut a, s0, chain_hash(HASH_SEED, &[9, 9]));
        let t = a.create().unwrap();
        assert_eq!(a.match_prefix(t, &[9, 9, 3]).unwrap(), 0, "tokens differ");
        check_invariants(&a);

        // Same hash and tokens, other prefix: the second page of [7, 8, 3, 4] collides with
        // that of [1, 2, 3, 4] (tokens 3, 4 computed after 1, 2).
        let mut a = PageAllocator::new(cfg(2, 12, 4, 16));
        let s = a.create().unwrap();
        a.append(s, 4).unwrap();
        a.register_prefix(s, &[1, 2, 3, 4]).unwrap();
        let s1 = a.pages(s).unwrap()[1];
        let h = chain_hash(chain_hash(HASH_SEED, &[7, 8]), &[3, 4]);
        rekey(&mut a, s1, h);
        let c = a.create().unwrap();
        a.append(c, 6).unwrap();
        assert_eq!(a.register_prefix(c, &[7, 8, 3, 4, 5, 6]).unwrap(), 1, "stops at the collision");
        let u = a.create().unwrap();
        assert_eq!(a.match_prefix(u, &[7, 8, 3, 4, 5]).unwrap(), 2, "parent differs");
        assert_eq!(a.pages(u).unwrap(), &a.pages(c).unwrap()[..1]);
        check_invariants(&a);
    }

    #[test]
    fn lru_cached_pages_are_evicted_when_the_free_list_is_empty() {
        let mut a = PageAllocator::new(cfg(2, 4, 3, 8));
        let s1 = a.create().unwrap();
        a.append(s1, 4).unwrap();
        a.register_prefix(s1, &[1, 2, 3, 4]).unwrap();
        let p1 = a.pages(s1).unwrap().to_vec();
        let s2 = a.create().unwrap();
        a.append(s2, 4).unwrap();
        a.register_prefix(s2, &[5, 6, 7, 8]).unwrap();
        let p2 = a.pages(s2).unwrap().to_vec();
        a.release(s1);
        a.release(s2);
        assert_eq!((a.free_pages(), a.used_pages(), a.cached_pages()), (4, 0, 4));
        assert!(a.free.is_empty());
        // The LRU page is s1's last page (released first, last page first).
        let s3 = a.create().unwrap();
        a.append(s3, 2).unwrap();
        assert_eq!(a.pages(s3).unwrap(), &p1[1..2]);
        assert_eq!(a.stats().evictions, 1);
        assert_eq!(a.cached_pages(), 3);
        check_invariants(&a);
        // The evicted page matches no more; its parent still does.
        a.release(s3);
        let t = a.create().unwrap();
        assert_eq!(a.match_prefix(t, &[1, 2, 3, 4, 0]).unwrap(), 2);
        assert_eq!(a.pages(t).unwrap(), &p1[..1]);
        // Referenced pages are never evicted: the next victims are s3's old page (not
        // cached, so on the free list), then s2's pages, last page first.
        let u = a.create().unwrap();
        a.append(u, 4).unwrap();
        assert_eq!(a.pages(u).unwrap(), [p1[1], p2[1]]);
        assert_eq!(a.stats().evictions, 2);
        check_invariants(&a);
        a.release(u);
        let v = a.create().unwrap();
        assert_eq!(a.match_prefix(v, &[5, 6, 7, 8, 0]).unwrap(), 2);
        check_invariants(&a);
    }

    #[test]
    fn a_page_leaving_the_cache_takes_the_pages_chained_after_it() {
        // Written in place: the pages after it leave the cache, evictable ones to the free list.
        let mut a = PageAllocator::new(cfg(2, 4, 2, 8));
        let s = a.create().unwrap();
        a.append(s, 6).unwrap();
        assert_eq!(a.register_prefix(s, &[1, 2, 3, 4, 5, 6]).unwrap(), 3);
        a.truncate(s, 3).unwrap();
        assert_eq!((a.free.len(), a.lru.len()), (1, 1));
        a.append(s, 1).unwrap();
        assert_eq!((a.cached_pages(), a.free.len(), a.lru.len()), (1, 2, 0));
        check_invariants(&a);
        a.release(s);

        // Evicted: a page chained on through it from another sequence leaves the cache too.
        let mut a = PageAllocator::new(cfg(2, 6, 3, 8));
        let s = a.create().unwrap();
        a.append(s, 4).unwrap();
        a.register_prefix(s, &[1, 2, 3, 4]).unwrap();
        let t = a.create().unwrap();
        a.append(t, 6).unwrap();
        assert_eq!(a.register_prefix(t, &[1, 2, 3, 4, 5, 6]).unwrap(), 1, "chains through s");
        let (sp, tp) = (a.pages(s).unwrap().to_vec(), a.pages(t).unwrap().to_vec());
        assert_eq!(a.cache[tp[2] as usize].as_ref().unwrap().parent, Some(sp[1]));
        let u = a.create().unwrap();
        assert_eq!(a.match_prefix(u, &[1, 2, 3, 4, 5, 6, 7]).unwrap(), 6);
        assert_eq!(a.pages(u).unwrap(), [sp[0], sp[1], tp[2]]);
        a.release(u);
        a.release(s); // LRU: sp[1], sp[0]
        let v = a.create().unwrap();
        a.append(v, 2).unwrap(); // the last free page
        a.append(v, 2).unwrap(); // evicts sp[1], and with it tp[2] (held by t)
        assert_eq!(a.pages(v).unwrap()[1], sp[1]);
        assert_eq!(a.stats().evictions, 1);
        assert_eq!(a.cached_pages(), 1);
        assert!(a.cache[tp[2] as usize].is_none());
        check_invariants(&a);
        a.release(v);
        let w = a.create().unwrap();
        assert_eq!(a.match_prefix(w, &[1, 2, 3, 4, 5, 6, 7]).unwrap(), 2);
        check_invariants(&a);
    }

    #[test]
    fn append_into_a_registered_page_held_alone_unregisters_it() {
        let mut a = PageAllocator::new(cfg(4, 6, 3, 16));
        let prompt: Vec<u32> = (0..9).collect();
        let s = a.create().unwrap();
        a.append(s, 8).unwrap();
        assert_eq!(a.register_prefix(s, &prompt[..8]).unwrap(), 2);
        let p = a.pages(s).unwrap().to_vec();
        a.truncate(s, 6).unwrap();
        assert_eq!(a.cached_pages(), 2, "truncation alone keeps the contents");
        a.append(s, 1).unwrap();
        assert!(a.take_copies().is_empty());
        assert_eq!(a.pages(s).unwrap(), p, "written in place");
        assert_eq!(a.cached_pages(), 1);
        let t = a.create().unwrap();
        assert_eq!(a.match_prefix(t, &prompt).unwrap(), 4);
        check_invariants(&a);
    }

    #[test]
    fn append_into_a_shared_registered_page_copies_it() {
        let mut a = PageAllocator::new(cfg(4, 6, 3, 16));
        let prompt: Vec<u32> = (0..9).collect();
        let s = a.create().unwrap();
        a.append(s, 8).unwrap();
        a.register_prefix(s, &prompt[..8]).unwrap();
        let p = a.pages(s).unwrap().to_vec();
        let t = a.create().unwrap();
        assert_eq!(a.match_prefix(t, &prompt).unwrap(), 8);
        a.truncate(s, 6).unwrap();
        a.append(s, 1).unwrap();
        let q = a.pages(s).unwrap().to_vec();
        assert_eq!(a.take_copies(), [PageCopy { src: p[1], dst: q[1], tokens: 2 }]);
        assert_eq!(a.cached_pages(), 2);
        a.release(t);
        let u = a.create().unwrap();
        assert_eq!(a.match_prefix(u, &prompt).unwrap(), 8);
        assert_eq!(a.pages(u).unwrap(), p);
        check_invariants(&a);
    }

    #[test]
    fn clear_prefix_cache_frees_evictable_pages() {
        let mut a = PageAllocator::new(cfg(2, 6, 3, 12));
        let s = a.create().unwrap();
        a.append(s, 4).unwrap();
        a.register_prefix(s, &[1, 2, 3, 4]).unwrap();
        let t = a.create().unwrap();
        a.append(t, 4).unwrap();
        a.register_prefix(t, &[5, 6, 7, 8]).unwrap();
        a.release(s);
        a.clear_prefix_cache();
        assert_eq!((a.cached_pages(), a.free.len(), a.free_pages()), (0, 4, 4));
        let u = a.create().unwrap();
        assert_eq!(a.match_prefix(u, &[1, 2, 3, 4, 5]).unwrap(), 0);
        a.release(t);
        assert_eq!(a.free.len(), 6, "uncached pages go straight to the free list");
        check_invariants(&a);
    }

    struct XorShift(u64);
    impl XorShift {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
    }

    /// Simulated pool: per page and slot, the whole token prefix whose last token's KV the
    /// slot holds (what the GPU would have computed there).
    type Mem = Vec<Vec<Option<Vec<u32>>>>;

    fn apply_copies(a: &mut PageAllocator, mem: &mut Mem) {
        for c in a.take_copies() {
            let src = mem[c.src as usize][..c.tokens].to_vec();
            assert!(src.iter().all(Option::is_some), "copy of an unwritten slot");
            mem[c.dst as usize][..c.tokens].clone_from_slice(&src);
        }
    }

    /// Append `new` tokens to `seq` and write their KV into `mem`; false if it did not fit.
    fn append_tokens(a: &mut PageAllocator, mem: &mut Mem, text: &mut Vec<u32>, seq: usize, new: &[u32]) -> bool {
        let ps = a.config.page_size;
        let (pages0, len0, free0) = (a.pages(seq).unwrap().to_vec(), a.len(seq).unwrap(), a.free_pages());
        let needed = a.pages_needed(seq, new.len());
        match a.append(seq, new.len()) {
            Ok(start) => {
                assert_eq!(start, len0);
                assert_eq!(free0 - a.free_pages(), needed.unwrap(), "pages_needed is exact");
                apply_copies(a, mem);
                text.extend_from_slice(new);
                let pages = a.pages(seq).unwrap();
                for p in start..text.len() {
                    mem[pages[p / ps] as usize][p % ps] = Some(text[..=p].to_vec());
                }
                true
            }
            Err(e) => {
                assert!(matches!(e, KvError::Full { .. } | KvError::ContextExceeded { .. }), "{e:?}");
                assert_eq!(a.pages(seq).unwrap(), pages0);
                assert_eq!((a.len(seq).unwrap(), a.free_pages()), (len0, free0));
                assert!(a.copies.is_empty());
                false
            }
        }
    }

    /// Each live sequence reads back the KV of its own tokens, and each cached page holds
    /// the KV of its tokens after its parent's.
    fn check_contents(a: &PageAllocator, mem: &Mem, texts: &[Option<Vec<u32>>]) {
        let ps = a.config.page_size;
        for (i, text) in texts.iter().enumerate() {
            let Some(text) = text else {
                assert!(a.seqs[i].is_none());
                continue;
            };
            assert_eq!(a.len(i).unwrap(), text.len());
            let pages = a.pages(i).unwrap();
            for p in 0..text.len() {
                assert_eq!(mem[pages[p / ps] as usize][p % ps].as_deref(), Some(&text[..=p]), "seq {i} pos {p}");
            }
        }
        for (p, c) in a.cache.iter().enumerate() {
            let Some(c) = c else { continue };
            let prefix: Vec<u32> = match c.parent {
                Some(par) => mem[par as usize][ps - 1].clone().unwrap(),
                None => Vec::new(),
            };
            for (j, slot) in mem[p].iter().enumerate() {
                let mut want = prefix.clone();
                want.extend_from_slice(&c.tokens[..=j]);
                assert_eq!(slot.as_ref(), Some(&want), "cached page {p} slot {j}");
            }
        }
    }

    #[test]
    fn random_ops_keep_invariants() {
        for seed in [0x9e37_79b9_7f4a_7c15u64, 1, 0xdead_beef, 42] {
            let config = cfg(3, 10, 4, 15);
            let mut a = PageAllocator::new(config);
            let mut rng = XorShift(seed);
            let mut mem: Mem = vec![vec![None; config.page_size]; config.num_pages];
            let mut texts: Vec<Option<Vec<u32>>> = vec![None; config.max_seqs];
            let mut prompts: Vec<Vec<u32>> = Vec::new();
            let mut hits = 0;
            for _ in 0..2000 {
                let live: Vec<usize> = (0..texts.len()).filter(|&i| texts[i].is_some()).collect();
                let pick = |rng: &mut XorShift| live[rng.below(live.len())];
                let op = rng.below(10);
                match op {
                    0 => match a.create() {
                        Ok(s) => texts[s] = Some(Vec::new()),
                        Err(e) => {
                            assert_eq!(e, KvError::NoSequenceSlot { max_seqs: 4 });
                            assert_eq!(live.len(), 4);
                        }
                    },
                    1 | 2 if !live.is_empty() => {
                        let s = pick(&mut rng);
                        let new: Vec<u32> = (0..rng.below(6)).map(|_| rng.below(2) as u32).collect();
                        let mut text = texts[s].take().unwrap();
                        append_tokens(&mut a, &mut mem, &mut text, s, &new);
                        texts[s] = Some(text);
                    }
                    3 if !live.is_empty() => {
                        let s = pick(&mut rng);
                        if let Ok(f) = a.fork(s) {
                            texts[f] = texts[s].clone();
                        }
                    }
                    4 if !live.is_empty() => {
                        let s = pick(&mut rng);
                        let text = texts[s].as_mut().unwrap();
                        let len = rng.below(text.len() + 1);
                        a.truncate(s, len).unwrap();
                        text.truncate(len);
                    }
                    5 | 6 if !live.is_empty() => {
                        let s = pick(&mut rng);
                        a.release(s);
                        texts[s] = None;
                    }
                    7 if !live.is_empty() => {
                        let s = pick(&mut rng);
                        let text = texts[s].as_ref().unwrap();
                        let k = rng.below(text.len() + 1);
                        let added = a.register_prefix(s, &text[..k]).unwrap();
                        assert!(added <= k / config.page_size);
                        prompts.push(text[..k].to_vec());
                        let over = text.len() + 1;
                        assert!(matches!(a.register_prefix(s, &vec![0; over]), Err(KvError::BeyondLength { .. })));
                    }
                    8 | 9 => {
                        let Ok(s) = a.create() else { continue };
                        let mut prompt = match prompts.len() {
                            0 => Vec::new(),
                            n => prompts[rng.below(n)].clone(),
                        };
                        if rng.below(2) == 0 {
                            prompt.truncate(rng.below(prompt.len() + 1));
                        }
                        prompt.extend((0..rng.below(5)).map(|_| rng.below(2) as u32));
                        let m = a.match_prefix(s, &prompt).unwrap();
                        assert!(m < prompt.len().max(1) && m.is_multiple_of(config.page_size));
                        hits += m;
                        let mut text = prompt[..m].to_vec();
                        append_tokens(&mut a, &mut mem, &mut text, s, &prompt[m..]);
                        texts[s] = Some(text);
                    }
                    _ => {}
                }
                check_invariants(&a);
                check_contents(&a, &mem, &texts);
            }
            let st = a.stats();
            assert!(hits > 0 && st.evictions > 0 && st.cow_copies > 0, "seed {seed:x}: {st:?}");
            assert_eq!(st.hit_tokens, hits as u64);
        }
    }

    #[test]
    fn with_a_window_ring_forks_copy_rings_rollbacks_are_bounded_and_no_prefix_is_cached() {
        // Window 8, steps of up to 4, pages of 4: a ring of 3 pages (12 tokens).
        let ring = WindowRing::new(8, 4, 4);
        let mut a = PageAllocator::new(cfg(4, 40, 3, 64)).with_ring(ring);
        let s = a.create().unwrap();
        let prompt: Vec<u32> = (0..20).collect();
        a.append(s, 20).unwrap();
        assert_eq!(a.register_prefix(s, &prompt).unwrap(), 0, "no prefix cache with a ring");
        let f = a.fork(s).unwrap();
        assert_eq!(a.take_ring_copies(), vec![(s, f)]);
        assert!(a.take_ring_copies().is_empty());
        let t = a.create().unwrap();
        assert_eq!(a.match_prefix(t, &prompt).unwrap(), 0);
        // A rejected 4-token draft rolls back; 12 tokens back from 20 does not keep the window
        // of a query at 8 (keys 1..8, which positions 13..20 overwrote).
        assert!(a.can_truncate(s, 16).unwrap());
        assert!(!a.can_truncate(s, 8).unwrap());
        a.truncate(s, 16).unwrap();
        a.append(s, 4).unwrap();
        a.truncate(s, 8).unwrap();
        assert_eq!(a.append(s, 1), Err(KvError::WindowLost { seq: s }));
        // The fork kept its own state, and a released slot starts clean.
        a.append(f, 1).unwrap();
        a.release(s);
        let s2 = a.create().unwrap();
        a.append(s2, 3).unwrap();
        check_invariants(&a);
        // Without a ring the same rollback is fine.
        let mut b = PageAllocator::new(cfg(4, 40, 1, 64));
        let s = b.create().unwrap();
        b.append(s, 20).unwrap();
        assert!(b.can_truncate(s, 0).unwrap());
        b.truncate(s, 0).unwrap();
        b.append(s, 1).unwrap();
    }
}

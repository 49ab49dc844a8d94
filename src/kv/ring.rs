//! Page rings for sliding-window layers. A sliding layer's query at position `q` reads only
//! keys `q - window + 1 ..= q`, so such a layer needs no pages older than its window: each
//! sequence slot owns a fixed ring of [`WindowRing::pages`] pages in the sliding layers'
//! buffers, and position `p` lives in ring page `(p / page_size) % pages`, slot
//! `p % page_size` (pool page `slot * pages + that`). Full-attention layers keep the paged
//! pool and the block table.
//!
//! A ring of `pages * page_size` slots holds the positions written last, position `p` in
//! slot `p mod (pages * page_size)`. It is sized so that no step overwrites a key a query of
//! the same step still reads: a step writes up to `max_step` tokens of one sequence (keys
//! first, then attention), and its first query needs the `window - 1` keys before it, so
//! `pages * page_size >= window + max_step - 1`.
//!
//! What the ring cannot do: give back keys it has overwritten. Rolling a sequence back (a
//! rejected speculative draft, a failed step) keeps its window only while the positions
//! written since then have not wrapped onto it ([`WindowRing::keeps_window`]); and a cached
//! prompt prefix cannot be attached, since its sliding-layer keys are gone.

/// Whether a model's sliding-window layers keep page rings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KvWindow {
    /// Rings where one holds fewer tokens than the context (so they save memory); there is
    /// then no prefix cache.
    #[default]
    Auto,
    /// Rings whenever the model has sliding layers.
    Ring,
    /// Every layer keeps every token in the pool's pages (and the prefix cache works).
    Full,
}

impl std::str::FromStr for KvWindow {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(KvWindow::Auto),
            "ring" => Ok(KvWindow::Ring),
            "full" => Ok(KvWindow::Full),
            _ => Err(format!("unknown KV window mode `{s}` (expected auto, ring or full)")),
        }
    }
}

impl KvWindow {
    /// The ring sliding layers of `window` keys get under this mode, for sequences of up to
    /// `context` tokens written in steps of up to `max_step` (`None`: no sliding layers, or
    /// no ring).
    pub fn ring(self, window: Option<usize>, context: usize, max_step: usize, page_size: usize) -> Option<WindowRing> {
        let r = WindowRing::new(window?, max_step, page_size);
        match self {
            KvWindow::Full => None,
            KvWindow::Ring => Some(r),
            KvWindow::Auto => (r.tokens() < context).then_some(r),
        }
    }
}

/// The ring of one sequence in the sliding layers' pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct WindowRing {
    /// Ring pages per sequence.
    pub pages: usize,
    pub page_size: usize,
    /// Keys a sliding layer's query sees, itself included.
    pub window: usize,
    /// Most tokens of one sequence a step writes.
    pub max_step: usize,
}

impl WindowRing {
    /// The smallest ring for `window`-key layers written in steps of up to `max_step`
    /// tokens.
    pub fn new(window: usize, max_step: usize, page_size: usize) -> WindowRing {
        let (w, s, ps) = (window.max(1), max_step.max(1), page_size.max(1));
        WindowRing { pages: (w + s - 1).div_ceil(ps), page_size: ps, window: w, max_step: s }
    }

    /// KV bytes of one sequence's rings in `layers` sliding layers (K and V).
    pub fn bytes_per_sequence(&self, layers: usize, n_kv_heads: usize, head_dim: usize, dtype: super::plan::KvDtype) -> u64 {
        super::plan::kv_bytes_per_token(layers, n_kv_heads, head_dim, dtype) * self.tokens() as u64
    }

    /// Tokens one ring holds.
    pub fn tokens(&self) -> usize {
        self.pages * self.page_size
    }

    /// Pool page (in the sliding layers' buffers) of position `pos` of sequence slot `slot`.
    pub fn page(&self, slot: usize, pos: usize) -> usize {
        slot * self.pages + (pos / self.page_size) % self.pages
    }

    /// Whether, with positions `..written` having been written, the keys a query at `len`
    /// reads from before it (`len - window + 1 .. len`) are all still in the ring: the
    /// condition for rolling a sequence back to `len` tokens.
    pub fn keeps_window(&self, written: usize, len: usize) -> bool {
        // The ring holds positions written - tokens() .. written.
        written <= (len + 1).saturating_sub(self.window) + self.tokens()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Simulates a ring slot by slot: every step writes its keys, then each of its queries
    /// checks that every key of its window still holds its own position.
    fn simulate(r: &WindowRing, steps: &[usize]) {
        let mut slots = vec![usize::MAX; r.tokens()];
        let mut pos = 0;
        for &n in steps {
            assert!(n <= r.max_step);
            for p in pos..pos + n {
                slots[r.page(0, p) * r.page_size + p % r.page_size] = p;
            }
            for q in pos..pos + n {
                for k in (q + 1).saturating_sub(r.window)..=q {
                    assert_eq!(slots[r.page(0, k) * r.page_size + k % r.page_size], k, "query {q} key {k} ({r:?}, {steps:?})");
                }
            }
            pos += n;
        }
    }

    #[test]
    fn no_step_overwrites_a_key_its_queries_read() {
        for window in [1, 2, 7, 8, 9, 33] {
            for max_step in [1, 3, 8, 17] {
                for page_size in [1, 4, 16] {
                    let r = WindowRing::new(window, max_step, page_size);
                    // Full steps, single tokens, and uneven steps that cross page edges.
                    simulate(&r, &[max_step; 12]);
                    simulate(&r, &[1; 80]);
                    let uneven: Vec<usize> = (0..40).map(|i| 1 + (i * 7) % max_step).collect();
                    simulate(&r, &uneven);
                }
            }
        }
    }

    #[test]
    fn one_page_fewer_loses_keys() {
        // Window 8, steps of 4, pages of 4: 3 pages (12 slots >= 8 + 4 - 1). With 2, the step
        // writing 5..9 puts position 8 into the slot of 0 while its query 5 reads keys 0..5.
        let r = WindowRing::new(8, 4, 4);
        assert_eq!(r.pages, 3);
        let small = WindowRing { pages: r.pages - 1, ..r };
        assert!(std::panic::catch_unwind(|| simulate(&small, &[1, 4, 4, 4])).is_err());
        simulate(&r, &[1, 4, 4, 4, 4, 4]);
        // Pages of one token: exactly window + step - 1 slots.
        assert_eq!(WindowRing::new(8, 4, 1).tokens(), 11);
    }

    #[test]
    fn auto_takes_a_ring_only_when_it_is_smaller_than_the_context() {
        assert_eq!(KvWindow::Auto.ring(Some(512), 2048, 128, 16).map(|r| r.tokens()), Some(640));
        assert_eq!(KvWindow::Auto.ring(Some(512), 640, 128, 16), None);
        assert!(KvWindow::Ring.ring(Some(512), 640, 128, 16).is_some());
        assert_eq!(KvWindow::Full.ring(Some(512), 8192, 128, 16), None);
        assert_eq!(KvWindow::Ring.ring(None, 8192, 128, 16), None);
        assert_eq!("ring".parse::<KvWindow>(), Ok(KvWindow::Ring));
        assert!("rings".parse::<KvWindow>().unwrap_err().contains("auto, ring or full"));
    }

    #[test]
    fn rollback_keeps_the_window_until_writes_wrap_onto_it() {
        let r = WindowRing::new(8, 4, 4);
        assert_eq!(r.tokens(), 12);
        // Back 4 tokens after a 4-token step: fine.
        assert!(r.keeps_window(40, 36));
        // The window of a query at 30 starts at 23: position 35 overwrote it.
        assert!(r.keeps_window(35, 30));
        assert!(!r.keeps_window(36, 30));
        // Early positions: a window that starts at 0.
        assert!(r.keeps_window(12, 3));
        assert!(!r.keeps_window(13, 3));
        assert_eq!(r.page(2, 17), 2 * 3 + 1);
        assert_eq!(r.page(2, 13), 2 * 3);
    }
}

//! The CPU loops' threads: a range split over scoped threads (one thread on wasm, where
//! threads cannot be spawned). Used by the AWQ calibration and search ([`super::awq`]) and the
//! parallel round-to-nearest of [`super::quantize`].

use std::ops::Range;

/// Threads for the CPU loops: the available cores, at most 16 (1 on wasm).
pub(crate) fn threads() -> usize {
    if cfg!(target_arch = "wasm32") {
        return 1;
    }
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1).min(16)
}

/// Splits `0..n` into up to [`threads`] ranges and runs `f` on each (in parallel natively),
/// returning the results in order.
pub(crate) fn par_ranges<T: Send>(n: usize, f: impl Fn(Range<usize>) -> T + Sync) -> Vec<T> {
    let t = threads().min(n.max(1));
    let chunk = n.div_ceil(t.max(1)).max(1);
    let ranges: Vec<_> = (0..n).step_by(chunk).map(|a| a..(a + chunk).min(n)).collect();
    if ranges.len() <= 1 {
        return ranges.into_iter().map(&f).collect();
    }
    std::thread::scope(|sc| {
        let handles: Vec<_> = ranges.into_iter().map(|r| sc.spawn(|| f(r))).collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e))).collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn par_ranges_cover_every_index_once_in_order() {
        for n in [0, 1, 2, 5, 16, 17, 100] {
            let parts = par_ranges(n, |r| r.collect::<Vec<_>>());
            assert!(parts.len() <= threads().max(1));
            assert_eq!(parts.concat(), (0..n).collect::<Vec<_>>(), "n = {n}");
        }
    }
}

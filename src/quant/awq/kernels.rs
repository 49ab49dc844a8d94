//! The arithmetic AWQ spends its time in: the threaded f32 matrix product of the
//! calibration forward ([`matmul`]) and the sum of squared dot products that scores one
//! candidate's quantization error ([`Kernels::block_error`]).
//!
//! Each has a portable version (written for LLVM to vectorize: independent accumulators,
//! separate multiply and add) and, on x86_64 CPUs with AVX, the hand-written one in
//! `avx.rs`. Both perform the same operations in the same order, so they give the same
//! bits and the chosen AWQ scales do not depend on the CPU. The AVX path stays because it is
//! measurably faster: `cargo bench --bench awq` times both (numbers in `avx.rs`).

use std::ops::Range;

use crate::quant::pool::par_ranges;

/// Which implementation of the dot products runs. Only [`Kernels::avx`] hands out the AVX
/// one, after checking the CPU, so calling it is always sound.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Kernels {
    avx: bool,
}

impl Kernels {
    /// The portable loops (every target).
    pub const PORTABLE: Kernels = Kernels { avx: false };

    /// The hand-written AVX kernels, when this CPU has AVX (x86_64 only).
    pub fn avx() -> Option<Kernels> {
        #[cfg(target_arch = "x86_64")]
        if super::avx::available() {
            return Some(Kernels { avx: true });
        }
        None
    }

    /// The fastest this CPU runs: AVX where it can, else portable.
    pub fn best() -> Kernels {
        Kernels::avx().unwrap_or(Kernels::PORTABLE)
    }

    pub fn name(&self) -> &'static str {
        if self.avx {
            "avx"
        } else {
            "portable"
        }
    }

    /// Rows `rows` of `w` (`[n, k]`) against every row of `x` (`[t, k]`), plus `bias`,
    /// appended to `out` as `[rows, t]` (one row of `w` after the other).
    pub fn matmul_rows(self, x: &[f32], w: &[f32], bias: Option<&[f32]>, k: usize, rows: Range<usize>, out: &mut Vec<f32>) {
        #[cfg(target_arch = "x86_64")]
        if self.avx {
            // SAFETY: `avx` is only set where the CPU has AVX (see `Kernels::avx`).
            return matmul_rows_with(x, w, bias, k, rows, out, |a, b| unsafe { super::avx::dot(a, b) });
        }
        matmul_rows_with(x, w, bias, k, rows, out, dot)
    }

    /// `sum_t sum_r (e_r . x_t)^2` over the rows `e_r` of `e` and the rows `x_t` of `x`
    /// (both `k` wide), accumulated in f64.
    pub fn block_error(self, e: &[f32], k: usize, x: &[f32]) -> f64 {
        #[cfg(target_arch = "x86_64")]
        if self.avx {
            // SAFETY: as in `matmul_rows`.
            return block_error_with(e, k, x, |r, x| unsafe { super::avx::dot4(r, x) }, |a, b| unsafe { super::avx::dot(a, b) });
        }
        block_error_with(e, k, x, dot4, dot)
    }
}

/// `y = x W^T (+ b)` for `x: [t, k]`, `w: [n, k]`; returns `[t, n]`. Threads split `n`; the
/// dot products are [`Kernels::best`]'s.
pub fn matmul(x: &[f32], w: &[f32], bias: Option<&[f32]>, k: usize, n: usize) -> Vec<f32> {
    let t = x.len() / k;
    let kernels = Kernels::best();
    // Each thread fills a [rows, t] block (transposed), then blocks are interleaved.
    let blocks = par_ranges(n, |rows| {
        let mut out = Vec::with_capacity(rows.len() * t);
        kernels.matmul_rows(x, w, bias, k, rows, &mut out);
        out
    });
    let mut y = vec![0f32; t * n];
    let mut j0 = 0;
    for blk in blocks {
        let rows = blk.len() / t.max(1);
        for (jj, col) in blk.chunks_exact(t.max(1)).enumerate() {
            for (ti, &v) in col.iter().enumerate() {
                y[ti * n + j0 + jj] = v;
            }
        }
        j0 += rows;
    }
    y
}

#[inline(always)]
fn matmul_rows_with(
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    k: usize,
    rows: Range<usize>,
    out: &mut Vec<f32>,
    dot: impl Fn(&[f32], &[f32]) -> f32,
) {
    for j in rows {
        let wr = &w[j * k..(j + 1) * k];
        let b = bias.map_or(0.0, |b| b[j]);
        out.extend(x.chunks_exact(k).map(|xr| dot(xr, wr) + b));
    }
}

/// Four rows of `e` at a time (each `x_t` read once for four dot products), then the rest.
#[inline(always)]
fn block_error_with(
    e: &[f32],
    k: usize,
    x: &[f32],
    dot4: impl Fn([&[f32]; 4], &[f32]) -> [f32; 4],
    dot: impl Fn(&[f32], &[f32]) -> f32,
) -> f64 {
    let mut err = 0f64;
    let mut quad = e.chunks_exact(4 * k);
    for four in &mut quad {
        let rows4 = [&four[..k], &four[k..2 * k], &four[2 * k..3 * k], &four[3 * k..]];
        for xt in x.chunks_exact(k) {
            for d in dot4(rows4, xt) {
                err += (d as f64) * (d as f64);
            }
        }
    }
    for erow in quad.remainder().chunks_exact(k) {
        for xt in x.chunks_exact(k) {
            let d = dot(erow, xt) as f64;
            err += d * d;
        }
    }
    err
}

/// f32 dot product with 16 independent accumulators (lane `l` sums the products of the
/// elements `l mod 16`; then the lanes in order, then the tail).
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let ca = a.chunks_exact(16);
    let cb = b.chunks_exact(16);
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..16 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s = 0f32;
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    acc.iter().sum::<f32>() + s
}

/// Four dot products of `x` with `e[0..4]` in one pass over `x` (8 lanes per row, summed in
/// order, then the tail).
#[inline(always)]
fn dot4(e: [&[f32]; 4], x: &[f32]) -> [f32; 4] {
    let (mut a0, mut a1, mut a2, mut a3) = ([0f32; 8], [0f32; 8], [0f32; 8], [0f32; 8]);
    let xc = x.chunks_exact(8);
    let xr = xc.remainder();
    let it = xc.zip(e[0].chunks_exact(8)).zip(e[1].chunks_exact(8)).zip(e[2].chunks_exact(8)).zip(e[3].chunks_exact(8));
    for ((((xs, e0), e1), e2), e3) in it {
        let xs: &[f32; 8] = xs.try_into().expect("8");
        let (e0, e1, e2, e3): (&[f32; 8], &[f32; 8], &[f32; 8], &[f32; 8]) =
            (e0.try_into().expect("8"), e1.try_into().expect("8"), e2.try_into().expect("8"), e3.try_into().expect("8"));
        for l in 0..8 {
            a0[l] += e0[l] * xs[l];
            a1[l] += e1[l] * xs[l];
            a2[l] += e2[l] * xs[l];
            a3[l] += e3[l] * xs[l];
        }
    }
    let n = x.len() - xr.len();
    let tail = |ej: &[f32]| ej[n..].iter().zip(xr).map(|(p, q)| p * q).sum::<f32>();
    [
        a0.iter().sum::<f32>() + tail(e[0]),
        a1.iter().sum::<f32>() + tail(e[1]),
        a2.iter().sum::<f32>() + tail(e[2]),
        a3.iter().sum::<f32>() + tail(e[3]),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference::ops;

    fn data(n: usize, seed: usize) -> Vec<f32> {
        (0..n).map(|i| (((i * 7919 + seed * 104729) % 2001) as f32 / 1000.0 - 1.0) * 0.5).collect()
    }

    /// The AVX kernels give the portable ones' bits (lane tails, row remainders, bias), so
    /// the AWQ scales do not depend on the CPU. Skipped where the CPU has no AVX.
    #[test]
    fn avx_matches_portable_bit_for_bit() {
        let Some(avx) = Kernels::avx() else {
            eprintln!("no AVX on this CPU: nothing to compare");
            return;
        };
        for k in [1, 7, 8, 9, 15, 16, 17, 40, 576] {
            for rows in 1..=9 {
                let (x, w, b) = (data(3 * k, 1), data(rows * k, 2), data(rows, 3));
                for bias in [None, Some(&b[..])] {
                    let (mut p, mut a) = (Vec::new(), Vec::new());
                    Kernels::PORTABLE.matmul_rows(&x, &w, bias, k, 0..rows, &mut p);
                    avx.matmul_rows(&x, &w, bias, k, 0..rows, &mut a);
                    assert_eq!(p.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), a.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
                }
                let (e, p) = (Kernels::PORTABLE.block_error(&w, k, &x), avx.block_error(&w, k, &x));
                assert_eq!(e.to_bits(), p.to_bits(), "block_error k {k} rows {rows}");
            }
        }
    }

    /// The threaded product (blocks of rows interleaved back into `[t, n]`) against the
    /// reference's f64 linear layer; and `block_error` against its definition.
    #[test]
    fn threaded_matmul_and_block_error_match_the_reference() {
        let (t, k, n) = (5, 40, 37);
        let (x, w, b) = (data(t * k, 4), data(n * k, 5), data(n, 6));
        let got = matmul(&x, &w, Some(&b), k, n);
        let want = ops::linear(&x, &w, Some(&b), k, n);
        assert!(got.iter().zip(&want).all(|(g, r)| (g - r).abs() <= 1e-5 * (1.0 + r.abs())), "{got:?} vs {want:?}");
        for kernels in [Some(Kernels::PORTABLE), Kernels::avx()].into_iter().flatten() {
            let err = kernels.block_error(&w, k, &x);
            let y = ops::linear(&x, &w, None, k, n);
            let want: f64 = y.iter().map(|&v| v as f64 * v as f64).sum();
            assert!((err - want).abs() <= 1e-5 * want, "{}: {err} vs {want}", kernels.name());
        }
    }
}

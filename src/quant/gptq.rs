//! GPTQ (Frantar et al., 2022): post-training quantization that rounds a weight matrix one
//! input column at a time and pushes each column's rounding error onto the columns not yet
//! rounded, weighted by the inverse Hessian of the layer's reconstruction error
//! `||W X - Q X||^2` over calibration inputs X (`H = X^T X`). The output is the same packed
//! layout as round-to-nearest ([`super::PackedMatrix`], the RTN kinds q8 / q4 / q4sym):
//! only the codes differ, so every kernel reads it unchanged.
//!
//! Per matrix: `H += damp * mean(diag H) * I` (dead inputs, whose diagonal is 0, get 1 and
//! their weights zeroed); `U` = the upper Cholesky factor of `H^-1`; then for each column `i`
//! in order, a group's scale and minimum are fixed from the current (already corrected)
//! values when column `i` starts the group (RTN's rule on them), the column is rounded, and
//! `W[:, j] -= (w_i - q_i) / U[i, i] * U[i, j]` for every later `j`. Rows are independent
//! given `U` (groups run along a row), so they are split over threads. Arithmetic in f64.
//!
//! With `act_order` the columns are taken by decreasing Hessian diagonal (the inputs with
//! the most energy first, while the most columns are left to absorb their error), and every
//! group's scale and minimum are fixed up front from the original weights ("static
//! groups"), since a group's columns are no longer rounded together. The packed layout is
//! the same: codes are stored in column order.

use super::{check_rtn, group_params, non_finite_scale, pack_group, pool, round_code, PackedMatrix, QuantError, QuantFormat};

/// GPTQ settings.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct GptqOptions {
    /// Dampening, as a fraction of the Hessian's mean diagonal (the paper's 1%).
    pub damp: f64,
    /// Round the columns by decreasing Hessian diagonal, with static group scales.
    pub act_order: bool,
}

impl Default for GptqOptions {
    fn default() -> Self {
        GptqOptions { damp: 0.01, act_order: false }
    }
}

/// The Hessian `X^T X` (`k x k`, row-major, f64) of `n` input rows `x` (`[n, k]`).
pub fn hessian(x: &[f32], k: usize) -> Vec<f64> {
    let n = x.len() / k.max(1);
    let rows: Vec<Vec<f64>> = pool::par_ranges(k, |range| {
        range
            .flat_map(|i| {
                let mut row = vec![0f64; k];
                for t in 0..n {
                    let xt = &x[t * k..(t + 1) * k];
                    let xi = xt[i] as f64;
                    if xi != 0.0 {
                        for (h, &xj) in row.iter_mut().zip(xt) {
                            *h += xi * xj as f64;
                        }
                    }
                }
                row
            })
            .collect()
    });
    rows.concat()
}

/// `a . b` in f64 with four accumulators, so that the loop vectorizes.
#[inline]
fn dot(a: &[f64], b: &[f64]) -> f64 {
    let (ca, cb) = (a.chunks_exact(4), b.chunks_exact(4));
    let tail: f64 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    let mut acc = [0f64; 4];
    for (x, y) in ca.zip(cb) {
        for l in 0..4 {
            acc[l] += x[l] * y[l];
        }
    }
    (acc[0] + acc[1]) + (acc[2] + acc[3]) + tail
}

/// Columns per panel of the blocked factorizations: each row below a panel is read once per
/// panel instead of once per column (the matrices of a 4864-wide layer are 190 MB).
const PANEL: usize = 16;

/// The lower Cholesky factor of the symmetric positive definite `a` (`n x n`), or `None`
/// where a pivot is not positive. Left-looking by panels of [`PANEL`] columns: the panel's
/// diagonal block first, then the rows below it split over threads.
fn cholesky(a: &[f64], n: usize) -> Option<Vec<f64>> {
    let mut l = vec![0f64; n * n];
    for j0 in (0..n).step_by(PANEL) {
        let j1 = (j0 + PANEL).min(n);
        for i in j0..j1 {
            for c in j0..=i {
                let s = a[i * n + c] - dot(&l[i * n..i * n + c], &l[c * n..c * n + c]);
                if c == i {
                    if s <= 0.0 || !s.is_finite() {
                        return None;
                    }
                    l[i * n + i] = s.sqrt();
                } else {
                    l[i * n + c] = s / l[c * n + c];
                }
            }
        }
        let below = n - j1;
        let l_ref = &l;
        let panel = |range: std::ops::Range<usize>| -> Vec<f64> {
            let mut out = Vec::with_capacity(range.len() * (j1 - j0));
            for t in range {
                let i = j1 + t;
                let row = &l_ref[i * n..i * n + j0];
                let mut local = [0f64; PANEL];
                for c in j0..j1 {
                    let lc = &l_ref[c * n..c * n + c];
                    let s = a[i * n + c] - dot(row, &lc[..j0]) - dot(&local[..c - j0], &lc[j0..c]);
                    local[c - j0] = s / l_ref[c * n + c];
                }
                out.extend_from_slice(&local[..j1 - j0]);
            }
            out
        };
        let parts = if below * j1 > 1 << 16 { pool::par_ranges(below, panel) } else { vec![panel(0..below)] };
        for (t, v) in parts.concat().chunks_exact(j1 - j0).enumerate() {
            let i = j1 + t;
            l[i * n + j0..i * n + j1].copy_from_slice(v);
        }
    }
    Some(l)
}

/// `U`, the upper Cholesky factor of `h^-1` (`h^-1 = U^T U`). With `J` the reversal of the
/// indices and `M` the lower Cholesky factor of `J h J`, `h = R R^T` for the upper
/// triangular `R = J M J`, so `h^-1 = R^-T R^-1` and `U = R^-1 = J M^-1 J` (positive
/// diagonal, hence the factor). One factorization and one triangular inverse, both blocked;
/// the inverse's columns are independent and split over threads.
fn inverse_upper_factor(h: &[f64], n: usize) -> Option<Vec<f64>> {
    let mut hr = vec![0f64; n * n];
    for i in 0..n {
        for j in 0..n {
            hr[i * n + j] = h[(n - 1 - i) * n + (n - 1 - j)];
        }
    }
    let m = cholesky(&hr, n)?;
    drop(hr);
    // M^-1 by columns: x = M^-1 e_c is zero above c, x[c] = 1 / M[c][c] and
    // x[i] = -M[i][c..i] . x[c..i] / M[i][i] below; PANEL columns at a time, so that each row
    // of M is read once per panel.
    let m_ref = &m;
    let blocks = n.div_ceil(PANEL);
    let cols: Vec<Vec<f64>> = pool::par_ranges(blocks, |range| {
        let mut out = Vec::new();
        for b in range {
            let (c0, c1) = (b * PANEL, ((b + 1) * PANEL).min(n));
            // x[cc][i - c0] for the panel's columns, rows c0..n.
            let mut x = vec![vec![0f64; n - c0]; c1 - c0];
            for i in c0..n {
                let row = &m_ref[i * n..i * n + i];
                let d = m_ref[i * n + i];
                for (cc, xc) in x.iter_mut().enumerate() {
                    let c = c0 + cc;
                    if i < c {
                        continue;
                    }
                    xc[i - c0] = if i == c { 1.0 / d } else { -dot(&row[c..i], &xc[c - c0..i - c0]) / d };
                }
            }
            out.extend(x);
        }
        out
    })
    .into_iter()
    .flatten()
    .collect();
    // U[i][j] = X[n-1-i][n-1-j], X[r][c] = cols[c][r - block start of c].
    let mut u = vec![0f64; n * n];
    for i in 0..n {
        for j in i..n {
            let (r, c) = (n - 1 - i, n - 1 - j);
            u[i * n + j] = cols[c][r - c / PANEL * PANEL];
        }
    }
    Some(u)
}

/// GPTQ of the `rows x k` matrix `w` (row-major) with the Hessian `h` of its inputs (`k x k`,
/// [`hessian`]) into `format` (q8, q4, q4sym or q3, any group). Errors: a format round-to-
/// nearest cannot produce, shapes that do not match, non-finite weights or a Hessian that
/// dampening cannot make positive definite, each naming `tensor`.
pub fn quantize(
    tensor: &str,
    w: &[f32],
    rows: usize,
    k: usize,
    h: &[f64],
    format: QuantFormat,
    opts: GptqOptions,
) -> Result<PackedMatrix, QuantError> {
    let invalid = |reason: String| QuantError::Invalid { tensor: tensor.into(), reason };
    check_rtn(tensor, format)?;
    super::check_dense(tensor, format, "GPTQ")?;
    format.check(tensor, k)?;
    if w.len() != rows * k {
        return Err(invalid(format!("{} values, expected {rows} x {k}", w.len())));
    }
    if h.len() != k * k {
        return Err(invalid(format!("a Hessian of {} values, expected {k} x {k}", h.len())));
    }
    if let Some(i) = w.iter().position(|v| !v.is_finite()) {
        return Err(invalid(format!("non-finite value {} at element {i}", w[i])));
    }
    let mut h = h.to_vec();
    let dead: Vec<bool> = (0..k).map(|i| h[i * k + i] == 0.0).collect();
    for (i, &d) in dead.iter().enumerate() {
        if d {
            h[i * k + i] = 1.0;
        }
    }
    let mean_diag = (0..k).map(|i| h[i * k + i]).sum::<f64>() / k as f64;
    for i in 0..k {
        h[i * k + i] += opts.damp * mean_diag;
    }
    // The order columns are rounded in: theirs, or by decreasing diagonal (stable).
    let mut order: Vec<usize> = (0..k).collect();
    if opts.act_order {
        order.sort_by(|&a, &b| h[b * k + b].total_cmp(&h[a * k + a]));
        let hp: Vec<f64> = (0..k * k).map(|i| h[order[i / k] * k + order[i % k]]).collect();
        h = hp;
    }
    let u = inverse_upper_factor(&h, k)
        .ok_or_else(|| invalid(format!("the inputs' Hessian ({k} x {k}) is not positive definite even with {} dampening", opts.damp)))?;
    round_columns(tensor, w, rows, k, &u, &order, opts.act_order, &dead, format)
}

/// GPTQ's column loop, in `order` (the factor `u` is of the Hessian permuted so). Groups'
/// scales are fixed from the original row first (`static_groups`, act-order), or from the
/// corrected values as each group starts (in column order). Codes are packed in column
/// order either way.
#[allow(clippy::too_many_arguments)]
fn round_columns(
    tensor: &str,
    w: &[f32],
    rows: usize,
    k: usize,
    u: &[f64],
    order: &[usize],
    static_groups: bool,
    dead: &[bool],
    format: QuantFormat,
) -> Result<PackedMatrix, QuantError> {
    let group = format.group as usize;
    let (qw, sw) = (format.qs_words(k), format.scale_words(k));
    let parts = pool::par_ranges(rows, |range| -> RowPart {
        let mut qs = vec![0u32; range.len() * qw];
        let mut scales = vec![0u32; range.len() * sw];
        let mut codes = vec![0i32; k];
        let mut params = vec![(0u32, 0f32, 0f32); k / group];
        let mut gx = vec![0f32; group];
        for (ri, r) in range.enumerate() {
            let orig: Vec<f32> = w[r * k..(r + 1) * k].iter().zip(dead).map(|(&v, &d)| if d { 0.0 } else { v }).collect();
            let mut row: Vec<f64> = order.iter().map(|&c| orig[c] as f64).collect();
            // (sc, d, m) of group g from its values x.
            let params_of = |g: usize, x: &[f32]| {
                let p = group_params(format.kind, x);
                if p.1.is_finite() && p.2.is_finite() {
                    Ok(p)
                } else {
                    Err(non_finite_scale(tensor, r, g, x, format))
                }
            };
            if static_groups {
                for (g, p) in params.iter_mut().enumerate() {
                    *p = params_of(g, &orig[g * group..(g + 1) * group])?;
                }
            }
            for a in 0..k {
                let c = order[a];
                if !static_groups && c.is_multiple_of(group) {
                    // In column order a group's columns are row[a..a + group], corrected so far.
                    for (x, &v) in gx.iter_mut().zip(&row[a..a + group]) {
                        *x = v as f32;
                    }
                    params[c / group] = params_of(c / group, &gx)?;
                }
                let (_, d, m) = params[c / group];
                let inv = if d != 0.0 { 1.0 / d } else { 0.0 };
                let q = round_code(format.kind, row[a] as f32, inv, m);
                codes[c] = q;
                let err = (row[a] - (q as f32 * d + m) as f64) / u[a * k + a];
                for (x, &uij) in row[a + 1..].iter_mut().zip(&u[a * k + a + 1..(a + 1) * k]) {
                    *x -= err * uij;
                }
            }
            for (g, p) in params.iter().enumerate() {
                let (q, s) = (&mut qs[ri * qw..(ri + 1) * qw], &mut scales[ri * sw..(ri + 1) * sw]);
                pack_group(format, g, p.0, &codes[g * group..(g + 1) * group], q, s);
            }
        }
        Ok((qs, scales))
    });
    gather(parts, format, rows, k)
}

/// One row range's codes and scales, or why it failed.
type RowPart = Result<(Vec<u32>, Vec<u32>), QuantError>;

/// The packed matrix from the row ranges' codes and scales, in order.
fn gather(parts: Vec<RowPart>, format: QuantFormat, rows: usize, k: usize) -> Result<PackedMatrix, QuantError> {
    let (mut qs, mut scales) = (Vec::with_capacity(rows * format.qs_words(k)), Vec::with_capacity(rows * format.scale_words(k)));
    for p in parts {
        let (q, s) = p?;
        qs.extend(q);
        scales.extend(s);
    }
    Ok(PackedMatrix { format, rows, k, qs, scales })
}

/// `||(W - deq(Q)) X^T||^2` summed over the input rows `x` (`[n, k]`): the layer output error
/// GPTQ minimizes, for reports and tests.
pub fn output_error(w: &[f32], q: &PackedMatrix, x: &[f32]) -> f64 {
    let k = q.k;
    let deq = q.dequantize();
    let n = x.len() / k.max(1);
    let mut total = 0f64;
    for r in 0..q.rows {
        let e: Vec<f64> = (0..k).map(|c| (w[r * k + c] - deq[r * k + c]) as f64).collect();
        for t in 0..n {
            let y: f64 = e.iter().zip(&x[t * k..(t + 1) * k]).map(|(a, &b)| a * b as f64).sum();
            total += y * y;
        }
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_inverse_factor_inverts() {
        // A small SPD matrix: U^T U must be its inverse.
        let n = 5;
        let mut a = vec![0f64; n * n];
        for i in 0..n {
            for j in 0..n {
                a[i * n + j] = 1.0 / (1.0 + (i as f64 - j as f64).abs()) + if i == j { 1.0 } else { 0.0 };
            }
        }
        let u = inverse_upper_factor(&a, n).unwrap();
        for i in 0..n {
            for j in 0..n {
                let hinv_ij: f64 = (0..n).map(|p| u[p * n + i] * u[p * n + j]).sum();
                let prod: f64 = (0..n).map(|p| a[i * n + p] * (0..n).map(|q| u[q * n + p] * u[q * n + j]).sum::<f64>()).sum();
                assert!((prod - if i == j { 1.0 } else { 0.0 }).abs() < 1e-10, "({i}, {j}): {prod} ({hinv_ij})");
            }
        }
        assert!(cholesky(&[-1.0], 1).is_none());
    }

    /// `U` is upper triangular with a positive diagonal and `U^T U h = I`, for sizes around
    /// the panel (odd ones, one panel, several) and a matrix large enough to run threaded.
    #[test]
    fn inverse_upper_factor_inverts_random_spd_matrices() {
        let mut seed = 7u64;
        let mut rnd = || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((seed >> 11) as f64 / (1u64 << 53) as f64) - 0.5
        };
        for n in [1, 5, 16, 17, 37, 70, 300] {
            let samples = n + 5;
            let x: Vec<f32> = (0..samples * n).map(|_| rnd() as f32).collect();
            let mut h = hessian(&x, n);
            for i in 0..n {
                h[i * n + i] += 0.01;
            }
            let u = inverse_upper_factor(&h, n).expect("positive definite");
            for i in 0..n {
                assert!(u[i * n + i] > 0.0, "n {n}: diagonal {i}");
                for j in 0..i {
                    assert_eq!(u[i * n + j], 0.0, "n {n}: U[{i}][{j}] below the diagonal");
                }
            }
            // (U^T U h)[i][j] = sum_p U[p][i] (U h)[p][j].
            let uh: Vec<f64> = (0..n * n).map(|e| (0..n).map(|q| u[(e / n) * n + q] * h[q * n + e % n]).sum()).collect();
            let mut worst = 0f64;
            for i in 0..n {
                for j in 0..n {
                    let v: f64 = (0..n).map(|p| u[p * n + i] * uh[p * n + j]).sum();
                    worst = worst.max((v - if i == j { 1.0 } else { 0.0 }).abs());
                }
            }
            assert!(worst < 1e-8, "n {n}: |U^T U h - I| up to {worst:e}");
        }
    }

    /// The blocked Cholesky factor reproduces its matrix (across panel edges) and an
    /// indefinite matrix has none.
    #[test]
    fn cholesky_reproduces_its_matrix() {
        let n = 45;
        let x: Vec<f32> = (0..(n + 3) * n).map(|i| ((i * 7919 % 101) as f32 - 50.0) / 50.0).collect();
        let mut h = hessian(&x, n);
        for i in 0..n {
            h[i * n + i] += 0.1;
        }
        let l = cholesky(&h, n).unwrap();
        for i in 0..n {
            for j in 0..n {
                let v: f64 = (0..n).map(|p| l[i * n + p] * l[j * n + p]).sum();
                assert!((v - h[i * n + j]).abs() < 1e-9 * h[i * n + i].max(1.0), "L L^T [{i}][{j}]");
            }
        }
        assert!(cholesky(&[1.0, 2.0, 2.0, 1.0], 2).is_none(), "an indefinite matrix has no factor");
    }
}

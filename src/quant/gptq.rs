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
//! Columns are taken in their order (no act-order), so a group's columns stay contiguous.

use super::{check_rtn, group_params, non_finite_scale, pack_group, pool, round_code, PackedMatrix, QuantError, QuantFormat};

/// GPTQ settings.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct GptqOptions {
    /// Dampening, as a fraction of the Hessian's mean diagonal (the paper's 1%).
    pub damp: f64,
}

impl Default for GptqOptions {
    fn default() -> Self {
        GptqOptions { damp: 0.01 }
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

/// The lower Cholesky factor of the symmetric positive definite `a` (`n x n`), or `None`
/// where a pivot is not positive.
fn cholesky(a: &[f64], n: usize) -> Option<Vec<f64>> {
    let mut l = vec![0f64; n * n];
    for i in 0..n {
        for j in 0..=i {
            let s: f64 = (0..j).map(|p| l[i * n + p] * l[j * n + p]).sum();
            if i == j {
                let d = a[i * n + i] - s;
                if d <= 0.0 || !d.is_finite() {
                    return None;
                }
                l[i * n + i] = d.sqrt();
            } else {
                l[i * n + j] = (a[i * n + j] - s) / l[j * n + j];
            }
        }
    }
    Some(l)
}

/// `U`, the upper Cholesky factor of `h^-1` (`h^-1 = U^T U`), from the lower factor `L` of
/// `h`: `h^-1 = L^-T L^-1`, factored again.
fn inverse_upper_factor(h: &[f64], n: usize) -> Option<Vec<f64>> {
    let l = cholesky(h, n)?;
    // L^-1 by forward substitution, column by column.
    let mut li = vec![0f64; n * n];
    for c in 0..n {
        li[c * n + c] = 1.0 / l[c * n + c];
        for i in c + 1..n {
            let s: f64 = (c..i).map(|p| l[i * n + p] * li[p * n + c]).sum();
            li[i * n + c] = -s / l[i * n + i];
        }
    }
    // h^-1 = L^-T L^-1: entry (i, j) = sum over p >= max(i, j) of li[p][i] li[p][j], read
    // from the transpose so that both factors are contiguous.
    let mut lt = vec![0f64; n * n];
    for p in 0..n {
        for i in 0..=p {
            lt[i * n + p] = li[p * n + i];
        }
    }
    let lt = &lt;
    let rows: Vec<Vec<f64>> = pool::par_ranges(n, |range| {
        let mut out = Vec::with_capacity(range.len() * n);
        for i in range {
            for j in 0..n {
                let from = i.max(j);
                out.push(lt[i * n + from..(i + 1) * n].iter().zip(&lt[j * n + from..(j + 1) * n]).map(|(a, b)| a * b).sum::<f64>());
            }
        }
        vec![out]
    })
    .into_iter()
    .flatten()
    .collect();
    let hinv = rows.concat();
    let lo = cholesky(&hinv, n)?;
    // U = L'^T.
    let mut u = vec![0f64; n * n];
    for i in 0..n {
        for j in i..n {
            u[i * n + j] = lo[j * n + i];
        }
    }
    Some(u)
}

/// GPTQ of the `rows x k` matrix `w` (row-major) with the Hessian `h` of its inputs (`k x k`,
/// [`hessian`]) into `format` (q8, q4 or q4sym, any group). Errors: a format round-to-
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
    let u = inverse_upper_factor(&h, k)
        .ok_or_else(|| invalid(format!("the inputs' Hessian ({k} x {k}) is not positive definite even with {} dampening", opts.damp)))?;
    let group = format.group as usize;
    let (qw, sw) = (format.qs_words(k), format.scale_words(k));
    let parts = pool::par_ranges(rows, |range| -> Result<(Vec<u32>, Vec<u32>), QuantError> {
        let mut qs = vec![0u32; range.len() * qw];
        let mut scales = vec![0u32; range.len() * sw];
        let mut codes = vec![0i32; group];
        let mut gx = vec![0f32; group];
        for (ri, r) in range.enumerate() {
            let mut row: Vec<f64> = w[r * k..(r + 1) * k].iter().zip(&dead).map(|(&v, &d)| if d { 0.0 } else { v as f64 }).collect();
            let (mut d, mut m, mut sc) = (0f32, 0f32, 0u32);
            for i in 0..k {
                let g = i / group;
                if i % group == 0 {
                    for (x, &v) in gx.iter_mut().zip(&row[i..i + group]) {
                        *x = v as f32;
                    }
                    (sc, d, m) = group_params(format.kind, &gx);
                    if !(d.is_finite() && m.is_finite()) {
                        return Err(non_finite_scale(tensor, r, g, &gx, format));
                    }
                }
                let inv = if d != 0.0 { 1.0 / d } else { 0.0 };
                let q = round_code(format.kind, row[i] as f32, inv, m);
                codes[i % group] = q;
                let err = (row[i] - (q as f32 * d + m) as f64) / u[i * k + i];
                for (x, &uij) in row[i + 1..].iter_mut().zip(&u[i * k + i + 1..(i + 1) * k]) {
                    *x -= err * uij;
                }
                if i % group == group - 1 {
                    pack_group(format, g, sc, &codes, &mut qs[ri * qw..(ri + 1) * qw], &mut scales[ri * sw..(ri + 1) * sw]);
                }
            }
        }
        Ok((qs, scales))
    });
    let (mut qs, mut scales) = (Vec::with_capacity(rows * qw), Vec::with_capacity(rows * sw));
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
}

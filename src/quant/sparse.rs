//! 2:4 structured sparsity (`QuantKind::S24Q4`, `QuantKind::S24Q8`): of every four
//! consecutive elements of a row two are kept, the other two are zero.
//!
//! Layout (per row, as the module docs of [`crate::quant`] describe the planes): kept value
//! `p` (0..k/2, in element order; two per four) has its code in the low plane (`S24Q4`: 4
//! bits at bit `4 (p % 8)` of word `p / 8`; `S24Q8`: a two's-complement byte at bit
//! `8 (p % 4)` of word `p / 4`) and its position within its four (0..3) in the high plane (2
//! bits at bit `2 (p % 16)` of word `p / 16`, after the low plane). The first kept of a four
//! has the lower position. So an 8-element step of the kernels reads 16 (`S24Q4`) or 32
//! (`S24Q8`) low bits and 8 high bits, exactly where Q3's and Q5's steps read theirs, and one
//! decode (`raw_codes8` in shaders/common/weights/codes.wgsl) places the kept codes, with a
//! pruned element getting the code of zero. Scales are `Q4Sym`'s / `Q8`'s: one f16 `d` per
//! group, two per word, set from the kept values of the group only.
//!
//! Which two are kept: the two of largest score `|w_ij| * n_j`, with `n_j` the norm of input
//! channel `j` over the calibration tokens (Wanda, Sun et al. 2023) or 1 (magnitude pruning);
//! the lower position wins a tie.

use super::{group_params, non_finite_scale, round_code, PackedMatrix, QuantError, QuantFormat, QuantKind};

/// The dense code of element `c` of a row whose words are `q` (low plane of `lo_words`
/// words, then the high plane): the kept value's raw code, or the code of zero (8 for
/// `S24Q4`, whose values are `q - 8`; 0 for `S24Q8`).
pub fn dense_code(kind: QuantKind, q: &[u32], lo_words: usize, c: usize) -> i32 {
    let (four, e) = (c / 4, (c % 4) as u32);
    let mut code = if kind == QuantKind::S24Q4 { 8 } else { 0 };
    // The second kept value wins a repeated position, as the shaders' selects do.
    for p in [2 * four, 2 * four + 1] {
        if (q[lo_words + p / 16] >> (2 * (p % 16))) & 3 == e {
            code = match kind {
                QuantKind::S24Q4 => ((q[p / 8] >> (4 * (p % 8))) & 15) as i32,
                _ => (q[p / 4] >> (8 * (p % 4))) as u8 as i8 as i32,
            };
        }
    }
    code
}

/// The positions (0..3, ascending) of the two kept elements of the four `w[0..4]` under
/// input norms `n[0..4]`: the two largest `|w| n`, the lower position on a tie.
pub fn keep_two(w: &[f32], n: &[f32]) -> (usize, usize) {
    let s: [f32; 4] = std::array::from_fn(|i| w[i].abs() * n[i]);
    let mut order = [0usize, 1, 2, 3];
    // Stable: equal scores keep their positions' order.
    order.sort_by(|&a, &b| s[b].total_cmp(&s[a]));
    let (a, b) = (order[0], order[1]);
    (a.min(b), a.max(b))
}

/// Prune a `rows x k` matrix to 2:4 and pack it in `format` (`S24Q4` or `S24Q8`, groups of
/// 32 or more), keeping in every four the two largest `|w_ij| * norms[j]` (`None`: by
/// magnitude). Codes round to nearest against the f16 scale stored for the kept values of
/// each group. Errors name `tensor`.
pub fn quantize(
    tensor: &str,
    values: &[f32],
    rows: usize,
    k: usize,
    format: QuantFormat,
    norms: Option<&[f32]>,
) -> Result<PackedMatrix, QuantError> {
    let invalid = |reason: String| QuantError::Invalid { tensor: tensor.into(), reason };
    if !format.kind.is_sparse() {
        return Err(invalid(format!("{format} is not a 2:4 format (s24q4, s24q8)")));
    }
    format.check(tensor, k)?;
    if values.len() != rows * k {
        return Err(invalid(format!("{} values, expected {rows} x {k}", values.len())));
    }
    if let Some(i) = values.iter().position(|v| !v.is_finite()) {
        return Err(invalid(format!("non-finite value {} at element {i}", values[i])));
    }
    let ones = vec![1f32; k];
    let norms = match norms {
        Some(n) if n.len() != k => return Err(invalid(format!("{} input norms for rows of {k}", n.len()))),
        Some(n) => match n.iter().position(|v| !(v.is_finite() && *v >= 0.0)) {
            Some(i) => return Err(invalid(format!("input norm {} of channel {i} is not a finite non-negative number", n[i]))),
            None => n,
        },
        None => &ones,
    };
    // Q4Sym's and Q8's rules for a group's scale and codes, applied to its kept values.
    let rule = if format.kind == QuantKind::S24Q4 { QuantKind::Q4Sym } else { QuantKind::Q8 };
    let group = format.group as usize;
    let (qw, lw, sw) = (format.qs_words(k), format.lo_words(k), format.scale_words(k));
    let mut qs = vec![0u32; rows * qw];
    let mut scales = vec![0u32; rows * sw];
    let mut kept = vec![0f32; group / 2];
    let mut pos = vec![0u32; group / 2];
    for r in 0..rows {
        let row = &values[r * k..(r + 1) * k];
        let (q, s) = (&mut qs[r * qw..(r + 1) * qw], &mut scales[r * sw..(r + 1) * sw]);
        for g in 0..k / group {
            for f in 0..group / 4 {
                let c = g * group + 4 * f;
                let (a, b) = keep_two(&row[c..c + 4], &norms[c..c + 4]);
                (kept[2 * f], kept[2 * f + 1]) = (row[c + a], row[c + b]);
                (pos[2 * f], pos[2 * f + 1]) = (a as u32, b as u32);
            }
            let (sc, d, m) = group_params(rule, &kept);
            if !(d.is_finite() && m.is_finite()) {
                return Err(non_finite_scale(tensor, r, g, &row[g * group..(g + 1) * group], format));
            }
            s[g / 2] |= sc << (16 * (g & 1));
            let inv = if d != 0.0 { 1.0 / d } else { 0.0 };
            for (i, (&v, &at)) in kept.iter().zip(&pos).enumerate() {
                let p = g * group / 2 + i;
                let code = round_code(rule, v, inv, m);
                match format.kind {
                    QuantKind::S24Q4 => q[p / 8] |= (code as u32) << (4 * (p % 8)),
                    _ => q[p / 4] |= (code as i8 as u8 as u32) << (8 * (p % 4)),
                }
                q[lw + p / 16] |= at << (2 * (p % 16));
            }
        }
    }
    Ok(PackedMatrix { format, rows, k, qs, scales })
}

/// The norm of each input channel over the calibration inputs `x` (`[n, k]`, row-major):
/// Wanda's `||X_j||_2`.
pub fn input_norms(x: &[f32], k: usize) -> Vec<f32> {
    let mut acc = vec![0f64; k];
    for row in x.chunks_exact(k) {
        for (a, &v) in acc.iter_mut().zip(row) {
            *a += (v as f64) * (v as f64);
        }
    }
    acc.into_iter().map(|a| a.sqrt() as f32).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keep_two_takes_the_largest_scores_lower_position_on_ties() {
        assert_eq!(keep_two(&[0.1, -3.0, 2.0, 0.5], &[1.0; 4]), (1, 2));
        assert_eq!(keep_two(&[0.1, -3.0, 2.0, 0.5], &[100.0, 0.1, 1.0, 1.0]), (0, 2));
        assert_eq!(keep_two(&[1.0, 1.0, 1.0, 1.0], &[1.0; 4]), (0, 1));
        assert_eq!(keep_two(&[0.0, 0.0, 0.0, 2.0], &[1.0; 4]), (0, 3));
    }
}

//! Plain-loop CPU reference ops over `&[f32]` slices with explicit dimensions. Sums are
//! accumulated in f64 and rounded to f32 once, so these are the oracle GPU kernels are
//! compared against. Matrices are row-major; shapes are given as `[rows, cols]`.
//!
//! These functions check their slice lengths with `assert!`: they are a test oracle, and a
//! mismatch is a bug in the caller.

/// Gathers rows of an embedding table.
///
/// `table`: `[vocab, dim]`; `ids`: `T` token ids. Returns `[T, dim]`.
///
/// # Panics
/// If an id is `>= vocab` or `table.len() != vocab * dim`.
pub fn embedding(table: &[f32], vocab: usize, dim: usize, ids: &[u32]) -> Vec<f32> {
    assert_eq!(table.len(), vocab * dim, "embedding table is not [vocab, dim]");
    let mut out = Vec::with_capacity(ids.len() * dim);
    for &id in ids {
        let id = id as usize;
        assert!(id < vocab, "token id {id} out of range for vocab {vocab}");
        out.extend_from_slice(&table[id * dim..(id + 1) * dim]);
    }
    out
}

/// RMSNorm over each row: `y = x / sqrt(mean(x^2) + eps) * w` (the weight multiplies
/// directly; it is not `1 + w`).
///
/// `x`: `[T, D]` with `D = w.len()`. Returns `[T, D]`.
pub fn rmsnorm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let d = w.len();
    assert!(d > 0 && x.len().is_multiple_of(d), "rmsnorm: x is not [T, {d}]");
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks_exact(d) {
        let ms = row.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / d as f64;
        let r = 1.0 / (ms + eps as f64).sqrt();
        out.extend(row.iter().zip(w).map(|(&v, &g)| (v as f64 * r * g as f64) as f32));
    }
    out
}

/// Linear layer `y = x W^T + b`.
///
/// `x`: `[T, K]`; `w`: `[N, K]` (Hugging Face `[out_features, in_features]`);
/// `bias`: `[N]` or `None`. Returns `[T, N]`.
pub fn linear(x: &[f32], w: &[f32], bias: Option<&[f32]>, k: usize, n: usize) -> Vec<f32> {
    assert!(k > 0 && x.len().is_multiple_of(k), "linear: x is not [T, {k}]");
    assert_eq!(w.len(), n * k, "linear: w is not [{n}, {k}]");
    if let Some(b) = bias {
        assert_eq!(b.len(), n, "linear: bias is not [{n}]");
    }
    let t = x.len() / k;
    let mut out = Vec::with_capacity(t * n);
    for row in x.chunks_exact(k) {
        for j in 0..n {
            let wr = &w[j * k..(j + 1) * k];
            let mut acc = bias.map_or(0.0, |b| b[j] as f64);
            for (&a, &b) in row.iter().zip(wr) {
                acc += a as f64 * b as f64;
            }
            out.push(acc as f32);
        }
    }
    out
}

/// Rotary position embedding in the Hugging Face `rotate_half` layout: within each head,
/// dimension `i` is paired with `i + head_dim/2` (not `2i` with `2i+1`).
///
/// For pair `i` the angle is `positions[t] * inv_freq[i]`, computed in f32 as transformers
/// does; then `y[i] = x[i] cos - x[i+h] sin` and `y[i+h] = x[i+h] cos + x[i] sin`.
///
/// `x`: `[T, n_heads * head_dim]`; `positions`: `T` absolute positions;
/// `inv_freq`: `head_dim / 2` frequencies. Returns `[T, n_heads * head_dim]`.
pub fn rope(x: &[f32], positions: &[usize], n_heads: usize, head_dim: usize, inv_freq: &[f32]) -> Vec<f32> {
    rope_scaled(x, positions, n_heads, head_dim, inv_freq, 1.0)
}

/// [`rope`] with cos and sin multiplied by `mscale` (in f32, as transformers applies
/// LongRoPE's attention factor).
pub fn rope_scaled(x: &[f32], positions: &[usize], n_heads: usize, head_dim: usize, inv_freq: &[f32], mscale: f32) -> Vec<f32> {
    let half = head_dim / 2;
    let width = n_heads * head_dim;
    assert!(head_dim.is_multiple_of(2), "rope: head_dim {head_dim} is odd");
    assert_eq!(inv_freq.len(), half, "rope: inv_freq is not [head_dim/2]");
    assert_eq!(x.len(), positions.len() * width, "rope: x is not [T, n_heads*head_dim]");
    let mut out = vec![0.0f32; x.len()];
    for (t, &pos) in positions.iter().enumerate() {
        for i in 0..half {
            let angle = pos as f32 * inv_freq[i];
            let (sin, cos) = ((angle.sin() * mscale) as f64, (angle.cos() * mscale) as f64);
            for h in 0..n_heads {
                let base = t * width + h * head_dim;
                let a = x[base + i] as f64;
                let b = x[base + i + half] as f64;
                out[base + i] = (a * cos - b * sin) as f32;
                out[base + i + half] = (b * cos + a * sin) as f32;
            }
        }
    }
    out
}

/// Causal scaled-dot-product attention with grouped-query heads.
///
/// `q`: `[T, n_heads * head_dim]`, query row `t` at absolute position `q_positions[t]`;
/// `k`, `v`: `[S, n_kv_heads * head_dim]`, key row `j` at position `j`. Query row `t`
/// attends to keys `0..=q_positions[t]` (so prefill passes `0..T` with `S = T`, and a decode
/// step passes `[S - 1]`). Query head `h` reads kv head `h / (n_heads / n_kv_heads)`.
/// Scores are `q.k * scale` (usually `head_dim^-0.5`). Returns `[T, n_heads * head_dim]`.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    q_positions: &[usize],
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    scale: f32,
) -> Vec<f32> {
    attention_windowed(q, k, v, q_positions, n_heads, n_kv_heads, head_dim, scale, None)
}

/// [`attention`] where, with `window = Some(w)`, query position `i` sees only keys `j` with
/// `i - w < j <= i` (sliding-window attention: itself and the `w - 1` keys before it).
#[allow(clippy::too_many_arguments)]
pub fn attention_windowed(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    q_positions: &[usize],
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    scale: f32,
    window: Option<usize>,
) -> Vec<f32> {
    assert!(n_kv_heads > 0 && n_heads.is_multiple_of(n_kv_heads), "attention: heads not a multiple of kv heads");
    let qw = n_heads * head_dim;
    let kw = n_kv_heads * head_dim;
    assert_eq!(q.len(), q_positions.len() * qw, "attention: q is not [T, n_heads*head_dim]");
    assert!(k.len().is_multiple_of(kw) && k.len() == v.len(), "attention: k/v are not [S, n_kv_heads*head_dim]");
    let s = k.len() / kw;
    let group = n_heads / n_kv_heads;
    let mut out = vec![0.0f32; q.len()];
    let mut scores = vec![0.0f64; s];
    for (t, &pos) in q_positions.iter().enumerate() {
        assert!(pos < s, "attention: query position {pos} has no key (S = {s})");
        let n_keys = pos + 1;
        let first = window.map_or(0, |w| n_keys.saturating_sub(w.max(1)));
        for h in 0..n_heads {
            let kvh = h / group;
            let qr = &q[t * qw + h * head_dim..t * qw + (h + 1) * head_dim];
            let mut max = f64::NEG_INFINITY;
            for (j, sc) in scores[..n_keys].iter_mut().enumerate().skip(first) {
                let kr = &k[j * kw + kvh * head_dim..j * kw + (kvh + 1) * head_dim];
                let dot: f64 = qr.iter().zip(kr).map(|(&a, &b)| a as f64 * b as f64).sum();
                *sc = dot * scale as f64;
                max = max.max(*sc);
            }
            let mut denom = 0.0f64;
            for sc in &mut scores[first..n_keys] {
                *sc = (*sc - max).exp();
                denom += *sc;
            }
            for d in 0..head_dim {
                let mut acc = 0.0f64;
                for (j, &p) in scores[..n_keys].iter().enumerate().skip(first) {
                    acc += p * v[j * kw + kvh * head_dim + d] as f64;
                }
                out[t * qw + h * head_dim + d] = (acc / denom) as f32;
            }
        }
    }
    out
}

/// SiLU, `x * sigmoid(x)`, elementwise.
pub fn silu(x: &[f32]) -> Vec<f32> {
    x.iter().map(|&v| silu_f64(v as f64) as f32).collect()
}

fn silu_f64(v: f64) -> f64 {
    v / (1.0 + (-v).exp())
}

/// Gated MLP activation `silu(gate) * up`, elementwise; both have the same length.
pub fn silu_mul(gate: &[f32], up: &[f32]) -> Vec<f32> {
    assert_eq!(gate.len(), up.len(), "silu_mul: gate and up differ in length");
    gate.iter().zip(up).map(|(&g, &u)| (silu_f64(g as f64) * u as f64) as f32).collect()
}

/// GELU with the tanh approximation (PyTorch `gelu(approximate="tanh")`,
/// `gelu_pytorch_tanh`), in f64.
pub fn gelu_tanh(v: f64) -> f64 {
    let c = (2.0 / std::f64::consts::PI).sqrt();
    0.5 * v * (1.0 + (c * (v + 0.044715 * v * v * v)).tanh())
}

/// Gated MLP activation `gelu_tanh(gate) * up`, elementwise (Gemma).
pub fn gelu_tanh_mul(gate: &[f32], up: &[f32]) -> Vec<f32> {
    assert_eq!(gate.len(), up.len(), "gelu_tanh_mul: gate and up differ in length");
    gate.iter().zip(up).map(|(&g, &u)| (gelu_tanh(g as f64) * u as f64) as f32).collect()
}

/// Elementwise `a + b` (the residual add); both have the same length.
pub fn add(a: &[f32], b: &[f32]) -> Vec<f32> {
    assert_eq!(a.len(), b.len(), "add: lengths differ");
    a.iter().zip(b).map(|(&x, &y)| x + y).collect()
}

/// Softmax over each row of `x` (`[T, n]`), max-subtracted, in f64. Returns `[T, n]`.
pub fn softmax(x: &[f32], n: usize) -> Vec<f32> {
    assert!(n > 0 && x.len().is_multiple_of(n), "softmax: x is not [T, {n}]");
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks_exact(n) {
        let max = row.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v as f64));
        let e: Vec<f64> = row.iter().map(|&v| (v as f64 - max).exp()).collect();
        let sum: f64 = e.iter().sum();
        out.extend(e.iter().map(|&v| (v / sum) as f32));
    }
    out
}

/// A mixture of experts' route for one token from its router logits `z` (transformers'
/// Qwen3-MoE / Mixtral / OLMoE blocks): the softmax of `z` (in f64), the `top_k` most probable
/// experts (the lower index first on a tie) in order of probability, with their
/// probabilities, renormalised to sum to 1 with `renormalize`.
pub fn moe_route(z: &[f32], top_k: usize, renormalize: bool) -> Vec<(usize, f64)> {
    let max = z.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let e: Vec<f64> = z.iter().map(|&v| (v as f64 - max).exp()).collect();
    let sum: f64 = e.iter().sum();
    let mut order: Vec<usize> = (0..z.len()).collect();
    order.sort_by(|&a, &b| e[b].total_cmp(&e[a]).then(a.cmp(&b)));
    let mut chosen: Vec<(usize, f64)> = order[..top_k.min(z.len())].iter().map(|&i| (i, e[i] / sum)).collect();
    if renormalize {
        let s: f64 = chosen.iter().map(|c| c.1).sum();
        chosen.iter_mut().for_each(|c| c.1 /= s);
    }
    chosen
}

/// Index of the largest value; the lowest index wins ties, NaNs are never chosen (an
/// all-NaN or empty row gives 0).
pub fn argmax(row: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut best_v = f32::NEG_INFINITY;
    let mut found = false;
    for (i, &v) in row.iter().enumerate() {
        if v.is_nan() {
            continue;
        }
        if !found || v > best_v {
            best = i;
            best_v = v;
            found = true;
        }
    }
    best as u32
}

/// OpenAI's logit_bias and penalties (`shaders/logit_bias.wgsl`): `logits[r * n + t] +=
/// delta` for each `(t, delta)` of `rows[r]`, in place (tokens at or past `n` are skipped).
pub fn logit_bias(logits: &mut [f32], n: usize, rows: &[Vec<(u32, f32)>]) {
    for (row, pairs) in logits.chunks_mut(n).zip(rows) {
        for &(t, d) in pairs {
            if let Some(v) = row.get_mut(t as usize) {
                *v += d;
            }
        }
    }
}

/// Constrained decoding's mask (`shaders/logit_mask.wgsl`): every logit of `logits`
/// (`rows x n`) whose bit in its row's `words(n)`-word bitmask (`mask`, bit `i % 32` of word
/// `i / 32`) is clear becomes -inf, in place.
pub fn logit_mask(logits: &mut [f32], mask: &[u32], n: usize) {
    let words = n.div_ceil(32);
    for (r, row) in logits.chunks_mut(n).enumerate() {
        for (i, v) in row.iter_mut().enumerate() {
            if mask[r * words + i / 32] & (1 << (i % 32)) == 0 {
                *v = f32::NEG_INFINITY;
            }
        }
    }
}

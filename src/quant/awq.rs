//! Activation-aware weight scaling, after AWQ (Lin et al., arXiv:2306.00978).
//!
//! Salient input channels (those with large mean |x|) lose less to rounding if their weight
//! columns are scaled up before quantization and the input is scaled down by the same
//! factor. For a linear layer `y = W x` and per-input-channel scales `s > 0`,
//! `W x = (W diag(s)) (x / s)`: quantizing `W diag(s)` instead of `W` changes which errors
//! the rounding makes, and `x / s` costs nothing when it can be folded into the op that
//! produces `x`. Here every fold is exact:
//!
//! - q/k/v (input: input RMSNorm output) and gate/up (input: post-attention RMSNorm output):
//!   `1 / s` multiplies the RMSNorm weight;
//! - o_proj (input: attention output, a mix of V rows): `1 / s` divides the v_proj rows (and
//!   bias). Query heads sharing one KV head read the same V channel, so under GQA/MQA the
//!   scales are tied: one scale per KV channel, shared by the `n_heads / n_kv_heads` o_proj
//!   columns that read it;
//! - down_proj (input: `silu(gate) * up`): `1 / s` divides the up_proj rows.
//!
//! Scales are `s = mean|x|^alpha`, normalized by `sqrt(max s * min s)` as in the reference
//! implementation (llm-awq), and `alpha` is chosen per group of layers sharing an input from
//! a grid (`0, 1/n, ..., 1`) by the output error `sum_t ||(W - deq(Q(W diag(s))) / s) x_t||^2`
//! over a sample of calibration tokens. `alpha = 0` is plain round-to-nearest, so the chosen
//! scales never do worse than RTN on that sample.
//!
//! Calibration runs the float model once over the calibration tokens with a lean f32 forward
//! pass (threaded matrix products; RMSNorm, RoPE and attention from [`crate::reference::ops`])
//! that records, per layer, mean |x| per input channel over all tokens and the inputs of the
//! sampled tokens (position 0 always among them, see [`sample_indices`]).

use std::collections::HashMap;

use super::{QuantError, QuantFormat};
use crate::error::LanternError;
use crate::model::ModelConfig;
use crate::reference::ops;

/// Float weights by Hugging Face name, as f32 (what calibration, search and folding read).
pub type FloatWeights = HashMap<String, Vec<f32>>;

/// Search settings.
#[derive(Debug, Clone, PartialEq)]
pub struct AwqOptions {
    /// Grid steps: alpha takes the values `0, 1/grid, ..., 1` (`grid + 1` candidates).
    pub grid: u32,
    /// Calibration tokens kept (the text is cut after this many).
    pub max_tokens: usize,
    /// Tokens whose activations score each candidate (position 0 and evenly spaced others,
    /// see [`sample_indices`]). The mean |x| that sets the scales uses every token.
    pub sample_tokens: usize,
}

impl Default for AwqOptions {
    fn default() -> Self {
        AwqOptions { grid: 10, max_tokens: 256, sample_tokens: 32 }
    }
}

impl AwqOptions {
    /// The alpha candidates.
    pub fn alphas(&self) -> Vec<f32> {
        let n = self.grid.max(1);
        (0..=n).map(|i| i as f32 / n as f32).collect()
    }
}

/// The inputs one group of linear layers saw during calibration.
#[derive(Debug, Clone)]
pub struct InputStats {
    /// Input channels.
    pub k: usize,
    /// Mean |x| per channel over every calibration token.
    pub mean_abs: Vec<f32>,
    /// Inputs of the sampled tokens, `[n_sample, k]` row-major.
    pub sample: Vec<f32>,
}

impl InputStats {
    pub fn n_sample(&self) -> usize {
        self.sample.len() / self.k.max(1)
    }
}

/// Which linear layers share an input.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Site {
    /// q/k/v projections (input RMSNorm output).
    Qkv,
    /// o_proj (attention output).
    O,
    /// gate/up projections (post-attention RMSNorm output).
    GateUp,
    /// down_proj (`silu(gate) * up`).
    Down,
}

impl Site {
    pub const ALL: [Site; 4] = [Site::Qkv, Site::O, Site::GateUp, Site::Down];

    pub fn name(&self) -> &'static str {
        match self {
            Site::Qkv => "qkv",
            Site::O => "o_proj",
            Site::GateUp => "gate_up",
            Site::Down => "down_proj",
        }
    }

    /// Names of the weights of layer `l` that read this input.
    pub fn weights(&self, l: usize) -> Vec<String> {
        let p = format!("model.layers.{l}");
        match self {
            Site::Qkv => ["q", "k", "v"].iter().map(|n| format!("{p}.self_attn.{n}_proj.weight")).collect(),
            Site::O => vec![format!("{p}.self_attn.o_proj.weight")],
            Site::GateUp => vec![format!("{p}.mlp.gate_proj.weight"), format!("{p}.mlp.up_proj.weight")],
            Site::Down => vec![format!("{p}.mlp.down_proj.weight")],
        }
    }

    /// Where `1 / s` goes: the norm weight (qkv, gate/up) or the rows of the producing
    /// projection (o: v_proj, down: up_proj).
    pub fn fold_target(&self, l: usize) -> String {
        let p = format!("model.layers.{l}");
        match self {
            Site::Qkv => format!("{p}.input_layernorm.weight"),
            Site::O => format!("{p}.self_attn.v_proj.weight"),
            Site::GateUp => format!("{p}.post_attention_layernorm.weight"),
            Site::Down => format!("{p}.mlp.up_proj.weight"),
        }
    }
}

/// What calibration recorded for one decoder layer, by site.
#[derive(Debug, Clone)]
pub struct LayerStats {
    pub qkv: InputStats,
    pub o: InputStats,
    pub gate_up: InputStats,
    pub down: InputStats,
}

impl LayerStats {
    pub fn get(&self, site: Site) -> &InputStats {
        match site {
            Site::Qkv => &self.qkv,
            Site::O => &self.o,
            Site::GateUp => &self.gate_up,
            Site::Down => &self.down,
        }
    }
}

/// Threads for the CPU loops (1 on wasm, where threads cannot be spawned).
fn threads() -> usize {
    if cfg!(target_arch = "wasm32") {
        return 1;
    }
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1).min(16)
}

/// Splits `0..n` into up to `threads()` ranges and runs `f` on each (in parallel natively),
/// returning the results in order.
fn par_ranges<T: Send>(n: usize, f: impl Fn(std::ops::Range<usize>) -> T + Sync) -> Vec<T> {
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

/// f32 dot product with 16 independent accumulators (vectorizes without fast-math).
#[inline(always)]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
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

#[inline(always)]
fn matmul_rows_generic(x: &[f32], w: &[f32], bias: Option<&[f32]>, k: usize, rows: std::ops::Range<usize>, out: &mut Vec<f32>) {
    for j in rows {
        let wr = &w[j * k..(j + 1) * k];
        let b = bias.map_or(0.0, |b| b[j]);
        out.extend(x.chunks_exact(k).map(|xr| dot(xr, wr) + b));
    }
}

/// Rows `rows` of `W` against every row of `x`, appended as `[rows, t]`.
fn matmul_rows(x: &[f32], w: &[f32], bias: Option<&[f32]>, k: usize, rows: std::ops::Range<usize>, out: &mut Vec<f32>) {
    #[cfg(target_arch = "x86_64")]
    if avx::available() {
        for j in rows {
            let wr = &w[j * k..(j + 1) * k];
            let b = bias.map_or(0.0, |b| b[j]);
            // SAFETY: the CPU supports AVX (checked above).
            out.extend(x.chunks_exact(k).map(|xr| unsafe { avx::dot(xr, wr) } + b));
        }
        return;
    }
    matmul_rows_generic(x, w, bias, k, rows, out)
}

/// `y = x W^T (+ b)` for `x: [t, k]`, `w: [n, k]`; returns `[t, n]`. Threads split `n`.
pub(crate) fn matmul(x: &[f32], w: &[f32], bias: Option<&[f32]>, k: usize, n: usize) -> Vec<f32> {
    let t = x.len() / k;
    // Each thread fills a [rows, t] block (transposed), then blocks are interleaved.
    let blocks = par_ranges(n, |rows| {
        let mut out = Vec::with_capacity(rows.len() * t);
        matmul_rows(x, w, bias, k, rows, &mut out);
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

/// Records `x` (`[t, k]`) into stats: mean |x| and the sampled rows.
fn record(x: &[f32], k: usize, sample: &[usize]) -> InputStats {
    let t = x.len() / k;
    let mut mean = vec![0f64; k];
    for row in x.chunks_exact(k) {
        for (m, &v) in mean.iter_mut().zip(row) {
            *m += v.abs() as f64;
        }
    }
    let mut s = Vec::with_capacity(sample.len() * k);
    for &i in sample {
        s.extend_from_slice(&x[i * k..(i + 1) * k]);
    }
    InputStats { k, mean_abs: mean.into_iter().map(|m| (m / t.max(1) as f64) as f32).collect(), sample: s }
}

/// The sampled token indices: all of them when `t <= n`, else position 0 and `n - 1`
/// evenly spaced others (midpoints of equal spans of `1..t`). Position 0 is always in: its
/// activations are unusually large in many models and every later token attends to it, so
/// errors there spread; leaving it out of the objective measurably hurts. Measured on SmolLM2
/// (Q4_1 GGUF to q4sym, 256 calibration tokens, 32 sampled; mean KL to the source over 214
/// positions of chat and story text): RTN 0.54, AWQ without position 0 0.35, with it 0.27.
pub fn sample_indices(t: usize, n: usize) -> Vec<usize> {
    if t <= n {
        return (0..t).collect();
    }
    if n == 0 {
        return Vec::new();
    }
    let mut v = vec![0];
    v.extend((0..n - 1).map(|i| 1 + (2 * i + 1) * (t - 1) / (2 * (n - 1))));
    v
}

fn missing(name: &str) -> LanternError {
    LanternError::Calibration(format!("weight `{name}` is missing"))
}

/// The f32 forward pass over `tokens` (positions `0..T`). With `stats`, records the inputs
/// of every linear layer. Returns the final residual stream `[T, hidden]` (before the final
/// norm).
fn forward(
    c: &ModelConfig,
    w: &FloatWeights,
    tokens: &[u32],
    sample_tokens: usize,
    mut stats: Option<&mut Vec<LayerStats>>,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Vec<f32>, LanternError> {
    let get = |n: &str| w.get(n).map(Vec::as_slice).ok_or_else(|| missing(n));
    let (h, hd) = (c.hidden_size, c.head_dim);
    let (qd, kvd, ffn) = (c.num_heads * hd, c.num_kv_heads * hd, c.intermediate_size);
    if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
        return Err(LanternError::Calibration(format!("AWQ calibration: token id {bad} is outside the vocabulary ({})", c.vocab_size)));
    }
    let positions: Vec<usize> = (0..tokens.len()).collect();
    let sample = sample_indices(tokens.len(), sample_tokens);
    let inv_freq = c.rope_inv_freq();
    let mut x = ops::embedding(get("model.embed_tokens.weight")?, c.vocab_size, h, tokens);
    for l in 0..c.num_layers {
        progress(l, c.num_layers);
        let p = format!("model.layers.{l}");
        let lw = |n: &str| get(&format!("{p}.{n}"));
        let bias = |n: &str| -> Option<&[f32]> {
            if c.qkv_bias {
                w.get(&format!("{p}.self_attn.{n}_proj.bias")).map(Vec::as_slice)
            } else {
                None
            }
        };
        let n1 = ops::rmsnorm(&x, lw("input_layernorm.weight")?, c.rms_norm_eps);
        let q = matmul(&n1, lw("self_attn.q_proj.weight")?, bias("q"), h, qd);
        let k = matmul(&n1, lw("self_attn.k_proj.weight")?, bias("k"), h, kvd);
        let v = matmul(&n1, lw("self_attn.v_proj.weight")?, bias("v"), h, kvd);
        let q = ops::rope(&q, &positions, c.num_heads, hd, &inv_freq);
        let k = ops::rope(&k, &positions, c.num_kv_heads, hd, &inv_freq);
        let scale = (1.0 / (hd as f64).sqrt()) as f32;
        let a = ops::attention(&q, &k, &v, &positions, c.num_heads, c.num_kv_heads, hd, scale);
        let o = matmul(&a, lw("self_attn.o_proj.weight")?, None, qd, h);
        let x1 = ops::add(&x, &o);
        let n2 = ops::rmsnorm(&x1, lw("post_attention_layernorm.weight")?, c.rms_norm_eps);
        let g = matmul(&n2, lw("mlp.gate_proj.weight")?, None, h, ffn);
        let u = matmul(&n2, lw("mlp.up_proj.weight")?, None, h, ffn);
        let m = ops::silu_mul(&g, &u);
        let d = matmul(&m, lw("mlp.down_proj.weight")?, None, ffn, h);
        x = ops::add(&x1, &d);
        if let Some(s) = stats.as_deref_mut() {
            s.push(LayerStats {
                qkv: record(&n1, h, &sample),
                o: record(&a, qd, &sample),
                gate_up: record(&n2, h, &sample),
                down: record(&m, ffn, &sample),
            });
        }
    }
    progress(c.num_layers, c.num_layers);
    Ok(x)
}

/// Runs the float model over `tokens` and records, per layer, the inputs of its linear
/// layers (mean |x| over all tokens, the rows of `sample_tokens` evenly spaced tokens).
/// `progress(layer, layers)` is called as layers complete.
pub fn capture(
    config: &ModelConfig,
    weights: &FloatWeights,
    tokens: &[u32],
    sample_tokens: usize,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Vec<LayerStats>, LanternError> {
    if tokens.is_empty() {
        return Err(LanternError::Calibration("AWQ calibration: no calibration tokens".into()));
    }
    let mut stats = Vec::with_capacity(config.num_layers);
    forward(config, weights, tokens, sample_tokens, Some(&mut stats), progress)?;
    Ok(stats)
}

/// The final residual stream `[T, hidden]` of the lean f32 forward pass (for checking it
/// against [`crate::reference::ReferenceModel::forward_hidden`]).
pub fn forward_hidden(config: &ModelConfig, weights: &FloatWeights, tokens: &[u32]) -> Result<Vec<f32>, LanternError> {
    forward(config, weights, tokens, 0, None, &mut |_, _| {})
}

/// Per-channel scales `mean_abs^alpha`, floored at 1e-4 and normalized by
/// `sqrt(max * min)` (llm-awq's `auto_scale`).
pub fn scales_for(mean_abs: &[f32], alpha: f32) -> Vec<f32> {
    let mut s: Vec<f32> = mean_abs.iter().map(|&m| (m.max(0.0) as f64).powf(alpha as f64).max(1e-4) as f32).collect();
    let (lo, hi) = s.iter().fold((f32::INFINITY, 0f32), |(lo, hi), &v| (lo.min(v), hi.max(v)));
    let norm = ((lo as f64) * (hi as f64)).sqrt() as f32;
    if norm.is_finite() && norm > 0.0 {
        for v in &mut s {
            *v /= norm;
        }
    }
    s
}

/// Expands per-KV-channel o_proj scales (`[n_kv_heads * head_dim]`) to the o_proj input
/// (`[n_heads * head_dim]`): query head `h` reads KV head `h / (n_heads / n_kv_heads)`.
pub fn expand_kv(c: &ModelConfig, s_kv: &[f32]) -> Vec<f32> {
    let hd = c.head_dim;
    let rep = c.group_size();
    (0..c.num_heads).flat_map(|h| s_kv[(h / rep) * hd..(h / rep + 1) * hd].iter().copied()).collect()
}

/// Averages o_proj input statistics over the query heads of each KV head.
pub fn tie_kv(c: &ModelConfig, mean_abs: &[f32]) -> Vec<f32> {
    let hd = c.head_dim;
    let rep = c.group_size();
    let mut out = vec![0f32; c.num_kv_heads * hd];
    for h in 0..c.num_heads {
        for d in 0..hd {
            out[(h / rep) * hd + d] += mean_abs[h * hd + d] / rep as f32;
        }
    }
    out
}

/// Four dot products of `x` with `e0..e3` in one pass over `x` (8 lanes per row).
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

/// `sum_t sum_r (e_r . x_t)^2` over the rows `e_r` of `e` and the rows `x_t` of `x`.
#[inline(always)]
fn block_error_generic(e: &[f32], k: usize, x: &[f32]) -> f64 {
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

/// AVX versions of the dot products. They perform exactly the operations of the portable
/// ones (lane `l` accumulates the products of elements `l mod 8` (or `l mod 16`), separate
/// multiply and add, no FMA, the same final sums), so results are bit-identical: the choice
/// of AWQ scales does not depend on the CPU.
#[cfg(target_arch = "x86_64")]
mod avx {
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx")]
    fn hsum(v: __m256) -> f32 {
        let mut a = [0f32; 8];
        // SAFETY: `a` holds 8 f32.
        unsafe { _mm256_storeu_ps(a.as_mut_ptr(), v) };
        a.iter().sum::<f32>()
    }

    /// [`super::dot4`].
    #[target_feature(enable = "avx")]
    pub fn dot4(e: [&[f32]; 4], x: &[f32]) -> [f32; 4] {
        let n = x.len() / 8 * 8;
        assert!(e.iter().all(|r| r.len() >= x.len()));
        let mut a = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        while i < n {
            // SAFETY: i + 8 <= n <= len of x and of every e[j] (asserted above).
            unsafe {
                let xv = _mm256_loadu_ps(x.as_ptr().add(i));
                for j in 0..4 {
                    a[j] = _mm256_add_ps(a[j], _mm256_mul_ps(_mm256_loadu_ps(e[j].as_ptr().add(i)), xv));
                }
            }
            i += 8;
        }
        let tail = |ej: &[f32]| ej[n..x.len()].iter().zip(&x[n..]).map(|(p, q)| p * q).sum::<f32>();
        [hsum(a[0]) + tail(e[0]), hsum(a[1]) + tail(e[1]), hsum(a[2]) + tail(e[2]), hsum(a[3]) + tail(e[3])]
    }

    /// [`super::dot`]: 16 lanes as two registers.
    #[target_feature(enable = "avx")]
    pub fn dot(a: &[f32], b: &[f32]) -> f32 {
        let len = a.len().min(b.len());
        let n = len / 16 * 16;
        let (mut lo, mut hi) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let mut i = 0;
        while i < n {
            // SAFETY: i + 16 <= n <= len of both slices.
            unsafe {
                lo = _mm256_add_ps(lo, _mm256_mul_ps(_mm256_loadu_ps(a.as_ptr().add(i)), _mm256_loadu_ps(b.as_ptr().add(i))));
                hi = _mm256_add_ps(hi, _mm256_mul_ps(_mm256_loadu_ps(a.as_ptr().add(i + 8)), _mm256_loadu_ps(b.as_ptr().add(i + 8))));
            }
            i += 16;
        }
        let mut acc = [0f32; 16];
        // SAFETY: `acc` holds 16 f32.
        unsafe {
            _mm256_storeu_ps(acc.as_mut_ptr(), lo);
            _mm256_storeu_ps(acc.as_mut_ptr().add(8), hi);
        }
        let mut s = 0f32;
        for (x, y) in a[n..len].iter().zip(&b[n..len]) {
            s += x * y;
        }
        acc.iter().sum::<f32>() + s
    }

    pub fn available() -> bool {
        std::arch::is_x86_feature_detected!("avx")
    }
}

fn block_error(e: &[f32], k: usize, x: &[f32]) -> f64 {
    #[cfg(target_arch = "x86_64")]
    if avx::available() {
        let mut err = 0f64;
        let mut quad = e.chunks_exact(4 * k);
        for four in &mut quad {
            let rows4 = [&four[..k], &four[k..2 * k], &four[2 * k..3 * k], &four[3 * k..]];
            for xt in x.chunks_exact(k) {
                // SAFETY: the CPU supports AVX (checked above).
                for d in unsafe { avx::dot4(rows4, xt) } {
                    err += (d as f64) * (d as f64);
                }
            }
        }
        for erow in quad.remainder().chunks_exact(k) {
            for xt in x.chunks_exact(k) {
                // SAFETY: as above.
                let d = unsafe { avx::dot(erow, xt) } as f64;
                err += d * d;
            }
        }
        return err;
    }
    block_error_generic(e, k, x)
}

/// The output error `sum_t ||(W - deq(Q(W diag(s))) diag(1/s)) x_t||^2` of quantizing the
/// `rows x k` matrix `w` with input scales `s` (`None`: plain RTN) over the sampled inputs
/// `x` (`[n, k]`). The rounding is exactly [`super::PackedMatrix::quantize`]'s.
pub fn output_error(tensor: &str, w: &[f32], k: usize, s: Option<&[f32]>, x: &[f32], format: QuantFormat) -> Result<f64, QuantError> {
    format.check(tensor, k)?;
    let rows = w.len() / k;
    let inv_s: Option<Vec<f32>> = s.map(|s| s.iter().map(|v| 1.0 / v).collect());
    // Row blocks bound the scratch memory and give the threads work.
    let block = 16usize;
    let blocks = rows.div_ceil(block);
    let parts = par_ranges(blocks, |range| -> Result<f64, QuantError> {
        let mut err = 0f64;
        let mut e = vec![0f32; block * k];
        for b in range {
            let (r0, r1) = (b * block, ((b + 1) * block).min(rows));
            let src = &w[r0 * k..r1 * k];
            let e = &mut e[..src.len()];
            match s {
                Some(s) => {
                    for (erow, row) in e.chunks_exact_mut(k).zip(src.chunks_exact(k)) {
                        for ((ei, &a), &si) in erow.iter_mut().zip(row).zip(s) {
                            *ei = a * si;
                        }
                    }
                }
                None => e.copy_from_slice(src),
            }
            super::fake_quantize(tensor, e, k, format)?;
            match &inv_s {
                Some(inv) => {
                    for (erow, row) in e.chunks_exact_mut(k).zip(src.chunks_exact(k)) {
                        for ((ei, &a), &is) in erow.iter_mut().zip(row).zip(inv) {
                            *ei = a - *ei * is;
                        }
                    }
                }
                None => {
                    for (ei, &a) in e.iter_mut().zip(src) {
                        *ei = a - *ei;
                    }
                }
            }
            err += block_error(e, k, x);
        }
        Ok(err)
    });
    parts.into_iter().sum()
}

/// The outcome of the alpha search for one site of one layer.
#[derive(Debug, Clone)]
pub struct SiteResult {
    pub site: Site,
    /// The chosen alpha (0 = plain RTN).
    pub alpha: f32,
    /// Scales to apply: `[k]` for qkv / gate_up / down, `[n_kv_heads * head_dim]` (tied)
    /// for o_proj.
    pub scales: Vec<f32>,
    /// Output error of plain RTN (alpha 0) on the sample.
    pub err_rtn: f64,
    /// Output error of the chosen alpha on the sample (`<= err_rtn`).
    pub err_best: f64,
}

/// Searches alpha for one site: every candidate's scales are applied to all weights `ws`
/// reading the input (each `[rows, k]`), quantized with `format`, and scored on the sample.
pub fn search_site(
    c: &ModelConfig,
    site: Site,
    names: &[String],
    ws: &[&[f32]],
    stats: &InputStats,
    format: QuantFormat,
    alphas: &[f32],
) -> Result<SiteResult, QuantError> {
    let k = stats.k;
    let base = if site == Site::O { tie_kv(c, &stats.mean_abs) } else { stats.mean_abs.clone() };
    let mut best: Option<(f32, Vec<f32>, f64)> = None;
    let mut err_rtn = f64::NAN;
    for &alpha in alphas {
        let s = if alpha == 0.0 { None } else { Some(scales_for(&base, alpha)) };
        let full = match (&s, site) {
            (Some(s), Site::O) => Some(expand_kv(c, s)),
            (s, _) => s.clone(),
        };
        let mut err = 0f64;
        for (name, w) in names.iter().zip(ws) {
            err += output_error(name, w, k, full.as_deref(), &stats.sample, format)?;
        }
        if alpha == 0.0 {
            err_rtn = err;
        }
        // Ties keep the smaller alpha (alpha 0 comes first).
        if best.as_ref().is_none_or(|b| err < b.2) {
            best = Some((alpha, s.unwrap_or_else(|| vec![1.0; base.len()]), err));
        }
    }
    let (alpha, scales, err_best) = best.unwrap_or((0.0, vec![1.0; base.len()], 0.0));
    if err_rtn.is_nan() {
        // No alpha 0 in the grid: score plain RTN for the report.
        err_rtn = 0.0;
        for (name, w) in names.iter().zip(ws) {
            err_rtn += output_error(name, w, k, None, &stats.sample, format)?;
        }
    }
    Ok(SiteResult { site, alpha, scales, err_rtn, err_best })
}

/// Scales for one layer, by site (`None`: leave that site unscaled). o_proj scales are per
/// KV channel (`[n_kv_heads * head_dim]`).
#[derive(Debug, Clone, Default)]
pub struct LayerScales {
    pub qkv: Option<Vec<f32>>,
    pub o: Option<Vec<f32>>,
    pub gate_up: Option<Vec<f32>>,
    pub down: Option<Vec<f32>>,
}

fn scale_cols(w: &mut [f32], k: usize, s: &[f32]) {
    for row in w.chunks_exact_mut(k) {
        for (v, &si) in row.iter_mut().zip(s) {
            *v *= si;
        }
    }
}

fn divide_rows(w: &mut [f32], k: usize, s: &[f32]) {
    for (row, &si) in w.chunks_exact_mut(k).zip(s) {
        for v in row {
            *v /= si;
        }
    }
}

fn divide(v: &mut [f32], s: &[f32]) {
    for (x, &si) in v.iter_mut().zip(s) {
        *x /= si;
    }
}

/// Applies one layer's scales to float weights, folding `1 / s` exactly (see the module
/// docs): the float model computes the same function afterwards (up to f32 rounding).
pub fn fold_layer(c: &ModelConfig, w: &mut FloatWeights, l: usize, s: &LayerScales) -> Result<(), LanternError> {
    let (h, hd) = (c.hidden_size, c.head_dim);
    let qd = c.num_heads * hd;
    let ffn = c.intermediate_size;
    let p = format!("model.layers.{l}");
    fn get_in<'a>(w: &'a mut FloatWeights, p: &str, n: &str) -> Result<&'a mut Vec<f32>, LanternError> {
        let name = format!("{p}.{n}");
        w.get_mut(&name).ok_or_else(|| missing(&name))
    }
    if let Some(s) = &s.qkv {
        for n in ["q", "k", "v"] {
            scale_cols(get_in(w, &p, &format!("self_attn.{n}_proj.weight"))?, h, s);
        }
        divide(get_in(w, &p, "input_layernorm.weight")?, s);
    }
    if let Some(s_kv) = &s.o {
        scale_cols(get_in(w, &p, "self_attn.o_proj.weight")?, qd, &expand_kv(c, s_kv));
        divide_rows(get_in(w, &p, "self_attn.v_proj.weight")?, h, s_kv);
        if c.qkv_bias {
            if let Ok(b) = get_in(w, &p, "self_attn.v_proj.bias") {
                divide(b, s_kv);
            }
        }
    }
    if let Some(s) = &s.gate_up {
        scale_cols(get_in(w, &p, "mlp.gate_proj.weight")?, h, s);
        scale_cols(get_in(w, &p, "mlp.up_proj.weight")?, h, s);
        divide(get_in(w, &p, "post_attention_layernorm.weight")?, s);
    }
    if let Some(s) = &s.down {
        scale_cols(get_in(w, &p, "mlp.down_proj.weight")?, ffn, s);
        divide_rows(get_in(w, &p, "mlp.up_proj.weight")?, h, s);
    }
    Ok(())
}

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
//! The module by job: this file holds the algorithm (options, scales, the search, the
//! folds); [`calibrate`] the calibration forward pass and the statistics it records;
//! [`kernels`] the threaded matrix products and error sums both spend their time in, with
//! `avx.rs` their hand-written x86_64 versions.

use std::collections::HashMap;

use super::pool::par_ranges;
use super::{QuantError, QuantFormat};
use crate::error::LanternError;
use crate::model::ModelConfig;

#[cfg(target_arch = "x86_64")]
mod avx;
pub mod calibrate;
pub mod kernels;

pub use calibrate::{capture, forward_hidden, sample_indices, InputStats, LayerStats};
use kernels::Kernels;

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

fn missing(name: &str) -> LanternError {
    LanternError::Calibration(format!("weight `{name}` is missing"))
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
    let kernels = Kernels::best();
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
            err += kernels.block_error(e, k, x);
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

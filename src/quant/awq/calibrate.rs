//! Calibration: the float model run once over the calibration tokens, recording per layer
//! what each group of linear layers reads: mean |x| per input channel over every token, and
//! the inputs of the sampled tokens (position 0 always among them, see [`sample_indices`]).
//!
//! The forward pass is the CPU reference's decoder stack ([`forward::run`]: the same
//! weights by name, norms, RoPE, attention and block structure) with one thing swapped through
//! its [`Pass`]: the linear layers are the threaded f32 [`matmul`] instead of the reference's
//! single-threaded f64 [`ops::linear`](crate::reference::ops::linear). Measured on SmolLM2-135M,
//! 256 tokens, on 2 busy cores (`cargo bench --bench awq`): 2.8-3.2 s with `matmul` (as fast
//! as the lean copy of the forward pass this replaced), 24 s with the reference's linear
//! layers. The recorded statistics are bit-identical to the lean copy's; the final residual
//! stream matches the reference's within 1e-4 (`tests/quant.rs`).

use super::kernels::matmul;
use super::{missing, FloatWeights, Site};
use crate::error::LanternError;
use crate::model::ModelConfig;
use crate::reference::forward::{self, Layer, LinearInput, Pass};

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

/// The reference's decoder stack with threaded f32 matrix products, recording the inputs
/// of every linear layer (with `stats`) and reporting progress.
struct Calibration<'a> {
    layers: usize,
    sample: Vec<usize>,
    /// Finished layers; `None`: run the forward pass only.
    stats: Option<Vec<LayerStats>>,
    /// The current layer's inputs so far, by site.
    current: [Option<InputStats>; 4],
    progress: &'a mut dyn FnMut(usize, usize),
}

fn site(input: LinearInput) -> Site {
    match input {
        LinearInput::Qkv => Site::Qkv,
        LinearInput::O => Site::O,
        LinearInput::GateUp => Site::GateUp,
        LinearInput::Down => Site::Down,
    }
}

impl Pass for Calibration<'_> {
    fn linear(&self, x: &[f32], w: &[f32], bias: Option<&[f32]>, k: usize, n: usize) -> Vec<f32> {
        matmul(x, w, bias, k, n)
    }

    fn input(&mut self, _: usize, input: LinearInput, x: &[f32], k: usize) {
        if self.stats.is_some() {
            let i = Site::ALL.iter().position(|&s| s == site(input)).expect("every site is in Site::ALL");
            self.current[i] = Some(record(x, k, &self.sample));
        }
    }

    fn state(&mut self, index: usize, _: &[f32]) {
        if let (Some(stats), true) = (&mut self.stats, index > 0) {
            let [Some(qkv), Some(o), Some(gate_up), Some(down)] = std::mem::take(&mut self.current) else {
                unreachable!("every decoder layer reports the inputs of all four sites");
            };
            stats.push(LayerStats { qkv, o, gate_up, down });
        }
        (self.progress)(index, self.layers);
    }
}

/// The f32 forward pass over `tokens` (positions `0..T`): [`forward::run`] with
/// [`Calibration`]. Returns the final residual stream `[T, hidden]` (before the final norm)
/// and, with `record`, what each layer's linear layers read.
fn forward(
    c: &ModelConfig,
    w: &FloatWeights,
    tokens: &[u32],
    sample_tokens: usize,
    record: bool,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<(Vec<f32>, Vec<LayerStats>), LanternError> {
    if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
        return Err(LanternError::Calibration(format!("AWQ calibration: token id {bad} is outside the vocabulary ({})", c.vocab_size)));
    }
    let get = |n: &str| w.get(n).map(Vec::as_slice).ok_or_else(|| missing(n));
    let embed = get("model.embed_tokens.weight")?;
    let layers = (0..c.num_layers).map(|l| Layer::by_name(c, l, get, |n| w.get(n).map(Vec::as_slice))).collect::<Result<Vec<_>, _>>()?;
    let mut pass = Calibration {
        layers: c.num_layers,
        sample: sample_indices(tokens.len(), sample_tokens),
        stats: record.then(|| Vec::with_capacity(c.num_layers)),
        current: Default::default(),
        progress,
    };
    let x = forward::run(c, embed, &layers, tokens, &mut pass);
    Ok((x, pass.stats.unwrap_or_default()))
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
    Ok(forward(config, weights, tokens, sample_tokens, true, progress)?.1)
}

/// The final residual stream `[T, hidden]` of the lean f32 forward pass (for checking it
/// against [`crate::reference::ReferenceModel::forward_hidden`]).
pub fn forward_hidden(config: &ModelConfig, weights: &FloatWeights, tokens: &[u32]) -> Result<Vec<f32>, LanternError> {
    Ok(forward(config, weights, tokens, 0, false, &mut |_, _| {})?.0)
}

//! The token of each logit row on the GPU (`shaders/argmax.wgsl`): the argmax (greedy), or a
//! draw from the softmax by the Gumbel-max rule for rows with a [`RowDraw`], over the whole
//! vocabulary or its top-p nucleus. 4 bytes per row come back.
//!
//! Gumbel-max: `argmax_i(logit_i / T + g_i)` with `g_i` independent standard Gumbel noise is
//! an exact draw from `softmax(logits / T)`, and taken over a subset of the tokens, an exact
//! draw from the renormalised subset: the nucleus (the fewest best tokens whose probability
//! reaches top-p) is the set of tokens whose logit is at least a threshold, which the kernel
//! finds by bisection over the logits' order (one pass over the row per step, at most 32). The noise is a hash of (the row's key, `i`), and
//! the key a hash of the request's seed and the token's index in its output, so a draw
//! depends on nothing the host holds between steps: the GPU's token is the request's token
//! on every path, and sampling without a top-k decodes ahead of the host as greedy decoding
//! does, reading back 4 bytes instead of a logits row. The uniform numbers lie on a 2^-24
//! grid, so the noise lies in about [-2.8, 17.3]: a token more than about 20 nats below the
//! row's best (probability under 2e-9 at T = 1) is never drawn.

use crate::gpu::buffer::create_uniform;
use crate::gpu::{GpuContext, GpuError, PipelineKey, ShaderOp};

use super::{bind, pipeline, Dim, Dispatch};

/// Mirrors `struct Params` in argmax.wgsl.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct ArgmaxParams {
    pub n: u32,
    pub _pad: [u32; 3],
}

/// Mirrors `struct Draw` in argmax.wgsl: how one logit row's token is chosen. The default
/// (zeroes) is the plain argmax.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct RowDraw {
    /// 1 / temperature; 0 for the argmax.
    pub inv_t: f32,
    pub key0: u32,
    pub key1: u32,
    /// Nucleus sampling's p in (0, 1); anything else: every token is a candidate.
    pub top_p: f32,
}

/// SplitMix64's step: the finaliser of `x` plus the golden-ratio increment (the engine's
/// seeded generator takes its state from the same stream).
pub fn mix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// `mix32` in argmax.wgsl.
fn mix32(mut x: u32) -> u32 {
    x ^= x >> 16;
    x = x.wrapping_mul(0x7feb_352d);
    x ^= x >> 15;
    x = x.wrapping_mul(0x846c_a68b);
    x ^ (x >> 16)
}

impl RowDraw {
    /// The plain argmax.
    pub const ARGMAX: RowDraw = RowDraw { inv_t: 0.0, key0: 0, key1: 0, top_p: 0.0 };

    /// The draw of token `index` of an output sampled at `temperature` (> 0) with `seed`,
    /// from the nucleus of `top_p` (1: the whole vocabulary).
    pub fn sampled(temperature: f32, top_p: f32, seed: u64, index: u64) -> RowDraw {
        let k = mix64(seed ^ mix64(index));
        RowDraw { inv_t: 1.0 / temperature, key0: k as u32, key1: (k >> 32) as u32, top_p }
    }

    /// Whether the candidates are cut to a nucleus.
    pub fn nucleus(&self) -> bool {
        self.inv_t > 0.0 && self.top_p > 0.0 && self.top_p < 1.0
    }

    /// The standard Gumbel noise of token `i` (`gumbel` in argmax.wgsl, in f32).
    pub fn noise(&self, i: u32) -> f32 {
        let h = mix32(mix32(i ^ self.key0).wrapping_add(self.key1));
        let u = ((h >> 8) as f32 + 0.5) * (1.0 / 16_777_216.0);
        -(-u.ln()).ln()
    }

    /// Token `i`'s score in the kernel's comparison (the logit itself for the argmax).
    pub fn score(&self, v: f32, i: u32) -> f32 {
        if self.inv_t > 0.0 && v > -f32::MAX {
            v * self.inv_t + self.noise(i)
        } else {
            v
        }
    }
}

/// The nucleus threshold of a row for `d` on the CPU, in f64: the largest logit `L` such that
/// the tokens at or above it hold a probability mass of at least `top_p` (every finite
/// logit counts when `d` has no nucleus: -f32::MAX).
pub fn nucleus_floor(row: &[f32], d: &RowDraw) -> f32 {
    if !d.nucleus() {
        return -f32::MAX;
    }
    let mut v: Vec<f32> = row.iter().copied().filter(|v| *v >= -f32::MAX).collect();
    v.sort_by(|a, b| b.total_cmp(a));
    let Some(&mx) = v.first() else { return -f32::MAX };
    let w = |x: f32| ((x as f64 - mx as f64) * d.inv_t as f64).exp();
    let z: f64 = v.iter().map(|&x| w(x)).sum();
    let mut acc = 0.0;
    for &x in &v {
        acc += w(x);
        if acc >= d.top_p as f64 * z {
            return x;
        }
    }
    *v.last().expect("not empty")
}

/// The kernel's choice for one row on the CPU (its tests compare with it): the argmax of the
/// scores of the candidates (tokens at or above `floor`: see [`nucleus_floor`]), lowest
/// index on ties, NaN never winning, 0 for a row without a candidate.
pub fn choose(row: &[f32], d: &RowDraw, floor: f32) -> u32 {
    let mut best: Option<(f32, u32)> = None;
    for (i, &v) in row.iter().enumerate() {
        if v < floor {
            continue;
        }
        let s = d.score(v, i as u32);
        if s.is_nan() || s == f32::NEG_INFINITY {
            continue;
        }
        if best.is_none_or(|(bv, _)| s > bv) {
            best = Some((s, i as u32));
        }
    }
    best.map_or(0, |b| b.1)
}

/// `out[r]` = the token of logit row `r` (of `n` values) for the step's `n_out` rows, chosen
/// as `draws[r]` says (a [`RowDraw`] per row).
pub async fn build(
    ctx: &GpuContext,
    step: &wgpu::Buffer,
    logits: &wgpu::Buffer,
    out: &wgpu::Buffer,
    draws: &wgpu::Buffer,
    n: usize,
) -> Result<Dispatch, GpuError> {
    let key = PipelineKey::new(ShaderOp::Argmax, 256);
    let pipe = pipeline(ctx, key).await?;
    let ubuf = create_uniform(ctx, "argmax.params", &ArgmaxParams { n: n as u32, _pad: [0; 3] });
    let bg = bind(ctx, "argmax", &pipe, &[(0, step), (1, &ubuf), (2, logits), (3, out), (4, draws)]);
    Ok(Dispatch { label: "argmax".into(), pipeline: pipe, bind_group: bg, grid: [Dim::Out, Dim::Const(1), Dim::Const(1)] })
}

//! Token sampling: greedy, temperature, top-k, top-p (nucleus), with a seeded generator so
//! a given seed reproduces a sampled continuation exactly.
//!
//! Order of operations (as in Hugging Face `generate` and llama.cpp): temperature scaling,
//! then top-k, then top-p over the renormalised distribution, then one draw. Temperature 0
//! means greedy (argmax, lowest id on ties), and greedy runs on the GPU. Sampling without a
//! top-k draws on the GPU too ([`Sampler::draws_on_gpu`]: a Gumbel-max draw keyed by the
//! seed and the token's index, `kernels::argmax`); top-k sampling draws here, from the
//! GPU's top-k pairs or the logits row, with the seeded generator.

/// Sampling parameters of one request.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct SamplingParams {
    /// 0 = greedy.
    pub temperature: f32,
    /// Keep the k most likely tokens; 0 = off.
    pub top_k: usize,
    /// Keep the smallest set whose probability reaches p; 1.0 = off.
    pub top_p: f32,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams { temperature: 0.0, top_k: 0, top_p: 1.0, seed: 0 }
    }
}

impl SamplingParams {
    /// Greedy decoding (argmax).
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0 || self.top_k == 1
    }
}

/// Greedy choice: the index of the largest logit (lowest index on ties, NaN skipped; 0 for
/// an all-NaN row), the GPU kernel's rule.
pub use crate::model::argmax;

/// A small, fast, seedable generator (SplitMix64 seeding a xoshiro256**).
#[derive(Debug, Clone)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    pub fn new(seed: u64) -> Rng {
        // SplitMix64's stream: the finaliser of z, z + g, z + 2g, ...
        let mut z = seed;
        let mut next = || {
            let x = crate::kernels::argmax::mix64(z);
            z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
            x
        };
        Rng { s: [next(), next(), next(), next()] }
    }

    pub fn next_u64(&mut self) -> u64 {
        let r = self.s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = self.s[1] << 17;
        self.s[2] ^= self.s[0];
        self.s[3] ^= self.s[1];
        self.s[1] ^= self.s[2];
        self.s[0] ^= self.s[3];
        self.s[2] ^= t;
        self.s[3] = self.s[3].rotate_left(45);
        r
    }

    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// A sampler for one request.
#[derive(Debug, Clone)]
pub struct Sampler {
    pub params: SamplingParams,
    rng: Rng,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Sampler {
        Sampler { params, rng: Rng::new(params.seed) }
    }

    /// Draw a token from one row of logits.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.params.is_greedy() || logits.is_empty() {
            return argmax(logits);
        }
        let t = self.params.temperature as f64;
        let cand: Vec<(u32, f64)> =
            logits.iter().enumerate().filter(|(_, v)| v.is_finite()).map(|(i, &v)| (i as u32, v as f64 / t)).collect();
        if cand.is_empty() {
            return argmax(logits);
        }
        self.draw(cand)
    }

    /// Whether this sampler's tokens are drawn on the GPU (`kernels::argmax`'s Gumbel-max
    /// rule, over the whole vocabulary or its top-p nucleus): sampling without a top-k, as
    /// OpenAI's and Anthropic's APIs do. Its steps must carry [`Self::row_draw`] for the row it
    /// samples.
    pub fn draws_on_gpu(&self) -> bool {
        let p = &self.params;
        !p.is_greedy() && p.temperature.is_finite() && p.top_k == 0 && p.top_p > 0.0
    }

    /// Whether the GPU's choice (the argmax kernel's: the argmax, or [`Self::row_draw`]'s
    /// draw) is this sampler's token: greedy, or drawing on the GPU.
    pub fn gpu_chooses(&self) -> bool {
        self.params.is_greedy() || self.draws_on_gpu()
    }

    /// How the GPU chooses this sampler's token number `index` of its output (0 for the
    /// first): a Gumbel-max draw keyed by the seed and `index` when it draws on the GPU
    /// ([`Self::draws_on_gpu`]), else the argmax (greedy; top-k sampling draws on the host).
    pub fn row_draw(&self, index: usize) -> crate::kernels::argmax::RowDraw {
        if self.draws_on_gpu() {
            crate::kernels::argmax::RowDraw::sampled(self.params.temperature, self.params.top_p, self.params.seed, index as u64)
        } else {
            crate::kernels::argmax::RowDraw::ARGMAX
        }
    }

    /// The token of row `r` of a step's output: the GPU's choice when greedy or drawing on the
    /// GPU (the step carried [`Self::row_draw`]), else a draw from the row's
    /// top-k pairs or logits (whichever the step read back).
    pub fn sample_step(&mut self, out: &crate::model::forward::StepOutput, r: usize, vocab: usize) -> u32 {
        match (&out.top, &out.logits) {
            _ if self.gpu_chooses() => out.argmax[r],
            (Some(t), _) => self.sample_top(&t[r]),
            (None, Some(l)) => self.sample(&l[r * vocab..(r + 1) * vocab]),
            (None, None) => out.argmax[r],
        }
    }

    /// Whether [`Self::sample_top`] over the best `k` (id, logit) pairs of a row draws what
    /// [`Self::sample`] over the whole row would: sampling with a top-k of at most `k`.
    pub fn fits_top(&self, k: usize) -> bool {
        !self.params.is_greedy() && self.params.top_k > 0 && self.params.top_k <= k
    }

    /// These parameters as `kernels::sample` takes them, for drawing on the GPU from a row's
    /// top-k pairs.
    pub fn gpu_params(&self) -> crate::kernels::sample::SampleParams {
        let p = &self.params;
        crate::kernels::sample::SampleParams { temperature: p.temperature, top_k: p.top_k as u32, top_p: p.top_p, _pad: 0 }
    }

    /// Draw a token from a row's best (id, logit) pairs (the GPU top-k); the same draw as
    /// `sample` on the full row when `fits_top` holds for the number of pairs given.
    pub fn sample_top(&mut self, top: &[(u32, f32)]) -> u32 {
        let t = self.params.temperature as f64;
        let cand: Vec<(u32, f64)> = top.iter().filter(|(_, v)| v.is_finite()).map(|&(i, v)| (i, v as f64 / t)).collect();
        if cand.is_empty() {
            return top.first().map_or(0, |c| c.0);
        }
        if self.params.is_greedy() {
            return cand.iter().fold(cand[0], |b, &c| if c.1 > b.1 || (c.1 == b.1 && c.0 < b.0) { c } else { b }).0;
        }
        self.draw(cand)
    }

    /// Temperature-scaled candidates -> top-k, top-p, one draw.
    fn draw(&mut self, cand: Vec<(u32, f64)>) -> u32 {
        let d = self.shape(cand);
        self.draw_from(&d)
    }

    /// The distribution [`Self::sample`] draws from for one row of logits: (id, probability)
    /// pairs, most likely first, summing to 1 (one pair with probability 1 when greedy).
    /// Speculative decoding compares the target's and the draft's with it.
    pub fn distribution(&self, logits: &[f32]) -> Dist {
        let cand: Vec<(u32, f64)> = if self.params.is_greedy() {
            Vec::new()
        } else {
            let t = self.params.temperature as f64;
            logits.iter().enumerate().filter(|(_, v)| v.is_finite()).map(|(i, &v)| (i as u32, v as f64 / t)).collect()
        };
        if cand.is_empty() {
            return Dist(vec![(argmax(logits), 1.0)]);
        }
        self.shape(cand)
    }

    /// [`Self::distribution`] from a row's best (id, logit) pairs (the GPU top-k); the same
    /// distribution when [`Self::fits_top`] holds for the number of pairs given.
    pub fn distribution_top(&self, top: &[(u32, f32)]) -> Dist {
        let t = self.params.temperature as f64;
        let cand: Vec<(u32, f64)> = top.iter().filter(|(_, v)| v.is_finite()).map(|&(i, v)| (i, v as f64 / t)).collect();
        if cand.is_empty() {
            return Dist(vec![(top.first().map_or(0, |c| c.0), 1.0)]);
        }
        if self.params.is_greedy() {
            let best = cand.iter().fold(cand[0], |b, &c| if c.1 > b.1 || (c.1 == b.1 && c.0 < b.0) { c } else { b });
            return Dist(vec![(best.0, 1.0)]);
        }
        self.shape(cand)
    }

    /// One draw from `d` (one uniform number from the generator).
    pub fn draw_from(&mut self, d: &Dist) -> u32 {
        let u = self.rng.next_f64();
        let mut acc = 0.0;
        for &(id, p) in &d.0 {
            acc += p;
            if u < acc {
                return id;
            }
        }
        d.0.last().map_or(0, |c| c.0)
    }

    /// A uniform number in [0, 1) from the request's generator (speculative acceptance).
    pub fn uniform(&mut self) -> f64 {
        self.rng.next_f64()
    }

    /// Temperature-scaled candidates -> top-k, top-p: the distribution one draw takes.
    fn shape(&self, mut cand: Vec<(u32, f64)>) -> Dist {
        // Descending by logit, ties by lower id (a total order, so deterministic). With top-k,
        // select the k best in linear time and sort only those, not the whole vocabulary.
        let order = |a: &(u32, f64), b: &(u32, f64)| b.1.partial_cmp(&a.1).unwrap_or(std::cmp::Ordering::Equal).then(a.0.cmp(&b.0));
        if self.params.top_k > 0 && self.params.top_k < cand.len() {
            cand.select_nth_unstable_by(self.params.top_k - 1, order);
            cand.truncate(self.params.top_k);
        }
        cand.sort_by(order);
        let max = cand[0].1;
        let mut probs: Vec<f64> = cand.iter().map(|c| (c.1 - max).exp()).collect();
        let sum: f64 = probs.iter().sum();
        for p in &mut probs {
            *p /= sum;
        }
        if self.params.top_p < 1.0 {
            let mut acc = 0.0;
            let mut keep = probs.len();
            for (i, p) in probs.iter().enumerate() {
                acc += p;
                if acc >= self.params.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
            probs.truncate(keep.max(1));
            let s: f64 = probs.iter().sum();
            for p in &mut probs {
                *p /= s;
            }
        }
        Dist(cand.into_iter().zip(probs).map(|(c, p)| (c.0, p)).collect())
    }
}

/// A sampling distribution: (token id, probability) pairs, most likely first, summing to 1;
/// tokens not listed have probability 0.
#[derive(Debug, Clone, PartialEq)]
pub struct Dist(pub Vec<(u32, f64)>);

impl Dist {
    /// The probability of `id`.
    pub fn prob(&self, id: u32) -> f64 {
        self.0.iter().find(|c| c.0 == id).map_or(0.0, |c| c.1)
    }

    /// All mass on `id` (a deterministic draft: prompt lookup, or a greedy draft model).
    pub fn one(id: u32) -> Dist {
        Dist(vec![(id, 1.0)])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argmax_prefers_lowest_index_and_skips_nan() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
        assert_eq!(argmax(&[f32::NAN, 0.5, 0.1]), 1);
        assert_eq!(argmax(&[-1.0, -0.5]), 1);
        assert_eq!(argmax(&[f32::NAN, f32::NAN]), 0);
    }

    #[test]
    fn same_seed_same_draws_and_top_k_limits_support() {
        let logits: Vec<f32> = (0..100).map(|i| ((i * 37) % 100) as f32 / 10.0).collect();
        let p = SamplingParams { temperature: 1.0, top_k: 5, top_p: 1.0, seed: 42 };
        let a: Vec<u32> = {
            let mut s = Sampler::new(p);
            (0..200).map(|_| s.sample(&logits)).collect()
        };
        let b: Vec<u32> = {
            let mut s = Sampler::new(p);
            (0..200).map(|_| s.sample(&logits)).collect()
        };
        assert_eq!(a, b);
        let mut top5: Vec<u32> = (0..100u32).collect();
        top5.sort_by(|&x, &y| logits[y as usize].partial_cmp(&logits[x as usize]).unwrap());
        top5.truncate(5);
        assert!(a.iter().all(|t| top5.contains(t)));
        let distinct: std::collections::BTreeSet<_> = a.iter().collect();
        assert!(distinct.len() > 1, "temperature 1 should not be greedy");
    }

    #[test]
    fn top_p_keeps_the_nucleus() {
        // Probabilities ~ [0.5, 0.25, 0.125, ...]: p = 0.7 keeps the first two.
        let logits: Vec<f32> = (0..10).map(|i| -(i as f32) * std::f32::consts::LN_2).collect();
        let mut s = Sampler::new(SamplingParams { temperature: 1.0, top_k: 0, top_p: 0.7, seed: 7 });
        for _ in 0..500 {
            assert!(s.sample(&logits) <= 1);
        }
    }

    #[test]
    fn sampling_from_the_top_pairs_equals_sampling_the_row() {
        // Ties included: ids order equal logits.
        let logits: Vec<f32> = (0..500).map(|i| ((i * 7919) % 97) as f32 / 9.0).collect();
        for (top_k, top_p, t) in [(40, 1.0, 0.8), (64, 0.9, 1.2), (1, 1.0, 1.0), (7, 0.5, 0.3)] {
            let p = SamplingParams { temperature: t, top_k, top_p, seed: 3 };
            let mut order: Vec<(u32, f32)> = logits.iter().enumerate().map(|(i, &v)| (i as u32, v)).collect();
            order.sort_by(|a, b| b.1.partial_cmp(&a.1).unwrap().then(a.0.cmp(&b.0)));
            order.truncate(64);
            let (mut a, mut b) = (Sampler::new(p), Sampler::new(p));
            assert!(a.fits_top(64) || p.is_greedy());
            for _ in 0..300 {
                assert_eq!(a.sample(&logits), b.sample_top(&order), "top_k {top_k} top_p {top_p}");
            }
        }
    }

    #[test]
    fn sampling_frequencies_follow_the_distribution() {
        let logits = [0.0f32, (3.0f32).ln()]; // p = [0.25, 0.75]
        let mut s = Sampler::new(SamplingParams { temperature: 1.0, top_k: 0, top_p: 1.0, seed: 1 });
        let n = 20000;
        let ones = (0..n).filter(|_| s.sample(&logits) == 1).count() as f64 / n as f64;
        assert!((ones - 0.75).abs() < 0.02, "{ones}");
    }
}

/// A sampled token's log-probability and the row's most likely alternatives, from the
/// model's raw logits (before temperature; over the tokens a constraint allows).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct TokenLogprob {
    pub id: u32,
    pub logprob: f32,
    /// The `k` best (id, log-probability), best first.
    pub top: Vec<(u32, f32)>,
}

/// Log-probabilities of row `r` of a step's output for the sampled `token` and the `k` best
/// alternatives: from the GPU's top pairs and logsumexp (`Want::TopK`: 512 bytes read back),
/// or from the full logits row. `None` when the step read back neither, or the token is not
/// among the top pairs.
pub fn token_logprob(out: &crate::model::forward::StepOutput, r: usize, vocab: usize, token: u32, k: usize) -> Option<TokenLogprob> {
    if let (Some(top), Some(lse)) = (&out.top, &out.lse) {
        let (row, lse) = (top.get(r)?, *lse.get(r)?);
        let chosen = row.iter().find(|p| p.0 == token)?.1 - lse;
        return Some(TokenLogprob { id: token, logprob: chosen, top: row.iter().take(k).map(|&(i, v)| (i, v - lse)).collect() });
    }
    let row = out.logits.as_ref()?.get(r * vocab..(r + 1) * vocab)?;
    let m = row.iter().copied().filter(|v| v.is_finite()).fold(f32::MIN, f32::max) as f64;
    let lse = (m + row.iter().filter(|v| v.is_finite()).map(|&v| (v as f64 - m).exp()).sum::<f64>().ln()) as f32;
    let mut best: Vec<(u32, f32)> = row.iter().enumerate().filter(|(_, v)| v.is_finite()).map(|(i, &v)| (i as u32, v)).collect();
    let k = k.min(best.len());
    if k > 0 {
        best.select_nth_unstable_by(k - 1, |a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        best.truncate(k);
        best.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    } else {
        best.clear();
    }
    Some(TokenLogprob { id: token, logprob: row.get(token as usize)? - lse, top: best.into_iter().map(|(i, v)| (i, v - lse)).collect() })
}

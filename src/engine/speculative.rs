//! Speculative decoding: a cheap drafter proposes k tokens, the target model runs the last
//! accepted token and the k drafts as one step through the paged cache (every weight read
//! once for k + 1 tokens), and a verification rule keeps the output exactly what the target
//! alone would produce.
//!
//! - Drafters: prompt lookup ([`lookup`]: the continuation of the longest recent n-gram
//!   match in the prompt and the text so far; no second model) or a draft model sharing the
//!   target's tokenizer ([`draft_tokens`], which keeps the draft's own cache in step).
//! - Greedy ([`verify_greedy`]): drafts are accepted while they equal the target's argmax;
//!   the first mismatch is replaced by the target's choice, and when all are accepted the
//!   target's next token comes free. Token for token the output of plain greedy decoding.
//! - Sampling ([`verify_sampled`]): drafter-invariant verification. Each output position
//!   takes exactly one uniform number from the request's generator, as plain sampling does:
//!   the target's token there is the draw of that number from the target's distribution p
//!   (temperature, top-k, top-p applied), and a draft is accepted when it equals that token.
//!   The output is therefore token for token what plain sampling with the same seed emits,
//!   whatever was drafted, whatever the batch, preemption or draft length was. For a
//!   deterministic draft (prompt lookup, one-hot q) this is exactly the rejection rule of
//!   Leviathan et al. 2023 (accept with probability p(d), else draw from p without d). A
//!   draft model draws its drafts with the same numbers (the request's generator, read ahead
//!   on a copy), so a draft and the target agree wherever their distributions put the number
//!   in the same token: an acceptance rate a little below the rejection rule's sum of
//!   min(p, q), bought for outputs that never depend on the drafter (the coupling of Daliri
//!   et al. 2024, "drafter-invariant speculative decoding", with inverse-CDF draws).
//! - Rejected positions are rolled back in the cache by truncating the sequence (whole pages
//!   past the new length are freed, the block table shrinks with them).
//! - [`DraftLength`] picks k per step from the measured acceptance rate and the measured
//!   cost of draft tokens and of verify steps of each width, unless k is fixed.
//!
//! The single-sequence loop (`generate`) and the batching engine (`Engine`) both use these
//! pieces; the engine puts speculative and plain sequences into the same target step.

use super::sampler::{Dist, Sampler};
use crate::model::forward::{DraftMemory, GpuModel, StepOutput, Want};
use crate::model::tokenizer::Tokenizer;
use crate::model::ModelConfig;
use crate::{LanternError, Result};

/// Where drafts come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Drafter {
    /// No speculation.
    #[default]
    Off,
    /// n-gram lookup in the prompt and the output so far.
    Lookup,
    /// A smaller model with the same tokenizer (loaded by the caller).
    Model,
}

/// A request's speculative decoding settings.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Speculation {
    pub drafter: Drafter,
    /// Draft tokens per step: `Some(k)` fixed (`Some(0)`: no speculation, plain decoding),
    /// `None`: adaptive, 1 to `max_draft`.
    pub draft_tokens: Option<usize>,
    /// Most draft tokens per step when adaptive.
    pub max_draft: usize,
    /// Longest n-gram prompt lookup matches (shorter ones are tried after, down to 1).
    pub lookup_ngram: usize,
}

impl Default for Speculation {
    fn default() -> Self {
        Speculation { drafter: Drafter::Off, draft_tokens: None, max_draft: 8, lookup_ngram: 3 }
    }
}

impl Speculation {
    /// Prompt lookup, adaptive k.
    pub fn lookup() -> Self {
        Speculation { drafter: Drafter::Lookup, ..Default::default() }
    }

    /// A draft model, adaptive k.
    pub fn draft_model() -> Self {
        Speculation { drafter: Drafter::Model, ..Default::default() }
    }

    /// Whether any token will be drafted.
    pub fn enabled(&self) -> bool {
        self.drafter != Drafter::Off && self.draft_tokens != Some(0) && self.max_draft > 0
    }
}

/// Counts for one draft length.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct KStats {
    pub k: usize,
    pub steps: usize,
    pub proposed: usize,
    pub accepted: usize,
}

/// What speculation did for one request.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct SpecStats {
    pub drafter: Drafter,
    /// Verify steps (target steps that carried drafts).
    pub steps: usize,
    /// Target steps without drafts (no lookup match, or no room to draft).
    pub plain_steps: usize,
    pub proposed: usize,
    pub accepted: usize,
    /// accepted / proposed.
    pub acceptance_rate: f64,
    /// Output tokens per target step (1 without speculation).
    pub tokens_per_step: f64,
    /// Wall time of drafting (draft-model steps or lookups).
    pub draft_ms: f64,
    /// Wall time of the target's verify steps.
    pub verify_ms: f64,
    /// Per draft length used.
    pub by_k: Vec<KStats>,
    /// Milliseconds spent measuring step costs before the request (`step_costs::ensure`; 0
    /// when they were known).
    pub warmup_ms: f64,
    /// The speedup over plain decoding that the chosen k's were expected to give (mean over
    /// target steps, plain steps counting 1), from the measured costs and acceptance.
    pub expected_gain: f64,
    /// The speedup they gave: output tokens per millisecond of drafting and target steps,
    /// against one plain step's measured cost ([`Self::plain_step_ms`]).
    pub measured_gain: f64,
    /// The target's one-token step as measured here (the plain decoding it is compared with).
    pub plain_step_ms: f64,
    /// Why the request decoded without drafting, when it did.
    pub plain_reason: Option<String>,
    #[serde(skip)]
    expected_sum: f64,
}

impl SpecStats {
    pub fn new(drafter: Drafter) -> Self {
        SpecStats { drafter, ..Default::default() }
    }

    /// The k chosen for the step about to be recorded was expected to give `gain`.
    pub fn expect(&mut self, gain: f64) {
        if gain.is_finite() {
            self.expected_sum += gain;
        }
    }

    /// Close the figures: the plain step they are compared with cost `plain_step_ms`.
    pub fn finish(&mut self, plain_step_ms: Option<f64>) {
        let steps = self.steps + self.plain_steps;
        if steps > 0 {
            self.expected_gain = self.expected_sum / steps as f64;
        }
        let spent = self.draft_ms + self.verify_ms;
        if let (Some(p), true) = (plain_step_ms, spent > 0.0) {
            self.plain_step_ms = p;
            self.measured_gain = (self.accepted + steps) as f64 / spent * p;
        }
    }

    /// Count one verify step that proposed `k` drafts and accepted `accepted`.
    pub fn record(&mut self, k: usize, accepted: usize, draft_ms: f64, verify_ms: f64) {
        self.draft_ms += draft_ms;
        self.verify_ms += verify_ms;
        if k == 0 {
            self.plain_steps += 1;
        } else {
            self.steps += 1;
            self.proposed += k;
            self.accepted += accepted;
            let e = match self.by_k.iter_mut().position(|e| e.k == k) {
                Some(i) => &mut self.by_k[i],
                None => {
                    self.by_k.push(KStats { k, ..Default::default() });
                    self.by_k.sort_by_key(|e| e.k);
                    let i = self.by_k.iter().position(|e| e.k == k).expect("just added");
                    &mut self.by_k[i]
                }
            };
            e.steps += 1;
            e.proposed += k;
            e.accepted += accepted;
        }
        self.acceptance_rate = if self.proposed > 0 { self.accepted as f64 / self.proposed as f64 } else { 0.0 };
        let steps = self.steps + self.plain_steps;
        let tokens = self.accepted + steps;
        self.tokens_per_step = if steps > 0 { tokens as f64 / steps as f64 } else { 0.0 };
    }
}

/// Chooses k per step: the k in 0..=max that maximises expected tokens per millisecond,
/// E(k) / (draft_ms(k) + verify_ms(k + 1)), where E(k) = 1 + a + ... + a^k for the
/// per-token acceptance probability a (decayed counts of accepts and rejects),
/// draft_ms(k) the measured cost of drafting k tokens and verify_ms(w) the measured cost
/// of a target step of w tokens; k = 0 is a plain step (E = 1, no drafting), so a request
/// drafts only where drafting is expected to pay. Drafting is a fixed cost (its first draft
/// step also takes the token the target emitted last) plus one draft step per further token,
/// so draft_ms(k) is measured per k and extended linearly to k not yet measured (through the
/// two nearest measured k, or from the draft model's measured one- and two-token steps).
/// An unmeasured width is assumed expensive, not cheap: it costs what the next measured
/// width above it does, and past the widest measured one, proportionally more
/// (`step_costs::ensure` measures the widths that matter before a request's first draft).
/// A draft model's acceptance cannot be observed without drafting, so after
/// [`Self::PROBE_AFTER`] plain steps it drafts once if that would pay at a high acceptance.
#[derive(Debug, Clone)]
pub struct DraftLength {
    fixed: Option<usize>,
    max: usize,
    /// Whether plain steps teach nothing about acceptance (a draft model: its draft is not
    /// made at k = 0), so a long run of them ends in a probe. Prompt lookup's unverified
    /// draft is still checked against the target's token ([`Self::observe`]).
    probes: bool,
    /// Plain steps since the last verify step.
    plain_run: usize,
    accepts: f64,
    trials: f64,
    /// Index: k; EMA of the measured milliseconds of drafting k tokens.
    draft_ms: Vec<Option<f64>>,
    /// The draft model's one-token step (a draft token after the first) and two-token step
    /// (the first draft step: the target's last token and the first draft).
    draft_token_ms: Option<f64>,
    draft_first_ms: Option<f64>,
    /// Index: step width (tokens); EMA of measured milliseconds.
    verify_ms: Vec<Option<f64>>,
}

impl DraftLength {
    /// Weight of the past in the decayed acceptance counts and the cost averages.
    const DECAY: f64 = 0.9;

    pub fn new(s: &Speculation) -> Self {
        let max = s.draft_tokens.unwrap_or(s.max_draft).max(1);
        DraftLength {
            fixed: s.draft_tokens,
            max,
            probes: s.drafter == Drafter::Model,
            plain_run: 0,
            accepts: 0.0,
            trials: 0.0,
            draft_ms: vec![None; max + 1],
            draft_token_ms: None,
            draft_first_ms: None,
            verify_ms: vec![None; max + 2],
        }
    }

    /// A draft that was not verified (a plain step) turned out right or wrong: one more
    /// trial for the acceptance estimate.
    pub fn observe(&mut self, hit: bool) {
        self.accepts = Self::DECAY * self.accepts + f64::from(u8::from(hit));
        self.trials = Self::DECAY * self.trials + 1.0;
    }

    /// A plain step of a lookup request produced `token` after `history`: check the draft
    /// lookup would have made ([`Self::observe`]), so the estimate keeps learning at k = 0.
    pub fn observe_lookup(&mut self, s: &Speculation, history: &[u32], token: u32) {
        if s.drafter == Drafter::Lookup {
            if let Some(&d) = lookup(history, 1, s.lookup_ngram).first() {
                self.observe(d == token);
            }
        }
    }

    /// Start from what was measured: the target's step costs by width and the draft model's
    /// one- and two-token steps. `GpuModel::step_costs`.
    pub fn with_costs(mut self, target: &[Option<f64>], draft: Option<&[Option<f64>]>) -> Self {
        for (w, v) in target.iter().enumerate().take(self.verify_ms.len()) {
            if v.is_some() {
                self.verify_ms[w] = *v;
            }
        }
        if let Some(d) = draft {
            self.draft_token_ms = d.get(1).copied().flatten();
            self.draft_first_ms = d.get(2).copied().flatten();
        }
        self
    }

    /// Most trials a remembered acceptance counts for at a request's start: enough to start
    /// near the k earlier requests settled on, few enough that this request's own steps
    /// outweigh it within a step or two.
    const PRIOR_TRIALS: f64 = 6.0;

    /// Start from what earlier requests learned ([`DraftMemory`]): the cost of drafting each
    /// k, and the acceptance estimate, its weight capped at [`Self::PRIOR_TRIALS`] trials.
    pub fn with_memory(mut self, m: &DraftMemory) -> Self {
        for (k, v) in m.draft_ms.iter().enumerate().take(self.draft_ms.len()) {
            if v.is_some() {
                self.draft_ms[k] = *v;
            }
        }
        if m.trials > 0.0 {
            let scale = (Self::PRIOR_TRIALS / m.trials).min(1.0);
            self.accepts = m.accepts * scale;
            self.trials = m.trials * scale;
        }
        self
    }

    /// Write what this request learned into `m`, for the requests after it.
    pub fn remember(&self, m: &mut DraftMemory) {
        if m.draft_ms.len() < self.draft_ms.len() {
            m.draft_ms.resize(self.draft_ms.len(), None);
        }
        for (k, v) in self.draft_ms.iter().enumerate() {
            if v.is_some() {
                m.draft_ms[k] = *v;
            }
        }
        if self.trials > 0.0 {
            m.accepts = self.accepts;
            m.trials = self.trials;
        }
    }

    /// Milliseconds of drafting `k` tokens: measured, else linear through the two nearest
    /// measured k (slope at least 0), else from the one measured k at a draft token's cost
    /// per further token, else a two-token draft step and k - 1 one-token ones, else `k`
    /// draft tokens (0 where nothing is known: lookup).
    fn draft_estimate(&self, k: usize) -> f64 {
        if k == 0 {
            return 0.0;
        }
        let measured: Vec<(usize, f64)> = self.draft_ms.iter().enumerate().filter_map(|(j, v)| v.map(|v| (j, v))).collect();
        if let Some(&(_, v)) = measured.iter().find(|m| m.0 == k) {
            return v;
        }
        let mut near = measured;
        near.sort_by_key(|m| m.0.abs_diff(k));
        let line = |(j, v): (usize, f64), slope: f64| (v + (k as f64 - j as f64) * slope).max(0.0);
        match near.as_slice() {
            [] => match (self.draft_first_ms, self.draft_token_ms) {
                (Some(f), Some(t)) => f + (k - 1) as f64 * t,
                (_, t) => k as f64 * t.unwrap_or(0.0),
            },
            [one] => line(*one, self.draft_token_ms.unwrap_or(one.1 / one.0 as f64)),
            [a, b, ..] => line(*a, ((b.1 - a.1) / (b.0 as f64 - a.0 as f64)).max(0.0)),
        }
    }

    /// Most tokens a step may draft.
    pub fn max(&self) -> usize {
        self.fixed.unwrap_or(self.max)
    }

    /// The per-token acceptance probability now estimated (a prior of 1 in 2 at the start).
    pub fn acceptance(&self) -> f64 {
        (self.accepts + 1.0) / (self.trials + 2.0)
    }

    /// Plain steps in a row after which a draft model drafts once to learn its acceptance
    /// again (where drafting would pay at [`Self::PROBE_ACCEPTANCE`]).
    pub const PROBE_AFTER: usize = 16;
    const PROBE_ACCEPTANCE: f64 = 0.9;

    /// Expected tokens per millisecond of a step drafting `k` at acceptance `a`.
    fn rate(&self, k: usize, a: f64) -> f64 {
        let expected: f64 = (0..=k).map(|i| a.powi(i as i32)).sum();
        expected / (self.draft_estimate(k) + self.verify_estimate(k + 1)).max(1e-6)
    }

    /// The k in 0..=top with the best rate at acceptance `a`, and that rate.
    fn best(&self, top: usize, a: f64) -> (usize, f64) {
        let mut best = (0, self.rate(0, a));
        for k in 1..=top {
            let r = self.rate(k, a);
            if r > best.1 * (1.0 + 1e-9) {
                best = (k, r);
            }
        }
        best
    }

    /// Draft tokens for the next step, at most `limit` (the tokens left to generate less
    /// one, the context's room, and for lookup the continuation it found).
    pub fn next(&self, limit: usize) -> usize {
        if let Some(k) = self.fixed {
            return k.min(limit);
        }
        let top = self.max.min(limit);
        if top == 0 {
            return 0;
        }
        let k = self.best(top, self.acceptance()).0;
        if k == 0 && self.probes && self.plain_run >= Self::PROBE_AFTER {
            return self.best(top, Self::PROBE_ACCEPTANCE).0;
        }
        k
    }

    /// The expected speedup of drafting `k` over a plain step (tokens per millisecond, at
    /// the acceptance now estimated).
    pub fn gain(&self, k: usize) -> f64 {
        let a = self.acceptance();
        self.rate(k, a) / self.rate(0, a).max(1e-12)
    }

    /// Whether no k up to `limit` can pay here even if every draft were accepted: the
    /// measured verify and draft costs rule speculation out for this request (it then
    /// decodes plainly). Never for a fixed k.
    pub fn hopeless(&self, limit: usize) -> bool {
        self.fixed.is_none() && self.best(self.max.min(limit), 1.0).0 == 0
    }

    /// Milliseconds of a target step of `w` tokens: measured, else what the next measured
    /// width above costs (the same kernel passes, or more), else past the widest measured
    /// width proportionally more than it; 1 per token where nothing is measured.
    fn verify_estimate(&self, w: usize) -> f64 {
        let measured = |i: usize| self.verify_ms.get(i).copied().flatten();
        if let Some(v) = measured(w) {
            return v;
        }
        if let Some(v) = (w + 1..self.verify_ms.len()).find_map(measured) {
            return v;
        }
        match (1..w).rev().find_map(|i| measured(i).map(|v| (i, v))) {
            Some((i, v)) => v * w as f64 / i as f64,
            None => w as f64,
        }
    }

    /// Learn from a step: `k` drafted (0: a plain step), `accepted` of them kept, the draft
    /// milliseconds and the target step's milliseconds.
    pub fn record(&mut self, k: usize, accepted: usize, draft_ms: f64, step_ms: f64) {
        let ema = |old: Option<f64>, new: f64| Some(old.map_or(new, |o| Self::DECAY * o + (1.0 - Self::DECAY) * new));
        if let Some(slot) = self.verify_ms.get_mut(k + 1) {
            *slot = ema(*slot, step_ms);
        }
        self.plain_run = if k == 0 { self.plain_run + 1 } else { 0 };
        if k > 0 {
            if let Some(slot) = self.draft_ms.get_mut(k) {
                *slot = ema(*slot, draft_ms);
            }
            let rejected = usize::from(accepted < k);
            self.accepts = Self::DECAY * self.accepts + accepted as f64;
            self.trials = Self::DECAY * self.trials + (accepted + rejected) as f64;
        }
    }
}

/// Why a request with `s` should not draft at all, given the target's measured step costs
/// by width and the draft model's (`None` for lookup, or when unknown: drafts then count as
/// free): no k up to `room` could pay even with every draft accepted
/// ([`DraftLength::hopeless`]). The reason names the costs.
pub fn why_plain(s: &Speculation, target: &[Option<f64>], draft: Option<&[Option<f64>]>, room: usize) -> Option<String> {
    if !DraftLength::new(s).with_costs(target, draft).hopeless(room) {
        return None;
    }
    let cost = |w: usize| target.get(w).copied().flatten().map_or("unmeasured".to_string(), |v| format!("{v:.1} ms"));
    let draft_token = draft.and_then(|d| d.get(1).copied().flatten()).map(|d| format!(", a draft token {d:.1} ms")).unwrap_or_default();
    Some(format!(
        "drafting cannot pay on this adapter even if every draft were accepted: a target step costs {} for 1 token, {} for 2, {} for 4, {} for 8{draft_token}",
        cost(1),
        cost(2),
        cost(4),
        cost(8)
    ))
}

impl SpecStats {
    /// The statistics of a request that decoded `decoded` tokens plainly in `decode_ms`
    /// because drafting could not pay (`reason`; [`why_plain`]), against a measured plain
    /// step of `plain_step_ms`.
    pub fn unspeculated(drafter: Drafter, reason: String, decoded: usize, decode_ms: f64, plain_step_ms: Option<f64>) -> SpecStats {
        let mut s = SpecStats::new(drafter);
        for _ in 0..decoded {
            s.record(0, 0, 0.0, 0.0);
            s.expect(1.0);
        }
        s.verify_ms = decode_ms;
        s.plain_reason = Some(reason);
        s.finish(plain_step_ms);
        s
    }
}

/// Where a request with `drafter` keeps what it learns ([`DraftMemory`]): on the draft
/// model for its drafts, on the target otherwise (prompt lookup).
pub fn memory<'a>(drafter: Drafter, target: &'a GpuModel, draft: Option<&'a GpuModel>) -> &'a DraftMemory {
    match (drafter, draft) {
        (Drafter::Model, Some(d)) => &d.draft_memory,
        _ => &target.draft_memory,
    }
}

/// [`memory`], to write.
pub fn memory_mut<'a>(drafter: Drafter, target: &'a mut GpuModel, draft: Option<&'a mut GpuModel>) -> &'a mut DraftMemory {
    match (drafter, draft) {
        (Drafter::Model, Some(d)) => &mut d.draft_memory,
        _ => &mut target.draft_memory,
    }
}

/// The most tokens a sequence may draft for its next step: every draft may be emitted, plus
/// the target's own next token, within `max_tokens` (of which `out_len` are out), the
/// context (the cache holds `held - 1` tokens and the step adds 1 + k) and the step's logit
/// rows.
pub fn draft_limit(max_tokens: usize, out_len: usize, held: usize, context: usize, logit_rows: usize) -> usize {
    max_tokens.saturating_sub(out_len + 1).min(context.saturating_sub(held)).min(logit_rows.saturating_sub(1))
}

/// Prompt lookup: the tokens that followed the most recent earlier occurrence of the
/// longest suffix of `history` (n-grams of `max_ngram` tokens down to 1), at most `k` of
/// them; empty when nothing matches.
pub fn lookup(history: &[u32], k: usize, max_ngram: usize) -> Vec<u32> {
    let len = history.len();
    if k == 0 || len < 2 {
        return Vec::new();
    }
    for n in (1..=max_ngram.min(len - 1)).rev() {
        let tail = &history[len - n..];
        // Occurrences ending before the suffix itself, the most recent first.
        if let Some(i) = (0..len - n).rev().find(|&i| &history[i..i + n] == tail) {
            let start = i + n;
            return history[start..(start + k).min(len)].to_vec();
        }
    }
    Vec::new()
}

/// What verification kept: how many drafts were accepted, and the tokens to emit (the
/// accepted drafts, then the target's correction or, when all were accepted, its next
/// token). Always at least one token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    pub accepted: usize,
    pub tokens: Vec<u32>,
}

/// Greedy verification: `argmax[i]` is the target's choice after the last accepted token
/// and drafts `0..i` (so `argmax.len() == drafts.len() + 1`).
pub fn verify_greedy(drafts: &[u32], argmax: &[u32]) -> Verdict {
    let mut tokens = Vec::with_capacity(drafts.len() + 1);
    for (i, &d) in drafts.iter().enumerate() {
        let t = argmax[i];
        tokens.push(t);
        if t != d {
            return Verdict { accepted: i, tokens };
        }
    }
    tokens.push(argmax[drafts.len()]);
    Verdict { accepted: drafts.len(), tokens }
}

/// Sampled verification (drafter-invariant): `p[i]` is the target's distribution after the
/// last accepted token and drafts `0..i` (`p.len() == drafts.len() + 1`; the last is the
/// bonus position). Each position's token is one draw from `p[i]` with the next uniform
/// number of `sampler`'s generator, exactly as plain sampling would draw it; draft `i` is
/// accepted when it equals that token, and the first that does not ends the verdict with the
/// target's token in its place. One uniform number is taken per emitted token.
pub fn verify_sampled(drafts: &[u32], p: &[Dist], sampler: &mut Sampler) -> Verdict {
    let mut tokens = Vec::with_capacity(drafts.len() + 1);
    for (i, &d) in drafts.iter().enumerate() {
        let t = sampler.draw_from(&p[i]);
        tokens.push(t);
        if t != d {
            return Verdict { accepted: i, tokens };
        }
    }
    tokens.push(sampler.draw_from(&p[drafts.len()]));
    Verdict { accepted: drafts.len(), tokens }
}

/// What a step must read back for `sampler`'s tokens, drafted and verified tokens
/// included: the argmax kernel's choices alone when greedy or drawing from the whole
/// vocabulary on the GPU (verification then compares the drafts with those draws), the GPU
/// top-k when the sampler's top-k fits in it, else the logits.
pub fn want_for(sampler: &Sampler) -> Want {
    if sampler.gpu_chooses() {
        Want::Argmax
    } else if sampler.fits_top(crate::kernels::topk::TOPK_MAX) {
        Want::TopK
    } else {
        Want::Logits
    }
}

/// The wider of two readbacks (a step serving several samplers reads what the most
/// demanding needs).
pub fn wider(a: Want, b: Want) -> Want {
    let rank = |w: Want| match w {
        Want::Argmax => 0,
        Want::TopK => 1,
        Want::Logits => 2,
    };
    if rank(b) > rank(a) {
        b
    } else {
        a
    }
}

/// The distribution `sampler` draws from at output row `r` of a step.
pub fn dist_at(out: &StepOutput, r: usize, vocab: usize, sampler: &Sampler) -> Dist {
    if sampler.params.is_greedy() {
        return Dist::one(out.argmax[r]);
    }
    match (&out.logits, &out.top) {
        (Some(l), _) => sampler.distribution(&l[r * vocab..(r + 1) * vocab]),
        (None, Some(t)) => sampler.distribution_top(&t[r]),
        (None, None) => Dist::one(out.argmax[r]),
    }
}

/// One sequence's drafting in a draft-model round: its slot in the draft model's cache,
/// the tokens so far (prompt and output; the last is not yet in the target's cache), how
/// many to draft, and a copy of the request's sampler (its generator where the request's
/// stands now: draft `i` is drawn with the number the target's position `i` will take).
/// [`draft_tokens`] fills `tokens`.
pub struct DraftJob<'a> {
    pub slot: usize,
    pub history: &'a [u32],
    pub k: usize,
    pub sampler: Sampler,
    /// The output index of the first drafted token (the request's output length): a sampler
    /// drawing on the GPU drafts with the draws the target verifies with.
    pub index: usize,
    pub tokens: Vec<u32>,
}

/// Draft `job.k` tokens for each job on the draft model, batched: the tokens each draft
/// cache lacks go in one step (long catch-ups, such as a prompt, first run alone in chunks),
/// then one token per job per step. A job whose draft cache is full stops drafting (it
/// keeps what it has). Drafts follow each job's sampler: the argmax when greedy; when drawing
/// on the GPU (no top-k), the draft's Gumbel-max draw with the noise the target's draw
/// at that position takes (coupled draws: where the two models agree the draft is the
/// target's token); else a draw from the sampler's distribution over the draft's logits
/// with the generator's next number (the one [`verify_sampled`] gives the target there).
/// Bring each draft sequence up to its history but the last token where it lags by more
/// than a step's catch-up (a new request's prompt): the draft model's prefill, which callers
/// run before timing [`draft_tokens`] so it does not count as the cost of draft tokens (it
/// once made the adaptive k see a draft token at twice its cost and stay at k = 1).
pub async fn catch_up(draft: &mut GpuModel, jobs: &[(usize, &[u32])]) -> Result<()> {
    for &(slot, history) in jobs {
        let len = draft.sequence_len(slot)?;
        if len + 2 < history.len() {
            draft.forward(slot, &history[len..history.len() - 1], Want::Argmax).await?;
        }
    }
    Ok(())
}

pub async fn draft_tokens(draft: &mut GpuModel, jobs: &mut [DraftJob<'_>]) -> Result<()> {
    let vocab = draft.config.vocab_size;
    let max_step = draft.options.max_batch_tokens.max(1);
    // Catch up: every job's cache must hold all of its history but the last token.
    let mut pending: Vec<usize> = Vec::with_capacity(jobs.len());
    for j in jobs.iter() {
        let len = draft.sequence_len(j.slot)?;
        if len >= j.history.len() {
            return Err(LanternError::InvalidRequest(format!(
                "draft sequence {} holds {len} tokens, more than the {} before the last one",
                j.slot,
                j.history.len() - 1
            )));
        }
        pending.push(j.history.len() - len);
    }
    let total: usize = pending.iter().sum();
    if total > max_step {
        for (j, p) in jobs.iter().zip(pending.iter_mut()) {
            if *p > 1 && j.k > 0 {
                let len = j.history.len() - *p;
                draft.forward(j.slot, &j.history[len..j.history.len() - 1], Want::Argmax).await?;
                *p = 1;
            }
        }
    }
    let rounds = jobs.iter().map(|j| j.k).max().unwrap_or(0);
    let mut active: Vec<bool> = jobs.iter().map(|j| j.k > 0).collect();
    for round in 0..rounds {
        let (mut ids, mut positions, mut seqs, mut rows) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut want = Want::Argmax;
        let mut draws = Vec::new();
        let mut members = Vec::new();
        for (i, j) in jobs.iter_mut().enumerate() {
            if !active[i] || j.tokens.len() >= j.k || rows.len() >= draft.logit_rows {
                active[i] = false;
                continue;
            }
            let feed: Vec<u32> = if round == 0 {
                j.history[j.history.len() - pending[i]..].to_vec()
            } else {
                vec![*j.tokens.last().expect("a token per earlier round")]
            };
            if ids.len() + feed.len() > max_step || draft.check_fits(j.slot, feed.len()).is_err() {
                active[i] = false;
                continue;
            }
            let start = draft.kv.alloc.append(j.slot, feed.len()).map_err(LanternError::Kv)?;
            for (o, &t) in feed.iter().enumerate() {
                ids.push(t);
                positions.push((start + o) as u32);
                seqs.push(j.slot as u32);
            }
            rows.push(ids.len() as u32 - 1);
            want = wider(want, want_for(&j.sampler));
            draws.push(j.sampler.row_draw(j.index + round));
            members.push(i);
        }
        if members.is_empty() {
            break;
        }
        let ops = crate::model::forward::LogitOps { draws, ..Default::default() };
        let out = draft.step_batch_with(&ids, &positions, &seqs, &rows, want, ops).await?;
        for (r, &i) in members.iter().enumerate() {
            let j = &mut jobs[i];
            let t = if j.sampler.gpu_chooses() {
                out.argmax[r]
            } else {
                let dist = dist_at(&out, r, vocab, &j.sampler);
                j.sampler.draw_from(&dist)
            };
            j.tokens.push(t);
        }
    }
    Ok(())
}

/// Refuse a draft model that does not share the target's tokenizer: another vocabulary
/// size, or any id whose token differs. `target` and `draft` name the models in the error.
pub fn check_pair(target: (&str, &ModelConfig, &Tokenizer), draft: (&str, &ModelConfig, &Tokenizer)) -> Result<()> {
    let (tn, tc, tt) = target;
    let (dn, dc, dt) = draft;
    let mismatch = |reason: String| Err(LanternError::DraftMismatch { target: tn.to_string(), draft: dn.to_string(), reason });
    if tc.vocab_size != dc.vocab_size || tt.vocab_size() != dt.vocab_size() {
        return mismatch(format!(
            "the target's vocabulary has {} tokens ({} in its tokenizer), the draft's {} ({} in its tokenizer); draft and target must share one tokenizer",
            tc.vocab_size,
            tt.vocab_size(),
            dc.vocab_size,
            dt.vocab_size()
        ));
    }
    for id in 0..tt.vocab_size() as u32 {
        let (a, b) = (tt.id_to_token(id), dt.id_to_token(id));
        if a != b {
            return mismatch(format!(
                "token {id} is {:?} in the target's vocabulary and {:?} in the draft's; draft and target must share one tokenizer",
                a.unwrap_or_default(),
                b.unwrap_or_default()
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::sampler::SamplingParams;

    #[test]
    fn lookup_takes_the_longest_most_recent_match() {
        // ... 1 2 3 [9 9] ... 1 2 3 [7 7] ... 1 2 3 -> the most recent 3-gram: 7 7.
        let h = [1, 2, 3, 9, 9, 5, 1, 2, 3, 7, 7, 6, 1, 2, 3];
        assert_eq!(lookup(&h, 2, 3), vec![7, 7]);
        assert_eq!(lookup(&h, 5, 3), vec![7, 7, 6, 1, 2]);
        // Only a 1-gram matches: 4 ... 4 -> what followed the earlier 4.
        assert_eq!(lookup(&[4, 8, 1, 4], 3, 3), vec![8, 1, 4]);
        // A longer match wins over a more recent shorter one.
        assert_eq!(lookup(&[5, 6, 1, 0, 6, 2, 5, 6], 1, 3), vec![1]);
        assert!(lookup(&[1, 2, 3], 4, 3).is_empty());
        assert!(lookup(&[1, 1], 0, 3).is_empty());
        // Continuations stop at the end of the history.
        assert_eq!(lookup(&[3, 3, 3], 4, 2), vec![3]);
    }

    #[test]
    fn greedy_verdicts() {
        assert_eq!(verify_greedy(&[1, 2, 3], &[1, 2, 3, 4]), Verdict { accepted: 3, tokens: vec![1, 2, 3, 4] });
        assert_eq!(verify_greedy(&[1, 2, 3], &[1, 5, 3, 4]), Verdict { accepted: 1, tokens: vec![1, 5] });
        assert_eq!(verify_greedy(&[1], &[9, 4]), Verdict { accepted: 0, tokens: vec![9] });
        assert_eq!(verify_greedy(&[], &[7]), Verdict { accepted: 0, tokens: vec![7] });
    }

    #[test]
    fn sampled_verification_follows_p_and_emits_what_plain_sampling_does() {
        // The first emitted token follows p whatever the draft, and every verdict's tokens
        // are the draws plain sampling takes from the same generator.
        let p = Dist(vec![(0, 0.6), (1, 0.3), (2, 0.1)]);
        let q = Dist(vec![(2, 0.5), (1, 0.4), (0, 0.1)]);
        let params = SamplingParams { temperature: 1.0, seed: 11, ..Default::default() };
        let mut s = Sampler::new(params);
        let mut plain = Sampler::new(params);
        let mut drafting = Sampler::new(SamplingParams { seed: 99, ..params });
        let mut counts = [0usize; 3];
        let n = 60_000;
        for _ in 0..n {
            let d = [drafting.draw_from(&q), drafting.draw_from(&q)];
            let v = verify_sampled(&d, &[p.clone(), p.clone(), p.clone()], &mut s);
            assert_eq!(v.tokens.len(), v.accepted + 1);
            assert_eq!(v.tokens[..v.accepted], d[..v.accepted]);
            for &t in &v.tokens {
                assert_eq!(t, plain.draw_from(&p), "a verdict's token differs from plain sampling's");
            }
            counts[v.tokens[0] as usize] += 1;
        }
        for (i, &c) in counts.iter().enumerate() {
            let f = c as f64 / n as f64;
            assert!((f - p.prob(i as u32)).abs() < 0.01, "token {i}: {f} against {}", p.prob(i as u32));
        }
        // A draft drawn with the target's own numbers from a close q is mostly accepted.
        let close = Dist(vec![(0, 0.55), (1, 0.35), (2, 0.1)]);
        let mut accepted = 0;
        for _ in 0..n {
            let d = s.clone().draw_from(&close);
            accepted += verify_sampled(&[d], &[p.clone(), p.clone()], &mut s).accepted;
            // (the bonus draw took the next number; the next round reads ahead from here)
        }
        let rate = accepted as f64 / n as f64;
        assert!(rate > 0.9, "coupled drafts accepted at {rate}, below the 0.95 overlap of p and q minus rounding");
    }

    #[test]
    fn fixed_and_adaptive_draft_lengths() {
        let fixed = DraftLength::new(&Speculation { draft_tokens: Some(3), ..Speculation::lookup() });
        assert_eq!(fixed.next(10), 3);
        assert_eq!(fixed.next(2), 2);
        let mut a = DraftLength::new(&Speculation::lookup());
        // Verify steps cost the same at any width and drafts are free: draft the most.
        for k in [1, 4, 8] {
            a.record(k, k, 0.0, 10.0);
        }
        assert_eq!(a.next(100), 8);
        assert_eq!(a.next(3), 3);
        // Every draft rejected, and each extra token in a step costs: a draft model stops
        // drafting, and after PROBE_AFTER plain steps drafts once (a plain step cannot
        // tell it whether its drafts got better), then stops again.
        let mut b = DraftLength::new(&Speculation::draft_model());
        for _ in 0..30 {
            for k in 1..=8 {
                b.record(k, 0, 5.0 * k as f64, 10.0 + 2.0 * k as f64);
            }
        }
        assert!(b.acceptance() < 0.1);
        assert_eq!(b.next(100), 0);
        for _ in 0..DraftLength::PROBE_AFTER {
            assert_eq!(b.next(100), 0);
            b.record(0, 0, 0.0, 10.0);
        }
        let probe = b.next(100);
        assert!(probe > 0);
        b.record(probe, 0, 5.0 * probe as f64, 10.0 + 2.0 * probe as f64);
        assert_eq!(b.next(100), 0);
        assert!(!b.hopeless(100), "drafting would pay at a high acceptance");
        // Drafting is a fixed 60 ms plus 5 ms a token (k = 2 and 4 measured): the estimate
        // for other k follows the line, and k maximises tokens per millisecond against a
        // flat 100 ms verify at a measured acceptance of 0.7.
        let flat: Vec<Option<f64>> = (0..10).map(|w| (w > 0).then_some(100.0)).collect();
        let mut f = DraftLength::new(&Speculation { max_draft: 8, ..Speculation::draft_model() }).with_costs(&flat, None);
        for _ in 0..60 {
            f.record(2, 1, 70.0, 100.0);
            f.record(4, 3, 80.0, 100.0);
        }
        assert!((f.draft_estimate(3) - 75.0).abs() < 1e-9 && (f.draft_estimate(8) - 100.0).abs() < 1e-9);
        assert!((f.draft_estimate(1) - 65.0).abs() < 1e-9);
        let a = f.acceptance();
        let rate = |k: usize| (0..=k).map(|i| a.powi(i as i32)).sum::<f64>() / (60.0 + 5.0 * k as f64 + 100.0);
        let best = (1..=8).max_by(|&x, &y| rate(x).total_cmp(&rate(y))).unwrap();
        assert!(rate(best) > 1.0 / 100.0, "drafting pays here");
        assert_eq!(f.next(100), best);
        // A new request starts from what `f` learned: its draft costs, and its acceptance
        // at the weight of a few trials. It picks `f`'s k where a blind start picks fewer,
        // and its own rejections pull k back down within a few steps.
        let mut memory = DraftMemory::default();
        f.remember(&mut memory);
        let blind =
            DraftLength::new(&Speculation { max_draft: 8, ..Speculation::draft_model() }).with_costs(&flat, Some(&[None, Some(65.0)]));
        let mut warm = blind.clone().with_memory(&memory);
        assert!((warm.acceptance() - f.acceptance()).abs() < 0.05 && warm.trials <= DraftLength::PRIOR_TRIALS);
        assert!((warm.draft_estimate(3) - 75.0).abs() < 1e-9);
        let aw = warm.acceptance();
        let rate = |k: usize| (0..=k).map(|i| aw.powi(i as i32)).sum::<f64>() / (60.0 + 5.0 * k as f64 + 100.0);
        let best = (1..=8).max_by(|&x, &y| rate(x).total_cmp(&rate(y))).unwrap();
        assert_eq!(warm.next(100), best);
        assert!(blind.next(100) < best, "{} {best}", blind.next(100));
        for _ in 0..3 {
            warm.record(best, 0, 60.0 + 5.0 * best as f64, 100.0);
        }
        assert!(warm.next(100) < best);
        // Lookup may stop drafting (k = 0) and starts again when its unverified drafts turn
        // out right.
        // (A two-token step costs 1.2 plain ones: one accepted draft in two would pay.)
        let mut c = DraftLength::new(&Speculation::lookup());
        for _ in 0..30 {
            c.record(1, 0, 0.0, 12.0);
            c.record(0, 0, 0.0, 10.0);
        }
        assert_eq!(c.next(100), 0);
        for _ in 0..40 {
            c.observe(true);
        }
        assert!(c.next(100) > 0);
    }

    #[test]
    fn unmeasured_widths_are_costed_as_expensive() {
        // Measured: 1 token 10 ms, 4 tokens 20 ms. Widths 2-3 cost what 4 does, widths past
        // 4 proportionally more, and with nothing measured a width costs its token count.
        let d = DraftLength::new(&Speculation::lookup()).with_costs(&[None, Some(10.0), None, None, Some(20.0)], None);
        assert_eq!(d.verify_estimate(1), 10.0);
        assert_eq!(d.verify_estimate(2), 20.0);
        assert_eq!(d.verify_estimate(3), 20.0);
        assert_eq!(d.verify_estimate(8), 40.0);
        let blind = DraftLength::new(&Speculation::lookup());
        assert_eq!(blind.verify_estimate(5), 5.0);
        // ... so a blind lookup does not draft (no width is known to be cheap).
        assert_eq!(blind.next(8), 0);
        assert!(blind.hopeless(8));
        // The draft model's one- and two-token steps price drafting before any is measured:
        // a two-token first step, then a token per step.
        let m = DraftLength::new(&Speculation::draft_model()).with_costs(&[], Some(&[None, Some(3.0), Some(5.0)]));
        assert_eq!(m.draft_estimate(1), 5.0);
        assert_eq!(m.draft_estimate(4), 14.0);
    }

    #[test]
    fn speculation_is_hopeless_only_where_no_k_could_pay() {
        // A verify step of w tokens costs w plain steps (a CPU adapter without batched
        // kernels): even all-accepted drafts cannot pay once a draft costs anything.
        let linear: Vec<Option<f64>> = (0..10).map(|w| (w > 0).then_some(10.0 * w as f64)).collect();
        let draft = DraftLength::new(&Speculation::draft_model()).with_costs(&linear, Some(&[None, Some(2.0), Some(3.0)]));
        assert!(draft.hopeless(8));
        assert_eq!(draft.next(8), 0);
        assert!((draft.gain(0) - 1.0).abs() < 1e-12);
        // The same costs with free drafts (lookup) break even at best: still no gain.
        assert!(DraftLength::new(&Speculation::lookup()).with_costs(&linear, None).hopeless(8));
        // Flat verify costs (a GPU): drafting pays, and the expected gain says by how much.
        let flat: Vec<Option<f64>> = (0..10).map(|w| (w > 0).then_some(10.0)).collect();
        let gpu = DraftLength::new(&Speculation::draft_model()).with_costs(&flat, Some(&[None, Some(2.0), Some(3.0)]));
        assert!(!gpu.hopeless(8));
        let k = gpu.next(8);
        assert!(k > 0 && gpu.gain(k) > 1.0, "k {k} gain {}", gpu.gain(k));
        // A fixed k is never dropped.
        let fixed = DraftLength::new(&Speculation { draft_tokens: Some(2), ..Speculation::draft_model() }).with_costs(&linear, None);
        assert!(!fixed.hopeless(8));
        assert_eq!(fixed.next(8), 2);
    }
}

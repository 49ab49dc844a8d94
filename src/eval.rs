//! Evaluation on the GPU: perplexity of a token sequence ([`perplexity`]) and a side-by-side
//! comparison of two models under greedy decoding and teacher forcing ([`compare`]).
//!
//! Everything here works on token ids (tokenization is the caller's business), is `async`
//! like the rest of the library and touches no files, so it also runs in a browser.
//! Log-softmax, NLL and KL are computed in f64 from the f32 logits the GPU returns.
//!
//! # Perplexity
//!
//! Standard next-token perplexity, as Hugging Face's "Perplexity of fixed-length models"
//! guide and `tests/fixtures/smollm2/perplexity.json` define it: for tokens `x_0..x_{T-1}`,
//! `NLL_i = -log softmax(logits[i-1])[x_i]`, the mean over the scored tokens, and
//! `ppl = exp(mean)`. The first token of the text is never scored (nothing predicts it).
//!
//! Windowing ([`Window`]), for texts longer than the model's context:
//! - one window over the whole text (what [`Window::Auto`] picks when the text fits): tokens
//!   `1..T` are scored, `T - 1` in all;
//! - non-overlapping windows of `size` tokens ([`Window::Chunks`]): each window starts with an
//!   empty cache, so its first token has no context and is not scored (`T - windows` scored);
//! - sliding windows ([`Window::Sliding`]), exactly the loop of the Hugging Face guide:
//!   windows of `size` tokens start every `stride` tokens, the first window scores all its
//!   tokens but the first, and every later window scores only the tokens the previous window
//!   did not reach (its last `stride` tokens, fewer for the final one), with the rest of the
//!   window as context. With `stride < size` every token after the first is scored exactly
//!   once, with at least `size - stride` tokens of context once past the first window;
//!   `stride == size` is the same as [`Window::Chunks`].
//!
//! # Comparison
//!
//! See [`compare`] for the definitions of divergence, token agreement, top-1 agreement and KL.

use web_time::Instant;

use crate::engine::sampler::argmax;
use crate::model::forward::{GpuModel, Want};
use crate::Result;

/// Errors of the evaluation functions (model and GPU failures come through as their own
/// [`crate::LanternError`] variants).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EvalError {
    #[error("perplexity needs at least 2 tokens (the first one is not predicted), got {tokens}")]
    TooFewTokens { tokens: usize },
    #[error("a window of {size} tokens does not fit the model's context of {context} tokens")]
    WindowTooLarge { size: usize, context: usize },
    #[error("a window must hold at least 2 tokens, got {size}")]
    WindowTooSmall { size: usize },
    #[error("stride {stride} must be between 1 and the window size {size}")]
    BadStride { stride: usize, size: usize },
    #[error("the models have different vocabularies: {a} tokens (model A) vs {b} tokens (model B)")]
    VocabMismatch { a: usize, b: usize },
    #[error("prompt {index} is empty")]
    EmptyPrompt { index: usize },
    #[error(
        "prompt {index}: {prompt_tokens} prompt tokens + {max_new} new tokens need {needed} positions, \
         but model {model} has a context of {context}"
    )]
    PromptTooLong { index: usize, model: char, prompt_tokens: usize, max_new: usize, needed: usize, context: usize },
}

/// How a text is split into windows for [`perplexity`]. See the module docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Window {
    /// One window over the whole text if it fits the model's context, otherwise
    /// non-overlapping windows of the context length.
    #[default]
    Auto,
    /// Non-overlapping windows of `size` tokens, each starting from an empty cache.
    Chunks { size: usize },
    /// Windows of `size` tokens every `stride` tokens; each scores only the tokens the
    /// previous one did not reach.
    Sliding { size: usize, stride: usize },
}

/// The windowing a [`perplexity`] run actually used.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum WindowMode {
    /// One window over the whole text.
    Single,
    /// Non-overlapping windows.
    Chunks,
    /// Sliding windows with a stride.
    Sliding,
}

/// Windowing used, as reported.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct WindowReport {
    pub mode: WindowMode,
    /// Tokens per window (the last window may be shorter).
    pub size: usize,
    /// Start-to-start distance of sliding windows.
    pub stride: Option<usize>,
    /// Number of windows run.
    pub windows: usize,
}

impl WindowReport {
    /// One line for people, e.g. "sliding windows of 512 tokens, stride 256 (3 windows)".
    pub fn describe(&self) -> String {
        match self.mode {
            WindowMode::Single => format!("one window of {} tokens", self.size),
            WindowMode::Chunks => {
                format!("{} non-overlapping windows of {} tokens (the first token of each is not scored)", self.windows, self.size)
            }
            WindowMode::Sliding => format!(
                "{} sliding windows of {} tokens, stride {} (each scores the tokens the previous one did not reach)",
                self.windows,
                self.size,
                self.stride.unwrap_or(self.size)
            ),
        }
    }
}

/// The negative log-likelihood of one scored token.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct TokenNll {
    /// Position of the token in the text (>= 1).
    pub pos: usize,
    /// Its id.
    pub id: u32,
    /// `-log p(id | context)` in nats.
    pub nll: f64,
}

/// Result of [`perplexity`].
#[derive(Debug, Clone, serde::Serialize)]
pub struct PerplexityReport {
    /// Tokens in the text (T).
    pub token_count: usize,
    /// Tokens scored (T - 1 with one window or sliding windows, T - windows with chunks).
    pub predicted_tokens: usize,
    /// Sum of the scored tokens' NLL, nats.
    pub sum_nll: f64,
    /// `sum_nll / predicted_tokens`, nats.
    pub mean_nll: f64,
    /// `exp(mean_nll)`.
    pub perplexity: f64,
    pub window: WindowReport,
    /// Tokens run through the model, context overlap of sliding windows included.
    pub tokens_evaluated: usize,
    /// Wall time of the whole evaluation.
    pub elapsed_ms: f64,
    /// `tokens_evaluated` per second of wall time.
    pub tokens_per_s: f64,
    /// Every scored token in text order.
    pub per_token: Vec<TokenNll>,
}

/// Work done so far, for progress display.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    /// Tokens run through the model(s) so far.
    pub done: usize,
    /// Tokens to run in all.
    pub total: usize,
}

/// One window: tokens `begin..end` are the model's input, tokens `score_from..end` are scored.
#[derive(Debug, Clone, Copy)]
struct Span {
    begin: usize,
    end: usize,
    score_from: usize,
}

fn plan(tokens: usize, context: usize, window: Window) -> Result<(WindowReport, Vec<Span>)> {
    if tokens < 2 {
        return Err(EvalError::TooFewTokens { tokens }.into());
    }
    let (mode, size, stride) = match window {
        Window::Auto if tokens <= context => (WindowMode::Single, tokens, tokens),
        Window::Auto => (WindowMode::Chunks, context, context),
        Window::Chunks { size } => (WindowMode::Chunks, size, size),
        Window::Sliding { size, stride } => (WindowMode::Sliding, size, stride),
    };
    if size < 2 {
        return Err(EvalError::WindowTooSmall { size }.into());
    }
    if size > context {
        return Err(EvalError::WindowTooLarge { size, context }.into());
    }
    if stride == 0 || stride > size {
        return Err(EvalError::BadStride { stride, size }.into());
    }
    // The Hugging Face loop: windows start every `stride` tokens; each scores from where the
    // previous one ended (never its own first token); stop once a window reaches the end.
    let mut spans = Vec::new();
    let mut prev_end = 0;
    let mut begin = 0;
    loop {
        let end = (begin + size).min(tokens);
        spans.push(Span { begin, end, score_from: prev_end.max(begin + 1) });
        prev_end = end;
        if end == tokens {
            break;
        }
        begin += stride;
    }
    let mode = if spans.len() == 1 { WindowMode::Single } else { mode };
    let report = WindowReport {
        mode,
        size: if spans.len() == 1 { tokens.min(size) } else { size },
        stride: (mode == WindowMode::Sliding).then_some(stride),
        windows: spans.len(),
    };
    Ok((report, spans))
}

/// `log(sum(exp(row)))` in f64.
fn log_sum_exp(row: &[f32]) -> f64 {
    let max = row.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
    if !max.is_finite() {
        return max;
    }
    let s: f64 = row.iter().map(|&x| (x as f64 - max).exp()).sum();
    max + s.ln()
}

/// `log softmax(row)` in f64.
fn log_softmax(row: &[f32], out: &mut Vec<f64>) {
    let lse = log_sum_exp(row);
    out.clear();
    out.extend(row.iter().map(|&x| x as f64 - lse));
}

/// Rows of logits `forward_all_logits` produces per GPU step.
fn logit_chunk(model: &GpuModel) -> usize {
    model.options.max_logit_rows.min(model.options.max_batch_tokens).max(1)
}

fn context_of(model: &GpuModel) -> usize {
    model.kv.alloc.config.context
}

/// Perplexity of `ids` under `model` (see the module docs for the definition and the
/// windowing). Each window runs in a fresh sequence, released afterwards (also on error).
/// `progress` is called after every GPU step with the tokens run so far.
pub async fn perplexity(model: &mut GpuModel, ids: &[u32], window: Window, mut progress: impl FnMut(Progress)) -> Result<PerplexityReport> {
    let t0 = Instant::now();
    let (report, spans) = plan(ids.len(), context_of(model), window)?;
    // The last token of a window is never input: nothing in the window predicts from it.
    let total: usize = spans.iter().map(|s| s.end - 1 - s.begin).sum();
    let mut done = 0usize;
    let mut per_token = Vec::with_capacity(ids.len());
    progress(Progress { done, total });
    for span in &spans {
        let seq = model.new_sequence()?;
        let r = score_window(model, seq, ids, *span, &mut per_token, &mut done, total, &mut progress).await;
        model.release_sequence(seq);
        r?;
    }
    let sum_nll: f64 = per_token.iter().map(|t| t.nll).sum();
    let predicted = per_token.len();
    let mean_nll = sum_nll / predicted as f64;
    let elapsed = t0.elapsed().as_secs_f64();
    Ok(PerplexityReport {
        token_count: ids.len(),
        predicted_tokens: predicted,
        sum_nll,
        mean_nll,
        perplexity: mean_nll.exp(),
        window: report,
        tokens_evaluated: done,
        elapsed_ms: elapsed * 1e3,
        tokens_per_s: if elapsed > 0.0 { done as f64 / elapsed } else { 0.0 },
        per_token,
    })
}

#[allow(clippy::too_many_arguments)]
async fn score_window(
    model: &mut GpuModel,
    seq: usize,
    ids: &[u32],
    span: Span,
    out: &mut Vec<TokenNll>,
    done: &mut usize,
    total: usize,
    progress: &mut impl FnMut(Progress),
) -> Result<()> {
    let vocab = model.config.vocab_size;
    // Context-only tokens: no logits needed (the last one's row predicts the first scored token).
    let rows_from = span.score_from - 1;
    if rows_from > span.begin {
        model.forward(seq, &ids[span.begin..rows_from], Want::Argmax).await?;
        *done += rows_from - span.begin;
        progress(Progress { done: *done, total });
    }
    let chunk = logit_chunk(model);
    let mut p = rows_from;
    while p < span.end - 1 {
        let q = (p + chunk).min(span.end - 1);
        let logits = model.forward_all_logits(seq, &ids[p..q]).await?;
        for (r, row) in logits.chunks_exact(vocab).enumerate() {
            let pos = p + r + 1;
            let id = ids[pos];
            out.push(TokenNll { pos, id, nll: log_sum_exp(row) - row[id as usize] as f64 });
        }
        *done += q - p;
        progress(Progress { done: *done, total });
        p = q;
    }
    Ok(())
}

/// Teacher-forced agreement statistics over a set of positions.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct PositionStats {
    /// Positions compared.
    pub positions: usize,
    /// Positions where both models' argmax (lowest id on ties) is the same token.
    pub top1_matches: usize,
    /// Sum of KL(P_A || P_B) over the positions, nats.
    pub sum_kl: f64,
    /// `top1_matches / positions` (None without positions).
    pub top1_agreement: Option<f64>,
    /// `sum_kl / positions` (None without positions).
    pub mean_kl: Option<f64>,
    /// Largest KL at one position (None without positions).
    pub max_kl: Option<f64>,
}

impl PositionStats {
    fn add(&mut self, top1: bool, kl: f64) {
        self.positions += 1;
        self.top1_matches += top1 as usize;
        self.sum_kl += kl;
        self.max_kl = Some(self.max_kl.map_or(kl, |m| m.max(kl)));
        self.finish();
    }

    fn merge(&mut self, o: &PositionStats) {
        self.positions += o.positions;
        self.top1_matches += o.top1_matches;
        self.sum_kl += o.sum_kl;
        self.max_kl = match (self.max_kl, o.max_kl) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
        self.finish();
    }

    fn finish(&mut self) {
        let n = self.positions;
        self.top1_agreement = (n > 0).then(|| self.top1_matches as f64 / n as f64);
        self.mean_kl = (n > 0).then(|| self.sum_kl / n as f64);
    }
}

/// [`compare`]'s result for one prompt.
#[derive(Debug, Clone, serde::Serialize)]
pub struct PromptComparison {
    pub index: usize,
    pub prompt_tokens: usize,
    /// Model A's greedy continuation (exactly `max_new` tokens).
    pub a_ids: Vec<u32>,
    /// Model B's greedy continuation (exactly `max_new` tokens).
    pub b_ids: Vec<u32>,
    /// First index `k` (0-based, into the continuations) with `a_ids[k] != b_ids[k]`; None if
    /// the continuations are identical.
    pub first_divergence: Option<usize>,
    /// Positions `k < max_new` with `a_ids[k] == b_ids[k]`.
    pub matching_tokens: usize,
    /// `matching_tokens / max_new` (None when `max_new` is 0).
    pub token_agreement: Option<f64>,
    /// Teacher-forced on prompt + A's continuation, the positions whose next token is one of
    /// A's generated tokens (`max_new` positions).
    pub generated: PositionStats,
    /// Teacher-forced, the positions whose next token is a prompt token (`prompt_tokens - 1`
    /// positions: the first prompt token is not predicted).
    pub prompt: PositionStats,
}

/// Result of [`compare`]: every prompt and the totals.
#[derive(Debug, Clone, serde::Serialize)]
pub struct CompareReport {
    pub prompts: Vec<PromptComparison>,
    pub max_new: usize,
    /// Prompts whose continuations are identical.
    pub identical_prompts: usize,
    /// All matching tokens over all prompts / (prompts x max_new).
    pub token_agreement: Option<f64>,
    /// Mean over the diverging prompts of their first divergent index.
    pub mean_first_divergence: Option<f64>,
    /// Generated positions of all prompts pooled (each position weighs the same).
    pub generated: PositionStats,
    /// Prompt positions of all prompts pooled.
    pub prompt: PositionStats,
    pub elapsed_ms: f64,
}

/// Greedy decoding of exactly `n` tokens from `prompt` (no stop tokens).
async fn greedy(model: &mut GpuModel, prompt: &[u32], n: usize, tick: &mut impl FnMut(usize)) -> Result<Vec<u32>> {
    if n == 0 {
        return Ok(Vec::new());
    }
    let seq = model.new_sequence()?;
    let r = async {
        let mut out = Vec::with_capacity(n);
        let mut t = model.forward(seq, prompt, Want::Argmax).await?.argmax[0];
        tick(prompt.len());
        out.push(t);
        while out.len() < n {
            t = model.forward(seq, &[t], Want::Argmax).await?.argmax[0];
            tick(1);
            out.push(t);
        }
        Ok(out)
    }
    .await;
    model.release_sequence(seq);
    r
}

fn check_fits(index: usize, which: char, model: &GpuModel, prompt_tokens: usize, max_new: usize) -> Result<()> {
    let needed = (prompt_tokens + max_new).saturating_sub(1);
    let context = context_of(model);
    if needed > context {
        return Err(EvalError::PromptTooLong { index, model: which, prompt_tokens, max_new, needed, context }.into());
    }
    Ok(())
}

/// Compare model B against model A on `prompts` (token ids, tokenized once for both).
///
/// Per prompt:
/// 1. Both models decode greedily (argmax, lowest id on ties) exactly `max_new` tokens from
///    the prompt; EOS does not stop them, so both continuations have `max_new` tokens.
///    `first_divergence` is the first index where they differ, `token_agreement` the
///    fraction of the `max_new` indices where they are equal (position-wise, so tokens after
///    a divergence count only where they happen to line up again).
/// 2. Teacher forcing on A's sequence `S = prompt ++ a_ids`: both models run
///    `S[..len-1]` in one pass with all logits; the row at position `i` predicts `S[i+1]`.
///    At each position: top-1 agreement (argmax of A's row == argmax of B's row) and
///    `KL(P_A || P_B) = sum_v P_A(v) (log P_A(v) - log P_B(v))` with both log-softmaxes in
///    f64. Positions are reported in two groups: `generated` (the `max_new` positions that
///    predict A's generated tokens, starting at the last prompt token) and `prompt` (the
///    `prompt_tokens - 1` positions that predict prompt tokens).
///
/// Totals pool positions over prompts (each position weighs the same). Both models need the
/// same vocabulary size ([`EvalError::VocabMismatch`]) and room for
/// `prompt_tokens + max_new - 1` positions. `progress` counts tokens run through either model.
pub async fn compare(
    a: &mut GpuModel,
    b: &mut GpuModel,
    prompts: &[Vec<u32>],
    max_new: usize,
    mut progress: impl FnMut(Progress),
) -> Result<CompareReport> {
    let t0 = Instant::now();
    let (va, vb) = (a.config.vocab_size, b.config.vocab_size);
    if va != vb {
        return Err(EvalError::VocabMismatch { a: va, b: vb }.into());
    }
    for (i, p) in prompts.iter().enumerate() {
        if p.is_empty() {
            return Err(EvalError::EmptyPrompt { index: i }.into());
        }
        check_fits(i, 'A', a, p.len(), max_new)?;
        check_fits(i, 'B', b, p.len(), max_new)?;
    }
    // Per prompt and model: generation feeds L + N - 1 tokens, teacher forcing as many.
    let per = |p: &Vec<u32>| (p.len() + max_new).saturating_sub(1);
    let total: usize = prompts.iter().map(|p| 4 * per(p)).sum();
    let mut done = 0usize;
    progress(Progress { done, total });
    let mut out = Vec::with_capacity(prompts.len());
    for (index, prompt) in prompts.iter().enumerate() {
        let mut tick = |n: usize| {
            done += n;
            progress(Progress { done, total });
        };
        let a_ids = greedy(a, prompt, max_new, &mut tick).await?;
        let b_ids = greedy(b, prompt, max_new, &mut tick).await?;
        let first_divergence = a_ids.iter().zip(&b_ids).position(|(x, y)| x != y);
        let matching_tokens = a_ids.iter().zip(&b_ids).filter(|(x, y)| x == y).count();
        let mut seq_tokens = prompt.clone();
        seq_tokens.extend_from_slice(&a_ids);
        let (generated, prompt_stats) = teacher_forced(a, b, &seq_tokens, prompt.len(), &mut tick).await?;
        out.push(PromptComparison {
            index,
            prompt_tokens: prompt.len(),
            first_divergence,
            matching_tokens,
            token_agreement: (max_new > 0).then(|| matching_tokens as f64 / max_new as f64),
            a_ids,
            b_ids,
            generated,
            prompt: prompt_stats,
        });
    }
    let mut generated = PositionStats::default();
    let mut prompt = PositionStats::default();
    for p in &out {
        generated.merge(&p.generated);
        prompt.merge(&p.prompt);
    }
    let matching: usize = out.iter().map(|p| p.matching_tokens).sum();
    let n_tokens = out.len() * max_new;
    let diverged: Vec<usize> = out.iter().filter_map(|p| p.first_divergence).collect();
    Ok(CompareReport {
        identical_prompts: out.len() - diverged.len(),
        token_agreement: (n_tokens > 0).then(|| matching as f64 / n_tokens as f64),
        mean_first_divergence: (!diverged.is_empty()).then(|| diverged.iter().sum::<usize>() as f64 / diverged.len() as f64),
        prompts: out,
        max_new,
        generated,
        prompt,
        elapsed_ms: t0.elapsed().as_secs_f64() * 1e3,
    })
}

/// Teacher-forced statistics of `b` against `a` on `tokens` (prompt of `prompt_len` tokens
/// followed by A's continuation): (generated positions, prompt positions).
async fn teacher_forced(
    a: &mut GpuModel,
    b: &mut GpuModel,
    tokens: &[u32],
    prompt_len: usize,
    tick: &mut impl FnMut(usize),
) -> Result<(PositionStats, PositionStats)> {
    let mut generated = PositionStats::default();
    let mut prompt = PositionStats::default();
    let inputs = tokens.len() - 1;
    if inputs == 0 {
        return Ok((generated, prompt));
    }
    let sa = a.new_sequence()?;
    let sb = match b.new_sequence() {
        Ok(s) => s,
        Err(e) => {
            a.release_sequence(sa);
            return Err(e);
        }
    };
    let r = async {
        let vocab = a.config.vocab_size;
        let chunk = logit_chunk(a).min(logit_chunk(b));
        let (mut la, mut lb) = (Vec::with_capacity(vocab), Vec::with_capacity(vocab));
        let mut p = 0;
        while p < inputs {
            let q = (p + chunk).min(inputs);
            let ra = a.forward_all_logits(sa, &tokens[p..q]).await?;
            tick(q - p);
            let rb = b.forward_all_logits(sb, &tokens[p..q]).await?;
            tick(q - p);
            for (r, (xa, xb)) in ra.chunks_exact(vocab).zip(rb.chunks_exact(vocab)).enumerate() {
                let pos = p + r;
                log_softmax(xa, &mut la);
                log_softmax(xb, &mut lb);
                let kl: f64 = la.iter().zip(&lb).map(|(&x, &y)| if x == f64::NEG_INFINITY { 0.0 } else { x.exp() * (x - y) }).sum();
                let top1 = argmax(xa) == argmax(xb);
                // Row `pos` predicts token `pos + 1`.
                if pos + 1 < prompt_len {
                    prompt.add(top1, kl);
                } else {
                    generated.add(top1, kl);
                }
            }
            p = q;
        }
        Ok::<_, crate::LanternError>(())
    }
    .await;
    a.release_sequence(sa);
    b.release_sequence(sb);
    r?;
    Ok((generated, prompt))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spans(t: usize, ctx: usize, w: Window) -> Vec<(usize, usize, usize)> {
        plan(t, ctx, w).unwrap().1.iter().map(|s| (s.begin, s.end, s.score_from)).collect()
    }

    #[test]
    fn windows_follow_the_hugging_face_loop() {
        assert_eq!(spans(10, 16, Window::Auto), vec![(0, 10, 1)]);
        assert_eq!(spans(10, 4, Window::Auto), vec![(0, 4, 1), (4, 8, 5), (8, 10, 9)]);
        assert_eq!(spans(10, 16, Window::Sliding { size: 4, stride: 2 }), vec![(0, 4, 1), (2, 6, 4), (4, 8, 6), (6, 10, 8)]);
        assert_eq!(spans(11, 16, Window::Sliding { size: 4, stride: 3 }), vec![(0, 4, 1), (3, 7, 4), (6, 10, 7), (9, 11, 10)]);
        assert_eq!(spans(5, 16, Window::Sliding { size: 8, stride: 2 }), vec![(0, 5, 1)]);
        let (r, _) = plan(5, 16, Window::Sliding { size: 8, stride: 2 }).unwrap();
        assert_eq!(r.mode, WindowMode::Single);
        assert!(matches!(plan(1, 16, Window::Auto), Err(crate::LanternError::Eval(EvalError::TooFewTokens { tokens: 1 }))));
        assert!(matches!(plan(9, 8, Window::Chunks { size: 9 }), Err(crate::LanternError::Eval(EvalError::WindowTooLarge { .. }))));
        assert!(matches!(plan(9, 8, Window::Sliding { size: 4, stride: 5 }), Err(crate::LanternError::Eval(EvalError::BadStride { .. }))));
        assert!(matches!(plan(9, 8, Window::Sliding { size: 4, stride: 0 }), Err(crate::LanternError::Eval(EvalError::BadStride { .. }))));
    }

    #[test]
    fn sliding_windows_score_every_token_after_the_first_once() {
        for t in 2..40 {
            for size in 2..12 {
                for stride in 1..=size {
                    let (_, s) = plan(t, 64, Window::Sliding { size, stride }).unwrap();
                    let scored: Vec<usize> = s.iter().flat_map(|s| s.score_from..s.end).collect();
                    // stride == size: chunks, whose first tokens have no context.
                    let want: Vec<usize> = (1..t).filter(|i| stride < size || i % size != 0).collect();
                    assert_eq!(scored, want, "T {t} size {size} stride {stride}");
                }
            }
        }
    }

    #[test]
    fn log_softmax_is_exact_in_f64() {
        let row = [1.0f32, 2.0, 3.0];
        let lse = (1f64.exp() + 2f64.exp() + 3f64.exp()).ln();
        assert!((log_sum_exp(&row) - lse).abs() < 1e-12);
        let big = [1000.0f32, 1000.0];
        assert!((log_sum_exp(&big) - (1000.0 + 2f64.ln())).abs() < 1e-9);
    }
}

//! The generation loop for one sequence: prefill the prompt, then decode token by token,
//! streaming text pieces, until EOS, a stop string, the token limit or the context's end.

use crate::kernels::argmax::RowDraw;
use web_time::Instant;

use super::constraint::{Constraint, Guide};
use super::logit_bias::{BiasState, LogitBias};
use super::metrics::{HostCosts, RequestTimings};
use super::sampler::{Sampler, SamplingParams, TokenLogprob};
use super::speculative::{self, DraftJob, DraftLength, Drafter, SpecStats, Speculation};
use crate::model::forward::{GpuModel, LogitOps, StepOutput, Want};
use crate::model::tokenizer::Tokenizer;
use crate::{LanternError, Result};

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// An end-of-sequence token or a stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
    /// The sequence filled the context window.
    ContextFull,
    /// The caller asked to stop.
    Cancelled,
}

impl FinishReason {
    pub fn as_str(&self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::ContextFull => "context_full",
            FinishReason::Cancelled => "cancelled",
        }
    }
}

/// One generation request.
#[derive(Debug, Clone)]
pub struct GenerateRequest {
    pub prompt_ids: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Token ids that end generation (the model's EOS ids by default).
    pub stop_ids: Vec<u32>,
    /// Strings that end generation; the text is cut before them.
    pub stop_strings: Vec<String>,
    /// Speculative decoding (off by default). Greedy output is the same with it or
    /// without; sampled output follows the same distribution. Off for constrained requests.
    pub speculation: Speculation,
    /// Constrained decoding (none by default): every sampled token is one the grammar
    /// allows (masked on the GPU before argmax / top-k), a stop id only where it accepts,
    /// and the sequence ends when the grammar is finished. A constraint that does not
    /// compile refuses the request (`LanternError::Constraint`).
    pub constraint: Option<Constraint>,
    /// Log-probabilities of each sampled token and its `k` best alternatives (0..=20;
    /// `Some(0)`: the token's own only), from the GPU's top-k and logsumexp. The batching
    /// engine honours it (in `Event::Token` and `Generation::logprobs`); such requests decode
    /// without speculation.
    pub logprobs: Option<usize>,
    /// OpenAI's `logit_bias` and presence/frequency penalties (none by default), added to
    /// the logits on the GPU before the mask, argmax and top-k. Requests with any decode
    /// without speculation.
    pub bias: LogitBias,
}

impl Default for GenerateRequest {
    /// No prompt, 128 new tokens, greedy, no stop ids or strings, no speculation or
    /// constraint.
    fn default() -> Self {
        GenerateRequest {
            prompt_ids: Vec::new(),
            max_tokens: 128,
            sampling: SamplingParams::default(),
            stop_ids: Vec::new(),
            stop_strings: Vec::new(),
            speculation: Speculation::default(),
            constraint: None,
            logprobs: None,
            bias: LogitBias::default(),
        }
    }
}

/// The outcome of a request.
#[derive(Debug, Clone)]
pub struct Generation {
    pub prompt_ids: Vec<u32>,
    pub output_ids: Vec<u32>,
    pub text: String,
    pub finish_reason: FinishReason,
    /// The stop string that ended the generation (cut from `text`), when one did.
    pub stop_string: Option<String>,
    pub timings: RequestTimings,
    /// Prompt tokens whose KV came from the prefix cache (not computed again).
    pub cached_prompt_tokens: usize,
    /// What speculative decoding did, when it was on.
    pub speculative: Option<SpecStats>,
    /// Per output token, with `GenerateRequest::logprobs`.
    pub logprobs: Vec<TokenLogprob>,
    /// The host's work per decode token (dispatches, submits, waits...), when the request
    /// decoded at least two tokens.
    pub host: Option<HostCosts>,
}

/// The tokens that end a generation unless the caller says otherwise: the model's
/// end-of-sequence ids (from its config) and the tokenizer's, each once.
pub fn default_stop_ids(model_eos: &[u32], tokenizer: &Tokenizer) -> Vec<u32> {
    let mut ids = model_eos.to_vec();
    if let Some(e) = tokenizer.eos_id() {
        if !ids.contains(&e) {
            ids.push(e);
        }
    }
    ids
}

/// Run `req` on `model`, calling `on_text` with each new piece of text as it becomes
/// complete UTF-8. `on_text` returns `false` to cancel.
pub async fn generate(
    model: &mut GpuModel,
    tokenizer: &Tokenizer,
    req: &GenerateRequest,
    on_text: impl FnMut(&str) -> bool,
) -> Result<Generation> {
    generate_with(model, None, tokenizer, req, on_text).await
}

/// [`generate`] with a draft model for `Drafter::Model` speculation (it must share the
/// target's tokenizer: [`speculative::check_pair`]); it gets a sequence of its own for the
/// request, released at the end.
pub async fn generate_with(
    model: &mut GpuModel,
    mut draft: Option<&mut GpuModel>,
    tokenizer: &Tokenizer,
    req: &GenerateRequest,
    mut on_text: impl FnMut(&str) -> bool,
) -> Result<Generation> {
    let arrival = Instant::now();
    let context = model.kv.alloc.config.context;
    if req.prompt_ids.is_empty() {
        return Err(LanternError::InvalidRequest("the prompt is empty (no tokens to condition on)".into()));
    }
    if req.prompt_ids.len() >= context {
        return Err(LanternError::PromptTooLong { prompt_tokens: req.prompt_ids.len(), max_new: req.max_tokens, context });
    }
    req.bias.check(model.config.vocab_size).map_err(LanternError::InvalidRequest)?;
    // Constrained and biased requests decode without speculation (their drafts are not
    // checked against the grammar or the biases).
    let unspeculated;
    let req = if (req.constraint.is_some() || !req.bias.is_none()) && req.speculation.enabled() {
        unspeculated = GenerateRequest { speculation: Speculation::default(), ..req.clone() };
        &unspeculated
    } else {
        req
    };
    let guide = super::constraint::guide_for(tokenizer, req.constraint.as_ref(), model.config.vocab_size, &req.stop_ids)?;
    if req.speculation.enabled() && req.speculation.drafter == Drafter::Model && draft.is_none() {
        return Err(LanternError::InvalidRequest("speculation with a draft model needs the draft model loaded (--draft)".into()));
    }
    // Adaptive speculation chooses k from measured step costs: measure the widths not known
    // yet (a warm-up on scratch sequences, reported as the request's `warmup_ms`). Where it
    // cannot (the cache is full of other sequences), the unknown widths count as expensive.
    let warmup_ms = if req.speculation.enabled() {
        let d = draft.as_deref_mut().filter(|_| req.speculation.drafter == Drafter::Model);
        match super::step_costs::ensure(model, d, &req.speculation).await {
            Ok(ms) => ms,
            Err(e @ LanternError::Gpu(_)) => return Err(e),
            Err(e) => {
                log::warn!("measuring step costs for speculation: {e}");
                0.0
            }
        }
    } else {
        0.0
    };
    let draft_seq = match draft.as_deref_mut() {
        Some(d) if req.speculation.enabled() && req.speculation.drafter == Drafter::Model => Some(d.new_sequence()?),
        _ => None,
    };
    let seq = match model.new_sequence() {
        Ok(s) => s,
        Err(e) => {
            if let (Some(d), Some(ds)) = (draft.as_deref_mut(), draft_seq) {
                d.release_sequence(ds);
            }
            return Err(e);
        }
    };
    let drafting = draft_seq.and_then(|ds| draft.map(|d| (d, ds)));
    let (mut r, drafting) = admit_and_run(model, drafting, tokenizer, req, guide, seq, arrival, &mut on_text).await;
    if let Ok(Some(s)) = r.as_mut().map(|g| g.speculative.as_mut()) {
        s.warmup_ms = warmup_ms;
    }
    model.release_sequence(seq);
    if let Some((d, ds)) = drafting {
        d.release_sequence(ds);
    }
    r
}

/// The draft model and the request's sequence in it.
type Drafting<'a> = Option<(&'a mut GpuModel, usize)>;

/// Take the cached prefix of the prompt, refuse the request up front (with what it needs
/// and what is free) when its KV cannot fit, run it, and offer its prompt pages to the
/// prefix cache.
#[allow(clippy::too_many_arguments)]
async fn admit_and_run<'a>(
    model: &mut GpuModel,
    mut drafting: Drafting<'a>,
    tokenizer: &Tokenizer,
    req: &GenerateRequest,
    guide: Option<Guide>,
    seq: usize,
    arrival: Instant,
    on_text: &mut impl FnMut(&str) -> bool,
) -> (Result<Generation>, Drafting<'a>) {
    let context = model.kv.alloc.config.context;
    let cached = if model.options.prefix_cache {
        match model.attach_cached_prefix(seq, &req.prompt_ids) {
            Ok(c) => c,
            Err(e) => return (Err(e), drafting),
        }
    } else {
        0
    };
    // The most this request can hold: its prompt and every token it may generate.
    let most = (req.prompt_ids.len() + req.max_tokens).min(context);
    if let Err(e) = model.check_fits(seq, most - cached) {
        return (Err(LanternError::Kv(e)), drafting);
    }
    let r = run(model, &mut drafting, tokenizer, req, guide, seq, cached, arrival, on_text).await;
    (
        r.map(|mut g| {
            g.cached_prompt_tokens = cached;
            g
        }),
        drafting,
    )
}

/// The tokens one step after the first produces: a plain decode step, or a drafted and
/// verified run of them.
#[allow(clippy::too_many_arguments)]
async fn next_tokens(
    model: &mut GpuModel,
    drafting: &mut Drafting<'_>,
    req: &GenerateRequest,
    seq: usize,
    history: &[u32],
    out_len: usize,
    sampler: &mut Sampler,
    want: Want,
    spec: &mut Option<(DraftLength, SpecStats)>,
    guide: &mut Option<Guide>,
    bias: &Option<BiasState>,
) -> Result<Vec<u32>> {
    let context = model.kv.alloc.config.context;
    let last = *history.last().expect("a sampled token");
    let Some((len_ctl, stats)) = spec.as_mut() else {
        let t0 = Instant::now();
        let out = forward_guided(model, seq, &[last], want, guide, bias, sampler.row_draw(out_len)).await?;
        model.record_step_ms(1, t0.elapsed().as_secs_f64() * 1e3);
        return Ok(vec![sampler.sample_step(&out, 0, model.config.vocab_size)]);
    };
    // Room: every drafted token may be emitted, plus the target's own next one; the verify
    // step stays within the context. Lookup's k is chosen knowing how much it found.
    let room = speculative::draft_limit(req.max_tokens, out_len, history.len(), context, model.logit_rows);
    let (k, found) = match req.speculation.drafter {
        Drafter::Lookup => {
            let found = speculative::lookup(history, room.min(len_ctl.max()), req.speculation.lookup_ngram);
            (len_ctl.next(found.len()), found)
        }
        _ => (len_ctl.next(room), Vec::new()),
    };
    stats.expect(len_ctl.gain(k));
    if let (Drafter::Model, Some((d, ds)), true) = (req.speculation.drafter, drafting.as_mut(), k > 0) {
        speculative::catch_up(d, &[(*ds, history)]).await?;
    }
    let t0 = Instant::now();
    let drafts = match (req.speculation.drafter, drafting.as_mut()) {
        (Drafter::Model, Some((d, ds))) if k > 0 => {
            let mut jobs = [DraftJob { slot: *ds, history, k, sampler: sampler.clone(), index: out_len, tokens: Vec::new() }];
            speculative::draft_tokens(d, &mut jobs).await?;
            let [j] = jobs;
            j.tokens
        }
        (Drafter::Lookup, _) => found[..k].to_vec(),
        _ => Vec::new(),
    };
    let draft_ms = t0.elapsed().as_secs_f64() * 1e3;
    let t1 = Instant::now();
    let cache_len = history.len() - 1;
    let verdict = if drafts.is_empty() {
        let draws = vec![sampler.row_draw(out_len)];
        let out = model.forward_with(seq, &[last], want, LogitOps { draws, ..LogitOps::default() }).await?;
        let token = sampler.sample_step(&out, 0, model.config.vocab_size);
        len_ctl.observe_lookup(&req.speculation, history, token);
        speculative::Verdict { accepted: 0, tokens: vec![token] }
    } else {
        let mut input = Vec::with_capacity(drafts.len() + 1);
        input.push(last);
        input.extend_from_slice(&drafts);
        // Drawing on the GPU (no top-k), row i draws output token out_len + i.
        let draws = (0..input.len()).map(|i| sampler.row_draw(out_len + i)).collect();
        let out = model.forward_rows_with(seq, &input, speculative::want_for(sampler), LogitOps { draws, ..LogitOps::default() }).await?;
        let v = if sampler.gpu_chooses() {
            speculative::verify_greedy(&drafts, &out.argmax)
        } else {
            let vocab = model.config.vocab_size;
            let p: Vec<_> = (0..input.len()).map(|r| speculative::dist_at(&out, r, vocab, sampler)).collect();
            speculative::verify_sampled(&drafts, &p, sampler)
        };
        // Roll back the rejected positions: the cache keeps the last token and the
        // accepted drafts; the token emitted last goes in with the next step.
        model.truncate_sequence(seq, cache_len + 1 + v.accepted)?;
        v
    };
    let verify_ms = t1.elapsed().as_secs_f64() * 1e3;
    if let Some((d, ds)) = drafting.as_mut() {
        let keep = d.sequence_len(*ds)?.min(cache_len + 1 + verdict.accepted);
        d.truncate_sequence(*ds, keep)?;
    }
    len_ctl.record(drafts.len(), verdict.accepted, draft_ms, verify_ms);
    len_ctl.remember(speculative::memory_mut(req.speculation.drafter, model, drafting.as_mut().map(|(d, _)| &mut **d)));
    // What later requests start from: this step's cost at its width (drafting's cost by k
    // is in the draft memory above).
    model.record_step_ms(drafts.len() + 1, verify_ms);
    stats.record(drafts.len(), verdict.accepted, draft_ms, verify_ms);
    Ok(verdict.tokens)
}

/// A forward step whose sampled row is biased by `bias` and masked by `guide`'s allowed
/// tokens (computed while the GPU runs the step's layers), or a plain one without either;
/// its token is chosen on the GPU as `draw` says.
#[allow(clippy::too_many_arguments)]
async fn forward_guided(
    model: &mut GpuModel,
    seq: usize,
    tokens: &[u32],
    want: Want,
    guide: &mut Option<Guide>,
    bias: &Option<BiasState>,
    draw: RowDraw,
) -> Result<StepOutput> {
    let bias = bias.as_ref().map(|b| vec![b.row()]).unwrap_or_default();
    let draws = vec![draw];
    match guide.as_mut() {
        Some(g) => model.forward_with(seq, tokens, want, LogitOps { bias, mask: Some(&mut || g.mask()), draws }).await,
        None => model.forward_with(seq, tokens, want, LogitOps { bias, mask: None, draws }).await,
    }
}

#[allow(clippy::too_many_arguments)]
async fn run(
    model: &mut GpuModel,
    drafting: &mut Drafting<'_>,
    tokenizer: &Tokenizer,
    req: &GenerateRequest,
    mut guide: Option<Guide>,
    seq: usize,
    cached: usize,
    arrival: Instant,
    on_text: &mut impl FnMut(&str) -> bool,
) -> Result<Generation> {
    let context = model.kv.alloc.config.context;
    let mut timings = RequestTimings::new(arrival);
    let mut sampler = Sampler::new(req.sampling);
    // Greedy, and sampling without a top-k: the argmax kernel's choice (4 bytes);
    // top-k sampling within the GPU top-k: its pairs (512 bytes); anything else: the logits
    // row.
    let want = speculative::want_for(&sampler);
    let mut spec = req.speculation.enabled().then(|| {
        let memory = speculative::memory(req.speculation.drafter, model, drafting.as_ref().map(|(d, _)| &**d));
        let costs = DraftLength::new(&req.speculation)
            .with_costs(model.step_costs(), drafting.as_ref().map(|(d, _)| d.step_costs()))
            .with_memory(memory);
        (costs, SpecStats::new(req.speculation.drafter))
    });
    let mut stream = TextStream::new(tokenizer, &req.stop_strings);
    let mut out_ids = Vec::new();
    let mut history = req.prompt_ids.clone();
    if req.max_tokens == 0 {
        timings.finished = Some(Instant::now());
        return Ok(Generation {
            prompt_ids: req.prompt_ids.clone(),
            output_ids: out_ids,
            text: String::new(),
            finish_reason: FinishReason::Length,
            stop_string: None,
            timings,
            cached_prompt_tokens: 0,
            speculative: spec.map(|s| s.1),
            logprobs: Vec::new(),
            host: None,
        });
    }
    let mut bias = BiasState::new(&req.bias);
    let out = forward_guided(model, seq, &req.prompt_ids[cached..], want, &mut guide, &bias, sampler.row_draw(0)).await?;
    if model.options.prefix_cache {
        model.cache_prefix(seq, &req.prompt_ids)?;
    }
    let mut batch = vec![sampler.sample_step(&out, 0, model.config.vocab_size)];
    // Speculation that cannot pay here even if every draft were accepted (the measured
    // verify and draft costs say so) is dropped for the request, which then decodes as a
    // plain one does (ahead of the host; the draft model never runs).
    let mut unspeculated: Option<(Drafter, String)> = None;
    if spec.is_some() {
        let room = speculative::draft_limit(req.max_tokens, 1, history.len() + 1, context, model.logit_rows);
        let draft_costs = drafting.as_ref().map(|(d, _)| d.step_costs());
        if let Some(reason) = speculative::why_plain(&req.speculation, model.step_costs(), draft_costs, room) {
            unspeculated = Some((req.speculation.drafter, reason));
            spec = None;
        }
    }
    // Plain decoding runs ahead of the host: the GPU feeds each step's token (its argmax, or
    // a draw from its top-k pairs) to the next step, and the tokens are checked here as they
    // arrive (`GpuModel::begin_ahead`). A sampled token is drawn again here from the same
    // pairs by the request's sampler, which stays the reference: where f32 rounding made the
    // GPU draw another token, the run restarts from this one, so the output is the
    // step-at-a-time output. Anything else that needs the host between tokens (grammars,
    // biases, drafts, sampling without a top-k of at most 64) steps one token at a time.
    let gpu_sampling = (want == Want::TopK).then(|| sampler.gpu_params());
    // Speculative requests run ahead too while they choose not to draft (k = 0): their plain
    // steps cost what a plain request's do. When a step is to carry drafts, the run submits
    // no more steps, its steps in flight are taken (valid plain steps: neither greedy nor
    // sampled tokens depend on where a verify step falls, since sampled verification takes
    // one number per token, as plain sampling does), and the verify step follows.
    let ahead = guide.is_none() && bias.is_none() && (want == Want::Argmax || want == Want::TopK) && model.decode_ahead_depth() >= 2;
    // The draws the GPU's steps take, ahead of the request's sampler (a copy of it).
    let mut draws = sampler.clone();
    // The output index of the token the run's next submitted step draws (`Sampler::row_draw`).
    let mut draw_index = 0usize;
    let mut ahead_open = false;
    let mut redraws = 0usize;
    let mut last_arrival = Instant::now();
    let decode_start = (model.ctx.host_counts(), Instant::now());
    let r = async {
        let finish = 'gen: loop {
            let now = Instant::now();
            for token in batch {
                if let Some(g) = guide.as_mut() {
                    g.accept(token)?;
                }
                if let Some(b) = bias.as_mut() {
                    b.observe(token);
                }
                timings.tokens.push(now);
                out_ids.push(token);
                history.push(token);
                let (piece, stop) = stream.push(tokenizer, token, &req.stop_ids, &req.stop_strings)?;
                // A finished grammar ends the sequence (its text is complete).
                let stop = stop.or_else(|| guide.as_ref().filter(|g| g.is_finished()).map(|_| FinishReason::Stop));
                if let Some(p) = piece {
                    if !on_text(&p) {
                        break 'gen FinishReason::Cancelled;
                    }
                }
                if let Some(f) = stop {
                    break 'gen f;
                }
                if out_ids.len() >= req.max_tokens {
                    break 'gen FinishReason::Length;
                }
                if history.len() > context {
                    break 'gen FinishReason::ContextFull;
                }
            }
            // Whether the next target step should carry drafts (speculative requests).
            let draft_now = match spec.as_ref() {
                Some((len_ctl, _)) if ahead => {
                    let room = speculative::draft_limit(req.max_tokens, out_ids.len(), history.len(), context, model.logit_rows);
                    let most = match req.speculation.drafter {
                        Drafter::Lookup => speculative::lookup(&history, room.min(len_ctl.max()), req.speculation.lookup_ngram).len(),
                        _ => room,
                    };
                    len_ctl.next(most) > 0
                }
                _ => false,
            };
            if ahead_open && model.hold_ahead(draft_now) == 0 && draft_now {
                model.end_ahead().await?;
                ahead_open = false;
            }
            batch = if ahead && (ahead_open || !draft_now) {
                if !ahead_open {
                    // Steps left: every token still wanted, within the context (the cache holds
                    // all of history but the last token).
                    let limit = (req.max_tokens - out_ids.len()).min(context + 1 - history.len());
                    model.begin_ahead(seq, *history.last().expect("a sampled token"), limit, gpu_sampling).await?;
                    ahead_open = true;
                    draws = sampler.clone();
                    // The run's first step draws the output's next token.
                    draw_index = out_ids.len();
                }
                let step = model
                    .ahead_next(&mut || {
                        let row = sampler.row_draw(draw_index);
                        draw_index += 1;
                        (row, if gpu_sampling.is_some() { draws.uniform() as f32 } else { 0.0 })
                    })
                    .await?;
                let token = match &step.top {
                    Some(top) => sampler.sample_step(top, 0, model.config.vocab_size),
                    None => step.token,
                };
                if token != step.token {
                    // The GPU drew another token: the steps after it ran on that one.
                    model.end_ahead().await?;
                    ahead_open = false;
                    redraws += 1;
                }
                let now = Instant::now();
                let ms = (now - last_arrival).as_secs_f64() * 1e3;
                model.record_step_ms(1, ms);
                last_arrival = now;
                if let Some((len_ctl, stats)) = spec.as_mut() {
                    len_ctl.observe_lookup(&req.speculation, &history, token);
                    len_ctl.record(0, 0, 0.0, ms);
                    stats.record(0, 0, 0.0, ms);
                    stats.expect(1.0);
                }
                vec![token]
            } else {
                let out = next_tokens(model, drafting, req, seq, &history, out_ids.len(), &mut sampler, want, &mut spec, &mut guide, &bias)
                    .await?;
                last_arrival = Instant::now();
                out
            };
        };
        Ok::<_, LanternError>(finish)
    }
    .await;
    // Steps still in flight past a stop are drained and their KV rolled back.
    let ended = if ahead_open { model.end_ahead().await } else { Ok(()) };
    let finish = r?;
    ended?;
    let decoded = out_ids.len().saturating_sub(1);
    let plain_ms = model.step_costs().get(1).copied().flatten();
    let speculative = match (spec, unspeculated) {
        (Some((_, mut stats)), _) => {
            stats.finish(plain_ms);
            Some(stats)
        }
        (None, Some((drafter, reason))) => {
            Some(SpecStats::unspeculated(drafter, reason, decoded, decode_start.1.elapsed().as_secs_f64() * 1e3, plain_ms))
        }
        (None, None) => None,
    };
    let host = (decoded > 0).then(|| {
        let wall = decode_start.1.elapsed().as_secs_f64() * 1e3;
        HostCosts { redraws, ..HostCosts::new(&model.ctx.host_counts().since(&decode_start.0), decoded, wall) }
    });
    if let Some(rest) = stream.finish(tokenizer, finish)? {
        on_text(&rest);
    }
    let text = stream.text;
    timings.finished = Some(Instant::now());
    Ok(Generation {
        prompt_ids: req.prompt_ids.clone(),
        output_ids: out_ids,
        text,
        finish_reason: finish,
        stop_string: stream.matched,
        timings,
        cached_prompt_tokens: 0,
        speculative,
        logprobs: Vec::new(),
        host,
    })
}

/// Output text of one sequence as its tokens arrive: complete UTF-8 pieces, stop ids, and
/// stop strings (text is cut before the first one; text that may be the start of one is held
/// back until it is not).
pub(crate) struct TextStream {
    decoder: crate::model::tokenizer::StreamDecoder,
    pub(crate) text: String,
    /// The stop string that ended the text.
    pub(crate) matched: Option<String>,
    emitted: usize,
    hold: usize,
}

impl TextStream {
    pub(crate) fn new(tokenizer: &Tokenizer, stop_strings: &[String]) -> Self {
        TextStream {
            decoder: tokenizer.stream_decoder(),
            text: String::new(),
            matched: None,
            emitted: 0,
            hold: stop_strings.iter().map(|s| s.len()).max().unwrap_or(0),
        }
    }

    /// Take `token`: the text now safe to show, and `Stop` when a stop id or string ended
    /// the sequence.
    pub(crate) fn push(
        &mut self,
        tokenizer: &Tokenizer,
        token: u32,
        stop_ids: &[u32],
        stop_strings: &[String],
    ) -> Result<(Option<String>, Option<FinishReason>)> {
        if stop_ids.contains(&token) {
            // The stop token's own text is not part of the output.
            let _ = self.decoder.step(tokenizer, token)?;
            return Ok((None, Some(FinishReason::Stop)));
        }
        if let Some(piece) = self.decoder.step(tokenizer, token)? {
            self.text.push_str(&piece);
        }
        let first =
            stop_strings.iter().filter(|s| !s.is_empty()).filter_map(|s| self.text.find(s.as_str()).map(|i| (i, s))).min_by_key(|m| m.0);
        if let Some((cut, stop)) = first {
            self.matched = Some(stop.clone());
            self.text.truncate(cut);
            let piece = (cut > self.emitted).then(|| self.text[self.emitted..cut].to_string());
            self.emitted = self.text.len();
            return Ok((piece, Some(FinishReason::Stop)));
        }
        let safe = self.text.len().saturating_sub(self.hold);
        let safe = (0..=safe).rev().find(|&i| self.text.is_char_boundary(i)).unwrap_or(0);
        if safe > self.emitted {
            let piece = self.text[self.emitted..safe].to_string();
            self.emitted = safe;
            return Ok((Some(piece), None));
        }
        Ok((None, None))
    }

    /// The sequence ended with `finish`: the text not shown yet (none when cancelled; a
    /// stop leaves no held-back text after the cut).
    pub(crate) fn finish(&mut self, tokenizer: &Tokenizer, finish: FinishReason) -> Result<Option<String>> {
        if finish != FinishReason::Stop {
            if let Some(rest) = self.decoder.finish(tokenizer)? {
                self.text.push_str(&rest);
            }
        }
        if finish == FinishReason::Cancelled || self.text.len() <= self.emitted {
            return Ok(None);
        }
        let piece = self.text[self.emitted..].to_string();
        self.emitted = self.text.len();
        Ok(Some(piece))
    }
}

//! Continuous batching: an [`Engine`] owns a loaded model and serves many requests on it at
//! once. `submit` returns a [`RequestHandle`] that streams [`Event`]s and can cancel; `step`
//! runs one scheduler iteration: every running sequence gets its next token (decode) or the
//! next chunk of its prompt (chunked prefill) within a token budget per step, new requests are
//! admitted while KV pages and sequence slots allow (taking cached prefix pages first), and
//! when the cache runs out the youngest running sequence is preempted (its pages freed, its
//! prompt and output so far recomputed when it is readmitted). One GPU step serves all of
//! them: the kernels take tokens of many sequences (each token carries its sequence and
//! position), greedy rows read back 4-byte token ids, sampled rows their logits.
//!
//! Nothing here blocks: `step` is async (GPU readback), so the same engine runs in a server
//! thread (`run_until_idle` under pollster) or a browser event loop.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use futures_channel::mpsc::{unbounded, UnboundedReceiver, UnboundedSender};
use web_time::Instant;

use super::constraint::{self, Guide};
use super::generate::{FinishReason, GenerateRequest, Generation, TextStream};
use super::logit_bias::BiasState;
use super::metrics::RequestTimings;
use super::sampler::{Dist, Sampler, TokenLogprob};
use super::speculative::{self, DraftJob, DraftLength, Drafter, SpecStats};
use crate::kernels::argmax::RowDraw;
use crate::kv::KvError;
use crate::model::forward::{BatchFlight, GpuModel, LogitOps, Want};
use crate::model::tokenizer::Tokenizer;
use crate::{LanternError, Result};

mod ahead;
mod complete;
mod draft;
mod schedule;

use ahead::Chain;

/// Scheduling limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct EngineOptions {
    /// Tokens per step (decode tokens + prefill chunks); at most the model's
    /// `max_batch_tokens`.
    pub step_tokens: usize,
    /// Most prompt tokens one sequence prefills per step, so that a long prompt shares the
    /// step with running streams instead of stalling them.
    pub prefill_chunk: usize,
    /// Requests waiting for admission at most; `submit` refuses more (`Overloaded`).
    pub max_waiting: usize,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions { step_tokens: 128, prefill_chunk: 64, max_waiting: 256 }
    }
}

/// What a request's handle receives.
#[derive(Debug, Clone)]
pub enum Event {
    /// A sampled token and the text it completes (may be empty: part of a character, or
    /// held back because it may begin a stop string); its log-probabilities when asked for.
    Token { id: u32, text: String, logprob: Option<Box<TokenLogprob>> },
    /// Text released when the request ends (held back earlier, or the decoder's rest).
    Text(String),
    /// The request ended normally (stop, length, context full, cancelled).
    Done(Box<Generation>),
    /// The request failed; no more events follow.
    Error(String),
}

/// The caller's side of a request.
pub struct RequestHandle {
    pub id: u64,
    events: UnboundedReceiver<Event>,
    cancel: Arc<AtomicBool>,
}

impl RequestHandle {
    /// Ask the engine to stop this request (its pages are freed at the next step; a `Done`
    /// with `FinishReason::Cancelled` follows).
    pub fn cancel(&self) {
        self.cancel.store(true, Ordering::Relaxed);
    }

    /// A flag that cancels the request when set (for another thread).
    pub fn cancel_flag(&self) -> Arc<AtomicBool> {
        self.cancel.clone()
    }

    /// The next event without waiting: `Ok(None)` when none is ready yet, `Err(())` when the
    /// stream has ended.
    #[allow(clippy::result_unit_err)]
    pub fn try_next(&mut self) -> std::result::Result<Option<Event>, ()> {
        match self.events.try_recv() {
            Ok(e) => Ok(Some(e)),
            Err(futures_channel::mpsc::TryRecvError::Empty) => Ok(None),
            Err(futures_channel::mpsc::TryRecvError::Closed) => Err(()),
        }
    }

    /// The next event, waiting for it; `None` when the stream has ended.
    pub async fn next(&mut self) -> Option<Event> {
        use futures_core::Stream;
        std::future::poll_fn(|cx| std::pin::Pin::new(&mut self.events).poll_next(cx)).await
    }
}

/// One request inside the engine.
struct Seq {
    id: u64,
    req: GenerateRequest,
    /// KV sequence slot while admitted.
    slot: Option<usize>,
    /// Prompt, then every sampled token: what the cache must hold before the next sample.
    tokens: Vec<u32>,
    /// Tokens of `tokens` whose K/V are in the cache.
    computed: usize,
    out: Vec<u32>,
    sampler: Sampler,
    stream: TextStream,
    timings: RequestTimings,
    cached_prompt_tokens: usize,
    prompt_registered: bool,
    preemptions: usize,
    tx: UnboundedSender<Event>,
    cancel: Arc<AtomicBool>,
    /// Speculative decoding state, when the request asked for it (and is not constrained).
    spec: Option<SeqSpec>,
    /// Log-probabilities of the output so far (with `GenerateRequest::logprobs`).
    logprobs: Vec<TokenLogprob>,
    /// Parallel samples of the same prompt ([`Engine::submit_n`]) waiting for this one to
    /// compute all but the prompt's last token; then each forks its KV pages.
    held: Vec<Seq>,
    /// Constrained decoding: the grammar's state, which masks the sequence's logit rows.
    guide: Option<Guide>,
    /// Logit bias and penalties: what is added to the sequence's logit rows.
    bias: Option<BiasState>,
    /// While its steps are decoded ahead with GPU draws: a copy of `sampler` that gave those
    /// draws their numbers, ahead of the sampler itself.
    draws: Option<Sampler>,
    /// Its row of the step in flight was fed a token the host's sampler did not draw: the
    /// row is dropped and its position given back when that step lands.
    stale: bool,
}

/// A speculative sequence's state in the engine.
struct SeqSpec {
    len: DraftLength,
    stats: SpecStats,
    /// Its sequence in the draft model's cache (draft-model speculation).
    draft_slot: Option<usize>,
    /// Drafts for the coming step.
    drafts: Vec<u32>,
    draft_ms: f64,
}

impl Seq {
    fn cancelled(&self) -> bool {
        self.cancel.load(Ordering::Relaxed) || self.tx.is_closed()
    }

    /// Tokens to compute before sampling can stop: all it holds, or with parallel samples
    /// still held, all but the prompt's last token (each sample computes that one itself,
    /// on forked pages, for a logits row of its own).
    fn compute_limit(&self) -> usize {
        self.tokens.len() - usize::from(!self.held.is_empty())
    }
}

/// What one `step` did.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct StepReport {
    /// Tokens computed in the step (decode tokens + prefill chunk tokens).
    pub tokens: usize,
    /// Sequences that sampled a token.
    pub sampled: usize,
    /// Sequences that took part.
    pub sequences: usize,
    pub prefill_tokens: usize,
    pub admitted: usize,
    pub preempted: usize,
    pub finished: usize,
}

/// The inputs of a scheduled step, and per sequence: (id, tokens, first logits row, rows:
/// 1, or 1 + drafts for a verify).
struct Scheduled {
    ids: Vec<u32>,
    positions: Vec<u32>,
    seqs: Vec<u32>,
    rows: Vec<u32>,
    want: Want,
    sampling: Vec<(u64, usize, Option<usize>, usize)>,
    started: Instant,
    /// Its time is one step's cost (not a step submitted ahead, whose time includes the
    /// step before it).
    timed: bool,
}

/// What a host gives Lantern out of one frame: a time budget (wall time inside the call)
/// and a work budget (GPU dispatches submitted in the call). A `Duration` converts into a
/// time-only budget; [`FrameBudget::dispatches`] makes a work-only one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameBudget {
    pub time: std::time::Duration,
    pub max_dispatches: usize,
}

impl FrameBudget {
    /// At most `n` dispatches per call (at least one, so steps progress), no time limit.
    pub fn dispatches(n: usize) -> FrameBudget {
        FrameBudget { time: std::time::Duration::MAX, max_dispatches: n.max(1) }
    }
}

impl From<std::time::Duration> for FrameBudget {
    fn from(time: std::time::Duration) -> FrameBudget {
        FrameBudget { time, max_dispatches: usize::MAX }
    }
}

/// What one `step_within` call did.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct FrameReport {
    /// The report of the step that completed during this call, if one did.
    pub step: Option<StepReport>,
    /// A step is still on the GPU (call again next frame).
    pub in_flight: bool,
    /// GPU dispatches this call submitted.
    pub submitted: usize,
}

/// Totals since the engine started.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct EngineStats {
    pub steps: u64,
    pub submitted: u64,
    pub finished: u64,
    pub failed: u64,
    pub cancelled: u64,
    pub preemptions: u64,
    pub prompt_tokens_computed: u64,
    pub prompt_tokens_cached: u64,
    pub output_tokens: u64,
    /// Steps submitted before the tokens of the step before them were read (decoding
    /// ahead: the device had the step queued while the host completed the previous one).
    pub steps_ahead: u64,
    /// Of those, steps whose sampled rows were drawn on the GPU.
    pub sampled_steps_ahead: u64,
    /// Tokens the GPU drew that the request's sampler did not (f32 rounding at a boundary):
    /// the sequence's row of the step behind was dropped and computed again.
    pub redraws: u64,
}

/// Many requests served together on one model.
pub struct Engine {
    pub model: GpuModel,
    pub tokenizer: Arc<Tokenizer>,
    pub options: EngineOptions,
    waiting: VecDeque<Seq>,
    /// Admitted sequences, oldest first.
    running: Vec<Seq>,
    next_id: u64,
    stats: EngineStats,
    /// A frame-budgeted step on the GPU (`step_within`).
    pending: Option<(Scheduled, crate::model::forward::PendingStep, StepReport)>,
    /// A decode step submitted ahead whose tokens have not been read.
    chain: Option<Chain>,
    /// Tests only: the GPU draws chained steps' sampled rows with other numbers than the
    /// samplers', so that the redraw path runs ([`Engine::skew_gpu_draws`]).
    skew_draws: bool,
    /// The draft model for draft-model speculation ([`Engine::set_draft`]).
    draft: Option<GpuModel>,
}

/// Alternatives per token `GenerateRequest::logprobs` may ask for (OpenAI's bound).
pub const MAX_LOGPROBS: usize = 20;

/// Why `submit` refused a request.
fn refuse(msg: String) -> LanternError {
    LanternError::InvalidRequest(msg)
}

impl Engine {
    pub fn new(model: GpuModel, tokenizer: Arc<Tokenizer>, mut options: EngineOptions) -> Engine {
        options.step_tokens = options.step_tokens.clamp(1, model.options.max_batch_tokens.max(1));
        options.prefill_chunk = options.prefill_chunk.clamp(1, options.step_tokens);
        Engine {
            model,
            tokenizer,
            options,
            waiting: VecDeque::new(),
            running: Vec::new(),
            next_id: 0,
            stats: EngineStats::default(),
            pending: None,
            chain: None,
            skew_draws: false,
            draft: None,
        }
    }

    /// Load `weights` onto a device the host application already has and serve them: the
    /// host keeps its device and queue (Lantern records its own command buffers on that
    /// queue) and may build several engines (models) on the same device.
    pub async fn with_device(
        device: wgpu::Device,
        queue: wgpu::Queue,
        weights: &crate::model::ModelWeights,
        tokenizer: Arc<Tokenizer>,
        model_options: crate::model::forward::ModelOptions,
        options: EngineOptions,
    ) -> Result<Engine> {
        let ctx = crate::gpu::GpuContext::from_device(device, queue).map_err(LanternError::Gpu)?;
        let model = GpuModel::load(ctx, weights, model_options).await?;
        Ok(Engine::new(model, tokenizer, options))
    }

    /// Measure the step costs speculation with `s` chooses k from
    /// ([`super::step_costs::ensure`]) on the idle engine's model and draft model; returns the
    /// milliseconds it took (0 when they were known). Call it at load time.
    pub async fn measure_step_costs(&mut self, s: &super::Speculation) -> Result<f64> {
        if !self.is_idle() {
            return Err(LanternError::InvalidRequest("measuring step costs needs an idle engine (call it before submitting)".into()));
        }
        super::step_costs::ensure(&mut self.model, self.draft.as_mut(), s).await
    }

    /// The engine's model and draft model (to keep their step costs: `step_costs::save`).
    pub fn models(&self) -> (&GpuModel, Option<&GpuModel>) {
        (&self.model, self.draft.as_ref())
    }

    /// The same, to give them step costs kept earlier (`step_costs::load`).
    pub fn models_mut(&mut self) -> (&mut GpuModel, Option<&mut GpuModel>) {
        (&mut self.model, self.draft.as_mut())
    }

    /// The model back (requests still queued are dropped: their handles end).
    /// Compile and touch everything a step uses before the first frame
    /// ([`GpuModel::warm_up`]); call it at load time, outside the frame loop, while the
    /// engine is idle. Returns the milliseconds it took.
    pub async fn warm_up(&mut self) -> Result<f64> {
        if !self.is_idle() {
            return Err(LanternError::InvalidRequest("warm_up needs an idle engine (call it before submitting)".into()));
        }
        self.model.warm_up().await
    }

    /// For tests of decoding ahead: with `on`, chained steps draw their sampled rows on the
    /// GPU with numbers shifted by a half from the samplers' own, so most GPU draws differ
    /// from the requests' samplers and every one of them takes the redraw path (the output
    /// must not change).
    #[doc(hidden)]
    pub fn skew_gpu_draws(&mut self, on: bool) {
        self.skew_draws = on;
    }

    /// (A decode step still in flight ahead is abandoned: its tokens are never read.)
    pub fn into_model(self) -> GpuModel {
        self.model
    }

    /// Serve draft-model speculation (`Drafter::Model` requests) with `draft`, whose
    /// tokenizer must be the engine's ([`speculative::check_pair`]). The engine must be idle.
    pub fn set_draft(&mut self, draft: GpuModel, draft_tokenizer: &Tokenizer) -> Result<()> {
        if !self.is_idle() {
            return Err(LanternError::InvalidRequest("set_draft needs an idle engine".into()));
        }
        speculative::check_pair(
            ("the target model", &self.model.config, &self.tokenizer),
            ("the draft model", &draft.config, draft_tokenizer),
        )?;
        self.draft = Some(draft);
        Ok(())
    }

    /// The draft model back, if one was set.
    pub fn take_draft(&mut self) -> Option<GpuModel> {
        self.draft.take()
    }

    /// Whether a draft model is set.
    pub fn has_draft(&self) -> bool {
        self.draft.is_some()
    }

    pub fn stats(&self) -> &EngineStats {
        &self.stats
    }

    /// Requests admitted (holding KV pages) and waiting.
    pub fn running(&self) -> usize {
        self.running.len()
    }

    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// The unit-length embedding of `tokens` ([`GpuModel::embedding`]), run between two
    /// steps on a sequence of its own. Refused while a frame-budgeted step is in flight;
    /// `KvError::NoSequenceSlot` or `KvError::Full` when the running requests leave no room
    /// for it now (the worker then retries after the next step).
    pub async fn embedding(&mut self, tokens: &[u32], pooling: crate::model::forward::Pooling) -> Result<Vec<f32>> {
        if self.pending.is_some() {
            return Err(LanternError::InvalidRequest("an embedding cannot run while a frame-budgeted step is in flight".into()));
        }
        // A decode step ahead lands first: the embedding's steps share the workspace.
        if let Some(c) = self.chain.take() {
            self.land_chain(c, false).await?;
        }
        self.model.embedding(tokens, pooling).await
    }

    /// No request left (and no step on the GPU).
    pub fn is_idle(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty() && self.pending.is_none() && self.chain.is_none()
    }

    /// Queue a request. Refused at once (typed error, nothing queued) when the prompt is
    /// empty or does not fit the context, when it could never fit the whole cache, or when
    /// the queue is full.
    pub fn submit(&mut self, req: GenerateRequest) -> Result<RequestHandle> {
        let context = self.model.kv.alloc.config.context;
        if req.prompt_ids.is_empty() {
            return Err(refuse("the prompt is empty (no tokens to condition on)".into()));
        }
        if req.prompt_ids.len() >= context {
            return Err(LanternError::PromptTooLong { prompt_tokens: req.prompt_ids.len(), max_new: req.max_tokens, context });
        }
        if let Some(&bad) = req.prompt_ids.iter().find(|&&t| t as usize >= self.model.config.vocab_size) {
            return Err(refuse(format!("token id {bad} is outside the vocabulary (size {})", self.model.config.vocab_size)));
        }
        // A request that could not fit even in an empty cache would wait forever.
        let page = self.model.kv.alloc.config.page_size;
        let most = req.prompt_ids.len().saturating_add(req.max_tokens.max(1)).min(context);
        let total = self.model.kv.alloc.total_pages();
        if most.div_ceil(page) > total {
            return Err(LanternError::Kv(KvError::Full { needed: most.div_ceil(page), free: total, total, page_size: page }));
        }
        // A constraint that does not compile is refused here, before anything is queued.
        // Constrained requests decode without speculation (drafts are not checked against
        // the grammar).
        let guide = constraint::guide_for(&self.tokenizer, req.constraint.as_ref(), self.model.config.vocab_size, &req.stop_ids)?;
        req.bias.check(self.model.config.vocab_size).map_err(refuse)?;
        if req.logprobs.is_some_and(|k| k > MAX_LOGPROBS) {
            return Err(refuse(format!("logprobs asks for {} alternatives; at most {MAX_LOGPROBS}", req.logprobs.unwrap_or(0))));
        }
        let speculate = speculates(&req, &guide);
        if speculate && req.speculation.drafter == Drafter::Model && self.draft.is_none() {
            return Err(refuse("speculation with a draft model needs a draft model in the engine (--draft)".into()));
        }
        if req.max_tokens == 0 {
            // Nothing to generate: done at once, like `generate`.
            let (tx, rx) = unbounded();
            let now = Instant::now();
            let mut timings = RequestTimings::new(now);
            timings.finished = Some(now);
            let g = Generation {
                prompt_ids: req.prompt_ids.clone(),
                output_ids: Vec::new(),
                text: String::new(),
                finish_reason: FinishReason::Length,
                stop_string: None,
                timings,
                cached_prompt_tokens: 0,
                speculative: None,
                logprobs: Vec::new(),
                host: None,
            };
            let _ = tx.unbounded_send(Event::Done(Box::new(g)));
            let id = self.next_id;
            self.next_id += 1;
            return Ok(RequestHandle { id, events: rx, cancel: Arc::new(AtomicBool::new(false)) });
        }
        if self.waiting.len() >= self.options.max_waiting {
            return Err(LanternError::Overloaded { waiting: self.waiting.len(), max_waiting: self.options.max_waiting });
        }
        let (seq, handle) = self.new_seq(req, guide, speculate);
        self.waiting.push_back(seq);
        Ok(handle)
    }

    /// Queue `n` samples of one prompt (OpenAI's `n`): one sequence computes the prompt, the
    /// others fork its KV pages (shared, copy-on-write for the partial last page) before its
    /// last token, so the prompt's pages are held once. Sample `i` samples with seed
    /// `seed + i`. Refused like [`Engine::submit`], and when `n` is 0 or exceeds the
    /// engine's sequences. Sequences of a group are independent after the fork; cancelling
    /// the first before it releases leaves the others running alone.
    pub fn submit_n(&mut self, req: GenerateRequest, n: usize) -> Result<Vec<RequestHandle>> {
        let max_seqs = self.model.kv.alloc.config.max_seqs;
        if n == 0 || n > max_seqs {
            return Err(refuse(format!("n = {n}: parallel samples must number 1 to {max_seqs} (the engine's sequences)")));
        }
        if self.waiting.len() + n > self.options.max_waiting && n > 1 {
            return Err(LanternError::Overloaded { waiting: self.waiting.len(), max_waiting: self.options.max_waiting });
        }
        let sample = |i: usize| {
            let mut r = req.clone();
            r.sampling.seed = r.sampling.seed.wrapping_add(i as u64);
            r
        };
        let first = self.submit(sample(0))?;
        let mut handles = vec![first];
        if req.max_tokens == 0 {
            for i in 1..n {
                handles.push(self.submit(sample(i))?);
            }
            return Ok(handles);
        }
        let mut held = Vec::with_capacity(n - 1);
        for i in 1..n {
            let r = sample(i);
            // Each sample walks the grammar on its own (it compiled for the first).
            let guide = constraint::guide_for(&self.tokenizer, r.constraint.as_ref(), self.model.config.vocab_size, &r.stop_ids)?;
            let speculate = speculates(&r, &guide);
            let (seq, handle) = self.new_seq(r, guide, speculate);
            held.push(seq);
            handles.push(handle);
        }
        self.waiting.back_mut().expect("just queued").held = held;
        Ok(handles)
    }

    /// A queued sequence for a checked request (its compiled grammar, whether it speculates).
    fn new_seq(&mut self, req: GenerateRequest, guide: Option<Guide>, speculate: bool) -> (Seq, RequestHandle) {
        let (tx, rx) = unbounded();
        let cancel = Arc::new(AtomicBool::new(false));
        let id = self.next_id;
        self.next_id += 1;
        self.stats.submitted += 1;
        let seq = Seq {
            id,
            tokens: req.prompt_ids.clone(),
            computed: 0,
            out: Vec::new(),
            sampler: Sampler::new(req.sampling),
            stream: TextStream::new(&self.tokenizer, &req.stop_strings),
            timings: RequestTimings::new(Instant::now()),
            cached_prompt_tokens: 0,
            prompt_registered: false,
            preemptions: 0,
            slot: None,
            guide,
            bias: BiasState::new(&req.bias),
            spec: speculate.then(|| SeqSpec {
                len: DraftLength::new(&req.speculation)
                    .with_costs(self.model.step_costs(), self.draft.as_ref().map(|d| d.step_costs()))
                    .with_memory(speculative::memory(req.speculation.drafter, &self.model, self.draft.as_ref())),
                stats: SpecStats::new(req.speculation.drafter),
                draft_slot: None,
                drafts: Vec::new(),
                draft_ms: 0.0,
            }),
            req,
            tx,
            cancel: cancel.clone(),
            held: Vec::new(),
            draws: None,
            stale: false,
            logprobs: Vec::new(),
        };
        (seq, RequestHandle { id, events: rx, cancel })
    }

    /// Step until no request is left.
    pub async fn run_until_idle(&mut self) -> Result<()> {
        while !self.is_idle() {
            self.step().await?;
        }
        Ok(())
    }

    /// End `s` (already out of the running/waiting lists): free its pages and send `Done`.
    /// Free `s`'s sequence in the draft model and forget its drafts.
    fn release_draft(&mut self, s: &mut Seq) {
        if let Some(sp) = s.spec.as_mut() {
            if let (Some(d), Some(slot)) = (self.draft.as_mut(), sp.draft_slot.take()) {
                d.release_sequence(slot);
            }
            sp.drafts.clear();
        }
    }

    /// Parallel samples still held by `s` go on alone (first in the queue).
    fn release_held(&mut self, s: &mut Seq) {
        for f in s.held.drain(..).rev() {
            self.waiting.push_front(f);
        }
    }

    fn finish(&mut self, mut s: Seq, reason: FinishReason) {
        self.release_held(&mut s);
        if let Some(slot) = s.slot.take() {
            self.model.release_sequence(slot);
        }
        self.release_draft(&mut s);
        let tail = s.stream.finish(&self.tokenizer, reason).ok().flatten();
        if let Some(t) = tail {
            let _ = s.tx.unbounded_send(Event::Text(t));
        }
        s.timings.finished = Some(Instant::now());
        match reason {
            FinishReason::Cancelled => self.stats.cancelled += 1,
            _ => self.stats.finished += 1,
        }
        let g = Generation {
            prompt_ids: s.req.prompt_ids.clone(),
            output_ids: std::mem::take(&mut s.out),
            text: std::mem::take(&mut s.stream.text),
            finish_reason: reason,
            stop_string: s.stream.matched.take(),
            timings: s.timings.clone(),
            cached_prompt_tokens: s.cached_prompt_tokens,
            speculative: s.spec.as_ref().map(|sp| sp.stats.clone()),
            logprobs: std::mem::take(&mut s.logprobs),
            // Engine steps serve many requests at once: their host costs are the engine's
            // (`lantern bench`), not one request's.
            host: None,
        };
        let _ = s.tx.unbounded_send(Event::Done(Box::new(g)));
    }

    fn fail(&mut self, mut s: Seq, msg: String) {
        self.release_held(&mut s);
        if let Some(slot) = s.slot.take() {
            self.model.release_sequence(slot);
        }
        self.release_draft(&mut s);
        self.stats.failed += 1;
        let _ = s.tx.unbounded_send(Event::Error(msg));
    }

    /// Free the pages of running sequence `i` and queue it first for readmission (its
    /// prompt and output so far are recomputed then: preemption by recompute).
    fn preempt(&mut self, i: usize) {
        let mut s = self.running.remove(i);
        if let Some(slot) = s.slot.take() {
            self.model.release_sequence(slot);
        }
        self.release_draft(&mut s);
        s.computed = 0;
        s.preemptions += 1;
        self.stats.preemptions += 1;
        self.waiting.push_front(s);
    }

    /// One scheduler iteration and one GPU step. Returns what it did (nothing when idle).
    pub async fn step(&mut self) -> Result<StepReport> {
        if let Some((sch, mut p, report)) = self.pending.take() {
            // A frame-budgeted step is in flight: finish it first.
            let out = loop {
                match self.model.advance(&mut p, web_time::Instant::now(), crate::model::forward::DISPATCHES_PER_SUBMIT).await {
                    Ok(Some(o)) => break Ok(o),
                    Ok(None) => {
                        // Submitted work remains: wait for the device instead of spinning.
                        #[cfg(not(target_arch = "wasm32"))]
                        let _ = self.model.ctx.device.poll(wgpu::PollType::wait_indefinitely());
                    }
                    Err(e) => break Err(e),
                }
            };
            return self.complete(sch, out, report);
        }
        if let Some(c) = self.chain.take() {
            return self.land_chain(c, true).await;
        }
        self.draft_with_model().await;
        let (report, sch) = self.schedule()?;
        let Some(mut sch) = sch else { return Ok(report) };
        sch.started = Instant::now();
        if let Some(rows) = self.chains(&sch) {
            return self.start_chain(sch, rows, report).await;
        }
        let bias = step_bias(&self.running, &sch.sampling, sch.rows.len());
        let draws = step_draws(&self.running, &sch.sampling, sch.rows.len());
        let out = if guided(&self.running, &sch.sampling) {
            // The masks are computed while the GPU runs the step's layers.
            let (running, sampling, n_rows, vocab) = (&mut self.running, &sch.sampling, sch.rows.len(), self.model.config.vocab_size);
            let mut masks = || Ok(step_masks(running, sampling, n_rows, vocab));
            let ops = LogitOps { bias, mask: Some(&mut masks), draws };
            self.model.step_batch_with(&sch.ids, &sch.positions, &sch.seqs, &sch.rows, sch.want, ops).await
        } else {
            let ops = LogitOps { bias, mask: None, draws };
            self.model.step_batch_with(&sch.ids, &sch.positions, &sch.seqs, &sch.rows, sch.want, ops).await
        };
        self.complete(sch, out, report)
    }

    /// A frame-budgeted step for hosts with a frame loop: schedules a step when none is in
    /// flight, submits its dispatches a few at a time until `budget` has passed (at least one
    /// batch per call), and collects its result once the GPU has it, never waiting on the
    /// GPU. Tokens arrive through the handles as with `step`; `FrameReport::step` is the
    /// report of a step that completed in this call. Prompt-lookup speculation runs here as
    /// in `step`; draft-model drafting does not (its draft steps are not split across
    /// frames), so draft-model requests decode without drafts on this path.
    pub async fn step_within(&mut self, budget: impl Into<FrameBudget>) -> Result<FrameReport> {
        let budget = budget.into();
        if let Some(c) = self.chain.take() {
            // A step decoded ahead by `step` lands first (this path never decodes ahead).
            let r = self.land_chain(c, false).await?;
            return Ok(FrameReport { step: Some(r), in_flight: false, submitted: 0 });
        }
        let now = web_time::Instant::now();
        let deadline = now.checked_add(budget.time).unwrap_or(now + std::time::Duration::from_secs(3600));
        let (sch, mut p, report) = match self.pending.take() {
            Some(x) => x,
            None => {
                let (report, sch) = self.schedule()?;
                let Some(mut sch) = sch else { return Ok(FrameReport { step: Some(report), in_flight: false, submitted: 0 }) };
                sch.started = Instant::now();
                // This path submits a step over several calls: the masks are computed first.
                let bias = step_bias(&self.running, &sch.sampling, sch.rows.len());
                let draws = step_draws(&self.running, &sch.sampling, sch.rows.len());
                let r = if guided(&self.running, &sch.sampling) {
                    let (running, sampling, n_rows, vocab) =
                        (&mut self.running, &sch.sampling, sch.rows.len(), self.model.config.vocab_size);
                    let mut masks = || Ok(step_masks(running, sampling, n_rows, vocab));
                    let ops = LogitOps { bias, mask: Some(&mut masks), draws };
                    self.model.begin_step_batch_with(&sch.ids, &sch.positions, &sch.seqs, &sch.rows, sch.want, ops)
                } else {
                    let ops = LogitOps { bias, mask: None, draws };
                    self.model.begin_step_batch_with(&sch.ids, &sch.positions, &sch.seqs, &sch.rows, sch.want, ops)
                };
                match r {
                    Ok(p) => (sch, p, report),
                    Err(e) => {
                        return self.complete(sch, Err(e), report).map(|r| FrameReport { step: Some(r), in_flight: false, submitted: 0 })
                    }
                }
            }
        };
        let before = p.submitted();
        let r = self.model.advance(&mut p, deadline, budget.max_dispatches).await;
        let submitted = p.submitted() - before;
        match r {
            Ok(None) => {
                self.pending = Some((sch, p, report));
                Ok(FrameReport { step: None, in_flight: true, submitted })
            }
            Ok(Some(out)) => self.complete(sch, Ok(out), report).map(|r| FrameReport { step: Some(r), in_flight: false, submitted }),
            Err(e) => self.complete(sch, Err(e), report).map(|r| FrameReport { step: Some(r), in_flight: false, submitted }),
        }
    }
}

/// Whether a request decodes speculatively: asked for, and neither constrained, biased nor
/// asking for logprobs (drafts are checked against none of those).
fn speculates(req: &GenerateRequest, guide: &Option<Guide>) -> bool {
    req.speculation.enabled() && guide.is_none() && req.logprobs.is_none() && req.bias.is_none()
}

/// The step's bias pairs, one row per logit row (empty for a sequence without biases;
/// none at all when no sampled sequence has any).
fn step_bias(running: &[Seq], sampling: &[(u64, usize, Option<usize>, usize)], n_rows: usize) -> Vec<Vec<(u32, f32)>> {
    let mut rows = Vec::new();
    for &(id, _, row, n) in sampling {
        let (Some(r), Some(b)) = (row, running.iter().find(|s| s.id == id).and_then(|s| s.bias.as_ref())) else { continue };
        if rows.is_empty() {
            rows = vec![Vec::new(); n_rows];
        }
        let pairs = b.row();
        for row in &mut rows[r..r + n] {
            row.clone_from(&pairs);
        }
    }
    rows
}

/// How the GPU chooses each logit row's token (in row order; empty when every row takes the
/// argmax): a sequence sampling without a top-k draws its next tokens there
/// ([`Sampler::row_draw`] from its output's length on: one row, or one per verified
/// position).
fn step_draws(running: &[Seq], sampling: &[(u64, usize, Option<usize>, usize)], n_rows: usize) -> Vec<RowDraw> {
    let mut rows = Vec::new();
    for &(id, _, row, n) in sampling {
        let Some(r) = row else { continue };
        let Some(s) = running.iter().find(|s| s.id == id).filter(|s| s.sampler.draws_on_gpu()) else { continue };
        if rows.is_empty() {
            rows = vec![RowDraw::ARGMAX; n_rows];
        }
        for (j, d) in rows[r..r + n].iter_mut().enumerate() {
            *d = s.sampler.row_draw(s.out.len() + j);
        }
    }
    rows
}

/// Whether a scheduled step samples a row of a constrained sequence.
fn guided(running: &[Seq], sampling: &[(u64, usize, Option<usize>, usize)]) -> bool {
    sampling.iter().any(|&(id, _, row, _)| row.is_some() && running.iter().any(|s| s.id == id && s.guide.is_some()))
}

/// The step's allowed-token bitmasks, one row of `ceil(vocab / 32)` words per logit row: a
/// constrained sequence's from its grammar, every other row all ones. A grammar that fails
/// to give a mask leaves its row open; the sequence then fails on its token alone.
fn step_masks(running: &mut [Seq], sampling: &[(u64, usize, Option<usize>, usize)], n_rows: usize, vocab: usize) -> Vec<u32> {
    let words = Guide::words(vocab);
    let mut masks = vec![u32::MAX; n_rows * words];
    for &(id, _, row, n) in sampling {
        let (Some(r), Some(s)) = (row, running.iter_mut().find(|s| s.id == id)) else { continue };
        if let Some(g) = s.guide.as_mut() {
            for k in r..r + n {
                let out = &mut masks[k * words..(k + 1) * words];
                if g.mask_into(out).is_err() {
                    out.fill(u32::MAX);
                }
            }
        }
    }
    masks
}

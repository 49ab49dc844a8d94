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
use crate::kv::KvError;
use crate::model::forward::{BatchFlight, GpuModel, LogitOps, Want};
use crate::model::tokenizer::Tokenizer;
use crate::{LanternError, Result};

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

/// A greedy decode step of every running sequence on the GPU whose tokens the host has not
/// read yet (decoding ahead in the engine: see [`Engine::step`]).
struct Chain {
    sch: Scheduled,
    flight: BatchFlight,
    report: StepReport,
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
        if self.chains(&sch) {
            // A plain greedy decode step of every running sequence: submitted without
            // waiting, and the next one goes in behind it before its tokens are read.
            return match self.model.submit_decode_batch(Some(&sch.ids), &sch.positions, &sch.seqs) {
                Ok(flight) => self.land_chain(Chain { sch, flight, report }, true).await,
                Err(e) => self.complete(sch, Err(e), report),
            };
        }
        let bias = step_bias(&self.running, &sch.sampling, sch.rows.len());
        let out = if guided(&self.running, &sch.sampling) {
            // The masks are computed while the GPU runs the step's layers.
            let (running, sampling, n_rows, vocab) = (&mut self.running, &sch.sampling, sch.rows.len(), self.model.config.vocab_size);
            let mut masks = || Ok(step_masks(running, sampling, n_rows, vocab));
            let ops = LogitOps { bias, mask: Some(&mut masks) };
            self.model.step_batch_with(&sch.ids, &sch.positions, &sch.seqs, &sch.rows, sch.want, ops).await
        } else {
            let ops = LogitOps { bias, mask: None };
            self.model.step_batch_with(&sch.ids, &sch.positions, &sch.seqs, &sch.rows, sch.want, ops).await
        };
        self.complete(sch, out, report)
    }

    /// Whether a scheduled step can start decoding ahead: the model keeps batched steps in
    /// flight, and the step is one greedy decode token (row `i` for token `i`) of every
    /// running sequence, each of them plain (see [`plain_decode`]).
    fn chains(&self, sch: &Scheduled) -> bool {
        self.model.decodes_batches_ahead()
            && sch.want == Want::Argmax
            && sch.sampling.len() == self.running.len()
            && sch.ids.len() == sch.sampling.len()
            && sch.sampling.iter().enumerate().all(|(i, &(id, take, row, n_rows))| {
                take == 1 && row == Some(i) && n_rows == 1 && self.running.get(i).is_some_and(|s| s.id == id && plain_decode(s))
            })
    }

    /// The step after `prev` (a chained step still in flight), submitted before `prev`'s
    /// tokens are read, where it can be planned without them: the same sequences in the same
    /// order, none cancelled, nobody waiting for admission, each still plain with room for
    /// two more tokens (the one `prev` brings and this one's), and a page for each without
    /// preempting anyone. Its ids are `prev`'s argmax rows, copied on the GPU. `None` when
    /// it cannot (the engine then schedules anew once `prev` has landed).
    fn chain_next(&mut self, prev: &Scheduled) -> Option<Chain> {
        let context = self.model.kv.alloc.config.context;
        if !self.waiting.is_empty() || self.running.len() != prev.sampling.len() {
            return None;
        }
        let fits = self.running.iter().zip(&prev.sampling).all(|(s, p)| {
            s.id == p.0 && !s.cancelled() && plain_decode(s) && s.out.len() + 2 <= s.req.max_tokens && s.tokens.len() + 2 <= context
        });
        if !fits {
            return None;
        }
        let (mut positions, mut seqs) = (Vec::with_capacity(prev.sampling.len()), Vec::with_capacity(prev.sampling.len()));
        for s in &self.running {
            let slot = s.slot.expect("running sequences hold a slot");
            match self.model.kv.alloc.append(slot, 1) {
                Ok(pos) => {
                    positions.push(pos as u32);
                    seqs.push(slot as u32);
                }
                Err(_) => {
                    self.unreserve(&seqs, &positions);
                    return None;
                }
            }
        }
        let flight = match self.model.submit_decode_batch(None, &positions, &seqs) {
            Ok(f) => f,
            Err(_) => {
                self.unreserve(&seqs, &positions);
                return None;
            }
        };
        self.stats.steps_ahead += 1;
        let n = seqs.len();
        let sampling = prev.sampling.iter().enumerate().map(|(i, p)| (p.0, 1, Some(i), 1)).collect();
        let sch = Scheduled {
            ids: Vec::new(),
            positions,
            seqs,
            rows: (0..n as u32).collect(),
            want: Want::Argmax,
            sampling,
            started: Instant::now(),
            timed: false,
        };
        let report = StepReport { tokens: n, sequences: n, ..StepReport::default() };
        Some(Chain { sch, flight, report })
    }

    /// Give back the positions `chain_next` reserved (`seqs[i]` had `positions[i]` appended).
    fn unreserve(&mut self, seqs: &[u32], positions: &[u32]) {
        for (&slot, &pos) in seqs.iter().zip(positions) {
            let _ = self.model.kv.alloc.truncate(slot as usize, pos as usize);
        }
    }

    /// Land a chained step: with `next`, first submit the step after it where it can be
    /// planned without its tokens ([`Self::chain_next`]), so the device never waits for the
    /// host between them; then read its tokens and complete it. Sequences that finish on this
    /// step's tokens leave the running list, and the step after it computed a token past
    /// their end: that token is never read (its sequence is gone when it lands) and its KV
    /// page went back with the sequence.
    async fn land_chain(&mut self, c: Chain, next: bool) -> Result<StepReport> {
        let after = if next { self.chain_next(&c.sch) } else { None };
        let out = self.model.land_decode_batch(c.flight, after.is_none()).await;
        let mut report = self.complete(c.sch, out, c.report);
        match after {
            Some(a) if report.is_ok() => self.chain = Some(a),
            Some(a) => {
                // The step failed and its sequences with it (the same as this one's): drain.
                let _ = self.model.land_decode_batch(a.flight, true).await;
            }
            None => {
                // Nothing behind it: cancellations end now, as a step at a time would.
                if let Ok(r) = report.as_mut() {
                    self.sweep_cancelled(r);
                }
            }
        }
        report
    }

    /// End cancelled and abandoned (handle dropped) requests, freeing their pages.
    fn sweep_cancelled(&mut self, report: &mut StepReport) {
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].cancelled() {
                let s = self.running.remove(i);
                self.finish(s, FinishReason::Cancelled);
                report.finished += 1;
            } else {
                i += 1;
            }
        }
        let mut i = 0;
        while i < self.waiting.len() {
            if self.waiting[i].cancelled() {
                let s = self.waiting.remove(i).expect("index in range");
                self.finish(s, FinishReason::Cancelled);
                report.finished += 1;
            } else {
                i += 1;
            }
        }
    }

    /// The draft tokens a speculative sequence in decode may take this step: at most its
    /// chosen k, one less than the tokens it may still emit, and the context's room.
    fn draft_room(&self, s: &Seq) -> usize {
        let context = self.model.kv.alloc.config.context;
        let Some(sp) = &s.spec else { return 0 };
        if s.slot.is_none() || s.computed + 1 != s.tokens.len() {
            return 0;
        }
        sp.len.next(speculative::draft_limit(s.req.max_tokens, s.out.len(), s.tokens.len(), context, self.model.logit_rows))
    }

    /// Draft-model speculation: every running sequence in decode that asked for it gets its
    /// drafts from the draft model, all in the same draft steps. A draft model that fails
    /// leaves the sequences without drafts this step (they decode plainly).
    async fn draft_with_model(&mut self) {
        if self.draft.is_none() {
            return;
        }
        let mut picks: Vec<(usize, usize)> = Vec::new();
        for (i, s) in self.running.iter().enumerate() {
            let wants = s.spec.as_ref().is_some_and(|sp| sp.stats.drafter == Drafter::Model && sp.drafts.is_empty());
            let k = if wants && !s.cancelled() { self.draft_room(s) } else { 0 };
            if k > 0 {
                picks.push((i, k));
            }
        }
        let Some(draft) = self.draft.as_mut() else { return };
        if picks.is_empty() {
            return;
        }
        // A draft sequence for those without one.
        for &(i, _) in &picks {
            let sp = self.running[i].spec.as_mut().expect("speculative");
            if sp.draft_slot.is_none() {
                sp.draft_slot = draft.new_sequence().ok();
            }
        }
        // New sequences' prompts first, untimed: a prefill is not what draft tokens cost.
        let lagging: Vec<(usize, &[u32])> = picks
            .iter()
            .filter_map(|&(i, _)| {
                self.running[i].spec.as_ref().and_then(|sp| sp.draft_slot).map(|slot| (slot, &self.running[i].tokens[..]))
            })
            .collect();
        let caught = speculative::catch_up(draft, &lagging).await;
        let t0 = Instant::now();
        let mut jobs: Vec<DraftJob<'_>> = Vec::new();
        let mut owners: Vec<usize> = Vec::new();
        for (i, s) in self.running.iter_mut().enumerate() {
            let Some(&(_, k)) = picks.iter().find(|p| p.0 == i) else { continue };
            let Some(slot) = s.spec.as_ref().and_then(|sp| sp.draft_slot) else { continue };
            jobs.push(DraftJob { slot, history: &s.tokens, k, sampler: s.sampler.clone(), tokens: Vec::new() });
            owners.push(i);
        }
        let r = match caught {
            Ok(()) => speculative::draft_tokens(draft, &mut jobs).await,
            Err(e) => Err(e),
        };
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        let results: Vec<Vec<u32>> = jobs.into_iter().map(|j| j.tokens).collect();
        for (i, tokens) in owners.into_iter().zip(results) {
            let sp = self.running[i].spec.as_mut().expect("speculative");
            if r.is_ok() {
                sp.drafts = tokens;
            } else if let Some(slot) = sp.draft_slot.take() {
                // Its draft cache may be out of step: start it again next time.
                draft.release_sequence(slot);
            }
            sp.draft_ms = ms;
        }
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
                let r = if guided(&self.running, &sch.sampling) {
                    let (running, sampling, n_rows, vocab) =
                        (&mut self.running, &sch.sampling, sch.rows.len(), self.model.config.vocab_size);
                    let mut masks = || Ok(step_masks(running, sampling, n_rows, vocab));
                    let ops = LogitOps { bias, mask: Some(&mut masks) };
                    self.model.begin_step_batch_with(&sch.ids, &sch.positions, &sch.seqs, &sch.rows, sch.want, ops)
                } else {
                    let ops = LogitOps { bias, mask: None };
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

    /// The scheduling half of a step: cancellations, decode tokens and prompt chunks of the
    /// running sequences, admissions; the step's inputs (None when there is nothing to run).
    fn schedule(&mut self) -> Result<(StepReport, Option<Scheduled>)> {
        let mut report = StepReport::default();
        // A lost device ends every request with the error (a new engine on a new device is
        // the way on).
        if let Err(e) = self.model.ctx.check_lost() {
            let msg = e.to_string();
            for s in std::mem::take(&mut self.running).into_iter().chain(std::mem::take(&mut self.waiting)) {
                self.fail(s, msg.clone());
            }
            return Err(LanternError::Gpu(e));
        }
        // Cancelled or abandoned (handle dropped) requests free their pages first.
        self.sweep_cancelled(&mut report);

        // Parallel samples fork their first sequence's pages once it has computed all but the
        // prompt's last token (those without a free sequence slot try again next step).
        let mut forked = Vec::new();
        for s in self.running.iter_mut() {
            if s.held.is_empty() || s.computed != s.compute_limit() {
                continue;
            }
            let slot = s.slot.expect("running sequences hold a slot");
            while let Some(mut f) = s.held.pop() {
                match self.model.kv.alloc.fork(slot) {
                    Ok(fs) => {
                        f.slot = Some(fs);
                        f.computed = s.computed;
                        f.cached_prompt_tokens = s.computed;
                        // The first sequence offers the prompt's pages to the prefix cache.
                        f.prompt_registered = true;
                        self.stats.prompt_tokens_cached += s.computed as u64;
                        forked.push(f);
                    }
                    Err(_) => {
                        s.held.push(f);
                        break;
                    }
                }
            }
        }
        self.running.extend(forked);

        // Running sequences first, oldest first: each decode token, or its next prompt chunk.
        let mut budget = self.options.step_tokens;
        // (index into running, tokens this step)
        let mut plan: Vec<(u64, usize)> = Vec::new();
        let mut idx = 0;
        while idx < self.running.len() && budget > 0 {
            let (id, slot, need) = {
                let s = &self.running[idx];
                (s.id, s.slot.expect("running sequences hold a slot"), s.compute_limit() - s.computed)
            };
            // A speculative sequence in decode carries its drafts (looked up now, or drafted
            // by the draft model before scheduling), as many as the step's budget leaves.
            let drafts = if need == 1 { self.drafts_for(idx, budget - 1) } else { 0 };
            let take = need.min(budget).min(if need > 1 { self.options.prefill_chunk } else { 1 }) + drafts;
            if take == 0 {
                idx += 1;
                continue;
            }
            // Room for its tokens: preempt the youngest sequences (those after it) until there
            // is; with none left, this one waits (preempted) for older ones to finish.
            let mut runs = true;
            loop {
                match self.model.check_fits(slot, take) {
                    Ok(()) => break,
                    Err(KvError::Full { .. }) => {
                        let victim = if self.running.len() > idx + 1 { self.running.len() - 1 } else { idx };
                        self.preempt(victim);
                        report.preempted += 1;
                        if victim == idx {
                            runs = false;
                            break;
                        }
                    }
                    Err(e) => {
                        let s = self.running.remove(idx);
                        self.fail(s, e.to_string());
                        runs = false;
                        break;
                    }
                }
            }
            if !runs {
                continue;
            }
            let _ = id;
            self.model.kv.alloc.append(slot, take).map_err(LanternError::Kv)?;
            plan.push((id, take));
            budget -= take;
            idx += 1;
        }

        // Admit waiting requests (first come, first served) while slots, pages and budget
        // allow, leaving a page per running sequence for its next decode tokens.
        while budget > 0 && !self.waiting.is_empty() {
            let Ok(slot) = self.model.new_sequence() else { break };
            let mut s = self.waiting.pop_front().expect("not empty");
            let cached = if self.model.options.prefix_cache {
                // Never the whole prompt: the last token is computed to give logits.
                self.model.attach_cached_prefix(slot, &s.tokens).unwrap_or(0)
            } else {
                0
            };
            let need = s.compute_limit() - cached;
            let reserve = self.running.len() + s.held.len();
            let needed_pages = self.model.kv.alloc.pages_needed(slot, need).unwrap_or(usize::MAX);
            if needed_pages.saturating_add(reserve) > self.model.kv.alloc.free_pages() && !self.running.is_empty() {
                // Wait for pages (attached prefix pages go back to the cache).
                self.model.release_sequence(slot);
                self.waiting.push_front(s);
                break;
            }
            let take = need.min(budget).min(self.options.prefill_chunk);
            if let Err(e) = self.model.kv.alloc.append(slot, take) {
                self.model.release_sequence(slot);
                if self.running.is_empty() && plan.is_empty() {
                    // Alone and still no room: it can never run.
                    self.fail(s, format!("{e}"));
                    continue;
                }
                self.waiting.push_front(s);
                break;
            }
            if s.preemptions == 0 {
                s.cached_prompt_tokens = cached;
            }
            s.computed = cached;
            s.slot = Some(slot);
            self.stats.prompt_tokens_cached += cached as u64;
            report.admitted += 1;
            if take > 0 {
                // (None: a group's first sequence whose prompt came from the cache up to its
                // fork point; the group forks at the next step.)
                plan.push((s.id, take));
            }
            budget -= take;
            self.running.push(s);
        }

        if plan.is_empty() {
            return Ok((report, None));
        }

        // The step's inputs: each sequence's tokens, and a logits row for those whose chunk
        // reaches the end of what they hold (they sample next).
        let (mut ids, mut positions, mut seqs, mut rows) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut want = Want::Argmax;
        let mut sampling: Vec<(u64, usize, Option<usize>, usize)> = Vec::new();
        for &(id, take) in &plan {
            let s = self.running.iter().find(|s| s.id == id).expect("planned sequences run");
            let slot = s.slot.expect("admitted");
            let drafts: &[u32] = s.spec.as_ref().map_or(&[], |sp| &sp.drafts);
            let held = s.tokens.len();
            for p in s.computed..s.computed + take {
                ids.push(if p < held { s.tokens[p] } else { drafts[p - held] });
                positions.push(p as u32);
                seqs.push(slot as u32);
            }
            // Sequences whose chunk reaches the end of what they hold sample next: one row,
            // or with drafts a row per verified position. The GPU argmax serves greedy rows,
            // the GPU top-k top-k sampling, other sampling the logits.
            let (row, n_rows) = if s.computed + take >= held {
                let n_rows = s.computed + take - held + 1;
                let first = rows.len();
                for r in 0..n_rows {
                    rows.push((ids.len() - n_rows + r) as u32);
                }
                want = speculative::wider(want, speculative::want_for(&s.sampler));
                if s.req.logprobs.is_some() {
                    // The GPU's top pairs and logsumexp (or the logits when those are read).
                    want = speculative::wider(want, Want::TopK);
                }
                (Some(first), n_rows)
            } else {
                (None, 0)
            };
            sampling.push((id, take, row, n_rows));
        }
        report.tokens = ids.len();
        report.sequences = plan.len();
        Ok((report, Some(Scheduled { ids, positions, seqs, rows, want, sampling, started: Instant::now(), timed: true })))
    }

    /// The drafts running sequence `idx` takes into this step (at most `most`): prompt lookup
    /// runs here; draft-model drafts were made before scheduling. Drafts beyond `most` are
    /// dropped (with their distributions).
    fn drafts_for(&mut self, idx: usize, most: usize) -> usize {
        let room = self.draft_room(&self.running[idx]);
        let s = &mut self.running[idx];
        let Some(sp) = s.spec.as_mut() else { return 0 };
        if sp.stats.drafter == Drafter::Lookup && sp.drafts.is_empty() && room > 0 {
            let t0 = Instant::now();
            sp.drafts = speculative::lookup(&s.tokens, room, s.req.speculation.lookup_ngram);
            sp.draft_ms = t0.elapsed().as_secs_f64() * 1e3;
        }
        let keep = sp.drafts.len().min(most);
        sp.drafts.truncate(keep);
        keep
    }

    /// The completing half of a step: sampling (or verifying drafts, rolling rejected ones
    /// back), streaming, stop checks, finishing.
    fn complete(&mut self, sch: Scheduled, out: Result<crate::model::forward::StepOutput>, mut report: StepReport) -> Result<StepReport> {
        let (sampling, timed) = (sch.sampling, sch.timed);
        let step_ms = sch.started.elapsed().as_secs_f64() * 1e3;
        let out = match out {
            Ok(o) => o,
            Err(e) => {
                // A failed step: every sequence in it ends with the error.
                let msg = e.to_string();
                for (id, _, _, _) in sampling {
                    if let Some(i) = self.running.iter().position(|s| s.id == id) {
                        let s = self.running.remove(i);
                        self.fail(s, msg.clone());
                    }
                }
                return Err(e);
            }
        };
        self.stats.steps += 1;
        let vocab = self.model.config.vocab_size;
        let now = Instant::now();
        // A step of one sequence in decode measures what a step of its width costs (the
        // prior of later requests' draft lengths).
        if let [(_, take, Some(_), n_rows)] = sampling[..] {
            if take == n_rows && timed {
                self.model.record_step_ms(take, step_ms);
            }
        }
        for (id, take, row, n_rows) in sampling {
            let Some(i) = self.running.iter().position(|s| s.id == id) else { continue };
            let s = &mut self.running[i];
            let prefill = s.computed < s.req.prompt_ids.len();
            let (drafts, draft_ms) = match s.spec.as_mut() {
                Some(sp) if n_rows > 1 => (std::mem::take(&mut sp.drafts), sp.draft_ms),
                _ => (Vec::new(), 0.0),
            };
            let before = s.computed;
            s.computed += take - drafts.len();
            if prefill {
                report.prefill_tokens += take;
                self.stats.prompt_tokens_computed += take as u64;
            }
            if !s.prompt_registered && s.computed >= s.req.prompt_ids.len() && self.model.options.prefix_cache {
                s.prompt_registered = true;
                let slot = s.slot.expect("admitted");
                let _ = self.model.kv.alloc.register_prefix(slot, &s.req.prompt_ids);
            }
            let Some(r) = row else { continue };
            let tokens = if drafts.is_empty() {
                let token = s.sampler.sample_step(&out, r, vocab);
                let lp = s.req.logprobs.and_then(|k| super::sampler::token_logprob(&out, r, vocab, token, k));
                if let Some(sp) = s.spec.as_mut().filter(|_| !prefill) {
                    sp.len.observe_lookup(&s.req.speculation, &s.tokens, token);
                    sp.len.record(0, 0, 0.0, step_ms);
                    sp.len.remember(speculative::memory_mut(s.req.speculation.drafter, &mut self.model, self.draft.as_mut()));
                    sp.stats.record(0, 0, 0.0, step_ms);
                }
                vec![(token, lp)]
            } else {
                let v = if s.req.sampling.is_greedy() {
                    speculative::verify_greedy(&drafts, &out.argmax[r..r + n_rows])
                } else {
                    let p: Vec<Dist> = (r..r + n_rows).map(|row| speculative::dist_at(&out, row, vocab, &s.sampler)).collect();
                    speculative::verify_sampled(&drafts, &p, &mut s.sampler)
                };
                // Keep the verified token and the accepted drafts in the cache; the
                // rejected positions' pages go back.
                s.computed = before + 1 + v.accepted;
                let slot = s.slot.expect("admitted");
                self.model.truncate_sequence(slot, s.computed)?;
                let sp = s.spec.as_mut().expect("drafts come from speculation");
                if let (Some(d), Some(ds)) = (self.draft.as_mut(), sp.draft_slot) {
                    let keep = d.sequence_len(ds)?.min(s.computed);
                    d.truncate_sequence(ds, keep)?;
                }
                sp.len.record(drafts.len(), v.accepted, draft_ms, step_ms);
                sp.len.remember(speculative::memory_mut(s.req.speculation.drafter, &mut self.model, self.draft.as_mut()));
                sp.stats.record(drafts.len(), v.accepted, draft_ms, step_ms);
                v.tokens.into_iter().map(|t| (t, None)).collect()
            };
            report.sampled += 1;
            for (token, lp) in tokens {
                if self.emit(i, token, lp, now) {
                    report.finished += 1;
                    break;
                }
            }
        }
        Ok(report)
    }

    /// Hand running sequence `i` its next token: stream it, then finish the sequence on a
    /// stop, its length or the context's end. Returns whether it left the running list.
    fn emit(&mut self, i: usize, token: u32, logprob: Option<TokenLogprob>, now: Instant) -> bool {
        let context = self.model.kv.alloc.config.context;
        let s = &mut self.running[i];
        if let Some(Err(e)) = s.guide.as_mut().map(|g| g.accept(token)) {
            let s = self.running.remove(i);
            self.fail(s, e.to_string());
            return true;
        }
        if let Some(b) = s.bias.as_mut() {
            b.observe(token);
        }
        self.stats.output_tokens += 1;
        s.timings.tokens.push(now);
        s.out.push(token);
        s.tokens.push(token);
        let (piece, stop) = match s.stream.push(&self.tokenizer, token, &s.req.stop_ids, &s.req.stop_strings) {
            Ok(x) => x,
            Err(e) => {
                let s = self.running.remove(i);
                self.fail(s, e.to_string());
                return true;
            }
        };
        if let Some(lp) = &logprob {
            s.logprobs.push(lp.clone());
        }
        let _ = s.tx.unbounded_send(Event::Token { id: token, text: piece.unwrap_or_default(), logprob: logprob.map(Box::new) });
        let reason = if let Some(f) = stop {
            Some(f)
        } else if s.guide.as_ref().is_some_and(|g| g.is_finished()) {
            // The grammar allows nothing more: the output is complete.
            Some(FinishReason::Stop)
        } else if s.out.len() >= s.req.max_tokens {
            Some(FinishReason::Length)
        } else if s.tokens.len() + 1 > context {
            Some(FinishReason::ContextFull)
        } else {
            None
        };
        match reason {
            Some(reason) => {
                let s = self.running.remove(i);
                self.finish(s, reason);
                true
            }
            None => false,
        }
    }
}

/// Whether a running sequence's decode steps can be chained ahead of the host: greedy, in
/// decode, neither speculative, constrained, biased nor asking for logprobs, and holding no
/// parallel samples still to fork (each of those needs the host between its steps).
fn plain_decode(s: &Seq) -> bool {
    s.req.sampling.is_greedy()
        && s.spec.is_none()
        && s.guide.is_none()
        && s.bias.is_none()
        && s.req.logprobs.is_none()
        && s.held.is_empty()
        && s.slot.is_some()
        && s.computed + 1 == s.tokens.len()
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

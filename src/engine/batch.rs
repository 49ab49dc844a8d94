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

use super::generate::{FinishReason, GenerateRequest, Generation, TextStream};
use super::metrics::RequestTimings;
use super::sampler::Sampler;
use crate::kv::KvError;
use crate::model::llama::{GpuModel, Want};
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
    /// held back because it may begin a stop string).
    Token { id: u32, text: String },
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
}

impl Seq {
    fn cancelled(&self) -> bool {
        self.cancel.load(Ordering::Relaxed) || self.tx.is_closed()
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

/// The inputs of a scheduled step, and per sequence: (id, tokens, logits row).
struct Scheduled {
    ids: Vec<u32>,
    positions: Vec<u32>,
    seqs: Vec<u32>,
    rows: Vec<u32>,
    want: Want,
    sampling: Vec<(u64, usize, Option<usize>)>,
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
    pending: Option<(Scheduled, crate::model::llama::PendingStep, StepReport)>,
}

/// Why `submit` refused a request.
fn refuse(msg: String) -> LanternError {
    LanternError::InvalidRequest(msg)
}

impl Engine {
    pub fn new(model: GpuModel, tokenizer: Arc<Tokenizer>, mut options: EngineOptions) -> Engine {
        options.step_tokens = options.step_tokens.clamp(1, model.options.max_batch_tokens.max(1));
        options.prefill_chunk = options.prefill_chunk.clamp(1, options.step_tokens);
        Engine { model, tokenizer, options, waiting: VecDeque::new(), running: Vec::new(), next_id: 0, stats: EngineStats::default(), pending: None }
    }

    /// Load `weights` onto a device the host application already has and serve them: the
    /// host keeps its device and queue (Lantern records its own command buffers on that
    /// queue) and may build several engines (models) on the same device.
    pub async fn with_device(
        device: wgpu::Device,
        queue: wgpu::Queue,
        weights: &crate::model::ModelWeights,
        tokenizer: Arc<Tokenizer>,
        model_options: crate::model::llama::ModelOptions,
        options: EngineOptions,
    ) -> Result<Engine> {
        let ctx = crate::gpu::GpuContext::from_device(device, queue).map_err(LanternError::Gpu)?;
        let model = GpuModel::load(ctx, weights, model_options).await?;
        Ok(Engine::new(model, tokenizer, options))
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

    pub fn into_model(self) -> GpuModel {
        self.model
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

    /// No request left (and no step on the GPU).
    pub fn is_idle(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty() && self.pending.is_none()
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
                timings,
                cached_prompt_tokens: 0,
                speculative: None,
            };
            let _ = tx.unbounded_send(Event::Done(Box::new(g)));
            let id = self.next_id;
            self.next_id += 1;
            return Ok(RequestHandle { id, events: rx, cancel: Arc::new(AtomicBool::new(false)) });
        }
        if self.waiting.len() >= self.options.max_waiting {
            return Err(LanternError::Overloaded { waiting: self.waiting.len(), max_waiting: self.options.max_waiting });
        }
        let (tx, rx) = unbounded();
        let cancel = Arc::new(AtomicBool::new(false));
        let id = self.next_id;
        self.next_id += 1;
        self.stats.submitted += 1;
        self.waiting.push_back(Seq {
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
            req,
            tx,
            cancel: cancel.clone(),
        });
        Ok(RequestHandle { id, events: rx, cancel })
    }

    /// Step until no request is left.
    pub async fn run_until_idle(&mut self) -> Result<()> {
        while !self.is_idle() {
            self.step().await?;
        }
        Ok(())
    }

    /// End `s` (already out of the running/waiting lists): free its pages and send `Done`.
    fn finish(&mut self, mut s: Seq, reason: FinishReason) {
        if let Some(slot) = s.slot.take() {
            self.model.release_sequence(slot);
        }
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
            timings: s.timings.clone(),
            cached_prompt_tokens: s.cached_prompt_tokens,
            speculative: None,
        };
        let _ = s.tx.unbounded_send(Event::Done(Box::new(g)));
    }

    fn fail(&mut self, mut s: Seq, msg: String) {
        if let Some(slot) = s.slot.take() {
            self.model.release_sequence(slot);
        }
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
                match self.model.advance(&mut p, web_time::Instant::now(), crate::model::llama::DISPATCHES_PER_SUBMIT).await {
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
        let (report, sch) = self.schedule()?;
        let Some(sch) = sch else { return Ok(report) };
        let out = self.model.step_batch(&sch.ids, &sch.positions, &sch.seqs, &sch.rows, sch.want).await;
        self.complete(sch, out, report)
    }

    /// A frame-budgeted step for hosts with a frame loop: schedules a step when none is in
    /// flight, submits its dispatches a few at a time until `budget` has passed (at least one
    /// batch per call), and collects its result once the GPU has it, never waiting on the
    /// GPU. Tokens arrive through the handles as with `step`; `FrameReport::step` is the
    /// report of a step that completed in this call.
    pub async fn step_within(&mut self, budget: impl Into<FrameBudget>) -> Result<FrameReport> {
        let budget = budget.into();
        let now = web_time::Instant::now();
        let deadline = now.checked_add(budget.time).unwrap_or(now + std::time::Duration::from_secs(3600));
        let (sch, mut p, report) = match self.pending.take() {
            Some(x) => x,
            None => {
                let (report, sch) = self.schedule()?;
                let Some(sch) = sch else { return Ok(FrameReport { step: Some(report), in_flight: false, submitted: 0 }) };
                match self.model.begin_step_batch(&sch.ids, &sch.positions, &sch.seqs, &sch.rows, sch.want) {
                    Ok(p) => (sch, p, report),
                    Err(e) => return self.complete(sch, Err(e), report).map(|r| FrameReport { step: Some(r), in_flight: false, submitted: 0 }),
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

        // Running sequences first, oldest first: each decode token, or its next prompt chunk.
        let mut budget = self.options.step_tokens;
        // (index into running, tokens this step)
        let mut plan: Vec<(u64, usize)> = Vec::new();
        let mut idx = 0;
        while idx < self.running.len() && budget > 0 {
            let (id, slot, need) = {
                let s = &self.running[idx];
                (s.id, s.slot.expect("running sequences hold a slot"), s.tokens.len() - s.computed)
            };
            let take = need.min(budget).min(if need > 1 { self.options.prefill_chunk } else { 1 });
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
            let need = s.tokens.len() - cached;
            let reserve = self.running.len();
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
            plan.push((s.id, take));
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
        let mut sampling: Vec<(u64, usize, Option<usize>)> = Vec::new();
        for &(id, take) in &plan {
            let s = self.running.iter().find(|s| s.id == id).expect("planned sequences run");
            let slot = s.slot.expect("admitted");
            for p in s.computed..s.computed + take {
                ids.push(s.tokens[p]);
                positions.push(p as u32);
                seqs.push(slot as u32);
            }
            let row = if s.computed + take == s.tokens.len() {
                rows.push(ids.len() as u32 - 1);
                if !s.req.sampling.is_greedy() {
                    // The GPU top-k serves top-k sampling; other sampling needs the logits.
                    if s.sampler.fits_top(crate::kernels::topk::TOPK_MAX) {
                        if want == Want::Argmax {
                            want = Want::TopK;
                        }
                    } else {
                        want = Want::Logits;
                    }
                }
                Some(rows.len() - 1)
            } else {
                None
            };
            sampling.push((id, take, row));
        }
        report.tokens = ids.len();
        report.sequences = plan.len();
        Ok((report, Some(Scheduled { ids, positions, seqs, rows, want, sampling })))
    }

    /// The completing half of a step: sampling, streaming, stop checks, finishing.
    fn complete(&mut self, sch: Scheduled, out: Result<crate::model::llama::StepOutput>, mut report: StepReport) -> Result<StepReport> {
        let sampling = sch.sampling;
        let out = match out {
            Ok(o) => o,
            Err(e) => {
                // A failed step: every sequence in it ends with the error.
                let msg = e.to_string();
                for (id, _, _) in sampling {
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
        let context = self.model.kv.alloc.config.context;
        let now = Instant::now();
        for (id, take, row) in sampling {
            let Some(i) = self.running.iter().position(|s| s.id == id) else { continue };
            let s = &mut self.running[i];
            let prefill = s.computed < s.req.prompt_ids.len();
            s.computed += take;
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
            let s = &mut self.running[i];
            let token = match (&out.top, &out.logits) {
                _ if s.req.sampling.is_greedy() => out.argmax[r],
                (Some(t), _) => s.sampler.sample_top(&t[r]),
                (None, Some(l)) => s.sampler.sample(&l[r * vocab..(r + 1) * vocab]),
                (None, None) => out.argmax[r],
            };
            report.sampled += 1;
            self.stats.output_tokens += 1;
            s.timings.tokens.push(now);
            s.out.push(token);
            s.tokens.push(token);
            let (piece, stop) = match s.stream.push(&self.tokenizer, token, &s.req.stop_ids, &s.req.stop_strings) {
                Ok(x) => x,
                Err(e) => {
                    let s = self.running.remove(i);
                    self.fail(s, e.to_string());
                    continue;
                }
            };
            let _ = s.tx.unbounded_send(Event::Token { id: token, text: piece.unwrap_or_default() });
            let reason = if let Some(f) = stop {
                Some(f)
            } else if s.out.len() >= s.req.max_tokens {
                Some(FinishReason::Length)
            } else if s.tokens.len() + 1 > context {
                Some(FinishReason::ContextFull)
            } else {
                None
            };
            if let Some(reason) = reason {
                let s = self.running.remove(i);
                self.finish(s, reason);
                report.finished += 1;
            }
        }
        Ok(report)
    }
}

//! Decoding ahead in the engine: a decode step of every running sequence is submitted before
//! the previous step's tokens are read, its input tokens copied on the GPU from that step's
//! argmax rows or GPU draws (ARCHITECTURE.md, "The batching engine decodes ahead too").

use super::*;
use crate::kernels::argmax::RowDraw;
use crate::kernels::sample::SampleParams;
use crate::model::forward::BatchSampling;

/// A decode step of every running sequence on the GPU whose tokens the host has not read
/// yet (decoding ahead in the engine: see [`Engine::step`]).
pub(super) struct Chain {
    sch: Scheduled,
    flight: BatchFlight,
    report: StepReport,
}

/// How the rows of a chained step get their tokens: from the argmax kernel (greedy rows, and
/// rows sampling without a top-k, by the Gumbel-max rule), or also drawn on the GPU
/// from the top-k pairs with the one set of parameters every top-k sampled sequence shares
/// (greedy rows then draw with the number 0, which takes their best pair, the argmax; rows
/// sampling without a top-k keep the argmax kernel's draw).
#[derive(Clone, Copy, PartialEq)]
pub(super) enum Rows {
    Argmax,
    Drawn(SampleParams),
}

/// The GPU sampling parameters of a sampled sequence that can draw on the GPU: a top-k of
/// 1 to 64 (the GPU's top-k pairs hold the whole candidate set) and parameters the kernel
/// takes; `None` for anything else.
fn gpu_params(s: &Seq) -> Option<SampleParams> {
    let p = s.sampler.gpu_params();
    (s.sampler.fits_top(crate::kernels::topk::TOPK_MAX) && p.check().is_ok()).then_some(p)
}

impl Engine {
    /// How the running sequences' rows can be decoded ahead, if they can: each is plain (see
    /// [`plain_decode`]), and the sampled ones draw on the GPU with the same parameters.
    fn chain_rows(&self) -> Option<Rows> {
        let mut rows = Rows::Argmax;
        for s in &self.running {
            if !plain_decode(s) || s.stale {
                return None;
            }
            if s.sampler.gpu_chooses() {
                continue;
            }
            let p = gpu_params(s)?;
            match rows {
                Rows::Argmax => rows = Rows::Drawn(p),
                Rows::Drawn(q) if q == p => {}
                Rows::Drawn(_) => return None,
            }
        }
        Some(rows)
    }

    /// Whether a scheduled step can start decoding ahead: the model keeps batched steps in
    /// flight, and the step is one decode token (row `i` for token `i`) of every running
    /// sequence, whose rows can be decoded ahead ([`Self::chain_rows`]).
    /// Returns how its rows get their tokens.
    pub(super) fn chains(&self, sch: &Scheduled) -> Option<Rows> {
        let decode_of_all = self.model.decodes_batches_ahead()
            && sch.want != Want::Logits
            && sch.sampling.len() == self.running.len()
            && sch.ids.len() == sch.sampling.len()
            && sch.sampling.iter().enumerate().all(|(i, &(id, take, row, n_rows))| {
                take == 1 && row == Some(i) && n_rows == 1 && self.running.get(i).is_some_and(|s| s.id == id)
            });
        if decode_of_all {
            self.chain_rows()
        } else {
            None
        }
    }

    /// The numbers the GPU draws the next chained step's rows with from their top-k pairs
    /// (0 for greedy rows; -1, keep the argmax kernel's draw, for rows sampling without a
    /// top-k), from each sampled sequence's copy of its sampler (`fresh`: a new copy, at
    /// a chain's start).
    fn next_draws(&mut self, fresh: bool) -> Vec<f32> {
        let skew = if self.skew_draws { 0.5 } else { 0.0 };
        self.running
            .iter_mut()
            .map(|s| {
                if s.req.sampling.is_greedy() {
                    return 0.0;
                }
                if s.sampler.draws_on_gpu() {
                    return -1.0;
                }
                if fresh || s.draws.is_none() {
                    s.draws = Some(s.sampler.clone());
                }
                s.draws.as_mut().map_or(0.0, |d| ((d.uniform() + skew) % 1.0) as f32)
            })
            .collect()
    }

    /// The step after `prev` (a chained step still in flight), submitted before `prev`'s
    /// tokens are read, where it can be planned without them: the same sequences in the same
    /// order, none cancelled, nobody waiting for admission, the rows still decodable ahead,
    /// each sequence with room for two more tokens (the one `prev` brings and this one's)
    /// and a page for each without preempting anyone. Its input tokens are `prev`'s argmax
    /// rows or GPU draws, copied on the GPU. `None` when it cannot (the engine then schedules
    /// anew once `prev` has landed).
    pub(super) fn chain_next(&mut self, prev: &Scheduled) -> Option<Chain> {
        let context = self.model.kv.alloc.config.context;
        if !self.waiting.is_empty() || self.running.len() != prev.sampling.len() {
            return None;
        }
        let fits = self
            .running
            .iter()
            .zip(&prev.sampling)
            .all(|(s, p)| s.id == p.0 && !s.cancelled() && s.out.len() + 2 <= s.req.max_tokens && s.tokens.len() + 2 <= context);
        let rows = self.chain_rows()?;
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
        let flight = match self.submit_chained(None, &positions, &seqs, rows, false) {
            Ok(f) => f,
            Err(_) => {
                self.unreserve(&seqs, &positions);
                return None;
            }
        };
        let n = seqs.len();
        let sampling = prev.sampling.iter().enumerate().map(|(i, p)| (p.0, 1, Some(i), 1)).collect();
        let want = if rows == Rows::Argmax { Want::Argmax } else { Want::TopK };
        let sch = Scheduled {
            ids: Vec::new(),
            positions,
            seqs,
            rows: (0..n as u32).collect(),
            want,
            sampling,
            started: Instant::now(),
            timed: false,
        };
        let report = StepReport { tokens: n, sequences: n, ..StepReport::default() };
        Some(Chain { sch, flight, report })
    }

    /// Submit a chained step with `rows`' way of choosing tokens (`fresh`: the chain's first
    /// step, whose draws come from new copies of the samplers; else the step behind one in
    /// flight, whose token each sequence has not taken yet), counting it.
    fn submit_chained(&mut self, ids: Option<&[u32]>, positions: &[u32], seqs: &[u32], rows: Rows, fresh: bool) -> Result<BatchFlight> {
        // The argmax kernel's draws: each row's token index in its output.
        let ahead = usize::from(!fresh);
        let row_draws: Vec<RowDraw> = self.running.iter().map(|s| s.sampler.row_draw(s.out.len() + ahead)).collect();
        let flight = match rows {
            Rows::Argmax => self.model.submit_decode_batch(ids, positions, seqs, &row_draws, None)?,
            Rows::Drawn(params) => {
                let draws = self.next_draws(fresh);
                self.model.submit_decode_batch(ids, positions, seqs, &row_draws, Some(BatchSampling { params, draws: &draws }))?
            }
        };
        if ids.is_none() {
            self.stats.steps_ahead += 1;
            if let Rows::Drawn(_) = rows {
                self.stats.sampled_steps_ahead += 1;
            }
        }
        Ok(flight)
    }

    /// Give back the positions `chain_next` reserved (`seqs[i]` had `positions[i]` appended).
    pub(super) fn unreserve(&mut self, seqs: &[u32], positions: &[u32]) {
        for (&slot, &pos) in seqs.iter().zip(positions) {
            let _ = self.model.kv.alloc.truncate(slot as usize, pos as usize);
        }
    }

    /// Start decoding ahead with `sch` (a step [`Self::chains`] accepts, with its `rows`): it is submitted
    /// without waiting, and the next one goes in behind it before its tokens are read.
    pub(super) async fn start_chain(&mut self, sch: Scheduled, rows: Rows, report: StepReport) -> Result<StepReport> {
        match self.submit_chained(Some(&sch.ids), &sch.positions, &sch.seqs, rows, true) {
            Ok(flight) => self.land_chain(Chain { sch, flight, report }, true).await,
            Err(e) => self.complete(sch, Err(e), report),
        }
    }

    /// Land a chained step: with `next`, first submit the step after it where it can be
    /// planned without its tokens ([`Self::chain_next`]), so the device never waits for the
    /// host between them; then read its tokens and complete it. Sequences that finish on this
    /// step's tokens leave the running list, and the step after it computed a token past
    /// their end: that token is never read (its sequence is gone when it lands) and its KV
    /// page went back with the sequence. A sampled row whose GPU draw differs from the
    /// request's sampler (the sampler's token is kept) makes the sequence stale: its row of
    /// the step behind ran on the GPU's token, so that row is dropped when it lands and its
    /// position is computed again by the next scheduled step.
    pub(super) async fn land_chain(&mut self, c: Chain, next: bool) -> Result<StepReport> {
        let after = if next { self.chain_next(&c.sch) } else { None };
        let landed = self.model.land_decode_batch(c.flight, after.is_none()).await;
        let mut report = match landed {
            Ok(out) => {
                let mut sch = c.sch;
                self.drop_stale_rows(&mut sch);
                // (sequence, the token the GPU fed its next step) for the rows read.
                let fed: Vec<(u64, u32)> = sch.sampling.iter().filter_map(|&(id, _, row, _)| Some((id, *out.argmax.get(row?)?))).collect();
                let r = self.complete(sch, Ok(out), c.report);
                self.mark_redraws(&fed);
                r
            }
            Err(e) => self.complete(c.sch, Err(e), c.report),
        };
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

    /// Rows of stale sequences leave the landed step unread (no token, no number drawn from
    /// their samplers), and the position each reserved goes back.
    fn drop_stale_rows(&mut self, sch: &mut Scheduled) {
        let running = &mut self.running;
        let alloc = &mut self.model.kv.alloc;
        sch.sampling.retain(|&(id, ..)| match running.iter_mut().find(|s| s.id == id) {
            Some(s) if s.stale => {
                s.stale = false;
                s.draws = None;
                if let Some(slot) = s.slot {
                    let _ = alloc.truncate(slot, s.computed);
                }
                false
            }
            _ => true,
        });
    }

    /// After a chained step completed: each of its sequences still running whose token
    /// differs from the one the GPU fed its next step (`fed`: sequence, token) is stale.
    fn mark_redraws(&mut self, fed: &[(u64, u32)]) {
        for &(id, token) in fed {
            if let Some(s) = self.running.iter_mut().find(|s| s.id == id) {
                if s.tokens.last() != Some(&token) {
                    s.stale = true;
                    self.stats.redraws += 1;
                }
            }
        }
    }
}

/// Whether a running sequence's decode steps can be chained ahead of the host: in decode,
/// greedy or sampled (the sampling is checked by [`Engine::chain_rows`]), neither
/// speculative, constrained, biased nor asking for logprobs, and holding no parallel samples
/// still to fork (each of those needs the host between its steps).
fn plain_decode(s: &Seq) -> bool {
    s.spec.is_none()
        && s.guide.is_none()
        && s.bias.is_none()
        && s.req.logprobs.is_none()
        && s.held.is_empty()
        && s.slot.is_some()
        && s.computed + 1 == s.tokens.len()
}

//! Decoding ahead in the engine: a greedy decode step of every running sequence is
//! submitted before the previous step's tokens are read, its ids copied on the GPU
//! (ARCHITECTURE.md, "The batching engine decodes ahead too").

use super::*;

/// A greedy decode step of every running sequence on the GPU whose tokens the host has not
/// read yet (decoding ahead in the engine: see [`Engine::step`]).
pub(super) struct Chain {
    sch: Scheduled,
    flight: BatchFlight,
    report: StepReport,
}

impl Engine {
    /// Whether a scheduled step can start decoding ahead: the model keeps batched steps in
    /// flight, and the step is one greedy decode token (row `i` for token `i`) of every
    /// running sequence, each of them plain (see [`plain_decode`]).
    pub(super) fn chains(&self, sch: &Scheduled) -> bool {
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
    pub(super) fn chain_next(&mut self, prev: &Scheduled) -> Option<Chain> {
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
    pub(super) fn unreserve(&mut self, seqs: &[u32], positions: &[u32]) {
        for (&slot, &pos) in seqs.iter().zip(positions) {
            let _ = self.model.kv.alloc.truncate(slot as usize, pos as usize);
        }
    }

    /// Start decoding ahead with `sch` (a step [`Self::chains`] accepts): it is submitted
    /// without waiting, and the next one goes in behind it before its tokens are read.
    pub(super) async fn start_chain(&mut self, sch: Scheduled, report: StepReport) -> Result<StepReport> {
        match self.model.submit_decode_batch(Some(&sch.ids), &sch.positions, &sch.seqs) {
            Ok(flight) => self.land_chain(Chain { sch, flight, report }, true).await,
            Err(e) => self.complete(sch, Err(e), report),
        }
    }

    /// Land a chained step: with `next`, first submit the step after it where it can be
    /// planned without its tokens ([`Self::chain_next`]), so the device never waits for the
    /// host between them; then read its tokens and complete it. Sequences that finish on this
    /// step's tokens leave the running list, and the step after it computed a token past
    /// their end: that token is never read (its sequence is gone when it lands) and its KV
    /// page went back with the sequence.
    pub(super) async fn land_chain(&mut self, c: Chain, next: bool) -> Result<StepReport> {
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

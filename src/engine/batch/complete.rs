//! The completing half of a step: sampling or verifying drafts, streaming, stop checks,
//! finishing.

use super::*;

impl Engine {
    /// The completing half of a step: sampling (or verifying drafts, rolling rejected ones
    /// back), streaming, stop checks, finishing.
    pub(super) fn complete(
        &mut self,
        sch: Scheduled,
        out: Result<crate::model::forward::StepOutput>,
        mut report: StepReport,
    ) -> Result<StepReport> {
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
                let lp = s.req.logprobs.and_then(|k| super::super::sampler::token_logprob(&out, r, vocab, token, k));
                if let Some(sp) = s.spec.as_mut().filter(|_| !prefill) {
                    sp.len.observe_lookup(&s.req.speculation, &s.tokens, token);
                    sp.len.record(0, 0, 0.0, step_ms);
                    sp.len.remember(speculative::memory_mut(s.req.speculation.drafter, &mut self.model, self.draft.as_mut()));
                    sp.stats.record(0, 0, 0.0, step_ms);
                }
                vec![(token, lp)]
            } else {
                let v = if s.sampler.gpu_chooses() {
                    // The argmax rows are the target's tokens (its draws, when sampling from
                    // the GPU).
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
    pub(super) fn emit(&mut self, i: usize, token: u32, logprob: Option<TokenLogprob>, now: Instant) -> bool {
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

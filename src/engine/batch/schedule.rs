//! The scheduling half of a step: cancellations, forks of parallel samples, decode tokens
//! and prompt chunks of the running sequences, admissions, preemption; the step's inputs.

use super::*;

impl Engine {
    /// End cancelled and abandoned (handle dropped) requests, freeing their pages.
    pub(super) fn sweep_cancelled(&mut self, report: &mut StepReport) {
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

    /// The scheduling half of a step: cancellations, decode tokens and prompt chunks of the
    /// running sequences, admissions; the step's inputs (None when there is nothing to run).
    pub(super) fn schedule(&mut self) -> Result<(StepReport, Option<Scheduled>)> {
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
        // Logit rows are budgeted too: a decode token takes one, and each draft one more (a
        // verify step reads a row per position); a prompt chunk that ends its prompt takes one.
        let mut rows_left = self.model.logit_rows;
        // (index into running, tokens this step)
        let mut plan: Vec<(u64, usize)> = Vec::new();
        let mut idx = 0;
        while idx < self.running.len() && budget > 0 {
            let (id, slot, need, to_end) = {
                let s = &self.running[idx];
                (s.id, s.slot.expect("running sequences hold a slot"), s.compute_limit() - s.computed, s.tokens.len() - s.computed)
            };
            // A speculative sequence in decode carries its drafts (looked up now, or drafted
            // by the draft model before scheduling), as many as the step's budgets leave.
            let drafts = if need == 1 && rows_left > 0 { self.drafts_for(idx, (budget - 1).min(rows_left - 1)) } else { 0 };
            let mut take = need.min(budget).min(if need > 1 { self.options.prefill_chunk } else { 1 }) + drafts;
            // Rows as the step's inputs below count them (one per position from the last token
            // held on). Out of rows, a chunk stops short of its prompt's end (its last token
            // waits for the next step) and a decode token waits.
            let rows = (take + 1).saturating_sub(to_end);
            if rows > rows_left {
                take = need.min(to_end).saturating_sub(1);
            }
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
            rows_left -= (take + 1).saturating_sub(to_end);
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
            let mut take = need.min(budget).min(self.options.prefill_chunk);
            let to_end = s.tokens.len() - cached;
            if take >= to_end && rows_left == 0 {
                // Its last prompt token waits for a step with a logit row to spare.
                take = need.saturating_sub(1);
            }
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
            rows_left -= usize::from(take >= to_end);
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
            // or with drafts a row per verified position. The argmax kernel serves greedy
            // rows and sampling without a top-k, the GPU top-k top-k sampling, other
            // sampling (and verification) the logits.
            let (row, n_rows) = if s.computed + take >= held {
                let n_rows = s.computed + take - held + 1;
                let first = rows.len();
                for r in 0..n_rows {
                    rows.push((ids.len() - n_rows + r) as u32);
                }
                want = speculative::wider(want, speculative::want_for(&s.sampler));
                if s.req.logprobs.is_some() {
                    // The GPU's top pairs and logsumexp (or the logits when those are read); a
                    // draw on the GPU (no top-k) may fall outside the top pairs, so its
                    // log-probability needs the logits.
                    let need = if s.sampler.draws_on_gpu() { Want::Logits } else { Want::TopK };
                    want = speculative::wider(want, need);
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
}

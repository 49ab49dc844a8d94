//! Speculative drafts in the engine: prompt lookup while scheduling, draft-model drafting
//! for all speculative sequences in shared draft steps before it.

use super::*;

impl Engine {
    /// The draft tokens a speculative sequence in decode may take this step: at most its
    /// chosen k, one less than the tokens it may still emit, and the context's room.
    pub(super) fn draft_room(&self, s: &Seq) -> usize {
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
    pub(super) async fn draft_with_model(&mut self) {
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
            jobs.push(DraftJob { slot, history: &s.tokens, k, sampler: s.sampler.clone(), index: s.out.len(), tokens: Vec::new() });
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

    /// The drafts running sequence `idx` takes into this step (at most `most`): prompt lookup
    /// runs here; draft-model drafts were made before scheduling. Drafts beyond `most` are
    /// dropped (with their distributions).
    pub(super) fn drafts_for(&mut self, idx: usize, most: usize) -> usize {
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
}

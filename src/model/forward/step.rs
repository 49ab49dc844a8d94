//! Step execution: sequences in the KV cache, the forward steps (one sequence or a batch),
//! the frame-budgeted path that submits a step a few dispatches at a time, warm-up and
//! per-dispatch profiling.

use crate::gpu::GpuError;
use crate::kernels::argmax::RowDraw;
use crate::kernels::{self, Dispatch, StepUniform};
use crate::kv::KvError;
use crate::{LanternError, Result};

use super::{gpu_err, GpuModel, StepOutput, Want};

/// Most dispatches recorded per submission on the frame-budgeted path. Fewer go into one
/// submission when the measured cost per dispatch says more would overrun the frame budget.
pub const DISPATCHES_PER_SUBMIT: usize = 8;

impl PendingStep {
    /// Dispatches submitted so far.
    pub fn submitted(&self) -> usize {
        self.next
    }
}

/// Constrained decoding: computes a step's allowed-token bitmasks, `n_out x
/// kernels::logit_mask::words(vocab)` u32 (all ones for an unconstrained row). A masked step
/// calls it after submitting the layers and the LM head, so the host computes the masks
/// while the GPU runs them; the mask, argmax / top-k and readback follow in a second
/// submission.
pub type MaskFn<'a> = &'a mut dyn FnMut() -> Result<Vec<u32>>;

/// What a step does to its logit rows on the GPU before argmax, top-k and the readback:
/// first the biases are added, then the mask sets disallowed tokens to -inf.
#[derive(Default)]
pub struct LogitOps<'a> {
    /// OpenAI's `logit_bias` and presence/frequency penalties: `(token, delta)` pairs added
    /// to each logit row, in the step's row order (rows past the end, and empty rows, are
    /// left as they are). Each token at most once per row, inside the vocabulary; deltas
    /// finite.
    pub bias: Vec<Vec<(u32, f32)>>,
    /// Constrained decoding's bitmasks. [`GpuModel::step_batch_with`] and
    /// [`GpuModel::forward_with`] ask for them once the layers and the LM head are submitted,
    /// so the host computes them while the GPU runs those; the frame-budgeted
    /// [`GpuModel::begin_step_batch_with`] asks up front.
    pub mask: Option<MaskFn<'a>>,
    /// How each logit row's token is chosen, in the step's row order: the argmax, or a
    /// Gumbel-max draw, with or without a nucleus (`kernels::argmax::RowDraw`; rows past the
    /// end take the argmax). After the bias and the mask, so a draw respects both.
    pub draws: Vec<RowDraw>,
}

impl LogitOps<'_> {
    /// Whether any row is biased.
    pub fn biased(&self) -> bool {
        self.bias.iter().any(|r| !r.is_empty())
    }
}

/// A step started with [`GpuModel::begin_step_batch`] and driven by [`GpuModel::advance`].
pub struct PendingStep {
    s: StepUniform,
    want: Want,
    /// The step's logit rows are masked (the bitmasks were uploaded at its start).
    masked: bool,
    /// The step's logit rows are biased (the pairs were uploaded at its start).
    biased: bool,
    /// Dispatches submitted so far.
    next: usize,
    submissions: usize,
    mapping: Option<futures_channel::oneshot::Receiver<std::result::Result<(), wgpu::BufferAsyncError>>>,
}

/// Steps of at most this many tokens may split each token's keys (flash-decoding); larger
/// steps have enough tokens to fill the device.
pub(super) const SPLIT_MAX_TOKENS: usize = 4;

/// Batched steps of at most this many tokens take the four-token matvec; larger ones up to
/// [`BATCH8_MAX_TOKENS`] the eight-token matvec where the plans have it
/// (`Plans::layers_batch8`), and larger ones again passes of the four-token matvec (CPU
/// adapters' steps of 9-16: on lavapipe, Qwen2.5-Coder-1.5B, 9 tokens cost 3.4 s in three
/// four-token passes against 4.1 s in two eight-token ones).
pub(super) const BATCH4_MAX_TOKENS: usize = 4;
pub(super) const BATCH8_MAX_TOKENS: usize = 8;

impl GpuModel {
    /// Run one step of each plan shape (decode; the batched and the matmul prefill), with
    /// argmax and top-k readback, on a scratch sequence that is released afterwards: drivers
    /// that compile a shader at its first dispatch (llvmpipe) and first touches of weight
    /// memory then happen here, at load time, and not inside a host's frame. Returns the
    /// milliseconds it took.
    pub async fn warm_up(&mut self) -> Result<f64> {
        let t0 = web_time::Instant::now();
        let context = self.kv.alloc.config.context;
        let mut sizes = vec![1usize, self.matvec_max_tokens + 1, self.batch_max_tokens.max(self.matvec_max_tokens) + 1];
        if self.plans.layers_batch8.is_some() {
            sizes.push(BATCH4_MAX_TOKENS + 1);
        }
        sizes.sort_unstable();
        sizes.dedup();
        sizes.retain(|&n| n <= self.options.max_batch_tokens);
        let seq = self.new_sequence()?;
        let mut run = async || -> Result<()> {
            let mut used = 0;
            for (i, &n) in sizes.iter().enumerate() {
                if used + n + 1 > context {
                    break;
                }
                self.forward(seq, &vec![0u32; n], Want::Argmax).await?;
                used += n;
                if i == 0 {
                    self.forward(seq, &[0u32], Want::TopK).await?;
                    used += 1;
                }
            }
            Ok(())
        };
        let r = run().await;
        self.release_sequence(seq);
        r.map(|_| t0.elapsed().as_secs_f64() * 1e3)
    }

    /// Milliseconds of one step of each of `widths` tokens at the end of a `prefix`-token
    /// scratch sequence (released after): the median of `reps` timed steps per width, each
    /// rolled back, after one untimed step of each kernel shape among them (pipelines
    /// compiled, weights touched); a width timed dearer than as many one-token steps is timed
    /// again (up to twice) and the fastest kept. What a speculative verify step of that
    /// width costs here; each is also recorded as the width's cost ([`Self::record_step_ms`]).
    pub async fn measure_step_costs(&mut self, prefix: usize, widths: &[usize], reps: usize) -> Result<Vec<f64>> {
        let context = self.kv.alloc.config.context;
        let widest = widths.iter().copied().max().unwrap_or(0);
        if widths.contains(&0) || prefix + widest + 1 > context || widest > self.logit_rows.min(self.options.max_batch_tokens) {
            return Err(LanternError::InvalidRequest(format!(
                "steps of {widths:?} tokens after {prefix} do not fit (context {context}, at most {} tokens and {} logit rows per step)",
                self.options.max_batch_tokens, self.logit_rows
            )));
        }
        // The kernel shape a width runs: the decode matvec, the four- or eight-token batched
        // matvec, the matmul.
        let (mv, bt, b8) = (self.matvec_max_tokens, self.batch_max_tokens, self.plans.layers_batch8.is_some());
        let shape = |w: usize| {
            if w <= mv {
                0
            } else if w <= bt && (!b8 || !(BATCH4_MAX_TOKENS + 1..=BATCH8_MAX_TOKENS).contains(&w)) {
                1
            } else if w <= bt {
                3
            } else {
                2
            }
        };
        let mut warm: Vec<usize> = Vec::new();
        for &w in widths {
            if !warm.iter().any(|&o| shape(o) == shape(w)) {
                warm.push(w);
            }
        }
        let seq = self.new_sequence()?;
        let mut run = async || -> Result<Vec<f64>> {
            // Any tokens will do (the cost does not depend on them): ids within the vocabulary.
            let vocab = self.config.vocab_size.max(1) as u32;
            let ids: Vec<u32> = (0..prefix as u32).map(|i| (100 + i) % vocab).collect();
            if !ids.is_empty() {
                self.forward(seq, &ids, Want::Argmax).await?;
            }
            let step = |w: usize| -> Vec<u32> { (0..w as u32).map(|i| (200 + i) % vocab).collect() };
            for &w in &warm {
                self.forward_rows(seq, &step(w), Want::Argmax).await?;
                self.truncate_sequence(seq, prefix)?;
            }
            let mut out = Vec::with_capacity(widths.len());
            for &w in widths {
                let mut times = Vec::with_capacity(reps);
                for _ in 0..reps.max(1) {
                    let t0 = web_time::Instant::now();
                    self.forward_rows(seq, &step(w), Want::Argmax).await?;
                    times.push(t0.elapsed().as_secs_f64() * 1e3);
                    self.truncate_sequence(seq, prefix)?;
                }
                times.sort_by(f64::total_cmp);
                out.push(times[times.len() / 2]);
            }
            // A busy moment (another process on the same cores) inflates a timing, and kept
            // costs are read by every later run: a step of w tokens dearer than w one-token
            // steps, which a batched kernel is not on a quiet adapter, is timed again (up to
            // twice), keeping the fastest.
            let one = widths.iter().position(|&w| w == 1).map(|i| out[i]).or_else(|| self.step_costs().get(1).copied().flatten());
            if let Some(one) = one {
                for (i, &w) in widths.iter().enumerate() {
                    for _ in 0..2 {
                        if w <= 1 || out[i] <= one * w as f64 * 1.1 {
                            break;
                        }
                        let t0 = web_time::Instant::now();
                        self.forward_rows(seq, &step(w), Want::Argmax).await?;
                        out[i] = out[i].min(t0.elapsed().as_secs_f64() * 1e3);
                        self.truncate_sequence(seq, prefix)?;
                    }
                }
            }
            for (&w, &ms) in widths.iter().zip(&out) {
                self.record_step_ms(w, ms);
            }
            Ok(out)
        };
        let r = run().await;
        self.release_sequence(seq);
        r
    }

    /// Start a new sequence in the KV cache.
    pub fn new_sequence(&mut self) -> Result<usize> {
        self.kv.alloc.create().map_err(LanternError::Kv)
    }

    /// End a sequence, freeing its pages (full pages registered in the prefix cache stay
    /// there, evictable, until memory is needed).
    pub fn release_sequence(&mut self, seq: usize) {
        self.kv.alloc.release(seq);
    }

    /// A new sequence sharing every page of `seq` (parallel samples of one prompt); the
    /// partial last page is copied when either writes to it.
    pub fn fork_sequence(&mut self, seq: usize) -> Result<usize> {
        self.kv.alloc.fork(seq).map_err(LanternError::Kv)
    }

    /// Attach the longest cached prefix of `prompt` (whole pages, never the whole prompt) to
    /// the empty sequence `seq`; returns the tokens that need no computing.
    pub fn attach_cached_prefix(&mut self, seq: usize, prompt: &[u32]) -> Result<usize> {
        self.kv.alloc.match_prefix(seq, prompt).map_err(LanternError::Kv)
    }

    /// Offer the full pages of `tokens` (positions 0.. of `seq`) to the prefix cache.
    pub fn cache_prefix(&mut self, seq: usize, tokens: &[u32]) -> Result<usize> {
        self.kv.alloc.register_prefix(seq, tokens).map_err(LanternError::Kv)
    }

    /// Record the copy-on-write page copies the allocator queued (before the step's
    /// dispatches, so the new tokens land on the copies).
    pub(super) fn encode_pending_copies(&mut self, enc: &mut wgpu::CommandEncoder) {
        for c in self.kv.alloc.take_copies() {
            self.kv.store.encode_page_copy(enc, c.src as usize, c.dst as usize, c.tokens);
        }
        for (src, dst) in self.kv.alloc.take_ring_copies() {
            self.kv.store.encode_ring_copy(enc, src, dst);
        }
        for (src, dst) in self.kv.alloc.take_tail_copies() {
            self.kv.store.encode_tail_copy(enc, src, dst);
        }
    }

    /// Tokens stored for a sequence.
    pub fn sequence_len(&self, seq: usize) -> Result<usize> {
        self.kv.alloc.len(seq).map_err(LanternError::Kv)
    }

    /// Append `tokens` to sequence `seq`, running as many steps as the batch limit needs,
    /// and return the argmax (and logits, if asked) of the last token.
    pub async fn forward(&mut self, seq: usize, tokens: &[u32], want: Want) -> Result<StepOutput> {
        self.forward_with(seq, tokens, want, LogitOps::default()).await
    }

    /// [`Self::forward`] with the last token's logits row biased and masked on the GPU by
    /// `ops` (its first bias row; the mask is asked for while the GPU runs the last step's
    /// layers).
    pub async fn forward_with(&mut self, seq: usize, tokens: &[u32], want: Want, ops: LogitOps<'_>) -> Result<StepOutput> {
        if tokens.is_empty() {
            return Err(LanternError::InvalidRequest("forward called with no tokens".into()));
        }
        let chunk = self.options.max_batch_tokens.max(1);
        let mut outs = self.run_chunks(seq, tokens, chunk, want, false, ops).await?;
        Ok(outs.pop().unwrap_or_default())
    }

    /// Append `tokens` to `seq` in one step and return the output of every position (the
    /// argmax per token, and the top-k pairs or logits rows when asked): a speculative
    /// verify step. At most `options.max_batch_tokens` tokens and `logit_rows` rows; the
    /// pages are released again if the step fails.
    pub async fn forward_rows(&mut self, seq: usize, tokens: &[u32], want: Want) -> Result<StepOutput> {
        self.forward_rows_with(seq, tokens, want, LogitOps::default()).await
    }

    /// [`Self::forward_rows`] with `ops` on its logit rows (one per token: the speculative
    /// verify step of a request drawing on the GPU draws each row's token).
    pub async fn forward_rows_with(&mut self, seq: usize, tokens: &[u32], want: Want, ops: LogitOps<'_>) -> Result<StepOutput> {
        if tokens.is_empty() || tokens.len() > self.options.max_batch_tokens.max(1) || tokens.len() > self.logit_rows {
            return Err(LanternError::InvalidRequest(format!(
                "forward_rows: {} tokens (a step takes 1 to {} tokens with at most {} logit rows)",
                tokens.len(),
                self.options.max_batch_tokens,
                self.logit_rows
            )));
        }
        self.check_ids(tokens)?;
        let start = self.kv.alloc.append(seq, tokens.len()).map_err(LanternError::Kv)?;
        let rows: Vec<u32> = (0..tokens.len() as u32).collect();
        match self.step(seq, tokens, start, &rows, want, false, ops).await {
            Ok(o) => Ok(o),
            Err(e) => {
                let _ = self.kv.alloc.truncate(seq, start);
                Err(e)
            }
        }
    }

    /// Keep only the first `len` tokens of `seq` (rejected speculative tokens): pages past
    /// the new end are freed and the block table shrinks with them. With window rings
    /// (`kv::ring`), going back further than a ring allows is refused and changes nothing.
    pub fn truncate_sequence(&mut self, seq: usize, len: usize) -> Result<()> {
        if !self.kv.alloc.can_truncate(seq, len).map_err(LanternError::Kv)? {
            let written = self.kv.alloc.written(seq).map_err(LanternError::Kv)?;
            return Err(LanternError::Kv(match self.kv.alloc.ring().copied().filter(|r| !r.keeps_window(written, len)) {
                Some(r) => crate::kv::KvError::RollbackBeyondRing { seq, len, written, ring_tokens: r.tokens() },
                None => crate::kv::KvError::RollbackBeyondTail { seq, len, page_size: self.kv.alloc.config.page_size },
            }));
        }
        self.kv.alloc.truncate(seq, len).map_err(LanternError::Kv)
    }

    /// Append `tokens` to `seq` and return the logits of every position (`tokens x vocab`),
    /// for evaluation (perplexity) and reference comparisons.
    pub async fn forward_all_logits(&mut self, seq: usize, tokens: &[u32]) -> Result<Vec<f32>> {
        if tokens.is_empty() {
            return Ok(Vec::new());
        }
        let chunk = self.logit_rows;
        let outs = self.run_chunks(seq, tokens, chunk, Want::Logits, true, LogitOps::default()).await?;
        Ok(outs.into_iter().flat_map(|o| o.logits.unwrap_or_default()).collect())
    }

    /// Append `tokens` to `seq` in steps of at most `chunk` tokens. With `every_row` each
    /// step returns all its rows' outputs, else only the last step returns its last row.
    /// Pages are reserved up front (a full cache is reported before any work) and released
    /// again if a step fails, so the sequence is left as it was.
    async fn run_chunks(
        &mut self,
        seq: usize,
        tokens: &[u32],
        chunk: usize,
        want: Want,
        every_row: bool,
        ops: LogitOps<'_>,
    ) -> Result<Vec<StepOutput>> {
        let mut ops = Some(ops);
        self.check_ids(tokens)?;
        let start = self.kv.alloc.append(seq, tokens.len()).map_err(LanternError::Kv)?;
        let n_chunks = tokens.len().div_ceil(chunk);
        let mut outs = Vec::with_capacity(if every_row { n_chunks } else { 1 });
        for (ci, part) in tokens.chunks(chunk).enumerate() {
            let rows: Vec<u32> = if every_row {
                (0..part.len() as u32).collect()
            } else if ci + 1 == n_chunks {
                vec![(part.len() - 1) as u32]
            } else {
                vec![]
            };
            // Only the last chunk samples: it alone is biased and masked.
            let o = if ci + 1 == n_chunks { ops.take().unwrap_or_default() } else { LogitOps::default() };
            match self.step(seq, part, start + ci * chunk, &rows, want, every_row, o).await {
                Ok(o) => {
                    if !rows.is_empty() {
                        outs.push(o);
                    }
                }
                Err(e) => {
                    let _ = self.kv.alloc.truncate(seq, start);
                    return Err(e);
                }
            }
        }
        Ok(outs)
    }

    /// Write one step's inputs: the step uniform, token ids, positions, sequence of each
    /// token, the block table and the rows whose logits are wanted.
    pub(super) fn write_step_inputs(&self, seq: usize, part: &[u32], pos0: usize, rows: &[u32]) -> StepUniform {
        let n = part.len() as u32;
        let positions: Vec<u32> = (0..n).map(|i| pos0 as u32 + i).collect();
        let seqs = vec![seq as u32; part.len()];
        self.write_batch_inputs(part, &positions, &seqs, rows)
    }

    /// [`Self::write_step_inputs`] for tokens of any sequences: id, position and sequence per
    /// token.
    fn write_batch_inputs(&self, ids: &[u32], positions: &[u32], seqs: &[u32], rows: &[u32]) -> StepUniform {
        self.write_batch_inputs_from(Some(ids), positions, seqs, rows)
    }

    /// [`Self::write_batch_inputs`]; with `ids` `None` the ids are not written (the step's
    /// commands copy them from the previous step's argmax).
    pub(super) fn write_batch_inputs_from(&self, ids: Option<&[u32]>, positions: &[u32], seqs: &[u32], rows: &[u32]) -> StepUniform {
        let ctx = &self.ctx;
        let n = positions.len() as u32;
        let max_keys = positions.iter().map(|&p| p as usize + 1).max().unwrap_or(1);
        let mut step = StepUniform::new(n, rows.len() as u32);
        step.n_splits = self.splits_for(positions.len(), max_keys) as u32;
        ctx.write(&self.ws.step, 0, bytemuck::bytes_of(&step));
        if let Some(ids) = ids {
            ctx.write(&self.ws.ids, 0, bytemuck::cast_slice(ids));
        }
        ctx.write(&self.ws.positions, 0, bytemuck::cast_slice(positions));
        ctx.write(&self.ws.token_seq, 0, bytemuck::cast_slice(seqs));
        ctx.write(&self.ws.block_table, 0, bytemuck::cast_slice(&self.kv.alloc.block_table()));
        if !rows.is_empty() {
            ctx.write(&self.ws.logit_rows, 0, bytemuck::cast_slice(rows));
        }
        step
    }

    /// Key splits for a step of `n_tokens` whose longest sequence has `max_keys` keys: one
    /// per `attention_split_keys` keys, up to `attention_splits`, in decode-sized steps only.
    pub(super) fn splits_for(&self, n_tokens: usize, max_keys: usize) -> usize {
        if n_tokens > SPLIT_MAX_TOKENS {
            return 1;
        }
        max_keys.div_ceil(self.options.attention_split_keys.max(1)).clamp(1, self.attention_splits)
    }

    /// The layer dispatches for a step of `n` tokens: matvec for decode-sized steps, matmul
    /// otherwise.
    fn layer_plan_for(&self, n: usize) -> &[Dispatch] {
        if n <= self.matvec_max_tokens {
            &self.plans.layers_matvec
        } else if n <= self.batch_max_tokens {
            match &self.plans.layers_batch8 {
                Some(eight) if (BATCH4_MAX_TOKENS + 1..=BATCH8_MAX_TOKENS).contains(&n) => eight,
                _ => self.plans.layers_batch.as_deref().unwrap_or(&self.plans.layers_matmul),
            }
        } else {
            &self.plans.layers_matmul
        }
    }

    pub(super) fn check_ids(&self, tokens: &[u32]) -> Result<()> {
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= self.config.vocab_size) {
            return Err(LanternError::TokenOutOfRange { id: bad, vocab: self.config.vocab_size });
        }
        Ok(())
    }

    /// One step: `part` tokens of `seq` at positions `pos0..`, logits for `rows` (indices
    /// into `part`). Pages must already be reserved.
    #[allow(clippy::too_many_arguments)]
    async fn step(
        &mut self,
        seq: usize,
        part: &[u32],
        pos0: usize,
        rows: &[u32],
        want: Want,
        all_rows: bool,
        ops: LogitOps<'_>,
    ) -> Result<StepOutput> {
        let s = self.write_step_inputs(seq, part, pos0, rows);
        self.run_step(s, want, all_rows, ops).await
    }

    /// One step over tokens of several sequences (continuous batching): `ids[i]` at
    /// `positions[i]` of sequence `seqs[i]`, whose pages must already be reserved
    /// (`kv.alloc.append`); argmax (and logits with `Want::Logits`) of the tokens at indices
    /// `rows`. At most `options.max_batch_tokens` tokens and `logit_rows` rows.
    /// `ids` `None`: the step's ids come from the GPU (one per position).
    pub(super) fn validate_batch(&self, ids: Option<&[u32]>, positions: &[u32], seqs: &[u32], rows: &[u32]) -> Result<()> {
        let bad = |m: String| Err(LanternError::InvalidRequest(m));
        let n = positions.len();
        let n_ids = ids.map_or(n, <[u32]>::len);
        if n == 0 || n_ids != n || n != seqs.len() {
            return bad(format!("step_batch: {n_ids} ids, {n} positions, {} sequence indices", seqs.len()));
        }
        if n > self.options.max_batch_tokens.max(1) || rows.len() > self.logit_rows {
            return bad(format!(
                "step_batch: {} tokens and {} logit rows exceed the step's {} tokens / {} rows",
                n,
                rows.len(),
                self.options.max_batch_tokens,
                self.logit_rows
            ));
        }
        if let Some(&r) = rows.iter().find(|&&r| r as usize >= n) {
            return bad(format!("step_batch: logit row {r} outside the step's {n} tokens"));
        }
        if let Some(ids) = ids {
            self.check_ids(ids)?;
        }
        for (&s, &p) in seqs.iter().zip(positions) {
            let len = self.kv.alloc.len(s as usize).map_err(LanternError::Kv)?;
            if p as usize >= len {
                return bad(format!("step_batch: position {p} of sequence {s}, which has room for {len} tokens (reserve pages first)"));
            }
        }
        if self.options.kv_dtype == crate::kv::plan::KvDtype::Q4 {
            // The q4 cache's seal pass (kv_seal.wgsl) finds a sequence's pages from its run
            // of rows.
            let mut seen = std::collections::HashSet::new();
            for i in 0..n {
                let run_continues = i > 0 && seqs[i - 1] == seqs[i];
                if run_continues && positions[i] != positions[i - 1] + 1 {
                    return bad(format!(
                        "step_batch: with a q4 KV cache a sequence's tokens take consecutive positions (row {i} of sequence {} is at {} after {})",
                        seqs[i],
                        positions[i],
                        positions[i - 1]
                    ));
                }
                if !run_continues && !seen.insert(seqs[i]) {
                    return bad(format!(
                        "step_batch: with a q4 KV cache a sequence's tokens are consecutive rows (sequence {} comes back at row {i})",
                        seqs[i]
                    ));
                }
            }
        }
        Ok(())
    }

    pub async fn step_batch(&mut self, ids: &[u32], positions: &[u32], seqs: &[u32], rows: &[u32], want: Want) -> Result<StepOutput> {
        self.step_batch_with(ids, positions, seqs, rows, want, LogitOps::default()).await
    }

    /// [`Self::step_batch`] with the logit rows biased and masked on the GPU by `ops` (one
    /// bias row and one bitmask per logit row, in `rows` order; the masks are asked for while
    /// the GPU runs the layers).
    pub async fn step_batch_with(
        &mut self,
        ids: &[u32],
        positions: &[u32],
        seqs: &[u32],
        rows: &[u32],
        want: Want,
        ops: LogitOps<'_>,
    ) -> Result<StepOutput> {
        self.validate_batch(Some(ids), positions, seqs, rows)?;
        let s = self.write_batch_inputs(ids, positions, seqs, rows);
        self.run_step(s, want, false, ops).await
    }

    pub(super) async fn run_step(&mut self, s: StepUniform, want: Want, all_rows: bool, ops: LogitOps<'_>) -> Result<StepOutput> {
        let ctx = self.ctx.clone();
        ctx.check_lost().map_err(LanternError::Gpu)?;
        let r = self.run_step_inner(s, want, all_rows, ops).await;
        // Whatever failed on a lost device, the loss is the error to report.
        match (r, ctx.check_lost()) {
            (Err(_), Err(lost)) => Err(LanternError::Gpu(lost)),
            (r, _) => r,
        }
    }

    /// The dispatches of a step, in order; with `biased` and `masked`, the logit bias and then
    /// the logit mask run between the LM head and the argmax.
    pub(super) fn step_dispatches(&self, s: &StepUniform, want: Want, all_rows: bool, biased: bool, masked: bool) -> Vec<&Dispatch> {
        let mut v: Vec<&Dispatch> = self.plans.embed.iter().chain(self.layer_plan_for(s.n_tokens as usize)).collect();
        if s.n_out > 0 {
            let head = if all_rows {
                &self.plans.head_all
            } else if (BATCH4_MAX_TOKENS + 1..=BATCH8_MAX_TOKENS).contains(&(s.n_out as usize)) && self.plans.head_gather_batch8.is_some() {
                self.plans.head_gather_batch8.as_deref().unwrap_or(&self.plans.head_gather)
            } else if s.n_out > 1 && self.plans.head_gather_batch.is_some() {
                self.plans.head_gather_batch.as_deref().unwrap_or(&self.plans.head_gather)
            } else {
                &self.plans.head_gather
            };
            v.extend(head.iter());
            if biased {
                v.push(&self.plans.logit_bias);
            }
            if masked {
                v.push(&self.plans.logit_mask);
            }
            v.push(&self.plans.argmax);
            if want == Want::TopK {
                v.push(&self.plans.topk);
            }
        }
        v
    }

    /// Bytes a step reads back: each row's token (the argmax kernel's choice), then with
    /// `Want::TopK` each row's top-k pairs, or with `Want::Logits` each row's logits.
    fn readback_bytes(&self, n_out: u32, want: Want) -> u64 {
        let n = n_out as u64;
        n * 4
            + match want {
                Want::Logits => n * self.config.vocab_size as u64 * 4,
                Want::TopK => n * kernels::topk::TOPK_ROW_WORDS as u64 * 4,
                Want::Argmax => 0,
            }
    }

    /// Copy a step's output into the readback (the layout [`Self::parse_output`] reads);
    /// returns its bytes.
    fn encode_readback(&self, enc: &mut wgpu::CommandEncoder, n_out: u32, want: Want) -> u64 {
        let n = n_out as u64;
        self.readback.copy_from(enc, &self.ws.argmax, 0, n * 4);
        let rows = self.readback_bytes(n_out, want) - n * 4;
        match want {
            Want::Logits => self.readback.copy_to(enc, &self.ws.logits, 0, n * 4, rows),
            Want::TopK => self.readback.copy_to(enc, &self.ws.topk, 0, n * 4, rows),
            Want::Argmax => {}
        }
        n * 4 + rows
    }

    /// The step's output from the bytes read back: `n_out` tokens (the argmax kernel's
    /// choices: the argmax, or a row's Gumbel-max draw), then the rows `want` asks for.
    pub(super) fn parse_output(&self, bytes: &[u8], n_out: u32, want: Want) -> StepOutput {
        if n_out == 0 {
            return StepOutput::default();
        }
        let (ids, rows) = bytes.split_at(n_out as usize * 4);
        let argmax: Vec<u32> = bytemuck::pod_collect_to_vec(ids);
        match want {
            Want::Logits => {
                let logits: Vec<f32> = bytemuck::pod_collect_to_vec(rows);
                StepOutput { argmax, logits: Some(logits), top: None, lse: None }
            }
            Want::TopK => {
                let words: Vec<u32> = bytemuck::pod_collect_to_vec(rows);
                let rows = words.chunks_exact(kernels::topk::TOPK_ROW_WORDS);
                let top: Vec<Vec<(u32, f32)>> = rows.clone().map(|w| kernels::topk::decode_row(w, kernels::topk::TOPK_MAX)).collect();
                let lse = rows.map(kernels::topk::row_logsumexp).collect();
                StepOutput { argmax, logits: None, top: Some(top), lse: Some(lse) }
            }
            Want::Argmax => StepOutput { argmax, logits: None, top: None, lse: None },
        }
    }

    /// Check a step's bitmasks (one row of `words(vocab)` per logit row) and upload them.
    fn upload_mask(&self, mask: &[u32], n_out: u32) -> Result<()> {
        let want = n_out as usize * kernels::logit_mask::words(self.config.vocab_size);
        if mask.len() != want {
            return Err(LanternError::InvalidRequest(format!(
                "token mask of {} words for {n_out} logit rows of {} tokens (want {want})",
                mask.len(),
                self.config.vocab_size
            )));
        }
        self.ctx.write(&self.ws.token_mask, 0, bytemuck::cast_slice(mask));
        Ok(())
    }

    /// Check a step's row draws (at most one per logit row, inverse temperatures finite and
    /// not negative) and upload them; rows a previous step drew and this one does not go
    /// back to the argmax.
    pub(super) fn upload_draws(&mut self, draws: &[RowDraw], n_out: u32) -> Result<()> {
        if draws.len() > n_out as usize {
            return Err(LanternError::InvalidRequest(format!("row draws for {} rows in a step of {n_out} logit rows", draws.len())));
        }
        if let Some((r, d)) = draws.iter().enumerate().find(|(_, d)| !(d.inv_t.is_finite() && d.inv_t >= 0.0)) {
            return Err(LanternError::InvalidRequest(format!(
                "row draw {r}: inverse temperature {} (want a finite value of at least 0)",
                d.inv_t
            )));
        }
        let set = draws.iter().rposition(|d| *d != RowDraw::ARGMAX).map_or(0, |i| i + 1);
        let write = set.max(self.row_draws_set).min(self.logit_rows);
        if write > 0 {
            let mut rows = draws[..set].to_vec();
            rows.resize(write, RowDraw::ARGMAX);
            self.ctx.write(&self.ws.row_draws, 0, bytemuck::cast_slice(&rows));
        }
        self.row_draws_set = set;
        Ok(())
    }

    /// Check a step's bias pairs (at most one row per logit row; tokens inside the
    /// vocabulary, once per row; finite deltas) and upload them, growing the buffer (and
    /// rebinding the bias dispatch) when they do not fit.
    fn upload_bias(&mut self, bias: &[Vec<(u32, f32)>], n_out: u32) -> Result<()> {
        let vocab = self.config.vocab_size;
        if bias.len() > n_out as usize {
            return Err(LanternError::InvalidRequest(format!("logit bias for {} rows in a step of {n_out} logit rows", bias.len())));
        }
        for (r, row) in bias.iter().enumerate() {
            let mut seen: Vec<u32> = row.iter().map(|p| p.0).collect();
            seen.sort_unstable();
            if let Some(&(t, d)) = row.iter().find(|&&(t, d)| t as usize >= vocab || !d.is_finite()) {
                return Err(LanternError::InvalidRequest(format!(
                    "logit bias row {r}: token {t} with delta {d} (tokens must be below the vocabulary size {vocab}, deltas finite)"
                )));
            }
            if let Some(w) = seen.windows(2).find(|w| w[0] == w[1]) {
                return Err(LanternError::InvalidRequest(format!("logit bias row {r}: token {} appears twice", w[0])));
            }
        }
        let words = kernels::logit_bias::pack(bias, self.logit_rows);
        let need = (words.len() * 4) as u64;
        if need > self.ws.logit_bias.size() {
            let bytes = need.next_power_of_two();
            self.ws.logit_bias = crate::gpu::buffer::create_zeroed(&self.ctx, "logit_bias", bytes).map_err(gpu_err)?;
            self.plans.logit_bias = kernels::logit_bias::rebind(
                &self.ctx,
                self.plans.logit_bias.pipeline.clone(),
                &self.ws.step,
                &self.ws.logit_bias,
                &self.ws.logits,
                vocab,
                self.logit_rows,
            );
            self.memory.workspace = self.ws.bytes();
        }
        self.ctx.write(&self.ws.logit_bias, 0, bytemuck::cast_slice(&words));
        Ok(())
    }

    async fn run_step_inner(&mut self, s: StepUniform, want: Want, all_rows: bool, ops: LogitOps<'_>) -> Result<StepOutput> {
        let ctx = self.ctx.clone();
        if s.n_out > 0 {
            self.upload_draws(&ops.draws, s.n_out)?;
        }
        let biased = ops.biased() && s.n_out > 0;
        if biased {
            self.upload_bias(&ops.bias, s.n_out)?;
        }
        let mut mask = ops.mask.filter(|_| s.n_out > 0);
        let scope = ctx.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let mut enc = ctx.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("step") });
        self.encode_pending_copies(&mut enc);
        let dispatches = self.step_dispatches(&s, want, all_rows, biased, mask.is_some());
        // Masked: the layers and the LM head go first, and the host computes the masks while
        // the GPU runs them; the mask, argmax / top-k and readback follow.
        let split = if mask.is_some() { dispatches.len() - 2 - usize::from(want == Want::TopK) } else { dispatches.len() };
        {
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some("forward"), timestamp_writes: None });
            ctx.counters.dispatched(kernels::encode_all(&mut pass, dispatches[..split].iter().copied(), &s));
        }
        if let Some(f) = mask.as_mut() {
            ctx.submit([enc.finish()]);
            let words = match f() {
                Ok(w) => w,
                Err(e) => {
                    let _ = scope.pop().await;
                    return Err(e);
                }
            };
            if let Err(e) = self.upload_mask(&words, s.n_out) {
                let _ = scope.pop().await;
                return Err(e);
            }
            enc = ctx.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("step tail") });
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some("mask and sample"), timestamp_writes: None });
            ctx.counters.dispatched(kernels::encode_all(&mut pass, dispatches[split..].iter().copied(), &s));
        }
        drop(dispatches);
        let bytes = if s.n_out > 0 { self.encode_readback(&mut enc, s.n_out, want) } else { 0 };
        ctx.submit([enc.finish()]);
        if let Some(e) = scope.pop().await {
            return Err(LanternError::Gpu(GpuError::Validation { context: "forward step".into(), message: e.to_string() }));
        }
        if s.n_out == 0 {
            return Ok(StepOutput::default());
        }
        let data = self.readback.read(&ctx, bytes).await.map_err(gpu_err)?;
        Ok(self.parse_output(&data[..bytes as usize], s.n_out, want))
    }

    /// Start a step of tokens of several sequences without running it (the frame-budgeted
    /// path): inputs are written and page copies submitted; [`Self::advance`] then submits
    /// its dispatches a few at a time and collects the result without ever waiting.
    pub fn begin_step_batch(&mut self, ids: &[u32], positions: &[u32], seqs: &[u32], rows: &[u32], want: Want) -> Result<PendingStep> {
        self.begin_step_batch_with(ids, positions, seqs, rows, want, LogitOps::default())
    }

    /// [`Self::begin_step_batch`] with the logit rows biased and masked by `ops` (the masks
    /// are asked for here, up front: this path submits a step across several calls, so they
    /// are not overlapped with the GPU's work).
    pub fn begin_step_batch_with(
        &mut self,
        ids: &[u32],
        positions: &[u32],
        seqs: &[u32],
        rows: &[u32],
        want: Want,
        ops: LogitOps<'_>,
    ) -> Result<PendingStep> {
        self.ctx.check_lost().map_err(LanternError::Gpu)?;
        self.validate_batch(Some(ids), positions, seqs, rows)?;
        let s = self.write_batch_inputs(ids, positions, seqs, rows);
        if s.n_out > 0 {
            self.upload_draws(&ops.draws, s.n_out)?;
        }
        let biased = ops.biased() && s.n_out > 0;
        if biased {
            self.upload_bias(&ops.bias, s.n_out)?;
        }
        let masked = match ops.mask {
            Some(f) if s.n_out > 0 => {
                self.upload_mask(&f()?, s.n_out)?;
                true
            }
            _ => false,
        };
        let mut enc = self.ctx.device.create_command_encoder(&Default::default());
        self.encode_pending_copies(&mut enc);
        self.ctx.submit([enc.finish()]);
        Ok(PendingStep { s, want, masked, biased, next: 0, mapping: None, submissions: 0 })
    }

    /// Submit more of `p`'s dispatches until `deadline` or `max_dispatches` (at least one
    /// dispatch per call; submissions of at most [`DISPATCHES_PER_SUBMIT`], fewer when the
    /// measured cost per dispatch says more would pass the deadline), then its readback,
    /// then check without waiting whether the result has arrived: `Some` once it has. Never
    /// blocks on the GPU.
    pub async fn advance(&mut self, p: &mut PendingStep, deadline: web_time::Instant, max_dispatches: usize) -> Result<Option<StepOutput>> {
        let ctx = self.ctx.clone();
        ctx.check_lost().map_err(LanternError::Gpu)?;
        let dispatches = self.step_dispatches(&p.s, p.want, false, p.biased, p.masked);
        let total = dispatches.len();
        let mut this_call = 0;
        let mut cost = self.submit_ms_per_dispatch;
        while p.next < total && this_call < max_dispatches.max(1) {
            let now = web_time::Instant::now();
            if this_call > 0 && now >= deadline {
                break;
            }
            // As many dispatches as the measured cost says fit in what is left of the
            // budget (at least one per call, so a step always progresses).
            let left_ms = deadline.saturating_duration_since(now).as_secs_f64() * 1e3;
            let fit = match cost {
                Some(c) if c > 0.0 => ((left_ms / c).floor() as usize).clamp(1, DISPATCHES_PER_SUBMIT),
                _ => 1,
            };
            let n = fit.min(max_dispatches.max(1) - this_call).min(total - p.next).max(1);
            let scope = ctx.device.push_error_scope(wgpu::ErrorFilter::Validation);
            let mut enc = ctx.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("step part") });
            let end = p.next + n;
            {
                let mut pass = enc.begin_compute_pass(&Default::default());
                ctx.counters.dispatched(kernels::encode_all(&mut pass, dispatches[p.next..end].iter().copied(), &p.s));
            }
            if end == total && p.s.n_out > 0 {
                self.encode_readback(&mut enc, p.s.n_out, p.want);
            }
            ctx.submit([enc.finish()]);
            if let Some(e) = scope.pop().await {
                return Err(LanternError::Gpu(GpuError::Validation { context: "forward step".into(), message: e.to_string() }));
            }
            // What one dispatch costs the caller here (encoding and submitting; on CPU
            // adapters the work itself runs inside submit): a moving average over the
            // submissions after a call's first, since the first also waits for whatever the
            // host queued before the call (its own frame), which more dispatches do not add.
            if this_call > 0 || cost.is_none() {
                let per = now.elapsed().as_secs_f64() * 1e3 / n as f64;
                cost = Some(match cost {
                    Some(c) => 0.7 * c + 0.3 * per,
                    None => per,
                });
            }
            p.next = end;
            p.submissions += 1;
            this_call += n;
        }
        self.submit_ms_per_dispatch = cost;
        if p.next < total {
            return Ok(None);
        }
        if p.s.n_out == 0 {
            return Ok(Some(StepOutput::default()));
        }
        let bytes = self.readback_bytes(p.s.n_out, p.want);
        if p.mapping.is_none() {
            p.mapping = Some(self.readback.start_map(bytes));
        }
        // Let the device make progress and deliver the map callback, without waiting.
        #[cfg(not(target_arch = "wasm32"))]
        let _ = ctx.device.poll(wgpu::PollType::Poll);
        match p.mapping.as_mut().map(|rx| rx.try_recv()) {
            Some(Ok(Some(r))) => r.map_err(|e| LanternError::Gpu(GpuError::Readback(e.to_string())))?,
            Some(Ok(None)) => return Ok(None),
            _ => return Err(LanternError::Gpu(GpuError::Readback("map callback dropped (device lost?)".into()))),
        }
        let data = self.readback.take_mapped(bytes).map_err(gpu_err)?;
        Ok(Some(self.parse_output(&data[..bytes as usize], p.s.n_out, p.want)))
    }

    /// Time every dispatch of one step separately (one submission and wait per dispatch):
    /// wall-clock milliseconds per dispatch label, summed over layers. Appends `tokens` to
    /// `seq` like `forward`. For profiling only: it is much slower than a real step.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn profile_step(&mut self, seq: usize, tokens: &[u32]) -> Result<Vec<(String, f64, usize)>> {
        self.check_ids(tokens)?;
        let start = self.kv.alloc.append(seq, tokens.len()).map_err(LanternError::Kv)?;
        let n = tokens.len() as u32;
        let s = self.write_step_inputs(seq, tokens, start, &[n - 1]);
        let ctx = self.ctx.clone();
        let mut enc = ctx.device.create_command_encoder(&Default::default());
        self.encode_pending_copies(&mut enc);
        ctx.submit([enc.finish()]);
        let layers = self.layer_plan_for(tokens.len());
        let all: Vec<&Dispatch> = self
            .plans
            .embed
            .iter()
            .chain(layers.iter())
            .chain(self.plans.head_gather.iter())
            .chain(std::iter::once(&self.plans.argmax))
            .collect();
        let _ = ctx.device.poll(wgpu::PollType::wait_indefinitely());
        let mut acc: Vec<(String, f64, usize)> = Vec::new();
        for d in all {
            let t0 = web_time::Instant::now();
            let mut enc = ctx.device.create_command_encoder(&Default::default());
            {
                let mut pass = enc.begin_compute_pass(&Default::default());
                d.encode(&mut pass, &s);
            }
            ctx.submit([enc.finish()]);
            let _ = ctx.device.poll(wgpu::PollType::wait_indefinitely());
            let ms = t0.elapsed().as_secs_f64() * 1e3;
            // Group by kernel variant and weight name without the layer index.
            let key = d
                .label
                .split_whitespace()
                .map(|w| {
                    w.split('.').filter(|p| p.parse::<usize>().is_err() && *p != "model" && *p != "layers").collect::<Vec<_>>().join(".")
                })
                .collect::<Vec<_>>()
                .join(" ");
            match acc.iter_mut().find(|e| e.0 == key) {
                Some(e) => {
                    e.1 += ms;
                    e.2 += 1;
                }
                None => acc.push((key, ms, 1)),
            }
        }
        Ok(acc)
    }

    /// The KV error of trying to add `n` tokens to `seq`, if it would fail.
    pub fn check_fits(&self, seq: usize, n: usize) -> std::result::Result<(), KvError> {
        let needed = self.kv.alloc.pages_needed(seq, n)?;
        if needed > self.kv.alloc.free_pages() {
            return Err(KvError::Full {
                needed,
                free: self.kv.alloc.free_pages(),
                total: self.kv.alloc.config.num_pages,
                page_size: self.kv.alloc.config.page_size,
            });
        }
        Ok(())
    }
}

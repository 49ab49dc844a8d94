//! Decoding ahead of the host: one sequence's greedy decode steps are submitted before the
//! tokens they depend on have come back. Each step's GPU argmax is copied, on the GPU, into
//! the `ids` slot the next step's embedding gather reads, so the host never needs a token to
//! encode the next step; it keeps [`ModelOptions::decode_ahead`](super::ModelOptions) steps
//! in flight and reads each step's token from its own small readback buffer, oldest first,
//! while the later ones run. The caller checks EOS, stop strings and the token limit on the
//! tokens as they arrive; [`GpuModel::end_ahead`] then drains the steps still in flight and
//! truncates the sequence to the tokens taken (their KV is never read: attention reads only
//! a sequence's length). The tokens are exactly those of the step-at-a-time path, since
//! every step runs the same dispatches on the same inputs.
//!
//! Sampled decoding runs ahead the same way: each step draws its token on the GPU from the
//! row's top-k pairs (`kernels::sample`, with a uniform number the caller supplies per step)
//! and reads the pairs back beside the token, so the caller can check the draw against its
//! own sampler and restart from its token where f32 rounding made them differ.
//!
//! The batching engine decodes ahead the same way, a step at a time for all its sequences
//! ([`GpuModel::submit_decode_batch`]): a greedy decode step of every running sequence is
//! submitted with its ids copied on the GPU from the previous step's argmax rows before the
//! host reads that step's tokens, so the device has the next step queued while the host
//! streams, checks stops and schedules.
//!
//! Per step the host writes the position (4 bytes; and the draw when sampling), the step
//! uniform when the key splits change, and the sequence's block-table row when its pages
//! change; the bind groups are the load-time ones, and no buffer is created.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;

use crate::gpu::{GpuError, Readback};
use crate::kernels::argmax::RowDraw;
use crate::kernels::sample::SampleParams;
use crate::kernels::topk::TOPK_ROW_WORDS;
use crate::kernels::{self, StepUniform};
use crate::{LanternError, Result};

use super::{gpu_err, GpuModel, StepOutput, Want};

/// Resolves to the validation error a submitted step raised, if any (`Send` on native,
/// like wgpu's own future, so a model with a run open can move between threads).
#[cfg(not(target_arch = "wasm32"))]
type ErrorFuture = Pin<Box<dyn Future<Output = Option<wgpu::Error>> + Send>>;
#[cfg(target_arch = "wasm32")]
type ErrorFuture = Pin<Box<dyn Future<Output = Option<wgpu::Error>>>>;

/// One submitted step whose token has not been taken.
struct Flight {
    slot: usize,
    submission: wgpu::SubmissionIndex,
    map: futures_channel::oneshot::Receiver<std::result::Result<(), wgpu::BufferAsyncError>>,
    errors: ErrorFuture,
}

/// A decode run of one sequence in progress (see the module docs).
pub(super) struct Ahead {
    seq: usize,
    /// Tokens in the cache when the run began (the first input token is not among them).
    base: usize,
    /// Steps submitted (step `i` writes position `base + i`).
    submitted: usize,
    /// Tokens handed to the caller.
    taken: usize,
    /// Most steps the run may submit.
    limit: usize,
    flights: VecDeque<Flight>,
    /// The sequence's block-table row as last written to the GPU.
    table: Vec<u32>,
    /// Key splits in the step uniform on the GPU.
    splits: u32,
    /// Next readback slot.
    next_slot: usize,
    /// Tokens are drawn on the GPU from the top-k pairs (else the argmax).
    sampling: bool,
    /// No further steps are submitted while set ([`GpuModel::hold_ahead`]).
    hold: bool,
}

/// One token of a run ahead: the id the GPU chose (and fed to the next step) and, when the
/// run samples, the row's top-k pairs it drew from (for the caller's own draw).
#[derive(Debug, Clone)]
pub struct AheadToken {
    pub token: u32,
    pub top: Option<StepOutput>,
}

/// Bytes of a readback slot: the token, then a top-k row.
const SLOT_BYTES: u64 = 4 + TOPK_ROW_WORDS as u64 * 4;

/// Readback slots for runs ahead: one per step in flight (the token id and, when sampling,
/// the top-k row it was drawn from).
pub(super) fn slots(ctx: &crate::gpu::GpuContext, depth: usize) -> Vec<Readback> {
    (0..depth).map(|_| Readback::new(ctx, "decode-ahead readback", SLOT_BYTES)).collect()
}

impl GpuModel {
    /// Steps a run ahead keeps in flight (0 where runs ahead are off).
    pub fn decode_ahead_depth(&self) -> usize {
        self.ahead_slots.len()
    }

    /// Start decoding `seq` ahead of the host: `first` is the last sampled token (not yet in
    /// the cache), and at most `limit` steps (tokens) will be submitted. Tokens are the GPU
    /// argmax, or with `sampling` drawn on the GPU from each step's top-k pairs. Take them with
    /// [`Self::ahead_next`] and end with [`Self::end_ahead`]. A run left unended is drained
    /// here first.
    pub async fn begin_ahead(&mut self, seq: usize, first: u32, limit: usize, sampling: Option<SampleParams>) -> Result<()> {
        if self.ahead_slots.is_empty() {
            return Err(LanternError::InvalidRequest("decoding ahead is off for this model (decode_ahead < 2)".into()));
        }
        if self.ahead.is_some() {
            // A run dropped without end_ahead (an error on its caller's path): drain its
            // readbacks; its sequence is its owner's to release.
            let _ = self.drain_ahead().await;
        }
        self.check_ids(&[first])?;
        self.ctx.check_lost().map_err(LanternError::Gpu)?;
        let base = self.sequence_len(seq)?;
        let ctx = &self.ctx;
        ctx.write(&self.ws.ids, 0, bytemuck::bytes_of(&first));
        ctx.write(&self.ws.token_seq, 0, bytemuck::bytes_of(&(seq as u32)));
        ctx.write(&self.ws.logit_rows, 0, bytemuck::bytes_of(&0u32));
        if let Some(p) = &sampling {
            p.check().map_err(LanternError::InvalidRequest)?;
            ctx.write(&self.ws.sample_params, 0, bytemuck::bytes_of(p));
        }
        self.ahead = Some(Ahead {
            seq,
            base,
            submitted: 0,
            taken: 0,
            limit,
            flights: VecDeque::with_capacity(self.ahead_slots.len()),
            table: Vec::new(),
            splits: u32::MAX,
            next_slot: 0,
            sampling: sampling.is_some(),
            hold: false,
        });
        Ok(())
    }

    /// The next token of the run ahead: submits steps until the run's depth is in flight (or
    /// its limit is reached), then waits for the oldest step's token. `draw` gives each
    /// submitted step (in step order) how the argmax kernel chooses its token (the argmax,
    /// or a Gumbel-max draw) and, when the run samples from the top-k pairs,
    /// its uniform number in [0, 1). An error once the run has taken `limit` tokens.
    pub async fn ahead_next(&mut self, draw: &mut dyn FnMut() -> (RowDraw, f32)) -> Result<AheadToken> {
        let Some(mut a) = self.ahead.take() else {
            return Err(LanternError::InvalidRequest("ahead_next without begin_ahead".into()));
        };
        let r = self.next_of(&mut a, draw).await;
        self.ahead = Some(a);
        r
    }

    async fn next_of(&mut self, a: &mut Ahead, draw: &mut dyn FnMut() -> (RowDraw, f32)) -> Result<AheadToken> {
        while a.flights.len() < self.ahead_slots.len() && a.submitted < a.limit && !a.hold {
            let (row, u) = draw();
            self.submit_ahead(a, row, a.sampling.then_some(u))?;
        }
        let Some(f) = a.flights.pop_front() else {
            return Err(LanternError::InvalidRequest(format!("ahead_next past the run's limit of {} tokens", a.limit)));
        };
        let token = self.land(f, a.flights.is_empty(), a.sampling).await?;
        a.taken += 1;
        Ok(token)
    }

    /// Submit no further steps while `hold` (a speculative request about to verify drafts
    /// takes the tokens already in flight first; they are valid plain steps). Returns the
    /// steps still in flight.
    pub fn hold_ahead(&mut self, hold: bool) -> usize {
        match self.ahead.as_mut() {
            Some(a) => {
                a.hold = hold;
                a.flights.len()
            }
            None => 0,
        }
    }

    /// End the run ahead: wait for the steps still in flight (their tokens are discarded) and
    /// keep only the tokens taken in the sequence's cache (the last one taken is not in it,
    /// as after a step-at-a-time decode).
    pub async fn end_ahead(&mut self) -> Result<()> {
        let Some((seq, keep)) = self.ahead.as_ref().map(|a| (a.seq, a.base + a.taken)) else {
            return Ok(());
        };
        let drained = self.drain_ahead().await;
        let truncated = self.kv.alloc.truncate(seq, keep).map_err(LanternError::Kv);
        drained.and(truncated)
    }

    /// Wait for every step in flight and unmap its readback; the run is over.
    async fn drain_ahead(&mut self) -> Result<()> {
        let mut first_err = Ok(());
        if let Some(mut a) = self.ahead.take() {
            while let Some(f) = a.flights.pop_front() {
                let idle = a.flights.is_empty();
                if let Err(e) = self.land(f, idle, false).await {
                    if first_err.is_ok() {
                        first_err = Err(e);
                    }
                }
            }
        }
        first_err
    }

    /// Wait for a submitted step and read its token, and with `top` the top-k row it was
    /// drawn from (`idle`: nothing else is queued behind it).
    async fn land(&self, f: Flight, idle: bool, top: bool) -> Result<AheadToken> {
        let slot = f.slot;
        let bytes = self.await_flight(f, idle, &self.ahead_slots[slot], if top { SLOT_BYTES } else { 4 }).await?;
        let token = u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
        let top = top.then(|| self.parse_output(&bytes[..SLOT_BYTES as usize], 1, Want::TopK));
        Ok(AheadToken { token, top })
    }

    /// Wait for a submitted step (native: for its submission only; `idle`: nothing else is
    /// queued behind it, so the wait leaves the device idle) and take `bytes` from its
    /// readback `rb`.
    async fn await_flight(&self, f: Flight, idle: bool, rb: &Readback, bytes: u64) -> Result<Vec<u8>> {
        let ctx = &self.ctx;
        #[cfg(not(target_arch = "wasm32"))]
        ctx.wait_idle(Some(f.submission), idle).map_err(gpu_err)?;
        #[cfg(target_arch = "wasm32")]
        let _ = (f.submission, idle);
        if let Some(e) = f.errors.await {
            return Err(LanternError::Gpu(GpuError::Validation { context: "decode step ahead".into(), message: e.to_string() }));
        }
        match f.map.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(LanternError::Gpu(GpuError::Readback(e.to_string()))),
            Err(_) => return Err(LanternError::Gpu(GpuError::Readback("map callback dropped (device lost?)".into()))),
        }
        ctx.counters.read_back();
        rb.take_mapped(bytes).map_err(gpu_err)
    }

    /// Encode and submit the run's next step (`row`: how the argmax kernel chooses its token;
    /// `u`: its uniform draw when sampling from the top-k pairs).
    fn submit_ahead(&mut self, a: &mut Ahead, row: RowDraw, u: Option<f32>) -> Result<()> {
        let ctx = self.ctx.clone();
        self.upload_draws(&[row], 1)?;
        let pos = self.kv.alloc.append(a.seq, 1).map_err(LanternError::Kv)?;
        debug_assert_eq!(pos, a.base + a.submitted);
        let mut s = StepUniform::new(1, 1);
        s.n_splits = self.splits_for(1, pos + 1) as u32;
        if s.n_splits != a.splits {
            ctx.write(&self.ws.step, 0, bytemuck::bytes_of(&s));
            a.splits = s.n_splits;
        }
        ctx.write(&self.ws.positions, 0, bytemuck::bytes_of(&(pos as u32)));
        if let Some(u) = u {
            ctx.write(&self.ws.draws, 0, bytemuck::bytes_of(&u));
        }
        let pages = self.kv.alloc.pages(a.seq).map_err(LanternError::Kv)?;
        if pages != a.table.as_slice() {
            let row = (a.seq * self.kv.alloc.config.max_pages_per_seq() * 4) as u64;
            ctx.write(&self.ws.block_table, row, bytemuck::cast_slice(pages));
            a.table.clear();
            a.table.extend_from_slice(pages);
        }
        let slot = a.next_slot;
        a.next_slot = (slot + 1) % self.ahead_slots.len();
        let scope = ctx.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let mut enc = ctx.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("decode step ahead") });
        self.encode_pending_copies(&mut enc);
        {
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some("forward"), timestamp_writes: None });
            let want = if a.sampling { Want::TopK } else { Want::Argmax };
            let mut dispatches = self.step_dispatches(&s, want, false, false, false);
            if a.sampling {
                // The draw overwrites the argmax with the sampled id.
                dispatches.push(&self.plans.sample);
            }
            ctx.counters.dispatched(kernels::encode_all(&mut pass, dispatches, &s));
        }
        // The token goes where the next step's embedding reads it, and to this step's slot
        // (with the top-k row it was drawn from).
        enc.copy_buffer_to_buffer(&self.ws.argmax, 0, &self.ws.ids, 0, 4);
        let rb = &self.ahead_slots[slot];
        let bytes = if a.sampling {
            rb.copy_to(&mut enc, &self.ws.argmax, 0, 0, 4);
            rb.copy_to(&mut enc, &self.ws.topk, 0, 4, SLOT_BYTES - 4);
            SLOT_BYTES
        } else {
            rb.copy_from(&mut enc, &self.ws.argmax, 0, 4);
            4
        };
        let submission = ctx.submit([enc.finish()]);
        let errors: ErrorFuture = Box::pin(scope.pop());
        let map = rb.start_map(bytes);
        a.flights.push_back(Flight { slot, submission, map, errors });
        a.submitted += 1;
        Ok(())
    }
}

/// One batched decode step submitted by [`GpuModel::submit_decode_batch`] whose tokens have
/// not been read: one token per sequence, in the order the step was given them.
pub(crate) struct BatchFlight {
    flight: Flight,
    rows: usize,
    /// Tokens were drawn on the GPU from top-k rows, which were read back with them.
    sampled: bool,
}

/// Sampling for a batched step decoded ahead: the parameters every sampled row shares and
/// one uniform number per row (0 for a greedy row: the draw is then the row's best pair, its
/// argmax).
pub(crate) struct BatchSampling<'a> {
    pub params: SampleParams,
    pub draws: &'a [f32],
}

/// Bytes of a batched readback slot per row: the token, and the top-k row it was drawn from.
const BATCH_ROW_BYTES: u64 = 4 + TOPK_ROW_WORDS as u64 * 4;

/// Readback slots for the engine's batched steps ahead (two: one step on the GPU while the
/// host completes the one before), each holding a token and a top-k row per logit row.
pub(super) fn batch_slots(ctx: &crate::gpu::GpuContext, depth: usize, logit_rows: usize) -> Vec<Readback> {
    if depth < 2 {
        return Vec::new();
    }
    (0..2).map(|_| Readback::new(ctx, "batched decode-ahead readback", logit_rows as u64 * BATCH_ROW_BYTES)).collect()
}

impl GpuModel {
    /// Whether batched decode steps can be submitted ahead (`ModelOptions::decode_ahead` of
    /// at least 2).
    pub(crate) fn decodes_batches_ahead(&self) -> bool {
        !self.batch_slots.is_empty()
    }

    /// Submit a decode step of one token per sequence (token `i` at `positions[i]` of
    /// sequence `seqs[i]`, its pages reserved; logit row `i`) without waiting for it, and
    /// return it in flight; [`Self::land_decode_batch`] reads it. Each row's token is its
    /// argmax kernel's choice (the argmax, or the draw `row_draws` gives the row), or with
    /// `sampling` a draw on the GPU from the row's top-k pairs (`kernels::sample`, one
    /// uniform number per row, negative to keep the argmax kernel's choice; the top-k rows
    /// are read back so the caller can check each draw against its own sampler). `ids` gives the step's input
    /// tokens, or with `None` each sequence's input is the token of the same row of the step
    /// submitted just before this one, copied on the GPU (the engine submits the same
    /// sequences, in the same order, before reading that step), so the host needs no token
    /// to encode the next step. Per step the host writes the step's inputs (and the draws);
    /// no buffer or bind group is created.
    pub(crate) fn submit_decode_batch(
        &mut self,
        ids: Option<&[u32]>,
        positions: &[u32],
        seqs: &[u32],
        row_draws: &[RowDraw],
        sampling: Option<BatchSampling<'_>>,
    ) -> Result<BatchFlight> {
        let n = seqs.len();
        if self.batch_slots.is_empty() {
            return Err(LanternError::InvalidRequest("batched decoding ahead is off for this model (decode_ahead < 2)".into()));
        }
        let rows: Vec<u32> = (0..n as u32).collect();
        // (Without ids, the tokens a step feeds the next are always inside the vocabulary.)
        self.validate_batch(ids, positions, seqs, &rows)?;
        if let Some(sp) = &sampling {
            if sp.draws.len() != n {
                return Err(LanternError::InvalidRequest(format!("submit_decode_batch: {} draws for {n} sequences", sp.draws.len())));
            }
            sp.params.check().map_err(LanternError::InvalidRequest)?;
        }
        self.ctx.check_lost().map_err(LanternError::Gpu)?;
        let ctx = self.ctx.clone();
        self.upload_draws(row_draws, n as u32)?;
        let s = self.write_batch_inputs_from(ids, positions, seqs, &rows);
        if let Some(sp) = &sampling {
            ctx.write(&self.ws.sample_params, 0, bytemuck::bytes_of(&sp.params));
            ctx.write(&self.ws.draws, 0, bytemuck::cast_slice(sp.draws));
        }
        let slot = self.next_batch_slot;
        self.next_batch_slot = (slot + 1) % self.batch_slots.len();
        if std::mem::replace(&mut self.batch_unlanded[slot], true) {
            // A flight dropped without landing (its engine was taken apart): abort its map.
            self.batch_slots[slot].abandon();
        }
        let id_bytes = n as u64 * 4;
        let scope = ctx.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let mut enc = ctx.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("batched decode step ahead") });
        if ids.is_none() {
            enc.copy_buffer_to_buffer(&self.ws.argmax, 0, &self.ws.ids, 0, id_bytes);
        }
        self.encode_pending_copies(&mut enc);
        {
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some("forward"), timestamp_writes: None });
            let want = if sampling.is_some() { Want::TopK } else { Want::Argmax };
            let mut dispatches = self.step_dispatches(&s, want, false, false, false);
            if sampling.is_some() {
                // The draws overwrite the argmax rows with the sampled ids.
                dispatches.push(&self.plans.sample);
            }
            ctx.counters.dispatched(kernels::encode_all(&mut pass, dispatches, &s));
        }
        let rb = &self.batch_slots[slot];
        let bytes = if sampling.is_some() {
            rb.copy_to(&mut enc, &self.ws.argmax, 0, 0, id_bytes);
            rb.copy_to(&mut enc, &self.ws.topk, 0, id_bytes, n as u64 * (BATCH_ROW_BYTES - 4));
            n as u64 * BATCH_ROW_BYTES
        } else {
            rb.copy_from(&mut enc, &self.ws.argmax, 0, id_bytes);
            id_bytes
        };
        let submission = ctx.submit([enc.finish()]);
        let errors: ErrorFuture = Box::pin(scope.pop());
        let map = rb.start_map(bytes);
        Ok(BatchFlight { flight: Flight { slot, submission, map, errors }, rows: n, sampled: sampling.is_some() })
    }

    /// Wait for a batched step submitted by [`Self::submit_decode_batch`] and read it
    /// (`idle`: no step is queued behind it): its argmax rows are the tokens the GPU fed each
    /// sequence's next step (with the top-k rows they were drawn from, when sampled).
    pub(crate) async fn land_decode_batch(&mut self, f: BatchFlight, idle: bool) -> Result<StepOutput> {
        let (slot, n, sampled) = (f.flight.slot, f.rows, f.sampled);
        let bytes = if sampled { n as u64 * BATCH_ROW_BYTES } else { n as u64 * 4 };
        let data = self.await_flight(f.flight, idle, &self.batch_slots[slot], bytes).await?;
        // (On an error the slot stays marked: its next step aborts whatever map is left.)
        self.batch_unlanded[slot] = false;
        Ok(self.parse_output(&data[..bytes as usize], n as u32, if sampled { Want::TopK } else { Want::Argmax }))
    }
}

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
//! Per step the host writes the position (4 bytes), the step uniform when the key splits
//! change, and the sequence's block-table row when its pages change; the bind groups are the
//! load-time ones, and no buffer is created.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;

use crate::gpu::{GpuError, Readback};
use crate::kernels::{self, StepUniform};
use crate::{LanternError, Result};

use super::{gpu_err, GpuModel, Want};

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
}

/// Readback slots for runs ahead: one per step in flight, 4 bytes each (one token id).
pub(super) fn slots(ctx: &crate::gpu::GpuContext, depth: usize) -> Vec<Readback> {
    (0..depth).map(|_| Readback::new(ctx, "decode-ahead readback", 4)).collect()
}

impl GpuModel {
    /// Steps a run ahead keeps in flight (0 where runs ahead are off).
    pub fn decode_ahead_depth(&self) -> usize {
        self.ahead_slots.len()
    }

    /// Start decoding `seq` ahead of the host with greedy (GPU argmax) sampling: `first` is
    /// the last sampled token (not yet in the cache), and at most `limit` steps (tokens) will
    /// be submitted. Take the tokens with [`Self::ahead_next`] and end with
    /// [`Self::end_ahead`]. A run left unended is drained here first.
    pub async fn begin_ahead(&mut self, seq: usize, first: u32, limit: usize) -> Result<()> {
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
        });
        Ok(())
    }

    /// The next token of the run ahead: submits steps until the run's depth is in flight (or
    /// its limit is reached), then waits for the oldest step's token. An error once the run
    /// has taken `limit` tokens.
    pub async fn ahead_next(&mut self) -> Result<u32> {
        let Some(mut a) = self.ahead.take() else {
            return Err(LanternError::InvalidRequest("ahead_next without begin_ahead".into()));
        };
        let r = self.next_of(&mut a).await;
        self.ahead = Some(a);
        r
    }

    async fn next_of(&mut self, a: &mut Ahead) -> Result<u32> {
        while a.flights.len() < self.ahead_slots.len() && a.submitted < a.limit {
            self.submit_ahead(a)?;
        }
        let Some(f) = a.flights.pop_front() else {
            return Err(LanternError::InvalidRequest(format!("ahead_next past the run's limit of {} tokens", a.limit)));
        };
        let token = self.land(f, a.flights.is_empty()).await?;
        a.taken += 1;
        Ok(token)
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
                if let Err(e) = self.land(f, idle).await {
                    if first_err.is_ok() {
                        first_err = Err(e);
                    }
                }
            }
        }
        first_err
    }

    /// Wait for a submitted step and read its token (`idle`: nothing else is queued behind it).
    async fn land(&self, f: Flight, idle: bool) -> Result<u32> {
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
        let bytes = self.ahead_slots[f.slot].take_mapped(4).map_err(gpu_err)?;
        Ok(u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]))
    }

    /// Encode and submit the run's next step.
    fn submit_ahead(&mut self, a: &mut Ahead) -> Result<()> {
        let ctx = self.ctx.clone();
        let pos = self.kv.alloc.append(a.seq, 1).map_err(LanternError::Kv)?;
        debug_assert_eq!(pos, a.base + a.submitted);
        let mut s = StepUniform::new(1, 1);
        s.n_splits = self.splits_for(1, pos + 1) as u32;
        if s.n_splits != a.splits {
            ctx.write(&self.ws.step, 0, bytemuck::bytes_of(&s));
            a.splits = s.n_splits;
        }
        ctx.write(&self.ws.positions, 0, bytemuck::bytes_of(&(pos as u32)));
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
            let dispatches = self.step_dispatches(&s, Want::Argmax, false, false, false);
            ctx.counters.dispatched(kernels::encode_all(&mut pass, dispatches, &s));
        }
        // The token goes where the next step's embedding reads it, and to this step's slot.
        enc.copy_buffer_to_buffer(&self.ws.argmax, 0, &self.ws.ids, 0, 4);
        self.ahead_slots[slot].copy_from(&mut enc, &self.ws.argmax, 0, 4);
        let submission = ctx.submit([enc.finish()]);
        let errors: ErrorFuture = Box::pin(scope.pop());
        let map = self.ahead_slots[slot].start_map(4);
        a.flights.push_back(Flight { slot, submission, map, errors });
        a.submitted += 1;
        Ok(())
    }
}

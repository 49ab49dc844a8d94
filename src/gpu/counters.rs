//! What the host does on the device's behalf, counted: dispatches encoded, command
//! submissions, buffer writes, readbacks, blocking waits (and the time spent in them), bind
//! groups and buffers created. A run takes a [`HostCounts`] snapshot before and after its
//! decode steps; the difference per token is the host's work per token (`lantern run
//! --json`'s `host` block), and on wgpu's noop backend, which executes nothing, the wall
//! time per token is the host's cost alone.

use std::sync::atomic::{AtomicU64, Ordering};

use serde::Serialize;

/// Live counters of one [`super::GpuContext`] (shared by every model on it).
#[derive(Debug, Default)]
pub struct HostCounters {
    dispatches: AtomicU64,
    submits: AtomicU64,
    writes: AtomicU64,
    readbacks: AtomicU64,
    waits: AtomicU64,
    stalls: AtomicU64,
    wait_ns: AtomicU64,
    bind_groups: AtomicU64,
}

/// A snapshot of [`HostCounters`] (plus the buffers and textures the ledger recorded).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct HostCounts {
    /// Compute dispatches encoded.
    pub dispatches: u64,
    /// `Queue::submit` calls.
    pub submits: u64,
    /// `Queue::write_buffer` calls (each one a staging copy inside wgpu).
    pub writes: u64,
    /// Buffers mapped and read back.
    pub readbacks: u64,
    /// Times the host blocked until the device finished a submission.
    pub waits: u64,
    /// Those of the waits with nothing else queued behind the awaited submission: the
    /// device idles from then until the host submits again.
    pub stalls: u64,
    /// Nanoseconds spent blocked in those waits.
    pub wait_ns: u64,
    /// Bind groups created.
    pub bind_groups: u64,
    /// Buffers and textures created (the allocation ledger's entries).
    pub buffers: u64,
}

impl HostCounts {
    /// `self - earlier`, field by field.
    pub fn since(&self, earlier: &HostCounts) -> HostCounts {
        HostCounts {
            dispatches: self.dispatches - earlier.dispatches,
            submits: self.submits - earlier.submits,
            writes: self.writes - earlier.writes,
            readbacks: self.readbacks - earlier.readbacks,
            waits: self.waits - earlier.waits,
            stalls: self.stalls - earlier.stalls,
            wait_ns: self.wait_ns - earlier.wait_ns,
            bind_groups: self.bind_groups - earlier.bind_groups,
            buffers: self.buffers - earlier.buffers,
        }
    }
}

impl HostCounters {
    pub(crate) fn dispatched(&self, n: usize) {
        self.dispatches.fetch_add(n as u64, Ordering::Relaxed);
    }
    pub(crate) fn submitted(&self) {
        self.submits.fetch_add(1, Ordering::Relaxed);
    }
    pub(crate) fn wrote(&self) {
        self.writes.fetch_add(1, Ordering::Relaxed);
    }
    pub(crate) fn read_back(&self) {
        self.readbacks.fetch_add(1, Ordering::Relaxed);
    }
    #[cfg(not(target_arch = "wasm32"))]
    pub(crate) fn waited(&self, d: std::time::Duration, idle: bool) {
        self.waits.fetch_add(1, Ordering::Relaxed);
        if idle {
            self.stalls.fetch_add(1, Ordering::Relaxed);
        }
        self.wait_ns.fetch_add(d.as_nanos() as u64, Ordering::Relaxed);
    }
    pub(crate) fn bound(&self) {
        self.bind_groups.fetch_add(1, Ordering::Relaxed);
    }

    /// The counts so far; `buffers` is filled in by [`super::GpuContext::host_counts`].
    fn snapshot(&self) -> HostCounts {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        HostCounts {
            dispatches: l(&self.dispatches),
            submits: l(&self.submits),
            writes: l(&self.writes),
            readbacks: l(&self.readbacks),
            waits: l(&self.waits),
            stalls: l(&self.stalls),
            wait_ns: l(&self.wait_ns),
            bind_groups: l(&self.bind_groups),
            buffers: 0,
        }
    }
}

impl super::GpuContext {
    /// What the host has done on this context so far (see [`HostCounts`]).
    pub fn host_counts(&self) -> HostCounts {
        HostCounts { buffers: self.ledger.mark() as u64, ..self.counters.snapshot() }
    }

    /// Create a bind group (counted).
    pub fn bind_group(&self, desc: &wgpu::BindGroupDescriptor<'_>) -> wgpu::BindGroup {
        self.counters.bound();
        self.device.create_bind_group(desc)
    }

    /// Submit command buffers (counted); the index waits can name.
    pub fn submit<I: IntoIterator<Item = wgpu::CommandBuffer>>(&self, cmds: I) -> wgpu::SubmissionIndex {
        self.counters.submitted();
        self.queue.submit(cmds)
    }

    /// `Queue::write_buffer` (counted).
    pub fn write(&self, buffer: &wgpu::Buffer, offset: u64, data: &[u8]) {
        self.counters.wrote();
        self.queue.write_buffer(buffer, offset, data);
    }

    /// Block until the device has finished `submission` (every submission when `None`),
    /// counting the wait and its time. Native only: a browser cannot block.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn wait(&self, submission: Option<wgpu::SubmissionIndex>) -> Result<(), super::GpuError> {
        self.wait_idle(submission, true)
    }

    /// [`Self::wait`], saying whether the device has nothing queued behind `submission`
    /// (`idle`: the wait is a stall).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn wait_idle(&self, submission: Option<wgpu::SubmissionIndex>, idle: bool) -> Result<(), super::GpuError> {
        let t0 = std::time::Instant::now();
        let r = self.device.poll(wgpu::PollType::Wait { submission_index: submission, timeout: None });
        self.counters.waited(t0.elapsed(), idle);
        r.map(|_| ()).map_err(|e| super::GpuError::Readback(e.to_string()))
    }
}

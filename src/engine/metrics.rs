//! Serving metrics with the field's definitions: TTFT = arrival to first token; ITL = each
//! gap between consecutive tokens; TPOT = mean of the n-1 intervals after the first token;
//! E2E = arrival to completion.

use web_time::Instant;

/// Timestamps of one request.
#[derive(Debug, Clone)]
pub struct RequestTimings {
    pub arrival: Instant,
    /// When each output token became available.
    pub tokens: Vec<Instant>,
    pub finished: Option<Instant>,
}

/// Derived metrics, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct RequestMetrics {
    pub ttft_ms: Option<f64>,
    /// Mean of the n-1 intervals after the first token; `None` for fewer than 2 tokens.
    pub tpot_ms: Option<f64>,
    pub e2e_ms: Option<f64>,
    /// Decode throughput of this request: 1000 / TPOT.
    pub tokens_per_s: Option<f64>,
    pub output_tokens: usize,
}

impl RequestTimings {
    pub fn new(arrival: Instant) -> Self {
        RequestTimings { arrival, tokens: Vec::new(), finished: None }
    }

    /// Milliseconds between two instants.
    fn ms(a: Instant, b: Instant) -> f64 {
        b.saturating_duration_since(a).as_secs_f64() * 1e3
    }

    /// Inter-token latencies: each gap between consecutive tokens.
    pub fn itl_ms(&self) -> Vec<f64> {
        self.tokens.windows(2).map(|w| Self::ms(w[0], w[1])).collect()
    }

    pub fn metrics(&self) -> RequestMetrics {
        let ttft = self.tokens.first().map(|&t| Self::ms(self.arrival, t));
        let n = self.tokens.len();
        let tpot = if n >= 2 { Some(Self::ms(self.tokens[0], self.tokens[n - 1]) / (n - 1) as f64) } else { None };
        let end = self.finished.or(self.tokens.last().copied());
        RequestMetrics {
            ttft_ms: ttft,
            tpot_ms: tpot,
            e2e_ms: end.map(|e| Self::ms(self.arrival, e)),
            tokens_per_s: tpot.filter(|&t| t > 0.0).map(|t| 1000.0 / t),
            output_tokens: n,
        }
    }
}

/// Percentile `p` (0..=100) of `v` with linear interpolation between closest ranks (numpy's
/// default); None for an empty set.
pub fn percentile(v: &[f64], p: f64) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    let mut s: Vec<f64> = v.iter().copied().filter(|x| !x.is_nan()).collect();
    if s.is_empty() {
        return None;
    }
    s.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    let rank = (p.clamp(0.0, 100.0) / 100.0) * (s.len() - 1) as f64;
    let (lo, hi) = (rank.floor() as usize, rank.ceil() as usize);
    Some(s[lo] + (s[hi] - s[lo]) * (rank - lo as f64))
}

/// Mean and percentiles of one metric over a set of values.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct Distribution {
    pub n: usize,
    pub mean: f64,
    pub p50: f64,
    pub p95: f64,
    pub p99: f64,
    pub max: f64,
}

impl Distribution {
    pub fn of(v: &[f64]) -> Distribution {
        let n = v.len();
        if n == 0 {
            return Distribution::default();
        }
        let q = |p| percentile(v, p).unwrap_or(0.0);
        Distribution { n, mean: v.iter().sum::<f64>() / n as f64, p50: q(50.0), p95: q(95.0), p99: q(99.0), max: q(100.0) }
    }
}

/// One finished request of a workload, times in ms from the start of the run.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct RequestRecord {
    pub prompt_tokens: usize,
    /// Prompt tokens whose KV came from the prefix cache.
    pub cached_prompt_tokens: usize,
    /// When the request arrived (its scheduled arrival in an open-loop workload).
    pub arrival_ms: f64,
    /// When each output token became available.
    pub token_ms: Vec<f64>,
    pub finished_ms: f64,
    pub finish_reason: String,
}

impl RequestRecord {
    pub fn ttft_ms(&self) -> Option<f64> {
        self.token_ms.first().map(|t| t - self.arrival_ms)
    }

    /// Mean of the n-1 intervals after the first token (None for n < 2).
    pub fn tpot_ms(&self) -> Option<f64> {
        let n = self.token_ms.len();
        (n >= 2).then(|| (self.token_ms[n - 1] - self.token_ms[0]) / (n - 1) as f64)
    }

    pub fn itl_ms(&self) -> impl Iterator<Item = f64> + '_ {
        self.token_ms.windows(2).map(|w| w[1] - w[0])
    }

    pub fn e2e_ms(&self) -> f64 {
        self.finished_ms - self.arrival_ms
    }

    /// Whether the request met both SLOs (a missing TPOT, one output token, meets any TPOT
    /// SLO).
    pub fn meets(&self, slo_ttft_ms: Option<f64>, slo_tpot_ms: Option<f64>) -> bool {
        let ttft_ok = match (slo_ttft_ms, self.ttft_ms()) {
            (Some(s), Some(t)) => t <= s,
            (Some(_), None) => false,
            (None, _) => true,
        };
        let tpot_ok = match (slo_tpot_ms, self.tpot_ms()) {
            (Some(s), Some(t)) => t <= s,
            _ => true,
        };
        ttft_ok && tpot_ok
    }
}

/// The serving metrics of a workload: percentiles per request (TTFT, TPOT, E2E) and per gap
/// (ITL, pooled over every request's gaps), throughput over the run's wall time (first
/// arrival to last completion), and goodput (requests that met the SLO, per second).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct WorkloadSummary {
    pub requests: usize,
    pub duration_s: f64,
    pub prompt_tokens: usize,
    pub cached_prompt_tokens: usize,
    pub output_tokens: usize,
    pub ttft_ms: Distribution,
    pub itl_ms: Distribution,
    pub tpot_ms: Distribution,
    pub e2e_ms: Distribution,
    pub output_tokens_per_s: f64,
    pub total_tokens_per_s: f64,
    pub requests_per_s: f64,
    pub slo_ttft_ms: Option<f64>,
    pub slo_tpot_ms: Option<f64>,
    pub met_slo: usize,
    /// Requests per second that met the SLO.
    pub goodput_requests_per_s: f64,
}

impl WorkloadSummary {
    pub fn of(records: &[RequestRecord], slo_ttft_ms: Option<f64>, slo_tpot_ms: Option<f64>) -> WorkloadSummary {
        if records.is_empty() {
            return WorkloadSummary { slo_ttft_ms, slo_tpot_ms, ..Default::default() };
        }
        let start = records.iter().map(|r| r.arrival_ms).fold(f64::INFINITY, f64::min);
        let end = records.iter().map(|r| r.finished_ms).fold(f64::NEG_INFINITY, f64::max);
        let duration_s = ((end - start) / 1e3).max(1e-9);
        let ttft: Vec<f64> = records.iter().filter_map(|r| r.ttft_ms()).collect();
        let tpot: Vec<f64> = records.iter().filter_map(|r| r.tpot_ms()).collect();
        let itl: Vec<f64> = records.iter().flat_map(|r| r.itl_ms()).collect();
        let e2e: Vec<f64> = records.iter().map(|r| r.e2e_ms()).collect();
        let output_tokens: usize = records.iter().map(|r| r.token_ms.len()).sum();
        let prompt_tokens: usize = records.iter().map(|r| r.prompt_tokens).sum();
        let met = records.iter().filter(|r| r.meets(slo_ttft_ms, slo_tpot_ms)).count();
        WorkloadSummary {
            requests: records.len(),
            duration_s,
            prompt_tokens,
            cached_prompt_tokens: records.iter().map(|r| r.cached_prompt_tokens).sum(),
            output_tokens,
            ttft_ms: Distribution::of(&ttft),
            itl_ms: Distribution::of(&itl),
            tpot_ms: Distribution::of(&tpot),
            e2e_ms: Distribution::of(&e2e),
            output_tokens_per_s: output_tokens as f64 / duration_s,
            total_tokens_per_s: (output_tokens + prompt_tokens) as f64 / duration_s,
            requests_per_s: records.len() as f64 / duration_s,
            slo_ttft_ms,
            slo_tpot_ms,
            met_slo: met,
            goodput_requests_per_s: met as f64 / duration_s,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn worked_example_ttft_700_tpot_35_20_tokens_gives_e2e_1365() {
        let a = Instant::now();
        let mut t = RequestTimings::new(a);
        for i in 0..20u64 {
            t.tokens.push(a + Duration::from_millis(700 + 35 * i));
        }
        t.finished = t.tokens.last().copied();
        let m = t.metrics();
        assert!((m.ttft_ms.unwrap() - 700.0).abs() < 1e-6);
        assert!((m.tpot_ms.unwrap() - 35.0).abs() < 1e-6);
        assert!((m.e2e_ms.unwrap() - 1365.0).abs() < 1e-6);
        assert_eq!(t.itl_ms().len(), 19);
    }

    /// The worked example through a workload record: TTFT 700 ms, 20 tokens 35 ms apart.
    fn record(arrival: f64, ttft: f64, tpot: f64, n: usize) -> RequestRecord {
        let token_ms: Vec<f64> = (0..n).map(|i| arrival + ttft + tpot * i as f64).collect();
        RequestRecord {
            prompt_tokens: 10,
            cached_prompt_tokens: 0,
            arrival_ms: arrival,
            finished_ms: *token_ms.last().unwrap_or(&arrival),
            token_ms,
            finish_reason: "length".into(),
        }
    }

    #[test]
    fn workload_worked_example_and_tpot_for_one_token() {
        let r = record(0.0, 700.0, 35.0, 20);
        assert_eq!(r.ttft_ms(), Some(700.0));
        assert!((r.tpot_ms().unwrap() - 35.0).abs() < 1e-9);
        assert!((r.e2e_ms() - 1365.0).abs() < 1e-9);
        let one = record(0.0, 50.0, 0.0, 1);
        assert_eq!(one.tpot_ms(), None);
        assert!(one.meets(Some(100.0), Some(1.0)), "one token: no TPOT to miss");
    }

    #[test]
    fn percentiles_interpolate_between_ranks() {
        let v: Vec<f64> = (1..=100).map(|x| x as f64).collect();
        assert_eq!(percentile(&v, 50.0), Some(50.5));
        assert!((percentile(&v, 95.0).unwrap() - 95.05).abs() < 1e-9);
        assert!((percentile(&v, 99.0).unwrap() - 99.01).abs() < 1e-9);
        assert_eq!(percentile(&v, 100.0), Some(100.0));
        assert_eq!(percentile(&[3.0], 99.0), Some(3.0));
        assert_eq!(percentile(&[], 50.0), None);
    }

    #[test]
    fn workload_summary_pools_gaps_and_counts_goodput() {
        // Two requests over 2 s: one fast (TTFT 100, TPOT 10), one slow (TTFT 900, TPOT 50).
        let a = record(0.0, 100.0, 10.0, 11);
        let b = record(500.0, 900.0, 50.0, 3);
        let s = WorkloadSummary::of(&[a, b], Some(500.0), Some(20.0));
        assert_eq!(s.requests, 2);
        assert_eq!(s.output_tokens, 14);
        // First arrival 0 to last completion 500 + 900 + 100 = 1500 ms.
        assert!((s.duration_s - 1.5).abs() < 1e-9);
        assert!((s.output_tokens_per_s - 14.0 / 1.5).abs() < 1e-9);
        // TPOT is per request (10 and 50), not pooled over gaps.
        assert!((s.tpot_ms.p50 - 30.0).abs() < 1e-9);
        // ITL pools all 12 gaps: ten of 10 ms and two of 50 ms.
        assert_eq!(s.itl_ms.n, 12);
        assert!((s.itl_ms.mean - 200.0 / 12.0).abs() < 1e-9);
        assert_eq!(s.met_slo, 1);
        assert!((s.goodput_requests_per_s - 1.0 / 1.5).abs() < 1e-9);
    }

    #[test]
    fn tpot_is_undefined_for_one_token() {
        let a = Instant::now();
        let mut t = RequestTimings::new(a);
        t.tokens.push(a + Duration::from_millis(10));
        let m = t.metrics();
        assert_eq!(m.tpot_ms, None);
        assert!((m.ttft_ms.unwrap() - 10.0).abs() < 1e-6);
        assert!(t.itl_ms().is_empty());
    }
}

/// The host's work per decode token over a run's decode steps (everything after the first
/// token), from the device's [`HostCounts`](crate::gpu::HostCounts): what `lantern run
/// --json` reports as `host`. On wgpu's noop backend, which executes nothing, `ms_per_token`
/// is the host's cost alone: the ceiling of an infinitely fast GPU.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct HostCosts {
    /// Decode tokens the figures are per (output tokens after the first).
    pub tokens: usize,
    /// Wall milliseconds per token (the decode phase's TPOT, drained steps included).
    pub ms_per_token: f64,
    /// Of those, milliseconds the host was busy, not blocked waiting for the device.
    pub busy_ms_per_token: f64,
    pub dispatches_per_token: f64,
    pub submits_per_token: f64,
    /// `write_buffer` calls (each a staging copy inside wgpu).
    pub writes_per_token: f64,
    pub readbacks_per_token: f64,
    /// Waits for the device, and those of them that left it idle (nothing queued behind).
    pub waits_per_token: f64,
    pub stalls_per_token: f64,
    pub bind_groups_per_token: f64,
    /// Buffers and textures created.
    pub buffers_per_token: f64,
    /// Sampled tokens the GPU drew differently from the request's sampler (f32 rounding at a
    /// boundary; the sampler's token was kept and decoding restarted from it).
    pub redraws: usize,
}

impl HostCosts {
    /// Per-token figures from the counts of `tokens` decode steps that took `wall_ms`.
    pub fn new(c: &crate::gpu::HostCounts, tokens: usize, wall_ms: f64) -> HostCosts {
        let n = tokens.max(1) as f64;
        let per = |v: u64| v as f64 / n;
        HostCosts {
            tokens,
            ms_per_token: wall_ms / n,
            busy_ms_per_token: (wall_ms - c.wait_ns as f64 / 1e6).max(0.0) / n,
            dispatches_per_token: per(c.dispatches),
            submits_per_token: per(c.submits),
            writes_per_token: per(c.writes),
            readbacks_per_token: per(c.readbacks),
            waits_per_token: per(c.waits),
            stalls_per_token: per(c.stalls),
            bind_groups_per_token: per(c.bind_groups),
            buffers_per_token: per(c.buffers),
            redraws: 0,
        }
    }
}

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
        RequestTimings {
            arrival,
            tokens: Vec::new(),
            finished: None,
        }
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
        let tpot = if n >= 2 {
            Some(Self::ms(self.tokens[0], self.tokens[n - 1]) / (n - 1) as f64)
        } else {
            None
        };
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

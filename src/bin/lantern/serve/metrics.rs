//! `/metrics` of `lantern serve`: request outcomes, HTTP responses by route and status, token
//! counts and latency histograms, in the Prometheus text format, with the engine's snapshot.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use lantern::engine::{FinishReason, Generation};

use super::transport::Shared;

const OUTCOMES: [(&str, &str); 10] = [
    ("stop", "finished: end of sequence or a stop string"),
    ("length", "finished: max_tokens or the context reached"),
    ("cancelled", "the client went away; the engine freed the request's pages"),
    ("timeout", "--request-timeout passed"),
    ("error", "the engine failed the request"),
    ("rejected", "invalid request (4xx)"),
    ("overloaded", "the engine's queue was full (429)"),
    ("unavailable", "the engine has stopped (503)"),
    ("too_many_connections", "connection refused beyond --max-connections, every connection busy (503)"),
    ("shutdown", "cancelled by a shutdown past its deadline (503 or a final error event)"),
];

const TTFT_BUCKETS: &[f64] = &[0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];
const TPOT_BUCKETS: &[f64] = &[0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5];
const E2E_BUCKETS: &[f64] = &[0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0];

pub(crate) struct Histogram {
    buckets: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    pub(crate) fn new(buckets: &'static [f64]) -> Self {
        Histogram { buckets, counts: vec![0; buckets.len()], sum: 0.0, count: 0 }
    }

    pub(crate) fn observe(&mut self, v: f64) {
        if !v.is_finite() {
            return;
        }
        if let Some(i) = self.buckets.iter().position(|&b| v <= b) {
            self.counts[i] += 1;
        }
        self.sum += v;
        self.count += 1;
    }

    /// The Prometheus text of the histogram; `labels`: `key="value"` pairs every sample
    /// carries (empty: none).
    pub(crate) fn render(&self, o: &mut String, name: &str, help: &str, labels: &str) {
        let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} histogram");
        let (pre, set) = if labels.is_empty() { (String::new(), String::new()) } else { (format!("{labels},"), format!("{{{labels}}}")) };
        let mut cum = 0;
        for (b, c) in self.buckets.iter().zip(&self.counts) {
            cum += c;
            let _ = writeln!(o, "{name}_bucket{{{pre}le=\"{b}\"}} {cum}");
        }
        let _ = writeln!(o, "{name}_bucket{{{pre}le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(o, "{name}_sum{set} {}", self.sum);
        let _ = writeln!(o, "{name}_count{set} {}", self.count);
    }
}

pub struct Metrics {
    pub(crate) evicted: u64,
    http: BTreeMap<(&'static str, u16), u64>,
    outcomes: BTreeMap<&'static str, u64>,
    prompt_tokens: u64,
    completion_tokens: u64,
    draft_proposed: u64,
    draft_accepted: u64,
    ttft: Histogram,
    tpot: Histogram,
    e2e: Histogram,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            evicted: 0,
            http: BTreeMap::new(),
            outcomes: OUTCOMES.iter().map(|(k, _)| (*k, 0)).collect(),
            prompt_tokens: 0,
            completion_tokens: 0,
            draft_proposed: 0,
            draft_accepted: 0,
            ttft: Histogram::new(TTFT_BUCKETS),
            tpot: Histogram::new(TPOT_BUCKETS),
            e2e: Histogram::new(E2E_BUCKETS),
        }
    }
}

impl Metrics {
    pub fn http(&mut self, route: &'static str, status: u16) {
        *self.http.entry((route, status)).or_insert(0) += 1;
    }

    pub fn outcome(&mut self, o: &'static str) {
        *self.outcomes.entry(o).or_insert(0) += 1;
    }

    /// A request the engine finished: its outcome, tokens and latencies.
    pub fn finished(&mut self, g: &Generation, prompt_tokens: usize) {
        self.outcome(match g.finish_reason {
            FinishReason::Stop => "stop",
            FinishReason::Length | FinishReason::ContextFull => "length",
            FinishReason::Cancelled => "cancelled",
        });
        self.prompt_tokens += prompt_tokens as u64;
        self.completion_tokens += g.output_ids.len() as u64;
        if let Some(sp) = &g.speculative {
            self.draft_proposed += sp.proposed as u64;
            self.draft_accepted += sp.accepted as u64;
        }
        let m = g.timings.metrics();
        if let Some(t) = m.ttft_ms {
            self.ttft.observe(t / 1e3);
        }
        if let Some(t) = m.tpot_ms {
            self.tpot.observe(t / 1e3);
        }
        if let Some(t) = m.e2e_ms {
            self.e2e.observe(t / 1e3);
        }
    }
}

fn label(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

pub fn render(shared: &Shared) -> String {
    let s = shared.client.snapshot();
    let m_evicted = shared.metrics().evicted;
    let mut o = String::with_capacity(8192);
    let mut one = |name: &str, kind: &str, help: &str, value: f64| {
        let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}");
    };
    one("lantern_requests_running", "gauge", "Requests admitted to the engine (holding KV pages).", s.running as f64);
    one("lantern_requests_waiting", "gauge", "Requests queued for admission.", s.waiting as f64);
    one("lantern_requests_max_waiting", "gauge", "Queue length beyond which requests get 429.", s.max_waiting as f64);
    one("lantern_kv_pages_total", "gauge", "KV cache pages in the pool.", s.kv_pages_total as f64);
    one(
        "lantern_kv_pages_free",
        "gauge",
        "KV cache pages not held by a request (evictable prefix-cache pages count as free).",
        s.kv_pages_free as f64,
    );
    one("lantern_kv_page_size_tokens", "gauge", "Tokens per KV page.", s.kv_page_size as f64);
    one("lantern_context_tokens", "gauge", "Context window (prompt + completion) in tokens.", s.context as f64);
    one("lantern_http_connections_open", "gauge", "Open HTTP connections (this scrape's included).", shared.open_connections() as f64);
    one(
        "lantern_engine_up",
        "gauge",
        "1 while the engine thread takes requests.",
        if shared.engine_down.load(Ordering::SeqCst) { 0.0 } else { 1.0 },
    );
    one(
        "lantern_engine_busy",
        "gauge",
        "1 while the engine has requests running or waiting, or a step in flight.",
        if s.busy { 1.0 } else { 0.0 },
    );
    one("lantern_engine_steps_total", "counter", "Engine steps (one GPU batch each).", s.stats.steps as f64);
    one(
        "lantern_engine_preemptions_total",
        "counter",
        "Running requests preempted (pages freed, recomputed later) for lack of KV pages.",
        s.stats.preemptions as f64,
    );
    one(
        "lantern_engine_prompt_tokens_computed_total",
        "counter",
        "Prompt tokens prefilled on the GPU.",
        s.stats.prompt_tokens_computed as f64,
    );
    one("lantern_engine_output_tokens_total", "counter", "Tokens sampled by the engine.", s.stats.output_tokens as f64);
    one(
        "lantern_prefix_cache_hit_tokens_total",
        "counter",
        "Prompt tokens whose KV came from the prefix cache instead of being computed.",
        s.stats.prompt_tokens_cached as f64,
    );
    one("lantern_prefix_cache_lookups_total", "counter", "Prefix cache lookups.", s.prefix.lookups as f64);
    one("lantern_prefix_cache_evictions_total", "counter", "Cached prefix pages reused for new data.", s.prefix.evictions as f64);
    one(
        "lantern_http_connections_evicted_total",
        "counter",
        "Connections without a request in flight closed to make room (--max-connections, --max-idle-connections).",
        m_evicted as f64,
    );
    if let Some((rss, threads)) = process_stats() {
        one("process_resident_memory_bytes", "gauge", "Resident memory of the server process.", rss as f64);
        one("process_threads", "gauge", "Threads of the server process.", threads as f64);
    }
    let m = shared.metrics();
    one("lantern_prompt_tokens_total", "counter", "Prompt tokens of finished requests.", m.prompt_tokens as f64);
    one("lantern_completion_tokens_total", "counter", "Completion tokens of finished requests.", m.completion_tokens as f64);
    one(
        "lantern_speculative_draft_tokens_total",
        "counter",
        "Tokens drafted for speculative decoding (finished requests).",
        m.draft_proposed as f64,
    );
    one(
        "lantern_speculative_accepted_tokens_total",
        "counter",
        "Drafted tokens the target accepted (finished requests).",
        m.draft_accepted as f64,
    );
    let _ = writeln!(o, "# HELP lantern_requests_total Generation requests by outcome.\n# TYPE lantern_requests_total counter");
    for (k, v) in &m.outcomes {
        let _ = writeln!(o, "lantern_requests_total{{outcome=\"{k}\"}} {v}");
    }
    let _ = writeln!(
        o,
        "# HELP lantern_http_responses_total HTTP responses by route and status (499: the client went away).\n# TYPE lantern_http_responses_total counter"
    );
    for ((route, code), v) in &m.http {
        let _ = writeln!(o, "lantern_http_responses_total{{route=\"{route}\",code=\"{code}\"}} {v}");
    }
    const TTFT_HELP: &str = "Arrival to first token, per finished request.";
    const TPOT_HELP: &str = "Mean of the gaps between output tokens after the first, per finished request with 2+ tokens.";
    const E2E_HELP: &str = "Arrival to completion, per finished request.";
    m.ttft.render(&mut o, "lantern_time_to_first_token_seconds", TTFT_HELP, "");
    m.tpot.render(&mut o, "lantern_time_per_output_token_seconds", TPOT_HELP, "");
    m.e2e.render(&mut o, "lantern_e2e_request_latency_seconds", E2E_HELP, "");

    // The same values under vLLM's names, which the field's routers and gateways read (SGLang's
    // model gateway, vllm-router, the Gateway API Inference Extension): every sample carries
    // `model_name`, as vLLM's do.
    let model = format!("model_name=\"{}\"", label(&shared.model.model_id));
    let mut vllm = |name: &str, kind: &str, help: &str, value: f64| {
        let _ = writeln!(o, "# HELP vllm:{name} {help}\n# TYPE vllm:{name} {kind}\nvllm:{name}{{{model}}} {value}");
    };
    let usage = if s.kv_pages_total == 0 { 0.0 } else { 1.0 - s.kv_pages_free as f64 / s.kv_pages_total as f64 };
    vllm("num_requests_running", "gauge", "Requests admitted to the engine (lantern_requests_running).", s.running as f64);
    vllm("num_requests_waiting", "gauge", "Requests queued for admission (lantern_requests_waiting).", s.waiting as f64);
    vllm(
        "kv_cache_usage_perc",
        "gauge",
        "KV-cache usage, 1 = every page held (1 - lantern_kv_pages_free / lantern_kv_pages_total).",
        usage,
    );
    vllm("gpu_cache_usage_perc", "gauge", "vLLM's older name of kv_cache_usage_perc.", usage);
    vllm("num_preemptions_total", "counter", "Requests preempted for lack of KV pages.", s.stats.preemptions as f64);
    vllm("prompt_tokens_total", "counter", "Prompt tokens of finished requests.", m.prompt_tokens as f64);
    vllm("generation_tokens_total", "counter", "Output tokens of finished requests.", m.completion_tokens as f64);
    vllm(
        "prefix_cache_queries_total",
        "counter",
        "Prompt tokens looked up in the prefix cache (computed + cached).",
        (s.stats.prompt_tokens_computed + s.stats.prompt_tokens_cached) as f64,
    );
    vllm("prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache.", s.stats.prompt_tokens_cached as f64);
    let queried = s.stats.prompt_tokens_computed + s.stats.prompt_tokens_cached;
    vllm(
        "gpu_prefix_cache_hit_rate",
        "gauge",
        "vLLM's older gauge: prefix_cache_hits_total / prefix_cache_queries_total (0 before any prompt).",
        if queried == 0 { 0.0 } else { s.stats.prompt_tokens_cached as f64 / queried as f64 },
    );
    let _ = writeln!(o, "# HELP vllm:request_success_total Finished requests by reason.\n# TYPE vllm:request_success_total counter");
    for (reason, outcome) in [("stop", "stop"), ("length", "length"), ("abort", "cancelled")] {
        let v = m.outcomes.get(outcome).copied().unwrap_or(0);
        let _ = writeln!(o, "vllm:request_success_total{{{model},finished_reason=\"{reason}\"}} {v}");
    }
    m.ttft.render(&mut o, "vllm:time_to_first_token_seconds", TTFT_HELP, &model);
    m.tpot.render(&mut o, "vllm:time_per_output_token_seconds", TPOT_HELP, &model);
    m.tpot.render(&mut o, "vllm:inter_token_latency_seconds", TPOT_HELP, &model);
    m.e2e.render(&mut o, "vllm:e2e_request_latency_seconds", E2E_HELP, &model);
    drop(m);
    let _ = writeln!(
        o,
        "# HELP vllm:cache_config_info The KV cache's configuration.\n# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{{{model},block_size=\"{}\",num_gpu_blocks=\"{}\",cache_dtype=\"{}\",enable_prefix_caching=\"{}\"}} 1",
        s.kv_page_size,
        s.kv_pages_total,
        label(&shared.kv_dtype),
        shared.prefix_cache,
    );
    let _ = writeln!(
        o,
        "# HELP lantern_model_info The served model.\n# TYPE lantern_model_info gauge\nlantern_model_info{{model=\"{}\",adapter=\"{}\",kv_dtype=\"{}\"}} 1",
        label(&shared.model.model_id),
        label(&shared.adapter),
        label(&shared.kv_dtype)
    );
    o
}

/// Resident bytes and thread count from /proc (Linux only).
fn process_stats() -> Option<(u64, u64)> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let field = |name: &str| {
        status.lines().find_map(|l| l.strip_prefix(name)).and_then(|v| v.split_whitespace().next()).and_then(|v| v.parse::<u64>().ok())
    };
    Some((field("VmRSS:")? * 1024, field("Threads:")?))
}

pub fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// A seed from the clock and a counter (not for secrets).
pub fn random_u64() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let t = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    let mut z = t ^ COUNTER.fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_text() {
        let mut h = Histogram::new(&[0.1, 1.0]);
        h.observe(0.05);
        h.observe(0.5);
        h.observe(5.0);
        h.observe(f64::NAN);
        let mut o = String::new();
        h.render(&mut o, "x_seconds", "help", "");
        let mut l = String::new();
        h.render(&mut l, "y", "help", "m=\"a\"");
        assert!(l.contains("y_bucket{m=\"a\",le=\"0.1\"} 1\n") && l.contains("y_count{m=\"a\"} 3\n"), "{l}");
        assert!(o.contains("x_seconds_bucket{le=\"0.1\"} 1\n"), "{o}");
        assert!(o.contains("x_seconds_bucket{le=\"1\"} 2\n"), "{o}");
        assert!(o.contains("x_seconds_bucket{le=\"+Inf\"} 3\n"), "{o}");
        assert!(o.contains("x_seconds_count 3\n"), "{o}");
    }
}

//! `lantern bench`: a described serving workload through the batching engine, with the
//! field's metrics. Prompts are random token ids (plus an optional shared prefix), outputs
//! run to exactly their drawn length (EOS ignored), arrivals are closed-loop at a fixed
//! concurrency or open-loop Poisson at a rate. One thread drives the engine and submits each
//! request when it arrives, so a request that arrives during a GPU step waits for it, and that
//! wait counts in its TTFT (measured from its scheduled arrival).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};

use lantern::engine::metrics::{RequestRecord, WorkloadSummary};
use lantern::engine::sampler::Rng;
use lantern::engine::{Engine, EngineOptions, Event, GenerateRequest, RequestHandle, SamplingParams};
use lantern::model::forward::ModelOptions;

use super::{spinner, DeviceArgs, KvArg};

#[derive(Args)]
pub struct BenchArgs {
    /// A GGUF file, a Hugging Face folder or a catalogue name (qwen2.5-coder-0.5b, ...; fetched
    /// once). Default: SmolLM2-135M-Instruct, fetched once.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Requests in the workload (per concurrency level with --sweep).
    #[arg(long, default_value_t = 32)]
    pub requests: usize,
    /// Prompt tokens per request: N, or A..B drawn uniformly (inclusive). Random ids, after
    /// the shared prefix.
    #[arg(long, default_value = "128")]
    pub prompt_len: String,
    /// Output tokens per request: N or A..B (generation runs to exactly this, ignoring EOS).
    #[arg(long, default_value = "32")]
    pub output_len: String,
    /// Tokens every prompt starts with (the same random ids for all: prefix-cache hits).
    #[arg(long, default_value_t = 0)]
    pub shared_prefix: usize,
    /// Closed loop: keep this many requests in flight.
    #[arg(long, default_value_t = 4, conflicts_with = "rate")]
    pub concurrency: usize,
    /// Open loop: Poisson arrivals at this many requests per second (exponential gaps).
    #[arg(long)]
    pub rate: Option<f64>,
    /// Run the workload at each of these concurrency levels and print throughput against
    /// latency (e.g. 1,4,16).
    #[arg(long, value_delimiter = ',')]
    pub sweep: Vec<usize>,
    /// SLO on time to first token for goodput.
    #[arg(long)]
    pub slo_ttft_ms: Option<f64>,
    /// SLO on time per output token for goodput.
    #[arg(long)]
    pub slo_tpot_ms: Option<f64>,
    /// Seed of prompts, lengths and arrivals.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Sequences the KV cache and the engine hold at once (default: the highest concurrency,
    /// at least 4).
    #[arg(long)]
    pub max_seqs: Option<usize>,
    /// Context per sequence (default: longest prompt + output, rounded up to a page).
    #[arg(long)]
    pub context: Option<usize>,
    /// Tokens per engine step (decode tokens + prefill chunks).
    #[arg(long, default_value_t = 128)]
    pub step_tokens: usize,
    /// Most prompt tokens one sequence prefills per step.
    #[arg(long, default_value_t = 64)]
    pub prefill_chunk: usize,
    /// KV cache storage.
    #[arg(long, value_enum, default_value_t = KvArg::F32)]
    pub kv_dtype: KvArg,
    /// Steps of at most this many tokens use the matvec kernels (default: the adapter's).
    #[arg(long)]
    pub matvec_max_tokens: Option<usize>,
    /// Steps of 5-8 tokens take two passes of the four-token matvec instead of one of the
    /// eight-token matvec (comparisons).
    #[arg(long)]
    pub no_eight_token_matvec: bool,
    /// Steps of at most this many tokens use the batched (four- and eight-token) matvec where
    /// the adapter's layout has one; larger steps the matmul (default: the adapter's; 0
    /// turns the batched matvec off, for comparisons).
    #[arg(long)]
    pub batch_max_tokens: Option<usize>,
    /// Sample the workload's requests at this temperature (each request seeded from --seed
    /// and its index; 0: greedy).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Sample among the best K tokens (0: the whole vocabulary); with --temperature.
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Nucleus sampling: the fewest best tokens whose probability reaches P; with --temperature.
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Engine steps kept in flight ahead of the host: a greedy decode step of every running
    /// sequence is submitted, its ids copied on the GPU from the step before, before that
    /// step's tokens are read. 0 or 1: one step at a time (for comparisons).
    #[arg(long, default_value_t = 3)]
    pub decode_ahead: usize,
    /// Write every request's timestamps and the summary as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Draw latency distributions (CDFs) and throughput over time as SVG.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// With --draft or --lookup: prompts for the speculative benchmark (repeatable; default:
    /// built-in code-completion prompts for a draft model, a code rewrite for lookup).
    #[arg(long)]
    pub prompt: Vec<String>,
    /// With --draft or --lookup: also time every dispatch of steps of 1 to 8 tokens.
    #[arg(long)]
    pub profile: bool,
    /// With --draft or --lookup: also run each of these fixed draft lengths.
    #[arg(long, value_delimiter = ',')]
    pub k_sweep: Vec<usize>,
    /// With --draft or --lookup: rounds per prompt, each running plain and then every
    /// speculative setting once; tok/s and speedups are the medians over the rounds (a
    /// shared machine's speed drifts between runs seconds apart).
    #[arg(long, default_value_t = 1)]
    pub rounds: usize,
    /// Constrained decoding's cost per token: the same prompt greedily, plain and constrained
    /// to the JSON schema in this file (`--output-len` tokens at most, `--requests` runs of
    /// each, at most 8; `--prompt` replaces the prompt).
    #[arg(long, value_name = "FILE")]
    pub json_schema: Option<PathBuf>,
    /// `--json-schema` with a built-in schema (objects, an enum, an array, bounded integers).
    #[arg(long)]
    pub constrained: bool,
    #[command(flatten)]
    pub spec: super::spec_args::SpecArgs,
    #[command(flatten)]
    pub device: DeviceArgs,
}

/// "N" or "A..B".
pub(crate) fn parse_len(s: &str, what: &str) -> Result<(usize, usize)> {
    let p = |x: &str| x.trim().parse::<usize>().with_context(|| format!("{what} {s:?}: expected N or A..B"));
    let (a, b) = match s.split_once("..") {
        Some((a, b)) => (p(a)?, p(b.trim_start_matches('='))?),
        None => (p(s)?, p(s)?),
    };
    if a == 0 || b < a {
        bail!("{what} {s:?}: lengths must be positive and A <= B");
    }
    Ok((a, b))
}

/// One request of the workload before it runs.
struct Planned {
    req: GenerateRequest,
    /// Scheduled arrival, seconds after the start (open loop).
    at: f64,
}

fn workload(a: &BenchArgs, vocab: usize, seed: u64) -> Result<Vec<Planned>> {
    let (p0, p1) = parse_len(&a.prompt_len, "--prompt-len")?;
    let (o0, o1) = parse_len(&a.output_len, "--output-len")?;
    let mut rng = Rng::new(seed);
    let mut draw = |lo: usize, hi: usize| lo + (rng.next_u64() % (hi - lo + 1) as u64) as usize;
    // Ids from the middle of the vocabulary: ordinary tokens, no specials.
    let lo_id = (vocab / 8) as u64;
    let span = (vocab / 2).max(1) as u64;
    let mut ids = Rng::new(seed ^ 0x9e37_79b9_7f4a_7c15);
    let prefix: Vec<u32> = (0..a.shared_prefix).map(|_| (lo_id + ids.next_u64() % span) as u32).collect();
    let mut arrivals = Rng::new(seed ^ 0x5151);
    let mut t = 0.0;
    let mut out = Vec::with_capacity(a.requests);
    let valid = a.temperature >= 0.0 && a.temperature.is_finite() && a.top_p > 0.0 && a.top_p <= 1.0;
    if !valid {
        bail!("--temperature must be 0 or more and --top-p in (0, 1]");
    }
    for i in 0..a.requests {
        let n = draw(p0, p1);
        let m = draw(o0, o1);
        let mut prompt = prefix.clone();
        prompt.extend((0..n).map(|_| (lo_id + ids.next_u64() % span) as u32));
        if let Some(rate) = a.rate {
            // Exponential gap with mean 1/rate.
            let u = (arrivals.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
            t += -(1.0 - u).ln() / rate;
        }
        out.push(Planned {
            req: GenerateRequest {
                prompt_ids: prompt,
                max_tokens: m,
                sampling: SamplingParams { temperature: a.temperature, top_k: a.top_k, top_p: a.top_p, seed: seed.wrapping_add(i as u64) },
                stop_ids: vec![],
                stop_strings: vec![],
                speculation: Default::default(),
                constraint: None,
                logprobs: None,
                bias: Default::default(),
            },
            at: t,
        });
    }
    Ok(out)
}

/// What a run produced: every request's record, and (ms since start, tokens) samples.
type Driven = (Vec<RequestRecord>, Vec<(f64, usize)>);

/// Run `plan` on `engine` at `concurrency` (closed loop) or at the planned arrival times
/// (open loop); every request's record, times from the run's start.
fn drive(engine: &mut Engine, plan: Vec<Planned>, concurrency: Option<usize>, pb: &ProgressBar) -> Result<Driven> {
    let start = Instant::now();
    let ms = |t: Instant| t.saturating_duration_since(start).as_secs_f64() * 1e3;
    let total = plan.len();
    let mut pending = plan.into_iter().peekable();
    let mut live: Vec<(RequestHandle, f64, usize)> = Vec::new(); // handle, arrival ms, prompt tokens
    let mut records = Vec::with_capacity(total);
    // (time ms, running sequences) after each step, for the plot.
    let mut timeline = Vec::new();
    while records.len() < total {
        // Arrivals.
        loop {
            let due = match (concurrency, pending.peek()) {
                (Some(c), Some(_)) => live.len() < c,
                (None, Some(p)) => start.elapsed().as_secs_f64() >= p.at,
                (_, None) => false,
            };
            if !due {
                break;
            }
            let p = pending.next().expect("peeked");
            let arrival = if concurrency.is_some() { ms(Instant::now()) } else { p.at * 1e3 };
            let n = p.req.prompt_ids.len();
            let h = engine.submit(p.req).context("submitting a workload request")?;
            live.push((h, arrival, n));
        }
        if engine.is_idle() {
            if let Some(p) = pending.peek() {
                let wait = p.at - start.elapsed().as_secs_f64();
                if wait > 0.0 {
                    std::thread::sleep(Duration::from_secs_f64(wait.min(0.05)));
                }
                continue;
            }
        } else {
            pollster::block_on(engine.step()).context("engine step")?;
            timeline.push((ms(Instant::now()), engine.running()));
        }
        // Completions.
        let mut i = 0;
        while i < live.len() {
            let mut done = None;
            loop {
                match live[i].0.try_next() {
                    Ok(Some(Event::Done(g))) => {
                        done = Some(g);
                        break;
                    }
                    Ok(Some(Event::Error(e))) => bail!("request failed: {e}"),
                    Ok(Some(_)) => {}
                    Ok(None) => break,
                    Err(()) => bail!("a request's stream ended without a result"),
                }
            }
            if let Some(g) = done {
                let (_, arrival, n) = live.swap_remove(i);
                let t = &g.timings;
                records.push(RequestRecord {
                    prompt_tokens: n,
                    cached_prompt_tokens: g.cached_prompt_tokens,
                    arrival_ms: arrival,
                    token_ms: t.tokens.iter().map(|&x| ms(x)).collect(),
                    finished_ms: t.finished.map(ms).unwrap_or_else(|| ms(Instant::now())),
                    finish_reason: g.finish_reason.as_str().to_string(),
                });
                pb.inc(1);
            } else {
                i += 1;
            }
        }
    }
    Ok((records, timeline))
}

/// The host's work per engine step over a run (see `gpu::HostCounts`).
#[derive(Debug, Clone, serde::Serialize)]
struct StepHost {
    dispatches: f64,
    submits: f64,
    writes: f64,
    readbacks: f64,
    /// Waits with nothing queued behind them: the device idles until the host submits again.
    stalls: f64,
    bind_groups: f64,
    buffers: f64,
    /// Steps submitted before the step before them was read.
    steps_ahead: u64,
    steps: u64,
}

impl StepHost {
    fn of(c: &lantern::gpu::HostCounts, stats: &lantern::engine::EngineStats) -> StepHost {
        let per = |v: u64| v as f64 / stats.steps.max(1) as f64;
        StepHost {
            dispatches: per(c.dispatches),
            submits: per(c.submits),
            writes: per(c.writes),
            readbacks: per(c.readbacks),
            stalls: per(c.stalls),
            bind_groups: per(c.bind_groups),
            buffers: per(c.buffers),
            steps_ahead: stats.steps_ahead,
            steps: stats.steps,
        }
    }
}

fn print_summary(s: &WorkloadSummary, label: &str) {
    println!("{label}");
    println!(
        "  {} requests in {:.2} s: {:.2} req/s, {:.1} output tok/s, {:.1} total tok/s ({} prompt tokens, {} from the prefix cache, {} output)",
        s.requests, s.duration_s, s.requests_per_s, s.output_tokens_per_s, s.total_tokens_per_s, s.prompt_tokens, s.cached_prompt_tokens, s.output_tokens
    );
    println!("  {:<6} {:>10} {:>10} {:>10} {:>10} {:>10}", "ms", "mean", "p50", "p95", "p99", "max");
    for (name, d) in [("TTFT", &s.ttft_ms), ("ITL", &s.itl_ms), ("TPOT", &s.tpot_ms), ("E2E", &s.e2e_ms)] {
        println!("  {:<6} {:>10.1} {:>10.1} {:>10.1} {:>10.1} {:>10.1}", name, d.mean, d.p50, d.p95, d.p99, d.max);
    }
    if s.slo_ttft_ms.is_some() || s.slo_tpot_ms.is_some() {
        let f = |v: Option<f64>| v.map_or("-".to_string(), |x| format!("{x} ms"));
        println!(
            "  goodput: {}/{} requests met TTFT <= {} and TPOT <= {}: {:.2} req/s",
            s.met_slo,
            s.requests,
            f(s.slo_ttft_ms),
            f(s.slo_tpot_ms),
            s.goodput_requests_per_s
        );
    }
}

pub fn run(a: BenchArgs) -> Result<()> {
    if a.spec.draft.is_some() || a.spec.lookup {
        return super::spec_bench::run(&a);
    }
    if a.json_schema.is_some() || a.constrained {
        return super::constrained_bench::run(&a);
    }
    if a.requests == 0 {
        bail!("--requests must be at least 1");
    }
    if let Some(r) = a.rate {
        if !(r > 0.0 && r.is_finite()) {
            bail!("--rate must be a positive number of requests per second");
        }
    }
    let levels: Vec<usize> = if a.sweep.is_empty() { vec![a.concurrency.max(1)] } else { a.sweep.iter().map(|&c| c.max(1)).collect() };
    let model_path = lantern::fetch::resolve_model(a.model.as_deref(), true)?;
    let pb = spinner(&format!("loading {}", model_path.display()), false);
    let ctx = a.device.open()?;
    let (_, p1) = parse_len(&a.prompt_len, "--prompt-len")?;
    let (_, o1) = parse_len(&a.output_len, "--output-len")?;
    let longest = a.shared_prefix + p1 + o1;
    let context = a.context.unwrap_or(longest.div_ceil(16) * 16);
    let max_seqs = a.max_seqs.unwrap_or_else(|| levels.iter().copied().max().unwrap_or(4).max(if a.rate.is_some() { 16 } else { 4 }));
    pb.set_message(format!("uploading weights to {}", ctx.info.name));
    let (mut model, tokenizer) = pollster::block_on(lantern::model::load::load_to_gpu(
        ctx.clone(),
        &model_path,
        ModelOptions {
            context: Some(context),
            max_seqs,
            max_batch_tokens: a.step_tokens.max(1),
            kv_dtype: a.kv_dtype.dtype(),
            matvec_max_tokens: a.matvec_max_tokens,
            eight_token_matvec: a.no_eight_token_matvec.then_some(false),
            batch_max_tokens: a.batch_max_tokens,
            decode_ahead: a.decode_ahead,
            ..Default::default()
        },
        &mut |_, _| {},
    ))
    .with_context(|| format!("loading {}", model_path.display()))?;
    let tokenizer = Arc::new(tokenizer.with_context(|| format!("{} has no tokenizer", model_path.display()))?);
    pb.finish_and_clear();
    let vocab = model.config.vocab_size;
    let mode = match a.rate {
        Some(r) => format!("Poisson arrivals at {r} req/s"),
        None => "closed loop".to_string(),
    };
    println!(
        "{} on {} | {} requests, prompt {} (+{} shared) tokens, output {} tokens, {mode} | KV {:?}, {} sequences x {} tokens, steps of {} tokens",
        model_path.display(),
        ctx.info.name,
        a.requests,
        a.prompt_len,
        a.shared_prefix,
        a.output_len,
        model.options.kv_dtype,
        max_seqs,
        context,
        a.step_tokens
    );
    let mut all = Vec::new();
    for &c in &levels {
        let plan = workload(&a, vocab, a.seed)?;
        model.kv.alloc.clear_prefix_cache();
        let mut engine = Engine::new(
            model,
            tokenizer.clone(),
            EngineOptions { step_tokens: a.step_tokens, prefill_chunk: a.prefill_chunk, max_waiting: a.requests.max(1) },
        );
        let bar = ProgressBar::new(a.requests as u64);
        bar.set_style(
            ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} requests, {elapsed}, ETA {eta}")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
        );
        let label = if a.rate.is_some() { format!("rate {}", a.rate.unwrap_or_default()) } else { format!("concurrency {c}") };
        bar.set_message(label.clone());
        let before = ctx.host_counts();
        let (records, timeline) = drive(&mut engine, plan, if a.rate.is_some() { None } else { Some(c) }, &bar)?;
        bar.finish_and_clear();
        let stats = engine.stats().clone();
        let host = StepHost::of(&ctx.host_counts().since(&before), &stats);
        model = engine.into_model();
        let summary = WorkloadSummary::of(&records, a.slo_ttft_ms, a.slo_tpot_ms);
        print_summary(&summary, &format!("{label}: {} preemptions, {} engine steps", stats.preemptions, stats.steps));
        println!(
            "  host per engine step: {:.1} dispatches, {:.2} submits, {:.2} writes, {:.2} waits leaving the device idle, {:.2} bind groups, {:.2} buffers; {} of {} steps submitted ahead of the host",
            host.dispatches, host.submits, host.writes, host.stalls, host.bind_groups, host.buffers, stats.steps_ahead, stats.steps
        );
        all.push((label, c, summary, records, timeline, host));
        if a.rate.is_some() {
            break;
        }
    }
    if all.len() > 1 {
        let base = all[0].2.output_tokens_per_s;
        println!("\nthroughput against latency:");
        println!(
            "  {:>11} {:>12} {:>8} {:>10} {:>10} {:>10} {:>10}",
            "concurrency", "output tok/s", "x c=1st", "TTFT p50", "TTFT p95", "TPOT p50", "E2E p50"
        );
        for (_, c, s, _, _, _) in &all {
            println!(
                "  {:>11} {:>12.1} {:>8.2} {:>10.1} {:>10.1} {:>10.1} {:>10.1}",
                c,
                s.output_tokens_per_s,
                s.output_tokens_per_s / base.max(1e-9),
                s.ttft_ms.p50,
                s.ttft_ms.p95,
                s.tpot_ms.p50,
                s.e2e_ms.p50
            );
        }
    }
    if let Some(path) = &a.json {
        let runs: Vec<serde_json::Value> = all
            .iter()
            .map(|(label, c, s, r, _, h)| serde_json::json!({ "label": label, "concurrency": if a.rate.is_some() { None } else { Some(c) }, "rate": a.rate, "summary": s, "host_per_step": h, "requests": r }))
            .collect();
        let v = serde_json::json!({
            "model": model_path.display().to_string(),
            "adapter": ctx.adapter_json(),
            "workload": {
                "requests": a.requests, "prompt_len": a.prompt_len, "output_len": a.output_len, "shared_prefix": a.shared_prefix,
                "rate": a.rate, "seed": a.seed, "kv_dtype": model.options.kv_dtype, "max_seqs": max_seqs, "context": context,
                "step_tokens": a.step_tokens, "prefill_chunk": a.prefill_chunk, "decode_ahead": a.decode_ahead,
                "temperature": a.temperature, "top_k": a.top_k, "top_p": a.top_p,
            },
            "runs": runs,
        });
        std::fs::write(path, serde_json::to_string_pretty(&v)?).with_context(|| format!("writing {}", path.display()))?;
        println!("wrote {}", path.display());
    }
    if let Some(path) = &a.plot {
        let runs: Vec<plot::Run> =
            all.iter().map(|(label, _, s, r, t, _)| plot::Run { label, summary: s, records: r, timeline: t }).collect();
        std::fs::write(path, plot::svg(&runs)).with_context(|| format!("writing {}", path.display()))?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

/// A hand-written SVG: CDFs of TTFT, TPOT and E2E per run (left), and output tokens/s over
/// time per run with the running sequences (right).
mod plot {
    use lantern::engine::metrics::{RequestRecord, WorkloadSummary};
    use std::fmt::Write;

    pub struct Run<'a> {
        pub label: &'a str,
        pub summary: &'a WorkloadSummary,
        pub records: &'a [RequestRecord],
        pub timeline: &'a [(f64, usize)],
    }

    const COLORS: [&str; 6] = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf"];
    const W: f64 = 420.0;
    const H: f64 = 220.0;

    struct Panel {
        x0: f64,
        y0: f64,
        xmax: f64,
        ymax: f64,
    }

    impl Panel {
        fn px(&self, x: f64) -> f64 {
            self.x0 + 50.0 + (x / self.xmax.max(1e-9)).min(1.0) * (W - 70.0)
        }
        fn py(&self, y: f64) -> f64 {
            self.y0 + H - 30.0 - (y / self.ymax.max(1e-9)).min(1.0) * (H - 50.0)
        }
        fn frame(&self, out: &mut String, title: &str, xlabel: &str, ylabel: &str) {
            let (l, r, t, b) = (self.x0 + 50.0, self.x0 + W - 20.0, self.y0 + 20.0, self.y0 + H - 30.0);
            let _ = write!(
                out,
                r##"<rect x="{l}" y="{t}" width="{}" height="{}" fill="none" stroke="#888"/><text x="{}" y="{}" font-size="12" text-anchor="middle">{title}</text><text x="{}" y="{}" font-size="10" text-anchor="middle">{xlabel}</text><text x="{}" y="{}" font-size="10" text-anchor="middle" transform="rotate(-90 {} {})">{ylabel}</text>"##,
                r - l,
                b - t,
                (l + r) / 2.0,
                t - 6.0,
                (l + r) / 2.0,
                b + 24.0,
                self.x0 + 14.0,
                (t + b) / 2.0,
                self.x0 + 14.0,
                (t + b) / 2.0
            );
            for i in 0..=4 {
                let fx = self.xmax * i as f64 / 4.0;
                let fy = self.ymax * i as f64 / 4.0;
                let _ = write!(
                    out,
                    r##"<text x="{:.1}" y="{:.1}" font-size="9" text-anchor="middle">{}</text>"##,
                    self.px(fx),
                    b + 11.0,
                    short(fx)
                );
                let _ = write!(
                    out,
                    r##"<text x="{:.1}" y="{:.1}" font-size="9" text-anchor="end">{}</text>"##,
                    l - 3.0,
                    self.py(fy) + 3.0,
                    short(fy)
                );
            }
        }
        fn line(&self, out: &mut String, pts: &[(f64, f64)], color: &str, dash: bool) {
            if pts.is_empty() {
                return;
            }
            let d: Vec<String> = pts.iter().map(|&(x, y)| format!("{:.1},{:.1}", self.px(x), self.py(y))).collect();
            let _ = write!(
                out,
                r##"<polyline fill="none" stroke="{color}" stroke-width="1.5"{} points="{}"/>"##,
                if dash { r#" stroke-dasharray="4 3""# } else { "" },
                d.join(" ")
            );
        }
    }

    fn short(v: f64) -> String {
        if v >= 1000.0 {
            format!("{:.1}k", v / 1000.0)
        } else if v >= 10.0 {
            format!("{v:.0}")
        } else {
            format!("{v:.1}")
        }
    }

    fn cdf(mut v: Vec<f64>) -> Vec<(f64, f64)> {
        v.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
        let n = v.len() as f64;
        v.iter().enumerate().map(|(i, &x)| (x, (i + 1) as f64 / n)).collect()
    }

    pub fn svg(runs: &[Run]) -> String {
        let mut out = String::new();
        let rows = 3.0;
        let height = H * rows + 40.0 + 16.0 * runs.len() as f64;
        let _ = write!(
            out,
            r##"<svg xmlns="http://www.w3.org/2000/svg" width="{}" height="{height}" font-family="sans-serif"><rect width="100%" height="100%" fill="white"/>"##,
            2.0 * W
        );
        // Left: CDFs of TTFT, TPOT, E2E.
        for (row, (name, get)) in [
            ("TTFT", (|r: &RequestRecord| r.ttft_ms()) as fn(&RequestRecord) -> Option<f64>),
            ("TPOT", |r: &RequestRecord| r.tpot_ms()),
            ("E2E", |r: &RequestRecord| Some(r.e2e_ms())),
        ]
        .into_iter()
        .enumerate()
        {
            let xmax = runs.iter().flat_map(|r| r.records.iter().filter_map(get)).fold(0.0, f64::max) * 1.05;
            let p = Panel { x0: 0.0, y0: row as f64 * H, xmax, ymax: 1.0 };
            p.frame(&mut out, &format!("{name}: share of requests at or below"), "ms", "fraction");
            for (i, r) in runs.iter().enumerate() {
                p.line(&mut out, &cdf(r.records.iter().filter_map(get).collect()), COLORS[i % COLORS.len()], false);
            }
        }
        // Right: output tokens/s over time (bins), running sequences (dashed, right scale
        // shared), per run.
        let tmax = runs.iter().flat_map(|r| r.records.iter().map(|x| x.finished_ms)).fold(0.0, f64::max) / 1e3;
        let bins = 40usize;
        let width = (tmax / bins as f64).max(1e-3);
        let series: Vec<Vec<(f64, f64)>> = runs
            .iter()
            .map(|r| {
                let mut counts = vec![0usize; bins + 1];
                for t in r.records.iter().flat_map(|x| x.token_ms.iter()) {
                    counts[((t / 1e3 / width) as usize).min(bins)] += 1;
                }
                counts.iter().enumerate().map(|(i, &c)| ((i as f64 + 0.5) * width, c as f64 / width)).collect()
            })
            .collect();
        let ymax = series.iter().flatten().map(|p| p.1).fold(0.0, f64::max) * 1.1;
        let p = Panel { x0: W, y0: 0.0, xmax: tmax, ymax };
        p.frame(&mut out, "output tokens/s over time", "s", "tok/s");
        for (i, s) in series.iter().enumerate() {
            p.line(&mut out, s, COLORS[i % COLORS.len()], false);
        }
        let smax = runs.iter().flat_map(|r| r.timeline.iter().map(|x| x.1)).max().unwrap_or(1) as f64;
        let p = Panel { x0: W, y0: H, xmax: tmax, ymax: smax.max(1.0) };
        p.frame(&mut out, "running sequences after each step", "s", "sequences");
        for (i, r) in runs.iter().enumerate() {
            let pts: Vec<(f64, f64)> = r.timeline.iter().map(|&(t, n)| (t / 1e3, n as f64)).collect();
            p.line(&mut out, &pts, COLORS[i % COLORS.len()], true);
        }
        // Throughput against latency (one point per run).
        let xmax = runs.iter().map(|r| r.summary.tpot_ms.p50).fold(0.0, f64::max) * 1.1;
        let ymax = runs.iter().map(|r| r.summary.output_tokens_per_s).fold(0.0, f64::max) * 1.1;
        let p = Panel { x0: W, y0: 2.0 * H, xmax, ymax };
        p.frame(&mut out, "throughput against TPOT p50", "TPOT p50 ms", "output tok/s");
        let pts: Vec<(f64, f64)> = runs.iter().map(|r| (r.summary.tpot_ms.p50, r.summary.output_tokens_per_s)).collect();
        p.line(&mut out, &pts, "#444", false);
        for (i, &(x, y)) in pts.iter().enumerate() {
            let _ = write!(out, r##"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{}"/>"##, p.px(x), p.py(y), COLORS[i % COLORS.len()]);
        }
        // Legend.
        for (i, r) in runs.iter().enumerate() {
            let y = rows * H + 20.0 + 16.0 * i as f64;
            let _ = write!(
                out,
                r##"<rect x="50" y="{}" width="12" height="4" fill="{}"/><text x="68" y="{}" font-size="11">{}: {:.1} output tok/s, TTFT p50 {:.0} ms, TPOT p50 {:.1} ms</text>"##,
                y - 4.0,
                COLORS[i % COLORS.len()],
                y,
                r.label,
                r.summary.output_tokens_per_s,
                r.summary.ttft_ms.p50,
                r.summary.tpot_ms.p50
            );
        }
        out.push_str("</svg>\n");
        out
    }
}

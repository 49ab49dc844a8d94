//! Continuous batching (`lantern::engine::Engine`) on a tiny Llama (the `llama-gqa` fixture,
//! f32): every request's output inside a batch equals its output alone (batch-invariant
//! kernels), including across preemption (a KV pool far smaller than the demand) and prefix
//! hits; cancellation and dropped handles free their pages; refusals are typed.

mod common;

use common::random::Rng;

use std::sync::{Arc, OnceLock};

use lantern::engine::{Engine, EngineOptions, Event, FinishReason, GenerateRequest, Generation, RequestHandle, SamplingParams};
use lantern::model::forward::{GpuModel, ModelOptions};
use lantern::model::hf::load_hf_folder;
use lantern::model::tokenizer::Tokenizer;
use lantern::model::ModelWeights;

fn tokenizer() -> Arc<Tokenizer> {
    common::smollm2_tokenizer()
}

fn weights() -> &'static ModelWeights {
    static W: OnceLock<ModelWeights> = OnceLock::new();
    W.get_or_init(|| load_hf_folder(&common::tiny_dir().join("llama-gqa")).expect("tiny llama-gqa"))
}

fn engine(opts: ModelOptions, eo: EngineOptions) -> Engine {
    let m = pollster::block_on(GpuModel::load(common::gpu(), weights(), opts)).expect("upload tiny model");
    Engine::new(m, tokenizer(), eo)
}

/// Random prompts (1..40 tokens, ids < 512) and lengths; two share a 24-token prefix, one
/// samples with temperature (its own seed).
fn requests(seed: u64, n: usize) -> Vec<GenerateRequest> {
    let mut r = Rng(seed);
    let shared: Vec<u32> = (0..24).map(|_| r.below(512) as u32).collect();
    (0..n)
        .map(|i| {
            let len = 1 + r.below(40);
            let mut prompt: Vec<u32> = (0..len).map(|_| r.below(512) as u32).collect();
            if i < 2 {
                prompt = shared.iter().copied().chain(prompt.into_iter().take(6)).collect();
            }
            let sampling =
                if i == 3 { SamplingParams { temperature: 0.8, top_k: 40, top_p: 0.95, seed: 11 } } else { SamplingParams::default() };
            GenerateRequest {
                prompt_ids: prompt,
                max_tokens: 1 + r.below(20),
                sampling,
                stop_ids: vec![],
                stop_strings: vec![],
                speculation: Default::default(),
                constraint: None,
                logprobs: None,
                bias: Default::default(),
            }
        })
        .collect()
}

/// Drain a handle's events: the Done generation and the streamed text.
fn collect(h: &mut RequestHandle) -> (Generation, String) {
    let mut text = String::new();
    loop {
        match h.try_next() {
            Ok(Some(Event::Token { text: t, .. })) | Ok(Some(Event::Text(t))) => text.push_str(&t),
            Ok(Some(Event::Done(g))) => return (*g, text),
            Ok(Some(Event::Error(e))) => panic!("request {} failed: {e}", h.id),
            Ok(None) => panic!("request {} has no Done after the engine went idle", h.id),
            Err(()) => panic!("request {} ended without Done", h.id),
        }
    }
}

fn model_opts(max_seqs: usize, kv_pages: Option<usize>) -> ModelOptions {
    ModelOptions {
        context: Some(64),
        max_seqs,
        page_size: 4,
        kv_pages,
        max_batch_tokens: 32,
        max_logit_rows: 16,
        batch_invariant: true,
        ..Default::default()
    }
}

/// Each request alone, one after another.
fn solo(reqs: &[GenerateRequest]) -> Vec<Generation> {
    let mut e = engine(model_opts(1, None), EngineOptions { step_tokens: 32, prefill_chunk: 32, max_waiting: 8 });
    reqs.iter()
        .map(|r| {
            let mut h = e.submit(r.clone()).expect("submit");
            pollster::block_on(e.run_until_idle()).expect("run");
            collect(&mut h).0
        })
        .collect()
}

#[test]
fn batched_outputs_equal_solo_outputs_with_preemption_and_prefix_hits() {
    let reqs = requests(0x5eed, 10);
    let alone = solo(&reqs);
    // 6 sequences at once sharing 18 pages of 4 tokens (72 tokens; the requests want up to
    // 64 each), steps of 12 tokens with prefill chunks of 8: chunked prefill beside decode,
    // admission by free pages, and preemption when running sequences outgrow the pool.
    let mut e = engine(model_opts(6, Some(18)), EngineOptions { step_tokens: 12, prefill_chunk: 8, max_waiting: 64 });
    let mut handles: Vec<RequestHandle> = reqs.iter().map(|r| e.submit(r.clone()).expect("submit")).collect();
    let mut max_seqs_in_step = 0;
    while !e.is_idle() {
        let rep = pollster::block_on(e.step()).expect("step");
        max_seqs_in_step = max_seqs_in_step.max(rep.sequences);
    }
    let stats = e.stats().clone();
    eprintln!("{stats:?}; up to {max_seqs_in_step} sequences in one step");
    assert!(max_seqs_in_step >= 3, "requests were batched");
    assert!(stats.preemptions > 0, "the small pool forced preemption");
    for (i, (h, want)) in handles.iter_mut().zip(&alone).enumerate() {
        let (got, streamed) = collect(h);
        assert_eq!(got.output_ids, want.output_ids, "request {i}: batched output differs from solo");
        assert_eq!(got.finish_reason, want.finish_reason, "request {i}");
        assert_eq!(streamed, got.text, "request {i}: streamed text = final text");
    }
    assert_eq!(e.model.kv.alloc.free_pages(), e.model.kv.alloc.total_pages(), "every page back");
    // The shared prefix: request 0 again, then request 1 reuses the 24 tokens of pages they
    // share and still produces its tokens.
    for i in [0, 1] {
        let mut h = e.submit(reqs[i].clone()).unwrap();
        pollster::block_on(e.run_until_idle()).unwrap();
        let (g, _) = collect(&mut h);
        if i == 1 {
            assert!(g.cached_prompt_tokens >= 24, "prefix hit: {} cached tokens", g.cached_prompt_tokens);
        }
        assert_eq!(g.output_ids, alone[i].output_ids, "request {i} after the batch");
    }
}

#[test]
fn cancelled_and_dropped_requests_free_their_pages() {
    let mut e = engine(model_opts(4, None), EngineOptions::default());
    let long = GenerateRequest {
        prompt_ids: (1..20).collect(),
        max_tokens: 40,
        sampling: SamplingParams::default(),
        stop_ids: vec![],
        stop_strings: vec![],
        speculation: Default::default(),
        constraint: None,
        logprobs: None,
        bias: Default::default(),
    };
    let mut a = e.submit(long.clone()).unwrap();
    let b = e.submit(long.clone()).unwrap();
    for _ in 0..3 {
        pollster::block_on(e.step()).unwrap();
    }
    assert_eq!(e.running(), 2);
    a.cancel();
    drop(b); // a client that went away
    pollster::block_on(e.step()).unwrap();
    assert!(e.is_idle());
    assert_eq!(e.model.kv.alloc.used_pages(), 0, "pages of cancelled requests freed");
    let (g, _) = collect(&mut a);
    assert_eq!(g.finish_reason, FinishReason::Cancelled);
    assert!(!g.output_ids.is_empty() && g.output_ids.len() < 40);
    assert_eq!(e.stats().cancelled, 2);
}

#[test]
fn impossible_requests_are_refused_at_submit() {
    let mut e = engine(model_opts(2, Some(8)), EngineOptions { max_waiting: 1, ..Default::default() });
    let req = |n: usize, max: usize| GenerateRequest {
        prompt_ids: vec![5; n],
        max_tokens: max,
        sampling: SamplingParams::default(),
        stop_ids: vec![],
        stop_strings: vec![],
        speculation: Default::default(),
        constraint: None,
        logprobs: None,
        bias: Default::default(),
    };
    assert!(matches!(e.submit(req(0, 4)), Err(lantern::LanternError::InvalidRequest(_))), "empty prompt");
    assert!(matches!(e.submit(req(64, 4)), Err(lantern::LanternError::PromptTooLong { .. })));
    // 8 pages of 4 tokens hold 32: a 30-token prompt with 10 new tokens could never fit.
    let err = e.submit(req(30, 10)).err().expect("refused");
    assert!(err.to_string().contains("needs 10 more page(s)"), "{err}");
    let _h = e.submit(req(4, 4)).unwrap();
    let err = e.submit(req(4, 4)).err().expect("queue full");
    assert!(matches!(err, lantern::LanternError::Overloaded { waiting: 1, max_waiting: 1 }), "{err}");
    assert!(err.to_string().contains("overloaded"), "{err}");
}

/// The engine on its own thread: four client threads submit at once and each reads its
/// stream to the end; outputs equal the solo ones.
#[test]
fn worker_thread_serves_concurrent_clients() {
    use lantern::engine::EngineWorker;
    let reqs = requests(0xbeef, 4);
    let alone = solo(&reqs);
    let worker = EngineWorker::spawn(engine(model_opts(4, None), EngineOptions::default()));
    let threads: Vec<_> = reqs
        .iter()
        .cloned()
        .map(|r| {
            let client = worker.client();
            std::thread::spawn(move || {
                let mut h = client.submit(r).expect("submit");
                loop {
                    match pollster::block_on(h.next()) {
                        Some(Event::Done(g)) => return g.output_ids,
                        Some(Event::Error(e)) => panic!("{e}"),
                        Some(_) => {}
                        None => panic!("stream ended without Done"),
                    }
                }
            })
        })
        .collect();
    for (i, (t, want)) in threads.into_iter().zip(&alone).enumerate() {
        assert_eq!(t.join().expect("client thread"), want.output_ids, "request {i}");
    }
    // The snapshot is published right after the step that sent the last Done.
    let mut snap = worker.client().snapshot();
    for _ in 0..200 {
        if snap.stats.finished == 4 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
        snap = worker.client().snapshot();
    }
    assert_eq!(snap.stats.finished, 4);
    let engine = worker.shutdown().expect("engine back");
    assert_eq!(engine.model.kv.alloc.used_pages(), 0);
}

/// The GPU top-k (512 bytes per sampled row) returns exactly the 64 best (id, logit) pairs of
/// the row the logits path reads back, and a top-k sampler draws the same tokens from them.
#[test]
fn gpu_top_k_pairs_equal_the_logits_and_sample_the_same_tokens() {
    use lantern::engine::Sampler;
    use lantern::model::forward::Want;
    let mut m = pollster::block_on(GpuModel::load(common::gpu(), weights(), model_opts(2, None))).expect("upload");
    let prompt: Vec<u32> = (1..20).map(|i| i * 17 % 512).collect();
    let a = m.new_sequence().unwrap();
    let logits = pollster::block_on(m.forward(a, &prompt, Want::Logits)).unwrap().logits.expect("logits");
    let b = m.new_sequence().unwrap();
    let out = pollster::block_on(m.forward(b, &prompt, Want::TopK)).unwrap();
    let top = out.top.expect("top pairs")[0].clone();
    let mut want: Vec<(u32, f32)> = logits.iter().enumerate().map(|(i, &v)| (i as u32, v)).collect();
    want.sort_by(|x, y| y.1.partial_cmp(&x.1).unwrap().then(x.0.cmp(&y.0)));
    want.truncate(64);
    assert_eq!(top, want);
    assert_eq!(out.argmax[0], want[0].0);
    for p in [
        SamplingParams { temperature: 0.9, top_k: 40, top_p: 0.95, seed: 5 },
        SamplingParams { temperature: 1.5, top_k: 64, top_p: 1.0, seed: 6 },
    ] {
        let (mut sa, mut sb) = (Sampler::new(p), Sampler::new(p));
        for _ in 0..200 {
            assert_eq!(sa.sample(&logits), sb.sample_top(&top));
        }
    }
}

/// `submit_n`: n samples of one prompt. Sample i equals a solo request with seed + i, greedy
/// samples equal each other, and the prompt's pages are held once (the samples fork them
/// before the prompt's last token; the prefix cache is off, so no other sharing exists).
#[test]
fn parallel_samples_fork_the_prompt_pages_and_equal_solo_runs() {
    let mut r = Rng(0xf0e1);
    let prompt: Vec<u32> = (0..30).map(|_| r.below(512) as u32).collect();
    let sampled = GenerateRequest {
        prompt_ids: prompt.clone(),
        max_tokens: 6,
        sampling: SamplingParams { temperature: 1.0, top_k: 0, top_p: 1.0, seed: 77 },
        ..Default::default()
    };
    let greedy = GenerateRequest { sampling: SamplingParams::default(), ..sampled.clone() };
    let seeds: Vec<GenerateRequest> =
        (0..3).map(|i| GenerateRequest { sampling: SamplingParams { seed: 77 + i, ..sampled.sampling }, ..sampled.clone() }).collect();
    let alone = solo(&seeds.iter().cloned().chain([greedy.clone()]).collect::<Vec<_>>());

    let opts = ModelOptions { prefix_cache: false, ..model_opts(4, Some(40)) };
    let mut e = engine(opts, EngineOptions { step_tokens: 32, prefill_chunk: 8, max_waiting: 8 });
    let total = e.model.kv.alloc.total_pages();
    let mut handles = e.submit_n(sampled, 3).expect("submit_n");
    let mut peak = 0;
    while !e.is_idle() {
        pollster::block_on(e.step()).expect("step");
        peak = peak.max(total - e.model.kv.alloc.free_pages());
    }
    // Alone, each sample holds ceil(36 / 4) = 9 pages (27 for three). Forked: the 7 full
    // prompt pages once, plus per sample its partial page (a copy) and 1-2 pages of output.
    assert!(peak <= 7 + 3 * 3, "peak {peak} pages: the prompt's pages are not shared");
    let gens: Vec<Generation> = handles.iter_mut().map(|h| collect(h).0).collect();
    for (i, (g, want)) in gens.iter().zip(&alone).enumerate() {
        assert_eq!(g.output_ids, want.output_ids, "sample {i} differs from a solo run with seed 77 + {i}");
        assert_eq!(g.prompt_ids, prompt);
    }
    assert_eq!(gens[1].cached_prompt_tokens, 29, "a forked sample shares all but the prompt's last token");
    assert!(gens[0].output_ids != gens[1].output_ids || gens[1].output_ids != gens[2].output_ids, "seeds differ");
    assert_eq!(e.model.kv.alloc.free_pages(), total, "every page back");

    // Greedy: two identical samples; n beyond the engine's sequences is refused.
    let mut hs = e.submit_n(greedy, 2).expect("submit_n");
    pollster::block_on(e.run_until_idle()).unwrap();
    for h in &mut hs {
        assert_eq!(collect(h).0.output_ids, alone[3].output_ids);
    }
    assert!(e.submit_n(seeds[0].clone(), 5).is_err(), "n = 5 > 4 sequences");
    assert!(e.submit_n(seeds[0].clone(), 0).is_err());
    // Dropping the first sample's handle before the fork leaves the others running.
    let mut hs = e.submit_n(seeds[0].clone(), 2).expect("submit_n");
    drop(hs.remove(0));
    pollster::block_on(e.run_until_idle()).unwrap();
    assert_eq!(collect(&mut hs[0]).0.output_ids, alone[1].output_ids);
    assert_eq!(e.model.kv.alloc.free_pages(), total, "every page back");
}

/// Logprobs (`GenerateRequest::logprobs`) from the GPU's top pairs and logsumexp (greedy:
/// `Want::TopK`) and from the logits row (sampling without top-k) equal a CPU log-softmax of
/// the same logits within 1e-4, for the sampled token and its 5 best alternatives.
#[test]
fn logprobs_equal_a_cpu_log_softmax_of_the_logits() {
    use lantern::model::forward::Want;
    let prompt: Vec<u32> = (1..14).map(|i| i * 29 % 512).collect();
    let mut e = engine(model_opts(2, None), EngineOptions { step_tokens: 32, prefill_chunk: 32, max_waiting: 8 });
    for sampling in [SamplingParams::default(), SamplingParams { temperature: 1.0, top_k: 0, top_p: 1.0, seed: 9 }] {
        let req = GenerateRequest { prompt_ids: prompt.clone(), max_tokens: 5, sampling, logprobs: Some(5), ..Default::default() };
        let mut h = e.submit(req).expect("submit");
        pollster::block_on(e.run_until_idle()).unwrap();
        let (g, _) = collect(&mut h);
        assert_eq!(g.logprobs.len(), g.output_ids.len());
        // The same logits, teacher-forced one position at a time.
        let seq = e.model.new_sequence().unwrap();
        let mut feed = prompt.clone();
        for (t, lp) in g.logprobs.iter().enumerate() {
            let logits = pollster::block_on(e.model.forward(seq, &feed, Want::Logits)).unwrap().logits.expect("logits");
            let m = logits.iter().cloned().fold(f32::MIN, f32::max) as f64;
            let lse = m + logits.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>().ln();
            let want = |id: u32| logits[id as usize] as f64 - lse;
            assert_eq!(lp.id, g.output_ids[t]);
            assert!((lp.logprob as f64 - want(lp.id)).abs() < 1e-4, "token {t}: {} vs {}", lp.logprob, want(lp.id));
            let mut best: Vec<u32> = (0..logits.len() as u32).collect();
            best.sort_by(|a, b| logits[*b as usize].total_cmp(&logits[*a as usize]).then(a.cmp(b)));
            assert_eq!(lp.top.iter().map(|p| p.0).collect::<Vec<_>>(), best[..5].to_vec(), "token {t}: the 5 best");
            for &(id, v) in &lp.top {
                assert!((v as f64 - want(id)).abs() < 1e-4, "token {t}, alternative {id}: {v} vs {}", want(id));
            }
            feed = vec![g.output_ids[t]];
        }
        e.model.release_sequence(seq);
    }
    let bad = GenerateRequest { prompt_ids: prompt, logprobs: Some(21), ..Default::default() };
    assert!(e.submit(bad).is_err(), "more than 20 alternatives");
}

/// OpenAI's logit_bias and presence/frequency penalties: a biased greedy request takes, at
/// every step, the argmax of the logits plus its biases computed on the CPU (teacher-forced
/// through the same model), and its logprobs are the log-softmax of those biased logits. A
/// plain request batched beside biased ones keeps its solo output, two rows of 512 pairs
/// overflow the bias buffer's first size (16 rows x 64 pairs; it grows), and `generate`
/// takes the same biased tokens as the engine.
#[test]
fn logit_bias_and_penalties_equal_a_cpu_bias_of_the_logits() {
    use lantern::engine::LogitBias;
    use lantern::model::forward::Want;
    let prompt: Vec<u32> = (1..12).map(|i| i * 37 % 512).collect();
    let mut e = engine(model_opts(6, None), EngineOptions { step_tokens: 32, prefill_chunk: 32, max_waiting: 8 });
    let plain = GenerateRequest { prompt_ids: prompt.clone(), max_tokens: 10, ..Default::default() };
    let mut h = e.submit(plain.clone()).unwrap();
    pollster::block_on(e.run_until_idle()).unwrap();
    let alone = collect(&mut h).0;
    // Ban the plain run's first token, favour another, and penalise repeats hard.
    let fixed = vec![(alone.output_ids[0], -100.0), (77, 2.5)];
    let mut r = Rng::new(4242);
    let wide: Vec<(u32, f32)> = (0..512u32).map(|t| (t, r.uniform())).collect();
    let cases = [
        LogitBias { tokens: fixed.clone(), presence_penalty: 0.8, frequency_penalty: 1.1 },
        LogitBias { tokens: vec![], presence_penalty: -0.5, frequency_penalty: 2.0 },
        LogitBias { tokens: wide.clone(), presence_penalty: 0.0, frequency_penalty: 0.0 },
        LogitBias { tokens: wide.iter().map(|&(t, d)| (t, -d)).collect(), presence_penalty: 0.3, frequency_penalty: 0.0 },
    ];
    let reqs: Vec<GenerateRequest> = cases
        .iter()
        .enumerate()
        .map(|(i, b)| GenerateRequest {
            prompt_ids: prompt.iter().map(|&t| (t + i as u32) % 512).collect(),
            max_tokens: 10,
            logprobs: Some(3),
            bias: b.clone(),
            ..Default::default()
        })
        .collect();
    let mut hs: Vec<RequestHandle> = reqs.iter().map(|q| e.submit(q.clone()).unwrap()).collect();
    let mut hp = e.submit(plain.clone()).unwrap();
    let before = e.model.memory().workspace;
    pollster::block_on(e.run_until_idle()).unwrap();
    assert!(e.model.memory().workspace > before, "the bias buffer grew");
    assert_eq!(collect(&mut hp).0.output_ids, alone.output_ids, "a plain request beside biased ones");
    for (q, h) in reqs.iter().zip(hs.iter_mut()) {
        let g = collect(h).0;
        assert_eq!(g.output_ids.len(), 10);
        let seq = e.model.new_sequence().unwrap();
        let mut feed = q.prompt_ids.clone();
        let mut counts = std::collections::HashMap::<u32, u32>::new();
        for (t, lp) in g.logprobs.iter().enumerate() {
            let mut logits = pollster::block_on(e.model.forward(seq, &feed, Want::Logits)).unwrap().logits.expect("logits");
            for &(tok, d) in &q.bias.tokens {
                logits[tok as usize] += d;
            }
            for (&tok, &c) in &counts {
                logits[tok as usize] -= c as f32 * q.bias.frequency_penalty + q.bias.presence_penalty;
            }
            let best = lantern::reference::ops::argmax(&logits);
            assert_eq!(g.output_ids[t], best, "{:?}: token {t}", q.bias);
            let m = logits.iter().cloned().fold(f32::MIN, f32::max) as f64;
            let lse = m + logits.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>().ln();
            assert!((lp.logprob as f64 - (logits[best as usize] as f64 - lse)).abs() < 1e-4, "{:?}: token {t} logprob", q.bias);
            *counts.entry(best).or_default() += 1;
            feed = vec![best];
        }
        e.model.release_sequence(seq);
        // The single-sequence loop (`lantern run`, the browser) takes the same tokens.
        let one = GenerateRequest { logprobs: None, ..q.clone() };
        let solo = pollster::block_on(lantern::engine::generate::generate(&mut e.model, &tokenizer(), &one, |_| true)).unwrap();
        assert_eq!(solo.output_ids, g.output_ids, "{:?}: generate", q.bias);
    }
    assert_ne!(reqs[0].bias.tokens[0].0, 0, "the banned token is a real choice");
    let bad = GenerateRequest {
        prompt_ids: prompt.clone(),
        bias: LogitBias { tokens: vec![(512, 1.0)], ..Default::default() },
        ..Default::default()
    };
    let Err(err) = e.submit(bad) else { panic!("a bias outside the vocabulary was accepted") };
    let err = err.to_string();
    assert!(err.contains("token 512") && err.contains("512"), "{err}");
}

/// One greedy request through `generate` on a model loaded with `decode_ahead` steps in
/// flight, then a second request on the same model (which must not see the first one's
/// rolled-back steps).
fn generate_pair(decode_ahead: usize, first: &GenerateRequest, second: &GenerateRequest) -> (Generation, Generation) {
    let opts = ModelOptions { context: Some(48), page_size: 4, max_batch_tokens: 16, decode_ahead, ..Default::default() };
    let mut m = pollster::block_on(GpuModel::load(common::gpu(), weights(), opts)).expect("upload tiny model");
    assert_eq!(m.decode_ahead_depth(), if decode_ahead >= 2 { decode_ahead } else { 0 });
    let tok = tokenizer();
    let mut run = |r: &GenerateRequest| {
        let mut streamed = String::new();
        let g = pollster::block_on(lantern::engine::generate::generate(&mut m, &tok, r, |p| {
            streamed.push_str(p);
            true
        }))
        .expect("generate");
        assert_eq!(streamed, g.text, "streamed text equals the final text");
        g
    };
    let a = run(first);
    let b = run(second);
    (a, b)
}

#[test]
fn decode_ahead_gives_the_step_at_a_time_tokens_and_rolls_back_past_stops() {
    let base = GenerateRequest { prompt_ids: vec![5, 77, 301, 9, 18], max_tokens: 30, ..Default::default() };
    let other = GenerateRequest { prompt_ids: vec![5, 77, 301, 9, 40, 41], max_tokens: 12, ..Default::default() };
    let (plain, _) = generate_pair(0, &base, &other);
    assert_eq!(plain.output_ids.len(), 30);
    // Stops that land while later steps are in flight: an id, a string, the context's end.
    let by_id = GenerateRequest { stop_ids: vec![plain.output_ids[9]], ..base.clone() };
    let by_string =
        GenerateRequest { stop_strings: vec![plain.text.chars().skip(plain.text.chars().count() / 2).take(3).collect()], ..base.clone() };
    let to_context = GenerateRequest { prompt_ids: (0..40).map(|i| 3 + i * 7).collect(), max_tokens: 100, ..base.clone() };
    let one = GenerateRequest { max_tokens: 1, ..base.clone() };
    let two = GenerateRequest { max_tokens: 2, ..base.clone() };
    for req in [&base, &by_id, &by_string, &to_context, &one, &two] {
        let (want, want_next) = generate_pair(0, req, &other);
        for depth in [2, 3, 5] {
            let (got, got_next) = generate_pair(depth, req, &other);
            assert_eq!(got.output_ids, want.output_ids, "depth {depth}: tokens");
            assert_eq!(got.text, want.text, "depth {depth}: text");
            assert_eq!(got.finish_reason, want.finish_reason, "depth {depth}: finish reason");
            assert_eq!(got_next.output_ids, want_next.output_ids, "depth {depth}: the next request on the same model");
        }
    }
    let (ctx_full, _) = generate_pair(3, &to_context, &other);
    assert_eq!(ctx_full.finish_reason, FinishReason::ContextFull);
    let (stopped, _) = generate_pair(3, &by_id, &other);
    let at = plain.output_ids.iter().position(|&t| t == plain.output_ids[9]).expect("the stop id") + 1;
    assert_eq!((stopped.finish_reason, stopped.output_ids.len()), (FinishReason::Stop, at));
}

#[test]
fn noop_backend_decodes_with_no_objects_created_per_token() {
    // wgpu's noop backend executes nothing (the tokens are zeros), so what a run costs there
    // is the host's own work; it stands in for a discrete GPU (no CPU-adapter layouts).
    let ctx = common::gpu_with(&lantern::gpu::DeviceOptions { backend: Some("noop".into()), ..Default::default() });
    assert_eq!(ctx.info.backend, wgpu::Backend::Noop);
    assert!(!ctx.caps.cpu_like && ctx.caps.subgroups);
    let mut m =
        pollster::block_on(GpuModel::load(ctx, weights(), ModelOptions { context: Some(256), ..Default::default() })).expect("load");
    let req = GenerateRequest { prompt_ids: vec![1, 2, 3], max_tokens: 64, ..Default::default() };
    let g = pollster::block_on(lantern::engine::generate::generate(&mut m, &tokenizer(), &req, |_| true)).expect("generate");
    assert_eq!(g.output_ids, vec![0; 64], "noop reads back zeros");
    let h = g.host.expect("host costs of the decode steps");
    assert_eq!(h.tokens, 63);
    assert_eq!((h.buffers_per_token, h.bind_groups_per_token), (0.0, 0.0), "{h:?}");
    assert_eq!((h.submits_per_token, h.readbacks_per_token), (1.0, 1.0), "{h:?}");
    assert_eq!(h.dispatches_per_token, m.dispatches_per_decode_step() as f64, "{h:?}");
    // Steps run ahead: only the last wait finds nothing queued behind it.
    assert!(h.stalls_per_token <= 1.0 / 63.0 + 1e-9, "{h:?}");
    assert!(h.writes_per_token < 1.2, "a position per step, the block table per new page: {h:?}");
}

#[test]
fn sampled_decode_ahead_gives_the_step_at_a_time_tokens() {
    // Sampling with a top-k of at most 64 runs ahead too: each step's token is drawn on the
    // GPU from its top-k pairs and fed to the next step; the request's sampler draws again
    // from the same pairs and its token is kept, so the output is the step-at-a-time one.
    let other = GenerateRequest { prompt_ids: vec![5, 77, 301, 9, 40, 41], max_tokens: 12, ..Default::default() };
    let mut redraws = 0;
    for (i, (temperature, top_k, top_p)) in [(0.8, 40, 0.95), (1.5, 64, 1.0), (0.3, 8, 0.9), (1.0, 2, 1.0)].into_iter().enumerate() {
        let req = GenerateRequest {
            prompt_ids: vec![5, 77, 301, 9, 18],
            max_tokens: 30,
            sampling: SamplingParams { temperature, top_k, top_p, seed: 100 + i as u64 },
            ..Default::default()
        };
        let (want, want_next) = generate_pair(0, &req, &other);
        for depth in [2, 3] {
            let (got, got_next) = generate_pair(depth, &req, &other);
            assert_eq!(got.output_ids, want.output_ids, "t {temperature} k {top_k} p {top_p}, depth {depth}");
            assert_eq!(got_next.output_ids, want_next.output_ids, "the next request after t {temperature}, depth {depth}");
            let h = got.host.expect("host costs");
            assert!(h.submits_per_token <= 1.0 + h.redraws as f64 * 3.0 / 29.0 + 1e-9, "{h:?}");
            redraws += h.redraws;
        }
    }
    // Rounding can make a draw differ now and then; not most of the time.
    assert!(redraws < 10, "{redraws} GPU draws differed from the sampler's");
}

/// Sampling without a top-k (OpenAI's default, with or without a top-p) draws on the GPU by
/// the Gumbel-max rule over the vocabulary or its nucleus, keyed by the seed and the token's
/// index: the same tokens a step at a time and decoded ahead (in `generate` and in the
/// engine, chained beside greedy and top-k sampled rows), one readback of 4 bytes per token,
/// other seeds other tokens.
#[test]
fn whole_vocabulary_draws_are_the_same_ahead_and_a_step_at_a_time() {
    let hot = |seed: u64, temperature: f32| SamplingParams { temperature, top_k: 0, top_p: 1.0, seed };
    let nucleus = |seed: u64, top_p: f32| SamplingParams { temperature: 1.0, top_k: 0, top_p, seed };
    let other = GenerateRequest { prompt_ids: vec![5, 77, 301, 9, 40, 41], max_tokens: 12, ..Default::default() };
    let req = |sampling| GenerateRequest { prompt_ids: vec![5, 77, 301, 9, 18], max_tokens: 30, sampling, ..Default::default() };
    let (want, want_next) = generate_pair(0, &req(hot(3, 1.0)), &other);
    let (greedy, _) = generate_pair(0, &req(SamplingParams::default()), &other);
    let (reseeded, _) = generate_pair(0, &req(hot(4, 1.0)), &other);
    assert_ne!(want.output_ids, greedy.output_ids, "a draw at temperature 1 is not the argmax");
    assert_ne!(want.output_ids, reseeded.output_ids, "another seed, other tokens");
    for depth in [2, 3] {
        let (got, got_next) = generate_pair(depth, &req(hot(3, 1.0)), &other);
        assert_eq!(got.output_ids, want.output_ids, "depth {depth}");
        assert_eq!(got_next.output_ids, want_next.output_ids, "the next request, depth {depth}");
        let h = got.host.expect("host costs");
        assert_eq!((h.submits_per_token, h.readbacks_per_token, h.redraws), (1.0, 1.0, 0), "{h:?}");
        assert!(h.stalls_per_token <= 1.0 / 29.0 + 1e-9, "decoded ahead: {h:?}");
    }
    // A nucleus: its own tokens, the same ahead.
    let (cut, _) = generate_pair(0, &req(nucleus(3, 0.5)), &other);
    assert_ne!(cut.output_ids, want.output_ids, "a top-p of 0.5 draws from fewer tokens");
    let (cut_ahead, _) = generate_pair(3, &req(nucleus(3, 0.5)), &other);
    assert_eq!(cut_ahead.output_ids, cut.output_ids, "top-p 0.5 ahead");
    // The engine: the chain's requests with three of them sampling without a top-k.
    let mut reqs = chain_requests(None);
    reqs[0].sampling = hot(21, 0.9);
    reqs[3].sampling = nucleus(23, 0.9);
    reqs[6].sampling = hot(22, 1.4);
    let (plain, plain_stats, _) = run_chained(0, false, &reqs);
    let (ahead, stats, _) = run_chained(3, false, &reqs);
    for (i, (w, g)) in plain.iter().zip(&ahead).enumerate() {
        assert_eq!(g.output_ids, w.output_ids, "request {i}");
        assert_eq!(g.finish_reason, w.finish_reason, "request {i}");
    }
    eprintln!("one step at a time: {plain_stats:?}\nahead: {stats:?}");
    assert!(stats.steps_ahead >= 5, "whole-vocabulary rows chain: {stats:?}");
    assert_eq!(stats.redraws, 0, "the GPU's draw is the token: {stats:?}");
    // Alone in the engine, a request draws what `generate` draws.
    let mut e = engine(model_opts(2, None), EngineOptions { step_tokens: 32, prefill_chunk: 32, max_waiting: 8 });
    let mut h = e.submit(req(hot(3, 1.0))).expect("submit");
    pollster::block_on(e.run_until_idle()).expect("run");
    assert_eq!(collect(&mut h).0.output_ids, want.output_ids, "the engine and generate");
}

/// Requests whose streams end in every way while a step past their end is in flight: by
/// length, by a stop id and a stop string taken from their plain outputs, at the context's
/// end; two sample on the GPU with the same parameters (so they chain with the greedy ones),
/// one samples with others (no step runs ahead while it runs), one arrives mid-run (the
/// chain breaks for its admission).
fn chain_requests(plain: Option<&[Generation]>) -> Vec<GenerateRequest> {
    let greedy = |prompt: Vec<u32>, max_tokens: usize| GenerateRequest { prompt_ids: prompt, max_tokens, ..Default::default() };
    let sampled = |prompt: Vec<u32>, max_tokens: usize, temperature: f32, seed: u64| GenerateRequest {
        prompt_ids: prompt,
        max_tokens,
        sampling: SamplingParams { temperature, top_k: 20, top_p: 0.9, seed },
        ..Default::default()
    };
    let mut reqs = vec![
        greedy(vec![5, 77, 301, 9, 18], 24),
        greedy(vec![7, 7, 120, 44], 30),
        greedy(vec![300, 12, 9], 30),
        greedy((0..52).map(|i| 3 + i * 7).collect(), 40),
        sampled(vec![90, 91, 92], 26, 0.9, 9),
        sampled(vec![61, 62, 63, 64], 20, 0.9, 10),
        greedy(vec![11, 12, 13, 14, 15, 16], 9),
        sampled(vec![40, 41, 42], 6, 1.3, 5),
    ];
    if let Some(p) = plain {
        reqs[1].stop_ids = vec![p[1].output_ids[13]];
        let t = &p[2].text;
        reqs[2].stop_strings = vec![t.chars().skip(t.chars().count() * 2 / 3).take(3).collect()];
    }
    reqs
}

/// Run `reqs` on an engine whose model keeps `decode_ahead` steps in flight (its GPU draws
/// skewed with `skew`): all but the last two at once, the seventh after 6 steps, the eighth
/// after 40. Returns each request's generation, the engine's totals and the host's counts.
fn run_chained(
    decode_ahead: usize,
    skew: bool,
    reqs: &[GenerateRequest],
) -> (Vec<Generation>, lantern::engine::EngineStats, lantern::gpu::HostCounts) {
    let opts = ModelOptions { decode_ahead, ..model_opts(6, None) };
    let mut e = engine(opts, EngineOptions { step_tokens: 40, prefill_chunk: 40, max_waiting: 16 });
    e.skew_gpu_draws(skew);
    let before = e.model.ctx.host_counts();
    let mut handles: Vec<RequestHandle> = reqs[..6].iter().map(|r| e.submit(r.clone()).expect("submit")).collect();
    let mut steps = 0;
    while !e.is_idle() || handles.len() < reqs.len() {
        if steps == 6 && handles.len() == 6 {
            handles.push(e.submit(reqs[6].clone()).expect("submit"));
        }
        if steps == 40 && handles.len() == 7 {
            handles.push(e.submit(reqs[7].clone()).expect("submit"));
        }
        pollster::block_on(e.step()).expect("step");
        steps += 1;
    }
    let host = e.model.ctx.host_counts().since(&before);
    assert_eq!(e.model.kv.alloc.free_pages(), e.model.kv.alloc.total_pages(), "every page back (decode_ahead {decode_ahead})");
    let gens = handles
        .iter_mut()
        .map(|h| {
            let (g, streamed) = collect(h);
            assert_eq!(streamed, g.text, "streamed text = final text");
            g
        })
        .collect();
    (gens, e.stats().clone(), host)
}

#[test]
fn engine_decodes_ahead_with_the_step_at_a_time_tokens() {
    // The engine submits the next decode step of every running sequence, its input tokens
    // copied on the GPU from the previous step's argmax rows or GPU draws, before it reads
    // that step's tokens.
    let (plain, _, _) = run_chained(0, false, &chain_requests(None));
    let reqs = chain_requests(Some(&plain));
    let (want, want_stats, want_host) = run_chained(0, false, &reqs);
    let (got, stats, host) = run_chained(3, false, &reqs);
    // Most GPU draws differ from the samplers': the redraw path, same output.
    let (skewed, skewed_stats, _) = run_chained(3, true, &reqs);
    eprintln!("one step at a time: {want_stats:?} {want_host:?}\nahead: {stats:?} {host:?}\nskewed draws: {skewed_stats:?}");
    for (i, w) in want.iter().enumerate() {
        for (how, g) in [("ahead", &got[i]), ("skewed draws", &skewed[i])] {
            assert_eq!(g.output_ids, w.output_ids, "request {i}, {how}: tokens");
            assert_eq!(g.text, w.text, "request {i}, {how}: text");
            assert_eq!(g.finish_reason, w.finish_reason, "request {i}, {how}: finish reason");
        }
    }
    // Every way of ending was exercised.
    let reasons: Vec<FinishReason> = want.iter().map(|g| g.finish_reason).collect();
    assert_eq!(reasons[..4], [FinishReason::Length, FinishReason::Stop, FinishReason::Stop, FinishReason::ContextFull]);
    assert_eq!(want_stats.steps_ahead, 0);
    // (Prefill chunks, the arrivals, the request sampling with other parameters and the
    // last tokens of each request break the chain; the decode steps between them run ahead.)
    assert!(stats.steps_ahead >= 5 && stats.sampled_steps_ahead >= 3, "decode steps ran ahead: {stats:?}");
    assert_eq!(stats.redraws, 0, "{stats:?}");
    assert!(skewed_stats.redraws >= 3 && skewed_stats.sampled_steps_ahead >= 1, "{skewed_stats:?}");
    // Every step one at a time leaves the device idle while the host reads it; a step
    // landed with the next one queued behind it does not.
    assert_eq!(want_host.stalls, want_stats.steps, "{want_host:?}");
    assert_eq!(host.stalls, stats.steps - stats.steps_ahead, "{host:?}");
}

#[test]
fn engine_steps_ahead_on_the_noop_backend_create_nothing_and_never_stall() {
    // Sixteen sequences decoding together on wgpu's noop backend (a discrete GPU's layouts;
    // tokens are zeros): in steady state each engine step is one submission and one
    // readback, with no buffer or bind group created and no wait leaving the device idle.
    let ctx = common::gpu_with(&lantern::gpu::DeviceOptions { backend: Some("noop".into()), ..Default::default() });
    let opts = ModelOptions { context: Some(128), max_seqs: 16, max_batch_tokens: 64, max_logit_rows: 16, ..Default::default() };
    let m = pollster::block_on(GpuModel::load(ctx, weights(), opts)).expect("load");
    let mut e = Engine::new(m, tokenizer(), EngineOptions { step_tokens: 64, prefill_chunk: 64, max_waiting: 16 });
    let mut handles: Vec<RequestHandle> = (0..16u32)
        .map(|i| e.submit(GenerateRequest { prompt_ids: vec![1 + i, 2, 3], max_tokens: 48, ..Default::default() }).expect("submit"))
        .collect();
    // Prefill and the first decode steps, then the steady state.
    for _ in 0..4 {
        pollster::block_on(e.step()).expect("step");
    }
    let (before, steps0) = (e.model.ctx.host_counts(), e.stats().steps);
    for _ in 0..32 {
        pollster::block_on(e.step()).expect("step");
    }
    let c = e.model.ctx.host_counts().since(&before);
    let steps = e.stats().steps - steps0;
    assert_eq!(steps, 32);
    assert_eq!((c.buffers, c.bind_groups), (0, 0), "{c:?}");
    assert_eq!((c.submits, c.readbacks, c.stalls), (32, 32, 0), "{c:?}");
    pollster::block_on(e.run_until_idle()).expect("run");
    for h in &mut handles {
        assert_eq!(collect(h).0.output_ids, vec![0; 48]);
    }
}

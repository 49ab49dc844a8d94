//! Speculative decoding: greedy identity on the real models (prompt lookup on SmolLM2 and
//! Qwen2.5-Coder-0.5B, the 0.5B drafting for the 1.5B), sampled verification's distribution
//! on tiny random models against the CPU reference (chi-square) and its outputs against
//! plain sampling with the same seed, cache rollback, and the refusals.

mod common;

use std::collections::HashMap;
use std::sync::Arc;

use common::random::{random_model, Spec};
use lantern::engine::generate::{generate, generate_with, GenerateRequest};
use lantern::engine::sampler::Sampler;
use lantern::engine::speculative::{check_pair, Drafter, Speculation};
use lantern::engine::SamplingParams;
use lantern::model::forward::{GpuModel, ModelOptions, Want};
use lantern::model::tokenizer::Tokenizer;
use lantern::model::ModelWeights;
use lantern::quant::quantize::{EmbeddingPolicy, QuantizeOptions};
use lantern::quant::QuantKind;
use lantern::reference::forward::ReferenceModel;
use lantern::LanternError;

fn tokenizer() -> Arc<Tokenizer> {
    common::smollm2_tokenizer()
}

const TINY: Spec = Spec {
    seed: 0,
    vocab: 24,
    hidden: 32,
    ffn: 48,
    layers: 2,
    heads: 2,
    kv_heads: 1,
    head_dim: 16,
    bias: false,
    tied: false,
    f16: false,
    llama3: false,
    gemma: false,
};

fn load(w: &ModelWeights, context: usize, page_size: usize) -> GpuModel {
    let opts = ModelOptions { context: Some(context), page_size, max_seqs: 2, prefix_cache: false, ..Default::default() };
    pollster::block_on(GpuModel::load(common::gpu(), w, opts)).expect("upload")
}

/// `w` on the GPU with `o`.
fn up(w: &ModelWeights, o: ModelOptions) -> GpuModel {
    pollster::block_on(GpuModel::load(common::gpu(), w, o)).unwrap()
}

/// `drafter` with a fixed draft length of `k` (n-grams of 2 for lookup).
fn fixed(drafter: Drafter, k: usize) -> Speculation {
    Speculation { drafter, draft_tokens: Some(k), lookup_ngram: 2, ..Default::default() }
}

fn request(prompt: &[u32], max_tokens: usize, sampling: SamplingParams, speculation: Speculation) -> GenerateRequest {
    GenerateRequest {
        prompt_ids: prompt.to_vec(),
        max_tokens,
        sampling,
        stop_ids: vec![],
        stop_strings: vec![],
        speculation,
        constraint: None,
        logprobs: None,
        bias: Default::default(),
    }
}

/// Upper quantile of the chi-square distribution with `df` degrees of freedom at tail
/// probability 1e-6 (Wilson-Hilferty; z = 4.753).
fn chi2_bound(df: usize) -> f64 {
    let d = df as f64;
    let z = 4.753;
    d * (1.0 - 2.0 / (9.0 * d) + z * (2.0 / (9.0 * d)).sqrt()).powi(3)
}

/// Pearson's statistic of observed counts against expected ones, bins with an expectation
/// under 5 pooled into one; returns (statistic, degrees of freedom).
fn chi2(observed: &[f64], expected: &[f64]) -> (f64, usize) {
    let (mut stat, mut bins) = (0.0, 0usize);
    let (mut po, mut pe) = (0.0, 0.0);
    for (&o, &e) in observed.iter().zip(expected) {
        if e < 5.0 {
            po += o;
            pe += e;
        } else {
            stat += (o - e) * (o - e) / e;
            bins += 1;
        }
    }
    if pe > 0.0 {
        stat += (po - pe) * (po - pe) / pe.max(1e-9);
        bins += 1;
    }
    (stat, bins.saturating_sub(1))
}

/// Samples `runs` requests of `new` tokens each (seeds 0..runs) and counts every token after
/// the first (those come out of verify steps when speculating) against what the target's
/// CPU reference says each position's distribution is, given the tokens before it:
/// E[count(x)] = sum over samples of p(x | prefix). Each sample is an independent draw
/// (runs are independent; within a run, given its prefix), so Pearson's statistic is at most
/// chi-square distributed (variance p(1-p) <= p per draw).
#[allow(clippy::too_many_arguments)]
fn sample_counts(
    target: &mut GpuModel,
    mut draft: Option<&mut GpuModel>,
    reference: &ReferenceModel,
    prompt: &[u32],
    params: SamplingParams,
    speculation: Speculation,
    runs: usize,
    new: usize,
) -> (Vec<f64>, Vec<f64>, (usize, usize)) {
    let vocab = reference.config().vocab_size;
    let tok = tokenizer();
    let mut observed = vec![0.0; vocab];
    let mut expected = vec![0.0; vocab];
    let mut memo: HashMap<Vec<u32>, Vec<f64>> = HashMap::new();
    let (mut proposed, mut accepted) = (0, 0);
    for run in 0..runs {
        let sampling = SamplingParams { seed: run as u64 * 7919 + 1, ..params };
        let g =
            pollster::block_on(generate_with(target, draft.as_deref_mut(), &tok, &request(prompt, new, sampling, speculation), |_| true))
                .expect("generate");
        assert_eq!(g.output_ids.len(), new);
        if let Some(s) = &g.speculative {
            proposed += s.proposed;
            accepted += s.accepted;
        }
        for pos in 1..new {
            let mut prefix = prompt.to_vec();
            prefix.extend_from_slice(&g.output_ids[..pos]);
            let p = memo.entry(prefix.clone()).or_insert_with(|| {
                let logits = reference.forward(&prefix);
                let d = Sampler::new(sampling).distribution(&logits[logits.len() - vocab..]);
                let mut p = vec![0.0; vocab];
                for (id, q) in d.0 {
                    p[id as usize] = q;
                }
                p
            });
            for (e, q) in expected.iter_mut().zip(p.iter()) {
                *e += q;
            }
            observed[g.output_ids[pos] as usize] += 1.0;
        }
    }
    (observed, expected, (proposed, accepted))
}

#[test]
fn speculative_sampling_follows_the_target_distribution() {
    let tw = random_model(Spec { seed: 31, ..TINY });
    let dw = random_model(Spec { seed: 32, ..TINY });
    let reference = ReferenceModel::new(&tw).unwrap();
    let mut target = load(&tw, 32, 4);
    let mut draft = load(&dw, 32, 4);
    let prompt = [3u32, 14, 15, 9];
    let (runs, new) = (320, 6);
    for (params, label) in [
        (SamplingParams { temperature: 1.0, top_k: 0, top_p: 1.0, seed: 0 }, "temperature 1 (logits)"),
        (SamplingParams { temperature: 0.8, top_k: 6, top_p: 0.95, seed: 0 }, "top-k 6, top-p 0.95 (GPU top-k)"),
    ] {
        let spec = Speculation { drafter: Drafter::Model, draft_tokens: Some(3), ..Default::default() };
        let (o, e, (proposed, accepted)) = sample_counts(&mut target, Some(&mut draft), &reference, &prompt, params, spec, runs, new);
        let (stat, df) = chi2(&o, &e);
        let bound = chi2_bound(df);
        eprintln!("{label}: draft model, k = 3: chi-square {stat:.1} on {df} df (bound {bound:.1}); {accepted}/{proposed} drafts accepted");
        assert!(accepted > 0 && accepted < proposed, "both branches of the rule ran: {accepted}/{proposed}");
        assert!(stat < bound, "{label}: speculative samples do not follow the target: chi-square {stat:.1} > {bound:.1}");

        // Lookup drafts (deterministic, q one-hot) follow it too.
        let lookup = Speculation { drafter: Drafter::Lookup, draft_tokens: Some(4), lookup_ngram: 1, ..Default::default() };
        let (o, e, (proposed, _)) = sample_counts(&mut target, None, &reference, &prompt, params, lookup, runs, new);
        let (stat, df) = chi2(&o, &e);
        eprintln!("{label}: lookup: chi-square {stat:.1} on {df} df (bound {:.1}); {proposed} drafts", chi2_bound(df));
        assert!(proposed > 0, "lookup proposed nothing");
        assert!(stat < chi2_bound(df), "{label}: lookup samples do not follow the target: {stat:.1}");
    }
    // The test can fail: samples of the draft model alone, scored against the target.
    let p = SamplingParams { temperature: 1.0, top_k: 0, top_p: 1.0, seed: 0 };
    let (o, e, _) = sample_counts(&mut draft, None, &reference, &prompt, p, Speculation::default(), runs, new);
    let (stat, df) = chi2(&o, &e);
    eprintln!("the draft's own samples against the target: chi-square {stat:.1} on {df} df");
    assert!(stat > chi2_bound(df), "the statistic does not tell the draft's distribution from the target's ({stat:.1})");
    assert_eq!(target.kv.alloc.free_pages(), target.kv.alloc.total_pages(), "target pages leaked");
    assert_eq!(draft.kv.alloc.free_pages(), draft.kv.alloc.total_pages(), "draft pages leaked");
}

#[test]
fn rejected_drafts_roll_back_and_long_greedy_generation_stays_exact() {
    let tw = random_model(Spec { seed: 41, vocab: 40, ..TINY });
    let dw = random_model(Spec { seed: 42, vocab: 40, ..TINY });
    let reference = ReferenceModel::new(&tw).unwrap();
    let (context, page) = (128, 4);
    let mut target = load(&tw, context, page);
    let mut draft = load(&dw, context, page);
    let prompt = [5u32, 6, 7, 8, 9, 10, 11];
    let n = 100;
    let want = reference.greedy(&prompt, n);
    let plain = pollster::block_on(generate(
        &mut target,
        &tokenizer(),
        &request(&prompt, n, SamplingParams::default(), Speculation::default()),
        |_| true,
    ))
    .unwrap();
    assert_eq!(plain.output_ids, want, "plain greedy against the reference");
    for spec in [
        Speculation { drafter: Drafter::Model, draft_tokens: Some(5), ..Default::default() },
        Speculation { drafter: Drafter::Model, ..Default::default() },
        Speculation { drafter: Drafter::Lookup, draft_tokens: Some(7), lookup_ngram: 2, ..Default::default() },
    ] {
        let g = pollster::block_on(generate_with(
            &mut target,
            Some(&mut draft),
            &tokenizer(),
            &request(&prompt, n, SamplingParams::default(), spec),
            |_| true,
        ))
        .unwrap();
        let s = g.speculative.clone().unwrap();
        eprintln!("{:?} k {:?}: {}/{} accepted over {} verify steps", s.drafter, spec.draft_tokens, s.accepted, s.proposed, s.steps);
        // (The adaptive k drafts as little as a poor draft deserves.)
        if spec.draft_tokens.is_some() {
            assert!(s.proposed - s.accepted >= 10, "the test needs many rejected drafts: {}/{}", s.accepted, s.proposed);
        }
        assert_eq!(g.output_ids, want, "{:?}: speculative greedy against the reference", s.drafter);
        assert_eq!(target.kv.alloc.free_pages(), target.kv.alloc.total_pages(), "target pages leaked");
        assert_eq!(draft.kv.alloc.free_pages(), draft.kv.alloc.total_pages(), "draft pages leaked");
    }

    // A verify step across page boundaries, rolled back: the sequence holds exactly the pages
    // a plain run of the kept length holds, and the freed pages are back on the free list.
    let seq = target.new_sequence().unwrap();
    pollster::block_on(target.forward(seq, &prompt, Want::Argmax)).unwrap();
    let free_before = target.kv.alloc.free_pages();
    pollster::block_on(target.forward_rows(seq, &[1, 2, 3, 4, 5, 6, 7, 8, 9], Want::Argmax)).unwrap();
    assert_eq!(target.kv.alloc.pages(seq).unwrap().len(), (prompt.len() + 9).div_ceil(page));
    target.truncate_sequence(seq, prompt.len() + 2).unwrap();
    assert_eq!(target.sequence_len(seq).unwrap(), prompt.len() + 2);
    assert_eq!(target.kv.alloc.pages(seq).unwrap().len(), (prompt.len() + 2).div_ceil(page));
    let plain_pages = (prompt.len() + 2).div_ceil(page) - prompt.len().div_ceil(page);
    assert_eq!(target.kv.alloc.free_pages(), free_before - plain_pages);
    target.release_sequence(seq);
}

#[test]
fn refusals_and_k_zero() {
    let tw = random_model(Spec { seed: 51, ..TINY });
    let mut target = load(&tw, 32, 4);
    let tok = tokenizer();
    let prompt = [1u32, 2, 3];
    // A draft-model request without a draft model.
    let err = pollster::block_on(generate(
        &mut target,
        &tok,
        &request(&prompt, 4, SamplingParams::default(), Speculation::draft_model()),
        |_| true,
    ))
    .unwrap_err();
    assert!(matches!(err, LanternError::InvalidRequest(_)) && err.to_string().contains("draft model"), "{err}");
    // k = 0: plain decoding, no speculative statistics.
    let zero = Speculation { draft_tokens: Some(0), ..Speculation::lookup() };
    let g = pollster::block_on(generate(&mut target, &tok, &request(&prompt, 6, SamplingParams::default(), zero), |_| true)).unwrap();
    assert!(g.speculative.is_none());
    let plain =
        pollster::block_on(generate(&mut target, &tok, &request(&prompt, 6, SamplingParams::default(), Speculation::default()), |_| true))
            .unwrap();
    assert_eq!(g.output_ids, plain.output_ids);
    // A draft with another vocabulary, named in the error with both sizes.
    let other = random_model(Spec { seed: 52, vocab: 30, ..TINY });
    let err = check_pair(("target.gguf", &tw.config, &tok), ("draft.gguf", &other.config, &tok)).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, LanternError::DraftMismatch { .. }), "{err:?}");
    assert!(msg.contains("target.gguf") && msg.contains("draft.gguf") && msg.contains("24") && msg.contains("30"), "{msg}");
}

/// Adaptive speculation decides from measured step costs: measured before the first draft
/// when unknown; dropped for the request (which then decodes ahead of the host, like a plain
/// one) where no k could pay even with every draft accepted; drafting where verify steps are
/// cheap. The tokens are the plain ones in every case.
#[test]
fn adaptive_speculation_follows_the_measured_step_costs() {
    let tw = random_model(Spec { seed: 61, ..TINY });
    let dw = random_model(Spec { seed: 62, ..TINY });
    let tok = tokenizer();
    let prompt: Vec<u32> = [1u32, 2, 3, 4, 5, 6].repeat(4);
    let n = 24;
    let mut plain_model = load(&tw, 128, 4);
    let plain = pollster::block_on(generate(
        &mut plain_model,
        &tok,
        &request(&prompt, n, SamplingParams::default(), Speculation::default()),
        |_| true,
    ))
    .unwrap();

    // Nothing measured: the widths are measured first, then kept on the model.
    let mut fresh = load(&tw, 128, 4);
    let mut draft = load(&dw, 128, 4);
    assert!(fresh.step_costs().iter().all(|c| c.is_none()));
    let g = pollster::block_on(generate_with(
        &mut fresh,
        Some(&mut draft),
        &tok,
        &request(&prompt, n, SamplingParams::default(), Speculation::draft_model()),
        |_| true,
    ))
    .unwrap();
    let s = g.speculative.unwrap();
    assert!(s.warmup_ms > 0.0, "{s:?}");
    for w in [1, 2, 4, 8] {
        assert!(fresh.step_costs().get(w).copied().flatten().is_some(), "width {w} not measured: {:?}", fresh.step_costs());
    }
    assert!(draft.step_costs().get(2).copied().flatten().is_some(), "the draft's two-token step: {:?}", draft.step_costs());
    assert_eq!(g.output_ids, plain.output_ids);
    assert!(s.plain_step_ms > 0.0 && s.measured_gain > 0.0 && s.expected_gain > 0.0, "{s:?}");

    // Every extra token in a step costs a full step: drafting cannot pay. The request says
    // why, decodes ahead of the host (no stall per token) and never runs the draft.
    let mut linear = load(&tw, 128, 4);
    for w in 1..=9 {
        linear.record_step_ms(w, 10.0 * w as f64);
    }
    let mut draft = load(&dw, 128, 4);
    for spec in [Speculation::draft_model(), Speculation { lookup_ngram: 2, ..Speculation::lookup() }] {
        let g = pollster::block_on(generate_with(
            &mut linear,
            Some(&mut draft),
            &tok,
            &request(&prompt, n, SamplingParams::default(), spec),
            |_| true,
        ))
        .unwrap();
        let s = g.speculative.unwrap();
        assert!(s.plain_reason.as_deref().is_some_and(|r| r.contains("cannot pay")), "{s:?}");
        assert_eq!((s.proposed, s.steps, s.warmup_ms), (0, 0, 0.0), "{s:?}");
        assert_eq!(s.plain_steps, n - 1);
        assert_eq!(g.output_ids, plain.output_ids, "{:?}", spec.drafter);
        let h = g.host.unwrap();
        assert!(h.stalls_per_token < 0.5, "not decoded ahead of the host: {h:?}");
    }
    assert_eq!(draft.step_costs().iter().flatten().count(), 0, "the draft model ran");

    // Verify steps cost what one token does: lookup drafts the repeating prompt's
    // continuation, expecting a gain.
    let mut flat = load(&tw, 128, 4);
    for w in 1..=9 {
        flat.record_step_ms(w, 10.0);
    }
    let spec = Speculation { lookup_ngram: 2, ..Speculation::lookup() };
    let g = pollster::block_on(generate(&mut flat, &tok, &request(&prompt, n, SamplingParams::default(), spec), |_| true)).unwrap();
    let s = g.speculative.unwrap();
    assert!(s.proposed > 0 && s.plain_reason.is_none(), "{s:?}");
    assert!(s.expected_gain > 1.0, "{s:?}");
    assert_eq!(g.output_ids, plain.output_ids);
}

#[test]
fn smollm2_lookup_gives_the_fixture_greedy_ids() {
    let l = lantern::model::load::load_path(&common::smollm2_gguf()).unwrap();
    let tok = l.tokenizer.as_ref().unwrap();
    let opts = ModelOptions { context: Some(256), ..Default::default() };
    let mut m = pollster::block_on(GpuModel::load(common::gpu(), &l.weights, opts)).unwrap();
    let cases = common::real::json("smollm2", "cases.json").as_array().unwrap().clone();
    // A fixed draft length: the adaptive one follows measured step times, and on a loaded
    // machine may stop drafting altogether (CI once drafted 8 tokens in six cases).
    let spec = Speculation { draft_tokens: Some(4), ..Speculation::lookup() };
    let stats = common::real::check_speculative_cases(&mut m, None, tok, &cases, spec).unwrap_or_else(|e| panic!("{e}"));
    assert!(stats.iter().any(|(_, s)| s.accepted > 0), "lookup never helped");
}

/// A Qwen fixture's cases: the three short ones, or all four with `LANTERN_SPEC_LONG=1` (the
/// 566-token prompt takes minutes on lavapipe).
fn qwen_cases(dir: &str) -> Vec<serde_json::Value> {
    let long = std::env::var_os("LANTERN_SPEC_LONG").is_some();
    let cases: Vec<_> = common::real::json(dir, "cases.json")
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| long || c["n_prompt_tokens"].as_u64().unwrap() <= 48)
        .cloned()
        .collect();
    assert_eq!(cases.len(), if long { 4 } else { 3 });
    cases
}

#[test]
fn qwen_0_5b_lookup_gives_the_fixture_greedy_ids() {
    let path = common::real::model("LANTERN_QWEN05_GGUF", "qwen2.5-coder-0.5b");
    let l = lantern::model::load::load_path(&path).unwrap();
    let tok = l.tokenizer.as_ref().unwrap();
    let opts = ModelOptions { context: Some(640), ..Default::default() };
    let mut m = pollster::block_on(GpuModel::load(common::gpu(), &l.weights, opts)).unwrap();
    // The short cases: the long one's 566-token prompt is checked plainly in tests/qwen_q4km.rs
    // and costs a minute here.
    let cases = qwen_cases("qwen2.5-coder-0.5b-q4km");
    common::real::check_speculative_cases(&mut m, None, tok, &cases, Speculation::lookup()).unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn qwen_1_5b_with_the_0_5b_drafting_gives_the_fixture_greedy_ids() {
    let target_path = common::real::model("LANTERN_QWEN15_GGUF", "qwen2.5-coder-1.5b");
    let draft_path = common::real::model("LANTERN_QWEN05_GGUF", "qwen2.5-coder-0.5b");
    let ctx = common::gpu();
    // The short cases (the long one's 566-token prompt takes minutes here; set
    // LANTERN_SPEC_LONG=1 to run it too).
    let long = std::env::var_os("LANTERN_SPEC_LONG").is_some();
    let opts = ModelOptions { context: Some(if long { 1024 } else { 128 }), max_seqs: 1, ..Default::default() };
    let (mut target, tok) =
        pollster::block_on(lantern::model::load::load_to_gpu(ctx.clone(), &target_path, opts.clone(), &mut |_, _| {})).unwrap();
    let tok = tok.unwrap();
    let (mut draft, dtok) = pollster::block_on(lantern::model::load::load_to_gpu(ctx, &draft_path, opts.clone(), &mut |_, _| {})).unwrap();
    check_pair(("1.5b", &target.config, &tok), ("0.5b", &draft.config, dtok.as_ref().unwrap())).expect("one tokenizer");
    let cases = qwen_cases("qwen2.5-coder-1.5b-q4km");
    // A fixed draft length (the adaptive one may stop drafting on a loaded machine).
    let spec = Speculation { draft_tokens: Some(4), ..Speculation::draft_model() };
    let stats = common::real::check_speculative_cases(&mut target, Some(&mut draft), &tok, &cases, spec).unwrap_or_else(|e| panic!("{e}"));
    let (p, a) = stats.iter().fold((0, 0), |(p, a), (_, s)| (p + s.proposed, a + s.accepted));
    eprintln!("0.5B drafting for 1.5B: {a}/{p} accepted");
    assert!(a * 2 > p, "the 0.5B should agree with the 1.5B on most tokens: {a}/{p}");
    // The draft requantized to 4 bits at load (`--draft-quant q4`): other drafts, the same
    // output (the first case, to keep CI short; every case with LANTERN_SPEC_LONG).
    drop(draft);
    let q4 = QuantizeOptions { embeddings: EmbeddingPolicy::Same, ..QuantizeOptions::new(QuantKind::Q4) };
    let (mut draft, _) =
        pollster::block_on(lantern::quant::quantize::load_to_gpu_requantized(common::gpu(), &draft_path, opts, &q4, &mut |_, _| {}))
            .unwrap();
    assert!(draft.memory().weights.keys().all(|k| k == "f32" || k.starts_with("q4g32")), "{:?}", draft.memory().weights.keys());
    let stats =
        common::real::check_speculative_cases(&mut target, Some(&mut draft), &tok, &cases[..if long { cases.len() } else { 1 }], spec)
            .unwrap_or_else(|e| panic!("{e}"));
    let (p, a) = stats.iter().fold((0, 0), |(p, a), (_, s)| (p + s.proposed, a + s.accepted));
    eprintln!("0.5B requantized to q4 drafting for 1.5B: {a}/{p} accepted");
    assert!(a * 2 > p, "the q4 0.5B should still agree with the 1.5B on most tokens: {a}/{p}");
    // SmolLM2 cannot draft for Qwen: another vocabulary.
    let s = lantern::model::load::load_path(&common::smollm2_gguf()).unwrap();
    let err = check_pair(("qwen", &target.config, &tok), ("smollm2", &s.weights.config, s.tokenizer.as_ref().unwrap())).unwrap_err();
    assert!(err.to_string().contains("151936") && err.to_string().contains("49152"), "{err}");
}

/// Drain a handle's events to its generation.
fn done(h: &mut lantern::engine::RequestHandle) -> lantern::engine::Generation {
    loop {
        match h.try_next() {
            Ok(Some(lantern::engine::Event::Done(g))) => return *g,
            Ok(Some(lantern::engine::Event::Error(e))) => panic!("request {} failed: {e}", h.id),
            Ok(Some(_)) => {}
            Ok(None) => panic!("request {} has no Done after the engine went idle", h.id),
            Err(()) => panic!("request {} ended without Done", h.id),
        }
    }
}

#[test]
fn engine_batches_speculative_and_plain_requests_and_each_gets_its_solo_output() {
    use lantern::engine::{Engine, EngineOptions};
    let tw = random_model(Spec { seed: 61, vocab: 40, ..TINY });
    let dw = random_model(Spec { seed: 62, vocab: 40, ..TINY });
    let opts = |max_seqs: usize, kv_pages: Option<usize>| ModelOptions {
        context: Some(96),
        max_seqs,
        page_size: 4,
        kv_pages,
        max_batch_tokens: 48,
        max_logit_rows: 24,
        batch_invariant: true,
        prefix_cache: false,
        ..Default::default()
    };
    let tok = tokenizer();
    let greedy = SamplingParams::default();
    let hot = SamplingParams { temperature: 1.0, top_k: 0, top_p: 1.0, seed: 5 };
    let warm = SamplingParams { temperature: 0.9, top_k: 8, top_p: 0.95, seed: 9 };
    let reqs: Vec<GenerateRequest> = vec![
        request(&[5, 6, 7, 8, 5, 6, 7], 30, greedy, Speculation::default()),
        request(&[9, 3, 9, 3, 9, 3, 1], 30, greedy, Speculation::lookup()),
        request(&[2, 4, 6, 8, 10], 30, greedy, Speculation::draft_model()),
        request(&[11, 12, 13], 24, hot, fixed(Drafter::Model, 3)),
        request(&[14, 15, 14, 15, 14], 24, warm, fixed(Drafter::Lookup, 2)),
        request(&[16, 17, 18, 19], 20, hot, Speculation::default()),
    ];
    // Alone, one at a time.
    let mut solo_t = up(&tw, opts(1, None));
    let mut solo_d = up(&dw, opts(1, None));
    let solo: Vec<Vec<u32>> = reqs
        .iter()
        .map(|r| pollster::block_on(generate_with(&mut solo_t, Some(&mut solo_d), &tok, r, |_| true)).unwrap().output_ids)
        .collect();
    // Sampled verification is drafter-invariant: each request's output, speculative or not,
    // is the plain output for its seed (greedy ones the plain greedy output).
    for (i, r) in reqs.iter().enumerate() {
        let plain = GenerateRequest { speculation: Speculation::default(), ..r.clone() };
        let p = pollster::block_on(generate_with(&mut solo_t, None, &tok, &plain, |_| true)).unwrap().output_ids;
        assert_eq!(solo[i], p, "request {i} ({:?}): speculative output differs from plain decoding with its seed", r.speculation.drafter);
    }
    // Together, with room for all, then with a KV pool that forces preemption.
    for kv_pages in [None, Some(30)] {
        let mut e =
            Engine::new(up(&tw, opts(6, kv_pages)), tok.clone(), EngineOptions { step_tokens: 48, prefill_chunk: 8, max_waiting: 16 });
        e.set_draft(up(&dw, opts(6, None)), &tok).unwrap();
        // As `serve` does: the adaptive k decides from measured step costs.
        assert!(pollster::block_on(e.measure_step_costs(&Speculation::draft_model())).unwrap() > 0.0);
        let mut handles: Vec<_> = reqs.iter().map(|r| e.submit(r.clone()).unwrap()).collect();
        pollster::block_on(e.run_until_idle()).unwrap();
        for (i, h) in handles.iter_mut().enumerate() {
            let g = done(h);
            assert_eq!(g.output_ids, solo[i], "request {i} (kv_pages {kv_pages:?}): batched output differs from its solo run");
            if reqs[i].speculation.enabled() {
                let s = g.speculative.expect("speculative stats");
                // A fixed draft length always drafts; an adaptive one drafts only where the
                // costs measured on this machine say it pays (on a loaded 2-core CI runner
                // they may not), so it is only reported.
                if reqs[i].speculation.draft_tokens.is_some() {
                    assert!(s.proposed > 0, "request {i} drafted nothing");
                }
                eprintln!("request {i}: {}/{} drafts accepted, {} plain steps", s.accepted, s.proposed, s.plain_steps);
            }
        }
        eprintln!("kv_pages {kv_pages:?}: {} steps, {} preemptions", e.stats().steps, e.stats().preemptions);
        if kv_pages.is_some() {
            assert!(e.stats().preemptions > 0, "the small pool should preempt");
        }
        let d = e.take_draft().unwrap();
        assert_eq!(d.kv.alloc.free_pages(), d.kv.alloc.total_pages(), "draft pages leaked");
        let m = e.into_model();
        assert_eq!(m.kv.alloc.free_pages(), m.kv.alloc.total_pages(), "target pages leaked");
    }
    // A draft-model request to an engine without a draft model is refused.
    let mut e = Engine::new(up(&tw, opts(2, None)), tok.clone(), EngineOptions::default());
    assert!(e.submit(reqs[2].clone()).is_err());
}

/// The scheduler budgets logit rows as well as tokens: four sequences verifying four drafts
/// each want 20 rows from a model with 7, so drafts are trimmed and decode tokens or a prompt's
/// last token wait a step, and every output is still its solo run's. (On a loaded CI runner
/// the adaptive k of the test above once asked for 25 rows of 24.)
#[test]
fn steps_never_ask_for_more_logit_rows_than_the_model_has() {
    use lantern::engine::{Engine, EngineOptions};
    let tw = random_model(Spec { seed: 63, vocab: 40, ..TINY });
    let opts = |max_seqs: usize| ModelOptions {
        context: Some(96),
        max_seqs,
        page_size: 4,
        max_batch_tokens: 48,
        max_logit_rows: 7,
        batch_invariant: true,
        prefix_cache: false,
        ..Default::default()
    };
    let tok = tokenizer();
    let greedy = SamplingParams::default();
    let hot = SamplingParams { temperature: 1.0, top_k: 0, top_p: 1.0, seed: 3 };
    let reqs: Vec<GenerateRequest> = vec![
        request(&[9, 3, 9, 3, 9, 3, 9], 28, greedy, fixed(Drafter::Lookup, 4)),
        request(&[5, 6, 5, 6, 5, 6, 5], 28, greedy, fixed(Drafter::Lookup, 4)),
        request(&[1, 2, 1, 2, 1, 2, 1, 2, 1], 28, hot, fixed(Drafter::Lookup, 4)),
        request(&[7, 8, 7, 8, 7], 28, greedy, fixed(Drafter::Lookup, 4)),
        request(&[10, 11, 12], 20, SamplingParams::default(), Speculation::default()),
    ];
    let mut solo_t = up(&tw, opts(1));
    let solo: Vec<Vec<u32>> =
        reqs.iter().map(|r| pollster::block_on(generate_with(&mut solo_t, None, &tok, r, |_| true)).unwrap().output_ids).collect();
    let mut e = Engine::new(up(&tw, opts(5)), tok, EngineOptions { step_tokens: 48, prefill_chunk: 8, max_waiting: 16 });
    let mut handles: Vec<_> = reqs.iter().map(|r| e.submit(r.clone()).unwrap()).collect();
    pollster::block_on(e.run_until_idle()).unwrap();
    let mut proposed = 0;
    for (i, h) in handles.iter_mut().enumerate() {
        let g = done(h);
        assert_eq!(g.output_ids, solo[i], "request {i}: batched output differs from its solo run");
        proposed += g.speculative.map_or(0, |s| s.proposed);
    }
    assert!(proposed > 0, "lookup drafted nothing");
    let m = e.into_model();
    assert_eq!(m.kv.alloc.free_pages(), m.kv.alloc.total_pages(), "pages leaked");
}

#[test]
fn window_rings_batch_speculative_plain_and_parallel_requests_like_full_pages() {
    // Gemma-style blocks (a sliding layer with a 5-key window): with steps of up to 8 tokens
    // and pages of 4, each sequence's ring holds 12 tokens and wraps several times over these
    // requests, through verify steps rolled back, forks of n = 3 and preemption. Every
    // output must equal the same engine's with every layer keeping every token (the draft
    // lengths are fixed, so both engines schedule the same steps and even the sampled
    // outputs agree).
    use lantern::engine::{Engine, EngineOptions};
    use lantern::model::forward::KvWindow;
    let tw = random_model(Spec { seed: 71, vocab: 40, gemma: true, ..TINY });
    let dw = random_model(Spec { seed: 72, vocab: 40, gemma: true, ..TINY });
    let opts = |kv_window: KvWindow, kv_pages: Option<usize>| ModelOptions {
        context: Some(96),
        max_seqs: 6,
        page_size: 4,
        kv_pages,
        max_batch_tokens: 8,
        max_logit_rows: 8,
        batch_invariant: true,
        kv_window,
        // Full pages would reuse the n = 3 prompt's pages; rings cannot.
        prefix_cache: false,
        ..Default::default()
    };
    let tok = tokenizer();
    let greedy = SamplingParams::default();
    let hot = SamplingParams { temperature: 1.0, top_k: 0, top_p: 1.0, seed: 5 };
    let reqs: Vec<GenerateRequest> = vec![
        request(&[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], 40, greedy, Speculation::default()),
        request(&[9, 3, 9, 3, 9, 3, 1], 40, greedy, fixed(Drafter::Lookup, 4)),
        request(&[2, 4, 6, 8, 10, 12, 14, 16, 18], 40, greedy, fixed(Drafter::Model, 5)),
        request(&[11, 12, 13], 30, hot, fixed(Drafter::Model, 3)),
    ];
    let mut outputs = Vec::new();
    for (kv_window, kv_pages) in [(KvWindow::Full, None), (KvWindow::Ring, None), (KvWindow::Full, Some(20)), (KvWindow::Ring, Some(20))] {
        let target = up(&tw, opts(kv_window, kv_pages));
        assert_eq!(target.memory().kv_window_ring.map(|r| r.tokens()), (kv_window == KvWindow::Ring).then_some(12));
        let mut e = Engine::new(target, tok.clone(), EngineOptions { step_tokens: 8, prefill_chunk: 8, max_waiting: 16 });
        e.set_draft(up(&dw, opts(kv_window, None)), &tok).unwrap();
        let mut handles: Vec<_> = reqs.iter().map(|r| e.submit(r.clone()).unwrap()).collect();
        handles.extend(e.submit_n(request(&[1, 2, 3, 1, 2, 3, 1, 2], 30, hot, Speculation::default()), 3).unwrap());
        pollster::block_on(e.run_until_idle()).unwrap();
        let out: Vec<Vec<u32>> = handles.iter_mut().map(|h| done(h).output_ids).collect();
        if kv_pages.is_some() {
            assert!(e.stats().preemptions > 0, "the small pool should preempt");
        }
        let d = e.take_draft().unwrap();
        assert_eq!(d.kv.alloc.free_pages(), d.kv.alloc.total_pages(), "draft pages leaked");
        let m = e.into_model();
        assert_eq!(m.kv.alloc.free_pages(), m.kv.alloc.total_pages(), "target pages leaked");
        outputs.push((kv_window, kv_pages, out));
    }
    assert!(outputs[0].2.iter().all(|o| o.len() >= 20), "outputs too short to wrap the rings: {:?}", outputs[0].2);
    for pair in outputs.chunks(2) {
        let ((_, kv_pages, full), (_, _, ring)) = (&pair[0], &pair[1]);
        for (i, (a, b)) in ring.iter().zip(full).enumerate() {
            assert_eq!(a, b, "request {i} (kv_pages {kv_pages:?}): rings and full pages give different outputs");
        }
    }
}

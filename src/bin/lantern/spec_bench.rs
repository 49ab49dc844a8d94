//! `lantern bench --draft M` / `--lookup`: what speculative decoding buys on this adapter.
//!
//! 1. The cost of a target step by width (1 token, then 1 + k tokens as a verify step
//!    carries), median of several, against the single-token step measured in the same run:
//!    where the batched kernels keep their advantage, and so which k can pay. The models
//!    keep these costs (`GpuModel::record_step_ms`), so the adaptive k starts from them as
//!    it would on a server that has already served requests, instead of trying wider steps
//!    in the first prompt to learn what they cost.
//! 2. Greedy generations of real prompts (code completion for a draft model, a code rewrite
//!    for lookup; or `--prompt`), plain and speculative, in the same run: decode tokens/s,
//!    speedup, acceptance rate, and whether the ids are identical (they must be).
//! 3. With `--k-sweep`, the same for each fixed k, beside the adaptive choice.

use std::sync::Arc;

use anyhow::{bail, Context, Result};

use lantern::engine::generate::{generate_with, GenerateRequest, Generation};
use lantern::engine::speculative::{Drafter, Speculation};
use lantern::engine::SamplingParams;
use lantern::model::forward::{GpuModel, ModelOptions, Want};
use lantern::model::tokenizer::{ChatMessage, Tokenizer};

use super::bench_cmd::BenchArgs;
use super::spinner;

/// Code-completion prompts: a draft model of the same family guesses most of the tokens.
const COMPLETION: &[&str] = &[
    "Write a Python function `is_prime(n)` that returns whether n is prime, with a docstring.",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Write a JavaScript function that debounces another function by a given number of milliseconds.",
];

/// A code-rewrite prompt: the answer quotes most of the prompt (prompt lookup's case).
const REWRITE: &str = "Rewrite this function to use type hints and a docstring, keeping the logic the same:\n\n```python\ndef merge_sorted(left, right):\n    result = []\n    i = 0\n    j = 0\n    while i < len(left) and j < len(right):\n        if left[i] <= right[j]:\n            result.append(left[i])\n            i += 1\n        else:\n            result.append(right[j])\n            j += 1\n    result.extend(left[i:])\n    result.extend(right[j:])\n    return result\n```";

/// A prompt whose answer repeats little of itself: prompt lookup finds little to draft.
const STORY: &str = "Tell me a short story about a lighthouse keeper and a storm.";

fn median(v: Vec<f64>) -> f64 {
    lantern::engine::metrics::percentile(&v, 50.0).unwrap_or(0.0)
}

fn generate_once(
    target: &mut GpuModel,
    draft: Option<&mut GpuModel>,
    tokenizer: &Tokenizer,
    prompt_ids: &[u32],
    max_tokens: usize,
    speculation: Speculation,
) -> Result<Generation> {
    let req = GenerateRequest {
        prompt_ids: prompt_ids.to_vec(),
        max_tokens,
        sampling: SamplingParams::default(),
        // Exactly max_tokens (EOS ignored), so plain and speculative runs time the same tokens.
        stop_ids: vec![],
        stop_strings: vec![],
        speculation,
        constraint: None,
        logprobs: None,
        bias: Default::default(),
    };
    Ok(pollster::block_on(generate_with(target, draft, tokenizer, &req, |_| true))?)
}

pub fn run(a: &BenchArgs) -> Result<()> {
    let spec = a.spec.speculation();
    let model_path = lantern::fetch::resolve_model(a.model.as_deref(), true)?;
    let pb = spinner(&format!("loading {}", model_path.display()), false);
    let ctx = a.device.open()?;
    let max_tokens = a.output_len.parse::<usize>().context("--output-len must be one number with --draft/--lookup")?;
    let options = ModelOptions {
        context: Some(a.context.unwrap_or(1024)),
        max_seqs: 2,
        kv_dtype: a.kv_dtype.dtype(),
        eight_token_matvec: a.no_eight_token_matvec.then_some(false),
        batch_max_tokens: a.batch_max_tokens,
        ..Default::default()
    };
    let (mut target, tokenizer) =
        pollster::block_on(lantern::model::load::load_to_gpu(ctx.clone(), &model_path, options.clone(), &mut |_, _| {}))
            .with_context(|| format!("loading {}", model_path.display()))?;
    let tokenizer = Arc::new(tokenizer.with_context(|| format!("{} has no tokenizer", model_path.display()))?);
    pb.set_message("loading the draft model");
    let mut draft = pollster::block_on(a.spec.load_draft(ctx.clone(), &model_path, &target, &tokenizer, options))?.map(|d| d.0);
    pb.set_message("warming up");
    pollster::block_on(target.warm_up())?;
    if let Some(d) = draft.as_mut() {
        pollster::block_on(d.warm_up())?;
    }
    pb.finish_and_clear();
    println!(
        "{} on {} | speculative decoding with {} | greedy, {} new tokens per prompt",
        model_path.display(),
        ctx.info.name,
        match (&a.spec.draft, spec.drafter) {
            (Some(d), _) => match a.spec.draft_quant.unwrap_or_default() {
                super::spec_args::DraftQuant::Native => format!("draft model {}", d.display()),
                q => format!("draft model {} (requantized to {} at load)", d.display(), q.name()),
            },
            (None, Drafter::Lookup) => format!("prompt lookup (n-grams up to {})", spec.lookup_ngram),
            _ => bail!("bench with speculation needs --draft or --lookup"),
        },
        max_tokens
    );

    // 1. Step cost by width.
    let widths: Vec<usize> =
        [1usize, 2, 3, 4, 5, 8, 9, 16].into_iter().filter(|&w| w <= target.options.max_batch_tokens.min(target.logit_rows)).collect();
    let prefix = 64;
    // Repetitions per width (LANTERN_BENCH_REPS; 3 by default, the table is noisy on shared
    // machines: 9 gives a steadier one).
    let reps = std::env::var("LANTERN_BENCH_REPS").ok().and_then(|v| v.parse().ok()).unwrap_or(3);
    // One scratch sequence for every width (one prefill, one untimed step per kernel shape).
    let bar = spinner(&format!("step cost by width ({} widths)", widths.len()), false);
    let ms = pollster::block_on(target.measure_step_costs(prefix, &widths, reps))?;
    bar.finish_and_clear();
    let cost: Vec<(usize, f64)> = widths.iter().copied().zip(ms).collect();
    let base = cost[0].1;
    println!("\ntarget step cost by width (tokens in the step, after {prefix} cached; median of {reps}; against the 1-token step):");
    println!("  {:>5} {:>9} {:>9} {:>12}", "width", "ms", "x 1-tok", "ms / token");
    for &(w, ms) in &cost {
        println!("  {:>5} {:>9.1} {:>9.2} {:>12.1}", w, ms, ms / base, ms / w as f64);
    }
    if a.profile {
        // Where a verify step's time goes: each dispatch kind's milliseconds (one submission
        // and wait per dispatch, so the sum exceeds a real step's time).
        let seq = target.new_sequence()?;
        let ids: Vec<u32> = (0..prefix as u32).map(|i| 100 + i % 1000).collect();
        pollster::block_on(target.forward(seq, &ids, Want::Argmax))?;
        // (width, per dispatch kind: label, milliseconds, dispatches)
        type Profile = Vec<(String, f64, usize)>;
        let mut cols: Vec<(usize, Profile)> = Vec::new();
        let most = target.options.max_batch_tokens;
        for w in [1usize, 2, 3, 4, 5, 8].into_iter().filter(|&w| w <= most) {
            let step: Vec<u32> = (0..w as u32).map(|i| 200 + i).collect();
            let _ = target.profile_step(seq, &step)?;
            target.truncate_sequence(seq, prefix)?;
            let p = target.profile_step(seq, &step)?;
            target.truncate_sequence(seq, prefix)?;
            cols.push((w, p));
        }
        target.release_sequence(seq);
        println!("\nper-dispatch milliseconds by step width (profiled one dispatch at a time):");
        print!("  {:<58}", "dispatch");
        for (w, _) in &cols {
            print!(" {:>8}", format!("w={w}"));
        }
        println!();
        let mut keys: Vec<String> = Vec::new();
        for (_, p) in &cols {
            for (k, _, _) in p {
                if !keys.contains(k) {
                    keys.push(k.clone());
                }
            }
        }
        for k in keys.iter().chain(std::iter::once(&"total".to_string())) {
            let short: String = k.chars().take(58).collect();
            print!("  {short:<58}");
            for (_, p) in &cols {
                let ms: f64 = if k == "total" { p.iter().map(|e| e.1).sum() } else { p.iter().filter(|e| &e.0 == k).map(|e| e.1).sum() };
                print!(" {:>8.1}", ms);
            }
            println!();
        }
    }
    if let Some(d) = draft.as_mut() {
        let dm = pollster::block_on(d.measure_step_costs(prefix, &[1, 2], reps))?[0];
        println!("  draft model 1-token step: {dm:.1} ms ({:.2}x the target's)", dm / base);
    }

    // 2. Prompts, plain against speculative.
    let chat = |text: &str| -> Result<Vec<u32>> {
        let tmpl = tokenizer.chat_template()?;
        let rendered = tmpl.render(&[ChatMessage::user(text.to_string())], true)?;
        Ok(tokenizer.encode_chat(&rendered)?)
    };
    let prompts: Vec<(String, Vec<u32>)> = if !a.prompt.is_empty() {
        a.prompt.iter().map(|p| Ok((p.clone(), chat(p)?))).collect::<Result<_>>()?
    } else if spec.drafter == Drafter::Lookup {
        // Where lookup pays, and where it finds nothing to draft (it must cost nothing there).
        vec![("code rewrite".to_string(), chat(REWRITE)?), ("a story (nothing to look up)".to_string(), chat(STORY)?)]
    } else {
        COMPLETION.iter().map(|p| Ok((p.to_string(), chat(p)?))).collect::<Result<_>>()?
    };
    // Fixed draft lengths first, then the adaptive choice: it starts from the step costs the
    // earlier runs measured (as it would in a running server) and learns the acceptance rate.
    let mut settings: Vec<(String, Speculation)> =
        a.k_sweep.iter().map(|&k| (format!("k={k}"), Speculation { draft_tokens: Some(k), ..spec })).collect();
    match spec.draft_tokens {
        Some(k) => settings.push((format!("k={k}"), spec)),
        None => settings.push(("adaptive".to_string(), Speculation { draft_tokens: None, ..spec })),
    }
    let rounds = a.rounds.max(1);
    println!(
        "\ngreedy generations, plain against speculative (decode tokens/s = 1 / TPOT{}):",
        if rounds > 1 { format!("; medians of {rounds} rounds, each running plain then every setting") } else { String::new() }
    );
    println!(
        "  {:<34} {:>9} {:>9} {:>8} {:>8} {:>11} {:>9} {:>10}",
        "prompt", "setting", "tok/s", "speedup", "accept", "tok/step", "mean k", "identical"
    );
    // Per setting, each prompt's median speedup (the mean over prompts is reported last).
    let mut speedups: Vec<Vec<f64>> = vec![Vec::new(); settings.len()];
    for (label, ids) in &prompts {
        let mut plain_tps = Vec::with_capacity(rounds);
        // Per setting: (tok/s, speedup against the same round's plain run, stats) per round.
        let mut runs: Vec<Vec<(f64, f64, lantern::engine::SpecStats)>> = vec![Vec::new(); settings.len()];
        for _ in 0..rounds {
            let plain = generate_once(&mut target, None, &tokenizer, ids, max_tokens, Speculation::default())?;
            let p_tps = plain.timings.metrics().tokens_per_s.unwrap_or(0.0);
            plain_tps.push(p_tps);
            for (si, (name, s)) in settings.iter().enumerate() {
                let g = generate_once(&mut target, draft.as_mut(), &tokenizer, ids, max_tokens, *s)?;
                if g.output_ids != plain.output_ids {
                    bail!("speculative greedy output differs from plain decoding for {label:?} ({name}): a bug");
                }
                let tps = g.timings.metrics().tokens_per_s.unwrap_or(0.0);
                runs[si].push((tps, tps / p_tps.max(1e-9), g.speculative.clone().unwrap_or_default()));
            }
        }
        let short: String = label.chars().take(34).collect();
        println!(
            "  {:<34} {:>9} {:>9.2} {:>8} {:>8} {:>11} {:>9} {:>10}",
            short,
            "plain",
            median(plain_tps),
            "1.00",
            "-",
            "1.00",
            "-",
            "-"
        );
        for (si, (name, _)) in settings.iter().enumerate() {
            let r = &runs[si];
            let sp = &r[r.len() / 2].2;
            let mean_k = if sp.steps > 0 { sp.proposed as f64 / sp.steps as f64 } else { 0.0 };
            let speedup = median(r.iter().map(|x| x.1).collect());
            speedups[si].push(speedup);
            let spread = if rounds > 1 {
                let lo = r.iter().map(|x| x.1).fold(f64::INFINITY, f64::min);
                let hi = r.iter().map(|x| x.1).fold(0.0, f64::max);
                format!(" (rounds {lo:.2}-{hi:.2})")
            } else {
                String::new()
            };
            println!(
                "  {:<34} {:>9} {:>9.2} {:>8.2} {:>7.0}% {:>11.2} {:>9.1} {:>10}{spread}",
                "",
                name,
                median(r.iter().map(|x| x.0).collect()),
                speedup,
                sp.acceptance_rate * 100.0,
                sp.tokens_per_step,
                mean_k,
                "yes"
            );
        }
    }
    println!("\nmean speedup over the prompts (each prompt's median):");
    for ((name, _), s) in settings.iter().zip(&speedups) {
        println!("  {name:>9}: {:.2}x", s.iter().sum::<f64>() / s.len().max(1) as f64);
    }
    Ok(())
}

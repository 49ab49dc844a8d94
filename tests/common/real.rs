//! Checks of a real model against its transformers fixture folder (the `cases.json` /
//! `tokenize.json` / `perplexity.json` layout of `tests/fixtures/smollm2` and the Qwen and
//! Gemma sets): tokenizer ids, prompt argmax, last-position top-20 logits and greedy
//! continuations through the paged cache.

use lantern::engine::sampler::argmax;
use lantern::eval::{perplexity, Window};
use lantern::model::forward::{GpuModel, Want};
use lantern::model::load::load_path;
use lantern::model::tokenizer::Tokenizer;
use std::path::{Path, PathBuf};

/// A vendored fixture folder, `tests/fixtures/NAME`.
pub fn fixtures(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

/// A catalogue model file (`lantern fetch NAME`), or the path in `$var`.
pub fn model(var: &str, name: &str) -> PathBuf {
    let path = std::env::var_os(var)
        .map(PathBuf::from)
        .unwrap_or_else(|| lantern::fetch::model_path(lantern::fetch::find_model(name).expect("catalogue entry")));
    assert!(path.is_file(), "{} not found: run `lantern fetch {name}` (the README's test command does) or set {var}", path.display());
    path
}

/// A JSON file of a vendored fixture folder.
pub fn json(dir: &str, file: &str) -> serde_json::Value {
    super::read_json(&fixtures(dir).join(file))
}

/// GPU weight bytes by dtype against the file's, and no float copy of a quantized tensor.
pub fn check_memory(path: &Path, model: &GpuModel) {
    let l = load_path(path).unwrap();
    let file_quant: u64 = l.weights.tensors.values().filter(|t| t.dtype.quant_kind().is_some()).map(|t| t.data.len() as u64).sum();
    let file_f32: u64 = l.weights.tensors.values().filter(|t| t.dtype.quant_kind().is_none()).map(|t| t.data.len() as u64).sum();
    let m = model.memory();
    let gpu_quant: u64 = m.weights.iter().filter(|(k, _)| k.as_str() != "f32").map(|(_, w)| w.bytes + w.scale_bytes).sum();
    let ratio = gpu_quant as f64 / file_quant as f64;
    eprintln!(
        "{}: quantized weights {gpu_quant} bytes on the GPU for {file_quant} in the file ({:+.3}%); by dtype {:?}",
        path.display(),
        100.0 * (ratio - 1.0),
        m.weights.keys()
    );
    assert!((ratio - 1.0).abs() <= 0.02, "GPU weight bytes {gpu_quant} vs file {file_quant}");
    // With the padding of tiled textures (CPU adapters with 8-lane subgroups) too.
    let padding: u64 = m.weights.values().map(|w| w.padding).sum();
    let with_padding = (gpu_quant + padding) as f64 / file_quant as f64;
    eprintln!("  tiled-texture padding {padding} bytes ({:+.3}% with it)", 100.0 * (with_padding - 1.0));
    assert!(with_padding - 1.0 <= 0.02, "GPU weight bytes {gpu_quant} + padding {padding} vs file {file_quant}");
    // f32 norms and biases only: an f32 copy of any matrix would add its size here.
    assert!(
        m.weights.get("f32").map_or(0, |w| w.bytes) <= file_f32,
        "f32 weights {:?} beyond the file's f32 tensors ({file_f32})",
        m.weights.get("f32")
    );
    assert!(!m.weights.contains_key("f16"));
    assert!(m.tiled_weights == 0 || model.ctx.caps.cpu_like, "tiled texture weights on CPU adapters only");
}

/// Last-position top-20 logits bound (the fixtures' "about 1e-3 absolute").
pub const TOP20_TOL: f32 = 1e-3;

/// What one case measured.
#[derive(Debug, Default)]
pub struct CaseReport {
    pub name: String,
    pub prompt_tokens: usize,
    pub greedy_checked: usize,
    /// Largest |logit - reference| over the last position's top 20.
    pub top20_diff: f32,
}

/// The indices of `near_ties` entries at `where_` (margins under 1e-3 that may flip).
fn near_ties(case: &serde_json::Value, where_: &str) -> Vec<usize> {
    case["near_ties"]
        .as_array()
        .map(|v| v.iter().filter(|t| t["where"].as_str() == Some(where_)).filter_map(|t| t["index"].as_u64().map(|i| i as usize)).collect())
        .unwrap_or_default()
}

/// Runs every case: the tokenizer reproduces `input_ids` from `prompt_text`; one prompt pass
/// with every position's logits gives `prompt_argmax` (near ties excepted) and the last
/// position's top-20 within [`TOP20_TOL`]; then greedy decoding through the KV cache, one
/// token per step, gives `greedy_ids` (the first `max_greedy` of them when given, and only up
/// to a near-tie step). Returns each case's report, or every failure.
pub fn check_cases(
    model: &mut GpuModel,
    tokenizer: &Tokenizer,
    cases: &[serde_json::Value],
    max_greedy: Option<usize>,
) -> Result<Vec<CaseReport>, String> {
    let vocab = model.config.vocab_size;
    let mut failures = Vec::new();
    let mut reports = Vec::new();
    for case in cases {
        let name = case["name"].as_str().unwrap().to_string();
        let prompt = super::ids(&case["input_ids"]);
        let text = case["prompt_text"].as_str().unwrap();
        let ids = if case["chat"].as_bool().unwrap() { tokenizer.encode_chat(text) } else { tokenizer.encode(text) };
        if ids.as_ref().ok() != Some(&prompt) {
            failures.push(format!("{name}: tokenizer ids differ"));
        }
        let mut greedy = super::ids(&case["greedy_ids"]);
        if let Some(&first_tie) = near_ties(case, "greedy_step").iter().min() {
            greedy.truncate(first_tie);
        }
        if let Some(n) = max_greedy {
            greedy.truncate(n);
        }
        let seq = model.new_sequence().unwrap();
        let logits = pollster::block_on(model.forward_all_logits(seq, &prompt)).expect("forward");
        let l = prompt.len();
        let am: Vec<u32> = logits.chunks_exact(vocab).map(argmax).collect();
        let want_prompt = super::ids(&case["prompt_argmax"]);
        let ties = near_ties(case, "prompt_argmax");
        if let Some(i) = (0..l).find(|&i| am[i] != want_prompt[i] && !ties.contains(&i)) {
            failures.push(format!("{name}: prompt argmax differs first at position {i}: {} vs {}", am[i], want_prompt[i]));
        }
        let mut out = vec![am[l - 1]];
        while out.len() < greedy.len() {
            let t = *out.last().unwrap();
            out.push(pollster::block_on(model.forward(seq, &[t], Want::Argmax)).expect("decode").argmax[0]);
        }
        out.truncate(greedy.len());
        model.release_sequence(seq);
        if out != greedy {
            let i = (0..greedy.len()).find(|&i| out[i] != greedy[i]).unwrap();
            failures.push(format!("{name}: greedy token {i} differs: {} vs {}", out[i], greedy[i]));
        }
        let last = &logits[(l - 1) * vocab..l * vocab];
        let mut worst = 0.0f32;
        for pair in case["last_top20"].as_array().unwrap() {
            let id = pair[0].as_u64().unwrap() as usize;
            let want = pair[1].as_f64().unwrap() as f32;
            worst = worst.max((last[id] - want).abs());
        }
        if worst > TOP20_TOL || worst.is_nan() {
            failures.push(format!("{name}: last-position top-20 logits differ by {worst:e} > {TOP20_TOL:e}"));
        }
        eprintln!("{name}: {l} prompt + {} greedy tokens, top-20 max |diff| {worst:e}", greedy.len());
        reports.push(CaseReport { name, prompt_tokens: l, greedy_checked: greedy.len(), top20_diff: worst });
    }
    if failures.is_empty() {
        Ok(reports)
    } else {
        Err(failures.join("\n"))
    }
}

/// The tokenizer against `tokenize.json`: ids with and without special tokens, and decoding.
pub fn check_tokenize(tokenizer: &Tokenizer, fx: &serde_json::Value) {
    let cases = fx["cases"].as_array().expect("tokenize cases");
    assert!(!cases.is_empty());
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let text = case["text"].as_str().unwrap();
        let want = super::ids(&case["ids"]);
        assert_eq!(tokenizer.encode(text).unwrap(), want, "case {name}: ids");
        assert_eq!(tokenizer.encode_with(text, false).unwrap(), super::ids(&case["ids_add_special_tokens_false"]), "case {name}");
        assert_eq!(tokenizer.decode(&want).unwrap(), case["decoded"].as_str().unwrap(), "case {name}: decode");
    }
}

/// Perplexity of `text` against `perplexity.json` (same ids, one window): returns (ours,
/// the reference's, relative difference).
pub fn check_perplexity(model: &mut GpuModel, tokenizer: &Tokenizer, text: &str, fx: &serde_json::Value) -> (f64, f64, f64) {
    let ids = tokenizer.encode(text).unwrap();
    assert_eq!(ids, super::ids(&fx["input_ids"]), "token ids of perplexity.txt");
    let rep = pollster::block_on(perplexity(model, &ids, Window::Auto, |_| {})).unwrap();
    assert_eq!(rep.predicted_tokens, fx["predicted_tokens"].as_u64().unwrap() as usize);
    let want = fx["perplexity"].as_f64().unwrap();
    let rel = (rep.perplexity - want).abs() / want;
    eprintln!(
        "perplexity {:.4} (transformers {want:.4}, rel diff {rel:.2e}), {} tokens at {:.1} tokens/s",
        rep.perplexity, rep.tokens_evaluated, rep.tokens_per_s
    );
    (rep.perplexity, want, rel)
}

/// Greedy generation of every case with `speculation` (and `draft` for a draft model) gives
/// the fixture's `greedy_ids` (up to the first near tie): the same ids as plain decoding.
/// Returns the speculative statistics per case, or every failure.
pub fn check_speculative_cases(
    model: &mut GpuModel,
    mut draft: Option<&mut GpuModel>,
    tokenizer: &Tokenizer,
    cases: &[serde_json::Value],
    speculation: lantern::engine::Speculation,
) -> Result<Vec<(String, lantern::engine::SpecStats)>, String> {
    let mut failures = Vec::new();
    let mut out = Vec::new();
    for case in cases {
        let name = case["name"].as_str().unwrap().to_string();
        let prompt = super::ids(&case["input_ids"]);
        let mut greedy = super::ids(&case["greedy_ids"]);
        if let Some(&first_tie) = near_ties(case, "greedy_step").iter().min() {
            greedy.truncate(first_tie);
        }
        let req = lantern::engine::GenerateRequest {
            prompt_ids: prompt,
            max_tokens: greedy.len(),
            sampling: Default::default(),
            stop_ids: vec![],
            stop_strings: vec![],
            speculation,
            constraint: None,
            logprobs: None,
            bias: Default::default(),
        };
        let g = pollster::block_on(lantern::engine::generate::generate_with(model, draft.as_deref_mut(), tokenizer, &req, |_| true))
            .map_err(|e| format!("{name}: {e}"))?;
        let stats = g.speculative.clone().unwrap_or_default();
        if g.output_ids != greedy {
            let i = (0..greedy.len()).find(|&i| g.output_ids.get(i) != Some(&greedy[i])).unwrap_or(0);
            failures.push(format!("{name}: speculative greedy token {i} differs: {:?} vs {}", g.output_ids.get(i), greedy[i]));
        }
        eprintln!(
            "{name}: {} tokens, {:?}: {} drafted, {} accepted, {:.2} tokens per target step",
            greedy.len(),
            stats.drafter,
            stats.proposed,
            stats.accepted,
            stats.tokens_per_step
        );
        out.push((name, stats));
    }
    if failures.is_empty() {
        Ok(out)
    } else {
        Err(failures.join("\n"))
    }
}

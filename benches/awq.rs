//! AWQ CPU bench (plain main, `harness = false`): `cargo bench --bench awq`.
//!
//! On SmolLM2-135M (`LANTERN_SMOLLM2_GGUF` or the default model path; skipped when it is not
//! on disk): the calibration forward (`awq::capture`, 256 tokens, 32 sampled, as `lantern
//! quantize --awq` runs by default) and the alpha search of layer 0 (all four sites, the
//! default 11-point grid, q4sym g32), as medians of `BENCH_REPS` (default 3) runs on all
//! cores.

use std::time::Instant;

use lantern::quant::awq::{self, AwqOptions, FloatWeights, Site};
use lantern::quant::{QuantFormat, QuantKind};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// Median seconds of `f` over `reps` runs (one warm-up run first).
fn time(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    median(
        (0..reps)
            .map(|_| {
                let t = Instant::now();
                f();
                t.elapsed().as_secs_f64()
            })
            .collect(),
    )
}

fn reps() -> usize {
    std::env::var("BENCH_REPS").ok().and_then(|s| s.parse().ok()).unwrap_or(3).max(1)
}

fn smollm2() {
    let path = std::env::var_os("LANTERN_SMOLLM2_GGUF").map(std::path::PathBuf::from).unwrap_or_else(lantern::fetch::default_model_path);
    if !path.exists() {
        println!("SmolLM2 calibration: skipped ({} not on disk; run `lantern fetch`)", path.display());
        return;
    }
    let loaded = lantern::model::load::load_path(&path).expect("load SmolLM2");
    let c = &loaded.weights.config;
    let floats: FloatWeights = loaded.weights.tensors.iter().map(|(n, t)| (n.clone(), t.to_f32())).collect();
    let text =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/smollm2/perplexity.txt")).expect("fixture text");
    let tok = loaded.tokenizer.as_ref().expect("tokenizer");
    let ids = tok.encode(&text).expect("encode");
    let opts = AwqOptions::default();
    let tokens = &ids[..opts.max_tokens.min(ids.len())];
    let reps = reps();
    let mut stats = Vec::new();
    let cal = time(reps, || {
        stats = awq::capture(c, &floats, tokens, opts.sample_tokens, &mut |_, _| {}).expect("capture");
    });
    println!("SmolLM2 calibration forward, {} tokens ({} sampled): {:.3} s", tokens.len(), opts.sample_tokens, cal);
    let format = QuantFormat::new(QuantKind::Q4Sym, 32);
    let alphas = opts.alphas();
    let search = time(reps, || {
        for site in Site::ALL {
            let names = site.weights(0);
            let ws: Vec<&[f32]> = names.iter().map(|n| floats[n].as_slice()).collect();
            awq::search_site(c, site, &names, &ws, stats[0].get(site), format, &alphas).expect("search");
        }
    });
    println!("SmolLM2 alpha search, layer 0 (4 sites, {} alphas, {format}): {:.3} s", alphas.len(), search);
}

fn main() {
    smollm2();
}

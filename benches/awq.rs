//! AWQ CPU bench (plain main, `harness = false`): `cargo bench --bench awq`.
//!
//! First the kernels of `lantern::quant::awq::kernels`, portable against hand-written AVX,
//! one thread, on SmolLM2-135M's shapes: the calibration forward's products (256 tokens
//! against q/o `576x576`, k/v `192x576`, gate/up `1536x576`, down `576x1536`) and the search's
//! error sums (32 sampled tokens against a whole matrix in the 16-row blocks `output_error`
//! uses); medians of 21 runs, the ratio, and whether both gave the same bits.
//!
//! Then, on SmolLM2-135M itself (`LANTERN_SMOLLM2_GGUF` or the default model path; skipped
//! when it is not on disk): the calibration forward (`awq::capture`, 256 tokens, 32 sampled,
//! as `lantern quantize --awq` runs by default) and the alpha search of layer 0 (all four
//! sites, the default 11-point grid, q4sym g32), as medians of `BENCH_REPS` (default 3) runs
//! on all cores.

use std::time::Instant;

use std::hint::black_box;

use lantern::quant::awq::kernels::Kernels;
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

fn data(n: usize, seed: usize) -> Vec<f32> {
    (0..n).map(|i| (((i * 7919 + seed * 104729) % 2001) as f32 / 1000.0 - 1.0) * 0.5).collect()
}

/// SmolLM2-135M's linear layers: (name, rows, k).
const SHAPES: [(&str, usize, usize); 4] =
    [("q/o_proj", 576, 576), ("k/v_proj", 192, 576), ("gate/up_proj", 1536, 576), ("down_proj", 576, 1536)];

fn report(what: &str, portable: f64, avx: Option<(f64, bool)>) {
    match avx {
        Some((a, same)) => println!(
            "{what:<48} portable {:8.3} ms  avx {:8.3} ms  ratio {:5.2}x  same bits: {}",
            portable * 1e3,
            a * 1e3,
            portable / a,
            if same { "yes" } else { "NO" }
        ),
        None => println!("{what:<48} portable {:8.3} ms  (no AVX on this CPU)", portable * 1e3),
    }
}

fn kernels() {
    const REPS: usize = 21;
    let avx = Kernels::avx();
    let tokens = 256;
    for (name, n, k) in SHAPES {
        let (x, w) = (data(tokens * k, 1), data(n * k, 2));
        let run = |kernels: Kernels| {
            let mut out = Vec::with_capacity(tokens * n);
            let s = time(REPS, || {
                out.clear();
                kernels.matmul_rows(&x, &w, None, k, 0..n, &mut out);
                black_box(&out);
            });
            (s, out)
        };
        let (p, pout) = run(Kernels::PORTABLE);
        let a = avx.map(|avx| {
            let (a, aout) = run(avx);
            (a, pout.iter().zip(&aout).all(|(p, a)| p.to_bits() == a.to_bits()))
        });
        report(&format!("matmul {tokens} tokens x {name} [{n}, {k}]"), p, a);
    }
    let sample = 32;
    for (name, n, k) in SHAPES {
        let (x, e) = (data(sample * k, 3), data(n * k, 4));
        let run = |kernels: Kernels| {
            let mut err = 0.0;
            let s = time(REPS, || {
                err = e.chunks(16 * k).map(|b| kernels.block_error(b, k, &x)).sum::<f64>();
                black_box(err);
            });
            (s, err)
        };
        let (p, perr) = run(Kernels::PORTABLE);
        let a = avx.map(|avx| {
            let (a, aerr) = run(avx);
            (a, perr.to_bits() == aerr.to_bits())
        });
        report(&format!("block_error {sample} tokens x {name} [{n}, {k}]"), p, a);
    }
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
    kernels();
    smollm2();
}

//! `lantern quantize`: a GGUF file or Hugging Face folder in, a quantized safetensors folder out.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};

use lantern::model::load::load_path;
use lantern::quant::awq::AwqOptions;
use lantern::quant::quantize::{quantize_model, EmbeddingPolicy, Method, Progress, QuantizeOptions};
use lantern::quant::safetensors::write_model_folder;
use lantern::quant::QuantKind;

#[derive(Args)]
pub struct QuantizeArgs {
    /// A GGUF file, a Hugging Face folder or a catalogue name (qwen2.5-coder-0.5b, ...; fetched
    /// once). Default: SmolLM2-135M-Instruct, fetched once.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Format of the linear layers: q4 (4-bit, scale + minimum), q4sym (4-bit symmetric),
    /// q3 (3-bit, scale + minimum; groups of 32 or more), q8 (8-bit symmetric), s24q4 / s24q8
    /// (2:4 sparse: two of every four weights zero, the others 4- or 8-bit symmetric).
    #[arg(long = "to", value_parser = ["q4", "q4sym", "q3", "q8", "s24q4", "s24q8"], required_unless_present = "bits", conflicts_with = "bits")]
    to: Option<String>,
    /// Bits per weight instead of --to: 8 (q8), 4 (q4) or 3 (q3); with --method wanda-2:4,
    /// the kept values' bits: 4 (s24q4) or 8 (s24q8).
    #[arg(long, value_parser = clap::value_parser!(u8).range(3..=8))]
    bits: Option<u8>,
    /// Elements per scale: a positive multiple of 8 (of 32 for q3) that divides every row
    /// length (32, 64 or 128 usually).
    #[arg(long, default_value_t = 32)]
    group: u32,
    /// Text file for calibration (AWQ's activation-aware scales, GPTQ's Hessians); without
    /// it, round to nearest.
    #[arg(long)]
    calibration: Option<PathBuf>,
    /// rtn (round to nearest; 2:4 formats pruned by magnitude), awq (activation-aware scales,
    /// then RTN), gptq (error feedback through the inputs' inverse Hessian) or wanda-2:4 (2:4
    /// pruning by |w| x the input's norm over the calibration text). Default: awq with
    /// --calibration, else rtn.
    #[arg(long, value_parser = ["rtn", "awq", "gptq", "wanda-2:4"])]
    method: Option<String>,
    /// GPTQ's dampening: the fraction of the Hessian's mean diagonal added to it (larger
    /// trusts a small calibration text less).
    #[arg(long, default_value_t = 0.01)]
    gptq_damp: f64,
    /// GPTQ's act-order: round the input columns by decreasing Hessian diagonal (the inputs
    /// with the most energy first), each group's scale fixed from the original weights.
    #[arg(long)]
    gptq_act_order: bool,
    /// Most calibration tokens used (the text is cut after these).
    #[arg(long, default_value_t = 256)]
    calibration_tokens: usize,
    /// Token embedding and LM head: f32, f16, q8 (8-bit, group 32) or same (the --to format).
    #[arg(long, default_value = "q8", value_parser = ["f32", "f16", "q8", "same"])]
    embeddings: String,
    /// Output folder (config.json, model.safetensors, tokenizer files).
    #[arg(long)]
    out: PathBuf,
    /// Print the summary as JSON on stdout.
    #[arg(long)]
    json: bool,
}

fn mib(b: usize) -> String {
    format!("{:.2} MiB", b as f64 / (1024.0 * 1024.0))
}

pub fn quantize(a: QuantizeArgs) -> Result<()> {
    let t0 = Instant::now();
    let model_path = lantern::fetch::resolve_model(a.model.as_deref(), true)?;
    let wanda = a.method.as_deref() == Some("wanda-2:4");
    let kind = match (a.to.as_deref(), a.bits) {
        (Some(to), _) => QuantKind::parse(to).with_context(|| format!("unknown --to {to}"))?,
        (None, Some(8)) if wanda => QuantKind::S24Q8,
        (None, Some(4)) if wanda => QuantKind::S24Q4,
        (None, Some(b)) if wanda => bail!("--bits {b}: wanda-2:4 keeps 4- or 8-bit values"),
        (None, Some(8)) => QuantKind::Q8,
        (None, Some(4)) => QuantKind::Q4,
        (None, Some(3)) => QuantKind::Q3,
        (None, Some(b)) => bail!("--bits {b}: Lantern quantizes to 8, 4 or 3 bits"),
        (None, None) => bail!("give --to FORMAT or --bits 8|4|3"),
    };
    let embeddings = EmbeddingPolicy::parse(&a.embeddings).with_context(|| format!("unknown --embeddings {}", a.embeddings))?;
    let min_group = kind.min_group();
    if a.group == 0 || !a.group.is_multiple_of(min_group) {
        bail!("--group {} must be a positive multiple of {min_group} for {} (32, 64 or 128 usually)", a.group, kind.name());
    }
    if a.out.exists() && !a.out.is_dir() {
        bail!("--out {} exists and is not a folder", a.out.display());
    }
    eprintln!("loading {}", model_path.display());
    let loaded = load_path(&model_path).with_context(|| format!("loading {}", model_path.display()))?;
    // Fail before the work if the config has no config.json form.
    loaded.weights.config.to_hf_json()?;
    let mut opts = QuantizeOptions::new(kind);
    opts.group = a.group;
    opts.embeddings = embeddings;
    opts.awq = AwqOptions { max_tokens: a.calibration_tokens.max(1), ..AwqOptions::default() };
    let calibration = match &a.calibration {
        Some(p) => {
            let text = std::fs::read_to_string(p).with_context(|| format!("reading calibration text {}", p.display()))?;
            let tok = loaded
                .tokenizer
                .as_ref()
                .with_context(|| format!("{} has no tokenizer to encode the calibration text with", model_path.display()))?;
            let ids = tok.encode(&text)?;
            if ids.is_empty() {
                bail!("calibration text {} is empty", p.display());
            }
            Some(ids)
        }
        None => None,
    };
    if !(a.gptq_damp >= 0.0 && a.gptq_damp.is_finite()) {
        bail!("--gptq-damp {} must be a non-negative number", a.gptq_damp);
    }
    opts.gptq.damp = a.gptq_damp;
    opts.gptq.act_order = a.gptq_act_order;
    opts.method = match (a.method.as_deref(), &calibration) {
        (Some("rtn"), _) | (None, None) => Method::Rtn,
        (Some("awq") | None, Some(_)) => Method::Awq,
        (Some("gptq"), Some(_)) => Method::Gptq,
        (Some("wanda-2:4"), Some(_)) => Method::Wanda,
        (Some(m), None) => bail!("--method {m} needs --calibration TEXT (its inputs are measured on it)"),
        (Some(m), Some(_)) => bail!("unknown --method {m}"),
    };
    let pb = ProgressBar::new(0);
    pb.set_style(
        ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} {elapsed}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    let mut progress = |p: Progress<'_>| match p {
        Progress::Calibrate { layer, layers } => {
            pb.set_message("calibrating (f32 forward)");
            pb.set_length(layers as u64);
            pb.set_position(layer as u64);
        }
        Progress::Search { layer, layers } => {
            pb.set_message("AWQ scale search");
            pb.set_length(layers as u64);
            pb.set_position(layer as u64);
        }
        Progress::Quantize { done, total, .. } => {
            pb.set_message("quantizing");
            pb.set_length(total as u64);
            pb.set_position(done as u64);
        }
    };
    let q = quantize_model(&loaded.weights, &opts, calibration.as_deref(), &mut progress)?;
    pb.finish_and_clear();
    drop(loaded.weights);
    let mut meta = q.metadata.clone();
    meta.source = Some(model_path.display().to_string());
    if let (Some(cal), Some(p)) = (meta.calibration.as_mut(), &a.calibration) {
        cal["file"] = p.display().to_string().into();
    }
    eprintln!("writing {}", a.out.display());
    let written = write_model_folder(&a.out, &q.weights, &meta, loaded.tokenizer.as_ref())?;
    let r = &q.report;
    let before: usize = r.bytes_before.values().sum();
    let after: usize = r.bytes_after.values().sum();
    if a.json {
        let v = serde_json::json!({
            "model": model_path.display().to_string(),
            "out": a.out.display().to_string(),
            "format": opts.format().to_string(),
            "method": opts.method,
            "embeddings": opts.embeddings,
            "report": r,
            "files": written.files.iter().map(|(p, n)| serde_json::json!({"path": p.display().to_string(), "bytes": n})).collect::<Vec<_>>(),
            "seconds": t0.elapsed().as_secs_f64(),
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    eprintln!("bytes before: {} total", mib(before));
    for (d, b) in &r.bytes_before {
        eprintln!("  {d:>8}: {}", mib(*b));
    }
    eprintln!("bytes after: {} total ({:.1}% of before)", mib(after), 100.0 * after as f64 / before.max(1) as f64);
    for (d, b) in &r.bytes_after {
        eprintln!("  {d:>8}: {}", mib(*b));
    }
    let methods: Vec<String> = r.methods.iter().map(|(m, n)| format!("{m} {n}")).collect();
    eprintln!("tensors by method: {}", methods.join(", "));
    if opts.method == Method::Awq {
        let n = r.awq.len().max(1);
        let mean_alpha = r.awq.iter().map(|s| s.alpha as f64).sum::<f64>() / n as f64;
        let (rtn, awq) = r.awq.iter().fold((0.0, 0.0), |(a, b), s| (a + s.err_rtn, b + s.err_awq));
        let unscaled = r.awq.iter().filter(|s| s.alpha == 0.0).count();
        let gain = if rtn > 0.0 {
            format!("{:.1}% lower", 100.0 * (1.0 - awq / rtn))
        } else {
            "RTN is already exact: the source holds this format".to_string()
        };
        eprintln!(
            "AWQ: {} calibration tokens, mean alpha {mean_alpha:.2} ({unscaled} of {} sites kept alpha 0), sampled output error {awq:.4e} vs RTN {rtn:.4e} ({gain}); calibration {:.1} s, search {:.1} s",
            r.calibration_tokens,
            r.awq.len(),
            r.calibration_seconds,
            r.search_seconds
        );
    }
    for (p, n) in &written.files {
        eprintln!("  wrote {} ({})", p.display(), mib(*n as usize));
    }
    eprintln!("done in {:.1} s", t0.elapsed().as_secs_f64());
    Ok(())
}

//! `lantern eval ppl` and `lantern eval compare`: thin wrappers around `lantern::eval`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};

use lantern::eval::{compare, perplexity, CompareReport, PositionStats, Progress, Window};
use lantern::gpu::GpuContext;
use lantern::model::forward::{GpuModel, ModelOptions, WeightPrecision};
use lantern::model::load::load_path;
use lantern::model::tokenizer::{ChatMessage, Tokenizer};

use super::{spinner, DeviceArgs, KvArg, Weights};

#[derive(Subcommand)]
pub enum EvalCmd {
    /// Perplexity of a model on a text file (standard next-token perplexity, f64 sums).
    Ppl(PplArgs),
    /// Compare model B with model A: greedy continuations, then teacher-forced top-1
    /// agreement and KL(P_A || P_B) on A's sequences.
    Compare(CompareArgs),
}

#[derive(Args)]
pub struct PplArgs {
    /// A GGUF file, a Hugging Face folder or a catalogue name (qwen2.5-coder-0.5b, ...; fetched
    /// once). Default: SmolLM2-135M-Instruct, fetched once.
    #[arg(long)]
    model: Option<PathBuf>,
    /// UTF-8 text file, tokenized as a whole with the model's tokenizer.
    #[arg(long)]
    text: PathBuf,
    /// Context (= window) length in tokens. Default: min(model's, 2048). A text that fits is
    /// one window; a longer one is split into non-overlapping windows of this length.
    #[arg(long)]
    context: Option<usize>,
    /// Sliding windows of --context tokens every S tokens; each window scores only the tokens
    /// the previous one did not reach (Hugging Face's strided perplexity).
    #[arg(long)]
    stride: Option<usize>,
    /// Weight storage on the GPU (as for `run`).
    #[arg(long, value_enum, default_value_t = Weights::Native)]
    weights: Weights,
    /// KV cache storage (as for `run`).
    #[arg(long, value_enum, default_value_t = KvArg::F32)]
    kv_dtype: KvArg,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
    /// Include every scored token's NLL (position, id, nats) in the JSON.
    #[arg(long)]
    per_token: bool,
    #[command(flatten)]
    device: DeviceArgs,
}

#[derive(Args)]
pub struct CompareArgs {
    /// Model A, then model B (GGUF files or Hugging Face folders). Given once, both are that
    /// model (compare two --weights); not given, both are the default model.
    #[arg(long)]
    model: Vec<PathBuf>,
    /// Prompts: one per line, a JSON list of strings, or a JSON list of objects with
    /// `input_ids` (used as is) or `prompt_text`/`prompt` (like the fixtures' cases.json).
    #[arg(long)]
    prompts: PathBuf,
    /// Tokens each model generates per prompt (EOS does not stop it).
    #[arg(long, default_value_t = 32)]
    max_tokens: usize,
    /// Wrap text prompts in model A's chat template as one user message.
    #[arg(long)]
    chat: bool,
    /// Context window of both models in tokens. Default: min(model's, 2048).
    #[arg(long)]
    context: Option<usize>,
    /// Weight storage: once for both models, or twice (A, then B).
    #[arg(long, value_enum)]
    weights: Vec<Weights>,
    /// KV cache storage: once for both models, or twice (A, then B), e.g. `--kv-dtype f32
    /// --kv-dtype q8` to measure what a q8 cache changes.
    #[arg(long, value_enum)]
    kv_dtype: Vec<KvArg>,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    device: DeviceArgs,
}

pub fn eval(cmd: EvalCmd) -> Result<()> {
    match cmd {
        EvalCmd::Ppl(a) => ppl(a),
        EvalCmd::Compare(a) => compare_cmd(a),
    }
}

fn precision(w: Weights) -> WeightPrecision {
    match w {
        Weights::Native => WeightPrecision::Native,
        Weights::F32 => WeightPrecision::F32,
        Weights::F16 => WeightPrecision::F16,
    }
}

fn default_model(p: Option<PathBuf>) -> Result<PathBuf> {
    lantern::fetch::resolve_model(p.as_deref(), true)
}

fn gpu(device: &DeviceArgs) -> Result<Arc<GpuContext>> {
    device.open()
}

/// Load `path` onto `ctx`; returns the model, its tokenizer (if any) and the load time.
fn load(
    ctx: &Arc<GpuContext>,
    path: &Path,
    context: Option<usize>,
    weights: Weights,
    kv: KvArg,
) -> Result<(GpuModel, Option<Tokenizer>, f64)> {
    let t0 = Instant::now();
    let pb = spinner(&format!("loading {}", path.display()), false);
    let loaded = load_path(path).with_context(|| format!("loading {}", path.display()))?;
    pb.set_message(format!("uploading {} to {}", path.display(), ctx.info.name));
    // Evaluation reads the logits of every position: bigger steps than `run`'s 128 tokens /
    // 64 logit rows (SmolLM2 on lavapipe: 3.4 tokens/s at 64 rows, 4.2 at 128, 4.9 at 256),
    // with the logits buffer kept under 64 MiB for large vocabularies.
    let rows = ((64usize << 20) / (loaded.weights.config.vocab_size.max(1) * 4)).clamp(64, 256);
    let model = pollster::block_on(GpuModel::load(
        ctx.clone(),
        &loaded.weights,
        ModelOptions {
            context,
            weights: precision(weights),
            kv_dtype: kv.dtype(),
            max_batch_tokens: rows,
            max_logit_rows: rows,
            ..Default::default()
        },
    ))
    .with_context(|| format!("uploading {}", path.display()))?;
    pb.finish_and_clear();
    Ok((model, loaded.tokenizer, t0.elapsed().as_secs_f64() * 1e3))
}

fn progress_bar(what: &str) -> ProgressBar {
    let pb = ProgressBar::new(0);
    pb.set_style(
        ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} tokens, {per_sec}, ETA {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    pb.set_message(what.to_string());
    pb
}

fn on_progress(pb: &ProgressBar) -> impl FnMut(Progress) + '_ {
    move |p: Progress| {
        pb.set_length(p.total as u64);
        pb.set_position(p.done as u64);
    }
}

fn ppl(a: PplArgs) -> Result<()> {
    let model_path = default_model(a.model.clone())?;
    let text = std::fs::read_to_string(&a.text).with_context(|| format!("reading {}", a.text.display()))?;
    let ctx = gpu(&a.device)?;
    let (mut model, tokenizer, load_ms) = load(&ctx, &model_path, a.context, a.weights, a.kv_dtype)?;
    let tokenizer = tokenizer.with_context(|| format!("{} has no tokenizer (tokenizer.json)", model_path.display()))?;
    let ids = tokenizer.encode(&text)?;
    let context = model.kv.alloc.config.context;
    let window = match a.stride {
        Some(stride) => Window::Sliding { size: context, stride },
        None => Window::Auto,
    };
    let pb = progress_bar("perplexity");
    let report = pollster::block_on(perplexity(&mut model, &ids, window, on_progress(&pb)))?;
    pb.finish_and_clear();
    if a.json {
        let mut v = serde_json::to_value(&report)?;
        if !a.per_token {
            if let Some(o) = v.as_object_mut() {
                o.remove("per_token");
            }
        }
        v["window"]["description"] = report.window.describe().into();
        v["input_ids"] = serde_json::json!(ids);
        v["text_path"] = a.text.display().to_string().into();
        v["text_chars"] = text.chars().count().into();
        v["context"] = context.into();
        v["weight_precision"] = serde_json::to_value(model.options.weights)?;
        v["load_ms"] = load_ms.into();
        v["model"] = serde_json::json!({ "path": model_path.display().to_string(), "config": model.config });
        v["adapter"] = ctx.adapter_json();
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        println!(
            "perplexity {:.4} (mean NLL {:.6} nats over {} predicted tokens)",
            report.perplexity, report.mean_nll, report.predicted_tokens
        );
        println!("text: {} tokens from {}; {}", report.token_count, a.text.display(), report.window.describe());
        println!(
            "{} tokens evaluated in {:.1} s ({:.1} tokens/s) on {}, model loaded in {:.0} ms",
            report.tokens_evaluated,
            report.elapsed_ms / 1e3,
            report.tokens_per_s,
            ctx.info.name,
            load_ms
        );
    }
    Ok(())
}

/// One prompt as read from the file.
struct PromptIn {
    name: String,
    ids: Vec<u32>,
}

/// Tokenize a text prompt (optionally wrapped in the chat template).
fn encode_text(tok: &Tokenizer, text: &str, chat: bool) -> Result<Vec<u32>> {
    if chat {
        let tmpl = tok.chat_template().context("model A has no usable chat template")?;
        let rendered = tmpl.render(&[ChatMessage::user(text.to_string())], true)?;
        Ok(tok.encode_chat(&rendered)?)
    } else {
        Ok(tok.encode(text)?)
    }
}

fn read_prompts(path: &Path, tok: Option<&Tokenizer>, chat: bool) -> Result<Vec<PromptIn>> {
    let body = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let need_tok = || tok.with_context(|| "the models have no tokenizer; give prompts as `input_ids`".to_string());
    let trimmed = body.trim_start();
    let mut out = Vec::new();
    if trimmed.starts_with('[') {
        let v: serde_json::Value = serde_json::from_str(&body).with_context(|| format!("{} is not valid JSON", path.display()))?;
        let items = v.as_array().with_context(|| format!("{}: expected a JSON list", path.display()))?;
        for (i, item) in items.iter().enumerate() {
            let name = item.get("name").and_then(|n| n.as_str()).map(str::to_string).unwrap_or_else(|| format!("{i}"));
            let ids = if let Some(s) = item.as_str() {
                encode_text(need_tok()?, s, chat)?
            } else if let Some(ids) = item.get("input_ids").and_then(|x| x.as_array()) {
                ids.iter()
                    .map(|x| {
                        x.as_u64()
                            .and_then(|x| u32::try_from(x).ok())
                            .with_context(|| format!("{}: prompt {i}: input_ids must be token ids", path.display()))
                    })
                    .collect::<Result<Vec<u32>>>()?
            } else if let Some(text) = item.get("prompt_text").and_then(|x| x.as_str()) {
                // Already the exact text to tokenize (a rendered template for chat cases).
                let t = need_tok()?;
                if item.get("chat").and_then(|c| c.as_bool()).unwrap_or(false) {
                    t.encode_chat(text)?
                } else {
                    t.encode(text)?
                }
            } else if let Some(text) = item.get("prompt").and_then(|x| x.as_str()) {
                let c = item.get("chat").and_then(|c| c.as_bool()).unwrap_or(chat);
                encode_text(need_tok()?, text, c)?
            } else {
                bail!("{}: prompt {i} is neither a string nor an object with input_ids, prompt_text or prompt", path.display());
            };
            out.push(PromptIn { name, ids });
        }
    } else {
        for (i, line) in body.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            out.push(PromptIn { name: format!("line {}", i + 1), ids: encode_text(need_tok()?, line, chat)? });
        }
    }
    if out.is_empty() {
        bail!("{} holds no prompts", path.display());
    }
    Ok(out)
}

fn compare_cmd(a: CompareArgs) -> Result<()> {
    if a.model.len() > 2 {
        bail!("--model is given {} times: give model A and model B (or one model twice with two --weights)", a.model.len());
    }
    if a.weights.len() > 2 {
        bail!("--weights is given {} times: give one for both models, or one for A and one for B", a.weights.len());
    }
    let path_a = default_model(a.model.first().cloned())?;
    let path_b = a.model.get(1).cloned().unwrap_or_else(|| path_a.clone());
    let w_a = a.weights.first().copied().unwrap_or(Weights::Native);
    let w_b = a.weights.get(1).copied().unwrap_or(w_a);
    let ctx = gpu(&a.device)?;
    let (kv_a, kv_b) = match a.kv_dtype.as_slice() {
        [] => (KvArg::F32, KvArg::F32),
        [k] => (*k, *k),
        [ka, kb] => (*ka, *kb),
        _ => bail!("--kv-dtype: give it once (both models) or twice (A, then B)"),
    };
    let (mut ma, tok_a, load_a) = load(&ctx, &path_a, a.context, w_a, kv_a)?;
    let (mut mb, tok_b, load_b) = load(&ctx, &path_b, a.context, w_b, kv_b)?;
    let prompts = read_prompts(&a.prompts, tok_a.as_ref(), a.chat)?;
    if let (Some(ta), Some(tb)) = (tok_a.as_ref(), tok_b.as_ref()) {
        if path_a != path_b && (ta.vocab_size() != tb.vocab_size() || ta.decode(&prompts[0].ids).ok() != tb.decode(&prompts[0].ids).ok()) {
            eprintln!("warning: the two models' tokenizers differ; prompts are tokenized with model A's");
        }
    }
    let ids: Vec<Vec<u32>> = prompts.iter().map(|p| p.ids.clone()).collect();
    let pb = progress_bar(&format!("comparing on {} prompts", ids.len()));
    let report = pollster::block_on(compare(&mut ma, &mut mb, &ids, a.max_tokens, on_progress(&pb)))?;
    pb.finish_and_clear();
    let decode = |ids: &[u32]| tok_a.as_ref().and_then(|t| t.decode(ids).ok());
    let side = |p: &Path, m: &GpuModel, load_ms: f64| {
        serde_json::json!({
            "path": p.display().to_string(),
            "weight_precision": m.options.weights,
            "kv_dtype": m.options.kv_dtype,
            "weight_bytes": m.weight_bytes(),
            "load_ms": load_ms,
        })
    };
    if a.json {
        let mut v = serde_json::to_value(&report)?;
        if let Some(list) = v["prompts"].as_array_mut() {
            for (item, (p, r)) in list.iter_mut().zip(prompts.iter().zip(&report.prompts)) {
                item["name"] = p.name.clone().into();
                item["prompt_ids"] = serde_json::json!(p.ids);
                item["a_text"] = decode(&r.a_ids).into();
                item["b_text"] = decode(&r.b_ids).into();
            }
        }
        v["a"] = side(&path_a, &ma, load_a);
        v["b"] = side(&path_b, &mb, load_b);
        v["adapter"] = ctx.adapter_json();
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        print_table(&prompts, &report);
        println!(
            "A: {} (weights {}, KV {:?}), B: {} (weights {}, KV {:?}), on {}",
            path_a.display(),
            weights_name(&ma),
            ma.options.kv_dtype,
            path_b.display(),
            weights_name(&mb),
            mb.options.kv_dtype,
            ctx.info.name
        );
        print_summary(&report);
    }
    Ok(())
}

fn weights_name(m: &GpuModel) -> String {
    serde_json::to_value(m.options.weights).ok().and_then(|v| v.as_str().map(str::to_string)).unwrap_or_default()
}

fn opt(v: Option<f64>, prec: usize) -> String {
    v.map_or("-".into(), |x| format!("{x:.prec$}"))
}

fn kl(v: Option<f64>) -> String {
    v.map_or("-".into(), |x| format!("{x:.3e}"))
}

fn print_table(prompts: &[PromptIn], r: &CompareReport) {
    println!(
        "{:<20} {:>6} {:>9} {:>7} {:>9} {:>10} {:>10} {:>10}",
        "prompt", "tokens", "diverges", "agree", "top1 gen", "KL gen", "top1 prm", "KL prm"
    );
    for (p, c) in prompts.iter().zip(&r.prompts) {
        let mut name = p.name.clone();
        if name.chars().count() > 20 {
            name = name.chars().take(19).collect::<String>() + "…";
        }
        println!(
            "{:<20} {:>6} {:>9} {:>7} {:>9} {:>10} {:>10} {:>10}",
            name,
            c.prompt_tokens,
            c.first_divergence.map_or("-".into(), |d| d.to_string()),
            opt(c.token_agreement, 3),
            opt(c.generated.top1_agreement, 3),
            kl(c.generated.mean_kl),
            opt(c.prompt.top1_agreement, 3),
            kl(c.prompt.mean_kl),
        );
    }
}

fn stats_line(what: &str, s: &PositionStats) -> String {
    format!(
        "{what} ({} positions): top-1 agreement {}, mean KL {}, max KL {}",
        s.positions,
        opt(s.top1_agreement, 4),
        kl(s.mean_kl),
        kl(s.max_kl)
    )
}

fn print_summary(r: &CompareReport) {
    println!(
        "greedy, {} new tokens per prompt: {}/{} prompts identical, token agreement {}, mean first divergence {}",
        r.max_new,
        r.identical_prompts,
        r.prompts.len(),
        opt(r.token_agreement, 4),
        opt(r.mean_first_divergence, 1)
    );
    println!("teacher-forced on A's sequences, KL(P_A || P_B) in nats:");
    println!("  {}", stats_line("generated positions", &r.generated));
    println!("  {}", stats_line("prompt positions", &r.prompt));
    println!("({:.1} s)", r.elapsed_ms / 1e3);
}

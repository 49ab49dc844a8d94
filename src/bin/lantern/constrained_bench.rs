//! `lantern bench --json-schema FILE` (or `--constrained` for a built-in schema): what
//! constrained decoding costs per token on this adapter. The same chat prompt runs
//! greedily, plain and constrained, alternating, in one process: the median inter-token
//! milliseconds of each, and their difference (the grammar's mask computed on the host
//! while the GPU runs the layers, its upload, and the mask dispatch).

use std::sync::Arc;

use anyhow::{Context, Result};

use lantern::engine::generate::{default_stop_ids, generate, GenerateRequest};
use lantern::engine::Constraint;
use lantern::model::forward::{GpuModel, ModelOptions};
use lantern::model::tokenizer::{ChatMessage, Tokenizer};

use super::bench_cmd::BenchArgs;
use super::spinner;

/// The schema of `--constrained`: objects, an enum, an array, bounded integers.
fn builtin_schema() -> serde_json::Value {
    serde_json::json!({
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "role": {"enum": ["admin", "user", "guest"]},
            "skills": {"type": "array", "items": {"type": "string"}},
            "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}}, "required": ["city", "zip"]}
        },
        "required": ["name", "age", "role", "skills", "address"]
    })
}

fn median(v: &[f64]) -> f64 {
    lantern::engine::metrics::percentile(v, 50.0).unwrap_or(f64::NAN)
}

pub fn run(a: &BenchArgs) -> Result<()> {
    let schema = match &a.json_schema {
        Some(p) => serde_json::from_str(&std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?)
            .with_context(|| format!("{} is not JSON", p.display()))?,
        None => builtin_schema(),
    };
    let model_path = lantern::fetch::resolve_model(a.model.as_deref(), true)?;
    let pb = spinner(&format!("loading {}", model_path.display()), false);
    let ctx = a.device.open()?;
    let (mut model, tokenizer): (GpuModel, Option<Tokenizer>) = pollster::block_on(lantern::model::load::load_to_gpu(
        ctx.clone(),
        &model_path,
        ModelOptions { context: Some(a.context.unwrap_or(1024)), ..Default::default() },
        &mut |_, _| {},
    ))
    .with_context(|| format!("loading {}", model_path.display()))?;
    let tokenizer = Arc::new(tokenizer.with_context(|| format!("{} has no tokenizer", model_path.display()))?);
    pb.finish_and_clear();
    let (_, max_tokens) = super::bench_cmd::parse_len(&a.output_len, "--output-len")?;
    let user = a.prompt.first().cloned().unwrap_or_else(|| "Describe a fictional employee as JSON.".into());
    let text = tokenizer.chat_template()?.render(&[ChatMessage::user(user)], true)?;
    let prompt_ids = tokenizer.encode_chat(&text)?;
    let t0 = std::time::Instant::now();
    let _ = tokenizer.guidance()?;
    let env_ms = t0.elapsed().as_secs_f64() * 1e3;
    let t0 = std::time::Instant::now();
    let _ = lantern::engine::Guide::new(&tokenizer, &Constraint::JsonSchema(schema.clone()), model.config.vocab_size, &[])?;
    let compile_ms = t0.elapsed().as_secs_f64() * 1e3;
    let stop_ids = default_stop_ids(&model.config.eos_token_ids, &tokenizer);
    // Plain runs ignore EOS so they time as many tokens as asked; constrained ones end when
    // the schema is complete.
    let plain = GenerateRequest { prompt_ids: prompt_ids.clone(), max_tokens, ..Default::default() };
    let guided =
        GenerateRequest { prompt_ids, max_tokens, stop_ids, constraint: Some(Constraint::JsonSchema(schema)), ..Default::default() };
    let reps = a.requests.clamp(1, 8);
    let (mut itl_plain, mut itl_guided, mut last_text) = (Vec::new(), Vec::new(), String::new());
    for _ in 0..reps {
        let g = pollster::block_on(generate(&mut model, &tokenizer, &plain, |_| true))?;
        itl_plain.extend(g.timings.itl_ms());
        let g = pollster::block_on(generate(&mut model, &tokenizer, &guided, |_| true))?;
        itl_guided.extend(g.timings.itl_ms());
        last_text = g.text;
    }
    let (p, c) = (median(&itl_plain), median(&itl_guided));
    println!("{} on {} | {reps} runs each, up to {max_tokens} tokens, greedy", model_path.display(), ctx.info.name);
    println!("token environment (once per tokenizer): {env_ms:.1} ms; schema compile: {compile_ms:.1} ms");
    println!("plain:       median {p:.2} ms/token over {} tokens", itl_plain.len());
    println!("constrained: median {c:.2} ms/token over {} tokens", itl_guided.len());
    println!("overhead:    {:+.2} ms/token ({:+.1}%)", c - p, (c - p) / p * 100.0);
    println!("last constrained output: {last_text}");
    Ok(())
}

//! `lantern info`: what a model file holds and what a native load puts on the GPU, by dtype
//! (scale metadata apart), without touching a GPU.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

use lantern::model::load::load_path;
use lantern::model::DType;

#[derive(Args)]
pub struct InfoArgs {
    /// A GGUF file, a Hugging Face folder or a catalogue name (qwen2.5-coder-0.5b, ...; fetched
    /// once). Default: SmolLM2-135M-Instruct, fetched once.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

/// Tensors and bytes of one dtype.
#[derive(Default, serde::Serialize)]
pub struct Row {
    pub tensors: usize,
    pub parameters: u64,
    pub bytes: u64,
    pub scale_bytes: u64,
}

/// Tensors, parameters and bytes by dtype: in the file, and on the GPU after a native load.
pub fn by_dtype(w: &lantern::model::ModelWeights, path: &std::path::Path) -> Result<(BTreeMap<String, Row>, BTreeMap<String, Row>)> {
    let mut file: BTreeMap<String, Row> = BTreeMap::new();
    let mut gpu: BTreeMap<String, Row> = BTreeMap::new();
    for t in w.tensors.values() {
        let n = t.numel() as u64;
        let f = file.entry(t.dtype.name()).or_default();
        f.tensors += 1;
        f.parameters += n;
        f.bytes += t.data.len() as u64;
        // A native load: integer formats stay packed (codes + f16 scales), f16 stays f16, the
        // rest becomes f32 (see `WeightPrecision::Native`).
        let (key, bytes, scales) = match t.packed() {
            Some(p) => {
                let p = p.map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
                (p.format.to_string(), (p.bytes() - p.scale_bytes()) as u64, p.scale_bytes() as u64)
            }
            None if t.dtype == DType::F16 => ("f16".to_string(), n * 2, 0),
            None => ("f32".to_string(), n * 4, 0),
        };
        let g = gpu.entry(key).or_default();
        g.tensors += 1;
        g.parameters += n;
        g.bytes += bytes;
        g.scale_bytes += scales;
    }
    Ok((file, gpu))
}

pub fn info(a: InfoArgs) -> Result<()> {
    let path = lantern::fetch::resolve_model(a.model.as_deref(), !a.json)?;
    let loaded = load_path(&path)?;
    let w = &loaded.weights;
    let (file, gpu) = by_dtype(w, &path)?;
    // A tied embedding is also the LM head: counted once, as the file stores it.
    let params: u64 = file.values().map(|r| r.parameters).sum();
    let gpu_total: u64 = gpu.values().map(|r| r.bytes + r.scale_bytes).sum();
    let c = &w.config;
    if a.json {
        let v = serde_json::json!({
            "path": path.display().to_string(),
            "config": c,
            "parameters": params,
            // Mixtures of experts: what one token reads (the chosen experts only).
            "active_parameters_per_token": params - c.idle_expert_parameters(),
            "file_bytes_by_dtype": file,
            "gpu_weight_bytes_by_dtype": gpu,
            "gpu_weight_bytes": gpu_total,
            "kv_bytes_per_token_f32": 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    let mb = |b: u64| b as f64 / 1e6;
    println!("{}", path.display());
    println!(
        "  {:?}: {} layers, hidden {}, {} heads / {} KV heads x {}, FFN {}, vocab {}, context {}{}",
        c.arch,
        c.num_layers,
        c.hidden_size,
        c.num_heads,
        c.num_kv_heads,
        c.head_dim,
        c.intermediate_size,
        c.vocab_size,
        c.max_position_embeddings,
        if c.tie_word_embeddings { ", tied embeddings" } else { "" }
    );
    let b = &c.block;
    if *b != lantern::model::BlockSpec::default() || c.rope_scaling.is_some() {
        let mut parts = Vec::new();
        if b.norms == lantern::model::NormPlacement::Sandwich {
            parts.push("sandwich norms".to_string());
        }
        if b.qk_norm {
            parts.push(if b.qk_norm_whole { "q/k norms over the whole projection" } else { "q/k norms" }.into());
        }
        if let Some(m) = &b.moe {
            let sparse = (0..c.num_layers).filter(|&l| b.experts(l).is_some()).count();
            parts.push(format!(
                "{} experts of width {}, {} per token{}, on {sparse} of {} layers",
                m.experts,
                m.expert_intermediate,
                m.experts_per_token,
                if m.renormalize { " (weights renormalised)" } else { "" },
                c.num_layers
            ));
        }
        if b.activation == lantern::model::Activation::GeluTanh {
            parts.push("GELU-tanh".into());
        }
        if let Some(s) = b.embedding_scale {
            parts.push(format!("embedding x {s}"));
        }
        if let Some(w) = b.sliding_window {
            let n = c.sliding_layers();
            let local = b.rope_local_theta.map(|t| format!(", RoPE base {t} there")).unwrap_or_default();
            parts.push(format!("{w}-key sliding window on {n} of {} layers{local}", c.num_layers));
        }
        match &c.rope_scaling {
            Some(lantern::model::RopeScaling::LongRope { original_max_position_embeddings: o, .. }) => {
                parts.push(format!("LongRoPE (original context {o})"))
            }
            Some(lantern::model::RopeScaling::Llama3 { factor, .. }) => parts.push(format!("Llama 3 RoPE x{factor}")),
            Some(lantern::model::RopeScaling::Linear { factor }) => parts.push(format!("linear RoPE x{factor}")),
            Some(lantern::model::RopeScaling::Divisors { .. }) => parts.push("RoPE divisors from rope_freqs.weight".into()),
            None => {}
        }
        println!("  block: {}", parts.join(", "));
    }
    match c.idle_expert_parameters() {
        0 => println!("  parameters: {:.1} M", params as f64 / 1e6),
        idle => println!("  parameters: {:.1} M, {:.1} M of them read per token", params as f64 / 1e6, (params - idle) as f64 / 1e6),
    }
    println!("  in the file:");
    for (k, r) in &file {
        println!("    {k:<8} {:4} tensors {:9.1} M params {:9.1} MB", r.tensors, r.parameters as f64 / 1e6, mb(r.bytes));
    }
    println!("  on the GPU after a native load (`--weights native`):");
    for (k, r) in &gpu {
        let sc = if r.scale_bytes > 0 { format!(" ({:.1} MB of it scales)", mb(r.scale_bytes)) } else { String::new() };
        println!("    {k:<8} {:4} tensors {:9.1} MB{sc}", r.tensors, mb(r.bytes + r.scale_bytes));
    }
    println!("    total    {:9.1} MB of weights", mb(gpu_total));
    println!("  KV cache: {} bytes per token (f32 K and V, all layers)", 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4);
    Ok(())
}

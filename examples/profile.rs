//! Per-kernel wall-clock profile of one prefill and one decode step:
//! `cargo run --release --example profile -- MODEL.gguf [PROMPT_TOKENS [BATCH_MAX_TOKENS]]`
//! (the last: steps up to this many tokens take the batched matvec instead of the matmul).

use lantern::gpu::{DeviceOptions, GpuContext};
use lantern::model::forward::{GpuModel, ModelOptions};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::args().nth(1).ok_or("usage: profile MODEL [PROMPT_TOKENS]")?;
    let n: usize = std::env::args().nth(2).map(|s| s.parse()).transpose()?.unwrap_or(16);
    let loaded = lantern::model::load::load_path(std::path::Path::new(&path))?;
    let ctx = pollster::block_on(GpuContext::new(&DeviceOptions::default()))?;
    let batch_max_tokens = std::env::args().nth(3).map(|s| s.parse()).transpose()?;
    let opts = ModelOptions { batch_max_tokens, ..Default::default() };
    let mut m = pollster::block_on(GpuModel::load(ctx.clone(), &loaded.weights, opts))?;
    let seq = m.new_sequence()?;
    let prompt: Vec<u32> = (0..n as u32).map(|i| 100 + i).collect();
    for (name, tokens) in [
        ("prefill (first: includes lazy shader compiles)", prompt.clone()),
        ("prefill", prompt.clone()),
        ("decode", vec![42u32]),
        ("decode", vec![43u32]),
    ] {
        let prof = m.profile_step(seq, &tokens)?;
        let total: f64 = prof.iter().map(|p| p.1).sum();
        println!(
            "{name} ({} tokens): {total:.1} ms in {} dispatches on {}",
            tokens.len(),
            prof.iter().map(|p| p.2).sum::<usize>(),
            ctx.info.name
        );
        for (k, ms, c) in prof {
            println!("  {ms:9.2} ms  x{c:<3} {k}");
        }
    }
    Ok(())
}

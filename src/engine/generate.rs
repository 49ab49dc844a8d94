//! The generation loop for one sequence: prefill the prompt, then decode token by token,
//! streaming text pieces, until EOS, a stop string, the token limit or the context's end.

use web_time::Instant;

use super::metrics::RequestTimings;
use super::sampler::{Sampler, SamplingParams};
use crate::model::llama::{GpuModel, Want};
use crate::model::tokenizer::Tokenizer;
use crate::{LanternError, Result};

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// An end-of-sequence token or a stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
    /// The sequence filled the context window.
    ContextFull,
    /// The caller asked to stop.
    Cancelled,
}

impl FinishReason {
    pub fn as_str(&self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::ContextFull => "context_full",
            FinishReason::Cancelled => "cancelled",
        }
    }
}

/// One generation request.
#[derive(Debug, Clone)]
pub struct GenerateRequest {
    pub prompt_ids: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Token ids that end generation (the model's EOS ids by default).
    pub stop_ids: Vec<u32>,
    /// Strings that end generation; the text is cut before them.
    pub stop_strings: Vec<String>,
}

/// The outcome of a request.
#[derive(Debug, Clone)]
pub struct Generation {
    pub prompt_ids: Vec<u32>,
    pub output_ids: Vec<u32>,
    pub text: String,
    pub finish_reason: FinishReason,
    pub timings: RequestTimings,
    /// Prompt tokens whose KV came from the prefix cache (not computed again).
    pub cached_prompt_tokens: usize,
}

/// Run `req` on `model`, calling `on_text` with each new piece of text as it becomes
/// complete UTF-8. `on_text` returns `false` to cancel.
pub async fn generate(
    model: &mut GpuModel,
    tokenizer: &Tokenizer,
    req: &GenerateRequest,
    mut on_text: impl FnMut(&str) -> bool,
) -> Result<Generation> {
    let arrival = Instant::now();
    let context = model.kv.alloc.config.context;
    if req.prompt_ids.is_empty() {
        return Err(LanternError::Other("the prompt is empty (no tokens to condition on)".into()));
    }
    if req.prompt_ids.len() >= context {
        return Err(LanternError::PromptTooLong {
            prompt_tokens: req.prompt_ids.len(),
            max_new: req.max_tokens,
            context,
        });
    }
    let seq = model.new_sequence()?;
    let r = admit_and_run(model, tokenizer, req, seq, arrival, &mut on_text).await;
    model.release_sequence(seq);
    r
}

/// Take the cached prefix of the prompt, refuse the request up front (with what it needs
/// and what is free) when its KV cannot fit, run it, and offer its prompt pages to the
/// prefix cache.
async fn admit_and_run(
    model: &mut GpuModel,
    tokenizer: &Tokenizer,
    req: &GenerateRequest,
    seq: usize,
    arrival: Instant,
    on_text: &mut impl FnMut(&str) -> bool,
) -> Result<Generation> {
    let context = model.kv.alloc.config.context;
    let cached = if model.options.prefix_cache { model.attach_cached_prefix(seq, &req.prompt_ids)? } else { 0 };
    // The most this request can hold: its prompt and every token it may generate.
    let most = (req.prompt_ids.len() + req.max_tokens).min(context);
    model.check_fits(seq, most - cached).map_err(LanternError::Kv)?;
    let mut g = run(model, tokenizer, req, seq, cached, arrival, on_text).await?;
    g.cached_prompt_tokens = cached;
    Ok(g)
}

async fn run(
    model: &mut GpuModel,
    tokenizer: &Tokenizer,
    req: &GenerateRequest,
    seq: usize,
    cached: usize,
    arrival: Instant,
    on_text: &mut impl FnMut(&str) -> bool,
) -> Result<Generation> {
    let context = model.kv.alloc.config.context;
    let mut timings = RequestTimings::new(arrival);
    let mut sampler = Sampler::new(req.sampling);
    let want = if req.sampling.is_greedy() { Want::Argmax } else { Want::Logits };
    let mut decoder = tokenizer.stream_decoder();
    let mut text = String::new();
    let mut out_ids = Vec::new();
    let finish;
    let mut next_input: Vec<u32> = req.prompt_ids[cached..].to_vec();
    let mut prefilled = false;
    // Longest stop string, to hold back text that may be the start of one.
    let hold = req.stop_strings.iter().map(|s| s.len()).max().unwrap_or(0);
    let mut emitted = 0usize;
    if req.max_tokens == 0 {
        timings.finished = Some(Instant::now());
        return Ok(Generation {
            prompt_ids: req.prompt_ids.clone(),
            output_ids: out_ids,
            text,
            finish_reason: FinishReason::Length,
            timings,
            cached_prompt_tokens: 0,
        });
    }
    loop {
        let out = model.forward(seq, &next_input, want).await?;
        if !prefilled {
            prefilled = true;
            if model.options.prefix_cache {
                model.cache_prefix(seq, &req.prompt_ids)?;
            }
        }
        let token = match &out.logits {
            Some(l) => sampler.sample(l),
            None => out.argmax.first().copied().unwrap_or(0),
        };
        timings.tokens.push(Instant::now());
        out_ids.push(token);
        if req.stop_ids.contains(&token) {
            finish = FinishReason::Stop;
            if let Some(piece) = decoder.step(tokenizer, token)? {
                let _ = piece; // EOS text is not part of the output text.
            }
            break;
        }
        if let Some(piece) = decoder.step(tokenizer, token)? {
            text.push_str(&piece);
        }
        // Stop strings: cut the text at the first occurrence.
        if let Some(cut) = req
            .stop_strings
            .iter()
            .filter(|s| !s.is_empty())
            .filter_map(|s| text.find(s.as_str()))
            .min()
        {
            text.truncate(cut);
            if cut > emitted && !on_text(&text[emitted..cut]) {
                finish = FinishReason::Cancelled;
                break;
            }
            emitted = text.len();
            finish = FinishReason::Stop;
            break;
        }
        let safe = text.len().saturating_sub(hold);
        let safe = (0..=safe).rev().find(|&i| text.is_char_boundary(i)).unwrap_or(0);
        if safe > emitted {
            if !on_text(&text[emitted..safe]) {
                finish = FinishReason::Cancelled;
                emitted = safe;
                break;
            }
            emitted = safe;
        }
        if out_ids.len() >= req.max_tokens {
            finish = FinishReason::Length;
            break;
        }
        if model.sequence_len(seq)? + 1 > context {
            finish = FinishReason::ContextFull;
            break;
        }
        next_input = vec![token];
    }
    if finish != FinishReason::Stop || req.stop_strings.is_empty() {
        if let Some(rest) = decoder.finish(tokenizer)? {
            if finish != FinishReason::Stop {
                text.push_str(&rest);
            }
        }
    }
    if finish != FinishReason::Cancelled && text.len() > emitted {
        on_text(&text[emitted..]);
    }
    timings.finished = Some(Instant::now());
    Ok(Generation {
        prompt_ids: req.prompt_ids.clone(),
        output_ids: out_ids,
        text,
        finish_reason: finish,
        timings,
        cached_prompt_tokens: 0,
    })
}

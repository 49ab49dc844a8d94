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

/// The tokens that end a generation unless the caller says otherwise: the model's
/// end-of-sequence ids (from its config) and the tokenizer's, each once.
pub fn default_stop_ids(model_eos: &[u32], tokenizer: &Tokenizer) -> Vec<u32> {
    let mut ids = model_eos.to_vec();
    if let Some(e) = tokenizer.eos_id() {
        if !ids.contains(&e) {
            ids.push(e);
        }
    }
    ids
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
        return Err(LanternError::InvalidRequest("the prompt is empty (no tokens to condition on)".into()));
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
    // Greedy: the GPU argmax (4 bytes); top-k sampling within the GPU top-k: its pairs
    // (512 bytes); anything else: the logits row.
    let want = if req.sampling.is_greedy() {
        Want::Argmax
    } else if sampler.fits_top(crate::kernels::topk::TOPK_MAX) {
        Want::TopK
    } else {
        Want::Logits
    };
    let mut stream = TextStream::new(tokenizer, &req.stop_strings);
    let mut out_ids = Vec::new();
    let finish;
    let mut next_input: Vec<u32> = req.prompt_ids[cached..].to_vec();
    let mut prefilled = false;
    if req.max_tokens == 0 {
        timings.finished = Some(Instant::now());
        return Ok(Generation {
            prompt_ids: req.prompt_ids.clone(),
            output_ids: out_ids,
            text: String::new(),
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
        let token = match (&out.top, &out.logits) {
            (Some(t), _) => sampler.sample_top(t.first().map_or(&[][..], |r| &r[..])),
            (None, Some(l)) => sampler.sample(l),
            (None, None) => out.argmax.first().copied().unwrap_or(0),
        };
        timings.tokens.push(Instant::now());
        out_ids.push(token);
        let (piece, stop) = stream.push(tokenizer, token, &req.stop_ids, &req.stop_strings)?;
        if let Some(p) = piece {
            if !on_text(&p) {
                finish = FinishReason::Cancelled;
                break;
            }
        }
        if let Some(f) = stop {
            finish = f;
            break;
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
    if let Some(rest) = stream.finish(tokenizer, finish)? {
        on_text(&rest);
    }
    let text = stream.text;
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

/// Output text of one sequence as its tokens arrive: complete UTF-8 pieces, stop ids, and
/// stop strings (text is cut before the first one; text that may be the start of one is held
/// back until it is not).
pub(crate) struct TextStream {
    decoder: crate::model::tokenizer::StreamDecoder,
    pub(crate) text: String,
    emitted: usize,
    hold: usize,
}

impl TextStream {
    pub(crate) fn new(tokenizer: &Tokenizer, stop_strings: &[String]) -> Self {
        TextStream {
            decoder: tokenizer.stream_decoder(),
            text: String::new(),
            emitted: 0,
            hold: stop_strings.iter().map(|s| s.len()).max().unwrap_or(0),
        }
    }

    /// Take `token`: the text now safe to show, and `Stop` when a stop id or string ended
    /// the sequence.
    pub(crate) fn push(
        &mut self,
        tokenizer: &Tokenizer,
        token: u32,
        stop_ids: &[u32],
        stop_strings: &[String],
    ) -> Result<(Option<String>, Option<FinishReason>)> {
        if stop_ids.contains(&token) {
            // The stop token's own text is not part of the output.
            let _ = self.decoder.step(tokenizer, token)?;
            return Ok((None, Some(FinishReason::Stop)));
        }
        if let Some(piece) = self.decoder.step(tokenizer, token)? {
            self.text.push_str(&piece);
        }
        if let Some(cut) = stop_strings.iter().filter(|s| !s.is_empty()).filter_map(|s| self.text.find(s.as_str())).min() {
            self.text.truncate(cut);
            let piece = (cut > self.emitted).then(|| self.text[self.emitted..cut].to_string());
            self.emitted = self.text.len();
            return Ok((piece, Some(FinishReason::Stop)));
        }
        let safe = self.text.len().saturating_sub(self.hold);
        let safe = (0..=safe).rev().find(|&i| self.text.is_char_boundary(i)).unwrap_or(0);
        if safe > self.emitted {
            let piece = self.text[self.emitted..safe].to_string();
            self.emitted = safe;
            return Ok((Some(piece), None));
        }
        Ok((None, None))
    }

    /// The sequence ended with `finish`: the text not shown yet (none when cancelled; a
    /// stop leaves no held-back text after the cut).
    pub(crate) fn finish(&mut self, tokenizer: &Tokenizer, finish: FinishReason) -> Result<Option<String>> {
        if finish != FinishReason::Stop {
            if let Some(rest) = self.decoder.finish(tokenizer)? {
                self.text.push_str(&rest);
            }
        }
        if finish == FinishReason::Cancelled || self.text.len() <= self.emitted {
            return Ok(None);
        }
        let piece = self.text[self.emitted..].to_string();
        self.emitted = self.text.len();
        Ok(Some(piece))
    }
}

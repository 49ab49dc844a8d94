//! Model hyper-parameters, read from a Hugging Face `config.json` (both the transformers 5
//! `rope_parameters` form and the older `rope_theta` + `rope_scaling` form) or from GGUF
//! metadata.

use serde::Serialize;

/// Supported decoder-only architectures. All share one block shape (RMSNorm, RoPE attention
/// with grouped-query heads, a gated MLP); how each differs from Llama is data, in
/// [`BlockSpec`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Arch {
    /// Llama 1/2/3, SmolLM2, TinyLlama.
    Llama,
    /// Mistral without sliding window (full causal attention).
    Mistral,
    /// Qwen2: Llama block with q/k/v projection biases.
    Qwen2,
    /// Gemma 3 (text): sandwich norms, q/k norms, GELU-tanh, a scaled embedding, and
    /// sliding-window attention on five layers of every six.
    Gemma3,
    /// Qwen3: the Llama block with q/k norms over each head, no biases.
    Qwen3,
    /// Phi-3: the Llama block with fused q|k|v and gate|up tensors (split at load) and
    /// LongRoPE scaling on the long-context models.
    Phi3,
}

impl Arch {
    /// The name GGUF's `general.architecture` uses.
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Mistral => "mistral",
            Arch::Qwen2 => "qwen2",
            Arch::Gemma3 => "gemma3",
            Arch::Qwen3 => "qwen3",
            Arch::Phi3 => "phi3",
        }
    }
}

/// Where the block's RMSNorms sit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum NormPlacement {
    /// `x += f(norm(x))` for attention and MLP (Llama).
    Pre,
    /// `x += norm_post(f(norm_pre(x)))` for both (Gemma 2/3): four norms per layer.
    Sandwich,
}

/// The gated MLP's activation: `down(act(gate x) * up x)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Activation {
    /// `x * sigmoid(x)` (Llama, Qwen, Mistral).
    Silu,
    /// `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))` (Gemma: `gelu_pytorch_tanh`).
    GeluTanh,
}

/// What one layer's attention sees.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LayerAttention {
    /// Every earlier key (full causal attention), RoPE base `rope_theta`.
    Full,
    /// The query and the `sliding_window - 1` keys before it, RoPE base
    /// `rope_local_theta` (Gemma 3's local layers).
    Sliding,
}

/// How an architecture's decoder block differs from Llama's, as data the forward passes
/// (GPU and CPU reference) read instead of branching on [`Arch`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BlockSpec {
    pub norms: NormPlacement,
    /// RMSNorm over each q and k head after the projection, before RoPE (Gemma 3, Qwen3).
    pub qk_norm: bool,
    pub activation: Activation,
    /// The embedding output is multiplied by this (Gemma: sqrt(hidden) rounded to f32); the
    /// tied LM head reads the unscaled table.
    pub embedding_scale: Option<f32>,
    /// Attention scores are multiplied by this (default `1/sqrt(head_dim)`; Gemma:
    /// `query_pre_attn_scalar^-1/2`).
    pub attention_scale: Option<f32>,
    /// Per layer: full or sliding-window attention (empty: every layer full).
    pub layer_attention: Vec<LayerAttention>,
    /// Keys a sliding layer's query sees, itself included.
    pub sliding_window: Option<usize>,
    /// RoPE base of the sliding layers (Gemma 3: 10000, while global layers use 1e6).
    pub rope_local_theta: Option<f64>,
    /// Hugging Face checkpoints of this architecture store every `*norm.weight` as `w` and
    /// apply `1 + w` (Gemma); Lantern, like GGUF, holds the applied value, so the HF loader
    /// adds this and the HF writer subtracts it. 0 elsewhere.
    pub hf_norm_offset: f32,
}

impl Default for BlockSpec {
    /// The Llama block.
    fn default() -> Self {
        BlockSpec {
            norms: NormPlacement::Pre,
            qk_norm: false,
            activation: Activation::Silu,
            embedding_scale: None,
            attention_scale: None,
            layer_attention: Vec::new(),
            sliding_window: None,
            rope_local_theta: None,
            hf_norm_offset: 0.0,
        }
    }
}

impl BlockSpec {
    /// Gemma 3's block for a model of `num_layers` layers of width `hidden`, with a local
    /// window of `window` keys (pattern 6: layer i is global iff (i + 1) % 6 == 0).
    pub fn gemma3(num_layers: usize, hidden: usize, window: usize, query_pre_attn_scalar: f64, local_theta: f64) -> Self {
        BlockSpec {
            norms: NormPlacement::Sandwich,
            qk_norm: true,
            activation: Activation::GeluTanh,
            // transformers: `torch.tensor(hidden ** 0.5, dtype=float32)`.
            embedding_scale: Some((hidden as f64).sqrt() as f32),
            attention_scale: Some((1.0 / query_pre_attn_scalar.sqrt()) as f32),
            layer_attention: Self::pattern(num_layers, 6),
            sliding_window: Some(window),
            rope_local_theta: Some(local_theta),
            hf_norm_offset: 1.0,
        }
    }

    /// Layer kinds for `every`-layer patterns: layer i is global iff (i + 1) % every == 0.
    pub fn pattern(num_layers: usize, every: usize) -> Vec<LayerAttention> {
        (0..num_layers).map(|i| if (i + 1) % every.max(1) == 0 { LayerAttention::Full } else { LayerAttention::Sliding }).collect()
    }

    /// The Llama block with every one of `num_layers` layers behind a `window`-key window
    /// (Mistral 7B v0.1, Phi-3-mini), on the global RoPE.
    pub fn uniform_window(self, num_layers: usize, window: usize) -> Self {
        BlockSpec { sliding_window: Some(window), layer_attention: vec![LayerAttention::Sliding; num_layers], ..self }
    }

    /// Whether a tensor is a norm weight (what [`BlockSpec::hf_norm_offset`] applies to).
    pub fn is_norm_weight(name: &str) -> bool {
        name.ends_with("norm.weight")
    }

    /// Layer `l`'s attention kind.
    pub fn attention(&self, l: usize) -> LayerAttention {
        self.layer_attention.get(l).copied().unwrap_or(LayerAttention::Full)
    }

    /// Keys layer `l`'s query may see (itself included): `None` for full attention.
    pub fn window(&self, l: usize) -> Option<usize> {
        match self.attention(l) {
            LayerAttention::Full => None,
            LayerAttention::Sliding => self.sliding_window,
        }
    }
}

/// RoPE frequency scaling.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub enum RopeScaling {
    /// Llama 3 scaling: low frequencies divided by `factor`, a smooth band in between.
    Llama3 {
        /// Divisor applied to low frequencies.
        factor: f64,
        /// Wavelengths above `original_max_position_embeddings / low_freq_factor` are divided.
        low_freq_factor: f64,
        /// Wavelengths below `original_max_position_embeddings / high_freq_factor` are kept.
        high_freq_factor: f64,
        /// Context length the model was pre-trained with.
        original_max_position_embeddings: f64,
    },
    /// Linear position interpolation: every frequency divided by `factor`.
    Linear {
        /// Divisor applied to every frequency.
        factor: f64,
    },
    /// Frequency `i` divided by `divisors[i]`: a GGUF's `rope_freqs.weight` taken as it is,
    /// when it matches no Llama 3 parameters Lantern can infer (llama.cpp applies the same
    /// tensor directly).
    Divisors { divisors: Vec<f32> },
    /// LongRoPE (Phi-3 128k): frequency `i` divided by `short_factor[i]` for sequences within
    /// `original_max_position_embeddings`, by `long_factor[i]` beyond, and cos/sin scaled by
    /// `attention_factor`. transformers switches sets with the current sequence length; Lantern
    /// picks one set per load, by the context it is loaded for (as llama.cpp does).
    LongRope { short_factor: Vec<f32>, long_factor: Vec<f32>, original_max_position_embeddings: f64, attention_factor: f64 },
}

/// Most decoder blocks a config may declare. Real models have at most a few hundred; the
/// bound keeps a corrupt layer count from sizing per-layer tables (Gemma 3's attention
/// pattern, Phi-3's unfusing loop) by billions before any tensor is looked at.
pub const MAX_LAYERS: usize = 1 << 16;

/// Everything the forward pass needs to know about a model's shape.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelConfig {
    /// Architecture family (from `model_type`).
    pub arch: Arch,
    /// Number of token ids (rows of the embedding and lm_head).
    pub vocab_size: usize,
    /// Width of the residual stream (`d_model`).
    pub hidden_size: usize,
    /// Width of the gated MLP (gate/up output, down input).
    pub intermediate_size: usize,
    /// Number of decoder blocks (`num_hidden_layers`).
    pub num_layers: usize,
    /// Query heads (`num_attention_heads`).
    pub num_heads: usize,
    /// Key/value heads (`num_key_value_heads`; equal to `num_heads` when absent).
    pub num_kv_heads: usize,
    /// Per-head width (`head_dim`, or `hidden_size / num_heads` when absent); even.
    pub head_dim: usize,
    /// RMSNorm epsilon, added to the mean square.
    pub rms_norm_eps: f32,
    /// RoPE base.
    pub rope_theta: f64,
    /// RoPE frequency scaling; `None` for the default (unscaled) RoPE.
    pub rope_scaling: Option<RopeScaling>,
    /// Longest context the model was configured for.
    pub max_position_embeddings: usize,
    /// lm_head shares the embedding matrix (no `lm_head.weight` needed).
    pub tie_word_embeddings: bool,
    /// q/k/v projections carry biases (Qwen2, or Llama with `attention_bias`).
    pub qkv_bias: bool,
    /// Beginning-of-sequence token, if the config names one.
    pub bos_token_id: Option<u32>,
    /// Tokens that end generation.
    pub eos_token_ids: Vec<u32>,
    /// How the block differs from Llama's (norm placement, q/k norms, activation, scales,
    /// sliding-window layers).
    pub block: BlockSpec,
}

impl ModelConfig {
    /// The exact inverse frequencies used by RoPE (length `head_dim / 2`), computed as
    /// transformers does (float32), including Llama 3 / linear scaling.
    pub fn rope_inv_freq(&self) -> Vec<f32> {
        self.rope_inv_freq_for(0)
    }

    /// The inverse frequencies for sequences of up to `seq_len` tokens (LongRoPE takes its
    /// long factors when `seq_len` passes the original context; other scalings ignore it).
    pub fn rope_inv_freq_for(&self, seq_len: usize) -> Vec<f32> {
        self.rope_inv_freq_with(self.rope_theta, self.rope_scaling.as_ref(), seq_len)
    }

    /// The inverse frequencies of layer `l` for sequences of up to `seq_len` tokens (sliding
    /// layers may have their own base, and are then never scaled).
    pub fn layer_rope_inv_freq(&self, l: usize, seq_len: usize) -> Vec<f32> {
        match (self.block.attention(l), self.block.rope_local_theta) {
            (LayerAttention::Sliding, Some(theta)) => self.rope_inv_freq_with(theta, None, seq_len),
            _ => self.rope_inv_freq_for(seq_len),
        }
    }

    /// The factor RoPE's cos and sin are multiplied by (LongRoPE's attention factor; 1
    /// otherwise).
    pub fn rope_attention_factor(&self) -> f32 {
        match &self.rope_scaling {
            Some(RopeScaling::LongRope { attention_factor, .. }) => *attention_factor as f32,
            _ => 1.0,
        }
    }

    /// Layers behind a sliding window (they see only the last `sliding_window` keys).
    pub fn sliding_layers(&self) -> usize {
        (0..self.num_layers).filter(|&l| self.block.window(l).is_some()).count()
    }

    /// Whether any layer uses a RoPE table other than the global one.
    pub fn has_local_rope(&self) -> bool {
        self.block.rope_local_theta.is_some() && self.block.layer_attention.contains(&LayerAttention::Sliding)
    }

    /// Attention's score scale.
    pub fn attention_scale(&self) -> f32 {
        self.block.attention_scale.unwrap_or((1.0 / (self.head_dim as f64).sqrt()) as f32)
    }

    fn rope_inv_freq_with(&self, theta: f64, scaling: Option<&RopeScaling>, seq_len: usize) -> Vec<f32> {
        let dim = self.head_dim;
        let base = theta as f32;
        let mut inv: Vec<f32> = (0..dim / 2).map(|i| 1.0f32 / base.powf((2 * i) as f32 / dim as f32)).collect();
        match scaling {
            None => {}
            Some(RopeScaling::Linear { factor }) => {
                for f in &mut inv {
                    *f /= *factor as f32;
                }
            }
            Some(RopeScaling::Divisors { divisors }) => {
                for (f, d) in inv.iter_mut().zip(divisors) {
                    *f /= *d;
                }
            }
            Some(RopeScaling::LongRope { short_factor, long_factor, original_max_position_embeddings, .. }) => {
                // transformers: 1 / (ext * base ** (2i / dim)), in f32.
                let ext = if seq_len as f64 > *original_max_position_embeddings { long_factor } else { short_factor };
                for (i, f) in inv.iter_mut().enumerate() {
                    *f = 1.0f32 / (ext[i] * base.powf((2 * i) as f32 / dim as f32));
                }
            }
            Some(&RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings: old_ctx }) => {
                // Same float32 operations, in the same order, as transformers'
                // `_compute_llama3_parameters` (Python scalars meet f32 tensors as f32).
                let low_wavelen = (old_ctx / low_freq_factor) as f32;
                let high_wavelen = (old_ctx / high_freq_factor) as f32;
                let factor = factor as f32;
                let band = (high_freq_factor - low_freq_factor) as f32;
                for f in &mut inv {
                    let wavelen = (2.0 * std::f64::consts::PI) as f32 / *f;
                    if wavelen < high_wavelen {
                        // unchanged
                    } else if wavelen > low_wavelen {
                        *f /= factor;
                    } else {
                        let smooth = (old_ctx as f32 / wavelen - low_freq_factor as f32) / band;
                        let v = *f;
                        *f = (1.0 - smooth) * v / factor + smooth * v;
                    }
                }
            }
        }
        inv
    }

    /// Number of query heads that share one KV head.
    pub fn group_size(&self) -> usize {
        self.num_heads / self.num_kv_heads
    }

    /// Width of the fused q|k|v projection output.
    pub fn qkv_dim(&self) -> usize {
        (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
    }
}

/// Reads Hugging Face `config.json` text into a [`ModelConfig`].
mod hf_json {
    use serde_json::{Map, Value};

    use super::{Arch, ModelConfig, RopeScaling, MAX_LAYERS};
    use crate::error::LanternError;
    use crate::model::LoadError;

    type Obj = Map<String, Value>;

    fn cfg_err(file: &str, field: &str, reason: impl std::fmt::Display) -> LanternError {
        LanternError::Config { field: field.to_string(), reason: format!("{reason} (in {file})") }
    }

    /// A present, non-null value.
    fn get<'a>(o: &'a Obj, key: &str) -> Option<&'a Value> {
        o.get(key).filter(|v| !v.is_null())
    }

    fn usize_field(o: &Obj, key: &str, file: &str) -> Result<Option<usize>, LanternError> {
        match get(o, key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .map(Some)
                .ok_or_else(|| cfg_err(file, key, format!("expected a non-negative integer, got {v}"))),
        }
    }

    fn required_usize(o: &Obj, key: &str, file: &str) -> Result<usize, LanternError> {
        let n = usize_field(o, key, file)?.ok_or_else(|| cfg_err(file, key, "missing"))?;
        if n == 0 {
            return Err(cfg_err(file, key, "must be positive, got 0"));
        }
        Ok(n)
    }

    fn f64_field(o: &Obj, key: &str, field: &str, file: &str) -> Result<Option<f64>, LanternError> {
        match get(o, key) {
            None => Ok(None),
            Some(v) => v.as_f64().map(Some).ok_or_else(|| cfg_err(file, field, format!("expected a number, got {v}"))),
        }
    }

    fn bool_field(o: &Obj, key: &str, file: &str) -> Result<Option<bool>, LanternError> {
        match get(o, key) {
            None => Ok(None),
            Some(v) => v.as_bool().map(Some).ok_or_else(|| cfg_err(file, key, format!("expected true or false, got {v}"))),
        }
    }

    fn token_id(v: &Value, field: &str, file: &str) -> Result<u32, LanternError> {
        v.as_u64().and_then(|n| u32::try_from(n).ok()).ok_or_else(|| cfg_err(file, field, format!("expected a token id, got {v}")))
    }

    /// Architecture from `model_type`, cross-checked with `architectures`.
    fn arch(o: &Obj, file: &str) -> Result<Arch, LanternError> {
        let from_class = |c: &str| match c {
            "LlamaForCausalLM" => Some(Arch::Llama),
            "MistralForCausalLM" => Some(Arch::Mistral),
            "Qwen2ForCausalLM" => Some(Arch::Qwen2),
            "Gemma3ForCausalLM" => Some(Arch::Gemma3),
            "Qwen3ForCausalLM" => Some(Arch::Qwen3),
            "Phi3ForCausalLM" => Some(Arch::Phi3),
            _ => None,
        };
        let classes: Vec<&str> = match get(o, "architectures") {
            Some(Value::Array(a)) => a.iter().filter_map(Value::as_str).collect(),
            Some(Value::String(s)) => vec![s.as_str()],
            _ => Vec::new(),
        };
        let model_type = get(o, "model_type").and_then(Value::as_str);
        let arch = match model_type {
            Some("llama") => Arch::Llama,
            Some("mistral") => Arch::Mistral,
            Some("qwen2") => Arch::Qwen2,
            Some("gemma3_text") => Arch::Gemma3,
            Some("qwen3") => Arch::Qwen3,
            Some("phi3") => Arch::Phi3,
            Some("gemma3") => {
                return Err(LanternError::UnsupportedArchitecture {
                    arch: "gemma3 (the multimodal Gemma3ForConditionalGeneration; its text model, model_type gemma3_text, is supported)"
                        .into(),
                })
            }
            Some(other) => return Err(LanternError::UnsupportedArchitecture { arch: other.to_string() }),
            None => match classes.first() {
                Some(c) => from_class(c).ok_or_else(|| LanternError::UnsupportedArchitecture { arch: c.to_string() })?,
                None => return Err(cfg_err(file, "model_type", "missing (and no `architectures` list)")),
            },
        };
        // A head other than the causal-LM one (e.g. `LlamaForSequenceClassification`) has no
        // lm_head to run; refuse rather than guess.
        if !classes.is_empty() && !classes.iter().any(|c| from_class(c).is_some()) {
            return Err(LanternError::UnsupportedArchitecture {
                arch: format!("{} (model_type {:?})", classes.join(", "), model_type.unwrap_or("?")),
            });
        }
        Ok(arch)
    }

    /// `(rope_theta, rope_scaling)` from `rope_parameters` (transformers 5) or the legacy
    /// top-level `rope_theta` + `rope_scaling`.
    fn rope(o: &Obj, file: &str) -> Result<(f64, Option<RopeScaling>), LanternError> {
        let mut params: Option<&Obj> = match get(o, "rope_parameters") {
            None => None,
            Some(Value::Object(p)) => Some(p),
            Some(v) => return Err(cfg_err(file, "rope_parameters", format!("expected an object, got {v}"))),
        };
        // Per-layer-type form ({"full_attention": {...}, "sliding_attention": {...}}): the
        // global layers' parameters here; `gemma3_block` reads the sliding ones.
        if let Some(p) = params {
            if !p.contains_key("rope_type") && !p.contains_key("rope_theta") {
                if let Some(Value::Object(full)) = p.get("full_attention") {
                    params = Some(full);
                }
            }
        }
        let legacy_scaling: Option<&Obj> = match get(o, "rope_scaling") {
            None => None,
            Some(Value::Object(p)) => Some(p),
            Some(v) => return Err(cfg_err(file, "rope_scaling", format!("expected an object or null, got {v}"))),
        };
        let theta = match params.map(|p| f64_field(p, "rope_theta", "rope_parameters.rope_theta", file)) {
            Some(r) => r?,
            None => None,
        };
        let theta = match theta {
            Some(t) => t,
            None => f64_field(o, "rope_theta", "rope_theta", file)?.unwrap_or(10000.0),
        };
        if !(theta.is_finite() && theta > 0.0) {
            return Err(cfg_err(file, "rope_theta", format!("must be a positive number, got {theta}")));
        }
        let (scaling, prefix): (Option<&Obj>, &str) = match (params, legacy_scaling) {
            (Some(p), _) => (Some(p), "rope_parameters"),
            (None, Some(s)) => (Some(s), "rope_scaling"),
            (None, None) => (None, ""),
        };
        let Some(s) = scaling else {
            return Ok((theta, None));
        };
        let kind = get(s, "rope_type")
            .or_else(|| get(s, "type"))
            .map(|v| v.as_str().map(str::to_string).unwrap_or_else(|| v.to_string()))
            .unwrap_or_else(|| "default".to_string());
        let num = |key: &str| -> Result<f64, LanternError> {
            let field = format!("{prefix}.{key}");
            let v =
                f64_field(s, key, &field, file)?.ok_or_else(|| cfg_err(file, &field, format!("missing (needed by rope_type `{kind}`)")))?;
            if !(v.is_finite() && v > 0.0) {
                return Err(cfg_err(file, &field, format!("must be a positive number, got {v}")));
            }
            Ok(v)
        };
        let scaling = match kind.as_str() {
            "default" => None,
            "linear" => Some(RopeScaling::Linear { factor: num("factor")? }),
            "llama3" => {
                let low = num("low_freq_factor")?;
                let high = num("high_freq_factor")?;
                if high <= low {
                    return Err(cfg_err(
                        file,
                        &format!("{prefix}.high_freq_factor"),
                        format!("must be greater than low_freq_factor ({high} <= {low})"),
                    ));
                }
                Some(RopeScaling::Llama3 {
                    factor: num("factor")?,
                    low_freq_factor: low,
                    high_freq_factor: high,
                    original_max_position_embeddings: num("original_max_position_embeddings")?,
                })
            }
            "longrope" | "su" => {
                let factors = |key: &str| -> Result<Vec<f32>, LanternError> {
                    let field = format!("{prefix}.{key}");
                    let a = get(s, key).and_then(Value::as_array).ok_or_else(|| cfg_err(file, &field, "missing (needed by LongRoPE)"))?;
                    a.iter()
                        .map(|v| v.as_f64().filter(|f| f.is_finite() && *f > 0.0).map(|f| f as f32))
                        .collect::<Option<Vec<f32>>>()
                        .ok_or_else(|| cfg_err(file, &field, "expected a list of positive numbers"))
                };
                let orig =
                    match f64_field(s, "original_max_position_embeddings", &format!("{prefix}.original_max_position_embeddings"), file)? {
                        Some(v) => v,
                        None => f64_field(o, "original_max_position_embeddings", "original_max_position_embeddings", file)?
                            .ok_or_else(|| cfg_err(file, "original_max_position_embeddings", "missing (needed by LongRoPE)"))?,
                    };
                if !(orig.is_finite() && orig >= 1.0) {
                    return Err(cfg_err(file, "original_max_position_embeddings", format!("must be a positive number, got {orig}")));
                }
                Some(RopeScaling::LongRope {
                    short_factor: factors("short_factor")?,
                    long_factor: factors("long_factor")?,
                    original_max_position_embeddings: orig,
                    // 0: not given; `parse` derives it from the context ratio.
                    attention_factor: f64_field(s, "attention_factor", &format!("{prefix}.attention_factor"), file)?.unwrap_or(0.0),
                })
            }
            other => {
                return Err(cfg_err(
                    file,
                    &format!("{prefix}.rope_type"),
                    format!("unsupported RoPE type `{other}` (supported: default, linear, llama3, longrope)"),
                ))
            }
        };
        for p in [Some(s), Some(o)].into_iter().flatten() {
            if let Some(f) = f64_field(p, "partial_rotary_factor", "partial_rotary_factor", file)? {
                if f != 1.0 {
                    return Err(cfg_err(file, "partial_rotary_factor", format!("partial rotary embeddings ({f}) are not supported")));
                }
            }
        }
        Ok((theta, scaling))
    }

    pub(super) fn parse(text: &str, file: &str) -> Result<ModelConfig, LanternError> {
        let root: Value = serde_json::from_str(text)
            .map_err(|e| LoadError::Invalid { file: file.to_string(), reason: format!("not valid JSON: {e}") })?;
        let Value::Object(o) = root else {
            return Err(LoadError::Invalid { file: file.to_string(), reason: "expected a JSON object at the top level".to_string() }.into());
        };
        let o = &o;
        let arch = arch(o, file)?;

        let want_act = if arch == Arch::Gemma3 { "gelu_pytorch_tanh" } else { "silu" };
        for key in ["hidden_act", "hidden_activation"] {
            if let Some(act) = get(o, key) {
                if act.as_str() != Some(want_act) {
                    return Err(cfg_err(file, key, format!("a {arch:?} model runs `{want_act}`, got {act}")));
                }
            }
        }

        let vocab_size = required_usize(o, "vocab_size", file)?;
        let hidden_size = required_usize(o, "hidden_size", file)?;
        let intermediate_size = required_usize(o, "intermediate_size", file)?;
        let num_layers = required_usize(o, "num_hidden_layers", file)?;
        if num_layers > MAX_LAYERS {
            return Err(cfg_err(file, "num_hidden_layers", format!("{num_layers} is more than the {MAX_LAYERS} layers a model may have")));
        }
        let num_heads = required_usize(o, "num_attention_heads", file)?;
        let num_kv_heads = usize_field(o, "num_key_value_heads", file)?.unwrap_or(num_heads);
        if num_kv_heads == 0 {
            return Err(cfg_err(file, "num_key_value_heads", "must be positive, got 0"));
        }
        if num_heads % num_kv_heads != 0 {
            return Err(cfg_err(
                file,
                "num_key_value_heads",
                format!("num_attention_heads ({num_heads}) is not a multiple of num_key_value_heads ({num_kv_heads})"),
            ));
        }
        let head_dim = match usize_field(o, "head_dim", file)? {
            Some(d) => d,
            None => {
                if hidden_size % num_heads != 0 {
                    return Err(cfg_err(
                        file,
                        "head_dim",
                        format!("absent, and hidden_size ({hidden_size}) is not a multiple of num_attention_heads ({num_heads})"),
                    ));
                }
                hidden_size / num_heads
            }
        };
        if head_dim == 0 || head_dim % 2 != 0 {
            return Err(cfg_err(file, "head_dim", format!("must be positive and even (RoPE pairs dimensions), got {head_dim}")));
        }

        let rms_norm_eps = f64_field(o, "rms_norm_eps", "rms_norm_eps", file)?.unwrap_or(1e-6);
        if !(rms_norm_eps.is_finite() && rms_norm_eps > 0.0) {
            return Err(cfg_err(file, "rms_norm_eps", format!("must be a positive number, got {rms_norm_eps}")));
        }
        let (rope_theta, rope_scaling) = rope(o, file)?;

        let default_max_pos = match arch {
            Arch::Llama => 2048,
            Arch::Mistral => 4096 * 32,
            Arch::Qwen2 => 32768,
            Arch::Gemma3 => 131072,
            Arch::Qwen3 => 40960,
            Arch::Phi3 => 4096,
        };
        let max_position_embeddings = usize_field(o, "max_position_embeddings", file)?.unwrap_or(default_max_pos);
        if max_position_embeddings == 0 {
            return Err(cfg_err(file, "max_position_embeddings", "must be positive, got 0"));
        }
        let tie_word_embeddings = bool_field(o, "tie_word_embeddings", file)?.unwrap_or(false);

        if bool_field(o, "mlp_bias", file)? == Some(true) {
            return Err(cfg_err(file, "mlp_bias", "MLP projection biases are not supported"));
        }
        let qkv_bias = match arch {
            Arch::Qwen2 => true,
            Arch::Mistral => false,
            Arch::Gemma3 | Arch::Qwen3 | Arch::Phi3 => {
                // Qwen3's `attention_bias` also biases o_proj; none of these has biases.
                if bool_field(o, "attention_bias", file)? == Some(true) {
                    return Err(cfg_err(file, "attention_bias", format!("{arch:?} attention biases (o_proj included) are not supported")));
                }
                false
            }
            Arch::Llama => {
                // In transformers' LlamaAttention `attention_bias` puts a bias on o_proj as
                // well as q/k/v, and an o_proj bias has no place in this runtime's block.
                if bool_field(o, "attention_bias", file)? == Some(true) {
                    return Err(cfg_err(
                        file,
                        "attention_bias",
                        "Llama `attention_bias: true` also adds an o_proj bias, which is not supported",
                    ));
                }
                false
            }
        };
        for key in ["o_proj_bias", "output_bias"] {
            if bool_field(o, key, file)? == Some(true) {
                return Err(cfg_err(file, key, "an o_proj bias is not supported"));
            }
        }

        // Mistral and Phi-3 may put every layer behind one window (Mistral 7B v0.1: 4096,
        // Phi-3-mini: 2047); Llama has none.
        let mut uniform_window = None;
        match arch {
            Arch::Mistral | Arch::Phi3 => {
                if let Some(w) = usize_field(o, "sliding_window", file)? {
                    if w == 0 {
                        return Err(cfg_err(file, "sliding_window", "must be positive, got 0"));
                    }
                    if w < max_position_embeddings {
                        uniform_window = Some(w);
                    }
                }
            }
            Arch::Llama => {
                if let Some(w) = usize_field(o, "sliding_window", file)? {
                    if w < max_position_embeddings {
                        return Err(cfg_err(file, "sliding_window", format!("Llama has no sliding window (got {w})")));
                    }
                }
            }
            Arch::Qwen2 | Arch::Qwen3 => {
                if bool_field(o, "use_sliding_window", file)? == Some(true) {
                    return Err(cfg_err(
                        file,
                        "use_sliding_window",
                        "sliding-window attention is not supported; only full causal attention is",
                    ));
                }
            }
            Arch::Gemma3 => {}
        }
        let mut block = match arch {
            Arch::Gemma3 => gemma3_block(o, file, num_layers, hidden_size, head_dim)?,
            Arch::Qwen3 => super::BlockSpec { qk_norm: true, ..Default::default() },
            _ => super::BlockSpec::default(),
        };
        if let Some(w) = uniform_window {
            block = block.uniform_window(num_layers, w);
        }
        let rope_scaling = match rope_scaling {
            Some(RopeScaling::LongRope { short_factor, long_factor, original_max_position_embeddings: orig, attention_factor }) => {
                let n = head_dim / 2;
                if short_factor.len() != n || long_factor.len() != n {
                    return Err(cfg_err(
                        file,
                        "rope_parameters.short_factor",
                        format!(
                            "LongRoPE needs head_dim / 2 = {n} factors, got {} short and {} long",
                            short_factor.len(),
                            long_factor.len()
                        ),
                    ));
                }
                // transformers: factor = max_position_embeddings / original, attention factor
                // sqrt(1 + ln(factor) / ln(original)) unless given.
                let factor = max_position_embeddings as f64 / orig;
                let attention_factor = if attention_factor > 0.0 {
                    attention_factor
                } else if factor <= 1.0 {
                    1.0
                } else {
                    (1.0 + factor.ln() / orig.ln()).sqrt()
                };
                Some(RopeScaling::LongRope { short_factor, long_factor, original_max_position_embeddings: orig, attention_factor })
            }
            other => other,
        };
        if let (Some(Value::Array(types)), false) = (get(o, "layer_types"), arch == Arch::Gemma3) {
            if let Some(t) = types.iter().find(|t| t.as_str() != Some("full_attention")) {
                return Err(cfg_err(file, "layer_types", format!("layer type {t} is not supported; only `full_attention` is")));
            }
        }

        let bos_token_id = match get(o, "bos_token_id") {
            None => None,
            Some(v) => Some(token_id(v, "bos_token_id", file)?),
        };
        let eos_token_ids = match get(o, "eos_token_id") {
            None => Vec::new(),
            Some(Value::Array(a)) => a.iter().map(|v| token_id(v, "eos_token_id", file)).collect::<Result<Vec<_>, _>>()?,
            Some(v) => vec![token_id(v, "eos_token_id", file)?],
        };

        Ok(ModelConfig {
            arch,
            vocab_size,
            hidden_size,
            intermediate_size,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            rms_norm_eps: rms_norm_eps as f32,
            rope_theta,
            rope_scaling,
            max_position_embeddings,
            tie_word_embeddings,
            qkv_bias,
            bos_token_id,
            eos_token_ids,
            block,
        })
    }

    /// Gemma 3's block from its config: window, layer types (or the 6-layer pattern), local
    /// RoPE base (per-layer-type `rope_parameters` or legacy `rope_local_base_freq`),
    /// `query_pre_attn_scalar`; soft-capping refused.
    fn gemma3_block(o: &Obj, file: &str, num_layers: usize, hidden: usize, head_dim: usize) -> Result<super::BlockSpec, LanternError> {
        for key in ["final_logit_softcapping", "attn_logit_softcapping"] {
            if get(o, key).is_some() {
                return Err(cfg_err(file, key, "logit soft-capping is not supported"));
            }
        }
        if bool_field(o, "use_bidirectional_attention", file)? == Some(true) {
            return Err(cfg_err(file, "use_bidirectional_attention", "bidirectional attention is not supported"));
        }
        let window = required_usize(o, "sliding_window", file)?;
        let scalar = f64_field(o, "query_pre_attn_scalar", "query_pre_attn_scalar", file)?.unwrap_or(head_dim as f64);
        if !(scalar.is_finite() && scalar > 0.0) {
            return Err(cfg_err(file, "query_pre_attn_scalar", format!("must be a positive number, got {scalar}")));
        }
        let local = match get(o, "rope_parameters").and_then(|p| p.get("sliding_attention")) {
            Some(Value::Object(sl)) => {
                if get(sl, "rope_type").and_then(Value::as_str).is_some_and(|t| t != "default") {
                    return Err(cfg_err(file, "rope_parameters.sliding_attention.rope_type", "only `default` is supported"));
                }
                f64_field(sl, "rope_theta", "rope_parameters.sliding_attention.rope_theta", file)?
            }
            _ => f64_field(o, "rope_local_base_freq", "rope_local_base_freq", file)?,
        }
        .unwrap_or(10000.0);
        let mut block = super::BlockSpec::gemma3(num_layers, hidden, window, scalar, local);
        match get(o, "layer_types") {
            Some(Value::Array(types)) => {
                if types.len() != num_layers {
                    return Err(cfg_err(file, "layer_types", format!("has {} entries for {num_layers} layers", types.len())));
                }
                block.layer_attention = types
                    .iter()
                    .map(|t| match t.as_str() {
                        Some("full_attention") => Ok(super::LayerAttention::Full),
                        Some("sliding_attention") => Ok(super::LayerAttention::Sliding),
                        _ => Err(cfg_err(file, "layer_types", format!("unknown layer type {t}"))),
                    })
                    .collect::<Result<_, _>>()?;
            }
            Some(v) => return Err(cfg_err(file, "layer_types", format!("expected a list, got {v}"))),
            None => {
                if let Some(n) = usize_field(o, "sliding_window_pattern", file)? {
                    if n == 0 {
                        return Err(cfg_err(file, "sliding_window_pattern", "must be positive, got 0"));
                    }
                    block.layer_attention = super::BlockSpec::pattern(num_layers, n);
                }
            }
        }
        Ok(block)
    }
}

impl ModelConfig {
    /// Parses a Hugging Face `config.json` (`text`; `file` names it in errors).
    ///
    /// Accepts `model_type` llama, mistral and qwen2 (any other gives
    /// [`LanternError::UnsupportedArchitecture`]), and both RoPE forms: transformers 5
    /// `rope_parameters` and legacy `rope_theta` + `rope_scaling` (`rope_type`/`type` of
    /// `default`, `linear` or `llama3`). Refuses, with a typed [`LanternError::Config`], what
    /// the runtime cannot run exactly: sliding-window attention, MLP or o_proj biases,
    /// activations other than SiLU, unknown RoPE types, and inconsistent sizes.
    ///
    /// [`LanternError::UnsupportedArchitecture`]: crate::LanternError::UnsupportedArchitecture
    /// [`LanternError::Config`]: crate::LanternError::Config
    pub fn from_hf_json(text: &str, file: &str) -> Result<ModelConfig, crate::LanternError> {
        hf_json::parse(text, file)
    }
}

impl ModelConfig {
    /// This config as Hugging Face `config.json` text that [`ModelConfig::from_hf_json`]
    /// reads back into an equal config (RoPE in both the `rope_parameters` and the legacy
    /// `rope_theta` + `rope_scaling` forms).
    ///
    /// Errors with [`LanternError::Config`](crate::LanternError::Config) for what
    /// `config.json` cannot say: q/k/v biases on a Llama or Mistral model.
    pub fn to_hf_json(&self) -> Result<String, crate::LanternError> {
        use serde_json::{json, Value};
        if self.qkv_bias && self.arch != Arch::Qwen2 {
            return Err(crate::LanternError::Config {
                field: "qkv_bias".into(),
                reason: format!("a {:?} model with q/k/v biases (and no o_proj bias) has no Hugging Face config.json form", self.arch),
            });
        }
        let (model_type, class) = match self.arch {
            Arch::Llama => ("llama", "LlamaForCausalLM"),
            Arch::Mistral => ("mistral", "MistralForCausalLM"),
            Arch::Qwen2 => ("qwen2", "Qwen2ForCausalLM"),
            Arch::Gemma3 => ("gemma3_text", "Gemma3ForCausalLM"),
            Arch::Qwen3 => ("qwen3", "Qwen3ForCausalLM"),
            Arch::Phi3 => {
                // Its folders hold fused qkv_proj / gate_up_proj tensors, which the writer
                // does not produce.
                return Err(crate::LanternError::Config {
                    field: "arch".into(),
                    reason: "writing Phi-3 folders is not supported (its checkpoints fuse q|k|v and gate|up)".into(),
                });
            }
        };
        // The shortest decimal that reads back as the same f32 (1e-5, not 9.99999974e-6).
        let eps: f64 = format!("{}", self.rms_norm_eps).parse().unwrap_or(self.rms_norm_eps as f64);
        let mut rope = json!({"rope_theta": self.rope_theta, "rope_type": "default"});
        let scaling = match self.rope_scaling.clone() {
            None => Value::Null,
            Some(RopeScaling::Divisors { .. }) => {
                return Err(crate::LanternError::Config {
                    field: "rope_scaling".into(),
                    reason: "per-frequency RoPE divisors from a GGUF have no config.json form".into(),
                })
            }
            Some(RopeScaling::LongRope { short_factor, long_factor, original_max_position_embeddings, attention_factor }) => json!({
                "rope_type": "longrope",
                "short_factor": short_factor,
                "long_factor": long_factor,
                "original_max_position_embeddings": original_max_position_embeddings,
                "attention_factor": attention_factor,
            }),
            Some(RopeScaling::Linear { factor }) => {
                json!({"rope_type": "linear", "factor": factor})
            }
            Some(RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings }) => json!({
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low_freq_factor,
                "high_freq_factor": high_freq_factor,
                "original_max_position_embeddings": original_max_position_embeddings,
            }),
        };
        if let (Value::Object(r), Value::Object(s)) = (&mut rope, &scaling) {
            for (k, v) in s {
                r.insert(k.clone(), v.clone());
            }
        }
        let mut o = json!({
            "architectures": [class],
            "model_type": model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": match self.block.activation {
                Activation::Silu => "silu",
                Activation::GeluTanh => "gelu_pytorch_tanh",
            },
            "rms_norm_eps": eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": scaling,
            "rope_parameters": rope,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "mlp_bias": false,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": match self.eos_token_ids.as_slice() {
                [] => Value::Null,
                [one] => json!(one),
                many => json!(many),
            },
        });
        match self.arch {
            Arch::Llama => o["attention_bias"] = json!(false),
            Arch::Mistral => o["sliding_window"] = json!(self.block.sliding_window),
            Arch::Qwen2 | Arch::Qwen3 => o["use_sliding_window"] = json!(false),
            Arch::Phi3 => {}
            Arch::Gemma3 => {
                let b = &self.block;
                o["attention_bias"] = json!(false);
                o["sliding_window"] = json!(b.sliding_window);
                o["layer_types"] = json!(b
                    .layer_attention
                    .iter()
                    .map(|a| match a {
                        LayerAttention::Full => "full_attention",
                        LayerAttention::Sliding => "sliding_attention",
                    })
                    .collect::<Vec<_>>());
                // 1/scale^2 (the scale is stored as f32; the scalar is an integer in practice).
                let scale = self.attention_scale() as f64;
                o["query_pre_attn_scalar"] = json!((1.0 / (scale * scale)).round());
                o["rope_local_base_freq"] = json!(b.rope_local_theta.unwrap_or(10000.0));
                o["rope_parameters"] = json!({
                    "full_attention": o["rope_parameters"].clone(),
                    "sliding_attention": {"rope_type": "default", "rope_theta": b.rope_local_theta.unwrap_or(10000.0)},
                });
                o["final_logit_softcapping"] = Value::Null;
                o["attn_logit_softcapping"] = Value::Null;
            }
        }
        serde_json::to_string_pretty(&o).map_err(|e| crate::LanternError::Serialize { what: "config.json".into(), reason: e.to_string() })
    }
}

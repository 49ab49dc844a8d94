//! Hugging Face `config.json` as derived serde structs: [`HfConfig`] is what the file says
//! (every field optional, as transformers writes them), [`parse`] checks it and builds a
//! [`ModelConfig`], and [`write`] is the inverse. A field of the wrong type is an error naming
//! its path (`rope_parameters.factor`, `eos_token_id`), from serde itself.

use serde::de::IgnoredAny;
use serde::{Deserialize, Serialize};

use super::{Activation, Arch, BlockSpec, LayerAttention, ModelConfig, MoeSpec, RopeScaling, MAX_LAYERS};
use crate::error::LanternError;
use crate::model::LoadError;

/// `config.json` of a decoder-only causal LM. Absent and `null` are both `None`; keys Lantern
/// does not read are ignored.
#[derive(Debug, Default, Deserialize, Serialize)]
#[serde(default)]
struct HfConfig {
    #[serde(skip_serializing_if = "Option::is_none")]
    architectures: Option<OneOrMany<String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    model_type: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    vocab_size: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    hidden_size: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    intermediate_size: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    num_hidden_layers: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    num_attention_heads: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    num_key_value_heads: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    head_dim: Option<usize>,
    /// Llama, Qwen, Mistral, Phi-3.
    #[serde(skip_serializing_if = "Option::is_none")]
    hidden_act: Option<String>,
    /// Gemma.
    #[serde(skip_serializing_if = "Option::is_none")]
    hidden_activation: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    rms_norm_eps: Option<f64>,
    /// Legacy RoPE form: `rope_theta` + `rope_scaling`.
    #[serde(skip_serializing_if = "Option::is_none")]
    rope_theta: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    rope_scaling: Option<RopeParams>,
    /// transformers 5 form (flat, or per layer type for Gemma 3).
    #[serde(skip_serializing_if = "Option::is_none")]
    rope_parameters: Option<RopeParams>,
    #[serde(skip_serializing_if = "Option::is_none")]
    original_max_position_embeddings: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    partial_rotary_factor: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    max_position_embeddings: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tie_word_embeddings: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    mlp_bias: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    attention_bias: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    o_proj_bias: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    output_bias: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    sliding_window: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    use_sliding_window: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    sliding_window_pattern: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    layer_types: Option<Vec<String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    query_pre_attn_scalar: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    rope_local_base_freq: Option<f64>,
    /// Present and not null: refused (any value).
    #[serde(skip_serializing)]
    final_logit_softcapping: Option<IgnoredAny>,
    #[serde(skip_serializing)]
    attn_logit_softcapping: Option<IgnoredAny>,
    #[serde(skip_serializing_if = "Option::is_none")]
    use_bidirectional_attention: Option<bool>,
    /// Mixtures of experts: Qwen3-MoE's `num_experts`, Mixtral's `num_local_experts`.
    #[serde(skip_serializing_if = "Option::is_none")]
    num_experts: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    num_local_experts: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    num_experts_per_tok: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    moe_intermediate_size: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    norm_topk_prob: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    decoder_sparse_step: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    mlp_only_layers: Option<Vec<usize>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    shared_expert_intermediate_size: Option<usize>,
    /// OLMoE: refused when set.
    #[serde(skip_serializing_if = "Option::is_none")]
    clip_qkv: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    bos_token_id: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    eos_token_id: Option<OneOrMany<u32>>,
}

/// One RoPE parameter set (`rope_parameters`, `rope_scaling`), or, for Gemma 3, one per layer
/// type (`full_attention`, `sliding_attention`).
#[derive(Debug, Default, Clone, Deserialize, Serialize)]
#[serde(default)]
struct RopeParams {
    #[serde(skip_serializing_if = "Option::is_none")]
    rope_type: Option<String>,
    /// The legacy name of `rope_type`.
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    legacy_type: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    rope_theta: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    factor: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    low_freq_factor: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    high_freq_factor: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    original_max_position_embeddings: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    short_factor: Option<Vec<f64>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    long_factor: Option<Vec<f64>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    attention_factor: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    partial_rotary_factor: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    full_attention: Option<Box<RopeParams>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    sliding_attention: Option<Box<RopeParams>>,
}

/// A value or a list of them (`eos_token_id`, `architectures`).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(
    untagged,
    expecting = "expected one value or a list of values (token ids: non-negative integers below 2^32; architectures: strings)"
)]
enum OneOrMany<T> {
    One(T),
    Many(Vec<T>),
}

impl<T: Clone> OneOrMany<T> {
    fn to_vec(&self) -> Vec<T> {
        match self {
            OneOrMany::One(v) => vec![v.clone()],
            OneOrMany::Many(v) => v.clone(),
        }
    }
}

fn cfg_err(file: &str, field: &str, reason: impl std::fmt::Display) -> LanternError {
    LanternError::Config { field: field.to_string(), reason: format!("{reason} (in {file})") }
}

/// `n`, which must be positive (`field` names it).
fn positive(n: Option<usize>, field: &str, file: &str) -> Result<Option<usize>, LanternError> {
    match n {
        Some(0) => Err(cfg_err(file, field, "must be positive, got 0")),
        n => Ok(n),
    }
}

fn required(n: Option<usize>, field: &str, file: &str) -> Result<usize, LanternError> {
    positive(n, field, file)?.ok_or_else(|| cfg_err(file, field, "missing"))
}

/// A finite number above zero.
fn positive_f64(v: f64, field: &str, file: &str) -> Result<f64, LanternError> {
    if v.is_finite() && v > 0.0 {
        Ok(v)
    } else {
        Err(cfg_err(file, field, format!("must be a positive number, got {v}")))
    }
}

const CAUSAL_LM_CLASSES: [(&str, Arch); 9] = [
    ("LlamaForCausalLM", Arch::Llama),
    ("MistralForCausalLM", Arch::Mistral),
    ("Qwen2ForCausalLM", Arch::Qwen2),
    ("Gemma3ForCausalLM", Arch::Gemma3),
    ("Qwen3ForCausalLM", Arch::Qwen3),
    ("Phi3ForCausalLM", Arch::Phi3),
    ("Qwen3MoeForCausalLM", Arch::Qwen3Moe),
    ("MixtralForCausalLM", Arch::Mixtral),
    ("OlmoeForCausalLM", Arch::Olmoe),
];

const MODEL_TYPES: [(&str, Arch); 9] = [
    ("llama", Arch::Llama),
    ("mistral", Arch::Mistral),
    ("qwen2", Arch::Qwen2),
    ("gemma3_text", Arch::Gemma3),
    ("qwen3", Arch::Qwen3),
    ("phi3", Arch::Phi3),
    ("qwen3_moe", Arch::Qwen3Moe),
    ("mixtral", Arch::Mixtral),
    ("olmoe", Arch::Olmoe),
];

fn lookup(table: &[(&str, Arch)], key: &str) -> Option<Arch> {
    table.iter().find(|(k, _)| *k == key).map(|&(_, a)| a)
}

fn names(arch: Arch) -> (&'static str, &'static str) {
    let model_type = MODEL_TYPES.iter().find(|(_, a)| *a == arch).map(|(k, _)| *k).unwrap_or("?");
    let class = CAUSAL_LM_CLASSES.iter().find(|(_, a)| *a == arch).map(|(k, _)| *k).unwrap_or("?");
    (model_type, class)
}

/// Architecture from `model_type`, cross-checked with `architectures`.
fn arch(c: &HfConfig, file: &str) -> Result<Arch, LanternError> {
    let classes = c.architectures.as_ref().map(OneOrMany::to_vec).unwrap_or_default();
    let arch = match c.model_type.as_deref() {
        Some("gemma3") => {
            return Err(LanternError::UnsupportedArchitecture {
                arch: "gemma3 (the multimodal Gemma3ForConditionalGeneration; its text model, model_type gemma3_text, is supported)".into(),
            })
        }
        Some(t) => lookup(&MODEL_TYPES, t).ok_or_else(|| LanternError::UnsupportedArchitecture { arch: t.to_string() })?,
        None => match classes.first() {
            Some(cls) => lookup(&CAUSAL_LM_CLASSES, cls).ok_or_else(|| LanternError::UnsupportedArchitecture { arch: cls.to_string() })?,
            None => return Err(cfg_err(file, "model_type", "missing (and no `architectures` list)")),
        },
    };
    // A head other than the causal-LM one (e.g. `LlamaForSequenceClassification`) has no
    // lm_head to run; refuse rather than guess.
    if !classes.is_empty() && !classes.iter().any(|cls| lookup(&CAUSAL_LM_CLASSES, cls).is_some()) {
        return Err(LanternError::UnsupportedArchitecture {
            arch: format!("{} (model_type {:?})", classes.join(", "), c.model_type.as_deref().unwrap_or("?")),
        });
    }
    Ok(arch)
}

/// `(rope_theta, rope_scaling)` from `rope_parameters` (transformers 5) or the legacy
/// top-level `rope_theta` + `rope_scaling`.
fn rope(c: &HfConfig, file: &str) -> Result<(f64, Option<RopeScaling>), LanternError> {
    let mut params = c.rope_parameters.as_ref();
    // Per-layer-type form ({"full_attention": {...}, "sliding_attention": {...}}): the global
    // layers' parameters here; `gemma3_block` reads the sliding ones.
    if let Some(p) = params {
        if p.rope_type.is_none() && p.rope_theta.is_none() {
            if let Some(full) = &p.full_attention {
                params = Some(full);
            }
        }
    }
    let (theta, theta_field) = match params.and_then(|p| p.rope_theta) {
        Some(t) => (t, "rope_parameters.rope_theta"),
        None => (c.rope_theta.unwrap_or(10000.0), "rope_theta"),
    };
    let theta = positive_f64(theta, theta_field, file)?;
    let (s, prefix) = match (params, &c.rope_scaling) {
        (Some(p), _) => (p, "rope_parameters"),
        (None, Some(s)) => (s, "rope_scaling"),
        (None, None) => return Ok((theta, None)),
    };
    let kind = s.rope_type.as_deref().or(s.legacy_type.as_deref()).unwrap_or("default");
    let field = |key: &str| format!("{prefix}.{key}");
    let num = |v: Option<f64>, key: &str| -> Result<f64, LanternError> {
        let v = v.ok_or_else(|| cfg_err(file, &field(key), format!("missing (needed by rope_type `{kind}`)")))?;
        positive_f64(v, &field(key), file)
    };
    let scaling = match kind {
        "default" => None,
        "linear" => Some(RopeScaling::Linear { factor: num(s.factor, "factor")? }),
        "llama3" => {
            let low = num(s.low_freq_factor, "low_freq_factor")?;
            let high = num(s.high_freq_factor, "high_freq_factor")?;
            if high <= low {
                return Err(cfg_err(file, &field("high_freq_factor"), format!("must be greater than low_freq_factor ({high} <= {low})")));
            }
            Some(RopeScaling::Llama3 {
                factor: num(s.factor, "factor")?,
                low_freq_factor: low,
                high_freq_factor: high,
                original_max_position_embeddings: num(s.original_max_position_embeddings, "original_max_position_embeddings")?,
            })
        }
        "longrope" | "su" => {
            let factors = |v: &Option<Vec<f64>>, key: &str| -> Result<Vec<f32>, LanternError> {
                let a = v.as_ref().ok_or_else(|| cfg_err(file, &field(key), "missing (needed by LongRoPE)"))?;
                a.iter()
                    .map(|&f| (f.is_finite() && f > 0.0).then_some(f as f32))
                    .collect::<Option<Vec<f32>>>()
                    .ok_or_else(|| cfg_err(file, &field(key), "expected a list of positive numbers"))
            };
            let orig = s
                .original_max_position_embeddings
                .or(c.original_max_position_embeddings)
                .ok_or_else(|| cfg_err(file, "original_max_position_embeddings", "missing (needed by LongRoPE)"))?;
            if !(orig.is_finite() && orig >= 1.0) {
                return Err(cfg_err(file, "original_max_position_embeddings", format!("must be a positive number, got {orig}")));
            }
            Some(RopeScaling::LongRope {
                short_factor: factors(&s.short_factor, "short_factor")?,
                long_factor: factors(&s.long_factor, "long_factor")?,
                original_max_position_embeddings: orig,
                // 0: not given; `parse` derives it from the context ratio.
                attention_factor: s.attention_factor.unwrap_or(0.0),
            })
        }
        other => {
            return Err(cfg_err(
                file,
                &field("rope_type"),
                format!("unsupported RoPE type `{other}` (supported: default, linear, llama3, longrope)"),
            ))
        }
    };
    for f in [s.partial_rotary_factor, c.partial_rotary_factor].into_iter().flatten() {
        if f != 1.0 {
            return Err(cfg_err(file, "partial_rotary_factor", format!("partial rotary embeddings ({f}) are not supported")));
        }
    }
    Ok((theta, scaling))
}

/// Parses `text` (the contents of `file`) into a [`ModelConfig`].
pub(super) fn parse(text: &str, file: &str) -> Result<ModelConfig, LanternError> {
    let root: serde_json::Value =
        serde_json::from_str(text).map_err(|e| LoadError::Invalid { file: file.to_string(), reason: format!("not valid JSON: {e}") })?;
    if !root.is_object() {
        return Err(LoadError::Invalid { file: file.to_string(), reason: "expected a JSON object at the top level".to_string() }.into());
    }
    let c: HfConfig = serde_path_to_error::deserialize(root).map_err(|e| {
        let path = e.path().to_string();
        cfg_err(file, &path, e.into_inner())
    })?;
    let arch = arch(&c, file)?;

    let want_act = if arch == Arch::Gemma3 { "gelu_pytorch_tanh" } else { "silu" };
    for (key, act) in [("hidden_act", &c.hidden_act), ("hidden_activation", &c.hidden_activation)] {
        if let Some(act) = act.as_deref().filter(|a| *a != want_act) {
            return Err(cfg_err(file, key, format!("a {arch:?} model runs `{want_act}`, got `{act}`")));
        }
    }

    let vocab_size = required(c.vocab_size, "vocab_size", file)?;
    let hidden_size = required(c.hidden_size, "hidden_size", file)?;
    let intermediate_size = required(c.intermediate_size, "intermediate_size", file)?;
    let num_layers = required(c.num_hidden_layers, "num_hidden_layers", file)?;
    if num_layers > MAX_LAYERS {
        return Err(cfg_err(file, "num_hidden_layers", format!("{num_layers} is more than the {MAX_LAYERS} layers a model may have")));
    }
    let num_heads = required(c.num_attention_heads, "num_attention_heads", file)?;
    let num_kv_heads = positive(c.num_key_value_heads, "num_key_value_heads", file)?.unwrap_or(num_heads);
    if num_heads % num_kv_heads != 0 {
        return Err(cfg_err(
            file,
            "num_key_value_heads",
            format!("num_attention_heads ({num_heads}) is not a multiple of num_key_value_heads ({num_kv_heads})"),
        ));
    }
    let head_dim = match c.head_dim {
        Some(d) => d,
        None if hidden_size % num_heads != 0 => {
            return Err(cfg_err(
                file,
                "head_dim",
                format!("absent, and hidden_size ({hidden_size}) is not a multiple of num_attention_heads ({num_heads})"),
            ))
        }
        None => hidden_size / num_heads,
    };
    if head_dim == 0 || head_dim % 2 != 0 {
        return Err(cfg_err(file, "head_dim", format!("must be positive and even (RoPE pairs dimensions), got {head_dim}")));
    }

    let rms_norm_eps = positive_f64(c.rms_norm_eps.unwrap_or(1e-6), "rms_norm_eps", file)?;
    let (rope_theta, rope_scaling) = rope(&c, file)?;

    let default_max_pos = match arch {
        Arch::Llama => 2048,
        Arch::Mistral => 4096 * 32,
        Arch::Qwen2 => 32768,
        Arch::Gemma3 => 131072,
        Arch::Qwen3 => 40960,
        Arch::Phi3 => 4096,
        Arch::Qwen3Moe => 32768,
        Arch::Mixtral => 4096 * 32,
        Arch::Olmoe => 4096,
    };
    let max_position_embeddings = positive(c.max_position_embeddings, "max_position_embeddings", file)?.unwrap_or(default_max_pos);
    let tie_word_embeddings = c.tie_word_embeddings.unwrap_or(false);

    if c.mlp_bias == Some(true) {
        return Err(cfg_err(file, "mlp_bias", "MLP projection biases are not supported"));
    }
    let attention_bias = c.attention_bias == Some(true);
    let qkv_bias = match arch {
        Arch::Qwen2 => true,
        Arch::Mistral | Arch::Mixtral => false,
        // Qwen3's `attention_bias` also biases o_proj; none of these has biases.
        Arch::Gemma3 | Arch::Qwen3 | Arch::Qwen3Moe | Arch::Olmoe | Arch::Phi3 if attention_bias => {
            return Err(cfg_err(file, "attention_bias", format!("{arch:?} attention biases (o_proj included) are not supported")))
        }
        // In transformers' LlamaAttention `attention_bias` puts a bias on o_proj as well as
        // q/k/v, and an o_proj bias has no place in this runtime's block.
        Arch::Llama if attention_bias => {
            return Err(cfg_err(file, "attention_bias", "Llama `attention_bias: true` also adds an o_proj bias, which is not supported"))
        }
        _ => false,
    };
    for (key, bias) in [("o_proj_bias", c.o_proj_bias), ("output_bias", c.output_bias)] {
        if bias == Some(true) {
            return Err(cfg_err(file, key, "an o_proj bias is not supported"));
        }
    }

    // Mistral and Phi-3 may put every layer behind one window (Mistral 7B v0.1: 4096,
    // Phi-3-mini: 2047); Llama has none.
    let mut uniform_window = None;
    match arch {
        Arch::Mistral | Arch::Mixtral | Arch::Phi3 => {
            if let Some(w) = positive(c.sliding_window, "sliding_window", file)? {
                if w < max_position_embeddings {
                    uniform_window = Some(w);
                }
            }
        }
        Arch::Llama => {
            if let Some(w) = c.sliding_window.filter(|&w| w < max_position_embeddings) {
                return Err(cfg_err(file, "sliding_window", format!("Llama has no sliding window (got {w})")));
            }
        }
        Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen3Moe => {
            if c.use_sliding_window == Some(true) {
                return Err(cfg_err(
                    file,
                    "use_sliding_window",
                    "sliding-window attention is not supported; only full causal attention is",
                ));
            }
        }
        Arch::Gemma3 => {}
        Arch::Olmoe => {
            if c.clip_qkv.is_some() {
                return Err(cfg_err(file, "clip_qkv", "clipping q/k/v is not supported"));
            }
        }
    }
    let mut block = match arch {
        Arch::Gemma3 => gemma3_block(&c, file, num_layers, hidden_size, head_dim)?,
        Arch::Qwen3 => BlockSpec { qk_norm: true, ..Default::default() },
        Arch::Qwen3Moe => BlockSpec { qk_norm: true, moe: Some(moe(&c, file, arch, num_layers, intermediate_size)?), ..Default::default() },
        Arch::Mixtral => BlockSpec { moe: Some(moe(&c, file, arch, num_layers, intermediate_size)?), ..Default::default() },
        Arch::Olmoe => BlockSpec {
            qk_norm: true,
            qk_norm_whole: true,
            moe: Some(moe(&c, file, arch, num_layers, intermediate_size)?),
            ..Default::default()
        },
        _ => BlockSpec::default(),
    };
    if !matches!(arch, Arch::Qwen3Moe | Arch::Mixtral | Arch::Olmoe)
        && (c.num_experts.unwrap_or(0) > 0 || c.num_local_experts.unwrap_or(0) > 0)
    {
        return Err(cfg_err(file, "num_experts", format!("a {arch:?} model has no experts")));
    }
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
                    format!("LongRoPE needs head_dim / 2 = {n} factors, got {} short and {} long", short_factor.len(), long_factor.len()),
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
    if let (Some(types), false) = (&c.layer_types, arch == Arch::Gemma3) {
        if let Some(t) = types.iter().find(|t| *t != "full_attention") {
            return Err(cfg_err(file, "layer_types", format!("layer type `{t}` is not supported; only `full_attention` is")));
        }
    }

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
        bos_token_id: c.bos_token_id,
        eos_token_ids: c.eos_token_id.as_ref().map(OneOrMany::to_vec).unwrap_or_default(),
        block,
    })
}

/// The mixture of experts of a Qwen3-MoE or Mixtral config (`intermediate`: the dense MLP's
/// width, which Mixtral's experts share).
fn moe(c: &HfConfig, file: &str, arch: Arch, num_layers: usize, intermediate: usize) -> Result<MoeSpec, LanternError> {
    if c.shared_expert_intermediate_size.unwrap_or(0) > 0 {
        return Err(cfg_err(file, "shared_expert_intermediate_size", "shared experts are not supported"));
    }
    // transformers 5 writes `num_local_experts` for every family (Qwen3-MoE's own checkpoints
    // say `num_experts`).
    let (experts_field, experts) = match (c.num_experts, c.num_local_experts) {
        (Some(n), _) => ("num_experts", n),
        (None, Some(n)) => ("num_local_experts", n),
        (None, None) if arch == Arch::Mixtral => ("num_local_experts", 8),
        (None, None) => return Err(cfg_err(file, "num_experts", "missing")),
    };
    let (per_token, expert_intermediate, renormalize) = match arch {
        Arch::Mixtral => (c.num_experts_per_tok.unwrap_or(2), intermediate, true),
        // OLMoE's experts have the model's intermediate size.
        Arch::Olmoe => (required(c.num_experts_per_tok, "num_experts_per_tok", file)?, intermediate, c.norm_topk_prob.unwrap_or(false)),
        _ => (
            required(c.num_experts_per_tok, "num_experts_per_tok", file)?,
            required(c.moe_intermediate_size, "moe_intermediate_size", file)?,
            c.norm_topk_prob.unwrap_or(false),
        ),
    };
    if experts == 0 {
        return Err(cfg_err(file, experts_field, "must be positive, got 0"));
    }
    if per_token == 0 || per_token > experts {
        return Err(cfg_err(file, "num_experts_per_tok", format!("must be between 1 and {experts_field} ({experts}), got {per_token}")));
    }
    let step = positive(c.decoder_sparse_step, "decoder_sparse_step", file)?.unwrap_or(1);
    let dense = c.mlp_only_layers.clone().unwrap_or_default();
    if let Some(&l) = dense.iter().find(|&&l| l >= num_layers) {
        return Err(cfg_err(file, "mlp_only_layers", format!("names layer {l} of {num_layers}")));
    }
    let sparse_layers = (0..num_layers).map(|l| !dense.contains(&l) && (l + 1) % step == 0).collect();
    Ok(MoeSpec { experts, experts_per_token: per_token, expert_intermediate, renormalize, sparse_layers })
}

/// Gemma 3's block from its config: window, layer types (or the 6-layer pattern), local RoPE
/// base (per-layer-type `rope_parameters` or legacy `rope_local_base_freq`),
/// `query_pre_attn_scalar`; soft-capping refused.
fn gemma3_block(c: &HfConfig, file: &str, num_layers: usize, hidden: usize, head_dim: usize) -> Result<BlockSpec, LanternError> {
    for (key, cap) in [("final_logit_softcapping", &c.final_logit_softcapping), ("attn_logit_softcapping", &c.attn_logit_softcapping)] {
        if cap.is_some() {
            return Err(cfg_err(file, key, "logit soft-capping is not supported"));
        }
    }
    if c.use_bidirectional_attention == Some(true) {
        return Err(cfg_err(file, "use_bidirectional_attention", "bidirectional attention is not supported"));
    }
    let window = required(c.sliding_window, "sliding_window", file)?;
    let scalar = positive_f64(c.query_pre_attn_scalar.unwrap_or(head_dim as f64), "query_pre_attn_scalar", file)?;
    let local = match c.rope_parameters.as_ref().and_then(|p| p.sliding_attention.as_ref()) {
        Some(sl) => {
            if sl.rope_type.as_deref().is_some_and(|t| t != "default") {
                return Err(cfg_err(file, "rope_parameters.sliding_attention.rope_type", "only `default` is supported"));
            }
            sl.rope_theta
        }
        None => c.rope_local_base_freq,
    }
    .unwrap_or(10000.0);
    let mut block = BlockSpec::gemma3(num_layers, hidden, window, scalar, local);
    match &c.layer_types {
        Some(types) => {
            if types.len() != num_layers {
                return Err(cfg_err(file, "layer_types", format!("has {} entries for {num_layers} layers", types.len())));
            }
            block.layer_attention = types
                .iter()
                .map(|t| match t.as_str() {
                    "full_attention" => Ok(LayerAttention::Full),
                    "sliding_attention" => Ok(LayerAttention::Sliding),
                    _ => Err(cfg_err(file, "layer_types", format!("unknown layer type `{t}`"))),
                })
                .collect::<Result<_, _>>()?;
        }
        None => {
            if let Some(n) = positive(c.sliding_window_pattern, "sliding_window_pattern", file)? {
                block.layer_attention = BlockSpec::pattern(num_layers, n);
            }
        }
    }
    Ok(block)
}

/// `config` as `config.json` text (see [`ModelConfig::to_hf_json`]).
pub(super) fn write(config: &ModelConfig) -> Result<String, LanternError> {
    let m = config;
    if m.qkv_bias && m.arch != Arch::Qwen2 {
        return Err(LanternError::Config {
            field: "qkv_bias".into(),
            reason: format!("a {:?} model with q/k/v biases (and no o_proj bias) has no Hugging Face config.json form", m.arch),
        });
    }
    if m.block.moe.is_some() {
        return Err(LanternError::Config { field: "arch".into(), reason: "writing mixture-of-experts folders is not supported".into() });
    }
    if m.arch == Arch::Phi3 {
        // Its folders hold fused qkv_proj / gate_up_proj tensors, which the writer does not
        // produce.
        return Err(LanternError::Config {
            field: "arch".into(),
            reason: "writing Phi-3 folders is not supported (its checkpoints fuse q|k|v and gate|up)".into(),
        });
    }
    let (model_type, class) = names(m.arch);
    // The shortest decimal that reads back as the same f32 (1e-5, not 9.99999974e-6).
    let eps: f64 = format!("{}", m.rms_norm_eps).parse().unwrap_or(m.rms_norm_eps as f64);
    let scaling = match m.rope_scaling.clone() {
        None => None,
        Some(RopeScaling::Divisors { .. }) => {
            return Err(LanternError::Config {
                field: "rope_scaling".into(),
                reason: "per-frequency RoPE divisors from a GGUF have no config.json form".into(),
            })
        }
        Some(RopeScaling::LongRope { short_factor, long_factor, original_max_position_embeddings, attention_factor }) => Some(RopeParams {
            rope_type: Some("longrope".into()),
            short_factor: Some(short_factor.iter().map(|&f| f as f64).collect()),
            long_factor: Some(long_factor.iter().map(|&f| f as f64).collect()),
            original_max_position_embeddings: Some(original_max_position_embeddings),
            attention_factor: Some(attention_factor),
            ..Default::default()
        }),
        Some(RopeScaling::Linear { factor }) => {
            Some(RopeParams { rope_type: Some("linear".into()), factor: Some(factor), ..Default::default() })
        }
        Some(RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings }) => Some(RopeParams {
            rope_type: Some("llama3".into()),
            factor: Some(factor),
            low_freq_factor: Some(low_freq_factor),
            high_freq_factor: Some(high_freq_factor),
            original_max_position_embeddings: Some(original_max_position_embeddings),
            ..Default::default()
        }),
    };
    // Both forms: `rope_parameters` (the theta and the scaling in one set) and the legacy
    // `rope_theta` + `rope_scaling`.
    let mut rope = scaling.clone().unwrap_or_else(|| RopeParams { rope_type: Some("default".into()), ..Default::default() });
    rope.rope_theta = Some(m.rope_theta);
    let mut c = HfConfig {
        architectures: Some(OneOrMany::Many(vec![class.to_string()])),
        model_type: Some(model_type.to_string()),
        vocab_size: Some(m.vocab_size),
        hidden_size: Some(m.hidden_size),
        intermediate_size: Some(m.intermediate_size),
        num_hidden_layers: Some(m.num_layers),
        num_attention_heads: Some(m.num_heads),
        num_key_value_heads: Some(m.num_kv_heads),
        head_dim: Some(m.head_dim),
        hidden_act: Some(
            match m.block.activation {
                Activation::Silu => "silu",
                Activation::GeluTanh => "gelu_pytorch_tanh",
            }
            .into(),
        ),
        rms_norm_eps: Some(eps),
        rope_theta: Some(m.rope_theta),
        rope_scaling: scaling,
        rope_parameters: Some(rope),
        max_position_embeddings: Some(m.max_position_embeddings),
        tie_word_embeddings: Some(m.tie_word_embeddings),
        mlp_bias: Some(false),
        bos_token_id: m.bos_token_id,
        eos_token_id: match m.eos_token_ids.as_slice() {
            [] => None,
            [one] => Some(OneOrMany::One(*one)),
            many => Some(OneOrMany::Many(many.to_vec())),
        },
        ..Default::default()
    };
    match m.arch {
        Arch::Llama => c.attention_bias = Some(false),
        Arch::Mistral => c.sliding_window = m.block.sliding_window,
        Arch::Qwen2 | Arch::Qwen3 => c.use_sliding_window = Some(false),
        Arch::Phi3 | Arch::Qwen3Moe | Arch::Mixtral | Arch::Olmoe => {}
        Arch::Gemma3 => {
            let b = &m.block;
            let local = b.rope_local_theta.unwrap_or(10000.0);
            c.attention_bias = Some(false);
            c.sliding_window = b.sliding_window;
            c.layer_types = Some(
                b.layer_attention
                    .iter()
                    .map(|a| match a {
                        LayerAttention::Full => "full_attention".to_string(),
                        LayerAttention::Sliding => "sliding_attention".to_string(),
                    })
                    .collect(),
            );
            // 1/scale^2 (the scale is stored as f32; the scalar is an integer in practice).
            let scale = m.attention_scale() as f64;
            c.query_pre_attn_scalar = Some((1.0 / (scale * scale)).round());
            c.rope_local_base_freq = Some(local);
            c.rope_parameters = Some(RopeParams {
                full_attention: c.rope_parameters.take().map(Box::new),
                sliding_attention: Some(Box::new(RopeParams {
                    rope_type: Some("default".into()),
                    rope_theta: Some(local),
                    ..Default::default()
                })),
                ..Default::default()
            });
        }
    }
    serde_json::to_string_pretty(&c).map_err(|e| LanternError::Serialize { what: "config.json".into(), reason: e.to_string() })
}

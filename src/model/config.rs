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
    /// Qwen3-MoE: the Qwen3 block with a mixture of experts for the MLP ([`MoeSpec`]; some
    /// layers may keep a dense MLP). CPU reference only so far.
    Qwen3Moe,
    /// Mixtral: the Mistral block with a mixture of experts for the MLP. CPU reference only
    /// so far.
    Mixtral,
    /// OLMoE: the Llama block with q/k RMSNorms over the whole projection (not each head) and
    /// a mixture of experts for the MLP. CPU reference only so far.
    Olmoe,
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
            Arch::Qwen3Moe => "qwen3moe",
            // GGUF files of Mixtral say `llama` (with an expert count).
            Arch::Mixtral => "llama",
            Arch::Olmoe => "olmoe",
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
    /// With `qk_norm`: the norms run over the whole q and k projections instead of each head
    /// (OLMoE: weights of `n_heads * head_dim` and `n_kv_heads * head_dim`).
    pub qk_norm_whole: bool,
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
    /// A mixture of experts in place of the dense MLP (Qwen3-MoE, Mixtral).
    pub moe: Option<MoeSpec>,
}

/// A mixture-of-experts MLP: a router (`[experts, hidden]`) scores the experts for each
/// token, the `experts_per_token` most probable (softmax) run their own gated MLP of width
/// `expert_intermediate`, and their outputs are summed weighted by those probabilities,
/// renormalised over the chosen experts with `renormalize` (Mixtral always; Qwen3-MoE with
/// `norm_topk_prob`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MoeSpec {
    pub experts: usize,
    pub experts_per_token: usize,
    pub expert_intermediate: usize,
    pub renormalize: bool,
    /// Per layer: whether its MLP is the mixture (false: a dense MLP of `intermediate_size`,
    /// Qwen3-MoE's `mlp_only_layers`); empty: every layer.
    pub sparse_layers: Vec<bool>,
}

impl MoeSpec {
    /// Whether layer `l`'s MLP is the mixture of experts.
    pub fn is_sparse(&self, l: usize) -> bool {
        self.sparse_layers.get(l).copied().unwrap_or(true)
    }
}

impl Default for BlockSpec {
    /// The Llama block.
    fn default() -> Self {
        BlockSpec {
            norms: NormPlacement::Pre,
            qk_norm: false,
            qk_norm_whole: false,
            activation: Activation::Silu,
            embedding_scale: None,
            attention_scale: None,
            layer_attention: Vec::new(),
            sliding_window: None,
            rope_local_theta: None,
            hf_norm_offset: 0.0,
            moe: None,
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
            qk_norm_whole: false,
            activation: Activation::GeluTanh,
            // transformers: `torch.tensor(hidden ** 0.5, dtype=float32)`.
            embedding_scale: Some((hidden as f64).sqrt() as f32),
            attention_scale: Some((1.0 / query_pre_attn_scalar.sqrt()) as f32),
            layer_attention: Self::pattern(num_layers, 6),
            sliding_window: Some(window),
            rope_local_theta: Some(local_theta),
            hf_norm_offset: 1.0,
            moe: None,
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

    /// Layer `l`'s mixture of experts, when its MLP is one.
    pub fn experts(&self, l: usize) -> Option<&MoeSpec> {
        self.moe.as_ref().filter(|m| m.is_sparse(l))
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

    /// Expert parameters a token does not read: in each mixture-of-experts layer, the gate,
    /// up and down projections of the experts the router leaves out (0 for dense models).
    pub fn idle_expert_parameters(&self) -> u64 {
        (0..self.num_layers)
            .filter_map(|l| self.block.experts(l))
            .map(|m| {
                // Saturating: a corrupt file's sizes may overflow (the plan then fits nothing).
                [m.experts.saturating_sub(m.experts_per_token), 3, m.expert_intermediate, self.hidden_size]
                    .iter()
                    .fold(1u64, |a, &x| a.saturating_mul(x as u64))
            })
            .fold(0u64, u64::saturating_add)
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

mod hf_json;

impl ModelConfig {
    /// Parses a Hugging Face `config.json` (`text`; `file` names it in errors).
    ///
    /// Accepts `model_type` llama, mistral, qwen2, qwen3, gemma3_text and phi3 (any other
    /// gives [`LanternError::UnsupportedArchitecture`]), and both RoPE forms: transformers 5
    /// `rope_parameters` and legacy `rope_theta` + `rope_scaling` (`rope_type`/`type` of
    /// `default`, `linear`, `llama3` or `longrope`). Refuses, with a typed
    /// [`LanternError::Config`] naming the field's path, what the runtime cannot run exactly:
    /// sliding-window attention where the family has none, MLP or o_proj biases, another
    /// activation than the family's, unknown RoPE types, a field of the wrong type, and
    /// inconsistent sizes.
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
        hf_json::write(self)
    }
}

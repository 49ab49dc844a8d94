//! The whole forward pass as plain loops over f32 weights (f64 accumulation): the oracle for
//! the GPU forward pass. Mirrors transformers' `LlamaForCausalLM` / `Qwen2ForCausalLM` /
//! `MistralForCausalLM` (eager attention, full causal mask):
//! <https://github.com/huggingface/transformers/blob/main/src/transformers/models/llama/modeling_llama.py>,
//! and `Gemma3ForCausalLM` (`models/gemma3/modeling_gemma3.py`) through the config's
//! [`BlockSpec`](crate::model::BlockSpec): sandwich norms, q/k norms, GELU-tanh, the
//! embedding scale, sliding-window layers with their own RoPE base.

use super::ops;
use crate::error::LanternError;
use crate::model::validate::validate;
use crate::model::{ModelConfig, ModelWeights};

/// One decoder block's weights, dequantized to f32.
struct RefLayer {
    input_norm: Vec<f32>,     // (hidden)
    q: Vec<f32>,              // (n_heads * head_dim, hidden)
    k: Vec<f32>,              // (n_kv_heads * head_dim, hidden)
    v: Vec<f32>,              // (n_kv_heads * head_dim, hidden)
    q_bias: Option<Vec<f32>>, // (n_heads * head_dim)
    k_bias: Option<Vec<f32>>, // (n_kv_heads * head_dim)
    v_bias: Option<Vec<f32>>, // (n_kv_heads * head_dim)
    o: Vec<f32>,              // (hidden, n_heads * head_dim)
    /// q/k norms over each head (head_dim), with `BlockSpec::qk_norm`.
    qk_norm: Option<(Vec<f32>, Vec<f32>)>,
    /// Sandwich norms of the attention and MLP outputs (hidden each).
    attn_out_norm: Option<Vec<f32>>,
    mlp_out_norm: Option<Vec<f32>>,
    /// The MLP input's norm.
    post_norm: Vec<f32>, // (hidden)
    window: Option<usize>,
    gate: Vec<f32>, // (intermediate, hidden)
    up: Vec<f32>,   // (intermediate, hidden)
    down: Vec<f32>, // (hidden, intermediate)
}

/// A CPU reference model: every weight converted to f32 with `HostTensor::to_f32`.
pub struct ReferenceModel {
    config: ModelConfig,
    embed: Vec<f32>, // (vocab, hidden)
    layers: Vec<RefLayer>,
    norm: Vec<f32>,            // (hidden)
    lm_head: Option<Vec<f32>>, // (vocab, hidden); None when tied to `embed`
}

impl ReferenceModel {
    /// Builds the reference from loaded weights, after checking them with
    /// [`validate`](crate::model::validate::validate).
    pub fn new(weights: &ModelWeights) -> Result<Self, LanternError> {
        validate(weights)?;
        let c = weights.config.clone();
        // `validate` guarantees presence, so indexing cannot fail.
        let get = |name: &str| weights.tensors[name].to_f32();
        let opt = |name: &str| weights.tensors.get(name).map(|t| t.to_f32());
        let layers = (0..c.num_layers)
            .map(|l| {
                let p = format!("model.layers.{l}");
                let bias = |n: &str| {
                    if c.qkv_bias {
                        opt(&format!("{p}.self_attn.{n}_proj.bias"))
                    } else {
                        None
                    }
                };
                let norms = crate::model::validate::layer_norm_names(&c, l);
                RefLayer {
                    qk_norm: c
                        .block
                        .qk_norm
                        .then(|| (get(&format!("{p}.self_attn.q_norm.weight")), get(&format!("{p}.self_attn.k_norm.weight")))),
                    attn_out_norm: norms.attn_out.as_deref().map(get),
                    mlp_out_norm: norms.mlp_out.as_deref().map(get),
                    window: c.block.window(l),
                    input_norm: get(&norms.attn_in),
                    q: get(&format!("{p}.self_attn.q_proj.weight")),
                    k: get(&format!("{p}.self_attn.k_proj.weight")),
                    v: get(&format!("{p}.self_attn.v_proj.weight")),
                    q_bias: bias("q"),
                    k_bias: bias("k"),
                    v_bias: bias("v"),
                    o: get(&format!("{p}.self_attn.o_proj.weight")),
                    post_norm: get(&norms.mlp_in),
                    gate: get(&format!("{p}.mlp.gate_proj.weight")),
                    up: get(&format!("{p}.mlp.up_proj.weight")),
                    down: get(&format!("{p}.mlp.down_proj.weight")),
                }
            })
            .collect();
        Ok(ReferenceModel {
            embed: get("model.embed_tokens.weight"),
            norm: get("model.norm.weight"),
            lm_head: if c.tie_word_embeddings { None } else { Some(get("lm_head.weight")) },
            layers,
            config: c,
        })
    }

    /// The model's config.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// One decoder block applied to the residual stream `x` (`[T, hidden]`, positions `0..T`).
    /// `inv_freq`: this layer's RoPE frequencies for the sequence's length.
    fn layer(&self, layer: &RefLayer, x: &[f32], positions: &[usize], inv_freq: &[f32]) -> Vec<f32> {
        let c = &self.config;
        let (h, hd) = (c.hidden_size, c.head_dim);
        let (qd, kvd) = (c.num_heads * hd, c.num_kv_heads * hd);

        let n = ops::rmsnorm(x, &layer.input_norm, c.rms_norm_eps);
        let q = ops::linear(&n, &layer.q, layer.q_bias.as_deref(), h, qd);
        let k = ops::linear(&n, &layer.k, layer.k_bias.as_deref(), h, kvd);
        let v = ops::linear(&n, &layer.v, layer.v_bias.as_deref(), h, kvd);
        // q/k norms run over each head's head_dim values.
        let (q, k) = match &layer.qk_norm {
            Some((qn, kn)) => (ops::rmsnorm(&q, qn, c.rms_norm_eps), ops::rmsnorm(&k, kn, c.rms_norm_eps)),
            None => (q, k),
        };
        let m = c.rope_attention_factor();
        let q = ops::rope_scaled(&q, positions, c.num_heads, hd, inv_freq, m);
        let k = ops::rope_scaled(&k, positions, c.num_kv_heads, hd, inv_freq, m);
        let a = ops::attention_windowed(&q, &k, &v, positions, c.num_heads, c.num_kv_heads, hd, c.attention_scale(), layer.window);
        let out_norm = |y: Vec<f32>, w: &Option<Vec<f32>>| match w {
            Some(w) => ops::rmsnorm(&y, w, c.rms_norm_eps),
            None => y,
        };
        let x = ops::add(x, &out_norm(ops::linear(&a, &layer.o, None, qd, h), &layer.attn_out_norm));

        let n = ops::rmsnorm(&x, &layer.post_norm, c.rms_norm_eps);
        let ffn = c.intermediate_size;
        let g = ops::linear(&n, &layer.gate, None, h, ffn);
        let u = ops::linear(&n, &layer.up, None, h, ffn);
        let act = match c.block.activation {
            crate::model::Activation::Silu => ops::silu_mul(&g, &u),
            crate::model::Activation::GeluTanh => ops::gelu_tanh_mul(&g, &u),
        };
        let m = ops::linear(&act, &layer.down, None, ffn, h);
        ops::add(&x, &out_norm(m, &layer.mlp_out_norm))
    }

    /// The residual stream of a full causal pass over `tokens` (positions `0..T`): element 0
    /// is the embedding output and element `l + 1` the stream after layer `l`, each
    /// `[T, hidden]` row-major. For locating where a GPU pass first diverges.
    ///
    /// # Panics
    /// If a token id is `>= vocab_size`.
    pub fn forward_hidden(&self, tokens: &[u32]) -> Vec<Vec<f32>> {
        let c = &self.config;
        let positions: Vec<usize> = (0..tokens.len()).collect();
        let mut states = Vec::with_capacity(c.num_layers + 1);
        let mut e = ops::embedding(&self.embed, c.vocab_size, c.hidden_size, tokens);
        if let Some(scale) = c.block.embedding_scale {
            // transformers multiplies in the activation dtype (f32).
            e.iter_mut().for_each(|v| *v *= scale);
        }
        states.push(e);
        for (l, layer) in self.layers.iter().enumerate() {
            // transformers picks LongRoPE's factor set by the sequence's length.
            let inv_freq = c.layer_rope_inv_freq(l, tokens.len());
            let next = self.layer(layer, states.last().map(Vec::as_slice).unwrap_or(&[]), &positions, &inv_freq);
            states.push(next);
        }
        states
    }

    /// Final norm and lm_head (or the tied embedding) over residual rows `[T, hidden]`.
    fn head(&self, x: &[f32]) -> Vec<f32> {
        let c = &self.config;
        let n = ops::rmsnorm(x, &self.norm, c.rms_norm_eps);
        let w = self.lm_head.as_deref().unwrap_or(&self.embed);
        ops::linear(&n, w, None, c.hidden_size, c.vocab_size)
    }

    /// Logits `[T, vocab]` (row-major) for every position of a full causal pass over
    /// `tokens`, positions `0..T`.
    ///
    /// # Panics
    /// If a token id is `>= vocab_size`.
    pub fn forward(&self, tokens: &[u32]) -> Vec<f32> {
        let states = self.forward_hidden(tokens);
        states.last().map(|x| self.head(x)).unwrap_or_default()
    }

    /// Greedy decoding without a KV cache: appends the argmax (lowest id on ties) of the last
    /// position `n` times, re-running the whole sequence each step. Returns the `n` new tokens
    /// only. Fine for tiny models; quadratic in length.
    ///
    /// # Panics
    /// If `prompt` is empty or holds a token id `>= vocab_size`.
    pub fn greedy(&self, prompt: &[u32], n: usize) -> Vec<u32> {
        assert!(!prompt.is_empty(), "greedy: empty prompt");
        let h = self.config.hidden_size;
        let mut seq = prompt.to_vec();
        for _ in 0..n {
            let states = self.forward_hidden(&seq);
            let x = states.last().map(Vec::as_slice).unwrap_or(&[]);
            let logits = self.head(&x[x.len() - h..]);
            seq.push(ops::argmax(&logits));
        }
        seq.split_off(prompt.len())
    }
}

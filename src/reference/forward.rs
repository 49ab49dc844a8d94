//! The whole Llama-family forward pass as plain loops over f32 weights (f64 accumulation):
//! the oracle for the GPU forward pass. Mirrors transformers' `LlamaForCausalLM` /
//! `Qwen2ForCausalLM` / `MistralForCausalLM` (eager attention, full causal mask):
//! <https://github.com/huggingface/transformers/blob/main/src/transformers/models/llama/modeling_llama.py>.

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
    post_norm: Vec<f32>,      // (hidden)
    gate: Vec<f32>,           // (intermediate, hidden)
    up: Vec<f32>,             // (intermediate, hidden)
    down: Vec<f32>,           // (hidden, intermediate)
}

/// A CPU reference model: every weight converted to f32 with `HostTensor::to_f32`.
pub struct ReferenceModel {
    config: ModelConfig,
    embed: Vec<f32>, // (vocab, hidden)
    layers: Vec<RefLayer>,
    norm: Vec<f32>,            // (hidden)
    lm_head: Option<Vec<f32>>, // (vocab, hidden); None when tied to `embed`
    inv_freq: Vec<f32>,        // (head_dim / 2)
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
                RefLayer {
                    input_norm: get(&format!("{p}.input_layernorm.weight")),
                    q: get(&format!("{p}.self_attn.q_proj.weight")),
                    k: get(&format!("{p}.self_attn.k_proj.weight")),
                    v: get(&format!("{p}.self_attn.v_proj.weight")),
                    q_bias: bias("q"),
                    k_bias: bias("k"),
                    v_bias: bias("v"),
                    o: get(&format!("{p}.self_attn.o_proj.weight")),
                    post_norm: get(&format!("{p}.post_attention_layernorm.weight")),
                    gate: get(&format!("{p}.mlp.gate_proj.weight")),
                    up: get(&format!("{p}.mlp.up_proj.weight")),
                    down: get(&format!("{p}.mlp.down_proj.weight")),
                }
            })
            .collect();
        Ok(ReferenceModel {
            embed: get("model.embed_tokens.weight"),
            norm: get("model.norm.weight"),
            lm_head: if c.tie_word_embeddings {
                None
            } else {
                Some(get("lm_head.weight"))
            },
            inv_freq: c.rope_inv_freq(),
            layers,
            config: c,
        })
    }

    /// The model's config.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// One decoder block applied to the residual stream `x` (`[T, hidden]`, positions `0..T`).
    fn layer(&self, layer: &RefLayer, x: &[f32], positions: &[usize]) -> Vec<f32> {
        let c = &self.config;
        let (h, hd) = (c.hidden_size, c.head_dim);
        let (qd, kvd) = (c.num_heads * hd, c.num_kv_heads * hd);

        let n = ops::rmsnorm(x, &layer.input_norm, c.rms_norm_eps);
        let q = ops::linear(&n, &layer.q, layer.q_bias.as_deref(), h, qd);
        let k = ops::linear(&n, &layer.k, layer.k_bias.as_deref(), h, kvd);
        let v = ops::linear(&n, &layer.v, layer.v_bias.as_deref(), h, kvd);
        let q = ops::rope(&q, positions, c.num_heads, hd, &self.inv_freq);
        let k = ops::rope(&k, positions, c.num_kv_heads, hd, &self.inv_freq);
        let scale = (1.0 / (hd as f64).sqrt()) as f32;
        let a = ops::attention(
            &q,
            &k,
            &v,
            positions,
            c.num_heads,
            c.num_kv_heads,
            hd,
            scale,
        );
        let x = ops::add(x, &ops::linear(&a, &layer.o, None, qd, h));

        let n = ops::rmsnorm(&x, &layer.post_norm, c.rms_norm_eps);
        let ffn = c.intermediate_size;
        let g = ops::linear(&n, &layer.gate, None, h, ffn);
        let u = ops::linear(&n, &layer.up, None, h, ffn);
        let m = ops::linear(&ops::silu_mul(&g, &u), &layer.down, None, ffn, h);
        ops::add(&x, &m)
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
        states.push(ops::embedding(
            &self.embed,
            c.vocab_size,
            c.hidden_size,
            tokens,
        ));
        for layer in &self.layers {
            let next = self.layer(
                layer,
                states.last().map(Vec::as_slice).unwrap_or(&[]),
                &positions,
            );
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

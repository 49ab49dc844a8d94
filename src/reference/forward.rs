//! The whole forward pass as plain loops over f32 weights (f64 accumulation): the oracle for
//! the GPU forward pass. Mirrors transformers' `LlamaForCausalLM` / `Qwen2ForCausalLM` /
//! `MistralForCausalLM` (eager attention, full causal mask):
//! <https://github.com/huggingface/transformers/blob/main/src/transformers/models/llama/modeling_llama.py>,
//! and `Gemma3ForCausalLM` (`models/gemma3/modeling_gemma3.py`) through the config's
//! [`BlockSpec`](crate::model::BlockSpec): sandwich norms, q/k norms, GELU-tanh, the
//! embedding scale, sliding-window layers with their own RoPE base.
//!
//! The decoder stack itself ([`run`]) is shared: a [`Pass`] chooses how the linear layers are
//! computed (here [`ops::linear`]) and sees every linear layer's input and the residual
//! stream after each layer. AWQ's calibration (`quant/awq/calibrate.rs`) runs the same
//! blocks with threaded f32 matrix products and records the inputs.

use super::ops;
use crate::error::LanternError;
use crate::model::validate::{expert_names, layer_norm_names, validate};
use crate::model::{ModelConfig, ModelWeights, MoeSpec};

/// The linear layers of a decoder block, by the input they share.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LinearInput {
    /// q/k/v projections: the attention input norm's output.
    Qkv,
    /// o_proj: the attention output.
    O,
    /// gate/up projections: the MLP input norm's output.
    GateUp,
    /// down_proj: the gated activation, `act(gate) * up`.
    Down,
}

/// How [`run`] computes the linear layers, and what it is told along the way. Every method
/// has a default: the reference's f64 [`ops::linear`], and nothing observed.
pub trait Pass {
    /// `y = x W^T + b` for `x: [T, k]`, `w: [n, k]`; returns `[T, n]`.
    fn linear(&self, x: &[f32], w: &[f32], bias: Option<&[f32]>, k: usize, n: usize) -> Vec<f32> {
        ops::linear(x, w, bias, k, n)
    }

    /// The input `x` (`[T, k]`) of layer `layer`'s linear layers `input`, before they run.
    fn input(&mut self, layer: usize, input: LinearInput, x: &[f32], k: usize) {
        let _ = (layer, input, x, k);
    }

    /// The residual stream `[T, hidden]` after `index` layers (0: the embedding output).
    fn state(&mut self, index: usize, x: &[f32]) {
        let _ = (index, x);
    }
}

/// One decoder block's weights: `W` is `Vec<f32>` in [`ReferenceModel`] (dequantized with
/// `HostTensor::to_f32`), `&[f32]` while [`run`] reads them.
#[derive(Debug, Clone)]
pub struct Layer<W> {
    pub input_norm: W,     // (hidden)
    pub q: W,              // (n_heads * head_dim, hidden)
    pub k: W,              // (n_kv_heads * head_dim, hidden)
    pub v: W,              // (n_kv_heads * head_dim, hidden)
    pub q_bias: Option<W>, // (n_heads * head_dim)
    pub k_bias: Option<W>, // (n_kv_heads * head_dim)
    pub v_bias: Option<W>, // (n_kv_heads * head_dim)
    pub o: W,              // (hidden, n_heads * head_dim)
    /// q/k norms over each head (head_dim), with `BlockSpec::qk_norm`; over the whole
    /// projection with `qk_norm_whole` (their width says which).
    pub qk_norm: Option<(W, W)>,
    /// Sandwich norms of the attention and MLP outputs (hidden each).
    pub attn_out_norm: Option<W>,
    pub mlp_out_norm: Option<W>,
    /// The MLP input's norm.
    pub post_norm: W, // (hidden)
    pub window: Option<usize>,
    pub mlp: Mlp<W>,
}

/// A decoder block's MLP.
#[derive(Debug, Clone)]
pub enum Mlp<W> {
    /// `down(act(gate x) * up x)`.
    Dense {
        gate: W, // (intermediate, hidden)
        up: W,   // (intermediate, hidden)
        down: W, // (hidden, intermediate)
    },
    /// A mixture of experts ([`MoeSpec`](crate::model::MoeSpec)): the router
    /// `(experts, hidden)` and each expert's gate, up (`(expert_intermediate, hidden)`) and
    /// down (`(hidden, expert_intermediate)`).
    Experts { router: W, experts: Vec<[W; 3]> },
}

impl<W> Layer<W> {
    /// Layer `l`'s weights by their Hugging Face names: `get` fetches the ones the config
    /// requires, `opt` the q/k/v biases (looked up only with `qkv_bias`).
    pub fn by_name<E>(
        c: &ModelConfig,
        l: usize,
        mut get: impl FnMut(&str) -> Result<W, E>,
        mut opt: impl FnMut(&str) -> Option<W>,
    ) -> Result<Self, E> {
        let p = format!("model.layers.{l}");
        let mut bias = |n: &str| if c.qkv_bias { opt(&format!("{p}.self_attn.{n}_proj.bias")) } else { None };
        let norms = layer_norm_names(c, l);
        Ok(Layer {
            qk_norm: match c.block.qk_norm {
                true => Some((get(&format!("{p}.self_attn.q_norm.weight"))?, get(&format!("{p}.self_attn.k_norm.weight"))?)),
                false => None,
            },
            attn_out_norm: norms.attn_out.as_deref().map(&mut get).transpose()?,
            mlp_out_norm: norms.mlp_out.as_deref().map(&mut get).transpose()?,
            window: c.block.window(l),
            input_norm: get(&norms.attn_in)?,
            q: get(&format!("{p}.self_attn.q_proj.weight"))?,
            k: get(&format!("{p}.self_attn.k_proj.weight"))?,
            v: get(&format!("{p}.self_attn.v_proj.weight"))?,
            q_bias: bias("q"),
            k_bias: bias("k"),
            v_bias: bias("v"),
            o: get(&format!("{p}.self_attn.o_proj.weight"))?,
            post_norm: get(&norms.mlp_in)?,
            mlp: match expert_names(c, l) {
                Some(names) => Mlp::Experts {
                    router: get(&names.router)?,
                    experts: names.experts.iter().map(|[g, u, d]| Ok([get(g)?, get(u)?, get(d)?])).collect::<Result<_, E>>()?,
                },
                None => Mlp::Dense {
                    gate: get(&format!("{p}.mlp.gate_proj.weight"))?,
                    up: get(&format!("{p}.mlp.up_proj.weight"))?,
                    down: get(&format!("{p}.mlp.down_proj.weight"))?,
                },
            },
        })
    }
}

impl Layer<Vec<f32>> {
    /// The same weights, borrowed.
    pub fn view(&self) -> Layer<&[f32]> {
        let v = Vec::as_slice;
        Layer {
            input_norm: v(&self.input_norm),
            q: v(&self.q),
            k: v(&self.k),
            v: v(&self.v),
            q_bias: self.q_bias.as_deref(),
            k_bias: self.k_bias.as_deref(),
            v_bias: self.v_bias.as_deref(),
            o: v(&self.o),
            qk_norm: self.qk_norm.as_ref().map(|(q, k)| (v(q), v(k))),
            attn_out_norm: self.attn_out_norm.as_deref(),
            mlp_out_norm: self.mlp_out_norm.as_deref(),
            post_norm: v(&self.post_norm),
            window: self.window,
            mlp: match &self.mlp {
                Mlp::Dense { gate, up, down } => Mlp::Dense { gate: v(gate), up: v(up), down: v(down) },
                Mlp::Experts { router, experts } => {
                    Mlp::Experts { router: v(router), experts: experts.iter().map(|[g, u, d]| [v(g), v(u), v(d)]).collect() }
                }
            },
        }
    }
}

/// One decoder block (layer `l`, weights `w`) applied to the residual stream `x`
/// (`[T, hidden]`, positions `0..T`). `inv_freq`: this layer's RoPE frequencies for the
/// sequence's length.
#[allow(clippy::too_many_arguments)]
fn layer(c: &ModelConfig, l: usize, w: &Layer<&[f32]>, x: &[f32], positions: &[usize], inv_freq: &[f32], pass: &mut dyn Pass) -> Vec<f32> {
    let (h, hd) = (c.hidden_size, c.head_dim);
    let (qd, kvd) = (c.num_heads * hd, c.num_kv_heads * hd);

    let n = ops::rmsnorm(x, w.input_norm, c.rms_norm_eps);
    pass.input(l, LinearInput::Qkv, &n, h);
    let q = pass.linear(&n, w.q, w.q_bias, h, qd);
    let k = pass.linear(&n, w.k, w.k_bias, h, kvd);
    let v = pass.linear(&n, w.v, w.v_bias, h, kvd);
    // q/k norms run over each head's head_dim values.
    let (q, k) = match w.qk_norm {
        Some((qn, kn)) => (ops::rmsnorm(&q, qn, c.rms_norm_eps), ops::rmsnorm(&k, kn, c.rms_norm_eps)),
        None => (q, k),
    };
    let m = c.rope_attention_factor();
    let q = ops::rope_scaled(&q, positions, c.num_heads, hd, inv_freq, m);
    let k = ops::rope_scaled(&k, positions, c.num_kv_heads, hd, inv_freq, m);
    let a = ops::attention_windowed(&q, &k, &v, positions, c.num_heads, c.num_kv_heads, hd, c.attention_scale(), w.window);
    let out_norm = |y: Vec<f32>, norm: Option<&[f32]>| match norm {
        Some(g) => ops::rmsnorm(&y, g, c.rms_norm_eps),
        None => y,
    };
    pass.input(l, LinearInput::O, &a, qd);
    let x = ops::add(x, &out_norm(pass.linear(&a, w.o, None, qd, h), w.attn_out_norm));

    let n = ops::rmsnorm(&x, w.post_norm, c.rms_norm_eps);
    pass.input(l, LinearInput::GateUp, &n, h);
    let m = match &w.mlp {
        Mlp::Dense { gate, up, down } => {
            let ffn = c.intermediate_size;
            let act = gated(c, &pass.linear(&n, gate, None, h, ffn), &pass.linear(&n, up, None, h, ffn));
            pass.input(l, LinearInput::Down, &act, ffn);
            pass.linear(&act, down, None, ffn, h)
        }
        Mlp::Experts { router, experts } => {
            let moe = c.block.experts(l).expect("a layer with experts has a MoeSpec");
            mixture(c, moe, router, experts, &n, pass)
        }
    };
    ops::add(&x, &out_norm(m, w.mlp_out_norm))
}

/// `act(g) * u` with the block's activation.
fn gated(c: &ModelConfig, g: &[f32], u: &[f32]) -> Vec<f32> {
    match c.block.activation {
        crate::model::Activation::Silu => ops::silu_mul(g, u),
        crate::model::Activation::GeluTanh => ops::gelu_tanh_mul(g, u),
    }
}

/// A mixture of experts over the normed rows `n` (`[T, hidden]`), as transformers'
/// `Qwen3MoeSparseMoeBlock` / `MixtralSparseMoeBlock`: each token's router logits, their
/// softmax, the `experts_per_token` most probable experts (the lower index first on a tie),
/// their probabilities renormalised to sum to 1 with `renormalize`, and the sum of those
/// experts' gated MLPs weighted by them (in expert order).
fn mixture(c: &ModelConfig, moe: &MoeSpec, router: &[f32], experts: &[[&[f32]; 3]], n: &[f32], pass: &mut dyn Pass) -> Vec<f32> {
    let h = c.hidden_size;
    let ei = moe.expert_intermediate;
    let logits = pass.linear(n, router, None, h, moe.experts);
    let mut out = vec![0.0f32; n.len()];
    for (t, row) in n.chunks(h).enumerate() {
        let mut chosen = ops::moe_route(&logits[t * moe.experts..(t + 1) * moe.experts], moe.experts_per_token, moe.renormalize);
        chosen.sort_by_key(|c| c.0);
        let mut acc = vec![0.0f64; h];
        for (i, p) in chosen {
            let [gate, up, down] = experts[i];
            let act = gated(c, &pass.linear(row, gate, None, h, ei), &pass.linear(row, up, None, h, ei));
            let y = pass.linear(&act, down, None, ei, h);
            // transformers weights each expert's output in f32.
            acc.iter_mut().zip(&y).for_each(|(a, &v)| *a += (v * p as f32) as f64);
        }
        out[t * h..(t + 1) * h].iter_mut().zip(&acc).for_each(|(o, &a)| *o = a as f32);
    }
    out
}

/// A full causal pass over `tokens` (positions `0..T`) through the embedding table `embed`
/// (`[vocab, hidden]`) and `layers`, with `pass` computing the linear layers and observing
/// (see [`Pass`]). Returns the final residual stream `[T, hidden]`, before the final norm.
///
/// # Panics
/// If a token id is `>= vocab_size`.
pub fn run(c: &ModelConfig, embed: &[f32], layers: &[Layer<&[f32]>], tokens: &[u32], pass: &mut dyn Pass) -> Vec<f32> {
    let positions: Vec<usize> = (0..tokens.len()).collect();
    let mut x = ops::embedding(embed, c.vocab_size, c.hidden_size, tokens);
    if let Some(scale) = c.block.embedding_scale {
        // transformers multiplies in the activation dtype (f32).
        x.iter_mut().for_each(|v| *v *= scale);
    }
    pass.state(0, &x);
    for (l, w) in layers.iter().enumerate() {
        // transformers picks LongRoPE's factor set by the sequence's length.
        let inv_freq = c.layer_rope_inv_freq(l, tokens.len());
        x = layer(c, l, w, &x, &positions, &inv_freq, pass);
        pass.state(l + 1, &x);
    }
    x
}

/// The reference's own pass: f64 linear layers, every residual stream kept.
struct States(Vec<Vec<f32>>);

impl Pass for States {
    fn state(&mut self, _: usize, x: &[f32]) {
        self.0.push(x.to_vec());
    }
}

/// A CPU reference model: every weight converted to f32 with `HostTensor::to_f32`.
pub struct ReferenceModel {
    config: ModelConfig,
    embed: Vec<f32>, // (vocab, hidden)
    layers: Vec<Layer<Vec<f32>>>,
    norm: Vec<f32>,            // (hidden)
    lm_head: Option<Vec<f32>>, // (vocab, hidden); None when tied to `embed`
}

impl ReferenceModel {
    /// Builds the reference from loaded weights, after checking them with
    /// [`validate`].
    pub fn new(weights: &ModelWeights) -> Result<Self, LanternError> {
        validate(weights)?;
        let c = weights.config.clone();
        // `validate` guarantees presence, so indexing cannot fail.
        let get = |name: &str| weights.tensors[name].to_f32();
        let layers = (0..c.num_layers)
            .map(|l| {
                let r: Result<_, std::convert::Infallible> =
                    Layer::by_name(&c, l, |n| Ok(get(n)), |n| weights.tensors.get(n).map(|t| t.to_f32()));
                r.unwrap_or_else(|e| match e {})
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

    /// The residual stream of a full causal pass over `tokens` (positions `0..T`): element 0
    /// is the embedding output and element `l + 1` the stream after layer `l`, each
    /// `[T, hidden]` row-major. For locating where a GPU pass first diverges.
    ///
    /// # Panics
    /// If a token id is `>= vocab_size`.
    pub fn forward_hidden(&self, tokens: &[u32]) -> Vec<Vec<f32>> {
        let layers: Vec<_> = self.layers.iter().map(Layer::view).collect();
        let mut states = States(Vec::with_capacity(layers.len() + 1));
        run(&self.config, &self.embed, &layers, tokens, &mut states);
        states.0
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

//! Seeded random models for the tests that compare the GPU with the CPU reference, natively
//! (tests/random_models.rs) and in the browser (tests/wasm.rs): plain Rust, no filesystem,
//! so it builds for wasm32 too. Also the tests' one random-number generator.
#![allow(dead_code)]

use std::collections::HashMap;

use lantern::model::{Arch, BlockSpec, DType, HostTensor, LayerAttention, ModelConfig, ModelWeights, RopeScaling};

/// The tests' one seeded generator (xorshift64): every test's random data is reproducible
/// from its seed. `Rng(state)` starts from a raw non-zero state, `Rng::new(seed)` mixes a
/// seed first.
pub struct Rng(pub u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng((seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03) | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// Uniform in [-1, 1).
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    /// Uniform in 0..n.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    pub fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.uniform()).collect()
    }

    /// Roughly normal (a scaled sum of four uniforms).
    pub fn normal(&mut self) -> f32 {
        (0..4).map(|_| self.uniform()).sum::<f32>() * 0.866
    }

    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next_u64() as u8).collect()
    }

    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = self.below(i + 1);
            v.swap(i, j);
        }
    }
}

/// The shape and options of a seeded random model.
#[derive(Clone, Copy)]
pub struct Spec {
    pub seed: u64,
    pub vocab: usize,
    pub hidden: usize,
    pub ffn: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub bias: bool,
    pub tied: bool,
    pub f16: bool,
    pub llama3: bool,
    /// Gemma 3's block: sandwich norms, q/k norms, GELU-tanh, scaled embedding, a 5-key
    /// window on layers 0, 2, 4, ... (RoPE base 10000 there, 1e6 on the full layers).
    pub gemma: bool,
}

/// A seeded random model: Llama (Qwen2 with `bias`), weights uniform around small offsets.
pub fn random_model(s: Spec) -> ModelWeights {
    let mut rng = Rng(s.seed.wrapping_mul(0x9E3779B97F4A7C15) | 1);
    let config = ModelConfig {
        arch: if s.gemma {
            Arch::Gemma3
        } else if s.bias {
            Arch::Qwen2
        } else {
            Arch::Llama
        },
        vocab_size: s.vocab,
        hidden_size: s.hidden,
        intermediate_size: s.ffn,
        num_layers: s.layers,
        num_heads: s.heads,
        num_kv_heads: s.kv_heads,
        head_dim: s.head_dim,
        rms_norm_eps: 1e-5,
        rope_theta: if s.gemma { 1e6 } else { 10000.0 },
        rope_scaling: s.llama3.then_some(RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 32.0,
        }),
        max_position_embeddings: 512,
        tie_word_embeddings: s.tied,
        qkv_bias: s.bias,
        bos_token_id: None,
        eos_token_ids: vec![],
        block: if s.gemma {
            let mut b = BlockSpec::gemma3(s.layers, s.hidden, 5, s.head_dim as f64, 10000.0);
            b.layer_attention = (0..s.layers).map(|l| if l % 2 == 0 { LayerAttention::Sliding } else { LayerAttention::Full }).collect();
            b
        } else {
            BlockSpec::default()
        },
    };
    let mut tensors = HashMap::new();
    let mut add = |name: String, shape: Vec<usize>, scale: f32, offset: f32, rng: &mut Rng, matrix: bool| {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|_| offset + scale * rng.uniform()).collect();
        let t = if s.f16 && matrix {
            let bits: Vec<u8> = v.iter().flat_map(|x| half::f16::from_f32(*x).to_le_bytes()).collect();
            HostTensor { name: name.clone(), shape, dtype: DType::F16, data: bits }
        } else {
            HostTensor::from_f32(name.clone(), shape, &v)
        };
        tensors.insert(name, t);
    };
    let (d, hd, f) = (s.hidden, s.head_dim, s.ffn);
    add("model.embed_tokens.weight".into(), vec![s.vocab, d], 0.5, 0.0, &mut rng, true);
    for l in 0..s.layers {
        let p = format!("model.layers.{l}");
        add(format!("{p}.input_layernorm.weight"), vec![d], 0.2, 1.0, &mut rng, false);
        add(format!("{p}.post_attention_layernorm.weight"), vec![d], 0.2, 1.0, &mut rng, false);
        add(format!("{p}.self_attn.q_proj.weight"), vec![s.heads * hd, d], 0.2, 0.0, &mut rng, true);
        add(format!("{p}.self_attn.k_proj.weight"), vec![s.kv_heads * hd, d], 0.2, 0.0, &mut rng, true);
        add(format!("{p}.self_attn.v_proj.weight"), vec![s.kv_heads * hd, d], 0.2, 0.0, &mut rng, true);
        if s.bias {
            add(format!("{p}.self_attn.q_proj.bias"), vec![s.heads * hd], 0.1, 0.0, &mut rng, false);
            add(format!("{p}.self_attn.k_proj.bias"), vec![s.kv_heads * hd], 0.1, 0.0, &mut rng, false);
            add(format!("{p}.self_attn.v_proj.bias"), vec![s.kv_heads * hd], 0.1, 0.0, &mut rng, false);
        }
        add(format!("{p}.self_attn.o_proj.weight"), vec![d, s.heads * hd], 0.2, 0.0, &mut rng, true);
        if s.gemma {
            add(format!("{p}.self_attn.q_norm.weight"), vec![hd], 0.3, 1.0, &mut rng, false);
            add(format!("{p}.self_attn.k_norm.weight"), vec![hd], 0.3, 1.0, &mut rng, false);
            add(format!("{p}.pre_feedforward_layernorm.weight"), vec![d], 0.2, 1.0, &mut rng, false);
            add(format!("{p}.post_feedforward_layernorm.weight"), vec![d], 0.2, 1.0, &mut rng, false);
        }
        add(format!("{p}.mlp.gate_proj.weight"), vec![f, d], 0.2, 0.0, &mut rng, true);
        add(format!("{p}.mlp.up_proj.weight"), vec![f, d], 0.2, 0.0, &mut rng, true);
        add(format!("{p}.mlp.down_proj.weight"), vec![d, f], 0.2, 0.0, &mut rng, true);
    }
    add("model.norm.weight".into(), vec![d], 0.2, 1.0, &mut rng, false);
    if !s.tied {
        add("lm_head.weight".into(), vec![s.vocab, d], 0.3, 0.0, &mut rng, true);
    }
    ModelWeights { config, tensors, source: format!("random model seed {}", s.seed) }
}

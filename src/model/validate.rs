//! Checks a loaded weight set against its config: every tensor the architecture needs is
//! present with the exact expected shape and a byte size matching its dtype, and no bias the
//! config does not account for is silently ignored.

use super::config::{ModelConfig, NormPlacement};
use super::tensor::ModelWeights;
use super::LoadError;
use crate::error::LanternError;

/// Every tensor the forward pass reads, with its expected shape (Hugging Face names,
/// Linear weights as `[out_features, in_features]`).
pub fn expected_tensors(c: &ModelConfig) -> Vec<(String, Vec<usize>)> {
    let mut out = expected_global_tensors(c);
    for l in 0..c.num_layers {
        out.extend(expected_layer_tensors(c, l));
    }
    out
}

/// The tensors outside the layers: embedding, final norm, and the head unless tied.
pub fn expected_global_tensors(c: &ModelConfig) -> Vec<(String, Vec<usize>)> {
    let h = c.hidden_size;
    let mut out = vec![("model.embed_tokens.weight".to_string(), vec![c.vocab_size, h]), ("model.norm.weight".to_string(), vec![h])];
    if !c.tie_word_embeddings {
        out.push(("lm_head.weight".to_string(), vec![c.vocab_size, h]));
    }
    out
}

/// Layer `l`'s tensors, as the architecture's block ([`ModelConfig::block`]) has them.
pub fn expected_layer_tensors(c: &ModelConfig, l: usize) -> Vec<(String, Vec<usize>)> {
    let (h, hd) = (c.hidden_size, c.head_dim);
    let q = c.num_heads * hd;
    let kv = c.num_kv_heads * hd;
    let ffn = c.intermediate_size;
    let p = format!("model.layers.{l}");
    let mut out = vec![
        (format!("{p}.input_layernorm.weight"), vec![h]),
        (format!("{p}.self_attn.q_proj.weight"), vec![q, h]),
        (format!("{p}.self_attn.k_proj.weight"), vec![kv, h]),
        (format!("{p}.self_attn.v_proj.weight"), vec![kv, h]),
    ];
    if c.qkv_bias {
        out.push((format!("{p}.self_attn.q_proj.bias"), vec![q]));
        out.push((format!("{p}.self_attn.k_proj.bias"), vec![kv]));
        out.push((format!("{p}.self_attn.v_proj.bias"), vec![kv]));
    }
    if c.block.qk_norm {
        let (qn, kn) = if c.block.qk_norm_whole { (q, kv) } else { (hd, hd) };
        out.push((format!("{p}.self_attn.q_norm.weight"), vec![qn]));
        out.push((format!("{p}.self_attn.k_norm.weight"), vec![kn]));
    }
    out.push((format!("{p}.self_attn.o_proj.weight"), vec![h, q]));
    out.push((format!("{p}.post_attention_layernorm.weight"), vec![h]));
    if c.block.norms == NormPlacement::Sandwich {
        out.push((format!("{p}.pre_feedforward_layernorm.weight"), vec![h]));
        out.push((format!("{p}.post_feedforward_layernorm.weight"), vec![h]));
    }
    match (c.block.experts(l), expert_names(c, l)) {
        (Some(moe), Some(names)) => {
            let ei = moe.expert_intermediate;
            out.push((names.router, vec![moe.experts, h]));
            for [gate, up, down] in names.experts {
                out.push((gate, vec![ei, h]));
                out.push((up, vec![ei, h]));
                out.push((down, vec![h, ei]));
            }
        }
        _ => {
            out.push((format!("{p}.mlp.gate_proj.weight"), vec![ffn, h]));
            out.push((format!("{p}.mlp.up_proj.weight"), vec![ffn, h]));
            out.push((format!("{p}.mlp.down_proj.weight"), vec![h, ffn]));
        }
    }
    out
}

/// The tensor names of layer `l`'s mixture of experts, as Hugging Face checkpoints hold them.
pub struct ExpertNames {
    /// The router, `[experts, hidden]`.
    pub router: String,
    /// Per expert: its gate, up and down projections.
    pub experts: Vec<[String; 3]>,
}

/// Layer `l`'s expert tensor names, when its MLP is a mixture of experts: Mixtral's
/// `block_sparse_moe.{gate, experts.E.w1/w3/w2}`, else `mlp.{gate, experts.E.gate_proj/up_proj/down_proj}`.
pub fn expert_names(c: &ModelConfig, l: usize) -> Option<ExpertNames> {
    let moe = c.block.experts(l)?;
    let p = format!("model.layers.{l}");
    Some(if c.arch == crate::model::Arch::Mixtral {
        ExpertNames {
            router: format!("{p}.block_sparse_moe.gate.weight"),
            experts: (0..moe.experts).map(|e| ["w1", "w3", "w2"].map(|n| format!("{p}.block_sparse_moe.experts.{e}.{n}.weight"))).collect(),
        }
    } else {
        ExpertNames {
            router: format!("{p}.mlp.gate.weight"),
            experts: (0..moe.experts)
                .map(|e| ["gate_proj", "up_proj", "down_proj"].map(|n| format!("{p}.mlp.experts.{e}.{n}.weight")))
                .collect(),
        }
    })
}

/// The norm weights of layer `l` in the order the block applies them: the attention
/// input's, then (sandwich) the attention output's, then the MLP input's, then (sandwich) the
/// MLP output's.
pub fn layer_norm_names(c: &ModelConfig, l: usize) -> LayerNorms {
    let p = format!("model.layers.{l}");
    match c.block.norms {
        NormPlacement::Pre => LayerNorms {
            attn_in: format!("{p}.input_layernorm.weight"),
            attn_out: None,
            mlp_in: format!("{p}.post_attention_layernorm.weight"),
            mlp_out: None,
        },
        NormPlacement::Sandwich => LayerNorms {
            attn_in: format!("{p}.input_layernorm.weight"),
            attn_out: Some(format!("{p}.post_attention_layernorm.weight")),
            mlp_in: format!("{p}.pre_feedforward_layernorm.weight"),
            mlp_out: Some(format!("{p}.post_feedforward_layernorm.weight")),
        },
    }
}

/// One layer's norm tensor names (Hugging Face names; see [`layer_norm_names`]).
#[derive(Debug, Clone)]
pub struct LayerNorms {
    pub attn_in: String,
    pub attn_out: Option<String>,
    pub mlp_in: String,
    pub mlp_out: Option<String>,
}

/// Every `(name, shape)` of `expected` is in `tensors` with exactly that shape; the first
/// that is not is a [`LoadError::MissingTensor`] or [`LoadError::WrongShape`] naming `file`.
pub fn check_expected(
    tensors: &std::collections::HashMap<String, super::HostTensor>,
    expected: Vec<(String, Vec<usize>)>,
    file: &str,
) -> Result<(), LanternError> {
    for (name, shape) in expected {
        match tensors.get(&name) {
            None => return Err(LoadError::MissingTensor { file: file.to_string(), tensor: name }.into()),
            Some(t) if t.shape != shape => {
                return Err(LoadError::WrongShape { file: file.to_string(), tensor: name, got: t.shape.clone(), expected: shape }.into())
            }
            Some(_) => {}
        }
    }
    Ok(())
}

/// True for a bias tensor the runtime would not apply under this config.
fn is_unexpected_bias(c: &ModelConfig, name: &str) -> bool {
    if !name.starts_with("model.layers.") || !name.ends_with(".bias") {
        return name == "lm_head.bias";
    }
    let qkv = name.ends_with("q_proj.bias") || name.ends_with("k_proj.bias") || name.ends_with("v_proj.bias");
    !(qkv && c.qkv_bias)
}

/// Checks that `weights` holds every tensor its config needs ([`expected_tensors`]) with
/// exactly the expected shape, that each tensor's byte size matches its dtype, and that no
/// bias tensor is present that the forward pass would ignore. Extra non-bias tensors (for
/// example a stored `lm_head.weight` when embeddings are tied) are allowed.
///
/// Errors name the tensor and, for a shape mismatch, both shapes:
/// [`LoadError::MissingTensor`], [`LoadError::WrongShape`], [`LoadError::Invalid`].
pub fn validate(weights: &ModelWeights) -> Result<(), LanternError> {
    let c = &weights.config;
    let file = || weights.source.clone();
    check_expected(&weights.tensors, expected_tensors(c), &weights.source)?;
    let mut names: Vec<&String> = weights.tensors.keys().collect();
    names.sort();
    for name in names {
        let t = &weights.tensors[name];
        let numel: usize = t.shape.iter().product();
        match t.dtype.bytes_for_shape(&t.shape) {
            Some(n) if n == t.data.len() => {}
            Some(n) => {
                return Err(LoadError::Invalid {
                    file: file(),
                    reason: format!("tensor `{name}` ({:?} {:?}) should hold {n} bytes but holds {}", t.dtype, t.shape, t.data.len()),
                }
                .into())
            }
            None => {
                return Err(LoadError::Invalid {
                    file: file(),
                    reason: format!("tensor `{name}` has {numel} elements, not a multiple of the {:?} block size", t.dtype),
                }
                .into())
            }
        }
        if is_unexpected_bias(c, name) {
            return Err(LoadError::Invalid {
                file: file(),
                reason: format!("tensor `{name}` is a bias this {:?} config does not use; refusing to ignore it", c.arch),
            }
            .into());
        }
    }
    Ok(())
}

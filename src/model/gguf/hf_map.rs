//! From a parsed GGUF to Lantern's model: [`ModelConfig`] from the metadata, llama.cpp tensor
//! names mapped to Hugging Face ones, Q/K rows un-permuted on raw bytes, and the tensor set
//! checked against the config ([`weights_from_gguf`]).

use super::*;
use crate::model::config::MAX_LAYERS;

/// The Hugging Face name for a llama.cpp tensor name in a file of architecture `arch`, or
/// `None` for names with no HF counterpart (e.g. `rope_freqs.weight`). `ffn_norm` is the
/// MLP's input norm: Llama's `post_attention_layernorm`, Gemma's
/// `pre_feedforward_layernorm` (where `post_attention_norm` is the attention output's norm).
pub fn hf_tensor_name(gguf_name: &str, arch: Arch) -> Option<String> {
    match gguf_name {
        "token_embd.weight" => return Some("model.embed_tokens.weight".into()),
        "output_norm.weight" => return Some("model.norm.weight".into()),
        "output.weight" => return Some("lm_head.weight".into()),
        _ => {}
    }
    let rest = gguf_name.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (module, suffix) = rest.rsplit_once('.')?;
    if suffix != "weight" && suffix != "bias" {
        return None;
    }
    let hf = match module {
        "attn_norm" => "input_layernorm",
        "ffn_norm" if arch == Arch::Gemma3 => "pre_feedforward_layernorm",
        "ffn_norm" => "post_attention_layernorm",
        "post_attention_norm" if arch == Arch::Gemma3 => "post_attention_layernorm",
        "post_ffw_norm" if arch == Arch::Gemma3 => "post_feedforward_layernorm",
        "attn_qkv" => "self_attn.qkv_proj",
        "ffn_up" if arch == Arch::Phi3 => "mlp.gate_up_proj",
        "attn_q_norm" => "self_attn.q_norm",
        "attn_k_norm" => "self_attn.k_norm",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        // Mixtures of experts: the router, and every expert's projection in one 3-D tensor
        // (`[experts, rows, cols]`), which `ModelWeights::unfuse` splits per expert.
        "ffn_gate_inp" if arch == Arch::Mixtral => "block_sparse_moe.gate",
        "ffn_gate_inp" => "mlp.gate",
        "ffn_gate_exps" => "mlp.experts.gate_proj",
        "ffn_up_exps" => "mlp.experts.up_proj",
        "ffn_down_exps" => "mlp.experts.down_proj",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf}.{suffix}"))
}

/// Undo llama.cpp's Q/K row permutation on raw bytes.
///
/// `convert_hf_to_gguf.py` stores `w.reshape(n_head, 2, hd/2, in).swapaxes(1, 2)` so that
/// RoPE rotates adjacent pairs; Hugging Face rotates halves. GGUF row `h*hd + 2*i + j`
/// holds HF row `h*hd + j*(hd/2) + i`. Rows are moved whole (a row of a block-quantized
/// tensor is a whole number of blocks), so no value is re-encoded. `n_rows` is the outer
/// dimension (`n_head * hd`); 1-D biases work with one element per row. Returns `None` if
/// the bytes do not split into `n_rows` equal rows or the head size is not even.
pub fn unpermute_qk_rows(data: &[u8], n_rows: usize, n_head: usize) -> Option<Vec<u8>> {
    if n_rows == 0 || n_head == 0 || !n_rows.is_multiple_of(n_head) || !data.len().is_multiple_of(n_rows) {
        return None;
    }
    let hd = n_rows / n_head;
    if !hd.is_multiple_of(2) {
        return None;
    }
    let half = hd / 2;
    let row = data.len() / n_rows;
    let mut out = vec![0u8; data.len()];
    for h in 0..n_head {
        for i in 0..half {
            for j in 0..2 {
                let src = h * hd + 2 * i + j;
                let dst = h * hd + j * half + i;
                out[dst * row..(dst + 1) * row].copy_from_slice(&data[src * row..(src + 1) * row]);
            }
        }
    }
    Some(out)
}

fn config_err(field: &str, reason: impl Into<String>) -> LanternError {
    LanternError::Config { field: field.to_string(), reason: reason.into() }
}

fn nonzero(g: &GgufFile<'_>, key: &str) -> Result<usize, LanternError> {
    let v = g.get_u32(key)? as usize;
    if v == 0 {
        return Err(config_err(key, "must be greater than zero"));
    }
    Ok(v)
}

/// Build the model configuration from GGUF metadata (`general.architecture` and the
/// `{arch}.*` keys; vocab size from `tokenizer.ggml.tokens`).
pub fn config_from_gguf(g: &GgufFile<'_>) -> Result<ModelConfig, LanternError> {
    let arch_name = g.get_str("general.architecture")?;
    let arch = match arch_name {
        // llama.cpp writes Mixtral as `llama` with experts.
        "llama" if g.get_u32_opt("llama.expert_count")?.unwrap_or(0) > 0 => Arch::Mixtral,
        "llama" => Arch::Llama,
        "qwen3moe" => Arch::Qwen3Moe,
        "olmoe" => Arch::Olmoe,
        "mistral" => Arch::Mistral,
        "qwen2" => Arch::Qwen2,
        "gemma3" => Arch::Gemma3,
        "qwen3" => Arch::Qwen3,
        "phi3" => Arch::Phi3,
        other => return Err(LanternError::UnsupportedArchitecture { arch: other.to_string() }),
    };
    let k = |s: &str| format!("{arch_name}.{s}");
    let num_layers = nonzero(g, &k("block_count"))?;
    // A corrupt block_count fails here, before anything is sized by it: at most MAX_LAYERS,
    // and no more layers than the file has tensors for (a header-only file has none).
    let layers_in_file = g.tensors().iter().filter_map(|t| gguf_layer(&t.name)).max().map_or(0, |l| l.saturating_add(1));
    if num_layers > MAX_LAYERS {
        return Err(config_err(&k("block_count"), format!("{num_layers} is more than the {MAX_LAYERS} layers a model may have")));
    }
    if !g.tensors().is_empty() && num_layers > layers_in_file {
        return Err(config_err(
            &k("block_count"),
            format!("is {num_layers}, but the file has tensors for {layers_in_file} layers (blk.0 ...)"),
        ));
    }
    let hidden_size = nonzero(g, &k("embedding_length"))?;
    let intermediate_size = nonzero(g, &k("feed_forward_length"))?;
    let num_heads = nonzero(g, &k("attention.head_count"))?;
    let num_kv_heads = match g.get_u32_opt(&k("attention.head_count_kv"))? {
        None => num_heads,
        Some(0) => return Err(config_err(&k("attention.head_count_kv"), "must be greater than zero")),
        Some(v) => v as usize,
    };
    if num_heads % num_kv_heads != 0 {
        return Err(config_err(&k("attention.head_count_kv"), format!("{num_kv_heads} does not divide the head count {num_heads}")));
    }
    let head_dim = match g.get_u32_opt(&k("attention.key_length"))? {
        Some(v) if v > 0 => v as usize,
        Some(_) => return Err(config_err(&k("attention.key_length"), "must be greater than zero")),
        None if hidden_size % num_heads == 0 => hidden_size / num_heads,
        None => return Err(config_err(&k("embedding_length"), format!("{hidden_size} is not a multiple of the head count {num_heads}"))),
    };
    if head_dim % 2 != 0 {
        return Err(config_err(&k("attention.key_length"), format!("head size {head_dim} is odd")));
    }
    if num_heads.checked_mul(head_dim).is_none() {
        return Err(config_err(&k("attention.head_count"), format!("{num_heads} heads of {head_dim} overflow the address space")));
    }
    if let Some(v) = g.get_u32_opt(&k("attention.value_length"))? {
        if v as usize != head_dim {
            return Err(config_err(&k("attention.value_length"), format!("{v} differs from the key length {head_dim} (unsupported)")));
        }
    }
    if let Some(v) = g.get_u32_opt(&k("rope.dimension_count"))? {
        if v as usize != head_dim {
            return Err(config_err(
                &k("rope.dimension_count"),
                format!("{v} differs from the head size {head_dim} (partial rotary is unsupported)"),
            ));
        }
    }
    let rms_norm_eps = g.get_f32(&k("attention.layer_norm_rms_epsilon"))?;
    let rope_theta = g.get_f32_opt(&k("rope.freq_base"))?.unwrap_or(10000.0) as f64;
    let rope_scaling = rope_scaling_from_gguf(g, arch_name, rope_theta, head_dim)?;
    let max_position_embeddings = nonzero(g, &k("context_length"))?;

    let vocab_size = match g.get_array_opt("tokenizer.ggml.tokens")? {
        Some(a) => a.len(),
        None => g.get_u32_opt(&k("vocab_size"))?.map(|v| v as usize).ok_or_else(|| g.missing("tokenizer.ggml.tokens"))?,
    };
    if vocab_size == 0 {
        return Err(config_err("tokenizer.ggml.tokens", "is empty"));
    }
    if let Some(t) = g.tensor_info("token_embd.weight") {
        let rows = t.dims.get(1).copied().unwrap_or(0);
        if rows != vocab_size as u64 {
            return Err(config_err("tokenizer.ggml.tokens", format!("has {vocab_size} tokens but token_embd.weight has {rows} rows")));
        }
    }
    let bos_token_id = g.get_u32_opt("tokenizer.ggml.bos_token_id")?;
    let mut eos_token_ids = Vec::new();
    for key in ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"] {
        if let Some(id) = g.get_u32_opt(key)? {
            if !eos_token_ids.contains(&id) {
                eos_token_ids.push(id);
            }
        }
    }
    let qkv_bias = arch == Arch::Qwen2 || g.tensor_info("blk.0.attn_q.bias").is_some();
    let block = match arch {
        Arch::Gemma3 => {
            // As llama.cpp reads these files: a window from the metadata, pattern 6, local
            // RoPE base 10000 (not stored), scores scaled by 1/sqrt(head_dim) (the 27B model's
            // query_pre_attn_scalar differs; it is not stored either).
            let window = nonzero(g, &k("attention.sliding_window"))?;
            if rope_scaling.is_some() {
                return Err(config_err(&k("rope.scaling.type"), "RoPE scaling on Gemma 3 is not supported"));
            }
            if g.get_f32_opt(&k("final_logit_softcapping"))?.is_some() || g.get_f32_opt(&k("attn_logit_softcapping"))?.is_some() {
                return Err(config_err(&k("final_logit_softcapping"), "logit soft-capping is not supported"));
            }
            let local_theta = g.get_f32_opt(&k("rope.freq_base_swa"))?.map_or(10000.0, f64::from);
            BlockSpec::gemma3(num_layers, hidden_size, window, head_dim as f64, local_theta)
        }
        Arch::Qwen3 => BlockSpec { qk_norm: true, ..Default::default() },
        Arch::Qwen3Moe => {
            BlockSpec { qk_norm: true, moe: Some(moe_from_gguf(g, arch_name, intermediate_size, true)?), ..Default::default() }
        }
        // llama.cpp's OLMoE graph: q/k RMSNorms over the whole projection, the experts'
        // softmax weights as they are (`build_moe_ffn(.., norm_w = false, ..)`).
        Arch::Olmoe => BlockSpec {
            qk_norm: true,
            qk_norm_whole: true,
            moe: Some(moe_from_gguf(g, arch_name, intermediate_size, false)?),
            ..Default::default()
        },
        Arch::Phi3 | Arch::Mistral | Arch::Mixtral => {
            let moe = match arch {
                Arch::Mixtral => Some(moe_from_gguf(g, arch_name, intermediate_size, true)?),
                _ => None,
            };
            // One window on every layer (0 or absent: none).
            let block = match g.get_u32_opt(&k("attention.sliding_window"))?.filter(|&w| w > 0 && (w as usize) < max_position_embeddings) {
                Some(w) => BlockSpec::default().uniform_window(num_layers, w as usize),
                None => BlockSpec::default(),
            };
            BlockSpec { moe, ..block }
        }
        _ => BlockSpec::default(),
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
        rms_norm_eps,
        rope_theta,
        rope_scaling,
        max_position_embeddings,
        tie_word_embeddings: g.tensor_info("output.weight").is_none(),
        qkv_bias,
        bos_token_id,
        eos_token_ids,
        block,
    })
}

/// The mixture of experts of a GGUF file: `{arch}.expert_count`, `expert_used_count`,
/// `expert_feed_forward_length` (Mixtral's and OLMoE's experts have the model's
/// `feed_forward_length`), and the renormalisation llama.cpp applies (`expert_weights_norm`;
/// absent: `renormalize`, what llama.cpp's graph of the architecture does: renormalised for
/// Qwen3-MoE and Mixtral, not for OLMoE). Every layer is sparse.
fn moe_from_gguf(g: &GgufFile<'_>, arch: &str, intermediate: usize, renormalize: bool) -> Result<crate::model::MoeSpec, LanternError> {
    let k = |s: &str| format!("{arch}.{s}");
    let experts = nonzero(g, &k("expert_count"))?;
    let per_token = nonzero(g, &k("expert_used_count"))?;
    if per_token > experts {
        return Err(config_err(&k("expert_used_count"), format!("{per_token} is more than the {experts} experts")));
    }
    if g.get_u32_opt(&k("expert_shared_count"))?.unwrap_or(0) > 0
        || g.get_u32_opt(&k("expert_shared_feed_forward_length"))?.unwrap_or(0) > 0
    {
        return Err(config_err(&k("expert_shared_count"), "shared experts are not supported"));
    }
    let expert_intermediate = match g.get_u32_opt(&k("expert_feed_forward_length"))? {
        Some(0) => return Err(config_err(&k("expert_feed_forward_length"), "must be greater than zero")),
        Some(n) => n as usize,
        None => intermediate,
    };
    let renormalize = g.get_bool_opt(&k("expert_weights_norm"))?.unwrap_or(renormalize);
    Ok(crate::model::MoeSpec { experts, experts_per_token: per_token, expert_intermediate, renormalize, sparse_layers: Vec::new() })
}

/// RoPE scaling from `{arch}.rope.scaling.*` (linear, llama3) or, for Llama 3.x files that
/// only carry the precomputed `rope_freqs.weight` factors, inferred from that tensor.
fn rope_scaling_from_gguf(g: &GgufFile<'_>, arch: &str, theta: f64, head_dim: usize) -> Result<Option<RopeScaling>, LanternError> {
    let k = |s: &str| format!("{arch}.{s}");
    // LongRoPE (llama.cpp's Phi-3 conversion): both factor sets as tensors, the original
    // context and the attention factor as metadata.
    if let (Some(long), Some(short)) = (g.host_tensor("rope_factors_long.weight")?, g.host_tensor("rope_factors_short.weight")?) {
        let (long, short) = (long.to_f32(), short.to_f32());
        if long.len() != head_dim / 2 || short.len() != head_dim / 2 {
            return Err(config_err(
                "rope_factors_long.weight",
                format!("{} long and {} short factors, expected head_dim / 2 = {}", long.len(), short.len(), head_dim / 2),
            ));
        }
        let orig = g
            .get_u32_opt(&k("rope.scaling.original_context_length"))?
            .ok_or_else(|| config_err(&k("rope.scaling.original_context_length"), "missing (needed by LongRoPE)"))?;
        let attn = g.get_f32_opt(&k("rope.scaling.attn_factor"))?.unwrap_or(1.0);
        return Ok(Some(RopeScaling::LongRope {
            short_factor: short,
            long_factor: long,
            original_max_position_embeddings: orig as f64,
            attention_factor: attn as f64,
        }));
    }
    let ty = g.get_str_opt(&k("rope.scaling.type"))?;
    let factor = g.get_f32_opt(&k("rope.scaling.factor"))?.map(f64::from);
    let orig = g.get_u32_opt(&k("rope.scaling.original_context_length"))?;
    let positive = |f: Option<f64>| -> Result<f64, LanternError> {
        match f {
            Some(f) if f > 0.0 && f.is_finite() => Ok(f),
            Some(f) => Err(config_err(&k("rope.scaling.factor"), format!("{f} is not a positive number"))),
            None => Err(config_err(&k("rope.scaling.factor"), "missing")),
        }
    };
    match ty {
        Some("linear") => return Ok(Some(RopeScaling::Linear { factor: positive(factor)? })),
        Some("llama3") => {
            let low = g.get_f32_opt(&k("rope.scaling.low_freq_factor"))?.unwrap_or(1.0) as f64;
            let high = g.get_f32_opt(&k("rope.scaling.high_freq_factor"))?.unwrap_or(4.0) as f64;
            return Ok(Some(RopeScaling::Llama3 {
                factor: positive(factor)?,
                low_freq_factor: low,
                high_freq_factor: high,
                original_max_position_embeddings: orig.unwrap_or(8192) as f64,
            }));
        }
        Some("none") | None => {}
        Some(other) => {
            return Err(config_err(&k("rope.scaling.type"), format!("{other:?} is not supported (supported: none, linear, llama3)")))
        }
    }
    if ty.is_none() {
        if let Some(f) = g.get_f32_opt(&k("rope.scale_linear"))? {
            if f != 1.0 {
                return Ok(Some(RopeScaling::Linear { factor: positive(Some(f as f64))? }));
            }
        }
    }
    let Some(t) = g.host_tensor("rope_freqs.weight")? else {
        return Ok(None);
    };
    let ff = t.to_f32();
    if ff.len() != head_dim / 2 {
        return Err(config_err("rope_freqs.weight", format!("has {} factors, expected head_dim / 2 = {}", ff.len(), head_dim / 2)));
    }
    let factor = ff.iter().copied().fold(1.0f32, f32::max) as f64;
    if factor == 1.0 {
        return Ok(None);
    }
    let scaling = RopeScaling::Llama3 {
        factor,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: orig.unwrap_or(8192) as f64,
    };
    let expected = llama3_rope_factors(&scaling, theta, head_dim);
    let worst = ff.iter().zip(&expected).map(|(&a, &b)| ((a as f64 - b) / b).abs()).fold(0.0, f64::max);
    if worst > 1e-3 {
        // Another original context than the default: apply the file's divisors as they are.
        return Ok(Some(RopeScaling::Divisors { divisors: ff }));
    }
    Ok(Some(scaling))
}

/// The per-frequency divisors `convert_hf_to_gguf.py` writes into `rope_freqs.weight`.
fn llama3_rope_factors(s: &RopeScaling, theta: f64, head_dim: usize) -> Vec<f64> {
    let RopeScaling::Llama3 { factor, low_freq_factor: low, high_freq_factor: high, original_max_position_embeddings: old } = *s else {
        return vec![1.0; head_dim / 2];
    };
    (0..head_dim / 2)
        .map(|i| {
            let freq = 1.0 / theta.powf((2 * i) as f64 / head_dim as f64);
            let wavelen = 2.0 * std::f64::consts::PI / freq;
            if wavelen < old / high {
                1.0
            } else if wavelen > old / low {
                factor
            } else {
                let smooth = (old / wavelen - low) / (high - low);
                1.0 / ((1.0 - smooth) / factor + smooth)
            }
        })
        .collect()
}

/// Build [`ModelWeights`] from a parsed GGUF: config from metadata, tensors renamed to
/// Hugging Face names, kept in their file dtype, with llama.cpp's Q/K row permutation undone
/// for the llama/mistral architectures. `file_name` becomes [`ModelWeights::source`].
pub fn weights_from_gguf(gguf: &GgufFile<'_>, file_name: &str) -> Result<ModelWeights, LanternError> {
    let config = config_from_gguf(gguf)?;
    let mut tensors = HashMap::with_capacity(gguf.tensors().len());
    for info in gguf.tensors() {
        if let Some(t) = convert_tensor(&config, info, gguf.loadable_dtype(info)?, gguf.tensor_data(info)?.to_vec(), file_name)? {
            tensors.insert(t.name.clone(), t);
        }
    }
    let mut weights = ModelWeights { config, tensors, source: file_name.to_string() };
    weights.unfuse()?;
    check_tensor_set(&weights.config, &weights.tensors, file_name)?;
    Ok(weights)
}

/// The layer a GGUF tensor belongs to (`blk.N.*`), or `None` for the tensors outside the
/// layers (embedding, output norm and head, RoPE factors): how a streaming loader groups the
/// file's tensors into parts.
pub fn gguf_layer(gguf_name: &str) -> Option<usize> {
    gguf_name.strip_prefix("blk.")?.split_once('.')?.0.parse().ok()
}

/// The tensors of one streamed part: layer `l`'s (`Some(l)`) or those outside the layers.
pub fn part_tensors<'g>(gguf: &'g GgufFile<'_>, layer: Option<usize>) -> Vec<&'g GgufTensorInfo> {
    gguf.tensors().iter().filter(|t| gguf_layer(&t.name) == layer).collect()
}

/// One GGUF tensor as Lantern holds it: its Hugging Face name, file dtype, and bytes (with
/// llama.cpp's Q/K row permutation undone for llama/mistral), from its raw bytes `raw`;
/// `None` for tensors with no counterpart (RoPE factor tensors are read into the config).
///
/// `raw` is taken by value: a streamed load hands over the buffer it read, and no second copy
/// of the tensor is made unless its rows are un-permuted.
pub fn convert_tensor(
    config: &ModelConfig,
    info: &GgufTensorInfo,
    dtype: DType,
    raw: Vec<u8>,
    file_name: &str,
) -> Result<Option<HostTensor>, LanternError> {
    let Some(hf) = hf_tensor_name(&info.name, config.arch) else {
        if !matches!(info.name.as_str(), "rope_freqs.weight" | "rope_factors_long.weight" | "rope_factors_short.weight") {
            log::warn!("{file_name}: ignoring tensor `{}` (no Hugging Face counterpart)", info.name);
        }
        return Ok(None);
    };
    let permuted = matches!(config.arch, Arch::Llama | Arch::Mistral | Arch::Mixtral);
    let shape = info.shape();
    if raw.len() as u64 != info.size {
        return Err(LoadError::Invalid {
            file: file_name.to_string(),
            reason: format!("tensor `{}`: {} bytes, expected {}", info.name, raw.len(), info.size),
        }
        .into());
    }
    let heads = if hf.contains(".self_attn.q_proj.") {
        Some(config.num_heads)
    } else if hf.contains(".self_attn.k_proj.") {
        Some(config.num_kv_heads)
    } else {
        None
    };
    let data = match heads {
        Some(n_head) if permuted => {
            let rows = shape.first().copied().unwrap_or(0);
            if rows != n_head * config.head_dim {
                return Err(LoadError::WrongShape {
                    file: file_name.to_string(),
                    tensor: info.name.clone(),
                    got: shape.clone(),
                    // A scalar or 1-D q/k weight has no inner dims to repeat (found by fuzz target gguf).
                    expected: match info.name.ends_with(".bias") {
                        true => vec![n_head * config.head_dim],
                        false => vec![n_head * config.head_dim, config.hidden_size],
                    },
                }
                .into());
            }
            unpermute_qk_rows(&raw, rows, n_head).ok_or_else(|| LoadError::Invalid {
                file: file_name.to_string(),
                reason: format!("tensor `{}` cannot be split into {rows} rows of {n_head} heads", info.name),
            })?
        }
        _ => raw,
    };
    Ok(Some(HostTensor { name: hf, shape, dtype, data }))
}

/// The tensors of one part of a streamed GGUF load ([`gguf_layer`]), converted
/// ([`convert_tensor`]), unfused and checked against the part's expected set.
pub fn weights_part(
    config: &ModelConfig,
    layer: Option<usize>,
    tensors: Vec<HostTensor>,
    file_name: &str,
) -> Result<ModelWeights, LanternError> {
    weights_part_except(config, layer, tensors, &[], file_name)
}

/// [`weights_part`] for a part whose tensors named in `streamed` (Hugging Face names) are
/// left out, to be read a slice of rows at a time ([`row_range`]); the caller checks their
/// shapes ([`check_streamed`]).
pub fn weights_part_except(
    config: &ModelConfig,
    layer: Option<usize>,
    tensors: Vec<HostTensor>,
    streamed: &[&str],
    file_name: &str,
) -> Result<ModelWeights, LanternError> {
    let mut w = ModelWeights {
        config: config.clone(),
        tensors: tensors.into_iter().map(|t| (t.name.clone(), t)).collect(),
        source: file_name.to_string(),
    };
    w.unfuse()?;
    let mut expected = match layer {
        Some(l) => crate::model::validate::expected_layer_tensors(config, l),
        None => crate::model::validate::expected_global_tensors(config),
    };
    expected.retain(|(name, _)| !streamed.contains(&name.as_str()));
    crate::model::validate::check_expected(&w.tensors, expected, file_name)?;
    Ok(w)
}

/// The global matrices a streamed load reads a slice of rows at a time instead of whole: the
/// embedding table and the LM head, a model's largest (Qwen2.5-1.5B's Q6_K table is 191 MB).
/// Never a q/k projection, whose rows llama.cpp permutes.
pub const STREAMED_MATRICES: [&str; 2] = ["model.embed_tokens.weight", "lm_head.weight"];

/// The GGUF tensor a Hugging Face name comes from.
pub fn gguf_info_for<'g>(gguf: &'g GgufFile<'_>, config: &ModelConfig, hf: &str) -> Option<&'g GgufTensorInfo> {
    gguf.tensors().iter().find(|t| hf_tensor_name(&t.name, config.arch).as_deref() == Some(hf))
}

/// Each of `streamed` that this config reads is in the file with the shape it expects and a
/// loadable type: the checks [`weights_part`] makes, without reading the tensor.
pub fn check_streamed(gguf: &GgufFile<'_>, config: &ModelConfig, streamed: &[&str], file_name: &str) -> Result<(), LanternError> {
    for (name, shape) in crate::model::validate::expected_global_tensors(config) {
        if !streamed.contains(&name.as_str()) {
            continue;
        }
        let info = gguf_info_for(gguf, config, &name)
            .ok_or_else(|| LoadError::MissingTensor { file: file_name.to_string(), tensor: name.clone() })?;
        if info.shape() != shape {
            return Err(LoadError::WrongShape { file: file_name.to_string(), tensor: name, got: info.shape(), expected: shape }.into());
        }
        gguf.loadable_dtype(info)?;
    }
    Ok(())
}

/// The byte range in the file of rows `start..end` of a 2-D tensor (every row the same
/// number of bytes: whole blocks for block formats).
pub fn row_range(
    gguf: &GgufFile<'_>,
    info: &GgufTensorInfo,
    start: usize,
    end: usize,
    file_name: &str,
) -> Result<(u64, u64), LanternError> {
    let shape = info.shape();
    let rows = shape.first().copied().unwrap_or(0);
    let bad = |reason: String| LoadError::Invalid { file: file_name.to_string(), reason: format!("tensor `{}`: {reason}", info.name) };
    if shape.len() != 2 || rows == 0 || !info.size.is_multiple_of(rows as u64) {
        return Err(bad(format!("{} bytes in {shape:?} cannot be read by rows", info.size)).into());
    }
    if start > end || end > rows {
        return Err(bad(format!("rows {start}..{end} asked for, it has {rows}")).into());
    }
    let row_bytes = info.size / rows as u64;
    let (a, _) = gguf.tensor_range(info);
    Ok((a + start as u64 * row_bytes, a + end as u64 * row_bytes))
}

/// Every tensor the forward pass needs is present with the shape the config implies
/// ([`crate::model::validate::expected_layer_tensors`]). Checked layer by layer, so a
/// corrupt `block_count` fails at the first missing layer instead of building a huge list.
fn check_tensor_set(c: &ModelConfig, tensors: &HashMap<String, HostTensor>, file: &str) -> Result<(), LanternError> {
    use crate::model::validate::{check_expected, expected_global_tensors, expected_layer_tensors};
    check_expected(tensors, expected_global_tensors(c), file)?;
    for l in 0..c.num_layers {
        check_expected(tensors, expected_layer_tensors(c, l), file)?;
    }
    Ok(())
}

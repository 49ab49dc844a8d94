//! Whole-model quantization: every linear weight of the decoder layers (q/k/v/o, gate/up/down
//! projections) becomes a packed [`DType::Packed`] tensor, the embedding and LM head follow
//! an [`EmbeddingPolicy`], and everything else (norms, biases) is stored as f32.
//!
//! Methods: round-to-nearest per group ([`PackedMatrix::quantize`]), or AWQ-style
//! activation-aware scaling first ([`super::awq`]), which needs calibration tokens. A source
//! tensor already stored in the target format (a GGUF Q8_0 / Q4_0 / Q4_1 block tensor with
//! group 32, or a packed tensor of the same format) is repacked bit for bit under RTN
//! instead of being dequantized and rounded again.
//!
//! Every packed tensor's recipe (kind, group, method, AWQ alpha and folds) goes into the
//! returned [`QuantMetadata`], which [`super::safetensors`] stores with the weights.

use std::collections::{BTreeMap, HashMap};

use web_time::Instant;

use super::awq::{self, AwqOptions, FloatWeights, LayerScales, Site, SiteResult};
use super::safetensors::{QuantMetadata, TensorInfo};
use super::{pool, PackedMatrix, QuantError, QuantFormat, QuantKind};
use crate::error::LanternError;
use crate::model::validate::validate;
use crate::model::{DType, HostTensor, ModelWeights};

/// How the linear layers are quantized.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Method {
    /// Round to nearest, group by group.
    Rtn,
    /// Activation-aware per-channel scales searched on calibration text, folded into the
    /// preceding op, then round to nearest.
    Awq,
    /// GPTQ ([`super::gptq`]): each linear layer rounded column by column with the error
    /// pushed onto the columns left, weighted by the inverse Hessian of its calibration
    /// inputs.
    Gptq,
    /// Wanda 2:4 ([`super::sparse`]): in every four consecutive inputs of a row the two
    /// weights of largest `|w| * ||x||` over the calibration inputs are kept, into a 2:4 kind.
    Wanda,
}

impl Method {
    /// The name in messages, metadata and `lantern quantize --method`.
    pub fn name(&self) -> &'static str {
        match self {
            Method::Rtn => "rtn",
            Method::Awq => "awq",
            Method::Gptq => "gptq",
            Method::Wanda => "wanda-2:4",
        }
    }
}

/// What happens to the token embedding and the LM head (the same matrix when
/// `tie_word_embeddings`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum EmbeddingPolicy {
    /// Keep as f32.
    F32,
    /// Store as f16.
    F16,
    /// 8-bit, group 32 (as llama.cpp's Q8_0). The default.
    Q8,
    /// The same format as the linear layers (round to nearest).
    Same,
}

impl EmbeddingPolicy {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "f32" => Some(EmbeddingPolicy::F32),
            "f16" => Some(EmbeddingPolicy::F16),
            "q8" => Some(EmbeddingPolicy::Q8),
            "same" => Some(EmbeddingPolicy::Same),
            _ => None,
        }
    }
}

/// Settings of [`quantize_model`].
#[derive(Debug, Clone, PartialEq)]
pub struct QuantizeOptions {
    /// Bit layout of the linear layers.
    pub kind: QuantKind,
    /// Elements per scale (a positive multiple of 8 dividing every row length; 32, 64, 128
    /// are the usual choices).
    pub group: u32,
    pub method: Method,
    pub embeddings: EmbeddingPolicy,
    /// AWQ search settings (used with [`Method::Awq`]; its `max_tokens` also caps GPTQ's
    /// calibration tokens).
    pub awq: AwqOptions,
    /// GPTQ settings (used with [`Method::Gptq`]).
    pub gptq: super::gptq::GptqOptions,
}

impl QuantizeOptions {
    /// RTN, group 32, embeddings q8.
    pub fn new(kind: QuantKind) -> Self {
        QuantizeOptions {
            kind,
            group: 32,
            method: Method::Rtn,
            embeddings: EmbeddingPolicy::Q8,
            awq: AwqOptions::default(),
            gptq: super::gptq::GptqOptions::default(),
        }
    }

    /// The linear layers' format.
    pub fn format(&self) -> QuantFormat {
        QuantFormat::new(self.kind, self.group)
    }

    /// The embedding / LM head format, `None` for float policies.
    pub fn embedding_format(&self) -> Option<QuantFormat> {
        match self.embeddings {
            EmbeddingPolicy::F32 | EmbeddingPolicy::F16 => None,
            EmbeddingPolicy::Q8 => Some(QuantFormat::new(QuantKind::Q8, 32)),
            EmbeddingPolicy::Same => Some(self.format()),
        }
    }
}

/// One AWQ search outcome, for reports.
#[derive(Debug, Clone, serde::Serialize)]
pub struct AwqSiteReport {
    pub layer: usize,
    pub site: &'static str,
    pub alpha: f32,
    /// Output error of plain RTN on the sampled calibration tokens.
    pub err_rtn: f64,
    /// Output error with the chosen scales (`<= err_rtn`).
    pub err_awq: f64,
}

/// What [`quantize_model`] did.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct QuantReport {
    /// Bytes of the source tensors by dtype name (`f32`, `q4_1`, ...).
    pub bytes_before: BTreeMap<String, usize>,
    /// Bytes of the output tensors by dtype name (`f32`, `q4g32`, ...).
    pub bytes_after: BTreeMap<String, usize>,
    /// Tensors per method: `rtn`, `awq`, `repack` (packed), `f32`, `f16`, `bf16` (float).
    pub methods: BTreeMap<String, usize>,
    /// AWQ search results per layer and site.
    pub awq: Vec<AwqSiteReport>,
    /// Calibration tokens used (0 without AWQ).
    pub calibration_tokens: usize,
    pub calibration_seconds: f64,
    pub search_seconds: f64,
    pub quantize_seconds: f64,
}

/// Progress callbacks of [`quantize_model`].
#[derive(Debug, Clone, Copy)]
pub enum Progress<'a> {
    /// The calibration forward pass finished `layer` of `layers`.
    Calibrate { layer: usize, layers: usize },
    /// The AWQ search finished `layer` of `layers`.
    Search { layer: usize, layers: usize },
    /// Tensor `done` of `total` (`name`) is being written.
    Quantize { name: &'a str, done: usize, total: usize },
}

/// The quantized model: weights (packed linear layers), the metadata to store with them,
/// and a report.
#[derive(Debug, Clone)]
pub struct QuantizedModel {
    pub weights: ModelWeights,
    pub metadata: QuantMetadata,
    pub report: QuantReport,
}

/// What a tensor is, by its Hugging Face name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    /// A decoder-layer projection weight (quantized with the layer format).
    Linear,
    /// `model.embed_tokens.weight` or `lm_head.weight`.
    Embedding,
    /// Norms, biases, anything else: stored as f32.
    Other,
}

fn role(name: &str) -> Role {
    const LINEAR: [&str; 7] = [
        ".self_attn.q_proj.weight",
        ".self_attn.k_proj.weight",
        ".self_attn.v_proj.weight",
        ".self_attn.o_proj.weight",
        ".mlp.gate_proj.weight",
        ".mlp.up_proj.weight",
        ".mlp.down_proj.weight",
    ];
    // A mixture's experts (Hugging Face's names, and Mixtral's w1/w3/w2); its router stays
    // float, as llama.cpp keeps `ffn_gate_inp`.
    const EXPERT: [&str; 6] = [".gate_proj.weight", ".up_proj.weight", ".down_proj.weight", ".w1.weight", ".w2.weight", ".w3.weight"];
    let expert = name.contains(".experts.") && EXPERT.iter().any(|s| name.ends_with(s));
    if name == "model.embed_tokens.weight" || name == "lm_head.weight" {
        Role::Embedding
    } else if name.starts_with("model.layers.") && (expert || LINEAR.iter().any(|s| name.ends_with(s))) {
        Role::Linear
    } else {
        Role::Other
    }
}

fn rows_k(t: &HostTensor) -> Result<(usize, usize), QuantError> {
    match t.shape.as_slice() {
        [r, k] => Ok((*r, *k)),
        s => Err(QuantError::Invalid { tensor: t.name.clone(), reason: format!("expected a 2-D weight, shape is {s:?}") }),
    }
}

/// Round to nearest on all cores (row blocks quantized in parallel, then stacked).
pub fn quantize_parallel(tensor: &str, values: &[f32], rows: usize, k: usize, format: QuantFormat) -> Result<PackedMatrix, QuantError> {
    format.check(tensor, k)?;
    if pool::threads() <= 1 || rows < 64 {
        return PackedMatrix::quantize(tensor, values, rows, k, format);
    }
    let parts = pool::par_ranges(rows, |r| PackedMatrix::quantize(tensor, &values[r.start * k..r.end * k], r.len(), k, format));
    let parts = parts.into_iter().collect::<Result<Vec<_>, _>>()?;
    PackedMatrix::concat_rows(&parts)
}

/// The source tensor in `format` without rounding again, when it already is (GGUF blocks of
/// the same kind with group 32, or packed in exactly this format).
fn repack(t: &HostTensor, format: QuantFormat) -> Option<Result<PackedMatrix, QuantError>> {
    let same = match t.dtype {
        DType::Packed(f) => f == format,
        DType::Q8_0 | DType::Q4_0 | DType::Q4_1 => t.dtype.quant_kind() == Some(format.kind) && format.group == 32,
        _ => false,
    };
    if same && t.shape.len() == 2 {
        t.packed()
    } else {
        None
    }
}

/// The calibration tokens actually used: at most `max_tokens`, and no more than the
/// model's context.
pub fn calibration_slice<'a>(tokens: &'a [u32], opts: &AwqOptions, max_position_embeddings: usize) -> &'a [u32] {
    let n = tokens.len().min(opts.max_tokens.max(1)).min(max_position_embeddings);
    &tokens[..n]
}

/// Quantizes `weights` (any loaded model: float safetensors, or GGUF, whose block tensors
/// are dequantized with [`HostTensor::to_f32`] or repacked when the format matches).
///
/// With [`Method::Awq`], `calibration` holds the token ids of the calibration text (cut to
/// `opts.awq.max_tokens`); it is ignored for RTN. Errors: [`QuantError::GroupMismatch`]
/// naming the first tensor whose row length the group does not divide,
/// [`QuantError::Invalid`] for non-finite weights, and validation errors of the input.
pub fn quantize_model(
    weights: &ModelWeights,
    opts: &QuantizeOptions,
    calibration: Option<&[u32]>,
    progress: &mut dyn FnMut(Progress<'_>),
) -> Result<QuantizedModel, LanternError> {
    validate(weights)?;
    let c = &weights.config;
    let format = opts.format();
    let emb_format = opts.embedding_format();
    let mut names: Vec<&String> = weights.tensors.keys().collect();
    names.sort();
    // Check every shape first, so a bad group fails before any work, naming the tensor.
    for name in &names {
        let t = &weights.tensors[*name];
        let f = match role(name) {
            Role::Linear => Some(format),
            Role::Embedding => emb_format,
            Role::Other => None,
        };
        if let Some(f) = f {
            let (_, k) = rows_k(t)?;
            f.check(name, k)?;
        }
    }
    let mut report = QuantReport::default();
    for t in weights.tensors.values() {
        *report.bytes_before.entry(t.dtype.name()).or_default() += t.data.len();
    }
    let mut meta = QuantMetadata { source: Some(weights.source.clone()), ..QuantMetadata::default() };

    // AWQ: calibrate on the float model, search, fold into float copies of the weights.
    // GPTQ: calibrate on the float model, keeping every token's inputs for the Hessians.
    let mut floats: FloatWeights = HashMap::new();
    let mut results: Vec<[SiteResult; 4]> = Vec::new();
    let mut stats: Vec<awq::LayerStats> = Vec::new();
    let mut calibration_tokens = 0;
    let method_name = match opts.method {
        Method::Gptq => "GPTQ",
        Method::Wanda => "Wanda",
        _ => "AWQ",
    };
    // 2:4 kinds come from magnitude (rtn) or Wanda pruning; Wanda makes nothing else.
    match (opts.method, format.kind.is_sparse()) {
        (Method::Awq | Method::Gptq, true) => {
            return Err(LanternError::Config {
                field: "method".into(),
                reason: format!("{method_name} rounds dense weights; {} is 2:4 sparse: use --method wanda-2:4 or rtn", format.kind.name()),
            })
        }
        (Method::Wanda, false) => {
            return Err(LanternError::Config {
                field: "method".into(),
                reason: format!("wanda-2:4 prunes into a 2:4 kind (s24q4, s24q8), not {}", format.kind.name()),
            })
        }
        _ => {}
    }
    if opts.method != Method::Rtn {
        if c.block != crate::model::BlockSpec::default() {
            return Err(LanternError::Config {
                field: "method".into(),
                reason: format!("{method_name}'s calibration pass runs the Llama block, not {:?}'s; use round-to-nearest", c.arch),
            });
        }
        let tokens = calibration.ok_or_else(|| LanternError::Calibration(format!("{method_name} needs calibration tokens")))?;
        let tokens = calibration_slice(tokens, &opts.awq, c.max_position_embeddings);
        if tokens.is_empty() {
            return Err(LanternError::Calibration(format!("{method_name}: the calibration text has no tokens")));
        }
        for name in &names {
            if role(name) != Role::Embedding || name.as_str() == "model.embed_tokens.weight" {
                floats.insert((*name).clone(), weights.tensors[*name].to_f32());
            }
        }
        let t0 = Instant::now();
        let sample = if matches!(opts.method, Method::Gptq | Method::Wanda) { tokens.len() } else { opts.awq.sample_tokens };
        stats = awq::capture(c, &floats, tokens, sample, &mut |layer, layers| progress(Progress::Calibrate { layer, layers }))?;
        calibration_tokens = tokens.len();
        report.calibration_tokens = tokens.len();
        report.calibration_seconds = t0.elapsed().as_secs_f64();
        if opts.method == Method::Gptq {
            meta.calibration = Some(serde_json::json!({
                "tokens": tokens.len(),
                "damp": opts.gptq.damp,
                "act_order": opts.gptq.act_order,
                "objective": "||W X - Q X||^2 over every calibration token's input to the layer (float model's activations), columns in order",
            }));
        }
        if opts.method == Method::Wanda {
            meta.calibration = Some(serde_json::json!({
                "tokens": tokens.len(),
                "score": "|W_ij| * ||X_j||_2 over every calibration token's input to the layer (float model's activations); the two largest of every four consecutive inputs kept",
            }));
        }
    }
    if opts.method == Method::Awq {
        let t1 = Instant::now();
        let alphas = opts.awq.alphas();
        for (l, st) in stats.iter().enumerate() {
            let mut one = Vec::with_capacity(4);
            for site in Site::ALL {
                let wn = site.weights(l);
                let ws: Vec<&[f32]> = wn.iter().map(|n| floats[n].as_slice()).collect();
                let r = awq::search_site(c, site, &wn, &ws, st.get(site), format, &alphas)?;
                report.awq.push(AwqSiteReport { layer: l, site: site.name(), alpha: r.alpha, err_rtn: r.err_rtn, err_awq: r.err_best });
                one.push(r);
            }
            progress(Progress::Search { layer: l + 1, layers: c.num_layers });
            let [a, b, cc, d]: [SiteResult; 4] = one.try_into().expect("four sites");
            results.push([a, b, cc, d]);
        }
        for (l, r) in results.iter().enumerate() {
            let pick = |r: &SiteResult| (r.alpha > 0.0).then(|| r.scales.clone());
            let s = LayerScales { qkv: pick(&r[0]), o: pick(&r[1]), gate_up: pick(&r[2]), down: pick(&r[3]) };
            awq::fold_layer(c, &mut floats, l, &s)?;
        }
        report.search_seconds = t1.elapsed().as_secs_f64();
        meta.calibration = Some(serde_json::json!({
            "tokens": calibration_tokens,
            "sample_tokens": awq::sample_indices(calibration_tokens, opts.awq.sample_tokens).len(),
            "alpha_grid": alphas,
            "objective": "sum over sampled tokens of ||(W - deq(Q(W diag(s))) / s) x||^2 per group of layers sharing an input",
        }));
        if c.num_heads != c.num_kv_heads {
            meta.notes.push(format!(
                "o_proj scales are tied across the {} query heads of each KV head, so that 1/s folds exactly into the v_proj rows",
                c.group_size()
            ));
        }
    }

    // The output tensors (GPTQ: each site's Hessian made once, for the weights sharing it).
    let mut hessians: HashMap<(usize, Site), Vec<f64>> = HashMap::new();
    let t2 = Instant::now();
    let mut out = HashMap::new();
    let total = names.len();
    for (i, name) in names.iter().enumerate() {
        progress(Progress::Quantize { name, done: i, total });
        let t = &weights.tensors[*name];
        let float = |floats: &FloatWeights| floats.get(*name).cloned().unwrap_or_else(|| t.to_f32());
        let float_tensor = |dtype: DType, values: Vec<f32>| HostTensor {
            name: (*name).clone(),
            shape: t.shape.clone(),
            dtype,
            data: match dtype {
                DType::F16 if t.dtype == DType::F16 => t.data.clone(),
                DType::F16 => values.iter().flat_map(|v| half::f16::from_f32(*v).to_le_bytes()).collect(),
                _ => bytemuck::cast_slice(&values).to_vec(),
            },
        };
        match role(name) {
            Role::Other => {
                out.insert((*name).clone(), float_tensor(DType::F32, float(&floats)));
            }
            Role::Embedding => match (opts.embeddings, emb_format) {
                (EmbeddingPolicy::F32, _) => {
                    out.insert((*name).clone(), float_tensor(DType::F32, t.to_f32()));
                }
                (EmbeddingPolicy::F16, _) => {
                    let v = if t.dtype == DType::F16 { Vec::new() } else { t.to_f32() };
                    out.insert((*name).clone(), float_tensor(DType::F16, v));
                }
                (_, Some(f)) => {
                    let (rows, k) = rows_k(t)?;
                    let (m, method) = match repack(t, f) {
                        Some(r) => (r?, "repack"),
                        None => (quantize_parallel(name, &t.to_f32(), rows, k, f)?, "rtn"),
                    };
                    meta.tensors.insert((*name).clone(), TensorInfo::new(f, method));
                    out.insert((*name).clone(), HostTensor::from_packed(name.as_str(), &m));
                }
                (_, None) => unreachable!("quantized embedding policies have a format"),
            },
            Role::Linear => {
                let (rows, k) = rows_k(t)?;
                let (m, mut info) = if opts.method == Method::Awq {
                    let m = quantize_parallel(name, &floats[*name], rows, k, format)?;
                    (m, TensorInfo::new(format, "awq"))
                } else if opts.method == Method::Gptq {
                    let h = gptq_hessian(&mut hessians, &stats, name)?;
                    let m = super::gptq::quantize(name, &floats[*name], rows, k, h, format, opts.gptq)?;
                    (m, TensorInfo::new(format, "gptq"))
                } else if opts.method == Method::Wanda {
                    let (_, _, x) = site_inputs(&stats, name, "Wanda")?;
                    let norms = super::sparse::input_norms(&x.sample, x.k);
                    let m = super::sparse::quantize(name, &floats[*name], rows, k, format, Some(&norms))?;
                    (m, TensorInfo::new(format, Method::Wanda.name()))
                } else {
                    match repack(t, format) {
                        Some(r) => (r?, TensorInfo::new(format, "repack")),
                        None => (quantize_parallel(name, &t.to_f32(), rows, k, format)?, TensorInfo::new(format, "rtn")),
                    }
                };
                if opts.method == Method::Awq {
                    awq_info(&mut info, name, &results);
                }
                meta.tensors.insert((*name).clone(), info);
                out.insert((*name).clone(), HostTensor::from_packed(name.as_str(), &m));
            }
        }
    }
    progress(Progress::Quantize { name: "", done: total, total });
    report.quantize_seconds = t2.elapsed().as_secs_f64();
    for t in out.values() {
        *report.bytes_after.entry(t.dtype.name()).or_default() += t.data.len();
    }
    for (n, t) in &out {
        let method = match meta.tensors.get(n) {
            Some(info) => info.method.clone(),
            None => {
                meta.float_tensors.insert(n.clone(), t.dtype.name());
                t.dtype.name()
            }
        };
        *report.methods.entry(method).or_default() += 1;
    }
    let weights = ModelWeights { config: c.clone(), tensors: out, source: format!("{} quantized to {}", weights.source, format) };
    validate(&weights)?;
    Ok(QuantizedModel { weights, metadata: meta, report })
}

/// The Hessian `X^T X` of the calibration inputs of linear weight `name` (the site of its
/// layer that feeds it), made on first use and kept for the weights that share the input.
fn gptq_hessian<'a>(
    hessians: &'a mut HashMap<(usize, Site), Vec<f64>>,
    stats: &[awq::LayerStats],
    name: &str,
) -> Result<&'a [f64], LanternError> {
    let (l, site, st) = site_inputs(stats, name, "GPTQ")?;
    // Keep one layer's Hessians at a time: weights come in name order, a layer's together.
    hessians.retain(|key, _| key.0 == l);
    Ok(hessians.entry((l, site)).or_insert_with(|| super::gptq::hessian(&st.sample, st.k)))
}

/// The layer, site and calibration inputs of linear weight `name` (errors name `method`).
fn site_inputs<'a>(stats: &'a [awq::LayerStats], name: &str, method: &str) -> Result<(usize, Site, &'a awq::InputStats), LanternError> {
    let layer = name.strip_prefix("model.layers.").and_then(|r| r.split('.').next()).and_then(|l| l.parse::<usize>().ok());
    let site = layer.and_then(|l| Site::ALL.into_iter().find(|s| s.weights(l).iter().any(|w| w == name)).map(|s| (l, s)));
    let (l, site) = site.ok_or_else(|| LanternError::Calibration(format!("{method}: `{name}` is not a linear weight calibration saw")))?;
    let st = stats.get(l).ok_or_else(|| LanternError::Calibration(format!("{method}: no calibration inputs for layer {l}")))?.get(site);
    Ok((l, site, st))
}

/// Fills the AWQ fields of a linear weight's metadata: its input-scale alpha and fold, and
/// for v_proj / up_proj the row scaling from the next projection.
fn awq_info(info: &mut TensorInfo, name: &str, results: &[[SiteResult; 4]]) {
    let Some(rest) = name.strip_prefix("model.layers.") else {
        return;
    };
    let Some(l) = rest.split('.').next().and_then(|s| s.parse::<usize>().ok()) else {
        return;
    };
    let Some(r) = results.get(l) else { return };
    let site_of = |n: &str| -> Option<usize> {
        if n.ends_with("q_proj.weight") || n.ends_with("k_proj.weight") || n.ends_with("v_proj.weight") {
            Some(0)
        } else if n.ends_with("o_proj.weight") {
            Some(1)
        } else if n.ends_with("gate_proj.weight") || n.ends_with("up_proj.weight") {
            Some(2)
        } else if n.ends_with("down_proj.weight") {
            Some(3)
        } else {
            None
        }
    };
    let Some(si) = site_of(name) else { return };
    let res = &r[si];
    info.alpha = Some(res.alpha);
    if res.alpha > 0.0 {
        info.fold_into = Some(res.site.fold_target(l));
    }
    let next = if name.ends_with("v_proj.weight") {
        Some(&r[1])
    } else if name.ends_with("up_proj.weight") {
        Some(&r[3])
    } else {
        None
    };
    if let Some(n) = next {
        if n.alpha > 0.0 {
            info.row_scales_from = Some(n.site.weights(l)[0].clone());
            info.row_alpha = Some(n.alpha);
        }
    }
}

/// [`load_to_gpu`](crate::model::load::load_to_gpu) with the weights requantized on the host first ([`quantize_model`] with
/// `quant`, calibration-free): for a draft model, whose drafts are only proposals the target
/// checks, so a smaller format makes drafting cheaper without changing the output. The
/// source is read whole (memory-mapped) rather than streamed. It lives here, above
/// `model`, because it quantizes (the model's loaders never do). Errors: those of loading, and
/// [`QuantError::GroupMismatch`](crate::quant::QuantError) naming the first tensor whose row
/// length `quant`'s group does not divide.
#[cfg(not(target_arch = "wasm32"))]
pub async fn load_to_gpu_requantized(
    ctx: std::sync::Arc<crate::gpu::GpuContext>,
    path: &std::path::Path,
    options: crate::model::forward::ModelOptions,
    quant: &QuantizeOptions,
    progress: &mut dyn FnMut(usize, usize),
) -> crate::Result<(crate::model::forward::GpuModel, Option<crate::model::tokenizer::Tokenizer>)> {
    let loaded = crate::model::load::load_path(path)?;
    let q = quantize_model(&loaded.weights, quant, None, &mut |_| {})?;
    drop(loaded.weights);
    let model = crate::model::forward::GpuModel::load_with_progress(ctx, &q.weights, options, progress).await?;
    Ok((model, loaded.tokenizer))
}

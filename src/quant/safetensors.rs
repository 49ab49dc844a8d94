//! Quantized Hugging Face-style model folders, as `lantern quantize` writes them and
//! [`crate::model::hf`] reads them.
//!
//! A folder holds `config.json` (Hugging Face form), `model.safetensors`, and, when the
//! source had a tokenizer, `tokenizer.json` + `tokenizer_config.json`. In `model.safetensors`:
//!
//! - a packed `[rows, k]` weight `<name>` (see [`crate::quant`] for the layout) is two `U32`
//!   entries: `<name>.qweight` (`[rows, qs_words]`: the codes) and `<name>.scales`
//!   (`[rows, scale_words]`: the f16 scales, and minimums for `q4`);
//! - other tensors are stored as `F32`, `F16` or `BF16` under their own names;
//! - `__metadata__["lantern.quantization"]` is JSON ([`QuantMetadata`]):
//!   `{"format_version": 1, "tensors": {"<name>": {"kind": "q4", "group": 32,
//!   "method": "awq", "alpha": 0.5, ...}}, "source": ..., ...}`. `kind` and `group` are
//!   what a loader needs (`k = qs_words * elements per word`); the rest records how each
//!   tensor was made.

use std::collections::HashMap;

use safetensors::tensor::{Dtype as StDtype, TensorView};

use super::{QuantError, QuantFormat, QuantKind};
use crate::error::LanternError;
use crate::model::tokenizer::Tokenizer;
use crate::model::{DType, ModelConfig, ModelWeights};

pub use crate::model::quantized::{
    packed_from_views, parse_metadata, QuantMetadata, TensorInfo, FORMAT_VERSION, METADATA_KEY, QWEIGHT_SUFFIX, SCALES_SUFFIX,
};

/// One safetensors entry to write: name, dtype, shape and borrowed bytes.
struct Entry<'a> {
    name: String,
    dtype: StDtype,
    shape: Vec<usize>,
    data: std::borrow::Cow<'a, [u8]>,
}

/// Plans the entries of `weights`: packed tensors split in two, GGUF blocks repacked, floats
/// as they are. Fills `meta.tensors` for packed tensors it has no entry for, and
/// `meta.float_tensors`.
fn entries<'a>(weights: &'a ModelWeights, meta: &mut QuantMetadata) -> Result<Vec<Entry<'a>>, LanternError> {
    let mut names: Vec<&String> = weights.tensors.keys().collect();
    names.sort();
    let mut out = Vec::new();
    meta.float_tensors.clear();
    for name in names {
        let t = &weights.tensors[name];
        let packed_entry = |out: &mut Vec<Entry<'a>>, format: QuantFormat, rows: usize, k: usize, data: std::borrow::Cow<'a, [u8]>| {
            let nq = rows * format.qs_words(k) * 4;
            let (q, s) = match data {
                std::borrow::Cow::Borrowed(b) => (b[..nq].into(), b[nq..].into()),
                std::borrow::Cow::Owned(v) => (v[..nq].to_vec().into(), v[nq..].to_vec().into()),
            };
            out.push(Entry {
                name: format!("{name}{QWEIGHT_SUFFIX}"),
                dtype: StDtype::U32,
                shape: vec![rows, format.qs_words(k)],
                data: q,
            });
            out.push(Entry {
                name: format!("{name}{SCALES_SUFFIX}"),
                dtype: StDtype::U32,
                shape: vec![rows, format.scale_words(k)],
                data: s,
            });
        };
        let off = weights.config.block.hf_norm_offset;
        match t.dtype {
            // Norm weights in the checkpoint's own convention (Gemma stores w for 1 + w).
            DType::F32 | DType::F16 | DType::BF16 if off != 0.0 && crate::model::BlockSpec::is_norm_weight(name) => {
                meta.float_tensors.insert(name.clone(), DType::F32.name());
                let v: Vec<f32> = t.to_f32().into_iter().map(|x| x - off).collect();
                out.push(Entry {
                    name: name.clone(),
                    dtype: StDtype::F32,
                    shape: t.shape.clone(),
                    data: bytemuck::cast_slice::<f32, u8>(&v).to_vec().into(),
                });
            }
            DType::F32 | DType::F16 | DType::BF16 => {
                let dtype = match t.dtype {
                    DType::F32 => StDtype::F32,
                    DType::F16 => StDtype::F16,
                    _ => StDtype::BF16,
                };
                meta.float_tensors.insert(name.clone(), t.dtype.name());
                out.push(Entry { name: name.clone(), dtype, shape: t.shape.clone(), data: t.data.as_slice().into() });
            }
            DType::Packed(f) => {
                let m = match t.packed() {
                    Some(Ok(m)) => m,
                    Some(Err(e)) => return Err(e.into()),
                    None => unreachable!("packed dtype"),
                };
                let info = meta.tensors.entry(name.clone()).or_insert_with(|| TensorInfo::new(f, "unknown"));
                if info.format() != f {
                    return Err(LanternError::Serialize {
                        what: format!("tensor `{name}`"),
                        reason: format!("it is {f} but its metadata says {}", info.format()),
                    });
                }
                packed_entry(&mut out, f, m.rows, m.k, t.data.as_slice().into());
            }
            DType::Q8_0 | DType::Q4_0 | DType::Q4_1 => match (t.packed(), t.shape.len()) {
                (Some(Ok(m)), 2) => {
                    meta.tensors.entry(name.clone()).or_insert_with(|| TensorInfo::new(m.format, "repack"));
                    packed_entry(&mut out, m.format, m.rows, m.k, m.to_bytes().into());
                }
                (Some(Err(e)), _) => return Err(e.into()),
                _ => {
                    meta.float_tensors.insert(name.clone(), "f32".into());
                    out.push(Entry {
                        name: name.clone(),
                        dtype: StDtype::F32,
                        shape: t.shape.clone(),
                        data: bytemuck::cast_slice(&t.to_f32()).to_vec().into(),
                    });
                }
            },
            other => {
                return Err(QuantError::Invalid {
                    tensor: name.clone(),
                    reason: format!(
                        "is {}: quantized safetensors hold {} packs only (run from the GGUF file itself)",
                        other.name(),
                        QuantKind::rtn_names()
                    ),
                }
                .into())
            }
        }
    }
    meta.tensors.retain(|n, _| weights.tensors.get(n).is_some_and(|t| t.dtype.quant_kind().is_some()));
    Ok(out)
}

fn st_err(e: safetensors::SafeTensorError) -> LanternError {
    LanternError::Serialize { what: "safetensors".into(), reason: e.to_string() }
}

fn views<'a>(entries: &'a [Entry<'a>]) -> Result<Vec<(String, TensorView<'a>)>, LanternError> {
    entries.iter().map(|e| TensorView::new(e.dtype, e.shape.clone(), &e.data).map(|v| (e.name.clone(), v)).map_err(st_err)).collect()
}

fn header(meta: &QuantMetadata) -> Result<HashMap<String, String>, LanternError> {
    let json = serde_json::to_string(meta)
        .map_err(|e| LanternError::Serialize { what: "the lantern.quantization metadata".into(), reason: e.to_string() })?;
    Ok(HashMap::from([(METADATA_KEY.to_string(), json), ("format".to_string(), "pt".to_string())]))
}

/// `weights` as the bytes of a quantized `model.safetensors` (see the module docs), with
/// `meta` (completed for every packed tensor) in `__metadata__`.
pub fn to_safetensors_bytes(weights: &ModelWeights, meta: &QuantMetadata) -> Result<Vec<u8>, LanternError> {
    let mut meta = meta.clone();
    let entries = entries(weights, &mut meta)?;
    safetensors::tensor::serialize(views(&entries)?, Some(header(&meta)?)).map_err(st_err)
}

/// `tokenizer.json` and `tokenizer_config.json` texts that
/// [`Tokenizer::from_hf_files`] reads back into an identical tokenizer (same ids, special
/// tokens, BOS behaviour and chat template).
pub fn tokenizer_files(tok: &Tokenizer, config: &ModelConfig) -> Result<(String, String), LanternError> {
    let json =
        tok.inner().to_string(false).map_err(|e| LanternError::Serialize { what: "tokenizer.json".into(), reason: e.to_string() })?;
    let mut cfg = serde_json::json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": tok.add_bos(),
        "add_eos_token": false,
        "clean_up_tokenization_spaces": false,
        "model_max_length": config.max_position_embeddings,
    });
    if let Some(b) = tok.bos_token() {
        cfg["bos_token"] = b.into();
    }
    if let Some(e) = tok.eos_token() {
        cfg["eos_token"] = e.into();
    }
    if let Some(t) = tok.chat_template_source() {
        cfg["chat_template"] = t.into();
    }
    let cfg = serde_json::to_string_pretty(&cfg)
        .map_err(|e| LanternError::Serialize { what: "tokenizer_config.json".into(), reason: e.to_string() })?;
    Ok((json, cfg))
}

/// Files of a written folder and their sizes.
#[derive(Debug, Clone, Default)]
pub struct WrittenFolder {
    pub files: Vec<(std::path::PathBuf, u64)>,
}

/// Writes a quantized model folder: `config.json`, `model.safetensors` (with `meta`) and,
/// with a tokenizer, `tokenizer.json` + `tokenizer_config.json`. Creates `dir` if needed;
/// existing files of those names are replaced. The folder loads with
/// [`crate::model::load::load_path`].
#[cfg(not(target_arch = "wasm32"))]
pub fn write_model_folder(
    dir: &std::path::Path,
    weights: &ModelWeights,
    meta: &QuantMetadata,
    tokenizer: Option<&Tokenizer>,
) -> Result<WrittenFolder, LanternError> {
    use crate::model::hf::{CONFIG_FILE, SINGLE_FILE};
    std::fs::create_dir_all(dir).map_err(|e| LanternError::io(dir, e))?;
    let mut written = WrittenFolder::default();
    let mut put = |name: &str, text: &str| -> Result<(), LanternError> {
        let p = dir.join(name);
        std::fs::write(&p, text).map_err(|e| LanternError::io(&p, e))?;
        written.files.push((p, text.len() as u64));
        Ok(())
    };
    put(CONFIG_FILE, &weights.config.to_hf_json()?)?;
    if let Some(tok) = tokenizer {
        let (tj, tc) = tokenizer_files(tok, &weights.config)?;
        put("tokenizer.json", &tj)?;
        put("tokenizer_config.json", &tc)?;
    }
    let mut meta = meta.clone();
    let entries = entries(weights, &mut meta)?;
    let path = dir.join(SINGLE_FILE);
    // Written under a temporary name and renamed, so a failed run leaves no half file that
    // looks complete.
    let tmp = dir.join(format!("{SINGLE_FILE}.partial"));
    safetensors::tensor::serialize_to_file(views(&entries)?, Some(header(&meta)?), &tmp).map_err(|e| match e {
        safetensors::SafeTensorError::IoError(io) => LanternError::io(&tmp, io),
        other => st_err(other),
    })?;
    std::fs::rename(&tmp, &path).map_err(|e| LanternError::io(&path, e))?;
    let len = std::fs::metadata(&path).map_err(|e| LanternError::io(&path, e))?.len();
    written.files.push((path, len));
    Ok(written)
}

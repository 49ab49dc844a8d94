//! Hugging Face folder loader: `config.json` plus `model.safetensors`, or sharded
//! `model-0000k-of-0000n.safetensors` files listed by `model.safetensors.index.json`.
//!
//! Tensors keep their file dtype (F32, F16 or BF16) and their Hugging Face names and shapes;
//! FP8 (`F8_E4M3`) weights and their scales become one packed [`QuantKind::Fp8`](crate::quant::QuantKind::Fp8)
//! tensor each ([`crate::model::fp8`]);
//! the packed weights of a `lantern quantize` folder (`<name>.qweight` + `<name>.scales`
//! described by `lantern.quantization` metadata) load as one [`DType::Packed`] tensor each.
//! Natively the files are memory-mapped ([`load_hf_folder`]); in the browser the caller
//! fetches the files and hands over the bytes ([`load_hf_buffers`]). Both validate the
//! result against the config ([`crate::model::validate::validate`]).

use std::collections::{BTreeMap, HashMap};

use safetensors::tensor::{Dtype as StDtype, SafeTensorError, SafeTensors};

use super::config::ModelConfig;
use super::tensor::{DType, HostTensor, ModelWeights};
use super::validate::validate;
use super::LoadError;
use crate::error::LanternError;

/// Name of the model config file in a Hugging Face folder.
pub const CONFIG_FILE: &str = "config.json";
/// Name of the single weights file of an unsharded checkpoint.
pub const SINGLE_FILE: &str = "model.safetensors";
/// Name of the shard index of a sharded checkpoint.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// Maps a safetensors dtype to a storage dtype this runtime keeps, or `None`.
fn map_dtype(d: StDtype) -> Option<DType> {
    match d {
        StDtype::F32 => Some(DType::F32),
        StDtype::F16 => Some(DType::F16),
        StDtype::BF16 => Some(DType::BF16),
        StDtype::F8_E4M3 => Some(DType::F8_E4M3),
        _ => None,
    }
}

/// Turns a safetensors parse error into a message that says what is wrong with the file.
fn describe(err: SafeTensorError, len: usize) -> String {
    match err {
        SafeTensorError::HeaderTooSmall => {
            format!("file is {len} bytes, too short for the 8-byte header length (truncated or not a safetensors file)")
        }
        SafeTensorError::InvalidHeaderLength => {
            format!("header length runs past the end of the file ({len} bytes): truncated or not a safetensors file")
        }
        SafeTensorError::HeaderTooLarge => "header length is implausibly large (corrupt, or not a safetensors file)".to_string(),
        SafeTensorError::MetadataIncompleteBuffer => {
            format!("tensor data does not match the file size ({len} bytes): the file is truncated or has trailing bytes")
        }
        SafeTensorError::InvalidHeaderDeserialization(e) => format!("corrupt header JSON: {e}"),
        other => other.to_string(),
    }
}

/// Parses one safetensors file's bytes and adds its tensors to `out`, copied in their file
/// dtype. `file` names the file in errors.
///
/// Packed tensors of a quantized checkpoint (`lantern quantize`: `U32` `<name>.qweight` and
/// `<name>.scales` entries described by the `lantern.quantization` metadata, see
/// [`crate::quant::safetensors`]) become one [`DType::Packed`] tensor `<name>` with its
/// logical shape `[rows, k]`.
///
/// Errors: [`LoadError::Safetensors`] for a corrupt or truncated file,
/// [`LoadError::UnsupportedDType`] for a dtype other than F32/F16/BF16/F8_E4M3 (or U32 outside a
/// packed pair), [`LoadError::Quantized`] for packed tensors with bad or missing metadata or
/// mismatched sizes, and [`LoadError::Invalid`] for a tensor name already present in `out`.
pub fn read_safetensors(file: &str, bytes: &[u8], out: &mut HashMap<String, HostTensor>) -> Result<(), LanternError> {
    use crate::model::quantized::{packed_from_views, parse_metadata, METADATA_KEY, QWEIGHT_SUFFIX, SCALES_SUFFIX};
    let st =
        SafeTensors::deserialize(bytes).map_err(|e| LoadError::Safetensors { file: file.to_string(), reason: describe(e, bytes.len()) })?;
    // `deserialize` succeeded, so the header parses again.
    let quant = match SafeTensors::read_metadata(bytes) {
        Ok((_, md)) => match md.metadata().as_ref().and_then(|m| m.get(METADATA_KEY)) {
            Some(text) => Some(parse_metadata(text, file)?),
            None => None,
        },
        Err(_) => None,
    };
    // Sorted so that the first error reported does not depend on hash order.
    let mut views = st.tensors();
    views.sort_by(|a, b| a.0.cmp(&b.0));
    let mut insert = |name: String, t: HostTensor| -> Result<(), LanternError> {
        if out.contains_key(&name) {
            return Err(LoadError::Invalid { file: file.to_string(), reason: format!("tensor `{name}` is stored more than once") }.into());
        }
        out.insert(name, t);
        Ok(())
    };
    // Packed pairs by logical name: (qweight, scales).
    type Pair<'v, 'd> = (Option<&'v safetensors::tensor::TensorView<'d>>, Option<&'v safetensors::tensor::TensorView<'d>>);
    let mut packed: BTreeMap<String, Pair> = BTreeMap::new();
    for (name, view) in &views {
        if view.dtype() == StDtype::U32 {
            if let Some(base) = name.strip_suffix(QWEIGHT_SUFFIX) {
                packed.entry(base.to_string()).or_default().0 = Some(view);
                continue;
            }
            if let Some(base) = name.strip_suffix(SCALES_SUFFIX) {
                packed.entry(base.to_string()).or_default().1 = Some(view);
                continue;
            }
        }
        let dtype = map_dtype(view.dtype()).ok_or_else(|| LoadError::UnsupportedDType {
            file: file.to_string(),
            tensor: name.clone(),
            dtype: format!(
                "{} (supported: F32, F16, BF16, F8_E4M3 with its scale, and U32 {QWEIGHT_SUFFIX}/{SCALES_SUFFIX} pairs of a quantized checkpoint)",
                view.dtype()
            ),
        })?;
        insert(name.clone(), HostTensor { name: name.clone(), shape: view.shape().to_vec(), dtype, data: view.data().to_vec() })?;
    }
    for (base, (q, s)) in packed {
        let t = packed_from_views(file, quant.as_ref(), &base, q, s)?;
        insert(base, t)?;
    }
    Ok(())
}

/// Reads a `model.safetensors.index.json`: its `weight_map` (tensor name -> shard file name).
/// `file` names the index in errors.
pub fn parse_index(text: &str, file: &str) -> Result<BTreeMap<String, String>, LanternError> {
    let invalid = |reason: String| LoadError::Invalid { file: file.to_string(), reason };
    let root: serde_json::Value = serde_json::from_str(text).map_err(|e| invalid(format!("not valid JSON: {e}")))?;
    let map = root.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| invalid("no `weight_map` object".to_string()))?;
    let mut out = BTreeMap::new();
    for (tensor, shard) in map {
        let shard = shard.as_str().ok_or_else(|| invalid(format!("weight_map entry for `{tensor}` is not a file name: {shard}")))?;
        // Shards must sit beside the index: no paths.
        if shard.is_empty() || shard.contains('/') || shard.contains('\\') || shard == ".." {
            return Err(invalid(format!("weight_map entry for `{tensor}` is not a plain file name: {shard:?}")).into());
        }
        out.insert(tensor.clone(), shard.to_string());
    }
    if out.is_empty() {
        return Err(invalid("`weight_map` is empty".to_string()).into());
    }
    Ok(out)
}

/// The distinct shard file names an index lists, in sorted order (what a browser must fetch).
pub fn shard_files(index_json: &str, file: &str) -> Result<Vec<String>, LanternError> {
    let mut shards: Vec<String> = parse_index(index_json, file)?.into_values().collect();
    shards.sort();
    shards.dedup();
    Ok(shards)
}

/// Checks that every tensor the index names was found in the shard it names.
fn check_index(index_file: &str, weight_map: &BTreeMap<String, String>, found_in: &HashMap<String, String>) -> Result<(), LanternError> {
    use crate::model::quantized::{QWEIGHT_SUFFIX, SCALES_SUFFIX};
    for (tensor, shard) in weight_map {
        // The `.qweight` / `.scales` entries of a packed tensor load as one tensor.
        let logical = tensor
            .strip_suffix(QWEIGHT_SUFFIX)
            .or_else(|| tensor.strip_suffix(SCALES_SUFFIX))
            .filter(|base| !found_in.contains_key(tensor.as_str()) && found_in.contains_key(*base));
        match found_in.get(logical.unwrap_or(tensor)) {
            Some(f) if f == shard => {}
            Some(f) => {
                return Err(LoadError::Invalid {
                    file: index_file.to_string(),
                    reason: format!("weight_map puts `{tensor}` in {shard}, but it is stored in {f}"),
                }
                .into())
            }
            None => return Err(LoadError::MissingTensor { file: shard.clone(), tensor: tensor.clone() }.into()),
        }
    }
    Ok(())
}

/// Moves one file's tensors into `tensors`, recording in `found_in` that `shard` held
/// each; a name already loaded from another file is an error naming `file` (the path).
fn merge(
    file: &str,
    shard: &str,
    part: HashMap<String, HostTensor>,
    tensors: &mut HashMap<String, HostTensor>,
    found_in: &mut HashMap<String, String>,
) -> Result<(), LanternError> {
    let mut names: Vec<String> = part.keys().cloned().collect();
    names.sort();
    if let Some(dup) = names.iter().find(|n| tensors.contains_key(*n)) {
        return Err(
            LoadError::Invalid { file: file.to_string(), reason: format!("tensor `{dup}` is also stored in {}", found_in[dup]) }.into()
        );
    }
    for (name, t) in part {
        found_in.insert(name.clone(), shard.to_string());
        tensors.insert(name, t);
    }
    Ok(())
}

/// Loads a checkpoint from bytes already in memory (the browser path): `config_json` is the
/// text of `config.json`, `index_json` that of `model.safetensors.index.json` when the
/// checkpoint is sharded, and `files` the safetensors files as `(file name, bytes)`.
///
/// With an index, every shard it names must be among `files` and hold the tensors it says.
/// The result is validated against the config.
pub fn load_hf_buffers(config_json: &str, index_json: Option<&str>, files: &[(&str, &[u8])]) -> Result<ModelWeights, LanternError> {
    let config = ModelConfig::from_hf_json(config_json, CONFIG_FILE)?;
    let mut tensors = HashMap::new();
    let mut found_in = HashMap::new();
    for (name, bytes) in files {
        let mut part = HashMap::new();
        read_safetensors(name, bytes, &mut part)?;
        merge(name, name, part, &mut tensors, &mut found_in)?;
    }
    if let Some(index) = index_json {
        let weight_map = parse_index(index, INDEX_FILE)?;
        for shard in weight_map.values() {
            if !files.iter().any(|(n, _)| n == shard) {
                return Err(LoadError::Invalid {
                    file: INDEX_FILE.to_string(),
                    reason: format!("names shard {shard}, which was not provided"),
                }
                .into());
            }
        }
        check_index(INDEX_FILE, &weight_map, &found_in)?;
    }
    let source = match files {
        [(one, _)] => one.to_string(),
        _ => format!("{} safetensors files", files.len()),
    };
    crate::model::fp8::pack_fp8_tensors(&source, &mut tensors)?;
    let mut weights = ModelWeights { config, tensors, source };
    apply_norm_offset(&mut weights);
    weights.unfuse()?;
    validate(&weights)?;
    Ok(weights)
}

/// HF norm weights into Lantern's convention: `w + hf_norm_offset` (Gemma stores `w` and
/// applies `1 + w`), as f32. Nothing happens for architectures without an offset.
pub(crate) fn apply_norm_offset(weights: &mut ModelWeights) {
    let off = weights.config.block.hf_norm_offset;
    if off == 0.0 {
        return;
    }
    for (name, t) in weights.tensors.iter_mut() {
        if crate::model::BlockSpec::is_norm_weight(name) && t.dtype.quant_kind().is_none() {
            let v: Vec<f32> = t.to_f32().into_iter().map(|x| x + off).collect();
            *t = crate::model::HostTensor::from_f32(name.clone(), t.shape.clone(), &v);
        }
    }
}

#[cfg(not(target_arch = "wasm32"))]
pub use native::{load_hf_folder, read_hf_folder};

#[cfg(not(target_arch = "wasm32"))]
mod native {
    use std::collections::HashMap;
    use std::fs::File;
    use std::path::Path;

    use super::{check_index, merge, parse_index, read_safetensors, CONFIG_FILE, INDEX_FILE, SINGLE_FILE};
    use crate::error::LanternError;
    use crate::model::validate::validate;
    use crate::model::{LoadError, ModelConfig, ModelWeights};

    fn read_text(path: &Path) -> Result<String, LanternError> {
        std::fs::read_to_string(path).map_err(|e| LanternError::io(path, e))
    }

    /// Memory-maps one safetensors file and copies its tensors into `out`.
    fn read_file(path: &Path, out: &mut HashMap<String, crate::model::HostTensor>) -> Result<(), LanternError> {
        let shown = path.display().to_string();
        let file = File::open(path).map_err(|e| LanternError::io(path, e))?;
        let len = file.metadata().map_err(|e| LanternError::io(path, e))?.len();
        if len < 8 {
            // Too short to map usefully (and zero-length maps fail on some platforms).
            let bytes = std::fs::read(path).map_err(|e| LanternError::io(path, e))?;
            return read_safetensors(&shown, &bytes, out);
        }
        // SAFETY: the map is read-only and dropped before returning; every tensor is copied
        // out. Another process truncating the file while we read it could fault, which is
        // the usual caveat of memory-mapped loading.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| LanternError::io(path, e))?;
        read_safetensors(&shown, &map, out)
    }

    /// Reads a Hugging Face folder without validating tensor names and shapes against the
    /// config (see [`load_hf_folder`] for the checked version).
    pub fn read_hf_folder(dir: &Path) -> Result<ModelWeights, LanternError> {
        let config_path = dir.join(CONFIG_FILE);
        if !config_path.is_file() {
            return Err(LoadError::Invalid {
                file: dir.display().to_string(),
                reason: format!(
                    "no {CONFIG_FILE} here: expected a Hugging Face model folder ({CONFIG_FILE} + {SINGLE_FILE} or {INDEX_FILE})"
                ),
            }
            .into());
        }
        let config = ModelConfig::from_hf_json(&read_text(&config_path)?, &config_path.display().to_string())?;

        let mut tensors = HashMap::new();
        let index_path = dir.join(INDEX_FILE);
        let single_path = dir.join(SINGLE_FILE);
        if index_path.is_file() {
            let index_name = index_path.display().to_string();
            let weight_map = parse_index(&read_text(&index_path)?, &index_name)?;
            let mut shards: Vec<&String> = weight_map.values().collect();
            shards.sort();
            shards.dedup();
            let mut found_in = HashMap::new();
            for shard in shards {
                let shard_path = dir.join(shard);
                if !shard_path.is_file() {
                    return Err(LoadError::Invalid {
                        file: index_name,
                        reason: format!("names shard {shard}, which does not exist in {}", dir.display()),
                    }
                    .into());
                }
                let mut part = HashMap::new();
                read_file(&shard_path, &mut part)?;
                merge(&shard_path.display().to_string(), shard, part, &mut tensors, &mut found_in)?;
            }
            check_index(&index_name, &weight_map, &found_in)?;
        } else if single_path.is_file() {
            read_file(&single_path, &mut tensors)?;
        } else {
            let has_bin = dir.join("pytorch_model.bin").is_file() || dir.join("pytorch_model.bin.index.json").is_file();
            return Err(LoadError::Invalid {
                file: dir.display().to_string(),
                reason: if has_bin {
                    format!("only PyTorch .bin weights here; convert them to safetensors ({SINGLE_FILE})")
                } else {
                    format!("neither {SINGLE_FILE} nor {INDEX_FILE} found")
                },
            }
            .into());
        }
        crate::model::fp8::pack_fp8_tensors(&dir.display().to_string(), &mut tensors)?;
        let mut weights = ModelWeights { config, tensors, source: dir.display().to_string() };
        super::apply_norm_offset(&mut weights);
        weights.unfuse()?;
        Ok(weights)
    }

    /// Loads a Hugging Face model folder (`config.json` plus `model.safetensors`, or shards
    /// listed by `model.safetensors.index.json`), memory-mapping the weight files, and
    /// validates every tensor's presence and shape against the config.
    pub fn load_hf_folder(dir: &Path) -> Result<ModelWeights, LanternError> {
        let weights = read_hf_folder(dir)?;
        validate(&weights)?;
        Ok(weights)
    }
}

//! One entry point for every model source: a GGUF file or a Hugging Face folder.

use crate::model::tokenizer::Tokenizer;
use crate::model::ModelWeights;
#[cfg(not(target_arch = "wasm32"))]
use crate::{LanternError, Result};

/// Weights plus the tokenizer that came with them (if the source has one).
pub struct LoadedModel {
    pub weights: ModelWeights,
    pub tokenizer: Option<Tokenizer>,
}

/// Load a GGUF file or a Hugging Face folder (config.json, model.safetensors or shards with
/// their index, tokenizer.json, tokenizer_config.json), memory-mapping the weights.
#[cfg(not(target_arch = "wasm32"))]
pub fn load_path(path: &std::path::Path) -> Result<LoadedModel> {
    if path.is_dir() {
        let weights = crate::model::hf::load_hf_folder(path)?;
        let tj = path.join("tokenizer.json");
        let tokenizer = if tj.is_file() {
            let bytes = std::fs::read(&tj).map_err(|e| LanternError::io(&tj, e))?;
            let tc = path.join("tokenizer_config.json");
            let cfg = if tc.is_file() {
                Some(std::fs::read(&tc).map_err(|e| LanternError::io(&tc, e))?)
            } else {
                None
            };
            Some(Tokenizer::from_hf_files(&bytes, cfg.as_deref())?)
        } else {
            None
        };
        return Ok(LoadedModel { weights, tokenizer });
    }
    if !path.exists() {
        return Err(LanternError::io(
            path,
            std::io::Error::new(std::io::ErrorKind::NotFound, "no such file or folder"),
        ));
    }
    let map = crate::model::gguf::GgufMmap::open(path)?;
    let gguf = map.parse()?;
    let weights = crate::model::gguf::weights_from_gguf(&gguf, gguf.file_name())?;
    let tokenizer = Some(Tokenizer::from_gguf(&gguf)?);
    Ok(LoadedModel { weights, tokenizer })
}

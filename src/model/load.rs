//! One entry point for every model source: a GGUF file or a Hugging Face folder.

use crate::model::tokenizer::Tokenizer;
use crate::model::ModelWeights;
#[cfg(not(target_arch = "wasm32"))]
use crate::LanternError;
use crate::Result;

/// Weights plus the tokenizer that came with them (if the source has one).
pub struct LoadedModel {
    pub weights: ModelWeights,
    pub tokenizer: Option<Tokenizer>,
}

/// Load a GGUF file or a Hugging Face folder (config.json, model.safetensors or shards with
/// their index, tokenizer.json, tokenizer_config.json, chat_template.jinja), memory-mapping
/// the weights. A `chat_template.jinja` (where transformers 4.43+ saves the template) wins
/// over `tokenizer_config.json`'s `chat_template`, as in transformers.
#[cfg(not(target_arch = "wasm32"))]
pub fn load_path(path: &std::path::Path) -> Result<LoadedModel> {
    if path.is_dir() {
        let weights = crate::model::hf::load_hf_folder(path)?;
        let tj = path.join("tokenizer.json");
        let tokenizer = if tj.is_file() {
            let bytes = std::fs::read(&tj).map_err(|e| LanternError::io(&tj, e))?;
            let tc = path.join("tokenizer_config.json");
            let cfg = if tc.is_file() { Some(std::fs::read(&tc).map_err(|e| LanternError::io(&tc, e))?) } else { None };
            let mut tok = Tokenizer::from_hf_files(&bytes, cfg.as_deref())?;
            let jinja = path.join("chat_template.jinja");
            if jinja.is_file() {
                tok.set_chat_template(std::fs::read_to_string(&jinja).map_err(|e| LanternError::io(&jinja, e))?);
            }
            Some(tok)
        } else {
            None
        };
        return Ok(LoadedModel { weights, tokenizer });
    }
    if !path.exists() {
        return Err(LanternError::io(path, std::io::Error::new(std::io::ErrorKind::NotFound, "no such file or folder")));
    }
    let map = crate::model::gguf::GgufMmap::open(path)?;
    let gguf = map.parse()?;
    let weights = crate::model::gguf::weights_from_gguf(&gguf, gguf.file_name())?;
    let tokenizer = Some(Tokenizer::from_gguf(&gguf)?);
    Ok(LoadedModel { weights, tokenizer })
}

/// Load a model straight onto the GPU: a GGUF is streamed, its header parsed from the first
/// bytes and then one layer's tensors at a time read by offset, converted, uploaded and
/// dropped ([`GpuModel::load_streamed`](crate::model::forward::GpuModel::load_streamed)), so
/// host memory holds about one layer instead of a copy of every tensor; a Hugging
/// Face folder is read whole ([`load_path`]) and uploaded. Returns the model and the
/// tokenizer that came with it.
#[cfg(not(target_arch = "wasm32"))]
pub async fn load_to_gpu(
    ctx: std::sync::Arc<crate::gpu::GpuContext>,
    path: &std::path::Path,
    options: crate::model::forward::ModelOptions,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<(crate::model::forward::GpuModel, Option<Tokenizer>)> {
    use crate::model::forward::GpuModel;
    if path.is_dir() || !path.exists() {
        let loaded = load_path(path)?;
        let model = GpuModel::load_with_progress(ctx, &loaded.weights, options, progress).await?;
        return Ok((model, loaded.tokenizer));
    }
    // Each tensor read by offset into a buffer that lives for its part only: no map, so host
    // memory holds about one layer rather than the file.
    use std::io::{Read, Seek, SeekFrom};
    let mut file = std::fs::File::open(path).map_err(|e| LanternError::io(path, e))?;
    let file_len = file.metadata().map_err(|e| LanternError::io(path, e))?.len();
    let mut read = async |start: u64, end: u64| -> Result<Vec<u8>> {
        let mut raw = vec![0u8; (end - start) as usize];
        file.seek(SeekFrom::Start(start)).and_then(|_| file.read_exact(&mut raw)).map_err(|e| LanternError::io(path, e))?;
        Ok(raw)
    };
    let (model, tokenizer) = load_gguf_streamed(ctx, &path.display().to_string(), file_len, options, &mut read, progress).await?;
    Ok((model, Some(tokenizer)))
}

/// Stream a GGUF of `file_len` bytes onto the GPU through `read(start, end)` (its bytes in
/// that range): the header from the first 4 MiB (more, four times at a time, until it fits),
/// then one layer's tensors at a time, converted, unfused, checked, uploaded and dropped
/// ([`GpuModel::load_streamed`](crate::model::forward::GpuModel::load_streamed)). Native files
/// ([`load_to_gpu`]) and browser `Blob`s (`web.rs`) both load this way.
pub async fn load_gguf_streamed(
    ctx: std::sync::Arc<crate::gpu::GpuContext>,
    name: &str,
    file_len: u64,
    options: crate::model::forward::ModelOptions,
    read: &mut impl AsyncFnMut(u64, u64) -> Result<Vec<u8>>,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<(crate::model::forward::GpuModel, Tokenizer)> {
    use crate::model::forward::Part;
    use crate::model::gguf::{
        check_streamed, config_from_gguf, convert_tensor, gguf_info_for, part_tensors, row_range, weights_part_except, GgufError, GgufFile,
        STREAMED_MATRICES,
    };
    let mut n = 4u64 << 20;
    let prefix = loop {
        let prefix = read(0, n.min(file_len)).await?;
        match GgufFile::parse_prefix(&prefix, file_len, name) {
            Ok(_) => break prefix,
            Err(GgufError::Truncated { .. }) if n < file_len => n *= 4,
            Err(e) => return Err(e.into()),
        }
    };
    let gguf = GgufFile::parse_prefix(&prefix, file_len, name)?;
    let config = config_from_gguf(&gguf)?;
    let tokenizer = Tokenizer::from_gguf(&gguf)?;
    let mut fetch = async |part: Part| -> Result<ModelWeights> {
        let layer = match part {
            Part::Layer(l) => Some(l),
            Part::Globals => None,
            Part::Rows { tensor, start, end } => {
                // A slice of the embedding table or the head, read by byte range.
                let info = gguf_info_for(&gguf, &config, &tensor)
                    .ok_or_else(|| crate::model::LoadError::MissingTensor { file: name.to_string(), tensor: tensor.clone() })?;
                let (a, b) = row_range(&gguf, info, start, end, name)?;
                let mut shape = info.shape();
                shape[0] = end - start;
                let data = read(a, b).await?;
                let t = crate::model::HostTensor { name: tensor.clone(), shape, dtype: gguf.loadable_dtype(info)?, data };
                return Ok(ModelWeights { config: config.clone(), tensors: [(tensor, t)].into(), source: name.to_string() });
            }
        };
        // The embedding table and head come by rows (`Part::Rows`), not with the globals.
        let streamed: &[&str] = if layer.is_none() { &STREAMED_MATRICES } else { &[] };
        if layer.is_none() {
            check_streamed(&gguf, &config, streamed, name)?;
        }
        let mut tensors = Vec::new();
        for info in part_tensors(&gguf, layer) {
            if crate::model::gguf::hf_tensor_name(&info.name, config.arch).is_some_and(|hf| streamed.contains(&hf.as_str())) {
                continue;
            }
            let (a, b) = gguf.tensor_range(info);
            let raw = read(a, b).await?;
            tensors.extend(convert_tensor(&config, info, gguf.loadable_dtype(info)?, raw, name)?);
        }
        weights_part_except(&config, layer, tensors, streamed, name)
    };
    let model = crate::model::forward::GpuModel::load_streamed(ctx, config.clone(), options, &mut fetch, progress).await?;
    Ok((model, tokenizer))
}

//! The speculative decoding options shared by `run`, `serve` and `bench`, and loading the
//! draft model beside the target.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::Args;

use lantern::engine::speculative::{self, Drafter, Speculation};
use lantern::gpu::GpuContext;
use lantern::model::forward::{GpuModel, ModelOptions};
use lantern::model::tokenizer::Tokenizer;
use lantern::quant::quantize::{EmbeddingPolicy, QuantizeOptions};
use lantern::quant::QuantKind;

#[derive(Args, Clone, Debug, Default)]
pub struct SpecArgs {
    /// Speculative decoding with this draft model (a GGUF file, a Hugging Face folder or a
    /// catalogue name) sharing the target's tokenizer: it drafts tokens, the target checks
    /// them all in one step. Greedy output is unchanged; sampled output keeps the target's
    /// distribution.
    #[arg(long)]
    pub draft: Option<PathBuf>,
    /// Speculative decoding with drafts looked up in the prompt and the text so far (the
    /// continuation of the longest recent n-gram match; no second model).
    #[arg(long, conflicts_with = "draft")]
    pub lookup: bool,
    /// Tokens drafted per step (fixed; 0 turns speculation off). Default: adaptive, from the
    /// measured acceptance rate and step costs, 1 to --max-draft.
    #[arg(long)]
    pub draft_tokens: Option<usize>,
    /// Most tokens drafted per step when adaptive.
    #[arg(long, default_value_t = 8)]
    pub max_draft: usize,
    /// Longest n-gram --lookup matches (shorter ones are tried after it).
    #[arg(long, default_value_t = 3)]
    pub lookup_ngram: usize,
    /// Requantize the draft model at load, round to nearest with group 32, LM head included:
    /// q4 (4-bit, scale and minimum) or q8; `native` keeps its file's formats. Drafts are
    /// only proposals the target checks, so output is unchanged; a smaller draft drafts
    /// faster (README: measured speedups). Default: native.
    #[arg(long, value_enum)]
    pub draft_quant: Option<DraftQuant>,
}

/// How the draft model's weights are stored on the GPU.
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DraftQuant {
    /// As in the draft's file.
    #[default]
    Native,
    /// 4-bit with a scale and a minimum per 32 weights (`lantern quantize --to q4`).
    Q4,
    /// 8-bit symmetric per 32 weights.
    Q8,
}

impl DraftQuant {
    /// The option's value as typed (`native`, `q4`, `q8`): clap's name for it.
    pub fn name(self) -> String {
        clap::ValueEnum::to_possible_value(&self).map(|v| v.get_name().to_string()).unwrap_or_default()
    }

    /// The packed format the draft is requantized to (`None`: as loaded).
    pub fn kind(self) -> Option<QuantKind> {
        match self {
            DraftQuant::Native => None,
            DraftQuant::Q4 => Some(QuantKind::Q4),
            DraftQuant::Q8 => Some(QuantKind::Q8),
        }
    }
}

impl SpecArgs {
    /// The requests' speculation settings.
    pub fn speculation(&self) -> Speculation {
        let drafter = if self.draft.is_some() {
            Drafter::Model
        } else if self.lookup {
            Drafter::Lookup
        } else {
            Drafter::Off
        };
        Speculation { drafter, draft_tokens: self.draft_tokens, max_draft: self.max_draft, lookup_ngram: self.lookup_ngram.max(1) }
    }

    /// Where this adapter's measured step costs of the target (and, with `--draft`, of the
    /// draft model) are kept (`lantern::engine::step_costs`), keyed by file, size, and what
    /// changes their kernels.
    pub fn cost_files(&self, ctx: &GpuContext, target_path: &Path, options: &ModelOptions) -> Result<(PathBuf, Option<PathBuf>)> {
        let dir = lantern::fetch::cache_dir().join("costs");
        let key = |path: &Path, extra: &str| -> Result<PathBuf> {
            let len = std::fs::metadata(path).with_context(|| format!("reading {}", path.display()))?.len();
            let name = path.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
            let k = format!("{name}-{len}-{:?}-{:?}-{extra}", options.kv_dtype, options.weights);
            Ok(lantern::engine::step_costs::path(&dir, &ctx.info, &ctx.kernels, &k))
        };
        let draft = match &self.draft {
            Some(name) => {
                let path = lantern::fetch::resolve_model(Some(name.as_path()), false)?;
                Some(key(&path, &self.draft_quant.unwrap_or_default().name())?)
            }
            None => None,
        };
        Ok((key(target_path, "")?, draft))
    }

    /// Load the draft model (when `--draft` is given) on the target's device with `options`,
    /// refusing the target itself and a draft with another tokenizer.
    pub async fn load_draft(
        &self,
        ctx: Arc<GpuContext>,
        target_path: &Path,
        target: &GpuModel,
        target_tokenizer: &Tokenizer,
        options: ModelOptions,
    ) -> Result<Option<(GpuModel, Tokenizer)>> {
        let Some(name) = &self.draft else {
            if let Some(q) = self.draft_quant {
                bail!("--draft-quant {} needs --draft <DRAFT>: it requantizes the draft model, and there is none", q.name());
            }
            return Ok(None);
        };
        let path = lantern::fetch::resolve_model(Some(name.as_path()), true)?;
        let same = match (path.canonicalize(), target_path.canonicalize()) {
            (Ok(a), Ok(b)) => a == b,
            _ => path == target_path,
        };
        if same {
            bail!(
                "--draft {} is the target model itself: every draft would be accepted but each costs a full target step, so it can only be slower; pick a smaller model with the same tokenizer, or --lookup",
                path.display()
            );
        }
        let loaded = match self.draft_quant.unwrap_or_default().kind() {
            None => lantern::model::load::load_to_gpu(ctx, &path, options, &mut |_, _| {}).await,
            Some(kind) => {
                let q = QuantizeOptions { embeddings: EmbeddingPolicy::Same, ..QuantizeOptions::new(kind) };
                lantern::quant::quantize::load_to_gpu_requantized(ctx, &path, options, &q, &mut |_, _| {}).await
            }
        };
        let (model, tokenizer) = loaded.with_context(|| format!("loading the draft model {}", path.display()))?;
        let tokenizer = tokenizer.with_context(|| format!("the draft model {} has no tokenizer", path.display()))?;
        speculative::check_pair(
            (&target_path.display().to_string(), &target.config, target_tokenizer),
            (&path.display().to_string(), &model.config, &tokenizer),
        )?;
        Ok(Some((model, tokenizer)))
    }
}

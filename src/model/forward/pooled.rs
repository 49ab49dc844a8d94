//! Text embeddings from a decoder: the prompt runs through every layer (no LM head), each
//! position's final hidden state is normalised by the model's final RMS norm on the host, and
//! the positions are pooled (mean, or the last token) and scaled to unit length. What
//! `/v1/embeddings` and Ollama's `/api/embed` serve.

use crate::gpu::buffer::{read_f32, Readback};
use crate::{LanternError, Result};

use super::{gpu_err, GpuModel, LogitOps, Want};

/// How a prompt's positions become one vector.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Pooling {
    /// The mean of every position's normalised hidden state.
    #[default]
    Mean,
    /// The last position's (a causal model's only state that saw the whole text).
    Last,
}

impl Pooling {
    pub fn name(self) -> &'static str {
        match self {
            Pooling::Mean => "mean",
            Pooling::Last => "last",
        }
    }
}

/// `x` scaled to unit L2 length (left as it is when all zeros).
pub fn l2_normalized(mut x: Vec<f32>) -> Vec<f32> {
    let n = x.iter().map(|v| (*v as f64) * (*v as f64)).sum::<f64>().sqrt();
    if n > 0.0 {
        x.iter_mut().for_each(|v| *v = (*v as f64 / n) as f32);
    }
    x
}

impl GpuModel {
    /// The unit-length embedding of `tokens` (`hidden_size` floats) pooled by `pooling`, on a
    /// sequence of its own that is released afterwards (its pages are never cached). The
    /// prompt runs in steps of at most `max_batch_tokens`; a prompt longer than the context,
    /// or one the KV pool has no room for, is refused before any work.
    pub async fn embedding(&mut self, tokens: &[u32], pooling: Pooling) -> Result<Vec<f32>> {
        let context = self.kv.alloc.config.context;
        if tokens.is_empty() {
            return Err(LanternError::InvalidRequest("an embedding needs at least one token".into()));
        }
        if tokens.len() > context {
            return Err(LanternError::PromptTooLong { prompt_tokens: tokens.len(), max_new: 0, context });
        }
        self.check_ids(tokens)?;
        let seq = self.new_sequence()?;
        let r = self.embedding_on(seq, tokens, pooling).await;
        self.release_sequence(seq);
        r
    }

    async fn embedding_on(&mut self, seq: usize, tokens: &[u32], pooling: Pooling) -> Result<Vec<f32>> {
        let d = self.config.hidden_size;
        let eps = self.config.rms_norm_eps as f64;
        if self.final_norm_host.is_none() {
            self.final_norm_host = Some(read_f32(&self.ctx, &self.weights.final_norm, d).await.map_err(gpu_err)?);
        }
        let chunk = self.options.max_batch_tokens.max(1);
        if self.hidden_readback.is_none() {
            self.hidden_readback = Some(Readback::new(&self.ctx, "hidden readback", (chunk * d * 4) as u64));
        }
        let start = self.kv.alloc.append(seq, tokens.len()).map_err(LanternError::Kv)?;
        let mut sum = vec![0f64; d];
        let n_chunks = tokens.len().div_ceil(chunk);
        for (ci, part) in tokens.chunks(chunk).enumerate() {
            // No logit rows: the step is the embedding gather and the layers.
            let s = self.write_step_inputs(seq, part, start + ci * chunk, &[]);
            self.run_step(s, Want::Argmax, false, LogitOps::default()).await?;
            let first = match pooling {
                Pooling::Mean => 0,
                Pooling::Last if ci + 1 == n_chunks => part.len() - 1,
                Pooling::Last => continue,
            };
            let rows = part.len() - first;
            let bytes = (rows * d * 4) as u64;
            let rb = self.hidden_readback.as_ref().expect("made above");
            let mut enc = self.ctx.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("hidden readback") });
            rb.copy_from(&mut enc, &self.ws.hidden, (first * d * 4) as u64, bytes);
            self.ctx.submit([enc.finish()]);
            let data = rb.read(&self.ctx, bytes).await.map_err(gpu_err)?;
            let h: &[f32] = bytemuck::cast_slice(&data[..bytes as usize]);
            let w = self.final_norm_host.as_deref().expect("read above");
            for row in h.chunks_exact(d) {
                // The model's final RMS norm, as the LM head's prologue applies it.
                let ms = row.iter().map(|v| (*v as f64) * (*v as f64)).sum::<f64>() / d as f64;
                let inv = 1.0 / (ms + eps).sqrt();
                for ((acc, x), g) in sum.iter_mut().zip(row).zip(w) {
                    *acc += *x as f64 * inv * *g as f64;
                }
            }
        }
        let n = match pooling {
            Pooling::Mean => tokens.len(),
            Pooling::Last => 1,
        };
        let pooled: Vec<f32> = sum.iter().map(|v| (v / n as f64) as f32).collect();
        if pooled.iter().any(|v| !v.is_finite()) {
            return Err(LanternError::InvalidRequest("the embedding is not finite (the model overflowed on this text)".into()));
        }
        Ok(l2_normalized(pooled))
    }
}

//! KV arithmetic: bytes per token for each KV dtype (KV bytes = 2 x B x T x L x H_kv x d_h
//! x b) and the reserve held back from a memory budget. Plain numbers in, plain numbers out:
//! the model-level plan (parameters, workspace, what fits) is `model::plan`, which uses it.

/// Storage of cached K and V.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum KvDtype {
    #[default]
    F32,
    F16,
    /// int8 with one f32 scale per token and KV head (for each of K and V).
    Q8,
    /// 4-bit codes (-7..7, symmetric) with one f32 scale per token and KV head, like
    /// llama.cpp's `-ctk q4_0` but scaled per head rather than per 32 elements.
    Q4,
    /// 2-byte bfloat16 (for sizing checkpoints that cache in bf16).
    Bf16,
}

impl KvDtype {
    pub fn parse(s: &str) -> Option<KvDtype> {
        match s {
            "f32" => Some(KvDtype::F32),
            "f16" => Some(KvDtype::F16),
            "bf16" => Some(KvDtype::Bf16),
            "q8" => Some(KvDtype::Q8),
            "q4" => Some(KvDtype::Q4),
            _ => None,
        }
    }

    /// Bytes of one head's K (or V) of one token.
    pub fn head_bytes(&self, head_dim: usize) -> u64 {
        match self {
            KvDtype::F32 => (head_dim as u64).saturating_mul(4),
            KvDtype::F16 | KvDtype::Bf16 => (head_dim as u64).saturating_mul(2),
            KvDtype::Q8 => (head_dim as u64).saturating_add(4),
            KvDtype::Q4 => (head_dim as u64 / 2).saturating_add(4),
        }
    }
}

/// KV bytes of one token across all layers: 2 (K and V) x L x H_kv x (d_h x b). Saturates at
/// `u64::MAX` for sizes no memory holds (configs from corrupt files), rather than overflowing.
pub fn kv_bytes_per_token(layers: usize, kv_heads: usize, head_dim: usize, dtype: KvDtype) -> u64 {
    [layers as u64, kv_heads as u64, dtype.head_bytes(head_dim)].iter().fold(2u64, |a, &x| a.saturating_mul(x))
}

/// KV bytes of `batch` sequences of `tokens` tokens.
pub fn kv_bytes(layers: usize, kv_heads: usize, head_dim: usize, dtype: KvDtype, batch: usize, tokens: usize) -> u64 {
    kv_bytes_per_token(layers, kv_heads, head_dim, dtype).saturating_mul(batch as u64).saturating_mul(tokens as u64)
}

/// Memory held back from a budget for the driver, fragmentation and small allocations: 5%,
/// at least 64 MiB (never more than the budget).
pub fn reserve_bytes(budget: u64) -> u64 {
    (budget / 20).max(64 << 20).min(budget)
}

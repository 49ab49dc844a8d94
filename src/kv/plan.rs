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
    /// 4-bit codes with f16 scales and minimums as KIVI lays them out: V per group of 32
    /// elements of each token and head (5 bits an element), K per channel over each page
    /// (6 bits at 16-token pages), a sequence's open page kept in f16 until it fills.
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

    /// Bytes of one head's K (or V) of one token (q4: the mean of K's and V's at the
    /// default 16-token page; the open pages' f16 tail, two pages per sequence slot, is
    /// not counted).
    pub fn head_bytes(&self, head_dim: usize) -> u64 {
        let hd = head_dim as u64;
        match self {
            KvDtype::F32 => hd.saturating_mul(4),
            KvDtype::F16 | KvDtype::Bf16 => hd.saturating_mul(2),
            KvDtype::Q8 => hd.saturating_add(4),
            KvDtype::Q4 => {
                // K: codes and a 4-byte scale per channel per 16 tokens; V: codes and a
                // 4-byte scale per group.
                let k = hd / 2 + hd / 4;
                let v = hd / 2 + 4 * hd.div_ceil(v_group(head_dim) as u64);
                (k + v).div_ceil(2)
            }
        }
    }
}

/// The elements of a q4 V group sharing a scale: 32, or 16 or 8 for heads that are not a
/// multiple of 32 (the GPU's `vg` in `shaders/common/kv.wgsl`).
pub fn v_group(head_dim: usize) -> usize {
    if head_dim.is_multiple_of(32) {
        32
    } else if head_dim.is_multiple_of(16) {
        16
    } else {
        8
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

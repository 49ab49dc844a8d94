//! The shader registry: every WGSL file embedded with `include_str!`, a typed key per kernel
//! variant, and the expansion of a key into WGSL source (preprocessed, with the variant's
//! sizes as `const` declarations).

use crate::quant::QuantKind;
use std::collections::BTreeSet;

use super::preprocess::{preprocess, PreprocessError};

/// Every shader file, by path relative to `shaders/`.
pub const SOURCES: &[(&str, &str)] = &[
    ("common/step.wgsl", include_str!("../../shaders/common/step.wgsl")),
    ("common/weights.wgsl", include_str!("../../shaders/common/weights.wgsl")),
    ("common/weights/dense_f32.wgsl", include_str!("../../shaders/common/weights/dense_f32.wgsl")),
    ("common/weights/dense_f16.wgsl", include_str!("../../shaders/common/weights/dense_f16.wgsl")),
    ("common/weights/codes.wgsl", include_str!("../../shaders/common/weights/codes.wgsl")),
    ("common/weights/scales.wgsl", include_str!("../../shaders/common/weights/scales.wgsl")),
    ("common/weights/words_buffer.wgsl", include_str!("../../shaders/common/weights/words_buffer.wgsl")),
    ("common/weights/words_texture.wgsl", include_str!("../../shaders/common/weights/words_texture.wgsl")),
    ("common/weights/packed.wgsl", include_str!("../../shaders/common/weights/packed.wgsl")),
    ("common/linear.wgsl", include_str!("../../shaders/common/linear.wgsl")),
    ("common/matvec_end.wgsl", include_str!("../../shaders/common/matvec_end.wgsl")),
    ("common/blocked_acc.wgsl", include_str!("../../shaders/common/blocked_acc.wgsl")),
    ("common/blocked_q.wgsl", include_str!("../../shaders/common/blocked_q.wgsl")),
    ("common/blocked_q_tex.wgsl", include_str!("../../shaders/common/blocked_q_tex.wgsl")),
    ("common/kv.wgsl", include_str!("../../shaders/common/kv.wgsl")),
    ("common/rank.wgsl", include_str!("../../shaders/common/rank.wgsl")),
    ("common/topk_row.wgsl", include_str!("../../shaders/common/topk_row.wgsl")),
    ("common/masked.wgsl", include_str!("../../shaders/common/masked.wgsl")),
    ("common/hi_words4.wgsl", include_str!("../../shaders/common/hi_words4.wgsl")),
    ("common/gather.wgsl", include_str!("../../shaders/common/gather.wgsl")),
    ("embedding.wgsl", include_str!("../../shaders/embedding.wgsl")),
    ("rmsnorm.wgsl", include_str!("../../shaders/rmsnorm.wgsl")),
    ("matvec.wgsl", include_str!("../../shaders/matvec.wgsl")),
    ("matvec_rows4.wgsl", include_str!("../../shaders/matvec_rows4.wgsl")),
    ("matvec_wg.wgsl", include_str!("../../shaders/matvec_wg.wgsl")),
    ("matmul.wgsl", include_str!("../../shaders/matmul.wgsl")),
    ("matmul_blocked.wgsl", include_str!("../../shaders/matmul_blocked.wgsl")),
    ("matvec_q_rows4.wgsl", include_str!("../../shaders/matvec_q_rows4.wgsl")),
    ("matvec_q_tiled.wgsl", include_str!("../../shaders/matvec_q_tiled.wgsl")),
    ("matvec_q_multi.wgsl", include_str!("../../shaders/matvec_q_multi.wgsl")),
    ("matvec_q_wg.wgsl", include_str!("../../shaders/matvec_q_wg.wgsl")),
    ("matvec_q_masked.wgsl", include_str!("../../shaders/matvec_q_masked.wgsl")),
    ("matmul_blocked_q.wgsl", include_str!("../../shaders/matmul_blocked_q.wgsl")),
    ("matmul_blocked_q_xbcast.wgsl", include_str!("../../shaders/matmul_blocked_q_xbcast.wgsl")),
    ("matmul_blocked_q_xtex.wgsl", include_str!("../../shaders/matmul_blocked_q_xtex.wgsl")),
    ("rope_kv.wgsl", include_str!("../../shaders/rope_kv.wgsl")),
    ("kv_seal.wgsl", include_str!("../../shaders/kv_seal.wgsl")),
    ("attention.wgsl", include_str!("../../shaders/attention.wgsl")),
    ("attention_xbcast.wgsl", include_str!("../../shaders/attention_xbcast.wgsl")),
    ("common/attention.wgsl", include_str!("../../shaders/common/attention.wgsl")),
    ("attention_reduce.wgsl", include_str!("../../shaders/attention_reduce.wgsl")),
    ("argmax.wgsl", include_str!("../../shaders/argmax.wgsl")),
    ("topk.wgsl", include_str!("../../shaders/topk.wgsl")),
    ("sample.wgsl", include_str!("../../shaders/sample.wgsl")),
    ("logit_mask.wgsl", include_str!("../../shaders/logit_mask.wgsl")),
    ("logit_bias.wgsl", include_str!("../../shaders/logit_bias.wgsl")),
    ("x_texture.wgsl", include_str!("../../shaders/x_texture.wgsl")),
    ("moe_route.wgsl", include_str!("../../shaders/moe_route.wgsl")),
    ("moe_matvec.wgsl", include_str!("../../shaders/moe_matvec.wgsl")),
    ("moe_matvec_multi.wgsl", include_str!("../../shaders/moe_matvec_multi.wgsl")),
    ("moe_group.wgsl", include_str!("../../shaders/moe_group.wgsl")),
    ("moe_grouped.wgsl", include_str!("../../shaders/moe_grouped.wgsl")),
    ("moe_combine.wgsl", include_str!("../../shaders/moe_combine.wgsl")),
    ("common/moe.wgsl", include_str!("../../shaders/common/moe.wgsl")),
    ("common/unit16.wgsl", include_str!("../../shaders/common/unit16.wgsl")),
];

/// FNV-1a (64 bits) of every embedded shader file: changes whenever a kernel's source does,
/// so what was measured or cached against the old kernels can tell it is stale.
pub fn sources_fingerprint() -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for (path, text) in SOURCES {
        for b in path.bytes().chain(text.bytes()) {
            h = (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

/// Look up an embedded shader file.
pub fn source(path: &str) -> Option<&'static str> {
    SOURCES.iter().find(|(p, _)| *p == path).map(|(_, s)| *s)
}

/// One op per shader file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ShaderOp {
    /// Gather embedding rows for token ids.
    Embedding,
    /// Standalone RMSNorm (the forward pass folds it into the following matvec/matmul).
    RmsNorm,
    /// Decode matvec `y = W x` with optional fused RMSNorm, bias, SiLU gate and residual add.
    Matvec,
    /// Prefill tiled matmul `Y = X W^T` with the same fused prologue/epilogues.
    Matmul,
    /// Prefill matmul for CPU adapters: register blocks of tokens x rows per invocation read
    /// straight from global memory (no workgroup memory, no barriers); same semantics.
    MatmulBlocked,
    /// Decode matvec over packed integer weights (every packed format), dequantized in
    /// registers: one file per layout ([`PipelineKey::file`]).
    MatvecQ,
    /// The packed decode matvec for CPU adapters whose weights stay in storage buffers
    /// (SwiftShader): four rows per invocation, codes decoded in place
    /// (`common/masked.wgsl`), group scales applied once.
    MatvecQMasked,
    /// `MatmulBlocked` over packed integer weights (CPU adapters' prefill).
    MatmulBlockedQ,
    /// RoPE on q and k, and the write of k and v into the paged KV cache.
    RopeKv,
    /// A q4 KV cache's K: the pages a step fills rounded per channel, and the open pages'
    /// keys kept in f16 (after [`ShaderOp::RopeKv`]).
    KvSeal,
    /// Causal grouped-query attention over the paged KV cache (split over KV shards and key
    /// ranges when asked).
    Attention,
    /// Flash-decoding's reduce: combines attention's partial results per (token, head).
    AttentionReduce,
    /// Greedy sampling: argmax over logits rows, 4 bytes read back per row.
    Argmax,
    /// Sampling support: the best K (id, logit) pairs of logits rows.
    TopK,
    /// A token drawn on the GPU from each row's top-k pairs (temperature, top-k, top-p).
    Sample,
    /// Constrained decoding: disallowed tokens' logits set to -inf from a bitmask per row.
    LogitMask,
    /// OpenAI's logit_bias and penalties: sparse (token, delta) pairs added to each row.
    LogitBias,
    /// A step's linear-layer input rows copied into an rgba32float texture, which the CPU
    /// adapters' blocked matmul reads (`flags::XTEX`) with texel fetches.
    XTexture,
    /// A mixture of experts' router: each token's top-k experts and their weights, from its
    /// router logits, kept on the GPU for [`ShaderOp::MoeMatvec`].
    MoeRoute,
    /// The expert matvecs of a mixture of experts (gate|up with GATED, else down and the
    /// weighted sum over the chosen experts), reading only the routed experts' rows of the
    /// stacked expert weights.
    MoeMatvec,
    /// A step's token-expert pairs grouped by expert, with the work list of
    /// [`ShaderOp::MoeGrouped`] (prefill).
    MoeGroup,
    /// The expert matvecs over grouped pairs: each expert's weight rows read once for several
    /// of its pairs (gate|up with GATED, else down into weighted pair rows).
    MoeGrouped,
    /// The sum of each token's weighted pair rows (after [`ShaderOp::MoeGrouped`]'s down),
    /// added into the residual stream with RESIDUAL.
    MoeCombine,
}

impl ShaderOp {
    /// The shader file of this op (of its default layout: [`PipelineKey::file`] picks the
    /// layout's file where an op has several).
    pub fn file(&self) -> &'static str {
        match self {
            ShaderOp::Embedding => "embedding.wgsl",
            ShaderOp::RmsNorm => "rmsnorm.wgsl",
            ShaderOp::Matvec => "matvec.wgsl",
            ShaderOp::Matmul => "matmul.wgsl",
            ShaderOp::MatmulBlocked => "matmul_blocked.wgsl",
            ShaderOp::MatvecQ => "matvec_q_rows4.wgsl",
            ShaderOp::MatvecQMasked => "matvec_q_masked.wgsl",
            ShaderOp::MatmulBlockedQ => "matmul_blocked_q.wgsl",
            ShaderOp::RopeKv => "rope_kv.wgsl",
            ShaderOp::KvSeal => "kv_seal.wgsl",
            ShaderOp::Attention => "attention.wgsl",
            ShaderOp::AttentionReduce => "attention_reduce.wgsl",
            ShaderOp::Argmax => "argmax.wgsl",
            ShaderOp::TopK => "topk.wgsl",
            ShaderOp::Sample => "sample.wgsl",
            ShaderOp::LogitMask => "logit_mask.wgsl",
            ShaderOp::LogitBias => "logit_bias.wgsl",
            ShaderOp::XTexture => "x_texture.wgsl",
            ShaderOp::MoeRoute => "moe_route.wgsl",
            ShaderOp::MoeMatvec => "moe_matvec.wgsl",
            ShaderOp::MoeGroup => "moe_group.wgsl",
            ShaderOp::MoeGrouped => "moe_grouped.wgsl",
            ShaderOp::MoeCombine => "moe_combine.wgsl",
        }
    }

    /// The op's name in labels.
    fn name(&self) -> &'static str {
        match self {
            ShaderOp::MatvecQ => "matvec_q",
            op => op.file().trim_end_matches(".wgsl"),
        }
    }

    /// Ops whose `weights` field names the KV cache's dtype (F32, F16 or Q8).
    pub fn reads_kv(&self) -> bool {
        matches!(self, ShaderOp::RopeKv | ShaderOp::KvSeal | ShaderOp::Attention)
    }
}

/// Optional device features a variant uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
pub struct Features {
    pub f16: bool,
    pub subgroups: bool,
}

/// Storage dtype of a weight operand as the kernels read it: f32, f16, or one of the packed
/// formats, which [`QuantKind`] lists once (its module, `quant`, sits below this one and holds
/// their bit layouts and CPU oracle).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum WeightFormat {
    /// One f32 per element.
    F32,
    /// Two f16 packed in each u32, unpacked with `unpack2x16float` (needs no shader-f16).
    F16,
    /// Packed integer codes with group scales (`crate::quant`'s layout).
    Packed(QuantKind),
}

impl WeightFormat {
    /// Packed integer codes with group scales beside them.
    pub fn is_packed(&self) -> bool {
        matches!(self, WeightFormat::Packed(_))
    }

    /// Every packed format, in the order of [`QuantKind::ALL`].
    pub fn packed() -> impl Iterator<Item = WeightFormat> {
        QuantKind::ALL.into_iter().map(WeightFormat::Packed)
    }

    /// The packed kind, for packed formats.
    pub fn kind(&self) -> Option<QuantKind> {
        match self {
            WeightFormat::Packed(k) => Some(*k),
            _ => None,
        }
    }

    /// Short name (labels, reports, `BENCH_FORMATS`): `f32`, `f16`, or the kind's name
    /// (`q4s` and `q5s` for the symmetric 4- and 5-bit kinds).
    pub fn name(&self) -> &'static str {
        match self {
            WeightFormat::F32 => "f32",
            WeightFormat::F16 => "f16",
            WeightFormat::Packed(QuantKind::Q4Sym) => "q4s",
            WeightFormat::Packed(QuantKind::Q5Sym) => "q5s",
            WeightFormat::Packed(k) => k.name(),
        }
    }

    /// The define of this format as a KV-cache dtype (Q4Sym stands for the 4-bit cache).
    fn kv_define(&self) -> Option<&'static str> {
        match self {
            WeightFormat::F32 => Some("KV_F32"),
            WeightFormat::F16 => Some("KV_F16"),
            WeightFormat::Packed(QuantKind::Q8) => Some("KV_Q8"),
            WeightFormat::Packed(QuantKind::Q4Sym) => Some("KV_Q4"),
            _ => None,
        }
    }

    /// Preprocessor defines of this format.
    fn defines(&self) -> &'static [&'static str] {
        use QuantKind as K;
        let WeightFormat::Packed(kind) = self else {
            return if *self == WeightFormat::F32 { &["W_F32"] } else { &["W_F16"] };
        };
        match kind {
            K::Q8 => &["W_PACKED", "W_Q8"],
            // W_DM: one (d, m) word of two f16 per group (the formats with a minimum).
            K::Q4 => &["W_PACKED", "W_Q4", "W_DM"],
            K::Q4Sym => &["W_PACKED", "W_Q4S"],
            // Every other format: its own define, plus the plane and scale shape the shared
            // code paths key on (W_HI: a high plane, W_HI1 / W_HI2: of 1 or 2 bits; W_LO2:
            // a 2-bit low plane; W_SUPER: 256-element super-blocks; W_TABLE: codes through a
            // 16-entry table, IQ4's or MXFP4's).
            K::Q5Sym => &["W_PACKED", "W_Q5S", "W_HI", "W_HI1"],
            K::Q5 => &["W_PACKED", "W_Q5", "W_HI", "W_HI1", "W_DM"],
            // Lantern's 3-bit: Q3_K's planes with Q4_1's (d, m) per group of any size.
            K::Q3 => &["W_PACKED", "W_Q3", "W_LO2", "W_HI", "W_HI1", "W_DM"],
            // 2:4 sparse (W_S24): Q3's planes holding Q4Sym's kept codes, or Q5's holding
            // Q8's kept bytes (W_S24Q8), with each kept value's position in the high plane.
            K::S24Q4 => &["W_PACKED", "W_S24", "W_Q4S", "W_LO2", "W_HI", "W_HI1"],
            K::S24Q8 => &["W_PACKED", "W_S24", "W_S24Q8", "W_HI", "W_HI1"],
            K::Iq4Nl => &["W_PACKED", "W_IQ4NL", "W_TABLE"],
            K::Q2K => &["W_PACKED", "W_Q2K", "W_LO2", "W_SUPER"],
            K::Q3K => &["W_PACKED", "W_Q3K", "W_LO2", "W_HI", "W_HI1", "W_SUPER"],
            K::Q4K => &["W_PACKED", "W_Q4K", "W_SUPER"],
            K::Q5K => &["W_PACKED", "W_Q5K", "W_HI", "W_HI1", "W_SUPER"],
            K::Q6K => &["W_PACKED", "W_Q6K", "W_HI", "W_HI2", "W_SUPER"],
            K::Iq4Xs => &["W_PACKED", "W_IQ4XS", "W_TABLE", "W_SUPER"],
            K::Mxfp4 => &["W_PACKED", "W_MXFP4", "W_TABLE"],
            // FP8 E4M3: Q8's bytes and scales, each byte decoded as a float (W_FP8).
            K::Fp8 => &["W_PACKED", "W_Q8", "W_FP8"],
        }
    }
}

/// Fused prologue/epilogue flags of the matvec and matmul kernels.
pub mod flags {
    /// Fold RMSNorm of the input rows (with weight `g`) into the product.
    pub const NORM: u32 = 1;
    /// Add a bias per output row.
    pub const BIAS: u32 = 2;
    /// Add the result into the output (residual stream) instead of overwriting.
    pub const RESIDUAL: u32 = 4;
    /// Two weights (gate, up): output `silu(gate x) * (up x)`.
    pub const GATED: u32 = 8;
    /// Input rows are gathered through a row index list (logits of selected positions).
    pub const GATHER: u32 = 16;
    /// Matvec layout: one workgroup per output row, threads striding K (coalesced; GPUs).
    /// Without it: one invocation per output row walking K contiguously (CPU adapters).
    pub const ROW_PER_WORKGROUP: u32 = 32;
    /// Matvec layout without ROW_PER_WORKGROUP: each invocation computes four adjacent rows,
    /// reusing every x load (CPU adapters, where each storage load is costly).
    pub const ROWS4: u32 = 64;
    /// Blocked matmul: 8 tokens per invocation (else 4).
    pub const BLOCK_M8: u32 = 128;
    /// Blocked matmul: 8 rows per invocation (else 4).
    pub const BLOCK_N8: u32 = 256;
    /// Packed kernels on CPU adapters whose workgroup is exactly one 8-wide subgroup: each
    /// lane loads one element of x and `subgroupBroadcast` hands it to the others, so x
    /// costs one load per 8 elements instead of one per element per lane (lavapipe runs
    /// every divergent load as a per-lane scalar loop). Needs SUBGROUPS.
    pub const XBCAST: u32 = 512;
    /// Packed weights held as tiled rgba32uint textures (CPU adapters with 8-lane
    /// subgroups: lavapipe fetches a 16-byte texel for a fraction of the cost of one divergent
    /// 4-byte storage load): the matvec computes a 32-row tile per workgroup from texel
    /// fetches; the blocked matmul and the embedding gather read words through them.
    pub const TEX: u32 = 1024;
    /// Packed matvec for a few tokens (batched decode, speculative verify): four tokens per
    /// invocation (TEX, XBCAST) or workgroup (MULTI_ROW) share every weight read and
    /// dequantization.
    pub const TOK4: u32 = 2048;
    /// GATED with GELU-tanh instead of SiLU: `gelu_tanh(gate x) * (up x)` (Gemma).
    pub const GELU: u32 = 4096;
    /// RMSNorm rows normalized in place (q/k heads inside the fused q|k|v rows).
    pub const IN_PLACE: u32 = 8192;
    /// Packed matvec on GPUs (llama.cpp's K-quant layout): `MR_ROWS` rows per workgroup
    /// share every x load; each invocation takes 16-element units (16 invocations per
    /// 256-element super-block, one scale group per unit) with x' held in registers for all
    /// the rows, and the group minimum factored out of the inner loop (d sum(c x) + m sum(x)).
    /// Reduced with subgroups when SUBGROUPS is set, else in workgroup memory.
    pub const MULTI_ROW: u32 = 16384;
    /// TEX matvec: x (and the norm weight) read from 64 KiB uniform windows, which CPU
    /// adapters gather in a few instructions (a divergent storage load is a per-lane loop);
    /// rows of x past the window fall back to storage loads.
    pub const XU: u32 = 32768;
    /// Blocked matmul over tiled weights (CPU adapters, with XBCAST): x read from an
    /// rgba32float texture copy of the step's rows (`ShaderOp::XTexture`), one texel per lane
    /// shared by subgroup broadcast, and the norm weight from its 64 KiB uniform window,
    /// instead of per-lane storage loads.
    pub const XTEX: u32 = 65536;
    /// Packed matvec for speculative verify steps of 5-8 tokens: eight tokens per invocation
    /// (TEX) or workgroup (MULTI_ROW), one pass over the weights. Its expansion also defines
    /// TOK4 (the kernels add tokens 4-7 to TOK4's code).
    pub const TOK8: u32 = 131072;
    /// Every flag with its define name, in a stable order.
    pub const ALL: &[(u32, &str)] = &[
        (NORM, "NORM"),
        (BIAS, "BIAS"),
        (RESIDUAL, "RESIDUAL"),
        (GATED, "GATED"),
        (GATHER, "GATHER"),
        (ROW_PER_WORKGROUP, "ROW_PER_WORKGROUP"),
        (ROWS4, "ROWS4"),
        (BLOCK_M8, "BLOCK_M8"),
        (BLOCK_N8, "BLOCK_N8"),
        (XBCAST, "XBCAST"),
        (TEX, "TEX"),
        (TOK4, "TOK4"),
        (GELU, "GELU"),
        (IN_PLACE, "IN_PLACE"),
        (MULTI_ROW, "MULTI_ROW"),
        (XU, "XU"),
        (XTEX, "XTEX"),
        (TOK8, "TOK8"),
    ];
}

/// The typed key of one pipeline variant: it yields the defines, the cache key and a label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PipelineKey {
    pub op: ShaderOp,
    /// `flags::*` bits.
    pub flags: u32,
    pub weights: WeightFormat,
    /// Invocations per workgroup (x).
    pub workgroup: u32,
    pub features: Features,
}

impl PipelineKey {
    /// A key with no flags, f32 weights, no optional features.
    pub fn new(op: ShaderOp, workgroup: u32) -> Self {
        PipelineKey { op, flags: 0, weights: WeightFormat::F32, workgroup, features: Features::default() }
    }

    pub fn with_flags(mut self, flags: u32) -> Self {
        self.flags = flags;
        self
    }

    pub fn with_features(mut self, features: Features) -> Self {
        self.features = features;
        self
    }

    pub fn with_weights(mut self, w: WeightFormat) -> Self {
        self.weights = w;
        self
    }

    /// The preprocessor flags of this variant.
    pub fn defines(&self) -> Option<BTreeSet<String>> {
        let mut d = BTreeSet::new();
        for (bit, name) in flags::ALL {
            if self.flags & bit != 0 {
                d.insert(name.to_string());
            }
        }
        if self.op.reads_kv() {
            // For the KV-cache ops the dtype field is the cache's storage.
            d.insert(self.weights.kv_define()?.to_string());
        } else {
            for name in self.weights.defines() {
                d.insert(name.to_string());
            }
        }
        let multi_moe = self.op == ShaderOp::MoeMatvec && self.flags & flags::MULTI_ROW != 0;
        if multi_moe
            || matches!(self.op, ShaderOp::MatvecQ | ShaderOp::MatmulBlockedQ | ShaderOp::MatvecQMasked) && self.flags & flags::XBCAST == 0
        {
            // These read activations (and norm weights) as vec4.
            d.insert("X_VEC4".into());
        }
        if self.flags & flags::TOK8 != 0 {
            d.insert("TOK4".into());
        }
        if self.features.f16 {
            d.insert("F16".into());
        }
        if self.features.subgroups {
            d.insert("SUBGROUPS".into());
        }
        Some(d)
    }

    /// A readable label, also used as the snapshot name.
    pub fn label(&self) -> String {
        let mut s = format!("{}_wg{}", self.op.name(), self.workgroup);
        for (bit, name) in flags::ALL {
            if self.flags & bit != 0 {
                s.push('_');
                s.push_str(&name.to_lowercase());
            }
        }
        if self.op.reads_kv() {
            // The cache's dtype: f32, f16, q8, q4 (the 4-bit cache stands as Q4Sym).
            s.push_str("_kv");
            s.push_str(if self.weights == WeightFormat::Packed(QuantKind::Q4Sym) { "q4" } else { self.weights.name() });
        } else {
            s.push_str("_w");
            s.push_str(self.weights.name());
        }
        if self.features.f16 {
            s.push_str("_f16");
        }
        if self.features.subgroups {
            s.push_str("_sg");
        }
        s
    }

    /// The shader file of this variant: the float matvec has one per layout flag
    /// (ROW_PER_WORKGROUP, ROWS4, else a row per invocation), the packed matvec one per
    /// layout flag (TEX, MULTI_ROW, ROW_PER_WORKGROUP; else ROWS4, with or without XBCAST), the packed blocked
    /// matmul one per way of reading x (XTEX, else XBCAST, else storage), attention one for
    /// GPUs and one for 8-lane subgroups (XBCAST).
    pub fn file(&self) -> &'static str {
        match self.op {
            ShaderOp::Attention if self.flags & flags::XBCAST != 0 => "attention_xbcast.wgsl",
            ShaderOp::MatmulBlockedQ if self.flags & flags::XTEX != 0 => "matmul_blocked_q_xtex.wgsl",
            ShaderOp::MatmulBlockedQ if self.flags & flags::XBCAST != 0 => "matmul_blocked_q_xbcast.wgsl",
            ShaderOp::Matvec if self.flags & flags::ROW_PER_WORKGROUP != 0 => "matvec_wg.wgsl",
            ShaderOp::Matvec if self.flags & flags::ROWS4 != 0 => "matvec_rows4.wgsl",
            ShaderOp::MatvecQ if self.flags & flags::TEX != 0 => "matvec_q_tiled.wgsl",
            ShaderOp::MatvecQ if self.flags & flags::MULTI_ROW != 0 => "matvec_q_multi.wgsl",
            ShaderOp::MoeMatvec if self.flags & flags::MULTI_ROW != 0 => "moe_matvec_multi.wgsl",
            ShaderOp::MatvecQ if self.flags & flags::ROW_PER_WORKGROUP != 0 => "matvec_q_wg.wgsl",
            op => op.file(),
        }
    }

    /// The expanded WGSL of this variant.
    pub fn expand(&self) -> Result<String, PreprocessError> {
        let file = self.file();
        let src =
            source(file).ok_or_else(|| PreprocessError::UnknownInclude { file: "<registry>".into(), line: 0, target: file.into() })?;
        let defines = self.defines().ok_or_else(|| PreprocessError::UnknownDirective {
            file: file.into(),
            line: 0,
            directive: format!("KV dtype {} (the cache stores f32, f16 or q8)", self.weights.name()),
        })?;
        let body = preprocess(file, src, &defines, &source)?;
        let mut out = String::new();
        if self.features.f16 {
            out.push_str("enable f16;\n");
        }
        out.push_str(&format!("// {} (generated by lantern from shaders/{})\n", self.label(), file));
        out.push_str(&format!("const WG: u32 = {}u;\n", self.workgroup));
        out.push_str(&body);
        Ok(out)
    }

    /// naga capabilities this variant needs.
    pub fn naga_capabilities(&self) -> naga::valid::Capabilities {
        let mut c = naga::valid::Capabilities::empty();
        if self.weights != WeightFormat::F32 {
            // unpack2x16float: core WebGPU, absent only on old GL (DownlevelFlags::SHADER_F16_IN_F32).
            c |= naga::valid::Capabilities::SHADER_FLOAT16_IN_FLOAT32;
        }
        if self.features.f16 {
            c |= naga::valid::Capabilities::SHADER_FLOAT16;
        }
        if self.features.subgroups {
            c |= naga::valid::Capabilities::SUBGROUP;
        }
        c
    }
}

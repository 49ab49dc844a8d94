//! The memory plan of a model from its config alone (no weights, no GPU), so a model can be
//! sized before it is downloaded: parameter counts, the workspace a load allocates, and how
//! many tokens of KV cache fit a budget after weights, workspace and a reserve (the KV
//! arithmetic itself is `kv::plan`).

use crate::kv::plan::{kv_bytes_per_token, KvDtype};
use crate::model::ModelConfig;

/// Parameters of a decoder model, from its config: embedding, per layer q/k/v/o (+ q/k/v
/// biases), the MLP (gate/up/down, or a mixture's router and every expert's gate/up/down),
/// the norms; final norm; an LM head unless tied.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct ParamCount {
    pub embedding: u64,
    /// Per layer (the mean where layers differ: a mixture with dense layers among its sparse
    /// ones).
    pub per_layer: u64,
    pub layers: u64,
    pub lm_head: u64,
    pub total: u64,
    /// What one token reads: `total` less the experts its router leaves out (`total` for a
    /// dense model).
    pub active: u64,
    /// 12 d^2: the textbook size of a transformer block (4 d^2 attention + 8 d^2 MLP with
    /// a 4d FFN), a sanity line next to `per_layer`.
    pub block_12d2: u64,
}

/// Saturating products and sums: a config read from a corrupt or hostile file may carry
/// sizes whose products overflow u64 (found by `fuzz/`'s `gguf` target); the plan then says
/// `u64::MAX` bytes, which fits nothing, instead of panicking or wrapping to a small number.
fn mul(xs: &[u64]) -> u64 {
    xs.iter().fold(1u64, |a, &x| a.saturating_mul(x))
}

fn sum(xs: &[u64]) -> u64 {
    xs.iter().fold(0u64, |a, &x| a.saturating_add(x))
}

/// Parameters of the model `c` describes (saturating at `u64::MAX` for absurd configs).
pub fn param_count(c: &ModelConfig) -> ParamCount {
    let d = c.hidden_size as u64;
    let hd = c.head_dim as u64;
    let q = mul(&[c.num_heads as u64, hd]);
    let kv = mul(&[c.num_kv_heads as u64, hd]);
    let f = c.intermediate_size as u64;
    let bias = if c.qkv_bias { sum(&[q, kv, kv]) } else { 0 };
    // Two norms per layer, four with sandwich norms, plus the q/k norms.
    let norms = if c.block.norms == crate::model::NormPlacement::Sandwich { mul(&[4, d]) } else { mul(&[2, d]) };
    // q/k norms per head (a head's width each), or over the whole projection (OLMoE).
    let qk_norm = match (c.block.qk_norm, c.block.qk_norm_whole) {
        (_, true) => sum(&[q, kv]),
        (true, false) => mul(&[2, hd]),
        (false, false) => 0,
    };
    let attention = sum(&[mul(&[d, q]), mul(&[2, d, kv]), mul(&[q, d]), bias, norms, qk_norm]);
    let mlp = |l: usize| match c.block.experts(l) {
        Some(m) => sum(&[mul(&[d, m.experts as u64]), mul(&[m.experts as u64, 3, d, m.expert_intermediate as u64])]),
        None => mul(&[3, d, f]),
    };
    let layers = sum(&(0..c.num_layers).map(|l| sum(&[attention, mlp(l)])).collect::<Vec<_>>());
    let per_layer = layers / c.num_layers.max(1) as u64;
    let embedding = mul(&[c.vocab_size as u64, d]);
    let lm_head = if c.tie_word_embeddings { 0 } else { embedding };
    let total = sum(&[embedding, layers, d, lm_head]);
    let active = total.saturating_sub(c.idle_expert_parameters());
    ParamCount { embedding, per_layer, layers, lm_head, total, active, block_12d2: mul(&[12, d, d]) }
}

/// Activation bytes of one forward step of `max_batch_tokens` tokens with `logit_rows` rows
/// of logits, as `GpuModel::load` allocates them (f32 hidden, q|k|v, attention output, MLP
/// activation, logits, step inputs, RoPE table of `context` positions, and for sandwich-norm
/// models the sublayer output and sliding layers' RoPE table, for mixtures of experts the
/// router's and experts' buffers; the block table's few bytes per sequence are left out).
pub fn workspace_bytes(c: &ModelConfig, max_batch_tokens: usize, logit_rows: usize, context: usize) -> u64 {
    let t = max_batch_tokens.max(1) as u64;
    let r = logit_rows.max(1).min(max_batch_tokens.max(1)) as u64;
    let d = c.hidden_size as u64;
    let hd = c.head_dim as u64;
    let (heads, kv_heads) = (c.num_heads as u64, c.num_kv_heads as u64);
    let qkv = mul(&[sum(&[heads, kv_heads, kv_heads]), hd]);
    let act = mul(&[t, sum(&[d, qkv, mul(&[heads, hd]), c.intermediate_size as u64]), 4]);
    // The logits rows, their constrained-decoding bitmasks and their logit-bias pairs.
    let logits = sum(&[
        mul(&[r, c.vocab_size as u64, 4]),
        mul(&[r, c.vocab_size.div_ceil(32) as u64, 4]),
        crate::kernels::logit_bias::initial_bytes(r as usize),
    ]);
    let inputs = sum(&[mul(&[t, 16]), mul(&[r, 4])]);
    let tables = if c.has_local_rope() { 2 } else { 1 };
    let rope = mul(&[tables, context as u64, hd, 4]);
    let branch = if c.block.norms == crate::model::NormPlacement::Sandwich { mul(&[t, d, 4]) } else { 0 };
    // Mixtures of experts: router logits, the route, each token-expert pair's activation,
    // and prefill's grouping and weighted pair rows.
    let moe = c.block.moe.as_ref().map_or(0, |m| {
        let pairs = mul(&[t, m.experts_per_token as u64]);
        let (groups, work) = crate::kernels::moe::group_bytes(t as usize, m.experts_per_token, m.experts);
        sum(&[
            mul(&[t, m.experts as u64, 4]),
            mul(&[pairs, crate::kernels::moe::ROUTE_BYTES as u64]),
            mul(&[pairs, m.expert_intermediate as u64, 4]),
            groups,
            work,
            mul(&[pairs, d, 4]),
        ])
    });
    sum(&[act, logits, inputs, rope, branch, moe])
}

/// Widths of the linear-layer inputs (hidden, attention output, MLP activation) that CPU
/// adapters with tiled weights copy into x textures for the prefill matmul
/// (`kernels::x_texture`): workspace on top of [`workspace_bytes`] there.
pub fn x_texture_widths(c: &ModelConfig) -> [usize; 3] {
    [c.hidden_size, c.num_heads * c.head_dim, c.intermediate_size]
}

/// What fits: inputs and results of [`plan`].
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Plan {
    pub kv_dtype: KvDtype,
    pub kv_bytes_per_token: u64,
    /// KV bytes of `batch` sequences of `context` tokens.
    pub kv_bytes_requested: u64,
    pub batch: usize,
    pub context: usize,
    pub weight_bytes: u64,
    pub workspace_bytes: u64,
    pub reserve_bytes: u64,
    pub budget_bytes: u64,
    /// Where the budget came from.
    pub budget_source: String,
    /// Bytes left for the KV cache (0 when weights + workspace + reserve exceed the budget).
    pub kv_budget_bytes: u64,
    pub page_size: usize,
    pub pages: u64,
    /// Longest single sequence the pages hold (capped by the model's context).
    pub max_context_one_sequence: u64,
    /// Sequences of `context` tokens that fit at once.
    pub max_sequences_at_context: u64,
    /// Whether `batch` sequences of `context` tokens fit.
    pub fits: bool,
    /// Models with sliding-window layers: what keeping only their windows' pages saves
    /// (for one-token steps; [`window_saving`] takes a step size).
    pub window: Option<WindowSaving>,
    /// When the sliding layers keep window rings ([`Plan::with_ring`]): their size. The
    /// pages (`pages`) then hold only the other layers.
    pub ring: Option<RingPlan>,
}

/// The sliding layers' window rings in a plan.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct RingPlan {
    pub ring: crate::kv::ring::WindowRing,
    pub sliding_layers: usize,
    /// KV bytes of one sequence's rings (every sliding layer's K and V).
    pub bytes_per_sequence: u64,
    /// KV bytes per token of the layers that keep the pool's pages.
    pub pool_bytes_per_token: u64,
}

/// What sliding-window layers save. A sliding layer never reads keys older than its window,
/// so a ring of pages per sequence ([`crate::kv::ring`]) holds `window + step - 1` tokens
/// (rounded up to whole pages, at most `context`) for it instead of `context`.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct WindowSaving {
    pub sliding_layers: usize,
    pub layers: usize,
    pub window: usize,
    /// KV bytes of one sequence of `context` tokens with every layer keeping every token.
    pub bytes_per_sequence: u64,
    /// The same with sliding layers keeping only their ring.
    pub bytes_per_sequence_windowed: u64,
    /// Whether the plan takes the saving (`KvWindow`: rings where smaller than the context).
    pub taken: bool,
}

/// [`WindowSaving`] for sequences of `context` tokens written in steps of up to `step` tokens
/// in pages of `page_size`.
pub fn window_saving(c: &ModelConfig, kv_dtype: KvDtype, context: usize, step: usize, page_size: usize) -> Option<WindowSaving> {
    let window = c.block.sliding_window?;
    let sliding = c.sliding_layers();
    if sliding == 0 {
        return None;
    }
    let per_layer_token = kv_bytes_per_token(1, c.num_kv_heads, c.head_dim, kv_dtype);
    let kept = crate::kv::ring::WindowRing::new(window, step, page_size).tokens().min(context) as u64;
    let full = mul(&[(c.num_layers - sliding) as u64, context as u64]);
    Some(WindowSaving {
        sliding_layers: sliding,
        layers: c.num_layers,
        window,
        bytes_per_sequence: mul(&[per_layer_token, c.num_layers as u64, context as u64]),
        bytes_per_sequence_windowed: mul(&[per_layer_token, sum(&[full, mul(&[sliding as u64, kept])])]),
        taken: false,
    })
}

impl Plan {
    /// This plan with the sliding layers keeping `ring` per sequence (what
    /// `KvWindow::ring` gives for the load's context, step size and page size): the rings
    /// of `batch` sequences come out of the KV budget first, and the pages that are left
    /// hold only the other layers. `None` leaves the plan as it is.
    pub fn with_ring(mut self, c: &ModelConfig, ring: Option<crate::kv::ring::WindowRing>, step: usize) -> Plan {
        let Some(r) = ring else { return self };
        let sliding = c.sliding_layers();
        let per_layer_token = kv_bytes_per_token(1, c.num_kv_heads, c.head_dim, self.kv_dtype);
        let ring_seq = r.bytes_per_sequence(sliding, c.num_kv_heads, c.head_dim, self.kv_dtype);
        let pool_token = mul(&[per_layer_token, (c.num_layers - sliding) as u64]);
        let per_seq = sum(&[ring_seq, mul(&[pool_token, self.context as u64])]);
        let room = self.kv_budget_bytes.saturating_sub(mul(&[ring_seq, self.batch as u64]));
        let pages_per_seq = self.context.max(1).div_ceil(self.page_size) as u64;
        self.pages = match mul(&[pool_token, self.page_size as u64]) {
            0 => mul(&[pages_per_seq, self.batch as u64]),
            page_bytes => room / page_bytes,
        };
        self.kv_bytes_requested = mul(&[per_seq, self.batch as u64]);
        self.max_context_one_sequence = if self.kv_budget_bytes >= ring_seq { mul(&[self.pages, self.page_size as u64]) } else { 0 }
            .min(c.max_position_embeddings as u64);
        self.max_sequences_at_context = self.kv_budget_bytes.checked_div(per_seq).unwrap_or(0);
        self.fits = self.max_sequences_at_context >= self.batch as u64;
        self.window = window_saving(c, self.kv_dtype, self.context, step, self.page_size).map(|w| WindowSaving { taken: true, ..w });
        self.ring = Some(RingPlan { ring: r, sliding_layers: sliding, bytes_per_sequence: ring_seq, pool_bytes_per_token: pool_token });
        self
    }

    /// KV bytes the plan allocates: its pages (of the layers that keep them) and any rings of
    /// `batch` sequences; without a budget, what `batch` sequences of `context` tokens take.
    pub fn kv_bytes(&self) -> u64 {
        if self.budget_bytes == 0 {
            return self.kv_bytes_requested;
        }
        match &self.ring {
            Some(r) => {
                sum(&[mul(&[self.pages, self.page_size as u64, r.pool_bytes_per_token]), mul(&[r.bytes_per_sequence, self.batch as u64])])
            }
            None => mul(&[self.pages, self.page_size as u64, self.kv_bytes_per_token]),
        }
    }
}

/// Size the KV cache for a budget.
#[allow(clippy::too_many_arguments)]
pub fn plan(
    c: &ModelConfig,
    weight_bytes: u64,
    kv_dtype: KvDtype,
    batch: usize,
    context: usize,
    page_size: usize,
    workspace_bytes: u64,
    reserve_bytes: u64,
    budget_bytes: u64,
    budget_source: String,
) -> Plan {
    let per_token = kv_bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, kv_dtype);
    let page_size = page_size.max(1);
    let used = sum(&[weight_bytes, workspace_bytes, reserve_bytes]);
    let kv_budget = budget_bytes.saturating_sub(used);
    let page_bytes = mul(&[per_token, page_size as u64]);
    let pages = kv_budget.checked_div(page_bytes).unwrap_or(0);
    let pages_per_seq = context.max(1).div_ceil(page_size) as u64;
    let max_seqs = pages / pages_per_seq;
    Plan {
        kv_dtype,
        kv_bytes_per_token: per_token,
        kv_bytes_requested: mul(&[per_token, batch as u64, context as u64]),
        batch,
        context,
        weight_bytes,
        workspace_bytes,
        reserve_bytes,
        budget_bytes,
        budget_source,
        kv_budget_bytes: kv_budget,
        page_size,
        pages,
        max_context_one_sequence: mul(&[pages, page_size as u64]).min(c.max_position_embeddings as u64),
        max_sequences_at_context: max_seqs,
        fits: max_seqs >= batch as u64,
        window: window_saving(c, kv_dtype, context, 1, page_size),
        ring: None,
    }
}

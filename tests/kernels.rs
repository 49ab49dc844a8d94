//! Every GPU kernel against the plain-loop CPU oracle (`lantern::reference::ops`) on seeded
//! random data and odd shapes: each fused linear variant in each matvec layout and the matmul
//! (f32 and f16 weights, offset outputs, weights split across bindings), embedding, rmsnorm,
//! argmax, RoPE with the paged KV-cache write, and paged grouped-query attention.

mod common;

use common::random::Rng;

use std::sync::{Arc, OnceLock};

use half::f16;
use lantern::gpu::buffer::{create_storage, create_storage_window, create_zeroed, read_buffer, read_f32};
use lantern::gpu::shader::{flags, Features, WeightFormat};
use lantern::gpu::{DeviceOptions, GpuContext, GpuError, PipelineKey, ShaderOp};
use lantern::kernels::argmax::RowDraw;
use lantern::kernels::attention::{AttentionIo, AttentionParams, KvBinding};
use lantern::kernels::linear::{self, GpuLinear, HostMatrix, LinearIo};
use lantern::kernels::rope_kv::{rope_table, RopeKvIo, RopeKvParams};
use lantern::kernels::{self, step_buffer, submit, submit_step, x_texture, StepUniform};
use lantern::kv::cache::{quantize_group, quantize_head, round_trip, seal_page, v_group, KvLayout};
use lantern::kv::plan::KvDtype;
use lantern::kv::ring::WindowRing;
use lantern::quant::{PackedMatrix, QuantFormat, QuantKind};
use lantern::reference::ops;
use pollster::block_on;

// ---------------------------------------------------------------------------------------------
// Tolerances. All are relative to the scale of the expected output: a value passes when
// |got - want| <= TOL * max(1, max |want|) (see `assert_close`).
// ---------------------------------------------------------------------------------------------

/// Matvec/matmul with fused prologue/epilogues: f32 sums of up to ~600 products (plus f32
/// RMSNorm and SiLU) against f64 sums.
const LINEAR_TOL: f32 = 1e-5;
/// Standalone RMSNorm: one f32 sum of squares per row.
const RMSNORM_TOL: f32 = 1e-5;
/// RoPE: one rotation; the table's cos/sin (f64, rounded) vs the oracle's f32 sin/cos.
const ROPE_TOL: f32 = 1e-5;
/// Attention: f32 online softmax over up to ~130 keys against an f64 two-pass softmax.
const ATTENTION_TOL: f32 = 1e-5;
/// Embedding and the KV-cache copy of v are gathers: bit exact.
const EXACT: f32 = 0.0;
/// Packed weights dequantized in half precision (F16 variants): q d and + m each round to f16
/// (up to 2^-10 of the group's largest value per weight), summed over up to 576 products and,
/// for GATED, multiplied by a second such product.
const F16_DEQUANT_TOL: f32 = 5e-3;

/// RMSNorm epsilon used throughout.
const EPS: f32 = 1e-5;
/// The binding limit that forces weight and table splitting (bytes).
const SMALL_BINDING: u64 = 4096;

// ---------------------------------------------------------------------------------------------
// Helpers: RNG, contexts, buffers, comparison.
// ---------------------------------------------------------------------------------------------

/// The shared default context (one device for the whole binary; pipelines are cached on it).
fn gpu() -> Arc<GpuContext> {
    static CTX: OnceLock<Arc<GpuContext>> = OnceLock::new();
    CTX.get_or_init(common::gpu).clone()
}

/// A context whose storage bindings are capped at `SMALL_BINDING` bytes, so tensors split.
fn gpu_small() -> Arc<GpuContext> {
    static CTX: OnceLock<Arc<GpuContext>> = OnceLock::new();
    CTX.get_or_init(|| common::gpu_with(&DeviceOptions { max_binding_size: Some(SMALL_BINDING), ..Default::default() })).clone()
}

fn buf_f32(ctx: &GpuContext, label: &str, v: &[f32]) -> wgpu::Buffer {
    create_storage(ctx, label, bytemuck::cast_slice(v)).unwrap_or_else(|e| panic!("{label}: {e}"))
}

fn buf_u32(ctx: &GpuContext, label: &str, v: &[u32]) -> wgpu::Buffer {
    create_storage(ctx, label, bytemuck::cast_slice(v)).unwrap_or_else(|e| panic!("{label}: {e}"))
}

fn read_f32s(ctx: &Arc<GpuContext>, b: &wgpu::Buffer, n: usize) -> Vec<f32> {
    block_on(read_f32(ctx, b, n)).expect("read back f32")
}

fn read_u32s(ctx: &Arc<GpuContext>, b: &wgpu::Buffer, n: usize) -> Vec<u32> {
    let bytes = block_on(read_buffer(ctx, b, (n * 4) as u64)).expect("read back u32");
    bytemuck::cast_slice(&bytes[..n * 4]).to_vec()
}

/// Values rounded to f16: (IEEE half bits, the same values back in f32).
fn round_f16(v: &[f32]) -> (Vec<u16>, Vec<f32>) {
    let h: Vec<f16> = v.iter().map(|&x| f16::from_f32(x)).collect();
    (h.iter().map(|x| x.to_bits()).collect(), h.iter().map(|x| x.to_f32()).collect())
}

/// Fail with the worst index, got and want unless every |got - want| <= tol * scale, where
/// scale = max(1, max |want|). NaN in `got` always fails.
fn assert_close(what: &str, got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let scale = want.iter().fold(1.0f32, |m, v| m.max(v.abs()));
    let (mut worst, mut wi) = (0.0f32, 0usize);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let d = (g - w).abs();
        let d = if d.is_nan() { f32::INFINITY } else { d };
        if d > worst {
            worst = d;
            wi = i;
        }
    }
    assert!(
        worst <= tol * scale,
        "{what}: worst |got - want| = {worst:e} at index {wi} (got {}, want {}), tolerance {tol:e} x scale {scale}",
        got[wi],
        want[wi]
    );
}

/// A random weight matrix in `format`: the f32 values the oracle uses (already rounded for
/// f16, dequantized for packed formats) and the half bits or packed codes the GPU gets.
struct HostWeight {
    values: Vec<f32>,
    half: Option<Vec<u16>>,
    packed: Option<PackedMatrix>,
}

fn quant_kind(format: WeightFormat) -> Option<QuantKind> {
    format.kind()
}

/// A number per format for seeds (f32 0, f16 1, the packed kinds from 2 in their order).
fn format_id(format: WeightFormat) -> u64 {
    format.kind().map_or(if format == WeightFormat::F32 { 0 } else { 1 }, |k| 2 + k as u64)
}

/// Random ggml blocks of `kind` for a `rows x k` matrix, repacked: any bits for the codes and
/// sub-block scales, and f16 scales and minimums of either sign up to 0.05 (so that values
/// stay of order one).
fn random_ggml(rng: &mut Rng, kind: QuantKind, rows: usize, k: usize) -> PackedMatrix {
    let (be, bb) = lantern::quant::ggml::block_size(kind);
    let mut data: Vec<u8> = (0..rows * k / be * bb).map(|_| rng.next_u64() as u8).collect();
    for b in data.chunks_exact_mut(bb) {
        for &at in lantern::quant::ggml::f16_fields(kind) {
            let v = half::f16::from_f32(0.05 * rng.uniform());
            b[at..at + 2].copy_from_slice(&v.to_le_bytes());
        }
        if kind == QuantKind::Mxfp4 {
            // The E8M0 exponent: 2^(e - 128) from 2^-10 to 2^-3, so values stay below 1.5.
            b[0] = 118 + (rng.next_u64() % 8) as u8;
        }
    }
    PackedMatrix::from_gguf_blocks("test", kind, &data, rows, k).expect("repack random blocks")
}

impl HostWeight {
    /// `group` is used by packed formats only.
    fn random(rng: &mut Rng, rows: usize, k: usize, format: WeightFormat, group: u32) -> HostWeight {
        let v = rng.vec(rows * k);
        match format {
            WeightFormat::F32 => HostWeight { values: v, half: None, packed: None },
            WeightFormat::F16 => {
                let (bits, values) = round_f16(&v);
                HostWeight { values, half: Some(bits), packed: None }
            }
            f => {
                let kind = quant_kind(f).unwrap();
                let p = if kind.is_rtn() {
                    PackedMatrix::quantize("test", &v, rows, k, QuantFormat::new(kind, group)).expect("quantize")
                } else {
                    random_ggml(rng, kind, rows, k)
                };
                HostWeight { values: p.dequantize(), half: None, packed: Some(p) }
            }
        }
    }

    fn matrix(&self) -> HostMatrix<'_> {
        match (&self.half, &self.packed) {
            (Some(b), _) => HostMatrix::F16(b),
            (_, Some(p)) => HostMatrix::Packed(p),
            _ => HostMatrix::F32(&self.values),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Linear: matvec in every layout and the matmul, with every fused combination the runtime uses.
// ---------------------------------------------------------------------------------------------

/// The fused combinations the forward pass builds.
const PLAIN: u32 = 0;
const NORM: u32 = flags::NORM;
const NORM_BIAS: u32 = flags::NORM | flags::BIAS;
const RESIDUAL: u32 = flags::RESIDUAL;
const NORM_GATED: u32 = flags::NORM | flags::GATED;
const NORM_GATHER: u32 = flags::NORM | flags::GATHER;
const COMBOS: [u32; 6] = [PLAIN, NORM, NORM_BIAS, RESIDUAL, NORM_GATED, NORM_GATHER];

/// (rows, K, tokens): odd sizes that straddle workgroup, tile and subgroup multiples. Every K
/// is even so f16 weights can use them too.
const LINEAR_SHAPES: [(usize, usize, usize); 5] = [(1, 2, 1), (7, 6, 3), (65, 58, 33), (333, 130, 3), (701, 578, 2)];
/// Odd K (the scalar tail of the row-per-invocation loop): f32 weights only.
const LINEAR_SHAPES_ODD_K: [(usize, usize, usize); 2] = [(9, 5, 3), (70, 131, 1)];

/// How the kernel is laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Layout {
    /// Matvec, one invocation per output row, 64 per workgroup (CPU adapters without subgroups).
    Thread64,
    /// Matvec, a 64-wide workgroup per row, shared-memory reduction.
    RowWg64,
    /// Matvec, a 64-wide workgroup per row, subgroup reduction (GPUs).
    RowWg64Subgroups,
    /// Matvec, an 8-wide workgroup per row, subgroup reduction (lavapipe: one subgroup).
    RowWg8Subgroups,
    /// Tiled matmul (prefill).
    Matmul,
    /// Blocked matmul (prefill on CPU adapters), 4 tokens x 4 rows per invocation.
    Blocked44,
    /// Blocked matmul, 8 tokens x 4 rows.
    Blocked84,
    /// Blocked matmul, 4 tokens x 8 rows.
    Blocked48,
    /// Blocked matmul, 8 tokens x 8 rows.
    Blocked88,
    /// Matvec, four rows per invocation, 8 per workgroup (CPU adapters).
    Rows4,
    /// Packed weights: Rows4 with x shared by subgroup broadcast (8-lane subgroups).
    Rows4Bcast,
    /// Rows4Bcast with four tokens per invocation from storage (batched decode on CPU
    /// adapters).
    Rows4BcastTok4,
    /// Packed weights held as tiled textures: a 32-row tile per 8-lane workgroup, x from
    /// storage (CPU adapters with 8-lane subgroups).
    Tiled,
    /// Tiled with four tokens per invocation (batched decode).
    TiledTok4,
    /// Tiled with x and the norm weight from 64 KiB uniform windows (the runtime's choice).
    TiledXu,
    /// TiledXu with four tokens per invocation.
    TiledXuTok4,
    /// Tiled with eight tokens per invocation (speculative verify steps of 5-8 tokens).
    TiledTok8,
    /// TiledXu with eight tokens per invocation.
    TiledXuTok8,
    /// Tiled weights in the blocked matmul (8 tokens x 8 rows, x by broadcast).
    Blocked88Tiled,
    /// Blocked88Tiled with x from a texture copy and the norm weight from its uniform window
    /// (the runtime's prefill on CPU adapters).
    Blocked88TiledXtex,
    /// Packed weights: blocked matmul 8 tokens x 8 rows with x shared by subgroup broadcast.
    Blocked88Bcast,
    /// Packed weights: blocked matmul 4 tokens x 4 rows with x shared by subgroup broadcast.
    Blocked44Bcast,
    /// Packed weights: a 64-wide workgroup per row, subgroups, dequantized in f16.
    RowWg64F16,
    /// Packed weights: tiled matmul with f16 weight tiles.
    MatmulF16,
    /// Packed weights, the GPU default: two rows per 64-wide workgroup sharing x, 16-element
    /// units, reduced in workgroup memory.
    MultiRow,
    /// MultiRow reduced with subgroups.
    MultiRowSubgroups,
    /// MultiRow with four tokens per workgroup (GPUs' batched steps), workgroup-memory
    /// reduction.
    MultiRowTok4,
    /// MultiRowTok4 reduced with subgroups.
    MultiRowTok4Subgroups,
    /// MultiRow with eight tokens per workgroup (GPUs' verify steps of 5-8 tokens).
    MultiRowTok8,
    /// MultiRowTok8 reduced with subgroups.
    MultiRowTok8Subgroups,
    /// Packed weights in storage buffers on CPU adapters without 8-lane subgroups
    /// (SwiftShader): four rows per invocation in 16-element units, codes decoded in place
    /// (`ShaderOp::MatvecQMasked`).
    Masked,
    /// Whatever `linear::build` picks for a matvec on this adapter.
    Auto,
    /// Whatever `linear::build` picks for a matmul (prefill) on this adapter.
    AutoMatmul,
}

impl Layout {
    const ALL: [Layout; 9] = [
        Layout::Thread64,
        Layout::RowWg64,
        Layout::RowWg64Subgroups,
        Layout::RowWg8Subgroups,
        Layout::Matmul,
        Layout::Blocked44,
        Layout::Blocked84,
        Layout::Blocked48,
        Layout::Blocked88,
    ];

    /// The layouts of the packed-weight kernels.
    const PACKED: [Layout; 28] = [
        Layout::Masked,
        Layout::MultiRow,
        Layout::MultiRowSubgroups,
        Layout::MultiRowTok4,
        Layout::MultiRowTok4Subgroups,
        Layout::MultiRowTok8Subgroups,
        Layout::TiledXuTok8,
        Layout::Rows4,
        Layout::Rows4Bcast,
        Layout::Rows4BcastTok4,
        Layout::Tiled,
        Layout::TiledTok4,
        Layout::TiledXu,
        Layout::TiledXuTok4,
        Layout::Blocked88Tiled,
        Layout::Blocked88TiledXtex,
        Layout::Blocked88Bcast,
        Layout::Blocked44Bcast,
        Layout::RowWg64,
        Layout::RowWg64Subgroups,
        Layout::RowWg8Subgroups,
        Layout::RowWg64F16,
        Layout::Matmul,
        Layout::MatmulF16,
        Layout::Blocked44,
        Layout::Blocked84,
        Layout::Blocked48,
        Layout::Blocked88,
    ];

    /// A prefill (matmul) layout: no gathered rows.
    fn is_matmul(self) -> bool {
        matches!(
            self,
            Layout::Matmul
                | Layout::MatmulF16
                | Layout::Blocked44
                | Layout::Blocked84
                | Layout::Blocked48
                | Layout::Blocked88
                | Layout::Blocked88Bcast
                | Layout::Blocked44Bcast
                | Layout::Blocked88Tiled
                | Layout::Blocked88TiledXtex
        )
    }

    /// Layouts reading tiled texture-held weights.
    fn is_tiled(self) -> bool {
        matches!(
            self,
            Layout::Tiled
                | Layout::TiledTok4
                | Layout::TiledTok8
                | Layout::TiledXu
                | Layout::TiledXuTok4
                | Layout::TiledXuTok8
                | Layout::Blocked88Tiled
                | Layout::Blocked88TiledXtex
        )
    }

    /// Layouts reading x and the norm weight through uniform windows.
    fn is_xu(self) -> bool {
        matches!(self, Layout::TiledXu | Layout::TiledXuTok4 | Layout::TiledXuTok8)
    }

    fn needs_subgroups(self) -> bool {
        matches!(
            self,
            Layout::RowWg64Subgroups
                | Layout::RowWg8Subgroups
                | Layout::RowWg64F16
                | Layout::MultiRowSubgroups
                | Layout::MultiRowTok4Subgroups
                | Layout::MultiRowTok8Subgroups
        )
    }

    fn needs_f16(self) -> bool {
        matches!(self, Layout::RowWg64F16 | Layout::MatmulF16)
    }

    /// The explicit variant; `None` for `Auto`.
    fn key(self, fl: u32, weights: WeightFormat) -> Option<PipelineKey> {
        let sg = Features { f16: false, subgroups: true };
        let rpw = flags::ROW_PER_WORKGROUP;
        if weights.is_packed() {
            let mv = ShaderOp::MatvecQ;
            let bq = ShaderOp::MatmulBlockedQ;
            let f16 = Features { f16: true, subgroups: false };
            let key = match self {
                Layout::Rows4 => PipelineKey::new(mv, 8).with_flags(fl | flags::ROWS4),
                Layout::Rows4Bcast => PipelineKey::new(mv, 8).with_flags(fl | flags::ROWS4 | flags::XBCAST).with_features(sg),
                Layout::Rows4BcastTok4 => {
                    PipelineKey::new(mv, 8).with_flags(fl | flags::ROWS4 | flags::XBCAST | flags::TOK4).with_features(sg)
                }
                Layout::Tiled => PipelineKey::new(mv, 8).with_flags(fl | flags::TEX).with_features(sg),
                Layout::TiledTok4 => PipelineKey::new(mv, 8).with_flags(fl | flags::TEX | flags::TOK4).with_features(sg),
                Layout::TiledXu => PipelineKey::new(mv, 8).with_flags(fl | flags::TEX | flags::XU).with_features(sg),
                Layout::TiledXuTok4 => PipelineKey::new(mv, 8).with_flags(fl | flags::TEX | flags::XU | flags::TOK4).with_features(sg),
                Layout::TiledTok8 => PipelineKey::new(mv, 8).with_flags(fl | flags::TEX | flags::TOK8).with_features(sg),
                Layout::TiledXuTok8 => PipelineKey::new(mv, 8).with_flags(fl | flags::TEX | flags::XU | flags::TOK8).with_features(sg),
                Layout::Blocked88Tiled => PipelineKey::new(bq, 8)
                    .with_flags(fl | flags::BLOCK_M8 | flags::BLOCK_N8 | flags::XBCAST | flags::TEX)
                    .with_features(sg),
                Layout::Blocked88TiledXtex => PipelineKey::new(bq, 8)
                    .with_flags(fl | flags::BLOCK_M8 | flags::BLOCK_N8 | flags::XBCAST | flags::TEX | flags::XTEX)
                    .with_features(sg),
                Layout::Blocked88Bcast => {
                    PipelineKey::new(bq, 8).with_flags(fl | flags::BLOCK_M8 | flags::BLOCK_N8 | flags::XBCAST).with_features(sg)
                }
                Layout::Blocked44Bcast => PipelineKey::new(bq, 8).with_flags(fl | flags::XBCAST).with_features(sg),
                Layout::RowWg64 => PipelineKey::new(mv, 64).with_flags(fl | rpw),
                Layout::RowWg64Subgroups => PipelineKey::new(mv, 64).with_flags(fl | rpw).with_features(sg),
                Layout::RowWg8Subgroups => PipelineKey::new(mv, 8).with_flags(fl | rpw).with_features(sg),
                Layout::RowWg64F16 => PipelineKey::new(mv, 64).with_flags(fl | rpw).with_features(Features { f16: true, subgroups: true }),
                Layout::MultiRow => PipelineKey::new(mv, 64).with_flags(fl | flags::MULTI_ROW),
                Layout::MultiRowSubgroups => PipelineKey::new(mv, 64).with_flags(fl | flags::MULTI_ROW).with_features(sg),
                Layout::MultiRowTok4 => PipelineKey::new(mv, 64).with_flags(fl | flags::MULTI_ROW | flags::TOK4),
                Layout::MultiRowTok4Subgroups => PipelineKey::new(mv, 64).with_flags(fl | flags::MULTI_ROW | flags::TOK4).with_features(sg),
                Layout::MultiRowTok8 => PipelineKey::new(mv, 64).with_flags(fl | flags::MULTI_ROW | flags::TOK8),
                Layout::MultiRowTok8Subgroups => PipelineKey::new(mv, 64).with_flags(fl | flags::MULTI_ROW | flags::TOK8).with_features(sg),
                Layout::Matmul => PipelineKey::new(ShaderOp::Matmul, 64).with_flags(fl),
                Layout::MatmulF16 => PipelineKey::new(ShaderOp::Matmul, 64).with_flags(fl).with_features(f16),
                Layout::Blocked44 => PipelineKey::new(bq, 8).with_flags(fl),
                Layout::Blocked84 => PipelineKey::new(bq, 8).with_flags(fl | flags::BLOCK_M8),
                Layout::Blocked48 => PipelineKey::new(bq, 8).with_flags(fl | flags::BLOCK_N8),
                Layout::Blocked88 => PipelineKey::new(bq, 8).with_flags(fl | flags::BLOCK_M8 | flags::BLOCK_N8),
                Layout::Masked => PipelineKey::new(ShaderOp::MatvecQMasked, linear::MASKED_WG).with_flags(fl),
                Layout::Auto | Layout::AutoMatmul => return None,
                Layout::Thread64 => panic!("no row-per-invocation layout for packed weights"),
            };
            return Some(key.with_weights(weights));
        }
        let key = match self {
            Layout::Thread64 => PipelineKey::new(ShaderOp::Matvec, 64).with_flags(fl),
            Layout::RowWg64 => PipelineKey::new(ShaderOp::Matvec, 64).with_flags(fl | rpw),
            Layout::RowWg64Subgroups => PipelineKey::new(ShaderOp::Matvec, 64).with_flags(fl | rpw).with_features(sg),
            Layout::RowWg8Subgroups => PipelineKey::new(ShaderOp::Matvec, 8).with_flags(fl | rpw).with_features(sg),
            Layout::Matmul => PipelineKey::new(ShaderOp::Matmul, 64).with_flags(fl),
            Layout::Blocked44 => PipelineKey::new(ShaderOp::MatmulBlocked, 8).with_flags(fl),
            Layout::Blocked84 => PipelineKey::new(ShaderOp::MatmulBlocked, 8).with_flags(fl | flags::BLOCK_M8),
            Layout::Blocked48 => PipelineKey::new(ShaderOp::MatmulBlocked, 8).with_flags(fl | flags::BLOCK_N8),
            Layout::Blocked88 => PipelineKey::new(ShaderOp::MatmulBlocked, 8).with_flags(fl | flags::BLOCK_M8 | flags::BLOCK_N8),
            Layout::Rows4 => PipelineKey::new(ShaderOp::Matvec, 8).with_flags(fl | flags::ROWS4),
            Layout::RowWg64F16
            | Layout::MatmulF16
            | Layout::MultiRow
            | Layout::MultiRowSubgroups
            | Layout::MultiRowTok4
            | Layout::MultiRowTok4Subgroups
            | Layout::MultiRowTok8
            | Layout::MultiRowTok8Subgroups
            | Layout::Rows4Bcast
            | Layout::Rows4BcastTok4
            | Layout::Tiled
            | Layout::TiledTok4
            | Layout::TiledXu
            | Layout::TiledXuTok4
            | Layout::TiledTok8
            | Layout::TiledXuTok8
            | Layout::Blocked88Tiled
            | Layout::Blocked88TiledXtex
            | Layout::Blocked88Bcast
            | Layout::Blocked44Bcast
            | Layout::Masked => {
                panic!("{self:?} is a packed-weight layout")
            }
            Layout::Auto | Layout::AutoMatmul => return None,
        };
        Some(key.with_weights(weights))
    }

    /// The layouts this device can run: subgroup ones need the subgroup feature, and the
    /// 8-wide one subgroups of at most 8 (the kernel needs whole subgroups per workgroup).
    fn available(ctx: &GpuContext) -> Vec<Layout> {
        Self::available_of(ctx, &Layout::ALL)
    }

    fn available_of(ctx: &GpuContext, set: &[Layout]) -> Vec<Layout> {
        let runs = |l: &Layout| match l {
            Layout::RowWg8Subgroups => ctx.caps.subgroups && ctx.caps.subgroup_max_size <= 8,
            Layout::Rows4Bcast | Layout::Rows4BcastTok4 | Layout::Blocked88Bcast | Layout::Blocked44Bcast => linear::xbcast_fits(ctx),
            Layout::Tiled | Layout::TiledTok4 | Layout::TiledTok8 | Layout::Blocked88Tiled => ctx.caps.cpu_like && linear::xbcast_fits(ctx),
            Layout::Blocked88TiledXtex => lantern::kernels::x_texture::fits(ctx, &[], 1) && linear::x_window(ctx) > 0,
            Layout::TiledXu | Layout::TiledXuTok4 | Layout::TiledXuTok8 => linear::x_window(ctx) > 0,
            l => (!l.needs_subgroups() || ctx.caps.subgroups) && (!l.needs_f16() || ctx.caps.shader_f16),
        };
        let (yes, no): (Vec<Layout>, Vec<Layout>) = set.iter().copied().partition(runs);
        if !no.is_empty() {
            eprintln!("note: adapter {} ({:?}) cannot run layouts {no:?}", ctx.info.name, ctx.caps);
        }
        yes
    }
}

/// One linear check.
#[derive(Debug, Clone, Copy)]
struct LinearCase {
    fl: u32,
    layout: Layout,
    weights: WeightFormat,
    rows: usize,
    k: usize,
    tokens: usize,
    /// Input rows wider than K, output written at a column offset into wider rows.
    wide: bool,
    seed: u64,
    /// Elements per scale (packed weights).
    group: u32,
}

/// Run one fused linear on the GPU and compare it with the ops composition it stands for.
fn check_linear(ctx: &Arc<GpuContext>, c: LinearCase) {
    let LinearCase { fl, rows, k, tokens, .. } = c;
    let has = |f: u32| fl & f != 0;
    assert!(!(has(flags::GATED) && has(flags::BIAS)), "the runtime never fuses a bias into the gated product");
    let mut rng = Rng::new(c.seed);
    // Packed kernels read x as vec4: keep wide strides a multiple of 4 for them.
    let x_stride = if c.wide { k + if c.weights.is_packed() { 4 } else { 2 } } else { k };
    let (out_offset, out_stride) = if c.wide { (3, rows + 5) } else { (0, rows) };
    let x = rng.vec(tokens * x_stride);
    let g: Vec<f32> = (0..k).map(|_| 1.0 + 0.5 * rng.uniform()).collect();
    let w = HostWeight::random(&mut rng, rows, k, c.weights, c.group);
    let u = has(flags::GATED).then(|| HostWeight::random(&mut rng, rows, k, c.weights, c.group));
    let bias = has(flags::BIAS).then(|| rng.vec(rows));
    // Gathered rows: a few input rows in scrambled order, always including the last one.
    let gather: Vec<u32> = if has(flags::GATHER) {
        let n = tokens.min(4);
        let mut v: Vec<u32> = (0..n).map(|_| rng.below(tokens) as u32).collect();
        v[0] = tokens as u32 - 1;
        v
    } else {
        (0..tokens as u32).collect()
    };
    let n_out = gather.len();
    let y0 = rng.vec(n_out * out_stride);

    // Explicit layouts get the storage they read; the automatic ones what the runtime picks.
    let auto = matches!(c.layout, Layout::Auto | Layout::AutoMatmul);
    let tiled = auto || c.layout.is_tiled();
    let lin = GpuLinear::upload_with(ctx, "test.linear", w.matrix(), u.as_ref().map(|u| u.matrix()), bias.as_deref(), rows, k, tiled)
        .expect("upload linear");
    let key = c.layout.key(fl, c.weights);
    if c.layout.is_tiled() && !lin.is_tiled() {
        return; // groups of 8 or 16 (`lantern quantize`), or a tile past the binding limit, keep storage buffers
    }

    let what = format!(
        "{} rows {rows} k {k} tokens {tokens}{} ({} chunks)",
        key.map_or_else(|| format!("{:?} {:?}", c.weights, c.layout), |k| k.label()),
        if c.wide { " wide" } else { "" },
        lin.chunks().len()
    );
    let step = step_buffer(ctx);
    // Inputs the tiled matvec may read as uniform windows, as the runtime makes them.
    let xtex = c.layout == Layout::Blocked88TiledXtex || (c.layout == Layout::AutoMatmul && x_texture::fits(ctx, &[x_stride], tokens));
    let window = if auto || c.layout.is_xu() || xtex { linear::x_window(ctx) } else { 0 };
    let xb = create_storage_window(ctx, "x", bytemuck::cast_slice(&x), window).unwrap();
    let gb = create_storage_window(ctx, "g", bytemuck::cast_slice(&g), window).unwrap();
    let yb = buf_f32(ctx, "y", &y0);
    let rb = buf_u32(ctx, "rows", &gather);
    // x copied into a texture first, as the runtime's prefill does on CPU adapters.
    let xt = xtex.then(|| x_texture::create(ctx, "x.tex", x_stride, tokens).unwrap());
    let copy = xt.as_ref().map(|t| block_on(x_texture::build(ctx, &step, &xb, x_stride, k, t)).unwrap());
    let io = LinearIo {
        step: &step,
        x: &xb,
        x_stride,
        norm: has(flags::NORM).then_some(&gb),
        eps: EPS,
        y: &yb,
        out_stride,
        out_offset,
        residual: has(flags::RESIDUAL),
        rows: has(flags::GATHER).then_some(&rb),
        x_tex: xt.as_ref(),
    };
    let multi_row = matches!(
        c.layout,
        Layout::MultiRow
            | Layout::MultiRowSubgroups
            | Layout::MultiRowTok4
            | Layout::MultiRowTok4Subgroups
            | Layout::MultiRowTok8
            | Layout::MultiRowTok8Subgroups
    );
    if multi_row && !linear::multi_row_fits(&lin) {
        // Groups of 8 take the row-per-workgroup layout (`build`); the explicit key is refused.
        let r = block_on(linear::build_with_key(ctx, &lin, &io, key.unwrap()));
        assert!(r.is_err_and(|e| e.to_string().contains("multiples of 16")), "{what}: MULTI_ROW with group {} must be refused", c.group);
        return;
    }
    if c.layout == Layout::Masked && !linear::masked_reads(&lin) {
        // IQ4 tables, 2-bit planes, groups of 8: refused (`build` takes ROWS4 for them).
        let r = block_on(linear::build_with_key(ctx, &lin, &io, key.unwrap()));
        assert!(r.is_err_and(|e| e.to_string().contains("16-element units")), "{what}: the masked matvec must refuse these weights");
        return;
    }
    let d = match key {
        Some(key) => block_on(linear::build_with_key(ctx, &lin, &io, key)),
        None if c.layout == Layout::AutoMatmul => block_on(linear::build(ctx, &lin, &io, linear::Shape::Matmul)),
        None => block_on(linear::build(ctx, &lin, &io, linear::Shape::Matvec)),
    }
    .unwrap_or_else(|e| panic!("{what}: build: {e}"));
    let d: Vec<_> = copy.into_iter().chain(d).collect();
    submit(ctx, &step, tokens as u32, n_out as u32, &d);
    let got = read_f32s(ctx, &yb, y0.len());

    let xin: Vec<f32> = gather.iter().flat_map(|&r| x[r as usize * x_stride..][..k].iter().copied()).collect();
    let xn = if has(flags::NORM) { ops::rmsnorm(&xin, &g, EPS) } else { xin };
    let core = match &u {
        Some(u) => ops::silu_mul(&ops::linear(&xn, &w.values, None, k, rows), &ops::linear(&xn, &u.values, None, k, rows)),
        None => ops::linear(&xn, &w.values, bias.as_deref(), k, rows),
    };
    let mut want = y0.clone();
    for r in 0..n_out {
        let dst = &mut want[r * out_stride + out_offset..][..rows];
        let src = &core[r * rows..][..rows];
        let new = if has(flags::RESIDUAL) { ops::add(dst, src) } else { src.to_vec() };
        dst.copy_from_slice(&new);
    }
    let tol = if key.is_some_and(|k| k.weights.is_packed() && k.features.f16) { F16_DEQUANT_TOL } else { LINEAR_TOL };
    assert_close(&what, &got, &want, tol);
}

/// Every layout and weight format over every shape for one fused combination.
fn linear_suite(fl: u32, seed: u64) {
    let ctx = gpu();
    for layout in Layout::available(&ctx) {
        if layout.is_matmul() && fl & flags::GATHER != 0 {
            continue; // gathered rows are matvec-only
        }
        for weights in [WeightFormat::F32, WeightFormat::F16] {
            let odd: &[(usize, usize, usize)] = match weights {
                WeightFormat::F32 => &LINEAR_SHAPES_ODD_K,
                _ => &[],
            };
            for (i, &(rows, k, tokens)) in LINEAR_SHAPES.iter().chain(odd).enumerate() {
                check_linear(
                    &ctx,
                    LinearCase {
                        fl,
                        layout,
                        weights,
                        rows,
                        k,
                        tokens,
                        wide: i % 2 == 1,
                        seed: seed ^ ((i as u64) << 8) ^ ((layout as u64) << 16) ^ (format_id(weights) << 24),
                        group: 0,
                    },
                );
            }
        }
    }
}

#[test]
fn linear_plain_matches_reference() {
    linear_suite(PLAIN, 1);
}

#[test]
fn linear_norm_matches_reference() {
    linear_suite(NORM, 2);
}

#[test]
fn linear_norm_bias_matches_reference() {
    linear_suite(NORM_BIAS, 3);
}

#[test]
fn linear_residual_matches_reference() {
    linear_suite(RESIDUAL, 4);
}

#[test]
fn linear_norm_gated_matches_reference() {
    linear_suite(NORM_GATED, 5);
}

#[test]
fn linear_norm_gather_matches_reference() {
    linear_suite(NORM_GATHER, 6);
}

/// Weights (and the bias) split by rows into several bindings: every combination and layout,
/// output at a column offset so each chunk's `row_offset` is exercised.
#[test]
fn linear_weights_split_across_bindings_match_reference() {
    let ctx = gpu_small();
    let (rows, k, tokens) = (65, 130, 3);
    for fl in COMBOS {
        for layout in Layout::available(&ctx) {
            if layout.is_matmul() && fl & flags::GATHER != 0 {
                continue;
            }
            for weights in [WeightFormat::F32, WeightFormat::F16] {
                let c = LinearCase { fl, layout, weights, rows, k, tokens, wide: true, seed: 77 ^ fl as u64, group: 0 };
                let bytes = rows * k * if weights == WeightFormat::F32 { 4 } else { 2 };
                assert!(bytes as u64 > 4 * SMALL_BINDING, "shape too small to split into several chunks");
                check_linear(&ctx, c);
            }
        }
    }
}

/// `linear::build` (the layout the runtime picks for this adapter) agrees too.
#[test]
fn linear_auto_layout_matches_reference() {
    let ctx = gpu();
    eprintln!("adapter {}: matvec layout {:?}, caps {:?}", ctx.info.name, linear::matvec_layout(&ctx), ctx.caps);
    for fl in [NORM_BIAS, NORM_GATHER] {
        for (i, &(rows, k, tokens)) in LINEAR_SHAPES.iter().enumerate() {
            let c = LinearCase {
                fl,
                layout: Layout::Auto,
                weights: WeightFormat::F16,
                rows,
                k,
                tokens,
                wide: false,
                seed: 900 + i as u64,
                group: 0,
            };
            check_linear(&ctx, c);
        }
    }
    eprintln!("adapter {}: matmul layout {:?}", ctx.info.name, linear::matmul_layout(&ctx));
    for fl in [NORM_BIAS, NORM_GATED, RESIDUAL] {
        for (i, &(rows, k, tokens)) in LINEAR_SHAPES.iter().enumerate() {
            let c = LinearCase {
                fl,
                layout: Layout::AutoMatmul,
                weights: WeightFormat::F16,
                rows,
                k,
                tokens,
                wide: i % 2 == 1,
                seed: 950 + i as u64,
                group: 0,
            };
            check_linear(&ctx, c);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Packed integer weights (Q8, Q4, Q4Sym, Q3 and the 2:4 kinds: the formats `lantern quantize`
// writes): every layout of the packed matvec and matmuls against dequantize-then-multiply on
// the CPU.
// ---------------------------------------------------------------------------------------------

const PACKED_FORMATS: [WeightFormat; 6] = [
    WeightFormat::Packed(QuantKind::Q8),
    WeightFormat::Packed(QuantKind::Q4),
    WeightFormat::Packed(QuantKind::Q4Sym),
    WeightFormat::Packed(QuantKind::Q3),
    WeightFormat::Packed(QuantKind::S24Q4),
    WeightFormat::Packed(QuantKind::S24Q8),
];

/// (rows, K, tokens, group): rows not a multiple of any workgroup or block, K from one group to
/// many, groups of 8 to 128 (odd group counts for the paired f16 scales).
const PACKED_SHAPES: [(usize, usize, usize, u32); 6] =
    [(1, 32, 1, 32), (7, 72, 3, 8), (65, 96, 33, 32), (333, 192, 3, 64), (9, 384, 9, 128), (701, 576, 2, 32)];

/// Q3's and the 2:4 kinds': groups of 32 or more, rows whose low plane is not a whole texel
/// (K 96: the tiled layout refuses Q3's and S24Q4's) and ones that are.
const Q3_SHAPES: [(usize, usize, usize, u32); 6] =
    [(1, 32, 1, 32), (7, 96, 3, 32), (65, 128, 33, 64), (333, 192, 3, 64), (9, 384, 9, 128), (701, 576, 2, 32)];

fn packed_shapes(weights: WeightFormat) -> &'static [(usize, usize, usize, u32)] {
    if weights.kind().is_some_and(|k| k.min_group() == 32) {
        &Q3_SHAPES
    } else {
        &PACKED_SHAPES
    }
}

fn packed_suite(fl: u32, seed: u64) {
    let ctx = gpu();
    for layout in Layout::available_of(&ctx, &Layout::PACKED) {
        if layout.is_matmul() && fl & flags::GATHER != 0 {
            continue;
        }
        for weights in PACKED_FORMATS {
            for (i, &(rows, k, tokens, group)) in packed_shapes(weights).iter().enumerate() {
                let c = LinearCase {
                    fl,
                    layout,
                    weights,
                    rows,
                    k,
                    tokens,
                    wide: i % 2 == 1,
                    seed: seed ^ ((i as u64) << 8) ^ ((layout as u64) << 16) ^ (format_id(weights) << 24),
                    group,
                };
                check_linear(&ctx, c);
            }
        }
    }
}

#[test]
fn packed_linear_plain_and_residual_match_reference() {
    packed_suite(PLAIN, 31);
    packed_suite(RESIDUAL, 32);
}

#[test]
fn packed_linear_norm_and_bias_match_reference() {
    packed_suite(NORM, 33);
    packed_suite(NORM_BIAS, 34);
}

#[test]
fn packed_linear_norm_gated_matches_reference() {
    packed_suite(NORM_GATED, 35);
}

#[test]
fn packed_linear_norm_gather_matches_reference() {
    packed_suite(NORM_GATHER, 36);
}

/// Codes and scales split across bindings at the same rows, and the layout the runtime picks.
#[test]
fn packed_linear_split_across_bindings_and_auto_layout_match_reference() {
    let small = gpu_small();
    let (rows, k, tokens) = (65, 192, 3);
    for fl in COMBOS {
        for weights in PACKED_FORMATS {
            for layout in Layout::available_of(&small, &Layout::PACKED) {
                if layout.is_matmul() && fl & flags::GATHER != 0 {
                    continue;
                }
                let c = LinearCase { fl, layout, weights, rows, k, tokens, wide: true, seed: 78 ^ fl as u64, group: 64 };
                check_linear(&small, c);
            }
        }
    }
    let ctx = gpu();
    // x rows past the 64 KiB uniform window (20 tokens of 1024 floats: tokens 16.. and the
    // gathered rows among them fall back to storage loads inside the XU kernel).
    for weights in PACKED_FORMATS {
        for (layout, fl) in [
            (Layout::TiledXu, NORM_GATHER),
            (Layout::TiledXuTok4, NORM_GATED),
            (Layout::TiledXuTok8, NORM_GATED),
            (Layout::TiledXu, RESIDUAL),
        ] {
            if Layout::available_of(&ctx, &[layout]).is_empty() {
                continue;
            }
            let c = LinearCase { fl, layout, weights, rows: 70, k: 1024, tokens: 20, wide: false, seed: 995, group: 32 };
            check_linear(&ctx, c);
        }
    }
    for weights in PACKED_FORMATS {
        for (i, &(rows, k, tokens, group)) in packed_shapes(weights).iter().enumerate() {
            for (layout, fl) in [(Layout::Auto, NORM_GATHER), (Layout::AutoMatmul, NORM_GATED), (Layout::Auto, NORM_GATED)] {
                let c = LinearCase { fl, layout, weights, rows, k, tokens, wide: false, seed: 990 + i as u64, group };
                check_linear(&ctx, c);
            }
        }
    }
}

/// The GGUF-only formats (Q5_0, Q5_1, IQ4_NL, MXFP4 and the 256-element K-quants and IQ4_XS)
/// and FP8 (every byte, the NaN codes' +-480 included) from random blocks, in every packed kernel: (rows, K, tokens) with odd
/// row counts, one super-block to several (odd counts: Q6_K's paired d words, IQ4_XS's
/// two headers per texel), token counts for the matvec, the four- and eight-token matvecs
/// and the matmuls.
const GGML_FORMATS: [WeightFormat; 11] = [
    WeightFormat::Packed(QuantKind::Q5Sym),
    WeightFormat::Packed(QuantKind::Q5),
    WeightFormat::Packed(QuantKind::Iq4Nl),
    WeightFormat::Packed(QuantKind::Mxfp4),
    WeightFormat::Packed(QuantKind::Fp8),
    WeightFormat::Packed(QuantKind::Q2K),
    WeightFormat::Packed(QuantKind::Q3K),
    WeightFormat::Packed(QuantKind::Q4K),
    WeightFormat::Packed(QuantKind::Q5K),
    WeightFormat::Packed(QuantKind::Q6K),
    WeightFormat::Packed(QuantKind::Iq4Xs),
];
const GGML_SHAPES: [(usize, usize, usize); 3] = [(7, 256, 3), (65, 768, 9), (333, 512, 1)];

/// The packed layouts the GGUF-only formats are checked in: every kernel and shape the
/// runtime picks (the blocked matmul's other tile sizes differ from 8x8 only in the
/// format-independent accumulation).
const GGML_LAYOUTS: [Layout; 24] = [
    Layout::Masked,
    Layout::MultiRow,
    Layout::MultiRowSubgroups,
    Layout::MultiRowTok4,
    Layout::MultiRowTok4Subgroups,
    Layout::MultiRowTok8,
    Layout::MultiRowTok8Subgroups,
    Layout::TiledTok8,
    Layout::TiledXuTok8,
    Layout::Rows4,
    Layout::Rows4Bcast,
    Layout::Rows4BcastTok4,
    Layout::Tiled,
    Layout::TiledTok4,
    Layout::TiledXu,
    Layout::TiledXuTok4,
    Layout::Blocked88Tiled,
    Layout::Blocked88TiledXtex,
    Layout::Blocked88Bcast,
    Layout::RowWg64Subgroups,
    Layout::RowWg64F16,
    Layout::Matmul,
    Layout::MatmulF16,
    Layout::Blocked88,
];

/// The fused combinations that reach format-specific code: the norm prologue with the gated
/// pair (two weights), the plain residual store, and gathered rows. Bias and the plain
/// norm share the epilogue with the 3-format suites above.
const GGML_COMBOS: [u32; 3] = [NORM_GATED, RESIDUAL, NORM_GATHER];

fn ggml_suite(formats: &[WeightFormat], seed: u64) {
    let ctx = gpu();
    for layout in Layout::available_of(&ctx, &GGML_LAYOUTS) {
        for fl in GGML_COMBOS {
            if layout.is_matmul() && fl & flags::GATHER != 0 {
                continue;
            }
            for &weights in formats {
                for (i, &(rows, k, tokens)) in GGML_SHAPES.iter().enumerate() {
                    let group = quant_kind(weights).unwrap().ggml_group();
                    let c = LinearCase {
                        fl,
                        layout,
                        weights,
                        rows,
                        k,
                        tokens,
                        wide: i % 2 == 1,
                        seed: seed ^ ((i as u64) << 8) ^ ((layout as u64) << 16) ^ (format_id(weights) << 24) ^ ((fl as u64) << 32),
                        group,
                    };
                    check_linear(&ctx, c);
                }
            }
        }
    }
}

#[test]
fn ggml_32_formats_match_reference_in_every_layout() {
    ggml_suite(&GGML_FORMATS[..5], 41);
}

#[test]
fn ggml_k_quants_2_3_4_match_reference_in_every_layout() {
    ggml_suite(&GGML_FORMATS[5..8], 42);
}

#[test]
fn ggml_k_quants_5_6_and_iq4xs_match_reference_in_every_layout() {
    ggml_suite(&GGML_FORMATS[8..], 43);
}

/// Binding splits (8 KiB) and the runtime's own layout choice for the GGUF-only formats.
#[test]
fn ggml_formats_split_across_bindings_and_auto_layout_match_reference() {
    let small = gpu_small();
    for weights in GGML_FORMATS {
        let group = quant_kind(weights).unwrap().ggml_group();
        for layout in Layout::available_of(&small, &GGML_LAYOUTS) {
            for fl in [NORM_GATED, RESIDUAL] {
                let c = LinearCase { fl, layout, weights, rows: 65, k: 256, tokens: 3, wide: true, seed: 79 ^ fl as u64, group };
                check_linear(&small, c);
            }
        }
        for (layout, fl) in [(Layout::Auto, NORM_GATHER), (Layout::AutoMatmul, NORM_GATED), (Layout::Auto, NORM_GATED)] {
            let c = LinearCase { fl, layout, weights, rows: 70, k: 256, tokens: 20, wide: false, seed: 991, group };
            check_linear(&gpu(), c);
        }
    }
}

/// Bad shapes are refused with errors naming the tensor, never a panic or a wrong result.
#[test]
fn packed_linear_rejects_mismatched_shapes() {
    let ctx = gpu();
    let mut rng = Rng::new(5);
    let w = HostWeight::random(&mut rng, 8, 64, WeightFormat::Packed(QuantKind::Q4), 32);
    let err = GpuLinear::upload(&ctx, "bad.rows", w.matrix(), None, None, 9, 64).err().expect("rows mismatch");
    assert!(err.to_string().contains("bad.rows"), "{err}");
    let other = HostWeight::random(&mut rng, 8, 64, WeightFormat::Packed(QuantKind::Q8), 32);
    let err = GpuLinear::upload(&ctx, "bad.gate", w.matrix(), Some(other.matrix()), None, 8, 64).err().expect("mixed formats");
    assert!(err.to_string().contains("share one storage format"), "{err}");
    // x rows that are not a whole number of vec4.
    let lin = GpuLinear::upload(&ctx, "odd.stride", w.matrix(), None, None, 8, 64).unwrap();
    let step = step_buffer(&ctx);
    let xb = buf_f32(&ctx, "x", &[0.0; 66 * 2]);
    let yb = buf_f32(&ctx, "y", &[0.0; 16]);
    let io = LinearIo {
        step: &step,
        x: &xb,
        x_stride: 66,
        norm: None,
        eps: EPS,
        y: &yb,
        out_stride: 8,
        out_offset: 0,
        residual: false,
        rows: None,
        x_tex: None,
    };
    let err = block_on(linear::build(&ctx, &lin, &io, linear::Shape::Matvec)).err().expect("odd stride");
    assert!(err.to_string().contains("multiples of 4"), "{err}");
}

// ---------------------------------------------------------------------------------------------
// Embedding.
// ---------------------------------------------------------------------------------------------

/// Gather `tokens` random ids (always including 0, vocab - 1 and both sides of every chunk
/// boundary) from a random table and compare with `ops::embedding`; returns the chunk count.
fn check_embedding(ctx: &Arc<GpuContext>, format: WeightFormat, vocab: usize, dim: usize, tokens: usize, seed: u64, tiled: bool) -> usize {
    let mut rng = Rng::new(seed);
    let group = if dim.is_multiple_of(32) { 32 } else { 8 };
    let w = HostWeight::random(&mut rng, vocab, dim, format, group);
    let lin = GpuLinear::upload_with(ctx, "embed", w.matrix(), None, None, vocab, dim, tiled).expect("upload table");
    let chunks = lin.chunks();
    let mut ids: Vec<u32> = vec![0, vocab as u32 - 1];
    for &(r, _) in chunks.iter().skip(1) {
        ids.extend([r as u32 - 1, r as u32]);
    }
    while ids.len() < tokens {
        ids.push(rng.below(vocab) as u32);
    }
    rng.shuffle(&mut ids);
    let t = ids.len();
    let what = format!(
        "embedding {format:?} vocab {vocab} dim {dim} tokens {t} ({} chunks{})",
        chunks.len(),
        if lin.is_tiled() { ", tiled textures" } else { "" }
    );
    let step = step_buffer(ctx);
    let idb = buf_u32(ctx, "ids", &ids);
    let y = create_zeroed(ctx, "y", (t * dim * 4) as u64).unwrap();
    let d = block_on(kernels::embedding::build(ctx, &step, &idb, &lin, &y, 1.0)).expect("build embedding");
    submit(ctx, &step, t as u32, t as u32, &d);
    let got = read_f32s(ctx, &y, t * dim);
    assert_close(&what, &got, &ops::embedding(&w.values, vocab, dim, &ids), EXACT);
    chunks.len()
}

#[test]
fn embedding_matches_reference() {
    let ctx = gpu();
    check_embedding(&ctx, WeightFormat::F32, 50, 58, 33, 11, false);
    check_embedding(&ctx, WeightFormat::F32, 20, 578, 3, 12, false);
    check_embedding(&ctx, WeightFormat::F32, 9, 7, 1, 13, false);
    check_embedding(&ctx, WeightFormat::F16, 50, 6, 33, 14, false);
    check_embedding(&ctx, WeightFormat::F16, 20, 130, 3, 15, false);
    // Packed tables in storage buffers and (where the adapter holds them so) tiled textures.
    for tiled in [false, true] {
        for (i, f) in PACKED_FORMATS.into_iter().enumerate() {
            check_embedding(&ctx, f, 50, 64, 33, 16 + i as u64, tiled);
            // Rows of 40 take groups of 8, which q3 and the 2:4 kinds have not: 96.
            let dim = if f.kind().is_some_and(|k| k.min_group() == 32) { 96 } else { 40 };
            check_embedding(&ctx, f, 9, dim, 3, 19 + i as u64, tiled);
        }
        for (i, f) in GGML_FORMATS.into_iter().enumerate() {
            check_embedding(&ctx, f, 37, 512, 9, 60 + i as u64, tiled);
        }
    }
}

#[test]
fn embedding_table_split_across_bindings_matches_reference() {
    let ctx = gpu_small();
    // f32 rows of 232 bytes: 17 rows per chunk; f16 rows of 116 bytes: 35 per chunk; f16 rows
    // of 10 bytes (odd dim): 409 per chunk, chunk boundaries inside a u32 word pair.
    for (format, vocab, dim, seed) in [
        (WeightFormat::F32, 77, 58, 21),
        (WeightFormat::F16, 77, 58, 22),
        (WeightFormat::F16, 900, 5, 23),
        (WeightFormat::Packed(QuantKind::Q8), 300, 64, 24),
        (WeightFormat::Packed(QuantKind::Q4), 300, 64, 25),
        (WeightFormat::Packed(QuantKind::Q4Sym), 600, 32, 26),
        (WeightFormat::Packed(QuantKind::Q3), 500, 64, 27),
    ] {
        for tiled in [false, true] {
            // Tiled tables split at whole tiles of 32 rows: fewer, larger chunks.
            let chunks = check_embedding(&ctx, format, vocab, dim, 15, seed, tiled);
            let want = if tiled && format.is_packed() && linear::xbcast_fits(&ctx) { 2 } else { 3 };
            assert!(chunks >= want, "{format:?} {vocab}x{dim}: only {chunks} chunks");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// RMSNorm.
// ---------------------------------------------------------------------------------------------

#[test]
fn rmsnorm_matches_reference() {
    let ctx = gpu();
    let step = step_buffer(&ctx);
    for (i, &k) in [1usize, 2, 6, 58, 130, 578].iter().enumerate() {
        for &t in &[1usize, 3, 33] {
            let mut rng = Rng::new(100 + i as u64 * 7 + t as u64);
            // Rows of very different magnitude: the norm must not depend on it.
            let mut x = rng.vec(t * k);
            for (r, row) in x.chunks_mut(k).enumerate() {
                let s = [1e-2f32, 1.0, 30.0][r % 3];
                row.iter_mut().for_each(|v| *v *= s);
            }
            let g: Vec<f32> = (0..k).map(|_| 1.0 + rng.uniform()).collect();
            let xb = buf_f32(&ctx, "x", &x);
            let gb = buf_f32(&ctx, "g", &g);
            let y = create_zeroed(&ctx, "y", (t * k * 4) as u64).unwrap();
            let d = block_on(kernels::rmsnorm::build(
                &ctx,
                &step,
                &xb,
                &gb,
                &y,
                kernels::rmsnorm::RowLayout::dense(k),
                EPS,
                kernels::rmsnorm::Mode::Write,
            ))
            .expect("build rmsnorm");
            submit(&ctx, &step, t as u32, t as u32, std::slice::from_ref(&d));
            let got = read_f32s(&ctx, &y, t * k);
            assert_close(&format!("rmsnorm k {k} tokens {t}"), &got, &ops::rmsnorm(&x, &g, EPS), RMSNORM_TOL);
        }
    }
}

#[test]
fn rmsnorm_residual_and_in_place_head_modes() {
    use kernels::rmsnorm::{Mode, RowLayout};
    let ctx = gpu();
    let step = step_buffer(&ctx);
    let mut rng = Rng::new(77);
    // Residual: y += norm(x) * g over dense rows.
    let (t, k) = (5usize, 70usize);
    let x = rng.vec(t * k);
    let y0 = rng.vec(t * k);
    let g: Vec<f32> = (0..k).map(|_| 1.0 + rng.uniform()).collect();
    let (xb, gb) = (buf_f32(&ctx, "x", &x), buf_f32(&ctx, "g", &g));
    let y = buf_f32(&ctx, "y", &y0);
    let d = block_on(kernels::rmsnorm::build(&ctx, &step, &xb, &gb, &y, RowLayout::dense(k), EPS, Mode::Residual)).unwrap();
    submit(&ctx, &step, t as u32, t as u32, std::slice::from_ref(&d));
    let want: Vec<f32> = ops::rmsnorm(&x, &g, EPS).iter().zip(&y0).map(|(n, y)| n + y).collect();
    assert_close("rmsnorm residual", &read_f32s(&ctx, &y, t * k), &want, RMSNORM_TOL);
    // In place over heads inside wider rows: 3 "q" heads with one weight, 2 "k" heads with
    // the other, then 6 floats that must stay untouched.
    let (hd, qh, kh, extra) = (12usize, 3usize, 2usize, 6usize);
    let stride = (qh + kh) * hd + extra;
    let rows = rng.vec(t * stride);
    let g2: Vec<f32> = (0..2 * hd).map(|_| 0.5 + rng.uniform()).collect();
    let yb = buf_f32(&ctx, "rows", &rows);
    let gb2 = buf_f32(&ctx, "g2", &g2);
    let layout = RowLayout { k: hd, rows: qh + kh, row_stride: hd, token_stride: stride, split: qh, ..Default::default() };
    let d = block_on(kernels::rmsnorm::build(&ctx, &step, &xb, &gb2, &yb, layout, EPS, Mode::InPlace)).unwrap();
    submit(&ctx, &step, t as u32, t as u32, std::slice::from_ref(&d));
    let mut want = rows.clone();
    for tt in 0..t {
        for h in 0..qh + kh {
            let at = tt * stride + h * hd;
            let w = if h < qh { &g2[..hd] } else { &g2[hd..] };
            want[at..at + hd].copy_from_slice(&ops::rmsnorm(&rows[at..at + hd], w, EPS));
        }
    }
    assert_close("rmsnorm in place over heads", &read_f32s(&ctx, &yb, t * stride), &want, RMSNORM_TOL);
    // In place over a whole "q" (36 floats) and then a whole "k" (24) of each row, each with
    // its own weight read from one buffer at an offset (OLMoE's q/k norms); the rest untouched.
    let (qd, kd) = (qh * hd, kh * hd);
    let g3: Vec<f32> = (0..qd + kd).map(|_| 0.5 + rng.uniform()).collect();
    let yb = buf_f32(&ctx, "rows", &rows);
    let gb3 = buf_f32(&ctx, "g3", &g3);
    let q = RowLayout { k: qd, rows: 1, row_stride: qd, token_stride: stride, split: 1, ..Default::default() };
    let k_ = RowLayout { k: kd, rows: 1, row_stride: kd, token_stride: stride, split: 1, offset: qd, g_offset: qd };
    let dq = block_on(kernels::rmsnorm::build(&ctx, &step, &xb, &gb3, &yb, q, EPS, Mode::InPlace)).unwrap();
    let dk = block_on(kernels::rmsnorm::build(&ctx, &step, &xb, &gb3, &yb, k_, EPS, Mode::InPlace)).unwrap();
    submit(&ctx, &step, t as u32, t as u32, &[dq, dk]);
    let mut want = rows.clone();
    for tt in 0..t {
        let at = tt * stride;
        want[at..at + qd].copy_from_slice(&ops::rmsnorm(&rows[at..at + qd], &g3[..qd], EPS));
        want[at + qd..at + qd + kd].copy_from_slice(&ops::rmsnorm(&rows[at + qd..at + qd + kd], &g3[qd..], EPS));
    }
    assert_close("rmsnorm in place over whole projections", &read_f32s(&ctx, &yb, t * stride), &want, RMSNORM_TOL);
    // A weight too short for its offset is refused.
    let short = RowLayout { g_offset: qd + 1, ..k_ };
    assert!(block_on(kernels::rmsnorm::build(&ctx, &step, &xb, &gb3, &yb, short, EPS, Mode::InPlace)).is_err());
}

// ---------------------------------------------------------------------------------------------
// Argmax.
// ---------------------------------------------------------------------------------------------

/// Argmax of every `n`-wide row of `logits` on the GPU against `ops::argmax`.
fn check_argmax(ctx: &Arc<GpuContext>, what: &str, logits: &[f32], n: usize) {
    let rows = logits.len() / n;
    let got = run_argmax(ctx, logits, n, &vec![RowDraw::ARGMAX; rows]);
    for (r, row) in logits.chunks(n).enumerate() {
        let want = ops::argmax(row);
        let at = |i: u32| row.get(i as usize).copied().unwrap_or(f32::NAN);
        assert_eq!(
            got[r],
            want,
            "{what}: row {r} of {rows} (n {n}): got index {} (value {}), want index {want} (value {})",
            got[r],
            at(got[r]),
            at(want)
        );
    }
}

/// The argmax kernel's token for every `n`-wide row of `logits`, row `r` chosen as `draws[r]`.
fn run_argmax(ctx: &Arc<GpuContext>, logits: &[f32], n: usize, draws: &[RowDraw]) -> Vec<u32> {
    let rows = logits.len() / n;
    let step = step_buffer(ctx);
    let lb = buf_f32(ctx, "logits", logits);
    let out = create_zeroed(ctx, "argmax", (rows * 4) as u64).unwrap();
    let db = create_storage(ctx, "row_draws", bytemuck::cast_slice(draws)).unwrap();
    let d = block_on(kernels::argmax::build(ctx, &step, &lb, &out, &db, n)).expect("build argmax");
    submit(ctx, &step, rows as u32, rows as u32, std::slice::from_ref(&d));
    read_u32s(ctx, &out, rows)
}

/// Gumbel-max draws on the GPU against the CPU reference (`kernels::argmax::choose`): the
/// token the GPU drew is a candidate (inside the nucleus for a top-p 1e-4 higher: the GPU sums
/// probabilities in f32), and no candidate (inside the nucleus for a top-p 1e-4 lower) beats
/// its score by more than 1e-4 (f32 logarithms differ by an ulp or two between adapters).
fn check_draws(ctx: &Arc<GpuContext>, what: &str, logits: &[f32], n: usize, draws: &[RowDraw]) {
    use lantern::kernels::argmax::{choose, nucleus_floor};
    let got = run_argmax(ctx, logits, n, draws);
    for (r, row) in logits.chunks(n).enumerate() {
        let d = draws[r];
        let with_p = |dp: f32| RowDraw { top_p: if d.nucleus() { (d.top_p + dp).min(0.999_999) } else { d.top_p }, ..d };
        let (wide, narrow) = (nucleus_floor(row, &with_p(1e-4)), nucleus_floor(row, &with_p(-1e-4)));
        let want = choose(row, &d, narrow);
        let t = got[r] as usize;
        let score = |i: usize| d.score(row[i], i as u32);
        let ok = t == want as usize || (t < n && row[t] >= wide && score(t) >= score(want as usize) - 1e-4);
        assert!(
            ok,
            "{what}: row {r} (n {n}, {d:?}): GPU drew {t} (logit {}), the reference {want} (logit {}); nucleus floors {wide}..{narrow}",
            row.get(t).copied().unwrap_or(f32::NAN),
            row[want as usize]
        );
    }
}

/// GPU top-k against a CPU sort (value descending, lower id on ties, non-finite skipped):
/// every pair exact; the row's logsumexp against an f64 one over its finite values.
fn check_topk(ctx: &Arc<GpuContext>, what: &str, logits: &[f32], n: usize, k: usize) {
    use lantern::kernels::topk::{decode_row, row_logsumexp, TOPK_ROW_WORDS};
    let rows = logits.len() / n;
    let step = step_buffer(ctx);
    let lb = buf_f32(ctx, "logits", logits);
    let out = create_zeroed(ctx, "topk", (rows * TOPK_ROW_WORDS * 4) as u64).unwrap();
    let d = block_on(kernels::topk::build(ctx, &step, &lb, &out, n, k)).expect("build topk");
    submit(ctx, &step, rows as u32, rows as u32, std::slice::from_ref(&d));
    let words = read_u32s(ctx, &out, rows * TOPK_ROW_WORDS);
    for (r, row) in logits.chunks(n).enumerate() {
        let row_words = &words[r * TOPK_ROW_WORDS..][..TOPK_ROW_WORDS];
        let got = decode_row(row_words, k);
        let finite: Vec<f64> = row.iter().filter(|v| v.is_finite()).map(|&v| v as f64).collect();
        if !finite.is_empty() {
            let m = finite.iter().cloned().fold(f64::MIN, f64::max);
            let lse = m + finite.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
            let lse_got = row_logsumexp(row_words) as f64;
            assert!((lse_got - lse).abs() <= 1e-5 * lse.abs().max(1.0), "{what}: row {r}: logsumexp {lse_got} vs {lse}");
        }
        let mut want: Vec<(u32, f32)> = row.iter().enumerate().filter(|(_, v)| v.is_finite()).map(|(i, &v)| (i as u32, v)).collect();
        want.sort_by(|a, b| b.1.partial_cmp(&a.1).unwrap().then(a.0.cmp(&b.0)));
        want.truncate(k);
        assert_eq!(got, want, "{what}: row {r} of {rows} (n {n}, k {k})");
    }
}

#[test]
fn topk_matches_a_cpu_sort() {
    let ctx = gpu();
    for (i, &(n, k)) in [(1usize, 64usize), (7, 5), (63, 64), (500, 40), (4099, 64), (49152, 64), (3000, 1)].iter().enumerate() {
        let mut rng = Rng::new(900 + i as u64);
        check_topk(&ctx, "random", &rng.vec(3 * n), n, k);
    }
    // Ties (ids order equal values), NaN and infinities skipped, fewer finite values than k.
    let mut rng = Rng::new(950);
    let mut tied: Vec<f32> = rng.vec(2 * 1000).iter().map(|v| (v * 8.0).round()).collect();
    tied[3] = f32::NAN;
    tied[10] = f32::INFINITY;
    tied[1011] = f32::NEG_INFINITY;
    check_topk(&ctx, "ties and non-finite", &tied, 1000, 64);
    let mut sparse = vec![f32::NAN; 300];
    for (j, i) in [5usize, 77, 150, 299].iter().enumerate() {
        sparse[*i] = j as f32;
    }
    check_topk(&ctx, "fewer finite values than k", &sparse, 300, 64);
}

#[test]
fn argmax_matches_reference_on_random_rows() {
    let ctx = gpu();
    for (i, &n) in [1usize, 7, 255, 257, 1000, 4099].iter().enumerate() {
        let mut rng = Rng::new(200 + i as u64);
        check_argmax(&ctx, "random", &rng.vec(3 * n), n);
    }
}

#[test]
fn argmax_ties_pick_the_lowest_index() {
    let ctx = gpu();
    let n = 1000;
    let mut rng = Rng::new(300);
    let mut logits = Vec::new();
    // Tied maxima in different lanes (256-wide workgroup), in the same lane, across many
    // lanes, and a constant row.
    for tied in [&[700usize, 3, 259][..], &[500, 244], &[300, 44], &[999, 998, 997, 600, 1]] {
        let mut row = rng.vec(n);
        tied.iter().for_each(|&i| row[i] = 2.0);
        logits.extend(row);
    }
    logits.extend(std::iter::repeat_n(0.5f32, n));
    check_argmax(&ctx, "ties", &logits, n);
}

#[test]
fn argmax_never_picks_nan() {
    let ctx = gpu();
    let n = 777;
    let mut rng = Rng::new(400);
    let mut logits = Vec::new();
    // NaN first, NaN after the maximum, NaN everywhere but two values, NaN as the would-be max.
    let mut row = rng.vec(n);
    row[0] = f32::NAN;
    logits.extend(row);
    let mut row = rng.vec(n);
    row[100] = 5.0;
    row[101] = f32::NAN;
    row[776] = f32::NAN;
    logits.extend(row);
    let mut row = vec![f32::NAN; n];
    row[300] = -1.0;
    row[600] = 3.0;
    logits.extend(row);
    let mut row = rng.vec(n);
    row[42] = f32::NAN;
    row[43] = 1.5;
    logits.extend(row);
    check_argmax(&ctx, "nan", &logits, n);
}

/// Regression: a row with no value above f32::MIN (all NaN, or all -inf as a fully masked
/// row gives) yielded index n - 1 on the GPU; the oracle says 0.
#[test]
fn argmax_all_nan_or_all_neg_inf_row_gives_zero() {
    let ctx = gpu();
    let n = 300;
    let mut logits = vec![f32::NAN; n];
    logits.extend(vec![f32::NEG_INFINITY; n]);
    check_argmax(&ctx, "all nan / all -inf", &logits, n);
}

#[test]
fn argmax_draws_from_the_whole_vocabulary_as_the_reference_does() {
    let ctx = gpu();
    for (i, &n) in [1usize, 7, 255, 257, 1000, 4099].iter().enumerate() {
        let mut rng = Rng::new(500 + i as u64);
        let rows = 6;
        let mut logits: Vec<f32> = rng.vec(rows * n).iter().map(|v| v * 8.0).collect();
        // A masked row (every token but three at -inf), and a NaN among the values.
        for (j, v) in logits[n..2 * n].iter_mut().enumerate() {
            if j % 97 != 3 {
                *v = f32::NEG_INFINITY;
            }
        }
        logits[2 * n] = f32::NAN;
        // Greedy rows between sampled ones, temperatures low and high, nuclei narrow and wide,
        // indices far apart.
        let draws: Vec<RowDraw> = (0..rows)
            .map(|r| match r {
                4 => RowDraw::ARGMAX,
                _ => RowDraw::sampled([0.3, 1.0, 2.0][r % 3], [1.0, 0.9, 1.0, 0.5, 1.0, 0.95][r], 42 + r as u64, (r * 1000) as u64),
            })
            .collect();
        check_draws(&ctx, "random", &logits, n, &draws);
        // (Rows of 3 tokens or fewer are wholly masked: their token is 0, as the argmax's.)
        let masked = run_argmax(&ctx, &logits, n, &draws)[1] as usize;
        assert!(if n > 3 { masked % 97 == 3 } else { masked == 0 }, "n {n}: a masked-out token ({masked}) was drawn");
    }
}

/// The GPU's Gumbel-max draws follow softmax(logits / T), and with a top-p the renormalised
/// nucleus: 4,096 draws (one row each, one index each) of a six-token row, each token's count
/// within 5 standard deviations of what its probability gives; a -inf token, and with a top-p
/// a token outside the nucleus, never drawn.
#[test]
fn argmax_draws_follow_the_softmax() {
    let ctx = gpu();
    let row = [2.0f32, 1.0, 0.0, -1.0, f32::NEG_INFINITY, 1.5];
    let (rows, t) = (4096usize, 0.8f32);
    let logits: Vec<f32> = (0..rows).flat_map(|_| row).collect();
    // p = [.519, .149, .043, .012, 0, .278] at T = 0.8: a top-p of 0.8 keeps tokens 0, 5 and 1
    // (.519 + .278 < 0.8 <= .519 + .278 + .149).
    for (top_p, nucleus) in [(1.0f32, vec![0usize, 1, 2, 3, 5]), (0.8, vec![0, 1, 5])] {
        let draws: Vec<RowDraw> = (0..rows).map(|i| RowDraw::sampled(t, top_p, 7, i as u64)).collect();
        let got = run_argmax(&ctx, &logits, row.len(), &draws);
        let e: Vec<f64> = row.iter().enumerate().map(|(i, &v)| if nucleus.contains(&i) { ((v / t) as f64).exp() } else { 0.0 }).collect();
        let z: f64 = e.iter().sum();
        for (tok, &ei) in e.iter().enumerate() {
            let p = ei / z;
            let count = got.iter().filter(|&&g| g as usize == tok).count() as f64;
            let (mean, sd) = (p * rows as f64, (p * (1.0 - p) * rows as f64).sqrt());
            assert!(
                (count - mean).abs() <= 5.0 * sd + 1e-9,
                "top-p {top_p}, token {tok}: drawn {count} times, expected {mean:.1} (sd {sd:.1})"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Paged KV cache layout shared by the rope_kv and attention checks.
// ---------------------------------------------------------------------------------------------

/// Heads of one attention layer.
#[derive(Debug, Clone, Copy)]
struct Heads {
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
}

impl Heads {
    fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }
    fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
    fn qkv_dim(&self) -> usize {
        self.q_dim() + 2 * self.kv_dim()
    }
}

/// How the cache is stored in a check: dtype and how many pages a shard (buffer) holds
/// (`None`: one shard).
#[derive(Debug, Clone, Copy)]
struct Storage {
    dtype: KvDtype,
    pages_per_shard: Option<usize>,
}

const F32_ONE_SHARD: Storage = Storage { dtype: KvDtype::F32, pages_per_shard: None };

/// A random block table over a shuffled pool (with spare pages nobody owns; sequence 1 shares
/// the first `shared` pages of sequence 0, like a common prompt prefix) and host copies of the
/// K and V caches as the values they hold, `(pages, page_size, n_kv_heads, head_dim)`.
struct Paged {
    heads: Heads,
    page_size: usize,
    max_pages: usize,
    layout: KvLayout,
    /// Where each (seq, page index) lives: the block table, or for a window ring the pages
    /// the ring formula gives (the uploaded table is then all 0xffffffff: the kernels must
    /// not read it).
    block_table: Vec<u32>,
    /// The table the kernels get.
    gpu_table: Vec<u32>,
    k: Vec<f32>,
    v: Vec<f32>,
    /// Q4: K as the GPU knows it before rounding (the open pages' slots in f16, as their
    /// tail holds them), and each sequence's length (which pages are sealed). `k` is then
    /// what attention reads: sealed pages rounded per channel, open pages' written slots in
    /// f16, their other slots 0.
    k_raw: Vec<f32>,
    lens: Vec<usize>,
}

impl Paged {
    fn random(rng: &mut Rng, heads: Heads, n_seqs: usize, max_len: usize, page_size: usize, storage: Storage, shared: usize) -> Paged {
        let max_pages = max_len.div_ceil(page_size);
        let n_pages = n_seqs * max_pages + 2;
        let mut pool: Vec<u32> = (0..n_pages as u32).collect();
        rng.shuffle(&mut pool);
        let mut block_table = pool[..n_seqs * max_pages].to_vec();
        if n_seqs > 1 {
            for i in 0..shared.min(max_pages) {
                block_table[max_pages + i] = block_table[i];
            }
        }
        let cells = n_pages * page_size * heads.kv_dim();
        let binding =
            Self::binding(storage, |b| KvLayout::new(storage.dtype, page_size, heads.n_kv_heads, heads.head_dim, n_pages, n_seqs, b));
        let layout = KvLayout::new(storage.dtype, page_size, heads.n_kv_heads, heads.head_dim, n_pages, n_seqs, binding).expect("layout");
        if let Some(p) = storage.pages_per_shard {
            assert_eq!(layout.pages_per_shard, p);
        }
        let hd = heads.head_dim;
        // The values the cache can hold exactly in its dtype.
        let store = |v: Vec<f32>| -> Vec<f32> { v.chunks(hd).flat_map(|h| round_trip(storage.dtype, h)).collect() };
        let k_raw = rng.vec(cells);
        let (k, v) = (store(k_raw.clone()), store(rng.vec(cells)));
        let gpu_table = block_table.clone();
        let mut paged = Paged { heads, page_size, max_pages, layout, block_table, gpu_table, k, v, k_raw, lens: vec![0; n_seqs] };
        paged.set_lens(&vec![0; n_seqs]);
        paged
    }

    /// The binding limit that gives `storage.pages_per_shard` pages per shard for the
    /// layout `make` builds (every page in one shard when `None`).
    fn binding(storage: Storage, make: impl Fn(u64) -> Result<KvLayout, GpuError>) -> u64 {
        let one = make(u64::MAX >> 8).expect("layout");
        storage.pages_per_shard.map_or(u64::MAX >> 8, |p| p as u64 * one.page_bytes() + one.tail_words() as u64 * 4)
    }

    /// Q4: the sequences' lengths before a step (what the length words say); their open
    /// pages' written slots become f16 in `k_raw`, and `k` what attention reads.
    fn set_lens(&mut self, lens: &[usize]) {
        self.lens = lens.to_vec();
        if self.layout.dtype != KvDtype::Q4 {
            return;
        }
        let ps = self.page_size;
        for (s, &len) in lens.iter().enumerate() {
            if !len.is_multiple_of(ps) {
                for pos in len / ps * ps..len {
                    for kvh in 0..self.heads.n_kv_heads {
                        let a = self.addr(s, pos, kvh);
                        for x in &mut self.k_raw[a..a + self.heads.head_dim] {
                            *x = f16::from_f32(*x).to_f32();
                        }
                    }
                }
            }
        }
        self.k = self.q4_view(
            |g, kvh| self.page_heads(&self.k_raw, g, kvh),
            |s, pos, kvh| {
                let a = self.addr(s, pos, kvh);
                self.k_raw[a..a + self.heads.head_dim].to_vec()
            },
            true,
        );
    }

    /// The heads of physical page g for KV head kvh in `x`.
    fn page_heads(&self, x: &[f32], g: usize, kvh: usize) -> Vec<Vec<f32>> {
        let hd = self.heads.head_dim;
        (0..self.page_size).map(|slot| x[((g * self.page_size + slot) * self.heads.n_kv_heads + kvh) * hd..][..hd].to_vec()).collect()
    }

    /// Q4: K as attention reads it, given each page's heads for a KV head (`page`, sealed:
    /// rounded by `seal` when asked, else taken as they are) and an open page's slot
    /// (`open`). The slots of an open page past its sequence's length keep the sealed
    /// values (in a window ring, those of the page that used it before).
    fn q4_view(
        &self,
        page: impl Fn(usize, usize) -> Vec<Vec<f32>>,
        open: impl Fn(usize, usize, usize) -> Vec<f32>,
        seal: bool,
    ) -> Vec<f32> {
        let (ps, nkv, hd) = (self.page_size, self.heads.n_kv_heads, self.heads.head_dim);
        let mut k = vec![0.0f32; self.k_raw.len()];
        let n_pages = k.len() / (ps * nkv * hd);
        for g in 0..n_pages {
            for kvh in 0..nkv {
                let heads = page(g, kvh);
                let heads = if seal { seal_page(&heads) } else { heads };
                for (slot, h) in heads.iter().enumerate() {
                    k[((g * ps + slot) * nkv + kvh) * hd..][..hd].copy_from_slice(h);
                }
            }
        }
        for (s, &len) in self.lens.iter().enumerate() {
            if len.is_multiple_of(ps) {
                continue;
            }
            for pos in len / ps * ps..len {
                for kvh in 0..nkv {
                    let a = self.addr(s, pos, kvh);
                    k[a..a + hd].copy_from_slice(&open(s, pos, kvh));
                }
            }
        }
        k
    }

    /// Q4: `x` with the slots of each open page past its sequence's length set to 0 (they
    /// hold rounded values of no page attention reads yet, which a step changes on the
    /// host's model but not on the GPU).
    fn mask_open(&self, x: &mut [f32]) {
        let (ps, hd) = (self.page_size, self.heads.head_dim);
        for (s, &len) in self.lens.iter().enumerate() {
            if len.is_multiple_of(ps) {
                continue;
            }
            for pos in len..len / ps * ps + ps {
                for kvh in 0..self.heads.n_kv_heads {
                    let a = self.addr(s, pos, kvh);
                    x[a..a + hd].fill(0.0);
                }
            }
        }
    }

    /// Q4: apply a step's K writes (`k_rot[i]`: the heads of token `tokens[i]`, kv_dim
    /// floats) as the seal pass does: pages the step fills are rounded, open pages keep f16.
    fn q4_step(&mut self, tokens: &[(usize, usize)], k_rot: &[f32]) {
        let kv_dim = self.heads.kv_dim();
        let mut lens = self.lens.clone();
        for (i, &(s, pos)) in tokens.iter().enumerate() {
            let a = self.addr(s, pos, 0);
            self.k_raw[a..a + kv_dim].copy_from_slice(&k_rot[i * kv_dim..][..kv_dim]);
            lens[s] = lens[s].max(pos + 1);
        }
        self.set_lens(&lens);
    }

    /// Window rings (`kv::ring`) for `n_seqs` sequence slots of up to `max_len` positions:
    /// position p of slot s in page s * ring.pages + (p / page_size) % ring.pages.
    fn rings(rng: &mut Rng, heads: Heads, n_seqs: usize, max_len: usize, ring: WindowRing, storage: Storage) -> Paged {
        let page_size = ring.page_size;
        let max_pages = max_len.div_ceil(page_size);
        let block_table: Vec<u32> = (0..n_seqs).flat_map(|s| (0..max_pages).map(move |i| ring.page(s, i * page_size) as u32)).collect();
        let n_pages = n_seqs * ring.pages;
        let cells = n_pages * page_size * heads.kv_dim();
        let binding = Self::binding(storage, |b| KvLayout::rings(storage.dtype, &ring, n_seqs, heads.n_kv_heads, heads.head_dim, b));
        let layout = KvLayout::rings(storage.dtype, &ring, n_seqs, heads.n_kv_heads, heads.head_dim, binding).expect("ring layout");
        assert_eq!(layout.ring, ring.pages);
        let hd = heads.head_dim;
        let store = |v: Vec<f32>| -> Vec<f32> { v.chunks(hd).flat_map(|h| round_trip(storage.dtype, h)).collect() };
        let k_raw = rng.vec(cells);
        let (k, v) = (store(k_raw.clone()), store(rng.vec(cells)));
        let gpu_table = vec![u32::MAX; block_table.len()];
        let mut paged = Paged { heads, page_size, max_pages, layout, block_table, gpu_table, k, v, k_raw, lens: vec![0; n_seqs] };
        paged.set_lens(&vec![0; n_seqs]);
        paged
    }

    /// Offset of (seq, pos, kv head) in the caches.
    fn addr(&self, seq: usize, pos: usize, kvh: usize) -> usize {
        let page = self.block_table[seq * self.max_pages + pos / self.page_size] as usize;
        ((page * self.page_size + pos % self.page_size) * self.heads.n_kv_heads + kvh) * self.heads.head_dim
    }

    /// K and V of `seq` for positions `0..n` as `[n, n_kv_heads * head_dim]` rows.
    fn gather(&self, seq: usize, n: usize) -> (Vec<f32>, Vec<f32>) {
        let (mut k, mut v) = (Vec::new(), Vec::new());
        for pos in 0..n {
            for kvh in 0..self.heads.n_kv_heads {
                let a = self.addr(seq, pos, kvh);
                k.extend_from_slice(&self.k[a..a + self.heads.head_dim]);
                v.extend_from_slice(&self.v[a..a + self.heads.head_dim]);
            }
        }
        (k, v)
    }

    /// The shard buffers' words for host values `x` (one layout, every dtype; q4: V, or K
    /// with `k` from `k_raw` and the lengths).
    fn encode(&self, x: &[f32], k: bool) -> Vec<Vec<u32>> {
        let l = &self.layout;
        let hd = l.head_dim;
        let q4_k = k && l.dtype == KvDtype::Q4;
        let words = ((if k { l.k_shard_bytes() } else { l.v_shard_bytes() }) / 4) as usize;
        let mut shards = vec![vec![0u32; words]; l.n_shards];
        let heads = x.len() / hd;
        for g in 0..heads {
            let page = g / (l.page_size * l.n_kv_heads);
            let slot = g / l.n_kv_heads % l.page_size;
            let (s, th) = l.locate(page, slot, g % l.n_kv_heads);
            let h = &x[g * hd..][..hd];
            let w = &mut shards[s];
            match l.dtype {
                KvDtype::F32 => {
                    for (i, v) in h.iter().enumerate() {
                        w[th * hd + i] = v.to_bits();
                    }
                }
                KvDtype::F16 => {
                    for i in (0..hd).step_by(2) {
                        let lo = f16::from_f32(h[i]).to_bits() as u32;
                        let hi = f16::from_f32(h[i + 1]).to_bits() as u32;
                        w[(th * hd + i) / 2] = lo | (hi << 16);
                    }
                }
                KvDtype::Q8 => {
                    let (codes, amax) = quantize_head(h, 127.0);
                    for i in (0..hd).step_by(4) {
                        let b = |j: usize| (codes[i + j] as u8) as u32;
                        w[(th * hd + i) / 4] = b(0) | b(1) << 8 | b(2) << 16 | b(3) << 24;
                    }
                    w[l.scale_base() + th] = amax.to_bits();
                }
                KvDtype::Q4 if !q4_k => {
                    let vg = v_group(hd);
                    for (j, grp) in h.chunks(vg).enumerate() {
                        let (codes, d, m) = quantize_group(grp);
                        for (i, &c) in codes.iter().enumerate() {
                            w[(th * hd + j * vg + i) / 8] |= (c as u32) << (4 * ((j * vg + i) % 8));
                        }
                        w[l.scale_base() + th * (hd / vg) + j] = f16x2(d, m);
                    }
                }
                KvDtype::Q4 => {}
                KvDtype::Bf16 => unreachable!("not a runtime dtype"),
            }
        }
        if q4_k {
            let (ps, nkv) = (l.page_size, l.n_kv_heads);
            for g in 0..l.num_pages {
                for kvh in 0..nkv {
                    let heads = self.page_heads(&self.k_raw, g, kvh);
                    for c in 0..hd {
                        let col: Vec<f32> = heads.iter().map(|h| h[c]).collect();
                        let (codes, d, m) = quantize_group(&col);
                        for (slot, &n) in codes.iter().enumerate() {
                            let (s, th) = l.locate(g, slot, kvh);
                            shards[s][(th * hd + c) / 8] |= (n as u32) << (4 * (c % 8));
                        }
                        let (s, th) = l.locate(g, 0, kvh);
                        let lp = th / (ps * nkv);
                        shards[s][l.scale_base() + (lp * nkv + kvh) * hd + c] = f16x2(d, m);
                    }
                }
            }
            for (sq, &len) in self.lens.iter().enumerate() {
                // Step rows: no key of this sequence from the step's own rows (its first row
                // would be at its length).
                for w in shards.iter_mut() {
                    w[l.tail_base() - 2 * (sq + 1)] = 0;
                    w[l.tail_base() - 2 * (sq + 1) + 1] = len as u32;
                }
                if len.is_multiple_of(ps) {
                    continue;
                }
                for pos in len / ps * ps..len / ps * ps + ps {
                    for kvh in 0..nkv {
                        let a = self.addr(sq, pos, kvh);
                        let (s, _) = l.locate(a / hd / nkv / ps, 0, 0);
                        let tw = self.tail_word(sq, pos, kvh);
                        for i in (0..hd).step_by(2) {
                            shards[s][tw + i / 2] = f16x2(self.k_raw[a + i], self.k_raw[a + i + 1]);
                        }
                    }
                }
            }
        }
        shards
    }

    /// Q4: the first tail word of (sequence, position, KV head) in its shard.
    fn tail_word(&self, seq: usize, pos: usize, kvh: usize) -> usize {
        let l = &self.layout;
        let x = pos / l.page_size;
        l.tail_base() + (((seq * 2 + x % 2) * l.page_size + pos % l.page_size) * l.n_kv_heads + kvh) * (l.head_dim / 2)
    }

    /// Host values (`pages * page_size * kv_dim`) from the shard buffers' words (q4 K: as
    /// attention would read it with sequences of `lens` tokens).
    fn decode(&mut self, shards: &[Vec<u32>], k: bool, lens: &[usize]) -> Vec<f32> {
        let l = self.layout;
        let hd = l.head_dim;
        let heads = self.k.len() / hd;
        let mut x = vec![0.0f32; self.k.len()];
        let q4 = |w: u32, e: usize| ((w >> (4 * (e % 8))) & 15) as f32;
        let half = |w: u32, i: usize| f16::from_bits((w >> (16 * i)) as u16).to_f32();
        for g in 0..heads {
            let page = g / (l.page_size * l.n_kv_heads);
            let slot = g / l.n_kv_heads % l.page_size;
            let kvh = g % l.n_kv_heads;
            let (s, th) = l.locate(page, slot, kvh);
            let w = &shards[s];
            for i in 0..hd {
                let e = th * hd + i;
                x[g * hd + i] = match l.dtype {
                    KvDtype::F32 => f32::from_bits(w[e]),
                    KvDtype::F16 => half(w[e / 2], e % 2),
                    KvDtype::Q8 => {
                        let code = (w[e / 4] >> (8 * (e % 4))) as u8 as i8;
                        lantern::kv::cache::dequantize_q8(code, f32::from_bits(w[l.scale_base() + th]))
                    }
                    KvDtype::Q4 if k => {
                        let lp = th / (l.page_size * l.n_kv_heads);
                        let dm = w[l.scale_base() + (lp * l.n_kv_heads + kvh) * hd + i];
                        q4(w[e / 8], e) * half(dm, 0) + half(dm, 1)
                    }
                    KvDtype::Q4 => {
                        let vg = v_group(hd);
                        let dm = w[l.scale_base() + th * (hd / vg) + i / vg];
                        q4(w[e / 8], e) * half(dm, 0) + half(dm, 1)
                    }
                    KvDtype::Bf16 => unreachable!("not a runtime dtype"),
                };
            }
        }
        if k && l.dtype == KvDtype::Q4 {
            // The open pages from the tails.
            let saved = std::mem::replace(&mut self.lens, lens.to_vec());
            let nkv = l.n_kv_heads;
            let sealed = x;
            x = self.q4_view(
                |g, kvh| self.page_heads(&sealed, g, kvh),
                |sq, pos, kvh| {
                    let a = self.addr(sq, pos, kvh);
                    let (s, _) = l.locate(a / hd / nkv / l.page_size, 0, 0);
                    let tw = self.tail_word(sq, pos, kvh);
                    (0..hd).map(|i| half(shards[s][tw + i / 2], i % 2)).collect()
                },
                false,
            );
            self.lens = saved;
        }
        x
    }

    /// K and V shard buffers holding the host values.
    fn upload(&self, ctx: &GpuContext) -> (Vec<wgpu::Buffer>, Vec<wgpu::Buffer>) {
        let up = |name: &str, x: &[f32], k: bool| -> Vec<wgpu::Buffer> {
            self.encode(x, k).iter().enumerate().map(|(i, w)| buf_u32(ctx, &format!("{name}.{i}"), w)).collect()
        };
        (up("k_cache", &self.k, true), up("v_cache", &self.v, false))
    }

    /// Host values of shard buffers read back (`k`: K's buffers; q4: with sequences of
    /// `lens` tokens).
    fn read(&mut self, ctx: &Arc<GpuContext>, bufs: &[wgpu::Buffer], k: bool, lens: &[usize]) -> Vec<f32> {
        self.decode(&self.read_words(ctx, bufs, k), k, lens)
    }

    /// The shard buffers' words.
    fn read_words(&self, ctx: &Arc<GpuContext>, bufs: &[wgpu::Buffer], k: bool) -> Vec<Vec<u32>> {
        let words = ((if k { self.layout.k_shard_bytes() } else { self.layout.v_shard_bytes() }) / 4) as usize;
        bufs.iter().map(|b| read_u32s(ctx, b, words)).collect()
    }
}

/// An f16 pair in one word (`a` low).
fn f16x2(a: f32, b: f32) -> u32 {
    f16::from_f32(a).to_bits() as u32 | (f16::from_f32(b).to_bits() as u32) << 16
}

/// HF-style inverse frequencies, base 10000.
fn inv_freq(head_dim: usize) -> Vec<f32> {
    (0..head_dim / 2).map(|i| 1.0 / 10000f32.powf(2.0 * i as f32 / head_dim as f32)).collect()
}

/// Tokens as (seq, pos): a fresh prefill, a chunk continuing a sequence already in pages, and a
/// decode step deep into a third, in scrambled order.
fn mixed_tokens(rng: &mut Rng, spans: &[(usize, std::ops::Range<usize>)]) -> Vec<(usize, usize)> {
    let mut t: Vec<(usize, usize)> = spans.iter().flat_map(|(s, r)| r.clone().map(move |p| (*s, p))).collect();
    rng.shuffle(&mut t);
    t
}

/// Columns `[from, from + width)` of every `stride`-wide row.
fn columns(x: &[f32], stride: usize, from: usize, width: usize) -> Vec<f32> {
    x.chunks(stride).flat_map(|r| r[from..from + width].iter().copied()).collect()
}

// ---------------------------------------------------------------------------------------------
// RoPE + KV-cache write.
// ---------------------------------------------------------------------------------------------

fn check_rope_kv(heads: Heads, page_size: usize, spans: &[(usize, std::ops::Range<usize>)], storage: Storage, seed: u64) {
    check_rope_kv_into(heads, page_size, spans, storage, seed, None)
}

/// [`check_rope_kv`] into the pool's pages, or into window rings (`ring`, whose page size
/// it takes).
fn check_rope_kv_into(
    heads: Heads,
    page_size: usize,
    spans: &[(usize, std::ops::Range<usize>)],
    storage: Storage,
    seed: u64,
    ring: Option<WindowRing>,
) {
    let ctx = gpu();
    let mut rng = Rng::new(seed);
    let Heads { n_heads, n_kv_heads, head_dim } = heads;
    let n_seqs = spans.iter().map(|s| s.0 + 1).max().unwrap();
    let n_positions = spans.iter().map(|s| s.1.end).max().unwrap() + 3;
    let mut paged = match ring {
        Some(r) => Paged::rings(&mut rng, heads, n_seqs, n_positions, r, storage),
        None => Paged::random(&mut rng, heads, n_seqs, n_positions, page_size, storage, 0),
    };
    let mut tokens = mixed_tokens(&mut rng, spans);
    let q4 = storage.dtype == KvDtype::Q4;
    if q4 {
        // The seal pass takes a sequence's tokens as consecutive rows, as steps lay them out;
        // the sequences start at their spans (earlier positions already cached).
        tokens.sort();
        let mut lens = vec![0; n_seqs];
        for (s, r) in spans {
            lens[*s] = r.start;
        }
        paged.set_lens(&lens);
    }
    let t = tokens.len();
    let stride = heads.qkv_dim() + 3; // padding the kernel must leave alone
    let qkv = rng.vec(t * stride);
    let positions: Vec<u32> = tokens.iter().map(|&(_, p)| p as u32).collect();
    let seqs: Vec<u32> = tokens.iter().map(|&(s, _)| s as u32).collect();
    let freq = inv_freq(head_dim);
    let what = format!(
        "rope_kv {n_heads}/{n_kv_heads} heads, head_dim {head_dim}, page {}, {t} tokens, {:?} KV in {} shard(s), ring {ring:?}",
        paged.page_size, storage.dtype, paged.layout.n_shards
    );

    let step = step_buffer(&ctx);
    let qkv_b = buf_f32(&ctx, "qkv", &qkv);
    let rope_b = buf_f32(&ctx, "rope", &rope_table(&freq, n_positions, 1.0));
    let pos_b = buf_u32(&ctx, "positions", &positions);
    let seq_b = buf_u32(&ctx, "token_seq", &seqs);
    let bt_b = buf_u32(&ctx, "block_table", &paged.gpu_table);
    let (k_b, v_b) = paged.upload(&ctx);
    let io = RopeKvIo {
        step: &step,
        qkv: &qkv_b,
        rope: &rope_b,
        positions: &pos_b,
        token_seq: &seq_b,
        block_table: &bt_b,
        kv: KvBinding { layout: &paged.layout, k: &k_b, v: &v_b },
    };
    let p = RopeKvParams {
        n_heads: n_heads as u32,
        n_kv_heads: n_kv_heads as u32,
        head_dim: head_dim as u32,
        qkv_stride: stride as u32,
        max_pages: paged.max_pages as u32,
        n_positions: n_positions as u32,
    };
    let mut d = block_on(kernels::rope_kv::build(&ctx, &io, p)).expect("build rope_kv");
    d.extend(block_on(kernels::rope_kv::build_tail(&ctx, &io, p)).expect("build the tail pass"));
    let passes = if q4 { 3 } else { 1 };
    assert_eq!(d.len(), passes * paged.layout.n_shards, "{what}: one dispatch per shard (and two seal passes per shard for q4)");
    submit(&ctx, &step, t as u32, t as u32, &d);
    let got_qkv = read_f32s(&ctx, &qkv_b, qkv.len());
    let mut lens_after = paged.lens.clone();
    for &(s, pos) in &tokens {
        lens_after[s] = lens_after[s].max(pos + 1);
    }
    if q4 {
        // Each sequence's first row in the step and its position, in every shard.
        for w in paged.read_words(&ctx, &k_b, true) {
            for (s, r) in spans {
                let first = tokens.iter().position(|&(ts, _)| ts == *s).unwrap();
                let at = paged.layout.tail_base() - 2 * (s + 1);
                assert_eq!((w[at] as usize, w[at + 1] as usize), (first, r.start), "{what}: step rows of sequence {s}");
            }
        }
    }
    let mut got_k = paged.read(&ctx, &k_b, true, &lens_after);
    let got_v = paged.read(&ctx, &v_b, false, &lens_after);

    let pos_usize: Vec<usize> = tokens.iter().map(|&(_, p)| p).collect();
    let q_rot = ops::rope(&columns(&qkv, stride, 0, heads.q_dim()), &pos_usize, n_heads, head_dim, &freq);
    let k_rot = ops::rope(&columns(&qkv, stride, heads.q_dim(), heads.kv_dim()), &pos_usize, n_kv_heads, head_dim, &freq);
    // q rotated in place (once, whatever the shard count; with q4 k too); v and the
    // padding untouched.
    let mut want_qkv = qkv.clone();
    for ti in 0..t {
        want_qkv[ti * stride..][..heads.q_dim()].copy_from_slice(&q_rot[ti * heads.q_dim()..][..heads.q_dim()]);
        if q4 {
            want_qkv[ti * stride + heads.q_dim()..][..heads.kv_dim()].copy_from_slice(&k_rot[ti * heads.kv_dim()..][..heads.kv_dim()]);
        }
    }
    assert_close(&format!("{what}: qkv (q rotated in place)"), &got_qkv, &want_qkv, ROPE_TOL);
    // k rotated and v copied into (page, slot) of each token in the cache's dtype; every
    // other cell untouched.
    for (ti, &(s, pos)) in tokens.iter().enumerate() {
        for kvh in 0..n_kv_heads {
            let a = paged.addr(s, pos, kvh);
            if !q4 {
                let k = round_trip(storage.dtype, &k_rot[ti * heads.kv_dim() + kvh * head_dim..][..head_dim]);
                paged.k[a..a + head_dim].copy_from_slice(&k);
            }
            let vb = ti * stride + heads.q_dim() + heads.kv_dim() + kvh * head_dim;
            paged.v[a..a + head_dim].copy_from_slice(&round_trip(storage.dtype, &qkv[vb..vb + head_dim]));
        }
    }
    if q4 {
        // Pages the step filled rounded per channel, the open ones in f16.
        paged.q4_step(&tokens, &k_rot);
        let mut want_k = std::mem::take(&mut paged.k);
        paged.mask_open(&mut want_k);
        paged.mask_open(&mut got_k);
        paged.k = want_k;
    }
    // f16: the GPU's rounding may differ by one ulp; q8: a code may differ by one where the
    // GPU's rotated value lands on the other side of a rounding boundary.
    let (k_tol, v_tol) = match storage.dtype {
        KvDtype::F32 => (ROPE_TOL, EXACT),
        KvDtype::F16 => (1e-3, 1e-3),
        // One code of a group whose values span at most 2.
        KvDtype::Q4 => (2.02 / 15.0, 2.02 / 15.0),
        _ => (1.01 / 127.0, 1.01 / 127.0),
    };
    assert_close(&format!("{what}: k cache"), &got_k, &paged.k, k_tol);
    assert_close(&format!("{what}: v cache"), &got_v, &paged.v, v_tol);
    if matches!(storage.dtype, KvDtype::Q8 | KvDtype::Q4) {
        // Mostly exact: a one-code slack must stay the exception.
        let off = got_k
            .iter()
            .chain(&got_v)
            .zip(paged.k.iter().chain(&paged.v))
            .filter(|(g, w)| (*g - *w).abs() > 1e-6 * w.abs().max(1.0))
            .count();
        let written = 2 * t * heads.kv_dim();
        assert!(off * 100 <= written, "{what}: {off} of {written} written values differ");
    }
}

#[test]
fn rope_kv_matches_reference_and_writes_the_right_slots() {
    let spans = [(0, 0..4), (1, 7..10), (2, 13..14)];
    let f32s = F32_ONE_SHARD;
    check_rope_kv(Heads { n_heads: 8, n_kv_heads: 2, head_dim: 8 }, 3, &spans, f32s, 500);
    check_rope_kv(Heads { n_heads: 4, n_kv_heads: 1, head_dim: 64 }, 5, &spans, f32s, 501);
    check_rope_kv(Heads { n_heads: 3, n_kv_heads: 3, head_dim: 6 }, 3, &spans, f32s, 502);
    check_rope_kv(Heads { n_heads: 2, n_kv_heads: 1, head_dim: 130 }, 5, &spans, f32s, 503);
    // A 33-token chunk continuing a sequence, beside a one-token decode of another.
    check_rope_kv(Heads { n_heads: 4, n_kv_heads: 2, head_dim: 16 }, 5, &[(1, 5..38), (0, 40..41)], f32s, 504);
}

#[test]
fn rope_kv_writes_f16_q8_and_q4_caches_split_across_shards() {
    let spans = [(0, 0..4), (1, 7..10), (2, 13..14)];
    for (i, dtype) in [KvDtype::F32, KvDtype::F16, KvDtype::Q8, KvDtype::Q4].into_iter().enumerate() {
        let seed = 510 + i as u64 * 10;
        check_rope_kv(Heads { n_heads: 9, n_kv_heads: 3, head_dim: 64 }, 5, &spans, Storage { dtype, pages_per_shard: None }, seed);
        check_rope_kv(Heads { n_heads: 8, n_kv_heads: 2, head_dim: 8 }, 3, &spans, Storage { dtype, pages_per_shard: Some(2) }, seed + 1);
        check_rope_kv(
            Heads { n_heads: 4, n_kv_heads: 2, head_dim: 16 },
            5,
            &[(1, 5..38), (0, 40..41)],
            Storage { dtype, pages_per_shard: Some(3) },
            seed + 2,
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Attention over the paged cache.
// ---------------------------------------------------------------------------------------------

fn attention_params(heads: Heads, paged: &Paged, qkv_stride: usize, out_stride: usize) -> AttentionParams {
    AttentionParams {
        n_heads: heads.n_heads as u32,
        n_kv_heads: heads.n_kv_heads as u32,
        head_dim: heads.head_dim as u32,
        qkv_stride: qkv_stride as u32,
        max_pages: paged.max_pages as u32,
        out_stride: out_stride as u32,
        scale: 1.0 / (heads.head_dim as f32).sqrt(),
        window: 0,
    }
}

/// One attention check: `storage` of the cache, key `splits` per token, `shared` prefix pages
/// between sequences 0 and 1.
struct AttentionCase<'a> {
    heads: Heads,
    page_size: usize,
    spans: &'a [(usize, std::ops::Range<usize>)],
    storage: Storage,
    splits: &'a [u32],
    shared: usize,
    seed: u64,
    /// Window rings instead of pool pages (and their window on the queries).
    ring: Option<WindowRing>,
}

fn check_attention(c: AttentionCase) {
    let ctx = gpu();
    let mut rng = Rng::new(c.seed);
    let heads = c.heads;
    let Heads { n_heads, n_kv_heads, head_dim } = heads;
    let n_seqs = c.spans.iter().map(|s| s.0 + 1).max().unwrap();
    let max_len = c.spans.iter().map(|s| s.1.end).max().unwrap() + 2;
    // Every cell random, including slots past each query's position: reading them is a bug.
    let paged = match c.ring {
        Some(r) => Paged::rings(&mut rng, heads, n_seqs, max_len, r, c.storage),
        None => Paged::random(&mut rng, heads, n_seqs, max_len, c.page_size, c.storage, c.shared),
    };
    let mut paged = paged;
    // Each sequence's length in this step (q4: pages past it are open, read from the tail).
    let mut lens = vec![0; n_seqs];
    for (s, r) in c.spans {
        lens[*s] = lens[*s].max(r.end);
    }
    paged.set_lens(&lens);
    let tokens = mixed_tokens(&mut rng, c.spans);
    let t = tokens.len();
    let stride = heads.qkv_dim();
    // Sharper-than-uniform scores so the softmax weights matter.
    let qkv: Vec<f32> = rng.vec(t * stride).iter().map(|v| v * 3.0).collect();
    let out_stride = heads.q_dim() + 2;
    let out0 = rng.vec(t * out_stride);
    let positions: Vec<u32> = tokens.iter().map(|&(_, p)| p as u32).collect();
    let seqs: Vec<u32> = tokens.iter().map(|&(s, _)| s as u32).collect();
    let what = format!(
        "attention {n_heads}/{n_kv_heads} heads, head_dim {head_dim}, page {}, {t} tokens, {:?} KV in {} shard(s), {} shared page(s)",
        c.page_size, c.storage.dtype, paged.layout.n_shards, c.shared
    );

    let step = step_buffer(&ctx);
    let qkv_b = buf_f32(&ctx, "qkv", &qkv);
    let pos_b = buf_u32(&ctx, "positions", &positions);
    let seq_b = buf_u32(&ctx, "token_seq", &seqs);
    let bt_b = buf_u32(&ctx, "block_table", &paged.gpu_table);
    let (k_b, v_b) = paged.upload(&ctx);
    let out_b = buf_f32(&ctx, "out", &out0);
    let mut p = attention_params(heads, &paged, stride, out_stride);
    p.window = c.ring.map_or(0, |r| r.window as u32);
    let max_splits = *c.splits.iter().max().unwrap() as usize;
    let part_bytes = kernels::attention::partials_bytes(&p, &paged.layout, t, max_splits).max(4);
    let partials = create_zeroed(&ctx, "partials", part_bytes).unwrap();
    let io = AttentionIo {
        step: &step,
        qkv: &qkv_b,
        positions: &pos_b,
        token_seq: &seq_b,
        block_table: &bt_b,
        kv: KvBinding { layout: &paged.layout, k: &k_b, v: &v_b },
        out: &out_b,
        partials: &partials,
    };
    // Both kernels: the workgroup one, and the subgroup one where it runs.
    let mut variants = vec![false];
    if kernels::attention::subgroup_fits(&ctx, &p) {
        variants.push(true);
    }
    let mut outs = Vec::new();
    for sub in variants {
        let d = block_on(kernels::attention::build_variant(&ctx, &io, p, sub)).unwrap_or_else(|e| panic!("{what}: build: {e}"));
        for &splits in c.splits {
            ctx.queue.write_buffer(&out_b, 0, bytemuck::cast_slice(&out0));
            let mut s = StepUniform::new(t as u32, t as u32);
            s.n_splits = splits;
            submit_step(&ctx, &step, &s, &d);
            outs.push((format!("{} with {splits} split(s)", d[0].label), read_f32s(&ctx, &out_b, out0.len())));
        }
    }

    let mut want = out0.clone();
    for (ti, &(s, pos)) in tokens.iter().enumerate() {
        let (k, v) = paged.gather(s, pos + 1);
        let q = &qkv[ti * stride..][..heads.q_dim()];
        let window = c.ring.map(|r| r.window);
        let o = ops::attention_windowed(q, &k, &v, &[pos], n_heads, n_kv_heads, head_dim, p.scale, window);
        want[ti * out_stride..][..heads.q_dim()].copy_from_slice(&o);
    }
    for (label, got) in outs {
        assert_close(&format!("{what} {label}"), &got, &want, ATTENTION_TOL);
    }
}

/// A fresh prefill, a chunk continuing 70 cached tokens (more than one 64-key chunk) and a
/// decode after 130 cached tokens.
const ATTENTION_SPANS: [(usize, std::ops::Range<usize>); 3] = [(0, 0..3), (1, 70..73), (2, 130..131)];

fn attention_case(heads: Heads, page_size: usize, seed: u64) -> AttentionCase<'static> {
    AttentionCase { heads, page_size, spans: &ATTENTION_SPANS, storage: F32_ONE_SHARD, splits: &[1], shared: 0, seed, ring: None }
}

#[test]
fn attention_gqa_matches_reference() {
    check_attention(attention_case(Heads { n_heads: 8, n_kv_heads: 2, head_dim: 8 }, 3, 600));
}

/// SmolLM2's layout (3 query heads per KV head) and a group of 6 (two head batches, the
/// second one partial).
#[test]
fn attention_gqa_groups_of_3_and_6_match_reference() {
    check_attention(attention_case(Heads { n_heads: 9, n_kv_heads: 3, head_dim: 64 }, 16, 605));
    check_attention(attention_case(Heads { n_heads: 12, n_kv_heads: 2, head_dim: 16 }, 7, 606));
}

#[test]
fn attention_mqa_matches_reference() {
    check_attention(attention_case(Heads { n_heads: 4, n_kv_heads: 1, head_dim: 64 }, 5, 601));
}

#[test]
fn attention_mha_matches_reference() {
    check_attention(attention_case(Heads { n_heads: 3, n_kv_heads: 3, head_dim: 10 }, 3, 602));
    check_attention(attention_case(Heads { n_heads: 2, n_kv_heads: 2, head_dim: 130 }, 5, 603));
}

#[test]
fn attention_head_dim_256_matches_reference() {
    check_attention(attention_case(Heads { n_heads: 2, n_kv_heads: 1, head_dim: 256 }, 5, 604));
}

/// Flash-decoding and the KV split across buffers: keys cut into 1, 2, 3 and 7 ranges per
/// token, pages spread over shards of 2 and 5 pages, ragged sequences sharing prefix pages,
/// page sizes that divide no length, in every KV dtype, through both kernels.
#[test]
fn paged_attention_splits_shards_shared_prefixes_and_kv_dtypes_match_reference() {
    // Sequence 1 shares its first pages with sequence 0 (a common prompt), and a decode and a
    // chunk of each run beside a third sequence.
    let spans: [(usize, std::ops::Range<usize>); 4] = [(0, 40..41), (1, 25..29), (2, 0..5), (1, 60..61)];
    let mut seed = 620;
    for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::Q8, KvDtype::Q4] {
        for (heads, page_size, pages_per_shard) in [
            (Heads { n_heads: 9, n_kv_heads: 3, head_dim: 64 }, 7, Some(5)),
            (Heads { n_heads: 4, n_kv_heads: 1, head_dim: 32 }, 5, Some(2)),
            (Heads { n_heads: 6, n_kv_heads: 2, head_dim: 16 }, 3, None),
            // Pages of 16: q4's chunks of 8 keys inside one sealed page (scales folded into
            // q), beside the open page's and the step's own.
            (Heads { n_heads: 9, n_kv_heads: 3, head_dim: 64 }, 16, Some(2)),
        ] {
            seed += 1;
            check_attention(AttentionCase {
                heads,
                page_size,
                spans: &spans,
                storage: Storage { dtype, pages_per_shard },
                splits: &[1, 2, 3, 7],
                shared: if page_size == 16 { 1 } else { 3 },
                seed,
                ring: None,
            });
        }
    }
}

/// Sliding layers' window rings (`kv::ring`): keys found by the ring formula, never the
/// block table, for positions whose rings have wrapped many times, with key splits, rings
/// spread over shards and every KV dtype, through both kernels; and the KV writes land in
/// the ring slots.
#[test]
fn window_ring_attention_and_writes_match_reference() {
    // Chunks of up to 4 tokens, decodes deep into sequences, and a fresh prefill.
    let spans: [(usize, std::ops::Range<usize>); 4] = [(0, 40..41), (1, 25..29), (2, 0..3), (3, 97..98)];
    let mut seed = 660;
    for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::Q8, KvDtype::Q4] {
        for (heads, window, page_size, pages_per_shard) in [
            (Heads { n_heads: 9, n_kv_heads: 3, head_dim: 64 }, 9, 4, Some(5)),
            (Heads { n_heads: 4, n_kv_heads: 1, head_dim: 32 }, 5, 3, Some(2)),
            (Heads { n_heads: 6, n_kv_heads: 2, head_dim: 16 }, 12, 5, None),
        ] {
            seed += 1;
            let ring = WindowRing::new(window, 4, page_size);
            let storage = Storage { dtype, pages_per_shard };
            check_attention(AttentionCase {
                heads,
                page_size,
                spans: &spans,
                storage,
                splits: &[1, 2, 3],
                shared: 0,
                seed,
                ring: Some(ring),
            });
            check_rope_kv_into(heads, page_size, &spans, storage, seed, Some(ring));
        }
    }
}

#[test]
fn attention_rejects_head_dim_over_256() {
    let ctx = gpu();
    let heads = Heads { n_heads: 2, n_kv_heads: 1, head_dim: 258 };
    let mut rng = Rng::new(605);
    let paged = Paged::random(&mut rng, heads, 1, 4, 2, F32_ONE_SHARD, 0);
    let b = buf_f32(&ctx, "any", &[0.0; 4]);
    let kv = [buf_f32(&ctx, "kv", &[0.0; 4])];
    let io = AttentionIo {
        step: &b,
        qkv: &b,
        positions: &b,
        token_seq: &b,
        block_table: &b,
        kv: KvBinding { layout: &paged.layout, k: &kv, v: &kv },
        out: &b,
        partials: &b,
    };
    let r = block_on(kernels::attention::build(&ctx, &io, attention_params(heads, &paged, 1, 1)));
    assert!(matches!(r, Err(GpuError::Validation { .. })), "head_dim 258 accepted: {:?}", r.err());
}

/// The forward pass's order in one submission: rope_kv writes the new tokens into pages that
/// already hold a sequence's earlier tokens, then attention reads them (f32 and q8 caches,
/// two shards, keys split in two).
#[test]
fn rope_kv_then_attention_continue_a_paged_sequence() {
    for (dtype, pages_per_shard, splits) in [(KvDtype::F32, None, 1), (KvDtype::Q8, Some(3), 2), (KvDtype::Q4, Some(3), 2)] {
        let ctx = gpu();
        let mut rng = Rng::new(700);
        let heads = Heads { n_heads: 6, n_kv_heads: 2, head_dim: 16 };
        let Heads { n_heads, n_kv_heads, head_dim } = heads;
        let (page_size, cached, new) = (3, 11, 5);
        let n_positions = cached + new;
        let mut paged = Paged::random(&mut rng, heads, 2, n_positions, page_size, Storage { dtype, pages_per_shard }, 0);
        let seq = 1;
        paged.set_lens(&[0, cached]);
        let stride = heads.qkv_dim();
        let qkv = rng.vec(new * stride);
        let pos: Vec<usize> = (cached..cached + new).collect();
        let positions: Vec<u32> = pos.iter().map(|&p| p as u32).collect();
        let freq = inv_freq(head_dim);

        let step = step_buffer(&ctx);
        let qkv_b = buf_f32(&ctx, "qkv", &qkv);
        let rope_b = buf_f32(&ctx, "rope", &rope_table(&freq, n_positions, 1.0));
        let pos_b = buf_u32(&ctx, "positions", &positions);
        let seq_b = buf_u32(&ctx, "token_seq", &vec![seq as u32; new]);
        let bt_b = buf_u32(&ctx, "block_table", &paged.gpu_table);
        let (k_b, v_b) = paged.upload(&ctx);
        let kv = KvBinding { layout: &paged.layout, k: &k_b, v: &v_b };
        let out_b = create_zeroed(&ctx, "out", (new * heads.q_dim() * 4) as u64).unwrap();
        let rope_io = RopeKvIo { step: &step, qkv: &qkv_b, rope: &rope_b, positions: &pos_b, token_seq: &seq_b, block_table: &bt_b, kv };
        let rope_p = RopeKvParams {
            n_heads: n_heads as u32,
            n_kv_heads: n_kv_heads as u32,
            head_dim: head_dim as u32,
            qkv_stride: stride as u32,
            max_pages: paged.max_pages as u32,
            n_positions: n_positions as u32,
        };
        let mut d = block_on(kernels::rope_kv::build(&ctx, &rope_io, rope_p)).expect("build rope_kv");
        let p = attention_params(heads, &paged, stride, heads.q_dim());
        let partials = create_zeroed(&ctx, "partials", kernels::attention::partials_bytes(&p, &paged.layout, new, splits).max(4)).unwrap();
        let io = AttentionIo {
            step: &step,
            qkv: &qkv_b,
            positions: &pos_b,
            token_seq: &seq_b,
            block_table: &bt_b,
            kv,
            out: &out_b,
            partials: &partials,
        };
        d.extend(block_on(kernels::attention::build(&ctx, &io, p)).expect("build attention"));
        d.extend(block_on(kernels::rope_kv::build_tail(&ctx, &rope_io, rope_p)).expect("build the tail pass"));
        let mut s = StepUniform::new(new as u32, new as u32);
        s.n_splits = splits as u32;
        submit_step(&ctx, &step, &s, &d);
        let got = read_f32s(&ctx, &out_b, new * heads.q_dim());

        let q = ops::rope(&columns(&qkv, stride, 0, heads.q_dim()), &pos, n_heads, head_dim, &freq);
        let k_new = ops::rope(&columns(&qkv, stride, heads.q_dim(), heads.kv_dim()), &pos, n_kv_heads, head_dim, &freq);
        let v_new = columns(&qkv, stride, heads.q_dim() + heads.kv_dim(), heads.kv_dim());
        for (i, &ps) in pos.iter().enumerate() {
            for kvh in 0..n_kv_heads {
                let a = paged.addr(seq, ps, kvh);
                let h = i * heads.kv_dim() + kvh * head_dim..i * heads.kv_dim() + (kvh + 1) * head_dim;
                paged.v[a..a + head_dim].copy_from_slice(&round_trip(dtype, &v_new[h.clone()]));
                if dtype != KvDtype::Q4 {
                    paged.k[a..a + head_dim].copy_from_slice(&round_trip(dtype, &k_new[h]));
                }
            }
        }
        let (k_cached, _) = paged.gather(seq, cached);
        let (mut k, v) = paged.gather(seq, n_positions);
        if dtype == KvDtype::Q4 {
            // q4: the cached keys as they were before the step (the pages it seals hold its
            // own keys too), the step's keys exactly as rotated.
            k = k_cached.into_iter().chain(k_new.iter().copied()).collect();
        }
        let want = ops::attention(&q, &k, &v, &pos, n_heads, n_kv_heads, head_dim, p.scale);
        // q8, q4: a new key's code may differ by one from the CPU's (see check_rope_kv).
        let tol = match dtype {
            KvDtype::Q8 => 2e-2,
            KvDtype::Q4 => 1e-4,
            _ => ATTENTION_TOL,
        };
        assert_close(&format!("rope_kv + attention, 5 tokens after 11 cached, {dtype:?} KV"), &got, &want, tol);
    }
}

// ---------------------------------------------------------------------------------------------
// Constrained decoding's logit mask.
// ---------------------------------------------------------------------------------------------

/// GPU logit mask against `ops::logit_mask` (exact: values are copied or set to -inf), then
/// the GPU argmax of the masked rows: it must be an allowed token (the best one) whenever a
/// row allows any.
fn check_logit_mask(ctx: &Arc<GpuContext>, what: &str, logits: &[f32], mask: &[u32], n: usize) {
    let rows = logits.len() / n;
    let step = step_buffer(ctx);
    let lb = buf_f32(ctx, "logits", logits);
    let mb = buf_u32(ctx, "mask", mask);
    let out = create_zeroed(ctx, "argmax", (rows * 4) as u64).unwrap();
    let m = block_on(kernels::logit_mask::build(ctx, &step, &mb, &lb, n)).expect("build logit_mask");
    let db = create_zeroed(ctx, "row_draws", (rows * std::mem::size_of::<RowDraw>()) as u64).unwrap();
    let a = block_on(kernels::argmax::build(ctx, &step, &lb, &out, &db, n)).expect("build argmax");
    submit(ctx, &step, rows as u32, rows as u32, &[m, a]);
    let got = read_f32s(ctx, &lb, rows * n);
    let mut want = logits.to_vec();
    ops::logit_mask(&mut want, mask, n);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(g.to_bits() == w.to_bits(), "{what}: n {n}, row {} index {}: got {g}, want {w} (logit {})", i / n, i % n, logits[i]);
    }
    let best = read_u32s(ctx, &out, rows);
    let words = kernels::logit_mask::words(n);
    for (r, row) in want.chunks(n).enumerate() {
        let allowed = |i: u32| mask[r * words + i as usize / 32] & (1 << (i % 32)) != 0;
        if (0..n as u32).any(allowed) {
            assert!(allowed(best[r]), "{what}: n {n}, row {r}: argmax {} is masked out", best[r]);
            assert_eq!(best[r], ops::argmax(row), "{what}: n {n}, row {r}");
        }
    }
}

#[test]
fn logit_mask_matches_reference_on_odd_shapes() {
    let ctx = gpu();
    for (i, &(n, rows)) in [(1usize, 1usize), (31, 2), (32, 1), (33, 3), (1000, 2), (4099, 3), (49152, 1)].iter().enumerate() {
        let mut rng = Rng::new(1200 + i as u64);
        let logits = rng.vec(rows * n);
        let words = kernels::logit_mask::words(n);
        // Row 0 random bits, row 1 a sparse mask (one bit in 37), row 2 everything allowed.
        let mut mask = Vec::with_capacity(rows * words);
        for r in 0..rows {
            for w in 0..words {
                mask.push(match r {
                    0 => rng.next_u64() as u32,
                    1 => (0..32).filter(|b| (w * 32 + b) % 37 == 5).fold(0u32, |m, b| m | (1 << b)),
                    _ => u32::MAX,
                });
            }
        }
        check_logit_mask(&ctx, "random", &logits, &mask, n);
    }
}

/// A row that allows one token picks it whatever its logit; a row that allows nothing is all
/// -inf (argmax then gives 0, as on the CPU).
#[test]
fn logit_mask_single_allowed_token_and_empty_row() {
    let ctx = gpu();
    let n = 777;
    let words = kernels::logit_mask::words(n);
    let mut rng = Rng::new(1300);
    let mut logits = rng.vec(2 * n);
    logits[700] = -50.0;
    let mut mask = vec![0u32; 2 * words];
    mask[700 / 32] = 1 << (700 % 32);
    check_logit_mask(&ctx, "one allowed", &logits, &mask, n);
}

/// GPU logit bias against `ops::logit_bias` (exact: one f32 add per pair): rows with many
/// pairs (more than a workgroup strides over), a row without any, pairs at both ends of
/// the vocabulary; rows past the step's are left alone.
#[test]
fn logit_bias_matches_reference_on_odd_shapes() {
    let ctx = gpu();
    for (i, &(n, rows, max_rows)) in [(1usize, 1usize, 1usize), (33, 3, 4), (1000, 2, 2), (4099, 4, 8), (49152, 2, 3)].iter().enumerate() {
        let mut rng = Rng::new(1400 + i as u64);
        let logits = rng.vec(max_rows * n);
        let mut bias: Vec<Vec<(u32, f32)>> = Vec::new();
        for r in 0..rows {
            let want = match r % 3 {
                0 => n.min(150),
                1 => 0,
                _ => n.min(3),
            };
            let mut toks: Vec<u32> = (0..n as u32).collect();
            for k in 0..want {
                let j = k + rng.below(n - k);
                toks.swap(k, j);
            }
            let mut row: Vec<(u32, f32)> = toks[..want].iter().map(|&t| (t, 10.0 * rng.uniform())).collect();
            if want > 1 {
                row[0].0 = 0;
                row[1].0 = n as u32 - 1;
                row.sort_by_key(|p| p.0);
                row.dedup_by_key(|p| p.0);
            }
            bias.push(row);
        }
        let step = step_buffer(&ctx);
        let lb = buf_f32(&ctx, "logits", &logits);
        let bb = buf_u32(&ctx, "bias", &kernels::logit_bias::pack(&bias, max_rows));
        let d = block_on(kernels::logit_bias::build(&ctx, &step, &bb, &lb, n, max_rows)).expect("build logit_bias");
        submit(&ctx, &step, rows as u32, rows as u32, &[d]);
        let got = read_f32s(&ctx, &lb, max_rows * n);
        let mut want = logits.clone();
        ops::logit_bias(&mut want[..rows * n], n, &bias);
        for (k, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(g.to_bits() == w.to_bits(), "n {n}, row {} index {}: got {g}, want {w}", k / n, k % n);
        }
    }
}

/// GPU sampling from top-k rows (`kernels::sample`) draws what its f32 host mirror draws
/// (`sample::draw`), for every parameter shape, and each draw is one of the kept candidates:
/// the top-k rows come from the top-k kernel over random logits (some rows with fewer finite
/// values than the slots).
#[test]
fn sample_draws_match_the_host_mirror() {
    use lantern::kernels::sample::{draw, SampleParams};
    use lantern::kernels::topk::{decode_row, TOPK_MAX, TOPK_ROW_WORDS};
    let ctx = gpu();
    let (n, rows) = (300usize, 40usize);
    let mut rng = Rng::new(4242);
    let mut logits: Vec<f32> = rng.vec(n * rows).iter().map(|v| v * 4.0).collect();
    for v in &mut logits[n * 3..n * 4 - 20] {
        *v = f32::NEG_INFINITY; // row 3: 20 finite values
    }
    let step = step_buffer(&ctx);
    let lb = buf_f32(&ctx, "logits", &logits);
    let top = create_zeroed(&ctx, "topk", (rows * TOPK_ROW_WORDS * 4) as u64).unwrap();
    let topk = block_on(kernels::topk::build(&ctx, &step, &lb, &top, n, TOPK_MAX)).unwrap();
    let ids = create_zeroed(&ctx, "ids", (rows * 4) as u64).unwrap();
    submit(&ctx, &step, rows as u32, rows as u32, std::slice::from_ref(&topk));
    let words = read_u32s(&ctx, &top, rows * TOPK_ROW_WORDS);
    for (i, params) in [
        SampleParams { temperature: 0.8, top_k: 40, top_p: 0.95, _pad: 0 },
        SampleParams { temperature: 1.0, top_k: 0, top_p: 1.0, _pad: 0 },
        SampleParams { temperature: 0.2, top_k: 3, top_p: 0.5, _pad: 0 },
        SampleParams { temperature: 2.5, top_k: 64, top_p: 0.999, _pad: 0 },
    ]
    .into_iter()
    .enumerate()
    {
        let u: Vec<f32> = (0..rows).map(|r| ((r * 7919 + i * 104729) % 1000) as f32 / 1000.0).collect();
        let ub = buf_f32(&ctx, "u", &u);
        let pb = lantern::gpu::buffer::create_uniform(&ctx, "sample.params", &params);
        let d = block_on(kernels::sample::build(&ctx, &step, &pb, &top, &ub, &ids)).unwrap();
        submit(&ctx, &step, rows as u32, rows as u32, std::slice::from_ref(&d));
        let got = read_u32s(&ctx, &ids, rows);
        for r in 0..rows {
            let pairs = decode_row(&words[r * TOPK_ROW_WORDS..][..TOPK_ROW_WORDS], TOPK_MAX);
            let want = draw(&pairs, &params, u[r]);
            assert_eq!(got[r], want, "params {params:?}, row {r}, u {}", u[r]);
            let k = if params.top_k == 0 { TOPK_MAX } else { params.top_k as usize };
            assert!(pairs.iter().take(k).any(|p| p.0 == got[r]), "row {r}: {} is not among the top {k}", got[r]);
        }
    }
    // A negative number keeps the row's id (the argmax kernel's draw from the whole
    // vocabulary), and the other rows still draw.
    let params = SampleParams { temperature: 0.8, top_k: 40, top_p: 0.95, _pad: 0 };
    let u: Vec<f32> = (0..rows).map(|r| if r % 2 == 0 { -1.0 } else { (r as f32 * 0.37) % 1.0 }).collect();
    let (ub, pb) = (buf_f32(&ctx, "u", &u), lantern::gpu::buffer::create_uniform(&ctx, "sample.params", &params));
    let kept = buf_u32(&ctx, "ids", &vec![123_456; rows]);
    let d = block_on(kernels::sample::build(&ctx, &step, &pb, &top, &ub, &kept)).unwrap();
    submit(&ctx, &step, rows as u32, rows as u32, std::slice::from_ref(&d));
    for (r, got) in read_u32s(&ctx, &kept, rows).into_iter().enumerate() {
        let pairs = decode_row(&words[r * TOPK_ROW_WORDS..][..TOPK_ROW_WORDS], TOPK_MAX);
        let want = if r % 2 == 0 { 123_456 } else { draw(&pairs, &params, u[r]) };
        assert_eq!(got, want, "row {r}, u {}", u[r]);
    }
}

// ---------------------------------------------------------------------------------------------
// Mixture of experts: the router's top-k on the GPU against `ops::moe_route`, and the expert
// matvecs (reading only the routed experts of stacked weights), per pair and grouped by
// expert, against dequantize-then-multiply per token-expert pair.
// ---------------------------------------------------------------------------------------------

/// The route of `t` tokens' router logits (`t x n`), run on the GPU: (expert, weight) pairs.
fn gpu_route(ctx: &Arc<GpuContext>, logits: &[f32], n: usize, top_k: usize, renormalize: bool) -> (wgpu::Buffer, Vec<(u32, f32)>) {
    let t = logits.len() / n;
    let step = step_buffer(ctx);
    let lb = buf_f32(ctx, "router_logits", logits);
    let route = create_zeroed(ctx, "route", (t * top_k * kernels::moe::ROUTE_BYTES) as u64).unwrap();
    let d = block_on(kernels::moe::route(ctx, &step, &lb, &route, n, top_k, renormalize)).expect("route");
    submit(ctx, &step, t as u32, 0, &[d]);
    let raw = read_u32s(ctx, &route, 2 * t * top_k);
    (route, raw.chunks_exact(2).map(|p| (p[0], f32::from_bits(p[1]))).collect())
}

#[test]
fn moe_route_matches_reference() {
    let ctx = gpu();
    let mut rng = Rng::new(71);
    // (experts, top_k, tokens, renormalize): one expert, all experts, Qwen3-30B-A3B's 8 of 128.
    for &(n, k, t, renorm) in &[(8, 1, 3, false), (8, 2, 5, true), (8, 8, 2, true), (6, 3, 7, false), (128, 8, 4, true), (60, 4, 9, false)]
    {
        let mut logits: Vec<f32> = rng.vec(t * n).iter().map(|v| 3.0 * v).collect();
        // A tie for first place in token 0: the lower index wins.
        logits[n - 1] = 5.0;
        logits[1] = 5.0;
        let (_, got) = gpu_route(&ctx, &logits, n, k, renorm);
        for (ti, z) in logits.chunks_exact(n).enumerate() {
            let want = ops::moe_route(z, k, renorm);
            for (j, &(e, w)) in want.iter().enumerate() {
                let (ge, gw) = got[ti * k + j];
                assert_eq!(ge as usize, e, "n {n} k {k}: token {ti} pick {j}");
                assert!((gw as f64 - w).abs() <= 1e-6, "n {n} k {k}: token {ti} pick {j} weight {gw} vs {w}");
            }
        }
        assert_eq!((got[0].0, got.get(1).map(|g| g.0).filter(|_| k > 1)), (1, (k > 1).then_some(n as u32 - 1)), "tie order");
    }
    // Bad shapes are typed errors.
    let step = step_buffer(&ctx);
    let b = buf_f32(&ctx, "x", &[0.0; 8]);
    assert!(matches!(block_on(kernels::moe::route(&ctx, &step, &b, &b, 4, 5, true)), Err(GpuError::Validation { .. })));
    assert!(matches!(block_on(kernels::moe::route(&ctx, &step, &b, &b, 4, 0, true)), Err(GpuError::Validation { .. })));
}

/// One expert-matvec case, `shape` = (n, top_k, t, rows, d): `n` experts of `rows` x `d`
/// (gate, up) and `d` x `rows` (down) in `format`, `top_k` per token, `t` tokens.
fn check_experts(ctx: &Arc<GpuContext>, seed: u64, shape: (usize, usize, usize, usize, usize), format: WeightFormat, group: u32) {
    let (n, top_k, t, rows, d) = shape;
    let mut rng = Rng::new(seed);
    let what = format!("experts {n} x ({rows} x {d}) {} top-{top_k}, {t} tokens", format.name());
    let x = rng.vec(t * d);
    let g: Vec<f32> = rng.vec(d).iter().map(|v| 1.0 + 0.2 * v).collect();
    let y0 = rng.vec(t * d);
    let logits: Vec<f32> = rng.vec(t * n).iter().map(|v| 2.0 * v).collect();
    let gate = HostWeight::random(&mut rng, n * rows, d, format, group);
    let up = HostWeight::random(&mut rng, n * rows, d, format, group);
    let down = HostWeight::random(&mut rng, n * d, rows, format, group);
    let gate_up = GpuLinear::upload_with(ctx, "experts.gate_up", gate.matrix(), Some(up.matrix()), None, n * rows, d, false).unwrap();
    let down_l = GpuLinear::upload_with(ctx, "experts.down", down.matrix(), None, None, n * d, rows, false).unwrap();
    // The oracle.
    let normed = ops::rmsnorm(&x, &g, EPS);
    let mut want_act = Vec::new();
    let mut want_y = y0.clone();
    let mut used = vec![false; n];
    for ti in 0..t {
        let nt = &normed[ti * d..(ti + 1) * d];
        for (e, w) in ops::moe_route(&logits[ti * n..(ti + 1) * n], top_k, true) {
            used[e] = true;
            let a = ops::linear(nt, &gate.values[e * rows * d..(e + 1) * rows * d], None, d, rows);
            let b = ops::linear(nt, &up.values[e * rows * d..(e + 1) * rows * d], None, d, rows);
            let act = ops::silu_mul(&a, &b);
            let out = ops::linear(&act, &down.values[e * d * rows..(e + 1) * d * rows], None, rows, d);
            for (yv, o) in want_y[ti * d..(ti + 1) * d].iter_mut().zip(&out) {
                *yv += (w as f32) * o;
            }
            want_act.extend(act);
        }
    }
    if t * top_k < n {
        assert!(used.iter().any(|u| !u), "{what}: some expert gets no token");
    }
    let sgs: &[bool] = if ctx.caps.subgroups { &[false, true] } else { &[false] };
    let mut multi_runs = 0;
    for (sg, multi) in sgs.iter().flat_map(|&sg| [(sg, false), (sg, true)]) {
        let (route, _) = gpu_route(ctx, &logits, n, top_k, true);
        let step = step_buffer(ctx);
        let xb = buf_f32(ctx, "x", &x);
        let gb = buf_f32(ctx, "norm", &g);
        let act = create_zeroed(ctx, "act", (t * top_k * rows * 4) as u64).unwrap();
        let y = buf_f32(ctx, "y", &y0);
        let io = kernels::moe::ExpertIo {
            step: &step,
            x: &xb,
            x_stride: d,
            norm: Some(&gb),
            eps: EPS,
            route: &route,
            top_k,
            y: &act,
            out_stride: rows,
            residual: false,
        };
        let io2 = kernels::moe::ExpertIo { x: &act, x_stride: rows, norm: None, y: &y, out_stride: d, residual: true, ..io };
        let fits = kernels::moe::multi_fits(&gate_up, &io) && kernels::moe::multi_fits(&down_l, &io2);
        if multi && !fits {
            // Refused, with the reason, rather than read wrong.
            let e = block_on(kernels::moe::experts_with(ctx, &gate_up, n, &io, sg, true)).err();
            assert!(e.is_some() || kernels::moe::multi_fits(&gate_up, &io), "{what}: MULTI_ROW where it does not fit");
            continue;
        }
        multi_runs += multi as usize;
        let d1 = block_on(kernels::moe::experts_with(ctx, &gate_up, n, &io, sg, multi)).expect("gate|up");
        let d2 = block_on(kernels::moe::experts_with(ctx, &down_l, n, &io2, sg, multi)).expect("down");
        submit(ctx, &step, t as u32, 0, &[d1, d2]);
        let how = format!("subgroups {sg}, {}", if multi { "multi-row" } else { "row per workgroup" });
        assert_close(&format!("{what} ({how}): act"), &read_f32s(ctx, &act, t * top_k * rows), &want_act, LINEAR_TOL);
        assert_close(&format!("{what} ({how}): y"), &read_f32s(ctx, &y, t * d), &want_y, LINEAR_TOL);
    }
    let whole_units = format.is_packed() && group.is_multiple_of(16) && rows.is_multiple_of(16) && d.is_multiple_of(16);
    assert_eq!(multi_runs > 0, whole_units, "{what}: the MULTI_ROW layout runs exactly where its units fit");
    // Grouped by expert (prefill): the grouping, gate|up and down over its work items, and
    // the sum of each token's pair rows into y; buffers sized for more tokens than the step.
    let (route, _) = gpu_route(ctx, &logits, n, top_k, true);
    let step = step_buffer(ctx);
    let (gb, wb) = kernels::moe::group_bytes(t + 5, top_k, n);
    let groups = create_zeroed(ctx, "groups", gb).unwrap();
    let work = create_zeroed(ctx, "work", wb).unwrap();
    let xb = buf_f32(ctx, "x", &x);
    let gbuf = buf_f32(ctx, "norm", &g);
    let act = create_zeroed(ctx, "act", (t * top_k * rows * 4) as u64).unwrap();
    let pairs = create_zeroed(ctx, "pairs", (t * top_k * d * 4) as u64).unwrap();
    let y = buf_f32(ctx, "y", &y0);
    let io = kernels::moe::ExpertIo {
        step: &step,
        x: &xb,
        x_stride: d,
        norm: Some(&gbuf),
        eps: EPS,
        route: &route,
        top_k,
        y: &act,
        out_stride: rows,
        residual: false,
    };
    let io2 = kernels::moe::ExpertIo { x: &act, x_stride: rows, norm: None, y: &pairs, out_stride: d, ..io };
    let grouping = kernels::moe::Grouping { groups: &groups, work: &work, max_tokens: t + 5 };
    let ds = vec![
        block_on(kernels::moe::group(ctx, &step, &route, &grouping, n, top_k)).expect("group"),
        block_on(kernels::moe::grouped(ctx, &gate_up, n, &io, &grouping)).expect("grouped gate|up"),
        block_on(kernels::moe::grouped(ctx, &down_l, n, &io2, &grouping)).expect("grouped down"),
        block_on(kernels::moe::combine(ctx, &step, &pairs, &y, d, top_k, true)).expect("combine"),
    ];
    submit(ctx, &step, t as u32, 0, &ds);
    assert_close(&format!("{what} (grouped): act"), &read_f32s(ctx, &act, t * top_k * rows), &want_act, LINEAR_TOL);
    assert_close(&format!("{what} (grouped): y"), &read_f32s(ctx, &y, t * d), &want_y, LINEAR_TOL);
    // Every pair sits in its expert's group, once; the work items cover the groups in order.
    let sorted = read_u32s(ctx, &groups, t * top_k);
    let mut seen = sorted.clone();
    seen.sort_unstable();
    assert_eq!(seen, (0..(t * top_k) as u32).collect::<Vec<_>>(), "{what}: grouped pairs");
    let items = read_u32s(ctx, &work, 4 * kernels::moe::work_items(t + 5, top_k, n));
    let mut at = 0;
    for it in items.chunks_exact(4).filter(|i| i[2] > 0) {
        assert_eq!(it[1] as usize, at, "{what}: work items are contiguous");
        for &pr in &sorted[at..at + it[2] as usize] {
            assert_eq!(ops::moe_route(&logits[(pr as usize / top_k) * n..][..n], top_k, true)[pr as usize % top_k].0, it[0] as usize);
        }
        at += it[2] as usize;
    }
    assert_eq!(at, t * top_k, "{what}: work items cover every pair");
}

#[test]
fn moe_experts_match_reference_in_every_format() {
    let ctx = gpu();
    // (experts, top_k, tokens, expert rows, hidden): one pick per token; 2 of 8; every expert
    // for every token; 3 of 6 for 7 tokens; and tokens few enough that experts go unused.
    // Prefill-sized steps: experts with several work items of pairs.
    let shapes = [
        (4, 1, 3, 24, 64),
        (8, 2, 5, 40, 72),
        (8, 8, 2, 16, 64),
        (6, 3, 7, 48, 96),
        (16, 2, 3, 32, 64),
        (4, 2, 21, 24, 64),
        (8, 1, 40, 16, 64),
    ];
    for (i, &shape) in shapes.iter().enumerate() {
        for format in [
            WeightFormat::F32,
            WeightFormat::F16,
            WeightFormat::Packed(QuantKind::Q8),
            WeightFormat::Packed(QuantKind::Q4),
            WeightFormat::Packed(QuantKind::Q4Sym),
        ] {
            check_experts(&ctx, 80 + i as u64, shape, format, 8);
        }
        // Groups of 16: the MULTI_ROW layout where rows and hidden are whole units.
        if shape.3.is_multiple_of(16) && shape.4.is_multiple_of(16) {
            for kind in [QuantKind::Q8, QuantKind::Q4, QuantKind::Q4Sym] {
                check_experts(&ctx, 100 + i as u64, shape, WeightFormat::Packed(kind), 16);
            }
        }
        // Q3 and the 2:4 kinds (groups of 32): both layouts where the rows and hidden are
        // whole groups.
        if shape.3.is_multiple_of(32) && shape.4.is_multiple_of(32) {
            for kind in [QuantKind::Q3, QuantKind::S24Q4, QuantKind::S24Q8] {
                check_experts(&ctx, 110 + i as u64, shape, WeightFormat::Packed(kind), 32);
            }
        }
    }
    // Every other packed format on rows of whole super-blocks.
    for format in WeightFormat::packed() {
        check_experts(&ctx, 90, (3, 2, 3, 256, 256), format, 32);
    }
}

#[test]
fn moe_experts_refuse_what_they_cannot_read() {
    let ctx = gpu();
    let mut rng = Rng::new(5);
    let step = step_buffer(&ctx);
    let b = buf_f32(&ctx, "b", &[0.0; 64]);
    let io = kernels::moe::ExpertIo {
        step: &step,
        x: &b,
        x_stride: 12,
        norm: None,
        eps: EPS,
        route: &b,
        top_k: 2,
        y: &b,
        out_stride: 12,
        residual: true,
    };
    // k not a multiple of 8.
    let w = HostWeight::random(&mut rng, 4 * 12, 12, WeightFormat::F32, 8);
    let lin = GpuLinear::upload_with(&ctx, "odd", w.matrix(), None, None, 4 * 12, 12, false).unwrap();
    let e = block_on(kernels::moe::experts(&ctx, &lin, 4, &io)).err().expect("k = 12 refused");
    assert!(e.to_string().contains("multiple of 8"), "{e}");
    // Rows not a whole number of experts; more picks than experts.
    let w = HostWeight::random(&mut rng, 4 * 16, 16, WeightFormat::F32, 8);
    let lin = GpuLinear::upload_with(&ctx, "rows", w.matrix(), None, None, 4 * 16, 16, false).unwrap();
    let e = block_on(kernels::moe::experts(&ctx, &lin, 3, &io)).err().expect("64 rows are not 3 experts");
    assert!(e.to_string().contains("3 experts"), "{e}");
    let e = block_on(kernels::moe::experts(&ctx, &lin, 1, &io)).err().expect("2 picks of 1 expert");
    assert!(e.to_string().contains("experts per token"), "{e}");
    // Stacked experts over more than one binding.
    let small = gpu_small();
    let w = HostWeight::random(&mut rng, 8 * 64, 64, WeightFormat::F32, 8);
    let lin = GpuLinear::upload_with(&small, "big", w.matrix(), None, None, 8 * 64, 64, false).unwrap();
    let step_s = step_buffer(&small);
    let bs = buf_f32(&small, "b", &[0.0; 64]);
    let io_s = kernels::moe::ExpertIo { step: &step_s, x: &bs, route: &bs, y: &bs, ..io };
    let e = block_on(kernels::moe::experts(&small, &lin, 8, &io_s)).err().expect("split experts refused");
    assert!(e.to_string().contains("max_storage_buffer_binding_size"), "{e}");
    // The grouping: more experts than its workgroup counts, and buffers too small for the
    // steps it is built for.
    let (gb, wb) = kernels::moe::group_bytes(16, 2, 8);
    let (groups, work) = (create_zeroed(&ctx, "groups", gb).unwrap(), create_zeroed(&ctx, "work", wb).unwrap());
    let g = kernels::moe::Grouping { groups: &groups, work: &work, max_tokens: 16 };
    assert!(block_on(kernels::moe::group(&ctx, &step, &b, &g, 8, 2)).is_ok());
    let e = block_on(kernels::moe::group(&ctx, &step, &b, &g, 600, 2)).err().expect("600 experts refused");
    assert!(e.to_string().contains("512"), "{e}");
    let g = kernels::moe::Grouping { max_tokens: 17, ..g };
    let e = block_on(kernels::moe::group(&ctx, &step, &b, &g, 8, 2)).err().expect("17 tokens do not fit");
    assert!(e.to_string().contains("17 tokens"), "{e}");
}

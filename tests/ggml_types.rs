//! Every GGUF weight type Lantern loads, end to end on the GPU: the ggml-types fixture
//! (`tests/fixtures/ggml-types`: one tiny Llama quantized by llama.cpp's `llama-quantize
//! --pure` to each single type, MXFP4 by gguf-py, with transformers' float32 logits from the
//! dequantized weights) run in every kernel layout the runtime has (forced with `gpu::KernelOptions` on the
//! context), with weights split across small bindings too. Per type and layout: the logits of every
//! position within the fixture's bound (1e-4 x the row's max |logit|), in one prefill step
//! (matmul kernels) and in chunks of 8 (the batched matvec; chunks of 4 with small
//! bindings), and the 16 greedy tokens through the paged cache (decode matvec).

mod common;

use std::path::PathBuf;

use lantern::gpu::{DeviceOptions, KernelOptions, MatmulLayout, MatvecLayout};
use lantern::model::forward::{GpuModel, ModelOptions, Want};
use lantern::model::load::load_path;

const TYPES: [&str; 13] = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "MXFP4"];

/// The fixture's bound: per position row, 1e-4 of the row's largest |logit|.
const REL_TOL: f32 = 1e-4;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/ggml-types")
}

/// A kernel layout: the kernel choices that force it, and the binding limit.
struct Layout {
    name: &'static str,
    kernels: KernelOptions,
    binding: Option<u64>,
}

const DEFAULT: KernelOptions =
    KernelOptions { matvec: None, matmul: None, xbcast: true, weight_textures: true, uniform_x: true, x_textures: true, f16_dequant: true };
const GPU_MULTIROW: KernelOptions = KernelOptions { matvec: Some(MatvecLayout::MultiRow), matmul: Some(MatmulLayout::Tiled), ..DEFAULT };

const LAYOUTS: [Layout; 7] = [
    // CPU adapters' defaults: texture matvec (TEX, TOK8 for chunks), blocked matmul with x
    // broadcast.
    Layout { name: "default", kernels: DEFAULT, binding: None },
    Layout { name: "default, 16 KiB bindings", kernels: DEFAULT, binding: Some(16 * 1024) },
    // Storage-read matvec with x broadcast (no texture copies).
    Layout { name: "rows4 xbcast", kernels: KernelOptions { weight_textures: false, ..DEFAULT }, binding: None },
    // No subgroups: plain ROWS4 matvec and blocked matmul (SwiftShader's kernels).
    Layout { name: "rows4, blocked", kernels: KernelOptions { xbcast: false, ..DEFAULT }, binding: None },
    // The GPU kernels: two rows per workgroup in 16-element units (MULTI_ROW, the GPU
    // default), a workgroup per row, and the tiled matmul.
    Layout { name: "multirow, tiled", kernels: GPU_MULTIROW, binding: None },
    Layout { name: "multirow, tiled, 16 KiB bindings", kernels: GPU_MULTIROW, binding: Some(16 * 1024) },
    Layout {
        name: "wg64, tiled",
        kernels: KernelOptions { matvec: Some(MatvecLayout::Wg64), matmul: Some(MatmulLayout::Tiled), ..DEFAULT },
        binding: None,
    },
];

/// Worst per-row relative error of `got` against `want` (rows of `vocab`): (ratio, position).
fn worst_row_error(got: &[f32], want: &[f32], vocab: usize) -> (f32, usize, f32) {
    assert_eq!(got.len(), want.len());
    let mut worst = (0.0f32, 0usize, 0.0f32);
    for (r, (g, w)) in got.chunks_exact(vocab).zip(want.chunks_exact(vocab)).enumerate() {
        let scale = w.iter().fold(0f32, |a, v| a.max(v.abs()));
        let d = g.iter().zip(w).fold(0f32, |a, (x, y)| if (x - y).is_nan() { f32::INFINITY } else { a.max((x - y).abs()) });
        if d / scale > worst.0 || d.is_infinite() {
            worst = (d / scale, r, d);
        }
    }
    worst
}

/// Every type in `LAYOUTS[i]`. One test per layout, so the test threads compile their
/// pipelines side by side (on lavapipe, compiling them is most of this file's time).
fn every_ggml_type_matches_the_reference_in(i: usize) {
    let reference = common::read_json(&dir().join("reference.json"));
    // MXFP4's file and references were made with gguf-py and transformers (make_mxfp4.py),
    // not llama-quantize, so they are recorded beside the copied reference.json.
    let mxfp4 = common::read_json(&dir().join("mxfp4.json"));
    let input = common::ids(&reference["input_ids"]);
    let mut report = Vec::new();
    {
        let layout = &LAYOUTS[i];
        let ctx = common::gpu_with(&DeviceOptions { max_binding_size: layout.binding, kernels: layout.kernels, ..Default::default() });
        for ty in TYPES {
            let r = if ty == "MXFP4" { &mxfp4 } else { &reference["types"][ty] };
            let what = format!("{ty} [{}]", layout.name);
            let loaded = load_path(&dir().join(format!("tiny-{ty}.gguf"))).unwrap_or_else(|e| panic!("{what}: load: {e}"));
            let w = &loaded.weights;
            let vocab = w.config.vocab_size;
            let want = common::read_f32(&dir().join(format!("{ty}.logits.f32")));
            // Prefill in chunks of 8 (the batched matvec on CPU adapters), then in one step;
            // with small bindings in chunks of 4 (the workspace must fit them too).
            let chunks: &[usize] = if layout.binding.is_some() { &[4] } else { &[8, 32] };
            for &chunk in chunks {
                let opts = ModelOptions { context: Some(64), max_batch_tokens: chunk, max_logit_rows: chunk, ..Default::default() };
                let mut m = pollster::block_on(GpuModel::load(ctx.clone(), w, opts)).unwrap_or_else(|e| panic!("{what}: GPU load: {e}"));
                let seq = m.new_sequence().unwrap();
                let got = pollster::block_on(m.forward_all_logits(seq, &input)).unwrap_or_else(|e| panic!("{what}: forward: {e}"));
                let (rel, pos, abs) = worst_row_error(&got, &want, vocab);
                assert!(
                    rel <= REL_TOL,
                    "{what}, chunks of {chunk}: position {pos} off by {abs:e} ({rel:e} of the row's max |logit|, bound {REL_TOL:e})"
                );
                report.push(format!("{what} chunks {chunk}: worst {rel:.2e} of max |logit|"));
                m.release_sequence(seq);
                if chunk == *chunks.last().unwrap() {
                    // Greedy through the paged cache.
                    let greedy = common::ids(&r["greedy_ids"]);
                    let seq = m.new_sequence().unwrap();
                    let mut out = vec![pollster::block_on(m.forward(seq, &input, Want::Argmax)).unwrap().argmax[0]];
                    while out.len() < greedy.len() {
                        let t = *out.last().unwrap();
                        out.push(pollster::block_on(m.forward(seq, &[t], Want::Argmax)).unwrap().argmax[0]);
                    }
                    assert_eq!(out, greedy, "{what}: greedy ids");
                }
            }
        }
    }
    for line in report {
        eprintln!("{line}");
    }
}

macro_rules! layout_tests {
    ($($name:ident => $i:expr),* $(,)?) => {$(
        #[test]
        fn $name() {
            every_ggml_type_matches_the_reference_in($i);
        }
    )*};
}

layout_tests! {
    every_ggml_type_in_the_default_layout => 0,
    every_ggml_type_in_the_default_layout_with_16_kib_bindings => 1,
    every_ggml_type_in_rows4_xbcast => 2,
    every_ggml_type_in_rows4_blocked => 3,
    every_ggml_type_in_multirow_tiled => 4,
    every_ggml_type_in_multirow_tiled_with_16_kib_bindings => 5,
    every_ggml_type_in_wg64_tiled => 6,
}

#[test]
fn the_layout_tests_cover_every_layout() {
    // layout_tests! above names one test per entry of LAYOUTS.
    assert_eq!(LAYOUTS.len(), 7);
}

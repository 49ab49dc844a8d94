//! The GPU forward pass against the CPU reference forward pass (f64 accumulation) on seeded
//! random models with shapes the fixtures do not cover: widths that are not multiples of any
//! tile size, GQA/MQA/MHA, q/k/v biases, tied and untied heads, f16 weights, Llama 3 RoPE
//! scaling, Gemma 3's block (sandwich norms, q/k norms, GELU-tanh, scaled embedding, sliding
//! window layers with their own RoPE base), and prompts processed in uneven chunks through
//! pages of odd size.

mod common;

use common::random::{random_model, Rng, Spec};
use lantern::model::llama::{GpuModel, ModelOptions};
use lantern::reference::ReferenceModel;

const TOL: f32 = 2e-4;

fn check(s: Spec, tokens: usize, opts: ModelOptions) {
    let w = random_model(s);
    let reference = ReferenceModel::new(&w).expect("reference model");
    let mut rng = Rng(s.seed + 99);
    let ids: Vec<u32> = (0..tokens).map(|_| rng.below(s.vocab) as u32).collect();
    let want = reference.forward(&ids);
    let mut m = pollster::block_on(GpuModel::load(common::gpu(), &w, opts)).expect("load");
    let seq = m.new_sequence().unwrap();
    let got = pollster::block_on(m.forward_all_logits(seq, &ids)).expect("forward");
    let scale = want.iter().fold(0.0f32, |a, &b| a.max(b.abs())).max(1.0);
    let (mut worst, mut wi) = (0.0f32, 0);
    for (i, (a, b)) in got.iter().zip(&want).enumerate() {
        if (a - b).abs() > worst {
            worst = (a - b).abs();
            wi = i;
        }
    }
    assert!(
        worst <= TOL * scale,
        "seed {}: max |diff| {worst:e} (scale {scale}) at position {} token {}: got {} want {}",
        s.seed,
        wi / s.vocab,
        wi % s.vocab,
        got[wi],
        want[wi]
    );
}

const BASE: Spec = Spec {
    seed: 1,
    vocab: 97,
    hidden: 40,
    ffn: 72,
    layers: 2,
    heads: 5,
    kv_heads: 1,
    head_dim: 8,
    bias: false,
    tied: false,
    f16: false,
    llama3: false,
    gemma: false,
};

#[test]
fn odd_widths_mqa_in_uneven_chunks() {
    let opts = ModelOptions { context: Some(64), page_size: 5, max_batch_tokens: 7, max_logit_rows: 7, ..Default::default() };
    check(BASE, 23, opts);
}

#[test]
fn gqa_with_biases_and_tied_head() {
    let s = Spec { seed: 2, vocab: 301, hidden: 96, ffn: 200, heads: 4, kv_heads: 2, head_dim: 24, bias: true, tied: true, ..BASE };
    check(s, 19, ModelOptions { context: Some(40), page_size: 3, ..Default::default() });
}

#[test]
fn mha_with_f16_weights_and_llama3_rope() {
    let s = Spec { seed: 3, vocab: 130, hidden: 64, ffn: 130, heads: 4, kv_heads: 4, head_dim: 16, f16: true, llama3: true, ..BASE };
    check(s, 70, ModelOptions { context: Some(96), page_size: 16, max_batch_tokens: 33, max_logit_rows: 33, ..Default::default() });
}

#[test]
fn large_head_dim_and_single_token_steps() {
    let s = Spec { seed: 4, vocab: 50, hidden: 128, ffn: 96, heads: 2, kv_heads: 1, head_dim: 128, ..BASE };
    check(s, 9, ModelOptions { context: Some(16), page_size: 2, max_batch_tokens: 1, max_logit_rows: 1, ..Default::default() });
}

#[test]
fn f16_weight_storage_stays_close_to_the_f32_reference() {
    // WeightPrecision::F16 rounds f32 weights to f16 at upload: logits move by about the
    // f16 rounding of the weights, far less than the gaps between top tokens here.
    use lantern::model::llama::WeightPrecision;
    let s = Spec { seed: 5, vocab: 200, hidden: 64, ffn: 96, heads: 4, kv_heads: 2, head_dim: 16, ..BASE };
    let w = random_model(s);
    let want = ReferenceModel::new(&w).unwrap().forward(&[3, 14, 15, 92, 65, 35]);
    let mut m = pollster::block_on(GpuModel::load(
        common::gpu(),
        &w,
        ModelOptions { context: Some(16), weights: WeightPrecision::F16, ..Default::default() },
    ))
    .unwrap();
    let seq = m.new_sequence().unwrap();
    let got = pollster::block_on(m.forward_all_logits(seq, &[3, 14, 15, 92, 65, 35])).unwrap();
    let scale = want.iter().fold(0.0f32, |a, &b| a.max(b.abs())).max(1.0);
    let worst = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    assert!(worst <= 5e-3 * scale, "f16 storage moved logits by {worst} (scale {scale})");
    assert!(worst > 0.0, "f16 rounding should be visible: was the F16 path taken?");
    let f32_model = pollster::block_on(GpuModel::load(
        common::gpu(),
        &w,
        ModelOptions { context: Some(16), weights: WeightPrecision::F32, ..Default::default() },
    ))
    .unwrap();
    assert!(
        (m.weight_bytes() as f64) < 0.6 * f32_model.weight_bytes() as f64,
        "f16 storage should about halve the weight bytes: {} vs {}",
        m.weight_bytes(),
        f32_model.weight_bytes()
    );
}

#[test]
fn gemma_block_with_windows_in_uneven_chunks() {
    // 23 tokens through a 5-key window: chunks of 7 and pages of 3 cut across it.
    let s =
        Spec { seed: 6, vocab: 120, hidden: 48, ffn: 80, layers: 3, heads: 4, kv_heads: 2, head_dim: 16, tied: true, gemma: true, ..BASE };
    check(s, 23, ModelOptions { context: Some(32), page_size: 3, max_batch_tokens: 7, max_logit_rows: 7, ..Default::default() });
}

#[test]
fn gemma_block_decoding_token_by_token_with_split_keys() {
    // Single-token steps (the decode kernels) with each token's keys cut into ranges of 2:
    // most ranges of a windowed layer are empty and must not count.
    let s =
        Spec { seed: 7, vocab: 90, hidden: 64, ffn: 96, layers: 2, heads: 2, kv_heads: 1, head_dim: 32, f16: true, gemma: true, ..BASE };
    let opts = ModelOptions {
        context: Some(24),
        page_size: 4,
        max_batch_tokens: 1,
        max_logit_rows: 1,
        attention_splits: Some(6),
        attention_split_keys: 2,
        ..Default::default()
    };
    check(s, 17, opts);
}

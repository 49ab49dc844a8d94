//! The GPU forward pass against the CPU reference forward pass (f64 accumulation) on seeded
//! random models with shapes the fixtures do not cover: widths that are not multiples of any
//! tile size, GQA/MQA/MHA, q/k/v biases, tied and untied heads, f16 weights, Llama 3 RoPE
//! scaling, Gemma 3's block (sandwich norms, q/k norms, GELU-tanh, scaled embedding, sliding
//! window layers with their own RoPE base), and prompts processed in uneven chunks through
//! pages of odd size.

mod common;

use common::random::{random_model, Rng, Spec};
use lantern::model::forward::{GpuModel, ModelOptions};
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
    use lantern::model::forward::WeightPrecision;
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

/// Logits of every position of `ids`, fed in steps of `steps` tokens (cycled), each step
/// returning its rows.
fn rows_in_steps(m: &mut GpuModel, seq: usize, ids: &[u32], steps: &[usize]) -> Vec<f32> {
    let mut out = Vec::new();
    let (mut at, mut i) = (0, 0);
    while at < ids.len() {
        let n = steps[i % steps.len()].min(ids.len() - at);
        out.extend(pollster::block_on(m.forward_all_logits(seq, &ids[at..at + n])).expect("step"));
        at += n;
        i += 1;
    }
    out
}

#[test]
fn gemma_block_window_rings_equal_full_pages_in_every_kv_dtype() {
    // Window 5, steps of up to 6, pages of 3: a ring of 4 pages (12 tokens) per sequence for
    // the sliding layers, against 61 tokens of context: each sequence's ring wraps five
    // times. Ring and pool addressing must give bit-identical logits, for f32 (also equal
    // to the reference), f16, q8 and q4 caches alike, with the pages the rings free.
    use lantern::kv::plan::KvDtype;
    use lantern::model::forward::KvWindow;
    let s = Spec { seed: 8, vocab: 80, hidden: 48, ffn: 64, layers: 4, heads: 4, kv_heads: 2, head_dim: 16, gemma: true, ..BASE };
    let w = random_model(s);
    let mut rng = Rng(s.seed + 5);
    let ids: Vec<u32> = (0..61).map(|_| rng.below(s.vocab) as u32).collect();
    let want = ReferenceModel::new(&w).unwrap().forward(&ids);
    for kv_dtype in [KvDtype::F32, KvDtype::F16, KvDtype::Q8, KvDtype::Q4] {
        let mut runs = Vec::new();
        for kv_window in [KvWindow::Ring, KvWindow::Full] {
            let opts = ModelOptions {
                context: Some(64),
                page_size: 3,
                max_batch_tokens: 6,
                max_logit_rows: 6,
                kv_dtype,
                kv_window,
                ..Default::default()
            };
            let mut m = pollster::block_on(GpuModel::load(common::gpu(), &w, opts)).expect("load");
            let mem = m.memory().clone();
            assert_eq!(mem.kv_window_ring.map(|r| (r.pages, r.tokens())), (kv_window == KvWindow::Ring).then_some((4, 12)));
            let seq = m.new_sequence().unwrap();
            // Uneven steps that cross page and window edges, then single tokens.
            let mut got = rows_in_steps(&mut m, seq, &ids[..40], &[6, 1, 5, 2, 3]);
            got.extend(rows_in_steps(&mut m, seq, &ids[40..], &[1]));
            runs.push((got, mem.kv_cache, mem.kv_ring_bytes));
        }
        let ((ring, ring_bytes, ring_part), (full, full_bytes, _)) = (&runs[0], &runs[1]);
        assert!(ring == full, "{kv_dtype:?}: ring and full-page logits differ");
        // Two sliding layers of four keep 12 tokens instead of 64.
        assert!(ring_bytes < full_bytes && *ring_part > 0, "{kv_dtype:?}: ring {ring_bytes} B vs full {full_bytes} B");
        if kv_dtype == KvDtype::F32 {
            let scale = want.iter().fold(0.0f32, |a, &b| a.max(b.abs())).max(1.0);
            let worst = ring.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
            assert!(worst <= TOL * scale, "ring vs reference: {worst:e} (scale {scale})");
        }
    }
}

#[test]
fn window_rings_fork_with_their_sequence_and_refuse_a_rollback_past_the_ring() {
    use lantern::kv::KvError;
    use lantern::model::forward::{KvWindow, Want};
    use lantern::LanternError;
    let s = Spec { seed: 9, vocab: 70, hidden: 32, ffn: 48, layers: 2, heads: 2, kv_heads: 1, head_dim: 16, gemma: true, ..BASE };
    let w = random_model(s);
    let reference = ReferenceModel::new(&w).unwrap();
    let opts = ModelOptions {
        context: Some(48),
        max_seqs: 3,
        page_size: 2,
        max_batch_tokens: 4,
        max_logit_rows: 4,
        kv_window: KvWindow::Ring,
        ..Default::default()
    };
    let mut m = pollster::block_on(GpuModel::load(common::gpu(), &w, opts)).expect("load");
    // Window 5, steps of 4, pages of 2: 4 pages, 8 tokens per ring.
    assert_eq!(m.memory().kv_window_ring.map(|r| r.tokens()), Some(8));
    let mut rng = Rng(3);
    let prompt: Vec<u32> = (0..21).map(|_| rng.below(s.vocab) as u32).collect();
    let seq = m.new_sequence().unwrap();
    rows_in_steps(&mut m, seq, &prompt, &[4]);
    // A fork copies the ring: both continue differently and each matches the reference.
    let fork = m.fork_sequence(seq).unwrap();
    let tails: [Vec<u32>; 2] = [vec![1, 2, 3, 4, 5, 6, 7], vec![9, 8, 7, 6, 5, 4, 3]];
    for (sq, tail) in [(seq, &tails[0]), (fork, &tails[1])] {
        let got = rows_in_steps(&mut m, sq, tail, &[1, 2]);
        let all: Vec<u32> = prompt.iter().chain(tail.iter()).copied().collect();
        let want = reference.forward(&all);
        let want = &want[prompt.len() * s.vocab..];
        let worst = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert!(worst <= TOL * 10.0, "sequence {sq} after the fork: {worst:e}");
    }
    // A rejected 4-token verify step rolls back and the sequence stays exact.
    let len = m.sequence_len(seq).unwrap();
    pollster::block_on(m.forward_rows(seq, &[11, 12, 13, 14], Want::Argmax)).unwrap();
    m.truncate_sequence(seq, len).unwrap();
    let got = pollster::block_on(m.forward_all_logits(seq, &[20])).unwrap();
    let all: Vec<u32> = prompt.iter().chain(&tails[0]).chain(&[20]).copied().collect();
    let want = reference.forward(&all);
    let worst = got.iter().zip(&want[(all.len() - 1) * s.vocab..]).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    assert!(worst <= TOL * 10.0, "after the rollback: {worst:e}");
    // Going back past the ring is refused and changes nothing.
    let len = m.sequence_len(seq).unwrap();
    match m.truncate_sequence(seq, len - 6) {
        Err(LanternError::Kv(KvError::RollbackBeyondRing { ring_tokens: 8, .. })) => {}
        other => panic!("rollback past the ring: {other:?}"),
    }
    assert_eq!(m.sequence_len(seq).unwrap(), len);
    pollster::block_on(m.forward_all_logits(seq, &[21])).unwrap();
    // No prefix cache with rings: nothing registers, nothing attaches.
    assert_eq!(m.cache_prefix(seq, &prompt).unwrap(), 0);
    let other = m.new_sequence().unwrap();
    assert_eq!(m.attach_cached_prefix(other, &prompt).unwrap(), 0);
}

#[test]
fn window_rings_split_over_bindings_fork_page_by_page() {
    // 8 KiB bindings and 1.5 KiB pages (3 tokens x 2 KV heads x 64 dims x f32): 5 pages per
    // shard; one-token steps (the attention partials must fit a binding too) make rings of 2
    // pages, so slot 2's ring (pages 4 and 5) straddles two shards and its fork is copied page
    // by page. Both sequences then continue and match the reference.
    use lantern::model::forward::KvWindow;
    let s = Spec { seed: 10, vocab: 60, hidden: 64, ffn: 64, layers: 2, heads: 4, kv_heads: 2, head_dim: 64, gemma: true, ..BASE };
    let w = random_model(s);
    let reference = ReferenceModel::new(&w).unwrap();
    let ctx = common::gpu_with(&lantern::gpu::DeviceOptions { max_binding_size: Some(8192), ..Default::default() });
    let opts = ModelOptions {
        // The RoPE table (context x 64 dims x f32) must fit a binding too.
        context: Some(32),
        max_seqs: 3,
        page_size: 3,
        max_batch_tokens: 1,
        max_logit_rows: 1,
        kv_window: KvWindow::Ring,
        ..Default::default()
    };
    let mut m = pollster::block_on(GpuModel::load(ctx, &w, opts)).expect("load");
    let rl = m.kv.store.ring_layout.expect("ring layout");
    assert_eq!((rl.ring, rl.pages_per_shard), (2, 5));
    assert!(rl.n_shards > 1);
    let mut rng = Rng(4);
    let prompt: Vec<u32> = (0..17).map(|_| rng.below(s.vocab) as u32).collect();
    // Slots 0 and 1 are taken first so that the prompt's sequence owns slot 2's ring.
    let pads = [m.new_sequence().unwrap(), m.new_sequence().unwrap()];
    let seq = m.new_sequence().unwrap();
    for p in pads {
        m.release_sequence(p);
    }
    rows_in_steps(&mut m, seq, &prompt, &[1]);
    let fork = m.fork_sequence(seq).unwrap();
    assert_eq!((seq, fork), (2, 0));
    for (sq, tail) in [(seq, [1u32, 2, 3, 4, 5]), (fork, [7, 6, 5, 4, 3])] {
        let got = rows_in_steps(&mut m, sq, &tail, &[1]);
        let all: Vec<u32> = prompt.iter().chain(tail.iter()).copied().collect();
        let want = reference.forward(&all);
        let worst = got.iter().zip(&want[prompt.len() * s.vocab..]).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert!(worst <= TOL * 10.0, "sequence {sq} after the fork: {worst:e}");
    }
}

/// The q4 cache keeps a sequence's open page in f16 and rounds a page per channel when a step
/// fills it: a rejected verify step that sealed a page reopens it exactly (its tail kept the
/// f16 keys, so the rejected drafts leave no trace), a fork mid-page copies the tail and
/// gives bit for bit what a fresh sequence fed the same steps gives, and a rollback into a
/// page whose tail a longer step overwrote is refused and changes nothing.
#[test]
fn q4_cache_rollbacks_and_forks_give_what_fresh_sequences_give() {
    use lantern::kv::plan::KvDtype;
    use lantern::kv::KvError;
    use lantern::model::forward::Want;
    use lantern::LanternError;
    let s = Spec { seed: 23, vocab: 64, hidden: 32, ffn: 48, layers: 2, heads: 4, kv_heads: 2, head_dim: 16, ..BASE };
    let w = random_model(s);
    let opts = ModelOptions {
        context: Some(64),
        max_seqs: 4,
        page_size: 4,
        max_batch_tokens: 10,
        max_logit_rows: 10,
        kv_dtype: KvDtype::Q4,
        ..Default::default()
    };
    let mut m = pollster::block_on(GpuModel::load(common::gpu(), &w, opts.clone())).expect("load");
    let mut rng = Rng(s.seed + 1);
    let mut ids = |n: usize| -> Vec<u32> { (0..n).map(|_| rng.below(s.vocab) as u32).collect() };
    // 14 tokens: pages 0-2 sealed, page 3 open with two keys.
    let prompt = ids(14);
    let (draft, tail_a, tail_b) = (ids(5), ids(5), ids(5));
    let fresh = |m: &mut GpuModel, tokens: &[u32], steps: &[usize]| -> Vec<f32> {
        let seq = m.new_sequence().unwrap();
        let out = rows_in_steps(m, seq, tokens, steps);
        m.release_sequence(seq);
        out
    };

    // Rollback: a 5-token verify step seals page 3 and opens page 4; keeping one draft goes
    // back into page 3. Whatever the rejected drafts were, the sequence then gives the same
    // logits (page 3 is reopened from its exact f16 keys, not from the rounding that
    // included a rejected one).
    let mut runs = Vec::new();
    for rejected in [ids(4), ids(4)] {
        let seq = m.new_sequence().unwrap();
        rows_in_steps(&mut m, seq, &prompt, &[6, 8]);
        let verify: Vec<u32> = draft[..1].iter().chain(&rejected).copied().collect();
        pollster::block_on(m.forward_rows(seq, &verify, Want::Argmax)).unwrap();
        m.truncate_sequence(seq, 15).unwrap();
        runs.push(rows_in_steps(&mut m, seq, &tail_a, &[3, 2]));
        m.release_sequence(seq);
    }
    assert!(runs[0] == runs[1], "the rejected drafts changed the logits after the rollback");
    let all: Vec<u32> = prompt.iter().chain(&draft[..1]).chain(&tail_a).copied().collect();
    let f32_opts = ModelOptions { kv_dtype: KvDtype::F32, ..opts };
    let mut exact = pollster::block_on(GpuModel::load(common::gpu(), &w, f32_opts)).expect("load");
    let want = fresh(&mut exact, &all, &[6, 8, 5, 3, 2]);
    let worst = runs[0].iter().zip(&want[15 * s.vocab..]).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    let scale = want.iter().fold(0.0f32, |a, &b| a.max(b.abs()));
    assert!(worst <= 0.1 * scale, "q4 against f32 after the rollback: {worst} (logits up to {scale})");

    // Fork mid-page: both continue, each as a fresh sequence would.
    let a = m.new_sequence().unwrap();
    rows_in_steps(&mut m, a, &prompt, &[6, 8]);
    let b = m.fork_sequence(a).unwrap();
    let got_a = rows_in_steps(&mut m, a, &tail_a, &[5]);
    let got_b = rows_in_steps(&mut m, b, &tail_b, &[1, 4]);
    m.release_sequence(a);
    m.release_sequence(b);
    for (got, tail, steps) in [(&got_a, &tail_a, &[6usize, 8, 5][..]), (&got_b, &tail_b, &[6, 8, 1, 4][..])] {
        let all: Vec<u32> = prompt.iter().chain(tail).copied().collect();
        let want = fresh(&mut m, &all, steps);
        assert!(*got == want[14 * s.vocab..], "a fork's logits differ from a fresh sequence's");
    }

    // A 10-token step from position 14 writes pages 3 to 5: page 3's tail is overwritten, and
    // going back into it is refused; going back to page 4 is fine.
    let seq = m.new_sequence().unwrap();
    rows_in_steps(&mut m, seq, &prompt, &[6, 8]);
    pollster::block_on(m.forward_rows(seq, &ids(10), Want::Argmax)).unwrap();
    match m.truncate_sequence(seq, 15) {
        Err(LanternError::Kv(KvError::RollbackBeyondTail { len: 15, page_size: 4, .. })) => {}
        other => panic!("rollback into an overwritten tail: {other:?}"),
    }
    assert_eq!(m.sequence_len(seq).unwrap(), 24);
    m.truncate_sequence(seq, 17).unwrap();
    m.truncate_sequence(seq, 16).unwrap();
    pollster::block_on(m.forward_all_logits(seq, &[3])).unwrap();
}

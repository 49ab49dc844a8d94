//! Bad input reaching the runtime gets a typed error with a clear message, never a panic or
//! a corrupted state: prompts longer than the context, a full cache, out-of-vocabulary ids,
//! no matching adapter, an unknown backend, and the GL backend's answer.

mod common;

use lantern::engine::generate::{generate, GenerateRequest};
use lantern::engine::SamplingParams;
use lantern::gpu::{DeviceOptions, GpuContext, GpuError};
use lantern::kv::KvError;
use lantern::model::forward::{GpuModel, ModelOptions, Want};
use lantern::model::hf::load_hf_folder;
use lantern::LanternError;

fn tiny_model(context: usize) -> GpuModel {
    let w = load_hf_folder(&common::tiny_dir().join("llama-gqa")).unwrap();
    pollster::block_on(GpuModel::load(common::gpu(), &w, ModelOptions { context: Some(context), page_size: 4, ..Default::default() }))
        .unwrap()
}

#[test]
fn prompt_longer_than_the_context_is_refused_before_any_work() {
    let mut m = tiny_model(8);
    // Any tokenizer will do: the check happens before decoding anything.
    let l = lantern::model::load::load_path(&common::smollm2_gguf()).unwrap();
    let tok = l.tokenizer.unwrap();
    let req = GenerateRequest {
        prompt_ids: (1..=10).collect(),
        max_tokens: 4,
        sampling: SamplingParams::default(),
        stop_ids: vec![],
        stop_strings: vec![],
        speculation: Default::default(),
        constraint: None,
        logprobs: None,
        bias: Default::default(),
    };
    let err = pollster::block_on(generate(&mut m, &tok, &req, |_| true)).unwrap_err();
    assert!(matches!(err, LanternError::PromptTooLong { prompt_tokens: 10, context: 8, .. }), "{err:?}");
    assert!(err.to_string().contains("10 tokens") && err.to_string().contains("8"), "{err}");
    assert_eq!(m.kv.alloc.free_pages(), m.kv.alloc.config.num_pages, "no pages leaked");
}

#[test]
fn filling_the_context_is_a_typed_error_and_leaves_the_sequence_intact() {
    let mut m = tiny_model(8);
    let seq = m.new_sequence().unwrap();
    pollster::block_on(m.forward(seq, &[1, 2, 3, 4, 5, 6], Want::Argmax)).unwrap();
    let err = pollster::block_on(m.forward(seq, &[7, 8, 9], Want::Argmax)).unwrap_err();
    assert!(matches!(err, LanternError::Kv(KvError::ContextExceeded { tokens: 9, context: 8 })), "{err:?}");
    assert_eq!(m.sequence_len(seq).unwrap(), 6);
    // The sequence still works.
    pollster::block_on(m.forward(seq, &[7, 8], Want::Argmax)).unwrap();
    assert_eq!(m.sequence_len(seq).unwrap(), 8);
}

#[test]
fn a_full_page_pool_is_reported_with_sizes() {
    let mut m = tiny_model(8);
    let s1 = m.new_sequence().unwrap();
    pollster::block_on(m.forward(s1, &[1, 2, 3, 4, 5], Want::Argmax)).unwrap();
    // One sequence slot only by default.
    let err = m.new_sequence().unwrap_err();
    assert!(matches!(err, LanternError::Kv(KvError::NoSequenceSlot { max_seqs: 1 })), "{err:?}");
}

#[test]
fn token_ids_outside_the_vocabulary_are_refused() {
    let mut m = tiny_model(16);
    let seq = m.new_sequence().unwrap();
    let err = pollster::block_on(m.forward(seq, &[1, 512], Want::Argmax)).unwrap_err();
    assert!(err.to_string().contains("512") && err.to_string().contains("vocabulary"), "{err}");
    assert_eq!(m.sequence_len(seq).unwrap(), 0);
}

#[test]
fn no_matching_adapter_names_what_exists() {
    let err = pollster::block_on(GpuContext::new(&DeviceOptions { adapter: Some("no-such-gpu-anywhere".into()), ..Default::default() }))
        .unwrap_err();
    assert!(matches!(err, GpuError::NoAdapter { .. }), "{err:?}");
    assert!(err.to_string().contains("no GPU adapter"), "{err}");
}

#[test]
fn unknown_backend_is_a_clear_error() {
    let err = pollster::block_on(GpuContext::new(&DeviceOptions { backend: Some("glide".into()), ..Default::default() })).unwrap_err();
    assert!(err.to_string().contains("unknown backend `glide`"), "{err}");
}

#[test]
fn gl_backend_either_matches_the_reference_or_is_refused_clearly() {
    let ctx = pollster::block_on(GpuContext::new(&DeviceOptions { backend: Some("gl".into()), ..Default::default() }));
    match ctx {
        Err(e) => {
            let msg = e.to_string();
            assert!(
                msg.contains("no GPU adapter") || msg.contains("lacks") || msg.contains("device request failed"),
                "unclear GL refusal: {msg}"
            );
        }
        Ok(ctx) => {
            let w = load_hf_folder(&common::tiny_dir().join("llama-gqa")).unwrap();
            match pollster::block_on(GpuModel::load(ctx, &w, ModelOptions { context: Some(64), ..Default::default() })) {
                Err(e) => {
                    eprintln!("GL adapter refused the model: {e}");
                    assert!(matches!(e, LanternError::Gpu(_)), "GL refusal must be a GPU capability error: {e:?}");
                }
                Ok(mut m) => {
                    eprintln!("GL adapter runs the model");
                    let r = common::read_json(&common::tiny_dir().join("llama-gqa/reference.json"));
                    let ids = common::ids(&r["input_ids"]);
                    let seq = m.new_sequence().unwrap();
                    let out = pollster::block_on(m.forward(seq, &ids, Want::Argmax)).unwrap();
                    assert_eq!(out.argmax[0] as u64, r["argmax"][ids.len() - 1].as_u64().unwrap());
                }
            }
        }
    }
}

//! The GPU forward pass against Hugging Face reference logits (tiny fixtures) and against the
//! CPU reference forward pass (seeded random models), including chunked prefill, decode
//! through the paged cache, and tensors split across bindings.

mod common;

use common::{assert_close, ids, read_f32};

use std::path::PathBuf;

use lantern::engine::sampler::argmax;
use lantern::model::forward::{l2_normalized, GpuModel, ModelOptions, Pooling, Want};
use lantern::model::hf::load_hf_folder;
use lantern::model::ModelWeights;

const TOL: f32 = 1e-4;

fn tiny(name: &str) -> PathBuf {
    common::tiny_dir().join(name)
}

fn reference(name: &str) -> serde_json::Value {
    common::read_json(&tiny(name).join("reference.json"))
}

fn load_gpu(weights: &ModelWeights, opts: ModelOptions) -> GpuModel {
    let ctx = common::gpu();
    pollster::block_on(GpuModel::load(ctx, weights, opts)).expect("load model on GPU")
}

fn check_fixture(name: &str, opts: ModelOptions) {
    check_fixture_against(name, opts, "logits.f32");
}

/// [`check_fixture`] with the logits of `logits_file` (within TOL).
fn check_fixture_against(name: &str, opts: ModelOptions, logits_file: &str) -> Vec<f32> {
    let w = load_hf_folder(&tiny(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
    let r = reference(name);
    let input = ids(&r["input_ids"]);
    let want = read_f32(&tiny(name).join(logits_file));
    let vocab = w.config.vocab_size;
    let mut m = load_gpu(&w, opts);
    let seq = m.new_sequence().unwrap();
    let got = pollster::block_on(m.forward_all_logits(seq, &input)).unwrap();
    assert_close(name, &got, &want, vocab, TOL);
    let am: Vec<u32> = got.chunks_exact(vocab).map(argmax).collect();
    assert_eq!(am, ids(&r["argmax"]), "{name}: argmax per position");
    m.release_sequence(seq);

    // Greedy continuation through the cache: prefill, then one token per step.
    let greedy = ids(&r["greedy_ids"]);
    let seq = m.new_sequence().unwrap();
    let mut out = Vec::new();
    let mut next = pollster::block_on(m.forward(seq, &input, Want::Argmax)).unwrap().argmax[0];
    out.push(next);
    while out.len() < greedy.len() {
        next = pollster::block_on(m.forward(seq, &[next], Want::Argmax)).unwrap().argmax[0];
        out.push(next);
    }
    assert_eq!(out, greedy, "{name}: greedy ids");
    got
}

macro_rules! fixture_tests {
    ($($fn:ident => $name:expr),* $(,)?) => {$(
        #[test]
        fn $fn() {
            check_fixture($name, ModelOptions { context: Some(256), ..Default::default() });
        }
    )*};
}

fixture_tests! {
    llama_gqa => "llama-gqa",
    llama_gqa_f16 => "llama-gqa-f16",
    llama_gqa_bf16 => "llama-gqa-bf16",
    llama_gqa_fp8_channel => "llama-gqa-fp8-channel",
    llama_mha_tied => "llama-mha-tied",
    llama_mha_tied_sharded => "llama-mha-tied-sharded",
    llama_mqa => "llama-mqa",
    llama3_rope_scaling => "llama3-rope-scaling",
    llama3_rope_scaling_hd16 => "llama3-rope-scaling-hd16",
    qwen2_bias => "qwen2-bias",
    mistral => "mistral",
}

/// How far an FP8 checkpoint's float32 scales move when stored as Lantern's f16 (scale x 256,
/// 2^-12 of the scale): the block fixture's logits move by 1.7e-4 in transformers itself.
const FP8_F32_SCALE_TOL: f32 = 2.5e-4;

/// FP8 weights with float32 block scales (`_scale_inv`, [64, 64] blocks, partial ones
/// included): TOL-close to the reference of the same codes with the scales rounded as stored,
/// and within FP8_F32_SCALE_TOL of the float32-scale reference; greedy exact.
#[test]
fn llama_gqa_fp8_block() {
    let name = "llama-gqa-fp8-block";
    let got = check_fixture_against(name, ModelOptions { context: Some(256), ..Default::default() }, "logits_f16_scales.f32");
    let want = read_f32(&tiny(name).join("logits.f32"));
    assert_close(&format!("{name} (float32 scales)"), &got, &want, 512, FP8_F32_SCALE_TOL);
}

#[test]
fn llama_gqa_long_input_in_small_chunks_with_odd_page_size() {
    // 200 tokens, prefilled 37 at a time through pages of 7 tokens.
    let w = load_hf_folder(&tiny("llama-gqa")).unwrap();
    let r = reference("llama-gqa");
    let input = ids(&r["long"]["input_ids"]);
    let want = read_f32(&tiny("llama-gqa").join("logits_long.f32"));
    let opts = ModelOptions { context: Some(256), page_size: 7, max_batch_tokens: 37, max_logit_rows: 37, ..Default::default() };
    let mut m = load_gpu(&w, opts);
    let seq = m.new_sequence().unwrap();
    let got = pollster::block_on(m.forward_all_logits(seq, &input)).unwrap();
    assert_close("llama-gqa long", &got, &want, w.config.vocab_size, TOL);
}

#[test]
fn tensors_split_across_small_bindings_give_the_same_logits() {
    // 8 KiB bindings force every weight to be split by rows into several buffers.
    let w = load_hf_folder(&tiny("llama-gqa")).unwrap();
    let r = reference("llama-gqa");
    let input = ids(&r["input_ids"]);
    let want = read_f32(&tiny("llama-gqa").join("logits.f32"));
    let ctx = common::gpu_with(&lantern::gpu::DeviceOptions { max_binding_size: Some(8 * 1024), ..Default::default() });
    let mut m = pollster::block_on(GpuModel::load(
        ctx,
        &w,
        ModelOptions { context: Some(48), max_batch_tokens: 8, max_logit_rows: 2, ..Default::default() },
    ))
    .unwrap();
    let seq = m.new_sequence().unwrap();
    let got = pollster::block_on(m.forward_all_logits(seq, &input)).unwrap();
    assert_close("llama-gqa split", &got, &want, w.config.vocab_size, TOL);
}

/// The streamed load (`load_gguf_streamed`, what `lantern run` and the browser use: the GGUF
/// header from the file's first bytes, then one layer's tensors at a time read by byte range,
/// each uploaded and dropped) gives the same logits, bit for bit, as loading the whole file,
/// on SmolLM2 and on llama.cpp's Phi-3 GGUF (whose fused tensors are split per part).
#[test]
fn streamed_gguf_load_equals_the_whole_file_load() {
    let phi3 = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-archs/phi3/model.gguf");
    for path in [common::smollm2_gguf(), phi3] {
        let bytes = std::fs::read(&path).unwrap();
        let name = path.display().to_string();
        let opts = ModelOptions { context: Some(64), ..Default::default() };
        // The header from a prefix grown until it holds the metadata (4 MiB first; SmolLM2's
        // is smaller, the reads below count what was asked), then part by part.
        let mut reads = Vec::new();
        let mut read = async |a: u64, b: u64| {
            reads.push((a, b));
            Ok(bytes[a as usize..b as usize].to_vec())
        };
        let (mut streamed, _) = pollster::block_on(lantern::model::load::load_gguf_streamed(
            common::gpu(),
            &name,
            bytes.len() as u64,
            opts.clone(),
            &mut read,
            &mut |_, _| {},
        ))
        .unwrap();
        if bytes.len() > 4 << 20 {
            assert!(!reads.contains(&(0, bytes.len() as u64)), "{name}: a streamed load never reads the whole file at once");
        }
        assert!(reads.len() > streamed.config.num_layers, "{name}: {} reads", reads.len());
        // A prefix too short for the header asks for more (the loader's cue to read further).
        let short = lantern::model::gguf::GgufFile::parse_prefix(&bytes[..4096], bytes.len() as u64, name.as_str());
        assert!(matches!(short, Err(lantern::model::gguf::GgufError::Truncated { .. })), "{name}");
        let whole = lantern::model::load::load_path(&path).unwrap();
        let mut m = pollster::block_on(GpuModel::load(common::gpu(), &whole.weights, opts)).unwrap();
        let ids = [1u32, 5, 9, 2, 7, 3];
        let (s1, s2) = (streamed.new_sequence().unwrap(), m.new_sequence().unwrap());
        let a = pollster::block_on(streamed.forward_all_logits(s1, &ids)).unwrap();
        let b = pollster::block_on(m.forward_all_logits(s2, &ids)).unwrap();
        assert_eq!(a, b, "{name}");
        assert_eq!(streamed.memory().weights, m.memory().weights);
    }
}

/// A streamed load writes the embedding table and the head a slice of rows at a time
/// (`ModelOptions::stream_slice_bytes`), never reading either whole. With slices of 3 rows
/// and bindings of 16 KiB (so slices straddle the buffer chunks they are written into), every
/// GGUF weight format of the ggml-types fixture and the tiny architectures (tied and untied
/// heads) give the logits of the whole-file load bit for bit; SmolLM2's 28 MB table comes in
/// slices of at most 16 MiB by default.
#[test]
fn streamed_loads_write_the_head_a_slice_of_rows_at_a_time() {
    let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let mut paths: Vec<_> = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"]
        .iter()
        .map(|t| root.join(format!("ggml-types/tiny-{t}.gguf")))
        .collect();
    paths.extend(["gemma3", "llama3.2", "phi3", "qwen3"].iter().map(|a| root.join(format!("tiny-archs/{a}/model.gguf"))));
    let ctx = common::gpu_with(&lantern::gpu::DeviceOptions { max_binding_size: Some(16 * 1024), ..Default::default() });
    for path in &paths {
        let bytes = std::fs::read(path).unwrap();
        let name = path.display().to_string();
        let whole = lantern::model::load::load_path(path).unwrap();
        let c = &whole.weights.config;
        let opts = ModelOptions {
            context: Some(32),
            max_batch_tokens: 4,
            max_logit_rows: 4,
            stream_slice_bytes: 3 * c.hidden_size * 4,
            ..Default::default()
        };
        let map = lantern::model::gguf::GgufMmap::open(path).unwrap();
        let gguf = map.parse().unwrap();
        let info = gguf.tensor_info("token_embd.weight").unwrap();
        let (t0, t1) = gguf.tensor_range(info);
        assert!(info.size > 2 * 16 * 1024, "{name}: the table spans several binding chunks");
        let mut slices = 0;
        let mut read = async |a: u64, b: u64| {
            if a >= t0 && b <= t1 {
                assert!(b - a < info.size, "{name}: the table read whole");
                slices += 1;
            }
            Ok(bytes[a as usize..b as usize].to_vec())
        };
        let (mut streamed, _) = pollster::block_on(lantern::model::load::load_gguf_streamed(
            ctx.clone(),
            &name,
            bytes.len() as u64,
            opts.clone(),
            &mut read,
            &mut |_, _| {},
        ))
        .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(slices, c.vocab_size.div_ceil(3), "{name}");
        let mut m = pollster::block_on(GpuModel::load(ctx.clone(), &whole.weights, opts)).unwrap();
        let ids = [1u32, 5, 9, 2, 7, 3];
        let (s1, s2) = (streamed.new_sequence().unwrap(), m.new_sequence().unwrap());
        let a = pollster::block_on(streamed.forward_all_logits(s1, &ids)).unwrap();
        let b = pollster::block_on(m.forward_all_logits(s2, &ids)).unwrap();
        assert_eq!(a, b, "{name}");
        assert_eq!(streamed.memory().weights, m.memory().weights, "{name}");
    }
    // SmolLM2 by default: no read as large as its embedding table.
    let path = common::smollm2_gguf();
    let bytes = std::fs::read(&path).unwrap();
    let map = lantern::model::gguf::GgufMmap::open(&path).unwrap();
    let gguf = map.parse().unwrap();
    let table = gguf.tensor_info("token_embd.weight").unwrap().size;
    let mut largest = 0u64;
    let mut read = async |a: u64, b: u64| {
        if a > 0 {
            largest = largest.max(b - a);
        }
        Ok(bytes[a as usize..b as usize].to_vec())
    };
    let opts = ModelOptions { context: Some(32), ..Default::default() };
    pollster::block_on(lantern::model::load::load_gguf_streamed(
        common::gpu(),
        "smollm2",
        bytes.len() as u64,
        opts,
        &mut read,
        &mut |_, _| {},
    ))
    .unwrap();
    assert!(largest < table, "largest read {largest} bytes, the embedding table is {table}");
}

/// Every pipeline the runtime asks for is among the variants the shader tests validate,
/// translate and snapshot (`kernels::all_variants`, tests/shaders.rs). The tiny models
/// of every architecture (HF folders and llama.cpp GGUFs, mixtures of experts among them) and
/// of every GGUF weight format
/// are loaded under the capabilities of each adapter family the kernels tell apart (CPU
/// adapters with subgroups of 8 like lavapipe, of 4 or none; GPUs with f16 and fixed or
/// variable subgroups, and without either), with each weight precision and KV dtype; every
/// key those loads compiled must be in the set.
#[test]
fn every_pipeline_the_runtime_requests_is_a_validated_variant() {
    use lantern::gpu::shader::{Features, PipelineKey};
    use lantern::gpu::Capabilities;
    use lantern::kv::plan::KvDtype;
    use lantern::model::forward::WeightPrecision;
    use std::collections::BTreeSet;
    let base = common::gpu();
    let validated: BTreeSet<PipelineKey> = [false, true]
        .into_iter()
        .flat_map(|f16| [false, true].map(|subgroups| Features { f16, subgroups }))
        .flat_map(lantern::kernels::all_variants)
        .collect();
    let caps = |cpu_like: bool, shader_f16: bool, sg: Option<(u32, u32)>| Capabilities {
        shader_f16: shader_f16 && base.caps.shader_f16,
        subgroups: sg.is_some() && base.caps.subgroups,
        timestamps: false,
        subgroup_min_size: sg.map_or(0, |s| s.0),
        subgroup_max_size: sg.map_or(0, |s| s.1),
        cpu_like,
    };
    let families = [
        ("this adapter", base.caps),
        ("CPU adapter, subgroups of 8 (lavapipe)", caps(true, true, Some((8, 8)))),
        ("CPU adapter, no f16, subgroups of 4 (SwiftShader)", caps(true, false, Some((4, 4)))),
        ("CPU adapter without subgroups", caps(true, false, None)),
        ("GPU, f16, subgroups of 32", caps(false, true, Some((32, 32)))),
        ("GPU, f16, subgroups of 8 to 64", caps(false, true, Some((8, 64)))),
        ("GPU without f16 or subgroups", caps(false, false, None)),
    ];
    let mut models: Vec<(String, ModelWeights)> = Vec::new();
    for name in ["llama-gqa", "llama-gqa-f16", "llama-mha-tied", "llama-mqa", "qwen2-bias", "mistral"] {
        models.push((name.into(), load_hf_folder(&tiny(name)).expect(name)));
    }
    let archs = common::fixtures_dir().join("tiny-archs");
    for name in ["gemma3", "llama3.2", "phi3", "phi3-longrope", "qwen3"] {
        let l = lantern::model::load::load_path(&archs.join(name).join("model.gguf")).expect(name);
        models.push((format!("{name} GGUF"), l.weights));
    }
    // Mixtures of experts: the router and expert kernels.
    let moe = common::fixtures_dir().join("tiny-moe");
    for path in [moe.join("qwen3moe"), moe.join("olmoe"), moe.join("mixtral").join("model.gguf")] {
        let l = lantern::model::load::load_path(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        models.push((path.display().to_string(), l.weights));
    }
    let types = common::fixtures_dir().join("ggml-types");
    for ty in ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"] {
        let l = lantern::model::load::load_path(&types.join(format!("tiny-{ty}.gguf"))).expect(ty);
        models.push((format!("tiny Llama {ty}"), l.weights));
    }
    let base_opts = ModelOptions { context: Some(64), max_batch_tokens: 32, max_logit_rows: 8, ..Default::default() };
    let option_sets = [
        ModelOptions { ..base_opts.clone() },
        ModelOptions { weights: WeightPrecision::F16, kv_dtype: KvDtype::F16, ..base_opts.clone() },
        ModelOptions { weights: WeightPrecision::F32, kv_dtype: KvDtype::Q8, batch_invariant: true, ..base_opts.clone() },
        ModelOptions { weight_textures: Some(false), kv_dtype: KvDtype::Q8, ..base_opts.clone() },
    ];
    let mut missing: BTreeSet<String> = BTreeSet::new();
    let mut requested = 0;
    for (family, caps) in families {
        let ctx = base.with_caps(caps).expect("capabilities within the device's");
        for (name, w) in &models {
            for opts in &option_sets {
                if let Err(e) = pollster::block_on(GpuModel::load(ctx.clone(), w, opts.clone())) {
                    panic!("{family}: {name} with {:?} weights, {:?} KV does not load: {e}", opts.weights, opts.kv_dtype);
                }
            }
        }
        let keys = ctx.pipelines.keys();
        requested += keys.len();
        missing.extend(keys.iter().filter(|k| !validated.contains(k)).map(|k| format!("{family}: {}", k.label())));
    }
    assert!(
        missing.is_empty(),
        "pipelines the runtime asks for that no shader test validates:\n{}",
        missing.into_iter().collect::<Vec<_>>().join("\n")
    );
    eprintln!("{requested} pipelines requested over the adapter families, all validated");
}

/// The CPU reference's embedding: the final residual rows through the final norm, pooled,
/// scaled to unit length.
fn reference_embedding(w: &ModelWeights, tokens: &[u32], pooling: Pooling) -> Vec<f32> {
    let r = lantern::reference::ReferenceModel::new(w).unwrap();
    let d = w.config.hidden_size;
    let last = r.forward_hidden(tokens).pop().unwrap();
    let norm = w.tensors["model.norm.weight"].to_f32();
    let normed = lantern::reference::ops::rmsnorm(&last, &norm, w.config.rms_norm_eps);
    let rows: Vec<&[f32]> = normed.chunks_exact(d).collect();
    let pooled: Vec<f32> = match pooling {
        Pooling::Mean => (0..d).map(|j| rows.iter().map(|r| r[j] as f64).sum::<f64>() as f32 / rows.len() as f32).collect(),
        Pooling::Last => rows.last().unwrap().to_vec(),
    };
    l2_normalized(pooled)
}

#[test]
fn embeddings_pool_the_reference_final_states_and_release_their_pages() {
    for name in ["llama-gqa", "qwen2-bias"] {
        let w = load_hf_folder(&tiny(name)).unwrap();
        let input = ids(&reference(name)["input_ids"]);
        // Steps of 3 tokens: the mean runs over several steps, the last token is in the last.
        let opts = ModelOptions { context: Some(64), page_size: 4, max_batch_tokens: 3, max_logit_rows: 3, ..Default::default() };
        let mut m = load_gpu(&w, opts);
        let total = m.kv.alloc.total_pages();
        for pooling in [Pooling::Mean, Pooling::Last] {
            for n in [1, 2, input.len()] {
                let got = pollster::block_on(m.embedding(&input[..n], pooling)).unwrap();
                let want = reference_embedding(&w, &input[..n], pooling);
                assert_eq!(got.len(), w.config.hidden_size);
                let err = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                assert!(err < 1e-4, "{name} {pooling:?} over {n} tokens: max error {err}");
                let len: f32 = got.iter().map(|v| v * v).sum::<f32>().sqrt();
                assert!((len - 1.0).abs() < 1e-5, "unit length, got {len}");
                assert_eq!(m.kv.alloc.free_pages(), total, "{name}: the embedding's pages are released");
            }
        }
        // Refusals change nothing.
        assert!(pollster::block_on(m.embedding(&[], Pooling::Mean)).is_err());
        let too_long = vec![1u32; 65];
        let e = pollster::block_on(m.embedding(&too_long, Pooling::Mean)).unwrap_err();
        assert!(e.to_string().contains("64"), "{e}");
        let e = pollster::block_on(m.embedding(&[1, w.config.vocab_size as u32], Pooling::Mean)).unwrap_err();
        assert!(e.to_string().contains(&w.config.vocab_size.to_string()), "{e}");
        assert_eq!(m.kv.alloc.free_pages(), total);
        // A decode after embeddings still gives the reference greedy ids (the workspace the
        // embedding used is the step's own).
        let greedy = ids(&reference(name)["greedy_ids"]);
        let seq = m.new_sequence().unwrap();
        let first = pollster::block_on(m.forward(seq, &input, Want::Argmax)).unwrap().argmax[0];
        assert_eq!(first, greedy[0], "{name}: greedy after embeddings");
    }
}

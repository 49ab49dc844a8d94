//! The browser demo end to end: the wasm package (built by `scripts/web.sh`, which the
//! README's test command runs first) served on loopback, the real page driven in Debian's
//! Chromium by `web/e2e.mjs` (playwright-core), a tiny generated model, SmolLM2, Gemma 3 270M
//! and Qwen2.5-Coder-1.5B (1.1 GB, streamed into the GPU a layer at a time) loaded from the
//! page (the demo, built on the lantern-web package) and continued greedily; the browser's
//! text must equal the native runtime's answer to the same completions request, a second
//! page load must read the model from the browser's cache,
//! and a screenshot is kept as `target/test-artifacts/web-demo.png`.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{GgufWriter, Meta};
use lantern::engine::generate::generate;
use lantern::model::forward::{GpuModel, ModelOptions};

/// Shapes of a random llama for the browser tests.
struct Dims {
    hidden: u64,
    heads: u64,
    kv_heads: u64,
    hd: u64,
    ffn: u64,
    layers: u64,
}

/// A llama GGUF named `name` with the byte-level tokenizer (256 byte tokens and an
/// end-of-text token, `common::byte_level_tokenizer`), a tied head, unit norms, and each
/// matrix written by `matrix(writer, name, dims, is_embedding)`.
fn web_gguf(path: &Path, name: &str, d: Dims, mut matrix: impl FnMut(&mut GgufWriter, &str, &[u64], bool)) {
    let vocab = 257u64;
    let mut w = GgufWriter::default();
    w.kv("general.architecture", Meta::Str("llama".into()))
        .kv("general.name", Meta::Str(name.into()))
        .kv("llama.block_count", Meta::U32(d.layers as u32))
        .kv("llama.context_length", Meta::U32(256))
        .kv("llama.embedding_length", Meta::U32(d.hidden as u32))
        .kv("llama.feed_forward_length", Meta::U32(d.ffn as u32))
        .kv("llama.attention.head_count", Meta::U32(d.heads as u32))
        .kv("llama.attention.head_count_kv", Meta::U32(d.kv_heads as u32))
        .kv("llama.attention.key_length", Meta::U32(d.hd as u32))
        .kv("llama.attention.layer_norm_rms_epsilon", Meta::F32(1e-5))
        .kv("llama.rope.freq_base", Meta::F32(10000.0));
    for (k, v) in common::byte_level_tokenizer(&[], &["<|endoftext|>"]) {
        w.kv(&k, v);
    }
    w.set("tokenizer.ggml.pre", Meta::Str("default".into()));
    let ones = |n: u64| vec![1.0f32; n as usize];
    let (h, q, kv, f) = (d.hidden, d.heads * d.hd, d.kv_heads * d.hd, d.ffn);
    matrix(&mut w, "token_embd.weight", &[h, vocab], true);
    for l in 0..d.layers {
        let b = |x: &str| format!("blk.{l}.{x}");
        w.tensor_f32(&b("attn_norm.weight"), &[h], &ones(h));
        matrix(&mut w, &b("attn_q.weight"), &[h, q], false);
        matrix(&mut w, &b("attn_k.weight"), &[h, kv], false);
        matrix(&mut w, &b("attn_v.weight"), &[h, kv], false);
        matrix(&mut w, &b("attn_output.weight"), &[q, h], false);
        w.tensor_f32(&b("ffn_norm.weight"), &[h], &ones(h));
        matrix(&mut w, &b("ffn_gate.weight"), &[h, f], false);
        matrix(&mut w, &b("ffn_up.weight"), &[h, f], false);
        matrix(&mut w, &b("ffn_down.weight"), &[f, h], false);
    }
    w.tensor_f32("output_norm.weight", &[h], &ones(h));
    std::fs::write(path, w.to_bytes()).unwrap();
}

/// A tiny llama GGUF with random f32 weights, small enough to load in a browser in a moment.
fn tiny_web_gguf(path: &Path) {
    let d = Dims { hidden: 64, heads: 4, kv_heads: 2, hd: 16, ffn: 128, layers: 2 };
    let mut rng = common::random::Rng(0x2545_f491_4f6c_dd1d);
    web_gguf(path, "tiny-web", d, |w, name, dims, embedding| {
        let scale = if embedding { 2.0 } else { 0.5 };
        let v: Vec<f32> = (0..dims[0] * dims[1]).map(|_| rng.uniform() * 0.5 * scale).collect();
        w.tensor_f32(name, dims, &v);
    });
}

/// `web/e2e.mjs` on the models in `dir` with these cases (and extra flags): its report,
/// after checking it passed.
fn run_e2e(root: &Path, dir: &Path, cases: &serde_json::Value, extra: &[&str]) -> serde_json::Value {
    let cases_path = dir.join("cases.json");
    std::fs::write(&cases_path, serde_json::to_vec_pretty(cases).unwrap()).unwrap();
    let out = Command::new("node")
        .arg(root.join("web/e2e.mjs"))
        .arg("--models")
        .arg(dir)
        .arg("--cases")
        .arg(&cases_path)
        .arg("--screenshot")
        .arg(root.join("target/test-artifacts/web-demo.png"))
        .args(extra)
        // Chromium finds SwiftShader by itself; a Vulkan ICD pin would hide its adapter.
        .env_remove("VK_DRIVER_FILES")
        .env_remove("VK_ICD_FILENAMES")
        .output()
        .expect("node (scripts/web.sh installs Node.js)");
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("{stderr}");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("e2e printed no report ({e}): {}", String::from_utf8_lossy(&out.stdout)));
    assert!(out.status.success() && report["ok"] == true, "browser e2e failed: {}", serde_json::to_string_pretty(&report).unwrap());
    report
}

/// A llama GGUF of random Q8_0 weights larger than 2 GiB (the ArrayBuffer limit): hidden
/// 2048, 36 layers of 16 heads (4 KV heads), feed-forward 8192. Weights of about 0.02
/// standard deviation, the table's about 1, so the greedy tokens are well separated.
fn large_gguf(path: &Path) {
    let d = Dims { hidden: 2048, heads: 16, kv_heads: 4, hd: 128, ffn: 8192, layers: 36 };
    let mut rng = common::random::Rng::new(0x1234_5678);
    const Q8_0: u32 = 8;
    web_gguf(path, "large-web", d, |w, name, dims, embedding| {
        // Q8_0 blocks (f16 scale, 32 int8 codes) of random codes; uniform int8 has std ~74.
        let n = dims[0] * dims[1];
        let d = half::f16::from_f32(if embedding { 1.0 } else { 0.02 } / 74.0).to_le_bytes();
        let mut out = Vec::with_capacity((n / 32 * 34) as usize);
        for _ in 0..n / 32 {
            out.extend(d);
            for _ in 0..4 {
                out.extend(rng.next_u64().to_le_bytes());
            }
        }
        w.tensor(name, dims, Q8_0, out);
    });
}

/// A model larger than 2 GiB (what one ArrayBuffer can hold) loads in the page from the
/// network and again from Cache Storage, and gives the CPU reference's greedy tokens; the
/// wasm heap stays a small fraction of the file. Minutes on a CPU (SwiftShader), so not in
/// the default suite: `cargo test --release --test web -- --ignored --nocapture` after
/// `scripts/web.sh test-deps`.
#[test]
#[ignore]
fn model_over_2gb_loads_in_chromium() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    assert!(root.join("web/pkg/lantern_bg.wasm").is_file(), "build web/pkg with scripts/web.sh test-deps first");
    let dir = root.join("target/test-artifacts/web-large");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let model = dir.join("large-web.gguf");
    large_gguf(&model);
    let bytes = std::fs::metadata(&model).unwrap().len();
    assert!(bytes > 2 << 30, "{bytes} bytes");
    let prompt = "Hello, large model!";
    // lavapipe reports a 2 GiB device heap, too small for these weights, so the expected
    // tokens come from the CPU reference (f32 products of the dequantized weights).
    let expect = {
        let loaded = lantern::model::load::load_path(&model).unwrap();
        let tok = loaded.tokenizer.unwrap();
        let ids = lantern::reference::ReferenceModel::new(&loaded.weights).unwrap().greedy(&tok.encode(prompt).unwrap(), 2);
        tok.decode(&ids).unwrap()
    };
    let cases = serde_json::json!([{ "model": "large-web.gguf", "prompt": prompt, "maxTokens": 2, "expect": expect }]);
    let report = run_e2e(&root, &dir, &cases, &["--cases-only", "--timeout-s", "1500"]);
    let results = report["results"].as_array().unwrap();
    assert_eq!(results.len(), 2);
    assert_eq!(results[0]["text"], cases[0]["expect"]);
    assert_eq!(results[1]["source"], "cache");
    let wasm_mb = results[0]["wasmMb"].as_f64().unwrap();
    eprintln!(
        "{} MB file: wasm heap {wasm_mb} MB; peak resident MB {} (network), {} (cache)",
        bytes / 1_000_000,
        results[0]["peakMb"],
        results[1]["peakMb"]
    );
    assert!(wasm_mb * 10.0 < bytes as f64 / 1e6, "wasm heap {wasm_mb} MB for a {bytes}-byte file");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The native runtime's greedy continuation of `prompt` (the completions request the demo
/// page sends), validated and turned into a request by the same code the browser package
/// runs.
fn native_run(model: &Path, prompt: &str, max_tokens: usize) -> lantern::engine::Generation {
    let body = serde_json::json!({ "model": "native", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0 });
    native_api(model, lantern::api::Endpoint::Completions, &body)
}

#[test]
fn demo_page_in_chromium_matches_native_tokens_and_caches_the_model() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let pkg = root.join("web/pkg/lantern_bg.wasm");
    assert!(pkg.is_file(), "{} is missing: build it with scripts/web.sh (the README's test command does)", pkg.display());
    assert!(root.join("web/node_modules/playwright-core").is_dir(), "web/node_modules is missing: scripts/web.sh installs it");

    let dir = root.join("target/test-artifacts/web-models");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    tiny_web_gguf(&dir.join("tiny-web.gguf"));
    let link = |from: &Path, name: &str| {
        let to = dir.join(name);
        std::fs::hard_link(from, &to).or_else(|_| std::fs::copy(from, &to).map(|_| ())).unwrap();
        to
    };
    let smol = link(&common::smollm2_gguf(), common::SMOLLM2_FILE);
    let gemma_file = lantern::catalogue::find_model("gemma3-270m").unwrap().file;
    let gemma = link(&common::real::model("LANTERN_GEMMA3_GGUF", "gemma3-270m"), gemma_file);
    let qwen_file = lantern::catalogue::find_model("qwen2.5-coder-1.5b").unwrap().file;
    let qwen = link(&common::real::model("LANTERN_QWEN15_GGUF", "qwen2.5-coder-1.5b"), qwen_file);

    // The native runs of the real models also give the decode speed the browser's is shown
    // beside (a few tokens each: a report, not a benchmark; the README's come from
    // `web/e2e.mjs --cases-only` with longer runs).
    let gemma_native = native_run(&gemma, "def reverse(s):", 3);
    let qwen_native = native_run(&qwen, "def reverse(s):", 2);
    let text = |m: &Path, prompt: &str, n: usize| native_run(m, prompt, n).text;
    let cases = serde_json::json!([
        { "model": "tiny-web.gguf", "prompt": "Hello, browser!", "maxTokens": 12, "expect": text(&dir.join("tiny-web.gguf"), "Hello, browser!", 12) },
        { "model": gemma_file, "prompt": "def reverse(s):", "maxTokens": 3, "expect": gemma_native.text },
        // A file over 1 GiB, streamed: its prefill and decode take minutes on SwiftShader, so
        // it is loaded and run once.
        { "model": qwen_file, "prompt": "def reverse(s):", "maxTokens": 2, "expect": qwen_native.text },
        // Generated twice: plainly and with prompt-lookup speculation. The last case is also
        // reloaded (from Cache Storage) and chatted with (through SmolLM2's chat template;
        // the Gemma 3 270M file is the base model, without one).
        { "model": common::SMOLLM2_FILE, "prompt": "one two three four, one two three four, one two", "maxTokens": 12, "lookup": true,
          "expect": text(&smol, "one two three four, one two three four, one two", 12) },
    ]);
    let report = run_e2e(&root, &dir, &cases, &[]);
    let results = report["results"].as_array().unwrap();
    assert_eq!(results.len(), 9);
    for (i, c) in cases.as_array().unwrap().iter().enumerate() {
        assert_eq!(results[i]["model"], c["model"]);
        assert_eq!(results[i]["text"], c["expect"], "{}", c["model"]);
    }
    for (i, native) in [(1, &gemma_native), (2, &qwen_native)] {
        let t = &results[i]["timings"];
        let n = native.timings.metrics();
        eprintln!(
            "{}: decode in Chromium (SwiftShader) {:.2} tok/s (TPOT {:.0} ms), native on {} {:.2} tok/s (TPOT {:.0} ms)",
            results[i]["model"],
            t["tokensPerS"].as_f64().unwrap_or(f64::NAN),
            t["tpotMs"].as_f64().unwrap_or(f64::NAN),
            common::gpu().info.name,
            n.tokens_per_s.unwrap_or(f64::NAN),
            n.tpot_ms.unwrap_or(f64::NAN)
        );
    }
    assert_eq!(results[3]["lookupText"], cases[3]["expect"], "prompt lookup in the browser changed the text");
    let lookup = results[3]["lookupMetrics"].as_str().unwrap_or_default();
    eprintln!("SmolLM2 with prompt lookup in the browser: {lookup}");
    assert!(lookup.contains("speculative (prompt lookup):"), "no speculative statistics on the page: {lookup}");
    assert_eq!(results[7]["picker"], true, "the model picker lists SmolLM2 with its size, cached");
    assert_eq!(results[8]["chat"], true);
    assert_eq!(results[4]["badFile"], true);
    assert_eq!(results[5]["stop"], true);
    assert_eq!(results[6]["source"], "cache", "the reload read the model from Cache Storage");
    assert_eq!(results[6]["model"], common::SMOLLM2_FILE);
    // Streamed: the wasm heap never held the file (the whole-file load needed more than twice
    // its size there). The renderer's and GPU process's peaks are logged for the report.
    let file_mb = std::fs::metadata(&qwen).unwrap().len() as f64 / 1e6;
    assert_eq!(results[2]["model"], qwen_file);
    let wasm_mb = results[2]["wasmMb"].as_f64().expect("the page reports its wasm heap");
    eprintln!("{qwen_file}: wasm heap {wasm_mb} MB for a {file_mb:.0} MB file; peak resident MB {}", results[2]["peakMb"]);
    assert!(wasm_mb < file_mb, "wasm heap {wasm_mb} MB after loading a {file_mb:.0} MB file: was it streamed?");
    assert!(root.join("target/test-artifacts/web-demo.png").is_file());
}

/// The native runtime's answer to an OpenAI chat body, validated and turned into a request
/// by the same code the browser package runs (`api::parse_request`).
fn native_chat(model: &Path, body: &serde_json::Value) -> lantern::engine::Generation {
    native_api(model, lantern::api::Endpoint::Chat, body)
}

/// The native runtime's answer to an OpenAI body for `endpoint`, validated and turned into a
/// request by the same code the browser package runs (`api::parse_request`).
fn native_api(model: &Path, endpoint: lantern::api::Endpoint, body: &serde_json::Value) -> lantern::engine::Generation {
    let loaded = lantern::model::load::load_path(model).unwrap();
    let tok = std::sync::Arc::new(loaded.tokenizer.unwrap());
    let mut m =
        pollster::block_on(GpuModel::load(common::gpu(), &loaded.weights, ModelOptions { max_seqs: 1, ..Default::default() })).unwrap();
    let a = &m.kv.alloc;
    let served = lantern::api::ServedModel {
        template: tok.chat_template().map_err(|e| e.to_string()),
        stop_ids: lantern::engine::generate::default_stop_ids(&m.config.eos_token_ids, &tok),
        vocab: m.config.vocab_size,
        context: a.config.context,
        kv_pages_total: a.total_pages(),
        page_size: a.config.page_size.max(1),
        aliases: vec![],
        model_id: "native".into(),
        speculation: Default::default(),
        max_seqs: 1,
        embedding_dims: m.config.hidden_size,
        token_bytes: Default::default(),
        tokenizer: tok.clone(),
    };
    let v = lantern::api::parse_request(&served, endpoint, &serde_json::to_vec(body).unwrap()).unwrap();
    let req = v.request(&served, 0);
    pollster::block_on(generate(&mut m, &tok, &req, |_| true)).unwrap()
}

#[test]
fn npm_package_in_an_app_in_chromium_answers_as_native_does() {
    // The packed tarball (scripts/web.sh test-deps packs it and installs it into
    // tests/web-package as an app would), bundled with esbuild by the app's own build, driven
    // in Chromium: a streamed chat answer, json_schema, a forced tool call, an aborted stream,
    // two requests at once, the official openai client through engine.fetch, typed errors.
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let app = root.join("tests/web-package");
    assert!(
        app.join("node_modules/lantern-web/lantern_bg.wasm").is_file(),
        "the lantern-web tarball is not installed in tests/web-package: scripts/web.sh test-deps does it"
    );
    let build = Command::new("node").arg(app.join("build.mjs")).output().expect("node");
    assert!(build.status.success(), "esbuild: {}", String::from_utf8_lossy(&build.stderr));
    // The package's types: a TypeScript app's calls type-check (strict) against index.d.ts.
    let tsc = Command::new(app.join("node_modules/.bin/tsc"))
        .current_dir(&app)
        .args(["--noEmit", "--strict", "--target", "es2022", "--module", "es2022", "--moduleResolution", "bundler"])
        .args(["--lib", "es2022,dom,dom.asynciterable", "typed.ts"])
        .output()
        .expect("tsc (tests/web-package's devDependencies)");
    assert!(tsc.status.success(), "typed.ts does not type-check: {}", String::from_utf8_lossy(&tsc.stdout));

    let dir = root.join("target/test-artifacts/web-package-models");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let smol = dir.join(common::SMOLLM2_FILE);
    std::fs::hard_link(common::smollm2_gguf(), &smol).or_else(|_| std::fs::copy(common::smollm2_gguf(), &smol).map(|_| ())).unwrap();
    let bytes = std::fs::read(&smol).unwrap();
    std::fs::write(dir.join("truncated.gguf"), &bytes[..bytes.len() / 30]).unwrap();
    let prompt = "What is the capital of France?";
    let config = serde_json::json!({ "model": "smollm2-135m", "prompt": prompt, "maxTokens": 8, "truncated": "truncated.gguf" });
    let config_path = dir.join("config.json");
    std::fs::write(&config_path, config.to_string()).unwrap();

    let out = Command::new("node")
        .arg(app.join("run.mjs"))
        .arg("--models")
        .arg(&dir)
        .arg("--config")
        .arg(&config_path)
        // Chromium finds SwiftShader by itself; a Vulkan ICD pin would hide its adapter.
        .env_remove("VK_DRIVER_FILES")
        .env_remove("VK_ICD_FILENAMES")
        .output()
        .expect("node");
    eprintln!("{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("the package test printed no report ({e}): {}", String::from_utf8_lossy(&out.stdout)));
    assert!(out.status.success() && report["failed"].is_null(), "package test failed: {}", report["failed"]);
    let c = &report["checks"];

    // Greedy answers equal the native runtime's for the same OpenAI body.
    let body = |max_tokens: usize| serde_json::json!({ "model": "native", "messages": [{ "role": "user", "content": prompt }], "max_tokens": max_tokens, "temperature": 0 });
    let native8 = native_chat(&smol, &body(8)).text;
    let native4 = native_chat(&smol, &body(4)).text;
    eprintln!("native: {native8:?} / {native4:?}");
    assert_eq!(c["stream"]["text"], native8.as_str(), "streamed chat answer");
    assert_eq!(c["openai_client"]["text"], native8.as_str(), "openai client, whole");
    assert_eq!(c["openai_client"]["streamed"], native8.as_str(), "openai client, streamed");
    assert_eq!(c["two_at_once"]["a"], native4.as_str(), "one of two requests batched together");
    assert_eq!(c["tool_call"]["finish"], "tool_calls");
    assert_eq!(c["abort"]["code"], "aborted");
    let e = &c["errors"];
    assert_eq!(
        (e["missing"]["code"].as_str(), e["truncated"]["code"].as_str(), e["tooSmall"]["code"].as_str()),
        (Some("download_failed"), Some("bad_model"), Some("out_of_memory")),
        "{e}"
    );
    assert!(e["tooSmall"]["message"].as_str().unwrap_or("").contains("does not fit"), "{e}");
}

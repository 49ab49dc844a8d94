//! The `lantern` binary as a user runs it: `run --json` on the real model, `devices`, and
//! clear failures for bad arguments.

mod common;

use std::process::Command;

fn lantern() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_lantern"));
    c.env("LANTERN_OFFLINE", "1");
    c
}

#[test]
fn run_json_reports_ids_text_and_metrics() {
    let out =
        lantern().args(["run", "Once upon a time", "--max-tokens", "3", "--json", "--model"]).arg(common::smollm2_gguf()).output().unwrap();
    assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object on stdout");
    // "Once upon a time" is 4 tokens for SmolLM2 (no BOS added).
    assert_eq!(v["prompt_ids"].as_array().unwrap().len(), 4);
    assert_eq!(v["output_ids"].as_array().unwrap().len(), 3);
    assert_eq!(v["finish_reason"], "length");
    assert!(!v["text"].as_str().unwrap().is_empty());
    assert!(v["ttft_ms"].as_f64().unwrap() > 0.0);
    assert!(v["tpot_ms"].as_f64().unwrap() > 0.0);
    assert!(v["tokens_per_s"].as_f64().unwrap() > 0.0);
    assert!(v["adapter"]["name"].as_str().is_some());
    assert_eq!(v["dispatches_per_decode_step"], 183);
    // Weights by dtype with their scales, and every allocation explained.
    let m = &v["memory"];
    let q4 = &m["weights"]["q4g32"];
    assert_eq!(q4["bytes"].as_u64().unwrap() + q4["scale_bytes"].as_u64().unwrap(), 66_355_200);
    assert_eq!(m["weights"]["q8g32"]["scale_bytes"].as_u64().unwrap(), 49152 * 18 * 2);
    // Tiled textures' padding (CPU adapters with 8-lane subgroups) is reported beside them.
    assert!(q4["padding"].as_u64().unwrap() < 66_355_200 / 100 * 3, "q4 padding {}", q4["padding"]);
    let total: u64 =
        ["window_padding", "kv_cache", "workspace", "uniforms", "readback"].iter().map(|k| m[k].as_u64().unwrap()).sum::<u64>()
            + m["weights"]
                .as_object()
                .unwrap()
                .values()
                .map(|d| d["bytes"].as_u64().unwrap() + d["scale_bytes"].as_u64().unwrap() + d["padding"].as_u64().unwrap())
                .sum::<u64>();
    assert_eq!(m["ledger_bytes"].as_u64().unwrap(), total);
}

/// `info` needs no GPU: parameters and bytes by dtype in the file and after a native load.
#[test]
fn info_reports_bytes_by_dtype_without_a_gpu() {
    let out = lantern().args(["info", "--json", "--model"]).arg(common::smollm2_gguf()).output().unwrap();
    assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object on stdout");
    assert_eq!(v["parameters"], 134_515_008u64);
    assert_eq!(v["file_bytes_by_dtype"]["q4_1"]["tensors"], 210);
    assert_eq!(v["gpu_weight_bytes"], 96_576_768u64);
    assert_eq!(v["gpu_weight_bytes_by_dtype"]["q4g32"]["scale_bytes"].as_u64().unwrap(), 13_271_040);
}

#[test]
fn run_streams_text_and_prints_metrics_on_stderr() {
    let out =
        lantern().args(["run", "The capital of France is", "--max-tokens", "2", "--model"]).arg(common::smollm2_gguf()).output().unwrap();
    assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("TTFT") && err.contains("TPOT") && err.contains("tok/s"), "{err}");
    assert!(!out.stdout.is_empty());
}

#[test]
fn devices_lists_adapters_as_json() {
    let out = lantern().args(["devices", "--json"]).output().unwrap();
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let a = &v.as_array().unwrap()[0];
    for k in ["name", "backend", "device_type", "driver", "features", "limits"] {
        assert!(!a[k].is_null(), "missing {k}");
    }
}

#[test]
fn missing_model_file_fails_with_its_path() {
    let out = lantern().args(["run", "hi", "--model", "/nonexistent/model.gguf"]).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("/nonexistent/model.gguf"), "{err}");
}

#[test]
fn corrupt_gguf_fails_cleanly() {
    let dir = std::env::temp_dir().join(format!("lantern-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join("bad.gguf");
    std::fs::write(&p, b"GGUF\x03\x00\x00\x00garbage").unwrap();
    let out = lantern().args(["run", "hi", "--model"]).arg(&p).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("bad.gguf") && !err.contains("panicked"), "{err}");
}

/// `lantern bench` on the real model: a closed-loop sweep (1 and 3 in flight, shared prefix)
/// and a Poisson run; the table, the JSON (every request's timestamps and the summary) and
/// the SVG agree with the workload.
#[test]
fn bench_runs_a_workload_and_writes_json_and_svg() {
    let dir = std::env::temp_dir().join(format!("lantern-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (json, svg) = (dir.join("b.json"), dir.join("b.svg"));
    let out = lantern()
        .args(["bench", "--requests", "3", "--prompt-len", "6..10", "--output-len", "3", "--shared-prefix", "16", "--sweep", "1,3"])
        .args(["--slo-ttft-ms", "100000", "--slo-tpot-ms", "100000", "--json"])
        .arg(&json)
        .arg("--plot")
        .arg(&svg)
        .arg("--model")
        .arg(common::smollm2_gguf())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "stdout: {stdout}\nstderr: {}", String::from_utf8_lossy(&out.stderr));
    for needle in ["TTFT", "ITL", "TPOT", "E2E", "goodput: 3/3", "throughput against latency"] {
        assert!(stdout.contains(needle), "{needle:?} missing from:\n{stdout}");
    }
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let runs = v["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 2);
    for run in runs {
        let reqs = run["requests"].as_array().unwrap();
        assert_eq!(reqs.len(), 3);
        for r in reqs {
            let toks = r["token_ms"].as_array().unwrap();
            assert_eq!(toks.len(), 3, "exactly --output-len tokens");
            let p = r["prompt_tokens"].as_u64().unwrap();
            assert!((22..=26).contains(&p), "16 shared + 6..10 tokens: {p}");
            assert!(r["arrival_ms"].as_f64().unwrap() <= toks[0].as_f64().unwrap());
            assert!(toks[2].as_f64().unwrap() <= r["finished_ms"].as_f64().unwrap() + 1e-6);
        }
        let s = &run["summary"];
        assert_eq!(s["output_tokens"], 9);
        assert_eq!(s["met_slo"], 3);
        assert!(s["output_tokens_per_s"].as_f64().unwrap() > 0.0);
    }
    // The later requests of a run reuse the shared prefix's full page.
    assert!(runs[0]["summary"]["cached_prompt_tokens"].as_u64().unwrap() >= 16);
    let svg_text = std::fs::read_to_string(&svg).unwrap();
    assert!(svg_text.starts_with("<svg") && svg_text.trim_end().ends_with("</svg>"));
    assert!(svg_text.matches("<polyline").count() >= 6, "CDFs and throughput curves drawn");

    // Open loop: Poisson arrivals.
    let out = lantern()
        .args(["bench", "--requests", "3", "--prompt-len", "8", "--output-len", "2", "--rate", "20", "--model"])
        .arg(common::smollm2_gguf())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && stdout.contains("Poisson arrivals at 20 req/s") && stdout.contains("3 requests in"), "{stdout}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The driver's pipeline cache persists between processes: the first run of a fresh cache
/// folder compiles and saves it, the second hands the saved data to the driver, and a
/// damaged file is refused (never given to the driver) and rewritten.
#[test]
fn pipeline_cache_is_saved_then_loaded_by_the_next_process() {
    let dir = std::env::temp_dir().join(format!("lantern-cli-pipelines-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let run = || {
        let out = lantern()
            .env("LANTERN_CACHE_DIR", &dir)
            .args(["run", "Hi", "--max-tokens", "1", "--json", "--model"])
            .arg(common::smollm2_gguf())
            .output()
            .unwrap();
        assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        v["pipelines"].clone()
    };
    let first = run();
    assert!(first["compiled"].as_u64().unwrap() > 0, "{first}");
    assert_eq!(first["driver_cache"]["state"], "empty", "{first}");
    let files: Vec<_> = std::fs::read_dir(dir.join("pipelines")).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(files.len(), 1, "one cache file per adapter: {files:?}");
    let saved = std::fs::read(&files[0]).unwrap();
    let payload = lantern::gpu::pipeline::unseal(&saved).expect("a sealed cache file");

    let second = run();
    assert_eq!(second["driver_cache"]["state"], "loaded", "{second}");
    assert_eq!(second["driver_cache"]["bytes"].as_u64().unwrap(), payload.len() as u64);

    // A torn write: refused with a reason, then replaced by a good file.
    std::fs::write(&files[0], &saved[..saved.len() / 2]).unwrap();
    let third = run();
    assert_eq!(third["driver_cache"]["state"], "rejected", "{third}");
    assert!(third["driver_cache"]["reason"].as_str().unwrap().contains("truncated"), "{third}");
    assert!(lantern::gpu::pipeline::unseal(&std::fs::read(&files[0]).unwrap()).is_ok());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn models_lists_the_catalogue_and_what_is_downloaded() {
    let dir = std::env::temp_dir().join(format!("lantern-models-{}", std::process::id()));
    let models = dir.join("models");
    std::fs::create_dir_all(&models).unwrap();
    let list = |dir: &std::path::Path| -> Vec<serde_json::Value> {
        let out = lantern().args(["models", "--json"]).env("LANTERN_CACHE_DIR", dir).output().unwrap();
        assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap().as_array().unwrap().clone()
    };
    let v = list(&dir);
    let names: Vec<&str> = v.iter().map(|m| m["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "gemma3-270m"]);
    assert!(v.iter().all(|m| m["downloaded"] == false), "an empty cache holds nothing: {v:?}");
    assert_eq!(v[3]["family"], "gemma3");
    assert_eq!(v[3]["format"], "Q4_K_M");
    assert_eq!(v[0]["default"], true);
    // A file of the right size with the sidecar a completed fetch writes counts; a file of
    // the wrong size does not.
    let spec = lantern::fetch::find_model("gemma3-270m").unwrap();
    let path = models.join(spec.file);
    std::fs::File::create(&path).unwrap().set_len(spec.size).unwrap();
    std::fs::write(lantern::fetch::sidecar_path(&path), format!("{}  {}\n", spec.sha256, spec.file)).unwrap();
    let short = models.join(lantern::fetch::find_model("qwen2.5-coder-0.5b").unwrap().file);
    std::fs::write(&short, b"partial").unwrap();
    let v = list(&dir);
    assert_eq!(v[3]["downloaded"], true);
    assert_eq!(v[1]["downloaded"], false);
    let text = lantern().arg("models").env("LANTERN_CACHE_DIR", &dir).output().unwrap();
    let text = String::from_utf8(text.stdout).unwrap();
    assert!(text.lines().any(|l| l.starts_with("gemma3-270m") && l.contains("yes")), "{text}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn draft_pointing_at_the_target_itself_is_refused() {
    let model = common::smollm2_gguf();
    let out = lantern().args(["run", "Hi", "--max-tokens", "2", "--model"]).arg(&model).arg("--draft").arg(&model).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("is the target model itself") && err.contains("--lookup"), "{err}");
    // --draft-tokens 0: plain decoding, and no speculative report.
    let out = lantern()
        .args(["run", "Hi", "--max-tokens", "3", "--json", "--lookup", "--draft-tokens", "0", "--model"])
        .arg(&model)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v["speculative"].is_null());
    assert_eq!(v["output_ids"].as_array().unwrap().len(), 3);
    // --draft-quant needs a draft model.
    let out = lantern().args(["run", "Hi", "--lookup", "--draft-quant", "q4", "--model"]).arg(&model).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--draft <DRAFT>"), "{err}");
}

/// SmolLM2 under a second name in a fresh temporary folder (returned with it), to draft for
/// itself without being refused as the target.
fn smollm2_as_draft(tag: &str) -> (std::path::PathBuf, std::path::PathBuf) {
    let model = common::smollm2_gguf();
    let dir = std::env::temp_dir().join(format!("lantern-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let draft = dir.join("draft.gguf");
    if std::fs::hard_link(&model, &draft).is_err() {
        std::fs::copy(&model, &draft).unwrap();
    }
    (dir, draft)
}

/// `lantern run --json` of "The capital of France is" on `model` (`max_tokens` new tokens,
/// the cache in `cache` when given, then `extra`), its output parsed.
fn run_json(model: &std::path::Path, max_tokens: usize, cache: Option<&std::path::Path>, extra: &[&str]) -> serde_json::Value {
    let mut c = lantern();
    if let Some(dir) = cache {
        c.env("LANTERN_CACHE_DIR", dir);
    }
    let out = c
        .args(["run", "The capital of France is", "--max-tokens", &max_tokens.to_string(), "--json", "--model"])
        .arg(model)
        .args(extra)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
}

#[test]
fn a_draft_requantized_at_load_leaves_greedy_output_unchanged() {
    // SmolLM2 drafting for itself (a second name for the file, so it is not refused as the
    // target), requantized to 4 bits: its drafts may differ from the target's choices, and
    // the output must still be plain greedy decoding's.
    let model = common::smollm2_gguf();
    let (dir, draft) = smollm2_as_draft("draft-quant");
    let run = |extra: &[&str]| run_json(&model, 12, None, extra);
    let plain = run(&[]);
    let spec = run(&["--draft", draft.to_str().unwrap(), "--draft-quant", "q4", "--draft-tokens", "3"]);
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(plain["output_ids"], spec["output_ids"]);
    let sp = &spec["speculative"];
    assert_eq!(sp["drafter"], "model", "{spec}");
    assert!(sp["proposed"].as_u64().unwrap() > 0 && sp["accepted"].as_u64().unwrap() > 0, "{sp}");
}

/// Adaptive speculation's step costs: the first run measures them and keeps them per adapter
/// and model; a later run reads them, and where they show no draft could pay it does not
/// even load the draft model and decodes plainly (saying why), with the same tokens.
#[test]
fn speculation_keeps_its_measured_costs_and_skips_a_draft_that_cannot_pay() {
    let model = common::smollm2_gguf();
    let (dir, draft) = smollm2_as_draft("costs-cli");
    let cache = dir.join("cache");
    let run = |extra: &[&str]| run_json(&model, 6, Some(&cache), extra);
    let plain = run(&[]);
    let first = run(&["--draft", draft.to_str().unwrap()]);
    assert_eq!(plain["output_ids"], first["output_ids"]);
    assert!(first["speculative"]["warmup_ms"].as_f64().unwrap() > 0.0, "{}", first["speculative"]);
    // One cost file for the target, one for the draft, under the adapter's folder.
    let files: Vec<std::path::PathBuf> = std::fs::read_dir(cache.join("costs"))
        .unwrap()
        .flat_map(|a| std::fs::read_dir(a.unwrap().path()).unwrap())
        .map(|f| f.unwrap().path())
        .collect();
    let target_file = files.iter().find(|f| f.to_string_lossy().contains("SmolLM2")).expect("the target's costs").clone();
    let draft_file = files.iter().find(|f| f.to_string_lossy().contains("draft.gguf")).expect("the draft's costs").clone();
    let kept: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&target_file).unwrap()).unwrap();
    for w in ["1", "2", "4", "8"] {
        assert!(kept["step_ms"][w].as_f64().is_some_and(|v| v > 0.0), "width {w}: {kept}");
    }
    // The second run reads them: nothing to measure.
    let second = run(&["--draft", draft.to_str().unwrap()]);
    assert_eq!(second["speculative"]["warmup_ms"].as_f64(), Some(0.0), "{}", second["speculative"]);
    assert_eq!(plain["output_ids"], second["output_ids"]);
    // Costs where every extra token in a step costs a whole step: the draft is not loaded.
    std::fs::write(&target_file, r#"{"version": 1, "step_ms": {"1": 10.0, "2": 20.0, "4": 40.0, "8": 80.0}}"#).unwrap();
    std::fs::write(&draft_file, r#"{"version": 1, "step_ms": {"1": 2.0, "2": 3.0}}"#).unwrap();
    let skipped = run(&["--draft", draft.to_str().unwrap()]);
    let sp = &skipped["speculative"];
    assert!(sp["plain_reason"].as_str().is_some_and(|r| r.contains("cannot pay") && r.contains("not loaded")), "{sp}");
    assert_eq!(sp["proposed"], 0, "{sp}");
    assert_eq!(plain["output_ids"], skipped["output_ids"]);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `synth`: the header alone (a few MB) expands into a file of the real one's size with the
/// same metadata and tensor table, which loads and decodes (`--ignore-eos`: exactly the
/// tokens asked for); a truncated header is refused by name.
#[test]
fn synth_rebuilds_a_model_from_its_header_and_it_runs() {
    let dir = std::env::temp_dir().join(format!("lantern-synth-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let real = common::smollm2_gguf();
    let head = dir.join("smollm2.ggufh");
    let out = lantern().args(["synth", "--header-only", "--out"]).arg(&head).arg("--like").arg(&real).output().unwrap();
    assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    let head_len = std::fs::metadata(&head).unwrap().len();
    let real_bytes = std::fs::read(&real).unwrap();
    assert!(
        head_len < 4 << 20 && real_bytes.starts_with(&std::fs::read(&head).unwrap()),
        "the header is the file's first {head_len} bytes"
    );
    let synth = dir.join("smollm2-synth.gguf");
    let out = lantern().args(["synth", "--out"]).arg(&synth).arg("--like").arg(&head).output().unwrap();
    assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    let synth_bytes = std::fs::read(&synth).unwrap();
    assert_eq!(synth_bytes.len(), real_bytes.len());
    assert_eq!(synth_bytes[..head_len as usize], real_bytes[..head_len as usize]);
    assert_ne!(synth_bytes[head_len as usize..], real_bytes[head_len as usize..], "the weights are generated");
    let out =
        lantern().args(["run", "Once upon a time", "--max-tokens", "5", "--ignore-eos", "--json", "--model"]).arg(&synth).output().unwrap();
    assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["output_ids"].as_array().unwrap().len(), 5);
    assert_eq!(v["finish_reason"], "length");
    let cut = dir.join("cut.ggufh");
    std::fs::write(&cut, &real_bytes[..1000]).unwrap();
    let out = lantern().args(["synth", "--out"]).arg(dir.join("x.gguf")).arg("--like").arg(&cut).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cut.ggufh") && err.contains("truncated"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// On wgpu's noop backend a run decodes exactly --max-tokens and reports the host's work per
/// token: one submit and one readback, no bind group or buffer created.
#[test]
fn run_on_the_noop_backend_reports_host_costs() {
    let out = lantern()
        .args(["run", "Once upon a time", "--max-tokens", "24", "--backend", "noop", "--json", "--model"])
        .arg(common::smollm2_gguf())
        .output()
        .unwrap();
    assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["noop"], true);
    assert_eq!(v["adapter"]["backend"], "noop");
    assert_eq!(v["output_ids"].as_array().unwrap().len(), 24, "EOS (token 0 from the zeroed readback) is ignored on noop");
    let h = &v["host"];
    assert_eq!(h["tokens"], 23);
    assert_eq!((h["submits_per_token"].as_f64(), h["readbacks_per_token"].as_f64()), (Some(1.0), Some(1.0)), "{h}");
    assert_eq!((h["bind_groups_per_token"].as_f64(), h["buffers_per_token"].as_f64()), (Some(0.0), Some(0.0)), "{h}");
    assert_eq!(h["dispatches_per_token"].as_f64(), v["dispatches_per_decode_step"].as_f64());
    assert!(h["ms_per_token"].as_f64().unwrap() > 0.0);
}

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
    let out = lantern()
        .args(["run", "Once upon a time", "--max-tokens", "3", "--json", "--model"])
        .arg(common::smollm2_gguf())
        .output()
        .unwrap();
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
}

#[test]
fn run_streams_text_and_prints_metrics_on_stderr() {
    let out = lantern()
        .args(["run", "The capital of France is", "--max-tokens", "2", "--model"])
        .arg(common::smollm2_gguf())
        .output()
        .unwrap();
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
    let out = lantern()
        .args(["run", "hi", "--model", "/nonexistent/model.gguf"])
        .output()
        .unwrap();
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

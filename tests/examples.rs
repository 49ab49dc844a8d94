//! The embedding examples as a user runs them: the headless one generates the same tokens as
//! `lantern run` for the same prompt while keeping each frame call within its budget plus a
//! stated margin, and the windowed one runs under Xvfb, streams the same tokens into its
//! window and saves a screenshot (kept as `target/test-artifacts/windowed.png`).

mod common;

use std::path::PathBuf;
use std::process::Command;

const PROMPT: &str = "Once upon a time";
const TOKENS: &str = "8";
const BUDGET_MS: f64 = 4.0;
/// On lavapipe a submission also runs (or waits for) the GPU work queued before it, the
/// host's own frame included, on the same two CPU cores: a call can overrun its budget by
/// one host frame plus one dispatch. The margin states how much that may be.
const MARGIN_MS: f64 = 100.0;

/// An example binary next to the `lantern` binary Cargo built for this test run.
fn example(name: &str) -> PathBuf {
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_lantern"));
    let path = bin.parent().unwrap().join("examples").join(name);
    assert!(path.is_file(), "{} is missing: `cargo test` builds the examples (or `cargo build --release --examples`)", path.display());
    path
}

fn json_of(out: std::process::Output, what: &str) -> serde_json::Value {
    assert!(out.status.success(), "{what} failed: {}\n{}", String::from_utf8_lossy(&out.stderr), String::from_utf8_lossy(&out.stdout));
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{what}: not one JSON object ({e}): {}", String::from_utf8_lossy(&out.stdout)))
}

fn lantern_run_ids() -> Vec<u32> {
    let out = Command::new(env!("CARGO_BIN_EXE_lantern"))
        .env("LANTERN_OFFLINE", "1")
        .args(["run", PROMPT, "--max-tokens", TOKENS, "--json", "--model"])
        .arg(common::smollm2_gguf())
        .output()
        .unwrap();
    common::ids(&json_of(out, "lantern run")["output_ids"])
}

fn check_frames(v: &serde_json::Value, what: &str) {
    let f = &v["frames"];
    let max = f["call_ms"]["max"].as_f64().unwrap();
    let (frames, steps) = (f["frames"].as_u64().unwrap(), f["steps"].as_u64().unwrap());
    eprintln!(
        "{what}: {frames} frames, {steps} steps, call ms p50 {:.2} max {max:.2}, frame ms p50 {:.2}",
        f["call_ms"]["p50"], f["frame_ms"]["p50"]
    );
    assert!(max <= BUDGET_MS + MARGIN_MS, "{what}: a frame call took {max:.1} ms, budget {BUDGET_MS} + margin {MARGIN_MS}");
    assert!(frames > steps, "{what}: steps were spread over frames ({frames} frames, {steps} steps)");
}

#[test]
fn headless_example_keeps_the_budget_and_matches_lantern_run() {
    let want = lantern_run_ids();
    let out = Command::new(example("headless"))
        .env("LANTERN_OFFLINE", "1")
        .args([PROMPT, "--max-tokens", TOKENS, "--budget-ms", &BUDGET_MS.to_string(), "--json", "--model"])
        .arg(common::smollm2_gguf())
        .output()
        .unwrap();
    let v = json_of(out, "headless example");
    assert_eq!(common::ids(&v["output_ids"]), want, "the frame-budgeted tokens equal `lantern run`'s");
    assert_eq!(v["finish_reason"], "length");
    check_frames(&v, "headless");
}

#[test]
fn windowed_example_runs_under_xvfb_and_saves_a_screenshot() {
    let want = lantern_run_ids();
    let shot = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/test-artifacts/windowed.png");
    let _ = std::fs::remove_file(&shot);
    // xvfb-run (Debian's xvfb, installed by scripts/setup.sh) picks a free display.
    let out = Command::new("xvfb-run")
        .args(["-a", "-s", "-screen 0 1280x720x24"])
        .arg(example("windowed"))
        .env("LANTERN_OFFLINE", "1")
        .args([PROMPT, "--max-tokens", TOKENS, "--budget-ms", &BUDGET_MS.to_string(), "--json", "--screenshot"])
        .arg(&shot)
        .arg("--model")
        .arg(common::smollm2_gguf())
        .output()
        .expect("xvfb-run (Debian package xvfb; scripts/setup.sh installs it)");
    let v = json_of(out, "windowed example under Xvfb");
    assert_eq!(common::ids(&v["output_ids"]), want, "the window's tokens equal `lantern run`'s");
    check_frames(&v, "windowed");

    // The screenshot: the window's size, the animation (many colours) and the overlay text
    // (white glyph pixels in the band at the bottom).
    let decoder = png::Decoder::new(std::io::BufReader::new(std::fs::File::open(&shot).expect("screenshot written")));
    let mut reader = decoder.read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size().unwrap()];
    let info = reader.next_frame(&mut buf).unwrap();
    assert_eq!((info.width, info.height), (960, 540));
    let px = |x: u32, y: u32| {
        let i = ((y * info.width + x) * 4) as usize;
        [buf[i], buf[i + 1], buf[i + 2]]
    };
    let mut colours = std::collections::HashSet::new();
    for y in (0..300).step_by(7) {
        for x in (0..960).step_by(7) {
            colours.insert(px(x, y));
        }
    }
    assert!(colours.len() > 200, "the animation is drawn ({} colours above the overlay)", colours.len());
    let band_white = (380..540).flat_map(|y| (0..960).map(move |x| (x, y))).filter(|&(x, y)| px(x, y).iter().all(|&c| c > 230)).count();
    assert!(band_white > 500, "the overlay shows text ({band_white} white pixels)");
}

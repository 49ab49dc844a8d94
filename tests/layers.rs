//! The one-way layering of ARCHITECTURE.md, checked on the source: each rule names a part of
//! `src/` and the crate modules it must not name (`crate::<module>`, in code; comments are
//! skipped). Dependencies point down: bin -> api -> eval -> engine -> model -> kernels ->
//! kv -> gpu, with the leaves below them (the CPU oracle's ops, the packed-format code of
//! `quant/`, the error type). Only `gpu/` creates devices, buffers, textures, pipelines and
//! shader modules. No GPU, no build of the library: the rules are read off the files.

use std::path::{Path, PathBuf};

/// (part of src/: a directory or a file, the crate modules it must not use, why).
const RULES: &[(&str, &[&str], &str)] = &[
    (
        "gpu",
        &["kernels", "kv", "model", "engine", "api", "eval", "web", "reference", "catalogue", "fetch"],
        "the device layer is the bottom",
    ),
    ("kv", &["kernels", "model", "engine", "api", "eval", "web", "reference"], "the cache sits below the kernels that read it"),
    ("kernels", &["model", "engine", "api", "eval", "web"], "ops know tensors and the cache layout, not models"),
    ("model", &["engine", "api", "eval", "web", "reference"], "the forward pass knows no requests, nor the test oracle"),
    ("engine", &["api", "eval", "web", "reference"], "generation knows no HTTP or evaluation, nor the test oracle"),
    ("eval", &["api", "web"], "evaluation sits below the server"),
    ("api", &["web", "eval"], "the API types (OpenAI, Anthropic, Ollama) know the engine only"),
    (
        "reference/ops.rs",
        &["gpu", "kernels", "kv", "model", "engine", "api", "eval", "web", "quant"],
        "the CPU oracle's ops are plain loops",
    ),
    ("quant/mod.rs", &["gpu", "kernels", "kv", "model", "engine", "api", "eval", "web"], "packed formats sit below the model"),
    ("quant/ggml.rs", &["gpu", "kernels", "kv", "model", "engine", "api", "eval", "web"], "ggml block formats sit below the model"),
    ("kv/plan.rs", &["gpu"], "KV sizing is plain numbers (the memory plan runs without a GPU)"),
    ("model/plan.rs", &["gpu"], "the memory plan runs without a GPU"),
];

/// wgpu calls that make GPU objects: only src/gpu/ may make them.
const GPU_ONLY: &[&str] = &[
    "create_buffer(",
    "create_buffer_init(",
    "create_texture(",
    "create_shader_module",
    "create_compute_pipeline(",
    "request_adapter(",
    "request_device(",
];

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The code of a file without its comments (the part of each line before `//`).
fn code(path: &Path) -> Vec<(usize, String)> {
    let text = std::fs::read_to_string(path).unwrap();
    text.lines().enumerate().map(|(i, l)| (i + 1, l.split("//").next().unwrap_or("").to_string())).collect()
}

/// The `crate::<module>` names on a line.
fn crate_modules(line: &str) -> Vec<&str> {
    line.match_indices("crate::")
        .filter(|(i, _)| *i == 0 || !line.as_bytes()[i - 1].is_ascii_alphanumeric() && line.as_bytes()[i - 1] != b'_')
        .map(|(i, _)| {
            let rest = &line[i + 7..];
            let end = rest.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(rest.len());
            &rest[..end]
        })
        .collect()
}

#[test]
fn no_layer_names_a_layer_above_it() {
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut broken = Vec::new();
    let mut checked = 0;
    for f in &files {
        let rel = f.strip_prefix(&src).unwrap().to_string_lossy().replace('\\', "/");
        let applies: Vec<_> = RULES
            .iter()
            .filter(|(part, _, _)| rel == *part || rel.starts_with(&format!("{part}/")) || rel == format!("{part}.rs"))
            .collect();
        for (n, line) in code(f) {
            for m in crate_modules(&line) {
                checked += 1;
                for (part, banned, why) in &applies {
                    if banned.contains(&m) {
                        broken.push(format!("src/{rel}:{n}: `crate::{m}` in {part} ({why}): {}", line.trim()));
                    }
                }
            }
            if !rel.starts_with("gpu/") {
                for call in GPU_ONLY {
                    if line.contains(call) {
                        broken.push(format!("src/{rel}:{n}: `{call}` outside src/gpu/: {}", line.trim()));
                    }
                }
            }
        }
    }
    assert!(checked > 100, "only {checked} crate paths found: is the scan reading src/?");
    assert!(broken.is_empty(), "layering broken:\n{}", broken.join("\n"));
}

/// The scan itself: the paths it finds on a line, and the ones it must not.
#[test]
fn the_scan_reads_crate_paths_and_skips_comments() {
    assert_eq!(crate_modules("use crate::kv::plan::KvDtype; let x = crate::gpu::f();"), ["kv", "gpu"]);
    assert!(crate_modules("use lantern_crate::model;").is_empty());
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("layers-scan.rs");
    std::fs::write(&dir, "// crate::model in a comment\nuse crate::engine; // crate::web\n").unwrap();
    let lines: Vec<Vec<String>> = code(&dir).iter().map(|(_, l)| crate_modules(l).into_iter().map(String::from).collect()).collect();
    assert_eq!(lines, vec![Vec::<String>::new(), vec!["engine".to_string()]]);
}

/// No environment variable picks a kernel: the layouts come from the adapter and
/// `gpu::KernelOptions` (the library's and the CLI's choice), never from `std::env` read in
/// the GPU and kernel layers or the forward pass.
#[test]
fn no_kernel_is_chosen_by_an_environment_variable() {
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    for dir in ["gpu", "kernels", "model"] {
        rust_files(&src.join(dir), &mut files);
    }
    assert!(files.len() > 20, "only {} files under src/gpu, src/kernels, src/model", files.len());
    let mut found = Vec::new();
    for f in &files {
        for (n, line) in code(f) {
            // The backend choice (`WGPU_BACKEND`, wgpu's own convention) is not a kernel.
            if (line.contains("env::var") || line.contains("env!(\"LANTERN")) && !line.contains("WGPU_BACKEND") {
                found.push(format!("{}:{n}: {}", f.display(), line.trim()));
            }
        }
    }
    assert!(found.is_empty(), "kernels chosen from the environment (use gpu::KernelOptions):\n{}", found.join("\n"));
}

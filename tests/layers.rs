//! The one-way layering of ARCHITECTURE.md, checked on the source: each rule names a part of
//! `src/` and the crate paths it must not name (`crate::<module>` or a deeper path such as
//! `crate::quant::quantize`, in code, grouped imports `crate::{a, b::c}` included; comments
//! are skipped). Dependencies point down: bin -> web -> api -> eval -> engine -> the
//! quantizer (`quant::{quantize, awq, safetensors}`) -> model -> kernels -> kv -> gpu, with
//! the leaves beside them: the packed formats (`quant/mod.rs`, `ggml.rs`, `pool.rs`, below
//! model), the CPU oracle (`reference/`, which reads the model's types but no GPU), the
//! catalogue and the download (`catalogue.rs`, `fetch.rs`: plain data). The error type
//! (`error.rs`) wraps every layer's errors, so it names them and no rule covers it. Only
//! `gpu/` creates devices, buffers, textures, pipelines and shader modules. No GPU, no build
//! of the library: the rules are read off the files.

use std::path::{Path, PathBuf};

/// (part of src/: a directory or a file, the crate paths it must not use, why).
const RULES: &[(&str, &[&str], &str)] = &[
    (
        "gpu",
        &["kernels", "kv", "model", "engine", "api", "eval", "web", "reference", "catalogue", "fetch", "quant::quantize", "quant::awq"],
        "the device layer is the bottom",
    ),
    (
        "kv",
        &["kernels", "model", "reference", "quant::quantize", "quant::awq", "engine", "api", "eval", "web"],
        "the cache sits below the kernels that read it",
    ),
    (
        "kernels",
        &["model", "reference", "quant::quantize", "quant::awq", "engine", "api", "eval", "web"],
        "ops know tensors and the cache layout, not models",
    ),
    (
        "model",
        &["reference", "quant::quantize", "quant::awq", "quant::safetensors", "engine", "api", "eval", "web"],
        "the forward pass knows no requests, nor the test oracle, nor the quantizer",
    ),
    ("engine", &["api", "eval", "web", "reference"], "generation knows no HTTP or evaluation, nor the test oracle"),
    ("eval", &["api", "web"], "evaluation sits below the server"),
    ("api", &["web", "eval"], "the API types (OpenAI, Anthropic, Ollama) know the engine only"),
    ("web", &["eval", "reference", "fetch"], "the browser API runs the engine; the download is native"),
    (
        "reference/ops.rs",
        &["gpu", "kernels", "kv", "model", "engine", "api", "eval", "web", "quant"],
        "the CPU oracle's ops are plain loops",
    ),
    ("reference", &["gpu", "kernels", "kv", "engine", "api", "eval", "web", "fetch"], "the CPU oracle runs without a GPU"),
    ("quant/mod.rs", &["gpu", "kernels", "kv", "model", "engine", "api", "eval", "web"], "packed formats sit below the model"),
    ("quant/ggml.rs", &["gpu", "kernels", "kv", "model", "engine", "api", "eval", "web"], "ggml block formats sit below the model"),
    (
        "quant/gptq.rs",
        &["gpu", "kernels", "kv", "model", "engine", "api", "eval", "web", "reference"],
        "GPTQ works on matrices and Hessians, below the model",
    ),
    (
        "quant/sparse.rs",
        &["gpu", "kernels", "kv", "model", "engine", "api", "eval", "web", "reference"],
        "2:4 pruning works on matrices and input norms, below the model",
    ),
    (
        "quant/pool.rs",
        &["gpu", "kernels", "kv", "model", "engine", "api", "eval", "web", "reference"],
        "the CPU loops' thread split is a leaf",
    ),
    ("quant/quantize.rs", &["engine", "api", "eval", "web", "fetch"], "the quantizer sits above the model, below generation"),
    ("quant/awq", &["engine", "api", "eval", "web", "fetch", "gpu", "kernels", "kv"], "AWQ calibrates on the CPU oracle, below generation"),
    ("quant/safetensors.rs", &["engine", "api", "eval", "web", "fetch", "gpu", "kernels", "kv"], "writing packed checkpoints is host work"),
    (
        "catalogue.rs",
        &["gpu", "kernels", "kv", "model", "engine", "api", "eval", "web", "reference", "quant", "fetch"],
        "the catalogue is plain data",
    ),
    (
        "fetch.rs",
        &["gpu", "kernels", "kv", "model", "engine", "api", "eval", "web", "reference", "quant"],
        "the download knows files, not models",
    ),
    ("kv/plan.rs", &["gpu"], "KV sizing is plain numbers (the memory plan runs without a GPU)"),
    ("model/plan.rs", &["gpu"], "the memory plan runs without a GPU"),
    ("model/fp8.rs", &["gpu", "kernels", "kv"], "reading FP8 checkpoints is host work"),
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

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// The paths below `crate::` that `text` names, each as `a::b::c`, and the byte offset of
/// its `crate::`: `crate::x::y` gives `x::y`; a group `crate::x::{self, y::z, w::{u, v}}`
/// gives `x`, `x::y::z`, `x::w::u`, `x::w::v` (across lines too).
fn crate_paths(text: &str) -> Vec<(usize, String)> {
    let bytes = text.as_bytes();
    let mut out = Vec::new();
    for (i, _) in text.match_indices("crate::") {
        if i > 0 && is_ident(bytes[i - 1] as char) {
            continue;
        }
        let mut found = Vec::new();
        tree(&text[i + 7..], String::new(), &mut found);
        out.extend(found.into_iter().filter(|p| !p.is_empty()).map(|p| (i, p)));
    }
    out
}

/// The paths of one use-tree starting at `rest`, each prefixed with `prefix`.
fn tree(rest: &str, prefix: String, out: &mut Vec<String>) {
    let rest = rest.trim_start();
    if let Some(group) = rest.strip_prefix('{') {
        // Split the group at its top-level commas, up to the matching brace.
        let (mut depth, mut from) = (0usize, 0usize);
        for (j, c) in group.char_indices() {
            match c {
                '{' => depth += 1,
                '}' if depth == 0 => {
                    tree(&group[from..j], prefix.clone(), out);
                    return;
                }
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    tree(&group[from..j], prefix.clone(), out);
                    from = j + 1;
                }
                _ => {}
            }
        }
        return;
    }
    let end = rest.find(|c: char| !is_ident(c)).unwrap_or(rest.len());
    let name = &rest[..end];
    if name.is_empty() {
        if !prefix.is_empty() {
            out.push(prefix);
        }
        return;
    }
    let path = match (prefix.is_empty(), name) {
        (false, "self") => prefix.clone(),
        (true, _) => name.to_string(),
        (false, _) => format!("{prefix}::{name}"),
    };
    match rest[end..].strip_prefix("::") {
        Some(more) => tree(more, path, out),
        None => out.push(path),
    }
}

/// Whether `path` is `banned` or below it (`quant::quantize::x` is below `quant::quantize`;
/// `quantized` is not below `quant`).
fn is_under(path: &str, banned: &str) -> bool {
    path == banned || path.starts_with(banned) && path[banned.len()..].starts_with("::")
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
        let lines = code(f);
        let text: String = lines.iter().map(|(_, l)| format!("{l}\n")).collect();
        for (at, path) in crate_paths(&text) {
            checked += 1;
            let n = text[..at].matches('\n').count() + 1;
            for (part, banned, why) in &applies {
                if let Some(b) = banned.iter().find(|b| is_under(&path, b)) {
                    broken.push(format!("src/{rel}:{n}: `crate::{path}` in {part} (not {b}: {why}): {}", lines[n - 1].1.trim()));
                }
            }
        }
        if !rel.starts_with("gpu/") {
            for (n, line) in &lines {
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

/// Every module of `src/` (each top-level directory and file but `lib.rs`, `error.rs` and
/// the binaries) is under at least one rule, so a new module cannot grow a cycle unseen.
#[test]
fn every_module_has_a_rule() {
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut uncovered = Vec::new();
    for f in &files {
        let rel = f.strip_prefix(&src).unwrap().to_string_lossy().replace('\\', "/");
        if ["lib.rs", "error.rs"].contains(&rel.as_str()) || rel.starts_with("bin/") {
            continue;
        }
        let covered = RULES.iter().any(|(part, _, _)| rel == *part || rel.starts_with(&format!("{part}/")) || rel == format!("{part}.rs"));
        if !covered {
            uncovered.push(rel);
        }
    }
    assert!(uncovered.is_empty(), "files under no layering rule: {uncovered:?}");
}

/// The scan itself: the paths it finds, grouped and nested imports, and what it must skip.
#[test]
fn the_scan_reads_crate_paths_and_skips_comments() {
    let paths = |t: &str| crate_paths(t).into_iter().map(|(_, p)| p).collect::<Vec<_>>();
    assert_eq!(paths("use crate::kv::plan::KvDtype; let x = crate::gpu::f();"), ["kv::plan::KvDtype", "gpu::f"]);
    assert!(paths("use lantern_crate::model;").is_empty());
    assert_eq!(
        paths("use crate::{\n    quant::{self, quantize::quantize_model},\n    model::ModelWeights,\n};"),
        ["quant", "quant::quantize::quantize_model", "model::ModelWeights"]
    );
    assert_eq!(paths("crate::quant::quantize::load_to_gpu_requantized(ctx)"), ["quant::quantize::load_to_gpu_requantized"]);
    assert!(is_under("quant::quantize::x", "quant::quantize") && is_under("quant", "quant"));
    assert!(!is_under("quantized", "quant") && !is_under("quant::ggml", "quant::quantize"));
    // The cycle this test exists for: model/load.rs calling the quantizer is caught.
    let banned = RULES.iter().find(|r| r.0 == "model").unwrap().1;
    assert!(paths("let q = crate::quant::quantize::quantize_model(&w);").iter().any(|p| banned.iter().any(|b| is_under(p, b))));
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("layers-scan.rs");
    std::fs::write(&dir, "// crate::model in a comment\nuse crate::engine; // crate::web\n").unwrap();
    let text: String = code(&dir).iter().map(|(_, l)| format!("{l}\n")).collect();
    assert_eq!(paths(&text), ["engine"]);
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

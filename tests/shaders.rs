//! Shader artifacts, checked with no adapter: every kernel variant is expanded, parsed and
//! validated by naga under capability sets with and without shader-f16 and subgroups,
//! translated to SPIR-V (Vulkan), MSL (Metal) and HLSL (DX12), and snapshotted with insta.

use lantern::gpu::shader::{Features, PipelineKey};
use lantern::quant::QuantKind;
use naga::valid::{Capabilities, ValidationFlags, Validator};

fn feature_sets() -> Vec<Features> {
    vec![
        Features { f16: false, subgroups: false },
        Features { f16: false, subgroups: true },
        Features { f16: true, subgroups: false },
        Features { f16: true, subgroups: true },
    ]
}

fn all_keys() -> Vec<PipelineKey> {
    let mut keys: Vec<PipelineKey> = feature_sets().into_iter().flat_map(lantern::kernels::all_variants).collect();
    keys.sort();
    keys.dedup();
    keys
}

fn parse_validate(key: &PipelineKey, caps: Capabilities) -> (naga::Module, naga::valid::ModuleInfo) {
    let src = key.expand().unwrap_or_else(|e| panic!("{}: preprocess: {e}", key.label()));
    let module = naga::front::wgsl::parse_str(&src).unwrap_or_else(|e| panic!("{}: parse: {}", key.label(), e.emit_to_string(&src)));
    let info = Validator::new(ValidationFlags::all(), caps)
        .validate(&module)
        .unwrap_or_else(|e| panic!("{}: validate: {}", key.label(), e.emit_to_string(&src)));
    (module, info)
}

#[test]
fn every_variant_validates_under_its_capabilities_and_richer_ones() {
    let keys = all_keys();
    assert!(keys.len() >= 40, "expected the full variant set, got {}", keys.len());
    for key in &keys {
        let needed = key.naga_capabilities();
        parse_validate(key, needed);
        parse_validate(key, needed | Capabilities::SHADER_FLOAT16 | Capabilities::SUBGROUP);
    }
}

#[test]
fn variants_without_optional_features_validate_with_no_capabilities() {
    // The baseline set must run where neither shader-f16 nor subgroups exist
    // (SwiftShader in Chromium has no f16).
    for key in lantern::kernels::all_variants(Features::default()) {
        assert!(!key.features.f16 && !key.features.subgroups, "{}", key.label());
        // Only the core-WebGPU f16 packing builtins, never the shader-f16 feature.
        let caps = key.naga_capabilities();
        assert!(!caps.contains(Capabilities::SHADER_FLOAT16) && !caps.contains(Capabilities::SUBGROUP));
        parse_validate(&key, caps);
    }
}

#[test]
fn subgroup_variants_are_rejected_without_the_capability() {
    let sg = lantern::kernels::all_variants(Features { f16: false, subgroups: true })
        .into_iter()
        .filter(|k| k.features.subgroups)
        .collect::<Vec<_>>();
    assert!(!sg.is_empty());
    for key in sg {
        let src = key.expand().unwrap();
        let module = naga::front::wgsl::parse_str(&src).unwrap();
        let r = Validator::new(ValidationFlags::all(), Capabilities::empty()).validate(&module);
        assert!(r.is_err(), "{} validated without SUBGROUP", key.label());
    }
}

#[test]
fn every_variant_translates_to_spirv_msl_and_hlsl() {
    for key in all_keys() {
        let (module, info) = parse_validate(&key, key.naga_capabilities());
        let spv = naga::back::spv::write_vec(&module, &info, &naga::back::spv::Options::default(), None)
            .unwrap_or_else(|e| panic!("{}: SPIR-V: {e}", key.label()));
        assert!(!spv.is_empty());
        let msl_opts = naga::back::msl::Options { lang_version: (2, 1), ..Default::default() };
        naga::back::msl::write_string(&module, &info, &msl_opts, &naga::back::msl::PipelineOptions::default())
            .unwrap_or_else(|e| panic!("{}: MSL: {e}", key.label()));
        let hlsl_opts = naga::back::hlsl::Options { shader_model: naga::back::hlsl::ShaderModel::V6_0, ..Default::default() };
        let pipeline_opts = naga::back::hlsl::PipelineOptions::default();
        let mut out = String::new();
        naga::back::hlsl::Writer::new(&mut out, &hlsl_opts, &pipeline_opts)
            .write(&module, &info, None)
            .unwrap_or_else(|e| panic!("{}: HLSL: {e}", key.label()));
        assert!(out.contains("main"));
    }
}

/// The variants whose expanded source is kept as a snapshot: with f32 weights, one per op,
/// kernel layout (the flags that pick code paths) and feature set; with packed weights, one
/// per shader file (Q4_K, on the file's plainest layout: fewest layout flags, no optional
/// features). The fusions (norm prologue, bias, residual, gathered rows, gate, GELU) are shown
/// on the fullest one (`NORM | GATED`). Every other variant is named in
/// `tests/snapshots/variants.txt` with a hash of its expanded source, so an edit to a shared
/// include changes one snapshot per file that includes it and the hashes of the variants it
/// reaches; every variant is still validated and translated above.
fn snapshotted(keys: &[PipelineKey]) -> Vec<PipelineKey> {
    use lantern::gpu::shader::{flags, WeightFormat};
    use std::collections::BTreeMap;
    let fused = flags::NORM | flags::GATED | flags::BIAS | flags::RESIDUAL | flags::GATHER | flags::GELU;
    let rank = |k: &PipelineKey| {
        let w = match k.weights {
            WeightFormat::F32 => 0,
            WeightFormat::Packed(QuantKind::Q4K) => 1,
            _ => 2,
        };
        let f = if k.flags & fused == flags::NORM | flags::GATED { 0 } else { 1 };
        let layout = (k.flags & !fused).count_ones();
        (w, f, layout, k.features.f16, k.features.subgroups, k.label())
    };
    let mut best: BTreeMap<(String, u32, bool, bool, bool), PipelineKey> = BTreeMap::new();
    for k in keys {
        let packed = k.weights.is_packed() && !k.op.reads_kv();
        let group = if packed {
            (k.file().to_string(), 0, false, false, true)
        } else {
            (k.file().to_string(), k.flags & !fused, k.features.f16, k.features.subgroups, false)
        };
        let e = best.entry(group).or_insert(*k);
        if rank(k) < rank(e) {
            *e = *k;
        }
    }
    let mut v: Vec<PipelineKey> = best.into_values().collect();
    v.sort();
    v
}

/// At most this many snapshot files and lines in them: a person can review a change to them.
/// A constant: a new layout earns its snapshot by replacing one, not by raising it.
const SNAPSHOT_FILES_MAX: usize = 60;
const SNAPSHOT_LINES_MAX: usize = 25_000;

/// The snapshot files are exactly those of the snapshotted variants (none left over from a
/// variant that is no longer snapshotted or no longer exists), within the caps.
#[test]
fn snapshot_files_are_the_snapshotted_variants() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/snapshots");
    let want: std::collections::BTreeSet<String> =
        snapshotted(&all_keys()).iter().map(|k| format!("shaders__{}.snap", k.label())).collect();
    let have: std::collections::BTreeSet<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("shaders__") && n.ends_with(".snap"))
        .collect();
    let stale: Vec<&String> = have.difference(&want).collect();
    let missing: Vec<&String> = want.difference(&have).collect();
    assert!(stale.is_empty() && missing.is_empty(), "stale snapshot files: {stale:?}\nmissing: {missing:?}");
    assert!(want.len() <= SNAPSHOT_FILES_MAX, "{} snapshot files (at most {SNAPSHOT_FILES_MAX})", want.len());
    let lines: usize = want.iter().map(|f| std::fs::read_to_string(dir.join(f)).unwrap().lines().count()).sum();
    assert!(lines <= SNAPSHOT_LINES_MAX, "{lines} snapshot lines (at most {SNAPSHOT_LINES_MAX})");
}

#[test]
fn expanded_sources_snapshot() {
    for key in snapshotted(&all_keys()) {
        let src = key.expand().unwrap();
        insta::assert_snapshot!(key.label(), src);
    }
}

/// FNV-1a, 64 bits: a stable fingerprint of an expanded source.
fn fnv64(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3))
}

/// Every variant not snapshotted, by label, with the hash of its expanded source: a change
/// names the variants it reaches. `LANTERN_UPDATE_VARIANTS=1` (or insta's `INSTA_UPDATE`)
/// rewrites the file.
#[test]
fn variant_hashes_match_the_manifest() {
    let keys = all_keys();
    let shown: std::collections::BTreeSet<String> = snapshotted(&keys).iter().map(|k| k.label()).collect();
    let mut manifest = String::from("# label, FNV-1a 64 of the expanded WGSL: every variant without a snapshot file (tests/shaders.rs)\n");
    for k in keys.iter().filter(|k| !shown.contains(&k.label())) {
        manifest.push_str(&format!("{} {:016x}\n", k.label(), fnv64(&k.expand().unwrap())));
    }
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/snapshots/variants.txt");
    let update = std::env::var("LANTERN_UPDATE_VARIANTS").is_ok_and(|v| v == "1")
        || std::env::var("INSTA_UPDATE").is_ok_and(|v| v == "always" || v == "new");
    let have = std::fs::read_to_string(&path).unwrap_or_default();
    if have != manifest && update {
        std::fs::write(&path, &manifest).unwrap();
        return;
    }
    let parse = |t: &str| -> std::collections::BTreeMap<String, String> {
        t.lines().filter(|l| !l.starts_with('#')).filter_map(|l| l.split_once(' ')).map(|(a, b)| (a.to_string(), b.to_string())).collect()
    };
    let (want, got) = (parse(&have), parse(&manifest));
    let changed: Vec<&String> = got.iter().filter(|(k, v)| want.get(*k).is_some_and(|w| w != *v)).map(|(k, _)| k).collect();
    let added: Vec<&String> = got.keys().filter(|k| !want.contains_key(*k)).collect();
    let removed: Vec<&String> = want.keys().filter(|k| !got.contains_key(*k)).collect();
    assert!(
        changed.is_empty() && added.is_empty() && removed.is_empty(),
        "variants whose expanded WGSL changed: {changed:?}\nnew: {added:?}\ngone: {removed:?}\n(review, then LANTERN_UPDATE_VARIANTS=1 cargo test --test shaders)"
    );
}

#[test]
fn labels_are_unique_per_key() {
    let keys = all_keys();
    let mut labels: Vec<String> = keys.iter().map(|k| k.label()).collect();
    labels.sort();
    let n = labels.len();
    labels.dedup();
    assert_eq!(n, labels.len());
}

/// The Rust structs written into each kernel's uniforms have the size of the WGSL structs they
/// mirror, in every variant: binding 0 is the step uniform, binding 1 the op's `Params`
/// (naga's layout of the expanded source against `kernels::params_size`), whose named fields
/// sit at the offsets the Rust struct gives them (`kernels::params_fields`).
#[test]
fn uniform_structs_match_their_wgsl_mirrors() {
    let step = std::mem::size_of::<lantern::kernels::StepUniform>() as u32;
    let mut checked = 0;
    for key in all_keys() {
        let (module, _) = parse_validate(&key, key.naga_capabilities() | Capabilities::SHADER_FLOAT16 | Capabilities::SUBGROUP);
        let mut layouter = naga::proc::Layouter::default();
        layouter.update(module.to_ctx()).unwrap();
        for (_, var) in module.global_variables.iter() {
            let (Some(b), naga::AddressSpace::Uniform) = (&var.binding, var.space) else {
                continue;
            };
            let size = layouter[var.ty].size;
            let want = match (b.group, b.binding) {
                (0, 0) => step,
                (0, 1) => lantern::kernels::params_size(key.op) as u32,
                // XU: the 64 KiB windows of x and the norm weight the Rust side binds.
                (0, 15) | (0, 16) => lantern::kernels::linear::XU_WINDOW,
                // The expert matvec's experts per token.
                (0, 19) => lantern::kernels::moe::MOE_UNIFORM_BYTES,
                other => panic!("{}: unexpected uniform at {other:?}", key.label()),
            };
            assert_eq!(size, want, "{}: uniform at binding {} is {size} bytes in WGSL, {want} in Rust", key.label(), b.binding);
            // The op's Params: every named field at the same offset (padding aside).
            if (b.group, b.binding) == (0, 1) {
                let naga::TypeInner::Struct { members, .. } = &module.types[var.ty].inner else {
                    panic!("{}: binding 1 is not a struct", key.label())
                };
                let wgsl: Vec<(String, usize)> = members
                    .iter()
                    .filter_map(|m| m.name.clone().map(|n| (n, m.offset as usize)))
                    .filter(|(n, _)| !n.starts_with('_'))
                    .collect();
                let rust: Vec<(String, usize)> =
                    lantern::kernels::params_fields(key.op).into_iter().map(|(n, o)| (n.to_string(), o)).collect();
                assert_eq!(wgsl, rust, "{}: Params fields and offsets, WGSL vs Rust", key.label());
            }
            checked += 1;
        }
    }
    assert!(checked > 100, "{checked}");
}

/// Every WGSL source stays readable: no `#if` nested more than two deep, and no function
/// defined twice under different conditions (a layout that needs another version of a
/// function gets its own file).
#[test]
fn sources_nest_conditions_at_most_two_deep_and_define_each_function_once() {
    fn walk(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                walk(&p, out);
            } else if p.extension().is_some_and(|x| x == "wgsl") {
                out.push(p);
            }
        }
    }
    let mut files = Vec::new();
    walk(&std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("shaders"), &mut files);
    assert!(files.len() >= 30, "found only {} shader files", files.len());
    let mut broken = Vec::new();
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap();
        let (mut depth, mut deepest) = (0usize, 0usize);
        let mut fns: std::collections::BTreeMap<String, Vec<usize>> = Default::default();
        for (i, line) in text.lines().enumerate() {
            let t = line.trim_start();
            if t.starts_with("#if") {
                depth += 1;
                deepest = deepest.max(depth);
            } else if t.starts_with("#endif") {
                depth = depth.saturating_sub(1);
            } else if let Some(rest) = t.strip_prefix("fn ") {
                let name: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
                fns.entry(name).or_default().push(i + 1);
            }
        }
        let name = f.strip_prefix(env!("CARGO_MANIFEST_DIR")).unwrap().display().to_string();
        if deepest > 2 {
            broken.push(format!("{name}: #if nested {deepest} deep"));
        }
        for (fname, lines) in fns.iter().filter(|(_, l)| l.len() > 1) {
            broken.push(format!("{name}: fn {fname} defined on lines {lines:?}"));
        }
    }
    assert!(broken.is_empty(), "{}", broken.join("\n"));
}

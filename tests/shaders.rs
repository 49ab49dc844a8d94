//! Shader artifacts, checked with no adapter: every kernel variant is expanded, parsed and
//! validated by naga under capability sets with and without shader-f16 and subgroups,
//! translated to SPIR-V (Vulkan), MSL (Metal) and HLSL (DX12), and snapshotted with insta.

use lantern::gpu::shader::{Features, PipelineKey};
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

/// Whether a variant's expanded source is kept as a snapshot: one per op, weight format,
/// layout family and feature set, so that an edit to a shared include shows up once per
/// kernel body it reaches rather than once per fused combination. Every variant is still
/// validated and translated above. The linear ops keep their fullest common fusion
/// (`NORM | GATED`: the norm prologue and the gated epilogue); the other fusions (bias,
/// residual, the gathered LM-head rows, GELU, plain) are shown once, on the f32 matvec.
/// The tiled matvec keeps its XU form.
fn snapshotted(key: &PipelineKey) -> bool {
    use lantern::gpu::shader::{flags, ShaderOp, WeightFormat};
    let linear = matches!(
        key.op,
        ShaderOp::Matvec
            | ShaderOp::Matmul
            | ShaderOp::MatmulBlocked
            | ShaderOp::MatvecQ
            | ShaderOp::MatvecQMasked
            | ShaderOp::MatmulBlockedQ
    );
    if !linear {
        return true;
    }
    // The tiled matvec without XU differs from the XU one (the runtime's choice) only in
    // reading x from storage.
    if key.op == ShaderOp::MatvecQ && key.flags & flags::TEX != 0 && key.flags & flags::XU == 0 {
        return false;
    }
    let fused = flags::NORM | flags::GATED | flags::BIAS | flags::RESIDUAL | flags::GATHER | flags::GELU;
    let f32_matvec = key.op == ShaderOp::Matvec && key.weights == WeightFormat::F32 && key.flags & !fused == 0;
    f32_matvec || key.flags & fused == flags::NORM | flags::GATED
}

/// The snapshot files are exactly those of the snapshotted variants (none left over from a
/// variant that is no longer snapshotted or no longer exists).
#[test]
fn snapshot_files_are_the_snapshotted_variants() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/snapshots");
    let want: std::collections::BTreeSet<String> =
        all_keys().iter().filter(|k| snapshotted(k)).map(|k| format!("shaders__{}.snap", k.label())).collect();
    let have: std::collections::BTreeSet<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("shaders__") && n.ends_with(".snap"))
        .collect();
    let stale: Vec<&String> = have.difference(&want).collect();
    let missing: Vec<&String> = want.difference(&have).collect();
    assert!(stale.is_empty() && missing.is_empty(), "stale snapshot files: {stale:?}\nmissing: {missing:?}");
    assert!(want.len() < 300, "{} snapshots: more than one per op, format, layout and feature set?", want.len());
}

#[test]
fn expanded_sources_snapshot() {
    for key in all_keys().iter().filter(|k| snapshotted(k)) {
        let src = key.expand().unwrap();
        insta::assert_snapshot!(key.label(), src);
    }
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

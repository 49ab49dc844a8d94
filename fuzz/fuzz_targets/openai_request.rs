//! `cargo +nightly fuzz run openai_request`: see fuzz/README.md and `lantern_fuzz::openai_request`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| lantern_fuzz::openai_request(data));

//! Fuzz target: `mpquic::harness::config_file`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| mpquic::harness::config_file(data));

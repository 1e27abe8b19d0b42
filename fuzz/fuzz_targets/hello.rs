//! Fuzz target: `mpquic::harness::hello`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| mpquic::harness::hello(data));

//! Fuzz target: `mpquic::harness::control_http`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| mpquic::harness::control_http(data));

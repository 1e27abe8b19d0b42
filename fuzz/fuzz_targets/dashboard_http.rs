//! Fuzz target: `mpquic::harness::dashboard_http`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| mpquic::harness::dashboard_http(data));

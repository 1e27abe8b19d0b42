//! Fuzz target: `mpquic_core::harness::connect_ip`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| mpquic_core::harness::connect_ip(data));

//! Fuzz target: `mpquic_core::harness::tunnel_receive`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| mpquic_core::harness::tunnel_receive(data));

//! Fuzz target: `mpquic_core::harness::stripe_packets`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| mpquic_core::harness::stripe_packets(data));

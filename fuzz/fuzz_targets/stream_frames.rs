//! Fuzz target: `mpquic_core::harness::stream_frames`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| mpquic_core::harness::stream_frames(data));

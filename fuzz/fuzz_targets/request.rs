//! Fuzz target `request`: see `headroom_fuzz::nbd::check_request` for the input layout and what is
//! checked.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| headroom_fuzz::nbd::check_request(data));

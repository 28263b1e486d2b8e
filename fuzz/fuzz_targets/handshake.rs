//! Fuzz target `handshake`: see `headroom_fuzz::nbd::check_handshake` for the input layout and what is
//! checked.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| headroom_fuzz::nbd::check_handshake(data));

//! Fuzz target `session`: see `headroom_fuzz::session::check_session` for the input layout and
//! what is checked.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| headroom_fuzz::session::check_session(data));

//! Fuzz target `api_bodies`: see `headroom_fuzz::api::check_api_bodies` for what is checked.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| headroom_fuzz::api::check_api_bodies(data));

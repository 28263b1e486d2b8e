//! Fuzz target `router`: see `headroom_fuzz::router` for what is checked.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| headroom_fuzz::router::check_router(data));

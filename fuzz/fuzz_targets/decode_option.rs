//! Fuzz target: option header and option data decoding.
//!
//! Why: option data nests client-chosen length fields (export names, query lists,
//! info lists); decoding arbitrary bytes must never panic or over-allocate, and
//! anything that decodes must re-encode to the same bytes.
#![no_main]

use headroom_nbd::consts::OPTION_HEADER_LEN;
use headroom_nbd::{
    ClientOption, OptionHeader, decode_option, decode_option_header, encode_client_option,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((header_bytes, rest)) = data.split_first_chunk::<OPTION_HEADER_LEN>() else {
        return;
    };
    // Both with the header as sent (usually a bad magic or a length mismatch) ...
    if let Ok(header) = decode_option_header(header_bytes) {
        let _ = decode_option(&header, rest);
    }
    // ... and with a consistent header, so the data decoders see every input.
    let option = u32::from_be_bytes([
        header_bytes[8],
        header_bytes[9],
        header_bytes[10],
        header_bytes[11],
    ]) % 16;
    let Ok(length) = u32::try_from(rest.len()) else {
        return;
    };
    let header = OptionHeader { option, length };
    if let Ok(decoded) = decode_option(&header, rest) {
        if !matches!(decoded, ClientOption::Abort | ClientOption::Unknown(_)) {
            let mut encoded = Vec::new();
            encode_client_option(&mut encoded, &decoded);
            assert_eq!(
                &encoded[OPTION_HEADER_LEN..],
                rest,
                "decode/encode round trip"
            );
        }
    }
});

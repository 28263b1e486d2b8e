//! Fuzz target: request header decoding and validation.
//!
//! Why: the 28-byte request header is the input the server parses most often, from
//! every client; decoding and validating arbitrary bytes must never panic, and a
//! decoded header must re-encode to the same bytes.
#![no_main]

use headroom_nbd::{
    ExportLimits, REQUEST_HEADER_LEN, decode_request_header, encode_request_header,
    validate_request,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((header_bytes, rest)) = data.split_first_chunk::<REQUEST_HEADER_LEN>() else {
        return;
    };
    let Ok(header) = decode_request_header(header_bytes) else {
        return;
    };
    let mut encoded = Vec::with_capacity(REQUEST_HEADER_LEN);
    encode_request_header(&mut encoded, &header);
    assert_eq!(&encoded[..], &header_bytes[..], "decode/encode round trip");

    // Derive export limits from the remaining bytes so validation sees varied exports.
    let size_bytes = rest
        .first_chunk::<8>()
        .map_or(1 << 30, |b| u64::from_be_bytes(*b));
    let bits = rest.get(8).copied().unwrap_or(0);
    let limits = ExportLimits {
        size_bytes,
        read_only: bits & 1 != 0,
        max_payload_bytes: headroom_nbd::MAX_PAYLOAD_BYTES,
        structured_replies: bits & 2 != 0,
        allocation_context_id: (bits & 4 != 0).then_some(1),
    };
    match validate_request(&header, &limits) {
        Ok(valid) => assert_eq!(valid.cookie, header.cookie),
        Err(rejection) => {
            assert_eq!(rejection.cookie, header.cookie);
            assert!(rejection.payload_to_discard <= headroom_nbd::MAX_DISCARD_BYTES);
        }
    }
});

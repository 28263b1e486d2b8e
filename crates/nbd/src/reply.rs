//! Encoders for transmission replies (simple replies and structured reply chunks), and
//! client-side decoders of their headers.
//!
//! Why: these run once or more per request on the hot path, so they only append to a
//! caller-owned buffer (no allocation beyond the `Vec` growing) and never copy data
//! payloads: the OFFSET_DATA encoder writes the header and the session appends (or
//! vectored-writes) the data after it.

use crate::consts::{
    MAX_STRING_BYTES, NBD_REPLY_FLAG_DONE, NBD_REPLY_TYPE_BLOCK_STATUS, NBD_REPLY_TYPE_ERROR,
    NBD_REPLY_TYPE_ERROR_OFFSET, NBD_REPLY_TYPE_NONE, NBD_REPLY_TYPE_OFFSET_DATA,
    NBD_REPLY_TYPE_OFFSET_HOLE, SIMPLE_REPLY_HEADER_LEN, SIMPLE_REPLY_MAGIC,
    STRUCTURED_REPLY_HEADER_LEN, STRUCTURED_REPLY_MAGIC,
};
use crate::error::TransmissionError;
use crate::wire::{len_u16, len_u32, prefix, truncate_utf8};

/// Largest `data_len` an OFFSET_DATA chunk can carry: its length field counts the
/// 8-byte offset too ("a request for more than 2^32 - 8 bytes ... MUST be split into at
/// least two chunks").
pub const MAX_OFFSET_DATA_LEN: u32 = u32::MAX - 8;

/// Most extents one BLOCK_STATUS chunk can hold within a 32-bit length.
pub const MAX_BLOCK_STATUS_EXTENTS: usize = ((u32::MAX - 4) / 8) as usize;

/// Appends a simple reply header: "32 bits, 0x67446698, magic; 32 bits, error (MAY be
/// zero); 64 bits, handle" (16 bytes). For a successful READ without structured
/// replies the data follows; for errors nothing follows.
pub fn encode_simple_reply_header(out: &mut Vec<u8>, cookie: u64, error: u32) {
    out.extend_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&error.to_be_bytes());
    out.extend_from_slice(&cookie.to_be_bytes());
}

/// Appends a structured reply chunk header: "32 bits, 0x668e33ef, magic; 16 bits,
/// flags; 16 bits, type; 64 bits, handle; 32 bits, length of payload" (20 bytes).
pub fn encode_structured_chunk_header(
    out: &mut Vec<u8>,
    flags: u16,
    chunk_type: u16,
    cookie: u64,
    length: u32,
) {
    out.extend_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&flags.to_be_bytes());
    out.extend_from_slice(&chunk_type.to_be_bytes());
    out.extend_from_slice(&cookie.to_be_bytes());
    out.extend_from_slice(&length.to_be_bytes());
}

const fn done_flag(done: bool) -> u16 {
    if done { NBD_REPLY_FLAG_DONE } else { 0 }
}

/// Appends an `NBD_REPLY_TYPE_OFFSET_DATA` chunk header plus its 8-byte offset
/// (28 bytes); the caller sends `data_len` data bytes next. "*length* MUST be at least
/// 9" so `data_len` must be in `1..=`[`MAX_OFFSET_DATA_LEN`] (the length field
/// saturates rather than wrapping if it is not).
pub fn encode_structured_offset_data_header(
    out: &mut Vec<u8>,
    done: bool,
    cookie: u64,
    offset: u64,
    data_len: u32,
) {
    debug_assert!(
        (1..=MAX_OFFSET_DATA_LEN).contains(&data_len),
        "OFFSET_DATA chunk with {data_len} data bytes"
    );
    encode_structured_chunk_header(
        out,
        done_flag(done),
        NBD_REPLY_TYPE_OFFSET_DATA,
        cookie,
        data_len.saturating_add(8),
    );
    out.extend_from_slice(&offset.to_be_bytes());
}

/// Appends an `NBD_REPLY_TYPE_OFFSET_HOLE` chunk: "*length* MUST be exactly 12 ...
/// 64 bits: offset (unsigned); 32 bits: hole size (unsigned, MUST be nonzero)".
pub fn encode_structured_offset_hole(
    out: &mut Vec<u8>,
    done: bool,
    cookie: u64,
    offset: u64,
    hole_len: u32,
) {
    debug_assert!(hole_len != 0, "OFFSET_HOLE chunk of size 0");
    encode_structured_chunk_header(out, done_flag(done), NBD_REPLY_TYPE_OFFSET_HOLE, cookie, 12);
    out.extend_from_slice(&offset.to_be_bytes());
    out.extend_from_slice(&hole_len.to_be_bytes());
}

/// Appends the final `NBD_REPLY_TYPE_NONE` chunk: "*length* MUST be 0 ... MUST always
/// be used with the `NBD_REPLY_FLAG_DONE` bit set".
pub fn encode_structured_none_done(out: &mut Vec<u8>, cookie: u64) {
    encode_structured_chunk_header(out, NBD_REPLY_FLAG_DONE, NBD_REPLY_TYPE_NONE, cookie, 0);
}

/// Appends an `NBD_REPLY_TYPE_ERROR` chunk: "32 bits: error (MUST be nonzero); 16 bits:
/// message length; *message length* bytes: optional string". The message is cut to
/// 4096 bytes ("*message length* MUST NOT exceed the 4096 bytes string length limit").
pub fn encode_structured_error(
    out: &mut Vec<u8>,
    done: bool,
    cookie: u64,
    errno: u32,
    message: &str,
) {
    debug_assert!(errno != 0, "error chunk with error 0");
    let message = truncate_utf8(message, MAX_STRING_BYTES);
    let message_len = len_u16(message.len());
    encode_structured_chunk_header(
        out,
        done_flag(done),
        NBD_REPLY_TYPE_ERROR,
        cookie,
        6 + u32::from(message_len),
    );
    out.extend_from_slice(&errno.to_be_bytes());
    out.extend_from_slice(&message_len.to_be_bytes());
    out.extend_from_slice(message.as_bytes());
}

/// Appends an `NBD_REPLY_TYPE_ERROR_OFFSET` chunk: the ERROR fields followed by "64
/// bits: offset (unsigned)" (the offset "MUST lie within the original offset and length
/// of the request").
pub fn encode_structured_error_offset(
    out: &mut Vec<u8>,
    done: bool,
    cookie: u64,
    errno: u32,
    message: &str,
    offset: u64,
) {
    debug_assert!(errno != 0, "error chunk with error 0");
    let message = truncate_utf8(message, MAX_STRING_BYTES);
    let message_len = len_u16(message.len());
    encode_structured_chunk_header(
        out,
        done_flag(done),
        NBD_REPLY_TYPE_ERROR_OFFSET,
        cookie,
        14 + u32::from(message_len),
    );
    out.extend_from_slice(&errno.to_be_bytes());
    out.extend_from_slice(&message_len.to_be_bytes());
    out.extend_from_slice(message.as_bytes());
    out.extend_from_slice(&offset.to_be_bytes());
}

/// Appends an `NBD_REPLY_TYPE_BLOCK_STATUS` chunk: "32 bits, metadata context ID" then
/// per extent "32 bits, length of the extent ... (unsigned, MUST be nonzero); 32 bits,
/// status flags" (`NBD_STATE_HOLE` = 1, `NBD_STATE_ZERO` = 2 for `base:allocation`).
/// "*length* MUST be 4 + (a positive integer multiple of 8)": pass at least one extent.
/// Extents beyond [`MAX_BLOCK_STATUS_EXTENTS`] are dropped (the spec allows returning
/// fewer descriptors than the range needs).
pub fn encode_structured_block_status(
    out: &mut Vec<u8>,
    done: bool,
    cookie: u64,
    context_id: u32,
    extents: &[(u32, u32)],
) {
    debug_assert!(!extents.is_empty(), "BLOCK_STATUS chunk without extents");
    let extents = prefix(extents, MAX_BLOCK_STATUS_EXTENTS);
    // ≤ MAX_BLOCK_STATUS_EXTENTS, so 4 + 8 * n fits in u32.
    let length = len_u32(4 + 8 * extents.len());
    out.reserve(STRUCTURED_REPLY_HEADER_LEN + 4 + 8 * extents.len());
    encode_structured_chunk_header(
        out,
        done_flag(done),
        NBD_REPLY_TYPE_BLOCK_STATUS,
        cookie,
        length,
    );
    out.extend_from_slice(&context_id.to_be_bytes());
    for &(length_bytes, flags) in extents {
        out.extend_from_slice(&length_bytes.to_be_bytes());
        out.extend_from_slice(&flags.to_be_bytes());
    }
}

// ---------------------------------------------------------------- client side (tests, tools)

/// A decoded simple reply header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SimpleReplyHeader {
    /// Error value (0 on success).
    pub error: u32,
    /// Cookie of the request answered.
    pub cookie: u64,
}

/// Decodes a simple reply header (client side / tests).
pub fn decode_simple_reply_header(
    buf: &[u8; SIMPLE_REPLY_HEADER_LEN],
) -> Result<SimpleReplyHeader, TransmissionError> {
    let magic = u32::from_be_bytes([buf[0], buf[1], buf[2], buf[3]]);
    if magic != SIMPLE_REPLY_MAGIC {
        return Err(TransmissionError::BadReplyMagic { magic });
    }
    Ok(SimpleReplyHeader {
        error: u32::from_be_bytes([buf[4], buf[5], buf[6], buf[7]]),
        cookie: u64::from_be_bytes([
            buf[8], buf[9], buf[10], buf[11], buf[12], buf[13], buf[14], buf[15],
        ]),
    })
}

/// A decoded structured reply chunk header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StructuredChunkHeader {
    /// Reply flags (`NBD_REPLY_FLAG_DONE`).
    pub flags: u16,
    /// Chunk type (`NBD_REPLY_TYPE_*`).
    pub chunk_type: u16,
    /// Cookie of the request answered.
    pub cookie: u64,
    /// Payload length that follows.
    pub length: u32,
}

impl StructuredChunkHeader {
    /// Whether this is the final chunk of its reply.
    #[must_use]
    pub const fn is_done(&self) -> bool {
        self.flags & NBD_REPLY_FLAG_DONE != 0
    }
}

/// Decodes a structured reply chunk header (client side / tests).
pub fn decode_structured_chunk_header(
    buf: &[u8; STRUCTURED_REPLY_HEADER_LEN],
) -> Result<StructuredChunkHeader, TransmissionError> {
    let magic = u32::from_be_bytes([buf[0], buf[1], buf[2], buf[3]]);
    if magic != STRUCTURED_REPLY_MAGIC {
        return Err(TransmissionError::BadReplyMagic { magic });
    }
    Ok(StructuredChunkHeader {
        flags: u16::from_be_bytes([buf[4], buf[5]]),
        chunk_type: u16::from_be_bytes([buf[6], buf[7]]),
        cookie: u64::from_be_bytes([
            buf[8], buf[9], buf[10], buf[11], buf[12], buf[13], buf[14], buf[15],
        ]),
        length: u32::from_be_bytes([buf[16], buf[17], buf[18], buf[19]]),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::consts::*;

    const COOKIE: u64 = 0x0102_0304_0506_0708;
    const COOKIE_BYTES: [u8; 8] = [1, 2, 3, 4, 5, 6, 7, 8];

    fn chunk_header(flags: u16, ty: u16, len: u32) -> Vec<u8> {
        let mut v = vec![0x66, 0x8e, 0x33, 0xef];
        v.extend_from_slice(&flags.to_be_bytes());
        v.extend_from_slice(&ty.to_be_bytes());
        v.extend_from_slice(&COOKIE_BYTES);
        v.extend_from_slice(&len.to_be_bytes());
        v
    }

    #[test]
    fn simple_reply_layout() {
        let mut out = Vec::new();
        encode_simple_reply_header(&mut out, COOKIE, NBD_EINVAL);
        assert_eq!(
            out,
            [0x67, 0x44, 0x66, 0x98, 0, 0, 0, 22, 1, 2, 3, 4, 5, 6, 7, 8]
        );
        let decoded = decode_simple_reply_header(&out.clone().try_into().unwrap()).unwrap();
        assert_eq!(
            decoded,
            SimpleReplyHeader {
                error: 22,
                cookie: COOKIE
            }
        );
    }

    #[test]
    fn chunk_header_layout_and_round_trip() {
        let mut out = Vec::new();
        encode_structured_chunk_header(
            &mut out,
            NBD_REPLY_FLAG_DONE,
            NBD_REPLY_TYPE_ERROR,
            COOKIE,
            6,
        );
        assert_eq!(out, chunk_header(1, 0x8001, 6));
        let h = decode_structured_chunk_header(&out.clone().try_into().unwrap()).unwrap();
        assert!(h.is_done());
        assert_eq!(h.chunk_type, NBD_REPLY_TYPE_ERROR);
        assert_eq!(h.length, 6);
        assert_eq!(h.cookie, COOKIE);
    }

    #[test]
    fn offset_data_header_layout() {
        let mut out = Vec::new();
        encode_structured_offset_data_header(&mut out, true, COOKIE, 0x1000, 512);
        let mut expected = chunk_header(1, 1, 520);
        expected.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0x10, 0]);
        assert_eq!(out, expected);
        assert_eq!(out.len(), 28);

        let mut out = Vec::new();
        encode_structured_offset_data_header(&mut out, false, COOKIE, 0, 1);
        assert_eq!(&out[4..6], &[0, 0], "done flag clear");
    }

    #[test]
    fn offset_hole_layout() {
        let mut out = Vec::new();
        encode_structured_offset_hole(&mut out, false, COOKIE, 4096, 65536);
        let mut expected = chunk_header(0, 2, 12);
        expected.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0x10, 0, 0, 1, 0, 0]);
        assert_eq!(out, expected);
    }

    #[test]
    fn none_done_layout() {
        let mut out = Vec::new();
        encode_structured_none_done(&mut out, COOKIE);
        assert_eq!(out, chunk_header(1, 0, 0));
    }

    #[test]
    fn error_layout() {
        let mut out = Vec::new();
        encode_structured_error(&mut out, true, COOKIE, NBD_ENOSPC, "full");
        let mut expected = chunk_header(1, 0x8001, 10);
        expected.extend_from_slice(&[0, 0, 0, 28, 0, 4]);
        expected.extend_from_slice(b"full");
        assert_eq!(out, expected);

        let mut out = Vec::new();
        encode_structured_error(&mut out, true, COOKIE, NBD_EIO, "");
        assert_eq!(out.len(), 20 + 6);
    }

    #[test]
    fn error_message_is_capped() {
        let mut out = Vec::new();
        encode_structured_error(&mut out, true, COOKIE, NBD_EIO, &"x".repeat(10_000));
        assert_eq!(out.len(), 20 + 6 + 4096);
        assert_eq!(&out[16..20], &(6u32 + 4096).to_be_bytes());
        assert_eq!(&out[24..26], &4096u16.to_be_bytes());
    }

    #[test]
    fn error_offset_layout() {
        let mut out = Vec::new();
        encode_structured_error_offset(&mut out, false, COOKIE, NBD_EIO, "io", 512);
        let mut expected = chunk_header(0, 0x8002, 16);
        expected.extend_from_slice(&[0, 0, 0, 5, 0, 2, b'i', b'o', 0, 0, 0, 0, 0, 0, 2, 0]);
        assert_eq!(out, expected);
    }

    #[test]
    fn block_status_layout() {
        let mut out = Vec::new();
        encode_structured_block_status(
            &mut out,
            true,
            COOKIE,
            1,
            &[(4096, 0), (1 << 21, NBD_STATE_HOLE | NBD_STATE_ZERO)],
        );
        let mut expected = chunk_header(1, 5, 4 + 16);
        expected.extend_from_slice(&[0, 0, 0, 1]);
        expected.extend_from_slice(&[0, 0, 0x10, 0, 0, 0, 0, 0]);
        expected.extend_from_slice(&[0, 0x20, 0, 0, 0, 0, 0, 3]);
        assert_eq!(out, expected);
    }

    #[test]
    fn encoders_append_without_touching_existing_bytes() {
        let mut out = vec![0xaa; 3];
        encode_structured_none_done(&mut out, COOKIE);
        encode_simple_reply_header(&mut out, COOKIE, 0);
        assert_eq!(&out[..3], &[0xaa; 3]);
        assert_eq!(out.len(), 3 + 20 + 16);
    }

    #[test]
    fn bad_reply_magic() {
        assert!(matches!(
            decode_simple_reply_header(&[0; 16]),
            Err(TransmissionError::BadReplyMagic { magic: 0 })
        ));
        assert!(matches!(
            decode_structured_chunk_header(&[0xff; 20]),
            Err(TransmissionError::BadReplyMagic { magic: 0xffff_ffff })
        ));
    }
}

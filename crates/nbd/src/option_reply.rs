//! Encoders for fixed-newstyle option replies (`NBD_REP_*`), and the client-side
//! decoder of their header.
//!
//! Why: every option but `NBD_OPT_EXPORT_NAME` is answered with the same 20-byte
//! header plus a type-specific payload; having one encoder per payload type makes the
//! byte layouts testable against the spec independently of the session logic.

use crate::consts::{
    MAX_STRING_BYTES, NBD_INFO_BLOCK_SIZE, NBD_INFO_DESCRIPTION, NBD_INFO_EXPORT, NBD_INFO_NAME,
    NBD_REP_INFO, NBD_REP_META_CONTEXT, NBD_REP_SERVER, OPTION_REPLY_HEADER_LEN,
    OPTION_REPLY_MAGIC,
};
use crate::error::HandshakeError;
use crate::wire::{len_u32, prefix, truncate_utf8};

/// Appends the reply header (magic, option, reply type, length) for `data_len` bytes of data.
fn put_header(out: &mut Vec<u8>, option: u32, reply_type: u32, data_len: u32) {
    out.extend_from_slice(&OPTION_REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&option.to_be_bytes());
    out.extend_from_slice(&reply_type.to_be_bytes());
    out.extend_from_slice(&data_len.to_be_bytes());
}

/// Appends a complete option reply: "64 bits, `0x3e889045565a9`; 32 bits, the option as
/// sent by the client to which this is a reply; 32 bits, reply type; 32 bits, length of
/// the reply; any data as required by the reply".
///
/// Also the way to send an error reply (`reply_type` with bit 31 set) whose data is an
/// "error message string suitable for display to the user".
pub fn encode_option_reply(out: &mut Vec<u8>, option: u32, reply_type: u32, data: &[u8]) {
    let len = len_u32(data.len());
    let data = prefix(data, len as usize);
    put_header(out, option, reply_type, len);
    out.extend_from_slice(data);
}

/// Appends an error reply whose data is `message`, cut to the 4096-byte string limit
/// on a character boundary.
pub fn encode_option_error(out: &mut Vec<u8>, option: u32, reply_type: u32, message: &str) {
    let message = truncate_utf8(message, MAX_STRING_BYTES);
    encode_option_reply(out, option, reply_type, message.as_bytes());
}

/// `NBD_REP_INFO` / `NBD_INFO_EXPORT`: length 12: "16 bits, `NBD_INFO_EXPORT`; 64 bits,
/// size of the export in bytes (unsigned); 16 bits, transmission flags".
pub fn encode_info_export(
    out: &mut Vec<u8>,
    option: u32,
    size_bytes: u64,
    transmission_flags: u16,
) {
    put_header(out, option, NBD_REP_INFO, 12);
    out.extend_from_slice(&NBD_INFO_EXPORT.to_be_bytes());
    out.extend_from_slice(&size_bytes.to_be_bytes());
    out.extend_from_slice(&transmission_flags.to_be_bytes());
}

fn encode_info_string(out: &mut Vec<u8>, option: u32, info_type: u16, text: &str) {
    let text = truncate_utf8(text, MAX_STRING_BYTES);
    put_header(out, option, NBD_REP_INFO, len_u32(2 + text.len()));
    out.extend_from_slice(&info_type.to_be_bytes());
    out.extend_from_slice(text.as_bytes());
}

/// `NBD_REP_INFO` / `NBD_INFO_NAME`: "16 bits, `NBD_INFO_NAME`; String: name of the
/// export, *length - 2* bytes". Names longer than 4096 bytes are cut.
pub fn encode_info_name(out: &mut Vec<u8>, option: u32, name: &str) {
    encode_info_string(out, option, NBD_INFO_NAME, name);
}

/// `NBD_REP_INFO` / `NBD_INFO_DESCRIPTION`: "16 bits, `NBD_INFO_DESCRIPTION`; String:
/// description of the export, *length - 2* bytes". Cut to 4096 bytes.
pub fn encode_info_description(out: &mut Vec<u8>, option: u32, text: &str) {
    encode_info_string(out, option, NBD_INFO_DESCRIPTION, text);
}

/// `NBD_REP_INFO` / `NBD_INFO_BLOCK_SIZE`: length 14: "16 bits, `NBD_INFO_BLOCK_SIZE`;
/// 32 bits, minimum block size; 32 bits, preferred block size; 32 bits, maximum block
/// size". Headroom sends [`crate::MIN_BLOCK_BYTES`], [`crate::PREFERRED_BLOCK_BYTES`],
/// [`crate::MAX_PAYLOAD_BYTES`].
pub fn encode_info_block_size(
    out: &mut Vec<u8>,
    option: u32,
    minimum: u32,
    preferred: u32,
    maximum: u32,
) {
    put_header(out, option, NBD_REP_INFO, 14);
    out.extend_from_slice(&NBD_INFO_BLOCK_SIZE.to_be_bytes());
    out.extend_from_slice(&minimum.to_be_bytes());
    out.extend_from_slice(&preferred.to_be_bytes());
    out.extend_from_slice(&maximum.to_be_bytes());
}

/// `NBD_REP_SERVER` (one per export in reply to `NBD_OPT_LIST`): "32 bits, length of
/// name; String, name of the export; [the rest] a string suitable for direct display
/// to a human being". Name and description are each cut to 4096 bytes.
pub fn encode_rep_server(out: &mut Vec<u8>, option: u32, export_name: &str, description: &str) {
    let name = truncate_utf8(export_name, MAX_STRING_BYTES);
    let description = truncate_utf8(description, MAX_STRING_BYTES);
    put_header(
        out,
        option,
        NBD_REP_SERVER,
        len_u32(4 + name.len() + description.len()),
    );
    out.extend_from_slice(&len_u32(name.len()).to_be_bytes());
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(description.as_bytes());
}

/// `NBD_REP_META_CONTEXT`: "32 bits, NBD metadata context ID; String, name of the
/// metadata context". For `NBD_OPT_LIST_META_CONTEXT` the ID "SHOULD be set to zero".
pub fn encode_rep_meta_context(out: &mut Vec<u8>, option: u32, context_id: u32, name: &str) {
    let name = truncate_utf8(name, MAX_STRING_BYTES);
    put_header(out, option, NBD_REP_META_CONTEXT, len_u32(4 + name.len()));
    out.extend_from_slice(&context_id.to_be_bytes());
    out.extend_from_slice(name.as_bytes());
}

/// A decoded option reply header (client side / tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionReplyHeader {
    /// The option being answered.
    pub option: u32,
    /// `NBD_REP_*`.
    pub reply_type: u32,
    /// Length of the data that follows.
    pub length: u32,
}

impl OptionReplyHeader {
    /// Whether the reply type is an error (bit 31 set).
    #[must_use]
    pub const fn is_error(&self) -> bool {
        self.reply_type & crate::consts::NBD_REP_FLAG_ERROR != 0
    }
}

/// Decodes an option reply header (client side / tests).
pub fn decode_option_reply_header(
    buf: &[u8; OPTION_REPLY_HEADER_LEN],
) -> Result<OptionReplyHeader, HandshakeError> {
    let magic = u64::from_be_bytes([
        buf[0], buf[1], buf[2], buf[3], buf[4], buf[5], buf[6], buf[7],
    ]);
    if magic != OPTION_REPLY_MAGIC {
        return Err(HandshakeError::BadOptionReplyMagic { magic });
    }
    Ok(OptionReplyHeader {
        option: u32::from_be_bytes([buf[8], buf[9], buf[10], buf[11]]),
        reply_type: u32::from_be_bytes([buf[12], buf[13], buf[14], buf[15]]),
        length: u32::from_be_bytes([buf[16], buf[17], buf[18], buf[19]]),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::consts::*;

    const MAGIC: [u8; 8] = [0x00, 0x03, 0xe8, 0x89, 0x04, 0x55, 0x65, 0xa9];

    fn expected_header(option: u32, reply_type: u32, len: u32) -> Vec<u8> {
        let mut v = MAGIC.to_vec();
        v.extend_from_slice(&option.to_be_bytes());
        v.extend_from_slice(&reply_type.to_be_bytes());
        v.extend_from_slice(&len.to_be_bytes());
        v
    }

    #[test]
    fn ack_layout() {
        let mut out = Vec::new();
        encode_option_reply(&mut out, NBD_OPT_STRUCTURED_REPLY, NBD_REP_ACK, &[]);
        assert_eq!(
            out,
            [
                0x00, 0x03, 0xe8, 0x89, 0x04, 0x55, 0x65, 0xa9, 0, 0, 0, 8, 0, 0, 0, 1, 0, 0, 0, 0
            ]
        );
    }

    #[test]
    fn error_reply_carries_message() {
        let mut out = Vec::new();
        encode_option_error(&mut out, 42, NBD_REP_ERR_UNSUP, "nope");
        let mut expected = expected_header(42, 0x8000_0001, 4);
        expected.extend_from_slice(b"nope");
        assert_eq!(out, expected);
    }

    #[test]
    fn error_message_is_cut_to_string_limit() {
        let mut out = Vec::new();
        let long = "é".repeat(3000); // 6000 bytes
        encode_option_error(&mut out, NBD_OPT_GO, NBD_REP_ERR_UNKNOWN, &long);
        let len = u32::from_be_bytes([out[16], out[17], out[18], out[19]]) as usize;
        assert_eq!(len, 4096);
        assert_eq!(out.len(), 20 + 4096);
        assert!(std::str::from_utf8(&out[20..]).is_ok());
    }

    #[test]
    fn info_export_layout() {
        let mut out = Vec::new();
        encode_info_export(&mut out, NBD_OPT_GO, 1 << 30, 0x016d);
        let mut expected = expected_header(NBD_OPT_GO, NBD_REP_INFO, 12);
        expected.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0x40, 0, 0, 0, 0x01, 0x6d]);
        assert_eq!(out, expected);
    }

    #[test]
    fn info_name_and_description_layout() {
        let mut out = Vec::new();
        encode_info_name(&mut out, NBD_OPT_INFO, "v1");
        let mut expected = expected_header(NBD_OPT_INFO, NBD_REP_INFO, 4);
        expected.extend_from_slice(&[0, 1, b'v', b'1']);
        assert_eq!(out, expected);

        let mut out = Vec::new();
        encode_info_description(&mut out, NBD_OPT_INFO, "");
        let mut expected = expected_header(NBD_OPT_INFO, NBD_REP_INFO, 2);
        expected.extend_from_slice(&[0, 2]);
        assert_eq!(out, expected);
    }

    #[test]
    fn info_block_size_layout() {
        let mut out = Vec::new();
        encode_info_block_size(&mut out, NBD_OPT_GO, 1, 4096, 32 << 20);
        let mut expected = expected_header(NBD_OPT_GO, NBD_REP_INFO, 14);
        expected.extend_from_slice(&[0, 3, 0, 0, 0, 1, 0, 0, 0x10, 0, 0x02, 0, 0, 0]);
        assert_eq!(out, expected);
    }

    #[test]
    fn rep_server_layout() {
        let mut out = Vec::new();
        encode_rep_server(&mut out, NBD_OPT_LIST, "vol", "1 GiB");
        let mut expected = expected_header(NBD_OPT_LIST, NBD_REP_SERVER, 4 + 3 + 5);
        expected.extend_from_slice(&[0, 0, 0, 3]);
        expected.extend_from_slice(b"vol1 GiB");
        assert_eq!(out, expected);
    }

    #[test]
    fn rep_meta_context_layout() {
        let mut out = Vec::new();
        encode_rep_meta_context(&mut out, NBD_OPT_SET_META_CONTEXT, 1, "base:allocation");
        let mut expected = expected_header(NBD_OPT_SET_META_CONTEXT, NBD_REP_META_CONTEXT, 19);
        expected.extend_from_slice(&[0, 0, 0, 1]);
        expected.extend_from_slice(b"base:allocation");
        assert_eq!(out, expected);
    }

    #[test]
    fn reply_header_round_trip_and_bad_magic() {
        let mut out = Vec::new();
        encode_option_reply(&mut out, NBD_OPT_LIST, NBD_REP_ERR_POLICY, b"xy");
        let header: [u8; 20] = out[..20].try_into().unwrap();
        let decoded = decode_option_reply_header(&header).unwrap();
        assert_eq!(
            decoded,
            OptionReplyHeader {
                option: NBD_OPT_LIST,
                reply_type: NBD_REP_ERR_POLICY,
                length: 2
            }
        );
        assert!(decoded.is_error());
        let mut bad = header;
        bad[0] = 1;
        assert!(matches!(
            decode_option_reply_header(&bad),
            Err(HandshakeError::BadOptionReplyMagic { .. })
        ));
    }
}

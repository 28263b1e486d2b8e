//! The fixed-newstyle handshake framing: greeting, client flags, option headers,
//! the `NBD_OPT_EXPORT_NAME` reply, and the transmission flags Headroom advertises.
//!
//! Why: these are the few fixed-size messages exchanged before option data is read,
//! and each has a "close the connection" rule in the spec. Keeping them together lets
//! the session read exactly 4 or 16 bytes, call one function, and act on a typed result.

use crate::consts::{
    EXPORT_NAME_REPLY_PADDING_BYTES, IHAVEOPT, NBD_FLAG_C_FIXED_NEWSTYLE, NBD_FLAG_C_NO_ZEROES,
    NBD_FLAG_CAN_MULTI_CONN, NBD_FLAG_FIXED_NEWSTYLE, NBD_FLAG_HAS_FLAGS, NBD_FLAG_NO_ZEROES,
    NBD_FLAG_READ_ONLY, NBD_FLAG_SEND_CACHE, NBD_FLAG_SEND_DF, NBD_FLAG_SEND_FAST_ZERO,
    NBD_FLAG_SEND_FLUSH, NBD_FLAG_SEND_FUA, NBD_FLAG_SEND_TRIM, NBD_FLAG_SEND_WRITE_ZEROES,
    NBD_OPT_ABORT, NBD_OPT_EXPORT_NAME, NBD_OPT_EXTENDED_HEADERS, NBD_OPT_GO, NBD_OPT_INFO,
    NBD_OPT_LIST, NBD_OPT_LIST_META_CONTEXT, NBD_OPT_SET_META_CONTEXT, NBD_OPT_STARTTLS,
    NBD_OPT_STRUCTURED_REPLY, NBD_REP_ERR_TOO_BIG, NBD_REP_ERR_UNSUP, NBDMAGIC, OPTION_HEADER_LEN,
};
use crate::error::HandshakeError;

// ---------------------------------------------------------------- limits

/// Largest option data (bytes) the session reads and decodes.
///
/// The largest legitimate option is `NBD_OPT_SET_META_CONTEXT`/`NBD_OPT_GO` with a
/// 4096-byte export name plus a few queries or info types; 64 KiB leaves ample room.
pub const MAX_OPTION_LENGTH: u32 = 64 * 1024;

/// Largest option data (bytes) the session reads and throws away in order to answer an
/// over-long option with an error instead of closing. Above this the session closes.
///
/// Spec: "Servers that receive messages which they do not implement MUST reply to them
/// with `NBD_REP_ERR_UNSUP`, and MUST NOT fail to parse the next message received" and
/// `NBD_REP_ERR_TOO_BIG`: "The request or the reply is too large to process"; but also
/// "if a server believes a client's behaviour constitutes a denial of service, it MAY
/// initiate a hard disconnect". We treat more than 1 MiB of option data as such.
pub const MAX_OPTION_DISCARD_BYTES: u32 = 1024 * 1024;

/// Minimum block size advertised in `NBD_INFO_BLOCK_SIZE`: 1, i.e. any alignment
/// (the spec's default: "a server SHOULD support a default minimum block size of 1").
pub const MIN_BLOCK_BYTES: u32 = 1;
/// Preferred block size advertised in `NBD_INFO_BLOCK_SIZE` ("MUST be a power of 2 at
/// least as large as the maximum of the minimum block size and 2^9").
pub const PREFERRED_BLOCK_BYTES: u32 = 4096;
/// Maximum payload of one `NBD_CMD_READ`/`NBD_CMD_WRITE` (32 MiB), advertised as the
/// maximum block size. Equals the spec's interoperable maximum: "limit `NBD_CMD_READ`
/// and `NBD_CMD_WRITE` commands to a maximum block size of 2^25 (33,554,432)".
pub const MAX_PAYLOAD_BYTES: u32 = 32 * 1024 * 1024;

// The advertised block sizes obey the spec's rules, checked at compile time: minimum
// "MUST be a power of 2, MUST NOT be larger than 2^16"; preferred "MUST be a power of 2
// at least as large as the maximum of the minimum block size and 2^9"; maximum "MUST be
// either an integer multiple of the minimum block size or the value 0xffffffff ...
// MUST be at least as large as the smaller of the preferred block size or export size".
const _: () = {
    assert!(MIN_BLOCK_BYTES.is_power_of_two() && MIN_BLOCK_BYTES <= 1 << 16);
    assert!(PREFERRED_BLOCK_BYTES.is_power_of_two());
    assert!(PREFERRED_BLOCK_BYTES >= MIN_BLOCK_BYTES && PREFERRED_BLOCK_BYTES >= 512);
    assert!(MAX_PAYLOAD_BYTES.is_multiple_of(MIN_BLOCK_BYTES));
    assert!(MAX_PAYLOAD_BYTES >= PREFERRED_BLOCK_BYTES);
};

// ---------------------------------------------------------------- greeting and client flags

/// Handshake flags Headroom sends: fixed newstyle and no-zeroes.
pub const SERVER_HANDSHAKE_FLAGS: u16 = NBD_FLAG_FIXED_NEWSTYLE | NBD_FLAG_NO_ZEROES;

/// Appends the 18-byte server greeting: `NBDMAGIC`, `IHAVEOPT`, handshake flags
/// (`NBD_FLAG_FIXED_NEWSTYLE | NBD_FLAG_NO_ZEROES`).
pub fn encode_server_greeting(out: &mut Vec<u8>) {
    out.extend_from_slice(&NBDMAGIC.to_be_bytes());
    out.extend_from_slice(&IHAVEOPT.to_be_bytes());
    out.extend_from_slice(&SERVER_HANDSHAKE_FLAGS.to_be_bytes());
}

/// The client's 32-bit flags, decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ClientFlags {
    /// `NBD_FLAG_C_FIXED_NEWSTYLE`. "Servers MAY choose to honour fixed newstyle from
    /// clients that didn't set this bit"; the session decides.
    pub fixed_newstyle: bool,
    /// `NBD_FLAG_C_NO_ZEROES`: omit the 124 zero bytes after the `NBD_OPT_EXPORT_NAME` reply.
    pub no_zeroes: bool,
}

impl ClientFlags {
    /// The raw 32-bit value (client side / tests).
    #[must_use]
    pub const fn to_raw(self) -> u32 {
        let mut raw = 0;
        if self.fixed_newstyle {
            raw |= NBD_FLAG_C_FIXED_NEWSTYLE;
        }
        if self.no_zeroes {
            raw |= NBD_FLAG_C_NO_ZEROES;
        }
        raw
    }
}

/// Decodes the client flags. Any bit other than the two Headroom advertises is an
/// error after which the session closes: "Clients MUST NOT set any other flags; the
/// server MUST drop the TCP connection if the client sets an unknown flag, or a flag
/// that does not match something advertised by the server."
pub fn decode_client_flags(raw: u32) -> Result<ClientFlags, HandshakeError> {
    if raw & !(NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES) != 0 {
        return Err(HandshakeError::UnknownClientFlags { flags: raw });
    }
    Ok(ClientFlags {
        fixed_newstyle: raw & NBD_FLAG_C_FIXED_NEWSTYLE != 0,
        no_zeroes: raw & NBD_FLAG_C_NO_ZEROES != 0,
    })
}

// ---------------------------------------------------------------- option header

/// The 16-byte header in front of every client option (after `IHAVEOPT`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionHeader {
    /// Option number (`NBD_OPT_*`).
    pub option: u32,
    /// Length of the option data that follows, in bytes.
    pub length: u32,
}

/// Decodes an option header. A wrong magic means the stream is not NBD options at all
/// (e.g. garbage after the client flags): the session closes the connection.
pub fn decode_option_header(buf: &[u8; OPTION_HEADER_LEN]) -> Result<OptionHeader, HandshakeError> {
    let magic = u64::from_be_bytes([
        buf[0], buf[1], buf[2], buf[3], buf[4], buf[5], buf[6], buf[7],
    ]);
    if magic != IHAVEOPT {
        return Err(HandshakeError::BadOptionMagic { magic });
    }
    Ok(OptionHeader {
        option: u32::from_be_bytes([buf[8], buf[9], buf[10], buf[11]]),
        length: u32::from_be_bytes([buf[12], buf[13], buf[14], buf[15]]),
    })
}

/// Appends an option header (client side / tests).
pub fn encode_option_header(out: &mut Vec<u8>, option: u32, length: u32) {
    out.extend_from_slice(&IHAVEOPT.to_be_bytes());
    out.extend_from_slice(&option.to_be_bytes());
    out.extend_from_slice(&length.to_be_bytes());
}

/// What the session does with an option's data, decided from the header alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OptionDataAction {
    /// Read `length` bytes and call [`crate::decode_option`].
    Read,
    /// Read and drop `length` bytes, then reply with `reply_type`
    /// (`NBD_REP_ERR_UNSUP` for unknown options, `NBD_REP_ERR_TOO_BIG` for known ones),
    /// and keep haggling.
    DiscardThenReply {
        /// The `NBD_REP_ERR_*` to send after discarding.
        reply_type: u32,
    },
    /// Close the connection without reading the data.
    Close,
}

/// Whether `option` is one this crate decodes (anything else gets `NBD_REP_ERR_UNSUP`).
#[must_use]
pub const fn is_known_option(option: u32) -> bool {
    matches!(
        option,
        NBD_OPT_EXPORT_NAME
            | NBD_OPT_ABORT
            | NBD_OPT_LIST
            | NBD_OPT_STARTTLS
            | NBD_OPT_INFO
            | NBD_OPT_GO
            | NBD_OPT_STRUCTURED_REPLY
            | NBD_OPT_LIST_META_CONTEXT
            | NBD_OPT_SET_META_CONTEXT
            | NBD_OPT_EXTENDED_HEADERS
    )
}

/// Decides how to treat an option's data from its header:
///
/// | length                                  | action                                       |
/// |-----------------------------------------|----------------------------------------------|
/// | ≤ [`MAX_OPTION_LENGTH`]                 | `Read`                                       |
/// | ≤ [`MAX_OPTION_DISCARD_BYTES`], unknown | discard, `NBD_REP_ERR_UNSUP`                 |
/// | ≤ [`MAX_OPTION_DISCARD_BYTES`], known   | discard, `NBD_REP_ERR_TOO_BIG`               |
/// | larger (e.g. a claimed 4 GiB)           | `Close` (denial of service, see the const)   |
///
/// `NBD_OPT_EXPORT_NAME` longer than [`MAX_OPTION_LENGTH`] always closes: its name
/// would exceed the 4096-byte string limit, and that option has no error reply
/// ("If the server is unwilling to allow the export, it MUST terminate the session").
#[must_use]
pub const fn option_data_action(header: &OptionHeader) -> OptionDataAction {
    if header.length <= MAX_OPTION_LENGTH {
        return OptionDataAction::Read;
    }
    if header.option == NBD_OPT_EXPORT_NAME || header.length > MAX_OPTION_DISCARD_BYTES {
        return OptionDataAction::Close;
    }
    let reply_type = if is_known_option(header.option) {
        NBD_REP_ERR_TOO_BIG
    } else {
        NBD_REP_ERR_UNSUP
    };
    OptionDataAction::DiscardThenReply { reply_type }
}

// ---------------------------------------------------------------- NBD_OPT_EXPORT_NAME reply

/// Appends the reply that ends a successful `NBD_OPT_EXPORT_NAME`: size (u64),
/// transmission flags (u16), then 124 zero bytes unless the client set
/// `NBD_FLAG_C_NO_ZEROES` ("124 bytes, zeroes (reserved) (unless `NBD_FLAG_C_NO_ZEROES`
/// was negotiated by the client)").
pub fn encode_export_name_reply(
    out: &mut Vec<u8>,
    size_bytes: u64,
    transmission_flags: u16,
    no_zeroes: bool,
) {
    out.extend_from_slice(&size_bytes.to_be_bytes());
    out.extend_from_slice(&transmission_flags.to_be_bytes());
    if !no_zeroes {
        out.resize(out.len() + EXPORT_NAME_REPLY_PADDING_BYTES, 0);
    }
}

// ---------------------------------------------------------------- transmission flags

/// The transmission flags Headroom advertises for an export.
///
/// Always: `HAS_FLAGS`, `SEND_FLUSH`, `SEND_FUA`, `CAN_MULTI_CONN` (the server keeps
/// no per-connection cache, so "the effects of `NBD_CMD_FLUSH` and `NBD_CMD_FLAG_FUA`
/// MUST be visible across all connections" holds), `SEND_CACHE`.
/// Writable exports: `SEND_TRIM`, `SEND_WRITE_ZEROES`, `SEND_FAST_ZERO`.
/// Read-only exports: `READ_ONLY` instead of those three.
/// With structured replies: `SEND_DF` ("MUST leave this flag clear if structured
/// replies have not been negotiated").
///
/// [`crate::validate_request`] assumes exactly this flag set.
#[must_use]
pub const fn transmission_flags(read_only: bool, structured_replies: bool) -> u16 {
    let mut flags =
        NBD_FLAG_HAS_FLAGS | NBD_FLAG_SEND_FLUSH | NBD_FLAG_SEND_FUA | NBD_FLAG_CAN_MULTI_CONN;
    flags |= NBD_FLAG_SEND_CACHE;
    if read_only {
        flags |= NBD_FLAG_READ_ONLY;
    } else {
        flags |= NBD_FLAG_SEND_TRIM | NBD_FLAG_SEND_WRITE_ZEROES | NBD_FLAG_SEND_FAST_ZERO;
    }
    if structured_replies {
        flags |= NBD_FLAG_SEND_DF;
    }
    flags
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::consts::*;

    #[test]
    fn greeting_layout() {
        // S: 64 bits NBDMAGIC, S: 64 bits IHAVEOPT, S: 16 bits handshake flags.
        let mut out = Vec::new();
        encode_server_greeting(&mut out);
        assert_eq!(
            out,
            [
                b'N', b'B', b'D', b'M', b'A', b'G', b'I', b'C', //
                b'I', b'H', b'A', b'V', b'E', b'O', b'P', b'T', //
                0x00, 0x03,
            ]
        );
        assert_eq!(out.len(), SERVER_GREETING_LEN);
    }

    #[test]
    fn client_flags_known_bits_decode() {
        assert_eq!(
            decode_client_flags(0),
            Ok(ClientFlags {
                fixed_newstyle: false,
                no_zeroes: false
            })
        );
        assert_eq!(
            decode_client_flags(3),
            Ok(ClientFlags {
                fixed_newstyle: true,
                no_zeroes: true
            })
        );
        let flags = decode_client_flags(1).unwrap();
        assert!(flags.fixed_newstyle && !flags.no_zeroes);
        assert_eq!(flags.to_raw(), 1);
    }

    #[test]
    fn client_flags_unknown_bits_close() {
        for raw in [4, 0x8000_0000, 0xffff_ffff, 1 | 8] {
            let err = decode_client_flags(raw).unwrap_err();
            assert_eq!(err, HandshakeError::UnknownClientFlags { flags: raw });
            assert!(err.closes_connection());
        }
    }

    #[test]
    fn option_header_layout() {
        // C: 64 bits IHAVEOPT, C: 32 bits option, C: 32 bits length.
        let buf: [u8; 16] = [
            b'I', b'H', b'A', b'V', b'E', b'O', b'P', b'T', 0, 0, 0, 7, 0, 0, 0x01, 0x02,
        ];
        assert_eq!(
            decode_option_header(&buf),
            Ok(OptionHeader {
                option: NBD_OPT_GO,
                length: 0x102
            })
        );
        let mut out = Vec::new();
        encode_option_header(&mut out, NBD_OPT_GO, 0x102);
        assert_eq!(out, buf);
    }

    #[test]
    fn option_header_bad_magic_is_an_error() {
        let mut buf = [0u8; 16];
        buf[..8].copy_from_slice(b"GARBAGE!");
        let err = decode_option_header(&buf).unwrap_err();
        assert_eq!(
            err,
            HandshakeError::BadOptionMagic {
                magic: u64::from_be_bytes(*b"GARBAGE!")
            }
        );
    }

    #[test]
    fn option_length_policy() {
        let h = |option, length| OptionHeader { option, length };
        assert_eq!(
            option_data_action(&h(NBD_OPT_GO, 0)),
            OptionDataAction::Read
        );
        assert_eq!(
            option_data_action(&h(NBD_OPT_GO, MAX_OPTION_LENGTH)),
            OptionDataAction::Read
        );
        assert_eq!(
            option_data_action(&h(NBD_OPT_GO, MAX_OPTION_LENGTH + 1)),
            OptionDataAction::DiscardThenReply {
                reply_type: NBD_REP_ERR_TOO_BIG
            }
        );
        assert_eq!(
            option_data_action(&h(999, MAX_OPTION_LENGTH + 1)),
            OptionDataAction::DiscardThenReply {
                reply_type: NBD_REP_ERR_UNSUP
            }
        );
        assert_eq!(
            option_data_action(&h(999, 100)),
            OptionDataAction::Read,
            "short unknown options are read, then answered UNSUP by decode_option"
        );
        assert_eq!(
            option_data_action(&h(NBD_OPT_GO, MAX_OPTION_DISCARD_BYTES + 1)),
            OptionDataAction::Close
        );
        assert_eq!(
            option_data_action(&h(NBD_OPT_LIST, u32::MAX)),
            OptionDataAction::Close,
            "an option claiming 4 GiB closes"
        );
        assert_eq!(
            option_data_action(&h(NBD_OPT_EXPORT_NAME, MAX_OPTION_LENGTH + 1)),
            OptionDataAction::Close
        );
    }

    #[test]
    fn export_name_reply_layout() {
        let mut out = Vec::new();
        encode_export_name_reply(&mut out, 0x0102_0304_0506_0708, 0x0a0b, false);
        assert_eq!(out.len(), 8 + 2 + 124);
        assert_eq!(out[..10], [1, 2, 3, 4, 5, 6, 7, 8, 0x0a, 0x0b]);
        assert!(out[10..].iter().all(|&b| b == 0));

        let mut out = vec![0xee];
        encode_export_name_reply(&mut out, 1 << 30, 1, true);
        assert_eq!(out, [0xee, 0, 0, 0, 0, 0x40, 0, 0, 0, 0, 1]);
    }

    #[test]
    fn transmission_flag_sets() {
        let rw = transmission_flags(false, false);
        assert_eq!(rw & NBD_FLAG_HAS_FLAGS, NBD_FLAG_HAS_FLAGS);
        assert_eq!(rw & NBD_FLAG_READ_ONLY, 0);
        for f in [
            NBD_FLAG_SEND_FLUSH,
            NBD_FLAG_SEND_FUA,
            NBD_FLAG_SEND_TRIM,
            NBD_FLAG_SEND_WRITE_ZEROES,
            NBD_FLAG_SEND_FAST_ZERO,
            NBD_FLAG_CAN_MULTI_CONN,
            NBD_FLAG_SEND_CACHE,
        ] {
            assert_ne!(rw & f, 0, "flag {f:#x} missing");
        }
        assert_eq!(rw & NBD_FLAG_SEND_DF, 0, "DF needs structured replies");
        assert_ne!(transmission_flags(false, true) & NBD_FLAG_SEND_DF, 0);

        let ro = transmission_flags(true, true);
        assert_ne!(ro & NBD_FLAG_READ_ONLY, 0);
        assert_eq!(
            ro & (NBD_FLAG_SEND_TRIM | NBD_FLAG_SEND_WRITE_ZEROES | NBD_FLAG_SEND_FAST_ZERO),
            0
        );
        assert_eq!(rw & (NBD_FLAG_ROTATIONAL | NBD_FLAG_SEND_RESIZE), 0);
        assert_eq!(rw, 0b0000_1101_0110_1101);
    }
}

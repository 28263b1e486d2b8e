//! Transmission requests: the 28-byte header, the command set, and the validation
//! rules that turn a bad request into the errno the spec names.
//!
//! Why: validation is where protocol knowledge meets the export's limits, and where a
//! mistake either corrupts the stream (a WRITE payload left unread) or breaks a client
//! (a wrong errno). Doing it here, as a pure function over the header and a small
//! limits struct, lets every rule be table-tested with its spec sentence beside it;
//! the session only acts on the result.

use crate::consts::{
    NBD_CMD_BLOCK_STATUS, NBD_CMD_CACHE, NBD_CMD_DISC, NBD_CMD_FLAG_DF, NBD_CMD_FLAG_FAST_ZERO,
    NBD_CMD_FLAG_FUA, NBD_CMD_FLAG_NO_HOLE, NBD_CMD_FLAG_REQ_ONE, NBD_CMD_FLUSH, NBD_CMD_READ,
    NBD_CMD_TRIM, NBD_CMD_WRITE, NBD_CMD_WRITE_ZEROES, REQUEST_HEADER_LEN, REQUEST_MAGIC,
};
use crate::errno::Errno;
use crate::error::TransmissionError;

/// Largest WRITE payload the session reads and drops in order to reject a WRITE with
/// an errno and keep the connection. Larger rejected WRITEs close the connection.
///
/// Spec: "either the server or the client MAY initiate a hard disconnect if the payload
/// of an `NBD_CMD_WRITE` request ... would be large enough to be deemed a denial of
/// service attack; however, for maximum portability, any *length* less than 2^25
/// (33,554,432) bytes SHOULD NOT be considered a denial of service attack". 64 MiB is
/// twice that bound.
pub const MAX_DISCARD_BYTES: u32 = 64 * 1024 * 1024;

/// A decoded request header (compact form; extended headers are not negotiated).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestHeader {
    /// Command flags (`NBD_CMD_FLAG_*`).
    pub flags: u16,
    /// Command type (`NBD_CMD_*`), possibly unknown.
    pub command: u16,
    /// The client's cookie ("handle"), echoed in every reply.
    pub cookie: u64,
    /// Byte offset into the export.
    pub offset: u64,
    /// Length in bytes (for WRITE also the payload that follows the header).
    pub length: u32,
}

impl RequestHeader {
    /// Bytes of payload that follow this header on the wire: `length` for
    /// `NBD_CMD_WRITE` ("*length* bytes of data if the request is of type
    /// `NBD_CMD_WRITE`"), 0 otherwise.
    #[must_use]
    pub const fn payload_bytes(&self) -> u32 {
        if self.command == NBD_CMD_WRITE {
            self.length
        } else {
            0
        }
    }
}

/// Decodes a request header: "32 bits, 0x25609513, magic; 16 bits, command flags;
/// 16 bits, type; 64 bits, handle; 64 bits, offset; 32 bits, length".
///
/// A wrong magic is fatal ([`TransmissionError::BadRequestMagic`]): the session closes.
pub fn decode_request_header(
    buf: &[u8; REQUEST_HEADER_LEN],
) -> Result<RequestHeader, TransmissionError> {
    let magic = u32::from_be_bytes([buf[0], buf[1], buf[2], buf[3]]);
    if magic != REQUEST_MAGIC {
        return Err(TransmissionError::BadRequestMagic { magic });
    }
    Ok(RequestHeader {
        flags: u16::from_be_bytes([buf[4], buf[5]]),
        command: u16::from_be_bytes([buf[6], buf[7]]),
        cookie: u64::from_be_bytes([
            buf[8], buf[9], buf[10], buf[11], buf[12], buf[13], buf[14], buf[15],
        ]),
        offset: u64::from_be_bytes([
            buf[16], buf[17], buf[18], buf[19], buf[20], buf[21], buf[22], buf[23],
        ]),
        length: u32::from_be_bytes([buf[24], buf[25], buf[26], buf[27]]),
    })
}

/// Appends a request header (client side / tests). The inverse of [`decode_request_header`].
pub fn encode_request_header(out: &mut Vec<u8>, header: &RequestHeader) {
    out.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
    out.extend_from_slice(&header.flags.to_be_bytes());
    out.extend_from_slice(&header.command.to_be_bytes());
    out.extend_from_slice(&header.cookie.to_be_bytes());
    out.extend_from_slice(&header.offset.to_be_bytes());
    out.extend_from_slice(&header.length.to_be_bytes());
}

/// The commands Headroom serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Command {
    /// `NBD_CMD_READ` (0).
    Read,
    /// `NBD_CMD_WRITE` (1).
    Write,
    /// `NBD_CMD_DISC` (2).
    Disc,
    /// `NBD_CMD_FLUSH` (3).
    Flush,
    /// `NBD_CMD_TRIM` (4).
    Trim,
    /// `NBD_CMD_CACHE` (5).
    Cache,
    /// `NBD_CMD_WRITE_ZEROES` (6).
    WriteZeroes,
    /// `NBD_CMD_BLOCK_STATUS` (7).
    BlockStatus,
}

impl Command {
    /// Parses a command type; `None` for unknown types (including experimental
    /// `NBD_CMD_RESIZE`).
    #[must_use]
    pub const fn from_u16(raw: u16) -> Option<Self> {
        match raw {
            NBD_CMD_READ => Some(Self::Read),
            NBD_CMD_WRITE => Some(Self::Write),
            NBD_CMD_DISC => Some(Self::Disc),
            NBD_CMD_FLUSH => Some(Self::Flush),
            NBD_CMD_TRIM => Some(Self::Trim),
            NBD_CMD_CACHE => Some(Self::Cache),
            NBD_CMD_WRITE_ZEROES => Some(Self::WriteZeroes),
            NBD_CMD_BLOCK_STATUS => Some(Self::BlockStatus),
            _ => None,
        }
    }

    /// The command type on the wire.
    #[must_use]
    pub const fn as_u16(self) -> u16 {
        match self {
            Self::Read => NBD_CMD_READ,
            Self::Write => NBD_CMD_WRITE,
            Self::Disc => NBD_CMD_DISC,
            Self::Flush => NBD_CMD_FLUSH,
            Self::Trim => NBD_CMD_TRIM,
            Self::Cache => NBD_CMD_CACHE,
            Self::WriteZeroes => NBD_CMD_WRITE_ZEROES,
            Self::BlockStatus => NBD_CMD_BLOCK_STATUS,
        }
    }

    /// The spec's constant name.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::Read => "NBD_CMD_READ",
            Self::Write => "NBD_CMD_WRITE",
            Self::Disc => "NBD_CMD_DISC",
            Self::Flush => "NBD_CMD_FLUSH",
            Self::Trim => "NBD_CMD_TRIM",
            Self::Cache => "NBD_CMD_CACHE",
            Self::WriteZeroes => "NBD_CMD_WRITE_ZEROES",
            Self::BlockStatus => "NBD_CMD_BLOCK_STATUS",
        }
    }

    /// Whether the command changes data (refused with `NBD_EPERM` on read-only exports).
    #[must_use]
    pub const fn modifies_data(self) -> bool {
        matches!(self, Self::Write | Self::Trim | Self::WriteZeroes)
    }

    /// Command flags documented as applicable to this command (with Headroom's
    /// advertised transmission flags). FUA: "This flag is valid for all commands,
    /// provided `NBD_FLAG_SEND_FUA` has been negotiated, in which case the server MUST
    /// accept all commands with this bit set (even by ignoring the bit)".
    #[must_use]
    pub const fn applicable_flags(self) -> u16 {
        match self {
            Self::WriteZeroes => NBD_CMD_FLAG_FUA | NBD_CMD_FLAG_NO_HOLE | NBD_CMD_FLAG_FAST_ZERO,
            Self::Read => NBD_CMD_FLAG_FUA | NBD_CMD_FLAG_DF,
            Self::BlockStatus => NBD_CMD_FLAG_FUA | NBD_CMD_FLAG_REQ_ONE,
            Self::Write | Self::Disc | Self::Flush | Self::Trim | Self::Cache => NBD_CMD_FLAG_FUA,
        }
    }
}

impl std::fmt::Display for Command {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Every command flag bit Headroom knows in the compact-header protocol.
pub const KNOWN_COMMAND_FLAGS: u16 = NBD_CMD_FLAG_FUA
    | NBD_CMD_FLAG_NO_HOLE
    | NBD_CMD_FLAG_DF
    | NBD_CMD_FLAG_REQ_ONE
    | NBD_CMD_FLAG_FAST_ZERO;

/// What was negotiated for the connection, as validation needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExportLimits {
    /// Export size in bytes.
    pub size_bytes: u64,
    /// Whether the export is read-only (advertised `NBD_FLAG_READ_ONLY`).
    pub read_only: bool,
    /// Maximum READ/WRITE length (the advertised maximum block size;
    /// normally [`crate::MAX_PAYLOAD_BYTES`]).
    pub max_payload_bytes: u32,
    /// Whether `NBD_OPT_STRUCTURED_REPLY` was negotiated.
    pub structured_replies: bool,
    /// Context ID of `base:allocation` if it was selected with SET_META_CONTEXT for this export.
    pub allocation_context_id: Option<u32>,
}

/// A request that passed validation. `offset + length` is within the export for every
/// command but `Disc` (whose fields are passed through unchecked).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ValidRequest {
    /// The command.
    pub command: Command,
    /// `NBD_CMD_FLAG_FUA`: persist before replying.
    pub fua: bool,
    /// `NBD_CMD_FLAG_NO_HOLE` (WRITE_ZEROES): the range must stay allocated.
    pub no_hole: bool,
    /// `NBD_CMD_FLAG_FAST_ZERO` (WRITE_ZEROES): fail with `NBD_ENOTSUP` unless fast.
    pub fast_zero: bool,
    /// `NBD_CMD_FLAG_DF` (READ): send at most one content chunk.
    pub df: bool,
    /// `NBD_CMD_FLAG_REQ_ONE` (BLOCK_STATUS): one extent per context.
    pub req_one: bool,
    /// Cookie to echo.
    pub cookie: u64,
    /// Byte offset.
    pub offset: u64,
    /// Length in bytes (0 is valid for all but BLOCK_STATUS; reply success without I/O).
    pub length: u32,
}

impl ValidRequest {
    /// Payload bytes that follow the header (WRITE only); the session reads them next.
    #[must_use]
    pub const fn payload_bytes(&self) -> u32 {
        match self.command {
            Command::Write => self.length,
            _ => 0,
        }
    }
}

/// Why a request was rejected; its `Display` is suitable as the message of a
/// structured error chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum RejectReason {
    /// "The server SHOULD return `NBD_EINVAL` if it receives an unknown command."
    #[error("unknown command {command}")]
    UnknownCommand {
        /// The command type sent.
        command: u16,
    },
    /// "The server SHOULD return `NBD_EINVAL` if it receives an unknown command flag."
    #[error("unknown command flags {flags:#06x}")]
    UnknownFlags {
        /// The unknown bits.
        flags: u16,
    },
    /// "It also SHOULD return `NBD_EINVAL` if it receives a request with a flag not
    /// explicitly documented as applicable to the given request."
    #[error("flag {flag:#06x} is not applicable to {command}")]
    FlagNotApplicable {
        /// The lowest offending flag bit.
        flag: u16,
        /// The command it was sent with.
        command: Command,
    },
    /// "Clients MUST NOT set the `NBD_CMD_FLAG_DF` request flag unless `NBD_FLAG_SEND_DF`
    /// is set", and the server "MUST leave this flag clear if structured replies have
    /// not been negotiated".
    #[error("NBD_CMD_FLAG_DF without structured replies")]
    DfWithoutStructuredReplies,
    /// "it SHOULD return `NBD_EPERM` if it receives a write or trim request on a
    /// read-only export"; for WRITE_ZEROES: "It SHOULD return `NBD_EPERM` if it
    /// receives a write zeroes request on a read-only export."
    #[error("{command} on a read-only export")]
    ReadOnly {
        /// The refused command.
        command: Command,
    },
    /// "Servers SHOULD reply with `NBD_EINVAL` to clients sending
    /// `NBD_CMD_BLOCK_STATUS` without selecting at least one metadata context."
    #[error("NBD_CMD_BLOCK_STATUS without a negotiated metadata context")]
    NoMetaContext,
    /// FLUSH: "*length* and *offset* are reserved, and MUST be set to all-zero."
    #[error("NBD_CMD_FLUSH with nonzero offset or length")]
    FlushWithRange,
    /// "the client MUST NOT use a *length* larger than any advertised maximum block
    /// size. The server SHOULD report an `NBD_EINVAL` error if the client's request ...
    /// is larger than the advertised maximum block size."
    #[error("length {length_bytes} exceeds the maximum block size {max_payload_bytes}")]
    TooLarge {
        /// Requested length.
        length_bytes: u32,
        /// Advertised maximum.
        max_payload_bytes: u32,
    },
    /// `offset + length` does not fit in 64 bits.
    #[error("offset {offset} + length {length_bytes} overflows")]
    RangeOverflow {
        /// Requested offset.
        offset: u64,
        /// Requested length.
        length_bytes: u32,
    },
    /// The range ends past the end of the export.
    #[error("range {offset}+{length_bytes} is beyond the export size {size_bytes}")]
    BeyondEnd {
        /// Requested offset.
        offset: u64,
        /// Requested length.
        length_bytes: u32,
        /// Export size.
        size_bytes: u64,
    },
    /// BLOCK_STATUS of length 0: the reply must hold at least one extent of nonzero
    /// length, which cannot describe an empty range.
    #[error("NBD_CMD_BLOCK_STATUS with length 0")]
    ZeroLengthBlockStatus,
}

/// A well-framed request the server refuses. The session replies with `errno` for
/// `cookie` and then:
/// - if `fatal`: closes the connection (the WRITE payload is too large to skip;
///   sending the error reply first is optional);
/// - else: reads and drops `payload_to_discard` bytes (non-zero only for WRITE) and
///   goes on with the next request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{reason}: {errno}")]
pub struct RequestRejection {
    /// Cookie to echo in the error reply.
    pub cookie: u64,
    /// The errno to reply with.
    pub errno: Errno,
    /// Bytes of WRITE payload to read and drop before the next request header.
    pub payload_to_discard: u32,
    /// The payload is larger than [`MAX_DISCARD_BYTES`]: close the connection.
    pub fatal: bool,
    /// Which rule was broken.
    pub reason: RejectReason,
    /// Payload bytes the client sends after this header (WRITE `length`, else 0),
    /// whether or not they are to be discarded.
    pub wire_payload_bytes: u32,
}

impl RequestRejection {
    /// The errno to reply with.
    #[must_use]
    pub const fn errno(&self) -> Errno {
        self.errno
    }

    /// Payload bytes that follow the rejected header on the wire (WRITE `length`, else 0).
    /// The session must consume them before the next header, or close.
    #[must_use]
    pub const fn payload_bytes(&self) -> u32 {
        self.wire_payload_bytes
    }

    /// Whether the session must close: the payload exceeds [`MAX_DISCARD_BYTES`].
    #[must_use]
    pub const fn is_fatal(&self) -> bool {
        self.fatal
    }

    /// A fixed, human-readable summary of the broken rule (the `Display` of
    /// [`RequestRejection::reason`] adds the numbers).
    #[must_use]
    pub const fn message(&self) -> &'static str {
        self.reason.message()
    }
}

impl RejectReason {
    /// A fixed summary of the rule, for error messages that must not allocate.
    #[must_use]
    pub const fn message(&self) -> &'static str {
        match self {
            Self::UnknownCommand { .. } => "unknown command",
            Self::UnknownFlags { .. } => "unknown command flags",
            Self::FlagNotApplicable { .. } => "command flag not applicable to this command",
            Self::DfWithoutStructuredReplies => "DF flag without structured replies",
            Self::ReadOnly { .. } => "export is read-only",
            Self::NoMetaContext => "block status without a negotiated metadata context",
            Self::FlushWithRange => "flush with nonzero offset or length",
            Self::TooLarge { .. } => "request larger than the maximum block size",
            Self::RangeOverflow { .. } => "offset + length overflows",
            Self::BeyondEnd { .. } => "request beyond the end of the export",
            Self::ZeroLengthBlockStatus => "block status of length 0",
        }
    }
}

/// Validates a decoded header against what was negotiated. Rules, in order (the first
/// that matches decides the errno):
///
/// 1. unknown command → `NBD_EINVAL`;
/// 2. `NBD_CMD_DISC` → always valid ("There is no reply to an `NBD_CMD_DISC`", so an
///    error could not be reported anyway);
/// 3. unknown flag bits → `NBD_EINVAL`; a known flag not applicable to the command
///    (NO_HOLE/FAST_ZERO off WRITE_ZEROES, DF off READ, REQ_ONE off BLOCK_STATUS)
///    → `NBD_EINVAL`; FUA is accepted on every command;
/// 4. DF without structured replies → `NBD_EINVAL`;
/// 5. WRITE/TRIM/WRITE_ZEROES on a read-only export → `NBD_EPERM`;
/// 6. BLOCK_STATUS without structured replies or without `base:allocation` selected
///    → `NBD_EINVAL`;
/// 7. FLUSH with nonzero offset or length → `NBD_EINVAL`;
/// 8. READ and WRITE longer than `max_payload_bytes` → `NBD_EINVAL`. TRIM, WRITE_ZEROES,
///    CACHE and BLOCK_STATUS carry no payload and are accepted up to the export size (the
///    session splits them so that no single backend operation is unbounded);
/// 9. `offset + length` overflowing u64 → `NBD_EINVAL`;
/// 10. range past the end: WRITE/WRITE_ZEROES → `NBD_ENOSPC`, READ/TRIM/CACHE/BLOCK_STATUS
///     → `NBD_EINVAL`;
/// 11. BLOCK_STATUS with length 0 → `NBD_EINVAL`.
///
/// Zero-length READ/WRITE/TRIM/CACHE/WRITE_ZEROES are valid ("the behavior of a
/// server on such a request is unspecified although the server SHOULD NOT
/// disconnect"); the session replies success without I/O.
///
/// A rejected WRITE carries `payload_to_discard = length` when `length <=`
/// [`MAX_DISCARD_BYTES`], else `fatal = true`.
pub fn validate_request(
    h: &RequestHeader,
    limits: &ExportLimits,
) -> Result<ValidRequest, RequestRejection> {
    let reject = |errno: Errno, reason: RejectReason| {
        let payload = h.payload_bytes();
        let fatal = payload > MAX_DISCARD_BYTES;
        RequestRejection {
            cookie: h.cookie,
            errno,
            payload_to_discard: if fatal { 0 } else { payload },
            fatal,
            reason,
            wire_payload_bytes: payload,
        }
    };

    // 1. "The server SHOULD return NBD_EINVAL if it receives an unknown command."
    let Some(command) = Command::from_u16(h.command) else {
        return Err(reject(
            Errno::Einval,
            RejectReason::UnknownCommand { command: h.command },
        ));
    };

    let valid = ValidRequest {
        command,
        fua: h.flags & NBD_CMD_FLAG_FUA != 0,
        no_hole: h.flags & NBD_CMD_FLAG_NO_HOLE != 0,
        fast_zero: h.flags & NBD_CMD_FLAG_FAST_ZERO != 0,
        df: h.flags & NBD_CMD_FLAG_DF != 0,
        req_one: h.flags & NBD_CMD_FLAG_REQ_ONE != 0,
        cookie: h.cookie,
        offset: h.offset,
        length: h.length,
    };

    // 2. DISC: "The server MUST handle all outstanding requests ... and close the TCP
    // session." No reply exists to carry an error.
    if command == Command::Disc {
        return Ok(valid);
    }

    // 3. "The server SHOULD return NBD_EINVAL if it receives an unknown command flag. It
    // also SHOULD return NBD_EINVAL if it receives a request with a flag not explicitly
    // documented as applicable to the given request."
    let unknown = h.flags & !KNOWN_COMMAND_FLAGS;
    if unknown != 0 {
        return Err(reject(
            Errno::Einval,
            RejectReason::UnknownFlags { flags: unknown },
        ));
    }
    let inapplicable = h.flags & !command.applicable_flags();
    if inapplicable != 0 {
        return Err(reject(
            Errno::Einval,
            RejectReason::FlagNotApplicable {
                flag: inapplicable & inapplicable.wrapping_neg(),
                command,
            },
        ));
    }

    // 4. NBD_FLAG_SEND_DF is only advertised with structured replies; "Clients MUST NOT
    // set the NBD_CMD_FLAG_DF request flag unless this transmission flag is set."
    if valid.df && !limits.structured_replies {
        return Err(reject(
            Errno::Einval,
            RejectReason::DfWithoutStructuredReplies,
        ));
    }

    // 5. "it SHOULD return NBD_EPERM if it receives a write or trim request on a
    // read-only export" (and likewise for write zeroes).
    if limits.read_only && command.modifies_data() {
        return Err(reject(Errno::Eperm, RejectReason::ReadOnly { command }));
    }

    // 6. "Servers SHOULD reply with NBD_EINVAL to clients sending NBD_CMD_BLOCK_STATUS
    // without selecting at least one metadata context." Contexts require structured
    // replies, and the reply must be structured.
    if command == Command::BlockStatus
        && (!limits.structured_replies || limits.allocation_context_id.is_none())
    {
        return Err(reject(Errno::Einval, RejectReason::NoMetaContext));
    }

    // 7. "For a flush request, *length* and *offset* are reserved, and MUST be set to
    // all-zero."
    if command == Command::Flush {
        if h.offset != 0 || h.length != 0 {
            return Err(reject(Errno::Einval, RejectReason::FlushWithRange));
        }
        return Ok(valid);
    }

    // 8. "the client MUST NOT use a *length* larger than any advertised maximum block
    // size. The server SHOULD report an NBD_EINVAL error if ... [it] is larger than the
    // advertised maximum block size." Headroom enforces this only where the length is
    // memory the server must hold: READ and WRITE. WRITE_ZEROES, TRIM, CACHE and
    // BLOCK_STATUS carry no payload; real clients send them larger than the maximum block
    // size (libnbd's nbdfuse forwards a whole-device zeroing from mkfs.ext4, and nbdkit
    // and qemu-nbd accept it), so they are accepted up to the export size (rule 10) and
    // the session splits them into bounded pieces.
    let size_limited = match command {
        Command::Read | Command::Write => true,
        Command::WriteZeroes
        | Command::Cache
        | Command::Trim
        | Command::BlockStatus
        | Command::Disc
        | Command::Flush => false,
    };
    if size_limited && h.length > limits.max_payload_bytes {
        return Err(reject(
            Errno::Einval,
            RejectReason::TooLarge {
                length_bytes: h.length,
                max_payload_bytes: limits.max_payload_bytes,
            },
        ));
    }

    // 9. An unrepresentable range is an invalid argument.
    let Some(end) = h.offset.checked_add(u64::from(h.length)) else {
        return Err(reject(
            Errno::Einval,
            RejectReason::RangeOverflow {
                offset: h.offset,
                length_bytes: h.length,
            },
        ));
    };

    // 10. "The server SHOULD return NBD_ENOSPC if it receives a write request including
    // one or more sectors beyond the size of the device. ... It SHOULD return NBD_EINVAL
    // if it receives a read or trim request including one or more sectors beyond the
    // size of the device"; WRITE_ZEROES: "SHOULD return NBD_ENOSPC if it receives a
    // write zeroes request including one or more sectors beyond the size of the device";
    // BLOCK_STATUS: "SHOULD return NBD_EINVAL if it receives a NBD_CMD_BLOCK_STATUS
    // request including one or more sectors beyond the size of the device". CACHE is
    // not specified; it is treated like READ.
    if end > limits.size_bytes {
        let errno = match command {
            Command::Write | Command::WriteZeroes => Errno::Enospc,
            _ => Errno::Einval,
        };
        return Err(reject(
            errno,
            RejectReason::BeyondEnd {
                offset: h.offset,
                length_bytes: h.length,
                size_bytes: limits.size_bytes,
            },
        ));
    }

    // 11. A block status reply "MUST return at least one status descriptor" of nonzero
    // length; for an empty range there is nothing truthful to return.
    if command == Command::BlockStatus && h.length == 0 {
        return Err(reject(Errno::Einval, RejectReason::ZeroLengthBlockStatus));
    }

    Ok(valid)
}

/// Appends the error reply for a rejected request.
///
/// With structured replies: one `NBD_REPLY_TYPE_ERROR` chunk with `NBD_REPLY_FLAG_DONE`
/// whose message is the [`RejectReason`] ("The server SHOULD prefer sending errors via
/// a structured reply, as the error can then be accompanied by a string payload", and
/// the server "MUST NOT use a simple reply for `NBD_CMD_READ` (even for the case of an
/// early `NBD_EINVAL` due to bad flags)"). Without: a simple reply carrying the errno
/// and no payload. Rejections are rare, so formatting the message may allocate.
pub fn encode_rejection(out: &mut Vec<u8>, rejection: &RequestRejection, structured_replies: bool) {
    if structured_replies {
        crate::reply::encode_structured_error(
            out,
            true,
            rejection.cookie,
            rejection.errno.as_u32(),
            &rejection.reason.to_string(),
        );
    } else {
        crate::reply::encode_simple_reply_header(out, rejection.cookie, rejection.errno.as_u32());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::consts::*;

    const SIZE: u64 = 1 << 30;
    const MAX: u32 = 32 << 20;

    fn limits() -> ExportLimits {
        ExportLimits {
            size_bytes: SIZE,
            read_only: false,
            max_payload_bytes: MAX,
            structured_replies: true,
            allocation_context_id: Some(1),
        }
    }

    fn req(command: u16, flags: u16, offset: u64, length: u32) -> RequestHeader {
        RequestHeader {
            flags,
            command,
            cookie: 0xc0ff_ee00_1234_5678,
            offset,
            length,
        }
    }

    #[test]
    fn header_layout_from_spec() {
        let buf: [u8; 28] = [
            0x25, 0x60, 0x95, 0x13, // magic
            0x00, 0x01, // flags: FUA
            0x00, 0x01, // type: WRITE
            1, 2, 3, 4, 5, 6, 7, 8, // handle
            0, 0, 0, 0, 0, 0, 0x10, 0, // offset 4096
            0, 0, 0x02, 0, // length 512
        ];
        let h = decode_request_header(&buf).unwrap();
        assert_eq!(
            h,
            RequestHeader {
                flags: NBD_CMD_FLAG_FUA,
                command: NBD_CMD_WRITE,
                cookie: 0x0102_0304_0506_0708,
                offset: 4096,
                length: 512
            }
        );
        assert_eq!(h.payload_bytes(), 512);
        let mut out = Vec::new();
        encode_request_header(&mut out, &h);
        assert_eq!(out, buf);
    }

    #[test]
    fn bad_magic_is_fatal() {
        let mut buf = [0u8; 28];
        buf[..4].copy_from_slice(&0x2560_9514u32.to_be_bytes());
        let err = decode_request_header(&buf).unwrap_err();
        assert_eq!(
            err,
            TransmissionError::BadRequestMagic { magic: 0x2560_9514 }
        );
        assert!(err.closes_connection());
        assert_eq!(err.errno(), None);
    }

    #[test]
    fn command_numbers_round_trip() {
        for raw in 0..=7u16 {
            let c = Command::from_u16(raw).unwrap();
            assert_eq!(c.as_u16(), raw);
        }
        assert_eq!(Command::from_u16(NBD_CMD_RESIZE), None);
        assert_eq!(Command::from_u16(0xffff), None);
    }

    /// One row: request, limits tweak, expected outcome.
    struct Row {
        name: &'static str,
        header: RequestHeader,
        limits: ExportLimits,
        expect: Result<(), (Errno, u32, bool)>,
    }

    fn ok(name: &'static str, header: RequestHeader) -> Row {
        Row {
            name,
            header,
            limits: limits(),
            expect: Ok(()),
        }
    }

    fn err(name: &'static str, header: RequestHeader, errno: Errno) -> Row {
        let discard = header.payload_bytes();
        Row {
            name,
            header,
            limits: limits(),
            expect: Err((errno, discard, false)),
        }
    }

    fn with(mut row: Row, f: impl FnOnce(&mut ExportLimits)) -> Row {
        f(&mut row.limits);
        row
    }

    #[test]
    fn validation_table() {
        let ro = |l: &mut ExportLimits| l.read_only = true;
        let simple = |l: &mut ExportLimits| {
            l.structured_replies = false;
            l.allocation_context_id = None;
        };
        let rows = vec![
            // --- well-formed requests
            ok("read", req(NBD_CMD_READ, 0, 0, 4096)),
            ok("read to the last byte", req(NBD_CMD_READ, 0, SIZE - 1, 1)),
            ok("read max payload", req(NBD_CMD_READ, 0, 0, MAX)),
            ok("write fua", req(NBD_CMD_WRITE, NBD_CMD_FLAG_FUA, 4096, 512)),
            ok("flush", req(NBD_CMD_FLUSH, 0, 0, 0)),
            ok(
                "fua on flush is accepted",
                req(NBD_CMD_FLUSH, NBD_CMD_FLAG_FUA, 0, 0),
            ),
            ok(
                "fua on read is accepted",
                req(NBD_CMD_READ, NBD_CMD_FLAG_FUA, 0, 1),
            ),
            ok(
                "trim whole export",
                req(NBD_CMD_TRIM, 0, 0, u32::MAX).tap_len(SIZE),
            ),
            ok("cache", req(NBD_CMD_CACHE, 0, 0, 65536)),
            ok(
                "write zeroes no_hole",
                req(
                    NBD_CMD_WRITE_ZEROES,
                    NBD_CMD_FLAG_NO_HOLE | NBD_CMD_FLAG_FUA,
                    0,
                    4096,
                ),
            ),
            ok(
                "fast zero beyond max payload",
                req(NBD_CMD_WRITE_ZEROES, NBD_CMD_FLAG_FAST_ZERO, 0, MAX + 1),
            ),
            ok(
                "block status",
                req(NBD_CMD_BLOCK_STATUS, NBD_CMD_FLAG_REQ_ONE, 0, u32::MAX).tap_len(SIZE),
            ),
            ok("df read", req(NBD_CMD_READ, NBD_CMD_FLAG_DF, 0, 65536)),
            ok("zero-length read", req(NBD_CMD_READ, 0, SIZE, 0)),
            ok("zero-length write", req(NBD_CMD_WRITE, 0, 0, 0)),
            ok(
                "disc with junk fields",
                req(NBD_CMD_DISC, 0xffff, u64::MAX, 7),
            ),
            ok("read on read-only", req(NBD_CMD_READ, 0, 0, 1)),
            // --- unknown command / flags
            err("unknown command", req(99, 0, 0, 0), Errno::Einval),
            err(
                "resize is unknown",
                req(NBD_CMD_RESIZE, 0, 0, 0),
                Errno::Einval,
            ),
            err(
                "unknown flag bit",
                req(NBD_CMD_READ, 1 << 9, 0, 1),
                Errno::Einval,
            ),
            err(
                "payload_len flag unknown without extended headers",
                req(NBD_CMD_WRITE, NBD_CMD_FLAG_PAYLOAD_LEN, 0, 512),
                Errno::Einval,
            ),
            err(
                "no_hole on write",
                req(NBD_CMD_WRITE, NBD_CMD_FLAG_NO_HOLE, 0, 8),
                Errno::Einval,
            ),
            err(
                "fast_zero on trim",
                req(NBD_CMD_TRIM, NBD_CMD_FLAG_FAST_ZERO, 0, 8),
                Errno::Einval,
            ),
            err(
                "df on write",
                req(NBD_CMD_WRITE, NBD_CMD_FLAG_DF, 0, 8),
                Errno::Einval,
            ),
            err(
                "req_one on read",
                req(NBD_CMD_READ, NBD_CMD_FLAG_REQ_ONE, 0, 8),
                Errno::Einval,
            ),
            with(
                err(
                    "df without structured replies",
                    req(NBD_CMD_READ, NBD_CMD_FLAG_DF, 0, 8),
                    Errno::Einval,
                ),
                simple,
            ),
            // --- read-only
            with(
                err(
                    "write on read-only",
                    req(NBD_CMD_WRITE, 0, 0, 512),
                    Errno::Eperm,
                ),
                ro,
            ),
            with(
                err(
                    "trim on read-only",
                    req(NBD_CMD_TRIM, 0, 0, 512),
                    Errno::Eperm,
                ),
                ro,
            ),
            with(
                err(
                    "write zeroes on read-only",
                    req(NBD_CMD_WRITE_ZEROES, 0, 0, 512),
                    Errno::Eperm,
                ),
                ro,
            ),
            with(ok("flush on read-only", req(NBD_CMD_FLUSH, 0, 0, 0)), ro),
            // --- block status preconditions
            with(
                err(
                    "block status without structured",
                    req(NBD_CMD_BLOCK_STATUS, 0, 0, 512),
                    Errno::Einval,
                ),
                simple,
            ),
            with(
                err(
                    "block status without context",
                    req(NBD_CMD_BLOCK_STATUS, 0, 0, 512),
                    Errno::Einval,
                ),
                |l| l.allocation_context_id = None,
            ),
            err(
                "block status length 0",
                req(NBD_CMD_BLOCK_STATUS, 0, 0, 0),
                Errno::Einval,
            ),
            // --- flush reserved fields
            err(
                "flush with offset",
                req(NBD_CMD_FLUSH, 0, 1, 0),
                Errno::Einval,
            ),
            err(
                "flush with length",
                req(NBD_CMD_FLUSH, 0, 0, 1),
                Errno::Einval,
            ),
            // --- maximum block size
            err(
                "read 256 MiB",
                req(NBD_CMD_READ, 0, 0, 256 << 20),
                Errno::Einval,
            ),
            err(
                "read max+1",
                req(NBD_CMD_READ, 0, 0, MAX + 1),
                Errno::Einval,
            ),
            ok(
                "cache beyond max payload",
                req(NBD_CMD_CACHE, 0, 0, MAX + 1),
            ),
            ok(
                "write zeroes beyond max payload",
                req(NBD_CMD_WRITE_ZEROES, 0, 0, MAX + 1),
            ),
            ok("trim 1 GiB", req(NBD_CMD_TRIM, 0, 0, 1 << 30)),
            ok(
                "write zeroes of the whole export",
                req(NBD_CMD_WRITE_ZEROES, NBD_CMD_FLAG_NO_HOLE, 0, 1 << 30),
            ),
            err(
                "write zeroes beyond max payload and past the end",
                req(NBD_CMD_WRITE_ZEROES, 0, 4096, 1 << 30),
                Errno::Enospc,
            ),
            err(
                "trim beyond max payload and past the end",
                req(NBD_CMD_TRIM, 0, 4096, 1 << 30),
                Errno::Einval,
            ),
            err(
                "cache beyond max payload and past the end",
                req(NBD_CMD_CACHE, 0, 4096, 1 << 30),
                Errno::Einval,
            ),
            err(
                "write max+1 (discardable)",
                req(NBD_CMD_WRITE, 0, 0, MAX + 1),
                Errno::Einval,
            ),
            // --- ranges
            err(
                "read overflow",
                req(NBD_CMD_READ, 0, u64::MAX, 2),
                Errno::Einval,
            ),
            err(
                "write overflow",
                req(NBD_CMD_WRITE, 0, u64::MAX - 1, 4096),
                Errno::Einval,
            ),
            err(
                "read past end",
                req(NBD_CMD_READ, 0, SIZE - 1, 2),
                Errno::Einval,
            ),
            err(
                "read at end+1, length 0",
                req(NBD_CMD_READ, 0, SIZE + 1, 0),
                Errno::Einval,
            ),
            err(
                "write past end",
                req(NBD_CMD_WRITE, 0, SIZE, 512),
                Errno::Enospc,
            ),
            err(
                "write zeroes past end",
                req(NBD_CMD_WRITE_ZEROES, 0, SIZE - 1, 2),
                Errno::Enospc,
            ),
            err(
                "trim past end",
                req(NBD_CMD_TRIM, 0, SIZE, 1),
                Errno::Einval,
            ),
            err(
                "cache past end",
                req(NBD_CMD_CACHE, 0, SIZE, 1),
                Errno::Einval,
            ),
            err(
                "block status past end",
                req(NBD_CMD_BLOCK_STATUS, 0, SIZE, 1),
                Errno::Einval,
            ),
        ];
        for row in rows {
            let got = validate_request(&row.header, &row.limits);
            match (row.expect, got) {
                (Ok(()), Ok(v)) => {
                    assert_eq!(v.cookie, row.header.cookie, "{}", row.name);
                    assert_eq!(v.offset, row.header.offset, "{}", row.name);
                    assert_eq!(v.length, row.header.length, "{}", row.name);
                }
                (Err((errno, discard, fatal)), Err(r)) => {
                    assert_eq!(r.errno, errno, "{}: {}", row.name, r.reason);
                    assert_eq!(r.payload_to_discard, discard, "{}", row.name);
                    assert_eq!(r.fatal, fatal, "{}", row.name);
                    assert_eq!(r.cookie, row.header.cookie, "{}", row.name);
                }
                (expect, got) => panic!("{}: expected {expect:?}, got {got:?}", row.name),
            }
        }
    }

    trait TapLen {
        fn tap_len(self, size: u64) -> Self;
    }
    impl TapLen for RequestHeader {
        /// Caps the length so that the request covers at most `size` bytes.
        fn tap_len(mut self, size: u64) -> Self {
            self.length = u32::try_from(size.min(u64::from(self.length))).unwrap();
            self
        }
    }

    #[test]
    fn flags_are_decoded_into_the_valid_request() {
        let v = validate_request(
            &req(
                NBD_CMD_WRITE_ZEROES,
                NBD_CMD_FLAG_FUA | NBD_CMD_FLAG_NO_HOLE | NBD_CMD_FLAG_FAST_ZERO,
                0,
                8,
            ),
            &limits(),
        )
        .unwrap();
        assert!(v.fua && v.no_hole && v.fast_zero && !v.df && !v.req_one);
        assert_eq!(v.command, Command::WriteZeroes);
        assert_eq!(v.payload_bytes(), 0);
        let v = validate_request(
            &req(NBD_CMD_BLOCK_STATUS, NBD_CMD_FLAG_REQ_ONE, 0, 8),
            &limits(),
        )
        .unwrap();
        assert!(v.req_one && !v.fua);
        let v = validate_request(&req(NBD_CMD_READ, NBD_CMD_FLAG_DF, 0, 8), &limits()).unwrap();
        assert!(v.df);
        let v = validate_request(&req(NBD_CMD_WRITE, 0, 0, 8), &limits()).unwrap();
        assert_eq!(v.payload_bytes(), 8);
    }

    #[test]
    fn huge_rejected_write_is_fatal_and_discards_nothing() {
        // "a WRITE announcing 4 GiB": cannot be skipped, so the session must close.
        let r = validate_request(&req(NBD_CMD_WRITE, 0, 0, u32::MAX), &limits()).unwrap_err();
        assert_eq!(r.errno, Errno::Einval);
        assert!(r.fatal);
        assert_eq!(r.payload_to_discard, 0);

        // At the discard bound the payload is still skipped.
        let r =
            validate_request(&req(NBD_CMD_WRITE, 0, 0, MAX_DISCARD_BYTES), &limits()).unwrap_err();
        assert!(!r.fatal);
        assert_eq!(r.payload_to_discard, MAX_DISCARD_BYTES);

        // Rejected on read-only, a small write is discardable.
        let ro = ExportLimits {
            read_only: true,
            ..limits()
        };
        let r = validate_request(&req(NBD_CMD_WRITE, 0, 0, 4096), &ro).unwrap_err();
        assert_eq!(
            (r.errno, r.payload_to_discard, r.fatal),
            (Errno::Eperm, 4096, false)
        );

        // The accessor view used by sessions.
        let r = validate_request(&req(NBD_CMD_WRITE, 0, 0, u32::MAX), &limits()).unwrap_err();
        assert_eq!(r.payload_bytes(), u32::MAX);
        assert!(r.is_fatal());
        assert_eq!(r.errno(), Errno::Einval);
        assert_eq!(r.message(), "request larger than the maximum block size");

        // A non-write never has payload, whatever its length.
        let r = validate_request(&req(NBD_CMD_READ, 0, 0, u32::MAX), &limits()).unwrap_err();
        assert_eq!((r.payload_to_discard, r.fatal), (0, false));
        assert_eq!(r.payload_bytes(), 0);
    }

    #[test]
    fn rejection_replies() {
        let r = validate_request(&req(NBD_CMD_READ, 0, 0, 256 << 20), &limits()).unwrap_err();
        let mut simple = Vec::new();
        encode_rejection(&mut simple, &r, false);
        let mut expected = vec![0x67, 0x44, 0x66, 0x98, 0, 0, 0, 22];
        expected.extend_from_slice(&0xc0ff_ee00_1234_5678u64.to_be_bytes());
        assert_eq!(simple, expected);

        let mut structured = Vec::new();
        encode_rejection(&mut structured, &r, true);
        let message = r.reason.to_string();
        assert_eq!(&structured[..4], &STRUCTURED_REPLY_MAGIC.to_be_bytes());
        assert_eq!(&structured[4..6], &NBD_REPLY_FLAG_DONE.to_be_bytes());
        assert_eq!(&structured[6..8], &NBD_REPLY_TYPE_ERROR.to_be_bytes());
        assert_eq!(&structured[20..24], &NBD_EINVAL.to_be_bytes());
        assert_eq!(&structured[26..], message.as_bytes());
        assert_eq!(structured.len(), 20 + 6 + message.len());
    }

    #[test]
    fn rejection_messages_are_human_readable() {
        let r = validate_request(&req(NBD_CMD_WRITE, 0, SIZE, 512), &limits()).unwrap_err();
        assert_eq!(
            r.reason.to_string(),
            "range 1073741824+512 is beyond the export size 1073741824"
        );
        assert_eq!(
            r.to_string(),
            "range 1073741824+512 is beyond the export size 1073741824: NBD_ENOSPC (28)"
        );
        let r = validate_request(
            &req(NBD_CMD_WRITE, NBD_CMD_FLAG_NO_HOLE | NBD_CMD_FLAG_DF, 0, 1),
            &limits(),
        )
        .unwrap_err();
        assert_eq!(
            r.reason,
            RejectReason::FlagNotApplicable {
                flag: NBD_CMD_FLAG_NO_HOLE,
                command: Command::Write
            }
        );
    }
}

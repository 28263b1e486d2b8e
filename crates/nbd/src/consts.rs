//! Wire constants of the NBD protocol (NetworkBlockDevice/nbd `doc/proto.md`).
//!
//! Why a module of its own: every other module, the server sessions and the tests
//! name these numbers, and keeping them in one place (grouped the way the spec's
//! "Values" section groups them) makes it easy to audit them against the spec.
//! All multi-byte values are sent big-endian ("network byte order").

// ---------------------------------------------------------------- magics

/// `NBDMAGIC` / `INIT_PASSWD`: first 8 bytes the server sends.
pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
/// `IHAVEOPT`: second 8 bytes of the greeting, and the prefix of every client option.
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
/// Magic of every fixed-newstyle option reply (`0x3e889045565a9`).
pub const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
/// Alias of [`OPTION_REPLY_MAGIC`] under the name the brief uses.
pub const REPLY_MAGIC: u64 = OPTION_REPLY_MAGIC;
/// Magic of a transmission request (`NBD_REQUEST_MAGIC`).
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
/// Magic of a simple reply (`NBD_SIMPLE_REPLY_MAGIC`, formerly `NBD_REPLY_MAGIC`).
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
/// Magic of a structured reply chunk (`NBD_STRUCTURED_REPLY_MAGIC`).
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

// ---------------------------------------------------------------- handshake flags (16 bits, server)

/// `NBD_FLAG_FIXED_NEWSTYLE` (bit 0).
pub const NBD_FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
/// `NBD_FLAG_NO_ZEROES` (bit 1).
pub const NBD_FLAG_NO_ZEROES: u16 = 1 << 1;

// ---------------------------------------------------------------- client flags (32 bits)

/// `NBD_FLAG_C_FIXED_NEWSTYLE` (bit 0).
pub const NBD_FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
/// `NBD_FLAG_C_NO_ZEROES` (bit 1).
pub const NBD_FLAG_C_NO_ZEROES: u32 = 1 << 1;

// ---------------------------------------------------------------- transmission flags (16 bits)

/// `NBD_FLAG_HAS_FLAGS` (bit 0): MUST always be 1.
pub const NBD_FLAG_HAS_FLAGS: u16 = 1 << 0;
/// `NBD_FLAG_READ_ONLY` (bit 1).
pub const NBD_FLAG_READ_ONLY: u16 = 1 << 1;
/// `NBD_FLAG_SEND_FLUSH` (bit 2).
pub const NBD_FLAG_SEND_FLUSH: u16 = 1 << 2;
/// `NBD_FLAG_SEND_FUA` (bit 3).
pub const NBD_FLAG_SEND_FUA: u16 = 1 << 3;
/// `NBD_FLAG_ROTATIONAL` (bit 4).
pub const NBD_FLAG_ROTATIONAL: u16 = 1 << 4;
/// `NBD_FLAG_SEND_TRIM` (bit 5).
pub const NBD_FLAG_SEND_TRIM: u16 = 1 << 5;
/// `NBD_FLAG_SEND_WRITE_ZEROES` (bit 6).
pub const NBD_FLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
/// `NBD_FLAG_SEND_DF` (bit 7).
pub const NBD_FLAG_SEND_DF: u16 = 1 << 7;
/// `NBD_FLAG_CAN_MULTI_CONN` (bit 8).
pub const NBD_FLAG_CAN_MULTI_CONN: u16 = 1 << 8;
/// `NBD_FLAG_SEND_RESIZE` (bit 9, experimental; never advertised by Headroom).
pub const NBD_FLAG_SEND_RESIZE: u16 = 1 << 9;
/// `NBD_FLAG_SEND_CACHE` (bit 10).
pub const NBD_FLAG_SEND_CACHE: u16 = 1 << 10;
/// `NBD_FLAG_SEND_FAST_ZERO` (bit 11).
pub const NBD_FLAG_SEND_FAST_ZERO: u16 = 1 << 11;
/// `NBD_FLAG_BLOCK_STATUS_PAYLOAD` (bit 12, extended headers only; never advertised).
pub const NBD_FLAG_BLOCK_STATUS_PAYLOAD: u16 = 1 << 12;

// ---------------------------------------------------------------- option types

/// `NBD_OPT_EXPORT_NAME`.
pub const NBD_OPT_EXPORT_NAME: u32 = 1;
/// `NBD_OPT_ABORT`.
pub const NBD_OPT_ABORT: u32 = 2;
/// `NBD_OPT_LIST`.
pub const NBD_OPT_LIST: u32 = 3;
/// `NBD_OPT_PEEK_EXPORT` (withdrawn; treated as unknown).
pub const NBD_OPT_PEEK_EXPORT: u32 = 4;
/// `NBD_OPT_STARTTLS`.
pub const NBD_OPT_STARTTLS: u32 = 5;
/// `NBD_OPT_INFO`.
pub const NBD_OPT_INFO: u32 = 6;
/// `NBD_OPT_GO`.
pub const NBD_OPT_GO: u32 = 7;
/// `NBD_OPT_STRUCTURED_REPLY`.
pub const NBD_OPT_STRUCTURED_REPLY: u32 = 8;
/// `NBD_OPT_LIST_META_CONTEXT`.
pub const NBD_OPT_LIST_META_CONTEXT: u32 = 9;
/// `NBD_OPT_SET_META_CONTEXT`.
pub const NBD_OPT_SET_META_CONTEXT: u32 = 10;
/// `NBD_OPT_EXTENDED_HEADERS` (decoded, but Headroom answers `NBD_REP_ERR_UNSUP`).
pub const NBD_OPT_EXTENDED_HEADERS: u32 = 11;

// ---------------------------------------------------------------- option reply types

/// `NBD_REP_ACK`.
pub const NBD_REP_ACK: u32 = 1;
/// `NBD_REP_SERVER`.
pub const NBD_REP_SERVER: u32 = 2;
/// `NBD_REP_INFO`.
pub const NBD_REP_INFO: u32 = 3;
/// `NBD_REP_META_CONTEXT`.
pub const NBD_REP_META_CONTEXT: u32 = 4;
/// Bit 31 marks every error reply type.
pub const NBD_REP_FLAG_ERROR: u32 = 1 << 31;
/// `NBD_REP_ERR_UNSUP`: unknown option.
pub const NBD_REP_ERR_UNSUP: u32 = NBD_REP_FLAG_ERROR + 1;
/// `NBD_REP_ERR_POLICY`: known and valid, but forbidden by policy.
pub const NBD_REP_ERR_POLICY: u32 = NBD_REP_FLAG_ERROR + 2;
/// `NBD_REP_ERR_INVALID`: syntactically or semantically invalid.
pub const NBD_REP_ERR_INVALID: u32 = NBD_REP_FLAG_ERROR + 3;
/// `NBD_REP_ERR_PLATFORM`.
pub const NBD_REP_ERR_PLATFORM: u32 = NBD_REP_FLAG_ERROR + 4;
/// `NBD_REP_ERR_TLS_REQD`.
pub const NBD_REP_ERR_TLS_REQD: u32 = NBD_REP_FLAG_ERROR + 5;
/// `NBD_REP_ERR_UNKNOWN`: the export is not available.
pub const NBD_REP_ERR_UNKNOWN: u32 = NBD_REP_FLAG_ERROR + 6;
/// `NBD_REP_ERR_SHUTDOWN`.
pub const NBD_REP_ERR_SHUTDOWN: u32 = NBD_REP_FLAG_ERROR + 7;
/// `NBD_REP_ERR_BLOCK_SIZE_REQD`.
pub const NBD_REP_ERR_BLOCK_SIZE_REQD: u32 = NBD_REP_FLAG_ERROR + 8;
/// `NBD_REP_ERR_TOO_BIG`: the request or the reply is too large to process.
pub const NBD_REP_ERR_TOO_BIG: u32 = NBD_REP_FLAG_ERROR + 9;
/// `NBD_REP_ERR_EXT_HEADER_REQD`.
pub const NBD_REP_ERR_EXT_HEADER_REQD: u32 = NBD_REP_FLAG_ERROR + 10;

// ---------------------------------------------------------------- NBD_REP_INFO types

/// `NBD_INFO_EXPORT`: size and transmission flags (mandatory before a successful GO/INFO).
pub const NBD_INFO_EXPORT: u16 = 0;
/// `NBD_INFO_NAME`: canonical export name.
pub const NBD_INFO_NAME: u16 = 1;
/// `NBD_INFO_DESCRIPTION`: human-readable description.
pub const NBD_INFO_DESCRIPTION: u16 = 2;
/// `NBD_INFO_BLOCK_SIZE`: minimum, preferred and maximum block size.
pub const NBD_INFO_BLOCK_SIZE: u16 = 3;

// ---------------------------------------------------------------- commands

/// `NBD_CMD_READ`.
pub const NBD_CMD_READ: u16 = 0;
/// `NBD_CMD_WRITE`.
pub const NBD_CMD_WRITE: u16 = 1;
/// `NBD_CMD_DISC`.
pub const NBD_CMD_DISC: u16 = 2;
/// `NBD_CMD_FLUSH`.
pub const NBD_CMD_FLUSH: u16 = 3;
/// `NBD_CMD_TRIM`.
pub const NBD_CMD_TRIM: u16 = 4;
/// `NBD_CMD_CACHE`.
pub const NBD_CMD_CACHE: u16 = 5;
/// `NBD_CMD_WRITE_ZEROES`.
pub const NBD_CMD_WRITE_ZEROES: u16 = 6;
/// `NBD_CMD_BLOCK_STATUS`.
pub const NBD_CMD_BLOCK_STATUS: u16 = 7;
/// `NBD_CMD_RESIZE` (experimental; Headroom answers `NBD_EINVAL` as for any unknown command).
pub const NBD_CMD_RESIZE: u16 = 8;

// ---------------------------------------------------------------- command flags (16 bits)

/// `NBD_CMD_FLAG_FUA` (bit 0).
pub const NBD_CMD_FLAG_FUA: u16 = 1 << 0;
/// `NBD_CMD_FLAG_NO_HOLE` (bit 1), valid on `NBD_CMD_WRITE_ZEROES`.
pub const NBD_CMD_FLAG_NO_HOLE: u16 = 1 << 1;
/// `NBD_CMD_FLAG_DF` (bit 2), valid on `NBD_CMD_READ` when `NBD_FLAG_SEND_DF` was sent.
pub const NBD_CMD_FLAG_DF: u16 = 1 << 2;
/// `NBD_CMD_FLAG_REQ_ONE` (bit 3), valid on `NBD_CMD_BLOCK_STATUS`.
pub const NBD_CMD_FLAG_REQ_ONE: u16 = 1 << 3;
/// `NBD_CMD_FLAG_FAST_ZERO` (bit 4), valid on `NBD_CMD_WRITE_ZEROES`.
pub const NBD_CMD_FLAG_FAST_ZERO: u16 = 1 << 4;
/// `NBD_CMD_FLAG_PAYLOAD_LEN` (bit 5), extended headers only: unknown to Headroom.
pub const NBD_CMD_FLAG_PAYLOAD_LEN: u16 = 1 << 5;

// ---------------------------------------------------------------- structured replies

/// `NBD_REPLY_FLAG_DONE` (bit 0): final chunk of a structured reply.
pub const NBD_REPLY_FLAG_DONE: u16 = 1 << 0;
/// `NBD_REPLY_TYPE_NONE`.
pub const NBD_REPLY_TYPE_NONE: u16 = 0;
/// `NBD_REPLY_TYPE_OFFSET_DATA`.
pub const NBD_REPLY_TYPE_OFFSET_DATA: u16 = 1;
/// `NBD_REPLY_TYPE_OFFSET_HOLE`.
pub const NBD_REPLY_TYPE_OFFSET_HOLE: u16 = 2;
/// `NBD_REPLY_TYPE_BLOCK_STATUS`.
pub const NBD_REPLY_TYPE_BLOCK_STATUS: u16 = 5;
/// Bit 15 marks every error chunk type.
pub const NBD_REPLY_TYPE_FLAG_ERROR: u16 = 1 << 15;
/// `NBD_REPLY_TYPE_ERROR`.
pub const NBD_REPLY_TYPE_ERROR: u16 = NBD_REPLY_TYPE_FLAG_ERROR + 1;
/// `NBD_REPLY_TYPE_ERROR_OFFSET`.
pub const NBD_REPLY_TYPE_ERROR_OFFSET: u16 = NBD_REPLY_TYPE_FLAG_ERROR + 2;

// ---------------------------------------------------------------- base:allocation flags

/// `NBD_STATE_HOLE` (bit 0): the extent is not allocated.
pub const NBD_STATE_HOLE: u32 = 1 << 0;
/// `NBD_STATE_ZERO` (bit 1): the extent reads as zeroes.
pub const NBD_STATE_ZERO: u32 = 1 << 1;

// ---------------------------------------------------------------- error values

/// `NBD_EPERM`.
pub const NBD_EPERM: u32 = 1;
/// `NBD_EIO`.
pub const NBD_EIO: u32 = 5;
/// `NBD_ENOMEM`.
pub const NBD_ENOMEM: u32 = 12;
/// `NBD_EINVAL`.
pub const NBD_EINVAL: u32 = 22;
/// `NBD_ENOSPC`.
pub const NBD_ENOSPC: u32 = 28;
/// `NBD_EOVERFLOW`.
pub const NBD_EOVERFLOW: u32 = 75;
/// `NBD_ENOTSUP`.
pub const NBD_ENOTSUP: u32 = 95;
/// `NBD_ESHUTDOWN`.
pub const NBD_ESHUTDOWN: u32 = 108;

// ---------------------------------------------------------------- sizes

/// "[A string] MUST be no longer than 4096 bytes" (spec, Conventions).
pub const MAX_STRING_BYTES: usize = 4096;
/// Zero padding after the `NBD_OPT_EXPORT_NAME` reply unless `NO_ZEROES` was negotiated.
pub const EXPORT_NAME_REPLY_PADDING_BYTES: usize = 124;
/// Length of the server greeting: NBDMAGIC, IHAVEOPT, handshake flags.
pub const SERVER_GREETING_LEN: usize = 18;
/// Length of an option header: IHAVEOPT, option, length.
pub const OPTION_HEADER_LEN: usize = 16;
/// Length of an option reply header: magic, option, reply type, length.
pub const OPTION_REPLY_HEADER_LEN: usize = 20;
/// Length of a transmission request header (compact, non-extended headers).
pub const REQUEST_HEADER_LEN: usize = 28;
/// Length of a simple reply header.
pub const SIMPLE_REPLY_HEADER_LEN: usize = 16;
/// Length of a structured reply chunk header.
pub const STRUCTURED_REPLY_HEADER_LEN: usize = 20;

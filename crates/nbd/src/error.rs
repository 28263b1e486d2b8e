//! Error types of the protocol layer, one per phase, each knowing its NBD consequence.
//!
//! Why: the session code must decide, for every failure, between "send this
//! `NBD_REP_ERR_*` and keep haggling", "send this errno and keep serving" and "close
//! the connection". Putting that mapping on the error types (as methods) keeps the
//! decision next to the spec text that justifies it, instead of in the session loop.

use crate::consts;
use crate::wire::StringError;

/// A violation during the initial handshake or in the framing of an option.
///
/// Every variant means the connection cannot continue: the session closes it
/// without a reply ([`HandshakeError::closes_connection`] is always true).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum HandshakeError {
    /// "the server MUST drop the TCP connection if the client sets an unknown flag,
    /// or a flag that does not match something advertised by the server."
    #[error("unknown client flags {flags:#010x}")]
    UnknownClientFlags {
        /// The raw 32-bit client flags.
        flags: u32,
    },
    /// The 8 bytes where an option must start with `IHAVEOPT` held something else;
    /// the option stream cannot be resynchronised, so the connection is closed.
    #[error("bad option magic {magic:#018x} (expected IHAVEOPT)")]
    BadOptionMagic {
        /// The 64-bit value found instead of `IHAVEOPT`.
        magic: u64,
    },
    /// An option reply (client side) did not start with the option reply magic.
    #[error("bad option reply magic {magic:#018x}")]
    BadOptionReplyMagic {
        /// The 64-bit value found instead.
        magic: u64,
    },
}

impl HandshakeError {
    /// Whether the session must close the connection: always, for this type.
    #[must_use]
    pub const fn closes_connection(&self) -> bool {
        true
    }
}

/// Why an option's data was refused. The session answers with
/// [`OptionError::reply_type`] (for every variant today: `NBD_REP_ERR_INVALID`,
/// "determined by the server to be syntactically or semantically invalid") and keeps
/// haggling, except for `NBD_OPT_EXPORT_NAME`, which cannot be answered with an error
/// ([`OptionError::closes_connection`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OptionError {
    /// The data slice given to the decoder is not `header.length` bytes long
    /// (a bug in the caller rather than in the client, but still not a panic).
    #[error(
        "option {option}: got {actual_bytes} data bytes for a header announcing {declared_bytes}"
    )]
    LengthMismatch {
        /// Option number from the header.
        option: u32,
        /// `length` from the header.
        declared_bytes: u32,
        /// Bytes actually passed to the decoder.
        actual_bytes: usize,
    },
    /// The option takes no data but some was sent ("The client MUST NOT send any
    /// additional data with the option, and the server SHOULD reject a request that
    /// includes data with `NBD_REP_ERR_INVALID`").
    #[error("option {option}: takes no data but {length_bytes} bytes were sent")]
    UnexpectedData {
        /// Option number.
        option: u32,
        /// Data length sent.
        length_bytes: u32,
    },
    /// A length field points past the end of the option data ("such as a query length
    /// that would require reading beyond the original length given in the option
    /// header ... the server MUST fail the request with `NBD_REP_ERR_INVALID`").
    #[error("option {option}: truncated while reading {field}")]
    Truncated {
        /// Option number.
        option: u32,
        /// Which field could not be read.
        field: &'static str,
    },
    /// Bytes left over after the last field.
    #[error("option {option}: {extra_bytes} unexpected trailing bytes")]
    TrailingBytes {
        /// Option number.
        option: u32,
        /// How many bytes were left.
        extra_bytes: usize,
    },
    /// A string field is not a valid NBD string.
    #[error("option {option}: invalid {field}: {reason}")]
    InvalidString {
        /// Option number.
        option: u32,
        /// Which string field.
        field: &'static str,
        /// Which rule it broke.
        reason: StringError,
    },
}

impl OptionError {
    /// The option the error is about.
    #[must_use]
    pub const fn option(&self) -> u32 {
        match self {
            Self::LengthMismatch { option, .. }
            | Self::UnexpectedData { option, .. }
            | Self::Truncated { option, .. }
            | Self::TrailingBytes { option, .. }
            | Self::InvalidString { option, .. } => *option,
        }
    }

    /// The `NBD_REP_ERR_*` reply type to send.
    #[must_use]
    pub const fn reply_type(&self) -> u32 {
        consts::NBD_REP_ERR_INVALID
    }

    /// Whether the session must close instead of replying: true for
    /// `NBD_OPT_EXPORT_NAME`, because "If the chosen export does not exist or
    /// requirements for the chosen export are not met ... the server MUST terminate
    /// the session" and that option has no error reply.
    #[must_use]
    pub const fn closes_connection(&self) -> bool {
        self.option() == consts::NBD_OPT_EXPORT_NAME
    }
}

/// A violation in the transmission phase that makes the request stream unreadable.
///
/// Unlike a [`crate::RequestRejection`] (a well-framed request the server refuses with an
/// errno), these cannot be answered: the session closes the connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum TransmissionError {
    /// A request did not start with `NBD_REQUEST_MAGIC`. Nothing after it can be trusted
    /// (not even the cookie), so there is no reply: "Either side MAY initiate a hard
    /// disconnect if it detects a violation by the other party of a mandatory condition".
    #[error("bad request magic {magic:#010x}")]
    BadRequestMagic {
        /// The 32-bit value found instead.
        magic: u32,
    },
    /// (Client side) a reply started with neither reply magic.
    #[error("bad reply magic {magic:#010x}")]
    BadReplyMagic {
        /// The 32-bit value found instead.
        magic: u32,
    },
}

impl TransmissionError {
    /// Whether the connection must be closed: always, for this type.
    #[must_use]
    pub const fn closes_connection(&self) -> bool {
        true
    }

    /// The errno to reply with before closing: none, since the request's cookie is not
    /// trustworthy once the framing is lost.
    #[must_use]
    pub const fn errno(&self) -> Option<crate::Errno> {
        None
    }
}

//! A minimal NBD client: fixed-newstyle handshake, `NBD_OPT_GO`, simple replies only, no TLS.
//!
//! Every byte from the server is read into fixed-size buffers or bounded allocations and
//! decoded with `headroom-nbd`'s checked decoders; a misbehaving server yields a
//! [`LabError`], never a panic.

use headroom_nbd::consts::{
    IHAVEOPT, NBD_FLAG_C_FIXED_NEWSTYLE, NBD_FLAG_C_NO_ZEROES, NBD_FLAG_FIXED_NEWSTYLE,
    NBD_FLAG_NO_ZEROES, NBD_FLAG_READ_ONLY, NBD_INFO_EXPORT, NBD_OPT_GO, NBD_REP_ACK, NBD_REP_INFO,
    NBDMAGIC, OPTION_REPLY_HEADER_LEN, SERVER_GREETING_LEN,
};
use headroom_nbd::{
    ClientOption, HandshakeError, InfoRequest, MAX_OPTION_LENGTH, TransmissionError,
    decode_option_reply_header, encode_client_option,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Everything that can go wrong in the lab's client or in a load group.
#[derive(Debug, thiserror::Error)]
pub enum LabError {
    /// The load specification is unusable; nothing was sent.
    #[error("invalid load spec: {0}")]
    InvalidSpec(String),
    /// A socket operation failed (including the server closing the connection early).
    #[error("{context}: {source}")]
    Io {
        /// What the client was doing.
        context: &'static str,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The greeting did not start with `NBDMAGIC` + `IHAVEOPT`.
    #[error("not an NBD newstyle server (greeting magic {magic:#018x}, {ihaveopt:#018x})")]
    BadGreeting {
        /// The first 8 bytes.
        magic: u64,
        /// The next 8 bytes.
        ihaveopt: u64,
    },
    /// The server does not offer the fixed newstyle handshake (needed for `NBD_OPT_GO`).
    #[error("server handshake flags {flags:#06x} lack NBD_FLAG_FIXED_NEWSTYLE")]
    NotFixedNewstyle {
        /// The server's handshake flags.
        flags: u16,
    },
    /// An option reply header was malformed.
    #[error("handshake: {0}")]
    Handshake(#[from] HandshakeError),
    /// A reply header in transmission was malformed.
    #[error("transmission: {0}")]
    Transmission(#[from] TransmissionError),
    /// The server refused `NBD_OPT_GO` (unknown export, policy, TLS required, ...).
    #[error("server refused NBD_OPT_GO for {export:?}: reply type {reply_type:#010x} {message:?}")]
    GoRefused {
        /// The export asked for.
        export: String,
        /// The `NBD_REP_ERR_*` value.
        reply_type: u32,
        /// The server's message, if any (lossy UTF-8).
        message: String,
    },
    /// An option reply answered another option than the one sent.
    #[error("option reply for option {option}, expected NBD_OPT_GO")]
    UnexpectedOptionReply {
        /// The option number in the reply.
        option: u32,
    },
    /// An option reply announced more data than any valid reply carries.
    #[error("option reply of {length_bytes} bytes exceeds the {MAX_OPTION_LENGTH}-byte bound")]
    OptionReplyTooLong {
        /// The announced length.
        length_bytes: u32,
    },
    /// `NBD_INFO_EXPORT` did not have its fixed 12-byte layout.
    #[error("NBD_INFO_EXPORT of {length_bytes} bytes (expected 12)")]
    BadInfoExport {
        /// The reply's data length.
        length_bytes: u32,
    },
    /// The server acknowledged `NBD_OPT_GO` without sending `NBD_INFO_EXPORT`.
    #[error("NBD_OPT_GO acknowledged without NBD_INFO_EXPORT")]
    NoExportInfo,
    /// The load's region does not fit the export.
    #[error("region of {region_bytes} bytes exceeds the export's {export_bytes} bytes")]
    RegionTooLarge {
        /// The spec's region.
        region_bytes: u64,
        /// The export's size.
        export_bytes: u64,
    },
    /// The load writes but the export is read-only.
    #[error("the export is read-only but the load has writes (read_permille < 1000)")]
    ReadOnlyExport,
    /// A tenant of a group failed.
    #[error("group {group}, tenant {tenant}: {source}")]
    Tenant {
        /// Group name.
        group: String,
        /// Tenant index in the group.
        tenant: usize,
        /// What went wrong.
        source: Box<LabError>,
    },
    /// Requests were still in flight long after the run's end.
    #[error("{in_flight} requests still in flight {after:?} after the end of the run")]
    DrainTimeout {
        /// Requests not answered.
        in_flight: usize,
        /// The drain timeout.
        after: std::time::Duration,
    },
    /// A reply carried a cookie of no request in flight.
    #[error("reply for cookie {cookie:#018x}, which is not in flight")]
    UnknownCookie {
        /// The cookie in the reply.
        cookie: u64,
    },
}

impl LabError {
    pub(crate) const fn io(context: &'static str) -> impl FnOnce(std::io::Error) -> Self {
        move |source| Self::Io { context, source }
    }
}

/// What `NBD_OPT_GO` told about the export.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Export {
    /// Size in bytes.
    pub size_bytes: u64,
    /// Transmission flags (`NBD_FLAG_*`).
    pub transmission_flags: u16,
}

impl Export {
    /// Whether the server marked the export read-only.
    #[must_use]
    pub const fn read_only(&self) -> bool {
        self.transmission_flags & NBD_FLAG_READ_ONLY != 0
    }
}

/// A connection in the transmission phase, simple replies only.
#[derive(Debug)]
pub struct NbdClient {
    stream: TcpStream,
    export: Export,
}

impl NbdClient {
    /// Connects to `addr` (`host:port`), performs the fixed-newstyle handshake and enters
    /// transmission on `export_name` with `NBD_OPT_GO`.
    pub async fn connect(addr: &str, export_name: &str) -> Result<Self, LabError> {
        let mut stream = TcpStream::connect(addr)
            .await
            .map_err(LabError::io("connect"))?;
        stream
            .set_nodelay(true)
            .map_err(LabError::io("TCP_NODELAY"))?;
        let export = handshake(&mut stream, export_name).await?;
        Ok(Self { stream, export })
    }

    /// The export's size and flags.
    #[must_use]
    pub const fn export(&self) -> Export {
        self.export
    }

    /// The socket, positioned at the start of the transmission phase.
    #[must_use]
    pub fn into_stream(self) -> TcpStream {
        self.stream
    }
}

async fn handshake(stream: &mut TcpStream, export_name: &str) -> Result<Export, LabError> {
    let mut greeting = [0u8; SERVER_GREETING_LEN];
    stream
        .read_exact(&mut greeting)
        .await
        .map_err(LabError::io("reading the greeting"))?;
    let [
        m0,
        m1,
        m2,
        m3,
        m4,
        m5,
        m6,
        m7,
        i0,
        i1,
        i2,
        i3,
        i4,
        i5,
        i6,
        i7,
        f0,
        f1,
    ] = greeting;
    let magic = u64::from_be_bytes([m0, m1, m2, m3, m4, m5, m6, m7]);
    let ihaveopt = u64::from_be_bytes([i0, i1, i2, i3, i4, i5, i6, i7]);
    if magic != NBDMAGIC || ihaveopt != IHAVEOPT {
        return Err(LabError::BadGreeting { magic, ihaveopt });
    }
    let flags = u16::from_be_bytes([f0, f1]);
    if flags & NBD_FLAG_FIXED_NEWSTYLE == 0 {
        return Err(LabError::NotFixedNewstyle { flags });
    }
    let mut client_flags = NBD_FLAG_C_FIXED_NEWSTYLE;
    if flags & NBD_FLAG_NO_ZEROES != 0 {
        client_flags |= NBD_FLAG_C_NO_ZEROES;
    }
    let mut out = client_flags.to_be_bytes().to_vec();
    encode_client_option(
        &mut out,
        &ClientOption::Go(InfoRequest {
            export_name: export_name.to_string(),
            info_types: Vec::new(),
        }),
    );
    stream
        .write_all(&out)
        .await
        .map_err(LabError::io("sending NBD_OPT_GO"))?;

    let mut export = None;
    loop {
        let mut header = [0u8; OPTION_REPLY_HEADER_LEN];
        stream
            .read_exact(&mut header)
            .await
            .map_err(LabError::io("reading an option reply"))?;
        let reply = decode_option_reply_header(&header)?;
        if reply.option != NBD_OPT_GO {
            return Err(LabError::UnexpectedOptionReply {
                option: reply.option,
            });
        }
        if reply.length > MAX_OPTION_LENGTH {
            return Err(LabError::OptionReplyTooLong {
                length_bytes: reply.length,
            });
        }
        let mut data = vec![0u8; reply.length as usize];
        stream
            .read_exact(&mut data)
            .await
            .map_err(LabError::io("reading option reply data"))?;
        if reply.is_error() {
            return Err(LabError::GoRefused {
                export: export_name.to_string(),
                reply_type: reply.reply_type,
                message: String::from_utf8_lossy(&data).into_owned(),
            });
        }
        match reply.reply_type {
            NBD_REP_ACK => return export.ok_or(LabError::NoExportInfo),
            NBD_REP_INFO => {
                if let Some(info) = parse_info_export(&data, reply.length)? {
                    export = Some(info);
                }
            }
            // Other replies (none are defined for GO today) carry nothing we need.
            _ => {}
        }
    }
}

/// `NBD_INFO_EXPORT` from an `NBD_REP_INFO` payload; `None` for other info types.
fn parse_info_export(data: &[u8], length_bytes: u32) -> Result<Option<Export>, LabError> {
    match data {
        [t0, t1, ..] if u16::from_be_bytes([*t0, *t1]) != NBD_INFO_EXPORT => Ok(None),
        [_, _, s0, s1, s2, s3, s4, s5, s6, s7, f0, f1] => Ok(Some(Export {
            size_bytes: u64::from_be_bytes([*s0, *s1, *s2, *s3, *s4, *s5, *s6, *s7]),
            transmission_flags: u16::from_be_bytes([*f0, *f1]),
        })),
        _ => Err(LabError::BadInfoExport { length_bytes }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn info_export_is_parsed_with_bounds() {
        let mut data = NBD_INFO_EXPORT.to_be_bytes().to_vec();
        data.extend_from_slice(&(64u64 << 20).to_be_bytes());
        data.extend_from_slice(&3u16.to_be_bytes());
        let export = parse_info_export(&data, 12).ok().flatten();
        assert_eq!(
            export,
            Some(Export {
                size_bytes: 64 << 20,
                transmission_flags: 3
            })
        );
        assert!(matches!(
            parse_info_export(&data[..11], 11),
            Err(LabError::BadInfoExport { length_bytes: 11 })
        ));
        assert!(matches!(
            parse_info_export(&[], 0),
            Err(LabError::BadInfoExport { .. })
        ));
        // Another info type (NBD_INFO_NAME) is skipped, whatever its length.
        assert!(matches!(parse_info_export(&[0, 1, b'x'], 3), Ok(None)));
    }
}

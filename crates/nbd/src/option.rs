//! Decoding (and, for clients and tests, encoding) of option data.
//!
//! Why: option data carries nested length-prefixed strings chosen by the client; this
//! is the most intricate untrusted input of the handshake. Each rule below cites the
//! spec sentence that makes a malformed option `NBD_REP_ERR_INVALID`.

use crate::consts::{
    NBD_OPT_ABORT, NBD_OPT_EXPORT_NAME, NBD_OPT_EXTENDED_HEADERS, NBD_OPT_GO, NBD_OPT_INFO,
    NBD_OPT_LIST, NBD_OPT_LIST_META_CONTEXT, NBD_OPT_SET_META_CONTEXT, NBD_OPT_STARTTLS,
    NBD_OPT_STRUCTURED_REPLY,
};
use crate::error::OptionError;
use crate::handshake::{OptionHeader, encode_option_header};
use crate::wire::{Reader, len_u16, len_u32, parse_string};

/// A decoded client option.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClientOption {
    /// `NBD_OPT_EXPORT_NAME`: enter transmission on this export (no error reply possible).
    ExportName(String),
    /// `NBD_OPT_GO`: like INFO, then enter transmission on `NBD_REP_ACK`.
    Go(InfoRequest),
    /// `NBD_OPT_INFO`: describe an export.
    Info(InfoRequest),
    /// `NBD_OPT_LIST`: one `NBD_REP_SERVER` per export, then `NBD_REP_ACK`.
    List,
    /// `NBD_OPT_ABORT`: reply `NBD_REP_ACK` and close.
    Abort,
    /// `NBD_OPT_STARTTLS`: the session acknowledges it and starts TLS when TLS is configured.
    StartTls,
    /// `NBD_OPT_STRUCTURED_REPLY`: reply `NBD_REP_ACK`.
    StructuredReply,
    /// `NBD_OPT_LIST_META_CONTEXT`.
    ListMetaContext(MetaContextRequest),
    /// `NBD_OPT_SET_META_CONTEXT`.
    SetMetaContext(MetaContextRequest),
    /// `NBD_OPT_EXTENDED_HEADERS`: not implemented; reply `NBD_REP_ERR_UNSUP`.
    ExtendedHeaders,
    /// Any other option number: reply `NBD_REP_ERR_UNSUP` ("Servers that receive
    /// messages which they do not implement MUST reply to them with `NBD_REP_ERR_UNSUP`").
    Unknown(u32),
}

impl ClientOption {
    /// The option number on the wire.
    #[must_use]
    pub const fn option_number(&self) -> u32 {
        match self {
            Self::ExportName(_) => NBD_OPT_EXPORT_NAME,
            Self::Go(_) => NBD_OPT_GO,
            Self::Info(_) => NBD_OPT_INFO,
            Self::List => NBD_OPT_LIST,
            Self::Abort => NBD_OPT_ABORT,
            Self::StartTls => NBD_OPT_STARTTLS,
            Self::StructuredReply => NBD_OPT_STRUCTURED_REPLY,
            Self::ListMetaContext(_) => NBD_OPT_LIST_META_CONTEXT,
            Self::SetMetaContext(_) => NBD_OPT_SET_META_CONTEXT,
            Self::ExtendedHeaders => NBD_OPT_EXTENDED_HEADERS,
            Self::Unknown(n) => *n,
        }
    }
}

/// Data of `NBD_OPT_INFO` / `NBD_OPT_GO`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct InfoRequest {
    /// Export name; empty means the default export.
    pub export_name: String,
    /// Requested `NBD_INFO_*` types, as sent. "The server MUST ignore any information
    /// requests it does not understand."
    pub info_types: Vec<u16>,
}

/// Data of `NBD_OPT_LIST_META_CONTEXT` / `NBD_OPT_SET_META_CONTEXT`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct MetaContextRequest {
    /// Export name the contexts are for.
    pub export_name: String,
    /// Query strings, as sent (see [`crate::select_meta_contexts`]).
    pub queries: Vec<String>,
}

/// Decodes an option's data. `data` must be exactly `header.length` bytes.
///
/// Rules (all errors map to `NBD_REP_ERR_INVALID`, see [`OptionError`]):
/// - `NBD_OPT_LIST`, `NBD_OPT_STARTTLS`, `NBD_OPT_STRUCTURED_REPLY`,
///   `NBD_OPT_EXTENDED_HEADERS` take no data: "The client MUST NOT send any additional
///   data with the option, and the server SHOULD reject a request that includes data
///   with `NBD_REP_ERR_INVALID`."
/// - `NBD_OPT_ABORT` ignores data: "a server SHOULD ignore any data sent by the client
///   rather than rejecting the request as invalid."
/// - INFO/GO: `u32` name length ("MUST be no larger than the option data length - 6"),
///   name, `u16` count, `count` × `u16`; nothing may follow.
/// - LIST/SET_META_CONTEXT: `u32` name length, name, `u32` query count, then per query
///   `u32` length and string; "If the option request is syntactically invalid (such as
///   a query length that would require reading beyond the original length given in
///   the option header), the server MUST fail the request with `NBD_REP_ERR_INVALID`."
/// - Every string must be UTF-8 without NUL and at most 4096 bytes.
/// - Unknown option numbers decode to [`ClientOption::Unknown`] whatever their data.
pub fn decode_option(header: &OptionHeader, data: &[u8]) -> Result<ClientOption, OptionError> {
    let option = header.option;
    if usize::try_from(header.length).ok() != Some(data.len()) {
        return Err(OptionError::LengthMismatch {
            option,
            declared_bytes: header.length,
            actual_bytes: data.len(),
        });
    }
    let no_data = |value: ClientOption| {
        if data.is_empty() {
            Ok(value)
        } else {
            Err(OptionError::UnexpectedData {
                option,
                length_bytes: header.length,
            })
        }
    };
    match option {
        NBD_OPT_EXPORT_NAME => Ok(ClientOption::ExportName(
            string_field(option, "export name", data)?.to_owned(),
        )),
        NBD_OPT_ABORT => Ok(ClientOption::Abort),
        NBD_OPT_LIST => no_data(ClientOption::List),
        NBD_OPT_STARTTLS => no_data(ClientOption::StartTls),
        NBD_OPT_STRUCTURED_REPLY => no_data(ClientOption::StructuredReply),
        NBD_OPT_EXTENDED_HEADERS => no_data(ClientOption::ExtendedHeaders),
        NBD_OPT_INFO => decode_info_request(option, data).map(ClientOption::Info),
        NBD_OPT_GO => decode_info_request(option, data).map(ClientOption::Go),
        NBD_OPT_LIST_META_CONTEXT => {
            decode_meta_context_request(option, data).map(ClientOption::ListMetaContext)
        }
        NBD_OPT_SET_META_CONTEXT => {
            decode_meta_context_request(option, data).map(ClientOption::SetMetaContext)
        }
        other => Ok(ClientOption::Unknown(other)),
    }
}

fn string_field<'a>(
    option: u32,
    field: &'static str,
    bytes: &'a [u8],
) -> Result<&'a str, OptionError> {
    parse_string(bytes).map_err(|reason| OptionError::InvalidString {
        option,
        field,
        reason,
    })
}

/// Reads a `u32` length followed by that many bytes of string.
fn length_prefixed_string(
    option: u32,
    field: &'static str,
    reader: &mut Reader<'_>,
) -> Result<String, OptionError> {
    let truncated = OptionError::Truncated { option, field };
    let len = reader.u32().ok_or_else(|| truncated.clone())?;
    let len = usize::try_from(len).map_err(|_| truncated.clone())?;
    let bytes = reader.take(len).ok_or(truncated)?;
    Ok(string_field(option, field, bytes)?.to_owned())
}

fn expect_end(option: u32, reader: &Reader<'_>) -> Result<(), OptionError> {
    match reader.remaining() {
        0 => Ok(()),
        extra_bytes => Err(OptionError::TrailingBytes {
            option,
            extra_bytes,
        }),
    }
}

fn decode_info_request(option: u32, data: &[u8]) -> Result<InfoRequest, OptionError> {
    let mut reader = Reader::new(data);
    let export_name = length_prefixed_string(option, "export name", &mut reader)?;
    let count = reader.u16().ok_or(OptionError::Truncated {
        option,
        field: "information request count",
    })?;
    let mut info_types = Vec::with_capacity(usize::from(count).min(reader.remaining() / 2));
    for _ in 0..count {
        let info = reader.u16().ok_or(OptionError::Truncated {
            option,
            field: "information request",
        })?;
        info_types.push(info);
    }
    expect_end(option, &reader)?;
    Ok(InfoRequest {
        export_name,
        info_types,
    })
}

fn decode_meta_context_request(
    option: u32,
    data: &[u8],
) -> Result<MetaContextRequest, OptionError> {
    let mut reader = Reader::new(data);
    let export_name = length_prefixed_string(option, "export name", &mut reader)?;
    let count = reader.u32().ok_or(OptionError::Truncated {
        option,
        field: "query count",
    })?;
    // Each query takes at least 4 bytes, so `remaining / 4` bounds the allocation no
    // matter what count the client claims; the loop fails on the first missing query.
    let capacity = match usize::try_from(count) {
        Ok(count) => count.min(reader.remaining() / 4),
        Err(_) => reader.remaining() / 4,
    };
    let mut queries = Vec::with_capacity(capacity);
    for _ in 0..count {
        queries.push(length_prefixed_string(option, "query", &mut reader)?);
    }
    expect_end(option, &reader)?;
    Ok(MetaContextRequest {
        export_name,
        queries,
    })
}

// ---------------------------------------------------------------- client side (tests, tools)

/// Appends a whole option (header and data) as a client sends it. The inverse of
/// [`crate::decode_option_header`] + [`decode_option`]; used by tests and tools.
pub fn encode_client_option(out: &mut Vec<u8>, option: &ClientOption) {
    let mut data = Vec::new();
    match option {
        ClientOption::ExportName(name) => data.extend_from_slice(name.as_bytes()),
        ClientOption::Go(req) | ClientOption::Info(req) => {
            put_string(&mut data, &req.export_name);
            let count = len_u16(req.info_types.len());
            data.extend_from_slice(&count.to_be_bytes());
            for info in req.info_types.iter().take(usize::from(count)) {
                data.extend_from_slice(&info.to_be_bytes());
            }
        }
        ClientOption::ListMetaContext(req) | ClientOption::SetMetaContext(req) => {
            put_string(&mut data, &req.export_name);
            data.extend_from_slice(&len_u32(req.queries.len()).to_be_bytes());
            for query in &req.queries {
                put_string(&mut data, query);
            }
        }
        ClientOption::List
        | ClientOption::Abort
        | ClientOption::StartTls
        | ClientOption::StructuredReply
        | ClientOption::ExtendedHeaders
        | ClientOption::Unknown(_) => {}
    }
    encode_option_header(out, option.option_number(), len_u32(data.len()));
    out.extend_from_slice(&data);
}

fn put_string(out: &mut Vec<u8>, text: &str) {
    out.extend_from_slice(&len_u32(text.len()).to_be_bytes());
    out.extend_from_slice(text.as_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::consts::*;
    use crate::wire::StringError;

    fn header(option: u32, data: &[u8]) -> OptionHeader {
        OptionHeader {
            option,
            length: len_u32(data.len()),
        }
    }

    fn decode(option: u32, data: &[u8]) -> Result<ClientOption, OptionError> {
        decode_option(&header(option, data), data)
    }

    #[test]
    fn export_name_is_the_whole_data() {
        assert_eq!(
            decode(NBD_OPT_EXPORT_NAME, b"vol1"),
            Ok(ClientOption::ExportName("vol1".into()))
        );
        assert_eq!(
            decode(NBD_OPT_EXPORT_NAME, b""),
            Ok(ClientOption::ExportName(String::new())),
            "empty name = default export"
        );
        let err = decode(NBD_OPT_EXPORT_NAME, b"v\0l").unwrap_err();
        assert!(err.closes_connection(), "EXPORT_NAME has no error reply");
        assert_eq!(err.reply_type(), NBD_REP_ERR_INVALID);
    }

    #[test]
    fn go_layout_from_spec() {
        // 32 bits name length, name, 16 bits number of info requests, 16 bits each.
        let data = [0, 0, 0, 2, b'v', b'1', 0, 2, 0, 3, 0, 2];
        assert_eq!(
            decode(NBD_OPT_GO, &data),
            Ok(ClientOption::Go(InfoRequest {
                export_name: "v1".into(),
                info_types: vec![NBD_INFO_BLOCK_SIZE, NBD_INFO_DESCRIPTION],
            }))
        );
        let info = decode(NBD_OPT_INFO, &[0, 0, 0, 0, 0, 0]).unwrap();
        assert_eq!(info, ClientOption::Info(InfoRequest::default()));
    }

    #[test]
    fn go_malformed_lengths_are_invalid() {
        let cases: [(&[u8], &str); 6] = [
            (&[], "no name length"),
            (&[0, 0, 0, 5, b'v'], "name longer than data"),
            (&[0, 0, 0, 1, b'v'], "missing info count"),
            (&[0, 0, 0, 1, b'v', 0, 2, 0, 3], "info list short"),
            (&[0, 0, 0, 0, 0, 0, 0xff], "trailing byte"),
            (&[0xff, 0xff, 0xff, 0xff, 0, 0], "absurd name length"),
        ];
        for (data, why) in cases {
            let err = decode(NBD_OPT_GO, data).unwrap_err();
            assert_eq!(err.reply_type(), NBD_REP_ERR_INVALID, "{why}");
            assert!(!err.closes_connection(), "{why}");
            assert_eq!(err.option(), NBD_OPT_GO);
        }
        assert!(matches!(
            decode(NBD_OPT_GO, &[0, 0, 0, 0, 0, 0, 0xff]),
            Err(OptionError::TrailingBytes { extra_bytes: 1, .. })
        ));
    }

    #[test]
    fn bad_utf8_name_is_invalid() {
        let data = [0, 0, 0, 2, 0xc3, 0x28, 0, 0];
        assert_eq!(
            decode(NBD_OPT_INFO, &data),
            Err(OptionError::InvalidString {
                option: NBD_OPT_INFO,
                field: "export name",
                reason: StringError::NotUtf8
            })
        );
    }

    #[test]
    fn meta_context_layout_from_spec() {
        // 32 bits name length, name, 32 bits number of queries, per query: 32 bits
        // length, string.
        let mut data = vec![0, 0, 0, 2, b'v', b'1', 0, 0, 0, 2];
        data.extend_from_slice(&[0, 0, 0, 15]);
        data.extend_from_slice(b"base:allocation");
        data.extend_from_slice(&[0, 0, 0, 5]);
        data.extend_from_slice(b"base:");
        let expected = MetaContextRequest {
            export_name: "v1".into(),
            queries: vec!["base:allocation".into(), "base:".into()],
        };
        assert_eq!(
            decode(NBD_OPT_SET_META_CONTEXT, &data),
            Ok(ClientOption::SetMetaContext(expected.clone()))
        );
        assert_eq!(
            decode(NBD_OPT_LIST_META_CONTEXT, &data),
            Ok(ClientOption::ListMetaContext(expected))
        );
    }

    #[test]
    fn meta_context_lies_are_invalid() {
        // Claims 4 billion queries but carries none: must fail fast without allocating.
        let data = [0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff];
        assert!(matches!(
            decode(NBD_OPT_SET_META_CONTEXT, &data),
            Err(OptionError::Truncated { field: "query", .. })
        ));
        // Query length beyond the option data.
        let data = [0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 9, b'b'];
        assert!(matches!(
            decode(NBD_OPT_LIST_META_CONTEXT, &data),
            Err(OptionError::Truncated { field: "query", .. })
        ));
        // Missing query count.
        assert!(matches!(
            decode(NBD_OPT_LIST_META_CONTEXT, &[0, 0, 0, 0]),
            Err(OptionError::Truncated {
                field: "query count",
                ..
            })
        ));
    }

    #[test]
    fn no_data_options_reject_data_and_abort_ignores_it() {
        for (opt, ok) in [
            (NBD_OPT_LIST, ClientOption::List),
            (NBD_OPT_STARTTLS, ClientOption::StartTls),
            (NBD_OPT_STRUCTURED_REPLY, ClientOption::StructuredReply),
            (NBD_OPT_EXTENDED_HEADERS, ClientOption::ExtendedHeaders),
        ] {
            assert_eq!(decode(opt, &[]), Ok(ok));
            assert_eq!(
                decode(opt, &[1]),
                Err(OptionError::UnexpectedData {
                    option: opt,
                    length_bytes: 1
                })
            );
        }
        assert_eq!(decode(NBD_OPT_ABORT, &[1, 2, 3]), Ok(ClientOption::Abort));
    }

    #[test]
    fn unknown_options_decode_as_unknown() {
        assert_eq!(
            decode(NBD_OPT_PEEK_EXPORT, b"x"),
            Ok(ClientOption::Unknown(4))
        );
        assert_eq!(
            decode(0xdead_beef, &[0; 10]),
            Ok(ClientOption::Unknown(0xdead_beef))
        );
    }

    #[test]
    fn length_mismatch_is_reported_not_panicked() {
        let h = OptionHeader {
            option: NBD_OPT_GO,
            length: 10,
        };
        assert!(matches!(
            decode_option(&h, &[0; 3]),
            Err(OptionError::LengthMismatch {
                declared_bytes: 10,
                actual_bytes: 3,
                ..
            })
        ));
    }

    #[test]
    fn client_encoding_matches_hand_layout() {
        let mut out = Vec::new();
        encode_client_option(
            &mut out,
            &ClientOption::Go(InfoRequest {
                export_name: "v1".into(),
                info_types: vec![NBD_INFO_BLOCK_SIZE],
            }),
        );
        let mut expected = b"IHAVEOPT".to_vec();
        expected.extend_from_slice(&[0, 0, 0, 7, 0, 0, 0, 10]);
        expected.extend_from_slice(&[0, 0, 0, 2, b'v', b'1', 0, 1, 0, 3]);
        assert_eq!(out, expected);
    }
}

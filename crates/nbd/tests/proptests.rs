//! Property tests: decoders never panic on arbitrary bytes, encode→decode round trips,
//! and validation invariants over arbitrary headers and limits.

use headroom_nbd::consts::*;
use headroom_nbd::*;
use proptest::prelude::*;

fn any_limits() -> impl Strategy<Value = ExportLimits> {
    (
        prop_oneof![Just(0u64), Just(1u64 << 30), 0u64..1 << 40, Just(u64::MAX)],
        any::<bool>(),
        prop_oneof![Just(MAX_PAYLOAD_BYTES), any::<u32>()],
        any::<bool>(),
        proptest::option::of(any::<u32>()),
    )
        .prop_map(
            |(size_bytes, read_only, max_payload_bytes, structured_replies, ctx)| ExportLimits {
                size_bytes,
                read_only,
                max_payload_bytes,
                structured_replies,
                allocation_context_id: ctx,
            },
        )
}

fn any_header() -> impl Strategy<Value = RequestHeader> {
    (
        prop_oneof![0u16..0x20, any::<u16>()],
        prop_oneof![0u16..10, any::<u16>()],
        any::<u64>(),
        prop_oneof![
            Just(0u64),
            0u64..1 << 31,
            (1u64 << 30) - 4096..(1u64 << 30) + 4096,
            Just(u64::MAX),
            any::<u64>()
        ],
        prop_oneof![
            Just(0u32),
            0u32..1 << 16,
            Just(MAX_PAYLOAD_BYTES),
            Just(MAX_PAYLOAD_BYTES + 1),
            Just(u32::MAX),
            any::<u32>()
        ],
    )
        .prop_map(|(flags, command, cookie, offset, length)| RequestHeader {
            flags,
            command,
            cookie,
            offset,
            length,
        })
}

/// NBD-valid strings: no NUL, short.
fn nbd_string() -> impl Strategy<Value = String> {
    "[^\u{0}]{0,24}"
}

fn info_request() -> impl Strategy<Value = InfoRequest> {
    (nbd_string(), proptest::collection::vec(any::<u16>(), 0..8)).prop_map(
        |(export_name, info_types)| InfoRequest {
            export_name,
            info_types,
        },
    )
}

fn meta_request() -> impl Strategy<Value = MetaContextRequest> {
    (nbd_string(), proptest::collection::vec(nbd_string(), 0..6)).prop_map(
        |(export_name, queries)| MetaContextRequest {
            export_name,
            queries,
        },
    )
}

fn any_client_option() -> impl Strategy<Value = ClientOption> {
    prop_oneof![
        nbd_string().prop_map(ClientOption::ExportName),
        info_request().prop_map(ClientOption::Go),
        info_request().prop_map(ClientOption::Info),
        Just(ClientOption::List),
        Just(ClientOption::Abort),
        Just(ClientOption::StartTls),
        Just(ClientOption::StructuredReply),
        meta_request().prop_map(ClientOption::ListMetaContext),
        meta_request().prop_map(ClientOption::SetMetaContext),
        Just(ClientOption::ExtendedHeaders),
        (12u32..).prop_map(ClientOption::Unknown),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2048, ..ProptestConfig::default() })]

    #[test]
    fn request_header_decoder_total(buf in any::<[u8; 28]>()) {
        match decode_request_header(&buf) {
            Ok(h) => {
                let mut out = Vec::new();
                encode_request_header(&mut out, &h);
                prop_assert_eq!(&out[..], &buf[..]);
            }
            Err(e) => {
                prop_assert!(e.closes_connection());
                prop_assert_ne!(u32::from_be_bytes([buf[0], buf[1], buf[2], buf[3]]), REQUEST_MAGIC);
            }
        }
    }

    #[test]
    fn request_header_round_trip(h in any_header()) {
        let mut out = Vec::new();
        encode_request_header(&mut out, &h);
        let buf: [u8; 28] = out.try_into().unwrap();
        prop_assert_eq!(decode_request_header(&buf), Ok(h));
    }

    #[test]
    fn option_header_decoder_total(buf in any::<[u8; 16]>()) {
        if let Ok(h) = decode_option_header(&buf) {
            let mut out = Vec::new();
            encode_option_header(&mut out, h.option, h.length);
            prop_assert_eq!(&out[..], &buf[..]);
        }
    }

    #[test]
    fn option_decoder_total(option in prop_oneof![0u32..13, any::<u32>()],
                            data in proptest::collection::vec(any::<u8>(), 0..256)) {
        let header = OptionHeader { option, length: u32::try_from(data.len()).unwrap() };
        match decode_option(&header, &data) {
            Ok(decoded) => {
                prop_assert_eq!(decoded.option_number(), option);
                // Known options are decoded exactly, so re-encoding gives the same bytes
                // (ABORT ignores its data; unknown options keep none).
                if !matches!(decoded, ClientOption::Abort | ClientOption::Unknown(_)) {
                    let mut out = Vec::new();
                    encode_client_option(&mut out, &decoded);
                    prop_assert_eq!(&out[16..], &data[..]);
                }
            }
            Err(e) => {
                prop_assert_eq!(e.option(), option);
                prop_assert_eq!(e.reply_type(), NBD_REP_ERR_INVALID);
                prop_assert_eq!(e.closes_connection(), option == NBD_OPT_EXPORT_NAME);
            }
        }
    }

    #[test]
    fn option_decoder_with_wrong_length_never_panics(option in 0u32..13,
                                                     length in any::<u32>(),
                                                     data in proptest::collection::vec(any::<u8>(), 0..64)) {
        let header = OptionHeader { option, length };
        let result = decode_option(&header, &data);
        if usize::try_from(length).ok() != Some(data.len()) {
            let is_mismatch = matches!(result, Err(OptionError::LengthMismatch { .. }));
            prop_assert!(is_mismatch);
        }
    }

    #[test]
    fn client_option_round_trip(option in any_client_option()) {
        let mut out = Vec::new();
        encode_client_option(&mut out, &option);
        let header_bytes: [u8; 16] = out[..16].try_into().unwrap();
        let header = decode_option_header(&header_bytes).unwrap();
        prop_assert_eq!(header.option, option.option_number());
        prop_assert_eq!(option_data_action(&header), OptionDataAction::Read);
        let decoded = decode_option(&header, &out[16..]).unwrap();
        prop_assert_eq!(decoded, option);
    }

    #[test]
    fn client_flags_decoder(raw in any::<u32>()) {
        match decode_client_flags(raw) {
            Ok(flags) => {
                prop_assert_eq!(raw & !3, 0);
                prop_assert_eq!(flags.to_raw(), raw);
            }
            Err(e) => {
                prop_assert_ne!(raw & !3, 0);
                prop_assert!(e.closes_connection());
            }
        }
    }

    #[test]
    fn option_length_policy_is_bounded(option in any::<u32>(), length in any::<u32>()) {
        let action = option_data_action(&OptionHeader { option, length });
        match action {
            OptionDataAction::Read => prop_assert!(length <= MAX_OPTION_LENGTH),
            OptionDataAction::DiscardThenReply { reply_type } => {
                prop_assert!(length > MAX_OPTION_LENGTH && length <= MAX_OPTION_DISCARD_BYTES);
                prop_assert!(reply_type == NBD_REP_ERR_TOO_BIG || reply_type == NBD_REP_ERR_UNSUP);
                prop_assert_ne!(option, NBD_OPT_EXPORT_NAME);
            }
            OptionDataAction::Close => prop_assert!(length > MAX_OPTION_LENGTH),
        }
    }

    #[test]
    fn validation_invariants(h in any_header(), limits in any_limits()) {
        match validate_request(&h, &limits) {
            Ok(v) => {
                prop_assert_eq!(v.cookie, h.cookie);
                prop_assert_eq!(v.command.as_u16(), h.command);
                if v.command != Command::Disc {
                    prop_assert_eq!(h.flags & !v.command.applicable_flags(), 0);
                    let end = h.offset.checked_add(u64::from(h.length));
                    prop_assert!(end.is_some_and(|end| end <= limits.size_bytes));
                    if v.command.modifies_data() {
                        prop_assert!(!limits.read_only);
                    }
                    if v.df {
                        prop_assert!(limits.structured_replies);
                    }
                }
                if matches!(v.command, Command::Read | Command::Write) {
                    prop_assert!(h.length <= limits.max_payload_bytes);
                }
                if v.command == Command::BlockStatus {
                    prop_assert!(limits.structured_replies && limits.allocation_context_id.is_some());
                    prop_assert!(h.length > 0);
                }
                if v.command == Command::Flush {
                    prop_assert_eq!((h.offset, h.length), (0, 0));
                }
                prop_assert_eq!(v.payload_bytes(), h.payload_bytes());
            }
            Err(r) => {
                prop_assert_eq!(r.cookie, h.cookie);
                prop_assert!(matches!(r.errno, Errno::Einval | Errno::Eperm | Errno::Enospc));
                prop_assert_eq!(r.payload_bytes(), h.payload_bytes());
                prop_assert!(!r.message().is_empty());
                if h.command == NBD_CMD_WRITE {
                    prop_assert_eq!(r.fatal, h.length > MAX_DISCARD_BYTES);
                    prop_assert_eq!(r.payload_to_discard, if r.fatal { 0 } else { h.length });
                } else {
                    prop_assert!(!r.fatal);
                    prop_assert_eq!(r.payload_to_discard, 0);
                }
                prop_assert!(!r.reason.to_string().is_empty());
            }
        }
    }

    #[test]
    fn simple_reply_round_trip(cookie in any::<u64>(), error in any::<u32>()) {
        let mut out = Vec::new();
        encode_simple_reply_header(&mut out, cookie, error);
        let buf: [u8; 16] = out.try_into().unwrap();
        prop_assert_eq!(decode_simple_reply_header(&buf), Ok(SimpleReplyHeader { error, cookie }));
    }

    #[test]
    fn structured_header_round_trip(flags in any::<u16>(), ty in any::<u16>(), cookie in any::<u64>(), length in any::<u32>()) {
        let mut out = Vec::new();
        encode_structured_chunk_header(&mut out, flags, ty, cookie, length);
        let buf: [u8; 20] = out.try_into().unwrap();
        prop_assert_eq!(
            decode_structured_chunk_header(&buf),
            Ok(StructuredChunkHeader { flags, chunk_type: ty, cookie, length })
        );
    }

    #[test]
    fn reply_decoders_total(a in any::<[u8; 16]>(), b in any::<[u8; 20]>(), c in any::<[u8; 20]>()) {
        let _ = decode_simple_reply_header(&a);
        let _ = decode_structured_chunk_header(&b);
        let _ = decode_option_reply_header(&c);
    }

    #[test]
    fn chunk_lengths_match_payloads(cookie in any::<u64>(), done in any::<bool>(),
                                    message in "\\PC{0,5000}",
                                    extents in proptest::collection::vec((1u32.., any::<u32>()), 1..64)) {
        let mut out = Vec::new();
        encode_structured_error(&mut out, done, cookie, NBD_EIO, &message);
        let header = decode_structured_chunk_header(&out[..20].try_into().unwrap()).unwrap();
        prop_assert_eq!(header.length as usize, out.len() - 20);
        prop_assert!(header.length as usize <= 6 + MAX_STRING_BYTES);
        prop_assert!(std::str::from_utf8(&out[26..]).is_ok());

        let mut out = Vec::new();
        encode_structured_block_status(&mut out, done, cookie, 1, &extents);
        let header = decode_structured_chunk_header(&out[..20].try_into().unwrap()).unwrap();
        prop_assert_eq!(header.length as usize, out.len() - 20);
        prop_assert_eq!(header.length as usize, 4 + 8 * extents.len());
        prop_assert_eq!(header.is_done(), done);
    }

    #[test]
    fn meta_selection_has_no_duplicates(queries in proptest::collection::vec(
        prop_oneof![Just("base:allocation".to_owned()), Just("base:".to_owned()), "\\PC{0,20}"], 0..8),
        list in any::<bool>()) {
        let op = if list { MetaContextOp::List } else { MetaContextOp::Set };
        let selected = select_meta_contexts(op, &queries);
        prop_assert!(selected.len() <= MetaContext::ALL.len());
        let explicitly_named = queries.iter().any(|q| q == BASE_ALLOCATION);
        prop_assert_eq!(selected.contains(&MetaContext::BaseAllocation),
            explicitly_named || (list && (queries.is_empty() || queries.iter().any(|q| q == "base:"))));
    }
}

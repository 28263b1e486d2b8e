//! What the NBD fuzz targets check: `handshake`, `option` and `request`.
//!
//! Why a file of its own: the fuzz targets (through the `headroom_fuzz` library) and the corpus
//! replay test `crates/nbd/tests/fuzz_corpus.rs` (through `#[path]`) include this same file, so
//! CI checks every committed corpus input exactly as the fuzzer did. It uses nothing but
//! `headroom_nbd`'s public API.
//!
//! Each `check_*` function takes arbitrary bytes and panics (through `assert!`) when an
//! invariant breaks; a panic is what the fuzzer reports as a crash. Beyond "no panic", they
//! check round trips where an encoder exists, that validation never accepts a request past the
//! end of the export (or larger than the maximum block size, or a write to a read-only export,
//! or a flag that was not advertised), that rejections carry the spec's errno and discard
//! exactly the WRITE payload the client sends, and that every reply the encoders produce for
//! client-chosen input is well framed.

use headroom_nbd::consts::{
    NBD_CMD_BLOCK_STATUS, NBD_CMD_CACHE, NBD_CMD_DISC, NBD_CMD_FLAG_DF, NBD_CMD_FLAG_FUA,
    NBD_CMD_FLAG_NO_HOLE, NBD_CMD_FLAG_REQ_ONE, NBD_CMD_FLUSH, NBD_CMD_READ, NBD_CMD_TRIM,
    NBD_CMD_WRITE, NBD_CMD_WRITE_ZEROES, NBD_FLAG_C_FIXED_NEWSTYLE, NBD_FLAG_C_NO_ZEROES,
    NBD_FLAG_READ_ONLY, NBD_FLAG_SEND_CACHE, NBD_FLAG_SEND_DF, NBD_FLAG_SEND_FAST_ZERO,
    NBD_FLAG_SEND_FLUSH, NBD_FLAG_SEND_FUA, NBD_FLAG_SEND_TRIM, NBD_FLAG_SEND_WRITE_ZEROES,
    NBD_INFO_BLOCK_SIZE, NBD_INFO_DESCRIPTION, NBD_INFO_NAME, NBD_OPT_EXPORT_NAME, NBD_OPT_GO,
    NBD_OPT_SET_META_CONTEXT, NBD_REP_ACK, NBD_REP_ERR_INVALID, NBD_REP_ERR_UNKNOWN,
    NBD_REP_ERR_UNSUP, NBD_REP_SERVER, OPTION_HEADER_LEN, OPTION_REPLY_HEADER_LEN, REQUEST_MAGIC,
    SIMPLE_REPLY_HEADER_LEN, STRUCTURED_REPLY_HEADER_LEN,
};
use headroom_nbd::{
    BASE_ALLOCATION, BASE_ALLOCATION_CONTEXT_ID, ClientFlags, ClientOption, Command, Errno,
    ExportLimits, InfoRequest, KNOWN_COMMAND_FLAGS, MAX_DISCARD_BYTES, MAX_OPTION_DISCARD_BYTES,
    MAX_OPTION_LENGTH, MAX_PAYLOAD_BYTES, MIN_BLOCK_BYTES, MetaContext, MetaContextOp,
    MetaContextRequest, OptionDataAction, OptionHeader, PREFERRED_BLOCK_BYTES, REQUEST_HEADER_LEN,
    RejectReason, RequestHeader, RequestRejection, ValidRequest, allocation_context_matches,
    decode_client_flags, decode_option, decode_option_header, decode_option_reply_header,
    decode_request_header, decode_simple_reply_header, decode_structured_chunk_header,
    encode_client_option, encode_export_name_reply, encode_info_block_size,
    encode_info_description, encode_info_export, encode_info_name, encode_option_error,
    encode_option_header, encode_option_reply, encode_rejection, encode_rep_meta_context,
    encode_rep_server, encode_request_header, is_known_option, option_data_action,
    select_meta_contexts, transmission_flags, validate_request,
};

/// Longest string the spec allows ("MUST be no longer than 4096 bytes").
const MAX_STRING_BYTES: usize = 4096;

// ---------------------------------------------------------------- byte cursor

/// Takes the first `N` bytes of `rest`, or `None` (taking nothing) if fewer remain.
fn take<'a, const N: usize>(rest: &mut &'a [u8]) -> Option<&'a [u8; N]> {
    let (head, tail) = rest.split_first_chunk::<N>()?;
    *rest = tail;
    Some(head)
}

/// Takes the first `n` bytes of `rest`, or `None` (taking nothing) if fewer remain.
fn take_slice<'a>(rest: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
    if n > rest.len() {
        return None;
    }
    let (head, tail) = rest.split_at(n);
    *rest = tail;
    Some(head)
}

// ---------------------------------------------------------------- target `request`

/// Export limits from the bytes after the request header: size (u64, default 1 GiB), maximum
/// payload (u32, default [`MAX_PAYLOAD_BYTES`]), then one byte of bits: read-only, structured
/// replies, `base:allocation` selected.
fn limits_from(mut rest: &[u8]) -> ExportLimits {
    let size_bytes = take::<8>(&mut rest).map_or(1 << 30, |b| u64::from_be_bytes(*b));
    let max_payload_bytes =
        take::<4>(&mut rest).map_or(MAX_PAYLOAD_BYTES, |b| u32::from_be_bytes(*b));
    let bits = take::<1>(&mut rest).map_or(0, |b| b[0]);
    ExportLimits {
        size_bytes,
        read_only: bits & 1 != 0,
        max_payload_bytes,
        structured_replies: bits & 2 != 0,
        allocation_context_id: (bits & 4 != 0).then_some(BASE_ALLOCATION_CONTEXT_ID),
    }
}

/// Target `request`: a 28-byte request header, then the export's limits (see
/// [`limits_from`]). The header is decoded as sent and, so validation sees every input, once
/// more with the request magic put in.
pub fn check_request(data: &[u8]) {
    let mut rest = data;
    let Some(raw) = take::<REQUEST_HEADER_LEN>(&mut rest) else {
        return;
    };
    let limits = limits_from(rest);
    check_request_header(raw, &limits);
    let mut fixed = *raw;
    fixed[..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
    check_request_header(&fixed, &limits);
}

/// Decodes one request header, checks the round trip, and validates it against `limits`.
/// `None` when the magic is wrong (the session closes the connection).
fn check_request_header(
    raw: &[u8; REQUEST_HEADER_LEN],
    limits: &ExportLimits,
) -> Option<(RequestHeader, Result<ValidRequest, RequestRejection>)> {
    let header = match decode_request_header(raw) {
        Ok(header) => header,
        Err(err) => {
            assert!(err.closes_connection(), "a bad magic must close");
            assert_eq!(err.errno(), None, "no errno without a trustworthy cookie");
            assert_ne!(raw[..4], REQUEST_MAGIC.to_be_bytes(), "good magic refused");
            return None;
        }
    };
    let mut encoded = Vec::with_capacity(REQUEST_HEADER_LEN);
    encode_request_header(&mut encoded, &header);
    assert_eq!(
        encoded[..],
        raw[..],
        "request header decode/encode round trip"
    );
    let result = check_validation(&header, limits);
    Some((header, result))
}

/// Runs [`validate_request`] and checks what its result promises.
pub fn check_validation(
    h: &RequestHeader,
    limits: &ExportLimits,
) -> Result<ValidRequest, RequestRejection> {
    let result = validate_request(h, limits);
    let command = Command::from_u16(h.command);
    match &result {
        Ok(valid) => check_accepted(h, limits, valid),
        Err(rejection) => check_rejected(h, limits, command, rejection),
    }
    result
}

fn check_accepted(h: &RequestHeader, limits: &ExportLimits, valid: &ValidRequest) {
    assert_eq!(Some(valid.command), Command::from_u16(h.command));
    assert_eq!(valid.command.as_u16(), h.command);
    assert_eq!(
        (valid.cookie, valid.offset, valid.length),
        (h.cookie, h.offset, h.length),
        "a valid request keeps the header's cookie, offset and length"
    );
    assert_eq!(valid.fua, h.flags & NBD_CMD_FLAG_FUA != 0);
    assert_eq!(valid.no_hole, h.flags & NBD_CMD_FLAG_NO_HOLE != 0);
    assert_eq!(valid.df, h.flags & NBD_CMD_FLAG_DF != 0);
    assert_eq!(valid.req_one, h.flags & NBD_CMD_FLAG_REQ_ONE != 0);
    assert_eq!(valid.payload_bytes(), h.payload_bytes());
    if valid.command == Command::Disc {
        // DISC has no reply to carry an error: its fields pass unchecked.
        return;
    }
    assert_eq!(h.flags & !KNOWN_COMMAND_FLAGS, 0, "unknown flags accepted");
    assert_eq!(
        h.flags & !valid.command.applicable_flags(),
        0,
        "inapplicable flag accepted"
    );
    let end = h.offset.checked_add(u64::from(h.length));
    assert!(
        end.is_some_and(|end| end <= limits.size_bytes),
        "accepted {} {}+{} past the end of a {}-byte export",
        valid.command,
        h.offset,
        h.length,
        limits.size_bytes
    );
    if matches!(valid.command, Command::Read | Command::Write) {
        assert!(
            h.length <= limits.max_payload_bytes,
            "accepted a READ/WRITE larger than the maximum block size"
        );
    }
    if limits.read_only {
        assert!(
            !valid.command.modifies_data(),
            "accepted a change to a read-only export"
        );
    }
    match valid.command {
        Command::BlockStatus => {
            assert!(limits.structured_replies && limits.allocation_context_id.is_some());
            assert!(h.length > 0, "accepted a BLOCK_STATUS of length 0");
        }
        Command::Flush => assert_eq!((h.offset, h.length), (0, 0), "FLUSH with a range"),
        _ => {}
    }
    // Nothing is accepted that the advertised transmission flags did not offer.
    let advertised = transmission_flags(limits.read_only, limits.structured_replies);
    let needs = |flag: u16, what: &str| {
        assert!(
            advertised & flag != 0,
            "accepted {what} without advertising it"
        );
    };
    match valid.command {
        Command::Flush => needs(NBD_FLAG_SEND_FLUSH, "FLUSH"),
        Command::Trim => needs(NBD_FLAG_SEND_TRIM, "TRIM"),
        Command::WriteZeroes => needs(NBD_FLAG_SEND_WRITE_ZEROES, "WRITE_ZEROES"),
        Command::Cache => needs(NBD_FLAG_SEND_CACHE, "CACHE"),
        Command::Write => assert_eq!(advertised & NBD_FLAG_READ_ONLY, 0, "WRITE on READ_ONLY"),
        _ => {}
    }
    if valid.fua {
        needs(NBD_FLAG_SEND_FUA, "FUA");
    }
    if valid.df {
        needs(NBD_FLAG_SEND_DF, "DF");
    }
    if valid.fast_zero {
        needs(NBD_FLAG_SEND_FAST_ZERO, "FAST_ZERO");
    }
}

fn check_rejected(
    h: &RequestHeader,
    limits: &ExportLimits,
    command: Option<Command>,
    r: &RequestRejection,
) {
    assert_eq!(r.cookie, h.cookie, "the rejection must echo the cookie");
    assert_ne!(command, Some(Command::Disc), "DISC is never rejected");
    let payload = h.payload_bytes();
    assert_eq!(r.payload_bytes(), payload, "wire payload misstated");
    assert_eq!(r.is_fatal(), payload > MAX_DISCARD_BYTES);
    assert_eq!(r.payload_to_discard, if r.is_fatal() { 0 } else { payload });
    assert!(r.payload_to_discard <= MAX_DISCARD_BYTES);
    assert!(!r.message().is_empty());
    let modifies = command.is_some_and(Command::modifies_data);
    match r.reason {
        RejectReason::ReadOnly { command: c } => {
            assert_eq!(r.errno(), Errno::Eperm);
            assert!(limits.read_only && c.modifies_data() && Some(c) == command);
        }
        RejectReason::BeyondEnd {
            offset,
            length_bytes,
            size_bytes,
        } => {
            let expected = match command {
                Some(Command::Write | Command::WriteZeroes) => Errno::Enospc,
                _ => Errno::Einval,
            };
            assert_eq!(r.errno(), expected, "past-the-end errno");
            assert_eq!(
                (offset, length_bytes, size_bytes),
                (h.offset, h.length, limits.size_bytes)
            );
            assert!(offset.saturating_add(u64::from(length_bytes)) > size_bytes);
        }
        RejectReason::UnknownCommand { command: c } => {
            assert_eq!(r.errno(), Errno::Einval);
            assert!(command.is_none() && c == h.command);
        }
        RejectReason::RangeOverflow { .. } => {
            assert_eq!(r.errno(), Errno::Einval);
            assert!(h.offset.checked_add(u64::from(h.length)).is_none());
        }
        RejectReason::TooLarge { length_bytes, .. } => {
            assert_eq!(r.errno(), Errno::Einval);
            assert!(length_bytes > limits.max_payload_bytes);
        }
        _ => assert_eq!(r.errno(), Errno::Einval),
    }
    // Read-only is checked before the range: a change to a read-only export is EPERM.
    if limits.read_only && modifies && h.flags & !KNOWN_COMMAND_FLAGS == 0 {
        let applicable = command.map_or(0, Command::applicable_flags);
        if h.flags & !applicable == 0 && (h.flags & NBD_CMD_FLAG_DF == 0) {
            assert_eq!(
                r.errno(),
                Errno::Eperm,
                "change to a read-only export: {r:?}"
            );
        }
    }
    // Both reply forms are well framed and carry the cookie and the errno.
    let mut out = Vec::new();
    encode_rejection(&mut out, r, false);
    let mut rest = &out[..];
    let Some(raw) = take::<SIMPLE_REPLY_HEADER_LEN>(&mut rest) else {
        panic!("simple error reply shorter than its header");
    };
    let Ok(reply) = decode_simple_reply_header(raw) else {
        panic!("simple error reply does not decode");
    };
    assert_eq!((reply.cookie, reply.error), (h.cookie, r.errno().as_u32()));
    assert!(rest.is_empty());
    out.clear();
    encode_rejection(&mut out, r, true);
    let mut rest = &out[..];
    let Some(raw) = take::<STRUCTURED_REPLY_HEADER_LEN>(&mut rest) else {
        panic!("structured error reply shorter than its header");
    };
    let Ok(chunk) = decode_structured_chunk_header(raw) else {
        panic!("structured error chunk does not decode");
    };
    assert!(chunk.is_done());
    assert_eq!(chunk.cookie, h.cookie);
    assert_eq!(
        usize::try_from(chunk.length).ok(),
        Some(rest.len()),
        "chunk length"
    );
    let Some(errno) = take::<4>(&mut rest) else {
        panic!("structured error without an errno");
    };
    assert_eq!(u32::from_be_bytes(*errno), r.errno().as_u32());
}

// ---------------------------------------------------------------- target `option`

/// Target `option`: a 16-byte option header and option data. Decoded with the header as sent
/// (usually a bad magic or a length mismatch), then with a consistent header (the option
/// number taken modulo 16, so every decoder is reached), so the data decoders see every input.
pub fn check_option(data: &[u8]) {
    let mut rest = data;
    let Some(raw) = take::<OPTION_HEADER_LEN>(&mut rest) else {
        return;
    };
    if let Some(header) = check_option_header(raw) {
        check_option_data(&header, rest);
    }
    let option = u32::from_be_bytes([raw[8], raw[9], raw[10], raw[11]]) % 16;
    let Ok(length) = u32::try_from(rest.len()) else {
        return;
    };
    check_option_data(&OptionHeader { option, length }, rest);
}

/// Decodes an option header and checks it and the action taken on it.
fn check_option_header(raw: &[u8; OPTION_HEADER_LEN]) -> Option<OptionHeader> {
    let header = match decode_option_header(raw) {
        Ok(header) => header,
        Err(err) => {
            assert!(err.closes_connection(), "a bad option magic must close");
            return None;
        }
    };
    let mut encoded = Vec::with_capacity(OPTION_HEADER_LEN);
    encode_option_header(&mut encoded, header.option, header.length);
    assert_eq!(
        encoded[..],
        raw[..],
        "option header decode/encode round trip"
    );
    match option_data_action(&header) {
        OptionDataAction::Read => assert!(header.length <= MAX_OPTION_LENGTH),
        OptionDataAction::DiscardThenReply { reply_type } => {
            assert!(header.length > MAX_OPTION_LENGTH && header.length <= MAX_OPTION_DISCARD_BYTES);
            assert_ne!(
                header.option, NBD_OPT_EXPORT_NAME,
                "EXPORT_NAME has no error reply"
            );
            let expected = if is_known_option(header.option) {
                headroom_nbd::consts::NBD_REP_ERR_TOO_BIG
            } else {
                NBD_REP_ERR_UNSUP
            };
            assert_eq!(reply_type, expected);
        }
        OptionDataAction::Close => assert!(
            header.length > MAX_OPTION_DISCARD_BYTES
                || (header.length > MAX_OPTION_LENGTH && header.option == NBD_OPT_EXPORT_NAME)
        ),
    }
    Some(header)
}

/// Decodes option data and checks the result: the round trip for every option that keeps its
/// data, errors that say the right thing, and well-framed replies built from what the client
/// sent (names, queries, error messages).
fn check_option_data(header: &OptionHeader, data: &[u8]) -> Option<ClientOption> {
    let option = match decode_option(header, data) {
        Ok(option) => option,
        Err(err) => {
            assert_eq!(err.option(), header.option);
            assert_eq!(err.reply_type(), NBD_REP_ERR_INVALID);
            assert_eq!(
                err.closes_connection(),
                header.option == NBD_OPT_EXPORT_NAME
            );
            let mut out = Vec::new();
            encode_option_error(&mut out, header.option, err.reply_type(), &err.to_string());
            check_option_replies(&out, header.option);
            return None;
        }
    };
    assert_eq!(option.option_number(), header.option);
    if !matches!(option, ClientOption::Abort | ClientOption::Unknown(_)) {
        let mut encoded = Vec::new();
        encode_client_option(&mut encoded, &option);
        assert_eq!(
            encoded.get(OPTION_HEADER_LEN..),
            Some(data),
            "option decode/encode round trip"
        );
    }
    let mut out = Vec::new();
    match &option {
        ClientOption::ExportName(name) => {
            assert!(name.len() <= MAX_STRING_BYTES && !name.contains('\0'));
        }
        ClientOption::Go(request) | ClientOption::Info(request) => {
            check_string(&request.export_name);
            encode_info_name(&mut out, header.option, &request.export_name);
            encode_rep_server(
                &mut out,
                header.option,
                &request.export_name,
                &request.export_name,
            );
        }
        ClientOption::ListMetaContext(request) | ClientOption::SetMetaContext(request) => {
            check_string(&request.export_name);
            for query in &request.queries {
                check_string(query);
            }
            check_meta_selection(&request.queries, header.option == NBD_OPT_SET_META_CONTEXT);
            for query in &request.queries {
                encode_rep_meta_context(&mut out, header.option, 0, query);
            }
        }
        _ => {}
    }
    check_option_replies(&out, header.option);
    Some(option)
}

/// A decoded string obeys the spec's rules.
fn check_string(text: &str) {
    assert!(
        text.len() <= MAX_STRING_BYTES,
        "string of {} bytes decoded",
        text.len()
    );
    assert!(!text.contains('\0'), "string with NUL decoded");
}

/// The two meta context selectors agree, and SET/LIST follow the empty-query rules.
fn check_meta_selection(queries: &[String], is_set: bool) {
    let op = if is_set {
        MetaContextOp::Set
    } else {
        MetaContextOp::List
    };
    let selected = select_meta_contexts(op, queries);
    let matches = allocation_context_matches(queries, is_set);
    assert_eq!(matches, selected.contains(&MetaContext::BaseAllocation));
    assert!(selected.len() <= MetaContext::ALL.len());
    if queries.is_empty() {
        assert_eq!(
            selected.is_empty(),
            is_set,
            "empty queries: LIST all, SET none"
        );
    }
    if queries.iter().any(|q| q == BASE_ALLOCATION) {
        assert!(matches, "{BASE_ALLOCATION} not selected");
    }
}

/// `out` is a sequence of well-framed option replies to `option`: each header decodes, its
/// length covers exactly its data, strings are at most 4096 bytes of UTF-8, and an
/// `NBD_REP_SERVER` name length stays inside its reply.
fn check_option_replies(out: &[u8], option: u32) {
    let mut rest = out;
    while !rest.is_empty() {
        let Some(raw) = take::<OPTION_REPLY_HEADER_LEN>(&mut rest) else {
            panic!("option reply shorter than its header");
        };
        let Ok(reply) = decode_option_reply_header(raw) else {
            panic!("option reply with a bad magic");
        };
        assert_eq!(reply.option, option, "reply to the wrong option");
        let Ok(length) = usize::try_from(reply.length) else {
            panic!("reply length does not fit in usize");
        };
        let Some(body) = take_slice(&mut rest, length) else {
            panic!("reply length {length} runs past the reply");
        };
        if reply.is_error() {
            assert!(
                body.len() <= MAX_STRING_BYTES,
                "error message over 4096 bytes"
            );
            assert!(
                std::str::from_utf8(body).is_ok(),
                "error message is not UTF-8"
            );
        } else if reply.reply_type == NBD_REP_SERVER {
            let mut body = body;
            let Some(len) = take::<4>(&mut body) else {
                panic!("NBD_REP_SERVER without a name length");
            };
            let len = u32::from_be_bytes(*len) as usize;
            assert!(
                len <= body.len() && len <= MAX_STRING_BYTES,
                "NBD_REP_SERVER name length"
            );
            assert!(std::str::from_utf8(body).is_ok());
        }
    }
}

// ---------------------------------------------------------------- target `handshake`

/// An export of the model server the `handshake` target negotiates with.
struct Export {
    name: &'static str,
    size_bytes: u64,
    read_only: bool,
}

const EXPORTS: [Export; 3] = [
    Export {
        name: "disk",
        size_bytes: 1 << 30,
        read_only: false,
    },
    Export {
        name: "ro",
        size_bytes: 1 << 20,
        read_only: true,
    },
    Export {
        name: "odd",
        size_bytes: 12_345,
        read_only: false,
    },
];

fn export(name: &str) -> Option<&'static Export> {
    EXPORTS.iter().find(|e| e.name == name)
}

/// The negotiation state the model server keeps (the subset of the session's that affects
/// framing and validation).
#[derive(Default)]
struct Haggling {
    structured: bool,
    no_zeroes: bool,
    /// Export name and whether `base:allocation` was selected for it.
    meta_selection: Option<(String, bool)>,
}

enum Next {
    Continue,
    End,
    Transmit(&'static Export),
}

/// Target `handshake`: a whole client byte stream, from the client flags through option
/// haggling into transmission, driven through the real decoders and encoders the way the
/// session in `headroom-node` drives them (same order of calls, same decisions on each
/// result), against a model server with three exports (`disk`, 1 GiB; `ro`, 1 MiB
/// read-only; `odd`, 12,345 bytes). Every option and request is checked as in the `option`
/// and `request` targets, and every reply built on the way must be well framed.
pub fn check_handshake(data: &[u8]) {
    let mut rest = data;
    let Some(raw_flags) = take::<4>(&mut rest) else {
        return;
    };
    let raw_flags = u32::from_be_bytes(*raw_flags);
    let flags = match decode_client_flags(raw_flags) {
        Ok(flags) => flags,
        Err(err) => {
            assert!(err.closes_connection());
            assert_ne!(
                raw_flags & !(NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES),
                0
            );
            return;
        }
    };
    assert_eq!(flags.to_raw(), raw_flags, "client flags round trip");
    let mut state = Haggling {
        no_zeroes: flags.no_zeroes,
        ..Haggling::default()
    };
    let export = loop {
        let Some(raw) = take::<OPTION_HEADER_LEN>(&mut rest) else {
            return; // EOF while haggling: the session ends quietly.
        };
        let Some(header) = check_option_header(raw) else {
            return;
        };
        match option_data_action(&header) {
            OptionDataAction::Read => {}
            OptionDataAction::DiscardThenReply { .. } => {
                let Some(_) = take_slice(&mut rest, header.length as usize) else {
                    return;
                };
                continue;
            }
            OptionDataAction::Close => return,
        }
        let Some(data) = take_slice(&mut rest, header.length as usize) else {
            return;
        };
        let Some(option) = check_option_data(&header, data) else {
            if header.option == NBD_OPT_EXPORT_NAME {
                return; // a malformed EXPORT_NAME closes
            }
            continue;
        };
        let mut out = Vec::new();
        let next = answer(&mut state, &header, option, &mut out);
        match next {
            Next::Continue => check_option_replies(&out, header.option),
            Next::End => {
                check_option_replies(&out, header.option);
                return;
            }
            Next::Transmit(export) => {
                if header.option == NBD_OPT_EXPORT_NAME {
                    let expected = if state.no_zeroes { 10 } else { 134 };
                    assert_eq!(out.len(), expected, "EXPORT_NAME reply length");
                } else {
                    check_option_replies(&out, header.option);
                }
                break export;
            }
        }
    };
    transmit(&state, export, rest);
}

/// The model server's answer to one decoded option, as the session gives it.
fn answer(
    state: &mut Haggling,
    header: &OptionHeader,
    option: ClientOption,
    out: &mut Vec<u8>,
) -> Next {
    let number = header.option;
    let ack = |out: &mut Vec<u8>| encode_option_reply(out, number, NBD_REP_ACK, &[]);
    let unknown = |out: &mut Vec<u8>, name: &str| {
        encode_option_error(
            out,
            number,
            NBD_REP_ERR_UNKNOWN,
            &format!("no export named {name:?}"),
        );
        Next::Continue
    };
    match option {
        ClientOption::ExportName(name) => {
            let Some(export) = export(&name) else {
                return Next::End; // EXPORT_NAME cannot be refused but by closing
            };
            let flags = transmission_flags(export.read_only, state.structured);
            encode_export_name_reply(out, export.size_bytes, flags, state.no_zeroes);
            Next::Transmit(export)
        }
        ClientOption::Info(InfoRequest {
            export_name,
            info_types,
        })
        | ClientOption::Go(InfoRequest {
            export_name,
            info_types,
        }) => {
            let Some(export) = export(&export_name) else {
                return unknown(out, &export_name);
            };
            let flags = transmission_flags(export.read_only, state.structured);
            encode_info_export(out, number, export.size_bytes, flags);
            for info in info_types {
                match info {
                    NBD_INFO_NAME => encode_info_name(out, number, export.name),
                    NBD_INFO_DESCRIPTION => encode_info_description(out, number, "a model export"),
                    _ => {}
                }
            }
            // NBD_INFO_BLOCK_SIZE: always sent, asked for or not.
            encode_info_block_size(
                out,
                number,
                MIN_BLOCK_BYTES,
                PREFERRED_BLOCK_BYTES,
                MAX_PAYLOAD_BYTES,
            );
            ack(out);
            if number == NBD_OPT_GO {
                Next::Transmit(export)
            } else {
                Next::Continue
            }
        }
        ClientOption::List => {
            for export in &EXPORTS {
                encode_rep_server(out, number, export.name, "a model export");
            }
            ack(out);
            Next::Continue
        }
        ClientOption::Abort => {
            ack(out);
            Next::End
        }
        ClientOption::StructuredReply => {
            if state.structured {
                encode_option_error(out, number, NBD_REP_ERR_INVALID, "already negotiated");
            } else {
                state.structured = true;
                ack(out);
            }
            Next::Continue
        }
        ClientOption::ListMetaContext(MetaContextRequest {
            export_name,
            queries,
        })
        | ClientOption::SetMetaContext(MetaContextRequest {
            export_name,
            queries,
        }) => {
            let is_set = number == NBD_OPT_SET_META_CONTEXT;
            if !state.structured {
                encode_option_error(out, number, NBD_REP_ERR_INVALID, "structured replies first");
                return Next::Continue;
            }
            if export(&export_name).is_none() {
                return unknown(out, &export_name);
            }
            let matches = allocation_context_matches(&queries, is_set);
            if matches {
                let id = if is_set {
                    BASE_ALLOCATION_CONTEXT_ID
                } else {
                    0
                };
                encode_rep_meta_context(out, number, id, BASE_ALLOCATION);
            }
            ack(out);
            if is_set {
                state.meta_selection = Some((export_name, matches));
            }
            Next::Continue
        }
        // No TLS in the model: NBD_REP_ERR_UNSUP, as a server without TLS configured answers.
        ClientOption::StartTls | ClientOption::ExtendedHeaders | ClientOption::Unknown(_) => {
            encode_option_error(out, number, NBD_REP_ERR_UNSUP, "not supported");
            Next::Continue
        }
    }
}

/// The transmission phase: request headers, each validated; WRITE payloads (of valid and
/// rejected requests alike) are skipped as the session reads or discards them.
fn transmit(state: &Haggling, export: &Export, mut rest: &[u8]) {
    let allocation_context = state.structured
        && matches!(&state.meta_selection, Some((name, true)) if name == export.name);
    let limits = ExportLimits {
        size_bytes: export.size_bytes,
        read_only: export.read_only,
        max_payload_bytes: MAX_PAYLOAD_BYTES,
        structured_replies: state.structured,
        allocation_context_id: allocation_context.then_some(BASE_ALLOCATION_CONTEXT_ID),
    };
    while let Some(raw) = take::<REQUEST_HEADER_LEN>(&mut rest) {
        let Some((_, result)) = check_request_header(raw, &limits) else {
            return; // bad magic: the session closes
        };
        let payload = match result {
            Ok(valid) if valid.command == Command::Disc => return,
            Ok(valid) => valid.payload_bytes(),
            Err(rejection) if rejection.is_fatal() => return,
            Err(rejection) => rejection.payload_to_discard,
        };
        if take_slice(&mut rest, payload as usize).is_none() {
            return;
        }
    }
}

// ---------------------------------------------------------------- seeds

/// Appends a request header.
fn request(out: &mut Vec<u8>, command: u16, flags: u16, offset: u64, length: u32) {
    let header = RequestHeader {
        flags,
        command,
        cookie: u64::from(command) << 8 | u64::from(flags),
        offset,
        length,
    };
    encode_request_header(out, &header);
}

fn option(out: &mut Vec<u8>, option: &ClientOption) {
    encode_client_option(out, option);
}

fn info(name: &str, info_types: &[u16]) -> InfoRequest {
    InfoRequest {
        export_name: name.into(),
        info_types: info_types.to_vec(),
    }
}

fn meta(name: &str, queries: &[&str]) -> MetaContextRequest {
    MetaContextRequest {
        export_name: name.into(),
        queries: queries.iter().map(|q| (*q).to_owned()).collect(),
    }
}

/// Valid inputs for the `handshake` target, built with the encoders: whole sessions.
pub fn handshake_seeds() -> Vec<(&'static str, Vec<u8>)> {
    let flags = |f: ClientFlags| f.to_raw().to_be_bytes().to_vec();
    let both = ClientFlags {
        fixed_newstyle: true,
        no_zeroes: true,
    };
    // Structured replies, base:allocation, GO, then one request of each command.
    let mut go = flags(both);
    option(&mut go, &ClientOption::StructuredReply);
    option(&mut go, &ClientOption::ListMetaContext(meta("disk", &[])));
    option(
        &mut go,
        &ClientOption::SetMetaContext(meta("disk", &[BASE_ALLOCATION])),
    );
    option(&mut go, &ClientOption::Info(info("odd", &[NBD_INFO_NAME])));
    option(
        &mut go,
        &ClientOption::Go(info(
            "disk",
            &[NBD_INFO_NAME, NBD_INFO_DESCRIPTION, NBD_INFO_BLOCK_SIZE],
        )),
    );
    request(&mut go, NBD_CMD_READ, NBD_CMD_FLAG_DF, 0, 4096);
    request(&mut go, NBD_CMD_WRITE, NBD_CMD_FLAG_FUA, 4096, 8);
    go.extend_from_slice(b"payload!");
    request(
        &mut go,
        NBD_CMD_BLOCK_STATUS,
        NBD_CMD_FLAG_REQ_ONE,
        0,
        1 << 20,
    );
    request(&mut go, NBD_CMD_TRIM, 0, 0, 4096);
    request(
        &mut go,
        NBD_CMD_WRITE_ZEROES,
        NBD_CMD_FLAG_NO_HOLE,
        8192,
        4096,
    );
    request(&mut go, NBD_CMD_CACHE, 0, 0, 4096);
    request(&mut go, NBD_CMD_FLUSH, 0, 0, 0);
    request(&mut go, NBD_CMD_DISC, 0, 0, 0);

    // Old-style EXPORT_NAME on the read-only export: rejected writes, a read past the end.
    let mut export_name = flags(ClientFlags {
        fixed_newstyle: true,
        no_zeroes: false,
    });
    option(&mut export_name, &ClientOption::List);
    option(&mut export_name, &ClientOption::ExportName("ro".into()));
    request(&mut export_name, NBD_CMD_WRITE, 0, 0, 4);
    export_name.extend_from_slice(b"data");
    request(&mut export_name, NBD_CMD_READ, 0, (1 << 20) - 1, 2);
    request(&mut export_name, NBD_CMD_TRIM, 0, 0, 1);
    request(&mut export_name, NBD_CMD_DISC, 0, 0, 0);

    // Options refused one by one, then ABORT.
    let mut refused = flags(ClientFlags::default());
    option(
        &mut refused,
        &ClientOption::SetMetaContext(meta("disk", &["base:"])),
    );
    option(&mut refused, &ClientOption::StartTls);
    option(&mut refused, &ClientOption::ExtendedHeaders);
    option(&mut refused, &ClientOption::Go(info("missing", &[])));
    refused.extend_from_slice(&{
        let mut unknown = Vec::new();
        encode_option_header(&mut unknown, 99, 3);
        unknown.extend_from_slice(b"abc");
        unknown
    });
    option(&mut refused, &ClientOption::Abort);

    vec![
        ("go_and_every_command", go),
        ("export_name_read_only", export_name),
        ("refusals_then_abort", refused),
    ]
}

/// Valid inputs for the `option` target: each option the server decodes, encoded.
pub fn option_seeds() -> Vec<(&'static str, Vec<u8>)> {
    let one = |o: ClientOption| {
        let mut out = Vec::new();
        encode_client_option(&mut out, &o);
        out
    };
    vec![
        ("export_name", one(ClientOption::ExportName("disk".into()))),
        (
            "go",
            one(ClientOption::Go(info(
                "disk",
                &[NBD_INFO_NAME, NBD_INFO_BLOCK_SIZE],
            ))),
        ),
        ("info", one(ClientOption::Info(info("", &[])))),
        ("list", one(ClientOption::List)),
        ("abort", one(ClientOption::Abort)),
        ("starttls", one(ClientOption::StartTls)),
        ("structured_reply", one(ClientOption::StructuredReply)),
        (
            "list_meta_context",
            one(ClientOption::ListMetaContext(meta("disk", &["base:"]))),
        ),
        (
            "set_meta_context",
            one(ClientOption::SetMetaContext(meta(
                "disk",
                &[BASE_ALLOCATION, "qemu:dirty"],
            ))),
        ),
        ("extended_headers", one(ClientOption::ExtendedHeaders)),
    ]
}

/// Valid inputs for the `request` target: each command within a 1 GiB writable export with
/// structured replies and `base:allocation`, plus the classic rejections.
pub fn request_seeds() -> Vec<(&'static str, Vec<u8>)> {
    let with_limits = |command: u16, flags: u16, offset: u64, length: u32, bits: u8| {
        let mut out = Vec::new();
        request(&mut out, command, flags, offset, length);
        out.extend_from_slice(&(1u64 << 30).to_be_bytes());
        out.extend_from_slice(&MAX_PAYLOAD_BYTES.to_be_bytes());
        out.push(bits);
        out
    };
    vec![
        (
            "read",
            with_limits(NBD_CMD_READ, NBD_CMD_FLAG_DF, 4096, 4096, 0b110),
        ),
        (
            "write_fua",
            with_limits(NBD_CMD_WRITE, NBD_CMD_FLAG_FUA, 0, 512, 0),
        ),
        ("flush", with_limits(NBD_CMD_FLUSH, 0, 0, 0, 0)),
        ("trim", with_limits(NBD_CMD_TRIM, 0, 0, 1 << 20, 0)),
        ("cache", with_limits(NBD_CMD_CACHE, 0, 0, 1 << 20, 0)),
        (
            "write_zeroes",
            with_limits(NBD_CMD_WRITE_ZEROES, NBD_CMD_FLAG_NO_HOLE, 0, 64 << 20, 0),
        ),
        (
            "block_status",
            with_limits(
                NBD_CMD_BLOCK_STATUS,
                NBD_CMD_FLAG_REQ_ONE,
                0,
                1 << 30,
                0b110,
            ),
        ),
        ("disc", with_limits(NBD_CMD_DISC, 0, 0, 0, 0)),
        (
            "write_read_only",
            with_limits(NBD_CMD_WRITE, 0, 0, 512, 0b001),
        ),
        (
            "read_past_end",
            with_limits(NBD_CMD_READ, 0, (1 << 30) - 1, 2, 0),
        ),
    ]
}

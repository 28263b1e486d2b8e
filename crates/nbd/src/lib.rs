//! headroom-nbd: the NBD protocol (NetworkBlockDevice/nbd `doc/proto.md`) as pure
//! codecs and validation rules.
//!
//! Why a crate of its own: the protocol is the project's outermost trust boundary, and
//! keeping it free of sockets, async runtimes and storage makes every byte layout and
//! every errno rule testable (and fuzzable) in isolation. The server sessions in
//! `headroom-node` read fixed-size headers from the socket, call the decoders and
//! validators here, and write what the encoders here append to their buffers.
//!
//! Guarantees: decoders work on byte slices, check every bound and never panic on any
//! input; encoders only append to a caller-owned `Vec<u8>`; no `unsafe`, and no
//! non-test code path that can panic on input.
//!
//! See `crates/nbd/README.md` for the supported feature set, the limits and the errno
//! rule table with the spec quotes.

pub mod consts;
mod errno;
mod error;
mod handshake;
mod meta;
mod option;
mod option_reply;
mod reply;
mod request;
mod wire;

pub use consts::REQUEST_HEADER_LEN;
pub use errno::Errno;
pub use error::{HandshakeError, OptionError, TransmissionError};
pub use handshake::{
    ClientFlags, MAX_OPTION_DISCARD_BYTES, MAX_OPTION_LENGTH, MAX_PAYLOAD_BYTES, MIN_BLOCK_BYTES,
    OptionDataAction, OptionHeader, PREFERRED_BLOCK_BYTES, SERVER_HANDSHAKE_FLAGS,
    decode_client_flags, decode_option_header, encode_export_name_reply, encode_option_header,
    encode_server_greeting, is_known_option, option_data_action, transmission_flags,
};
pub use meta::{
    BASE_ALLOCATION, BASE_ALLOCATION_CONTEXT_ID, MetaContext, MetaContextOp,
    allocation_context_matches, select_meta_contexts,
};
pub use option::{
    ClientOption, InfoRequest, MetaContextRequest, decode_option, encode_client_option,
};
pub use option_reply::{
    OptionReplyHeader, decode_option_reply_header, encode_info_block_size, encode_info_description,
    encode_info_export, encode_info_name, encode_option_error, encode_option_reply,
    encode_rep_meta_context, encode_rep_server,
};
pub use reply::{
    MAX_BLOCK_STATUS_EXTENTS, MAX_OFFSET_DATA_LEN, SimpleReplyHeader, StructuredChunkHeader,
    decode_simple_reply_header, decode_structured_chunk_header, encode_simple_reply_header,
    encode_structured_block_status, encode_structured_chunk_header, encode_structured_error,
    encode_structured_error_offset, encode_structured_none_done,
    encode_structured_offset_data_header, encode_structured_offset_hole,
};
pub use request::{
    Command, ExportLimits, KNOWN_COMMAND_FLAGS, MAX_DISCARD_BYTES, RejectReason, RequestHeader,
    RequestRejection, ValidRequest, decode_request_header, encode_rejection, encode_request_header,
    validate_request,
};
pub use wire::StringError;

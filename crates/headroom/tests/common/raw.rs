//! Byte-level NBD access for tests that must control every byte: durability checks that need
//! to know exactly when a FLUSH was acknowledged, the negotiation and bad-input suites that
//! send options and requests no real client would (malformed, half-sent, out of order).
//!
//! Nothing here re-declares the protocol: constants are `headroom_nbd::consts`, and every
//! header is framed with `headroom-nbd`'s encoders and decoders. The ordinary handshake
//! ([`Client::open`], [`open_stream`]) is the lab's client (`headroom_lab::NbdClient`), so
//! the tests and the load generator enter transmission the same way.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use headroom_lab::{Export, LabError, NbdClient};
use headroom_nbd::consts::{
    IHAVEOPT, NBD_CMD_DISC, NBD_CMD_FLUSH, NBD_CMD_READ, NBD_CMD_WRITE, NBD_FLAG_C_FIXED_NEWSTYLE,
    NBD_FLAG_C_NO_ZEROES, NBD_INFO_EXPORT, NBD_OPT_GO, NBD_OPT_LIST, NBD_REP_ACK,
    NBD_REP_FLAG_ERROR, NBD_REP_INFO, NBD_REP_SERVER, NBDMAGIC, OPTION_HEADER_LEN,
    OPTION_REPLY_HEADER_LEN, SERVER_GREETING_LEN, SIMPLE_REPLY_HEADER_LEN,
    STRUCTURED_REPLY_HEADER_LEN,
};
use headroom_nbd::{
    ClientOption, InfoRequest, MetaContextRequest, RequestHeader, decode_option_reply_header,
    decode_simple_reply_header, decode_structured_chunk_header, encode_client_option,
    encode_option_header, encode_request_header,
};

pub struct OptionReply {
    pub option: u32,
    pub reply_type: u32,
    pub data: Vec<u8>,
}

pub struct SimpleReply {
    pub error: u32,
    pub cookie: u64,
}

/// One structured reply chunk: its header's fields and its payload.
pub struct Chunk {
    pub flags: u16,
    pub chunk_type: u16,
    pub cookie: u64,
    pub payload: Vec<u8>,
}

/// Reads one structured reply chunk (header and payload).
pub fn read_chunk(stream: &mut TcpStream) -> Chunk {
    let mut header = [0u8; STRUCTURED_REPLY_HEADER_LEN];
    stream.read_exact(&mut header).expect("chunk header");
    let header = decode_structured_chunk_header(&header).expect("structured reply magic");
    let mut payload = vec![0u8; header.length as usize];
    stream.read_exact(&mut payload).expect("chunk payload");
    Chunk {
        flags: header.flags,
        chunk_type: header.chunk_type,
        cookie: header.cookie,
        payload,
    }
}

pub struct Client {
    pub stream: TcpStream,
    pub size_bytes: u64,
    pub transmission_flags: u16,
}

pub fn connect(addr: SocketAddr) -> TcpStream {
    let stream = TcpStream::connect(addr).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .expect("timeout");
    stream.set_nodelay(true).expect("nodelay");
    stream
}

/// The lab's handshake (fixed newstyle, `NBD_OPT_GO` for `export`) on a blocking socket with
/// `read_timeout` (which also bounds the handshake): the socket at the start of transmission
/// and what GO told. Errors are the lab's, for callers that expect the server to go away (the
/// crash harness).
pub fn open_stream(
    addr: SocketAddr,
    export: &str,
    read_timeout: Duration,
) -> Result<(TcpStream, Export), LabError> {
    let io = |context| move |source| LabError::Io { context, source };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .build()
        .map_err(io("starting a runtime for the handshake"))?;
    let addr = addr.to_string();
    let handshake = NbdClient::connect(&addr, export);
    let client = runtime
        .block_on(async { tokio::time::timeout(read_timeout, handshake).await })
        .map_err(|elapsed| LabError::Io {
            context: "the handshake",
            source: std::io::Error::new(std::io::ErrorKind::TimedOut, elapsed),
        })??;
    let export = client.export();
    let stream = {
        // into_std must run inside the runtime that registered the socket.
        let _entered = runtime.enter();
        client.into_stream().into_std().map_err(io("into_std"))?
    };
    stream.set_nonblocking(false).map_err(io("blocking mode"))?;
    stream
        .set_read_timeout(Some(read_timeout))
        .map_err(io("read timeout"))?;
    Ok((stream, export))
}

/// Reads the server greeting and sends client flags (FIXED_NEWSTYLE | NO_ZEROES).
pub fn greet(stream: &mut TcpStream) {
    let mut greeting = [0u8; SERVER_GREETING_LEN];
    stream.read_exact(&mut greeting).expect("greeting");
    assert_eq!(
        u64::from_be_bytes(greeting[0..8].try_into().unwrap()),
        NBDMAGIC
    );
    assert_eq!(
        u64::from_be_bytes(greeting[8..16].try_into().unwrap()),
        IHAVEOPT
    );
    let flags = NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES;
    stream
        .write_all(&flags.to_be_bytes())
        .expect("client flags");
}

/// Sends option `option` with `data` as its payload, whatever the payload holds.
pub fn send_option(stream: &mut TcpStream, option: u32, data: &[u8]) {
    let mut buf = Vec::with_capacity(OPTION_HEADER_LEN + data.len());
    encode_option_header(&mut buf, option, data.len() as u32);
    buf.extend_from_slice(data);
    stream.write_all(&buf).expect("send option");
}

pub fn read_option_reply(stream: &mut TcpStream) -> OptionReply {
    let mut header = [0u8; OPTION_REPLY_HEADER_LEN];
    stream.read_exact(&mut header).expect("option reply header");
    let header = decode_option_reply_header(&header).expect("option reply magic");
    let mut data = vec![0u8; header.length as usize];
    stream.read_exact(&mut data).expect("option reply data");
    OptionReply {
        option: header.option,
        reply_type: header.reply_type,
        data,
    }
}

/// The data of `option` as `headroom-nbd` encodes it (without the option header).
fn option_payload(option: &ClientOption) -> Vec<u8> {
    let mut out = Vec::new();
    encode_client_option(&mut out, option);
    out.split_off(OPTION_HEADER_LEN)
}

/// GO payload for `name` with no info requests.
pub fn go_payload(name: &str) -> Vec<u8> {
    option_payload(&ClientOption::Go(InfoRequest {
        export_name: name.to_string(),
        info_types: Vec::new(),
    }))
}

/// LIST_META_CONTEXT / SET_META_CONTEXT payload for `export` with `queries`.
pub fn meta_payload(export: &str, queries: &[&str]) -> Vec<u8> {
    option_payload(&ClientOption::ListMetaContext(MetaContextRequest {
        export_name: export.to_string(),
        queries: queries.iter().map(|q| q.to_string()).collect(),
    }))
}

/// The replies to one option as (option, reply type, data): with the magic checked, that is
/// every byte of them.
pub type OptionReplies = Vec<(u32, u32, Vec<u8>)>;

/// Reads the replies to one option up to and including the final one (ACK or an error).
pub fn read_option_replies(stream: &mut TcpStream) -> OptionReplies {
    let mut replies = Vec::new();
    loop {
        let reply = read_option_reply(stream);
        let last = reply.reply_type == NBD_REP_ACK || reply.reply_type & NBD_REP_FLAG_ERROR != 0;
        replies.push((reply.option, reply.reply_type, reply.data));
        if last {
            return replies;
        }
    }
}

/// The names in an `NBD_OPT_LIST` answer (sent on `stream`), in the order given.
pub fn list_exports(stream: &mut TcpStream) -> Vec<String> {
    send_option(stream, NBD_OPT_LIST, &[]);
    let mut names = Vec::new();
    for (option, reply_type, data) in read_option_replies(stream) {
        assert_eq!(option, NBD_OPT_LIST);
        match reply_type {
            NBD_REP_SERVER => {
                let len = u32::from_be_bytes(data[0..4].try_into().unwrap()) as usize;
                names.push(String::from_utf8(data[4..4 + len].to_vec()).unwrap());
            }
            NBD_REP_ACK => {}
            other => panic!("LIST answered {other:#x}"),
        }
    }
    names
}

/// Sends GO and reads replies until ACK; returns (size, flags) or the error reply type.
pub fn go(stream: &mut TcpStream, name: &str) -> Result<(u64, u16), u32> {
    send_option(stream, NBD_OPT_GO, &go_payload(name));
    let mut export = None;
    loop {
        let reply = read_option_reply(stream);
        match reply.reply_type {
            NBD_REP_INFO => {
                let info_type = u16::from_be_bytes(reply.data[0..2].try_into().unwrap());
                if info_type == NBD_INFO_EXPORT {
                    let size = u64::from_be_bytes(reply.data[2..10].try_into().unwrap());
                    let flags = u16::from_be_bytes(reply.data[10..12].try_into().unwrap());
                    export = Some((size, flags));
                }
            }
            NBD_REP_ACK => return Ok(export.expect("NBD_INFO_EXPORT before ACK")),
            err => return Err(err),
        }
    }
}

/// Appends one request header (flags, command, cookie, offset, length), for tests that
/// pipeline many requests in one write.
pub fn push_request(
    out: &mut Vec<u8>,
    flags: u16,
    command: u16,
    cookie: u64,
    offset: u64,
    length: u32,
) {
    encode_request_header(
        out,
        &RequestHeader {
            flags,
            command,
            cookie,
            offset,
            length,
        },
    );
}

impl Client {
    /// The lab's handshake (simple replies, GO); panics when the server refuses.
    pub fn open(addr: SocketAddr, export: &str) -> Client {
        let (stream, export) = open_stream(addr, export, Duration::from_secs(30))
            .unwrap_or_else(|err| panic!("GO succeeds: {err}"));
        Client {
            stream,
            size_bytes: export.size_bytes,
            transmission_flags: export.transmission_flags,
        }
    }

    pub fn send_request(
        &mut self,
        flags: u16,
        command: u16,
        cookie: u64,
        offset: u64,
        length: u32,
    ) {
        let mut buf = Vec::with_capacity(headroom_nbd::REQUEST_HEADER_LEN);
        push_request(&mut buf, flags, command, cookie, offset, length);
        self.stream.write_all(&buf).expect("send request");
    }

    pub fn read_simple_reply(&mut self) -> SimpleReply {
        let mut header = [0u8; SIMPLE_REPLY_HEADER_LEN];
        self.stream.read_exact(&mut header).expect("reply header");
        let reply = decode_simple_reply_header(&header).expect("simple reply magic");
        SimpleReply {
            error: reply.error,
            cookie: reply.cookie,
        }
    }

    pub fn write(&mut self, cookie: u64, offset: u64, data: &[u8], flags: u16) -> u32 {
        self.send_request(flags, NBD_CMD_WRITE, cookie, offset, data.len() as u32);
        self.stream.write_all(data).expect("payload");
        let reply = self.read_simple_reply();
        assert_eq!(reply.cookie, cookie);
        reply.error
    }

    pub fn read(&mut self, cookie: u64, offset: u64, length: u32) -> Result<Vec<u8>, u32> {
        self.send_request(0, NBD_CMD_READ, cookie, offset, length);
        let reply = self.read_simple_reply();
        assert_eq!(reply.cookie, cookie);
        if reply.error != 0 {
            return Err(reply.error);
        }
        let mut data = vec![0u8; length as usize];
        self.stream.read_exact(&mut data).expect("read data");
        Ok(data)
    }

    pub fn flush(&mut self, cookie: u64) -> u32 {
        self.send_request(0, NBD_CMD_FLUSH, cookie, 0, 0);
        let reply = self.read_simple_reply();
        assert_eq!(reply.cookie, cookie);
        reply.error
    }

    pub fn disconnect(mut self) {
        self.send_request(0, NBD_CMD_DISC, 0, 0, 0);
    }
}

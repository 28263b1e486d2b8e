//! A deliberately small, hand-rolled NBD client for tests that must control every byte:
//! durability checks that need to know exactly when a FLUSH was acknowledged, and the
//! bad-input suite that sends what no real client would.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
pub const OPT_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

pub const OPT_EXPORT_NAME: u32 = 1;
pub const OPT_ABORT: u32 = 2;
pub const OPT_LIST: u32 = 3;
pub const OPT_INFO: u32 = 6;
pub const OPT_GO: u32 = 7;
pub const OPT_STRUCTURED_REPLY: u32 = 8;
pub const OPT_LIST_META_CONTEXT: u32 = 9;
pub const OPT_SET_META_CONTEXT: u32 = 10;

pub const REP_ACK: u32 = 1;
pub const REP_SERVER: u32 = 2;
pub const REP_INFO: u32 = 3;
pub const REP_META_CONTEXT: u32 = 4;
pub const REP_ERR_UNSUP: u32 = 0x8000_0001;
pub const REP_ERR_INVALID: u32 = 0x8000_0003;
pub const REP_ERR_UNKNOWN: u32 = 0x8000_0006;
pub const REP_ERR_TOO_BIG: u32 = 0x8000_0009;

pub const CMD_READ: u16 = 0;
pub const CMD_WRITE: u16 = 1;
pub const CMD_DISC: u16 = 2;
pub const CMD_FLUSH: u16 = 3;
pub const CMD_TRIM: u16 = 4;
pub const CMD_CACHE: u16 = 5;
pub const CMD_WRITE_ZEROES: u16 = 6;
pub const CMD_BLOCK_STATUS: u16 = 7;
pub const CMD_FLAG_FUA: u16 = 1;

pub const EPERM: u32 = 1;
pub const EIO: u32 = 5;
pub const EINVAL: u32 = 22;
pub const ENOSPC: u32 = 28;
pub const EOVERFLOW: u32 = 75;
pub const ENOTSUP: u32 = 95;

pub struct OptionReply {
    pub option: u32,
    pub reply_type: u32,
    pub data: Vec<u8>,
}

pub struct SimpleReply {
    pub error: u32,
    pub cookie: u64,
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

/// Reads the server greeting and sends client flags (FIXED_NEWSTYLE | NO_ZEROES).
pub fn greet(stream: &mut TcpStream) {
    let mut greeting = [0u8; 18];
    stream.read_exact(&mut greeting).expect("greeting");
    assert_eq!(
        u64::from_be_bytes(greeting[0..8].try_into().unwrap()),
        NBDMAGIC
    );
    assert_eq!(
        u64::from_be_bytes(greeting[8..16].try_into().unwrap()),
        IHAVEOPT
    );
    stream.write_all(&3u32.to_be_bytes()).expect("client flags");
}

pub fn send_option(stream: &mut TcpStream, option: u32, data: &[u8]) {
    let mut buf = Vec::with_capacity(16 + data.len());
    buf.extend_from_slice(&IHAVEOPT.to_be_bytes());
    buf.extend_from_slice(&option.to_be_bytes());
    buf.extend_from_slice(&(data.len() as u32).to_be_bytes());
    buf.extend_from_slice(data);
    stream.write_all(&buf).expect("send option");
}

pub fn read_option_reply(stream: &mut TcpStream) -> OptionReply {
    let mut header = [0u8; 20];
    stream.read_exact(&mut header).expect("option reply header");
    assert_eq!(
        u64::from_be_bytes(header[0..8].try_into().unwrap()),
        OPT_REPLY_MAGIC
    );
    let option = u32::from_be_bytes(header[8..12].try_into().unwrap());
    let reply_type = u32::from_be_bytes(header[12..16].try_into().unwrap());
    let len = u32::from_be_bytes(header[16..20].try_into().unwrap()) as usize;
    let mut data = vec![0u8; len];
    stream.read_exact(&mut data).expect("option reply data");
    OptionReply {
        option,
        reply_type,
        data,
    }
}

/// GO payload for `name` with no info requests.
pub fn go_payload(name: &str) -> Vec<u8> {
    let mut data = Vec::new();
    data.extend_from_slice(&(name.len() as u32).to_be_bytes());
    data.extend_from_slice(name.as_bytes());
    data.extend_from_slice(&0u16.to_be_bytes());
    data
}

/// LIST_META_CONTEXT / SET_META_CONTEXT payload for `export` with `queries`.
pub fn meta_payload(export: &str, queries: &[&str]) -> Vec<u8> {
    let mut data = Vec::new();
    data.extend_from_slice(&(export.len() as u32).to_be_bytes());
    data.extend_from_slice(export.as_bytes());
    data.extend_from_slice(&(queries.len() as u32).to_be_bytes());
    for query in queries {
        data.extend_from_slice(&(query.len() as u32).to_be_bytes());
        data.extend_from_slice(query.as_bytes());
    }
    data
}

/// The replies to one option as (option, reply type, data): with the magic checked, that is
/// every byte of them.
pub type OptionReplies = Vec<(u32, u32, Vec<u8>)>;

/// Reads the replies to one option up to and including the final one (ACK or an error).
pub fn read_option_replies(stream: &mut TcpStream) -> OptionReplies {
    let mut replies = Vec::new();
    loop {
        let reply = read_option_reply(stream);
        let last = reply.reply_type == REP_ACK || reply.reply_type & 0x8000_0000 != 0;
        replies.push((reply.option, reply.reply_type, reply.data));
        if last {
            return replies;
        }
    }
}

/// The names in an `NBD_OPT_LIST` answer (sent on `stream`), in the order given.
pub fn list_exports(stream: &mut TcpStream) -> Vec<String> {
    send_option(stream, OPT_LIST, &[]);
    let mut names = Vec::new();
    for (option, reply_type, data) in read_option_replies(stream) {
        assert_eq!(option, OPT_LIST);
        match reply_type {
            REP_SERVER => {
                let len = u32::from_be_bytes(data[0..4].try_into().unwrap()) as usize;
                names.push(String::from_utf8(data[4..4 + len].to_vec()).unwrap());
            }
            REP_ACK => {}
            other => panic!("LIST answered {other:#x}"),
        }
    }
    names
}

/// Sends GO and reads replies until ACK; returns (size, flags) or the error reply type.
pub fn go(stream: &mut TcpStream, name: &str) -> Result<(u64, u16), u32> {
    send_option(stream, OPT_GO, &go_payload(name));
    let mut export = None;
    loop {
        let reply = read_option_reply(stream);
        match reply.reply_type {
            REP_INFO => {
                let info_type = u16::from_be_bytes(reply.data[0..2].try_into().unwrap());
                if info_type == 0 {
                    let size = u64::from_be_bytes(reply.data[2..10].try_into().unwrap());
                    let flags = u16::from_be_bytes(reply.data[10..12].try_into().unwrap());
                    export = Some((size, flags));
                }
            }
            REP_ACK => return Ok(export.expect("NBD_INFO_EXPORT before ACK")),
            err => return Err(err),
        }
    }
}

impl Client {
    /// Full handshake with simple replies and GO.
    pub fn open(addr: SocketAddr, export: &str) -> Client {
        let mut stream = connect(addr);
        greet(&mut stream);
        let (size_bytes, transmission_flags) = go(&mut stream, export).expect("GO succeeds");
        Client {
            stream,
            size_bytes,
            transmission_flags,
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
        let mut buf = [0u8; 28];
        buf[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        buf[4..6].copy_from_slice(&flags.to_be_bytes());
        buf[6..8].copy_from_slice(&command.to_be_bytes());
        buf[8..16].copy_from_slice(&cookie.to_be_bytes());
        buf[16..24].copy_from_slice(&offset.to_be_bytes());
        buf[24..28].copy_from_slice(&length.to_be_bytes());
        self.stream.write_all(&buf).expect("send request");
    }

    pub fn read_simple_reply(&mut self) -> SimpleReply {
        let mut header = [0u8; 16];
        self.stream.read_exact(&mut header).expect("reply header");
        assert_eq!(
            u32::from_be_bytes(header[0..4].try_into().unwrap()),
            SIMPLE_REPLY_MAGIC
        );
        SimpleReply {
            error: u32::from_be_bytes(header[4..8].try_into().unwrap()),
            cookie: u64::from_be_bytes(header[8..16].try_into().unwrap()),
        }
    }

    pub fn write(&mut self, cookie: u64, offset: u64, data: &[u8], flags: u16) -> u32 {
        self.send_request(flags, CMD_WRITE, cookie, offset, data.len() as u32);
        self.stream.write_all(data).expect("payload");
        let reply = self.read_simple_reply();
        assert_eq!(reply.cookie, cookie);
        reply.error
    }

    pub fn read(&mut self, cookie: u64, offset: u64, length: u32) -> Result<Vec<u8>, u32> {
        self.send_request(0, CMD_READ, cookie, offset, length);
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
        self.send_request(0, CMD_FLUSH, cookie, 0, 0);
        let reply = self.read_simple_reply();
        assert_eq!(reply.cookie, cookie);
        reply.error
    }

    pub fn disconnect(mut self) {
        self.send_request(0, CMD_DISC, 0, 0, 0);
    }
}

//! What the floor servers share (`floor_server` and `floor_server_uring`): the arguments, the
//! export in RAM, the handshake (blocking std I/O) and the parser of a batch of requests. The
//! two differ only in how the transmission phase moves bytes (blocking `read`/`writev`, or
//! io_uring), so the protocol work they measure is the same code.

use std::io::{IoSlice, Read, Write};
use std::net::TcpStream;

use headroom_nbd::consts::{
    IHAVEOPT, NBD_CMD_DISC, NBD_CMD_READ, NBD_CMD_WRITE, NBD_FLAG_FIXED_NEWSTYLE,
    NBD_FLAG_HAS_FLAGS, NBD_FLAG_NO_ZEROES, NBD_FLAG_SEND_FLUSH, NBD_INFO_EXPORT, NBD_OPT_ABORT,
    NBD_OPT_EXPORT_NAME, NBD_OPT_GO, NBD_OPT_INFO, NBD_REP_ACK, NBD_REP_ERR_UNSUP, NBD_REP_INFO,
    NBDMAGIC, OPTION_REPLY_MAGIC, REQUEST_MAGIC, SIMPLE_REPLY_MAGIC,
};

/// Largest payload it accepts (the spec's common 32 MiB).
const MAX_PAYLOAD_BYTES: usize = 32 << 20;
/// Requests per batch at most: one `writev`/`sendmsg` of at most 2 slices per reply (the
/// kernel's IOV_MAX is 1024 slices).
pub const MAX_BATCH: usize = 500;
const HEADER_LEN: usize = 28;
/// The input buffer's starting size (it grows for a WRITE larger than it).
pub const INBUF_BYTES: usize = 1 << 20;

/// `ADDR SIZE_MIB [FLAGS...]`: the address, the export's size in MiB and the flags given.
pub fn args(usage: &str) -> std::io::Result<(String, usize, Vec<String>)> {
    let args: Vec<String> = std::env::args().collect();
    let usage = || std::io::Error::other(format!("usage: {usage}"));
    let addr = args.get(1).ok_or_else(usage)?.clone();
    let size_mib: usize = args.get(2).and_then(|s| s.parse().ok()).ok_or_else(usage)?;
    Ok((addr, size_mib, args[3..].to_vec()))
}

/// The export: `size_mib` MiB touched and not zero, so reads come from memory of their own (an
/// untouched zero vector would be one shared zero page, always in cache).
pub fn export(size_mib: usize) -> Vec<u8> {
    let mut data = vec![0u8; size_mib << 20];
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for chunk in data.chunks_exact_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes());
    }
    data
}

fn be_u16(b: &[u8]) -> u16 {
    u16::from_be_bytes([b[0], b[1]])
}
fn be_u32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}
fn be_u64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_be_bytes(a)
}

fn option_reply(s: &mut TcpStream, option: u32, kind: u32, data: &[u8]) -> std::io::Result<()> {
    let mut out = Vec::with_capacity(20 + data.len());
    out.extend_from_slice(&OPTION_REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&option.to_be_bytes());
    out.extend_from_slice(&kind.to_be_bytes());
    out.extend_from_slice(&u32::try_from(data.len()).unwrap_or(0).to_be_bytes());
    out.extend_from_slice(data);
    s.write_all(&out)
}

pub fn bad(what: &str) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, what.to_owned())
}

/// The newstyle handshake for an export of `size` bytes (simple replies only: structured
/// replies are refused). Returns whether the client went on to the transmission phase (false:
/// it aborted).
pub fn handshake(s: &mut TcpStream, size: u64) -> std::io::Result<bool> {
    s.set_nodelay(true)?;
    let tflags = NBD_FLAG_HAS_FLAGS | NBD_FLAG_SEND_FLUSH;
    let mut greeting = Vec::new();
    greeting.extend_from_slice(&NBDMAGIC.to_be_bytes());
    greeting.extend_from_slice(&IHAVEOPT.to_be_bytes());
    greeting.extend_from_slice(&(NBD_FLAG_FIXED_NEWSTYLE | NBD_FLAG_NO_ZEROES).to_be_bytes());
    s.write_all(&greeting)?;
    let mut client_flags = [0u8; 4];
    s.read_exact(&mut client_flags)?;
    let no_zeroes = be_u32(&client_flags) & u32::from(NBD_FLAG_NO_ZEROES) != 0;
    loop {
        let mut head = [0u8; 16];
        s.read_exact(&mut head)?;
        if be_u64(&head) != IHAVEOPT {
            return Err(bad("option magic"));
        }
        let option = be_u32(&head[8..]);
        let len = be_u32(&head[12..]) as usize;
        if len > 4096 {
            return Err(bad("option too long"));
        }
        let mut body = vec![0u8; len];
        s.read_exact(&mut body)?;
        match option {
            NBD_OPT_GO | NBD_OPT_INFO => {
                let mut info = Vec::new();
                info.extend_from_slice(&NBD_INFO_EXPORT.to_be_bytes());
                info.extend_from_slice(&size.to_be_bytes());
                info.extend_from_slice(&tflags.to_be_bytes());
                option_reply(s, option, NBD_REP_INFO, &info)?;
                option_reply(s, option, NBD_REP_ACK, &[])?;
                if option == NBD_OPT_GO {
                    return Ok(true);
                }
            }
            NBD_OPT_EXPORT_NAME => {
                let mut out = Vec::new();
                out.extend_from_slice(&size.to_be_bytes());
                out.extend_from_slice(&tflags.to_be_bytes());
                if !no_zeroes {
                    out.extend_from_slice(&[0u8; 124]);
                }
                s.write_all(&out)?;
                return Ok(true);
            }
            NBD_OPT_ABORT => {
                option_reply(s, option, NBD_REP_ACK, &[])?;
                return Ok(false);
            }
            _ => option_reply(s, option, NBD_REP_ERR_UNSUP, &[])?,
        }
    }
}

/// The replies of one batch: a simple reply header each, and the payload of each READ (a range
/// of the export, or with `--copy` of `copied`).
#[derive(Debug)]
pub struct Batch {
    copy: bool,
    heads: Vec<[u8; 16]>,
    /// Per reply: the range of the export (or of `copied`) it carries, if any.
    payloads: Vec<Option<(usize, usize)>>,
    copied: Vec<u8>,
    /// A DISC was parsed: answer the batch, then end the connection.
    pub disconnect: bool,
}

impl Batch {
    pub fn new(copy: bool) -> Self {
        Batch {
            copy,
            heads: Vec::with_capacity(MAX_BATCH),
            payloads: Vec::with_capacity(MAX_BATCH),
            copied: Vec::new(),
            disconnect: false,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.heads.is_empty()
    }

    /// The batch's replies as slices, in order: what one `writev`/`sendmsg` sends.
    pub fn slices<'a>(&'a self, data: &'a [u8]) -> Vec<IoSlice<'a>> {
        let source: &[u8] = if self.copy { &self.copied } else { data };
        let mut slices = Vec::with_capacity(2 * self.heads.len());
        for (head, payload) in self.heads.iter().zip(&self.payloads) {
            slices.push(IoSlice::new(head));
            if let Some((at, len)) = payload {
                slices.push(IoSlice::new(&source[*at..*at + *len]));
            }
        }
        slices
    }

    /// Forgets the replies (once they are sent).
    pub fn clear(&mut self) {
        self.heads.clear();
        self.payloads.clear();
        self.copied.clear();
    }

    /// Parses the complete requests in `inbuf[*start..end]` into the batch (READ: the range, or
    /// with `--copy` a copy of it; WRITE: copied into `data`; DISC: `disconnect`), advancing
    /// `*start`. Stops at an incomplete request (then `inbuf` is grown if a WRITE is larger than
    /// all of it), a DISC, or a full batch. Returns whether it needs more input before more
    /// requests can parse (false: the batch is full and complete requests may remain). A bad
    /// magic or an out-of-range request is an error (the connection ends).
    pub fn parse(
        &mut self,
        inbuf: &mut Vec<u8>,
        start: &mut usize,
        end: usize,
        data: &mut [u8],
    ) -> std::io::Result<bool> {
        loop {
            if self.heads.len() == MAX_BATCH {
                return Ok(false);
            }
            if end - *start < HEADER_LEN {
                return Ok(true);
            }
            let h = &inbuf[*start..*start + HEADER_LEN];
            if be_u32(h) != REQUEST_MAGIC {
                return Err(bad("request magic"));
            }
            let command = be_u16(&h[6..]);
            let cookie = &h[8..16];
            let offset = usize::try_from(be_u64(&h[16..])).map_err(|_| bad("offset"))?;
            let len = be_u32(&h[24..]) as usize;
            let in_range = len <= MAX_PAYLOAD_BYTES && offset.saturating_add(len) <= data.len();
            let mut head = [0u8; 16];
            head[..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
            head[8..].copy_from_slice(cookie);
            match command {
                NBD_CMD_READ | NBD_CMD_WRITE if !in_range => return Err(bad("range")),
                NBD_CMD_READ => {
                    if self.copy {
                        let at = self.copied.len();
                        self.copied.extend_from_slice(&data[offset..offset + len]);
                        self.payloads.push(Some((at, len)));
                    } else {
                        self.payloads.push(Some((offset, len)));
                    }
                }
                NBD_CMD_WRITE => {
                    if end - *start < HEADER_LEN + len {
                        // The payload is not all here yet: make room and read on.
                        if inbuf.len() < HEADER_LEN + len {
                            inbuf.resize(HEADER_LEN + len, 0);
                        }
                        return Ok(true);
                    }
                    let body = *start + HEADER_LEN;
                    data[offset..offset + len].copy_from_slice(&inbuf[body..body + len]);
                    *start += len;
                    self.payloads.push(None);
                }
                NBD_CMD_DISC => {
                    self.disconnect = true;
                    *start += HEADER_LEN;
                    return Ok(true);
                }
                _ => self.payloads.push(None),
            }
            self.heads.push(head);
            *start += HEADER_LEN;
        }
    }
}

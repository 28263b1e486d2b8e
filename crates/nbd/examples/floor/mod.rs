//! What the floor servers share (`floor_server` and `floor_server_uring`): the arguments, the
//! export in RAM, the handshake (blocking std I/O) and the parser of a batch of requests. The
//! two differ only in how the transmission phase moves bytes (blocking `read`/`writev`, or
//! io_uring), so the protocol work they measure is the same code.
//!
//! Why the replies look the way they do: a floor is only a yardstick if the client does the
//! same work against it as against Headroom. fio's nbd engine (libnbd) negotiates structured
//! replies whenever the server offers them, and then reads each reply as a chunk header and,
//! for a READ, an offset before the data: more work on the client's side than a simple reply
//! costs, and a client at 100 % of a CPU makes the server that spares it look faster. So the
//! floors accept `NBD_OPT_STRUCTURED_REPLY` as Headroom does and answer as Headroom does: a
//! READ with one `NBD_REPLY_TYPE_OFFSET_DATA` chunk flagged DONE, anything else with one
//! `NBD_REPLY_TYPE_NONE` chunk flagged DONE, encoded by the same functions of this crate
//! Headroom's reply writer calls. `--simple` refuses the option (the yardstick as it was:
//! 16-byte simple replies).
//!
//! How replies are batched, against Headroom's session (`node::session`):
//! - alike: the replies of the requests parsed from what one receive brought go out in one
//!   `writev`/`sendmsg`, in request order; the headers of a batch are encoded back to back into
//!   one buffer and each READ's payload is a slice of its own, so a run of headers with no
//!   payload between them is one slice (Headroom's writer's `Segment`s); a batch ends at 256
//!   replies or once it holds 192 KiB of headers and payloads (Headroom's `BATCH_REPLIES_MAX`
//!   and `BATCH_BYTES_MAX`, same rule: a reply is added while the batch is below both); the
//!   input buffer is 128 KiB, as Headroom's reader's, and each receive has all of it but an
//!   incomplete request carried over (a read buffer refilled whole, as Headroom's).
//! - not alike: Headroom's reader hands each request to a writer task on the same thread, and
//!   the writer sends what has completed when the reader has nothing more to parse, which is
//!   after a further receive finds the socket empty (one more system call per batch, and any
//!   requests that arrived meanwhile join the batch); a floor sends as soon as the bytes of one
//!   receive are parsed. Headroom's network thread also waits `coalesce_us` (10 µs on RAM,
//!   adaptive: `node::coalesce`) before it sleeps, so more requests pile up per wake-up; the
//!   floors never wait. Headroom's READ payloads are copied out of its store into pooled
//!   buffers, the floors' with `--copy` into one reply buffer per batch.

use std::io::{IoSlice, Read, Write};
use std::net::TcpStream;

use headroom_nbd::consts::{
    IHAVEOPT, NBD_CMD_DISC, NBD_CMD_READ, NBD_CMD_WRITE, NBD_FLAG_FIXED_NEWSTYLE,
    NBD_FLAG_HAS_FLAGS, NBD_FLAG_NO_ZEROES, NBD_FLAG_SEND_FLUSH, NBD_INFO_EXPORT, NBD_OPT_ABORT,
    NBD_OPT_EXPORT_NAME, NBD_OPT_GO, NBD_OPT_INFO, NBD_OPT_STRUCTURED_REPLY, NBD_REP_ACK,
    NBD_REP_ERR_INVALID, NBD_REP_ERR_UNSUP, NBD_REP_INFO, NBDMAGIC, OPTION_REPLY_MAGIC,
    REQUEST_MAGIC,
};
use headroom_nbd::{
    encode_simple_reply_header, encode_structured_none_done, encode_structured_offset_data_header,
};

/// Largest payload it accepts (the spec's common 32 MiB).
const MAX_PAYLOAD_BYTES: usize = 32 << 20;
/// Replies per batch at most (Headroom's `BATCH_REPLIES_MAX`): one `writev`/`sendmsg` of at
/// most 2 slices per reply and one more (the kernel's IOV_MAX is 1024 slices).
pub const MAX_BATCH: usize = 256;
/// A batch takes no more replies once its headers and payloads reach this (Headroom's
/// `BATCH_BYTES_MAX`).
const BATCH_BYTES_MAX: usize = 192 << 10;
const HEADER_LEN: usize = 28;
/// The input buffer's starting size (Headroom's reader's buffer; it grows for a WRITE larger
/// than it).
pub const INBUF_BYTES: usize = 128 << 10;

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

/// Whether the flags given allow structured replies (`--simple`: refuse them).
pub fn structured_allowed(flags: &[String]) -> bool {
    !flags.iter().any(|a| a == "--simple")
}

/// The newstyle handshake for an export of `size` bytes; `NBD_OPT_STRUCTURED_REPLY` is
/// accepted if `allow_structured`, else refused. Returns `None` if the client aborted, else
/// whether structured replies were negotiated.
pub fn handshake(
    s: &mut TcpStream,
    size: u64,
    allow_structured: bool,
) -> std::io::Result<Option<bool>> {
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
    let mut structured = false;
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
                    return Ok(Some(structured));
                }
            }
            NBD_OPT_STRUCTURED_REPLY if allow_structured => {
                // The option carries no data ("the client MUST NOT send any additional data").
                if len != 0 || structured {
                    option_reply(s, option, NBD_REP_ERR_INVALID, &[])?;
                } else {
                    structured = true;
                    option_reply(s, option, NBD_REP_ACK, &[])?;
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
                return Ok(Some(structured));
            }
            NBD_OPT_ABORT => {
                option_reply(s, option, NBD_REP_ACK, &[])?;
                return Ok(None);
            }
            _ => option_reply(s, option, NBD_REP_ERR_UNSUP, &[])?,
        }
    }
}

/// One piece of a batch on the wire (as Headroom's reply writer lays a batch out).
#[derive(Debug)]
enum Segment {
    /// Reply headers, back to back in `Batch::out`.
    Head(std::ops::Range<usize>),
    /// A READ's payload: a range of the export, or with `--copy` of `Batch::copied`.
    Payload(std::ops::Range<usize>),
}

/// The replies of one batch: their headers encoded back to back, and the payload of each READ
/// (a range of the export, or with `--copy` of `copied`), in wire order.
#[derive(Debug)]
pub struct Batch {
    copy: bool,
    /// Structured replies were negotiated: chunks, not simple replies.
    structured: bool,
    out: Vec<u8>,
    /// The batch up to `head_start` (the headers after it follow all of these).
    segments: Vec<Segment>,
    head_start: usize,
    replies: usize,
    /// Headers and payloads, bytes.
    batch_bytes: usize,
    copied: Vec<u8>,
    /// A DISC was parsed: answer the batch, then end the connection.
    pub disconnect: bool,
}

impl Batch {
    pub fn new(copy: bool, structured: bool) -> Self {
        Batch {
            copy,
            structured,
            out: Vec::with_capacity(MAX_BATCH * 28),
            segments: Vec::with_capacity(2 * MAX_BATCH),
            head_start: 0,
            replies: 0,
            batch_bytes: 0,
            copied: Vec::new(),
            disconnect: false,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.replies == 0
    }

    /// The batch's replies as slices, in order: what one `writev`/`sendmsg` sends.
    pub fn slices<'a>(&'a self, data: &'a [u8]) -> Vec<IoSlice<'a>> {
        let source: &[u8] = if self.copy { &self.copied } else { data };
        let mut slices = Vec::with_capacity(self.segments.len() + 1);
        for segment in &self.segments {
            slices.push(match segment {
                Segment::Head(range) => IoSlice::new(&self.out[range.clone()]),
                Segment::Payload(range) => IoSlice::new(&source[range.clone()]),
            });
        }
        if self.head_start < self.out.len() {
            slices.push(IoSlice::new(&self.out[self.head_start..]));
        }
        slices
    }

    /// Forgets the replies (once they are sent).
    pub fn clear(&mut self) {
        self.out.clear();
        self.segments.clear();
        self.head_start = 0;
        self.replies = 0;
        self.batch_bytes = 0;
        self.copied.clear();
    }

    /// Appends one reply: its header and, for a READ, the payload `range` (of the export, or
    /// of `copied`).
    fn reply(&mut self, cookie: u64, offset: u64, payload: Option<std::ops::Range<usize>>) {
        let before = self.out.len();
        match (&payload, self.structured) {
            (Some(range), true) if !range.is_empty() => {
                // At most MAX_PAYLOAD_BYTES (checked by the parser): fits in 32 bits.
                let len = u32::try_from(range.len()).unwrap_or(u32::MAX);
                encode_structured_offset_data_header(&mut self.out, true, cookie, offset, len);
            }
            (_, true) => encode_structured_none_done(&mut self.out, cookie),
            (_, false) => encode_simple_reply_header(&mut self.out, cookie, 0),
        }
        self.batch_bytes += self.out.len() - before;
        if let Some(range) = payload.filter(|r| !r.is_empty()) {
            self.segments
                .push(Segment::Head(self.head_start..self.out.len()));
            self.head_start = self.out.len();
            self.batch_bytes += range.len();
            self.segments.push(Segment::Payload(range));
        }
        self.replies += 1;
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
            if self.replies == MAX_BATCH || self.batch_bytes >= BATCH_BYTES_MAX {
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
            let cookie = be_u64(&h[8..]);
            let offset_u64 = be_u64(&h[16..]);
            let offset = usize::try_from(offset_u64).map_err(|_| bad("offset"))?;
            let len = be_u32(&h[24..]) as usize;
            let in_range = len <= MAX_PAYLOAD_BYTES && offset.saturating_add(len) <= data.len();
            match command {
                NBD_CMD_READ | NBD_CMD_WRITE if !in_range => return Err(bad("range")),
                NBD_CMD_READ => {
                    let range = if self.copy {
                        let at = self.copied.len();
                        self.copied.extend_from_slice(&data[offset..offset + len]);
                        at..at + len
                    } else {
                        offset..offset + len
                    };
                    self.reply(cookie, offset_u64, Some(range));
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
                    self.reply(cookie, offset_u64, None);
                }
                NBD_CMD_DISC => {
                    self.disconnect = true;
                    *start += HEADER_LEN;
                    return Ok(true);
                }
                _ => self.reply(cookie, offset_u64, None),
            }
            *start += HEADER_LEN;
        }
    }
}

/// Makes the whole input buffer free for the next receive but the incomplete request at
/// `start..end` (moved to the front), as a read buffer refilled whole is.
pub fn compact(inbuf: &mut [u8], start: &mut usize, end: &mut usize) {
    if *start > 0 {
        inbuf.copy_within(*start..*end, 0);
        *end -= *start;
        *start = 0;
    }
}

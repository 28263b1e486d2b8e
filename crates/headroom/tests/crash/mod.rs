//! Helpers of the crash-consistency harness (`crash_consistency.rs`): an NBD connection whose
//! every call returns an error instead of panicking (the server it talks to is killed with
//! SIGKILL at random moments, so a broken connection is an expected outcome, not a test
//! failure), a seeded RNG, and the block contents the writer stamps and the checker recognises.
//! The connection is the tests' one client: the lab's handshake (`common::raw::open_stream`)
//! and `headroom-nbd`'s request and reply framing, only fallible.
#![allow(dead_code)]

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use headroom_lab::LabError;
use headroom_nbd::consts::{NBD_CMD_DISC, NBD_CMD_READ, SIMPLE_REPLY_HEADER_LEN};
use headroom_nbd::{RequestHeader, decode_simple_reply_header, encode_request_header};

use crate::common::raw::open_stream;

/// The granularity of the model: every request is aligned to it.
pub const BLOCK: u64 = 4096;
const MAGIC: &[u8; 8] = b"HRCRASH1";
const HEADER: usize = 32;

fn protocol(what: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.into())
}

/// One NBD connection in transmission phase (simple replies, no structured replies).
pub struct Conn {
    stream: TcpStream,
    pub size_bytes: u64,
    pub transmission_flags: u16,
}

impl Conn {
    /// The lab's handshake (fixed newstyle, NBD_OPT_GO for `export`); a refused export is
    /// `ErrorKind::NotFound`, a broken connection the socket's error.
    pub fn open(addr: SocketAddr, export: &str) -> io::Result<Conn> {
        let (stream, export_info) =
            open_stream(addr, export, Duration::from_secs(60)).map_err(|err| match err {
                LabError::Io { source, .. } => source,
                LabError::GoRefused { .. } => io::Error::new(io::ErrorKind::NotFound, err),
                other => protocol(other.to_string()),
            })?;
        Ok(Conn {
            stream,
            size_bytes: export_info.size_bytes,
            transmission_flags: export_info.transmission_flags,
        })
    }

    /// Sends one request (and its payload for WRITE) without waiting for the reply.
    pub fn send(
        &mut self,
        command: u16,
        flags: u16,
        cookie: u64,
        offset: u64,
        length: u32,
        payload: Option<&[u8]>,
    ) -> io::Result<()> {
        let mut out = Vec::with_capacity(28 + payload.map_or(0, <[u8]>::len));
        encode_request_header(
            &mut out,
            &RequestHeader {
                flags,
                command,
                cookie,
                offset,
                length,
            },
        );
        if let Some(data) = payload {
            out.extend_from_slice(data);
        }
        self.stream.write_all(&out)
    }

    /// Reads one simple reply header: (cookie, error). Only for replies without data.
    pub fn recv(&mut self) -> io::Result<(u64, u32)> {
        let mut header = [0u8; SIMPLE_REPLY_HEADER_LEN];
        self.stream.read_exact(&mut header)?;
        let reply =
            decode_simple_reply_header(&header).map_err(|e| protocol(format!("reply: {e}")))?;
        Ok((reply.cookie, reply.error))
    }

    /// A READ with nothing else in flight on this connection; `Ok(Err(errno))` for an error
    /// reply.
    pub fn read(
        &mut self,
        cookie: u64,
        offset: u64,
        buf: &mut [u8],
    ) -> io::Result<Result<(), u32>> {
        let length = u32::try_from(buf.len()).map_err(|_| protocol("read too large"))?;
        self.send(NBD_CMD_READ, 0, cookie, offset, length, None)?;
        let (got, error) = self.recv()?;
        if got != cookie {
            return Err(protocol(format!(
                "reply for cookie {got}, expected {cookie}"
            )));
        }
        if error != 0 {
            return Ok(Err(error));
        }
        self.stream.read_exact(buf)?;
        Ok(Ok(()))
    }

    /// NBD_CMD_DISC; errors are ignored (the server may be gone).
    pub fn disconnect(mut self) {
        let _ = self.send(NBD_CMD_DISC, 0, u64::MAX, 0, 0, None);
    }
}

/// splitmix64: small, seedable, good enough for choosing operations.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next_u64() % (hi - lo + 1)
    }

    /// True with probability `percent`/100.
    pub fn chance(&mut self, percent: u64) -> bool {
        self.next_u64() % 100 < percent
    }
}

/// Block contents: a header naming (volume uid, block index, tag), then bytes drawn from a
/// fixed noise buffer at an offset derived from the header, so every version of every block
/// differs and data written to one place is recognised wherever it turns up.
pub struct Patterns {
    noise: Vec<u8>,
    pub zero: Vec<u8>,
}

/// What a block read back holds, as far as its header tells.
#[derive(Debug, PartialEq, Eq)]
pub enum Found {
    Zero,
    Stamped { uid: u64, block: u64, tag: u64 },
    Garbage,
}

impl Patterns {
    pub fn new() -> Patterns {
        let mut rng = Rng::new(0x5eed);
        let noise = (0..2 * BLOCK as usize / 8)
            .flat_map(|_| rng.next_u64().to_le_bytes())
            .collect();
        Patterns {
            noise,
            zero: vec![0u8; BLOCK as usize],
        }
    }

    /// Appends the contents of `block` of volume `uid` written by the write tagged `tag`.
    pub fn fill(&self, out: &mut Vec<u8>, uid: u64, block: u64, tag: u64) {
        out.extend_from_slice(MAGIC);
        for word in [uid, block, tag] {
            out.extend_from_slice(&word.to_le_bytes());
        }
        let start = (uid
            .wrapping_mul(31)
            .wrapping_add(block.wrapping_mul(7))
            .wrapping_add(tag)
            % BLOCK) as usize;
        out.extend_from_slice(&self.noise[start..start + BLOCK as usize - HEADER]);
    }

    /// Whether `data` (one block) is exactly what `fill` makes for (uid, block, tag).
    pub fn matches(&self, data: &[u8], uid: u64, block: u64, tag: u64) -> bool {
        let mut expected = Vec::with_capacity(BLOCK as usize);
        self.fill(&mut expected, uid, block, tag);
        data == expected.as_slice()
    }

    pub fn identify(&self, data: &[u8]) -> Found {
        if data == self.zero.as_slice() {
            return Found::Zero;
        }
        if data.len() < HEADER || &data[0..8] != MAGIC {
            return Found::Garbage;
        }
        let word = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&data[8 + 8 * i..16 + 8 * i]);
            u64::from_le_bytes(w)
        };
        Found::Stamped {
            uid: word(0),
            block: word(1),
            tag: word(2),
        }
    }
}

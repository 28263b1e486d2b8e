//! floor_server: the least CPU an NBD server over TCP can spend per request on a machine —
//! a yardstick for the data path work (docs/results.md, "The floor"), not a product.
//!
//! Why it exists: the data path target is a ratio to nbdkit's CPU time per I/O, and part of
//! every server's cost is the kernel's (TCP on loopback, copies, waking a sleeping thread).
//! This server does nothing else: one blocking thread, one connection at a time, no QoS, no
//! statistics, no limits worth the name; it reads as many requests as one `read` returns,
//! answers them all with one `writev` (simple replies only: it refuses structured replies),
//! and serves reads straight from its memory (the kernel's copy is the only one). With
//! `--copy` it first copies each read into a reply buffer, as a real server that cannot lend
//! its storage to the socket does. Whatever it costs per I/O is the floor under any server
//! built on sockets and blocking or epoll wake-ups on that machine.
//!
//! Usage: `cargo run --release -p headroom-nbd --example floor_server -- 127.0.0.1:PORT
//! SIZE_MIB [--copy]`. The export has any name; it lives in RAM, filled with a
//! pseudo-random pattern at start.
//! Trusted clients only: it checks bounds (a bad request ends the connection) and nothing
//! more.

use std::io::{IoSlice, Read, Write};
use std::net::{TcpListener, TcpStream};

use headroom_nbd::consts::{
    IHAVEOPT, NBD_CMD_DISC, NBD_CMD_READ, NBD_CMD_WRITE, NBD_FLAG_FIXED_NEWSTYLE,
    NBD_FLAG_HAS_FLAGS, NBD_FLAG_NO_ZEROES, NBD_FLAG_SEND_FLUSH, NBD_INFO_EXPORT, NBD_OPT_ABORT,
    NBD_OPT_EXPORT_NAME, NBD_OPT_GO, NBD_OPT_INFO, NBD_REP_ACK, NBD_REP_ERR_UNSUP, NBD_REP_INFO,
    NBDMAGIC, OPTION_REPLY_MAGIC, REQUEST_MAGIC, SIMPLE_REPLY_MAGIC,
};

/// Largest payload it accepts (the spec's common 32 MiB).
const MAX_PAYLOAD_BYTES: usize = 32 << 20;
/// Requests per `writev` at most (the kernel's IOV_MAX is 1024 slices).
const MAX_BATCH: usize = 500;
const HEADER_LEN: usize = 28;

fn main() -> std::io::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let usage = || std::io::Error::other("usage: floor_server ADDR SIZE_MIB [--copy]");
    let addr = args.get(1).ok_or_else(usage)?;
    let size_mib: usize = args.get(2).and_then(|s| s.parse().ok()).ok_or_else(usage)?;
    let copy = args.get(3).is_some_and(|a| a == "--copy");
    let mut data = vec![0u8; size_mib << 20];
    // Touched and not zero, so reads come from memory of their own (an untouched zero
    // vector would be one shared zero page, always in cache).
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for chunk in data.chunks_exact_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes());
    }
    let listener = TcpListener::bind(addr)?;
    for stream in listener.incoming() {
        if let Err(err) = serve(stream?, &mut data, copy) {
            eprintln!("floor_server: connection ended: {err}");
        }
    }
    Ok(())
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

fn bad(what: &str) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, what.to_owned())
}

fn serve(mut s: TcpStream, data: &mut [u8], copy: bool) -> std::io::Result<()> {
    s.set_nodelay(true)?;
    let size = data.len() as u64;
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
                option_reply(&mut s, option, NBD_REP_INFO, &info)?;
                option_reply(&mut s, option, NBD_REP_ACK, &[])?;
                if option == NBD_OPT_GO {
                    break;
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
                break;
            }
            NBD_OPT_ABORT => {
                option_reply(&mut s, option, NBD_REP_ACK, &[])?;
                return Ok(());
            }
            _ => option_reply(&mut s, option, NBD_REP_ERR_UNSUP, &[])?,
        }
    }
    transmit(s, data, copy)
}

fn transmit(mut s: TcpStream, data: &mut [u8], copy: bool) -> std::io::Result<()> {
    let mut inbuf = vec![0u8; 1 << 20];
    let (mut start, mut end) = (0usize, 0usize);
    let mut heads: Vec<[u8; 16]> = Vec::with_capacity(MAX_BATCH);
    // Per reply: the range of `data` (or of `copied`) it carries, if any.
    let mut payloads: Vec<Option<(usize, usize)>> = Vec::with_capacity(MAX_BATCH);
    let mut copied: Vec<u8> = Vec::new();
    // Whether the buffer holds no complete request: only then does it read (and block).
    let mut need_more = true;
    loop {
        if need_more {
            if end == inbuf.len() {
                inbuf.copy_within(start..end, 0);
                end -= start;
                start = 0;
            }
            let n = s.read(&mut inbuf[end..])?;
            if n == 0 {
                return Ok(());
            }
            end += n;
        }
        let mut disconnect = false;
        need_more = true;
        loop {
            if heads.len() == MAX_BATCH {
                need_more = false;
                break;
            }
            if end - start < HEADER_LEN {
                break;
            }
            let h = &inbuf[start..start + HEADER_LEN];
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
                    if copy {
                        let at = copied.len();
                        copied.extend_from_slice(&data[offset..offset + len]);
                        payloads.push(Some((at, len)));
                    } else {
                        payloads.push(Some((offset, len)));
                    }
                }
                NBD_CMD_WRITE => {
                    if end - start < HEADER_LEN + len {
                        // The payload is not all here yet: make room and read on.
                        if inbuf.len() < HEADER_LEN + len {
                            inbuf.resize(HEADER_LEN + len, 0);
                        }
                        break;
                    }
                    let body = start + HEADER_LEN;
                    data[offset..offset + len].copy_from_slice(&inbuf[body..body + len]);
                    start += len;
                    payloads.push(None);
                }
                NBD_CMD_DISC => {
                    disconnect = true;
                    start += HEADER_LEN;
                    break;
                }
                _ => payloads.push(None),
            }
            heads.push(head);
            start += HEADER_LEN;
        }
        let source: &[u8] = if copy { &copied } else { data };
        let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(2 * heads.len());
        for (head, payload) in heads.iter().zip(&payloads) {
            slices.push(IoSlice::new(head));
            if let Some((at, len)) = payload {
                slices.push(IoSlice::new(&source[*at..*at + *len]));
            }
        }
        write_all_vectored(&mut s, &mut slices)?;
        drop(slices);
        heads.clear();
        payloads.clear();
        copied.clear();
        if disconnect {
            return Ok(());
        }
        if start == end {
            start = 0;
            end = 0;
        }
    }
}

fn write_all_vectored(s: &mut TcpStream, mut slices: &mut [IoSlice<'_>]) -> std::io::Result<()> {
    while !slices.is_empty() {
        let n = s.write_vectored(slices)?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        IoSlice::advance_slices(&mut slices, n);
    }
    Ok(())
}

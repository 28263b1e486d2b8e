//! floor_server: the least CPU an NBD server over TCP can spend per request on a machine —
//! a yardstick for the data path work (docs/results.md, "The floor"), not a product.
//!
//! Why it exists: the data path target is a ratio to nbdkit's CPU time per I/O, and part of
//! every server's cost is the kernel's (TCP on loopback, copies, waking a sleeping thread).
//! This server does nothing else: one blocking thread, one connection at a time, no QoS, no
//! statistics, no limits worth the name; it reads as many requests as one `read` returns,
//! answers them all with one `writev` (structured replies, as Headroom sends them, unless
//! `--simple` refuses them; `floor/mod.rs` says what is alike and what is not), and serves
//! reads straight from its memory (the kernel's copy is the only one). With
//! `--copy` it first copies each read into a reply buffer, as a real server that cannot lend
//! its storage to the socket does. Whatever it costs per I/O is the floor under any server
//! built on sockets and blocking or epoll wake-ups on that machine.
//!
//! Usage: `cargo run --release -p headroom-nbd --example floor_server -- 127.0.0.1:PORT
//! SIZE_MIB [--copy] [--simple]`. The export has any name; it lives in RAM, filled with a
//! pseudo-random pattern at start.
//! Trusted clients only: it checks bounds (a bad request ends the connection) and nothing
//! more.
//!
//! `floor_server_uring` is the same server with its transmission phase on io_uring; the
//! handshake and the request parser are shared, in `floor/mod.rs`.

use std::io::{IoSlice, Read, Write};
use std::net::{TcpListener, TcpStream};

mod floor;

fn main() -> std::io::Result<()> {
    let (addr, size_mib, flags) = floor::args("floor_server ADDR SIZE_MIB [--copy] [--simple]")?;
    let copy = flags.iter().any(|a| a == "--copy");
    let allow_structured = floor::structured_allowed(&flags);
    let mut data = floor::export(size_mib);
    let listener = TcpListener::bind(addr)?;
    for stream in listener.incoming() {
        if let Err(err) = serve(stream?, &mut data, copy, allow_structured) {
            eprintln!("floor_server: connection ended: {err}");
        }
    }
    Ok(())
}

fn serve(
    mut s: TcpStream,
    data: &mut [u8],
    copy: bool,
    allow_structured: bool,
) -> std::io::Result<()> {
    match floor::handshake(&mut s, data.len() as u64, allow_structured)? {
        Some(structured) => transmit(s, data, floor::Batch::new(copy, structured)),
        None => Ok(()),
    }
}

fn transmit(mut s: TcpStream, data: &mut [u8], mut batch: floor::Batch) -> std::io::Result<()> {
    let mut inbuf = vec![0u8; floor::INBUF_BYTES];
    let (mut start, mut end) = (0usize, 0usize);
    // Whether the buffer holds no complete request: only then does it read (and block).
    let mut need_more = true;
    loop {
        if need_more {
            floor::compact(&mut inbuf, &mut start, &mut end);
            let n = s.read(&mut inbuf[end..])?;
            if n == 0 {
                return Ok(());
            }
            end += n;
        }
        need_more = batch.parse(&mut inbuf, &mut start, end, data)?;
        if !batch.is_empty() {
            write_all_vectored(&mut s, &mut batch.slices(data))?;
            batch.clear();
        }
        if batch.disconnect {
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

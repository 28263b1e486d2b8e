//! Bad input over the wire: each case sends raw bytes no well-behaved client would, checks the
//! answer the NBD spec names, and then checks that the server still serves a good client.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers panic on failure by design

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use common::Server;
use common::raw::*;
use headroom_nbd::consts::*;
use headroom_nbd::encode_option_header;

const VOLUME_BYTES: u64 = 16 << 20;

fn server() -> (tempfile::TempDir, Server) {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_memory(&dir.path().join("mem"), "1GiB");
    server.create_volume("vol", "16MiB");
    (dir, server)
}

/// A well-behaved client can still connect, write, read back and flush.
fn still_serves(server: &Server) {
    let mut client = Client::open(server.nbd, "vol");
    assert_eq!(client.size_bytes, VOLUME_BYTES);
    let data = vec![0x5au8; 4096];
    assert_eq!(client.write(1, 4096, &data, 0), 0);
    assert_eq!(client.read(2, 4096, 4096).unwrap(), data);
    assert_eq!(client.flush(3), 0);
    client.disconnect();
}

/// True when the server closed the connection (EOF or reset), false if it sent something.
fn closed_by_server(stream: &mut TcpStream) -> bool {
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let mut byte = [0u8; 1];
    match stream.read(&mut byte) {
        Ok(0) => true,
        Ok(_) => false,
        Err(err) => matches!(
            err.kind(),
            std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe
        ),
    }
}

#[test]
fn handshake_garbage_closes_only_that_connection() {
    let (_dir, server) = server();

    // Unknown client flags: the server must close the connection.
    let mut stream = connect(server.nbd);
    let mut greeting = [0u8; 18];
    stream.read_exact(&mut greeting).unwrap();
    stream.write_all(&0xffff_fff0u32.to_be_bytes()).unwrap();
    assert!(
        closed_by_server(&mut stream),
        "unknown client flags accepted"
    );
    still_serves(&server);

    // Garbage where an option header should be.
    let mut stream = connect(server.nbd);
    greet(&mut stream);
    stream.write_all(b"this is not an NBD option!").unwrap();
    assert!(closed_by_server(&mut stream), "garbage option accepted");
    still_serves(&server);

    // An option claiming 4 GiB of data: refused as too big, and the connection is dropped
    // rather than reading gigabytes.
    let mut stream = connect(server.nbd);
    greet(&mut stream);
    let mut header = Vec::new();
    encode_option_header(&mut header, NBD_OPT_GO, u32::MAX);
    stream.write_all(&header).unwrap();
    let reply = read_option_reply(&mut stream);
    assert_eq!(reply.reply_type, NBD_REP_ERR_TOO_BIG);
    assert!(closed_by_server(&mut stream));
    still_serves(&server);
}

#[test]
fn unknown_option_then_go_on_the_same_connection() {
    let (_dir, server) = server();
    let mut stream = connect(server.nbd);
    greet(&mut stream);
    send_option(&mut stream, 0x00ab_cdef, b"whatever");
    let reply = read_option_reply(&mut stream);
    assert_eq!(reply.option, 0x00ab_cdef);
    assert_eq!(reply.reply_type, NBD_REP_ERR_UNSUP);

    // GO for a missing export is refused with ERR_UNKNOWN, and the haggling goes on.
    assert_eq!(go(&mut stream, "missing"), Err(NBD_REP_ERR_UNKNOWN));
    let (size, _flags) = go(&mut stream, "vol").expect("GO after refusals");
    assert_eq!(size, VOLUME_BYTES);
    let mut client = Client {
        stream,
        size_bytes: size,
        transmission_flags: 0,
    };
    assert_eq!(client.read(7, 0, 512).unwrap(), vec![0u8; 512]);
    client.disconnect();
    still_serves(&server);
}

#[test]
fn export_name_for_a_missing_export_closes() {
    let (_dir, server) = server();
    let mut stream = connect(server.nbd);
    greet(&mut stream);
    send_option(&mut stream, NBD_OPT_EXPORT_NAME, b"missing");
    assert!(closed_by_server(&mut stream));
    still_serves(&server);
}

#[test]
fn invalid_requests_get_the_spec_errno_and_the_connection_survives() {
    let (_dir, server) = server();
    let mut client = Client::open(server.nbd, "vol");

    // Read past the end: EINVAL.
    assert_eq!(client.read(1, VOLUME_BYTES - 512, 4096), Err(NBD_EINVAL));
    // Write past the end: ENOSPC (payload consumed, connection in sync).
    assert_eq!(
        client.write(2, VOLUME_BYTES - 512, &[1u8; 4096], 0),
        NBD_ENOSPC
    );
    // offset + length overflows 64 bits.
    assert_eq!(client.read(3, u64::MAX - 100, 4096), Err(NBD_EINVAL));
    assert_eq!(client.write(4, u64::MAX - 100, &[1u8; 4096], 0), NBD_EINVAL);
    // Unknown command.
    client.send_request(0, 99, 5, 0, 0);
    let reply = client.read_simple_reply();
    assert_eq!((reply.cookie, reply.error), (5, NBD_EINVAL));
    // Unknown flag on a READ.
    client.send_request(0x4000, NBD_CMD_READ, 6, 0, 4096);
    let reply = client.read_simple_reply();
    assert_eq!((reply.cookie, reply.error), (6, NBD_EINVAL));
    // A 256 MiB read is over the advertised 32 MiB maximum.
    assert_eq!(client.read(7, 0, 256 << 20), Err(NBD_EINVAL));
    // And the same connection still works.
    assert_eq!(client.write(8, 0, &[9u8; 4096], 0), 0);
    assert_eq!(client.read(9, 0, 4096).unwrap(), vec![9u8; 4096]);
    client.disconnect();
    still_serves(&server);
}

#[test]
fn oversized_write_then_hang_up() {
    let (_dir, server) = server();
    let mut client = Client::open(server.nbd, "vol");
    // Announce a 4 GiB - 1 payload, send a little, and vanish.
    client.send_request(0, NBD_CMD_WRITE, 1, 0, u32::MAX);
    client.stream.write_all(&[0xeeu8; 65536]).unwrap();
    drop(client);
    still_serves(&server);
    // Nothing of it was written.
    let mut reader = Client::open(server.nbd, "vol");
    assert_eq!(reader.read(2, 8192, 65536).unwrap(), vec![0u8; 65536]);
    reader.disconnect();
}

#[test]
fn write_cut_off_mid_payload_is_not_applied() {
    let (_dir, server) = server();
    let mut client = Client::open(server.nbd, "vol");
    client.send_request(0, NBD_CMD_WRITE, 1, 1 << 20, 65536);
    client.stream.write_all(&[0x77u8; 1000]).unwrap();
    drop(client);
    still_serves(&server);
    let mut reader = Client::open(server.nbd, "vol");
    assert_eq!(reader.read(2, 1 << 20, 65536).unwrap(), vec![0u8; 65536]);
    reader.disconnect();
}

#[test]
fn bad_request_magic_closes_the_connection() {
    let (_dir, server) = server();
    let mut client = Client::open(server.nbd, "vol");
    client.stream.write_all(&[0xabu8; 28]).unwrap();
    assert!(closed_by_server(&mut client.stream));
    still_serves(&server);
}

fn rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kib * 1024
}

#[test]
fn pipelined_reads_whose_replies_are_never_read_stay_bounded() {
    let (_dir, server) = server();
    let rss_before = rss_bytes(server.pid());
    let mut client = Client::open(server.nbd, "vol");
    client
        .stream
        .set_write_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut requests = Vec::with_capacity(20_000 * 28);
    for cookie in 0..20_000u64 {
        push_request(
            &mut requests,
            0,
            NBD_CMD_READ,
            cookie,
            (cookie % 4096) * 4096,
            64u32 << 10,
        );
    }
    // The server stops reading once its per-connection budget is held by unsent replies, so
    // this write may time out part-way; either way we never read a reply.
    let _ = client.stream.write_all(&requests);
    still_serves(&server);
    // 20,000 x 64 KiB would be 1.25 GiB if the server buffered them all.
    let rss_after = rss_bytes(server.pid());
    assert!(
        rss_after < rss_before + (300 << 20),
        "server grew from {rss_before} to {rss_after} bytes"
    );
    drop(client);
    still_serves(&server);
}

#[test]
fn too_many_connections_are_refused_without_harming_others() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_with(
        &dir.path().join("mem"),
        &["--memory", "1GiB", "--max-connections", "4"],
    );
    server.create_volume("vol", "16MiB");
    let held: Vec<Client> = (0..4).map(|_| Client::open(server.nbd, "vol")).collect();
    let mut extra = connect(server.nbd);
    assert!(closed_by_server(&mut extra), "fifth connection was served");
    drop(held);
    // Slots are released when clients leave; poll until one is free again (the server notices
    // the hang-ups asynchronously).
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let mut served = false;
    while !served && std::time::Instant::now() < deadline {
        let mut stream = connect(server.nbd);
        let mut greeting = [0u8; 18];
        // Each attempt waits for the server's answer: a greeting, or a close while full.
        served = stream.read_exact(&mut greeting).is_ok();
    }
    assert!(served, "no connection slot came back");
    still_serves(&server);
}

//! Option negotiation and structured replies byte by byte: the paths real clients take
//! (nbdinfo, qemu, libnbd) checked without them, so a regression names the exact reply.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers panic on failure by design

mod common;

use std::io::{Read, Write};

use common::Server;
use common::raw::*;
use headroom_nbd::consts::*;

fn be16(b: &[u8]) -> u16 {
    u16::from_be_bytes(b[..2].try_into().unwrap())
}
fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes(b[..4].try_into().unwrap())
}
fn be64(b: &[u8]) -> u64 {
    u64::from_be_bytes(b[..8].try_into().unwrap())
}

fn start() -> (tempfile::TempDir, Server) {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start_memory(&dir.path().join("mem"), "1GiB");
    server.create_volume("vol", "8MiB");
    server.create_volume("other", "4MiB");
    (dir, server)
}

#[test]
fn list_info_and_repeated_options() {
    let (_dir, server) = start();
    let mut stream = connect(server.nbd);
    greet(&mut stream);

    // LIST: one REP_SERVER per volume, then ACK.
    send_option(&mut stream, NBD_OPT_LIST, &[]);
    let mut names = Vec::new();
    loop {
        let reply = read_option_reply(&mut stream);
        assert_eq!(reply.option, NBD_OPT_LIST);
        if reply.reply_type == NBD_REP_ACK {
            break;
        }
        assert_eq!(reply.reply_type, NBD_REP_SERVER);
        let len = be32(&reply.data) as usize;
        names.push(String::from_utf8(reply.data[4..4 + len].to_vec()).unwrap());
    }
    names.sort();
    assert_eq!(names, vec!["other", "vol"]);

    // LIST with data is invalid, and haggling continues.
    send_option(&mut stream, NBD_OPT_LIST, b"junk");
    assert_eq!(
        read_option_reply(&mut stream).reply_type,
        NBD_REP_ERR_INVALID
    );

    // INFO asking for name, description and block size.
    let mut payload = go_payload("vol");
    payload.truncate(payload.len() - 2);
    payload.extend_from_slice(&3u16.to_be_bytes());
    for info in [NBD_INFO_NAME, NBD_INFO_DESCRIPTION, NBD_INFO_BLOCK_SIZE] {
        payload.extend_from_slice(&info.to_be_bytes());
    }
    send_option(&mut stream, NBD_OPT_INFO, &payload);
    let mut seen = std::collections::BTreeMap::new();
    loop {
        let reply = read_option_reply(&mut stream);
        if reply.reply_type == NBD_REP_ACK {
            break;
        }
        assert_eq!(reply.reply_type, NBD_REP_INFO);
        seen.insert(be16(&reply.data), reply.data[2..].to_vec());
    }
    let export = &seen[&0];
    assert_eq!(be64(export), 8 << 20);
    assert_eq!(&seen[&NBD_INFO_NAME][..], b"vol");
    assert!(String::from_utf8_lossy(&seen[&NBD_INFO_DESCRIPTION]).contains("vol"));
    let block = &seen[&NBD_INFO_BLOCK_SIZE];
    assert_eq!(
        (be32(block), be32(&block[4..]), be32(&block[8..])),
        (1, 4096, 32 << 20)
    );

    // Structured replies twice: the second is refused.
    send_option(&mut stream, NBD_OPT_STRUCTURED_REPLY, &[]);
    assert_eq!(read_option_reply(&mut stream).reply_type, NBD_REP_ACK);
    send_option(&mut stream, NBD_OPT_STRUCTURED_REPLY, &[]);
    assert_eq!(
        read_option_reply(&mut stream).reply_type,
        NBD_REP_ERR_INVALID
    );

    // ABORT is acknowledged and the server closes.
    send_option(&mut stream, NBD_OPT_ABORT, &[]);
    assert_eq!(read_option_reply(&mut stream).reply_type, NBD_REP_ACK);
    let mut byte = [0u8; 1];
    assert_eq!(stream.read(&mut byte).unwrap(), 0);
}

#[test]
fn structured_replies_and_block_status() {
    let (_dir, server) = start();
    let mut stream = connect(server.nbd);
    greet(&mut stream);

    // SET_META_CONTEXT before structured replies is invalid.
    send_option(
        &mut stream,
        NBD_OPT_SET_META_CONTEXT,
        &meta_payload("vol", &["base:allocation"]),
    );
    assert_eq!(
        read_option_reply(&mut stream).reply_type,
        NBD_REP_ERR_INVALID
    );

    send_option(&mut stream, NBD_OPT_STRUCTURED_REPLY, &[]);
    assert_eq!(read_option_reply(&mut stream).reply_type, NBD_REP_ACK);

    // LIST_META_CONTEXT with no queries lists base:allocation.
    send_option(
        &mut stream,
        NBD_OPT_LIST_META_CONTEXT,
        &meta_payload("vol", &[]),
    );
    let reply = read_option_reply(&mut stream);
    assert_eq!(reply.reply_type, NBD_REP_META_CONTEXT);
    assert_eq!(&reply.data[4..], b"base:allocation");
    assert_eq!(read_option_reply(&mut stream).reply_type, NBD_REP_ACK);

    // An unknown context is simply not selected; base:allocation is.
    send_option(
        &mut stream,
        NBD_OPT_SET_META_CONTEXT,
        &meta_payload("vol", &["qemu:dirty-bitmap:x", "base:allocation"]),
    );
    let reply = read_option_reply(&mut stream);
    assert_eq!(reply.reply_type, NBD_REP_META_CONTEXT);
    let context_id = be32(&reply.data);
    assert_eq!(&reply.data[4..], b"base:allocation");
    assert_eq!(read_option_reply(&mut stream).reply_type, NBD_REP_ACK);

    let (size, flags) = go(&mut stream, "vol").unwrap();
    assert_eq!(size, 8 << 20);
    assert_ne!(
        flags & NBD_FLAG_SEND_DF,
        0,
        "DF advertised with structured replies"
    );
    let mut client = Client {
        stream,
        size_bytes: size,
        transmission_flags: flags,
    };

    // Write 4 KiB at 3 MiB (second extent); read it back as one OFFSET_DATA chunk.
    client.send_request(0, NBD_CMD_WRITE, 1, 3 << 20, 4096);
    client.stream.write_all(&[0x42u8; 4096]).unwrap();
    let done = read_chunk(&mut client.stream);
    assert_eq!(
        (done.chunk_type, done.flags, done.cookie),
        (NBD_REPLY_TYPE_NONE, NBD_REPLY_FLAG_DONE, 1)
    );

    client.send_request(0, NBD_CMD_READ, 2, 3 << 20, 4096);
    let data = read_chunk(&mut client.stream);
    assert_eq!(
        (data.chunk_type, data.flags, data.cookie),
        (NBD_REPLY_TYPE_OFFSET_DATA, NBD_REPLY_FLAG_DONE, 2)
    );
    assert_eq!(be64(&data.payload), 3 << 20);
    assert!(data.payload[8..].iter().all(|&b| b == 0x42));

    // A read of a hole is one OFFSET_HOLE chunk (offset, length) and no zeros on the wire...
    client.send_request(0, NBD_CMD_READ, 7, 5 << 20, 65536);
    let hole = read_chunk(&mut client.stream);
    assert_eq!(
        (hole.chunk_type, hole.flags, hole.cookie),
        (NBD_REPLY_TYPE_OFFSET_HOLE, NBD_REPLY_FLAG_DONE, 7)
    );
    assert_eq!(hole.payload.len(), 12);
    assert_eq!(
        (be64(&hole.payload), be32(&hole.payload[8..])),
        (5 << 20, 65536)
    );
    // ...unless the client asks for one data chunk (DF): then the zeros come as data.
    client.send_request(NBD_CMD_FLAG_DF, NBD_CMD_READ, 8, 5 << 20, 4096);
    let zeros = read_chunk(&mut client.stream);
    assert_eq!(
        (zeros.chunk_type, zeros.flags, zeros.cookie),
        (NBD_REPLY_TYPE_OFFSET_DATA, NBD_REPLY_FLAG_DONE, 8)
    );
    assert_eq!(zeros.payload.len(), 8 + 4096);
    assert!(zeros.payload[8..].iter().all(|&b| b == 0));
    // A read that covers data and hole is data (zeros included).
    client.send_request(0, NBD_CMD_READ, 9, (4 << 20) - 4096, 8192);
    let mixed = read_chunk(&mut client.stream);
    assert_eq!(mixed.chunk_type, NBD_REPLY_TYPE_OFFSET_DATA);
    assert_eq!(mixed.payload.len(), 8 + 8192);

    // Block status over the whole volume: hole, data (the 2 MiB extent), hole.
    client.send_request(0, NBD_CMD_BLOCK_STATUS, 3, 0, 8 << 20);
    let status = read_chunk(&mut client.stream);
    assert_eq!(
        (status.chunk_type, status.flags, status.cookie),
        (NBD_REPLY_TYPE_BLOCK_STATUS, NBD_REPLY_FLAG_DONE, 3)
    );
    assert_eq!(be32(&status.payload), context_id);
    let extents: Vec<(u32, u32)> = status.payload[4..]
        .chunks(8)
        .map(|c| (be32(c), be32(&c[4..])))
        .collect();
    assert_eq!(extents, vec![(2 << 20, 3), (2 << 20, 0), (4 << 20, 3)]);

    // REQ_ONE: exactly one extent, not longer than asked.
    client.send_request(
        NBD_CMD_FLAG_REQ_ONE,
        NBD_CMD_BLOCK_STATUS,
        4,
        1 << 20,
        2 << 20,
    );
    let status = read_chunk(&mut client.stream);
    assert_eq!(status.payload.len(), 4 + 8);
    assert_eq!(
        (be32(&status.payload[4..]), be32(&status.payload[8..])),
        (1 << 20, 3)
    );

    // Errors arrive as structured error chunks with the errno.
    client.send_request(0, NBD_CMD_READ, 5, 8 << 20, 4096);
    let error = read_chunk(&mut client.stream);
    assert_eq!(
        (error.chunk_type, error.flags, error.cookie),
        (NBD_REPLY_TYPE_ERROR, NBD_REPLY_FLAG_DONE, 5)
    );
    assert_eq!(be32(&error.payload), NBD_EINVAL);

    // A zero-length read is answered with a lone NONE chunk.
    client.send_request(0, NBD_CMD_READ, 6, 0, 0);
    let none = read_chunk(&mut client.stream);
    assert_eq!(
        (none.chunk_type, none.flags, none.cookie),
        (NBD_REPLY_TYPE_NONE, NBD_REPLY_FLAG_DONE, 6)
    );

    // Pipelined requests each get exactly one final chunk, whatever the order.
    for cookie in 10..42u64 {
        client.send_request(0, NBD_CMD_READ, cookie, (cookie % 8) << 20, 65536);
    }
    let mut cookies: Vec<u64> = (10..42)
        .map(|_| {
            let chunk = read_chunk(&mut client.stream);
            assert_eq!(chunk.flags & NBD_REPLY_FLAG_DONE, NBD_REPLY_FLAG_DONE);
            // Only the second extent (2-4 MiB) holds data; the rest reads as holes.
            let offset = (chunk.cookie % 8) << 20;
            if (2 << 20..4 << 20).contains(&offset) {
                assert_eq!(chunk.chunk_type, NBD_REPLY_TYPE_OFFSET_DATA);
                assert_eq!(chunk.payload.len(), 8 + 65536);
            } else {
                assert_eq!(chunk.chunk_type, NBD_REPLY_TYPE_OFFSET_HOLE);
                assert_eq!(chunk.payload.len(), 12);
            }
            chunk.cookie
        })
        .collect();
    cookies.sort_unstable();
    assert_eq!(cookies, (10..42).collect::<Vec<_>>());
    client.disconnect();
}

#[test]
fn trim_and_write_zeroes_release_extents() {
    let (_dir, server) = start();
    let mut client = Client::open(server.nbd, "vol");
    let data = vec![0x11u8; 2 << 20];
    assert_eq!(client.write(1, 0, &data, 0), 0);
    assert_eq!(client.write(2, 2 << 20, &data, 0), 0);
    let allocated = |server: &Server| -> u64 {
        let out = server.cli(&["volume", "show", "vol", "--json"]);
        let info: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        info["allocated_bytes"].as_u64().unwrap()
    };
    assert_eq!(allocated(&server), 4 << 20);

    client.send_request(0, NBD_CMD_TRIM, 3, 0, 2 << 20);
    assert_eq!(client.read_simple_reply().error, 0);
    assert_eq!(allocated(&server), 2 << 20);
    assert_eq!(client.read(4, 0, 4096).unwrap(), vec![0u8; 4096]);

    client.send_request(0, NBD_CMD_WRITE_ZEROES, 5, 2 << 20, 2 << 20);
    assert_eq!(client.read_simple_reply().error, 0);
    assert_eq!(allocated(&server), 0);
    assert_eq!(client.read(6, 3 << 20, 4096).unwrap(), vec![0u8; 4096]);

    // FAST_ZERO with NO_HOLE cannot be faster than writing: ENOTSUP, as the spec asks.
    client.send_request(
        NBD_CMD_FLAG_NO_HOLE | NBD_CMD_FLAG_FAST_ZERO,
        NBD_CMD_WRITE_ZEROES,
        7,
        0,
        4096,
    );
    assert_eq!(client.read_simple_reply().error, NBD_ENOTSUP);
    client.disconnect();
}

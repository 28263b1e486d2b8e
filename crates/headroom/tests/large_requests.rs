//! Requests without payload larger than the maximum block size.
//!
//! Why: the 32 MiB maximum block size bounds what a READ or WRITE makes the server hold, but
//! WRITE_ZEROES, TRIM and CACHE carry no payload, and real clients send them larger (nbdfuse
//! forwards mkfs.ext4's whole-device zeroing as one request). The server accepts them up to
//! the export size and runs them as bounded pieces; these tests check at the byte level that
//! the whole range is affected, that nothing next to it is, and that out-of-range requests get
//! the errno the spec names without touching anything. Every case runs with the QoS scheduler
//! (pieces are scheduled one by one) and without it (`--policy off`), on both backends.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers panic on failure by design

mod common;

use common::Server;
use common::raw::*;
use headroom_nbd::consts::*;

const MIB: u64 = 1 << 20;
/// The volume: four times the maximum block size.
const VOLUME_BYTES: u64 = 128 * MIB;

/// Deterministic, nonzero bytes for absolute volume offset `offset`.
fn pattern_byte(offset: u64) -> u8 {
    ((offset.wrapping_mul(0x9e37_79b9) >> 13) as u8) | 1
}

fn fill(client: &mut Client) {
    let chunk = 16 * MIB;
    for (cookie, offset) in (0..VOLUME_BYTES).step_by(chunk as usize).enumerate() {
        let data: Vec<u8> = (offset..offset + chunk).map(pattern_byte).collect();
        assert_eq!(client.write(100 + cookie as u64, offset, &data, 0), 0);
    }
}

/// Reads the whole volume and checks: zeros in `zeroed` ranges, the pattern elsewhere.
fn check(client: &mut Client, zeroed: &[(u64, u64)], what: &str) {
    let chunk = 16 * MIB;
    for offset in (0..VOLUME_BYTES).step_by(chunk as usize) {
        let data = client.read(900, offset, chunk as u32).unwrap();
        for (i, byte) in data.iter().enumerate() {
            let at = offset + i as u64;
            let zero = zeroed
                .iter()
                .any(|&(start, len)| at >= start && at < start + len);
            let want = if zero { 0 } else { pattern_byte(at) };
            assert_eq!(
                *byte, want,
                "{what}: byte at {at} is {byte:#x}, expected {want:#x}"
            );
        }
    }
}

fn request(
    client: &mut Client,
    command: u16,
    flags: u16,
    cookie: u64,
    offset: u64,
    len: u32,
) -> u32 {
    client.send_request(flags, command, cookie, offset, len);
    let reply = client.read_simple_reply();
    assert_eq!(reply.cookie, cookie);
    reply.error
}

fn servers(dir: &std::path::Path) -> Vec<(&'static str, Server)> {
    vec![
        (
            "memory, burst scheduler",
            Server::start_memory(&dir.join("mem-burst"), "1GiB"),
        ),
        (
            "memory, no scheduler",
            Server::start_with(
                &dir.join("mem-off"),
                &["--memory", "1GiB", "--policy", "off"],
            ),
        ),
        ("files, burst scheduler", Server::start(&dir.join("files"))),
    ]
}

#[test]
fn write_zeroes_and_trim_of_64_mib_affect_exactly_their_range() {
    let dir = tempfile::tempdir().unwrap();
    for (name, server) in servers(dir.path()) {
        server.create_volume("vol", "128MiB");
        let mut client = Client::open(server.nbd, "vol");
        assert_eq!(client.size_bytes, VOLUME_BYTES);
        fill(&mut client);

        // Unaligned on both ends, crossing piece and extent boundaries.
        let punch = (5 * MIB + 4096 + 512, 64 * MIB as u32);
        assert_eq!(
            request(&mut client, NBD_CMD_WRITE_ZEROES, 0, 1, punch.0, punch.1),
            0,
            "{name}: 64 MiB WRITE_ZEROES"
        );
        check(&mut client, &[(punch.0, u64::from(punch.1))], name);

        // NO_HOLE: zeros are written, not punched.
        fill(&mut client);
        let written = (MIB + 7, 64 * MIB as u32 + 3);
        assert_eq!(
            request(
                &mut client,
                NBD_CMD_WRITE_ZEROES,
                NBD_CMD_FLAG_NO_HOLE | NBD_CMD_FLAG_FUA,
                2,
                written.0,
                written.1
            ),
            0,
            "{name}: 64 MiB WRITE_ZEROES with NO_HOLE and FUA"
        );
        check(&mut client, &[(written.0, u64::from(written.1))], name);

        // TRIM: Headroom punches, so the range reads as zeros too.
        fill(&mut client);
        let trimmed = (40 * MIB - 4096, 64 * MIB as u32);
        assert_eq!(
            request(&mut client, NBD_CMD_TRIM, 0, 3, trimmed.0, trimmed.1),
            0,
            "{name}: 64 MiB TRIM"
        );
        check(&mut client, &[(trimmed.0, u64::from(trimmed.1))], name);

        // CACHE of 64 MiB is accepted and changes nothing.
        assert_eq!(
            request(&mut client, NBD_CMD_CACHE, 0, 4, MIB, 64 * MIB as u32),
            0
        );
        check(&mut client, &[(trimmed.0, u64::from(trimmed.1))], name);
        client.disconnect();
        server.stop();
    }
}

#[test]
fn whole_volume_zeroing_and_trimming_free_everything() {
    let dir = tempfile::tempdir().unwrap();
    for (name, server) in servers(dir.path()) {
        server.create_volume("vol", "128MiB");
        let mut client = Client::open(server.nbd, "vol");
        let whole = VOLUME_BYTES as u32;

        fill(&mut client);
        assert_eq!(
            request(
                &mut client,
                NBD_CMD_WRITE_ZEROES,
                NBD_CMD_FLAG_NO_HOLE,
                1,
                0,
                whole
            ),
            0,
            "{name}: whole-volume WRITE_ZEROES with NO_HOLE"
        );
        check(&mut client, &[(0, VOLUME_BYTES)], name);

        fill(&mut client);
        assert_eq!(
            request(
                &mut client,
                NBD_CMD_WRITE_ZEROES,
                NBD_CMD_FLAG_FUA,
                2,
                0,
                whole
            ),
            0,
            "{name}: whole-volume WRITE_ZEROES"
        );
        check(&mut client, &[(0, VOLUME_BYTES)], name);
        assert_eq!(
            allocated_bytes(&server),
            0,
            "{name}: zeroing released the extents"
        );

        fill(&mut client);
        assert_eq!(
            request(&mut client, NBD_CMD_TRIM, 0, 3, 0, whole),
            0,
            "{name}: whole-volume TRIM"
        );
        check(&mut client, &[(0, VOLUME_BYTES)], name);
        assert_eq!(
            allocated_bytes(&server),
            0,
            "{name}: trim released the extents"
        );
        assert_eq!(client.flush(4), 0);
        client.disconnect();
        server.stop();
    }
}

#[test]
fn large_requests_past_the_end_get_the_spec_errno_and_change_nothing() {
    let dir = tempfile::tempdir().unwrap();
    for (name, server) in servers(dir.path()) {
        server.create_volume("vol", "128MiB");
        let mut client = Client::open(server.nbd, "vol");
        fill(&mut client);
        let whole = VOLUME_BYTES as u32;
        // "SHOULD return NBD_ENOSPC if it receives a write zeroes request including one or
        // more sectors beyond the size of the device"; TRIM (and CACHE, like READ): EINVAL.
        let cases = [
            (NBD_CMD_WRITE_ZEROES, 0, 512, whole, NBD_ENOSPC),
            (
                NBD_CMD_WRITE_ZEROES,
                NBD_CMD_FLAG_NO_HOLE,
                64 * MIB,
                64 * MIB as u32 + 1,
                NBD_ENOSPC,
            ),
            (NBD_CMD_WRITE_ZEROES, 0, 0, u32::MAX, NBD_ENOSPC),
            (NBD_CMD_TRIM, 0, 512, whole, NBD_EINVAL),
            (NBD_CMD_TRIM, 0, 0, u32::MAX, NBD_EINVAL),
            (NBD_CMD_CACHE, 0, 512, whole, NBD_EINVAL),
            (
                NBD_CMD_WRITE_ZEROES,
                0,
                u64::MAX - MIB,
                64 * MIB as u32,
                NBD_EINVAL,
            ),
        ];
        for (cookie, &(command, flags, offset, len, errno)) in cases.iter().enumerate() {
            assert_eq!(
                request(&mut client, command, flags, cookie as u64, offset, len),
                errno,
                "{name}: command {command} at {offset}+{len}"
            );
        }
        check(&mut client, &[], name);
        // READ and WRITE stay bounded by the maximum block size.
        assert_eq!(client.read(50, 0, 64 * MIB as u32), Err(NBD_EINVAL));
        client.disconnect();
        server.stop();
    }
}

fn allocated_bytes(server: &Server) -> u64 {
    let out = server.cli(&["volume", "show", "vol", "--json"]);
    assert!(out.status.success(), "{}", common::text(&out));
    let info: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    info["allocated_bytes"].as_u64().unwrap()
}

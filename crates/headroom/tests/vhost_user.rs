//! End-to-end: a volume attached to a vhost-user-blk socket with the real binary's CLI
//! (`volume attach NAME --vhost-user PATH`), driven by the lab's vhost-user frontend
//! (`headroom_lab::vhost_user`: the protocol over the socket, a memfd as guest memory),
//! restored after `kill -9` with the stale socket replaced, and detached (`volume detach`).
#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers panic on failure by design

mod common;

use std::os::unix::fs::{FileTypeExt, PermissionsExt};

use common::{Server, text};
use headroom_lab::vhost_user::{BlkOp, ClientOptions, S_OK, VhostUserBlkClient};

#[test]
fn attach_serves_a_volume_survives_kill_9_and_detach_removes_the_socket() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let sock = dir.path().join("disk.sock");
    let sock_arg = sock.to_str().unwrap();
    let server = Server::start(&data);
    server.create_volume("disk", "64MiB");
    // A regular file at the path is refused and kept; nothing else is touched.
    let image = dir.path().join("image.raw");
    std::fs::write(&image, b"keep").unwrap();
    let refused = server.cli(&[
        "volume",
        "attach",
        "disk",
        "--vhost-user",
        image.to_str().unwrap(),
    ]);
    assert!(!refused.status.success(), "{}", text(&refused));
    assert!(
        text(&refused).contains("not a socket"),
        "{}",
        text(&refused)
    );
    assert_eq!(std::fs::read(&image).unwrap(), b"keep");
    let out = server.cli(&[
        "volume",
        "attach",
        "disk",
        "--vhost-user",
        sock_arg,
        "--num-queues",
        "2",
        "--mode",
        "0660",
    ]);
    assert!(out.status.success(), "{}", text(&out));
    let meta = std::fs::metadata(&sock).unwrap();
    assert!(meta.file_type().is_socket());
    assert_eq!(meta.permissions().mode() & 0o777, 0o660);
    let options = ClientOptions {
        num_queues: 2,
        ..ClientOptions::default()
    };
    let written: Vec<u8> = (0..8192u32).map(|i| (i % 251) as u8).collect();
    {
        let mut client = VhostUserBlkClient::connect(&sock, options).unwrap();
        let done = client
            .call(
                1,
                &BlkOp::Write {
                    offset: 4096,
                    data: written.clone(),
                },
            )
            .unwrap();
        assert_eq!(done.status, S_OK);
        assert_eq!(client.call(0, &BlkOp::Flush).unwrap().status, S_OK);
        client.disconnect().unwrap();
    }
    // Killed: the socket file stays behind, stale; the restart replaces it and serves the
    // stored attachment again.
    server.kill9();
    assert!(sock.exists());
    let server = Server::start(&data);
    let mut client = VhostUserBlkClient::connect(&sock, options).unwrap();
    let back = client
        .call(
            0,
            &BlkOp::Read {
                offset: 4096,
                len: 8192,
            },
        )
        .unwrap();
    assert_eq!((back.status, back.data), (S_OK, written));
    client.disconnect().unwrap();
    let out = server.cli(&["volume", "detach", "disk", "--vhost-user", sock_arg]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(!sock.exists(), "detach removes the socket");
    let out = server.cli(&["volume", "detach", "disk", "--vhost-user", sock_arg]);
    assert!(
        !out.status.success(),
        "a second detach is refused: {}",
        text(&out)
    );
    server.stop();
}

//! The NBD Unix socket of a node started in this process: a local client's uid (the kernel's
//! `SO_PEERCRED`) is its tenant when `nbd_unix_tenants` maps it and anonymous otherwise, the
//! connection table shows it by uid, TCP can be off, and the socket file is removed at a clean
//! stop. Negotiation is driven with `headroom_nbd`'s codecs over a real `UnixStream`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use headroom_nbd::ClientOption;
use headroom_nbd::consts::{NBD_REP_ACK, NBD_REP_SERVER};
use headroom_node::{NodeConfig, RunningNode, UnixSocketConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

/// This process's uid, as the kernel will report it for our connections.
fn our_uid() -> u32 {
    std::fs::metadata("/proc/self").unwrap().uid()
}

fn unix_config(path: &Path, tenants: &[(u32, &str)]) -> UnixSocketConfig {
    UnixSocketConfig {
        path: path.to_path_buf(),
        mode: Some(0o600),
        tenants: tenants
            .iter()
            .map(|(uid, t)| (*uid, (*t).to_string()))
            .collect(),
        ..UnixSocketConfig::default()
    }
}

/// A node with `unix` (TCP on too unless `tcp` is false), a public volume and one of alice's.
async fn node_with(unix: UnixSocketConfig, tcp: bool) -> RunningNode {
    let mut config: NodeConfig = common::config();
    if !tcp {
        config.nbd_listen = None;
    }
    config.nbd_unix = Some(unix);
    let node = common::start(config).await;
    node.create_volume("public", 1 << 20, None).unwrap();
    node.store().create_tenant("alice").unwrap();
    let options = headroom_store::NewVolume {
        tenant: Some("alice".to_string()),
        ..headroom_store::NewVolume::default()
    };
    node.store()
        .create_volume_with("alices", 1 << 20, options)
        .unwrap();
    node
}

/// Connects to the socket, haggles up to the first option and asks for the export list.
async fn listed(path: &Path) -> Vec<String> {
    let mut stream = UnixStream::connect(path).await.expect("connect");
    let mut greeting = [0u8; headroom_nbd::consts::SERVER_GREETING_LEN];
    stream.read_exact(&mut greeting).await.expect("greeting");
    let flags = headroom_nbd::ClientFlags {
        fixed_newstyle: true,
        no_zeroes: true,
    };
    stream
        .write_all(&flags.to_raw().to_be_bytes())
        .await
        .unwrap();
    let mut out = Vec::new();
    headroom_nbd::encode_client_option(&mut out, &ClientOption::List);
    stream.write_all(&out).await.unwrap();
    let mut names = Vec::new();
    loop {
        let mut header = [0u8; headroom_nbd::consts::OPTION_REPLY_HEADER_LEN];
        stream.read_exact(&mut header).await.expect("a reply");
        let header = headroom_nbd::decode_option_reply_header(&header).unwrap();
        let mut data = vec![0u8; header.length as usize];
        stream.read_exact(&mut data).await.unwrap();
        match header.reply_type {
            NBD_REP_SERVER => {
                let len = u32::from_be_bytes(data[0..4].try_into().unwrap()) as usize;
                names.push(String::from_utf8(data[4..4 + len].to_vec()).unwrap());
            }
            NBD_REP_ACK => break,
            other => panic!("reply type {other:#x} to LIST"),
        }
    }
    names.sort();
    names
}

fn socket_in(dir: &tempfile::TempDir) -> PathBuf {
    dir.path().join("nbd.sock")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mapped_uid_sees_its_tenants_volumes_and_only_those() {
    let dir = tempfile::tempdir().unwrap();
    let path = socket_in(&dir);
    let node = node_with(unix_config(&path, &[(our_uid(), "alice")]), true).await;
    assert_eq!(node.nbd_unix.as_deref(), Some(path.as_path()));
    assert_eq!(
        listed(&path).await,
        ["alices"],
        "alice's volume, not the public one"
    );
    // The same process over TCP is anonymous: a uid is a Unix socket's proof only.
    let mut haggle = common::Haggle::open(&node).await;
    let replies = haggle.ask(&ClientOption::List).await;
    assert_eq!(replies.len(), 2, "one server and the ack: {replies:?}");
    drop(haggle);
    node.shutdown().await.expect("a clean stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unmapped_uid_is_anonymous_and_counted_by_uid() {
    let dir = tempfile::tempdir().unwrap();
    let path = socket_in(&dir);
    // Another uid is mapped; ours is not.
    let node = node_with(unix_config(&path, &[(our_uid() + 1, "alice")]), true).await;
    assert_eq!(listed(&path).await, ["public"]);
    // An open connection shows as a local uid, not as an address.
    let held = UnixStream::connect(&path).await.unwrap();
    let mut greeting = [0u8; headroom_nbd::consts::SERVER_GREETING_LEN];
    let mut held = held;
    held.read_exact(&mut greeting).await.unwrap();
    let view = node.api_state().connections.view();
    let peers: Vec<&str> = view.connections.iter().map(|c| c.peer.as_str()).collect();
    let ours = format!("unix:uid={},", our_uid());
    assert!(
        peers.iter().any(|p| p.starts_with(&ours)),
        "{peers:?} has no {ours}"
    );
    drop(held);
    node.shutdown().await.expect("a clean stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_off_serves_the_socket_alone_and_a_clean_stop_removes_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = socket_in(&dir);
    let node = node_with(unix_config(&path, &[]), false).await;
    assert_eq!(node.nbd_addr, None, "no TCP listener");
    let meta = std::fs::symlink_metadata(&path).unwrap();
    assert_eq!(
        meta.permissions().mode() & 0o777,
        0o600,
        "the mode asked for"
    );
    assert_eq!(listed(&path).await, ["public"]);
    node.shutdown().await.expect("a clean stop");
    assert!(
        std::fs::symlink_metadata(&path).is_err(),
        "the socket file is gone after a clean stop"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_does_not_start_on_a_regular_file_or_without_any_listener() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("disk.img");
    std::fs::write(&path, b"not a socket").unwrap();
    let mut config = common::config();
    config.nbd_unix = Some(unix_config(&path, &[]));
    let err = headroom_node::Node::start(config).await.unwrap_err();
    assert!(err.to_string().contains("is not a socket"), "{err}");
    assert_eq!(std::fs::read(&path).unwrap(), b"not a socket");
    let mut config = common::config();
    config.nbd_listen = None;
    let err = headroom_node::Node::start(config).await.unwrap_err();
    assert!(err.to_string().contains("server.nbd_listen"), "{err}");
}

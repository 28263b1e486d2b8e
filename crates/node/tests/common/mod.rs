//! The in-process harness: a real node (`Node::start`) on an in-memory store in this test's
//! own process, its NBD and API listeners on loopback ports the kernel picks, and the lab's
//! NBD client (`headroom_lab::NbdClient`, the one the load generator uses) speaking the real
//! protocol to it. No subprocess, no fio: a test starts a node in milliseconds and reads its
//! state directly (`RunningNode::store`, `api_state`) where a subprocess test would have to
//! ask over HTTP.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)] // each test file uses a part

use headroom_lab::{LabError, NbdClient};
use headroom_nbd::RequestHeader;
use headroom_nbd::consts::{NBD_CMD_DISC, NBD_CMD_READ, NBD_CMD_WRITE, SIMPLE_REPLY_HEADER_LEN};
use headroom_node::config::{NodeConfig, StoreBackend};
use headroom_node::server::{Node, RunningNode};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The memory store's capacity in every harness node.
pub const CAPACITY_BYTES: u64 = 256 << 20;

/// A node's configuration for a test: memory store, loopback ports chosen by the kernel.
pub fn config() -> NodeConfig {
    let mut config = NodeConfig::new(StoreBackend::Memory {
        capacity_bytes: CAPACITY_BYTES,
    });
    config.nbd_listen = "127.0.0.1:0".parse().unwrap();
    config.api_listen = "127.0.0.1:0".parse().unwrap();
    config
}

/// Starts a node with `config`.
pub async fn start(config: NodeConfig) -> RunningNode {
    Node::start(config).await.expect("the node starts")
}

/// Starts a node with [`config`] and volume `name` of `size_bytes` (no QoS).
pub async fn start_with_volume(name: &str, size_bytes: u64) -> RunningNode {
    let node = start(config()).await;
    node.create_volume(name, size_bytes, None)
        .expect("the volume is created");
    node
}

/// Connects to export `name` (fixed newstyle, `NBD_OPT_GO`, simple replies).
pub async fn connect(node: &RunningNode, name: &str) -> Result<Client, LabError> {
    let client = NbdClient::connect(&node.nbd_addr.to_string(), name).await?;
    let size_bytes = client.export().size_bytes;
    let read_only = client.export().read_only();
    Ok(Client {
        stream: client.into_stream(),
        size_bytes,
        read_only,
        next_cookie: 1,
    })
}

/// A connection in transmission, one request at a time.
pub struct Client {
    stream: TcpStream,
    pub size_bytes: u64,
    pub read_only: bool,
    next_cookie: u64,
}

impl Client {
    /// Sends one request (and `payload` after it) and reads its simple reply header; returns
    /// the reply's error value (0: success) and, for a successful READ, the data.
    pub async fn request(
        &mut self,
        command: u16,
        flags: u16,
        offset: u64,
        length: u32,
        payload: &[u8],
    ) -> (u32, Vec<u8>) {
        let cookie = self.next_cookie;
        self.next_cookie += 1;
        let header = RequestHeader {
            flags,
            command,
            cookie,
            offset,
            length,
        };
        self.send(&header, payload).await;
        let mut header = [0u8; SIMPLE_REPLY_HEADER_LEN];
        self.stream
            .read_exact(&mut header)
            .await
            .expect("reply header");
        let reply = headroom_nbd::decode_simple_reply_header(&header).expect("a simple reply");
        assert_eq!(reply.cookie, cookie, "the reply answers another request");
        let mut data = Vec::new();
        if command == NBD_CMD_READ && reply.error == 0 {
            data.resize(length as usize, 0);
            self.stream.read_exact(&mut data).await.expect("read data");
        }
        (reply.error, data)
    }

    /// Sends one request header and the payload after it, in one write.
    async fn send(&mut self, header: &RequestHeader, payload: &[u8]) {
        let mut out = Vec::new();
        headroom_nbd::encode_request_header(&mut out, header);
        out.extend_from_slice(payload);
        self.stream.write_all(&out).await.expect("request sent");
    }

    /// Writes `data` at `offset`; the reply's error value.
    pub async fn write(&mut self, offset: u64, data: &[u8]) -> u32 {
        let length = u32::try_from(data.len()).unwrap();
        self.request(NBD_CMD_WRITE, 0, offset, length, data).await.0
    }

    /// Reads `length` bytes at `offset`: the reply's error value and the data.
    pub async fn read(&mut self, offset: u64, length: u32) -> (u32, Vec<u8>) {
        self.request(NBD_CMD_READ, 0, offset, length, &[]).await
    }

    /// Ends transmission cleanly (`NBD_CMD_DISC`), then waits for the server to close.
    pub async fn disconnect(mut self) {
        let header = RequestHeader {
            flags: 0,
            command: NBD_CMD_DISC,
            cookie: 0,
            offset: 0,
            length: 0,
        };
        self.send(&header, &[]).await;
        let mut rest = Vec::new();
        let _ = self.stream.read_to_end(&mut rest).await;
        assert!(rest.is_empty(), "bytes after DISC: {rest:?}");
    }
}

//! The in-process harness: a real node (`Node::start`) on an in-memory store in this test's
//! own process, its NBD and API listeners on loopback ports the kernel picks, and the lab's
//! NBD client (`headroom_lab::NbdClient`, the one the load generator uses) speaking the real
//! protocol to it. No subprocess, no fio: a test starts a node in milliseconds and reads its
//! state directly (`RunningNode::store`, `api_state`) where a subprocess test would have to
//! ask over HTTP. Below the lab's client, `Haggle` drives option haggling one option at a time
//! and `Client` sends raw requests and reads simple or structured replies, all through
//! `headroom_nbd`'s encoders and decoders, for tests of the protocol's corners.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)] // each test file uses a part

pub mod router;

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
    config.nbd_listen = Some("127.0.0.1:0".parse().unwrap());
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
    let client =
        NbdClient::connect(&node.nbd_addr.expect("a TCP listener").to_string(), name).await?;
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

/// What a [`Client`] request sends: command, flags, offset, length (the payload is separate).
#[derive(Clone, Copy, Debug)]
pub struct Req {
    pub command: u16,
    pub flags: u16,
    pub offset: u64,
    pub length: u32,
}

impl Req {
    pub fn new(command: u16, offset: u64, length: u32) -> Req {
        Req {
            command,
            flags: 0,
            offset,
            length,
        }
    }

    pub fn flags(mut self, flags: u16) -> Req {
        self.flags = flags;
        self
    }
}

/// One structured reply chunk: its header and its payload.
#[derive(Clone, Debug)]
pub struct Chunk {
    pub header: headroom_nbd::StructuredChunkHeader,
    pub data: Vec<u8>,
}

impl Chunk {
    /// The error value of an error chunk (`NBD_REPLY_TYPE_ERROR*`), else `None`.
    pub fn error(&self) -> Option<u32> {
        if self.header.chunk_type & headroom_nbd::consts::NBD_REPLY_TYPE_FLAG_ERROR == 0 {
            return None;
        }
        Some(u32::from_be_bytes(self.data[0..4].try_into().unwrap()))
    }

    /// The (length, flags) descriptors of an `NBD_REPLY_TYPE_BLOCK_STATUS` chunk, after its
    /// context id (returned first).
    pub fn block_status(&self) -> (u32, Vec<(u32, u32)>) {
        assert_eq!(
            self.header.chunk_type,
            headroom_nbd::consts::NBD_REPLY_TYPE_BLOCK_STATUS
        );
        let be = |b: &[u8]| u32::from_be_bytes(b.try_into().unwrap());
        let context = be(&self.data[0..4]);
        let descriptors = self.data[4..]
            .chunks_exact(8)
            .map(|d| (be(&d[0..4]), be(&d[4..8])))
            .collect();
        (context, descriptors)
    }
}

impl Client {
    /// Sends a request without reading anything back: its cookie.
    pub async fn send_request(&mut self, req: Req, payload: &[u8]) -> u64 {
        let cookie = self.next_cookie;
        self.next_cookie += 1;
        let header = RequestHeader {
            flags: req.flags,
            command: req.command,
            cookie,
            offset: req.offset,
            length: req.length,
        };
        self.send(&header, payload).await;
        cookie
    }

    /// Reads one simple reply header: (cookie, error).
    pub async fn read_simple_header(&mut self) -> (u64, u32) {
        let mut header = [0u8; SIMPLE_REPLY_HEADER_LEN];
        self.stream
            .read_exact(&mut header)
            .await
            .expect("reply header");
        let reply = headroom_nbd::decode_simple_reply_header(&header).expect("a simple reply");
        (reply.cookie, reply.error)
    }

    /// Reads `n` bytes of reply payload.
    pub async fn read_payload(&mut self, n: usize) -> Vec<u8> {
        let mut data = vec![0u8; n];
        self.stream.read_exact(&mut data).await.expect("payload");
        data
    }

    /// Reads one structured reply chunk.
    pub async fn read_chunk(&mut self) -> Chunk {
        let mut buf = [0u8; headroom_nbd::consts::STRUCTURED_REPLY_HEADER_LEN];
        self.stream
            .read_exact(&mut buf)
            .await
            .expect("chunk header");
        let header = headroom_nbd::decode_structured_chunk_header(&buf).expect("a chunk");
        let data = self.read_payload(header.length as usize).await;
        Chunk { header, data }
    }

    /// Sends one request on a session with structured replies and reads every chunk of its
    /// reply, up to the one flagged done.
    pub async fn request_chunks(&mut self, req: Req, payload: &[u8]) -> Vec<Chunk> {
        let cookie = self.send_request(req, payload).await;
        let mut chunks = Vec::new();
        loop {
            let chunk = self.read_chunk().await;
            assert_eq!(chunk.header.cookie, cookie, "a chunk of another request");
            let done = chunk.header.is_done();
            chunks.push(chunk);
            if done {
                return chunks;
            }
        }
    }

    /// Sends a request and waits for the server to close the connection, not answering it
    /// with anything but at most a reply header: whether it did close (EOF or reset) within
    /// the guard of several seconds.
    pub async fn closes_after(mut self, req: Req, payload: &[u8]) -> bool {
        self.send_request(req, payload).await;
        closes(&mut self.stream).await
    }
}

/// A failure guard (never synchronisation): far longer than anything a test waits for.
pub const GUARD: std::time::Duration = std::time::Duration::from_secs(10);

/// Whether the peer closes `stream` (EOF or reset) within [`GUARD`]; bytes before the close
/// are read and dropped.
pub async fn closes(stream: &mut TcpStream) -> bool {
    let mut sink = Vec::new();
    match tokio::time::timeout(GUARD, stream.read_to_end(&mut sink)).await {
        Ok(Ok(_)) => true,
        Ok(Err(err)) => matches!(
            err.kind(),
            std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe
        ),
        Err(_) => false,
    }
}

/// Waits (polling; a failure guard of [`GUARD`], not a delay the test depends on) until
/// `done` holds; false if it never did.
pub async fn eventually(mut done: impl FnMut() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + GUARD;
    while tokio::time::Instant::now() < deadline {
        if done() {
            return true;
        }
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
    }
    done()
}

/// One option reply: its header and data.
#[derive(Clone, Debug)]
pub struct OptionReply {
    pub header: headroom_nbd::OptionReplyHeader,
    pub data: Vec<u8>,
}

impl OptionReply {
    pub fn reply_type(&self) -> u32 {
        self.header.reply_type
    }

    /// The `NBD_INFO_*` type of an `NBD_REP_INFO` reply.
    pub fn info_type(&self) -> u16 {
        assert_eq!(self.header.reply_type, headroom_nbd::consts::NBD_REP_INFO);
        u16::from_be_bytes([self.data[0], self.data[1]])
    }
}

/// A connection in option haggling, driven option by option with `headroom_nbd`'s encoders
/// and decoders: for tests of negotiation itself (the lab's client only knows GO).
pub struct Haggle {
    pub stream: TcpStream,
}

impl Haggle {
    /// Connects and reads the greeting, sending nothing.
    pub async fn greeted(node: &RunningNode) -> Haggle {
        let stream = TcpStream::connect(node.nbd_addr.expect("a TCP listener"))
            .await
            .expect("connect");
        Haggle::greeted_on(stream).await
    }

    /// Connects from the loopback address `source` (any of 127.0.0.0/8: another client
    /// address as the node counts them) and reads the greeting.
    pub async fn greeted_from(node: &RunningNode, source: std::net::Ipv4Addr) -> Haggle {
        Haggle::greeted_on(connect_from(node, source).await).await
    }

    /// Connects from the loopback address `source` and sends the client flags.
    pub async fn open_from(node: &RunningNode, source: std::net::Ipv4Addr) -> Haggle {
        let mut haggle = Haggle::greeted_from(node, source).await;
        let flags = headroom_nbd::ClientFlags {
            fixed_newstyle: true,
            no_zeroes: true,
        };
        haggle
            .stream
            .write_all(&flags.to_raw().to_be_bytes())
            .await
            .expect("client flags");
        haggle
    }

    /// Reads the greeting on a connected socket.
    pub async fn greeted_on(mut stream: TcpStream) -> Haggle {
        stream.set_nodelay(true).expect("TCP_NODELAY");
        let mut greeting = [0u8; headroom_nbd::consts::SERVER_GREETING_LEN];
        stream.read_exact(&mut greeting).await.expect("greeting");
        let magic = u64::from_be_bytes(greeting[0..8].try_into().unwrap());
        let ihaveopt = u64::from_be_bytes(greeting[8..16].try_into().unwrap());
        let flags = u16::from_be_bytes([greeting[16], greeting[17]]);
        assert_eq!(magic, headroom_nbd::consts::NBDMAGIC);
        assert_eq!(ihaveopt, headroom_nbd::consts::IHAVEOPT);
        assert_eq!(flags, headroom_nbd::SERVER_HANDSHAKE_FLAGS);
        Haggle { stream }
    }

    /// Connects, reads the greeting and sends `client_flags`.
    pub async fn open_with_flags(node: &RunningNode, client_flags: u32) -> Haggle {
        let mut haggle = Haggle::greeted(node).await;
        haggle
            .stream
            .write_all(&client_flags.to_be_bytes())
            .await
            .expect("client flags");
        haggle
    }

    /// Connects with fixed newstyle and no zeroes: ready for the first option.
    pub async fn open(node: &RunningNode) -> Haggle {
        let flags = headroom_nbd::ClientFlags {
            fixed_newstyle: true,
            no_zeroes: true,
        };
        Haggle::open_with_flags(node, flags.to_raw()).await
    }

    /// Sends one option (header and data).
    pub async fn send(&mut self, option: &headroom_nbd::ClientOption) {
        let mut out = Vec::new();
        headroom_nbd::encode_client_option(&mut out, option);
        self.stream.write_all(&out).await.expect("option sent");
    }

    /// Sends an option header claiming `length` bytes of data, and `data` (which may be
    /// shorter: the rest is sent by the caller, or never).
    pub async fn send_raw(&mut self, option: u32, length: u32, data: &[u8]) {
        let mut out = Vec::new();
        headroom_nbd::encode_option_header(&mut out, option, length);
        out.extend_from_slice(data);
        self.stream.write_all(&out).await.expect("option sent");
    }

    /// Reads one option reply.
    pub async fn reply(&mut self) -> OptionReply {
        let mut buf = [0u8; headroom_nbd::consts::OPTION_REPLY_HEADER_LEN];
        self.stream
            .read_exact(&mut buf)
            .await
            .expect("option reply header");
        let header = headroom_nbd::decode_option_reply_header(&buf).expect("an option reply");
        let mut data = vec![0u8; header.length as usize];
        self.stream.read_exact(&mut data).await.expect("reply data");
        OptionReply { header, data }
    }

    /// Reads the replies to one option up to its last (an ACK or an error); each must answer
    /// `option`.
    pub async fn replies(&mut self, option: u32) -> Vec<OptionReply> {
        let mut replies = Vec::new();
        loop {
            let reply = self.reply().await;
            assert_eq!(reply.header.option, option, "a reply to another option");
            let last = reply.header.is_error()
                || reply.header.reply_type == headroom_nbd::consts::NBD_REP_ACK;
            replies.push(reply);
            if last {
                return replies;
            }
        }
    }

    /// Sends `option` and reads its replies.
    pub async fn ask(&mut self, option: &headroom_nbd::ClientOption) -> Vec<OptionReply> {
        self.send(option).await;
        self.replies(option.option_number()).await
    }

    /// Enters transmission on `name` with `NBD_OPT_GO`: the session as a [`Client`] and the
    /// transmission flags.
    pub async fn go(mut self, name: &str) -> (Client, u16) {
        let go = headroom_nbd::ClientOption::Go(headroom_nbd::InfoRequest {
            export_name: name.to_string(),
            info_types: Vec::new(),
        });
        let replies = self.ask(&go).await;
        let last = replies.last().expect("a reply");
        assert_eq!(
            last.reply_type(),
            headroom_nbd::consts::NBD_REP_ACK,
            "GO refused: {replies:?}"
        );
        let export = replies
            .iter()
            .find(|r| {
                r.reply_type() == headroom_nbd::consts::NBD_REP_INFO
                    && r.info_type() == headroom_nbd::consts::NBD_INFO_EXPORT
            })
            .expect("NBD_INFO_EXPORT");
        let size_bytes = u64::from_be_bytes(export.data[2..10].try_into().unwrap());
        let flags = u16::from_be_bytes([export.data[10], export.data[11]]);
        let client = Client {
            stream: self.stream,
            size_bytes,
            read_only: flags & headroom_nbd::consts::NBD_FLAG_READ_ONLY != 0,
            next_cookie: 1,
        };
        (client, flags)
    }

    /// Negotiates structured replies (asserting the ACK), then GO on `name`; with
    /// `allocation`, selects `base:allocation` for it in between.
    pub async fn go_structured(mut self, name: &str, allocation: bool) -> (Client, u16) {
        let replies = self.ask(&headroom_nbd::ClientOption::StructuredReply).await;
        assert_eq!(replies.len(), 1);
        assert_eq!(replies[0].reply_type(), headroom_nbd::consts::NBD_REP_ACK);
        if allocation {
            let set =
                headroom_nbd::ClientOption::SetMetaContext(headroom_nbd::MetaContextRequest {
                    export_name: name.to_string(),
                    queries: vec![headroom_nbd::BASE_ALLOCATION.to_string()],
                });
            let replies = self.ask(&set).await;
            assert_eq!(
                replies.last().map(OptionReply::reply_type),
                Some(headroom_nbd::consts::NBD_REP_ACK),
                "{replies:?}"
            );
        }
        self.go(name).await
    }

    /// Whether the server closes the connection (see [`closes`]).
    pub async fn closes(mut self) -> bool {
        closes(&mut self.stream).await
    }
}

impl Client {
    /// The socket, for tests that send bytes no helper would.
    pub fn stream(&mut self) -> &mut TcpStream {
        &mut self.stream
    }
}

/// A TCP connection to the node's NBD port from the loopback address `source`.
pub async fn connect_from(node: &RunningNode, source: std::net::Ipv4Addr) -> TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().expect("a socket");
    socket
        .bind(std::net::SocketAddr::from((source, 0)))
        .expect("bind the source address");
    socket
        .connect(node.nbd_addr.expect("a TCP listener"))
        .await
        .expect("connect")
}

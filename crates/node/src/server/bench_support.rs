//! The request pipeline driven in process for measurement: a node assembled by the same
//! steps as [`super::Node::start`] (store, I/O runtime, scheduler, session context), without
//! listeners, the API or background work, and clients that send it 4 KiB READs or WRITEs at
//! a fixed queue depth, through the in-memory transport or through the real NBD session over
//! an in-memory stream.
//!
//! Why: the pipeline's own cost per request is a few microseconds, which a socket, fio and the
//! neighbours' load on a shared machine hide. With no socket and no other work in the process,
//! what a run costs is the pipeline's (and, for the NBD cases, the session's parse and encode),
//! so the criterion bench (`crates/node/benches/pipeline.rs`: ns and allocations per
//! request) and the instruction count (`crates/node/examples/pipeline_count.rs` under
//! callgrind, `scripts/count-pipeline-instructions`) compare two versions of the hot path. Both drive
//! the cases defined here, so they measure the same thing.
//!
//! Each case has its own node, built once ([`CaseDriver::new`]) on a current-thread runtime,
//! as the node's network threads run each connection; the volume's working set is written
//! first, so READs copy data rather than answer holes. A run ([`CaseDriver::run`]) starts and
//! ends with nothing in flight. Not a stable API: compiled with the `bench-support` feature
//! only.

use std::net::SocketAddr;
use std::sync::Arc;

use headroom_nbd as nbd;
use headroom_nbd::consts;
use headroom_qos::{PolicyKind, QosSpec};
use headroom_store::Store;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader, DuplexStream};
use tokio::io::{ReadHalf, WriteHalf};

use super::assembly;
use crate::admission::Connections;
use crate::clock::Clock;
use crate::config::{NodeConfig, PolicyChoice, StoreBackend};
use crate::memory_transport::{MemoryOutcome, MemoryRequest, MemorySession};
use crate::metrics::MetricsRegistry;
use crate::pipeline::IoJob;
use crate::scheduler::Scheduler;
use crate::session::SessionContext;

/// Bytes per request.
pub const REQUEST_BYTES: u32 = 4096;
/// Requests in flight in the deep-queue cases.
pub const DEEP_QUEUE_DEPTH: usize = 32;
/// The volume, all of it written before the first measured request: the READs and WRITEs
/// visit its 4 KiB blocks in a fixed scattered order.
pub const VOLUME_BYTES: u64 = 16 << 20;
/// The memory store's capacity.
const STORE_BYTES: u64 = 64 << 20;
/// The prefill's requests.
const PREFILL_REQUEST_BYTES: u32 = 1 << 20;
/// Each direction of the NBD case's in-memory stream: room for every reply in flight.
const DUPLEX_BYTES: usize = 256 << 10;
const VOLUME_NAME: &str = "bench";

/// The command of a case.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BenchOp {
    Read,
    Write,
}

/// How a case's client reaches the pipeline.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BenchTransport {
    /// `memory_transport`: typed requests in, typed replies out.
    Memory,
    /// `session::serve_connection` over a `tokio::io::duplex` stream: encoded requests in,
    /// encoded replies out (structured replies, as libnbd negotiates them).
    Nbd,
}

/// One measured case.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Case {
    pub transport: BenchTransport,
    pub op: BenchOp,
    /// `burst` with a volume whose QoS never binds; `false`: policy `off`.
    pub qos: bool,
    /// Requests kept in flight: 1 waits for each reply (`MemorySession::call`).
    pub depth: usize,
}

impl Case {
    /// Every case the bench runs.
    pub fn all() -> Vec<Case> {
        let mut cases = Vec::new();
        for op in [BenchOp::Read, BenchOp::Write] {
            for qos in [true, false] {
                for depth in [1, DEEP_QUEUE_DEPTH] {
                    cases.push(Case {
                        transport: BenchTransport::Memory,
                        op,
                        qos,
                        depth,
                    });
                }
            }
        }
        for qos in [true, false] {
            cases.push(Case {
                transport: BenchTransport::Nbd,
                op: BenchOp::Read,
                qos,
                depth: DEEP_QUEUE_DEPTH,
            });
        }
        cases
    }

    /// `memory_read_4k_burst_qd1`, `nbd_read_4k_off_qd32`, ...
    pub fn name(&self) -> String {
        let transport = match self.transport {
            BenchTransport::Memory => "memory",
            BenchTransport::Nbd => "nbd",
        };
        let op = match self.op {
            BenchOp::Read => "read",
            BenchOp::Write => "write",
        };
        let policy = if self.qos { "burst" } else { "off" };
        format!("{transport}_{op}_4k_{policy}_qd{}", self.depth)
    }

    /// The case [`Case::name`] names.
    pub fn parse(name: &str) -> Option<Case> {
        Case::all().into_iter().find(|case| case.name() == name)
    }
}

/// A node of the pipeline alone: what `Node::start` assembles for requests, on a memory store.
#[derive(Debug)]
struct BenchNode {
    store: Arc<Store>,
    scheduler: Option<Arc<Scheduler<IoJob>>>,
    ctx: Arc<SessionContext>,
    connections: Arc<Connections>,
}

impl BenchNode {
    /// Assembles the node on the current runtime, with the server's defaults but `policy`
    /// (and no reply coalescing: it lives in the network threads' park hook, not here).
    async fn start(policy: PolicyChoice) -> BenchNode {
        let mut config = NodeConfig::new(StoreBackend::Memory {
            capacity_bytes: STORE_BYTES,
        });
        config.qos.policy = policy;
        config.coalesce_us = Some(0);
        let store = super::store::open_store(&config)
            .await
            .expect("the memory store opens");
        let io = assembly::start_io(&config, &store, Clock::new()).expect("the I/O runtime");
        let metrics = MetricsRegistry::new(config.metrics, io.clock);
        let scheduler =
            assembly::start_scheduler(&config, &store, &io, &metrics).expect("the scheduler");
        let (ctx, connections) =
            assembly::session_context(&config, &store, &io, scheduler.clone(), None, &metrics);
        BenchNode {
            store,
            scheduler,
            ctx,
            connections,
        }
    }

    /// The bench volume: with a policy, a baseline far above anything one client reaches.
    fn create_volume(&self) {
        let spec = QosSpec {
            baseline_iops: Some(10_000_000),
            baseline_mbps: Some(1_000_000),
            ..QosSpec::default()
        };
        super::running::create_volume(
            &self.store,
            self.scheduler.as_ref(),
            VOLUME_NAME,
            VOLUME_BYTES,
            Some(spec),
        )
        .expect("the bench volume is created");
    }

    fn attach(&self, peer: SocketAddr) -> MemorySession {
        crate::memory_transport::attach(
            &self.store,
            &self.connections,
            &self.ctx.pipeline,
            peer,
            VOLUME_NAME,
            None,
        )
        .expect("the client attaches")
    }
}

impl Drop for BenchNode {
    fn drop(&mut self) {
        if let Some(scheduler) = &self.scheduler {
            scheduler.stop();
        }
    }
}

/// The offset of request `index`: the volume's blocks in a scattered order that visits each
/// once per pass (an odd multiplier is a bijection modulo a power of two).
fn offset_of(index: u64) -> u64 {
    let blocks = VOLUME_BYTES / u64::from(REQUEST_BYTES);
    (index.wrapping_mul(0x9E37_79B1) & (blocks - 1)) * u64::from(REQUEST_BYTES)
}

/// One case's node and client, ready to run requests.
#[derive(Debug)]
pub struct CaseDriver {
    case: Case,
    /// Requests sent so far (the next one's index, for its offset).
    sent: u64,
    /// A WRITE's data.
    payload: Vec<u8>,
    // Dropped in this order: the client, the runtime (with the NBD session's tasks), the node
    // (which stops its scheduler).
    client: Client,
    runtime: tokio::runtime::Runtime,
    _node: BenchNode,
}

#[derive(Debug)]
enum Client {
    Memory(Box<MemorySession>),
    Nbd(WireClient),
}

impl CaseDriver {
    /// Builds `case`'s node, writes the volume's working set and attaches the client.
    pub fn new(case: Case) -> CaseDriver {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a tokio runtime");
        let policy = if case.qos {
            PolicyChoice::Policy(PolicyKind::Burst)
        } else {
            PolicyChoice::Off
        };
        let (node, client) = runtime.block_on(async {
            let node = BenchNode::start(policy).await;
            node.create_volume();
            let mut prefill = node.attach(SocketAddr::from(([127, 0, 0, 2], 40_000)));
            for offset in (0..VOLUME_BYTES).step_by(PREFILL_REQUEST_BYTES as usize) {
                let data = vec![0xa5; PREFILL_REQUEST_BYTES as usize];
                let done = prefill
                    .call(MemoryRequest::write(offset, data))
                    .await
                    .expect("the prefill is sent");
                assert_eq!(done, Ok(MemoryOutcome::Done), "the prefill is written");
            }
            prefill.detach().await;
            let peer = SocketAddr::from(([127, 0, 0, 1], 40_000));
            let client = match case.transport {
                BenchTransport::Memory => Client::Memory(Box::new(node.attach(peer))),
                BenchTransport::Nbd => Client::Nbd(WireClient::connect(&node, peer).await),
            };
            (node, client)
        });
        CaseDriver {
            case,
            runtime,
            client,
            sent: 0,
            payload: vec![0x5a; REQUEST_BYTES as usize],
            _node: node,
        }
    }

    pub fn case(&self) -> Case {
        self.case
    }

    /// Runs `requests` requests of the case, `depth` in flight, and returns once every reply
    /// is in; panics on a failed request.
    pub fn run(&mut self, requests: u64) {
        let CaseDriver {
            case,
            runtime,
            client,
            sent,
            payload,
            ..
        } = self;
        let first = *sent;
        *sent += requests;
        let mut batch = Batch {
            op: case.op,
            next: first,
            end: first + requests,
            payload,
        };
        runtime.block_on(async {
            match client {
                Client::Memory(session) if case.depth == 1 => {
                    batch.call_each(session).await;
                }
                Client::Memory(session) => batch.keep_in_flight(session, case.depth).await,
                Client::Nbd(wire) => batch.keep_in_flight_wire(wire, case.depth).await,
            }
        });
    }
}

/// The requests of one run.
struct Batch<'a> {
    op: BenchOp,
    /// Index of the next request to send.
    next: u64,
    end: u64,
    payload: &'a [u8],
}

impl Batch<'_> {
    fn remaining(&self) -> u64 {
        self.end - self.next
    }

    /// The next request (the client builds a WRITE's data, as a transport has it).
    fn next_request(&mut self) -> MemoryRequest {
        let offset = offset_of(self.next);
        self.next += 1;
        match self.op {
            BenchOp::Read => MemoryRequest::read(offset, REQUEST_BYTES),
            BenchOp::Write => MemoryRequest::write(offset, self.payload.to_vec()),
        }
    }

    async fn call_each(&mut self, session: &mut MemorySession) {
        while self.remaining() > 0 {
            let request = self.next_request();
            let outcome = session.call(request).await.expect("the request is sent");
            check(self.op, outcome);
        }
    }

    async fn keep_in_flight(&mut self, session: &mut MemorySession, depth: usize) {
        let mut in_flight = 0usize;
        while in_flight < depth && self.remaining() > 0 {
            session
                .send(self.next_request())
                .await
                .expect("the request is sent");
            in_flight += 1;
        }
        while in_flight > 0 {
            let completion = session
                .next_completion()
                .await
                .expect("a reply for a request in flight");
            check(self.op, completion.result);
            in_flight -= 1;
            if self.remaining() > 0 {
                session
                    .send(self.next_request())
                    .await
                    .expect("the request is sent");
                in_flight += 1;
            }
        }
    }

    async fn keep_in_flight_wire(&mut self, wire: &mut WireClient, depth: usize) {
        let mut in_flight = 0usize;
        while in_flight < depth && self.remaining() > 0 {
            self.queue_wire(wire);
            in_flight += 1;
        }
        wire.flush().await;
        while in_flight > 0 {
            wire.read_reply(self.op).await;
            in_flight -= 1;
            if self.remaining() > 0 {
                self.queue_wire(wire);
                in_flight += 1;
            }
            // What a client batches: the replacements of every reply it has already read.
            if !wire.has_buffered_replies() {
                wire.flush().await;
            }
        }
    }

    fn queue_wire(&mut self, wire: &mut WireClient) {
        let offset = offset_of(self.next);
        self.next += 1;
        wire.queue(self.op, offset, self.payload);
    }
}

fn check(op: BenchOp, outcome: Result<MemoryOutcome, crate::memory_transport::RequestFailed>) {
    match (op, outcome) {
        (BenchOp::Read, Ok(MemoryOutcome::Data(data))) => {
            assert_eq!(data.len(), REQUEST_BYTES as usize, "a whole READ");
            std::hint::black_box(data);
        }
        (BenchOp::Write, Ok(MemoryOutcome::Done)) => {}
        (op, other) => panic!("{op:?} answered {other:?}"),
    }
}

/// An NBD client on the in-memory stream: fixed newstyle, structured replies, `NBD_OPT_GO`.
struct WireClient {
    reader: BufReader<ReadHalf<DuplexStream>>,
    writer: WriteHalf<DuplexStream>,
    /// Encoded requests not yet written.
    out: Vec<u8>,
    /// A reply chunk's payload (kept: its allocation serves the next reply).
    chunk: Vec<u8>,
    next_cookie: u64,
}

impl std::fmt::Debug for WireClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WireClient")
            .field("next_cookie", &self.next_cookie)
            .finish_non_exhaustive()
    }
}

impl WireClient {
    /// Starts the node's NBD session on one end of a duplex stream and negotiates on the other.
    async fn connect(node: &BenchNode, peer: SocketAddr) -> WireClient {
        let (ours, theirs) = tokio::io::duplex(DUPLEX_BYTES);
        let admitted = node.connections.admit(peer).expect("admitted");
        let ctx = Arc::clone(&node.ctx);
        tokio::spawn(async move {
            let _ = crate::session::serve_connection(theirs, ctx, &admitted).await;
        });
        let (reader, writer) = tokio::io::split(ours);
        let mut client = WireClient {
            reader: BufReader::with_capacity(DUPLEX_BYTES, reader),
            writer,
            out: Vec::new(),
            chunk: Vec::new(),
            next_cookie: 1,
        };
        client.negotiate().await;
        client
    }

    async fn negotiate(&mut self) {
        let mut greeting = [0u8; consts::SERVER_GREETING_LEN];
        self.reader
            .read_exact(&mut greeting)
            .await
            .expect("the greeting");
        let flags = nbd::ClientFlags {
            fixed_newstyle: true,
            no_zeroes: true,
        };
        self.out.extend_from_slice(&flags.to_raw().to_be_bytes());
        self.ask(&nbd::ClientOption::StructuredReply).await;
        let go = nbd::ClientOption::Go(nbd::InfoRequest {
            export_name: VOLUME_NAME.to_owned(),
            info_types: Vec::new(),
        });
        self.ask(&go).await;
    }

    /// Sends an option and reads its replies up to its ACK.
    async fn ask(&mut self, option: &nbd::ClientOption) {
        nbd::encode_client_option(&mut self.out, option);
        self.flush().await;
        loop {
            let mut buf = [0u8; consts::OPTION_REPLY_HEADER_LEN];
            self.reader
                .read_exact(&mut buf)
                .await
                .expect("an option reply");
            let header = nbd::decode_option_reply_header(&buf).expect("an option reply header");
            assert!(!header.is_error(), "option refused: {header:?}");
            let mut data = vec![0u8; header.length as usize];
            self.reader
                .read_exact(&mut data)
                .await
                .expect("option data");
            if header.reply_type == consts::NBD_REP_ACK {
                return;
            }
        }
    }

    /// Encodes a request (a WRITE's `payload` after its header) for the next flush.
    fn queue(&mut self, op: BenchOp, offset: u64, payload: &[u8]) {
        let command = match op {
            BenchOp::Read => consts::NBD_CMD_READ,
            BenchOp::Write => consts::NBD_CMD_WRITE,
        };
        let header = nbd::RequestHeader {
            flags: 0,
            command,
            cookie: self.next_cookie,
            offset,
            length: REQUEST_BYTES,
        };
        self.next_cookie += 1;
        nbd::encode_request_header(&mut self.out, &header);
        if op == BenchOp::Write {
            self.out.extend_from_slice(payload);
        }
    }

    async fn flush(&mut self) {
        if self.out.is_empty() {
            return;
        }
        self.writer
            .write_all(&self.out)
            .await
            .expect("requests written");
        self.out.clear();
    }

    fn has_buffered_replies(&self) -> bool {
        !self.reader.buffer().is_empty()
    }

    /// Reads one whole reply (simple, or structured chunks up to the one flagged done).
    async fn read_reply(&mut self, op: BenchOp) {
        loop {
            let mut magic = [0u8; 4];
            self.reader.read_exact(&mut magic).await.expect("a reply");
            match u32::from_be_bytes(magic) {
                consts::SIMPLE_REPLY_MAGIC => {
                    let mut buf = [0u8; consts::SIMPLE_REPLY_HEADER_LEN];
                    buf[..4].copy_from_slice(&magic);
                    self.reader
                        .read_exact(&mut buf[4..])
                        .await
                        .expect("a simple reply");
                    let reply = nbd::decode_simple_reply_header(&buf).expect("a simple reply");
                    assert_eq!(reply.error, 0, "a failed request");
                    assert_eq!(op, BenchOp::Write, "a READ's reply is structured");
                    return;
                }
                consts::STRUCTURED_REPLY_MAGIC => {
                    let mut buf = [0u8; consts::STRUCTURED_REPLY_HEADER_LEN];
                    buf[..4].copy_from_slice(&magic);
                    self.reader
                        .read_exact(&mut buf[4..])
                        .await
                        .expect("a chunk header");
                    let header = nbd::decode_structured_chunk_header(&buf).expect("a chunk");
                    assert_eq!(
                        header.chunk_type & consts::NBD_REPLY_TYPE_FLAG_ERROR,
                        0,
                        "a failed request"
                    );
                    self.chunk.resize(header.length as usize, 0);
                    self.reader
                        .read_exact(&mut self.chunk)
                        .await
                        .expect("a chunk's payload");
                    std::hint::black_box(&self.chunk);
                    if header.is_done() {
                        return;
                    }
                }
                other => panic!("not a reply: magic {other:#x}"),
            }
        }
    }
}

//! One NBD connection, from the greeting to the last reply.
//!
//! Negotiation shows a session only the volumes of its tenant: the identity its TLS handshake
//! proved, or none (plaintext, anonymous TLS), which sees only volumes without a tenant. Any
//! other volume is answered exactly as a name no volume has (`Haggling::visible_export`).
//!
//! Negotiation runs on the whole socket under a deadline, and may be cut short by eviction
//! (`node::admission`) until the reply that enters transmission. Transmission splits it: this
//! task reads and validates requests (and write payloads) and hands each one to the executor,
//! and a writer task encodes replies in completion order, batching whatever is ready into one
//! write. Every request holds a request slot of its connection until its reply is on the wire;
//! a READ or WRITE also holds its buffer's bytes, from the connection's semaphore and then from
//! the connection's reserve or its tenant's share of the node's budget (`node::budget`). A
//! client that pipelines without reading replies fills its own connection's budget, then its
//! tenant's, never more: its reader stops pulling from the socket and TCP pushes back, and the
//! tenant's other connections go on with their reserves. A client that takes no byte of a reply, or
//! sends no byte of a WRITE payload, for `client_stall_timeout_ms` is disconnected, which gives
//! its bytes back.
//!
//! One stage per file, in the order a request meets them (the connection, its TLS and the
//! context it runs in are here):
//! - `negotiate`: option haggling, until the client enters transmission, starts TLS or leaves;
//! - `transmit`: the reader, which validates each request, takes its permits and hands it on;
//! - `split`: requests larger than one backend operation, fed to the scheduler a few pieces at
//!   a time;
//! - `job`: what the scheduler runs (`IoJob`: a client's request or a grant for the node's own
//!   work) and how a dispatched job executes against the store, inline or on an executor lane;
//! - `block_status`: the bounded walk of allocation runs one BLOCK_STATUS answers;
//! - `reply`: the writer, which encodes replies as they complete, batching what is ready.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use headroom_nbd as nbd;
use headroom_qos::OpKind;
use headroom_qos::routing::{ReadRouting, ReplicaLoad, route_read};
use headroom_store::{Store, Volume};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::admission::Admitted;
use crate::budget::{Budget, BudgetError};
use crate::buffers::BufferPool;
use crate::clock::Clock;
use crate::emulated::EmulatedDevice;
use crate::exec::Lanes;
use crate::limits::Limits;
use crate::metrics::MetricsRegistry;
use crate::scheduler::{IoDesc, Scheduler};
use negotiate::Haggling;
use negotiate::Outcome;
use negotiate::negotiate;
use transmit::transmit;

/// The one metadata context we serve.
pub(super) const ALLOCATION_CONTEXT_ID: u32 = nbd::BASE_ALLOCATION_CONTEXT_ID;
pub(super) const ALLOCATION_CONTEXT_NAME: &str = nbd::BASE_ALLOCATION;
/// A batch of replies is written once it holds this many bytes (headers and payloads)...
pub(super) const BATCH_BYTES_MAX: usize = 192 << 10;
/// ...or this many replies (each takes at most two of the kernel's 1,024 iovecs).
pub(super) const BATCH_REPLIES_MAX: usize = 256;

/// What a session needs from the node.
#[derive(Debug)]
pub struct SessionContext {
    pub store: Arc<Store>,
    pub limits: Limits,
    /// Where and how requests run (shared with the scheduler's wake-up thread).
    pub io: Arc<IoRuntime>,
    /// The QoS scheduler; `None` with `--policy off` (requests run as they arrive).
    pub scheduler: Option<Arc<Scheduler<IoJob>>>,
    /// TLS credentials; `None`: NOTLS mode (STARTTLS is answered `NBD_REP_ERR_UNSUP`).
    pub tls: Option<Arc<Tls>>,
    /// FORCEDTLS: refuse every option but STARTTLS and ABORT until TLS is up.
    pub tls_required: bool,
    /// The node's payload byte budget, per tenant and in all (`node::budget`).
    pub budget: Arc<Budget>,
    /// Per-volume statistics and the promise audit (`node::metrics`).
    pub metrics: Arc<MetricsRegistry>,
}

/// What upgrades a session to TLS.
#[cfg(feature = "tls")]
pub type Tls = crate::tls::TlsAcceptor;

/// What upgrades a session to TLS: nothing in a build without the `tls` feature (the type has
/// no values, so `SessionContext::tls` is always `None` there).
#[cfg(not(feature = "tls"))]
#[derive(Debug)]
pub enum Tls {}

/// Where and how block I/O runs once it may run.
#[derive(Debug)]
pub struct IoRuntime {
    /// The executors, one per lane (`exec::Lane`); `None`: run everything but FLUSH inline
    /// on the calling thread.
    pub lanes: Option<Lanes>,
    /// Requests with at most this many payload bytes run inline even with an executor.
    pub inline_max_bytes: u32,
    /// Payload buffers for READ replies and WRITE data.
    pub buffers: Arc<BufferPool>,
    /// Emulated devices that decide when each request completes.
    pub emulation: Emulation,
    pub clock: Clock,
    /// For FLUSH without an executor, from threads outside the runtime too.
    pub runtime: tokio::runtime::Handle,
    /// Which copy of a replicated volume serves each read.
    pub reads: ReadRouter,
}

/// Read routing over a replicated volume's copies (`[storage] read_routing`): the policy is
/// `headroom_qos::routing::route_read` (FAST's type-aware routing with stealing, or a
/// baseline), the same code the simulator routes with; this is its state on a live node.
///
/// A device's load is the number of routed reads on it not yet answered (with an emulated
/// device, until the device says they are done). Writes are not counted: they go to every
/// copy alike, so they load every copy's device the same and do not change which is idler.
#[derive(Debug)]
pub struct ReadRouter {
    routing: ReadRouting,
    /// Advanced per routed read (round robin).
    turn: AtomicU64,
    /// Routed reads in flight, per pool device id.
    in_flight: Box<[AtomicU32]>,
}

/// Where a read was routed: the copy it tries first and that copy's device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Routed {
    copy: u8,
    device: u32,
}

impl ReadRouter {
    pub fn new(routing: ReadRouting) -> ReadRouter {
        ReadRouter {
            routing,
            turn: AtomicU64::new(0),
            in_flight: (0..headroom_store::MAX_DEVICES)
                .map(|_| AtomicU32::new(0))
                .collect(),
        }
    }

    /// The routing policy.
    pub fn routing(&self) -> ReadRouting {
        self.routing
    }

    /// Routes a read at `offset` of `volume` (the copies of its first extent decide) and
    /// counts it in flight on the chosen copy's device until [`ReadRouter::done`]. `None` for
    /// a 1-replica volume and for a hole: the store reads as it always does.
    ///
    /// The router's "replica 0, 1, 2" are the copies in the order of their devices' ids, not
    /// the copies' numbers: placement puts copy 0 of different extents on different devices,
    /// so routing by copy number would send random and sequential reads to every device
    /// alike. By device order, the lowest-numbered device holding a copy serves the random
    /// reads and the next one the sequential reads, for every extent the two share (FAST's
    /// head and middle replica).
    fn route(&self, volume: &Volume, offset: u64, sequential: bool) -> Option<Routed> {
        if volume.replicas() <= 1 {
            return None;
        }
        let copies = volume.copies(offset / headroom_store::EXTENT_SIZE_BYTES);
        // (device, copy number, healthy), in device order.
        let mut order = [(u32::MAX, 0u8, false); headroom_store::MAX_REPLICAS as usize];
        let mut n = 0;
        for (copy, slot) in copies.iter().enumerate() {
            if let Some((location, healthy)) = slot {
                order[n] = (location.device, u8::try_from(copy).ok()?, *healthy);
                n += 1;
            }
        }
        let order = &mut order[..n];
        order.sort_unstable();
        let mut loads = [ReplicaLoad::default(); headroom_store::MAX_REPLICAS as usize];
        for (load, &(device, _, healthy)) in loads.iter_mut().zip(order.iter()) {
            *load = ReplicaLoad {
                healthy,
                in_flight: self.counter(device)?.load(Ordering::Relaxed),
            };
        }
        let turn = self.turn.fetch_add(1, Ordering::Relaxed);
        let pick = route_read(self.routing, sequential, turn, &loads[..n])?;
        let (device, copy, _) = *order.get(pick)?;
        self.counter(device)?.fetch_add(1, Ordering::Relaxed);
        Some(Routed { copy, device })
    }

    /// The routed read on `device` is answered.
    fn done(&self, device: u32) {
        if let Some(c) = self.counter(device) {
            c.fetch_sub(1, Ordering::Relaxed);
        }
    }

    fn counter(&self, device: u32) -> Option<&AtomicU32> {
        self.in_flight.get(usize::try_from(device).ok()?)
    }
}

/// Which emulated devices decide when requests complete (`[storage.emulated]`).
#[derive(Debug, Default)]
pub enum Emulation {
    /// None: a request completes when its operation is done.
    #[default]
    Off,
    /// One device in front of the whole pool.
    Node(Arc<EmulatedDevice>),
    /// One per pool device, by device id (`per_device`): a request books the devices its
    /// extents are on and completes when the last of them is done.
    PerDevice(Vec<Arc<EmulatedDevice>>),
}

impl Emulation {
    /// Channels of all the emulated devices together (`None`: no emulation).
    pub fn parallelism(&self) -> Option<u32> {
        match self {
            Emulation::Off => None,
            Emulation::Node(device) => Some(device.spec().parallelism),
            Emulation::PerDevice(devices) => Some(
                devices
                    .iter()
                    .map(|d| d.spec().parallelism)
                    .fold(0u32, u32::saturating_add),
            ),
        }
    }
}

/// Books a request on the per-device emulated devices of the extents it touches (after it
/// ran, so a write's new extents are placed): each piece on its extent's device, at its
/// length; a read on the device of the copy it was routed to (`read_copy`, copy 0 when not
/// routed), anything else on every copy's device; FLUSH on every device. Returns the device
/// to complete on and when, or `None` when no device works for it (a read of holes, a trim
/// of what is gone).
pub(super) fn book_per_device<'d>(
    devices: &'d [Arc<EmulatedDevice>],
    volume: &Volume,
    request: &nbd::ValidRequest,
    desc: IoDesc,
    sequential: bool,
    read_copy: Option<u8>,
    now_ns: u64,
) -> Option<(&'d Arc<EmulatedDevice>, u64)> {
    let mut latest: Option<(&Arc<EmulatedDevice>, u64)> = None;
    let mut book = |device: &'d Arc<EmulatedDevice>, position: u64, len_bytes: u32| {
        let done_ns = device.book(now_ns, desc.op, position, len_bytes, sequential);
        if latest.is_none_or(|(_, at)| done_ns > at) {
            latest = Some((device, done_ns));
        }
    };
    if matches!(request.command, nbd::Command::Flush) {
        for device in devices {
            book(device, 0, 0);
        }
        return latest;
    }
    let extent_bytes = headroom_store::EXTENT_SIZE_BYTES;
    let start = request.offset;
    let end = start.saturating_add(u64::from(request.length));
    let mut at = start;
    while at < end {
        let extent = at / extent_bytes;
        let piece_end = ((extent + 1) * extent_bytes).min(end);
        let piece = u32::try_from(piece_end - at).unwrap_or(u32::MAX);
        let copies = match desc.op {
            OpKind::Read => {
                let c = read_copy.unwrap_or(0);
                c..c + 1
            }
            _ => 0..volume.replicas().max(1),
        };
        for copy in copies {
            if let Some(location) = volume.replica_location(copy, extent)
                && let Some(device) = usize::try_from(location.device)
                    .ok()
                    .and_then(|d| devices.get(d))
            {
                book(
                    device,
                    location.offset_bytes + at % extent_bytes,
                    if desc.len_bytes == 0 { 0 } else { piece },
                );
            }
        }
        at = piece_end;
    }
    latest
}

/// Why a session ended early. None of these affect other sessions.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error("socket error: {0}")]
    Io(#[from] std::io::Error),
    #[error("handshake: {0}")]
    Handshake(#[from] nbd::HandshakeError),
    #[error("client did not finish negotiation in time")]
    HandshakeTimeout,
    #[error("client asked for unknown export {0:?} with NBD_OPT_EXPORT_NAME")]
    UnknownExport(String),
    #[error("option of {0} bytes is too large")]
    OptionTooLarge(u32),
    #[error("transmission: {0}")]
    Transmission(#[from] nbd::TransmissionError),
    #[error(
        "client asked for export {0:?} with NBD_OPT_EXPORT_NAME before starting the TLS this server requires"
    )]
    TlsRequired(String),
    #[error("{0}")]
    TlsHandshake(String),
    #[error("evicted while negotiating, to make room for a new connection")]
    Evicted,
    #[error("client stopped reading replies: it took no byte for {0} ms")]
    RepliesStalled(u64),
    #[error("client stopped sending a WRITE payload: no byte came for {0} ms")]
    PayloadStalled(u64),
    #[error("byte budget: {0}")]
    Budget(#[from] BudgetError),
}

/// The outcome of negotiation when the client moves to transmission.
pub(super) struct Negotiated {
    volume: Arc<Volume>,
    structured: bool,
    allocation_context: bool,
}

/// What a session runs on: any byte stream (a TCP socket on a node; an in-memory pipe in the
/// session fuzzer, `fuzz/src/session.rs`).
pub trait SessionStream: AsyncRead + AsyncWrite + Unpin + Send + 'static {}

impl<S: AsyncRead + AsyncWrite + Unpin + Send + 'static> SessionStream for S {}

/// Serves one accepted connection to the end. Socket options (`TCP_NODELAY`) are the
/// caller's.
pub async fn serve_connection<S: SessionStream>(
    mut stream: S,
    ctx: Arc<SessionContext>,
    conn: &Admitted,
) -> Result<(), SessionError> {
    // One deadline for the whole negotiation, TLS handshake included.
    let deadline =
        tokio::time::Instant::now() + Duration::from_millis(ctx.limits.handshake_timeout_ms);
    let mut state = match tokio::time::timeout_at(deadline, greet(&mut stream)).await {
        Ok(Ok(flags)) => Haggling::new(flags),
        Ok(Err(err)) => return Err(err),
        Err(_) => return Err(SessionError::HandshakeTimeout),
    };
    let outcome =
        match tokio::time::timeout_at(deadline, negotiate(&mut stream, &ctx, &mut state, conn))
            .await
        {
            Ok(outcome) => outcome?,
            Err(_) => return Err(SessionError::HandshakeTimeout),
        };
    match outcome {
        Outcome::End => Ok(()),
        Outcome::Transmit(negotiated) => transmit_on(stream, ctx, negotiated, conn).await,
        Outcome::StartTls(tls) => {
            let (upgraded, tenant) =
                match tokio::time::timeout_at(deadline, start_tls(&tls, stream, conn)).await {
                    Ok(upgraded) => upgraded?,
                    Err(_) => return Err(SessionError::HandshakeTimeout),
                };
            serve_tls(upgraded, tenant, ctx, state, deadline, conn).await
        }
    }
}

/// Transmission on the whole stream: a TCP socket splits into its owned halves as before (no
/// lock between the reader and the writer task), any other stream through `tokio::io::split`.
async fn transmit_on<S: SessionStream>(
    stream: S,
    ctx: Arc<SessionContext>,
    negotiated: Negotiated,
    conn: &Admitted,
) -> Result<(), SessionError> {
    let stream: Box<dyn std::any::Any + Send> = Box::new(stream);
    match stream.downcast::<TcpStream>() {
        Ok(tcp) => {
            let (reader, writer) = tcp.into_split();
            transmit(reader, writer, ctx, negotiated, conn).await
        }
        Err(other) => {
            let Ok(stream) = other.downcast::<S>() else {
                unreachable!("the stream is an S")
            };
            let (reader, writer) = tokio::io::split(*stream);
            transmit(reader, writer, ctx, negotiated, conn).await
        }
    }
}

/// Sends the greeting and reads the client flags.
async fn greet<S: SessionStream>(stream: &mut S) -> Result<nbd::ClientFlags, SessionError> {
    let mut out = Vec::with_capacity(32);
    nbd::encode_server_greeting(&mut out);
    stream.write_all(&out).await?;
    let mut flags_buf = [0u8; 4];
    stream.read_exact(&mut flags_buf).await?;
    Ok(nbd::decode_client_flags(u32::from_be_bytes(flags_buf))?)
}

#[cfg(feature = "tls")]
type TlsStream<S> = tokio_openssl::SslStream<S>;
#[cfg(not(feature = "tls"))]
type TlsStream<S> = S;

/// The TLS handshake that follows our `NBD_REP_ACK` to `NBD_OPT_STARTTLS`; returns the
/// stream and the client's tenant (its PSK identity or certificate CN, `None` if anonymous).
#[cfg(feature = "tls")]
async fn start_tls<S: SessionStream>(
    tls: &Tls,
    stream: S,
    conn: &Admitted,
) -> Result<(TlsStream<S>, Option<String>), SessionError> {
    let (stream, peer) = tls
        .accept(stream, conn.peer().ip())
        .await
        .map_err(|err| SessionError::TlsHandshake(err.to_string()))?;
    tracing::debug!("TLS session up, peer {peer:?}");
    Ok((stream, peer.into_tenant()))
}

#[cfg(not(feature = "tls"))]
async fn start_tls<S: SessionStream>(
    tls: &Tls,
    _stream: S,
    _conn: &Admitted,
) -> Result<(TlsStream<S>, Option<String>), SessionError> {
    match *tls {}
}

/// Negotiation (again, from scratch but for the client flags) and transmission over TLS, for
/// `tenant`.
async fn serve_tls<S: SessionStream>(
    mut stream: TlsStream<S>,
    tenant: Option<String>,
    ctx: Arc<SessionContext>,
    plaintext: Haggling,
    deadline: tokio::time::Instant,
    conn: &Admitted,
) -> Result<(), SessionError> {
    // Nothing settled in plaintext survives the upgrade: a man in the middle could have
    // chosen it.
    let mut state = Haggling::new(plaintext.client_flags);
    state.tls_active = true;
    state.tenant = tenant;
    let outcome =
        match tokio::time::timeout_at(deadline, negotiate(&mut stream, &ctx, &mut state, conn))
            .await
        {
            Ok(outcome) => outcome?,
            Err(_) => return Err(SessionError::HandshakeTimeout),
        };
    match outcome {
        Outcome::Transmit(negotiated) => {
            let (reader, writer) = tokio::io::split(stream);
            transmit(reader, writer, ctx, negotiated, conn).await
        }
        // ABORT or EOF: close TLS politely (the client may already be gone).
        Outcome::End => {
            let _ = stream.shutdown().await;
            Ok(())
        }
        // `answer` refuses a second STARTTLS.
        Outcome::StartTls(_) => Ok(()),
    }
}

mod block_status;
mod job;
mod negotiate;
mod reply;
mod split;
#[cfg(test)]
mod tests;
mod transmit;

pub use block_status::{BLOCK_STATUS_MAX_DESCRIPTORS, BLOCK_STATUS_MAX_WALK_BYTES};
pub use job::{ClientJob, Grant, GrantSlot, IoJob, IoRunner, PendingGrant};

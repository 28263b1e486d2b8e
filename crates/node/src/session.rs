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

use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use headroom_nbd as nbd;
use headroom_nbd::consts;
use headroom_qos::OpKind;
use headroom_qos::routing::{ReadRouting, ReplicaLoad, route_read};
use headroom_store::{Store, StoreError, Volume};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};

use crate::admission::Admitted;
use crate::budget::{Budget, BudgetError, Charge};
use crate::buffers::{BufferPool, PooledBuffer};
use crate::clock::Clock;
use crate::config::Limits;
use crate::emulated::EmulatedDevice;
use crate::exec::{Lane, Lanes};
use crate::metrics::{MetricsRegistry, VolumeOp, VolumeStats};
use crate::scheduler::{IoDesc, Ready, Runner, Scheduler, Ticket, VolumeHandle};

/// The one metadata context we serve.
const ALLOCATION_CONTEXT_ID: u32 = nbd::BASE_ALLOCATION_CONTEXT_ID;
const ALLOCATION_CONTEXT_NAME: &str = nbd::BASE_ALLOCATION;
/// A batch of replies is written once it holds this many bytes (headers and payloads)...
const BATCH_BYTES_MAX: usize = 192 << 10;
/// ...or this many replies (each takes at most two of the kernel's 1,024 iovecs).
const BATCH_REPLIES_MAX: usize = 256;

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
fn book_per_device<'d>(
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
struct Negotiated {
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

// ---------------------------------------------------------------------------------------------
// Negotiation

/// How option haggling ended.
enum Outcome {
    /// The client ended it cleanly (ABORT or EOF).
    End,
    Transmit(Negotiated),
    /// We acknowledged `NBD_OPT_STARTTLS`: the TLS handshake comes next.
    StartTls(Arc<Tls>),
}

/// Runs option haggling on `stream` until the client enters transmission, starts TLS, or
/// leaves.
async fn negotiate<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    ctx: &SessionContext,
    state: &mut Haggling,
    conn: &Admitted,
) -> Result<Outcome, SessionError> {
    let mut out = Vec::with_capacity(256);
    loop {
        let mut header_buf = [0u8; 16];
        match stream.read_exact(&mut header_buf).await {
            Ok(_) => {}
            Err(err) if err.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(Outcome::End),
            Err(err) => return Err(err.into()),
        }
        let header = nbd::decode_option_header(&header_buf)?;
        out.clear();
        match nbd::option_data_action(&header) {
            nbd::OptionDataAction::Read => {}
            nbd::OptionDataAction::DiscardThenReply { reply_type } => {
                discard(stream, u64::from(header.length)).await?;
                nbd::encode_option_error(&mut out, header.option, reply_type, "option too large");
                stream.write_all(&out).await?;
                continue;
            }
            nbd::OptionDataAction::Close => {
                // Reading gigabytes to stay in sync would be a denial of service: say why (when
                // the option has an error reply at all), then close.
                if header.option != consts::NBD_OPT_EXPORT_NAME {
                    nbd::encode_option_error(
                        &mut out,
                        header.option,
                        consts::NBD_REP_ERR_TOO_BIG,
                        "option too large",
                    );
                    // Best effort: the client may already be gone.
                    let _ = stream.write_all(&out).await;
                }
                return Err(SessionError::OptionTooLarge(header.length));
            }
        }
        let mut data = vec![0u8; header.length as usize];
        stream.read_exact(&mut data).await?;
        let step = match nbd::decode_option(&header, &data) {
            Ok(option) => state.answer(ctx, header.option, option, &mut out)?,
            // A malformed EXPORT_NAME has no error reply: the spec's only answer is to close.
            Err(err) if err.closes_connection() => Step::End,
            Err(err) => {
                nbd::encode_option_error(
                    &mut out,
                    header.option,
                    err.reply_type(),
                    &err.to_string(),
                );
                Step::Continue
            }
        };
        match step {
            Step::Continue => stream.write_all(&out).await?,
            Step::Transmit(negotiated) => {
                // Transmitting (never evicted) from before the client can see the reply.
                let volume = &negotiated.volume;
                if !conn.enter_transmission(volume.name(), volume.tenant()) {
                    return Err(SessionError::Evicted);
                }
                stream.write_all(&out).await?;
                return Ok(Outcome::Transmit(negotiated));
            }
            Step::StartTls(tls) => {
                // The ACK is the last plaintext byte; the client starts the handshake.
                stream.write_all(&out).await?;
                stream.flush().await?;
                return Ok(Outcome::StartTls(tls));
            }
            Step::End => {
                // The client may close without reading a final ack; that is fine.
                let _ = stream.write_all(&out).await;
                return Ok(Outcome::End);
            }
        }
    }
}

/// What negotiation has settled so far.
struct Haggling {
    client_flags: nbd::ClientFlags,
    no_zeroes: bool,
    structured: bool,
    /// (export name, base:allocation selected) from the last SET_META_CONTEXT.
    meta_selection: Option<(String, bool)>,
    /// The session runs over TLS.
    tls_active: bool,
    /// Whose volumes this session may see: the TLS client's identity, `None` before TLS and
    /// for an anonymous TLS client (see `visible_export`).
    tenant: Option<String>,
}

/// What follows an option's reply.
enum Step {
    Continue,
    Transmit(Negotiated),
    StartTls(Arc<Tls>),
    End,
}

impl Haggling {
    fn new(client_flags: nbd::ClientFlags) -> Haggling {
        Haggling {
            client_flags,
            no_zeroes: client_flags.no_zeroes,
            structured: false,
            meta_selection: None,
            tls_active: false,
            tenant: None,
        }
    }

    /// The volume `name` if this session may see it, else `None`, the answer for a name no
    /// volume has: the callers answer both the same way, so a client cannot tell another
    /// tenant's volume from a missing one. A session with a tenant sees that tenant's volumes
    /// only; a session without one (plaintext, or TLS without a client identity) sees only
    /// volumes without a tenant.
    fn visible_export(&self, ctx: &SessionContext, name: &str) -> Option<Arc<Volume>> {
        let volume = ctx.store.open_volume(name).ok()?;
        if volume.tenant() == self.tenant.as_deref() {
            return Some(volume);
        }
        tracing::debug!(
            "session of tenant {:?} asked for {name:?}, a volume of tenant {:?}: answered as unknown",
            self.tenant,
            volume.tenant()
        );
        None
    }

    /// FORCEDTLS before the upgrade: "If the server receives any other option, it MUST reply
    /// with NBD_REP_ERR_TLS_REQD if TLS has not been initiated"; EXPORT_NAME cannot be
    /// refused, so "it MUST terminate the session". `None`: the option goes on to `answer`.
    fn refuse_without_tls(
        &self,
        ctx: &SessionContext,
        option_number: u32,
        option: &nbd::ClientOption,
        out: &mut Vec<u8>,
    ) -> Option<Result<Step, SessionError>> {
        if self.tls_active || !ctx.tls_required {
            return None;
        }
        match option {
            nbd::ClientOption::StartTls | nbd::ClientOption::Abort => None,
            nbd::ClientOption::ExportName(name) => {
                Some(Err(SessionError::TlsRequired(name.clone())))
            }
            _ => {
                let message = "this server requires TLS: send NBD_OPT_STARTTLS first";
                nbd::encode_option_error(out, option_number, consts::NBD_REP_ERR_TLS_REQD, message);
                Some(Ok(Step::Continue))
            }
        }
    }

    /// Appends the reply to one decoded option to `out` and says what comes next.
    fn answer(
        &mut self,
        ctx: &SessionContext,
        option_number: u32,
        option: nbd::ClientOption,
        out: &mut Vec<u8>,
    ) -> Result<Step, SessionError> {
        let unknown = |out: &mut Vec<u8>, name: &str| {
            let message = format!("no export named {name:?}");
            nbd::encode_option_error(out, option_number, consts::NBD_REP_ERR_UNKNOWN, &message);
            Step::Continue
        };
        let ack = |out: &mut Vec<u8>| {
            nbd::encode_option_reply(out, option_number, consts::NBD_REP_ACK, &[]);
        };
        if let Some(step) = self.refuse_without_tls(ctx, option_number, &option, out) {
            return step;
        }
        match option {
            nbd::ClientOption::ExportName(name) => {
                // The spec leaves no way to refuse EXPORT_NAME but closing.
                let Some(volume) = self.visible_export(ctx, &name) else {
                    return Err(SessionError::UnknownExport(name));
                };
                let flags = transmission_flags(&volume, self.structured);
                nbd::encode_export_name_reply(out, volume.size_bytes(), flags, self.no_zeroes);
                let allocation_context = self.structured && self.selected_for(&name);
                Ok(Step::Transmit(Negotiated {
                    volume,
                    structured: self.structured,
                    allocation_context,
                }))
            }
            nbd::ClientOption::Info(request) | nbd::ClientOption::Go(request) => {
                let Some(volume) = self.visible_export(ctx, &request.export_name) else {
                    return Ok(unknown(out, &request.export_name));
                };
                let flags = transmission_flags(&volume, self.structured);
                nbd::encode_info_export(out, option_number, volume.size_bytes(), flags);
                for info in &request.info_types {
                    match *info {
                        consts::NBD_INFO_NAME => {
                            nbd::encode_info_name(out, option_number, volume.name());
                        }
                        consts::NBD_INFO_DESCRIPTION => {
                            nbd::encode_info_description(out, option_number, &describe(&volume));
                        }
                        _ => {}
                    }
                }
                // Always sent: clients that did not ask still benefit from knowing our limit.
                nbd::encode_info_block_size(
                    out,
                    option_number,
                    nbd::MIN_BLOCK_BYTES,
                    nbd::PREFERRED_BLOCK_BYTES,
                    ctx.limits.max_request_bytes,
                );
                ack(out);
                if option_number != consts::NBD_OPT_GO {
                    return Ok(Step::Continue);
                }
                let allocation_context = self.structured && self.selected_for(&request.export_name);
                Ok(Step::Transmit(Negotiated {
                    volume,
                    structured: self.structured,
                    allocation_context,
                }))
            }
            nbd::ClientOption::List => {
                // Only the volumes this session could open (`visible_export`).
                let visible = ctx
                    .store
                    .list_volumes()
                    .into_iter()
                    .filter(|info| info.tenant == self.tenant);
                for info in visible {
                    let description = format!("{} bytes", info.size_bytes);
                    nbd::encode_rep_server(out, option_number, &info.name, &description);
                }
                ack(out);
                Ok(Step::Continue)
            }
            nbd::ClientOption::Abort => {
                ack(out);
                Ok(Step::End)
            }
            nbd::ClientOption::StructuredReply => {
                if self.structured {
                    nbd::encode_option_error(
                        out,
                        option_number,
                        consts::NBD_REP_ERR_INVALID,
                        "structured replies already negotiated",
                    );
                } else {
                    self.structured = true;
                    ack(out);
                }
                Ok(Step::Continue)
            }
            nbd::ClientOption::ListMetaContext(request)
            | nbd::ClientOption::SetMetaContext(request) => {
                let is_set = option_number == consts::NBD_OPT_SET_META_CONTEXT;
                if !self.structured {
                    nbd::encode_option_error(
                        out,
                        option_number,
                        consts::NBD_REP_ERR_INVALID,
                        "negotiate structured replies first",
                    );
                    return Ok(Step::Continue);
                }
                if self.visible_export(ctx, &request.export_name).is_none() {
                    return Ok(unknown(out, &request.export_name));
                }
                let matches = nbd::allocation_context_matches(&request.queries, is_set);
                if matches {
                    nbd::encode_rep_meta_context(
                        out,
                        option_number,
                        ALLOCATION_CONTEXT_ID,
                        ALLOCATION_CONTEXT_NAME,
                    );
                }
                ack(out);
                if is_set {
                    self.meta_selection = Some((request.export_name, matches));
                }
                Ok(Step::Continue)
            }
            nbd::ClientOption::StartTls => Ok(self.start_tls(ctx, option_number, out)),
            nbd::ClientOption::ExtendedHeaders => {
                let message = "not supported by this server";
                nbd::encode_option_error(out, option_number, consts::NBD_REP_ERR_UNSUP, message);
                Ok(Step::Continue)
            }
            nbd::ClientOption::Unknown(_) => {
                let message = "unknown option";
                nbd::encode_option_error(out, option_number, consts::NBD_REP_ERR_UNSUP, message);
                Ok(Step::Continue)
            }
        }
    }

    /// The answer to `NBD_OPT_STARTTLS` (spec, "TLS support").
    fn start_tls(&self, ctx: &SessionContext, option_number: u32, out: &mut Vec<u8>) -> Step {
        let refuse = |out: &mut Vec<u8>, reply_type: u32, message: &str| {
            nbd::encode_option_error(out, option_number, reply_type, message);
            Step::Continue
        };
        let Some(tls) = &ctx.tls else {
            // NOTLS: "MUST respond with NBD_REP_ERR_POLICY ... [or] NBD_REP_ERR_UNSUP (if it
            // does not support the NBD_OPT_STARTTLS option at all)".
            return refuse(
                out,
                consts::NBD_REP_ERR_UNSUP,
                "TLS is not configured on this server",
            );
        };
        if self.tls_active {
            // "If the server receives NBD_OPT_STARTTLS when TLS has already been negotiated, it
            // MUST reply with NBD_REP_ERR_INVALID."
            return refuse(out, consts::NBD_REP_ERR_INVALID, "TLS is already running");
        }
        if !self.client_flags.fixed_newstyle {
            // "The server MUST operate in NOTLS mode unless ... the client replied with
            // NBD_FLAG_C_FIXED_NEWSTYLE".
            return refuse(
                out,
                consts::NBD_REP_ERR_POLICY,
                "TLS needs fixed newstyle negotiation",
            );
        }
        nbd::encode_option_reply(out, option_number, consts::NBD_REP_ACK, &[]);
        Step::StartTls(Arc::clone(tls))
    }

    fn selected_for(&self, export: &str) -> bool {
        matches!(&self.meta_selection, Some((name, true)) if name == export)
    }
}

fn describe(volume: &Volume) -> String {
    format!("headroom volume {}", volume.name())
}

/// Flags we advertise for `volume` (`NBD_FLAG_READ_ONLY` for a read-only volume).
fn transmission_flags(volume: &Volume, structured: bool) -> u16 {
    nbd::transmission_flags(volume.read_only(), structured)
}

async fn discard<R: tokio::io::AsyncRead + Unpin>(
    reader: &mut R,
    bytes: u64,
) -> std::io::Result<()> {
    let copied = tokio::io::copy(&mut reader.take(bytes), &mut tokio::io::sink()).await?;
    if copied < bytes {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Transmission

/// Permits a request holds until its reply has been written: a request slot, and for READ
/// and WRITE its buffer's bytes from the connection's and the node's budgets.
#[derive(Debug)]
struct Permits {
    _request: OwnedSemaphorePermit,
    _bytes: Option<(OwnedSemaphorePermit, Charge)>,
}

enum ReplyBody {
    Done,
    Error(nbd::Errno, &'static str),
    Data {
        offset: u64,
        data: PooledBuffer,
    },
    /// A READ of a range that is all hole: one `NBD_REPLY_TYPE_OFFSET_HOLE` chunk, no payload.
    Hole {
        offset: u64,
        len: u32,
    },
    BlockStatus {
        extents: Vec<(u32, u32)>,
    },
}

struct Reply {
    cookie: u64,
    body: ReplyBody,
    _permits: Permits,
}

type ReplySender = mpsc::UnboundedSender<Reply>;

/// Where a session's replies go, and what counts them: one `Arc` per request in flight.
#[derive(Debug)]
struct ReplyPath {
    tx: ReplySender,
    stats: Arc<VolumeStats>,
    metrics: Arc<MetricsRegistry>,
}

/// What the statistics need of a request when its reply is handed to the writer.
#[derive(Clone, Copy, Debug)]
struct Tally {
    op: VolumeOp,
    /// Payload bytes (READ and WRITE).
    payload_bytes: u64,
    /// When its header was read (node clock).
    arrival_ns: u64,
}

impl Tally {
    fn of(request: &nbd::ValidRequest, arrival_ns: u64) -> Option<Tally> {
        let op = VolumeOp::of(request.command)?;
        let payload_bytes = match op {
            VolumeOp::Read | VolumeOp::Write => u64::from(request.length),
            _ => 0,
        };
        Some(Tally {
            op,
            payload_bytes,
            arrival_ns,
        })
    }
}

impl ReplyPath {
    /// Hands a reply to the writer at `now_ns` and counts it (arrival to then).
    fn send(&self, tally: Tally, reply: Reply, now_ns: u64) {
        let failed = matches!(reply.body, ReplyBody::Error(..));
        // Counted first, so a client that has its reply finds it counted.
        self.stats.complete(
            &self.metrics,
            tally.op,
            tally.payload_bytes,
            failed,
            tally.arrival_ns,
            now_ns,
        );
        // If the writer is gone the client is gone; dropping the reply releases its permits.
        let _ = self.tx.send(reply);
    }
}

/// Runs transmission on a connection's two halves: plain TCP halves (no lock between them) or
/// the halves of a TLS stream. Generic, so the plaintext path pays nothing for TLS.
async fn transmit<R, W>(
    read_half: R,
    write_half: W,
    ctx: Arc<SessionContext>,
    negotiated: Negotiated,
    conn: &Admitted,
) -> Result<(), SessionError>
where
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let mut reader = BufReader::with_capacity(128 << 10, read_half);
    let (reply_tx, reply_rx) = mpsc::unbounded_channel::<Reply>();
    let stall_ms = ctx.limits.client_stall_timeout_ms;
    let stall = Duration::from_millis(stall_ms);
    let writer = tokio::spawn(write_replies(
        write_half,
        reply_rx,
        negotiated.structured,
        Arc::clone(&ctx.io.buffers),
        stall,
    ));

    let max_requests = ctx.limits.max_inflight_requests_per_conn;
    let request_slots = Arc::new(Semaphore::new(max_requests));
    // `Limits::validate` keeps it below 4 GiB (semaphore permits are u32).
    let byte_budget = u32::try_from(ctx.limits.max_inflight_bytes_per_conn).unwrap_or(u32::MAX);
    let byte_slots = Arc::new(Semaphore::new(byte_budget as usize));
    conn.shared().set_slots(
        Arc::clone(&request_slots),
        max_requests,
        Arc::clone(&byte_slots),
        byte_budget as usize,
    );
    let volume = negotiated.volume;
    let account = ctx.budget.join(volume.tenant());
    let handle = ctx
        .scheduler
        .as_ref()
        .map(|scheduler| scheduler_handle(scheduler, &volume));
    let clock = ctx.io.clock;
    let path = Arc::new(ReplyPath {
        tx: reply_tx.clone(),
        stats: volume_stats(&ctx.metrics, &volume),
        metrics: Arc::clone(&ctx.metrics),
    });
    let mut last_end_bytes = u64::MAX / 2;
    let mut ready: Vec<Ready<IoJob>> = Vec::new();
    // Ends with the writer: when it gives up on a client that stopped reading, the reader
    // must not go on reading (and running) what the client keeps sending.
    let writer_gone = reply_tx.clone();

    let requests = async {
        loop {
            let mut header_buf = [0u8; nbd::REQUEST_HEADER_LEN];
            match reader.read_exact(&mut header_buf).await {
                Ok(_) => {}
                // A client that hangs up without NBD_CMD_DISC: nothing to answer.
                Err(err) if err.kind() == std::io::ErrorKind::UnexpectedEof => break Ok(()),
                Err(err) => break Err(err.into()),
            }
            if reply_tx.is_closed() {
                break Ok(());
            }
            crate::coalesce::note_request();
            let header = match nbd::decode_request_header(&header_buf) {
                Ok(header) => header,
                Err(err) => break Err(err.into()),
            };
            let arrival_ns = clock.now_ns();
            let Ok(request_permit) = request_slots.clone().acquire_owned().await else {
                break Ok(());
            };
            let limits = nbd::ExportLimits {
                size_bytes: volume.size_bytes(),
                read_only: volume.read_only(),
                max_payload_bytes: ctx.limits.max_request_bytes,
                structured_replies: negotiated.structured,
                allocation_context_id: negotiated
                    .allocation_context
                    .then_some(ALLOCATION_CONTEXT_ID),
            };
            let request = match nbd::validate_request(&header, &limits) {
                Ok(request) => request,
                Err(rejection) => {
                    let permits = Permits {
                        _request: request_permit,
                        _bytes: None,
                    };
                    let fatal = rejection.is_fatal();
                    let payload = rejection.payload_bytes();
                    if payload > 0
                        && !fatal
                        && let Err(err) = discard(&mut reader, u64::from(payload)).await
                    {
                        break Err(err.into());
                    }
                    let reply = Reply {
                        cookie: header.cookie,
                        body: ReplyBody::Error(rejection.errno(), rejection.message()),
                        _permits: permits,
                    };
                    match VolumeOp::of_type(header.command) {
                        Some(op) => {
                            let tally = Tally {
                                op,
                                payload_bytes: 0,
                                arrival_ns,
                            };
                            path.stats.arrive(&ctx.metrics, arrival_ns, 0);
                            path.send(tally, reply, clock.now_ns());
                        }
                        None => {
                            let _ = reply_tx.send(reply);
                        }
                    }
                    if !fatal {
                        continue;
                    }
                    break Ok(());
                }
            };
            tracing::trace!(
                command = request.command.name(),
                offset = request.offset,
                length = request.length,
                "request"
            );
            let Some(tally) = Tally::of(&request, arrival_ns) else {
                // NBD_CMD_DISC.
                break Ok(());
            };
            // READ and WRITE are charged their buffer, BLOCK_STATUS the largest reply it may
            // build: first against this connection's budget (waiting for its own replies),
            // then against its reserve or its tenant's and the node's shared pool.
            let charged_len = match request.command {
                nbd::Command::Read | nbd::Command::Write => Some(request.length),
                nbd::Command::BlockStatus => Some(BLOCK_STATUS_CHARGE_BYTES),
                _ => None,
            };
            let bytes_permit = match charged_len {
                Some(charged_len) => {
                    let charge_bytes = BufferPool::charge_bytes(charged_len);
                    // At most the class of a 32 MiB request.
                    let permits = u32::try_from(charge_bytes).unwrap_or(u32::MAX);
                    let Ok(conn_permit) = byte_slots.clone().acquire_many_owned(permits).await
                    else {
                        break Ok(());
                    };
                    match account.charge(charge_bytes).await {
                        Ok(charge) => Some((conn_permit, charge)),
                        Err(err) => break Err(err.into()),
                    }
                }
                None => None,
            };
            let permits = Permits {
                _request: request_permit,
                _bytes: bytes_permit,
            };
            conn.shared().note_inflight();
            let mut write_payload = None;
            if matches!(request.command, nbd::Command::Write) {
                let payload = write_payload.insert(ctx.io.buffers.get(request.length as usize));
                // A payload cut short (or stalled): the write never happened and nobody is left to
                // answer.
                match read_exact_progressing(&mut reader, payload.as_mut_slice(), stall).await {
                    Ok(()) => {}
                    Err(err) if is_stalled(&err) => {
                        break Err(SessionError::PayloadStalled(stall_ms));
                    }
                    Err(err) => break Err(err.into()),
                }
            }
            // Counted as arrived (at its header's time) only now that nothing can stop it
            // from being answered: the audit must see every arrival leave.
            path.stats
                .arrive(&ctx.metrics, arrival_ns, tally.payload_bytes);
            let mut submit = |job: IoJob| {
                let io = job.desc();
                let scheduled = ctx.scheduler.as_ref().zip(handle.as_ref());
                let end = io.offset_bytes.saturating_add(u64::from(io.len_bytes));
                let sequential = scheduled.is_none()
                    && headroom_qos::model::is_sequential(last_end_bytes, io.offset_bytes);
                if scheduled.is_none() {
                    last_end_bytes = end;
                }
                submit_job(&ctx.io, scheduled, job, sequential, &mut ready);
            };
            let piece_bytes = piece_bytes_of(&request, ctx.limits.max_request_bytes);
            if needs_split(&request, piece_bytes) {
                // One reply for the request, sent when its last piece completes; each piece is
                // scheduled, charged and run as a request of its own, at most
                // `SPLIT_PIECES_IN_FLIGHT` at once (the rest are submitted as those complete).
                let pieces = match request.command {
                    nbd::Command::Cache => cache_work(&volume, pieces(&request, piece_bytes)),
                    _ => pieces(&request, piece_bytes),
                };
                let feeder = PieceFeeder {
                    volume: Arc::clone(&volume),
                    io: Arc::clone(&ctx.io),
                    scheduled: ctx.scheduler.clone().zip(handle.clone()),
                };
                let split =
                    SplitRequest::new(&request, pieces, permits, Arc::clone(&path), tally, feeder);
                for _ in 0..SPLIT_PIECES_IN_FLIGHT {
                    match split.next_piece() {
                        Some(job) => submit(job),
                        None => break,
                    }
                }
                continue;
            }
            // With structured replies, a READ of a hole is answered by a hole chunk instead of
            // zeros (as qemu-nbd does), unless the client asked for one data chunk (DF).
            let sparse_read = negotiated.structured && !request.df;
            submit(IoJob::Client(ClientJob {
                volume: Arc::clone(&volume),
                request,
                write_payload,
                sparse_read,
                answer: Answer::Whole {
                    permits,
                    reply: Arc::clone(&path),
                    tally,
                },
            }));
        }
    };
    let result = tokio::select! {
        result = requests => result,
        () = writer_gone.closed() => Ok(()),
    };
    drop(writer_gone);
    drop(reply_tx);
    drop(path);
    // Replies for everything already accepted are still delivered (NBD_CMD_DISC semantics).
    let written = match writer.await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(err)) if is_stalled(&err) => Err(SessionError::RepliesStalled(stall_ms)),
        Ok(Err(err)) => {
            tracing::debug!("reply writer ended: {err}");
            Ok(())
        }
        Err(err) => {
            tracing::warn!("reply writer failed: {err}");
            Ok(())
        }
    };
    drop(account);
    result.and(written)
}

/// The volume's statistics, registering it with its stored QoS if they are new.
fn volume_stats(metrics: &MetricsRegistry, volume: &Volume) -> Arc<VolumeStats> {
    if let Some(stats) = metrics.get(volume.id()) {
        return stats;
    }
    let qos = crate::volume_qos::effective_qos(volume.qos().as_deref(), volume.size_bytes());
    metrics.volume(volume.id(), volume.name(), &qos)
}

/// The scheduler's handle for a volume, registering it with no QoS if the scheduler has not
/// seen it (a volume created while the node starts).
fn scheduler_handle(scheduler: &Scheduler<IoJob>, volume: &Volume) -> Arc<VolumeHandle> {
    if let Some(handle) = scheduler.handle(volume.id()) {
        return handle;
    }
    let qos = crate::volume_qos::effective_qos(volume.qos().as_deref(), volume.size_bytes());
    scheduler.add_volume(volume.id(), &qos)
}

// ---------------------------------------------------------------------------------------------
// Requests larger than one backend operation

/// Smallest piece a split request is cut into, whatever `max_request_bytes` says (a tiny
/// configured maximum must not turn a 4 GiB TRIM into millions of pieces).
const MIN_PIECE_BYTES: u32 = 1 << 20;

/// Submits `job` to the scheduler (and runs what it dispatches, with `ready` as the
/// scratch vector), or without one runs it at once, as `sequential` or not: what a session
/// does with each request and a split request with each piece it feeds.
fn submit_job(
    io: &Arc<IoRuntime>,
    scheduled: Option<(&Arc<Scheduler<IoJob>>, &Arc<VolumeHandle>)>,
    job: IoJob,
    sequential: bool,
    ready: &mut Vec<Ready<IoJob>>,
) {
    match scheduled {
        Some((scheduler, handle)) => {
            let desc = job.desc();
            scheduler.submit(handle, desc, job, ready);
            if !ready.is_empty() {
                run_ready_in(io, Some(scheduler), ready);
            }
        }
        None => {
            if let Some(released) = run_job(io, None, job, Unscheduled(sequential)) {
                debug_assert!(released.is_empty());
            }
        }
    }
}

/// How many pieces of one split request the node holds at once (queued at the scheduler or
/// running): one running and one waiting, so a request's pieces keep its device busy
/// without taking every I/O worker. Submitting all of them at once let one client at queue
/// depth 1 run eight 32 MiB zeroings in parallel (the executor started helper threads for
/// them) and take both cores of a small machine from everyone else.
const SPLIT_PIECES_IN_FLIGHT: usize = 2;

/// Pieces of the commands whose work grows with their length (zeroing in place, CACHE's
/// readahead) are at most one extent, so no single dispatch holds the scheduler's capacity
/// (or a worker) for long; TRIM and a releasing WRITE_ZEROES are metadata per extent and
/// keep the maximum block size.
const WORK_PIECE_BYTES: u32 = headroom_store::EXTENT_SIZE_BYTES as u32;

/// The piece size `request` is cut into when it is larger (`needs_split`).
fn piece_bytes_of(request: &nbd::ValidRequest, max_request_bytes: u32) -> u32 {
    let whole = max_request_bytes.max(MIN_PIECE_BYTES);
    let per_byte_work = matches!(request.command, nbd::Command::Cache)
        || (matches!(request.command, nbd::Command::WriteZeroes) && request.no_hole);
    if per_byte_work {
        whole.min(WORK_PIECE_BYTES)
    } else {
        whole
    }
}

/// Whether `request` is run as several pieces of at most `piece_bytes`. WRITE_ZEROES, TRIM and
/// CACHE carry no payload, so validation accepts them up to the export size (4 GiB - 1 on the
/// wire); cutting them at the maximum block size keeps every backend operation (a zero-filled
/// write, a punch, a readahead) and every scheduler charge bounded, and lets other volumes'
/// requests run between the pieces. BLOCK_STATUS is not split but cut short instead: its reply
/// describes one contiguous run of extents, and may end early ([`BLOCK_STATUS_MAX_WALK_BYTES`]).
fn needs_split(request: &nbd::ValidRequest, piece_bytes: u32) -> bool {
    matches!(
        request.command,
        nbd::Command::WriteZeroes | nbd::Command::Trim | nbd::Command::Cache
    ) && request.length > piece_bytes
}

/// The pieces of a CACHE that have something to read ahead: the first one (so the request is
/// charged and answered as any split request is), and every later one over an allocated
/// extent. A piece over holes does nothing (`Volume::cache` skips them) but would cost a
/// scheduler charge and an executor hop: a client looping 32 MiB CACHEs over a thin volume
/// sent 16 of them per request, about 30,000 a second.
fn cache_work(volume: &Volume, pieces: Vec<nbd::ValidRequest>) -> Vec<nbd::ValidRequest> {
    pieces
        .into_iter()
        .enumerate()
        .filter(|(i, p)| *i == 0 || volume.holds_data_in(p.offset, u64::from(p.length)))
        .map(|(_, p)| p)
        .collect()
}

/// Cuts `request` at multiples of `piece_bytes` (absolute offsets, so that pieces cover whole
/// extents except at the request's ends).
fn pieces(request: &nbd::ValidRequest, piece_bytes: u32) -> Vec<nbd::ValidRequest> {
    let piece_bytes = u64::from(piece_bytes.max(1));
    let end = request.offset.saturating_add(u64::from(request.length));
    let mut out = Vec::with_capacity(
        usize::try_from(u64::from(request.length) / piece_bytes + 2).unwrap_or(0),
    );
    let mut offset = request.offset;
    while offset < end {
        let boundary = (offset / piece_bytes)
            .saturating_add(1)
            .saturating_mul(piece_bytes);
        let piece_end = boundary.min(end);
        // piece_end - offset <= piece_bytes <= u32::MAX.
        let length = u32::try_from(piece_end - offset).unwrap_or(u32::MAX);
        out.push(nbd::ValidRequest {
            offset,
            length,
            ..*request
        });
        offset = piece_end;
    }
    out
}

/// The shared state of a request split into pieces: the last piece to complete sends the one
/// reply, with the first failure (by offset) if any piece failed, and releases the permits.
/// It also feeds the pieces to the scheduler, [`SPLIT_PIECES_IN_FLIGHT`] at a time.
#[derive(Debug)]
struct SplitRequest {
    cookie: u64,
    remaining: AtomicUsize,
    state: Mutex<SplitState>,
    reply: Arc<ReplyPath>,
    tally: Tally,
    feeder: PieceFeeder,
}

#[derive(Debug)]
struct SplitState {
    /// (piece index, errno, message) of the lowest failed piece.
    failure: Option<(usize, nbd::Errno, &'static str)>,
    permits: Option<Permits>,
    /// Pieces not submitted yet, in offset order, and the index of the first of them.
    unsubmitted: std::collections::VecDeque<nbd::ValidRequest>,
    next_index: usize,
}

/// What submitting a piece needs, from the session that received the request.
#[derive(Debug)]
struct PieceFeeder {
    volume: Arc<Volume>,
    io: Arc<IoRuntime>,
    scheduled: Option<(Arc<Scheduler<IoJob>>, Arc<VolumeHandle>)>,
}

impl SplitRequest {
    fn new(
        request: &nbd::ValidRequest,
        pieces: Vec<nbd::ValidRequest>,
        permits: Permits,
        reply: Arc<ReplyPath>,
        tally: Tally,
        feeder: PieceFeeder,
    ) -> Arc<SplitRequest> {
        Arc::new(SplitRequest {
            cookie: request.cookie,
            remaining: AtomicUsize::new(pieces.len()),
            state: Mutex::new(SplitState {
                failure: None,
                permits: Some(permits),
                unsubmitted: pieces.into(),
                next_index: 0,
            }),
            reply,
            tally,
            feeder,
        })
    }

    /// The next piece to submit, as a job, if any is left.
    fn next_piece(self: &Arc<Self>) -> Option<IoJob> {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let piece = state.unsubmitted.pop_front()?;
        let index = state.next_index;
        state.next_index += 1;
        drop(state);
        Some(IoJob::Client(ClientJob {
            volume: Arc::clone(&self.feeder.volume),
            request: piece,
            write_payload: None,
            sparse_read: false,
            answer: Answer::Piece {
                split: Arc::clone(self),
                index,
            },
        }))
    }

    /// Submits the next piece, if any, after one completed (on the completing thread). Its
    /// pieces never run inline (`runs_off_thread`), so this does not recurse.
    fn feed(self: &Arc<Self>) {
        let Some(job) = self.next_piece() else {
            return;
        };
        let scheduled = self.feeder.scheduled.as_ref().map(|(s, h)| (s, h));
        // The pieces are contiguous: each follows the previous one.
        submit_job(&self.feeder.io, scheduled, job, true, &mut Vec::new());
    }

    /// Records one piece's outcome; answers the request when it was the last, and otherwise
    /// submits the next piece.
    fn piece_done(self: &Arc<Self>, index: usize, body: ReplyBody, now_ns: u64) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if let ReplyBody::Error(errno, message) = body
            && state.failure.is_none_or(|(first, _, _)| index < first)
        {
            state.failure = Some((index, errno, message));
        }
        if self.remaining.fetch_sub(1, Ordering::AcqRel) != 1 {
            drop(state);
            self.feed();
            return;
        }
        let Some(permits) = state.permits.take() else {
            return;
        };
        let body = match state.failure {
            Some((_, errno, message)) => ReplyBody::Error(errno, message),
            None => ReplyBody::Done,
        };
        drop(state);
        self.reply.send(
            self.tally,
            Reply {
                cookie: self.cookie,
                body,
                _permits: permits,
            },
            now_ns,
        );
    }
}

/// How a job's outcome reaches the client.
#[derive(Debug)]
enum Answer {
    /// The job is the whole request: its reply goes out when it completes.
    Whole {
        permits: Permits,
        reply: Arc<ReplyPath>,
        tally: Tally,
    },
    /// The job is piece `index` of a split request.
    Piece {
        split: Arc<SplitRequest>,
        index: usize,
    },
}

impl Answer {
    /// Answers the request at `now_ns` (node clock).
    fn deliver(self, cookie: u64, body: ReplyBody, now_ns: u64) {
        match self {
            Answer::Whole {
                permits,
                reply,
                tally,
            } => reply.send(
                tally,
                Reply {
                    cookie,
                    body,
                    _permits: permits,
                },
                now_ns,
            ),
            Answer::Piece { split, index } => split.piece_done(index, body, now_ns),
        }
    }
}

/// What the scheduler runs: a client's request, or a grant for the node's own work (the
/// rebuild of lost copies), which is charged and paced by the same policy as a tenant of its
/// own, so that it takes its share of the node and no more.
#[derive(Debug)]
pub enum IoJob {
    Client(ClientJob),
    Grant(Grant),
}

impl IoJob {
    /// The request as the scheduler sees it.
    fn desc(&self) -> IoDesc {
        match self {
            IoJob::Client(job) => job.desc(),
            IoJob::Grant(grant) => grant.desc,
        }
    }
}

/// Node-internal work that waits for the scheduler: submitted with
/// [`Grant::submit`], dispatched by the policy like a request (the runner then hands the
/// ticket over instead of running anything), done by the submitter, and completed with
/// [`Grant::complete`], which is when the policy learns the work is over.
#[derive(Debug)]
pub struct Grant {
    desc: IoDesc,
    slot: Arc<GrantSlot>,
}

/// Where a dispatched grant's ticket waits for its submitter.
#[derive(Debug, Default)]
pub struct GrantSlot {
    state: Mutex<GrantState>,
    dispatched: std::sync::Condvar,
}

#[derive(Debug, Default)]
struct GrantState {
    ticket: Option<Ticket>,
    /// The submitter stopped waiting: a later dispatch completes the grant at once.
    abandoned: bool,
}

impl Grant {
    /// Submits `desc` for `handle` (a volume key the caller registered with
    /// `Scheduler::add_volume`); [`PendingGrant::wait`] then blocks until the policy
    /// dispatches it. Dropping the pending grant before that gives it up: it is completed as
    /// soon as it is dispatched, so the scheduler's books stay right.
    pub fn submit(
        io: &Arc<IoRuntime>,
        scheduler: &Arc<Scheduler<IoJob>>,
        handle: &Arc<VolumeHandle>,
        desc: IoDesc,
    ) -> PendingGrant {
        let slot = Arc::new(GrantSlot::default());
        let mut ready = Vec::new();
        scheduler.submit(
            handle,
            desc,
            IoJob::Grant(Grant {
                desc,
                slot: Arc::clone(&slot),
            }),
            &mut ready,
        );
        if !ready.is_empty() {
            run_ready(io, Some(scheduler), ready);
        }
        PendingGrant {
            slot,
            io: Arc::clone(io),
            scheduler: Arc::clone(scheduler),
        }
    }

    /// The work a dispatched grant admitted is done: the policy is told, and whatever that
    /// releases runs.
    pub fn complete(io: &Arc<IoRuntime>, scheduler: &Arc<Scheduler<IoJob>>, ticket: Ticket) {
        let mut released = Vec::new();
        scheduler.complete_at(ticket, io.clock.now_ns(), &mut released);
        if !released.is_empty() {
            run_ready(io, Some(scheduler), released);
        }
    }

    /// The runner's side: hands the ticket to the waiting submitter, or completes it at once
    /// when nobody waits any more. Returns what that completion released.
    fn dispatched(
        self,
        io: &IoRuntime,
        scheduler: Option<&Arc<Scheduler<IoJob>>>,
        admission: Admission,
    ) -> Option<Vec<Ready<IoJob>>> {
        let Scheduled(ticket) = admission else {
            return None;
        };
        let mut state = self.slot.state.lock().unwrap_or_else(|p| p.into_inner());
        if !state.abandoned {
            state.ticket = Some(ticket);
            drop(state);
            self.slot.dispatched.notify_all();
            return None;
        }
        drop(state);
        let scheduler = scheduler?;
        let mut released = Vec::new();
        scheduler.complete_at(ticket, io.clock.now_ns(), &mut released);
        Some(released)
    }
}

/// A submitted grant whose submitter waits for its dispatch ([`Grant::submit`]).
#[derive(Debug)]
pub struct PendingGrant {
    slot: Arc<GrantSlot>,
    io: Arc<IoRuntime>,
    scheduler: Arc<Scheduler<IoJob>>,
}

impl PendingGrant {
    /// The ticket once the policy dispatched the grant, or `None` after `timeout` (call
    /// again to keep waiting).
    pub fn wait(&self, timeout: Duration) -> Option<Ticket> {
        let deadline = std::time::Instant::now() + timeout;
        let mut state = self.slot.state.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(t) = state.ticket.take() {
                return Some(t);
            }
            let now = std::time::Instant::now();
            if now >= deadline {
                return None;
            }
            state = self
                .slot
                .dispatched
                .wait_timeout(state, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

impl Drop for PendingGrant {
    fn drop(&mut self) {
        // Under the lock, so a dispatch either came before (its ticket is here) or sees this
        // and completes the grant itself.
        let mut state = self.slot.state.lock().unwrap_or_else(|p| p.into_inner());
        state.abandoned = true;
        let ticket = state.ticket.take();
        drop(state);
        if let Some(ticket) = ticket {
            Grant::complete(&self.io, &self.scheduler, ticket);
        }
    }
}

/// One validated request (or piece of one) with everything needed to run it and answer it.
#[derive(Debug)]
pub struct ClientJob {
    volume: Arc<Volume>,
    request: nbd::ValidRequest,
    write_payload: Option<PooledBuffer>,
    /// A READ whose range is all hole may be answered with `ReplyBody::Hole`.
    sparse_read: bool,
    answer: Answer,
}

impl ClientJob {
    /// The request as the scheduler sees it ([`desc_of`]).
    fn desc(&self) -> IoDesc {
        desc_of(&self.volume, &self.request)
    }

    /// Whether it must leave the calling thread: [`runs_off_thread`].
    fn runs_on_executor(&self, io: &IoRuntime) -> bool {
        runs_off_thread(&self.request, io)
    }
}

/// The request as the scheduler sees it: every request is charged, reads of holes too,
/// and each as the device work it does. CACHE is readahead, a read of its length from the
/// device (its egress, which it does not send, is counted too: over, not under);
/// WRITE_ZEROES that may not punch provisions and zeroes its range (`OpKind::WriteZeroes`:
/// CPU and metadata per KiB, no payload), and where the volume's devices cannot zero a range
/// in place it writes zeros, a write of its length; one that may punch is a discard, a TRIM;
/// BLOCK_STATUS walks the extent map and asks the device where its data is, one small read's
/// worth (its walk is bounded: [`BLOCK_STATUS_MAX_WALK_BYTES`]). A FUA request also pays for
/// the device sync it runs, and a FLUSH for one sync per device with writes not yet durable
/// (the pool-wide commit it causes: `Volume::unsynced_devices`), at least one.
fn desc_of(volume: &Volume, request: &nbd::ValidRequest) -> IoDesc {
    let (op, len_bytes) = match request.command {
        nbd::Command::Read => (OpKind::Read, request.length),
        nbd::Command::Write => (OpKind::Write, request.length),
        nbd::Command::Flush => (OpKind::Flush, 0),
        // Refused at once (not faster than a write): costs what a refusal costs.
        nbd::Command::WriteZeroes if request.no_hole && request.fast_zero => (OpKind::Trim, 0),
        nbd::Command::WriteZeroes if request.no_hole && !volume.is_zero_fast() => {
            (OpKind::Write, request.length)
        }
        nbd::Command::WriteZeroes if request.no_hole => (OpKind::WriteZeroes, request.length),
        nbd::Command::WriteZeroes => (OpKind::Trim, request.length),
        nbd::Command::Trim => (OpKind::Trim, request.length),
        nbd::Command::Cache => (OpKind::Read, request.length),
        nbd::Command::BlockStatus => (OpKind::Read, 0),
        nbd::Command::Disc => (OpKind::Trim, 0),
    };
    let syncs = match request.command {
        nbd::Command::Flush => volume.unsynced_devices().max(1),
        nbd::Command::Read | nbd::Command::Cache | nbd::Command::BlockStatus => 0,
        _ => u32::from(request.fua),
    };
    IoDesc {
        op,
        offset_bytes: request.offset,
        len_bytes,
        syncs,
    }
}

/// Whether it must leave the calling thread (a network thread, which carries other
/// connections, of other tenants too): whatever may block in the kernel always (FLUSH's
/// fsync and any FUA request's `fdatasync`, TRIM's and WRITE_ZEROES' fallocate, CACHE's
/// readahead, BLOCK_STATUS's lseeks over the device files), large copies when there are
/// workers; small READs and WRITEs
/// run inline, where a thread hop would cost more than they do.
fn runs_off_thread(request: &nbd::ValidRequest, io: &IoRuntime) -> bool {
    let moved = match request.command {
        nbd::Command::Read | nbd::Command::Write => request.length,
        _ => 0,
    };
    let blocking = matches!(
        request.command,
        nbd::Command::Flush
            | nbd::Command::Trim
            | nbd::Command::WriteZeroes
            | nbd::Command::Cache
            | nbd::Command::BlockStatus
    ) || request.fua;
    blocking || (io.lanes.is_some() && moved > io.inline_max_bytes)
}

/// The executor lane a request runs on when it leaves the calling thread: bulk work (CACHE,
/// WRITE_ZEROES, TRIM, BLOCK_STATUS, FUA or not: its length is the work) on the low-priority
/// lane, FLUSH and FUA READs and WRITEs on the sync lane, the rest on the data lane; so a 4 KiB
/// read never queues behind a neighbour's zeroing or `fdatasync` (exec.rs, "Lanes").
fn lane_of(request: &nbd::ValidRequest) -> Lane {
    match request.command {
        nbd::Command::Cache
        | nbd::Command::WriteZeroes
        | nbd::Command::Trim
        | nbd::Command::BlockStatus => Lane::Bulk,
        nbd::Command::Flush => Lane::Sync,
        _ if request.fua => Lane::Sync,
        _ => Lane::Data,
    }
}

/// Runs jobs for the scheduler's wake-up thread.
#[derive(Debug)]
pub struct IoRunner(pub Arc<IoRuntime>);

impl Runner<IoJob> for IoRunner {
    fn run(&self, scheduler: &Arc<Scheduler<IoJob>>, ready: Vec<Ready<IoJob>>) {
        run_ready(&self.0, Some(scheduler), ready);
    }
}

/// Why a job runs: the scheduler dispatched it, or there is no scheduler (then with the
/// IOCost sequential flag the session computed).
enum Admission {
    Scheduled(Ticket),
    Unscheduled(bool),
}
use Admission::{Scheduled, Unscheduled};

impl Admission {
    fn sequential(&self) -> bool {
        match self {
            Scheduled(ticket) => ticket.sequential(),
            Unscheduled(sequential) => *sequential,
        }
    }
}

/// Runs dispatched jobs and whatever their completions release, in order.
fn run_ready(
    io: &Arc<IoRuntime>,
    scheduler: Option<&Arc<Scheduler<IoJob>>>,
    mut ready: Vec<Ready<IoJob>>,
) {
    run_ready_in(io, scheduler, &mut ready);
}

/// `run_ready` on a vector the caller keeps (a session's): its allocation serves the next
/// request too. Leaves it empty.
fn run_ready_in(
    io: &Arc<IoRuntime>,
    scheduler: Option<&Arc<Scheduler<IoJob>>>,
    ready: &mut Vec<Ready<IoJob>>,
) {
    let mut work: std::collections::VecDeque<Ready<IoJob>> = std::mem::take(ready).into();
    while let Some(Ready { job, ticket }) = work.pop_front() {
        if let Some(released) = run_job(io, scheduler, job, Scheduled(ticket)) {
            work.extend(released);
        }
    }
    // Empty, hence contiguous: the conversion keeps the buffer.
    *ready = work.into();
}

/// Runs one job inline or on the executor. Returns the jobs its completion released when it
/// completed inline (the caller runs them), so a chain of releases never recurses.
fn run_job(
    io: &Arc<IoRuntime>,
    scheduler: Option<&Arc<Scheduler<IoJob>>>,
    job: IoJob,
    admission: Admission,
) -> Option<Vec<Ready<IoJob>>> {
    let job = match job {
        IoJob::Client(job) => job,
        IoJob::Grant(grant) => return grant.dispatched(io, scheduler, admission),
    };
    // `None`: it went to the cluster asynchronously and is answered from its completion.
    let (job, admission) = start_async(io, scheduler, job, admission)?;
    if !job.runs_on_executor(io) {
        return execute_and_finish(io, scheduler, job, admission);
    }
    let lane = lane_of(&job.request);
    let task = {
        let io = Arc::clone(io);
        let scheduler = scheduler.cloned();
        move || {
            if let Some(released) = execute_and_finish(&io, scheduler.as_ref(), job, admission) {
                run_ready(&io, scheduler.as_ref(), released);
            }
        }
    };
    match &io.lanes {
        Some(lanes) => {
            if let Err(task) = lanes.get(lane).submit(Box::new(task)) {
                task();
            }
        }
        // FLUSH may take milliseconds (fsync): never on a runtime thread.
        None => {
            io.runtime.spawn_blocking(task);
        }
    }
    None
}

/// A READ, or a WRITE without FUA, of a volume on RADOS goes to the cluster asynchronously
/// (headroom_store's volume_aio.rs; docs/ARCHITECTURE.md, decision 25):
/// prepared on the calling thread, answered from librados' completion thread, so no I/O
/// thread waits for the cluster and many requests are in flight without a thread each.
/// `Some` hands the job back for the synchronous path (other requests and backends, holes,
/// FUA, an emulated device, injected faults).
fn start_async(
    io: &Arc<IoRuntime>,
    scheduler: Option<&Arc<Scheduler<IoJob>>>,
    job: ClientJob,
    admission: Admission,
) -> Option<(ClientJob, Admission)> {
    let write = match job.request.command {
        nbd::Command::Read => false,
        nbd::Command::Write if !job.request.fua => true,
        _ => return Some((job, admission)),
    };
    if job.request.length == 0 || !matches!(io.emulation, Emulation::Off) {
        return Some((job, admission));
    }
    let request = job
        .volume
        .start_async(job.request.offset, u64::from(job.request.length), write);
    let request = match request {
        Ok(None) => return Some((job, admission)),
        Ok(Some(request)) => Ok(request),
        Err(err) => Err(err),
    };
    let ClientJob {
        request: nbd_request,
        write_payload,
        answer,
        ..
    } = job;
    let (cookie, offset) = (nbd_request.cookie, nbd_request.offset);
    let finish = {
        let io = Arc::clone(io);
        let scheduler = scheduler.cloned();
        move |body: ReplyBody| {
            let now_ns = io.clock.now_ns();
            answer.deliver(cookie, body, now_ns);
            let (Some(scheduler), Scheduled(ticket)) = (scheduler, admission) else {
                return;
            };
            let mut released = Vec::new();
            scheduler.complete_at(ticket, now_ns, &mut released);
            if released.is_empty() {
                return;
            }
            // Not here: this may be librados' completion thread, which must not block (a
            // released FLUSH or TRIM would) and serves the other completions.
            let task = {
                let io = Arc::clone(&io);
                move || run_ready(&io, Some(&scheduler), released)
            };
            match &io.lanes {
                Some(lanes) => {
                    if let Err(task) = lanes.get(Lane::Data).submit(Box::new(task)) {
                        io.runtime.spawn_blocking(task);
                    }
                }
                None => {
                    io.runtime.spawn_blocking(task);
                }
            }
        }
    };
    let error = move |err: &StoreError| {
        tracing::debug!("request at {offset} failed: {err}");
        let (errno, message) = store_errno(err);
        ReplyBody::Error(errno, message)
    };
    let buffers = Arc::clone(&io.buffers);
    match (request, write_payload) {
        (Err(err), payload) => {
            if let Some(payload) = payload {
                buffers.put(payload);
            }
            finish(error(&err));
        }
        (Ok(request), Some(payload)) if write => request.submit(
            payload,
            Box::new(move |payload, result| {
                buffers.put(payload);
                finish(match result {
                    Ok(()) => ReplyBody::Done,
                    Err(err) => error(&err),
                });
            }),
        ),
        // validate_request only yields WRITE with its payload read; keep the errno honest.
        (Ok(_), None) if write => {
            finish(ReplyBody::Error(nbd::Errno::Eio, "write payload missing"))
        }
        (Ok(request), payload) => {
            if let Some(payload) = payload {
                buffers.put(payload);
            }
            let data = buffers.get(nbd_request.length as usize);
            request.submit(
                data,
                Box::new(move |data, result| match result {
                    Ok(()) => finish(ReplyBody::Data { offset, data }),
                    Err(err) => {
                        buffers.put(data);
                        finish(error(&err));
                    }
                }),
            );
        }
    }
    None
}

/// Performs the request, then answers it and reports its completion: at once, or when the
/// emulated device says it is done. Returns what the completion released if it happened here.
fn execute_and_finish(
    io: &Arc<IoRuntime>,
    scheduler: Option<&Arc<Scheduler<IoJob>>>,
    job: ClientJob,
    admission: Admission,
) -> Option<Vec<Ready<IoJob>>> {
    let desc = job.desc();
    let sequential = admission.sequential();
    let ClientJob {
        volume,
        request,
        write_payload,
        sparse_read,
        answer,
    } = job;
    let routed = match desc.op {
        OpKind::Read => io.reads.route(&volume, request.offset, sequential),
        _ => None,
    };
    let body = execute(
        &io.buffers,
        &volume,
        &request,
        write_payload,
        sparse_read,
        routed.map_or(0, |r| r.copy),
    );
    let cookie = request.cookie;
    let clock = io.clock;
    let routed_on = routed.map(|r| (Arc::clone(io), r.device));
    let finish = move |scheduler: Option<&Arc<Scheduler<IoJob>>>| {
        // One clock read for the reply's statistics and the scheduler's completion.
        let now_ns = clock.now_ns();
        answer.deliver(cookie, body, now_ns);
        if let Some((io, device)) = &routed_on {
            io.reads.done(*device);
        }
        let mut released = Vec::new();
        if let (Some(scheduler), Scheduled(ticket)) = (scheduler, admission) {
            scheduler.complete_at(ticket, now_ns, &mut released);
        }
        released
    };
    let now_ns = io.clock.now_ns();
    let (device, done_ns) = match &io.emulation {
        Emulation::Off => return Some(finish(scheduler)),
        Emulation::Node(device) => {
            // One device for the whole pool: each volume has its own region of it.
            let position = volume
                .id()
                .wrapping_mul(headroom_store::MAX_VOLUME_SIZE_BYTES)
                .wrapping_add(request.offset);
            (
                device,
                device.book(now_ns, desc.op, position, desc.len_bytes, sequential),
            )
        }
        Emulation::PerDevice(devices) => {
            let copy = routed.map(|r| r.copy);
            match book_per_device(devices, &volume, &request, desc, sequential, copy, now_ns) {
                Some(booked) => booked,
                None => return Some(finish(scheduler)),
            }
        }
    };
    let io = Arc::clone(io);
    let scheduler = scheduler.cloned();
    device.complete_at(
        done_ns,
        Box::new(move || {
            let released = finish(scheduler.as_ref());
            if !released.is_empty() {
                run_ready(&io, scheduler.as_ref(), released);
            }
        }),
    );
    None
}

/// Performs the block operation and builds the reply.
fn execute(
    buffers: &BufferPool,
    volume: &Volume,
    request: &nbd::ValidRequest,
    write_payload: Option<PooledBuffer>,
    sparse_read: bool,
    first_copy: u8,
) -> ReplyBody {
    let offset = request.offset;
    let length = u64::from(request.length);
    let outcome = match request.command {
        nbd::Command::Read => {
            let mut data = buffers.get(request.length as usize);
            let read = if sparse_read && request.length > 0 {
                volume.read_at_unless_hole_from(offset, data.as_mut_slice(), first_copy)
            } else {
                volume
                    .read_at_from(offset, data.as_mut_slice(), first_copy)
                    .map(|()| false)
            };
            match read {
                Ok(true) => {
                    buffers.put(data);
                    return ReplyBody::Hole {
                        offset,
                        len: request.length,
                    };
                }
                Ok(false) => return ReplyBody::Data { offset, data },
                Err(err) => {
                    buffers.put(data);
                    Err(err)
                }
            }
        }
        nbd::Command::Write => match write_payload {
            Some(payload) => {
                let result = volume.write_at(offset, payload.as_slice(), request.fua);
                buffers.put(payload);
                result
            }
            // validate_request only yields WRITE with its payload read; keep the errno honest.
            None => return ReplyBody::Error(nbd::Errno::Eio, "write payload missing"),
        },
        nbd::Command::Flush => volume.flush(),
        nbd::Command::Trim => volume.trim(offset, length, request.fua),
        nbd::Command::WriteZeroes => {
            if request.fast_zero && request.no_hole {
                // Zeroing without punching means writing zeros: not faster than a write.
                return ReplyBody::Error(nbd::Errno::Enotsup, "fast zero needs hole punching");
            }
            volume.write_zeroes(offset, length, !request.no_hole, request.fua)
        }
        nbd::Command::Cache => volume.cache(offset, length),
        nbd::Command::BlockStatus => match block_status(volume, offset, length, request.req_one) {
            Ok(extents) => {
                return ReplyBody::BlockStatus {
                    extents: status_descriptors(&extents, request.req_one),
                };
            }
            Err(err) => Err(err),
        },
        nbd::Command::Disc => Ok(()),
    };
    match outcome {
        Ok(()) => ReplyBody::Done,
        Err(err) => {
            tracing::debug!("request at {offset}+{length} failed: {err}");
            let (errno, message) = store_errno(&err);
            ReplyBody::Error(errno, message)
        }
    }
}

/// Longest range one BLOCK_STATUS walks: 64 extents of 2 MiB. The NBD spec lets the answer
/// describe less than was asked (the client asks again from where it ends), and without a
/// bound a crafted 4 GiB request over a fragmented volume cost about a million `lseek` calls
/// on a thread that serves other connections. At most 64 allocated extents are asked where
/// their data is; unallocated ranges cost nothing.
pub const BLOCK_STATUS_MAX_WALK_BYTES: u64 = 64 * headroom_store::EXTENT_SIZE_BYTES;
/// Most descriptors one BLOCK_STATUS answer carries (8 bytes each), also a shorter answer.
pub const BLOCK_STATUS_MAX_DESCRIPTORS: usize = 2048;
/// What a BLOCK_STATUS is charged against the byte budgets: its largest answer.
const BLOCK_STATUS_CHARGE_BYTES: u32 = (BLOCK_STATUS_MAX_DESCRIPTORS * 8) as u32;

/// The allocation runs of `[offset, offset + length)`, at most [`BLOCK_STATUS_MAX_WALK_BYTES`]
/// of it, walked one extent at a time: the walk stops once it has
/// [`BLOCK_STATUS_MAX_DESCRIPTORS`] runs (a fragmented extent is hundreds of runs, each two
/// `lseek` calls: 64 such extents took 0.4 s on this machine), or with `req_one`
/// (NBD_CMD_FLAG_REQ_ONE: one extent is enough) as soon as a second run shows where the first
/// one ends.
fn block_status(
    volume: &Volume,
    offset: u64,
    length: u64,
    req_one: bool,
) -> Result<Vec<headroom_store::Extent>, StoreError> {
    let end = offset.saturating_add(length.min(BLOCK_STATUS_MAX_WALK_BYTES));
    let extent_bytes = headroom_store::EXTENT_SIZE_BYTES;
    let mut out: Vec<headroom_store::Extent> = Vec::new();
    let mut pos = offset;
    while pos < end {
        let next = ((pos / extent_bytes + 1) * extent_bytes).min(end);
        let mut walked = 0;
        for run in volume.block_status(pos, next - pos)? {
            walked += run.length;
            match out.last_mut() {
                Some(last) if last.hole == run.hole && last.zero == run.zero => {
                    last.length += run.length;
                }
                _ => out.push(run),
            }
        }
        if walked == 0 {
            break;
        }
        pos += walked;
        if (req_one && out.len() > 1) || out.len() >= BLOCK_STATUS_MAX_DESCRIPTORS {
            break;
        }
    }
    if req_one {
        out.truncate(1);
    }
    Ok(out)
}

/// Maps store extents to `base:allocation` descriptors (length, flags), at most
/// [`BLOCK_STATUS_MAX_DESCRIPTORS`] of them (one with `req_one`).
fn status_descriptors(extents: &[headroom_store::Extent], req_one: bool) -> Vec<(u32, u32)> {
    let mut out: Vec<(u32, u32)> = Vec::with_capacity(extents.len().min(1024));
    for extent in extents {
        let mut flags = 0;
        if extent.hole {
            flags |= consts::NBD_STATE_HOLE;
        }
        if extent.zero || extent.hole {
            flags |= consts::NBD_STATE_ZERO;
        }
        // Request lengths are 32-bit, so every clipped extent fits; saturate defensively.
        let length = u32::try_from(extent.length).unwrap_or(u32::MAX);
        if length == 0 {
            continue;
        }
        let full = out.len() == BLOCK_STATUS_MAX_DESCRIPTORS;
        match out.last_mut() {
            Some(last) if last.1 == flags => last.0 = last.0.saturating_add(length),
            // A shorter answer: the client asks again from where it ends.
            _ if full => break,
            _ => out.push((length, flags)),
        }
        if req_one {
            break;
        }
    }
    if req_one {
        out.truncate(1);
    }
    out
}

/// The errno the spec names for each store failure.
fn store_errno(err: &StoreError) -> (nbd::Errno, &'static str) {
    match err {
        StoreError::NoSpace => (nbd::Errno::Enospc, "no space left in the pool"),
        StoreError::OutOfRange { .. } => (nbd::Errno::Einval, "range outside the volume"),
        StoreError::VolumeDeleted(_) => (nbd::Errno::Eio, "volume was deleted"),
        _ => (nbd::Errno::Eio, "I/O error"),
    }
}

/// Encodes replies as they complete, batching what is ready into one write.
///
/// A write that the socket accepts no byte of within `stall` fails with `TimedOut`: the client
/// stopped reading, and ending the session gives back everything its replies hold.
async fn write_replies<W: AsyncWrite + Unpin>(
    mut writer: W,
    mut replies: mpsc::UnboundedReceiver<Reply>,
    structured: bool,
    buffers: Arc<BufferPool>,
    stall: Duration,
) -> std::io::Result<()> {
    // Headers (and other small replies) are encoded into `out`; READ payloads stay in their
    // buffers. `segments` lists the batch in wire order, and one `writev` sends it all: no
    // payload is copied on its way out.
    let mut out: Vec<u8> = Vec::with_capacity(64 << 10);
    let mut segments: Vec<Segment> = Vec::with_capacity(2 * BATCH_REPLIES_MAX);
    let mut batch: Vec<Reply> = Vec::with_capacity(BATCH_REPLIES_MAX);
    while let Some(first) = replies.recv().await {
        let mut next = Some(first);
        let mut head_start = 0;
        let mut payload_bytes = 0;
        while let Some(reply) = next.take() {
            if encode_reply(&mut out, &reply, structured) {
                segments.push(Segment::Head(head_start..out.len()));
                head_start = out.len();
                segments.push(Segment::Payload(batch.len()));
                payload_bytes += reply_payload(&reply).len();
            }
            batch.push(reply);
            if out.len() + payload_bytes < BATCH_BYTES_MAX && batch.len() < BATCH_REPLIES_MAX {
                next = replies.try_recv().ok();
            }
        }
        if head_start < out.len() {
            segments.push(Segment::Head(head_start..out.len()));
        }
        let mut slices: Vec<std::io::IoSlice<'_>> = segments
            .iter()
            .map(|segment| match segment {
                Segment::Head(range) => std::io::IoSlice::new(&out[range.clone()]),
                Segment::Payload(index) => std::io::IoSlice::new(reply_payload(&batch[*index])),
            })
            .collect();
        write_all_slices(&mut writer, &mut slices, stall).await?;
        drop(slices);
        out.clear();
        segments.clear();
        // Releases the permits of everything now on the wire, and recycles read buffers.
        for reply in batch.drain(..) {
            if let ReplyBody::Data { data, .. } = reply.body {
                buffers.put(data);
            }
        }
    }
    // Flushes, then ends the stream (TLS: close_notify first, as the spec asks).
    match tokio::time::timeout(stall, writer.shutdown()).await {
        Ok(done) => done,
        Err(_) => Err(Stalled::error()),
    }
}

/// The client moved no byte for the stall timeout (`Limits::client_stall_timeout_ms`).
#[derive(Debug, thiserror::Error)]
#[error("the client moved no byte in time")]
struct Stalled;

impl Stalled {
    fn error() -> std::io::Error {
        std::io::Error::new(std::io::ErrorKind::TimedOut, Stalled)
    }
}

fn is_stalled(err: &std::io::Error) -> bool {
    err.get_ref().is_some_and(|inner| inner.is::<Stalled>())
}

/// Fills `buf`; each read must bring at least one byte within `stall`.
async fn read_exact_progressing<R: AsyncRead + Unpin>(
    reader: &mut R,
    buf: &mut [u8],
    stall: Duration,
) -> std::io::Result<()> {
    let mut filled = 0;
    while let Some(rest) = buf.get_mut(filled..)
        && !rest.is_empty()
    {
        let n = match tokio::time::timeout(stall, reader.read(rest)).await {
            Ok(read) => read?,
            Err(_) => return Err(Stalled::error()),
        };
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        filled += n;
    }
    Ok(())
}

/// One piece of a batch of replies on the wire.
enum Segment {
    /// Bytes of the batch's encode buffer.
    Head(std::ops::Range<usize>),
    /// The payload of the batch's reply at this index.
    Payload(usize),
}

/// The payload bytes a reply carries after its header (READ data).
fn reply_payload(reply: &Reply) -> &[u8] {
    match &reply.body {
        ReplyBody::Data { data, .. } => data.as_slice(),
        _ => &[],
    }
}

/// Writes every slice, in order; each write must make progress within `stall`.
async fn write_all_slices<W: AsyncWrite + Unpin>(
    writer: &mut W,
    slices: &mut [std::io::IoSlice<'_>],
    stall: Duration,
) -> std::io::Result<()> {
    let mut slices = slices;
    std::io::IoSlice::advance_slices(&mut slices, 0);
    while !slices.is_empty() {
        let n = match tokio::time::timeout(stall, writer.write_vectored(slices)).await {
            Ok(written) => written?,
            Err(_) => return Err(Stalled::error()),
        };
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        std::io::IoSlice::advance_slices(&mut slices, n);
    }
    Ok(())
}

/// Appends a reply to `out`; returns whether its payload (`reply_payload`) must follow `out`
/// on the wire.
fn encode_reply(out: &mut Vec<u8>, reply: &Reply, structured: bool) -> bool {
    let cookie = reply.cookie;
    match (&reply.body, structured) {
        (ReplyBody::Done, false) => nbd::encode_simple_reply_header(out, cookie, 0),
        (ReplyBody::Done, true) => nbd::encode_structured_none_done(out, cookie),
        (ReplyBody::Error(errno, _), false) => {
            nbd::encode_simple_reply_header(out, cookie, *errno as u32);
        }
        (ReplyBody::Error(errno, message), true) => {
            nbd::encode_structured_error(out, true, cookie, *errno as u32, message);
        }
        (ReplyBody::Data { data, .. }, false) => {
            nbd::encode_simple_reply_header(out, cookie, 0);
            return !data.is_empty();
        }
        (ReplyBody::Data { offset, data }, true) => {
            if data.is_empty() {
                nbd::encode_structured_none_done(out, cookie);
                return false;
            }
            // Lengths were validated against the 32 MiB maximum, so they fit in 32 bits.
            let length = u32::try_from(data.len()).unwrap_or(u32::MAX);
            nbd::encode_structured_offset_data_header(out, true, cookie, *offset, length);
            return true;
        }
        (ReplyBody::Hole { offset, len }, true) => {
            nbd::encode_structured_offset_hole(out, true, cookie, *offset, *len);
        }
        // Not produced without structured replies; answered correctly all the same.
        (ReplyBody::Hole { len, .. }, false) => {
            nbd::encode_simple_reply_header(out, cookie, 0);
            out.resize(out.len() + *len as usize, 0);
        }
        (ReplyBody::BlockStatus { extents }, _) => {
            nbd::encode_structured_block_status(out, true, cookie, ALLOCATION_CONTEXT_ID, extents);
        }
    }
    false
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)] // tests panic on failure by design

    use super::*;
    use crate::emulated::EmulatedDeviceSpec;
    use headroom_qos::model::IoCostModel;
    use headroom_store::EXTENT_SIZE_BYTES as E;

    fn devices(n: usize) -> Vec<Arc<EmulatedDevice>> {
        let spec = EmulatedDeviceSpec {
            model: IoCostModel {
                rbps: 100_000_000,
                rseqiops: 20_000,
                rrandiops: 10_000,
                wbps: 100_000_000,
                wseqiops: 20_000,
                wrandiops: 10_000,
            },
            parallelism: 2,
            write_interference_permille: 0,
            per_device: true,
            streams: 0,
        };
        (0..n)
            .map(|_| EmulatedDevice::start(spec, Clock::new()).unwrap())
            .collect()
    }

    fn request(command: nbd::Command, offset: u64, length: u32) -> nbd::ValidRequest {
        nbd::ValidRequest {
            command,
            fua: false,
            no_hole: false,
            fast_zero: false,
            df: false,
            req_one: false,
            cookie: 1,
            offset,
            length,
        }
    }

    fn booked(devices: &[Arc<EmulatedDevice>]) -> Vec<u64> {
        devices.iter().map(|d| d.stats().booked).collect()
    }

    #[test]
    fn per_device_emulation_books_the_devices_a_request_touches() {
        // A RAM store has two devices; a volume's first two extents stripe over them.
        let store = Store::open_memory(64 << 20).unwrap();
        store.create_volume("v", 16 << 20).unwrap();
        let volume = store.open_volume("v").unwrap();
        volume.write_at(0, &[1u8; 4096], false).unwrap();
        volume.write_at(E, &[2u8; 4096], false).unwrap();
        let on = |extent: u64| volume.extent_location(extent).unwrap().device;
        assert_eq!((on(0), on(1)), (0, 1));
        let devices = devices(2);
        let book = |req: nbd::ValidRequest| {
            let job_desc = IoDesc {
                op: match req.command {
                    nbd::Command::Flush => OpKind::Flush,
                    nbd::Command::Write => OpKind::Write,
                    _ => OpKind::Read,
                },
                offset_bytes: req.offset,
                len_bytes: if matches!(req.command, nbd::Command::Flush) {
                    0
                } else {
                    req.length
                },
                syncs: 0,
            };
            book_per_device(&devices, &volume, &req, job_desc, false, None, 1_000)
                .map(|(device, at)| (Arc::as_ptr(device), at))
        };
        // Within extent 0: device 0 only.
        let (device, at) = book(request(nbd::Command::Read, 0, 4096)).unwrap();
        assert_eq!(booked(&devices), vec![1, 0]);
        assert_eq!(device, Arc::as_ptr(&devices[0]));
        assert!(at > 1_000);
        // Across the boundary of extents 0 and 1: one piece on each device.
        assert!(book(request(nbd::Command::Read, E - 4096, 8192)).is_some());
        assert_eq!(booked(&devices), vec![2, 1]);
        // A read of a hole (extent 5 was never written): no device works, no booking.
        assert!(book(request(nbd::Command::Read, 5 * E, 4096)).is_none());
        assert_eq!(booked(&devices), vec![2, 1]);
        // FLUSH reaches every device; it completes with the later of the two.
        let (_, flush_at) = book(request(nbd::Command::Flush, 0, 0)).unwrap();
        assert_eq!(booked(&devices), vec![3, 2]);
        assert!(flush_at > 1_000);
    }

    /// A 2-replica volume on a RAM store of two devices, its first extent written.
    fn mirrored() -> (Store, Arc<Volume>) {
        let store = Store::open_memory(64 << 20).unwrap();
        store
            .create_volume_with(
                "m",
                16 << 20,
                headroom_store::NewVolume {
                    replicas: 2,
                    ..headroom_store::NewVolume::default()
                },
            )
            .unwrap();
        let volume = store.open_volume("m").unwrap();
        volume.write_at(0, &[7u8; 4096], false).unwrap();
        (store, volume)
    }

    #[test]
    fn type_aware_routing_splits_random_and_sequential_reads_and_an_idle_copy_steals() {
        let (_store, volume) = mirrored();
        let copies = volume.copies(0);
        let device_of = |copy: u8| copies[usize::from(copy)].unwrap().0.device;
        // The copy on the lower-numbered device is the router's head replica.
        let (head, middle) = if device_of(0) < device_of(1) {
            (0, 1)
        } else {
            (1, 0)
        };
        let router = ReadRouter::new(ReadRouting::TypeAware);
        // Idle: random reads to the head, sequential reads to the middle.
        let random = router.route(&volume, 0, false).unwrap();
        assert_eq!((random.copy, random.device), (head, device_of(head)));
        router.done(random.device);
        let scan = router.route(&volume, 0, true).unwrap();
        assert_eq!((scan.copy, scan.device), (middle, device_of(middle)));
        // The middle busy with that scan, the head idle: the next sequential read is stolen.
        assert_eq!(router.route(&volume, 4096, true).unwrap().copy, head);
        // Both busy: each default keeps its own.
        assert_eq!(router.route(&volume, 8192, true).unwrap().copy, middle);
        assert_eq!(router.route(&volume, 0, false).unwrap().copy, head);
        // A hole and a 1-replica volume are not routed.
        assert!(router.route(&volume, 5 * E, false).is_none());
        let store = Store::open_memory(64 << 20).unwrap();
        store.create_volume("single", 16 << 20).unwrap();
        let single = store.open_volume("single").unwrap();
        single.write_at(0, &[1u8; 4096], false).unwrap();
        assert!(router.route(&single, 0, false).is_none());
        // Primary and round robin, for comparison.
        let primary = ReadRouter::new(ReadRouting::Primary);
        assert!((0..4).all(|_| primary.route(&volume, 0, true).unwrap().copy == head));
        let rr = ReadRouter::new(ReadRouting::RoundRobin);
        let turns: Vec<u8> = (0..4)
            .map(|_| rr.route(&volume, 0, false).unwrap().copy)
            .collect();
        assert_eq!(turns, vec![head, middle, head, middle]);
    }

    #[test]
    fn per_device_emulation_books_the_routed_copy_for_reads_and_every_copy_for_writes() {
        let (_store, volume) = mirrored();
        let copies = volume.copies(0);
        let (d0, d1) = (
            copies[0].unwrap().0.device as usize,
            copies[1].unwrap().0.device as usize,
        );
        assert_ne!(d0, d1);
        let devices = devices(2);
        let desc = |op, len| IoDesc {
            op,
            offset_bytes: 0,
            len_bytes: len,
            syncs: 0,
        };
        let mut expect = vec![0u64; 2];
        book_per_device(
            &devices,
            &volume,
            &request(nbd::Command::Read, 0, 4096),
            desc(OpKind::Read, 4096),
            false,
            Some(1),
            1_000,
        )
        .unwrap();
        expect[d1] += 1;
        assert_eq!(booked(&devices), expect);
        book_per_device(
            &devices,
            &volume,
            &request(nbd::Command::Write, 0, 4096),
            desc(OpKind::Write, 4096),
            false,
            None,
            1_000,
        )
        .unwrap();
        expect[d0] += 1;
        expect[d1] += 1;
        assert_eq!(booked(&devices), expect);
    }

    #[test]
    fn a_grant_waits_for_the_policy_and_its_completion_is_charged_to_its_volume() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let io = Arc::new(IoRuntime {
            lanes: None,
            inline_max_bytes: 0,
            buffers: Arc::new(BufferPool::new(1 << 20)),
            emulation: Emulation::Off,
            clock: Clock::new(),
            runtime: runtime.handle().clone(),
            reads: ReadRouter::new(ReadRouting::Primary),
        });
        let runner = Arc::new(IoRunner(Arc::clone(&io)));
        let scheduler =
            Scheduler::start(&crate::config::QosConfig::default(), io.clock, runner, None).unwrap();
        let qos = crate::repair::rebuild_qos(64 << 20);
        let handle = scheduler.add_volume(crate::repair::REBUILD_SCHEDULER_KEY, &qos);
        let desc = IoDesc {
            op: OpKind::Write,
            offset_bytes: 0,
            len_bytes: E as u32,
            syncs: 0,
        };
        // Dispatched (within its rate), handed to the submitter, completed by it.
        let pending = Grant::submit(&io, &scheduler, &handle, desc);
        let ticket = pending.wait(Duration::from_secs(10)).expect("dispatched");
        assert_eq!(handle.counters.snapshot().ios.iter().sum::<u64>(), 0);
        Grant::complete(&io, &scheduler, ticket);
        let stats = handle.counters.snapshot();
        assert_eq!(stats.ios.iter().sum::<u64>(), 1);
        assert_eq!(stats.bytes.iter().sum::<u64>(), E);
        drop(pending);
        // A grant given up before it is taken is still completed (its dispatch does it).
        let pending = Grant::submit(&io, &scheduler, &handle, desc);
        drop(pending);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while handle.counters.snapshot().ios.iter().sum::<u64>() < 2 {
            assert!(
                std::time::Instant::now() < deadline,
                "the abandoned grant never completed"
            );
            std::thread::yield_now();
        }
        assert_eq!(handle.counters.snapshot().bytes.iter().sum::<u64>(), 2 * E);
        scheduler.stop();
    }

    fn io_without_executor(runtime: &tokio::runtime::Runtime) -> IoRuntime {
        IoRuntime {
            lanes: None,
            inline_max_bytes: 64 << 10,
            buffers: Arc::new(BufferPool::new(1 << 20)),
            emulation: Emulation::Off,
            clock: Clock::new(),
            runtime: runtime.handle().clone(),
            reads: ReadRouter::new(ReadRouting::Primary),
        }
    }

    #[test]
    fn every_command_is_charged_the_device_work_it_does_and_what_may_block_leaves_the_thread() {
        use nbd::Command::{BlockStatus, Cache, Flush, Read, Trim, Write, WriteZeroes};
        let model = headroom_qos::model::CostModel::new(
            headroom_qos::model::CpuModel::default(),
            headroom_qos::model::DeviceModel::Linear(IoCostModel::SSD_FAST),
        );
        let store = Store::open_memory(1 << 30).unwrap();
        store.create_volume("v", 1 << 30).unwrap();
        let volume = store.open_volume("v").unwrap();
        assert!(volume.is_zero_fast(), "RAM zeroes in place");
        let device_units = |request: &nbd::ValidRequest| {
            let desc = desc_of(&volume, request);
            model.estimate(desc.op, desc.len_bytes, false).device_units
        };
        let len = 32 << 20;
        let read = device_units(&request(Read, 0, len));
        let write = device_units(&request(Write, 0, len));
        assert!(read > 0 && write > 0);
        // CACHE reads its length into the page cache: charged as that read.
        assert_eq!(device_units(&request(Cache, 0, len)), read);
        // WRITE_ZEROES that may not punch zeroes its range in place: its metadata, far less
        // than a write of its length (were the device to write zeros, it would be that
        // write); one that may punch is a discard.
        let zeroes = |no_hole, fast_zero| nbd::ValidRequest {
            no_hole,
            fast_zero,
            ..request(WriteZeroes, 0, len)
        };
        let zeroing = desc_of(&volume, &zeroes(true, false));
        assert_eq!((zeroing.op, zeroing.len_bytes), (OpKind::WriteZeroes, len));
        let zeroing = device_units(&zeroes(true, false));
        assert!(zeroing > 0 && zeroing * 100 < write, "{zeroing} {write}");
        assert_eq!(device_units(&zeroes(false, false)), 0);
        assert_eq!(desc_of(&volume, &zeroes(false, false)).op, OpKind::Trim);
        // Refused at once.
        assert_eq!(device_units(&zeroes(true, true)), 0);
        // BLOCK_STATUS: one small read's worth, whatever its length.
        let small_read = device_units(&request(Read, 0, 0));
        assert!(small_read > 0);
        assert_eq!(device_units(&request(BlockStatus, 0, u32::MAX)), small_read);
        assert_eq!(device_units(&request(BlockStatus, 0, 4096)), small_read);
        // A FUA request pays for its sync; a FLUSH for one sync per device holding writes
        // not yet durable, at least one.
        let fua = |command| nbd::ValidRequest {
            fua: true,
            ..request(command, 0, 4096)
        };
        assert_eq!(desc_of(&volume, &request(Write, 0, 4096)).syncs, 0);
        assert_eq!(desc_of(&volume, &fua(Write)).syncs, 1);
        assert_eq!(desc_of(&volume, &fua(Trim)).syncs, 1);
        assert_eq!(desc_of(&volume, &request(Flush, 0, 0)).syncs, 1);
        volume.write_at(0, &[1u8; 4096], false).unwrap();
        assert_eq!(volume.unsynced_devices(), 1);
        assert_eq!(desc_of(&volume, &request(Flush, 0, 0)).syncs, 1);
        volume.flush().unwrap();
        assert_eq!(volume.unsynced_devices(), 0);

        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let io = io_without_executor(&runtime);
        for command in [Flush, Trim, WriteZeroes, Cache, BlockStatus] {
            assert!(
                runs_off_thread(&request(command, 0, 4096), &io),
                "{} would run on the connection's thread",
                command.name()
            );
        }
        let fua_write = nbd::ValidRequest {
            fua: true,
            ..request(Write, 0, 4096)
        };
        assert!(runs_off_thread(&fua_write, &io), "a FUA write syncs");
        // Small READs and WRITEs stay inline (no executor here: nothing else does).
        assert!(!runs_off_thread(&request(Read, 0, 4096), &io));
        assert!(!runs_off_thread(&request(Write, 0, 1 << 20), &io));
    }

    #[test]
    fn a_cache_is_cut_into_pieces_only_where_there_is_data() {
        let store = Store::open_memory(1 << 30).unwrap();
        store.create_volume("v", 256 << 20).unwrap();
        let volume = store.open_volume("v").unwrap();
        let extent = headroom_store::EXTENT_SIZE_BYTES;
        let cache = request(nbd::Command::Cache, 0, 32 << 20);
        let piece_bytes = piece_bytes_of(&cache, 32 << 20);
        assert_eq!(pieces(&cache, piece_bytes).len(), 16);
        // Thin: only the first piece, which answers the request.
        let kept = cache_work(&volume, pieces(&cache, piece_bytes));
        assert_eq!(kept.iter().map(|p| p.offset).collect::<Vec<_>>(), vec![0]);
        // One written extent (the 11th) adds its piece, and only it.
        volume
            .write_at(10 * extent + 5, &[1u8; 4096], false)
            .unwrap();
        let kept = cache_work(&volume, pieces(&cache, piece_bytes));
        assert_eq!(
            kept.iter().map(|p| p.offset).collect::<Vec<_>>(),
            vec![0, 10 * extent]
        );
        assert!(volume.holds_data_in(10 * extent, 1));
        assert!(!volume.holds_data_in(11 * extent, extent));
        assert!(!volume.holds_data_in(1 << 40, 4096), "past the end");
    }

    #[test]
    fn bulk_work_and_syncs_leave_the_lane_of_reads_and_writes() {
        use nbd::Command::{BlockStatus, Cache, Flush, Read, Trim, Write, WriteZeroes};
        let fua = |command| nbd::ValidRequest {
            fua: true,
            ..request(command, 0, 4096)
        };
        for command in [Cache, WriteZeroes, Trim, BlockStatus] {
            assert_eq!(lane_of(&request(command, 0, 1 << 20)), Lane::Bulk);
            // A FUA bulk request is bulk work first: its length is what it costs.
            assert_eq!(lane_of(&fua(command)), Lane::Bulk);
        }
        assert_eq!(lane_of(&request(Flush, 0, 0)), Lane::Sync);
        assert_eq!(lane_of(&fua(Write)), Lane::Sync);
        assert_eq!(lane_of(&fua(Read)), Lane::Sync);
        assert_eq!(lane_of(&request(Read, 0, 1 << 20)), Lane::Data);
        assert_eq!(lane_of(&request(Write, 0, 1 << 20)), Lane::Data);
    }

    #[test]
    fn a_split_request_holds_at_most_two_pieces_in_the_node_and_answers_once() {
        use headroom_store::{FaultConfig, FaultRule, FaultScope};
        // Every write-class operation of the volume takes 2 s longer, so the pieces cannot
        // finish (and feed the next ones) before the check below.
        let store = Store::open_memory(1 << 30).unwrap();
        store.create_volume("v", 1 << 30).unwrap();
        store
            .inject_faults(&FaultConfig {
                seed: 1,
                rules: vec![FaultRule {
                    latency_spike_permille: 1000,
                    latency_spike_ms: 2_000,
                    ..FaultRule::new(FaultScope::Volume("v".into()))
                }],
            })
            .unwrap();
        let volume = Arc::new(store.open_volume("v").unwrap());
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        let io = Arc::new(io_without_executor(&runtime));
        let metrics = MetricsRegistry::new(crate::metrics::MetricsConfig::default(), io.clock);
        let (tx, mut replies) = mpsc::unbounded_channel();
        let path = Arc::new(ReplyPath {
            tx,
            stats: volume_stats(&metrics, &volume),
            metrics: Arc::clone(&metrics),
        });
        let slots = Arc::new(Semaphore::new(1));
        let permits = Permits {
            _request: slots.clone().try_acquire_owned().unwrap(),
            _bytes: None,
        };
        // A NO_HOLE zeroing of four extents: four pieces of one extent each.
        let zeroing = nbd::ValidRequest {
            no_hole: true,
            ..request(nbd::Command::WriteZeroes, 0, 4 * E as u32)
        };
        let piece_bytes = piece_bytes_of(&zeroing, 32 << 20);
        assert_eq!(piece_bytes, E as u32);
        let pieces = pieces(&zeroing, piece_bytes);
        assert_eq!(pieces.len(), 4);
        let split = SplitRequest::new(
            &zeroing,
            pieces,
            permits,
            path,
            Tally::of(&zeroing, 0).unwrap(),
            PieceFeeder {
                volume: Arc::clone(&volume),
                io: Arc::clone(&io),
                scheduled: None,
            },
        );
        for _ in 0..SPLIT_PIECES_IN_FLIGHT {
            let job = split.next_piece().unwrap();
            assert!(run_job(&io, None, job, Unscheduled(true)).is_none());
        }
        let unsubmitted = |split: &SplitRequest| lock_state(split).unsubmitted.len();
        assert_eq!(
            unsubmitted(&split),
            2,
            "the other pieces wait until one of the first two completes"
        );
        // Each completion feeds the next; the last sends the one reply.
        let reply = runtime.block_on(async {
            tokio::time::timeout(Duration::from_secs(60), replies.recv()).await
        });
        let reply = reply.expect("answered").expect("a reply");
        assert!(matches!(reply.body, ReplyBody::Done));
        assert_eq!(unsubmitted(&split), 0);
        assert!(replies.try_recv().is_err(), "one reply for the request");
        drop(reply);
        assert_eq!(
            slots.available_permits(),
            1,
            "the permits went with the reply"
        );
        // TRIM stays cut at the maximum block size (metadata per extent).
        assert_eq!(
            piece_bytes_of(&request(nbd::Command::Trim, 0, u32::MAX), 32 << 20),
            32 << 20
        );
    }

    fn lock_state(split: &SplitRequest) -> std::sync::MutexGuard<'_, SplitState> {
        split.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    #[test]
    fn block_status_is_bounded_and_req_one_answers_one_extent() {
        let store = Store::open_memory(1 << 30).unwrap();
        store.create_volume("v", 1 << 30).unwrap();
        let volume = store.open_volume("v").unwrap();
        // Data in every other extent of the first 300 MiB: runs of 2 MiB, data then hole.
        for extent in (0..150u64).step_by(2) {
            volume.write_at(extent * E, &[1u8; 4096], false).unwrap();
        }
        let status = |offset: u64, length: u32, req_one: bool| {
            let request = nbd::ValidRequest {
                req_one,
                ..request(nbd::Command::BlockStatus, offset, length)
            };
            let body = execute(&BufferPool::new(1 << 20), &volume, &request, None, false, 0);
            match body {
                ReplyBody::BlockStatus { extents } => extents,
                _ => panic!("not a BLOCK_STATUS answer"),
            }
        };
        let described =
            |extents: &[(u32, u32)]| extents.iter().map(|e| u64::from(e.0)).sum::<u64>();
        let hole = consts::NBD_STATE_HOLE | consts::NBD_STATE_ZERO;
        // The whole volume asked for: at most 64 extents walked, a shorter answer.
        let all = status(0, (1 << 30) - 4096, false);
        assert_eq!(described(&all), BLOCK_STATUS_MAX_WALK_BYTES);
        assert_eq!(all.len(), 64);
        assert!(all.iter().step_by(2).all(|e| e == &(E as u32, 0)));
        assert!(
            all.iter()
                .skip(1)
                .step_by(2)
                .all(|e| e == &(E as u32, hole))
        );
        // REQ_ONE: the first run only, with its real length.
        assert_eq!(status(0, (1 << 30) - 4096, true), vec![(E as u32, 0)]);
        assert_eq!(
            status(E + 4096, 1 << 29, true),
            vec![(E as u32 - 4096, hole)]
        );
        // A long hole: one run, as far as the walk goes.
        let long = status(300 << 20, 700 << 20, true);
        assert_eq!(long, vec![(BLOCK_STATUS_MAX_WALK_BYTES as u32, hole)]);
        // The number of descriptors is bounded too: a prefix of the runs.
        let runs: Vec<headroom_store::Extent> = (0..5000)
            .map(|i| headroom_store::Extent {
                length: 4096,
                hole: i % 2 == 1,
                zero: i % 2 == 1,
            })
            .collect();
        let descriptors = status_descriptors(&runs, false);
        assert_eq!(descriptors.len(), BLOCK_STATUS_MAX_DESCRIPTORS);
        assert!(descriptors.iter().all(|d| d.0 == 4096));
        assert_eq!(status_descriptors(&runs, true).len(), 1);
        assert!(BLOCK_STATUS_CHARGE_BYTES as usize >= BLOCK_STATUS_MAX_DESCRIPTORS * 8);
    }

    #[test]
    fn emulation_parallelism_sums_the_devices() {
        assert_eq!(Emulation::Off.parallelism(), None);
        let two = devices(2);
        assert_eq!(Emulation::Node(Arc::clone(&two[0])).parallelism(), Some(2));
        assert_eq!(Emulation::PerDevice(two).parallelism(), Some(4));
    }
}

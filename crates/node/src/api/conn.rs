//! Serving the management API: timeouts on every phase of a request, a cap on connections
//! that makes room by evicting unfinished ones, and a shutdown that does not wait for them.
//!
//! Why: `axum::serve` runs hyper without a timer, so hyper's header read timeout never fires
//! and nothing bounds the API's connections. Unauthenticated clients that send half a request
//! and stop could then hold every file descriptor of the process, which NBD shares (its
//! `accept` failed with EMFILE), and graceful shutdown waited for them, so SIGTERM never got
//! to the flush. Here each connection is driven by hyper's HTTP/1 server with hyper-util's
//! Tokio timer, and by a task of ours that knows which phase the connection is in:
//!
//! * *head*: from accept (or the first byte of a later request) until its head is parsed:
//!   at most [`ApiLimits::header_read_timeout_ms`];
//! * *body*: from the head until its body has arrived in full: at most
//!   [`ApiLimits::body_read_timeout_ms`];
//! * *busy*: the handler runs (a complete request is being answered): no limit, and never
//!   evicted;
//! * *idle*: between requests on a kept-alive connection: at most
//!   [`ApiLimits::idle_timeout_ms`].
//!
//! A connection past its phase's deadline is closed. At [`ApiLimits::max_connections`] a new
//! connection makes room, as NBD admission does (`crate::admission`): the oldest connection
//! that has not completed a request yet goes first (a flood's half-sent requests), then the
//! oldest that is not busy (idle keep-alives, half-sent later requests); only when every
//! connection is busy is the new one closed. So a flood can delay nobody who completes a
//! request faster than the flood opens the cap's worth of sockets. At shutdown connections
//! that are not busy are closed at once; busy ones get [`SHUTDOWN_GRACE_MS`] to finish.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use hyper::body::{Body as HttpBody, Frame, Incoming, SizeHint};
use hyper_util::rt::{TokioIo, TokioTimer};
use serde::Serialize;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, watch};
use tokio::task::JoinSet;
use tower_service::Service;

use crate::setting::InvalidSetting;
use crate::sync::lock;

/// The API's connection limits (`[api]` in the configuration).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiLimits {
    /// Most API connections open at once (lowered at start to leave the file-descriptor
    /// reserve, see `server::api_connection_cap`).
    pub max_connections: usize,
    /// From accept, or from a later request's first byte, to its complete head.
    pub header_read_timeout_ms: u64,
    /// From a request's head to the end of its body.
    pub body_read_timeout_ms: u64,
    /// A kept-alive connection between requests.
    pub idle_timeout_ms: u64,
}

/// Default of [`ApiLimits::max_connections`].
pub const DEFAULT_MAX_API_CONNECTIONS: usize = 1024;
/// Default of [`ApiLimits::header_read_timeout_ms`].
pub const DEFAULT_HEADER_READ_TIMEOUT_MS: u64 = 10_000;
/// Default of [`ApiLimits::body_read_timeout_ms`].
pub const DEFAULT_BODY_READ_TIMEOUT_MS: u64 = 30_000;
/// Default of [`ApiLimits::idle_timeout_ms`].
pub const DEFAULT_IDLE_TIMEOUT_MS: u64 = 60_000;
/// Longest API timeout accepted (`api.*_timeout_ms`): an hour.
pub const MAX_API_TIMEOUT_MS: u64 = 3_600_000;
/// How long a request being answered at shutdown may still take.
pub const SHUTDOWN_GRACE_MS: u64 = 5_000;

impl ApiLimits {
    /// At least one connection; every timeout 1 ms to [`MAX_API_TIMEOUT_MS`] (the keys are
    /// the configuration file's).
    pub fn validate(&self) -> Result<(), InvalidSetting> {
        if self.max_connections == 0 {
            return Err(InvalidSetting::new(
                "api.max_connections",
                0,
                "must be at least 1",
            ));
        }
        for (key, ms) in [
            ("api.header_read_timeout_ms", self.header_read_timeout_ms),
            ("api.body_read_timeout_ms", self.body_read_timeout_ms),
            ("api.idle_timeout_ms", self.idle_timeout_ms),
        ] {
            if !(1..=MAX_API_TIMEOUT_MS).contains(&ms) {
                return Err(InvalidSetting::new(
                    key,
                    ms,
                    format!("must be between 1 and {MAX_API_TIMEOUT_MS} (1 h)"),
                ));
            }
        }
        Ok(())
    }
}

impl Default for ApiLimits {
    fn default() -> Self {
        ApiLimits {
            max_connections: DEFAULT_MAX_API_CONNECTIONS,
            header_read_timeout_ms: DEFAULT_HEADER_READ_TIMEOUT_MS,
            body_read_timeout_ms: DEFAULT_BODY_READ_TIMEOUT_MS,
            idle_timeout_ms: DEFAULT_IDLE_TIMEOUT_MS,
        }
    }
}

const HEAD: u8 = 0;
const BODY: u8 = 1;
const BUSY: u8 = 2;
const IDLE: u8 = 3;

/// One API connection, as its task, its I/O, its service and the table see it.
#[derive(Debug)]
struct Conn {
    /// Order of acceptance (the table's key).
    seq: u64,
    /// `HEAD`, `BODY`, `BUSY` or `IDLE`.
    phase: AtomicU8,
    /// When the phase began, ms since the table's epoch.
    since_ms: AtomicU64,
    completed_requests: AtomicU64,
    epoch: Instant,
    /// Wakes the task: the phase changed (its deadline moved).
    changed: Notify,
    /// Wakes the task: it was evicted.
    evicted: Notify,
}

impl Conn {
    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn enter(&self, phase: u8) {
        self.since_ms.store(self.now_ms(), Ordering::Relaxed);
        self.phase.store(phase, Ordering::Release);
        self.changed.notify_one();
    }

    /// `from` → `to` only if the connection is in `from`.
    fn advance(&self, from: u8, to: u8) {
        if self
            .phase
            .compare_exchange(from, to, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            self.since_ms.store(self.now_ms(), Ordering::Relaxed);
            self.changed.notify_one();
        }
    }

    fn busy(&self) -> bool {
        self.phase.load(Ordering::Acquire) == BUSY
    }

    /// When the current phase runs out (`None`: busy, no limit).
    fn deadline(&self, limits: &ApiLimits) -> Option<Instant> {
        let limit_ms = match self.phase.load(Ordering::Acquire) {
            HEAD => limits.header_read_timeout_ms,
            BODY => limits.body_read_timeout_ms,
            IDLE => limits.idle_timeout_ms,
            _ => return None,
        };
        let since_ms = self.since_ms.load(Ordering::Relaxed);
        Some(self.epoch + Duration::from_millis(since_ms.saturating_add(limit_ms)))
    }
}

/// The API's connections: the cap, the evictions, and the counts `GET /v1/node` shows.
#[derive(Debug)]
pub struct ApiConnections {
    limits: ApiLimits,
    epoch: Instant,
    table: Mutex<BTreeMap<u64, Arc<Conn>>>,
    next_seq: AtomicU64,
    accepted_total: AtomicU64,
    evicted_total: AtomicU64,
    refused_total: AtomicU64,
    timed_out_total: AtomicU64,
    accept_errors_total: AtomicU64,
}

/// What [`ApiConnections::view`] shows.
#[derive(Clone, Debug, Serialize)]
pub struct ApiConnectionsView {
    pub max_connections: usize,
    pub open: usize,
    pub header_read_timeout_ms: u64,
    pub body_read_timeout_ms: u64,
    pub idle_timeout_ms: u64,
    pub accepted_total: u64,
    /// Unfinished connections closed to make room for a new one.
    pub evicted_total: u64,
    /// New connections closed because every open one was busy.
    pub refused_total: u64,
    /// Connections closed past a phase's deadline.
    pub timed_out_total: u64,
    pub accept_errors_total: u64,
}

impl ApiConnections {
    pub fn new(mut limits: ApiLimits) -> Arc<ApiConnections> {
        limits.max_connections = limits.max_connections.max(1);
        Arc::new(ApiConnections {
            limits,
            epoch: Instant::now(),
            table: Mutex::new(BTreeMap::new()),
            next_seq: AtomicU64::new(0),
            accepted_total: AtomicU64::new(0),
            evicted_total: AtomicU64::new(0),
            refused_total: AtomicU64::new(0),
            timed_out_total: AtomicU64::new(0),
            accept_errors_total: AtomicU64::new(0),
        })
    }

    pub fn limits(&self) -> &ApiLimits {
        &self.limits
    }

    fn lock(&self) -> MutexGuard<'_, BTreeMap<u64, Arc<Conn>>> {
        lock(&self.table)
    }

    pub fn view(&self) -> ApiConnectionsView {
        ApiConnectionsView {
            max_connections: self.limits.max_connections,
            open: self.lock().len(),
            header_read_timeout_ms: self.limits.header_read_timeout_ms,
            body_read_timeout_ms: self.limits.body_read_timeout_ms,
            idle_timeout_ms: self.limits.idle_timeout_ms,
            accepted_total: self.accepted_total.load(Ordering::Relaxed),
            evicted_total: self.evicted_total.load(Ordering::Relaxed),
            refused_total: self.refused_total.load(Ordering::Relaxed),
            timed_out_total: self.timed_out_total.load(Ordering::Relaxed),
            accept_errors_total: self.accept_errors_total.load(Ordering::Relaxed),
        }
    }

    /// Admits a new connection, evicting an unfinished one at the cap; `None`: every open
    /// connection is busy, close the new one.
    fn admit(&self) -> Option<Arc<Conn>> {
        let mut table = self.lock();
        if table.len() >= self.limits.max_connections {
            // Oldest first (the map is in acceptance order): one that never completed a
            // request, else one that is not busy.
            let victim = table
                .values()
                .find(|c| !c.busy() && c.completed_requests.load(Ordering::Relaxed) == 0)
                .or_else(|| table.values().find(|c| !c.busy()))
                .map(|c| c.seq);
            let Some(seq) = victim else {
                self.refused_total.fetch_add(1, Ordering::Relaxed);
                return None;
            };
            if let Some(conn) = table.remove(&seq) {
                conn.evicted.notify_one();
                self.evicted_total.fetch_add(1, Ordering::Relaxed);
            }
        }
        let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
        let conn = Arc::new(Conn {
            seq,
            phase: AtomicU8::new(HEAD),
            since_ms: AtomicU64::new(0),
            completed_requests: AtomicU64::new(0),
            epoch: self.epoch,
            changed: Notify::new(),
            evicted: Notify::new(),
        });
        conn.since_ms.store(conn.now_ms(), Ordering::Relaxed);
        table.insert(seq, Arc::clone(&conn));
        self.accepted_total.fetch_add(1, Ordering::Relaxed);
        Some(conn)
    }

    fn remove(&self, seq: u64) {
        self.lock().remove(&seq);
    }
}

/// Serves `router` on `listener` until `stop` turns true (or its sender goes away), then
/// closes unfinished connections at once and gives busy ones [`SHUTDOWN_GRACE_MS`].
pub async fn serve(
    listener: TcpListener,
    router: Router,
    connections: Arc<ApiConnections>,
    mut stop: watch::Receiver<bool>,
) {
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        // A backstop under our own phase deadlines: hyper starts this timer when it begins
        // to read a head, which on a kept-alive connection is the start of the idle time.
        .header_read_timeout(Duration::from_millis(
            connections
                .limits
                .idle_timeout_ms
                .saturating_add(connections.limits.header_read_timeout_ms)
                .saturating_add(1_000),
        ));
    let builder = Arc::new(builder);
    let mut tasks = JoinSet::new();
    let mut failed_accepts = 0u32;
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = stop.changed() => break,
            Some(_) = tasks.join_next(), if !tasks.is_empty() => continue,
        };
        let stream = match accepted {
            Ok((stream, _peer)) => {
                failed_accepts = 0;
                stream
            }
            Err(err) => {
                connections
                    .accept_errors_total
                    .fetch_add(1, Ordering::Relaxed);
                // EMFILE and friends: back off (10 ms doubling to 1 s) instead of spinning.
                failed_accepts = failed_accepts.saturating_add(1);
                let delay_ms = 10u64 << failed_accepts.min(7).saturating_sub(1);
                if failed_accepts == 1 {
                    tracing::warn!("API accept failed: {err}; retrying after {delay_ms} ms");
                }
                tokio::select! {
                    () = tokio::time::sleep(Duration::from_millis(delay_ms.min(1_000))) => {}
                    _ = stop.changed() => break,
                }
                continue;
            }
        };
        let Some(conn) = connections.admit() else {
            drop(stream);
            continue;
        };
        let _ = stream.set_nodelay(true);
        tasks.spawn(run_connection(
            stream,
            conn,
            Arc::clone(&connections),
            router.clone(),
            Arc::clone(&builder),
            stop.clone(),
        ));
    }
    drop(listener);
    // Every task sees the stop itself; wait for them (each bounded by the grace).
    while tasks.join_next().await.is_some() {}
}

async fn run_connection(
    stream: TcpStream,
    conn: Arc<Conn>,
    table: Arc<ApiConnections>,
    router: Router,
    builder: Arc<hyper::server::conn::http1::Builder>,
    mut stop: watch::Receiver<bool>,
) {
    let io = TokioIo::new(Tracked {
        inner: stream,
        conn: Arc::clone(&conn),
    });
    let service = ConnService {
        router,
        conn: Arc::clone(&conn),
    };
    let connection = builder.serve_connection(io, service);
    tokio::pin!(connection);
    let limits = table.limits.clone();
    let mut stopping_until: Option<Instant> = None;
    loop {
        let deadline = match stopping_until {
            Some(grace) => Some(grace),
            None => conn.deadline(&limits),
        };
        let sleep = async move {
            match deadline {
                Some(at) => tokio::time::sleep_until(at.into()).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = connection.as_mut() => break,
            () = conn.evicted.notified() => break,
            () = conn.changed.notified() => continue,
            () = sleep => {
                if stopping_until.is_some() {
                    break;
                }
                if conn.deadline(&limits).is_some_and(|at| at <= Instant::now()) {
                    table.timed_out_total.fetch_add(1, Ordering::Relaxed);
                    break;
                }
            }
            _ = stop.changed(), if stopping_until.is_none() => {
                if !conn.busy() {
                    break;
                }
                connection.as_mut().graceful_shutdown();
                stopping_until = Some(Instant::now() + Duration::from_millis(SHUTDOWN_GRACE_MS));
            }
        }
    }
    table.remove(conn.seq);
}

/// The per-connection service: marks the phases around the router.
#[derive(Clone, Debug)]
struct ConnService {
    router: Router,
    conn: Arc<Conn>,
}

impl hyper::service::Service<hyper::Request<Incoming>> for ConnService {
    type Response = axum::response::Response;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn call(&self, request: hyper::Request<Incoming>) -> Self::Future {
        let conn = Arc::clone(&self.conn);
        let mut router = self.router.clone();
        Box::pin(async move {
            let request = request.map(|body| {
                if body.is_end_stream() {
                    conn.enter(BUSY);
                    Body::new(body)
                } else {
                    conn.enter(BODY);
                    Body::new(TrackedBody {
                        inner: body,
                        conn: Arc::clone(&conn),
                    })
                }
            });
            let response = match router.call(request).await {
                Ok(response) => response,
                Err(never) => match never {},
            };
            conn.completed_requests.fetch_add(1, Ordering::Relaxed);
            conn.enter(IDLE);
            Ok(response)
        })
    }
}

/// A request body that marks the connection busy once it has arrived in full.
#[derive(Debug)]
struct TrackedBody {
    inner: Incoming,
    conn: Arc<Conn>,
}

impl HttpBody for TrackedBody {
    type Data = hyper::body::Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        let ended = match &polled {
            Poll::Ready(None) => true,
            Poll::Ready(Some(Ok(_))) => self.inner.is_end_stream(),
            _ => false,
        };
        if ended {
            self.conn.advance(BODY, BUSY);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The socket, noting a new request's first byte (idle → head).
#[derive(Debug)]
struct Tracked {
    inner: TcpStream,
    conn: Arc<Conn>,
}

impl AsyncRead for Tracked {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.conn.advance(IDLE, HEAD);
        }
        polled
    }
}

impl AsyncWrite for Tracked {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn table(max: usize) -> Arc<ApiConnections> {
        ApiConnections::new(ApiLimits {
            max_connections: max,
            ..ApiLimits::default()
        })
    }

    #[test]
    fn at_the_cap_the_oldest_unfinished_connection_makes_room() {
        let t = table(3);
        let a = t.admit().unwrap();
        let b = t.admit().unwrap();
        let c = t.admit().unwrap();
        // a completed a request and idles; b is half-sent; c is busy.
        a.completed_requests.store(1, Ordering::Relaxed);
        a.enter(IDLE);
        c.enter(BUSY);
        let d = t.admit().unwrap();
        let open: Vec<u64> = t.lock().keys().copied().collect();
        assert_eq!(
            open,
            vec![a.seq, c.seq, d.seq],
            "b, never complete, goes first"
        );
        assert!(!open.contains(&b.seq));
        // Next: d (never complete, not busy).
        let e = t.admit().unwrap();
        let open: Vec<u64> = t.lock().keys().copied().collect();
        assert_eq!(open, vec![a.seq, c.seq, e.seq]);
        // With e busy too, the idle a is the only one not busy.
        e.enter(BUSY);
        let f = t.admit().unwrap();
        let open: Vec<u64> = t.lock().keys().copied().collect();
        assert_eq!(open, vec![c.seq, e.seq, f.seq]);
        // All busy: the new one is refused, nobody is evicted.
        f.enter(BUSY);
        assert!(t.admit().is_none());
        let view = t.view();
        assert_eq!((view.evicted_total, view.refused_total), (3, 1));
    }

    #[test]
    fn phases_have_their_own_deadlines() {
        let t = table(1);
        let limits = t.limits().clone();
        let c = t.admit().unwrap();
        let head = c.deadline(&limits).unwrap();
        c.enter(BODY);
        let body = c.deadline(&limits).unwrap();
        assert!(body > head, "the body limit is the longer one");
        c.enter(BUSY);
        assert!(c.deadline(&limits).is_none(), "a handler is never cut");
        c.enter(IDLE);
        assert!(c.deadline(&limits).unwrap() > body);
        // The body end only moves a connection in the body phase.
        c.advance(BODY, BUSY);
        assert!(!c.busy());
    }
}

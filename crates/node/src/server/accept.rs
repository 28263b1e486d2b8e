//! The NBD accept loops, one per listener (TCP, the Unix socket): each takes connections off
//! its listener, admits them under the connection limits (logging refusals and evictions at a
//! bounded rate), backs off when `accept` itself fails, and runs each admitted connection as
//! a session, on a connection thread when there are some. A Unix client is admitted by its
//! kernel credentials (`SO_PEERCRED`) and, if `[server] nbd_unix_tenants` maps its uid,
//! negotiates as that tenant; from there on both doors run the same session.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::NodeError;
use super::unix_socket::SocketFile;
use crate::admission::{Admitted, Connections};
use crate::net_threads::NetThreads;
use crate::origin::{LocalPeer, Origin};
use crate::session::{SessionContext, SessionError, serve_connection};

/// A listener NBD clients come in by.
#[derive(Debug)]
pub(super) enum Door {
    Tcp(TcpListener),
    Unix(UnixDoor),
}

/// The Unix socket: its listener, its file (removed when the loop ends) and the uid map.
#[derive(Debug)]
pub(super) struct UnixDoor {
    pub(super) listener: UnixListener,
    /// Held, never read: dropping it with the door removes the socket file.
    pub(super) _file: SocketFile,
    /// The tenant each mapped local uid acts for (`UnixSocketConfig::tenants`).
    pub(super) tenants: BTreeMap<u32, String>,
}

/// An accepted socket.
enum Conn {
    Tcp(TcpStream),
    Unix(UnixStream),
}

/// An accepted socket off its reactor, on its way to a connection thread.
enum StdConn {
    Tcp(std::net::TcpStream),
    Unix(std::os::unix::net::UnixStream),
}

impl Conn {
    fn into_std(self) -> std::io::Result<StdConn> {
        match self {
            Conn::Tcp(s) => s.into_std().map(StdConn::Tcp),
            Conn::Unix(s) => s.into_std().map(StdConn::Unix),
        }
    }
}

impl StdConn {
    fn into_tokio(self) -> std::io::Result<Conn> {
        match self {
            StdConn::Tcp(s) => TcpStream::from_std(s).map(Conn::Tcp),
            StdConn::Unix(s) => UnixStream::from_std(s).map(Conn::Unix),
        }
    }
}

/// One connection off a listener: `Err` of the outer result is the listener's failure
/// (backed off), of the inner one the connection's alone (it is dropped).
type Accepted = std::io::Result<std::io::Result<(Conn, Origin, Option<String>)>>;

impl Door {
    async fn accept(&self) -> Accepted {
        match self {
            Door::Tcp(listener) => {
                let (stream, addr) = listener.accept().await?;
                Ok(Ok((Conn::Tcp(stream), Origin::Tcp(addr), None)))
            }
            Door::Unix(door) => {
                let (stream, _) = door.listener.accept().await?;
                Ok(stream.peer_cred().map(|cred| {
                    let peer = LocalPeer {
                        uid: cred.uid(),
                        gid: cred.gid(),
                        pid: cred.pid(),
                    };
                    let tenant = door.tenants.get(&peer.uid).cloned();
                    (Conn::Unix(stream), Origin::Unix(peer), tenant)
                }))
            }
        }
    }
}

/// What [`spawn`] started: the accept loops' tasks, the connection threads (which the
/// vhost-user queues share: they end once this and every loop are dropped), what the API
/// reads of them, and what says when they have ended (none without them).
pub(super) struct Accepting {
    pub(super) tasks: Vec<JoinHandle<()>>,
    pub(super) net_threads: Option<Arc<NetThreads>>,
    pub(super) connection_threads: crate::net_threads::OpenConnections,
    pub(super) threads_ended: Option<crate::net_threads::ThreadsEnded>,
}

/// Starts the connection threads (`net_threads`; 0: connections share the runtime) and an
/// accept loop per door. The threads end once every loop has.
pub(super) fn spawn(
    doors: Vec<Door>,
    ctx: Arc<SessionContext>,
    connections: Arc<Connections>,
    stop: watch::Receiver<bool>,
    net_threads: usize,
) -> Result<Accepting, NodeError> {
    let (net_threads, threads_ended) = match net_threads {
        0 => (None, None),
        n => {
            let (threads, ended) = NetThreads::start(n).map_err(NodeError::Workers)?;
            (Some(Arc::new(threads)), Some(ended))
        }
    };
    let connection_threads = net_threads
        .as_deref()
        .map(NetThreads::open_connections)
        .unwrap_or_default();
    match &net_threads {
        Some(t) => tracing::info!(
            "connection threads: {} (each connection stays on one)",
            t.len()
        ),
        None => tracing::info!("connection threads: none (connections share the runtime)"),
    }
    let tasks = doors
        .into_iter()
        .map(|door| {
            tokio::spawn(accept_loop(
                door,
                Arc::clone(&ctx),
                Arc::clone(&connections),
                stop.clone(),
                net_threads.clone(),
            ))
        })
        .collect();
    Ok(Accepting {
        tasks,
        net_threads,
        connection_threads,
        threads_ended,
    })
}

async fn accept_loop(
    door: Door,
    ctx: Arc<SessionContext>,
    connections: Arc<Connections>,
    mut stop: watch::Receiver<bool>,
    // Dropped when the last loop ends: the threads then close their connections and end.
    net_threads: Option<Arc<NetThreads>>,
) {
    let mut backoff = AcceptBackoff::default();
    let mut refusals = Sampled::default();
    let mut evictions = Sampled::default();
    loop {
        let accepted = tokio::select! {
            accepted = door.accept() => accepted,
            _ = stop.changed() => break,
        };
        let (stream, peer, tenant) = match accepted {
            Ok(Ok(accepted)) => {
                backoff.succeeded();
                accepted
            }
            Ok(Err(err)) => {
                // The peer's credentials could not be read: that connection alone is lost.
                tracing::info!("dropped a connection on the NBD socket: {err}");
                continue;
            }
            Err(err) => {
                connections.note_accept_error();
                // EMFILE and friends: keep serving the connections we have, and try again
                // later instead of spinning on a listener that stays readable.
                if let Some(delay) = backoff.failed(&err) {
                    tokio::select! {
                        () = tokio::time::sleep(delay) => {}
                        _ = stop.changed() => break,
                    }
                }
                continue;
            }
        };
        let admitted = match connections.admit(peer.clone()) {
            Ok(admitted) => admitted.with_local_tenant(tenant),
            Err(refusal) => {
                if let Some(more) = refusals.sample() {
                    tracing::warn!("refusing {peer}: {refusal} ({more} more refused before)");
                }
                drop(stream);
                continue;
            }
        };
        if let Some(evicted) = &admitted.evicted
            && let Some(more) = evictions.sample()
        {
            tracing::info!(
                "closed {evicted}, still negotiating, to make room for {peer} ({more} more evicted before)"
            );
        }
        let ctx = Arc::clone(&ctx);
        let Some(threads) = &net_threads else {
            tokio::spawn(run_session(stream, peer, ctx, admitted));
            continue;
        };
        // The socket moves to the chosen thread's reactor: deregistered here, registered there.
        let stream = match stream.into_std() {
            Ok(stream) => stream,
            Err(err) => {
                tracing::info!("session with {peer} ended: {err}");
                continue;
            }
        };
        let shown = peer.clone();
        let placed = threads.spawn(move || async move {
            match stream.into_tokio() {
                Ok(stream) => run_session(stream, peer, ctx, admitted).await,
                Err(err) => tracing::info!("session with {peer} ended: {err}"),
            }
        });
        if placed.is_none() {
            tracing::error!("no connection thread took {shown}: closed");
        }
    }
}

/// One connection from admission to close, on whichever thread runs it.
async fn run_session(stream: Conn, peer: Origin, ctx: Arc<SessionContext>, admitted: Admitted) {
    let shared = Arc::clone(admitted.shared());
    let served = match stream {
        Conn::Tcp(stream) => {
            if let Err(err) = stream.set_nodelay(true) {
                tracing::info!("session with {peer} ended: {}", SessionError::from(err));
                return;
            }
            tokio::select! {
                served = serve_connection(stream, ctx, &admitted) => served,
                () = shared.evicted() => Err(SessionError::Evicted),
            }
        }
        Conn::Unix(stream) => tokio::select! {
            served = serve_connection(stream, ctx, &admitted) => served,
            () = shared.evicted() => Err(SessionError::Evicted),
        },
    };
    match served {
        Ok(()) => {}
        Err(SessionError::Evicted) => {
            tracing::debug!("session with {peer} ended: {}", SessionError::Evicted);
        }
        Err(err) => tracing::info!("session with {peer} ended: {err}"),
    }
    drop(admitted);
}

/// Delays between failed `accept` calls: none for errors of one connection (it was reset or
/// aborted before we took it), otherwise 10 ms doubling to 1 s until one succeeds. Logs once
/// when a run of failures starts and once when it ends.
#[derive(Debug, Default)]
struct AcceptBackoff {
    failures: u64,
    delay: Option<Duration>,
    since: Option<Instant>,
}

const ACCEPT_BACKOFF_FIRST: Duration = Duration::from_millis(10);
const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);

impl AcceptBackoff {
    fn failed(&mut self, err: &std::io::Error) -> Option<Duration> {
        use std::io::ErrorKind;
        if matches!(
            err.kind(),
            ErrorKind::ConnectionAborted | ErrorKind::ConnectionReset | ErrorKind::Interrupted
        ) {
            tracing::debug!("accept failed: {err}");
            return None;
        }
        self.failures += 1;
        let delay = match self.delay {
            None => {
                tracing::warn!(
                    "accept failed: {err}; retrying after 10 ms, doubling up to 1 s, until it \
                     works (open connections are served meanwhile)"
                );
                self.since = Some(Instant::now());
                ACCEPT_BACKOFF_FIRST
            }
            Some(delay) => (delay * 2).min(ACCEPT_BACKOFF_MAX),
        };
        self.delay = Some(delay);
        Some(delay)
    }

    fn succeeded(&mut self) {
        if self.failures > 0 {
            let ms = self.since.map_or(0, |t| t.elapsed().as_millis());
            tracing::warn!(
                "accept works again after {} failed attempts in {ms} ms",
                self.failures
            );
        }
        *self = AcceptBackoff::default();
    }
}

/// Logs the first of a run of events and then at most one per second, with the count of those
/// not logged, so a flood of connections cannot flood the log.
#[derive(Debug, Default)]
struct Sampled {
    last: Option<Instant>,
    unlogged: u64,
}

impl Sampled {
    /// `Some(events not logged since the last one logged)` when this one should be logged.
    fn sample(&mut self) -> Option<u64> {
        let now = Instant::now();
        match self.last {
            Some(last) if now.duration_since(last) < Duration::from_secs(1) => {
                self.unlogged += 1;
                None
            }
            _ => {
                self.last = Some(now);
                Some(std::mem::take(&mut self.unlogged))
            }
        }
    }
}
